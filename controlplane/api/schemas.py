"""The REST API's request and response bodies (pydantic: the API is a trust boundary).

Requests forbid unknown fields (a misspelt key is an error naming it, not a silently ignored
option) and bound every number: finite, and within a range no honest caller leaves (a budget of
at most :data:`MAX_BUDGET_USD_PER_HR`, a planning trace of at most
:data:`~controlplane.policies.planner.PLANNING_QUERIES` queries), so that bad input is a 422, never
a 5xx or an hour of simulation. The app spec itself is :class:`controlplane.spec.AppSpec`, the same
document the CLI reads. Responses are built from the store's records by the routes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from controlplane.apps.plans import DEFAULT_TRACE_QUERIES
from controlplane.policies.planner import PLANNING_QUERIES
from controlplane.spec import (
    MAX_BUDGET_USD_PER_HR,
    MAX_SLO_LATENCY_MS,
    MIN_BUDGET_USD_PER_HR,
    whole_number,
)

__all__ = [
    "DEFAULT_TRACE_QUERIES",
    "EXACT_FLOAT_INT",
    "MAX_BUDGET_USD_PER_HR",
    "MAX_INFER_SAMPLES",
    "MAX_RATE_QPS",
    "AppOut",
    "BudgetChangeIn",
    "BudgetChangeOut",
    "BudgetOut",
    "BudgetSetOut",
    "DecisionOut",
    "DrainOut",
    "ErrorBody",
    "ErrorDetail",
    "FleetOut",
    "FleetTypeOut",
    "HealthOut",
    "InferIn",
    "InferOut",
    "InstanceEventOut",
    "InstanceOut",
    "LoopsProcessOut",
    "MetricSampleOut",
    "PlanIn",
    "PlanOut",
    "RequirementsIn",
    "ServingOut",
    "ServingStageOut",
    "ServingTotalsOut",
    "ServingWorkerOut",
    "StageOut",
    "TeardownOut",
    "TimingsOut",
    "TraceIn",
    "TraceStatsOut",
]

# A budget above a million USD/hr is a typo (or an attack on the planner's enumeration).
# The fastest arrival rate a planning trace may have; the Kairos setting runs at tens of qps.
MAX_RATE_QPS = 1e5
# The slowest: a trace of the planning default's queries then spans two months, and one at
# 1e-300 qps spans more seconds than a float holds.
MIN_RATE_QPS = 1e-3
# Queries in a planning trace generated for a request that does not say.
_MAX_DURATION_S = 7 * 86_400.0
_MAX_SEED = 2**32 - 1
_MAX_REASON = 500

# strict: "3" is not a budget and true is not a rate (ints are accepted where floats are).
_REQUEST = ConfigDict(extra="forbid", strict=True, frozen=True)

# Responses are built from the store's records by attribute (`Out.model_validate(record)`), not
# copied field by field.
_RESPONSE = ConfigDict(frozen=True, from_attributes=True)


# An integer field of a request: strict (true and "7" are not integers), but 7.0 is 7.
_WholeNumber = Annotated[int, BeforeValidator(whole_number)]


# --- errors ----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """What went wrong: a stable ``code``, a one-line ``message``, the offending ``field``."""

    model_config = _RESPONSE

    code: str = Field(
        description="stable word to branch on: unauthorized, forbidden, not_found, conflict,"
        " app_exists, invalid_request, invalid_spec, invalid_value, unplannable, malformed_json,"
        " internal, ..."
    )
    message: str = Field(description="one line for a person")
    field: str | None = Field(
        default=None, description="path of the offending value (slo.latency_ms, trace.rate_qps)"
    )


class ErrorBody(BaseModel):
    """Every error answer's body."""

    model_config = _RESPONSE

    error: ErrorDetail


# --- health ----------------------------------------------------------------------------------


class LoopsProcessOut(BaseModel):
    model_config = _RESPONSE

    pid: int | None = Field(description="the loops process's pid; null while it is restarted")
    restarts: int = Field(description="how many times it was started again after it exited")
    url: str = Field(description="its API on loopback (its /healthz, its /metrics of the jobs)")
    role: Literal["leader", "standby"] | None = Field(
        description="its role under the leader lease; null while it does not answer"
    )
    serving_feed: Literal["ok", "down"] | None = Field(
        default=None,
        description="its feed from this serving process (the observed arrivals and statuses"
        " its tuner, gears and calibration read): down while it fails; null while the loops"
        " process does not answer",
    )


