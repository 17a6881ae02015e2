"""InferLine: planner + tuner against static and reactive provisioning; planner sensitivity.

This experiment owns the InferLine result (InferLine, SoCC'20: Figures 6-8 for the
provisioning comparison, Figure 10 for the planner's sensitivity), on rm2 with the four Kairos
types (g4dn.xlarge, c5n.2xlarge, r5n.large, t3.xlarge) at the catalogue's prices, SLO 350 ms at
p99, batch sizes from the Kairos mix; its building blocks are those of benchmarks/inferline_tuner.py
(``benchmarks/inferline_tuner.py``: the app, the planning trace, the ramp and the replay).

**Provisioning.** One planning trace (10 minutes of gamma arrivals, CV^2 = 4, at R qps) and three
test traces of ``TRACE_S`` each, all with mean rate about R:

- *steady*: constant R, gamma CV^2 = 4 (the planning trace's process, a fresh draw);
- *ramp*: benchmarks/inferline_tuner.py's trace shortened: R ramping linearly 0.6 R -> 1.4 R over
  the trace, CV^2 = 4, times 1.5 for 20 s mid-trace and near the top of the ramp
  (:func:`ramp_profile`);
- *bursty*: gamma CV^2 = ``BURSTY_CV2`` (twice the planning trace's), the rate 1.5x a base rate
  for ``BURST_S`` every ``BURST_PERIOD_S`` from ``BURST_FIRST_S``, the base set so that the mean
  is R (:func:`bursty_profile`): bursts longer than an instance's boot, and burstier arrivals
  than planned for.

Four methods per trace, replayed by ``controlplane.policies.replay.replay`` (the discrete-event
simulator on the measured latency samples; boot 60 s for the GPU type, 30 s for the others): *tuner*
= the planner's plan for the planning trace, scaled by InferLine's tuner (planned envelope from the
planning trace); *static peak* and *static mean* = the planner on the planning trace scaled to
the test trace's highest 20 s rate and to its mean rate, static (InferLine's CG-Peak and CG-Mean,
which are told each trace's peak and mean); *utilization* = the tuner's plan with the reactive
70% target-tracking autoscaler. The tuner's plan is made once and used on all three traces, as a
user plans once for the traffic ahead; the static plans are made per trace.

**Sensitivity** (InferLine Figure 10): the planner's plan (USD/hr and instances) against the SLO,
the rate (the planning trace's times scaled) and CV^2 (fresh planning traces at R), the other two
at their defaults (350 ms, R, CV^2 = 4); the default point is the tuner's plan.

The spec's budget is 20 USD/hr, as in benchmarks/inferline_tuner.py (``BUDGET_USD_PER_HR`` of
benchmarks/inferline_tuner.py): it binds for no plan here (the costliest is below 7 USD/hr). The
space of mixes it affords is past the planner's 200,000-mix limit, so the planner finds its start
among the mixes up to the smallest doubled budget that holds one covering the peak
(``controlplane.policies.planner.MAX_RANKED_MIXES``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.inferline_tuner import (
    BUDGET_USD_PER_HR,
    CV2,
    MODEL,
    PEAK_WINDOW_S,
    PLANNING_S,
    RAMP_FROM,
    RAMP_TO,
    SLO_MS,
    SPIKE_S,
    SPIKES,
    TEST_S,
    TYPES,
    make_app,
    mean_rate_qps,
    peak_rate_qps,
    ramp_profile,
    renewal_trace,
    replay_policy,
)
from benchmarks.results.common import (
    Context,
    Figure,
    Section,
    experiment_main,
    md_table,
    pyplot,
    save_figure,
)
from benchmarks.results.findings import finding
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app, scale_trace
from controlplane.policies.replay import ReplayResult, ScalingPolicy
from controlplane.spec import ResolvedApp
from estimator.batches import BatchDistribution, parse_batch_distribution
from estimator.traces import RateProfile, Trace, constant_profile

KEY = "inferline"
SEED = 0
RATE_QPS = 150.0  # R: rm2 then needs about 20 instances (see docs/inferline-results.md)
QUICK_RATE_QPS = 30.0
TRACE_S = 900.0  # every test trace (inferline_tuner.py's ramp is 30 minutes; 15 keep the run short)
# Quick mode (the test suite's; indicative figures): one burst in a 2-minute trace, planned on
# one minute (3 and 2 minutes before 2026-12-07).
QUICK_TRACE_S = 120.0
QUICK_PLANNING_S = 60.0
# The bursty trace: 1.5x bursts of a minute (twice the 30 s boot of a CPU type) every 3 minutes
# on a gamma process twice as bursty as the planning trace's.
BURSTY_CV2 = 8.0
BURST_FACTOR = 1.5
BURST_S = 60.0
BURST_PERIOD_S = 180.0
BURST_FIRST_S = 60.0

METHODS: tuple[tuple[str, str, ScalingPolicy], ...] = (
    # (method, plan, scaling policy)
    ("tuner", "tuner", "tuner"),
    ("static peak", "peak", "static"),
    ("static mean", "mean", "static"),
    ("utilization", "tuner", "utilization"),
)
# The planner's sensitivity (full, quick): SLO ms, rate as a multiple of R, CV^2. Each axis's
# default (350 ms, 1x, CV^2 4) is the base plan, made once whatever the axis holds: quick's
# middle points cost nothing.
SLO_POINTS_MS = ((275.0, 300.0, 350.0, 500.0, 700.0), (300.0, 350.0, 500.0))
RATE_MULTIPLES = ((0.25, 0.5, 1.0, 1.5, 2.0), (0.5, 1.0, 2.0))
CV2_POINTS = ((0.1, 1.0, 4.0, 8.0), (1.0, 4.0, 8.0))


# --- traces ----------------------------------------------------------------------------------


def burst_starts_s(duration_s: float) -> list[float]:
    """The bursty trace's burst starts: every BURST_PERIOD_S from BURST_FIRST_S while a whole
    burst fits in ``duration_s`` (at least one burst, at the start, if none does).

    >>> burst_starts_s(900.0)
    [60.0, 240.0, 420.0, 600.0, 780.0]
    """
    starts = [
        float(s) for s in np.arange(BURST_FIRST_S, duration_s - BURST_S + 1e-9, BURST_PERIOD_S)
    ]
    return starts or [0.0]


def bursty_profile(rate_qps: float, duration_s: float) -> RateProfile:
    """A base rate b, times BURST_FACTOR on each burst, with b such that the mean rate over
    ``duration_s`` is ``rate_qps``: b (duration + n BURST_S (factor - 1)) = rate duration."""
    starts = burst_starts_s(duration_s)
    burst_s = min(BURST_S, duration_s)
    base_qps = rate_qps * duration_s / (duration_s + len(starts) * burst_s * (BURST_FACTOR - 1.0))
    times_s, rates_qps = [0.0], [base_qps]
    for start_s in starts:
        high_qps = base_qps * BURST_FACTOR
        times_s += [start_s, start_s, start_s + burst_s, start_s + burst_s]
        rates_qps += [base_qps, high_qps, high_qps, base_qps]
    return RateProfile(np.array(times_s), np.array(rates_qps))


def make_test_traces(
    rate_qps: float, duration_s: float, batches: BatchDistribution, seed: int
) -> dict[str, Trace]:
    """The three test traces (module docstring), each from its own generator."""
    profiles = {
        "steady": (constant_profile(rate_qps), CV2),
        "ramp": (ramp_profile(rate_qps, duration_s), CV2),
        "bursty": (bursty_profile(rate_qps, duration_s), BURSTY_CV2),
    }
    return {
        name: renewal_trace(profile, duration_s, cv2, batches, np.random.default_rng([seed, k]))
        for k, (name, (profile, cv2)) in enumerate(profiles.items(), start=1)
    }


def trace_definitions(rate_qps: float, duration_s: float) -> dict[str, str]:
    minutes = duration_s / 60.0
    spikes = [start_s * duration_s / TEST_S for start_s, _, _ in SPIKES]
    starts = burst_starts_s(duration_s)
    return {
        "steady": f"{minutes:g} min at R = {rate_qps:g} qps, gamma CV^2 = {CV2:g}",
        "ramp": (
            f"{minutes:g} min, {RAMP_FROM:g} R -> {RAMP_TO:g} R linearly, CV^2 = {CV2:g}, x1.5 for"
            f" {SPIKE_S:g} s at {spikes[0]:.0f} s and {spikes[1]:.0f} s"
        ),
        "bursty": (
            f"{minutes:g} min, mean R, CV^2 = {BURSTY_CV2:g}, x{BURST_FACTOR:g} the base rate for"
            f" {BURST_S:g} s every {BURST_PERIOD_S:g} s ({len(starts)}"
            f" burst{'s' if len(starts) > 1 else ''} from {starts[0]:g} s)"
        ),
    }


# --- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanPoint:
    plan: PlanDocument
    rate_qps: float
    seconds: float

    @property
    def fleet(self) -> dict[str, int]:
        return {t: n for s in self.plan.stages for t, n in sorted(s.fleet.items()) if n}

    @property
    def instances(self) -> int:
        return sum(self.fleet.values())

    def document(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "instances": self.instances,
            "cost_usd_per_hr": self.plan.cost_usd_per_hr,
            "feasible": self.plan.feasible,
            "planned_rate_qps": self.rate_qps,
            "predicted_p99_ms": max((s.predicted_p99_ms for s in self.plan.stages), default=0.0),
            "simulations": self.plan.simulations,
            "seconds": self.seconds,
        }


def plan_point(app: ResolvedApp, trace: Trace, seed: int) -> PlanPoint:
    started = time.perf_counter()
    plan = plan_app(app, trace, seed=seed)
    return PlanPoint(plan, mean_rate_qps(trace), time.perf_counter() - started)


def fleet_text(fleet: dict[str, int]) -> str:
    return " + ".join(f"{n} {t}" for t, n in fleet.items()) or "none"


# --- replays ---------------------------------------------------------------------------------


def method_row(result: ReplayResult, duration_s: float, seconds: float) -> dict[str, Any]:
    return {
        "p99_ms": result.p99_ms,
        "slo_miss_share": result.slo_miss_share,
        "cost_usd": result.cost_usd,
        "cost_usd_per_hr": result.cost_usd * 3600.0 / duration_s,
        "scaling_actions": result.scaling_actions,
        "budget_capped": sum(1 for d in result.decisions if d.action == "budget_capped"),
        "seconds": seconds,
    }


def fleet_series(result: ReplayResult) -> dict[str, list[float]]:
    """The serving fleet's size and the arrival rate per 10 s window of a replay."""
    return {
        "t_s": [w.t_s for w in result.timeline],
        "instances": [float(sum(w.fleet.values())) for w in result.timeline],
        "rate_qps": [w.rate_qps for w in result.timeline],
    }


