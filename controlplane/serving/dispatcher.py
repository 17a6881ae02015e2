"""The dispatcher of one app: central queues per stage, the matching policy, batches to workers.

This module owns how an app's queries flow through its workers while the service runs
(:class:`AppDispatcher`, on the asyncio event loop that serves the API):

- **Stages.** One stage per model of the app, each with a central queue in arrival order (the
  simulator's and InferLine's centralized queue) and its own dispatch policy object, built by
  :func:`estimator.policies.policy_factory` over the live instances' types and the model's
  profiles: the same classes, built the same way, that the simulator and the planner run, so
  what is simulated is what runs. The policy is the plan's for that stage when the applied plan
  names one, else the planner's rule (:func:`policy_name`: FCFS for one instance type, Kairos
  over a mix when some type serves the whole range within the SLO). Its batch cap
  (``max_batch_queries``) comes from the gear in force, else the plan's stage ``batch_size``,
  else 1.
- **Rounds.** A round asks a stage's policy which queued queries start on which idle instances
  (:class:`matching.policy.DispatchPolicy`). Arrivals, completions, failures and fleet changes
  mark stages dirty; one round per dirty stage runs at the next turn of the event loop (so the
  arrivals of one turn are matched together, later stages first: their queries are older).
- **Batches.** Each :class:`~matching.policy.Dispatch` sends the rows of its queries as one batch
  to the worker over a kept-alive HTTP connection (:mod:`controlplane.serving.transport`); the
  worker is busy until the answer returns (its predicted end, start plus the profile's mean, is
  what the policy sees meanwhile), and the measured round trip is fed back to the policy
  (``observe``: Kairos' online latency model learns from it).
- **Cascades.** A query carries its cascade (the gear in force when it arrived, or the variant a
  model-less query was given); after stage i each of its samples is final when its certainty
  reaches the threshold h_i (or at the last stage), and the others go together, as one new
  query, to the next model's queue, keeping the original arrival time (the SLO clock runs from
  arrival). The request resolves when every sample is final.
- **Failures.** A worker whose call fails is unhealthy at once (:class:`~controlplane.serving.
  workers.Worker`) and its batch goes back to the front of its stage's queue, up to
  ``max_attempts`` tries per query, then an explicit error (502). A healthy worker idle for
  ``idle_probe_s`` is probed too, so one that died while idle leaves matching (recorded like a
  failed call, with nothing in flight) before a query is sent to it. A worker that refuses the
  inputs themselves (400) fails the queries at once: another would refuse them too. A query past
  its SLO is still served and answered, flagged ``late``; only past ``give_up_s`` (far beyond
  the SLO) is it answered with an explicit timeout (504), and a query nothing can serve (no
  healthy instance of its model) is refused at arrival (503), so nothing waits without bound.
- **Admission and states.** :mod:`controlplane.serving.admission` refuses a query (429) whose
  queue cannot be served within the SLO even at the cheapest gear; :mod:`controlplane.serving.
  states` marks (model, instance) pairs overloaded or interfered, and rounds leave interfered
  instances out while the model has an active one.
- **Model-less queries** (INFaaS): a request with requirements (latency, minimum accuracy) gets
  the cheapest variant that meets them (:func:`controlplane.policies.variants.choose` over the app's
  cascade, the gear in force and each of its models alone, with latency predicted as admission
  predicts it and accuracy from the validation records), or a
  :class:`~controlplane.errors.RequirementsUnmetError` naming the closest offer.

Everything here runs on one event loop; nothing blocks it (the store and the provider are read
by :mod:`controlplane.serving.loop` in threads).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from controlplane.errors import (
    NoServingInstanceError,
    OverloadedError,
    QueryFailedError,
    QueryTimeoutError,
    RequirementsUnmetError,
    ServingError,
    WorkerCallError,
)
from controlplane.policies.variants import Requirements, VariantOption, VariantState, choose
from controlplane.serving.admission import (
    DEFAULT_MAX_QUEUED_SAMPLES,
    StageLoad,
    decide,
    predicted_latency_ms,
)
from controlplane.serving.observations import Observations
from controlplane.serving.states import ModelState, StateTracker, is_overloaded, model_state
from controlplane.serving.transport import WorkerReply, WorkerTransport
from controlplane.serving.workers import Worker, WorkerEndpoint
from estimator.cascades import Cascade, ValidationRecords, evaluate
from estimator.policies import full_range_types, policy_factory
from estimator.profiles import LatencyProfile
from matching.policy import DispatchPolicy, QueuedQuery, StageContext

__all__ = [
    "AppConfig",
    "AppDispatcher",
    "AppStatus",
    "DispatcherSettings",
    "InferResult",
    "ServingGear",
    "StagePlan",
    "StageStatus",
    "WorkerLoss",
    "WorkerStatus",
    "policy_name",
]

logger = logging.getLogger(__name__)

# How often unanswered requests are checked against their give-up time.
_SWEEP_S = 0.25


# --- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagePlan:
    """What the applied plan says of a model's stage: its fleet (type -> count; the instances
    placed on it), its batch cap and its dispatch policy."""

    fleet: Mapping[str, int] | None = None
    max_batch_queries: int = 1
    policy: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class AppConfig:
    """What the dispatcher needs of an app: its SLO, its models (one stage each), the cascade it
    serves by default (a single model is the cascade of one), each model's profile per instance
    type, prices, the validation records of its models (cascade accuracy and reach; optional),
    the applied plan's stages by model, and a ``version`` that changes whenever any of it does."""

    name: str
    slo_ms: float
    models: tuple[str, ...]
    cascade: Cascade
    profiles: Mapping[str, Mapping[str, LatencyProfile]]
    prices_usd_per_hr: Mapping[str, float]
    validation: ValidationRecords | None = None
    stage_plans: Mapping[str, StagePlan] = field(default_factory=dict)
    version: tuple[object, ...] = ()

    def __post_init__(self) -> None:
        missing = [m for m in self.cascade.models if m not in self.models]
        if missing:
            raise ValueError(f"the cascade names models the app does not serve: {missing}")


