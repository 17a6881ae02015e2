"""The simulator's mechanics: engines agree, batching, fleets that change, cost, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.serving.stages import LatencyTable, ServingStage, Slot
from controlplane.serving.workers import Worker, WorkerEndpoint
from estimator.errors import BatchSizeOutOfRangeError, SimulationError
from estimator.policies import policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import (
    InstanceSpec,
    ServiceTable,
    Stage,
    _capacity_sps,
    _StageState,
    simulate,
)
from estimator.traces import Trace
from matching.fcfs import FcfsPolicy


def profile(instance_type: str, base_ms: float, per_item_ms: float, rng: np.random.Generator):
    sizes = np.array([1, 2, 4, 8])
    cells = tuple(base_ms + per_item_ms * b + rng.exponential(1.0, size=5) for b in sizes)
    return LatencyProfile("m", instance_type, sizes, cells)


@st.composite
def scenarios(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_types = draw(st.integers(1, 3))
    names = [f"t{i}.large" for i in range(n_types)]
    profiles = {
        name: profile(name, draw(st.floats(0.5, 20)), draw(st.floats(0, 5)), rng) for name in names
    }
    counts = [draw(st.integers(0, 4)) for _ in names]
    if sum(counts) == 0:
        counts[0] = 1
    fleet = zip(names, counts, strict=True)
    instances = tuple(InstanceSpec(name) for name, count in fleet for _ in range(count))
    n = draw(st.integers(1, 300))
    # Integer-spaced arrivals make simultaneous events (ties) common.
    gaps = rng.integers(0, 3, size=n) * draw(st.sampled_from([0.001, 0.004, 0.01]))
    arrivals = np.cumsum(gaps)
    sizes = rng.integers(1, 9, size=n)
    max_batch = draw(st.integers(1, 4))
    return Trace(arrivals, sizes), instances, profiles, max_batch, seed


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_fcfs_kernel_and_event_engine_agree_query_by_query(scenario) -> None:
    trace, instances, profiles, max_batch, seed = scenario
    stage = Stage("m", instances, profiles, FcfsPolicy(), max_batch_queries=max_batch)
    prices = dict.fromkeys(profiles, 1.0)
    results = [
        simulate(trace, [stage], np.random.default_rng(seed), prices_usd_per_hr=prices, engine=e)
        for e in ("kernel", "events")
    ]
    kernel, events = results
    assert (kernel.engine, events.engine) == ("kernel", "events")
    np.testing.assert_array_equal(kernel.start_s, events.start_s)
    np.testing.assert_array_equal(kernel.finish_s, events.finish_s)
    np.testing.assert_array_equal(kernel.instance, events.instance)
    np.testing.assert_allclose(kernel.utilisation[0], events.utilisation[0])


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_every_query_served_once_after_it_arrives(scenario) -> None:
    trace, instances, profiles, max_batch, seed = scenario
    stage = Stage("m", instances, profiles, max_batch_queries=max_batch)
    result = simulate(
        trace, [stage], np.random.default_rng(seed), prices_usd_per_hr=dict.fromkeys(profiles, 1.0)
    )
    assert np.all(result.start_s >= trace.arrival_s)
    assert np.all(result.finish_s > result.start_s)
    # No instance runs two batches at once: per instance, batches do not overlap.
    for index in np.unique(result.instance):
        mine = result.instance == index
        starts, order = np.unique(result.start_s[mine], return_index=True)
        finishes = result.finish_s[mine][order]
        assert np.all(starts[1:] >= finishes[:-1])


def test_fastest_idle_type_takes_the_query() -> None:
    rng = np.random.default_rng(0)
    slow, fast = profile("slow.large", 50, 0, rng), profile("fast.large", 5, 0, rng)
    trace = Trace(np.array([0.0, 1.0, 2.0]), np.ones(3, dtype=np.int64))
    stage = Stage(
        "m",
        (InstanceSpec("slow.large"), InstanceSpec("fast.large")),
        {"slow.large": slow, "fast.large": fast},
    )
    result = simulate(trace, [stage], rng, prices_usd_per_hr={"slow.large": 1, "fast.large": 2})
    assert result.instance.tolist() == [1, 1, 1]


def test_batching_takes_up_to_max_batch_queued_queries() -> None:
    rng = np.random.default_rng(0)
    p = LatencyProfile("m", "x", np.array([1, 8]), (np.array([100.0]), np.array([100.0])))
    trace = Trace(np.zeros(10), np.ones(10, dtype=np.int64))
    stage = Stage("m", (InstanceSpec("x"),), {"x": p}, max_batch_queries=4)
    result = simulate(trace, [stage], rng, prices_usd_per_hr={"x": 1.0})
    # 10 queries at t=0 with batches of 4: three batches of 0.1 s each.
    assert sorted(set(result.finish_s.round(9))) == [0.1, 0.2, 0.3]
    assert np.count_nonzero(result.finish_s == result.finish_s.min()) == 4


def test_instances_joining_and_leaving_are_honoured_and_billed() -> None:
    p = LatencyProfile("m", "x", np.array([1]), (np.array([1000.0]),))
    trace = Trace(np.arange(0.0, 20.0, 0.5), np.ones(40, dtype=np.int64))
    instances = (InstanceSpec("x", stop_s=5.0), InstanceSpec("x", ready_s=4.0, billed_from_s=3.0))
    stage = Stage("m", instances, {"x": p})
    result = simulate(trace, [stage], np.random.default_rng(0), prices_usd_per_hr={"x": 3600.0})
    first = result.instance == 0
    assert np.all(result.start_s[first] < 5.0)
    assert np.all(result.start_s[~first] >= 4.0)
    horizon = result.horizon_s
    assert result.cost_usd == pytest.approx(5.0 + (horizon - 3.0))


def test_cost_of_a_static_fleet_is_the_sum_of_prices() -> None:
    p = LatencyProfile("m", "x", np.array([1]), (np.array([1.0]),))
    trace = Trace(np.linspace(0, 100, 50), np.ones(50, dtype=np.int64))
    stage = Stage("m", (InstanceSpec("x"), InstanceSpec("x")), {"x": p})
    result = simulate(trace, [stage], np.random.default_rng(0), prices_usd_per_hr={"x": 0.526})
    assert result.summary().cost_usd_per_hr == pytest.approx(2 * 0.526)


def test_summary_statistics() -> None:
    p = LatencyProfile("m", "x", np.array([1]), (np.array([10.0]),))
    trace = Trace(np.arange(100) * 1.0, np.ones(100, dtype=np.int64))
    stage = Stage("m", (InstanceSpec("x"),), {"x": p})
    summary = simulate(
        trace, [stage], np.random.default_rng(0), prices_usd_per_hr={"x": 1}, qos_ms=9.0
    ).summary()
    assert summary.p99_ms == pytest.approx(10.0)
    assert summary.attainment == 0.0
    assert summary.throughput_qps == pytest.approx(100 / 99.01)
    assert summary.mean_utilisation == pytest.approx(1.0 / 99.01, rel=1e-6)


def test_batch_size_outside_profile_is_refused() -> None:
    p = LatencyProfile("m", "x", np.array([10, 20]), (np.array([1.0]), np.array([2.0])))
    trace = Trace(np.zeros(2), np.array([10, 25]))
    stage = Stage("m", (InstanceSpec("x"),), {"x": p})
    with pytest.raises(BatchSizeOutOfRangeError, match="batch size 25"):
        simulate(trace, [stage], np.random.default_rng(0), prices_usd_per_hr={"x": 1})


def test_bad_stages_are_refused() -> None:
    p = LatencyProfile("m", "x", np.array([1]), (np.array([1.0]),))
    with pytest.raises(SimulationError, match="no instances"):
        Stage("m", (), {"x": p})
    with pytest.raises(SimulationError, match="no profile"):
        Stage("m", (InstanceSpec("y"),), {"x": p})
    with pytest.raises(SimulationError, match="ready_s < stop_s"):
        InstanceSpec("x", ready_s=5, stop_s=5)
    trace = Trace(np.zeros(1), np.ones(1, dtype=np.int64))
    with pytest.raises(SimulationError, match="no price"):
        simulate(
            trace,
            [Stage("m", (InstanceSpec("x"),), {"x": p})],
            np.random.default_rng(0),
            prices_usd_per_hr={},
        )
    dynamic = Stage("m", (InstanceSpec("x", stop_s=math.inf, ready_s=1.0),), {"x": p})
    with pytest.raises(SimulationError, match="FCFS kernel"):
        simulate(
            trace, [dynamic], np.random.default_rng(0), prices_usd_per_hr={"x": 1}, engine="kernel"
        )


def test_same_seed_same_result_and_different_seed_differs() -> None:
    rng = np.random.default_rng(1)
    p = LatencyProfile("m", "x", np.array([1]), (rng.exponential(5, size=100),))
    trace = Trace(np.sort(rng.uniform(0, 10, size=500)), np.ones(500, dtype=np.int64))
    stage = Stage("m", (InstanceSpec("x"), InstanceSpec("x")), {"x": p})

    def run(seed: int) -> np.ndarray:
        return simulate(
            trace, [stage], np.random.default_rng(seed), prices_usd_per_hr={"x": 1}
        ).finish_s

    np.testing.assert_array_equal(run(5), run(5))
    assert not np.array_equal(run(5), run(6))


class RecordingFcfs(FcfsPolicy):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, float]] = []

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        self.seen.append((instance_type, batch_size, latency_ms))


def test_policies_observe_every_completed_batch_with_its_service_time() -> None:
    p = LatencyProfile("m", "x", np.array([1, 4]), (np.array([10.0]), np.array([40.0])))
    trace = Trace(np.array([0.0, 0.0, 0.0, 1.0]), np.ones(4, dtype=np.int64))
    policy = RecordingFcfs()
    stage = Stage("m", (InstanceSpec("x"),), {"x": p}, policy, max_batch_queries=3)
    simulate(trace, [stage], np.random.default_rng(0), prices_usd_per_hr={"x": 1}, engine="events")
    assert [(t, b) for t, b, _ in policy.seen] == [("x", 3), ("x", 1)]
    assert [ms for _, _, ms in policy.seen] == pytest.approx([30.0, 10.0])


@pytest.mark.parametrize("engine", ["kernel", "events"])
def test_type_order_overrides_speed_in_both_engines(engine: str) -> None:
    rng = np.random.default_rng(0)
    slow, fast = profile("slow.large", 50, 0, rng), profile("fast.large", 5, 0, rng)
    trace = Trace(np.array([0.0, 1.0, 2.0]), np.ones(3, dtype=np.int64))
    instances = (InstanceSpec("slow.large"), InstanceSpec("fast.large"))
    stage = Stage("m", instances, {"slow.large": slow, "fast.large": fast},
                  FcfsPolicy(type_order=("slow.large",)))  # fmt: skip
    prices = {"slow.large": 1, "fast.large": 2}
    result = simulate(trace, [stage], rng, prices_usd_per_hr=prices, engine=engine)  # type: ignore[arg-type]
    assert result.instance.tolist() == [0, 0, 0]


def test_admission_refuses_what_the_slo_cannot_hold_and_serves_the_rest_in_time() -> None:
    # One instance of exactly 10 ms (100 qps) offered 150 qps for 20 s, SLO 50 ms.
    p = LatencyProfile("m", "x", np.array([1]), (np.array([10.0]),))
    arrivals = np.arange(0.0, 20.0, 1.0 / 150.0)
    trace = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    stage = Stage("m", (InstanceSpec("x"),), {"x": p})
    prices = {"x": 1.0}
    late = simulate(trace, [stage], np.random.default_rng(0), prices_usd_per_hr=prices, qos_ms=50.0)
    gated = simulate(
        trace,
        [stage],
        np.random.default_rng(0),
        prices_usd_per_hr=prices,
        qos_ms=50.0,
        admission=True,
    )
    assert np.all(np.isfinite(late.finish_s)) and gated.engine == "events"
    refused = np.isinf(gated.finish_s)
    # Served however late, the queue grows without bound: most queries miss.
    assert np.mean(late.response_ms > 50.0) > 0.5
    # Refused at arrival when the queue ahead drains past the 40 ms the SLO leaves after the
    # 10 ms service: about the third the instance cannot serve, and every admitted query meets
    # the SLO (its wait is known exactly here: one type, one service time).
    assert 0.3 < refused.mean() < 0.36
    assert np.all(gated.response_ms[~refused] <= 50.0 + 1e-6)
    assert np.all(gated.start_s[refused] == gated.arrival_s[refused])
    assert math.isfinite(gated.horizon_s) and gated.cost_usd > 0


def test_admission_reads_a_queue_of_mixed_sizes_at_each_size_s_rate() -> None:
    # Batch 1 takes 10 ms, batch 8 takes 16 ms: eight queries of 8 samples queued drain in
    # 8 x 16 = 128 ms, not 64 samples at batch 1's 10 ms each (640 ms).
    p = LatencyProfile("m", "x", np.array([1, 8]), (np.array([10.0]), np.array([16.0])))
    arrivals = np.concatenate([np.zeros(9), [0.001]])
    sizes = np.array([8] * 9 + [1], dtype=np.int64)
    stage = Stage("m", (InstanceSpec("x"),), {"x": p})
    run = {"prices_usd_per_hr": {"x": 1.0}, "admission": True}
    trace = Trace(arrivals, sizes)
    # SLO 200 ms: the last query meets 16 ms left of the first call and 8 x 16 ms queued.
    admitted = simulate(trace, [stage], np.random.default_rng(0), qos_ms=200.0, **run)
    assert np.all(np.isfinite(admitted.finish_s))
    refused = simulate(trace, [stage], np.random.default_rng(0), qos_ms=100.0, **run)
    assert np.isinf(refused.finish_s[-1])
    with pytest.raises(SimulationError, match="qos_ms"):
        simulate(
            trace, [stage], np.random.default_rng(0), prices_usd_per_hr={"x": 1.0}, admission=True
        )


@pytest.mark.parametrize("mode", ["sampled", "mean"])
def test_service_table_mean_is_the_profile_mean_clipped_into_its_range(mode: str) -> None:
    rng = np.random.default_rng(5)
    wide = LatencyProfile(
        "m",
        "c",
        np.array([2, 4, 8, 16]),
        tuple(5.0 + 0.2 * b + rng.exponential(1.0, size=7) for b in (2, 4, 8, 16)),
    )
    profiles = {"a": profile("a", 2.0, 0.5, rng), "b": profile("b", 9.0, 0.1, rng), "c": wide}
    table = ServiceTable.build(profiles, mode)  # type: ignore[arg-type]
    for name, prof in profiles.items():
        i = table.type_id(name)
        low, high = prof.min_batch_size, prof.max_batch_size
        for size in (-1, 0, low - 1, low, (low + high) // 2, high, high + 7, 16):
            clipped = min(max(size, low), high)
            expected = float(np.mean(table.table_s[i, clipped]))
            assert math.isfinite(expected)
            for _ in range(2):  # computed, then remembered
                assert table.mean_s(i, size) == pytest.approx(expected, rel=1e-12)


def test_admission_judges_a_cascade_at_the_stage_every_query_reaches() -> None:
    """A cascade whose second model (200 ms a call) one query in ten reaches: queries arriving
    while it is busy are admitted (they reach it rarely; judged on the whole path, with an
    allowance of 300 - 5 - 200 = 95 ms, every query arriving in a busy second stage's first
    100 ms was refused). Only the first stage's queue can refuse them."""
    fast = LatencyProfile("a", "x", np.array([1]), (np.array([5.0]),))
    slow = LatencyProfile("b", "x", np.array([1]), (np.array([200.0]),))
    arrivals = np.arange(0.0, 10.0, 1.0 / 50.0)  # 50 qps: the first stage at 25% of its capacity
    trace = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    forward = np.zeros(arrivals.size, dtype=bool)
    forward[::10] = True  # 5 qps to a stage of 5 qps: it is busy all the time
    first = Stage("a", (InstanceSpec("x"),), {"x": fast}, forward=forward)
    second = Stage("b", (InstanceSpec("x"),), {"x": slow})
    result = simulate(
        trace,
        [first, second],
        np.random.default_rng(0),
        prices_usd_per_hr={"x": 1.0},
        qos_ms=300.0,
        admission=True,
    )
    assert np.all(np.isfinite(result.finish_s))  # none refused
    # The queries that leave at the first stage are served in time.
    assert np.all(result.response_ms[~forward] <= 300.0)


