"""The dispatcher's batch trigger against fake in-process workers: under a gear with a minimum
queue length a stage waits for that many queries, and its guard's timer releases a lone query
(CascadeServe's minimum queue length, the rule the gear plan simulated). Nothing sleeps in the
tests; the one timer that runs is the dispatcher's own guard."""

from __future__ import annotations

import asyncio

from controlplane.clock import FakeClock
from controlplane.serving.dispatcher import AppDispatcher, DispatcherSettings, ServingGear
from controlplane.serving.observations import Observations
from controlplane.serving.transport import HttpWorkerTransport
from tests.component.test_serving import (
    SMALL,
    config,
    endpoints,
    fleet,
    row,
    run,
    settle,
    until,
)


async def spin(turns: int = 50) -> None:
    """Let the event loop run ``turns`` times (rounds, HTTP calls in flight)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def queued(dispatcher: AppDispatcher, model: str = "tiny") -> int:
    stage = next(s for s in dispatcher.status().stages if s.model == model)
    return stage.queued_queries


def test_a_batch_waits_for_the_minimum_queue_length() -> None:
    async def scenario() -> None:
        (worker,) = await fleet([SMALL])
        app = config(models=("tiny",))
        gear = ServingGear(app.cascade, {"tiny": 8}, min_queue={"tiny": 3}, max_wait_s=3600.0)
        clock = FakeClock(100.0)  # stands still: the guard never expires here
        dispatcher = AppDispatcher(
            app,
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
            clock_s=clock.now_s,
            gear=lambda: gear,
        )
        dispatcher.set_workers(endpoints([worker]))
        first = [dispatcher.submit([row(q, 0.9)]) for q in range(2)]
        await spin()
        assert queued(dispatcher) == 2 and worker.requests == 0  # held: 2 < 3
        third = dispatcher.submit([row(2, 0.9)])
        results = await settle([*first, third])
        assert [r.outputs for r in results] == [(0,), (1,), (2,)]  # type: ignore[union-attr]
        assert (worker.requests, worker.rows) == (1, 3)  # one batch of the three
        await dispatcher.close()

    run(scenario())


def test_the_guard_releases_a_lone_query() -> None:
    async def scenario() -> None:
        (worker,) = await fleet([SMALL])
        app = config(models=("tiny",))
        gear = ServingGear(app.cascade, {"tiny": 8}, min_queue={"tiny": 4}, max_wait_s=0.01)
        dispatcher = AppDispatcher(
            app,
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
            gear=lambda: gear,
        )
        dispatcher.set_workers(endpoints([worker]))
        lone = dispatcher.submit([row(7, 0.9)])
        await until(lambda: queued(dispatcher) == 1)
        # nothing else will happen to the stage: only the guard's timer can release it
        result = await lone
        assert result.outputs == (7,)
        assert (worker.requests, worker.rows) == (1, 1)
        await dispatcher.close()

    run(scenario())


def test_without_a_trigger_a_query_starts_at_once() -> None:
    async def scenario() -> None:
        (worker,) = await fleet([SMALL])
        app = config(models=("tiny",))
        clock = FakeClock(0.0)
        dispatcher = AppDispatcher(
            app,
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
            clock_s=clock.now_s,
        )
        dispatcher.set_workers(endpoints([worker]))
        result = await dispatcher.submit([row(3, 0.9)])
        assert result.outputs == (3,) and worker.requests == 1
        await dispatcher.close()

    run(scenario())
