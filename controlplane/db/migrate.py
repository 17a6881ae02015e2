"""Schema migrations: bring a database to a revision of ``migrations/`` (Alembic), or say where
it is.

The Alembic config is built here in code (no alembic.ini needed): its script location is the
repository's ``migrations/`` folder, found beside this package (an editable install, which is how
the project is installed; see docs/service.md). Every failure is a one-line
:class:`~controlplane.errors.DatabaseError` with the URL's password hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import URL, Engine
from sqlalchemy.exc import SQLAlchemyError

from controlplane.db.session import make_engine, parse_url, redact_url
from controlplane.errors import DatabaseError

__all__ = [
    "MIGRATIONS_DIR",
    "Target",
    "current",
    "downgrade",
    "head",
    "is_up_to_date",
    "older_than",
    "upgrade",
]

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


# A database to migrate: its URL (the usual case: the migration opens its own connection, with
# SQLite's foreign keys off), or an engine to migrate through (an in-memory SQLite database exists
# only inside its engine).
Target = str | URL | Engine


def _url(target: Target) -> URL:
    return target.url if isinstance(target, Engine) else parse_url(target)


def _config(target: Target) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise DatabaseError(
            f"the migrations are not at {MIGRATIONS_DIR}; install heteroplane from its"
            " repository (pip install -e .)"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Passed as an attribute, not a main option: configparser would read '%' in a password.
    config.attributes["url"] = _url(target).render_as_string(hide_password=False)
    return config


@contextmanager
def _reported(action: str, target: Target) -> Iterator[None]:
    try:
        yield
    except CommandError as error:
        raise DatabaseError(f"cannot {action} {redact_url(_url(target))}: {error}") from None
    except SQLAlchemyError as error:
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        raise DatabaseError(f"cannot {action} {redact_url(_url(target))}: {reason}") from None


def _run(target: Target, migrate: Callable[[Config], None]) -> None:
    config = _config(target)
    if not isinstance(target, Engine):
        migrate(config)
        return
    with target.connect() as connection:
        config.attributes["connection"] = connection
        migrate(config)


def _sqlite_file(target: Target) -> Path | None:
    url = _url(target)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(str(url.database))


def _check_revision(action: str, target: Target, revision: str) -> None:
    # Alembic fails an assertion (a traceback, not a CommandError) on an empty revision.
    if not revision.strip():
        raise DatabaseError(
            f"cannot {action} {redact_url(_url(target))}: no revision given ({revision!r})"
        )


def head() -> str:
    """The newest revision of ``migrations/``."""
    revision = ScriptDirectory.from_config(_config("sqlite://")).get_current_head()
    if revision is None:
        raise DatabaseError(f"no migrations in {MIGRATIONS_DIR}")
    return revision


def _check_known(action: str, target: Target) -> None:
    """A database at a revision ``migrations/`` does not know was migrated by a newer
    heteroplane: say so (Alembic said "Can't locate revision identified by '0099'")."""
    revision = current(target)
    if revision is None:
        return
    try:
        known = ScriptDirectory.from_config(_config("sqlite://")).get_revision(revision)
    except (CommandError, RevisionError):
        known = None
    if known is None:
        raise DatabaseError(
            f"cannot {action} {redact_url(_url(target))}: it is at revision {revision}, which"
            f" this heteroplane does not know (its newest is {head()}): a newer heteroplane"
            " migrated it; run that one, or its `heteroplane db downgrade --revision"
            f" {head()}` to come back"
        )


def upgrade(target: Target, revision: str = "head") -> None:
    """Migrate the database (its URL, or an engine) up to ``revision`` (default: the newest); a
    SQLite file is created, with its folder, when missing."""
    _check_revision("upgrade", target, revision)
    _check_known("upgrade", target)
    path = _sqlite_file(target)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DatabaseError(
                f"cannot create {path.parent} for {redact_url(_url(target))}:"
                f" {error.strerror or error}"
            ) from None
    with _reported("upgrade", target):
        _run(target, lambda config: command.upgrade(config, revision))


def older_than(revision: str, current: str | None) -> bool:
    """Whether ``revision`` (``base``, a revision or its unique prefix) comes before ``current``
    in the history: an upgrade to it does nothing (Alembic's upgrade only goes forward), where
    it is a downgrade the operator asked for. False for a name the history does not know
    (the upgrade then says so)."""
    if current is None:
        return False
    script = ScriptDirectory.from_config(_config("sqlite://"))
    try:
        target = script.get_revision(revision)
        if target is None:
            return revision.strip() == "base"
        return target.revision != current and any(
            step.revision == target.revision for step in script.iterate_revisions(current, "base")
        )
    except (CommandError, RevisionError):
        # A name the history does not know, or a database at a revision it does not know (a
        # newer heteroplane migrated it): the upgrade says which.
        return False


def downgrade(target: Target, revision: str) -> None:
    """Migrate the database down to ``revision`` (``base``: no tables at all)."""
    _check_revision("downgrade", target, revision)
    _check_known("downgrade", target)
    with _reported("downgrade", target):
        _run(target, lambda config: command.downgrade(config, revision))


def current(target: Target) -> str | None:
    """The revision the database is at; None for a database never migrated (a SQLite file that
    does not exist is left uncreated)."""
    path = _sqlite_file(target)
    if path is not None and not path.exists():
        return None
    with _reported("read the revision of", target):
        engine = target if isinstance(target, Engine) else make_engine(target)
        try:
            with engine.connect() as connection:
                return MigrationContext.configure(connection).get_current_revision()
        finally:
            if engine is not target:
                engine.dispose()


def is_up_to_date(target: Target) -> bool:
    """Whether the database is at the newest revision."""
    return current(target) == head()
