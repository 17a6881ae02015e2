"""The instance catalog: which EC2 instance types can be bought, their shapes and their prices.

This module owns :class:`InstanceType` (a shape and its on-demand price), :class:`Catalog` (an
immutable mapping from type name to :class:`InstanceType`), the default catalog shipped as package
data (``estimator/data/instance_types.csv``: Linux on-demand prices in us-east-1, sources and dates
in ``docs/catalog.md``; besides the EC2 types it holds ``local.cpu``, the machine the profiler
measures, and the emulated ``emu.*`` types the local provisioner runs, with their speed factors),
and the reader and writer of the catalog files a user hands in with ``--catalog FILE`` (CSV or
JSON). What can be bought and at what price is kept apart from how instances are created (that is
``provisioners/``).

Every value is checked where it enters: an :class:`InstanceType` cannot be built with a negative
price, and a catalog file that is malformed fails with one :class:`~estimator.errors.CatalogError`
line naming the file, the row and the field.

>>> catalog = load_catalog()
>>> catalog.price_usd_per_hr("g4dn.xlarge")
0.526
>>> catalog["r5n.large"].is_gpu
False
>>> custom = catalog.with_overrides([InstanceType("emu.small", 0.05, speed_factor=0.5)])
>>> custom["emu.small"].family, len(custom) == len(catalog) + 1
('emu', True)
"""

from __future__ import annotations

import csv
import difflib
import functools
import io
import json
import math
import numbers
import re
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, overload

from estimator.documents import DuplicateKeyError, loads_json
from estimator.errors import CatalogError, UnknownInstanceTypeError
from estimator.numbers import plain

__all__ = [
    "CATALOG_COLUMNS",
    "MIN_PRICE_USD_PER_HR",
    "Catalog",
    "InstanceType",
    "default_catalog",
    "load_catalog",
    "read_catalog_file",
    "write_catalog_file",
]

# The column order of the files this module writes; a file it reads may hold any subset of the
# optional ones, in any order, and further columns (notes, sources) that it ignores, but for one
# whose name is close to one of these (a misspelling: refused).
CATALOG_COLUMNS: tuple[str, ...] = (
    "instance_type",
    "family",
    "price_usd_per_hr",
    "vcpus",
    "memory_gib",
    "gpus",
    "gpu_model",
    "gpu_memory_gib",
    "speed_factor",
    "spot_price_usd_per_hr",
    "interruptions_per_hr",
)
_REQUIRED_COLUMNS = ("instance_type", "price_usd_per_hr")
# The least price a type may have but 0 (on demand or spot; EC2 prices have four to six decimals).
# Every part compares a fleet's cost with its budget allowing 1e-9 USD/hr of float rounding: a
# price far below it would let that allowance buy instances (a million at 1e-15 USD/hr within a
# 1e-9 budget), so the allowance is at most a thousandth of one instance's price.
MIN_PRICE_USD_PER_HR = 1e-6
# The most a type may cost an hour (on demand or spot): EC2's dearest types are a few hundred
# USD/hr. Past it a figure is a mistake, and the costs computed from one overflowed (1e308 USD/hr
# printed an infinite cost and broke `--json`).
MAX_PRICE_USD_PER_HR = 1e6
# Every column but the name and the text ones holds a number.
_NUMERIC_COLUMNS = tuple(
    c for c in CATALOG_COLUMNS if c not in ("instance_type", "gpu_model", "family")
)

# The same alphabet a fleet string (``type=count,type=count``) accepts, so that every type in a
# catalog can be named on the command line.
_TYPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_]*$")

_DEFAULT_CATALOG_RESOURCE = ("data", "instance_types.csv")

_T = TypeVar("_T")


