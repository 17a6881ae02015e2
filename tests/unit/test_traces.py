"""Traces: the value object, the CSV contract, statistics, rate profiles and the generators."""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.errors import EstimatorError, TraceError, WorkloadError
from estimator.traces import (
    RateProfile,
    Trace,
    constant_profile,
    diurnal_profile,
    gamma_arrivals,
    poisson_arrivals,
    read_trace_csv,
    renewal_arrivals,
    step_profile,
    trace_stats,
    with_spikes,
    write_trace_csv,
)


def within_poisson(count: int, expected: float, cv2: float = 1.0, sigmas: float = 4.0) -> bool:
    """A renewal count over a long stretch has variance about cv2 * mean (renewal CLT)."""
    return abs(count - expected) <= sigmas * math.sqrt(max(cv2, 1e-9) * expected) + 1.0


def cv2_estimate_sd(k: float, n: int) -> float:
    """Standard deviation of the sample CV^2 of n i.i.d. gamma(shape k, mean 1) gaps (delta
    method on g(m1, m2) = m2 / m1^2 with the gamma raw moments)."""
    m1 = 1.0
    m2 = (k + 1) / k
    m3 = (k + 1) * (k + 2) / k**2
    m4 = (k + 1) * (k + 2) * (k + 3) / k**3
    var_x, var_x2, cov = m2 - m1**2, m4 - m2**2, m3 - m1 * m2
    d1, d2 = -2.0 * m2 / m1**3, 1.0 / m1**2
    return math.sqrt((d1 * d1 * var_x + d2 * d2 * var_x2 + 2 * d1 * d2 * cov) / n)


# --- the value object ------------------------------------------------------------------------


def test_trace_converts_and_freezes_its_arrays() -> None:
    arrivals = [0, 1, 1, 2.5]
    batches = np.array([1.0, 2.0, 3.0, 4.0])
    trace = Trace(np.array(arrivals), batches, np.array([0, 3, 1, 2], dtype=np.int32))
    assert trace.arrival_s.dtype == np.float64 and trace.batch_size.dtype == np.int64
    assert trace.sample_id is not None and trace.sample_id.dtype == np.int64
    assert trace.arrival_s.flags.c_contiguous and not trace.arrival_s.flags.writeable
    assert len(trace) == 4 and trace.duration_s == 2.5
    batches[0] = 99.0  # the trace holds its own copy
    assert trace.batch_size[0] == 1
    with pytest.raises(ValueError, match="read-only"):
        trace.arrival_s[0] = 5.0


def test_duration_of_short_traces_is_zero() -> None:
    assert Trace(np.array([]), np.array([], dtype=np.int64)).duration_s == 0.0
    assert Trace(np.array([7.0]), np.array([1])).duration_s == 0.0
    assert Trace(np.array([7.0, 7.0]), np.array([1, 1])).duration_s == 0.0


@pytest.mark.parametrize(
    ("arrival", "batch", "sample", "message"),
    [
        ([0.0, 3.5, 3.2], [1, 1, 1], None, r"arrival_s decreases at row 3: 3\.2 < 3\.5"),
        ([0.0, -1.0], [1, 1], None, r"arrival_s is negative at row 2: -1\.0"),
        ([0.0, math.nan], [1, 1], None, "arrival_s is not finite at row 2: nan"),
        ([0.0, math.inf], [1, 1], None, "arrival_s is not finite at row 2: inf"),
        ([0.0, 1.0], [1, 0], None, "batch_size must be >= 1, got 0 at row 2"),
        ([0.0, 1.0], [1.0, 2.5], None, r"batch_size is not an integer at row 2: 2\.5"),
        ([0.0, 1.0], [1], None, "batch_size has 1 rows but arrival_s has 2"),
        ([0.0, 1.0], [1, 1], [0, -4], "sample_id must be >= 0, got -4 at row 2"),
        ([0.0, 1.0], [1, 1], [0], "sample_id has 1 rows but arrival_s has 2"),
        ([[0.0, 1.0]], [1, 1], None, "one-dimensional"),
        (["a", "b"], [1, 1], None, "must hold numbers"),
    ],
)
def test_trace_rejects_bad_columns_naming_the_row(
    arrival: list[float], batch: list[float], sample: list[int] | None, message: str
) -> None:
    with pytest.raises(TraceError, match=message):
        Trace(np.array(arrival), np.array(batch), None if sample is None else np.array(sample))


