"""A spot instance's price now beside its launch price: ``instances`` gains
``price_now_usd_per_hr``.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 13:30:00

``price_now_usd_per_hr`` (float, nullable): where the reconciler found a live spot instance's
type priced otherwise than the instance was launched at (rule 10, docs/spot.md), the price now;
the fleet route, the dashboard, ``/metrics``, the roll-up and the budget's checks cost the
instance at it. ``price_usd_per_hr`` stays the launch price (rule 10 reads a rise from it). NULL:
the launch price is the price now (every row from before). Written by hand from
controlplane/db/models.py; tests/integration/test_migrations.py checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("price_now_usd_per_hr", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("price_now_usd_per_hr")
