"""Traces: the queries a workload sends, their CSV form, their statistics, and their generators.

A :class:`Trace` is the arrival time and batch size of every query (and, for cascades, which
validation sample it carries). This module owns the trace file format (DESIGN.md section 4), the
summary statistics the planner and the tuner read (the rate and the squared coefficient of
variation of the inter-arrival times, as InferLine (SoCC'20) characterises bursty workloads), and
every synthetic arrival process the project uses: Poisson and gamma renewal processes
(InferLine's bursty workloads), step and linear-ramp rate changes (InferLine's tuner-sensitivity
experiments), and diurnal rates with spikes.

All generators are one mechanism, :func:`renewal_arrivals`: a unit-rate renewal process time-warped
through the inverse of the integrated rate of a piecewise-linear :class:`RateProfile` (the
time-rescaling theorem). Randomness comes only through the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from estimator.batches import MAX_BATCH_SIZE
from estimator.errors import EstimatorError, TraceError, WorkloadError

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

ARRIVAL_COLUMN = "arrival_s"
BATCH_COLUMN = "batch_size"
SAMPLE_COLUMN = "sample_id"

# A guard against a typo (a rate in queries per millisecond, a duration in milliseconds) that
# would otherwise try to allocate tens of gigabytes: 200 million arrivals is 1.6 GB of float64.
MAX_GENERATED_ARRIVALS = 200_000_000
# The burstiest renewal process generated: gamma gaps of shape 1/CV^2. Past about 100 the draws
# are mostly 0 (below float precision) and a few huge ones, so a trace of the asked rate and
# duration cannot be drawn (1e7 gave 387,997 queries at time 0); InferLine's evaluation and the
# held-out traces use 1 to 8.
MAX_CV2 = 100.0

# Knots per period of a diurnal profile: the chord error of a sinusoid sampled at N points per
# period is at most amplitude * (1 - cos(pi / N)) of the mean, about 5e-4 at N = 96 (15 minutes
# in a day).
DIURNAL_KNOTS_PER_PERIOD = 96
# The most knots a diurnal profile holds (about 16 MB of times and rates): a period of a
# microsecond over a hundred seconds asked for 9.6 billion and 71 GiB.
MAX_DIURNAL_KNOTS = 1_000_000


# ---------------------------------------------------------------------------------------------
# The trace value object
# ---------------------------------------------------------------------------------------------


def _frozen_copy(values: ArrayLike, dtype: type[np.generic]) -> NDArray[Any]:
    array = np.array(values, dtype=dtype, copy=True, order="C")
    array.setflags(write=False)
    return array


def _as_int_column(values: ArrayLike, name: str) -> IntArray:
    """``values`` as int64, refusing floats with a fractional part (no silent truncation)."""
    raw = np.asarray(values)
    if raw.ndim != 1:
        raise TraceError(f"{name} must be one-dimensional, got shape {raw.shape}")
    if raw.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(raw) | (raw != np.round(raw)))
        if bad.size:
            row = int(bad[0])
            raise TraceError(f"{name} is not an integer at row {row + 1}: {raw[row].item()!r}")
    elif raw.dtype.kind not in "iu" and raw.size:
        raise TraceError(f"{name} must hold integers, got dtype {raw.dtype}")
    result: IntArray = _frozen_copy(raw, np.int64)
    return result


def check_non_decreasing(
    values: NDArray[np.float64],
    name: str,
    error: type[EstimatorError] = TraceError,
    position: str = "row",
) -> None:
    """Refuse non-finite values or a decrease, naming the first bad 1-based ``position``."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        k = int(bad[0])
        raise error(f"{name} is not finite at {position} {k + 1}: {values[k].item()!r}")
    bad = np.flatnonzero(np.diff(values) < 0.0)
    if bad.size:
        k = int(bad[0]) + 1
        raise error(
            f"{name} decreases at {position} {k + 1}: "
            f"{values[k].item()!r} < {values[k - 1].item()!r}"
        )


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """The queries of a workload: arrival times in seconds from the start and batch sizes.

    The arrays are converted to read-only contiguous copies (float64 arrivals, int64 batch sizes
    and sample ids) and validated: arrivals finite, >= 0 and non-decreasing; batch sizes >= 1;
    sample ids >= 0; all the same length. A violation raises :class:`TraceError` naming the
    1-based row, e.g. ``arrival_s decreases at row 17: 3.2 < 3.5``.

    >>> trace = Trace(np.array([0.0, 0.5, 2.0]), np.array([1, 4, 2]))
    >>> len(trace), trace.duration_s
    (3, 2.0)
    """

    arrival_s: FloatArray
    batch_size: IntArray
    sample_id: IntArray | None = None

    def __post_init__(self) -> None:
        arrival = np.asarray(self.arrival_s)
        if arrival.ndim != 1:
            raise TraceError(f"arrival_s must be one-dimensional, got shape {arrival.shape}")
        if arrival.dtype.kind not in "fiu" and arrival.size:
            raise TraceError(f"arrival_s must hold numbers, got dtype {arrival.dtype}")
        arrival_s: FloatArray = _frozen_copy(arrival, np.float64)
        batch_size = _as_int_column(self.batch_size, BATCH_COLUMN)
        sample_id = (
            None if self.sample_id is None else _as_int_column(self.sample_id, SAMPLE_COLUMN)
        )
        n = arrival_s.size
        for name, column in ((BATCH_COLUMN, batch_size), (SAMPLE_COLUMN, sample_id)):
            if column is not None and column.size != n:
                raise TraceError(f"{name} has {column.size} rows but arrival_s has {n}")

        bad = np.flatnonzero(np.isfinite(arrival_s) & (arrival_s < 0.0))
        if bad.size and not np.any(~np.isfinite(arrival_s[: bad[0]])):
            row = int(bad[0])
            raise TraceError(f"arrival_s is negative at row {row + 1}: {arrival_s[row].item()!r}")
        check_non_decreasing(arrival_s, ARRIVAL_COLUMN)
        bad = np.flatnonzero(batch_size < 1)
        if bad.size:
            row = int(bad[0])
            raise TraceError(f"batch_size must be >= 1, got {batch_size[row]} at row {row + 1}")
        bad = np.flatnonzero(batch_size > MAX_BATCH_SIZE)
        if bad.size:
            row = int(bad[0])
            raise TraceError(
                f"batch_size must be at most {MAX_BATCH_SIZE:,}, got {batch_size[row]} at row"
                f" {row + 1}"
            )
        if sample_id is not None:
            bad = np.flatnonzero(sample_id < 0)
            if bad.size:
                row = int(bad[0])
                raise TraceError(f"sample_id must be >= 0, got {sample_id[row]} at row {row + 1}")

        object.__setattr__(self, "arrival_s", arrival_s)
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "sample_id", sample_id)

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def duration_s(self) -> float:
        """Last arrival minus first arrival (0 for fewer than two queries)."""
        if self.arrival_s.size < 2:
            return 0.0
        return float(self.arrival_s[-1] - self.arrival_s[0])


