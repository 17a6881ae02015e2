"""Batch-size distributions: how many items each query of a workload carries.

This module owns the batch-size specs a user writes on the command line or in a workload file
(``fixed:N``, ``kairos``, ``lognormal:...``, ``gaussian:...``), the samplers they parse into, and
the exact probability mass function of the Kairos production mix, which the Kairos bounds need as
p(b) (KAIROS_MATH.md, "The evaluation workload"). Randomness comes only through the
``numpy.random.Generator`` passed to ``sample``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from estimator.errors import WorkloadError

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]

# The Kairos production mix (KAIROS_MATH.md, after the DeepRecSys trace as Kairos replays it):
# a branch draw r uniform in 1..99 picks one of four components; every size is rounded up to a
# multiple of 10.
KAIROS_BRANCH_HIGH = 99
KAIROS_SMALL = (1, 99, 8)  # r <= 8: uniform 1..99
KAIROS_MEDIUM = (200, 599, 30)  # 8 < r <= 30: uniform 200..599
KAIROS_LARGE = (600, 999, 35)  # 30 < r <= 35: uniform 600..999
KAIROS_LOGNORMAL_MU = 5.1  # otherwise: log-normal(mu, sigma) ...
KAIROS_LOGNORMAL_SIGMA = 0.2
KAIROS_LOGNORMAL_KEEP = (100.0, 200.0)  # ... kept when inside [100, 200] ...
KAIROS_FALLBACK = (190, 199)  # ... else replaced by uniform 190..199
KAIROS_STEP = 10

# The largest batch size a spec may give or a draw may reach. Far past any measured profile (the
# Kairos data end at 1,000; a worker takes at most 4,096 rows at once), and small enough that a
# generated trace's batch sizes (MAX_GENERATED_ARRIVALS of them) sum exactly in int64 and float64.
MAX_BATCH_SIZE = 1_000_000


class BatchDistribution(Protocol):
    """A sampler of batch sizes; ``spec`` parses back (``parse_batch_distribution``) to it."""

    @property
    def spec(self) -> str: ...

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        """``n`` batch sizes, int64, each >= 1."""
        ...


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise WorkloadError(f"the number of batch sizes to draw must be an integer >= 0, got {n!r}")
    return int(n)


def _round_up(values: NDArray[np.float64] | IntArray, step: int) -> IntArray:
    """Round up to a multiple of ``step`` (integers exactly; floats by ceil)."""
    if values.dtype.kind in "iu":
        return -(-values.astype(np.int64) // step) * step
    return (np.ceil(values / step) * step).astype(np.int64)


def _format_number(value: float) -> str:
    # Whole numbers as integers, but not 1e300 as its 301 digits.
    whole = float(value).is_integer() and abs(value) < 1e15
    return str(int(value)) if whole else repr(float(value))


@dataclass(frozen=True, slots=True)
class FixedBatch:
    """Every query has the same batch size (``fixed:N``)."""

    size: int

    def __post_init__(self) -> None:
        size = self.size
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise WorkloadError(f"a fixed batch size must be an integer >= 1, got {size!r}")
        if size > MAX_BATCH_SIZE:
            raise WorkloadError(
                f"a fixed batch size must be at most {MAX_BATCH_SIZE:,} (the largest batch size),"
                f" got {size}"
            )
        object.__setattr__(self, "size", int(size))

    @property
    def spec(self) -> str:
        return f"fixed:{self.size}"

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        return np.full(_check_n(n), self.size, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class KairosMix:
    """The Kairos evaluation mix (``kairos``): mean about 244, median 180 (KAIROS_MATH.md).

    Draw r uniform in 1..99; r <= 8: uniform 1..99; 8 < r <= 30: uniform 200..599;
    30 < r <= 35: uniform 600..999; otherwise log-normal(mu 5.1, sigma 0.2), replaced by uniform
    190..199 when outside [100, 200]; round up to a multiple of 10. Uniform draws are of integers.
    """

    @property
    def spec(self) -> str:
        return "kairos"

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        n = _check_n(n)
        r = rng.integers(1, KAIROS_BRANCH_HIGH + 1, size=n)
        sizes = np.empty(n, dtype=np.float64)
        lower = 0
        for low, high, upper in (KAIROS_SMALL, KAIROS_MEDIUM, KAIROS_LARGE):
            chosen = (r > lower) & (r <= upper)
            sizes[chosen] = rng.integers(low, high + 1, size=int(chosen.sum()))
            lower = upper
        chosen = r > lower
        drawn = rng.lognormal(KAIROS_LOGNORMAL_MU, KAIROS_LOGNORMAL_SIGMA, size=int(chosen.sum()))
        outside = (drawn < KAIROS_LOGNORMAL_KEEP[0]) | (drawn > KAIROS_LOGNORMAL_KEEP[1])
        low, high = KAIROS_FALLBACK
        drawn[outside] = rng.integers(low, high + 1, size=int(outside.sum()))
        sizes[chosen] = drawn
        return _round_up(sizes, KAIROS_STEP)


def kairos_batch_pmf() -> tuple[IntArray, FloatArray]:
    """The exact probability mass function of the Kairos mix: (batch sizes, probabilities).

    Sizes are 10, 20, ..., 1000 (every one has positive mass). The uniform components are counted
    exactly; the log-normal component puts P(10(k-1) < X <= 10k) on 10k for k = 11..20, with
    P(X <= x) = Phi((ln x - mu) / sigma), and its mass outside [100, 200] on the rounded uniform
    190..199 fallback (1/10 on 190, 9/10 on 200).

    >>> sizes, p = kairos_batch_pmf()
    >>> int(sizes[0]), int(sizes[-1]), round(float(p.sum()), 12)
    (10, 1000, 1.0)
    """
    step = KAIROS_STEP
    sizes = np.arange(step, KAIROS_LARGE[1] + step, step, dtype=np.int64)
    p = np.zeros(sizes.size)

    def add_uniform(low: int, high: int, weight: float) -> None:
        values = np.arange(low, high + 1, dtype=np.int64)
        rounded = _round_up(values, step)
        np.add.at(p, rounded // step - 1, weight / values.size)

    lower = 0
    for low, high, upper in (KAIROS_SMALL, KAIROS_MEDIUM, KAIROS_LARGE):
        add_uniform(low, high, (upper - lower) / KAIROS_BRANCH_HIGH)
        lower = upper
    weight = (KAIROS_BRANCH_HIGH - lower) / KAIROS_BRANCH_HIGH

    def cdf(x: float) -> float:
        z = (math.log(x) - KAIROS_LOGNORMAL_MU) / KAIROS_LOGNORMAL_SIGMA
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    keep_low, keep_high = KAIROS_LOGNORMAL_KEEP
    for edge in range(int(keep_low), int(keep_high), step):
        p[(edge + step) // step - 1] += weight * (cdf(edge + step) - cdf(edge))
    outside = 1.0 - (cdf(keep_high) - cdf(keep_low))
    add_uniform(*KAIROS_FALLBACK, weight * outside)
    return sizes, p


@dataclass(frozen=True, slots=True)
class LogNormalBatch:
    """Log-normal batch sizes (``lognormal:mu=5.1,sigma=0.2[,low=..,high=..,step=..]``): a draw
    exp(N(mu, sigma^2)) rounded up to a multiple of ``step``, then clipped to [low, high]."""

    mu: float
    sigma: float
    low: int | None = None
    high: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        _check_shape_params(self.spec, self.sigma, "sigma", self.low, self.high, self.step)

    @property
    def spec(self) -> str:
        return _spec(
            "lognormal", {"mu": self.mu, "sigma": self.sigma}, self.low, self.high, self.step
        )

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        drawn = rng.lognormal(self.mu, self.sigma, size=_check_n(n))
        return _round_and_clip(self.spec, drawn, self.low, self.high, self.step)


@dataclass(frozen=True, slots=True)
class GaussianBatch:
    """Normal batch sizes (``gaussian:mean=300,sd=100[,low=..,high=..,step=..]``, the Kairos
    robustness experiment): a draw N(mean, sd^2) rounded up to a multiple of ``step``, then
    clipped to [low, high] (``low`` defaults to ``step``, so negative draws become ``step``)."""

    mean: float
    sd: float
    low: int | None = None
    high: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        _check_shape_params(self.spec, self.sd, "sd", self.low, self.high, self.step)

    @property
    def spec(self) -> str:
        return _spec("gaussian", {"mean": self.mean, "sd": self.sd}, self.low, self.high, self.step)

    def sample(self, n: int, rng: np.random.Generator) -> IntArray:
        drawn = rng.normal(self.mean, self.sd, size=_check_n(n))
        return _round_and_clip(self.spec, drawn, self.low, self.high, self.step)


def _spec(name: str, params: dict[str, float], low: int | None, high: int | None, step: int) -> str:
    parts = [f"{key}={_format_number(value)}" for key, value in params.items()]
    if low is not None:
        parts.append(f"low={low}")
    if high is not None:
        parts.append(f"high={high}")
    if step != 1:
        parts.append(f"step={step}")
    return f"{name}:" + ",".join(parts)


def _check_shape_params(
    spec: str, spread: float, spread_name: str, low: int | None, high: int | None, step: int
) -> None:
    if not math.isfinite(spread) or spread <= 0.0:
        raise WorkloadError(f"batch-size spec {spec!r}: {spread_name} must be > 0, got {spread!r}")
    if step < 1:
        raise WorkloadError(f"batch-size spec {spec!r}: step must be >= 1, got {step}")
    floor = step if low is None else low
    if floor < 1:
        raise WorkloadError(f"batch-size spec {spec!r}: low must be >= 1, got {floor}")
    if high is not None and high < floor:
        raise WorkloadError(f"batch-size spec {spec!r}: high {high} is below low {floor}")
    for key, value in (("step", step), ("low", floor), ("high", high)):
        _check_at_most(spec, key, value)


def _check_at_most(spec: str, key: str, value: int | None) -> None:
    """A spec's size ``key`` past :data:`MAX_BATCH_SIZE` is a WorkloadError of one line."""
    if value is not None and value > MAX_BATCH_SIZE:
        raise WorkloadError(
            f"batch-size spec {spec!r}: {key} must be at most {MAX_BATCH_SIZE:,}"
            f" (the largest batch size), got {value}"
        )


