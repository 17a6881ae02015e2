"""Latency emulation: how long a worker standing in for an instance type makes a batch take.

This module owns the arithmetic by which a worker on this machine emulates an instance type of
speed factor f (docs/catalog.md, "Emulated types"), the emulated compute of the demo family's
models (:data:`EMULATED_COMPUTE`), the reading of the curves a worker pads to out of a profile
file, and the padding: the worker computes the batch for real (``measured_ms``), then sleeps
``padding_ms = max(0, target_ms - measured_ms)`` so that the batch takes the emulated type's
compute.

The digits models themselves compute in well under a millisecond, which no real model does: an
emulated type stands in for an instance serving a real model of the family's sizes, and its
compute is the curve ``C_m(b) = base_ms + per_row_ms * b`` of model m on a type of speed factor 1
(:class:`ComputeCurve`), divided by f. The numbers are :data:`EMULATED_COMPUTE` (docs/catalog.md
says where they come from).

The target latency of a batch of b rows of model m, in order of preference:

1. with a profile file that has a ``compute`` section (``heteroplane profile measure`` writes one,
   :data:`EMULATED_COMPUTE` unless told otherwise: the curves its workers padded to while it
   measured them), that section's curve of m: ``C_m(b) / f``;
2. with a profile file without one (written by hand, or by an older version), its curve of
   (m, the worker's own type) ``L_own(b)``, else its curve of (m, :data:`REFERENCE_TYPE`) over f,
   ``L_ref(b) / f``: the file's latencies are then taken to be compute;
3. no file, or no curve for m in it: the batch's own measured latency scaled, ``measured_ms / f``.

The local provisioner hands its workers the data directory's profile file whenever there is one
(``profiles/family.json``, which the demo and ``heteroplane profile measure`` write), so a
service's emulated workers pad to the curves its profiles were measured on.

The compute a worker pads to is not what a client of the worker sees: a call also pays for the
request's parsing and validation, the JSON of both ways and the round trip. The profile file keeps
the two apart: its ``compute`` section is what the workers pad to, its ``profiles`` are what a
batch costs through the worker's serving path, measured (what the planner reads).

A tabulated curve (:class:`LatencyCurve`) is the mean latency per batch size, linear between
measured sizes, held at the smallest size below it and extrapolated in proportion to b above the
largest (a batch twice the largest measured one takes twice as long). An emulation can slow a
worker down, never speed it up: when this machine computes slower than the target, the batch is
served in its measured latency and ``padding_ms`` is 0.

Pure: no I/O but :func:`read_curves`, no clock.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

__all__ = [
    "BASE_MS",
    "COMPUTE_SECTION",
    "EMULATED_COMPUTE",
    "MODEL_SIZES",
    "PER_ROW_MS",
    "PROFILE_FORMAT",
    "REFERENCE_TYPE",
    "ComputeCurve",
    "Curve",
    "CurveSet",
    "Emulation",
    "EmulationError",
    "LatencyCurve",
    "compute_document",
    "padding_ms",
    "read_curves",
]

# The machine the profiler measures; the same name as controlplane.apps.profiler.REFERENCE_TYPE
# (this package may not import it).
REFERENCE_TYPE = "local.cpu"
PROFILE_FORMAT = "heteroplane.profiles/v1"
# The profile file's top-level key holding the compute curves the emulated workers pad to.
COMPUTE_SECTION = "compute"
# Where a worker's curves come from, as its answers' ``emulation_source`` says: compute curves
# given directly, or a profile file's compute section.
SOURCE_COMPUTE = "compute"
SOURCE_FILE = "compute:profile"


class EmulationError(ValueError):
    """A speed factor or a profile file the emulation cannot use; the message is one line."""


class Curve(Protocol):
    """Latency (ms) of one model by batch size."""

    def latency_ms(self, batch_size: int) -> float: ...


@dataclass(frozen=True, slots=True)
class ComputeCurve:
    """The emulated compute of one model on a type of speed factor 1: ``base_ms + per_row_ms *
    b`` for a batch of b rows (a fixed cost per call, then a cost per row, as a model on a CPU).

    >>> ComputeCurve(2.0, 3.0).latency_ms(4)
    14.0
    """

    base_ms: float
    per_row_ms: float

    def __post_init__(self) -> None:
        for name, value in (("base_ms", self.base_ms), ("per_row_ms", self.per_row_ms)):
            if not math.isfinite(value) or value < 0:
                raise EmulationError(f"{name} must be finite and >= 0 ms, got {value}")

    def latency_ms(self, batch_size: int) -> float:
        return self.base_ms + self.per_row_ms * batch_size


# The demo family's emulated compute on a type of speed factor 1 (emu.cpu.large, "a CPU instance
# as fast as the reference"): C_m(b) = size_m (BASE_MS + PER_ROW_MS b). tiny stands for a small
# CNN served on a 4-vCPU CPU instance (16 ms for one image, 12 ms more per image: a CPU gains
# little from batching), the others for models 1.25, 2 and 4 times its cost (large: a
# ResNet-50-sized model, 64 ms for one image). Chosen, not measured; docs/catalog.md ("Emulated
# types") says why these numbers.
BASE_MS = 4.0
PER_ROW_MS = 12.0
MODEL_SIZES: Mapping[str, float] = MappingProxyType(
    {"tiny": 1.0, "small": 1.25, "medium": 2.0, "large": 4.0}
)
EMULATED_COMPUTE: Mapping[str, ComputeCurve] = MappingProxyType(
    {name: ComputeCurve(size * BASE_MS, size * PER_ROW_MS) for name, size in MODEL_SIZES.items()}
)


@dataclass(frozen=True, slots=True)
class LatencyCurve:
    """Mean latency (ms) by batch size of one model on one type: ``batch_sizes`` increasing.

    >>> curve = LatencyCurve((1, 4), (2.0, 5.0))
    >>> [curve.latency_ms(b) for b in (1, 2, 4, 8)]
    [2.0, 3.0, 5.0, 10.0]
    """

    batch_sizes: tuple[int, ...]
    mean_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.batch_sizes or len(self.batch_sizes) != len(self.mean_ms):
            raise EmulationError("a latency curve needs one mean per batch size, at least one")
        if any(b < 1 for b in self.batch_sizes) or any(
            later <= earlier for earlier, later in itertools.pairwise(self.batch_sizes)
        ):
            raise EmulationError(f"batch sizes {list(self.batch_sizes)} must increase from 1 up")
        if any(not math.isfinite(ms) or ms < 0 for ms in self.mean_ms):
            raise EmulationError("latencies must be finite and >= 0 ms")

    def latency_ms(self, batch_size: int) -> float:
        """Linear between measured sizes; the smallest size's latency below it; in proportion
        to the batch size above the largest."""
        sizes, means = self.batch_sizes, self.mean_ms
        if batch_size <= sizes[0]:
            return means[0]
        if batch_size >= sizes[-1]:
            return means[-1] * batch_size / sizes[-1]
        upper = bisect.bisect_left(sizes, batch_size)
        if sizes[upper] == batch_size:
            return means[upper]
        b0, b1 = sizes[upper - 1], sizes[upper]
        share = (batch_size - b0) / (b1 - b0)
        return means[upper - 1] + share * (means[upper] - means[upper - 1])


def padding_ms(measured_ms: float, target_ms: float) -> float:
    """How long to sleep after computing for ``measured_ms`` so the batch takes ``target_ms``:
    ``max(0, target - measured)``.

    >>> padding_ms(3.0, 5.0), padding_ms(5.0, 3.0)
    (2.0, 0.0)
    """
    return max(0.0, target_ms - measured_ms)


@dataclass(frozen=True, slots=True)
class Emulation:
    """How a worker emulates ``instance_type`` of ``speed_factor`` (``None``: it does not; it is
    the machine it runs on, as on EC2 or for :data:`REFERENCE_TYPE`).

    ``own`` maps model names to curves of the worker's own type (taken as they are),
    ``reference`` to curves of a type of speed factor 1 (divided by the speed factor); ``origin``
    names where the reference curves come from (see the module docstring for which wins).

    >>> half = Emulation("emu.cpu.small", 0.5)
    >>> half.target_ms("tiny", 1, measured_ms=2.0), half.padding_ms("tiny", 1, measured_ms=2.0)
    (4.0, 2.0)
    >>> builtin = Emulation("emu.cpu.small", 0.5, reference=EMULATED_COMPUTE)
    >>> builtin.target_ms("tiny", 2, measured_ms=0.1), builtin.source("tiny")
    (56.0, 'compute')
    >>> Emulation("g4dn.xlarge", None).padding_ms("tiny", 1, measured_ms=2.0)
    0.0
    """

    instance_type: str
    speed_factor: float | None
    own: Mapping[str, Curve] = field(default_factory=dict)
    reference: Mapping[str, Curve] = field(default_factory=dict)
    origin: str = SOURCE_COMPUTE

    def __post_init__(self) -> None:
        factor = self.speed_factor
        if factor is not None and (not math.isfinite(factor) or factor <= 0):
            raise EmulationError(f"speed factor must be a positive number, got {factor}")

    @property
    def emulated(self) -> bool:
        """Whether responses are padded to another type's latency."""
        return self.speed_factor is not None

    def target_ms(self, model: str, batch_size: int, *, measured_ms: float) -> float:
        """The emulated type's latency for this batch (``measured_ms`` when not emulated)."""
        if self.speed_factor is None:
            return measured_ms
        if model in self.own:
            return self.own[model].latency_ms(batch_size)
        if model in self.reference:
            return self.reference[model].latency_ms(batch_size) / self.speed_factor
        return measured_ms / self.speed_factor

    def padding_ms(self, model: str, batch_size: int, *, measured_ms: float) -> float:
        """How long to sleep after the real computation (0 when not emulated)."""
        return padding_ms(measured_ms, self.target_ms(model, batch_size, measured_ms=measured_ms))

    def source(self, model: str) -> str:
        """Where the target latency of ``model`` comes from, for the worker's responses."""
        if self.speed_factor is None:
            return "none"
        if model in self.own:
            return f"profile:{self.instance_type}"
        if model in self.reference:
            return self.origin
        return "measured"


