"""A model's stage in an app's dispatcher: its central queue, the workers that serve it as its
policy sees them, their latency tables, the policy itself, and what it can serve.

:mod:`~controlplane.serving.placement` fills in who serves a stage (``slots``, ``latency``,
``policy``); :mod:`~controlplane.serving.dispatcher` moves queries through it (``queue``, the
sample counts, ``dirty``); :mod:`~controlplane.serving.variants` and admission read its capacity
(:meth:`ServingStage.capacity_sps`, cached in ``capacity``, at the queries its policy sends a
call, :meth:`ServingStage.call_cap`); the transport encodes its batches with its ``io``
(:class:`~controlplane.serving.modelio.ModelIO`).
"""

from __future__ import annotations

import collections
import math

from controlplane.serving.modelio import ModelIO
from controlplane.serving.workers import Worker
from estimator.profiles import LatencyProfile
from matching.admission import Backlog, batch_samples, queue_wait_ms
from matching.policy import DispatchPolicy, queries_per_call
from matching.queues import CentralQueue

__all__ = ["DRAIN_WINDOW_S", "DrainMeter", "LatencyTable", "ServingStage", "Slot"]

# The span over which a stage's drain rate is measured, and for which its queue must have stayed
# non-empty for the measure to stand: hundreds of batches at the rates where the serving process
# rather than its workers sets the pace, and short against the seconds such an overload lasts.
DRAIN_WINDOW_S = 0.5


class LatencyTable:
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


class Slot:
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


class DrainMeter:
    """The samples per second a stage's answers came back while its queue never emptied: the
    rate its queue really drains at, whoever sets it. The profiles say how fast the workers
    serve; when the serving process itself falls behind (its event loop saturated, so each
    answer is read and the next batch sent late) the queue drains slower than they say, and a
    wait judged on them alone admitted queries into a queue of seconds (docs/serving.md,
    "Overload without collapse").

    >>> meter = DrainMeter(window_s=0.5)
    >>> meter.queued(10.0)
    >>> for i in range(1, 11):
    ...     meter.served(10.0 + 0.05 * i, 4)
    >>> meter.rate_sps(10.5)
    80.0
    >>> meter.emptied(); meter.rate_sps(10.5) is None
    True
    """

    __slots__ = ("_served", "_total", "backlogged_since_s", "window_s")

    def __init__(self, window_s: float = DRAIN_WINDOW_S) -> None:
        self.window_s = window_s
        self._served: collections.deque[tuple[float, int]] = collections.deque()
        self._total = 0
        # Since when the queue has held a query without a break; None while it is empty.
        self.backlogged_since_s: float | None = None

    def queued(self, now_s: float) -> None:
        """A query joined the queue."""
        if self.backlogged_since_s is None:
            self.backlogged_since_s = now_s

    def emptied(self) -> None:
        """The queue was seen empty."""
        self.backlogged_since_s = None

    def served(self, now_s: float, samples: int) -> None:
        """A batch of ``samples`` samples was answered."""
        self._served.append((now_s, samples))
        self._total += samples
        self._forget(now_s)

    def rate_sps(self, now_s: float) -> float | None:
        """Samples answered per second over the last window, when the queue held queries
        throughout it; None otherwise (the rate then says how much work came, not how fast
        it could be done)."""
        since = self.backlogged_since_s
        if since is None or now_s - since < self.window_s:
            return None
        self._forget(now_s)
        return self._total / self.window_s

    def _forget(self, now_s: float) -> None:
        served = self._served
        start = now_s - self.window_s
        while served and served[0][0] <= start:
            self._total -= served.popleft()[1]


