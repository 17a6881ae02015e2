"""How long the gear planner takes for the demo cascade app (target: under 2 s).

    .venv/bin/python benchmarks/gear_planner_speed.py [--family auto|real|synthetic]
        [--validation FILE] [--profiles FILE] [--repeat 3] [--seed 0] [--quick] [--json]

The demo app is the one of ``benchmarks/gear_demo.py``: the real model family when it can run
here (its validation records and latency profiles measured here, on the slow emulated type),
else the seeded synthetic one; the fleet places every model on one instance and the most
accurate on three; the SLO is 10x the most accurate model's batch-1 latency. The planner
(``controlplane.policies.gears.plan_gears``) runs with its defaults: the threshold grid 0.1..0.9 on
every ordered chain of the models, 8 ranges, up to 8 finalists simulated by bisection. Prints the
best of ``--repeat`` timings (measuring the profiles is not part of it) and the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from controlplane.policies.gears import GearPlan, plan_gears

try:  # imported as benchmarks.gear_planner_speed (benchmarks/results)
    from benchmarks.gear_demo import DemoFamily, load_demo_family
    from benchmarks.sizes import add_quick, chosen
except ModuleNotFoundError:  # run as a script: the sibling modules
    from gear_demo import DemoFamily, load_demo_family
    from sizes import add_quick, chosen  # type: ignore[no-redef]

TARGET_S = 2.0


def measure(family: DemoFamily, repeat: int = 3, seed: int = 0) -> tuple[dict[str, Any], GearPlan]:
    """Plan the family's gears ``repeat`` times; return the summary (the ``--json`` object:
    ``seconds_best`` is the best time) and the plan. Raises
    :class:`~estimator.errors.NoFeasibleGearError` when no cascade meets the SLO."""
    placement = family.placement()
    prices = {family.instance_type: family.price_usd_per_hr}
    times: list[float] = []
    plan: GearPlan | None = None
    for _ in range(max(1, repeat)):
        started = time.perf_counter()
        plan = plan_gears(
            family.records, placement, family.profiles, prices, slo_ms=family.slo_ms, seed=seed
        )
        times.append(time.perf_counter() - started)
    assert plan is not None
    best = min(times)
    summary = {
        "family": family.source,
        "placement": str(placement),
        "slo_ms": family.slo_ms,
        "seconds_best": best,
        "seconds_all": times,
        "target_s": TARGET_S,
        "under_target": best < TARGET_S,
        "candidates": plan.candidates,
        "finalists": len(plan.options),
        "simulations": plan.simulations,
        "plan": plan.to_document(),
    }
    return summary, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family", default=None, choices=("auto", "real", "synthetic"), help="default auto"
    )
    parser.add_argument("--validation", type=Path, help="validation.json of the real family")
    parser.add_argument("--profiles", type=Path, help="profile JSON of the real family")
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed runs (best is reported; default 3)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_quick(parser, "the synthetic family, one run (make bench)")
    args = parser.parse_args(argv)
    sizes = chosen(args)
    if args.family is None:
        args.family = sizes.gear_families[0]
    if args.repeat is None:
        args.repeat = sizes.gear_repeats

    say = (lambda m: print(m, file=sys.stderr, flush=True)) if not args.json else (lambda m: None)
    family = load_demo_family(
        args.family,
        validation=args.validation,
        profiles=args.profiles,
        seed=args.seed,
        progress=say,
    )
    summary, plan = measure(family, args.repeat, args.seed)
    placement = summary["placement"]
    best: float = summary["seconds_best"]
    times: list[float] = summary["seconds_all"]
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0 if summary["under_target"] else 1
    print(f"demo app: {family.source}")
    print(f"fleet {placement}, SLO P99 <= {family.slo_ms:g} ms")
    print(
        f"gear planning time: best {best:.2f} s of {len(times)}"
        f" ({', '.join(f'{t:.2f}' for t in times)} s); target < {TARGET_S:g} s:"
        f" {'holds' if best < TARGET_S else 'FAILS'}"
    )
    print(
        f"{plan.candidates} candidate cascades, {len(plan.options)} finalists,"
        f" {plan.simulations} simulations"
    )
    for gear in plan.gears:
        option = plan.options[gear.option]
        print(
            f"  [{gear.low_qps:>9.1f}, {gear.high_qps:>9.1f}) qps: {option.cascade.label}"
            f" ({100 * option.quality.accuracy:.2f}%)"
        )
    return 0 if summary["under_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
