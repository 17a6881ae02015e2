"""The discrete-event simulator: InferLine's estimator, generalised to heterogeneous fleets.

A trace of queries flows through one or more stages. Each stage has a central queue
(:class:`matching.queues.CentralQueue`, the live dispatcher's too), a fleet of instances (of several
instance types, each with its latency profile) and a dispatch policy (:mod:`matching.policy`). An
instance serves one batch at a time; a batch of queries whose batch sizes sum to B takes a service
time drawn from its type's profile at B. After a stage, a query
either leaves (its response time is completion minus arrival, spanning every stage it visited) or,
for cascades, is forwarded to the next stage's queue (InferLine section 4.2, "conditional control
flow using scale factor s"). Instances may join and leave during the run (``InstanceSpec``), which
the tuner's replay uses.

Gear switching (CascadeServe section 5) needs two more things, both optional: a :class:`Routing`
gives every query its route under each of several *modes* (a cascade gear: which stage it enters,
where it goes after each stage, each stage's batch cap), and a :class:`ModeController` is asked
every ``period_s`` of simulated time, with the queue length of every stage, which mode holds from
then on. A query takes the route of the mode in force when it arrives (the producer puts it into
the queue of the gear's first model); batch caps change at once; queued queries stay where they
are, so queues carry across a change. That is the whole hook: the engine knows nothing of gears.

**The batch trigger** (CascadeServe section 4.5, "minimum queue length"): a stage with
``min_queue`` m > 1 starts a batch only once its queue holds at least m queries, or once its
oldest queued query has waited ``max_wait_s`` in that queue (the starvation guard: a lone query at
low load is never stranded); then the policy takes the queue as usual (up to the batch cap). The
engine wakes the stage at the guard's expiry, so a stage waiting for its trigger needs no other
event. m = 1 (the default) is dispatch-at-once. A :class:`Routing` may give each mode its own m
and guard per stage. The live dispatcher applies the same rule
(``controlplane.serving.dispatcher``).

Two engines compute the same thing:

- the **event engine** (plain Python) keeps an event heap keyed by (time, priority, sequence), as
  SimPy does: at one instant, completions are handled before instances join, before arrivals, and
  the policy is asked once all of that instant's events are in. It runs any policy and any number of
  stages.
- the **FCFS kernel** (:mod:`estimator.kernels`, compiled) handles the common case of one stage, a
  static fleet and :class:`matching.fcfs.FcfsPolicy` at tens of millions of queries per second.

Both draw service times the same way (one uniform number per query and stage, drawn up front from
the caller's generator), so for the same seed they agree query by query; tests check it.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from estimator.errors import BatchSizeOutOfRangeError, SimulationError
from estimator.kernels import fcfs_kernel
from estimator.profiles import LatencyProfile, ServiceMode
from estimator.traces import Trace
from matching.admission import Backlog, allowance_ms, batch_samples, queue_wait_ms
from matching.errors import InvalidDispatchError
from matching.fcfs import FcfsPolicy
from matching.policy import Dispatch, DispatchPolicy, QueuedQuery, StageContext, queries_per_call
from matching.queues import CentralQueue

Engine = Literal["auto", "events", "kernel"]

# Event priorities at one instant: free instances first, then joins, then the mode controller's
# tick, then arrivals.
_COMPLETION, _JOIN, _TICK = 0, 1, 2


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One instance of a stage: its type, when it can serve, when it stops taking work.

    Billing runs from ``billed_from_s`` (default: ``ready_s``) to ``stop_s`` or the end of the run:
    an instance that is booting already costs money.
    """

    instance_type: str
    ready_s: float = 0.0
    stop_s: float = math.inf
    billed_from_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.ready_s >= 0 and self.stop_s > self.ready_s):
            raise SimulationError(
                f"instance of {self.instance_type}: needs 0 <= ready_s < stop_s"
                f" (got {self.ready_s}, {self.stop_s})"
            )


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a pipeline: a model served by a fleet under a dispatch policy.

    ``forward`` (cascades): per query, whether it goes on to the next stage after this one.
    """

    model: str
    instances: tuple[InstanceSpec, ...]
    profiles: Mapping[str, LatencyProfile]  # by instance type
    policy: DispatchPolicy = field(default_factory=FcfsPolicy)
    max_batch_queries: int = 1
    forward: np.ndarray | None = None
    # The batch trigger (module docstring): a batch starts once min_queue queries are queued, or
    # once the oldest has waited max_wait_s (needed, finite, when min_queue > 1).
    min_queue: int = 1
    max_wait_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.instances:
            raise SimulationError(f"stage {self.model!r} has no instances")
        if self.max_batch_queries < 1:
            raise SimulationError(f"stage {self.model!r}: max batch must be >= 1")
        _check_trigger(self.model, self.min_queue, self.max_wait_s)
        for spec in self.instances:
            if spec.instance_type not in self.profiles:
                raise SimulationError(
                    f"stage {self.model!r}: no profile for instance type {spec.instance_type!r}"
                )


def _check_trigger(model: str, min_queue: int, max_wait_s: float) -> None:
    if min_queue < 1:
        raise SimulationError(f"stage {model!r}: min_queue must be >= 1, got {min_queue}")
    if min_queue > 1 and not (math.isfinite(max_wait_s) and max_wait_s >= 0):
        raise SimulationError(
            f"stage {model!r}: a min_queue above 1 needs a finite max_wait_s >= 0 (the guard),"
            f" got {max_wait_s!r}"
        )


@dataclass(frozen=True, slots=True, eq=False)
class Routing:
    """Every query's route under each of G modes, over S stages and n queries.

    ``entry[g, q]`` is the stage query q enters when it arrives under mode g;
    ``next_stage[g, s, q]`` where it goes after stage s (a later stage, or -1: it is answered
    there); ``max_batch_queries[g, s]`` stage s's batch cap while mode g holds; ``min_queue[g,
    s]`` and ``max_wait_s[g, s]`` its batch trigger and guard (default: 1, dispatch at once). A
    stage a route never visits still needs its instances (they stay idle).
    """

    entry: np.ndarray
    next_stage: np.ndarray
    max_batch_queries: np.ndarray
    min_queue: np.ndarray | None = None
    max_wait_s: np.ndarray | None = None

    def __post_init__(self) -> None:
        entry = np.ascontiguousarray(self.entry, dtype=np.int64)
        nxt = np.ascontiguousarray(self.next_stage, dtype=np.int64)
        caps = np.ascontiguousarray(self.max_batch_queries, dtype=np.int64)
        if entry.ndim != 2 or nxt.ndim != 3 or caps.ndim != 2:
            raise SimulationError(
                "routing needs entry (modes, queries), next_stage (modes, stages, queries) and"
                " max_batch_queries (modes, stages)"
            )
        modes, stages, n = nxt.shape
        if entry.shape != (modes, n) or caps.shape != (modes, stages) or modes == 0:
            raise SimulationError(
                f"routing shapes disagree: entry {entry.shape}, next_stage {nxt.shape},"
                f" max_batch_queries {caps.shape}"
            )
        if entry.size and (entry.min() < 0 or entry.max() >= stages):
            raise SimulationError(f"routing: an entry stage outside 0..{stages - 1}")
        here = np.arange(stages)[None, :, None]
        if np.any((nxt != -1) & ((nxt <= here) | (nxt >= stages))):
            raise SimulationError("routing: a next stage must be a later stage, or -1 to answer")
        if caps.size and caps.min() < 1:
            raise SimulationError("routing: batch caps must be >= 1")
        trigger = np.ascontiguousarray(
            np.ones_like(caps) if self.min_queue is None else self.min_queue, dtype=np.int64
        )
        wait = np.ascontiguousarray(
            np.full(caps.shape, math.inf) if self.max_wait_s is None else self.max_wait_s,
            dtype=np.float64,
        )
        if trigger.shape != caps.shape or wait.shape != caps.shape:
            raise SimulationError(
                "routing: min_queue and max_wait_s need the shape (modes, stages)"
            )
        for (g, s), m in np.ndenumerate(trigger):
            _check_trigger(f"{s} of mode {g}", int(m), float(wait[g, s]))
        for name, value in (
            ("entry", entry),
            ("next_stage", nxt),
            ("max_batch_queries", caps),
            ("min_queue", trigger),
            ("max_wait_s", wait),
        ):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def modes(self) -> int:
        return int(self.next_stage.shape[0])


class ModeController(Protocol):
    """Chooses the mode of a routed run as it goes (a gear switcher): asked first for the mode at
    time 0, then every ``period_s`` with the queue length of every stage at that instant."""

    @property
    def period_s(self) -> float: ...

    def initial_mode(self) -> int: ...

    def tick(self, now_s: float, queue_lengths: tuple[int, ...]) -> int: ...


@dataclass(frozen=True, slots=True, eq=False)
class ServiceTable:
    """Service times of one stage's instance types on a dense batch-size axis, in seconds.

    ``table_s[type, b, k]``: the ``k``-th of K quantile points at batch size ``b`` (NaN outside
    the profile); a query with uniform draw ``u`` takes column ``floor(u K)``. In ``mean`` mode
    K = 1 and the column is the interpolated mean.
    """

    instance_types: tuple[str, ...]
    low: np.ndarray
    high: np.ndarray
    table_s: np.ndarray
    # mean_s's answers by (type id, batch size), each computed on first use: admission control
    # asks at every arrival, where a NumPy reduction each time was most of a replay's time, and
    # most simulations never ask (computing every size up front costs the planner's many runs)
    mean_cache_s: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, profiles: Mapping[str, LatencyProfile], mode: ServiceMode) -> ServiceTable:
        types = tuple(sorted(profiles))
        chosen = [profiles[t] for t in types]
        low = np.array([p.min_batch_size for p in chosen], dtype=np.int64)
        high = np.array([p.max_batch_size for p in chosen], dtype=np.int64)
        if mode == "mean":
            k_points = 1
        elif mode == "sampled":
            k_points = max(cell.size for p in chosen for cell in p.samples_ms)
        else:
            raise SimulationError(f"unknown service mode {mode!r} (sampled or mean)")
        table = np.full((len(types), int(high.max()) + 1, k_points), np.nan)
        for i, profile in enumerate(chosen):
            dense = (
                profile.mean_table_ms() if mode == "mean" else profile.quantile_table_ms(k_points)
            )
            table[i, low[i] : high[i] + 1, :] = dense / 1000.0
        return cls(types, low, high, table)

    def type_id(self, instance_type: str) -> int:
        return self.instance_types.index(instance_type)

    def service_s(self, type_id: int, batch_size: int, u: float) -> float:
        return float(self.table_s[type_id, batch_size, int(u * self.table_s.shape[2])])

    def mean_s(self, type_id: int, batch_size: int) -> float:
        """Mean service time at ``batch_size`` (clipped into the type's measured range)."""
        key = (type_id, batch_size)
        known = self.mean_cache_s.get(key)
        if known is None:
            size = min(max(batch_size, int(self.low[type_id])), int(self.high[type_id]))
            known = self.mean_cache_s[key] = float(np.nanmean(self.table_s[type_id, size]))
        return known


@dataclass(frozen=True, slots=True, eq=False)
class SimulationResult:
    """What happened to every query, and the fleet's use and cost.

    ``instance`` is the index (into ``instance_types`` of the last stage the query visited) of
    the instance that answered it; ``stages_visited`` how many stages it went through;
    ``answered_stage`` the stage that answered it; ``mode`` (routed runs only) the mode in force
    when it arrived. A query refused by admission control (``simulate(admission=True)``) has an
    infinite ``finish_s``, its arrival as ``start_s``, instance and answered stage -1 and no
    stage visited.
    """

    arrival_s: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    instance: np.ndarray
    stages_visited: np.ndarray
    instance_types: tuple[tuple[str, ...], ...]  # per stage, per instance
    utilisation: tuple[np.ndarray, ...]  # per stage, per instance: busy share of its active time
    cost_usd: float
    horizon_s: float
    qos_ms: float | None
    engine: str
    answered_stage: np.ndarray | None = None
    mode: np.ndarray | None = None

    @property
    def response_ms(self) -> np.ndarray:
        response: np.ndarray = (self.finish_s - self.arrival_s) * 1000.0
        return response

    @property
    def wait_ms(self) -> np.ndarray:
        """Time in the queue of the first stage the query entered."""
        wait: np.ndarray = (self.start_s - self.arrival_s) * 1000.0
        return wait

    @property
    def cost_usd_per_hr(self) -> float:
        """Fleet cost averaged over the run (for a static fleet: the sum of its prices)."""
        return self.cost_usd / (self.horizon_s / 3600.0) if self.horizon_s > 0 else 0.0

    def summary(self) -> SimulationSummary:
        response = self.response_ms
        n = response.size
        p50, p95, p99 = (float(v) for v in np.percentile(response, [50, 95, 99]))
        span_s = float(self.finish_s.max() - self.arrival_s.min())
        return SimulationSummary(
            queries=n,
            p50_ms=p50,
            p95_ms=p95,
            p99_ms=p99,
            mean_ms=float(response.mean()),
            mean_wait_ms=float(self.wait_ms.mean()),
            attainment=(
                float(np.count_nonzero(response <= self.qos_ms) / n)
                if self.qos_ms is not None
                else None
            ),
            throughput_qps=n / span_s if span_s > 0 else float("inf"),
            cost_usd_per_hr=self.cost_usd_per_hr,
            cost_usd=self.cost_usd,
            mean_utilisation=float(np.mean(np.concatenate(self.utilisation))),
        )


@dataclass(frozen=True, slots=True)
class SimulationSummary:
    queries: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    mean_wait_ms: float
    attainment: float | None  # share of queries with response time <= QoS
    throughput_qps: float  # queries answered / (last answer - first arrival)
    cost_usd_per_hr: float
    cost_usd: float
    mean_utilisation: float


def speed_ranks(
    table: ServiceTable,
    instance_types: Sequence[str],
    reference_batch: int,
    preferred: Sequence[str] = (),
) -> dict[str, int]:
    """Rank instance types: the ``preferred`` ones first in that order, then the rest fastest
    first by mean service time at ``reference_batch``."""
    first = [t for t in preferred if t in set(instance_types)]
    rest = sorted(
        set(instance_types) - set(first),
        key=lambda t: (table.mean_s(table.type_id(t), reference_batch), t),
    )
    return {name: rank for rank, name in enumerate([*first, *rest])}


def _preferred_types(policy: DispatchPolicy) -> tuple[str, ...]:
    order: tuple[str, ...] = getattr(policy, "type_order", ())
    return order


def simulate(
    trace: Trace,
    stages: Sequence[Stage],
    rng: np.random.Generator,
    *,
    prices_usd_per_hr: Mapping[str, float],
    qos_ms: float | None = None,
    service: ServiceMode = "sampled",
    engine: Engine = "auto",
    routing: Routing | None = None,
    controller: ModeController | None = None,
    admission: bool = False,
) -> SimulationResult:
    """Replay ``trace`` through ``stages`` and return every query's timings.

    ``engine="auto"`` takes the compiled FCFS kernel when it applies (one stage, a static fleet,
    :class:`FcfsPolicy`, no routing), the event engine otherwise. With ``routing`` (no stage may
    then have ``forward``) queries follow the routes of the mode in force when they arrive, mode 0
    throughout or as ``controller`` switches it (see the module docstring). With ``admission``
    (needs ``qos_ms``; the event engine) a query is refused at its arrival as the live
    dispatcher's admission control refuses it (:mod:`matching.admission`: the wait until an
    instance of each stage from its entry on is free, then that stage's queue by query size,
    against what the SLO leaves after its service); a refused query is never served
    (:class:`SimulationResult`). Deterministic for a given generator state (and a deterministic
    controller).
    """
    if len(trace) == 0:
        raise SimulationError("the trace has no queries")
    if not stages:
        raise SimulationError("nothing to simulate: no stages")
    for stage in stages:
        for spec in stage.instances:
            if spec.instance_type not in prices_usd_per_hr:
                raise SimulationError(f"no price for instance type {spec.instance_type!r}")
        if stage.forward is not None and len(stage.forward) != len(trace):
            raise SimulationError(f"stage {stage.model!r}: forward needs one flag per query")
        if stage.forward is not None and routing is not None:
            raise SimulationError(
                f"stage {stage.model!r}: give forward flags or a routing, not both"
            )
    if controller is not None and routing is None:
        raise SimulationError("a mode controller needs a routing (modes to switch between)")
    if routing is not None and routing.next_stage.shape[1:] != (len(stages), len(trace)):
        raise SimulationError(
            f"routing covers {routing.next_stage.shape[1]} stages and {routing.next_stage.shape[2]}"
            f" queries, the run has {len(stages)} and {len(trace)}"
        )
    if controller is not None and not (
        math.isfinite(controller.period_s) and controller.period_s > 0
    ):
        raise SimulationError(f"the controller's period must be > 0 s, got {controller.period_s}")
    tables = [ServiceTable.build(stage.profiles, service) for stage in stages]
    for stage, table in zip(stages, tables, strict=True):
        _check_batch_sizes(trace, stage, table)
    # Types are ranked by speed at the workload's typical batch size (its mean, rounded).
    reference = round(float(trace.batch_size.mean()))
    u = rng.random((len(stages), len(trace)))

    if admission and qos_ms is None:
        raise SimulationError("admission control needs the SLO (qos_ms)")
    kernel_fits = (
        not admission
        and len(stages) == 1
        and routing is None
        and stages[0].min_queue == 1
        and isinstance(stages[0].policy, FcfsPolicy)
        and all(s.ready_s == 0 and s.stop_s == math.inf for s in stages[0].instances)
    )
    if engine == "kernel" and not kernel_fits:
        raise SimulationError("the FCFS kernel needs one stage, a static fleet and the fcfs policy")
    if engine not in ("auto", "events", "kernel"):
        raise SimulationError(f"unknown engine {engine!r}")
    if kernel_fits and engine != "events":
        run = _run_kernel(trace, stages[0], tables[0], u[0], reference)
    else:
        run = _EventEngine(
            trace, stages, tables, u, reference, qos_ms, routing, controller, admission
        ).run()
    start_s, finish_s, served_by, visited, busy_s, answered, modes = run

    answered_at = finish_s[np.isfinite(finish_s)]
    horizon_s = float(answered_at.max()) if answered_at.size else float(trace.arrival_s.max())
    cost_usd = 0.0
    utilisation = []
    for stage, busy in zip(stages, busy_s, strict=True):
        active = np.empty(len(stage.instances))
        for i, spec in enumerate(stage.instances):
            billed_from = spec.ready_s if spec.billed_from_s is None else spec.billed_from_s
            billed_s = max(0.0, min(spec.stop_s, horizon_s) - billed_from)
            cost_usd += prices_usd_per_hr[spec.instance_type] * billed_s / 3600.0
            active[i] = max(0.0, min(spec.stop_s, horizon_s) - spec.ready_s)
        utilisation.append(np.divide(busy, active, out=np.zeros_like(busy), where=active > 0))
    return SimulationResult(
        arrival_s=trace.arrival_s,
        start_s=start_s,
        finish_s=finish_s,
        instance=served_by,
        stages_visited=visited,
        instance_types=tuple(tuple(s.instance_type for s in st.instances) for st in stages),
        utilisation=tuple(utilisation),
        cost_usd=cost_usd,
        horizon_s=horizon_s,
        qos_ms=qos_ms,
        engine="kernel" if kernel_fits and engine != "events" else "events",
        answered_stage=answered,
        mode=modes,
    )


def _check_batch_sizes(trace: Trace, stage: Stage, table: ServiceTable) -> None:
    """Every query must fit the profile of every type that may serve it at this stage."""
    smallest, largest = int(trace.batch_size.min()), int(trace.batch_size.max())
    for instance_type in {spec.instance_type for spec in stage.instances}:
        i = table.type_id(instance_type)
        low, high = int(table.low[i]), int(table.high[i])
        if smallest < low or largest > high:
            bad = smallest if smallest < low else largest
            raise BatchSizeOutOfRangeError(stage.model, instance_type, bad, low, high)


_Run = tuple[
    np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], np.ndarray, np.ndarray | None
]


