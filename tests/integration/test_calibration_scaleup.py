"""Online calibration on the live local fleet: a worker slower than its profile makes the service
record a ``profile_drift`` decision with both figures, and the tuner, on the calibrated profile,
scales the fleet up (issue 17's acceptance test).

The real service (``build_service`` on the local provisioner, its data directory in
``tmp_path``) runs behind a real uvicorn server on 127.0.0.1. Its one app serves ``tiny`` on
``emu.cpu.large``. The data directory's profile file (``LOCAL_PROFILE_FILE``, which the app's spec
names too) tells two stories:

* its ``profiles`` (what the planner, the dispatcher and the tuner believe) say a batch costs
  :data:`BELIEVED_MS`, so one instance carries about 100 queries/s;
* its ``compute`` section (what the emulated workers pad every batch to,
  ``provisioners.worker.emulation``) says :data:`COMPUTE_MS`, so one worker really carries about
  20 queries/s.

The plan, previewed through the API for :data:`PLAN_QPS`, is one worker (the believed profile
says one carries it). ``controlplane.clients.loadgen`` then sends open-loop Poisson traffic at
:data:`LOAD_QPS`: less than the plan's rate (so the live envelope never exceeds the planned one and
the tuner has no reason to scale up on the believed profile), more than one slow worker serves.
The calibration loop (each tuner tick) compares the served batches' round trips with the profile;
after :data:`MIN_BATCHES` of them it stores a scale factor and records ``profile_drift``; the
tuner, set up again on the calibrated profile, keeps the plan's capacity in queries/s (more
instances of the slower type), finds the one running worker short of the load and scales up, and
the reconciler launches workers within the budget (:data:`MAX_WORKERS`).

Everything is polled against deadlines (the workers import torch: seconds each on a busy
machine); nothing is timed. The assertions: the drift decision names the profiled and the
observed mean per batch (the profile's figure exactly, the observed one at least the compute the
worker pads to), the stored factor agrees with it, and a plan previewed for the load's rate is one
instance before it and more after it (or, on a machine too busy for any plan within the budget,
refused); no scale-up and no launch beyond the plan's comes before
it, while after it come a tuner ``scale_up`` (``below plan``, at the calibrated rate per
instance) and a ``launch``, and more instances of the app than the plan had, two of them
running.
"""

from __future__ import annotations

import re
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
from tests.integration.background_load import BackgroundLoad
from tests.integration.conftest import ApiServer, local_data_dir, running_local_service

pytest.importorskip("torch")

APP = "drifting"
MODEL = "tiny"
INSTANCE_TYPE = "emu.cpu.large"  # speed factor 1: the worker pads to the compute curve as it is
# What the profiles say a batch costs, and what the workers really take (padded to).
BELIEVED_MS = 10.0
COMPUTE_MS = 50.0
SLO_MS = 1000.0
# The plan's rate: the believed profile's one instance carries it (about 100 qps at 10 ms).
PLAN_QPS = 50.0
# The load: below the plan's rate, above what one 50 ms worker serves (about 20 qps).
LOAD_QPS = 25.0
MAX_WORKERS = 4
PRICE_USD_PER_HR = default_catalog().price_usd_per_hr(INSTANCE_TYPE)
# MAX_WORKERS workers and half of another: the scale-up stays within it.
BUDGET_USD_PER_HR = (MAX_WORKERS + 0.5) * PRICE_USD_PER_HR
MIN_BATCHES = 30
THRESHOLD = 0.25
# Workers import torch and load the family: seconds each, more on a busy shared machine.
DEADLINE_S = 240.0
LOAD_S = 2 * DEADLINE_S + 60.0  # the trace outlasts every wait; stop() ends it
POLL_S = 0.25
KEPT = ("requested", "pending", "running")

T = TypeVar("T")


