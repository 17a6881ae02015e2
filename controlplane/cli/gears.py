"""``heteroplane gears``: the gear plan of a cascade app on a fixed placement (CascadeServe).

The algorithm lives in ``controlplane.policies.gears`` (docs/cascades.md, "Cascades, gears and
allocation"); this module reads the spec, the validation records, the profiles and the placement
(``--placement`` text, or the fleets of a ``heteroplane plan --json`` document) and prints the
gear plan: the finalist cascades with their max sustainable QPS under the SLO, and the gear of
each QPS range.

Held-out protocol (docs/cascades.md): the records are split (``ValidationRecords.split``, half and
half); thresholds and gears are chosen on the *choose* split and every finalist is scored on the
*score* split. Each option and gear carries ``accuracy`` (in-sample) and ``held_out_accuracy``;
the spec's accuracy floor is checked against the held-out figure.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from controlplane.cli.common import check_seed
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.parsers import MAX_GEAR_QPS, MAX_GEAR_RANGES
from controlplane.policies.gears import CascadePlacement, GearPlan, plan_gears
from controlplane.policies.replay import read_plan
from controlplane.policies.variants import percent_places
from controlplane.spec import ResolvedApp, load_spec, resolve_spec
from estimator.cascades import DEFAULT_CHOOSE_SHARE, DEFAULT_SPLIT_SEED, load_validation
from estimator.errors import BatchSizeOutOfRangeError
from estimator.fleet import Fleet
from estimator.numbers import plain


def parse_grid(text: str) -> tuple[float, ...]:
    """``0.1,0.5,0.9`` as distinct numbers in [0, 1], increasing."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise UsageError(f"--thresholds: {part!r} is not a number") from None
        if not 0.0 <= value <= 1.0:
            raise UsageError(f"--thresholds: {part} is outside [0, 1]")
        values.append(value)
    return tuple(sorted(set(values)))


def load_app(spec_path: Path, profiles: Path | None) -> ResolvedApp:
    """The spec resolved against its catalog and profiles (``profiles`` replacing the files the
    spec names, for every model)."""
    spec = load_spec(spec_path)
    if profiles is not None:
        models = [m.model_copy(update={"profiles": str(profiles)}) for m in spec.models]
        spec = spec.model_copy(update={"models": models})
    return resolve_spec(spec)


def placement_from(args: argparse.Namespace, app: ResolvedApp) -> CascadePlacement:
    order = app.spec.serving_order
    if args.placement is not None:
        placement = CascadePlacement.parse(args.placement)
    else:
        plan = read_plan(args.plan)
        fleets: dict[str, Fleet] = {s.name: s.fleet for s in plan.stages}
        others = sorted(set(fleets) - set(order))
        if others:
            raise UsageError(
                f"the plan's stage(s) {', '.join(map(repr, others))} are not models of the app"
                f" ({', '.join(order)}): a plan made for another spec"
            )
        placement = CascadePlacement(fleets, tuple(m for m in order if m in fleets))
    for model in placement.order:
        if model not in order:
            raise UsageError(f"the placement names {model!r}, not a model of the app")
        for t in placement.fleets[model]:
            if t not in app.prices_usd_per_hr:
                raise UsageError(
                    f"the placement's type {t!r} is not one of the spec's instance types"
                    f" ({', '.join(app.instance_types)})"
                )
    cost = placement.cost_usd_per_hr(app.prices_usd_per_hr)
    if cost > app.spec.budget_usd_per_hr + 1e-9:
        # As replay refuses a plan over the budget: the service would never run this fleet.
        raise UsageError(
            f"the placement costs {cost:.4g} USD/hr, over the app's budget of"
            f" {plain(app.spec.budget_usd_per_hr)} USD/hr"
        )
    # Serving order is the spec's, whatever order the placement was written in.
    return CascadePlacement(placement.fleets, tuple(m for m in order if m in placement.fleets))


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.ranges <= MAX_GEAR_RANGES:
        raise UsageError(f"--ranges must be in 1..{MAX_GEAR_RANGES:,}, got {args.ranges}")
    if args.qps_max is not None and not (
        math.isfinite(args.qps_max) and 0 < args.qps_max <= MAX_GEAR_QPS
    ):
        raise UsageError(
            f"--qps-max must be a number in (0, {MAX_GEAR_QPS:,.0f}] qps, got {args.qps_max:g}"
        )
    check_seed(args.seed)
    grid = parse_grid(args.thresholds)
    app = load_app(args.spec, args.profiles)
    records = load_validation(args.validation)
    placement = placement_from(args, app)
    for model in placement.order:
        records.model_index(model)
    share = getattr(args, "choose_share", DEFAULT_CHOOSE_SHARE)
    split_seed = getattr(args, "split_seed", DEFAULT_SPLIT_SEED)
    choose, score = records.split(share, split_seed)
    profiles = {m: {t: app.profile(m, t) for t in placement.fleets[m]} for m in placement.order}
    batch_size = getattr(args, "batch_size", 1)
    try:
        for by_type in profiles.values():
            for profile in by_type.values():
                profile.check_batch_size(batch_size)
    except BatchSizeOutOfRangeError as error:
        raise UsageError(
            f"--batch-size {batch_size}: the profile of {error.model} on {error.instance_type}"
            f" measures batch sizes {error.low}..{error.high}; give the samples in each query"
            " with --batch-size within every placed profile's range"
        ) from None
    slo = app.spec.slo
    progress(f"planning gears for {app.spec.name} on {placement}")
    plan = plan_gears(
        choose,
        placement,
        profiles,
        app.prices_usd_per_hr,
        slo_ms=slo.latency_ms,
        percentile=slo.percentile,
        accuracy_floor=slo.accuracy,
        qps_max=args.qps_max,
        n_ranges=args.ranges,
        grid=grid,
        batch_size=batch_size,
        seed=args.seed,
        held_out=score,
    )
    data: dict[str, Any] = {
        "app": app.spec.name,
        "validation": str(args.validation),
        **plan.to_document(),
        "cost_usd_per_hr": placement.cost_usd_per_hr(app.prices_usd_per_hr),
        "batch_size": batch_size,
        "seed": args.seed,
        "split": {
            "choose_share": share,
            "seed": split_seed,
            "choose_samples": choose.n_samples,
            "score_samples": score.n_samples,
        },
    }
    return emit(args.json, data, lambda: human(data, plan))


