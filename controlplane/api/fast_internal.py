"""The loops process's frequent reads of a serving process, answered without FastAPI's
per-request machinery: ``POST /internal/v1/feed`` (every ``loops_pull_s``, 100 ms by default)
and ``GET /internal/v1/apps/{app}/observations`` (the calibration's, every tick).

Through FastAPI each of these went through a dozen ASGI layers, its dependencies (the token
check, the services) and the thread pool (a hop to another thread, which then holds the
interpreter while the serving loop's queries wait for it): on the 2-core machine, at 330
queries a second of a user's ONNX model, 6-7% of the serving process's CPU samples were that
machinery, and none after (py-spy; docs/serving.md, "Through the API").
:class:`FastInternalMiddleware` answers them itself on the event loop when nothing about the
request is unusual:

- the request shows the settings' ``internal_token`` (the secret the loops process is given;
  compared in constant time), and the process runs a serving loop;
- the feed's body is whole within :data:`MAX_FEED_BYTES` and valid as the route's
  :class:`~controlplane.api.routes.internal.FeedIn`, and the gears it sets need no read of the
  store (:meth:`~controlplane.loops.live_gears.GearTable.reads_store`: a gear of a plan not
  parsed yet is set by the route, in the thread pool, as before);
- then the answer is the route's own (:func:`~controlplane.api.routes.internal.feed_document`,
  :func:`~controlplane.api.routes.internal.observations_document`), counted as the route's
  answer would be (:class:`~controlplane.api.counters.RequestCountingMiddleware`).

Anything else (an admin token, another internal route, a body the checks refuse) goes to
FastAPI unchanged, with the body read so far handed on: the route answers it as it always did,
errors included.
"""

from __future__ import annotations

import re

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.deps import Services, shows_internal_secret
from controlplane.api.fast_infer import read_up_to, replay, send_ok
from controlplane.api.limits import mark_authenticated
from controlplane.api.routes import APP_NAME_MAX, APP_NAME_PATTERN
from controlplane.api.routes.internal import (
    FeedIn,
    dumps,
    feed_document,
    observations_document,
)

__all__ = ["MAX_FEED_BYTES", "FastInternalMiddleware"]

_FEED = "/internal/v1/feed"
_OBSERVATIONS = re.compile(f"/internal/v1/apps/({APP_NAME_PATTERN})/observations")
# A feed body holds an app's newest arrival, its gear and its name at most, per app: far below
# this for any fleet; a larger one goes to the route.
MAX_FEED_BYTES = 1 << 20
_JSON = [(b"content-type", b"application/json")]


class FastInternalMiddleware:
    """Answer the loops' feed and observation reads outside FastAPI (module docstring).

    ``services`` is the app's :class:`~controlplane.api.deps.Services`."""

    def __init__(self, app: ASGIApp, services: Services) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/internal/"):
            await self.app(scope, receive, send)
            return
        services = self.services
        path, method = scope["path"], scope["method"]
        app = None
        if method == "GET":
            match = _OBSERVATIONS.fullmatch(path)
            app = match.group(1) if match is not None else None
        feed = method == "POST" and path == _FEED
        if (
            services.serving is None
            or not (feed or (app is not None and len(app) <= APP_NAME_MAX))
            or not shows_internal_secret(services.settings.internal_token, _authorization(scope))
        ):
            await self.app(scope, receive, send)
            return
        mark_authenticated(scope)
        counter = services.requests
        if app is not None:
            payload = dumps(observations_document(services, app))
            counter.add(app, 200)
            await send_ok(send, payload, _JSON)
            return
        body, more = await read_up_to(receive, MAX_FEED_BYTES)
        if body is None:  # the client went away
            return
        parsed = None
        if not more and len(body) <= MAX_FEED_BYTES:
            try:
                parsed = FeedIn.model_validate_json(body)
            except ValidationError:
                parsed = None
        table = services.gear_table
        if parsed is None or (
            table is not None and parsed.gears is not None and table.reads_store(parsed.gears)
        ):
            await self.app(scope, replay(body, more, receive), send)
            return
        payload = dumps(feed_document(services, parsed))
        counter.add("", 200)
        await send_ok(send, payload, _JSON)


def _authorization(scope: Scope) -> str | None:
    """The request's ``Authorization`` value, None when it sent none."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None
