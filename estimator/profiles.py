"""Latency profiles: per (model, instance type, batch size), the measured service-time samples.

Two file formats are read (DESIGN.md section 4): the Kairos samples CSV (columns model,
instance_type, batch_size, sample, infer_ms, load_ms; a query's service time is
infer_ms + load_ms, and the single largest sample of each cell is dropped, as the Kairos authors
do, because the first run of a cell is a warm-up outlier) and the project's own profile JSON
(:func:`write_profiles_json`).

Between measured batch sizes the latency is interpolated linearly, quantile by quantile (so a
drawn service time for batch 15 mixes the same quantile of the 10 and 20 cells); outside the
measured range the profile refuses with :class:`BatchSizeOutOfRangeError`.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from estimator.batches import MAX_BATCH_SIZE
from estimator.documents import DuplicateKeyError, loads_json
from estimator.errors import (
    BatchSizeOutOfRangeError,
    MissingProfileError,
    ProfileError,
    UnknownModelError,
)

PROFILE_FORMAT = "heteroplane.profiles/v1"
KAIROS_COLUMNS = ("model", "instance_type", "batch_size", "sample", "infer_ms", "load_ms")

ServiceMode = Literal["sampled", "mean"]

# The longest latency a profile may hold: a day. Past it a figure is not a measurement, and the
# costs and rates computed from one overflowed (1e308 ms printed an infinite cost, a 300-digit
# error message).
MAX_LATENCY_MS = 86_400_000.0


def _read_only(array: np.ndarray) -> np.ndarray:
    """``array``, made read-only (a kept table that a caller changed would change every
    later answer)."""
    array.flags.writeable = False
    return array


@dataclass(frozen=True, slots=True, eq=False)
class LatencyProfile:
    """Measured latency of one model on one instance type, by batch size.

    ``samples_ms[i]`` holds the samples (sorted ascending) measured at ``batch_sizes[i]``.
    """

    model: str
    instance_type: str
    batch_sizes: np.ndarray
    samples_ms: tuple[np.ndarray, ...]
    # Derived once: latency lookups run per query in planners and policies.
    _mean_ms: np.ndarray = field(init=False, repr=False)
    # The quantile tables, each computed on first use and kept (read-only): every simulation
    # and every Kairos policy factory asks for the same ones, and a capacity search runs many.
    _tables: dict[tuple[str, float], np.ndarray] = field(
        init=False, repr=False, default_factory=dict
    )

    def __getstate__(self) -> list[Any]:
        """The fields for pickling and copying, without the kept tables (read-only here, they
        would come back writable): a copy makes its own."""
        return [{} if f.name == "_tables" else getattr(self, f.name) for f in fields(self)]

    def __post_init__(self) -> None:
        where = f"profile of {self.model!r} on {self.instance_type!r}"
        try:
            sizes = np.ascontiguousarray(self.batch_sizes, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise ProfileError(
                f"{where}: batch sizes must be whole numbers in 1..{MAX_BATCH_SIZE:,}"
            ) from None
        if sizes.ndim != 1 or sizes.size == 0:
            raise ProfileError(f"{where} has no batch sizes")
        if sizes[0] < 1 or np.any(np.diff(sizes) <= 0):
            raise ProfileError(f"{where}: batch sizes must be >= 1 and strictly increasing")
        if sizes[-1] > MAX_BATCH_SIZE:
            raise ProfileError(
                f"{where}: batch size {int(sizes[-1])} is past the largest, {MAX_BATCH_SIZE:,}"
            )
        if len(self.samples_ms) != sizes.size:
            raise ProfileError(f"{where}: one sample list per batch size is needed")
        cells = []
        for size, samples in zip(sizes, self.samples_ms, strict=True):
            cell = np.sort(np.asarray(samples, dtype=np.float64).ravel())
            if cell.size == 0:
                raise ProfileError(f"{where}: no samples at batch size {size}")
            if not np.all(np.isfinite(cell)) or cell[0] < 0:
                raise ProfileError(f"{where}: latencies at batch size {size} must be finite, >= 0")
            if cell[-1] > MAX_LATENCY_MS:
                raise ProfileError(
                    f"{where}: latencies at batch size {size} must be at most"
                    f" {MAX_LATENCY_MS:,.0f} ms (a day), got {cell[-1]:.6g}"
                )
            if cell[-1] <= 0:
                # A batch that takes no time has no throughput to bound or search for (the
                # capacity search and the bounds divided by it: a traceback, an infinite bound).
                raise ProfileError(f"{where}: latencies at batch size {size} are all 0")
            cells.append(cell)
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "samples_ms", tuple(cells))
        means = np.array([cell.mean() for cell in cells])
        means.flags.writeable = False
        object.__setattr__(self, "_mean_ms", means)

    @property
    def min_batch_size(self) -> int:
        return int(self.batch_sizes[0])

    @property
    def max_batch_size(self) -> int:
        return int(self.batch_sizes[-1])

    @property
    def mean_ms(self) -> np.ndarray:
        """Mean latency at each measured batch size."""
        return self._mean_ms

    @property
    def p99_ms(self) -> np.ndarray:
        """99th percentile latency at each measured batch size."""
        return np.array([np.percentile(cell, 99) for cell in self.samples_ms])

    def check_batch_size(self, batch_size: int) -> None:
        if not self.min_batch_size <= batch_size <= self.max_batch_size:
            raise BatchSizeOutOfRangeError(
                self.model,
                self.instance_type,
                int(batch_size),
                self.min_batch_size,
                self.max_batch_size,
            )

    def mean_latency_ms(self, batch_size: int) -> float:
        """Mean latency at ``batch_size``, linear between measured batch sizes."""
        self.check_batch_size(batch_size)
        return float(np.interp(batch_size, self.batch_sizes, self.mean_ms))

    def mean_latencies_ms(self, batch_sizes: np.ndarray) -> np.ndarray:
        """Mean latency at each of ``batch_sizes`` (vectorised :meth:`mean_latency_ms`)."""
        sizes = np.asarray(batch_sizes)
        if sizes.size:
            self.check_batch_size(int(sizes.min()))
            self.check_batch_size(int(sizes.max()))
        means: np.ndarray = np.interp(sizes, self.batch_sizes, self._mean_ms)
        return means

    def rate_qps(self, batch_sizes: np.ndarray) -> float:
        """Queries per second one instance serves when each query of the mix ``batch_sizes``
        runs alone: 1000 / E_q[L(b_q)] with L the mean latency (Kairos' Q_t, KAIROS_MATH.md,
        on an empirical mix)."""
        mean_ms = float(self.mean_latencies_ms(batch_sizes).mean())
        return 1000.0 / mean_ms if mean_ms > 0 else math.inf

    def quantile_table_ms(self, n_points: int) -> np.ndarray:
        """Service-time quantiles on a dense batch-size axis.

        Row ``b - min_batch_size`` holds ``n_points`` values: column ``k`` is the sample of rank
        ``floor(k n / n_points)`` of the cell (n samples), so a uniform ``u`` in [0, 1) draws
        column ``floor(u n_points)`` and reproduces the cell's empirical distribution exactly
        when ``n_points`` is a multiple of n. Between measured sizes, rows interpolate linearly.
        """
        if n_points < 1:
            raise ValueError("n_points must be >= 1")
        return self._kept(("table", float(n_points)), lambda: self._quantile_table_ms(n_points))

    def _kept(self, key: tuple[str, float], make: Callable[[], np.ndarray]) -> np.ndarray:
        """The table ``key`` names, made by ``make`` on first use and kept read-only."""
        known = self._tables.get(key)
        if known is None:
            known = self._tables[key] = _read_only(make())
        return known

    def _quantile_table_ms(self, n_points: int) -> np.ndarray:
        k = np.arange(n_points)
        at_measured = np.stack(
            [cell[(k * cell.size) // n_points] for cell in self.samples_ms]
        )  # (n_sizes, n_points)
        dense = np.arange(self.min_batch_size, self.max_batch_size + 1)
        if self.batch_sizes.size == 1:
            return at_measured.copy()
        upper = np.clip(np.searchsorted(self.batch_sizes, dense), 1, self.batch_sizes.size - 1)
        lower = upper - 1
        span = (self.batch_sizes[upper] - self.batch_sizes[lower]).astype(np.float64)
        weight = ((dense - self.batch_sizes[lower]) / span)[:, None]
        dense_ms: np.ndarray = (1.0 - weight) * at_measured[lower] + weight * at_measured[upper]
        return dense_ms

    def mean_by_batch_ms(self) -> np.ndarray:
        """Mean latency indexed by batch size itself: entry ``b`` for b in 0..max (NaN below the
        smallest measured size), for policies that look latencies up by batch size."""
        table = np.full(self.max_batch_size + 1, np.nan)
        table[self.min_batch_size :] = self.mean_table_ms()[:, 0]
        return table

    def quantile_by_batch_ms(self, quantile: float) -> np.ndarray:
        """The ``quantile`` (in [0, 1]; 0.99 for the p99) of the service time indexed by batch
        size itself, like :meth:`mean_by_batch_ms`: entry ``b`` for b in 0..max (NaN below the
        smallest measured size). At a measured size it is the cell's quantile (``np.quantile``,
        linear between order statistics, as :attr:`p99_ms`); between measured sizes it is linear
        in b, as :meth:`draw_ms` mixes the same quantile of both cells.
        """
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile!r}")
        return self._kept(
            ("by_batch", float(quantile)), lambda: self._quantile_by_batch_ms(quantile)
        )

    def _quantile_by_batch_ms(self, quantile: float) -> np.ndarray:
        at_measured = np.array([np.quantile(cell, quantile) for cell in self.samples_ms])
        dense = np.arange(self.min_batch_size, self.max_batch_size + 1)
        table = np.full(self.max_batch_size + 1, np.nan)
        table[self.min_batch_size :] = np.interp(dense, self.batch_sizes, at_measured)
        return table

    def mean_table_ms(self) -> np.ndarray:
        """Mean latency on a dense batch-size axis from ``min_batch_size`` (one column)."""
        dense = np.arange(self.min_batch_size, self.max_batch_size + 1)
        means: np.ndarray = np.interp(dense, self.batch_sizes, self.mean_ms)
        return means[:, None]

    def draw_ms(
        self, batch_size: int, rng: np.random.Generator, mode: ServiceMode = "sampled"
    ) -> float:
        """One service time at ``batch_size``: a quantile-interpolated sample, or the mean."""
        self.check_batch_size(batch_size)
        if mode == "mean":
            return self.mean_latency_ms(batch_size)
        u = rng.random()
        i = int(np.searchsorted(self.batch_sizes, batch_size))
        upper = self.samples_ms[i]
        upper_ms = float(upper[int(u * upper.size)])
        if self.batch_sizes[i] == batch_size:
            return upper_ms
        lower = self.samples_ms[i - 1]
        lower_ms = float(lower[int(u * lower.size)])
        weight = (batch_size - self.batch_sizes[i - 1]) / (
            self.batch_sizes[i] - self.batch_sizes[i - 1]
        )
        return float((1.0 - weight) * lower_ms + weight * upper_ms)


class ProfileSet(Mapping[tuple[str, str], LatencyProfile]):
    """Profiles keyed by (model, instance type)."""

    def __init__(self, profiles: Iterable[LatencyProfile], source: str = "") -> None:
        self._profiles: dict[tuple[str, str], LatencyProfile] = {}
        for profile in profiles:
            key = (profile.model, profile.instance_type)
            if key in self._profiles:
                raise ProfileError(
                    f"two profiles for {profile.model!r} on {profile.instance_type!r}"
                )
            self._profiles[key] = profile
        self.source = source

    def __getitem__(self, key: tuple[str, str]) -> LatencyProfile:
        return self._profiles[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._profiles)

    def __len__(self) -> int:
        return len(self._profiles)

    @property
    def models(self) -> list[str]:
        return sorted({model for model, _ in self._profiles})

    def instance_types(self, model: str) -> list[str]:
        self._check_model(model)
        return sorted(t for m, t in self._profiles if m == model)

    def get_profile(self, model: str, instance_type: str) -> LatencyProfile:
        self._check_model(model)
        try:
            return self._profiles[(model, instance_type)]
        except KeyError:
            raise MissingProfileError(model, instance_type) from None

    def _check_model(self, model: str) -> None:
        if not any(m == model for m, _ in self._profiles):
            raise UnknownModelError(model, self.models)


def load_profiles(path: str | Path) -> ProfileSet:
    """Read a Kairos samples CSV (``.csv`` or ``.csv.gz``) or a profile JSON, by content."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise ProfileError(f"{path}: not a readable gzip file ({error})") from None
    try:
        text = raw.decode("utf-8-sig")  # a spreadsheet's byte order mark is no column name
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a text file (expected CSV or JSON)") from None
    if text.lstrip()[:1] in ("{", "["):  # a CSV's header starts with a column name
        return _parse_profiles_json(text, str(path))
    return _parse_kairos_csv(text, str(path))