def _round_and_clip(
    spec: str, drawn: FloatArray, low: int | None, high: int | None, step: int
) -> IntArray:
    """Round up to a multiple of ``step``, clip to [low, high]; a draw past
    :data:`MAX_BATCH_SIZE` with no ``high`` to clip it (or not a number) is an error, not a
    size."""
    ceiling = float(high) if high is not None else float(MAX_BATCH_SIZE)
    # In float first, so that a huge draw cannot overflow int64 before it is checked or clipped.
    rounded = np.ceil(drawn / step) * step
    if np.isnan(rounded).any():
        raise WorkloadError(f"batch-size spec {spec!r}: draws that are not numbers")
    if high is None and (rounded > ceiling).any():
        raise WorkloadError(
            f"batch-size spec {spec!r}: draws reach {float(rounded.max()):.4g}, past the largest"
            f" batch size {MAX_BATCH_SIZE:,}; give high= to clip them"
        )
    result: IntArray = np.clip(rounded, step if low is None else low, ceiling).astype(np.int64)
    return result


# ---------------------------------------------------------------------------------------------
# Parsing specs
# ---------------------------------------------------------------------------------------------

_SHAPED: dict[str, tuple[tuple[str, str], Callable[..., BatchDistribution]]] = {
    "lognormal": (("mu", "sigma"), LogNormalBatch),
    "gaussian": (("mean", "sd"), GaussianBatch),
}
_EXPECTED = (
    "expected 'fixed:N', 'kairos', 'lognormal:mu=M,sigma=S[,low=L,high=H,step=K]' or "
    "'gaussian:mean=M,sd=S[,low=L,high=H,step=K]'"
)


