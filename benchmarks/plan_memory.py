"""Bounded planning: time and peak memory of one plan preview at budgets up to $1,000,000/hr.

    .venv/bin/python benchmarks/plan_memory.py [--json] [--budgets 10,1e3,1e5,1e6] [--runs 3]
        [--deadline-s 60]

Each run is a fresh Python process (so that its peak resident memory, ``ru_maxrss``, is the
preview's alone plus the interpreter and the libraries) that plans examples/rm2.yaml (the Kairos
setting: rm2 on four EC2 types, no ``max_counts``) at the given budget for a Poisson planning
trace at 60 qps, as ``POST /v1/apps/{app}/plans`` does (``controlplane.apps.plans``:
``planning_trace`` then ``plan_app`` inside the deadline of ``estimator.deadline``). It prints,
per budget, the median seconds and peak MB over the runs with their spread, and the outcome (the
plan's fleet, or the one-line reason it was given up). Goals: <= 512 MB at every budget, and an
answer (a plan, or the deadline's 422 reason) within the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_MB = 512.0

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from controlplane.apps.plans import PlanRequest, TraceRequest, planning_trace
from controlplane.policies.planner import plan_app
from controlplane.spec import load_spec, resolve_spec
from estimator import deadline
from estimator.errors import EstimatorError
budget, limit_s = float(sys.argv[1]), float(sys.argv[2])
spec = load_spec(Path("examples/rm2.yaml")).model_copy(update={"budget_usd_per_hr": budget})
app = resolve_spec(spec, Path("examples"))
trace, _ = planning_trace(app, PlanRequest(trace=TraceRequest(rate_qps=60.0)))
start = time.perf_counter()
try:
    with deadline.limit(limit_s):
        plan = plan_app(app, trace)
    outcome = ", ".join(f"{n} x {t}" for s in plan.stages for t, n in s.fleet.items())
except EstimatorError as error:
    outcome = str(error)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
print(json.dumps({"seconds": seconds, "peak_mb": peak, "outcome": outcome}))
"""


def one(budget: float, deadline_s: float) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, repr(budget), repr(deadline_s)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=deadline_s + 300,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="10,1e3,1e5,1e6")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error("--budgets: numbers separated by commas")
    if args.runs < 1 or not args.deadline_s > 0 or not all(b > 0 for b in budgets):
        parser.error("--runs >= 1, --deadline-s > 0 and budgets > 0")
    load = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for budget in budgets:
        runs = [one(budget, args.deadline_s) for _ in range(args.runs)]
        seconds = [float(r["seconds"]) for r in runs]  # type: ignore[arg-type]
        peaks = [float(r["peak_mb"]) for r in runs]  # type: ignore[arg-type]
        rows.append(
            {
                "budget_usd_per_hr": budget,
                "seconds_median": statistics.median(seconds),
                "seconds_range": [min(seconds), max(seconds)],
                "peak_mb_median": statistics.median(peaks),
                "peak_mb_range": [min(peaks), max(peaks)],
                "within_512_mb": max(peaks) <= GOAL_MB,
                "outcome": runs[-1]["outcome"],
            }
        )
        row = rows[-1]
        print(
            f"budget {budget:>10g} USD/hr: {row['seconds_median']:.2f} s"
            f" ({min(seconds):.2f}-{max(seconds):.2f}), peak {row['peak_mb_median']:.0f} MB"
            f" ({min(peaks):.0f}-{max(peaks):.0f}), {args.runs} runs: {row['outcome']}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps({"loadavg_start": load, "runs": args.runs, "budgets": rows}, indent=2))
    return 0 if all(r["within_512_mb"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
