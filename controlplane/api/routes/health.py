"""``GET /healthz`` (liveness, no token) and ``GET /metrics`` (Prometheus text format, viewer).

The metrics, per app: its budget and the cost of its live fleet (gauges, USD/hr), its instances
by lifecycle state (gauge), the newest rolled-up arrival rate and P99 latency (gauges, when a
sample exists), and the API's answers about it by HTTP status (counter); for the service: runs of
each scheduler job by outcome (counter). With a serving loop, per app also: queries answered,
failed and refused (counter), of them late (counter), samples answered per model (counter),
samples queued per model and workers by health (gauges, as of the loop's last refresh), and the
INFaaS state of each model on each instance (gauge: 1 for the state it is in). Exposition
format: Prometheus text format 0.0.4.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from controlplane import __version__
from controlplane.api.deps import Services, ServicesDep, Viewer
from controlplane.api.routes import errors
from controlplane.api.schemas import HealthOut
from controlplane.policies.lifecycle import LIVE_STATES, InstanceState

__all__ = ["render_metrics", "router"]

router = APIRouter(tags=["health"])

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/healthz", summary="Liveness: the service answers (no token needed)")
def healthz(services: ServicesDep) -> HealthOut:
    scheduler = services.scheduler
    return HealthOut(
        version=__version__,
        scheduler_running=scheduler is not None and scheduler.running,
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics per app (viewer)",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}}},
        **errors(401, 403, 503),
    },
)
def metrics(services: ServicesDep, _who: Viewer) -> PlainTextResponse:
    return PlainTextResponse(render_metrics(services), media_type=PROMETHEUS_TEXT)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]],
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            shown = ",".join(f'{key}="{_label(val)}"' for key, val in labels.items())
            self.lines.append(
                f"{name}{{{shown}}} {_number(value)}" if shown else f"{name} {_number(value)}"
            )

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(services: Services) -> str:
    """The exposition text (see the module docstring)."""
    store = services.store
    apps = store.list_apps()
    instances = store.list_instances()
    by_state: dict[str, dict[str, int]] = {
        app.name: {state.value: 0 for state in InstanceState} for app in apps
    }
    fleet_cost: dict[str, float] = defaultdict(float)
    for instance in instances:
        if instance.app in by_state:
            by_state[instance.app][instance.state] += 1
        if instance.state in LIVE_STATES:
            fleet_cost[instance.app] += instance.price_usd_per_hr
    latest = {app.name: store.metric_series(app.name, limit=1) for app in apps}

    out = _Exposition()
    out.family(
        "heteroplane_app_budget_usd_per_hr",
        "gauge",
        "The app's cost budget in USD per hour.",
        (({"app": app.name}, app.budget_usd_per_hr) for app in apps),
    )
    out.family(
        "heteroplane_app_fleet_cost_usd_per_hr",
        "gauge",
        "What the app's live instances cost, in USD per hour.",
        (({"app": app.name}, fleet_cost[app.name]) for app in apps),
    )
    out.family(
        "heteroplane_app_instances",
        "gauge",
        "The app's instances by lifecycle state.",
        (
            ({"app": app, "state": state}, count)
            for app, states in by_state.items()
            for state, count in states.items()
        ),
    )
    out.family(
        "heteroplane_app_arrival_rate_qps",
        "gauge",
        "The app's arrival rate in the newest rolled-up sample, queries per second.",
        (
            (
                ({"app": app}, samples[-1].arrival_rate_qps)
                for app, samples in latest.items()
                if samples
            )
        ),
    )
    out.family(
        "heteroplane_app_latency_p99_ms",
        "gauge",
        "The app's P99 latency in the newest rolled-up sample, milliseconds.",
        (
            ({"app": app}, p99)
            for app, samples in latest.items()
            if samples and (p99 := samples[-1].latency_p99_ms) is not None
        ),
    )
    out.family(
        "heteroplane_api_requests_total",
        "counter",
        "The API's answers by app (empty: no app) and HTTP status.",
        (
            ({"app": app, "status": str(status)}, count)
            for (app, status), count in sorted(services.requests.snapshot().items())
        ),
    )
    if services.serving is not None:
        _serving_metrics(out, services)
    scheduler = services.scheduler
    jobs = scheduler.jobs.items() if scheduler is not None else []
    out.family(
        "heteroplane_scheduler_job_runs_total",
        "counter",
        "Runs of each scheduler job by outcome (ran, failed, skipped: still running).",
        (
            ({"job": name, "outcome": outcome}, float(count))
            for name, job in jobs
            for outcome, count in (
                ("ran", job.stats.runs),
                ("failed", job.stats.failures),
                ("skipped", job.stats.skips),
            )
        ),
    )
    return out.text()


def _serving_metrics(out: _Exposition, services: Services) -> None:
    serving = services.serving
    assert serving is not None
    totals = serving.observations.totals()
    statuses = serving.statuses()
    out.family(
        "heteroplane_serving_queries_total",
        "counter",
        "Inference queries by outcome: answered, failed (an explicit error), refused (429, 503).",
        (
            ({"app": app, "outcome": outcome}, float(count))
            for app, t in totals.items()
            for outcome, count in (
                ("answered", t.answered),
                ("failed", t.failed),
                ("refused", t.refused),
            )
        ),
    )
    out.family(
        "heteroplane_serving_late_queries_total",
        "counter",
        "Answered inference queries whose latency was over the app's SLO.",
        (({"app": app}, float(t.late)) for app, t in totals.items()),
    )
    out.family(
        "heteroplane_serving_samples_total",
        "counter",
        "Samples answered, by the model that answered them.",
        (
            ({"app": app, "model": model}, float(count))
            for app, t in totals.items()
            for model, count in sorted(t.samples_by_model.items())
        ),
    )
    out.family(
        "heteroplane_serving_queue_samples",
        "gauge",
        "Samples waiting in each model's queue (as of the serving loop's last refresh).",
        (
            ({"app": st.app, "model": stage.model}, float(stage.queued_samples))
            for st in statuses
            for stage in st.stages
        ),
    )
    out.family(
        "heteroplane_serving_workers",
        "gauge",
        "Workers the serving loop matches queries to, by health.",
        (
            ({"app": st.app, "health": health}, float(count))
            for st in statuses
            for health, count in (
                ("healthy", sum(w.healthy for w in st.workers)),
                ("unhealthy", sum(not w.healthy for w in st.workers)),
            )
        ),
    )
    out.family(
        "heteroplane_model_state",
        "gauge",
        "INFaaS state of a model on an instance: 1 for the state it is in.",
        (
            ({"app": st.app, "model": stage.model, "instance": instance, "state": state}, 1.0)
            for st in statuses
            for stage in st.stages
            for instance, state in sorted(stage.states.items())
        ),
    )
