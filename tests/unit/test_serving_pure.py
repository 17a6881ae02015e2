"""The serving loop's pure parts: INFaaS model states, admission control, observations, the
worker backoff, the central queue and the HTTP answer parsing."""

from __future__ import annotations

import asyncio
import doctest
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.errors import OverloadedError, WorkerCallError
from controlplane.policies.plan import PlanDocument, StagePlan
from controlplane.serving import workers as workers_module
from controlplane.serving.admission import (
    MAX_RETRY_AFTER_S,
    StageLoad,
    cheapest,
    decide,
    predicted_latency_ms,
    wait_ms,
)
from controlplane.serving.config import AppConfig, DispatcherSettings
from controlplane.serving.dispatcher import AppDispatcher, _Request, policy_name
from controlplane.serving.health import Health
from controlplane.serving.modelio import ModelIO
from controlplane.serving.observations import ARRIVALS_KEPT, Observations, summarise
from controlplane.serving.placement import Placement
from controlplane.serving.stages import LatencyTable, ServingStage, Slot
from controlplane.serving.states import (
    StateTracker,
    is_interfered,
    is_overloaded,
    model_state,
)
from controlplane.serving.transport import (
    HttpWorkerTransport,
    WorkerBusy,
    _Answer,
    _Channel,
    answer_error,
    busy_of,
)
from controlplane.serving.workers import BACKOFF_MAX_S, Worker, WorkerEndpoint, backoff_s
from estimator.cascades import Cascade
from estimator.fleet import Fleet
from estimator.profiles import LatencyProfile
from matching import admission as matching_admission
from matching.kairos import KairosPolicy
from matching.policy import QueuedQuery
from matching.queues import CentralQueue

# --- states ----------------------------------------------------------------------------------


def test_overloaded_when_the_backlog_takes_longer_than_the_slo_to_drain() -> None:
    assert not is_overloaded(0, 0.0, 100.0)  # nothing waits: never overloaded
    assert is_overloaded(1, 0.0, 100.0)  # something waits and nothing serves
    assert not is_overloaded(100, 1000.0, 100.0)  # exactly 100 ms of work
    assert is_overloaded(101, 1000.0, 100.0)


def test_overloaded_when_admission_refused_it_or_its_arrivals_reach_its_capacity() -> None:
    # Admission keeps a one-sample backlog drainable within the SLO: the backlog alone says
    # active, the refusals or the rate say overloaded (INFaaS: "serve at their peak throughput").
    assert not is_overloaded(10, 10.0, 1000.0)  # drains in exactly the SLO
    assert is_overloaded(10, 10.0, 1000.0, refused=1)
    assert is_overloaded(0, 10.0, 1000.0, arrival_sps=10.0)  # at its peak
    assert is_overloaded(0, 10.0, 1000.0, arrival_sps=12.0)
    assert not is_overloaded(10, 10.0, 1000.0, refused=0, arrival_sps=9.9)
    assert not is_overloaded(0, 0.0, 1000.0, arrival_sps=0.0)  # nothing comes, nothing serves


def test_the_tracker_judges_overload_on_refusals_and_arrivals_over_its_window() -> None:
    tracker = StateTracker(window_s=10.0)
    for i in range(120):  # 12 samples/s for 10 s on a model serving 10
        tracker.arrived("tiny", 100.0 + i / 12.0, 1)
    over = tracker.overload("tiny", 110.0, backlog_samples=5, capacity_sps=10.0, slo_ms=1000.0)
    assert over.arrival_sps == pytest.approx(12.0, rel=0.06)
    assert (over.refused, over.backlog_ms) == (0, 500.0)
    assert over.overloaded
    assert over.reasons() == [f"arrivals {over.arrival_sps:.3g} samples/s >= capacity 10 samples/s"]
    # Twice the capacity (an instance joined): the same arrivals are within it.
    assert not tracker.overload("tiny", 110.0, 5, 20.0, 1000.0).overloaded
    # A load that began within the window is judged over its own span (2 s at least).
    onset = StateTracker(window_s=10.0)
    for i in range(12):  # 12 samples/s for 1 s
        onset.arrived("tiny", 50.0 + i / 12.0, 1)
    assert onset.arrival_sps("tiny", 51.0) == pytest.approx(12 / 2.0)  # 1 s in: over 2 s
    for i in range(12, 24):  # and another
        onset.arrived("tiny", 50.0 + i / 12.0, 1)
    assert onset.arrival_sps("tiny", 52.0) == pytest.approx(12.0)
    assert onset.overload("tiny", 52.0, 0, 10.0, 1000.0).overloaded
    # Aged out of the window: nothing arrives.
    assert tracker.arrival_sps("tiny", 125.0) == 0.0
    assert not tracker.overload("tiny", 125.0, 0, 10.0, 1000.0).overloaded

    # A refusal counts (and is an arrival) while the capacity is no larger than it was judged at.
    tracker.refused("tiny", 200.0, samples=1, capacity_sps=10.0)
    tracker.refused("tiny", 200.1, samples=1, capacity_sps=10.0)
    over = tracker.overload("tiny", 201.0, 0, 10.0, 1000.0)
    assert (over.refused, over.overloaded) == (2, True)
    assert over.arrival_sps == pytest.approx(2 / 2.0)  # a load just begun: over 2 s at least
    assert tracker.arrival_sps("tiny", 203.0) == pytest.approx(2 / 3.0)  # since it began
    assert tracker.arrival_sps("tiny", 209.2) == pytest.approx(2 / 9.2)
    assert over.reasons() == ["2 queries refused (429) in the last 10 s"]
    assert over.numbers()["refused"] == 2.0
    assert tracker.refusals("tiny", 201.0, capacity_sps=5.0) == 2  # an instance left
    assert tracker.refusals("tiny", 201.0, capacity_sps=20.0) == 0  # an instance joined
    assert not tracker.overload("tiny", 201.0, 0, 20.0, 1000.0).overloaded
    assert tracker.refusals("tiny", 211.0, capacity_sps=10.0) == 0  # aged out
    assert tracker.refusals("other", 201.0, capacity_sps=10.0) == 0
    tracker.refused("tiny", 300.0, samples=0, capacity_sps=10.0)  # reaches nothing: ignored
    assert tracker.refusals("tiny", 300.0, capacity_sps=10.0) == 0

    # The backlog criterion, with nothing serving: an infinite drain, None in the numbers, once
    # it has lasted the hold (2 s: INFaaS's monitoring period).
    over = tracker.overload("idle", 0.0, backlog_samples=3, capacity_sps=0.0, slo_ms=100.0)
    assert not over.overloaded and math.isinf(over.backlog_ms)
    over = tracker.overload("idle", 2.0, backlog_samples=3, capacity_sps=0.0, slo_ms=100.0)
    assert over.overloaded and math.isinf(over.held_backlog_ms)
    assert (over.numbers()["backlog_ms"], over.numbers()["held_backlog_ms"]) == (None, None)
    assert over.reasons() == ["backlog drains in inf ms or more > SLO 100 ms for the last 2 s"]


