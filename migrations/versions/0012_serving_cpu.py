"""The serving process's CPU per query beside the app's overhead: ``serving_overheads`` gains
``cpu_ms``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30 00:10:00

``cpu_ms`` (float, nullable): the serving process's CPU time per answered query, its idle share
taken off (``controlplane.serving.observations.CpuMeter``), as the calibration loop stored it
with the app's overhead: the planner serves each simulated query that long at the serving
process, a queue of its own in front of the workers. NULL: not measured (a row from before).
Written by hand from controlplane/db/models.py; tests/integration/test_migrations.py checks that
the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("serving_overheads") as batch:
        batch.add_column(sa.Column("cpu_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("serving_overheads") as batch:
        batch.drop_column("cpu_ms")
