"""Baseline dispatchers (Ribbon FCFS base-first, DRS, Clockwork), the oracle, capacity search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator.capacity import Workload, allowable_throughput, search_allowable_rate, tune_threshold
from estimator.oracle import oracle_throughput_qps
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching.clockwork import ClockworkPolicy
from matching.drs import DrsPolicy


def linear_profile(instance_type: str, per_item_ms: float, sizes=(1, 100)) -> LatencyProfile:
    sizes_array = np.array(sizes)
    cells = tuple(np.array([per_item_ms * b]) for b in sizes_array)
    return LatencyProfile("m", instance_type, sizes_array, cells)


GPU = linear_profile("gpu.x", 1.0)  # 1 ms per item
CPU = linear_profile("cpu.x", 4.0)  # 4 ms per item
PROFILES = {"gpu.x": GPU, "cpu.x": CPU}
PRICES = {"gpu.x": 1.0, "cpu.x": 0.2}


def run(policy, trace: Trace, instances, qos_ms: float = 100.0):
    stage = Stage("m", tuple(InstanceSpec(t) for t in instances), PROFILES, policy)
    return simulate(
        trace, [stage], np.random.default_rng(0), prices_usd_per_hr=PRICES, qos_ms=qos_ms
    )


def test_drs_sends_large_queries_to_base_and_small_to_auxiliary() -> None:
    trace = Trace(np.arange(6) * 1.0, np.array([5, 50, 10, 80, 20, 30]))
    result = run(DrsPolicy(25, ["gpu.x"]), trace, ["gpu.x", "cpu.x"])
    served_by_cpu = result.instance == 1
    assert served_by_cpu.tolist() == [True, False, True, False, True, False]


def test_drs_without_auxiliaries_uses_the_base_for_everything() -> None:
    trace = Trace(np.arange(3) * 1.0, np.array([5, 50, 10]))
    result = run(DrsPolicy(25, ["gpu.x"]), trace, ["gpu.x"])
    assert np.all(result.instance == 0)


def test_clockwork_commits_each_query_to_the_earliest_finish_within_qos() -> None:
    tables = {t: p.mean_by_batch_ms() for t, p in PROFILES.items()}
    # Three queries of 40 items at once, QoS 100 ms. On the GPU they would finish at 40, 80 and
    # 120 ms, on the idle CPU at 160 ms. The first two fit QoS on the GPU. The third fits
    # nowhere, so it takes the earliest finish: the GPU again, at 120 ms.
    trace = Trace(np.zeros(3), np.array([40, 40, 40]))
    result = run(ClockworkPolicy(tables), trace, ["gpu.x", "cpu.x"])
    assert result.instance.tolist() == [0, 0, 0]
    assert result.finish_s.tolist() == pytest.approx([0.04, 0.08, 0.12])
    # Four queries of 10 items: the GPU finishes them at 10, 20, 30, 40 ms; the fourth would
    # also finish at 40 ms on the CPU, and the tie goes to the lower index (the GPU).
    small = Trace(np.zeros(4), np.array([10, 10, 10, 10]))
    result = run(ClockworkPolicy(tables), small, ["gpu.x", "cpu.x"])
    assert result.instance.tolist() == [0, 0, 0, 0]


def test_clockwork_spreads_when_the_base_would_miss_qos() -> None:
    tables = {t: p.mean_by_batch_ms() for t, p in PROFILES.items()}
    trace = Trace(np.zeros(3), np.array([20, 20, 20]))
    result = run(ClockworkPolicy(tables), trace, ["gpu.x", "cpu.x"], qos_ms=50.0)
    # GPU: 20, 40 ms; the third would finish at 60 ms on the GPU (> 50) and 80 on the CPU
    # (> 50): neither meets QoS, so the earliest finish (GPU) takes it.
    assert result.instance.tolist() == [0, 0, 0]
    trace = Trace(np.zeros(3), np.array([20, 20, 10]))
    result = run(ClockworkPolicy(tables), trace, ["gpu.x", "cpu.x"], qos_ms=50.0)
    # The third (10 items): GPU would finish at 50 ms (= QoS, within), CPU at 40: CPU is earlier.
    assert result.instance.tolist() == [0, 0, 1]


def test_oracle_hand_computed() -> None:
    tables = {t: p.mean_by_batch_ms() for t, p in PROFILES.items()}
    # One GPU (1 ms/item) and one CPU (4 ms/item), queries of 10, 20, 30 and 90, QoS 100 ms.
    # t=0: the GPU takes the largest (90, until 90 ms), the CPU the smallest (10, until 40 ms).
    # t=40: the CPU takes 20 (80 ms, within QoS) until 120 ms. t=90: the GPU takes 30 until
    # 120 ms. Four queries in 120 ms.
    sizes = np.array([10, 20, 30, 90])
    qps = oracle_throughput_qps(sizes, ["gpu.x", "cpu.x"], tables, 100.0, ["gpu.x"])
    assert qps == pytest.approx(4 / 0.120)


def test_capacity_search_finds_a_step() -> None:
    result = search_allowable_rate(lambda rate: 1.0 if rate <= 37.3 else 0.5, guess_qps=5.0)
    assert 37.3 * 0.99 <= result.allowable_qps <= 37.3
    assert result.evaluations == len(result.probes)


def test_allowable_throughput_of_mm1_matches_the_closed_form() -> None:
    """M/M/1 response time is exponential with rate mu - lambda, so 99% finish within QoS when
    lambda = mu - ln(100) / QoS."""
    rng = np.random.default_rng(5)
    profile = LatencyProfile("m", "x", np.array([1]), (rng.exponential(10.0, size=200_000),))
    workload = Workload.poisson(np.ones(200_000, dtype=np.int64), rng)
    qos_ms = 100.0
    result = allowable_throughput(
        lambda: Stage("m", (InstanceSpec("x"),), {"x": profile}),
        workload,
        {"x": 1.0},
        qos_ms,
        guess_qps=10.0,
        rel_tol=0.005,
    )
    theory = 100.0 - math.log(100) / (qos_ms / 1000.0)
    assert result.allowable_qps == pytest.approx(theory, rel=0.03)


def test_threshold_hill_climbing_reaches_the_peak() -> None:
    tuning = tune_threshold(lambda t: -((t - 230) ** 2), start=100, step=10, low=10, high=1000)
    assert tuning.threshold == 230
    assert tuning.evaluations < 30


def test_threshold_hill_climbing_crosses_a_plateau() -> None:
    """Flat from 10 to 500, then a peak at 700: a 10-step climb from 180 would stop at once."""

    def capacity(t: int) -> float:
        return 1.0 if t <= 500 else 2.0 - abs(t - 700) / 1000

    tuning = tune_threshold(capacity, start=180, step=10, low=10, high=1000)
    assert tuning.threshold == 700
