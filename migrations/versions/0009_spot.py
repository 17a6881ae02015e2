"""Spot capacity: ``instances`` gains ``market``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29 00:00:00

``market`` (text, not null, ``on-demand`` for every row written before): the purchase option an
instance was launched with, ``on-demand`` or ``spot`` (docs/spot.md). The reconciler launches a
plan's ``spot_fleet`` on spot and counts what it has of each. Written by hand from
controlplane/db/models.py; tests/integration/test_migrations.py checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(
            sa.Column("market", sa.String(length=16), nullable=False, server_default="on-demand")
        )


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("market")
