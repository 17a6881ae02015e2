"""An answer is one write on the socket: the response's head is held until its body
(:class:`~controlplane.service.protocol.HeldHeadTransport`), through the protocol ``heteroplane
serve`` runs, on a recording transport. A streamed answer's head still goes out at the end of the
turn that started it, and a close sends what is held first."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

from controlplane.service.protocol import HeldHeadTransport, server_options
from tests.recording_transport import RecordingTransport, drive

REQUEST = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"


def _serve(app: Any, scenario: Any) -> None:
    drive(uvicorn.Config(app, **server_options()), scenario)


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_an_answer_sent_at_once_is_one_write_of_head_and_body() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]}
        )
        await send({"type": "http.response.body", "body": b"hello"})

    async def scenario(protocol: Any, transport: RecordingTransport) -> None:
        protocol.data_received(REQUEST)
        await _turns()
        assert len(transport.writes) == 1, transport.writes
        (answer,) = transport.writes
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nhello")
        protocol.data_received(REQUEST)  # kept alive: the next answer is one write too
        await _turns()
        assert len(transport.writes) == 2 and transport.writes[1] == answer

    _serve(app, scenario)


def test_a_streamed_answers_head_goes_out_at_the_end_of_its_turn() -> None:
    go_on = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await go_on.wait()
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    async def scenario(protocol: Any, transport: RecordingTransport) -> None:
        protocol.data_received(REQUEST)
        await _turns()
        assert len(transport.writes) == 1
        assert transport.writes[0].startswith(b"HTTP/1.1 200 OK")
        assert transport.writes[0].endswith(b"transfer-encoding: chunked\r\n\r\n")
        go_on.set()
        await _turns()
        assert transport.writes[1:] == [b"4\r\nlate\r\n0\r\n\r\n"]

    _serve(app, scenario)


def test_a_close_sends_what_is_held_first_and_nothing_goes_to_a_closed_socket() -> None:
    async def scenario() -> None:
        transport = RecordingTransport()
        held = HeldHeadTransport(transport, asyncio.get_running_loop())
        held.write(b"head")
        assert transport.writes == [] and not held.is_closing()
        held.close()
        assert transport.writes == [b"head"] and held.is_closing()
        await _turns()  # the end-of-turn flush finds nothing held
        assert transport.writes == [b"head"]

        gone = RecordingTransport()
        late = HeldHeadTransport(gone, asyncio.get_running_loop())
        late.write(b"head")
        gone.closed = True  # the client went before the turn ended
        await _turns()
        assert gone.writes == []

    asyncio.run(scenario())
