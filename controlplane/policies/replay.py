"""Replay: the simulator with the fleet changing as a scaling policy decides.

This module owns the replay of a trace against a plan (:func:`replay`): it reads the planner's
plan document (:func:`parse_plan`, :func:`read_plan`), rolls a scaling policy over the trace to get
a fleet timeline (:func:`tuner_timeline`, :func:`utilization_timeline`, :func:`static_timeline`),
simulates the trace once on that timeline (:func:`estimator.simulator.simulate`, whose instances
join at ``ready_s``, leave at ``stop_s`` and are billed from ``billed_from_s``) and summarises what
happened per 10 s window (:class:`ReplayResult`).

Two passes, and why that is exact: every scaling policy here decides from the arrivals alone
(InferLine's tuner compares arrival envelopes, Algorithms 3 and 4; the utilisation autoscaler
estimates utilisation as arrival rate over capacity), never from the simulated latencies. So the
decisions of a closed loop (simulate a second, decide, simulate the next) equal those of rolling the
policy over the arrivals first, and one simulation of the resulting timeline gives exactly the
closed loop's latencies. A policy that read latencies (queue lengths, measured p99) would need the
loop; ``docs/replay.md`` says more.

A plan with several stages (a cascade) replays as one pipeline (:func:`replay_pipeline`): the
whole pipeline simulated once, each query forwarded as the validation records say
(:mod:`controlplane.policies.pipeline`, the pipeline the planner judges plans with), under the
plan's per-stage fleets (static) or under one tuner per stage (:func:`cascade_tuner_timelines`):
each on the arrivals of the queries that reach its stage, sized for its own envelope, all within
the one budget (docs/tuner.md, "Cascades: one tuner per stage"). The same two passes stay exact:
the tuners decide from arrivals, and which query reaches which stage is fixed by its validation
sample before anything is simulated. The utilisation autoscaler scales one stage; for several it
is refused.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controlplane.policies import scaling
from controlplane.policies.pipeline import (
    answering_stages,
    by_fleet,
    dispatch_choice,
    mix_policy,
    pipeline_stages,
)
from controlplane.policies.plan import (
    DispatchName,
    PlanDocument,
    PlanError,
    StagePlan,
)
from controlplane.policies.plan import read_plan as read_plan_document
from controlplane.policies.sizing import SizingLadder, tuner_stage
from controlplane.policies.tuner import (
    DEFAULT_RECENT_S,
    CapacityModel,
    ScalingDecision,
    TunerConfig,
    TunerStage,
    TunerState,
    default_boot_s,
    fleet_cost_usd_per_hr,
    initial_state,
    live_batch,
    ready_fleets,
    tune,
    utilisation_target,
)
from controlplane.spec import ResolvedApp
from estimator.bounds import kairos_quantities, upper_bounds
from estimator.envelope import DEFAULT_MAX_WINDOW_S, arrival_cv2
from estimator.errors import EstimatorError
from estimator.fleet import Fleet
from estimator.numbers import plain
from estimator.policies import full_range_types, policy_class, policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Routing, SimulationResult, Stage, simulate
from estimator.traces import Trace
from matching import registry
from matching.policy import DispatchPolicy

__all__ = [
    "DEFAULT_PLANNING_SHARE",
    "DEFAULT_TUNER_MIN_WINDOW_S",
    "REPORTED_PERCENTILE",
    "AbortedBoot",
    "FleetTimeline",
    "PlanError",
    "ReplayDecision",
    "ReplayError",
    "ReplayResult",
    "ScalingPolicy",
    "StagePlan",
    "StageReplay",
    "TimelineOptions",
    "TimelineWindow",
    "UtilizationConfig",
    "cascade_tuner_timelines",
    "check_plan",
    "check_stages",
    "outcome",
    "parse_plan",
    "planning_arrivals",
    "rate_per_instance_qps",
    "read_plan",
    "replay",
    "replay_pipeline",
    "replay_timeline",
    "split_slo_ms",
    "spot_price_usd_per_hr",
    "stage_cost_usd_per_hr",
    "stage_slo_targets_ms",
    "static_policy_timeline",
    "static_timeline",
    "thin_planning_arrivals",
    "timeline_windows",
    "tuner_policy_timeline",
    "tuner_timeline",
    "utilization_policy_timeline",
    "utilization_timeline",
]

# The name of a scaling policy replay runs: one of ``controlplane.policies.scaling.replay_names()``.
ScalingPolicy = str

# Without a planning trace, the tuner plans on the replayed trace's first 10%: the part an operator
# would have seen before deploying (docs/replay.md).
DEFAULT_PLANNING_SHARE = 0.1
# The tuner runs once per second of trace time (InferLine's tuner reacts "within seconds").
TUNER_TICK_S = 1.0
# The tuner's shortest window in the replay. InferLine starts the ladder at the bottleneck's service
# time, but for a single model that is milliseconds: the most arrivals of a Poisson stream in any
# 10 ms window reads as several times its rate, and with rho capped at 1 (utilisation_target) such
# counting noise would be provisioned for as if it were sustained load (docs/replay.md).
DEFAULT_TUNER_MIN_WINDOW_S = 1.0
# The timeline's resolution.
TIMELINE_STEP_S = 10.0
# The percentile the replay reports (the contract's ``p99_ms``).
REPORTED_PERCENTILE = 99.0
# The longest trace a replay takes (a week, as the API's generated traces): the tuner ticks every
# second and the timeline has a window every TIMELINE_STEP_S, so a span of 1e8 s (a typo) would
# need gigabytes.
MAX_REPLAY_SPAN_S = 7 * 86_400.0


class ReplayError(EstimatorError):
    """A replay that cannot run: a plan that does not fit the spec, a trace too short to plan on."""


def check_span(trace: Trace) -> None:
    """Refuse a trace longer than :data:`MAX_REPLAY_SPAN_S` (a :class:`ReplayError`)."""
    if trace.arrival_s.size and float(trace.arrival_s[-1]) > MAX_REPLAY_SPAN_S:
        raise ReplayError(
            f"the trace spans {float(trace.arrival_s[-1]):.6g} s; a replay takes at most"
            f" {MAX_REPLAY_SPAN_S:.0f} s (a week)"
        )


# --- the plan document -----------------------------------------------------------------------


def parse_plan(document: object, source: str | None = None) -> PlanDocument:
    """Check a parsed plan document for a replay: a plan (:meth:`PlanDocument.parse`) with at
    least one stage, each with instances.

    >>> plan = parse_plan({"feasible": True, "cost_usd_per_hr": 1.05, "steps": [],
    ...     "stages": [{"name": "m", "fleet": {"g4dn.xlarge": 2}, "batch_size": 1}]})
    >>> str(plan.stages[0].fleet), plan.stages[0].batch_size
    ('g4dn.xlarge=2', 1)

    Raises:
        PlanError: a document that is not a plan, has no stage or a stage without instances.
    """
    return _replayable(PlanDocument.parse(document, source), source)


def read_plan(path: str | Path) -> PlanDocument:
    """Read and check a plan document (JSON) from ``path`` for a replay.

    Raises:
        PlanError: a file that cannot be read, is not JSON, or is not a plan to replay.
    """
    return _replayable(read_plan_document(path), str(path))


def _replayable(plan: PlanDocument, source: str | None) -> PlanDocument:
    if not plan.stages and not plan.feasible:
        # What plan writes when no fleet within the budget serves any rate: no fleet to replay.
        raise PlanError(
            "stages",
            "none: the plan found no fleet within the budget that serves any rate (at most"
            f" {plan.max_feasible_qps or 0.0:.4g} qps), so there is nothing to replay; raise"
            " the budget or loosen the SLO and plan again",
            source,
        )
    if not plan.stages:
        raise PlanError("stages", "must be a non-empty list", source)
    for i, stage in enumerate(plan.stages):
        if stage.fleet.total == 0:
            raise PlanError(f"stages[{i}].fleet", "has no instances", source)
    return plan


def check_plan(plan: PlanDocument, app: ResolvedApp) -> StagePlan:
    """The plan's one stage, checked against the app: its model is the app's (the whole of its
    serving order, for a cascade), its types are the spec's candidates, and its fleet costs no
    more than the budget.

    Raises:
        ReplayError: a multi-stage plan (:func:`check_stages` checks those), an unknown stage or
            one stage of a cascade, a type the spec does not name, or a fleet over the budget.
    """
    if len(plan.stages) > 1:
        raise ReplayError(
            f"the plan has {len(plan.stages)} stages: a multi-stage plan is checked stage by"
            " stage (check_stages) and replays as one pipeline (replay_pipeline)"
        )
    (stage,) = plan.stages
    if stage.name not in app.spec.model_names:
        raise ReplayError(
            f"the plan's stage {stage.name!r} is not a model of the spec "
            f"({', '.join(app.spec.model_names)})"
        )
    order = tuple(app.spec.serving_order)
    if app.spec.cascade is not None and (stage.name,) != order:
        # A cascade replayed by one of its stages alone answers every query there: a plan of
        # another app, or cut short, would replay as a faster, cheaper app than the spec's.
        raise ReplayError(
            f"the plan's stages ({stage.name}) are not the spec's serving order"
            f" ({', '.join(order)})"
        )
    for name in stage.fleet:
        if name not in app.prices_usd_per_hr:
            raise ReplayError(
                f"the plan's type {name!r} is not one of the spec's instance types "
                f"({', '.join(app.instance_types)})"
            )
    cost = stage_cost_usd_per_hr(stage, app)
    if cost > app.constraints.budget_usd_per_hr + 1e-9:
        raise ReplayError(
            f"the plan's fleet {stage.fleet} costs {cost:.6g} USD/hr, over the spec's budget of "
            f"{plain(app.constraints.budget_usd_per_hr)} USD/hr"
        )
    return stage


def stage_cost_usd_per_hr(stage: StagePlan, app: ResolvedApp) -> float:
    """What ``stage``'s fleet costs an hour, as the plan priced it (docs/spot.md): its spot
    instances (``spot_fleet``) at the catalog's spot price, the others on demand.

    Raises:
        ReplayError: a type on spot that the catalog gives no spot price.
    """
    cost = 0.0
    for name, count in stage.fleet.items():
        spot = min(stage.spot_fleet.get(name, 0), count)
        if spot:
            cost += spot * spot_price_usd_per_hr(app, name)
        cost += (count - spot) * app.prices_usd_per_hr[name]
    return cost


def spot_price_usd_per_hr(app: ResolvedApp, name: str) -> float:
    """The catalog's spot price of ``name``, which a plan holds on spot.

    Raises:
        ReplayError: the catalog gives it no spot price.
    """
    price = app.catalog[name].spot_price_usd_per_hr
    if price is None:
        raise ReplayError(f"the plan has {name} on spot, but the catalog gives it no spot price")
    return price


# --- the fleet timeline ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AbortedBoot:
    """An instance stopped before it served: it costs from ``launched_s`` to ``stopped_s`` and never
    enters the simulation (whose instances must serve for some time)."""

    instance_type: str
    launched_s: float
    stopped_s: float


@dataclass(frozen=True, slots=True)
class ReplayDecision:
    """One scaling decision: ``scale_up`` launches ``count`` instances of ``instance_type``,
    ``scale_down`` stops them, ``budget_capped`` says the budget kept the policy short by about
    ``count`` of them (the replay keeps the first of a run of identical ones)."""

    at_s: float
    stage: str
    action: str
    instance_type: str
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class FleetTimeline:
    """Every instance the policy ran, as the simulator takes it, plus the boots it aborted, and the
    decisions that made them."""

    instances: tuple[InstanceSpec, ...]
    aborted: tuple[AbortedBoot, ...] = ()
    decisions: tuple[ReplayDecision, ...] = ()
    # (time, the most queries per batch from then on) where the tuner's ladder moves it (the
    # planner's batch for the ready fleet, tuner.live_batch); empty: the plan's throughout.
    batch_caps: tuple[tuple[float, int], ...] = ()

    @property
    def scaling_actions(self) -> int:
        """The number of launches and stops (``budget_capped`` changes nothing)."""
        return sum(1 for d in self.decisions if d.action in ("scale_up", "scale_down"))

    def _billed(self) -> list[tuple[str, float, float]]:
        spans = [
            (s.instance_type, s.ready_s if s.billed_from_s is None else s.billed_from_s, s.stop_s)
            for s in self.instances
        ]
        return spans + [(a.instance_type, a.launched_s, a.stopped_s) for a in self.aborted]

    def cost_usd_per_hr_at(self, t_s: float, prices_usd_per_hr: Mapping[str, float]) -> float:
        """The fleet's cost rate at ``t_s``: every instance launched and not yet stopped."""
        return sum(prices_usd_per_hr[name] for name, lo, hi in self._billed() if lo <= t_s < hi)

    def peak_cost_usd_per_hr(
        self, prices_usd_per_hr: Mapping[str, float], start_s: float = 0.0, end_s: float = math.inf
    ) -> float:
        """The highest cost rate over [start_s, end_s) (it changes only at launches and stops)."""
        points = {start_s} | {lo for _, lo, _ in self._billed() if start_s <= lo < end_s}
        return max(self.cost_usd_per_hr_at(t, prices_usd_per_hr) for t in points)

    def ready_fleet_at(self, t_s: float, types: Sequence[str]) -> dict[str, int]:
        """Counts by type of the instances serving at ``t_s`` (ready, not stopped)."""
        counts = dict.fromkeys(types, 0)
        for spec in self.instances:
            if spec.ready_s <= t_s < spec.stop_s:
                counts[spec.instance_type] = counts.get(spec.instance_type, 0) + 1
        return counts