class HealthOut(BaseModel):
    model_config = _RESPONSE

    status: Literal["ok"] = "ok"
    version: str
    scheduler_running: bool = Field(description="whether this process's scheduler runs jobs")
    role: Literal["leader", "standby", "serving"] = Field(
        description="leader: this replica holds the leader lease and runs the periodic jobs"
        " (in the loops process it supervises, by default); standby: it serves the API and"
        " inference and takes over when the leader goes (docs/service.md, 'Replicas and the"
        " leader lease'); serving: it serves the API and inference only, the periodic jobs run"
        " in a loops process started apart (docs/service.md, 'Serving apart from the loops')"
    )
    loops: LoopsProcessOut | None = Field(
        default=None,
        description="the loops process this serving process started and supervises"
        " (heteroplane serve's default); null when there is none",
    )
    serving_feed: Literal["ok", "down"] | None = Field(
        default=None,
        description="a loops process's feed from the serving process (the arrivals and statuses"
        " its tuner, gears and calibration read): down while it fails, when its jobs see no"
        " traffic and leave every app on its plan; null in a process that serves (its loops read"
        " its own serving loop)",
    )
    serving_feed_down_s: float | None = Field(
        default=None, description="how long the feed has failed, s; null while it answers"
    )
    dispatch_owner: str | None = Field(
        default=None,
        description="this serving process's id among the dispatchers of a database several"
        " serve (docs/service.md, 'Several serving processes'): a process takes dispatch leases"
        " once its dispatch_url answers with its own id; null where there are none",
    )


# --- apps ------------------------------------------------------------------------------------


class AppOut(BaseModel):
    """A registered app: its spec (relative paths anchored), budget and applied plan."""

    model_config = _RESPONSE

    name: str
    spec: dict[str, Any] = Field(description="the app spec document (docs/app-spec.md)")
    budget_usd_per_hr: float
    applied_plan_id: int | None
    version: int = Field(description="bumped by every change of the app (spec, budget, plan)")
    created_at: datetime
    updated_at: datetime


# --- plans -----------------------------------------------------------------------------------


class TraceIn(BaseModel):
    """A synthetic planning trace: a renewal process at a constant rate (Poisson, or gamma gaps
    with ``cv2``), with batch sizes from ``batch_dist`` (``heteroplane trace generate``'s
    syntax)."""

    # The document says what the check below enforces: a poisson trace (the default kind) has
    # cv2 = 1, a gamma trace names its cv2 (a default of 1 would plan a Poisson trace under the
    # name gamma). The bound on rate_qps x duration_s is past what a JSON Schema can say.
    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"kind": {"const": "poisson"}}},
                    "then": {"properties": {"cv2": {"const": 1.0}}},
                },
                {
                    "if": {"properties": {"kind": {"const": "gamma"}}, "required": ["kind"]},
                    "then": {"required": ["cv2"]},
                },
            ]
        }
    )

    kind: Literal["poisson", "gamma"] = "poisson"
    rate_qps: float = Field(ge=MIN_RATE_QPS, le=MAX_RATE_QPS, allow_inf_nan=False)
    cv2: float = Field(
        default=1.0,
        gt=0,
        le=100,
        allow_inf_nan=False,
        description="squared coefficient of variation of the gaps (1: Poisson)",
    )
    duration_s: float | None = Field(
        default=None,
        gt=0,
        le=_MAX_DURATION_S,
        allow_inf_nan=False,
        description=f"length of the trace (default: {DEFAULT_TRACE_QUERIES:,} queries' worth)",
    )
    batch_dist: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="fixed:N, kairos, lognormal:mu=M,sigma=S[,...] or gaussian:mean=M,sd=S[,...]"
        " (default: fixed at the smallest batch size every profile of the app has)",
    )
    seed: _WholeNumber = Field(default=0, ge=0, le=_MAX_SEED)

    @model_validator(mode="after")
    def _check(self) -> TraceIn:
        if self.kind == "poisson" and self.cv2 != 1.0:
            raise ValueError("a poisson trace has cv2 = 1; use kind gamma for another cv2")
        if self.kind == "gamma" and "cv2" not in self.model_fields_set:
            raise ValueError("a gamma trace needs cv2, its gaps' squared coefficient of variation")
        duration_s = self.duration_s
        if duration_s is not None and self.rate_qps * duration_s > PLANNING_QUERIES * 10:
            raise ValueError(
                f"rate_qps x duration_s = {self.rate_qps * duration_s:.3g} queries; a planning"
                f" trace holds at most {PLANNING_QUERIES * 10:,} (the planner reads its busiest"
                f" {PLANNING_QUERIES:,})"
            )
        return self


