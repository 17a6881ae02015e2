"""The tuner on live traffic: a real store (SQLite through the migrations), a fake clock and
arrivals fed by hand; what the reconciler would read and what the decision log says."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.live_tuner import LiveTuner
from controlplane.spec import resolve_spec, validate_spec
from controlplane.store import AppRecord, Store

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
APP = "recs"
# tiny: 20 ms per query on emu.cpu.small (mu 50 qps), 10 ms on emu.cpu.large (mu 100 qps).
PROFILES = {
    "format": "heteroplane.profiles/v1",
    "profiles": [
        {"model": "tiny", "instance_type": SMALL, "batch_sizes": [1], "latency_ms": [[20.0]]},
        {"model": "tiny", "instance_type": LARGE, "batch_sizes": [1], "latency_ms": [[10.0]]},
    ],
}


def spec(folder: Path, budget: float) -> dict[str, Any]:
    (folder / "profiles.json").write_text(json.dumps(PROFILES))
    return {
        "name": APP,
        "models": [{"name": "tiny", "profiles": str(folder / "profiles.json")}],
        "slo": {"latency_ms": 100},
        "budget_usd_per_hr": budget,
        "instance_types": [SMALL],
    }


def plan_document(count: int, rate_qps: float) -> dict[str, Any]:
    return {
        "feasible": True,
        "cost_usd_per_hr": 0.05 * count,
        "stages": [
            {
                "name": "tiny",
                "fleet": {SMALL: count},
                "batch_size": 1,
                "predicted_p99_ms": 50.0,
                "throughput_qps": 50.0 * count,
                "policy": "fcfs",
            }
        ],
        "planned_rate_qps": rate_qps,
        "steps": [],
    }


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    opened = Store.from_url(url, FakeClock())
    yield opened
    opened.close()


def steady(rate_qps: float, start_s: float, end_s: float) -> np.ndarray:
    return start_s + np.arange(int((end_s - start_s) * rate_qps)) / rate_qps


class Feed:
    """The arrivals the serving loop would have seen, settable by the test."""

    def __init__(self) -> None:
        self.arrival_s = np.empty(0)

    def __call__(self, app: str) -> np.ndarray:
        assert app == APP
        return self.arrival_s


def live_tuner(store: Store, clock: FakeClock, feed: Feed) -> LiveTuner:
    def resolve(app: AppRecord) -> Any:
        return resolve_spec(validate_spec(app.spec))

    return LiveTuner(store, clock, feed, resolve)


def applied(store: Store, folder: Path, count: int, rate_qps: float, budget: float) -> AppRecord:
    store.create_app(spec(folder, budget), who="test")
    plan = store.create_plan(APP, plan_document(count, rate_qps))
    store.apply_plan(APP, plan.id)
    return store.get_app(APP)


def test_a_step_in_the_rate_scales_up_within_the_budget_and_back_down(
    store: Store, tmp_path: Path
) -> None:
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)  # 10 x 0.05 at most
    tuner = live_tuner(store, clock, feed)
    assert tuner.desired_fleet(app) == {SMALL: 2}  # the plan's, before the first tick

    feed.arrival_s = steady(50.0, 940.0, 1000.0)  # the planned rate: nothing to do
    assert tuner.tick() == []
    assert tuner.desired_fleet(app) == {SMALL: 2}

    clock.advance(60.0)
    feed.arrival_s = steady(256.0, 1000.0, 1060.0)  # a step to five times the plan
    made = tuner.tick()
    assert next(d.action for _, d in made) == "scale_up"
    grown = tuner.desired_fleet(app)[SMALL]
    assert 2 < grown <= 10  # more instances, never past the budget's 10
    kinds = [d.kind for d in store.list_decisions(APP)]
    assert "scale_up" in kinds

    clock.advance(120.0)
    feed.arrival_s = steady(16.0, 1120.0, 1180.0)  # quiet again, long after the last change
    made = tuner.tick()
    assert [d.action for _, d in made] == ["scale_down"]
    assert tuner.desired_fleet(app)[SMALL] < grown
    reasons = [d.reason for d in store.list_decisions(APP) if d.kind == "scale_down"]
    assert reasons and "since the last change" in reasons[-1]


def test_the_budget_cap_is_recorded_once_while_it_binds(store: Store, tmp_path: Path) -> None:
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.15)  # 3 x 0.05 at most
    tuner = live_tuner(store, clock, feed)
    for _ in range(5):
        clock.advance(1.0)
        now = clock.now_s()
        feed.arrival_s = steady(512.0, now - 60.0, now)
        tuner.tick()
    assert tuner.desired_fleet(app)[SMALL] <= 3
    capped = [d for d in store.list_decisions(APP) if d.kind == "budget_capped"]
    assert len(capped) == 1
    assert "budget" in capped[0].reason


def test_a_new_plan_restarts_the_tuner_from_its_fleet(store: Store, tmp_path: Path) -> None:
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=1.0)
    tuner = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    tuner.tick()
    assert tuner.desired_fleet(app)[SMALL] > 2
    plan = store.create_plan(APP, plan_document(4, 200.0))
    store.apply_plan(APP, plan.id)
    app = store.get_app(APP)
    assert tuner.desired_fleet(app) == {SMALL: 4}  # the new plan's until the tuner runs on it


def test_an_app_without_a_plan_wants_nothing(store: Store, tmp_path: Path) -> None:
    store.create_app(spec(tmp_path, 1.0), who="test")
    tuner = live_tuner(store, FakeClock(), Feed())
    assert tuner.tick() == []
    assert tuner.desired_fleet(store.get_app(APP)) == {}


def test_an_app_nobody_observes_stays_on_its_plan(store: Store, tmp_path: Path) -> None:
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=1.0)

    def unobserved(name: str) -> None:
        return None

    tuner = LiveTuner(
        store, FakeClock(start_s=1000.0), unobserved, lambda a: resolve_spec(validate_spec(a.spec))
    )
    assert tuner.tick() == []
    assert tuner.desired_fleet(app) == {SMALL: 2}
    assert store.list_decisions(APP) == [] or all(
        d.kind not in ("scale_up", "scale_down") for d in store.list_decisions(APP)
    )
