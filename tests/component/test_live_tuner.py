"""The tuner on live traffic: a real store (SQLite through the migrations), a fake clock and
arrivals fed by hand; what the reconciler would read and what the decision log says.

The tests of InferLine's arithmetic (and of the planned envelope) run the tuner with
``model="inferline"``; the load model's tests at the end hold its curve builds in a queue they
run by hand, so that "not ready yet" and "ready" are steps of the test, not races."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.apps.resolver import scaled_profiles
from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db.store import AppRecord, Store
from controlplane.loops.live_tuner import LiveTuner, plan_capacity_curve
from controlplane.policies.capacity_curve import LOAD_MODEL_RECENT_S
from controlplane.policies.sizing import SizingLadder
from controlplane.policies.tuner import TunerConfig, planning_envelope
from controlplane.spec import resolve_spec, validate_spec
from estimator.envelope import DEFAULT_MAX_WINDOW_S, tuner_windows_s
from tests.dying_writes import decision_write_fails

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
    """The tuner with InferLine's model (one provisioning ratio, a 60 s live envelope)."""
    return LiveTuner(store, clock, feed, resolve, model="inferline")


def resolve(app: AppRecord) -> Any:
    return resolve_spec(validate_spec(app.spec))


def applied(
    store: Store, folder: Path, count: int, rate_qps: float, budget: float, **extra: Any
) -> AppRecord:
    """The app with a plan of ``count`` small instances at ``rate_qps`` applied; ``extra`` keys
    join the plan document (an ``envelope``)."""
    store.create_app(spec(folder, budget), who="test")
    plan = store.create_plan(APP, {**plan_document(count, rate_qps), **extra})
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


def test_an_app_deleted_during_the_tick_is_skipped_and_the_others_go_on(
    store: Store, tmp_path: Path
) -> None:
    """A teardown's delete between the tick's read of the apps and its decision failed the
    whole tick with NotFoundError's traceback (a tester's app down under load), and with it
    every other app's scaling in that tick."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)  # five times the plan: a decision to record
    store.delete_app(APP, force=True)
    assert tuner.tick([app]) == []


def test_a_decision_is_in_the_log_before_the_reconciler_can_act_on_it(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciler runs on another thread and reads ``desired_fleet``: while the tuner writes
    its scale-up, the fleet the reconciler sees is still the old one (else a launch could be
    logged before the decision that caused it)."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = live_tuner(store, clock, feed)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    tuner.tick()
    seen: list[dict[str, int]] = []
    record = store.record_decisions  # the tick's decisions, in one transaction

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(dict(tuner.desired_fleet(app)))
        return record(*args, **kwargs)

    monkeypatch.setattr(store, "record_decisions", recording)
    clock.advance(60.0)
    feed.arrival_s = steady(256.0, 1000.0, 1060.0)
    made = tuner.tick()
    assert [d.action for _, d in made][:1] == ["scale_up"]
    assert seen and all(fleet == {SMALL: 2} for fleet in seen)
    assert tuner.desired_fleet(app)[SMALL] > 2  # and right after, the new fleet


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


def test_a_restarted_tuner_starts_from_the_fleet_it_had_reached(
    store: Store, tmp_path: Path
) -> None:
    # A restarted loops process set the tuner up from the plan's fleet: under load its
    # reconciler drained what the tuner had grown (and the tuner then grew it again).
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=1.0)
    before = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    assert any(d.action == "scale_up" for _, d in before.tick())
    reached = before.desired_fleet(app)
    assert reached[SMALL] > 2

    clock.advance(1.0)
    restarted = live_tuner(store, clock, feed)
    assert restarted.desired_fleet(app) == reached  # the reconciler's first pass, before a tick
    feed.arrival_s = steady(256.0, 941.0, 1001.0)
    made = restarted.tick()
    assert not any(d.action == "scale_down" for _, d in made)
    assert restarted.desired_fleet(app)[SMALL] >= reached[SMALL]

    # A plan applied since is the tuner's start, as ever.
    plan = store.create_plan(APP, plan_document(3, 150.0))
    store.apply_plan(APP, plan.id)
    app = store.get_app(APP)
    assert live_tuner(store, clock, feed).desired_fleet(app) == {SMALL: 3}


def test_a_restarted_tuner_starts_from_the_plan_where_the_budget_was_cut_below_its_fleet(
    store: Store, tmp_path: Path
) -> None:
    """The budget was cut below the fleet the tuner had reached while no tuner ran (the loops
    process down): the restarted one starts from the plan's fleet, not from what the budget no
    longer pays for (its first tick would shed it with a budget_capped, the reconciler before
    it would be asked for a fleet past the budget)."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=1.0)
    before = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    made = [d for _, d in before.tick() if d.action == "scale_up"]
    assert made and before.desired_fleet(app)[SMALL] > 2
    reached_cost = made[-1].cost_usd_per_hr_after
    later = store.list_decisions(APP, kinds=["scale_up"])[-1].at + timedelta(seconds=1)
    # A cut that still pays for the fleet reached keeps it.
    store.change_budget(APP, reached_cost + 0.001, reason="cut", who="test", at=later)
    app = store.get_app(APP)
    assert live_tuner(store, clock, feed).desired_fleet(app) == before.desired_fleet(app)
    # One below it does not, and a raise after the cut does not bring it back.
    store.change_budget(APP, reached_cost - 0.001, reason="cut", who="test", at=later)
    store.change_budget(APP, 1.0, reason="raised again", who="test", at=later)
    app = store.get_app(APP)
    clock.advance(1.0)
    restarted = live_tuner(store, clock, feed)
    assert restarted.desired_fleet(app) == {SMALL: 2}
    feed.arrival_s = steady(256.0, 941.0, 1001.0)
    restarted.tick()
    assert not store.list_decisions(APP, kinds=["budget_capped"])


