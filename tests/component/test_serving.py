"""The serving loop against fake in-process workers (:mod:`tests.fake_worker`:
asyncio HTTP servers on 127.0.0.1 speaking the worker agent's interface, answering at once or
after a set delay, failing on demand).

Two levels: the dispatcher of one app (every query answered, cascade forwarding by threshold,
batching where the plan says so, a failing or dying worker's queries re-dispatched and the
worker marked unhealthy, late answers flagged, admission control) and the API around the
serving loop (the endpoint's contract, its errors, the status route, /metrics, the roll-up), all
on one event loop per test (``asyncio.run``); nothing sleeps, nothing is timed.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import FakeClock, SystemClock
from controlplane.dashboard import snapshot
from controlplane.db.store import Store
from controlplane.errors import (
    NoServingInstanceError,
    OverloadedError,
    QueryFailedError,
    QueryRejectedError,
    QueryTimeoutError,
    RequirementsUnmetError,
)
from controlplane.loops.rollup import roll_up
from controlplane.policies.variants import Requirements
from controlplane.service.app import create_app
from controlplane.serving.dispatcher import (
    AppConfig,
    AppDispatcher,
    DispatcherSettings,
    InferResult,
    ServingGear,
    StagePlan,
    WorkerLoss,
)
from controlplane.serving.loop import ServingLoop, ServingSettings
from controlplane.serving.modelio import ModelIO, Row
from controlplane.serving.observations import Observations
from controlplane.serving.transport import HttpWorkerTransport, WorkerReply
from controlplane.serving.workers import (
    ProvisionedInstances,
    StaticInstances,
    Worker,
    WorkerEndpoint,
    backoff_s,
)
from controlplane.settings import Settings
from estimator.cascades import Cascade
from estimator.fleet import Fleet
from estimator.profiles import LatencyProfile
from matching import registry
from matching.fcfs import FcfsPolicy
from matching.policy import Dispatch
from provisioners.artifacts import ModelSignature, TensorSpec
from provisioners.base import APP_TAG, LaunchRequest, ProvisionedInstance
from provisioners.fake import FakeProvisioner
from tests.fake_worker import FakeWorker

T = TypeVar("T")

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEADLINE_S = 60.0


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, DEADLINE_S))


def row(klass: int, certainty: float) -> list[float]:
    """An input the fake workers answer with ``klass`` at ``certainty`` (pixel 1 / 16)."""
    return [float(klass), 16.0 * certainty] + [0.0] * 62


def profile(model: str, instance_type: str, fixed_ms: float, slope_ms: float) -> LatencyProfile:
    sizes = np.array(BATCHES)
    return LatencyProfile(
        model,
        instance_type,
        sizes,
        tuple(np.full(3, fixed_ms + slope_ms * b) for b in BATCHES),
    )


def config(
    *,
    slo_ms: float = 200.0,
    models: tuple[str, ...] = ("tiny", "large"),
    thresholds: tuple[float, ...] = (0.5,),
    stage_plans: dict[str, StagePlan] | None = None,
    fixed_ms: float = 0.5,
) -> AppConfig:
    weight = {"tiny": 1.0, "medium": 2.0, "large": 4.0}  # bigger models are slower
    profiles = {
        m: {
            SMALL: profile(m, SMALL, 2 * fixed_ms * weight[m], 0.02),
            LARGE: profile(m, LARGE, fixed_ms * weight[m], 0.01),
        }
        for m in models
    }
    cascade = Cascade(models, thresholds) if len(models) > 1 else Cascade(models, ())
    return AppConfig(
        name="demo",
        slo_ms=slo_ms,
        models=models,
        cascade=cascade,
        profiles=profiles,
        prices_usd_per_hr={SMALL: 0.05, LARGE: 0.2},
        stage_plans=stage_plans or {},
    )


async def fleet(types: Sequence[str], **knobs: Any) -> list[FakeWorker]:
    workers = [FakeWorker(t, **knobs) for t in types]
    for worker in workers:
        await worker.start()
    return workers


def endpoints(workers: Sequence[FakeWorker]) -> list[WorkerEndpoint]:
    return [WorkerEndpoint(f"i-{k}", w.instance_type, w.address) for k, w in enumerate(workers)]


async def dispatcher_over(
    workers: Sequence[FakeWorker],
    app: AppConfig | None = None,
    *,
    on_unhealthy: Callable[[Any], None] | None = None,
    clock_s: Callable[[], float] | None = None,
    **settings: Any,
) -> AppDispatcher:
    """A dispatcher of ``app`` (default :func:`config`) over ``workers``, with ``settings``
    (:class:`DispatcherSettings`) and, where given, its health callback and clock."""
    extra: dict[str, Any] = {}
    if on_unhealthy is not None:
        extra["on_unhealthy"] = on_unhealthy
    if clock_s is not None:
        extra["clock_s"] = clock_s
    dispatcher = AppDispatcher(
        app or config(),
        HttpWorkerTransport(),
        # every batch time kept and read at once: these runs last milliseconds (the service
        # keeps one in every few so that they span a minute, and holds a batch size's back
        # until they span BATCH_EVIDENCE_S)
        Observations(span_s=0.0, batch_evidence_s=0.0),
        settings=DispatcherSettings(**settings),
        **extra,
    )
    dispatcher.set_workers(endpoints(workers))
    return dispatcher


async def settle(futures: Sequence[Awaitable[InferResult]]) -> list[InferResult | BaseException]:
    return list(await asyncio.gather(*futures, return_exceptions=True))


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (the scenario's deadline bounds it)."""
    while not condition():
        await asyncio.sleep(0)


# --- the dispatcher of one app ---------------------------------------------------------------


def test_every_query_is_answered_with_the_workers_outputs() -> None:
    async def scenario() -> None:
        workers = await fleet([SMALL, SMALL, LARGE])
        dispatcher = await dispatcher_over(workers, admission=False)
        inputs = [[row(q % 10, 0.9), row((q + 1) % 10, 0.9)] for q in range(400)]
        results = await settle([dispatcher.submit(x) for x in inputs])
        for q, result in enumerate(results):
            assert isinstance(result, InferResult), result
            assert result.outputs == (q % 10, (q + 1) % 10)
            assert result.models == ("tiny", "tiny")
            assert result.total_ms >= result.service_ms >= 0
            assert math.isclose(result.queue_ms + result.service_ms, result.total_ms)
        assert sum(w.rows for w in workers) == 800
        assert all(w.requests > 0 for w in workers)
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.arrived, totals.answered, totals.failed) == (400, 400, 0)
        await dispatcher.close()

    run(scenario())


def test_a_cascade_forwards_the_samples_below_the_threshold() -> None:
    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        dispatcher = await dispatcher_over(workers, config(models=("tiny", "large")))
        sure, unsure = row(3, 0.8), row(7, 0.2)
        result = await dispatcher.submit([sure, unsure, sure, row(1, 0.5)])
        assert result.models == ("tiny", "large", "tiny", "tiny")  # 0.5 >= 0.5 stops at tiny
        assert result.outputs == (3, 7, 3, 1)
        assert result.gear == "tiny@0.5 -> large"
        rows_by_model = Counter[str]()
        for worker in workers:
            rows_by_model.update(worker.rows_by_model)
        assert rows_by_model == {"tiny": 4, "large": 1}
        await dispatcher.close()

    run(scenario())


def test_a_three_model_cascade_answers_when_every_sample_is_final() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        app = config(models=("tiny", "medium", "large"), thresholds=(0.9, 0.5))
        dispatcher = await dispatcher_over(workers, app)
        result = await dispatcher.submit([row(1, 0.95), row(2, 0.6), row(3, 0.1)])
        assert result.models == ("tiny", "medium", "large")
        assert result.gear == "tiny@0.9 -> medium@0.5 -> large"
        await dispatcher.close()

    run(scenario())


def test_the_gear_hook_changes_the_cascade_of_new_queries() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE])
        gear: list[ServingGear | None] = [None]
        dispatcher = AppDispatcher(
            config(), HttpWorkerTransport(), Observations(), gear=lambda: gear[0]
        )
        dispatcher.set_workers(endpoints(workers))
        unsure = row(4, 0.1)
        assert (await dispatcher.submit([unsure])).models == ("large",)
        gear[0] = ServingGear(Cascade(("tiny",), ()))
        fast = await dispatcher.submit([unsure])
        assert (fast.models, fast.gear) == (("tiny",), "tiny")
        await dispatcher.close()

    run(scenario())


def test_the_status_gives_a_later_models_reach_at_the_specs_thresholds_whatever_the_gear() -> None:
    """Under a gear whose threshold answers every sample at the first model, the status still
    says which share the spec's threshold would forward: what the tuner sizes the stage for."""

    async def scenario() -> None:
        workers = await fleet([LARGE])
        gear: list[ServingGear | None] = [None]
        dispatcher = AppDispatcher(
            config(thresholds=(0.5,)), HttpWorkerTransport(), Observations(), gear=lambda: gear[0]
        )
        dispatcher.set_workers(endpoints(workers))
        assert [s.reach for s in dispatcher.status().stages] == [None, None]  # no answers yet
        gear[0] = ServingGear(Cascade(("tiny", "large"), (0.1,)))
        unsure, sure = row(2, 0.25), row(5, 0.75)
        result = await dispatcher.submit([unsure, unsure, unsure, sure])
        assert result.models == ("tiny",) * 4  # the gear forwarded none of them
        gear[0] = None  # the spec's own gear: 0.25 goes on to large
        result = await dispatcher.submit([unsure, sure, sure, sure])
        assert result.models == ("large", "tiny", "tiny", "tiny")
        first, second = dispatcher.status().stages
        assert (first.model, first.reach) == ("tiny", None)
        assert second.model == "large"
        assert second.reach == pytest.approx(4 / 8)  # 3 + 1 of 8 under 0.5 at tiny
        assert second.reach_samples == 8
        dispatcher.reconfigure(config(thresholds=(0.3,)))  # other thresholds: counted afresh
        assert dispatcher.status().stages[1].reach is None
        await dispatcher.close()

    run(scenario())


