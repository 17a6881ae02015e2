"""The HTTP/1.1 protocol ``heteroplane serve`` runs uvicorn with: uvicorn's httptools protocol
(h11's where httptools is not installed), reading request heads up to
:data:`~controlplane.api.limits.MAX_HEAD_READ_BYTES`, that answers a head past that 431 Request
Header Fields Too Large (RFC 6585 section 5) with the API's error body.

A head over :data:`~controlplane.api.limits.MAX_HEADER_BYTES` but within the read limit reaches
the app, whose :class:`~controlplane.api.limits.HeaderSizeLimitMiddleware` answers the 431. A
longer one never does: h11 stops buffering it and raises, and uvicorn answers 400 and closes the
connection while the client is still sending, so the client's kernel sees unread data discarded
and the client gets a connection reset instead of any answer. This protocol answers 431 instead,
closes only its sending side (the answer goes out) and reads and drops what the client still
sends until it stops, or for :data:`LINGER_S`, before it closes (Apache's "lingering close").

:func:`server_options` are the ``uvicorn.Config`` keyword arguments that select it; ``h11`` is
named rather than left to ``auto``, which would pick httptools where it is installed, whose
parser has a head limit of its own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # imports httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is a dependency; h11 serves where it is missing
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from controlplane.api.limits import MAX_HEAD_READ_BYTES

# asyncio's loop, not uvloop: the serving loop's worker transport
# (controlplane.serving.transport) requires an asyncio.Transport, which uvloop's are not.
_LOOP = "asyncio"

__all__ = ["LINGER_S", "HeadLimitedH11Protocol", "HeadLimitedHttpToolsProtocol", "server_options"]

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


if HttpToolsProtocol is not None:

    class HeadLimitedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol; a head still incomplete after the read limit
        (:data:`~controlplane.api.limits.MAX_HEAD_READ_BYTES`) is answered 431, then lingered on.

        The bytes of a head are counted from the chunk after the previous message ended to the
        chunk in which the parser completes the head; a chunk is at most what one socket read
        returns (256 KiB in asyncio and uvloop), so at most that much more than the limit is
        buffered before the answer."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_READ_BYTES
            self._head_bytes = 0
            self._in_head = True
            self._lingering = False

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # the rest of a refused head: dropped
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if (
                self._in_head
                and self._head_bytes > self._head_limit
                and not self.transport.is_closing()
            ):
                self._send_431()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True
            self._head_bytes = 0

        def _send_431(self) -> None:
            body = _too_large_body(self._head_limit)
            content = [b"HTTP/1.1 431 " + _TOO_LARGE_REASON + b"\r\n"]
            for name, value in self.server_state.default_headers:
                content.extend([name, b": ", value, b"\r\n"])
            content.extend(
                [
                    b"content-type: application/json\r\n",
                    b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                    b"connection: close\r\n",
                    b"\r\n",
                    body,
                ]
            )
            self.transport.write(b"".join(content))
            self._lingering = True
            _linger(self.transport)

else:  # pragma: no cover
    HeadLimitedHttpToolsProtocol = None  # type: ignore[assignment,misc]


def server_options() -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments: the protocol (httptools' where installed, else
    h11's), the head read limit and asyncio's event loop."""
    protocol: type[asyncio.Protocol] = HeadLimitedH11Protocol
    if HeadLimitedHttpToolsProtocol is not None:
        protocol = HeadLimitedHttpToolsProtocol
    return {
        "http": protocol,
        "loop": _LOOP,
        "h11_max_incomplete_event_size": MAX_HEAD_READ_BYTES,
    }
