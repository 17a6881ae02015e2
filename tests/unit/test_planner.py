"""The planner (InferLine Algorithms 1-2 over Kairos-ranked mixes) and ``heteroplane plan``."""

from __future__ import annotations

import itertools
import json
import math
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.cli import main
from controlplane.policies import planner as planner_module
from controlplane.policies.gears import GearPlan
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import (
    MIN_ENVELOPE_WINDOW_S,
    InfeasibleSLOError,
    busiest_segment,
    peak_rate_qps,
    plan_app,
    scale_trace,
)
from controlplane.policies.replay import rate_per_instance_qps
from controlplane.spec import ResolvedApp, load_spec, resolve_spec
from estimator.batches import parse_batch_distribution
from estimator.cascades import (
    answering_stage,
    evaluate,
    synthetic_validation,
    validation_document,
    with_sample_ids,
)
from estimator.envelope import arrival_envelope, tuner_windows_s
from estimator.errors import EstimatorError
from estimator.numbers import money, plain
from estimator.policies import full_range_types, policy_factory
from estimator.simulator import InstanceSpec, SimulationResult, Stage, simulate
from estimator.traces import Trace, gamma_arrivals, poisson_arrivals, trace_stats, write_trace_csv
from tests.conftest import KAIROS_CSV, needs_shared

# Sub-linear in the batch size (a fixed cost per batch), so batching pays: mean ~ a + s b ms.
SHAPES = {"g4dn.xlarge": (3.0, 1.0), "r5n.large": (8.0, 4.0), "t3.xlarge": (12.0, 6.0)}
BATCHES = (1, 2, 4, 8, 16)


def write_profiles(folder: Path) -> Path:
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for itype, (fixed, slope) in SHAPES.items():
        for b in BATCHES:
            # 11 samples (the largest is dropped on reading): a +-10% spread around the mean.
            rows += [
                f"m,{itype},{b},{i},{(fixed + slope * b) * (0.9 + 0.02 * i):.4f},0"
                for i in range(11)
            ]
    path = folder / "profiles.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def write_spec(folder: Path, slo_ms: float, budget: float, **extra: str) -> Path:
    profiles = folder / "profiles.csv"
    if not profiles.exists():
        write_profiles(folder)
    lines = [
        "name: toy",
        "models: [{name: m, profiles: profiles.csv}]",
        f"slo: {{latency_ms: {slo_ms}}}",
        f"budget_usd_per_hr: {budget}",
        "instance_types: [g4dn.xlarge, r5n.large, t3.xlarge]",
        *(f"{key}: {value}" for key, value in extra.items()),
    ]
    path = folder / f"spec-{slo_ms}-{budget}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def app_for(folder: Path, slo_ms: float, budget: float) -> ResolvedApp:
    return resolve_spec(load_spec(write_spec(folder, slo_ms, budget)))


def poisson_trace(rate_qps: float, queries: int = 1500, seed: int = 1) -> Trace:
    arrivals = poisson_arrivals(rate_qps, queries / rate_qps, np.random.default_rng(seed))
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def gamma_trace(rate_qps: float, cv2: float, queries: int = 1500, seed: int = 1) -> Trace:
    arrivals = gamma_arrivals(rate_qps, cv2, queries / rate_qps, np.random.default_rng(seed))
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def resimulated_p99_ms(app: ResolvedApp, plan: PlanDocument, trace: Trace, seed: int = 0) -> float:
    """Rebuild the plan's one stage from scratch and simulate it on the trace."""
    (stage,) = plan.stages
    profiles = {t: app.profile(stage.name, t) for t in stage.fleet}
    prices = dict(app.prices_usd_per_hr)
    if stage.policy == "kairos":
        base = full_range_types(profiles, trace.batch_size, app.spec.slo.latency_ms, prices)
        make = policy_factory("kairos", profiles, base)
    else:
        make = policy_factory("fcfs", profiles, list(profiles))
    instances = tuple(InstanceSpec(t) for t, n in stage.fleet.items() for _ in range(n))
    result = simulate(
        Trace(trace.arrival_s - trace.arrival_s[0], trace.batch_size),
        [Stage(stage.name, instances, profiles, make(), max_batch_queries=stage.batch_size)],
        np.random.default_rng(seed),
        prices_usd_per_hr=prices,
        qos_ms=app.spec.slo.latency_ms,  # Kairos' dispatcher reads it
    )
    return float(np.percentile(result.response_ms, 99))