# --- the summary's wording -------------------------------------------------------------------


def cost_relation(cost: float, reference: float) -> str:
    """How ``cost`` compares with ``reference``: a factor from 1.25x on, a percentage below,
    "the same" within 0.5%.

    >>> cost_relation(1.0, 2.1), cost_relation(1.3, 1.0), cost_relation(1.154, 1.212)
    ('2.1x less cost than', '1.3x more cost than', '5% less cost than')
    >>> cost_relation(1.001, 1.0)
    'the same cost as'
    """
    if cost <= 0.0 or reference <= 0.0:
        return "no cost comparable with"
    if abs(cost - reference) < 0.005 * reference:
        return "the same cost as"
    if reference >= 1.25 * cost:
        return f"{reference / cost:.1f}x less cost than"
    if cost >= 1.25 * reference:
        return f"{cost / reference:.1f}x more cost than"
    if cost < reference:
        return f"{100.0 * (1.0 - cost / reference):.0f}% less cost than"
    return f"{100.0 * (cost / reference - 1.0):.0f}% more cost than"


def pct(share: float) -> str:
    return f"{100.0 * share:.1f}%"


# --- the experiment --------------------------------------------------------------------------


def run(ctx: Context) -> Section:
    q = 1 if ctx.quick else 0
    rate_qps = QUICK_RATE_QPS if ctx.quick else RATE_QPS
    duration_s = QUICK_TRACE_S if ctx.quick else TRACE_S
    planning_s = QUICK_PLANNING_S if ctx.quick else PLANNING_S
    batches = parse_batch_distribution("kairos")
    app = make_app(budget_usd_per_hr=BUDGET_USD_PER_HR)

    # The planning trace is inferline_tuner.py's (its first draws from the seed).
    planning = renewal_trace(
        constant_profile(rate_qps), planning_s, CV2, batches, np.random.default_rng(SEED)
    )
    tests = make_test_traces(rate_qps, duration_s, batches, SEED)
    ctx.log(
        f"planning trace {len(planning):,} queries; test traces "
        + ", ".join(f"{name} {len(t):,}" for name, t in tests.items())
    )

    # The tuner's plan, made once on the planning trace and used on every trace; the static
    # baselines are given each trace's mean and peak rate (InferLine's CG-Mean and CG-Peak).
    base = plan_point(app, planning, SEED)
    ctx.log(
        f"tuner's plan: {fleet_text(base.fleet)} ${base.plan.cost_usd_per_hr:.3f}/hr,"
        f" {base.seconds:.1f} s"
    )
    plans: dict[str, dict[str, PlanPoint]] = {"tuner": dict.fromkeys(tests, base)}
    plans["peak"], plans["mean"] = {}, {}
    for name, trace in tests.items():
        for kind, target_qps in (("peak", peak_rate_qps(trace)), ("mean", mean_rate_qps(trace))):
            point = plan_point(app, scale_trace(planning, target_qps), SEED)
            plans[kind][name] = point
            ctx.log(
                f"{kind} plan {name} ({target_qps:.1f} qps): {fleet_text(point.fleet)}"
                f" ${point.plan.cost_usd_per_hr:.3f}/hr, {point.seconds:.1f} s"
            )

    results: dict[str, dict[str, dict[str, Any]]] = {}
    series: dict[str, dict[str, list[float]]] = {}
    for name, trace in tests.items():
        results[name] = {}
        for method, plan_name, policy in METHODS:
            plan = plans[plan_name][name]
            started = time.perf_counter()
            replayed = replay_policy(trace, app, plan.plan, policy, planning, SEED)
            row = method_row(replayed, trace.duration_s, time.perf_counter() - started)
            results[name][method] = row
            if name == "bursty":
                series[method] = fleet_series(replayed)
            ctx.log(
                f"replay {name} / {method}: over SLO {pct(row['slo_miss_share'])},"
                f" ${row['cost_usd']:.3f}, {row['scaling_actions']} actions,"
                f" {row['seconds']:.1f} s"
            )
        peak_cost = results[name]["static peak"]["cost_usd"]
        for row in results[name].values():
            row["cost_ratio_vs_peak"] = row["cost_usd"] / peak_cost

    sensitivity = run_sensitivity(ctx, planning, base, batches, rate_qps, planning_s, q)

    data: dict[str, Any] = {
        "setup": {
            "model": MODEL,
            "instance_types": list(TYPES),
            "slo_ms": SLO_MS,
            "budget_usd_per_hr": BUDGET_USD_PER_HR,
            "rate_qps": rate_qps,
            "planning_s": planning_s,
            "planning_queries": len(planning),
            "trace_s": duration_s,
            "seed": SEED,
        },
        "traces": {
            name: {
                "definition": trace_definitions(rate_qps, duration_s)[name],
                "queries": len(trace),
                "mean_qps": mean_rate_qps(trace),
                "peak_qps": plans["peak"][name].rate_qps,
            }
            for name, trace in tests.items()
        },
        "plans": {"tuner": base.document()}
        | {
            f"{kind} {name}": plans[kind][name].document()
            for name in tests
            for kind in ("mean", "peak")
        },
        "results": results,
        "sensitivity": sensitivity,
        "bursty_fleet": series,
    }
    figures = [
        plot_cost_miss(ctx, results),
        plot_sensitivity(ctx, sensitivity),
        plot_bursty_fleet(
            ctx, series, plans["peak"]["bursty"].instances, plans["mean"]["bursty"].instances
        ),
    ]
    return Section(
        key=KEY,
        title="InferLine: planner + tuner against static and reactive provisioning",
        what=what_text(data),
        rerun="python -m benchmarks.results.inferline",
        body=body_text(data),
        summary=summary_lines(data),
        data=data,
        figures=figures,
    )


