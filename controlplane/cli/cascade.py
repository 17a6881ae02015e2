"""``heteroplane cascade evaluate``: the demo family's models alone and the Pareto set of cascades
(with ``--app``: the validation records of an app's registered models instead,
:mod:`controlplane.cli.cascade_registered`).

Trains (or loads) the demo model family, reads its validation records, measures each model's
compute per query on this machine (its mean latency at batch size 1, ``controlplane.apps.profiler``;
or takes it from a profile file), evaluates every ordered chain of models, cheapest first, with
every threshold combination of a grid (``estimator.cascades``), and prints the Pareto set
(accuracy up, compute down). The *best* cascade is the cheapest whose accuracy is within
:data:`ACCURACY_TOLERANCE` of the most accurate single model.

Held-out protocol (``controlplane.policies.cascade_choice.choose_held_out``): the front, the most
accurate model and the best cascade are chosen on the *choose* half of the validation records;
every model and cascade is also scored on the *score* half. ``accuracy`` is the in-sample
(choose split) figure, ``held_out_accuracy`` the score split's, the one to quote.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from controlplane.apps import profiler
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.profile import load_family, parse_models
from controlplane.policies.cascade_choice import (
    ACCURACY_TOLERANCE,
    HeldOutChoice,
    choose_held_out,
)
from estimator.cascades import (
    DEFAULT_CHOOSE_SHARE,
    DEFAULT_SPLIT_SEED,
    ValidationRecords,
    load_validation,
)
from estimator.profiles import load_profiles


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
    if getattr(args, "app", None) is not None:
        # An app's registered models, fetched from the service: controlplane.cli.cascade_registered.
        from controlplane.cli.cascade_registered import run_evaluate_app

        return run_evaluate_app(args)
    if getattr(args, "data", None) is not None or getattr(args, "out", None) is not None:
        raise UsageError("--data and --out go with --app (an app's registered models)")
    family = load_family()
    models = parse_models(args.models)
    grid = parse_thresholds(args.thresholds)
    if args.max_stages < 1:
        raise UsageError(f"--max-stages must be >= 1, got {args.max_stages}")
    if args.samples < 1 or args.warmup < 0 or args.threads < 1:
        raise UsageError("--samples and --threads must be >= 1 and --warmup >= 0")
    if args.instance_type is not None and args.profiles is None:
        raise UsageError("--instance-type goes with --profiles (whose latency is the compute)")
    profiles = load_profiles(args.profiles) if args.profiles is not None else None
    instance_type = args.instance_type or profiler.REFERENCE_TYPE

    directory = family.ensure_family(args.cache_dir, progress=progress)
    records = load_validation(directory / family.VALIDATION_FILE)
    if profiles is not None:
        compute_ms = {
            name: profiles.get_profile(name, instance_type).mean_latency_ms(1) for name in models
        }
        compute_source = f"{args.profiles}, {instance_type}"
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
    choice = choose_held_out(
        records,
        compute_ms,
        models=models,
        grid=grid,
        max_length=args.max_stages,
        share=getattr(args, "choose_share", DEFAULT_CHOOSE_SHARE),
        seed=getattr(args, "split_seed", DEFAULT_SPLIT_SEED),
    )
    data = evaluation(records, models, compute_ms, choice)
    data["compute_source"] = compute_source
    data["thresholds"] = list(grid)
    data["max_stages"] = args.max_stages
    return emit(args.json, data, lambda: _human(data))


def evaluation(
    records: ValidationRecords,
    models: Sequence[str],
    compute_ms: dict[str, float],
    choice: HeldOutChoice,
) -> dict[str, Any]:
    """The command's JSON object: each model alone, the Pareto cascades, and the best one, each
    with its in-sample (``accuracy``, the choose split) and ``held_out_accuracy`` (score split)."""
    singles: list[dict[str, Any]] = [
        {
            "name": name,
            "accuracy": choice.choose.model_accuracy(name),
            "held_out_accuracy": choice.score.model_accuracy(name),
            "compute_ms_per_query": compute_ms[name],
            "params": int(records.params[records.model_index(name)]),
        }
        for name in models
    ]
    top = next(m for m in singles if m["name"] == choice.top_model)
    best = choice.best
    cascades = [
        {
            **point.cascade.to_document(),
            "label": point.cascade.label,
            "accuracy": point.quality.accuracy,
            "held_out_accuracy": choice.held_out_accuracy(point.cascade),
            "compute_ms_per_query": point.compute_ms_per_query,
            "reach_share": list(point.quality.reach_share),
            "answered_share": list(point.quality.answered_share),
            "best": point is best,
        }
        for point in choice.front
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
        "split": {
            "choose_share": choice.share,
            "seed": choice.seed,
            "choose_samples": choice.choose.n_samples,
            "score_samples": choice.score.n_samples,
        },
        "models": singles,
        "cascades": cascades,
        "most_accurate_model": top["name"],
        "accuracy_tolerance": ACCURACY_TOLERANCE,
        "best": best_entry,
        "compute_ratio": ratio,
    }


def _human(data: dict[str, Any]) -> str:
    split = data["split"]
    lines = [
        f"{data['dataset']}: {data['validation_samples']} validation samples;"
        f" compute per query = mean latency at batch size 1, {data['compute_source']}",
        f"thresholds chosen on {split['choose_samples']} samples (in-sample), scored on the other"
        f" {split['score_samples']} (held-out; split seed {split['seed']})",
        "",
        f"{'model':<10}{'in-sample':>10}{'held-out':>10}{'compute ms/query':>18}{'params':>10}",
    ]
    for m in data["models"]:
        lines.append(
            f"{m['name']:<10}{m['accuracy'] * 100:>9.2f}%{m['held_out_accuracy'] * 100:>9.2f}%"
            f"{m['compute_ms_per_query']:>18.4f}{m['params']:>10,}"
        )
    width = max(len(c["label"]) for c in data["cascades"]) + 2
    lines += [
        "",
        "Pareto set of cascades, cheapest first (* = best):",
        f"  {'cascade':<{width}}{'in-sample':>10}{'held-out':>10}{'compute ms/query':>18}"
        "  reach share per stage",
    ]
    for c in data["cascades"]:
        mark = "*" if c["best"] else " "
        reach = ", ".join(f"{r:.3f}" for r in c["reach_share"])
        lines.append(
            f"{mark} {c['label']:<{width}}{c['accuracy'] * 100:>9.2f}%"
            f"{c['held_out_accuracy'] * 100:>9.2f}%{c['compute_ms_per_query']:>18.4f}  {reach}"
        )
    best = data["best"]
    top = next(m for m in data["models"] if m["name"] == data["most_accurate_model"])
    if best is None:
        lines.append("no cascade comes within the tolerance of the most accurate model")
    elif best["models"] == [top["name"]]:
        # The most accurate model alone: "1.0x less compute" than itself said nothing.
        lines += [
            "",
            f"best: {top['name']} alone ({best['held_out_accuracy'] * 100:.2f}% held-out,"
            f" {best['accuracy'] * 100:.2f}% in-sample, {best['compute_ms_per_query']:.4f}"
            " ms/query): no cascade as accurate within the tolerance needs less compute",
        ]
    else:
        lines += [
            "",
            f"best: {best['label']}: {best['held_out_accuracy'] * 100:.2f}% held-out"
            f" ({best['accuracy'] * 100:.2f}% in-sample) against"
            f" {top['held_out_accuracy'] * 100:.2f}% ({top['accuracy'] * 100:.2f}%) for"
            f" {top['name']} alone, at {best['compute_ms_per_query']:.4f} ms/query,"
            f" {data['compute_ratio']:.1f}x less compute",
        ]
    return "\n".join(lines)
