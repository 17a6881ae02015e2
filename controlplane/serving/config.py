"""What an app's dispatcher is given: the app (its SLO, models, cascade, profiles, prices, the
applied plan's stages), the gear the switcher puts in force, and the dispatch loop's timeouts and
limits.

These are plain values: :class:`~controlplane.serving.loop.ServingLoop` builds an
:class:`AppConfig` from the stored spec and plan, the live gear switcher hands out
:class:`ServingGear` values, and the dispatcher's parts (:mod:`~controlplane.serving.dispatcher`,
:mod:`~controlplane.serving.placement`, :mod:`~controlplane.serving.health`,
:mod:`~controlplane.serving.variants`) read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from controlplane.policies.gears import GearPlan
from controlplane.policies.plan import StagePlan
from controlplane.serving.admission import DEFAULT_MAX_QUEUED_SAMPLES
from controlplane.serving.modelio import ModelIO
from estimator.cascades import Cascade, ValidationRecords
from estimator.profiles import LatencyProfile

__all__ = [
    "AppConfig",
    "DispatcherSettings",
    "GearSource",
    "ServingGear",
    "batch_cap",
    "batch_gear",
    "batch_trigger",
]


@dataclass(frozen=True, slots=True, eq=False)
class AppConfig:
    """What the dispatcher needs of an app: its SLO, its models (one stage each), the cascade it
    serves by default (a single model is the cascade of one), each model's profile per instance
    type, prices, the validation records of its models (cascade accuracy and reach; optional),
    the applied plan's stages by model, each model's :class:`~controlplane.serving.modelio.
    ModelIO` (its signature and certainty kind; a model not in ``io`` is a demo family model
    with the margin certainty), and a ``version`` that changes whenever any of it does."""

    name: str
    slo_ms: float
    models: tuple[str, ...]
    cascade: Cascade
    profiles: Mapping[str, Mapping[str, LatencyProfile]]
    prices_usd_per_hr: Mapping[str, float]
    validation: ValidationRecords | None = None
    stage_plans: Mapping[str, StagePlan] = field(default_factory=dict)
    version: tuple[object, ...] = ()
    io: Mapping[str, ModelIO] = field(default_factory=dict)
    # The cascade placement's inputs (controlplane.policies.load_balance, SP3): the applied
    # plan's rate and gear plan (the loads the placement must serve), each model's memory (MB)
    # and each instance type's memory for models (MB; a type not listed has no limit).
    planned_rate_qps: float = 0.0
    gear_plan: GearPlan | None = None
    model_memory_mb: Mapping[str, float] = field(default_factory=dict)
    instance_memory_mb: Mapping[str, float] = field(default_factory=dict)
    # The SLO less the control plane's own measured time per query: what the planner judges a
    # stage's dispatch (its Kairos base types) against; None: ``slo_ms`` (nothing measured).
    stage_slo_ms: float | None = None
    # The SLO's percentile: 1 - it is the share of queries the SLO lets it miss, which the
    # overload verdict allows admission's refusals (controlplane.serving.states).
    slo_percentile: float = 99.0

    @property
    def dispatch_slo_ms(self) -> float:
        """The SLO a stage's base types must meet at every batch size (:attr:`stage_slo_ms`)."""
        return self.slo_ms if self.stage_slo_ms is None else self.stage_slo_ms

    def __post_init__(self) -> None:
        missing = [m for m in self.cascade.models if m not in self.models]
        if missing:
            raise ValueError(f"the cascade names models the app does not serve: {missing}")

    def model_io(self, model: str) -> ModelIO:
        """How the dispatcher talks to ``model`` (:attr:`io`, else a family model's)."""
        found = self.io.get(model)
        return found if found is not None else ModelIO(model)


@dataclass(frozen=True, slots=True)
class ServingGear:
    """A gear the switcher puts in force: its cascade, the batch cap of each of its models, and
    the cheapest (fastest) gear the app may switch to, which admission control judges by.

    Its batch trigger (CascadeServe's minimum queue length, ``controlplane.policies.gears``,
    SP4): a stage of a model in ``min_queue`` with a value m > 1 starts a batch only once m
    queries are queued, or once its oldest queued query has waited ``max_wait_s`` (the
    starvation guard). A model not in ``min_queue`` starts at once, as apps without a gear
    plan do."""

    cascade: Cascade
    max_batch_queries: Mapping[str, int] = field(default_factory=dict)
    cheapest: Cascade | None = None
    min_queue: Mapping[str, int] = field(default_factory=dict)
    max_wait_s: float = 0.0


GearSource = Callable[[], ServingGear | None]


@dataclass(frozen=True, slots=True)
class DispatcherSettings:
    """Timeouts and limits of the dispatch loop.

    A worker call times out after max(``call_timeout_floor_s``, ``call_timeout_factor`` x the
    batch's predicted service time); a query is tried on at most ``max_attempts`` workers; it is
    answered with a timeout error ``give_up_s`` after its arrival (default: max(30 s, 20 x the
    SLO)); ``admission`` turns admission control off (benchmarks of the bare loop). A healthy
    worker idle for ``idle_probe_s`` gets a health probe with the call timeout floor (None: never).
    A worker's first ``warmup_batches`` answered batches are its warm-up (a runtime's first
    runs, caches, a connection opened): calibration does not read them. A worker whose call
    timed out is probed at once with ``slow_probe_s`` to tell a slow query (it answers) from a
    worker gone (:meth:`AppDispatcher._call <controlplane.serving.dispatcher.AppDispatcher>`).
    """

    call_timeout_floor_s: float = 2.0
    call_timeout_factor: float = 10.0
    max_attempts: int = 3
    give_up_s: float | None = None
    max_queued_samples: int = DEFAULT_MAX_QUEUED_SAMPLES
    admission: bool = True
    idle_probe_s: float | None = 5.0
    warmup_batches: int = 5
    slow_probe_s: float = 0.5

    def give_up_after_s(self, slo_ms: float) -> float:
        if self.give_up_s is not None:
            return self.give_up_s
        return max(30.0, 20.0 * slo_ms / 1000.0)


def batch_cap(config: AppConfig, model: str, gear: ServingGear) -> int:
    """How many queued queries one batch of ``model`` may take: the gear's cap, else the plan's
    stage's batch size, else 1."""
    cap = gear.max_batch_queries.get(model)
    if cap is None:
        plan = config.stage_plans.get(model)
        cap = plan.batch_size if plan is not None else 1
    return max(int(cap), 1)


def batch_gear(model: str, cap: int) -> ServingGear:
    """The gear of a single-model app whose one setting is its batch cap: the batch the tuner's
    sizing ladder gives the fleet it runs (``controlplane.loops.live_tuner``, docs/tuner.md,
    "The rung's batch"), which the planner showed to meet the SLO on that fleet."""
    return ServingGear(Cascade((model,), ()), {model: max(int(cap), 1)})


def batch_trigger(gear: ServingGear, model: str) -> tuple[int, float]:
    """The minimum queue length of ``model``'s stage under ``gear`` and its guard in seconds:
    (1, 0.0), start at once, for a model the gear sets none for."""
    minimum = max(int(gear.min_queue.get(model, 1)), 1)
    return (minimum, max(gear.max_wait_s, 0.0)) if minimum > 1 else (1, 0.0)
