"""Arrival envelopes (InferLine Algorithm 3) against brute force, and the tuner's windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.envelope import (
    Envelope,
    arrival_cv2,
    arrival_envelope,
    clip_short_bursts,
    tuner_windows_s,
)
from estimator.errors import TraceError, WorkloadError
from estimator.traces import constant_profile, gamma_arrivals, renewal_arrivals, step_profile


def brute_force(arrival_s: np.ndarray, window_s: np.ndarray) -> list[int]:
    """max over starts t of #{j : t <= a_j < t + w}, trying every t in the trace (O(n^2))."""
    best = []
    for w in window_s:
        counts = [int(np.sum((arrival_s >= t) & (arrival_s < t + w))) for t in arrival_s]
        best.append(max(counts, default=0))
    return best


# --- the tuner's windows ---------------------------------------------------------------------


def test_windows_double_from_the_service_time() -> None:
    assert tuner_windows_s(0.25).tolist() == [0.25, 0.5, 1, 2, 4, 8, 16, 32, 60]
    assert tuner_windows_s(1.0).tolist() == [1, 2, 4, 8, 16, 32, 60]
    assert tuner_windows_s(0.234375).tolist()[-2:] == [30.0, 60.0]  # 0.234375 * 256 = 60 once
    assert tuner_windows_s(60.0).tolist() == [60.0]
    assert tuner_windows_s(0.3, max_window_s=1.0).tolist() == [0.3, 0.6, 1.0]
    windows = tuner_windows_s(0.007)
    assert np.all(np.diff(windows) > 0) and windows[-1] == 60.0


@pytest.mark.parametrize(
    ("service", "maximum", "message"),
    [
        (0.0, 60.0, "service_time_s must be a finite number > 0, got 0.0"),
        (-1.0, 60.0, "service_time_s must be"),
        (math.nan, 60.0, "service_time_s must be"),
        (1.0, math.inf, "max_window_s must be"),
        (90.0, 60.0, "longer than max_window_s"),
    ],
)
def test_windows_validation(service: float, maximum: float, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        tuner_windows_s(service, maximum)


# --- envelopes -------------------------------------------------------------------------------


# Timestamps on a coarse grid make ties and arrivals exactly on a window's edge common.
grid_arrivals = st.lists(st.integers(min_value=0, max_value=40), max_size=60).map(
    lambda ticks: np.sort(np.array(ticks, dtype=np.float64)) / 4.0
)
float_arrivals = st.lists(
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False), max_size=60
).map(lambda xs: np.sort(np.array(xs, dtype=np.float64)))
windows = st.lists(
    st.one_of(
        st.integers(min_value=1, max_value=44).map(lambda q: q / 4.0),
        st.floats(min_value=1e-3, max_value=120.0),
    ),
    min_size=1,
    max_size=6,
).map(lambda ws: np.array(ws, dtype=np.float64))


@settings(max_examples=200, deadline=None)
@given(st.one_of(grid_arrivals, float_arrivals), windows)
def test_envelope_matches_brute_force(arrival_s: np.ndarray, window_s: np.ndarray) -> None:
    envelope = arrival_envelope(arrival_s, window_s)
    assert envelope.max_arrivals.tolist() == brute_force(arrival_s, window_s)
    assert envelope.window_s.tolist() == window_s.tolist()


def test_edge_cases() -> None:
    windows_s = [0.5, 1.0, 10.0]
    assert arrival_envelope([], windows_s).max_arrivals.tolist() == [0, 0, 0]
    assert arrival_envelope([3.0], windows_s).max_arrivals.tolist() == [1, 1, 1]
    assert arrival_envelope([2.0] * 7, windows_s).max_arrivals.tolist() == [7, 7, 7]
    # Half-open windows: arrivals one second apart, a 1 s window holds one, not two.
    ticks = np.arange(100.0)
    assert arrival_envelope(ticks, [1.0, 10.0, 10.5]).max_arrivals.tolist() == [1, 10, 11]
    assert arrival_envelope(ticks, []).max_arrivals.size == 0


