"""Overload without collapse (issue 30): a query nobody will read never costs a worker call.

At the dispatcher, over a fake worker (:mod:`controlplane.serving.fake_worker`): a query whose
future is cancelled (its client gone) leaves the queue and is never sent; a query whose give-up
time has passed, or comes before the predicted end of the batch it would join, is answered with
its timeout instead of being sent. Through the API's middleware
(:class:`~controlplane.api.disconnect.CancelOnDisconnect`): an inference request whose client
disconnects before the answer is cancelled (its query with it), one whose client stays is
answered, and a request to any other route is left alone. Then end to end, on a real uvicorn
server: a client that sends a query and closes its connection while the worker is busy; its
query leaves the queue and the worker never sees it.

The worker is held busy by a query it does not answer (``hang``) or answers after a delay, so
that what queues behind it is decided before any worker is free: nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from controlplane.api.disconnect import CancelOnDisconnect
from controlplane.errors import QueryTimeoutError
from controlplane.policies.plan import StagePlan
from controlplane.serving.dispatcher import AppDispatcher, DispatcherSettings, InferResult
from controlplane.serving.fake_worker import FakeWorker
from controlplane.serving.observations import Observations
from controlplane.serving.transport import HttpWorkerTransport
from estimator.fleet import Fleet
from tests.component.test_serving import (
    LARGE,
    ApiWorld,
    config,
    endpoints,
    fleet,
    row,
    run,
    settle,
    until,
    world,
)

__all__ = ["world"]  # the fixture, imported for this module's tests

ONE_AT_A_TIME = {"tiny": StagePlan("tiny", Fleet.of({}), 1, policy="fcfs")}


async def one_worker(
    clock_s: Any = time.monotonic, **settings: Any
) -> tuple[FakeWorker, AppDispatcher]:
    (worker,) = await fleet([LARGE])
    app = config(models=("tiny",), stage_plans=ONE_AT_A_TIME, slo_ms=10_000.0)
    dispatcher = AppDispatcher(
        app,
        HttpWorkerTransport(),
        Observations(),
        settings=DispatcherSettings(admission=False, **settings),
        clock_s=clock_s,
    )
    dispatcher.set_workers(endpoints([worker]))
    return worker, dispatcher


def test_a_cancelled_query_leaves_the_queue_and_is_never_sent() -> None:
    async def scenario() -> None:
        worker, dispatcher = await one_worker()
        worker.delay_s = 0.05  # the first query holds the worker while the others queue
        first = dispatcher.submit([row(1, 0.9)])
        await until(lambda: worker.requests == 1)
        gone = dispatcher.submit([row(2, 0.9)])
        kept = dispatcher.submit([row(3, 0.9)])
        assert dispatcher.status().stages[0].queued_queries == 2
        gone.cancel()  # its client went away
        await asyncio.sleep(0)  # the done callbacks run
        assert dispatcher.status().stages[0].queued_queries == 1
        answers = await settle([first, kept])
        assert [a.outputs for a in answers if isinstance(a, InferResult)] == [(1,), (3,)]
        assert worker.requests == 2 and worker.rows == 2  # the cancelled query never went
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.timed_out) == (2, 1)
        await dispatcher.close()

    run(scenario())


def test_a_query_past_its_give_up_time_is_answered_without_a_worker_call() -> None:
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher = await one_worker(lambda: now[0], give_up_s=5.0)
        worker.delay_s = 0.05
        first = dispatcher.submit([row(1, 0.9)])
        await until(lambda: worker.requests == 1)
        expired = dispatcher.submit([row(2, 0.9)])
        now[0] += 4.0
        # Its give-up time is 1 s away: in time for a batch that takes a few ms.
        in_time = dispatcher.submit([row(3, 0.9)])
        now[0] += 1.5  # the first queued query is now past its 5 s; the other is not
        answers = await settle([first, expired, in_time])
        assert isinstance(answers[0], InferResult) and isinstance(answers[2], InferResult)
        assert isinstance(answers[1], QueryTimeoutError), answers[1]
        assert worker.requests == 2  # the expired query cost no call
        await dispatcher.close()

    run(scenario())


def test_a_query_whose_batch_would_end_past_its_give_up_time_is_not_sent() -> None:
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher = await one_worker(lambda: now[0], give_up_s=5.0)
        worker.delay_s = 0.05
        first = dispatcher.submit([row(1, 0.9)])
        await until(lambda: worker.requests == 1)
        doomed = dispatcher.submit([row(2, 0.9)])
        # 0.1 ms short of its give-up time: the batch (a ms or so predicted) would end past it.
        now[0] += 5.0 - 0.0001
        answers = await settle([first, doomed])
        assert isinstance(answers[1], QueryTimeoutError), answers[1]
        assert worker.requests == 1
        await dispatcher.close()

    run(scenario())


# --- the API's middleware --------------------------------------------------------------------


class _Connection:
    """An ASGI connection: the request's body, then ``http.disconnect`` when ``leave`` is set
    (the server says so only when the client goes)."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self.body_given = False

    async def receive(self) -> dict[str, Any]:
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def _scope(path: str, method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "headers": []}


