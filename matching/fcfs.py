"""First come, first served from a central queue, to the fastest idle instance.

The head of the queue goes to an idle instance; among idle instances the fastest type wins
(``speed_rank``), then the one idle the longest, then the lowest index. An instance takes up to
``max_batch_queries`` queued queries at once, as long as their summed batch size stays within its
profile. This is InferLine's centralized batched queue and Ribbon's base-first rule; the simulator's
compiled fast path implements exactly the same rule (tests check they agree query by query).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from matching.policy import Dispatch, InstanceView, PolicySetting, QueuedQuery, StageContext


class FcfsPolicy:
    """FCFS to the fastest idle instance (see the module docstring).

    ``type_order`` overrides "fastest": the listed types are preferred in that order, before the
    others (Ribbon's base-first rule is ``FcfsPolicy(type_order=(base_type,))``).
    """

    name = "fcfs"
    needs_base_type = False
    needs_threshold = False
    takes_noise = False
    in_plans = True
    matched_capacity = False
    batches = True

    def __init__(self, type_order: tuple[str, ...] = ()) -> None:
        self.type_order = tuple(type_order)

    @classmethod
    def factory(cls, setting: PolicySetting) -> Callable[[], FcfsPolicy]:
        """Fresh policies preferring the setting's base types in order."""
        order = tuple(setting.base_types)
        return lambda: cls(type_order=order)

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        idle = sorted(
            (inst for inst in instances if inst.is_idle(now_s)),
            key=lambda inst: (inst.speed_rank, inst.idle_since_s, inst.index),
        )
        dispatches: list[Dispatch] = []
        head = 0
        for instance in idle:
            if head >= len(queue):
                break
            batch, _, head = take_batch(
                queue, head, context.max_batch_queries, instance.max_batch_size
            )
            dispatches.append(Dispatch(instance.index, batch))
        return dispatches

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """FCFS predicts nothing, so it learns nothing."""


def take_batch(
    queue: Sequence[QueuedQuery], head: int, max_queries: int, max_samples: int
) -> tuple[tuple[int, ...], int, int]:
    """The FCFS batch from ``queue[head]`` on: the head query, then the next ones while the
    batch holds fewer than ``max_queries`` queries and their samples fit ``max_samples``.
    Returns (the batch's query ids, its samples, the new head).

    >>> q = [QueuedQuery(i, b, 0.0, 0.0) for i, b in enumerate([2, 2, 3])]
    >>> take_batch(q, 0, 8, 4), take_batch(q, 2, 8, 4)
    (((0, 1), 4, 2), ((2,), 3, 3))
    """
    batch = [queue[head].query_id]
    samples = queue[head].batch_size
    head += 1
    while head < len(queue) and len(batch) < max_queries:
        if samples + queue[head].batch_size > max_samples:
            break
        samples += queue[head].batch_size
        batch.append(queue[head].query_id)
        head += 1
    return tuple(batch), samples, head
