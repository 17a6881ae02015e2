"""A cascade's stages sized by ladders (the one sizing model for cascades too): each stage's
ladder is its fleet in the planner's plans of the whole cascade, refined where the fleet
changes; the planning arrivals that reach a later stage are an independent thinning (as a
cascade forwards queries), so their burstiness is the stream's the stage sees."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

from controlplane.policies.capacity_curve import CASCADE_LADDER_REFINE, cascade_sizing
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app, scale_trace
from controlplane.policies.replay import parse_plan, replay, thin_planning_arrivals
from controlplane.policies.sizing import SizingLadder
from controlplane.spec import ResolvedApp
from estimator.envelope import arrival_cv2
from estimator.traces import Trace, constant_profile, renewal_arrivals
from tests.unit.test_planner import poisson_trace, write_cascade_app

RATE_QPS = 60.0
# 83 s of planning arrivals: the tuner reads windows up to 60 s against the planned envelope.
QUERIES = 5000
LOADS = (1.0, 2.0, 4.0)


def stage_fleets(plan_stages: Iterable[Any]) -> dict[str, dict[str, int]]:
    return {s.name: {t: n for t, n in s.fleet.items() if n} for s in plan_stages}


@pytest.fixture(scope="module")
def cascade(tmp_path_factory: pytest.TempPathFactory) -> tuple[ResolvedApp, Trace]:
    """The toy two-stage cascade and a Poisson planning trace at RATE_QPS."""
    app = write_cascade_app(tmp_path_factory.mktemp("cascade"), records=True)
    return app, poisson_trace(RATE_QPS, queries=QUERIES)


@pytest.fixture(scope="module")
def planned_at(cascade: tuple[ResolvedApp, Trace]) -> Callable[[float], PlanDocument]:
    """The planner's plan of the cascade for the planning trace at f times RATE_QPS, by f (each
    made once: the tests read the plans and change nothing)."""
    app, planning = cascade

    @functools.cache
    def at(load: float) -> PlanDocument:
        return plan_app(app, scale_trace(planning, load * RATE_QPS))

    return at


def test_each_stage_ladder_is_its_fleet_in_the_planners_plans_refined_where_it_changes(
    sized: tuple[Any, dict[str, Any], dict[str, Any]],
    planned_at: Callable[[float], PlanDocument],
) -> None:
    # The ladders the replay sizes the cascade with (cascade_sizing: build_ladders on the plan's
    # stages, refined to CASCADE_LADDER_REFINE).
    _plan, ladders, _options = sized
    assert set(ladders) == {"cheap", "large"}
    for load in LOADS:
        plan = planned_at(load)
        planned = stage_fleets(plan.stages)
        for name, ladder in ladders.items():
            assert ladder is not None
            assert dict(ladder.fleet_at(load)) == planned[name], (name, load)
            # The ladder keeps the planner's batch at each rung too.
            batch = next(s.batch_size for s in plan.stages if s.name == name)
            assert dict(ladder.batches)[load] == batch, (name, load)
    for ladder in ladders.values():
        assert ladder is not None
        assert [f for f, _ in ladder.batches] == [f for f, _ in ladder.rungs]
    large = ladders["large"]
    assert large is not None and dict(large.curve)[1.0] == 1.0
    assert [m for _, m in large.curve] == sorted(m for _, m in large.curve)
    # Refined: wherever some stage's fleet changes between two neighbouring loads, they are
    # within CASCADE_LADDER_REFINE (1.1x) of each other; nowhere else is a load added.
    every = sorted({f for ladder in ladders.values() if ladder for f, _ in ladder.rungs})
    assert len(every) > len(LOADS)  # the large stage's fleet changes between 2x and 4x
    for lo, hi in itertools.pairwise(every):
        changes = any(
            ladder is not None and dict(ladder.fleet_at(lo)) != dict(ladder.fleet_at(hi))
            for ladder in ladders.values()
        )
        assert not changes or hi / lo <= CASCADE_LADDER_REFINE + 1e-9, (lo, hi)
    assert all(2.0 < f < 4.0 for f in every if f not in LOADS)


def test_a_later_stage_sees_an_independent_thinning_of_the_planning_arrivals() -> None:
    rng = np.random.default_rng(3)
    arrivals = renewal_arrivals(constant_profile(200.0), 200.0, 4.0, rng)
    replayed = Trace(np.arange(1000.0), np.ones(1000, dtype=np.int64))
    reach = np.zeros(1000, dtype=bool)
    reach[::5] = True  # 20% of the replayed queries reach the stage
    kept = thin_planning_arrivals(arrivals, replayed, reach)
    assert kept.size == pytest.approx(0.2 * arrivals.size, rel=0.1)
    # Forwarding by input, not by time: CV^2 s c + 1 - s of a stream of CV^2 c at share s
    # (every fifth query instead would make it about c / 5).
    cv2, _ = arrival_cv2(kept)
    assert cv2 == pytest.approx(0.2 * 4.0 + 0.8, rel=0.2)
    np.testing.assert_array_equal(kept, thin_planning_arrivals(arrivals, replayed, reach))


@pytest.fixture(scope="module")
def sized(cascade: tuple[ResolvedApp, Trace]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The toy cascade's plan, its stages' ladders and the replay's options for them."""
    app, planning = cascade
    plan = parse_plan(plan_app(app, planning, seed=0).to_document())
    ladders, options = cascade_sizing(app, plan, planning, burstiness=(), loads=LOADS)
    return plan, dict(ladders), options