def run_sensitivity(
    ctx: Context,
    planning: Trace,
    base: PlanPoint,
    batches: BatchDistribution,
    rate_qps: float,
    planning_s: float,
    q: int,
) -> dict[str, list[dict[str, Any]]]:
    """The planner's plan against SLO, rate and CV^2 (the others at their defaults); the default
    point is ``base``, the plan for the planning trace."""
    default_app = make_app(budget_usd_per_hr=BUDGET_USD_PER_HR)
    planning_rate_qps = mean_rate_qps(planning)
    # (axis, value, (app, trace) to plan, or None for the default point)
    cases: list[tuple[str, float, tuple[ResolvedApp, Trace] | None]] = []
    for slo_ms in SLO_POINTS_MS[q]:
        app = make_app(slo_ms=slo_ms, budget_usd_per_hr=BUDGET_USD_PER_HR)
        cases.append(("slo_ms", slo_ms, None if slo_ms == SLO_MS else (app, planning)))
    for multiple in RATE_MULTIPLES[q]:
        rate = multiple * planning_rate_qps
        scaled = scale_trace(planning, rate)
        cases.append(("rate_qps", rate, None if multiple == 1.0 else (default_app, scaled)))
    for cv2 in CV2_POINTS[q]:
        rng = np.random.default_rng(SEED)  # the planning trace's generator: CV2 draws it again
        trace = renewal_trace(constant_profile(rate_qps), planning_s, cv2, batches, rng)
        cases.append(("cv2", cv2, None if cv2 == CV2 else (default_app, trace)))

    out: dict[str, list[dict[str, Any]]] = {"slo_ms": [], "rate_qps": [], "cv2": []}
    for axis, value, job in cases:
        point = base if job is None else plan_point(job[0], job[1], SEED)
        ctx.log(
            f"sensitivity {axis} {value:g}: {fleet_text(point.fleet)}"
            f" ${point.plan.cost_usd_per_hr:.3f}/hr, {point.seconds:.1f} s"
        )
        out[axis].append({"value": value} | point.document())
    return out


