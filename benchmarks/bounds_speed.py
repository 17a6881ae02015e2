"""How fast the Kairos bounds rank configurations: configurations per second, and a 10-type catalog.

    .venv/bin/python benchmarks/bounds_speed.py [--quick] [--json]

- The bound alone: ``upper_bounds`` on 2,000,000 random count vectors of the four measured types.
- Exhaustive ranking (every affordable configuration bounded, the top 10 kept): the four measured
  types (g4dn.xlarge, c5n.2xlarge, r5n.large, t3.xlarge) uncapped at $30/hr, and the 10-type
  catalog below at $7/hr. Rate = configurations enumerated / wall time of ``rank_configurations``.
- The 10-type catalog at $50/hr and $100/hr: the exact top 10 (branch and bound; the box of count
  vectors holds about 1e21 and 1e24), for each of the five models.

The 10 types: the four measured ones, and six synthetic ones whose latency samples are a measured
type's scaled by a factor (``SYNTHETIC``), priced from the default catalog. rm2 at 350 ms, wnd and
mtwnd at 25, dien at 35, ncf at 5; the Kairos batch mix. Timings: best of 3 after a warm-up run.

Goals: >= 10 million configurations ranked per second; the 10-type catalog at $50/hr
ranked in < 5 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from estimator.batches import kairos_batch_pmf
from estimator.bounds import KairosQuantities, kairos_quantities, rank_configurations, upper_bounds
from estimator.catalog import load_catalog
from estimator.profiles import LatencyProfile, ProfileSet, load_profiles

try:  # imported as benchmarks.bounds_speed
    from benchmarks.paths import kairos_samples, shared_dir
    from benchmarks.sizes import add_quick, chosen
except ModuleNotFoundError:  # run as a script: the sibling modules
    from paths import kairos_samples, shared_dir
    from sizes import add_quick, chosen  # type: ignore[no-redef]

SHARED = shared_dir()
PROFILES = kairos_samples()
MEASURED = ("g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge")
# name: (measured type, latency factor). Larger sizes of a family run somewhat faster.
SYNTHETIC = {
    "g4dn.2xlarge": ("g4dn.xlarge", 0.95),
    "g5.xlarge": ("g4dn.xlarge", 0.6),
    "c5n.4xlarge": ("c5n.2xlarge", 0.85),
    "r5n.xlarge": ("r5n.large", 0.85),
    "c5.2xlarge": ("c5n.2xlarge", 1.05),
    "m5.xlarge": ("t3.xlarge", 0.9),
}
QOS_MS = {"rm2": 350.0, "wnd": 25.0, "mtwnd": 25.0, "dien": 35.0, "ncf": 5.0}


def best_of(repeats: int, run: Callable[[], object]) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def ten_type_profiles(measured: ProfileSet) -> ProfileSet:
    profiles = list(measured.values())
    for name, (source, factor) in SYNTHETIC.items():
        for model in measured.models:
            base = measured.get_profile(model, source)
            cells = tuple(cell * factor for cell in base.samples_ms)
            profiles.append(LatencyProfile(model, name, base.batch_sizes, cells))
    return ProfileSet(profiles)


def quantities(profiles: ProfileSet, model: str, types: tuple[str, ...]) -> KairosQuantities:
    catalog = load_catalog()
    prices = {name: catalog.price_usd_per_hr(name) for name in types}
    return kairos_quantities(profiles, model, types, prices, QOS_MS[model], kairos_batch_pmf())


def measure(
    *,
    vectors: int = 2_000_000,
    repeats: int = 3,
    ten_type_exhaustive: bool = True,
    budgets_usd_per_hr: tuple[float, ...] = (50.0, 100.0),
    models: tuple[str, ...] = tuple(QOS_MS),
) -> dict[str, Any]:
    """The figures (see the module docstring): the bound alone on ``vectors`` random count
    vectors, the exhaustive rankings (the 10-type one when ``ten_type_exhaustive``), and the exact
    top 10 of the 10-type catalog at each budget for each of ``models``; best of ``repeats``.

    Needs the shared data (:data:`PROFILES`).
    """
    measured = load_profiles(PROFILES)
    ten = ten_type_profiles(measured)
    ten_types = (*MEASURED, *SYNTHETIC)
    results: dict[str, Any] = {}

    q4 = quantities(measured, "rm2", MEASURED)
    counts = np.random.default_rng(0).integers(0, 40, size=(vectors, len(MEASURED)))
    seconds = best_of(repeats, lambda: upper_bounds(q4, counts))
    results["upper_bounds_per_s"] = counts.shape[0] / seconds

    exhaustive = [("4 types uncapped at $30/hr", q4, 30.0)]
    if ten_type_exhaustive:
        exhaustive.append(("10 types at $7/hr", quantities(ten, "rm2", ten_types), 7.0))
    for label, q, budget in exhaustive:
        ranking = rank_configurations(q, budget, top=10, method="exhaustive")
        seconds = best_of(
            repeats, partial(rank_configurations, q, budget, top=10, method="exhaustive")
        )
        results[f"exhaustive, {label}"] = {
            "configurations": ranking.enumerated,
            "seconds": seconds,
            "configurations_per_s": ranking.enumerated / seconds,
        }

    for budget in budgets_usd_per_hr:
        for model in models:
            q = quantities(ten, model, ten_types)
            ranking = rank_configurations(q, budget, top=10)
            seconds = best_of(repeats, partial(rank_configurations, q, budget, top=10))
            results[f"10 types at ${budget:g}/hr, {model}"] = {
                "seconds": seconds,
                "base_type": q.base_type,
                "top": ranking.fleet(0),
                "upper_bound_qps": float(ranking.upper_bound_qps[0]),
                "enumerated": ranking.enumerated,
                "note": ranking.note,
            }
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_quick(parser)
    args = parser.parse_args()
    sizes = chosen(args)
    if not PROFILES.exists():
        print(f"needs the shared data at {PROFILES} (set HETEROPLANE_SHARED)", file=sys.stderr)
        return 2
    results = measure(
        vectors=sizes.bound_vectors,
        repeats=sizes.bounds_repeats,
        ten_type_exhaustive=sizes.ten_type_exhaustive,
        budgets_usd_per_hr=sizes.bounds_budgets_usd_per_hr,
        models=sizes.bounds_models,
    )

    if args.json:
        print(json.dumps(results))
        return 0
    print(f"upper_bounds alone: {results['upper_bounds_per_s'] / 1e6:.1f} million configurations/s")
    for key, value in results.items():
        if not isinstance(value, dict):
            continue
        if "configurations_per_s" in value:
            print(
                f"{key}: {value['configurations']:,} configurations ranked in"
                f" {value['seconds']:.2f} s = {value['configurations_per_s'] / 1e6:.1f} million/s"
            )
        else:
            top = ",".join(f"{name}={n}" for name, n in value["top"].items() if n)
            print(
                f"{key}: {value['seconds']:.2f} s (base {value['base_type']}; top {top},"
                f" {value['upper_bound_qps']:.1f} qps; {value['enumerated']:,} bounded)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
