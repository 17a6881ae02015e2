"""The INFaaS results experiment's pure parts (benchmarks/results/infaas.py): the variants'
sizing, what ``choose`` is offered, the autoscaler's schedule, and the cost of a schedule."""

from __future__ import annotations

import doctest
import itertools
import math

import numpy as np
import pytest

from benchmarks.results import infaas
from benchmarks.results.infaas import (
    LOAD_WEIGHT,
    TICK_S,
    UTILISATION,
    Variant,
    autoscale,
    cost_series,
    offers,
    saturation,
    simulate_schedule,
)
from controlplane.policies.variants import Requirements, choose
from estimator.profiles import LatencyProfile
from estimator.traces import Trace


def _variant(
    model: str, itype: str, accuracy: float, price: float, q: float, boot_s: float = 30.0
) -> Variant:
    probes = ((0.1 * q, 5.0), (q, 50.0), (1.1 * q, 500.0))
    return Variant(model, itype, accuracy, price, boot_s, 4, q, probes)


def test_doctests() -> None:
    result = doctest.testmod(infaas)
    assert result.attempted > 0 and result.failed == 0


def test_instances_cover_the_load_at_the_utilisation_threshold() -> None:
    v = _variant("m", "t", 0.9, 0.1, 50.0)
    assert v.instances_for(0.0) == 1
    assert v.instances_for(UTILISATION * 50.0) == 1
    assert v.instances_for(UTILISATION * 50.0 + 0.1) == 2
    assert v.instances_for(1000.0) == math.ceil(1000.0 / (UTILISATION * 50.0))


def test_tail_interpolates_the_probes_and_is_infinite_past_them() -> None:
    v = _variant("m", "t", 0.9, 0.1, 100.0)
    assert v.tail_ms_at(55.0) == pytest.approx(27.5)
    assert v.tail_ms_at(111.0) == math.inf


def test_offers_charge_new_instances_extra_and_choose_takes_the_cheapest_that_meets() -> None:
    cheap = _variant("small", "cpu", 0.95, 0.05, 100.0)
    accurate = _variant("large", "gpu", 0.99, 0.5, 400.0)
    options = offers([cheap, accurate], 200.0, [0, 1])
    n_cheap = cheap.instances_for(200.0)
    assert options[0].cost_usd_per_query == pytest.approx(
        0.05 / 3600 * (n_cheap + LOAD_WEIGHT * n_cheap) / 200.0
    )
    assert options[1].cost_usd_per_query == pytest.approx(0.5 / 3600 / 200.0)
    assert choose(Requirements("a", 100.0, 0.9), options).option.name == "small on cpu"
    assert choose(Requirements("a", 100.0, 0.98), options).option.name == "large on gpu"


def _steady(rate_qps: float, start_s: float, end_s: float) -> np.ndarray:
    return np.arange(start_s, end_s, 1.0 / rate_qps)


def test_autoscale_adds_instances_after_a_step_and_removes_them_only_after_the_hold() -> None:
    v = _variant("m", "t", 0.99, 0.1, 50.0, boot_s=30.0)
    arrival = np.concatenate([_steady(10.0, 0.0, 60.0), _steady(100.0, 60.0, 120.0)])
    arrival = np.concatenate([arrival, _steady(10.0, 120.0, 240.0)])
    schedule = autoscale([v], Requirements("a", 100.0, 0.9), arrival, 240.0, 10.0)
    assert schedule.epochs == [(0, 0.0)]
    first, *added = schedule.instances
    assert first.started_s == 0.0 and first.ready_s == 0.0
    assert len(added) == v.instances_for(100.0) - 1
    assert all(60.0 < i.started_s <= 62.0 + TICK_S for i in added)
    assert all(i.ready_s == pytest.approx(i.started_s + 30.0) for i in added)
    # Down only once the load has been low for the whole hold (the boot time).
    assert all(i.stop_s >= 120.0 + 30.0 for i in added)
    assert all(math.isfinite(i.stop_s) for i in added)
    assert math.isinf(first.stop_s)