@dataclass(slots=True)
class _Launched:
    instance_type: str
    launched_s: float
    ready_s: float
    stop_s: float = math.inf


@dataclass(slots=True)
class _FleetLog:
    """The replay's mutable record of what runs (never escapes this module)."""

    boot_s: Mapping[str, float]
    launched: list[_Launched] = field(default_factory=list)
    decisions: list[ReplayDecision] = field(default_factory=list)

    @classmethod
    def planned(cls, fleet: Fleet, boot_s: Mapping[str, float]) -> _FleetLog:
        # The plan's fleet is running when the trace starts.
        log = cls(boot_s)
        log.launched = [_Launched(name, 0.0, 0.0) for name in fleet.expand()]
        return log

    def live(self, name: str, now_s: float) -> list[_Launched]:
        return [x for x in self.launched if x.instance_type == name and x.stop_s > now_s]

    def count(self, name: str, now_s: float) -> int:
        return len(self.live(name, now_s))

    def launch(self, name: str, count: int, now_s: float) -> None:
        ready_s = now_s + self.boot_s[name]
        self.launched += [_Launched(name, now_s, ready_s) for _ in range(count)]

    def stop(self, name: str, count: int, now_s: float) -> None:
        # As the tuner does: booting instances first (they serve nobody yet), the latest launched
        # first, then serving ones, again the latest launched first.
        order = sorted(self.live(name, now_s), key=lambda x: (x.ready_s <= now_s, -x.launched_s))
        if len(order) < count:
            raise ReplayError(f"cannot stop {count} x {name}: only {len(order)} run")
        for victim in order[:count]:
            victim.stop_s = now_s

    def decide(self, decision: ReplayDecision) -> None:
        if decision.action == "budget_capped":
            last = next(
                (d for d in reversed(self.decisions) if d.instance_type == decision.instance_type),
                None,
            )
            if last is not None and last.action == "budget_capped" and last.count == decision.count:
                return  # the same shortfall as the last tick said
        self.decisions.append(decision)

    def timeline(self) -> FleetTimeline:
        instances = []
        aborted = []
        for x in self.launched:
            if x.ready_s < x.stop_s:
                instances.append(InstanceSpec(x.instance_type, x.ready_s, x.stop_s, x.launched_s))
            else:
                aborted.append(AbortedBoot(x.instance_type, x.launched_s, x.stop_s))
        return FleetTimeline(tuple(instances), tuple(aborted), tuple(self.decisions))


def static_timeline(fleet: Fleet) -> FleetTimeline:
    """The plan's fleet from start to end: no decisions (``--tuner off``, the peak and mean
    baselines)."""
    return _FleetLog.planned(fleet, {}).timeline()


@dataclass(frozen=True, slots=True)
class TimelineOptions:
    """What :func:`replay` passes to a scaling policy's timeline function (each reads what it
    uses; see :func:`replay` for their meaning)."""

    planning_arrival_s: NDArray[np.float64] | None = None
    boot_s: Mapping[str, float] | None = None
    utilization: UtilizationConfig | None = None
    dispatch: DispatchName | None = None
    tuner_min_window_s: float = DEFAULT_TUNER_MIN_WINDOW_S
    tuner_capacity_curve: Sequence[tuple[float, float]] | None = None
    tuner_recent_s: float = DEFAULT_RECENT_S
    tuner_ladder: SizingLadder | None = None
    tuner_persistence_s: float | None = None


# A scaling policy as replay runs it (controlplane.policies.scaling: ``replays``).
TimelineFunction = Callable[[Trace, ResolvedApp, StagePlan, TimelineOptions], FleetTimeline]


def static_policy_timeline(
    trace: Trace, app: ResolvedApp, stage: StagePlan, options: TimelineOptions
) -> FleetTimeline:
    """``static`` (and the baselines, on their own plan): :func:`static_timeline`."""
    return static_timeline(stage.fleet)


def tuner_policy_timeline(
    trace: Trace, app: ResolvedApp, stage: StagePlan, options: TimelineOptions
) -> FleetTimeline:
    """``tuner``: :func:`tuner_timeline`, planning on the trace's first 10% unless told."""
    planning = options.planning_arrival_s
    if planning is None:
        planning = planning_arrivals(trace)
    return tuner_timeline(
        trace,
        app,
        stage,
        np.asarray(planning, dtype=np.float64),
        boot_s=options.boot_s,
        min_window_s=options.tuner_min_window_s,
        dispatch=options.dispatch if options.dispatch is not None else (stage.policy or "fcfs"),
        capacity_curve=options.tuner_capacity_curve,
        recent_s=options.tuner_recent_s,
        ladder=options.tuner_ladder,
        persistence_s=options.tuner_persistence_s,
    )


def utilization_policy_timeline(
    trace: Trace, app: ResolvedApp, stage: StagePlan, options: TimelineOptions
) -> FleetTimeline:
    """``utilization``: :func:`utilization_timeline`."""
    return utilization_timeline(
        trace, app, stage, config=options.utilization, boot_s=options.boot_s
    )


# --- what the policies know of the fleet -----------------------------------------------------


def _queries_per_batch(profile: LatencyProfile, mean_batch_size: float, batch_queries: int) -> int:
    """n' = min(n, floor(B_max / b_mean)), at least 1: queries of the mean size in one batch."""
    return max(1, min(batch_queries, math.floor(profile.max_batch_size / mean_batch_size)))


def rate_per_instance_qps(
    profile: LatencyProfile, batch_size: NDArray[np.int64], batch_queries: int = 1
) -> float:
    """mu_t: queries per second one instance serves on the trace's batch mix.

    With one query per batch, mu = 1 / E_q[L(b_q)] where L(b) is the profile's mean latency at the
    query's batch size b_q, averaged over the trace's queries. With up to n queries per batch, n'
    = min(n, floor(B_max / b_mean)) queries of the mean batch size fit in one batch (at least one),
    and mu = n' / L(round(n' b_mean)) (clipped into the profile's range).

    >>> p = LatencyProfile("m", "g", np.array([1, 4]), (np.array([10.0]), np.array([40.0])))
    >>> rate_per_instance_qps(p, np.array([1, 1, 4, 4]))
    40.0
    >>> rate_per_instance_qps(p, np.array([2, 2]), batch_queries=2)
    50.0
    """
    sizes = np.asarray(batch_size, dtype=np.int64)
    if batch_queries <= 1:
        return profile.rate_qps(sizes)
    mean_b = float(sizes.mean())
    fit = _queries_per_batch(profile, mean_b, batch_queries)
    batch = min(max(round(fit * mean_b), profile.min_batch_size), profile.max_batch_size)
    latency_s = profile.mean_latency_ms(batch) / 1000.0
    return fit / latency_s if latency_s > 0 else math.inf


