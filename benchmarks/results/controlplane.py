"""The control plane's own speed: estimator, bounds, dispatch decisions, planners, serving path.

This experiment owns the section ``controlplane`` of docs/results: every speed goal the issues set
for the control plane itself, measured by the existing speed scripts of ``benchmarks/`` (imported,
each through its ``measure`` function, so that each figure can be rerun alone with the script):

- ``estimator_speed.py``: the compiled FCFS simulator (>= 20 M simulated queries/s), the general
  event engine, the arrival envelope of the tuner (< 100 ms for a million arrivals);
- ``bounds_speed.py``: Kairos' upper bound and ranking (>= 10 M configurations ranked per second;
  the exact top 10 of a 10-type catalog at $50/hr in < 5 s);
- ``matching_speed.py``: one Kairos dispatch round (32 x 16 median <= 50 us; 256 x 128 p99
  <= 1 ms, issue 22) and the simulator under the Kairos policy (>= 50,000 simulated queries/s);
- ``planner_speed.py``: the planner on a 3-stage cascade over a 10-minute trace (< 10 s);
- ``gear_planner_speed.py``: the gear planner on the demo family (< 2 s);
- ``serving_speed/dispatcher.py``: the serving path's dispatcher with its real HTTP transport to
  fake workers that answer at once (>= 2,000 queries/s sustained adding <= 5 ms at p99).

Full mode runs every script at its own default sizes (about 2-4 minutes on a quiet 2-core
machine), plus the dispatcher's first sweep step (FCFS at 4,000 q/s) for the headroom; quick mode
runs each at small sizes with one repeat (indicative numbers only). The pure helpers (goals,
ratios, number formatting) are what ``tests/unit/test_results_controlplane.py`` checks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.results.common import (
    Context,
    Figure,
    Section,
    experiment_main,
    kairos_samples,
    md_table,
    pyplot,
    save_figure,
)
from benchmarks.results.findings import finding
from benchmarks.sizes import FULL, QUICK, Sizes

KEY = "controlplane"
RERUN = "python -m benchmarks.results.controlplane"
OPS = (">=", ">", "<=", "<")


@dataclass(frozen=True)
class Goal:
    """A target a figure must reach: ``measured op value`` (op one of :data:`OPS`)."""

    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown goal operator {self.op!r} (one of {', '.join(OPS)})")
        if not self.value > 0:
            raise ValueError(f"a goal's value must be > 0, got {self.value}")

    @property
    def higher_is_better(self) -> bool:
        return self.op.startswith(">")

    def met(self, measured: float) -> bool:
        return {
            ">=": measured >= self.value,
            ">": measured > self.value,
            "<=": measured <= self.value,
            "<": measured < self.value,
        }[self.op]

    def ratio(self, measured: float) -> float:
        """How far the figure is on the good side of the goal: measured / goal for an "at least"
        goal, goal / measured for an "at most" one (> 1: better than the goal)."""
        if measured <= 0:
            return float("inf") if not self.higher_is_better else 0.0
        return measured / self.value if self.higher_is_better else self.value / measured

    def text(self, unit: str) -> str:
        return f"{self.op} {self.value:,g} {unit}"


@dataclass(frozen=True)
class Row:
    """One figure of the section's table. ``value`` is None when it could not be measured
    (``note`` says why); ``condition_ok`` ANDs a second requirement into the verdict (the
    dispatcher's goal is a p99 *and* a sustained rate)."""

    key: str
    name: str
    value: float | None
    unit: str
    goal: Goal | None
    measured_on: str
    command: str
    note: str = ""
    condition_ok: bool = True
    short: str = ""  # the plot's label (``name`` when empty)

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.value is None:
            return None
        return self.goal.met(self.value) and self.condition_ok

    @property
    def ratio(self) -> float | None:
        if self.goal is None or self.value is None:
            return None
        return self.goal.ratio(self.value)


def fmt(x: float | None) -> str:
    """A figure with about three significant digits, thousands separated; None is a dash."""
    if x is None:
        return "-"
    size = abs(x)
    if size >= 100:
        return f"{x:,.0f}"
    if size >= 10:
        return f"{x:.1f}"
    if size >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def verdict(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "-"}[met]


def goals_count(rows: Sequence[Row]) -> tuple[int, int]:
    """(goals met, figures with a goal that were measured)."""
    judged = [row.met for row in rows if row.met is not None]
    return sum(judged), len(judged)


def rows_table(rows: Sequence[Row]) -> str:
    return md_table(
        ["figure", "measured", "goal", "goal met", "what it measured", "rerun alone"],
        [
            (
                row.name,
                f"{fmt(row.value)} {row.unit}" if row.value is not None else f"- ({row.note})",
                row.goal.text(row.unit) if row.goal else "-",
                verdict(row.met),
                row.measured_on + (f"; {row.note}" if row.note and row.value is not None else ""),
                f"`{row.command}`",
            )
            for row in rows
        ],
        right="1",
    )


def _script(name: str, *args: str) -> str:
    """The command that runs ``benchmarks/<name>.py``, or the package part ``name`` names
    (``"serving_speed dispatcher"``: ``python -m benchmarks.serving_speed dispatcher``)."""
    package, _, part = name.partition(" ")
    if part:
        return " ".join(["python", "-m", f"benchmarks.{package}", part, *args])
    return " ".join(["python", f"benchmarks/{name}.py", *args])


def estimator_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], dict[str, float]]:
    from benchmarks import estimator_speed

    ctx.log(f"estimator: {sizes.estimator_queries:,} queries, best of {sizes.estimator_repeats}")
    figures = estimator_speed.measure(
        sizes.estimator_queries,
        repeats=sizes.estimator_repeats,
        event_queries=sizes.event_queries,
        envelope_arrivals=sizes.envelope_arrivals,
    )
    arrivals = int(figures["envelope_arrivals"])
    command = _script("estimator_speed")
    if sizes.estimator_queries != FULL.estimator_queries:
        command += f" --queries {sizes.estimator_queries}"
    rows = []
    for n in (1, 64):
        rows.append(
            Row(
                f"fcfs_{n}_instances",
                f"FCFS simulator (compiled), {n} instance{'s' if n > 1 else ''}",
                figures[f"fcfs_{n}_instances_queries_per_s"] / 1e6,
                "M queries/s",
                Goal(">=", 20.0),
                f"the whole `simulate` call on {sizes.estimator_queries:,} Poisson queries at 70%"
                f" load, rm2 on g4dn.xlarge, Kairos batch mix; best of {sizes.estimator_repeats}",
                command,
                short=f"FCFS simulator, {n} instance{'s' if n > 1 else ''}",
            )
        )
    rows.append(
        Row(
            "event_engine",
            "event engine (any policy), FCFS, 1 instance",
            figures["event_engine_1_instances_queries_per_s"] / 1e3,
            "k queries/s",
            None,
            f"the same on the first {sizes.event_queries:,} queries through the general engine;"
            f" 64 instances: {fmt(figures['event_engine_64_instances_queries_per_s'] / 1e3)}"
            " k queries/s; one run",
            command,
        )
    )
    rows.append(
        Row(
            "envelope",
            f"arrival envelope, {int(figures['envelope_windows'])} tuner windows",
            figures["envelope_1m_arrivals_9_windows_ms"],
            "ms",
            Goal("<", 100.0) if arrivals >= 1_000_000 else None,
            f"max arrivals in any window of {arrivals:,} Poisson arrivals;"
            f" best of {sizes.estimator_repeats}"
            + ("" if arrivals >= 1_000_000 else " (the goal is for 1,000,000)"),
            command,
            short="arrival envelope, 1 M arrivals",
        )
    )
    return rows, figures


