"""The database's side of "who runs the background jobs": the leader lock on PostgreSQL, the
one-process rule on SQLite.

- **PostgreSQL** (:class:`AdvisoryLock`): a *session-level* advisory lock
  (``pg_try_advisory_lock(key)``) taken on a connection of its own, kept open and out of any pool.
  PostgreSQL holds such a lock for as long as the session lives and releases it when the session
  ends, however it ends: an unlock, a clean close, or the client's death (``kill -9``: the kernel
  closes the socket, the server's backend reads end-of-file and exits). So the lock is exactly
  "this process is alive and connected", with no home-made protocol over a table, no clock
  comparison to trust. :meth:`AdvisoryLock.check` runs ``SELECT 1`` on that connection: while
  it answers, the session (hence the lock) is ours. The connection has TCP keepalives and a TCP
  user timeout, so a check on a connection the network has silently dropped fails within seconds
  instead of hanging; and the server ends the session once it has been idle
  :data:`LOCK_IDLE_SESSION_TIMEOUT_S` (``idle_session_timeout``, PostgreSQL 14+), which frees the
  lock of a leader that stopped checking (frozen, or cut off) while its socket still looks open.
- **PostgreSQL migrations** (:func:`migration_lock`): a second advisory key, taken with the
  blocking ``pg_advisory_lock`` around ``alembic upgrade``, so replicas that start together
  migrate one after the other.
- **SQLite** (:class:`SqliteFileLock`): SQLite serves one replica. ``flock`` on
  ``<database>.lock`` next to the file, held for the life of the serving process (the kernel
  drops it when the process dies, ``kill -9`` included); a second serving process on the same
  file gets a :class:`~controlplane.errors.DatabaseError` naming the holder's pid. The loops
  processes that run apart from it on the same file (``heteroplane serve`` starts one) take the
  leader lease as replicas do on PostgreSQL, with a lock of the same kind: :class:`FileLeaderLock`
  (``flock`` on ``<database>.leader.lock``, tried without waiting, freed by the kernel when its
  holder dies). Migrations wait on a third one, ``<database>.migrate.lock``
  (:func:`migration_lock`).
- **A schema changed by hand** (:func:`schema_change_lock`, ``heteroplane db upgrade|downgrade``):
  refused while a service runs on the database, as these locks tell (a downgrade to ``base``
  dropped every table under a live service, and its running instances' records with them).

docs/service.md, "Replicas and the leader lease", says what this buys and what it does not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Connection, Engine, create_engine, text
from sqlalchemy.exc import ProgrammingError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from controlplane.db.session import CONNECT_TIMEOUT_S, missing_driver, parse_url, redact_url
from controlplane.errors import DatabaseError, DatabaseInUseError, first_line
from controlplane.repeating import Repeating

__all__ = [
    "LEADER_LOCK_KEY",
    "LOCK_APPLICATION_NAME",
    "LOCK_IDLE_SESSION_TIMEOUT_S",
    "LOCK_STATEMENT_TIMEOUT_MS",
    "MIGRATION_LOCK_KEY",
    "SERVING_APPLICATION_NAME",
    "SERVING_LOCK_KEY",
    "AdvisoryLock",
    "FileLeaderLock",
    "KeptLock",
    "SqliteFileLock",
    "advisory_key",
    "lock_sqlite_database",
    "migration_lock",
    "schema_change_lock",
    "sqlite_leader_lock",
]

logger = logging.getLogger(__name__)


def advisory_key(name: str) -> int:
    """A signed 64-bit advisory-lock key for ``name`` (the first 8 bytes of its SHA-256), so
    that our keys are unlikely to meet another application's on a shared database.

    >>> advisory_key("heteroplane.leader") == advisory_key("heteroplane.leader")
    True
    >>> -(2**63) <= advisory_key("heteroplane.leader") < 2**63
    True
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


