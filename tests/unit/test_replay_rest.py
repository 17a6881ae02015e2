"""A replay's tuner skips the ticks of a span it is at rest in (controlplane/policies/replay.py,
``_at_rest``): no arrivals in its window, nothing decided or booting, past its waits. A sparse
trace of a week ticked 604,800 times; the skipped ticks must change nothing, so each replay here
is compared with the same replay ticking every second."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from controlplane.policies import replay as replay_module
from controlplane.policies.capacity_curve import replay_sizing
from controlplane.policies.pipeline import answering_stages
from controlplane.policies.replay import (
    FleetTimeline,
    cascade_tuner_timelines,
    check_plan,
    check_stages,
    parse_plan,
    stage_slo_targets_ms,
    tuner_timeline,
)
from estimator.traces import Trace, renewal_arrivals, step_profile
from tests.unit.test_cascade_planning import SMALL_PLAN
from tests.unit.test_planner import write_cascade_app
from tests.unit.test_replay import CPU, GPU, app_of, plan_document, steady_planning

T = TypeVar("T")


def sparse_trace(bursts: int = 4, burst_s: float = 90.0, gap_s: float = 600.0) -> Trace:
    """Bursts of 120 qps (a step to 200 qps halfway through each) with quiet gaps between them,
    longer than the tuner's window."""
    parts = []
    for i in range(bursts):
        start = i * (burst_s + gap_s)
        rng = np.random.default_rng(i)
        rates = step_profile(120.0, 200.0, burst_s / 2)
        parts.append(start + renewal_arrivals(rates, burst_s, 1.0, rng))
    arrivals = np.concatenate(parts)
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def counting_tune(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    ticks: list[float] = []
    tune = replay_module.tune

    def counted(arrival_s, now_s, *args, **kwargs):  # type: ignore[no-untyped-def]
        ticks.append(now_s)
        return tune(arrival_s, now_s, *args, **kwargs)

    monkeypatch.setattr(replay_module, "tune", counted)
    return ticks


def same(a: FleetTimeline, b: FleetTimeline) -> None:
    assert a.instances == b.instances
    assert a.aborted == b.aborted
    assert a.decisions == b.decisions
    assert a.batch_caps == b.batch_caps


def with_and_without_skipping(
    monkeypatch: pytest.MonkeyPatch, run: Callable[[], T]
) -> tuple[T, T, int, int]:
    """``run()`` as it is and ticking every second: (skipping, every tick, the ticks of each)."""
    ticks = counting_tune(monkeypatch)
    skipping = run()
    skipped = len(ticks)
    ticks.clear()
    monkeypatch.setattr(replay_module, "_at_rest", lambda *args: False)
    return skipping, run(), skipped, len(ticks)


def test_a_single_stage_replay_skips_its_rest_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = app_of(tmp_path, budget_usd_per_hr=5.0)
    stage = check_plan(parse_plan(plan_document({GPU: 1, CPU: 1})), app)
    trace = sparse_trace()
    skipping, every, skipped, ticked = with_and_without_skipping(
        monkeypatch, lambda: tuner_timeline(trace, app, stage, steady_planning())
    )
    # The fleet grew in the bursts and shrank in the gaps: there was something to change.
    assert any(d.action == "scale_up" for d in every.decisions)
    assert any(d.action == "scale_down" for d in every.decisions)
    same(skipping, every)
    assert ticked == int(np.ceil(trace.arrival_s[-1]))
    assert skipped < ticked / 2


def test_a_cascade_replay_skips_its_rest_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = write_cascade_app(tmp_path, records=True)
    plan = parse_plan(SMALL_PLAN)
    stages = check_stages(plan, app)
    trace = sparse_trace(bursts=3)
    answered = answering_stages(app, trace, np.random.default_rng(3))
    targets = stage_slo_targets_ms(plan, app)

    def run() -> tuple[FleetTimeline, ...]:
        made = cascade_tuner_timelines(trace, app, stages, answered, steady_planning(), targets)
        return tuple(m.timeline for m in made)

    skipping, every, skipped, ticked = with_and_without_skipping(monkeypatch, run)
    assert any(d.action == "scale_up" for t in every for d in t.decisions)
    for a, b in zip(skipping, every, strict=True):
        same(a, b)
    assert skipped < ticked / 2


def test_a_laddered_replay_skips_its_rest_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # replay's default model: the sizing ladder (three loads, the planning trace's burstiness
    # alone), bursts that must persist, the load model's memory.
    app = app_of(tmp_path, budget_usd_per_hr=5.0)
    stage = check_plan(parse_plan(plan_document({GPU: 1})), app)
    planning_s = steady_planning()
    planning = Trace(planning_s, np.ones(planning_s.size, dtype=np.int64))
    ladder, options = replay_sizing(
        app, stage, planning, dispatch=stage.policy, loads=(0.5, 1.0, 2.0), burstiness=()
    )
    assert ladder is not None
    trace = sparse_trace()

    def run() -> FleetTimeline:
        return tuner_timeline(
            trace,
            app,
            stage,
            planning_s,
            ladder=ladder,
            recent_s=options["tuner_recent_s"],
            persistence_s=options["tuner_persistence_s"],
        )

    skipping, every, skipped, ticked = with_and_without_skipping(monkeypatch, run)
    assert any(d.action == "scale_up" for d in every.decisions)
    same(skipping, every)
    assert skipped < ticked / 2