def bounds_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], dict[str, Any]]:
    from benchmarks import bounds_speed

    ctx.log(
        f"bounds: {sizes.bound_vectors:,} vectors, rankings at"
        f" {', '.join(f'${b:g}/hr' for b in sizes.bounds_budgets_usd_per_hr)}"
        f" for {len(sizes.bounds_models)} model(s)"
    )
    results = bounds_speed.measure(
        vectors=sizes.bound_vectors,
        repeats=sizes.bounds_repeats,
        ten_type_exhaustive=sizes.ten_type_exhaustive,
        budgets_usd_per_hr=sizes.bounds_budgets_usd_per_hr,
        models=sizes.bounds_models,
    )
    command = _script("bounds_speed")
    best = f"best of {sizes.bounds_repeats}"
    rows = [
        Row(
            "upper_bounds",
            "Kairos upper bound alone (vectorised)",
            results["upper_bounds_per_s"] / 1e6,
            "M configurations/s",
            None,
            f"`upper_bounds` of rm2 on {sizes.bound_vectors:,} random count vectors of the 4"
            f" measured types; {best}",
            command,
        )
    ]
    for label in ("4 types uncapped at $30/hr", "10 types at $7/hr"):
        entry = results.get(f"exhaustive, {label}")
        if entry is None:
            continue
        rows.append(
            Row(
                f"exhaustive_{label.split()[0]}_types",
                f"exhaustive ranking, {label}",
                entry["configurations_per_s"] / 1e6,
                "M configurations/s",
                Goal(">=", 10.0),
                f"every affordable configuration of rm2 bounded, top 10 kept:"
                f" {entry['configurations']:,} configurations in {fmt(entry['seconds'])} s; {best}",
                command,
                short=f"exhaustive ranking, {label.split(' at ')[0].replace(' uncapped', '')}",
            )
        )
    for budget in sizes.bounds_budgets_usd_per_hr:
        per_model = {
            model: results[f"10 types at ${budget:g}/hr, {model}"] for model in sizes.bounds_models
        }
        slowest = max(per_model, key=lambda m: per_model[m]["seconds"])
        rows.append(
            Row(
                f"ten_types_{budget:g}",
                f"exact top 10 of a 10-type catalog at ${budget:g}/hr, slowest model",
                per_model[slowest]["seconds"],
                "s",
                Goal("<", 5.0) if budget == 50.0 else None,
                f"branch and bound, {len(per_model)} model(s) (slowest: {slowest}, "
                f"{per_model[slowest]['enumerated']:,} bounded); {best}",
                command,
                short=f"top 10 of 10 types at ${budget:g}/hr",
            )
        )
    return rows, results