def _parse_int(spec: str, key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise WorkloadError(
            f"batch-size spec {spec!r}: {key} must be an integer, got {text!r}"
        ) from None


def _parse_float(spec: str, key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise WorkloadError(
            f"batch-size spec {spec!r}: {key} must be a number, got {text!r}"
        ) from None
    if not math.isfinite(value):
        raise WorkloadError(f"batch-size spec {spec!r}: {key} must be finite, got {text!r}")
    return value


def parse_batch_distribution(spec: str) -> BatchDistribution:
    """Parse a batch-size spec.

    ``fixed:N``; ``kairos`` (KAIROS_MATH.md's production mix, :class:`KairosMix`);
    ``lognormal:mu=M,sigma=S[,low=L,high=H,step=K]``; ``gaussian:mean=M,sd=S[,low=,high=,step=]``
    (for the last two: round up to a multiple of ``step``, default 1, then clip to [low, high],
    ``low`` defaulting to ``step`` and ``high`` to none). A distribution's ``spec`` parses back
    to an equal distribution. No batch size exceeds :data:`MAX_BATCH_SIZE`: a larger ``N``,
    ``low``, ``high`` or ``step`` is refused here, an unclipped draw past it when sampling.

    >>> parse_batch_distribution("gaussian:mean=300,sd=100,step=10").spec
    'gaussian:mean=300,sd=100,step=10'

    Raises:
        WorkloadError: naming the spec and what was expected.
    """
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if name == "kairos":
        if rest.strip():
            raise WorkloadError(f"batch-size spec {spec!r}: kairos takes no parameters")
        return KairosMix()
    if name == "fixed":
        size = _parse_int(spec, "N", rest.strip())
        if size < 1:
            raise WorkloadError(f"batch-size spec {spec!r}: N must be >= 1, got {size}")
        _check_at_most(spec, "N", size)
        return FixedBatch(size)
    if name not in _SHAPED:
        raise WorkloadError(f"unknown batch-size spec {spec!r}: {_EXPECTED}")
    required, build = _SHAPED[name]
    allowed = (*required, "low", "high", "step")
    values: dict[str, str] = {}
    for item in rest.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key or not value:
            raise WorkloadError(f"batch-size spec {spec!r}: {item.strip()!r} is not key=value")
        if key not in allowed:
            raise WorkloadError(
                f"batch-size spec {spec!r}: unknown key {key!r} (allowed: {', '.join(allowed)})"
            )
        if key in values:
            raise WorkloadError(f"batch-size spec {spec!r}: {key!r} is given twice")
        values[key] = value
    missing = [key for key in required if key not in values]
    if missing:
        raise WorkloadError(f"batch-size spec {spec!r}: missing {', '.join(missing)}; {_EXPECTED}")
    return build(
        *(_parse_float(spec, key, values[key]) for key in required),
        low=_parse_int(spec, "low", values["low"]) if "low" in values else None,
        high=_parse_int(spec, "high", values["high"]) if "high" in values else None,
        step=_parse_int(spec, "step", values["step"]) if "step" in values else 1,
    )