def _run_kernel(
    trace: Trace, stage: Stage, table: ServiceTable, u: np.ndarray, reference: int
) -> _Run:
    types = [spec.instance_type for spec in stage.instances]
    ranks = speed_ranks(table, types, reference, _preferred_types(stage.policy))
    by_rank = sorted(set(types), key=ranks.__getitem__)
    seg_ident = np.array(
        [i for name in by_rank for i, t in enumerate(types) if t == name], dtype=np.int64
    )
    seg_count = np.array([types.count(name) for name in by_rank], dtype=np.int64)
    seg_start = np.concatenate(([0], np.cumsum(seg_count)[:-1])).astype(np.int64)
    seg_type = np.array([table.type_id(name) for name in by_rank], dtype=np.int64)
    seg_high = table.high[seg_type]
    start, finish, served_by, busy = fcfs_kernel(
        trace.arrival_s,
        trace.batch_size,
        u,
        seg_start,
        seg_count,
        seg_type,
        seg_high,
        seg_ident,
        len(types),
        table.table_s,
        stage.max_batch_queries,
    )
    ones = np.ones(len(trace), dtype=np.int64)
    return start, finish, served_by, ones, [busy], np.zeros(len(trace), dtype=np.int64), None


class _Instance:
    """An instance inside the event engine; policies see it through ``InstanceView``."""

    __slots__ = (
        "batch_size",
        "busy_s",
        "busy_until_s",
        "idle_since_s",
        "index",
        "instance_type",
        "max_batch_size",
        "ready_s",
        "running",
        "speed_rank",
        "started_s",
        "stop_s",
        "type_id",
    )

    def __init__(
        self, index: int, spec: InstanceSpec, type_id: int, speed_rank: int, max_batch: int
    ) -> None:
        self.index = index
        self.instance_type = spec.instance_type
        self.type_id = type_id
        self.speed_rank = speed_rank
        self.max_batch_size = max_batch
        self.ready_s = spec.ready_s
        self.stop_s = spec.stop_s
        self.busy_until_s = spec.ready_s
        self.idle_since_s = spec.ready_s
        self.running: tuple[int, ...] | None = None
        self.busy_s = 0.0
        self.batch_size = 0
        self.started_s = 0.0

    def is_idle(self, now_s: float) -> bool:
        return self.running is None and self.ready_s <= now_s < self.stop_s