def kairos_capacity_model(
    app: ResolvedApp,
    model: str,
    types: Sequence[str],
    trace: Trace,
    slo_ms: float | None = None,
) -> CapacityModel | None:
    """The Kairos throughput upper bound (:func:`estimator.bounds.upper_bounds`) of ``model`` on
    counts of ``types``, for the trace's batch mix and the SLO the stages share once the control
    plane's own time per query is taken off, as the planner judges a mix's dispatch by
    (``slo_ms`` where given: a cascade stage's share of it, :func:`stage_slo_targets_ms`), as a
    tuner capacity model;
    ``None`` when the bound does not apply (no type meets the SLO at every batch size, a batch
    size outside a profile)."""
    sizes, counts = np.unique(trace.batch_size, return_counts=True)
    prices = app.prices_usd_per_hr
    try:
        quantities = kairos_quantities(
            app.profiles[model],
            model,
            list(types),
            {name: prices[name] for name in types},
            app.constraints.stage_slo_ms if slo_ms is None else slo_ms,
            (sizes, counts / counts.sum()),
        )
    except EstimatorError:
        return None
    order = [tq.instance_type for tq in quantities.types]

    def capacity_qps(fleet: Mapping[str, int]) -> float:
        counts_row = np.array([[fleet.get(name, 0) for name in order]], dtype=np.int64)
        return float(upper_bounds(quantities, counts_row)[0])

    return capacity_qps


def matched_capacity_model(
    app: ResolvedApp,
    dispatch: str | None,
    model: str,
    types: Sequence[str],
    batch_size: int,
    trace: Trace,
    slo_ms: float | None = None,
) -> CapacityModel | None:
    """The tuner's capacity model of a stage dispatched by ``dispatch``: Kairos' matching bound
    (:func:`kairos_capacity_model`) where the policy's capacity is that bound
    (``matched_capacity``), the stage mixes types and takes one query per batch; else ``None``
    (the sum of the types' rates)."""
    if not has_matched_capacity(dispatch, types, batch_size):
        return None
    return kairos_capacity_model(app, model, types, trace, slo_ms)


def has_matched_capacity(dispatch: str | None, types: Sequence[str], batch_size: int) -> bool:
    """Whether :func:`matched_capacity_model` applies to a stage (see there; an unknown policy
    has no such model, and is refused where the stage is dispatched)."""
    if dispatch not in registry.names() or len(types) <= 1 or batch_size > 1:
        return False
    return policy_class(dispatch).matched_capacity


def planning_arrivals(trace: Trace, share: float = DEFAULT_PLANNING_SHARE) -> NDArray[np.float64]:
    """The arrivals of the trace's first ``share`` of its duration (the default planning trace).

    Raises:
        ReplayError: a share outside (0, 1], or no arrival in that part.
    """
    if not 0.0 < share <= 1.0:
        raise ReplayError(f"the planning share must be in (0, 1], got {share!r}")
    arrivals = trace.arrival_s
    if arrivals.size == 0:
        raise ReplayError("the trace has no queries")
    end_s = float(arrivals[0]) + share * trace.duration_s
    chosen: NDArray[np.float64] = arrivals[arrivals <= end_s]
    return chosen


def _stage_rates(app: ResolvedApp, stage: StagePlan, trace: Trace) -> dict[str, float]:
    return {
        name: rate_per_instance_qps(
            app.profile(stage.name, name), trace.batch_size, stage.batch_size
        )
        for name, count in stage.fleet.items()
        if count > 0
    }


def _batch_latency_s(
    app: ResolvedApp, stage: StagePlan, trace: Trace, name: str, mu_qps: float
) -> float:
    if stage.batch_size <= 1:
        return 1.0 / mu_qps
    profile = app.profile(stage.name, name)
    return _queries_per_batch(profile, float(trace.batch_size.mean()), stage.batch_size) / mu_qps


def _boot_s(
    app: ResolvedApp, types: Sequence[str], boot_s: Mapping[str, float] | None
) -> dict[str, float]:
    boot = default_boot_s(app.catalog, types)
    boot.update(boot_s or {})
    return boot


# Called at each tick of a replay's policy with (the tick's time, the trace's end), while
# :func:`reporting_ticks` is open (the command line's progress on a long replay).
_tick_hook: ContextVar[Callable[[float, float], None] | None] = ContextVar(
    "replay_tick_hook", default=None
)


class _Ticks:
    """The policy's ticks over a trace ending at ``end_s``: every ``step_s`` from ``step_s``
    (tick k at ``step_s * k``), the ticks of a span the policy is at rest in skipped
    (:meth:`skip_to`)."""

    def __init__(self, end_s: float, step_s: float) -> None:
        self._step_s = step_s
        self._count = max(1, math.ceil(end_s / step_s))
        self._last_s = step_s * self._count
        self._k = 1
        self._hook = _tick_hook.get()

    def __iter__(self) -> Iterator[float]:
        while self._k <= self._count:
            tick = float(self._step_s * np.float64(self._k))
            self._k += 1
            if self._hook is not None:
                self._hook(tick, self._last_s)
            yield tick

    def skip_to(self, t_s: float) -> None:
        """Go on from the first tick at or after ``t_s`` (the ticks before it are skipped)."""
        k = math.ceil(t_s / self._step_s) if math.isfinite(t_s) else self._count + 1
        while k > 1 and self._step_s * np.float64(k - 1) >= t_s:
            k -= 1
        while self._step_s * np.float64(k) < t_s:
            k += 1
        self._k = max(self._k, k)


def _ticks(end_s: float, step_s: float) -> _Ticks:
    """The policy's ticks over a trace ending at ``end_s``: every ``step_s`` from ``step_s``."""
    return _Ticks(end_s, step_s)


def _at_rest(
    before: TunerState,
    after: TunerState,
    decisions: Sequence[ScalingDecision],
    window_empty: bool,
    now_s: float,
    config: TunerConfig,
) -> bool:
    """Whether a tuner's tick at ``now_s`` that saw no arrivals (``window_empty``) left it where
    every later tick until the next arrival leaves it too: nothing decided, nothing changed,
    nothing booting, and past the waits after which a tick may scale down (so a later tick with
    no arrivals weighs the same fleet on the same nothing). A replay skips such a span's ticks:
    a sparse trace of a week ticked 604,800 times, most of them at rest."""
    if decisions or not window_empty or after != before:
        return False
    if any(boot.ready_at_s > now_s for boot in after.booting):
        return False
    quiet_s = math.inf if after.last_change_s is None else now_s - after.last_change_s
    watched_s = math.inf if after.started_s is None else now_s - after.started_s
    return quiet_s >= config.scale_down_delay_s and watched_s >= config.windows_s[-1]


@contextmanager
def reporting_ticks(say: Callable[[str], None], every_s: float = 10.0) -> Iterator[None]:
    """While open, a replay's policy that has ticked for ``every_s`` of wall time or more says,
    through ``say`` and at most once every ``every_s``, how far into the trace it is: its time
    grows with the trace's span (a tick a second), not its queries, and a sparse trace of a week
    ran for minutes without a word."""
    started = time.monotonic()
    last = [started]

    def hook(tick_s: float, end_s: float) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            say(
                f"replay: {tick_s:,.0f} of {end_s:,.0f} s of the trace"
                f" ({100.0 * tick_s / end_s:.0f}%, {now - started:.0f} s so far)"
            )

    token = _tick_hook.set(hook)
    try:
        yield
    finally:
        _tick_hook.reset(token)


# --- the tuner -------------------------------------------------------------------------------


def tuner_timeline(
    trace: Trace,
    app: ResolvedApp,
    stage: StagePlan,
    planning_arrival_s: NDArray[np.float64],
    *,
    boot_s: Mapping[str, float] | None = None,
    min_window_s: float = DEFAULT_TUNER_MIN_WINDOW_S,
    dispatch: DispatchName = "fcfs",
    capacity_curve: Sequence[tuple[float, float]] | None = None,
    recent_s: float = DEFAULT_RECENT_S,
    ladder: SizingLadder | None = None,
    persistence_s: float | None = None,
) -> FleetTimeline:
    """Roll InferLine's tuner (:func:`controlplane.policies.tuner.tune`) over ``trace`` once per
    second.

    The planning envelope comes from ``planning_arrival_s``; the windows from max(service time,
    ``min_window_s``) doubling to 60 s, where the service time is the slowest planned type's
    batch latency n'/mu_t (:func:`rate_per_instance_qps`); mu_t per planned type; rho =
    :func:`controlplane.policies.tuner.utilisation_target` (scale factor 1: one stage). The tuner
    adds and removes instances of the planned types only (InferLine tunes replication, not
    hardware), never over the spec's budget. At tick t it sees the arrivals in (t - 60 s, t].

    A stage of several types that the Kairos dispatcher serves one query per batch has the Kairos
    throughput bound as its capacity model (:func:`kairos_capacity_model`): its auxiliary types
    serve only the queries up to their violation batch, so once the base type is the bottleneck
    adding them adds nothing, and the tuner adds base instances instead.

    With ``capacity_curve`` (:func:`controlplane.policies.capacity_curve.capacity_curve`) the
    tuner sizes the stage by the planner's capacity at the live load instead of a constant rho
    (:meth:`controlplane.policies.tuner.TunerStage.capacity_at_load_qps`). ``recent_s`` is how
    far back the live envelope looks (InferLine's 60 s by default). The curve costs six plans,
    so the caller makes it and passes it: ``heteroplane replay`` does by default (the load
    model, with ``LOAD_MODEL_RECENT_S``), as does ``benchmarks/tuner_oracle.py``.

    With ``ladder`` (:func:`controlplane.policies.capacity_curve.build_ladder`, the sizing model)
    the stage is the sizing model's (:func:`controlplane.policies.sizing.tuner_stage`: its rates,
    capacity model and curve, every type of its rungs), and the tuner moves the fleet towards the
    cheapest mix for the live load, as the live tuner does. ``persistence_s`` reads bursts
    shorter than it as noise unless they recur (:func:`estimator.envelope.recurring_envelope`).
    """
    if ladder is not None:
        sized, sized_config, sized_boot = ladder_tuner(
            trace,
            app,
            stage,
            planning_arrival_s,
            ladder,
            boot_s=boot_s,
            min_window_s=min_window_s,
            recent_s=recent_s,
            persistence_s=persistence_s,
        )
        start = {name: n for name, n in stage.fleet.items() if n > 0}
        return _roll_tuner(
            trace, sized, sized_config, sized_boot, start, batch_size=stage.batch_size
        )
    mu = _stage_rates(app, stage, trace)
    if planning_arrival_s.size == 0:
        raise ReplayError("the planning trace has no queries")
    # The batch latency n'/mu_t; for one query per batch, 1/mu_t.
    service_time_s = max(_batch_latency_s(app, stage, trace, name, mu[name]) for name in mu)
    service_time_s = min(max(service_time_s, min_window_s), DEFAULT_MAX_WINDOW_S)
    boot = _boot_s(app, list(mu), boot_s)
    config = TunerConfig.from_planning_trace(
        planning_arrival_s,
        service_time_s,
        constraints=app.constraints,
        catalog=app.catalog,
        types=list(mu),
        boot_s=boot,
        recent_s=recent_s,
        persistence_s=persistence_s,
    )
    fleet = {name: stage.fleet[name] for name in mu}
    model = matched_capacity_model(app, dispatch, stage.name, list(mu), stage.batch_size, trace)
    rho = utilisation_target(fleet, mu, 1.0, config.planned_peak_rate_qps, model)
    curve = tuple(capacity_curve) if capacity_curve else None
    plan = TunerStage(stage.name, 1.0, fleet, mu, rho, capacity_model=model, capacity_curve=curve)
    return _roll_tuner(trace, plan, config, boot)


