"""Overload without collapse (issue 30): a query nobody will read never costs a worker call.

At the dispatcher, over a fake worker (:mod:`tests.fake_worker`): a query whose
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
import math
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controlplane.api.disconnect import CancelOnDisconnect
from controlplane.errors import OverloadedError, QueryTimeoutError, RequirementsUnmetError
from controlplane.policies.plan import StagePlan
from controlplane.policies.variants import Requirements
from controlplane.serving.dispatcher import AppDispatcher, DispatcherSettings, InferResult
from controlplane.serving.observations import Observations
from controlplane.serving.stages import DRAIN_WINDOW_S
from controlplane.serving.transport import HttpWorkerTransport
from estimator.cascades import Cascade
from estimator.fleet import Fleet
from tests.component.test_oip_routes import family_request, live_server
from tests.component.test_serving import (
    LARGE,
    SMALL,
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
from tests.fake_worker import FakeWorker

__all__ = ["world"]  # the fixture, imported for this module's tests

ONE_AT_A_TIME = {"tiny": StagePlan("tiny", Fleet.of({}), 1, policy="fcfs")}


async def held_worker(
    clock_s: Any = time.monotonic,
    slo_ms: float = 10_000.0,
    first_deadline_s: float | None = None,
    **settings: Any,
) -> tuple[FakeWorker, AppDispatcher, asyncio.Future[InferResult]]:
    """One worker (batch cap 1) holding the answer to a first query (its client's deadline
    ``first_deadline_s``), which is returned: what is submitted next queues until
    :meth:`FakeWorker.release`. Admission is off unless ``settings`` say otherwise."""
    (worker,) = await fleet([LARGE])
    app = config(models=("tiny",), stage_plans=ONE_AT_A_TIME, slo_ms=slo_ms)
    dispatcher = AppDispatcher(
        app,
        HttpWorkerTransport(),
        Observations(),
        settings=DispatcherSettings(**{"admission": False, **settings}),
        clock_s=clock_s,
    )
    dispatcher.set_workers(endpoints([worker]))
    worker.holding = True
    first = dispatcher.submit([row(1, 0.9)], deadline_s=first_deadline_s)
    await until(lambda: worker.requests == 1)
    return worker, dispatcher, first


def test_a_cancelled_query_leaves_the_queue_and_is_never_sent() -> None:
    async def scenario() -> None:
        worker, dispatcher, first = await held_worker()
        gone = dispatcher.submit([row(2, 0.9)])
        kept = dispatcher.submit([row(3, 0.9)])
        assert dispatcher.status().stages[0].queued_queries == 2
        gone.cancel()  # its client went away
        await asyncio.sleep(0)  # the done callbacks run
        assert dispatcher.status().stages[0].queued_queries == 1
        worker.release()
        answers = await settle([first, kept])
        assert [a.outputs for a in answers if isinstance(a, InferResult)] == [(1,), (3,)]
        assert worker.requests == 2 and worker.rows == 2  # the cancelled query never went
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.timed_out) == (2, 1)
        await dispatcher.close()

    run(scenario())


@pytest.mark.parametrize(
    ("later_s", "kept"),
    [
        # The first queued query past its 5 s give-up time; the second 1.5 s from it, in time
        # for a batch that takes a ms or so.
        ((4.0, 1.5), True),
        # 0.1 ms short of its give-up time: the batch (a ms or so predicted) would end past it.
        ((5.0 - 0.0001,), False),
    ],
)
def test_a_query_that_cannot_be_answered_in_time_costs_no_worker_call(
    later_s: tuple[float, ...], kept: bool
) -> None:
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker(lambda: now[0], give_up_s=5.0)
        submitted = []
        for seconds in later_s:
            submitted.append(dispatcher.submit([row(2, 0.9)]))
            now[0] += seconds
        worker.release()
        doomed, *rest = await settle(submitted)
        assert isinstance(doomed, QueryTimeoutError), doomed
        assert all(isinstance(answer, InferResult) for answer in rest) and len(rest) == kept
        assert worker.requests == 1 + len(rest)  # the doomed query cost no call
        assert isinstance(await first, InferResult)
        await dispatcher.close()

    run(scenario())


def test_a_query_past_its_clients_deadline_costs_no_worker_call() -> None:
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker(lambda: now[0])
        doomed = dispatcher.submit([row(2, 0.9)], deadline_s=now[0] + 0.5)
        patient = dispatcher.submit([row(3, 0.9)], deadline_s=now[0] + 60.0)
        now[0] += 0.6  # the first client's deadline has passed; the give-up time is 30 s away
        worker.release()
        answers = await settle([first, doomed, patient])
        assert isinstance(answers[1], QueryTimeoutError) and "within 500 ms" in str(answers[1])
        assert isinstance(answers[2], InferResult)
        assert worker.requests == 2
        await dispatcher.close()

    run(scenario())


def test_a_query_queued_past_its_clients_deadline_is_answered_at_it() -> None:
    """Answered 504 by the sweep at its deadline, while the worker still holds the batch ahead
    of it (not when a batch would start for it): it leaves its queue, with its samples, and is
    counted as timed out. A query whose batch is in flight at its deadline is left to that call
    and answered."""
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher, sent = await held_worker(lambda: now[0], first_deadline_s=now[0] + 0.5)
        doomed = dispatcher.submit([row(2, 0.9), row(4, 0.9)], deadline_s=now[0] + 0.5)
        patient = dispatcher.submit([row(3, 0.9)], deadline_s=now[0] + 60.0)
        (stage,) = dispatcher.status().stages
        assert (stage.queued_queries, stage.queued_samples) == (2, 3)
        now[0] += 0.6  # both short deadlines have passed; the give-up time is 30 s away
        await until(doomed.done)  # the worker still holds the first batch
        error = doomed.exception()
        assert isinstance(error, QueryTimeoutError) and "within 500 ms" in str(error), error
        assert not sent.done() and not patient.done()
        (stage,) = dispatcher.status().stages
        assert (stage.queued_queries, stage.queued_samples) == (1, 1)
        assert dispatcher.observations.totals()["demo"].timed_out == 1
        worker.release()
        answers = await settle([sent, patient])
        assert [a.outputs for a in answers if isinstance(a, InferResult)] == [(1,), (3,)]
        assert worker.requests == 2 and worker.rows == 2  # the doomed query cost no call
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.timed_out) == (2, 1)
        await dispatcher.close()

    run(scenario())


def test_the_sweep_is_aimed_at_the_next_clients_deadline() -> None:
    """The sweep runs every 0.25 s, and sooner for a client's deadline ahead: a query queued
    with 0.1 s to its deadline is answered at it, not up to a period later (a client whose own
    timeout is the deadline it sent, as `heteroplane loadgen --timeout-s`'s, had given up by
    then and recorded a timeout of its own instead of the 504)."""
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher, sent = await held_worker(lambda: now[0], first_deadline_s=now[0] + 60)
        assert dispatcher.sweep_delay_s == 0.25  # nothing due within a period
        soon = dispatcher.submit([row(2, 0.9)], deadline_s=now[0] + 0.1)
        await until(lambda: dispatcher.sweep_delay_s == 0.1)  # the next sweep aims at it
        now[0] += 0.1
        await until(soon.done)
        assert isinstance(soon.exception(), QueryTimeoutError)
        worker.release()
        (answer,) = await settle([sent])
        assert isinstance(answer, InferResult) and answer.outputs == (1,)
        await dispatcher.close()

    run(scenario())


def test_answered_queries_do_not_wait_for_their_deadline_in_the_sweeps_heap() -> None:
    """A query's client deadline is held for the sweep; answered (here: its client gone), it is
    dropped at a sweep, not kept with its inputs until its deadline while others are open."""

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker()
        far = time.monotonic() + 600.0
        gone = [dispatcher.submit([row(2, 0.9)], deadline_s=far) for _ in range(200)]
        for future in gone:
            future.cancel()
        await until(lambda: len(dispatcher._deadlines) == 0)  # the first query keeps it open
        worker.release()
        assert isinstance(await first, InferResult)
        await dispatcher.close()

    run(scenario())


def test_a_timeout_says_how_long_it_waited_below_a_second_too() -> None:
    # A client's timeout of a microsecond read "not answered within 0 s" (rounded to 1 ms).
    assert str(QueryTimeoutError("a", 1e-6)).endswith("within 0.001 ms")
    assert str(QueryTimeoutError("a", 30.0)).endswith("within 30 s")


def test_admission_judges_the_queue_at_the_rate_it_drains_not_only_the_profiles() -> None:
    """The profile says a query takes about half a millisecond; the answers come back one every
    20 ms (the serving process's event loop falling behind does this: each answer is read and
    the next batch sent late). Twenty queued queries look like 10 ms of wait to the profile and
    are 400 ms at the rate the queue drains: once the queue has drained that slowly for a
    whole window, a new query is refused, and once it has emptied, the profile judges again."""
    now = [1000.0]
    step_s = 0.02

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker(lambda: now[0], 50.0, admission=True)
        futures = [first] + [dispatcher.submit([row(1, 0.9)]) for _ in range(20)]  # admitted
        answers = 0
        while now[0] + step_s - 1000.0 < DRAIN_WINDOW_S:
            now[0] += step_s
            worker.release()  # the held answer goes; the next batch is held again
            worker.holding = True
            answers += 1
            await until(lambda sent=answers + 1: worker.received == sent)
            futures.append(dispatcher.submit([row(1, 0.9)]))  # one in for each out
        now[0] += step_s  # the queue has now drained at 50 q/s for a whole window
        with pytest.raises(OverloadedError):
            dispatcher.submit([row(1, 0.9)])
        worker.release()
        results = await settle(futures)
        assert all(isinstance(result, InferResult) for result in results)
        # The queue emptied: the next query is judged by the profile again, and admitted.
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        await dispatcher.close()
        await worker.stop()

    run(scenario())


def test_a_stalled_queue_refuses_with_a_retry_soon_not_as_full_queues() -> None:
    """The worker holds a batch while a query waits, and nothing is answered for a whole drain
    window (a batch far slower than its profile): the next query is refused, for a retry a
    second later and with the wait it would meet, not as queues full to their cap with "retry
    after 60 s" (the drain rate of 0 was an infinite wait). Once answers come, it is served."""
    now = [1000.0]

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker(lambda: now[0], 200.0, admission=True)
        queued = dispatcher.submit([row(2, 0.9)])  # admitted: the profile's wait is short
        now[0] += DRAIN_WINDOW_S + 0.01  # nothing answered for a whole window
        with pytest.raises(OverloadedError) as refused:
            dispatcher.submit([row(3, 0.9)])
        assert refused.value.retry_after_s == 1
        assert refused.value.predicted_ms < float("inf")
        assert "as many samples as they may" not in str(refused.value)
        worker.release()
        results = await settle([first, queued])
        assert all(isinstance(result, InferResult) for result in results)
        assert isinstance(await dispatcher.submit([row(4, 0.9)]), InferResult)
        await dispatcher.close()
        await worker.stop()

    run(scenario())


