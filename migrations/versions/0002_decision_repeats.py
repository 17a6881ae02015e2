"""Repeated decisions: ``decisions.key``, ``decisions.count`` and ``decisions.last_at``.

Revision ID: 0002
Revises: 0001
Create Date: 2025-06-01 00:00:00

A decision recorded with a key (the caller's identity of "the same decision") that repeats is
kept as one row: ``count`` says how many times it was made, ``at`` the first time and
``last_at`` the last (None while it was made once). Existing rows get ``count`` 1. The index on
``(app_id, kind, key)`` finds the row to merge into. Batch mode so that SQLite (which cannot
alter a table in place) rebuilds the table; PostgreSQL alters it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.add_column(sa.Column("key", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("count", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("last_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index(
            op.f("ix_decisions_app_id_kind_key"), ["app_id", "kind", "key"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_index(op.f("ix_decisions_app_id_kind_key"))
        batch.drop_column("last_at")
        batch.drop_column("count")
        batch.drop_column("key")
