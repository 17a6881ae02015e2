"""INFaaS's autoscaler on the live local fleet: an app with ``scaling: infaas`` whose one
variant cannot carry the load is replicated (a second worker process launched that serves), and
drained back to one worker once the load is gone (issue 20's acceptance test).

The real service (``build_service`` on the local provisioner, its data directory and SQLite
database, migrated, in ``tmp_path``) runs behind a real uvicorn server on 127.0.0.1. Its one app
serves ``tiny`` on ``emu.cpu.large`` in :data:`SERVICE_MS` a query: the data directory's profile
file says so, and the workers pad every batch to it
(``controlplane.provisioning.LOCAL_PROFILE_FILE``, ``provisioners.worker.emulation``), so
one worker serves about 10 queries/s (INFaaS's Q_v). The budget affords :data:`MAX_WORKERS`
workers and not one more; the plan, made by the API's planner for :data:`PLAN_QPS`, is one
worker.

``controlplane.clients.loadgen`` (open loop) sends Poisson traffic at :data:`HIGH_QPS`: more than
Q_v, so more than U x Q_v (INFaaS's VM-Autoscaler threshold, 80%), less than U x 2 Q_v. The one
worker cannot keep up: the serving loop's admission control refuses what would miss the SLO
(429), and the model's INFaaS state reads *overloaded* in ``GET /v1/apps/{app}/serving`` (its
arrivals, admitted and refused, reach its capacity, and admission refused queries of it:
:mod:`controlplane.serving.states`; the backlog alone never says so under admission, which
keeps a one-sample backlog drainable within the SLO). The scaler, each tuner tick, finds the
variant overloaded or the model's measured load (the arrivals its queue received, refused ones
included) over U times its capacity (INFaaS's Constraint 1), whichever it sees first (both
within about 2 s of the load's start), records ``infaas_replicate`` with its reason (naming the
overload and what it was judged on when the state was in the status it read), and the
reconciler launches a second worker process. Both workers serve (each has a busy share in the
serving loop's status), and the state is *active* again: 2 Q_v carry the load. The load then
stops: once the arrivals have aged out of the serving loop's window and an instance has stayed
underused for the hold (``tuner_scale_down_delay_s``), the scaler records ``infaas_drain`` and
the reconciler terminates one worker, whose process exits.

Everything is read through the API as a user would (``/v1/apps/{app}/decisions``,
``/v1/apps/{app}/fleet``, ``/v1/apps/{app}/serving``), but the worker processes' ids (the local
provisioner's records). The scheduler's loops tick fast through the settings (0.5 s), the hold is
:data:`HOLD_S`; everything is polled against deadlines, nothing sleeps but the polling, nothing
is timed. The component test (``tests/component/test_infaas_scaler.py``) drives the same policy
tick by tick on a fake clock, with the *overloaded* state of a queue that cannot drain in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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

APP = "infaas"
MODEL = "tiny"
INSTANCE_TYPE = "emu.cpu.large"  # speed factor 1: the worker pads to the profile as it is
SERVICE_MS = 100.0  # one query, one worker: Q_v = 10 queries/s
SLO_MS = 1000.0
PLAN_QPS = 3.0
# Over U x Q_v = 8 qps (one worker is short), under U x 2 Q_v = 16 qps (two carry it), so
# that two workers neither ask for a third nor look underused while the load lasts.
HIGH_QPS = 12.0
MAX_WORKERS = 2
PRICE_USD_PER_HR = default_catalog().price_usd_per_hr(INSTANCE_TYPE)
# MAX_WORKERS workers and half of another: a third does not fit.
BUDGET_USD_PER_HR = (MAX_WORKERS + 0.5) * PRICE_USD_PER_HR
# The service's loops, quick (the defaults: reconcile 5 s, tuner 1 s, scale-down delay 15 s).
TICK_S = 0.5
HOLD_S = 3.0
# Workers import torch and load the family: seconds each, more on a busy shared machine.
DEADLINE_S = 240.0
LOAD_S = 2 * DEADLINE_S + 60.0  # the trace outlasts every wait; stop() ends it
POLL_S = 0.25
KEPT = ("requested", "pending", "running")

T = TypeVar("T")


@pytest.fixture
def service(tmp_path: Path, trained_family: Path) -> Iterator[Service]:
    """The service on the local provisioner with the emulated SERVICE_MS profile in its data
    directory (read by the workers and by the app's spec) and its loops quick."""
    data_dir = local_data_dir(tmp_path, trained_family)
    cell = (np.full(8, SERVICE_MS),)
    profile = data_dir / LOCAL_PROFILE_FILE
    profile.parent.mkdir(parents=True)
    write_profiles_json(
        [LatencyProfile(MODEL, t, np.array([1]), cell) for t in ("local.cpu", INSTANCE_TYPE)],
        profile,
        source="tests/integration/test_infaas_scaling.py (emulated)",
    )
    with running_local_service(
        data_dir,
        reconcile_s=TICK_S,
        tuner_tick_s=TICK_S,
        tuner_scale_down_delay_s=HOLD_S,
        replan_enabled=False,  # the plan stays the one applied: the scaler's starting fleet
    ) as built:
        yield built


class _Watch:
    """The service's state through its API (and the worker processes through the local
    provisioner's records), polled against deadlines."""

    def __init__(self, service: Service, api: httpx.Client) -> None:
        self.service = service
        self.api = api
        provisioner = service.provisioner
        assert isinstance(provisioner, LocalProvisioner)
        self.provisioner = provisioner
        self.pids: dict[str, int] = {}  # provider id -> worker pid, as seen while it ran
        self.most_kept = 0
        self.states_seen: list[tuple[int, str]] = []  # (workers in the status, MODEL's state)

    def instances(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.api.get("/v1/instances", params={"app": APP}).json()
        self.most_kept = max(self.most_kept, sum(r["state"] in KEPT for r in rows))
        for record in self.provisioner.records():
            if record.pid is not None:  # None: a launch cut short, never started
                self.pids.setdefault(record.provider_id, record.pid)
        return rows

    def running(self) -> list[dict[str, Any]]:
        return [r for r in self.instances() if r["state"] == "running"]

    def fleet(self) -> dict[str, Any]:
        found: dict[str, Any] = self.api.get(f"/v1/apps/{APP}/fleet").json()
        return found

    def running_in_fleet(self) -> int:
        """Running instances of the app's fleet as ``/v1/apps/{app}/fleet`` counts them."""
        fleet = self.fleet()
        return sum(int(row["states"].get("running", 0)) for row in fleet["by_type"])

    def serving(self) -> dict[str, Any]:
        found: dict[str, Any] = self.api.get(f"/v1/apps/{APP}/serving").json()
        for stage in found["stages"]:
            if stage["model"] == MODEL:
                workers = len(found["workers"])
                self.states_seen += [(workers, s) for s in sorted(stage["states"].values())]
        return found

    def overloaded_seen(self) -> bool:
        """Whether MODEL's state read *overloaded* on a worker in a status polled so far (one
        more poll first)."""
        self.serving()
        return any(state == "overloaded" for _, state in self.states_seen)

    def decisions(self, kind: str | None = None, after_id: int = 0) -> list[dict[str, Any]]:
        params = {"kind": kind} if kind is not None else {}
        rows = self.api.get(f"/v1/apps/{APP}/decisions", params=params).json()
        return sorted((d for d in rows if int(d["id"]) > after_id), key=lambda d: int(d["id"]))

    def last_decision_id(self) -> int:
        return max((int(d["id"]) for d in self.decisions()), default=0)

    def until(self, what: str, check: Callable[[], T | None], deadline_s: float = DEADLINE_S) -> T:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(POLL_S)
        logs = self.service.settings.data_dir / "workers" / "logs"
        tails = {p.name: p.read_text()[-600:] for p in sorted(logs.glob("*.log"))}
        seen = [(d["kind"], d["reason"]) for d in self.decisions()]
        pytest.fail(f"{what}: not within {deadline_s:g} s; decisions {seen}; logs {tails}")


def _deploy(api: httpx.Client, profile: Path) -> dict[str, Any]:
    """Register the app (``scaling: infaas``), plan it for PLAN_QPS through the API and apply
    the plan."""
    spec = {
        "name": APP,
        "models": [{"name": MODEL, "profiles": str(profile)}],
        "slo": {"latency_ms": SLO_MS, "percentile": 99},
        "budget_usd_per_hr": BUDGET_USD_PER_HR,
        "instance_types": [INSTANCE_TYPE],
        "scaling": "infaas",
    }
    api.post("/v1/apps", json=spec).raise_for_status()
    preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": PLAN_QPS})
    preview.raise_for_status()
    plan: dict[str, Any] = preview.json()
    api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()
    return plan


@pytest.mark.slow
def test_an_overloaded_variant_is_replicated_on_a_new_worker_and_drained_once_the_load_stops(
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
        load = BackgroundLoad(url, APP, admin, LOAD_S)
        try:
            (first,) = watch.until("the planned worker running", watch.running)
            before_load = watch.last_decision_id()

            # More load than one worker carries: the variant is overloaded (the serving status
            # says so while the one worker serves alone), and the scaler replicates it.
            load.phase(HIGH_QPS, seed=20)
            watch.until(f"{MODEL} overloaded on the one worker", watch.overloaded_seen)

            def replicated() -> list[dict[str, Any]]:
                watch.serving()  # the states as the load goes on
                return watch.decisions("infaas_replicate", before_load)

            (replicate,) = watch.until("an infaas_replicate decision", replicated)[:1]

            def two_running() -> list[dict[str, Any]] | None:
                watch.serving()
                running = watch.running()
                return running if len(running) == 2 else None

            both = watch.until("two running workers", two_running)
            watch.until(
                "two running instances in the app's fleet", lambda: watch.running_in_fleet() == 2
            )
            ids = {r["id"] for r in both}

            def both_serve() -> dict[str, Any] | None:
                status = watch.serving()
                busy = {
                    w["instance_id"]: w["utilisation_share"]
                    for w in status["workers"]
                    if w["healthy"]
                }
                served = {i for i, share in busy.items() if share is not None and share > 0}
                return status if ids <= served else None

            serving = watch.until("both workers serving", both_serve)
            # Two workers carry the load: the state is active again (the refusals were judged
            # at one worker's capacity, the arrivals are within two), while the load goes on.
            watch.until(
                f"{MODEL} active on both workers under the load",
                lambda: (
                    (states := watch.serving()["stages"][0]["states"]).keys() >= ids
                    and set(states.values()) == {"active"}
                ),
            )
            pids_serving = {r["provider_id"]: watch.pids[r["provider_id"]] for r in both}
            assert all(process_alive(pid) for pid in pids_serving.values()), pids_serving
            drains_under_load = watch.decisions("infaas_drain", before_load)

            # The load stops: the scaler drains one worker after the hold.
            load.stop()
            stopped = watch.last_decision_id()
            (drain,) = watch.until(
                "an infaas_drain decision", lambda: watch.decisions("infaas_drain", stopped)
            )[:1]
            watch.until(
                "the fleet back to one running worker",
                lambda: watch.running_in_fleet() == 1 and watch.fleet()["instances"] == 1,
            )
            (kept,) = watch.running()
            gone = {p: pid for p, pid in pids_serving.items() if p != kept["provider_id"]}
            watch.until(
                "the removed worker's process gone",
                lambda: not any(process_alive(pid) for pid in gone.values()),
            )
        finally:
            load.stop()
        decisions = watch.decisions(after_id=before_load)
        fleet = watch.fleet()
        rows = watch.instances()

    # The state: overloaded while one worker served alone (never with two in the status).
    assert (1, "overloaded") in watch.states_seen, watch.states_seen
    # The replicate: INFaaS's decision with its reason and numbers, the loaded variant on one
    # more worker of its type, within the budget.
    reason = replicate["reason"]
    assert reason.startswith("infaas_replicate: "), reason
    assert f"replicate the loaded variant {MODEL} on {INSTANCE_TYPE}: +1 x {INSTANCE_TYPE}" in (
        reason
    )
    numbers = replicate["numbers"]
    assert numbers["policy"] == "infaas"
    assert (numbers["model"], numbers["instance_type"]) == (MODEL, INSTANCE_TYPE)
    assert (numbers["count"], numbers["count_before"], numbers["count_after"]) == (1, 1, 2)
    assert numbers["saturation_qps"] == pytest.approx(1000.0 / SERVICE_MS)
    # Overloaded (the state, named in the reason with what it was judged on), or more load than
    # U times the one worker's capacity, or both: whichever the tick saw first.
    if numbers["overloaded"]:
        assert f"{MODEL} is overloaded on {first['id']}: " in reason, reason
        assert numbers["overloaded_instances"] == [first["id"]]
        overload = numbers["overload"]
        assert overload["refused"] > 0 or overload["arrival_sps"] >= overload["capacity_sps"]
        assert overload["capacity_sps"] == pytest.approx(1000.0 / SERVICE_MS)
    else:
        assert numbers["load_qps"] > 0.8 * numbers["capacity_qps_before"], numbers
        assert "load " in reason and "overloaded" not in reason, reason
    assert numbers["cost_usd_per_hr_after"] <= BUDGET_USD_PER_HR + 1e-9
    # The one worker could not carry the load: admission refused some of it.
    assert int(serving["totals"]["refused"]) > 0, serving["totals"]
    # The reconciler launched the second worker after the decision; the first kept running.
    launches = [d for d in decisions if d["kind"] == "launch"]
    assert launches and all(int(d["id"]) > int(replicate["id"]) for d in launches), decisions
    assert first["id"] in ids and len(ids) == 2
    # No drain while the load lasted: two workers carried it (and no more were launched).
    assert drains_under_load == []
    assert watch.most_kept == MAX_WORKERS

    # The drain: after the load stopped, with its reason, one worker fewer; the reconciler
    # terminated one worker and its process is gone, the other still runs.
    reason = drain["reason"]
    assert reason.startswith("infaas_drain: "), reason
    assert f"-1 x {INSTANCE_TYPE}" in reason and "underused for" in reason
    numbers = drain["numbers"]
    assert numbers["instance_id"] in ids
    assert (numbers["instance_type"], numbers["count"], numbers["count_after"]) == (
        INSTANCE_TYPE,
        1,
        1,
    )
    assert numbers["underused_s"] >= HOLD_S - 1e-9 and numbers["hold_s"] == HOLD_S
    # Without it, the one worker left carries what load is still measured at U.
    assert numbers["capacity_qps_after"] == {MODEL: pytest.approx(1000.0 / SERVICE_MS)}
    assert numbers["load_qps"][MODEL] <= 0.8 * numbers["capacity_qps_after"][MODEL] + 1e-9
    terminations = [d for d in decisions if d["kind"] == "terminate"]
    assert terminations and all(int(t["id"]) > int(drain["id"]) for t in terminations), [
        (d["id"], d["kind"], d["reason"][:120]) for d in decisions
    ]
    assert fleet["instances"] == 1 and fleet["by_type"][0]["states"] == {"running": 1}
    assert kept["id"] in ids
    assert len(gone) == 1 and not any(process_alive(pid) for pid in gone.values())
    assert process_alive(watch.pids[kept["provider_id"]])
    (ended,) = [r for r in rows if r["id"] in ids and r["id"] != kept["id"]]
    assert ended["state"] not in KEPT
    # The load generator's queries were answered.
    assert load.result is not None and load.result.summary(SLO_MS).answered > 0
