"""``GET /healthz`` (liveness, no token) and ``GET /metrics`` (Prometheus text format, viewer).

The metrics, per app: its budget and the cost of its live fleet (gauges, USD/hr), its instances
by lifecycle state (gauge), the newest rolled-up arrival rate and P99 latency (gauges, when a
sample exists), and the API's answers about it by HTTP status (counter); for the service: runs of
each scheduler job by outcome (counter). With a serving loop, per app also: queries answered,
refused, timed out and failed (counter), of them late (counter), every query's end-to-end
latency from the API's receipt of the request by outcome (histogram, seconds), where the
answered queries' time went, queue / transport / compute (counter, seconds), samples answered
per model (counter), samples queued per model and workers by health (gauges, as of the loop's
last refresh), and the INFaaS state of each model on each instance (gauge: 1 for the state it
is in). The SLO attainment is (answered - late) / the sum of the queries counter: refused,
timed-out and failed queries are misses. Exposition format: Prometheus text format 0.0.4.

The exposition is prometheus_client's. Each FastAPI app has its own ``CollectorRegistry`` (never
the library's global one, so that several apps in one process do not clash), made on its first
scrape and kept on ``app.state``. Its collectors hold no values: they read the store, the request
counter, the serving loop and the scheduler's job statistics at scrape time, so nothing else in
the service has to update a metric object when something changes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from controlplane import __version__
from controlplane.api.counters import RequestCounter
from controlplane.api.deps import Services, ServicesDep, Viewer
from controlplane.api.routes import errors
from controlplane.api.routes.rollouts import RolloutCollector
from controlplane.api.schemas import HealthOut, LoopsProcessOut
from controlplane.db.store import Store
from controlplane.loops.scheduler import Scheduler
from controlplane.policies.lifecycle import LIVE_STATES, InstanceState
from controlplane.serving.observations import LATENCY_BUCKETS_MS, Outcome

if TYPE_CHECKING:  # the serving loop imports the API's resolver: only a type here
    from controlplane.serving.loop import ServingLoop

__all__ = [
    "AppCollector",
    "RequestCollector",
    "SchedulerCollector",
    "ServingCollector",
    "metrics_registry",
    "router",
]

router = APIRouter(tags=["health"])

# Said here rather than taken from prometheus_client: its CONTENT_TYPE_LATEST names text format
# 1.0.0 from 0.22 on, while generate_latest writes 0.0.4 (the same text for our metric names).
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
# Where a FastAPI app keeps its registry (see the module docstring).
_REGISTRY_STATE = "metrics_registry"


@router.get("/healthz", summary="Liveness: the service answers (no token needed)")
def healthz(request: Request, services: ServicesDep) -> HealthOut:
    scheduler = services.scheduler
    leadership = services.leadership
    # The loops process heteroplane serve started beside this one (controlplane.cli.serve).
    supervised = getattr(request.app.state, "loops_process", None)
    loops = None if supervised is None else LoopsProcessOut(**supervised.health())
    role: Literal["leader", "standby", "serving"]
    if loops is not None:
        # The service's role is its loops process's; one that does not answer runs no job.
        role = loops.role or "standby"
    elif leadership is not None:
        role = leadership.role
    else:
        # Without a lease the service is alone (an app built for a test): it leads.
        role = "serving" if services.gear_table is not None else "leader"
    forwarder = services.forwarder
    feed: Literal["ok", "down"] | None = None
    feed_down_s = None
    if services.serving_feed_down_s is not None:  # a loops process: its feed's state
        feed_down_s = services.serving_feed_down_s()
        feed = "ok" if feed_down_s is None else "down"
    return HealthOut(
        version=__version__,
        scheduler_running=scheduler is not None and scheduler.running,
        role=role,
        loops=loops,
        serving_feed=feed,
        serving_feed_down_s=feed_down_s,
        dispatch_owner=None if forwarder is None else forwarder.owners.owner,
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics per app (viewer); without a token, the API's JSON 401",
    # Response, not PlainTextResponse: the route's media type is the one FastAPI gives the
    # error answers in the OpenAPI document, and those are JSON like every other route's (a
    # scraper sends its token: Prometheus' `authorization` with `credentials_file`).
    response_class=Response,
    responses={
        200: {
            "description": "the metrics, Prometheus text format 0.0.4",
            "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}},
        },
        **errors(401, 403, 503),
    },
)
def metrics(request: Request, services: ServicesDep, _who: Viewer) -> Response:
    registry: CollectorRegistry | None = getattr(request.app.state, _REGISTRY_STATE, None)
    if registry is None:
        # Two first scrapes at once may each make one: both read the same services, and the
        # last one stored is kept.
        registry = metrics_registry(services)
        setattr(request.app.state, _REGISTRY_STATE, registry)
    return Response(generate_latest(registry), media_type=PROMETHEUS_TEXT)


def metrics_registry(services: Services) -> CollectorRegistry:
    """A registry of the service's metrics (see the module docstring), in the order they are
    exposed: the apps, the API's answers, the serving loop's (when there is one), the jobs."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AppCollector(services.store))
    registry.register(RequestCollector(services.requests))
    if services.serving is not None:
        registry.register(ServingCollector(services.serving))
        registry.register(RolloutCollector(services.serving.versions))
    registry.register(SchedulerCollector(services.scheduler))
    return registry


