"""One sizing model across its entry points, and the live tuner against a blip: a real store
(SQLite through the migrations), a fake clock, the real planner, and the fake provisioner behind
the real reconciler.

* The planner, ``heteroplane replay``'s tuner and the live tuner give the same target mix for
  the same planning trace and load.
* A blip (the issue's 56 queries inside one second, on an app planned at 5 qps) makes the live
  tuner launch nothing, and the reconciler with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.apps.budget import change_budget
from controlplane.apps.plans import PlanRequest, planning_trace, replanning_request
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db.store import AppRecord, PlanRecord, Store
from controlplane.loops import live_tuner
from controlplane.loops.live_tuner import LiveTuner
from controlplane.loops.reconciler import AppPricing, Reconciler
from controlplane.policies.capacity_curve import (
    DEFAULT_BURSTINESS,
    build_ladder,
    cascade_sizing,
    replay_sizing,
)
from controlplane.policies.pipeline import dispatch_choice
from controlplane.policies.planner import ServingCapacityError, plan_app, scale_trace
from controlplane.policies.replay import ladder_tuner
from controlplane.policies.sizing import SizingLadder
from controlplane.policies.tuner import TunerStage, ladder_fleet
from controlplane.service.build import stored_overhead
from controlplane.serving.loop import load_config
from controlplane.serving.placement import Placement
from controlplane.serving.stages import ServingStage
from controlplane.serving.workers import WorkerEndpoint
from controlplane.spec import ResolvedApp, load_spec, resolve_spec, validate_spec
from matching.kairos import KairosPolicy
from provisioners.fake import FakeProvisioner
from tests.unit.test_planner import write_cascade_app

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
APP = "recs"
RATE_QPS = 40.0
# The toy cascade (tests/unit/test_planner.py): its planned rate and the loads of its ladders
# (its large stage runs one instance up to 1.1x and two at 2x: a rung at 1.1x keeps a live load a
# hair over the planning trace's own envelope from reading as a need for the second, as the
# refinement of the full ladders does).
CASCADE_RATE_QPS = 120.0
CASCADE_LOADS = (1.0, 1.1, 2.0)
# tiny: 40 ms per query on a small (mu 25 qps for $0.05/hr), 10 ms on a large (mu 100 qps for
# $0.10/hr): the large serves twice the queries per dollar.
PROFILES = {
    "format": "heteroplane.profiles/v1",
    "profiles": [
        {"model": "tiny", "instance_type": SMALL, "batch_sizes": [1], "latency_ms": [[40.0]]},
        {"model": "tiny", "instance_type": LARGE, "batch_sizes": [1], "latency_ms": [[10.0]]},
    ],
}


def spec(folder: Path, budget: float) -> dict[str, Any]:
    (folder / "profiles.json").write_text(json.dumps(PROFILES))
    return {
        "name": APP,
        "models": [{"name": "tiny", "profiles": str(folder / "profiles.json")}],
        "slo": {"latency_ms": 200},
        "budget_usd_per_hr": budget,
        "instance_types": [SMALL, LARGE],
    }


def tiny_models(path: Path, latency_ms: dict[str, float]) -> list[dict[str, str]]:
    """Writes to ``path`` the profiles of ``tiny`` taking ``latency_ms`` a query on each type it
    names; the spec's ``models`` over them."""
    profiles = [
        {"model": "tiny", "instance_type": t, "batch_sizes": [1], "latency_ms": [[ms]]}
        for t, ms in latency_ms.items()
    ]
    path.write_text(json.dumps({"format": "heteroplane.profiles/v1", "profiles": profiles}))
    return [{"name": "tiny", "profiles": str(path)}]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    migrate.upgrade(url)
    opened = Store.from_url(url, FakeClock())
    yield opened
    opened.close()


def resolve(app: AppRecord) -> Any:
    return resolve_spec(validate_spec(app.spec))


def applied_plan(store: Store, folder: Path, rate_qps: float, budget: float) -> AppRecord:
    """The app with the planner's own plan for a Poisson trace at ``rate_qps`` applied (the
    trace a plan made for a rate alone is planned on again)."""
    store.create_app(spec(folder, budget), who="test")
    app = store.get_app(APP)
    trace, _ = planning_trace(resolve(app), PlanRequest(rate_qps=rate_qps, seed=0))
    document = plan_app(resolve(app), trace, seed=0).to_document()
    document["seed"] = 0
    plan = store.create_plan(APP, document)
    store.apply_plan(APP, plan.id)
    return store.get_app(APP)


# The live tuners' sizing ladders by what they are built from (:func:`remembered_ladders`).
_LADDERS: dict[str, dict[str, SizingLadder]] = {}


