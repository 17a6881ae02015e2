"""``heteroplane db``: migrate the service's database (``upgrade``, ``downgrade``, ``current``).

The database is the one the settings name (``HETEROPLANE_DATABASE_URL``, or the config file's
``database_url``; by default a SQLite file in the data directory; docs/service.md). Migrations
live in the repository's ``migrations/`` (Alembic; ``controlplane.db.migrate``).

``upgrade`` and ``downgrade`` are refused while a service runs on the database
(:func:`~controlplane.db.lease.schema_change_lock`): a downgrade dropped the tables under a live
``heteroplane serve``, and an upgrade puts a service on a schema newer than its code. An upgrade
with nothing to do (the database already at the newest revision) is not refused.
"""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.output import UsageError, emit
from controlplane.db import migrate
from controlplane.db.lease import schema_change_lock
from controlplane.db.session import is_in_memory_sqlite, redact_url
from controlplane.errors import SettingsError
from controlplane.settings import load_settings

__all__ = ["current", "downgrade", "upgrade"]


def _database_url(args: argparse.Namespace) -> str:
    """The configured database's URL; an in-memory SQLite one is refused: the command would
    migrate (or read) a database of its own, empty and gone when it exits, and say of an
    upgrade just done that the database has no tables."""
    settings = load_settings(args.config)
    if is_in_memory_sqlite(settings.database_url):
        raise SettingsError(
            "database_url",
            f"{settings.database_url} is an in-memory SQLite database: it exists only inside"
            " this command and is gone when it exits; use a file (sqlite:///PATH, the default"
            " under data_dir) or PostgreSQL",
        )
    return settings.database_url


def _state(url: str) -> dict[str, Any]:
    revision = migrate.current(url)
    head = migrate.head()
    return {
        "database": redact_url(url),
        "revision": revision,
        "head": head,
        "up_to_date": revision == head,
    }


def _describe(data: dict[str, Any]) -> str:
    revision = data["revision"]
    if revision is None:
        where = "has no tables (run: heteroplane db upgrade)"
    elif data["up_to_date"]:
        where = f"is at revision {revision} (the newest)"
    else:
        where = f"is at revision {revision}; the newest is {data['head']}"
    return f"database {data['database']} {where}"


def upgrade(args: argparse.Namespace) -> int:
    url = _database_url(args)
    before = migrate.current(url)
    if migrate.older_than(args.revision, before):
        # Alembic's upgrade to an older revision does nothing: it said the database was at its
        # revision, exit status 0, as if it had been moved.
        raise UsageError(
            f"cannot upgrade {redact_url(url)} to {args.revision}: it is at {before}, which is"
            f" newer; to go back: heteroplane db downgrade --revision {args.revision}"
        )
    if before != migrate.head() or args.revision not in ("head", before):
        with schema_change_lock(url, "upgrade"):
            before = migrate.current(url)
            migrate.upgrade(url, args.revision)
    data = {**_state(url), "previous_revision": before}
    return emit(args.json, data, lambda: _describe(data))


def downgrade(args: argparse.Namespace) -> int:
    url = _database_url(args)
    with schema_change_lock(url, "downgrade"):
        before = migrate.current(url)
        migrate.downgrade(url, args.revision)
    data = {**_state(url), "previous_revision": before}
    return emit(args.json, data, lambda: _describe(data))


def current(args: argparse.Namespace) -> int:
    data = _state(_database_url(args))
    return emit(args.json, data, lambda: _describe(data))