def ladder_tuner(
    trace: Trace,
    app: ResolvedApp,
    stage: StagePlan,
    planning_arrival_s: NDArray[np.float64],
    ladder: SizingLadder,
    *,
    boot_s: Mapping[str, float] | None = None,
    min_window_s: float = DEFAULT_TUNER_MIN_WINDOW_S,
    recent_s: float = DEFAULT_RECENT_S,
    persistence_s: float | None = None,
) -> tuple[TunerStage, TunerConfig, dict[str, float]]:
    """The replay's tuner of the sizing model: the stage
    (:func:`controlplane.policies.sizing.tuner_stage` from ``stage``'s fleet), its config (the
    planning envelope, prices, boot times and caps over every type of the ladder) and the boot
    times."""
    if planning_arrival_s.size == 0:
        raise ReplayError("the planning trace has no queries")
    mu = ladder.rate_per_instance_qps
    fleet = {name: n for name, n in stage.fleet.items() if n > 0}
    planned = {name: mu[name] for name in fleet if name in mu}
    if len(planned) != len(fleet):
        raise ReplayError(f"the ladder of {stage.name} does not cover the plan's types")
    service_time_s = max(_batch_latency_s(app, stage, trace, n, planned[n]) for n in planned)
    service_time_s = min(max(service_time_s, min_window_s), DEFAULT_MAX_WINDOW_S)
    types = sorted(mu)
    boot = _boot_s(app, types, boot_s)
    config = TunerConfig.from_planning_trace(
        planning_arrival_s,
        service_time_s,
        constraints=app.constraints,
        catalog=app.catalog,
        types=types,
        boot_s=boot,
        recent_s=recent_s,
        persistence_s=persistence_s,
    )
    return tuner_stage(ladder, fleet, config), config, boot


def _roll_tuner(
    trace: Trace,
    plan: TunerStage,
    config: TunerConfig,
    boot: Mapping[str, float],
    start: Mapping[str, int] | None = None,
    batch_size: int = 1,
) -> FleetTimeline:
    """Tick the tuner over ``trace`` once a second from ``start`` (by default ``plan``'s
    fleet); a laddered stage's batch caps where they differ from ``batch_size`` (the plan's)."""
    first = Fleet.of(dict(plan.fleet if start is None else start))
    state = dataclasses.replace(initial_state([plan], now_s=0.0), fleets={plan.name: first})
    log = _FleetLog.planned(first, boot)
    arrivals = trace.arrival_s
    caps: list[tuple[float, int]] = []
    _note_batch(caps, batch_size, plan, state, arrivals, 0.0, config)
    ticks = _ticks(float(arrivals[-1]), TUNER_TICK_S)
    for now_s in ticks:
        lo, hi = np.searchsorted(arrivals, [now_s - config.recent_s, now_s], side="right")
        before = state
        decisions, state = tune(arrivals[lo:hi], float(now_s), state, [plan], config)
        if _at_rest(before, state, decisions, lo == hi, now_s, config):
            ticks.skip_to(float(arrivals[hi]) if hi < arrivals.size else math.inf)
        for d in decisions:
            if d.action == "scale_up":
                log.launch(d.instance_type, d.count, d.at_s)
            elif d.action == "scale_down":
                log.stop(d.instance_type, d.count, d.at_s)
            log.decide(
                ReplayDecision(d.at_s, d.stage, d.action, d.instance_type, d.count, d.reason)
            )
        _note_batch(caps, batch_size, plan, state, arrivals, float(now_s), config)
    return dataclasses.replace(log.timeline(), batch_caps=tuple(caps))


def _note_batch(
    caps: list[tuple[float, int]],
    planned: int,
    plan: TunerStage,
    state: TunerState,
    arrival_s: NDArray[np.float64],
    now_s: float,
    config: TunerConfig,
) -> None:
    """Append (``now_s``, cap) to ``caps`` where the stage's batch cap from now on
    (:func:`controlplane.policies.tuner.live_batch` for its ready fleet) differs from the last
    one noted (``planned`` before any)."""
    fleet = ready_fleets(state, now_s)[plan.name]
    cap = live_batch(plan, fleet, arrival_s, now_s, config)
    if cap is not None and (caps[-1][1] if caps else planned) != cap:
        caps.append((now_s, cap))


# --- the reactive utilisation autoscaler -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class UtilizationConfig:
    """A target-tracking autoscaler as an EC2 Auto Scaling group runs one: every ``period_s`` it
    reads the utilisation of the last ``lookback_s`` and moves it to ``target``, waiting
    ``cooldown_s`` after each change."""

    target: float = 0.7
    period_s: float = 10.0
    lookback_s: float = 60.0
    cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise ReplayError(f"the utilisation target must be in (0, 1], got {self.target!r}")
        for name in ("period_s", "lookback_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ReplayError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.cooldown_s) and self.cooldown_s >= 0):
            raise ReplayError(f"cooldown_s must be a finite number >= 0, got {self.cooldown_s!r}")


def utilization_timeline(
    trace: Trace,
    app: ResolvedApp,
    stage: StagePlan,
    *,
    config: UtilizationConfig | None = None,
    boot_s: Mapping[str, float] | None = None,
) -> FleetTimeline:
    """Roll a reactive target-tracking autoscaler over ``trace``.

    Every ``period_s`` (t = 10, 20, ... s) it estimates utilisation u = r / C from arrivals alone:
    r = arrivals in (t - lookback, t] / min(lookback, t), C = sum over launched instances (booting
    ones included, so that a launch is not repeated while it boots) of mu_t. No sooner than
    ``cooldown_s`` after its last change it moves C to C* = r / target with instances of the plan's
    most cost-effective type b (largest mu_b / price_b): it adds ceil((C* - C) / mu_b) when C < C*
    (as many as the budget affords and the spec's cap of b allows), and removes
    floor((C - C*) / mu_b) of them when that many run, keeping one instance; so after a removal
    u stays <= target.
    """
    cfg = config if config is not None else UtilizationConfig()
    mu = _stage_rates(app, stage, trace)
    prices = app.prices_usd_per_hr
    best = max(mu, key=lambda t: (math.inf if prices[t] == 0 else mu[t] / prices[t], t))
    boot = _boot_s(app, list(mu), boot_s)
    log = _FleetLog.planned(stage.fleet, boot)
    arrivals = trace.arrival_s
    budget = app.constraints.budget_usd_per_hr
    last_change_s = -math.inf
    for now_s in _ticks(float(arrivals[-1]), cfg.period_s):
        if now_s - last_change_s < cfg.cooldown_s:
            continue
        lo, hi = np.searchsorted(arrivals, [now_s - cfg.lookback_s, now_s], side="right")
        rate_qps = (hi - lo) / min(cfg.lookback_s, now_s)
        counts = {t: log.count(t, now_s) for t in mu}
        capacity_qps = sum(counts[t] * mu[t] for t in mu)
        needed_qps = rate_qps / cfg.target
        seen = (
            f"utilisation {rate_qps / capacity_qps:.3g} over the last "
            f"{min(cfg.lookback_s, now_s):g} s ({rate_qps:.6g} qps on {capacity_qps:.6g} qps), "
            f"target {cfg.target:g}: need {needed_qps:.6g} qps"
        )
        if needed_qps > capacity_qps:
            wanted = math.ceil((needed_qps - capacity_qps) / mu[best] - 1e-12)
            cost = sum(counts[t] * prices[t] for t in mu)
            left = budget - cost + 1e-9
            affordable = (
                wanted if prices[best] == 0 else min(wanted, math.floor(left / prices[best]))
            )
            cap = app.constraints.max_count(best)
            limit = f"{plain(budget)} USD/hr"
            if cap is not None and counts[best] + affordable > cap:
                affordable = cap - counts[best]
                limit = f"the spec's cap of {cap} x {best}"
            if affordable > 0:
                log.launch(best, affordable, now_s)
                last_change_s = now_s
                reason = f"scale_up: {seen}; added {affordable} x {best} (mu {mu[best]:.6g} qps)"
                log.decide(ReplayDecision(now_s, stage.name, "scale_up", best, affordable, reason))
            if affordable < wanted:
                short = wanted - max(affordable, 0)
                reason = f"budget_capped: {seen}; {short} x {best} over {limit}"
                log.decide(ReplayDecision(now_s, stage.name, "budget_capped", best, short, reason))
        else:
            spare = math.floor((capacity_qps - needed_qps) / mu[best] + 1e-12)
            count = min(spare, counts[best], sum(counts.values()) - 1)
            if count > 0:
                log.stop(best, count, now_s)
                last_change_s = now_s
                reason = f"scale_down: {seen}; stopped {count} x {best} (mu {mu[best]:.6g} qps)"
                log.decide(ReplayDecision(now_s, stage.name, "scale_down", best, count, reason))
    return log.timeline()


# --- the replay ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimelineWindow:
    """One window [t_s, t_s + 10 s): the serving fleet at its start, the arrival rate and the p99
    response time of the queries that arrived in it (None: none did), and the highest cost rate
    of the launched fleet (booting instances included) during it."""

    t_s: float
    fleet: dict[str, int]
    rate_qps: float
    p99_ms: float | None
    cost_usd_per_hr: float


@dataclass(frozen=True, slots=True, eq=False)
class StageReplay:
    """One stage of a multi-stage replay (:func:`replay_pipeline`).

    ``reach_share`` is the share of the trace's queries that reach the stage (the validation
    records' forwarding); ``slo_target_ms`` the stage's share of the SLO
    (:func:`stage_slo_targets_ms`); ``utilisation_target`` the tuner's rho for the stage (None:
    static, or a stage the tuner leaves on its plan, ``note`` says why). ``timeline`` has the
    stage's serving fleet, the rate of the queries reaching it and its cost per 10 s window
    (``p99_ms`` is None: the simulation times queries end to end, not per stage).
    ``batch_caps``: (time, the most queries per batch from then on) where the tuner's ladder
    moved it (the planner's batch for the ready fleet,
    :func:`controlplane.policies.tuner.live_batch`); empty: the plan's throughout.
    """

    name: str
    reach_share: float
    slo_target_ms: float
    utilisation_target: float | None
    fleet_timeline: FleetTimeline
    timeline: tuple[TimelineWindow, ...]
    note: str | None = None

    @property
    def scaling_actions(self) -> int:
        return self.fleet_timeline.scaling_actions

    @property
    def batch_caps(self) -> tuple[tuple[float, int], ...]:
        return self.fleet_timeline.batch_caps

    def to_document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reach_share": self.reach_share,
            "slo_target_ms": self.slo_target_ms,
            "utilisation_target": self.utilisation_target,
            "scaling_actions": self.scaling_actions,
            "peak_cost_usd_per_hr": max((w.cost_usd_per_hr for w in self.timeline), default=0.0),
            "note": self.note,
            "batch_caps": [{"t_s": t, "max_batch_queries": b} for t, b in self.batch_caps],
            "timeline": [
                {
                    "t_s": w.t_s,
                    "fleet": w.fleet,
                    "rate_qps": w.rate_qps,
                    "cost_usd_per_hr": w.cost_usd_per_hr,
                }
                for w in self.timeline
            ],
        }


