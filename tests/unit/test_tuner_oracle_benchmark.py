"""The oracle's pieces (benchmarks/oracle.py, shared by benchmarks/tuner_oracle.py and
benchmarks/autoscaling_heldout.py) that need no planner: the minute rates and the oracle's
fleet per minute as the simulator takes it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.oracle import MINUTE_S, minute_rates_qps, oracle_timeline
from estimator.traces import Trace


def test_minute_rates_count_each_whole_minute() -> None:
    arrivals = np.concatenate([np.linspace(0.0, 59.9, 60), np.linspace(60.0, 119.9, 120)])
    trace = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    assert minute_rates_qps(trace, 120.0) == [1.0, 2.0]


def test_the_oracle_switches_its_fleet_at_each_minute_with_no_boot() -> None:
    fleets = [{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 1}]
    timeline = oracle_timeline(fleets)
    for m, fleet in enumerate(fleets):
        t = m * MINUTE_S + 1.0
        assert timeline.ready_fleet_at(t, ["a", "b"]) == fleet
    # Billed from the minute it starts serving: instance-seconds of the plan per minute.
    prices = {"a": 3600.0, "b": 36.0}
    assert timeline.cost_usd_per_hr_at(61.0, prices) == pytest.approx(3600.0 + 3 * 36.0)
    last = [s for s in timeline.instances if s.stop_s == math.inf]
    assert sorted(s.instance_type for s in last) == ["a", "b"]


def test_each_minute_serves_with_its_own_plans_batch() -> None:
    # The planner's plan for a minute has its own batch (a lone GPU may batch two queries where
    # the mix it replaces took one each): the cap moves where a minute's batch differs.
    fleets = [{"a": 1, "b": 2}, {"a": 1}, {"a": 1}, {"a": 1, "b": 1}]
    timeline = oracle_timeline(fleets, [1, 2, 2, 1], planned_batch=1)
    assert timeline.batch_caps == ((MINUTE_S, 2), (3 * MINUTE_S, 1))
    assert oracle_timeline(fleets, [2, 2, 2, 2], planned_batch=1).batch_caps == ((0.0, 2),)
    assert oracle_timeline(fleets).batch_caps == ()