def matching_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], dict[str, float]]:
    from benchmarks import matching_speed

    ctx.log(
        f"matching: {sizes.matching_states[0]} + {sizes.matching_states[1]} random states,"
        f" {sizes.matching_queries:,} simulated queries at"
        f" {', '.join(map(str, sizes.matching_rates_qps))} qps"
    )
    figures = matching_speed.measure(
        sizes.matching_queries,
        states=sizes.matching_states,
        repeats=sizes.matching_repeats,
        rates_qps=sizes.matching_rates_qps,
    )
    command = _script("matching_speed")
    if sizes.matching_queries != FULL.matching_queries:
        command += f" --queries {sizes.matching_queries}"
    state = "Kairos-mix queue, waits in [0, 300] ms, 1 base in 8 instances, about half busy"
    rows = [
        Row(
            "decision_32x16",
            "Kairos dispatch round, 32 queued x 16 instances, median",
            figures["32x16_policy_round_median_us"],
            "us",
            Goal("<=", 50.0),
            f"the tail-aware policy's whole `dispatch` on {sizes.matching_states[0]:,} random"
            f" states ({state}); p99 {fmt(figures['32x16_policy_round_p99_us'])} us",
            command,
            short="Kairos round 32 x 16, median",
        ),
        Row(
            "decision_256x128",
            "Kairos dispatch round, 256 queued x 128 instances, p99",
            figures["256x128_policy_round_p99_us"] / 1e3,
            "ms",
            Goal("<=", 1.0),
            f"the same on {sizes.matching_states[1]:,} states; median"
            f" {fmt(figures['256x128_policy_round_median_us'] / 1e3)} ms; SciPy's solve alone"
            f" {fmt(figures['256x128_scipy_solve_only_p99_us'] / 1e3)} ms at p99",
            command,
            short="Kairos round 256 x 128, p99",
        ),
    ]
    for rate in sizes.matching_rates_qps:
        key = f"kairos_{rate}qps"
        if f"{key}_queries_per_s" not in figures:
            continue
        rows.append(
            Row(
                f"simulator_kairos_{rate}",
                f"simulator under the Kairos policy, rm2 at {rate} qps",
                figures[f"{key}_queries_per_s"] / 1e3,
                "k queries/s",
                Goal(">=", 50.0),
                f"event engine, 1 g4dn.xlarge + 13 r5n.large, {sizes.matching_queries:,} Poisson"
                f" queries, best of {sizes.matching_repeats}; FCFS"
                f" {fmt(figures[f'fcfs_{rate}qps_queries_per_s'] / 1e3)} k/s",
                command,
                short=f"simulator under Kairos, {rate} qps",
            )
        )
    return rows, figures


