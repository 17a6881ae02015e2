"""``heteroplane demo --down`` on real local workers: a demo app's fleet of worker processes is
launched by one service, which then stops (as the demo does on Ctrl-C: its workers run on, in
sessions of their own); ``demo --down`` on the same data directory drains the app, stops every
worker process and deletes the app.

Reconcile ticks are called directly with a deadline; the only sleeps are the polling interval.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from controlplane.cli import main
from controlplane.service.build import build_service
from controlplane.service.demo import DEMO_APP
from controlplane.settings import Settings
from provisioners.local import LocalProvisioner
from tests.integration.conftest import launch_fleet, local_data_dir, process_alive

pytest.importorskip("torch")

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"


def test_demo_down_stops_the_workers_a_stopped_demo_left_running(
    tmp_path: Path,
    trained_family: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data_dir = local_data_dir(tmp_path, trained_family)
    service = build_service(Settings(data_dir=data_dir, provisioner="local"))
    pids: list[int] = []
    try:
        assert isinstance(service.provisioner, LocalProvisioner)
        store = service.store
        store.create_app(
            {
                "name": DEMO_APP,
                # Never resolved here: the reconciler prices the app from the default catalog.
                "models": [{"name": "tiny", "profiles": "profiles.json"}],
                "slo": {"latency_ms": 200},
                "budget_usd_per_hr": 1.0,
                "instance_types": [SMALL, LARGE],
            },
            who="test",
        )
        plan = store.create_plan(
            DEMO_APP,
            {
                "feasible": True,
                "cost_usd_per_hr": 0.15,
                "stages": [{"name": "tiny", "fleet": {SMALL: 1, LARGE: 1}, "batch_size": 1}],
            },
        )
        store.apply_plan(DEMO_APP, plan.id)
        launch_fleet(service, DEMO_APP, 2)
        pids = [record.pid for record in service.provisioner.records()]
        assert len(pids) == 2
    finally:
        service.close()  # the demo stopped: its workers run on
    try:
        assert all(process_alive(pid) for pid in pids)
        monkeypatch.delenv("HETEROPLANE_CONFIG", raising=False)
        monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(data_dir))
        monkeypatch.setenv("HETEROPLANE_PROVISIONER", "local")
        assert main(["demo", "--down"]) == 0
        err = capsys.readouterr().err
        assert f"app {DEMO_APP}: draining 2 instance(s)" in err
        assert f"app {DEMO_APP!r} is down, its workers stopped" in err
        assert not any(process_alive(pid) for pid in pids)
        after = build_service(Settings(data_dir=data_dir, provisioner="local"))
        try:
            assert after.store.list_apps() == []
            assert isinstance(after.provisioner, LocalProvisioner)
            assert after.provisioner.records() == []
        finally:
            after.close()
    finally:
        for pid in pids:  # whatever happened, no worker outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
