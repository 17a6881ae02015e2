"""Compile the compiled kernels into numba's on-disk cache once, ahead of their first use.

    python -m estimator.warm

Every kernel of the estimator and of the matching library is ``numba.njit(cache=True)``: the
first call in a fresh checkout compiles it (LLVM: about 20 s of a core for all of them) and
writes the machine code beside the source (``__pycache__``, or ``NUMBA_CACHE_DIR``); later
processes load it in milliseconds. The Makefile's test install runs this, so that a fresh
checkout's first ``make test`` does not spend that time in its tests (docs/status.md, "The test
suite"); run once after an install, it also spares a new service's first Kairos round the
compilation.

Each kernel is reached the way the code calls it (a small simulation with FCFS and with Kairos'
dispatcher, which learns from what it served, and the tuner's arrival envelopes), so the cache
holds the signatures the code asks for: a kernel compiled for other argument types would be
compiled again at its first real call.
"""

from __future__ import annotations

import time

import numpy as np

from estimator.envelope import arrival_envelope, recurring_envelope
from estimator.policies import policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching.fcfs import FcfsPolicy
from matching.kairos import FLOW_FROM_INSTANCES

__all__ = ["warm"]


def _profile(instance_type: str, per_item_ms: float) -> LatencyProfile:
    sizes = np.array([1, 8, 32])
    cells = tuple(per_item_ms * b * np.array([0.95, 1.0, 1.1]) for b in sizes)
    return LatencyProfile("m", instance_type, sizes, cells)


def warm() -> None:
    """Call every cached kernel once (see the module docstring)."""
    profiles = {"gpu": _profile("gpu", 1.0), "cpu": _profile("cpu", 4.0)}
    prices = {"gpu": 1.0, "cpu": 0.2}
    rng = np.random.default_rng(0)
    n = 300
    trace = Trace(np.cumsum(rng.exponential(0.01, size=n)), rng.integers(1, 33, size=n))
    fcfs = Stage("m", (InstanceSpec("cpu"), InstanceSpec("cpu")), profiles, FcfsPolicy())
    simulate(trace, [fcfs], rng, prices_usd_per_hr=prices, qos_ms=200.0)  # the FCFS kernel
    fleet = (InstanceSpec("gpu"), InstanceSpec("cpu"), InstanceSpec("cpu", ready_s=0.5))
    kairos = policy_factory("kairos", profiles, ["gpu"])()
    stage = Stage("m", fleet, profiles, kairos, max_batch_queries=2)
    simulate(trace, [stage], rng, prices_usd_per_hr=prices, qos_ms=200.0, engine="events")
    kairos.observe("gpu", 4, 5.0)  # what the live dispatcher does with each answer
    # A round of FLOW_FROM_INSTANCES instances or more is solved as a chain flow.
    wide = (InstanceSpec("gpu"),) * 4 + (InstanceSpec("cpu"),) * (FLOW_FROM_INSTANCES - 4)
    busy = Trace(np.sort(rng.uniform(0.0, 0.5, size=n)), trace.batch_size)
    stage = Stage("m", wide, profiles, policy_factory("kairos", profiles, ["gpu"])())
    simulate(busy, [stage], rng, prices_usd_per_hr=prices, qos_ms=200.0, engine="events")
    # A trace's arrays are read-only, which makes them another type to numba than an array
    # the caller may write to: both are asked for.
    for arrivals in (trace.arrival_s, trace.arrival_s.copy()):
        arrival_envelope(arrivals, [0.1, 1.0])
        recurring_envelope(arrivals, [0.1, 1.0], 0.5)


def main() -> int:
    started = time.perf_counter()
    warm()
    print(f"compiled kernels cached ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
