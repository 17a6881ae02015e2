"""The pure helpers of benchmarks/results/controlplane.py: goals, verdicts, formatting, summary."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks.results.controlplane import (
    FULL,
    QUICK,
    Goal,
    Row,
    dispatch_verdicts,
    fmt,
    goals_count,
    rows_table,
    summary_lines,
)
from benchmarks.serving_speed.dispatcher import Run


def row(key: str, value: float | None, goal: Goal | None, **extra: Any) -> Row:
    return Row(key, f"figure {key}", value, "ms", goal, "measured thing", "python x.py", **extra)


@pytest.mark.parametrize(
    ("op", "measured", "met"),
    [
        (">=", 20.0, True),
        (">=", 19.99, False),
        (">", 20.0, False),
        ("<=", 5.0, True),
        ("<=", 5.01, False),
        ("<", 5.0, False),
        ("<", 4.99, True),
    ],
)
def test_goal_met_follows_its_operator(op: str, measured: float, met: bool) -> None:
    goal = Goal(op, 20.0 if op.startswith(">") else 5.0)
    assert goal.met(measured) is met


def test_goal_ratio_is_above_one_exactly_when_better_than_the_goal() -> None:
    assert Goal(">=", 20.0).ratio(60.0) == pytest.approx(3.0)
    assert Goal(">=", 20.0).ratio(10.0) == pytest.approx(0.5)
    assert Goal("<=", 2.0).ratio(8.0) == pytest.approx(0.25)
    assert Goal("<", 5.0).ratio(0.5) == pytest.approx(10.0)
    assert math.isinf(Goal("<", 5.0).ratio(0.0))
    assert Goal(">=", 5.0).ratio(0.0) == 0.0


def test_goal_rejects_unknown_operators_and_non_positive_values() -> None:
    with pytest.raises(ValueError, match="operator"):
        Goal("==", 1.0)
    with pytest.raises(ValueError, match="> 0"):
        Goal("<", 0.0)


def test_goal_text_keeps_the_goal_as_stated() -> None:
    assert Goal(">=", 2000.0).text("q/s") == ">= 2,000 q/s"
    assert Goal("<", 5.0).text("s") == "< 5 s"


def test_row_verdict_needs_a_goal_a_value_and_its_condition() -> None:
    assert row("a", 3.0, Goal("<=", 5.0)).met is True
    assert row("b", 3.0, Goal("<=", 5.0), condition_ok=False).met is False
    assert row("c", 3.0, None).met is None
    assert row("d", None, Goal("<=", 5.0), note="failed").met is None
    assert row("d", None, Goal("<=", 5.0)).ratio is None


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (60_612_345.0, "60,612,345"),
        (123.4, "123"),
        (36.14, "36.1"),
        (2.345, "2.35"),
        (0.6123, "0.612"),
        (0.0, "0"),
    ],
)
def test_fmt_keeps_about_three_significant_digits(value: float | None, text: str) -> None:
    assert fmt(value) == text


def test_goals_count_and_table_skip_figures_without_a_verdict() -> None:
    rows = [
        row("a", 3.0, Goal("<=", 5.0)),
        row("b", 9.0, Goal("<=", 5.0)),
        row("c", 1.0, None),
        row("d", None, Goal("<", 2.0), note="no plan"),
    ]
    assert goals_count(rows) == (1, 2)
    table = rows_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "| met |" in lines[2]
    assert "**not met**" in lines[3]
    assert "- (no plan)" in lines[5]


def test_summary_lines_carry_the_computed_numbers_and_verdicts() -> None:
    rows = [
        row("fcfs_1_instances", 61.0, Goal(">=", 20.0)),
        row("fcfs_64_instances", 13.0, Goal(">=", 20.0)),
        row("envelope", 88.0, Goal("<", 100.0)),
        row("exhaustive_4_types", 18.5, Goal(">=", 10.0)),
        row("ten_types_50", 0.61, Goal("<", 5.0)),
        row("decision_32x16", 36.1, Goal("<=", 50.0)),
        row("decision_256x128", 3.6, Goal("<=", 2.0)),
        row("simulator_kairos_100", 75.0, Goal(">=", 50.0)),
        row("planner", 1.7, Goal("<", 10.0)),
        row("gear_real", None, Goal("<", 2.0), note="no plan", short="gear planner, real family"),
        row("gear_synthetic", 0.5, Goal("<", 2.0), short="gear planner, synthetic family"),
        row("dispatcher_fcfs_2000", 2.3, Goal("<=", 5.0)),
        row("dispatcher_kairos_2000", 7.7, Goal("<=", 5.0)),
        row("dispatcher_cascade_2000", 4.0, Goal("<=", 5.0), condition_ok=False),
        row("dispatcher_fcfs_4000", 11.0, None),
    ]
    lines = summary_lines(rows, FULL)
    assert 2 <= len(lines) <= 5
    text = "\n".join(lines)
    assert "13.0 ms on 64 instances (goal >= 20 ms: not met)" in text
    assert "3.60 ms at p99 (goal <= 2 ms: not met)" in text
    # The measured gear row is quoted, not the one that failed.
    assert "gears in 0.5 ms for the synthetic family (goal < 2 ms: met)" in text
    assert "holds in 1 of 3 scenarios" in text
    assert "(FCFS at 4,000 q/s: p99 11.0 ms)" in text
    met, judged = goals_count(rows)
    assert f"{met} of {judged} control-plane speed goals" in text


def test_quick_sizes_are_smaller_than_the_full_ones() -> None:
    assert QUICK.estimator_queries < FULL.estimator_queries
    assert QUICK.dispatcher_duration_s < FULL.dispatcher_duration_s
    assert QUICK.matching_states < FULL.matching_states
    assert not QUICK.dispatcher_headroom_qps


def run_at(rate_qps: float, answered: int, p99_ms: float) -> Run:
    sent = int(rate_qps * 10)
    return Run(
        scenario="fcfs",
        rate_qps=rate_qps,
        duration_s=10.0,
        sent=sent,
        answered=answered,
        refused=sent - answered,
        failed=0,
        sustained_qps=answered / 10.0,
        p50_ms=1.0,
        p99_ms=p99_ms,
        max_ms=2 * p99_ms,
        drain_ms=1.0,
        worker_calls=answered,
        cpu_us_per_query=150.0,
    )


def test_dispatch_verdicts_speak_as_the_script_does() -> None:
    runs = [
        run_at(2000, 20_000, 2.5),  # the goal
        run_at(2000, 20_000, 40.0),  # every query answered, p99 over 5 ms
        run_at(2000, 19_000, 3.0),  # refusals
        run_at(4000, 40_000, 30.0),  # headroom, over 5 ms
        run_at(4000, 40_000, 150.0),  # p99 past 100 ms: fell behind
    ]
    assert dispatch_verdicts(runs, 2000) == [
        "met",
        "kept up",
        "fell behind",
        "past the goal",
        "fell behind",
    ]