# --- honesty ---------------------------------------------------------------------------------


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    slo_ms=st.sampled_from([15.0, 25.0, 40.0, 80.0]),
    budget=st.sampled_from([0.3, 0.8, 1.5, 4.0]),
    rate_qps=st.sampled_from([60.0, 200.0, 500.0, 900.0]),
)
def test_plans_meet_the_slo_on_their_trace_and_stay_within_budget(
    tmp_path: Path, slo_ms: float, budget: float, rate_qps: float
) -> None:
    app = app_for(tmp_path, slo_ms, budget)
    trace = poisson_trace(rate_qps, queries=1000)
    plan = plan_app(app, trace)
    assert plan.cost_usd_per_hr <= budget + 1e-9
    if plan.feasible:
        assert plan.max_feasible_qps is None
        assert resimulated_p99_ms(app, plan, trace) <= slo_ms
        assert plan.stages[0].predicted_p99_ms <= slo_ms
    else:
        assert plan.max_feasible_qps is not None
        assert plan.max_feasible_qps < trace_stats(trace).rate_qps
        if plan.stages:  # planned for the highest feasible rate: honest there
            slower = scale_trace(trace, plan.max_feasible_qps)
            assert resimulated_p99_ms(app, plan, slower) <= slo_ms


def test_planning_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    app = app_for(tmp_path, 30.0, 3.0)
    trace = poisson_trace(300.0)
    assert plan_app(app, trace, seed=3) == plan_app(app, trace, seed=3)


# --- sensitivity (InferLine Fig. 10) ---------------------------------------------------------

WOBBLE = 1.05  # a greedy plan on a finite trace may be a few % off the trend


# The grid: each sweep runs at every point of the other two axes.
GRID_SLO_MS = (18.0, 30.0, 60.0)
GRID_RATE_QPS = (100.0, 400.0, 1200.0)
GRID_CV2 = (0.5, 4.0, 16.0)


def grid_trace(rate_qps: float, cv2: float) -> Trace:
    return poisson_trace(rate_qps) if cv2 == 1.0 else gamma_trace(rate_qps, cv2)


def assert_trend(plans: list[PlanDocument], *, rising: bool) -> None:
    """Feasible plans whose costs are monotone up to the greedy wobble between neighbours, and
    strictly so end to end (an infeasible plan's cost is the highest feasible rate's, not a
    point on the curve)."""
    assert all(plan.feasible for plan in plans), [plan.steps[-1] for plan in plans]
    costs = [plan.cost_usd_per_hr for plan in plans]
    if rising:
        assert all(b * WOBBLE >= a for a, b in itertools.pairwise(costs)), costs
        assert costs[-1] > costs[0], costs
    else:
        assert all(b <= a * WOBBLE for a, b in itertools.pairwise(costs)), costs
        assert costs[-1] < costs[0], costs


@pytest.mark.parametrize(("rate_qps", "cv2"), list(itertools.product((100.0, 400.0), (1.0, 4.0))))
def test_cost_falls_as_the_slo_loosens(tmp_path: Path, rate_qps: float, cv2: float) -> None:
    trace = grid_trace(rate_qps, cv2)
    plans = [plan_app(app_for(tmp_path, slo, 10.0), trace) for slo in GRID_SLO_MS]
    assert_trend(plans, rising=False)


@pytest.mark.parametrize(("slo_ms", "cv2"), list(itertools.product((25.0, 60.0), (1.0, 4.0))))
def test_cost_rises_with_the_arrival_rate(tmp_path: Path, slo_ms: float, cv2: float) -> None:
    app = app_for(tmp_path, slo_ms, 10.0)
    plans = [plan_app(app, grid_trace(rate, cv2)) for rate in GRID_RATE_QPS]
    assert_trend(plans, rising=True)


@pytest.mark.parametrize(
    ("slo_ms", "rate_qps"), list(itertools.product((25.0, 60.0), (100.0, 400.0)))
)
def test_cost_rises_with_burstiness(tmp_path: Path, slo_ms: float, rate_qps: float) -> None:
    app = app_for(tmp_path, slo_ms, 10.0)
    plans = [plan_app(app, gamma_trace(rate_qps, cv2)) for cv2 in GRID_CV2]
    assert_trend(plans, rising=True)


# --- infeasible inputs -----------------------------------------------------------------------


def test_a_short_trace_at_a_high_rate_is_planned_with_the_capacity_to_serve_it(
    tmp_path: Path,
) -> None:
    # 400 queries at 2,000 qps last a fifth of a second: a fleet with a fraction of that
    # capacity ends the trace with a queue still short of the SLO, and was planned as feasible.
    app = app_for(tmp_path, 300.0, 100.0)
    trace = poisson_trace(2000.0, queries=400)
    plan = plan_app(app, trace)
    assert plan.feasible
    (stage,) = plan.stages
    capacity_qps = sum(
        n * rate_per_instance_qps(app.profile("m", t), trace.batch_size, stage.batch_size)
        for t, n in stage.fleet.items()
    )
    assert capacity_qps > trace_stats(trace).rate_qps
    # Within a budget that cannot buy that capacity, it is not feasible, at a rate it can serve.
    poorer = app_for(tmp_path, 300.0, 0.5)
    plan = plan_app(poorer, trace)
    assert not plan.feasible
    assert plan.max_feasible_qps is not None and plan.max_feasible_qps < 2000.0
    (stage,) = plan.stages
    capacity_qps = sum(
        n * rate_per_instance_qps(poorer.profile("m", t), trace.batch_size, stage.batch_size)
        for t, n in stage.fleet.items()
    )
    assert capacity_qps > plan.max_feasible_qps