def planner_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], dict[str, Any]]:
    from benchmarks import planner_speed

    ctx.log(
        f"planner: {sizes.planner_duration_s:g} s at {sizes.planner_rate_qps:g} qps,"
        f" best of {sizes.planner_repeats}"
    )
    summary, _plan = planner_speed.measure(
        sizes.planner_rate_qps, sizes.planner_repeats, 0, sizes.planner_duration_s
    )
    full_trace = sizes.planner_duration_s == planner_speed.DURATION_S
    command = _script("planner_speed")
    if sizes.planner_repeats != 3:
        command += f" --repeat {sizes.planner_repeats}"
    row = Row(
        "planner",
        "planner, 3-stage cascade (wnd -> dien -> rm2)",
        summary["seconds_best"],
        "s",
        Goal("<", planner_speed.TARGET_S) if full_trace else None,
        f"`plan_app` on {summary['trace']['queries']:,} Poisson queries"
        f" ({sizes.planner_duration_s / 60:g} min at {sizes.planner_rate_qps:g} qps), 4 Kairos"
        f" types, ${planner_speed.BUDGET_USD_PER_HR:g}/hr, SLO {planner_speed.SLO_MS:g} ms;"
        f" {summary['simulations']} simulations; best of"
        f" {sizes.planner_repeats}"
        + ("" if full_trace else " (the goal is for a 10-minute trace)"),
        command,
        short="planner, 3-stage cascade",
    )
    return [row], summary


def gear_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], dict[str, Any]]:
    from benchmarks import gear_planner_speed
    from benchmarks.gear_demo import load_demo_family
    from estimator.errors import NoFeasibleGearError

    rows: list[Row] = []
    data: dict[str, Any] = {}
    for kind in sizes.gear_families:
        ctx.log(f"gear planner: the {kind} demo family, best of {sizes.gear_repeats}")
        family = load_demo_family(kind, progress=ctx.log)
        label = family.source.split(" (", 1)[0]
        command = _script("gear_planner_speed", *(() if kind == "auto" else ("--family", kind)))
        name = f"gear planner, demo family ({label})"
        try:
            summary, plan = gear_planner_speed.measure(family, sizes.gear_repeats, 0)
        except NoFeasibleGearError as error:
            # The real family's profiles are measured here, now: on a busy machine their tails
            # can put every cascade over the SLO; the synthetic family's row still times it.
            data[kind] = {"family": family.source, "error": str(error)}
            rows.append(
                Row(
                    f"gear_{label}",
                    name,
                    None,
                    "s",
                    Goal("<", gear_planner_speed.TARGET_S),
                    f"`plan_gears` on the {label} family (its profiles measured in this run)",
                    command,
                    note="no plan: " + str(error),
                    short=f"gear planner, {label} family",
                )
            )
            continue
        summary.pop("plan")
        summary["gears"] = [plan.options[g.option].cascade.label for g in plan.gears]
        data[kind] = summary
        rows.append(
            Row(
                f"gear_{label}",
                name,
                summary["seconds_best"],
                "s",
                Goal("<", gear_planner_speed.TARGET_S),
                f"`plan_gears` with its defaults ({summary['candidates']:,} candidate cascades,"
                f" {summary['finalists']} finalists, {summary['simulations']} simulations),"
                f" SLO {summary['slo_ms']:g} ms; best of {sizes.gear_repeats}",
                command,
                short=f"gear planner, {label} family",
            )
        )
    return rows, data