def test_a_third_models_reach_counts_only_what_the_specs_thresholds_send_the_second() -> None:
    """Under a gear whose first threshold forwards more than the spec's (and one that skips
    the first model), the second model answers samples the spec's first threshold would have
    answered: its share below is counted over those the spec's thresholds send it alone, and
    the third model's reach is the spec's. Counted over every sample it answered, the easy
    ones diluted its share and the third model read half its reach."""

    async def scenario() -> None:
        workers = await fleet([LARGE])
        models = ("tiny", "medium", "large")
        gear: list[ServingGear | None] = [ServingGear(Cascade(models, (0.9, 0.3)))]
        dispatcher = AppDispatcher(
            config(models=models, thresholds=(0.5, 0.3)),
            HttpWorkerTransport(),
            Observations(),
            gear=lambda: gear[0],
        )
        dispatcher.set_workers(endpoints(workers))
        easy, hard = row(1, 0.7), row(2, 0.2)
        # 0.7 goes on to medium under the gear's 0.9 (not under the spec's 0.5), and stops there.
        result = await dispatcher.submit([easy, easy, hard, hard])
        assert result.models == ("medium", "medium", "large", "large")
        gear[0] = ServingGear(Cascade(("medium", "large"), (0.3,)))  # tiny skipped
        result = await dispatcher.submit([easy, easy])
        assert result.models == ("medium", "medium")
        stages = {s.model: s for s in dispatcher.status().stages}
        assert (stages["medium"].reach, stages["medium"].reach_samples) == (0.5, 4)
        # At the spec's thresholds the two hard samples, and they alone, reach large.
        assert stages["large"].reach == pytest.approx(0.5)
        assert stages["large"].reach_samples == 4
        await dispatcher.close()

    run(scenario())


def test_the_plan_batches_queued_queries_together() -> None:
    async def scenario() -> None:
        # One slow worker: while it serves one batch, the others queue and go together.
        workers = await fleet([LARGE], delay_s=0.02)
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 8, policy="fcfs")}
        app = config(models=("tiny",), stage_plans=plan, slo_ms=10_000.0)
        dispatcher = await dispatcher_over(workers, app, admission=False)
        results = await settle([dispatcher.submit([row(q % 10, 0.9)]) for q in range(40)])
        assert all(isinstance(r, InferResult) for r in results)
        assert max(workers[0].batch_sizes) > 1
        assert max(workers[0].batch_sizes) <= 8
        assert sum(workers[0].batch_sizes) == 40
        await dispatcher.close()

    run(scenario())


def test_a_failing_worker_is_marked_unhealthy_and_its_queries_go_elsewhere() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE, LARGE])
        bad = workers[0]
        bad.status = 503  # a worker that says it cannot serve (a 500 is the model's error)
        unhealthy: list[str] = []
        dispatcher = AppDispatcher(
            config(models=("tiny",)),
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
            on_unhealthy=lambda loss: unhealthy.append(loss.endpoint.instance_id),
        )
        dispatcher.set_workers(endpoints(workers))
        results = await settle([dispatcher.submit([row(q % 10, 0.9)]) for q in range(200)])
        assert all(isinstance(r, InferResult) for r in results), results
        assert unhealthy == ["i-0"]
        status = {w.instance_id: w for w in dispatcher.status().workers}
        assert not status["i-0"].healthy and "HTTP 503" in status["i-0"].last_error
        assert status["i-1"].healthy and status["i-2"].healthy
        assert bad.requests == 0  # a 503 is not an answer
        # Probed after its backoff, it serves again once /health says ok.
        bad.status = None
        for worker in dispatcher.workers():
            worker.retry_at_s = 0.0
        await dispatcher.probe()
        assert all(w.healthy for w in dispatcher.status().workers)
        await dispatcher.close()

    run(scenario())


def watched_dispatcher(
    workers: Sequence[FakeWorker], app: AppConfig
) -> tuple[AppDispatcher, list[str]]:
    """A dispatcher over ``workers`` without admission control, and the instance ids it reports
    unhealthy (appended as it does)."""
    unhealthy: list[str] = []
    dispatcher = AppDispatcher(
        app,
        HttpWorkerTransport(),
        Observations(),
        settings=DispatcherSettings(admission=False),
        on_unhealthy=lambda loss: unhealthy.append(loss.endpoint.instance_id),
    )
    dispatcher.set_workers(endpoints(workers))
    return dispatcher, unhealthy


def poison_row(klass: int) -> list[float]:
    """A row the fake workers' model raises on (pixel 2 set: see :func:`poisoned`)."""
    bad = row(klass, 0.9)
    bad[2] = 1.0
    return bad


def poisoned(model: str, values: Sequence[float]) -> bool:
    return values[2] == 1.0


@pytest.mark.parametrize("foreign", [False, True])
def test_a_poison_query_fails_alone_and_the_worker_keeps_serving(foreign: bool) -> None:
    """The agent names the rows that failed (422, failed_rows): those queries get a 422, the
    others of the batch are sent again. A foreign server says only 500: each query of the batch
    is tried alone, and the poison one is a 422 too, the model having answered the good ones
    on that worker (it was a 502). Either way the worker stays healthy."""

    async def scenario() -> None:
        # One slow worker: queries queue while it serves and go together, poison among them.
        workers = await fleet([LARGE], delay_s=0.01, foreign=foreign)
        workers[0].poison = poisoned
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 8, policy="fcfs")}
        app = config(models=("tiny",), stage_plans=plan, slo_ms=10_000.0)
        dispatcher, unhealthy = watched_dispatcher(workers, app)
        inputs = [poison_row(q) if q % 7 == 3 else row(q % 10, 0.9) for q in range(60)]
        results = await settle([dispatcher.submit([x]) for x in inputs])
        for q, result in enumerate(results):
            if q % 7 == 3:
                assert isinstance(result, QueryRejectedError), result
                assert "index out of range" in str(result)
                # The model raised, the worker answered: nothing to retry.
                assert not getattr(result, "transport", False)
            else:
                assert isinstance(result, InferResult), result
                assert result.outputs == (q % 10,)
        assert max(workers[0].poisoned) > 1  # a batch of several held a poison query
        assert unhealthy == []
        (status,) = dispatcher.status().workers
        assert status.healthy and status.last_error == ""
        totals = dispatcher.observations.totals()["demo"]
        # A 422 is the client's mistake, not offered.
        assert (totals.answered, totals.failed) == (60 - 9, 0)
        assert totals.offered == 60 - 9
        assert totals.rejected == 9  # counted apart: arrived adds up
        await dispatcher.close()

    run(scenario())


def test_a_query_the_model_raises_on_alone_is_a_422_once_the_model_has_answered() -> None:
    """A foreign server's 500 for a query alone: with no evidence that the model works on that
    worker (it has answered nothing yet), a 502; once it has answered a good query, the same
    query is a 422, as it is beside good rows in a batch. An answer of the model's that does
    not fit the batch stays a 502 (the model's fault, not the query's)."""

    async def scenario() -> None:
        workers = await fleet([LARGE], foreign=True)
        workers[0].poison = poisoned
        dispatcher, unhealthy = watched_dispatcher(workers, config(models=("tiny",)))
        (first,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(first, QueryFailedError) and not first.transport, first
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        (again,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(again, QueryRejectedError) and "index out of range" in str(again)
        workers[0].poison = None
        workers[0].drops_a_row = True  # one query of two samples: its answer holds one row
        (short,) = await settle([dispatcher.submit([row(2, 0.9), row(4, 0.9)])])
        assert isinstance(short, QueryFailedError), short
        assert unhealthy == []
        await dispatcher.close()

    run(scenario())


def test_a_models_nan_output_and_an_answer_short_of_a_row_leave_the_worker_healthy() -> None:
    """A model's NaN and infinities (the agent writes JSON's NaN and Infinity) are an answer,
    not a broken worker: those queries are answered. A model that answers a batch of several
    with a row too few fails that batch, not the worker: its queries are tried again alone, and
    answered. The worker is never marked unhealthy."""

    async def scenario() -> None:
        workers = await fleet([LARGE], delay_s=0.01)
        workers[0].non_finite = poisoned
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 8, policy="fcfs")}
        app = config(models=("tiny",), stage_plans=plan, slo_ms=10_000.0)
        dispatcher, unhealthy = watched_dispatcher(workers, app)
        inputs = [poison_row(q) if q % 7 == 3 else row(q % 10, 0.9) for q in range(40)]
        results = await settle([dispatcher.submit([x]) for x in inputs])
        assert all(isinstance(r, InferResult) for r in results), results
        for q, result in enumerate(results):
            assert isinstance(result, InferResult)
            if q % 7 == 3:
                ((reply, offset),) = result.replies
                width = len(reply.outputs[0].data) // reply.outputs[0].shape[0]
                sample = reply.outputs[0].data[offset * width : (offset + 1) * width]
                assert math.isnan(sample[0]) and sample[1] == math.inf
            else:
                assert result.outputs == (q % 10,)
        assert max(workers[0].batch_sizes) > 1  # NaN rows were answered in batches of several

        workers[0].non_finite = None
        workers[0].drops_a_row = True
        results = await settle([dispatcher.submit([row(q % 10, 0.9)]) for q in range(24)])
        assert all(isinstance(r, InferResult) for r in results), results
        assert [r.outputs for r in results if isinstance(r, InferResult)] == [
            (q % 10,) for q in range(24)
        ]
        assert unhealthy == []
        (status,) = dispatcher.status().workers
        assert status.healthy
        await dispatcher.close()

    run(scenario())


def test_a_row_that_does_not_fit_the_signature_fails_alone_in_its_batch() -> None:
    """A row the dispatcher cannot encode (63 values for a 64-value input) refuses the batch
    before any call; each of its queries is tried again alone, and only the bad one fails."""

    async def scenario() -> None:
        workers = await fleet([LARGE], delay_s=0.01)
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 8, policy="fcfs")}
        app = config(models=("tiny",), stage_plans=plan, slo_ms=10_000.0)
        dispatcher = await dispatcher_over(workers, app, admission=False)
        inputs = [row(q % 10, 0.9)[:63] if q == 5 else row(q % 10, 0.9) for q in range(12)]
        results = await settle([dispatcher.submit([x]) for x in inputs])
        assert isinstance(results[5], QueryRejectedError), results[5]
        assert "64 values" in str(results[5])
        assert all(isinstance(r, InferResult) for q, r in enumerate(results) if q != 5)
        assert all(w.healthy for w in dispatcher.status().workers)
        await dispatcher.close()

    run(scenario())


