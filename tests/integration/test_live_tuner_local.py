"""The live tuner on live traffic: a step in the load makes the service launch local
workers within the budget, and a drop makes it remove them, with every decision and its reason
recorded.

The real service (``build_service`` on the local provisioner, its data directory in
``tmp_path``) runs behind a real uvicorn server on 127.0.0.1. Its one app serves ``large`` on
``emu.cpu.large`` in 100 ms a query: the data directory's profile file says so, and the workers
pad every batch to it (``controlplane.provisioning.LOCAL_PROFILE_FILE``,
``provisioners.worker.emulation``), so one worker serves about 10 queries/s. The budget affords
:data:`MAX_WORKERS` workers at the catalog's price and not one more; the plan, made by the API's
planner for the low rate, is one worker.

``controlplane.clients.loadgen`` (open loop) sends Poisson traffic in three phases, each ended by
what the service does rather than by a clock: :data:`LOW_QPS` until the first worker has answered
some queries, :data:`HIGH_QPS` (more than one worker carries) until a ``scale_up`` decision is
recorded and more worker processes run, then :data:`LOW_QPS` again until a ``scale_down`` is
recorded and the removed workers' processes are gone. The tuner's windows are shortened through
the settings (an 8 s longest window, a 3 s scale-down delay; InferLine's are 60 s and 15 s) so
that the whole step takes about half a minute (plus the session's family training);
``benchmarks/live_tuner_step.py`` runs the same step with the defaults and times it.

Every instance event (the history ``GET /v1/apps/{app}/events`` returns) is replayed at the end:
the requested + pending + running fleet never cost more than the budget, and no decision says
otherwise. Nothing sleeps but the polling of deadlines; nothing is timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from controlplane.provisioning import LOCAL_PROFILE_FILE
from controlplane.service.build import Service
from estimator.catalog import default_catalog
from estimator.profiles import LatencyProfile, write_profiles_json
from provisioners.local import LocalProvisioner
from tests.integration.background_load import BackgroundLoad
from tests.integration.conftest import (
    ApiServer,
    local_data_dir,
    process_alive,
    running_local_service,
)

pytest.importorskip("torch")

APP = "steps"
MODEL = "large"
INSTANCE_TYPE = "emu.cpu.large"
SERVICE_MS = 100.0
SLO_MS = 1000.0
LOW_QPS = 3.0
HIGH_QPS = 15.0
MAX_WORKERS = 2
# The budget: MAX_WORKERS workers and half of another, so MAX_WORKERS + 1 does not fit.
PRICE_USD_PER_HR = default_catalog().price_usd_per_hr(INSTANCE_TYPE)
BUDGET_USD_PER_HR = (MAX_WORKERS + 0.5) * PRICE_USD_PER_HR
# The tuner's timing for the test (the defaults are 60 s and 15 s).
MAX_WINDOW_S = 8.0
SCALE_DOWN_DELAY_S = 3.0
# Queries the first worker answers at the low rate before the step.
WARM_ANSWERS = 15
# Workers import torch and load the family: seconds each, more on a busy shared machine.
WORKER_DEADLINE_S = 300.0
PHASE_DEADLINE_S = 300.0
POLL_S = 0.25
KEPT = ("requested", "pending", "running")


@pytest.fixture
def service(tmp_path: Path, trained_family: Path) -> Iterator[Service]:
    """The service on the local provisioner with the emulated 100 ms profile in its data
    directory (read by the workers and by the app's spec) and the tuner's timing shortened."""
    data_dir = local_data_dir(tmp_path, trained_family)
    # Every batch of one takes SERVICE_MS (a deterministic service time); the reference type
    # too, so that nothing falls back to measured latencies.
    cell = (np.full(8, SERVICE_MS),)
    profile = data_dir / LOCAL_PROFILE_FILE
    profile.parent.mkdir(parents=True)
    write_profiles_json(
        [LatencyProfile(MODEL, t, np.array([1]), cell) for t in ("local.cpu", INSTANCE_TYPE)],
        profile,
        source="tests/integration/test_live_tuner_local.py (emulated)",
    )
    with running_local_service(
        data_dir,
        reconcile_s=1.0,
        tuner_max_window_s=MAX_WINDOW_S,
        tuner_scale_down_delay_s=SCALE_DOWN_DELAY_S,
    ) as built:
        yield built


class _Watch:
    """Reads the service's state through its API and the local provisioner; every read also
    checks the budget of the fleet the reconciler keeps."""

    def __init__(self, service: Service, api: httpx.Client) -> None:
        self.service = service
        self.api = api
        provisioner = service.provisioner
        assert isinstance(provisioner, LocalProvisioner)
        self.provisioner = provisioner
        self.pids: dict[str, int] = {}  # provider id -> worker pid, as seen while it ran
        self.most_kept = 0

    def instances(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.api.get("/v1/instances", params={"app": APP}).json()
        kept = [r for r in rows if r["state"] in KEPT]
        cost = sum(float(r["price_usd_per_hr"]) for r in kept)
        assert cost <= BUDGET_USD_PER_HR + 1e-9, f"the kept fleet costs {cost} > budget: {kept}"
        self.most_kept = max(self.most_kept, len(kept))
        for record in self.provisioner.records():
            if record.pid is not None:  # None: a launch cut short, never started
                self.pids.setdefault(record.provider_id, record.pid)
        return rows

    def running(self) -> list[dict[str, Any]]:
        return [r for r in self.instances() if r["state"] == "running"]

    def live_processes(self) -> list[int]:
        """Worker processes of the app's running instances that are alive."""
        ids = {r["provider_id"] for r in self.running()}
        return [
            pid
            for provider_id, pid in self.pids.items()
            if provider_id in ids and process_alive(pid)
        ]

    def decisions(self, kind: str, after_id: int = 0) -> list[dict[str, Any]]:
        rows = self.api.get(f"/v1/apps/{APP}/decisions", params={"kind": kind}).json()
        return [d for d in rows if int(d["id"]) > after_id]

    def last_decision_id(self) -> int:
        rows = self.api.get(f"/v1/apps/{APP}/decisions").json()
        return max((int(d["id"]) for d in rows), default=0)

    def until(self, what: str, check: Any, deadline_s: float = PHASE_DEADLINE_S) -> Any:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(POLL_S)
        logs = self.service.settings.data_dir / "workers" / "logs"
        tails = {p.name: p.read_text()[-600:] for p in sorted(logs.glob("*.log"))}
        decisions = [
            (d["kind"], d["reason"]) for d in self.api.get(f"/v1/apps/{APP}/decisions").json()
        ]
        pytest.fail(f"{what}: not within {deadline_s:g} s; decisions {decisions}; logs {tails}")


def _deploy(api: httpx.Client, profile: Path) -> dict[str, Any]:
    """Register the app, plan it for the low rate through the API and apply the plan."""
    spec = {
        "name": APP,
        "models": [{"name": MODEL, "profiles": str(profile)}],
        "slo": {"latency_ms": SLO_MS, "percentile": 99},
        "budget_usd_per_hr": BUDGET_USD_PER_HR,
        "instance_types": [INSTANCE_TYPE],
    }
    api.post("/v1/apps", json=spec).raise_for_status()
    preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": LOW_QPS})
    preview.raise_for_status()
    plan: dict[str, Any] = preview.json()
    api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()
    return plan


def _most_kept_cost(events: list[dict[str, Any]], prices: dict[str, float]) -> float:
    """The highest cost of the requested + pending + running fleet over the instance history
    (each event moves one instance; the history is in order)."""
    state: dict[str, str] = {}
    most = 0.0
    for event in sorted(events, key=lambda e: int(e["id"])):
        state[event["instance_id"]] = event["to_state"]
        cost = sum(prices[i] for i, s in state.items() if s in KEPT)
        most = max(most, cost)
    return most


@pytest.mark.slow
def test_a_step_in_the_load_scales_the_fleet_up_within_the_budget_and_back_down(
    service: Service,
) -> None:
    admin = service.store.create_token("admin", name="operator")
    headers = {"Authorization": f"Bearer {admin}"}
    with (
        ApiServer(service) as url,
        httpx.Client(base_url=url, headers=headers, timeout=60.0, trust_env=False) as api,
    ):
        plan = _deploy(api, service.settings.data_dir / LOCAL_PROFILE_FILE)
        assert [s["fleet"] for s in plan["stages"]] == [{INSTANCE_TYPE: 1}]
        watch = _Watch(service, api)
        load = BackgroundLoad(url, APP, admin, PHASE_DEADLINE_S + WORKER_DEADLINE_S)
        try:
            watch.until("the planned worker running", watch.running, WORKER_DEADLINE_S)

            # Low: one worker carries it.
            load.phase(LOW_QPS, seed=1)

            def warm() -> bool:
                status = api.get(f"/v1/apps/{APP}/serving").json()
                return int(status["totals"]["answered"]) >= WARM_ANSWERS

            watch.until("answers at the low rate", warm)

            # High: more than one worker can carry; the tuner scales up.
            before_step = watch.last_decision_id()
            load.phase(HIGH_QPS, seed=2)
            watch.until("a scale_up decision", lambda: watch.decisions("scale_up", before_step))
            # One reading, counted and returned: a second one may already differ from the first.
            more = watch.until(
                "more running worker processes",
                lambda: alive if len(alive := watch.live_processes()) >= 2 else None,
                WORKER_DEADLINE_S,
            )
            scaled_to = len(watch.running())
            ups = watch.decisions("scale_up", before_step)

            # Low again: the tuner scales down and the reconciler removes workers.
            before_drop = watch.last_decision_id()
            load.phase(LOW_QPS, seed=3)
            downs = watch.until(
                "a scale_down decision", lambda: watch.decisions("scale_down", before_drop)
            )
            watch.until("the fleet back to one worker", lambda: len(watch.running()) == 1)
            gone = [
                r["provider_id"]
                for r in watch.instances()
                if r["state"] not in KEPT and r["provider_id"] in watch.pids
            ]
            watch.until(
                "the removed workers' processes gone",
                lambda: not any(process_alive(watch.pids[p]) for p in gone),
            )
        finally:
            load.stop()
        events = api.get(f"/v1/apps/{APP}/events").json()
        rows = watch.instances()
        launches = watch.decisions("launch")
        terminations = watch.decisions("terminate")
        capped = watch.decisions("budget_capped")

    # The scale-up: the tuner's decisions with their reasons and numbers, within the budget.
    assert ups and scaled_to >= 2 and len(more) >= 2
    for up in ups:
        assert up["reason"].startswith("scale_up: window "), up["reason"]
        assert "qps > planned" in up["reason"] and "added" in up["reason"]
        assert up["numbers"]["instance_type"] == INSTANCE_TYPE
        assert up["numbers"]["count"] >= 1
        assert up["numbers"]["cost_usd_per_hr_after"] <= BUDGET_USD_PER_HR + 1e-9
    # The scale-down: after the drop, with its reason; the reconciler terminated the extra
    # workers and their processes are gone.
    assert downs
    for down in downs:
        assert down["reason"].startswith("scale_down: "), down["reason"]
        assert "since the last change" in down["reason"]
        assert down["numbers"]["instance_type"] == INSTANCE_TYPE
    assert any(t["numbers"]["cause"] == "scale_down" for t in terminations), terminations
    assert gone and not any(process_alive(watch.pids[p]) for p in gone)
    # Each worker the scale-down ended served no new query first: it drained (the serving loop
    # routes to running workers only), then went, drained.
    dropped = [t for t in terminations if t["numbers"]["cause"] == "scale_down"]
    for t in dropped:
        assert t["reason"].endswith("drained for 10 s after its scale-down"), t["reason"]
    moves = [e for e in events if e.get("to_state") == "draining"]
    assert {i for t in dropped for i in t["numbers"]["instance_ids"]} <= {
        e["instance_id"] for e in moves if e["reason"].startswith("scale_down: ")
    }
    # The budget: no poll saw more than MAX_WORKERS kept, no launch went past it, and over the
    # whole instance history the kept fleet never cost more than the budget.
    assert watch.most_kept <= MAX_WORKERS
    assert all(d["numbers"]["budget_usd_per_hr"] == BUDGET_USD_PER_HR for d in launches)
    prices = {r["id"]: float(r["price_usd_per_hr"]) for r in rows}
    assert len(rows) >= 2 and {r["instance_type"] for r in rows} == {INSTANCE_TYPE}
    assert _most_kept_cost(events, prices) <= BUDGET_USD_PER_HR + 1e-9
    for cap in capped:  # where the budget stopped the tuner (or the reconciler), it says so
        assert "budget" in cap["reason"]
    # The load generator saw the service answer in every phase.
    assert [rate for rate, _ in load.results] == [LOW_QPS, HIGH_QPS, LOW_QPS]
    assert all(result.summary(SLO_MS).answered > 0 for _, result in load.results)
