"""The live round trips' spread beside the calibration's factor: ``profile_scales`` gains
``spread``.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29 19:00:00

``spread`` (JSON, nullable): the serving loop's observed round trips of the (app, model,
instance type), each over its batch size's mean, at
``controlplane.policies.calibration.OVERHEAD_QUANTILES`` (0, 1, ..., 100 %): the resolver gives
the profile's samples that shape about their calibrated means, so the planner's queue has the
live path's tail, not the profiler's. NULL: the profile's own spread. Written by hand from
controlplane/db/models.py; tests/integration/test_migrations.py checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("profile_scales") as batch:
        batch.add_column(sa.Column("spread", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("profile_scales") as batch:
        batch.drop_column("spread")
