"""Ids that name things are never given twice on SQLite: ``apps``, ``plans``, ``rollouts``,
``model_versions`` and ``api_tokens`` are rebuilt with ``AUTOINCREMENT``.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 19:30:00

Without ``AUTOINCREMENT`` SQLite gives a new row the largest id in the table plus one, so the
ids of the newest rows deleted go to the next rows made: a plan id that a log line, a cache or a
script kept would name another app's plan (docs/status.md had it as "not true yet").
``AUTOINCREMENT`` keeps the largest id ever given in ``sqlite_sequence``; the rebuild seeds it
from the rows there are (an id freed before this migration can still come back once; none
after). PostgreSQL's sequences never give an id twice: nothing to do there. The rebuild copies
each table's columns, keys and CHECK constraints as they are (SQLite's foreign keys are off while
migrating: migrations/env.py), but for one thing: SQLite takes AUTOINCREMENT only on a key
declared on its column, so on SQLite these five primary keys have no constraint name (``pk_apps``
...) from here on, and the downgrade does not give the name back; a later migration must not
name them there. Written by hand from controlplane/db/models.py (their
``sqlite_autoincrement``); tests/integration/test_migrations.py checks both.
"""

from __future__ import annotations

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None

TABLES = ("apps", "plans", "rollouts", "model_versions", "api_tokens")


def _rebuild(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table in TABLES:
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}
        ):
            pass


def upgrade() -> None:
    _rebuild(True)


def downgrade() -> None:
    _rebuild(False)
