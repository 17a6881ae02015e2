"""The simulator against queueing theory, in long seeded runs.

The compiled FCFS path runs the long runs (millions of queries); the event engine runs the same
workloads shorter, and test_simulator checks the two agree query by query.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace, poisson_arrivals

MEAN_SERVICE_MS = 10.0
MU = 1000.0 / MEAN_SERVICE_MS  # service rate of one instance, per second


def exponential_profile(rng: np.random.Generator, n_samples: int = 1_000_000) -> LatencyProfile:
    samples = rng.exponential(MEAN_SERVICE_MS, size=n_samples)
    return LatencyProfile("m", "x", np.array([1]), (samples,))


def deterministic_profile() -> LatencyProfile:
    return LatencyProfile("m", "x", np.array([1]), (np.array([MEAN_SERVICE_MS]),))


def poisson_trace(rate_qps: float, n_queries: int, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rate_qps, n_queries / rate_qps * 1.05, rng)[:n_queries]
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))


def mean_wait_s(trace: Trace, profile: LatencyProfile, servers: int, seed: int = 1) -> float:
    stage = Stage("m", tuple(InstanceSpec("x") for _ in range(servers)), {"x": profile})
    result = simulate(trace, [stage], np.random.default_rng(seed), prices_usd_per_hr={"x": 1.0})
    assert result.engine == "kernel"
    return float(result.wait_ms.mean()) / 1000.0


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c (offered load a = lambda / mu)."""
    top = offered**servers / math.factorial(servers) / (1 - offered / servers)
    bottom = sum(offered**k / math.factorial(k) for k in range(servers)) + top
    return top / bottom


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mm1_mean_wait_within_2_percent(rho: float) -> None:
    rate = rho * MU
    profile = exponential_profile(np.random.default_rng(7))
    simulated = mean_wait_s(poisson_trace(rate, 3_000_000, seed=11), profile, servers=1)
    theory = rho / (MU - rate)  # Wq = rho / (mu - lambda)
    assert simulated == pytest.approx(theory, rel=0.02)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait_within_2_percent(rho: float) -> None:
    rate = rho * MU
    simulated = mean_wait_s(poisson_trace(rate, 2_000_000, seed=12), deterministic_profile(), 1)
    theory = rho / (2 * MU * (1 - rho))  # Pollaczek-Khinchine with zero service variance
    assert simulated == pytest.approx(theory, rel=0.02)


@pytest.mark.parametrize(("servers", "rho"), [(4, 0.75), (16, 0.85)])
def test_mmc_mean_wait_matches_erlang_c_within_3_percent(servers: int, rho: float) -> None:
    rate = rho * servers * MU
    profile = exponential_profile(np.random.default_rng(8))
    simulated = mean_wait_s(poisson_trace(rate, 3_000_000, seed=13), profile, servers)
    theory = erlang_c(servers, rate / MU) / (servers * MU - rate)
    assert simulated == pytest.approx(theory, rel=0.03)


def test_event_engine_mm1_agrees_with_theory() -> None:
    rate = 0.6 * MU
    trace = poisson_trace(rate, 200_000, seed=14)
    stage = Stage("m", (InstanceSpec("x"),), {"x": exponential_profile(np.random.default_rng(9))})
    result = simulate(
        trace, [stage], np.random.default_rng(2), prices_usd_per_hr={"x": 1.0}, engine="events"
    )
    theory = 0.6 / (MU - rate)
    assert result.wait_ms.mean() / 1000.0 == pytest.approx(theory, rel=0.05)


def test_tandem_of_two_mm1_stages_matches_jackson_network() -> None:
    """Burke: the output of M/M/1 is Poisson, so two stages in series are two M/M/1 queues."""
    rate = 40.0
    rng = np.random.default_rng(10)
    fast = exponential_profile(rng, 200_000)
    slow = LatencyProfile("m2", "y", np.array([1]), (rng.exponential(15.0, size=200_000),))
    trace = poisson_trace(rate, 200_000, seed=15)
    stages = [
        Stage("m", (InstanceSpec("x"),), {"x": fast}, forward=np.ones(len(trace), dtype=bool)),
        Stage("m2", (InstanceSpec("y"),), {"y": slow}),
    ]
    result = simulate(trace, stages, np.random.default_rng(3), prices_usd_per_hr={"x": 1, "y": 2})
    theory_s = 1 / (MU - rate) + 1 / (1000 / 15.0 - rate)  # sum of two M/M/1 sojourn times
    assert result.response_ms.mean() / 1000.0 == pytest.approx(theory_s, rel=0.04)
    assert np.all(result.stages_visited == 2)