def test_trace_errors_are_estimator_errors_and_value_errors() -> None:
    with pytest.raises(EstimatorError):
        Trace(np.array([1.0, 0.0]), np.array([1, 1]))
    assert issubclass(TraceError, ValueError)


# --- the CSV contract ------------------------------------------------------------------------


def write_text(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False),
        max_size=40,
    ).filter(lambda xs: len(xs) > 0),
    st.booleans(),
)
def test_csv_round_trips_exactly(arrivals: list[float], with_samples: bool) -> None:
    import tempfile

    n = len(arrivals)
    trace = Trace(
        np.sort(np.array(arrivals)),
        np.arange(1, n + 1),
        np.arange(n)[::-1].copy() if with_samples else None,
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.csv"
        write_trace_csv(trace, path)
        back = read_trace_csv(path)
    assert np.array_equal(back.arrival_s, trace.arrival_s)  # bit-exact floats
    assert np.array_equal(back.batch_size, trace.batch_size)
    if with_samples:
        assert back.sample_id is not None and trace.sample_id is not None
        assert np.array_equal(back.sample_id, trace.sample_id)
    else:
        assert back.sample_id is None


def test_csv_header_order_defaults_and_extras(tmp_path: Path) -> None:
    path = write_text(tmp_path, "\ufeffnote, arrival_s ,other\nx,0.5,1\n\ny,1.25,2\n")
    trace = read_trace_csv(path)
    assert trace.arrival_s.tolist() == [0.5, 1.25]
    assert trace.batch_size.tolist() == [1, 1]  # default batch size
    assert trace.sample_id is None
    path = write_text(tmp_path, 'sample_id,batch_size,arrival_s\n3,4,"0.0"\n1,2,2.0\n', "b.csv")
    trace = read_trace_csv(str(path))
    assert trace.batch_size.tolist() == [4, 2]
    assert trace.sample_id is not None and trace.sample_id.tolist() == [3, 1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("arrival_s,batch_size\n", "no data rows"),
        ("time,batch_size\n0,1\n", "no 'arrival_s' column"),
        ("arrival_s,arrival_s\n0,1\n", "appears twice"),
        (
            "arrival_s,batch_size\n0,1\n0.5,1\nabc,1\n",
            r"row 3: arrival_s is 'abc', expected a number",
        ),
        (
            "arrival_s,batch_size\n0,1\n\n0.5,2.5\n",
            r"row 2: batch_size is '2\.5', expected an integer",
        ),
        ("arrival_s,batch_size\n0,1\n0.5,\n", r"row 2: batch_size is '', expected an integer"),
        ("arrival_s,batch_size\n0,1\n0.5\n", "row 2 has 1 field"),
        ("arrival_s,batch_size\n0,1\n1_0,1\n", "row 2: arrival_s is '1_0'"),
        ("arrival_s,batch_size\n0,1\n3.5,1\n3.2,1\n", r"arrival_s decreases at row 3: 3\.2 < 3\.5"),
        ("arrival_s,batch_size\n0,1\n1,0\n", "batch_size must be >= 1, got 0 at row 2"),
        ("arrival_s\n0\nnan\n", "arrival_s is not finite at row 2"),
        ("arrival_s,sample_id\n0,-1\n", "sample_id must be >= 0, got -1 at row 1"),
        # Past int64: the columns' type (the fast path's), not an OverflowError.
        (
            "arrival_s,batch_size\n0,1\n1,100000000000000000000\n",
            r"row 2: batch_size is '100000000000000000000', expected an integer of at most 9223",
        ),
        (
            "arrival_s,sample_id\n0,-100000000000000000000\n",
            r"row 1: sample_id is '-100000000000000000000', expected an integer of at least -9223",
        ),
        (
            "arrival_s,batch_size,sample_id\n0,1,9223372036854775808\n",
            r"row 1: sample_id is '9223372036854775808', expected an integer of at most",
        ),
    ],
)
def test_read_rejects_bad_files_naming_the_row(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message) as caught:
        read_trace_csv(write_text(tmp_path, text))
    assert "\n" not in str(caught.value)


