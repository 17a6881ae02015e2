"""The online latency model: predicted service time of a batch size on an instance type.

Kairos predicts each query's latency on each instance type to build its cost matrix, and learns
the predictions online (Kairos section 5.1, "Remarks on assumptions and overhead": "Kairos starts
with a linear model but does not rely on the model accuracy because it will quickly transition into
a lookup table after processing more queries"). Per instance type this model keeps:

- a **linear fit** L(b) = a + c b, ordinary least squares over the caller's initial points (for
  example a profile's mean latency per batch size) and the first N measurements at each batch size
  (with a single distinct batch size the fit is the proportional line L(b) = (mean L / mean b) b);
- a **lookup table**: a batch size with at least N measurements (``table_after``, default 5) is
  *measured*, and its prediction is the mean of its measurements.

A prediction at batch size b is, in order: the table mean at b when b is measured; the linear
interpolation of the table means at the nearest measured sizes below and above b; the table mean
at the nearest measured size plus the fit's slope times the distance, when b lies outside the
measured range on one side; the fit itself while nothing is measured. Predictions are clipped at
0. Measurements beyond the first N at a size only refine its table mean: the fit is what covers
sizes the table does not, so it stops learning from a size once the table has it, which also keeps
an observation O(1).

The state lives in dense numpy arrays indexed by (type, batch size), so that one observation and
one prediction are O(1) and compiled code (the Kairos policy's round kernel) reads predictions
directly. The model is deterministic and pure: no clock, no I/O, no randomness; it changes only
through :meth:`LatencyModel.observe`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import numba
import numpy as np

from matching.errors import LatencyModelError, UnknownLatencyError

DEFAULT_TABLE_AFTER = 5

# Columns of the per-type fit accumulator (Welford's running moments).
_N, _MEAN_B, _MEAN_L, _M2_B, _C_BL = range(5)
# Columns of the per-type line: intercept and slope (ms, ms per item).
_A, _C = range(2)

Source = Literal["table", "interpolated", "extrapolated", "fit"]


class MeanLatencyProfile(Protocol):
    """What :meth:`LatencyModel.from_means` reads of a profile (``estimator.profiles`` has one)."""

    @property
    def batch_sizes(self) -> np.ndarray: ...
    @property
    def mean_ms(self) -> np.ndarray: ...


@dataclass(frozen=True, slots=True, eq=False)
class LatencyArrays:
    """The model's state, for compiled readers (see :func:`predict_kernel`).

    ``counts[t, b]`` and ``sums_ms[t, b]``: measurements at batch size b on type t and their sum;
    ``left[t, b]`` / ``right[t, b]``: the largest measured size <= b / the smallest >= b (-1 when
    none); ``line[t]``: the fit's intercept and slope; ``fit[t]``: its running moments (n first).
    Replaced as a whole when the model grows (a new type, a larger batch size).
    """

    counts: np.ndarray
    sums_ms: np.ndarray
    left: np.ndarray
    right: np.ndarray
    line: np.ndarray
    fit: np.ndarray


@numba.njit(cache=True, inline="always")
def _mean_at(counts: np.ndarray, sums_ms: np.ndarray, t: int, b: int) -> float:
    mean: float = sums_ms[t, b] / counts[t, b]
    return mean


@numba.njit(cache=True)
def predict_kernel(
    counts: np.ndarray,
    sums_ms: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    line: np.ndarray,
    table_after: int,
    t: int,
    b: int,
) -> float:
    """Predicted latency (ms) of batch size ``b`` on type ``t`` (the rule in the module docstring).

    ``b`` may exceed the arrays' batch-size capacity: it is then above every measured size.
    """
    cap = counts.shape[1] - 1
    slope: float = line[t, _C]
    value: float
    if b <= cap:
        if counts[t, b] >= table_after:
            return _mean_at(counts, sums_ms, t, b)
        lo = left[t, b]
        hi = right[t, b]
    else:
        lo = left[t, cap]
        hi = -1
    if lo >= 0 and hi >= 0:
        weight = (b - lo) / (hi - lo)
        value = (1.0 - weight) * _mean_at(counts, sums_ms, t, lo) + weight * _mean_at(
            counts, sums_ms, t, hi
        )
    elif lo >= 0:
        value = _mean_at(counts, sums_ms, t, lo) + slope * (b - lo)
    elif hi >= 0:
        value = _mean_at(counts, sums_ms, t, hi) + slope * (b - hi)
    else:
        value = line[t, _A] + slope * b
    return max(value, 0.0)


@numba.njit(cache=True)
def _add_to_fit(fit: np.ndarray, line: np.ndarray, t: int, b: int, latency_ms: float) -> None:
    """Welford's update of the running moments, then the least-squares line from them.

    With n points: slope c = sum (b - mean b)(L - mean L) / sum (b - mean b)^2, intercept
    a = mean L - c mean b; with one distinct batch size, the proportional line a = 0,
    c = mean L / mean b.
    """
    fit[t, _N] += 1.0
    n = fit[t, _N]
    delta_b = b - fit[t, _MEAN_B]
    fit[t, _MEAN_B] += delta_b / n
    delta_l = latency_ms - fit[t, _MEAN_L]
    fit[t, _MEAN_L] += delta_l / n
    fit[t, _M2_B] += delta_b * (b - fit[t, _MEAN_B])
    fit[t, _C_BL] += delta_b * (latency_ms - fit[t, _MEAN_L])
    if fit[t, _M2_B] > 0.0:
        slope = fit[t, _C_BL] / fit[t, _M2_B]
        line[t, _A] = fit[t, _MEAN_L] - slope * fit[t, _MEAN_B]
        line[t, _C] = slope
    else:
        line[t, _A] = 0.0
        line[t, _C] = fit[t, _MEAN_L] / fit[t, _MEAN_B]


@numba.njit(cache=True)
def _observe_kernel(
    counts: np.ndarray,
    sums_ms: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    line: np.ndarray,
    fit: np.ndarray,
    table_after: int,
    t: int,
    b: int,
    latency_ms: float,
) -> None:
    if counts[t, b] < table_after:
        _add_to_fit(fit, line, t, b, latency_ms)
    counts[t, b] += 1
    sums_ms[t, b] += latency_ms
    if counts[t, b] == table_after:
        # b becomes measured: it is the nearest measured size for the sizes up to the next
        # measured size on either side.
        cap = counts.shape[1] - 1
        x = b
        while x <= cap and (x == b or counts[t, x] < table_after):
            left[t, x] = b
            x += 1
        x = b
        while x >= 0 and (x == b or counts[t, x] < table_after):
            right[t, x] = b
            x -= 1


class LatencyModel:
    """Per-instance-type latency predictions, learned online (see the module docstring).

    ``points``: initial (batch size, latency ms) points per instance type, for the linear fit.
    A type with no points starts unknown and is learned from its first measurements.

    >>> model = LatencyModel({"gpu": [(10, 12.0), (20, 22.0)]}, table_after=2)
    >>> model.predict_ms("gpu", 40)  # the line 2 + b ms
    42.0
    >>> model.observe("gpu", 40, 50.0); model.observe("gpu", 40, 54.0)
    >>> model.predict_ms("gpu", 40), model.source("gpu", 40)
    (52.0, 'table')
    """

    def __init__(
        self,
        points: Mapping[str, Iterable[tuple[int, float]]] | None = None,
        *,
        table_after: int = DEFAULT_TABLE_AFTER,
    ) -> None:
        if isinstance(table_after, bool) or not isinstance(table_after, int) or table_after < 1:
            raise LatencyModelError(f"table_after must be an integer >= 1, got {table_after!r}")
        self._table_after = table_after
        self._type_ids: dict[str, int] = {}
        self._max_batch_size = 0
        self._arrays = _empty_arrays(0, 1)
        for instance_type, type_points in (points or {}).items():
            checked = [_check_point(instance_type, b, ms) for b, ms in type_points]
            t = self._add_type(instance_type)
            for b, ms in checked:
                self._max_batch_size = max(self._max_batch_size, b)
                _add_to_fit(self._arrays.fit, self._arrays.line, t, b, ms)
        self._reserve(self._max_batch_size)

    @classmethod
    def from_means(
        cls,
        profiles: Mapping[str, MeanLatencyProfile],
        *,
        table_after: int = DEFAULT_TABLE_AFTER,
    ) -> LatencyModel:
        """A model whose initial points are each profile's mean latency per batch size."""
        return cls(
            {
                instance_type: list(
                    zip(
                        np.asarray(p.batch_sizes).tolist(),
                        np.asarray(p.mean_ms).tolist(),
                        strict=True,
                    )
                )
                for instance_type, p in profiles.items()
            },
            table_after=table_after,
        )

    # -- reading ----------------------------------------------------------------------------

    @property
    def table_after(self) -> int:
        """How many measurements put a batch size in the lookup table."""
        return self._table_after

    @property
    def instance_types(self) -> tuple[str, ...]:
        """Known types, in the order of their index (:meth:`type_index`)."""
        return tuple(self._type_ids)

    @property
    def max_batch_size(self) -> int:
        """The largest batch size among the initial points and the measurements (0 if none)."""
        return self._max_batch_size

    @property
    def arrays(self) -> LatencyArrays:
        """The current state, for compiled readers; do not write into it."""
        return self._arrays

    def knows(self, instance_type: str) -> bool:
        """Whether the model can predict ``instance_type`` (it has a point or a measurement)."""
        t = self._type_ids.get(instance_type)
        return t is not None and self._arrays.fit[t, _N] > 0

    def type_index(self, instance_type: str) -> int:
        """The row of ``instance_type`` in :attr:`arrays`; refuses a type it cannot predict."""
        if not self.knows(instance_type):
            raise UnknownLatencyError(instance_type)
        return self._type_ids[instance_type]

    def predict_ms(self, instance_type: str, batch_size: int) -> float:
        """Predicted latency (ms) of ``batch_size`` on ``instance_type``."""
        t = self.type_index(instance_type)
        b = _check_batch_size(batch_size)
        a = self._arrays
        return float(
            predict_kernel(a.counts, a.sums_ms, a.left, a.right, a.line, self._table_after, t, b)
        )

    def source(self, instance_type: str, batch_size: int) -> Source:
        """Which rule :meth:`predict_ms` uses at ``batch_size``."""
        t = self.type_index(instance_type)
        b = _check_batch_size(batch_size)
        a = self._arrays
        cap = a.counts.shape[1] - 1
        if b <= cap and a.counts[t, b] >= self._table_after:
            return "table"
        lo = int(a.left[t, min(b, cap)])
        hi = int(a.right[t, b]) if b <= cap else -1
        if lo >= 0 and hi >= 0:
            return "interpolated"
        return "extrapolated" if lo >= 0 or hi >= 0 else "fit"

    def measurements(self, instance_type: str, batch_size: int) -> int:
        """How many measurements the model has of ``batch_size`` on ``instance_type``."""
        t = self._type_ids.get(instance_type)
        b = _check_batch_size(batch_size)
        if t is None or b >= self._arrays.counts.shape[1]:
            return 0
        return int(self._arrays.counts[t, b])

    def line(self, instance_type: str) -> tuple[float, float]:
        """The linear fit's (intercept ms, slope ms per item)."""
        t = self.type_index(instance_type)
        return float(self._arrays.line[t, _A]), float(self._arrays.line[t, _C])

    # -- learning ---------------------------------------------------------------------------

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """Learn that ``batch_size`` took ``latency_ms`` on ``instance_type``."""
        a = self._arrays
        t = self._type_ids.get(instance_type)
        if (
            t is None
            or type(batch_size) is not int
            or not 1 <= batch_size <= self._max_batch_size
            or not 0.0 <= latency_ms < math.inf
        ):
            # Anything but a known type, a known size and a plain latency: check, then grow.
            batch_size, latency_ms = _check_point(instance_type, batch_size, latency_ms)
            t = self._add_type(instance_type)
            self._reserve(batch_size)
            self._max_batch_size = max(self._max_batch_size, batch_size)
            a = self._arrays
        _observe_kernel(
            a.counts,
            a.sums_ms,
            a.left,
            a.right,
            a.line,
            a.fit,
            self._table_after,
            t,
            batch_size,
            float(latency_ms),
        )

    def copy(self) -> LatencyModel:
        """An independent copy (a policy learns into its model; give each policy its own)."""
        twin = LatencyModel(table_after=self._table_after)
        twin._type_ids = dict(self._type_ids)
        twin._max_batch_size = self._max_batch_size
        a = self._arrays
        twin._arrays = LatencyArrays(
            counts=a.counts.copy(),
            sums_ms=a.sums_ms.copy(),
            left=a.left.copy(),
            right=a.right.copy(),
            line=a.line.copy(),
            fit=a.fit.copy(),
        )
        return twin

    # -- growing ----------------------------------------------------------------------------

    def _add_type(self, instance_type: str) -> int:
        if instance_type in self._type_ids:
            return self._type_ids[instance_type]
        old = self._arrays
        grown = _empty_arrays(len(self._type_ids) + 1, old.counts.shape[1] - 1)
        for new, previous in zip(_fields(grown), _fields(old), strict=True):
            new[: previous.shape[0]] = previous
        self._arrays = grown
        self._type_ids[instance_type] = len(self._type_ids)
        return self._type_ids[instance_type]

    def _reserve(self, batch_size: int) -> None:
        """Make room for batch sizes up to ``batch_size`` (at least doubling, amortised O(1))."""
        old = self._arrays
        old_cap = old.counts.shape[1] - 1
        if batch_size <= old_cap:
            return
        cap = max(batch_size, 2 * old_cap)
        grown = _empty_arrays(old.counts.shape[0], cap)
        for new, previous in zip(_fields(grown)[:4], _fields(old)[:4], strict=True):
            new[:, : old_cap + 1] = previous
        grown.line[:] = old.line
        grown.fit[:] = old.fit
        # Beyond the old capacity nothing is measured: the nearest measured size below is the
        # old capacity's, and there is none above.
        grown.left[:, old_cap + 1 :] = old.left[:, old_cap : old_cap + 1]
        self._arrays = grown


