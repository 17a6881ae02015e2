"""Models a user brings: ``model_versions`` (the registry) and ``app_profiles``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 00:00:00

``model_versions``: one immutable row per pushed version of a model (``heteroplane model push``,
:mod:`controlplane.registry`): its name and version (unique together: of two concurrent pushes
that picked the same next version, one insert fails and that push retries), format, the sha256
and size of its file, its signature (inputs and outputs as JSON) and the blob's URI. Models are
not owned by apps; an app's spec names them.

``app_profiles``: the latency profiles measured for an app (``heteroplane profile run``), one
profile JSON document per app, deleted with the app (``ON DELETE CASCADE``, as the other app
tables). Written by hand from controlplane/db/models.py; tests/integration/test_migrations.py
checks that the two agree.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("signature", sa.JSON(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("version >= 1", name=op.f("ck_model_versions_version_positive")),
        sa.CheckConstraint("size_bytes >= 0", name=op.f("ck_model_versions_size_non_negative")),
        sa.CheckConstraint(
            "format IN ('onnx', 'torchscript')", name=op.f("ck_model_versions_format")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_model_versions_name_version")),
    )
    op.create_table(
        "app_profiles",
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["app_id"],
            ["apps.id"],
            name=op.f("fk_app_profiles_app_id_apps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("app_id", name=op.f("pk_app_profiles")),
    )


def downgrade() -> None:
    op.drop_table("app_profiles")
    op.drop_table("model_versions")