def test_read_rejects_binary_and_leaves_missing_files_to_the_caller(tmp_path: Path) -> None:
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"arrival_s\n\xff\xfe\x00\n")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace_csv(binary)
    with pytest.raises(FileNotFoundError):
        read_trace_csv(tmp_path / "missing.csv")


# --- statistics ------------------------------------------------------------------------------


def test_stats_by_hand() -> None:
    # gaps 1, 1, 4: mean 2, population variance 2, CV^2 = 2 / 4
    stats = trace_stats(Trace(np.array([0.0, 1.0, 2.0, 6.0]), np.array([1, 2, 3, 10])))
    assert stats.count == 4 and stats.duration_s == 6.0
    assert stats.rate_qps == pytest.approx(0.5)
    assert stats.cv2 == pytest.approx(0.5)
    assert stats.mean_batch_size == 4.0 and stats.max_batch_size == 10


def test_stats_of_degenerate_traces_are_finite() -> None:
    empty = trace_stats(Trace(np.array([]), np.array([], dtype=np.int64)))
    assert (empty.count, empty.rate_qps, empty.cv2, empty.max_batch_size) == (0, 0.0, 0.0, 0)
    tied = trace_stats(Trace(np.full(5, 3.0), np.ones(5, dtype=np.int64)))
    assert (tied.duration_s, tied.rate_qps, tied.cv2) == (0.0, 0.0, 0.0)


# --- rate profiles ---------------------------------------------------------------------------


def test_profile_rate_and_integral_by_hand() -> None:
    ramp = step_profile(150.0, 250.0, at_s=100.0, over_s=50.0)
    assert ramp.rate_at(50.0) == 150.0 and ramp.rate_at(125.0) == 200.0
    assert ramp.rate_at(1e6) == 250.0  # constant after the last knot
    t = np.array([0.0, 100.0, 125.0, 150.0, 200.0])
    # 150 * 100; + 25 * (150 + 200) / 2; + 50 * 200; + 50 * 250
    assert ramp.cumulative(t).tolist() == [0.0, 15000.0, 19375.0, 25000.0, 37500.0]


def test_step_is_right_continuous_and_zero_stretches_are_jumped() -> None:
    step = step_profile(0.0, 10.0, at_s=100.0)
    assert step.rate_at(np.array([99.9, 100.0, 100.1])).tolist() == [0.0, 10.0, 10.0]
    assert step.cumulative(100.0) == 0.0 and step.cumulative(101.0) == 10.0
    # Lambda^{-1}: the first expected arrival comes right after the rate turns on.
    assert step.inverse_cumulative(np.array([0.0, 5.0, 10.0])).tolist() == [100.0, 100.5, 101.0]
    off = step_profile(10.0, 0.0, at_s=5.0)
    assert off.inverse_cumulative(np.array([60.0]))[0] == math.inf  # never reached


profiles = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=50.0),
        st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=20.0)),
    ),
    min_size=1,
    max_size=6,
).map(
    lambda knots: RateProfile(
        np.concatenate(([0.0], np.cumsum([gap for gap, _ in knots[1:]]))),
        np.array([rate for _, rate in knots]),
    )
)


@settings(max_examples=80, deadline=None)
@given(profiles, st.floats(min_value=0.0, max_value=300.0))
def test_cumulative_is_the_integral_of_the_rate(profile: RateProfile, t_s: float) -> None:
    grid = np.unique(
        np.concatenate((np.linspace(0.0, t_s, 2001), profile.times_s[profile.times_s < t_s]))
    )
    rates = profile.rate_at(grid)
    # trapezoid on a grid that contains every knot is exact up to jumps on the grid
    jumps = np.abs(np.diff(profile.rates_qps)).sum() * (t_s / 2000 + 1e-12)
    expected = float(np.trapezoid(rates, grid))
    assert profile.cumulative(t_s) == pytest.approx(expected, rel=1e-9, abs=1e-6 + jumps)