def test_a_tuner_back_from_infaas_on_the_same_plan_starts_from_the_plan(
    store: Store, tmp_path: Path
) -> None:
    """The app moved to the INFaaS scaler and back on the same plan: the INFaaS scaler has
    moved the fleet since the tuner's last decision, so a tuner set up afresh starts from the
    plan's fleet, not from the fleet it had reached before the move."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=1.0)
    before = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    assert any(d.action == "scale_up" for _, d in before.tick())
    assert live_tuner(store, clock, feed).desired_fleet(app)[SMALL] > 2
    plan_id = store.get_app(APP).applied_plan_id
    store.record_decision(
        APP, "infaas_drain", "drained one", {"plan_id": plan_id, "fleet_after": {SMALL: 1}}
    )
    assert live_tuner(store, clock, feed).desired_fleet(app) == {SMALL: 2}


def test_an_app_without_a_plan_wants_nothing(store: Store, tmp_path: Path) -> None:
    store.create_app(spec(tmp_path, 1.0), who="test")
    tuner = live_tuner(store, FakeClock(), Feed())
    assert tuner.tick() == []
    assert tuner.desired_fleet(store.get_app(APP)) == {}


def test_an_app_nobody_observes_stays_on_its_plan(store: Store, tmp_path: Path) -> None:
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=1.0)

    def unobserved(name: str) -> None:
        return None

    tuner = LiveTuner(store, FakeClock(start_s=1000.0), unobserved, resolve)
    assert tuner.tick() == []
    assert tuner.desired_fleet(app) == {SMALL: 2}
    assert store.list_decisions(APP) == [] or all(
        d.kind not in ("scale_up", "scale_down") for d in store.list_decisions(APP)
    )


# --- the planned envelope from the plan document ------------------------------------------------

# The proxy's windows for this app: tiny serves in ms, so the ladder starts at the 1 s floor.
PROXY_WINDOWS = len(tuner_windows_s(1.0))


def flat_envelope(rate_qps: float, windows_s: tuple[float, ...] = (1.0, 3.0, 60.0)) -> Any:
    """A planned envelope of ``rate_qps`` at every window; the windows are not the tuner's own
    ladder, so a reason's window count says whose envelope the tuner used."""
    return {"windows_s": list(windows_s), "rate_qps": [rate_qps] * len(windows_s)}


def reasons(store: Store, kind: str) -> list[str]:
    return [d.reason for d in store.list_decisions(APP) if d.kind == kind]


def test_a_planned_envelope_above_the_live_rate_keeps_the_plan(
    store: Store, tmp_path: Path
) -> None:
    # 256 qps against a plan at 50 qps: the Poisson proxy scales up (the first test); an
    # envelope that planned for 300 qps at every window does not.
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, 2, 50.0, 0.5, envelope=flat_envelope(300.0))
    tuner = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    assert tuner.tick() == []
    assert tuner.desired_fleet(app) == {SMALL: 2}


@pytest.mark.parametrize(("max_window_s", "windows"), [(60.0, 3), (10.0, 2)])
def test_a_planned_envelope_below_the_live_rate_scales_up_on_its_windows(
    store: Store, tmp_path: Path, max_window_s: float, windows: int
) -> None:
    # The planned rate itself, 50 qps, leaves the proxy's plan alone (the first test); an
    # envelope of 20 qps is exceeded at each of its windows up to the tuner's longest.
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, 2, 50.0, 0.5, envelope=flat_envelope(20.0))
    tuner = LiveTuner(
        store,
        clock,
        feed,
        resolve,
        max_window_s=max_window_s,
        model="inferline",
    )
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    made = tuner.tick()
    assert [d.action for _, d in made] == ["scale_up"]
    assert tuner.desired_fleet(app)[SMALL] > 2
    (reason,) = reasons(store, "scale_up")
    assert f"> planned 20 qps ({windows} of {windows} windows over)" in reason


@pytest.mark.parametrize(
    "envelope",
    [
        [1.0, 60.0],
        {"windows_s": [1.0, 60.0]},
        {"windows_s": [1.0, 60.0], "rate_qps": [300.0]},
        {"windows_s": [], "rate_qps": []},
        {"windows_s": "1, 60", "rate_qps": [300.0, 300.0]},
        {"windows_s": ["1", 60.0], "rate_qps": [300.0, 300.0]},
        {"windows_s": [True, 60.0], "rate_qps": [300.0, 300.0]},
        {"windows_s": [0.0, 60.0], "rate_qps": [300.0, 300.0]},
        {"windows_s": [1.0, 60.0], "rate_qps": [-300.0, 300.0]},
        {"windows_s": [1.0, 60.0], "rate_qps": [300.0, 10**400]},  # the store refuses inf
        {"windows_s": [60.0, 1.0], "rate_qps": [300.0, 300.0]},
        {"windows_s": [120.0, 240.0], "rate_qps": [300.0, 300.0]},
    ],
    ids=[
        "a list",
        "no rates",
        "lengths differ",
        "empty",
        "a string",
        "a string window",
        "a bool window",
        "a zero window",
        "a negative rate",
        "a huge int",
        "decreasing windows",
        "windows past the longest",
    ],
)
def test_a_malformed_envelope_falls_back_to_the_poisson_proxy(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture, envelope: Any
) -> None:
    # Each would keep the plan at 256 qps if it were read as 300 qps (the test above); the proxy
    # at the planned 50 qps scales up on its own windows instead.
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, 2, 50.0, 0.5, envelope=envelope)
    tuner = live_tuner(store, clock, feed)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    with caplog.at_level(logging.WARNING, logger="controlplane.loops.live_tuner"):
        made = tuner.tick()
    assert [d.action for _, d in made] == ["scale_up"]
    assert tuner.desired_fleet(app)[SMALL] > 2
    (reason,) = reasons(store, "scale_up")
    assert f"of {PROXY_WINDOWS} windows over" in reason
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "envelope is not usable" in warning and "Poisson" in warning


