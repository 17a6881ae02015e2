"""The dispatcher of one app: its queries from arrival to answer, through central queues per stage,
the matching policy, and batches to workers.

This module owns the hot path of an app's serving (:class:`AppDispatcher`, on the asyncio event
loop that serves the API); it composes the app's placement (:mod:`controlplane.serving.placement`:
which workers serve which stage, under which policy), its workers' health
(:mod:`controlplane.serving.health`: unhealthy marking, probes, retries) and its variants
(:mod:`controlplane.serving.variants`: model-less choice, INFaaS states, the loads admission
judges).

- **Stages.** One stage per model of the app
  (:class:`~controlplane.serving.stages.ServingStage`), each
  with a central queue in arrival order (:class:`matching.queues.CentralQueue`: the simulator's
  and InferLine's centralized queue) and its own dispatch policy object, built by
  :func:`estimator.policies.policy_factory` over the live instances' types and the model's
  profiles: the same classes, built the same way, that the simulator and the planner run, so
  what is simulated is what runs. The policy is the plan's for that stage when the applied plan
  names one, else the planner's rule (:func:`~controlplane.serving.placement.policy_name`: FCFS
  for one instance type, Kairos over a mix when some type serves the whole range within the
  SLO). Its batch cap (``max_batch_queries``) comes from the gear in force (the switcher's for a
  cascade; for a single model sized by its ladder, the tuner's: the batch of the rung its fleet
  reaches, ``LiveTuner.batch_caps``), else the plan's stage ``batch_size``, else 1. An app of
  several models is co-located instead (CascadeServe SP3, :mod:`~controlplane.serving.placement`):
  a stage's instances are its model's hosts and its policy follows the load balancer's shares
  (:class:`~controlplane.serving.shares.SharePolicy`); the placement follows the gear in force.
- **Rounds.** A round asks a stage's policy which queued queries start on which idle instances
  (:class:`matching.policy.DispatchPolicy`). Arrivals, completions, failures and fleet changes
  mark stages dirty; one round per dirty stage runs at the next turn of the event loop (so the
  arrivals of one turn are matched together, later stages first: their queries are older).
  Under a gear with a minimum queue length m > 1 for the model (CascadeServe's batch trigger,
  :mod:`controlplane.policies.gears` SP4) a round starts no batch while fewer than m queries
  are queued, until the oldest has waited the gear's guard (``max_wait_s``); one timer per
  stage runs the round when the guard expires.
- **Batches.** Each :class:`~matching.policy.Dispatch` sends the rows of its queries as one batch
  to the worker over a kept-alive HTTP connection (:mod:`controlplane.serving.transport`), as an
  Open Inference Protocol request against the stage's model signature (its
  :class:`~controlplane.serving.modelio.ModelIO`, which also reads each row's prediction and
  certainty off the answer and keeps its raw outputs for the caller); the
  worker is busy until the answer returns (its predicted end, start plus the profile's mean, is
  what the policy sees meanwhile), and the measured round trip is fed back to the policy
  (``observe``: Kairos' online latency model learns from it), and recorded per (model, instance
  type, batch size) for the calibration loop (:meth:`Observations.batch_served`), with the
  instance's turnaround before the batch when work was waiting (:func:`_turnaround_ms`).
- **Cascades.** A query carries its cascade (the gear in force when it arrived, or the variant a
  model-less query was given); after stage i each of its samples is final when its certainty
  reaches the threshold h_i (or at the last stage), and the others go together, as one new
  query, to the next model's queue, keeping the original arrival time (the SLO clock runs from
  arrival). The request resolves when every sample is final.
- **Failures.** A worker whose call fails (no connection, a timeout, a broken connection, a
  status saying it cannot serve) is unhealthy at once and its batch goes back to the front of
  its stage's queue, up to ``max_attempts`` tries per query, then an explicit error (502;
  :mod:`controlplane.serving.health`, which also probes idle and unhealthy workers). A call
  that timed out on a worker that still answers its probe was a slow batch, not a worker gone:
  a query alone in it is answered 504 rather than sent on (it would take each worker out in
  turn), the queries of a batch of several are tried again alone; the worker stays out while
  its agent says a batch still runs there. A worker that answers
  that the model raised on the batch, or that its inputs are refused, stays healthy: a bad
  query fails alone (422 when the worker says its inputs are at fault or the model raised on
  it where that worker has answered the model before, else 502) and the other queries of its
  batch go back to the front of the queue. The agent names the rows that failed (it runs a
  failed batch again row by row); when a worker names none, each query of the batch is tried
  again in a batch of its own. A query
  past its SLO is still served and answered, flagged ``late``; only past ``give_up_s`` (far
  beyond the SLO) is it answered with an explicit timeout (504), and a query nothing can serve
  (no healthy instance of its model) is refused at arrival (503), so nothing waits without bound.
- **Overload without collapse.** Past saturation, work on queries nobody will read is work
  taken from those that will be: a query whose client has gone (the API cancels its call,
  :class:`~controlplane.api.disconnect.CancelOnDisconnect`) leaves its queue at once, and a
  query whose give-up time comes before the predicted end of the batch it would join is
  answered with its timeout instead of being sent (:meth:`AppDispatcher._in_time`): neither
  costs a worker call.
- **Admission and states.** :mod:`controlplane.serving.admission` refuses a query (429) whose
  queue cannot be served within the SLO even at the cheapest gear; :mod:`controlplane.serving.
  states` marks (model, instance) pairs overloaded or interfered, and rounds leave interfered
  instances out while the model has an active one.
- **Model-less queries** (INFaaS): a request with requirements (latency, minimum accuracy) gets
  the cheapest variant that meets them (:class:`~controlplane.serving.variants.AppVariants`), or
  a :class:`~controlplane.errors.RequirementsUnmetError` naming the closest offer.

Everything here runs on one event loop; nothing blocks it (the store and the provider are read
by :mod:`controlplane.serving.loop` in threads). The configuration types (:class:`AppConfig`,
:class:`StagePlan`, :class:`ServingGear`, :class:`DispatcherSettings`), :class:`WorkerLoss` and
:func:`policy_name` live beside it and are re-exported here.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from controlplane.errors import (
    NoServingInstanceError,
    OverloadedError,
    QueryFailedError,
    QueryRejectedError,
    QueryTimeoutError,
    ServingError,
    WorkerCallError,
)
from controlplane.policies.plan import StagePlan
from controlplane.policies.variants import Requirements, VariantOption
from controlplane.serving.admission import (
    StageLoad,
    decide,
    judged_positions,
    predicted_latency_ms,
)
from controlplane.serving.config import (
    AppConfig,
    DispatcherSettings,
    GearSource,
    ServingGear,
    batch_cap,
    batch_trigger,
)
from controlplane.serving.health import Health, WorkerLoss
from controlplane.serving.modelio import ModelIO, Row, WorkerReply
from controlplane.serving.observations import Observations, Outcome, Split, outcome_of
from controlplane.serving.placement import Placement, policy_name
from controlplane.serving.reach import ReachMeter
from controlplane.serving.stages import ServingStage, Slot
from controlplane.serving.states import ModelState, Overload, StateTracker, model_state
from controlplane.serving.transport import WorkerBusy, WorkerTransport
from controlplane.serving.variants import AppVariants
from controlplane.serving.workers import Worker, WorkerEndpoint
from estimator.cascades import Cascade
from estimator.policies import policy_factory
from matching.policy import DispatchPolicy, QueuedQuery, StageContext

__all__ = [
    "AppConfig",
    "AppDispatcher",
    "AppStatus",
    "DispatcherSettings",
    "GearSource",
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
# How long after the app's last model-less query refuse_early still weighs the variants such a
# query may run under (one in a minute's traffic makes the app one that gets them).
MODEL_LESS_MEMORY_S = 60.0
# The least time between two sweeps aimed at a client's deadline (sweep_delay_s).
_MIN_SWEEP_S = 0.02


def sweep_delay_s(now_s: float, next_deadline_s: float | None) -> float:
    """When the sweep runs next, seconds after ``now_s``: every :data:`_SWEEP_S`, sooner for the
    next client deadline still ahead (``next_deadline_s``), so that a queued query is answered
    504 within :data:`_MIN_SWEEP_S` of its deadline, not up to a period after it (a client whose
    own timeout is the deadline it sent had given up by then); never sooner than that, so that
    the deadlines of thousands of queries a second cost at most 50 sweeps a second.

    >>> sweep_delay_s(10.0, None), sweep_delay_s(10.0, 10.1), sweep_delay_s(10.0, 10.001)
    (0.25, 0.1, 0.02)
    >>> sweep_delay_s(10.0, 12.0)
    0.25
    """
    if next_deadline_s is None:
        return _SWEEP_S
    return round(min(_SWEEP_S, max(_MIN_SWEEP_S, next_deadline_s - now_s)), 9)


# A sample's reply until one answers it.
_NO_REPLY: tuple[WorkerReply, int] = (WorkerReply((), (), None, ""), -1)


# --- answers and status ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InferResult:
    """The answer to a request: per sample its output class, the model that answered it and its
    certainty; the gear's label; and timings (ms): ``total_ms`` from the API's receipt of the
    request (``received_s``; else its arrival at the loop) to the answer, ``service_ms`` the round
    trips of the batches that carried its samples, of which ``compute_ms`` the workers' own
    service time and ``transport_ms`` the rest, ``api_ms`` the API's part before the loop
    (receipt to submit: parsing, the token check, validation, the event loop's own queue),
    ``queue_ms`` the rest of ``total_ms`` (admission, the stages' queues, the loop); ``late``
    when ``total_ms`` is over the query's latency bound: a model-less query's own
    (``Requirements.latency_ms``), else the app's SLO. ``replies``: per sample, the worker's
    reply that answered it and the sample's row in that reply's batch: the answering model's raw
    outputs (:func:`~controlplane.serving.modelio.stack_outputs`, what ``/v2`` answers)."""

    outputs: tuple[int, ...]
    models: tuple[str, ...]
    certainty: tuple[float, ...]
    gear: str
    queue_ms: float
    service_ms: float
    total_ms: float
    late: bool
    transport_ms: float = 0.0
    compute_ms: float = 0.0
    api_ms: float = 0.0
    replies: tuple[tuple[WorkerReply, int], ...] = ()


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
    (samples/s), policy and batch cap, and the INFaaS state of the model on each instance. In a
    cascade's co-located placement (SP3), ``shares`` is each hosting instance's share of the
    model's queries (by instance id) and ``lp_utilisation`` the load balancer's u (the busiest
    instance's busy share at the load in force); empty and None otherwise. ``overload`` is
    what the model's overload verdict was judged on (:class:`~controlplane.serving.states.
    Overload`: backlog, refusals, arrival rate, capacity)."""

    model: str
    queued_queries: int
    queued_samples: int
    in_service_samples: int
    capacity_sps: float
    policy: str
    max_batch_queries: int
    states: Mapping[str, ModelState]
    shares: Mapping[str, float] = field(default_factory=dict)
    lp_utilisation: float | None = None
    overload: Overload | None = None
    # The share of the app's samples that reach this model at the spec's thresholds, as the
    # answers of the last minute show (controlplane.serving.reach), and the samples of the
    # spec's first model it rests on (fewer where a model between answered fewer than the
    # spec's thresholds send it); None for the first model or without answers.
    reach: float | None = None
    reach_samples: int = 0


@dataclass(frozen=True, slots=True)
class AppStatus:
    app: str
    gear: str
    slo_ms: float
    workers: tuple[WorkerStatus, ...]
    stages: tuple[StageStatus, ...]
    in_flight_requests: int


# --- requests ----------------------------------------------------------------------------------


def _dispatch_lag_ms(now_s: float, enqueued_s: float, idle_since_s: float) -> float:
    """How long a query queued to a free instance waited on the serving loop itself (ms): from
    its queueing to its batch's start, the event loop's turns (what no profile or simulated
    queue covers, so it is part of the service's own time per query: :class:`Split`'s
    ``lag_ms``). A query already queued when the instance came free waited for the instance:
    the loop's turn after its last answer is then the instance's (:func:`_turnaround_ms`), and
    0 here.

    >>> round(_dispatch_lag_ms(10.004, 10.003, 10.002), 9)  # free at 2 ms, queued at 3 ms
    1.0
    >>> _dispatch_lag_ms(10.004, 10.001, 10.002)  # queued at 1 ms, before it came free
    0.0
    """
    if enqueued_s < idle_since_s:
        return 0.0
    return max(0.0, now_s - enqueued_s) * 1000.0


def _turnaround_ms(now_s: float, oldest_enqueued_s: float, idle_since_s: float) -> float:
    """How long an instance stood between its last answer and its next batch's start (ms) while
    that batch's oldest query was already waiting: the serving loop's turn to read the answer
    and dispatch again, during which the instance serves no one although it has work (counted
    in the first dispatch round after the answer only: a wait past it is a policy's choice, or
    the query was in another instance's batch that failed). A
    simulated instance starts its next batch at its last one's end, so this is part of its
    service time: the dispatcher adds it to the batch's round trip in what the calibration
    sees (:meth:`Observations.batch_served`). 0 when the instance was idle with nothing queued.

    >>> round(_turnaround_ms(10.004, 10.001, 10.002), 9)
    2.0
    >>> _turnaround_ms(10.004, 10.003, 10.002)
    0.0
    """
    if oldest_enqueued_s >= idle_since_s:
        return 0.0
    return max(0.0, now_s - idle_since_s) * 1000.0


class _Request:
    __slots__ = (
        "api_ms",
        "arrival_s",
        "bound_ms",
        "cascade",
        "certainty",
        "compute_ms",
        "deadline_s",
        "future",
        "inputs",
        "lag_ms",
        "models",
        "outputs",
        "pending",
        "queued",
        "reached",
        "replies",
        "sample_ids",
        "service_ms",
    )

    def __init__(
        self,
        inputs: Sequence[Row],
        sample_ids: Sequence[int] | None,
        cascade: Cascade,
        arrival_s: float,
        future: asyncio.Future[InferResult],
        api_ms: float = 0.0,
    ) -> None:
        n = len(inputs)
        self.inputs = inputs
        self.sample_ids = sample_ids
        self.cascade = cascade
        self.arrival_s = arrival_s
        self.api_ms = api_ms  # the API's receipt to the loop's submit
        self.future = future
        self.outputs: list[int] = [0] * n
        self.models: list[str] = [""] * n
        self.certainty: list[float] = [0.0] * n
        self.replies: list[tuple[WorkerReply, int]] = [_NO_REPLY] * n
        self.pending = n
        self.service_ms = 0.0
        self.compute_ms = 0.0
        self.lag_ms = 0.0  # the loop's own wait before its batches started (_dispatch_lag_ms)
        self.queued: dict[int, _Stage] = {}  # query id -> the stage whose queue holds it
        self.deadline_s = math.inf  # when its client stops waiting, if it said
        self.bound_ms: float | None = None  # a model-less query's own latency bound
        # Per sample, the position in the spec's cascade it reaches at the spec's thresholds as
        # far as the answers so far show (-1: answered before it) (None: no spec model counted
        # one yet): a later model's reach counts only the samples the spec's thresholds send it.
        self.reached: list[int] | None = None


class _Part:
    """A request's samples at one stage: one queued query. ``alone``: it was in a batch the model
    raised on, with no word of which rows failed; it goes in a batch of its own from now on, so
    that its failure is its own."""

    __slots__ = ("alone", "attempts", "position", "query", "request", "samples")

    def __init__(
        self, request: _Request, position: int, samples: list[int], query: QueuedQuery
    ) -> None:
        self.request = request
        self.position = position  # the stage's index in the request's cascade
        self.samples = samples
        self.query = query
        self.attempts = 0
        self.alone = False


# --- stages ------------------------------------------------------------------------------------


class _Stage(ServingStage):
    """A stage as the dispatcher keeps it: also the request part of each of its queued queries
    (by query id)."""

    __slots__ = ("answered_in", "parts", "rounds", "wake", "wake_s")

    def __init__(self, model: str, io: ModelIO | None = None) -> None:
        super().__init__(model, io)
        self.parts: dict[int, _Part] = {}
        # Rounds run so far, and per instance id the count when its last answer came: a batch
        # started in the round right after is the first chance the loop had to give it work.
        self.rounds = 0
        self.answered_in: dict[str, int] = {}
        # The batch trigger's guard timer (AppDispatcher._held): one per stage, moved, not added.
        self.wake: asyncio.TimerHandle | None = None
        self.wake_s = math.inf


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
        self.placement = Placement()
        self.health = Health(config.name, transport, self.settings, clock_s, on_unhealthy)
        self._stages: dict[str, _Stage] = {}
        self._interfered: set[tuple[str, str]] = set()
        self._model_less_s = -math.inf  # the last model-less query's choice, on clock_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_query = 0
        # Requests not answered yet, oldest first: swept for their give-up time every _SWEEP_S
        # (one timer for all: a timer per request would fill the loop's heap with cancelled
        # ones, 60,000 at 2,000 q/s and a give-up of 30 s).
        self._open: dict[_Request, None] = {}
        # The requests whose client gave a deadline, by it (deadline, order, request): the same
        # sweep answers those still queued at their deadline (a heap: deadlines differ).
        self._deadlines: list[tuple[float, int, _Request]] = []
        self._order = itertools.count()
        self._sweeper: asyncio.TimerHandle | None = None
        # The delay the sweep's timer was last set for (sweep_delay_s).
        self.sweep_delay_s = _SWEEP_S
        self._rounds_scheduled = False
        self._closed = False
        self.config = config
        self.gear_label = config.cascade.label  # the gear in force at the last arrival
        self._last_gear: ServingGear | None = None
        self.reach = ReachMeter(config.cascade.models, config.cascade.thresholds)
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
        cascade = config.cascade
        if (self.reach.models, tuple(self.reach.thresholds.values())) != (
            cascade.models,
            tuple(cascade.thresholds),
        ):  # other thresholds: the counts so far say nothing of the new ones
            self.reach = ReachMeter(cascade.models, cascade.thresholds)
        self.variants = AppVariants(config, self._stages, self.tracker)
        self.health.app = config.name
        for model in [m for m in self._stages if m not in config.models]:
            stage = self._stages.pop(model)
            for part in list(stage.parts.values()):
                self._fail(part.request, QueryFailedError(self.app, "the app's spec changed", 0))
        for model in config.models:
            io = config.model_io(model)
            current = self._stages.get(model)
            if current is None:
                self._stages[model] = _Stage(model, io)
            else:
                current.io = io
        self._place()

    def set_workers(self, endpoints: Sequence[WorkerEndpoint]) -> None:
        """The app's running workers now: new ones join (healthy), gone ones leave (a batch they
        hold still completes or fails as it will). A worker whose endpoint changed is new: what
        the one it replaces answered is forgotten (:meth:`_rejection` reads it)."""
        before = dict(self.placement.workers)
        changed = self.placement.update(endpoints, self.clock_s())
        if changed:
            now_workers = self.placement.workers
            replaced = [i for i, w in before.items() if now_workers.get(i, w) is not w]
            for stage in self._stages.values():
                for instance_id in replaced:
                    stage.answered_in.pop(instance_id, None)
        listed = {e.instance_id for e in endpoints}
        gone = [i for i in {key[1] for key in self._interfered} if i not in listed]
        self.tracker.forget(gone)
        self._interfered = {key for key in self._interfered if key[1] in listed}
        if changed:
            self._place()
            self._fail_stranded("the workers left the fleet")

    def workers(self) -> list[Worker]:
        return list(self.placement.workers.values())

    def _place(self) -> None:
        """Place the workers on the stages again (:meth:`~controlplane.serving.placement.
        Placement.place`: after a fleet or a health change, which also drops the capacity
        estimates) and give every stage a round."""
        self.placement.place(self.config, self._stages, self.current_gear())
        for stage in self._stages.values():
            if stage.answered_in:  # forget the instances a stage no longer has
                here = {slot.worker.instance_id for slot in stage.slots}
                for gone in stage.answered_in.keys() - here:
                    del stage.answered_in[gone]
        self._mark_all()

    # --- requests -------------------------------------------------------------------------------

    def current_gear(self) -> ServingGear:
        """The gear in force: the switcher's (when its cascade is the app's to serve), else the
        app's own cascade."""
        gear = self.gear() if self.gear is not None else None
        if gear is not None and all(m in self._stages for m in gear.cascade.models):
            return gear
        return self._own_gear

    async def infer(
        self,
        inputs: Sequence[Row],
        sample_ids: Sequence[int] | None = None,
        requirements: Requirements | None = None,
        received_s: float | None = None,
        deadline_s: float | None = None,
    ) -> InferResult:
        """Answer one request (see the module docstring); raises the
        :class:`~controlplane.errors.ServingError` that says why not. ``received_s``: when the
        API received it, on ``clock_s`` (default: now)."""
        cascade = None
        bound_ms = None
        if requirements is not None:
            cascade = self.choose_variant(requirements, len(inputs))
            bound_ms = requirements.latency_ms
        return await self.submit(
            inputs, sample_ids, cascade, received_s, deadline_s, bound_ms=bound_ms
        )

    def submit(
        self,
        inputs: Sequence[Row],
        sample_ids: Sequence[int] | None = None,
        cascade: Cascade | None = None,
        received_s: float | None = None,
        deadline_s: float | None = None,
        *,
        bound_ms: float | None = None,
    ) -> asyncio.Future[InferResult]:
        """Queue a request under ``cascade`` (default: the gear in force) and return the future
        of its answer. Raises at once when it is refused (503 or 429 kinds). Its latency, and its
        SLO clock, run from ``received_s`` (when the API received it, on ``clock_s``; default
        and upper bound: now). ``deadline_s`` (on ``clock_s``): when its client stops waiting,
        if it said (a batch that would end later is not sent for it: :meth:`_in_time`).
        ``bound_ms``: a model-less query's own latency bound, which its answer's ``late`` is
        judged against instead of the SLO (the app's counts keep the SLO)."""
        if not inputs:
            raise ValueError("a request needs at least one sample")
        now = self.clock_s()
        arrival_s = now if received_s is None else min(received_s, now)
        app = self.app
        self.observations.arrival(app, now)
        if self._closed:
            self.observations.refused(app, now, (now - arrival_s) * 1000.0)
            raise NoServingInstanceError(self.app, self.config.cascade.models[0], "stopping")
        gear = self.current_gear()
        if gear is not self._last_gear:
            self._last_gear = gear
            self.gear_label = gear.cascade.label
            if self.placement.stale(self.config, gear):  # a cascade's shares follow the gear
                self._place()
        chosen = cascade
        if cascade is None:
            cascade = gear.cascade
        n = len(inputs)
        try:
            self._check_serving(cascade)
            if self.settings.admission:
                self._admit(gear, n, chosen=chosen)
        except ServingError as error:
            self._ended_at_entry(error, now, arrival_s)
            raise
        loop = asyncio.get_running_loop()
        future: asyncio.Future[InferResult] = loop.create_future()
        request = _Request(
            inputs, sample_ids, cascade, arrival_s, future, (now - arrival_s) * 1000.0
        )
        request.bound_ms = bound_ms
        future.add_done_callback(functools.partial(self._on_done, request))
        self._open[request] = None
        if deadline_s is not None and deadline_s < math.inf:
            request.deadline_s = deadline_s
            heapq.heappush(self._deadlines, (deadline_s, next(self._order), request))
        if self._sweeper is None:
            self.sweep_delay_s = sweep_delay_s(now, request.deadline_s)
            self._sweeper = loop.call_later(self.sweep_delay_s, self._sweep)
        self._enqueue(request, 0, list(range(n)), now)
        return future

    def refuse_early(self, received_s: float | None = None, *, plain: bool = False) -> bool:
        """Raise the :class:`~controlplane.errors.OverloadedError` that :meth:`submit` would
        raise now for a query of one sample (recorded as that refusal would be); nothing, and
        nothing recorded, when such a query would be admitted, or refused for another reason,
        or when nothing is queued (then submit's own check is the only one a query costs).

        A query is refused when the wait at its stages is over what the SLO leaves it after its
        own service (:func:`~controlplane.serving.admission.decide`); the wait does not depend
        on its size and its service grows with it, so a query that every candidate gear refuses
        at one sample is refused whatever its size: that is the check here (``by_every_gear``),
        which the API makes before it reads and decodes a body
        (:mod:`controlplane.api.fast_infer`). Past saturation most queries are refused, and a
        refusal that had decoded its body cost the serving loop about what an answer costs,
        which it took from the queries it serves.

        A model-less query runs under the variant its requirements pick, which its body says
        (one for the large model alone had been refused here at the tiny model's full queue).
        Where the app had one in the last :data:`MODEL_LESS_MEMORY_S`, a query the gears refuse
        that a variant would admit is not refused yet: True says so, and the caller asks again
        with ``plain`` once the body shows no requirements (``plain``: the query is known to
        carry none, a ``/v2`` query's or a body read: the gears alone judge it). False
        otherwise."""
        if self._closed or not self.settings.admission:
            return False
        if not any(stage.queued_samples for stage in self._stages.values()):
            # Nothing queued: the common case below saturation, where submit judges the query
            # anyway (a wait for busy instances alone is left to it: rare, and not refused early).
            return False
        gear = self.current_gear()
        try:
            self._check_serving(gear.cascade)
        except NoServingInstanceError:
            return False  # submit answers that (503), with the query's own size
        model_less = not plain and self.clock_s() - self._model_less_s <= MODEL_LESS_MEMORY_S
        try:
            return self._admit(
                gear, 1, by_every_gear=True, spare=self._a_variant_admits if model_less else None
            )
        except OverloadedError as error:
            now = self.clock_s()
            self.observations.arrival(self.app, now)
            self._ended_at_entry(error, now, now if received_s is None else min(received_s, now))
            raise

    def refused_at_front(self) -> bool:
        """Record a query the API's front refused as its head was read, before it reached
        admission (:mod:`controlplane.serving.throttle`), as admission records its refusals: an
        arrival and a refused query, at once (the tuner reads the whole demand, the attainment
        counts the miss). False, nothing recorded, where admission is off or the dispatcher
        closed: the query is not to be refused there."""
        if self._closed or not self.settings.admission:
            return False
        now = self.clock_s()
        self.observations.arrival(self.app, now)
        self.observations.ended_in_error(self.app, now, Outcome.REFUSED, 0.0)
        return True

    def _a_variant_admits(self, gear: ServingGear, now: float) -> bool:
        """Whether a query of one sample would be admitted under one of the variants a
        model-less query may be given now."""
        slo_ms = self.config.slo_ms
        return any(
            decide(self.variants.loads(cascade, 1, gear, now), slo_ms).admitted
            for cascade in self.variants.cascades(gear)
        )

    def _ended_at_entry(self, error: ServingError, now: float, arrival_s: float) -> None:
        """Record a query that ``error`` ended on its way in (its arrival recorded already)."""
        outcome = outcome_of(error)
        if outcome is not None:
            self.observations.ended_in_error(self.app, now, outcome, (now - arrival_s) * 1000.0)

    def unserved(self) -> str | None:
        """Why a query arriving now would be refused for want of a worker (503), or None when
        every model of the gear in force has a healthy one."""
        try:
            self._check_serving(self.current_gear().cascade)
        except NoServingInstanceError as error:
            return str(error)
        return None

    def _check_serving(self, cascade: Cascade) -> None:
        """Every model the cascade may send a sample to needs a healthy instance."""
        for model in cascade.models:
            stage = self._stages.get(model)
            if stage is None or not stage.served:
                workers = self.placement.workers
                why = "no running worker" if not workers else "no healthy worker serves it"
                raise NoServingInstanceError(self.app, model, why)

    def _admit(
        self,
        gear: ServingGear,
        samples: int,
        *,
        by_every_gear: bool = False,
        chosen: Cascade | None = None,
        spare: Callable[[ServingGear, float], bool] | None = None,
    ) -> bool:
        """Admission for a query of ``samples`` samples under ``gear`` (raises the
        :class:`~controlplane.errors.OverloadedError` that refuses it), judged under the gear of
        least predicted latency among the candidates; ``by_every_gear``: refused only when every
        candidate refuses (:meth:`refuse_early`). ``chosen``: the cascade a model-less query's
        variant choice gave it, the only one it runs under, so the only one judged (judged
        under the gear's candidates, a query for the large model alone was refused at the
        tiny model's queue, and its refusal marked tiny overloaded). ``spare``: asked before a
        refusal by the candidates (not at the cap on queued samples), which it turns into True,
        nothing recorded (:meth:`refuse_early`: a variant would admit it); else False, admitted."""
        queued = sum(s.queued_samples for s in self._stages.values())
        if queued + samples > self.settings.max_queued_samples:
            raise OverloadedError(self.app, math.inf, self.config.slo_ms, 1)
        if chosen is not None:
            candidates = [chosen]
        else:
            candidates = [gear.cascade, self.config.cascade]
            if gear.cheapest is not None and all(m in self._stages for m in gear.cheapest.models):
                candidates.append(gear.cheapest)
        now = self.clock_s()
        loads = {c: self.variants.loads(c, samples, gear, now) for c in dict.fromkeys(candidates)}
        cascade, best = min(loads.items(), key=lambda item: predicted_latency_ms(item[1]))
        verdict = decide(best, self.config.slo_ms)
        if verdict.admitted or (
            by_every_gear
            and any(decide(load, self.config.slo_ms).admitted for load in loads.values())
        ):
            return False
        if spare is not None and spare(gear, now):
            return True
        # An overload sign for each model admission judged the query on (states.py): those
        # every sample reaches. A later stage a share of the samples would have reached did not
        # refuse it (marked too, a cascade's medium model read as overloaded at 8 qps of its 80
        # for refusals made at its first model's queue).
        for i in judged_positions(best):
            load = best[i]
            reached = load.reach_share * samples
            self.tracker.refused((self.app, cascade.models[i]), now, reached, load.capacity_sps)
        raise OverloadedError(
            self.app, verdict.predicted_ms, self.config.slo_ms, verdict.retry_after_s
        )

    def _forward_unserved(self, request: _Request, position: int) -> bool:
        """The part of a query a cascade forwards to its model at ``position`` when no healthy
        instance serves that model (its workers died or left while the part was at an earlier
        stage): the query is answered now with the 503 an arrival would get, as
        :meth:`_fail_stranded` answers the parts already queued there; not queued where nothing
        serves it until its give-up time, nor refused as an overload (a 429 that said the
        queues were full, and an overload sign of a model that has no instance)."""
        model = request.cascade.models[position]
        stage = self._stages.get(model)
        if stage is None or stage.served:
            return False  # a model gone is _enqueue's answer
        self._fail(request, NoServingInstanceError(self.app, model, "no healthy worker"))
        return True

    def _forward_refused(self, request: _Request, position: int, samples: int, now: float) -> bool:
        """Admission for the part of a query a cascade forwards to its model at ``position``
        (:mod:`controlplane.serving.admission`: a query is judged on entry at the stage every
        sample reaches): refused (429) when that stage's wait exceeds what the SLO leaves the
        query after its time so far and its service there. A later stage short of capacity then
        refuses what it cannot serve in time, as the first stage does, rather than queue it."""
        if not self.settings.admission:
            return False
        model = request.cascade.models[position]
        stage = self._stages.get(model)
        if stage is None:
            return False
        cap = stage.call_cap(batch_cap(self.config, model, self.current_gear()), now)
        capacity, service_ms = stage.rates(samples, cap)
        backlog = stage.queued_samples + stage.in_service_samples
        load = StageLoad(backlog, capacity, service_ms, 1.0, stage.wait_ms(cap, now))
        elapsed_ms = (now - request.arrival_s) * 1000.0
        # The entry's rule on the one stage, against what the SLO leaves the query.
        verdict = decide([load], self.config.slo_ms - elapsed_ms)
        if verdict.admitted:
            return False
        self.tracker.refused((self.app, model), now, samples, capacity)
        self._fail(
            request,
            OverloadedError(
                self.app,
                elapsed_ms + verdict.predicted_ms,
                self.config.slo_ms,
                verdict.retry_after_s,
                forwarded_to=model,
            ),
        )
        return True

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
        stage.backlog.add(len(samples))
        stage.drain.queued(now)
        request.queued[query.query_id] = stage
        self.tracker.arrived((self.app, model), now, len(samples))
        self._backlog_moved(stage, now)
        self._mark(stage)

    def _backlog_moved(self, stage: _Stage, now: float) -> None:
        """A reading of ``stage``'s backlog for the tracker, as it changed (the overload verdict
        holds it over the SLO for a monitoring period: :mod:`controlplane.serving.states`)."""
        backlog = stage.queued_samples + stage.in_service_samples
        self.tracker.backlog((self.app, stage.model), now, backlog)

    def _requeue(self, stage: _Stage, parts: Sequence[_Part]) -> None:
        """Back to the front of the queue (they are the oldest there), keeping their ids."""
        stage.queue.push_front([p.query for p in parts])
        for part in parts:
            stage.parts[part.query.query_id] = part
            stage.queued_samples += len(part.samples)
            stage.backlog.add(len(part.samples))
            part.request.queued[part.query.query_id] = stage
        self._backlog_moved(stage, self.clock_s())
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

    def _eligible(self, stage: _Stage) -> list[Slot]:
        healthy = [s for s in stage.slots if s.worker.healthy]
        if not self._interfered:
            return healthy
        model = stage.model
        active = [s for s in healthy if (model, s.worker.instance_id) not in self._interfered]
        return active or healthy

    def _round(self, stage: _Stage, now: float, gear: ServingGear) -> None:
        stage.rounds += 1
        queue = stage.queue
        policy = stage.policy
        if not queue or policy is None:
            return
        slots = self._eligible(stage)
        if not any(s.worker.healthy and not s.worker.running for s in slots):
            return
        if self._held(stage, now, gear):
            return
        context = StageContext(batch_cap(self.config, stage.model, gear), self.config.slo_ms)
        # A batch trigger holds queries on purpose (the planner simulates that wait): its
        # stage's dispatch lag is not told apart from it, so not counted.
        lag_counted = batch_trigger(gear, stage.model)[0] <= 1
        by_index = {s.index: s for s in slots}
        try:
            dispatches = policy.dispatch(now, queue, slots, context)
        except Exception:
            policy = self._fall_back(stage, policy, "dispatch")
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
                    stage.backlog.remove(len(part.samples))
                    parts.append(part)
            if len(parts) > 1 and any(part.alone for part in parts):
                # A suspect of a failed batch goes alone; the others wait at the front.
                lone = next(part for part in parts if part.alone)
                self._requeue(stage, [part for part in parts if part is not lone])
                parts = [lone]
            if len(parts) > 1 and stage.io.varies:
                parts = self._stackable(stage, parts)
            if parts:
                parts = self._in_time(stage, slot.worker, parts, now)
            if parts:
                turnaround_ms = 0.0
                if lag_counted:
                    idle_since_s = slot.worker.idle_since_s
                    for part in parts:
                        part.request.lag_ms += _dispatch_lag_ms(
                            now, part.query.enqueued_s, idle_since_s
                        )
                    if stage.answered_in.get(slot.worker.instance_id) == stage.rounds - 1:
                        # The first round since its answer: the wait was the loop's turn (in a
                        # later round it is the policy's choice, or the query was elsewhere).
                        turnaround_ms = _turnaround_ms(
                            now, min(part.query.enqueued_s for part in parts), idle_since_s
                        )
                self._start(stage, slot, parts, now, turnaround_ms)
        self._backlog_moved(stage, now)
        if not queue:
            stage.drain.emptied()

    def _stackable(self, stage: _Stage, parts: list[_Part]) -> list[_Part]:
        """The parts of a batch whose samples come in the first part's shapes; the others back
        to the front of the queue, for a batch of their own shapes. A model with a dynamic
        dimension past the batch (a sequence's length) takes one shape a batch: a batch of
        mixed shapes failed to encode, was taken for bad inputs, and every query of it went
        alone from then on (a load of two lengths served one query a call, most refused)."""
        io = stage.io
        first = parts[0]  # kept whatever its own samples are (so that the batch never empties)
        key = io.stack_key(first.request.inputs[first.samples[0]])
        kept = [first]
        other: list[_Part] = []
        for part in parts[1:]:
            rows = part.request.inputs
            same = all(io.stack_key(rows[i]) == key for i in part.samples)
            (kept if same else other).append(part)
        if other:
            self._requeue(stage, other)
        return kept

    def _fall_back(self, stage: _Stage, policy: DispatchPolicy, failed: str) -> DispatchPolicy:
        """A policy that raised (in its ``failed`` method: ``dispatch`` or ``observe``) must
        neither stall its stage nor lose the answers of a batch: FCFS over the same instances
        decides from now on (logged once: it is a bug to look into)."""
        logger.exception(
            "%s: policy %s failed in %s; %s falls back to fcfs",
            self.app,
            policy.name,
            failed,
            stage.model,
        )
        fallback = policy_factory("fcfs", {}, sorted(stage.latency))()
        stage.policy = fallback
        stage.policy_name = "fcfs"
        return fallback

    def _in_time(
        self, stage: _Stage, worker: Worker, parts: list[_Part], now: float
    ) -> list[_Part]:
        """The parts of a batch about to start whose answer can still come in time: a query
        whose deadline (its give-up time, ``give_up_s`` after its arrival, or its client's own
        deadline when it gave one) comes before the batch's predicted end is answered with its
        timeout now, without costing the worker a call (its answer would be thrown away). Its
        client gone, a query has left the queue already (:meth:`_on_done`)."""
        give_up_s = self.settings.give_up_after_s(self.config.slo_ms)
        samples = sum(len(part.samples) for part in parts)
        end_s = now + stage.latency[worker.instance_type].ms(samples) / 1000.0
        late = [
            part
            for part in parts
            if min(part.request.arrival_s + give_up_s, part.request.deadline_s) < end_s
        ]
        if not late:
            return parts
        for part in late:
            request = part.request
            within_s = min(give_up_s, request.deadline_s - request.arrival_s)
            self._fail(request, QueryTimeoutError(self.app, within_s))
        self._mark(stage)  # the instance may stay idle: the next queries get a round
        return [part for part in parts if not part.request.future.done()]

    def _start(
        self, stage: _Stage, slot: Slot, parts: list[_Part], now: float, turnaround_ms: float
    ) -> None:
        rows = [part.request.inputs[i] for part in parts for i in part.samples]
        worker = slot.worker
        predicted_ms = stage.latency[worker.instance_type].ms(len(rows))
        worker.start(now, predicted_ms)
        stage.in_service_samples += len(rows)
        task = asyncio.get_running_loop().create_task(
            self._call(stage, worker, parts, rows, now, predicted_ms, turnaround_ms)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(
        self,
        stage: _Stage,
        worker: Worker,
        parts: list[_Part],
        rows: list[Row],
        started_s: float,
        predicted_ms: float,
        turnaround_ms: float,
    ) -> None:
        settings = self.settings
        timeout_s = max(
            settings.call_timeout_floor_s, settings.call_timeout_factor * predicted_ms / 1000.0
        )
        try:
            reply = await self.transport.infer(worker.address, stage.io, rows, timeout_s)
        except WorkerCallError as error:
            slow_s = None
            if error.kind == "timeout" and not worker.slow:
                try:
                    if await self._answers(worker):
                        slow_s = timeout_s
                except asyncio.CancelledError:
                    self._cancelled(stage, worker, parts, len(rows))
                    raise
            self._failed(stage, worker, parts, len(rows), error, slow_s)
        except asyncio.CancelledError:
            self._cancelled(stage, worker, parts, len(rows))
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
            self._completed(
                stage, worker, parts, rows, reply, started_s, predicted_ms, turnaround_ms
            )

    def _cancelled(self, stage: _Stage, worker: Worker, parts: list[_Part], batch: int) -> None:
        """A call cancelled (the dispatcher is closing): its queries are answered 503."""
        stage.in_service_samples -= batch
        now = self.clock_s()
        worker.finish(now)
        self._backlog_moved(stage, now)
        for part in parts:
            self._fail(part.request, NoServingInstanceError(self.app, stage.model, "stopping"))

    async def _answers(self, worker: Worker) -> bool:
        """Whether ``worker``, whose call just timed out, answers its health probe: alive, the
        batch was slow (a value-dependent slow path of the model), not a worker gone. An agent
        busy (with that batch, as it is) has answered."""
        try:
            answer = await self.transport.health(worker.address, self.settings.slow_probe_s)
        except Exception:  # no answer (a cancellation is not an Exception: it goes through)
            return False
        return answer is True or isinstance(answer, WorkerBusy)

    def _completed(
        self,
        stage: _Stage,
        worker: Worker,
        parts: list[_Part],
        rows: list[Row],
        reply: WorkerReply,
        started_s: float,
        predicted_ms: float,
        turnaround_ms: float,
    ) -> None:
        now = self.clock_s()
        batch = len(rows)
        stage.in_service_samples -= batch
        stage.drain.served(now, batch)
        self._backlog_moved(stage, now)
        worker.finish(now)
        worker.succeeded()
        worker.answered += 1
        stage.answered_in[worker.instance_id] = stage.rounds
        round_trip_ms = (now - started_s) * 1000.0
        # The calibration loop's figure: what the serving-path profiles measure, and the
        # instance's turnaround before the batch (its occupancy, as a simulated instance's). A
        # worker's first batches are its warm-up (a runtime's first calls, caches, a kept-alive
        # connection opened), not its speed: left out, they made a fresh worker's first drift
        # overshoot (a factor of 3.15 stored where 2.1 held a minute later).
        if worker.answered > self.settings.warmup_batches:
            self.observations.batch_served(
                self.app,
                stage.model,
                worker.instance_type,
                batch,
                round_trip_ms + turnaround_ms,
                now,
            )
        policy = stage.policy
        if policy is not None and worker.instance_type in stage.latency:
            try:
                policy.observe(worker.instance_type, batch, round_trip_ms)
            except Exception:  # the batch's answers still go out (below)
                self._fall_back(stage, policy, "observe")
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
        # The reach at the spec's thresholds is counted whatever gear sent the samples: at the
        # spec's k-th model, the samples the spec's thresholds send it (request.reached).
        spec = self.reach.spec(model)
        position, spec_threshold = spec if spec is not None else (-2, math.inf)
        offset = 0
        for part in parts:
            request = part.request
            samples = part.samples
            if request.future.done():
                offset += len(samples)
                continue
            request.service_ms += round_trip_ms
            request.compute_ms += min(measured_ms, round_trip_ms)
            cascade = request.cascade
            last = part.position + 1 >= len(cascade.models)
            threshold = math.inf if last else cascade.thresholds[part.position]
            forward = []
            seen = below = 0
            reached = request.reached if spec is not None else None
            if reached is None and position == 0:
                reached = request.reached = [0] * len(request.outputs)
            for i in samples:
                confidence = certainty[offset]
                if reached is not None and reached[i] == position:
                    seen += 1
                    if confidence >= spec_threshold:
                        reached[i] = -1
                    else:
                        below += 1
                        reached[i] = position + 1
                if last or confidence >= threshold:
                    request.outputs[i] = predictions[offset]
                    request.certainty[i] = confidence
                    request.models[i] = model
                    request.replies[i] = (reply, offset)
                    request.pending -= 1
                else:
                    forward.append(i)
                offset += 1
            if seen:
                self.reach.add(model, now, seen, below)
            if forward:
                if self._forward_unserved(request, part.position + 1):
                    continue
                if self._forward_refused(request, part.position + 1, len(forward), now):
                    continue
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
        slow_s: float | None = None,
    ) -> None:
        """A call that failed with ``error``. ``slow_s``: the call timed out (after that many
        seconds) while the worker answers its health probe: the worker is alive and the batch
        was slow. The worker leaves matching all the same (it is still busy with that batch),
        but a batch of one query is not sent to another worker: its query is answered 504 (sent
        again, a slow query took each worker out in turn); a batch of several is tried again
        query by query (:attr:`_Part.alone`), so that the slow one is alone when it times out.
        Its probes keep it out while its agent says the batch still runs
        (:meth:`Health.recover`). One back while still busy (a server that does not say so)
        times out on the next batch too: not that batch's fault (``Worker.slow``, until a call
        of it is answered or its agent, busy at a probe, says the batch is over), so it is
        retried as a worker's failure (the caller probes only a worker not flagged)."""
        now = self.clock_s()
        stage.in_service_samples -= batch
        worker.finish(now)
        self._backlog_moved(stage, now)
        if not error.worker_fault:
            self._rejected(stage, worker, parts, error, now)
            return
        if slow_s is not None:
            worker.slow = True
        reason = str(error)
        health = self.health
        lost = health.call_failed(worker, error, now)
        if lost:
            self._place()
        live = [part for part in parts if not part.request.future.done()]
        again = []
        for part in live:
            request = part.request
            part.attempts += 1
            if slow_s is not None and len(parts) == 1:
                self._fail(request, QueryTimeoutError(self.app, slow_s))
            elif health.retries(error, part.attempts):
                if slow_s is not None:
                    part.alone = True
                again.append(part)
            else:
                self._fail(
                    request, QueryFailedError(self.app, reason, part.attempts, transport=True)
                )
        self._send_again(stage.model, again)
        self._fail_stranded(reason)
        if lost:
            failed = sum(1 for part in live if part.request.future.done())
            health.report(
                WorkerLoss(worker.endpoint, reason, len(live), len(live) - failed, failed)
            )
        self._mark_all()

    def _rejected(
        self, stage: _Stage, worker: Worker, parts: list[_Part], error: WorkerCallError, now: float
    ) -> None:
        """The worker answered that the batch's inputs are refused or that the model raised on
        them: the worker is as healthy as before (:meth:`Health.call_failed` says so), and only
        the queries at fault fail. Those are the ones holding the rows the worker named, or the
        batch's one query; when the worker named none in a batch of several, every query of it
        is tried again alone (:attr:`_Part.alone`). The others go back to the front of the
        queue, their attempts as they were (nothing went wrong with them)."""
        self.health.call_failed(worker, error, now)
        at_fault: list[_Part] = []
        innocent: list[_Part] = []
        if error.rows is not None:
            named = set(error.rows)
            offset = 0
            for part in parts:
                end = offset + len(part.samples)
                hit = any(offset <= row < end for row in named)
                (at_fault if hit else innocent).append(part)
                offset = end
        elif len(parts) == 1:
            at_fault = parts
        else:
            for part in parts:
                part.alone = True
            innocent = parts
        for part in at_fault:
            part.attempts += 1
            self._fail(part.request, self._rejection(stage, worker, error, part.attempts))
        again = [part for part in innocent if not part.request.future.done()]
        self._send_again(stage.model, again)
        self._mark_all()

    def _send_again(self, model: str, parts: list[_Part]) -> None:
        """``parts`` of a failed batch back to the front of their model's queue (answered with
        an error when the app no longer serves the model)."""
        if not parts:
            return
        current = self._stages.get(model)
        if current is None:
            for part in parts:
                self._fail(part.request, QueryFailedError(self.app, "model gone", 0))
        else:
            self._requeue(current, parts)

    def _rejection(
        self, stage: _Stage, worker: Worker, error: WorkerCallError, attempts: int
    ) -> ServingError:
        """What a query the model refused or raised on is answered with: 422 when its inputs
        are at fault, else 502. They are when the worker says so (its inputs refused, or the
        model raised on them while other rows of the batch passed, or with an error that names
        an input fault), and when the model raised on them on a worker that has answered
        batches of this model: the model works, this query makes it fail (an answer that
        does not fit the batch is the model's fault, 502, whatever). Only without any
        such evidence (a model that has answered nothing on that worker) is it a 502: the
        same query was a 422 beside good rows and a 502 alone."""
        if error.kind == "input" or (
            error.kind == "model"
            and error.status is not None  # the worker said so (not an answer that does not fit)
            and worker.instance_id in stage.answered_in
        ):
            return QueryRejectedError(self.app, error.detail)
        return QueryFailedError(self.app, str(error), attempts)

    def _fail_stranded(self, reason: str) -> None:
        """Queries queued at a stage that no healthy instance serves any more are answered
        with an error now rather than at their give-up time: 502 for those already tried, 503
        for the others (a refusal at arrival would have said the same)."""
        for stage in self._stages.values():
            if not stage.parts or stage.served:
                continue
            for part in list(stage.parts.values()):
                if part.attempts:
                    error: ServingError = QueryFailedError(
                        self.app, reason, part.attempts, transport=True
                    )
                else:
                    error = NoServingInstanceError(self.app, stage.model, "no healthy worker")
                self._fail(part.request, error)

    # --- answers --------------------------------------------------------------------------------

    def _answer(self, request: _Request, now: float) -> None:
        total_ms = (now - request.arrival_s) * 1000.0
        late = total_ms > self.config.slo_ms
        # A model-less query chose its variant on a predicted latency within its own bound; an
        # answer past that bound says so, whatever the app's SLO (the app's counts keep it).
        bound_ms = request.bound_ms
        late_for_query = late if bound_ms is None else total_ms > bound_ms
        service_ms = min(request.service_ms, total_ms)
        compute_ms = min(request.compute_ms, service_ms)
        api_ms = min(request.api_ms, total_ms - service_ms)
        queue_ms = total_ms - service_ms - api_ms
        split = Split(
            queue_ms, service_ms - compute_ms, compute_ms, api_ms, min(request.lag_ms, queue_ms)
        )
        result = InferResult(
            outputs=tuple(request.outputs),
            models=tuple(request.models),
            certainty=tuple(request.certainty),
            gear=request.cascade.label,
            queue_ms=split.queue_ms,
            service_ms=service_ms,
            total_ms=total_ms,
            late=late_for_query,
            transport_ms=split.transport_ms,
            compute_ms=compute_ms,
            api_ms=api_ms,
            replies=tuple(request.replies),
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
            split=split,
        )
        request.future.set_result(result)

    def _fail(self, request: _Request, error: ServingError) -> None:
        if request.future.done():
            return
        now = self.clock_s()
        latency_ms = (now - request.arrival_s) * 1000.0
        outcome = outcome_of(error)
        if outcome is None:  # the client's mistake: counted apart, not offered
            self.observations.rejected(self.app, now)
        else:
            self.observations.ended_in_error(self.app, now, outcome, latency_ms)
        request.future.set_exception(error)

    def _sweep(self) -> None:
        """Answer the requests past their give-up time with a timeout error (the oldest
        first: the sweep stops at the first one still in time), and those queued past their
        client's own deadline: they leave their queue, costing no worker call. A request whose
        batch is in flight at its deadline is left to that call (its answer is on its way); it
        is looked at again at the next sweep (a cascade may queue it at its next model)."""
        self._sweeper = None
        now = self.clock_s()
        give_up_s = self.settings.give_up_after_s(self.config.slo_ms)
        cutoff = now - give_up_s
        expired = []
        for request in self._open:
            if request.arrival_s > cutoff:
                break
            expired.append(request)
        for request in expired:
            self._fail(request, QueryTimeoutError(self.app, give_up_s))
        deadlines = self._deadlines
        in_flight = []
        # Past their deadline, and answered ones at the top (nothing to aim the next sweep at).
        while deadlines and (deadlines[0][0] <= now or deadlines[0][2].future.done()):
            entry = heapq.heappop(deadlines)
            request = entry[2]
            if request.future.done():
                continue
            if not request.queued:
                in_flight.append(entry)
                continue
            self._leave_queues(request)
            self._fail(request, QueryTimeoutError(self.app, request.deadline_s - request.arrival_s))
        ahead = deadlines[0][0] if deadlines else None  # the next deadline, after now
        for entry in in_flight:
            heapq.heappush(deadlines, entry)
        if len(deadlines) > 2 * len(self._open) + 64:
            # Mostly answered requests, held until their deadline (a minute's, at 2,000 q/s,
            # would hold 120,000 of them and their inputs): dropped.
            deadlines[:] = [entry for entry in deadlines if not entry[2].future.done()]
            heapq.heapify(deadlines)
        if self._open and not self._closed:
            self.sweep_delay_s = sweep_delay_s(now, ahead)
            self._sweeper = asyncio.get_running_loop().call_later(self.sweep_delay_s, self._sweep)
        else:
            deadlines.clear()  # every request is answered

    def _on_done(self, request: _Request, future: asyncio.Future[InferResult]) -> None:
        """Whatever ended the request (answer, error, timeout, the caller going away): its
        queued queries leave their queues and its timer stops. A request cancelled (its client
        gone: the API cancels the call) is recorded as timed out, a miss, and never reaches a
        worker once it has left its queue."""
        self._open.pop(request, None)
        if future.cancelled():
            now = self.clock_s()
            latency_ms = (now - request.arrival_s) * 1000.0
            self.observations.ended_in_error(self.app, now, Outcome.TIMED_OUT, latency_ms)
        self._leave_queues(request)

    def _leave_queues(self, request: _Request) -> None:
        """Take ``request``'s queued queries out of their queues, with their samples' counts."""
        for query_id, stage in request.queued.items():
            if stage.queue.take(query_id) is not None:
                part = stage.parts.pop(query_id)
                stage.queued_samples -= len(part.samples)
                stage.backlog.remove(len(part.samples))
                self._backlog_moved(stage, self.clock_s())
                if not stage.queue:
                    stage.drain.emptied()
        request.queued.clear()

    # --- model-less queries ---------------------------------------------------------------------

    def variant_options(self, samples: int = 1) -> list[tuple[VariantOption, Cascade]]:
        """The variants the app offers now: its cascade, the gear in force and each of its
        models alone, with their predicted latency (as admission predicts it), accuracy on the
        validation records, cost per query and INFaaS state."""
        return self.variants.options(self.current_gear(), samples, self.clock_s())

    def choose_variant(self, requirements: Requirements, samples: int) -> Cascade:
        """The cascade of the cheapest variant that meets ``requirements``; raises
        :class:`~controlplane.errors.RequirementsUnmetError` with the closest offer."""
        now = self.clock_s()
        self._model_less_s = now
        return self.variants.choose(requirements, samples, self.current_gear(), now)

    # --- health ---------------------------------------------------------------------------------

    async def probe(self, timeout_s: float = 0.5) -> None:
        """Probe the unhealthy workers whose backoff is over; those that answer ``ok`` serve
        again. Also probes the healthy workers idle for ``idle_probe_s`` and re-reads the
        interference verdicts (their window moves on)."""
        now = self.clock_s()
        self._interfered = {
            key for key in self._interfered if self.tracker.interfered(key[0], key[1], now)
        }
        workers = self.placement.workers
        lost = await self.health.probe_idle(workers, now)
        if lost:
            self._place()
            self._fail_stranded("health probe failed while idle")
            for worker in lost:
                self.health.report(
                    WorkerLoss(worker.endpoint, worker.last_error, 0, 0, 0), idle=True
                )
            self._mark_all()
        due = self.health.due(workers, now)
        if not due:
            return
        if await self.health.recover(due, workers, timeout_s):
            self._place()
        self._mark_all()

    # --- status and shutdown --------------------------------------------------------------------

    def status(self) -> AppStatus:
        now = self.clock_s()
        gear = self.current_gear()
        stages = []
        reach = self.reach.reach(now)
        for model in self.config.models:
            stage = self._stages[model]
            cap = batch_cap(self.config, model, gear)
            # At what one call carries: one query under a policy that sends each alone.
            capacity = stage.capacity_sps(1, stage.call_cap(cap, now))
            overload = self.tracker.overload(
                (self.app, model),
                now,
                stage.queued_samples + stage.in_service_samples,
                capacity,
                self.config.slo_ms,
                refused_share_allowed=1.0 - self.config.slo_percentile / 100.0,
            )
            overloaded = overload.overloaded
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
                    shares=dict(stage.shares),
                    lp_utilisation=stage.lp_utilisation,
                    overload=overload,
                    reach=reach[model][0] if model in reach else None,
                    reach_samples=reach[model][1] if model in reach else 0,
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
            for w in sorted(self.placement.workers.values(), key=lambda w: w.instance_id)
        )
        return AppStatus(
            app=self.app,
            gear=gear.cascade.label,
            slo_ms=self.config.slo_ms,
            workers=workers,
            stages=tuple(stages),
            in_flight_requests=len(self._open),
        )

    def _held(self, stage: _Stage, now: float, gear: ServingGear) -> bool:
        """Whether the gear's batch trigger holds ``stage`` back (CascadeServe's minimum queue
        length, the rule the planner simulated): fewer queries queued than its minimum and the
        oldest queued for less than the guard. The stage's timer then runs a round when the
        guard expires, so a lone query at low load waits at most the guard."""
        minimum, wait_s = batch_trigger(gear, stage.model)
        if len(stage.queue) >= minimum:
            return False
        due = stage.queue[0].enqueued_s + wait_s  # the front is the oldest (requeues go there)
        if now >= due:
            return False
        if stage.wake is None or stage.wake_s != due:
            if stage.wake is not None:
                stage.wake.cancel()
            loop = asyncio.get_running_loop()
            stage.wake = loop.call_at(loop.time() + (due - now), self._wake, stage)
            stage.wake_s = due
        return True

    def _wake(self, stage: _Stage) -> None:
        stage.wake, stage.wake_s = None, math.inf
        self._mark(stage)

    def busy(self) -> bool:
        """Whether a query is queued or in service here."""
        return bool(self._tasks) or any(stage.parts for stage in self._stages.values())

    async def retire(self, within_s: float, poll_s: float = 0.05) -> None:
        """Close once the queries already here are answered, or ``within_s`` from now at the
        latest (:meth:`close` answers the rest with an error): for a dispatcher that no new
        query reaches any more (a rollout's route that went)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within_s
        while self.busy() and not self._closed and loop.time() < end:
            await asyncio.sleep(poll_s)
        await self.close()

    async def close(self) -> None:
        """Stop: queued and in-service queries are answered with an error."""
        self._closed = True
        for stage in self._stages.values():
            if stage.wake is not None:
                stage.wake.cancel()
                stage.wake, stage.wake_s = None, math.inf
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