@settings(max_examples=80, deadline=None)
@given(profiles, st.lists(st.floats(min_value=0.0, max_value=2000.0), min_size=1, max_size=20))
def test_inverse_cumulative_inverts_where_the_rate_is_positive(
    profile: RateProfile, expected: list[float]
) -> None:
    y = np.sort(np.array(expected))
    t = profile.inverse_cumulative(y)
    assert np.all(t[1:] >= t[:-1])
    finite = np.isfinite(t)
    assert np.allclose(profile.cumulative(t[finite]), y[finite], rtol=1e-9, atol=1e-7)
    total_rate_after = profile.rates_qps[-1]
    assert finite.all() or total_rate_after == 0.0


def test_profile_validation() -> None:
    with pytest.raises(WorkloadError, match="starts at time 0"):
        RateProfile(np.array([1.0]), np.array([1.0]))
    with pytest.raises(WorkloadError, match="decreases at knot 3"):
        RateProfile(np.array([0.0, 5.0, 4.0]), np.array([1.0, 1.0, 1.0]))
    with pytest.raises(WorkloadError, match=r"rate must be >= 0, got -1\.0 at knot 1"):
        RateProfile(np.array([0.0, 5.0]), np.array([1.0, -1.0]))
    with pytest.raises(WorkloadError, match="2 times but 1 rates"):
        RateProfile(np.array([0.0, 5.0]), np.array([1.0]))
    with pytest.raises(WorkloadError, match="finite"):
        RateProfile(np.array([0.0]), np.array([math.inf]))


def test_spikes_multiply_the_rate_with_sharp_edges() -> None:
    base = step_profile(10.0, 20.0, at_s=0.0, over_s=100.0)  # 10 -> 20 over 100 s
    spiked = with_spikes(base, [(20.0, 10.0, 3.0), (25.0, 10.0, 2.0), (60.0, 5.0, 0.0)])
    t = np.array([19.999, 20.0, 24.0, 25.0, 29.0, 30.0, 34.9, 35.0, 60.0, 64.9, 65.0, 200.0])
    expected = base.rate_at(t) * np.array([1, 3, 3, 6, 6, 2, 2, 1, 0, 0, 1, 1])
    assert np.allclose(spiked.rate_at(t), expected)

    def integral(start_s: float, end_s: float) -> float:
        return float(base.cumulative(end_s) - base.cumulative(start_s))

    # factor 3 on [20, 25), 6 on [25, 30), 2 on [30, 35), 0 on [60, 65)
    extra = 2 * integral(20, 25) + 5 * integral(25, 30) + integral(30, 35) - integral(60, 65)
    assert spiked.cumulative(300.0) == pytest.approx(base.cumulative(300.0) + extra)
    assert with_spikes(base, []) is base


@pytest.mark.parametrize(
    ("spike", "message"),
    [
        ((1.0, 2.0, -1.0), "spike 1 factor must be >= 0"),
        ((1.0, 0.0, 2.0), "spike 1 length_s must be > 0"),
        ((-1.0, 2.0, 2.0), "spike 1 start_s must be >= 0"),
        ((1.0, 2.0), "spike 1 must be"),
        ((1.0, math.nan, 2.0), "must be finite"),
    ],
)
def test_spike_validation(spike: tuple[float, ...], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        with_spikes(constant_profile(1.0), [spike])


def test_diurnal_profile_follows_the_sinusoid() -> None:
    day = diurnal_profile(100.0, 86400.0, amplitude=0.5)
    t = np.linspace(0.0, 86400.0, 1001)
    exact = 100.0 * (1.0 - 0.5 * np.cos(2.0 * np.pi * t / 86400.0))
    assert (
        np.max(np.abs(day.rate_at(t) - exact)) < 100.0 * 0.5 * (1 - math.cos(math.pi / 96)) + 1e-9
    )
    assert day.cumulative(86400.0) == pytest.approx(100.0 * 86400.0, rel=1e-3)
    flat = diurnal_profile(5.0, 10.0, amplitude=0.0)
    assert np.all(flat.rates_qps == 5.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mean_rate_qps": 0.0}, "mean_rate_qps must be > 0"),
        ({"duration_s": -1.0}, "duration_s must be > 0"),
        ({"amplitude": 1.5}, r"amplitude must be in \[0, 1\]"),
        ({"period_s": math.inf}, "period_s must be finite"),
        ({"spikes": [(0.0, 1.0, -2.0)]}, "factor must be >= 0"),
        # 96 knots a period: 9.6 billion of them (71 GiB) for this one, before.
        ({"period_s": 1e-6}, r"is 1e\+08 periods; at most 10,416"),
    ],
)
def test_diurnal_validation(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"mean_rate_qps": 1.0, "duration_s": 100.0} | kwargs
    with pytest.raises(WorkloadError, match=message):
        diurnal_profile(**arguments)  # type: ignore[arg-type]


