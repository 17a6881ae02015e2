"""CG-Peak and CG-Mean (controlplane/policies/baselines.py, ``heteroplane replay --policy
peak|mean``): the rates they plan for, and that the replayed fleet is the planner's plan on a
steady trace at that rate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.policies.baselines import (
    PEAK_WINDOW_S,
    baseline_rate_qps,
    leading_share,
    plan_baseline,
)
from controlplane.policies.planner import plan_app, scale_trace
from controlplane.policies.replay import ReplayError
from estimator.traces import Trace, renewal_arrivals, step_profile, write_trace_csv
from tests.unit.test_replay import GPU, app_of, plan_document, trace_of, write_app


def steady(rate_qps: float, duration_s: float, seed: int) -> Trace:
    arrivals = renewal_arrivals(
        step_profile(rate_qps, rate_qps, 0.0), duration_s, 1.0, np.random.default_rng(seed)
    )
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def step_trace() -> Trace:
    """50 qps for 60 s, then 150 qps to 120 s (Poisson)."""
    return trace_of(step_profile(50.0, 150.0, 60.0), 120.0)


def fleet_of(document: dict[str, object]) -> dict[str, int]:
    stages = document["stages"]
    assert isinstance(stages, list)
    return {name: n for s in stages for name, n in s["fleet"].items() if n}


def test_the_peak_is_the_most_arrivals_in_a_window_and_the_mean_the_whole_trace() -> None:
    trace = step_trace()
    assert PEAK_WINDOW_S == 10.0
    mean = baseline_rate_qps(trace, "mean")
    peak = baseline_rate_qps(trace, "peak")
    assert mean == pytest.approx((len(trace) - 1) / trace.duration_s)
    assert 85.0 < mean < 115.0  # (50 + 150) / 2, Poisson noise aside
    assert 140.0 < peak < 200.0  # the step's 150 qps, plus the noise of a 10 s count
    ends = np.searchsorted(trace.arrival_s, trace.arrival_s + 10.0, side="left")
    assert peak == float(np.max(ends - np.arange(len(trace)))) / 10.0
    # A longer window averages more of the noise away; one past the trace is its mean.
    assert baseline_rate_qps(trace, "peak", 60.0) <= peak
    assert baseline_rate_qps(trace, "peak", 1000.0) == pytest.approx(mean)
    with pytest.raises(ReplayError, match="window"):
        baseline_rate_qps(trace, "peak", 0.0)
    with pytest.raises(ReplayError, match="baseline"):
        baseline_rate_qps(trace, "median")  # type: ignore[arg-type]


def test_the_default_shape_is_the_first_tenth() -> None:
    trace = step_trace()
    head = leading_share(trace)
    assert head.arrival_s[-1] <= trace.arrival_s[0] + 0.1 * trace.duration_s
    assert len(head) == np.count_nonzero(trace.arrival_s <= head.arrival_s[-1])
    np.testing.assert_array_equal(head.batch_size, trace.batch_size[: len(head)])


@pytest.mark.parametrize("baseline", ["peak", "mean"])
def test_the_baseline_plan_is_the_plan_of_a_steady_trace_at_its_rate(
    tmp_path: Path, baseline: str
) -> None:
    app = app_of(tmp_path)
    trace, shape = step_trace(), steady(50.0, 120.0, seed=5)
    made = plan_baseline(app, trace, baseline, shape=shape)  # type: ignore[arg-type]
    rate = baseline_rate_qps(trace, baseline)  # type: ignore[arg-type]
    assert made.rate_qps == rate
    expected = plan_app(app, scale_trace(shape, rate), seed=0)
    assert made.plan.to_document()["stages"] == expected.to_document()["stages"]
    assert made.plan.rate_qps == pytest.approx(rate)


def write(tmp_path: Path, name: str, trace: Trace) -> Path:
    path = tmp_path / name
    write_trace_csv(trace, path)
    return path


def test_replay_peak_provisions_for_the_traces_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The acceptance test of issue 19 item 4: ``replay --policy peak`` replays, unchanged, the
    planner's plan for a steady trace at the replayed trace's peak rate."""
    spec = write_app(tmp_path)
    app = app_of(tmp_path)
    trace, shape = step_trace(), steady(50.0, 120.0, seed=5)
    base = [
        "replay",
        "--spec",
        str(spec),
        "--trace",
        str(write(tmp_path, "t.csv", trace)),
        "--planning-trace",
        str(write(tmp_path, "p.csv", shape)),
        "--json",
    ]
    outs = {}
    for baseline in ("peak", "mean"):
        assert main([*base, "--policy", baseline]) == 0
        outs[baseline] = json.loads(capsys.readouterr().out)
    peak, mean = outs["peak"], outs["mean"]

    rate = baseline_rate_qps(trace, "peak")
    assert peak["policy"] == "peak" and peak["baseline"]["rate_qps"] == pytest.approx(rate)
    assert peak["baseline"]["peak_window_s"] == PEAK_WINDOW_S
    # A plan made on a steady trace at the peak rate: the same fleet, served the whole run.
    at_peak = plan_app(app, scale_trace(shape, rate), seed=0)
    fleet = fleet_of(at_peak.to_document())
    assert peak["baseline"]["fleet"] == fleet
    assert all({k: v for k, v in w["fleet"].items() if v} == fleet for w in peak["timeline"])
    assert peak["scaling_actions"] == 0 and peak["decisions"] == []
    # Its capacity carries the peak: it serves the 150 qps step within the SLO, where the mean
    # plan, made for about 100 qps, is cheaper and misses more.
    assert mean["baseline"]["rate_qps"] < rate and mean["baseline"]["peak_window_s"] is None
    assert mean["baseline"]["fleet"] == fleet_of(
        plan_app(app, scale_trace(shape, mean["baseline"]["rate_qps"]), seed=0).to_document()
    )
    assert peak["baseline"]["cost_usd_per_hr"] > mean["baseline"]["cost_usd_per_hr"]
    assert peak["slo_miss_share"] < mean["slo_miss_share"]
    assert peak["slo_miss_share"] <= 0.01