@pytest.mark.parametrize("budget_too", [False, True], ids=["alone", "with a budget change"])
def test_a_recalibrated_profile_reaches_the_tuner_at_its_next_tick(
    store: Store, tmp_path: Path, budget_too: bool
) -> None:
    """After calibration found tiny twice as slow as profiled, the same traffic needs twice the
    instances: the tuner takes the new profile at its next tick, from the fleet it had; also
    when the budget changed before the same tick (the budget's branch took the tick, and the
    recalibration was lost)."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    factors: dict[tuple[str, str], float] = {}

    def recalibrated(record: AppRecord) -> Any:
        return scaled_profiles(resolve_spec(validate_spec(record.spec)), factors)

    tuner = LiveTuner(store, clock, feed, recalibrated, model="inferline")
    feed.arrival_s = steady(50.0, 940.0, 1000.0)  # the planned rate: nothing to do
    assert tuner.tick() == []
    assert tuner.desired_fleet(app) == {SMALL: 2}

    factors[("tiny", SMALL)] = 2.0  # what the calibrator stored: 40 ms per query, not 20
    clock.advance(5.0)
    feed.arrival_s = steady(50.0, 945.0, 1005.0)
    assert tuner.tick() == []  # not told yet: the profile it set up with still holds
    tuner.recalibrate(APP)
    if budget_too:
        store.change_budget(APP, 0.45, reason="test", who="test")
    clock.advance(5.0)
    feed.arrival_s = steady(50.0, 950.0, 1010.0)
    made = tuner.tick()
    assert [d.action for _, d in made][:1] == ["scale_up"]
    assert tuner.desired_fleet(store.get_app(APP))[SMALL] > 2


def test_a_recalibration_keeps_what_the_load_needs_of_a_plan_far_over_it(
    store: Store, tmp_path: Path
) -> None:
    """A plan of one instance far over its load (2 qps on an instance serving 50) does not keep
    all its capacity in qps after a drift: found 4x as slow (12.5 qps), the instance still
    carries the load many times over, and the tuner buys nothing. Live, an app planned at 5 qps
    on an instance serving 2,300 drifted 4x at its first queries and bought three more."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    applied(store, tmp_path, count=1, rate_qps=2.0, budget=0.5)
    factors: dict[tuple[str, str], float] = {}

    def recalibrated(record: AppRecord) -> Any:
        return scaled_profiles(resolve_spec(validate_spec(record.spec)), factors)

    tuner = LiveTuner(store, clock, feed, recalibrated, model="inferline")
    feed.arrival_s = steady(2.0, 940.0, 1000.0)
    assert tuner.tick() == []
    factors[("tiny", SMALL)] = 4.0  # 80 ms per query, not 20
    tuner.recalibrate(APP)
    for step in range(1, 13):
        clock.advance(5.0)
        feed.arrival_s = steady(2.0, 940.0 + 5 * step, 1000.0 + 5 * step)
        tuner.tick()
    assert reasons(store, "scale_up") == []
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 1}


def recalibrated_tuner(
    store: Store, tmp_path: Path, count: int, rate_qps: float
) -> tuple[LiveTuner, FakeClock, Feed, dict[tuple[str, str], float]]:
    """An InferLine tuner on a plan of ``count`` small instances at ``rate_qps``, its first tick
    taken at the planned rate; set a factor in the returned dict and call ``recalibrate``."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    applied(store, tmp_path, count=count, rate_qps=rate_qps, budget=0.5)
    factors: dict[tuple[str, str], float] = {}

    def recalibrated(record: AppRecord) -> Any:
        return scaled_profiles(resolve_spec(validate_spec(record.spec)), factors)

    tuner = LiveTuner(store, clock, feed, recalibrated, model="inferline")
    feed.arrival_s = steady(rate_qps, 940.0, 1000.0)
    assert tuner.tick() == []
    return tuner, clock, feed, factors


def serve_a_minute(tuner: LiveTuner, clock: FakeClock, feed: Feed, rate_qps: float) -> None:
    for _ in range(12):
        clock.advance(5.0)
        now = clock.now_s()
        feed.arrival_s = steady(rate_qps, now - 60.0, now)
        tuner.tick()


def test_instances_found_slower_never_leave_fewer_of_them_for_the_planned_load(
    store: Store, tmp_path: Path
) -> None:
    """Two instances planned at rho 0.38 (a planned peak of 38 qps on 100) keep the planned
    load on both. Found 10% slower, the whole-instance headroom (0.54) was taken at once, and
    the tuner stopped one of the two slower instances at the planned load: a stage sized by
    its load keeps its rho_m."""
    tuner, clock, feed, factors = recalibrated_tuner(store, tmp_path, count=2, rate_qps=20.0)
    serve_a_minute(tuner, clock, feed, 20.0)
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 2}
    factors[("tiny", SMALL)] = 1.1
    tuner.recalibrate(APP)
    serve_a_minute(tuner, clock, feed, 20.0)
    assert reasons(store, "scale_down") == []
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 2}


def test_a_stage_sized_by_its_load_found_slower_gets_back_its_capacity_in_qps(
    store: Store, tmp_path: Path
) -> None:
    """Four instances of 50 qps planned at 80 qps: found 3x slower, the stage is given back its
    capacity in qps (200) at the plan's headroom, as InferLine keeps rho_m, and the tuner buys
    back what the planned load needs at it. The whole-instance headroom of a plan far over its
    load, taken here too, gave back less (a higher rho_m for slower instances, whose queues
    leave less of the SLO: eight instances at the planned load where the plan's rho_m needs
    nine)."""
    tuner, clock, feed, factors = recalibrated_tuner(store, tmp_path, count=4, rate_qps=80.0)
    factors[("tiny", SMALL)] = 3.0
    tuner.recalibrate(APP)
    feed.arrival_s = steady(80.0, clock.now_s() - 60.0, clock.now_s())
    tuner.tick()
    (bought,) = reasons(store, "scale_up")
    assert f"planned capacity {4 * 50:g} qps" in bought, bought  # the plan's, in qps
    rho = float(bought.split(" rho ")[1].split(",")[0])
    need = float(bought.split("need ")[1].split(" qps")[0])
    assert need == pytest.approx(80.0 / rho, rel=1e-3), bought  # the planned load at rho_m
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: math.ceil(need / (50 / 3) - 1e-9)}


def test_the_same_profiles_recalibrated_again_change_nothing(store: Store, tmp_path: Path) -> None:
    """A second and a third recalibration on the profiles the first one took (another model's
    drift, a finer calibration) keep the stage as the first left it, set-up and ticks: each had
    taken the last stage's whole-instance headroom as the plan's and raised it, until the tuner
    stopped one of the instances it had at the same load."""
    tuner, clock, feed, factors = recalibrated_tuner(store, tmp_path, count=2, rate_qps=20.0)
    factors[("tiny", SMALL)] = 2.0
    tuner.recalibrate(APP)
    serve_a_minute(tuner, clock, feed, 20.0)
    first = tuner.desired_fleet(store.get_app(APP))
    assert first[SMALL] >= 2  # slower instances, never fewer of them for the same load
    moved = len(reasons(store, "scale_down")) + len(reasons(store, "scale_up"))
    for _ in range(2):
        tuner.recalibrate(APP)
        assert tuner.desired_fleet(store.get_app(APP)) == first  # the set-up keeps it
        serve_a_minute(tuner, clock, feed, 20.0)
        assert tuner.desired_fleet(store.get_app(APP)) == first
    assert len(reasons(store, "scale_down")) + len(reasons(store, "scale_up")) == moved


def test_a_recalibration_keeps_a_type_the_spec_no_longer_lists_off_the_fleet(
    store: Store, tmp_path: Path
) -> None:
    """A spec that no longer lists the plan's type caps it at 0 (the planner's rule) and the
    tuner sheds it to one; a recalibration, which sets the app up again, lost that cap, and the
    tuner bought the type again on the slower profile."""
    tuner, clock, feed, factors = recalibrated_tuner(store, tmp_path, count=2, rate_qps=50.0)
    changed = {**store.get_app(APP).spec, "instance_types": [LARGE]}
    store.update_app(APP, changed, who="test")
    serve_a_minute(tuner, clock, feed, 50.0)
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 1}
    factors[("tiny", SMALL)] = 2.0
    tuner.recalibrate(APP)
    serve_a_minute(tuner, clock, feed, 50.0)
    assert reasons(store, "scale_up") == []
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 1}


def test_a_recalibration_keeps_a_type_the_tuner_added_beyond_the_plan(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sizing model had added an emu.cpu.large to a plan of emu.cpu.small; a drift then
    set the app up again on the plan's types, kept the fleet with the large in it, and every
    tick after failed on its rate ("tuner: app left on its plan: 'emu.cpu.large'", 299 times in
    5 minutes, no scaling until a restart). The fresh set-up knows every type of the fleet it
    keeps; and a restart starts from a reached fleet that holds such a type."""
    clock, feed = FakeClock(start_s=1000.0), Feed()
    reached_a_mix(store, tmp_path)
    factors: dict[tuple[str, str], float] = {}

    def recalibrated(record: AppRecord) -> Any:
        return scaled_profiles(resolve_spec(validate_spec(record.spec)), factors)

    tuner = LiveTuner(store, clock, feed, recalibrated, model="inferline")
    app = store.get_app(APP)
    assert tuner.desired_fleet(app) == {SMALL: 2, LARGE: 1}  # restarted from what it reached
    feed.arrival_s = steady(150.0, 940.0, 1000.0)
    with caplog.at_level(logging.WARNING, logger="controlplane.loops.live_tuner"):
        tuner.tick()
        factors[("tiny", LARGE)] = 2.0  # the large twice as slow as profiled
        tuner.recalibrate(APP)
        for step in range(1, 4):
            clock.advance(5.0)
            feed.arrival_s = steady(150.0, 940.0 + 5 * step, 1000.0 + 5 * step)
            tuner.tick()
    assert not [r for r in caplog.records if "left on its plan" in r.getMessage()]
    assert tuner.desired_fleet(store.get_app(APP)).get(LARGE, 0) >= 1