# Each collector's describe() is its families without samples: the registry refuses a second
# collector of the same name, and nothing is read from the service to learn the names.


class AppCollector:
    """Per app: budget, live fleet cost, instances by state, the newest rolled-up sample."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            GaugeMetricFamily(
                "heteroplane_app_budget_usd_per_hr",
                "The app's cost budget in USD per hour.",
                labels=["app"],
            ),
            GaugeMetricFamily(
                "heteroplane_app_fleet_cost_usd_per_hr",
                "What the app's live instances cost, in USD per hour.",
                labels=["app"],
            ),
            GaugeMetricFamily(
                "heteroplane_app_instances",
                "The app's instances by lifecycle state.",
                labels=["app", "state"],
            ),
            GaugeMetricFamily(
                "heteroplane_app_arrival_rate_qps",
                "The app's arrival rate in the newest rolled-up sample, queries per second.",
                labels=["app"],
            ),
            GaugeMetricFamily(
                "heteroplane_app_latency_p99_ms",
                "The app's P99 latency in the newest rolled-up sample, milliseconds.",
                labels=["app"],
            ),
        )

    def describe(self) -> Sequence[Metric]:
        return self._families()

    def collect(self) -> Sequence[Metric]:
        apps = self.store.list_apps()
        by_state: dict[str, dict[str, int]] = {
            app.name: {state.value: 0 for state in InstanceState} for app in apps
        }
        for (name, state), count in self.store.count_instances().items():
            if name in by_state:
                by_state[name][state] = count
        fleet_cost: dict[str, float] = defaultdict(float)
        for instance in self.store.list_instances(states=[s.value for s in LIVE_STATES]):
            fleet_cost[instance.app] += instance.cost_usd_per_hr
        budget, cost, instances, rate, p99 = families = self._families()
        for app in apps:
            budget.add_metric([app.name], app.budget_usd_per_hr)
            cost.add_metric([app.name], fleet_cost[app.name])
            for state, count in by_state[app.name].items():
                instances.add_metric([app.name, state], count)
            newest = self.store.metric_series(app.name, limit=1)
            if newest:
                rate.add_metric([app.name], newest[-1].arrival_rate_qps)
                if newest[-1].latency_p99_ms is not None:
                    p99.add_metric([app.name], newest[-1].latency_p99_ms)
        return families


class RequestCollector:
    """The API's answers by app and HTTP status (:mod:`controlplane.api.counters`)."""

    def __init__(self, counter: RequestCounter) -> None:
        self.counter = counter

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "heteroplane_api_requests_total",
            "The API's answers by app (empty: no app) and HTTP status.",
            labels=["app", "status"],
        )

    def describe(self) -> Sequence[Metric]:
        return [self._family()]

    def collect(self) -> Sequence[Metric]:
        family = self._family()
        for (app, status), count in sorted(self.counter.snapshot().items()):
            family.add_metric([app, str(status)], count)
        return [family]