# ---------------------------------------------------------------------------------------------
# The CSV file format
# ---------------------------------------------------------------------------------------------


def _read_header(path: Path, text: str) -> tuple[list[str], int]:
    """The stripped column names and the number of physical lines before the first data row."""
    reader = csv.reader(io.StringIO(text, newline=""))
    for header in reader:
        if any(cell.strip() for cell in header):
            return [cell.strip() for cell in header], reader.line_num
    raise TraceError(
        f"trace {path} is empty (expected a CSV header with an {ARRIVAL_COLUMN} column)"
    )


_INT64_MIN = int(np.iinfo(np.int64).min)
_INT64_MAX = int(np.iinfo(np.int64).max)


def _parse_number(text: str, name: str, row: int, kind: type[float] | type[int]) -> float | int:
    stripped = text.strip()
    try:
        if "_" in stripped:  # Python accepts 1_000; numpy (the fast path) and other tools do not
            raise ValueError(stripped)
        value = kind(stripped)
    except ValueError:
        expected = "a number" if kind is float else "an integer"
        raise TraceError(f"row {row}: {name} is {text!r}, expected {expected}") from None
    if kind is int and not _INT64_MIN <= value <= _INT64_MAX:
        # The columns are int64 (as numpy's fast path reads them): a wider one cannot be held.
        bound = f"at most {_INT64_MAX}" if value > 0 else f"at least {_INT64_MIN}"
        raise TraceError(f"row {row}: {name} is {text!r}, expected an integer of {bound}")
    return value


# Every byte but the separator and the line feed, for bytes.translate to delete.
_NOT_SEPARATOR_OR_LINE_FEED = bytes(byte for byte in range(256) if byte not in b",\n")
_WIDTH_CHECK_CHUNK_BYTES = 1 << 20


def _rows_wider_than(data: bytes, skip_lines: int, width: int) -> bool:
    """Whether a data row may hold more than ``width`` fields (the header's), which numpy's
    reader, taking the header's columns, lets by. Checked on the file's bytes in C, not row by
    row: with every byte but separators and line feeds deleted, a row of more than ``width``
    fields is a run of ``width`` separators. A file with a quote character (where a quoted
    field may hold a separator) is left to the row-by-row reader, which decides (as it does on
    a lone carriage-return line end)."""
    kept: list[bytes] = []
    for start in range(0, len(data), _WIDTH_CHECK_CHUNK_BYTES):
        chunk = data[start : start + _WIDTH_CHECK_CHUNK_BYTES]
        if b'"' in chunk:
            return True
        kept.append(chunk.translate(None, _NOT_SEPARATOR_OR_LINE_FEED))
    marks = b"".join(kept)
    start = 0
    for _ in range(skip_lines):  # the header (and any blank lines before it)
        start = marks.find(b"\n", start) + 1
        if start == 0:
            return False
    return marks.find(b"," * width, start) >= 0


