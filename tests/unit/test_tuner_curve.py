"""The tuner's load model (controlplane/policies/tuner.py: equivalent_loads, capacity curves;
controlplane/policies/capacity_curve.py): a pure change of rate reads as one load at every window,
the planner's capacity curve sizes the stage, and the planned envelope keeps the planned fleet."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.policies.capacity_curve import build_ladder, capacity_curve
from controlplane.policies.planner import plan_app
from controlplane.policies.replay import ReplayResult, parse_plan, replay
from controlplane.policies.sizing import DEFAULT_LADDER_LOADS, SizingLadder
from controlplane.policies.tuner import (
    TunerConfig,
    TunerStage,
    equivalent_loads,
    initial_state,
    load_factors,
    tune,
)
from estimator.envelope import arrival_envelope, tuner_windows_s
from estimator.errors import WorkloadError
from estimator.traces import Trace, constant_profile, renewal_arrivals, step_profile
from tests.unit.test_replay import app_of, cli_inputs, plan_document

WINDOWS_S = tuple(float(w) for w in tuner_windows_s(1.0, 60.0))


def gamma_arrivals(rate_qps: float, duration_s: float, seed: int) -> np.ndarray:
    profile = step_profile(rate_qps, rate_qps, 0.0)
    return renewal_arrivals(profile, duration_s, 4.0, np.random.default_rng(seed))


def curve_stage(**kwargs: object) -> TunerStage:
    # 10 instances of 10 qps; the planner needs 1.6x the capacity at twice the rate.
    return TunerStage(
        "m",
        1.0,
        {"g": 10},
        {"g": 10.0},
        1.0,
        capacity_curve=((0.5, 0.6), (1.0, 1.0), (2.0, 1.6)),
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_pure_change_of_rate_reads_as_one_load_at_every_window() -> None:
    planning = gamma_arrivals(60.0, 3600.0, seed=1)
    planned = arrival_envelope(planning, WINDOWS_S).rate_qps
    faster = planning / 1.25  # the same arrivals at 1.25 times the rate
    live = arrival_envelope(faster, WINDOWS_S).rate_qps
    loads = equivalent_loads(live, WINDOWS_S, planned)
    assert loads == pytest.approx(np.full(len(WINDOWS_S), 1.25), rel=0.06)
    # The plain ratio (InferLine's constant rho) reads the short windows lower: the same bursts
    # in less time are a smaller part of a faster stream.
    ratios = load_factors(live, planned)
    assert ratios[0] < 1.22 and ratios[-1] == pytest.approx(1.25, rel=0.03)
    assert loads[0] > ratios[0]
    # The planned envelope itself is load 1.
    assert equivalent_loads(planned, WINDOWS_S, planned) == pytest.approx(np.ones(len(WINDOWS_S)))


def test_the_capacity_follows_the_curve_and_bursts_get_that_loads_headroom() -> None:
    stage = curve_stage()
    assert stage.planned_capacity_qps == 100.0
    assert stage.capacity_at_load_qps(1.0) == pytest.approx(100.0)
    assert stage.capacity_at_load_qps(1.5) == pytest.approx(130.0)
    assert stage.capacity_at_load_qps(4.0) == pytest.approx(320.0)  # 1.6 x 4 / 2, proportional
    # A pure change of rate: the planner's capacity there.
    assert stage.capacity_for_loads_qps(1.5, 1.5) == pytest.approx(130.0)
    # Bursts above the sustained load: the headroom of the sustained load, in proportion.
    assert stage.capacity_for_loads_qps(1.8, 1.5) == pytest.approx(130.0 * 1.8 / 1.5)
    # Without a curve: InferLine's constant ratio.
    plain = TunerStage("m", 1.0, {"g": 10}, {"g": 10.0}, 1.0)
    assert plain.capacity_for_loads_qps(1.5, 1.5) == pytest.approx(150.0)


def test_bad_curves_are_rejected() -> None:
    with pytest.raises(WorkloadError, match="capacity_curve has no point"):
        TunerStage("m", 1.0, {"g": 1}, {"g": 1.0}, 1.0, capacity_curve=())
    with pytest.raises(WorkloadError, match="multiplier"):
        TunerStage("m", 1.0, {"g": 1}, {"g": 1.0}, 1.0, capacity_curve=((1.0, -1.0),))
    with pytest.raises(WorkloadError, match="repeats"):
        TunerStage("m", 1.0, {"g": 1}, {"g": 1.0}, 1.0, capacity_curve=((1.0, 1.0), (1.0, 2.0)))


def config(planned_qps: float) -> TunerConfig:
    return TunerConfig(
        windows_s=(1.0, 2.0, 4.0),
        planned_rate_qps=(planned_qps,) * 3,
        budget_usd_per_hr=100.0,
        prices_usd_per_hr={"g": 1.0},
        boot_s={"g": 30.0},
    )


def steady(rate_qps: int, start_s: float, end_s: float) -> np.ndarray:
    return start_s + np.arange(int((end_s - start_s) * rate_qps)) / rate_qps


def test_with_a_curve_the_planned_envelope_keeps_the_plan_and_twice_it_needs_the_curve() -> None:
    stage, cfg = curve_stage(), config(64.0)
    state = initial_state([stage], 0.0)
    for now_s in (5.0, 100.0):
        decisions, after = tune(steady(64, 0.0, 100.0), now_s, state, [stage], cfg)
        assert decisions == [] and after == state
    # Twice the planned rate at every window: load 2, the planner's 1.6 x 100 qps = 16 x 10 qps.
    decisions, after = tune(steady(128, 90.0, 100.0), 100.0, state, [stage], cfg)
    assert [(d.action, d.count) for d in decisions] == [("scale_up", 6)]
    assert after.fleets["m"]["g"] == 16
    assert "load x2" in decisions[0].reason and "160 qps" in decisions[0].reason
    # Half of it, after the delay: the planner's 0.6 x 100 qps.
    decisions, after = tune(steady(32, 40.0, 100.0), 100.0, state, [stage], cfg)
    assert [(d.action, d.count) for d in decisions] == [("scale_down", 4)]
    assert after.fleets["m"]["g"] == 6


def test_the_capacity_curve_is_the_planners_capacity_by_load(tmp_path: Path) -> None:
    app = app_of(tmp_path, budget_usd_per_hr=10.0)
    arrivals = gamma_arrivals(50.0, 120.0, seed=3)
    planning = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    curve = capacity_curve(app, "m", planning, dispatch="fcfs", loads=(0.5, 1.0, 2.0))
    loads = [f for f, _ in curve]
    multipliers = [m for _, m in curve]
    assert loads == [0.5, 1.0, 2.0]
    assert multipliers[1] == 1.0
    assert multipliers == sorted(multipliers)
    # Sub-linear: twice the rate needs more, but less than twice the capacity.
    assert 1.0 < multipliers[2] <= 2.0


def test_replay_runs_the_load_model_by_default_and_reports_its_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = cli_inputs(tmp_path, plan_document({"g4dn.xlarge": 1}))
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tuner_model"] == "curve"
    curve = out["capacity_curve"]
    assert [f for f, _ in curve] == list(DEFAULT_LADDER_LOADS)
    assert dict(curve)[1.0] == 1.0
    # The sizing model's rungs: the planner's fleet at each load, the fleets growing with it.
    rungs = out["sizing_ladder"]
    assert [r["load"] for r in rungs] == list(DEFAULT_LADDER_LOADS)
    sizes = [sum(r["fleet"].values()) for r in rungs]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    # InferLine's one provisioning ratio, for comparison: no curve.
    assert main([*args, "--tuner-model", "inferline", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tuner_model"] == "inferline" and out["capacity_curve"] is None
    assert out["sizing_ladder"] is None
    with pytest.raises(SystemExit) as caught:
        main([*args, "--policy", "static", "--tuner-model", "curve"])
    assert caught.value.code == 2
    assert "--tuner-model is for the tuner" in capsys.readouterr().err


def test_a_single_stage_serves_with_the_batch_its_ladder_plans_for_its_fleet(
    tmp_path: Path,
) -> None:
    app = app_of(tmp_path, budget_usd_per_hr=10.0)
    arrivals = gamma_arrivals(50.0, 120.0, seed=3)
    planning = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    plan = parse_plan(plan_app(app, planning, seed=0).to_document())
    stage = plan.stages[0]
    ladder = build_ladder(app, "m", planning, dispatch="fcfs", loads=(0.5, 1.0, 2.0, 4.0))
    assert ladder is not None and [f for f, _ in ladder.batches] == [f for f, _ in ladder.rungs]
    # A ladder whose rungs from 2x on batch two queries: once the ready fleet reaches the 2x
    # rung's capacity the stage takes two a batch, and one again once it shrinks below.
    two = dataclasses.replace(
        ladder, batches=tuple((f, 2 if f >= 2.0 else 1) for f, _ in ladder.rungs)
    )
    reached = min(ladder.capacity_qps(rung) for f, rung in ladder.rungs if f >= 2.0)
    # Four times the planned rate for two minutes, then the planned rate for four.
    rng = np.random.default_rng(7)
    high = renewal_arrivals(constant_profile(200.0), 120.0, 1.0, rng)
    low = 120.0 + renewal_arrivals(constant_profile(50.0), 240.0, 1.0, rng)
    arrival_s = np.concatenate([high, low])
    trace = Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64))

    def replayed(used: SizingLadder) -> ReplayResult:
        return replay(
            trace,
            app,
            plan,
            np.random.default_rng(5),
            policy="tuner",
            planning_arrival_s=planning.arrival_s,
            tuner_ladder=used,
            tuner_recent_s=60.0,
        )

    result = replayed(two)
    caps = result.fleet_timeline.batch_caps
    assert [cap for _, cap in caps] == [2, 1], caps
    for t_s, cap in caps:
        ready = result.fleet_timeline.ready_fleet_at(t_s, ())
        assert (ladder.capacity_qps(ready) >= reached - 1e-9) == (cap == 2), (t_s, ready)
    # The rungs' own batches (one query on this app): the plan's batch throughout.
    assert stage.batch_size == 1 and all(b == 1 for _, b in ladder.batches)
    plain = replayed(ladder)
    assert plain.fleet_timeline.batch_caps == ()
    assert plain.p99_ms != result.p99_ms
