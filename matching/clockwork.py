"""Clockwork-style distribution: per-instance FCFS queues fed by a central controller.

Kairos' CLKWRK baseline (Kairos section 7, after Gujarati et al., OSDI'20): every instance keeps
its own FCFS queue; the controller knows each instance's timings and predicts each query's latency,
and sends each arriving query to the instance that would finish it earliest *within* its latency
target; if none can, to the one that finishes it earliest. Queries never move between queues.

The policy keeps the per-instance queues itself (the engine's central queue holds the queries
until their instance takes them). An instance's predicted free time is its real busy-until plus
the predicted latencies of the queries waiting for it, so predictions do not drift.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from matching.errors import MatchingError
from matching.policy import Dispatch, InstanceView, PolicySetting, QueuedQuery, StageContext


class ClockworkPolicy:
    """Earliest finish within QoS, committed at arrival (see the module docstring).

    ``latency_ms[type][b]`` is the predicted latency of a batch of size ``b`` on ``type``
    (NaN where the type cannot run it).
    """

    name = "clockwork"
    needs_base_type = False
    needs_threshold = False
    takes_noise = False
    in_plans = False
    matched_capacity = False
    batches = False

    def __init__(self, latency_ms: Mapping[str, np.ndarray]) -> None:
        self.latency_ms = {t: np.asarray(v, dtype=np.float64) for t, v in latency_ms.items()}
        self._assigned: set[int] = set()
        self._waiting: dict[int, deque[tuple[int, float]]] = {}
        self._pending_s: dict[int, float] = {}

    @classmethod
    def factory(cls, setting: PolicySetting) -> Callable[[], ClockworkPolicy]:
        """Fresh policies predicting each profile's mean latency by batch size."""
        tables = {t: p.mean_by_batch_ms() for t, p in setting.profiles.items()}
        return lambda: cls(tables)

    def _predict_s(self, instance_type: str, batch_size: int) -> float:
        table = self.latency_ms.get(instance_type)
        if table is None:
            raise MatchingError(f"clockwork has no latency prediction for {instance_type!r}")
        if batch_size >= table.size:
            return math.nan
        return float(table[batch_size]) / 1000.0

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        if context.qos_ms is None:
            raise MatchingError("the clockwork policy needs a latency target (qos_ms)")
        qos_s = context.qos_ms / 1000.0
        arrivals: list[QueuedQuery] = []
        for item in reversed(queue):  # new queries are at the tail of the central queue
            if item.query_id in self._assigned:
                break
            arrivals.append(item)
        for item in reversed(arrivals):
            self._place(now_s, item, instances, qos_s)
        dispatches = []
        for inst in instances:
            waiting = self._waiting.get(inst.index)
            if waiting and inst.is_idle(now_s):
                query_id, predicted_s = waiting.popleft()
                self._pending_s[inst.index] -= predicted_s
                self._assigned.discard(query_id)
                dispatches.append(Dispatch(inst.index, (query_id,)))
        return dispatches

    def _place(
        self, now_s: float, item: QueuedQuery, instances: Sequence[InstanceView], qos_s: float
    ) -> None:
        best: tuple[bool, float, int] | None = None
        best_latency_s = 0.0
        for inst in instances:
            latency_s = self._predict_s(inst.instance_type, item.batch_size)
            if math.isnan(latency_s):
                continue
            free_s = max(now_s, inst.busy_until_s) + self._pending_s.get(inst.index, 0.0)
            finish_s = free_s + latency_s
            key = (finish_s - item.arrival_s > qos_s, finish_s, inst.index)
            if best is None or key < best:
                best, best_latency_s = key, latency_s
        if best is None:
            raise MatchingError(f"no instance can run a batch of {item.batch_size}")
        index = best[2]
        self._waiting.setdefault(index, deque()).append((item.query_id, best_latency_s))
        self._pending_s[index] = self._pending_s.get(index, 0.0) + best_latency_s
        self._assigned.add(item.query_id)

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """Predictions come from the profile; measurements are not needed."""