def test_a_momentary_backlog_spike_is_no_overload_a_backlog_held_over_the_slo_is() -> None:
    """The backlog criterion holds over a monitoring period (2 s): a Poisson queue's burst
    drains in more than the SLO at one reading now and then at 40-55% busy, and read at one
    moment it made the scaler replicate a model that kept up with its load."""
    tracker = StateTracker(window_s=10.0)
    queue = ("demo", "large")
    # 10 samples/s of capacity, SLO 500 ms: over it past 5 samples queued.
    for t, samples in [(0.0, 1), (0.5, 0), (1.0, 2), (3.0, 0), (4.0, 1)]:
        tracker.backlog(queue, t, samples)
    tracker.backlog(queue, 4.2, 9)  # a burst: 900 ms of work at one reading
    spike = tracker.overload(queue, 4.3, 9, capacity_sps=10.0, slo_ms=500.0)
    assert spike.backlog_ms == 900.0 and spike.held_backlog_ms == 0.0
    assert not spike.overloaded and spike.reasons() == []
    tracker.backlog(queue, 4.6, 2)  # drained under the SLO again
    assert not tracker.overload(queue, 6.5, 2, 10.0, 500.0).overloaded
    # Held over the SLO (7 samples and more) at every reading for 2 s: overloaded.
    for i, samples in enumerate([8, 7, 12, 9, 7, 10]):
        tracker.backlog(queue, 10.0 + 0.3 * i, samples)
    assert not tracker.overload(queue, 11.9, 10, 10.0, 500.0).overloaded  # 1.9 s so far
    held = tracker.overload(queue, 12.0, 10, 10.0, 500.0)
    assert held.overloaded and held.held_backlog_ms == 700.0
    assert held.reasons() == ["backlog drains in 700 ms or more > SLO 500 ms for the last 2 s"]
    # One reading under the SLO within the last 2 s: not held.
    tracker.backlog(queue, 12.5, 3)
    tracker.backlog(queue, 12.6, 11)
    assert not tracker.overload(queue, 14.4, 11, 10.0, 500.0).overloaded
    assert tracker.overload(queue, 14.6, 11, 10.0, 500.0).overloaded
    # Instances joined: the same backlog drains within the SLO at three times the capacity.
    assert not tracker.overload(queue, 14.6, 11, 30.0, 500.0).overloaded


def test_a_poisson_queue_at_half_its_capacity_is_not_held_overloaded() -> None:
    """A single-server queue at 50% busy (Poisson arrivals, one sample a query, a model's
    service time of 100 ms give or take 30%: 10 samples/s), SLO 500 ms: its backlog goes past
    the SLO at some readings, never for a monitoring period."""
    rng = np.random.default_rng(7)
    tracker = StateTracker(window_s=10.0)
    queue = ("demo", "large")
    arrivals = np.cumsum(rng.exponential(1 / 5.0, size=6000))  # 5 qps for 20 min
    backlog, free_s = 0, 0.0
    ends: list[float] = []  # the service completions still to come
    spikes = held = 0
    for at in arrivals:
        while ends and ends[0] <= at:
            backlog -= 1
            tracker.backlog(queue, ends.pop(0), backlog)
        free_s = max(free_s, at) + rng.uniform(0.07, 0.13)
        ends.append(free_s)
        backlog += 1
        tracker.backlog(queue, at, backlog)
        over = tracker.overload(queue, at, backlog, capacity_sps=10.0, slo_ms=500.0)
        spikes += over.backlog_ms > 500.0
        held += over.overloaded
    assert spikes > 10, spikes  # read at one moment, it was overloaded now and then
    assert held == 0


def test_interfered_needs_enough_samples_and_a_median_above_the_margin() -> None:
    assert not is_interfered([3.0, 3.0], margin=0.5, min_samples=3)
    assert not is_interfered([1.0, 1.2, 1.5, 9.0, 9.0], margin=0.5, min_samples=3)
    assert is_interfered([1.0, 1.6, 1.6, 9.0, 9.0], margin=0.5, min_samples=3)


def test_interference_wins_over_overload() -> None:
    assert model_state(overloaded=True, interfered=True) == "interfered"
    assert model_state(overloaded=False, interfered=False) == "active"


def test_the_tracker_forgets_measurements_older_than_its_window() -> None:
    tracker = StateTracker(window_s=10.0, margin=0.5, min_samples=3)
    for t in range(3):
        tracker.observe("tiny", "i-1", float(t), measured_ms=30.0, profiled_ms=10.0)
    assert tracker.interfered("tiny", "i-1", 5.0)
    assert not tracker.interfered("tiny", "i-2", 5.0)
    assert not tracker.interfered("tiny", "i-1", 11.5)  # aged out: tried again
    tracker.observe("tiny", "i-1", 20.0, measured_ms=5.0, profiled_ms=0.0)  # ignored
    assert tracker.ratios("tiny", "i-1", 20.0) == []
    tracker.observe("tiny", "i-1", 21.0, measured_ms=5.0, profiled_ms=10.0)
    tracker.forget(["i-1"])
    assert tracker.ratios("tiny", "i-1", 21.0) == []