class ServingCollector:
    """Per app, what the serving loop counted and saw at its last refresh."""

    def __init__(self, serving: ServingLoop) -> None:
        self.serving = serving

    @staticmethod
    def _families() -> tuple[
        CounterMetricFamily,
        CounterMetricFamily,
        HistogramMetricFamily,
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            CounterMetricFamily(
                "heteroplane_serving_queries_total",
                "Inference queries by outcome: answered, refused (429, 503), timed_out (504),"
                " failed (502), and rejected (422: the model refused the query's own inputs; not"
                " offered). All but answered and rejected are SLO misses.",
                labels=["app", "outcome"],
            ),
            CounterMetricFamily(
                "heteroplane_serving_late_queries_total",
                "Answered inference queries whose latency, from the API's receipt of the"
                " request, was over the app's SLO.",
                labels=["app"],
            ),
            HistogramMetricFamily(
                "heteroplane_serving_latency_seconds",
                "Inference queries' end-to-end latency, from the API's receipt of the request to"
                " the answer or the error, by outcome.",
                labels=["app", "outcome"],
            ),
            CounterMetricFamily(
                "heteroplane_serving_stage_seconds",
                "The answered queries' time by stage: queue (the API before the loop, admission,"
                " the queues), transport (round trips less the workers' time), compute.",
                labels=["app", "stage"],
            ),
            CounterMetricFamily(
                "heteroplane_serving_samples_total",
                "Samples answered, by the model that answered them.",
                labels=["app", "model"],
            ),
            GaugeMetricFamily(
                "heteroplane_serving_queue_samples",
                "Samples waiting in each model's queue (as of the serving loop's last refresh).",
                labels=["app", "model"],
            ),
            GaugeMetricFamily(
                "heteroplane_serving_workers",
                "Workers the serving loop matches queries to, by health.",
                labels=["app", "health"],
            ),
            GaugeMetricFamily(
                "heteroplane_model_state",
                "INFaaS state of a model on an instance: 1 for the state it is in.",
                labels=["app", "model", "instance", "state"],
            ),
        )

    def describe(self) -> Sequence[Metric]:
        return self._families()

    def collect(self) -> Sequence[Metric]:
        families = self._families()
        queries, late, latency, stage_s, samples, queued, workers, states = families
        for app, totals in self.serving.observations.totals().items():
            queries.add_metric([app, "answered"], totals.answered)
            queries.add_metric([app, "failed"], totals.failed)
            queries.add_metric([app, "refused"], totals.refused)
            queries.add_metric([app, "timed_out"], totals.timed_out)
            queries.add_metric([app, "rejected"], totals.rejected)
            late.add_metric([app], totals.late)
            for outcome in Outcome:
                counts = totals.latency_buckets.get(outcome.value)
                if counts is None:
                    continue
                cumulative = 0
                buckets: list[tuple[str, float]] = []
                for bound_ms, count in zip((*LATENCY_BUCKETS_MS, math.inf), counts, strict=True):
                    cumulative += count
                    buckets.append((_bound_s(bound_ms), cumulative))
                total_s = totals.latency_outcome_sum_ms.get(outcome.value, 0.0) / 1000.0
                latency.add_metric([app, outcome.value], buckets, total_s)
            for part in ("api", "queue", "transport", "compute"):
                stage_s.add_metric([app, part], totals.latency_sum_ms.get(part, 0.0) / 1000.0)
            for model, count in sorted(totals.samples_by_model.items()):
                samples.add_metric([app, model], count)
        for status in self.serving.statuses():
            for stage in status.stages:
                queued.add_metric([status.app, stage.model], stage.queued_samples)
            healthy = sum(w.healthy for w in status.workers)
            workers.add_metric([status.app, "healthy"], healthy)
            workers.add_metric([status.app, "unhealthy"], len(status.workers) - healthy)
            for stage in status.stages:
                for instance, state in sorted(stage.states.items()):
                    states.add_metric([status.app, stage.model, instance, state], 1.0)
        return families


def _bound_s(bound_ms: float) -> str:
    """A histogram bucket's ``le`` label in seconds (``+Inf`` for the last)."""
    return "+Inf" if math.isinf(bound_ms) else f"{bound_ms / 1000.0:g}"


class SchedulerCollector:
    """Runs of each scheduler job by outcome (no samples without a scheduler)."""

    def __init__(self, scheduler: Scheduler | None) -> None:
        self.scheduler = scheduler

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "heteroplane_scheduler_job_runs_total",
            "Runs of each scheduler job by outcome (ran, failed, skipped: still running).",
            labels=["job", "outcome"],
        )

    def describe(self) -> Sequence[Metric]:
        return [self._family()]

    def collect(self) -> Sequence[Metric]:
        family = self._family()
        jobs = self.scheduler.jobs.items() if self.scheduler is not None else []
        for name, job in jobs:
            stats = job.stats
            family.add_metric([name, "ran"], stats.runs)
            family.add_metric([name, "failed"], stats.failures)
            family.add_metric([name, "skipped"], stats.skips)
        return [family]