@dataclass(frozen=True, slots=True, eq=False)
class ReplayResult:
    """What the replay found.

    ``cost_usd`` integrates every instance's price from launch to stop (or the run's end),
    booting ones included: the simulation's cost plus the aborted boots'. ``slo_miss_share`` is
    the share of queries slower than the SLO's latency. A multi-stage replay adds ``stages``
    (:class:`StageReplay`, in serving order); the timeline's fleet and cost are then the stages'
    together and ``p99_ms`` is end to end.
    """

    policy: str
    p99_ms: float
    slo_miss_share: float
    cost_usd: float
    scaling_actions: int
    timeline: tuple[TimelineWindow, ...]
    fleet_timeline: FleetTimeline
    simulation: SimulationResult
    stages: tuple[StageReplay, ...] = ()
    refused_share: float = 0.0

    @property
    def decisions(self) -> tuple[ReplayDecision, ...]:
        return self.fleet_timeline.decisions

    def to_document(self) -> dict[str, Any]:
        """The ``replay --json`` contract (``docs/replay.md``); a multi-stage replay adds
        ``stages`` (one object per stage, :meth:`StageReplay.to_document`) and
        ``peak_cost_usd_per_hr`` (the highest cost rate of all stages together)."""
        document = self._document()
        if self.stages:
            document["peak_cost_usd_per_hr"] = max(w.cost_usd_per_hr for w in self.timeline)
            document["stages"] = [stage.to_document() for stage in self.stages]
        return document

    def _document(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "queries": int(self.simulation.arrival_s.size),
            "p99_ms": finite_or_none(self.p99_ms),
            "slo_miss_share": self.slo_miss_share,
            "refused_share": self.refused_share,
            "cost_usd": self.cost_usd,
            "scaling_actions": self.scaling_actions,
            "batch_caps": [
                {"t_s": t, "max_batch_queries": b} for t, b in self.fleet_timeline.batch_caps
            ],
            "timeline": [
                {
                    "t_s": w.t_s,
                    "fleet": w.fleet,
                    "rate_qps": w.rate_qps,
                    "p99_ms": finite_or_none(w.p99_ms),
                    "cost_usd_per_hr": w.cost_usd_per_hr,
                }
                for w in self.timeline
            ],
            "decisions": [
                {
                    "at_s": d.at_s,
                    "stage": d.stage,
                    "action": d.action,
                    "instance_type": d.instance_type,
                    "count": d.count,
                    "reason": d.reason,
                }
                for d in self.decisions
            ],
        }


def tail_ms(response_ms: NDArray[np.float64], percentile: float = REPORTED_PERCENTILE) -> float:
    """The ``percentile`` of ``response_ms``, a refused query (infinite) counted as the slowest:
    infinite when the percentile falls among the refused."""
    refused = np.isinf(response_ms)
    if not refused.any():
        return float(np.percentile(response_ms, percentile))
    # Interpolating towards an infinite value is meaningless: the refused rank above every
    # answer at a finite stand-in, and a percentile past the slowest answer is among them.
    slowest = float(np.max(response_ms[~refused], initial=0.0))
    value = float(np.percentile(np.where(refused, 2.0 * slowest + 1.0, response_ms), percentile))
    return value if value <= slowest else math.inf


def finite_or_none(value: float | None) -> float | None:
    """``value`` for a JSON document: None where it is not finite (a P99 among refused
    queries)."""
    return value if value is not None and math.isfinite(value) else None


def outcome(result: SimulationResult, qos_ms: float) -> tuple[float, float, float]:
    """P99, the share of queries over the SLO (refused ones included) and the refused share."""
    response = result.response_ms
    refused = int(np.count_nonzero(np.isinf(response)))
    missed = int(np.count_nonzero(response > qos_ms))
    return tail_ms(response), missed / response.size, refused / response.size


def _aborted_cost_usd(
    aborted: Sequence[AbortedBoot], prices: Mapping[str, float], horizon_s: float
) -> float:
    # Billed like the simulator bills its instances: up to the stop or the run's end.
    return sum(
        prices[a.instance_type] * max(0.0, min(a.stopped_s, horizon_s) - a.launched_s) / 3600.0
        for a in aborted
    )


def timeline_windows(
    result: SimulationResult,
    timeline: FleetTimeline,
    types: Sequence[str],
    prices: Mapping[str, float],
) -> tuple[TimelineWindow, ...]:
    arrivals = result.arrival_s
    response = result.response_ms
    end_s = float(arrivals[-1])
    starts = TIMELINE_STEP_S * np.arange(max(1, math.floor(end_s / TIMELINE_STEP_S) + 1))
    bounds = np.searchsorted(arrivals, np.append(starts, starts[-1] + TIMELINE_STEP_S))
    windows = []
    for k, t_s in enumerate(float(t) for t in starts):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        p99 = tail_ms(response[lo:hi]) if hi > lo else None
        windows.append(
            TimelineWindow(
                t_s=t_s,
                fleet=timeline.ready_fleet_at(t_s, types),
                rate_qps=(hi - lo) / TIMELINE_STEP_S,
                p99_ms=p99,
                cost_usd_per_hr=timeline.peak_cost_usd_per_hr(prices, t_s, t_s + TIMELINE_STEP_S),
            )
        )
    return tuple(windows)


def replay(
    trace: Trace,
    app: ResolvedApp,
    plan: PlanDocument,
    rng: np.random.Generator,
    *,
    policy: ScalingPolicy = "tuner",
    planning_arrival_s: NDArray[np.float64] | None = None,
    boot_s: Mapping[str, float] | None = None,
    utilization: UtilizationConfig | None = None,
    dispatch: DispatchName | None = None,
    tuner_min_window_s: float = DEFAULT_TUNER_MIN_WINDOW_S,
    tuner_capacity_curve: Sequence[tuple[float, float]] | None = None,
    tuner_recent_s: float = DEFAULT_RECENT_S,
    tuner_ladder: SizingLadder | None = None,
    tuner_persistence_s: float | None = None,
    tuner_ladders: Mapping[str, SizingLadder] | None = None,
    admission: bool = True,
) -> ReplayResult:
    """Replay ``trace`` on ``plan``'s single stage with the fleet as ``policy`` scales it.

    Pass 1 rolls the policy over the arrivals into a :class:`FleetTimeline` (``static``: the
    plan's fleet throughout; ``tuner``: :func:`tuner_timeline`, planning on
    ``planning_arrival_s``, by default the trace's first 10% (:func:`planning_arrivals`), sized
    by ``tuner_capacity_curve`` where given, or by the sizing model's ``tuner_ladder`` (which
    re-chooses the mix), its live envelope over the last ``tuner_recent_s``, bursts shorter than
    ``tuner_persistence_s`` read as noise unless they recur;
    ``utilization``: :func:`utilization_timeline`). Pass 2 simulates the trace once on it, with
    ``dispatch`` (a policy a plan may name, ``matching.registry.plan_names()``; by default the
    plan stage's ``policy``, else fcfs) over the stage's types, the plan's batch size as the most
    queries per batch, and service times drawn from ``rng``. Exact because the policies decide
    from arrivals only. A static replay is the plain simulation of the plan's fleet.
    ``admission`` (the live dispatcher's default) refuses, as the service does, a query whose
    queue cannot be served within the SLO (:mod:`matching.admission`); a refused query is a miss
    (``ReplayResult.refused_share``); without it every query is served, however late.

    A plan of several stages (a cascade) replays as one pipeline (:func:`replay_pipeline`):
    static, or with one tuner per stage, each on the arrivals that reach its stage and all of
    them within the one budget (docs/tuner.md, "Cascades: one tuner per stage"); the
    utilisation autoscaler scales one stage only. A cascade's stages are sized by their
    ladders in ``tuner_ladders`` (by stage name; :func:`controlplane.policies.capacity_curve.
    cascade_sizing`), a stage without one by InferLine's model (``tuner_capacity_curve`` and
    ``tuner_ladder`` are for a single stage and are not used).

    Raises:
        ReplayError: a plan that does not fit the app (:func:`check_plan`, :func:`check_stages`),
            an unknown policy, the utilisation policy on several stages.
        EstimatorError: the simulator's errors (a batch size outside a profile).
    """
    check_span(trace)
    try:
        run_policy = scaling.timeline_function(policy)
    except scaling.UnknownScalingPolicyError as error:
        raise ReplayError(str(error)) from None
    if len(plan.stages) > 1:
        if not scaling.entry(policy).scales_cascades:
            raise ReplayError(
                f"a plan of {len(plan.stages)} stages replays static or with the tuner (one per"
                f" stage); the {policy} policy scales one stage"
            )
        return replay_pipeline(
            trace,
            app,
            plan,
            rng,
            policy=policy,
            planning_arrival_s=planning_arrival_s,
            boot_s=boot_s,
            dispatch=dispatch,
            tuner_min_window_s=tuner_min_window_s,
            tuner_recent_s=tuner_recent_s,
            tuner_persistence_s=tuner_persistence_s,
            tuner_ladders=tuner_ladders,
            admission=admission,
        )
    stage = check_plan(plan, app)
    options = TimelineOptions(
        planning_arrival_s=planning_arrival_s,
        boot_s=boot_s,
        utilization=utilization,
        dispatch=dispatch,
        tuner_min_window_s=tuner_min_window_s,
        tuner_capacity_curve=tuner_capacity_curve,
        tuner_recent_s=tuner_recent_s,
        tuner_ladder=tuner_ladder,
        tuner_persistence_s=tuner_persistence_s,
    )
    timeline = run_policy(trace, app, stage, options)
    return replay_timeline(
        trace, app, stage, timeline, rng, policy=policy, dispatch=dispatch, admission=admission
    )