# --- generators ------------------------------------------------------------------------------


def test_poisson_rate_and_cv2() -> None:
    rate_qps, duration_s = 200.0, 500.0
    arrivals = poisson_arrivals(rate_qps, duration_s, np.random.default_rng(1))
    assert arrivals.dtype == np.float64 and np.all(np.diff(arrivals) >= 0.0)
    assert arrivals[0] >= 0.0 and arrivals[-1] < duration_s
    assert within_poisson(arrivals.size, rate_qps * duration_s)
    stats = trace_stats(Trace(arrivals, np.ones(arrivals.size, dtype=np.int64)))
    assert abs(stats.cv2 - 1.0) < 4.0 * cv2_estimate_sd(1.0, arrivals.size - 1)


@pytest.mark.parametrize("cv2", [0.1, 4.0])
def test_gamma_rate_and_cv2(cv2: float) -> None:
    rate_qps, duration_s = 100.0, 1000.0
    arrivals = gamma_arrivals(rate_qps, cv2, duration_s, np.random.default_rng(2))
    assert within_poisson(arrivals.size, rate_qps * duration_s, cv2=cv2)
    stats = trace_stats(Trace(arrivals, np.ones(arrivals.size, dtype=np.int64)))
    tolerance = 4.0 * cv2_estimate_sd(1.0 / cv2, arrivals.size - 1)
    assert tolerance < 0.05 * cv2  # "within a few percent" at this sample size
    assert abs(stats.cv2 - cv2) < tolerance


def test_a_cv2_past_the_largest_is_refused() -> None:
    """Gamma gaps of shape 1e-7 are mostly 0: a CV^2 of 1e7 wrote 387,997 queries at time 0
    for 10 q/s over 20 s."""
    with pytest.raises(WorkloadError, match="cv2 must be <= 100"):
        gamma_arrivals(10.0, 1e7, 20.0, np.random.default_rng(0))
    assert gamma_arrivals(10.0, 100.0, 20.0, np.random.default_rng(0)).size < 1000


def test_ramp_counts_follow_the_integral() -> None:
    profile = step_profile(150.0, 250.0, at_s=100.0, over_s=50.0)
    arrivals = renewal_arrivals(profile, 300.0, 1.0, np.random.default_rng(3))
    edges = np.array([0.0, 100.0, 125.0, 150.0, 300.0])
    counts = np.histogram(arrivals, bins=edges)[0]
    expected = np.diff(profile.cumulative(edges))  # 15000, 4375, 5625, 37500
    for count, mean in zip(counts, expected, strict=True):
        assert within_poisson(int(count), float(mean))


def test_zero_rate_stretches_and_outages_have_no_arrivals() -> None:
    rng = np.random.default_rng(4)
    late = renewal_arrivals(step_profile(0.0, 50.0, at_s=100.0), 200.0, 1.0, rng)
    assert late.size > 0 and late.min() >= 100.0
    assert within_poisson(late.size, 5000.0)
    spiked = with_spikes(constant_profile(50.0), [(50.0, 20.0, 0.0), (100.0, 20.0, 4.0)])
    arrivals = renewal_arrivals(spiked, 200.0, 2.0, rng)
    assert not np.any((arrivals >= 50.0) & (arrivals < 70.0))
    burst = int(np.sum((arrivals >= 100.0) & (arrivals < 120.0)))
    assert within_poisson(burst, 4000.0, cv2=2.0)
    assert renewal_arrivals(step_profile(0.0, 5.0, at_s=10.0), 10.0, 1.0, rng).size == 0


