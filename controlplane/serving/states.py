"""INFaaS model states: each (model, instance) is *active*, *overloaded* or *interfered*, and a
variant (a model on an instance type) loaded nowhere is *inactive*.

INFaaS (Romero et al., USENIX ATC'21, section 4.2) keeps, for every model variant on every
worker, a state that routing and scaling read: "variant instances enter the Overloaded state
when they serve at their peak throughput", and are *interfered* when "not overloaded but still
experiencing higher inference latencies than the profiled values" (another tenant, a noisy
neighbour, a throttled CPU). This module owns the two verdicts as pure functions and a small
tracker of what they are judged on (measured latencies, arrivals, refusals):

- **Overloaded** (:func:`is_overloaded`, :meth:`StateTracker.overload`): the model cannot keep
  up with its load. The serving loop keeps one central queue per model (InferLine's centralized
  queue), and the instances of a model serve it together at their profiled rates (its capacity
  C, samples/s), so the verdict is the model's and shared by its instances (a central queue has
  no per-instance backlog or arrival rate to tell them apart). Over the last ``window_s``
  seconds, the model is overloaded when any of

  1. *backlog*: draining its backlog B (queued plus in-service samples) takes longer than the
     SLO, ``1000 B / C > slo_ms`` (no capacity: as soon as anything waits), at every reading
     over the last ``hold_s`` (2 s, INFaaS's monitoring period: the least B over it, at the
     current C, :meth:`StateTracker.held_backlog`). The dispatcher gives the tracker a reading
     each time B changes. Read at one moment, a Poisson queue's burst drained in more than the
     SLO now and then at 37-55% busy, and the INFaaS scaler replicated a model that kept up;
  2. *refused*: admission control (:mod:`controlplane.serving.admission`) refused (429) a query
     on it (a stage admission judged the query on, one every sample reaches:
     :func:`~controlplane.serving.admission.judged_positions`), judged at a capacity at least
     C: its queue could not serve the query within the SLO, and more of the window's samples
     refused than the SLO lets it miss (1 - its percentile: 1% for a P99; any refusal where
     the caller gives no share; where the window's share is under one sample, one refusal
     alone is not, two are). A refusal judged at a smaller capacity (before an instance
     joined) says nothing of the larger one and does not count. Any refusal counted until
     2026-12-07: a Poisson queue at 59% busy had a query refused now and then (6 of 4,677 in
     7 min), and the INFaaS scaler replicated the model on each;
  3. *rate*: its arrivals, admitted and refused, in samples per second over the window (or
     since the first of them, when the load began within it, over at least ``rate_min_s``,
     2 s: INFaaS's monitoring period), reach C: it serves at its peak throughput (INFaaS's
     wording), and its queue grows.

  The first seldom fires under admission control with one-sample queries: admission keeps the
  backlog drainable within the SLO less the query's own service. The other two say what the
  backlog cannot: the queue is held at the SLO only by turning load away, or the load is at
  least what the instances serve. Admission and the model-less variant choice judge the
  backlog of the moment (:func:`is_overloaded`): they place the query at hand, now.
- **Interfered** (:func:`is_interfered`): over the last ``window_s`` seconds, the median of
  measured service time / profiled mean service time (same batch size, same instance type)
  of the model on the instance exceeds ``1 + margin``, given at least ``min_samples``
  measurements. A profiled time below ``floor_ms`` (1 ms) counts as ``floor_ms``: under a
  millisecond, a batch's time is mostly the timer's resolution and the interpreter's overhead
  (the demo family's tiny model is profiled at 0.03 ms a sample), and a ratio of two such
  numbers says nothing of interference. The window is in time, so an instance the dispatcher
  stopped sending work to (it avoids interfered ones) comes back as active once its old
  measurements age out, and is tried again.

- **Inactive** (:func:`variant_states`, :func:`loading_latency_s`): INFaaS's variants start
  *inactive*, loaded on no worker, and cost their *loading latency* before they serve (section
  4, Figure 4). Here a variant is a model of the app on an instance type, and it is inactive
  when no running instance of that type serves the model. Every worker agent loads the app's
  whole family when it starts, so loading a variant is starting an instance of its type: its
  loading latency is the type's start-up time
  (:func:`controlplane.policies.tuner.default_boot_s`: 30 s for CPU types, 60 s for GPU
  types); a loaded (active, overloaded or interfered) variant serves without it. The INFaaS
  autoscaler (:mod:`controlplane.policies.infaas_scaling`) weighs it in the cost of a scaling
  action and counts a new instance's capacity only once it has loaded.

An instance is interfered before it is overloaded (:func:`model_state`): the remedy for
interference is elsewhere (another instance), for overload more capacity or a faster variant.
The dispatcher leaves interfered instances out of matching while the model has an active one and
feeds the tracker its arrivals (each sample a stage queues), its backlog as it changes and
admission's refusals; the model-less variant choice (:mod:`controlplane.serving.variants`)
judges the backlog criterion for the query at hand, on the backlog of the moment. The INFaaS
autoscaler (``scaling: infaas`` in the app spec, :mod:`controlplane.loops.infaas_scaler`) reads
all four from the loop's status every tick; the dashboard reads them through
``GET /v1/apps/{app}/serving`` and ``/metrics``.

>>> is_overloaded(queued_samples=300, capacity_sps=1000.0, slo_ms=200.0)
True
>>> is_overloaded(0, 10.0, 1000.0, refused=3), is_overloaded(0, 10.0, 1000.0, arrival_sps=12.0)
(True, True)
>>> is_overloaded(9, 10.0, 1000.0, refused=0, arrival_sps=8.0)
False
>>> is_interfered([1.1, 1.9, 2.0, 2.1, 1.7], margin=0.5, min_samples=5)
True
>>> model_state(overloaded=True, interfered=False)
'overloaded'
>>> variant_states({"i-1": "overloaded", "i-2": "active"}, {"i-1": "c", "i-2": "c"}, ["c", "g"])
{'c': 'overloaded', 'g': 'inactive'}
>>> loading_latency_s("inactive", boot_s=60.0), loading_latency_s("active", boot_s=60.0)
(60.0, 0.0)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_FLOOR_MS",
    "DEFAULT_HOLD_S",
    "DEFAULT_MARGIN",
    "DEFAULT_MIN_SAMPLES",
    "DEFAULT_RATE_MIN_S",
    "DEFAULT_WINDOW_S",
    "MONITORING_PERIOD_S",
    "ModelState",
    "Overload",
    "StateTracker",
    "backlog_ms",
    "is_interfered",
    "is_overloaded",
    "loading_latency_s",
    "model_state",
    "variant_states",
]

ModelState = Literal["inactive", "active", "overloaded", "interfered"]

# Measured latency 50% above the profile: beyond the spread of a profile's own samples (the
# family's p99 is within about 30% of its mean on an idle machine), so noise is not interference.
DEFAULT_MARGIN = 0.5
DEFAULT_WINDOW_S = 10.0
DEFAULT_MIN_SAMPLES = 5
DEFAULT_FLOOR_MS = 1.0
# INFaaS's monitoring daemons report every 2 s (section 5): its monitoring period.
MONITORING_PERIOD_S = 2.0
# The shortest time an arrival rate is measured over: a load that began less than a window ago
# is judged over its own span, a monitoring period at least.
DEFAULT_RATE_MIN_S = MONITORING_PERIOD_S
# How long the backlog must stay over the SLO for the verdict: a monitoring period. Read at one
# moment, a Poisson queue's bursts drain in more than the SLO now and then at 40-55% busy.
DEFAULT_HOLD_S = MONITORING_PERIOD_S
# Measurements kept per (model, instance), whatever the window: a bound on memory.
_MAX_KEPT = 256
# Arrivals and refusals are counted in buckets of a window's 1/_BUCKETS: memory bounded by the
# window whatever the rate.
_BUCKETS = 20


def backlog_ms(queued_samples: float, capacity_sps: float) -> float:
    """The time a backlog of ``queued_samples`` takes to drain at ``capacity_sps`` samples per
    second (0 when nothing waits, infinite when something waits and nothing serves)."""
    if queued_samples <= 0:
        return 0.0
    if capacity_sps <= 0:
        return math.inf
    return 1000.0 * queued_samples / capacity_sps


def is_overloaded(
    queued_samples: float,
    capacity_sps: float,
    slo_ms: float,
    *,
    refused: int = 0,
    arrival_sps: float = 0.0,
) -> bool:
    """Whether a model cannot keep up with its load (the module docstring's three criteria):
    its backlog of ``queued_samples`` takes longer than ``slo_ms`` to drain at ``capacity_sps``
    samples per second, or admission ``refused`` queries of it within the window (any: the
    share of refusals the SLO allows is :class:`Overload`'s, which the states are judged by), or
    its arrivals (``arrival_sps``, admitted and refused) reach its capacity."""
    if backlog_ms(queued_samples, capacity_sps) > slo_ms:
        return True
    if refused > 0:
        return True
    return arrival_sps > 0 and arrival_sps >= capacity_sps


@dataclass(frozen=True, slots=True)
class Overload:
    """What the overload verdict of a model was judged on (:meth:`StateTracker.overload`): the
    backlog's drain time (ms) now and the least it was over the last ``hold_s`` (the one judged)
    against the SLO, the queries refused within the window at a capacity at least the current
    one, and the arrival rate (samples/s, admitted and refused, over the window) against the
    capacity (samples/s)."""

    backlog_ms: float
    slo_ms: float
    refused: int
    arrival_sps: float
    capacity_sps: float
    window_s: float
    held_backlog_ms: float = 0.0
    hold_s: float = DEFAULT_HOLD_S
    # The refusals' samples and the samples that arrived (admitted and refused) over the same
    # window, and the share of them the app's SLO lets it miss (1 - its percentile: 1% for a
    # P99); 0: any refusal is an overload (a sender that does not say).
    refused_samples: float = 0.0
    arrived_samples: float = 0.0
    refused_share_allowed: float = 0.0

    @property
    def refused_over_allowance(self) -> bool:
        """Whether the refusals say overload: any, where no share is allowed; else more than the
        allowed share of the samples that arrived (a 429 now and then of a Poisson queue at
        60% busy is the queue's noise, which the SLO's percentile allows for, not a model
        that cannot keep up)."""
        if self.refused <= 0:
            return False
        if self.refused_share_allowed <= 0:
            return True
        allowed = self.refused_share_allowed * self.arrived_samples
        if self.refused_samples <= allowed:
            return False
        # A window the share allows less than one sample of (under 100 samples at a P99): one
        # refusal is what the allowed rate gives now and then (a model under 10 samples/s was
        # replicated on each); two say more.
        return allowed >= 1.0 or self.refused >= 2

    @property
    def overloaded(self) -> bool:
        return (
            self.held_backlog_ms > self.slo_ms
            or self.refused_over_allowance
            or (self.arrival_sps > 0 and self.arrival_sps >= self.capacity_sps)
        )

    def reasons(self) -> list[str]:
        """One phrase, with its numbers, per criterion that holds (empty: not overloaded)."""
        out = []
        if self.held_backlog_ms > self.slo_ms:
            out.append(
                f"backlog drains in {self.held_backlog_ms:.4g} ms or more > SLO"
                f" {self.slo_ms:g} ms for the last {self.hold_s:g} s"
            )
        if self.refused_over_allowance:
            said = f"{self.refused} queries refused (429) in the last {self.window_s:g} s"
            if self.refused_share_allowed > 0:
                share = self.refused_samples / max(self.arrived_samples, self.refused_samples)
                said += (
                    f", {share:.2%} of the samples that arrived > the"
                    f" {self.refused_share_allowed:.2%} the SLO allows"
                )
            out.append(said)
        if self.arrival_sps > 0 and self.arrival_sps >= self.capacity_sps:
            out.append(
                f"arrivals {self.arrival_sps:.3g} samples/s >= capacity"
                f" {self.capacity_sps:.3g} samples/s"
            )
        return out

    def numbers(self) -> dict[str, float | None]:
        """The numbers, as a plain mapping (a decision's, the scaler's; an infinite drain time,
        nothing serving, is None)."""
        return {
            "backlog_ms": _finite(self.backlog_ms),
            "held_backlog_ms": _finite(self.held_backlog_ms),
            "hold_s": self.hold_s,
            "slo_ms": self.slo_ms,
            "refused": float(self.refused),
            "arrival_sps": self.arrival_sps,
            "capacity_sps": self.capacity_sps,
            "window_s": self.window_s,
            "refused_samples": self.refused_samples,
            "arrived_samples": self.arrived_samples,
            "refused_share_allowed": self.refused_share_allowed,
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def is_interfered(ratios: Sequence[float], margin: float, min_samples: int) -> bool:
    """Whether the median of ``ratios`` (measured / profiled service time) exceeds ``1 +
    margin``, given at least ``min_samples`` of them."""
    if len(ratios) < max(min_samples, 1):
        return False
    return statistics.median(ratios) > 1.0 + margin


def model_state(*, overloaded: bool, interfered: bool) -> ModelState:
    """The INFaaS state from the two verdicts (interference first)."""
    if interfered:
        return "interfered"
    return "overloaded" if overloaded else "active"


def variant_states(
    states: Mapping[str, ModelState],
    instance_types: Mapping[str, str],
    types: Iterable[str],
) -> dict[str, ModelState]:
    """The state of a model's variant on each of ``types``, from the model's state on each
    instance (``states``, by instance id) and the instances' types: *inactive* where no instance
    of the type serves the model; else *interfered* when every instance of the type is, else
    *overloaded* when one is (the verdict is the model's queue's: shared), else *active*."""
    by_type: dict[str, list[ModelState]] = {}
    for instance, state in states.items():
        found = instance_types.get(instance)
        if found is not None:
            by_type.setdefault(found, []).append(state)
    out: dict[str, ModelState] = {}
    for name in types:
        seen = by_type.get(name, [])
        if not seen or all(s == "inactive" for s in seen):
            out[name] = "inactive"
        elif all(s == "interfered" for s in seen):
            out[name] = "interfered"
        elif "overloaded" in seen:
            out[name] = "overloaded"
        else:
            out[name] = "active"
    return out


def loading_latency_s(state: ModelState, boot_s: float) -> float:
    """The time before the variant serves a query sent to it: an inactive variant's loading
    latency (the start-up of an instance of its type, ``boot_s``: every worker loads the app's
    whole family as it starts); 0 for a loaded one."""
    return float(boot_s) if state == "inactive" else 0.0


@dataclass(frozen=True, slots=True)
class _Sample:
    at_s: float
    ratio: float


@dataclass(slots=True)
class _Reading:
    """A backlog reading (samples) from ``at_s`` until the next one (``until_s``)."""

    at_s: float
    samples: float
    until_s: float = math.inf


@dataclass(slots=True)
class _Backlog:
    """A queue's backlog readings that can still be the least over the last ``hold_s``: the
    later of two readings has the larger backlog (a later, smaller one makes an earlier one
    irrelevant to every window it is in), so the first is the least."""

    first_s: float
    kept: deque[_Reading]


@dataclass(slots=True)
class _Count:
    """Arrivals of a model in one bucket (samples), or refusals (queries) at one capacity."""

    bucket: int
    amount: float
    capacity_sps: float = 0.0


class StateTracker:
    """What the states are judged on, over a time window: measured-over-profiled service-time
    ratios per (model, instance) (interference), and per model's queue its arrivals and
    admission's refusals (overload, with the backlog and capacity the caller gives).

    ``instance`` is any hashable key (the serving loop uses the instance's id). Not
    thread-safe: the serving loop's event loop owns it.
    """

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        margin: float = DEFAULT_MARGIN,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        floor_ms: float = DEFAULT_FLOOR_MS,
        rate_min_s: float = DEFAULT_RATE_MIN_S,
        hold_s: float = DEFAULT_HOLD_S,
    ) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        self.window_s = window_s
        self.margin = margin
        self.min_samples = min_samples
        self.floor_ms = floor_ms
        self.rate_min_s = min(rate_min_s, window_s)
        if not (math.isfinite(hold_s) and hold_s >= 0):
            raise ValueError(f"hold_s must be >= 0, got {hold_s!r}")
        self.hold_s = min(hold_s, window_s)
        self._backlogs: dict[Hashable, _Backlog] = {}
        self._samples: dict[tuple[str, Hashable], deque[_Sample]] = {}
        self._bucket_s = window_s / _BUCKETS
        self._arrivals: dict[Hashable, deque[_Count]] = {}
        self._refusals: dict[Hashable, deque[_Count]] = {}
        self._refused_samples: dict[Hashable, deque[_Count]] = {}

    def observe(
        self, model: str, instance: Hashable, now_s: float, measured_ms: float, profiled_ms: float
    ) -> None:
        """One batch of ``model`` took ``measured_ms`` on ``instance`` where its profile says
        ``profiled_ms`` (ignored when either is not a positive number)."""
        if not (profiled_ms > 0 and math.isfinite(profiled_ms) and math.isfinite(measured_ms)):
            return
        key = (model, instance)
        kept = self._samples.get(key)
        if kept is None:
            kept = self._samples[key] = deque(maxlen=_MAX_KEPT)
        kept.append(_Sample(now_s, max(measured_ms, 0.0) / max(profiled_ms, self.floor_ms)))

    def slow(self, measured_ms: float, profiled_ms: float) -> bool:
        """Whether one measurement alone is over the margin (worth re-reading the verdict)."""
        return measured_ms > (1.0 + self.margin) * max(profiled_ms, self.floor_ms)

    def ratios(self, model: str, instance: Hashable, now_s: float) -> list[float]:
        """The ratios measured in the last ``window_s`` (older ones are dropped)."""
        kept = self._samples.get((model, instance))
        if kept is None:
            return []
        cutoff = now_s - self.window_s
        while kept and kept[0].at_s < cutoff:
            kept.popleft()
        return [s.ratio for s in kept]

    def interfered(self, model: str, instance: Hashable, now_s: float) -> bool:
        return is_interfered(self.ratios(model, instance, now_s), self.margin, self.min_samples)

    # --- overload ---------------------------------------------------------------------------------

    def _bucket(self, now_s: float) -> int:
        return math.floor(now_s / self._bucket_s)

    def _add(
        self,
        kept: dict[Hashable, deque[_Count]],
        queue: Hashable,
        now_s: float,
        amount: float,
        cap: float,
    ) -> None:
        counts = kept.get(queue)
        if counts is None:
            counts = kept[queue] = deque()
        bucket = self._bucket(now_s)
        last = counts[-1] if counts else None
        if last is not None and last.bucket == bucket and last.capacity_sps == cap:
            last.amount += amount
        else:
            counts.append(_Count(bucket, amount, cap))
        self._trim(counts, now_s)

    def _trim(self, counts: deque[_Count], now_s: float) -> float:
        """Drop the buckets wholly before the last ``window_s``; the time the ones kept span
        (from the first one's start to now: the window and at most one bucket more)."""
        first = self._bucket(now_s - self.window_s)
        while counts and counts[0].bucket < first:
            counts.popleft()
        return max(now_s - first * self._bucket_s, self.window_s)

    def arrived(self, queue: Hashable, now_s: float, samples: float) -> None:
        """``samples`` samples of an admitted query reached a model's ``queue`` (any hashable
        key: the serving loop, one tracker for every app, uses (app, model))."""
        if samples > 0:
            self._add(self._arrivals, queue, now_s, float(samples), 0.0)

    def refused(self, queue: Hashable, now_s: float, samples: float, capacity_sps: float) -> None:
        """Admission refused a query that would have brought ``samples`` samples to ``queue``,
        judging its capacity ``capacity_sps`` (samples/s) too small: an arrival, and a sign of
        overload while the capacity is no larger."""
        if samples <= 0:
            return
        self._add(self._arrivals, queue, now_s, float(samples), 0.0)
        self._add(self._refusals, queue, now_s, 1.0, float(capacity_sps))
        self._add(self._refused_samples, queue, now_s, float(samples), float(capacity_sps))

    def arrival_sps(self, queue: Hashable, now_s: float) -> float:
        """The samples that arrived at ``queue`` (admitted and refused) over the last window,
        per second; over the time since the first of them when it is more recent (a load that
        just began), but at least ``rate_min_s``."""
        counts = self._arrivals.get(queue)
        if not counts:
            return 0.0
        span_s = self._trim(counts, now_s)
        if not counts:
            return 0.0
        since_s = now_s - counts[0].bucket * self._bucket_s
        return sum(c.amount for c in counts) / min(span_s, max(since_s, self.rate_min_s))

    def refusals(self, queue: Hashable, now_s: float, capacity_sps: float) -> int:
        """The queries for ``queue`` refused over the last window at a capacity at least
        ``capacity_sps`` (a refusal before the capacity grew does not say the new one is
        short)."""
        counts = self._refusals.get(queue)
        if not counts:
            return 0
        self._trim(counts, now_s)
        limit = capacity_sps * (1.0 - 1e-9)
        return round(sum(c.amount for c in counts if c.capacity_sps >= limit))

    def backlog(self, queue: Hashable, now_s: float, samples: float) -> None:
        """A reading of ``queue``'s backlog (queued plus in-service samples), taken as it
        changed: it holds until the next reading."""
        found = self._backlogs.get(queue)
        if found is None:
            found = self._backlogs[queue] = _Backlog(now_s, deque())
        kept = found.kept
        if kept:
            kept[-1].until_s = now_s
        while kept and kept[-1].samples >= samples:
            kept.pop()
        kept.append(_Reading(now_s, float(samples)))
        self._trim_backlog(kept, now_s)

    def _trim_backlog(self, kept: deque[_Reading], now_s: float) -> None:
        cutoff = now_s - self.hold_s
        while len(kept) > 1 and kept[0].until_s <= cutoff:
            kept.popleft()

    def held_backlog(self, queue: Hashable, now_s: float) -> float:
        """The least backlog (samples) of ``queue`` over the last ``hold_s``: what stayed queued
        at every reading. 0 when its first reading is more recent (nothing was queued before)."""
        found = self._backlogs.get(queue)
        if found is None or now_s - found.first_s < self.hold_s:
            return 0.0
        self._trim_backlog(found.kept, now_s)
        return found.kept[0].samples

    def overload(
        self,
        queue: Hashable,
        now_s: float,
        backlog_samples: float,
        capacity_sps: float,
        slo_ms: float,
        refused_share_allowed: float = 0.0,
    ) -> Overload:
        """The overload verdict of a model's ``queue`` now, with what it was judged on: its backlog
        (queued plus in-service samples: a reading, with those :meth:`backlog` was given) and
        capacity (samples/s) as the caller sees them, the least backlog over the last
        ``hold_s`` at that capacity, its arrivals and refusals as observed.
        ``refused_share_allowed``: the share of the window's samples whose refusal the SLO
        allows (1 - its percentile); 0, any refusal is an overload."""
        self.backlog(queue, now_s, backlog_samples)
        return Overload(
            backlog_ms=backlog_ms(backlog_samples, capacity_sps),
            slo_ms=slo_ms,
            refused=self.refusals(queue, now_s, capacity_sps),
            arrival_sps=self.arrival_sps(queue, now_s),
            capacity_sps=capacity_sps,
            window_s=self.window_s,
            held_backlog_ms=backlog_ms(self.held_backlog(queue, now_s), capacity_sps),
            hold_s=self.hold_s,
            refused_samples=self._summed(self._refused_samples, queue, now_s, capacity_sps),
            arrived_samples=self._summed(self._arrivals, queue, now_s, 0.0),
            refused_share_allowed=refused_share_allowed,
        )

    def _summed(
        self,
        kept: dict[Hashable, deque[_Count]],
        queue: Hashable,
        now_s: float,
        capacity_sps: float,
    ) -> float:
        """The amounts of ``queue`` over the last window, of those counted at a capacity at least
        ``capacity_sps``."""
        counts = kept.get(queue)
        if not counts:
            return 0.0
        self._trim(counts, now_s)
        limit = capacity_sps * (1.0 - 1e-9)
        return sum(c.amount for c in counts if c.capacity_sps >= limit)

    def forget(self, instances: Iterable[Hashable]) -> None:
        """Drop what was measured on ``instances`` (they left the fleet)."""
        gone = set(instances)
        for key in [k for k in self._samples if k[1] in gone]:
            del self._samples[key]