def replay_timeline(
    trace: Trace,
    app: ResolvedApp,
    stage: StagePlan,
    timeline: FleetTimeline,
    rng: np.random.Generator,
    *,
    policy: str = "static",
    dispatch: DispatchName | None = None,
    profile_types: Mapping[str, str] | None = None,
    extra_prices_usd_per_hr: Mapping[str, float] | None = None,
    admission: bool = True,
) -> ReplayResult:
    """Pass 2 of :func:`replay` alone: simulate ``trace`` once on ``timeline`` (however it was
    made, e.g. an oracle's fleet per minute) with ``stage``'s batch size and dispatch
    (``dispatch`` overrides it), and summarise it as ``policy``. ``profile_types`` maps a type
    of the timeline that is no catalog type to the one whose profile it has (a spot instance,
    ``<type>@spot``: :mod:`controlplane.policies.spot_replay`), ``extra_prices_usd_per_hr``
    prices it.

    Raises:
        ReplayError: an unknown dispatch policy.
        EstimatorError: the simulator's errors (a batch size outside a profile).
    """
    check_span(trace)
    types = list(dict.fromkeys(spec.instance_type for spec in timeline.instances))
    base = profile_types or {}
    profiles = {name: app.profile(stage.name, base.get(name, name)) for name in types}
    prices = {**app.prices_usd_per_hr, **(extra_prices_usd_per_hr or {})}
    qos_ms = app.constraints.slo_ms
    # The base types are judged as the planner judges them: at the SLO less the service's own
    # measured time per query (none offline).
    base_ms = app.constraints.stage_slo_ms
    chosen = dispatch if dispatch is not None else mix_policy(stage.policy, stage.fleet)
    if chosen is None:  # a plan of one type: the planner's rule over the types it runs
        chosen, _ = dispatch_choice(None, profiles, prices, trace.batch_size, base_ms)
    make_policy = _dispatch_factory(
        chosen, profiles, trace, base_ms, prices, timeline.instances, stage
    )
    sim_stage = Stage(
        model=stage.name,
        instances=timeline.instances,
        profiles=profiles,
        policy=make_policy(),
        max_batch_queries=stage.batch_size,
    )
    result = _simulate_capped(
        trace,
        [sim_stage],
        rng,
        [timeline.batch_caps],
        [stage.batch_size],
        prices_usd_per_hr=prices,
        qos_ms=qos_ms,
        admission=admission,
    )
    all_types = list(dict.fromkeys([*stage.fleet, *types]))
    p99_ms, missed, refused = outcome(result, qos_ms)
    return ReplayResult(
        policy=policy,
        p99_ms=p99_ms,
        slo_miss_share=missed,
        refused_share=refused,
        cost_usd=result.cost_usd + _aborted_cost_usd(timeline.aborted, prices, result.horizon_s),
        scaling_actions=timeline.scaling_actions,
        timeline=timeline_windows(result, timeline, all_types, prices),
        fleet_timeline=timeline,
        simulation=result,
    )


def _dispatch_factory(
    dispatch: str,
    profiles: Mapping[str, LatencyProfile],
    trace: Trace,
    qos_ms: float,
    prices: Mapping[str, float],
    instances: Sequence[InstanceSpec] = (),
    plan: StagePlan | None = None,
) -> Callable[[], DispatchPolicy]:
    """``dispatch`` over ``profiles``' types, as the live dispatcher runs it on the fleet of
    ``instances`` over time: FCFS while the instances serving are of one type
    (:class:`controlplane.policies.pipeline.FleetRulePolicy`; a plan's mix that a tuner thins
    to one type, or an oracle's fleet per minute), ``dispatch`` while they are several, its base
    types in ``plan``'s order (:meth:`StagePlan.in_base_order`: what the planner simulated and
    the live dispatcher follows)."""
    allowed = registry.plan_names()
    if dispatch not in allowed:
        what = "not one a plan may name" if dispatch in registry.names() else "unknown"
        raise ReplayError(f"dispatch policy {dispatch!r}: {what} ({' or '.join(allowed)})")
    base_types: list[str] = []
    if policy_class(dispatch).needs_base_type:
        base_types = full_range_types(profiles, trace.batch_size, qos_ms, prices)
        if not base_types:
            raise ReplayError(
                f"{dispatch} needs a type that meets the SLO of {qos_ms:g} ms at every batch size"
            )
        if plan is not None:
            base_types = plan.in_base_order(base_types)
    # A policy that needs no base is given none, as the planner gives it none
    # (``pipeline.dispatch_choice``): FCFS then serves the fastest idle instance first, as the
    # live dispatcher does (its slots' speed ranks), not the full-range types' order.
    return by_fleet(dispatch, policy_factory(dispatch, profiles, base_types), profiles, instances)


# --- multi-stage plans -----------------------------------------------------------------------


def check_stages(plan: PlanDocument, app: ResolvedApp) -> tuple[StagePlan, ...]:
    """A multi-stage plan's stages, checked against the app: one per model of the spec's serving
    order, in that order, each fleet of the spec's types, and all of them within the budget.

    Raises:
        ReplayError: stages that are not the app's models in its order, an unknown type, or
            fleets over the budget.
    """
    order = tuple(app.spec.serving_order)
    names = tuple(stage.name for stage in plan.stages)
    if names != order:
        raise ReplayError(
            f"the plan's stages ({', '.join(names)}) are not the spec's serving order"
            f" ({', '.join(order)})"
        )
    cost = 0.0
    for stage in plan.stages:
        for name in stage.fleet:
            if name not in app.prices_usd_per_hr:
                raise ReplayError(
                    f"the plan's type {name!r} is not one of the spec's instance types "
                    f"({', '.join(app.instance_types)})"
                )
        cost += stage_cost_usd_per_hr(stage, app)
    if cost > app.constraints.budget_usd_per_hr + 1e-9:
        raise ReplayError(
            f"the plan's fleets cost {cost:.6g} USD/hr, over the spec's budget of "
            f"{plain(app.constraints.budget_usd_per_hr)} USD/hr"
        )
    return tuple(plan.stages)


def split_slo_ms(slo_ms: float, predicted_p99_ms: Sequence[float]) -> tuple[float, ...]:
    """``slo_ms`` split over stages in proportion to their predicted P99s; equally when some
    stage has no prediction (0: a plan document without them).

    >>> split_slo_ms(48.0, [6.0, 18.0])
    (12.0, 36.0)
    >>> split_slo_ms(48.0, [6.0, 0.0])
    (24.0, 24.0)
    """
    weights = [float(p) for p in predicted_p99_ms]
    if not weights:
        return ()
    if not all(math.isfinite(w) and w > 0.0 for w in weights):
        weights = [1.0] * len(weights)
    total = sum(weights)
    return tuple(slo_ms * w / total for w in weights)


def stage_slo_targets_ms(plan: PlanDocument, app: ResolvedApp) -> tuple[float, ...]:
    """Each stage's share of the SLO: the tuner's latency target for the stage. The planner plans
    a cascade's stages jointly against the end-to-end SLO and stores no per-stage target, so the
    SLO less the control plane's own time per query (what the stages share, as the planner
    counts it) is split in proportion to the plan's per-stage predicted P99s (each stage's tail on
    the queries that reach it), equally when the plan has none (:func:`split_slo_ms`)."""
    slo_ms = app.constraints.stage_slo_ms
    return split_slo_ms(slo_ms, [stage.predicted_p99_ms for stage in plan.stages])


def _reach_masks(
    answered: NDArray[np.int64] | None, stages: int, queries: int
) -> list[NDArray[np.bool_]]:
    """Per stage, which queries reach it: every query reaches the first stage, and stage i the
    queries answered at i or later (all of them without validation records)."""
    masks: list[NDArray[np.bool_]] = []
    for i in range(stages):
        if answered is None or i == 0:
            masks.append(np.ones(queries, dtype=np.bool_))
        else:
            masks.append(answered >= i)
    return masks


# The seed of the thinning of a planning trace that is not the replayed trace's own.
_THINNING_SEED = 20_251_129


def thin_planning_arrivals(
    planning_arrival_s: NDArray[np.float64], trace: Trace, reach: NDArray[np.bool_]
) -> NDArray[np.float64]:
    """The planning arrivals that reach a stage. When they are the replayed trace's own first
    queries (the default planning trace, :func:`planning_arrivals`), exactly those of them that
    ``reach`` marks (the same forwarding the replay simulates); otherwise (a planning trace of its
    own, whose queries have no validation samples here) each is kept with probability s, the
    replayed trace's reach share, drawn from a generator of fixed seed (deterministic). A cascade
    forwards a query for its input, not for when it came, so the queries that reach a stage are
    an independent thinning of those that reach the first: a systematic one (every 1/s-th) would
    be smoother than the traffic the stage sees, and the tuner would read its live bursts as
    more load than planned.

    >>> t = Trace(np.arange(4.0), np.ones(4, dtype=np.int64))
    >>> reach = np.array([True, False, True, False])
    >>> thin_planning_arrivals(np.arange(2.0), t, reach).tolist()
    [0.0]
    >>> kept = thin_planning_arrivals(np.arange(10_000.0), t, reach)
    >>> bool(abs(kept.size - 5_000) < 200), bool(np.all(np.diff(kept) > 0))
    (True, True)
    """
    planning = np.asarray(planning_arrival_s, dtype=np.float64)
    n = planning.size
    if n <= len(trace) and np.array_equal(planning, trace.arrival_s[:n]):
        own: NDArray[np.float64] = planning[reach[:n]]
        return own
    share = float(np.count_nonzero(reach)) / reach.size if reach.size else 0.0
    keep = np.random.default_rng(_THINNING_SEED).random(n) < share
    thinned: NDArray[np.float64] = planning[keep]
    return thinned


def _thinned_ladder(
    ladder: SizingLadder, trace: Trace, reach: NDArray[np.bool_], planning: NDArray[np.float64]
) -> SizingLadder:
    """A cascade stage's ladder as the stage sees it: its burstiness families' planning
    arrivals thinned as the stage's own (``planning``, already thinned) are, and each family,
    and the ladder itself, labelled with its thinned stream's CV^2 (a stream of CV^2 c thinned at
    share s has CV^2 s c + 1 - s), which is what the stage's live CV^2 is matched with."""
    thinned = [
        (thin_planning_arrivals(arrival_s, trace, reach), other)
        for _cv2, arrival_s, other in ladder.families
    ]
    return dataclasses.replace(
        ladder,
        cv2=arrival_cv2(planning)[0] if ladder.cv2 is not None else None,
        families=tuple((arrival_cv2(a)[0], a, other) for a, other in thinned),
    )


