"""The serving path end to end: the demo cascade app behind the service, ``heteroplane
loadgen`` replaying a 40-second trace, and a worker killed with SIGKILL in the middle.

The app is the one ``heteroplane demo`` serves, made by the same functions
(:mod:`controlplane.service.demo`): the family's profiles measured into the data directory through
real workers (a few samples: they only price and rank), the cheapest cascade as accurate as the
best model, the demo spec (its SLO and budget, the two emulated types, whose workers pad each
batch to tens of ms) and the plan previewed for the demo's rate and applied; the reconciler
launches its workers (at least one per stage). The real service (``build_service`` on the local
provisioner: reconciler, scheduler, serving loop, live tuner) runs behind uvicorn on a free
loopback port, and the real command line, ``python -m controlplane loadgen --json``, replays a
Poisson trace written by ``heteroplane trace generate`` (40 s at the rate the plan was made
for, which the planned fleet serves and the tuner keeps it for: the test is about correctness,
not capacity).

When the service has seen half of the trace's queries arrive, the worker of the stage with the
most workers among the gear in force (its first stage when each has one: every query visits it;
the demo's plan carries its cascade's gear plan, served by the live gear switcher) is killed
with SIGKILL. Then:

- every query sent got an answer or an explicit error (``answered + errors == sent``, ``sent``
  is the trace's length, and the service saw each of them arrive and finished each);
- the errors but the service's refusals (429, its admission control: a machine too busy to serve
  a query within the SLO refuses it, and the client sees each refusal) are no more than the
  queries in flight on the killed worker when the loop marked it unhealthy (the
  ``worker_unhealthy`` decision's numbers, recorded by the serving loop);
- the reconciler replaced the killed worker with a new running instance;
- the service's count of late queries is the number of answers that carried its late flag, and
  the client missed (late or failed) at least every query the service did, within 1% of all
  queries: the service times each query from the API's receipt, the client from its scheduled
  send, so on a busy machine the path outside the service (the generator falling behind, the
  connection, the server's HTTP) makes the client miss more, never fewer.

Nothing sleeps but the polling of deadlines; nothing is timed. It runs about 80 s (the
trace's one and the fleet's start), hence ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.cli import main
from controlplane.db.store import InstanceRecord
from controlplane.service.build import Service
from controlplane.service.demo import (
    DEMO_APP,
    DEMO_RATE_QPS,
    DemoFamily,
    DemoState,
    prepare_demo,
    prepare_family,
)
from controlplane.serving.observations import AppTotals
from estimator.traces import read_trace_csv
from provisioners.local import LocalProvisioner
from tests.integration.conftest import (
    ApiServer,
    launch_fleet,
    local_data_dir,
    running_local_service,
)

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
# The plan's own rate: below it the tuner would drain the fleet the victim is chosen from.
TRACE_RATE_QPS = DEMO_RATE_QPS
TRACE_DURATION_S = 40.0
TRACE_SEED = 8
PROFILE_SAMPLES = 3
SERVED_DEADLINE_S = 120.0
# loadgen starts (imports, reads the app), replays the trace, waits for the last answers.
RUN_DEADLINE_S = TRACE_DURATION_S + 180.0
REPLACED_DEADLINE_S = 120.0
POLL_S = 0.25


def _progress(line: str) -> None:
    print(line, file=sys.stderr)


@pytest.fixture
def demo(tmp_path: Path, trained_family: Path) -> Iterator[tuple[Service, DemoState]]:
    """The service on the local provisioner with the demo app registered and planned, as
    ``heteroplane demo`` prepares it: the family's profiles first (the local workers pad to them,
    so they must be there when the service is built), then the app, its token and its plan."""
    data_dir = local_data_dir(tmp_path, trained_family)
    family: DemoFamily = prepare_family(data_dir, PROFILE_SAMPLES, _progress)
    with running_local_service(data_dir) as service:
        state = prepare_demo(service, DEMO_RATE_QPS, _progress, family=family)
        assert state.plan is not None, "the demo's plan is infeasible: nothing to serve"
        yield service, state


def _running(service: Service) -> list[InstanceRecord]:
    return service.store.list_instances(DEMO_APP, states=["running"])


def _planned_workers(state: DemoState) -> int:
    assert state.plan is not None
    stages = state.plan.document["stages"]
    return sum(int(n) for stage in stages for n in stage["fleet"].values())


def _write_trace(path: Path) -> int:
    """A Poisson trace of TRACE_DURATION_S at TRACE_RATE_QPS by ``heteroplane trace generate``;
    its number of queries."""
    status = main(
        [
            "trace",
            "generate",
            "--kind",
            "poisson",
            "--rate",
            f"{TRACE_RATE_QPS:g}",
            "--duration",
            f"{TRACE_DURATION_S:g}",
            "--seed",
            str(TRACE_SEED),
            "--out",
            str(path),
            "--json",
        ]
    )
    assert status == 0
    return len(read_trace_csv(path))


def _totals(service: Service) -> AppTotals:
    assert service.serving is not None
    return service.serving.observations.totals().get(DEMO_APP, AppTotals())


def _wait_served(api: httpx.Client) -> None:
    """Send one validation digit until the demo's workers answer it."""
    from provisioners.worker.family import load_split

    digit = load_split().validation_inputs[0].astype(int).tolist()
    deadline = time.monotonic() + SERVED_DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        answer = api.post(f"/v1/apps/{DEMO_APP}/infer", json={"inputs": [digit]})
        if answer.status_code == 200:
            return
        last = answer.text
        time.sleep(POLL_S)
    pytest.fail(f"the demo's workers did not answer within {SERVED_DEADLINE_S:g} s: {last}")


