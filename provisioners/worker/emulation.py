"""Latency emulation: how long a worker standing in for an instance type makes a batch take.

This module owns the arithmetic by which a worker on this machine emulates an instance type of
speed factor f (docs/catalog.md, "Emulated types": such a type serves a batch in the reference
latency / f), the reading of the reference curves out of a profile file, and the padding: the
worker computes the batch for real (``measured_ms``), then sleeps ``padding_ms = max(0, target_ms
- measured_ms)`` so that the response takes the emulated type's latency.

The target latency of a batch of b rows of model m, in order of preference:

1. the profile file's curve of (m, the worker's own type), when the file has one: ``L_own(b)``;
2. its curve of (m, :data:`REFERENCE_TYPE`), which ``heteroplane profile measure`` writes:
   ``L_ref(b) / f``;
3. no curve: the batch's own measured latency scaled, ``measured_ms / f``.

A curve is the mean latency per batch size, linear between measured sizes, held at the smallest
size below it and extrapolated in proportion to b above the largest (a batch twice the largest
measured one takes twice as long). An emulation can slow a worker down, never speed it up: with
f > 1 and no profile, or when this machine is busier than when it was profiled, the batch is
served in its measured latency and ``padding_ms`` is 0.

Pure: no I/O but :func:`read_reference_curves`, no clock.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "PROFILE_FORMAT",
    "REFERENCE_TYPE",
    "Emulation",
    "EmulationError",
    "LatencyCurve",
    "padding_ms",
    "read_reference_curves",
]

# The machine the profiler measures; the same name as controlplane.apps.profiler.REFERENCE_TYPE
# (this package may not import it).
REFERENCE_TYPE = "local.cpu"
PROFILE_FORMAT = "heteroplane.profiles/v1"


class EmulationError(ValueError):
    """A speed factor or a profile file the emulation cannot use; the message is one line."""


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

    ``own`` and ``reference`` map model names to the profile's curves of the worker's type and of
    the reference type (see the module docstring for which wins).

    >>> half = Emulation("emu.cpu.small", 0.5)
    >>> half.target_ms("tiny", 1, measured_ms=2.0), half.padding_ms("tiny", 1, measured_ms=2.0)
    (4.0, 2.0)
    >>> Emulation("g4dn.xlarge", None).padding_ms("tiny", 1, measured_ms=2.0)
    0.0
    """

    instance_type: str
    speed_factor: float | None
    own: Mapping[str, LatencyCurve] = field(default_factory=dict)
    reference: Mapping[str, LatencyCurve] = field(default_factory=dict)

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
            return f"profile:{REFERENCE_TYPE}"
        return "measured"


def read_reference_curves(
    path: str | Path, models: Iterable[str], instance_type: str
) -> tuple[dict[str, LatencyCurve], dict[str, LatencyCurve]]:
    """The curves of ``models`` in a profile JSON file (``heteroplane.profiles/v1``, as
    ``heteroplane profile measure`` writes it): those of ``instance_type`` and those of
    :data:`REFERENCE_TYPE`, each the mean of every cell's samples.

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
    own: dict[str, LatencyCurve] = {}
    reference: dict[str, LatencyCurve] = {}
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
    return own, reference


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