def _empty_arrays(n_types: int, cap: int) -> LatencyArrays:
    shape = (n_types, cap + 1)
    return LatencyArrays(
        counts=np.zeros(shape, dtype=np.int64),
        sums_ms=np.zeros(shape, dtype=np.float64),
        left=np.full(shape, -1, dtype=np.int64),
        right=np.full(shape, -1, dtype=np.int64),
        line=np.zeros((n_types, 2), dtype=np.float64),
        fit=np.zeros((n_types, 5), dtype=np.float64),
    )


def _fields(arrays: LatencyArrays) -> tuple[np.ndarray, ...]:
    return (arrays.counts, arrays.sums_ms, arrays.left, arrays.right, arrays.line, arrays.fit)


def _check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
        raise LatencyModelError(f"a batch size must be an integer, got {batch_size!r}")
    if batch_size < 1:
        raise LatencyModelError(f"a batch size must be >= 1, got {batch_size}")
    return int(batch_size)


def _check_point(instance_type: str, batch_size: int, latency_ms: float) -> tuple[int, float]:
    b = _check_batch_size(batch_size)
    ms = float(latency_ms)
    if not 0.0 <= ms < math.inf:
        raise LatencyModelError(
            f"latency of batch {b} on {instance_type!r} must be finite and >= 0, got {latency_ms!r}"
        )
    return b, ms
