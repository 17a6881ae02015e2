"""The database schema: one typed SQLAlchemy 2.0 ORM class per table.

Tables (docs/service.md describes each column):

- ``apps``: a registered app, its spec document, its budget, its applied plan, and ``version``
  (optimistic concurrency: every change of the app row bumps it; a write that names a version it
  saw fails when another write came in between);
- ``budget_changes``: the audit trail of an app's budget (who, when, old, new, why);
- ``plans``: previewed, applied and superseded plans of an app (the ``Plan.to_document`` JSON);
- ``instances`` and ``instance_events``: the machines we run and every move through the lifecycle
  table of :mod:`controlplane.policies.lifecycle`;
- ``decisions``: what the policies decided and why (scale up/down, gear switches, replans);
- ``metric_samples``: the rolled-up load, latency, SLO attainment and cost of an app over time;
- ``api_tokens``: the SHA-256 hashes of the API tokens with their scope;
- ``profile_scales``: the online calibration's factor per (app, model, instance type): the app's
  resolved profiles are its profile files' samples times this factor; and, once the live round
  trips' spread was found off the profile's, that spread (``spread``, a unit-mean shape);
- ``serving_overheads``: the control plane's own time per query of an app as the serving loop
  measured it (the API's receipt to the dispatch queue, and the dispatch's wait on the event
  loop), which the planner adds to every
  query's simulated latency;
- ``dashboard_sessions``: the dashboard's sign-ins (the SHA-256 of a random session id, the token
  it was opened with, when it ends), shared by every replica of the API;
- ``model_versions``: the model registry (:mod:`controlplane.registry`): every pushed version of
  every model, immutable: its format, the sha256 and size of its file, its signature (inputs and
  outputs) and where the blob store keeps it; not owned by any app (apps name models);
- ``app_profiles``: the latency profiles measured for an app's artifact models (``heteroplane
  profile run``), one profile JSON document per app (the format ``estimator.profiles`` reads);
- ``rollouts``: a new version of one of an app's models moving into it step by step
  (:mod:`controlplane.policies.rollout`): its state, step, settings and last figures.

Deleting an app deletes its rows in every other table (``ON DELETE CASCADE``); the store only
deletes an app without live instances unless forced (see :meth:`Store.delete_app`).

Times are timezone-aware UTC datetimes in Python (:class:`UtcDateTime`): ``timestamptz`` on
PostgreSQL, naive UTC text on SQLite (which has no time zones); a naive datetime is refused.

Constraint names follow :data:`NAMING_CONVENTION`, so Alembic's migrations name every index and
constraint the same way on every database.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from controlplane.policies.auth import Scope
from controlplane.policies.lifecycle import InstanceState
from controlplane.policies.rollout_states import RolloutState

__all__ = [
    "NAMING_CONVENTION",
    "PLAN_STATUSES",
    "ApiToken",
    "App",
    "AppProfiles",
    "Base",
    "BudgetChange",
    "DashboardSession",
    "DecisionRow",
    "Instance",
    "InstanceEvent",
    "MetricSample",
    "ModelVersion",
    "Plan",
    "ProfileScale",
    "ServingOverhead",
    "UtcDateTime",
]

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

PLAN_STATUSES = ("previewed", "applied", "superseded")

# Lengths: an app name is a DNS label (controlplane.spec); EC2 ids are at most 19 characters
# today, with room to grow; token names and request ids are ours.
_NAME = 63
_SHORT = 16
_ID = 64
_LABEL = 100
_KEY = 200
PROFILE_SCALE_MODEL_MAX = _LABEL
PROFILE_SCALE_TYPE_MAX = _ID
# provisioners.artifacts.FORMATS (the layer rule keeps the models free of the provisioners).
MODEL_FORMATS = ("onnx", "torchscript")

# The tables whose ids name a thing outside its row (a plan id in a log line, the gear table, a
# script): SQLite's AUTOINCREMENT never gives an id twice, where a plain rowid goes to the next
# row once the newest is deleted (PostgreSQL's sequences never do). Migration 0013.
_NEVER_REUSED: dict[str, Any] = {"sqlite_autoincrement": True}


def _one_of(column: str, values: Iterable[str]) -> str:
    listed = ", ".join(f"'{value}'" for value in values)
    return f"{column} IN ({listed})"


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime, stored the same way on SQLite and PostgreSQL."""

    impl = DateTime
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(timezone=True)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"a naive datetime cannot be stored (give it a time zone): {value}")
        value = value.astimezone(UTC)
        # SQLite keeps text without an offset: store UTC wall time, read it back as UTC.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 (SQLAlchemy reads this class attribute)
        datetime: UtcDateTime,
        dict[str, Any]: JSON,
        float: Float,
    }


