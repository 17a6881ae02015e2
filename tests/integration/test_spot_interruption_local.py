"""A spot interruption notice under load on the live local fleet, and no query lost (issue 33's
acceptance test).

The real service (``build_service`` on the local provisioner, SQLite through the migrations)
runs behind a real uvicorn server on 127.0.0.1, with one app serving ``tiny`` on two
``emu.cpu.large`` workers (planned through the API for more load than is sent, so that one worker
carries the load alone while the other is replaced). ``controlplane.clients.loadgen`` sends
Poisson traffic through ``/v1/apps/{app}/infer`` all along. Then the local provisioner's
interruption knob gives one worker a notice (:data:`NOTICE_S`; its process is killed at the
deadline unless the control plane has terminated it by then). The reconciler's rule 9 must
drain it (the serving loop stops sending it queries, what it holds finishes), launch its
replacement at once, terminate it before the deadline and record a ``spot_interruption``
decision; and the client must see every query answered.

Marked slow: worker processes import torch and load the family (seconds each), and three of them
start here; everything is polled against deadlines, nothing sleeps but the polling, nothing is
timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime
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
pytestmark = pytest.mark.slow

APP = "spot"
MODEL = "tiny"
INSTANCE_TYPE = "emu.cpu.large"
SERVICE_MS = 20.0  # one worker serves about 50 queries/s
SLO_MS = 2000.0
PLAN_QPS = 70.0  # the plan: two workers
LOAD_QPS = 8.0  # one worker carries it alone
NOTICE_S = 60.0
PRICE_USD_PER_HR = default_catalog().price_usd_per_hr(INSTANCE_TYPE)
BUDGET_USD_PER_HR = 3.5 * PRICE_USD_PER_HR  # the two, and the replacement next to the doomed one
TICK_S = 0.5
DEADLINE_S = 240.0
LOAD_S = 2 * DEADLINE_S
POLL_S = 0.25

T = TypeVar("T")


@pytest.fixture
def service(tmp_path: Path, trained_family: Path) -> Iterator[Service]:
    data_dir = local_data_dir(tmp_path, trained_family)
    profile = data_dir / LOCAL_PROFILE_FILE
    profile.parent.mkdir(parents=True)
    write_profiles_json(
        [
            LatencyProfile(MODEL, t, np.array([1]), (np.full(8, SERVICE_MS),))
            for t in ("local.cpu", INSTANCE_TYPE)
        ],
        profile,
        source="tests/integration/test_spot_interruption_local.py (emulated)",
    )
    with running_local_service(
        data_dir,
        reconcile_s=TICK_S,
        tuner_tick_s=TICK_S,
        tuner_scale_down_delay_s=3600.0,  # the fleet stays the plan's under the light load
        replan_enabled=False,
    ) as built:
        yield built


def until(what: str, check: Callable[[], T | None], service: Service) -> T:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(POLL_S)
    logs = service.settings.data_dir / "workers" / "logs"
    tails = {p.name: p.read_text()[-600:] for p in sorted(logs.glob("*.log"))}
    pytest.fail(f"{what}: not within {DEADLINE_S:g} s; logs {tails}")


def test_an_interruption_notice_under_load_loses_no_query(service: Service) -> None:
    provisioner = service.provisioner
    assert isinstance(provisioner, LocalProvisioner)
    admin = service.store.create_token("admin", name="operator")
    headers = {"Authorization": f"Bearer {admin}"}
    with (
        ApiServer(service) as url,
        httpx.Client(base_url=url, headers=headers, timeout=60.0, trust_env=False) as api,
    ):
        spec = {
            "name": APP,
            "models": [
                {"name": MODEL, "profiles": str(service.settings.data_dir / LOCAL_PROFILE_FILE)}
            ],
            "slo": {"latency_ms": SLO_MS, "percentile": 99},
            "budget_usd_per_hr": BUDGET_USD_PER_HR,
            "instance_types": [INSTANCE_TYPE],
            "max_counts": {INSTANCE_TYPE: 3},
        }
        api.post("/v1/apps", json=spec).raise_for_status()
        plan = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": PLAN_QPS}).json()
        assert [s["fleet"] for s in plan["stages"]] == [{INSTANCE_TYPE: 2}], plan
        api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()

        def instances() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = api.get("/v1/instances", params={"app": APP}).json()
            return found

        def running() -> list[dict[str, Any]] | None:
            rows = [r for r in instances() if r["state"] == "running"]
            return rows if len(rows) == 2 else None

        def serving_workers() -> int:
            status = api.get(f"/v1/apps/{APP}/serving").json()
            return sum(1 for w in status["workers"] if w["healthy"])

        first_two = until("two running workers", running, service)
        until("both in the serving loop", lambda: serving_workers() == 2, service)
        load = BackgroundLoad(url, APP, admin, LOAD_S)
        try:
            load.phase(LOAD_QPS, seed=33)
            doomed = first_two[0]
            pid = {r.provider_id: r.pid for r in provisioner.records()}[doomed["provider_id"]]
            notice = provisioner.interrupt(doomed["provider_id"], NOTICE_S)

            (decision,) = until(
                "a spot_interruption decision",
                lambda: api.get(
                    f"/v1/apps/{APP}/decisions", params={"kind": "spot_interruption"}
                ).json(),
                service,
            )

            def doomed_ended() -> bool:
                state = {r["id"]: r for r in instances()}[doomed["id"]]["state"]
                return state in ("terminating", "terminated")

            # When the control plane ended it, not when its replacement runs too: past
            # margin_s + drain_s before the deadline the doomed worker drains and goes whether or
            # not the replacement runs yet, and a replacement slow to start on a busy machine
            # (torch, the family) must not count against the deadline.
            until("the doomed worker terminated", doomed_ended, service)
            ended_at = datetime.now(notice.deadline.tzinfo)

            def replaced() -> list[dict[str, Any]] | None:
                rows = {r["id"]: r for r in instances()}
                if rows[doomed["id"]]["state"] not in ("terminating", "terminated"):
                    return None
                serving = [r for r in rows.values() if r["state"] == "running"]
                return serving if len(serving) == 2 else None

            after = until("the doomed worker gone and its replacement running", replaced, service)
            until("the replacement in the serving loop", lambda: serving_workers() == 2, service)
            until("the doomed worker's process gone", lambda: not process_alive(pid), service)
            # The load goes on to the fleet as it is now: the replacement serves some of it.
            (new,) = [r for r in after if r["id"] != first_two[1]["id"]]

            def replacement_serves() -> bool:
                status = api.get(f"/v1/apps/{APP}/serving").json()
                return any(
                    w["instance_id"] == new["id"] and (w["utilisation_share"] or 0) > 0
                    for w in status["workers"]
                )

            until("the replacement serving queries", replacement_serves, service)
            # Its row ends terminated (by the control plane), not failed (lost).
            until(
                "the doomed worker's row ended",
                lambda: (
                    {r["id"]: r for r in instances()}[doomed["id"]]["state"]
                    in ("terminated", "failed")
                ),
                service,
            )
        finally:
            load.stop()
        rows = {r["id"]: r for r in instances()}

    result = load.result
    assert result is not None and result.sent > 0
    failed = [o for o in result.outcomes if not o.answered]
    assert failed == [], failed[:5]
    # Terminated by the control plane before the deadline (not lost: that would read failed).
    assert ended_at < notice.deadline
    assert rows[doomed["id"]]["state"] == "terminated"
    assert doomed["id"] not in {r["id"] for r in after}
    assert decision["numbers"]["provider_id"] == doomed["provider_id"]
    assert "spot interruption warning" in decision["reason"]