class PlanIn(BaseModel):
    """What to plan for: a generated ``trace``, or just a ``rate_qps`` (a Poisson trace)."""

    # Exactly one of the two, as the document says (null is as good as absent).
    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["trace"], "properties": {"trace": {"type": "object"}}},
                {"required": ["rate_qps"], "properties": {"rate_qps": {"type": "number"}}},
            ]
        }
    )

    trace: TraceIn | None = None
    rate_qps: float | None = Field(
        default=None, ge=MIN_RATE_QPS, le=MAX_RATE_QPS, allow_inf_nan=False
    )
    seed: _WholeNumber = Field(default=0, ge=0, le=_MAX_SEED, description="the planner's seed")

    @model_validator(mode="after")
    def _check(self) -> PlanIn:
        if self.trace is not None and self.rate_qps is not None:
            raise ValueError("give trace or rate_qps, not both")
        return self


class TraceStatsOut(BaseModel):
    model_config = _RESPONSE

    count: int
    rate_qps: float
    cv2: float
    mean_batch_size: float
    source: str = Field(description="how the trace was made (generator and parameters)")


class EnvelopeOut(BaseModel):
    """The planned arrival envelope: per window (s), the highest arrival rate (qps) the
    planning trace had over any window of that length."""

    model_config = _RESPONSE

    windows_s: list[float]
    rate_qps: list[float]


class StageOut(BaseModel):
    model_config = _RESPONSE

    name: str
    fleet: dict[str, int]
    batch_size: int
    predicted_p99_ms: float
    throughput_qps: float
    cost_usd_per_hr: float
    policy: str
    spot_fleet: dict[str, int] = Field(
        default_factory=dict, description="how many of fleet's instances are spot, by type"
    )


class PlanOut(BaseModel):
    """A plan: the planner's document (``Plan.to_document()``) with its id and status."""

    model_config = _RESPONSE

    id: int
    app: str
    number: int = Field(description="1, 2, 3, ... per app")
    status: Literal["previewed", "applied", "superseded"]
    app_version: int = Field(description="the app version it was made for")
    created_at: datetime
    applied_at: datetime | None
    feasible: bool
    cost_usd_per_hr: float
    stages: list[StageOut]
    rate_qps: float = Field(
        description="the rate the plan is planned for (the planning trace's, or the highest"
        " feasible one when infeasible)"
    )
    predicted_p99_ms: float | None = Field(
        default=None,
        description="the estimator's end-to-end P99 (the SLO's percentile) of the whole pipeline"
        " at rate_qps; null for a plan without stages or one made before plans carried it",
    )
    planned_rate_qps: float = Field(description="rate_qps under its older name")
    max_feasible_qps: float | None = None
    expected_cost_usd_per_hr: float | None = Field(
        default=None, description="the plan's cost at the prices used (spot at its spot price)"
    )
    cost_if_on_demand_usd_per_hr: float | None = Field(
        default=None, description="the plan's cost if its spot instances were paid on demand"
    )
    predicted_slo_attainment: float | None = Field(
        default=None,
        description="a plan with spot: the share of queries within the SLO it predicts with"
        " interruptions (docs/spot.md)",
    )
    spot_prices_usd_per_hr: dict[str, float] | None = Field(
        default=None, description="a plan with spot: the spot prices it was made at, by type"
    )
    spot_prices_source: str | None = Field(
        default=None,
        description="where those prices came from: catalog, provider, or provider and catalog",
    )
    steps: list[str]
    simulations: int
    seed: int | None = None
    trace: TraceStatsOut | None = None
    envelope: EnvelopeOut | None = Field(
        default=None, description="the planning trace's arrival envelope (InferLine's tuner)"
    )
    gear_plan: dict[str, Any] | None = Field(
        default=None,
        description="a cascade's gear plan on the plan's placement, the same object as"
        " `heteroplane gears --json` (docs/cascades.md); null for a single model",
    )

    @model_validator(mode="before")
    @classmethod
    def _rate_of_older_documents(cls, data: Any) -> Any:
        """A document stored before plans carried ``rate_qps`` has ``planned_rate_qps`` only."""
        if isinstance(data, dict) and data.get("rate_qps") is None and "planned_rate_qps" in data:
            return {**data, "rate_qps": data["planned_rate_qps"]}
        return data


