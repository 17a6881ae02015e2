"""The wait admission control judges, shared by the live dispatcher and the simulator.

A query joining a stage's queue waits until one of the stage's serving instances is free (the
call it serves ends, as the profile predicts it), then for the queries queued ahead of it
(:func:`queue_wait_ms`). Those are counted by the size of the query (the part of a request) they
came in (:class:`Backlog`): a query of n samples is served at the stage's capacity for queries
of n samples, C(n) samples per second (each serving instance at the batch one dispatch gives
it, :func:`batch_samples`: the stage's batch cap times n, within its profile), so the queue
drains in

    W_queue = sum over sizes n of 1000 x count(n) x n / C(n)   (ms).

With every query of one size this is 1000 B / C, B the queued samples. Where sizes differ it
is not: small queries are served at a small batch's rate, large ones at a large batch's, and B /
C at the new query's own size reads a queue of large queries as if it were served at the small
query's rate (Kairos' traces mix queries of one to hundreds of samples). Replayed on wnd's plan
with a 2.5x spike (``docs/serving.md``, "Admission control"), admission by B / C, every sample in
service counted too, missed 5.6% of the queries, more than serving every query late (4.3%); by
the time until an instance is free and this queue, 1.8%.

>>> backlog = Backlog()
>>> for n in (1, 1, 100):
...     backlog.add(n)
>>> backlog.samples, round(backlog.wait_ms(lambda n: 1000.0 if n == 1 else 10000.0), 6)
(102, 12.0)
>>> backlog.remove(100)
>>> backlog.samples, backlog.wait_ms(lambda n: 1000.0)
(2, 2.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["MIN_WAIT_SHARE", "Backlog", "allowance_ms", "batch_samples", "queue_wait_ms"]

# The least queueing any query is allowed, as a share of the SLO: an SLO that the bare service
# time already misses (a slow type, a tight SLO) does not turn away every query that would wait.
MIN_WAIT_SHARE = 0.25


def allowance_ms(slo_ms: float, service_ms: float, min_wait_share: float = MIN_WAIT_SHARE) -> float:
    """The wait a query may meet: what the SLO leaves after its service, at least a share of
    the SLO."""
    return max(slo_ms - service_ms, min_wait_share * slo_ms)


def batch_samples(size: int, cap: int, max_batch_size: int) -> int:
    """The samples of the batch one dispatch gives an instance when queries of ``size`` samples
    wait: ``cap`` queries, within its profile's ``max_batch_size``, at least the one query."""
    return max(min(cap * size, max_batch_size), size)


def queue_wait_ms(free_s: float, backlog: Backlog, capacity_sps: Callable[[int], float]) -> float:
    """What a query joining the queue waits (module docstring): ``free_s`` until an instance is
    free (infinite: none serves), then ``backlog`` at ``capacity_sps(n)`` for queries of n."""
    if math.isinf(free_s):
        return math.inf
    return 1000.0 * free_s + backlog.wait_ms(capacity_sps)


class Backlog:
    """Samples queued at a stage, by the size of the query they came in."""

    __slots__ = ("_counts", "samples")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.samples = 0

    def add(self, size: int) -> None:
        """One query of ``size`` samples joins the queue."""
        self._counts[size] = self._counts.get(size, 0) + 1
        self.samples += size

    def remove(self, size: int) -> None:
        """One query of ``size`` samples leaves the queue (dispatched, or its request ended); a
        size not held is ignored."""
        count = self._counts.get(size, 0)
        if count <= 0:
            return
        if count == 1:
            del self._counts[size]
        else:
            self._counts[size] = count - 1
        self.samples -= size

    def wait_ms(self, capacity_sps: Callable[[int], float]) -> float:
        """W (module docstring): ``capacity_sps(n)`` is the stage's samples per second for
        queries of n samples; infinite where one is not positive and such queries wait."""
        total = 0.0
        for size, count in self._counts.items():
            rate = capacity_sps(size)
            if rate <= 0.0:
                return math.inf
            total += 1000.0 * count * size / rate
        return total
