"""A budget cut under the fleet the live tuner has reached, with the reconciler carrying out
what it decides (the fake provisioner, a fake clock): the tuner keeps the fleet it reached and
sheds it to the new budget; the decision log says what happened.

The demo's shape: a 3-stage cascade, each stage planned on 1 x emu.cpu.small ($0.05/hr), planned
rate 12 qps, budget $0.5/hr, caps small 6 / large 2. Load above the plan grows the fleet to the
cap (6 smalls, $0.30/hr); then the budget is cut to $0.20/hr. Set up again from the plan at the
cut, the tuner had started from the plan's 3 smalls and recorded "added 1 x emu.cpu.small" that
the reconciler never launched (it drained 6 to 4), as testers saw on the demo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db.store import AppRecord, Store
from controlplane.loops.live_tuner import LiveTuner
from controlplane.loops.reconciler import AppPricing, Reconciler
from controlplane.policies.tuner import fleet_cost_usd_per_hr
from controlplane.spec import resolve_spec, validate_spec
from provisioners.fake import FakeProvisioner

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
PRICES = {SMALL: 0.05, LARGE: 0.10}
APP = "demo"
MODELS = {"tiny": 20.0, "medium": 40.0, "large": 80.0}  # ms per query at batch 1 on small
SCALE = {"tiny": 1.0, "medium": 0.068, "large": 0.0128}


def _spec(folder: Path) -> dict[str, Any]:
    profiles = {
        "format": "heteroplane.profiles/v1",
        "profiles": [
            {"model": m, "instance_type": t, "batch_sizes": [1], "latency_ms": [[ms * f]]}
            for m, ms in MODELS.items()
            for t, f in ((SMALL, 1.0), (LARGE, 0.5))
        ],
    }
    (folder / "profiles.json").write_text(json.dumps(profiles))
    return {
        "name": APP,
        "models": [{"name": m, "profiles": str(folder / "profiles.json")} for m in MODELS],
        "cascade": list(MODELS),
        "slo": {"latency_ms": 300},
        "budget_usd_per_hr": 0.5,
        "instance_types": [SMALL, LARGE],
        "max_counts": {SMALL: 6, LARGE: 2},
    }


def _plan() -> dict[str, Any]:
    return {
        "feasible": True,
        "cost_usd_per_hr": 0.15,
        "stages": [
            {
                "name": m,
                "fleet": {SMALL: 1},
                "batch_size": 1,
                "predicted_p99_ms": 100.0,
                "throughput_qps": 1000.0 / ms,
                "policy": "fcfs",
                "scale_factor": SCALE[m],
            }
            for m, ms in MODELS.items()
        ],
        "planned_rate_qps": 12.0,
        "steps": [],
    }


def _resolve(app: AppRecord) -> Any:
    return resolve_spec(validate_spec(app.spec))


def _steady(rate: float, start: float, end: float) -> np.ndarray:
    return start + np.arange(int((end - start) * rate)) / rate


def _running(store: Store) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in store.list_instances(APP, states=["requested", "pending", "running"]):
        counts[i.instance_type] = counts.get(i.instance_type, 0) + 1
    return counts


def _applied(tmp_path: Path) -> tuple[FakeClock, Store]:
    """A store through the migrations with the demo-shaped app and its plan applied."""
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    clock = FakeClock(start_s=1000.0)
    store = Store.from_url(url, clock)
    store.create_app(_spec(tmp_path), who="test")
    store.apply_plan(APP, store.create_plan(APP, _plan()).id)
    return clock, store


def test_a_budget_cut_or_a_lower_cap_sheds_the_fleet_reached_and_records_no_scale_up(
    tmp_path: Path,
) -> None:
    clock, store = _applied(tmp_path)
    arrivals = {"a": np.empty(0)}
    tuner = LiveTuner(store, clock, lambda _app: arrivals["a"], _resolve, model="inferline")
    fake = FakeProvisioner(now=clock.utcnow)
    reconciler = Reconciler(
        store,
        fake,
        clock,
        lambda _app: AppPricing(PRICES, {SMALL: 10.0, LARGE: 20.0}),
        desired_fleet=tuner.desired_fleet,
    )

    def tick(rate: float) -> None:
        clock.advance(5.0)
        now = clock.now_s()
        arrivals["a"] = _steady(rate, now - 60.0, now)
        tuner.tick()
        reconciler.run_once()
        fake.step()

    for _ in range(12):  # 40 qps > the planned 12: grown to the cap
        tick(40.0)
    assert _running(store) == {SMALL: 6}
    first = max(d.id for d in store.list_decisions(APP))
    launched = fake.launched_total

    store.change_budget(APP, 0.2, reason="cut", who="test")
    tick(40.0)
    tick(40.0)
    after = [d for d in store.list_decisions(APP) if d.id > first]
    # Nothing launched, and the log says so: no scale-up; the tuner's own scale-downs name the
    # budget: two smalls of the six, from the stages whose loss leaves the app's bottleneck (tiny,
    # which every query reaches) where it is.
    assert fake.launched_total == launched
    assert not [d for d in after if d.kind == "scale_up"], [d.reason for d in after]
    shed = [d for d in after if d.kind == "scale_down" and "over the budget" in d.reason]
    assert sum(d.numbers["count"] for d in shed) == 2, [d.reason for d in after]
    assert "tiny" not in {d.numbers["stage"] for d in shed}, [d.reason for d in shed]
    # The tuner's fleet is what runs, within the budget, nothing of it "booting".
    tuned = tuner._apps[APP]
    assert tuner.desired_fleet(store.get_app(APP)) == _running(store) == {SMALL: 4}
    assert fleet_cost_usd_per_hr(tuned.state, tuned.config.prices_usd_per_hr) <= 0.2 + 1e-9
    assert not tuned.state.booting

    # The budget raised again: the fleet reached stays (nothing shed, nothing set up from the
    # plan's three again), and the load it could not pay for grows it within the new budget.
    before = max(d.id for d in store.list_decisions(APP))
    store.change_budget(APP, 0.5, reason="raised", who="test")
    tick(40.0)
    raised = [d for d in store.list_decisions(APP) if d.id > before]
    assert not [d for d in raised if d.kind == "scale_down"], [d.reason for d in raised]
    grown = tuner.desired_fleet(store.get_app(APP))
    assert 4 < grown[SMALL] <= 6, grown
    assert fake.launched_total - launched == grown[SMALL] - 4

    # A cap lowered in the spec (PUT of the app; its plan stays): read at the next tick, the
    # fleet reached shed to it, and the reconciler stops what the tuner stopped (a cap is no
    # budget: at the disruption budget's pace).
    before = max(d.id for d in store.list_decisions(APP))
    spec = dict(store.get_app(APP).spec)
    store.update_app(APP, {**spec, "max_counts": {SMALL: 4, LARGE: 2}}, who="test")
    tick(40.0)
    capped = [d for d in store.list_decisions(APP) if d.id > before]
    shed = [d for d in capped if d.kind == "scale_down" and "over the cap" in d.reason]
    assert sum(d.numbers["count"] for d in shed) == grown[SMALL] - 4, [d.reason for d in capped]
    assert not [d for d in capped if d.kind == "scale_up"]
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 4}
    for _ in range(26):  # the disruption budget paces the serving ones: one a minute
        tick(40.0)
    assert tuner.desired_fleet(store.get_app(APP)) == _running(store) == {SMALL: 4}


def test_a_budget_cut_holds_when_the_spec_no_longer_resolves(tmp_path: Path) -> None:
    """The app's profiles gone (its spec no longer resolves) when the budget is cut: the tuner
    still takes the new budget (it needs no profile) and sheds to it; it used to stay on the old
    limits, retrying the spec every tick."""
    clock, store = _applied(tmp_path)
    broken: list[bool] = []

    def resolve(app: AppRecord) -> Any:
        if broken:
            raise ValueError("profiles.json: no such file")
        return _resolve(app)

    now = clock.now_s()
    tuner = LiveTuner(
        store, clock, lambda _app: _steady(40.0, now - 60.0, now), resolve, model="inferline"
    )
    tuner.tick()
    grown = tuner.desired_fleet(store.get_app(APP))[SMALL]
    assert grown > 4
    broken.append(True)
    store.change_budget(APP, 0.2, reason="cut", who="test")
    clock.advance(1.0)
    tuner.tick()
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 4}