def test_a_cascade_refuses_at_a_later_stage_what_that_stage_cannot_serve_in_time() -> None:
    """Its second model (200 ms a call, 5 qps) offered 10 qps of forwarded queries: admitted
    on entry (the first stage is idle), each is judged again at the second stage against what
    the SLO leaves it; those it cannot serve in time are refused there, and every forwarded
    query it takes meets the SLO, rather than a queue growing for the whole run."""
    fast = LatencyProfile("a", "x", np.array([1]), (np.array([5.0]),))
    slow = LatencyProfile("b", "x", np.array([1]), (np.array([200.0]),))
    arrivals = np.arange(0.0, 20.0, 1.0 / 50.0)
    trace = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    forward = np.zeros(arrivals.size, dtype=bool)
    forward[::5] = True
    stages = [
        Stage("a", (InstanceSpec("x"),), {"x": fast}, forward=forward),
        Stage("b", (InstanceSpec("x"),), {"x": slow}),
    ]
    run = {"prices_usd_per_hr": {"x": 1.0}, "qos_ms": 1000.0}
    late = simulate(trace, stages, np.random.default_rng(0), **run)  # type: ignore[arg-type]
    gated = simulate(trace, stages, np.random.default_rng(0), admission=True, **run)  # type: ignore[arg-type]
    refused = np.isinf(gated.finish_s)
    assert not refused[~forward].any()  # the queries that leave at the first stage: all in
    assert 0.4 < refused[forward].mean() < 0.6  # about half of 10 qps past a 5 qps stage
    assert np.all(gated.response_ms[forward & ~refused] <= 1000.0 + 1e-6)
    # Served however late, the second stage's queue grows: most forwarded queries miss.
    assert np.mean(late.response_ms[forward] > 1000.0) > 0.5