def _read_rows_slowly(
    text: str, skip_lines: int, columns: dict[str, int], width: int
) -> tuple[FloatArray, IntArray | None, IntArray | None]:
    """Parse row by row: only used to name the row a fast parse rejected (or to read it);
    a row of more than ``width`` fields (the header's) is refused."""
    arrivals: list[float] = []
    ints: dict[str, list[int]] = {name: [] for name in columns if name != ARRIVAL_COLUMN}
    needed = max(columns.values()) + 1
    reader = csv.reader(io.StringIO(text, newline=""))
    row = 0
    for fields in reader:
        if reader.line_num <= skip_lines:
            continue
        if not any(field.strip() for field in fields):
            continue  # blank lines are not rows (as in the fast path)
        row += 1
        if len(fields) < needed:
            raise TraceError(
                f"row {row} has {len(fields)} field(s), expected at least {needed} "
                f"(line {reader.line_num})"
            )
        if len(fields) > width:
            raise TraceError(
                f"row {row} has {len(fields)} field(s), the header has {width} "
                f"(line {reader.line_num})"
            )
        arrivals.append(
            float(_parse_number(fields[columns[ARRIVAL_COLUMN]], ARRIVAL_COLUMN, row, float))
        )
        for name, values in ints.items():
            values.append(int(_parse_number(fields[columns[name]], name, row, int)))
    batch = np.array(ints[BATCH_COLUMN], dtype=np.int64) if BATCH_COLUMN in ints else None
    sample = np.array(ints[SAMPLE_COLUMN], dtype=np.int64) if SAMPLE_COLUMN in ints else None
    return np.array(arrivals, dtype=np.float64), batch, sample


def read_trace_csv(path: str | Path) -> Trace:
    """Read a trace CSV (DESIGN.md section 4): a header, then one query per row.

    Columns: ``arrival_s`` (required; float seconds from the start, non-decreasing),
    ``batch_size`` (optional; int >= 1, default 1), ``sample_id`` (optional; int >= 0). Other
    columns are ignored (but a row may not have more fields than the header), blank lines are
    skipped, CRLF line ends, quoted fields (``"a,b"``) and a UTF-8 byte-order mark are accepted.
    Rows are numbered from 1 after the header in every error message.

    The file is read once (a pipe such as ``/dev/stdin`` gives its bytes once), then parsed from
    memory: the whole of it by numpy's C reader and its rows' widths are checked on its bytes at
    once; only when either rejects the file (or it has a quote character, where a quoted field
    may hold a separator) is it scanned again row by row, to name the offending row.

    Raises:
        TraceError: the file is empty or has no data rows, ``arrival_s`` is missing, a value is
            not a number (with its row), a row has fewer fields than the columns read or more
            than the header has (with its row and line, e.g. ``row 2 has 3 field(s), the header
            has 2 (line 3)``), arrivals decrease, or a batch size is below 1.
        FileNotFoundError: the file does not exist (left to the caller, as any ``OSError``).
    """
    path = Path(path)
    try:
        return _read_trace_csv(path)
    except UnicodeDecodeError as error:
        raise TraceError(
            f"trace {path} is not UTF-8 text (byte {error.start} cannot be decoded)"
        ) from None
    except csv.Error as error:  # e.g. a cell past the csv module's field size limit
        raise TraceError(f"trace {path}: not a readable CSV ({error})") from None


