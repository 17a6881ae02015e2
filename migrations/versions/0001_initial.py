"""The control plane's tables: apps, budget changes, plans, instances and their events, decisions,
metric samples, API tokens.

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00

Written by hand from controlplane/db/models.py; tests/integration/test_migrations.py checks that
the two agree (an autogenerate comparison after upgrading comes out empty) on SQLite and
PostgreSQL. ``apps.applied_plan_id`` and ``plans.app_id`` point at each other: on PostgreSQL the
first constraint is added once both tables exist; SQLite checks foreign keys only when rows are
written, so it takes the constraint inline (it cannot add one to an existing table).
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_STATES = "'requested', 'pending', 'running', 'draining', 'terminating', 'terminated', 'failed'"


def _at(name: str, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    sqlite = op.get_context().dialect.name == "sqlite"
    applied_plan_fk = (
        [
            sa.ForeignKeyConstraint(
                ["applied_plan_id"],
                ["plans.id"],
                name=op.f("fk_apps_applied_plan_id_plans"),
                ondelete="SET NULL",
            )
        ]
        if sqlite
        else []
    )
    op.create_table(
        "apps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("budget_usd_per_hr", sa.Float(), nullable=False),
        sa.Column("applied_plan_id", sa.Integer(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        _at("created_at"),
        _at("updated_at"),
        sa.CheckConstraint("budget_usd_per_hr > 0", name=op.f("ck_apps_budget_positive")),
        sa.CheckConstraint("version >= 1", name=op.f("ck_apps_version_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_apps")),
        sa.UniqueConstraint("name", name=op.f("uq_apps_name")),
        *applied_plan_fk,
    )
    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("app_version", sa.Integer(), nullable=False),
        _at("created_at"),
        _at("applied_at", nullable=True),
        sa.CheckConstraint(
            "status IN ('previewed', 'applied', 'superseded')", name=op.f("ck_plans_status")
        ),
        sa.ForeignKeyConstraint(
            ["app_id"], ["apps.id"], name=op.f("fk_plans_app_id_apps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plans")),
        sa.UniqueConstraint("app_id", "number", name=op.f("uq_plans_app_id_number")),
    )
    if not sqlite:
        op.create_foreign_key(
            op.f("fk_apps_applied_plan_id_plans"),
            "apps",
            "plans",
            ["applied_plan_id"],
            ["id"],
            ondelete="SET NULL",
        )
    op.create_table(
        "budget_changes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("who", sa.String(length=100), nullable=False),
        _at("at"),
        sa.Column("old_usd_per_hr", sa.Float(), nullable=True),
        sa.Column("new_usd_per_hr", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["app_id"], ["apps.id"], name=op.f("fk_budget_changes_app_id_apps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_changes")),
    )
    op.create_index(
        op.f("ix_budget_changes_app_id_at"), "budget_changes", ["app_id", "at"], unique=False
    )
    op.create_table(
        "instances",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=100), nullable=False),
        sa.Column("provider_id", sa.String(length=64), nullable=True),
        sa.Column("instance_type", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("price_usd_per_hr", sa.Float(), nullable=False),
        _at("created_at"),
        _at("updated_at"),
        sa.CheckConstraint(f"state IN ({_STATES})", name=op.f("ck_instances_state")),
        sa.ForeignKeyConstraint(
            ["app_id"], ["apps.id"], name=op.f("fk_instances_app_id_apps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instances")),
        sa.UniqueConstraint("provider_id", name=op.f("uq_instances_provider_id")),
        sa.UniqueConstraint("request_id", name=op.f("uq_instances_request_id")),
    )
    op.create_index(
        op.f("ix_instances_app_id_state"), "instances", ["app_id", "state"], unique=False
    )
    op.create_table(
        "instance_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("instance_id", sa.String(length=64), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        _at("at"),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["instance_id"],
            ["instances.id"],
            name=op.f("fk_instance_events_instance_id_instances"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_instance_events")),
    )
    op.create_index(
        op.f("ix_instance_events_instance_id_at"),
        "instance_events",
        ["instance_id", "at"],
        unique=False,
    )
    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        _at("at"),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("numbers", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["app_id"], ["apps.id"], name=op.f("fk_decisions_app_id_apps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_decisions")),
    )
    op.create_index(op.f("ix_decisions_app_id_at"), "decisions", ["app_id", "at"], unique=False)
    op.create_table(
        "metric_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("app_id", sa.Integer(), nullable=False),
        _at("at"),
        sa.Column("arrival_rate_qps", sa.Float(), nullable=False),
        sa.Column("latency_p50_ms", sa.Float(), nullable=True),
        sa.Column("latency_p95_ms", sa.Float(), nullable=True),
        sa.Column("latency_p99_ms", sa.Float(), nullable=True),
        sa.Column("attainment_share", sa.Float(), nullable=True),
        sa.Column("fleet_cost_usd_per_hr", sa.Float(), nullable=False),
        sa.Column("gear", sa.String(length=64), nullable=True),
        sa.Column("accuracy", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["app_id"], ["apps.id"], name=op.f("fk_metric_samples_app_id_apps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metric_samples")),
    )
    op.create_index(
        op.f("ix_metric_samples_app_id_at"), "metric_samples", ["app_id", "at"], unique=False
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        _at("created_at"),
        _at("revoked_at", nullable=True),
        _at("last_used_at", nullable=True),
        sa.CheckConstraint(
            "scope IN ('admin', 'operator', 'viewer', 'infer')", name=op.f("ck_api_tokens_scope")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_api_tokens_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
    op.drop_index(op.f("ix_metric_samples_app_id_at"), table_name="metric_samples")
    op.drop_table("metric_samples")
    op.drop_index(op.f("ix_decisions_app_id_at"), table_name="decisions")
    op.drop_table("decisions")
    op.drop_index(op.f("ix_instance_events_instance_id_at"), table_name="instance_events")
    op.drop_table("instance_events")
    op.drop_index(op.f("ix_instances_app_id_state"), table_name="instances")
    op.drop_table("instances")
    op.drop_index(op.f("ix_budget_changes_app_id_at"), table_name="budget_changes")
    op.drop_table("budget_changes")
    if op.get_context().dialect.name != "sqlite":
        op.drop_constraint(op.f("fk_apps_applied_plan_id_plans"), "apps", type_="foreignkey")
    op.drop_table("plans")
    op.drop_table("apps")
