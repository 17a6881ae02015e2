"""Arrival envelopes: the most queries a trace sends in any window of each length.

This is the network-calculus view of a workload that InferLine's tuner uses (InferLine,
SoCC'20, "High-Frequency Tuning", Algorithms 3 and 4): for window lengths from the bottleneck's
service time doubling up to a minute, the tuner compares the largest arrival rate seen in any
window of that length (``max_arrivals / window_s``) with the same envelope of the trace the plan
was made for, and scales out when a live rate exceeds the planned one. This module owns the
window ladder and the envelope computation; the tuner's decisions live with the policies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real

import numba
import numpy as np
from numpy.typing import ArrayLike, NDArray

from estimator.errors import TraceError, WorkloadError
from estimator.traces import check_non_decreasing

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# The longest time scale the tuner watches (this project's choice for InferLine's ladder).
DEFAULT_MAX_WINDOW_S = 60.0
# How long a burst must last before it counts as load rather than noise
# (:func:`recurring_envelope`): half a CPU instance's 30 s boot. A burst that is over sooner is
# over before most of the boot of the instance it would buy, so the tuner rides it on the fleet
# it has (docs/tuner.md, "Noise": fixed before the first held-out run; 8 s, tried on the tuning
# traces since, changed nothing that matters).
DEFAULT_PERSISTENCE_S = 15.0
# The burstiness estimate (:func:`arrival_cv2`) normalises each gap by the arrival rate of its
# stretch of this length, so that a load that moves over tens of seconds does not read as bursts.
DEFAULT_CV2_BIN_S = 10.0
# How many standard deviations of a renewal count a second's arrivals may stand above their
# stretch's median before :func:`clip_short_bursts` reads the excess as a blip.
BURST_CLIP_Z = 5.0


def _check_positive(*named: tuple[str, object]) -> None:
    """Each (name, value) a finite real number > 0, else a :class:`WorkloadError` naming it."""
    for name, value in named:
        if not (isinstance(value, Real) and math.isfinite(float(value)) and float(value) > 0.0):
            raise WorkloadError(f"{name} must be a finite number > 0, got {value!r}")


def _arrival_times(arrival_s: ArrayLike) -> FloatArray:
    """``arrival_s`` as a contiguous float array, checked one-dimensional and non-decreasing
    (a :class:`TraceError` else)."""
    arrivals = np.ascontiguousarray(arrival_s, dtype=np.float64)
    if arrivals.ndim != 1:
        raise TraceError(f"arrival times must be one-dimensional, got shape {arrivals.shape}")
    check_non_decreasing(arrivals, "arrival time")
    return arrivals


def tuner_windows_s(
    service_time_s: float, max_window_s: float = DEFAULT_MAX_WINDOW_S
) -> FloatArray:
    """The window lengths of InferLine's tuner (Algorithm 3, line 3): the service time, doubling
    while below ``max_window_s``, then ``max_window_s`` itself.

    >>> tuner_windows_s(0.25).tolist()
    [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0]

    Raises:
        WorkloadError: a service time or maximum window that is not finite and > 0, or a service
            time longer than the maximum window.
    """
    _check_positive(("service_time_s", service_time_s), ("max_window_s", max_window_s))
    service_time_s, max_window_s = float(service_time_s), float(max_window_s)
    if service_time_s > max_window_s:
        raise WorkloadError(
            f"service_time_s {service_time_s!r} is longer than max_window_s {max_window_s!r}"
        )
    doublings = math.ceil(math.log2(max_window_s / service_time_s))
    windows = service_time_s * 2.0 ** np.arange(doublings + 1)
    result: FloatArray = np.append(windows[windows < max_window_s], max_window_s)
    return result


@dataclass(frozen=True, slots=True, eq=False)
class Envelope:
    """The arrival envelope of a trace: ``max_arrivals[i]`` is the most arrivals in any window
    [t, t + ``window_s[i]``)."""

    window_s: FloatArray
    max_arrivals: IntArray

    def __post_init__(self) -> None:
        window_s = np.array(self.window_s, dtype=np.float64, copy=True, order="C")
        max_arrivals = np.array(self.max_arrivals, dtype=np.int64, copy=True, order="C")
        if window_s.ndim != 1 or window_s.shape != max_arrivals.shape:
            raise WorkloadError(
                f"an envelope needs one max_arrivals per window, got shapes {window_s.shape} "
                f"and {max_arrivals.shape}"
            )
        window_s.setflags(write=False)
        max_arrivals.setflags(write=False)
        object.__setattr__(self, "window_s", window_s)
        object.__setattr__(self, "max_arrivals", max_arrivals)

    @property
    def rate_qps(self) -> FloatArray:
        """The peak rate at each time scale, max_arrivals / window_s (Algorithm 3, line 4)."""
        rate: FloatArray = self.max_arrivals / self.window_s
        return rate


def _max_arrivals_py(arrival_s: FloatArray, window_s: FloatArray) -> IntArray:
    # For each window a two-pointer merge: i is a window's first arrival, j the first arrival at
    # or after arrival_s[i] + w; each step advances j (the window takes one more arrival) or i
    # (the window slides to the next start), so 2n steps finish every window. Written without
    # branches and interleaved across the windows: a branchy sweep mispredicts about once per
    # arrival and the windows' independent chains overlap in the pipeline (1M arrivals x 9
    # windows: about 95 ms branchy, 30 ms this way, on one core).
    n = arrival_s.size
    m = window_s.size
    best = np.zeros(m, dtype=np.int64)
    if n == 0:
        return best
    padded = np.empty(n + 1, dtype=np.float64)  # a +inf sentinel: no arrival at or after j == n
    padded[:n] = arrival_s
    padded[n] = np.inf
    first = np.zeros(m, dtype=np.int64)
    after = np.zeros(m, dtype=np.int64)
    for _ in range(2 * n):
        for k in range(m):
            i = first[k]
            j = after[k]
            grow = padded[j] < padded[i] + window_s[k]
            best[k] = max(best[k], j - i)
            after[k] = j + grow
            first[k] = min(i + 1 - grow, n)
    for k in range(m):
        best[k] = max(best[k], after[k] - first[k])
    return best


_max_arrivals: Callable[[FloatArray, FloatArray], IntArray] = numba.njit(cache=True, nogil=True)(
    _max_arrivals_py
)


def _recurring_max_py(arrival_s: FloatArray, window_s: FloatArray, persist_s: float) -> IntArray:
    # Per window w, two sweeps of the two-pointer merge of _max_arrivals_py (no copy of the
    # arrivals): the first finds the busiest window's first arrival (the earliest of them) and its
    # count; the second the most arrivals of any window once those of the stretch [centre - L/2,
    # centre + L/2) are left out, a window's count less its overlap with the stretch's indices.
    n = arrival_s.size
    m = window_s.size
    best = np.zeros(m, dtype=np.int64)
    if n == 0:
        return best
    span = arrival_s[n - 1] - arrival_s[0]
    for k in range(m):
        w = window_s[k]
        top = 0
        top_count = -1
        j = 0
        for i in range(n):
            if j < i:
                j = i
            while j < n and arrival_s[j] < arrival_s[i] + w:
                j += 1
            if j - i > top_count:
                top_count = j - i
                top = i
        stretch = max(w, persist_s)
        if span < 2.0 * stretch:
            # The busiest stretch would be half of what was seen, not an exception to it.
            best[k] = top_count
            continue
        # The stretch is centred on the busiest window of this length (a blip's own second,
        # not the busiest 15 s of a bursty stream elsewhere).
        centre = arrival_s[top] + 0.5 * w
        first = np.searchsorted(arrival_s, centre - 0.5 * stretch)
        last = np.searchsorted(arrival_s, centre + 0.5 * stretch)
        most = 0
        j = 0
        for i in range(n):
            if j < i:
                j = i
            while j < n and arrival_s[j] < arrival_s[i] + w:
                j += 1
            if first <= i < last:
                continue
            overlap = max(0, min(j, last) - max(i, first))
            most = max(most, j - i - overlap)
        best[k] = most
    return best


_recurring_max: Callable[[FloatArray, FloatArray, float], IntArray] = numba.njit(
    cache=True, nogil=True
)(_recurring_max_py)


def recurring_envelope(
    arrival_s: ArrayLike,
    window_s: ArrayLike | Sequence[float],
    persistence_s: float = DEFAULT_PERSISTENCE_S,
) -> Envelope:
    """The arrival envelope without the trace's single busiest stretch: for each window w, the
    most arrivals in any window [t, t + w) once the arrivals of the stretch of length
    L = max(w, ``persistence_s``) centred on the busiest window of length w are taken out (their
    times kept, so no window spans the gap with more than it had).

    A burst shorter than ``persistence_s`` then counts only if another like it comes within the
    same arrivals: a blip (a few hundred queries in one second) leaves the envelope as the rest of
    the traffic has it, while a rise in load, a burst that lasts, or bursts that recur are in it
    as before (every window inside them sees them again outside the stretch taken out). It is the
    tuner's reading of "a deficit that will still be there when an instance has booted"
    (docs/tuner.md, "Noise"). With ``persistence_s`` = 0 it is the second-busiest window of each
    length. Arrivals that span less than twice the stretch keep their whole envelope.

    >>> steady = np.arange(0.0, 60.0, 0.125)          # 8 qps for a minute
    >>> blip = np.sort(np.concatenate([steady, 30.0 + np.arange(200) / 400]))  # +200 in 0.5 s
    >>> arrival_envelope(blip, [1.0]).max_arrivals.tolist()
    [208]
    >>> recurring_envelope(blip, [1.0], persistence_s=5.0).max_arrivals.tolist()
    [8]

    Raises:
        TraceError, WorkloadError: as :func:`arrival_envelope`; a ``persistence_s`` that is not
            finite and >= 0.
    """
    full = arrival_envelope(arrival_s, window_s)
    persist = float(persistence_s)
    if not (math.isfinite(persist) and persist >= 0.0):
        raise WorkloadError(f"persistence_s must be a finite number >= 0, got {persistence_s!r}")
    arrivals = np.ascontiguousarray(arrival_s, dtype=np.float64)
    best = _recurring_max(arrivals, np.ascontiguousarray(full.window_s), persist)
    return Envelope(window_s=full.window_s, max_arrivals=best)


def clip_short_bursts(
    arrival_s: ArrayLike,
    persistence_s: float = DEFAULT_PERSISTENCE_S,
    cv2: float = 1.0,
    *,
    z: float = BURST_CLIP_Z,
    bin_s: float = 1.0,
) -> FloatArray:
    """The arrivals less the excess of each ``bin_s`` second that stands out of its stretch of
    ``persistence_s`` (centred on it) by more than ``z`` standard deviations of a renewal count:
    a bin of c arrivals whose stretch's median bin holds m keeps at most
    m + z sqrt(max(m, 1) max(cv2, 1)) of them (the earliest), the rest are dropped, provided the
    bins that stand out all fit in one stretch: bursts that recur across the arrivals (seconds
    standing out further apart than a stretch) are load, and nothing is dropped.

    A burst that is over within about half the stretch (a blip: a few seconds' worth of queries
    inside one second) is then read at the traffic's own level, while a rise, a step or a burst
    that lasts (over half the stretch at its new level) is not touched, nor is the noise of a
    renewal stream of the given burstiness (5 standard deviations). This is what
    :func:`recurring_envelope` does for a window whose stretch the arrivals span twice, for the
    windows they do not (a minute's memory read at 32 and 60 s), and for the tuner's line through
    the last minute's counts (docs/tuner.md, "Noise: the persistence test").

    >>> steady = np.arange(0.0, 60.0, 0.125)          # 8 qps for a minute
    >>> blip = np.sort(np.concatenate([steady, 30.0 + np.arange(200) / 400]))  # +200 in 0.5 s
    >>> arrival_envelope(clip_short_bursts(blip, 15.0), [32.0]).max_arrivals.tolist()
    [270]
    >>> step = np.sort(np.concatenate([steady, 30.0 + np.arange(240) / 8]))  # +8 qps from 30 s
    >>> clip_short_bursts(step, 15.0).size == step.size
    True

    Raises:
        TraceError: arrivals that are not one-dimensional, finite and sorted.
        WorkloadError: a ``persistence_s``, ``z`` or ``bin_s`` that is not finite and > 0.
    """
    arrivals = _arrival_times(arrival_s)
    _check_positive(("persistence_s", persistence_s), ("z", z), ("bin_s", bin_s))
    if arrivals.size < 2:
        return arrivals
    first = float(arrivals[0])
    bins = math.floor((float(arrivals[-1]) - first) / bin_s) + 1
    half = max(1, math.floor(float(persistence_s) / bin_s / 2.0))  # 2 half + 1 bins: 15 for 15 s
    if bins < 2 * half + 1:
        return arrivals  # a span shorter than the stretch: nothing stands out of it
    index = np.minimum(((arrivals - first) / bin_s).astype(np.int64), bins - 1)
    counts = np.bincount(index, minlength=bins).astype(np.float64)
    # At either end the stretch is what there is of it (a blip in the last second is judged
    # against the seconds before it, not against copies of itself).
    padded = np.pad(counts, half, mode="constant", constant_values=np.nan)
    stretches = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    level = np.nanmedian(stretches, axis=1)
    var = max(float(cv2), 1.0) if math.isfinite(cv2) else 1.0
    keep = np.floor(level + z * np.sqrt(np.maximum(level, 1.0) * var))
    over = np.flatnonzero(counts > keep)
    if over.size == 0 or over[-1] - over[0] > 2 * half:
        # None stands out, or those that do recur across the arrivals (they do not fit in one
        # stretch): bursts that come again are load (clients that send in bursts), not a blip.
        return arrivals
    starts = np.searchsorted(index, np.arange(bins), side="left")
    rank = np.arange(arrivals.size) - starts[index]
    kept: FloatArray = arrivals[rank < keep[index]]
    return kept


def arrival_envelope(arrival_s: ArrayLike, window_s: ArrayLike | Sequence[float]) -> Envelope:
    """The most arrivals in any half-open window [t, t + w) of the trace, for each w in
    ``window_s`` (the arrival curve of network calculus; InferLine Algorithm 3, line 4).

    A window holding the most arrivals can always be slid right until it starts at an arrival, so
    max_t #{j : t <= a_j < t + w} = max_i #{j : a_i <= a_j < a_i + w}, which a two-pointer sweep
    over the sorted arrivals finds in O(n) per window (compiled with numba). The comparison is
    ``a_j < a_i + w`` in floating point.

    >>> arrival_envelope([0.0, 0.1, 0.2, 5.0], [0.15, 1.0, 10.0]).max_arrivals.tolist()
    [2, 3, 4]

    Raises:
        TraceError: arrivals that are not a one-dimensional, finite, non-decreasing array.
        WorkloadError: a window that is not finite and > 0.
    """
    arrivals = np.ascontiguousarray(arrival_s, dtype=np.float64)
    windows = np.ascontiguousarray(window_s, dtype=np.float64)
    if arrivals.ndim != 1:
        raise TraceError(f"arrival times must be one-dimensional, got shape {arrivals.shape}")
    if windows.ndim != 1:
        raise WorkloadError(f"window lengths must be one-dimensional, got shape {windows.shape}")
    check_non_decreasing(arrivals, "arrival time")
    bad = np.flatnonzero(~(np.isfinite(windows) & (windows > 0.0)))
    if bad.size:
        raise WorkloadError(
            f"a window must be finite and > 0 s, got {windows[int(bad[0])].item()!r}"
        )
    return Envelope(window_s=windows, max_arrivals=_max_arrivals(arrivals, windows))


def arrival_cv2(arrival_s: ArrayLike, bin_s: float = DEFAULT_CV2_BIN_S) -> tuple[float, int]:
    """The arrivals' burstiness: the squared coefficient of variation of their gaps, each gap
    scaled by the arrival rate of the ``bin_s`` stretch it starts in (so a rate that moves slowly,
    a rise or a daily cycle, does not read as bursts), and the number of gaps it rests on.
    A Poisson stream reads about 1, a gamma renewal stream about its CV^2 (the trace generator's,
    :func:`estimator.traces.renewal_arrivals`). (nan, 0) for fewer than three arrivals.

    >>> rng = np.random.default_rng(0)
    >>> cv2, gaps = arrival_cv2(np.cumsum(rng.gamma(0.25, 4.0 / 100.0, size=20000)))
    >>> bool(3.5 < cv2 < 4.5), gaps
    (True, 19999)

    Raises:
        TraceError: arrivals that are not a one-dimensional, finite, non-decreasing array.
        WorkloadError: a ``bin_s`` that is not finite and > 0.
    """
    arrivals = _arrival_times(arrival_s)
    width = float(bin_s)
    if not (math.isfinite(width) and width > 0.0):
        raise WorkloadError(f"bin_s must be a finite number > 0, got {bin_s!r}")
    if arrivals.size < 3:
        return math.nan, 0
    start = float(arrivals[0])
    bins = np.floor((arrivals - start) / width).astype(np.int64)
    counts = np.bincount(bins)
    # The last stretch is cut at the last arrival: its rate is over the time it covers.
    spans = np.full(counts.size, width)
    spans[-1] = max(float(arrivals[-1]) - start - width * (counts.size - 1), width / counts[-1])
    rates = counts / spans
    scaled = np.diff(arrivals) * rates[bins[:-1]]
    mean = float(scaled.mean())
    if mean <= 0.0:
        return math.nan, 0
    return float(scaled.var() / (mean * mean)), int(scaled.size)