def _batching_profiles() -> dict[str, LatencyProfile]:
    """Two types of 10 ms for one sample and 12 ms for four: four single-sample queries a call
    serve 333 samples/s, one a call 100."""
    sizes = np.array([1, 2, 3, 4])
    means = (10.0, 10.7, 11.3, 12.0)
    return {
        t: LatencyProfile("m", t, sizes, tuple(np.array([ms]) for ms in means)) for t in ("a", "b")
    }


def _kairos_stage(cap: int) -> Stage:
    profiles = _batching_profiles()
    policy = policy_factory("kairos", profiles, ["a", "b"])()
    instances = (InstanceSpec("a"), InstanceSpec("b"))
    return Stage("m", instances, profiles, policy, max_batch_queries=cap)


def test_admission_under_kairos_counts_one_query_a_call_whatever_the_batch_cap() -> None:
    # 300 qps of single-sample queries on two instances that Kairos serves one query a call:
    # 200 qps. Kairos ignores the batch cap, so at a cap of 4 admission must refuse what it
    # refuses at 1; counted at four queries a call (667 samples/s) it admitted queries into a
    # queue that made them late (97% of those it admitted, up to 140 ms of a 50 ms SLO).
    arrivals = np.arange(0.0, 5.0, 1.0 / 300.0)
    trace = Trace(arrivals, np.ones(arrivals.size, dtype=np.int64))
    run = {"prices_usd_per_hr": {"a": 1.0, "b": 1.0}, "qos_ms": 50.0, "admission": True}
    alone = simulate(trace, [_kairos_stage(1)], np.random.default_rng(0), **run)  # type: ignore[arg-type]
    capped = simulate(trace, [_kairos_stage(4)], np.random.default_rng(0), **run)  # type: ignore[arg-type]
    refused = np.isinf(capped.finish_s)
    assert 0.25 < refused.mean() < 0.4  # about the third two 100-qps instances cannot serve
    np.testing.assert_array_equal(capped.finish_s, alone.finish_s)
    # Most admitted queries meet the SLO (Kairos' matching does not serve the queue in arrival
    # order, which the wait estimate assumes, so a few are late).
    assert np.mean(capped.response_ms[~refused] > 50.0) < 0.2