# --- the text --------------------------------------------------------------------------------


def what_text(data: dict[str, Any]) -> str:
    s = data["setup"]
    capped = sum(
        row["budget_capped"] for by_method in data["results"].values() for row in by_method.values()
    )
    traces = "\n".join(
        f"  - *{name}*: {t['definition']} ({t['queries']:,} queries, mean {t['mean_qps']:.1f} qps,"
        f" highest {PEAK_WINDOW_S:g} s rate {t['peak_qps']:.1f} qps)"
        for name, t in data["traces"].items()
    )
    return f"""\
- App: {s["model"]} on {", ".join(s["instance_types"])} (catalogue prices), SLO {s["slo_ms"]:g} ms
  at p99, batch sizes from the Kairos mix, spec budget ${s["budget_usd_per_hr"]:g}/hr (no plan
  reaches it; it capped {capped} scaling decisions of the tuner or the autoscaler). The mixes it
  affords are too many to rank them all: the planner ranks those up to the smallest doubled
  budget that holds one covering the peak (the plans' first steps say up to what).
- Planning trace: {s["planning_s"] / 60:g} min of gamma arrivals, CV^2 = {CV2:g}, at
  R = {s["rate_qps"]:g} qps ({s["planning_queries"]:,} queries; the planner simulates at most
  the busiest 20,000 in a row of a trace). Test traces, each of mean about R:
{traces}
- Methods: *tuner* = the planner's plan for the planning trace scaled by InferLine's tuner
  (controlplane/policies/tuner.py, planned envelope from the planning trace); *static peak* and
  *static mean* = the planner on the planning trace scaled to the test trace's highest
  {PEAK_WINDOW_S:g} s rate and to its mean rate, static (InferLine's CG-Peak and CG-Mean: they are
  told each trace's peak and mean); *utilization* = the tuner's plan under a reactive
  target-tracking autoscaler (70% of the last 60 s rate, 60 s cooldown). The tuner's plan is made
  once and used on all three traces, as a user plans once; the static plans are made per trace.
- Replays (controlplane.policies.replay): the discrete-event simulator on the measured Kairos
  latency samples, one seed for every replay; instances boot in 60 s (g4dn.xlarge) or 30 s (the CPU
  types) and are billed from launch. Cost is USD over the trace and mean USD/hr; "over SLO" is the
  share of queries answered in more than {s["slo_ms"]:g} ms.
- Sensitivity (InferLine Figure 10): the planner's plan for the planning trace with one of SLO,
  rate (arrival times scaled) or CV^2 (a fresh planning trace at R) changed, the others at
  {s["slo_ms"]:g} ms, R and CV^2 = {CV2:g}.
- Caveats: simulated, not measured on EC2; the traces are {s["trace_s"] / 60:g} minutes
  (inferline_tuner.py's ramp, docs/inferline-results.md, is 30, so this ramp is twice as steep); one
  seed for the traces and the service times (docs/tuner.md reports inferline_tuner.py's ramp on
  seeds 0-2 and other rates); plans are the planner's greedy result, not the optimum."""