def test_autoscale_upgrades_at_once_and_keeps_serving_until_the_new_variant_is_ready() -> None:
    cpu = _variant("m", "cpu", 0.99, 0.1, 10.0, boot_s=30.0)
    gpu = _variant("m", "gpu", 0.99, 0.5, 200.0, boot_s=60.0)
    arrival = np.concatenate([_steady(5.0, 0.0, 50.0), _steady(150.0, 50.0, 200.0)])
    schedule = autoscale([cpu, gpu], Requirements("a", 100.0, 0.9), arrival, 200.0, 5.0)
    assert schedule.epochs[0] == (0, 0.0)
    assert schedule.switches == 1
    variant, at_s = schedule.epochs[1]
    assert variant == 1
    started = [i for i in schedule.instances if i.variant == 1]
    assert len(started) == gpu.instances_for(150.0)
    assert at_s == pytest.approx(started[0].started_s + 60.0)
    assert all(i.epoch == 1 for i in started)
    old = [i for i in schedule.instances if i.variant == 0]
    assert all(i.retired_s == pytest.approx(at_s) for i in old)


def test_autoscale_downgrades_only_after_the_choice_held_for_the_boot_time() -> None:
    cpu = _variant("m", "cpu", 0.99, 0.1, 10.0, boot_s=30.0)
    gpu = _variant("m", "gpu", 0.99, 0.5, 200.0, boot_s=60.0)
    arrival = np.concatenate([_steady(150.0, 0.0, 100.0), _steady(2.0, 100.0, 400.0)])
    schedule = autoscale([cpu, gpu], Requirements("a", 100.0, 0.9), arrival, 400.0, 150.0)
    assert schedule.epochs[0][0] == 1
    assert [v for v, _ in schedule.epochs] == [1, 0]
    decided = min(i.started_s for i in schedule.instances if i.variant == 0)
    assert decided >= 100.0 + 60.0  # the GPU's hold: its boot time
    assert schedule.epochs[1][1] == pytest.approx(decided + 30.0)


def test_cost_series_bills_each_span() -> None:
    total, series = cost_series([(0.0, 1800.0, 2.0), (900.0, 2700.0, 4.0)], 3600.0)
    assert total == pytest.approx(1.0 + 2.0)
    assert series[0] == 2.0 and series[1000] == 6.0 and series[2000] == 4.0 and series[3000] == 0


def _constant_profile(model: str, itype: str, ms: float) -> LatencyProfile:
    sizes = np.array([1, 2, 4])
    return LatencyProfile(model, itype, sizes, tuple(np.full(5, ms * b) for b in sizes))


def test_simulate_schedule_answers_everything_and_bills_retired_instances_until_drained() -> None:
    cpu = _variant("m", "cpu", 0.99, 0.36, 10.0, boot_s=30.0)
    gpu = _variant("m", "gpu", 0.99, 3.6, 200.0, boot_s=60.0)
    profiles = {
        "m": {"cpu": _constant_profile("m", "cpu", 20.0), "gpu": _constant_profile("m", "gpu", 2.0)}
    }
    arrival = np.concatenate([_steady(5.0, 0.0, 50.0), _steady(150.0, 50.0, 200.0)])
    schedule = autoscale([cpu, gpu], Requirements("a", 100.0, 0.9), arrival, 200.0, 5.0)
    trace = Trace(arrival, np.ones(arrival.size, dtype=np.int64))
    outcome = simulate_schedule("x", [cpu, gpu], profiles, schedule, trace, 200.0, 100.0)
    assert outcome.queries == arrival.size
    switch_s = schedule.epochs[1][1]
    share_gpu = np.count_nonzero(arrival >= switch_s) / arrival.size
    assert outcome.variants["m on gpu"] == pytest.approx(share_gpu)
    # Every instance bills at least from its start to its stop or retirement.
    floor = sum(
        (cpu if i.variant == 0 else gpu).price_usd_per_hr
        * (min(i.stop_s, i.retired_s, 200.0) - i.started_s)
        / 3600.0
        for i in schedule.instances
    )
    assert outcome.cost_usd >= floor - 1e-12
    assert outcome.cost_usd <= floor + 2 * 3.6 * 10.0 / 3600.0


def test_saturation_finds_a_rate_within_the_slo_below_the_bound() -> None:
    profile = _constant_profile("m", "cpu", 10.0)
    q, probes = saturation(profile, 1, 50.0, 0.1)
    assert 0 < q <= 0.9 * 100.0
    assert all(r1 <= r2 for (r1, _), (r2, _) in itertools.pairwise(probes))
    feasible = [r for r, tail in probes if tail <= 50.0]
    assert q == pytest.approx(max(feasible))
    # A batch that alone takes longer than the SLO is never feasible.
    assert saturation(_constant_profile("m", "cpu", 80.0), 1, 50.0, 0.1)[0] == 0.0