def test_a_query_one_sample_of_which_would_be_refused_is_refused_before_its_size_is_known() -> None:
    """The API asks before it reads a body (refuse_early): refused exactly when a one-sample
    query would be by submit, recorded as that refusal; otherwise nothing raised or recorded."""

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker(admission=True, max_queued_samples=2)
        totals = dispatcher.observations.totals
        dispatcher.refuse_early()  # an empty queue admits
        before = totals()["demo"]
        queued = [dispatcher.submit([row(1, 0.9)]), dispatcher.submit([row(2, 0.9)])]
        assert totals()["demo"].arrived == before.arrived + 2
        with pytest.raises(OverloadedError):
            dispatcher.submit([row(3, 0.9)])
        refused = totals()["demo"]
        with pytest.raises(OverloadedError):
            dispatcher.refuse_early(received_s=time.monotonic())
        after = totals()["demo"]
        assert (after.arrived, after.refused) == (refused.arrived + 1, refused.refused + 1)
        worker.release()
        assert all(isinstance(r, InferResult) for r in await settle([first, *queued]))
        dispatcher.refuse_early()  # drained: admitted again, and nothing recorded
        assert totals()["demo"].arrived == after.arrived
        await dispatcher.close()
        await worker.stop()

    run(scenario())


def test_a_query_refused_at_the_front_is_recorded_as_admissions_refusals_are() -> None:
    """The API's front door refuses past saturation before admission sees the query
    (controlplane.api.front_door): the dispatcher records it as an arrival and a refusal, so
    the tuner reads the whole demand; with admission off, nothing is refused there."""

    async def scenario() -> None:
        for admission in (True, False):
            worker, dispatcher, first = await held_worker(admission=admission)
            before = dispatcher.observations.totals()["demo"]
            assert dispatcher.refused_at_front() is admission
            after = dispatcher.observations.totals()["demo"]
            assert (after.arrived - before.arrived, after.refused - before.refused) == (
                (1, 1) if admission else (0, 0)
            )
            worker.release()
            await settle([first])
            await dispatcher.close()
            assert dispatcher.refused_at_front() is False  # closed
            await worker.stop()

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