def test_an_slo_below_the_service_time_is_infeasible_with_a_clear_message(tmp_path: Path) -> None:
    app = app_for(tmp_path, 2.0, 3.0)
    with pytest.raises(InfeasibleSLOError) as caught:
        plan_app(app, poisson_trace(50.0))
    message = str(caught.value)
    assert message.startswith("infeasible: the service time alone exceeds the SLO")
    assert "'m'" in message and "g4dn.xlarge" in message and "SLO 2 ms" in message


def test_a_trace_whose_queries_arrive_at_one_time_has_no_rate_to_plan_for(
    tmp_path: Path,
) -> None:
    app = app_for(tmp_path, 25.0, 3.0)
    at_once = Trace(np.zeros(3), np.full(3, 10, dtype=np.int64))
    with pytest.raises(EstimatorError, match="all arrive at one time"):
        plan_app(app, at_once)


def test_a_free_type_with_a_large_cap_starts_from_the_fleet_its_load_needs(tmp_path: Path) -> None:
    """A free type's count is bounded by its cap alone: a cap of 100,000 had the planner rank
    and simulate fleets of the cap's size (a cap of a billion ran out of memory)."""
    fixed, slope = SHAPES["r5n.large"]
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    rows += [
        f"m,local.cpu,{b},{i},{(fixed + slope * b) * (0.9 + 0.02 * i):.4f},0"
        for b in BATCHES
        for i in range(11)
    ]
    (tmp_path / "free.csv").write_text("\n".join(rows) + "\n")
    spec = tmp_path / "free.yaml"
    spec.write_text(
        "name: free\nmodels: [{name: m, profiles: free.csv}]\nslo: {latency_ms: 25}\n"
        "budget_usd_per_hr: 1\ninstance_types: [local.cpu]\nmax_counts: {local.cpu: 100000}\n"
    )
    app = resolve_spec(load_spec(spec))
    assert app.prices_usd_per_hr["local.cpu"] == 0.0
    plan = plan_app(app, poisson_trace(2000.0, queries=4000))
    assert plan.feasible
    # One instance serves about 1000 / 12 qps at batch 1: the peak needs some 2000 / 0.7 of it.
    (start,) = [s for s in plan.steps if s.startswith("m: start from ")]
    started = int(start.removeprefix("m: start from ").split(" x ", 1)[0])
    assert started <= math.ceil(1.2 * 2000 / (0.7 * 1000 / 12.0)) + 1
    assert plan.stages[0].fleet.total <= started


def test_a_cap_past_the_most_instances_a_fleet_may_have_is_refused(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, 25.0, 1.0, max_counts="{r5n.large: 1000000000}")
    with pytest.raises(EstimatorError, match=r"max_counts\[r5n.large\]: must be <= 100000"):
        load_spec(spec)


def test_a_budget_too_small_reports_the_highest_feasible_rate(tmp_path: Path) -> None:
    app = app_for(tmp_path, 25.0, 0.2)  # one r5n.large: about 80 qps at batch 1
    trace = poisson_trace(600.0)
    plan = plan_app(app, trace)
    assert not plan.feasible
    assert plan.max_feasible_qps is not None
    assert 0 < plan.max_feasible_qps < trace_stats(trace).rate_qps
    assert plan.cost_usd_per_hr <= 0.2
    assert any("highest rate" in step for step in plan.steps)


def test_peak_rate_and_scaling() -> None:
    trace = Trace(np.array([0.0, 1.0, 1.5, 2.0, 20.0]), np.ones(5, dtype=np.int64))
    assert peak_rate_qps(trace, 10.0) == pytest.approx(0.4)
    faster = scale_trace(poisson_trace(100.0), 200.0)
    assert trace_stats(faster).rate_qps == pytest.approx(200.0)


# --- the planned envelope --------------------------------------------------------------------