def test_rate_and_frozen_results() -> None:
    windows_s = np.array([0.5, 2.0])
    envelope = arrival_envelope([0.0, 0.1, 0.2, 0.3, 5.0], windows_s)
    assert envelope.max_arrivals.dtype == np.int64
    assert envelope.rate_qps.tolist() == [8.0, 2.0]
    assert not envelope.max_arrivals.flags.writeable and not envelope.window_s.flags.writeable
    assert windows_s.flags.writeable  # the caller's array is left alone
    with pytest.raises(WorkloadError, match="one max_arrivals per window"):
        Envelope(window_s=np.array([1.0, 2.0]), max_arrivals=np.array([3]))


def test_large_trace_agrees_with_a_vectorised_count() -> None:
    # An independent O(n log n) count at a size where brute force is out of reach.
    arrival_s = gamma_arrivals(500.0, 4.0, 200.0, np.random.default_rng(0))
    windows_s = tuner_windows_s(0.01)
    expected = [
        int(
            np.max(
                np.searchsorted(arrival_s, arrival_s + w, side="left") - np.arange(arrival_s.size)
            )
        )
        for w in windows_s
    ]
    envelope = arrival_envelope(arrival_s, windows_s)
    assert envelope.max_arrivals.tolist() == expected
    # Peak rates fall towards the mean rate as the window grows (bursts average out).
    assert envelope.rate_qps[0] > 2 * 500.0 and envelope.rate_qps[-1] < 1.2 * 500.0