@pytest.fixture
def served(world: ApiWorld) -> Iterator[tuple[ApiWorld, FakeWorker, str]]:
    with live_server(world, [LARGE]) as ((worker,), address):
        yield world, worker, f"http://{address}"


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


def test_past_admission_a_query_is_refused_before_its_body_is_read(
    served: tuple[ApiWorld, FakeWorker, str],
) -> None:
    """A service past saturation does not decode what it refuses: with the worker held and the
    queue full, a query whose body is not even JSON is answered 429 (its body never read), in
    the protocol's shape on /v2 and the API's on /v1, where the same body is a 400 while
    queries are admitted."""
    world, worker, url = served
    token = world.tokens["infer"]
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    oip = f"{url}/v2/models/demo/infer"
    # Admission on, with room for one queued query; a call held for as long as the test takes.
    world.serving.settings = dataclasses.replace(
        world.serving.settings,
        dispatcher=DispatcherSettings(
            call_timeout_floor_s=60.0, idle_probe_s=None, admission=True, max_queued_samples=1
        ),
    )
    v1 = f"{url}/v1/apps/demo/infer"
    malformed = httpx.post(oip, content=b"{not json", headers=headers, trust_env=False)
    assert malformed.status_code == 400, malformed.text
    malformed = httpx.post(v1, content=b"{not json", headers=headers, trust_env=False)
    assert malformed.status_code == 400, malformed.text
    worker.hang = True  # the next query holds the worker; one more fills the queue
    held = []
    deadline = time.monotonic() + 20.0
    for value in (1, 2):
        thread = threading.Thread(
            target=lambda v=value: httpx.post(
                oip,
                json=family_request([row(v, 0.9)]),
                headers=headers,
                trust_env=False,
                timeout=30.0,
            ),
            daemon=True,
        )
        thread.start()
        held.append(thread)
        # The second is sent once the first holds the worker: sent while the first still
        # waited in the queue (a loaded machine), it found the queue full and was refused.
        while value == 1 and worker.received < 1:
            assert time.monotonic() < deadline, "the first query never reached the worker"
            time.sleep(0.02)
    while _serving(url, world)["stages"][0]["queued_queries"] < 1:
        assert time.monotonic() < deadline, "the second query never queued"
        time.sleep(0.02)
    refused = httpx.post(oip, content=b"{not json", headers=headers, trust_env=False)
    assert refused.status_code == 429, refused.text
    assert set(refused.json()) == {"error"} and "overloaded" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    refused = httpx.post(v1, content=b"{not json", headers=headers, trust_env=False)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "overloaded"
    assert worker.received == 1  # the held query only


