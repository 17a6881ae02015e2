"""The fidelity section's pure helpers and the serving-fidelity benchmark's judgement of a level
(the live runs themselves are benchmarks: `python -m benchmarks.results.fidelity`)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fidelity.serving import Level, compute_only, poisson_trace, predict
from benchmarks.results.fidelity import ratio_spread, within
from estimator.profiles import LatencyProfile


def level(measured: float, predicted: float) -> Level:
    return Level(0.5, 10.0, 100, 1.0, 1.0, measured, predicted, predicted, 0, 0.0)


def test_a_level_holds_within_fifteen_percent_of_the_measurement() -> None:
    assert level(115.0, 100.0).ratio == pytest.approx(1.15)
    assert level(100.0, 87.0).holds  # -13 %
    assert not level(100.0, 84.0).holds  # -16 %
    assert not level(100.0, 116.0).holds


def test_ratio_spread_and_within() -> None:
    assert ratio_spread([1.2, 0.9, 1.0]) == (1.0, 0.9, 1.2)
    assert within(1.14) and within(0.86) and not within(1.16) and not within(0.84)


def test_the_serving_path_model_predicts_more_than_the_compute_only_one() -> None:
    samples = (np.full(20, 7.5),)
    profile = LatencyProfile("large", "emu.cpu.large", np.array([1]), samples)
    old = compute_only(profile, 5.0)
    assert old.mean_latency_ms(1) == 5.0
    trace = poisson_trace(100.0, 30.0, 1)
    fleet = {"emu.cpu.large": 1}
    new_p99 = float(np.percentile(predict(trace, profile, fleet, 1), 99))
    old_p99 = float(np.percentile(predict(trace, old, fleet, 1), 99))
    # At 100 qps one instance is 75 % busy with 7.5 ms per query, 50 % with 5 ms: the queueing
    # the old model misses is more than the 2.5 ms per query it leaves out.
    assert new_p99 > old_p99 + 2.5