@dataclass(frozen=True, slots=True)
class _KairosColumns:
    """The columns of a Kairos samples CSV that profiles need, one entry per data row.

    The model and instance type columns are codes: ``model_names[model_code[i]]`` is row i's
    model, and the names are sorted (as ``np.unique`` sorts them), so sorting by code sorts by
    name.
    """

    model_code: np.ndarray
    model_names: np.ndarray
    type_code: np.ndarray
    type_names: np.ndarray
    batch_size: np.ndarray
    infer_ms: np.ndarray
    load_ms: np.ndarray


def _parse_kairos_csv(text: str, where: str, drop_largest: bool = True) -> ProfileSet:
    """Profiles from the text of a Kairos samples CSV.

    The columns are read by :func:`_read_kairos_columns_fast` (vectorised, about 10x faster on
    the 200,000-row shared file); any file it does not vouch for (quotes, blank lines, a ragged
    row, a value that is not a number, ...) is read again by :func:`_read_kairos_columns`, the
    ``csv`` module reader, which names the offending line. Both give the same columns, so a file
    gives the same profiles and the same errors either way (tests/unit/test_fast_readers.py).
    """
    columns = _read_kairos_columns_fast(text)
    if columns is None:
        columns = _read_kairos_columns(text, where)
    return _group_kairos_columns(columns, where, drop_largest)