def test_sub_millisecond_profiles_count_as_a_millisecond() -> None:
    tracker = StateTracker(margin=0.5, min_samples=3)
    for t in range(5):  # 0.2 ms where 0.03 ms was profiled: timer noise, not interference
        tracker.observe("tiny", "i-1", float(t), measured_ms=0.2, profiled_ms=0.03)
    assert not tracker.interfered("tiny", "i-1", 5.0)
    assert not tracker.slow(1.4, 0.03) and tracker.slow(1.6, 0.03)


# --- admission -------------------------------------------------------------------------------


def test_the_predicted_latency_sums_waits_and_services_of_the_stages_reached() -> None:
    stages = [
        StageLoad(backlog_samples=50, capacity_sps=1000.0, service_ms=2.0, reach_share=1.0),
        StageLoad(backlog_samples=10, capacity_sps=100.0, service_ms=20.0, reach_share=0.1),
        StageLoad(backlog_samples=1e6, capacity_sps=1.0, service_ms=99.0, reach_share=0.0),
    ]
    assert wait_ms(stages) == pytest.approx(50.0 + 100.0)
    assert predicted_latency_ms(stages) == pytest.approx(150.0 + 22.0)
    assert math.isinf(wait_ms([StageLoad(0, 0.0, 1.0)]))


def test_admission_allows_what_the_slo_leaves_after_the_service() -> None:
    load = StageLoad(backlog_samples=80, capacity_sps=1000.0, service_ms=20.0)
    assert decide([load], slo_ms=100.0).admitted  # 80 ms wait + 20 ms service
    refused = decide([StageLoad(2080, 1000.0, 20.0)], slo_ms=100.0)
    assert not refused.admitted and refused.retry_after_s == 2  # 2 s over the 80 ms allowance
    assert decide([StageLoad(1e9, 1.0, 20.0)], 100.0).retry_after_s == MAX_RETRY_AFTER_S


def test_a_service_slower_than_the_slo_still_admits_a_short_queue() -> None:
    # The service alone misses the SLO: a quarter of the SLO of waiting is still allowed.
    assert decide([StageLoad(20, 1000.0, 150.0)], slo_ms=100.0).admitted
    assert not decide([StageLoad(30, 1000.0, 150.0)], slo_ms=100.0).admitted


def test_a_cascade_is_admitted_on_the_stage_every_sample_reaches() -> None:
    """A busy large model that 5% of the samples reach does not turn the query away (its first
    model is free); the prediction stays the whole path's. A busy first model does."""
    first = StageLoad(backlog_samples=0, capacity_sps=1000.0, service_ms=5.0, reach_share=1.0)
    large = StageLoad(backlog_samples=200, capacity_sps=1000.0, service_ms=200.0, reach_share=0.05)
    admitted = decide([first, large], slo_ms=300.0)
    assert admitted.admitted and admitted.predicted_ms == 405.0  # 0 + 5 + 200 + 200
    busy = StageLoad(backlog_samples=400, capacity_sps=1000.0, service_ms=5.0, reach_share=1.0)
    assert not decide([busy, large], slo_ms=300.0).admitted  # 400 ms over 295 allowed


def test_the_cheapest_gear_is_the_fastest_now() -> None:
    busy = [StageLoad(500, 1000.0, 1.0)]
    idle = [StageLoad(0, 1000.0, 10.0), StageLoad(0, 100.0, 30.0, 0.1)]
    assert cheapest([busy, idle]) == 1
    with pytest.raises(ValueError):
        cheapest([])


@given(
    st.floats(0, 1e5),
    st.floats(0, 1e5),
    st.floats(1.0, 1e5),
    st.floats(0, 500),
    st.floats(1, 1000),
)
def test_more_backlog_never_turns_a_refusal_into_an_admission(
    backlog: float, extra: float, capacity: float, service: float, slo: float
) -> None:
    less = decide([StageLoad(backlog, capacity, service)], slo)
    more = decide([StageLoad(backlog + extra, capacity, service)], slo)
    assert less.admitted or not more.admitted
    if not more.admitted:
        assert 1 <= more.retry_after_s <= MAX_RETRY_AFTER_S


def _stage(*types_ms: tuple[str, float]) -> ServingStage:
    stage = ServingStage("m")
    for index, (name, ms) in enumerate(types_ms):
        profile = LatencyProfile(
            "m", name, np.array([1, 2]), (np.array([ms]), np.array([2.0 * ms]))
        )
        stage.latency[name] = LatencyTable(profile)
        worker = Worker(WorkerEndpoint(f"i-{index}", name, f"w:{index}"), 0.0)
        stage.slots.append(Slot(index, worker, 0, profile.max_batch_size))
    return stage


def test_a_joining_query_waits_for_the_first_free_instance_then_the_queue() -> None:
    # Four instances of 20 ms, all busy: the old estimate counted the four calls in service as
    # four samples still to serve, 1000 x 4 / 200 = 20 ms, where the next instance frees in 5.
    stage = _stage(*[("t", 20.0)] * 4)
    for i, slot in enumerate(stage.slots):
        slot.worker.start(0.0, 20.0 - 5.0 * i)  # they free at 20, 15, 10 and 5 ms
    stage.in_service_samples = 4
    assert stage.wait_ms(1, 0.0) == pytest.approx(5.0)
    # Two queued samples ahead of it drain at the stage's 200 samples/s once one is free.
    stage.backlog.add(1)
    stage.backlog.add(1)
    assert stage.wait_ms(1, 0.0) == pytest.approx(5.0 + 10.0)
    assert stage.wait_ms(1, 0.004) == pytest.approx(1.0 + 10.0)
    # An idle instance takes it at once; none healthy: nothing serves it.
    stage.slots[3].worker.finish(0.001)
    assert stage.wait_ms(1, 0.001) == pytest.approx(10.0)
    for slot in stage.slots:
        slot.worker.healthy = False
    assert math.isinf(stage.wait_ms(1, 0.0))