def reached_a_mix(store: Store, folder: Path) -> None:
    """The app on a plan of two emu.cpu.small, and in the log what the sizing model's scale-up
    left: two small and a large (0.2 USD/hr), which a restarted tuner starts from."""
    from controlplane.loops.live_tuner import FLEETS_AFTER
    from controlplane.loops.reached import PLAN_ID

    store.create_app({**spec(folder, 0.5), "instance_types": [SMALL, LARGE]}, who="test")
    plan = store.create_plan(APP, plan_document(2, 50.0))
    store.apply_plan(APP, plan.id)
    store.record_decision(
        APP,
        "scale_up",
        "the sizing model's fleet",
        {PLAN_ID: plan.id, FLEETS_AFTER: {"tiny": {SMALL: 2, LARGE: 1}},
         "cost_usd_per_hr_after": 0.2},
    )  # fmt: skip


def test_a_mix_reached_on_a_one_type_plan_is_measured_as_it_is_dispatched(
    store: Store, tmp_path: Path
) -> None:
    """Restarted from a fleet of two small and a large (the sizing model's) on a plan of smalls
    (FCFS, the single-type rule): the live dispatcher serves the mix by Kairos' matching (the
    planner's rule for a mix), so InferLine's model measures the stage's capacity by the Kairos
    bound, as for a plan that places the mix. It took the plan's FCFS and summed the rates."""
    reached_a_mix(store, tmp_path)
    clock, feed = FakeClock(start_s=1000.0), Feed()
    tuner = LiveTuner(store, clock, feed, resolve, model="inferline")
    feed.arrival_s = steady(100.0, 940.0, 1000.0)
    tuner.tick()
    (stage,) = tuner.stages(APP)
    assert set(stage.rate_per_instance_qps) == {SMALL, LARGE}
    assert stage.capacity_model is not None


def test_a_tick_that_cannot_size_the_app_is_a_decision_and_the_next_sets_it_up_again(
    store: Store, tmp_path: Path
) -> None:
    """A state the tuner could not size (a type its stages do not rate: here put there by hand)
    failed every tick, a warning a second and no sign in the app's events, until a restart. It
    is one ``tuner_failed`` decision now, and the next tick sets the app up again from its
    plan, which scales as ever."""
    import dataclasses

    from estimator.fleet import Fleet

    clock, feed = FakeClock(start_s=1000.0), Feed()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = live_tuner(store, clock, feed)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    assert tuner.tick() == []
    tuned = tuner._apps[APP]
    tuned.state = dataclasses.replace(
        tuned.state, fleets={"tiny": Fleet.of({SMALL: 2, "emu.cpu.ghost": 1})}
    )
    for step in (1, 2):
        clock.advance(1.0)
        feed.arrival_s = steady(50.0, 940.0 + step, 1000.0 + step)
        tuner.tick()
    (failed,) = store.list_decisions(APP, kinds=["tuner_failed"])
    assert "the tuner cannot size the app: no rate or price for 'emu.cpu.ghost'" in failed.reason
    assert failed.count == 1
    clock.advance(60.0)
    feed.arrival_s = steady(256.0, 1002.0, 1062.0)  # five times the plan: it scales again
    made = tuner.tick()
    assert next(d.action for _, d in made) == "scale_up"
    assert tuner.desired_fleet(app)[SMALL] > 2