def _wait_gear(service: Service) -> None:
    deadline = time.monotonic() + SERVED_DEADLINE_S
    while not service.store.list_decisions(DEMO_APP, kinds=["gear_switch"]):
        if time.monotonic() > deadline:
            pytest.fail(f"no gear_switch decision within {SERVED_DEADLINE_S:g} s")
        time.sleep(POLL_S)


def _gear_models(label: str) -> tuple[str, ...]:
    """The models of a cascade's label (``medium@0.6 -> large``)."""
    return tuple(part.split("@")[0].strip() for part in label.split("->"))


def _choose_victim(api: httpx.Client) -> str:
    """The instance id of a worker of the stage with the most workers among the models of the
    gear in force (its first model among equals: every query visits it), as the serving loop
    places them."""
    status = api.get(f"/v1/apps/{DEMO_APP}/serving").json()
    stages = {stage["model"]: sorted(stage["states"]) for stage in status["stages"]}
    model = max(_gear_models(status["gear"]), key=lambda m: len(stages.get(m, [])))
    assert stages[model], f"no worker serves {model}: {status}"
    return stages[model][0]


def _pid(service: Service, instance: InstanceRecord) -> int:
    provisioner = service.provisioner
    assert isinstance(provisioner, LocalProvisioner)
    (record,) = [w for w in provisioner.records() if w.provider_id == instance.provider_id]
    return record.pid


