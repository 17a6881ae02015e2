"""The store's records: the frozen values its methods return (ORM rows never leave the store),
and how a row becomes one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from controlplane.db import models as m
from controlplane.policies.plan import PlanDocument
from provisioners.artifacts import ArtifactRef, ModelSignature

__all__ = [
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
    "TokenRecord",
]


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

    @property
    def spot_enabled(self) -> bool:
        """Whether the stored spec turns spot on (its ``spot`` block's ``enabled``)."""
        spot = self.spec.get("spot")
        return isinstance(spot, Mapping) and spot.get("enabled") is True


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
    # A spot instance's price now where its type's spot price moved since the launch (the
    # reconciler writes it); None: ``price_usd_per_hr``, the launch price, is the price now.
    price_now_usd_per_hr: float | None = None

    @property
    def cost_usd_per_hr(self) -> float:
        """What the instance costs an hour now: the spot price now where it moved since the
        launch, else the launch price (what the budget guard and every view of the cost read)."""
        now = self.price_now_usd_per_hr
        return self.price_usd_per_hr if now is None else now


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
    answered queries, of the API's receipt to the dispatch queue plus the dispatch's wait on the
    event loop, and ``quantiles_ms``, its
    distribution (the quantiles at :data:`~controlplane.policies.calibration.
    OVERHEAD_QUANTILES`; empty when not measured): the planner adds a draw from it to every
    query's simulated latency (the median when it is empty). ``cpu_ms``: the serving process's
    CPU time per answered query (None: not measured), the service time of the queue the planner
    puts in front of the workers."""

    app: str
    overhead_ms: float
    samples: int
    updated_at: datetime
    quantiles_ms: tuple[float, ...] = ()
    cpu_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ProfileScaleRecord:
    """The online calibration's factor for ``model`` on ``instance_type`` in ``app``: its profile's
    samples times ``factor`` predict what the serving loop observes; ``spread``, when stored,
    the live round trips' unit-mean shape (quantiles at :data:`~controlplane.policies.
    calibration.OVERHEAD_QUANTILES`; empty: the profile's own spread)."""

    app: str
    model: str
    instance_type: str
    factor: float
    updated_at: datetime
    spread: tuple[float, ...] = ()


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
        price_now_usd_per_hr=row.price_now_usd_per_hr,
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


def _decision_record(row: m.DecisionRow, app: str) -> DecisionRecord:
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


def _overhead_record(app: str, row: m.ServingOverhead) -> ServingOverheadRecord:
    return ServingOverheadRecord(
        app,
        row.overhead_ms,
        row.samples,
        row.updated_at,
        tuple(row.quantiles_ms or ()),
        row.cpu_ms,
    )