LEADER_LOCK_KEY = advisory_key("heteroplane.leader")
MIGRATION_LOCK_KEY = advisory_key("heteroplane.migrations")
# Held by the one serving process of a database whose loops run apart (``serve --role serving``).
SERVING_LOCK_KEY = advisory_key("heteroplane.serving")
# What pg_stat_activity shows for the lock's connection (docs/service.md: "who is leader?").
LOCK_APPLICATION_NAME = "heteroplane-leader-lease"
# The serving process's lock connection's (``serve --role serving``, alone on its database).
SERVING_APPLICATION_NAME = "heteroplane-serving"

# libpq settings of the lock's connection. Keepalives after 5 s idle, every 2 s, 3 missed:
# a peer that vanished without a FIN is noticed in about 11 s; tcp_user_timeout (ms) bounds how
# long a check may wait on unacknowledged data.
_LOCK_CONNECT_ARGS: dict[str, Any] = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 5000,
}
# The leader lock's statements answer at once; a slower answer is a failed check.
LOCK_STATEMENT_TIMEOUT_MS = 5000
# The server ends a leader-lock session idle this long (PostgreSQL 14+: idle_session_timeout),
# freeing the lock of a leader that stopped checking (frozen, stopped, cut off without a FIN)
# while its socket still looks open. A live replica runs a statement every TRY_EVERY_S (2 s).
LOCK_IDLE_SESSION_TIMEOUT_S = 10


