"""The InferLine result's trace shapes and summary wording (benchmarks/results/inferline.py)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.inferline_tuner import SPIKES, TEST_S, make_traces, ramp_profile
from benchmarks.results.inferline import (
    BURST_FACTOR,
    BURST_PERIOD_S,
    BURST_S,
    burst_starts_s,
    bursty_profile,
    cost_relation,
    make_test_traces,
)
from estimator.batches import parse_batch_distribution


@pytest.mark.parametrize("duration_s", [180.0, 600.0, 900.0, 1000.0])
def test_bursty_profile_has_the_requested_mean(duration_s: float) -> None:
    profile = bursty_profile(150.0, duration_s)
    assert profile.cumulative(duration_s) / duration_s == pytest.approx(150.0, rel=1e-12)


def test_bursty_profile_bursts_at_the_factor_and_rests_between() -> None:
    profile = bursty_profile(100.0, 900.0)
    starts = burst_starts_s(900.0)
    assert len(starts) == 5
    assert np.diff(starts) == pytest.approx(BURST_PERIOD_S)
    base = profile.rate_at(starts[0] - 1.0)
    for start_s in starts:
        assert profile.rate_at(start_s + 1.0) == pytest.approx(BURST_FACTOR * base)
        assert profile.rate_at(start_s + BURST_S + 1.0) == pytest.approx(base)
    assert starts[-1] + BURST_S <= 900.0


def test_a_trace_shorter_than_a_burst_still_has_one() -> None:
    assert burst_starts_s(30.0) == [0.0]
    profile = bursty_profile(10.0, 30.0)
    assert profile.cumulative(30.0) / 30.0 == pytest.approx(10.0)


def test_the_ramp_keeps_issue_4s_spikes_at_30_minutes_and_scales_them_otherwise() -> None:
    full = ramp_profile(100.0)
    for start_s, length_s, factor in SPIKES:
        inside = start_s + length_s / 2
        assert full.rate_at(inside) == pytest.approx(
            factor * (0.6 * 100.0 + 0.8 * 100.0 * inside / TEST_S)
        )
    half = ramp_profile(100.0, TEST_S / 2)
    first_spike_s = SPIKES[0][0] / 2 + 1.0
    assert half.rate_at(first_spike_s) == pytest.approx(
        SPIKES[0][2] * (60.0 + 80.0 * first_spike_s / (TEST_S / 2))
    )


def test_test_traces_are_deterministic_for_a_seed_and_differ_between_seeds() -> None:
    batches = parse_batch_distribution("kairos")
    one = make_test_traces(20.0, 120.0, batches, 0)
    again = make_test_traces(20.0, 120.0, batches, 0)
    other = make_test_traces(20.0, 120.0, batches, 1)
    assert set(one) == {"steady", "ramp", "bursty"}
    for name in one:
        assert np.array_equal(one[name].arrival_s, again[name].arrival_s)
        assert not np.array_equal(one[name].arrival_s[:10], other[name].arrival_s[:10])


def test_make_traces_default_duration_is_issue_4s() -> None:
    _, test = make_traces(5.0, 0)
    assert test.duration_s > TEST_S - 60.0
    _, short = make_traces(5.0, 0, test_s=300.0)
    assert short.duration_s < 300.0


@pytest.mark.parametrize(
    ("cost", "reference", "text"),
    [
        (1.0, 2.44, "2.4x less cost than"),
        (1.3, 1.0, "1.3x more cost than"),
        (1.02, 1.0, "2% more cost than"),
        (1.0, 1.04, "4% less cost than"),
        (1.001, 1.0, "the same cost as"),
        (0.0, 1.0, "no cost comparable with"),
    ],
)
def test_cost_relation(cost: float, reference: float, text: str) -> None:
    assert cost_relation(cost, reference) == text
