"""Online calibration: ``profile_scales``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 00:00:00

One row per (app, model, instance type) whose profile the calibration loop found off: ``factor``
is observed over profiled service time, and the app's resolved profiles are its profile files'
samples times it (controlplane/apps/resolver.py). Written by hand from
controlplane/db/models.py; tests/integration/test_migrations.py checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "profile_scales",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=100), nullable=False),
        sa.Column("instance_type", sa.String(length=64), nullable=False),
        sa.Column("factor", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("factor > 0", name=op.f("ck_profile_scales_factor_positive")),
        sa.ForeignKeyConstraint(
            ["app_id"],
            ["apps.id"],
            name=op.f("fk_profile_scales_app_id_apps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_profile_scales")),
        sa.UniqueConstraint(
            "app_id",
            "model",
            "instance_type",
            name=op.f("uq_profile_scales_app_id_model_instance_type"),
        ),
    )


def downgrade() -> None:
    op.drop_table("profile_scales")