def test_a_recalibration_sets_the_app_up_without_computing_the_planning_envelope_again(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Poisson proxy's envelope (600 s of arrivals at the planned rate: millions at
    thousands of q/s) is computed once per rate, not at every set-up: a recalibration that sets
    the app up again took the tick, which shares the serving loop's interpreter, hundreds of
    milliseconds at 2,000 q/s."""
    from controlplane.loops import live_tuner as module

    computed: list[int] = []
    real = planning_envelope

    def counted(arrivals: Any, service_time_s: float, max_window_s: float) -> Any:
        computed.append(len(arrivals))
        return real(arrivals, service_time_s, max_window_s)

    monkeypatch.setattr(module, "planning_envelope", counted)
    module.synthetic_planning_envelope.cache_clear()
    clock, feed = FakeClock(start_s=1000.0), Feed()
    applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = live_tuner(store, clock, feed)
    for step in range(3):
        feed.arrival_s = steady(50.0, 940.0 + step, 1000.0 + step)
        tuner.tick()
        tuner.recalibrate(APP)
        clock.advance(1.0)
    assert len(computed) == 1  # three set-ups, one envelope
    # It is the envelope the tuner's config computes from the planning trace itself.
    catalog = resolve_spec(validate_spec(store.get_app(APP).spec)).catalog
    direct = TunerConfig.from_planning_trace(
        module.synthetic_planning_arrivals(50.0), 0.02, budget_usd_per_hr=1.0, catalog=catalog
    )
    assert module.synthetic_planning_envelope(50.0, 0.02, DEFAULT_MAX_WINDOW_S) == (
        direct.windows_s,
        direct.planned_rate_qps,
    )


# --- the load model ------------------------------------------------------------------------------


class Worker:
    """The curve builds the tuner hands off, run when the test says."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] = []

    def __call__(self, work: Callable[[], None]) -> None:
        self.queued.append(work)

    def run(self) -> None:
        queued, self.queued = self.queued, []
        for work in queued:
            work()


CURVE = ((0.5, 0.6), (1.0, 1.0), (2.0, 1.6))


def counted(built: list[int]) -> Callable[[Any, Any], Any]:
    """A curve builder that gives :data:`CURVE` and notes each plan id it builds for."""

    def build(app: Any, plan: Any) -> Any:
        built.append(plan.id)
        return CURVE

    return build


def decisions_of(store: Store, kind: str) -> list[Any]:
    return [d for d in store.list_decisions(APP) if d.kind == kind]


def step_up_and_down(tuner: LiveTuner, clock: FakeClock, feed: Feed) -> None:
    """Five times the plan for a minute, then quiet for four: a scale-up, then a scale-down."""
    clock.advance(60.0)
    feed.arrival_s = steady(256.0, 1000.0, 1060.0)
    tuner.tick()
    clock.advance(240.0)
    feed.arrival_s = steady(16.0, 1060.0, 1300.0)
    tuner.tick()


def test_the_load_model_waits_for_its_curve_off_the_tick_and_then_decides(
    store: Store, tmp_path: Path
) -> None:
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()
    built: list[int] = []
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    # A memory other than InferLine's 60 s, so that the scale-down's reason shows whose it read.
    tuner = LiveTuner(
        store,
        clock,
        feed,
        resolve,
        build_curve=counted(built),
        submit=worker,
        load_model_recent_s=2 * LOAD_MODEL_RECENT_S,
    )
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    tuner.tick()
    # The build was handed off, not run in the tick: InferLine's model decided meanwhile.
    assert len(worker.queued) == 1 and built == []
    (up,) = decisions_of(store, "scale_up")
    assert up.numbers["model"] == "inferline"
    assert "being built" in up.numbers["model_note"]
    clock.advance(1.0)
    tuner.tick()
    assert len(worker.queued) == 1  # one build per plan, however many ticks wait for it

    worker.run()
    assert built == [app.applied_plan_id]
    store.apply_plan(APP, store.create_plan(APP, plan_document(2, 50.0)).id)  # a fresh start
    feed.arrival_s = steady(50.0, 941.0, 1001.0)  # the planned rate: nothing to decide
    assert tuner.tick() == []
    assert len(worker.queued) == 1  # the new plan gets its own curve
    worker.run()
    before = len(decisions_of(store, "scale_up"))
    step_up_and_down(tuner, clock, feed)
    ups, downs = decisions_of(store, "scale_up")[before:], decisions_of(store, "scale_down")
    assert ups and downs
    for decision in (*ups, *downs):
        assert decision.numbers["model"] == "curve" and decision.numbers["model_note"] is None
    assert "the planner's capacity at that load" in ups[-1].reason
    # The load model's scale-down memory: the live envelope over its own span, not 60 s.
    assert f"over the last {2 * LOAD_MODEL_RECENT_S:g} s" in downs[-1].reason


@pytest.mark.parametrize(
    ("factor", "meanwhile"),
    [(0.5, "curve"), (2.0, "inferline")],
    ids=["faster instances: the old curve", "slower ones: InferLine's model on the new rates"],
)
def test_a_recalibration_builds_the_curve_again_and_sizes_safely_meanwhile(
    store: Store, tmp_path: Path, factor: float, meanwhile: str
) -> None:
    """A recalibration plans the curve again on the new profiles. Meanwhile, on instances no
    slower than planned, the old curve sizes the stage (InferLine's model in between would buy
    what the curve had found unneeded); on slower ones, InferLine's model on the new rates does
    (the old curve would provision too little)."""
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()
    built: list[int] = []
    factors: dict[tuple[str, str], float] = {}

    def recalibrated(record: AppRecord) -> Any:
        return scaled_profiles(resolve_spec(validate_spec(record.spec)), factors)

    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = LiveTuner(store, clock, feed, recalibrated, build_curve=counted(built), submit=worker)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    assert tuner.tick() == []
    worker.run()
    assert tuner.tick() == []
    (stage,) = tuner.stages(APP)
    assert stage.model == "curve" and stage.rate_per_instance_qps[SMALL] == pytest.approx(50.0)

    factors[("tiny", SMALL)] = factor  # 10 or 40 ms per query, not 20
    tuner.recalibrate(APP)
    clock.advance(60.0)
    feed.arrival_s = steady(256.0, 1000.0, 1060.0)
    tuner.tick()
    assert len(worker.queued) == 1  # the curve is built again, off the tick
    (stage,) = tuner.stages(APP)
    assert stage.model == meanwhile
    old_or_new = 50.0 if meanwhile == "curve" else 50.0 / factor
    assert stage.rate_per_instance_qps[SMALL] == pytest.approx(old_or_new)
    ups = decisions_of(store, "scale_up")
    assert ups and all(d.numbers["model"] == meanwhile for d in ups)

    worker.run()
    assert built == [app.applied_plan_id] * 2
    clock.advance(1.0)
    tuner.tick()
    (stage,) = tuner.stages(APP)
    assert stage.model == "curve"  # the new curve, on the recalibrated profile
    assert stage.rate_per_instance_qps[SMALL] == pytest.approx(50.0 / factor)