class KeptLock:
    """An advisory lock held for a process's lifetime (the serving process's, ``SERVING_LOCK_KEY``):
    taken once by :meth:`start`, then checked every ``every_s`` on a daemon thread (the server
    ends a session idle for :data:`LOCK_IDLE_SESSION_TIMEOUT_S`) and taken again after a failed
    check. A loss to another holder (the database answered, and another session holds the lock:
    this process was frozen past the idle timeout and another started meanwhile) is logged once
    and calls ``on_lost`` once; a database that does not answer is not a loss (the lock is tried
    again at the next round)."""

    def __init__(
        self,
        lock: AdvisoryLock,
        every_s: float,
        what: str,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.lock = lock
        self.every_s = float(every_s)
        self.what = what
        self.on_lost = on_lost
        self._lost = False
        self._told = False
        self._rounds = Repeating(self._check, self.every_s, "kept-lock", what)

    def start(self) -> bool:
        """Take the lock; False (and nothing started) when another session holds it."""
        if not self.lock.try_acquire():
            return False
        self._rounds.start()
        return True

    def close(self) -> None:
        self._rounds.stop()
        self.lock.close()

    def _check(self) -> None:
        held = self.lock.check() or self.lock.try_acquire()
        taken = not held and self.lock.refused
        if taken and not self._lost:
            logger.error("%s: the lock is lost to another holder", self.what)
        elif held and self._lost:
            logger.info("%s: the lock is held again", self.what)
        self._lost = taken
        if taken and self.on_lost is not None and not self._told:
            self._told = True
            self.on_lost()


def _lock_engine(url: str | URL, application_name: str, statement_timeout_ms: int) -> Engine:
    # NullPool: the connection is ours alone, never handed back to a pool (where another
    # checkout would hold our session lock) and never silently replaced by a fresh one.
    parsed = parse_url(url)
    try:
        return create_engine(
            parsed,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={
                **_LOCK_CONNECT_ARGS,
                "application_name": application_name,
                "options": f"-c statement_timeout={int(statement_timeout_ms)}",
            },
        )
    except ModuleNotFoundError as error:
        raise missing_driver(parsed, error) from None


class AdvisoryLock:
    """A PostgreSQL session-level advisory lock on a dedicated connection (thread-safe).

    A standby keeps its connection open between tries (one backend per replica, not one per
    try); a connection that fails is closed and made again at the next try.
    """

    def __init__(
        self,
        url: str | URL,
        key: int = LEADER_LOCK_KEY,
        *,
        application_name: str = LOCK_APPLICATION_NAME,
        what: str = "leader lock",
    ) -> None:
        parsed = parse_url(url)
        if parsed.get_backend_name() != "postgresql":
            raise DatabaseError(f"advisory locks need PostgreSQL, not {redact_url(parsed)!r}")
        self.key = key
        self.what = what
        # Whether the last try found the lock another session's (the database answered "no"),
        # rather than not reaching the database.
        self.refused = False
        self._where = redact_url(parsed)
        self._engine = _lock_engine(parsed, application_name, LOCK_STATEMENT_TIMEOUT_MS)
        self._connection: Connection | None = None
        self._held = False
        self._mutex = threading.Lock()
        # Why the last try could not reach the database, as logged (None: it reached it).
        self._unreachable: str | None = None

    @property
    def held(self) -> bool:
        """Whether the last try or check found the lock ours (no database round trip)."""
        with self._mutex:
            return self._held

    def try_acquire(self) -> bool:
        """Take the lock if no other session holds it; True when it is ours after the call."""
        with self._mutex:
            if self._held:
                return self._check_locked()
            try:
                if self._connection is None:
                    self._connection = self._connect()
                got = self._connection.execute(
                    text("SELECT pg_try_advisory_lock(:key)"), {"key": self.key}
                ).scalar_one()
            except SQLAlchemyError as error:
                # Once per cause: a standby tries every 2 s, and a database down for an hour
                # was 1,800 identical lines a loops process.
                reason = first_line(error)
                if reason != self._unreachable:
                    self._unreachable = reason
                    logger.warning("%s: cannot reach %s: %s", self.what, self._where, reason)
                self._drop_locked()
                self.refused = False
                return False
            if self._unreachable is not None:
                self._unreachable = None
                logger.info("%s: reaches %s again", self.what, self._where)
            self._held = bool(got)
            self.refused = not self._held
            return self._held

    def check(self) -> bool:
        """Whether the lock is still ours: ``SELECT 1`` on its connection answers. A failed
        check closes the connection (PostgreSQL has ended, or will end, the session and so
        released the lock)."""
        with self._mutex:
            return self._check_locked()

    def release(self) -> None:
        """Unlock (when held) and close the connection; safe to call at any time."""
        with self._mutex:
            if self._connection is not None and self._held:
                with contextlib.suppress(SQLAlchemyError):
                    self._connection.execute(
                        text("SELECT pg_advisory_unlock(:key)"), {"key": self.key}
                    )
            self._drop_locked()

    def close(self) -> None:
        """Release, and dispose of the engine."""
        self.release()
        self._engine.dispose()

    def _connect(self) -> Connection:
        connection = self._engine.connect()
        try:
            connection.execute(
                text(f"SET idle_session_timeout = '{int(LOCK_IDLE_SESSION_TIMEOUT_S)}s'")
            )
        except ProgrammingError:
            # PostgreSQL 13 and older have no such setting: a frozen leader then keeps the
            # lock until TCP gives up on it (docs/service.md).
            logger.info("%s: %s has no idle_session_timeout", self.what, self._where)
        return connection

    def _check_locked(self) -> bool:
        if not self._held or self._connection is None:
            return False
        try:
            self._connection.execute(text("SELECT 1")).scalar_one()
        except SQLAlchemyError as error:
            logger.error(
                "%s: its connection to %s failed: %s", self.what, self._where, first_line(error)
            )
            self._drop_locked()
            return False
        return True

    def _drop_locked(self) -> None:
        connection, self._connection = self._connection, None
        self._held = False
        if connection is not None:
            # A broken connection cannot roll back: invalidate first, then close quietly.
            with contextlib.suppress(Exception):
                connection.invalidate()
            with contextlib.suppress(Exception):
                connection.close()


@contextlib.contextmanager
def migration_lock(url: str | URL) -> Iterator[None]:
    """Hold the migrations' lock (waiting for it) while the block runs: an advisory lock on
    PostgreSQL, ``flock`` on ``<database>.migrate.lock`` on a SQLite file (a serving process and
    the loops beside it start together); nothing for an in-memory database."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "postgresql":
        database = _sqlite_file(parsed)
        if database is None:
            yield
            return
        fd = _open_lock_file(database.with_name(database.name + ".migrate.lock"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
        return
    # No statement timeout: the lock waits for another replica's migration, however long.
    engine = _lock_engine(parsed, "heteroplane-migrations", 0)
    try:
        try:
            connection = engine.connect()
        except SQLAlchemyError as error:
            # The first thing a service does with its database: say that it is unreachable.
            raise DatabaseError(
                f"cannot reach the database {redact_url(parsed)}: {first_line(error)}"
            ) from None
        try:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        except SQLAlchemyError as error:
            connection.close()
            raise DatabaseError(
                f"cannot lock {redact_url(parsed)} for migrating: {first_line(error)}"
            ) from None
        try:
            yield
        finally:
            with contextlib.suppress(SQLAlchemyError):
                connection.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
            with contextlib.suppress(SQLAlchemyError):
                connection.close()
    finally:
        engine.dispose()


@contextlib.contextmanager
def schema_change_lock(url: str | URL, action: str) -> Iterator[None]:
    """Hold the database ``url`` names against every heteroplane service while the block
    changes its schema by hand (``action``: ``upgrade``, ``downgrade``, for the message); a
    service running on it is a one-line :class:`~controlplane.errors.DatabaseInUseError`
    instead, and nothing is changed.

    A schema changed under a live service fails its API and its loops, and a downgrade drops
    the tables that record its running (paid) instances. On a SQLite file the serving lock
    (``<database>.lock``) and the leader lease's (``<database>.leader.lock``) are taken without
    waiting and held throughout, so a service that starts meanwhile is refused too. On
    PostgreSQL the leader lease and the serving lock (advisory locks, :data:`LEADER_LOCK_KEY`,
    :data:`SERVING_LOCK_KEY`) are taken likewise on a connection of the command's own, and a
    standby's lease connection (its ``application_name``) counts as a live service. What holds
    no lock is not seen: on PostgreSQL, a serving process whose loops are all gone (docs/cli.md).
    The migrations' lock (:func:`migration_lock`) is held inside, as a service holds it while
    it migrates at its start.
    """
    parsed = parse_url(url)
    where = redact_url(parsed)
    if parsed.get_backend_name() == "postgresql":
        with _postgresql_schema_lock(parsed, action, where):
            yield
        return
    database = _sqlite_file(parsed)
    if database is None:  # in memory: no other process can open it
        yield
        return
    held: list[int] = []
    try:
        for suffix in (".lock", ".leader.lock"):
            path = database.with_name(database.name + suffix)
            fd = _open_lock_file(path)
            if not _try_flock(fd, path):  # (a failure closed fd)
                holder = _read_pid(fd)
                os.close(fd)
                who = f"pid {holder}" if holder else "a process"
                raise _in_use(action, where, f"{who} holds {path.name}", holder)
            held.append(fd)
            # The pid, for the message of a service that starts meanwhile.
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        with migration_lock(parsed):
            yield
    finally:
        for fd in held:
            os.close(fd)


@contextlib.contextmanager
def _postgresql_schema_lock(parsed: URL, action: str, where: str) -> Iterator[None]:
    """:func:`schema_change_lock` on PostgreSQL: the leases' locks held by a session of this
    process's own (closing it releases them), then the migrations' lock (waiting for a service
    that migrates as it starts), then no lease connection of another session may be open."""
    engine = _lock_engine(parsed, "heteroplane-schema-change", LOCK_STATEMENT_TIMEOUT_MS)
    try:
        try:
            connection = engine.connect()
        except SQLAlchemyError as error:
            raise DatabaseError(f"cannot reach the database {where}: {first_line(error)}") from None
        try:
            for key, lock in (
                (LEADER_LOCK_KEY, "leader lease"),
                (SERVING_LOCK_KEY, "serving lock"),
            ):
                taken = _scalar(connection, "SELECT pg_try_advisory_lock(:key)", where, key=key)
                if not taken:
                    raise _in_use(action, where, f"a session holds its {lock}")
            with migration_lock(parsed):
                others = _scalar(
                    connection,
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid <> pg_backend_pid() AND application_name IN (:lease, :serving)",
                    where,
                    lease=LOCK_APPLICATION_NAME,
                    serving=SERVING_APPLICATION_NAME,
                )
                if others:
                    raise _in_use(action, where, f"{others} of its lease connections are open")
                yield
        finally:
            with contextlib.suppress(SQLAlchemyError):
                connection.close()  # the session ends: its advisory locks go with it
    finally:
        engine.dispose()


def _scalar(connection: Connection, sql: str, where: str, **params: Any) -> Any:
    try:
        return connection.execute(text(sql), params).scalar_one()
    except SQLAlchemyError as error:
        raise DatabaseError(f"cannot lock {where}: {first_line(error)}") from None


def _in_use(action: str, where: str, who: str, holder: str = "") -> DatabaseInUseError:
    return DatabaseInUseError(
        f"cannot {action} {where}: a heteroplane service runs on it ({who}), whose API and loops"
        " would fail on a changed schema; stop the service first",
        holder,
    )


class SqliteFileLock:
    """An exclusive ``flock`` on ``path`` for the life of this object (see the module
    docstring); :meth:`close` releases it. The file holds the holder's pid, for the message."""

    def __init__(self, path: Path, database: Path) -> None:
        self.path = path
        fd = _open_lock_file(path)
        if not _try_flock(fd, path):
            holder = _read_pid(fd)
            os.close(fd)
            who = f" (pid {holder})" if holder else ""
            raise DatabaseInUseError(
                f"another heteroplane process{who} already serves the SQLite database"
                f" {database}: SQLite serves one replica; stop it, or use PostgreSQL for"
                " standby replicas (docs/service.md)",
                holder,
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def close(self) -> None:
        """Release the lock (the file stays; the next holder overwrites its pid)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class FileLeaderLock:
    """The leader lease's lock on a SQLite file (thread-safe; :class:`~controlplane.loops.
    leadership.LeaderLock`): an exclusive ``flock`` on ``path``, tried without waiting and kept
    until :meth:`release`; the kernel frees it when the holding process dies, so a standby loops
    process takes over at its next try, as on PostgreSQL."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._mutex = threading.Lock()

    def try_acquire(self) -> bool:
        with self._mutex:
            if self._fd is not None:
                return True
            try:
                fd = _open_lock_file(self.path)
                taken = _try_flock(fd, self.path)
            except DatabaseError as error:
                logger.warning("leader lock: %s", error)
                return False
            if not taken:
                os.close(fd)
                return False
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
            return True

    def check(self) -> bool:
        # An flock is not taken away while its descriptor is open.
        with self._mutex:
            return self._fd is not None

    def release(self) -> None:
        with self._mutex:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)


def _sqlite_file(parsed: URL) -> Path | None:
    """The SQLite database file ``parsed`` names, its folder made when missing; None for
    PostgreSQL and for an in-memory database."""
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    database = Path(parsed.database).resolve()
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatabaseError(f"cannot create {database.parent}: {error.strerror or error}") from None
    return database


def lock_sqlite_database(url: str | URL) -> SqliteFileLock | None:
    """The one-serving-process lock of the SQLite file ``url`` names (None for PostgreSQL and
    for an in-memory SQLite database); the file's folder is created when missing."""
    database = _sqlite_file(parse_url(url))
    if database is None:
        return None
    return SqliteFileLock(database.with_name(database.name + ".lock"), database)


def sqlite_leader_lock(url: str | URL) -> FileLeaderLock | None:
    """The leader lease's lock of the SQLite file ``url`` names (None for PostgreSQL and for an
    in-memory database, which one process serves alone)."""
    database = _sqlite_file(parse_url(url))
    if database is None:
        return None
    return FileLeaderLock(database.with_name(database.name + ".leader.lock"))


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise DatabaseError(f"cannot open {path}: {error.strerror or error}") from None


def _try_flock(fd: int, path: Path) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting: False when another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        os.close(fd)
        raise DatabaseError(f"cannot lock {path}: {error.strerror or error}") from None
    return True


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