class App(Base):
    __tablename__ = "apps"
    __table_args__ = (
        CheckConstraint("budget_usd_per_hr > 0", name="budget_positive"),
        CheckConstraint("version >= 1", name="version_positive"),
        _NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(_NAME), unique=True)
    spec: Mapped[dict[str, Any]]
    budget_usd_per_hr: Mapped[float]
    # plans also points at apps; the constraint is added after both tables exist.
    applied_plan_id: Mapped[int | None] = mapped_column(
        ForeignKey("plans.id", ondelete="SET NULL", use_alter=True)
    )
    version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class BudgetChange(Base):
    __tablename__ = "budget_changes"
    __table_args__ = (Index(None, "app_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    who: Mapped[str] = mapped_column(String(_LABEL))
    at: Mapped[datetime]
    # None for the budget an app was registered with.
    old_usd_per_hr: Mapped[float | None]
    new_usd_per_hr: Mapped[float]
    reason: Mapped[str] = mapped_column(Text)


class Plan(Base):
    __tablename__ = "plans"
    __table_args__ = (
        UniqueConstraint("app_id", "number"),
        CheckConstraint(_one_of("status", PLAN_STATUSES), name="status"),
        _NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    # 1, 2, 3, ... per app.
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(_SHORT))
    document: Mapped[dict[str, Any]]
    # The app's version when the plan was made: applying it is refused once the app has changed.
    app_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]
    applied_at: Mapped[datetime | None]


class Instance(Base):
    __tablename__ = "instances"
    __table_args__ = (
        Index(None, "app_id", "state"),
        CheckConstraint(_one_of("state", [s.value for s in InstanceState]), name="state"),
    )

    id: Mapped[str] = mapped_column(String(_ID), primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    # The idempotency key of the launch: a retried launch finds the row the first one made.
    request_id: Mapped[str] = mapped_column(String(_LABEL), unique=True)
    provider_id: Mapped[str | None] = mapped_column(String(_ID), unique=True)
    instance_type: Mapped[str] = mapped_column(String(_ID))
    state: Mapped[str] = mapped_column(String(_SHORT))
    price_usd_per_hr: Mapped[float]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    # The purchase option it was launched with: on-demand or spot (docs/spot.md).
    market: Mapped[str] = mapped_column(
        String(_SHORT), default="on-demand", server_default="on-demand"
    )
    # A spot instance's price now, where the reconciler found its type's spot price moved away
    # from ``price_usd_per_hr`` (the launch price, kept: rule 10 reads the move from it); NULL:
    # the launch price is the price now (docs/spot.md).
    price_now_usd_per_hr: Mapped[float | None]


class InstanceEvent(Base):
    __tablename__ = "instance_events"
    __table_args__ = (Index(None, "instance_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_id: Mapped[str] = mapped_column(ForeignKey("instances.id", ondelete="CASCADE"))
    # None for the event that created the instance.
    from_state: Mapped[str | None] = mapped_column(String(_SHORT))
    to_state: Mapped[str] = mapped_column(String(_SHORT))
    at: Mapped[datetime]
    reason: Mapped[str] = mapped_column(Text)


class DecisionRow(Base):
    __tablename__ = "decisions"
    __table_args__ = (
        Index(None, "app_id", "at"),
        Index(None, "app_id", "kind", "key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    at: Mapped[datetime]
    # scale_up, scale_down, gear_switch, replan, budget_drain, ...
    kind: Mapped[str] = mapped_column(String(_SHORT * 2))
    reason: Mapped[str] = mapped_column(Text)
    numbers: Mapped[dict[str, Any]]
    # The caller's identity of "the same decision" (e.g. request id and error): a repeat of a
    # keyed decision bumps ``count`` and ``last_at`` of its row instead of adding one; ``at``
    # stays the first time. None: never merged.
    key: Mapped[str | None] = mapped_column(String(_KEY))
    count: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    last_at: Mapped[datetime | None]


class MetricSample(Base):
    __tablename__ = "metric_samples"
    __table_args__ = (Index(None, "app_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    at: Mapped[datetime]
    arrival_rate_qps: Mapped[float]
    # None when no query finished in the window.
    latency_p50_ms: Mapped[float | None]
    latency_p95_ms: Mapped[float | None]
    latency_p99_ms: Mapped[float | None]
    attainment_share: Mapped[float | None]
    fleet_cost_usd_per_hr: Mapped[float]
    gear: Mapped[str | None] = mapped_column(String(_ID))
    accuracy: Mapped[float | None]


class ApiToken(Base):
    __tablename__ = "api_tokens"
    __table_args__ = (
        CheckConstraint(_one_of("scope", [s.value for s in Scope]), name="scope"),
        _NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(_LABEL), unique=True)
    scope: Mapped[str] = mapped_column(String(_SHORT))
    # SHA-256 hex of the token; the token itself is never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


class ProfileScale(Base):
    __tablename__ = "profile_scales"
    __table_args__ = (
        UniqueConstraint("app_id", "model", "instance_type"),
        CheckConstraint("factor > 0", name="factor_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(PROFILE_SCALE_MODEL_MAX))
    instance_type: Mapped[str] = mapped_column(String(PROFILE_SCALE_TYPE_MAX))
    # Observed over profiled service time: the profile's samples are multiplied by it.
    factor: Mapped[float]
    updated_at: Mapped[datetime]
    # The observed round trips over their mean at calibration.OVERHEAD_QUANTILES (0..100 %):
    # the resolved profile's samples take this shape about their calibrated means; NULL: the
    # profile's own spread (none was found off, or a row from before).
    spread: Mapped[list[float] | None] = mapped_column(JSON, nullable=True)


class ServingOverhead(Base):
    __tablename__ = "serving_overheads"
    __table_args__ = (CheckConstraint("overhead_ms >= 0", name="overhead_ms_non_negative"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"), unique=True)
    # The median, ms, over ``samples`` answered queries, of the API's receipt to the dispatch
    # plus the dispatch's wait on the event loop (Split.own_ms).
    overhead_ms: Mapped[float]
    samples: Mapped[int]
    updated_at: Mapped[datetime]
    # Their quantiles at calibration.OVERHEAD_QUANTILES (0..100 %); NULL in rows from before.
    quantiles_ms: Mapped[list[float] | None] = mapped_column(JSON, nullable=True)
    # The serving process's CPU ms per answered query (observations.CpuMeter); NULL: not measured.
    cpu_ms: Mapped[float | None] = mapped_column(Float, nullable=True)


class DashboardSession(Base):
    """A dashboard sign-in: the browser's cookie holds a random session id, this row only its
    SHA-256. Revoking the token ends its sessions (the store checks ``revoked_at``); deleting the
    token deletes them (``ON DELETE CASCADE``)."""

    __tablename__ = "dashboard_sessions"
    __table_args__ = (CheckConstraint("expires_at > created_at", name="expires_after_created"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # SHA-256 hex of the session id; the id itself is only ever in the browser's cookie.
    session_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)


class ModelVersion(Base):
    """One pushed version of a registry model; rows are never changed. ``version`` is 1, 2, 3,
    ... per name (the unique constraint settles two concurrent pushes)."""

    __tablename__ = "model_versions"
    __table_args__ = (
        UniqueConstraint("name", "version"),
        CheckConstraint("version >= 1", name="version_positive"),
        CheckConstraint("size_bytes >= 0", name="size_non_negative"),
        CheckConstraint(_one_of("format", MODEL_FORMATS), name="format"),
        _NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(_NAME))
    version: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(_SHORT))
    # SHA-256 hex of the artifact's bytes: the worker checks the file it loads against it.
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # {"inputs": [...], "outputs": [...]} (provisioners.artifacts.ModelSignature.to_json).
    signature: Mapped[dict[str, Any]]
    # file:///... or s3://bucket/key.
    uri: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]


class AppProfiles(Base):
    """An app's measured latency profiles (``heteroplane profile run``): one document per app,
    replaced by the next measurement."""

    __tablename__ = "app_profiles"

    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"), primary_key=True)
    document: Mapped[dict[str, Any]]
    measured_at: Mapped[datetime]


class Rollout(Base):
    """A rollout of a new version of one model of an app (docs/rollouts.md). ``settings``
    holds its steps (shares), interval, shadow flag, thresholds and extra fleet; ``figures``
    the per-version figures of its current step as last judged; ``step_started_at`` when the
    current step began (a restart judges the step from there)."""

    __tablename__ = "rollouts"
    __table_args__ = (
        Index(None, "app_id", "state"),
        CheckConstraint(_one_of("state", [s.value for s in RolloutState]), name="state"),
        CheckConstraint("to_version >= 1", name="to_version_positive"),
        _NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(_NAME))
    # The registry model and its versions: the app's model ``model`` serves ``artifact``.
    artifact: Mapped[str] = mapped_column(String(_NAME))
    from_version: Mapped[int] = mapped_column(Integer)
    to_version: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(_SHORT))
    step_index: Mapped[int] = mapped_column(Integer, default=0)
    settings: Mapped[dict[str, Any]]
    figures: Mapped[dict[str, Any]]
    reason: Mapped[str] = mapped_column(Text)
    who: Mapped[str] = mapped_column(String(_LABEL))
    step_started_at: Mapped[datetime]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class AppDispatcher(Base):
    """Which serving process dispatches an app's queries, when several serve one database
    (docs/service.md, "Several serving processes"): the others forward the app's inference
    requests to ``url``. A lease: ``owner`` (a random id per serving process) renews
    ``expires_at``; past it another serving process takes the app over."""

    __tablename__ = "app_dispatchers"

    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id", ondelete="CASCADE"), primary_key=True)
    owner: Mapped[str] = mapped_column(String(_ID))
    url: Mapped[str] = mapped_column(Text)
    expires_at: Mapped[datetime]
