"""The HTTP/1.1 protocol ``heteroplane serve`` runs uvicorn with: uvicorn's httptools protocol
(h11's where httptools is not installed) with bounds on what one client may hold
(:class:`ConnectionLimits`, from the settings ``http_*``; docs/operations.md, "Connection
limits"):

- a head longer than ``head_max_bytes`` is answered 431 Request Header Fields Too Large (RFC
  6585 section 5); one not whole within ``head_timeout_s`` is answered 408 Request Timeout (a
  connection that sent nothing is closed without a word);
- a body arriving slower than ``body_min_rate_bytes_per_s`` is answered 408 and closed;
- at most ``unauthenticated_max`` connections that have not yet shown a valid token are open: a
  new one past it closes the least recently active of them (:class:`ConnectionGuard`), so that a
  flood of idle or slow connections costs a bounded amount of memory and never shuts out a
  client that asks and goes (``/healthz``, a load balancer's probe);
- an idle kept-alive connection is closed after ``keep_alive_s`` (75 s): longer than a load
  balancer keeps its own (:func:`server_options` says why).

The answers carry the API's error body (the Open Inference Protocol's ``{"error": "..."}`` on
``/v2``). A head over :data:`~controlplane.api.limits.MAX_HEADER_BYTES` but within the read limit
reaches the app, whose :class:`~controlplane.api.limits.HeaderSizeLimitMiddleware` answers the
431. After a refusal the protocol closes only its sending side (the answer goes out) and reads
and drops what the client still sends until it stops, or for :data:`LINGER_S`, before it closes
(Apache's "lingering close"): closing at once while the client still sends would make its
kernel answer a reset, and the client would never read the answer.

:func:`server_options` are the ``uvicorn.Config`` keyword arguments that select it. The h11
fallback (:class:`HeadLimitedH11Protocol`) keeps the head size limit only.

uvicorn has no public hook for these limits, so both classes subclass its protocol classes and
read their state: what they rely on, and the uvicorn versions it was checked on (pyproject.toml's
bounds), is pinned by ``tests/unit/test_dependency_pins.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from http import HTTPStatus
from importlib.util import find_spec
from typing import Any, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # imports httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is a dependency; h11 serves where it is missing
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from controlplane.api.errors import error_document
from controlplane.api.front_door import RETRY_AFTER_S, front_message
from controlplane.api.limits import CONNECTION_EXTENSION, HEAD_S, MAX_HEAD_READ_BYTES
from controlplane.api.routes import APP_NAME_MAX, APP_NAME_PATTERN
from controlplane.settings import Settings

# uvloop where it is installed (a dependency on every platform it builds for): the same
# asyncio API with its event loop, sockets and transports in C, which halves the loop's own
# share of each query's time at thousands a second; asyncio's loop where it is missing.
_LOOP = "uvloop" if find_spec("uvloop") is not None else "asyncio"

__all__ = [
    "LINGER_S",
    "ConnectionGuard",
    "ConnectionLimits",
    "HeadLimitedH11Protocol",
    "HeadLimitedHttpToolsProtocol",
    "HeldHeadTransport",
    "server_options",
]

# How long a connection whose head was refused is read (and dropped) before it is closed.
LINGER_S = 5.0
_TOO_LARGE = 431
_TOO_LARGE_REASON = b"Request Header Fields Too Large"


def _too_large_body(head_limit: int) -> bytes:
    return json.dumps(
        {
            "error": {
                "code": "headers_too_large",
                "message": f"the request's head is larger than {head_limit:,} bytes",
                "field": None,
            }
        },
        separators=(",", ":"),
    ).encode()


def _linger(transport: asyncio.Transport) -> None:
    """Close the sending side now (the answer goes out) and the connection after LINGER_S."""
    if transport.can_write_eof():
        transport.write_eof()
    asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class _HintedConnection(h11.Connection):
    """An h11 connection that remembers the status h11 suggests for the last protocol error
    (431 for a head longer than its buffer, 400 for other malformed input)."""

    error_status_hint: int | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.error_status_hint = error.error_status_hint
            raise


class HeadLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; a head over the read limit is answered 431, then lingered on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_READ_BYTES
        self.conn = _HintedConnection(h11.SERVER, max_incomplete_event_size=self._head_limit)
        self._lingering = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a refused head: dropped
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        assert isinstance(self.conn, _HintedConnection)
        if self.conn.error_status_hint != _TOO_LARGE:
            super().send_400_response(msg)
            return
        body = _too_large_body(self._head_limit)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=_TOO_LARGE, headers=headers, reason=_TOO_LARGE_REASON),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self._lingering = True
        _linger(self.transport)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long and how much a client may take (the settings ``http_*``: docs/service.md)."""

    head_timeout_s: float = 10.0
    head_max_bytes: int = MAX_HEAD_READ_BYTES
    body_min_rate_bytes_per_s: float = 1024.0
    body_rate_window_s: float = 10.0
    unauthenticated_max: int = 1000
    keep_alive_s: float = 75.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            head_timeout_s=settings.http_head_timeout_s,
            head_max_bytes=settings.http_head_max_bytes,
            body_min_rate_bytes_per_s=settings.http_body_min_rate_bytes_per_s,
            body_rate_window_s=settings.http_body_rate_window_s,
            unauthenticated_max=settings.http_unauthenticated_connections_max,
            keep_alive_s=settings.http_keep_alive_s,
        )