class _StageState:
    __slots__ = (
        "backlog",
        "context",
        "forward",
        "instances",
        "max_wait_s",
        "min_queue",
        "policy",
        "queue",
        "rates",
        "table",
        "wake_s",
    )

    def __init__(
        self, stage: Stage, table: ServiceTable, reference: int, qos_ms: float | None
    ) -> None:
        types = [spec.instance_type for spec in stage.instances]
        ranks = speed_ranks(table, types, reference, _preferred_types(stage.policy))
        self.instances = [
            _Instance(
                i,
                spec,
                table.type_id(spec.instance_type),
                ranks[spec.instance_type],
                int(table.high[table.type_id(spec.instance_type)]),
            )
            for i, spec in enumerate(stage.instances)
        ]
        self.queue = CentralQueue()
        self.policy = stage.policy
        self.table = table
        self.forward = stage.forward
        self.context = StageContext(max_batch_queries=stage.max_batch_queries, qos_ms=qos_ms)
        self.min_queue = stage.min_queue
        self.max_wait_s = stage.max_wait_s
        self.wake_s = -math.inf  # the time of the guard's wake-up event pushed last
        self.backlog = Backlog()  # the queue by query size, for admission control
        # (type id, query size, batch cap) -> samples/s of one instance (admission control)
        self.rates: dict[tuple[int, int, int], float] = {}


