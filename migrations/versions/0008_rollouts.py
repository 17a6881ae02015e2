"""Rollouts of new model versions into running apps: ``rollouts``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29 00:00:00

``rollouts``: one row per rollout (docs/rollouts.md): the app (``ON DELETE CASCADE``), the
app's model it changes and the registry model behind it (``artifact``), the version served
before and the one rolled out, the state (pending, running, paused, promoted, rolled_back,
aborted: ``controlplane.policies.rollout.TRANSITIONS``), the current step and when it began
(a restart judges the step from there), the settings (steps, interval, shadow, thresholds, the
extra fleet and its cost), the last figures per version, the reason of the last move and who
started it. Written by hand from controlplane/db/models.py; tests/integration/test_migrations.py
checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=63), nullable=False),
        sa.Column("artifact", sa.String(length=63), nullable=False),
        sa.Column("from_version", sa.Integer(), nullable=False),
        sa.Column("to_version", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("figures", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("who", sa.String(length=100), nullable=False),
        sa.Column("step_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'paused', 'promoted', 'rolled_back', 'aborted')",
            name=op.f("ck_rollouts_state"),
        ),
        sa.CheckConstraint("to_version >= 1", name=op.f("ck_rollouts_to_version_positive")),
        sa.ForeignKeyConstraint(
            ["app_id"], ["apps.id"], name=op.f("fk_rollouts_app_id_apps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
    )
    op.create_index(op.f("ix_rollouts_app_id_state"), "rollouts", ["app_id", "state"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_rollouts_app_id_state"), table_name="rollouts")
    op.drop_table("rollouts")
