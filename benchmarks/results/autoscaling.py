"""Autoscaling on held-out traffic: the tuner against the oracle, CG-Peak/Mean, the static plan
and target tracking.

This experiment owns the held-out evaluation of autoscaling: benchmarks/autoscaling_heldout.py
(its docstring has the whole setup: the trace family, the models and the cascade, the planning
guess, the policies, the goals) on its **test** seeds, and on its **tuning** seeds reported apart
and labelled so: a tuner's parameters are chosen on the tuning set, its standing is the test set's.

Quick mode (CI): one family (a rise), rm2 only, 1-minute traces, the first seed of each set
(indicative only).
"""

from __future__ import annotations

from typing import Any

from benchmarks.autoscaling_heldout import (
    CV2_CHOICES,
    FAMILIES,
    MAX_BLIP_COST_OVER_STATIC,
    MAX_COST_OVER_ORACLE,
    MAX_MISS,
    MAX_MISS_STEEP_STEP,
    MIN_MEAN_PEAK_OVER_COST,
    MODELS,
    NOMINAL_CV2,
    NOMINAL_RATE_QPS,
    PEAK_TIE_SHARE,
    POLICIES,
    STEEP_STEP,
    run_sets,
    set_markdown,
)
from benchmarks.results.common import (
    Context,
    Figure,
    Section,
    experiment_main,
    pyplot,
    save_figure,
)
from benchmarks.results.findings import finding

KEY = "autoscaling"
QUICK_FAMILIES = ("rise",)
QUICK_MODELS = ("rm2",)
QUICK_DURATION_S = 60.0  # 120 s before 2026-12-07
SET_ORDER = ("test", "tuning")


def run(ctx: Context) -> Section:
    if ctx.quick:
        report = run_sets(
            SET_ORDER,
            families=QUICK_FAMILIES,
            models=QUICK_MODELS,
            quick=True,
            duration_s=QUICK_DURATION_S,
            progress=ctx.log,
        )
    else:
        # Two processes: the full run is 72 cases (about 15 minutes this way on two cores).
        report = run_sets(SET_ORDER, progress=ctx.log, jobs=2)
    data = {
        "sets": report["sets"],
        "families": list(QUICK_FAMILIES if ctx.quick else FAMILIES),
        "models": list(QUICK_MODELS if ctx.quick else MODELS),
        "seconds": report["seconds"],
    }
    return Section(
        key=KEY,
        title="Autoscaling on held-out traffic",
        what=what_text(data),
        rerun="python -m benchmarks.results --only autoscaling",
        body=body_text(data),
        summary=summary_lines(data),
        data=data,
        figures=[plot_cost_miss(ctx, data)],
    )


def what_text(data: dict[str, Any]) -> str:
    seeds = {name: s["seeds"] for name, s in data["sets"].items()}
    rates = ", ".join(f"{m} {NOMINAL_RATE_QPS[m]:g} qps" for m in data["models"])
    return f"""\
- Traces (benchmarks/autoscaling_heldout.py, whose docstring defines each family; its command
  line prints the same tables): the families {", ".join(data["families"])}, each drawn per
  (family, model, seed), gamma arrivals with CV^2 drawn from
  {", ".join(f"{c:g}" for c in CV2_CHOICES)}; models {", ".join(data["models"])} (nominal rates
  R: {rates}). Seeds: test {seeds.get("test")}, tuning {seeds.get("tuning")} (disjoint; a
  tuner's parameters are chosen on the tuning set only).
- Planning: each model is planned on a steady trace at R with CV^2 = {NOMINAL_CV2:g} (the user's
  guess, never the test trace); that plan is the static plan and the tuner's start.
- Policies: the tuner (replay's `tuner` policy, its default model as `heteroplane replay` sets
  it up), the static plan, CG-Peak and CG-Mean (replay's `peak` and `mean`: the planner for the
  trace's 10 s peak or mean rate on a steady trace of its CV^2), target tracking (replay's
  `utilization` policy, its target the static plan's utilisation at R; single stage only) and
  the clairvoyant per-minute oracle (the planner at each minute's mean rate, instance-seconds;
  each minute's fleet serves with its plan's batch).
- Goals, per trace: misses <= {MAX_MISS:.0%} ({MAX_MISS_STEEP_STEP:.0%} across a step
  of more than {STEEP_STEP:g}x), cost <= {MAX_COST_OVER_ORACLE:g}x the oracle and below CG-Peak's
  (by more than {PEAK_TIE_SHARE:.1%}: a replay is costed to its last answer, so runs of one fleet
  differ by milliseconds); a blip: cost <= {MAX_BLIP_COST_OVER_STATIC:g}x the static plan's;
  across a set, CG-Peak / cost averages >= {MIN_MEAN_PEAK_OVER_COST:g}.
- Caveats: simulated (the replay's discrete-event simulator on measured latency samples, boot
  60 s GPU / 30 s CPU), not measured on EC2; the replay refuses at arrival what the service's
  admission control refuses (a query whose queue cannot be served within the SLO; every policy
  alike, docs/replay.md), so the miss share counts late and refused queries (until 2026-11-30
  every query was served, however late); a fleet of one type is dispatched FCFS whatever the
  plan names, as the live dispatcher does (until 2026-12-04 the replay kept the plan's Kairos
  on a mix thinned to one GPU, and the oracle's minutes batched one query whatever their plans
  said, docs/replay.md); the oracle's plans are cached per rate rounded to 2% of R."""