@pytest.mark.parametrize(
    ("arrival_s", "windows_s", "error", "message"),
    [
        ([0.0, 2.0, 1.0], [1.0], TraceError, r"arrival time decreases at row 3: 1\.0 < 2\.0"),
        ([0.0, math.nan], [1.0], TraceError, "not finite at row 2: nan"),
        ([[0.0, 1.0]], [1.0], TraceError, "one-dimensional"),
        ([0.0, 1.0], [1.0, 0.0], WorkloadError, r"finite and > 0 s, got 0\.0"),
        ([0.0, 1.0], [-2.0], WorkloadError, r"got -2\.0"),
        ([0.0, 1.0], [math.inf], WorkloadError, "got inf"),
        ([0.0, 1.0], [[1.0]], WorkloadError, "one-dimensional"),
    ],
)
def test_envelope_validation(
    arrival_s: list[float], windows_s: list[float], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        arrival_envelope(arrival_s, windows_s)


# --- the burstiness ----------------------------------------------------------------------------


@pytest.mark.parametrize("cv2", [1.0, 2.0, 8.0])
def test_the_burstiness_reads_the_gaps_cv2(cv2: float) -> None:
    rng = np.random.default_rng(7)
    arrivals = renewal_arrivals(constant_profile(100.0), 120.0, cv2, rng)
    read, gaps = arrival_cv2(arrivals)
    assert gaps == arrivals.size - 1
    assert abs(math.log(read / cv2)) < math.log(1.25)


def test_a_moving_rate_does_not_read_as_bursts() -> None:
    # Poisson arrivals from 30 to 300 qps over two minutes: the plain gap CV^2 reads the
    # changing rate (well over 1), the estimate per 10 s stretch does not.
    rng = np.random.default_rng(3)
    arrivals = renewal_arrivals(step_profile(30.0, 300.0, 0.0, over_s=120.0), 120.0, 1.0, rng)
    gaps = np.diff(arrivals)
    assert gaps.var() / gaps.mean() ** 2 > 1.3
    read, _ = arrival_cv2(arrivals)
    assert 0.85 < read < 1.15


def test_the_burstiness_of_too_few_or_bad_arrivals() -> None:
    read, gaps = arrival_cv2([1.0, 2.0])
    assert math.isnan(read) and gaps == 0
    with pytest.raises(TraceError):
        arrival_cv2([2.0, 1.0, 3.0])
    with pytest.raises(WorkloadError, match="bin_s"):
        arrival_cv2([1.0, 2.0, 3.0], bin_s=0.0)


# --- short bursts taken out of long windows ----------------------------------------------------


@pytest.mark.parametrize(("rate", "cv2"), [(60.0, 1.0), (60.0, 8.0), (250.0, 4.0)])
def test_a_blip_is_read_at_the_traffics_level_and_the_traffic_as_it_is(
    rate: float, cv2: float
) -> None:
    """Gamma arrivals of the given burstiness for a minute keep (almost) every arrival: a second
    over 5 standard deviations of its stretch's median is rare. Five seconds' worth of queries
    inside the last second (a blip, read at the memory's end, where the stretch is the seconds
    before it) is cut to within that bound, so the 32 s window reads the traffic's rate and
    little more."""
    rng = np.random.default_rng(11)
    traffic = gamma_arrivals(rate, cv2, 60.0, rng)
    kept = clip_short_bursts(traffic, 15.0, cv2)
    assert kept.size >= traffic.size * 0.999
    blip = 59.0 + np.sort(rng.uniform(0.0, 1.0, int(5 * rate)))
    with_blip = np.sort(np.concatenate([traffic, blip]))
    calm = clip_short_bursts(with_blip, 15.0, cv2)
    # The blip's second straddles at most two bins (they start at the first arrival), each of
    # which keeps at most 5 standard deviations over its stretch's median.
    bound = 2 * 5.0 * math.sqrt(rate * max(cv2, 1.0))
    assert calm.size - kept.size <= bound
    dropped = np.setdiff1d(with_blip, calm)
    assert dropped.size and dropped.min() >= 58.0  # from the blip's bins alone
    read = arrival_envelope(calm, [32.0]).rate_qps[0]
    assert read <= arrival_envelope(traffic, [32.0]).rate_qps[0] + bound / 32.0
    assert read < arrival_envelope(with_blip, [32.0]).rate_qps[0] - rate / 32.0


@pytest.mark.parametrize("lasts_s", [20.0, 10.0, 8.0], ids=["step", "10 s", "8 s"])
def test_a_step_or_a_burst_that_lasts_is_not_clipped(lasts_s: float) -> None:
    """A doubling of the rate that stays (a step at 40 s) or lasts 10 or 8 s (over half the
    15 s stretch: 15 seconds centred on each, not 17 as a rounding of 7.5 to 8 had made it, which
    cut 688 of an 8 s burst's 800 extra arrivals) is load: every arrival is kept."""
    rng = np.random.default_rng(5)
    base = gamma_arrivals(60.0, 1.0, 60.0, rng)
    more = 40.0 + np.sort(rng.uniform(0.0, lasts_s, int(60 * lasts_s)))
    arrivals = np.sort(np.concatenate([base, more]))
    assert clip_short_bursts(arrivals, 15.0, 1.0).size == arrivals.size


def test_clipping_bad_arguments() -> None:
    assert clip_short_bursts([], 15.0).size == 0
    assert clip_short_bursts([1.0, 2.0], 15.0).tolist() == [1.0, 2.0]  # shorter than a stretch
    with pytest.raises(TraceError):
        clip_short_bursts([2.0, 1.0], 15.0)
    for name, kwargs in (("persistence_s", {"persistence_s": 0.0}), ("z", {"z": -1.0})):
        with pytest.raises(WorkloadError, match=name):
            clip_short_bursts([1.0, 2.0, 3.0], **kwargs)


@pytest.mark.parametrize("period_s", [5.0, 10.0, 20.0])
def test_bursts_that_recur_across_the_memory_are_not_clipped(period_s: float) -> None:
    """Clients that send their queries in bursts (a burst inside 0.2 s every ``period_s``,
    64 qps on average, next to a little steady traffic): each burst's second stands out of its
    stretch, but they recur across the memory, so they are load, not a blip (the persistence
    test's rule: a burst counts once another like it comes within the memory). Clipped, a
    minute of them read a fifth of their rate at the 60 s window."""
    size = int(64 * period_s)
    bursts = [t + np.arange(size) * 0.2 / size for t in np.arange(period_s, 60.0, period_s)]
    arrivals = np.sort(np.concatenate([*bursts, np.arange(0.0, 60.0, 0.5)]))
    assert clip_short_bursts(arrivals, 15.0, arrival_cv2(arrivals)[0]).size == arrivals.size
