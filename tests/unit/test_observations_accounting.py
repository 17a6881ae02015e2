"""The serving accounting (:mod:`controlplane.serving.observations`): every query the service was
offered ends in one outcome, errors are misses, percentiles are over the answered queries, and
the counters keep where the answered queries' time went and a histogram of every outcome's
latency."""

from __future__ import annotations

import doctest
import itertools
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.errors import (
    NoServingInstanceError,
    OverloadedError,
    QueryFailedError,
    QueryRejectedError,
    QueryTimeoutError,
    RequirementsUnmetError,
    ServingUnavailableError,
)
from controlplane.serving import observations
from controlplane.serving.observations import (
    LATENCY_BUCKETS_MS,
    Observations,
    Outcome,
    Split,
    account,
    outcome_of,
    summarise,
)

latencies = st.lists(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False), max_size=50
)
counts = st.integers(min_value=0, max_value=50)
slos = st.floats(min_value=1e-3, max_value=1e5, allow_nan=False, allow_infinity=False)


def test_the_modules_doctests_pass() -> None:
    assert doctest.testmod(observations).failed == 0


def test_errors_are_misses_and_percentiles_are_over_the_answered() -> None:
    a = account([10.0, 20.0, 30.0, 400.0], 100.0, refused=2, timed_out=1, failed=1)
    assert (a.answered, a.within, a.errors, a.offered) == (4, 3, 4, 8)
    assert a.attainment_share == 3 / 8 and a.answered_share == 0.5
    assert a.latency_p50_ms == 25.0 and a.latency_p99_ms == pytest.approx(388.9)
    # Nothing answered: attainment 0, no percentiles; nothing offered: nothing known.
    none = account([], 100.0, refused=5)
    assert (none.attainment_share, none.latency_p99_ms) == (0.0, None)
    assert account([], 100.0).attainment_share is None


