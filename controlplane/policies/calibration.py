"""Online calibration: whether a profile still tells the truth about a (model, instance type).

A policy in the STYLE.md sense: a pure function of what the profile predicts and what the serving
loop measured, returning a decision (:class:`Calibration`); the calibration loop
(:mod:`controlplane.loops.calibration`) acts on it.

The measured figure is each batch's service time as the dispatcher sees it: the worker round
trip (transport and compute), which is what the serving-path profiles measure, plus the
instance's turnaround before the batch when work was waiting (the serving loop's turn between
its last answer and this start: a simulated instance's busy time). Per observed
batch i of size b_i with service time o_i, and the profile's mean latency L(b_i) (linear between
its measured batch sizes), the batch-weighted ratio is

    r = sum_i o_i / sum_i L(b_i)

(the observed over the predicted time of the same batches; with one batch size it is the ratio
of the means). Batches whose size the profile does not cover are left out: the profile says
nothing about them. The rule: drift when at least ``min_batches`` batches are left and
``|r - 1| > threshold``; the scale factor is then r (the profile's samples multiplied by r
predict the observed mean).

>>> from estimator.profiles import LatencyProfile
>>> profile = LatencyProfile("m", "t", [1, 4], ([10.0], [20.0]))
>>> c = calibrate(profile, {1: [21.0] * 30, 4: [39.0] * 30}, CalibrationRule(min_batches=50))
>>> c.drift, c.batches, c.profile_mean_ms, c.observed_mean_ms, c.factor
(True, 60, 15.0, 30.0, 2.0)
>>> calibrate(profile, {1: [21.0] * 30}, CalibrationRule(min_batches=50)).drift
False

**Fine corrections.** The threshold is wide on purpose (a drift re-sizes the live fleet), but a
queue at high utilisation magnifies a small error: a profile 7 % fast at 90 % of capacity is a
queue at 96 %, whose P99 is about three times the predicted one. So a smaller miss is corrected too
when the evidence for it is strong (``fine``): at least ``fine_min_batches`` batches, ``|r - 1|
> fine_threshold``, and that excess over ``fine_threshold`` more than :data:`FINE_Z` standard
errors of r (the ratio estimator's, sqrt(sum (o_i - r L(b_i))^2) / sum L(b_i)): noise or a few
slow batches do not move the profile. That error takes the batches as independent, and a stall
of the machine slows a whole window of them together, so the calibration loop waits
``fine_persist_s`` (60 s) after a fine verdict, reading the factor on every tick, and stores the
mean of those readings if it is still off by more than ``fine_threshold``: a steady bias moves
the profile, a slow second does not. A fine correction is stored and planned with like a drift;
the calibration loop does not re-size the fleet for it.

>>> ten = LatencyProfile("m", "t", [1], ([10.0],))
>>> fine = calibrate(ten, {1: [10.8, 10.7, 10.9] * 70})
>>> fine.drift, fine.fine, round(fine.factor, 2)
(False, True, 1.08)
>>> calibrate(ten, {1: [5.0, 17.0] * 105}).fine  # 10 % slow on average, but noisy
False

**The control plane's own overhead per query.** Besides the workers' batches, every query spends
time in the API before the serving loop takes it (its receipt to the dispatcher's submit: body
parsing, the token check, validation, the event loop's queue) and waiting for the loop's turn
with its instance already free (the dispatch lag), which no worker profile or simulated queue
holds. The planner adds the app's stored overhead to every query's simulated latency. The
measured figure is the median of the newest answered queries' own times (the two summed:
``Split.own_ms``); the rule
(:func:`overhead_drift`): update when at least ``min_batches`` queries were counted and the
median differs from the stored figure by more than ``threshold`` of it and more than
:data:`OVERHEAD_FLOOR_MS` (a fraction of a millisecond is the timer's and the scheduler's noise),
or when none is stored yet.

>>> o = overhead_drift(None, [2.0, 3.0, 4.0] * 20, CalibrationRule(min_batches=50))
>>> o.drift, o.observed_ms, o.samples, o.quantiles_ms[99]
(True, 3.0, 60, 4.0)
>>> overhead_drift(3.2, [2.0, 3.0, 4.0] * 20, CalibrationRule(min_batches=50), o.quantiles_ms).drift
False

Its tail, not only its median: with the median, the quantiles of the same queries at
:data:`OVERHEAD_QUANTILES` (0, 1, ..., 100 %) are stored, and the planner draws each simulated
query's overhead from them (:func:`draw_overhead_ms`): a service whose own time is 1 ms at the
median and 15 ms at p99 (the periodic jobs on the interpreter that serves, a collection) moves a
query's P99 by much more than 1 ms. The rule updates the stored figures also when the observed
P99 moved as the median would have to (more than ``threshold`` of the stored P99 and more than
:data:`OVERHEAD_FLOOR_MS`), and when the stored figure has no distribution yet.

**The spread of the round trips.** The factor makes a profile's mean right; its spread is the
profiler's, and the live path may have another: on a 2-core machine a millisecond model's round
trips through the serving loop were 0.9 ms at the median and 2.5 ms at p99, where the profile
said 0.9 and 1.3, and a queue's tail follows the service time's tail. So the loop also keeps
the shape of the observed round trips (:func:`spread_drift`): each batch's time over its batch
size's mean, pooled, at :data:`OVERHEAD_QUANTILES` (a unit-mean shape), stored when at least
``fine_min_batches`` batches give it and its tail differs from the resolved profile's (its
samples over their means, at the same batch sizes) by more than ``threshold``. The tail is the
mean of the slowest :data:`TAIL_SHARE` (5 %) over the mean: steadier from one window of a few
hundred batches to the next than a p99, which is two or three of them. The resolver then gives
each batch size of the profile that shape about its calibrated mean (:func:`spread_samples`).

>>> even = LatencyProfile("m", "t", [1], ([1.0, 1.0, 1.0, 1.0],))
>>> tailed = spread_drift(even, {1: [1.0] * 196 + [4.0] * 4})
>>> tailed.drift, round(tailed.observed_tail, 2), tailed.profile_tail
(True, 2.08, 1.0)
>>> spread_drift(even, {1: [1.0] * 200}).drift
False
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from estimator.profiles import LatencyProfile

__all__ = [
    "CPU_FLOOR_MS",
    "DEFAULT_FINE_MIN_BATCHES",
    "DEFAULT_FINE_PERSIST_S",
    "DEFAULT_FINE_THRESHOLD",
    "DEFAULT_MIN_BATCHES",
    "DEFAULT_THRESHOLD",
    "FINE_P99_ERROR",
    "FINE_UTILISATION",
    "FINE_Z",
    "OVERHEAD_FLOOR_MS",
    "OVERHEAD_QUANTILES",
    "TAIL_SHARE",
    "Calibration",
    "CalibrationRule",
    "OverheadCalibration",
    "Spread",
    "calibrate",
    "draw_overhead_ms",
    "overhead_drift",
    "serving_cpu_moved",
    "spread_drift",
    "spread_samples",
]

# Fifty batches: the mean of 50 service times with a 30 % coefficient of variation is within
# about 8 % of the truth (2 standard errors), well inside the 25 % threshold.
DEFAULT_MIN_BATCHES = 50
# A 25 % miss: less than the gap between neighbouring instance types' speeds in the catalogs,
# more than the run-to-run noise of a profile measured on the same type.
DEFAULT_THRESHOLD = 0.25
# Fine corrections (module docstring): a miss over the share that puts a queue at FINE_UTILISATION
# of its capacity past the fidelity goal (its P99 within FINE_P99_ERROR), on at least 200
# batches, beyond FINE_Z standard errors of the ratio. A queue's P99 grows as 1 / (1 - rho), and a
# service time e slower than planned puts it at rho (1 + e): the P99 is (1 - rho) / (1 - rho (1 +
# e)) times the plan's, within 1 + error while rho e <= (1 - rho) (1 - 1 / (1 + error)): 1.45 % at
# 90 % and 15 % (the 5 % before 2026-12-06 let a 5 ms model's 4-5 % stand, a P99 1.8 times the
# plan's at 90 %: docs/serving-fidelity.md).
FINE_UTILISATION = 0.9
FINE_P99_ERROR = 0.15
DEFAULT_FINE_THRESHOLD = round(
    (1.0 - FINE_UTILISATION) * (1.0 - 1.0 / (1.0 + FINE_P99_ERROR)) / FINE_UTILISATION, 4
)
DEFAULT_FINE_MIN_BATCHES = 200
# A fine correction is a steady bias: after a fine verdict the calibration loop reads the factor
# on its ticks for a minute (the tuner's longest window) and stores their mean if it is still off
# by more than the fine threshold. A window of the newest batches spans a second or two at
# hundreds of batches a second; one that a stall of the machine made slow is sure of its miss by
# its own standard error (its batches are not independent: a stall slows them together), and a
# rule judged on every tick's window would take the first such window as the truth.
DEFAULT_FINE_PERSIST_S = 60.0
FINE_Z = 3.0
# A change of the control plane's overhead below this is noise, whatever its share.
OVERHEAD_FLOOR_MS = 0.5
# A change of the serving process's CPU per query below this is noise, whatever its share.
CPU_FLOOR_MS = 0.05
# The percentages at which the overhead's distribution is stored: every percent, both ends in.
OVERHEAD_QUANTILES: tuple[float, ...] = tuple(float(q) for q in range(101))
_P99 = OVERHEAD_QUANTILES.index(99.0)
# The share of the slowest round trips whose mean is a spread's tail (module docstring).
TAIL_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class CalibrationRule:
    """When observed service times count as drift: at least ``min_batches`` observed batches and
    a relative miss ``|r - 1|`` above ``threshold``; and when a smaller miss is corrected as a
    fine one: at least ``fine_min_batches`` and a miss over ``fine_threshold`` by more than
    :data:`FINE_Z` standard errors (module docstring; a ``fine_threshold`` at ``threshold`` or
    above turns fine corrections off), which the calibration loop stores at the mean of its
    readings over ``fine_persist_s`` (:data:`DEFAULT_FINE_PERSIST_S`) when that is still off."""

    min_batches: int = DEFAULT_MIN_BATCHES
    threshold: float = DEFAULT_THRESHOLD
    fine_threshold: float = DEFAULT_FINE_THRESHOLD
    fine_min_batches: int = DEFAULT_FINE_MIN_BATCHES
    fine_persist_s: float = DEFAULT_FINE_PERSIST_S

    def __post_init__(self) -> None:
        if self.min_batches < 1:
            raise ValueError(f"min_batches must be >= 1, got {self.min_batches!r}")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"threshold must be finite and > 0, got {self.threshold!r}")
        if not (math.isfinite(self.fine_threshold) and self.fine_threshold > 0):
            raise ValueError(f"fine_threshold must be finite and > 0, got {self.fine_threshold!r}")
        if self.fine_min_batches < 1:
            raise ValueError(f"fine_min_batches must be >= 1, got {self.fine_min_batches!r}")
        if not (math.isfinite(self.fine_persist_s) and self.fine_persist_s >= 0):
            raise ValueError(f"fine_persist_s must be finite and >= 0, got {self.fine_persist_s!r}")


@dataclass(frozen=True, slots=True)
class Calibration:
    """What the observations say about a profile: ``batches`` counted, the profile's and the
    observed mean service time per batch over them (ms; None when none was counted), the ratio
    ``factor`` = observed / profile (1 when none was counted), whether that is ``drift``, or a
    ``fine`` correction (never both), and the standard error of the factor (``factor_se``)."""

    model: str
    instance_type: str
    batches: int
    profile_mean_ms: float | None
    observed_mean_ms: float | None
    factor: float
    drift: bool
    fine: bool = False
    factor_se: float = 0.0

    @property
    def corrects(self) -> bool:
        """Whether the profile is to be scaled by ``factor``: a drift or a fine correction."""
        return self.drift or self.fine


def calibrate(
    profile: LatencyProfile,
    observed_ms: Mapping[int, Sequence[float]],
    rule: CalibrationRule | None = None,
) -> Calibration:
    """The batch-weighted observed / profile ratio of ``observed_ms`` (batch size -> service
    times, ms) against ``profile``, and whether it is drift under ``rule`` (module docstring)."""
    rule = rule if rule is not None else CalibrationRule()
    observed_parts: list[np.ndarray] = []
    predicted_parts: list[np.ndarray] = []
    for batch_size, times in observed_ms.items():
        if not profile.min_batch_size <= batch_size <= profile.max_batch_size:
            continue
        values = np.asarray(times, dtype=np.float64)
        values = values[np.isfinite(values) & (values >= 0)]
        if values.size == 0:
            continue
        observed_parts.append(values)
        predicted_parts.append(np.full(values.size, profile.mean_latency_ms(batch_size)))
    observed = np.concatenate(observed_parts) if observed_parts else np.empty(0)
    predicted = np.concatenate(predicted_parts) if predicted_parts else np.empty(0)
    batches = int(observed.size)
    predicted_sum = float(predicted.sum())
    if batches == 0 or predicted_sum <= 0:
        return Calibration(profile.model, profile.instance_type, batches, None, None, 1.0, False)
    observed_sum = float(observed.sum())
    factor = observed_sum / predicted_sum
    miss = abs(factor - 1.0)
    # The ratio estimator's standard error (residuals about r times the profile's means).
    residuals = observed - factor * predicted
    factor_se = float(np.sqrt(np.sum(residuals**2) * batches / max(batches - 1, 1))) / predicted_sum
    drift = batches >= rule.min_batches and miss > rule.threshold and factor > 0
    fine = (
        not drift
        and factor > 0
        and rule.fine_threshold < rule.threshold
        and batches >= rule.fine_min_batches
        and miss - rule.fine_threshold > FINE_Z * factor_se
    )
    return Calibration(
        profile.model,
        profile.instance_type,
        batches,
        predicted_sum / batches,
        observed_sum / batches,
        factor,
        drift,
        fine,
        factor_se,
    )


@dataclass(frozen=True, slots=True)
class OverheadCalibration:
    """What the observed API times say about the stored overhead: ``samples`` counted, the
    ``stored_ms`` figure (None: none yet), the ``observed_ms`` median (None when none was
    counted), their ``quantiles_ms`` at :data:`OVERHEAD_QUANTILES` (empty when none was
    counted) and whether to store them (``drift``)."""

    samples: int
    stored_ms: float | None
    observed_ms: float | None
    drift: bool
    quantiles_ms: tuple[float, ...] = ()


def overhead_drift(
    stored_ms: float | None,
    api_times_ms: Sequence[float],
    rule: CalibrationRule | None = None,
    stored_quantiles_ms: Sequence[float] = (),
) -> OverheadCalibration:
    """Whether the median and quantiles of ``api_times_ms`` should replace ``stored_ms`` and
    ``stored_quantiles_ms`` under ``rule`` (module docstring)."""
    rule = rule if rule is not None else CalibrationRule()
    values = np.asarray(api_times_ms, dtype=np.float64)
    values = values[np.isfinite(values) & (values >= 0)]
    if values.size == 0:
        return OverheadCalibration(0, stored_ms, None, False)
    observed = float(np.median(values))
    quantiles = tuple(float(q) for q in np.percentile(values, OVERHEAD_QUANTILES))
    enough = values.size >= rule.min_batches

    def moved(now_ms: float, before_ms: float) -> bool:
        change = abs(now_ms - before_ms)
        return change > OVERHEAD_FLOOR_MS and change > rule.threshold * before_ms

    if stored_ms is None or len(stored_quantiles_ms) != len(OVERHEAD_QUANTILES):
        return OverheadCalibration(int(values.size), stored_ms, observed, enough, quantiles)
    drift = enough and (
        moved(observed, stored_ms) or moved(quantiles[_P99], stored_quantiles_ms[_P99])
    )
    return OverheadCalibration(int(values.size), stored_ms, observed, drift, quantiles)


def serving_cpu_moved(
    stored_ms: float | None, observed_ms: float, rule: CalibrationRule | None = None
) -> bool:
    """Whether the serving process's CPU per query ``observed_ms`` should replace ``stored_ms``
    (None: none stored): moved by more than :data:`CPU_FLOOR_MS` and the rule's threshold.

    >>> serving_cpu_moved(None, 0.3), serving_cpu_moved(0.3, 0.34), serving_cpu_moved(0.3, 0.5)
    (True, False, True)
    """
    if stored_ms is None:
        return True
    rule = rule if rule is not None else CalibrationRule()
    change = abs(observed_ms - stored_ms)
    return change > CPU_FLOOR_MS and change > rule.threshold * stored_ms


def draw_overhead_ms(
    quantiles_ms: Sequence[float], count: int, rng: np.random.Generator
) -> np.ndarray:
    """``count`` draws of the overhead from its quantiles at :data:`OVERHEAD_QUANTILES`
    (inverse transform, linear between them).

    >>> draws = draw_overhead_ms([float(q) for q in range(101)], 4, np.random.default_rng(0))
    >>> bool(((draws >= 0) & (draws <= 100)).all()), draws.shape
    (True, (4,))
    """
    if len(quantiles_ms) != len(OVERHEAD_QUANTILES):
        raise ValueError(
            f"expected {len(OVERHEAD_QUANTILES)} quantiles (0..100 %), got {len(quantiles_ms)}"
        )
    percent = rng.random(count) * 100.0
    return np.interp(percent, OVERHEAD_QUANTILES, np.asarray(quantiles_ms, dtype=np.float64))


@dataclass(frozen=True, slots=True)
class Spread:
    """What the observed round trips say about a profile's spread (module docstring):
    ``batches`` counted, the observed unit-mean ``quantiles`` at :data:`OVERHEAD_QUANTILES`
    (empty when none was counted), its p99 and the resolved profile's (1 when none), and whether
    to store the observed shape (``drift``); ``observed_tail`` and ``profile_tail`` the means
    of their slowest :data:`TAIL_SHARE` over their means (1 when none was counted)."""

    batches: int
    quantiles: tuple[float, ...]
    observed_tail: float
    profile_tail: float
    drift: bool


def _unit_mean(cells: Sequence[np.ndarray]) -> np.ndarray:
    """Each cell's values over its own mean, pooled (cells with no positive mean left out)."""
    parts = [cell / cell.mean() for cell in cells if cell.size and cell.mean() > 0]
    return np.concatenate(parts) if parts else np.empty(0)


