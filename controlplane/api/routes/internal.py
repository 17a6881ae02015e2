"""The serving process's internal routes (the settings' ``internal_token``, or an admin token;
not in the OpenAPI document): what the
loops process reads of the serving loop when the two run apart (``heteroplane serve --role
serving`` and ``--role loops``; docs/service.md, "Serving apart from the loops"), read by
:class:`~controlplane.loops.remote_serving.RemoteServing`.

- ``POST /internal/v1/feed``: the loops' frequent exchange (every ``loops_pull_s``). In: the
  newest arrival each app already has (``since_s``, on this process's clock), the gears in force
  (app -> [plan id, gear]: the serving loop's gear hook, :class:`~controlplane.loops.live_gears.
  GearTable`), the tuner's batch caps of single-model apps (app -> {model: cap}, at least 1: the
  batch of the rung of the app's sizing ladder its fleet reaches, docs/tuner.md) and the apps
  recalibrated since the last exchange (this process's resolver forgets them). Out: this
  process's clock (``now_s``) and, per app it serves, the arrivals after ``since_s`` and its
  status (``null`` before its first refresh).
- ``GET /internal/v1/apps/{app}/observations``: its batch service times and API times (the
  calibration's); ``POST .../forget-batch-times``: drop one (model, type)'s batch times.
- ``POST /internal/v1/apps/{app}/window``: the app's serving window since the last call (the
  roll-up's; ``null`` when the app is not served).
- ``GET /internal/v1/apps/{app}/versions?rollout_id=&step_index=``: each version's figures over
  a rollout's step (the rollout loop's judgement); ``POST .../versions/forget``: drop them.

The answers are JSON written with :func:`json.dumps` (a capacity may be infinite).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.deps import Internal, Services, ServicesDep
from controlplane.api.routes import AppName
from controlplane.errors import ServingUnavailableError
from controlplane.serving.loop import ServingLoop
from controlplane.serving.wire import status_to_json, window_to_json

__all__ = ["FeedIn", "dumps", "feed_document", "observations_document", "router"]

router = APIRouter(prefix="/internal/v1", tags=["internal"], include_in_schema=False)


# Refused as the public routes refuse them: a field no route reads, a time that is no time.
_INTERNAL = ConfigDict(extra="forbid")
# The most queries a batch cap may name (a profile's batch sizes stay far below it).
MAX_BATCH_CAP = 1 << 16
# The ids the store keeps (its integer columns).
_ID = Annotated[int, Query(ge=0, le=2**31 - 1)]


class FeedIn(BaseModel):
    model_config = _INTERNAL

    since_s: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = Field(default_factory=dict)
    # None (left out): the loops process does not know them yet (its switcher has not read the
    # store since it started), and the serving process keeps the ones it serves.
    gears: dict[str, tuple[int, int]] | None = None
    batch_caps: dict[str, dict[str, Annotated[int, Field(ge=1, le=MAX_BATCH_CAP)]]] | None = None
    recalibrated: list[str] = Field(default_factory=list)


class ForgetIn(BaseModel):
    model_config = _INTERNAL

    model: str
    instance_type: str


def _json(value: Any) -> Response:
    return Response(dumps(value), media_type="application/json")


def _serving(services: Services, app: str = "") -> ServingLoop:
    if services.serving is None:
        raise ServingUnavailableError(app, "this process runs no serving loop")
    return services.serving


def feed_document(services: Services, body: FeedIn) -> dict[str, Any]:
    """The feed's answer to ``body`` (module docstring), with its effects (the gears set, the
    recalibrated apps forgotten): what the route and the fast path
    (:mod:`controlplane.api.fast_internal`) answer. Cheap and non-blocking: it runs on the
    serving loop's event loop on the fast path."""
    serving = _serving(services)
    if services.gear_table is not None:
        if body.gears is not None:
            services.gear_table.set_all(body.gears)
        if body.batch_caps is not None:
            services.gear_table.set_caps(body.batch_caps)
    for app in body.recalibrated:
        services.resolver.invalidate(app)
    statuses = {status.app: status for status in serving.statuses()}
    apps: dict[str, Any] = {}
    for app in serving.served_apps():
        arrivals = serving.observations.arrival_s_since(app, body.since_s.get(app))
        status = statuses.get(app)
        apps[app] = {
            "arrivals_s": arrivals.tolist(),
            "status": status_to_json(status) if status is not None else None,
        }
    return {"now_s": serving.clock.now_s(), "apps": apps}


def observations_document(services: Services, app: str) -> dict[str, Any]:
    """``app``'s batch service times, API times and this serving process's CPU per query (the
    calibration's), as the route and the fast path answer them."""
    serving = _serving(services, app)
    found = serving.observations
    batch_times = [
        [model, instance_type, {str(size): times for size, times in by_size.items()}]
        for (model, instance_type), by_size in found.batch_times_ms(app).items()
    ]
    return {
        "batch_times_ms": batch_times,
        "api_times_ms": found.api_times_ms(app),
        "serving_cpu_ms": found.serving_cpu_ms(app, serving.clock.now_s()),
    }


def dumps(value: Any) -> bytes:
    """An internal answer's body: :func:`json.dumps` (a capacity may be infinite, which JSON's
    strict writers refuse)."""
    return json.dumps(value).encode()


@router.post("/feed")
def feed(body: FeedIn, services: ServicesDep, _who: Internal) -> Response:
    return _json(feed_document(services, body))


@router.get("/apps/{app}/observations")
def observations(app: AppName, services: ServicesDep, _who: Internal) -> Response:
    return _json(observations_document(services, app))


@router.post("/apps/{app}/forget-batch-times", status_code=204)
def forget_batch_times(
    app: AppName, body: ForgetIn, services: ServicesDep, _who: Internal
) -> Response:
    _serving(services, app).observations.forget_batch_times(app, body.model, body.instance_type)
    return Response(status_code=204)


@router.post("/apps/{app}/forget-api-times", status_code=204)
def forget_api_times(app: AppName, services: ServicesDep, _who: Internal) -> Response:
    _serving(services, app).observations.forget_api_times(app)
    return Response(status_code=204)


@router.get("/apps/{app}/versions")
def versions(
    app: AppName, rollout_id: _ID, step_index: _ID, services: ServicesDep, _who: Internal
) -> Response:
    figures = _serving(services, app).versions.figures(app, rollout_id, step_index)
    return _json({version: found.to_json() for version, found in figures.items()})


@router.post("/apps/{app}/versions/forget", status_code=204)
def forget_versions(app: AppName, services: ServicesDep, _who: Internal) -> Response:
    _serving(services, app).versions.forget(app)
    return Response(status_code=204)


@router.post("/apps/{app}/window")
def take_window(app: AppName, services: ServicesDep, _who: Internal) -> Response:
    window = _serving(services, app).take_window(app)
    return _json(window_to_json(window) if window is not None else None)
