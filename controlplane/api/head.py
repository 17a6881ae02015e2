"""``HEAD`` wherever ``GET`` is served (RFC 9110 section 9.3.2: the same answer without its
content).

FastAPI's routes name their methods, and a ``GET`` route does not take ``HEAD``: a load
balancer's or a monitor's ``HEAD /healthz`` was answered 405. This layer hands a ``HEAD``
request on as a ``GET`` and sends the answer's status and headers (its ``Content-Length``
included, as the protocol asks) without its body. A path with no ``GET`` answers as it would a
``GET`` (404, or 405 naming the methods it has).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HeadAsGetMiddleware"]


class HeadAsGetMiddleware:
    """Answer ``HEAD`` as ``GET``, less the body (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headless(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headless)
