"""Fidelity: what the planner predicts against what clients of the live service measure.

This experiment owns the section ``fidelity`` of docs/results. It runs the two live benchmarks of
``benchmarks/`` (imported, so each can be rerun alone with its script):

- ``fidelity/serving.py``: one app, one emulated instance, service times of about 5, 15 and 50 ms
  per batch, and a user's ONNX CNN pushed to the registry and queried over ``/v2`` (JSON and
  binary tensors); at 30%, 60% and 90% of the plan's capacity, the P99 a loadgen client measures
  against the planner's model (the serving-path profile plus a draw per query from the
  distribution of the service's own time it measured) and against that model with the path the
  service does not see (measured by the client in the warm-up) added, three seeded Poisson
  traces per level;
- ``fidelity/demo.py``: the demo's cascade as ``make demo`` serves it, at its applied plan's
  ``rate_qps``, against the plan's ``predicted_p99_ms``: three runs, the median and the spread.

The goal is measured / predicted P99 within 15% everywhere (the acceptance for the demo is 25%).
Full mode: 30 s per level and run, 60 s per demo run (about 40 minutes on a 2-core machine).
Quick mode: the 15 ms service time at 50% of capacity for 2.5 s after a 5 s warm-up, one run, no
demo (under half a minute; indicative only).
The load average before and after is recorded: the service, its workers and the load generator
share the machine's CPUs, and other work on it moves the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.fidelity import demo as demo_fidelity
from benchmarks.fidelity import serving as serving_fidelity
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

GOAL = 0.15
FULL_SERVICE_MS = (5.0, 15.0, 50.0)
FULL_ENCODINGS = serving_fidelity.ENCODINGS
FULL_LEVELS = (0.3, 0.6, 0.9)
FULL_DURATION_S = serving_fidelity.DEFAULT_DURATION_S
DEMO_DURATION_S = 60.0
QUICK_SERVICE_MS = (15.0,)
QUICK_LEVELS = (0.5,)
QUICK_DURATION_S = 2.5
# Enough queries for the service's overhead figure, which takes 50 of those it keeps: at the
# quick setting's 30 q/s it keeps one in two (a minute's span of 1,024), so 3 s (91 queries)
# were sometimes too few and the warm-up waited for a figure that never came.
QUICK_WARMUP_S = 5.0
QUICK_PROFILE_SAMPLES = 20
SEED = 1
DEMO_RUNS = 3


KEY = "fidelity"


def ratio_spread(ratios: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of measured / predicted ratios."""
    return statistics.median(ratios), min(ratios), max(ratios)


def within(ratio: float, goal: float = GOAL) -> bool:
    """Whether a measured / predicted ratio meets the goal: |ratio - 1| <= goal."""
    return abs(ratio - 1.0) <= goal


def summary_lines(
    rows: Sequence[dict[str, Any]],
    levels: Sequence[float],
    demo: dict[str, Any] | None,
) -> list[str]:
    """The section's findings (their wording: benchmarks/results/findings/fidelity.md)."""
    ratios = [float(r["ratio"]) for r in rows]
    median, low, high = ratio_spread(ratios)
    lines = [
        finding(
            KEY,
            "levels",
            levels=len(rows),
            settings="; ".join(dict.fromkeys(str(r["setting"]) for r in rows)),
            utilisations=", ".join(f"{u:.0%}" for u in levels),
            median=f"{median:.3f}",
            low=f"{low:.3f}",
            high=f"{high:.3f}",
            held=sum(bool(r["holds"]) for r in rows),
            client_held=sum(bool(r["client_holds"]) for r in rows),
        )
    ]
    if demo is not None:
        spread = demo["spread"]["ratio"]
        lines.append(
            finding(
                KEY,
                "demo",
                rate_qps=f"{demo['rate_qps']:.1f}",
                measured_p99_ms=f"{demo['p99_ms']:.0f}",
                predicted_p99_ms=f"{demo['predicted_p99_ms']:.0f}",
                ratio=f"{demo['ratio']:.3f}",
                runs=len(demo["runs"]),
                low=f"{spread['min']:.3f}",
                high=f"{spread['max']:.3f}",
            )
        )
    return lines


