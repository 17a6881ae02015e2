"""The store: the one place the service reads and writes its database.

The API, the scheduler's jobs and the CLI call :class:`Store`; ORM rows never leave this module:
every method returns frozen records (:class:`AppRecord`, :class:`PlanRecord`, ...) or plain
values, and every database failure is a one-line :class:`~controlplane.errors.DatabaseError`.

Concurrency (docs/service.md, "Concurrency"):

- An app row carries ``version``; every change of it (spec, budget, applied plan) bumps it with
  ``UPDATE apps SET ..., version = version + 1 WHERE id = :id AND version = :seen``, so of two
  writers that saw the same version exactly one updates a row. :meth:`Store.apply_plan` turns a
  lost race into :class:`~controlplane.errors.ConflictError`: a plan records the app version it
  was made for, and is applied only while the app is still at that version (a plan made before a
  budget or spec change, or before another plan was applied, is stale). :meth:`Store.change_budget`
  retries a lost race instead, so concurrent budget changes serialise: each audit row's old budget
  is the previous row's new one.
- A launch is idempotent by its request id: :meth:`Store.record_instance` with a request id seen
  before returns the instance recorded then (a unique constraint settles a race).
- Instance state moves follow :mod:`controlplane.policies.lifecycle`, compare-and-set on the state
  seen.

Lists come oldest first; with ``limit`` they hold the newest ``limit`` items (still oldest first);
``since`` is exclusive. Times are timezone-aware UTC; by default they are read from the clock the
store was given.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import numbers
import secrets
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Concatenate, NamedTuple, ParamSpec, Protocol, TypeVar, cast

from sqlalchemy import URL, CursorResult, Engine, Select, delete, func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from controlplane.db import migrate
from controlplane.db import models as m
from controlplane.db.session import make_engine, make_session_factory, redact_url, transaction
from controlplane.errors import (
    AppExistsError,
    ConflictError,
    ControlPlaneError,
    DatabaseError,
    InvalidValueError,
    NotFoundError,
)
from controlplane.policies import auth
from controlplane.policies.lifecycle import LIVE_STATES, InstanceState, check_transition
from controlplane.policies.plan import PlanDocument
from provisioners.artifacts import ArtifactError, ArtifactRef, ModelSignature

__all__ = [
    "DECISION_MERGE_WINDOW_S",
    "AppRecord",
    "BudgetChangeRecord",
    "DecisionRecord",
    "InstanceEventRecord",
    "InstanceRecord",
    "MetricSampleRecord",
    "ModelVersionRecord",
    "PlanRecord",
    "Principal",
    "ProfileScaleRecord",
    "ServingOverheadRecord",
    "Store",
    "TokenRecord",
]

# How often a write that lost a compare-and-set race is retried before ConflictError.
_ATTEMPTS = 20
# last_used_at of a token is refreshed at most this often: not a write per request.
LAST_USED_RESOLUTION_S = 60.0
# How long verify_token trusts its own answer (on the store's clock), and how many it keeps. A
# token revoked through another replica's store stops working here within this time.
TOKEN_CACHE_S = 1.0
TOKEN_CACHE_MAX = 1024
_APP_NAME_MAX = 63
# A keyed decision made again within this long of its last time is the same decision (one row,
# its count bumped): long enough for two alternating failures retried every reconcile tick.
DECISION_MERGE_WINDOW_S = 600.0
_DECISION_KEY_MAX = 200


class _WallClock(Protocol):
    """What the store needs of a clock (``controlplane.clock.Clock`` has it)."""

    def utcnow(self) -> datetime: ...


class _SystemWallClock:
    def utcnow(self) -> datetime:
        return datetime.now(UTC)


# --- records ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AppRecord:
    id: int
    name: str
    spec: dict[str, Any]
    budget_usd_per_hr: float
    applied_plan_id: int | None
    version: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class BudgetChangeRecord:
    id: int
    app: str
    who: str
    at: datetime
    old_usd_per_hr: float | None  # None: the budget the app was registered with
    new_usd_per_hr: float
    reason: str


@dataclass(frozen=True, slots=True)
class PlanRecord:
    id: int
    app: str
    number: int  # 1, 2, 3, ... per app
    status: str  # previewed, applied, superseded
    document: dict[str, Any]
    app_version: int  # the app's version the plan was made for
    created_at: datetime
    applied_at: datetime | None
    # The typed document, parsed at the first read of ``plan`` and kept (a loop reads it several
    # times a tick); not part of the record's value.
    _plan: PlanDocument | None = field(default=None, compare=False, repr=False)

    @property
    def plan(self) -> PlanDocument:
        """The document, typed (:meth:`PlanDocument.parse`, once per record).

        Raises:
            PlanError: a document that is not a plan.
        """
        plan = self._plan
        if plan is None:
            plan = PlanDocument.parse(self.document)
            object.__setattr__(self, "_plan", plan)
        return plan


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    id: str
    app: str
    request_id: str
    provider_id: str | None
    instance_type: str
    state: str
    price_usd_per_hr: float
    created_at: datetime
    updated_at: datetime
    market: str = "on-demand"  # or "spot" (docs/spot.md)


@dataclass(frozen=True, slots=True)
class InstanceEventRecord:
    id: int
    instance_id: str
    app: str
    from_state: str | None  # None: the instance was recorded
    to_state: str
    at: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    id: int
    app: str
    at: datetime
    kind: str
    reason: str
    numbers: dict[str, Any]
    count: int = 1  # how many times it was made (a keyed decision that repeats)
    last_at: datetime | None = None  # the last of them; None: made once (``at``)
    key: str | None = None  # the caller's identity of "the same decision"


@dataclass(frozen=True, slots=True)
class MetricSampleRecord:
    app: str
    at: datetime
    arrival_rate_qps: float
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    attainment_share: float | None
    fleet_cost_usd_per_hr: float
    gear: str | None
    accuracy: float | None


@dataclass(frozen=True, slots=True)
class ServingOverheadRecord:
    """The control plane's own time per query of ``app`` (ms): the median, over ``samples``
    answered queries, of the API's receipt to the dispatch queue, and ``quantiles_ms``, its
    distribution (the quantiles at :data:`~controlplane.policies.calibration.
    OVERHEAD_QUANTILES`; empty when not measured): the planner adds a draw from it to every
    query's simulated latency (the median when it is empty)."""

    app: str
    overhead_ms: float
    samples: int
    updated_at: datetime
    quantiles_ms: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ProfileScaleRecord:
    """The online calibration's factor for ``model`` on ``instance_type`` in ``app``: its profile's
    samples times ``factor`` predict what the serving loop observes."""

    app: str
    model: str
    instance_type: str
    factor: float
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class TokenRecord:
    id: int
    name: str
    scope: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