class _Loadgen:
    """``python -m controlplane loadgen ... --json`` in a subprocess, its stderr in a log."""

    def __init__(self, url: str, token: str, trace: Path, log: Path) -> None:
        self.log_path = log
        self._log = log.open("wb")
        command = [sys.executable, "-m", "controlplane", "loadgen", "--url", url]
        command += ["--app", DEMO_APP, "--trace", str(trace), "--token", token, "--json"]
        command += ["--progress-s", "10"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROPLANE_")}
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log
        )

    def fail(self, why: str) -> None:
        self.stop()
        pytest.fail(f"{why}:\n{self.log_path.read_text()}")

    def result(self, timeout_s: float) -> dict[str, Any]:
        try:
            out, _ = self.process.communicate(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            self.fail(f"loadgen did not finish within {RUN_DEADLINE_S:g} s")
        self._log.close()
        log = self.log_path.read_text()
        assert self.process.returncode == 0, f"loadgen exited {self.process.returncode}:\n{log}"
        summary: dict[str, Any] = json.loads(out)
        return summary

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


@pytest.mark.slow
def test_loadgen_replays_a_trace_on_the_demo_and_a_killed_worker_loses_nothing(
    demo: tuple[Service, DemoState], tmp_path: Path
) -> None:
    service, state = demo
    fleet = launch_fleet(service, DEMO_APP, _planned_workers(state))
    assert len(fleet) > 1, "a fleet of one worker cannot survive its loss"
    by_id = {instance.id: instance for instance in fleet}
    token = state.token.path.read_text(encoding="utf-8").strip()
    trace = tmp_path / "trace.csv"
    queries = _write_trace(trace)
    assert queries > 400  # about DEMO_RATE_QPS for 40 s

    with ApiServer(service) as url:
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30.0, trust_env=False) as api:
            _wait_served(api)
            # The gear switcher puts the plan's gear in force at its first tick after traffic.
            _wait_gear(service)
            _wait_served(api)  # a query under the gear: the loop's status names it
            victim = by_id[_choose_victim(api)]
            before = _totals(service)
            loadgen = _Loadgen(url, token, trace, tmp_path / "loadgen.log")
            try:
                deadline = time.monotonic() + RUN_DEADLINE_S
                while _totals(service).arrived - before.arrived < queries // 2:
                    if loadgen.process.poll() is not None:
                        loadgen.fail("loadgen exited before half of the trace was sent")
                    if time.monotonic() > deadline:
                        loadgen.fail("half of the trace did not arrive in time")
                    time.sleep(POLL_S)
                os.kill(_pid(service, victim), signal.SIGKILL)
                killed_at = _totals(service).arrived - before.arrived
                summary = loadgen.result(deadline - time.monotonic())
            finally:
                loadgen.stop()
            after = _totals(service)
            status = api.get(f"/v1/apps/{DEMO_APP}/serving").json()

            # The reconciler replaces the killed worker: a new running instance of its type.
            replaced_deadline = time.monotonic() + REPLACED_DEADLINE_S
            while True:
                running = {i.id: i for i in _running(service)}
                new = [i for i in running.values() if i.id not in by_id]
                if victim.id not in running and any(
                    i.instance_type == victim.instance_type for i in new
                ):
                    break
                if time.monotonic() > replaced_deadline:
                    pytest.fail(f"the killed worker {victim.id} was not replaced: {running}")
                time.sleep(POLL_S)

    losses = [
        d.numbers
        for d in service.store.list_decisions(DEMO_APP, kinds=["worker_unhealthy"])
        if d.numbers.get("instance_id") == victim.id
    ]
    in_flight = sum(int(loss["in_flight_queries"]) for loss in losses)
    figures = {
        "queries": queries,
        "killed_after_arrivals": killed_at,
        "victim": victim.id,
        "in_flight_on_victim": in_flight,
        "losses": losses,
        "loadgen": summary,
        "service": {
            "arrived": after.arrived - before.arrived,
            "answered": after.answered - before.answered,
            "failed": after.failed - before.failed,
            "refused": after.refused - before.refused,
            "timed_out": after.timed_out - before.timed_out,
            "late": after.late - before.late,
        },
    }
    print(json.dumps(figures, indent=1), file=sys.stderr)

    # Every query sent got an answer or an explicit error; none was lost on the way.
    assert summary["sent"] == queries, figures
    assert summary["answered"] + summary["errors"] == summary["sent"], figures
    assert sum(summary["errors_by_kind"].values()) == summary["errors"], figures
    # The service saw each arrive and finished each: answered, failed or refused, none open.
    service_side = figures["service"]
    assert service_side["arrived"] == queries, figures
    finished = ("answered", "failed", "refused", "timed_out")
    assert sum(service_side[kind] for kind in finished) == queries, figures
    assert service_side["answered"] == summary["answered"], figures
    assert status["in_flight_requests"] == 0, status
    # The service's count of late queries is the late flags its answers carried, and the client
    # missed every query the service did: its latency holds the service's own time and the path
    # outside it (this client, the connection, the server's HTTP), which on a busy machine
    # pushes more past the SLO (the generator's own send lag counts too), so only the service's
    # side is held to an exact count.
    assert summary["late_by_service"] == service_side["late"], figures
    service_missed = queries - (service_side["answered"] - service_side["late"])
    client_missed = summary["sent"] - round(summary["attainment"] * summary["sent"])
    assert client_missed >= service_missed - 0.01 * queries, figures
    # The queries the service refused (429: its admission control, on a machine too busy to serve
    # them within the SLO) are the refusals the client saw; no more other errors than the queries
    # in flight on the killed worker when it was taken out.
    refused = summary["errors_by_kind"].get("http_429", 0)
    assert refused == service_side["refused"], figures
    assert summary["errors"] - refused <= in_flight, figures
    for loss in losses:
        assert loss["redispatched_queries"] + loss["failed_queries"] == loss["in_flight_queries"]
    assert summary["answered"] >= queries - in_flight - refused, figures
    # The demo's plan carries its cascade's gear plan, and the service served by it: the gear
    # switcher's start is recorded, and the gear in force is one of the plan's.
    assert state.plan is not None
    gear_plan = state.plan.document["gear_plan"]
    switches = service.store.list_decisions(DEMO_APP, kinds=["gear_switch"])
    assert switches, "the gear switcher never put a gear in force"
    assert status["gear"] in {gear["cascade"] for gear in gear_plan["gears"]}, status