def test_at_the_slo_is_within_and_bad_arguments_are_refused() -> None:
    assert account([100.0], 100.0).within == 1
    with pytest.raises(ValueError, match="slo_ms"):
        account([1.0], float("nan"))
    with pytest.raises(ValueError, match="slo_ms"):
        account([1.0], 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        account([1.0], 100.0, failed=-1)


@given(latencies, slos, counts, counts, counts)
def test_attainment_never_exceeds_the_answered_share(
    answered_ms: list[float], slo_ms: float, refused: int, timed_out: int, failed: int
) -> None:
    a = account(answered_ms, slo_ms, refused=refused, timed_out=timed_out, failed=failed)
    assert a.offered == len(answered_ms) + refused + timed_out + failed
    if a.offered == 0:
        assert a.attainment_share is None
        return
    assert a.attainment_share is not None and a.answered_share is not None
    assert 0.0 <= a.attainment_share <= a.answered_share <= 1.0
    assert a.within == sum(1 for x in answered_ms if x <= slo_ms)


@given(latencies, slos, st.sampled_from(["refused", "timed_out", "failed"]))
def test_an_error_never_counts_as_within(
    answered_ms: list[float], slo_ms: float, kind: str
) -> None:
    before = account(answered_ms, slo_ms)
    after = account(answered_ms, slo_ms, **{kind: 1})
    assert after.within == before.within  # however fast the error came back
    assert after.offered == before.offered + 1
    assert after.attainment_share is not None
    if before.attainment_share is not None:
        assert after.attainment_share <= before.attainment_share
        if before.within:
            assert after.attainment_share < before.attainment_share
    # Percentiles do not move: an error has no latency to the answer.
    assert after.latency_p99_ms == before.latency_p99_ms


def test_each_error_maps_to_the_outcome_of_its_http_status() -> None:
    assert outcome_of(OverloadedError("a", 500.0, 100.0, 1)) is Outcome.REFUSED  # 429
    assert outcome_of(NoServingInstanceError("a", "m")) is Outcome.REFUSED  # 503
    assert outcome_of(ServingUnavailableError("a", "stopping")) is Outcome.REFUSED  # 503
    assert outcome_of(QueryTimeoutError("a", 30.0)) is Outcome.TIMED_OUT  # 504
    assert outcome_of(QueryFailedError("a", "boom", 3)) is Outcome.FAILED  # 502
    # The client's own mistakes (422) are not offered: no outcome.
    assert outcome_of(RequirementsUnmetError("a", "no", "tiny")) is None
    assert outcome_of(QueryRejectedError("a", "token id 99 outside the vocabulary")) is None


def test_a_window_and_the_totals_count_every_outcome() -> None:
    seen = Observations()
    for t in range(6):
        seen.arrival("demo", float(t))
    seen.answered("demo", 1.0, 40.0, late=False, models=["m"], split=Split(10.0, 5.0, 25.0))
    seen.answered("demo", 2.0, 140.0, late=True, models=["m"], split=Split(100.0, 5.0, 35.0))
    seen.refused("demo", 3.0, 2.0)
    seen.timed_out("demo", 4.0, 30_000.0)
    seen.failed("demo", 5.0, 700.0)
    seen.ended_in_error("demo", 5.0, Outcome.REFUSED, 1.0)
    with pytest.raises(ValueError, match="answered"):
        seen.ended_in_error("demo", 5.0, Outcome.ANSWERED, 1.0)
    window = seen.take_window("demo", 10.0, slo_ms=100.0)
    assert window is not None
    assert (window.answered, window.refused, window.timed_out, window.failed) == (2, 2, 1, 1)
    assert window.attainment_share == pytest.approx(1 / 6)
    assert window.latency_p50_ms == 90.0  # over the two answered only
    nothing = seen.take_window("demo", 20.0, slo_ms=100.0)
    assert nothing is not None and nothing.attainment_share is None and nothing.errors == 0

    totals = seen.totals()["demo"]
    assert (totals.answered, totals.within, totals.late) == (2, 1, 1)
    assert (totals.refused, totals.timed_out, totals.failed, totals.offered) == (2, 1, 1, 6)
    assert totals.attainment_share == pytest.approx(1 / 6)
    assert totals.latency_sum_ms == {
        "api": 0.0,
        "queue": 110.0,
        "transport": 10.0,
        "compute": 60.0,
        "total": 180.0,
    }
    assert totals.mean_ms("total") == 90.0 and totals.mean_ms("queue") == 55.0
    with pytest.raises(ValueError, match="stage"):
        totals.mean_ms("network")
    buckets = totals.latency_buckets
    assert set(buckets) == {"answered", "refused", "timed_out", "failed"}
    assert all(len(c) == len(LATENCY_BUCKETS_MS) + 1 for c in buckets.values())
    assert sum(buckets["answered"]) == 2 and sum(buckets["refused"]) == 2
    # 40 ms falls in the (25, 50] bucket, 30 s on the 30 s bound (le is inclusive).
    assert buckets["answered"][LATENCY_BUCKETS_MS.index(50.0)] == 1
    assert buckets["timed_out"][LATENCY_BUCKETS_MS.index(30_000.0)] == 1
    assert totals.latency_outcome_sum_ms["refused"] == 3.0


def answer_at(seen: Observations, app: str, rate: int, start_s: int, end_s: int) -> None:
    """Queries of ``app`` answered at ``rate`` a second from ``start_s`` to ``end_s``, each
    query's own time its answer time (ms)."""
    for i in range(start_s * rate, end_s * rate):
        t = i / rate
        seen.answered(app, t, 1.0, late=False, models=["m"], split=Split(api_ms=t * 1000.0))


def test_the_api_times_kept_span_a_minute_at_a_high_rate_and_every_query_at_a_low_one() -> None:
    kept = observations.API_TIMES_KEPT
    span_s = observations.API_TIMES_SPAN_S
    seen = Observations()
    # 100 s at 2,000 answered queries a second, each query's own time its arrival time (ms):
    # the newest API_TIMES_KEPT would be the last half-second's.
    rate = 2000
    answer_at(seen, "busy", rate, 0, 100)
    times = seen.api_times_ms("busy")
    assert len(times) == kept
    spans_evenly(times, newest=100_000.0, span=span_s * 1000.0)
    # At 5 q/s every answered query is kept: the newest API_TIMES_KEPT, over 205 s.
    answer_at(seen, "calm", 5, 0, 400)
    expected = [i * 200.0 for i in range(2000 - kept, 2000)]  # query i at i / 5 s
    assert seen.api_times_ms("calm") == pytest.approx(expected)
    # Forgotten (a profile run beside them), the fresh ones span the minute again at once.
    seen.forget_api_times("busy")
    assert seen.api_times_ms("busy") == []
    answer_at(seen, "busy", rate, 100, 110)
    assert len(seen.api_times_ms("busy")) <= kept * 10 / span_s * 1.1


def test_the_batch_times_kept_span_a_minute_and_a_recalibration_keeps_their_rate() -> None:
    kept = observations.BATCH_TIMES_KEPT
    span_s = observations.BATCH_TIMES_SPAN_S
    seen = Observations()
    rate = 500  # worker calls a second, each call's time its end (ms)
    for i in range(90 * rate):
        t = i / rate
        seen.batch_served("app", "m", "cpu", 4, t * 1000.0, t)
    (times,) = seen.batch_times_ms("app")[("m", "cpu")].values()
    assert len(times) == kept
    spans_evenly(times, newest=90_000.0, span=span_s * 1000.0)
    # The calibration forgets them once it has stored a factor: the calls of the next
    # BATCH_EVIDENCE_S are held back until they span it, and then they are its share of a
    # minute's evidence, not 256 calls of the first half-second.
    seen.forget_batch_times("app", "m", "cpu")
    assert seen.batch_times_ms("app") == {}
    evidence_s = observations.BATCH_EVIDENCE_S
    t = 90.0
    for i in range(int(90 * rate), int((90 + evidence_s + 1) * rate)):
        t = i / rate
        seen.batch_served("app", "m", "cpu", 4, t * 1000.0, t)
        if 91 < t < 90 + evidence_s * 0.9:  # listed, with no calls (a hold's forget drops it)
            assert seen.batch_times_ms("app") == {("m", "cpu"): {4: []}}, t
    (times,) = seen.batch_times_ms("app")[("m", "cpu")].values()
    assert len(times) <= kept * (evidence_s + 1) / span_s * 1.1
    assert times[-1] - times[0] >= evidence_s * 1000.0
    # Without a time (a caller that does not say when), every call is kept.
    for i in range(10):
        seen.batch_served("app", "m", "gpu", 1, float(i))
    assert seen.batch_times_ms("app")[("m", "gpu")] == {1: [float(i) for i in range(10)]}


def test_a_fresh_stream_and_a_surge_after_a_lull_are_thinned_from_their_first_values() -> None:
    """The rate that sets how many are kept is read from a stream's first values when they come
    faster than one a second: neither a new batch size's first second nor a surge's is kept
    whole, to outweigh the minute after it."""
    kept = observations.API_TIMES_KEPT
    first = observations.RATE_FIRST_VALUES
    seen = Observations()
    rate = 2000
    # 10 s at 2,000 q/s from the first query: of the first second, a few dozen kept, not 1,000.
    answer_at(seen, "app", rate, 0, 10)
    times = seen.api_times_ms("app")
    in_first_second = sum(1 for ms in times if ms < 1000.0)
    assert in_first_second <= 2 * first + rate / -(-rate * 60 // kept)
    # Then a minute without a query, and 2,000 q/s again for 10 s: the surge's first second
    # is not most of what is kept.
    answer_at(seen, "app", rate, 70, 80)
    times = seen.api_times_ms("app")
    surge_first_second = sum(1 for ms in times if 70_000.0 <= ms < 71_000.0)
    assert surge_first_second <= 2 * first + rate / -(-rate * 60 // kept)
    assert len(times) < kept  # two 10 s stretches of a minute's span
    # A batch size that starts at 500 calls a second: its first 10 s are read, thinned alike.
    for i in range(11 * 500):
        t = i / 500
        seen.batch_served("app", "m", "cpu", 1, t * 1000.0, t)
    (calls,) = seen.batch_times_ms("app")[("m", "cpu")].values()
    assert 0 < sum(1 for ms in calls if ms < 1000.0) <= 2 * first + 500 / -(-500 * 60 // 256)


def spans_evenly(times: list[float], newest: float, span: float) -> None:
    """``times`` (ms, oldest first) end at ``newest`` and span ``span`` (up to a tenth more),
    kept at even gaps (within a factor of two)."""
    assert times[-1] >= newest - 100.0  # the newest are kept
    assert span <= times[-1] - times[0] <= span * 1.1
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= 2 * min(gaps)


def test_an_answer_without_a_split_counts_its_time_as_queueing() -> None:
    seen = Observations()
    seen.answered("demo", 1.0, 12.0, late=False, models=["m"])
    totals = seen.totals()["demo"]
    assert totals.mean_ms("queue") == 12.0 and totals.mean_ms("compute") == 0.0


def test_summarise_takes_the_errors_of_a_window() -> None:
    failing = summarise([], 100.0, arrivals=4, elapsed_s=2.0, refused=3, failed=1)
    assert (failing.attainment_share, failing.latency_p99_ms, failing.offered) == (0.0, None, 4)
    assert failing.arrival_rate_qps == 2.0


def test_the_cpu_meter_takes_the_least_idle_share_off_and_keeps_a_minute() -> None:
    """CPU per answered query over the newest windows with answers, less the least share of a
    core any idle window used; none before CPU_MIN_QUERIES answers; no idle window seen: all
    the CPU counts; a window spans CPU_WINDOW_S of the caller's clock."""
    from controlplane.serving.observations import (
        CPU_MIN_QUERIES,
        CPU_WINDOW_S,
        CPU_WINDOWS_KEPT,
        CpuMeter,
    )

    cpu = [0.0]
    meter = CpuMeter(lambda: cpu[0])
    now = 0.0

    def window(queries: int, cpu_s: float) -> float | None:
        nonlocal now
        for i in range(queries):
            meter.answered(now + i * CPU_WINDOW_S / (queries + 1))
        now += CPU_WINDOW_S
        cpu[0] += cpu_s
        return meter.per_query_ms(now)

    assert meter.per_query_ms(now) is None  # the first window starts
    assert window(CPU_MIN_QUERIES - 1, 0.2) is None  # too few answers yet
    # No idle window seen: 0.2 + 0.2 s over 2 * 199 queries.
    assert window(CPU_MIN_QUERIES - 1, 0.2) == pytest.approx(400.0 / (2 * (CPU_MIN_QUERIES - 1)))
    assert window(0, 0.10) is not None  # idle: 2% of a core
    assert window(0, 0.05) is not None  # idle: 1%, the least
    # Then a busy minute: 300 queries at 0.5 ms over the 1% idle share, in every kept window.
    for _ in range(CPU_WINDOWS_KEPT):
        figure = window(300, 0.01 * CPU_WINDOW_S + 300 * 0.0005)
    assert figure == pytest.approx(0.5)


def _burn_cpu(seconds: float) -> None:
    """Spin until the calling thread has used ``seconds`` of CPU."""
    until_s = time.thread_time() + seconds
    while time.thread_time() < until_s:
        pass


def test_the_serving_cpu_counts_the_threads_that_answer_not_a_profile_run_beside_them() -> None:
    """The figure is the serving path's CPU per answered query: a profile run timing batches in
    worker threads of the same process (it took every app's figure from 2.3 to 16.6 ms) does
    not count; the thread that records the answers does, read from any thread."""
    from controlplane.serving.observations import CPU_WINDOW_S

    seen = Observations()
    assert seen.serving_cpu_ms("a", 0.0) is None  # the first window starts
    serving_done, read = threading.Event(), threading.Event()

    def serve() -> None:  # the event loop: 300 answers and 0.3 s of CPU for them
        for i in range(300):
            seen.answered("a", 1.0 + i / 100, 10.0, late=False, models=["m"])
        _burn_cpu(0.3)
        serving_done.set()
        read.wait()  # alive until the meter has read it, as the event loop is

    server = threading.Thread(target=serve)
    profile_run = threading.Thread(target=_burn_cpu, args=(0.6,))  # another thread's work
    server.start()
    profile_run.start()
    profile_run.join()
    serving_done.wait()
    figure = seen.serving_cpu_ms("a", CPU_WINDOW_S + 1.0)
    read.set()
    server.join()
    assert figure is not None
    # The server's 0.3 s over 300 answers (1 ms) and its bookkeeping; not the other 0.6 s,
    # which made it 3 ms a query.
    assert 0.9 < figure < 1.9
