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
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from estimator.errors import (
    BatchSizeOutOfRangeError,
    MissingProfileError,
    ProfileError,
    UnknownModelError,
)

PROFILE_FORMAT = "heteroplane.profiles/v1"
KAIROS_COLUMNS = ("model", "instance_type", "batch_size", "sample", "infer_ms", "load_ms")

ServiceMode = Literal["sampled", "mean"]


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

    def __post_init__(self) -> None:
        sizes = np.ascontiguousarray(self.batch_sizes, dtype=np.int64)
        where = f"profile of {self.model!r} on {self.instance_type!r}"
        if sizes.ndim != 1 or sizes.size == 0:
            raise ProfileError(f"{where} has no batch sizes")
        if sizes[0] < 1 or np.any(np.diff(sizes) <= 0):
            raise ProfileError(f"{where}: batch sizes must be >= 1 and strictly increasing")
        if len(self.samples_ms) != sizes.size:
            raise ProfileError(f"{where}: one sample list per batch size is needed")
        cells = []
        for size, samples in zip(sizes, self.samples_ms, strict=True):
            cell = np.sort(np.asarray(samples, dtype=np.float64).ravel())
            if cell.size == 0:
                raise ProfileError(f"{where}: no samples at batch size {size}")
            if not np.all(np.isfinite(cell)) or cell[0] < 0:
                raise ProfileError(f"{where}: latencies at batch size {size} must be finite, >= 0")
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
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: not a text file (expected CSV or JSON)") from None
    if text.lstrip().startswith("{"):
        return _parse_profiles_json(text, str(path))
    return _parse_kairos_csv(text, str(path))


def _parse_kairos_csv(text: str, where: str, drop_largest: bool = True) -> ProfileSet:
    reader = csv.reader(io.StringIO(text))
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
    if not rows:
        raise ProfileError(f"{where}: no data rows")
    index = {name: header.index(name) for name in KAIROS_COLUMNS}
    width = len(header)
    for number, row in enumerate(rows, start=2):
        if len(row) != width:
            raise ProfileError(f"{where}: line {number} has {len(row)} fields, expected {width}")
    columns = list(zip(*rows, strict=True))
    models = np.array(columns[index["model"]])
    types = np.array(columns[index["instance_type"]])
    batch = _numeric_column(columns[index["batch_size"]], "batch_size", where, np.int64)
    infer = _numeric_column(columns[index["infer_ms"]], "infer_ms", where, np.float64)
    load = _numeric_column(columns[index["load_ms"]], "load_ms", where, np.float64)
    latency = infer + load
    bad = np.flatnonzero(~np.isfinite(latency) | (latency < 0) | (batch < 1))
    if bad.size:
        line = int(bad[0]) + 2
        raise ProfileError(f"{where}: line {line} needs batch_size >= 1 and latencies >= 0")

    order = np.lexsort((latency, batch, types, models))
    models, types, batch, latency = models[order], types[order], batch[order], latency[order]
    key_change = (models[1:] != models[:-1]) | (types[1:] != types[:-1]) | (batch[1:] != batch[:-1])
    cell_starts = np.concatenate(([0], np.flatnonzero(key_change) + 1, [latency.size]))
    grouped: dict[tuple[str, str], tuple[list[int], list[np.ndarray]]] = {}
    for start, stop in itertools.pairwise(cell_starts):
        cell = latency[start:stop]  # sorted ascending by the lexsort
        if drop_largest and cell.size > 1:
            cell = cell[:-1]
        sizes, samples = grouped.setdefault((str(models[start]), str(types[start])), ([], []))
        sizes.append(int(batch[start]))
        samples.append(cell)
    return ProfileSet(
        (
            LatencyProfile(model, instance_type, np.array(sizes), tuple(samples))
            for (model, instance_type), (sizes, samples) in grouped.items()
        ),
        source=where,
    )


def _numeric_column(
    values: tuple[str, ...], name: str, where: str, dtype: type[np.generic]
) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float64).astype(dtype)
    except ValueError:
        for number, value in enumerate(values, start=2):
            try:
                float(value)
            except ValueError:
                raise ProfileError(
                    f"{where}: line {number}: {name} {value!r} is not a number"
                ) from None
        raise


def _parse_profiles_json(text: str, where: str) -> ProfileSet:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(
            f"{where}: malformed JSON ({error.msg} at line {error.lineno})"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("profiles"), list):
        raise ProfileError(f"{where}: expected an object with a 'profiles' list ({PROFILE_FORMAT})")
    if document.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise ProfileError(f"{where}: unsupported format {document.get('format')!r}")
    profiles = []
    for number, entry in enumerate(document["profiles"], start=1):
        label = f"{where}: profiles[{number - 1}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{label} must be an object")
        for key in ("model", "instance_type", "batch_sizes", "latency_ms"):
            if key not in entry:
                raise ProfileError(f"{label} lacks {key!r}")
        sizes, cells = entry["batch_sizes"], entry["latency_ms"]
        if not isinstance(sizes, list) or not isinstance(cells, list) or len(sizes) != len(cells):
            raise ProfileError(f"{label}: batch_sizes and latency_ms must be lists of equal length")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise ProfileError(f"{label}: batch_sizes must be whole numbers")
        try:
            samples = tuple(
                np.array(cell if isinstance(cell, list) else [cell], dtype=np.float64)
                for cell in cells
            )
        except (TypeError, ValueError):
            raise ProfileError(f"{label}: latency_ms must hold numbers") from None
        try:
            profiles.append(
                LatencyProfile(
                    str(entry["model"]), str(entry["instance_type"]), np.array(sizes), samples
                )
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