def test_past_saturation_the_front_refuses_before_the_api_and_every_query_is_counted(
    served: tuple[ApiWorld, FakeWorker, str],
) -> None:
    """With the worker held and the queue full, admission refuses every query; the front door
    then refuses most of the next ones as their head is read (its own message), and the serving
    loop counts every query sent, whoever refused it, as an arrival and a refusal."""
    world, worker, url = served
    headers = {"Authorization": f"Bearer {world.tokens['infer']}"}
    v1 = f"{url}/v1/apps/demo/infer"
    world.serving.settings = dataclasses.replace(
        world.serving.settings,
        dispatcher=DispatcherSettings(
            call_timeout_floor_s=60.0, idle_probe_s=None, admission=True, max_queued_samples=1
        ),
    )
    query = {"inputs": [row(1, 0.9)]}
    with httpx.Client(trust_env=False, timeout=30.0) as client:
        assert client.post(v1, json=query, headers=headers).status_code == 200  # answered
        worker.hang = True
        held = [
            threading.Thread(
                target=lambda: httpx.post(
                    v1, json=query, headers=headers, timeout=30.0, trust_env=False
                ),
                daemon=True,
            )
            for _ in range(2)
        ]
        deadline = time.monotonic() + 20.0
        for n, thread in enumerate(held, 1):
            thread.start()
            while _serving(url, world)["stages"][0]["queued_queries"] + worker.received < n + 1:
                assert time.monotonic() < deadline, "the held queries never reached the service"
                time.sleep(0.02)
        before = world.serving.observations.totals()["demo"]
        by = {"admission": 0, "front": 0}
        sent = 0
        while by["front"] == 0 and sent < 200:
            answer = client.post(v1, json=query, headers=headers)
            sent += 1
            assert answer.status_code == 429, answer.text
            message = answer.json()["error"]["message"]
            by["front" if "refused on arrival" in message else "admission"] += 1
        assert by["front"] == 1 and by["admission"] >= 1, by
        after = world.serving.observations.totals()["demo"]
        assert (after.arrived - before.arrived, after.refused - before.refused) == (sent, sent)
    assert worker.received == 2  # the answered query and the one held