def test_queued_queries_drain_at_the_rate_of_their_own_size() -> None:
    # One instance whose per-sample time falls with the batch (10 ms at 1, 12 ms at 2): 100
    # samples/s at size 1, 167 at size 2.
    stage = ServingStage("m")
    profile = LatencyProfile("m", "t", np.array([1, 2]), (np.array([10.0]), np.array([12.0])))
    stage.latency["t"] = LatencyTable(profile)
    stage.slots.append(Slot(0, Worker(WorkerEndpoint("i-0", "t", "w:0"), 0.0), 0, 2))
    stage.backlog.add(2)
    stage.backlog.add(2)
    # Two queries of two samples: 2 x 12 ms, not 4 samples at size 1's 10 ms each (40 ms).
    assert stage.wait_ms(1, 0.0) == pytest.approx(24.0)
    stage.backlog.remove(2)
    stage.backlog.remove(2)
    stage.backlog.remove(2)  # one not held: ignored
    assert stage.backlog.samples == 0 and stage.wait_ms(1, 0.0) == 0.0


def _batching_profile(instance_type: str) -> LatencyProfile:
    """10 ms for one sample, 12 ms for four: a call of four single-sample queries serves 333
    samples/s, a call of one 100."""
    sizes = np.array([1, 2, 3, 4])
    means = (10.0, 10.7, 11.3, 12.0)
    return LatencyProfile("m", instance_type, sizes, tuple(np.array([ms]) for ms in means))


def _busy_dispatcher(policy: str) -> AppDispatcher:
    """A dispatcher of one model on an "a" and a "b" worker under ``policy`` at the plan's
    batch cap of 4, both workers busy for 5 more ms and eight single-sample queries queued."""
    profiles = {"a": _batching_profile("a"), "b": _batching_profile("b")}
    plan = StagePlan("m", Fleet.of({"a": 1, "b": 1}), 4, policy=policy, base_types=("a", "b"))
    config = AppConfig(
        name="demo",
        slo_ms=50.0,
        models=("m",),
        cascade=Cascade(("m",), ()),
        profiles={"m": profiles},
        prices_usd_per_hr={"a": 1.0, "b": 1.0},
        stage_plans={"m": plan},
    )
    dispatcher = AppDispatcher(config, HttpWorkerTransport(), Observations(), clock_s=lambda: 0.0)
    dispatcher.set_workers([WorkerEndpoint("i-a", "a", "a:1"), WorkerEndpoint("i-b", "b", "b:1")])
    stage = dispatcher._stages["m"]
    assert stage.policy is not None and stage.policy.name == policy
    for slot in stage.slots:
        slot.worker.start(0.0, 5.0)
    stage.in_service_samples = 2
    for _ in range(8):
        stage.backlog.add(1)
    stage.queued_samples = 8
    return dispatcher


@pytest.mark.parametrize(
    ("policy", "call_cap", "capacity_sps", "wait_ms"),
    [("fcfs", 4, 2 * 4000.0 / 12.0, 5.0 + 12.0), ("kairos", 1, 2 * 1000.0 / 10.0, 5.0 + 40.0)],
)
def test_admission_counts_a_call_at_the_queries_the_stage_policy_sends(
    policy: str, call_cap: int, capacity_sps: float, wait_ms: float
) -> None:
    # At the plan's cap of 4, FCFS drains the eight queued queries two calls of four at a time
    # (667 samples/s): 5 + 12 ms of wait, within the 40 ms the 50 ms SLO leaves after a 10 ms
    # service. Kairos sends each query alone (200 samples/s): 5 + 40 ms, so it refuses, where
    # counting its instances at the cap admitted a query that would wait 45 ms.
    dispatcher = _busy_dispatcher(policy)
    assert dispatcher._stages["m"].call_cap(4, 0.0) == call_cap
    gear = dispatcher.current_gear()
    (load,) = dispatcher.variants.loads(gear.cascade, 1, gear, 0.0)
    assert load.capacity_sps == pytest.approx(capacity_sps)
    assert load.queue_wait_ms == pytest.approx(wait_ms)
    if policy == "fcfs":
        dispatcher._admit(gear, 1)  # admitted
    else:
        with pytest.raises(OverloadedError):
            dispatcher._admit(gear, 1)
    # The part of a query a cascade forwards is judged on the same count.
    loop = asyncio.new_event_loop()
    try:
        request = _Request([[0.0]], None, gear.cascade, 0.0, loop.create_future())
        assert dispatcher._forward_refused(request, 0, 1, 0.0) == (policy == "kairos")
    finally:
        loop.close()
    # The status (what INFaaS' overload signal reads) counts the same capacity, and still
    # reports the gear's batch cap.
    (status,) = dispatcher.status().stages
    assert status.capacity_sps == pytest.approx(capacity_sps)
    assert status.max_batch_queries == 4


def test_the_stage_wait_replaces_backlog_over_capacity_when_given() -> None:
    pooled = StageLoad(backlog_samples=80, capacity_sps=1000.0, service_ms=20.0)
    measured = StageLoad(80, 1000.0, 20.0, 1.0, queue_wait_ms=5.0)
    assert wait_ms([pooled]) == pytest.approx(80.0) and wait_ms([measured]) == 5.0
    assert not decide([StageLoad(200, 1000.0, 20.0)], 100.0).admitted
    assert decide([StageLoad(200, 1000.0, 20.0, 1.0, queue_wait_ms=79.0)], 100.0).admitted


def test_the_matching_admission_doctests() -> None:
    assert doctest.testmod(matching_admission).failed == 0


# --- observations ----------------------------------------------------------------------------


def test_a_window_summarises_rate_latency_attainment_and_accuracy() -> None:
    summary = summarise(
        [10.0, 20.0, 30.0, 400.0], 350.0, arrivals=5, elapsed_s=2.5, correct=3, labelled=4
    )
    assert summary.arrival_rate_qps == 2.0 and summary.answered == 4
    assert summary.latency_p50_ms == 25.0 and summary.attainment_share == 0.75
    assert summary.accuracy == 0.75
    empty = summarise([], 350.0, arrivals=0, elapsed_s=0.0)
    assert (empty.arrival_rate_qps, empty.latency_p99_ms, empty.attainment_share) == (
        0.0,
        None,
        None,
    )