def body_text(data: dict[str, Any]) -> str:
    plans = md_table(
        ["plan", "planned for (qps)", "fleet", "instances", "USD/hr", "simulations", "seconds"],
        [
            [
                name,
                f"{p['planned_rate_qps']:.1f}",
                fleet_text(p["fleet"]),
                p["instances"],
                f"{p['cost_usd_per_hr']:.3f}",
                p["simulations"],
                f"{p['seconds']:.1f}",
            ]
            for name, p in data["plans"].items()
        ],
        right="1,3,4,5,6",
    )
    rows = []
    for name, by_method in data["results"].items():
        for method, r in by_method.items():
            rows.append(
                [
                    name,
                    method,
                    f"{r['p99_ms']:.0f}",
                    pct(r["slo_miss_share"]),
                    f"{r['cost_usd']:.3f}",
                    f"{r['cost_usd_per_hr']:.3f}",
                    f"{r['cost_ratio_vs_peak']:.2f}",
                    r["scaling_actions"],
                ]
            )
    results = md_table(
        [
            "trace",
            "method",
            "P99 ms",
            "over SLO",
            "cost USD",
            "mean USD/hr",
            "cost / static peak",
            "scaling actions",
        ],
        rows,
        right="2,3,4,5,6,7",
    )
    axes = {"slo_ms": "SLO (ms)", "rate_qps": "rate (qps)", "cv2": "CV^2"}
    sens_rows = [
        [
            axes[axis],
            f"{p['value']:g}" if axis != "rate_qps" else f"{p['value']:.1f}",
            fleet_text(p["fleet"]),
            p["instances"],
            f"{p['cost_usd_per_hr']:.3f}",
            f"{p['predicted_p99_ms']:.0f}",
            "yes" if p["feasible"] else "no",
            f"{p['seconds']:.1f}",
        ]
        for axis, points in data["sensitivity"].items()
        for p in points
    ]
    sensitivity = md_table(
        ["varied", "value", "fleet", "instances", "USD/hr", "predicted P99 ms", "feasible", "s"],
        sens_rows,
        right="1,3,4,5,7",
    )
    return f"""\
### Plans

{plans}

### Cost and SLO misses per trace and method

{results}

### The planner's sensitivity

{sensitivity}
"""


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The section's findings (their wording: benchmarks/results/findings/inferline.md)."""
    rate = data["setup"]["rate_qps"]
    lines = []
    for name, label in (
        ("ramp", finding(KEY, "trace_ramp", rate_qps=f"{rate:g}")),
        (
            "bursty",
            finding(KEY, "trace_bursty", burst_s=f"{BURST_S:g}", bursty_cv2=f"{BURSTY_CV2:g}"),
        ),
    ):
        r = data["results"][name]
        tuner, peak, mean, util = (
            r["tuner"],
            r["static peak"],
            r["static mean"],
            r["utilization"],
        )
        lines.append(
            finding(
                KEY,
                "against_static",
                trace=label,
                slo_ms=f"{data['setup']['slo_ms']:g}",
                tuner_miss=pct(tuner["slo_miss_share"]),
                cost_against_peak=cost_relation(tuner["cost_usd"], peak["cost_usd"]),
                peak_miss=pct(peak["slo_miss_share"]),
                mean_miss=pct(mean["slo_miss_share"]),
                utilization_miss=pct(util["slo_miss_share"]),
            )
        )
    steady = data["results"]["steady"]
    lines.append(
        finding(
            KEY,
            "steady",
            tuner_miss=pct(steady["tuner"]["slo_miss_share"]),
            scaling_actions=steady["tuner"]["scaling_actions"],
            cost_against_mean=cost_relation(
                steady["tuner"]["cost_usd"], steady["static mean"]["cost_usd"]
            ),
            mean_miss=pct(steady["static mean"]["slo_miss_share"]),
        )
    )
    s = data["sensitivity"]
    bursty_cv2 = [p for p in s["cv2"] if p["value"] == BURSTY_CV2]
    tuner_usd_per_hr = data["results"]["bursty"]["tuner"]["cost_usd_per_hr"]
    planned_usd_per_hr = data["plans"]["tuner"]["cost_usd_per_hr"]
    if bursty_cv2 and tuner_usd_per_hr > planned_usd_per_hr:
        cv2_usd_per_hr = bursty_cv2[0]["cost_usd_per_hr"]
        share = (cv2_usd_per_hr - planned_usd_per_hr) / (tuner_usd_per_hr - planned_usd_per_hr)
        lines.append(
            finding(
                KEY,
                "bursty_cost",
                tuner_usd_per_hr=f"{tuner_usd_per_hr:.2f}",
                planned_usd_per_hr=f"{planned_usd_per_hr:.2f}",
                planned_cv2=f"{CV2:g}",
                cv2_usd_per_hr=f"{cv2_usd_per_hr:.2f}",
                bursty_cv2=f"{BURSTY_CV2:g}",
                share_clause=finding(KEY, "bursty_share", share=f"{share:.0%}")
                if 0.0 < share <= 1.0
                else "",
            )
        )

    def span(axis: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return s[axis][0], s[axis][-1]

    slo_lo, slo_hi = span("slo_ms")
    r_lo, r_hi = span("rate_qps")
    c_lo, c_hi = span("cv2")
    lines.append(
        finding(
            KEY,
            "sensitivity",
            slo_lo_usd_per_hr=f"{slo_lo['cost_usd_per_hr']:.2f}",
            slo_lo_ms=f"{slo_lo['value']:g}",
            slo_hi_usd_per_hr=f"{slo_hi['cost_usd_per_hr']:.2f}",
            slo_hi_ms=f"{slo_hi['value']:g}",
            rate_lo_usd_per_hr=f"{r_lo['cost_usd_per_hr']:.2f}",
            rate_lo_qps=f"{r_lo['value']:.0f}",
            rate_hi_usd_per_hr=f"{r_hi['cost_usd_per_hr']:.2f}",
            rate_hi_qps=f"{r_hi['value']:.0f}",
            cv2_lo_usd_per_hr=f"{c_lo['cost_usd_per_hr']:.2f}",
            cv2_lo=f"{c_lo['value']:g}",
            cv2_hi_usd_per_hr=f"{c_hi['cost_usd_per_hr']:.2f}",
            cv2_hi=f"{c_hi['value']:g}",
        )
    )
    return lines


# --- the plots -------------------------------------------------------------------------------

METHOD_STYLE = {
    "tuner": ("tab:blue", "o"),
    "static peak": ("tab:green", "s"),
    "static mean": ("tab:red", "v"),
    "utilization": ("tab:orange", "D"),
}


def plot_cost_miss(ctx: Context, results: dict[str, dict[str, dict[str, Any]]]) -> Figure:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(12, 3.8), sharey=False)
    for ax, (name, by_method) in zip(axes, results.items(), strict=True):
        for method, r in by_method.items():
            color, marker = METHOD_STYLE[method]
            ax.scatter(
                r["cost_usd_per_hr"],
                100.0 * r["slo_miss_share"],
                color=color,
                marker=marker,
                s=60,
                label=method,
            )
        top_pct = max(100.0 * r["slo_miss_share"] for r in by_method.values())
        right_usd_per_hr = max(r["cost_usd_per_hr"] for r in by_method.values())
        ax.set_title(f"{name} trace")
        ax.set_xlabel("mean cost (USD/hr)")
        ax.set_ylabel("queries over SLO (%)")
        ax.set_xlim(0.0, 1.15 * right_usd_per_hr)
        ax.set_ylim(0.0, 1.15 * top_pct + 0.1)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8)  # the costs start well right of 0
    return save_figure(
        ctx,
        fig,
        f"{KEY}-cost-miss.png",
        "Mean cost against the share of queries over the 350 ms SLO, per trace and method (rm2;"
        " lower left is better).",
    )


