"""``heteroplane profile``: measure the demo family's latency profiles here, or summarise a file.

``profile measure`` starts a worker agent of each instance type to profile on this machine (the
reference type ``local.cpu``, serving the models as they are, and the emulated types, padding to
their compute curves), times batches of each model at each batch size through them over HTTP,
and writes the project's profile JSON: the end-to-end profiles the planner reads, and the compute
curves the emulated workers pad to (its ``compute`` section). ``--compute-only`` times the models'
forward pass in this process instead. The timing lives in ``controlplane.apps.profiler``.
``profile show`` summarises any profile file (the JSON or a Kairos samples CSV): mean latency per
model, instance type and batch size.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.apps import profiler
from controlplane.cli.output import UsageError, emit, progress
from estimator.catalog import Catalog, InstanceType, default_catalog, load_catalog
from estimator.profiles import LatencyProfile, ProfileSet, load_profiles, write_profiles_json

if TYPE_CHECKING:
    from types import ModuleType


def load_family() -> ModuleType:
    """``provisioners.worker.family``, or a one-line :class:`UsageError` when torch is missing."""
    try:
        from provisioners.worker import family
    except ImportError as error:
        raise UsageError(
            f"needs torch and scikit-learn ({error}); install the worker extra:"
            " pip install -e '.[worker]'"
        ) from None
    return family


def parse_models(text: str | None) -> list[str]:
    """The family models named by ``--models`` (all of them by default), in family order."""
    family = load_family()
    if text is None:
        return list(family.MODEL_NAMES)
    names = [part.strip() for part in text.split(",")]
    if not names or any(not name for name in names):
        raise UsageError(f"--models {text!r}: expected model names separated by commas")
    for name in names:
        if name not in family.MODEL_NAMES:
            raise UsageError(
                f"--models: unknown model {name!r} (the family: {', '.join(family.MODEL_NAMES)})"
            )
    if len(set(names)) != len(names):
        raise UsageError(f"--models {text!r} names a model twice")
    return [name for name in family.MODEL_NAMES if name in names]


def measure_settings(args: argparse.Namespace) -> profiler.MeasureSettings:
    if args.samples < 1:
        raise UsageError(f"--samples must be >= 1, got {args.samples}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    return profiler.MeasureSettings(args.samples, args.warmup, args.threads)


def check_writable(path: Path, option: str = "--out") -> None:
    """Refuse an output path that cannot be written before the long work, not after it."""
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


def _emulated(text: str | None, catalog: Catalog) -> list[InstanceType]:
    if text is None:
        return profiler.emulated_types(catalog)
    names = [part.strip() for part in text.split(",")]
    if any(not name for name in names):
        raise UsageError(f"--instance-types {text!r}: expected type names separated by commas")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:  # as --batch-sizes refuses a size repeated
        raise UsageError(f"--instance-types: {', '.join(twice)} given twice; name each type once")
    types = []
    for name in names:
        if name == profiler.REFERENCE_TYPE:
            continue  # always measured
        itype = catalog[name]  # UnknownInstanceTypeError lists the known names
        if name in default_catalog() and itype.family != profiler.EMULATED_FAMILY:
            raise UsageError(
                f"--instance-types: {name} is a real instance type; profile it on that machine"
                " (emulated types are the emu.* ones, or types a --catalog file adds)"
            )
        types.append(itype)
    return types


def run_measure(args: argparse.Namespace) -> int:
    family = load_family()
    models = parse_models(args.models)
    try:
        batch_sizes = profiler.parse_batch_sizes(args.batch_sizes)
    except ValueError as error:
        raise UsageError(f"--batch-sizes: {error}") from None
    settings = measure_settings(args)
    catalog = load_catalog(args.catalog)
    types = _emulated(args.instance_types, catalog)
    out: Path = args.out
    if out is None:
        out = family.default_data_dir() / "profiles" / "family.json"
        out.parent.mkdir(parents=True, exist_ok=True)
    check_writable(out)

    compute = profiler.emulated_compute(models)
    measurement: profiler.Measurement
    if args.compute_only:
        measurement = "compute_only"
        measured = profiler.measure_family(
            models, batch_sizes, settings, cache_dir=args.cache_dir, progress=progress
        )
        profiles = measured + profiler.emulated_profiles(measured, types, compute)
    else:
        measurement = "serving_path"
        reference = catalog[profiler.REFERENCE_TYPE]
        profiles = profiler.measure_serving_path(
            models,
            batch_sizes,
            [reference, *types],
            settings,
            cache_dir=args.cache_dir,
            compute=compute,
            progress=progress,
        )
    meta = profiler.profile_meta(settings, types, compute, measurement)
    write_profiles_json(profiles, out, **meta)
    data = {
        "out": str(out),
        "measurement": measurement,
        "reference_type": profiler.REFERENCE_TYPE,
        "instance_types": [profiler.REFERENCE_TYPE, *(t.name for t in types)],
        "models": models,
        "batch_sizes": list(batch_sizes),
        "samples": settings.samples,
        "compute": meta["compute"],
        "profiles": [_summary(p) for p in profiles],
    }
    return emit(args.json, data, lambda: f"wrote {out}\n" + _table(profiles, measurement))


def run_show(args: argparse.Namespace) -> int:
    profiles = load_profiles(args.file)
    cells = _ordered(profiles)
    meta = _json_meta(args.file)
    measurement = meta.get("measurement")
    data: dict[str, Any] = {
        "file": str(args.file),
        "models": profiles.models,
        "instance_types": sorted({p.instance_type for p in cells}),
        "profiles": [_summary(p) for p in cells],
    }
    for key in ("measurement", "compute"):
        if key in meta:
            data[key] = meta[key]

    def text() -> str:
        lines = [f"{args.file}: {len(cells)} profiles", _table(cells, measurement)]
        compute = meta.get("compute")
        models = compute.get("models") if isinstance(compute, dict) else None
        if isinstance(models, dict) and models:
            lines.append("compute the emulated workers pad to: (base_ms + per_row_ms * b) / f")
            lines += [
                f"  {name}: base_ms {curve.get('base_ms')}, per_row_ms {curve.get('per_row_ms')}"
                for name, curve in models.items()
                if isinstance(curve, dict)
            ]
        return "\n".join(lines)

    return emit(args.json, data, text)


def _json_meta(path: Path) -> dict[str, Any]:
    """The top-level keys of a profile JSON file other than its profiles ({} for a CSV)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, ValueError, RecursionError):
        return {}
    if not isinstance(document, dict):
        return {}
    return {key: value for key, value in document.items() if key != "profiles"}