def test_observations_keep_arrivals_windows_and_counters() -> None:
    seen = Observations()
    assert seen.take_window("demo", 0.0, 100.0) is None
    for t in (1.0, 2.0, 3.0):
        seen.arrival("demo", t)
    seen.answered("demo", 3.0, 50.0, late=False, models=["tiny", "large"], correct=1, labelled=2)
    seen.answered("demo", 3.0, 150.0, late=True, models=["tiny"])
    seen.failed("demo", 3.0)
    seen.refused("demo", 3.0)
    assert seen.arrival_s("demo").tolist() == [1.0, 2.0, 3.0]
    assert seen.rate_qps("demo", now_s=3.0, window_s=1.5) == pytest.approx(2 / 1.5)
    window = seen.take_window("demo", 4.0, slo_ms=100.0, gear="tiny@0.5 -> large")
    assert window is not None
    assert window.arrival_rate_qps == pytest.approx(3 / 3.0)  # since the first arrival's t=1
    # One of four queries that ended was answered within the SLO: the failed and the refused
    # ones are misses, the percentiles are over the two answered.
    assert (window.answered, window.attainment_share, window.accuracy) == (2, 0.25, 0.5)
    assert (window.refused, window.failed, window.timed_out, window.offered) == (1, 1, 0, 4)
    assert window.latency_p99_ms == pytest.approx(149.0)
    assert window.gear == "tiny@0.5 -> large"
    again = seen.take_window("demo", 5.0, slo_ms=100.0)
    assert again is not None and again.answered == 0 and again.arrival_rate_qps == 0.0
    totals = seen.totals()["demo"]
    assert (totals.arrived, totals.answered, totals.late, totals.failed, totals.refused) == (
        3,
        2,
        1,
        1,
        1,
    )
    assert totals.samples_by_model == {"tiny": 2, "large": 1}


def test_the_arrival_ring_keeps_the_newest_in_order() -> None:
    seen = Observations()
    extra = 5
    for t in range(ARRIVALS_KEPT + extra):
        seen.arrival("demo", float(t))
    kept = seen.arrival_s("demo")
    assert kept.size == ARRIVALS_KEPT
    assert kept[0] == extra and kept[-1] == ARRIVALS_KEPT + extra - 1
    assert np.all(np.diff(kept) > 0)