def four_times_then_planned() -> Trace:
    """Four times the planned rate for two minutes, then the planned rate for three."""
    rng = np.random.default_rng(4)
    high = renewal_arrivals(constant_profile(4 * RATE_QPS), 120.0, 1.0, rng)
    low = 120.0 + renewal_arrivals(constant_profile(RATE_QPS), 180.0, 1.0, rng)
    arrival_s = np.concatenate([high, low])
    return Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64))


def replay_step(app: ResolvedApp, planning: Trace, plan: Any, options: dict[str, Any]) -> Any:
    """The tuner's replay of :func:`four_times_then_planned` with ``options``."""
    return replay(
        four_times_then_planned(),
        app,
        plan,
        np.random.default_rng(5),
        policy="tuner",
        planning_arrival_s=planning.arrival_s,
        **options,
    )


@pytest.fixture(scope="module")
def stepped(
    cascade: tuple[ResolvedApp, Trace], sized: tuple[Any, dict[str, Any], dict[str, Any]]
) -> Any:
    """The tuner's replay of :func:`four_times_then_planned` on the :func:`sized` ladders (the
    tests read it and change nothing)."""
    app, planning = cascade
    plan, _ladders, options = sized
    return replay_step(app, planning, plan, options)


def test_the_cascade_tuner_follows_its_ladders_up_and_back(
    cascade: tuple[ResolvedApp, Trace],
    sized: tuple[Any, dict[str, Any], dict[str, Any]],
    stepped: Any,
    planned_at: Callable[[float], PlanDocument],
) -> None:
    app, _planning = cascade
    plan, ladders, _options = sized
    assert set(ladders) == {"cheap", "large"}
    planned = stage_fleets(plan.stages)
    busy = stage_fleets(planned_at(4.0).stages)
    assert busy["large"] != planned["large"]  # the load below needs another fleet
    # Four times the planned rate for two minutes, then the planned rate for three: the large
    # stage grows to the planner's fleet for 4x, and each stage ends on its planned fleet,
    # never over the budget.
    result = stepped
    by_name = {stage.name: stage for stage in result.stages}
    # Each decision names the ladder's fleet as its target (InferLine's model names none).
    assert result.decisions
    assert all("the sizing model's fleet" in d.reason for d in result.decisions)
    seen = [{t: n for t, n in w.fleet.items() if n} for w in by_name["large"].timeline]
    assert busy["large"] in seen
    for name, stage in by_name.items():
        assert {t: n for t, n in stage.timeline[-1].fleet.items() if n} == planned[name], name
    assert max(w.cost_usd_per_hr for w in result.timeline) <= app.constraints.budget_usd_per_hr


def rung_batch(ladder: SizingLadder | None, fleet: dict[str, int]) -> int:
    """The planner's batch at the highest load whose rung needs no more capacity than
    ``fleet`` has (the lowest rung's if none)."""
    assert ladder is not None
    batch_at = dict(ladder.batches)
    have = ladder.capacity_qps(fleet)
    reached = [f for f, rung in ladder.rungs if ladder.capacity_qps(rung) <= have + 1e-9]
    return batch_at[max(reached)] if reached else ladder.batches[0][1]


def test_a_stage_serves_with_the_batch_its_ladder_plans_for_its_fleet(
    cascade: tuple[ResolvedApp, Trace],
    sized: tuple[Any, dict[str, Any], dict[str, Any]],
    stepped: Any,
) -> None:
    app, planning = cascade
    plan, ladders, options = sized
    large = ladders["large"]
    result = stepped
    stage = next(s for s in result.stages if s.name == "large")
    # The large stage grows for the 4x load and shrinks back; its batch cap follows the rung
    # its ready fleet reaches, which differs between the two fleets here.
    fleets = {frozenset(w.fleet.items()) for w in stage.timeline}
    wanted = {rung_batch(large, dict(f)) for f in fleets if any(n for _, n in f)}
    assert len(wanted) > 1
    assert stage.batch_caps
    for t_s, cap in stage.batch_caps:
        ready = stage.fleet_timeline.ready_fleet_at(t_s, ())
        assert cap == rung_batch(large, ready), (t_s, ready)
    assert {cap for _, cap in stage.batch_caps} == wanted
    document = result.to_document()
    large_doc = next(s for s in document["stages"] if s["name"] == "large")
    assert large_doc["batch_caps"][0]["max_batch_queries"] == stage.batch_caps[0][1]
    # Without the rungs' batches the stage keeps its plan's batch, and the run differs.
    plain = {name: dataclasses.replace(ladder, batches=()) for name, ladder in ladders.items()}
    before = replay_step(app, planning, plan, {**options, "tuner_ladders": plain})
    assert all(not s.batch_caps for s in before.stages)
    assert before.p99_ms != result.p99_ms