def test_a_model_less_query_whose_variant_is_backlogged_goes_to_its_queue_not_a_422() -> None:
    """The only variant that meets a model-less query's needs was overloaded at the moment (its
    backlog drains in more than the SLO): the query was refused 422 ``requirements_unmet``,
    which says not to try again, for a passing queue (3.3% of a steady model-less load onto
    one variant, live). It goes to that queue now, where admission control judges it (a 429
    to try again where the queue cannot serve it in time); a bound the wait itself misses is
    still unmet."""

    async def scenario() -> None:
        worker, dispatcher, first = await held_worker(slo_ms=2.0)
        queued = [dispatcher.submit([row(2, 0.9)]) for _ in range(5)]
        # tiny at 0.5 ms a batch: six samples in the queue drain in 3 ms, over the 2 ms SLO.
        ((option, cascade),) = dispatcher.variant_options()
        assert option.state == "overloaded", option
        assert math.isfinite(option.predicted_latency_ms) and option.predicted_latency_ms > 2.0
        patient = Requirements("demo", latency_ms=60_000.0)
        assert dispatcher.choose_variant(patient, 1) == cascade
        hurried = Requirements("demo", latency_ms=option.predicted_latency_ms / 2)
        with pytest.raises(RequirementsUnmetError, match="but it is overloaded"):
            dispatcher.choose_variant(hurried, 1)
        answer = dispatcher.infer([row(5, 0.9)], requirements=patient)
        worker.release()
        answers = await settle([first, *queued, answer])
        assert all(isinstance(a, InferResult) for a in answers), answers
        await dispatcher.close()

    run(scenario())


def test_a_model_less_query_whose_variant_is_interfered_is_served_at_its_slowed_latency() -> None:
    """The only variant that meets a model-less query's needs runs on an instance found
    interfered (it measures 20 ms where its profile says about 1): the query was refused 422
    ``requirements_unmet``, which says not to try again, though the dispatcher serves the model
    on that instance, its only one. It is served now, judged at its latency as slowed; a bound
    only the profile meets is still unmet."""

    async def scenario() -> None:
        (worker,) = await fleet([LARGE])
        worker.delay_s = 0.02
        dispatcher = AppDispatcher(
            config(models=("tiny",), stage_plans=ONE_AT_A_TIME),
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
        )
        dispatcher.set_workers(endpoints([worker]))
        while worker.requests < 5:  # the tracker's least evidence
            assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        ((option, cascade),) = dispatcher.variant_options()
        assert option.state == "interfered", option
        slowed = option.predicted_latency_ms * 10.0  # 20 ms against about 1: over 10 times
        patient = Requirements("demo", latency_ms=60_000.0)
        assert dispatcher.choose_variant(patient, 1) == cascade
        answer = await dispatcher.infer([row(5, 0.9)], requirements=patient)
        assert isinstance(answer, InferResult) and answer.outputs == (5,)
        hurried = Requirements("demo", latency_ms=slowed)
        with pytest.raises(RequirementsUnmetError, match="but it is interfered"):
            dispatcher.choose_variant(hurried, 1)
        await dispatcher.close()

    run(scenario())


