"""Inference queries refused at the front (:mod:`controlplane.api.front_door`): the protocol
``heteroplane serve`` runs answers them 429 as their head is read, with no request cycle and no
app call, reads and drops their body, and serves the next request on the same connection; the
app answers every other request. Driven in process on a recording transport."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn

from controlplane.api.counters import RequestCounter
from controlplane.api.front_door import FrontDoor
from controlplane.service.protocol import server_options
from controlplane.serving.throttle import FrontThrottle
from tests.recording_transport import RecordingTransport, drive


class Front:
    """Refuses every query of the apps in ``hot``; records what it was asked."""

    def __init__(self, hot: set[str]) -> None:
        self.hot = hot
        self.asked: list[str] = []

    def refuse(self, app: str) -> bool:
        self.asked.append(app)
        return app in self.hot


def _post(path: str, body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nHost: a\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def _run(front: Front, scenario: Any) -> list[str]:
    """The paths the app was called for, after ``scenario(protocol, transport)``."""
    called: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    drive(uvicorn.Config(app, access_log=False, **server_options(front=front)), scenario)
    return called


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _status_and_body(answer: bytes) -> tuple[int, dict[str, bytes], Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_refused_query_is_answered_429_without_the_app_and_the_connection_goes_on() -> None:
    front = Front({"hot"})
    body = json.dumps({"inputs": [[0] * 64]}).encode()

    async def scenario(protocol: Any, transport: RecordingTransport) -> None:
        # The body in two reads: it is read to its end and dropped before the answer.
        request = _post("/v1/apps/hot/infer", body)
        protocol.data_received(request[:-10])
        await _turns()
        assert transport.writes == []
        protocol.data_received(request[-10:])
        await _turns()
        (answer,) = transport.writes
        status, headers, document = _status_and_body(answer)
        assert status == 429 and headers[b"retry-after"] == b"1"
        assert document["error"]["code"] == "overloaded" and "hot" in document["error"]["message"]
        assert b"connection" not in headers and not transport.closed
        # Kept alive: the next request on the connection is the app's.
        protocol.data_received(_post("/v1/apps/cold/infer", body))
        await _turns()
        assert len(transport.writes) == 2 and transport.writes[1].endswith(b"\r\n\r\nok")

    called = _run(front, scenario)
    assert called == ["/v1/apps/cold/infer"] and front.asked == ["hot", "cold"]


def test_the_open_inference_protocols_refusal_has_its_error_shape() -> None:
    front = Front({"hot"})

    async def scenario(protocol: Any, transport: RecordingTransport) -> None:
        protocol.data_received(_post("/v2/models/hot/infer", b'{"inputs": []}'))
        await _turns()
        status, _, document = _status_and_body(transport.writes[0])
        assert status == 429 and isinstance(document["error"], str)
        assert "overloaded" in document["error"]

    assert _run(front, scenario) == []


def test_an_http_1_0_refusal_closes_the_connection() -> None:
    front = Front({"hot"})

    async def scenario(protocol: Any, transport: RecordingTransport) -> None:
        protocol.data_received(_post("/v1/apps/hot/infer", b"{}", version="1.0"))
        await _turns()
        status, headers, _ = _status_and_body(transport.writes[0])
        assert status == 429 and headers[b"connection"] == b"close" and transport.closed

    assert _run(front, scenario) == []


def test_only_plain_inference_posts_are_asked_about() -> None:
    front = Front({"hot"})
    requests = [
        b"GET /v1/apps/hot/infer HTTP/1.1\r\nHost: a\r\n\r\n",
        _post("/v1/apps/hot/infer?x=1", b"{}"),
        _post("/v2/models/hot/versions/1/infer", b"{}"),
        _post("/v1/apps/hot/plans", b"{}"),
        _post("/v1/apps/hot/infer", b"{}", extra="Expect: 100-continue\r\n"),
    ]

    async def scenario(protocol: Any, transport: RecordingTransport) -> None:
        for n, request in enumerate(requests, 1):
            protocol.data_received(request)
            await _turns()
            assert b"".join(transport.writes).count(b"HTTP/1.1 200 OK") == n

    called = _run(front, scenario)
    assert len(called) == len(requests) and front.asked == []


class Serving:
    """The serving loop's part: records the refusals it is told of (None: no dispatcher)."""

    def __init__(self, dispatches: bool) -> None:
        self.dispatches = dispatches
        self.refused: list[str] = []

    def refused_at_front(self, app: str) -> bool:
        if self.dispatches:
            self.refused.append(app)
        return self.dispatches


def test_the_front_door_refuses_only_what_the_serving_loop_records() -> None:
    now = [10.0]
    throttle = FrontThrottle(lambda: now[0])
    for _ in range(50):  # admission refused most of what reached it
        throttle.answered("hot", False)
    throttle.answered("hot", True)
    for dispatches, refused in ((True, True), (False, False)):
        counter = RequestCounter()
        serving = Serving(dispatches)
        door = FrontDoor(throttle, serving, counter)  # type: ignore[arg-type]
        answers = [door.refuse("hot") for _ in range(20)]
        assert any(answers) is refused
        assert serving.refused == ["hot"] * sum(answers)
        assert counter.snapshot().get(("hot", 429), 0) == sum(answers)
        assert not door.refuse("never-answered")
