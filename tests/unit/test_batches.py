"""Batch-size distributions: the spec grammar, the samplers, and the exact Kairos mix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from estimator.batches import (
    MAX_BATCH_SIZE,
    FixedBatch,
    GaussianBatch,
    KairosMix,
    LogNormalBatch,
    kairos_batch_pmf,
    parse_batch_distribution,
)
from estimator.errors import WorkloadError

N_SAMPLES = 200_000


def binomial_tolerance(p: float | np.ndarray, n: int, sigmas: float = 4.5) -> np.ndarray:
    """How far an observed frequency may stray from p in n draws."""
    return sigmas * np.sqrt(np.asarray(p) * (1.0 - np.asarray(p)) / n) + 1e-12


# --- the spec grammar ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("fixed:8", FixedBatch(8)),
        (" Kairos ", KairosMix()),
        ("lognormal:mu=5.1,sigma=0.2", LogNormalBatch(5.1, 0.2)),
        ("lognormal: sigma=0.2 , mu=5.1, step=10", LogNormalBatch(5.1, 0.2, step=10)),
        ("gaussian:mean=300,sd=100", GaussianBatch(300.0, 100.0)),
        (
            "gaussian:mean=300,sd=100,low=10,high=1000,step=10",
            GaussianBatch(300.0, 100.0, low=10, high=1000, step=10),
        ),
    ],
)
def test_parse_and_round_trip(spec: str, expected: object) -> None:
    parsed = parse_batch_distribution(spec)
    assert parsed == expected
    assert parse_batch_distribution(parsed.spec) == parsed
    assert parse_batch_distribution(parsed.spec).spec == parsed.spec


def test_canonical_specs() -> None:
    assert parse_batch_distribution("kairos").spec == "kairos"
    assert parse_batch_distribution("fixed:4").spec == "fixed:4"
    assert (
        parse_batch_distribution("gaussian:sd=100.0,mean=300.5,high=900").spec
        == "gaussian:mean=300.5,sd=100,high=900"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown batch-size spec ''"),
        ("poisson:3", "unknown batch-size spec 'poisson:3': expected 'fixed:N'"),
        ("fixed", "N must be an integer"),
        ("fixed:0", "N must be >= 1, got 0"),
        ("fixed:2.5", "N must be an integer, got '2.5'"),
        ("kairos:mu=1", "kairos takes no parameters"),
        ("lognormal:mu=5.1", "missing sigma"),
        ("lognormal:mu=5.1,sigma=0", "sigma must be > 0"),
        ("lognormal:mu=x,sigma=0.2", "mu must be a number, got 'x'"),
        ("lognormal:mu=nan,sigma=0.2", "mu must be finite"),
        ("lognormal:mu=5.1,sigma=0.2,shape=3", "unknown key 'shape'"),
        ("lognormal:mu=5.1,mu=5.2,sigma=0.2", "'mu' is given twice"),
        ("lognormal:mu=5.1,sigma", "'sigma' is not key=value"),
        ("gaussian:mean=300,sd=-1", "sd must be > 0"),
        ("gaussian:mean=300,sd=100,step=0", "step must be >= 1"),
        ("gaussian:mean=300,sd=100,low=0", "low must be >= 1"),
        ("gaussian:mean=300,sd=100,low=50,high=10", "high 10 is below low 50"),
        ("gaussian:mean=300,sd=100,step=2.5", "step must be an integer"),
        # Past the largest batch size (past int64 too): refused, not an OverflowError.
        ("fixed:99999999999999999999", "N must be at most 1,000,000"),
        ("fixed:1000001", "N must be at most 1,000,000"),
        ("gaussian:mean=300,sd=100,high=99999999999999999999", "high must be at most 1,000,000"),
        ("gaussian:mean=300,sd=100,low=2000000", "low must be at most 1,000,000"),
        ("lognormal:mu=5,sigma=1,step=2000000", "step must be at most 1,000,000"),
    ],
)
def test_bad_specs_name_the_spec(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message) as caught:
        parse_batch_distribution(spec)
    assert "\n" not in str(caught.value)


# --- samplers --------------------------------------------------------------------------------


def test_fixed_and_sample_sizes() -> None:
    rng = np.random.default_rng(0)
    drawn = FixedBatch(7).sample(5, rng)
    assert drawn.dtype == np.int64 and drawn.tolist() == [7] * 5
    assert KairosMix().sample(0, rng).size == 0
    with pytest.raises(WorkloadError, match="integer >= 0"):
        KairosMix().sample(-1, rng)
    with pytest.raises(WorkloadError, match="integer >= 1"):
        FixedBatch(0)
    assert FixedBatch(MAX_BATCH_SIZE).sample(1, rng).tolist() == [MAX_BATCH_SIZE]
    with pytest.raises(WorkloadError, match="at most 1,000,000"):
        FixedBatch(10**20)


@pytest.mark.parametrize(
    "spec",
    ["lognormal:mu=100,sigma=5", "gaussian:mean=1e300,sd=1", "gaussian:mean=1e308,sd=1e308"],
)
def test_draws_past_the_largest_batch_size_are_an_error_not_garbage(spec: str) -> None:
    # These once came out as 2**62 (4611686018427387904) each.
    with pytest.raises(WorkloadError, match="past the largest batch size 1,000,000") as caught:
        parse_batch_distribution(spec).sample(10, np.random.default_rng(0))
    assert "\n" not in str(caught.value) and "high=" in str(caught.value)
    assert len(str(caught.value)) < 200  # 1e300 as 1e+300, not its 301 digits


def test_a_high_clips_huge_draws_to_it() -> None:
    rng = np.random.default_rng(0)
    for spec in ("gaussian:mean=1e300,sd=1,high=100", "lognormal:mu=1000,sigma=5,high=50"):
        drawn = parse_batch_distribution(spec).sample(10, rng)
        assert drawn.dtype == np.int64 and drawn.max() <= 100 and drawn.min() >= 1


def test_lognormal_matches_its_cdf() -> None:
    # Rounding up to an integer keeps P(B <= c) = P(X <= c) for every integer c.
    mu, sigma = 5.1, 0.2
    drawn = parse_batch_distribution(f"lognormal:mu={mu},sigma={sigma}").sample(
        N_SAMPLES, np.random.default_rng(1)
    )
    assert drawn.dtype == np.int64 and drawn.min() >= 1
    for c in (120, 150, 164, 200, 250):
        p = stats.norm.cdf((math.log(c) - mu) / sigma)
        assert abs(np.mean(drawn <= c) - p) < binomial_tolerance(p, N_SAMPLES)


def test_gaussian_rounds_up_then_clips() -> None:
    dist = parse_batch_distribution("gaussian:mean=300,sd=100,high=450,step=25")
    drawn = dist.sample(N_SAMPLES, np.random.default_rng(2))
    assert np.all(drawn % 25 == 0) and drawn.min() >= 25 and drawn.max() <= 450
    for c in (100, 300, 425):
        p = stats.norm.cdf((c - 300.0) / 100.0)
        assert abs(np.mean(drawn <= c) - p) < binomial_tolerance(p, N_SAMPLES)
    # everything above 425 is rounded to 450 or clipped there
    assert abs(np.mean(drawn == 450) - stats.norm.sf(1.25)) < binomial_tolerance(0.1, N_SAMPLES)
    # far-negative draws land on low (default: step)
    wide = GaussianBatch(0.0, 50.0, step=10).sample(10_000, np.random.default_rng(3))
    assert wide.min() == 10 and np.mean(wide == 10) > 0.5


# --- the Kairos mix --------------------------------------------------------------------------


def test_kairos_pmf_is_the_documented_mix() -> None:
    sizes, p = kairos_batch_pmf()
    assert sizes.tolist() == list(range(10, 1001, 10))
    assert np.all(p > 0.0) and p.sum() == pytest.approx(1.0, abs=1e-12)
    mean = float(np.sum(sizes * p))
    assert mean == pytest.approx(244.0, abs=1.0)  # KAIROS_MATH.md: mean about 244
    median = int(sizes[np.searchsorted(np.cumsum(p), 0.5)])
    assert median == 180  # KAIROS_MATH.md: median 180
    # Spot checks by hand: 1000 only from 991..999 of the large branch (5/99 of queries).
    assert p[-1] == pytest.approx(5 / 99 * 9 / 400)
    # 10 only from 1..10 of the small branch.
    assert p[0] == pytest.approx(8 / 99 * 10 / 99)
    # 600: the medium branch's 591..599 plus the large branch's 600.
    assert p[59] == pytest.approx(22 / 99 * 9 / 400 + 5 / 99 * 1 / 400)
    # The log-normal branch puts P(160 < X <= 170) on 170.
    in_bin = stats.lognorm.cdf(170, 0.2, scale=math.exp(5.1)) - stats.lognorm.cdf(
        160, 0.2, scale=math.exp(5.1)
    )
    assert p[16] == pytest.approx(64 / 99 * in_bin)


def test_kairos_sampler_matches_the_pmf() -> None:
    sizes, p = kairos_batch_pmf()
    drawn = KairosMix().sample(N_SAMPLES, np.random.default_rng(4))
    assert drawn.dtype == np.int64
    assert np.all(drawn % 10 == 0) and drawn.min() >= 10 and drawn.max() <= 1000
    observed = np.bincount(drawn // 10 - 1, minlength=sizes.size)
    assert observed.size == sizes.size
    frequencies = observed / N_SAMPLES
    assert np.all(np.abs(frequencies - p) < binomial_tolerance(p, N_SAMPLES))
    chi2, p_value = stats.chisquare(observed, p * N_SAMPLES)
    assert p_value > 1e-4, chi2
    sd = math.sqrt(float(np.sum(p * sizes**2) - np.sum(p * sizes) ** 2))
    assert abs(drawn.mean() - np.sum(p * sizes)) < 4.0 * sd / math.sqrt(N_SAMPLES)


def test_kairos_sampler_is_reproducible() -> None:
    first = KairosMix().sample(1000, np.random.default_rng(5))
    assert np.array_equal(first, KairosMix().sample(1000, np.random.default_rng(5)))