@dataclass(slots=True)
class _StageTuner:
    """One stage's tuner in a cascade replay (never escapes this module)."""

    plan: TunerStage
    config: TunerConfig
    state: TunerState
    arrival_s: NDArray[np.float64]
    log: _FleetLog

    def window(self, now_s: float) -> NDArray[np.float64]:
        lo, hi = np.searchsorted(self.arrival_s, [now_s - self.config.recent_s, now_s], "right")
        window: NDArray[np.float64] = self.arrival_s[lo:hi]
        return window

    def next_arrival_s(self, now_s: float) -> float:
        """The first arrival after ``now_s`` (infinity: none)."""
        at = int(np.searchsorted(self.arrival_s, now_s, "right"))
        return float(self.arrival_s[at]) if at < self.arrival_s.size else math.inf

    def run(
        self, now_s: float, budget_usd_per_hr: float
    ) -> tuple[list[ScalingDecision], TunerState]:
        config = dataclasses.replace(self.config, budget_usd_per_hr=budget_usd_per_hr)
        return tune(self.window(now_s), now_s, self.state, [self.plan], config)

    def deficit(self, decisions: Sequence[ScalingDecision], state: TunerState) -> float:
        """The share of the capacity the stage wants that it lacks now: (wanted - now) / wanted,
        wanted = what the decisions launched plus what the budget kept them short of (0: no
        scale-up wanted)."""
        plan = self.plan
        before = plan.capacity_qps(self.state.fleets[plan.name])
        wanted = plan.capacity_qps(state.fleets[plan.name])
        mu = plan.rate_per_instance_qps
        wanted += sum(
            d.count * mu[d.instance_type] for d in decisions if d.action == "budget_capped"
        )
        return max(0.0, (wanted - before) / wanted) if wanted > before else 0.0


@dataclass(frozen=True, slots=True)
class _CascadeStage:
    timeline: FleetTimeline
    utilisation_target: float | None
    note: str | None


def cascade_tuner_timelines(
    trace: Trace,
    app: ResolvedApp,
    stages: Sequence[StagePlan],
    answered: NDArray[np.int64] | None,
    planning_arrival_s: NDArray[np.float64],
    targets_ms: Sequence[float],
    *,
    boot_s: Mapping[str, float] | None = None,
    min_window_s: float = DEFAULT_TUNER_MIN_WINDOW_S,
    dispatch: DispatchName | None = None,
    recent_s: float = DEFAULT_RECENT_S,
    persistence_s: float | None = None,
    ladders: Mapping[str, SizingLadder] | None = None,
) -> tuple[_CascadeStage, ...]:
    """Roll one InferLine tuner per stage over ``trace`` once per second (docs/tuner.md,
    "Cascades: one tuner per stage").

    Stage i sees the arrivals of the queries that reach it (``answered`` >= i, the validation
    records' forwarding, the same queries the pipeline simulation forwards); its tuner is set up
    as :func:`tuner_timeline` sets up a single stage, but on the stage's own planning envelope
    (:func:`thin_planning_arrivals`) and its own batch mix, so with scale factor 1 (the reach is
    in the arrivals), the spec's ``max_counts`` per type, and, for a Kairos mix, the Kairos bound
    at the stage's share of the SLO (``targets_ms``). A stage with a sizing ladder in
    ``ladders`` (:func:`controlplane.policies.capacity_curve.build_ladders`: the planner's fleet
    of that stage at each load of the whole cascade) is sized by it as a single stage is
    (:func:`ladder_tuner`), its burstiness families thinned as its planning arrivals are. A
    stage whose planning arrivals reach it fewer than twice keeps its planned fleet.

    A laddered stage's batch cap is read at 0 s and after every tick (:func:`_note_batch`) and
    kept where it changes (its timeline's ``batch_caps``).

    The budget binds all stages together. Each tick every tuner first decides alone, under the
    budget less what the other stages run; stages that want no scale-up then act first (their
    scale-downs free budget), then those that do, the largest deficit first (the share of the
    capacity the stage wants that it lacks; ties in serving order), each under the budget less
    what the others run by then. A scale-up the budget cuts is recorded ``budget_capped``.
    """
    budget = app.constraints.budget_usd_per_hr
    prices = app.prices_usd_per_hr
    masks = _reach_masks(answered, len(stages), len(trace))
    tuners: list[_StageTuner | None] = []
    fixed: list[float] = []  # the cost of a stage left on its plan
    made: list[tuple[float | None, str | None]] = []
    logs: list[_FleetLog] = []
    for i, stage in enumerate(stages):
        mask = masks[i]
        reached = Trace(trace.arrival_s[mask], trace.batch_size[mask]) if mask.any() else trace
        planning = thin_planning_arrivals(planning_arrival_s, trace, mask)
        ladder = None if ladders is None else ladders.get(stage.name)
        if ladder is not None and planning.size >= 2:
            sized, config, boot = ladder_tuner(
                reached,
                app,
                stage,
                planning,
                _thinned_ladder(ladder, trace, mask, planning),
                boot_s=boot_s,
                min_window_s=min_window_s,
                recent_s=recent_s,
                persistence_s=persistence_s,
            )
            first = Fleet.of({name: n for name, n in stage.fleet.items() if n > 0})
            log = _FleetLog.planned(first, boot)
            logs.append(log)
            state = dataclasses.replace(
                initial_state([sized], now_s=0.0), fleets={sized.name: first}
            )
            tuners.append(_StageTuner(sized, config, state, trace.arrival_s[mask], log))
            fixed.append(0.0)
            made.append((sized.utilisation_target, None))
            continue
        mu = _stage_rates(app, stage, reached)
        boot = _boot_s(app, list(mu), boot_s)
        fleet = {name: stage.fleet[name] for name in mu}
        log = _FleetLog.planned(Fleet.of(fleet), boot)
        logs.append(log)
        if planning.size < 2:
            tuners.append(None)
            fixed.append(sum(n * prices[t] for t, n in fleet.items()))
            made.append(
                (
                    None,
                    f"{planning.size} planning queries reach {stage.name}: no"
                    " envelope to tune on, the stage keeps its planned fleet",
                )
            )
            continue
        service_time_s = max(_batch_latency_s(app, stage, reached, t, mu[t]) for t in mu)
        service_time_s = min(max(service_time_s, min_window_s), DEFAULT_MAX_WINDOW_S)
        config = TunerConfig.from_planning_trace(
            planning,
            service_time_s,
            budget_usd_per_hr=budget,
            constraints=app.constraints,
            catalog=app.catalog,
            types=list(mu),
            boot_s=boot,
            recent_s=recent_s,
            persistence_s=persistence_s,
        )
        model = matched_capacity_model(
            app,
            dispatch if dispatch is not None else stage.policy,
            stage.name,
            list(mu),
            stage.batch_size,
            reached,
            targets_ms[i],
        )
        rho = utilisation_target(
            fleet, mu, 1.0, config.planned_peak_rate_qps, model, whole_instances=True
        )
        plan = TunerStage(stage.name, 1.0, fleet, mu, rho, capacity_model=model)
        state = initial_state([plan], now_s=0.0)
        tuners.append(_StageTuner(plan, config, state, trace.arrival_s[mask], log))
        fixed.append(0.0)
        made.append((rho, None))

    def costs() -> list[float]:
        return [
            fixed[i] if t is None else fleet_cost_usd_per_hr(t.state, prices)
            for i, t in enumerate(tuners)
        ]

    def left_for(i: int, cost: Sequence[float]) -> float:
        others = sum(c for j, c in enumerate(cost) if j != i)
        return max(0.0, budget - others)

    active = [i for i, t in enumerate(tuners) if t is not None]
    caps: list[list[tuple[float, int]]] = [[] for _ in stages]

    def note_cap(i: int, now_s: float) -> None:
        tuner = tuners[i]
        assert tuner is not None
        _note_batch(
            caps[i],
            stages[i].batch_size,
            tuner.plan,
            tuner.state,
            tuner.arrival_s,
            now_s,
            tuner.config,
        )

    for i in active:
        note_cap(i, 0.0)
    ticks = _ticks(float(trace.arrival_s[-1]), TUNER_TICK_S)
    for now_s in ticks:
        rested = True
        cost = costs()
        alone: dict[int, tuple[float, list[ScalingDecision], TunerState]] = {}
        deficit: dict[int, float] = {}
        for i in active:
            tuner = tuners[i]
            assert tuner is not None
            allowed = left_for(i, cost)
            decisions, state = tuner.run(now_s, allowed)
            alone[i] = (allowed, decisions, state)
            deficit[i] = tuner.deficit(decisions, state)
        order = sorted(active, key=lambda i: (deficit[i] > 0.0, -deficit[i], i))
        for rank, i in enumerate(order):
            tuner = tuners[i]
            assert tuner is not None
            allowed = left_for(i, cost)
            if allowed == alone[i][0]:
                decisions, state = alone[i][1], alone[i][2]
            else:
                decisions, state = tuner.run(now_s, allowed)
            rested = rested and _at_rest(
                tuner.state, state, decisions, tuner.window(now_s).size == 0, now_s, tuner.config
            )
            tuner.state = state
            cost[i] = fleet_cost_usd_per_hr(state, prices)
            for d in decisions:
                if d.action == "scale_up":
                    tuner.log.launch(d.instance_type, d.count, d.at_s)
                elif d.action == "scale_down":
                    tuner.log.stop(d.instance_type, d.count, d.at_s)
                reason = d.reason
                if d.action == "budget_capped":
                    reason += (
                        f"; the {plain(budget)} USD/hr budget is shared by the stages:"
                        f" the others run"
                        f" {budget - allowed:.6g} USD/hr, this stage went {rank + 1} of"
                        f" {len(order)} (deficit {deficit[i]:.3g}; the largest deficit first)"
                    )
                tuner.log.decide(
                    ReplayDecision(d.at_s, d.stage, d.action, d.instance_type, d.count, reason)
                )
            note_cap(i, now_s)
        if rested:
            upcoming = (t.next_arrival_s(now_s) for t in tuners if t is not None)
            ticks.skip_to(min(upcoming, default=math.inf))
    return tuple(
        _CascadeStage(dataclasses.replace(log.timeline(), batch_caps=tuple(cap)), rho, note)
        for log, (rho, note), cap in zip(logs, made, caps, strict=True)
    )