def _read_kairos_columns(text: str, where: str) -> _KairosColumns:
    """The reference reader: the ``csv`` module, row by row, with the file's errors."""
    try:
        return _read_kairos_rows(csv.reader(io.StringIO(text)), where)
    except csv.Error as error:  # e.g. a cell past the csv module's field size limit
        raise ProfileError(f"{where}: not a readable CSV ({error})") from None


def _read_kairos_rows(reader: Iterator[list[str]], where: str) -> _KairosColumns:
    header = next(reader, None)
    if header is None:
        raise ProfileError(f"{where}: empty file")
    header = [name.strip() for name in header]
    missing = [name for name in KAIROS_COLUMNS if name not in header]
    if missing:
        raise ProfileError(
            f"{where}: not a Kairos samples CSV, missing column(s) {', '.join(missing)}"
        )
    rows = list(reader)
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # blank lines at the end end no row (as in a trace); the rest keep their lines
    if not rows:
        raise ProfileError(f"{where}: no data rows")
    index = {name: header.index(name) for name in KAIROS_COLUMNS}
    width = len(header)
    for number, row in enumerate(rows, start=2):
        if len(row) != width:
            raise ProfileError(f"{where}: line {number} has {len(row)} fields, expected {width}")
    columns = list(zip(*rows, strict=True))
    model_names, model_code = np.unique(np.array(columns[index["model"]]), return_inverse=True)
    type_names, type_code = np.unique(
        np.array(columns[index["instance_type"]]), return_inverse=True
    )
    return _KairosColumns(
        model_code=model_code,
        model_names=model_names,
        type_code=type_code,
        type_names=type_names,
        batch_size=_numeric_column(columns[index["batch_size"]], "batch_size", where),
        infer_ms=_numeric_column(columns[index["infer_ms"]], "infer_ms", where),
        load_ms=_numeric_column(columns[index["load_ms"]], "load_ms", where),
    )