def test_a_budget_change_builds_the_curve_again_and_keeps_the_fleet_reached(
    store: Store, tmp_path: Path
) -> None:
    """The load model's curve is per (plan, budget): a budget change builds it again, off the
    tick; meanwhile the old one sizes the stage under the new budget, and the fleet the tuner
    reached stays (it was set up from the plan's again)."""
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()
    built: list[int] = []
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = LiveTuner(store, clock, feed, resolve, build_curve=counted(built), submit=worker)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    assert tuner.tick() == []
    worker.run()
    clock.advance(60.0)
    feed.arrival_s = steady(256.0, 1000.0, 1060.0)
    tuner.tick()
    reached = tuner.desired_fleet(store.get_app(APP))[SMALL]
    assert reached > 2

    store.change_budget(APP, 0.45, reason="test", who="test")
    clock.advance(1.0)
    feed.arrival_s = steady(256.0, 1001.0, 1061.0)
    tuner.tick()
    assert len(worker.queued) == 1  # built again for the new budget, off the tick
    (stage,) = tuner.stages(APP)
    assert stage.model == "curve"  # the old curve meanwhile
    assert tuner.desired_fleet(store.get_app(APP))[SMALL] == reached
    worker.run()
    assert built == [app.applied_plan_id] * 2
    clock.advance(1.0)
    tuner.tick()
    (stage,) = tuner.stages(APP)
    assert stage.model == "curve" and tuner.desired_fleet(store.get_app(APP))[SMALL] == reached


def test_without_its_curve_the_tuner_keeps_inferlines_model_and_says_why(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()

    def broken(app: Any, plan: Any) -> Any:
        raise ValueError("the planner places nothing")

    applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = LiveTuner(store, clock, feed, resolve, build_curve=broken, submit=worker)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    assert tuner.tick() == []
    with caplog.at_level(logging.WARNING, logger="controlplane.loops.live_tuner"):
        worker.run()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no capacity curve (the planner places nothing)" in warning
    assert "InferLine's model" in warning
    step_up_and_down(tuner, clock, feed)
    assert worker.queued == []  # a failed curve is not tried again for the same plan
    ups, downs = decisions_of(store, "scale_up"), decisions_of(store, "scale_down")
    assert ups and downs
    for decision in (*ups, *downs):
        assert decision.numbers["model"] == "inferline"
        assert decision.numbers["model_note"] == "no capacity curve: the planner places nothing"
    assert "over the last 60 s" in downs[-1].reason


def test_inferlines_model_when_asked_builds_no_curve(store: Store, tmp_path: Path) -> None:
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()
    applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = LiveTuner(store, clock, feed, resolve, model="inferline", submit=worker)
    step_up_and_down(tuner, clock, feed)
    assert worker.queued == []
    ups = decisions_of(store, "scale_up")
    assert ups and all(d.numbers["model"] == "inferline" for d in ups)
    assert all(d.numbers["model_note"] is None for d in ups)


@pytest.mark.parametrize(
    "extra",
    [{}, {"seed": 1, "trace": {"request": {"rate_qps": 50.0, "kind": "gamma", "cv2": 2.0}}}],
    ids=["a Poisson trace at the planned rate", "the trace request the API stored"],
)
def test_the_plans_capacity_curve_is_the_planners_on_its_planning_trace(
    store: Store, tmp_path: Path, extra: dict[str, Any]
) -> None:
    # The real builder, on the trace the plan names.
    applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5, **extra)
    record = store.get_applied_plan(APP)
    assert record is not None
    curve = plan_capacity_curve(resolve(store.get_app(APP)), record)
    assert [f for f, _ in curve] == [0.5, 0.75, 1.0, 1.25, 1.5, 2.0]
    assert dict(curve)[1.0] == 1.0
    assert [m for _, m in curve] == sorted(m for _, m in curve)


def test_a_cascade_keeps_inferlines_model_on_every_stage(store: Store, tmp_path: Path) -> None:
    cascade_app(store, tmp_path, budget=1.0)
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()
    tuner = LiveTuner(store, clock, feed, resolve, submit=worker)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    tuner.tick()
    assert worker.queued == []  # no curve is built for a cascade
    ups = decisions_of(store, "scale_up")
    assert {d.numbers["stage"] for d in ups} == {"tiny", "large"}
    for decision in ups:
        assert decision.numbers["model"] == "inferline"
        assert decision.numbers["model_note"] == "a cascade: InferLine's model per stage"


def test_a_tick_whose_second_decision_was_not_written_wrote_neither(
    store: Store, tmp_path: Path
) -> None:
    """A tick scales both stages of a cascade up, and the write of the second decision fails
    (the loops process dies there): neither is written, and the tuner started again scales both
    and says each once. Each decision was written in a transaction of its own, the first
    carrying the fleets after the whole tick (what a restarted tuner starts from): the second
    stage's instances were bought and never said."""
    cascade_app(store, tmp_path, budget=1.0)
    clock, feed = FakeClock(start_s=1000.0), Feed()
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    with decision_write_fails("s 0.5, rho") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            LiveTuner(store, clock, feed, resolve, submit=Worker()).tick()
        assert failing == []
    assert decisions_of(store, "scale_up") == []
    clock.advance(1.0)
    feed.arrival_s = steady(256.0, 941.0, 1001.0)
    restarted = LiveTuner(store, clock, feed, resolve, submit=Worker())
    assert [d.action for _, d in restarted.tick()] == ["scale_up", "scale_up"]
    ups = decisions_of(store, "scale_up")
    assert sorted(d.numbers["stage"] for d in ups) == ["large", "tiny"]