# --- budgets ---------------------------------------------------------------------------------


# Text without control characters (C0, DEL, C1): what the budget's reason validator accepts.
_ONE_LINE_PATTERN = r"^[^\u0000-\u001f\u007f-\u009f]*$"


class BudgetChangeIn(BaseModel):
    model_config = _REQUEST

    budget_usd_per_hr: float = Field(
        ge=MIN_BUDGET_USD_PER_HR, le=MAX_BUDGET_USD_PER_HR, allow_inf_nan=False
    )
    # One line of text (the validator below says why in its own words; the document says it
    # as a pattern).
    reason: str = Field(
        min_length=1, max_length=_MAX_REASON, json_schema_extra={"pattern": _ONE_LINE_PATTERN}
    )
    # A budget below the app's smallest serving fleet is a 409, one that buys no instance a 422,
    # unless forced.
    force: bool = False

    @field_validator("reason")
    @classmethod
    def _storable(cls, reason: str) -> str:
        # PostgreSQL's text holds no NUL character (SQLite's does): refused on both alike.
        if "\x00" in reason:
            raise ValueError("must not contain a NUL character")
        # One line of text, as a token's name is: a newline split the audit trail's row in
        # `heteroplane budget get`, and an escape sequence reached the operator's terminal.
        if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in reason):
            raise ValueError("must not hold control characters (a newline, a tab, an escape)")
        return reason


class BudgetChangeOut(BaseModel):
    """One row of the budget's audit trail."""

    model_config = _RESPONSE

    at: datetime
    who: str
    old_usd_per_hr: float | None = Field(description="None: the budget the app was registered with")
    new_usd_per_hr: float
    reason: str


class BudgetOut(BaseModel):
    model_config = _RESPONSE

    app: str
    budget_usd_per_hr: float
    fleet_cost_usd_per_hr: float = Field(description="what the live instances cost")
    changes: list[BudgetChangeOut] = Field(description="the audit trail, oldest first")


class DrainOut(BaseModel):
    """An instance to drain so that the fleet fits a lowered budget."""

    model_config = _RESPONSE

    id: str
    provider_id: str | None
    instance_type: str
    state: str
    price_usd_per_hr: float
    qps_per_usd: float | None = Field(
        description="queries per second it serves per USD/hr (lower drains first; None: free)"
    )


class BudgetSetOut(BaseModel):
    model_config = _RESPONSE

    app: str
    budget_usd_per_hr: float
    previous_usd_per_hr: float | None
    fleet_cost_usd_per_hr: float
    drain: list[DrainOut] = Field(description="instances to drain, least cost-effective first")
    note: str | None = None


# --- fleet, events, metrics ------------------------------------------------------------------


class InstanceOut(BaseModel):
    model_config = _RESPONSE

    id: str
    app: str
    provider_id: str | None
    instance_type: str
    state: str
    price_usd_per_hr: float = Field(description="the price it was launched at, USD/hr")
    market: str = Field(
        default="on-demand",
        description="its purchase option, on-demand or spot (docs/spot.md): which of an app's"
        " instances an interruption can take",
    )
    price_now_usd_per_hr: float | None = Field(
        default=None,
        description="a spot instance's price now where its type's spot price moved since the"
        " launch (what the budget counts it at); null: the launch price is the price now",
    )
    created_at: datetime
    updated_at: datetime
    role: Literal["fleet", "profile_run", "rollout"] = Field(
        default="fleet",
        description="what the instance is for: the app's fleet, a profile run's worker, or a"
        " rollout's worker (the new version's, beside the fleet)",
    )
    rollout_id: int | None = Field(default=None, description="the rollout whose worker it is")


class TeardownOut(BaseModel):
    """``DELETE /v1/apps/{app}?drain=true`` on an app with live instances (202): they are being
    drained; the app is deleted when none is left."""

    model_config = _RESPONSE

    app: str
    status: Literal["draining"] = "draining"
    instances: list[InstanceOut] = Field(description="the live instances being drained")
    message: str


class FleetTypeOut(BaseModel):
    model_config = _RESPONSE

    instance_type: str
    count: int
    price_usd_per_hr: float
    cost_usd_per_hr: float
    states: dict[str, int]


