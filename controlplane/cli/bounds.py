"""``heteroplane bounds``: rank the fleets a budget affords by their Kairos throughput upper bound.

The math lives in ``estimator.bounds`` (KAIROS_MATH.md); this module parses the options, builds
the batch-size pmf and prints the ranking, the paper's similarity pick and the best single-type
fleet for comparison.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from controlplane.cli.common import at_most, check_seed, load_inputs
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.parsers import EMPIRICAL_DRAWS, EMPIRICAL_SEED
from estimator import deadline
from estimator.batches import FixedBatch, KairosMix, kairos_batch_pmf, parse_batch_distribution
from estimator.bounds import (
    SIMILARITY_TOP,
    KairosQuantities,
    Ranking,
    best_homogeneous,
    kairos_quantities,
    rank_configurations,
    similarity_pick,
)
from estimator.capacity import MAX_PROBE_QUERIES, Workload, fleet_capacity
from estimator.errors import FleetError, UnknownInstanceTypeError
from estimator.fleet import Fleet
from estimator.numbers import plain
from estimator.profiles import ProfileSet
from estimator.search import kairos_plus


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    if not (math.isfinite(args.deadline_s) and args.deadline_s > 0):
        raise UsageError(f"--deadline-s must be a number of seconds > 0, got {args.deadline_s}")
    check_seed(args.seed)
    # A huge budget gives the ranking more mixes than any machine could list: the search stops
    # at the deadline with a one-line reason (estimator.deadline), in bounded memory.
    with deadline.limit(args.deadline_s):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    profiles, catalog = load_inputs(args)
    types = _candidate_types(args.types, profiles.instance_types(args.model))
    prices = {name: catalog.price_usd_per_hr(name) for name in types}
    max_counts = _max_counts(args.max_count, types)
    quantities = kairos_quantities(
        profiles,
        args.model,
        types,
        prices,
        args.qos_ms,
        _batch_pmf(args.batch_dist),
        qos_statistic=args.qos_statistic,
    )
    ranking = rank_configurations(
        quantities, args.budget, max_counts, top=max(args.top, SIMILARITY_TOP), rule=args.rule
    )
    chosen = similarity_pick(ranking)
    homogeneous, homogeneous_ub = best_homogeneous(quantities, args.budget, max_counts)
    shown = min(args.top, len(ranking))
    data = {
        "model": args.model,
        "qos_ms": args.qos_ms,
        "budget_usd_per_hr": ranking.budget_usd_per_hr,
        "batch_dist": args.batch_dist,
        "rule": args.rule,
        "qos_statistic": args.qos_statistic,
        "base_type": quantities.base_type,
        "types": list(ranking.types),
        "excluded": list(quantities.excluded),
        "max_counts": max_counts,
        "thresholds": list(quantities.thresholds),
        "quantities": _quantities_json(quantities),
        "ranking": [_entry(ranking, i) for i in range(shown)],
        "chosen": {**_entry(ranking, chosen), "rank": chosen + 1},
        "best_homogeneous": {
            "fleet": dict(zip(ranking.types, homogeneous.tolist(), strict=True)),
            "upper_bound_qps": homogeneous_ub,
            "cost_usd_per_hr": float(homogeneous @ quantities.prices_usd_per_hr),
        },
        "enumerated": ranking.enumerated,
        "exhaustive": ranking.exhaustive,
        "note": _note(ranking.note, shown, len(ranking)),
    }

    if args.kairos_plus:
        data["kairos_plus"] = _kairos_plus(args, profiles, quantities, prices, max_counts)

    def human() -> str:
        text = _human(args, quantities, ranking, shown, chosen, data["best_homogeneous"])
        if "kairos_plus" in data:
            plus = data["kairos_plus"]
            text += (
                f"\n  Kairos+: {_fleet_text(plus['fleet'])} reaches {plus['allowable_qps']:.2f}"
                f" qps (simulated), after evaluating {plus['evaluations']} of"
                f" {plus['configurations']} configurations"
            )
        return text

    return emit(args.json, data, human)


def _kairos_plus(
    args: argparse.Namespace,
    profiles: ProfileSet,
    quantities: KairosQuantities,
    prices: dict[str, float],
    max_counts: dict[str, int],
) -> dict[str, Any]:
    """Kairos+ over every affordable configuration, the simulator as the evaluator."""
    if args.queries < 100:
        raise UsageError(f"--queries must be >= 100, got {args.queries}")
    at_most("--queries", args.queries, MAX_PROBE_QUERIES)
    ranking = rank_configurations(quantities, args.budget, max_counts, rule=args.rule)
    rng = np.random.default_rng(args.seed)
    sizes = parse_batch_distribution(args.batch_dist).sample(args.queries, rng)
    workload = Workload.poisson(sizes, rng)
    by_type = {t: profiles.get_profile(args.model, t) for t in ranking.types}
    progress(f"Kairos+ over {len(ranking)} configurations ({args.queries} queries a probe)")

    def evaluate(counts: np.ndarray) -> float:
        types = [t for t, n in zip(ranking.types, counts, strict=True) for _ in range(int(n))]
        return fleet_capacity(by_type, types, "kairos", args.qos_ms, workload, prices).allowable_qps

    found = kairos_plus(ranking.counts, ranking.upper_bound_qps, evaluate, progress)
    return {
        **_entry(ranking, found.best_index),
        "allowable_qps": found.best_throughput_qps,
        "evaluations": found.evaluations,
        "configurations": len(ranking),
        "pruned_by_bound": found.pruned_by_bound,
        "pruned_as_subconfiguration": found.pruned_as_subconfiguration,
    }


def _candidate_types(text: str | None, profiled: list[str]) -> list[str]:
    if text is None:
        return profiled
    names = [name.strip() for name in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise UsageError(f"--types {text!r} must look like type1,type2,...")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"--types names {', '.join(repeated)} more than once")
    return names


def _max_counts(text: str | None, types: list[str]) -> dict[str, int]:
    if text is None:
        return {}
    try:
        limits = Fleet.parse(text)
    except FleetError as error:  # malformed, negative, repeated
        raise UsageError(f"--max-count {text!r}: {error}") from None
    for name in limits:
        if name not in types:
            raise UnknownInstanceTypeError(name, types, "candidate types (--max-count)")
    return dict(limits)


def _batch_pmf(spec: str) -> tuple[np.ndarray, np.ndarray]:
    """The pmf of a batch-size spec: exact for kairos and fixed:N, else from seeded draws."""
    distribution = parse_batch_distribution(spec)
    if isinstance(distribution, KairosMix):
        return kairos_batch_pmf()
    if isinstance(distribution, FixedBatch):
        return np.array([distribution.size]), np.array([1.0])
    draws = distribution.sample(EMPIRICAL_DRAWS, np.random.default_rng(EMPIRICAL_SEED))
    sizes, counts = np.unique(draws, return_counts=True)
    return sizes, counts / counts.sum()


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _entry(ranking: Ranking, index: int) -> dict[str, Any]:
    return {
        "fleet": ranking.fleet(index),
        "upper_bound_qps": float(ranking.upper_bound_qps[index]),
        "cost_usd_per_hr": float(ranking.cost_usd_per_hr[index]),
    }


def _quantities_json(q: KairosQuantities) -> dict[str, dict[str, Any]]:
    return {
        t.instance_type: {
            "price_usd_per_hr": t.price_usd_per_hr,
            "throughput_qps": _finite(t.throughput_qps),
            "full_range": t.full_range,
            "violation_batch": t.violation_batch,
            "small_share": t.small_share,
            "time_share": t.time_share,
            "aux_rate_qps": {str(b): _finite(v) for b, v in t.aux_rate_qps.items()},
            "base_equivalents": {str(b): _finite(v) for b, v in t.base_equivalents.items()},
        }
        for t in q.types
    }


def _fleet_text(fleet: dict[str, int]) -> str:
    return ",".join(f"{name}={n}" for name, n in fleet.items() if n) or "(none)"


def _human(
    args: argparse.Namespace,
    q: KairosQuantities,
    ranking: Ranking,
    shown: int,
    chosen: int,
    homogeneous: dict[str, Any],
) -> str:
    lines = [
        f"{args.model}: QoS {args.qos_ms:g} ms ({args.qos_statistic} latency), budget"
        f" ${plain(ranking.budget_usd_per_hr)}/hr, batch mix {args.batch_dist}; base type"
        f" {q.base_type} ({q.base_rate_qps:.2f} qps on the mix)",
    ]
    if q.excluded:
        lines.append(f"  excluded (meet QoS at no batch size): {', '.join(q.excluded)}")
    lines.append("")
    lines.append(
        f"  {'type':<16}{'$/hr':>8}{'Q_t qps':>10}{'b_a':>6}{'s_a':>7}{'tau_a':>7}{'Q_a(b_a)':>10}"
    )
    for t in q.types:
        if t.full_range:
            tail = f"{'full':>6}{'':>7}{'':>7}{'':>10}"
        else:
            b_a = t.violation_batch
            assert b_a is not None
            rate = t.aux_rate_qps.get(b_a, math.nan)
            tail = f"{b_a:>6}{t.small_share:>7.3f}{t.time_share:>7.3f}{rate:>10.2f}"
        lines.append(
            f"  {t.instance_type:<16}{t.price_usd_per_hr:>8.4f}{t.throughput_qps:>10.2f}{tail}"
        )
    lines.append("")
    lines.append(f"  {_note(ranking.note, shown, len(ranking))}")
    widths = [max(len(name), 3) for name in ranking.types]
    header = "".join(f"{name:>{w + 2}}" for name, w in zip(ranking.types, widths, strict=True))
    lines.append(f"  {'rank':>4}{header}{'UB qps':>12}{'$/hr':>10}")
    for i in range(shown):
        cells = "".join(
            f"{n:>{w + 2}}" for n, w in zip(ranking.counts[i].tolist(), widths, strict=True)
        )
        mark = "  <- chosen" if i == chosen else ""
        lines.append(
            f"  {i + 1:>4}{cells}{ranking.upper_bound_qps[i]:>12.2f}"
            f"{ranking.cost_usd_per_hr[i]:>10.4f}{mark}"
        )
    lines.append("")
    lines.append(
        f"  chosen by the similarity rule: #{chosen + 1} {_fleet_text(ranking.fleet(chosen))},"
        f" UB {ranking.upper_bound_qps[chosen]:.2f} qps, ${ranking.cost_usd_per_hr[chosen]:.4f}/hr"
    )
    lines.append(
        f"  best homogeneous: {_fleet_text(homogeneous['fleet'])},"
        f" UB {homogeneous['upper_bound_qps']:.2f} qps, ${homogeneous['cost_usd_per_hr']:.4f}/hr"
    )
    return "\n".join(lines)


def _note(note: str, shown: int, kept: int) -> str:
    """The ranking's note, and how many of it are listed when fewer (``--top`` below the ten
    the similarity pick looks at: the note said "top 10 kept" over a list of 3)."""
    return note if shown >= kept else f"{note}; the first {shown} listed"