def body_text(data: dict[str, Any]) -> str:
    parts = []
    for name in SET_ORDER:
        s = data["sets"].get(name)
        if s is None:
            continue
        title = (
            "Test set (held out)"
            if name == "test"
            else "Tuning set (reported apart: a tuner's parameters are chosen on it)"
        )
        parts.append(set_markdown(title, s["rows"], s["summary"]))
    return "\n".join(parts)


def _policy_words(summary: dict[str, Any], name: str) -> str:
    p = summary["policies"].get(name)
    if p is None:
        return finding(KEY, "policy_not_run", name=name)
    miss = "n/a" if p["mean_miss_share"] is None else f"{100 * p['mean_miss_share']:.2f}%"
    return finding(
        KEY,
        "policy",
        name=name,
        mean_cost_over_oracle=f"{p['mean_cost_over_oracle']:.2f}",
        miss=miss,
        meets_goal=p["meets_goal"],
        rows=p["rows"],
    )


def readme_headline(data: dict[str, Any]) -> str:
    """The README's words after this section's link: the held-out test set's figures (the
    issue asks the README for those, never the tuning set's); empty without a test set."""
    test = data["sets"].get("test")
    if test is None:
        return ""
    tuner = test["summary"]["policies"]["tuner"]
    return finding(
        KEY,
        "readme",
        mean_cost_over_oracle=f"{tuner['mean_cost_over_oracle']:.2f}",
        mean_miss_pct=f"{100 * tuner['mean_miss_share']:.2f}",
        meets_goal=tuner["meets_goal"],
        rows=tuner["rows"],
    )


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The section's findings (their wording: benchmarks/results/findings/autoscaling.md)."""
    lines = []
    for name in SET_ORDER:
        s = data["sets"].get(name)
        if s is None:
            continue
        summary = s["summary"]
        tuner = summary["policies"]["tuner"]
        oracle = summary["policies"]["oracle"]
        label = finding(KEY, f"set_label_{name}", rows=summary["rows"])
        lines.append(
            finding(
                KEY,
                "tuner",
                label=label,
                meets_goal=tuner["meets_goal"],
                rows=tuner["rows"],
                mean_cost_over_oracle=f"{tuner['mean_cost_over_oracle']:.2f}",
                max_cost_over_oracle=f"{tuner['max_cost_over_oracle']:.2f}",
                mean_miss_pct=f"{100 * tuner['mean_miss_share']:.2f}",
                max_miss_pct=f"{100 * tuner['max_miss_share']:.2f}",
                mean_peak_over_cost=f"{tuner['mean_peak_over_cost']:.2f}",
                goal_peak_over_cost=f"{MIN_MEAN_PEAK_OVER_COST:g}",
                oracle_peak_over_cost=f"{oracle['mean_peak_over_cost']:.2f}",
            )
        )
        if name == "test":
            others = [_policy_words(summary, p) for p in POLICIES if p not in ("tuner", "oracle")]
            lines.append(finding(KEY, "others", policies="; ".join(others)))
            if summary.get("blips"):
                lines.append(
                    finding(
                        KEY,
                        "blips",
                        max_blip_cost_over_static=f"{MAX_BLIP_COST_OVER_STATIC:g}",
                        within_static=summary["blips_within_static"],
                        blips=summary["blips"],
                    )
                )
    return lines


STYLE = {
    "tuner": ("tab:blue", "o"),
    "static": ("tab:gray", "x"),
    "CG-Peak": ("tab:green", "s"),
    "CG-Mean": ("tab:red", "v"),
    "target tracking": ("tab:orange", "D"),
}


def plot_cost_miss(ctx: Context, data: dict[str, Any]) -> Figure:
    plt = pyplot()
    names = [n for n in SET_ORDER if n in data["sets"]]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = data["sets"][name]["rows"]
        for policy, (color, marker) in STYLE.items():
            points = [r["policies"][policy] for r in rows if r["policies"].get(policy)]
            ax.scatter(
                [m["cost_over_oracle"] for m in points],
                [100 * m["miss_share"] for m in points],
                color=color,
                marker=marker,
                label=policy,
                s=30,
            )
        ax.axvline(MAX_COST_OVER_ORACLE, color="black", ls=":", lw=1)
        ax.axhline(100 * MAX_MISS, color="black", ls=":", lw=1)
        ax.set_xlabel("cost / oracle")
        ax.set_ylabel("queries over the SLO (%)")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_title(f"{name} set ({len(rows)} traces)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return save_figure(
        ctx,
        fig,
        f"{KEY}-cost-miss.png",
        "Each trace's cost over the oracle's against its share of queries over the SLO (late or"
        " refused), per policy (the dotted lines: the goal's 1.15x and 1%; lower left is better).",
    )


def main(argv: list[str] | None = None) -> int:
    return experiment_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
