"""The HTTP/1.1 protocol ``heteroplane serve`` runs uvicorn with: uvicorn's h11 protocol, reading
request heads up to :data:`~controlplane.api.limits.MAX_HEAD_READ_BYTES`, that answers a head
past that 431 Request Header Fields Too Large (RFC 6585 section 5) with the API's error body.

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

from controlplane.api.limits import MAX_HEAD_READ_BYTES

__all__ = ["LINGER_S", "HeadLimitedH11Protocol", "server_options"]

# How long a connection whose head was refused is read (and dropped) before it is closed.
LINGER_S = 5.0
_TOO_LARGE = 431


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
        body = json.dumps(
            {
                "error": {
                    "code": "headers_too_large",
                    "message": f"the request's head is larger than {self._head_limit:,} bytes",
                    "field": None,
                }
            },
            separators=(",", ":"),
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = b"Request Header Fields Too Large"
        for event in (
            h11.Response(status_code=_TOO_LARGE, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)


def server_options() -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments: this protocol and the head read limit."""
    return {"http": HeadLimitedH11Protocol, "h11_max_incomplete_event_size": MAX_HEAD_READ_BYTES}
