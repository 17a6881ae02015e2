"""``/v1/apps/{app}/rollouts``: start a rollout of a new model version into a running app, read
it, pause, resume or abort it (the use cases of :mod:`controlplane.apps.rollouts`; the rollout
loop, :mod:`controlplane.loops.rollouts`, moves it through its steps). docs/rollouts.md.

A second rollout while one is active is a 409; a model the app does not serve, a version it
already serves, steps that do not end at 1 are 422; a rollout whose extra instances the budget
cannot pay for is a 409 naming what it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Path
from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.deps import Operator, ServicesDep, Viewer
from controlplane.api.routes import AppName, errors
from controlplane.apps.rollouts import (
    RolloutRequest,
    abort_rollout,
    pause_rollout,
    resume_rollout,
    rollout_document,
    start_rollout,
)
from controlplane.db.store import RolloutRecord
from controlplane.policies.rollout import DEFAULT_INTERVAL_S, DEFAULT_STEPS, Thresholds
from controlplane.serving.versions import VersionMeter

__all__ = ["RolloutCollector", "router"]

router = APIRouter(prefix="/v1", tags=["rollouts"])

RolloutId = Annotated[int, Path(ge=1, le=2**31 - 1, description="the rollout's id")]


class ThresholdsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_p99_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_error_share: float = Field(default=0.01, ge=0, le=1)
    min_agreement_share: float = Field(default=0.95, ge=0, le=1)
    min_queries: int = Field(default=50, ge=1, le=10_000_000)
    min_accuracy: float | None = Field(default=None, ge=0, le=1)


class RolloutIn(BaseModel):
    """A rollout to start: ``model`` as ``NAME[@VERSION]`` (a registry model the app serves;
    default version: the latest), ``steps`` the shares of the queries the new version answers
    step by step (increasing, the last 1), ``interval_s`` the least time a step lasts,
    ``shadow`` a first step that mirrors every query to the new version and compares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, max_length=80)
    steps: list[float] = Field(default=list(DEFAULT_STEPS), min_length=1, max_length=20)
    interval_s: float = Field(default=DEFAULT_INTERVAL_S, gt=0, allow_inf_nan=False)
    shadow: bool = False
    thresholds: ThresholdsIn = Field(default_factory=ThresholdsIn)
    # heteroplane.validation/v1 records of the cascade's members with the new version: a
    # cascade member's rollout re-derives the thresholds on them.
    validation: dict[str, Any] | None = None


@router.post(
    "/apps/{app}/rollouts",
    status_code=201,
    summary="Start a rollout of a new model version (operator); 409 while one is active or"
    " when the budget cannot pay for its instances",
    responses=errors(400, 401, 403, 404, 409, 422),
)
def start(app: AppName, body: RolloutIn, services: ServicesDep, who: Operator) -> dict[str, Any]:
    thresholds = Thresholds(**body.thresholds.model_dump())
    request = RolloutRequest(
        body.model, body.steps, body.interval_s, body.shadow, thresholds, body.validation
    )
    # The new version's profile run and plan are the rollout loop's: the start returns at once.
    profile_run = services.provisioner is not None and services.settings.rollout_profile_run
    rollout = start_rollout(
        services.store,
        services.resolver,
        app,
        request,
        who=who.name,
        profile_run=profile_run,
        now=services.clock.utcnow(),
    )
    return rollout_document(rollout)


@router.get(
    "/apps/{app}/rollouts",
    summary="The app's rollouts, oldest first (viewer)",
    responses=errors(401, 403, 404, 422),
)
def list_rollouts(app: AppName, services: ServicesDep, _who: Viewer) -> list[dict[str, Any]]:
    services.store.get_app(app)
    return [rollout_document(r) for r in services.store.list_rollouts(app)]


@router.get(
    "/apps/{app}/rollouts/{rollout_id}",
    summary="One rollout: its state, step, reason and per-version figures (viewer)",
    responses=errors(401, 403, 404, 422),
)
def get_rollout(
    app: AppName, rollout_id: RolloutId, services: ServicesDep, _who: Viewer
) -> dict[str, Any]:
    return rollout_document(services.store.get_rollout(app, rollout_id))


# The moves a caller asks for: the use case and the route's summary.
_MOVES: dict[str, tuple[Callable[..., RolloutRecord], str]] = {
    "abort": (abort_rollout, "Abort the rollout: all traffic back on the old version at once"),
    "pause": (pause_rollout, "Pause the rollout where it is"),
    "resume": (resume_rollout, "Resume a paused rollout"),
}


def _move_route(move: Callable[..., RolloutRecord]) -> Callable[..., dict[str, Any]]:
    def route(
        app: AppName, rollout_id: RolloutId, services: ServicesDep, who: Operator
    ) -> dict[str, Any]:
        return rollout_document(move(services.store, app, who=who.name, rollout_id=rollout_id))

    return route


for _action, (_move, _summary) in _MOVES.items():
    router.add_api_route(
        f"/apps/{{app}}/rollouts/{{rollout_id}}/{_action}",
        _move_route(_move),
        methods=["POST"],
        name=f"{_action}_rollout",
        summary=f"{_summary} (operator); 404 when it is not active, 409 when its state does not"
        " allow the move",
        responses=errors(401, 403, 404, 409, 422),
    )


class RolloutCollector:
    """``/metrics``: each app's current rollout step, per version (``NAME@VERSION``): queries
    (answered and failed), failed ones, the answered ones' P99 at the client's view, and in a
    shadow step the samples compared and agreed. Gauges: a new step starts from zero."""

    def __init__(self, meter: VersionMeter) -> None:
        self.meter = meter

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        labels = ["app", "rollout", "version"]
        return (
            GaugeMetricFamily(
                "heteroplane_rollout_queries",
                "Queries of the rollout's current step answered or failed, per version.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "heteroplane_rollout_errors",
                "Queries of the rollout's current step that failed, per version.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "heteroplane_rollout_latency_p99_ms",
                "P99 latency (from the API's receipt) of the current step's answered queries.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "heteroplane_rollout_accuracy",
                "The share of the current step's samples with a validation sample id answered"
                " with its label.",
                labels=labels,
            ),
            GaugeMetricFamily(
                "heteroplane_rollout_agreement_share",
                "In a shadow step: the share of compared samples the new version answered as"
                " the old one did.",
                labels=labels,
            ),
        )

    def describe(self) -> Sequence[Metric]:
        return self._families()

    def collect(self) -> Sequence[Metric]:
        queries, failed, p99, accuracy, agreement = families = self._families()
        for app, (rollout_id, by_version) in sorted(self.meter.current().items()):
            for version, figures in sorted(by_version.items()):
                labels = [app, str(rollout_id), version]
                queries.add_metric(labels, figures.queries)
                failed.add_metric(labels, figures.errors)
                if figures.p99_ms is not None:
                    p99.add_metric(labels, figures.p99_ms)
                if figures.accuracy is not None:
                    accuracy.add_metric(labels, figures.accuracy)
                if figures.agreement_share is not None:
                    agreement.add_metric(labels, figures.agreement_share)
        return families