@pytest.fixture
def service(tmp_path: Path, trained_family: Path) -> Iterator[Service]:
    """The service on the local provisioner with a profile file whose ``profiles`` say
    BELIEVED_MS per batch and whose ``compute`` section (what the workers pad to) says
    COMPUTE_MS; the reconciler, the tuner and the calibration quick."""
    from provisioners.worker.emulation import ComputeCurve, compute_document

    data_dir = local_data_dir(tmp_path, trained_family)
    profile = data_dir / LOCAL_PROFILE_FILE
    profile.parent.mkdir(parents=True)
    cell = (np.full(8, BELIEVED_MS),)
    write_profiles_json(
        [LatencyProfile(MODEL, t, np.array([1]), cell) for t in ("local.cpu", INSTANCE_TYPE)],
        profile,
        source="tests/integration/test_calibration_scaleup.py (emulated, slower than profiled)",
        compute=compute_document({MODEL: ComputeCurve(COMPUTE_MS, 0.0)}),
    )
    with running_local_service(
        data_dir,
        reconcile_s=0.5,
        tuner_tick_s=0.5,
        tuner_max_window_s=8.0,
        # The scale-up's instances stay until they run: on a busy machine they booted longer
        # than the default 15 s, and the load's end let the tuner stop them first.
        tuner_scale_down_delay_s=3600.0,
        calibration_min_batches=MIN_BATCHES,
        calibration_threshold=THRESHOLD,
    ) as built:
        yield built


