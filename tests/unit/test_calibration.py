"""The calibration policy: the batch-weighted observed / profile ratio and the drift rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.policies.calibration import (
    OVERHEAD_QUANTILES,
    CalibrationRule,
    calibrate,
    draw_overhead_ms,
    overhead_drift,
    spread_drift,
    spread_samples,
)
from estimator.profiles import LatencyProfile

PROFILE = LatencyProfile("m", "t", [1, 4, 8], ([10.0, 12.0], [20.0], [30.0]))  # means 11, 20, 30


def test_one_batch_size_gives_the_ratio_of_the_means() -> None:
    c = calibrate(PROFILE, {1: [22.0] * 50}, CalibrationRule(min_batches=50, threshold=0.25))
    assert c.drift
    assert c.factor == pytest.approx(2.0)
    assert (c.profile_mean_ms, c.observed_mean_ms, c.batches) == (pytest.approx(11.0), 22.0, 50)


def test_batches_are_weighted_by_their_predicted_time() -> None:
    # 10 batches of 8 (300 ms predicted, 600 observed) and 10 of 1 (110 predicted, 110 observed)
    c = calibrate(PROFILE, {8: [60.0] * 10, 1: [11.0] * 10}, CalibrationRule(min_batches=20))
    assert c.factor == pytest.approx(710.0 / 410.0)
    assert c.drift


def test_between_measured_sizes_the_profile_is_interpolated() -> None:
    c = calibrate(PROFILE, {6: [25.0] * 5}, CalibrationRule(min_batches=5))
    assert c.profile_mean_ms == pytest.approx(25.0)
    assert not c.drift


def test_sizes_the_profile_does_not_cover_are_left_out() -> None:
    c = calibrate(PROFILE, {16: [500.0] * 100}, CalibrationRule(min_batches=1))
    assert (c.batches, c.factor, c.drift, c.profile_mean_ms) == (0, 1.0, False, None)


def test_within_the_threshold_is_no_drift() -> None:
    c = calibrate(PROFILE, {1: [13.0] * 100}, CalibrationRule(min_batches=50, threshold=0.25))
    assert c.factor == pytest.approx(13.0 / 11.0)
    assert not c.drift


def test_a_faster_worker_is_drift_too() -> None:
    c = calibrate(PROFILE, {4: [5.0] * 60})
    assert c.drift and c.factor == pytest.approx(0.25)


@pytest.mark.parametrize("rule", [{"min_batches": 0}, {"threshold": 0.0}, {"threshold": math.inf}])
def test_a_malformed_rule_is_refused(rule: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CalibrationRule(**rule)  # type: ignore[arg-type]


observed = st.dictionaries(
    st.sampled_from([1, 2, 4, 6, 8]),
    st.lists(st.floats(0.1, 1000.0), min_size=1, max_size=40),
    min_size=1,
    max_size=5,
)


@given(observed, st.integers(1, 200), st.floats(0.01, 2.0))
def test_below_min_batches_there_is_no_drift(
    times: dict[int, list[float]], min_batches: int, threshold: float
) -> None:
    c = calibrate(PROFILE, times, CalibrationRule(min_batches=min_batches, threshold=threshold))
    count = sum(len(v) for v in times.values())
    assert c.batches == count
    if count < min_batches:
        assert not c.drift
    else:
        assert c.drift == (abs(c.factor - 1.0) > threshold)


@given(observed)
def test_the_factor_is_the_observed_over_the_profiled_time(times: dict[int, list[float]]) -> None:
    c = calibrate(PROFILE, times, CalibrationRule(min_batches=1))
    predicted = sum(PROFILE.mean_latency_ms(b) * len(v) for b, v in times.items())
    assert c.factor == pytest.approx(sum(sum(v) for v in times.values()) / predicted)
    assert c.observed_mean_ms is not None and c.profile_mean_ms is not None
    assert c.factor == pytest.approx(c.observed_mean_ms / c.profile_mean_ms)


@given(observed)
def test_the_profile_scaled_by_the_factor_has_no_drift(times: dict[int, list[float]]) -> None:
    c = calibrate(PROFILE, times, CalibrationRule(min_batches=1))
    scaled = LatencyProfile(
        "m", "t", PROFILE.batch_sizes, tuple(cell * c.factor for cell in PROFILE.samples_ms)
    )
    assert calibrate(scaled, times, CalibrationRule(min_batches=1)).factor == pytest.approx(1.0)


# --- the control plane's own time per query: its distribution, not only its median -----------

RULE = CalibrationRule(min_batches=50)
# 1 ms at the median, a tail of 15 ms: what the periodic jobs on the serving interpreter give.
STEADY = [1.0] * 97 + [15.0] * 3


def test_the_overheads_quantiles_are_kept_with_its_median() -> None:
    verdict = overhead_drift(None, STEADY, RULE)
    assert verdict.drift and verdict.observed_ms == 1.0
    assert len(verdict.quantiles_ms) == len(OVERHEAD_QUANTILES) == 101
    assert verdict.quantiles_ms[0] == 1.0 and verdict.quantiles_ms[100] == 15.0
    assert verdict.quantiles_ms[99] == pytest.approx(15.0)
    assert list(verdict.quantiles_ms) == sorted(verdict.quantiles_ms)


def test_a_tail_that_moves_is_drift_even_when_the_median_stays() -> None:
    stored = overhead_drift(None, STEADY, RULE)
    calmer = [1.0] * 100  # the same median, no tail
    assert not overhead_drift(1.0, STEADY, RULE, stored.quantiles_ms).drift
    moved = overhead_drift(1.0, calmer, RULE, stored.quantiles_ms)
    assert moved.drift and moved.quantiles_ms[99] == 1.0
    # A figure stored before the distribution was: stored again, with it.
    assert overhead_drift(1.0, STEADY, RULE, ()).drift
    assert not overhead_drift(1.0, STEADY[:40], RULE, ()).drift  # too few queries


def test_draws_follow_the_quantiles() -> None:
    quantiles = overhead_drift(None, STEADY, RULE).quantiles_ms
    draws = draw_overhead_ms(quantiles, 20_000, np.random.default_rng(0))
    assert float(np.median(draws)) == pytest.approx(1.0)
    assert 0.03 < float(np.mean(draws > 1.0)) < 0.05  # the 3 % tail, interpolated from 96 %
    assert draws.max() <= 15.0 and draws.min() >= 1.0
    with pytest.raises(ValueError, match="101 quantiles"):
        draw_overhead_ms([1.0, 2.0], 3, np.random.default_rng(0))


# --- the spread of the round trips: the live path's tail, not the profiler's ------------------

# 10 ms at every measured size but twice as long at 4 % of the calls (a profile with a spread).
SPREAD_PROFILE = LatencyProfile("m", "t", [1, 4], ([10.0] * 24 + [20.0], [30.0] * 24 + [60.0]))


def test_a_spread_like_the_profiles_is_not_drift_and_a_heavier_one_is() -> None:
    alike = {1: ([10.0] * 24 + [20.0]) * 4, 4: ([30.0] * 24 + [60.0]) * 4}  # 200 batches
    assert not spread_drift(SPREAD_PROFILE, alike).drift
    heavier = {1: [10.0] * 180 + [50.0] * 20}
    verdict = spread_drift(SPREAD_PROFILE, heavier)
    assert verdict.drift and verdict.batches == 200
    assert verdict.observed_tail > 2.0 * verdict.profile_tail
    # A sample shape once stored, the same window is no drift against it.
    again = LatencyProfile(
        "m",
        "t",
        [1, 4],
        tuple(spread_samples(verdict.quantiles, mean) for mean in SPREAD_PROFILE.mean_ms),
    )
    assert not spread_drift(again, heavier).drift


def test_a_spread_needs_enough_batches_at_measured_sizes() -> None:
    heavier = [10.0] * 180 + [50.0] * 20
    assert not spread_drift(SPREAD_PROFILE, {1: heavier[:199]}).drift  # fine_min_batches: 200
    outside = spread_drift(SPREAD_PROFILE, {2: heavier, 8: heavier})  # not measured sizes
    assert (outside.batches, outside.quantiles, outside.drift) == (0, (), False)
    assert (
        spread_drift(SPREAD_PROFILE, {1: heavier}, CalibrationRule(fine_min_batches=500)).batches
        == 200
    )


@given(
    st.lists(st.floats(0.01, 100.0), min_size=101, max_size=101).map(sorted),
    st.floats(0.1, 1000.0),
)
def test_spread_samples_have_the_mean_asked_for_in_the_shapes_order(
    quantiles: list[float], mean_ms: float
) -> None:
    samples = spread_samples(quantiles, mean_ms)
    assert samples.size == 100
    assert float(samples.mean()) == pytest.approx(mean_ms)
    assert list(samples) == sorted(samples)
    with pytest.raises(ValueError, match="101 quantiles"):
        spread_samples(quantiles[:-1], mean_ms)
