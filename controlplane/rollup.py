"""The metric roll-up job: one sample per app per run into ``metric_samples``, and retention.

Each run records, for every app, the cost of its live fleet and the load and latency measured
since the last run, then deletes samples older than the retention. The serving loop that
measures load and latency arrives in a later issue; until then the arrival rate is 0 (this
service has served no queries) and the latencies are unknown (None), while the fleet cost is
real. The body is built by :func:`make_rollup` and handed to the scheduler by the composition
root (:mod:`controlplane.service`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import timedelta

from controlplane.clock import Clock
from controlplane.errors import NotFoundError
from controlplane.lifecycle import LIVE_STATES
from controlplane.scheduler import JobBody
from controlplane.store import Store

__all__ = ["RETENTION_S", "make_rollup", "roll_up"]

logger = logging.getLogger(__name__)

# A week of samples: the dashboard's longest view. At one sample per app every 10 s that is
# about 60,000 rows per app.
RETENTION_S = 7 * 86_400.0


def roll_up(store: Store, clock: Clock, retention_s: float = RETENTION_S) -> int:
    """Record one sample per app and apply the retention; return how many samples were written."""
    now = clock.utcnow()
    cost: dict[str, float] = defaultdict(float)
    for instance in store.list_instances(states=[s.value for s in LIVE_STATES]):
        cost[instance.app] += instance.price_usd_per_hr
    written = 0
    for app in store.list_apps():
        try:
            store.add_metric_sample(
                app.name, arrival_rate_qps=0.0, fleet_cost_usd_per_hr=cost[app.name], at=now
            )
        except NotFoundError:
            continue  # deleted since it was listed
        written += 1
    removed = store.delete_metric_samples(before=now - timedelta(seconds=retention_s))
    logger.debug("roll-up: %d sample(s) written, %d past retention removed", written, removed)
    return written


def make_rollup(store: Store, clock: Clock, retention_s: float = RETENTION_S) -> JobBody:
    """The roll-up as a scheduler job body."""

    def rollup() -> None:
        roll_up(store, clock, retention_s)

    return rollup
