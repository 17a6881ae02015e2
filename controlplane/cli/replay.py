"""``heteroplane replay``: a trace through a plan's fleet as a scaling policy changes it.

The work is :func:`controlplane.policies.replay.replay`; this module reads the spec, the plan and
the traces, maps the options to a scaling policy and prints the result (``docs/replay.md``). The
baselines ``--policy peak`` and ``--policy mean`` make their own plan, for the replayed trace's
peak or mean rate (:func:`controlplane.policies.baselines.plan_baseline`), and replay it static.
The tuner runs the load model of docs/tuner.md by default (``--tuner-model curve``: the planner's
sizing ladder of the plan's stage on the planning trace, a 60 s live envelope);
``--tuner-model inferline`` is InferLine's one provisioning ratio, for comparison. A plan of
several stages (a cascade) replays as one pipeline: static (``--tuner off``), or with one tuner
per stage on the queries that reach it, all within the one budget (docs/tuner.md, "Cascades: one
tuner per stage"); each stage's tuner is sized by its ladder in the planner's plans of the
whole cascade (InferLine's model where the planner places none), and the output adds a section
per stage.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from controlplane.cli.common import check_has_rate, check_seed
from controlplane.cli.output import UsageError, emit, progress
from controlplane.policies import scaling
from controlplane.policies.baselines import (
    PEAK_WINDOW_S,
    BaselinePlan,
    leading_share,
    plan_baseline,
)
from controlplane.policies.capacity_curve import cascade_sizing, replay_sizing
from controlplane.policies.plan import PlanDocument
from controlplane.policies.replay import (
    DEFAULT_PLANNING_SHARE,
    ScalingPolicy,
    check_plan,
    check_stages,
    finite_or_none,
    parse_plan,
    read_plan,
    replay,
    reporting_ticks,
    tail_ms,
)
from controlplane.policies.sizing import SizingLadder
from controlplane.policies.spot_replay import (
    parse_interruption_rates,
    replay_with_interruptions,
)
from controlplane.spec import load_spec, resolve_spec
from estimator.envelope import DEFAULT_PERSISTENCE_S
from estimator.traces import Trace, read_trace_csv


def p99_text(p99_ms: float, percentile: float = 99.0) -> str:
    """A replay's P99 (or its ``percentile``-th percentile) for people: infinite when over
    100 - ``percentile`` % of the queries were refused."""
    if np.isfinite(p99_ms):
        return f"{p99_ms:.2f} ms"
    return f"- (over {100 - percentile:.15g}% of queries refused)"


def window_p99_text(p99_ms: float | None) -> str:
    """A timeline window's P99 for people: ``-`` when no query arrived in it, and where over 1%
    of its queries were refused (an infinite P99, JSON's null) says so rather than ``inf``."""
    if p99_ms is None:
        return "-"
    return f"{p99_ms:.1f}" if math.isfinite(p99_ms) else ">1% refused"


def scaling_policy(tuner: str, policy: str | None) -> tuple[ScalingPolicy, str]:
    """The replay's scaling policy and the name to report, from ``--tuner`` and ``--policy``
    (:mod:`controlplane.policies.scaling`): a baseline replays its own plan static."""
    if tuner == "off":
        if policy is not None and scaling.entry(policy).changes_fleet:
            raise UsageError(
                f"--tuner off keeps the plan's fleet; it cannot go with --policy {policy}"
            )
        return "static", policy or "static"
    chosen = scaling.entry(policy or "tuner")
    return ("static" if chosen.plans_itself else chosen.name), chosen.name


def check_options(args: argparse.Namespace, label: str) -> None:
    """One-line errors for the combinations of options that do not make sense."""
    baseline = scaling.entry(label).plans_itself
    if baseline and args.plan is not None:
        raise UsageError(
            f"--policy {label} plans for the trace's {label} rate itself: drop --plan (replay"
            " your own plan with --policy static)"
        )
    if not baseline and args.plan is None:
        raise UsageError(
            f"--policy {label} replays a plan: pass --plan FILE (or --policy peak or mean, which"
            " plan for the trace's rate themselves)"
        )
    if args.planning_trace is not None and not (label == "tuner" or baseline):
        raise UsageError(
            "--planning-trace is for the tuner (its planned envelope) and for --policy peak or"
            " mean (the arrivals they plan on)"
        )
    if args.peak_window_s is not None and label != "peak":
        raise UsageError("--peak-window-s is for --policy peak")
    if args.tuner_model is not None and label != "tuner":
        raise UsageError("--tuner-model is for the tuner (--policy tuner)")
    if args.interruptions_per_hour is not None and label != "static":
        raise UsageError(
            "--interruptions-per-hour replays a plan's fleet as it is: use it with --policy"
            " static (the default with it)"
        )


def tuner_planning_trace(args: argparse.Namespace, trace: Trace, planning: Trace | None) -> Trace:
    """The trace the tuner's sizing ladder is planned on: ``--planning-trace``, else the replayed
    trace's leading share; one with no rate (fewer than two arrivals, or all at one time) is a
    one-line error naming where it came from."""
    chosen = leading_share(trace) if planning is None else planning
    where = (
        f"--planning-trace {args.planning_trace}"
        if planning is not None
        else f"the first {DEFAULT_PLANNING_SHARE:.0%} of {args.trace} (the default"
        " --planning-trace)"
    )
    check_has_rate(chosen, where, "a planning trace")
    return chosen


def run(args: argparse.Namespace) -> int:
    check_seed(args.seed)
    # Interruptions replay the plan's fleet as it is (docs/spot.md): the tuner off by default;
    # so does a plan with instances on spot (the tuner buys on demand and has no spot model).
    given = read_plan(args.plan) if args.policy is None and args.plan is not None else None
    spot_plan = given is not None and any(stage.spot_fleet for stage in given.stages)
    by_default = args.policy is None and (args.interruptions_per_hour is not None or spot_plan)
    if spot_plan and args.interruptions_per_hour is None and args.tuner != "off":
        progress("replay: the plan has instances on spot: replayed static (--policy static)")
    policy, label = scaling_policy("off" if by_default else args.tuner, args.policy)
    check_options(args, label)
    app = resolve_spec(load_spec(args.spec))
    trace = read_trace_csv(args.trace)
    if len(trace) == 0:
        raise UsageError(f"{args.trace}: the trace has no queries")
    planning = None if args.planning_trace is None else read_trace_csv(args.planning_trace)
    made: BaselinePlan | None = None
    if scaling.entry(label).plans_itself:
        made = plan_baseline(
            app,
            trace,
            "peak" if label == "peak" else "mean",
            shape=planning,
            window_s=PEAK_WINDOW_S if args.peak_window_s is None else args.peak_window_s,
            seed=args.seed,
        )
        plan: PlanDocument = parse_plan(made.plan.to_document(), f"the {label} plan")
    else:
        plan = given if given is not None else read_plan(args.plan)
    cascade = len(plan.stages) > 1
    on_spot = {t: n for stage in plan.stages for t, n in stage.spot_fleet.items() if n}
    if on_spot and policy != "static":
        raise UsageError(
            f"the plan has instances on spot ({','.join(f'{t}={n}' for t, n in on_spot.items())}):"
            f" --policy {label} buys on demand and has no spot model; replay it with --policy"
            " static (--interruptions-per-hour R interrupts its spot instances)"
        )
    if cascade and policy == "utilization":
        raise UsageError(
            f"the plan has {len(plan.stages)} stages: a cascade replays static (--tuner off) or"
            " with one tuner per stage; the utilization policy scales one stage"
        )
    model = args.tuner_model or "curve"
    model_note = None
    curve = None
    ladder = None
    ladders: dict[str, SizingLadder] = {}
    sizing: dict[str, Any] = {}
    ladder_note = (
        "replay: planning the tuner's sizing ladder (the planner at 0.2x to 5x of the planning"
        " rate and for other burstiness: tens of plans)"
    )
    if policy == "tuner" and cascade and model == "curve":
        check_stages(plan, app)
        ladder_trace = tuner_planning_trace(args, trace, planning)
        progress(ladder_note)
        # Each stage sized by its ladder: the planner's fleet of that stage for the whole
        # cascade at each load (docs/tuner.md, Cascades).
        ladders, sizing = cascade_sizing(
            app,
            plan,
            ladder_trace,
            dispatch=args.dispatch,
            seed=args.seed,
            progress=progress,
        )
        if not ladders:
            model = "inferline"
            model_note = (
                "the planner places nothing for the planning trace at its own rate: InferLine's"
                " model per stage"
            )
    elif policy == "tuner" and cascade:
        # A burst must persist to buy capacity, as in a single stage and the live tuner.
        sizing = {"tuner_persistence_s": DEFAULT_PERSISTENCE_S}
    elif policy == "tuner" and model == "curve":
        stage = check_plan(plan, app)
        ladder_trace = tuner_planning_trace(args, trace, planning)
        progress(ladder_note)
        ladder, sizing = replay_sizing(
            app,
            stage,
            ladder_trace,
            dispatch=args.dispatch,
            seed=args.seed,
            progress=progress,
        )
        curve = None if ladder is None else ladder.curve
        if curve is None:
            # The planner placed nothing for the planning trace at its own rate: no ladder to
            # read, so the tuner sizes the stage InferLine's way.
            model = "inferline"
    interruptions: dict[str, Any] | None = None
    if args.interruptions_per_hour is not None or on_spot:
        # One stage or every stage of a cascade at once (docs/spot.md). Without the option, a
        # plan with spot instances: billed at the spot price, as the plan priced them, and never
        # interrupted (the interruption replay at a rate of 0).
        stages = check_stages(plan, app) if cascade else (check_plan(plan, app),)
        types = list(dict.fromkeys(t for stage in stages for t in stage.fleet))
        try:
            given_rates = args.interruptions_per_hour
            rates = parse_interruption_rates("0" if given_rates is None else given_rates, types)
        except ValueError as error:
            raise UsageError(f"--interruptions-per-hour: {error}") from None
        result, log = replay_with_interruptions(
            trace,
            app,
            plan,
            np.random.default_rng(args.seed),
            rates,
            admission=not args.no_admission,
        )
        if args.interruptions_per_hour is not None:
            interruptions = {
                "rates_per_hr": rates,
                "spot_instances": log.spot_instances,
                "interruptions": log.interruptions,
                "missing_instance_s": log.missing_instance_s,
            }
    else:
        with reporting_ticks(progress):  # a tick a second: long on a trace spanning days
            result = replay(
                trace,
                app,
                plan,
                np.random.default_rng(args.seed),
                policy=policy,
                planning_arrival_s=None if planning is None or made else planning.arrival_s,
                dispatch=args.dispatch,
                admission=not args.no_admission,
                **sizing,
            )
    data = result.to_document()
    data["interruptions"] = interruptions
    data["policy"] = label
    data["slo_ms"] = app.spec.slo.latency_ms
    # Judged at the spec's percentile (p99_ms stays the contract's P99 whatever it is).
    percentile = app.spec.slo.percentile
    slo_tail = tail_ms(result.simulation.response_ms, percentile)
    data["percentile"] = percentile
    data["slo_tail_ms"] = finite_or_none(slo_tail)
    data["slo_met"] = bool(slo_tail <= app.spec.slo.latency_ms)
    data["budget_usd_per_hr"] = app.spec.budget_usd_per_hr
    if policy == "tuner" or made is not None:
        default = "first 10% of the trace"
        data["planning_trace"] = default if planning is None else str(args.planning_trace)
    else:
        data["planning_trace"] = None
    data["baseline"] = None if made is None else baseline_document(made)
    if policy == "tuner":
        data["tuner_model"] = model
        data["capacity_curve"] = None if curve is None else [list(p) for p in curve]
        data["sizing_ladder"] = None if ladder is None else rungs_document(ladder)
        if cascade:
            data["tuner_model_note"] = model_note
            data["sizing_ladders"] = {name: rungs_document(made) for name, made in ladders.items()}
    data["seed"] = args.seed

    def human() -> str:
        slo = app.spec.slo.latency_ms
        lines = [
            f"replay of {args.trace} ({data['queries']} queries) under {label}:",
            f"  p99 {p99_text(result.p99_ms)}; {100 * result.slo_miss_share:.2f}% over the"
            f" {slo:g} ms SLO ({100 * result.refused_share:.2f}% refused by admission control)",
            f"  cost {result.cost_usd:.4f} USD; {result.scaling_actions} scaling actions",
        ]
        if percentile != 99.0:  # the line above's P99 is not the SLO's judge
            tail = p99_text(slo_tail, percentile)
            lines.insert(
                2,
                f"  P{percentile:.15g} {tail}: the SLO (P{percentile:.15g} <= {slo:g} ms)"
                f" {'met' if data['slo_met'] else 'missed'}",
            )
        if made is not None:
            lines.insert(1, "  " + baseline_text(made))
        if interruptions is not None:
            lines.append(
                f"  {interruptions['interruptions']} interruptions of"
                f" {interruptions['spot_instances']} spot instances;"
                f" {interruptions['missing_instance_s']:.0f} instance-s of spot capacity missing"
                " between an instance and its replacement"
            )
        if result.fleet_timeline.batch_caps:
            lines.append(f"  {_caps_text(result.fleet_timeline.batch_caps)}")
        lines.append("  t_s      rate_qps  p99_ms      fleet")
        for window in result.timeline:
            p99 = window_p99_text(window.p99_ms)
            fleet = ",".join(f"{name}={count}" for name, count in window.fleet.items())
            lines.append(f"  {window.t_s:<8g} {window.rate_qps:<9.1f} {p99:<11} {fleet}")
        for stage in result.stages:
            rho = (
                "" if stage.utilisation_target is None else f", rho {stage.utilisation_target:.3g}"
            )
            lines.append(
                f"  stage {stage.name}: reached by {100 * stage.reach_share:.1f}% of the queries,"
                f" SLO share {stage.slo_target_ms:.2f} ms{rho}; {stage.scaling_actions} scaling"
                f" actions; peak {max(w.cost_usd_per_hr for w in stage.timeline):.4f} USD/hr"
            )
            if stage.note:
                lines.append(f"    {stage.note}")
            if stage.batch_caps:
                lines.append(f"    {_caps_text(stage.batch_caps)}")
            lines.append("    t_s      rate_qps  fleet")
            for window in stage.timeline:
                fleet = ",".join(f"{name}={count}" for name, count in window.fleet.items())
                lines.append(f"    {window.t_s:<8g} {window.rate_qps:<9.1f} {fleet}")
        return "\n".join(lines)

    return emit(args.json, data, human)


def _caps_text(caps: Sequence[tuple[float, int]]) -> str:
    """The summary's line for a stage's batch caps (time, cap) where its ladder moved them."""
    moves = ", ".join(f"{cap} from {t_s:g} s" for t_s, cap in caps)
    return f"most queries per batch (the ladder's for the fleet): {moves}"


def rungs_document(ladder: SizingLadder) -> list[dict[str, Any]]:
    """A sizing ladder's rungs as ``replay --json`` gives them: ``{load, fleet, batch}`` each
    (``batch``: the planner's most queries per batch at that load; null where not recorded)."""
    batch_at = dict(ladder.batches)
    return [
        {"load": f, "fleet": dict(fleet), "batch": batch_at.get(f)} for f, fleet in ladder.rungs
    ]


def baseline_document(made: BaselinePlan) -> dict[str, Any]:
    """The ``baseline`` object of ``replay --json`` for ``--policy peak|mean``."""
    return {
        "rate_qps": made.rate_qps,
        "peak_window_s": made.window_s,
        "feasible": made.plan.feasible,
        "cost_usd_per_hr": made.plan.cost_usd_per_hr,
        "fleet": {name: n for s in made.plan.stages for name, n in s.fleet.items() if n},
        "plan": made.plan.to_document(),
    }


def baseline_text(made: BaselinePlan) -> str:
    measure = (
        f"peak rate (most arrivals in any {made.window_s:g} s)"
        if made.window_s is not None
        else "mean rate"
    )
    fleet = ", ".join(f"{n} x {name}" for s in made.plan.stages for name, n in s.fleet.items() if n)
    verdict = (
        ""
        if made.plan.feasible
        else f" (NOT feasible within the budget: planned for {made.plan.rate_qps:.2f} qps)"
    )
    return (
        f"planned for the trace's {measure} {made.rate_qps:.2f} qps: {fleet} at"
        f" ${made.plan.cost_usd_per_hr:.3f}/hr{verdict}"
    )
