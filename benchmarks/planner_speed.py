"""How long the planner takes on a 3-stage app over a 10-minute trace (target: under 10 s).

    .venv/bin/python benchmarks/planner_speed.py [--rate 50] [--repeat 3] [--seed 0] [--quick]
        [--json]

The app: the cascade [wnd, dien, rm2] of the Kairos models on the shared measurements, on the four
Kairos types (g4dn.xlarge, c5n.2xlarge, r5n.large, t3.xlarge), budget 10 USD/hr. Until scale
factors arrive the planner plans each model as its own stage on the whole trace with an equal
share of the SLO (docs/planner.md, Cascades); the SLO is 1050 ms so that each stage gets 350 ms,
which rm2 (the slowest) meets, as in the Kairos setting. The trace: 10 minutes of Poisson arrivals
at ``--rate`` qps with batch sizes from the Kairos mix. Prints the planning time (best of
``--repeat``) and the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app
from controlplane.spec import resolve_spec, validate_spec
from estimator.batches import parse_batch_distribution
from estimator.traces import Trace, poisson_arrivals

try:  # imported as benchmarks.planner_speed
    from benchmarks.paths import kairos_samples, shared_dir
    from benchmarks.sizes import add_quick, chosen
except ModuleNotFoundError:  # run as a script: the sibling modules
    from paths import kairos_samples, shared_dir
    from sizes import add_quick, chosen  # type: ignore[no-redef]

SHARED = shared_dir()
PROFILES = kairos_samples()

CASCADE = ["wnd", "dien", "rm2"]
SLO_MS = 1050.0  # an equal share of 350 ms per stage
BUDGET_USD_PER_HR = 10.0
TYPES = ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"]
DURATION_S = 600.0
TARGET_S = 10.0


def measure(
    rate_qps: float = 50.0, repeat: int = 3, seed: int = 0, duration_s: float = DURATION_S
) -> tuple[dict[str, Any], PlanDocument]:
    """Plan the app over ``duration_s`` of Poisson arrivals at ``rate_qps``, ``repeat`` times;
    return the summary (the ``--json`` object: ``seconds_best`` is the best time) and the plan."""
    spec = validate_spec(
        {
            "name": "cascade-speed",
            "models": [{"name": m, "profiles": str(PROFILES)} for m in CASCADE],
            "cascade": CASCADE,
            "slo": {"latency_ms": SLO_MS, "percentile": 99},
            "budget_usd_per_hr": BUDGET_USD_PER_HR,
            "instance_types": TYPES,
        }
    )
    app = resolve_spec(spec)
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rate_qps, duration_s, rng)
    trace = Trace(arrivals, parse_batch_distribution("kairos").sample(arrivals.size, rng))

    times: list[float] = []
    plan: PlanDocument | None = None
    for _ in range(max(1, repeat)):
        started = time.perf_counter()
        plan = plan_app(app, trace, seed=seed)
        times.append(time.perf_counter() - started)
    assert plan is not None
    best = min(times)
    summary = {
        "app": spec.name,
        "cascade": CASCADE,
        "slo_ms": SLO_MS,
        "budget_usd_per_hr": BUDGET_USD_PER_HR,
        "trace": {"queries": len(trace), "duration_s": duration_s, "rate_qps": rate_qps},
        "seconds_best": best,
        "seconds_all": times,
        "under_target": best < TARGET_S,
        "feasible": plan.feasible,
        "cost_usd_per_hr": plan.cost_usd_per_hr,
        "simulations": plan.simulations,
        "stages": [
            {
                "name": s.name,
                "fleet": {t: n for t, n in s.fleet.items() if n},
                "batch_size": s.batch_size,
                "predicted_p99_ms": s.predicted_p99_ms,
                "cost_usd_per_hr": s.cost_usd_per_hr,
                "policy": s.policy,
            }
            for s in plan.stages
        ],
    }
    return summary, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0, help="Poisson rate (qps)")
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed runs (best is reported; default 3)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_quick(parser)
    args = parser.parse_args(argv)
    sizes = chosen(args)
    repeat = sizes.planner_repeats if args.repeat is None else args.repeat
    duration_s = sizes.planner_duration_s

    summary, plan = measure(args.rate, repeat, args.seed, duration_s)
    best: float = summary["seconds_best"]
    times: list[float] = summary["seconds_all"]
    queries: int = summary["trace"]["queries"]
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"planned {summary['app']} ({' -> '.join(CASCADE)}, SLO {SLO_MS:g} ms p99, budget"
        f" ${BUDGET_USD_PER_HR:g}/hr) over {queries:,} Poisson queries ({duration_s:g} s at"
        f" {args.rate:g} qps)"
    )
    print(
        f"planning time: best {best:.2f} s of {len(times)} ({', '.join(f'{t:.2f}' for t in times)}"
        f" s); target < {TARGET_S:g} s: {'holds' if best < TARGET_S else 'FAILS'}"
    )
    print(
        f"plan: feasible {plan.feasible}, ${plan.cost_usd_per_hr:.3f}/hr,"
        f" {plan.simulations} simulations"
    )
    for s in plan.stages:
        fleet = ", ".join(f"{n} x {t}" for t, n in sorted(s.fleet.items()) if n)
        print(
            f"  {s.name}: {fleet}; batch {s.batch_size}; predicted p99 {s.predicted_p99_ms:.1f} ms;"
            f" ${s.cost_usd_per_hr:.3f}/hr; {s.policy}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
