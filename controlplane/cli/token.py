"""``heteroplane token``: make, list and revoke API tokens in the configured database.

``token create`` works whether the service is running or not: it brings the database to the
newest schema first (a no-op when it is there), stores the token's SHA-256, and prints the token
alone on stdout (it is shown this once), so that ``TOKEN=$(heteroplane token create --scope
admin)`` captures it. Scopes are described in ``controlplane.policies.auth`` and docs/service.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from controlplane.cli.output import UsageError, emit
from controlplane.db.session import is_in_memory_sqlite, parse_url
from controlplane.db.store import Store, TokenRecord
from controlplane.errors import SettingsError
from controlplane.settings import load_settings

__all__ = ["create", "list_tokens", "revoke"]


def _store(args: argparse.Namespace, create: bool = False) -> Store:
    """The configured database (brought to the newest schema); without ``create`` (listing,
    revoking), a SQLite file that is not there is an error, not a new empty database made
    wherever the settings point."""
    settings = load_settings(args.config)
    if is_in_memory_sqlite(settings.database_url):
        # A token made there would be printed and then lost with the database at exit.
        raise SettingsError(
            "database_url",
            f"{settings.database_url} is an in-memory SQLite database: it exists only inside"
            " this command and is gone when it exits (a token made in it works nowhere); use"
            " the service's database (a file, sqlite:///PATH, the default under data_dir, or"
            " PostgreSQL)",
        )
    url = parse_url(settings.database_url)
    database = url.database
    on_file = url.get_backend_name() == "sqlite" and database not in (None, "", ":memory:")
    if not create and on_file and not Path(str(database)).is_file():
        raise UsageError(
            f"no database at {database} (the service makes it when it first starts;"
            " heteroplane token create makes it too): check database_url or --config"
        )
    return Store.from_url(settings.database_url, upgrade=True)


def create(args: argparse.Namespace) -> int:
    store = _store(args, create=True)
    try:
        token, record = store.issue_token(args.scope, args.name)
    finally:
        store.close()
    if args.json:
        return emit(True, {"token": token, "name": record.name, "scope": record.scope}, str)
    print(token)
    print(
        f"token {record.name!r} with scope {record.scope} created; it is shown only this once",
        file=sys.stderr,
    )
    return 0


def _document(record: TokenRecord) -> dict[str, Any]:
    def when(value: Any) -> str | None:
        return None if value is None else value.isoformat()

    return {
        "name": record.name,
        "scope": record.scope,
        "created_at": when(record.created_at),
        "last_used_at": when(record.last_used_at),
        "revoked_at": when(record.revoked_at),
    }


def list_tokens(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        tokens = [_document(record) for record in store.list_tokens()]
    finally:
        store.close()

    def human() -> str:
        if not tokens:
            return "no tokens (make one: heteroplane token create --scope admin)"
        lines = []
        for t in tokens:
            state = f"revoked {t['revoked_at']}" if t["revoked_at"] else "active"
            used = f"last used {t['last_used_at']}" if t["last_used_at"] else "never used"
            lines.append(f"{t['name']}: {t['scope']}, {state}, {used}")
        return "\n".join(lines)

    return emit(args.json, {"tokens": tokens}, human)


def revoke(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        record = store.revoke_token(args.name)
    finally:
        store.close()
    data = _document(record)
    return emit(args.json, data, lambda: f"token {record.name!r} revoked at {data['revoked_at']}")