def test_the_arrivals_since_a_time_are_the_rings_tail_before_and_after_it_wraps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the feed of a loops process running apart asks for: the arrivals after the newest
    it has, read from the ring without copying the rest, equal to filtering the whole."""
    monkeypatch.setattr("controlplane.serving.observations.ARRIVALS_KEPT", 8)
    seen = Observations()
    assert seen.arrival_s_since("demo", 0.0).size == 0
    for t in np.cumsum(np.random.default_rng(1).random(30)):
        seen.arrival("demo", float(t))
        whole = seen.arrival_s("demo")
        for since in (None, -1.0, float(t), float(t) - 0.5, float(t) - 3.0, *whole.tolist()):
            want = whole if since is None else whole[whole > since]
            assert np.array_equal(seen.arrival_s_since("demo", since), want)


# --- workers, queues, policies, the wire ------------------------------------------------------


def test_the_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n) for n in (0, 1, 2, 3)] == [0.0, 0.5, 1.0, 2.0]
    assert backoff_s(1000) == BACKOFF_MAX_S


def test_the_workers_doctests() -> None:
    results = doctest.testmod(workers_module)
    assert results.attempted > 0 and results.failed == 0


def test_utilisation_is_the_busy_share_of_the_last_window() -> None:
    worker = Worker(WorkerEndpoint("i-1", "t", "127.0.0.1:1"), 0.0)
    assert worker.utilisation(0.0) is None  # no time has passed
    worker.start(0.0, 10.0)
    assert worker.utilisation(30.0) == 1.0  # the call in progress counts
    worker.finish(30.0)
    assert worker.utilisation(60.0) == 0.5
    for t in range(61, 200):  # marks every second while idle
        worker.utilisation(float(t))
    assert worker.utilisation(200.0) == 0.0  # the busy half minute left the window


@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 5.0)),
        min_size=1,
        max_size=30,
    )
)
def test_utilisation_stays_a_share_and_counts_every_busy_second(
    calls: list[tuple[float, float]],
) -> None:
    worker = Worker(WorkerEndpoint("i-1", "t", "127.0.0.1:1"), 0.0)
    now = busy = 0.0
    for idle_s, busy_s in calls:
        now += idle_s
        worker.start(now, 1.0)
        now += busy_s
        worker.finish(now)
        busy += busy_s
        share = worker.utilisation(now, window_s=1e9)  # a window longer than the run
        if now > 0:
            assert share is not None and 0.0 <= share <= 1.0
            assert share == pytest.approx(busy / now)
    assert worker.busy_total_s(now) == pytest.approx(busy)


def test_the_queue_reads_in_order_after_removals_and_requeues() -> None:
    queue = CentralQueue()
    items = [QueuedQuery(q, 1, float(q), float(q)) for q in range(6)]
    for item in items:
        queue.append(item)
    assert queue.take(2) is items[2] and queue.take(0) is items[0]
    assert queue.take(2) is None
    assert [q.query_id for q in queue] == [1, 3, 4, 5]
    assert queue[1].query_id == 3 and len(queue) == 4
    queue.push_front([items[0], items[2]])
    assert [q.query_id for q in queue] == [0, 2, 1, 3, 4, 5]
    assert items[2] in queue and queue[0] is items[0]


def _profile(instance_type: str, ms: float) -> LatencyProfile:
    return LatencyProfile("m", instance_type, np.array([1, 2]), (np.array([ms]), np.array([ms])))


def test_the_stage_policy_follows_the_planners_rule() -> None:
    one = {"a": _profile("a", 5.0)}
    mix = {"a": _profile("a", 5.0), "b": _profile("b", 50.0)}
    assert policy_name(None, one, 100.0)[0] == "fcfs"
    name, base = policy_name(None, mix, 100.0)
    assert name == "kairos" and base
    assert policy_name(StagePlan("m", Fleet.of({}), 1, policy="fcfs"), mix, 100.0)[0] == "fcfs"
    assert policy_name(None, mix, 1.0)[0] == "fcfs"  # no type serves the range within the SLO


def test_a_mix_the_tuner_makes_of_a_one_type_plan_is_served_as_the_planner_dispatches_it() -> None:
    # A plan of one type names FCFS by the single-type rule; the planner dispatches a mix (the
    # sizing ladder's rungs that add a type) by Kairos' matching over its full-range base, and so
    # does the live stage once the tuner has added the type. It served the mix FCFS.
    mix = {"a": _profile("a", 5.0), "b": _profile("b", 50.0)}
    alone = StagePlan("m", Fleet.of({"a": 2}), 1, policy="fcfs", base_types=("a",))
    assert policy_name(alone, {"a": mix["a"]}, 100.0) == ("fcfs", ["a"])
    assert policy_name(alone, mix, 100.0) == policy_name(None, mix, 100.0)
    assert policy_name(alone, mix, 100.0)[0] == "kairos"
    assert policy_name(alone, mix, 1.0)[0] == "fcfs"  # no type serves the range within the SLO


def test_types_no_plan_ranks_take_the_kairos_base_by_throughput_per_dollar() -> None:
    # Both types serve the whole range within the SLO; "a" is 4x faster and 50x dearer. By
    # throughput per USD/hr, the planner's rule, "b" is the base: a stage served before any
    # plan (or on a plan older than base_types) took "a" by its name.
    mix = {"a": _profile("a", 5.0), "b": _profile("b", 20.0)}
    prices = {"a": 5.0, "b": 0.1}
    assert policy_name(None, mix, 100.0, prices) == ("kairos", ["b", "a"])
    plan = StagePlan("m", Fleet.of({}), 1, policy="kairos", base_types=("a",))
    assert policy_name(plan, mix, 100.0, prices) == ("kairos", ["a", "b"])  # the plan's first
    # A type without a price: by name, as without prices.
    assert policy_name(None, mix, 100.0, {"b": 0.1}) == ("kairos", ["a", "b"])
    # The live placement builds the stage's policy with the app's prices.
    config = AppConfig(
        name="demo",
        slo_ms=100.0,
        models=("m",),
        cascade=Cascade(("m",), ()),
        profiles={"m": mix},
        prices_usd_per_hr=prices,
    )
    placement = Placement()
    placement.update([WorkerEndpoint("i-a", "a", "a:1"), WorkerEndpoint("i-b", "b", "b:1")], 0.0)
    stage = ServingStage("m")
    placement.place(config, {"m": stage})
    assert isinstance(stage.policy, KairosPolicy)
    assert (stage.policy_name, stage.policy.base_type) == ("kairos", "b")


def test_the_live_dispatcher_keeps_the_plans_base_type_order() -> None:
    # Both types serve the whole range within the SLO; by name "a" would be the base. The plan
    # ranked "b" first (the planner's order: throughput per USD/hr on the trace's batch mix).
    mix = {"a": _profile("a", 5.0), "b": _profile("b", 20.0)}
    assert policy_name(None, mix, 100.0) == ("kairos", ["a", "b"])
    plan = StagePlan("m", Fleet.of({"a": 1, "b": 1}), 1, policy="kairos", base_types=("b", "a"))
    assert policy_name(plan, mix, 100.0) == ("kairos", ["b", "a"])
    # A type the plan did not rank (the tuner added it) follows the ranked ones.
    more = {**mix, "c": _profile("c", 1.0)}
    assert policy_name(plan, more, 100.0) == ("kairos", ["b", "a", "c"])
    # The plan document keeps the order through its JSON.
    document = PlanDocument(True, 0.0, (plan,)).to_document()
    assert PlanDocument.parse(document).stages[0].base_types == ("b", "a")


class _Wire(asyncio.Transport):
    """A transport that takes what is written and is closed on request (no socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _answer(*chunks: bytes) -> tuple[_Answer | WorkerCallError | None, bool]:
    """What a connection makes of an answer arriving in ``chunks`` (the result or the error,
    None while incomplete), and whether it closed the connection."""

    async def run() -> tuple[_Answer | WorkerCallError | None, bool]:
        channel, wire = _Channel("w"), _Wire()
        channel.connection_made(wire)
        waiter = channel.send(b"GET / HTTP/1.1\r\n\r\n")
        for chunk in chunks:
            channel.data_received(chunk)
        if not waiter.done():
            return None, wire.closed
        error = waiter.exception()
        if error is not None:
            assert isinstance(error, WorkerCallError)
            return error, wire.closed
        return waiter.result(), wire.closed

    return asyncio.run(run())


def test_answer_heads_and_bodies_are_checked() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: keep-alive\r\n\r\n"
    assert _answer(head, b"hello ", b"world!") == ((200, b"hello world!", False), False)
    assert _answer(head, b"hello")[0] is None  # the body is not whole yet
    closing = b"HTTP/1.1 503 X\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    assert _answer(closing)[0] == (503, b"", True)
    for bad in (b"SSH-2.0\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n", b"HTTP/1.1 x\r\n\r\n"):
        error, closed = _answer(bad)
        assert isinstance(error, WorkerCallError) and error.kind == "malformed" and closed
    error, closed = _answer(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 20_000)
    assert isinstance(error, WorkerCallError) and "too long" in str(error) and closed
    io = ModelIO("tiny")
    answer = (
        b'{"model_name":"tiny","outputs":[{"name":"logits","datatype":"FP32","shape":[2,10],'
        b'"data":[' + b",".join([b"0"] * 9 + [b"5"] + [b"5"] + [b"0"] * 9) + b"]}],"
        b'"parameters":{"served_ms":3.5,"instance_type":"emu.gpu"}}'
    )
    reply = io.decode("w", answer, rows=2)
    assert reply.predictions == (9, 0) and reply.served_ms == 3.5
    assert reply.instance_type == "emu.gpu"
    with pytest.raises(WorkerCallError, match="for a batch of 3 rows"):
        io.decode("w", answer, rows=3)
    with pytest.raises(WorkerCallError, match="not an inference answer"):
        io.decode("w", b"[]", rows=1)


# --- the health rule: only the call's own failures count against a worker ---------------------


@pytest.mark.parametrize(
    ("status", "kind", "rows"),
    [
        (400, "input", None),
        (413, "input", None),
        (422, "input", (1, 3)),
        (500, "model", (0,)),
        (503, "status", None),
        (404, "status", None),
        (502, "status", None),
    ],
)
def test_an_error_answer_is_the_inputs_the_models_or_the_workers(
    status: int, kind: str, rows: tuple[int, ...] | None
) -> None:
    body = b'{"error": "boom", "failed_rows": %s}' % str(list(rows or ())).encode()
    error = answer_error("w:1", status, body, 4)
    assert (error.kind, error.status, error.worker_fault) == (kind, status, kind == "status")
    assert error.rows == (rows if kind != "status" else None)
    assert "boom" in str(error)


@pytest.mark.parametrize("named", ["[4]", "[1, 1]", "[]", '["0"]', "[true]", '"0"'])
def test_failed_rows_outside_the_batch_name_nothing(named: str) -> None:
    error = answer_error("w:1", 422, b'{"error": "x", "failed_rows": %s}' % named.encode(), 4)
    assert error.rows is None and error.kind == "input"


def test_a_worker_that_answered_is_never_marked_unhealthy() -> None:
    settings = DispatcherSettings()
    health = Health("demo", None, settings, lambda: 0.0)  # type: ignore[arg-type]
    worker = Worker(WorkerEndpoint("i-1", "emu.cpu.large", "w:1"), 0.0)
    answered = [
        WorkerCallError("w:1", "model", "HTTP 500: raised", status=500, worker_fault=False),
        WorkerCallError("w:1", "input", "HTTP 422: bad", status=422, worker_fault=False),
    ]
    for error in answered * 50:  # one bad query after another
        assert health.call_failed(worker, error, 1.0) is False
        assert not health.retries(error, 1)
    assert worker.healthy and worker.last_error == ""
    for error in (
        WorkerCallError("w:1", "timeout", "no answer within 30 ms"),
        WorkerCallError("w:1", "connect", "refused"),
        WorkerCallError("w:1", "closed", "the worker closed the connection"),
        WorkerCallError("w:1", "status", "HTTP 503: stopping", status=503),
    ):
        fresh = Worker(WorkerEndpoint("i-2", "emu.cpu.large", "w:2"), 0.0)
        assert health.call_failed(fresh, error, 1.0) is True
        assert not fresh.healthy and health.retries(error, 1)


class _Answers:
    """A transport whose health probes answer in turn what ``answers`` holds (no calls)."""

    def __init__(self, *answers: bool | WorkerBusy) -> None:
        self.answers = list(answers)

    async def health(self, address: str, timeout_s: float) -> bool | WorkerBusy:
        return self.answers.pop(0)


def test_a_worker_whose_agent_is_busy_stays_out_at_the_same_backoff_until_it_is_not() -> None:
    """A worker out after a slow query, probed: while its agent says a batch is under way it
    stays out, probed again after the same backoff (busy is no failure); then it answers
    ready and not busy and is back. A transport that never says busy (True) puts it back at
    once, as before; no answer (False) lengthens its backoff."""
    clock = [100.0]
    transport = _Answers(WorkerBusy(1, 1.5), WorkerBusy(2, 4.0), True, False)
    health = Health("demo", transport, DispatcherSettings(), lambda: clock[0])  # type: ignore[arg-type]
    worker = Worker(WorkerEndpoint("i-1", "emu.cpu.large", "w:1"), 0.0)
    workers = {"i-1": worker}
    worker.fail(clock[0], "no answer within 1000 ms")
    for in_flight, busy_s in ((1, 1.5), (2, 4.0)):
        clock[0] = worker.retry_at_s
        assert health.due(workers, clock[0]) == [worker]
        assert asyncio.run(health.recover([worker], workers, 0.5)) == []
        assert not worker.healthy and worker.failures == 1
        assert worker.retry_at_s == clock[0] + backoff_s(1)
        assert worker.last_error == (
            f"busy: {in_flight} batch(es) under way, the oldest for {busy_s:.1f} s"
        )
    clock[0] = worker.retry_at_s
    assert asyncio.run(health.recover([worker], workers, 0.5)) == [worker]
    assert worker.healthy and worker.last_error == ""
    worker.fail(clock[0], "no answer within 1000 ms")  # a second failure (none answered since)
    worker.still_busy(clock[0], 1, 0.0)
    clock[0] = worker.retry_at_s
    assert asyncio.run(health.recover([worker], workers, 0.5)) == []
    assert worker.failures == 3 and worker.last_error == "health probe failed"
    assert worker.retry_at_s == clock[0] + backoff_s(3)


def test_an_idle_worker_whose_agent_is_busy_leaves_matching_until_it_is_not() -> None:
    """A worker this dispatcher has sent nothing for ``idle_probe_s``, whose agent says a batch
    is under way: a dispatcher before a restart or a failover sent it a slow one, and a batch
    sent now would wait behind it and time out. It had been taken as alive and kept in
    matching; it leaves now (reported as a loss), busy, and is back once its agent is not."""
    clock = [100.0]
    transport = _Answers(WorkerBusy(1, 40.0), True)
    health = Health("demo", transport, DispatcherSettings(), lambda: clock[0])  # type: ignore[arg-type]
    worker = Worker(WorkerEndpoint("i-1", "emu.cpu.large", "w:1"), 0.0)
    worker.checked_s = 0.0
    workers = {"i-1": worker}
    assert asyncio.run(health.probe_idle(workers, clock[0])) == [worker]
    assert not worker.healthy and worker.agent_busy and worker.failures == 1
    assert worker.last_error == "busy: 1 batch(es) under way, the oldest for 40.0 s"
    clock[0] = worker.retry_at_s
    assert health.due(workers, clock[0]) == [worker]
    assert asyncio.run(health.recover([worker], workers, 0.5)) == [worker]
    assert worker.healthy and worker.last_error == ""


@pytest.mark.parametrize(
    ("body", "busy"),
    [
        ({"ready": True}, None),  # a server that does not say
        ({"ready": True, "busy": False, "in_flight": 0, "busy_s": 0.0}, None),
        ({"ready": True, "busy": True, "in_flight": 2, "busy_s": 3.5}, WorkerBusy(2, 3.5)),
        ({"busy": True}, WorkerBusy(1, 0.0)),
        ({"busy": True, "in_flight": "2", "busy_s": float("nan")}, WorkerBusy(1, 0.0)),
        ({"busy": True, "in_flight": True, "busy_s": -1}, WorkerBusy(1, 0.0)),
        ({"busy": True, "busy_s": 3.0, "busy_timeout_s": 2.5}, WorkerBusy(1, 3.0, 2.5)),
        ({"busy": True, "busy_timeout_s": None}, WorkerBusy(1, 0.0)),
        ({"busy": True, "busy_timeout_s": float("inf")}, WorkerBusy(1, 0.0)),
        ({"busy": True, "busy_timeout_s": 0}, WorkerBusy(1, 0.0)),
        ({"busy": True, "busy_timeout_s": True}, WorkerBusy(1, 0.0)),
        ({"busy": "yes"}, None),
        ([], None),
    ],
)
def test_a_ready_answer_says_busy_only_with_the_agents_busy_true(
    body: object, busy: WorkerBusy | None
) -> None:
    assert busy_of(body) == busy


def test_a_worker_back_once_its_agent_is_no_longer_busy_is_not_slow() -> None:
    """A worker out after a slow query (``slow``: a timeout there was not the next batch's)
    whose agent said busy, then ready and not busy, is back with its slow batch over: a
    timeout there now is the new batch's, probed (a slow query answered 504 after one
    worker), not read as a worker's failure that takes the next worker out too. One back
    without ever having said busy (a server that does not say) stays ``slow``, as before."""
    clock = [100.0]
    transport = _Answers(WorkerBusy(1, 2.0), True, True)
    health = Health("demo", transport, DispatcherSettings(), lambda: clock[0])  # type: ignore[arg-type]
    worker = Worker(WorkerEndpoint("i-1", "emu.cpu.large", "w:1"), 0.0)
    workers = {"i-1": worker}
    worker.slow = True
    worker.fail(clock[0], "no answer within 1000 ms")
    clock[0] = worker.retry_at_s
    assert asyncio.run(health.recover([worker], workers, 0.5)) == []
    assert worker.slow and worker.agent_busy
    clock[0] = worker.retry_at_s
    assert asyncio.run(health.recover([worker], workers, 0.5)) == [worker]
    assert worker.healthy and not worker.slow
    worker.slow = True
    worker.fail(clock[0], "no answer within 1000 ms")
    clock[0] = worker.retry_at_s
    assert asyncio.run(health.recover([worker], workers, 0.5)) == [worker]
    assert worker.slow


def test_refusals_within_the_share_the_slo_allows_are_no_overload() -> None:
    """Any refusal in the window marked a model overloaded: at 11 qps on two instances of 10
    (Poisson, 59% busy) admission refused a query now and then (2 of 4,677 in 7 min), and the
    INFaaS scaler replicated the model on each, to drain it again. Refusals count once they are
    more than the share of the window's samples the SLO lets it miss (1% for a P99)."""
    tracker = StateTracker(window_s=10.0)
    for i in range(110):  # 11 samples/s for 10 s on a model serving 20
        tracker.arrived("large", 100.0 + i / 11.0, 1)
    tracker.refused("large", 109.5, samples=1, capacity_sps=20.0)
    noise = tracker.overload("large", 110.0, 0, 20.0, 300.0, refused_share_allowed=0.01)
    assert (noise.refused, noise.refused_samples, noise.arrived_samples) == (1, 1.0, 111.0)
    assert not noise.overloaded and noise.reasons() == []
    # Without an allowance (a P100 SLO, or a sender that does not say), as before: overloaded.
    assert tracker.overload("large", 110.0, 0, 20.0, 300.0).overloaded
    for t in (109.6, 109.7):
        tracker.refused("large", t, samples=1, capacity_sps=20.0)
    short = tracker.overload("large", 110.0, 0, 20.0, 300.0, refused_share_allowed=0.01)
    assert short.overloaded  # 3 of 113 samples: 2.65% > 1%
    assert short.reasons() == [
        "3 queries refused (429) in the last 10 s, 2.65% of the samples that arrived > the"
        " 1.00% the SLO allows"
    ]
    assert short.numbers()["refused_samples"] == 3.0
    # At a larger capacity (an instance joined) the refusals judged at the smaller say nothing.
    assert not tracker.overload("large", 110.0, 0, 30.0, 300.0, 0.01).overloaded


def test_one_refusal_in_a_window_the_share_allows_under_a_sample_is_no_overload() -> None:
    """Under 100 samples a window (a model under 10 samples/s at a P99) one refusal was over
    the 1% share, and the INFaaS scaler replicated the model on each such refusal; one refusal
    there is what the allowed rate gives now and then, two are an overload."""
    tracker = StateTracker(window_s=10.0)
    for i in range(60):  # 6 samples/s for 10 s
        tracker.arrived("large", 100.0 + i / 6.0, 1)
    tracker.refused("large", 109.5, samples=1, capacity_sps=20.0)
    one = tracker.overload("large", 110.0, 0, 20.0, 300.0, refused_share_allowed=0.01)
    assert one.refused == 1 and not one.overloaded and one.reasons() == []
    tracker.refused("large", 109.8, samples=1, capacity_sps=20.0)
    two = tracker.overload("large", 110.0, 0, 20.0, 300.0, refused_share_allowed=0.01)
    assert two.refused == 2 and two.overloaded
    # With 300 samples a window the share allows three: the fourth refused sample is over it.
    busy = StateTracker(window_s=10.0)
    for i in range(300):
        busy.arrived("large", 100.0 + i / 30.0, 1)
    for t in (109.1, 109.2, 109.3):
        busy.refused("large", t, samples=1, capacity_sps=40.0)
    assert not busy.overload("large", 110.0, 0, 40.0, 300.0, 0.01).overloaded  # 3 of 303
    busy.refused("large", 109.4, samples=1, capacity_sps=40.0)
    assert busy.overload("large", 110.0, 0, 40.0, 300.0, 0.01).overloaded  # 4 of 304
