"""Compile the numerical kernels once, ahead of their first use.

The simulator's FCFS kernel, the arrival envelopes and Kairos' dispatcher rounds (its latency
model, cost matrix and assignment) are compiled by numba on first call and cached beside their
modules (``cache=True``): a process that finds the cache loads them in milliseconds, one that
does not compiles them itself, about 20 s of a core for all of them. Several processes that
start together on a fresh checkout (the test suite's four, the services and command-line runs
they start) would each compile them; ``make test``'s install runs this first, so they all find
the cache (docs/status.md, "The test suite").

Run it as ``python -m estimator.warmup``; it runs the kernels on a tiny synthetic fleet and
trace, through the same public calls the planner, the replay and the tuner make, so that each
kernel compiles for the argument types those calls give it.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from estimator.envelope import arrival_envelope, recurring_envelope, tuner_windows_s
from estimator.policies import policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching.kairos import FLOW_FROM_INSTANCES

# A fast type and one four times slower, as a GPU and a CPU instance are to each other.
_SPEEDS = {"fast.x": 1.0, "slow.x": 4.0}
_PRICES = {"fast.x": 1.0, "slow.x": 0.2}


def _profiles() -> dict[str, LatencyProfile]:
    sizes = np.arange(1, 9)
    shape = np.array([0.98, 1.0, 1.02])
    return {
        name: LatencyProfile("warm", name, sizes, tuple(speed * b * shape for b in sizes))
        for name, speed in _SPEEDS.items()
    }


def warm() -> None:
    """Run every cached kernel once on tiny inputs (each compiles, or loads from its cache)."""
    rng = np.random.default_rng(0)
    profiles = _profiles()
    n = 200
    trace = Trace(np.arange(n, dtype=np.float64) * 0.01, rng.integers(1, 9, size=n))
    fleet = tuple(InstanceSpec(name) for name in ("slow.x", "slow.x", "fast.x"))
    # The compiled FCFS kernel (one stage, a static fleet, FCFS: the planner's estimator).
    simulate(trace, [Stage("warm", fleet, profiles)], rng, prices_usd_per_hr=_PRICES)
    # Kairos' rounds through the event engine (its latency model and costs), on a small fleet
    # (SciPy solves its rounds) and on one wide enough for the chain flow's kernel.
    wide = fleet + tuple(InstanceSpec("slow.x") for _ in range(FLOW_FROM_INSTANCES))
    crowded = Trace(np.arange(n, dtype=np.float64) * 0.0005, trace.batch_size)
    for instances, arrivals in ((fleet, trace), (wide, crowded)):
        kairos = policy_factory("kairos", profiles, ["fast.x"])()
        stage = Stage("warm", instances, profiles, kairos)
        simulate(arrivals, [stage], rng, prices_usd_per_hr=_PRICES, qos_ms=50.0)
    # The tuner's envelopes, on a trace's read-only arrivals and on a plain array.
    windows = tuner_windows_s(0.05)
    for arrival_s in (trace.arrival_s, np.array(trace.arrival_s)):
        arrival_envelope(arrival_s, windows)
        recurring_envelope(arrival_s, windows)


def main() -> int:
    started = time.perf_counter()
    warm()
    print(f"compiled the numerical kernels ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