def _numeric_column(values: tuple[str, ...], name: str, where: str) -> np.ndarray:
    """A column as float64 (batch sizes too: whole numbers are checked by the grouping)."""
    try:
        return np.array(values, dtype=np.float64)
    except ValueError:
        for number, value in enumerate(values, start=2):
            try:
                float(value)
            except ValueError:
                raise ProfileError(
                    f"{where}: line {number}: {name} {value!r} is not a number"
                ) from None
        raise


# A field the fast reader converts itself: digits with at most one '.', and at most 15 digits, so
# the digits are an integer m < 2**53 and the value is m / 10**k with both operands exact doubles;
# IEEE division rounds that correctly, as float() does (Clinger, "How to read floating point
# numbers accurately", PLDI 1990, the fast path). Other fields go through float().
_MAX_EXACT_DIGITS = 15
_POWERS_OF_TEN = np.array([float(10**k) for k in range(_MAX_EXACT_DIGITS + 1)])
# Wider fields than this (a name, a number) are left to the row-by-row reader: the fast reader
# lays each column out as a (rows x widest field) byte matrix.
_MAX_FAST_FIELD_BYTES = 64


def _read_kairos_columns_fast(text: str) -> _KairosColumns | None:
    """The columns of a plain Kairos CSV, read without a Python loop over rows; None for a file
    this reader does not vouch for, which :func:`_read_kairos_columns` then reads.

    Plain means: a header naming every Kairos column, no double quote (so no quoted field) and no
    NUL, lines ended by ``\\n`` or ``\\r\\n``, every row with as many fields as the header,
    and every number either a plain decimal (converted here, exactly) or one ``float()`` accepts.
    On such a file the ``csv`` module's fields are the bytes between commas, so both readers give
    the same columns.
    """
    if not text or '"' in text or "\x00" in text:
        return None
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: not from a decoded file
        return None
    header_end = data.find(b"\n")
    if header_end < 0:
        return None
    header_line = data[:header_end].removesuffix(b"\r")
    if b"\r" in header_line:
        return None
    header = [name.strip() for name in header_line.decode("utf-8").split(",")]
    if any(name not in header for name in KAIROS_COLUMNS):
        return None
    # The last line's end of line, if any, ends no row. The fields get a few bytes of zero
    # padding after the text, so that a field's bytes can be read as one fixed-width window.
    body_end = len(data) - (2 if data.endswith(b"\r\n") else 1 if data.endswith(b"\n") else 0)
    if body_end <= header_end + 1:
        return None
    padded = np.zeros(body_end - header_end - 1 + _MAX_FAST_FIELD_BYTES, dtype=np.uint8)
    size = body_end - header_end - 1
    padded[:size] = np.frombuffer(data, dtype=np.uint8, count=size, offset=header_end + 1)
    body = padded[:size]

    newlines = np.flatnonzero(body == ord("\n"))
    returns = np.flatnonzero(body == ord("\r"))
    # csv also ends a line at a lone '\r'; only '\r\n' is taken here.
    if returns.size and np.any(padded[returns + 1] != ord("\n")):
        return None
    commas = np.flatnonzero(body == ord(","))
    rows = newlines.size + 1
    delimiters = len(header) - 1
    if commas.size != rows * delimiters:
        return None
    line_starts = np.concatenate(([0], newlines + 1))
    line_ends = np.append(newlines, size)
    # With as many commas as fields need in all, each line has its share iff the i-th share
    # lies within line i: a ragged row, or a blank line (a row of no fields to csv), fails.
    shares = commas.reshape(rows, delimiters)
    if np.any(shares[:, 0] < line_starts) or np.any(shares[:, -1] >= line_ends):
        return None
    if int((line_ends - line_starts).max()) >= csv.field_size_limit():
        return None  # csv refuses a field that long
    if returns.size:
        line_ends[:-1] -= body[newlines - 1] == ord("\r")

    def field(name: str) -> tuple[np.ndarray, np.ndarray]:
        j = header.index(name)
        starts = line_starts if j == 0 else shares[:, j - 1] + 1
        ends = line_ends if j == delimiters else shares[:, j]
        return starts, ends

    model = _code_field(padded, *field("model"))
    instance_type = _code_field(padded, *field("instance_type"))
    batch_size = _decimal_field(padded, *field("batch_size"))
    infer_ms = _decimal_field(padded, *field("infer_ms"))
    load_ms = _decimal_field(padded, *field("load_ms"))
    if model is None or instance_type is None:
        return None
    if batch_size is None or infer_ms is None or load_ms is None:
        return None
    return _KairosColumns(
        model_code=model[0],
        model_names=model[1],
        type_code=instance_type[0],
        type_names=instance_type[1],
        batch_size=batch_size,
        infer_ms=infer_ms,
        load_ms=load_ms,
    )