def test_queries_of_a_dynamic_dimension_go_in_batches_of_one_shape() -> None:
    """A model whose input has a dynamic dimension past the batch (a sequence's length) takes
    one shape a batch. Queries of two lengths queued together go in batches of one length each,
    and every one is answered: a batch of both failed to encode, was taken for bad inputs, and
    each of its queries went alone from then on (a load of two lengths, one query a call)."""
    signature = ModelSignature(
        (TensorSpec("x", "FP32", (-1, -1)),), (TensorSpec("scores", "FP32", (-1, 10)),)
    )

    async def scenario() -> None:
        (worker,) = await fleet([LARGE], signatures={"tiny": signature})
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 8, policy="fcfs")}
        app = dataclasses.replace(
            config(models=("tiny",), stage_plans=plan, slo_ms=10_000.0),
            io={"tiny": ModelIO("tiny", signature)},
        )
        dispatcher = await dispatcher_over([worker], app, admission=False)
        worker.holding = True
        first = dispatcher.submit([row(0, 0.9)])  # held: what follows queues behind it
        await until(lambda: worker.received == 1)
        queued = [dispatcher.submit([row(q, 0.9)[: 8 if q % 2 else 12]]) for q in range(1, 9)]
        worker.release()
        results = await settle([first, *queued])
        assert all(isinstance(r, InferResult) for r in results), results
        assert [r.outputs for r in results if isinstance(r, InferResult)] == [
            (q,) for q in range(9)
        ]
        assert worker.batch_sizes == [1, 4, 4]  # the held query, then one batch of each length
        await dispatcher.close()
        await worker.stop()

    run(scenario())


def test_a_worker_that_dies_mid_run_loses_no_query() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE, LARGE], delay_s=0.005)
        dispatcher = await dispatcher_over(workers, config(models=("tiny",)), admission=False)
        first = [dispatcher.submit([row(q % 10, 0.9)]) for q in range(60)]
        await until(lambda: workers[1].requests > 3)
        workers[1].kill()
        second = [dispatcher.submit([row(q % 10, 0.9)]) for q in range(60)]
        results = await settle(first + second)
        assert all(isinstance(r, InferResult) for r in results), results
        victim = next(w for w in dispatcher.status().workers if w.instance_id == "i-1")
        assert not victim.healthy
        await dispatcher.close()

    run(scenario())


def test_a_worker_that_dies_while_idle_leaves_matching_at_its_idle_probe() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE, LARGE])
        losses: list[tuple[str, int]] = []
        dispatcher = AppDispatcher(
            config(models=("tiny",)),
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False, idle_probe_s=0.0),
            on_unhealthy=lambda loss: losses.append(
                (loss.endpoint.instance_id, loss.in_flight_queries)
            ),
        )
        dispatcher.set_workers(endpoints(workers))
        await dispatcher.probe()  # every worker answers: nothing changes
        assert all(w.healthy for w in dispatcher.status().workers) and losses == []
        workers[2].kill()
        await dispatcher.probe()
        health = {w.instance_id: w.healthy for w in dispatcher.status().workers}
        assert health == {"i-0": True, "i-1": True, "i-2": False}
        assert losses == [("i-2", 0)]  # recorded as a loss with nothing in flight
        results = await settle([dispatcher.submit([row(q % 10, 0.9)]) for q in range(30)])
        assert all(isinstance(r, InferResult) for r in results), results
        assert workers[0].requests + workers[1].requests == 30
        await dispatcher.close()

    run(scenario())


class _AnswersButProbesSlowly:
    """A transport whose worker serves batches but whose health answer, a failure, comes only
    when the test releases it."""

    def __init__(self) -> None:
        self.probed = asyncio.Event()
        self.release = asyncio.Event()

    async def infer(
        self, address: str, io: ModelIO, rows: Sequence[Row], timeout_s: float
    ) -> WorkerReply:
        return WorkerReply(tuple(1 for _ in rows), tuple(0.9 for _ in rows), 1.0, LARGE)

    async def health(self, address: str, timeout_s: float) -> bool:
        self.probed.set()
        await self.release.wait()
        return False

    async def close(self) -> None:
        return None


def test_a_batch_served_during_an_idle_probe_outweighs_the_probes_failure() -> None:
    async def scenario() -> None:
        transport = _AnswersButProbesSlowly()
        dispatcher = AppDispatcher(
            config(models=("tiny",)),
            transport,
            Observations(),
            settings=DispatcherSettings(admission=False, idle_probe_s=0.0),
        )
        dispatcher.set_workers([WorkerEndpoint("i-0", LARGE, "127.0.0.1:9")])
        probe = asyncio.create_task(dispatcher.probe())
        await transport.probed.wait()
        (result,) = await settle([dispatcher.submit([row(1, 0.9)])])
        assert isinstance(result, InferResult)  # served while the probe was out
        transport.release.set()
        await probe
        (worker,) = dispatcher.status().workers
        assert worker.healthy, worker.last_error
        await dispatcher.close()

    run(scenario())


def test_without_idle_probes_an_idle_dead_worker_stays_in_matching_until_a_call_fails() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        dispatcher = await dispatcher_over(
            workers, config(models=("tiny",)), admission=False, idle_probe_s=None
        )
        workers[1].kill()
        await dispatcher.probe()
        assert all(w.healthy for w in dispatcher.status().workers)
        await dispatcher.close()

    run(scenario())


def test_a_hanging_worker_times_out_and_is_taken_out() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        workers[0].hang = True
        dispatcher = await dispatcher_over(
            workers, config(models=("tiny",)), admission=False, call_timeout_floor_s=0.5
        )
        results = await settle([dispatcher.submit([row(q, 0.9)]) for q in range(10)])
        assert all(isinstance(r, InferResult) for r in results), results
        hung = next(w for w in dispatcher.status().workers if w.instance_id == "i-0")
        assert not hung.healthy and "timeout" in hung.last_error
        await dispatcher.close()

    run(scenario())


def test_a_worker_replaced_under_the_same_id_has_answered_nothing_for_the_422_rule() -> None:
    """The evidence that the model works on a worker is that worker's answers: a new worker
    under the same instance id (its endpoint changed: a new process, a new address) has given
    none, so a query its model raises on alone is a 502 there, as on any worker that has
    answered nothing (it was a 422 on the answers of the worker it replaced)."""

    async def scenario() -> None:
        old, new = await fleet([LARGE, LARGE], foreign=True)
        new.poison = poisoned
        dispatcher, unhealthy = watched_dispatcher([old], config(models=("tiny",)))
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        dispatcher.set_workers([WorkerEndpoint("i-0", LARGE, new.address)])
        (raised,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(raised, QueryFailedError) and not raised.transport, raised
        assert new.received == 1 and old.received == 1
        assert isinstance(await dispatcher.submit([row(2, 0.9)]), InferResult)
        (again,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(again, QueryRejectedError), again  # the new worker has answered
        assert unhealthy == []
        await dispatcher.close()

    run(scenario())


async def slow_path_dispatcher(
    workers: Sequence[FakeWorker], app: AppConfig, **options: Any
) -> AppDispatcher:
    """A dispatcher over ``workers`` that take a slow path (never answered) on poison rows, its
    calls timing out after 0.5 s, admission and idle probes off; ``options`` as
    :func:`dispatcher_over`'s."""
    for worker in workers:
        worker.slow = poisoned
    return await dispatcher_over(
        workers, app, admission=False, call_timeout_floor_s=0.5, idle_probe_s=None, **options
    )


def test_a_slow_query_alone_takes_out_one_worker_and_is_answered_504() -> None:
    """A value-dependent slow path: the call times out and the worker, alive, answers its
    probe. It leaves matching (still busy with the batch), and the query is not sent to the
    next worker (it took each out in turn, then a 502 inviting a retry): a 504, counted as
    timed out. The good queries after it are served by the other workers."""

    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE, LARGE])
        losses: list[str] = []
        dispatcher = await slow_path_dispatcher(
            workers,
            config(models=("tiny",)),
            on_unhealthy=lambda loss: losses.append(loss.endpoint.instance_id),
        )
        (slow,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(slow, QueryTimeoutError) and "within 500 ms" in str(slow), slow
        assert sum(w.received for w in workers) == 1 and len(losses) == 1
        results = await settle([dispatcher.submit([row(q, 0.9)]) for q in range(6)])
        assert [r.outputs for r in results if isinstance(r, InferResult)] == [
            (q,) for q in range(6)
        ]
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.timed_out, totals.failed) == (6, 1, 0)
        await dispatcher.close()

    run(scenario())


