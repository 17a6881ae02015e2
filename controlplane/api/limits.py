"""How big a request body may be: :data:`MAX_BODY_BYTES`, enforced before a route reads it.

Every body the API takes is a small JSON document (an app spec is a few hundred bytes), so a
megabyte is generous; without a limit, one request could make the server buffer gigabytes. A
declared ``Content-Length`` over the limit is answered 413 at once; a body sent without one
(chunked) is counted as it arrives and cut off at the limit, which the route sees as a body it
cannot parse (400).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.errors import error_response

__all__ = ["MAX_BODY_BYTES", "BodySizeLimitMiddleware"]

MAX_BODY_BYTES = 1 << 20


class BodyTooLargeError(Exception):
    """A body that grew past the limit while it was read."""


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                too_large = False  # the server's parser deals with a malformed header
            if too_large:
                response = error_response(
                    413, "too_large", f"the body is larger than {self.max_bytes:,} bytes"
                )
                await response(scope, receive, send)
                return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(f"the body is larger than {self.max_bytes:,} bytes")
            return message

        await self.app(scope, counting_receive, send)
