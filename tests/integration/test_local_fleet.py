"""Local end to end: the service with the local provisioner launches a fleet of real worker
processes of two emulated types from an applied plan, each serves a real inference, a worker
killed with SIGKILL is replaced by the reconciler, and so is one that hangs (SIGSTOP: its process
lives, its port accepts, nothing answers), once it has left ``/health`` unanswered for
``worker_unresponsive_s``.

The family is trained once per session and the profiles measured by ``heteroplane profile
measure`` (a few samples: the numbers only price and rank, nothing here is timed). Reconcile ticks
are called directly in a loop with a deadline; the only sleeps are the polling interval.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.db.store import InstanceRecord
from controlplane.service.build import Service
from provisioners.base import APP_TAG
from provisioners.local import LocalProvisioner
from tests.integration.conftest import (
    local_data_dir,
    measure_profiles,
    reconcile_until,
    running_local_service,
)

pytest.importorskip("torch")

APP = "digits"
SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
FLEET = {SMALL: 2, LARGE: 1}
# Workers import torch and load the family: seconds each, more on a busy shared machine.
FLEET_DEADLINE_S = 300.0


@pytest.fixture(scope="session")
def profiles(trained_family: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Profiles of the tiny model on the two emulated types, from ``heteroplane profile
    measure``."""
    out = tmp_path_factory.mktemp("profiles") / "family.json"
    return measure_profiles(trained_family, out, "tiny", "1,2,4")


# Long enough that a worker slow to answer on a loaded machine is not taken for hung.
UNRESPONSIVE_S = 10.0


@pytest.fixture
def service(tmp_path: Path, trained_family: Path) -> Iterator[Service]:
    """The service on the local provisioner (as ``local_service`` in the integration conftest),
    a hung worker replaced after :data:`UNRESPONSIVE_S`."""
    data_dir = local_data_dir(tmp_path, trained_family)
    with running_local_service(data_dir, worker_unresponsive_s=UNRESPONSIVE_S) as built:
        yield built


def _running(rows: list[InstanceRecord]) -> list[InstanceRecord]:
    return [r for r in rows if r.state == "running"]


def _infer(address: str) -> dict[str, object]:
    pixels = [float(i % 17) for i in range(64)] * 2
    tensor = {"name": "input", "shape": [2, 64], "datatype": "FP32", "data": pixels}
    body = json.dumps({"inputs": [tensor]})
    request = urllib.request.Request(
        f"http://{address}/v2/models/tiny/infer",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        assert response.status == 200
        answer: dict[str, object] = json.loads(response.read())
        return answer


def test_the_local_fleet_serves_and_a_killed_worker_is_replaced(
    service: Service, profiles: Path
) -> None:
    store = service.store
    store.create_app(
        {
            "name": APP,
            "models": [{"name": "tiny", "profiles": str(profiles)}],
            "slo": {"latency_ms": 200},
            "budget_usd_per_hr": 1.0,
            "instance_types": [SMALL, LARGE],
        },
        who="test",
    )
    plan = store.create_plan(
        APP,
        {
            "feasible": True,
            "cost_usd_per_hr": 0.2,
            "stages": [{"name": "tiny", "fleet": FLEET, "batch_size": 1}],
        },
    )
    store.apply_plan(APP, plan.id)

    rows = reconcile_until(service, APP, lambda rows: len(_running(rows)) >= 3, "3 running workers")
    running = _running(rows)
    assert sorted(r.instance_type for r in running) == sorted([SMALL, SMALL, LARGE])
    listed = {i.provider_id: i for i in service.provisioner.list({APP_TAG: APP})}
    types_served = set()
    for row in running:
        assert row.provider_id is not None
        address = listed[row.provider_id].address
        assert address is not None
        answer = _infer(address)
        parameters = answer["parameters"]
        assert isinstance(parameters, dict) and parameters["instance_type"] == row.instance_type
        outputs = answer["outputs"]
        assert isinstance(outputs, list) and outputs[0]["shape"] == [2, 10]
        types_served.add(parameters["instance_type"])
    assert types_served == {SMALL, LARGE}

    provisioner = service.provisioner
    assert isinstance(provisioner, LocalProvisioner)
    victim = next(r for r in running if r.instance_type == SMALL)
    (record,) = [w for w in provisioner.records() if w.provider_id == victim.provider_id]
    os.kill(record.pid, signal.SIGKILL)

    def replaced(rows: list[InstanceRecord]) -> bool:
        states = {r.id: r.state for r in rows}
        smalls = [r for r in _running(rows) if r.instance_type == SMALL]
        return states[victim.id] == "failed" and len(smalls) == 2

    rows = reconcile_until(service, APP, replaced, "replacement of the killed worker")
    replacement = next(
        r
        for r in _running(rows)
        if r.instance_type == SMALL and r.id not in {x.id for x in running}
    )
    listed = {i.provider_id: i for i in service.provisioner.list({APP_TAG: APP})}
    assert replacement.provider_id in listed
    address = listed[replacement.provider_id].address
    assert address is not None
    parameters = _infer(address)["parameters"]
    assert isinstance(parameters, dict) and parameters["instance_type"] == SMALL
    # Four launches so far: the fleet and one replacement, nothing twice.
    assert len([r for r in rows if not r.request_id.startswith("orphan:")]) == 4

    # A hung worker: alive to the provider, its port open, nothing answering.
    hung = next(r for r in _running(rows) if r.instance_type == LARGE)
    (record,) = [w for w in provisioner.records() if w.provider_id == hung.provider_id]
    os.kill(record.pid, signal.SIGSTOP)
    try:

        def hung_replaced(rows: list[InstanceRecord]) -> bool:
            states = {r.id: r.state for r in rows}
            larges = [r for r in _running(rows) if r.instance_type == LARGE]
            return states[hung.id] in ("terminating", "terminated") and len(larges) == 1

        rows = reconcile_until(service, APP, hung_replaced, "replacement of the hung worker")
    finally:
        os.kill(record.pid, signal.SIGCONT)  # so that a SIGTERM ends it at once if still there
    (ended,) = [
        d
        for d in store.list_decisions(APP, kinds=["terminate"])
        if hung.id in d.numbers["instance_ids"]
    ]
    assert ended.numbers["cause"] == "unresponsive"
    assert "has not answered /health" in ended.reason
    large = next(r for r in _running(rows) if r.instance_type == LARGE)
    listed = {i.provider_id: i for i in service.provisioner.list({APP_TAG: APP})}
    address = listed[large.provider_id or ""].address
    assert address is not None
    parameters = _infer(address)["parameters"]
    assert isinstance(parameters, dict) and parameters["instance_type"] == LARGE
    # The SIGKILLed one failed and the hung one was terminated; nothing else was replaced.
    assert len([r for r in rows if not r.request_id.startswith("orphan:")]) == 5
