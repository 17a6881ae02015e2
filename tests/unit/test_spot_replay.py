"""``heteroplane replay --interruptions-per-hour`` (controlplane.policies.spot_replay): a plan's
spot instances interrupted as a seeded Poisson process, each replaced at its notice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.policies.spot_replay import (
    DEFAULT_REPLACEMENT_BOOT_S,
    NOTICE_S,
    SPOT_SUFFIX,
    interrupted_timeline,
    parse_interruption_rates,
)
from estimator.traces import write_trace_csv
from tests.unit.test_planner import poisson_trace, write_cascade_app, write_spec


def test_spot_slots_are_chains_of_instances_and_on_demand_runs_throughout() -> None:
    end_s = 36_000.0
    timeline, log = interrupted_timeline(
        {"a": 3, "b": 1}, {"a": 2}, end_s, {"a": 1.0, "b": 50.0}, np.random.default_rng(7)
    )
    on_demand = [s for s in timeline.instances if not s.instance_type.endswith(SPOT_SUFFIX)]
    assert sorted(s.instance_type for s in on_demand) == ["a", "b"]  # b has no spot: never cut
    assert all(s.ready_s == 0 and math.isinf(s.stop_s) for s in on_demand)
    spot = [s for s in timeline.instances if s.instance_type.endswith(SPOT_SUFFIX)]
    assert log.spot_instances == 2 and len(spot) == 2 + log.interruptions
    # About one an hour each over ten hours.
    assert 8 <= log.interruptions <= 35
    # Each replacement is launched at its predecessor's notice and serves a boot later; the
    # predecessor serves until 25 s (margin and drain) before its deadline: the gap each time is
    # the boot less those 95 s, or up to the whole boot for one interrupted while it booted
    # (the last of each slot may be cut short by the end of the run).
    gap_s = DEFAULT_REPLACEMENT_BOOT_S - (NOTICE_S - 25.0)
    assert gap_s * (log.interruptions - 2) <= log.missing_instance_s
    assert log.missing_instance_s <= DEFAULT_REPLACEMENT_BOOT_S * log.interruptions
    replacements = [s for s in spot if s.ready_s > 0]
    assert all(s.billed_from_s == s.ready_s - DEFAULT_REPLACEMENT_BOOT_S for s in replacements)


def test_a_wave_takes_every_spot_instance_at_once() -> None:
    timeline, log = interrupted_timeline(
        {"a": 3}, {"a": 2}, 3600.0, {"a": 0.0}, np.random.default_rng(0), wave_at_s=600.0
    )
    assert log.interruptions == 2
    first = [s for s in timeline.instances if s.instance_type == "a@spot" and s.ready_s == 0]
    # Both stop before the wave's deadline, together; their replacements serve a boot after the
    # notice: the gap is the same for both.
    assert [s.stop_s for s in first] == [600.0 - 25.0] * 2
    later = [s for s in timeline.instances if s.instance_type == "a@spot" and s.ready_s > 0]
    assert [s.ready_s for s in later] == [600.0 - NOTICE_S + DEFAULT_REPLACEMENT_BOOT_S] * 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2", {"a": 2.0, "b": 2.0}), ("a=0.5", {"a": 0.5, "b": 0.0}), ("a=1,b=3", {"a": 1, "b": 3})],
)
def test_rates_are_one_for_all_or_one_per_type(text: str, expected: dict[str, float]) -> None:
    assert parse_interruption_rates(text, ["a", "b"]) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-1", "must be a finite number >= 0"),
        ("c=1", "'c' is not a type of the plan"),
        ("often", "'often' is not a number"),
        ("a=1,b", "expected TYPE=RATE"),
        ("a=100,a=3", "'a' is given twice"),
        ("", "got nothing"),
        (" , ", "got nothing"),
    ],
)
def test_bad_rates_are_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_interruption_rates(text, ["a", "b"])


def spot_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], queries: int
) -> tuple[Path, Path, Path]:
    """A spec that buys spot ($1.5/hr, a 40 ms SLO), a Poisson trace of ``queries`` at 200 q/s
    and the plan the command makes for it (with instances on spot): their files."""
    spec = write_spec(tmp_path, 40.0, 1.5, spot="{enabled: true, survive_share: 0.5}")
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(200.0, queries=queries), trace_file)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file), "--json"]) == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(capsys.readouterr().out)
    assert json.loads(plan_file.read_text())["stages"][0]["spot_fleet"]
    return spec, trace_file, plan_file


def test_the_command_replays_a_spot_plan_with_interruptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, trace_file, plan_file = spot_plan(tmp_path, capsys, 6000)
    args = ["replay", "--spec", str(spec), "--plan", str(plan_file), "--trace", str(trace_file)]

    assert main([*args, "--policy", "static", "--interruptions-per-hour", "0", "--json"]) == 0
    calm = json.loads(capsys.readouterr().out)
    assert calm["interruptions"]["interruptions"] == 0
    assert main([*args, "--policy", "static", "--interruptions-per-hour", "500", "--json"]) == 0
    stormy = json.loads(capsys.readouterr().out)
    assert stormy["interruptions"]["interruptions"] > 0
    assert stormy["interruptions"]["spot_instances"] == calm["interruptions"]["spot_instances"]
    # Every replacement is billed from its launch, next to its predecessor: it costs more.
    assert stormy["cost_usd"] > calm["cost_usd"]
    # The fleet short of its spot instances refuses, as the service's admission control does,
    # what its queue cannot serve in time; --no-admission serves it late instead.
    assert calm["refused_share"] < stormy["refused_share"]
    assert calm["slo_miss_share"] < stormy["slo_miss_share"]
    late = [*args, "--policy", "static", "--interruptions-per-hour", "500", "--no-admission"]
    assert main([*late, "--json"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert served["refused_share"] == 0
    assert served["interruptions"] == stormy["interruptions"]
    assert main([*args, "--interruptions-per-hour", "5"]) == 0  # static by default with it
    assert "interruptions of" in capsys.readouterr().out

    for bad, message in (
        (["--policy", "tuner", "--interruptions-per-hour", "5"], "use it with --policy static"),
        (["--policy", "static", "--interruptions-per-hour", "x=1"], "not a type of the plan"),
    ):
        with pytest.raises(SystemExit) as caught:
            main([*args, *bad])
        assert caught.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_the_plan_command_says_which_instances_are_spot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, 40.0, 1.5, spot="{enabled: true, survive_share: 0.5}")
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(200.0, queries=800), trace_file)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file)]) == 0
    text = capsys.readouterr().out
    assert " spot)" in text and "spot: " in text  # the fleet line and the step


def test_the_command_replays_a_cascade_with_interruptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cascade_app(tmp_path, records=True)
    spec = tmp_path / "cascade-True-0.6-50.yaml"
    spec.write_text(spec.read_text() + "spot: {enabled: true, survive_share: 0}\n")
    trace_file = tmp_path / "trace.csv"
    write_trace_csv(poisson_trace(600.0, queries=3000), trace_file)
    assert main(["plan", "--spec", str(spec), "--trace", str(trace_file), "--json"]) == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(capsys.readouterr().out)
    stages = json.loads(plan_file.read_text())["stages"]
    assert len(stages) == 2 and any(s["spot_fleet"] for s in stages)
    args = ["replay", "--spec", str(spec), "--plan", str(plan_file), "--trace", str(trace_file)]
    assert main([*args, "--interruptions-per-hour", "0", "--json"]) == 0
    calm = json.loads(capsys.readouterr().out)
    assert main([*args, "--interruptions-per-hour", "500", "--json"]) == 0
    stormy = json.loads(capsys.readouterr().out)
    spot = sum(sum(s["spot_fleet"].values()) for s in stages)
    assert calm["interruptions"]["spot_instances"] == spot
    assert calm["interruptions"]["interruptions"] == 0
    assert stormy["interruptions"]["interruptions"] > 0
    # A stage left without its spot instances refuses what it cannot serve in time, as the
    # service's admission control does. Served late instead, the run lasts until the
    # replacements have answered the queue, and they are billed until then.
    assert calm["refused_share"] == 0 < stormy["refused_share"]
    assert main([*args, "--interruptions-per-hour", "500", "--no-admission", "--json"]) == 0
    late = json.loads(capsys.readouterr().out)
    assert late["refused_share"] == 0 and late["interruptions"] == stormy["interruptions"]
    assert late["cost_usd"] > calm["cost_usd"]


def test_a_spot_plan_replays_at_the_price_it_was_planned_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan that fits its budget only at spot prices is replayed (not refused as over budget),
    static, its spot instances billed at the spot price whether or not interruptions are asked
    for; the tuner, which buys on demand, refuses it in one line."""
    _, trace_file, plan_file = spot_plan(tmp_path, capsys, 3000)
    planned = json.loads(plan_file.read_text())
    on_demand = planned["cost_if_on_demand_usd_per_hr"]
    assert planned["cost_usd_per_hr"] < on_demand
    # The budget the plan's own cost: over it on demand, within it at spot prices.
    tight = write_spec(
        tmp_path, 40.0, planned["cost_usd_per_hr"], spot="{enabled: true, survive_share: 0.5}"
    )
    args = ["replay", "--spec", str(tight), "--plan", str(plan_file), "--trace", str(trace_file)]
    assert main([*args, "--policy", "static", "--json"]) == 0
    static = json.loads(capsys.readouterr().out)
    assert main([*args, "--interruptions-per-hour", "0", "--json"]) == 0
    calm = json.loads(capsys.readouterr().out)
    assert static["cost_usd"] == calm["cost_usd"]
    assert static["p99_ms"] == calm["p99_ms"]
    peak = max(w["cost_usd_per_hr"] for w in static["timeline"])
    assert peak == pytest.approx(planned["cost_usd_per_hr"])
    assert main([*args, "--json"]) == 0  # static by default for a spot plan
    default = json.loads(capsys.readouterr().out)
    assert default["policy"] == "static" and default["cost_usd"] == static["cost_usd"]
    for policy in ("tuner", "utilization"):
        with pytest.raises(SystemExit) as caught:
            main([*args, "--policy", policy])
        assert caught.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "has instances on spot" in err[0], err