def batch_schedule(
    caps: Sequence[Sequence[tuple[float, int]]], planned: Sequence[int]
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """The stages' batch caps together: each stage's ``caps`` ((time, cap) where it changes;
    the ``planned`` cap before its first) merged into (the times any cap changes, the first
    0.0; the caps from each time on, one column per stage)."""
    times = sorted({0.0} | {t for stage in caps for t, _ in stage})
    rows = np.empty((len(times), len(planned)), dtype=np.int64)
    for j, (stage, cap) in enumerate(zip(caps, planned, strict=True)):
        k = 0
        for i, t in enumerate(times):
            while k < len(stage) and stage[k][0] <= t:
                cap = stage[k][1]
                k += 1
            rows[i, j] = cap
    return np.asarray(times, dtype=np.float64), rows


@dataclass(frozen=True, slots=True)
class _CapSchedule:
    """The simulator's mode controller (:class:`~estimator.simulator.ModeController`) for a
    fixed schedule: mode ``modes[i]`` from ``times[i]`` on, looked up every ``period_s``."""

    times: NDArray[np.float64]
    modes: NDArray[np.int64]
    # The caps change at the tuners' ticks (from 0 on), which these look-ups meet.
    period_s: float = TUNER_TICK_S

    def initial_mode(self) -> int:
        return int(self.modes[0])

    def tick(self, now_s: float, queue_lengths: tuple[int, ...]) -> int:
        del queue_lengths
        return int(self.modes[max(int(np.searchsorted(self.times, now_s, "right")) - 1, 0)])


def _simulate_capped(
    trace: Trace,
    built: Sequence[Stage],
    rng: np.random.Generator,
    caps: Sequence[Sequence[tuple[float, int]]],
    planned: Sequence[int],
    **options: Any,
) -> SimulationResult:
    """``simulate`` of ``built`` on ``trace``; where a tuner's ladder moved a stage's batch cap
    (``caps``, per stage, as :attr:`FleetTimeline.batch_caps`; ``planned``, each stage's plan's),
    with the caps as modes of a routing (:func:`_scheduled_routing`), which then carries the
    stages' forwarding in place of their flags."""
    if not any(caps):
        return simulate(trace, built, rng, **options)
    routing, controller = _scheduled_routing(built, batch_schedule(caps, planned), len(trace))
    unflagged = [dataclasses.replace(stage, forward=None) for stage in built]
    return simulate(trace, unflagged, rng, routing=routing, controller=controller, **options)


def _scheduled_routing(
    built: Sequence[Stage], schedule: tuple[NDArray[np.float64], NDArray[np.int64]], queries: int
) -> tuple[Routing, _CapSchedule]:
    """The pipeline's forwarding (``built``'s ``forward`` flags) as a routing with one mode per
    distinct row of batch caps in ``schedule``, and the controller that switches between them
    at its times."""
    times, rows = schedule
    distinct, modes = np.unique(rows, axis=0, return_inverse=True)
    stages = len(built)
    nxt = np.full((stages, queries), -1, dtype=np.int64)
    for s, stage in enumerate(built[:-1]):
        if stage.forward is not None:  # without flags a stage answers, as the simulator has it
            nxt[s, np.asarray(stage.forward, dtype=np.bool_)] = s + 1
    # The routing holds (modes, stages, queries) integers: a few modes (the distinct rows of
    # caps), about 10 MB for a cascade's 150,000 queries.
    count = distinct.shape[0]
    routing = Routing(
        entry=np.zeros((count, queries), dtype=np.int64),
        next_stage=np.broadcast_to(nxt, (count, stages, queries)),
        max_batch_queries=distinct,
    )
    return routing, _CapSchedule(times, np.asarray(modes, dtype=np.int64).reshape(-1))


def _window_starts(end_s: float) -> NDArray[np.float64]:
    starts: NDArray[np.float64] = TIMELINE_STEP_S * np.arange(
        max(1, math.floor(end_s / TIMELINE_STEP_S) + 1), dtype=np.float64
    )
    return starts


def _stage_windows(
    arrival_s: NDArray[np.float64],
    end_s: float,
    timeline: FleetTimeline,
    types: Sequence[str],
    prices: Mapping[str, float],
) -> tuple[TimelineWindow, ...]:
    starts = _window_starts(end_s)
    bounds = np.searchsorted(arrival_s, np.append(starts, starts[-1] + TIMELINE_STEP_S))
    return tuple(
        TimelineWindow(
            t_s=t_s,
            fleet=timeline.ready_fleet_at(t_s, types),
            rate_qps=float(bounds[k + 1] - bounds[k]) / TIMELINE_STEP_S,
            p99_ms=None,
            cost_usd_per_hr=timeline.peak_cost_usd_per_hr(prices, t_s, t_s + TIMELINE_STEP_S),
        )
        for k, t_s in enumerate(float(t) for t in starts)
    )


def replay_pipeline(
    trace: Trace,
    app: ResolvedApp,
    plan: PlanDocument,
    rng: np.random.Generator,
    *,
    policy: ScalingPolicy = "static",
    planning_arrival_s: NDArray[np.float64] | None = None,
    boot_s: Mapping[str, float] | None = None,
    dispatch: DispatchName | None = None,
    tuner_min_window_s: float = DEFAULT_TUNER_MIN_WINDOW_S,
    tuner_recent_s: float = DEFAULT_RECENT_S,
    tuner_persistence_s: float | None = None,
    tuner_ladders: Mapping[str, SizingLadder] | None = None,
    admission: bool = True,
) -> ReplayResult:
    """Replay ``trace`` through every stage of ``plan`` at once, each with its batch size and
    dispatch (``dispatch`` overrides the plan's), each query forwarded to the next stage as the
    validation records say (its ``sample_id``, else a sample drawn with ``rng`` before the
    service times are), as the planner simulates the pipeline
    (:func:`controlplane.policies.pipeline.pipeline_stages`).

    ``static``: every stage keeps its planned fleet. ``tuner``: one tuner per stage on the
    arrivals that reach it, within the one budget (:func:`cascade_tuner_timelines`, planning on
    ``planning_arrival_s``, by default the trace's first 10%), and the pipeline simulated once on
    the stages' changing fleets (exact for the reason :func:`replay` gives: the tuners decide
    from arrivals only), a stage sized by its ladder taking the ladder's batch for its ready
    fleet instead of the plan's (:func:`batch_schedule`). The timeline's fleet and cost are the
    stages' together; ``p99_ms`` and ``slo_miss_share`` are end to end; ``stages`` has each
    stage's reach, SLO share (:func:`stage_slo_targets_ms`), fleet over time, batch caps and
    decisions.

    Raises:
        ReplayError: stages that do not fit the app (:func:`check_stages`), a policy other than
            static or tuner.
        EstimatorError: the simulator's errors (a batch size outside a profile).
    """
    check_span(trace)
    stages = check_stages(plan, app)
    if policy not in scaling.names() or not scaling.entry(policy).scales_cascades:
        raise ReplayError(f"a multi-stage plan replays static or with the tuner, not {policy!r}")
    answered = answering_stages(app, trace, rng)
    targets = stage_slo_targets_ms(plan, app)
    masks = _reach_masks(answered, len(stages), len(trace))
    prices = dict(app.prices_usd_per_hr)
    qos_ms = app.constraints.slo_ms
    if policy == "tuner":
        planning = planning_arrivals(trace) if planning_arrival_s is None else planning_arrival_s
        made = cascade_tuner_timelines(
            trace,
            app,
            stages,
            answered,
            np.asarray(planning, dtype=np.float64),
            targets,
            boot_s=boot_s,
            min_window_s=tuner_min_window_s,
            dispatch=dispatch,
            recent_s=tuner_recent_s,
            persistence_s=tuner_persistence_s,
            ladders=tuner_ladders,
        )
        fleets: list[Sequence[InstanceSpec]] = [m.timeline.instances for m in made]
    else:
        made = tuple(_CascadeStage(static_timeline(stage.fleet), None, None) for stage in stages)
        fleets = [
            [InstanceSpec(t) for t, n in stage.fleet.items() for _ in range(n)] for stage in stages
        ]
    built = pipeline_stages(
        app,
        [
            (
                stage.name,
                fleet,
                stage.batch_size,
                dispatch if dispatch is not None else mix_policy(stage.policy, stage.fleet),
            )
            for stage, fleet in zip(stages, fleets, strict=True)
        ],
        trace,
        answered,
    )
    result = _simulate_capped(
        trace,
        built,
        rng,
        [m.timeline.batch_caps for m in made],
        [stage.batch_size for stage in stages],
        prices_usd_per_hr=prices,
        qos_ms=qos_ms,
        admission=admission,
    )
    timeline = FleetTimeline(
        tuple(spec for m in made for spec in m.timeline.instances),
        tuple(a for m in made for a in m.timeline.aborted),
        tuple(sorted((d for m in made for d in m.timeline.decisions), key=lambda d: d.at_s)),
    )
    types = list(
        dict.fromkeys(
            [
                *(t for stage in stages for t in stage.fleet),
                *(s.instance_type for s in timeline.instances),
            ]
        )
    )
    end_s = float(result.arrival_s[-1])
    per_stage = []
    for i, (stage, m) in enumerate(zip(stages, made, strict=True)):
        stage_types = list(
            dict.fromkeys([*stage.fleet, *(s.instance_type for s in m.timeline.instances)])
        )
        per_stage.append(
            StageReplay(
                name=stage.name,
                reach_share=float(np.count_nonzero(masks[i])) / len(trace),
                slo_target_ms=targets[i],
                utilisation_target=m.utilisation_target,
                fleet_timeline=m.timeline,
                timeline=_stage_windows(
                    trace.arrival_s[masks[i]], end_s, m.timeline, stage_types, prices
                ),
                note=m.note,
            )
        )
    p99_ms, missed, refused = outcome(result, qos_ms)
    return ReplayResult(
        policy=policy,
        p99_ms=p99_ms,
        slo_miss_share=missed,
        refused_share=refused,
        cost_usd=result.cost_usd + _aborted_cost_usd(timeline.aborted, prices, result.horizon_s),
        scaling_actions=timeline.scaling_actions,
        timeline=timeline_windows(result, timeline, types, prices),
        fleet_timeline=timeline,
        simulation=result,
        stages=tuple(per_stage),
    )