def remembered_ladders(app: ResolvedApp, plan: PlanRecord) -> dict[str, SizingLadder]:
    """:func:`controlplane.loops.live_tuner.plan_ladders`, the live tuner's own builder, each
    distinct ladder built once in this module: tens of plans, deterministic for the plan's seed,
    and the same app and plan recur across the tests (each restart, each budget a test cuts to).
    Keyed by all they are built from: the plan's document, the spec with each model's profile
    file read in place of its path (each test writes them in its own folder), and the measured
    serving figures. The test that compares the live tuner's ladder with the replay's builds
    its own."""
    spec = app.spec.model_dump(mode="json")
    for model in spec["models"]:
        if model.get("profiles"):
            model["profiles"] = Path(model["profiles"]).read_text()
    serving = [app.serving_overhead_ms, list(app.serving_overhead_quantiles_ms), app.serving_cpu_ms]
    key = json.dumps([plan.document, spec, serving, dict(app.prices_usd_per_hr)], sort_keys=True)
    if key not in _LADDERS:
        _LADDERS[key] = live_tuner.plan_ladders(app, plan)
    return dict(_LADDERS[key])


def remembering_tuner(
    store: Store, clock: FakeClock, arrivals: Callable[[str], np.ndarray]
) -> LiveTuner:
    """A live tuner on ``clock`` that sees ``arrivals``, its work done at once and its ladders
    remembered (:func:`remembered_ladders`)."""
    return LiveTuner(
        store, clock, arrivals, resolve, submit=lambda work: work(), build_curve=remembered_ladders
    )


def target(stage: TunerStage, load: float, budget: float) -> dict[str, int]:
    prices = {t: 0.05 if t == SMALL else 0.1 for t in stage.rate_per_instance_qps}
    fleet = ladder_fleet(stage, stage.capacity_at_load_qps(load), prices, budget)
    return {t: n for t, n in (fleet or {}).items() if n}


def test_the_planner_the_replay_and_the_live_tuner_size_alike(store: Store, tmp_path: Path) -> None:
    budget = 2.0
    app = applied_plan(store, tmp_path, RATE_QPS, budget)
    resolved = resolve(app)
    record = store.get_applied_plan(APP)
    assert record is not None
    planning, _ = planning_trace(resolved, replanning_request(record.plan))
    (planned_stage,) = record.plan.stages

    # The planner at each load: its own fleet for the planning trace at f times its rate.
    by_planner = {}
    for load in (1.0, 2.0):
        plan = plan_app(resolved, scale_trace(planning, load * RATE_QPS), seed=0)
        by_planner[load] = {t: n for t, n in plan.stages[0].fleet.items() if n}

    # The replay's tuner, on the ladder the replay command builds.
    ladder = build_ladder(
        resolved,
        "tiny",
        planning,
        dispatch=planned_stage.policy,
        also_types=list(planned_stage.fleet),
        burstiness=DEFAULT_BURSTINESS,
    )
    assert ladder is not None
    replayed, _, _ = ladder_tuner(planning, resolved, planned_stage, planning.arrival_s, ladder)

    # The live tuner, building its ladder (run at once here instead of on a thread).
    clock = FakeClock(start_s=1000.0)
    arrivals = 940.0 + np.arange(int(60 * RATE_QPS)) / RATE_QPS
    tuner = LiveTuner(store, clock, lambda _app: arrivals, resolve, submit=lambda work: work())
    tuner.tick()
    (live,) = tuner.stages(APP)

    assert live.ladder == replayed.ladder
    # Both sized for the other burstinesses alike: the planning trace is Poisson (CV^2 about 1),
    # so ladders for 2, 4 and 8.
    assert live.cv2 == replayed.cv2 and live.cv2 is not None and 0.8 < live.cv2 < 1.25
    assert [round(c) for c, _, _ in live.burstiness] == [2, 4, 8]
    assert [(c, e, s.ladder) for c, e, s in live.burstiness] == [
        (c, e, s.ladder) for c, e, s in replayed.burstiness
    ]
    assert dict(live.rate_per_instance_qps) == dict(replayed.rate_per_instance_qps)
    for load, fleet in by_planner.items():
        assert target(replayed, load, budget) == fleet, load
        assert target(live, load, budget) == fleet, load
    # The plan applied is the planner's at its rate, and what the live tuner wants to start.
    assert by_planner[1.0] == {t: n for t, n in planned_stage.fleet.items() if n}
    assert {t: n for t, n in tuner.desired_fleet(app).items() if n} == by_planner[1.0]


