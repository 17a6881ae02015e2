"""How fast the command line gets its inputs: the shared profile CSV, and a million arrivals.

    .venv/bin/python benchmarks/profile_load.py [--json] [--repeats 5]

- ``load_profiles`` on the shared Kairos samples (../shared/data/kairos_latency_samples.csv.gz,
  200,000 rows: five models on four EC2 types, 100 batch sizes, 100 samples each): read, gunzip,
  parse, group into the 20 profiles.
- ``poisson_arrivals`` at 1000 qps for 1000 s (1,000,000 arrivals expected), and
  ``gamma_arrivals`` with CV^2 = 4 at the same rate and length, each from a fresh seeded generator.

Each figure is the median of ``--repeats`` runs (5 by default) after a warm-up run, with the
fastest and slowest run as its spread. Goals (issue "a fast command line"): the profile CSV in
< 0.5 s; generating a million arrivals cheaper than simulating them (benchmarks/estimator_speed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from estimator.profiles import load_profiles
from estimator.traces import gamma_arrivals, poisson_arrivals

try:  # imported as benchmarks.profile_load
    from benchmarks.paths import kairos_samples, shared_dir
except ModuleNotFoundError:  # run as a script: the sibling module
    from paths import kairos_samples, shared_dir

SHARED = shared_dir()
PROFILES = kairos_samples()
RATE_QPS = 1000.0
DURATION_S = 1000.0


def median_of(repeats: int, run: Callable[[], object]) -> tuple[float, float, float]:
    """(median, min, max) wall time in seconds of ``repeats`` runs after one warm-up run."""
    run()  # warm-up: imports, the page cache, numpy's first-call costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def measure(repeats: int = 5) -> dict[str, object]:
    """The figures (see the module docstring); needs the shared data (:data:`PROFILES`)."""
    figures: dict[str, object] = {}

    def timed(name: str, run: Callable[[], object]) -> None:
        median_s, min_s, max_s = median_of(repeats, run)
        figures[name] = median_s
        figures[f"{name}_spread"] = [min_s, max_s]

    timed("profile_load_s", lambda: load_profiles(PROFILES))
    timed("poisson_1m_s", lambda: poisson_arrivals(RATE_QPS, DURATION_S, np.random.default_rng(0)))
    timed(
        "gamma_cv2_4_1m_s",
        lambda: gamma_arrivals(RATE_QPS, 4.0, DURATION_S, np.random.default_rng(0)),
    )
    profiles = load_profiles(PROFILES)
    figures["profiles"] = len(profiles)
    figures["profile_samples"] = sum(
        sum(cell.size for cell in profile.samples_ms) for profile in profiles.values()
    )
    figures["poisson_arrivals"] = int(
        poisson_arrivals(RATE_QPS, DURATION_S, np.random.default_rng(0)).size
    )
    figures["repeats"] = repeats
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not PROFILES.exists():
        print(f"needs the shared data at {PROFILES} (set HETEROPLANE_SHARED)", file=sys.stderr)
        return 2
    figures = measure(args.repeats)
    if args.json:
        print(json.dumps(figures))
        return 0

    def line(label: str, name: str) -> str:
        low, high = figures[f"{name}_spread"]  # type: ignore[misc]
        return f"  {label}: {figures[name]:.3f} s (runs {low:.3f} to {high:.3f} s)"

    print(f"inputs of the command line on {os.cpu_count()} cores, median of {args.repeats} runs")
    print(
        line(
            f"load {PROFILES.name} ({figures['profile_samples']:,} samples kept,"
            f" {figures['profiles']} profiles)",
            "profile_load_s",
        )
    )
    print(line(f"{figures['poisson_arrivals']:,} Poisson arrivals", "poisson_1m_s"))
    print(line("1M-expected gamma arrivals, CV^2 = 4", "gamma_cv2_4_1m_s"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
