"""The profiler: measured latency of the demo family's models on this machine, and emulated types.

This module owns how a latency profile is measured (the model family of
``provisioners.worker.family``, real inputs from its validation split, ``torch.inference_mode``, a
fixed number of threads, warm-up runs, then timed runs with ``time.perf_counter``), the
per-query compute of each model (its mean latency at batch size 1) that cascades are costed
with, and how the profiles of emulated instance types follow from the measured one: an emulated
type with speed factor f serves a batch in latency / f (docs/catalog.md, "Emulated types").

The machine it runs on is the reference type :data:`REFERENCE_TYPE` (``local.cpu``). Every
model is timed in turn within each round (interleaved), so that load from other processes on a
shared machine falls on all models alike instead of on whichever was being timed at that moment.

torch is imported inside the functions that time models, so that the rest of the command line
does not need it.
"""

from __future__ import annotations

import datetime
import platform
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from estimator.catalog import Catalog, InstanceType
from estimator.profiles import LatencyProfile

if TYPE_CHECKING:
    from torch import nn

REFERENCE_TYPE = "local.cpu"
EMULATED_FAMILY = "emu"
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_SAMPLES = 30
DEFAULT_WARMUP = 5
# One thread: the timings of a shared machine are steadier, and a worker serving one model per
# core is the deployment the emulated types stand for.
DEFAULT_THREADS = 1
MAX_BATCH_SIZE = 4096

ProgressFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """How each cell is timed: ``warmup`` untimed runs, then ``samples`` timed ones, on
    ``threads`` threads."""

    samples: int = DEFAULT_SAMPLES
    warmup: int = DEFAULT_WARMUP
    threads: int = DEFAULT_THREADS

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def measure_family(
    models: Sequence[str],
    batch_sizes: Sequence[int],
    settings: MeasureSettings,
    *,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
) -> list[LatencyProfile]:
    """Profiles of the family ``models`` on this machine (:data:`REFERENCE_TYPE`), one cell per
    batch size of ``batch_sizes`` (increasing), ``settings.samples`` samples each, in ms.

    Trains the family first when its cache lacks it (``provisioners.worker.family``).
    """
    say = progress or (lambda _message: None)
    loaded, inputs = _load_family(models, cache_dir, say)
    samples: dict[str, list[np.ndarray]] = {name: [] for name in models}
    for batch_size in batch_sizes:
        say(
            f"timing {', '.join(models)} at batch size {batch_size}:"
            f" {settings.warmup} warm-up and {settings.samples} timed runs each"
        )
        cell = time_models(loaded, inputs, batch_size, settings)
        for name in models:
            samples[name].append(cell[name])
    return [
        LatencyProfile(name, REFERENCE_TYPE, np.array(batch_sizes), tuple(samples[name]))
        for name in models
    ]


def measure_compute_ms(
    models: Sequence[str],
    settings: MeasureSettings,
    *,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, float]:
    """Per-query compute of each model: its mean latency at batch size 1 on this machine, ms."""
    profiles = measure_family(models, (1,), settings, cache_dir=cache_dir, progress=progress)
    return {p.model: float(p.mean_ms[0]) for p in profiles}


def time_models(
    models: Mapping[str, nn.Module],
    inputs: np.ndarray,
    batch_size: int,
    settings: MeasureSettings,
) -> dict[str, np.ndarray]:
    """Latency samples (ms) of each model on batches of ``batch_size`` rows of ``inputs``.

    Round k feeds every model the same batch (rows k*b .. k*b+b-1, wrapping around), models in
    turn; the first ``settings.warmup`` rounds are not recorded.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    rounds = settings.warmup + settings.samples
    rows = np.asarray(inputs, dtype=np.float32)
    batches = [
        torch.from_numpy(
            np.ascontiguousarray(rows[(k * batch_size + np.arange(batch_size)) % len(rows)])
        )
        for k in range(rounds)
    ]
    timed: dict[str, list[float]] = {name: [] for name in models}
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with torch.inference_mode():
            for k, batch in enumerate(batches):
                for name, model in models.items():
                    start = time.perf_counter()
                    model(batch)
                    elapsed_ms = (time.perf_counter() - start) * 1000.0
                    if k >= settings.warmup:
                        timed[name].append(elapsed_ms)
    finally:
        torch.set_num_threads(threads)
    return {name: np.array(values) for name, values in timed.items()}


def emulated_types(catalog: Catalog) -> list[InstanceType]:
    """The catalog's emulated types (family ``emu``), in catalog order."""
    return [t for t in catalog.values() if t.family == EMULATED_FAMILY]


def emulated_profiles(
    reference: Iterable[LatencyProfile], types: Iterable[InstanceType]
) -> list[LatencyProfile]:
    """Profiles of emulated ``types`` from the measured ``reference`` ones: every sample of a
    type with speed factor f is the reference sample / f (f > 1 is faster than the reference).

    >>> cells = (np.array([2.0]), np.array([3.0]))
    >>> base = LatencyProfile("m", "local.cpu", np.array([1, 2]), cells)
    >>> gpu = InstanceType("emu.gpu", 0.5, speed_factor=4.0)
    >>> emulated_profiles([base], [gpu])[0].mean_ms.tolist()
    [0.5, 0.75]
    """
    measured = list(reference)
    return [
        LatencyProfile(
            profile.model,
            itype.name,
            profile.batch_sizes,
            tuple(cell / itype.speed_factor for cell in profile.samples_ms),
        )
        for itype in types
        for profile in measured
    ]


def profile_meta(settings: MeasureSettings, types: Iterable[InstanceType]) -> dict[str, Any]:
    """The top-level keys of a measured profile file: where, when and how it was measured."""
    import torch

    return {
        "source": "measured",
        "host": socket.gethostname(),
        "machine": f"{platform.system()} {platform.machine()} {platform.processor()}".strip(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "reference_type": REFERENCE_TYPE,
        "threads": settings.threads,
        "warmup": settings.warmup,
        "samples": settings.samples,
        "speed_factors": {t.name: t.speed_factor for t in types},
    }


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` as increasing whole numbers in 1..:data:`MAX_BATCH_SIZE` (any order in,
    duplicates refused)."""
    parts = [part.strip() for part in text.split(",")]
    if not parts or any(not part for part in parts):
        raise ValueError(f"batch sizes {text!r}: expected whole numbers separated by commas")
    sizes = []
    for part in parts:
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"batch size {part!r} is not a whole number") from None
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch size {size} is outside 1..{MAX_BATCH_SIZE}")
        sizes.append(size)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"batch sizes {text!r} repeat a size")
    return tuple(sorted(sizes))


def _load_family(
    models: Sequence[str], cache_dir: str | Path | None, say: ProgressFn
) -> tuple[dict[str, nn.Module], np.ndarray]:
    from provisioners.worker import family

    for name in models:
        family.model_spec(name)
    directory = family.ensure_family(cache_dir, progress=say)
    loaded = {name: family.load_model(name, directory) for name in models}
    return loaded, family.load_split().validation_inputs