def test_a_worker_back_while_still_busy_with_a_slow_query_does_not_fail_the_next() -> None:
    """The worker a slow query took out answers its probe and serves again, still busy with
    that query (a server that does not say it is busy, unlike the agent, and runs one batch at
    a time): the next query's call to it times out too. That query is not the slow one: it is
    tried on the other worker and answered, not answered 504."""
    now = [1000.0]

    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        dispatcher = await slow_path_dispatcher(
            workers, config(models=("tiny",)), clock_s=lambda: now[0]
        )
        (slow,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(slow, QueryTimeoutError), slow
        (out,) = [k for k, w in enumerate(dispatcher.status().workers) if not w.healthy]
        workers[out].slow = lambda model, values: True  # still busy with the slow query
        workers[out].reports_busy = False  # and does not say so
        now[0] += 60.0  # past its probe's backoff
        await dispatcher.probe()
        assert all(w.healthy for w in dispatcher.status().workers)
        results = await settle([dispatcher.submit([row(q, 0.9)]) for q in range(2)])
        assert [r.outputs for r in results if isinstance(r, InferResult)] == [(0,), (1,)]
        assert workers[out].received == 2 and workers[1 - out].requests == 2
        await dispatcher.close()

    run(scenario())


async def slow_query_taken_out(
    now: list[float],
) -> tuple[list[FakeWorker], AppDispatcher, Worker, list[str]]:
    """Two fake workers over HTTP (they say when they are busy), a slow-path dispatcher on the
    clock ``now``, and one slow query sent: answered 504, its worker out. The workers, the
    dispatcher, the worker out and the instance ids reported lost."""
    workers = await fleet([LARGE, LARGE])
    losses: list[str] = []
    dispatcher = await slow_path_dispatcher(
        workers,
        config(models=("tiny",)),
        clock_s=lambda: now[0],
        on_unhealthy=lambda loss: losses.append(loss.endpoint.instance_id),
    )
    (slow,) = await settle([dispatcher.submit([poison_row(3)])])
    assert isinstance(slow, QueryTimeoutError), slow
    (out,) = [w for w in dispatcher.workers() if not w.healthy]
    return workers, dispatcher, out, losses


def test_a_worker_whose_agent_says_it_is_busy_stays_out_until_the_slow_query_ends() -> None:
    """The worker a slow query took out answers its probes, but its agent says a batch is
    under way there (the slow one: it runs one at a time): it stays out of matching, probed
    again after the same backoff (busy is no failure: the backoff does not grow), and is sent
    nothing meanwhile (no query times out behind the slow one). Once the slow batch ends, its
    next probe puts it back."""
    now = [1000.0]

    async def scenario() -> None:
        workers, dispatcher, out, losses = await slow_query_taken_out(now)
        index = int(out.instance_id.removeprefix("i-"))
        assert workers[index].slow_batches == 1 and out.failures == 1
        for _ in range(3):
            now[0] += 60.0  # past its probe's backoff
            await dispatcher.probe()
            assert not out.healthy and out.last_error.startswith("busy: 1 batch"), out.last_error
            assert out.failures == 1 and out.retry_at_s == now[0] + backoff_s(1)
            results = await settle([dispatcher.submit([row(q, 0.9)]) for q in range(2)])
            assert [r.outputs for r in results if isinstance(r, InferResult)] == [(0,), (1,)]
        assert workers[index].received == 1 and losses == [out.instance_id]
        workers[index].end_slow()
        now[0] += 60.0
        await dispatcher.probe()
        assert all(w.healthy for w in dispatcher.workers()) and out.last_error == ""
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.timed_out, totals.failed) == (6, 1, 0)
        await dispatcher.close()

    run(scenario())


def test_a_second_slow_query_after_the_busy_worker_is_back_takes_out_one_worker() -> None:
    """The worker a slow query took out stays out while its agent says busy, and is back once
    the slow batch ends: its slow batch is over, so a second slow query that times out there
    is probed and answered 504 with that one worker out, not read as the worker's failure and
    tried again on the other worker, which it would take out too."""
    now = [1000.0]

    async def scenario() -> None:
        workers, dispatcher, out, losses = await slow_query_taken_out(now)
        index = int(out.instance_id.removeprefix("i-"))
        now[0] += 60.0
        await dispatcher.probe()
        assert not out.healthy and out.last_error.startswith("busy: 1 batch"), out.last_error
        workers[index].end_slow()
        now[0] += 60.0
        await dispatcher.probe()
        assert all(w.healthy for w in dispatcher.workers())
        # A query answered by the other worker (idle the longer), then the second slow query
        # goes to this one (idle the longer now).
        other = workers[1 - index]
        (answered,) = await settle([dispatcher.submit([row(0, 0.9)])])
        assert isinstance(answered, InferResult) and other.received == 1, answered
        (again,) = await settle([dispatcher.submit([poison_row(3)])])
        assert isinstance(again, QueryTimeoutError), again
        assert workers[index].received == 2 and other.received == 1
        assert losses == [out.instance_id, out.instance_id], losses
        assert [w.healthy for w in dispatcher.workers()].count(True) == 1
        await dispatcher.close()

    run(scenario())


def test_a_slow_query_in_a_batch_is_tried_alone_and_the_others_are_served() -> None:
    """Which query of a timed-out batch was slow is not known: each is tried again alone, the
    good ones are answered and the slow one is a 504 when its own call times out. Two workers
    out of three leave matching (the batch's and the slow query's own), not every one."""

    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE, LARGE], delay_s=0.01)
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 8, policy="fcfs")}
        app = config(models=("tiny",), stage_plans=plan, slo_ms=10_000.0)
        dispatcher = await slow_path_dispatcher(workers, app)
        inputs = [poison_row(q) if q == 3 else row(q, 0.9) for q in range(8)]
        results = await settle([dispatcher.submit([x]) for x in inputs])
        for q, result in enumerate(results):
            if q == 3:
                assert isinstance(result, QueryTimeoutError), result
            else:
                assert isinstance(result, InferResult) and result.outputs == (q,), result
        assert sum(w.received for w in workers) - sum(w.requests for w in workers) == 2
        assert sum(w.healthy for w in dispatcher.status().workers) == 1
        await dispatcher.close()

    run(scenario())


def test_queries_fail_explicitly_when_every_attempt_fails() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        for worker in workers:
            worker.status = 503
        dispatcher = await dispatcher_over(workers, config(models=("tiny",)), admission=False)
        results = await settle([dispatcher.submit([row(1, 0.9)]) for _ in range(4)])
        # The two in flight fail (502); the two queued behind them are stranded once no healthy
        # worker is left, and answered at once (503) instead of at their give-up time.
        kinds = sorted(type(r).__name__ for r in results)
        assert kinds == ["NoServingInstanceError"] * 2 + ["QueryFailedError"] * 2, results
        # The workers failed, not the model: sent again, a query may be answered (Retry-After,
        # gRPC's UNAVAILABLE).
        assert all(r.transport for r in results if isinstance(r, QueryFailedError))
        # Both workers are out now: a new query is refused at once, never left waiting.
        with pytest.raises(NoServingInstanceError):
            dispatcher.submit([row(1, 0.9)])
        totals = dispatcher.observations.totals()["demo"]
        # 502s are failed; the 503s (stranded, and refused at arrival) are refused: all misses.
        assert (totals.failed, totals.refused, totals.answered) == (2, 3, 0)
        assert totals.attainment_share == 0.0
        await dispatcher.close()

    run(scenario())


def test_a_worker_refusing_the_inputs_fails_the_query_without_retrying() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        for worker in workers:
            worker.status = 400
        dispatcher = await dispatcher_over(workers, config(models=("tiny",)), admission=False)
        (result,) = await settle([dispatcher.submit([row(1, 0.9)])])
        # The inputs are at fault: a 422 for the caller, no retry, no worker out of matching.
        assert isinstance(result, QueryRejectedError) and "HTTP 400" in str(result)
        assert all(w.healthy for w in dispatcher.status().workers)
        # The client's mistake: not offered, so no miss of the app's attainment.
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.failed, totals.offered, totals.rejected) == (0, 0, 1)
        await dispatcher.close()

    run(scenario())


def test_an_interfered_instance_is_left_out_while_an_active_one_serves() -> None:
    async def scenario() -> None:
        # Both profiled at about 1 ms a batch; one takes 20 ms (it says so in served_ms).
        workers = await fleet([LARGE, LARGE])
        slow = workers[0]
        slow.delay_s = 0.02
        dispatcher = await dispatcher_over(workers, config(models=("tiny",)), admission=False)
        # In waves, so that the slow one serves the tracker's minimum of 5 batches whatever
        # the order the policy picks idle workers in.
        while slow.requests < 5:
            assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
            assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        before = slow.requests
        results = await settle([dispatcher.submit([row(q % 10, 0.9)]) for q in range(200)])
        assert all(isinstance(r, InferResult) for r in results)
        (stage,) = dispatcher.status().stages
        assert stage.states == {"i-0": "interfered", "i-1": "active"}
        assert slow.requests == before  # avoided while the other one is active
        await dispatcher.close()

    run(scenario())


def test_a_late_query_is_answered_and_flagged_late() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE], delay_s=0.05)
        dispatcher = await dispatcher_over(workers, config(models=("tiny",), slo_ms=10.0))
        result = await dispatcher.submit([row(2, 0.9)])
        assert result.late and result.total_ms > 10.0 and result.outputs == (2,)
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.late) == (1, 1)
        await dispatcher.close()

    run(scenario())


def test_admission_refuses_with_a_retry_after_when_the_queue_cannot_make_the_slo() -> None:
    async def scenario() -> None:
        # The profile says 10 ms a batch; one worker; SLO 100 ms: a backlog past ~9 queries
        # cannot be served in time, so the burst's tail is refused rather than queued.
        workers = await fleet([LARGE], delay_s=0.01)
        app = config(models=("tiny",), slo_ms=100.0, fixed_ms=10.0)
        dispatcher = await dispatcher_over(workers, app)
        futures: list[asyncio.Future[InferResult]] = []
        refused: list[OverloadedError] = []
        for q in range(50):
            try:
                futures.append(dispatcher.submit([row(q % 10, 0.9)]))
            except OverloadedError as error:
                refused.append(error)
        assert 5 <= len(futures) <= 15, len(futures)
        assert refused and all(e.retry_after_s >= 1 for e in refused)
        assert all(e.predicted_ms > e.slo_ms for e in refused)
        results = await settle(futures)
        assert all(isinstance(r, InferResult) for r in results)
        # Drained: admitted again.
        assert isinstance(await dispatcher.submit([row(1, 0.9)]), InferResult)
        assert dispatcher.observations.totals()["demo"].refused == len(refused)
        await dispatcher.close()

    run(scenario())


def test_no_worker_is_a_no_serving_instance_error() -> None:
    async def scenario() -> None:
        dispatcher = await dispatcher_over([])
        with pytest.raises(NoServingInstanceError, match="no running worker"):
            dispatcher.submit([row(1, 0.9)])
        await dispatcher.close()

    run(scenario())


def test_a_model_less_query_gets_the_cheapest_variant_that_meets_it() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE])
        dispatcher = await dispatcher_over(workers)
        # No validation records: accuracy is unknown (0), so a latency bound alone is met by the
        # cheapest variant, one model alone.
        result = await dispatcher.infer([row(5, 0.1)], requirements=Requirements("demo", 500.0))
        assert result.gear == "tiny" and result.models == ("tiny",)
        with pytest.raises(RequirementsUnmetError, match="closest offer") as caught:
            await dispatcher.infer([row(5, 0.1)], requirements=Requirements("demo", None, 0.9))
        assert caught.value.offer
        await dispatcher.close()

    run(scenario())


