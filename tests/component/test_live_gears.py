"""The gear switcher on live traffic: a real store (SQLite through the migrations), a fake clock,
arrivals and the serving loop's status set by hand; which gear the loop is given and what the
decision log says."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db.store import AppRecord, Store
from controlplane.loops.live_gears import GearTable, LiveGears, ready_share
from controlplane.policies.gears import (
    DEFAULT_CAP_HOLD_S,
    CascadePlacement,
    Gear,
    GearOption,
    GearPlan,
    Hysteresis,
)
from controlplane.serving.dispatcher import AppStatus, StageStatus, WorkerStatus
from controlplane.serving.states import ModelState
from estimator.cascades import Cascade, CascadeQuality
from tests.unit import cascade_support as family

APP = "digits"
TYPE = family.TYPE
PROFILES = family.profiles()
# Option 0, the fast gear: tiny alone (100 qps); option 1: tiny@0.5 -> large (20 qps, accurate).
FAST = GearOption(
    Cascade(("tiny",)), CascadeQuality(0.90, (1.0,), (1.0,)), (4,), 120.0, 100.0,
    ((0.0, 2.0), (100.0, 60.0)), 1.2,
)  # fmt: skip
ACCURATE = GearOption(
    Cascade(("tiny", "large"), (0.5,)), CascadeQuality(0.97, (1.0, 0.3), (0.7, 0.3)), (1, 1),
    30.0, 20.0, ((0.0, 10.0), (20.0, 90.0)), 3.6,
)  # fmt: skip
PAPER = Hysteresis.off()
PLAN = GearPlan(
    placement=CascadePlacement.parse(f"tiny:{TYPE}=1;large:{TYPE}=2"),
    slo_ms=100.0,
    percentile=99.0,
    accuracy_floor=None,
    options=(FAST, ACCURATE),
    gears=(Gear(0.0, 20.0, 1, True), Gear(20.0, 100.0, 0, True)),
    qps_max=100.0,
    candidates=7,
    simulations=42,
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    opened = Store.from_url(url, FakeClock())
    yield opened
    opened.close()


def applied(store: Store, folder: Path, gear_plan: dict[str, Any] | None) -> None:
    profiles = {
        "format": "heteroplane.profiles/v1",
        "profiles": [
            {"model": m, "instance_type": TYPE, "batch_sizes": [1], "latency_ms": [[5.0]]}
            for m in ("tiny", "large")
        ],
    }
    (folder / "profiles.json").write_text(json.dumps(profiles))
    store.create_app(
        {
            "name": APP,
            "models": [{"name": m, "profiles": str(folder / "profiles.json")}
                       for m in ("tiny", "large")],
            "cascade": ["tiny", "large"],
            "slo": {"latency_ms": 100},
            "budget_usd_per_hr": 1.0,
            "instance_types": [TYPE],
        },
        who="test",
    )  # fmt: skip
    document: dict[str, Any] = {"feasible": True, "cost_usd_per_hr": 0.5, "stages": []}
    if gear_plan is not None:
        document["gear_plan"] = gear_plan
    plan = store.create_plan(APP, document)
    store.apply_plan(APP, plan.id)


def planned_sps(model: str) -> float:
    """The placement's capacity of ``model`` at batch 1 (samples/s)."""
    count = PLAN.placement.fleets[model][TYPE]
    return count * 1000.0 / PROFILES[model][TYPE].mean_latency_ms(1)


PLACED = sum(PLAN.placement.fleets[m][TYPE] for m in PLAN.placement.order)  # 3 instances


class Loop:
    """What the serving loop would show: arrival times and a status snapshot, set by hand. The
    status is a co-located cascade's, as the dispatcher reports it: ``ready`` healthy workers of
    TYPE (by default the placement's three), each hosting both models, so that each stage's
    capacity counts every healthy worker at its full rate for that model."""

    def __init__(self) -> None:
        self.arrival_s: np.ndarray | None = np.empty(0)
        self.queue = 0
        self.ready = PLACED
        self.down = 0  # workers known to the loop but unhealthy

    @property
    def capacity(self) -> dict[str, float]:
        return {
            m: self.ready * planned_sps(m) / PLAN.placement.fleets[m][TYPE]
            for m in ("tiny", "large")
        }

    def arrivals(self, app: str) -> np.ndarray | None:
        assert app == APP
        return self.arrival_s

    def statuses(self) -> list[AppStatus]:
        workers = tuple(
            WorkerStatus(f"i-{k}", TYPE, f"10.0.0.{k}:8000", k < self.ready, False, "")
            for k in range(self.ready + self.down)
        )
        # every worker in both stages
        hosts: dict[str, ModelState] = {w.instance_id: "active" for w in workers}
        stages = tuple(
            StageStatus(
                m, self.queue if m == "tiny" else 0, 0, 0, self.capacity[m], "fcfs", 1, hosts
            )
            for m in ("tiny", "large")
        )
        return [AppStatus(APP, "", 100.0, workers, stages, 0)]

    def rate(self, rate_qps: float, now_s: float, span_s: float = 10.0) -> None:
        n = int(rate_qps * span_s)
        self.arrival_s = now_s - span_s + (np.arange(n) + 0.5) / rate_qps


