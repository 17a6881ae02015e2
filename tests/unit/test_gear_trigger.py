"""CascadeServe's batch trigger: SP4's minimum queue length per gear, its guard, the plan
document that carries them, and the simulator that runs them (the rule the dispatcher serves)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import pytest

from controlplane.policies.gears import (
    GUARD_SLO_SHARE,
    CascadePlacement,
    Gear,
    GearPlan,
    _batch_caps,
    _stage_capacity_qps,
    choose_min_queue,
    plan_gears,
)
from estimator.cascades import Cascade
from estimator.errors import CascadeError, SimulationError
from estimator.simulator import InstanceSpec, Routing, Stage, simulate
from estimator.traces import Trace
from tests.unit import cascade_support as family
from tests.unit.test_gears import PLACEMENT, SLO_MS, one_model, one_type

# A model whose batches are cheap to grow: 1 query in 10 ms, 16 in 18 ms.
GROWING_MS = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 18.0}


def capacity(latency_ms: Mapping[int, float], m: int) -> float:
    """One instance's queries per second at batches of m, from the profile as the plan reads it."""
    placement, profiles = one_model(latency_ms)
    return _stage_capacity_qps(placement.fleets["m"], profiles["m"], m, 1)


# --- SP4: the minimum queue length -----------------------------------------------------------


def test_the_minimum_queue_length_rises_by_one_until_the_throughput_meets_the_range() -> None:
    placement, profiles = one_model(GROWING_MS)
    cascade = Cascade(("m",))
    caps, _ = _batch_caps(cascade, (1.0,), placement, profiles, 1000.0, batch_size=1)
    assert caps == (16,)
    chosen = []
    for high_qps in (50.0, 150.0, 300.0, 600.0):
        (m,), wait_ms = choose_min_queue(
            cascade, (1.0,), caps, placement, profiles, slo_ms=1000.0, high_qps=high_qps
        )
        # the first m (from 1, by 1) at which batches of m serve the range's top
        assert capacity(GROWING_MS, m) >= high_qps
        assert m == 1 or capacity(GROWING_MS, m - 1) < high_qps
        # the guard: twice the fill time at the top of the range, 0 for a trigger of 1
        assert wait_ms == pytest.approx(0.0 if m == 1 else 2000.0 * (m - 1) / high_qps)
        chosen.append(m)
    assert chosen[0] == 1 and chosen == sorted(chosen) and chosen[-1] > chosen[1] > 1


def test_no_minimum_queue_length_meets_a_range_past_the_largest_batch() -> None:
    placement, profiles = one_model(GROWING_MS)
    cascade = Cascade(("m",))
    top = capacity(GROWING_MS, 16)
    with pytest.raises(CascadeError, match=r"the largest batch of 'm'; bottleneck 'm'"):
        choose_min_queue(
            cascade, (1.0,), (16,), placement, profiles, slo_ms=1000.0, high_qps=1.5 * top
        )


def test_no_minimum_queue_length_meets_a_range_within_the_slo() -> None:
    # Batches of 4 would serve 300 q/s, but from 3 on the guard and the batches pass 30 ms.
    placement, profiles = one_model(GROWING_MS)
    with pytest.raises(CascadeError, match=r"minimum queue length 3 .* past the SLO of 30 ms"):
        choose_min_queue(
            Cascade(("m",)), (1.0,), (16,), placement, profiles, slo_ms=30.0, high_qps=300.0
        )


def test_later_stages_keep_a_trigger_of_one_and_count_at_their_caps() -> None:
    latency = {"a": GROWING_MS, "b": {1: 10.0, 2: 12.0, 4: 14.0}}
    placement, profiles = one_type(latency)
    cascade, reach = Cascade(("a", "b"), (0.5,)), (1.0, 0.5)
    b_at_cap = _stage_capacity_qps(placement.fleets["b"], profiles["b"], 4, 1) / 0.5
    min_queue, _ = choose_min_queue(
        cascade, reach, (16, 4), placement, profiles, slo_ms=1000.0, high_qps=300.0
    )
    assert min_queue == (4, 1)
    # b at its cap is the bottleneck past b_at_cap: no trigger of a's serves it
    assert b_at_cap < capacity(GROWING_MS, 16)
    with pytest.raises(CascadeError, match="bottleneck 'b'"):
        choose_min_queue(
            cascade, reach, (16, 4), placement, profiles, slo_ms=1000.0, high_qps=1.1 * b_at_cap
        )


@pytest.fixture(scope="module")
def plan() -> GearPlan:
    return plan_gears(
        family.records(),
        CascadePlacement.parse(PLACEMENT),
        family.profiles(),
        family.PRICES,
        slo_ms=SLO_MS,
        grid=(0.3, 0.6, 0.9),
        n_ranges=6,
        seed=1,
    )