def _ordered(profiles: ProfileSet) -> list[LatencyProfile]:
    return [profiles[key] for key in sorted(profiles)]


def _summary(profile: LatencyProfile) -> dict[str, Any]:
    return {
        "model": profile.model,
        "instance_type": profile.instance_type,
        "batch_sizes": profile.batch_sizes.tolist(),
        "mean_ms": profile.mean_ms.tolist(),
        "p99_ms": profile.p99_ms.tolist(),
        "samples": [int(cell.size) for cell in profile.samples_ms],
    }


def _table(profiles: list[LatencyProfile], measurement: str | None = None) -> str:
    """Mean latency (ms) by batch size, one row per model and instance type."""
    sizes = sorted({int(b) for p in profiles for b in p.batch_sizes})
    head = ["model", "instance type", *(f"b={b}" for b in sizes)]
    rows = []
    for p in profiles:
        means = dict(zip(p.batch_sizes.tolist(), p.mean_ms.tolist(), strict=True))
        rows.append(
            [p.model, p.instance_type, *(f"{means[b]:.4g}" if b in means else "-" for b in sizes)]
        )
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    title = "  ".join(cell.ljust(w) for cell, w in zip(head, widths, strict=True))
    what = {
        "serving_path": "mean latency through each type's worker (end to end), ms",
        "compute_only": "mean compute latency, ms",
    }.get(measurement or "", "mean latency, ms")
    return "\n".join([what, title, *lines])