async def tiny_held_beside_large(**knobs: Any) -> tuple[list[FakeWorker], AppDispatcher]:
    """tiny on one worker that answers nothing until released and large on another, admission
    on under an SLO of 20 ms; ``knobs``: the dispatcher's other arguments (its clock, its
    settings)."""
    workers = await fleet([SMALL, LARGE])
    workers[0].holding = True
    plan = {
        "tiny": StagePlan("tiny", Fleet.of({SMALL: 1}), 1),
        "large": StagePlan("large", Fleet.of({LARGE: 1}), 1),
    }
    dispatcher = AppDispatcher(
        config(stage_plans=plan, slo_ms=20.0),
        HttpWorkerTransport(),
        Observations(),
        **{"settings": DispatcherSettings(admission=True), **knobs},
    )
    dispatcher.set_workers(endpoints(workers))
    return workers, dispatcher


def test_an_interfered_stage_slows_its_own_part_of_a_cascades_latency() -> None:
    """An interfered variant's latency is judged as slowed stage by stage: in a cascade whose
    first model measures 20 times its profile on every instance and whose second does not,
    only the first model's part is stretched (the whole had been multiplied by the worst
    stage's slowdown, so a bound the slowed cascade meets was refused 422)."""

    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        dispatcher = AppDispatcher(
            config(), HttpWorkerTransport(), Observations(), settings=DispatcherSettings()
        )
        dispatcher.set_workers(endpoints(workers))
        now = dispatcher.clock_s()
        for instance in ("i-0", "i-1"):  # the tracker's least evidence: 5 batches each
            for _ in range(5):
                dispatcher.tracker.observe("tiny", instance, now, 20.0, 1.0)
        options = {c.label: (option, c) for option, c in dispatcher.variant_options()}
        (cascade,) = [c for _, c in options.values() if len(c.models) == 2]
        assert options[cascade.label][0].state == "interfered"
        assert options["large"][0].state == "active"
        variants, gear = dispatcher.variants, dispatcher.current_gear()
        assert variants._slowdown("tiny", now) == 20.0
        assert variants._slowdown("large", now) == 1.0
        tiny_ms = options["tiny"][0].predicted_latency_ms
        large_ms = options["large"][0].predicted_latency_ms
        assert variants._slowed_ms(options["tiny"][1], 1, gear, now) == pytest.approx(20 * tiny_ms)
        slowed = variants._slowed_ms(cascade, 1, gear, now)
        assert options[cascade.label][0].predicted_latency_ms == pytest.approx(tiny_ms + large_ms)
        assert slowed == pytest.approx(20 * tiny_ms + large_ms)
        await dispatcher.close()

    run(scenario())


def test_after_a_model_less_query_an_early_refusal_weighs_every_variant() -> None:
    """The API's early refusal (before a body is read) judged a query under the gear's cascades
    alone: with the tiny model's queue full, a model-less query for the large model alone,
    whose queue was empty, was refused 429 before its requirements were read. Once the app has
    had a model-less query, a query the gears refuse and a variant admits is not refused
    before its body: the check says to ask again once the body shows no requirements
    (``plain``), and then the gears refuse it; where every variant refuses too, it is refused
    at once. Until the app's first model-less query the gears decide, as before."""

    async def scenario() -> None:
        # A still clock: the queues' waits do not drain between checks.
        workers, dispatcher = await tiny_held_beside_large(clock_s=lambda: 1000.0)
        queued: list[asyncio.Future[InferResult]] = []
        tiny, large = Cascade(("tiny",), ()), Cascade(("large",), ())
        with pytest.raises(OverloadedError):  # tiny's queue fills to what the SLO drains
            for _ in range(100):
                queued.append(dispatcher.submit([row(1, 0.9)], cascade=tiny))
        with pytest.raises(OverloadedError):  # no model-less query yet: the gears decide
            dispatcher.refuse_early()
        needs = Requirements("demo", latency_ms=10.0)
        assert dispatcher.choose_variant(needs, 1).models == ("large",)
        refused_before = dispatcher.observations.totals()["demo"].refused
        assert dispatcher.refuse_early() is True  # large alone admits it: ask again once read
        assert dispatcher.observations.totals()["demo"].refused == refused_before
        with pytest.raises(OverloadedError):  # a body without requirements: the gears refuse
            dispatcher.refuse_early(plain=True)
        answer = await dispatcher.infer([row(5, 0.9)], requirements=needs)
        assert answer.models == ("large",)
        workers[1].holding = True  # large's worker holds too: its queue fills
        with pytest.raises(OverloadedError):
            for _ in range(100):
                queued.append(dispatcher.submit([row(2, 0.9)], cascade=large))
        with pytest.raises(OverloadedError):  # tiny's again, at this moment
            for _ in range(100):
                queued.append(dispatcher.submit([row(1, 0.9)], cascade=tiny))
        refused_before = dispatcher.observations.totals()["demo"].refused
        with pytest.raises(OverloadedError):  # every variant refuses it now, recorded once
            dispatcher.refuse_early()
        assert dispatcher.observations.totals()["demo"].refused == refused_before + 1
        for worker in workers:
            worker.release()
        await settle(queued)
        await dispatcher.close()

    run(scenario())