def dispatcher_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], list[dict[str, Any]]]:
    from benchmarks.serving_speed import dispatcher as dispatcher_speed

    rate = sizes.dispatcher_rate_qps
    duration = sizes.dispatcher_duration_s
    repeats = sizes.dispatcher_repeats
    runs = []
    p99_ranges: list[tuple[float, float]] = []

    def median_run(scenario: str, rate_qps: float, what: str) -> None:
        # The run of median p99 out of ``repeats`` (seeds 0, 1, ...), and the p99s' range.
        ctx.log(f"dispatcher: {scenario} at {rate_qps:,.0f} q/s for {duration:g} s{what}")
        done = sorted(
            (
                dispatcher_speed.run_scenario(
                    scenario, rate_qps, duration, seed, warmup_s=sizes.dispatcher_warmup_s
                )
                for seed in range(repeats)
            ),
            key=lambda r: r.p99_ms,
        )
        runs.append(done[len(done) // 2])
        p99_ranges.append((done[0].p99_ms, done[-1].p99_ms))

    for scenario in dispatcher_speed.SCENARIOS:
        median_run(scenario, rate, "")
    for headroom in sizes.dispatcher_headroom_qps:
        median_run("fcfs", headroom, " (headroom)")
    labels = {
        "fcfs": "FCFS, 4 workers, one call per query",
        "kairos": "Kairos, 1 fast + 3 slow workers",
        "cascade": "cascade tiny@0.5 -> large, 1.5 calls per query",
    }
    rows = []
    for run, (p99_low, p99_high) in zip(runs, p99_ranges, strict=True):
        command = _script("serving_speed dispatcher", "--scenario", run.scenario)
        if run.rate_qps != dispatcher_speed.GOAL_QPS:
            command += f" --rate-qps {run.rate_qps:g}"
        if duration != 10.0:
            command += f" --duration-s {duration:g}"
        at_goal_rate = run.rate_qps == dispatcher_speed.GOAL_QPS
        kept = run.answered == run.sent and run.sustained_qps >= dispatcher_speed.GOAL_QPS * (
            1 - 1e-9
        )
        rows.append(
            Row(
                f"dispatcher_{run.scenario}_{run.rate_qps:g}",
                f"serving dispatcher, {labels[run.scenario]}, at {run.rate_qps:,.0f} q/s"
                f" offered: p99 added",
                run.p99_ms,
                "ms",
                Goal("<=", dispatcher_speed.GOAL_P99_MS) if at_goal_rate else None,
                f"the run of median p99 of {repeats} (p99 range {fmt(p99_low)}-{fmt(p99_high)}"
                f" ms), each open-loop Poisson for {duration:g} s after"
                f" {sizes.dispatcher_warmup_s:g} s of"
                f" warm-up, real HTTP transport to in-process fake workers; {run.answered:,} of"
                f" {run.sent:,} answered, {fmt(run.sustained_qps)} q/s sustained, p50"
                f" {fmt(run.p50_ms)} ms"
                + ("" if at_goal_rate else " (headroom, beyond the goal's rate)"),
                command,
                note="" if kept or not at_goal_rate else "did not sustain 2,000 q/s",
                condition_ok=kept,
                short=f"dispatcher {run.scenario} at {run.rate_qps:,.0f} q/s, p99",
            )
        )
    return rows, [
        {
            **asdict(run),
            "meets_goal": run.meets_goal,
            "kept_up": run.kept_up,
            "verdict": v,
            "repeats": repeats,
            "p99_range_ms": list(p99),
        }
        for run, v, p99 in zip(runs, dispatch_verdicts(runs, rate), p99_ranges, strict=True)
    ]


def dispatch_verdicts(runs: Sequence[Any], goal_rate_qps: float) -> list[str]:
    """What ``serving_speed/dispatcher.py`` prints in its goal column: at the goal's rate "met",
    "kept up" (every query answered, p99 under 100 ms, but not the goal) or "fell behind"; at a
    higher rate
    (the headroom) "met", "past the goal" or "fell behind"."""
    verdicts = []
    for run in runs:
        if run.meets_goal:
            verdicts.append("met")
        elif not run.kept_up:
            verdicts.append("fell behind")
        else:
            verdicts.append("kept up" if run.rate_qps == goal_rate_qps else "past the goal")
    return verdicts


def ratio_figure(ctx: Context, rows: Sequence[Row]) -> Figure:
    """Horizontal bars: each goal's ratio (> 1: better than the goal), log scale."""
    plt = pyplot()
    judged = [row for row in rows if row.ratio is not None]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(judged) + 1.8))
    ratios = [max(row.ratio or 0.0, 1e-3) for row in judged]
    colours = ["tab:green" if row.met else "tab:red" for row in judged]
    positions = list(range(len(judged)))[::-1]
    ax.barh(positions, ratios, color=colours)
    for y, ratio, row in zip(positions, ratios, judged, strict=True):
        goal = row.goal.text(row.unit) if row.goal else ""
        ax.annotate(
            f" {fmt(row.value)} {row.unit} (goal {goal})",
            (ratio, y),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--", label="goal")
    ax.set_xscale("log")
    ax.set_yticks(positions)
    ax.set_yticklabels([row.short or row.name for row in judged], fontsize=8)
    ax.set_xlim(min(min(ratios) / 2, 0.5), max(max(ratios) * 40, 20))
    ax.set_xlabel("measured / goal (time goals: goal / measured), log scale; > 1 beats the goal")
    ax.set_title("Control plane speed against its goals (green: met, red: not met)")
    ax.legend(loc="lower right", fontsize=8)
    caption = (
        "Each speed goal's ratio: measured / goal for throughput goals, goal / measured for time"
        " goals, so a bar past the dashed line beats its goal"
        + (" (quick mode: small sizes, indicative only)" if ctx.quick else "")
    )
    return save_figure(ctx, fig, f"{KEY}-goals.png", caption)


def dispatcher_figure(ctx: Context, runs: Sequence[dict[str, Any]], goal_ms: float) -> Figure:
    """p50 / p99 / max added latency of each dispatcher run, log scale, the goal as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['scenario']}\n{r['rate_qps']:,.0f} q/s" for r in runs]
    width = 0.27
    for k, (what, colour) in enumerate(
        (("p50_ms", "tab:blue"), ("p99_ms", "tab:orange"), ("max_ms", "tab:grey"))
    ):
        ax.bar(
            [i + (k - 1) * width for i in range(len(runs))],
            [max(r[what], 1e-3) for r in runs],
            width,
            label=what.replace("_ms", ""),
            color=colour,
        )
    ax.axhline(
        goal_ms, color="red", linestyle="--", linewidth=1, label=f"goal: p99 <= {goal_ms:g} ms"
    )
    ax.set_yscale("log")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("latency added by the dispatcher (ms, log scale)")
    ax.set_title("Serving dispatcher: latency from scheduled arrival to answer, fake workers")
    ax.legend(fontsize=8)
    caption = (
        "Latency the serving dispatcher adds (open-loop Poisson arrivals, workers that answer at"
        " once), by scenario and offered rate, against the 5 ms p99 goal"
        + (
            f" (quick mode: {QUICK.dispatcher_duration_s:g} s runs, indicative only)"
            if ctx.quick
            else ""
        )
    )
    return save_figure(ctx, fig, f"{KEY}-dispatcher.png", caption)


def api_rows(ctx: Context, sizes: Sizes) -> tuple[list[Row], dict[str, Any] | None]:
    """The serving path where clients enter (``benchmarks/serving_speed/api.py``): the median of
    ``api_runs`` runs, p99 added against its goal, the sustained rate as its condition."""
    from benchmarks.serving_speed import api as api_speed

    command = _script("serving_speed api", "--json")
    name = (
        f"through the API (heteroplane serve, worker agent processes, loadgen --engine raw), at"
        f" {sizes.api_rate_qps:,.0f} q/s offered: p99 added"
    )
    goal = Goal("<=", api_speed.GOAL_ADDED_MS)
    if sizes.api_runs == 0:
        note = "not run in quick mode (it starts the service and worker processes)"
        return [Row("api_path", name, None, "ms", goal, "-", command, note=note)], None
    ctx.log(
        f"api path: {sizes.api_runs} runs at {sizes.api_rate_qps:,.0f} q/s for"
        f" {sizes.api_duration_s:g} s"
    )
    result = api_speed.measure(sizes.api_rate_qps, sizes.api_duration_s, 2, sizes.api_runs)
    added = result["p99_added_ms"]
    sustained = result["sustained_qps"]
    kept = sustained is not None and sustained["median"] >= api_speed.GOAL_QPS * 0.99
    cpu = result["cpu_ms_per_query"]
    row = Row(
        "api_path",
        name,
        None if added is None else added["median"],
        "ms",
        goal,
        f"median of {sizes.api_runs} runs of {sizes.api_duration_s:g} s (range"
        f" {fmt(added['min']) if added else '-'}-{fmt(added['max']) if added else '-'} ms);"
        f" sustained {fmt(sustained['median']) if sustained else '-'} q/s, service CPU"
        f" {fmt(cpu['median']) if cpu else '-'} ms a query; load average"
        f" {result['loadavg_before'][0]:.1f} before, {result['loadavg_after'][0]:.1f} after",
        command,
        note="" if kept else f"did not sustain {api_speed.GOAL_QPS:,.0f} q/s",
        condition_ok=kept,
        short=f"API path at {sizes.api_rate_qps:,.0f} q/s, p99 added",
    )
    return [row], result


def run(ctx: Context) -> Section:
    if not kairos_samples().exists():
        raise FileNotFoundError(f"needs the shared data at {kairos_samples()}")
    sizes = QUICK if ctx.quick else FULL
    load_before = os.getloadavg()
    started = time.perf_counter()
    timings_s: dict[str, float] = {}
    rows: list[Row] = []
    data: dict[str, Any] = {"sizes": asdict(sizes)}

    def step(name: str, measured: tuple[list[Row], Any]) -> None:
        rows.extend(measured[0])
        data[name] = measured[1]
        timings_s[name] = time.perf_counter() - started - sum(timings_s.values())

    step("estimator", estimator_rows(ctx, sizes))
    step("bounds", bounds_rows(ctx, sizes))
    step("matching", matching_rows(ctx, sizes))
    step("planner", planner_rows(ctx, sizes))
    step("gear_planner", gear_rows(ctx, sizes))
    step("dispatcher", dispatcher_rows(ctx, sizes))
    step("api", api_rows(ctx, sizes))
    load_after = os.getloadavg()

    from benchmarks.serving_speed import dispatcher as dispatcher_speed

    dispatcher_runs = data["dispatcher"]
    figures = [
        ratio_figure(ctx, rows),
        dispatcher_figure(ctx, dispatcher_runs, dispatcher_speed.GOAL_P99_MS),
    ]
    met, judged = goals_count(rows)
    data.update(
        rows=[{**asdict(row), "met": row.met, "ratio": row.ratio} for row in rows],
        goals_met=met,
        goals_judged=judged,
        seconds_by_script=timings_s,
        load_average_1min_before=load_before[0],
        load_average_1min_after=load_after[0],
    )
    return Section(
        key=KEY,
        title="The control plane's own speed",
        what=what_text(ctx, sizes, load_before[0], load_after[0]),
        rerun=RERUN,
        body=body_text(rows, dispatcher_runs, timings_s),
        summary=summary_lines(rows, sizes),
        data=data,
        figures=figures,
    )


def _by_key(rows: Sequence[Row]) -> dict[str, Row]:
    return {row.key: row for row in rows}


def _figure(name: str, row: Row | None) -> dict[str, str]:
    """``{name}`` and ``{name}_goal`` of a findings template: '12.3 ms' (or 'not measured') and
    ' (goal <= 5 ms: met)' (or '' without a goal)."""
    if row is None or row.value is None:
        return {name: "not measured", f"{name}_goal": ""}
    goal = (
        f" (goal {row.goal.text(row.unit)}: {'met' if row.met else 'not met'})" if row.goal else ""
    )
    return {name: f"{fmt(row.value)} {row.unit}", f"{name}_goal": goal}


def summary_lines(rows: Sequence[Row], sizes: Sizes) -> list[str]:
    """The README lines, one per part, each with its numbers and verdicts (their wording:
    benchmarks/results/findings/controlplane.md)."""
    by = _by_key(rows)
    met, judged = goals_count(rows)
    rate = sizes.matching_rates_qps[0]
    lines = [
        finding(
            KEY,
            "estimator",
            **_figure("fcfs_1", by.get("fcfs_1_instances")),
            **_figure("fcfs_64", by.get("fcfs_64_instances")),
            **_figure("envelope", by.get("envelope")),
            envelope_arrivals=f"{sizes.envelope_arrivals:,}",
        ),
        finding(
            KEY,
            "bounds",
            **_figure("exhaustive", by.get("exhaustive_4_types")),
            **_figure("ten_types", by.get("ten_types_50")),
            models=len(sizes.bounds_models),
        ),
        finding(
            KEY,
            "matching",
            **_figure("small", by.get("decision_32x16")),
            **_figure("large", by.get("decision_256x128")),
            **_figure("simulator", by.get(f"simulator_kairos_{rate}")),
            rate_qps=rate,
        ),
    ]
    gears = [row for row in rows if row.key.startswith("gear_")]
    gear = next((row for row in gears if row.value is not None), gears[0] if gears else None)
    family = (
        " " + finding(KEY, "gear_family", family=gear.short.split(", ", 1)[1])
        if gear and gear.short
        else ""
    )
    lines.append(
        finding(
            KEY,
            "planners",
            trace_min=f"{sizes.planner_duration_s / 60:g}",
            **_figure("planner", by.get("planner")),
            **_figure("gears", gear),
            family=family,
        )
    )
    dispatch = [row for row in rows if row.key.startswith("dispatcher_") and row.goal]
    headroom = [row for row in rows if row.key.startswith("dispatcher_") and not row.goal]
    lines.append(
        finding(
            KEY,
            "dispatcher",
            rate_qps=f"{sizes.dispatcher_rate_qps:,.0f}",
            scenarios=", ".join(
                finding(
                    KEY,
                    "dispatcher_scenario",
                    p99_ms=fmt(row.value),
                    scenario=row.key.split("_")[1],
                )
                for row in dispatch
            ),
            held=sum(bool(row.met) for row in dispatch),
            judged_scenarios=len(dispatch),
            headroom="".join(
                " "
                + finding(
                    KEY,
                    "dispatcher_headroom",
                    rate_qps=f"{float(row.key.split('_')[2]):,.0f}",
                    p99_ms=fmt(row.value),
                )
                for row in headroom
            ),
            met=met,
            judged=judged,
        )
    )
    api = by.get("api_path")
    if api is not None and api.value is not None:
        lines.append(
            finding(
                KEY,
                "api",
                rate_qps=f"{sizes.api_rate_qps:,.0f}",
                **_figure("added", api),
                measured_on=api.measured_on,
                note=f" ({api.note})" if api.note else "",
            )
        )
    return lines


def what_text(ctx: Context, sizes: Sizes, load_before: float, load_after: float) -> str:
    mode = (
        "**Quick mode**: every script at small sizes with one repeat (see `data.sizes`), so the"
        " numbers are only indicative; goals stated for a larger size are not judged."
        if ctx.quick
        else "Full mode: every script at its own default sizes (the commands in the table"
        " reproduce each figure alone), plus the dispatcher's FCFS scenario at 4,000 q/s for the"
        " headroom."
    )
    return f"""\
The control plane's own speed, against its goals: the estimator, the
Kairos bounds and matching dispatcher, the planner, the gear planner and the serving
path's dispatcher. Each figure comes from one of the speed scripts in `benchmarks/`,
imported and run here in one process, in turn (the table names the script; run alone, it prints
the same figures):

- estimator and bounds: the measured Kairos latency samples of the shared data (rm2 on
  g4dn.xlarge; the 4 measured EC2 types and 6 synthetic types scaled from them), the Kairos batch
  mix, Poisson arrivals;
- matching: random dispatch states and rm2 on 1 g4dn.xlarge + 13 r5n.large in the event engine;
- planner: the cascade wnd -> dien -> rm2 on the 4 Kairos types, $10/hr, SLO 1050 ms p99;
- gear planner: the demo family (the real scikit-learn digits family, its latency measured here
  and emulated on a slow type, when torch is installed; and the seeded synthetic one);
- serving path: `AppDispatcher` with its real HTTP transport to in-process fake workers that
  answer at once, open-loop Poisson load from scheduled arrivals, so the latency is what the
  dispatcher adds (a lower bound's worth of work on the loop: the fake workers' HTTP parsing runs
  on it too);
- the API path (`python -m benchmarks.serving_speed api`, full mode only): `heteroplane serve`
  with two worker agent processes that answer at once and `heteroplane loadgen --engine raw` in a
  process of its own, all on the same two cores; p99 added is the client's p99 less a worker
  round trip's.

{mode}

Timings are wall-clock on a 2-core machine shared with other work: the 1-minute load average was
{load_before:.1f} before and {load_after:.1f} after this run, and any load above about 1 makes the
figures pessimistic (the dispatcher's p99 is the most sensitive: it needs a core to itself).
Seeds are fixed, so the work is the same on every run; only the timings vary."""


def body_text(
    rows: Sequence[Row], runs: Sequence[dict[str, Any]], timings_s: dict[str, float]
) -> str:
    dispatcher = md_table(
        [
            "scenario",
            "offered q/s",
            "sent",
            "answered",
            "refused",
            "worker calls",
            "sustained q/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "drain ms",
            "CPU us/query",
            "verdict",
        ],
        [
            (
                r["scenario"],
                fmt(r["rate_qps"]),
                f"{r['sent']:,}",
                f"{r['answered']:,}",
                r["refused"],
                f"{r['worker_calls']:,}",
                fmt(r["sustained_qps"]),
                fmt(r["p50_ms"]),
                fmt(r["p99_ms"]),
                fmt(r["max_ms"]),
                fmt(r["drain_ms"]),
                fmt(r["cpu_us_per_query"]),
                r["verdict"],
            )
            for r in runs
        ],
        right="1,2,3,4,5,6,7,8,9,10,11",
    )
    spent = md_table(
        ["script", "seconds (this run)"],
        [(name, f"{seconds:.1f}") for name, seconds in timings_s.items()],
        right="1",
    )
    return "\n\n".join(
        [
            "Every figure, its goal and whether it holds (`-`: no goal is set for it, or the goal"
            " is for a larger size than this run's):",
            rows_table(rows),
            "The serving path in detail (`serving_speed/dispatcher.py`; latency from each query's"
            " scheduled arrival to its answer; drain: last answer after the last arrival; CPU"
            " counts the fake workers and the load generator too; verdict: the script's, where"
            " 'kept up' answers every query with p99 under 100 ms but misses the goal's 5 ms):",
            dispatcher,
            "Time each part of this run took:",
            spent,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    return experiment_main(run, (__doc__ or "").splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
