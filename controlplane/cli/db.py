"""``heteroplane db``: migrate the service's database (``upgrade``, ``downgrade``, ``current``).

The database is the one the settings name (``HETEROPLANE_DATABASE_URL``, or the config file's
``database_url``; by default a SQLite file in the data directory; docs/service.md). Migrations
live in the repository's ``migrations/`` (Alembic; ``controlplane.db.migrate``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from controlplane.cli.output import emit
from controlplane.db import migrate
from controlplane.db.session import redact_url
from controlplane.settings import load_settings

__all__ = ["add_config_option", "register"]


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="settings YAML (default: $HETEROPLANE_CONFIG; HETEROPLANE_* variables win over it)",
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "db",
        help="migrate the service's database (upgrade, downgrade, current)",
        description="Bring the configured database (SQLite or PostgreSQL) to a schema revision,"
        " or say which revision it is at.",
    )
    actions = parser.add_subparsers(dest="db_command", metavar="ACTION")
    actions.required = True

    upgrade = actions.add_parser(
        "upgrade", help="migrate up to a revision (default: the newest, 'head')"
    )
    upgrade.add_argument("--revision", default="head", metavar="R", help="target (default head)")
    upgrade.set_defaults(handler=_upgrade)

    downgrade = actions.add_parser(
        "downgrade", help="migrate down to a revision ('base' drops every table)"
    )
    downgrade.add_argument("--revision", required=True, metavar="R", help="target revision")
    downgrade.set_defaults(handler=_downgrade)

    current = actions.add_parser("current", help="print the revision the database is at")
    current.set_defaults(handler=_current)

    for action in (upgrade, downgrade, current):
        add_config_option(action)
        action.add_argument("--json", action="store_true", help="print one JSON object")


def _database_url(args: argparse.Namespace) -> str:
    settings = load_settings(args.config)
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


def _upgrade(args: argparse.Namespace) -> int:
    url = _database_url(args)
    before = migrate.current(url)
    migrate.upgrade(url, args.revision)
    data = {**_state(url), "previous_revision": before}
    return emit(args.json, data, lambda: _describe(data))


def _downgrade(args: argparse.Namespace) -> int:
    url = _database_url(args)
    before = migrate.current(url)
    migrate.downgrade(url, args.revision)
    data = {**_state(url), "previous_revision": before}
    return emit(args.json, data, lambda: _describe(data))


def _current(args: argparse.Namespace) -> int:
    data = _state(_database_url(args))
    return emit(args.json, data, lambda: _describe(data))