def test_the_middleware_cancels_a_request_whose_client_has_gone() -> None:
    async def scenario() -> None:
        waiting: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def handler(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await waiting  # the query in the serving loop

        connection = _Connection()
        call = asyncio.ensure_future(
            CancelOnDisconnect(handler)(
                _scope("/v2/models/demo/infer"), connection.receive, connection.send
            )
        )
        await until(lambda: connection.body_given)
        await asyncio.sleep(0)
        connection.leave.set()
        await asyncio.wait_for(call, 10)  # returns: nobody to answer
        assert waiting.cancelled() and connection.sent == []
        assert not call.cancelled()

    run(scenario())


@pytest.mark.parametrize(
    ("path", "method"), [("/v1/apps/demo/infer", "POST"), ("/v1/apps/demo", "POST")]
)
def test_the_middleware_leaves_an_answered_request_and_other_routes_alone(
    path: str, method: str
) -> None:
    async def scenario() -> None:
        async def handler(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        connection = _Connection()
        connection.leave.set()  # the server says disconnect after the answer
        await CancelOnDisconnect(handler)(_scope(path, method), connection.receive, connection.send)
        assert [m["type"] for m in connection.sent] == [
            "http.response.start",
            "http.response.body",
        ]

    run(scenario())


# --- end to end on a real server -----------------------------------------------------------------


class _Background:
    """An event loop in a thread, for the fake worker the real server's loop calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served(world: ApiWorld) -> Iterator[tuple[ApiWorld, FakeWorker, str]]:
    background = _Background()
    (worker,) = background.run(fleet([LARGE]))
    world.instances.set("demo", endpoints([worker]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(world.app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20.0
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield world, worker, f"http://127.0.0.1:{port}"
    finally:
        background.run(worker.stop())  # first: a call it holds ends, and the server can stop
        server.should_exit = True
        thread.join(20)
        background.close()
        sock.close()


def _serving(url: str, world: ApiWorld) -> dict[str, Any]:
    response = httpx.get(
        f"{url}/v1/apps/demo/serving", headers=world.auth("viewer"), trust_env=False
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_a_client_that_goes_away_costs_no_worker_call(
    served: tuple[ApiWorld, FakeWorker, str],
) -> None:
    world, worker, url = served
    worker.hang = True  # the first query holds the worker: everything else queues
    # Held for as long as the test may take (not the default call timeout of 2 s).
    world.serving.settings = dataclasses.replace(
        world.serving.settings,
        dispatcher=DispatcherSettings(call_timeout_floor_s=60.0, idle_probe_s=None),
    )
    token = world.tokens["infer"]
    first = threading.Thread(
        target=lambda: httpx.post(
            f"{url}/v1/apps/demo/infer",
            json={"inputs": [row(1, 0.9)]},
            headers={"Authorization": f"Bearer {token}"},
            trust_env=False,
            timeout=30.0,
        ),
        daemon=True,
    )
    first.start()
    deadline = time.monotonic() + 20.0
    while worker.received == 0:
        assert time.monotonic() < deadline, "the first query never reached the worker"
        time.sleep(0.02)
    body = b'{"inputs": [[2.0, 14.4' + b", 0.0" * 62 + b"]]}"
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(
            b"POST /v1/apps/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        while _serving(url, world)["stages"][0]["queued_queries"] == 0:
            assert time.monotonic() < deadline, "the second query never queued"
            time.sleep(0.02)
    # The client closed its connection: its query leaves the queue, the worker never sees it.
    while (status := _serving(url, world))["stages"][0]["queued_queries"] != 0:
        assert time.monotonic() < deadline, f"the query of the client gone still queued: {status}"
        time.sleep(0.02)
    assert status["totals"]["timed_out"] == 1
    assert worker.received == 1  # only the first, held, query ever reached it
