"""The dashboard's server-side sign-ins: ``dashboard_sessions``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 00:00:00

One row per signed-in browser: the SHA-256 of the random session id its cookie holds (never the
API token), the token it signed in with (``ON DELETE CASCADE``; a revoked token's sessions are
refused by the store), when it was opened and when it ends. In the database so that every
replica of the API sees the same sign-ins (controlplane/dashboard/routes.py). Written by hand
from controlplane/db/models.py; tests/integration/test_migrations.py checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_hash", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "expires_at > created_at",
            name=op.f("ck_dashboard_sessions_expires_after_created"),
        ),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["api_tokens.id"],
            name=op.f("fk_dashboard_sessions_token_id_api_tokens"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dashboard_sessions")),
        sa.UniqueConstraint("session_hash", name=op.f("uq_dashboard_sessions_session_hash")),
    )
    op.create_index(
        op.f("ix_dashboard_sessions_token_id"), "dashboard_sessions", ["token_id"], unique=False
    )
    op.create_index(
        op.f("ix_dashboard_sessions_expires_at"),
        "dashboard_sessions",
        ["expires_at"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_dashboard_sessions_expires_at"), table_name="dashboard_sessions")
    op.drop_index(op.f("ix_dashboard_sessions_token_id"), table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