class FleetOut(BaseModel):
    """The app's live instances (not terminated or failed) by type, and what they cost."""

    model_config = _RESPONSE

    app: str
    budget_usd_per_hr: float
    cost_usd_per_hr: float
    instances: int
    by_type: list[FleetTypeOut]


class DecisionOut(BaseModel):
    model_config = _RESPONSE

    id: int
    at: datetime
    kind: str
    reason: str
    numbers: dict[str, Any]
    # A decision made again (same caller key): how many times, and the last; ``at`` is the first.
    count: int = 1
    last_at: datetime | None = None


class InstanceEventOut(BaseModel):
    model_config = _RESPONSE

    id: int
    instance_id: str
    at: datetime
    from_state: str | None
    to_state: str
    reason: str


class MetricSampleOut(BaseModel):
    model_config = _RESPONSE

    at: datetime
    arrival_rate_qps: float
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    attainment_share: float | None
    fleet_cost_usd_per_hr: float
    gear: str | None
    accuracy: float | None


# --- inference -------------------------------------------------------------------------------

# Samples in one inference request (the loadgen contract: 1..256).
MAX_INFER_SAMPLES = 256
# The demo family's input: 8x8 pixel intensities in 0..16 (provisioners.worker.agent).
INFER_FEATURES = 64
INFER_PIXEL_MAX = 16.0
# A latency bound above a day is a typo (the spec's SLO has the same bound).
_MAX_LATENCY_MS = MAX_SLO_LATENCY_MS


# A sample's values: what they must be depends on the app (checked by the route against its
# models' input: the demo family's 64 pixels in 0..16, or a model's first input, flattened).
# Every integer below it in magnitude is a float exactly; past it, a float stands for several.
EXACT_FLOAT_INT = 2**53


