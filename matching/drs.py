"""DRS: a static batch-size threshold between base and auxiliary instances.

Kairos' DRS baseline (Kairos section 7, after DeepRecSys, Gupta et al. 2020): a query larger than
the threshold is served by a base instance, one at or below it by an auxiliary instance (when the
fleet has any); within each class, FCFS to the fastest idle instance. The threshold is tuned per
configuration by hill climbing on throughput (``estimator.capacity.tune_drs_threshold``).
"""

from __future__ import annotations

from collections.abc import Sequence

from matching.errors import MatchingError
from matching.policy import Dispatch, InstanceView, QueuedQuery, StageContext


class DrsPolicy:
    """Queries with batch size > ``threshold`` go to ``base_types``, the rest to other types."""

    name = "drs"

    def __init__(self, threshold: int, base_types: Sequence[str]) -> None:
        if threshold < 0:
            raise MatchingError(f"the DRS threshold must be >= 0, got {threshold}")
        if not base_types:
            raise MatchingError("DRS needs at least one base type")
        self.threshold = threshold
        self.base_types = frozenset(base_types)

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        has_aux = any(inst.instance_type not in self.base_types for inst in instances)
        idle = sorted(
            (inst for inst in instances if inst.is_idle(now_s)),
            key=lambda inst: (inst.speed_rank, inst.idle_since_s, inst.index),
        )
        base = [inst for inst in idle if inst.instance_type in self.base_types]
        aux = [inst for inst in idle if inst.instance_type not in self.base_types]
        dispatches = []
        for item in queue:
            if not base and not aux:
                break
            small = item.batch_size <= self.threshold and has_aux
            pool = aux if small else base
            if pool and item.batch_size <= pool[0].max_batch_size:
                dispatches.append(Dispatch(pool.pop(0).index, (item.query_id,)))
        return dispatches

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """A static threshold learns nothing online."""