def test_diurnal_arrivals_follow_the_day() -> None:
    period_s = 4000.0
    profile = diurnal_profile(20.0, period_s, period_s=period_s, amplitude=0.8)
    arrivals = renewal_arrivals(profile, period_s, 1.0, np.random.default_rng(5))
    edges = np.linspace(0.0, period_s, 5)
    counts = np.histogram(arrivals, bins=edges)[0]
    for count, mean in zip(counts, np.diff(profile.cumulative(edges)), strict=True):
        assert within_poisson(int(count), float(mean))
    assert counts[1] > 2 * counts[0]  # the afternoon is busier than the night


def test_generators_are_reproducible_from_the_seed() -> None:
    first = gamma_arrivals(50.0, 3.0, 100.0, np.random.default_rng(7))
    second = gamma_arrivals(50.0, 3.0, 100.0, np.random.default_rng(7))
    assert np.array_equal(first, second)
    assert not np.array_equal(first, gamma_arrivals(50.0, 3.0, 100.0, np.random.default_rng(8)))


def test_short_traces_still_draw_enough_gaps() -> None:
    # Expected 0.5 arrivals: the top-up loop and the empty result both happen across seeds.
    sizes = [poisson_arrivals(0.5, 1.0, np.random.default_rng(seed)).size for seed in range(200)]
    assert 0 in sizes and max(sizes) >= 2
    assert abs(np.mean(sizes) - 0.5) < 4.0 * math.sqrt(0.5 / 200)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda rng: poisson_arrivals(0.0, 10.0, rng), "rate_qps must be > 0"),
        (lambda rng: poisson_arrivals(-3.0, 10.0, rng), "rate_qps must be > 0"),
        (lambda rng: poisson_arrivals(math.nan, 10.0, rng), "rate_qps must be finite"),
        (lambda rng: poisson_arrivals(1.0, 0.0, rng), "duration_s must be > 0"),
        (lambda rng: poisson_arrivals(1.0, math.inf, rng), "duration_s must be finite"),
        (lambda rng: gamma_arrivals(1.0, 0.0, 10.0, rng), "cv2 must be > 0"),
        (lambda rng: gamma_arrivals(1.0, -1.0, 10.0, rng), "cv2 must be > 0"),
        (lambda rng: step_profile(0.0, 0.0, 1.0), "mean rate > 0"),
        (lambda rng: step_profile(-1.0, 5.0, 1.0), "rate_from_qps must be >= 0"),
        (lambda rng: step_profile(1.0, 5.0, -1.0), "at_s must be >= 0"),
        (lambda rng: step_profile(1.0, 5.0, 1.0, -2.0), "over_s must be >= 0"),
        (lambda rng: poisson_arrivals(1e9, 1e9, rng), "more than"),
    ],
)
def test_generator_validation(call: object, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        call(np.random.default_rng(0))  # type: ignore[operator]


def test_a_rate_near_the_largest_float_is_refused_without_a_warning() -> None:
    """The expected count overflows to inf: one WorkloadError, no numpy RuntimeWarning before
    it (the CLI printed one above its one-line error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(WorkloadError, match="about inf arrivals"):
            renewal_arrivals(constant_profile(1e308), 10.0, 1.0, np.random.default_rng(0))


def test_a_trace_file_appears_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written under a temporary name and renamed once whole: a write cut short (here, the
    rename fails) leaves no trace under the name, and no temporary file either."""
    from estimator import traces

    trace = Trace(np.arange(5, dtype=np.float64), np.ones(5, dtype=np.int64))
    target = tmp_path / "t.csv"
    traces.write_trace_csv(trace, target)
    assert traces.read_trace_csv(target).arrival_s.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    target.unlink()

    def cut(self: Path, _target: Path) -> Path:
        raise OSError("interrupted")

    monkeypatch.setattr(traces.Path, "replace", cut)
    with pytest.raises(OSError, match="interrupted"):
        traces.write_trace_csv(trace, target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("arrival_s,batch_size\n0,10\n1,10,3\n2,10\n", "row 2 has 3 field(s), the header has 2"
         " (line 3)"),
        # A blank line is no row (its line is counted), CRLF line ends as LF.
        ("arrival_s,batch_size\r\n0,10\r\n\r\n1,10,3\r\n", "row 2 has 3 field(s), the header"
         " has 2 (line 4)"),
        # With quotes in the file the rows are read one by one: a quoted separator is no field.
        ('arrival_s,batch_size,note\n0,10,"a,b"\n1,10,x,y\n', "row 2 has 4 field(s), the header"
         " has 3 (line 3)"),
        # An empty last field is a field; the last row needs no line end.
        ("arrival_s,batch_size\n0,10\n1,10,\n", "row 2 has 3 field(s), the header has 2"
         " (line 3)"),
        ("arrival_s,batch_size\n0,10\n\n\n1,10,3", "row 2 has 3 field(s), the header has 2"
         " (line 5)"),
    ],
)  # fmt: skip
def test_a_row_wider_than_the_header_is_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=re.escape(message)):
        read_trace_csv(write_text(tmp_path, text))