def switcher(
    store: Store, clock: FakeClock, loop: Loop, hysteresis: Hysteresis | None = PAPER
) -> LiveGears:
    """The live switcher; by default on the paper's rule (no band, hold or dwell), which most
    tests here exercise; ``hysteresis=None``: the service's default."""

    def resolve(app: AppRecord) -> Any:
        return SimpleNamespace(profile=lambda m, t: PROFILES[m][t])

    return LiveGears(
        store, clock, loop.arrivals, loop.statuses, resolve, window_s=5.0, hysteresis=hysteresis
    )


def started(store: Store, tmp_path: Path) -> tuple[FakeClock, Loop, LiveGears]:
    """The gear plan applied, the loop showing the placement's workers, the live switcher on
    the paper's rule."""
    applied(store, tmp_path, PLAN.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    return clock, loop, switcher(store, clock, loop)


def a_second_at(rate_qps: float, clock: FakeClock, loop: Loop, gears: LiveGears) -> None:
    """One more second of the loop measuring ``rate_qps``, then the switcher's tick."""
    clock.advance(1.0)
    loop.rate(rate_qps, clock.now_s())
    gears.tick()


def gear_log(store: Store) -> list[dict[str, Any]]:
    return [d.numbers for d in store.list_decisions(APP, kinds=["gear_switch"])]


def set_aside_reasons(store: Store) -> list[str]:
    """The reasons of the logged decisions that set the app's gear plan aside."""
    return [
        d.reason for d in store.list_decisions(APP, kinds=["gear_switch"]) if "aside" in d.reason
    ]


def test_the_gear_plan_survives_its_document() -> None:
    document = json.loads(json.dumps(PLAN.to_document()))
    document["placement"] = dict(reversed(list(document["placement"].items())))  # as JSONB may
    again = GearPlan.from_document(document)
    assert again.placement.order == ("tiny", "large")
    assert again.to_document() == PLAN.to_document()


def test_a_document_that_is_not_a_gear_plan_is_refused() -> None:
    from estimator.errors import CascadeError

    gear = {"low_qps": 0, "high_qps": 1, "option": 5, "meets_slo": True}
    broken = {**PLAN.to_document(), "gears": [gear]}
    with pytest.raises(CascadeError, match="options of the plan"):
        GearPlan.from_document(broken)
    with pytest.raises(CascadeError, match="not a gear plan"):
        GearPlan.from_document({"placement": {}})


def test_the_rate_moves_the_gear_and_every_change_is_recorded(store: Store, tmp_path: Path) -> None:
    clock, loop, gears = started(store, tmp_path)
    assert gears.gear(APP) is None  # before the first tick

    loop.rate(10.0, clock.now_s())
    assert gears.tick() == []
    served = gears.gear(APP)
    assert served is not None and served.cascade == ACCURATE.cascade
    assert served.max_batch_queries == {"tiny": 1, "large": 1}
    assert served.cheapest == FAST.cascade  # what admission control may count on
    assert gear_log(store)[-1]["gear"] == 0

    clock.advance(5.0)
    loop.rate(60.0, clock.now_s())  # past the accurate gear's 20 qps: up at once
    (up,) = gears.tick()
    assert (up.previous, up.gear) == (0, 1)
    assert gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]

    clock.advance(5.0)
    loop.rate(10.0, clock.now_s())
    loop.queue = 50  # 10 qps < alpha 8 x 50 queued: the backlog of the burst drains first
    assert gears.tick() == []
    assert gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]

    loop.queue = 0
    clock.advance(1.0)
    (down,) = gears.tick()
    assert (down.previous, down.gear) == (1, 0)
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    log = gear_log(store)
    assert [n["gear"] for n in log] == [0, 1, 0]
    reasons = [d.reason for d in store.list_decisions(APP, kinds=["gear_switch"])]
    assert "up from gear 0 to 1" in reasons[1] and "down from gear 1 to 0" in reasons[2]


def test_the_budget_cap_holds_the_fast_gear(store: Store, tmp_path: Path) -> None:
    clock, loop, gears = started(store, tmp_path)
    loop.rate(60.0, clock.now_s())
    gears.tick(capped=lambda app: True)  # the budget stops the scale-up this load asks for
    assert gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    clock.advance(2.0)
    loop.rate(10.0, clock.now_s())
    assert gears.tick(capped=lambda app: True) == []  # within the hold: no move to the slow gear
    assert gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    # Past the hold the tuner still reports the cap (it sizes on a minute's memory), but for a
    # load that has gone: its reports below the gear's range do not hold the gear (a tester's
    # least accurate gear held 64 s at zero load).
    clock.advance(DEFAULT_CAP_HOLD_S)
    loop.rate(10.0, clock.now_s())
    (down,) = gears.tick(capped=lambda app: True)
    assert down.gear == 0