def spread_drift(
    profile: LatencyProfile,
    observed_ms: Mapping[int, Sequence[float]],
    rule: CalibrationRule | None = None,
) -> Spread:
    """The unit-mean shape of ``observed_ms`` (batch size -> service times, ms) against
    ``profile``'s at the same batch sizes, and whether to store it under ``rule`` (module
    docstring; batch sizes the profile does not measure are left out)."""
    rule = rule if rule is not None else CalibrationRule()
    observed: list[np.ndarray] = []
    profiled: list[np.ndarray] = []
    measured = dict(zip(profile.batch_sizes.tolist(), profile.samples_ms, strict=True))
    for batch_size, times in observed_ms.items():
        cell = measured.get(batch_size)
        if cell is None:
            continue
        values = np.asarray(times, dtype=np.float64)
        observed.append(values[np.isfinite(values) & (values >= 0)])
        profiled.append(cell)
    shape, own = _unit_mean(observed), _unit_mean(profiled)
    if shape.size == 0 or own.size == 0:
        return Spread(int(shape.size), (), 1.0, 1.0, False)
    quantiles = tuple(float(q) for q in np.percentile(shape, OVERHEAD_QUANTILES))
    observed_tail, profile_tail = _tail(shape), _tail(own)
    drift = (
        shape.size >= rule.fine_min_batches
        and abs(observed_tail / profile_tail - 1.0) > rule.threshold
    )
    return Spread(int(shape.size), quantiles, observed_tail, profile_tail, drift)


