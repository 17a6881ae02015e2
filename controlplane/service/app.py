"""The FastAPI application: :func:`create_app` wires the routes, the error mapping, the request
counters and the scheduler's lifetime around the parts it is handed.

A factory with no module-level state: the composition root (``heteroplane serve``, or a test)
builds the settings, the store, the clock and the scheduler and passes them in; each call
returns an independent app. The lifespan starts the serving loop and the scheduler (when given)
and stops them, waiting for running jobs, when the server stops. With a leader lease
(:class:`~controlplane.loops.leadership.Leadership`), the lifespan runs the lease instead, which
starts the scheduler only while this replica is the leader. Routes are under ``/v1`` except
``/healthz``, ``/metrics``, the Open Inference Protocol's ``/v2``
(:mod:`controlplane.api.routes.oip`) and the dashboard (``/dashboard``:
:mod:`controlplane.dashboard`, signed in with a token kept in a cookie, not in the OpenAPI
document); the OpenAPI document is at ``/openapi.json`` (and a browsable page at ``/docs``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane import __version__
from controlplane.api.counters import RequestCounter, RequestCountingMiddleware
from controlplane.api.deps import Services
from controlplane.api.disconnect import CancelOnDisconnect
from controlplane.api.errors import (
    OipErrorShapeMiddleware,
    error_document,
    install_error_handlers,
    is_oip_path,
)
from controlplane.api.fast_infer import FastInferMiddleware, TokenCheck
from controlplane.api.fast_internal import FastInternalMiddleware
from controlplane.api.forwarding import Forwarder, ForwardingMiddleware
from controlplane.api.front_door import FrontDoor
from controlplane.api.head import HeadAsGetMiddleware
from controlplane.api.limits import BodySizeLimitMiddleware, HeaderSizeLimitMiddleware
from controlplane.api.routes import (
    apps,
    budget,
    events,
    fleet,
    health,
    infer,
    internal,
    models,
    oip,
    plans,
    rollouts,
)
from controlplane.apps.resolver import AppResolver
from controlplane.clock import Clock, SystemClock
from controlplane.dashboard import install_dashboard
from controlplane.db.store import Store
from controlplane.errors import ControlPlaneError
from controlplane.loops.leadership import Leadership
from controlplane.loops.live_gears import GearTable
from controlplane.loops.scheduler import Scheduler
from controlplane.registry import Registry, registry_from_settings
from controlplane.registry.inspection import end_orphaned_inspectors
from controlplane.serving.loop import ServingLoop
from controlplane.serving.owners import DispatchOwners
from controlplane.serving.throttle import FrontThrottle
from controlplane.settings import Settings
from controlplane.spec import AppSpec
from provisioners.base import Provisioner

__all__ = ["create_app", "sweep_leftovers"]

logger = logging.getLogger(__name__)

_DESCRIPTION = (
    "The heteroplane control plane: register apps, preview and apply plans, set budgets, and"
    " watch fleets. Every route but /healthz needs `Authorization: Bearer <token>` (make one"
    ' with `heteroplane token create`). Errors are `{"error": {"code", "message",'
    ' "field"}}`. See docs/api.md.'
)


def create_app(
    settings: Settings,
    store: Store,
    clock: Clock,
    scheduler: Scheduler | None = None,
    serving: ServingLoop | None = None,
    resolver: AppResolver | None = None,
    leadership: Leadership | None = None,
    budget_changed: Callable[[str], object] | None = None,
    registry: Registry | None = None,
    provisioner: Provisioner | None = None,
    gear_table: GearTable | None = None,
    owners: DispatchOwners | None = None,
    serving_feed_down_s: Callable[[], float | None] | None = None,
) -> FastAPI:
    """The API over ``store``; ``scheduler`` and ``serving`` (if any) run while the app is
    served (without a serving loop the inference route answers 503). ``resolver`` is the
    service's one (the loops', carrying the calibrated profiles); a new one by default. With
    ``leadership``, the scheduler runs only while this replica holds the leader lease;
    ``budget_changed(app)`` runs after each budget change (the gear switcher's). ``registry``
    serves ``/v1/models`` (default: the settings' one, :func:`registry_from_settings`);
    ``provisioner`` launches profile runs' workers (``POST /v1/apps/{app}/profiles``; without
    one that route answers 503). ``gear_table``: the serving loop's gear hook when the loops run
    in a process of their own (``heteroplane serve --role serving``), set by them through
    ``/internal/v1/feed`` (:mod:`controlplane.api.routes.internal`). ``owners``: the dispatch
    leases of a serving process among several on one database; the inference requests of apps
    another one dispatches are forwarded to it (:mod:`controlplane.api.forwarding`).
    ``serving_feed_down_s``: a loops process's feed from the serving process, for ``/healthz``
    (:meth:`controlplane.loops.remote_serving.RemoteServing.down_for_s`)."""
    forwarder = (
        None
        if owners is None
        else Forwarder(owners, settings.oip_body_max_bytes, TokenCheck(store))
    )
    requests = RequestCounter()
    front_door = (
        FrontDoor(FrontThrottle(time.monotonic), serving, requests)
        if serving is not None and settings.serving_front_shed
        else None
    )
    services = Services(
        settings=settings,
        store=store,
        clock=clock,
        resolver=resolver
        if resolver is not None
        else AppResolver(
            settings.data_dir,
            artifacts=store.get_model_version,
            measured=store.get_app_profiles,
        ),
        requests=requests,
        scheduler=scheduler,
        serving=serving,
        leadership=leadership,
        budget_changed=budget_changed,
        registry=registry
        if registry is not None
        else registry_from_settings(settings, store, provisioner=provisioner),
        provisioner=provisioner,
        gear_table=gear_table,
        forwarder=forwarder,
        serving_feed_down_s=serving_feed_down_s,
        front_door=front_door,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(sweep_leftovers, services)
        if serving is not None:
            await serving.start()
        if owners is not None:
            await run_in_threadpool(owners.start)
        try:
            if scheduler is not None:
                if leadership is not None:
                    # Its first round may wait on the database: off the event loop.
                    await run_in_threadpool(leadership.start, scheduler)
                else:
                    scheduler.start()
            try:
                yield
            finally:
                if scheduler is not None:
                    # Waits for running jobs: off the event loop, which still serves the shutdown.
                    if leadership is not None:
                        await run_in_threadpool(leadership.stop)
                    else:
                        await run_in_threadpool(scheduler.shutdown, True)
        finally:
            if owners is not None:
                await run_in_threadpool(owners.close)
            if forwarder is not None:
                await forwarder.aclose()
            if serving is not None:
                await serving.stop()

    app = ServiceApp(
        title="heteroplane",
        version=__version__,
        description=_DESCRIPTION,
        lifespan=lifespan,
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.services = services
    install_error_handlers(app)
    app.add_middleware(HeadAsGetMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, exempt=_reads_own_body)
    app.add_middleware(HeaderSizeLimitMiddleware)
    # Outside the limits and the catch-all: their answers on /v2 take the protocol's shape too.
    app.add_middleware(OipErrorShapeMiddleware)
    app.add_middleware(RequestCountingMiddleware, counter=services.requests)
    # Added last, so called first: a query's latency runs from here (on the serving loop's
    # clock), before the body is read and the token checked in the thread pool.
    clock_s = serving.clock.now_s if serving is not None else time.monotonic
    # heteroplane serve's protocol stamps each request's head on time.monotonic(), the system
    # clock's: the receipt where the serving loop runs on it (not a test's fake clock).
    head_stamps = serving is None or isinstance(serving.clock, SystemClock)
    app.add_middleware(infer.ReceivedAtMiddleware, clock_s=clock_s, head_stamps=head_stamps)
    # In front of FastAPI (ServiceApp), outermost first: a query for an app another serving
    # process dispatches goes there whole (controlplane.api.forwarding); an inference request
    # whose client has gone is cancelled, and its query leaves the serving loop's queue
    # (controlplane.api.disconnect); the common inference request is answered without the
    # layers behind (controlplane.api.fast_infer); the loops process's feed and observation
    # reads too (controlplane.api.fast_internal). Anything else passes through unchanged.
    front: Any = FastInternalMiddleware(app.behind, services=services)
    front = FastInferMiddleware(front, services=services, clock_s=clock_s, head_stamps=head_stamps)
    front = CancelOnDisconnect(front)
    if forwarder is not None:
        front = ForwardingMiddleware(front, forwarder=forwarder)
    app.front = front
    routers = (health, apps, plans, budget, fleet, events, infer, models, oip, rollouts, internal)
    for module in routers:
        app.include_router(module.router)
    install_dashboard(app)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            _add_spec_schemas(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


class ServiceApp(FastAPI):
    """FastAPI with a front: the service's own outermost layers (``front``, set by
    :func:`create_app`) see every HTTP request before FastAPI's, which they reach through
    :meth:`behind`.

    FastAPI wraps the app's middleware in layers of its own (the server error handler and, in
    recent versions, telemetry and a body limit: each a frame and a wrapped ``send`` per
    request). Added with ``add_middleware``, the inference fast path sat inside them, and at a
    thousand requests a second and more they were about a quarter of the serving loop's time
    per request, answered or refused. In front, the fast path answers without them; what it
    passes on takes FastAPI's whole way as before. An exception escaping a front layer (a bug:
    they answer every failure of a query themselves) is uvicorn's to answer, a 500 and a logged
    traceback, as it is for an exception in FastAPI's own server error handler.

    A request whose path holds an encoded slash (``%2F``) is answered 404 here, before any
    layer: the server decodes the path before routing, so ``/v1/apps/demo%2Fplans`` was served
    as ``/v1/apps/demo/plans`` (demo's plans taken for an app) and ``/v2/models/demo%2Fready``
    as demo's readiness. No app or model name holds a ``/``, so such a path names nothing."""

    front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = _encoded_slash_answer(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        front = self.front
        if front is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # what the routes' helpers read (its exception handlers)
        await front(scope, receive, send)

    async def behind(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's own way: its layers, the app's middleware, its routes."""
        await super().__call__(scope, receive, send)


def _encoded_slash_answer(scope: Scope) -> JSONResponse | None:
    """The 404 of a path whose form as sent (``raw_path``, before the server decoded it) holds
    ``%2F`` or ``%2f``, in the API's error shape (the Open Inference Protocol's
    ``{"error": "..."}`` on ``/v2``); None for any other path."""
    raw: bytes = scope.get("raw_path") or b""
    path = raw.partition(b"?")[0]  # a query string may hold one
    if b"%2F" not in path and b"%2f" not in path:
        return None
    message = (
        f"no route {scope['method']} {path.decode('latin-1')}: a path with an encoded '/' (%2F)"
        " names nothing (no app or model name holds a '/')"
    )
    document = error_document(is_oip_path(scope["path"]), "not_found", message)
    return JSONResponse(document, status_code=404)


def _reads_own_body(scope: Scope) -> bool:
    """The routes that read their body under a limit of their own: a model push
    (``model_max_bytes``) and an Open Inference Protocol query (its model's 256 rows)."""
    return models.streams_own_body(scope) or oip.reads_own_body(scope)


def sweep_leftovers(services: Services) -> None:
    """What a crashed run of the service left, found and ended as it starts (docs/operations.md,
    "Crash guarantees"): model inspectors whose service is gone, staged uploads and
    half-written blobs of the registry. A failure is logged; the service starts all the same."""
    end_orphaned_inspectors()
    if services.registry is not None:
        try:
            services.registry.sweep()
        except (ControlPlaneError, OSError) as error:
            logger.error("startup sweep: the registry's leftovers stay: %s", error)


def _add_spec_schemas(document: dict[str, Any]) -> None:
    """Add the app spec's schema to the components, and make it the body of the operations
    that take one (POST and PUT /v1/apps: the route takes a mapping and validates it with
    ``controlplane.spec.validate_spec``, so that a problem names its field)."""
    schema = AppSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(schema.pop("$defs", {}))
    schemas["AppSpec"] = schema
    for item in document.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict) and operation.pop(apps.SPEC_BODY_MARK, False):
                operation["requestBody"] = {
                    "required": True,
                    "description": "the app spec document (docs/app-spec.md)",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/AppSpec"}}
                    },
                }