def test_replay_peak_plans_on_the_first_tenth_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_app(tmp_path)
    trace = step_trace()
    path = write(tmp_path, "t.csv", trace)
    argv = ["replay", "--spec", str(spec), "--trace", str(path), "--policy", "peak"]
    assert main([*argv, "--peak-window-s", "20"]) == 0
    text = capsys.readouterr().out
    assert "under peak" in text and "most arrivals in any 20 s" in text
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["planning_trace"] == "first 10% of the trace"
    expected = plan_baseline(app_of(tmp_path), trace, "peak")
    assert out["baseline"]["fleet"] == fleet_of(expected.plan.to_document())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "static"], "--policy static replays a plan: pass --plan"),
        (["--policy", "tuner"], "--policy tuner replays a plan: pass --plan"),
        (["--policy", "peak", "--plan", "PLAN"], "--policy peak plans for the trace's peak"),
        (["--policy", "mean", "--plan", "PLAN"], "drop --plan"),
        (["--policy", "mean", "--peak-window-s", "5"], "--peak-window-s is for --policy peak"),
        (
            ["--policy", "static", "--plan", "PLAN", "--planning-trace", "TRACE"],
            "--planning-trace is for the tuner",
        ),
        (["--policy", "peak", "--peak-window-s", "0"], "peak window"),
    ],
)
def test_bad_combinations_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    spec = write_app(tmp_path)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_document({GPU: 1})))
    trace = write(tmp_path, "t.csv", step_trace())
    extra = [str(plan) if a == "PLAN" else str(trace) if a == "TRACE" else a for a in extra]
    with pytest.raises(SystemExit) as caught:
        main(["replay", "--spec", str(spec), "--trace", str(trace), *extra, "--json"])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
