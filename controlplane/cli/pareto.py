"""``heteroplane plan --pareto``: the latency/quality Pareto front of a cascade app (Cascadia).

``plan`` hooks this in with two lines: ``add_pareto_arguments(parser)`` in its parser
(:mod:`controlplane.cli.parsers`, re-exported here), and ``if args.pareto: return run_pareto(args)``
at the top of its handler. It reuses ``plan``'s ``--spec``, ``--trace``, ``--seed`` and
``--json``. The algorithm lives in ``estimator.allocation`` (Cascadia's MILP allocation of
instances to stages inside a weighted-Tchebycheff sweep of the thresholds); this module loads the
inputs and prints the front.
"""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.parsers import PARETO_GRID, add_pareto_arguments
from controlplane.spec import ResolvedApp, load_spec, resolve_spec
from estimator.allocation import ParetoPoint, tchebycheff_front
from estimator.cascades import ValidationRecords, load_validation
from estimator.numbers import plain
from estimator.traces import Trace, read_trace_csv, trace_stats

__all__ = ["PARETO_GRID", "add_pareto_arguments", "pareto_front", "run_pareto"]


def _grid(text: str) -> tuple[float, ...]:
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


def pareto_front(
    app: ResolvedApp,
    records: ValidationRecords,
    trace: Trace,
    grid: tuple[float, ...] = PARETO_GRID,
) -> tuple[ParetoPoint, ...]:
    """The app's cascade (``serving_order``) front at the trace's mean rate: one instance of type
    t serves model m at mu = 1000 / E_q[L_{m,t}(b_q)] queries per second over the trace's batch
    sizes; the budget and ``max_counts`` of the spec bound the allocation."""
    order = app.spec.serving_order
    for model in order:
        records.model_index(model)
    rates = {
        m: {t: app.profile(m, t).rate_qps(trace.batch_size) for t in app.instance_types}
        for m in order
    }
    caps = {t: n for t in app.instance_types if (n := app.spec.max_count(t)) is not None}
    prices = {t: app.prices_usd_per_hr[t] for t in app.instance_types if caps.get(t) != 0}
    return tchebycheff_front(
        records,
        order,
        {m: {t: mu for t, mu in r.items() if t in prices} for m, r in rates.items()},
        trace_stats(trace).rate_qps,
        prices,
        grid=grid,
        budget_usd_per_hr=app.spec.budget_usd_per_hr,
        max_counts=caps or None,
    )


def run_pareto(args: argparse.Namespace) -> int:
    """The ``plan --pareto`` handler: reads ``--spec``, ``--trace``, ``--validation``."""
    if args.validation is None:
        raise UsageError("--pareto needs --validation FILE (the cascade's validation records)")
    grid = PARETO_GRID if args.thresholds is None else _grid(args.thresholds)
    app = resolve_spec(load_spec(args.spec))
    if len(app.spec.serving_order) < 2:
        raise UsageError("--pareto needs a cascade: the spec has one model")
    records = load_validation(args.validation)
    trace = read_trace_csv(args.trace)
    stats = trace_stats(trace)
    progress(
        f"sweeping {len(grid)}^{len(app.spec.serving_order) - 1} threshold settings of"
        f" {' -> '.join(app.spec.serving_order)} at {stats.rate_qps:.2f} qps"
    )
    front = pareto_front(app, records, trace, grid)
    data: dict[str, Any] = {
        "app": app.spec.name,
        "cascade": list(app.spec.serving_order),
        "rate_qps": stats.rate_qps,
        "budget_usd_per_hr": app.spec.budget_usd_per_hr,
        "thresholds": list(grid),
        "front": [
            {
                **p.cascade.to_document(),
                "label": p.cascade.label,
                "accuracy": p.quality.accuracy,
                "reach_share": list(p.quality.reach_share),
                "worst_stage_latency_ms": p.latency_ms,
                "bottleneck": p.allocation.bottleneck,
                "stage_latency_ms": list(p.allocation.latency_ms),
                "fleets": [dict(f) for f in p.allocation.fleets],
                "cost_usd_per_hr": p.allocation.cost_usd_per_hr,
                "weight_ratios": list(p.weight_ratios),
            }
            for p in front
        ],
        "seed": args.seed,
    }
    return emit(args.json, data, lambda: _human(data))


def _human(data: dict[str, Any]) -> str:
    lines = [
        f"{data['app']}: latency/accuracy Pareto front of {' -> '.join(data['cascade'])} at"
        f" {data['rate_qps']:.2f} qps, budget ${plain(data['budget_usd_per_hr'])}/hr"
        " (worst stage latency: M/D/1 per stage, Cascadia's MILP allocation)",
        f"  {'thresholds':<14}{'accuracy':>9}{'worst ms':>10}  {'bottleneck':<12}{'$/hr':>8}"
        "  allocation",
    ]
    for point in data["front"]:
        thresholds = ",".join(f"{h:g}" for h in point["thresholds"])
        fleets = "; ".join(
            f"{m}: " + (", ".join(f"{n} x {t}" for t, n in fleet.items()) or "none")
            for m, fleet in zip(point["models"], point["fleets"], strict=True)
        )
        lines.append(
            f"  {thresholds:<14}{100 * point['accuracy']:>8.2f}%"
            f"{point['worst_stage_latency_ms']:>10.2f}  {point['bottleneck']:<12}"
            f"{point['cost_usd_per_hr']:>8.3f}  {fleets}"
        )
    return "\n".join(lines)