def assert_envelope_shape(windows_s: list[float], rate_qps: list[float], span_s: float) -> None:
    """The tuner's ladder up to the planning trace's span, and what any arrival envelope satisfies
    on it: N(w) <= ceil(w / w') N(w') for w >= w' (a window of w is covered by ceil(w / w')
    windows of w'), so the rate does not rise from a window to its double."""
    ladder = tuner_windows_s(MIN_ENVELOPE_WINDOW_S).tolist()  # the toy serves in ms
    assert windows_s == [w for w in ladder if w <= span_s]
    counts = [round(r * w) for w, r in zip(windows_s, rate_qps, strict=True)]
    for i, j in itertools.combinations(range(len(windows_s)), 2):
        assert counts[j] <= math.ceil(windows_s[j] / windows_s[i]) * counts[i], (i, j)
    doublings = [i for i in range(len(windows_s) - 1) if windows_s[i + 1] == 2 * windows_s[i]]
    assert len(doublings) >= len(windows_s) - 2  # all but a last step to the longest window
    assert all(rate_qps[i + 1] <= rate_qps[i] for i in doublings), rate_qps


def test_the_document_carries_the_envelope_of_the_planned_queries(tmp_path: Path) -> None:
    app = app_for(tmp_path, 25.0, 3.0)
    bursty = gamma_trace(40.0, 4.0, queries=3000).arrival_s
    # Past the first 3,000 queries, a burst of 500 at 200 qps: the busiest stretch.
    burst = bursty[-1] + 1.0 + np.arange(500) / 200.0
    arrival_s = np.concatenate([bursty, burst]) + 7.5  # planned from 0 s
    trace = Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64))
    plan = plan_app(app, trace, max_queries=bursty.size)
    assert plan.feasible
    document = json.loads(json.dumps(plan.to_document()))
    envelope = document["envelope"]
    assert set(envelope) == {"windows_s", "rate_qps"}
    start = busiest_segment(trace.arrival_s, bursty.size)
    assert start == len(trace) - bursty.size  # the part that ends with the burst
    planned = trace.arrival_s[start : start + bursty.size]
    planned = planned - planned[0]
    expected = arrival_envelope(planned, envelope["windows_s"])
    assert envelope["rate_qps"] == expected.rate_qps.tolist()
    assert_envelope_shape(envelope["windows_s"], envelope["rate_qps"], float(planned[-1]))
    assert envelope["windows_s"][-1] == 60.0  # the planned part spans more than a minute
    # The burst is in it: its short windows see the burst's rate.
    assert envelope["rate_qps"][0] >= 200.0
    cut = f"busiest {bursty.size:,} of {len(trace):,} queries"
    assert any(cut in step for step in plan.steps), plan.steps


def test_a_burst_after_the_first_planned_queries_is_planned_for(tmp_path: Path) -> None:
    """A static plan holds through the trace's busiest stretch, wherever it comes: planned on the
    first queries alone, this trace's plan missed the SLO in its closing burst."""
    app = app_for(tmp_path, 25.0, 3.0)
    steady = poisson_trace(60.0, queries=2000).arrival_s
    burst = steady[-1] + poisson_trace(240.0, queries=1000, seed=2).arrival_s
    arrival_s = np.concatenate([steady, burst[1:]])
    trace = Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64))
    plan = plan_app(app, trace, max_queries=2000)
    assert plan.feasible
    assert plan.rate_qps > 100.0  # the segment planned on holds the burst
    assert resimulated_p99_ms(app, plan, trace) <= 25.0
    # Planned on the first 2,000 queries, the same fleet misses the SLO over the whole trace.
    first = plan_app(app, Trace(arrival_s[:2000], trace.batch_size[:2000]))
    assert resimulated_p99_ms(app, first, trace) > 25.0


def test_an_infeasible_plan_carries_the_envelope_of_the_rate_it_is_planned_for(
    tmp_path: Path,
) -> None:
    app = app_for(tmp_path, 25.0, 0.2)
    trace = poisson_trace(600.0)
    plan = plan_app(app, trace)
    assert not plan.feasible and plan.stages
    envelope = plan.to_document()["envelope"]
    from_zero = Trace(trace.arrival_s - trace.arrival_s[0], trace.batch_size)
    slower = scale_trace(from_zero, plan.planned_rate_qps)
    expected = arrival_envelope(slower.arrival_s, envelope["windows_s"])
    assert envelope["rate_qps"] == expected.rate_qps.tolist()
    assert max(envelope["rate_qps"]) < peak_rate_qps(trace, MIN_ENVELOPE_WINDOW_S)
    assert_envelope_shape(envelope["windows_s"], envelope["rate_qps"], slower.duration_s)


# --- the command -----------------------------------------------------------------------------


