"""The metric roll-up job: one sample per app per run into ``metric_samples``, and retention.

Each run records, for every app, the cost of its live fleet and the load and latency measured
since the last run, then deletes samples older than the retention, and decisions last made more
than ``decision_retention_days`` ago or beyond the newest ``decision_retention_count`` of an app
(settings of the same names); at most once an hour, also the instances that ended more than
``instance_retention_days`` ago, with their events, but each app's newest launch (its request id
numbers the next one, so that no id the provider has seen is used again): at most
``INSTANCE_RETENTION_BATCH`` a run, the next run going on while more are left (a database
upgraded with years of history is not locked for one long transaction). Load, latency, SLO
attainment, the gear in force and the accuracy on the validation samples the queries carried
come from the serving loop's window of the app (``window``:
:meth:`controlplane.serving.loop.ServingLoop.take_window`). Latencies run from the API's receipt
of each request; the percentiles are over the queries answered in the window, the attainment
over every query that ended in it: refused (429, 503), timed-out (504) and failed (502) ones are
misses, so a window in which every query failed has attainment 0 and no percentiles (not a
missing value that a chart would skip). An app the loop has not served (or a
service without one) is recorded with an arrival rate of 0 and unknown latencies, while the
fleet cost is always real. The body is built by :func:`make_rollup` and handed to the scheduler
by the composition root (:mod:`controlplane.service.build`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timedelta

from controlplane.clock import Clock
from controlplane.db.store import Store
from controlplane.errors import NotFoundError
from controlplane.loops.reconciler import newest_launch, request_prefix
from controlplane.loops.scheduler import JobBody
from controlplane.policies.lifecycle import BILLED_STATES
from controlplane.serving.observations import WindowSummary

__all__ = [
    "DECISION_RETENTION_COUNT",
    "DECISION_RETENTION_DAYS",
    "INSTANCE_RETENTION_BATCH",
    "INSTANCE_RETENTION_DAYS",
    "INSTANCE_RETENTION_EVERY_S",
    "RETENTION_S",
    "make_rollup",
    "roll_up",
]

logger = logging.getLogger(__name__)

# A week of samples: the dashboard's longest view. At one sample per app every 10 s that is
# about 60,000 rows per app.
RETENTION_S = 7 * 86_400.0
# The decision log's retention (the defaults of the settings of the same names).
DECISION_RETENTION_DAYS = 30.0
DECISION_RETENTION_COUNT = 10_000
# The ended instances' retention (the default of the setting of the same name), and how often it
# runs: the keep list reads every request id of each app.
INSTANCE_RETENTION_DAYS = 30.0
INSTANCE_RETENTION_EVERY_S = 3600.0
INSTANCE_RETENTION_BATCH = 2000

WindowFn = Callable[[str], WindowSummary | None]
"""App name -> the serving loop's window of it since the last call (None: not served)."""


def roll_up(
    store: Store,
    clock: Clock,
    retention_s: float = RETENTION_S,
    window: WindowFn | None = None,
    *,
    decision_retention_days: float = DECISION_RETENTION_DAYS,
    decision_retention_count: int = DECISION_RETENTION_COUNT,
) -> int:
    """Record one sample per app and apply the retentions (samples, decisions); return how many
    samples were written. (The ended instances' retention is :func:`make_rollup`'s.)"""
    now = clock.utcnow()
    cost: dict[str, float] = defaultdict(float)
    for instance in store.list_instances(states=[s.value for s in BILLED_STATES]):
        cost[instance.app] += instance.cost_usd_per_hr  # billed_cost_usd_per_hr's states
    written = 0
    for app in store.list_apps():
        served = window(app.name) if window is not None else None
        try:
            if served is None:
                store.add_metric_sample(
                    app.name, arrival_rate_qps=0.0, fleet_cost_usd_per_hr=cost[app.name], at=now
                )
            else:
                store.add_metric_sample(
                    app.name,
                    arrival_rate_qps=served.arrival_rate_qps,
                    latency_p50_ms=served.latency_p50_ms,
                    latency_p95_ms=served.latency_p95_ms,
                    latency_p99_ms=served.latency_p99_ms,
                    attainment_share=served.attainment_share,
                    gear=served.gear,
                    accuracy=served.accuracy,
                    fleet_cost_usd_per_hr=cost[app.name],
                    at=now,
                )
        except NotFoundError:
            continue  # deleted since it was listed
        written += 1
        if served is not None and served.errors:
            logger.info(
                "roll-up: %s: %d of %d queries ended in an error (refused %d, timed out %d,"
                " failed %d)",
                app.name,
                served.errors,
                served.offered,
                served.refused,
                served.timed_out,
                served.failed,
            )
    removed = store.delete_metric_samples(before=now - timedelta(seconds=retention_s))
    logger.debug("roll-up: %d sample(s) written, %d past retention removed", written, removed)
    pruned = store.delete_decisions(
        before=now - timedelta(days=decision_retention_days), keep=decision_retention_count
    )
    if pruned:
        logger.info("roll-up: %d decision(s) past retention removed", pruned)
    return written


def _forget_ended_instances(store: Store, before: datetime) -> int:
    keep: list[str] = []
    for app in store.list_apps():
        prefix = request_prefix(app)
        try:
            newest = newest_launch(store.list_request_ids(app.name, prefix), prefix)
        except NotFoundError:
            continue  # deleted since it was listed: its rows went with it
        if newest is not None:
            keep.append(newest)
    removed = store.delete_ended_instances(before=before, keep=keep, limit=INSTANCE_RETENTION_BATCH)
    if removed:
        logger.info("roll-up: %d ended instance(s) past retention removed", removed)
    return removed


def make_rollup(
    store: Store,
    clock: Clock,
    retention_s: float = RETENTION_S,
    window: WindowFn | None = None,
    *,
    decision_retention_days: float = DECISION_RETENTION_DAYS,
    decision_retention_count: int = DECISION_RETENTION_COUNT,
    instance_retention_days: float = INSTANCE_RETENTION_DAYS,
) -> JobBody:
    """The roll-up as a scheduler job body (``window``: the serving loop's, when it runs); the
    ended instances' retention runs on its first run and then every
    ``INSTANCE_RETENTION_EVERY_S``."""
    last: datetime | None = None  # the retention's last run that left nothing behind

    def rollup() -> None:
        nonlocal last
        now = clock.utcnow()
        due = last is None or (now - last).total_seconds() >= INSTANCE_RETENTION_EVERY_S
        roll_up(
            store,
            clock,
            retention_s,
            window,
            decision_retention_days=decision_retention_days,
            decision_retention_count=decision_retention_count,
        )
        if not due:
            return
        before = now - timedelta(days=instance_retention_days)
        if _forget_ended_instances(store, before) < INSTANCE_RETENTION_BATCH:  # else: next run
            last = now

    return rollup
