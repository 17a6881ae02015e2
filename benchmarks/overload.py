"""Overload without collapse: the answered rate past saturation, with and without dropping the
queries whose clients have gone.

    .venv/bin/python benchmarks/overload.py [--json] [--service-ms 5] [--load 2.0]
        [--duration-s 10] [--client-timeout-s 1]

What runs: :class:`controlplane.serving.dispatcher.AppDispatcher` with its real HTTP transport
to one in-process fake worker (:class:`tests.fake_worker.FakeWorker`) that answers
each batch after ``--service-ms`` (batch cap 1, FCFS: a capacity of 1000 / service-ms queries a
second), admission control off (the worst case: every query is queued). Open-loop Poisson
arrivals at ``--load`` x capacity for ``--duration-s``; each client gives up after
``--client-timeout-s``, as ``heteroplane loadgen --timeout-s`` does, which the API turns into a
cancelled call (:class:`controlplane.api.disconnect.CancelOnDisconnect`: here the future is
cancelled directly). Two runs on fresh dispatchers: ``drop`` (issue 30's behaviour: each client
gives its deadline, as ``/v2``'s ``parameters.timeout`` does, so a query whose batch would end
past it is not sent, and a client's give-up cancels its query, which leaves the queue) and
``keep`` (no deadline, and the answers are awaited to the end, as the service did before: a
query whose client is gone is still served).

Printed per run: ``good_qps`` (answered within the client's timeout, per second of the run:
what clients got), ``worker_calls`` (batches the worker answered), ``gave_up`` (clients that
timed out) and ``idle_after_s`` (from the last arrival until every client is done and, in
``keep``, every query served: how long the service stays busy with work nobody waits for).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from controlplane.errors import ServingError
from controlplane.policies.plan import StagePlan
from controlplane.serving.config import AppConfig, DispatcherSettings
from controlplane.serving.dispatcher import AppDispatcher
from controlplane.serving.observations import Observations
from controlplane.serving.transport import HttpWorkerTransport
from controlplane.serving.workers import WorkerEndpoint
from estimator.cascades import Cascade
from estimator.fleet import Fleet
from estimator.profiles import LatencyProfile
from estimator.traces import poisson_arrivals
from tests.fake_worker import FakeWorker

TYPE = "emu.cpu.large"
BATCHES = (1, 2, 4, 8)


def _config(service_ms: float) -> AppConfig:
    sizes = np.array(BATCHES)
    profile = LatencyProfile("m", TYPE, sizes, tuple(np.full(3, service_ms * b) for b in BATCHES))
    return AppConfig(
        name="overload",
        slo_ms=10.0 * service_ms,
        models=("m",),
        cascade=Cascade(("m",), ()),
        profiles={"m": {TYPE: profile}},
        prices_usd_per_hr={TYPE: 0.1},
        stage_plans={"m": StagePlan("m", Fleet.of({}), 1, policy="fcfs")},
    )


async def one_run(
    drop: bool, service_ms: float, load: float, duration_s: float, timeout_s: float
) -> dict[str, Any]:
    worker = FakeWorker(TYPE, delay_s=service_ms / 1000.0)
    await worker.start()
    dispatcher = AppDispatcher(
        _config(service_ms),
        HttpWorkerTransport(),
        Observations(),
        settings=DispatcherSettings(admission=False, give_up_s=3600.0),
    )
    dispatcher.set_workers([WorkerEndpoint("i-0", TYPE, worker.address)])
    capacity_qps = 1000.0 / service_ms
    arrivals = poisson_arrivals(load * capacity_qps, duration_s, np.random.default_rng(0))
    loop = asyncio.get_running_loop()
    start = loop.time()
    good = refused = 0
    gone_at: dict[int, float] = {}
    pending: list[asyncio.Task[None]] = []

    async def client(index: int) -> None:
        nonlocal good, refused
        deadline_s = loop.time() + timeout_s if drop else None  # the client says, in drop
        future = dispatcher.submit([[float(index % 10), 14.0] + [0.0] * 62], deadline_s=deadline_s)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
            good += 1
        except ServingError:  # answered 504 at once: its deadline could not be met
            refused += 1
        except TimeoutError:
            gone_at[index] = loop.time()
            if drop:
                future.cancel()
            else:
                await asyncio.gather(future, return_exceptions=True)

    for index, at in enumerate(arrivals.tolist()):
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append(loop.create_task(client(index)))
    last_arrival = loop.time()
    await asyncio.gather(*pending)
    idle_after_s = loop.time() - last_arrival
    await dispatcher.close()
    await worker.stop()
    return {
        "mode": "drop" if drop else "keep",
        "offered_qps": round(len(arrivals) / duration_s, 1),
        "capacity_qps": round(capacity_qps, 1),
        "good_qps": round(good / duration_s, 1),
        "worker_calls": worker.requests,
        "gave_up": len(gone_at),
        "answered_504": refused,
        "idle_after_s": round(idle_after_s, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service-ms", type=float, default=5.0)
    parser.add_argument("--load", type=float, default=2.0, help="offered rate / capacity")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--client-timeout-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    for drop in (True, False):
        started = time.monotonic()
        run = asyncio.run(
            one_run(drop, args.service_ms, args.load, args.duration_s, args.client_timeout_s)
        )
        run["wall_s"] = round(time.monotonic() - started, 1)
        runs.append(run)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    for run in runs:
        print(
            f"{run['mode']}: offered {run['offered_qps']:g} q/s against {run['capacity_qps']:g},"
            f" answered in time {run['good_qps']:g} q/s, worker calls {run['worker_calls']},"
            f" 504 at once {run['answered_504']}, clients gone {run['gave_up']},"
            f" busy {run['idle_after_s']:g} s after the last"
            " arrival"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