def test_an_accuracy_no_variant_has_is_unmet_even_with_no_worker_up() -> None:
    """With no worker running, a query asking for more accuracy than any variant has was a 503
    (try again later); no fleet would ever meet it: 422 as with workers up. An ask a variant
    meets stays a 503 until a worker serves it."""
    from dataclasses import replace

    from estimator.cascades import synthetic_validation

    records = synthetic_validation(
        np.random.default_rng(0), [0.9, 0.97], names=["tiny", "large"], n_samples=400
    )

    async def scenario() -> None:
        dispatcher = await dispatcher_over([], replace(config(), validation=records))
        with pytest.raises(RequirementsUnmetError, match="whatever the fleet; closest offer"):
            await dispatcher.infer([row(5, 0.1)], requirements=Requirements("demo", None, 0.999))
        with pytest.raises(NoServingInstanceError):
            await dispatcher.infer([row(5, 0.1)], requirements=Requirements("demo", None, 0.5))
        await dispatcher.close()

    run(scenario())


def test_a_latency_no_variant_reaches_is_unmet_even_with_no_worker_up() -> None:
    """With no worker running, a latency bound under every variant's fastest service (its
    reached stages on the fastest profiled type, no queue) was a 503 (try again later), while
    the same query with workers up is a 422: no fleet would meet it. A bound a fleet could meet
    stays a 503, and so does one met only by a variant of too little accuracy when another is
    accurate enough but too slow."""
    from dataclasses import replace

    from estimator.cascades import synthetic_validation

    records = synthetic_validation(
        np.random.default_rng(0), [0.9, 0.97], names=["tiny", "large"], n_samples=400
    )

    async def scenario() -> None:
        # tiny serves one sample in 0.51 ms at the fastest (emu.cpu.large), large in 2.01 ms.
        dispatcher = await dispatcher_over([], replace(config(), validation=records))
        with pytest.raises(RequirementsUnmetError, match="whatever the fleet") as caught:
            await dispatcher.infer([row(5, 0.1)], requirements=Requirements("demo", 0.1))
        assert "closest offer: model tiny at 0.51 ms at the fastest" in str(caught.value)
        # Fast enough on tiny, accurate enough on large: no variant is both.
        with pytest.raises(RequirementsUnmetError, match="whatever the fleet"):
            await dispatcher.infer([row(5, 0.1)], requirements=Requirements("demo", 1.0, 0.95))
        for reachable in (Requirements("demo", 1.0), Requirements("demo", 50.0, 0.95)):
            with pytest.raises(NoServingInstanceError):
                await dispatcher.infer([row(5, 0.1)], requirements=reachable)
        await dispatcher.close()

    run(scenario())


def test_a_refusal_is_an_overload_sign_of_the_stage_admission_judged_only() -> None:
    """A cascade whose first model's queue refuses queries: each refusal was recorded as an
    overload sign for every model the query would have reached, so the later model, a share of
    the samples reaching it and far from its capacity, read as overloaded too (a tester's
    medium at 8 qps of its 80). Only the stages every sample reaches judge a query."""
    from dataclasses import replace

    from estimator.cascades import synthetic_validation

    records = synthetic_validation(
        np.random.default_rng(0), [0.9, 0.97], names=["tiny", "large"], n_samples=400
    )

    async def scenario() -> None:
        workers = await fleet([LARGE])
        workers[0].hang = True  # holds its batch: the queue only grows
        app = replace(config(fixed_ms=20.0, slo_ms=100.0), validation=records)
        dispatcher = await dispatcher_over(workers, app)
        signs: list[str] = []
        dispatcher.tracker.refused = lambda key, *_: signs.append(key[1])  # type: ignore[method-assign]
        refused = 0
        for _ in range(40):
            try:
                dispatcher.submit([row(1, 0.1)])
            except OverloadedError:
                refused += 1
        assert refused and len(signs) == refused and set(signs) == {"tiny"}
        await dispatcher.close()

    run(scenario())


def test_a_workers_first_batches_are_its_warm_up_not_its_speed() -> None:
    """Calibration reads the batches a worker answered after its first few: a fresh worker's
    first calls (a runtime's first runs, a connection opened) made its first drift overshoot
    (3.15 stored where 2.1 held a minute later)."""
    warmup = DispatcherSettings().warmup_batches

    async def scenario() -> None:
        workers = await fleet([LARGE])
        dispatcher = await dispatcher_over(workers, config(models=("tiny",)))
        for _ in range(warmup + 3):
            await dispatcher.submit([row(1, 0.9)])
        times = dispatcher.observations.batch_times_ms("demo")[("tiny", LARGE)]
        assert sum(len(t) for t in times.values()) == 3
        await dispatcher.close()

    run(scenario())


def test_a_model_less_answer_past_its_own_latency_bound_is_flagged_late() -> None:
    """The variant is chosen on its predicted latency (about 1 ms here); the worker takes 50 ms.
    The answer is past the 20 ms the query asked for, though within the app's 200 ms SLO: its
    ``late`` says so (a tester's query asking for 33.5 ms was answered in 46 ms with ``late``
    false). The app's own counts stay against its SLO."""

    async def scenario() -> None:
        workers = await fleet([LARGE], delay_s=0.05)
        dispatcher = await dispatcher_over(workers, config(slo_ms=200.0))
        bound = Requirements("demo", latency_ms=20.0)
        result = await dispatcher.infer([row(5, 0.9)], requirements=bound)
        assert result.total_ms > 20.0 and result.late
        # Without a bound of its own, a query is judged against the SLO (200 ms).
        loose = await dispatcher.infer([row(5, 0.9)], requirements=Requirements("demo", 5000.0))
        assert loose.total_ms > 20.0 and not loose.late
        totals = dispatcher.observations.totals()["demo"]
        assert (totals.answered, totals.late) == (2, 0)
        await dispatcher.close()

    run(scenario())


def test_a_worker_removed_from_the_fleet_leaves_matching() -> None:
    async def scenario() -> None:
        workers = await fleet([LARGE, LARGE])
        dispatcher = await dispatcher_over(workers, config(models=("tiny",)))
        dispatcher.set_workers(endpoints(workers)[1:])
        results = await settle([dispatcher.submit([row(1, 0.9)]) for _ in range(20)])
        assert all(isinstance(r, InferResult) for r in results)
        assert workers[0].requests == 0 and workers[1].requests == 20
        await dispatcher.close()

    run(scenario())


def test_a_stage_whose_only_worker_dies_borrows_the_other_stages_workers() -> None:
    """One worker per stage, as the demo's plan places them: tiny's dies holding a batch; that
    batch and the queries queued behind it go to large's worker (every worker loads the whole
    family) instead of failing, and the loss says what was in flight on it."""

    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        workers[0].hang = True  # holds its first batch until it dies
        plan = {
            "tiny": StagePlan("tiny", Fleet.of({SMALL: 1}), 1),
            "large": StagePlan("large", Fleet.of({LARGE: 1}), 1),
        }
        losses: list[WorkerLoss] = []
        dispatcher = AppDispatcher(
            config(stage_plans=plan),
            HttpWorkerTransport(),
            Observations(),
            settings=DispatcherSettings(admission=False),
            on_unhealthy=losses.append,
        )
        dispatcher.set_workers(endpoints(workers))
        futures = [dispatcher.submit([row(q, 0.9)]) for q in range(10)]
        (victim,) = [w for w in dispatcher.workers() if w.instance_id == "i-0"]
        await until(lambda: victim.running)
        workers[0].kill()
        results = await settle(futures)
        assert all(isinstance(r, InferResult) for r in results), results
        assert [r.models for r in results if isinstance(r, InferResult)] == [("tiny",)] * 10
        assert workers[1].rows_by_model["tiny"] == 10
        ((endpoint, in_flight, redispatched, failed),) = [
            (x.endpoint.instance_id, x.in_flight_queries, x.redispatched_queries, x.failed_queries)
            for x in losses
        ]
        assert (endpoint, in_flight, redispatched, failed) == ("i-0", 1, 1, 0)
        await dispatcher.close()

    run(scenario())


class _FailsToDecide(FcfsPolicy):
    """FCFS whose every decision raises (a policy's bug)."""

    name = "test-fails-to-decide"

    def dispatch(self, *args: Any) -> list[Dispatch]:
        raise ValueError("cannot decide")


class _FailsToLearn(FcfsPolicy):
    """FCFS whose learning from a served batch raises (a policy's bug)."""

    name = "test-fails-to-learn"

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        raise ValueError("cannot learn")