def compute_document(curves: Mapping[str, ComputeCurve]) -> dict[str, Any]:
    """The ``compute`` section of a profile file for ``curves`` (model name -> curve on a type of
    speed factor 1), as :func:`read_curves` reads it back.

    >>> compute_document({"tiny": ComputeCurve(4.0, 3.0)})["models"]
    {'tiny': {'base_ms': 4.0, 'per_row_ms': 3.0}}
    """
    return {
        "latency_ms": "(base_ms + per_row_ms * batch_size) / speed_factor",
        "models": {
            name: {"base_ms": curve.base_ms, "per_row_ms": curve.per_row_ms}
            for name, curve in curves.items()
        },
    }


@dataclass(frozen=True, slots=True)
class CurveSet:
    """The curves a profile file gives a worker: ``own`` (its type's, taken as they are),
    ``reference`` (divided by the speed factor) and where the reference curves come from."""

    own: Mapping[str, Curve]
    reference: Mapping[str, Curve]
    origin: str


def read_curves(path: str | Path, models: Iterable[str], instance_type: str) -> CurveSet:
    """The curves of ``models`` that a profile JSON file (``heteroplane.profiles/v1``) gives a
    worker of ``instance_type``: its ``compute`` section's when it has one (``heteroplane profile
    measure`` writes it: the file's ``profiles`` are then end to end, not compute); else the
    ``profiles`` of ``instance_type`` and of :data:`REFERENCE_TYPE`, each the mean of every
    cell's samples.

    Raises :class:`EmulationError` on a file that cannot be read or does not hold that format.
    """
    where = str(path)
    try:
        document: Any = json.loads(Path(path).read_text())
    except OSError as error:
        raise EmulationError(f"{where}: cannot read ({error.strerror})") from None
    except ValueError as error:
        raise EmulationError(f"{where}: not JSON ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("profiles"), list):
        raise EmulationError(f"{where}: expected an object with a 'profiles' list")
    if document.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise EmulationError(f"{where}: unsupported format {document.get('format')!r}")
    wanted = set(models)
    if COMPUTE_SECTION in document:
        try:
            compute = _compute_curves(document[COMPUTE_SECTION], wanted)
        except EmulationError as error:
            raise EmulationError(f"{where}: {COMPUTE_SECTION}: {error}") from None
        return CurveSet({}, compute, SOURCE_FILE)
    own: dict[str, Curve] = {}
    reference: dict[str, Curve] = {}
    for index, entry in enumerate(document["profiles"]):
        if not isinstance(entry, dict):
            raise EmulationError(f"{where}: profiles[{index}] must be an object")
        model, itype = entry.get("model"), entry.get("instance_type")
        if model not in wanted or itype not in (instance_type, REFERENCE_TYPE):
            continue
        try:
            curve = _curve(entry.get("batch_sizes"), entry.get("latency_ms"))
        except EmulationError as error:
            raise EmulationError(f"{where}: profiles[{index}]: {error}") from None
        (own if itype == instance_type else reference)[str(model)] = curve
    return CurveSet(own, reference, f"profile:{REFERENCE_TYPE}")


def _compute_curves(section: object, wanted: set[str]) -> dict[str, Curve]:
    models = section.get("models") if isinstance(section, dict) else None
    if not isinstance(models, dict):
        raise EmulationError("expected an object with a 'models' object")
    curves: dict[str, Curve] = {}
    for name, entry in models.items():
        if name not in wanted:
            continue
        if not isinstance(entry, dict):
            raise EmulationError(f"{name}: expected an object with base_ms and per_row_ms")
        curves[str(name)] = ComputeCurve(
            _ms(entry, "base_ms", name), _ms(entry, "per_row_ms", name)
        )
    return curves


def _ms(entry: Mapping[str, object], key: str, model: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EmulationError(f"{model}: {key} must be a number, got {value!r}")
    return float(value)


def _curve(sizes: object, cells: object) -> LatencyCurve:
    if not isinstance(sizes, list) or not isinstance(cells, list) or len(sizes) != len(cells):
        raise EmulationError("batch_sizes and latency_ms must be lists of equal length")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in sizes):
        raise EmulationError("batch_sizes must be whole numbers")
    means = []
    for cell in cells:
        samples = cell if isinstance(cell, list) else [cell]
        if not samples or not all(
            isinstance(s, int | float) and not isinstance(s, bool) for s in samples
        ):
            raise EmulationError("latency_ms must hold numbers")
        means.append(sum(float(s) for s in samples) / len(samples))
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    return LatencyCurve(tuple(sizes[i] for i in order), tuple(means[i] for i in order))