def human(data: dict[str, Any], plan: GearPlan) -> str:
    floor = plan.accuracy_floor
    goal = (
        f"held-out accuracy >= {100 * floor:.2f}%, fastest first"
        if floor is not None
        else "most accurate within the SLO"
    )
    lines = [
        f"{data['app']}: gear plan on {plan.placement} (${data['cost_usd_per_hr']:.3f}/hr),"
        f" P{plan.percentile:.15g} <= {plan.slo_ms:g} ms, {goal}",
        f"  {data['candidates']} candidate cascades, {len(plan.options)} finalists,"
        f" {plan.simulations} simulations",
        f"  chosen on {data['split']['choose_samples']} validation samples (in-sample), scored on"
        f" the other {data['split']['score_samples']} (held-out)",
        "  finalists (max QPS within the SLO; accuracy held-out / in-sample):",
    ]
    for option in plan.options:
        caps = ",".join(str(k) for k in option.max_batch_queries)
        lines.append(
            f"    {option.cascade.label:<44} {100 * option.accuracy:6.2f}% /"
            f" {100 * option.quality.accuracy:6.2f}%"
            f" {option.max_qps:>10.1f} qps  batch caps {caps}"
        )
    lines.append("  gears:")
    # Enough decimals that every range's bounds differ (one for the usual ranges of several
    # qps; `--qps-max 0.001 --ranges 2` printed two ranges of [0.0, 0.0)).
    width = min((g.high_qps - g.low_qps for g in plan.gears if g.high_qps > g.low_qps), default=1)
    digits = min(max(1, math.ceil(-math.log10(width)) + 1), 9)
    for gear in plan.gears:
        option = plan.options[gear.option]
        places, flag = 2, ""
        if floor is not None and option.accuracy < floor:
            # As many decimals as show it under the floor: 98.329% against 98.33% read
            # "98.33% held-out ... (does not meet the SLO)" under a goal of ">= 98.33%".
            places = percent_places(option.accuracy, floor)
            flag = (
                f"  (does not meet the SLO: under the accuracy floor of {100 * floor:.{places}f}%)"
            )
        elif not gear.meets_slo:
            flag = (
                f"  (does not meet the SLO: it sustains {option.max_qps:.1f} qps within"
                f" P{plan.percentile:.15g} <= {plan.slo_ms:g} ms)"
            )
        lines.append(
            f"    [{gear.low_qps:>9.{digits}f}, {gear.high_qps:>9.{digits}f}) qps:"
            f" {option.cascade.label}"
            f" ({100 * option.accuracy:.{places}f}% held-out,"
            f" {100 * option.quality.accuracy:.2f}% in-sample){flag}"
        )
    return "\n".join(lines)