def test_lost_capacity_moves_to_the_fast_gear(store: Store, tmp_path: Path) -> None:
    clock, loop, gears = started(store, tmp_path)
    loop.rate(15.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    # One of the placement's three instances dies (it served a third of each model's time).
    loop.ready, loop.down = PLACED - 1, 1
    assert ready_share(PLAN, loop.statuses()[0], PROFILES) == pytest.approx(2 / 3)
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    # 15 qps on two thirds of the capacity counts as 22.5: the fast gear's range.
    (up,) = gears.tick()
    assert up.gear == 1 and up.effective_qps == pytest.approx(1.5 * up.measured_qps)


def test_a_worker_hosting_every_model_counts_once_per_type() -> None:
    # Co-located, each of the placement's three workers is in both stages at its full rate:
    # large's stage reports 1.5 x the placement's two instances, tiny's 3 x its one. The fleet
    # is the placement's: the share is 1.
    loop = Loop()
    assert loop.capacity["tiny"] == pytest.approx(3 * planned_sps("tiny"))
    assert ready_share(PLAN, loop.statuses()[0], PROFILES) == pytest.approx(1.0)
    loop.ready = 2 * PLACED  # the tuner doubled the fleet
    assert ready_share(PLAN, loop.statuses()[0], PROFILES) == pytest.approx(2.0)


def snapshot(workers: list[tuple[str, bool, tuple[str, ...]]]) -> AppStatus:
    """A status of ``workers`` (type, healthy, the models whose stage has its slot)."""
    listed = tuple(
        WorkerStatus(f"i-{k}", t, f"10.0.0.{k}:8000", healthy, False, "")
        for k, (t, healthy, _) in enumerate(workers)
    )
    stages = tuple(
        StageStatus(
            m,
            0,
            0,
            0,
            1.0,
            "fcfs",
            1,
            {f"i-{k}": "active" for k, (_, _, hosts) in enumerate(workers) if m in hosts},
        )
        for m in ("tiny", "large")
    )
    return AppStatus(APP, "", 100.0, listed, stages, 0)


BOTH = ("tiny", "large")


def test_a_worker_counts_for_the_models_its_slots_serve() -> None:
    # Workers of a type the placement has none of count where their rate is known (a stand-in,
    # a type the tuner chose): three of them, as fast as the placement's, are its capacity.
    other = {m: {"other": PROFILES[m][TYPE], **PROFILES[m]} for m in BOTH}
    three_other = snapshot([("other", True, BOTH)] * 3)
    assert ready_share(PLAN, three_other, other) == pytest.approx(1.0)
    # Without their rate, nothing serves: the fastest gear.
    assert ready_share(PLAN, three_other, PROFILES) == pytest.approx(1e-6)
    # One model a worker (a placement pruned by memory): tiny on one, large on one of its two
    # (the other down): large has half its capacity, whatever tiny's worker could do.
    pruned = snapshot(
        [(TYPE, True, ("tiny",)), (TYPE, True, ("large",)), (TYPE, False, ("large",))]
    )
    assert ready_share(PLAN, pruned, PROFILES) == pytest.approx(0.5)
    # A type standing in for another of the stage's: tiny:A=1; large:A=1,B=2, A and B as fast;
    # four A serve it all (tiny takes one A's time, large three).
    plan = dataclasses.replace(PLAN, placement=CascadePlacement.parse("tiny:A=1;large:A=1,B=2"))
    same = {m: {"A": PROFILES[m][TYPE], "B": PROFILES[m][TYPE]} for m in BOTH}
    assert ready_share(plan, snapshot([("A", True, BOTH)] * 4), same) == pytest.approx(1.0)


def test_a_budget_cut_counts_what_the_drain_leaves(store: Store, tmp_path: Path) -> None:
    # The placement's three instances at 0.3/hr: two serve, one boots. A budget of 0.6 pays for
    # two of the three kept: the drain leaves two thirds of the placement, what serves now; no
    # cut of what serves, and 10 qps on two thirds (15) is the accurate gear's.
    applied(store, tmp_path, PLAN.to_document())
    for n, state in enumerate(["running", "running", "pending"]):
        store.record_instance(
            APP, request_id=f"r{n}", instance_type=TYPE, price_usd_per_hr=0.3, state=state
        )
    clock, loop = FakeClock(start_s=100.0), Loop()
    loop.ready = 2
    gears = switcher(store, clock, loop)
    loop.rate(10.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    store.change_budget(APP, 0.6, reason="cut", who="test")
    clock.advance(1.0)
    loop.rate(10.0, clock.now_s())
    assert gears.budget_changed(APP) is None
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    # A budget of 0.3 leaves one of three: 10 qps reads as 30, the fast gear's, at once.
    store.change_budget(APP, 0.3, reason="cut", who="test")
    clock.advance(1.0)
    loop.rate(10.0, clock.now_s())
    cut = gears.budget_changed(APP)
    assert cut is not None and cut.gear == 1
    assert gear_log(store)[-1]["capacity_share"] == pytest.approx(1 / 3)


class Measured:
    """A resolver whose profiles are set by hand (a type not measured yet: KeyError)."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, Any]] = {m: dict(PROFILES[m]) for m in BOTH}

    def __call__(self, app: AppRecord) -> Any:
        return SimpleNamespace(profile=lambda m, t: self.table[m][t])


def test_a_new_type_counts_once_its_profile_is_found(store: Store, tmp_path: Path) -> None:
    applied(store, tmp_path, PLAN.to_document())
    for n in range(3):
        store.record_instance(
            APP, request_id=f"r{n}", instance_type=TYPE, price_usd_per_hr=0.1, state="running"
        )
    clock, loop, resolve = FakeClock(start_s=100.0), Loop(), Measured()
    serving = {"type": TYPE}

    def statuses() -> list[AppStatus]:
        return [snapshot([(serving["type"], True, BOTH)] * 3)]

    gears = LiveGears(store, clock, loop.arrivals, statuses, resolve, hysteresis=PAPER)
    loop.rate(15.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    # The fleet gains a type B before the app has its profile: looked up in vain, for now.
    for n in range(3):
        store.record_instance(
            APP, request_id=f"b{n}", instance_type="B", price_usd_per_hr=0.1, state="running"
        )
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    assert gears.tick() == []
    # B measured (as fast as the placement's type), then serving: three B are the capacity.
    for m in BOTH:
        resolve.table[m]["B"] = PROFILES[m][TYPE]
    serving["type"] = "B"
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    assert gears.tick() == []
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]


def test_a_worker_serving_a_stage_its_type_is_placed_on_elsewhere_counts(
    store: Store, tmp_path: Path
) -> None:
    """tiny placed on A, large on B (as fast). B's instance is gone (INFaaS's autoscaler
    drained the dearer variant; a worker died), so the serving loop serves large on the A
    worker too. Its rate for large is A's profile of large, which the placement does not list:
    the switcher looked up profiles only of each model's own placed types and of types outside
    the placement, read no rate, took the share for 1e-6 (a tester's 0.8 qps read as 800,000)
    and served the fastest gear at any load. One A worker serving both is half the capacity."""
    plan = dataclasses.replace(PLAN, placement=CascadePlacement.parse("tiny:A=1;large:B=1"))
    applied(store, tmp_path, plan.to_document())
    store.record_instance(
        APP, request_id="r0", instance_type="A", price_usd_per_hr=0.1, state="running"
    )
    resolve = Measured()
    resolve.table = {m: {"A": PROFILES[m][TYPE], "B": PROFILES[m][TYPE]} for m in BOTH}
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = LiveGears(
        store,
        clock,
        loop.arrivals,
        lambda: [snapshot([("A", True, BOTH)])],
        resolve,
        hysteresis=PAPER,
    )
    loop.rate(5.0, clock.now_s())
    gears.tick()
    a_second_at(5.0, clock, loop, gears)
    # 5 qps on half the capacity reads as 10: the accurate gear's range.
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    loop.rate(15.0, clock.now_s())
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    (up,) = gears.tick()
    assert up.gear == 1 and up.effective_qps == pytest.approx(2 * up.measured_qps)


def test_a_profile_worker_is_not_the_fleet_a_budget_cut_drains(
    store: Store, tmp_path: Path
) -> None:
    # Three serving instances at 0.3/hr and a profile run's worker at 0.6: a budget of 0.9 pays
    # for the fleet (the reconciler ends the profile worker first), so nothing that serves goes.
    applied(store, tmp_path, PLAN.to_document())
    for n in range(3):
        store.record_instance(
            APP, request_id=f"r{n}", instance_type=TYPE, price_usd_per_hr=0.3, state="running"
        )
    store.record_instance(
        APP,
        request_id="profile:digits-1a2b3c4d-emu.gpu",
        instance_type="emu.gpu",
        price_usd_per_hr=0.6,
        state="running",
    )
    store.change_budget(APP, 2.0, reason="room for the profile run", who="test")
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop)
    loop.rate(15.0, clock.now_s())
    gears.tick()
    store.change_budget(APP, 0.9, reason="cut", who="test")
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    assert gears.budget_changed(APP) is None
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]


def test_the_workers_the_tuner_adds_hold_the_accurate_gear(store: Store, tmp_path: Path) -> None:
    clock, loop, gears = started(store, tmp_path)
    loop.rate(15.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    # The load doubles to 30 qps, past the accurate gear's 20 on the placement; the tuner has
    # doubled the fleet (within the budget: no instance in the store costs anything), so 30 qps
    # on twice the capacity counts as 15: the accurate gear holds.
    loop.ready = 2 * PLACED
    for _ in range(10):
        clock.advance(1.0)
        loop.rate(30.0, clock.now_s())
        assert gears.tick() == []
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    # Back on the placement's three workers, 30 qps is the fast gear's.
    loop.ready, loop.down = PLACED, PLACED
    clock.advance(1.0)
    loop.rate(30.0, clock.now_s())
    (up,) = gears.tick()
    assert up.gear == 1 and up.effective_qps == pytest.approx(30.0)
    [switch] = [d for d in gear_log(store) if d.get("previous") is not None]
    assert switch["capacity_share"] == pytest.approx(1.0)


def test_no_switch_before_any_worker_is_up(store: Store, tmp_path: Path) -> None:
    applied(store, tmp_path, PLAN.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    loop.ready = 0  # the plan's workers are still starting
    gears = switcher(store, clock, loop)
    loop.rate(15.0, clock.now_s())
    gears.tick()
    in_force = gears.gear(APP)
    assert in_force is not None and in_force.cascade == ACCURATE.cascade
    clock.advance(1.0)
    assert gears.tick() == []  # no capacity yet reads as none at all: held, not switched
    assert not [d for d in gear_log(store) if d.get("previous") is not None]
    # Once capacity has been seen, losing it all is a reason to move to the fast gear.
    loop.ready = PLACED
    clock.advance(1.0)
    gears.tick()
    loop.ready, loop.down = 0, PLACED
    clock.advance(1.0)
    (up,) = gears.tick()
    assert up.gear == 1


def test_a_budget_below_the_fleets_cost_moves_the_gear_before_the_drain(
    store: Store, tmp_path: Path
) -> None:
    applied(store, tmp_path, PLAN.to_document())
    for n in range(3):  # the placement's three instances, 0.3 USD/hr each: 0.9 of the 1.0 budget
        store.record_instance(
            APP, request_id=f"r{n}", instance_type=TYPE, price_usd_per_hr=0.3, state="running"
        )
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop, hysteresis=None)  # the service's: the start is no dwell
    loop.rate(15.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    # The budget drops to a third of the fleet's cost; no instance has been drained yet. A
    # second after the start: no dwell holds a switch the budget forces.
    store.change_budget(APP, 0.3, reason="cut", who="test")
    clock.advance(1.0)
    up = gears.budget_changed(APP)
    assert up is not None and up.gear == 1  # 15 qps on a third of the capacity: the fast gear
    assert up.effective_qps == pytest.approx(3 * up.measured_qps)
    [switch] = [d for d in store.list_decisions(APP, kinds=["gear_switch"]) if d.numbers.get(
        "previous") is not None]  # fmt: skip
    assert switch.numbers["capacity_share"] == pytest.approx(1 / 3)
    assert [i.state for i in store.list_instances(APP)] == ["running"] * 3  # nothing drained


def test_an_app_without_a_gear_plan_is_served_as_its_spec_says(
    store: Store, tmp_path: Path
) -> None:
    applied(store, tmp_path, None)
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop)
    loop.rate(60.0, clock.now_s())
    assert gears.tick() == []
    assert gears.gear(APP) is None
    assert gear_log(store) == []


def test_a_broken_gear_plan_leaves_the_app_on_its_spec(store: Store, tmp_path: Path) -> None:
    applied(store, tmp_path, {"placement": {"tiny": {TYPE: 1}}})
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop)
    loop.rate(60.0, clock.now_s())
    assert gears.tick() == []
    assert gears.gear(APP) is None


def test_the_producer_evaluates_every_100_ms_without_reading_the_store(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    applied(store, tmp_path, PLAN.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    evaluations: list[float] = []
    arrivals = loop.arrivals

    def counted(app: str) -> np.ndarray | None:
        evaluations.append(clock.now_s())
        return arrivals(app)

    loop.arrivals = counted  # type: ignore[method-assign]
    gears = switcher(store, clock, loop)
    loop.rate(10.0, clock.now_s())
    gears.refresh()  # the tuner tick's side: the plan, its start recorded
    assert [n["gear"] for n in gear_log(store)] == [0]

    reads: list[str] = []
    for name in ("list_apps", "get_app", "get_applied_plan", "list_instances"):
        method = getattr(store, name)

        def spy(*args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            reads.append(_name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(store, name, spy)
    evaluations.clear()
    changes = []
    for tick in range(20):  # two seconds of the gears job at 100 ms
        clock.advance(0.1)
        loop.rate(10.0 if tick < 10 else 60.0, clock.now_s())
        changes += gears.switch_tick()
    assert len(evaluations) == 20  # ten evaluations a second
    assert reads == []  # the store is only written to, on a change
    (up,) = changes  # the first evaluation past the accurate gear's range moves up, once
    assert (up.previous, up.gear) == (0, 1) and up.at_s == pytest.approx(100.0 + 1.1)
    assert [n["gear"] for n in gear_log(store)] == [0, 1]
    served = gears.gear(APP)
    assert served is not None and served.cascade == FAST.cascade
    assert served.min_queue == {"tiny": 1}  # a plan without triggers dispatches at once


def test_the_gear_in_force_carries_its_trigger(store: Store, tmp_path: Path) -> None:
    fast = Gear(20.0, 100.0, 0, True, (3,), 40.0)
    plan = GearPlan(
        PLAN.placement, 100.0, 99.0, None, PLAN.options, (PLAN.gears[0], fast), 100.0, 7, 42
    )
    applied(store, tmp_path, plan.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop)
    loop.rate(60.0, clock.now_s())
    gears.tick()
    served = gears.gear(APP)
    assert served is not None and served.cascade == FAST.cascade
    assert served.min_queue == {"tiny": 3} and served.max_wait_s == pytest.approx(0.04)


@pytest.mark.parametrize(("hysteresis", "most", "least"), [(None, 1, 0), (PAPER, None, 10)])
def test_flapping_stops_at_a_boundary(
    store: Store,
    tmp_path: Path,
    hysteresis: Hysteresis | None,
    most: int | None,
    least: int,
) -> None:
    """Poisson arrivals at a steady 20 qps, the boundary between the two gears, for 5 minutes:
    the producer every 100 ms, the store side every second, as the service runs them. With the
    service's hysteresis the gear switches at most once; on the paper's rule it flaps."""
    applied(store, tmp_path, PLAN.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop, hysteresis)
    rng = np.random.default_rng(7)
    arrivals = 90.0 + np.cumsum(rng.exponential(1 / 20.0, size=20 * 330))
    for tick in range(3000):
        loop.arrival_s = arrivals[: np.searchsorted(arrivals, clock.now_s(), side="right")]
        if tick % 10 == 0:
            gears.refresh()
        gears.switch_tick()
        clock.advance(0.1)
    recorded = [n for n in gear_log(store) if "previous" in n]  # the start has no previous
    assert len(recorded) >= least
    if most is not None:
        assert len(recorded) <= most


def test_a_move_within_a_cascade_changes_the_trigger_and_is_not_recorded(
    store: Store, tmp_path: Path
) -> None:
    # The fast cascade serves two gears with different batch triggers.
    lower, upper = Gear(20.0, 60.0, 0, True, (2,), 40.0), Gear(60.0, 100.0, 0, True, (4,), 40.0)
    plan = GearPlan(
        PLAN.placement, 100.0, 99.0, None, PLAN.options, (PLAN.gears[0], lower, upper), 100.0, 7, 42
    )
    applied(store, tmp_path, plan.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop, hysteresis=None)
    loop.rate(40.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).min_queue == {"tiny": 2}  # type: ignore[union-attr]
    clock.advance(1.0)
    loop.rate(80.0, clock.now_s())
    assert gears.tick() == []  # no switch: the same cascade
    assert gears.gear(APP).min_queue == {"tiny": 4}  # type: ignore[union-attr]
    assert [n["gear"] for n in gear_log(store)] == [1]  # only the start is recorded


def test_the_serving_processs_gear_table_serves_the_gear_the_switcher_sent(
    store: Store, tmp_path: Path
) -> None:
    """Loops apart from serving: what the switcher has in force (plan id, gear) crosses to the
    serving process, whose table makes the same gear from the applied plan in the database."""
    clock, loop, gears = started(store, tmp_path)
    loop.rate(60.0, clock.now_s())
    gears.tick()
    table = GearTable(store)
    table.set_all(gears.in_force())
    assert table.gear(APP) == gears.gear(APP) and gears.gear(APP) is not None
    assert table.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]

    plan_id = next(iter(gears.in_force().values()))[0]
    table.set_all({APP: (plan_id + 1, 0)})  # not the applied plan: served without gears
    assert table.gear(APP) is None
    table.set_all({APP: (plan_id, len(PLAN.gears))})  # no such gear
    assert table.gear(APP) is None
    table.set_all({APP: (plan_id, 0)})
    assert table.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    table.set_all({})  # the switcher dropped the app
    assert table.gear(APP) is None


def test_an_app_registered_again_gets_a_new_plan_id_and_its_own_gears(
    store: Store, tmp_path: Path
) -> None:
    """Plan ids are never given twice (SQLite's gave a deleted app's plan id to the next plan
    made before migration 0013): an app registered again under the same name, with another
    cascade's plan, is served its own plan's gears, not the deleted app's that the table had
    parsed."""
    applied(store, tmp_path, PLAN.to_document())
    table = GearTable(store)
    (plan_id,) = [store.get_applied_plan(APP).id]  # type: ignore[union-attr]
    table.set_all({APP: (plan_id, 0)})
    assert table.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    store.delete_app(APP)
    table.set_all({})  # the switcher forgot the deleted app
    swapped = GearPlan(
        PLAN.placement, 100.0, 99.0, None, (ACCURATE, FAST), PLAN.gears, 100.0, 7, 42
    )
    applied(store, tmp_path, swapped.to_document())
    new_id = store.get_applied_plan(APP).id  # type: ignore[union-attr]
    assert new_id > plan_id
    table.set_all({APP: (new_id, 0)})
    assert table.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]


def test_an_app_deleted_during_a_refresh_is_forgotten_without_failing_the_tick(
    store: Store, tmp_path: Path
) -> None:
    clock, loop, gears = started(store, tmp_path)
    loop.rate(60.0, clock.now_s())
    gears.tick()
    assert APP in gears.in_force()
    listed = store.list_apps()  # the tick's snapshot, read before the app goes
    store.delete_app(APP)
    gears.refresh(apps=listed)
    assert gears.in_force() == {} and gears.gear(APP) is None


def test_a_spec_serving_another_cascade_sets_the_gear_plan_aside(
    store: Store, tmp_path: Path
) -> None:
    """`app apply` with the cascade's order replaced kept the old plan's gears in force (any
    gear whose models were still stages) with no decision: the gear plan is set aside now, once,
    and comes back when the spec serves the plan's cascade again."""
    clock, loop, gears = started(store, tmp_path)
    loop.rate(15.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP) is not None
    spec = dict(store.get_app(APP).spec)
    store.update_app(APP, {**spec, "cascade": ["large", "tiny"]}, who="test")
    for _ in range(2):
        a_second_at(15.0, clock, loop, gears)
        assert gears.gear(APP) is None and APP not in gears.in_force()
    (aside,) = set_aside_reasons(store)
    assert "made for the cascade tiny -> large, the spec now serves large -> tiny" in aside
    store.update_app(APP, spec, who="test")
    a_second_at(15.0, clock, loop, gears)
    assert gears.gear(APP) is not None


def test_a_spec_raising_the_accuracy_floor_past_a_gear_sets_the_gear_plan_aside(
    store: Store, tmp_path: Path
) -> None:
    """A spec replaced with an accuracy floor (`slo.accuracy`) the plan was not made for kept
    the old gears in force, unlogged: a tester's demo, planned with no floor, served tiny@0.9 ->
    medium (97.49% held-out) under a new floor of 98%. A floor that a gear misses sets the gear
    plan aside now, once; one every gear meets keeps it."""
    clock, loop, gears = started(store, tmp_path)
    loop.rate(60.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    spec = dict(store.get_app(APP).spec)
    store.update_app(APP, {**spec, "slo": {**spec["slo"], "accuracy": 0.85}}, who="test")
    a_second_at(60.0, clock, loop, gears)
    assert gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]  # 90% >= 85%

    store.update_app(APP, {**spec, "slo": {**spec["slo"], "accuracy": 0.95}}, who="test")
    for _ in range(2):
        a_second_at(60.0, clock, loop, gears)
        assert gears.gear(APP) is None and APP not in gears.in_force()
    (aside,) = set_aside_reasons(store)
    assert "made for no accuracy floor, the spec now asks 95%, which tiny (90.00%) misses" in aside
    # A restarted switcher (a loops process, a new leader) does not say it again.
    restarted = switcher(store, clock, loop)
    a_second_at(60.0, clock, loop, restarted)
    assert restarted.gear(APP) is None
    assert len(set_aside_reasons(store)) == 1
    store.update_app(APP, spec, who="test")
    a_second_at(60.0, clock, loop, gears)
    assert gears.gear(APP) is not None


def test_a_plan_starts_in_the_gear_of_its_load_on_the_capacity_that_serves(
    store: Store, tmp_path: Path
) -> None:
    """A plan applied while the tuner had doubled the fleet started in the gear of the measured
    rate alone (a tester's demo: tiny at 20.6 qps, where the doubled fleet carried it in
    tiny@0.9 -> medium), and moved a hold later; it starts on the capacity share now."""
    applied(store, tmp_path, PLAN.to_document())
    clock, loop = FakeClock(start_s=100.0), Loop()
    loop.ready = 2 * PLACED
    gears = switcher(store, clock, loop, hysteresis=None)
    loop.rate(30.0, clock.now_s())  # 15 qps on the planned capacity: the accurate gear's
    assert gears.tick() == []
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    (start,) = store.list_decisions(APP, kinds=["gear_switch"])
    assert start.numbers["gear"] == 0 and start.numbers["capacity_share"] == pytest.approx(2.0)
    assert "30 qps measured, 15 qps on the planned capacity (share 2)" in start.reason


def test_a_serving_process_started_serves_the_gear_the_log_names(
    store: Store, tmp_path: Path
) -> None:
    """A serving process started (the service restarted) served every geared app by its spec's
    cascade until its loops process had read the store, about 3 s on a tester's demo: its gear
    table starts from the gear the log names now, and names none after a set-aside."""
    applied(store, tmp_path, PLAN.to_document())
    plan = store.get_applied_plan(APP)
    assert plan is not None
    table = GearTable(store)
    table.resume()
    assert table.gear(APP) is None  # nothing in the log yet
    store.record_decision(
        APP, "gear_switch", "up from gear 0 to 1", {"gear": 1, "previous": 0, "plan_id": plan.id}
    )
    table = GearTable(store)
    table.resume()
    assert table.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    store.record_decision(APP, "gear_switch", "gear plan of plan 1 set aside: ...", {})
    table = GearTable(store)
    table.resume()
    assert table.gear(APP) is None


def test_a_restarted_switcher_resumes_the_gear_in_force(tmp_path: Path) -> None:
    """A switcher started anew on a plan that already serves (a restarted loops process or
    service, a new leader) resumes the gear and the dwell the log says, where it started from
    the load measured then: a tester's loops process killed at 9 qps, in the dead band of a gear
    from 10.4 qps, moved the gear down at the restart and back up 7 s later."""
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    clock, loop = FakeClock(start_s=100.0), Loop()
    store = Store.from_url(url, clock)  # the decisions' times on the switcher's clock

    def run(gears: LiveGears, rate_qps: float, seconds: float) -> list[Any]:
        """The producer every 100 ms at a steady ``rate_qps`` for ``seconds``: its switches."""
        switched = []
        for _ in range(round(seconds * 10)):
            loop.rate(rate_qps, clock.now_s())
            switched += gears.tick()
            clock.advance(0.1)
        return switched

    try:
        applied(store, tmp_path, PLAN.to_document())
        gears = switcher(store, clock, loop, hysteresis=None)
        assert run(gears, 10.0, 1.0) == []
        assert [d.gear for d in run(gears, 30.0, 1.0)] == [1]
        assert run(gears, 18.0, 60.0) == []  # in the fast gear's band (its range starts at 20)
        recorded = len(gear_log(store))

        restarted = switcher(store, clock, loop, hysteresis=None)
        assert run(restarted, 18.0, 10.0) == []
        assert restarted.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
        assert len(gear_log(store)) == recorded  # the restart is no switch

        # Restarted 2 s after a switch up, the switch's dwell still holds the gear.
        assert [d.gear for d in run(restarted, 10.0, 40.0)] == [0]
        assert [d.gear for d in run(restarted, 30.0, 2.0)] == [1]
        again = switcher(store, clock, loop, hysteresis=None)
        assert run(again, 5.0, 15.0) == []  # the hold is over, not the 30 s dwell
        assert again.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
        assert [(d.previous, d.gear) for d in run(again, 5.0, 15.0)] == [(1, 0)]
    finally:
        store.close()


def test_a_replica_that_leads_again_resumes_the_gear_from_the_log(tmp_path: Path) -> None:
    """A loops process demoted, then leader again after another replica's term, kept what its
    switcher had tracked before: it sent its old gear at once (the feed's gears are known once
    the switcher has read the store) and went on from it, where the other leader had switched
    since. Led again, it sends no gears and switches nothing until its refresh, which resumes
    the gear the log names."""
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    clock, loop = FakeClock(start_s=100.0), Loop()
    store = Store.from_url(url, clock)
    try:
        applied(store, tmp_path, PLAN.to_document())
        plan = store.get_applied_plan(APP)
        assert plan is not None
        store.record_decision(
            APP,
            "gear_switch",
            "up from gear 0 to 1",
            {"gear": 1, "previous": 0, "plan_id": plan.id},
        )
        term = [1]
        gears = switcher(store, clock, loop, hysteresis=None)
        gears.term = lambda: term[0]
        gears.refresh()
        assert gears.refreshed() and gears.in_force() == {APP: (plan.id, 1)}

        # Demoted; the other replica's switcher moves the gear down and logs it.
        clock.advance(60.0)
        store.record_decision(
            APP,
            "gear_switch",
            "down from gear 1 to 0",
            {"gear": 0, "previous": 1, "plan_id": plan.id},
        )
        term[0] = 2  # this replica leads again
        assert not gears.refreshed()  # the feed leaves its gears out until it has read the store
        loop.rate(30.0, clock.now_s())
        assert gears.switch_tick() == []  # nothing switched on the state of before
        gears.refresh()
        assert gears.refreshed() and gears.in_force() == {APP: (plan.id, 0)}
        assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]
    finally:
        store.close()


def test_the_feed_sends_gears_only_from_the_leader_that_has_read_the_store(
    tmp_path: Path,
) -> None:
    """The service's wiring (gears_by_lease): a standby loops process sends no gears (its
    switcher never runs; its empty gears undid the leader's at every other exchange), and a
    replica that leads again sends none until its switcher has read the store in that term."""
    from controlplane.loops.remote_serving import RemoteServing
    from controlplane.service.build import gears_by_lease

    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    clock, loop = FakeClock(start_s=100.0), Loop()
    store = Store.from_url(url, clock)
    remote = RemoteServing("http://serving.invalid", "token", clock)
    try:
        applied(store, tmp_path, PLAN.to_document())
        lease = SimpleNamespace(role="standby", terms=0)
        gears = switcher(store, clock, loop, hysteresis=None)
        gears_by_lease(gears, lease, remote)  # type: ignore[arg-type]
        gears.refresh()  # a standby's switcher does not run; were it to, still no gears
        assert not remote.gears_known()
        lease.role, lease.terms = "leader", 1
        assert not remote.gears_known()  # not read the store in this term yet
        gears.refresh()
        assert remote.gears_known()
        lease.role = "standby"
        assert not remote.gears_known()
        lease.role, lease.terms = "leader", 2
        assert not remote.gears_known()
        gears.refresh()
        assert remote.gears_known()
    finally:
        remote.close()
        store.close()