@dataclass(frozen=True, slots=True)
class ServingGear:
    """A gear the switcher puts in force: its cascade, the batch cap of each of its models, and
    the cheapest (fastest) gear the app may switch to, which admission control judges by."""

    cascade: Cascade
    max_batch_queries: Mapping[str, int] = field(default_factory=dict)
    cheapest: Cascade | None = None


GearSource = Callable[[], ServingGear | None]


@dataclass(frozen=True, slots=True)
class DispatcherSettings:
    """Timeouts and limits of the dispatch loop.

    A worker call times out after max(``call_timeout_floor_s``, ``call_timeout_factor`` x the
    batch's predicted service time); a query is tried on at most ``max_attempts`` workers; it is
    answered with a timeout error ``give_up_s`` after its arrival (default: max(30 s, 20 x the
    SLO)); ``admission`` turns admission control off (benchmarks of the bare loop). A healthy
    worker idle for ``idle_probe_s`` gets a health probe with the call timeout floor (None: never).
    """

    call_timeout_floor_s: float = 2.0
    call_timeout_factor: float = 10.0
    max_attempts: int = 3
    give_up_s: float | None = None
    max_queued_samples: int = DEFAULT_MAX_QUEUED_SAMPLES
    admission: bool = True
    idle_probe_s: float | None = 5.0

    def give_up_after_s(self, slo_ms: float) -> float:
        if self.give_up_s is not None:
            return self.give_up_s
        return max(30.0, 20.0 * slo_ms / 1000.0)


@dataclass(frozen=True, slots=True)
class InferResult:
    """The answer to a request: per sample its output class, the model that answered it and its
    certainty; the gear's label; and timings (ms): ``service_ms`` the round trips of the batches
    that carried its samples, ``queue_ms`` the rest of ``total_ms`` (waiting in queues and in the
    loop); ``late`` when ``total_ms`` is over the SLO."""

    outputs: tuple[int, ...]
    models: tuple[str, ...]
    certainty: tuple[float, ...]
    gear: str
    queue_ms: float
    service_ms: float
    total_ms: float
    late: bool


