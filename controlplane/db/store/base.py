"""The store's shared part: :class:`StoreBase` (engine, sessions, clock, error translation) and
the helpers the aggregates' modules share (rows by name, compare-and-set on an app's version,
validation of values)."""

from __future__ import annotations

import functools
import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Concatenate, ParamSpec, Protocol, Self, TypeVar, cast

from sqlalchemy import URL, CursorResult, Engine, Select, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db import migrate
from controlplane.db import models as m
from controlplane.db.session import make_engine, make_session_factory, redact_url
from controlplane.db.store.token_cache import TokenCache
from controlplane.errors import (
    ConflictError,
    ControlPlaneError,
    DatabaseError,
    InvalidValueError,
    NotFoundError,
    shown,
)
from controlplane.policies.lifecycle import InstanceState

__all__ = ["DECISION_MERGE_WINDOW_S", "StoreBase"]

# How often a write that lost a compare-and-set race is retried before ConflictError.
_ATTEMPTS = 20
_APP_NAME_MAX = 63
# A keyed decision made again within this long of its last time is the same decision (one row,
# its count bumped): long enough for two alternating failures retried every reconcile tick.
DECISION_MERGE_WINDOW_S = 600.0


class _WallClock(Protocol):
    """What the store needs of a clock (``controlplane.clock.Clock`` has it)."""

    def utcnow(self) -> datetime: ...


class _SystemWallClock:
    def utcnow(self) -> datetime:
        return datetime.now(UTC)


# --- error translation -----------------------------------------------------------------------

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")
_S = TypeVar("_S", bound="StoreBase")


class _LostRaceError(Exception):
    """A compare-and-set matched no row: roll back and try again."""


def _translated(
    method: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], _R]:
    """Turn SQLAlchemy's errors into one-line DatabaseErrors (ours pass through)."""

    @functools.wraps(method)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except ControlPlaneError:
            raise
        except SQLAlchemyError as error:
            raise self._database_error(error) from error

    return wrapper


class StoreBase:
    """What every aggregate's part of the store shares: the engine, its sessions (one transaction
    per method, :func:`~controlplane.db.session.transaction`), the clock, the token cache and the
    translation of database errors."""

    def __init__(
        self,
        engine: Engine,
        clock: _WallClock | None = None,
        *,
        decision_merge_window_s: float = DECISION_MERGE_WINDOW_S,
    ) -> None:
        self._engine = engine
        # How long after its last time a keyed decision is still merged into (record_decision).
        self.decision_merge_window_s = decision_merge_window_s
        self._sessions: sessionmaker[Session] = make_session_factory(engine)
        self._clock: _WallClock = clock if clock is not None else _SystemWallClock()
        # verify_token's answers for a second (controlplane.db.store.token_cache).
        self._token_cache = TokenCache(self._clock)

    @classmethod
    def from_url(
        cls, url: str | URL, clock: _WallClock | None = None, *, upgrade: bool = False
    ) -> Self:
        """A store on the database at ``url``: migrated to the newest revision first when
        ``upgrade``, else checked to be there (DatabaseError telling to run
        ``heteroplane db upgrade`` when not). An in-memory SQLite URL (``sqlite://``) gives a
        fresh database that only this store sees (pass ``upgrade=True``), on one connection: for
        single-threaded tests only."""
        engine = make_engine(url)
        # A SQLite database in memory lives only inside its engine: migrate through it.
        target: migrate.Target = engine if engine.url.database in (None, "", ":memory:") else url
        try:
            if upgrade:
                migrate.upgrade(target)
            else:
                found, wanted = migrate.current(target), migrate.head()
                if found != wanted:
                    at = f"at revision {found}" if found else "not migrated"
                    raise DatabaseError(
                        f"the database {redact_url(url)} is {at}, this heteroplane needs"
                        f" {wanted}; run: heteroplane db upgrade"
                    )
        except BaseException:
            engine.dispose()
            raise
        return cls(engine, clock)

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return redact_url(self._engine.url)

    def close(self) -> None:
        """Close the pooled connections."""
        self._engine.dispose()

    def _now(self, at: datetime | None) -> datetime:
        if at is None:
            return self._clock.utcnow()
        if at.tzinfo is None:
            raise InvalidValueError("at", f"must be timezone-aware, got {at.isoformat()}")
        return at.astimezone(UTC)

    def _database_error(self, error: SQLAlchemyError) -> DatabaseError:
        reason = str(getattr(error, "orig", None) or error).strip()
        reason = reason.splitlines()[0] if reason else type(error).__name__
        missing_table = "no such table" in reason or (
            "relation" in reason and "does not exist" in reason
        )
        if missing_table:
            return DatabaseError(
                f"the database {self.url} has no heteroplane tables ({reason});"
                " run: heteroplane db upgrade"
            )
        return DatabaseError(f"database error on {self.url}: {reason}")


# --- helpers ---------------------------------------------------------------------------------