def test_plan_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, 25.0, 3.0)
    trace_file = tmp_path / "trace.csv"
    trace = poisson_trace(300.0)
    write_trace_csv(trace, trace_file)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["feasible"] is True
    assert "max_feasible_qps" not in out
    for key in ("cost_usd_per_hr", "stages", "steps", "app", "slo_ms", "budget_usd_per_hr"):
        assert key in out
    assert set(out["trace"]) == {"count", "rate_qps", "cv2"}
    # The plan's own rate and end-to-end prediction, top level (one stage: the stage's figure).
    assert out["rate_qps"] == out["planned_rate_qps"] == pytest.approx(out["trace"]["rate_qps"])
    assert out["predicted_p99_ms"] == out["stages"][0]["predicted_p99_ms"] <= 25.0
    (stage,) = out["stages"]
    for key in ("name", "fleet", "batch_size", "predicted_p99_ms", "throughput_qps"):
        assert key in stage
    assert stage["predicted_p99_ms"] <= 25.0
    assert all(isinstance(step, str) for step in out["steps"])
    assert set(out["envelope"]) == {"windows_s", "rate_qps"}
    # A 5 s trace: the windows stop at its span, short of the tuner's minute.
    windows = out["envelope"]["windows_s"]
    assert windows == [w for w in tuner_windows_s(MIN_ENVELOPE_WINDOW_S) if w <= trace.duration_s]
    assert len(windows) == len(out["envelope"]["rate_qps"]) > 1 and windows[-1] < 60.0
    assert captured.err  # progress lines


def test_plan_human_output_and_infeasible_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, 25.0, 0.2)
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(600.0), trace_file)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] is False and out["max_feasible_qps"] < out["trace"]["rate_qps"]
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file)]) == 0
    text = capsys.readouterr().out
    assert "NOT feasible" in text
    rate, predicted = out["rate_qps"], out["predicted_p99_ms"]
    assert rate == out["max_feasible_qps"] and predicted is not None
    assert f"planned for {rate:.2f} qps: predicted end-to-end P99 {predicted:.1f} ms" in text


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("name: toy\nmodels: []\n", "models"),
        ("name: [unclosed\n", "malformed YAML"),
        (None, "no such file"),
    ],
)
def test_a_bad_spec_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, expected: str
) -> None:
    spec = tmp_path / "bad.yaml"
    if content is not None:
        spec.write_text(content)
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(50.0, queries=20), trace_file)
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--spec", str(spec), "--trace", str(trace_file)])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_an_infeasible_slo_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, 2.0, 3.0)
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(50.0, queries=50), trace_file)
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--spec", str(spec), "--trace", str(trace_file)])
    assert caught.value.code == 2
    assert "infeasible: the service time alone exceeds the SLO" in capsys.readouterr().err


# --- the shared data -------------------------------------------------------------------------


@needs_shared
def test_rm2_in_the_kairos_setting_gets_a_mixed_fleet_under_budget(tmp_path: Path) -> None:
    spec = tmp_path / "rm2.yaml"
    spec.write_text(
        "name: rm2\n"
        f"models: [{{name: rm2, profiles: {KAIROS_CSV}}}]\n"
        "slo: {latency_ms: 350}\n"
        "budget_usd_per_hr: 2.5\n"
        "instance_types: [g4dn.xlarge, c5n.2xlarge, r5n.large, t3.xlarge]\n"
        "max_counts: {g4dn.xlarge: 5, c5n.2xlarge: 6, r5n.large: 17, t3.xlarge: 15}\n"
    )
    app = resolve_spec(load_spec(spec))
    rng = np.random.default_rng(0)
    arrivals = poisson_arrivals(60.0, 600.0, rng)
    trace = Trace(arrivals, parse_batch_distribution("kairos").sample(arrivals.size, rng))
    plan = plan_app(app, trace)
    assert plan.feasible
    assert plan.cost_usd_per_hr < 2.5
    (stage,) = plan.stages
    assert len([t for t, n in stage.fleet.items() if n]) >= 2, stage.fleet
    assert stage.predicted_p99_ms <= 350.0
    assert any("busiest 20,000" in step for step in plan.steps)


# --- cascades: scale factors from validation records -----------------------------------------


def write_cascade_app(
    folder: Path, *, records: bool, threshold: float = 0.6, slo_ms: float = 50.0
) -> ResolvedApp:
    """Two stages (cheap then large), both profiled like the toy model ``m``."""
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for model, factor in (("cheap", 0.5), ("large", 1.0)):
        for itype, (fixed, slope) in SHAPES.items():
            for b in BATCHES:
                rows += [
                    f"{model},{itype},{b},{i},"
                    f"{factor * (fixed + slope * b) * (0.9 + 0.02 * i):.4f},0"
                    for i in range(11)
                ]
    (folder / "cascade.csv").write_text("\n".join(rows) + "\n")
    family = synthetic_validation(
        np.random.default_rng(0), [0.9, 0.97], names=["cheap", "large"], n_samples=600
    )
    (folder / "validation.json").write_text(json.dumps(validation_document(family)))
    lines = [
        "name: cascade",
        "models: [{name: cheap, profiles: cascade.csv}, {name: large, profiles: cascade.csv}]",
        "cascade: [cheap, large]",
        f"slo: {{latency_ms: {slo_ms:g}}}",
        "budget_usd_per_hr: 10",
        "instance_types: [g4dn.xlarge, r5n.large, t3.xlarge]",
    ]
    if records:
        lines += [f"thresholds: [{threshold}]", "validation: validation.json"]
    spec = folder / f"cascade-{records}-{threshold}-{slo_ms:g}.yaml"
    spec.write_text("\n".join(lines) + "\n")
    return resolve_spec(load_spec(spec))


