"""How big a request may be: its body (:data:`MAX_BODY_BYTES`, enforced before a route reads
it) and its header fields (:data:`MAX_HEADER_BYTES`, enforced before anything else looks at them).

Every body the API takes is a small JSON document (an app spec is a few hundred bytes), so a
megabyte is generous; without a limit, one request could make the server buffer gigabytes. A
declared ``Content-Length`` over the limit is answered 413 at once; a body sent without one
(chunked) is counted as it arrives and cut off at the limit with the same 413, whatever the
route made of the cut (FastAPI's body parsing would answer 400). The exceptions are a model push
(``POST /v1/models/{name}``), whose route streams the body to a file under a limit of its own
(``model_max_bytes``), and an Open Inference Protocol query, whose route reads it under its
model's limit (:func:`controlplane.api.routes.oip.body_limit`): the middleware lets them by.

Header fields over :data:`MAX_HEADER_BYTES` in all are answered 431 Request Header Fields Too
Large (RFC 6585 section 5) with the API's error body. The HTTP server must let such a head
through for this middleware to see it: ``heteroplane serve`` reads heads up to
:data:`MAX_HEAD_READ_BYTES` (and answers 431 itself past that:
:mod:`controlplane.service.protocol`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.errors import error_response

__all__ = [
    "CONNECTION_EXTENSION",
    "MAX_BODY_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_HEAD_READ_BYTES",
    "MAX_JSON_DEPTH",
    "BodySizeLimitMiddleware",
    "HeaderSizeLimitMiddleware",
    "header_bytes",
    "json_depth_exceeds",
    "mark_authenticated",
]

MAX_BODY_BYTES = 1 << 20
# A token and a cookie take well under a kilobyte; 32 KiB is nginx's largest default head
# (large_client_header_buffers 4 x 8k).
MAX_HEADER_BYTES = 32 << 10
# How much of a head the HTTP server reads before it gives up on the request (the default of the
# setting http_head_max_bytes): more than MAX_HEADER_BYTES, so that a head between the two
# reaches the middleware, yet small enough that a thousand clients with unfinished heads hold
# tens of megabytes, not gigabytes.
MAX_HEAD_READ_BYTES = 64 << 10
# How deep a JSON body may nest (arrays and objects), checked before it is decoded: a tensor of
# eight dimensions in a request document is a dozen levels.
MAX_JSON_DEPTH = 64
# The scope extension under which heteroplane serve's HTTP protocol hands the route its
# connection (controlplane.service.protocol); mark_authenticated tells it a token was valid.
CONNECTION_EXTENSION = "heteroplane.connection"
# The scope key under which heteroplane serve's HTTP protocol stamps a request's head as whole
# (time.monotonic(), in the socket read that completed it): the receipt stamp where the serving
# loop's clock is the system's (controlplane.api.routes.infer.stamp_receipt).
HEAD_S = "heteroplane.head_s"


class BodyTooLargeError(Exception):
    """A body that grew past the limit while it was read."""


class BodySizeLimitMiddleware:
    """Answer 413 to a body over ``max_bytes``; ``exempt(scope)`` names the requests whose route
    streams the body and enforces a limit of its own (a model push: ``model_max_bytes``)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = MAX_BODY_BYTES,
        exempt: Callable[[Scope], bool] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.exempt is not None and self.exempt(scope)):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                too_large = False  # the server's parser deals with a malformed header
            if too_large:
                await self._too_large()(scope, receive, send)
                return
        seen = 0
        started = overflowed = False

        async def counting_receive() -> Message:
            nonlocal seen, overflowed
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    overflowed = True
                    raise BodyTooLargeError(f"the body is larger than {self.max_bytes:,} bytes")
            return message

        async def answering_send(message: Message) -> None:
            # A body cut off at the limit (sent chunked, without a length) is the same 413 as a
            # declared length over it, whatever the route made of the error (FastAPI's body
            # parsing answers 400): its answer is replaced.
            nonlocal started
            if overflowed:
                if not started:
                    started = True
                    await self._too_large()(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, answering_send)
        except BodyTooLargeError:
            # A route that reads the body itself let the error by.
            if started:
                raise
            await self._too_large()(scope, receive, send)

    def _too_large(self) -> Response:
        return error_response(413, "too_large", f"the body is larger than {self.max_bytes:,} bytes")


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    """The size of header fields on the wire: ``name: value`` and CRLF per field."""
    return sum(len(name) + len(value) + 4 for name, value in headers)


class HeaderSizeLimitMiddleware:
    """Answer 431 when the request's header fields are over ``max_bytes`` in all."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and header_bytes(scope.get("headers") or []) > self.max_bytes:
            response = error_response(
                431,
                "headers_too_large",
                f"the request's header fields are larger than {self.max_bytes:,} bytes",
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def mark_authenticated(scope: Scope) -> None:
    """Tell the HTTP protocol that the request in ``scope`` showed a valid token: its
    connection leaves the count of unauthenticated ones
    (:class:`controlplane.service.protocol.ConnectionGuard`). Nothing under another server."""
    connection: Any = (scope.get("extensions") or {}).get(CONNECTION_EXTENSION)
    if connection is not None:
        connection.authenticated()


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``body`` nests arrays and objects deeper than ``limit``, counted
    without decoding it (brackets inside strings do not count), so that a body of a hundred
    thousand ``[`` is refused before a recursive decoder sees it.

    >>> json_depth_exceeds(b'{"a": [[1], "[[[["]}', 3), json_depth_exceeds(b'[[["[[["]]]', 2)
    (False, True)
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case, without the scan
    # Escaped backslashes and quotes are not string delimiters: blank them, then a byte is in a
    # string when an odd number of quotes precede it.
    text = np.frombuffer(body.replace(b"\\\\", b"__").replace(b'\\"', b"__"), dtype=np.uint8)
    step = _BRACKET_STEP[text]
    step[(np.cumsum(text == _QUOTE, dtype=np.int64) & 1).astype(bool)] = 0
    return bool(np.cumsum(step, dtype=np.int64).max(initial=0) > limit)


_QUOTE = ord('"')
# +1 for each opening bracket, -1 for each closing one, 0 for any other byte.
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1
