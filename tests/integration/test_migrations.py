"""The migrations on real databases (a SQLite file and a throwaway PostgreSQL server): empty ->
head -> base -> head, and the models and the migrations describe the same schema."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, inspect, text

from controlplane.cli import main
from controlplane.db import migrate
from controlplane.db.lease import (
    SERVING_APPLICATION_NAME,
    SERVING_LOCK_KEY,
    AdvisoryLock,
    schema_change_lock,
)
from controlplane.db.models import Base
from controlplane.db.session import make_engine
from controlplane.errors import DatabaseInUseError

# Every table the models declare: the migrations must create exactly these.
TABLES = set(Base.metadata.tables)
VERSIONS = Path(migrate.MIGRATIONS_DIR) / "versions"


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
    newest = max(p.name.split("_")[0] for p in VERSIONS.glob("[0-9]*_*.py"))
    assert migrate.current(database_url) == migrate.head() == newest
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


def decision_columns(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {column["name"] for column in inspect(engine).get_columns("decisions")}
    finally:
        engine.dispose()


def test_decision_repeats_upgrade_keeps_rows_and_downgrades(database_url: str) -> None:
    """0001 -> 0002 gives existing decisions count 1 and no key or last time; 0002 -> 0001 takes
    the three columns away again and keeps the rows."""
    migrate.upgrade(database_url, "0001")
    assert "count" not in decision_columns(database_url)
    engine = make_engine(database_url)
    at = datetime(2025, 1, 1, tzinfo=UTC)
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO apps (id, name, spec, budget_usd_per_hr, version, created_at,"
                    " updated_at) VALUES (1, 'recs', '{}', 1.0, 1, :at, :at)"
                ),
                {"at": at},
            )
            connection.execute(
                text(
                    "INSERT INTO decisions (app_id, at, kind, reason, numbers)"
                    " VALUES (1, :at, 'scale_up', 'load', '{}')"
                ),
                {"at": at},
            )
        migrate.upgrade(database_url, "0002")
        assert {"key", "count", "last_at"} <= decision_columns(database_url)
        with engine.connect() as connection:
            rows = connection.execute(text("SELECT key, count, last_at FROM decisions")).all()
        assert [tuple(row) for row in rows] == [(None, 1, None)]
        migrate.downgrade(database_url, "0001")
        assert not {"key", "count", "last_at"} & decision_columns(database_url)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM decisions")).scalar_one() == 1
    finally:
        engine.dispose()
    migrate.upgrade(database_url)
    assert schema_diff(database_url) == []


def test_the_models_cover_every_table() -> None:
    assert set(Base.metadata.tables) == TABLES


def _plan_ids(connection: Connection) -> list[int]:
    return list(connection.execute(text("SELECT id FROM plans ORDER BY id")).scalars())


def _add_plan(connection: Connection, number: int, at: datetime) -> None:
    connection.execute(
        text(
            "INSERT INTO plans (app_id, number, status, document, app_version, created_at)"
            " VALUES (1, :number, 'previewed', '{}', 1, :at)"
        ),
        {"number": number, "at": at},
    )


def test_ids_never_reused_after_0013(database_url: str) -> None:
    """A plan id freed by deleting the newest plan goes to the next plan at 0012 on SQLite (the
    rowid is the largest plus one) and never from 0013 on, with the rows kept through the
    rebuild and through its downgrade; PostgreSQL's sequences never reuse one at either."""
    migrate.upgrade(database_url, "0012")
    engine = make_engine(database_url)
    at = datetime(2025, 1, 1, tzinfo=UTC)
    sqlite = engine.dialect.name == "sqlite"
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO apps (name, spec, budget_usd_per_hr, version, created_at,"
                    " updated_at) VALUES ('recs', '{}', 1.0, 1, :at, :at)"
                ),
                {"at": at},
            )
            for number in (1, 2, 3):
                _add_plan(connection, number, at)
            first = _plan_ids(connection)
            connection.execute(text("DELETE FROM plans WHERE id = :id"), {"id": first[-1]})
            _add_plan(connection, 4, at)
            reused = _plan_ids(connection)[-1] == first[-1]
        assert reused == sqlite
        migrate.upgrade(database_url, "0013")
        with engine.begin() as connection:
            kept = _plan_ids(connection)
            assert len(kept) == 3
            connection.execute(text("DELETE FROM plans WHERE id = :id"), {"id": kept[-1]})
            _add_plan(connection, 5, at)
            assert _plan_ids(connection)[-1] > kept[-1]
        migrate.downgrade(database_url, "0012")
        with engine.connect() as connection:
            assert len(_plan_ids(connection)) == 3
    finally:
        engine.dispose()
    migrate.upgrade(database_url)
    assert schema_diff(database_url) == []


def test_sqlite_autoincrement_where_the_models_ask_for_it(tmp_path: Path) -> None:
    """The tables the models mark ``sqlite_autoincrement`` are the ones migration 0013 rebuilds,
    and a database migrated to head has AUTOINCREMENT on exactly those."""
    marked = {
        name
        for name, table in Base.metadata.tables.items()
        if table.dialect_options["sqlite"]["autoincrement"]
    }
    assert marked == {"apps", "plans", "rollouts", "model_versions", "api_tokens"}
    url = f"sqlite:///{tmp_path / 'heteroplane.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT name, sql FROM sqlite_master WHERE type = 'table'")
            ).all()
    finally:
        engine.dispose()
    assert {name for name, sql in rows if "AUTOINCREMENT" in sql} == marked


def test_no_schema_change_while_a_replica_runs_on_postgresql(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``heteroplane db downgrade`` dropped every table under live replicas. It is refused while
    a session holds the leader lease or the serving lock, or a standby's lease connection is
    open; otherwise it holds the leader lease itself, so no replica leads meanwhile."""
    for name in [n for n in os.environ if n.startswith("HETEROPLANE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HETEROPLANE_DATABASE_URL", postgres_url)
    migrate.upgrade(postgres_url)
    leader = AdvisoryLock(postgres_url)
    assert leader.try_acquire()
    with pytest.raises(SystemExit) as caught:
        main(["db", "downgrade", "--revision", "base"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs on it (a session holds its leader lease)" in err
    standby = AdvisoryLock(postgres_url)
    assert not standby.try_acquire()  # its connection stays open, to try again
    leader.close()
    with (
        pytest.raises(DatabaseInUseError, match=r"\(1 of its lease connections are open\)"),
        schema_change_lock(postgres_url, "downgrade"),
    ):
        pass
    standby.close()
    serving = AdvisoryLock(
        postgres_url, SERVING_LOCK_KEY, application_name=SERVING_APPLICATION_NAME
    )
    assert serving.try_acquire()
    with (
        pytest.raises(DatabaseInUseError, match="a session holds its serving lock"),
        schema_change_lock(postgres_url, "upgrade"),
    ):
        pass
    serving.close()
    assert tables(postgres_url) == TABLES
    with schema_change_lock(postgres_url, "downgrade"):
        starting = AdvisoryLock(postgres_url)
        assert not starting.try_acquire()  # a replica that starts meanwhile does not lead
        starting.close()
        migrate.downgrade(postgres_url, "base")
    assert tables(postgres_url) == set()
    leader = AdvisoryLock(postgres_url)
    assert leader.try_acquire()  # released with the command's session
    leader.close()