def _tail(shape: np.ndarray) -> float:
    """The mean of the slowest :data:`TAIL_SHARE` of a unit-mean ``shape`` (at least one)."""
    count = max(1, math.ceil(shape.size * TAIL_SHARE))
    return float(np.sort(shape)[-count:].mean())


def spread_samples(quantiles: Sequence[float], mean_ms: float) -> np.ndarray:
    """Samples (ms) of a unit-mean shape stored at :data:`OVERHEAD_QUANTILES` about ``mean_ms``:
    one at the middle of each percent (0.5, 1.5, ..., 99.5: equally likely draws, the ends not
    over-weighted), scaled so that their mean is ``mean_ms``.

    >>> samples = spread_samples([1.0] * 99 + [2.0, 4.0], 10.0)
    >>> samples.size, round(float(samples.mean()), 9), round(float(samples.max()), 2)
    (100, 10.0, 29.27)
    """
    if len(quantiles) != len(OVERHEAD_QUANTILES):
        raise ValueError(
            f"expected {len(OVERHEAD_QUANTILES)} quantiles (0..100 %), got {len(quantiles)}"
        )
    middles = np.interp(
        np.arange(0.5, 100.0, 1.0), OVERHEAD_QUANTILES, np.asarray(quantiles, dtype=np.float64)
    )
    total = float(middles.mean())
    if not total > 0:
        raise ValueError("a spread's quantiles must have a positive mean")
    scaled: np.ndarray = middles * (mean_ms / total)
    return scaled