@dataclass(frozen=True, slots=True)
class WorkerLoss:
    """A worker just marked unhealthy, and what became of the queries in flight on it then (the
    batch it held: a worker serves one at a time): ``redispatched_queries`` went back to the
    front of their stage's queue for another instance, ``failed_queries`` were answered with an
    error (their last attempt, or no healthy instance left to serve them)."""

    endpoint: WorkerEndpoint
    reason: str
    in_flight_queries: int
    redispatched_queries: int
    failed_queries: int


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker as the loop sees it; ``utilisation_share`` is its busy share of about the last
    minute (:meth:`~controlplane.serving.workers.Worker.utilisation`, None before any time
    passed)."""

    instance_id: str
    instance_type: str
    address: str
    healthy: bool
    busy: bool
    last_error: str
    utilisation_share: float | None = None


@dataclass(frozen=True, slots=True)
class StageStatus:
    """A model's stage: its queue (queries and samples), samples in service, capacity
    (samples/s), policy and batch cap, and the INFaaS state of the model on each instance."""

    model: str
    queued_queries: int
    queued_samples: int
    in_service_samples: int
    capacity_sps: float
    policy: str
    max_batch_queries: int
    states: Mapping[str, ModelState]


@dataclass(frozen=True, slots=True)
class AppStatus:
    app: str
    gear: str
    slo_ms: float
    workers: tuple[WorkerStatus, ...]
    stages: tuple[StageStatus, ...]
    in_flight_requests: int


def policy_name(
    plan: StagePlan | None, profiles: Mapping[str, LatencyProfile], slo_ms: float
) -> tuple[str, list[str]]:
    """The dispatch policy of a stage over the instance types in ``profiles`` and its base
    types: the plan's when it names one of fcfs or kairos, else the planner's rule (FCFS for one
    type; Kairos over a mix when a type serves the whole batch range within the SLO, the most
    cost-effective first; else FCFS)."""
    types = sorted(profiles)
    wanted = plan.policy if plan is not None else None
    if len(types) <= 1 or wanted == "fcfs":
        return "fcfs", types
    base = full_range_types(profiles, np.array([1]), slo_ms)
    if base and wanted in (None, "kairos"):
        return "kairos", base
    return "fcfs", base


# --- latency tables ----------------------------------------------------------------------------


class _Latency:
    """A profile's mean service time by batch size, as a list (looked up per dispatch); beyond
    the largest profiled size the per-sample time of the largest holds."""

    __slots__ = ("max_batch_size", "means_ms")

    def __init__(self, profile: LatencyProfile) -> None:
        means = profile.mean_by_batch_ms()
        low = profile.min_batch_size
        means[:low] = means[low]
        self.means_ms: list[float] = [float(v) for v in means]
        self.max_batch_size = profile.max_batch_size

    def ms(self, batch_size: int) -> float:
        top = self.max_batch_size
        if batch_size <= top:
            return self.means_ms[max(batch_size, 1)]
        return self.means_ms[top] * batch_size / top


# --- queues ------------------------------------------------------------------------------------


class _Queue(Sequence[QueuedQuery]):
    """A stage's central queue in arrival order, with removal from anywhere and re-insertion at
    the front (a failed batch's queries). Removed entries stay behind as tombstones until the
    next read compacts them away."""

    __slots__ = ("_by_id", "_items", "_removed")

    def __init__(self) -> None:
        self._items: deque[QueuedQuery] = deque()
        self._by_id: dict[int, QueuedQuery] = {}
        self._removed: set[int] = set()

    def append(self, item: QueuedQuery) -> None:
        self._items.append(item)
        self._by_id[item.query_id] = item

    def push_front(self, items: Sequence[QueuedQuery]) -> None:
        for item in reversed(items):
            self._items.appendleft(item)
            self._by_id[item.query_id] = item

    def _compact(self) -> None:
        if self._removed:
            removed = self._removed
            self._items = deque(item for item in self._items if item.query_id not in removed)
            removed.clear()

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __iter__(self) -> Iterator[QueuedQuery]:
        self._compact()
        return iter(self._items)

    @overload
    def __getitem__(self, index: int) -> QueuedQuery: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[QueuedQuery]: ...
    def __getitem__(self, index: int | slice) -> QueuedQuery | Sequence[QueuedQuery]:
        self._compact()
        if isinstance(index, slice):
            return list(self._items)[index]
        return self._items[index]

    def __contains__(self, item: object) -> bool:
        return isinstance(item, QueuedQuery) and item.query_id in self._by_id

    def take(self, query_id: int) -> QueuedQuery | None:
        """Remove ``query_id`` (None when it is not queued)."""
        item = self._by_id.pop(query_id, None)
        if item is None:
            return None
        items = self._items
        if items and items[0].query_id == query_id:
            items.popleft()
        else:
            self._removed.add(query_id)
        while items and items[0].query_id in self._removed:
            self._removed.discard(items.popleft().query_id)
        return item


# --- requests ----------------------------------------------------------------------------------


class _Request:
    __slots__ = (
        "arrival_s",
        "cascade",
        "certainty",
        "future",
        "inputs",
        "models",
        "outputs",
        "pending",
        "queued",
        "sample_ids",
        "service_ms",
    )

    def __init__(
        self,
        inputs: Sequence[Sequence[float]],
        sample_ids: Sequence[int] | None,
        cascade: Cascade,
        arrival_s: float,
        future: asyncio.Future[InferResult],
    ) -> None:
        n = len(inputs)
        self.inputs = inputs
        self.sample_ids = sample_ids
        self.cascade = cascade
        self.arrival_s = arrival_s
        self.future = future
        self.outputs: list[int] = [0] * n
        self.models: list[str] = [""] * n
        self.certainty: list[float] = [0.0] * n
        self.pending = n
        self.service_ms = 0.0
        self.queued: dict[int, _Stage] = {}  # query id -> the stage whose queue holds it


class _Part:
    """A request's samples at one stage: one queued query."""

    __slots__ = ("attempts", "position", "query", "request", "samples")

    def __init__(
        self, request: _Request, position: int, samples: list[int], query: QueuedQuery
    ) -> None:
        self.request = request
        self.position = position  # the stage's index in the request's cascade
        self.samples = samples
        self.query = query
        self.attempts = 0


# --- stages ------------------------------------------------------------------------------------


class _Slot:
    """A worker as one stage's policy sees it (:class:`matching.policy.InstanceView`)."""

    __slots__ = ("index", "max_batch_size", "speed_rank", "worker")

    def __init__(self, index: int, worker: Worker, speed_rank: int, max_batch_size: int) -> None:
        self.index = index
        self.worker = worker
        self.speed_rank = speed_rank
        self.max_batch_size = max_batch_size

    @property
    def instance_type(self) -> str:
        return self.worker.endpoint.instance_type

    @property
    def busy_until_s(self) -> float:
        return self.worker.busy_until_s

    @property
    def idle_since_s(self) -> float:
        return self.worker.idle_since_s

    def is_idle(self, now_s: float) -> bool:
        worker = self.worker
        return worker.healthy and not worker.running


class _Stage:
    __slots__ = (
        "capacity",
        "dirty",
        "in_service_samples",
        "latency",
        "model",
        "parts",
        "policy",
        "policy_key",
        "policy_name",
        "queue",
        "queued_samples",
        "slots",
    )

    def __init__(self, model: str) -> None:
        self.model = model
        self.queue = _Queue()
        self.parts: dict[int, _Part] = {}
        self.slots: list[_Slot] = []
        self.latency: dict[str, _Latency] = {}
        self.policy: DispatchPolicy | None = None
        self.policy_key: tuple[str, ...] = ()
        self.policy_name = ""
        self.queued_samples = 0
        self.in_service_samples = 0
        self.dirty = False
        # (samples, batch cap) -> (capacity in samples/s, fastest service ms): cleared whenever
        # the stage's instances or their health change.
        self.capacity: dict[tuple[int, int], tuple[float, float]] = {}


# --- the dispatcher ----------------------------------------------------------------------------


class AppDispatcher:
    """One app's serving (see the module docstring). Create and use it on the event loop."""

    def __init__(
        self,
        config: AppConfig,
        transport: WorkerTransport,
        observations: Observations,
        *,
        settings: DispatcherSettings | None = None,
        clock_s: Callable[[], float] = time.monotonic,
        gear: GearSource | None = None,
        tracker: StateTracker | None = None,
        on_unhealthy: Callable[[WorkerLoss], None] | None = None,
    ) -> None:
        self.transport = transport
        self.observations = observations
        self.settings = settings or DispatcherSettings()
        self.clock_s = clock_s
        self.gear = gear
        self.tracker = tracker or StateTracker()
        self.on_unhealthy = on_unhealthy
        self._workers: dict[str, Worker] = {}
        self._stages: dict[str, _Stage] = {}
        self._interfered: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_query = 0
        # Requests not answered yet, oldest first: swept for their give-up time every _SWEEP_S
        # (one timer for all: a timer per request would fill the loop's heap with cancelled
        # ones, 60,000 at 2,000 q/s and a give-up of 30 s).
        self._open: dict[_Request, None] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._rounds_scheduled = False
        self._closed = False
        self._quality: dict[Cascade, tuple[float, tuple[float, ...]]] = {}
        self.config = config
        self.gear_label = config.cascade.label  # the gear in force at the last arrival
        self._last_gear: ServingGear | None = None
        self.reconfigure(config)

    # --- configuration and fleet ----------------------------------------------------------------

    @property
    def app(self) -> str:
        return self.config.name

    def reconfigure(self, config: AppConfig) -> None:
        """Take a new configuration (spec, plan or profiles changed). Stages of models the app no
        longer serves are dropped, and their queued queries answered with an error."""
        self.config = config
        self._own_gear = ServingGear(config.cascade)
        self._quality.clear()
        for model in [m for m in self._stages if m not in config.models]:
            stage = self._stages.pop(model)
            for part in list(stage.parts.values()):
                self._fail(part.request, QueryFailedError(self.app, "the app's spec changed", 0))
        for model in config.models:
            self._stages.setdefault(model, _Stage(model))
        self._place()

    def set_workers(self, endpoints: Sequence[WorkerEndpoint]) -> None:
        """The app's running workers now: new ones join (healthy), gone ones leave (a batch they
        hold still completes or fails as it will)."""
        now = self.clock_s()
        listed = {e.instance_id: e for e in endpoints}
        changed = False
        for instance_id in [i for i in self._workers if i not in listed]:
            del self._workers[instance_id]
            changed = True
        gone = [i for i in {key[1] for key in self._interfered} if i not in listed]
        self.tracker.forget(gone)
        self._interfered = {key for key in self._interfered if key[1] in listed}
        for instance_id, endpoint in listed.items():
            worker = self._workers.get(instance_id)
            if worker is None or worker.endpoint != endpoint:
                self._workers[instance_id] = Worker(endpoint, now)
                changed = True
        if changed:
            self._place()
            self._fail_stranded("the workers left the fleet")

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def _place(self) -> None:
        """Assign workers to stages (the plan's placement) and rebuild the stages' slots and
        policies where their instance types changed.

        The plan's stage fleets place instances by type, in the cascade's order (a stage takes
        as many of each type as its fleet names, from the workers not yet placed); workers left
        over serve every stage, and a stage the placement leaves without any serves on all of
        them (a query must never wait for a stage with no instance). So does a stage whose placed
        workers are all unhealthy, until one of them is back or the fleet changes: every worker
        agent loads the whole family, and a plan of one instance per stage must survive the loss
        of one (its queries go to the other stages' workers rather than fail).
        """
        config = self.config
        workers = sorted(self._workers.values(), key=lambda w: w.instance_id)
        placed: dict[str, list[Worker]] = {m: [] for m in config.models}
        free = list(workers)
        for model in config.models:
            plan = config.stage_plans.get(model)
            if plan is None or not plan.fleet:
                continue
            for instance_type, count in plan.fleet.items():
                chosen = [w for w in free if w.instance_type == instance_type][: max(count, 0)]
                placed[model].extend(chosen)
                free = [w for w in free if w not in chosen]
        for model in config.models:
            own = placed[model]
            serving = own + free if any(w.healthy for w in own) else list(workers)
            self._build_stage(self._stages[model], serving)
        self._mark_all()

    def _health_changed(self) -> None:
        """A worker left or rejoined matching: placement again (a stage whose placed workers
        are all out borrows the others), which also drops the capacity estimates."""
        self._place()

    def _build_stage(self, stage: _Stage, workers: Sequence[Worker]) -> None:
        config = self.config
        stage.capacity.clear()
        profiles = config.profiles.get(stage.model, {})
        usable = [w for w in workers if w.instance_type in profiles]
        types = sorted({w.instance_type for w in usable})
        stage.latency = {t: _Latency(profiles[t]) for t in types}
        ranked = sorted(types, key=lambda t: (stage.latency[t].ms(1), t))
        rank = {t: i for i, t in enumerate(ranked)}
        stage.slots = [
            _Slot(i, w, rank[w.instance_type], stage.latency[w.instance_type].max_batch_size)
            for i, w in enumerate(usable)
        ]
        key = (*types, str(config.version))
        if types and key != stage.policy_key:
            used = {t: profiles[t] for t in types}
            name, base = policy_name(config.stage_plans.get(stage.model), used, config.slo_ms)
            stage.policy = policy_factory(name, used, base)()
            stage.policy_name = name
            stage.policy_key = key
        elif not types:
            stage.policy = None
            stage.policy_key = ()
            stage.policy_name = ""

    # --- requests -------------------------------------------------------------------------------

    def current_gear(self) -> ServingGear:
        """The gear in force: the switcher's (when its cascade is the app's to serve), else the
        app's own cascade."""
        gear = self.gear() if self.gear is not None else None
        if gear is not None and all(m in self._stages for m in gear.cascade.models):
            return gear
        return self._own_gear

    def _batch_cap(self, model: str, gear: ServingGear) -> int:
        cap = gear.max_batch_queries.get(model)
        if cap is None:
            plan = self.config.stage_plans.get(model)
            cap = plan.max_batch_queries if plan is not None else 1
        return max(int(cap), 1)

    async def infer(
        self,
        inputs: Sequence[Sequence[float]],
        sample_ids: Sequence[int] | None = None,
        requirements: Requirements | None = None,
    ) -> InferResult:
        """Answer one request (see the module docstring); raises the
        :class:`~controlplane.errors.ServingError` that says why not."""
        cascade = None
        if requirements is not None:
            cascade = self.choose_variant(requirements, len(inputs))
        return await self.submit(inputs, sample_ids, cascade)

    def submit(
        self,
        inputs: Sequence[Sequence[float]],
        sample_ids: Sequence[int] | None = None,
        cascade: Cascade | None = None,
    ) -> asyncio.Future[InferResult]:
        """Queue a request under ``cascade`` (default: the gear in force) and return the future
        of its answer. Raises at once when it is refused (503 or 429 kinds)."""
        if not inputs:
            raise ValueError("a request needs at least one sample")
        if self._closed:
            raise NoServingInstanceError(self.app, self.config.cascade.models[0], "stopping")
        now = self.clock_s()
        app = self.app
        self.observations.arrival(app, now)
        gear = self.current_gear()
        if gear is not self._last_gear:
            self._last_gear = gear
            self.gear_label = gear.cascade.label
        if cascade is None:
            cascade = gear.cascade
        n = len(inputs)
        try:
            self._check_serving(cascade)
            if self.settings.admission:
                self._admit(gear, n)
        except ServingError:
            self.observations.refused(app, now)
            raise
        loop = asyncio.get_running_loop()
        future: asyncio.Future[InferResult] = loop.create_future()
        request = _Request(inputs, sample_ids, cascade, now, future)
        future.add_done_callback(functools.partial(self._on_done, request))
        self._open[request] = None
        if self._sweeper is None:
            self._sweeper = loop.call_later(_SWEEP_S, self._sweep)
        self._enqueue(request, 0, list(range(n)), now)
        return future

    def _check_serving(self, cascade: Cascade) -> None:
        """Every model the cascade may send a sample to needs a healthy instance."""
        for model in cascade.models:
            stage = self._stages.get(model)
            if stage is None or not any(s.worker.healthy for s in stage.slots):
                why = "no running worker" if not self._workers else "no healthy worker serves it"
                raise NoServingInstanceError(self.app, model, why)

    def _admit(self, gear: ServingGear, samples: int) -> None:
        queued = sum(s.queued_samples for s in self._stages.values())
        if queued + samples > self.settings.max_queued_samples:
            raise OverloadedError(self.app, math.inf, self.config.slo_ms, 1)
        candidates = [gear.cascade, self.config.cascade]
        if gear.cheapest is not None and all(m in self._stages for m in gear.cheapest.models):
            candidates.append(gear.cheapest)
        loads = [self._loads(c, samples, gear) for c in dict.fromkeys(candidates)]
        best = min(loads, key=predicted_latency_ms)
        verdict = decide(best, self.config.slo_ms)
        if not verdict.admitted:
            raise OverloadedError(
                self.app, verdict.predicted_ms, self.config.slo_ms, verdict.retry_after_s
            )

    def _reach(self, cascade: Cascade) -> tuple[float, tuple[float, ...]]:
        """(accuracy, reach share per stage) of ``cascade`` on the validation records; without
        records, accuracy 0 (unknown) and every stage reached."""
        found = self._quality.get(cascade)
        if found is None:
            records = self.config.validation
            if records is not None and all(m in records.models for m in cascade.models):
                quality = evaluate(cascade, records)
                found = (quality.accuracy, quality.reach_share)
            else:
                found = (0.0, (1.0,) * len(cascade.models))
            self._quality[cascade] = found
        return found

    def _loads(self, cascade: Cascade, samples: int, gear: ServingGear) -> list[StageLoad]:
        _, reach = self._reach(cascade)
        loads = []
        for model, share in zip(cascade.models, reach, strict=True):
            stage = self._stages[model]
            n = max(math.ceil(share * samples), 1)
            cap = self._batch_cap(model, gear)
            key = (n, cap)
            known = stage.capacity.get(key)
            if known is None:
                fastest = min((t.ms(n) for t in stage.latency.values()), default=math.inf)
                known = stage.capacity[key] = (self._capacity_sps(stage, n, cap), fastest)
            capacity, fastest = known
            backlog = stage.queued_samples + stage.in_service_samples
            loads.append(StageLoad(backlog, capacity, fastest, share))
        return loads

    def _capacity_sps(self, stage: _Stage, samples: int, cap: int) -> float:
        """Samples per second the stage's healthy instances serve at batches of ``cap`` queries
        of ``samples`` samples (within each profile)."""
        total = 0.0
        for slot in stage.slots:
            if not slot.worker.healthy:
                continue
            latency = stage.latency[slot.instance_type]
            k = max(min(cap * samples, latency.max_batch_size), samples)
            ms = latency.ms(k)
            total += 1000.0 * k / ms if ms > 0 else math.inf
        return total

    def _enqueue(self, request: _Request, position: int, samples: list[int], now: float) -> None:
        model = request.cascade.models[position]
        stage = self._stages.get(model)
        if stage is None:
            self._fail(request, QueryFailedError(self.app, f"model {model!r} is gone", 0))
            return
        self._next_query += 1
        query = QueuedQuery(self._next_query, len(samples), request.arrival_s, now)
        part = _Part(request, position, samples, query)
        stage.queue.append(query)
        stage.parts[query.query_id] = part
        stage.queued_samples += len(samples)
        request.queued[query.query_id] = stage
        self._mark(stage)

    def _requeue(self, stage: _Stage, parts: Sequence[_Part]) -> None:
        """Back to the front of the queue (they are the oldest there), keeping their ids."""
        stage.queue.push_front([p.query for p in parts])
        for part in parts:
            stage.parts[part.query.query_id] = part
            stage.queued_samples += len(part.samples)
            part.request.queued[part.query.query_id] = stage
        self._mark(stage)

    # --- rounds ---------------------------------------------------------------------------------

    def _mark(self, stage: _Stage) -> None:
        stage.dirty = True
        if not self._rounds_scheduled and not self._closed:
            self._rounds_scheduled = True
            asyncio.get_running_loop().call_soon(self._run_rounds)

    def _mark_all(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            for stage in self._stages.values():
                stage.dirty = True
            return
        for stage in self._stages.values():
            self._mark(stage)

    def _run_rounds(self) -> None:
        self._rounds_scheduled = False
        gear = self.current_gear()
        now = self.clock_s()
        for model in reversed(self.config.models):
            stage = self._stages[model]
            if stage.dirty:
                stage.dirty = False
                self._round(stage, now, gear)

    def _eligible(self, stage: _Stage) -> list[_Slot]:
        healthy = [s for s in stage.slots if s.worker.healthy]
        if not self._interfered:
            return healthy
        model = stage.model
        active = [s for s in healthy if (model, s.worker.instance_id) not in self._interfered]
        return active or healthy

    def _round(self, stage: _Stage, now: float, gear: ServingGear) -> None:
        queue = stage.queue
        policy = stage.policy
        if not queue or policy is None:
            return
        slots = self._eligible(stage)
        if not any(s.worker.healthy and not s.worker.running for s in slots):
            return
        context = StageContext(self._batch_cap(stage.model, gear), self.config.slo_ms)
        by_index = {s.index: s for s in slots}
        try:
            dispatches = policy.dispatch(now, queue, slots, context)
        except Exception:
            # A policy that cannot decide must not stall the stage: FCFS over the same
            # instances decides from now on (logged: it is a bug to look into).
            logger.exception(
                "%s: policy %s failed; %s falls back to fcfs", self.app, policy.name, stage.model
            )
            types = sorted(stage.latency)
            stage.policy = policy = policy_factory("fcfs", {}, types)()
            stage.policy_name = "fcfs"
            dispatches = policy.dispatch(now, queue, slots, context)
        for dispatch in dispatches:
            slot = by_index.get(dispatch.instance_index)
            if slot is None or not slot.is_idle(now) or not dispatch.query_ids:
                logger.error("%s: policy %s made an invalid dispatch", self.app, policy.name)
                continue
            parts = []
            for query_id in dispatch.query_ids:
                if queue.take(query_id) is not None:
                    part = stage.parts.pop(query_id)
                    part.request.queued.pop(query_id, None)
                    stage.queued_samples -= len(part.samples)
                    parts.append(part)
            if parts:
                self._start(stage, slot, parts, now)

    def _start(self, stage: _Stage, slot: _Slot, parts: list[_Part], now: float) -> None:
        rows = [part.request.inputs[i] for part in parts for i in part.samples]
        worker = slot.worker
        predicted_ms = stage.latency[worker.instance_type].ms(len(rows))
        worker.start(now, predicted_ms)
        stage.in_service_samples += len(rows)
        task = asyncio.get_running_loop().create_task(
            self._call(stage, worker, parts, rows, now, predicted_ms)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(
        self,
        stage: _Stage,
        worker: Worker,
        parts: list[_Part],
        rows: list[Sequence[float]],
        started_s: float,
        predicted_ms: float,
    ) -> None:
        settings = self.settings
        timeout_s = max(
            settings.call_timeout_floor_s, settings.call_timeout_factor * predicted_ms / 1000.0
        )
        try:
            reply = await self.transport.infer(worker.address, stage.model, rows, timeout_s)
        except WorkerCallError as error:
            self._failed(stage, worker, parts, len(rows), error)
        except asyncio.CancelledError:
            stage.in_service_samples -= len(rows)
            worker.finish(self.clock_s())
            for part in parts:
                self._fail(part.request, NoServingInstanceError(self.app, stage.model, "stopping"))
            raise
        except Exception as error:  # a transport's bug must not lose the queries
            logger.exception("%s: call to %s failed unexpectedly", self.app, worker.address)
            self._failed(
                stage,
                worker,
                parts,
                len(rows),
                WorkerCallError(worker.address, "internal", str(error) or type(error).__name__),
            )
        else:
            self._completed(stage, worker, parts, rows, reply, started_s, predicted_ms)

    def _completed(
        self,
        stage: _Stage,
        worker: Worker,
        parts: list[_Part],
        rows: list[Sequence[float]],
        reply: WorkerReply,
        started_s: float,
        predicted_ms: float,
    ) -> None:
        now = self.clock_s()
        batch = len(rows)
        stage.in_service_samples -= batch
        worker.finish(now)
        worker.succeeded()
        round_trip_ms = (now - started_s) * 1000.0
        if stage.policy is not None and worker.instance_type in stage.latency:
            stage.policy.observe(worker.instance_type, batch, round_trip_ms)
        measured_ms = reply.served_ms if reply.served_ms is not None else round_trip_ms
        tracker = self.tracker
        tracker.observe(stage.model, worker.instance_id, now, measured_ms, predicted_ms)
        key = (stage.model, worker.instance_id)
        # The verdict moves only with a slow batch, or for a pair already interfered (the
        # median of a window is not worth computing for every fast batch).
        if key in self._interfered or tracker.slow(measured_ms, predicted_ms):
            if tracker.interfered(stage.model, worker.instance_id, now):
                self._interfered.add(key)
            else:
                self._interfered.discard(key)
        predictions, certainty = reply.predictions, reply.certainty
        model = stage.model
        offset = 0
        for part in parts:
            request = part.request
            samples = part.samples
            if request.future.done():
                offset += len(samples)
                continue
            request.service_ms += round_trip_ms
            cascade = request.cascade
            last = part.position + 1 >= len(cascade.models)
            threshold = math.inf if last else cascade.thresholds[part.position]
            forward = []
            for i in samples:
                confidence = certainty[offset]
                if last or confidence >= threshold:
                    request.outputs[i] = predictions[offset]
                    request.certainty[i] = confidence
                    request.models[i] = model
                    request.pending -= 1
                else:
                    forward.append(i)
                offset += 1
            if forward:
                self._enqueue(request, part.position + 1, forward, now)
            elif request.pending == 0:
                self._answer(request, now)
        self._mark_all()

    def _failed(
        self,
        stage: _Stage,
        worker: Worker,
        parts: list[_Part],
        batch: int,
        error: WorkerCallError,
    ) -> None:
        now = self.clock_s()
        stage.in_service_samples -= batch
        worker.finish(now)
        reason = str(error)
        lost = error.worker_fault and worker.healthy
        if lost:
            worker.fail(now, reason)
            self._health_changed()
        elif error.worker_fault:
            worker.last_error = reason
        live = [part for part in parts if not part.request.future.done()]
        again = []
        for part in live:
            request = part.request
            part.attempts += 1
            if not error.worker_fault or part.attempts >= self.settings.max_attempts:
                self._fail(request, QueryFailedError(self.app, reason, part.attempts))
            else:
                again.append(part)
        if again:
            current = self._stages.get(stage.model)
            if current is None:
                for part in again:
                    self._fail(part.request, QueryFailedError(self.app, "model gone", 0))
            else:
                self._requeue(current, again)
        self._fail_stranded(reason)
        if lost:
            failed = sum(1 for part in live if part.request.future.done())
            loss = WorkerLoss(worker.endpoint, reason, len(live), len(live) - failed, failed)
            logger.warning(
                "%s: worker %s unhealthy: %s; %d queries in flight on it, %d re-dispatched",
                self.app,
                worker.instance_id,
                reason,
                loss.in_flight_queries,
                loss.redispatched_queries,
            )
            if self.on_unhealthy is not None:
                self.on_unhealthy(loss)
        self._mark_all()

    def _fail_stranded(self, reason: str) -> None:
        """Queries queued at a stage that no healthy instance serves any more are answered
        with an error now rather than at their give-up time: 502 for those already tried, 503
        for the others (a refusal at arrival would have said the same)."""
        for stage in self._stages.values():
            if not stage.parts or any(s.worker.healthy for s in stage.slots):
                continue
            for part in list(stage.parts.values()):
                if part.attempts:
                    error: ServingError = QueryFailedError(self.app, reason, part.attempts)
                else:
                    error = NoServingInstanceError(self.app, stage.model, "no healthy worker")
                self._fail(part.request, error)

    # --- answers --------------------------------------------------------------------------------

    def _answer(self, request: _Request, now: float) -> None:
        total_ms = (now - request.arrival_s) * 1000.0
        late = total_ms > self.config.slo_ms
        service_ms = min(request.service_ms, total_ms)
        result = InferResult(
            outputs=tuple(request.outputs),
            models=tuple(request.models),
            certainty=tuple(request.certainty),
            gear=request.cascade.label,
            queue_ms=total_ms - service_ms,
            service_ms=service_ms,
            total_ms=total_ms,
            late=late,
        )
        correct = labelled = 0
        records = self.config.validation
        if records is not None and request.sample_ids is not None:
            labels = records.labels
            limit = labels.size
            for output, sample in zip(request.outputs, request.sample_ids, strict=False):
                if 0 <= sample < limit:
                    labelled += 1
                    correct += int(output == int(labels[sample]))
        self.observations.answered(
            self.app,
            now,
            total_ms,
            late=late,
            models=request.models,
            correct=correct,
            labelled=labelled,
        )
        request.future.set_result(result)

    def _fail(self, request: _Request, error: ServingError) -> None:
        if request.future.done():
            return
        self.observations.failed(self.app, self.clock_s())
        request.future.set_exception(error)

    def _sweep(self) -> None:
        """Answer the requests past their give-up time with a timeout error (the oldest
        first: the sweep stops at the first one still in time)."""
        self._sweeper = None
        give_up_s = self.settings.give_up_after_s(self.config.slo_ms)
        cutoff = self.clock_s() - give_up_s
        expired = []
        for request in self._open:
            if request.arrival_s > cutoff:
                break
            expired.append(request)
        for request in expired:
            self._fail(request, QueryTimeoutError(self.app, give_up_s))
        if self._open and not self._closed:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def _on_done(self, request: _Request, future: asyncio.Future[InferResult]) -> None:
        """Whatever ended the request (answer, error, timeout, the caller going away): its
        queued queries leave their queues and its timer stops."""
        self._open.pop(request, None)
        for query_id, stage in request.queued.items():
            if stage.queue.take(query_id) is not None:
                part = stage.parts.pop(query_id)
                stage.queued_samples -= len(part.samples)
        request.queued.clear()

    # --- model-less queries ---------------------------------------------------------------------

    def variant_options(self, samples: int = 1) -> list[tuple[VariantOption, Cascade]]:
        """The variants the app offers now: its cascade, the gear in force and each of its
        models alone, with their predicted latency (as admission predicts it), accuracy on the
        validation records, cost per query and INFaaS state."""
        gear = self.current_gear()
        candidates = [self.config.cascade, gear.cascade]
        candidates += [Cascade((m,), ()) for m in self.config.models]
        seen: set[str] = set()
        options = []
        for cascade in candidates:
            label = cascade.label
            if label in seen or not all(m in self._stages for m in cascade.models):
                continue
            seen.add(label)
            if not all(self._stages[m].slots for m in cascade.models):
                continue
            accuracy, reach = self._reach(cascade)
            loads = self._loads(cascade, samples, gear)
            cost = 0.0
            for model, share in zip(cascade.models, reach, strict=True):
                cost += share * self._cost_usd_per_sample(self._stages[model])
            options.append(
                (
                    VariantOption(
                        name=label,
                        predicted_latency_ms=predicted_latency_ms(loads),
                        accuracy=accuracy,
                        cost_usd_per_query=cost * samples,
                        kind="gear" if len(cascade.models) > 1 else "model",
                        state=self._variant_state(cascade, loads),
                    ),
                    cascade,
                )
            )
        return options

    def _cost_usd_per_sample(self, stage: _Stage) -> float:
        prices = self.config.prices_usd_per_hr
        costs = [
            latency.ms(1) / 3.6e6 * prices[t] for t, latency in stage.latency.items() if t in prices
        ]
        return min(costs, default=0.0)

    def _variant_state(self, cascade: Cascade, loads: Sequence[StageLoad]) -> VariantState:
        now = self.clock_s()
        for model, load in zip(cascade.models, loads, strict=True):
            if load.reach_share <= 0:
                continue
            healthy = [s for s in self._stages[model].slots if s.worker.healthy]
            if healthy and all(
                self.tracker.interfered(model, s.worker.instance_id, now) for s in healthy
            ):
                return "interfered"
        for load in loads:
            if load.reach_share > 0 and is_overloaded(
                load.backlog_samples, load.capacity_sps, self.config.slo_ms
            ):
                return "overloaded"
        return "active"

    def choose_variant(self, requirements: Requirements, samples: int) -> Cascade:
        """The cascade of the cheapest variant that meets ``requirements``; raises
        :class:`~controlplane.errors.RequirementsUnmetError` with the closest offer."""
        options = self.variant_options(samples)
        if not options:
            raise NoServingInstanceError(self.app, self.config.cascade.models[0])
        choice = choose(requirements, [option for option, _ in options])
        if not choice.met:
            raise RequirementsUnmetError(self.app, choice.message, choice.option.name)
        return next(c for option, c in options if option is choice.option)

    # --- health ---------------------------------------------------------------------------------

    async def probe(self, timeout_s: float = 0.5) -> None:
        """Probe the unhealthy workers whose backoff is over; those that answer ``ok`` serve
        again. Also probes the healthy workers idle for ``idle_probe_s`` and re-reads the
        interference verdicts (their window moves on)."""
        now = self.clock_s()
        self._interfered = {
            key for key in self._interfered if self.tracker.interfered(key[0], key[1], now)
        }
        await self._probe_idle(now)
        due = [
            w
            for w in self._workers.values()
            if not w.healthy and not w.probing and w.retry_at_s <= now
        ]
        if not due:
            return
        answers = await self._health(due, timeout_s)
        now = self.clock_s()
        for worker, ok in zip(due, answers, strict=True):
            if ok and self._workers.get(worker.instance_id) is worker:
                worker.recover(now)
                self._health_changed()
                logger.info("%s: worker %s healthy again", self.app, worker.instance_id)
            elif not worker.healthy:
                worker.fail(now, worker.last_error or "health probe failed")
        self._mark_all()

    async def _health(self, workers: list[Worker], timeout_s: float) -> list[bool]:
        """Whether each of ``workers`` answers its health probe (an exception is a no); they
        are marked ``probing`` meanwhile, so that no other probe overlaps."""
        for worker in workers:
            worker.probing = True
        try:
            answers = await asyncio.gather(
                *(self.transport.health(w.address, timeout_s) for w in workers),
                return_exceptions=True,
            )
        finally:
            for worker in workers:
                worker.probing = False
        return [answer is True for answer in answers]

    async def _probe_idle(self, now: float) -> None:
        """A healthy worker that no call has reached for ``idle_probe_s`` must still answer its
        health probe; one that does not (its process died while idle) is unhealthy from now, as
        after a failed call with nothing in flight. A worker that a batch reached meanwhile is
        left to that call's outcome."""
        after_s = self.settings.idle_probe_s
        if after_s is None:
            return
        idle = [
            w
            for w in self._workers.values()
            if w.healthy and not w.running and not w.probing and now - w.checked_s >= after_s
        ]
        if not idle:
            return
        asked_s = now
        answers = await self._health(idle, self.settings.call_timeout_floor_s)
        now = self.clock_s()
        lost = []
        for worker, ok in zip(idle, answers, strict=True):
            # A batch it took meanwhile (running now, or done: checked since) speaks for it.
            gone = self._workers.get(worker.instance_id) is not worker
            if gone or worker.running or worker.checked_s > asked_s:
                continue
            if ok:
                worker.checked_s = now
            elif worker.healthy:
                worker.fail(now, "health probe failed while idle")
                lost.append(worker)
        if not lost:
            return
        self._health_changed()
        self._fail_stranded("health probe failed while idle")
        for worker in lost:
            logger.warning(
                "%s: idle worker %s unhealthy: %s", self.app, worker.instance_id, worker.last_error
            )
            if self.on_unhealthy is not None:
                self.on_unhealthy(WorkerLoss(worker.endpoint, worker.last_error, 0, 0, 0))
        self._mark_all()

    # --- status and shutdown --------------------------------------------------------------------

    def status(self) -> AppStatus:
        now = self.clock_s()
        gear = self.current_gear()
        stages = []
        for model in self.config.models:
            stage = self._stages[model]
            cap = self._batch_cap(model, gear)
            capacity = self._capacity_sps(stage, 1, cap)
            overloaded = is_overloaded(
                stage.queued_samples + stage.in_service_samples, capacity, self.config.slo_ms
            )
            states = {
                s.worker.instance_id: model_state(
                    overloaded=overloaded,
                    interfered=self.tracker.interfered(model, s.worker.instance_id, now),
                )
                for s in stage.slots
            }
            stages.append(
                StageStatus(
                    model=model,
                    queued_queries=len(stage.queue),
                    queued_samples=stage.queued_samples,
                    in_service_samples=stage.in_service_samples,
                    capacity_sps=capacity,
                    policy=stage.policy_name,
                    max_batch_queries=cap,
                    states=states,
                )
            )
        workers = tuple(
            WorkerStatus(
                instance_id=w.instance_id,
                instance_type=w.instance_type,
                address=w.address,
                healthy=w.healthy,
                busy=w.running,
                last_error=w.last_error,
                utilisation_share=w.utilisation(now),
            )
            for w in sorted(self._workers.values(), key=lambda w: w.instance_id)
        )
        return AppStatus(
            app=self.app,
            gear=gear.cascade.label,
            slo_ms=self.config.slo_ms,
            workers=workers,
            stages=tuple(stages),
            in_flight_requests=len(self._open),
        )

    async def close(self) -> None:
        """Stop: queued and in-service queries are answered with an error."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for stage in self._stages.values():
            for part in list(stage.parts.values()):
                self._fail(part.request, NoServingInstanceError(self.app, stage.model, "stopping"))
