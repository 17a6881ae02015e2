"""The migrations on real databases (a SQLite file and a throwaway PostgreSQL server): empty ->
head -> base -> head, and the models and the migrations describe the same schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from controlplane.db import migrate
from controlplane.db.models import Base
from controlplane.db.session import make_engine

TABLES = {
    "apps",
    "budget_changes",
    "plans",
    "instances",
    "instance_events",
    "decisions",
    "metric_samples",
    "api_tokens",
}


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def schema_diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    assert migrate.current(database_url) is None
    migrate.upgrade(database_url)
    assert migrate.current(database_url) == migrate.head() == "0001"
    assert migrate.is_up_to_date(database_url)
    assert tables(database_url) == TABLES
    migrate.downgrade(database_url, "base")
    assert migrate.current(database_url) is None
    assert tables(database_url) == set()
    migrate.upgrade(database_url, "head")
    assert tables(database_url) == TABLES


def test_models_and_migrations_agree(database_url: str) -> None:
    migrate.upgrade(database_url)
    assert schema_diff(database_url) == []


def test_the_models_cover_every_table() -> None:
    assert set(Base.metadata.tables) == TABLES