def _read_trace_csv(path: Path) -> Trace:
    data = path.read_bytes()
    text = data.decode("utf-8-sig")
    header, skip_lines = _read_header(path, text)
    seen: set[str] = set()
    for name in header:
        if name and name in seen:
            raise TraceError(f"trace {path}: column {name!r} appears twice in the header")
        seen.add(name)
    if ARRIVAL_COLUMN not in seen:
        shown = ", ".join(repr(name) for name in header)
        raise TraceError(f"trace {path} has no {ARRIVAL_COLUMN!r} column (header: {shown})")
    columns = {
        name: header.index(name)
        for name in (ARRIVAL_COLUMN, BATCH_COLUMN, SAMPLE_COLUMN)
        if name in seen
    }
    dtype = np.dtype(
        [(name, np.float64 if name == ARRIVAL_COLUMN else np.int64) for name in columns]
    )
    try:
        with warnings.catch_warnings():
            # A header without rows is reported below, in the project's words.
            warnings.filterwarnings("ignore", "loadtxt: input contained no data")
            table = np.loadtxt(
                io.StringIO(text, newline=None),  # universal line ends, as numpy opens a file
                dtype=dtype,
                delimiter=",",
                skiprows=skip_lines,
                usecols=tuple(columns.values()),
                comments=None,
                quotechar='"',
                ndmin=1,
            )
        arrival_s: FloatArray = np.ascontiguousarray(table[ARRIVAL_COLUMN])
        batch: IntArray | None = (
            np.ascontiguousarray(table[BATCH_COLUMN]) if BATCH_COLUMN in columns else None
        )
        sample: IntArray | None = (
            np.ascontiguousarray(table[SAMPLE_COLUMN]) if SAMPLE_COLUMN in columns else None
        )
    except ValueError:
        arrival_s, batch, sample = _read_rows_slowly(text, skip_lines, columns, len(header))
    else:
        if _rows_wider_than(data, skip_lines, len(header)):
            _read_rows_slowly(text, skip_lines, columns, len(header))  # names the row
    if arrival_s.size == 0:
        raise TraceError(f"trace {path} has a header but no data rows")
    if batch is None:
        batch = np.ones(arrival_s.size, dtype=np.int64)
    try:
        return Trace(arrival_s, batch, sample)
    except TraceError as error:  # a value out of range (the row is the data row's number)
        raise TraceError(f"trace {path}: {error}") from None


