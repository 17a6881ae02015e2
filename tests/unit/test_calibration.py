"""The calibration policy: the batch-weighted observed / profile ratio and the drift rule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.policies.calibration import CalibrationRule, calibrate
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
