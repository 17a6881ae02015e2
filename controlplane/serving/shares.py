"""The dispatch policy of a cascade's stage that follows the load balancer's shares.

:mod:`~controlplane.serving.placement` gives each stage of a cascade app the shares of the
load-balancing LP (:func:`controlplane.policies.load_balance.balance`: which fraction of the
model's queries each hosting instance should serve); :class:`SharePolicy` makes the served
fractions track them with a deficit counter, in samples: with S the samples the stage has
started since the shares took force and s_i those started on instance i, the deficit of i is
share_i x S - s_i. Each round hands the queue's head, batched as FCFS batches it (up to the
batch cap of queued queries within the instance's largest profiled batch), to the idle
instance of largest deficit, then the next batch to the next, updating the counts as it goes.
Instances of share 0 come last: they serve only when every instance with a share is busy (the
policy never leaves a query queued while an instance that hosts its model is idle). Ties go to
the larger share, then the faster type, then the lower index.

The counters start again whenever the placement gives the stage new shares or new slots. Per
round the cost is a sort of the idle instances: nothing is solved on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matching.fcfs import take_batch
from matching.policy import Dispatch, InstanceView, QueuedQuery, StageContext

__all__ = ["SHARE_POLICY", "SharePolicy"]

SHARE_POLICY = "lp-shares"


class SharePolicy:
    """Dispatch so that each instance's served share tracks its LP share (see the module
    docstring); ``shares`` by slot index (a slot left out has share 0)."""

    name = SHARE_POLICY

    __slots__ = ("served", "served_total", "shares")

    def __init__(self, shares: Mapping[int, float]) -> None:
        self.shares = dict(shares)
        self.served: dict[int, float] = dict.fromkeys(self.shares, 0.0)
        self.served_total = 0.0

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        idle = [inst for inst in instances if inst.is_idle(now_s)]
        dispatches: list[Dispatch] = []
        shares = self.shares
        served = self.served
        head = 0
        while idle and head < len(queue):
            total = self.served_total
            best = min(
                idle,
                key=lambda inst: (
                    shares.get(inst.index, 0.0) <= 0.0,
                    served.get(inst.index, 0.0) - shares.get(inst.index, 0.0) * total,
                    -shares.get(inst.index, 0.0),
                    inst.speed_rank,
                    inst.index,
                ),
            )
            idle.remove(best)
            batch, samples, head = take_batch(
                queue, head, context.max_batch_queries, best.max_batch_size
            )
            served[best.index] = served.get(best.index, 0.0) + samples
            self.served_total = total + samples
            dispatches.append(Dispatch(best.index, batch))
        return dispatches

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """The shares come from the plan's profiles, not from what is measured."""

    def queries_per_call(self, now_s: float, batch_cap: int) -> int:
        """Up to ``batch_cap`` queries a call: each instance's batch is FCFS's."""
        return batch_cap
