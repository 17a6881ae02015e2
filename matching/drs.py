"""DRS: a static batch-size threshold between base and auxiliary instances.

Kairos' DRS baseline (Kairos section 7, after DeepRecSys, Gupta et al. 2020): a query larger than
the threshold is served by a base instance, one at or below it by an auxiliary instance (when the
fleet has any); within each class, FCFS to the fastest idle instance. The threshold is tuned per
configuration by hill climbing on throughput (``estimator.capacity.tune_threshold``).

The policy keeps one FIFO per class (new queries are classified as they appear at the tail of the
central queue), so a round costs what it dispatches, not the length of the queue: scanning the
whole queue for a query of the idle class made overloaded runs quadratic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from matching.errors import MatchingError
from matching.policy import Dispatch, InstanceView, PolicySetting, QueuedQuery, StageContext


class DrsPolicy:
    """Queries with batch size > ``threshold`` go to ``base_types``, the rest to other types."""

    name = "drs"
    needs_base_type = True
    needs_threshold = True
    takes_noise = False
    in_plans = False  # a plan does not record a threshold
    matched_capacity = False
    batches = False  # each query alone, to its class's fastest idle instance

    def __init__(self, threshold: int, base_types: Sequence[str]) -> None:
        if threshold < 0:
            raise MatchingError(f"the DRS threshold must be >= 0, got {threshold}")
        if not base_types:
            raise MatchingError("DRS needs at least one base type")
        self.threshold = threshold
        self.base_types = frozenset(base_types)
        self._small: deque[QueuedQuery] = deque()
        self._large: deque[QueuedQuery] = deque()
        self._pending: set[int] = set()

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        arrivals = []
        for item in reversed(queue):  # queries not yet classified are at the tail
            if item.query_id in self._pending:
                break
            arrivals.append(item)
        for item in reversed(arrivals):
            (self._small if item.batch_size <= self.threshold else self._large).append(item)
            self._pending.add(item.query_id)
        has_aux = any(inst.instance_type not in self.base_types for inst in instances)
        idle = sorted(
            (inst for inst in instances if inst.is_idle(now_s)),
            key=lambda inst: (inst.speed_rank, inst.idle_since_s, inst.index),
        )
        dispatches = []
        for inst in idle:
            if inst.instance_type in self.base_types:
                fifo = self._large if has_aux else self._earliest()
            else:
                fifo = self._small
            if fifo and fifo[0].batch_size <= inst.max_batch_size:
                item = fifo.popleft()
                self._pending.discard(item.query_id)
                dispatches.append(Dispatch(inst.index, (item.query_id,)))
        return dispatches

    @classmethod
    def factory(cls, setting: PolicySetting) -> Callable[[], DrsPolicy]:
        """Fresh policies with the setting's threshold and base types."""
        threshold, base = setting.threshold, tuple(setting.base_types)
        if threshold is None:
            raise MatchingError("the drs policy needs a batch-size threshold (--drs-threshold)")
        return lambda: cls(threshold, base)

    def _earliest(self) -> deque[QueuedQuery]:
        """Without auxiliaries the base serves both classes in arrival order."""
        if not self._small:
            return self._large
        if not self._large:
            return self._small
        small, large = self._small[0], self._large[0]
        first = (small.enqueued_s, small.query_id) <= (large.enqueued_s, large.query_id)
        return self._small if first else self._large

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """A static threshold learns nothing online."""
