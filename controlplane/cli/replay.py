"""``heteroplane replay``: a trace through a plan's fleet as a scaling policy changes it.

The work is :func:`controlplane.policies.replay.replay`; this module reads the spec, the plan and
the traces, maps the options to a scaling policy and prints the result (``docs/replay.md``).
"""

from __future__ import annotations

import argparse

import numpy as np

from controlplane.cli.output import UsageError, emit
from controlplane.policies.replay import ScalingPolicy, read_plan, replay
from controlplane.spec import load_spec, resolve_spec
from estimator.traces import read_trace_csv


def scaling_policy(tuner: str, policy: str | None) -> tuple[ScalingPolicy, str]:
    """The replay's scaling policy and the name to report, from ``--tuner`` and ``--policy``."""
    if tuner == "off":
        if policy in ("tuner", "utilization"):
            raise UsageError(
                f"--tuner off keeps the plan's fleet; it cannot go with --policy {policy}"
            )
        return "static", policy or "static"
    if policy in (None, "tuner"):
        return "tuner", "tuner"
    if policy == "utilization":
        return "utilization", "utilization"
    return "static", policy


def run(args: argparse.Namespace) -> int:
    policy, label = scaling_policy(args.tuner, args.policy)
    if args.planning_trace is not None and policy != "tuner":
        raise UsageError("--planning-trace is for the tuner (--policy tuner)")
    app = resolve_spec(load_spec(args.spec))
    plan = read_plan(args.plan)
    trace = read_trace_csv(args.trace)
    if len(trace) == 0:
        raise UsageError(f"{args.trace}: the trace has no queries")
    planning = None
    if args.planning_trace is not None:
        planning = read_trace_csv(args.planning_trace).arrival_s
    result = replay(
        trace,
        app,
        plan,
        np.random.default_rng(args.seed),
        policy=policy,
        planning_arrival_s=planning,
        dispatch=args.dispatch,
    )
    data = result.to_document()
    data["policy"] = label
    data["slo_ms"] = app.spec.slo.latency_ms
    data["budget_usd_per_hr"] = app.spec.budget_usd_per_hr
    data["planning_trace"] = (
        str(args.planning_trace)
        if args.planning_trace is not None
        else ("first 10% of the trace" if policy == "tuner" else None)
    )
    data["seed"] = args.seed

    def human() -> str:
        slo = app.spec.slo.latency_ms
        lines = [
            f"replay of {args.trace} ({data['queries']} queries) under {label}:",
            f"  p99 {result.p99_ms:.2f} ms; {100 * result.slo_miss_share:.2f}% over the"
            f" {slo:g} ms SLO",
            f"  cost {result.cost_usd:.4f} USD; {result.scaling_actions} scaling actions",
            "  t_s      rate_qps  p99_ms      fleet",
        ]
        for window in result.timeline:
            p99 = "-" if window.p99_ms is None else f"{window.p99_ms:.1f}"
            fleet = ",".join(f"{name}={count}" for name, count in window.fleet.items())
            lines.append(f"  {window.t_s:<8g} {window.rate_qps:<9.1f} {p99:<11} {fleet}")
        return "\n".join(lines)

    return emit(args.json, data, human)
