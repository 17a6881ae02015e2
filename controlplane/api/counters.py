"""The API's request counters: answers by app and HTTP status, for ``GET /metrics``.

A plain ASGI middleware counts every HTTP answer once it has started, under the ``{app}`` path
parameter of the route that served it (``""`` for routes of no app, such as ``/v1/apps``), so
that ``heteroplane_api_requests_total{app="recs",status="409"}`` reads as "answers about recs".
Counters live in memory and restart from zero with the service (Prometheus handles resets);
``/metrics`` reads a :meth:`RequestCounter.snapshot` at each scrape
(:class:`controlplane.api.routes.health.RequestCollector`).

The app label comes from the URL, so it is bounded: an answer of 401 (anyone may send one), 403
(a token without the scope, answered before the app is looked up: any name it makes up) or 404
(an app that does not exist) is counted under ``""``, and past :data:`MAX_APP_LABELS` distinct
apps the rest are counted under ``"_other"``.
"""

from __future__ import annotations

import threading
from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["MAX_APP_LABELS", "OTHER_APPS", "RequestCounter", "RequestCountingMiddleware"]

MAX_APP_LABELS = 1000
OTHER_APPS = "_other"
# Answers whose URL's app is not known to exist (see the module docstring).
_NO_APP_STATUSES = frozenset({401, 403, 404})


class RequestCounter:
    """Thread-safe counts of answers by (app, status)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, int]] = Counter()
        self._apps: set[str] = set()

    def add(self, app: str, status: int) -> None:
        if status in _NO_APP_STATUSES:
            app = ""
        with self._lock:
            if app and app not in self._apps:
                if len(self._apps) >= MAX_APP_LABELS:
                    app = OTHER_APPS
                else:
                    self._apps.add(app)
            self._counts[(app, status)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        """The counts so far, by (app, status)."""
        with self._lock:
            return dict(self._counts)


class RequestCountingMiddleware:
    """Count each HTTP answer in ``counter`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, counter: RequestCounter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The router has filled in the path parameters by the time an answer starts.
                params = scope.get("path_params") or {}
                app = params.get("app", "")
                self.counter.add(app if isinstance(app, str) else "", int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
