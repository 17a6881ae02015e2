"""Admission control: refuse a query (429 with ``Retry-After``) when the queue it would join
cannot be served within the SLO even at the cheapest gear, rather than let it wait without bound.

The estimate comes from the profiles and what the serving loop sees now, per stage (model) of a
gear's cascade (:class:`StageLoad`):

- the backlog B_s, samples queued at the stage plus those in service there;
- the capacity C_s, samples per second the stage's healthy instances serve: sum over instances i
  of k_i / L_{m,t(i)}(k_i), L the profiled mean service time and k_i the batch of samples one
  dispatch gives it: the queries one call carries (the stage's batch cap where its policy
  batches, one query where it sends each alone, as Kairos does: :meth:`~controlplane.serving.
  stages.ServingStage.call_cap`, :func:`matching.policy.queries_per_call`), within the profile.
  Until 2026-12-06 it was the batch cap whatever the policy, which under Kairos with a plan's
  cap above 1 overstated the capacity by the batching gain Kairos never takes;
- the wait W_s a query joining the queue meets (:meth:`~controlplane.serving.stages.
  ServingStage.wait_ms`, :mod:`matching.admission`): until the first healthy instance is free
  (its call's predicted end), then the queued queries, each size n at the capacity C_s(n) for
  queries of its size; with every instance idle and nothing queued, 0. (Until 2026-11-30 it was
  1000 B_s / C_s, which counts every call in service as a whole batch still to serve and a queue
  of large queries at a small one's rate: it refused queries that would have been served in
  time, most on a fleet of many busy instances or of mixed query sizes.) At least, though, the
  queued samples at the rate the queue was measured to drain while it never emptied
  (:class:`~controlplane.serving.stages.DrainMeter`): past saturation of the serving process
  itself the queue drains slower than the profiles say.
- the service time S_s of the new query's own batch (its batch size on the stage's fastest type);
- whether the gear sends any sample there (its reach share; a stage no sample reaches adds
  nothing).

A sample that reaches every stage of the path (the tail: P99 is what the SLO asks) waits about
B_s / C_s at each and is served in S_s, so the predicted latency of a new query under a gear is
(:func:`predicted_latency_ms`)

    T = sum over stages s with reach_s > 0 of  W_s + S_s  (ms).

Admission (:func:`decide`) judges the stages *every* sample reaches (reach share 1: a
cascade's first model; a single model's one stage): the query is refused when their wait W
exceeds what the SLO leaves after their service S, max(SLO - S, SLO / 4), under the gear of
least T among the candidates (the gear in force, the app's own cascade, and the cheapest gear
of a gear plan when the app has one). Until 2026-12-01 it judged the whole path, W and S summed
over every stage a sample may reach: a cascade whose later models a few percent of queries reach
refused queries whenever its large model was busy, most of which would have left at the first
model in time (a feasible plan of the demo family at 10 qps, P99 235 ms of a 300 ms SLO without
admission, had 2.07% of its queries refused). The part of a query a cascade forwards is judged
again at the next stage against what the SLO leaves it after its time so far (the dispatcher's
``_forward_refused``), so a later stage short of capacity refuses what it cannot serve in time
rather than queue it. The floor of a quarter of the SLO keeps
an SLO that the bare service time already misses (a slow type, a tight SLO) from turning away
every query that would wait at all: those queries are served, late, and counted. ``Retry-After``
is the time the backlog needs to drain down to the allowance, (W - allowance) / 1000 seconds,
rounded up, between 1 and :data:`MAX_RETRY_AFTER_S`.

Past the SLO, a hard cap on the samples queued per app (:data:`DEFAULT_MAX_QUEUED_SAMPLES`)
bounds memory whatever the estimate says.

>>> stage = StageLoad(backlog_samples=900, capacity_sps=1000.0, service_ms=5.0, reach_share=1.0)
>>> predicted_latency_ms([stage])
905.0
>>> decide([stage], slo_ms=200.0)
Admission(admitted=False, predicted_ms=905.0, wait_ms=900.0, retry_after_s=1)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from matching.admission import MIN_WAIT_SHARE, allowance_ms

__all__ = [
    "DEFAULT_MAX_QUEUED_SAMPLES",
    "MAX_RETRY_AFTER_S",
    "MIN_WAIT_SHARE",
    "Admission",
    "StageLoad",
    "cheapest",
    "decide",
    "judged_positions",
    "predicted_latency_ms",
    "wait_ms",
]

MAX_RETRY_AFTER_S = 60
# Samples queued per app beyond which every new query is refused: 256 k samples of 64 floats is
# about 128 MiB of inputs held by the loop.
DEFAULT_MAX_QUEUED_SAMPLES = 262_144


@dataclass(frozen=True, slots=True)
class StageLoad:
    """What a stage of a gear faces now (see the module docstring for the symbols)."""

    backlog_samples: float
    capacity_sps: float
    service_ms: float
    reach_share: float = 1.0
    # The wait as the stage measures it (:meth:`~controlplane.serving.stages.ServingStage.
    # wait_ms`: until an instance is free, then the queue by query size); None: 1000 B / C.
    queue_wait_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """The verdict for a new query: admitted or not, the predicted latency and its wait part
    under the chosen gear (ms), and, when refused, when to retry (whole seconds)."""

    admitted: bool
    predicted_ms: float
    wait_ms: float
    retry_after_s: int = 0


def _reached(stages: Iterable[StageLoad]) -> list[StageLoad]:
    return [s for s in stages if s.reach_share > 0]


def wait_ms(stages: Sequence[StageLoad]) -> float:
    """W: the queueing a sample reaching every stage of the path meets (infinite when a stage
    it reaches has no capacity and a backlog, or no capacity at all)."""
    total = 0.0
    for stage in _reached(stages):
        if stage.queue_wait_ms is not None:
            total += stage.queue_wait_ms
            continue
        if stage.capacity_sps <= 0:
            return math.inf
        total += 1000.0 * max(stage.backlog_samples, 0.0) / stage.capacity_sps
    return total


def predicted_latency_ms(stages: Sequence[StageLoad]) -> float:
    """T = W + the service of every stage the gear reaches."""
    return wait_ms(stages) + sum(s.service_ms for s in _reached(stages))


def cheapest(gears: Sequence[Sequence[StageLoad]]) -> int:
    """The index of the gear of least predicted latency (the first of equals)."""
    if not gears:
        raise ValueError("no gear to choose from")
    return min(range(len(gears)), key=lambda i: predicted_latency_ms(gears[i]))


def judged_positions(stages: Sequence[StageLoad]) -> list[int]:
    """The positions of the stages :func:`decide` judges a query on: those every sample of it
    reaches (reach share 1: a cascade's first model), or the first reached one when the records
    say none is. A refusal is these stages' doing, not a later stage's.

    >>> first, later = StageLoad(4, 100.0, 5.0, 1.0), StageLoad(0, 80.0, 9.0, 0.3)
    >>> judged_positions([first, later]), judged_positions([later, later])
    ([0], [0])
    """
    every = [i for i, s in enumerate(stages) if s.reach_share >= 1.0 - _SHARE_TOLERANCE]
    return every or [i for i, s in enumerate(stages) if s.reach_share > 0][:1]


def _every_sample(stages: Sequence[StageLoad]) -> list[StageLoad]:
    """The stages :func:`judged_positions` names."""
    return [stages[i] for i in judged_positions(stages)]


# Reach shares are computed from the validation records' counts: 1 within rounding.
_SHARE_TOLERANCE = 1e-9


def decide(
    stages: Sequence[StageLoad], slo_ms: float, *, min_wait_share: float = MIN_WAIT_SHARE
) -> Admission:
    """Admit or refuse under one gear's ``stages`` (see the module docstring): judged on the
    stages every sample reaches; ``predicted_ms`` is the whole path's T, the tail's."""
    judged = _every_sample(stages)
    wait = wait_ms(judged)
    service = sum(s.service_ms for s in judged)
    predicted = predicted_latency_ms(stages)
    allowance = allowance_ms(slo_ms, service, min_wait_share)
    if wait <= allowance:
        return Admission(True, predicted, wait)
    if math.isinf(wait):
        return Admission(False, predicted, wait, MAX_RETRY_AFTER_S)
    retry = min(max(math.ceil((wait - allowance) / 1000.0), 1), MAX_RETRY_AFTER_S)
    return Admission(False, predicted, wait, retry)