@pytest.mark.parametrize(
    ("policy", "single_sps"), [("fcfs", 2 * 4000.0 / 12.0), ("kairos", 2 * 1000.0 / 10.0)]
)
def test_the_simulator_and_the_live_stage_count_the_same_capacity(
    policy: str, single_sps: float
) -> None:
    """The simulator's admission (``_capacity_sps``) and the live stage's
    (``ServingStage.capacity_sps`` at its ``call_cap``) count a stage under a batch cap of 4
    alike: at four queries a call under FCFS, at one under Kairos, which sends each alone."""
    profiles = _batching_profiles()
    make = policy_factory(policy, profiles, ["a", "b"])
    instances = (InstanceSpec("a"), InstanceSpec("b"))
    stage = Stage("m", instances, profiles, make(), max_batch_queries=4)
    state = _StageState(stage, ServiceTable.build(profiles, "mean"), 0, 50.0)
    live = ServingStage("m")
    live.policy = make()
    for index, name in enumerate(("a", "b")):
        live.latency[name] = LatencyTable(profiles[name])
        worker = Worker(WorkerEndpoint(f"i-{name}", name, f"{name}:1"), 0.0)
        live.slots.append(Slot(index, worker, index, profiles[name].max_batch_size))
    for size in (1, 2, 4):
        simulated = _capacity_sps(state, state.instances, 0.0, size)
        served = live.capacity_sps(size, live.call_cap(4, 0.0))
        assert simulated == pytest.approx(served, rel=1e-9), size
    assert _capacity_sps(state, state.instances, 0.0, 1) == pytest.approx(single_sps)