@pytest.mark.parametrize("broken", [_FailsToDecide, _FailsToLearn])
def test_a_policy_that_raises_falls_back_to_fcfs_once_and_every_query_is_answered(
    broken: type[FcfsPolicy], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy whose ``dispatch`` or ``observe`` raises: FCFS decides from then on, said once,
    and no query is lost. (A raising ``observe`` lost the answers of the batch it learnt from,
    and the stage stalled with queries queued and its workers idle.)"""
    monkeypatch.setitem(registry.POLICIES, broken.name, broken)

    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE], delay_s=0.002)
        plan = {"tiny": StagePlan("tiny", Fleet.of({}), 1, policy=broken.name)}
        dispatcher = await dispatcher_over(
            workers, config(models=("tiny",), stage_plans=plan), admission=False
        )
        assert dispatcher.status().stages[0].policy == broken.name
        futures = [dispatcher.submit([row(q % 10, 0.9)]) for q in range(12)]
        results = await asyncio.wait_for(settle(futures), 10.0)
        assert [r.outputs for r in results if isinstance(r, InferResult)] == [
            (q % 10,) for q in range(12)
        ], results
        assert dispatcher.status().stages[0].policy == "fcfs"
        await dispatcher.close()
        for worker in workers:
            await worker.stop()

    with caplog.at_level(logging.ERROR, logger="controlplane.serving.dispatcher"):
        run(scenario())
    said = [r for r in caplog.records if "falls back to fcfs" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


# --- the API around the serving loop ---------------------------------------------------------

SPEC = {
    "name": "demo",
    "models": [
        {"name": "tiny", "profiles": "profiles.csv"},
        {"name": "large", "profiles": "profiles.csv"},
    ],
    "cascade": ["tiny", "large"],
    "thresholds": [0.5],
    "slo": {"latency_ms": 300},
    "budget_usd_per_hr": 5,
    "instance_types": [SMALL, LARGE],
}


def write_profiles(folder: Path, fixed_ms: float = 1.0) -> None:
    lines = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for model, weight in (("tiny", 1.0), ("large", 4.0)):
        for instance_type, scale in ((SMALL, 2.0), (LARGE, 1.0)):
            for b in BATCHES:
                ms = scale * weight * (fixed_ms + 0.01 * b)
                lines += [f"{model},{instance_type},{b},{i},{ms:.4f},0" for i in range(3)]
    (folder / "profiles.csv").write_text("\n".join(lines) + "\n")


class ApiWorld:
    """The API, a store with the demo app and tokens, a serving loop over fake workers."""

    def __init__(
        self, tmp_path: Path, *, fixed_ms: float = 1.0, slo_ms: float | None = None
    ) -> None:
        self.data_dir = tmp_path / "data"
        self.data_dir.mkdir()
        write_profiles(self.data_dir, fixed_ms)
        self.settings = Settings(data_dir=self.data_dir, provisioner="fake")
        self.store = Store.from_url(self.settings.database_url, FakeClock(), upgrade=True)
        self.tokens = {
            scope: self.store.create_token(scope, name=f"{scope}-token")
            for scope in ("admin", "viewer", "infer")
        }
        resolver = AppResolver(self.data_dir)
        spec = SPEC if slo_ms is None else {**SPEC, "slo": {"latency_ms": slo_ms}}
        self.store.create_app(spec_document(resolver.check(spec).spec), who="test")
        self.instances = StaticInstances()
        self.serving = ServingLoop(
            self.store,
            resolver,
            self.instances,
            clock=SystemClock(),
            settings=ServingSettings(refresh_s=3600.0),
        )
        self.app = create_app(self.settings, self.store, FakeClock(), serving=self.serving)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://heteroplane"
        )

    def auth(self, scope: str = "infer") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[scope]}"}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[ApiWorld]:
    made = ApiWorld(tmp_path)
    yield made
    made.store.close()


def api_run(world: ApiWorld, body: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    async def scenario() -> T:
        await world.serving.start()
        try:
            async with world.client() as client:
                return await body(client)
        finally:
            await world.serving.stop()

    return run(scenario())


def test_the_endpoint_answers_with_outputs_models_gear_and_timings(tmp_path: Path) -> None:
    # An SLO no wait here reaches: a busy machine took the first query past 300 ms by the time
    # tiny forwarded its second sample, and admission control then rightly refused it (429);
    # what this test checks is the answer's shape and the counts.
    world = ApiWorld(tmp_path, slo_ms=60_000.0)

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([SMALL, LARGE])
        world.instances.set("demo", endpoints(workers))
        response = await client.post(
            "/v1/apps/demo/infer",
            json={"inputs": [row(3, 0.9), row(4, 0.1)], "sample_ids": [10, 11]},
            headers=world.auth(),
        )
        assert response.status_code == 200, response.text
        answer = response.json()
        assert set(answer) == {"outputs", "models", "certainty", "gear", "timings", "late"}
        assert answer["outputs"] == [3, 4]
        assert answer["models"] == ["tiny", "large"]
        assert answer["certainty"] == pytest.approx([0.9, 0.1])
        assert answer["gear"] == "tiny@0.5 -> large"
        timings = answer["timings"]
        assert set(timings) == {
            "queue_ms",
            "service_ms",
            "total_ms",
            "transport_ms",
            "compute_ms",
            "api_ms",
        }
        assert timings["api_ms"] + timings["queue_ms"] + timings["service_ms"] == pytest.approx(
            timings["total_ms"]
        ), timings
        assert timings["transport_ms"] + timings["compute_ms"] == pytest.approx(
            timings["service_ms"]
        )
        assert min(timings.values()) >= 0.0, timings
        # Within the SLO or not is the machine's speed; the count below must agree with it.
        assert isinstance(answer["late"], bool), answer
        late = [answer["late"]]
        # Model-less: a latency bound alone picks the cheapest variant (the SLO's bound, so
        # that its answer's late, judged against the bound, agrees with the counts below).
        response = await client.post(
            "/v1/apps/demo/infer",
            json={"inputs": [row(4, 0.1)], "requirements": {"latency_ms": 60_000}},
            headers=world.auth(),
        )
        assert response.status_code == 200, response.text
        assert response.json()["gear"] == "tiny"
        late.append(response.json()["late"])
        response = await client.post(
            "/v1/apps/demo/infer",
            json={"inputs": [row(4, 0.1)], "requirements": {"min_accuracy": 0.99}},
            headers=world.auth(),
        )
        error = response.json()["error"]
        assert response.status_code == 422
        assert (error["code"], error["field"]) == ("requirements_unmet", "requirements")
        assert "closest offer" in error["message"]
        # The status route and /metrics see the app.
        response = await client.get("/v1/apps/demo/serving", headers=world.auth("viewer"))
        assert response.status_code == 200, response.text
        status = response.json()
        assert status["gear"] == "tiny@0.5 -> large"
        assert [s["model"] for s in status["stages"]] == ["tiny", "large"]
        assert all(w["healthy"] for w in status["workers"])
        assert set(status["stages"][0]["states"].values()) == {"active"}
        # tiny answered three samples (the model-less query's too), two under the spec's 0.5.
        reach = [(s["reach"], s["reach_samples"]) for s in status["stages"]]
        assert reach == [(None, 0), (pytest.approx(2 / 3), 3)]
        totals = status["totals"]
        assert (totals["answered"], totals["offered"]) == (2, 2)
        assert totals["within_slo"] == late.count(False)
        # The 422 (requirements unmet) is not offered: the share is of the two answered.
        assert totals["attainment_share"] == late.count(False) / 2
        mean = totals["mean_latency_ms"]
        assert set(mean) == {
            "api_ms",
            "overhead_ms",
            "queue_ms",
            "transport_ms",
            "compute_ms",
            "total_ms",
        }
        parts = ("api_ms", "queue_ms", "transport_ms", "compute_ms")
        assert sum(mean[p] for p in parts) == pytest.approx(mean["total_ms"])
        await world.serving.refresh()
        metrics = await client.get("/metrics", headers=world.auth("viewer"))
        # Parsed as Prometheus does: the exposition sorts each sample's labels by name.
        families = {f.name: f.samples for f in text_string_to_metric_families(metrics.text)}
        queries = families["heteroplane_serving_queries"]
        assert [s.value for s in queries if s.labels["outcome"] == "answered"] == [2.0]
        tiny = [s for s in families["heteroplane_model_state"] if s.labels["model"] == "tiny"]
        assert tiny and all(s.labels["app"] == "demo" and s.value == 1.0 for s in tiny)

    api_run(world, body)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"inputs": []}, "inputs"),
        ({"inputs": [[1.0] * 63]}, "inputs[0]"),
        ({"inputs": [[17.0] * 64]}, "inputs[0][0]"),
        ({"inputs": [[1.0] * 64] * 257}, "inputs"),
        ({"inputs": [[1.0] * 64], "sample_ids": [1, 2]}, None),
        ({"inputs": [[1.0] * 64], "requirements": {"min_accuracy": 1.5}}, None),
        ({"inputs": [[1.0] * 64], "model": "tiny"}, "model"),
    ],
)
def test_bad_input_is_a_422(world: ApiWorld, payload: dict[str, Any], field: str | None) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/apps/demo/infer", json=payload, headers=world.auth())
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_request"
        if field is not None:
            assert error["field"] == field

    api_run(world, body)


def test_tokens_scopes_unknown_apps_and_no_instances(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        payload = {"inputs": [row(1, 0.9)]}
        response = await client.post("/v1/apps/demo/infer", json=payload)
        assert response.status_code == 401
        response = await client.post(
            "/v1/apps/demo/infer", json=payload, headers=world.auth("viewer")
        )
        assert response.status_code == 403
        response = await client.post("/v1/apps/nope/infer", json=payload, headers=world.auth())
        assert response.status_code == 404
        response = await client.post("/v1/apps/demo/infer", json=payload, headers=world.auth())
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_serving_instance"

    api_run(world, body)


def test_overload_is_a_429_with_retry_after(tmp_path: Path) -> None:
    world = ApiWorld(tmp_path, fixed_ms=20.0)  # tiny takes 20 ms a batch, the SLO 300 ms

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([LARGE], delay_s=0.02)
        world.instances.set("demo", endpoints(workers))
        payload = {"inputs": [row(1, 0.9)]}
        responses = await asyncio.gather(
            *(
                client.post("/v1/apps/demo/infer", json=payload, headers=world.auth())
                for _ in range(60)
            )
        )
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 429}, statuses
        refused = [r for r in responses if r.status_code == 429]
        assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
        assert all(r.json()["error"]["code"] == "overloaded" for r in refused)

    try:
        api_run(world, body)
    finally:
        world.store.close()


def test_the_roll_up_records_the_serving_window(world: ApiWorld) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([LARGE])
        world.instances.set("demo", endpoints(workers))
        for _ in range(5):
            response = await client.post(
                "/v1/apps/demo/infer", json={"inputs": [row(1, 0.9)]}, headers=world.auth()
            )
            assert response.status_code == 200
        assert len(world.serving.observations.arrival_s("demo")) == 5
        roll_up(world.store, FakeClock(), window=world.serving.take_window)
        (sample,) = world.store.metric_series("demo")
        assert sample.latency_p99_ms is not None and sample.attainment_share == 1.0
        assert sample.arrival_rate_qps > 0 and sample.gear == "tiny@0.5 -> large"

    api_run(world, body)


def test_the_roll_up_records_the_gear_in_force_not_the_last_queries(world: ApiWorld) -> None:
    """A burst served by the fast gear, then no load: the switcher moves back to the accurate
    gear, and the window recorded the fast one (the gear at the last arrival) for as long as no
    query came: the dashboard said "tiny" while the events said the cascade was in force."""
    gear: list[ServingGear | None] = [ServingGear(Cascade(("tiny",), ()))]
    world.serving.gears = lambda app: gear[0]

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([LARGE])
        world.instances.set("demo", endpoints(workers))
        response = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [row(1, 0.1)]}, headers=world.auth()
        )
        assert response.status_code == 200 and response.json()["gear"] == "tiny"
        roll_up(world.store, FakeClock(), window=world.serving.take_window)
        gear[0] = ServingGear(Cascade(("tiny", "large"), (0.5,)))  # no query since
        roll_up(world.store, FakeClock(), window=world.serving.take_window)
        first, second = world.store.metric_series("demo")
        assert (first.gear, second.gear) == ("tiny", "tiny@0.5 -> large")

    api_run(world, body)


def test_the_dashboard_shows_each_workers_utilisation_and_model_states(tmp_path: Path) -> None:
    # An SLO no wait here reaches: forty queries at once on a busy machine can measure past 300 ms
    # (the fake workers share this process's loop), and admission control would then rightly
    # refuse some with 429; what this test checks is the dashboard's figures.
    world = ApiWorld(tmp_path, slo_ms=60_000.0)

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([SMALL, LARGE], delay_s=0.002)
        records = []
        for n, worker in enumerate(workers):
            record = world.store.record_instance(
                "demo",
                request_id=f"r-{n}",
                instance_type=worker.instance_type,
                price_usd_per_hr=0.1,
            )
            world.store.transition_instance(record.id, "pending", reason="t", provider_id=f"p{n}")
            world.store.transition_instance(record.id, "running", reason="t")
            records.append(record)
        world.instances.set(
            "demo",
            [
                WorkerEndpoint(r.id, w.instance_type, w.address)
                for r, w in zip(records, workers, strict=True)
            ],
        )
        viewer = world.auth("viewer")
        data = await client.get("/dashboard/data", headers=viewer)
        rows = {r["id"]: r for r in data.json()["snapshot"]["fleet"]["instances"]}
        assert all(r["utilisation_share"] is None and r["models"] is None for r in rows.values())
        answers = await asyncio.gather(
            *(
                client.post(
                    "/v1/apps/demo/infer", json={"inputs": [row(q % 10, 0.1)]}, headers=world.auth()
                )
                for q in range(40)
            )
        )
        assert all(a.status_code == 200 for a in answers)
        await world.serving.refresh()  # what the dashboard reads: the loop's last refresh
        data = await client.get("/dashboard/data", headers=viewer)
        assert data.status_code == 200, data.text
        rows = {r["id"]: r for r in data.json()["snapshot"]["fleet"]["instances"]}
        assert set(rows) == {r.id for r in records}
        status = (await client.get("/v1/apps/demo/serving", headers=viewer)).json()
        for record in records:
            measured = rows[record.id]
            assert 0.0 < measured["utilisation_share"] <= 1.0  # every worker served batches
            # Each model's INFaaS state on it, as the serving status reports it (the delay
            # makes tiny measure slower than its 1 ms profile: interfered).
            assert measured["models"] == {
                stage["model"]: stage["states"][record.id] for stage in status["stages"]
            }
            assert set(measured["models"].values()) <= {"active", "overloaded", "interfered"}
        assert all(0.0 < w["utilisation_share"] <= 1.0 for w in status["workers"])

    try:
        api_run(world, body)
    finally:
        world.store.close()


def test_refused_queries_are_misses_in_the_roll_up_metrics_status_and_dashboard(
    world: ApiWorld,
) -> None:
    """The app loses its only worker: every query gets 503 from then on. The roll-up's window,
    /metrics, the serving status and the dashboard count them as misses (the user's report:
    attainment 100.0% green while every request got 503 and no instance ran)."""
    clock = world.app.state.services.clock  # the API's: the dashboard reads samples up to now
    assert isinstance(clock, FakeClock)
    payload = {"inputs": [row(1, 0.9)]}

    async def post_all(client: httpx.AsyncClient, n: int) -> list[int]:
        answers = [
            await client.post("/v1/apps/demo/infer", json=payload, headers=world.auth())
            for _ in range(n)
        ]
        return [a.status_code for a in answers]

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([LARGE])
        world.instances.set("demo", endpoints(workers))
        assert await post_all(client, 4) == [200] * 4
        world.instances.set("demo", [])  # the worker is gone
        await world.serving.refresh()
        assert await post_all(client, 4) == [503] * 4
        clock.advance(10.0)
        roll_up(world.store, clock, window=world.serving.take_window)
        assert await post_all(client, 4) == [503] * 4
        clock.advance(10.0)
        roll_up(world.store, clock, window=world.serving.take_window)
        half, none = world.store.metric_series("demo")
        assert half.attainment_share == 0.5 and half.latency_p99_ms is not None
        assert none.attainment_share == 0.0 and none.latency_p99_ms is None

        viewer = world.auth("viewer")
        status = (await client.get("/v1/apps/demo/serving", headers=viewer)).json()["totals"]
        assert (status["answered"], status["refused"], status["offered"]) == (4, 8, 12)
        assert status["attainment_share"] == pytest.approx(1 / 3)
        metrics = await client.get("/metrics", headers=viewer)
        families = {f.name: f.samples for f in text_string_to_metric_families(metrics.text)}
        by_outcome = {s.labels["outcome"]: s.value for s in families["heteroplane_serving_queries"]}
        assert by_outcome == {
            "answered": 4.0,
            "refused": 8.0,
            "failed": 0.0,
            "timed_out": 0.0,
            "rejected": 0.0,
        }
        counts = {
            s.labels["outcome"]: s.value
            for s in families["heteroplane_serving_latency_seconds"]
            if s.name.endswith("_count")
        }
        assert counts == {"answered": 4.0, "refused": 8.0}
        stages = {s.labels["stage"] for s in families["heteroplane_serving_stage_seconds"]}
        assert stages == {"api", "queue", "transport", "compute"}

        data = await client.get("/dashboard/data", headers=viewer)
        latency = data.json()["snapshot"]["latency"]
        assert latency["attainment_share"] == 0.0  # the newest window: every query failed
        assert latency["p99_ms"] is None and latency["answered_none"] is True
        assert latency["slo_met"] is False and latency["has_data"] is True
        assert latency["window_attainment_share"] < 1.0
        # With the serving loop's counters, the snapshot says what the failures were.
        snap = snapshot.build_snapshot(
            world.store,
            world.store.get_app("demo"),
            clock.utcnow(),
            ledger=snapshot.SpendLedger(),
            serving=lambda app: world.serving.observations.totals().get(app.name),
        )
        outcomes = snap["latency"]["outcomes"]
        assert (outcomes["refused"], outcomes["errors"], outcomes["answered"]) == (8, 8, 4)
        assert outcomes["attainment_share"] == pytest.approx(1 / 3)

    api_run(world, body)


def test_a_query_refused_before_the_dispatcher_is_a_miss_too(world: ApiWorld) -> None:
    (world.data_dir / "profiles.csv").unlink()  # the spec no longer resolves

    async def body(client: httpx.AsyncClient) -> None:
        payload = {"inputs": [row(1, 0.9)]}
        response = await client.post("/v1/apps/demo/infer", json=payload, headers=world.auth())
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "serving_unavailable"
        totals = world.serving.observations.totals()["demo"]
        assert (totals.arrived, totals.refused, totals.attainment_share) == (1, 1, 0.0)

    api_run(world, body)


def test_latency_runs_from_the_apis_receipt_as_the_client_sees_it(world: ApiWorld) -> None:
    """Time the API spends before the answer (here a slow token check in a thread, as a busy
    service's is) counts: every query the client measured late because of it, the service counts
    late too (before, it timed from the loop and counted none of them late). Each query has its
    own token, so each is checked on its own (one check serves all the queries of a token)."""
    verify = world.store.verify_token
    calls = iter(range(1_000))
    stall_s = 1.0  # far over the app's 300 ms SLO, so that a loaded machine cannot blur it
    tokens = [world.store.create_token("infer", name=f"client-{i}") for i in range(8)]

    def slow_every_other(token: str, **kwargs: Any) -> Any:
        if next(calls) % 2:
            time.sleep(stall_s)
        return verify(token, **kwargs)

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([LARGE], delay_s=0.005)
        world.instances.set("demo", endpoints(workers))
        world.store.verify_token = slow_every_other  # type: ignore[method-assign]

        async def timed(token: str) -> tuple[float, dict[str, Any]]:
            start = time.perf_counter()
            answer = await client.post(
                "/v1/apps/demo/infer",
                json={"inputs": [row(1, 0.9)]},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert answer.status_code == 200, answer.text
            return (time.perf_counter() - start) * 1000.0, answer.json()

        measured = await asyncio.gather(*(timed(token) for token in tokens))
        # The service's figure is inside the client's, and both see the stall: the four stalled
        # queries are late on both sides, their time in the API counted as the API's part.
        assert all(a["timings"]["total_ms"] <= ms for ms, a in measured)
        stalled = [(ms, a) for ms, a in measured if ms >= 1000.0 * stall_s]
        assert len(stalled) == 4
        assert all(a["late"] and a["timings"]["api_ms"] >= 1000.0 * stall_s for _, a in stalled)
        # The service never counts late what the client saw in time.
        assert all(ms > 300.0 for ms, a in measured if a["late"])
        totals = world.serving.observations.totals()["demo"]
        client_late = sum(ms > 300.0 for ms, _ in measured)
        assert totals.answered == 8 and 4 <= totals.late <= client_late

    api_run(world, body)


def test_without_a_serving_loop_the_endpoint_is_503(tmp_path: Path) -> None:
    world = ApiWorld(tmp_path)
    app = create_app(world.settings, world.store, FakeClock())

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://h") as client:
            response = await client.post(
                "/v1/apps/demo/infer", json={"inputs": [row(1, 0.9)]}, headers=world.auth()
            )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "serving_unavailable"

    try:
        run(scenario())
    finally:
        world.store.close()


# --- where the workers are -------------------------------------------------------------------


class _CountingProvisioner(FakeProvisioner):
    def __init__(self) -> None:
        super().__init__(running_on_launch=True)
        self.lists = 0

    def list(self, tags: Mapping[str, str]) -> builtins.list[ProvisionedInstance]:
        self.lists += 1
        return super().list(tags)


def test_running_workers_come_from_the_store_with_the_providers_addresses(
    tmp_path: Path,
) -> None:
    store = Store.from_url(f"sqlite:///{tmp_path / 'db.sqlite'}", FakeClock(), upgrade=True)
    try:
        store.create_app({"name": "demo", "budget_usd_per_hr": 1.0}, who="test")
        provisioner = _CountingProvisioner()
        (launched,) = provisioner.launch(LaunchRequest("r-1", SMALL, 1, {APP_TAG: "demo"}))
        row = store.record_instance(
            "demo",
            request_id="r-1",
            instance_type=SMALL,
            price_usd_per_hr=0.05,
            provider_id=launched.provider_id,
            state="running",
        )
        source = ProvisionedInstances(store, provisioner, port=9000)
        (endpoint,) = source.running("demo")
        assert endpoint.instance_id == row.id and endpoint.instance_type == SMALL
        assert endpoint.address == f"{launched.address}:9000"  # a bare IP gets the agent's port
        assert source.running("demo") == [endpoint]
        assert provisioner.lists == 1  # the address is known: the provider is not asked again
        store.transition_instance(row.id, "draining", reason="test")
        assert source.running("demo") == []
    finally:
        store.close()


def test_a_query_a_cascade_forwards_is_refused_where_the_next_stage_cannot_serve_it_in_time() -> (
    None
):
    """Admission judges a cascade's query on entry; the part it forwards is judged again at the
    next model against what the SLO leaves it. The profiles say tiny 50 ms and large 200 ms a
    call, the worker answers in 150 ms: of two uncertain queries, both admitted on entry, the
    first forwarded finds the large model free and is answered; the second, behind it with at
    most 150 ms of its 300 ms SLO left, is refused (429) there, with a message that says so."""

    async def scenario() -> None:
        workers = await fleet([LARGE], delay_s=0.15)
        app = config(slo_ms=300.0, fixed_ms=50.0)
        dispatcher = await dispatcher_over(workers, app)
        futures = [dispatcher.submit([row(1, 0.1)]), dispatcher.submit([row(2, 0.1)])]
        results = await settle(futures)
        assert isinstance(results[0], InferResult) and results[0].models == ("large",), results
        assert isinstance(results[1], OverloadedError), results
        # Its message says where and why: not "a new query ... even at the cheapest gear".
        message = str(results[1])
        assert "forwarded to model 'large'" in message, message
        assert "after the query arrived, against its SLO of 300 ms" in message, message
        assert "new query" not in message and "cheapest gear" not in message, message
        assert workers[0].rows_by_model == {"tiny": 2, "large": 1}
        await dispatcher.close()

    run(scenario())


def test_rollouts_the_refresh_cannot_read_are_said_once_per_cause(
    world: ApiWorld, caplog: pytest.LogCaptureFixture
) -> None:
    """The database down: every serving process logged "cannot read the rollouts" every
    second of the outage (a PostgreSQL stopped for 10 s, ten lines a process)."""
    from controlplane.errors import DatabaseError

    down = [True]

    def routes() -> None:
        if down[0]:
            raise DatabaseError("database error on postgresql://db: connection refused")

    async def body(client: httpx.AsyncClient) -> None:
        world.serving.route_refresh = routes
        caplog.clear()
        for _ in range(3):
            await world.serving.refresh()
        down[0] = False
        await world.serving.refresh()
        await world.serving.refresh()
        said = [
            (r.levelname, r.getMessage()) for r in caplog.records if "rollouts" in r.getMessage()
        ]
        assert said == [
            (
                "WARNING",
                "serving refresh: cannot read the rollouts: database error on"
                " postgresql://db: connection refused",
            ),
            ("INFO", "serving refresh: reads the rollouts again"),
        ]

    with caplog.at_level("INFO", logger="controlplane.serving.loop"):
        api_run(world, body)


def test_a_refresh_the_spec_refuses_keeps_serving_and_says_so_once(
    world: ApiWorld, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An app's spec naming a type its models have no profiles on: the serving refresh logged a
    traceback every second (a tester's 201 of them in 3.5 minutes)."""
    from controlplane.serving import loop as serving_loop
    from controlplane.spec import UnprofiledModelError

    async def body(client: httpx.AsyncClient) -> None:
        workers = await fleet([SMALL, LARGE])
        world.instances.set("demo", endpoints(workers))
        answered = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [row(3, 0.9)]}, headers=world.auth()
        )
        assert answered.status_code == 200, answered.text

        def unprofiled(*_: object) -> None:
            raise UnprofiledModelError("demo", "large", ["tiny"])

        monkeypatch.setattr(serving_loop, "load_config", unprofiled)
        monkeypatch.setattr(serving_loop, "_version", lambda *_: -1)  # the spec changed
        caplog.clear()
        for _ in range(3):
            await world.serving.refresh()
        said = [r for r in caplog.records if "serving refresh" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING" and said[0].exc_info is None
        again = await client.post(
            "/v1/apps/demo/infer", json={"inputs": [row(4, 0.9)]}, headers=world.auth()
        )
        assert again.status_code == 200, again.text  # on the configuration it had

    api_run(world, body)


def test_the_pool_forgets_the_connections_of_workers_that_went(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool of kept-alive connections kept an entry, and its connections, for every worker
    address it ever called: with the local provisioner's port per worker it grew with every
    worker the fleet had (a soak of the demo: 31 workers an hour). Once per ``idle_s`` the
    connections idle past it go, and the addresses left with none."""
    import controlplane.serving.transport as transport_module

    now = [1000.0]
    monkeypatch.setattr(transport_module.time, "monotonic", lambda: now[0])

    async def scenario() -> None:
        gone, staying = FakeWorker(), FakeWorker()
        transport = HttpWorkerTransport(idle_s=20.0)
        try:
            for worker in (gone, staying):
                assert await transport.health(await worker.start(), 5.0)
            assert set(transport._idle) == {gone.address, staying.address}
            gone.kill()
            now[0] += 10.0  # within idle_s: nothing swept yet
            assert await transport.health(staying.address, 5.0)
            assert set(transport._idle) == {gone.address, staying.address}
            now[0] += 15.0  # the gone worker's connection idle 25 s: swept with its address
            assert await transport.health(staying.address, 5.0)
            assert set(transport._idle) == {staying.address}
        finally:
            await transport.close()
            staying.kill()

    asyncio.run(asyncio.wait_for(scenario(), 30.0))


def large_on_the_large_type_only(app: AppConfig) -> AppConfig:
    """``app`` with the large model profiled on the large type alone: only such a worker serves
    it (a model too big for the small type)."""
    from dataclasses import replace

    profiles = {**app.profiles, "large": {LARGE: app.profiles["large"][LARGE]}}
    return replace(app, profiles=profiles)


@pytest.mark.parametrize("admission", [True, False])
def test_a_part_forwarded_to_a_model_left_without_a_worker_fails_at_once(admission: bool) -> None:
    """The large model is profiled on the large type only; its one worker leaves the fleet while
    an uncertain query is at tiny. The part tiny forwards is answered with the 503 an arrival
    would get, at once: not refused as an overload ("its queues hold as many samples as they
    may; retry after 60 s", with admission) nor queued where nothing serves it until its
    give-up time (without)."""

    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE], delay_s=0.2)
        app = large_on_the_large_type_only(config(slo_ms=300.0))
        dispatcher = await dispatcher_over(workers, app, admission=admission, give_up_s=20.0)
        future = dispatcher.submit([row(1, 0.1)])
        await until(lambda: any(w.received for w in workers))  # at tiny
        dispatcher.set_workers(endpoints(workers)[:1])
        started = time.monotonic()
        (result,) = await settle([future])
        assert isinstance(result, NoServingInstanceError), result
        assert result.model == "large"
        assert time.monotonic() - started < 5.0
        no_capacity = 0.0  # a refusal at no capacity would count at any capacity
        refused = dispatcher.tracker.refusals(("demo", "large"), time.monotonic(), no_capacity)
        assert refused == 0  # no overload sign of a model that has no instance
        await dispatcher.close()

    run(scenario())


def test_a_model_less_query_gets_a_served_variant_over_one_whose_model_is_down() -> None:
    """The large model runs on the large type only, and its worker is down (still listed, out of
    matching). A query asking for 93% was refused 503 (no serving instance for 'large'): the
    cheapest variant meeting it, the cascade, reaches large, while medium alone (96%) meets it
    on a healthy worker. It gets medium now; an ask only large meets is still a 503 (try again
    once its worker is back), not a 422."""
    from dataclasses import replace

    from estimator.cascades import synthetic_validation

    records = synthetic_validation(
        np.random.default_rng(0),
        [0.9, 0.95, 0.97],
        names=["tiny", "medium", "large"],
        n_samples=400,
    )

    async def scenario() -> None:
        workers = await fleet([SMALL, LARGE])
        app = replace(
            config(models=("tiny", "medium", "large"), thresholds=(0.5, 0.5)), validation=records
        )
        app = large_on_the_large_type_only(app)
        dispatcher = await dispatcher_over(workers, app)
        offered = {option.name: option for option, _ in dispatcher.variant_options()}
        cascade = offered["tiny@0.5 -> medium@0.5 -> large"]
        assert cascade.cost_usd_per_query < offered["medium"].cost_usd_per_query
        assert offered["medium"].accuracy >= 0.93 and cascade.accuracy >= 0.93
        workers[1].kill()
        (large,) = [w for w in dispatcher.workers() if w.instance_type == LARGE]
        await settle([dispatcher.submit([row(1, 0.1)])])  # reaches large: its call fails
        await until(lambda: not large.healthy)
        result = await dispatcher.infer(
            [row(1, 0.9)], requirements=Requirements("demo", None, 0.93)
        )
        assert (result.gear, result.models) == ("medium", ("medium",))
        with pytest.raises(NoServingInstanceError, match="'large'"):
            await dispatcher.infer([row(1, 0.9)], requirements=Requirements("demo", None, 0.975))
        await dispatcher.close()

    run(scenario())
