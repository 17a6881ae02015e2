"""A query's receipt is stamped where ``heteroplane serve``'s protocol read its head, not where
the event loop got round to calling the app: the protocol stamps the scope
(:data:`~controlplane.api.limits.HEAD_S`), and the receipt middleware and the inference fast
path take that stamp where the serving loop's clock is the system's
(:func:`~controlplane.api.routes.infer.stamp_receipt`). Under load the wait between the two is
the serving process's queue, which the service's own time, its admission and its SLO count
must see."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from controlplane.api.limits import HEAD_S
from controlplane.api.routes.infer import RECEIVED_S, ReceivedAtMiddleware, stamp_receipt
from controlplane.service.protocol import server_options
from tests.recording_transport import RecordingTransport

REQUEST = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
APP_CLOCK = -1.0  # what a clock that is not the protocol's reads: told apart from any stamp


def _scopes_through_the_protocol(app: Any) -> list[dict[str, Any]]:
    """Send two requests to ``app`` through the protocol, the loop held up after each is read;
    the scopes the app was called with."""
    seen: list[dict[str, Any]] = []

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope, called_s=time.monotonic()))
        await app(scope, receive, send)

    async def main() -> None:
        config = uvicorn.Config(recording, **server_options())
        config.load()
        protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=ServerState(), app_state={}
        )
        protocol.connection_made(RecordingTransport())
        try:
            for _ in range(2):
                protocol.data_received(REQUEST)
                # The loop busy elsewhere before it runs the request's task: the stamp was
                # taken in the read, before ``read_s``; the app is called after it.
                read_s = time.monotonic()
                while time.monotonic() <= read_s:
                    pass
                for _ in range(5):
                    await asyncio.sleep(0)
        finally:
            protocol.connection_lost(None)
            await asyncio.sleep(0)

    asyncio.run(main())
    return seen


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_the_protocol_stamps_each_requests_head_before_the_app_is_called() -> None:
    scopes = _scopes_through_the_protocol(_answer)
    assert len(scopes) == 2
    for scope in scopes:
        assert isinstance(scope[HEAD_S], float)
        assert scope[HEAD_S] < scope["called_s"]
    assert scopes[0][HEAD_S] < scopes[1][HEAD_S]  # each request its own (kept alive)


def _receipts(head_stamps: bool) -> tuple[float, float]:
    """(the receipt the app saw, the protocol's stamp) of a request through the receipt
    middleware on a clock that reads :data:`APP_CLOCK`."""
    stamps: list[float] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        stamps.append(scope[RECEIVED_S])
        await _answer(scope, receive, send)

    middleware = ReceivedAtMiddleware(app, clock_s=lambda: APP_CLOCK, head_stamps=head_stamps)
    scope = _scopes_through_the_protocol(middleware)[0]
    return stamps[0], scope[HEAD_S]


def test_the_receipt_is_the_heads_stamp_where_the_clock_is_the_systems() -> None:
    received, head = _receipts(head_stamps=True)
    assert received == head
    received, head = _receipts(head_stamps=False)  # a fake clock's: the app's call, on it
    assert received == APP_CLOCK


def test_stamp_receipt_takes_the_clock_without_a_heads_stamp() -> None:
    scope: dict[str, Any] = {"type": "http"}
    assert stamp_receipt(scope, lambda: 7.0, head_stamps=True) == 7.0  # not served by the protocol
    assert scope[RECEIVED_S] == 7.0
    stamped: dict[str, Any] = {"type": "http", HEAD_S: 3.5}
    assert stamp_receipt(stamped, lambda: 7.0, head_stamps=True) == 3.5
    assert stamp_receipt(stamped, lambda: 7.0, head_stamps=False) == 7.0
