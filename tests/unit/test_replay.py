"""Replay (controlplane/policies/replay.py, ``heteroplane replay``): the static replay is a plain
simulation, the tuner and the utilisation autoscaler change the fleet with boot times, costs from
launch and the budget as a bound, and the command's JSON contract and bad input."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.cli import main
from controlplane.cli import replay as replay_cli
from controlplane.policies.pipeline import dispatch_choice
from controlplane.policies.plan import PlanDocument
from controlplane.policies.replay import (
    FleetTimeline,
    PlanError,
    ReplayError,
    ReplayResult,
    UtilizationConfig,
    check_plan,
    kairos_capacity_model,
    parse_plan,
    planning_arrivals,
    rate_per_instance_qps,
    replay,
    replay_timeline,
    reporting_ticks,
    tuner_timeline,
    utilization_timeline,
)
from controlplane.spec import ResolvedApp, load_spec, resolve_spec
from estimator.batches import parse_batch_distribution
from estimator.policies import policy_factory
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import RateProfile, Trace, renewal_arrivals, step_profile, write_trace_csv
from tests.conftest import KAIROS_CSV, needs_shared
from tests.unit.test_planner import write_cascade_app

GPU, CPU = "g4dn.xlarge", "r5n.large"  # 0.526 and 0.149 USD/hr in the shipped catalog
GPU_PRICE = 0.526
SLO_MS = 50.0

# g4dn: mean 10 ms at batch 1 (mu 100 qps); r5n: mean 25 ms (mu 40 qps).
PROFILES = {
    "format": "heteroplane.profiles/v1",
    "profiles": [
        {
            "model": "m",
            "instance_type": GPU,
            "batch_sizes": [1, 2],
            "latency_ms": [[8, 9, 10, 11, 12], [12, 14, 16, 18, 20]],
        },
        {
            "model": "m",
            "instance_type": CPU,
            "batch_sizes": [1, 2],
            "latency_ms": [[20, 22, 25, 28, 30], [40, 45, 50, 55, 60]],
        },
    ],
}


def write_app(tmp_path: Path, budget_usd_per_hr: float = 3.0) -> Path:
    (tmp_path / "p.json").write_text(json.dumps(PROFILES))
    spec = tmp_path / "app.yaml"
    spec.write_text(
        "name: replay-test\n"
        "models:\n  - name: m\n    profiles: p.json\n"
        f"slo:\n  latency_ms: {SLO_MS}\n"
        f"budget_usd_per_hr: {budget_usd_per_hr}\n"
        f"instance_types: [{GPU}, {CPU}]\n"
    )
    return spec


def app_of(tmp_path: Path, budget_usd_per_hr: float = 3.0) -> ResolvedApp:
    return resolve_spec(load_spec(write_app(tmp_path, budget_usd_per_hr)))


def plan_document(
    fleet: dict[str, int], name: str = "m", batch_size: int = 1, policy: str = "fcfs"
) -> dict[str, object]:
    return {
        "feasible": True,
        "cost_usd_per_hr": 0.0,
        "stages": [
            {
                "name": name,
                "fleet": fleet,
                "batch_size": batch_size,
                "predicted_p99_ms": 20.0,
                "throughput_qps": 100.0,
                "policy": policy,
            }
        ],
        "steps": [],
    }


def one_gpu() -> PlanDocument:
    return parse_plan(plan_document({GPU: 1}))


def trace_of(profile: RateProfile, duration_s: float, seed: int = 1, cv2: float = 1.0) -> Trace:
    arrivals = renewal_arrivals(profile, duration_s, cv2, np.random.default_rng(seed))
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def up_and_down() -> Trace:
    """50 qps, 150 qps from 300 s, 50 qps again from 600 s to 900 s (gamma gaps, CV^2 0.2)."""
    times = np.array([0.0, 300.0, 300.0, 600.0, 600.0])
    rates = np.array([50.0, 50.0, 150.0, 150.0, 50.0])
    return trace_of(RateProfile(times, rates), 900.0, cv2=0.2)


def steady_planning() -> np.ndarray:
    # Arrivals quieter than Poisson (CV^2 0.2) keep the tuner from reacting much to noise.
    return renewal_arrivals(step_profile(50.0, 50.0, 0.0), 120.0, 0.2, np.random.default_rng(7))


def never_over_budget(timeline: FleetTimeline, app: ResolvedApp) -> None:
    prices = app.prices_usd_per_hr
    assert timeline.peak_cost_usd_per_hr(prices) <= app.spec.budget_usd_per_hr + 1e-9


# --- the static fleet ------------------------------------------------------------------------


def test_with_the_tuner_off_the_replay_is_a_plain_simulation(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    plan = parse_plan(plan_document({GPU: 1, CPU: 1}))
    trace = trace_of(step_profile(40.0, 110.0, 60.0), 120.0)
    result = replay(trace, app, plan, np.random.default_rng(3), policy="static", admission=False)
    admitted = replay(trace, app, plan, np.random.default_rng(3), policy="static")

    profiles = {GPU: app.profile("m", GPU), CPU: app.profile("m", CPU)}
    prices = dict(app.prices_usd_per_hr)
    stage = Stage(
        "m",
        tuple(InstanceSpec(name) for name in plan.stages[0].fleet.expand()),
        profiles,
        policy_factory("fcfs", profiles, [])(),  # the planner's FCFS: the fastest idle first
    )
    plain = simulate(trace, [stage], np.random.default_rng(3), prices_usd_per_hr=prices)

    np.testing.assert_array_equal(result.simulation.finish_s, plain.finish_s)
    assert result.p99_ms == pytest.approx(float(np.percentile(plain.response_ms, 99)))
    assert result.cost_usd == pytest.approx(plain.cost_usd)
    assert result.refused_share == 0.0
    # By default the replay refuses what the service's admission control refuses: the plain
    # simulation with admission, whose refused queries are misses, never answered.
    gated = simulate(
        trace,
        [stage],
        np.random.default_rng(3),
        prices_usd_per_hr=prices,
        qos_ms=SLO_MS,
        admission=True,
    )
    np.testing.assert_array_equal(admitted.simulation.finish_s, gated.finish_s)
    refused = np.isinf(gated.finish_s)
    assert 0 < admitted.refused_share == pytest.approx(refused.mean())
    missed = np.count_nonzero(gated.response_ms > SLO_MS) / len(trace)
    assert admitted.slo_miss_share == pytest.approx(missed)
    # Refusing at the 110 qps step, where two instances serve about 140 qps at most, keeps the
    # admitted queries within the SLO: fewer misses than serving every query late.
    assert admitted.slo_miss_share < result.slo_miss_share
    assert result.scaling_actions == 0 and result.decisions == ()
    assert {tuple(w.fleet.items()) for w in result.timeline} == {((GPU, 1), (CPU, 1))}
    assert len(result.timeline) == 12  # windows at 0, 10, ..., 110 s


@pytest.mark.parametrize("policy", ["static", "tuner"])
def test_a_trace_longer_than_a_week_is_refused_in_one_line(tmp_path: Path, policy: str) -> None:
    # Two queries 1e8 s apart once filled memory with the timeline's windows (a typo's trace).
    app = app_of(tmp_path)
    plan = parse_plan(plan_document({GPU: 1, CPU: 1}))
    trace = Trace(np.array([0.0, 1e8]), np.ones(2, dtype=np.int64))
    with pytest.raises(ReplayError, match=r"^the trace spans 1e\+08 s; a replay takes at most"):
        replay(trace, app, plan, np.random.default_rng(3), policy=policy)


def test_the_plan_stage_policy_dispatches(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    plan = parse_plan(plan_document({GPU: 1, CPU: 2}, policy="kairos"))
    assert plan.stages[0].policy == "kairos"
    trace = trace_of(step_profile(60.0, 140.0, 60.0), 120.0)
    kairos = replay(trace, app, plan, np.random.default_rng(0), policy="utilization")
    fcfs = replay(trace, app, plan, np.random.default_rng(0), policy="utilization", dispatch="fcfs")
    assert kairos.decisions == fcfs.decisions  # pass 1 does not depend on the dispatcher
    assert not np.array_equal(kairos.simulation.finish_s, fcfs.simulation.finish_s)


def test_a_fleet_of_one_type_is_dispatched_fcfs_whatever_the_plan_names(tmp_path: Path) -> None:
    # The live dispatcher serves one type FCFS (placement.policy_name): a tuner that thins a
    # Kairos-dispatched mix to its GPU, or an oracle's minute of one type, replays so too.
    app = app_of(tmp_path)
    kairos = parse_plan(plan_document({GPU: 1, CPU: 1}, batch_size=2, policy="kairos")).stages[0]
    fcfs = parse_plan(plan_document({GPU: 1, CPU: 1}, batch_size=2, policy="fcfs")).stages[0]
    trace = trace_of(step_profile(110.0, 110.0, 0.0), 60.0)
    lone = FleetTimeline((InstanceSpec(GPU),))
    runs = [replay_timeline(trace, app, s, lone, np.random.default_rng(0)) for s in (kairos, fcfs)]
    assert np.array_equal(runs[0].simulation.finish_s, runs[1].simulation.finish_s)
    # Over a mix the plan's policy dispatches (Kairos sends each query alone: it is not FCFS).
    mix = FleetTimeline((InstanceSpec(GPU), InstanceSpec(CPU)))
    runs = [replay_timeline(trace, app, s, mix, np.random.default_rng(0)) for s in (kairos, fcfs)]
    assert not np.array_equal(runs[0].simulation.finish_s, runs[1].simulation.finish_s)
    # A mix thinned to one type half-way: the second half as FCFS serves it (the same batches,
    # once the queue the mix left is gone), the first half as Kairos does.
    thinned = FleetTimeline((InstanceSpec(GPU), InstanceSpec(CPU, 0.0, 30.0)))
    both = [
        replay_timeline(trace, app, s, thinned, np.random.default_rng(0)).simulation
        for s in (kairos, fcfs)
    ]
    late, early = both[0].arrival_s > 35.0, both[0].arrival_s < 25.0
    assert np.array_equal(both[0].finish_s[late], both[1].finish_s[late])
    assert not np.array_equal(both[0].finish_s[early], both[1].finish_s[early])


def test_a_mix_the_tuner_makes_of_a_one_type_plan_replays_as_the_planner_dispatches_it(
    tmp_path: Path,
) -> None:
    # A plan of one type names FCFS by the single-type rule; the tuner's mix of it (a rung of
    # the sizing ladder, which the planner dispatches by Kairos' matching) replays under the
    # planner's rule for a mix, as the live dispatcher serves it: Kairos over the full-range
    # base. It replayed FCFS, which the planner never ran on that mix.
    app = app_of(tmp_path)
    alone = parse_plan(plan_document({GPU: 1}, batch_size=2, policy="fcfs")).stages[0]
    trace = trace_of(step_profile(110.0, 110.0, 0.0), 60.0)
    mix = FleetTimeline((InstanceSpec(GPU), InstanceSpec(CPU)))

    def finish(dispatch: str | None) -> np.ndarray:
        rng = np.random.default_rng(0)
        return replay_timeline(trace, app, alone, mix, rng, dispatch=dispatch).simulation.finish_s

    assert np.array_equal(finish(None), finish("kairos"))
    assert not np.array_equal(finish(None), finish("fcfs"))


def test_the_replays_kairos_base_is_judged_at_the_slo_less_the_services_own_time(
    tmp_path: Path,
) -> None:
    # With 30 ms of the 50 ms SLO measured as the service's own, the planner's dispatch (and
    # the live dispatcher's) takes the g4dn.xlarge alone as a full-range base: the r5n.large's
    # 25 ms a query misses the 20 ms left. The replay judged the base at the whole SLO, where
    # the r5n.large (more queries per USD/hr) came first.
    plain = app_of(tmp_path)
    app = dataclasses.replace(plain, serving_overhead_ms=30.0)
    unranked = parse_plan(plan_document({GPU: 1, CPU: 1}, policy="kairos")).stages[0]
    document = plan_document({GPU: 1, CPU: 1}, policy="kairos")
    document["stages"][0]["base_types"] = [GPU]  # type: ignore[index]
    ranked = parse_plan(document).stages[0]
    mix = FleetTimeline((InstanceSpec(GPU), InstanceSpec(CPU)))
    trace = trace_of(step_profile(110.0, 110.0, 0.0), 30.0)
    measured = replay_timeline(trace, app, unranked, mix, np.random.default_rng(0))
    as_planned = replay_timeline(trace, plain, ranked, mix, np.random.default_rng(0))
    by_price = replay_timeline(trace, plain, unranked, mix, np.random.default_rng(0))
    assert np.array_equal(measured.simulation.finish_s, as_planned.simulation.finish_s)
    assert not np.array_equal(measured.simulation.finish_s, by_price.simulation.finish_s)


def test_fcfs_replays_the_fastest_idle_instance_first_as_served_live(tmp_path: Path) -> None:
    # docs/replay.md: FCFS serves the fastest idle instance first, as the live dispatcher (its
    # slots' speed ranks) and the planner do. The replay gave FCFS the full-range types as its
    # preferred order, the most throughput per dollar first: at a load one instance serves,
    # every query went to the slower CPU while the GPU stood idle.
    app = app_of(tmp_path)
    stage = parse_plan(plan_document({GPU: 1, CPU: 1}, policy="fcfs")).stages[0]
    mix = FleetTimeline((InstanceSpec(CPU), InstanceSpec(GPU)))
    trace = trace_of(step_profile(2.0, 2.0, 0.0), 30.0)  # one query every 0.5 s
    run = replay_timeline(trace, app, stage, mix, np.random.default_rng(0), admission=False)
    assert len(trace) > 10
    assert set(run.simulation.instance.tolist()) == {1}  # the GPU


def test_kairos_takes_its_base_in_the_plans_order(tmp_path: Path) -> None:
    # Both types serve every batch size within the SLO; by throughput per dollar the CPU comes
    # first, but a plan that ranks the GPU first is replayed (and served live) with it as base.
    app = app_of(tmp_path)
    mix = FleetTimeline((InstanceSpec(GPU), InstanceSpec(CPU), InstanceSpec(CPU)))
    trace = trace_of(step_profile(150.0, 150.0, 0.0), 30.0)

    def run(base_types: list[str] | None) -> np.ndarray:
        document = plan_document({GPU: 1, CPU: 2}, policy="kairos")
        if base_types is not None:
            document["stages"][0]["base_types"] = base_types  # type: ignore[index]
        stage = parse_plan(document).stages[0]
        return replay_timeline(trace, app, stage, mix, np.random.default_rng(0)).simulation.finish_s

    unranked = run(None)
    assert np.array_equal(run([CPU, GPU]), unranked)  # the plan's order is the default's here
    assert not np.array_equal(run([GPU, CPU]), unranked)


# --- the tuner -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step_replays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ReplayResult]:
    app = app_of(tmp_path_factory.mktemp("app"))
    trace, plan = up_and_down(), one_gpu()
    return {
        policy: replay(
            trace,
            app,
            plan,
            np.random.default_rng(0),
            policy=policy,
            planning_arrival_s=steady_planning(),
        )
        for policy in ("static", "tuner", "utilization")
    }


def test_a_step_up_launches_instances_that_serve_after_booting_and_cost_from_launch(
    step_replays: dict[str, ReplayResult],
) -> None:
    result = step_replays["tuner"]
    ups = [d for d in result.decisions if d.action == "scale_up" and d.at_s > 300.0]
    assert ups, result.decisions
    first = ups[0]
    assert 300.0 < first.at_s <= 305.0 and first.instance_type == GPU
    assert "window" in first.reason and "> planned" in first.reason

    instances = result.fleet_timeline.instances
    launched = [s for s in instances if s.billed_from_s == first.at_s]
    assert len(launched) == first.count
    for spec in launched:
        assert spec.ready_s == first.at_s + 60.0  # a GPU type boots in 60 s
    # No query starts on an instance before it is ready.
    sim = result.simulation
    ready = np.array([s.ready_s for s in instances])
    served = np.isfinite(sim.finish_s)
    assert np.all(sim.start_s[served] >= ready[sim.instance[served]] - 1e-9)
    # Billing runs from launch: the simulation's cost is exactly that integral.
    horizon = sim.horizon_s
    expected = sum(
        GPU_PRICE * (min(s.stop_s, horizon) - (s.billed_from_s or 0.0)) / 3600.0 for s in instances
    )
    assert result.cost_usd == pytest.approx(expected)
    # While they boot the timeline still shows the old fleet; after, the new one serves.
    by_t = {w.t_s: w for w in result.timeline}
    assert by_t[300.0].fleet[GPU] == 1
    assert by_t[380.0].fleet[GPU] >= 3
    cost_at = result.fleet_timeline.cost_usd_per_hr_at
    prices = {GPU: GPU_PRICE}
    assert cost_at(first.at_s, prices) - cost_at(first.at_s - 0.5, prices) == pytest.approx(
        first.count * GPU_PRICE
    )


def test_the_tuner_misses_the_slo_less_than_the_static_plan(
    step_replays: dict[str, ReplayResult],
) -> None:
    static, tuned = step_replays["static"], step_replays["tuner"]
    # One instance cannot serve 150 qps: the step's queries past its capacity are refused.
    assert static.slo_miss_share > 0.2 and static.refused_share > 0.1
    assert tuned.slo_miss_share < static.slo_miss_share / 3
    assert tuned.refused_share < static.refused_share / 3
    assert tuned.cost_usd > static.cost_usd


def test_a_step_down_removes_instances_after_the_delay(
    step_replays: dict[str, ReplayResult],
) -> None:
    result = step_replays["tuner"]
    downs = [d for d in result.decisions if d.action == "scale_down" and d.at_s > 600.0]
    assert downs, result.decisions
    # The tuner waits 15 s after the last change, and its recent envelope spans 60 s.
    assert downs[0].at_s >= 615.0
    assert "since the last change" in downs[0].reason
    by_t = {w.t_s: w for w in result.timeline}
    assert by_t[890.0].fleet[GPU] < by_t[590.0].fleet[GPU]
    assert by_t[890.0].cost_usd_per_hr < by_t[590.0].cost_usd_per_hr


def test_the_default_planning_trace_is_the_first_tenth() -> None:
    trace = up_and_down()
    planning = planning_arrivals(trace)
    assert planning[-1] <= trace.arrival_s[0] + 0.1 * trace.duration_s
    assert planning.size == np.count_nonzero(trace.arrival_s <= planning[-1])
    with pytest.raises(ReplayError, match="share"):
        planning_arrivals(trace, 0.0)


# --- the budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["static", "tuner", "utilization"])
def test_the_budget_is_never_exceeded(tmp_path: Path, policy: str) -> None:
    # 3 USD/hr buys 5 GPU instances; a jump to 1000 qps would need 10 or more.
    app = app_of(tmp_path, budget_usd_per_hr=3.0)
    trace = trace_of(step_profile(50.0, 1000.0, 20.0), 100.0)
    plan = parse_plan(plan_document({GPU: 2}))
    result = replay(
        trace,
        app,
        plan,
        np.random.default_rng(0),
        policy=policy,  # type: ignore[arg-type]
        boot_s={GPU: 5.0},  # so that the capped fleet serves within the trace
    )
    never_over_budget(result.fleet_timeline, app)
    assert all(w.cost_usd_per_hr <= 3.0 + 1e-9 for w in result.timeline)
    if policy != "static":
        assert any(d.action == "budget_capped" for d in result.decisions)
        assert max(w.fleet[GPU] for w in result.timeline) == 5


@settings(max_examples=15, deadline=None)
@given(
    budget=st.floats(0.6, 4.0),
    rates=st.lists(st.floats(5.0, 600.0), min_size=2, max_size=4),
    seed=st.integers(0, 1000),
)
def test_no_policy_ever_exceeds_the_budget(
    tmp_path_factory: pytest.TempPathFactory, budget: float, rates: list[float], seed: int
) -> None:
    app = app_of(tmp_path_factory.mktemp("app"), budget_usd_per_hr=budget)
    times = np.repeat(30.0 * np.arange(len(rates)), 2)[1:]
    profile = RateProfile(times, np.repeat(rates, 2)[:-1])
    trace = trace_of(profile, 30.0 * len(rates), seed)
    stage = check_plan(one_gpu(), app)
    for timeline in (
        tuner_timeline(trace, app, stage, planning_arrivals(trace)),
        utilization_timeline(trace, app, stage),
    ):
        never_over_budget(timeline, app)
        for spec in timeline.instances:
            assert spec.billed_from_s is not None
            assert spec.stop_s > spec.ready_s >= spec.billed_from_s


def test_a_plan_over_the_budget_is_refused(tmp_path: Path) -> None:
    app = app_of(tmp_path, budget_usd_per_hr=1.0)
    with pytest.raises(ReplayError, match="over the spec's budget"):
        check_plan(parse_plan(plan_document({GPU: 2})), app)


@pytest.mark.parametrize("name", ["cheap", "large"])
def test_one_stage_of_a_cascade_is_no_plan_of_it(tmp_path: Path, name: str) -> None:
    # Replayed, every query would be answered by that stage alone: a faster, cheaper app.
    app = write_cascade_app(tmp_path, records=True)
    plan = parse_plan(plan_document({CPU: 1}, name=name))
    with pytest.raises(ReplayError, match=r"not the spec's serving order \(cheap, large\)"):
        check_plan(plan, app)


def test_a_long_replay_says_how_far_into_the_trace_it_is(tmp_path: Path) -> None:
    # A tick a second whatever the queries: a sparse trace of a week ran minutes without a word.
    app = app_of(tmp_path)
    trace = trace_of(step_profile(5.0, 5.0, 30.0), 60.0)
    said: list[str] = []
    with reporting_ticks(said.append, every_s=0.0):  # every tick, for the test
        utilization_timeline(trace, app, check_plan(one_gpu(), app))
    end = f"{math.ceil(trace.arrival_s[-1]):,}"
    assert said and all(f"of {end} s of the trace" in line for line in said)
    assert "(100%," in said[-1]
    said.clear()
    utilization_timeline(trace, app, check_plan(one_gpu(), app))
    assert said == []  # outside it, nothing


# --- the utilisation autoscaler --------------------------------------------------------------


def test_utilization_scales_to_seventy_percent(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    # 120 qps on one GPU instance (mu 100 qps): utilisation 1.2.
    trace = trace_of(step_profile(120.0, 120.0, 0.0), 300.0, cv2=0.05)
    timeline = utilization_timeline(trace, app, check_plan(one_gpu(), app))
    # C* = r / 0.7 ~ 171 qps: one more instance, and then 120 / 200 = 0.6 <= 0.7 stays put
    # (one fewer would be 1.2): the autoscaler holds the smallest fleet at or under the target.
    (up,) = timeline.decisions
    assert (up.at_s, up.action, up.instance_type, up.count) == (10.0, "scale_up", GPU, 1)
    assert "target 0.7" in up.reason and "utilisation 1.2" in up.reason
    (late,) = [s for s in timeline.instances if s.billed_from_s == 10.0]
    assert late.ready_s == 70.0  # the GPU type's boot time


def test_utilization_waits_out_the_cooldown(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    trace = trace_of(step_profile(50.0, 250.0, 100.0), 240.0, cv2=0.05)
    timeline = utilization_timeline(trace, app, check_plan(one_gpu(), app))
    # t = 110: r = (50 s x 50 + 10 s x 250) / 60 ~ 83 qps needs 119 qps: +1 (200 qps).
    # t = 130 would need (30 x 50 + 30 x 250) / 60 / 0.7 ~ 214 qps, but the cooldown runs to 170;
    # t = 170: r = 250 qps needs 357 qps: +2 (400 qps), and then nothing.
    assert [(d.at_s, d.action, d.count) for d in timeline.decisions] == [
        (110.0, "scale_up", 1),
        (170.0, "scale_up", 2),
    ]
    config = UtilizationConfig(cooldown_s=0.0)
    eager = utilization_timeline(trace, app, check_plan(one_gpu(), app), config=config)
    assert [d.at_s for d in eager.decisions][:2] == [110.0, 130.0]


def test_utilization_waits_the_cooldown_between_changes(
    step_replays: dict[str, ReplayResult],
) -> None:
    decisions = [d for d in step_replays["utilization"].decisions if d.action != "budget_capped"]
    assert {d.action for d in decisions} == {"scale_up", "scale_down"}
    times = [d.at_s for d in decisions]
    assert all(later - earlier >= 60.0 for earlier, later in itertools.pairwise(times))
    assert all(t % 10.0 == 0.0 for t in times)  # it looks every 10 s
    assert all("target 0.7" in d.reason for d in decisions)


def test_utilization_settings_are_checked() -> None:
    with pytest.raises(ReplayError):
        UtilizationConfig(target=1.5)
    with pytest.raises(ReplayError):
        UtilizationConfig(cooldown_s=-1.0)


def test_rate_per_instance_averages_latency_over_the_batch_mix(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    # Half the queries at batch 1 (10 ms), half at 2 (16 ms): mean 13 ms.
    sizes = np.array([1, 2] * 50)
    assert rate_per_instance_qps(app.profile("m", GPU), sizes) == pytest.approx(1000.0 / 13.0)


# --- plan documents --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ([], ""),
        ({"cost_usd_per_hr": 1.0, "stages": []}, "feasible"),
        ({"feasible": True, "cost_usd_per_hr": 1.0, "stages": []}, "stages"),
        (plan_document({GPU: 0}), "stages[0].fleet"),
        (plan_document({GPU: -1}), "stages[0].fleet[g4dn.xlarge]"),
        (plan_document({GPU: 1}, batch_size=0), "stages[0].batch_size"),
        (plan_document({GPU: 1}, policy="drs"), "stages[0].policy"),
    ],
)
def test_malformed_plans_name_the_field(document: object, field: str) -> None:
    with pytest.raises(PlanError) as caught:
        parse_plan(document)
    assert caught.value.field == field


def test_plans_that_do_not_fit_the_spec_are_refused(tmp_path: Path) -> None:
    app = app_of(tmp_path)
    with pytest.raises(ReplayError, match="not one of the spec's instance types"):
        check_plan(parse_plan(plan_document({"p3.2xlarge": 1})), app)
    with pytest.raises(ReplayError, match="not a model of the spec"):
        check_plan(parse_plan(plan_document({GPU: 1}, name="other")), app)
    two = plan_document({GPU: 1})
    two["stages"] = [*two["stages"], *two["stages"]]  # type: ignore[misc]
    with pytest.raises(ReplayError, match="checked stage by stage"):
        check_plan(parse_plan(two), app)


# --- the command -----------------------------------------------------------------------------


def cli_inputs(tmp_path: Path, plan: object) -> list[str]:
    spec = write_app(tmp_path)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    trace_path = tmp_path / "trace.csv"
    write_trace_csv(trace_of(step_profile(50.0, 150.0, 40.0), 80.0), trace_path)
    return ["replay", "--spec", str(spec), "--plan", str(plan_path), "--trace", str(trace_path)]


@pytest.mark.parametrize("extra", [[], ["--policy", "utilization"], ["--tuner", "off"]])
def test_replay_json_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    assert main([*cli_inputs(tmp_path, plan_document({GPU: 1})), *extra, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("p99_ms", "slo_miss_share", "cost_usd", "scaling_actions", "timeline"):
        assert key in out
    assert 0.0 <= out["slo_miss_share"] <= 1.0 and out["cost_usd"] > 0
    assert [w["t_s"] for w in out["timeline"]] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    for window in out["timeline"]:
        assert set(window) >= {"t_s", "fleet", "rate_qps", "p99_ms"}
        assert window["fleet"].keys() >= {GPU}
    for decision in out["decisions"]:
        assert set(decision) >= {"at_s", "action", "instance_type", "count", "reason"}
    if extra == ["--tuner", "off"]:
        assert out["scaling_actions"] == 0 and out["decisions"] == []


def test_replay_refuses_as_the_service_does_unless_told_not_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One GPU (100 qps) under a step to 150 qps, static: a third of the step is refused.
    args = [*cli_inputs(tmp_path, plan_document({GPU: 1})), "--tuner", "off"]
    assert main([*args, "--json"]) == 0
    gated = json.loads(capsys.readouterr().out)
    assert main([*args, "--no-admission", "--json"]) == 0
    late = json.loads(capsys.readouterr().out)
    assert gated["refused_share"] > 0.1 and late["refused_share"] == 0.0
    # Over 1% refused: the P99 is among them, no number (valid JSON, not Infinity).
    assert gated["p99_ms"] is None and late["p99_ms"] > 1000.0
    assert gated["slo_miss_share"] < late["slo_miss_share"]
    windows = [w["p99_ms"] for w in gated["timeline"]]
    assert None in windows and any(isinstance(p, float) for p in windows)
    assert main(args) == 0
    assert "over 1% of queries refused" in capsys.readouterr().out


def test_replay_human_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = cli_inputs(tmp_path, plan_document({GPU: 1}))
    assert main([*args, "--policy", "static"]) == 0
    text = capsys.readouterr().out
    assert "under static" in text and "p99" in text and "0 scaling actions" in text


def test_replay_judges_the_slo_at_the_specs_percentile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One GPU under a step to 1.5x its capacity, served late: the P99 is far over the SLO, but
    # a P50 SLO is met. The replay said only its P99, as if the SLO were missed.
    args = [*cli_inputs(tmp_path, plan_document({GPU: 1})), "--tuner", "off", "--no-admission"]
    spec = tmp_path / "app.yaml"
    spec.write_text(spec.read_text().replace("latency_ms:", "percentile: 50\n  latency_ms:"))
    # The step for the last 15 s of 80: a sixth of the queries late.
    write_trace_csv(trace_of(step_profile(50.0, 150.0, 65.0), 80.0), tmp_path / "trace.csv")
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["percentile"] == 50.0 and out["p99_ms"] > SLO_MS
    assert out["slo_tail_ms"] <= SLO_MS < out["p99_ms"] and out["slo_met"] is True
    assert main(args) == 0
    assert f"the SLO (P50 <= {SLO_MS:g} ms) met" in capsys.readouterr().out
    # At 99 the summary says nothing more; the document says it all the same.
    spec.write_text(spec.read_text().replace("percentile: 50", "percentile: 99"))
    assert main(args) == 0
    assert "the SLO (P" not in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slo_tail_ms"] == out["p99_ms"] and out["slo_met"] is False


@pytest.mark.parametrize("extra", [[], ["--tuner", "off"]])
def test_replay_of_a_cascade_plan(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
) -> None:
    # A two-stage plan replays with the tuner (one per stage) as with --tuner off: one pipeline.
    # The ladders on three loads and the planning trace's burstiness alone (the command's own
    # are tens of plans; tests/unit/test_cascade_ladders.py tests cascade_sizing itself).
    short = functools.partial(replay_cli.cascade_sizing, loads=(0.5, 1.0, 2.0), burstiness=())
    monkeypatch.setattr(replay_cli, "cascade_sizing", short)
    write_cascade_app(tmp_path, records=True)
    spec = tmp_path / "cascade-True-0.6-50.yaml"
    plan = {
        "feasible": True,
        "cost_usd_per_hr": 0.298,
        "steps": [],
        "stages": [
            {"name": "cheap", "fleet": {CPU: 1}, "batch_size": 1, "predicted_p99_ms": 10.0},
            {"name": "large", "fleet": {CPU: 1}, "batch_size": 1, "predicted_p99_ms": 20.0},
        ],
    }
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    trace_path = tmp_path / "trace.csv"
    write_trace_csv(trace_of(step_profile(40.0, 200.0, 40.0), 80.0), trace_path)
    args = ["replay", "--spec", str(spec), "--plan", str(plan_path), "--trace", str(trace_path)]
    assert main([*args, *extra, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("p99_ms", "slo_miss_share", "cost_usd", "scaling_actions", "timeline"):
        assert key in out
    assert [s["name"] for s in out["stages"]] == ["cheap", "large"]
    assert out["stages"][0]["reach_share"] == 1.0 and out["stages"][1]["reach_share"] < 1.0
    assert out["peak_cost_usd_per_hr"] <= out["budget_usd_per_hr"]
    assert out["scaling_actions"] == sum(s["scaling_actions"] for s in out["stages"])
    if extra:
        assert out["policy"] == "static" and out["scaling_actions"] == 0
        assert all(not s["batch_caps"] for s in out["stages"])
    else:
        # Each stage sized by its ladder: its fleet in the planner's plan of the whole cascade
        # at each load, the planned one at 1x.
        assert out["policy"] == "tuner" and out["tuner_model"] == "curve"
        assert set(out["sizing_ladders"]) == {"cheap", "large"}
        for rungs in out["sizing_ladders"].values():
            loads = [r["load"] for r in rungs]
            assert loads == sorted(loads) and {0.5, 1.0, 2.0} <= set(loads)
            counts = [sum(r["fleet"].values()) for r in rungs]
            assert counts == sorted(counts)
            assert all(isinstance(r["batch"], int) and r["batch"] >= 1 for r in rungs)
        caps = [cap for stage in out["stages"] for cap in stage["batch_caps"]]
        assert caps and all(c["max_batch_queries"] >= 1 and c["t_s"] >= 0.0 for c in caps)
        assert out["scaling_actions"] > 0
        assert {d["stage"] for d in out["decisions"]} <= {"cheap", "large"}
    assert main([*args, *extra]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "stage cheap: reached by 100.0% of the queries" in text and "stage large" in text
    # The plan batches one query a stage; the ladders' rungs batch more: the summary says so.
    assert ("most queries per batch (the ladder's for the fleet):" in text) == (not extra)
    # The ladders' plans are progress on stderr, one line each.
    assert ("sizing ladder" in captured.err) == (not extra)
    assert (captured.err.count("ladder x") >= 3) == (not extra)


@pytest.mark.parametrize(
    ("plan", "extra", "message"),
    [
        ("{not json", [], "malformed JSON"),
        (plan_document({"p3.2xlarge": 1}), [], "not one of the spec's instance types"),
        (plan_document({GPU: 1}, name="other"), [], "not a model of the spec"),
        (plan_document({GPU: 1}), ["--tuner", "off", "--policy", "utilization"], "--tuner off"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    plan: object,
    extra: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as caught:
        main([*cli_inputs(tmp_path, plan), *extra, "--json"])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


# --- the Kairos capacity model of a mixed stage ----------------------------------------------


@needs_shared
def test_the_kairos_capacity_model_of_rm2_saturates_on_the_base_type(tmp_path: Path) -> None:
    spec = tmp_path / "rm2.yaml"
    spec.write_text(
        "name: rm2\n"
        f"models: [{{name: rm2, profiles: {KAIROS_CSV}}}]\n"
        "slo: {latency_ms: 350}\n"
        "budget_usd_per_hr: 10\n"
        f"instance_types: [{GPU}, {CPU}]\n"
    )
    app = resolve_spec(load_spec(spec))
    rng = np.random.default_rng(0)
    arrivals = renewal_arrivals(step_profile(100.0, 100.0, 0.0), 120.0, 1.0, rng)
    trace = Trace(arrivals, parse_batch_distribution("kairos").sample(arrivals.size, rng))
    model = kairos_capacity_model(app, "rm2", [GPU, CPU], trace)
    assert model is not None
    one_gpu_13, one_gpu_30, one_gpu_40 = (model({GPU: 1, CPU: n}) for n in (13, 30, 40))
    # The r5n.large serve only the queries below their violation batch: past some count the
    # g4dn.xlarge is the bottleneck and more of them add nothing, a second g4dn.xlarge does.
    assert one_gpu_13 > model({GPU: 1, CPU: 0}) > 0.0
    assert one_gpu_40 == pytest.approx(one_gpu_30)
    assert model({GPU: 2, CPU: 40}) > one_gpu_40
    # No full-range type (nothing serves every batch size within a 1 ms SLO): no model.
    tight = resolve_spec(load_spec(spec)).spec.model_copy(
        update={"slo": app.spec.slo.model_copy(update={"latency_ms": 1.0})}
    )
    assert kairos_capacity_model(resolve_spec(tight), "rm2", [GPU, CPU], trace) is None


def test_the_kairos_capacity_model_holds_to_the_slo_less_the_services_own_time(
    tmp_path: Path,
) -> None:
    """With the service's own 30 ms per query measured, the stages share 20 ms of the 50 ms SLO:
    the planner's dispatch leaves the r5n.large (25 ms a query) out of a mix's matching, so the
    tuner's capacity model (the sizing ladder's, the replay's, the live tuner's) must not count
    it either. It was the Kairos bound at the whole SLO, 140 qps for one of each against the
    100 qps the planner's fleet serves."""
    plain = app_of(tmp_path)
    app = dataclasses.replace(plain, serving_overhead_ms=30.0)
    trace = trace_of(step_profile(50.0, 50.0, 0.0), 60.0)
    profiles = {t: app.profile("m", t) for t in (GPU, CPU)}
    stage_slo_ms = app.constraints.stage_slo_ms
    assert stage_slo_ms == 20.0
    assert dispatch_choice(None, profiles, app.prices_usd_per_hr, trace.batch_size, stage_slo_ms)[
        1
    ] == [GPU]
    model = kairos_capacity_model(app, "m", [GPU, CPU], trace)
    assert model is not None
    assert model({GPU: 1, CPU: 1}) == pytest.approx(model({GPU: 1, CPU: 0}))
    # Nothing measured: the whole SLO, where the r5n.large serves beside the g4dn.xlarge.
    whole = kairos_capacity_model(plain, "m", [GPU, CPU], trace)
    assert whole is not None and whole({GPU: 1, CPU: 1}) > whole({GPU: 1, CPU: 0})


def test_a_windows_p99_reads_as_its_json_says() -> None:
    """The text timeline's P99 column: a number, ``-`` for a window no query arrived in (JSON's
    null), and a window with over 1% refused (an infinite P99, also null in JSON) says so."""
    assert replay_cli.window_p99_text(12.345) == "12.3"
    assert replay_cli.window_p99_text(None) == "-"
    assert replay_cli.window_p99_text(float("inf")) == ">1% refused"


def test_a_plan_without_stages_says_there_is_nothing_to_replay() -> None:
    """What plan writes when no fleet within the budget serves any rate: the refusal said
    "stages: must be a non-empty list", as for a malformed document."""
    document = {"feasible": False, "cost_usd_per_hr": 0.0, "max_feasible_qps": 0.0, "stages": []}
    with pytest.raises(PlanError) as refused:
        parse_plan(document)
    assert "no fleet within the budget that serves any rate" in str(refused.value)
    with pytest.raises(PlanError, match="non-empty list"):
        parse_plan({**document, "feasible": True})