def test_the_plan_raises_the_first_models_trigger_with_the_load(plan: GearPlan) -> None:
    firsts = []
    for k, gear in enumerate(plan.gears):
        option = plan.option_of(k)
        min_queue = plan.min_queue_of(k)
        assert len(min_queue) == len(option.cascade.models)
        assert all(m == 1 for m in min_queue[1:])
        assert 1 <= min_queue[0] <= option.max_batch_queries[0]
        if min_queue[0] == 1:
            assert gear.max_wait_ms == 0.0
        else:
            assert 0 < gear.max_wait_ms <= GUARD_SLO_SHARE * SLO_MS
            assert gear.meets_slo
        firsts.append(min_queue[0])
    # Low ranges dispatch at once; the top ranges wait for larger batches.
    assert firsts[0] == 1 and firsts[-1] > 1 and firsts == sorted(firsts)


# --- the plan document -----------------------------------------------------------------------


def test_the_trigger_survives_the_document_and_old_documents_read_as_dispatch_at_once(
    plan: GearPlan,
) -> None:
    document = json.loads(json.dumps(plan.to_document()))
    again = GearPlan.from_document(document)
    assert again.gears == plan.gears
    assert again.to_document() == plan.to_document()
    for gear in document["gears"]:  # as a plan made before SP4 chose triggers wrote it
        del gear["min_queue"], gear["max_wait_ms"]
    old = GearPlan.from_document(document)
    for k, gear in enumerate(old.gears):
        assert old.min_queue_of(k) == (1,) * len(old.option_of(k).cascade.models)
        assert gear.max_wait_ms == 0.0
    broken = json.loads(json.dumps(plan.to_document()))
    broken["gears"][0]["min_queue"] = [0] * len(broken["gears"][0]["min_queue"])
    with pytest.raises(CascadeError, match="min_queue needs"):
        GearPlan.from_document(broken)


def test_a_gear_without_a_trigger_is_dispatch_at_once() -> None:
    gear = Gear(0.0, 10.0, 0, True)
    assert gear.min_queue == () and gear.max_wait_ms == 0.0


# --- the simulator -----------------------------------------------------------------------------


def stage(min_queue: int, max_wait_s: float, cap: int = 16) -> Stage:
    _, profiles = one_model(GROWING_MS)
    return Stage(
        "m",
        (InstanceSpec(family.TYPE),),
        profiles["m"],
        max_batch_queries=cap,
        min_queue=min_queue,
        max_wait_s=max_wait_s,
    )


def run(arrival_s: list[float], min_queue: int, max_wait_s: float) -> np.ndarray:
    trace = Trace(np.array(arrival_s), np.ones(len(arrival_s), dtype=np.int64))
    result = simulate(
        trace,
        [stage(min_queue, max_wait_s)],
        np.random.default_rng(0),
        prices_usd_per_hr=family.PRICES,
        service="mean",
    )
    start: np.ndarray = result.start_s
    return start


def test_a_batch_waits_for_its_minimum_queue_length() -> None:
    start = run([0.0, 0.001, 0.002, 0.003], min_queue=3, max_wait_s=1.0)
    # the first three start together once the third arrives; the fourth waits for the guard
    # (the instance is free again long before it)
    assert list(start[:3]) == [0.002, 0.002, 0.002]
    assert start[3] == pytest.approx(1.003)


def test_the_guard_releases_a_lone_query() -> None:
    start = run([0.0, 5.0], min_queue=4, max_wait_s=0.05)
    assert list(start) == pytest.approx([0.05, 5.05])


def test_a_trigger_of_one_dispatches_at_once_as_before() -> None:
    arrivals = [0.0, 0.001, 0.5]
    assert list(run(arrivals, min_queue=1, max_wait_s=math.inf)) == [0.0, 0.01, 0.5]


def test_a_trigger_above_one_needs_a_guard() -> None:
    with pytest.raises(SimulationError, match="needs a finite max_wait_s"):
        stage(2, math.inf)
    with pytest.raises(SimulationError, match="min_queue must be >= 1"):
        stage(0, 1.0)
    entry, nxt, caps = np.zeros((1, 2)), np.full((1, 1, 2), -1), np.ones((1, 1))
    with pytest.raises(SimulationError, match="needs a finite max_wait_s"):
        Routing(entry, nxt, caps, np.full((1, 1), 3), np.full((1, 1), math.inf))
    assert Routing(entry, nxt, caps).min_queue.tolist() == [[1]]  # type: ignore[union-attr]