def create_cascade_app(
    store: Store, folder: Path, latency_ms: dict[str, float], budget: float
) -> None:
    """Creates the cascade app ``tiny`` -> ``large`` at a 100 ms SLO and ``budget`` USD/hr, both
    models profiled at ``latency_ms`` a query on each instance type it names (its types)."""
    profiles = {
        "format": "heteroplane.profiles/v1",
        "profiles": [
            {"model": m, "instance_type": t, "batch_sizes": [1], "latency_ms": [[ms]]}
            for m in ("tiny", "large")
            for t, ms in latency_ms.items()
        ],
    }
    (folder / "profiles.json").write_text(json.dumps(profiles))
    store.create_app(
        {
            "name": APP,
            "models": [
                {"name": m, "profiles": str(folder / "profiles.json")} for m in ("tiny", "large")
            ],
            "cascade": ["tiny", "large"],
            "slo": {"latency_ms": 100},
            "budget_usd_per_hr": budget,
            "instance_types": list(latency_ms),
        },
        who="test",
    )


def test_a_cascade_stages_kairos_bound_is_at_its_share_of_the_slo(
    store: Store, tmp_path: Path
) -> None:
    """A cascade whose stages share a 100 ms SLO 50/50 (their predicted P99s), the second a Kairos
    mix of a large (10 ms a query) and a small (60 ms): within its 50 ms the small serves no
    query, so the stage's capacity model, as the replay's InferLine model and the planner judge
    it, is the large's 100 qps. The live tuner's bound was at the whole SLO, where the small
    counted too (116.7 qps)."""
    create_cascade_app(store, tmp_path, {SMALL: 60.0, LARGE: 10.0}, budget=1.0)
    document = plan_document(1, 50.0)
    (first,) = document["stages"]
    mixed = {**first, "name": "large", "fleet": {SMALL: 1, LARGE: 1}, "policy": "kairos"}
    document["stages"] = [{**first, "fleet": {LARGE: 1}}, mixed]
    store.apply_plan(APP, store.create_plan(APP, document).id)
    tuner = LiveTuner(store, FakeClock(start_s=1000.0), Feed(), resolve, submit=Worker())
    tuner.tick()
    _tiny, large = tuner.stages(APP)
    assert large.capacity_model is not None
    assert large.capacity_model({SMALL: 1, LARGE: 1}) == pytest.approx(100.0)
    assert large.capacity_model({SMALL: 0, LARGE: 1}) == pytest.approx(100.0)


def batched_ladder(app: Any, plan: Any) -> SizingLadder:
    """A single stage's ladder whose lower rungs batch four queries (the planner's choice there:
    fewer instances, each batching more) and whose upper ones batch one."""
    rungs = ((0.5, {SMALL: 1}), (1.0, {SMALL: 2}), (2.0, {SMALL: 3}), (4.0, {SMALL: 5}))
    return SizingLadder(
        "tiny",
        rungs,
        {SMALL: 50.0},
        ((0.5, 0.5), (1.0, 1.0), (2.0, 1.5), (4.0, 2.5)),
        batches=((0.5, 4), (1.0, 4), (2.0, 1), (4.0, 1)),
    )


def test_a_single_stage_batches_as_its_ready_fleets_rung_says(store: Store, tmp_path: Path) -> None:
    # The replay serves a laddered stage with the batch of the rung its ready fleet reaches
    # (tuner.live_batch); the live tuner hands the same cap to the serving loop as the gear.
    clock, feed, worker = FakeClock(start_s=1000.0), Feed(), Worker()
    app = applied(store, tmp_path, count=2, rate_qps=50.0, budget=0.5)
    tuner = LiveTuner(store, clock, feed, resolve, build_curve=batched_ladder, submit=worker)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)
    tuner.tick()
    assert tuner.batch_caps() == {} and tuner.gear(APP) is None  # no ladder yet: the plan's
    worker.run()
    clock.advance(1.0)
    feed.arrival_s = steady(50.0, 941.0, 1001.0)
    assert tuner.tick() == []
    assert tuner.batch_caps() == {APP: {"tiny": 4}}  # two instances: the 1x rung's batch
    gear = tuner.gear(APP)
    assert gear is not None and gear.max_batch_queries == {"tiny": 4}
    assert gear.cascade.models == ("tiny",)
    clock.advance(1.0)
    tuner.tick()
    assert tuner.gear(APP) is gear  # the same cap, the same gear: the dispatcher keeps its place

    clock.advance(60.0)
    feed.arrival_s = steady(110.0, 1001.0, 1061.0)  # twice the plan and more, for a minute
    made = tuner.tick()
    assert [d.action for _, d in made] == ["scale_up"]
    assert tuner.desired_fleet(app)[SMALL] >= 3
    assert tuner.batch_caps() == {APP: {"tiny": 4}}  # the new instances still boot
    clock.advance(600.0)
    feed.arrival_s = steady(110.0, 1601.0, 1661.0)
    tuner.tick()
    assert tuner.batch_caps() == {APP: {"tiny": 1}}  # ready: the 2x rung's batch of one
    assert tuner.gear("another") is None


def cascade_app(store: Store, folder: Path, budget: float = 10.0, large: int = 2) -> None:
    """A two-model cascade planned at 50 qps on two small instances for ``tiny`` and ``large``
    for ``large``, which half the queries reach (its plan's scale factor), at ``budget``
    USD/hr."""
    create_cascade_app(store, folder, {SMALL: 20.0}, budget)
    document = plan_document(2, 50.0)
    (first,) = document["stages"]
    document["stages"] = [
        first,
        {**first, "name": "large", "scale_factor": 0.5, "fleet": {SMALL: large}},
    ]
    store.apply_plan(APP, store.create_plan(APP, document).id)


