"""``heteroplane cascade evaluate``: the demo family's models alone and the Pareto set of cascades.

Trains (or loads) the demo model family, reads its validation records, measures each model's
compute per query on this machine (its mean latency at batch size 1, ``controlplane.apps.profiler``;
or takes it from a profile file), evaluates every ordered chain of models, cheapest first, with
every threshold combination of a grid (``estimator.cascades``), and prints the Pareto set
(accuracy up, compute down). The *best* cascade is the cheapest whose accuracy is within
:data:`ACCURACY_TOLERANCE` of the most accurate single model.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controlplane.apps import profiler
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.profile import load_family, parse_models
from controlplane.policies.cascade_choice import ACCURACY_TOLERANCE, best_point
from estimator.cascades import (
    DEFAULT_THRESHOLD_GRID,
    CascadePoint,
    ValidationRecords,
    load_validation,
    pareto_cascades,
)
from estimator.profiles import load_profiles

DEFAULT_MAX_STAGES = 3
# Timed runs per model at batch size 1: the mean of 500 runs of a sub-millisecond model is stable
# to a few percent even on a shared machine, and all of them take well under a second.
DEFAULT_COMPUTE_SAMPLES = 500
DEFAULT_COMPUTE_WARMUP = 50


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cascade evaluate``."""
    parser = subparsers.add_parser(
        "cascade",
        help="evaluate cascades of the demo model family (accuracy against compute)",
        description="Cascades of the demo model family: a query stops at the first model whose"
        " certainty (top-1 minus top-2 softmax score) reaches that stage's threshold.",
    )
    actions = parser.add_subparsers(dest="cascade_command", metavar="ACTION")
    actions.required = True
    evaluate = actions.add_parser(
        "evaluate",
        help="each model alone and the Pareto set of cascades: accuracy, compute, reach",
        description="Train or load the demo family, measure each model's compute per query here"
        " (mean latency at batch size 1), evaluate every chain of models (cheapest first, up to"
        " --max-stages) with every threshold combination of --thresholds on the validation"
        " records, and print each model alone and the Pareto set of cascades (accuracy against"
        " compute per query, with the share of queries reaching each stage). The best cascade"
        f" is the cheapest within {ACCURACY_TOLERANCE * 100:g} points of the most accurate"
        " single model.",
    )
    evaluate.add_argument(
        "--models", metavar="M1,M2,...", help="models of the family to use (default: all)"
    )
    evaluate.add_argument(
        "--max-stages",
        type=int,
        default=DEFAULT_MAX_STAGES,
        metavar="K",
        help="longest chain of models (default %(default)s)",
    )
    evaluate.add_argument(
        "--thresholds",
        default=",".join(f"{h:g}" for h in DEFAULT_THRESHOLD_GRID),
        metavar="H1,H2,...",
        help="certainty thresholds to try at each stage, in [0, 1] (default %(default)s)",
    )
    evaluate.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="the family's model cache (default: $HETEROPLANE_DATA_DIR/models)",
    )
    evaluate.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_COMPUTE_SAMPLES,
        metavar="N",
        help="timed runs per model at batch size 1 (default %(default)s)",
    )
    evaluate.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_COMPUTE_WARMUP,
        metavar="N",
        help="untimed runs before them (default %(default)s)",
    )
    evaluate.add_argument(
        "--threads",
        type=int,
        default=profiler.DEFAULT_THREADS,
        metavar="N",
        help="torch threads while timing (default %(default)s)",
    )
    evaluate.add_argument(
        "--profiles",
        type=Path,
        metavar="FILE",
        help="take compute from this profile file (mean latency at batch size 1) instead of"
        " measuring it",
    )
    evaluate.add_argument(
        "--instance-type",
        default=profiler.REFERENCE_TYPE,
        metavar="T",
        help="with --profiles: whose latency is the compute (default %(default)s)",
    )
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(handler=run_evaluate)


def parse_thresholds(text: str) -> tuple[float, ...]:
    """``0.1,0.5,0.9`` as distinct numbers in [0, 1], increasing."""
    parts = [part.strip() for part in text.split(",")]
    if any(not part for part in parts):
        raise UsageError(f"--thresholds {text!r}: expected numbers separated by commas")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise UsageError(f"--thresholds: {part!r} is not a number") from None
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise UsageError(f"--thresholds: {part} is outside [0, 1]")
        values.append(value)
    return tuple(sorted(set(values)))


