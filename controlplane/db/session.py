"""Engines, sessions and transactions over a database URL (SQLite or PostgreSQL).

SQLite is set up for a multi-threaded service: one connection per thread from the pool
(``check_same_thread=False`` so that a connection may be handed between threads), foreign keys on,
a busy timeout, and every transaction started with ``BEGIN IMMEDIATE``. The last one matters:
with SQLite's default deferred ``BEGIN``, two transactions that read and then write deadlock on
the upgrade from a shared to a write lock, and one fails at once with "database is locked"
whatever the timeout. ``BEGIN IMMEDIATE`` takes the write lock up front, so writers queue on the
busy timeout instead (the recipe in SQLAlchemy's SQLite dialect notes). A database file is in
write-ahead-log mode (``journal_mode=WAL``, kept in the file): ``heteroplane serve`` runs its
serving process and its loops process on the same file, and with the log a commit neither waits
for the other process's readers nor blocks them.

PostgreSQL URLs may say ``postgresql://`` (taken to mean psycopg 3, the driver this package
depends on) or ``postgresql+psycopg://``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from controlplane.errors import DatabaseError

__all__ = [
    "BUSY_TIMEOUT_S",
    "is_in_memory_sqlite",
    "is_sqlite",
    "make_engine",
    "make_session_factory",
    "missing_driver",
    "parse_url",
    "redact_url",
    "transaction",
]

# How long a SQLite writer waits for another's transaction before "database is locked".
BUSY_TIMEOUT_S = 30.0
# How long connecting to PostgreSQL may take before the command says the server is unreachable.
CONNECT_TIMEOUT_S = 10


def parse_url(url: str | URL) -> URL:
    """``url`` as a SQLAlchemy URL, ``postgresql://`` read as psycopg 3.

    Raises :class:`DatabaseError` for a URL that does not parse or names another database.
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseError(f"malformed database URL {redact_url(url)!r}") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseError(
            f"unsupported database {parsed.get_backend_name()!r} in {redact_url(parsed)!r};"
            " use sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DB"
        )
    return parsed


def redact_url(url: str | URL) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs)."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        # Not a URL at all: show the scheme only, since the rest may hold a password.
        return url.split("://", 1)[0] + "://..." if "://" in url else "<not a URL>"


def is_sqlite(url: str | URL) -> bool:
    return parse_url(url).get_backend_name() == "sqlite"


def is_in_memory_sqlite(url: str | URL) -> bool:
    """Whether ``url`` names an in-memory SQLite database (``sqlite://``,
    ``sqlite:///:memory:``), which every connection and process sees empty of its own and which
    is gone at exit."""
    parsed = parse_url(url)
    return parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:")


def make_engine(url: str | URL, *, foreign_keys: bool = True, echo: bool = False) -> Engine:
    """An engine for ``url`` with the settings in the module docstring.

    ``foreign_keys=False`` leaves SQLite's foreign keys off: migrations that rebuild a table
    (Alembic's batch mode) would otherwise cascade the rebuild's drop into the rows that point at
    it. It has no effect on PostgreSQL.
    """
    parsed = parse_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            return _sqlite_engine(parsed, foreign_keys=foreign_keys, echo=echo)
        return create_engine(
            parsed,
            echo=echo,
            pool_pre_ping=True,
            connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
        )
    except (ArgumentError, NoSuchModuleError) as error:
        raise DatabaseError(f"cannot use database {redact_url(parsed)!r}: {error}") from None
    except ModuleNotFoundError as error:
        raise missing_driver(parsed, error) from None


def missing_driver(url: URL, error: ModuleNotFoundError) -> DatabaseError:
    """The one-line error for a database whose driver is not installed: PostgreSQL's psycopg
    is the optional extra ``postgres``."""
    return DatabaseError(
        f"cannot use database {redact_url(url)!r}: its driver {error.name or 'psycopg'} is not"
        " installed; install heteroplane with PostgreSQL support: pip install"
        " 'heteroplane[postgres]'"
    )


def _sqlite_engine(url: URL, *, foreign_keys: bool, echo: bool) -> Engine:
    in_memory = url.database in (None, "", ":memory:")
    options: dict[str, Any] = {
        "echo": echo,
        "connect_args": {"check_same_thread": False, "timeout": BUSY_TIMEOUT_S},
    }
    if in_memory:
        # One connection shared by every thread, or each would see its own empty database.
        options["poolclass"] = StaticPool
    engine = create_engine(url, **options)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's BEGIN below start transactions, not the sqlite3 module.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
        cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if not in_memory:
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions on ``engine``; objects stay readable after commit (they never leave the store)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session in one transaction: committed when the block ends, rolled back if it raises."""
    with factory.begin() as session:
        yield session