def write_trace_csv(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as CSV: ``arrival_s`` (shortest repr, so it round-trips exactly),
    ``batch_size``, and ``sample_id`` when the trace has one.

    A file is written under a temporary name beside it and renamed once whole: an interrupted
    write (a day of arrivals takes minutes) left a shorter trace under the name that read as a
    valid one. Anything but a regular file (``/dev/stdout``) is written to directly."""
    columns: list[Iterable[Any]] = [trace.arrival_s.tolist(), trace.batch_size.tolist()]
    header = [ARRIVAL_COLUMN, BATCH_COLUMN]
    if trace.sample_id is not None:
        columns.append(trace.sample_id.tolist())
        header.append(SAMPLE_COLUMN)
    target = Path(path)
    direct = target.exists() and not target.is_file()
    written = target if direct else target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        try:
            opened = written.open("w", encoding="utf-8", newline="")
        except OSError as error:  # named as the caller named it, not by the temporary name
            raise type(error)(error.errno, error.strerror, str(target)) from None
        with opened as handle:
            handle.write(",".join(header) + "\n")
            # repr(float) is the shortest string that parses back to the same double.
            handle.writelines(",".join(map(repr, row)) + "\n" for row in zip(*columns, strict=True))
        if not direct:
            written.replace(target)
    finally:
        if not direct:
            written.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What a trace looks like to the planner: its size, rate, burstiness and batch sizes."""

    count: int
    duration_s: float
    rate_qps: float
    cv2: float
    mean_batch_size: float
    max_batch_size: int


def trace_stats(trace: Trace) -> TraceStats:
    """Summary statistics of ``trace``.

    ``rate_qps = (count - 1) / duration_s`` (0 when the duration is 0), and ``cv2`` is the squared
    coefficient of variation of the inter-arrival times, CV_A^2 = sigma^2 / mu^2 (InferLine,
    "Random and Unpredictable Workloads"; population variance; 0 with fewer than two gaps or a
    zero mean gap). Poisson arrivals have cv2 = 1; burstier processes have more.

    Raises:
        TraceError: a span so short (a few subnormal seconds) that the rate is past the largest
            float.
    """
    count = len(trace)
    duration_s = trace.duration_s
    rate_qps = (count - 1) / duration_s if duration_s > 0.0 else 0.0
    if not math.isfinite(rate_qps):
        raise TraceError(
            f"arrival_s spans {duration_s!r} s over {count} rows: too short for a finite rate"
        )
    cv2 = 0.0
    if count >= 3:
        gaps_s = np.diff(trace.arrival_s)
        # The mean gap from the span, not a sum of the gaps (which may pass the largest float);
        # the variance of the gaps in units of it, not sigma^2 / mu^2, whose square overflows
        # (gaps of 1e200 s) or underflows to 0 (gaps of 1e-200 s).
        mean_gap_s = duration_s / (count - 1)
        if mean_gap_s > 0.0:
            cv2 = float((gaps_s / mean_gap_s).var())
    return TraceStats(
        count=count,
        duration_s=duration_s,
        rate_qps=rate_qps,
        cv2=cv2,
        mean_batch_size=float(trace.batch_size.mean()) if count else 0.0,
        max_batch_size=int(trace.batch_size.max()) if count else 0,
    )


# ---------------------------------------------------------------------------------------------
# Rate profiles
# ---------------------------------------------------------------------------------------------


def _finite(value: float, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise WorkloadError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise WorkloadError(f"{name} must be finite, got {number!r}")
    return number


def _positive(value: float, name: str) -> float:
    number = _finite(value, name)
    if number <= 0.0:
        raise WorkloadError(f"{name} must be > 0, got {number!r}")
    return number


def _non_negative(value: float, name: str) -> float:
    number = _finite(value, name)
    if number < 0.0:
        raise WorkloadError(f"{name} must be >= 0, got {number!r}")
    return number


@dataclass(frozen=True, slots=True, eq=False)
class RateProfile:
    """A piecewise-linear arrival rate lambda(t) in queries per second.

    ``rates_qps[i]`` is the rate at ``times_s[i]``; the rate is linear between knots and constant
    after the last one. ``times_s`` starts at 0 and is non-decreasing: a time repeated twice marks
    a jump (a step, or a spike's sharp edge), and the rate is right-continuous there. Rates are
    finite and >= 0; a stretch of rate 0 has no arrivals.

    >>> profile = RateProfile(np.array([0.0, 10.0]), np.array([0.0, 2.0]))
    >>> profile.rate_at(5.0), profile.cumulative(10.0), profile.cumulative(11.0)
    (1.0, 10.0, 12.0)
    """

    times_s: FloatArray
    rates_qps: FloatArray

    def __post_init__(self) -> None:
        times_s = np.asarray(self.times_s, dtype=np.float64)
        rates_qps = np.asarray(self.rates_qps, dtype=np.float64)
        if times_s.ndim != 1 or times_s.size == 0:
            raise WorkloadError(
                f"a rate profile needs at least one knot, got shape {times_s.shape}"
            )
        if rates_qps.shape != times_s.shape:
            raise WorkloadError(
                f"a rate profile has {times_s.size} times but {rates_qps.size} rates"
            )
        if not (np.all(np.isfinite(times_s)) and np.all(np.isfinite(rates_qps))):
            raise WorkloadError("a rate profile's times and rates must be finite")
        if times_s[0] != 0.0:
            raise WorkloadError(f"a rate profile starts at time 0, got {times_s[0].item()!r}")
        check_non_decreasing(times_s, "rate profile time", WorkloadError, position="knot")
        bad = np.flatnonzero(rates_qps < 0.0)
        if bad.size:
            k = int(bad[0])
            raise WorkloadError(
                f"rate profile rate must be >= 0, got {rates_qps[k].item()!r} at knot {k}"
            )
        object.__setattr__(self, "times_s", _frozen_copy(times_s, np.float64))
        object.__setattr__(self, "rates_qps", _frozen_copy(rates_qps, np.float64))

    # The derived arrays are cheap (a few knots) and recomputed on use, keeping the object a plain
    # value with two fields.
    def _pieces(self) -> tuple[FloatArray, FloatArray]:
        """Rise and length of the linear piece starting at each knot; the piece after the last
        knot rises 0 over an infinite length. Working with rise/length fractions rather than
        slopes keeps near-vertical pieces (knots a hair apart) free of overflow."""
        rise = np.append(np.diff(self.rates_qps), 0.0)
        length = np.append(np.diff(self.times_s), np.inf)
        return rise, length

    def _piece_value(self, k: IntArray, t: FloatArray) -> FloatArray:
        """The rate of linear piece ``k`` at ``t`` (``t`` within or at the end of the piece)."""
        rise, length = self._pieces()
        fraction = np.zeros(np.broadcast(k, t).shape)
        np.divide(t - self.times_s[k], length[k], out=fraction, where=length[k] > 0.0)
        value: FloatArray = self.rates_qps[k] + rise[k] * fraction
        return value

    def _knot_cumulative(self) -> FloatArray:
        """Lambda(times_s[i]): the trapezoid rule, exact for linear pieces."""
        pieces = 0.5 * (self.rates_qps[:-1] + self.rates_qps[1:]) * np.diff(self.times_s)
        return np.concatenate(([0.0], np.cumsum(pieces)))

    def _segment(self, t_s: FloatArray) -> IntArray:
        # side="right" picks the last of repeated knots: the rate after a jump.
        index: IntArray = np.searchsorted(self.times_s, t_s, side="right") - 1
        return np.clip(index, 0, None)

    @overload
    def rate_at(self, t_s: float) -> float: ...
    @overload
    def rate_at(self, t_s: FloatArray) -> FloatArray: ...
    def rate_at(self, t_s: FloatArray | float) -> FloatArray | float:
        """lambda(t) for t >= 0: linear between knots, right-continuous at jumps, constant after
        the last knot."""
        t = np.asarray(t_s, dtype=np.float64)
        rate = np.maximum(self._piece_value(self._segment(t), t), 0.0)
        return float(rate) if np.ndim(t_s) == 0 else rate

    @overload
    def cumulative(self, t_s: float) -> float: ...
    @overload
    def cumulative(self, t_s: FloatArray) -> FloatArray: ...
    def cumulative(self, t_s: FloatArray | float) -> FloatArray | float:
        """Lambda(t) = integral of lambda from 0 to t (t >= 0): the expected arrivals by t.

        On the piece from knot k, Lambda(t) = Lambda(t_k) + (t - t_k) (r_k + lambda(t)) / 2.
        """
        t = np.asarray(t_s, dtype=np.float64)
        k = self._segment(t)
        # A rate near the largest float overflows to inf: the count check after says so in one
        # line (no RuntimeWarning printed before it).
        with np.errstate(over="ignore"):
            value = self._knot_cumulative()[k] + 0.5 * (t - self.times_s[k]) * (
                self.rates_qps[k] + self._piece_value(k, t)
            )
        return float(value) if np.ndim(t_s) == 0 else value

    def inverse_cumulative(self, expected: FloatArray) -> FloatArray:
        """Lambda^{-1}: the first time by which ``expected`` arrivals are expected (vectorised).

        Stretches of rate 0 are flat in Lambda and are jumped over; a value beyond what the
        profile ever reaches (rate 0 after the last knot) maps to +inf.
        """
        y_total = np.asarray(expected, dtype=np.float64)
        knots = self._knot_cumulative()
        # side="right" picks the last knot of a flat (rate 0) stretch, where arrivals resume.
        k = np.clip(np.searchsorted(knots, y_total, side="right") - 1, 0, None)
        y = np.maximum(y_total - knots[k], 0.0)
        rise, length = self._pieces()
        r, rise, length = self.rates_qps[k], rise[k], length[k]
        # Solve r*dt + (rise/length)*dt^2/2 = y for dt in [0, length]: dt = y/r on a flat piece,
        # sqrt(2 y length / rise) on a ramp up from 0, else 2y / (r + sqrt(r^2 + 2 rise y /
        # length)), the form without cancellation; the discriminant is clipped against rounding
        # on a piece ramping down to 0, and dt is clipped to the piece so that rounding cannot
        # reorder arrivals across knots. _inverse_cumulative_sorted repeats these steps piece by
        # piece: keep the two in step (tests/unit/test_fast_readers.py compares them bit for bit).
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            growth = 2.0 * rise * (y / length)
            general = 2.0 * y / (r + np.sqrt(np.maximum(r * r + growth, 0.0)))
            from_zero = np.sqrt(2.0 * y * (length / rise))
            dt = np.where(rise == 0.0, y / r, np.where(r == 0.0, from_zero, general))
            dt = np.minimum(np.where(y > 0.0, dt, 0.0), length)
        dt = np.where(np.isnan(dt), np.inf, dt)
        result: FloatArray = self.times_s[k] + dt
        return result

    def _inverse_cumulative_sorted(self, expected: FloatArray) -> FloatArray:
        """:meth:`inverse_cumulative` of ``expected`` sorted ascending (no NaN), bit for bit, a
        piece at a time: each piece's values are a contiguous run, found by one search per knot
        rather than one per value, and only the piece's own branch of the solution is computed
        (about 3x faster on a million arrivals, benchmarks/profile_load.py)."""
        knots = self._knot_cumulative()
        # Values from knots[k] up to the next knot fall on piece k (the last of equal knots, as
        # side="right" picks above); values below the first knot fall on piece 0.
        bounds = np.append(np.searchsorted(expected, knots, side="left"), expected.size)
        bounds[0] = 0
        rise_all, length_all = self._pieces()
        result: FloatArray = np.empty(expected.size, dtype=np.float64)
        for k in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            y = np.maximum(expected[lo:hi] - knots[k], 0.0)
            r, rise, length = self.rates_qps[k], rise_all[k], length_all[k]
            with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
                if rise == 0.0 and r > 0.0:
                    # The common piece, in fewer passes: y / r is never NaN here, and the
                    # values y <= 0 that get dt = 0 below are a prefix of the run.
                    dt = y / r
                    dt[: np.searchsorted(y, 0.0, side="right")] = 0.0
                    if length != np.inf:
                        dt = np.minimum(dt, length)
                else:
                    if rise == 0.0:
                        dt = y / r
                    elif r == 0.0:
                        dt = np.sqrt(2.0 * y * (length / rise))
                    else:
                        growth = 2.0 * rise * (y / length)
                        dt = 2.0 * y / (r + np.sqrt(np.maximum(r * r + growth, 0.0)))
                    dt = np.minimum(np.where(y > 0.0, dt, 0.0), length)
                    dt = np.where(np.isnan(dt), np.inf, dt)
            result[lo:hi] = self.times_s[k] + dt
        return result


def constant_profile(rate_qps: float) -> RateProfile:
    """A constant rate; ``rate_qps`` must be > 0 (WorkloadError otherwise)."""
    return RateProfile(np.array([0.0]), np.array([_positive(rate_qps, "rate_qps")]))


def step_profile(
    rate_from_qps: float, rate_to_qps: float, at_s: float, over_s: float = 0.0
) -> RateProfile:
    """A rate that changes from ``rate_from_qps`` to ``rate_to_qps`` at ``at_s``: a step when
    ``over_s`` is 0, else a linear ramp over tau = ``over_s`` seconds (InferLine's tuner
    sensitivity experiments ramp from 150 to 250 qps over several tau, Figures 11-12).

    Either rate may be 0, but not both (their mean must be > 0).
    """
    rate_from_qps = _non_negative(rate_from_qps, "rate_from_qps")
    rate_to_qps = _non_negative(rate_to_qps, "rate_to_qps")
    if rate_from_qps + rate_to_qps <= 0.0:
        raise WorkloadError("a step or ramp needs a mean rate > 0, got 0 qps on both sides")
    at_s = _non_negative(at_s, "at_s")
    over_s = _non_negative(over_s, "over_s")
    times_s = [0.0, at_s, at_s + over_s]
    rates_qps = [rate_from_qps, rate_from_qps, rate_to_qps]
    return RateProfile(np.array(times_s), np.array(rates_qps))


def _validate_spikes(spikes: Iterable[Sequence[float]]) -> list[tuple[float, float, float]]:
    checked = []
    for index, spike in enumerate(spikes):
        try:
            start_s, length_s, factor = spike
        except (TypeError, ValueError):
            raise WorkloadError(
                f"spike {index + 1} must be (start_s, length_s, factor), got {spike!r}"
            ) from None
        checked.append(
            (
                _non_negative(start_s, f"spike {index + 1} start_s"),
                _positive(length_s, f"spike {index + 1} length_s"),
                _non_negative(factor, f"spike {index + 1} factor"),
            )
        )
    return checked


def with_spikes(profile: RateProfile, spikes: Iterable[Sequence[float]]) -> RateProfile:
    """``profile`` with its rate multiplied by ``factor`` on each window [start_s, start_s +
    length_s) of ``spikes`` (sharp edges; overlapping spikes multiply). A factor of 0 is an outage.
    """
    checked = _validate_spikes(spikes)
    if not checked:
        return profile
    base_times = profile.times_s
    edges = [edge for start_s, length_s, _ in checked for edge in (start_s, start_s + length_s)]
    breaks = np.unique(np.concatenate((base_times, edges)))
    times: list[float] = []
    rates: list[float] = []
    for left, right in itertools.pairwise(breaks):
        # On [left, right) the base rate is one linear piece: the one starting at the base knot
        # at or before ``left`` (base jumps are all at breaks).
        k = profile._segment(np.array(left))
        rate_left, rate_right = profile._piece_value(k, np.array([left, right]))
        factor = math.prod(f for s, n, f in checked if s <= left and right <= s + n)
        times += [float(left), float(right)]
        rates += [max(rate_left * factor, 0.0), max(rate_right * factor, 0.0)]
    times.append(float(breaks[-1]))
    rates.append(float(profile.rate_at(float(breaks[-1]))))  # no spike reaches past the last edge
    return RateProfile(*_drop_redundant_knots(np.array(times), np.array(rates)))


def _drop_redundant_knots(
    times_s: FloatArray, rates_qps: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Remove a knot repeating the previous knot's time and rate (a jump of size 0)."""
    keep = np.ones(times_s.size, dtype=bool)
    keep[1:] = (np.diff(times_s) != 0.0) | (np.diff(rates_qps) != 0.0)
    return times_s[keep], rates_qps[keep]


def diurnal_profile(
    mean_rate_qps: float,
    duration_s: float,
    period_s: float = 86400.0,
    amplitude: float = 0.5,
    spikes: Iterable[Sequence[float]] = (),
) -> RateProfile:
    """A day-like rate lambda(t) = mean * (1 - amplitude * cos(2 pi t / period)), lowest at t = 0
    and highest half a period later, sampled at 96 knots per period as a piecewise-linear profile
    over [0, duration_s], then multiplied by ``spikes`` (``(start_s, length_s, factor)`` each).
    """
    mean_rate_qps = _positive(mean_rate_qps, "mean_rate_qps")
    duration_s = _positive(duration_s, "duration_s")
    period_s = _positive(period_s, "period_s")
    amplitude = _finite(amplitude, "amplitude")
    if not 0.0 <= amplitude <= 1.0:
        raise WorkloadError(f"amplitude must be in [0, 1], got {amplitude!r}")
    periods = duration_s / period_s
    if periods * DIURNAL_KNOTS_PER_PERIOD > MAX_DIURNAL_KNOTS:
        raise WorkloadError(
            f"period_s {period_s:g} over duration_s {duration_s:g} is {periods:.4g} periods;"
            f" at most {MAX_DIURNAL_KNOTS // DIURNAL_KNOTS_PER_PERIOD:,} (each is"
            f" {DIURNAL_KNOTS_PER_PERIOD} knots of the profile): a longer period or a shorter"
            " duration"
        )
    knots = max(2, math.ceil(periods * DIURNAL_KNOTS_PER_PERIOD) + 1)
    times_s = np.linspace(0.0, duration_s, knots)
    rates_qps = mean_rate_qps * (1.0 - amplitude * np.cos(2.0 * np.pi * times_s / period_s))
    return with_spikes(RateProfile(times_s, np.maximum(rates_qps, 0.0)), spikes)


# ---------------------------------------------------------------------------------------------
# Arrival processes
# ---------------------------------------------------------------------------------------------


def _unit_gaps(n: int, cv2: float, rng: np.random.Generator) -> FloatArray:
    if cv2 == 1.0:
        return rng.exponential(1.0, size=n)
    return rng.gamma(1.0 / cv2, cv2, size=n)  # shape k = 1/CV^2, scale theta = CV^2: mean 1


def renewal_arrivals(
    profile: RateProfile, duration_s: float, cv2: float, rng: np.random.Generator
) -> FloatArray:
    """Arrival times in [0, duration_s) of a renewal process modulated by ``profile``.

    A unit-rate renewal process with i.i.d. gaps of mean 1 and squared coefficient of variation
    ``cv2`` (exponential when cv2 = 1, else gamma with shape 1/cv2 and scale cv2) has points
    S_1 < S_2 < ...; the arrivals are t_i = Lambda^{-1}(S_i), where Lambda is the profile's
    integrated rate. By the time-rescaling theorem this is exactly a non-homogeneous Poisson
    process of rate lambda(t) when cv2 = 1 (Brown et al., Neural Computation 14(2), 2002); for
    other cv2 it is a renewal process of rate lambda whose local burstiness is cv2 (InferLine's
    gamma arrival processes when the rate is constant). Stretches of rate 0 have no
    arrivals. The process starts fresh at 0 (the first gap is a full gap).

    >>> rng = np.random.default_rng(0)
    >>> arrivals = renewal_arrivals(constant_profile(100.0), 10.0, 1.0, rng)
    >>> bool(900 < arrivals.size < 1100 and arrivals[-1] < 10.0)
    True
    """
    duration_s = _positive(duration_s, "duration_s")
    cv2 = _positive(cv2, "cv2")
    if cv2 > MAX_CV2:
        raise WorkloadError(
            f"cv2 must be <= {MAX_CV2:g}, got {cv2:g}: gamma gaps that bursty are mostly 0 and a"
            " few huge ones, not a trace at the asked rate"
        )
    expected_total = float(profile.cumulative(duration_s))
    if expected_total > MAX_GENERATED_ARRIVALS:
        raise WorkloadError(
            f"the workload would have about {expected_total:.3g} arrivals, more than the "
            f"{MAX_GENERATED_ARRIVALS:.3g} allowed (check the units of the rate and the duration)"
        )
    if expected_total <= 0.0:
        return np.empty(0, dtype=np.float64)
    # Draw enough gaps to pass expected_total with high probability (6 standard deviations of the
    # count), then top up in the rare case the sum falls short.
    spread = 6.0 * math.sqrt(expected_total * max(cv2, 1.0))
    chunks = [np.cumsum(_unit_gaps(int(expected_total + spread) + 16, cv2, rng))]
    while chunks[-1][-1] < expected_total:
        more = int(expected_total - chunks[-1][-1] + spread) + 16
        chunks.append(chunks[-1][-1] + np.cumsum(_unit_gaps(more, cv2, rng)))
    points = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    points = points[points < expected_total]
    # The points increase (a cumulative sum of gaps >= 0), so the sorted inversion applies.
    arrival_s = profile._inverse_cumulative_sorted(points)
    # Rounding in the inversion must neither reorder arrivals nor push one past the end.
    arrival_s = np.maximum.accumulate(np.maximum(arrival_s, 0.0))
    result: FloatArray = arrival_s[arrival_s < duration_s]
    return result


def poisson_arrivals(rate_qps: float, duration_s: float, rng: np.random.Generator) -> FloatArray:
    """Poisson arrivals at ``rate_qps`` in [0, duration_s): exponential gaps (CV^2 = 1)."""
    return renewal_arrivals(constant_profile(rate_qps), duration_s, 1.0, rng)


def gamma_arrivals(
    rate_qps: float, cv2: float, duration_s: float, rng: np.random.Generator
) -> FloatArray:
    """Gamma renewal arrivals at ``rate_qps`` with squared coefficient of variation ``cv2``:
    gaps with shape 1/cv2 and mean 1/rate (the bursty arrival processes of InferLine's
    evaluation; cv2 = 1 is Poisson)."""
    return renewal_arrivals(constant_profile(rate_qps), duration_s, cv2, rng)
