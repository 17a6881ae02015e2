"""A cascade's co-located placement in the dispatcher (CascadeServe SP3): the load balancer's
shares in the app's status, the dispatcher's per-instance counts following them, memory-aware
pruning over the live workers, and the fallback when no placement fits; against the fake
in-process workers of ``test_serving``."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from controlplane.serving.dispatcher import (
    AppDispatcher,
    DispatcherSettings,
    InferResult,
    ServingGear,
)
from controlplane.serving.observations import Observations
from controlplane.serving.shares import SHARE_POLICY
from controlplane.serving.transport import HttpWorkerTransport
from estimator.cascades import Cascade
from tests.component.test_serving import (
    LARGE,
    SMALL,
    config,
    dispatcher_over,
    endpoints,
    fleet,
    row,
    run,
)
from tests.fake_worker import FakeWorker

QUERIES = 150


async def close(dispatcher: AppDispatcher, workers: list[FakeWorker]) -> None:
    await dispatcher.close()
    for worker in workers:
        await worker.stop()


def test_the_dispatcher_follows_the_load_balancers_shares() -> None:
    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE, LARGE])
        app = dataclasses.replace(config(), planned_rate_qps=400.0)
        dispatcher = await dispatcher_over(workers, app, admission=False)
        status = dispatcher.status()
        tiny, large = status.stages
        for stage in (tiny, large):
            assert stage.policy == SHARE_POLICY
            assert set(stage.shares) == {"i-0", "i-1", "i-2"}  # no memory limit: everywhere
            assert sum(stage.shares.values()) == pytest.approx(1.0)
            assert stage.lp_utilisation is not None and 0 < stage.lp_utilisation <= 1
        # One query at a time (every worker idle): each goes to the largest deficit.
        for q in range(QUERIES):
            assert isinstance(await dispatcher.submit([row(q % 10, 0.9)]), InferResult)
        for k, worker in enumerate(workers):
            assert abs(worker.requests - tiny.shares[f"i-{k}"] * QUERIES) <= 2, (
                [w.requests for w in workers],
                tiny.shares,
            )
        await close(dispatcher, workers)

    run(scenario())


def test_memory_prunes_a_model_from_the_small_instance() -> None:
    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        app = dataclasses.replace(
            config(),
            planned_rate_qps=50.0,
            model_memory_mb={"tiny": 60.0, "large": 60.0},
            instance_memory_mb={SMALL: 100.0},
        )
        dispatcher = await dispatcher_over(workers, app, admission=False)
        tiny, large = dispatcher.status().stages
        hosted_on_small = [s.model for s in (tiny, large) if "i-0" in s.shares]
        assert len(hosted_on_small) == 1  # 120 MB of models, 100 MB of memory
        assert "i-1" in tiny.shares and "i-1" in large.shares
        results = [await dispatcher.submit([row(q % 10, 0.3 * (q % 3))]) for q in range(30)]
        assert all(isinstance(r, InferResult) for r in results)
        await close(dispatcher, workers)

    run(scenario())


def test_without_a_placement_that_fits_every_worker_serves_every_stage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        app = dataclasses.replace(
            config(),
            model_memory_mb={"tiny": 60.0, "large": 60.0},
            instance_memory_mb={SMALL: 10.0, LARGE: 10.0},
        )
        dispatcher = await dispatcher_over(workers, app, admission=False)
        for stage in dispatcher.status().stages:
            assert stage.shares == {} and stage.lp_utilisation is None
            assert stage.policy != SHARE_POLICY
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        dispatcher.reconfigure(dataclasses.replace(app))  # the same reason: not logged again
        await close(dispatcher, workers)

    with caplog.at_level(logging.WARNING, logger="controlplane.serving.placement"):
        run(scenario())
    assert len([r for r in caplog.records if "no placement fits memory" in r.message]) == 1


def test_the_shares_follow_the_gear_in_force() -> None:
    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        app = dataclasses.replace(config(), planned_rate_qps=100.0)
        gear: list[ServingGear | None] = [None]
        dispatcher = AppDispatcher(
            app,
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
            gear=lambda: gear[0],
        )
        dispatcher.set_workers(endpoints(workers))
        before = dispatcher.status().stages[0]
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        gear[0] = ServingGear(Cascade(("large",), ()))  # tiny serves nothing now
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        after = dispatcher.status().stages[0]
        # Without demand, tiny is split by speed: LARGE's profile is twice as fast.
        assert after.shares == pytest.approx({"i-0": 1 / 3, "i-1": 2 / 3}, rel=0.05)
        assert after.lp_utilisation != before.lp_utilisation
        await close(dispatcher, workers)

    run(scenario())
