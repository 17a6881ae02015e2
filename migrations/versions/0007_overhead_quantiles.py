"""The control plane's measured overhead per query as a distribution: ``serving_overheads``
gains ``quantiles_ms``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 00:00:00

``quantiles_ms`` (JSON, nullable): the quantiles of the API's receipt-to-dispatch time at
``controlplane.policies.calibration.OVERHEAD_QUANTILES`` (0, 1, ..., 100 %), over the same
answered queries as the median in ``overhead_ms``: the planner draws each simulated query's
overhead from it, so the tail of the service's own time is in the predicted tail, not only its
median. NULL for a row written before (the planner then adds the median). Written by hand from
controlplane/db/models.py; tests/integration/test_migrations.py checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("serving_overheads") as batch:
        batch.add_column(sa.Column("quantiles_ms", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("serving_overheads") as batch:
        batch.drop_column("quantiles_ms")