def test_after_a_model_less_query_the_cap_on_queued_samples_is_refused_before_the_body() -> None:
    """The cap on queued samples refuses a query whatever variant it runs under: after a
    model-less query, a query met at the cap was not refused before its body (the early check
    asked for it again once read, as if a variant would admit it, and a model-less body was
    parsed by the route to be refused there). It is refused at once, recorded once."""

    async def scenario() -> None:
        settings = DispatcherSettings(admission=True, max_queued_samples=3)
        workers, dispatcher = await tiny_held_beside_large(
            clock_s=lambda: 1000.0, settings=settings
        )
        tiny, large = Cascade(("tiny",), ()), Cascade(("large",), ())
        queued = [dispatcher.submit([row(1, 0.9)], cascade=tiny) for _ in range(3)]
        dispatcher.choose_variant(Requirements("demo", latency_ms=10.0), 1)  # a model-less query
        with pytest.raises(OverloadedError):  # large's queue is empty: the cap refuses it
            dispatcher.submit([row(5, 0.9)], cascade=large)
        refused_before = dispatcher.observations.totals()["demo"].refused
        with pytest.raises(OverloadedError):
            dispatcher.refuse_early()
        assert dispatcher.observations.totals()["demo"].refused == refused_before + 1
        workers[0].release()
        await settle(queued)
        await dispatcher.close()

    run(scenario())


def test_a_model_less_query_is_admitted_at_its_variants_queue_not_the_gears() -> None:
    """Admission judged a model-less query under the gear's cascades, whatever variant it was
    given: a query for the large model alone was refused (429) at the tiny model's full queue,
    and its refusal marked tiny overloaded (the INFaaS scaler then replicated tiny, at 0 qps of
    its own, and drained it 25 s later, again and again, live). It is judged at the queue of
    the variant it runs under."""

    async def scenario() -> None:
        workers, dispatcher = await tiny_held_beside_large()
        queued: list[asyncio.Future[InferResult]] = []
        with pytest.raises(OverloadedError):  # tiny's queue fills to what the SLO drains
            for _ in range(100):
                queued.append(dispatcher.submit([row(1, 0.9)]))
        (tiny, large) = dispatcher.status().stages
        assert tiny.queued_samples > 0 and large.queued_samples == 0
        # The refusals the SLO's percentile allows (the config's P99): one in a window of fewer
        # than 100 samples is over 1%, but one alone there is no overload (two would be).
        assert tiny.overload is not None
        assert tiny.overload.refused_share_allowed == pytest.approx(0.01)
        assert tiny.overload.arrived_samples < 100
        assert tiny.overload.refused == 1 and not tiny.overload.overloaded
        needs = Requirements("demo", latency_ms=10.0)
        assert dispatcher.choose_variant(needs, 1).models == ("large",)
        answer = await dispatcher.infer([row(5, 0.9)], requirements=needs)
        assert answer.models == ("large",)
        workers[0].release()
        await settle(queued)
        await dispatcher.close()

    run(scenario())