def _field_bytes(padded: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """The fields as a (rows x widest) uint8 matrix, zeros after each field's end; None if the
    widest is wider than the padding after the text."""
    lengths = ends - starts
    widest = max(int(lengths.max()), 1)
    if widest > _MAX_FAST_FIELD_BYTES:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(padded, widest)
    matrix: np.ndarray = windows[starts]
    matrix[np.arange(widest) >= lengths[:, None]] = 0
    return matrix


def _code_field(
    padded: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """A text column as (code per row, sorted names), as ``np.unique(names,
    return_inverse=True)`` gives; a name is decoded once per run of equal rows, not per row."""
    matrix = _field_bytes(padded, starts, ends)
    if matrix is None:
        return None
    # No NUL in the text, so the zero padding is exactly what the bytes dtype strips.
    fields = matrix.view(f"S{matrix.shape[1]}").ravel()
    run_starts = np.concatenate(([0], np.flatnonzero(fields[1:] != fields[:-1]) + 1))
    run_bytes, run_code = np.unique(fields[run_starts], return_inverse=True)
    # Sorted as str (the order of the csv reader's arrays), not as bytes.
    names, name_code = np.unique(
        np.array([value.decode("utf-8") for value in run_bytes.tolist()]), return_inverse=True
    )
    run_lengths = np.diff(np.append(run_starts, fields.size))
    return np.repeat(name_code[run_code], run_lengths), names


def _decimal_field(padded: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """A numeric column as float64, equal to ``np.array(fields, dtype=np.float64)``; None if a
    field is not a number (the row-by-row reader then names it)."""
    lengths = ends - starts
    values = np.empty(starts.size, dtype=np.float64)
    widest = int(lengths.max())
    if widest <= _MAX_FAST_FIELD_BYTES:
        # One pass along the fields, a byte offset at a time, all rows at once: Horner's rule for
        # the digits as an integer, counting the digits, the dots and the digits after the dot.
        mantissa = np.zeros(starts.size, dtype=np.int64)
        digits = np.zeros(starts.size, dtype=np.int64)
        dots = np.zeros(starts.size, dtype=np.int64)
        fraction_digits = np.zeros(starts.size, dtype=np.int64)
        for offset in range(widest):
            char = padded[starts + offset]
            inside = offset < lengths
            digit = char - np.uint8(ord("0"))  # wraps around below '0'
            is_digit = (digit < 10) & inside
            mantissa = np.where(is_digit, mantissa * 10 + digit, mantissa)
            digits += is_digit
            fraction_digits += is_digit & (dots > 0)
            dots += (char == ord(".")) & inside
        plain = (digits + dots == lengths) & (dots <= 1) & (digits >= 1)
        plain &= digits <= _MAX_EXACT_DIGITS
        scale = _POWERS_OF_TEN[np.minimum(fraction_digits, _MAX_EXACT_DIGITS)]
        values[plain] = mantissa[plain].astype(np.float64) / scale[plain]
    else:
        plain = np.zeros(starts.size, dtype=bool)
    other = np.flatnonzero(~plain)
    if other.size:
        data = padded.tobytes()
        fields = [data[starts[i] : ends[i]].decode("utf-8") for i in other.tolist()]
        try:
            values[other] = np.array(fields, dtype=np.float64)
        except ValueError:
            return None
    return values


def _group_kairos_columns(columns: _KairosColumns, where: str, drop_largest: bool) -> ProfileSet:
    """One profile per (model, instance type), one cell per batch size, each cell's samples
    sorted and (``drop_largest``) its largest one dropped; profiles ordered by model, then type."""
    for names, codes, column in (
        (columns.model_names, columns.model_code, "model"),
        (columns.type_names, columns.type_code, "instance_type"),
    ):
        empty = [i for i, name in enumerate(names) if not str(name).strip()]
        if empty:  # as a profile JSON refuses it
            line = int(np.flatnonzero(codes == empty[0])[0]) + 2
            raise ProfileError(f"{where}: line {line}: {column} must be a non-empty name")
    # Both readers give batch sizes as read (floats): a whole number is checked here, before
    # any cast, so that 2.7 is not read as 2 nor 1e30 as a negative.
    read = columns.batch_size
    bad = np.flatnonzero(~np.isfinite(read) | (read != np.floor(read)))
    if bad.size:
        line = int(bad[0]) + 2
        raise ProfileError(
            f"{where}: line {line}: batch_size {read[bad[0]]:g} is not a whole number"
        )
    bad = np.flatnonzero(read > MAX_BATCH_SIZE)
    if bad.size:
        line = int(bad[0]) + 2
        raise ProfileError(
            f"{where}: line {line}: batch_size {read[bad[0]]:.15g} is past the largest,"
            f" {MAX_BATCH_SIZE:,}"
        )
    batch = read.astype(np.int64)
    with np.errstate(over="ignore"):  # two huge latencies add up to inf, refused below
        latency = columns.infer_ms + columns.load_ms
    bad = np.flatnonzero(~np.isfinite(latency) | (latency < 0) | (batch < 1))
    if bad.size:
        line = int(bad[0]) + 2
        raise ProfileError(f"{where}: line {line} needs batch_size >= 1 and latencies >= 0")

    # Rows in (model, type, batch) order, then each cell's samples by latency: a stable sort
    # (ties keep the file's order). The codes sort as the names do. A file written cell by cell
    # (the shared one is) is already in order but for the latencies.
    types = columns.type_names.size
    pair = columns.model_code.astype(np.int64) * types + columns.type_code
    in_order = (pair[1:] > pair[:-1]) | ((pair[1:] == pair[:-1]) & (batch[1:] >= batch[:-1]))
    if not np.all(in_order):
        order = np.lexsort((latency, batch, pair))
        pair, batch, latency = pair[order], batch[order], latency[order]
    key_change = (pair[1:] != pair[:-1]) | (batch[1:] != batch[:-1])
    cell_starts = np.concatenate(([0], np.flatnonzero(key_change) + 1, [latency.size]))
    model_names = columns.model_names.tolist()
    type_names = columns.type_names.tolist()
    grouped: dict[tuple[str, str], tuple[list[int], list[np.ndarray]]] = {}
    for start, stop, cell_pair, size in zip(
        cell_starts[:-1].tolist(),
        cell_starts[1:].tolist(),
        pair[cell_starts[:-1]].tolist(),
        batch[cell_starts[:-1]].tolist(),
        strict=True,
    ):
        cell = np.sort(latency[start:stop], kind="stable")
        if drop_largest and cell.size > 1:
            cell = cell[:-1]
        model_code, type_code = divmod(cell_pair, types)
        sizes, samples = grouped.setdefault(
            (model_names[model_code], type_names[type_code]), ([], [])
        )
        sizes.append(size)
        samples.append(cell)
    return ProfileSet(
        (
            LatencyProfile(model, instance_type, np.array(sizes), tuple(samples))
            for (model, instance_type), (sizes, samples) in grouped.items()
        ),
        source=where,
    )


def _parse_profiles_json(text: str, where: str) -> ProfileSet:
    try:
        document = loads_json(text)
    except DuplicateKeyError as error:
        raise ProfileError(f"{where}: malformed JSON ({error})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(
            f"{where}: malformed JSON ({error.msg} at line {error.lineno})"
        ) from None
    except RecursionError:
        raise ProfileError(f"{where}: JSON nested too deeply to read") from None
    return profiles_from_document(document, where)


# The fields of one entry of a profile JSON document (:func:`profiles_document`).
_ENTRY_KEYS = ("model", "instance_type", "batch_sizes", "latency_ms")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_cell(cell: object) -> bool:
    """One batch size's latencies in a profile JSON document: a number or a flat list of them."""
    return _is_number(cell) or (isinstance(cell, list) and all(_is_number(v) for v in cell))


def profiles_from_document(document: Any, where: str) -> ProfileSet:
    """The profiles of a parsed profile JSON document (:func:`profiles_document`'s output);
    ``where`` names it in errors."""
    if isinstance(document, list):
        raise ProfileError(
            f"{where}: a JSON list; a profile JSON is an object whose 'profiles' is that list"
            f' ({{"format": "{PROFILE_FORMAT}", "profiles": [...]}})'
        )
    if not isinstance(document, dict) or not isinstance(document.get("profiles"), list):
        raise ProfileError(f"{where}: expected an object with a 'profiles' list ({PROFILE_FORMAT})")
    if document.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise ProfileError(f"{where}: unsupported format {document.get('format')!r}")
    profiles = []
    for number, entry in enumerate(document["profiles"], start=1):
        label = f"{where}: profiles[{number - 1}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{label} must be an object")
        for key in _ENTRY_KEYS:
            if key not in entry:
                raise ProfileError(f"{label} lacks {key!r}")
        unknown = sorted(str(key) for key in entry if key not in _ENTRY_KEYS)
        if unknown:
            raise ProfileError(
                f"{label}: unknown field {unknown[0]!r} (an entry has {', '.join(_ENTRY_KEYS)})"
            )
        for key in ("model", "instance_type"):
            if not isinstance(entry[key], str) or not entry[key].strip():
                raise ProfileError(f"{label}: {key} must be a non-empty name, got {entry[key]!r}")
        sizes, cells = entry["batch_sizes"], entry["latency_ms"]
        if not isinstance(sizes, list) or not isinstance(cells, list) or len(sizes) != len(cells):
            raise ProfileError(f"{label}: batch_sizes and latency_ms must be lists of equal length")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ProfileError(f"{label}: batch_sizes must be whole numbers")
        too_large = [size for size in sizes if size > MAX_BATCH_SIZE]
        if too_large:
            digits = str(too_large[0])
            shown = digits if len(digits) <= 40 else f"{digits[:12]}... ({len(digits)} digits)"
            raise ProfileError(
                f"{label}: batch_sizes must be at most {MAX_BATCH_SIZE:,}, got {shown}"
            )
        if not all(_is_cell(cell) for cell in cells):
            raise ProfileError(
                f"{label}: latency_ms must hold a number or a list of numbers per batch size"
            )
        try:
            samples = tuple(
                np.array(cell if isinstance(cell, list) else [cell], dtype=np.float64)
                for cell in cells
            )
        except (TypeError, ValueError):
            raise ProfileError(f"{label}: latency_ms must hold numbers") from None
        except OverflowError:  # a JSON integer past any float
            raise ProfileError(f"{label}: latency_ms holds a number too large") from None
        try:
            profiles.append(
                LatencyProfile(entry["model"], entry["instance_type"], np.array(sizes), samples)
            )
        except ProfileError as error:
            raise ProfileError(f"{label}: {error}") from None
    if not profiles:
        raise ProfileError(f"{where}: no profiles")
    return ProfileSet(profiles, source=where)


def profiles_document(profiles: Iterable[LatencyProfile], **meta: Any) -> dict[str, Any]:
    """The profile JSON document (format ``heteroplane.profiles/v1``) for ``profiles``."""
    return {
        "format": PROFILE_FORMAT,
        **meta,
        "profiles": [
            {
                "model": p.model,
                "instance_type": p.instance_type,
                "batch_sizes": p.batch_sizes.tolist(),
                "latency_ms": [cell.tolist() for cell in p.samples_ms],
            }
            for p in profiles
        ],
    }


def write_profiles_json(profiles: Iterable[LatencyProfile], path: str | Path, **meta: Any) -> None:
    """Write profiles in the project's JSON format; ``meta`` adds top-level keys (source, host)."""
    Path(path).write_text(json.dumps(profiles_document(profiles, **meta), indent=1) + "\n")