class _Guarded(Protocol):
    """What :class:`ConnectionGuard` needs of a connection."""

    def evict(self) -> None: ...


class ConnectionGuard:
    """The server's connections that have not shown a valid token, least recently active first;
    admitting one past ``limit`` evicts the first (one server's: no module state)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: OrderedDict[_Guarded, None] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def admit(self, connection: _Guarded) -> None:
        self._waiting[connection] = None
        while len(self._waiting) > self.limit:
            oldest, _ = self._waiting.popitem(last=False)
            self.evicted += 1
            oldest.evict()

    def touch(self, connection: _Guarded) -> None:
        if connection in self._waiting:
            self._waiting.move_to_end(connection)

    def forget(self, connection: _Guarded) -> None:
        self._waiting.pop(connection, None)


class HeldHeadTransport:
    """The transport as one request's cycle sees it: its first write (the response's head) is
    held until its next one (the body), and both go out in one write; what is still held at the
    end of the event loop's turn goes out then.

    uvicorn's cycle writes a response's head and its body with a write each, and each is a
    system call on the socket; past a thousand answers a second those calls were a fifth of
    the serving loop's time (a refusal is little else), so one call a response gives that much
    back. An answer is sent as two ASGI messages in the same turn (every answer of the fast
    path and of FastAPI's routes), so nothing waits longer; a streamed answer's head goes out at
    the end of the turn that started it, as it would have. Only ``write``, ``is_closing`` and
    ``close`` are what the cycle uses of a transport; ``close`` sends what is held first."""

    __slots__ = ("_held", "_loop", "_transport", "_writes")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._writes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._writes += 1
        if self._writes == 1:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        held, self._held = self._held, None
        self._transport.write(data if held is None else held + bytes(data))

    def flush(self) -> None:
        """Send what is held (nothing once the next write took it, or the socket closed)."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._transport.close()


def _json_answer(
    status: int,
    document: object,
    default_headers: list[tuple[bytes, bytes]],
    *,
    headers: tuple[bytes, ...] = (),
    close: bool = True,
) -> bytes:
    """A whole answer of ``status`` with the JSON ``document`` as its body, the server's
    ``default_headers`` and ``headers`` (whole ``name: value`` lines, without their line end);
    with ``close``, ``connection: close``."""
    body = json.dumps(document, separators=(",", ":")).encode()
    content = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    for name, value in default_headers:
        content.extend([name, b": ", value, b"\r\n"])
    for line in headers:
        content.extend([line, b"\r\n"])
    content.extend(
        [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
            b"connection: close\r\n" if close else b"",
            b"\r\n",
            body,
        ]
    )
    return b"".join(content)


def _error_answer(
    status: int, url: bytes, code: str, message: str, default_headers: list[tuple[bytes, bytes]]
) -> bytes:
    """A whole ``connection: close`` answer with the API's error body (the protocol's own on
    ``/v2``, :func:`controlplane.api.limits.error_document`)."""
    oip = url.startswith(b"/v2/") or url == b"/v2"
    return _json_answer(status, error_document(oip, code, message), default_headers)


class FrontRefusals(Protocol):
    """What the protocol asks before an inference request's cycle starts
    (:class:`controlplane.api.front_door.FrontDoor`)."""

    def refuse(self, app: str) -> bool: ...


# The plain inference routes the fast path answers (controlplane.api.fast_infer): an app's
# name in group 1 (/v1) or 3 (/v2).
_FRONT_PATH = re.compile(
    f"/v1/apps/({APP_NAME_PATTERN})/infer|/v2/models/({APP_NAME_PATTERN})/infer".encode()
)


def _overloaded_answer(
    app: str, oip: bool, keep_alive: bool, default_headers: list[tuple[bytes, bytes]]
) -> bytes:
    """A whole 429 answer to a query refused at the front, with the API's error body (the
    protocol's own on ``/v2``), as admission's refusals read."""
    return _json_answer(
        429,
        error_document(oip, "overloaded", front_message(app)),
        default_headers,
        headers=(b"retry-after: " + str(RETRY_AFTER_S).encode("ascii"),),
        close=not keep_alive,
    )


if HttpToolsProtocol is not None:

    class HeadLimitedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with the limits of :class:`ConnectionLimits`.

        - A head still incomplete after ``head_max_bytes`` is answered 431, then lingered on.
          Its bytes are counted from the chunk after the previous message ended to the chunk in
          which the parser completes the head; a chunk is at most what one socket read returns
          (256 KiB in asyncio), so at most that much more than the limit is buffered.
        - A head must arrive whole within ``head_timeout_s`` of the connection opening (or of
          its first byte after a previous answer): else 408 and closed (closed without a word
          when nothing arrived). Between requests uvicorn's keep-alive timeout closes an idle
          connection.
        - A body must arrive at ``body_min_rate_bytes_per_s`` or faster over each
          ``body_rate_window_s`` while it is read (a window in which the app had reading
          paused, its buffer full, or the client waited for a 100 Continue does not count):
          else 408 (when nothing was answered yet) and closed.
        - At most ``unauthenticated_max`` connections that have not shown a valid token are
          open (:class:`ConnectionGuard`): the route's token check marks its connection through
          the scope's extension :data:`~controlplane.api.limits.CONNECTION_EXTENSION`.
        """

        limits = ConnectionLimits()
        guard: ConnectionGuard | None = None
        front: FrontRefusals | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_limit = self.limits.head_max_bytes
            self._head_bytes = 0
            self._in_head = True
            self._lingering = False
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._body_bytes = 0
            self._authenticated = False
            # A request refused at the front (its app's name, /v2, keep-alive) while its body
            # is read and dropped.
            self._shed: tuple[str, bool, bool] | None = None

        # The connection's life

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_head_timer()
            if self.guard is not None:
                self.guard.admit(self)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timers()
            if self.guard is not None:
                self.guard.forget(self)
            super().connection_lost(exc)

        def evict(self) -> None:
            """Closed to make room for a newer connection (:class:`ConnectionGuard`)."""
            self._stop_timers()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def authenticated(self) -> None:
            """A request on this connection showed a valid token: out of the guard's count."""
            if not self._authenticated:
                self._authenticated = True
                if self.guard is not None:
                    self.guard.forget(self)

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # the rest of a refused head: dropped
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_timer is None:
                    self._start_head_timer()
            super().data_received(data)
            if (
                self._in_head
                and self._head_bytes > self._head_limit
                and not self.transport.is_closing()
            ):
                self._refuse(431, "headers_too_large", self._head_message())

        # The parser's callbacks

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._cancel_head_timer()
            if self.front is not None and self._refused_at_front(self.front):
                return
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.transport is self.transport:
                cycle.transport = HeldHeadTransport(self.transport, self.loop)  # type: ignore[assignment]
            if self.scope is not None:
                # The request's receipt: the socket read that completed its head, before the
                # event loop gets to the app's task (a wait the service's own time counts).
                self.scope[HEAD_S] = time.monotonic()  # type: ignore[literal-required]
                # The route's token check marks the connection through it (mark_authenticated).
                extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
                extensions[CONNECTION_EXTENSION] = self
            self._body_bytes = 0
            if self.limits.body_min_rate_bytes_per_s > 0:
                self._body_timer = self.loop.call_later(
                    self.limits.body_rate_window_s, self._check_body_rate
                )

        def on_body(self, body: bytes) -> None:
            if self._shed is not None:
                return  # a refused query's body: dropped
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self._shed is not None:
                self._answer_shed(self._shed)
                return
            super().on_message_complete()
            self._cancel_body_timer()
            self._in_head = True
            self._head_bytes = 0

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.guard is not None and not self._authenticated:
                self.guard.touch(self)

        # The front's refusals (controlplane.api.front_door)

        def _refused_at_front(self, front: FrontRefusals) -> bool:
            """Whether the request whose head was just read is a plain inference query that
            the front refuses (then its body is read and dropped, and the 429 written once it
            has ended, as the cycle would have answered). Never a request that another one on
            the connection is still being answered before (a pipelined one), nor one whose
            client waits for a 100 Continue."""
            url = self.url
            if not (url.startswith((b"/v1/apps/", b"/v2/models/")) and url.endswith(b"/infer")):
                return False
            cycle = self.cycle
            if (
                self.expect_100_continue
                or (cycle is not None and not cycle.response_complete)
                or self.pipeline
                or self.parser.get_method() != b"POST"
            ):
                return False
            match = _FRONT_PATH.fullmatch(url)
            if match is None:
                return False
            oip = match.group(1) is None
            app = (match.group(3) if oip else match.group(1)).decode("ascii")
            if len(app) > APP_NAME_MAX or not front.refuse(app):
                return False
            keep_alive = self.parser.get_http_version() == "1.1" and self.parser.should_keep_alive()
            self._shed = (app, oip, keep_alive)
            # The body's deadline: the head's timeout again (a refused query's body that never
            # ends is answered 408 and closed, as a head that never ends is).
            self._start_head_timer()
            return True

        def _answer_shed(self, shed: tuple[str, bool, bool]) -> None:
            app, oip, keep_alive = shed
            self._shed = None
            self._cancel_head_timer()
            self._in_head = True
            self._head_bytes = 0
            if self.transport.is_closing():
                return
            self.transport.write(
                _overloaded_answer(app, oip, keep_alive, self.server_state.default_headers)
            )
            if keep_alive:
                self.on_response_complete()  # the next request, or the keep-alive timeout
            else:
                self.transport.close()

        # The limits

        def _head_message(self) -> str:
            return f"the request's head is larger than {self._head_limit:,} bytes"

        def _start_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(
                self.limits.head_timeout_s, self._head_timed_out
            )

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _stop_timers(self) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self._lingering:
                return
            if self._head_bytes == 0:
                self.transport.close()  # nothing asked: nothing to answer
                return
            timeout = self.limits.head_timeout_s
            self._refuse(
                408, "request_timeout", f"the request's head did not arrive within {timeout:g} s"
            )

        def _check_body_rate(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if cycle is None or not cycle.more_body or self.transport.is_closing():
                return
            window = self.limits.body_rate_window_s
            needed = self.limits.body_min_rate_bytes_per_s * window
            # Not the client's fault: the app holds reading back (its buffer is full), or the
            # client waits for the 100 Continue the app's first read sends.
            waiting = self.flow.read_paused or cycle.waiting_for_100_continue
            if self._body_bytes < needed and not waiting:
                if cycle.response_started:
                    self.transport.close()
                    return
                cycle.disconnected = True  # the app's answer, if any, goes nowhere
                cycle.message_event.set()
                self._refuse(
                    408,
                    "request_timeout",
                    f"the body arrived slower than {self.limits.body_min_rate_bytes_per_s:g}"
                    f" bytes/s over {window:g} s",
                )
                return
            self._body_bytes = 0
            self._body_timer = self.loop.call_later(window, self._check_body_rate)

        def _refuse(self, status: int, code: str, message: str) -> None:
            """Answer ``status`` and stop reading; the connection closes after a linger."""
            self._stop_timers()
            self.transport.write(
                _error_answer(
                    status,
                    getattr(self, "url", b""),
                    code,
                    message,
                    self.server_state.default_headers,
                )
            )
            self._lingering = True
            _linger(self.transport)

else:  # pragma: no cover
    HeadLimitedHttpToolsProtocol = None  # type: ignore[assignment,misc]


def server_options(
    limits: ConnectionLimits | None = None, front: FrontRefusals | None = None
) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments: the protocol (httptools' with ``limits``, default
    :class:`ConnectionLimits`, and a :class:`ConnectionGuard` of its own; h11's, with the head
    read limit only, where httptools is missing), the head read limit, the keep-alive timeout
    and asyncio's loop. ``front``: what refuses inference queries as their head is read, past
    saturation (the service's :class:`~controlplane.api.front_door.FrontDoor`; None: none is).

    The keep-alive timeout is uvicorn's 5 s unless set: a client or load balancer that keeps
    an idle connection longer than the server (an ALB keeps its backend connections for its
    idle timeout, 60 s by default) sends, now and then, a request on a connection the server
    is closing at that moment, and that request fails (the ALB answers 502). The side that
    closes idle connections must be the client's, so the server's timeout is the longer
    (:attr:`ConnectionLimits.keep_alive_s`, 75 s)."""
    limits = limits if limits is not None else ConnectionLimits()
    protocol: type[asyncio.Protocol] = HeadLimitedH11Protocol
    if HeadLimitedHttpToolsProtocol is not None:
        # A class per server: its guard counts that server's connections only.
        protocol = type(
            "GuardedHttpToolsProtocol",
            (HeadLimitedHttpToolsProtocol,),
            {
                "limits": limits,
                "guard": ConnectionGuard(limits.unauthenticated_max),
                "front": front,
            },
        )
    return {
        "http": protocol,
        "loop": _LOOP,
        "h11_max_incomplete_event_size": limits.head_max_bytes,
        "timeout_keep_alive": limits.keep_alive_s,
    }