@dataclass(frozen=True, slots=True)
class ModelVersionRecord:
    """One pushed version of a registry model (:mod:`controlplane.registry`): immutable."""

    name: str
    version: int
    format: str  # onnx, torchscript
    sha256: str  # hex, of the artifact's bytes
    size_bytes: int
    signature: ModelSignature
    uri: str  # file:///... or s3://bucket/key
    created_at: datetime

    def ref(self, serve_as: str) -> ArtifactRef:
        """What a worker needs to load this version and serve it as ``serve_as``: for a
        TorchScript module, its input signature too (one pushed with ``--inputs`` has it only
        here, not in its archive)."""
        inputs = self.signature.inputs if self.format == "torchscript" else ()
        return ArtifactRef(
            serve_as, self.name, self.version, self.format, self.sha256, self.uri, inputs
        )

    def to_json(self) -> dict[str, Any]:
        """The registry's version document (``GET /v1/models/{name}``)."""
        signature = self.signature.to_json()
        return {
            "name": self.name,
            "version": self.version,
            "format": self.format,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "inputs": signature["inputs"],
            "outputs": signature["outputs"],
            "uri": self.uri,
            "created_at": self.created_at.isoformat().replace("+00:00", "Z"),
        }


class Principal(NamedTuple):
    """Who a verified token belongs to: its name and scope."""

    name: str
    scope: str


# --- error translation -----------------------------------------------------------------------

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


class _LostRaceError(Exception):
    """A compare-and-set matched no row: roll back and try again."""