def plot_sensitivity(ctx: Context, sensitivity: dict[str, list[dict[str, Any]]]) -> Figure:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels = {
        "slo_ms": "P99 SLO (ms)",
        "rate_qps": "arrival rate (qps)",
        "cv2": "CV^2 of the inter-arrival times",
    }
    twins = []
    for ax, (axis, points) in zip(axes, sensitivity.items(), strict=True):
        x = [p["value"] for p in points]
        ax.plot(x, [p["cost_usd_per_hr"] for p in points], "o-", color="tab:blue", label="cost")
        ax.set_xlabel(labels[axis])
        ax.set_ylabel("plan cost (USD/hr)", color="tab:blue")
        ax.set_ylim(bottom=0.0)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twins.append(twin)
        twin.plot(x, [p["instances"] for p in points], "s--", color="tab:gray", label="instances")
        twin.set_ylabel("instances", color="tab:gray")
        twin.set_ylim(bottom=0.0)
        twin.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"cost vs {labels[axis].split(' (')[0]}")
    handles = axes[0].get_lines() + twins[0].get_lines()
    axes[0].legend(handles, [h.get_label() for h in handles], loc="best", fontsize=8)
    return save_figure(
        ctx,
        fig,
        f"{KEY}-sensitivity.png",
        "The planner's plan for rm2 (cost and instance count) against the SLO, the arrival rate"
        " and CV^2, the other two at their defaults (350 ms, R, CV^2 = 4).",
    )