def test_quoted_separators_blank_lines_and_crlf_are_not_extra_fields(tmp_path: Path) -> None:
    text = '\ufeffarrival_s,batch_size,note\r\n0,10,"a,b,c"\r\n  \r\n\r\n1,2,x\r\n2,3,'
    trace = read_trace_csv(write_text(tmp_path, text))
    assert trace.arrival_s.tolist() == [0.0, 1.0, 2.0] and trace.batch_size.tolist() == [10, 2, 3]


def test_a_valid_unquoted_file_is_not_read_again_row_by_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The width check is on the file's bytes at once (a trace may have millions of rows): blank
    lines (even of separators, before the header), CRLF, a byte-order mark, an ignored column and
    trailing blank lines leave the row-by-row reader unused."""
    from estimator import traces

    def unused(*args: object) -> None:
        raise AssertionError("read row by row")

    monkeypatch.setattr(traces, "_read_rows_slowly", unused)
    text = "\ufeff,,,\r\narrival_s,batch_size,note\r\n0,1,x\r\n\r\n1,2,\r\n\r\n\r\n"
    trace = read_trace_csv(write_text(tmp_path, text))
    assert trace.arrival_s.tolist() == [0.0, 1.0] and trace.batch_size.tolist() == [1, 2]


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5])
def test_the_width_check_reads_across_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    """A run of separators, a quote or the header's end split between two reads is still seen."""
    from estimator import traces

    monkeypatch.setattr(traces, "_WIDTH_CHECK_CHUNK_BYTES", chunk_bytes)
    good = "arrival_s,batch_size,x\n0,10,a\n1,10,b\n"
    assert read_trace_csv(write_text(tmp_path, good)).batch_size.tolist() == [10, 10]
    wide = write_text(tmp_path, good + "2,10,c,d\n", "wide.csv")
    with pytest.raises(TraceError, match=re.escape("row 3 has 4 field(s), the header has 3")):
        read_trace_csv(wide)
    quoted = write_text(tmp_path, good + '2,10,"c,d"\n', "quoted.csv")
    assert read_trace_csv(quoted).arrival_s.tolist() == [0.0, 1.0, 2.0]


def test_a_trace_from_a_pipe_is_read_whole() -> None:
    """A pipe (``--trace <(cat t.csv)``, ``/dev/stdin``) gives its bytes once: the file is read
    once, whichever readers then parse it (here the row-by-row one too, for the quoted field)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b'arrival_s,batch_size,note\n0,2,"a,b"\n1.5,3,c\n')
        os.close(write_end)
        trace = read_trace_csv(f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
    assert trace.arrival_s.tolist() == [0.0, 1.5] and trace.batch_size.tolist() == [2, 3]