def test_a_ladder_ends_below_the_serving_processs_capacity(store: Store, tmp_path: Path) -> None:
    """An app whose serving process carries 100 qps (10 ms of its CPU a query), planned at 40:
    the rungs past 100 qps are left out (no fleet serves them), the ones below are the
    planner's, and the plan at 3x is refused with the reason."""
    app = applied_plan(store, tmp_path, RATE_QPS, 2.0)
    resolved = dataclasses.replace(resolve(app), serving_cpu_ms=10.0)
    record = store.get_applied_plan(APP)
    assert record is not None
    planning, _ = planning_trace(resolved, replanning_request(record.plan))
    (planned_stage,) = record.plan.stages
    said: list[str] = []
    ladder = build_ladder(
        resolved,
        "tiny",
        planning,
        dispatch=planned_stage.policy,
        loads=(0.5, 1.0, 2.0, 3.0, 5.0),
        progress=said.append,
    )
    assert ladder is not None
    loads = [f for f, _ in ladder.rungs]
    assert loads and max(loads) * RATE_QPS < 100.0 and 2.0 in loads
    assert any("x3: none" in line and "at most 100 qps" in line for line in said)
    with pytest.raises(ServingCapacityError, match="at most 100 qps"):
        plan_app(resolved, scale_trace(planning, 3.0 * RATE_QPS), seed=0)


def priced_fleet(
    store: Store,
    clock: FakeClock,
    tuner: LiveTuner,
    prices: dict[str, float],
    qps: dict[str, float],
) -> tuple[FakeProvisioner, Reconciler]:
    """The fake provisioner and the reconciler that carries out ``tuner``'s fleet at ``prices``
    (type -> USD/hr), each type serving ``qps``."""
    fake = FakeProvisioner(now=clock.utcnow)
    reconciler = Reconciler(
        store,
        fake,
        clock,
        lambda _app: AppPricing(prices, qps),
        desired_fleet=tuner.desired_fleet,
    )
    return fake, reconciler


def small_and_large_fleet(
    store: Store, clock: FakeClock, tuner: LiveTuner
) -> tuple[FakeProvisioner, Reconciler]:
    """:func:`priced_fleet` with smalls at $0.05/hr (25 qps) and larges at $0.1/hr (100 qps)."""
    return priced_fleet(store, clock, tuner, {SMALL: 0.05, LARGE: 0.1}, {SMALL: 25.0, LARGE: 100.0})


def test_a_blip_makes_the_live_tuner_launch_nothing(store: Store, tmp_path: Path) -> None:
    # Planned at 5 qps; one instance serves far more. 56 queries inside one second, once.
    applied_plan(store, tmp_path, 5.0, budget=1.0)
    clock = FakeClock(start_s=1000.0)
    steady = 700.0 + np.arange(int(400 * 5.0)) / 5.0  # 5 qps from 700 s to 1100 s
    blip = 1020.0 + np.arange(56) / 56
    seen = np.sort(np.concatenate([steady, blip]))
    tuner = remembering_tuner(store, clock, lambda _app: seen[seen <= clock.now_s()])
    record = store.get_applied_plan(APP)
    assert record is not None
    planned = {t: n for t, n in record.plan.stages[0].fleet.items() if n}
    fake, reconciler = small_and_large_fleet(store, clock, tuner)
    reconciler.run_once()
    launched_at_start = len(fake.list({}))
    assert launched_at_start == sum(planned.values())
    for _ in range(80):  # 1000 s to 1080 s: before, during and after the blip
        clock.advance(1.0)
        tuner.tick()
        reconciler.run_once()
    kinds = [d.kind for d in store.list_decisions(APP)]
    assert "scale_up" not in kinds
    assert len(fake.list({})) == launched_at_start
    desired = tuner.desired_fleet(store.get_app(APP))
    assert {t: n for t, n in desired.items() if n} == planned