class _Watch:
    """The service's state through its API, polled against deadlines."""

    def __init__(self, service: Service, api: httpx.Client) -> None:
        self.service = service
        self.api = api

    def instances(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.api.get("/v1/instances", params={"app": APP}).json()
        return rows

    def grown_beyond(self, planned: int) -> list[dict[str, Any]] | None:
        """The app's instance records once more than ``planned`` are kept and two run."""
        rows = self.instances()
        kept = [r for r in rows if r["state"] in KEPT]
        running = [r for r in rows if r["state"] == "running"]
        return rows if len(kept) > planned and len(running) >= 2 else None

    def decisions(self, kind: str | None = None) -> list[dict[str, Any]]:
        params = {"kind": kind} if kind is not None else {}
        rows: list[dict[str, Any]] = self.api.get(f"/v1/apps/{APP}/decisions", params=params).json()
        return sorted(rows, key=lambda d: int(d["id"]))

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
    """Register the app, preview a plan for PLAN_QPS through the API and apply it."""
    spec = {
        "name": APP,
        "models": [{"name": MODEL, "profiles": str(profile)}],
        "slo": {"latency_ms": SLO_MS, "percentile": 99},
        "budget_usd_per_hr": BUDGET_USD_PER_HR,
        "instance_types": [INSTANCE_TYPE],
    }
    api.post("/v1/apps", json=spec).raise_for_status()
    preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": PLAN_QPS})
    preview.raise_for_status()
    plan: dict[str, Any] = preview.json()
    api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()
    return plan


def _preview_fleet(api: httpx.Client, rate_qps: float) -> int | str:
    """How many instances a plan previewed (not applied) for ``rate_qps`` has, or the planner's
    refusal (a 422 ``unplannable``: its message) where no plan within the budget serves it."""
    preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": rate_qps})
    error = preview.json().get("error") if preview.status_code == 422 else None
    if error and error.get("code") == "unplannable":
        return f"refused: {error.get('message')}"
    assert preview.status_code == 201, (preview.status_code, preview.text)
    return sum(sum(stage["fleet"].values()) for stage in preview.json()["stages"])


@pytest.mark.slow
def test_a_worker_slower_than_its_profile_triggers_profile_drift_then_a_scale_up(
    service: Service,
) -> None:
    admin = service.store.create_token("admin", name="operator")
    headers = {"Authorization": f"Bearer {admin}"}
    with (
        ApiServer(service) as url,
        httpx.Client(base_url=url, headers=headers, timeout=60.0, trust_env=False) as api,
    ):
        plan = _deploy(api, service.settings.data_dir / LOCAL_PROFILE_FILE)
        # On the believed profile one instance carries the plan's rate.
        assert [s["fleet"] for s in plan["stages"]] == [{INSTANCE_TYPE: 1}]
        planned = 1
        # A preview for the load's rate, on the profile the service believes: one instance.
        before = _preview_fleet(api, LOAD_QPS)
        watch = _Watch(service, api)
        load = BackgroundLoad(url, APP, admin, LOAD_S)
        try:
            watch.until(
                "the planned worker running",
                lambda: [r for r in watch.instances() if r["state"] == "running"],
            )
            load.phase(LOAD_QPS, seed=17)
            drift = watch.until(
                "a profile_drift decision", lambda: watch.decisions("profile_drift")
            )[0]
            drift_scales = service.store.list_profile_scales(APP)
            ups = watch.until(
                "a scale_up decision after the drift",
                lambda: [d for d in watch.decisions("scale_up") if int(d["id"]) > int(drift["id"])],
            )
            grown = watch.until(
                "more instances than the plan's, two of them running",
                lambda: watch.grown_beyond(planned),
            )
            after = _preview_fleet(api, LOAD_QPS)
        finally:
            load.stop()
        decisions = watch.decisions()

    # (a) The drift: both figures, the profile's exactly, the observed one at least the compute
    # the worker pads every batch to (its round trip adds the HTTP hop), their ratio the factor.
    numbers = drift["numbers"]
    assert (numbers["model"], numbers["instance_type"]) == (MODEL, INSTANCE_TYPE)
    assert numbers["profile_mean_ms"] == pytest.approx(BELIEVED_MS)
    assert numbers["observed_mean_ms"] >= 0.95 * COMPUTE_MS
    assert numbers["batches"] >= MIN_BATCHES
    assert numbers["old_factor"] == pytest.approx(1.0)
    assert numbers["factor"] == pytest.approx(numbers["observed_mean_ms"] / BELIEVED_MS)
    assert numbers["factor"] > 1.0 + THRESHOLD
    assert f"{numbers['observed_mean_ms']:.1f} ms per batch observed" in drift["reason"]
    assert f"the profile says {BELIEVED_MS:.1f} ms" in drift["reason"]
    # The factor is stored (a restart resolves the calibrated profile) and a preview plans on the
    # calibrated profile: the load's rate, one instance before, now needs more.
    [scale] = drift_scales
    assert (scale.model, scale.instance_type) == (MODEL, INSTANCE_TYPE)
    assert scale.factor == pytest.approx(numbers["factor"])
    # On a machine so busy that the calibrated batch time, or the service's own time per query
    # it measures, leaves no plan within the budget, the planner refuses the rate (422): that
    # too says one instance no longer carries it.
    assert before == planned, before
    assert isinstance(after, str) or after > planned, after

    # (b) The scale-up, after the drift: the tuner's decision (restoring the plan's capacity on
    # the calibrated profile), the reconciler's launch, more instances than the plan had.
    drift_id = int(drift["id"])
    assert all(
        int(d["id"]) > drift_id for d in decisions if d["kind"] in ("scale_up", "budget_capped")
    ), decisions
    assert ups and all(u["numbers"]["instance_type"] == INSTANCE_TYPE for u in ups)
    # Not the live envelope over the planned one (LOAD_QPS is below PLAN_QPS): the one worker
    # is below the plan's capacity, counted on the calibrated profile.
    assert ups[0]["reason"].startswith("scale_up: below plan: "), ups[0]["reason"]
    # ... with the calibrated rate per instance (the believed one was 1000 / BELIEVED_MS qps).
    mu = re.search(r"\(mu ([0-9.]+) qps", ups[0]["reason"])
    assert mu is not None, ups[0]["reason"]
    assert float(mu.group(1)) == pytest.approx(1000.0 / numbers["observed_mean_ms"], rel=0.02)
    assert all(u["numbers"]["count"] >= 1 for u in ups)
    assert all(u["numbers"]["cost_usd_per_hr_after"] <= BUDGET_USD_PER_HR + 1e-9 for u in ups)
    launches = [d for d in decisions if d["kind"] == "launch"]
    first_launches = [d for d in launches if int(d["id"]) < drift_id]
    later_launches = [d for d in launches if int(d["id"]) > int(ups[0]["id"])]
    # Before the drift only the plan's one instance was launched; after the scale-up, more.
    assert sum(len(d["numbers"]["launches"]) for d in first_launches) == planned, launches
    assert later_launches, launches
    assert len({r["id"] for r in grown}) > planned
    assert sum(r["state"] == "running" for r in grown) >= 2
    # The load generator's queries were answered (by the slow worker, then the fleet).
    assert load.result is not None and load.result.summary(SLO_MS).answered > 0