def run_evaluate(args: argparse.Namespace) -> int:
    family = load_family()
    models = parse_models(args.models)
    grid = parse_thresholds(args.thresholds)
    if args.max_stages < 1:
        raise UsageError(f"--max-stages must be >= 1, got {args.max_stages}")
    if args.samples < 1 or args.warmup < 0 or args.threads < 1:
        raise UsageError("--samples and --threads must be >= 1 and --warmup >= 0")
    profiles = load_profiles(args.profiles) if args.profiles is not None else None

    directory = family.ensure_family(args.cache_dir, progress=progress)
    records = load_validation(directory / family.VALIDATION_FILE)
    if profiles is not None:
        compute_ms = {
            name: profiles.get_profile(name, args.instance_type).mean_latency_ms(1)
            for name in models
        }
        compute_source = f"{args.profiles}, {args.instance_type}"
    else:
        settings = profiler.MeasureSettings(args.samples, args.warmup, args.threads)
        compute_ms = profiler.measure_compute_ms(
            models, settings, cache_dir=directory, progress=progress
        )
        compute_source = (
            f"measured on {profiler.REFERENCE_TYPE} (this machine), {args.samples} runs,"
            f" {args.threads} thread{'s' if args.threads > 1 else ''}"
        )
    progress(f"evaluating cascades of up to {args.max_stages} models, {len(grid)} thresholds")
    front = pareto_cascades(
        records, compute_ms, models=models, grid=grid, max_length=args.max_stages
    )
    data = evaluation(records, models, compute_ms, front)
    data["compute_source"] = compute_source
    data["thresholds"] = list(grid)
    data["max_stages"] = args.max_stages
    return emit(args.json, data, lambda: _human(data))


def evaluation(
    records: ValidationRecords,
    models: Sequence[str],
    compute_ms: dict[str, float],
    front: Sequence[CascadePoint],
) -> dict[str, Any]:
    """The command's JSON object: each model alone, the Pareto cascades, and the best one."""
    singles: list[dict[str, Any]] = [
        {
            "name": name,
            "accuracy": records.model_accuracy(name),
            "compute_ms_per_query": compute_ms[name],
            "params": int(records.params[records.model_index(name)]),
        }
        for name in models
    ]
    top = max(singles, key=lambda m: (m["accuracy"], -m["compute_ms_per_query"]))
    best = best_point(front, float(top["accuracy"]))
    cascades = [
        {
            **point.cascade.to_document(),
            "label": point.cascade.label,
            "accuracy": point.quality.accuracy,
            "compute_ms_per_query": point.compute_ms_per_query,
            "reach_share": list(point.quality.reach_share),
            "answered_share": list(point.quality.answered_share),
            "best": point is best,
        }
        for point in front
    ]
    best_entry = next((c for c in cascades if c["best"]), None)
    ratio = (
        float(top["compute_ms_per_query"]) / best_entry["compute_ms_per_query"]
        if best_entry is not None and best_entry["compute_ms_per_query"] > 0
        else None
    )
    return {
        "dataset": records.dataset,
        "validation_samples": records.n_samples,
        "models": singles,
        "cascades": cascades,
        "most_accurate_model": top["name"],
        "accuracy_tolerance": ACCURACY_TOLERANCE,
        "best": best_entry,
        "compute_ratio": ratio,
    }


def _human(data: dict[str, Any]) -> str:
    lines = [
        f"{data['dataset']}: {data['validation_samples']} validation samples;"
        f" compute per query = mean latency at batch size 1, {data['compute_source']}",
        "",
        f"{'model':<10}{'accuracy':>10}{'compute ms/query':>18}{'params':>10}",
    ]
    for m in data["models"]:
        lines.append(
            f"{m['name']:<10}{m['accuracy'] * 100:>9.2f}%{m['compute_ms_per_query']:>18.4f}"
            f"{m['params']:>10,}"
        )
    width = max(len(c["label"]) for c in data["cascades"]) + 2
    lines += [
        "",
        "Pareto set of cascades, cheapest first (* = best):",
        f"  {'cascade':<{width}}{'accuracy':>10}{'compute ms/query':>18}  reach share per stage",
    ]
    for c in data["cascades"]:
        mark = "*" if c["best"] else " "
        reach = ", ".join(f"{r:.3f}" for r in c["reach_share"])
        lines.append(
            f"{mark} {c['label']:<{width}}{c['accuracy'] * 100:>9.2f}%"
            f"{c['compute_ms_per_query']:>18.4f}  {reach}"
        )
    best = data["best"]
    top = next(m for m in data["models"] if m["name"] == data["most_accurate_model"])
    if best is None:
        lines.append("no cascade comes within the tolerance of the most accurate model")
    else:
        lines += [
            "",
            f"best: {best['label']}: {best['accuracy'] * 100:.2f}% against"
            f" {top['accuracy'] * 100:.2f}% for {top['name']} alone, at"
            f" {best['compute_ms_per_query']:.4f} ms/query, {data['compute_ratio']:.1f}x less"
            " compute",
        ]
    return "\n".join(lines)