def reach_status(reach: float | None, samples: int) -> Any:
    """The serving loop's status of the cascade app: ``large`` reached by ``reach`` of the
    samples at the spec's thresholds, measured on ``samples``."""
    from controlplane.serving.dispatcher import AppStatus, StageStatus

    def stage(model: str, share: float | None) -> StageStatus:
        return StageStatus(model, 0, 0, 0, 100.0, "fcfs", 1, {}, reach=share, reach_samples=samples)

    return AppStatus(
        APP, "tiny@0.5 -> large", 100.0, (), (stage("tiny", None), stage("large", reach)), 0
    )


def large_after_a_step(store: Store, folder: Path, statuses: Any) -> Any:
    """The scale-up the tuner (InferLine's model) decides for ``large`` at 256 qps."""
    cascade_app(store, folder)
    clock, feed = FakeClock(start_s=1000.0), Feed()
    tuner = LiveTuner(store, clock, feed, resolve, model="inferline", statuses=statuses)
    feed.arrival_s = steady(256.0, 940.0, 1000.0)
    tuner.tick()
    (up,) = [d for d in decisions_of(store, "scale_up") if d.numbers["stage"] == "large"]
    return up


def test_a_cascades_later_stage_is_sized_for_the_reach_the_serving_loop_measures(
    tmp_path: Path,
) -> None:
    """Live inputs that the first model is less sure of than the plan's records forward twice
    the plan's share: the stage is sized for the reach measured at the spec's thresholds (which
    the gear in force does not change), and the decision says so."""
    fleets = []
    for name, statuses in (
        ("planned", None),
        ("measured", lambda: [reach_status(1.0, 5000)]),
    ):
        folder = tmp_path / name
        folder.mkdir()
        url = f"sqlite:///{folder / 'hp.db'}"
        migrate.upgrade(url)
        store = Store.from_url(url, FakeClock())
        try:
            up = large_after_a_step(store, folder, statuses)
        finally:
            store.close()
        fleets.append(sum(up.numbers["fleets_after"]["large"].values()))
        if name == "measured":
            assert up.numbers["reach"] == {"observed": 1.0, "planned": 0.5, "samples": 5000.0}
            assert "reach at the spec's thresholds" in up.reason
        else:
            assert "reach" not in up.numbers
    planned, measured = fleets
    # k = ceil(r s / (mu rho)): twice the share, more instances, but fewer than twice as many:
    # a stage sized for a live reach takes the utilisation between its planned fleet and that
    # fleet less an instance where higher than the plan's (_whole_rho).
    assert planned < measured < 2 * planned


@pytest.mark.parametrize(
    ("reach", "samples"),
    [(0.52, 5000), (1.0, 50), (None, 5000)],
    ids=["within-noise", "too-few-samples", "no-answers-yet"],
)
def test_a_reach_within_noise_or_on_too_few_samples_keeps_the_plans_share(
    store: Store, tmp_path: Path, reach: float | None, samples: int
) -> None:
    up = large_after_a_step(store, tmp_path, lambda: [reach_status(reach, samples)])
    assert "reach" not in up.numbers
    assert "reach at the spec's thresholds" not in up.reason


def test_a_status_that_cannot_be_read_keeps_the_plans_share(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> list[Any]:
        raise RuntimeError("the feed is down")

    with caplog.at_level(logging.WARNING):
        up = large_after_a_step(store, tmp_path, broken)
    assert "reach" not in up.numbers
    assert "the feed is down" in caplog.text


def test_a_reach_above_the_plans_grows_the_stage_at_the_planned_load(
    store: Store, tmp_path: Path
) -> None:
    """The app's load at its plan, the stage's twice its plan's (the live inputs forward all
    of them where the plan said half): the stage's load exceeds what it was planned for, and
    InferLine's model grows it, as it does for a step in the app's load. It read the app's
    load against the app's planned envelope alone, and never grew the stage at the planned
    load however many more samples reached it. (One instance of ``large``: at the planned
    load its two would serve the whole app's at their utilisation target.)"""
    cascade_app(store, tmp_path, large=1)
    clock, feed = FakeClock(start_s=1000.0), Feed()
    statuses = [reach_status(1.0, 5000)]
    tuner = LiveTuner(store, clock, feed, resolve, model="inferline", statuses=lambda: statuses)
    feed.arrival_s = steady(50.0, 940.0, 1000.0)  # the planned rate
    tuner.tick()
    (up,) = [d for d in decisions_of(store, "scale_up") if d.numbers["stage"] == "large"]
    assert up.numbers["reach"]["observed"] == 1.0
    assert sum(up.numbers["fleets_after"]["large"].values()) > 1  # grown from its one
    assert not [d for d in decisions_of(store, "scale_up") if d.numbers["stage"] == "tiny"]
    # The plan's share at the planned load: nothing to do.
    statuses[:] = [reach_status(None, 0)]
    clock.advance(1.0)
    feed.arrival_s = steady(50.0, 941.0, 1001.0)
    assert tuner.tick() == []


def test_a_reach_on_the_edge_of_its_noise_band_does_not_flap_the_stage(
    store: Store, tmp_path: Path
) -> None:
    """A reading just past three sd, then just within, tick after tick (its own noise about
    the band's edge): the stage is sized for the reading while it stays near it, not moved
    between the plan's share and the reading (a jump of three sd) at every crossing. The
    tuner launched an instance and stopped it again every scale-down delay."""
    cascade_app(store, tmp_path)
    clock, feed = FakeClock(start_s=1000.0), Feed()
    sd, ticks = math.sqrt(0.25 / 200), [0]

    def statuses() -> list[Any]:
        return [reach_status(0.5 + (2.9 if ticks[0] % 2 else 3.1) * sd, 200)]

    tuner = LiveTuner(store, clock, feed, resolve, model="inferline", statuses=statuses)
    for _ in range(300):
        feed.arrival_s = steady(120.0, clock.now_s() - 60.0, clock.now_s())
        tuner.tick()
        ticks[0] += 1
        clock.advance(1.0)
    changes = [
        d
        for kind in ("scale_up", "scale_down")
        for d in decisions_of(store, kind)
        if d.numbers["stage"] == "large" and d.numbers["at_s"] >= 1060.0
    ]
    assert changes == []  # after the first minute's sizing, nothing moves
    assert tuner.desired_fleet(store.get_app(APP))[SMALL] >= 4