class ServingStage:
    """One model's stage (see the module docstring)."""

    __slots__ = (
        "backlog",
        "capacity",
        "dirty",
        "drain",
        "in_service_samples",
        "io",
        "latency",
        "lp_utilisation",
        "model",
        "policy",
        "policy_key",
        "policy_name",
        "queue",
        "queued_samples",
        "shares",
        "slots",
    )

    def __init__(self, model: str, io: ModelIO | None = None) -> None:
        self.model = model
        self.io = io if io is not None else ModelIO(model)  # what its batches are on the wire
        self.queue = CentralQueue()
        self.slots: list[Slot] = []
        self.latency: dict[str, LatencyTable] = {}
        self.policy: DispatchPolicy | None = None
        self.policy_key: tuple[str, ...] = ()
        self.policy_name = ""
        self.queued_samples = 0
        self.in_service_samples = 0
        self.backlog = Backlog()  # the queued parts by size, for admission control
        self.dirty = False
        self.drain = DrainMeter()  # how fast its queue really drains, for admission
        # (samples, batch cap) -> (capacity in samples/s, fastest service ms): cleared whenever
        # the stage's instances or their health change.
        self.capacity: dict[tuple[int, int], tuple[float, float]] = {}
        # A cascade's co-located placement (SP3): each hosting instance's share of the model's
        # queries by instance id, and the load balancer's u (empty and None otherwise).
        self.shares: dict[str, float] = {}
        self.lp_utilisation: float | None = None

    @property
    def served(self) -> bool:
        """Whether a healthy instance serves the stage (what a query reaching it needs)."""
        return any(slot.worker.healthy for slot in self.slots)

    def call_cap(self, batch_cap: int, now_s: float) -> int:
        """The queries one call to an instance carries at most under the stage's batch cap
        ``batch_cap``, as its policy sends them (:func:`matching.policy.queries_per_call`: the cap
        where it batches, 1 where each query runs alone, as under Kairos): what its capacity
        and wait are counted at (the simulator's admission counts the same)."""
        policy = self.policy
        return batch_cap if policy is None else queries_per_call(policy, now_s, batch_cap)

    def rates(self, samples: int, cap: int) -> tuple[float, float]:
        """(:meth:`capacity_sps`, the fastest type's service ms) for queries of ``samples``
        samples at batch cap ``cap``, cached in ``capacity``."""
        key = (samples, cap)
        known = self.capacity.get(key)
        if known is None:
            fastest = min((t.ms(samples) for t in self.latency.values()), default=math.inf)
            known = self.capacity[key] = (self.capacity_sps(samples, cap), fastest)
        return known

    def wait_ms(self, cap: int, now_s: float) -> float:
        """What a query joining the queue now waits (:mod:`matching.admission`): until a
        healthy instance is free (its call's predicted end), then the queued parts, each size
        at the stage's capacity for it (infinite with no healthy instance); and at least the
        queued samples at the rate the queue was measured to drain (:class:`DrainMeter`),
        where that is known and slower; where nothing drained in the whole window, the wait
        the instances and the queue give plus that window."""
        free_s = math.inf
        for slot in self.slots:
            worker = slot.worker
            if worker.healthy:
                free_s = min(
                    free_s, max(worker.busy_until_s - now_s, 0.0) if worker.running else 0.0
                )
        wait = queue_wait_ms(free_s, self.backlog, lambda size: self.rates(size, cap)[0])
        drained = self.drain.rate_sps(now_s)
        if drained is None or self.queued_samples <= 0:
            return wait
        if drained <= 0:
            # Nothing answered for a whole window while queries waited: the stage stalls (a
            # batch far slower than its profile, a worker hung short of its call's timeout) for
            # how long nobody knows, the window at least. It was an infinite wait, refused as
            # full queues with "retry after 60 s": a stall of a second or two sent the clients
            # that honour Retry-After away for a minute.
            return wait + 1000.0 * self.drain.window_s
        return max(wait, 1000.0 * self.queued_samples / drained)

    def capacity_sps(self, samples: int, cap: int) -> float:
        """Samples per second the stage's healthy instances serve at batches of ``cap`` queries
        of ``samples`` samples (within each profile); ``cap`` is what a call carries
        (:meth:`call_cap`), not the batch cap where the policy sends each query alone."""
        total = 0.0
        for slot in self.slots:
            if not slot.worker.healthy:
                continue
            latency = self.latency[slot.instance_type]
            k = batch_samples(samples, cap, latency.max_batch_size)
            ms = latency.ms(k)
            total += 1000.0 * k / ms if ms > 0 else math.inf
        return total