def test_a_cascade_is_sized_by_its_stage_ladders_in_the_replay_and_live_alike(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ladders at three loads, unrefined, for the planning trace's burstiness only (the defaults
    # are tens of plans of the whole cascade; tests/unit/test_cascade_ladders.py covers
    # refinement and burstiness): the same short ladders for the live tuner and the replay.
    short = functools.partial(cascade_sizing, loads=CASCADE_LOADS, burstiness=(), refine=0.0)
    monkeypatch.setattr(live_tuner, "cascade_sizing", short)
    write_cascade_app(tmp_path, records=True)
    written = load_spec(tmp_path / "cascade-True-0.6-50.yaml")
    store.create_app({**spec_document(written), "name": APP}, who="test")
    app = store.get_app(APP)
    resolved = resolve(app)
    planning, _ = planning_trace(resolved, PlanRequest(rate_qps=CASCADE_RATE_QPS, seed=0))
    document = plan_app(resolved, planning, seed=0).to_document()
    document["seed"] = 0
    store.apply_plan(APP, store.create_plan(APP, document).id)
    app = store.get_app(APP)
    record = store.get_applied_plan(APP)
    assert record is not None and len(record.plan.stages) == 2
    planning, _ = planning_trace(resolved, replanning_request(record.plan))
    prices = resolved.prices_usd_per_hr

    # The planner at 2x: each stage's fleet in its plan of the whole cascade (its plans at the
    # other loads are the ladders' rungs: tests/unit/test_cascade_ladders.py).
    by_planner = {
        s.name: {t: n for t, n in s.fleet.items() if n}
        for s in plan_app(resolved, scale_trace(planning, 2 * CASCADE_RATE_QPS)).stages
    }
    # The replay's ladders (heteroplane replay's cascade sizing), and the live tuner's.
    replayed, _ = short(resolved, record.plan, planning, seed=0)
    clock = FakeClock(start_s=1000.0)
    arrivals = 940.0 + np.arange(int(60 * CASCADE_RATE_QPS)) / CASCADE_RATE_QPS
    tuner = LiveTuner(
        store,
        clock,
        lambda _app: arrivals,
        resolve,
        submit=lambda work: work(),
        cascade_ladders=True,
    )
    assert tuner.tick() == []  # at the planned rate the plan's fleet stays
    live = {stage.name: stage for stage in tuner.stages(APP)}
    assert set(live) == set(replayed) == {"cheap", "large"}
    budget = resolved.constraints.budget_usd_per_hr
    for name, stage in live.items():
        assert stage.model == "curve" and stage.ladder is not None, name
        assert stage.ladder == tuple((f, dict(r)) for f, r in replayed[name].rungs)
        for load in CASCADE_LOADS:
            fleet = ladder_fleet(stage, stage.capacity_at_load_qps(load), prices, budget)
            assert {t: n for t, n in (fleet or {}).items() if n} == dict(
                replayed[name].fleet_at(load)
            ), (name, load)
        assert dict(replayed[name].fleet_at(2.0)) == by_planner[name]
    planned = {s.name: {t: n for t, n in s.fleet.items() if n} for s in record.plan.stages}
    assert sum(by_planner["large"].values()) > sum(planned["large"].values())

    # Twice the planned load for long: every stage grows to (at least) its planner's fleet at
    # 2x, reading the app's arrivals against the app's planned envelope.
    for _ in range(4):
        clock.advance(30.0)
        now = clock.now_s()
        rate = 2 * CASCADE_RATE_QPS
        arrivals = now - 60.0 + np.arange(int(60 * rate)) / rate
        tuner.tick()
    ups = [d for d in store.list_decisions(APP) if d.kind == "scale_up"]
    assert "large" in {d.numbers["stage"] for d in ups}
    assert all(d.numbers["model"] == "curve" and d.numbers["model_note"] is None for d in ups)
    wanted = tuner.desired_fleet(store.get_app(APP))
    for t in prices:
        assert wanted.get(t, 0) >= sum(f.get(t, 0) for f in by_planner.values()), t


def stepped_arrivals(clock: FakeClock, rates: list[tuple[float, float]], _app: str) -> np.ndarray:
    """The last minute of evenly spaced arrivals at ``rates`` ((from when, qps), in order) up to
    the clock's now."""
    now = clock.now_s()
    ends = [start for start, _ in rates[1:]] + [now]
    parts = [
        np.arange(np.ceil(max(start, now - 60.0) * rate), np.floor(end * rate) + 1) / rate
        for (start, rate), end in zip(rates, ends, strict=True)
        if end > now - 60.0
    ]
    arrivals = np.unique(np.concatenate(parts))
    return arrivals[arrivals <= now]


def stepped_tuner(store: Store, clock: FakeClock, rates: list[tuple[float, float]]) -> LiveTuner:
    """A live tuner on ``clock`` whose arrivals are :func:`stepped_arrivals` at ``rates`` (a list
    the test appends to), its ladders built at once (remembered: :func:`remembered_ladders`)."""
    return remembering_tuner(store, clock, functools.partial(stepped_arrivals, clock, rates))


def run_ticks(
    clock: FakeClock,
    tuner: LiveTuner,
    reconciler: Reconciler,
    fake: FakeProvisioner,
    seconds: int,
    check: Callable[[], None] = lambda: None,
) -> None:
    """``seconds`` ticks of a second: the tuner, the reconciler and the fake provisioner each
    take one, then ``check``."""
    for _ in range(seconds):
        clock.advance(1.0)
        tuner.tick()
        reconciler.run_once()
        fake.step()
        check()


def test_a_budget_cut_after_a_mix_change_keeps_the_app_serving_within_it(
    store: Store, tmp_path: Path
) -> None:
    """Planned at 8 qps on one small; at 60 qps the sizing model adds larges ($0.1/hr each).
    The budget is cut to $0.05/hr, which one small (the plan's floor) fits, so the API takes
    it unforced. The tuner sheds the larges and keeps the small that serves; once the ladders
    for the new budget (which place no large) are built, it sizes on them. It kept a large
    (over the budget, drained by the reconciler, never bought back: nothing served), and the
    new ladders were a KeyError, a ``tuner_failed`` decision and the tuner set up again."""
    applied_plan(store, tmp_path, 8.0, budget=0.3)
    record = store.get_applied_plan(APP)
    assert record is not None and dict(record.plan.stages[0].fleet) == {SMALL: 1}
    clock = FakeClock(start_s=1000.0)
    rates = [(0.0, 8.0)]
    seen = functools.partial(stepped_arrivals, clock, rates)
    queued: list[Callable[[], None]] = []  # the builds held back once the budget is cut

    def submit(work: Callable[[], None]) -> None:
        if rates[-1][1] == 60.0 and store.get_app(APP).budget_usd_per_hr < 0.3:
            queued.append(work)
        else:
            work()

    tuner = LiveTuner(store, clock, seen, resolve, submit=submit, build_curve=remembered_ladders)
    fake, reconciler = small_and_large_fleet(store, clock, tuner)

    def within_and_serving() -> None:
        app = store.get_app(APP)
        wanted = tuner.desired_fleet(app)
        cost = sum(n * (0.05 if t == SMALL else 0.1) for t, n in wanted.items())
        assert cost <= app.budget_usd_per_hr + 1e-9, (clock.now_s(), dict(wanted))
        running = [i for i in fake.list({}) if i.state == "running"]
        assert running, clock.now_s()

    def tick(seconds: int) -> None:
        run_ticks(clock, tuner, reconciler, fake, seconds, within_and_serving)

    tick(5)
    rates.append((clock.now_s(), 60.0))
    tick(40)
    assert tuner.desired_fleet(store.get_app(APP)).get(LARGE, 0) >= 1  # the mix moved
    (small,) = [i.provider_id for i in fake.list({}) if i.instance_type == SMALL]

    change_budget(store, AppResolver(tmp_path), APP, 0.05, reason="test", who="test")
    tick(20)
    assert len(queued) == 1
    queued.pop()()
    tick(20)
    (stage,) = tuner.stages(APP)
    assert stage.model == "curve" and LARGE not in dict(stage.ladder or ())[1.0]
    assert [i.provider_id for i in fake.list({}) if i.state == "running"] == [small]
    assert [d for d in store.list_decisions(APP) if d.kind == "tuner_failed"] == []
    # The costs the decisions state are the fleet's, without float noise (0.15000000000000002).
    costs = [d.numbers.get("cost_usd_per_hr_after") for d in store.list_decisions(APP)]
    tuned = [c for c in costs if c is not None]
    assert 0.15 in tuned and all(len(repr(c)) <= 12 for c in tuned), tuned


@pytest.mark.parametrize("first", ["tuner", "reconciler"])
@pytest.mark.parametrize("booted", [False, True], ids=["booting", "booted"])
def test_a_budget_cut_during_a_rise_keeps_the_instance_that_serves(
    store: Store, tmp_path: Path, first: str, booted: bool
) -> None:
    """Planned at 8 qps on one small; at 60 qps the sizing model adds two larges ($0.1/hr
    each) beside it. The budget is then cut to $0.1/hr: the small and one large no longer fit
    together. While the larges still boot (``booting``), the small is kept and the larges go,
    whether the tuner's shed or the reconciler's budget guard sees the cut first: the shed
    stopped the small (the least capacity per USD/hr lost) and the guard drained it (the least
    cost-effective), and the app served nothing until a large booted. Once the larges serve
    (``booted``), the small and one large go, as before. Either way the cut's
    ``budget_drain`` decision names what goes: it kept the small as its stage's last instance
    and named the larges, where the small was stopped."""
    applied_plan(store, tmp_path, 8.0, budget=0.3)
    clock = FakeClock(start_s=1000.0)
    rates = [(0.0, 8.0)]
    tuner = stepped_tuner(store, clock, rates)
    fake, reconciler = small_and_large_fleet(store, clock, tuner)
    if not booted:
        fake.never_run(LARGE)  # the larges boot for longer than the test looks

    def serving() -> None:
        live = [(i.instance_type, i.state) for i in fake.list({})]
        assert any(state == "running" for _, state in live), (clock.now_s(), live)

    def within_and_serving() -> None:
        app = store.get_app(APP)
        wanted = tuner.desired_fleet(app)
        cost = sum(n * (0.05 if t == SMALL else 0.1) for t, n in wanted.items())
        assert cost <= app.budget_usd_per_hr + 1e-9, (clock.now_s(), dict(wanted))
        serving()

    def kept() -> dict[str, str]:
        rows = store.list_instances(APP, states=["requested", "pending", "running"])
        return {i.id: i.instance_type for i in rows}

    run_ticks(clock, tuner, reconciler, fake, 5, within_and_serving)
    rates.append((clock.now_s(), 60.0))
    # The tuner reads a large as serving once its row runs and its modelled 30 s boot is up;
    # a few seconds later it stops the small (its 2,000-odd arrivals tell the rate well enough for
    # a scale-down before its minute's window), so the cut comes while all three serve.
    run_ticks(clock, tuner, reconciler, fake, 40 if booted else 15, within_and_serving)
    before = kept()
    assert sorted(before.values()) == [LARGE, LARGE, SMALL]
    states = {i.instance_type: i.state for i in fake.list({})}
    assert states == {SMALL: "running", LARGE: "running" if booted else "pending"}, states
    (small,) = [i for i, t in before.items() if t == SMALL]
    last = max(d.id for d in store.list_decisions(APP))

    change_budget(store, AppResolver(tmp_path), APP, 0.1, reason="test", who="test")
    if first == "reconciler":  # the guard acts on the cut before the tuner reads it
        reconciler.run_once()
        fake.step()
        serving()
    run_ticks(clock, tuner, reconciler, fake, 10, within_and_serving)

    after = [d for d in store.list_decisions(APP) if d.id > last]
    (drain,) = [d for d in after if d.kind == "budget_drain"]
    gone = set(before) - set(kept())
    assert gone == set(drain.numbers["drain"]), (drain.reason, [d.reason for d in after])
    if booted:
        assert sorted(before[i] for i in gone) == [LARGE, SMALL]
    else:
        assert small not in gone and sorted(before[i] for i in gone) == [LARGE, LARGE]
        assert not [
            d for d in after if d.kind == "scale_down" and d.numbers["instance_type"] == SMALL
        ]
    running = {i.instance_type for i in fake.list({}) if i.state == "running"}
    assert running == ({LARGE} if booted else {SMALL}), running


GPU = "emu.gpu"


def test_a_mix_change_stops_the_old_mix_only_once_the_new_one_serves(
    store: Store, tmp_path: Path
) -> None:
    """Planned at 100 qps on five smalls; at 300 qps the sizing model moves the stage to one
    gpu ($0.526/hr, 500 qps). The gpu's worker takes minutes to serve (an image pulled, models
    loaded), not the tuner's modelled minute: the smalls stay until its row runs, then go. They
    were stopped a minute after the gpu's launch, and the stage served on the one small the
    reconciler's guard kept (the disruption budget draining the others one a minute)."""
    document = {
        **spec(tmp_path, 2.0),
        "models": tiny_models(tmp_path / "gpu-profiles.json", {SMALL: 40.0, GPU: 2.0}),
        "instance_types": [SMALL, GPU],
    }
    store.create_app(document, who="test")
    app = store.get_app(APP)
    trace, _ = planning_trace(resolve(app), PlanRequest(rate_qps=100.0, seed=0))
    planned = plan_app(resolve(app), trace, seed=0).to_document()
    store.apply_plan(APP, store.create_plan(APP, {**planned, "seed": 0}).id)
    assert {t: n for t, n in planned["stages"][0]["fleet"].items() if n} == {SMALL: 5}
    clock = FakeClock(start_s=1000.0)
    rates = [(0.0, 100.0)]
    tuner = stepped_tuner(store, clock, rates)
    fake, reconciler = priced_fleet(
        store, clock, tuner, {SMALL: 0.05, GPU: 0.526}, {SMALL: 25.0, GPU: 500.0}
    )
    fake.never_run(GPU)  # its worker serves when the test says

    def tick(seconds: int) -> None:
        run_ticks(clock, tuner, reconciler, fake, seconds)

    def serving(name: str) -> int:
        return sum(1 for i in fake.list({}) if i.instance_type == name and i.state == "running")

    tick(10)
    rates.append((clock.now_s(), 300.0))
    tick(150)  # the gpu still boots, two and a half minutes after its launch
    kinds = [(d.kind, d.numbers.get("instance_type")) for d in store.list_decisions(APP)]
    assert ("scale_up", GPU) in kinds and not [k for k, _ in kinds if k == "scale_down"]
    smalls = serving(SMALL)
    assert smalls >= 5 and serving(GPU) == 0

    (gpu,) = [i.provider_id for i in fake.list({}) if i.instance_type == GPU]
    fake.set_state(gpu, "running")
    tick(5)
    downs = [d for d in store.list_decisions(APP) if d.kind == "scale_down"]
    assert [(d.numbers["instance_type"], d.numbers["count"]) for d in downs] == [(SMALL, smalls)]
    assert tuner.desired_fleet(store.get_app(APP)) == {SMALL: 0, GPU: 1}


def test_the_live_dispatcher_judges_its_kairos_base_as_the_planner_does(
    store: Store, tmp_path: Path
) -> None:
    """The service measured 190 ms of its own per query of a 200 ms SLO: the planner judges a
    mix's Kairos base against the 10 ms left, which only the large (10 ms a query) meets. The
    live dispatcher judged it against the whole SLO, where the small (15 ms, more queries per
    USD/hr) ranked first and became the base of a stage the plan does not rank (no plan yet, a
    type the tuner added)."""
    document = {
        **spec(tmp_path, 1.0),
        "models": tiny_models(tmp_path / "mixed.json", {SMALL: 15.0, LARGE: 10.0}),
    }
    store.create_app(document, who="test")
    store.set_serving_overhead(APP, 190.0, 100)
    resolver = AppResolver(tmp_path, overheads=stored_overhead(store))
    resolved = resolver.resolve(store.get_app(APP).spec, check_budget=False)
    profiles = {t: resolved.profile("tiny", t) for t in (SMALL, LARGE)}
    planned = dispatch_choice(
        None,
        profiles,
        resolved.prices_usd_per_hr,
        np.ones(1, dtype=np.int64),
        resolved.constraints.stage_slo_ms,
    )
    assert planned == ("kairos", [LARGE])

    placement = Placement()
    placement.update(
        [WorkerEndpoint("i-s", SMALL, "s:1"), WorkerEndpoint("i-l", LARGE, "l:1")], 0.0
    )
    stage = ServingStage("tiny")
    placement.place(load_config(store, resolver, APP), {"tiny": stage})
    assert isinstance(stage.policy, KairosPolicy)
    assert (stage.policy_name, stage.policy.base_type) == ("kairos", LARGE)


def test_a_one_type_plans_ladder_measures_its_mixes_as_the_planner_dispatches_them(
    store: Store, tmp_path: Path
) -> None:
    """Planned at 80 qps on one large (FCFS, the single-type rule); at 1.25x the planner adds a
    small and dispatches the mix by Kairos' matching. The ladder the live tuner and the replay
    size with measures capacity by that dispatch's bound (the Kairos bound over the ladder's
    types), as the live dispatcher and the replay now serve the mix; it took the plan's FCFS and
    summed the rates, a unit no dispatcher of the mix ran."""
    app = applied_plan(store, tmp_path, 80.0, 2.0)
    record = store.get_applied_plan(APP)
    assert record is not None
    (planned,) = record.plan.stages
    assert (dict(planned.fleet), planned.policy) == ({LARGE: 1}, "fcfs")
    resolved = resolve(app)
    loads = (1.0, 1.25)
    live = live_tuner._plan_ladder(resolved, record, loads)
    planning, _ = planning_trace(resolved, replanning_request(record.plan))
    replayed, _ = replay_sizing(resolved, planned, planning, burstiness=(), loads=loads)
    assert replayed is not None
    mixed = dict(live.fleet_at(1.25))
    assert mixed == {LARGE: 1, SMALL: 1}
    rung = plan_app(resolved, scale_trace(planning, 1.25 * 80.0), seed=0).stages[0]
    assert (dict(rung.fleet), rung.policy) == (mixed, "kairos")
    for ladder in (live, replayed):
        assert ladder.capacity_model is not None
        assert ladder.capacity_qps(mixed) == pytest.approx(ladder.capacity_model(mixed))


def test_a_plan_made_on_recorded_traffic_is_laddered_on_its_burstiness(
    store: Store, tmp_path: Path
) -> None:
    """A plan the traffic re-planner made on recorded arrivals of CV^2 4 stores no generator
    parameters, only their statistics. The rollout loop plans it again on gamma arrivals of that
    CV^2 (``burstiness_replanning_request``); the live tuner's ladder must be planned on the same
    load, not on a Poisson stand-in (CV^2 1) that reads the traffic smoother than it was."""
    app = applied_plan(store, tmp_path, RATE_QPS, 2.0)
    record = store.get_applied_plan(APP)
    assert record is not None
    document = record.plan.to_document()
    document["trace"] = {"source": "recorded traffic", "rate_qps": RATE_QPS, "cv2": 4.0}
    store.apply_plan(APP, store.create_plan(APP, document).id)
    recorded = store.get_applied_plan(APP)
    assert recorded is not None
    ladder = live_tuner.plan_ladder(resolve(app), recorded)
    assert ladder.cv2 is not None and 2.5 < ladder.cv2 < 6.0


def restarted(
    store: Store, tmp_path: Path, after: Callable[[float], np.ndarray]
) -> tuple[FakeClock, LiveTuner, Reconciler, FakeProvisioner, int]:
    """An app planned at 5 qps served at that rate until its service stops at 1010 s; it serves
    again from 1020 s, its tuner and serving loop new (their memory of arrivals lost), the plan's
    fleet still running: the clock at 1020 s, the restarted tuner (its arrivals ``after(now)``,
    those since 1020 s), its reconciler, the fake provisioner and how many instances it runs."""
    applied_plan(store, tmp_path, 5.0, budget=1.0)
    clock = FakeClock(start_s=1000.0)
    steady = 700.0 + np.arange(int(310 * 5.0)) / 5.0  # 5 qps from 700 s to 1010 s
    before = remembering_tuner(store, clock, lambda _app: steady[steady <= clock.now_s()])
    fake, reconciler = small_and_large_fleet(store, clock, before)
    reconciler.run_once()
    run_ticks(clock, before, reconciler, fake, 10)
    running = len(fake.list({}))
    assert running and "scale_up" not in [d.kind for d in store.list_decisions(APP)]
    clock.advance(10.0)  # down from 1010 s to 1020 s
    tuner = remembering_tuner(store, clock, lambda _app: after(clock.now_s()))
    reconciler = Reconciler(
        store,
        fake,
        clock,
        lambda _app: AppPricing({SMALL: 0.05, LARGE: 0.1}, {SMALL: 25.0, LARGE: 100.0}),
        desired_fleet=tuner.desired_fleet,
    )
    return clock, tuner, reconciler, fake, running


def test_a_restarted_services_backlog_makes_the_live_tuner_launch_nothing(
    store: Store, tmp_path: Path
) -> None:
    # The clients' 10 s of queries held while the service was down (50 at 5 qps) reach it in
    # its first second back, then 5 qps as before: the same load, read by a memory too young
    # for the persistence test (docs/tuner.md, "Noise: the persistence test").
    backlog = 1020.0 + np.arange(50) / 50
    steady = 1021.0 + np.arange(int(80 * 5.0)) / 5.0
    seen = np.sort(np.concatenate([backlog, steady]))
    clock, tuner, reconciler, fake, running = restarted(
        store, tmp_path, lambda now: seen[seen <= now]
    )
    run_ticks(clock, tuner, reconciler, fake, 80)  # 1020 s to 1100 s
    assert "scale_up" not in [d.kind for d in store.list_decisions(APP)]
    assert len(fake.list({})) == running


def test_a_rise_at_a_restart_still_scales_the_live_tuner_up(store: Store, tmp_path: Path) -> None:
    # The service comes back to 40 qps, eight times its plan's rate, and it lasts: bought after
    # the hold of a young memory (test_a_restarted_services_backlog_makes_the_live_tuner_launch_
    # nothing), within a second of the memory spanning twice the persistence, 15 s.
    rising = 1020.0 + np.arange(int(80 * 40.0)) / 40.0
    clock, tuner, reconciler, fake, running = restarted(
        store, tmp_path, lambda now: rising[rising <= now]
    )
    run_ticks(clock, tuner, reconciler, fake, 40)  # 1020 s to 1060 s
    ups = [d for d in store.list_decisions(APP) if d.kind == "scale_up"]
    # Bought once the memory spans twice the persistence (30 s), on the plan's fleet until then.
    assert ups and min(float(d.numbers["at_s"]) for d in ups) <= 1020.0 + 2 * 15.0 + 1.0
    assert len(fake.list({})) > running


def test_a_rise_that_fills_the_arrivals_ring_is_bought_by_the_live_tuner(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The serving loop keeps the last ARRIVALS_KEPT arrivals (262,144): past about 8,700 qps
    # they span less than the persistence test's 30 s, and a memory held young until it spans
    # that would never grow the stage. The ring made 200 arrivals here (5 s at 40 qps).
    monkeypatch.setattr(live_tuner, "ARRIVALS_KEPT", 200)
    rising = 1020.0 + np.arange(int(80 * 40.0)) / 40.0

    def ring(now: float) -> np.ndarray:
        seen = rising[rising <= now]
        return seen[-200:]

    clock, tuner, reconciler, fake, running = restarted(store, tmp_path, ring)
    run_ticks(clock, tuner, reconciler, fake, 40)  # 1020 s to 1060 s
    assert "scale_up" in [d.kind for d in store.list_decisions(APP)]
    assert len(fake.list({})) > running


def test_load_after_an_idle_gap_buys_nothing_for_its_opening_burst(
    store: Store, tmp_path: Path
) -> None:
    # 5 qps until 1010 s, nothing for two minutes, then a burst of 50 queries in a second and
    # 5 qps again: the tuner's memory holds only the new load, too young for the persistence test.
    applied_plan(store, tmp_path, 5.0, budget=1.0)
    clock = FakeClock(start_s=1000.0)
    before = 700.0 + np.arange(int(310 * 5.0)) / 5.0
    burst = 1130.0 + np.arange(50) / 50
    after = 1131.0 + np.arange(int(60 * 5.0)) / 5.0
    seen = np.sort(np.concatenate([before, burst, after]))
    tuner = remembering_tuner(store, clock, lambda _app: seen[seen <= clock.now_s()])
    fake, reconciler = small_and_large_fleet(store, clock, tuner)
    reconciler.run_once()
    running = len(fake.list({}))
    run_ticks(clock, tuner, reconciler, fake, 190)  # 1000 s to 1190 s
    assert "scale_up" not in [d.kind for d in store.list_decisions(APP)]
    assert len(fake.list({})) == running
