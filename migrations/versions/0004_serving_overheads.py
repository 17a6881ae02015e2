"""The control plane's measured overhead per query: ``serving_overheads``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 00:00:00

One row per app: the median time (ms) from the API's receipt of a query to its dispatch queue,
as the serving loop measured it over ``samples`` answered queries
(controlplane/loops/calibration.py). The planner adds it to every query's simulated latency. Written
by hand from controlplane/db/models.py; tests/integration/test_migrations.py checks that the two
agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "serving_overheads",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("overhead_ms", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "overhead_ms >= 0", name=op.f("ck_serving_overheads_overhead_ms_non_negative")
        ),
        sa.ForeignKeyConstraint(
            ["app_id"],
            ["apps.id"],
            name=op.f("fk_serving_overheads_app_id_apps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_overheads")),
        sa.UniqueConstraint("app_id", name=op.f("uq_serving_overheads_app_id")),
    )


def downgrade() -> None:
    op.drop_table("serving_overheads")