def _app_row(session: Session, name: str, *, lock: bool = False) -> m.App:
    """The app's row; with ``lock``, held for update until the transaction ends (PostgreSQL's
    SELECT ... FOR UPDATE: concurrent writers queue instead of racing; SQLite's BEGIN IMMEDIATE
    already serialises writers, and SQLAlchemy leaves the clause out there)."""
    query = select(m.App).where(m.App.name == name)
    if lock:
        query = query.with_for_update()
    row = session.scalar(query)
    if row is None:
        raise NotFoundError("app", name)
    return row


def _plan_row(session: Session, app: m.App, plan_id: int) -> m.Plan:
    plan = session.get(m.Plan, plan_id)
    if plan is None or plan.app_id != app.id:
        raise NotFoundError("plan", plan_id)
    return plan


def _instances_query() -> Select[tuple[m.Instance, str]]:
    return select(m.Instance, m.App.name).join(m.App, m.App.id == m.Instance.app_id)


def _instance_row(session: Session, instance_id: str) -> tuple[m.Instance, str]:
    found = session.execute(_instances_query().where(m.Instance.id == instance_id)).first()
    if found is None:
        raise NotFoundError("instance", instance_id)
    return found[0], found[1]


def _check_version(row: m.App, expected_version: int | None) -> None:
    if expected_version is None or row.version == expected_version:
        return
    if row.version < expected_version:
        raise ConflictError(
            f"app {row.name!r} is at version {row.version}, not {expected_version}; read it again"
        )
    raise ConflictError(
        f"app {row.name!r} changed meanwhile (version {expected_version} -> {row.version}: a"
        " budget change, a plan applied or another replace of its spec); read it again and send"
        " the change again"
    )


def _compare_and_set(session: Session, row: m.App, **values: Any) -> None:
    """Update the app row and bump its version, only if it is still at the version read."""
    result = session.execute(
        update(m.App)
        .where(m.App.id == row.id, m.App.version == row.version)
        .values(version=m.App.version + 1, **values)
        .execution_options(synchronize_session=False)
    )
    if cast(CursorResult[Any], result).rowcount != 1:
        raise _LostRaceError
    session.expire(row)


def _still_racing(app: str) -> ConflictError:
    return ConflictError(f"app {app!r} kept changing under concurrent writes; try again")


def _newest(
    session: Session, query: Select[tuple[_T]], at: Any, tie: Any, limit: int | None
) -> list[_T]:
    return [row[0] for row in _newest_rows(session, query, at, tie, limit)]


def _newest_rows(
    session: Session, query: Select[Any], at: Any, tie: Any, limit: int | None
) -> list[Any]:
    """Rows oldest first; with ``limit``, the newest ``limit`` of them."""
    if limit is None:
        return list(session.execute(query.order_by(at, tie)).tuples())
    if limit < 0:
        raise InvalidValueError("limit", f"must be >= 0, got {limit}")
    rows = list(session.execute(query.order_by(at.desc(), tie.desc()).limit(limit)).tuples())
    rows.reverse()
    return rows


def _values(states: Iterable[InstanceState]) -> list[str]:
    return sorted(state.value for state in states)


def _app_name(document: Mapping[str, Any]) -> str:
    name = document.get("name")
    if not isinstance(name, str) or not name or len(name) > _APP_NAME_MAX:
        raise InvalidValueError("name", f"must be an app name of 1 to 63 characters, got {name!r}")
    return name


def _budget(value: Any) -> float:
    return _number(value, "budget_usd_per_hr", positive=True)


def _number(value: Any, field: str, *, positive: bool = False, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidValueError(field, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidValueError(field, f"must be finite, got {number}")
    if positive and number <= 0:
        raise InvalidValueError(field, f"must be > 0, got {number:g}")
    if number < 0:
        raise InvalidValueError(field, f"must be >= 0, got {number:g}")
    if upper is not None and number > upper:
        raise InvalidValueError(field, f"must be <= {upper:g}, got {number:g}")
    return number


def _optional_number(value: Any, field: str, *, upper: float | None = None) -> float | None:
    return None if value is None else _number(value, field, upper=upper)


def _label(value: Any, field: str, *, max_length: int = 100) -> str:
    """A one-line name (a token's, who made a change, an instance type): 1 to ``max_length``
    characters, no control character (a newline in a token's name broke ``token list``)."""
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise InvalidValueError(
            field, f"must be a string of 1 to {max_length} characters, got {shown(value)}"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidValueError(
            field, f"must not hold control characters (a newline, a tab), got {shown(value)}"
        )
    return value


def _state(state: str) -> str:
    try:
        return InstanceState(state).value
    except ValueError:
        known = ", ".join(s.value for s in InstanceState)
        raise InvalidValueError("state", f"unknown state {state!r} (known: {known})") from None


def _json_default(value: Any) -> Any:
    # numpy's scalars register as numbers.Integral / numbers.Real.
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Sequence | set | frozenset) and not isinstance(value, str | bytes):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _json_document(document: Mapping[str, Any], field: str) -> dict[str, Any]:
    """``document`` as plain JSON (what both databases store alike): no NaN or infinity."""
    try:
        text = json.dumps(dict(document), default=_json_default, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidValueError(field, f"must be a JSON object without NaN: {error}") from None
    loaded: dict[str, Any] = json.loads(text)
    return loaded