def _exact_large_int(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A JSON integer past :data:`EXACT_FLOAT_INT` as it is: as a float it would round
    (-2**63 - 1 to -2**63) and pass the route's range check of an INT64 or UINT64 input."""
    if type(value) is int and abs(value) > EXACT_FLOAT_INT:
        return value
    return handler(value)


_Value = Annotated[float, Field(allow_inf_nan=False), WrapValidator(_exact_large_int)]
_Sample = Annotated[list[_Value], Field(min_length=1)]


class RequirementsIn(BaseModel):
    """A model-less query's needs (INFaaS): the system picks the cheapest variant (a model or a
    cascade gear) that meets them, or answers 422 with the closest offer."""

    model_config = _REQUEST

    latency_ms: float | None = Field(
        default=None, gt=0, le=_MAX_LATENCY_MS, allow_inf_nan=False, description="latency bound"
    )
    min_accuracy: float | None = Field(
        default=None, gt=0, le=1, description="minimum accuracy in (0, 1]"
    )


class InferIn(BaseModel):
    """A batch of samples for an app (``POST /v1/apps/{app}/infer``)."""

    model_config = _REQUEST

    inputs: list[_Sample] = Field(
        min_length=1,
        max_length=MAX_INFER_SAMPLES,
        description=f"1..{MAX_INFER_SAMPLES} samples. For an app of the demo family each is"
        f" {INFER_FEATURES} pixel values in 0..{INFER_PIXEL_MAX:g}; for an app of a model"
        " brought to the registry, the model's first input's sample flattened row-major, its"
        " values of that input's datatype (a model of several inputs: POST"
        " /v2/models/{app}/infer)",
    )
    # The bounds before the validator: pydantic leaves constraints that follow a
    # BeforeValidator out of the JSON Schema (they would still be enforced, undocumented).
    sample_ids: (
        list[Annotated[int, Field(ge=0, le=2**31 - 1), BeforeValidator(whole_number)]] | None
    ) = Field(
        default=None,
        description="which validation sample each input is (bookkeeping: the observed accuracy)",
    )
    requirements: RequirementsIn | None = None

    @field_validator("sample_ids")
    @classmethod
    def _one_id_per_input(
        cls, sample_ids: list[int] | None, info: ValidationInfo
    ) -> list[int] | None:
        # A field validator (inputs is checked first), so that the error names sample_ids.
        inputs = info.data.get("inputs")
        if sample_ids is not None and inputs is not None and len(sample_ids) != len(inputs):
            raise ValueError(f"has {len(sample_ids)} ids for {len(inputs)} inputs; give one each")
        return sample_ids


class TimingsOut(BaseModel):
    model_config = _RESPONSE

    queue_ms: float = Field(
        description="waiting: admission, the stages' queues, the serving loop"
        " (total_ms - service_ms - api_ms)"
    )
    service_ms: float = Field(
        description="round trips of the batches that carried the samples"
        " (transport_ms + compute_ms)"
    )
    total_ms: float = Field(description="from the API's receipt of the request to the answer")
    transport_ms: float = Field(
        description="the round trips less the workers' own service time (network, the agents)"
    )
    compute_ms: float = Field(description="the workers' own service time (their served_ms)")
    api_ms: float = Field(
        default=0.0,
        description="the API before the serving loop: its receipt of the request to the dispatch"
        " (parsing, the token check, validation, the event loop's own queue)",
    )


class InferOut(BaseModel):
    """The answer: per sample its output class, the model that answered it and its certainty."""

    model_config = _RESPONSE

    outputs: list[int]
    models: list[str]
    certainty: list[float]
    gear: str = Field(description="the cascade that served it (tiny@0.5 -> large), or the model")
    timings: TimingsOut
    late: bool = Field(description="total_ms is over the app's latency SLO")


class ServingWorkerOut(BaseModel):
    model_config = _RESPONSE

    instance_id: str
    instance_type: str
    address: str
    healthy: bool
    busy: bool
    last_error: str
    utilisation_share: float | None = None  # busy share of about the last minute


class ServingStageOut(BaseModel):
    model_config = _RESPONSE

    model: str
    queued_queries: int
    queued_samples: int
    in_service_samples: int
    capacity_sps: float = Field(description="samples per second the healthy instances serve")
    policy: str
    max_batch_queries: int
    states: dict[str, str] = Field(
        description="INFaaS state of the model per instance id: active, overloaded, interfered"
    )
    shares: dict[str, float] = Field(
        default_factory=dict,
        description="a cascade's co-located placement (SP3): the instances hosting the model"
        " by id, with the load balancer's share of its queries (empty otherwise)",
    )
    lp_utilisation: float | None = Field(
        default=None,
        description="the load balancer's u: the busiest instance's busy share at the load in"
        " force (null outside a cascade's co-located placement)",
    )
    reach: float | None = Field(
        default=None,
        description="the share of the app's samples that reach the model at the spec's"
        " thresholds, as the answers of the last minute show, whatever gear is in force (null"
        " for a cascade's first model or before answers)",
    )
    reach_samples: int = Field(
        default=0,
        description="the samples of the spec's first model that reach rests on (fewer than it"
        " answered where a model between answered fewer than the spec's thresholds send it)",
    )


class ServingLatencyOut(BaseModel):
    """The answered queries' mean time per stage since the service started (null before the
    first answer): total_ms = api_ms + queue_ms + transport_ms + compute_ms. ``overhead_ms``
    is the control plane's overhead per query the planner adds to every query's simulated
    latency (the median api_ms the calibration loop stored; null before it measured one)."""

    model_config = _RESPONSE

    api_ms: float | None = None
    overhead_ms: float | None = None
    queue_ms: float | None
    transport_ms: float | None
    compute_ms: float | None
    total_ms: float | None


class ServingTotalsOut(BaseModel):
    """The app's queries since the service started, by outcome. Latency runs from the API's
    receipt of the request; refused, timed-out and failed queries are misses."""

    model_config = _RESPONSE

    arrived: int
    answered: int
    late: int = Field(description="answered over the SLO")
    failed: int = Field(description="502: every attempt failed")
    refused: int = Field(description="429 overloaded, 503 no serving instance or unavailable")
    timed_out: int = Field(description="504: not answered within the give-up time")
    rejected: int = Field(
        default=0,
        description="422 after arrival, the model refusing the query's own inputs: the client's"
        " mistake, not offered (arrived = offered + rejected + those in flight)",
    )
    within_slo: int = Field(description="answered within the SLO")
    offered: int = Field(description="queries that ended: answered + refused + timed_out + failed")
    attainment_share: float | None = Field(
        description="within_slo / offered: errors count as misses (null before the first)"
    )
    samples_by_model: dict[str, int]
    mean_latency_ms: ServingLatencyOut


class ServingOut(BaseModel):
    """What the serving loop sees of an app: gear, workers, queues and model states."""

    model_config = _RESPONSE

    app: str
    gear: str
    slo_ms: float
    in_flight_requests: int
    workers: list[ServingWorkerOut]
    stages: list[ServingStageOut]
    totals: ServingTotalsOut
