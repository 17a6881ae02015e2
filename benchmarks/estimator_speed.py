"""How fast the estimator is: simulated queries per second, and the envelope of a long trace.

    .venv/bin/python benchmarks/estimator_speed.py [--quick] [--json] [--queries N]

- FCFS simulator, one stage, fleets of 1 and 64 instances, a 1,000,000-query Poisson trace at 70%
  of the fleet's capacity, batch sizes from the Kairos mix, service times drawn from the measured
  rm2 samples on g4dn.xlarge (../shared/data). Timed: the whole ``simulate`` call (service table,
  random draws, the compiled FCFS loop, cost and utilisation), best of 5 after a warm-up run.
- The same on 100,000 queries through the general event engine (the one any policy runs on).
- The envelope (max arrivals in any window) of 1,000,000 arrivals over the 9 tuner windows.

Goals: >= 20 million simulated queries/s; the envelope in < 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from estimator.batches import parse_batch_distribution
from estimator.envelope import arrival_envelope, tuner_windows_s
from estimator.profiles import load_profiles
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace, poisson_arrivals

try:  # imported as benchmarks.estimator_speed
    from benchmarks.paths import kairos_samples, shared_dir
    from benchmarks.sizes import add_quick, chosen
except ModuleNotFoundError:  # run as a script: the sibling modules
    from paths import kairos_samples, shared_dir
    from sizes import add_quick, chosen  # type: ignore[no-redef]

SHARED = shared_dir()
PROFILES = kairos_samples()
PRICES = {"g4dn.xlarge": 0.526}


def best_of(repeats: int, run: Callable[[], object]) -> float:
    run()  # warm-up: numba compiles (or loads its cache) on first use
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    queries: int = 1_000_000,
    *,
    repeats: int = 5,
    event_queries: int = 100_000,
    envelope_arrivals: int = 1_000_000,
) -> dict[str, float]:
    """The figures (see the module docstring), for ``queries`` Poisson queries through the compiled
    loop (best of ``repeats``), the first ``event_queries`` of them through the event engine (one
    timed run) and the envelope of ``envelope_arrivals`` arrivals (best of ``repeats``).

    Needs the shared data (:data:`PROFILES`). The key ``envelope_arrivals`` is the number of
    arrivals the envelope ran on.
    """
    profile = load_profiles(PROFILES).get_profile("rm2", "g4dn.xlarge")
    rng = np.random.default_rng(0)
    sizes = parse_batch_distribution("kairos").sample(queries, rng)
    # Capacity of one instance on this mix: 1 / E[L(b)].
    capacity_qps = profile.rate_qps(sizes[:20_000])
    figures: dict[str, float] = {}
    for instances in (1, 64):
        rate = 0.7 * capacity_qps * instances
        arrivals = poisson_arrivals(rate, queries / rate * 1.1, rng)[:queries]
        trace = Trace(arrivals, sizes[: arrivals.size])
        stage = Stage(
            "rm2",
            tuple(InstanceSpec("g4dn.xlarge") for _ in range(instances)),
            {"g4dn.xlarge": profile},
        )

        def run_kernel(trace: Trace = trace, stage: Stage = stage) -> object:
            return simulate(trace, [stage], np.random.default_rng(1), prices_usd_per_hr=PRICES)

        seconds = best_of(repeats, run_kernel)
        figures[f"fcfs_{instances}_instances_queries_per_s"] = len(trace) / seconds
        short = Trace(trace.arrival_s[:event_queries], trace.batch_size[:event_queries])

        def run_events(trace: Trace = short, stage: Stage = stage) -> object:
            return simulate(
                trace, [stage], np.random.default_rng(1), prices_usd_per_hr=PRICES, engine="events"
            )

        seconds = best_of(1, run_events)
        figures[f"event_engine_{instances}_instances_queries_per_s"] = len(short) / seconds

    rate = 1000.0
    arrivals = poisson_arrivals(rate, envelope_arrivals / rate * 1.01, np.random.default_rng(2))
    arrivals = arrivals[:envelope_arrivals]
    windows = tuner_windows_s(0.25)
    seconds = best_of(repeats, lambda: arrival_envelope(arrivals, windows))
    figures["envelope_1m_arrivals_9_windows_ms"] = seconds * 1000.0
    figures["envelope_windows"] = float(len(windows))
    figures["envelope_arrivals"] = float(len(arrivals))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--queries", type=int, default=None, help="default 1,000,000")
    add_quick(parser)
    args = parser.parse_args()
    sizes = chosen(args)
    if args.queries is None:
        args.queries = sizes.estimator_queries
    if not PROFILES.exists():
        print(f"needs the shared data at {PROFILES} (set HETEROPLANE_SHARED)", file=sys.stderr)
        return 2
    figures = measure(
        args.queries,
        repeats=sizes.estimator_repeats,
        event_queries=sizes.event_queries,
        envelope_arrivals=sizes.envelope_arrivals,
    )
    envelope_arrivals = int(figures.pop("envelope_arrivals"))
    windows = int(figures["envelope_windows"])

    if args.json:
        print(json.dumps(figures))
        return 0
    print(
        f"estimator speed on {os.cpu_count()} cores,"
        f" {args.queries:,} Poisson queries, Kairos batch mix"
    )
    for instances in (1, 64):
        kernel = figures[f"fcfs_{instances}_instances_queries_per_s"]
        events = figures[f"event_engine_{instances}_instances_queries_per_s"]
        print(
            f"  FCFS, {instances:>2} instance(s): {kernel / 1e6:6.1f} M queries/s compiled,"
            f" {events / 1e3:6.1f} k queries/s event engine"
        )
    print(
        f"  envelope of {envelope_arrivals:,} arrivals over {windows} windows:"
        f" {figures['envelope_1m_arrivals_9_windows_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
