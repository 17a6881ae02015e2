"""Several serving processes on one database: ``app_dispatchers``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29 04:00:00

One row per app that a serving process dispatches (``ON DELETE CASCADE`` with the app): the
owner's random id, the URL the other serving processes forward the app's inference requests
to, and when the owner's lease ends (docs/service.md, "Several serving processes"). Written by
hand from controlplane/db/models.py; tests/integration/test_migrations.py checks that the two
agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "app_dispatchers",
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["app_id"],
            ["apps.id"],
            name=op.f("fk_app_dispatchers_app_id_apps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("app_id", name=op.f("pk_app_dispatchers")),
    )


def downgrade() -> None:
    op.drop_table("app_dispatchers")