class _FieldError(Exception):
    """A field that failed its check; turned into a CatalogError with its context by the caller."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class InstanceType:
    """One instance type: a machine shape and its price.

    ``price_usd_per_hr`` is the on-demand price (zero is allowed: a machine already paid for).
    ``spot_price_usd_per_hr`` is the spot price the planner assumes (``None``: the type is not
    bought on spot; never above the on-demand price, which AWS caps spot at) and
    ``interruptions_per_hr`` the rate at which one spot instance of the type is interrupted
    (a Poisson process per instance-hour; docs/spot.md).
    ``family`` defaults to the part of the name before the first ``.`` (``g4dn`` for
    ``g4dn.xlarge``). ``gpu_memory_gib`` is the GPU memory of the whole instance, summed over its
    ``gpus`` (as AWS lists it: 96 GiB for g5.12xlarge's four A10G). ``speed_factor`` scales service
    times of emulated types: above 1 is faster than the reference type, below 1 slower.

    >>> InstanceType("g4dn.xlarge", 0.526, vcpus=4, memory_gib=16, gpus=1, gpu_model="T4").family
    'g4dn'
    >>> InstanceType("t3.xlarge", -1.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    estimator.errors.CatalogError: instance type 't3.xlarge': price_usd_per_hr: must be >= 0, ...
    """

    name: str
    price_usd_per_hr: float
    vcpus: int | None = None
    memory_gib: float | None = None
    gpus: int = 0
    gpu_model: str | None = None
    family: str = ""
    gpu_memory_gib: float = 0.0
    speed_factor: float = 1.0
    spot_price_usd_per_hr: float | None = None
    interruptions_per_hr: float = 0.0

    def __post_init__(self) -> None:
        try:
            checked = _checked_fields(
                name=self.name,
                price_usd_per_hr=self.price_usd_per_hr,
                vcpus=self.vcpus,
                memory_gib=self.memory_gib,
                gpus=self.gpus,
                gpu_model=self.gpu_model,
                family=self.family,
                gpu_memory_gib=self.gpu_memory_gib,
                speed_factor=self.speed_factor,
                spot_price_usd_per_hr=self.spot_price_usd_per_hr,
                interruptions_per_hr=self.interruptions_per_hr,
            )
        except _FieldError as bad:
            raise CatalogError(f"instance type {self.name!r}: {bad}") from None
        # Normalised values (ints as floats, empty strings as None, the derived family) make two
        # equal shapes compare equal however they were spelled.
        for key, value in checked.items():
            object.__setattr__(self, key, value)

    @property
    def is_gpu(self) -> bool:
        """Whether the type has at least one GPU."""
        return self.gpus > 0

    @property
    def has_spot(self) -> bool:
        """Whether the type can be bought on spot (the catalog gives it a spot price)."""
        return self.spot_price_usd_per_hr is not None


def _checked_fields(
    *,
    name: object,
    price_usd_per_hr: object,
    vcpus: object,
    memory_gib: object,
    gpus: object,
    gpu_model: object,
    family: object,
    gpu_memory_gib: object,
    speed_factor: object,
    spot_price_usd_per_hr: object = None,
    interruptions_per_hr: object = 0.0,
) -> dict[str, Any]:
    """Check every field of an instance type; return them normalised, or raise _FieldError."""
    if not isinstance(name, str) or not name:
        raise _FieldError("instance_type", "must be a non-empty name")
    if not _TYPE_NAME.fullmatch(name):
        raise _FieldError(
            "instance_type",
            f"{name!r} may hold only letters, digits, '.', '-' and '_' (and start with one of the"
            " first two)",
        )
    if gpu_model is not None and not isinstance(gpu_model, str):
        raise _FieldError("gpu_model", f"must be text, got {gpu_model!r}")
    if not isinstance(family, str):
        raise _FieldError("family", f"must be text, got {family!r}")
    on_demand = _checked_price("price_usd_per_hr", price_usd_per_hr)
    spot = (
        None
        if spot_price_usd_per_hr is None
        else _checked_price("spot_price_usd_per_hr", spot_price_usd_per_hr)
    )
    if spot is not None and spot > on_demand:
        raise _FieldError(
            "spot_price_usd_per_hr",
            f"{spot!r} is above the on-demand price {on_demand!r} (AWS caps spot at on demand)",
        )
    return {
        "name": name,
        "price_usd_per_hr": on_demand,
        "spot_price_usd_per_hr": spot,
        "interruptions_per_hr": _checked_real("interruptions_per_hr", interruptions_per_hr),
        "vcpus": None if vcpus is None else _checked_count("vcpus", vcpus),
        "memory_gib": None if memory_gib is None else _checked_real("memory_gib", memory_gib),
        "gpus": _checked_count("gpus", gpus),
        "gpu_model": (gpu_model.strip() or None) if gpu_model is not None else None,
        "family": family.strip() or name.partition(".")[0],
        "gpu_memory_gib": _checked_real("gpu_memory_gib", gpu_memory_gib),
        "speed_factor": _checked_real("speed_factor", speed_factor, positive=True),
    }


def _checked_real(
    field: str, value: object, *, minimum: float = 0.0, positive: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _FieldError(field, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer past any float
        raise _FieldError(field, "must be finite, got a number too large") from None
    if not math.isfinite(number):
        raise _FieldError(field, f"must be finite, got {number!r}")
    if positive and number <= 0.0:
        raise _FieldError(field, f"must be > 0, got {number!r}")
    if number < minimum:
        raise _FieldError(field, f"must be >= {minimum:g}, got {number!r}")
    return number


def _checked_price(field: str, value: object) -> float:
    """A price: 0 (free) or at least :data:`MIN_PRICE_USD_PER_HR`."""
    price = _checked_real(field, value)
    if price > MAX_PRICE_USD_PER_HR:
        raise _FieldError(
            field, f"must be at most {MAX_PRICE_USD_PER_HR:,.0f} USD/hr, got {price:.6g}"
        )
    if 0.0 < price < MIN_PRICE_USD_PER_HR:
        raise _FieldError(
            field,
            f"must be 0 or >= {plain(MIN_PRICE_USD_PER_HR)} USD/hr, got {price!r}"
            " (costs are compared"
            " with budgets to within 1e-9 USD/hr)",
        )
    return price


def _checked_count(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _FieldError(field, f"must be a whole number, got {value!r}")
    count = int(value)
    if count < 0:
        raise _FieldError(field, f"must be >= 0, got {count}")
    return count


class Catalog(Mapping[str, InstanceType]):
    """An immutable set of instance types, keyed by name, in the order they were given.

    Looking up a name the catalog does not hold raises
    :class:`~estimator.errors.UnknownInstanceTypeError` (a ``ValueError``, not a ``KeyError``);
    ``in`` and :meth:`get` answer without raising.
    """

    __slots__ = ("_types",)

    def __init__(self, types: Iterable[InstanceType]) -> None:
        by_name: dict[str, InstanceType] = {}
        for instance_type in types:
            if not isinstance(instance_type, InstanceType):
                raise CatalogError(
                    f"a catalog holds InstanceType values, got {type(instance_type).__name__}"
                )
            if instance_type.name in by_name:
                raise CatalogError(
                    f"instance type {instance_type.name!r} appears twice in the catalog"
                )
            by_name[instance_type.name] = instance_type
        self._types: dict[str, InstanceType] = by_name

    def __getitem__(self, name: str) -> InstanceType:
        try:
            return self._types[name]
        except KeyError:
            raise UnknownInstanceTypeError(name, self.names) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._types)

    def __len__(self) -> int:
        return len(self._types)

    def __contains__(self, name: object) -> bool:
        return name in self._types

    # Mapping's mixins find absent keys by catching KeyError, which __getitem__ does not raise;
    # these answer from the dict instead.
    @overload
    def get(self, name: str, /) -> InstanceType | None: ...
    @overload
    def get(self, name: str, default: InstanceType | _T, /) -> InstanceType | _T: ...
    def get(self, name: str, default: object = None, /) -> object:
        return self._types.get(name, default)

    def keys(self) -> KeysView[str]:
        return self._types.keys()

    def values(self) -> ValuesView[InstanceType]:
        return self._types.values()

    def items(self) -> ItemsView[str, InstanceType]:
        return self._types.items()

    def __repr__(self) -> str:
        shown = ", ".join(self.names[:4]) + (", ..." if len(self) > 4 else "")
        return f"Catalog({len(self)} instance types: {shown})"

    @property
    def names(self) -> list[str]:
        """The type names, in catalog order."""
        return list(self._types)

    def price_usd_per_hr(self, name: str) -> float:
        """The on-demand price of ``name`` in USD per hour."""
        return self[name].price_usd_per_hr

    def spot_price_usd_per_hr(self, name: str) -> float | None:
        """The spot price the catalog assumes for ``name`` (``None``: not offered on spot)."""
        return self[name].spot_price_usd_per_hr

    def with_overrides(self, types: Iterable[InstanceType]) -> Catalog:
        """A new catalog: ``types`` replace same-named entries in place; the others are appended."""
        overrides = Catalog(types)
        merged = dict(self._types)
        merged.update(overrides._types)
        return Catalog(merged.values())


@functools.cache
def default_catalog() -> Catalog:
    """The catalog shipped with the package (Linux on-demand, us-east-1; see docs/catalog.md)."""
    resource = resources.files("estimator").joinpath(*_DEFAULT_CATALOG_RESOURCE)
    text = resource.read_text(encoding="utf-8")
    return Catalog(
        _parse_csv(text, source="estimator/data/instance_types.csv (the default catalog)")
    )


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The default catalog, with the types of the file at ``path`` added or overriding by name."""
    if path is None:
        return default_catalog()
    return default_catalog().with_overrides(read_catalog_file(path))


def read_catalog_file(path: str | Path) -> list[InstanceType]:
    """Read instance types from a CSV file (header row) or a JSON file.

    The format follows the suffix (``.csv``, ``.json``); any other suffix is sniffed from the first
    non-space character (``[`` or ``{`` is JSON). JSON is a list of objects or an object with an
    ``instance_types`` list. ``instance_type`` and ``price_usd_per_hr`` are required; the other
    columns of :data:`CATALOG_COLUMNS` are optional and other columns are ignored (notes,
    sources), but for one whose name is close to one of them (a misspelling). Errors are one
    :class:`~estimator.errors.CatalogError` line naming the file, the row (1-based, counting data
    rows, not the header) and the field. A missing file raises ``FileNotFoundError``.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise CatalogError(f"{source}: not UTF-8 text") from None
    if not text.strip():
        raise CatalogError(f"{source}: empty file (expected a CSV header or a JSON list)")
    suffix = Path(path).suffix.lower()
    is_json = suffix == ".json" or (suffix != ".csv" and text.lstrip()[0] in "[{")
    types = _parse_json(text, source) if is_json else _parse_csv(text, source)
    if not types:
        raise CatalogError(f"{source}: holds no instance types")
    return types


def write_catalog_file(types: Iterable[InstanceType], path: str | Path) -> None:
    """Write instance types as CSV (or as a JSON list when the suffix is ``.json``).

    Floats are written with ``repr`` so that :func:`read_catalog_file` reads back equal values.
    """
    records = [_to_record(instance_type) for instance_type in types]
    target = Path(path)
    if target.suffix.lower() == ".json":
        target.write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
        return
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CATALOG_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({key: _cell(value) for key, value in record.items()})
    target.write_text(buffer.getvalue(), encoding="utf-8")


def _to_record(instance_type: InstanceType) -> dict[str, str | int | float | None]:
    return {
        "instance_type": instance_type.name,
        "family": instance_type.family,
        "price_usd_per_hr": instance_type.price_usd_per_hr,
        "vcpus": instance_type.vcpus,
        "memory_gib": instance_type.memory_gib,
        "gpus": instance_type.gpus,
        "gpu_model": instance_type.gpu_model,
        "gpu_memory_gib": instance_type.gpu_memory_gib,
        "speed_factor": instance_type.speed_factor,
        "spot_price_usd_per_hr": instance_type.spot_price_usd_per_hr,
        "interruptions_per_hr": instance_type.interruptions_per_hr,
    }


def _cell(value: str | int | float | None) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _parse_csv(text: str, source: str) -> list[InstanceType]:
    rows = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    records: list[tuple[str, Mapping[str, object]]] = []
    try:
        for cells in rows:
            if not any(cell.strip() for cell in cells):
                continue  # blank lines, and the rows of bare commas spreadsheets leave
            if header is None:
                header = _checked_header([cell.strip() for cell in cells], source)
                continue
            where = f"{source}: row {len(records) + 1} (line {rows.line_num})"
            if len(cells) > len(header):
                raise CatalogError(f"{where}: has more cells than the header has columns")
            padded = cells + [""] * (len(header) - len(cells))
            records.append((where, dict(zip(header, padded, strict=True))))
    except csv.Error as exc:
        raise CatalogError(f"{source}: line {rows.line_num}: malformed CSV ({exc})") from None
    return _build_types(records)


def _checked_header(header: list[str], source: str) -> list[str]:
    for column in _REQUIRED_COLUMNS:
        if column not in header:
            raise CatalogError(
                f"{source}: header: missing required column {column!r}"
                f" (columns: {', '.join(c for c in header if c) or 'none'})"
            )
    duplicated = sorted({column for column in header if column and header.count(column) > 1})
    if duplicated:
        raise CatalogError(f"{source}: header: column {duplicated[0]!r} appears twice")
    _check_near_misses(header, f"{source}: header")
    return header


def _check_near_misses(columns: Iterable[object], where: str) -> None:
    """Refuse a column that is not the catalog's but close to one of them (``spot_price_usd_hr``):
    a misspelt optional column would be ignored with the others (notes, sources) and its values
    lost without a word."""
    for column in columns:
        if not isinstance(column, str) or not column or column in CATALOG_COLUMNS:
            continue
        close = difflib.get_close_matches(column, CATALOG_COLUMNS, n=1, cutoff=0.75)
        if close:
            raise CatalogError(
                f"{where}: column {column!r} is not one of the catalog's; did you mean"
                f" {close[0]!r}? (columns: {', '.join(CATALOG_COLUMNS)})"
            )


def _parse_json(text: str, source: str) -> list[InstanceType]:
    try:
        document = loads_json(text)
    except DuplicateKeyError as exc:
        raise CatalogError(f"{source}: malformed JSON ({exc})") from None
    except json.JSONDecodeError as exc:
        raise CatalogError(
            f"{source}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise CatalogError(f"{source}: JSON nested too deeply to read") from None
    if isinstance(document, dict) and "instance_types" in document:
        document = document["instance_types"]
    if not isinstance(document, list):
        raise CatalogError(
            f"{source}: JSON must be a list of objects or an object with an 'instance_types' list"
        )
    records: list[tuple[str, Mapping[str, object]]] = []
    for row, record in enumerate(document, start=1):
        where = f"{source}: row {row}"
        if not isinstance(record, dict):
            raise CatalogError(f"{where}: expected an object, got {type(record).__name__}")
        _check_near_misses(record, where)
        # A CSV cell is text and read as a number; in JSON a price in quotes is a mistake.
        for field in _NUMERIC_COLUMNS:
            if isinstance(record.get(field), str):
                raise CatalogError(
                    f"{where}: {field}: must be a JSON number, not the text {record[field]!r}"
                )
        records.append((where, record))
    return _build_types(records)


def _build_types(records: Iterable[tuple[str, Mapping[str, object]]]) -> list[InstanceType]:
    types: list[InstanceType] = []
    first_row: dict[str, str] = {}
    for where, record in records:
        try:
            checked = _checked_fields(**_coerced_record(record))
        except _FieldError as bad:
            raise CatalogError(f"{where}: {bad}") from None
        name: str = checked["name"]
        if name in first_row:
            raise CatalogError(
                f"{where}: instance_type: {name!r} appears twice (first at {first_row[name]})"
            )
        first_row[name] = where.rpartition(": ")[2]
        types.append(InstanceType(**checked))
    return types


def _coerced_record(record: Mapping[str, object]) -> dict[str, object]:
    """Turn one row's raw cells (text from CSV, values from JSON) into typed fields."""
    for column in _REQUIRED_COLUMNS:
        if column not in record:
            raise _FieldError(column, "missing required field")
    name = record["instance_type"]
    if isinstance(name, str):
        name = name.strip()
    if name is None or name == "":
        raise _FieldError("instance_type", "is empty")
    price = _number(record, "price_usd_per_hr")
    if price is None:
        raise _FieldError("price_usd_per_hr", "is empty")
    gpus = _count(record, "gpus")
    gpu_memory_gib = _number(record, "gpu_memory_gib")
    speed_factor = _number(record, "speed_factor")
    interruptions = _number(record, "interruptions_per_hr")
    return {
        "name": name,
        "price_usd_per_hr": price,
        "vcpus": _count(record, "vcpus"),
        "memory_gib": _number(record, "memory_gib"),
        "gpus": 0 if gpus is None else gpus,
        "gpu_model": _text(record, "gpu_model"),
        "family": _text(record, "family") or "",
        "gpu_memory_gib": 0.0 if gpu_memory_gib is None else gpu_memory_gib,
        "speed_factor": 1.0 if speed_factor is None else speed_factor,
        "spot_price_usd_per_hr": _number(record, "spot_price_usd_per_hr"),
        "interruptions_per_hr": 0.0 if interruptions is None else interruptions,
    }


def _number(record: Mapping[str, object], field: str) -> float | None:
    raw = record.get(field)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, bool):
        raise _FieldError(field, f"not a number: {raw!r}")
    if isinstance(raw, int | float):
        try:
            return float(raw)
        except OverflowError:  # a JSON integer past any float
            raise _FieldError(field, "must be finite, got a number too large") from None
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            raise _FieldError(field, f"not a number: {raw.strip()!r}") from None
    raise _FieldError(field, f"not a number: {raw!r}")


def _count(record: Mapping[str, object], field: str) -> int | None:
    number = _number(record, field)
    if number is None:
        return None
    if not math.isfinite(number) or not number.is_integer():
        raise _FieldError(field, f"not a whole number: {record.get(field)!r}")
    return int(number)


def _text(record: Mapping[str, object], field: str) -> str | None:
    raw = record.get(field)
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise _FieldError(field, f"must be text, got {raw!r}")
    return raw.strip() or None