def _translated(
    method: Callable[Concatenate[Store, _P], _R],
) -> Callable[Concatenate[Store, _P], _R]:
    """Turn SQLAlchemy's errors into one-line DatabaseErrors (ours pass through)."""

    @functools.wraps(method)
    def wrapper(self: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except ControlPlaneError:
            raise
        except SQLAlchemyError as error:
            raise self._database_error(error) from error

    return wrapper


# --- the store -------------------------------------------------------------------------------


class Store:
    """Reads and writes of the control plane's database (see the module docstring)."""

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
        # verify_token's answers for a second (token digest -> who, until when): the inference
        # path checks a token per request. A revocation through this store clears it at once.
        self._token_cache: dict[str, tuple[Principal, datetime]] = {}
        self._token_generation = 0  # bumped by each revocation
        self._token_lock = threading.Lock()

    @classmethod
    def from_url(
        cls, url: str | URL, clock: _WallClock | None = None, *, upgrade: bool = False
    ) -> Store:
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

    # --- apps ----------------------------------------------------------------------------------

    @_translated
    def create_app(
        self,
        spec_document: Mapping[str, Any],
        budget_usd_per_hr: float | None = None,
        *,
        who: str,
        at: datetime | None = None,
    ) -> AppRecord:
        """Register the app ``spec_document`` describes (its ``name`` key names it), with its
        budget (default: the document's ``budget_usd_per_hr``); the budget's first audit row says
        who registered it. :class:`AppExistsError` when the name is taken."""
        name = _app_name(spec_document)
        budget = _budget(
            budget_usd_per_hr
            if budget_usd_per_hr is not None
            else spec_document.get("budget_usd_per_hr")
        )
        spec = _json_document({**spec_document, "budget_usd_per_hr": budget}, "spec")
        now = self._now(at)
        try:
            with transaction(self._sessions) as session:
                row = m.App(
                    name=name,
                    spec=spec,
                    budget_usd_per_hr=budget,
                    version=1,
                    created_at=now,
                    updated_at=now,
                )
                session.add(row)
                session.flush()
                session.add(
                    m.BudgetChange(
                        app_id=row.id,
                        who=_label(who, "who"),
                        at=now,
                        old_usd_per_hr=None,
                        new_usd_per_hr=budget,
                        reason="app registered",
                    )
                )
                return _app_record(row)
        except IntegrityError:
            raise AppExistsError(name) from None

    @_translated
    def get_app(self, name: str) -> AppRecord:
        with transaction(self._sessions) as session:
            return _app_record(_app_row(session, name))

    @_translated
    def list_apps(self) -> list[AppRecord]:
        with transaction(self._sessions) as session:
            rows = session.scalars(select(m.App).order_by(m.App.name))
            return [_app_record(row) for row in rows]

    @_translated
    def update_app(
        self,
        name: str,
        spec_document: Mapping[str, Any],
        *,
        who: str,
        expected_version: int | None = None,
        at: datetime | None = None,
    ) -> AppRecord:
        """Replace the app's spec (its name cannot change); a new budget in it is audited like
        :meth:`change_budget`. :class:`ConflictError` if the app is no longer at
        ``expected_version`` (when given)."""
        if _app_name(spec_document) != name:
            raise InvalidValueError(
                "name", f"an app cannot be renamed ({name!r} -> {spec_document.get('name')!r})"
            )
        budget = _budget(spec_document.get("budget_usd_per_hr"))
        spec = _json_document(spec_document, "spec")
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, name)
                    _check_version(row, expected_version)
                    old_budget = row.budget_usd_per_hr
                    _compare_and_set(
                        session,
                        row,
                        spec=spec,
                        budget_usd_per_hr=budget,
                        updated_at=now,
                    )
                    if budget != old_budget:
                        session.add(
                            m.BudgetChange(
                                app_id=row.id,
                                who=_label(who, "who"),
                                at=now,
                                old_usd_per_hr=old_budget,
                                new_usd_per_hr=budget,
                                reason="spec updated",
                            )
                        )
                    return _app_record(_app_row(session, name))
            except _LostRaceError:
                continue
        raise _still_racing(name)

    @_translated
    def delete_app(self, name: str, *, force: bool = False) -> None:
        """Delete the app and everything recorded about it (plans, instances, events, decisions,
        metrics, budget history). Refused with :class:`ConflictError` while it has live
        instances, unless ``force`` (their rows go too; the provider's instances do not)."""
        with transaction(self._sessions) as session:
            row = _app_row(session, name)
            live = session.scalar(
                select(func.count())
                .select_from(m.Instance)
                .where(m.Instance.app_id == row.id, m.Instance.state.in_(_values(LIVE_STATES)))
            )
            if live and not force:
                raise ConflictError(
                    f"app {name!r} still has {live} live instance(s); drain them first"
                )
            session.execute(delete(m.App).where(m.App.id == row.id))

    # --- budgets -------------------------------------------------------------------------------

    @_translated
    def change_budget(
        self,
        app: str,
        new_usd_per_hr: float,
        *,
        reason: str,
        who: str,
        expected_version: int | None = None,
        at: datetime | None = None,
    ) -> BudgetChangeRecord:
        """Set the app's budget (and its spec's ``budget_usd_per_hr``) and audit it. Concurrent
        changes serialise (the app's row is locked for the change; a lost race, possible only
        without the lock, is retried), so the audit trail is a chain. With
        ``expected_version``, :class:`ConflictError` if the app changed since."""
        budget = _budget(new_usd_per_hr)
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, app, lock=True)
                    _check_version(row, expected_version)
                    old = row.budget_usd_per_hr
                    _compare_and_set(
                        session,
                        row,
                        spec={**row.spec, "budget_usd_per_hr": budget},
                        budget_usd_per_hr=budget,
                        updated_at=now,
                    )
                    change = m.BudgetChange(
                        app_id=row.id,
                        who=_label(who, "who"),
                        at=now,
                        old_usd_per_hr=old,
                        new_usd_per_hr=budget,
                        reason=reason,
                    )
                    session.add(change)
                    session.flush()
                    return _budget_record(change, app)
            except _LostRaceError:
                continue
        raise _still_racing(app)

    @_translated
    def list_budget_changes(
        self, app: str, *, limit: int | None = None
    ) -> list[BudgetChangeRecord]:
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            query = select(m.BudgetChange).where(m.BudgetChange.app_id == row.id)
            # In chain order, not by time: each change is written under the app's row lock, so
            # ids follow the chain, while ``at`` is read before the lock (and from the clock of
            # whichever replica made the change).
            changes = _newest(session, query, m.BudgetChange.id, m.BudgetChange.id, limit)
            return [_budget_record(change, app) for change in changes]

    # --- plans ---------------------------------------------------------------------------------

    @_translated
    def create_plan(
        self, app: str, document: Mapping[str, Any], *, at: datetime | None = None
    ) -> PlanRecord:
        """Record a previewed plan (``Plan.to_document()`` and whatever else the caller adds)
        for the app at its current version; it gets the app's next plan number."""
        body = _json_document(document, "document")
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, app)
                    last = session.scalar(
                        select(func.max(m.Plan.number)).where(m.Plan.app_id == row.id)
                    )
                    plan = m.Plan(
                        app_id=row.id,
                        number=(last or 0) + 1,
                        status="previewed",
                        document=body,
                        app_version=row.version,
                        created_at=now,
                        applied_at=None,
                    )
                    session.add(plan)
                    session.flush()
                    return _plan_record(plan, app)
            except IntegrityError:
                continue  # another plan took the number: take the next
        raise _still_racing(app)

    @_translated
    def get_plan(self, app: str, plan_id: int) -> PlanRecord:
        with transaction(self._sessions) as session:
            return _plan_record(_plan_row(session, _app_row(session, app), plan_id), app)

    @_translated
    def get_applied_plan(self, app: str) -> PlanRecord | None:
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            if row.applied_plan_id is None:
                return None
            return _plan_record(_plan_row(session, row, row.applied_plan_id), app)

    @_translated
    def list_plans(self, app: str, *, limit: int | None = None) -> list[PlanRecord]:
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            query = select(m.Plan).where(m.Plan.app_id == row.id)
            plans = _newest(session, query, m.Plan.number, m.Plan.id, limit)
            return [_plan_record(plan, app) for plan in plans]

    @_translated
    def apply_plan(
        self,
        app: str,
        plan_id: int,
        *,
        expected_version: int | None = None,
        at: datetime | None = None,
    ) -> PlanRecord:
        """Make the previewed plan the app's applied plan (the one it had becomes superseded).

        :class:`ConflictError` when the plan is not previewed any more, or the app changed since
        the plan was made (its spec, budget or applied plan; then the plan is stale: preview
        another), or the app is not at ``expected_version`` (when given). Of concurrent applies
        for one app, exactly one succeeds.
        """
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            plan = _plan_row(session, row, plan_id)
            if plan.status != "previewed":
                raise ConflictError(f"plan {plan.number} of app {app!r} is already {plan.status}")
            _check_version(row, expected_version)
            if plan.app_version != row.version:
                raise ConflictError(
                    f"plan {plan.number} was made for version {plan.app_version} of app {app!r},"
                    f" which is now at version {row.version}; preview a new plan"
                )
            superseded = row.applied_plan_id
            try:
                _compare_and_set(session, row, applied_plan_id=plan.id, updated_at=now)
            except _LostRaceError:
                raise ConflictError(
                    f"app {app!r} changed while plan {plan.id} was being applied"
                ) from None
            if superseded is not None:
                session.execute(
                    update(m.Plan)
                    .where(m.Plan.id == superseded, m.Plan.status == "applied")
                    .values(status="superseded")
                    .execution_options(synchronize_session=False)
                )
            session.execute(
                update(m.Plan)
                .where(m.Plan.id == plan.id)
                .values(status="applied", applied_at=now)
                .execution_options(synchronize_session=False)
            )
            session.refresh(plan)
            return _plan_record(plan, app)

    # --- instances -----------------------------------------------------------------------------

    @_translated
    def record_instance(
        self,
        app: str,
        *,
        request_id: str,
        instance_type: str,
        price_usd_per_hr: float,
        provider_id: str | None = None,
        state: str = InstanceState.REQUESTED,
        reason: str = "launch requested",
        at: datetime | None = None,
        market: str = "on-demand",
    ) -> InstanceRecord:
        """Record an instance we launch (or adopt) under the idempotency key ``request_id``: the
        same request id again returns the instance recorded the first time, never a second one
        (:class:`ConflictError` if that was for another app or type). ``market``: ``on-demand``
        or ``spot``."""
        if market not in ("on-demand", "spot"):
            raise InvalidValueError("market", f"must be on-demand or spot, got {market!r}")
        request_id = _label(request_id, "request_id")
        state = _state(state)
        price = _number(price_usd_per_hr, "price_usd_per_hr")
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            existing = self._instance_by_request(request_id)
            if existing is not None:
                if existing.app != app or existing.instance_type != instance_type:
                    raise ConflictError(
                        f"request id {request_id!r} already launched a {existing.instance_type}"
                        f" for app {existing.app!r}"
                    )
                return existing
            try:
                with transaction(self._sessions) as session:
                    row = _app_row(session, app)
                    instance = m.Instance(
                        id=str(uuid.uuid4()),
                        app_id=row.id,
                        request_id=request_id,
                        provider_id=provider_id,
                        instance_type=_label(instance_type, "instance_type"),
                        state=state,
                        price_usd_per_hr=price,
                        created_at=now,
                        updated_at=now,
                        market=market,
                    )
                    session.add(instance)
                    session.flush()
                    session.add(
                        m.InstanceEvent(
                            instance_id=instance.id,
                            from_state=None,
                            to_state=state,
                            at=now,
                            reason=reason,
                        )
                    )
                    return _instance_record(instance, app)
            except IntegrityError:
                if self._instance_by_request(request_id) is None:
                    raise ConflictError(
                        f"provider id {provider_id!r} is already recorded for another instance"
                    ) from None
                # A concurrent launch with the same request id won: return its row.
        raise _still_racing(app)

    def _instance_by_request(self, request_id: str) -> InstanceRecord | None:
        with transaction(self._sessions) as session:
            found = session.execute(
                _instances_query().where(m.Instance.request_id == request_id)
            ).first()
            return None if found is None else _instance_record(found[0], found[1])

    @_translated
    def get_instance(self, instance_id: str) -> InstanceRecord:
        with transaction(self._sessions) as session:
            return _instance_record(*_instance_row(session, instance_id))

    @_translated
    def find_instance(self, *, provider_id: str) -> InstanceRecord | None:
        """The instance the provider knows as ``provider_id``, if we recorded one."""
        with transaction(self._sessions) as session:
            found = session.execute(
                _instances_query().where(m.Instance.provider_id == provider_id)
            ).first()
            return None if found is None else _instance_record(found[0], found[1])

    @_translated
    def list_instances(
        self, app: str | None = None, states: Iterable[str] | None = None
    ) -> list[InstanceRecord]:
        """Instances (of ``app``, in one of ``states``), oldest first."""
        with transaction(self._sessions) as session:
            query = _instances_query()
            if app is not None:
                query = query.where(m.Instance.app_id == _app_row(session, app).id)
            if states is not None:
                query = query.where(m.Instance.state.in_([_state(s) for s in states]))
            rows = session.execute(query.order_by(m.Instance.created_at, m.Instance.id))
            return [_instance_record(instance, name) for instance, name in rows.tuples()]

    @_translated
    def transition_instance(
        self,
        instance_id: str,
        to_state: str,
        *,
        reason: str,
        provider_id: str | None = None,
        at: datetime | None = None,
    ) -> InstanceRecord:
        """Move the instance to ``to_state`` (and set its provider id, when given), with an
        ``instance_events`` row. :class:`InvalidTransitionError` when the lifecycle table does
        not allow the move from the state it is in."""
        now = self._now(at)
        for _ in range(_ATTEMPTS):
            try:
                with transaction(self._sessions) as session:
                    instance, app = _instance_row(session, instance_id)
                    from_state = instance.state
                    check_transition(from_state, to_state)
                    values: dict[str, Any] = {"state": to_state, "updated_at": now}
                    if provider_id is not None:
                        values["provider_id"] = provider_id
                    result = session.execute(
                        update(m.Instance)
                        .where(m.Instance.id == instance_id, m.Instance.state == from_state)
                        .values(**values)
                        .execution_options(synchronize_session=False)
                    )
                    if cast(CursorResult[Any], result).rowcount != 1:
                        raise _LostRaceError
                    session.add(
                        m.InstanceEvent(
                            instance_id=instance_id,
                            from_state=from_state,
                            to_state=to_state,
                            at=now,
                            reason=reason,
                        )
                    )
                    session.refresh(instance)
                    return _instance_record(instance, app)
            except _LostRaceError:
                continue
            except IntegrityError:
                raise ConflictError(
                    f"provider id {provider_id!r} is already recorded for another instance"
                ) from None
        raise ConflictError(f"instance {instance_id!r} kept changing state; try again")

    @_translated
    def touch_instances(self, instance_ids: Iterable[str], *, at: datetime | None = None) -> int:
        """Set ``updated_at`` of the live ones of ``instance_ids`` to now (a heartbeat: a
        profile run says it still owns its workers, :mod:`controlplane.apps.profile_run`);
        how many rows were touched."""
        ids = list(instance_ids)
        if not ids:
            return 0
        with transaction(self._sessions) as session:
            result = session.execute(
                update(m.Instance)
                .where(m.Instance.id.in_(ids), m.Instance.state.in_(_values(LIVE_STATES)))
                .values(updated_at=self._now(at))
                .execution_options(synchronize_session=False)
            )
            return cast(CursorResult[Any], result).rowcount

    @_translated
    def set_provider_id(self, instance_id: str, provider_id: str) -> InstanceRecord:
        """Record the provider's id of the instance (without a state change)."""
        try:
            with transaction(self._sessions) as session:
                instance, app = _instance_row(session, instance_id)
                instance.provider_id = _label(provider_id, "provider_id")
                instance.updated_at = self._now(None)
                session.flush()
                return _instance_record(instance, app)
        except IntegrityError:
            raise ConflictError(
                f"provider id {provider_id!r} is already recorded for another instance"
            ) from None

    @_translated
    def list_instance_events(
        self,
        *,
        app: str | None = None,
        instance_id: str | None = None,
        since: datetime | None = None,
        limit: int | None = None,
    ) -> list[InstanceEventRecord]:
        with transaction(self._sessions) as session:
            query = select(m.InstanceEvent, m.App.name).join(
                m.Instance, m.Instance.id == m.InstanceEvent.instance_id
            )
            query = query.join(m.App, m.App.id == m.Instance.app_id)
            if app is not None:
                query = query.where(m.Instance.app_id == _app_row(session, app).id)
            if instance_id is not None:
                query = query.where(m.InstanceEvent.instance_id == instance_id)
            if since is not None:
                query = query.where(m.InstanceEvent.at > self._now(since))
            rows = _newest_rows(session, query, m.InstanceEvent.at, m.InstanceEvent.id, limit)
            return [_event_record(event, name) for event, name in rows]

    # --- profile scales (online calibration) ----------------------------------------------------

    @_translated
    def set_profile_scale(
        self,
        app: str,
        model: str,
        instance_type: str,
        factor: float,
        *,
        at: datetime | None = None,
    ) -> ProfileScaleRecord:
        """Set the calibration factor of ``model`` on ``instance_type`` for ``app`` (finite,
        > 0; it replaces the one before)."""
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 0):
            raise InvalidValueError("factor", f"must be finite and > 0, got {factor!r}")
        model = _label(model, "model", max_length=m.PROFILE_SCALE_MODEL_MAX)
        instance_type = _label(instance_type, "instance_type", max_length=m.PROFILE_SCALE_TYPE_MAX)
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            scale = session.scalar(
                select(m.ProfileScale).where(
                    m.ProfileScale.app_id == row.id,
                    m.ProfileScale.model == model,
                    m.ProfileScale.instance_type == instance_type,
                )
            )
            if scale is None:
                scale = m.ProfileScale(
                    app_id=row.id,
                    model=model,
                    instance_type=instance_type,
                    factor=float(factor),
                    updated_at=now,
                )
                session.add(scale)
            else:
                scale.factor = float(factor)
                scale.updated_at = now
            session.flush()
            return ProfileScaleRecord(app, model, instance_type, scale.factor, scale.updated_at)

    @_translated
    def list_profile_scales(self, app: str) -> list[ProfileScaleRecord]:
        """The calibration factors of ``app``, by model then instance type."""
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            scales = session.scalars(
                select(m.ProfileScale)
                .where(m.ProfileScale.app_id == row.id)
                .order_by(m.ProfileScale.model, m.ProfileScale.instance_type)
            )
            return [
                ProfileScaleRecord(app, s.model, s.instance_type, s.factor, s.updated_at)
                for s in scales
            ]

    @_translated
    def set_serving_overhead(
        self,
        app: str,
        overhead_ms: float,
        samples: int,
        *,
        quantiles_ms: Sequence[float] = (),
        at: datetime | None = None,
    ) -> ServingOverheadRecord:
        """Set ``app``'s measured control-plane overhead per query (ms, finite, >= 0) over
        ``samples`` (>= 1) answered queries, with its distribution ``quantiles_ms`` (finite,
        >= 0, non-decreasing; may be empty); it replaces the one before."""
        if not (
            isinstance(overhead_ms, int | float) and math.isfinite(overhead_ms) and overhead_ms >= 0
        ):
            raise InvalidValueError("overhead_ms", f"must be finite and >= 0, got {overhead_ms!r}")
        quantiles = [float(q) for q in quantiles_ms]
        if not all(math.isfinite(q) and q >= 0 for q in quantiles) or any(
            b < a for a, b in itertools.pairwise(quantiles)
        ):
            raise InvalidValueError("quantiles_ms", "must be finite, >= 0 and non-decreasing")
        if not (isinstance(samples, int) and samples >= 1):
            raise InvalidValueError("samples", f"must be an integer >= 1, got {samples!r}")
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.scalar(
                select(m.ServingOverhead).where(m.ServingOverhead.app_id == row.id)
            )
            if found is None:
                found = m.ServingOverhead(app_id=row.id)
                session.add(found)
            found.overhead_ms = float(overhead_ms)
            found.samples = samples
            found.updated_at = now
            found.quantiles_ms = quantiles or None
            session.flush()
            return _overhead_record(app, found)

    @_translated
    def get_serving_overhead(self, app: str) -> ServingOverheadRecord | None:
        """``app``'s measured control-plane overhead per query, None before any was measured."""
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.scalar(
                select(m.ServingOverhead).where(m.ServingOverhead.app_id == row.id)
            )
            if found is None:
                return None
            return _overhead_record(app, found)

    # --- the model registry and measured profiles -----------------------------------------------

    @_translated
    def next_model_version(self, name: str) -> int:
        """The version a new push of ``name`` takes: one past its newest (1 for a new name).
        Two pushes may both see the same number; :meth:`add_model_version` lets one win."""
        with transaction(self._sessions) as session:
            newest = session.scalar(
                select(func.max(m.ModelVersion.version)).where(m.ModelVersion.name == name)
            )
            return 1 if newest is None else int(newest) + 1

    @_translated
    def add_model_version(
        self,
        name: str,
        version: int,
        format: str,
        sha256: str,
        size_bytes: int,
        signature: ModelSignature,
        uri: str,
        *,
        at: datetime | None = None,
    ) -> ModelVersionRecord:
        """Record version ``version`` of model ``name`` (its blob already stored at ``uri``).
        :class:`ConflictError` when that version exists (a concurrent push took it: ask
        :meth:`next_model_version` again); :class:`InvalidValueError` for a value that is not
        a registry version's (a bad name, format, checksum, size or URI)."""
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise InvalidValueError("size_bytes", f"must be an integer >= 0, got {size_bytes!r}")
        try:
            # The reference's own checks: a DNS-label name, a version >= 1, a known format,
            # a sha256 of 64 hex digits, a file:// or s3:// URI.
            ArtifactRef(name, name, version, format, sha256, uri)
        except ArtifactError as error:
            raise InvalidValueError("model", str(error)) from None
        now = self._now(at)
        try:
            with transaction(self._sessions) as session:
                row = m.ModelVersion(
                    name=name,
                    version=version,
                    format=format,
                    sha256=sha256,
                    size_bytes=size_bytes,
                    signature=_json_document(signature.to_json(), "signature"),
                    uri=uri,
                    created_at=now,
                )
                session.add(row)
                session.flush()
                return _model_version_record(row)
        except IntegrityError:
            raise ConflictError(
                f"model {name!r} version {version} was pushed by another request; push again"
            ) from None

    @_translated
    def list_model_versions(self, name: str | None = None) -> list[ModelVersionRecord]:
        """Every version of every model (of ``name`` only, when given), by name then version;
        an unknown name has none."""
        query = select(m.ModelVersion).order_by(m.ModelVersion.name, m.ModelVersion.version)
        if name is not None:
            query = query.where(m.ModelVersion.name == name)
        with transaction(self._sessions) as session:
            return [_model_version_record(row) for row in session.scalars(query)]

    @_translated
    def get_model_version(self, name: str, version: int | None = None) -> ModelVersionRecord:
        """Version ``version`` of model ``name``, its newest when ``version`` is None;
        :class:`NotFoundError` (kind ``model``) when there is none."""
        query = select(m.ModelVersion).where(m.ModelVersion.name == name)
        if version is None:
            query = query.order_by(m.ModelVersion.version.desc()).limit(1)
        else:
            query = query.where(m.ModelVersion.version == version)
        with transaction(self._sessions) as session:
            row = session.scalar(query)
            if row is None:
                raise NotFoundError("model", name if version is None else f"{name}@{version}")
            return _model_version_record(row)

    @_translated
    def put_app_profiles(
        self, app: str, document: Mapping[str, Any], *, at: datetime | None = None
    ) -> None:
        """Store ``app``'s measured latency profiles (a profile JSON document), replacing the
        ones before; :class:`NotFoundError` for an app not registered."""
        stored = _json_document(document, "document")
        now = self._now(at)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            found = session.get(m.AppProfiles, row.id)
            if found is None:
                session.add(m.AppProfiles(app_id=row.id, document=stored, measured_at=now))
            else:
                found.document = stored
                found.measured_at = now

    @_translated
    def get_app_profiles(self, app: str) -> dict[str, Any] | None:
        """``app``'s measured latency profiles; None when none were measured (or no such app
        is registered: an app being registered has none yet)."""
        with transaction(self._sessions) as session:
            found = session.execute(
                select(m.AppProfiles.document)
                .join(m.App, m.App.id == m.AppProfiles.app_id)
                .where(m.App.name == app)
            ).scalar_one_or_none()
            return None if found is None else dict(found)

    # --- decisions and metrics -----------------------------------------------------------------

    @_translated
    def record_decision(
        self,
        app: str,
        kind: str,
        reason: str,
        numbers: Mapping[str, Any] | None = None,
        *,
        at: datetime | None = None,
        key: str | None = None,
    ) -> DecisionRecord:
        """Record what a policy decided (``kind``: scale_up, scale_down, gear_switch, replan,
        budget_drain, ...), why, and the numbers behind it (a JSON object).

        ``key`` is the caller's identity of "the same decision" (``f"{request_id}:{error}"`` for
        a failed launch, ``f"{stage}:{reason}"`` for a budget cap). A keyed decision repeats the
        app's newest one of the same kind and key when that one is still the app's latest
        decision of the kind, or was last made within ``decision_merge_window_s``: its row then
        counts one more (``count``), takes ``at`` as its ``last_at`` and the newest reason and
        numbers, and keeps its first ``at``. Anything else adds a row (count 1)."""
        body = _json_document(numbers or {}, "numbers")
        now = self._now(at)
        kind = _label(kind, "kind", max_length=32)
        if key is not None:
            key = _label(key, "key", max_length=_DECISION_KEY_MAX)
        with transaction(self._sessions) as session:
            row = _app_row(session, app)
            same = None if key is None else self._repeated(session, row.id, kind, key, now)
            if same is not None:
                same.count += 1
                seen = same.at if same.last_at is None else same.last_at
                same.last_at = max(seen, now)
                same.reason = reason
                same.numbers = body
                session.flush()
                return _decision_record(same, app)
            decision = m.Decision(
                app_id=row.id, at=now, kind=kind, reason=reason, numbers=body, key=key, count=1
            )
            session.add(decision)
            session.flush()
            return _decision_record(decision, app)

    def _repeated(
        self, session: Session, app_id: int, kind: str, key: str, now: datetime
    ) -> m.Decision | None:
        """The row a keyed decision repeats (see :meth:`record_decision`), or None."""
        newest = (m.Decision.at.desc(), m.Decision.id.desc())
        same = session.scalars(
            select(m.Decision)
            .where(m.Decision.app_id == app_id, m.Decision.kind == kind, m.Decision.key == key)
            .order_by(*newest)
            .limit(1)
        ).first()
        if same is None:
            return None
        seen = same.at if same.last_at is None else same.last_at
        if (now - seen).total_seconds() <= self.decision_merge_window_s:
            return same
        latest = session.scalars(
            select(m.Decision.id)
            .where(m.Decision.app_id == app_id, m.Decision.kind == kind)
            .order_by(*newest)
            .limit(1)
        ).first()
        return same if latest == same.id else None

    @_translated
    def list_decisions(
        self,
        app: str | None = None,
        *,
        since: datetime | None = None,
        kinds: Iterable[str] | None = None,
        exclude_kinds: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[DecisionRecord]:
        """The decisions (of ``app``), oldest first: after ``since``, of ``kinds`` only and of
        none of ``exclude_kinds``, filtered in the query, so ``limit`` (the newest that many)
        counts only the decisions that pass."""
        with transaction(self._sessions) as session:
            query = select(m.Decision, m.App.name).join(m.App, m.App.id == m.Decision.app_id)
            if app is not None:
                query = query.where(m.Decision.app_id == _app_row(session, app).id)
            if since is not None:
                query = query.where(m.Decision.at > self._now(since))
            if kinds is not None:
                query = query.where(m.Decision.kind.in_(list(kinds)))
            if exclude_kinds is not None:
                query = query.where(m.Decision.kind.not_in(list(exclude_kinds)))
            rows = _newest_rows(session, query, m.Decision.at, m.Decision.id, limit)
            return [_decision_record(decision, name) for decision, name in rows]

    @_translated
    def add_metric_sample(
        self,
        app: str,
        *,
        arrival_rate_qps: float,
        fleet_cost_usd_per_hr: float,
        latency_p50_ms: float | None = None,
        latency_p95_ms: float | None = None,
        latency_p99_ms: float | None = None,
        attainment_share: float | None = None,
        gear: str | None = None,
        accuracy: float | None = None,
        at: datetime | None = None,
    ) -> MetricSampleRecord:
        """Record one rolled-up sample of the app's load, latency, SLO attainment and cost."""
        sample = m.MetricSample(
            at=self._now(at),
            arrival_rate_qps=_number(arrival_rate_qps, "arrival_rate_qps"),
            latency_p50_ms=_optional_number(latency_p50_ms, "latency_p50_ms"),
            latency_p95_ms=_optional_number(latency_p95_ms, "latency_p95_ms"),
            latency_p99_ms=_optional_number(latency_p99_ms, "latency_p99_ms"),
            attainment_share=_optional_number(attainment_share, "attainment_share", upper=1.0),
            fleet_cost_usd_per_hr=_number(fleet_cost_usd_per_hr, "fleet_cost_usd_per_hr"),
            gear=None if gear is None else _label(gear, "gear", max_length=64),
            accuracy=_optional_number(accuracy, "accuracy", upper=1.0),
        )
        with transaction(self._sessions) as session:
            sample.app_id = _app_row(session, app).id
            session.add(sample)
            session.flush()
            return _sample_record(sample, app)

    @_translated
    def metric_series(
        self,
        app: str,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
    ) -> list[MetricSampleRecord]:
        """The app's samples with ``since < at <= until``, oldest first."""
        with transaction(self._sessions) as session:
            query = select(m.MetricSample).where(m.MetricSample.app_id == _app_row(session, app).id)
            if since is not None:
                query = query.where(m.MetricSample.at > self._now(since))
            if until is not None:
                query = query.where(m.MetricSample.at <= self._now(until))
            samples = _newest(session, query, m.MetricSample.at, m.MetricSample.id, limit)
            return [_sample_record(sample, app) for sample in samples]

    @_translated
    def delete_metric_samples(self, *, before: datetime) -> int:
        """Delete every sample older than ``before`` (retention); return how many went."""
        with transaction(self._sessions) as session:
            result = session.execute(
                delete(m.MetricSample).where(m.MetricSample.at < self._now(before))
            )
            return int(cast(CursorResult[Any], result).rowcount)

    @_translated
    def delete_decisions(self, *, before: datetime | None = None, keep: int | None = None) -> int:
        """Retention of the decision log: delete every decision last made before ``before``
        (``last_at``, else ``at``), and all but the newest ``keep`` (by first time) of each app;
        return how many went."""
        removed = 0
        with transaction(self._sessions) as session:
            if before is not None:
                seen = func.coalesce(m.Decision.last_at, m.Decision.at)
                result = session.execute(delete(m.Decision).where(seen < self._now(before)))
                removed += int(cast(CursorResult[Any], result).rowcount)
            if keep is not None:
                if keep < 0:
                    raise InvalidValueError("keep", f"must be >= 0, got {keep}")
                crowded = session.scalars(
                    select(m.Decision.app_id)
                    .group_by(m.Decision.app_id)
                    .having(func.count(m.Decision.id) > keep)
                ).all()
                for app_id in crowded:
                    older = (
                        select(m.Decision.id)
                        .where(m.Decision.app_id == app_id)
                        .order_by(m.Decision.at.desc(), m.Decision.id.desc())
                        .offset(keep)
                    )
                    ids = list(session.scalars(older))
                    for start in range(0, len(ids), 500):
                        result = session.execute(
                            delete(m.Decision).where(m.Decision.id.in_(ids[start : start + 500]))
                        )
                        removed += int(cast(CursorResult[Any], result).rowcount)
        return removed

    # --- tokens --------------------------------------------------------------------------------

    def create_token(
        self, scope: str, name: str | None = None, *, at: datetime | None = None
    ) -> str:
        """Make a token of ``scope`` named ``name`` (default ``<scope>-<random>``); return the
        token itself, which is shown this once (only its SHA-256 is kept).
        :class:`UnknownScopeError` for an unknown scope, :class:`ConflictError` for a name
        taken."""
        token, _ = self.issue_token(scope, name, at=at)
        return token

    @_translated
    def issue_token(
        self, scope: str, name: str | None = None, *, at: datetime | None = None
    ) -> tuple[str, TokenRecord]:
        """:meth:`create_token`, with the stored record (its name, when it was made)."""
        granted = auth.parse_scope(scope)
        label = _label(name, "name") if name is not None else f"{granted}-{secrets.token_hex(4)}"
        token = auth.generate_token()
        try:
            with transaction(self._sessions) as session:
                row = m.ApiToken(
                    name=label,
                    scope=granted.value,
                    token_hash=auth.hash_token(token),
                    created_at=self._now(at),
                    revoked_at=None,
                    last_used_at=None,
                )
                session.add(row)
                session.flush()
                return token, _token_record(row)
        except IntegrityError:
            raise ConflictError(f"a token named {label!r} already exists") from None

    def cached_principal(self, token: str) -> Principal | None:
        """Who ``token`` belongs to when :meth:`verify_token` answered that within the last
        ``TOKEN_CACHE_S`` (no database read: cheap enough for the event loop); None otherwise,
        and then only :meth:`verify_token` can tell. A revocation in this process clears the
        cache at once; one in another process is seen within ``TOKEN_CACHE_S``, as it is by
        :meth:`verify_token`."""
        return self.cached_token(token)[0]

    def cached_token(self, token: str) -> tuple[Principal | None, bool]:
        """:meth:`cached_principal`, and whether a new :meth:`verify_token` with ``fresh`` is
        due: no answer is cached, or the cached one is past half of its ``TOKEN_CACHE_S``. A
        caller that verifies again when it is due (in the background, the cached answer still
        standing meanwhile) keeps a token in use cached without ever trusting an answer older
        than ``TOKEN_CACHE_S``."""
        if not auth.looks_like_token(token):
            return None, False
        now = self._now(None)
        cached = self._cached(auth.hash_token(token), now)
        if cached is None:
            return None, True
        return cached[0], now >= cached[1] - timedelta(seconds=TOKEN_CACHE_S / 2)

    def _cached(self, digest: str, now: datetime) -> tuple[Principal, datetime] | None:
        """The cached answer for ``digest`` and when it expires, while it has not."""
        with self._token_lock:
            cached = self._token_cache.get(digest)
        return cached if cached is not None and now < cached[1] else None

    @_translated
    def verify_token(
        self, token: str, *, at: datetime | None = None, fresh: bool = False
    ) -> Principal | None:
        """Who ``token`` belongs to, or None when it is unknown or revoked. Looked up by its
        SHA-256 and compared in constant time; ``last_used_at`` is refreshed (at most once a
        minute). An answer of the last ``TOKEN_CACHE_S`` stands unless ``fresh``: then the
        database is read whatever is cached, and a token it no longer knows leaves the cache."""
        if not auth.looks_like_token(token):
            return None
        digest = auth.hash_token(token)
        now = self._now(at)
        cached = None if fresh else self._cached(digest, now)
        if cached is not None:
            return cached[0]
        with self._token_lock:
            generation = self._token_generation
        with transaction(self._sessions) as session:
            row = session.scalar(select(m.ApiToken).where(m.ApiToken.token_hash == digest))
            if row is None or not auth.hashes_match(token, row.token_hash) or row.revoked_at:
                principal = None
            else:
                last = row.last_used_at
                if last is None or (now - last).total_seconds() >= LAST_USED_RESOLUTION_S:
                    row.last_used_at = now
                principal = Principal(row.name, row.scope)
        with self._token_lock:
            if principal is None:
                self._token_cache.pop(digest, None)
                return None
            if generation != self._token_generation:
                return principal  # a revocation meanwhile: this answer may predate it
            if len(self._token_cache) >= TOKEN_CACHE_MAX:
                self._token_cache.clear()
            self._token_cache[digest] = (principal, now + timedelta(seconds=TOKEN_CACHE_S))
        return principal

    @_translated
    def revoke_token(self, name: str, *, at: datetime | None = None) -> TokenRecord:
        """Revoke the token named ``name`` (again: no change)."""
        with transaction(self._sessions) as session:
            row = session.scalar(select(m.ApiToken).where(m.ApiToken.name == name))
            if row is None:
                raise NotFoundError("token", name)
            if row.revoked_at is None:
                row.revoked_at = self._now(at)
            session.flush()
            record = _token_record(row)
        # After the commit: an answer cached meanwhile from the old row goes too, and one read
        # before the commit but not cached yet is not cached.
        with self._token_lock:
            self._token_cache.clear()
            self._token_generation += 1
        return record

    @_translated
    def get_token(self, name: str) -> TokenRecord:
        with transaction(self._sessions) as session:
            row = session.scalar(select(m.ApiToken).where(m.ApiToken.name == name))
            if row is None:
                raise NotFoundError("token", name)
            return _token_record(row)

    @_translated
    def list_tokens(self) -> list[TokenRecord]:
        with transaction(self._sessions) as session:
            rows = session.scalars(
                select(m.ApiToken).order_by(m.ApiToken.created_at, m.ApiToken.id)
            )
            return [_token_record(row) for row in rows]

    # --- dashboard sessions --------------------------------------------------------------------
    # The dashboard's sign-ins (controlplane/dashboard/routes.py): the browser's cookie holds a
    # random session id, the table its SHA-256, the token it was opened with and when it ends.
    # In the database, so that every replica of the API sees the same sign-ins.

    # A session id starts so: never mistaken for an API token (hp_...).
    DASHBOARD_SESSION_PREFIX = "hs_"

    @_translated
    def open_dashboard_session(
        self, token: str, *, lifetime_s: float, at: datetime | None = None
    ) -> str:
        """Open a sign-in for ``token`` that ends ``lifetime_s`` from now; return its session id
        (``hs_`` and 43 URL-safe characters, 256 bits), shown this once: only its SHA-256 is
        kept. :class:`NotFoundError` when the token is unknown or revoked. Sessions that have
        ended (of any token) are deleted on the way, so the table holds live ones only."""
        from datetime import timedelta  # (here: this section is appended to the class alone)

        lifetime = _number(lifetime_s, "lifetime_s", positive=True)
        now = self._now(at)
        session_id = self.DASHBOARD_SESSION_PREFIX + secrets.token_urlsafe(32)
        with transaction(self._sessions) as session:
            session.execute(delete(m.DashboardSession).where(m.DashboardSession.expires_at <= now))
            row = (
                session.scalar(
                    select(m.ApiToken).where(m.ApiToken.token_hash == auth.hash_token(token))
                )
                if auth.looks_like_token(token)
                else None
            )
            if row is None or row.revoked_at is not None:
                raise NotFoundError("token", "(the one given)")
            session.add(
                m.DashboardSession(
                    session_hash=auth.hash_token(session_id),
                    token_id=row.id,
                    created_at=now,
                    expires_at=now + timedelta(seconds=lifetime),
                )
            )
        return session_id

    @_translated
    def verify_dashboard_session(
        self, session_id: str, *, at: datetime | None = None
    ) -> Principal | None:
        """Who the sign-in ``session_id`` belongs to, or None when it is unknown, has ended, or
        its token has been revoked (an ended or revoked one is deleted)."""
        if not session_id.startswith(self.DASHBOARD_SESSION_PREFIX) or len(session_id) > 128:
            return None
        digest = auth.hash_token(session_id)
        now = self._now(at)
        with transaction(self._sessions) as session:
            found = session.execute(
                select(m.DashboardSession, m.ApiToken)
                .join(m.ApiToken, m.ApiToken.id == m.DashboardSession.token_id)
                .where(m.DashboardSession.session_hash == digest)
            ).one_or_none()
            if found is None:
                return None
            row, token = found
            if not auth.hashes_match(session_id, row.session_hash):
                return None
            if row.expires_at <= now or token.revoked_at is not None:
                session.delete(row)
                return None
            return Principal(token.name, token.scope)

    @_translated
    def close_dashboard_session(self, session_id: str) -> bool:
        """End the sign-in ``session_id`` (sign-out); whether there was one."""
        digest = auth.hash_token(session_id)
        with transaction(self._sessions) as session:
            result = session.execute(
                delete(m.DashboardSession).where(m.DashboardSession.session_hash == digest)
            )
            return int(cast(CursorResult[Any], result).rowcount) > 0

    @_translated
    def count_dashboard_sessions(self, *, token: str | None = None) -> int:
        """How many sign-ins are stored (of the token named ``token``, or of all)."""
        query = select(func.count()).select_from(m.DashboardSession)
        if token is not None:
            query = query.join(m.ApiToken, m.ApiToken.id == m.DashboardSession.token_id).where(
                m.ApiToken.name == token
            )
        with transaction(self._sessions) as session:
            return int(session.scalar(query) or 0)


# --- helpers ---------------------------------------------------------------------------------


def _overhead_record(app: str, row: m.ServingOverhead) -> ServingOverheadRecord:
    return ServingOverheadRecord(
        app, row.overhead_ms, row.samples, row.updated_at, tuple(row.quantiles_ms or ())
    )


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
    if expected_version is not None and row.version != expected_version:
        raise ConflictError(
            f"app {row.name!r} is at version {row.version}, not {expected_version}; read it again"
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
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise InvalidValueError(
            field, f"must be a string of 1 to {max_length} characters, got {value!r}"
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


# --- rows to records -------------------------------------------------------------------------


def _app_record(row: m.App) -> AppRecord:
    return AppRecord(
        id=row.id,
        name=row.name,
        spec=dict(row.spec),
        budget_usd_per_hr=row.budget_usd_per_hr,
        applied_plan_id=row.applied_plan_id,
        version=row.version,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _budget_record(row: m.BudgetChange, app: str) -> BudgetChangeRecord:
    return BudgetChangeRecord(
        id=row.id,
        app=app,
        who=row.who,
        at=row.at,
        old_usd_per_hr=row.old_usd_per_hr,
        new_usd_per_hr=row.new_usd_per_hr,
        reason=row.reason,
    )


def _plan_record(row: m.Plan, app: str) -> PlanRecord:
    return PlanRecord(
        id=row.id,
        app=app,
        number=row.number,
        status=row.status,
        document=dict(row.document),
        app_version=row.app_version,
        created_at=row.created_at,
        applied_at=row.applied_at,
    )


def _instance_record(row: m.Instance, app: str) -> InstanceRecord:
    return InstanceRecord(
        id=row.id,
        app=app,
        request_id=row.request_id,
        provider_id=row.provider_id,
        instance_type=row.instance_type,
        state=row.state,
        price_usd_per_hr=row.price_usd_per_hr,
        created_at=row.created_at,
        updated_at=row.updated_at,
        market=row.market,
    )


def _event_record(row: m.InstanceEvent, app: str) -> InstanceEventRecord:
    return InstanceEventRecord(
        id=row.id,
        instance_id=row.instance_id,
        app=app,
        from_state=row.from_state,
        to_state=row.to_state,
        at=row.at,
        reason=row.reason,
    )


def _decision_record(row: m.Decision, app: str) -> DecisionRecord:
    return DecisionRecord(
        id=row.id,
        app=app,
        at=row.at,
        kind=row.kind,
        reason=row.reason,
        numbers=dict(row.numbers),
        count=row.count,
        last_at=row.last_at,
        key=row.key,
    )


def _sample_record(row: m.MetricSample, app: str) -> MetricSampleRecord:
    return MetricSampleRecord(
        app=app,
        at=row.at,
        arrival_rate_qps=row.arrival_rate_qps,
        latency_p50_ms=row.latency_p50_ms,
        latency_p95_ms=row.latency_p95_ms,
        latency_p99_ms=row.latency_p99_ms,
        attainment_share=row.attainment_share,
        fleet_cost_usd_per_hr=row.fleet_cost_usd_per_hr,
        gear=row.gear,
        accuracy=row.accuracy,
    )


def _model_version_record(row: m.ModelVersion) -> ModelVersionRecord:
    return ModelVersionRecord(
        name=row.name,
        version=row.version,
        format=row.format,
        sha256=row.sha256,
        size_bytes=int(row.size_bytes),
        signature=ModelSignature.from_json(row.signature),
        uri=row.uri,
        created_at=row.created_at,
    )


def _token_record(row: m.ApiToken) -> TokenRecord:
    return TokenRecord(
        id=row.id,
        name=row.name,
        scope=row.scope,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )
