"""``heteroplane plan``: the cheapest fleet, batch size and replicas that meet an app's SLO.

The algorithm lives in ``controlplane.policies.planner`` (InferLine Algorithms 1 and 2 over
Kairos-ranked instance mixes, docs/planner.md); this module reads the spec and the trace and prints
the plan.
"""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.common import check_has_rate, check_seed
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.pareto import run_pareto
from controlplane.cli.parsers import MAX_RATE_QPS
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import MIN_STAGE_QUERIES, PLANNING_QUERIES, plan_app
from controlplane.policies.spot import plan_with_spot
from controlplane.spec import load_spec, resolve_spec
from estimator.numbers import plain
from estimator.traces import read_trace_csv, trace_stats


def run(args: argparse.Namespace) -> int:
    check_seed(args.seed)
    if args.pareto:
        return run_pareto(args)
    given = [
        o for o, v in (("--validation", args.validation), ("--thresholds", args.thresholds)) if v
    ]
    if given:
        raise UsageError(
            f"{' and '.join(given)}: only with --pareto (the Pareto front of a cascade)"
        )
    spec = load_spec(args.spec)
    app = resolve_spec(spec)
    trace = read_trace_csv(args.trace)
    stats = trace_stats(trace)
    check_has_rate(trace, f"--trace {args.trace}", "a plan")
    if stats.rate_qps > MAX_RATE_QPS:
        raise UsageError(
            f"--trace {args.trace}: its rate, {stats.rate_qps:.4g} qps, is past what heteroplane"
            f" plans for ({MAX_RATE_QPS:,.0f} qps)"
        )
    plan = plan_with_spot(app, trace, plan=plan_app, seed=args.seed, progress=progress)
    data: dict[str, Any] = {
        "app": spec.name,
        "slo_ms": spec.slo.latency_ms,
        "percentile": spec.slo.percentile,
        "budget_usd_per_hr": spec.budget_usd_per_hr,
        "trace": {"count": stats.count, "rate_qps": stats.rate_qps, "cv2": stats.cv2},
        **plan.to_document(),
        "seed": args.seed,
    }
    return emit(args.json, data, lambda: _human(data, plan))


def _human(data: dict[str, Any], plan: PlanDocument) -> str:
    trace = data["trace"]
    verdict = (
        f"feasible at ${plan.cost_usd_per_hr:.3f}/hr"
        f" (budget ${plain(data['budget_usd_per_hr'])}/hr)"
        if plan.feasible
        else f"NOT feasible within ${plain(data['budget_usd_per_hr'])}/hr: at most"
        f" {plan.max_feasible_qps:.2f} qps can be served"
    )
    predicted = (
        "n/a (no stages)" if plan.predicted_p99_ms is None else f"{plan.predicted_p99_ms:.1f} ms"
    )
    lines = [
        f"{data['app']}: P{data['percentile']:.15g} <= {data['slo_ms']:g} ms on {trace['count']:,}"
        f" queries at {trace['rate_qps']:.2f} qps (CV^2 {trace['cv2']:.2f}): {verdict}",
        f"  planned for {plan.rate_qps:.2f} qps: predicted end-to-end"
        f" P{data['percentile']:.15g} {predicted} (the whole pipeline)",
    ]
    planned = min(trace["count"], PLANNING_QUERIES)
    for i, s in enumerate(plan.stages):
        fleet = ", ".join(
            f"{n} x {t}" + (f" ({s.spot_fleet[t]} spot)" if s.spot_fleet.get(t) else "")
            for t, n in s.fleet.items()
        )
        tail = f"P{data['percentile']:.15g} {s.predicted_p99_ms:.1f} ms"
        if i and s.scale_factor * planned <= MIN_STAGE_QUERIES + 1e-9:
            # A later stage that (almost) no query reaches is planned on the trace's first
            # MIN_STAGE_QUERIES so that it keeps an instance: their tail says nothing.
            tail = "(almost) no query reaches it: planned on two so that it keeps an instance"
        lines.append(
            f"  {s.name}: {fleet}, batch {s.batch_size}, {s.policy} dispatch; {tail},"
            f" {s.throughput_qps:.2f} qps, ${s.cost_usd_per_hr:.3f}/hr"
        )
    lines.append(f"  steps ({plan.simulations} simulations):")
    lines += [f"    - {step}" for step in plan.steps]
    return "\n".join(lines)