def _capacity_sps(
    state: _StageState, active: Sequence[_Instance], now_s: float, size: int
) -> float:
    """Samples per second ``active`` serve at what one call of ``state``'s policy carries at
    ``now_s`` (the batch cap, or one query where the policy sends each alone:
    ``matching.policy.queries_per_call``) for queries of ``size`` samples (each instance at
    that many queries of ``size`` samples, within its profile), as the live stage's
    ``capacity_sps`` counts them (at its ``call_cap``)."""
    cap = queries_per_call(state.policy, now_s, state.context.max_batch_queries)
    rates = state.rates
    total = 0.0
    for inst in active:
        key = (inst.type_id, size, cap)
        known = rates.get(key)
        if known is None:
            k = batch_samples(size, cap, inst.max_batch_size)
            at_k = state.table.mean_s(inst.type_id, k)
            known = rates[key] = k / at_k if at_k > 0 else math.inf
        total += known
    return total


class _EventEngine:
    """The general engine: an event heap over any stages and policies (see the module docstring)."""

    def __init__(
        self,
        trace: Trace,
        stages: Sequence[Stage],
        tables: Sequence[ServiceTable],
        u: np.ndarray,
        reference: int,
        qos_ms: float | None,
        routing: Routing | None = None,
        controller: ModeController | None = None,
        admission: bool = False,
    ) -> None:
        self.trace = trace
        self.admission = admission
        self.stages = [
            _StageState(stage, table, reference, qos_ms)
            for stage, table in zip(stages, tables, strict=True)
        ]
        self.u = u
        n = len(trace)
        self.start_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)
        self.served_by = np.full(n, -1, dtype=np.int64)
        self.visited = np.zeros(n, dtype=np.int64)
        self.answered = np.zeros(n, dtype=np.int64)
        self.events: list[tuple[float, int, int, int, int]] = []
        self.sequence = 0
        self.qos_ms = qos_ms
        self.routing = routing
        self.controller = controller
        self.mode_of = np.full(n, -1, dtype=np.int64) if routing is not None else None
        self.mode = 0
        if routing is not None:
            self._set_mode(controller.initial_mode() if controller is not None else 0)

    def _set_mode(self, mode: int) -> None:
        routing = self.routing
        assert routing is not None
        if not 0 <= mode < routing.modes:
            raise SimulationError(
                f"the controller chose mode {mode}; the routing has 0..{routing.modes - 1}"
            )
        self.mode = mode
        for s, state in enumerate(self.stages):
            cap = int(routing.max_batch_queries[mode, s])
            if cap != state.context.max_batch_queries:
                state.context = StageContext(max_batch_queries=cap, qos_ms=self.qos_ms)
            assert routing.min_queue is not None and routing.max_wait_s is not None
            state.min_queue = int(routing.min_queue[mode, s])
            state.max_wait_s = float(routing.max_wait_s[mode, s])

    def _tick(self, now: float) -> None:
        controller = self.controller
        assert controller is not None
        lengths = tuple(len(state.queue) for state in self.stages)
        self._set_mode(int(controller.tick(now, lengths)))

    def _push(self, time_s: float, priority: int, stage: int, instance: int) -> None:
        heapq.heappush(self.events, (time_s, priority, self.sequence, stage, instance))
        self.sequence += 1

    def run(self) -> _Run:
        for s, state in enumerate(self.stages):
            for inst in state.instances:
                if inst.ready_s > 0:
                    self._push(inst.ready_s, _JOIN, s, inst.index)
        if self.controller is not None:
            self._push(self.controller.period_s, _TICK, -1, -1)
        routing, mode_of = self.routing, self.mode_of
        arrivals = self.trace.arrival_s.tolist()
        batch_sizes = self.trace.batch_size.tolist()
        n = len(arrivals)
        next_arrival = 0
        events = self.events
        while next_arrival < n or events:
            now = arrivals[next_arrival] if next_arrival < n else math.inf
            if events and events[0][0] <= now:
                now = events[0][0]
            dirty: set[int] = set()
            while events and events[0][0] == now:
                _, priority, _, s, index = heapq.heappop(events)
                if priority == _COMPLETION:
                    self._complete(now, s, index, dirty)
                elif priority == _TICK:
                    self._tick(now)
                    dirty.update(range(len(self.stages)))  # batch caps, triggers may change
                    if next_arrival < n:
                        assert self.controller is not None
                        self._push(now + self.controller.period_s, _TICK, -1, -1)
                else:
                    dirty.add(s)
            while next_arrival < n and arrivals[next_arrival] == now:
                q = next_arrival
                entry = 0
                if routing is not None and mode_of is not None:
                    entry = int(routing.entry[self.mode, q])
                    mode_of[q] = self.mode
                next_arrival += 1
                if self.admission and not self._admit(now, entry, batch_sizes[q], now):
                    self.start_s[q] = now
                    self.finish_s[q] = math.inf  # refused: a miss, never answered
                    self.answered[q] = -1
                    continue
                self.stages[entry].queue.append(QueuedQuery(q, batch_sizes[q], now, now))
                if self.admission:
                    self.stages[entry].backlog.add(batch_sizes[q])
                dirty.add(entry)
            for s in sorted(dirty):
                self._round(now, s)
        unserved = np.flatnonzero(np.isnan(self.finish_s))
        if unserved.size:
            raise SimulationError(
                f"{unserved.size} queries were never dispatched (policy"
                f" {self.stages[0].policy.name!r} left them queued with no event to come)"
            )
        busy = [np.array([inst.busy_s for inst in st.instances]) for st in self.stages]
        return (
            self.start_s,
            self.finish_s,
            self.served_by,
            self.visited,
            busy,
            self.answered,
            self.mode_of,
        )

    def _admit(self, now: float, stage: int, samples: int, arrival_s: float) -> bool:
        """Admission control as the live dispatcher judges it (``controlplane.serving.
        admission``, :mod:`matching.admission`): a query that arrived at ``arrival_s`` is refused
        at ``stage`` (its entry, the one every sample reaches, or the next one a cascade forwards
        it to) when its wait there (until an instance is free, then the queue) exceeds what the
        SLO leaves it after its time so far and its own service there on the fastest serving
        type."""
        assert self.qos_ms is not None
        state = self.stages[stage]
        active = [inst for inst in state.instances if inst.ready_s <= now < inst.stop_s]
        if not active:
            return False
        # Until an instance is free (the call's end as the profile's mean predicts it, as the
        # live dispatcher predicts it), then the queue.
        free_s = min(
            0.0
            if inst.running is None
            else max(inst.started_s + state.table.mean_s(inst.type_id, inst.batch_size) - now, 0.0)
            for inst in active
        )
        capacity_sps = functools.partial(_capacity_sps, state, active, now)
        wait_ms = queue_wait_ms(free_s, state.backlog, capacity_sps)
        service_ms = 1000.0 * min(state.table.mean_s(i.type_id, samples) for i in active)
        left_ms = self.qos_ms - (now - arrival_s) * 1000.0
        return wait_ms <= allowance_ms(left_ms, service_ms)

    def _complete(self, now: float, s: int, index: int, dirty: set[int]) -> None:
        state = self.stages[s]
        inst = state.instances[index]
        batch = inst.running
        assert batch is not None
        inst.running = None
        inst.idle_since_s = now
        state.policy.observe(inst.instance_type, inst.batch_size, (now - inst.started_s) * 1000.0)
        dirty.add(s)
        last = s + 1 == len(self.stages)
        routing, mode_of = self.routing, self.mode_of
        for q in batch:
            self.visited[q] += 1
            if routing is not None and mode_of is not None:
                nxt = int(routing.next_stage[mode_of[q], s, q])
            elif not last and state.forward is not None and state.forward[q]:
                nxt = s + 1
            else:
                nxt = -1
            if nxt >= 0:
                arrival = float(self.trace.arrival_s[q])
                batch_size = int(self.trace.batch_size[q])
                if self.admission and not self._admit(now, nxt, batch_size, arrival):
                    self.finish_s[q] = math.inf  # refused at the next stage: a miss
                    self.answered[q] = -1
                    continue
                self.stages[nxt].queue.append(QueuedQuery(q, batch_size, arrival, now))
                if self.admission:
                    self.stages[nxt].backlog.add(batch_size)
                dirty.add(nxt)
            else:
                self.finish_s[q] = now
                self.served_by[q] = index
                self.answered[q] = s

    def _round(self, now: float, s: int) -> None:
        state = self.stages[s]
        if not state.queue:
            return
        for inst in state.instances:  # any idle (is_idle inline: the engine's hottest test)
            if inst.running is None and inst.ready_s <= now < inst.stop_s:
                break
        else:
            return
        if len(state.queue) < state.min_queue:
            # The trigger (module docstring): wait for min_queue queries, or for the guard.
            due = state.queue[0].enqueued_s + state.max_wait_s
            if now < due:
                if state.wake_s != due:
                    state.wake_s = due
                    self._push(due, _JOIN, s, -1)  # handled like a join: a round for stage s
                return
        for dispatch in state.policy.dispatch(now, state.queue, state.instances, state.context):
            self._start(now, s, state, dispatch)

    def _start(self, now: float, s: int, state: _StageState, dispatch: Dispatch) -> None:
        if not 0 <= dispatch.instance_index < len(state.instances):
            raise InvalidDispatchError(f"no instance {dispatch.instance_index}")
        inst = state.instances[dispatch.instance_index]
        if not inst.is_idle(now):
            raise InvalidDispatchError(f"instance {inst.index} is not idle at {now}")
        if not dispatch.query_ids:
            raise InvalidDispatchError("an empty dispatch")
        ids = dispatch.query_ids
        taken = state.queue.take_batch(ids)
        total = sum(item.batch_size for item in taken)
        if self.admission:
            for item in taken:
                state.backlog.remove(item.batch_size)
        if total > inst.max_batch_size:
            raise InvalidDispatchError(
                f"batch of {total} exceeds the profile of {inst.instance_type}"
            )
        service = state.table.service_s(inst.type_id, total, float(self.u[s, ids[0]]))
        done = now + service
        inst.running = ids
        inst.batch_size = total
        inst.started_s = now
        inst.busy_until_s = done
        inst.busy_s += service
        if s == 0 or self.routing is not None:
            start_s = self.start_s
            for q in ids:
                if start_s[q] != start_s[q]:  # NaN: this is the first stage the query visits
                    start_s[q] = now
        self._push(done, _COMPLETION, s, inst.index)