def test_a_cascade_stage_is_planned_for_the_share_of_queries_that_reach_it(
    tmp_path: Path,
) -> None:
    app = write_cascade_app(tmp_path, records=True)
    assert app.cascade is not None and app.validation is not None
    trace = poisson_trace(600.0, queries=3000)
    plan = plan_app(app, trace, seed=2)
    assert plan.feasible
    first, second = plan.stages
    assert first.scale_factor == 1.0
    # The share reaching the large model: the samples whose cheap certainty is below 0.6.
    expected = evaluate(app.cascade, app.validation).reach_share[1]
    assert second.scale_factor == pytest.approx(expected, abs=0.04)
    assert 0.0 < second.scale_factor < 1.0
    assert any("scale factors from the validation records" in step for step in plan.steps)
    assert plan.to_document()["stages"][1]["scale_factor"] == second.scale_factor
    # The cascade's gear plan on the plan's placement, for the live switcher.
    gears = GearPlan.from_document(plan.to_document()["gear_plan"])
    assert gears.placement.order == ("cheap", "large")
    assert {m: dict(gears.placement.fleets[m]) for m in gears.placement.order} == {
        s.name: dict(s.fleet) for s in plan.stages
    }
    assert gears.slo_ms == 50 and gears.gears
    assert any(step.startswith("gear plan on the placement") for step in plan.steps)

    # Without records every query is assumed to reach the large model: never cheaper.
    plain = plan_app(write_cascade_app(tmp_path, records=False), trace, seed=2)
    assert [s.scale_factor for s in plain.stages] == [1.0, 1.0]
    assert plain.stages[1].cost_usd_per_hr >= second.cost_usd_per_hr
    assert any("scale factor 1.0" in step for step in plain.steps)
    assert "gear_plan" not in plain.to_document()  # no records: nothing to plan gears from


def test_a_trace_with_sample_ids_routes_by_them(tmp_path: Path) -> None:
    app = write_cascade_app(tmp_path, records=True, threshold=0.0)
    base = poisson_trace(300.0, queries=1000)
    trace = Trace(base.arrival_s, base.batch_size, np.arange(len(base)) % 600)
    plan = plan_app(app, trace, seed=0)
    # Threshold 0: the cheap model answers everything; the large stage keeps its minimum.
    assert plan.stages[1].scale_factor == pytest.approx(2 / len(trace))
    assert any("the trace's sample ids" in step for step in plan.steps)


def test_past_the_ranking_limit_the_start_is_still_the_cheapest_covering_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # $8/hr affords some 10^4 mixes of the three types: ranked whole by default. With the limit
    # at 50 the planner must find the same start among the mixes of a smaller, doubled budget.
    app = app_for(tmp_path, 40.0, 8.0)
    trace = poisson_trace(300.0, queries=1000)
    whole = plan_app(app, trace)
    assert "mixes up to" not in whole.steps[0]
    monkeypatch.setattr(planner_module, "MAX_RANKED_MIXES", 50)
    limited = plan_app(app, trace)
    start = next(step for step in limited.steps if ": start from " in step)
    assert "mixes up to" in start
    assert start.split(" (", 1)[0] == whole.steps[0].split(" (", 1)[0]  # the same start fleet
    assert [dict(s.fleet) for s in limited.stages] == [dict(s.fleet) for s in whole.stages]
    assert limited.simulations == whole.simulations


# --- the end-to-end prediction ---------------------------------------------------------------