def run(ctx: Context) -> Section:
    load_before = [round(x, 2) for x in os.getloadavg()]
    service_times = QUICK_SERVICE_MS if ctx.quick else FULL_SERVICE_MS
    levels = QUICK_LEVELS if ctx.quick else FULL_LEVELS
    duration = QUICK_DURATION_S if ctx.quick else FULL_DURATION_S
    started = time.perf_counter()
    options = serving_fidelity.Options(
        levels,
        duration,
        1 if ctx.quick else serving_fidelity.DEFAULT_RUNS,
        QUICK_WARMUP_S if ctx.quick else serving_fidelity.WARMUP_S,
        QUICK_PROFILE_SAMPLES if ctx.quick else serving_fidelity.PROFILE_SAMPLES,
    )
    encodings = () if ctx.quick else FULL_ENCODINGS
    settings = serving_fidelity.run(service_times, options, ctx.log, encodings)
    rows = serving_fidelity.as_json(settings)
    ctx.log(f"the serving benchmarks took {time.perf_counter() - started:.0f} s")
    if not ctx.quick:  # the page that explains the model gets the same figures
        page = serving_fidelity.markdown(
            settings, ["python -m benchmarks.results.fidelity"], duration
        )
        out = serving_fidelity.DEFAULT_OUT
        out.write_text(page + serving_fidelity.kept_sections(out))
    demo: dict[str, Any] | None = None
    if not ctx.quick:
        ctx.log("the demo cascade at its planned rate")
        args = argparse.Namespace(duration_s=DEMO_DURATION_S, runs=DEMO_RUNS, warmup_s=20.0, port=0)
        with tempfile.TemporaryDirectory(prefix="heteroplane-fidelity-") as folder:
            demo = demo_fidelity.measure(args, Path(folder))
    load_after = [round(x, 2) for x in os.getloadavg()]

    table = md_table(
        [
            "setting",
            "rho",
            "rate, qps",
            "P99 measured, ms",
            "P99 planner, ms",
            "measured / planner (runs)",
            "within 15%",
            "P99 with the client's path, ms",
            "within 15%",
        ],
        [
            [
                r["setting"],
                f"{r['utilisation']:g}",
                f"{r['rate_qps']:.1f}",
                f"{r['measured_p99_ms']:.1f}",
                f"{r['predicted_p99_ms']:.1f}",
                f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
                "yes" if r["holds"] else "no",
                f"{r['client_path_p99_ms']:.1f}",
                "yes" if r["client_holds"] else "no",
            ]
            for r in rows
        ],
        right="1,2,3,4,5,7",
    )
    models = "\n".join(
        f"- {s.label}: serving-path round trip {s.round_trip_ms:.2f} ms per batch of one,"
        f" capacity {s.capacity_qps:.1f} qps; the service's own time per query, median"
        f" {s.overhead_ms:.2f} ms, p99 {s.overhead_p99_ms:.2f} ms; outside it (the client's"
        f" path) p99 {s.outside_p99_ms:.2f} ms."
        for s in settings
    )
    summary = summary_lines(rows, levels, demo)
    body = f"""The planner's model of each service time:

{models}

{table}
"""
    if demo is not None:
        spread = demo["spread"]["ratio"]
        body += f"""
**The demo cascade** (`heteroplane demo --no-load`, plan {demo["plan"]}, `rate_qps`
{demo["rate_qps"]:.2f}): predicted P99 {demo["predicted_p99_ms"]:.1f} ms; measured, median of
{len(demo["runs"])} runs of {DEMO_DURATION_S:g} s, {demo["p99_ms"]:.1f} ms; measured / predicted
{demo["ratio"]:.3f} (runs {spread["min"]:.3f}-{spread["max"]:.3f}); attainment
{demo["attainment"]:.3f}.
"""
    body += f"""
Load average (1 / 5 / 15 min) {" / ".join(map(str, load_before))} before,
{" / ".join(map(str, load_after))} after. The page docs/serving-fidelity.md explains what the
model holds and what it leaves out.
"""
    figures = [plot(ctx, rows, demo)]
    return Section(
        key=KEY,
        figures=figures,
        title="Fidelity: predicted against measured P99",
        what=__doc__.split("\n\n", 1)[1].strip() if __doc__ else "",
        rerun="python -m benchmarks.results.fidelity",
        body=body,
        summary=summary,
        data={
            "levels": rows,
            "demo": demo,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
    )


def plot(ctx: Context, rows: list[dict[str, Any]], demo: dict[str, Any] | None) -> Figure:
    """Measured against predicted P99 per level (log-log), the 15% band around y = x."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    markers = "os^vD"
    for k, setting in enumerate(dict.fromkeys(r["setting"] for r in rows)):
        mine = [r for r in rows if r["setting"] == setting]
        ax.scatter(
            [r["predicted_p99_ms"] for r in mine],
            [r["measured_p99_ms"] for r in mine],
            marker=markers[k % len(markers)],
            label=setting,
        )
    if demo is not None:
        ax.scatter(
            [r["predicted_p99_ms"] for r in demo["runs"]],
            [r["p99_ms"] for r in demo["runs"]],
            marker="^",
            label="demo cascade",
        )
    values = [r["predicted_p99_ms"] for r in rows] + [r["measured_p99_ms"] for r in rows]
    low, high = 0.8 * min(values), 1.25 * max(values)
    line = [low, high]
    ax.plot(line, line, color="black", linewidth=1, label="measured = predicted")
    ax.fill_between(line, [v * (1 - GOAL) for v in line], [v * (1 + GOAL) for v in line],
                    color="grey", alpha=0.2, label="within 15%")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("P99 predicted by the planner's model, ms")
    ax.set_ylabel("P99 measured at the client, ms")
    ax.legend(fontsize=8)
    return save_figure(
        ctx,
        fig,
        "fidelity_p99.png",
        "Each level's P99 at the client against the planner's prediction (log-log); the band is"
        " the 15% goal.",
    )


if __name__ == "__main__":
    raise SystemExit(experiment_main(run, __doc__.splitlines()[0] if __doc__ else "fidelity"))
