"""``heteroplane token``: make, list and revoke API tokens in the configured database.

``token create`` works whether the service is running or not: it brings the database to the
newest schema first (a no-op when it is there), stores the token's SHA-256, and prints the token
alone on stdout (it is shown this once), so that ``TOKEN=$(heteroplane token create --scope
admin)`` captures it. Scopes are described in ``controlplane.policies.auth`` and docs/service.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from controlplane.cli.db import add_config_option
from controlplane.cli.output import emit
from controlplane.db.store import Store, TokenRecord
from controlplane.policies.auth import Scope
from controlplane.settings import load_settings

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "token",
        help="make, list and revoke API tokens",
        description="API tokens for the service's REST API, stored as SHA-256 hashes in the"
        " configured database.",
    )
    actions = parser.add_subparsers(dest="token_command", metavar="ACTION")
    actions.required = True

    create = actions.add_parser(
        "create", help="make a token and print it (alone, on stdout; shown once)"
    )
    create.add_argument(
        "--scope",
        required=True,
        choices=[scope.value for scope in Scope],
        help="admin > operator > viewer; infer: only the inference route",
    )
    create.add_argument("--name", metavar="NAME", help="a name for the token (default: random)")
    create.set_defaults(handler=_create)

    listing = actions.add_parser("list", help="list tokens (names, scopes, use; never tokens)")
    listing.set_defaults(handler=_list)

    revoke = actions.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("--name", required=True, metavar="NAME", help="the token's name")
    revoke.set_defaults(handler=_revoke)

    for action in (create, listing, revoke):
        add_config_option(action)
        action.add_argument("--json", action="store_true", help="print one JSON object")


def _store(args: argparse.Namespace) -> Store:
    settings = load_settings(args.config)
    return Store.from_url(settings.database_url, upgrade=True)


def _create(args: argparse.Namespace) -> int:
    store = _store(args)
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


def _list(args: argparse.Namespace) -> int:
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


def _revoke(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        record = store.revoke_token(args.name)
    finally:
        store.close()
    data = _document(record)
    return emit(args.json, data, lambda: f"token {record.name!r} revoked at {data['revoked_at']}")