def resimulated_pipeline_ms(app: ResolvedApp, plan: PlanDocument, trace: Trace, seed: int) -> float:
    """Rebuild every stage of a cascade plan from scratch, forward the queries the validation
    records send on (samples drawn with the seed, as the planner draws them) and simulate the
    whole pipeline once on the trace: the P99 of the end-to-end response times."""
    assert app.cascade is not None and app.validation is not None
    trace = Trace(trace.arrival_s - trace.arrival_s[0], trace.batch_size)
    drawn = with_sample_ids(trace, app.validation, np.random.default_rng(seed)).sample_id
    answered = answering_stage(app.cascade, app.validation, drawn)
    slo_ms = app.spec.slo.latency_ms  # the stages are planned jointly against the whole SLO
    stages = []
    for i, stage in enumerate(plan.stages):
        used = {t: n for t, n in stage.fleet.items() if n}
        profiles = {t: app.profile(stage.name, t) for t in used}
        prices = {t: app.prices_usd_per_hr[t] for t in used}
        reaching = trace.batch_size[answered >= i]
        if stage.policy == "kairos":
            base = full_range_types(profiles, reaching, slo_ms, prices)
            make = policy_factory("kairos", profiles, base)
        else:
            make = policy_factory("fcfs", profiles, list(profiles) if len(used) == 1 else [])
        forward = answered >= i + 1 if i + 1 < len(plan.stages) else None
        instances = tuple(InstanceSpec(t) for t in sorted(used) for _ in range(used[t]))
        stages.append(
            Stage(stage.name, instances, profiles, make(), stage.batch_size, forward=forward)
        )
    result = simulate(
        trace,
        stages,
        np.random.default_rng(seed),
        prices_usd_per_hr=app.prices_usd_per_hr,
        qos_ms=slo_ms,
    )
    return float(np.percentile(result.response_ms, 99))


def test_a_cascade_plan_predicts_the_whole_pipeline_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = write_cascade_app(tmp_path, records=True)
    trace = poisson_trace(600.0, queries=3000)
    runs = []

    def counted(trace: Trace, stages: list[Stage], *args: Any, **kwargs: Any) -> SimulationResult:
        runs.append(len(stages))
        return simulate(trace, stages, *args, **kwargs)

    monkeypatch.setattr(planner_module, "simulate", counted)
    plan = plan_app(app, trace, seed=2)
    assert plan.feasible and len(plan.stages) == 2
    assert plan.rate_qps == plan.planned_rate_qps == pytest.approx(trace_stats(trace).rate_qps)
    # The stages are judged together (the joint search simulates the whole pipeline), every
    # simulation counted.
    assert runs.count(2) >= 1 and plan.simulations == len(runs)
    assert plan.predicted_p99_ms is not None
    assert plan.predicted_p99_ms == pytest.approx(resimulated_pipeline_ms(app, plan, trace, 2))
    # Feasible now means the whole pipeline meets the SLO.
    assert plan.predicted_p99_ms <= app.spec.slo.latency_ms
    assert any(step.startswith("end to end: predicted P99") for step in plan.steps)
    document = plan.to_document()
    assert document["predicted_p99_ms"] == plan.predicted_p99_ms
    assert document["rate_qps"] == plan.rate_qps
    assert PlanDocument.parse(document) == plan


def test_a_single_model_plan_predicts_what_its_stage_does(tmp_path: Path) -> None:
    app = app_for(tmp_path, 30.0, 3.0)
    trace = poisson_trace(300.0)
    plan = plan_app(app, trace, seed=3)
    (stage,) = plan.stages
    # One stage is the whole pipeline: the same simulation (trace, seed), nothing simulated again.
    assert plan.predicted_p99_ms == stage.predicted_p99_ms
    assert plan.predicted_p99_ms == pytest.approx(resimulated_p99_ms(app, plan, trace, seed=3))
    (end_to_end,) = [step for step in plan.steps if step.startswith("end to end")]
    assert "the stage's own simulation" in end_to_end
    # An infeasible plan predicts at the rate it is planned for.
    small = plan_app(app_for(tmp_path, 25.0, 0.2), poisson_trace(600.0))
    assert not small.feasible and small.max_feasible_qps is not None
    assert small.rate_qps == small.max_feasible_qps
    assert small.predicted_p99_ms == small.stages[0].predicted_p99_ms


def test_a_plan_without_stages_predicts_nothing(tmp_path: Path) -> None:
    # The fastest type's mean latency (4 ms) is within the SLO, its sampled P99 is not: no rate
    # is served, so the plan has no stages and nothing to simulate.
    plan = plan_app(app_for(tmp_path, 4.1, 3.0), poisson_trace(100.0, queries=200))
    assert not plan.feasible and plan.stages == () and plan.max_feasible_qps == 0.0
    assert plan.rate_qps == 0.0 and plan.predicted_p99_ms is None
    assert plan.to_document()["predicted_p99_ms"] is None
    assert not any(step.startswith("end to end") for step in plan.steps)


def test_a_fleet_the_budget_caps_batches_to_serve_the_trace(tmp_path: Path) -> None:
    # One r5n.large is all $0.2/hr buys: 12 ms a query at batch 1 (about 83 qps), so 120 qps is
    # infeasible one query at a time; batches of a few queries serve it (8 + 4b ms for b).
    app = app_for(tmp_path, 100.0, 0.2)
    trace = poisson_trace(120.0)
    plan = plan_app(app, trace)
    assert plan.feasible, plan.steps
    (stage,) = plan.stages
    assert dict(stage.fleet) == {"r5n.large": 1} and stage.batch_size > 1
    assert any("batch up to" in step for step in plan.steps)
    assert plan.cost_usd_per_hr <= 0.2
    assert resimulated_p99_ms(app, plan, trace) <= 100.0