def plot_bursty_fleet(
    ctx: Context, series: dict[str, dict[str, list[float]]], peak_n: int, mean_n: int
) -> Figure:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for method in ("tuner", "utilization"):
        color, _ = METHOD_STYLE[method]
        s = series[method]
        ax.step(s["t_s"], s["instances"], where="post", color=color, label=f"{method} fleet")
    ax.axhline(peak_n, color=METHOD_STYLE["static peak"][0], ls=":", label="static peak fleet")
    ax.axhline(mean_n, color=METHOD_STYLE["static mean"][0], ls=":", label="static mean fleet")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("serving instances")
    ax.set_ylim(bottom=0.0)
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    rate = series["tuner"]
    twin.step(
        rate["t_s"], rate["rate_qps"], where="post", color="black", alpha=0.35, lw=1, label="rate"
    )
    twin.set_ylabel("arrival rate (qps, 10 s windows)")
    twin.set_ylim(bottom=0.0)
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="lower center", ncol=5, fontsize=8)
    ax.set_title("bursty trace: serving fleet size against the arrival rate")
    return save_figure(
        ctx,
        fig,
        f"{KEY}-bursty-fleet.png",
        "The bursty trace: instances serving under the tuner and the utilisation autoscaler (10 s"
        " windows, booting instances not counted) against the arrival rate.",
    )


def main(argv: list[str] | None = None) -> int:
    return experiment_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