def test_front_waits_are_lindleys_recursion_in_the_arrivals_order() -> None:
    """The serving process's queue (one server, first come first served, every query served in
    the CPU per query): the closed form equals the recursion d_i = max(a_i, d_(i-1)) + s on
    Poisson arrivals at 30%, 90% and past capacity (the waits then grow with the trace), in the
    caller's order when the arrivals come unsorted; none at 0 ms."""
    from controlplane.policies.planner import front_waits_ms

    rng = np.random.default_rng(11)
    for rho in (0.3, 0.9, 1.2):
        cpu_ms = 0.5
        arrivals = np.cumsum(rng.exponential(cpu_ms / 1000.0 / rho, size=2000))
        expected = np.empty(arrivals.size)
        departure = -np.inf
        for i, a in enumerate(arrivals):
            start = max(a, departure)
            expected[i] = (start - a) * 1000.0
            departure = start + cpu_ms / 1000.0
        assert np.allclose(front_waits_ms(arrivals, cpu_ms), expected, atol=1e-9)
        shuffled = rng.permutation(arrivals.size)
        assert np.allclose(front_waits_ms(arrivals[shuffled], cpu_ms), expected[shuffled])
        if rho > 1:
            assert expected[-100:].mean() > 20 * expected[:100].mean()
    assert not front_waits_ms(np.array([0.0, 0.0, 0.0]), 0.0).any()


def test_plan_texts_write_a_percentile_and_a_budget_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``:g`` wrote a percentile of 99.9999999999 as P100 and a budget of 1e6 as $1e+06/hr.
    spec = tmp_path / "spec.yaml"
    write_spec(tmp_path, 25.0, 1_000_000.0)
    text = (tmp_path / "spec-25.0-1000000.0.yaml").read_text()
    spec.write_text(
        text.replace(
            "slo: {latency_ms: 25.0}", "slo: {latency_ms: 25.0, percentile: 99.9999999999}"
        )
    )
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(60.0, queries=300), trace_file)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file)]) == 0
    out = capsys.readouterr().out
    assert "P99.9999999999 <= 25 ms" in out and "P100" not in out
    assert "$1000000/hr" in out and "e+06" not in out


def test_plain_numbers_keep_six_digits_without_an_exponent() -> None:
    assert [plain(x) for x in (1e6, 0.526, 5e-5, 1 / 3, 12.0)] == [
        "1000000",
        "0.526",
        "0.00005",
        "0.333333",
        "12",
    ]


def test_plan_costs_are_the_exact_sums_of_their_prices(tmp_path: Path) -> None:
    # Prices of 0.1 USD/hr: three instances summed as floats cost 0.30000000000000004.
    (tmp_path / "catalog.csv").write_text(
        "instance_type,price_usd_per_hr\n"
        + "".join(f"{name},0.1\n" for name in ("g4dn.xlarge", "r5n.large", "t3.xlarge"))
    )
    app = resolve_spec(load_spec(write_spec(tmp_path, 25.0, 3.0, catalog="catalog.csv")))
    plan = plan_app(app, poisson_trace(1500.0, queries=4000))
    assert plan.feasible
    (stage,) = plan.stages
    count = sum(stage.fleet.values())
    assert count >= 3  # a float sum of three or more 0.1s is not their decimal sum
    assert stage.cost_usd_per_hr == plan.cost_usd_per_hr == float(Decimal("0.1") * count)
    assert f'"cost_usd_per_hr": {count / 10}' in json.dumps(plan.to_document())


def test_money_is_the_decimal_sum() -> None:
    assert money(sum([0.1] * 3)) == 0.3 and money(2 * 0.149 + 3 * 0.1664) == 0.7972


def test_a_stage_no_query_reaches_prints_no_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Threshold 0: the cheap model answers everything; the large stage is planned on two
    # queries so that it keeps an instance, and the tail of those two said nothing.
    write_cascade_app(tmp_path, records=True, threshold=0.0)
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(300.0, queries=1000), trace_file)
    spec = tmp_path / "cascade-True-0.0-50.yaml"
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file)]) == 0
    out = capsys.readouterr().out
    (cheap,) = [line for line in out.splitlines() if line.startswith("  cheap:")]
    (large,) = [line for line in out.splitlines() if line.startswith("  large:")]
    assert "P99 " in cheap and "reaches it" not in cheap
    assert "P99" not in large and "no query reaches it: planned on two" in large
