"""What the serving loop measures, per app, for the tuner, the roll-up and ``/metrics``.

A query's **latency** runs from the moment the API received the request (stamped by the infer
route's middleware before any await or thread-pool hop: body parsing, the token check, admission,
the dispatch queues, transport, the worker's compute and retries all count) to the moment its
outcome is produced (the last point the service sees: the answer or the error). Every query the
service was offered ends in one :class:`Outcome`: answered (within or over the SLO), refused
(429 overloaded, 503 no serving instance or serving unavailable), timed out (504) or failed
(502). Refused, timed-out and failed queries are **misses**: they count in the attainment's
denominator and never in its numerator (:func:`account`).

- **Arrivals** (:meth:`Observations.arrival_s`): the arrival time of every query (admitted or
  refused: the tuner scales for the demand, not for what was let in), in a ring buffer of the
  last :data:`ARRIVALS_KEPT`, on the serving loop's monotonic clock. They are what InferLine's
  tuner compares with the planning envelope (``controlplane.policies.tuner.tune(arrival_s, now_s,
  ...)``: the live arrival envelope over windows up to 60 s) and what a gear switcher's measured QPS
  comes from (:meth:`Observations.rate_qps`).
- **Windows** (:meth:`Observations.take_window`): latency and SLO attainment of the queries that
  ended since the last call (the roll-up job calls it once per run, every ``rollup_s``, 10 s by
  default, and writes one metric sample per app from it: :func:`summarise`).
- **Counters** (:meth:`Observations.totals`): queries by outcome, late ones, the samples each
  model answered, where the answered queries' time went (:class:`Split`: queue, transport,
  compute) and a histogram of every query's end-to-end latency by outcome, since the service
  started (``/metrics``, ``GET /v1/apps/{app}/serving``).
- **API times** (:meth:`Observations.api_times_ms`): the API's part of the newest answered
  queries (receipt to submit), whose median and quantiles the calibration loop stores as the
  app's control-plane overhead per query; at a high rate one query in every few, so that they
  span at least a minute (:data:`API_TIMES_SPAN_S`).
- **The serving process's CPU per query** (:meth:`Observations.serving_cpu_ms`, a
  :class:`CpuMeter`): the CPU time of the threads that serve (:class:`ServingThreadsCpu`: each
  thread that records an answer, the event loop's, which runs uvicorn's parsing and writing, the
  inference fast path, the API's async routes, the dispatcher and the transport) per answered
  query, over the last minute's windows of :data:`CPU_WINDOW_S`, less their CPU when idle (the
  least share of a core they used in a window with no answer: timers, the channel to the
  loops). The other threads of the process are not the serving path and do not count: a
  profile run (``POST /v1/apps/{app}/profiles`` in a worker thread, and its timing threads),
  the loops and the scheduler's jobs, the store reads of the thread pools. A profile run of
  1,000 samples at batch sizes up to 4,096 had taken the figure of every app served beside it
  from 2.3 to 16.6 ms a query when it counted the whole process (:func:`time.process_time`).
  The planner takes the serving process as a queue of its own in front of the workers, serving
  each query in that time (:func:`controlplane.policies.planner.front_waits_ms`): the event
  loop is that one server. Process-wide: with several apps each is given the same figure.
- **Batch times** (:meth:`Observations.batch_times_ms`): each worker call's service time (the
  round trip as the dispatcher measures it, transport and compute, plus the instance's
  turnaround before it with work waiting) per (model, instance type, batch size), the last
  :data:`BATCH_TIMES_KEPT` per key, at a high rate one call in every few so that they span at
  least a minute (:data:`BATCH_TIMES_SPAN_S`), a batch size's only once they span
  :data:`BATCH_EVIDENCE_S` (no values until then): what the calibration loop compares with the
  profile in use
  (:mod:`controlplane.policies.calibration`).

The event loop writes; the roll-up job and the API's threads read: every method takes a lock.

>>> summary = summarise([10.0, 20.0, 30.0, 400.0], slo_ms=350.0, arrivals=4, elapsed_s=2.0)
>>> summary.arrival_rate_qps, summary.attainment_share
(2.0, 0.75)
>>> failing = summarise([10.0], slo_ms=350.0, arrivals=4, elapsed_s=2.0, refused=3)
>>> failing.attainment_share, failing.latency_p99_ms, failing.errors
(0.25, 10.0, 3)
"""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from controlplane.errors import (
    NoServingInstanceError,
    OverloadedError,
    QueryRejectedError,
    QueryTimeoutError,
    RequirementsUnmetError,
    ServingError,
    ServingUnavailableError,
)

__all__ = [
    "API_TIMES_SPAN_S",
    "ARRIVALS_KEPT",
    "BATCH_EVIDENCE_S",
    "BATCH_TIMES_KEPT",
    "BATCH_TIMES_SPAN_S",
    "CLIENT_ERRORS",
    "CPU_MIN_QUERIES",
    "CPU_WINDOW_S",
    "LATENCY_BUCKETS_MS",
    "MAX_WINDOW_LATENCIES",
    "Accounting",
    "AppTotals",
    "CpuMeter",
    "Observations",
    "Outcome",
    "ServingThreadsCpu",
    "SpannedSample",
    "Split",
    "WindowSummary",
    "account",
    "outcome_of",
    "summarise",
]

# 2^18 arrivals: the tuner's longest window (60 s) at more than 4,000 queries per second.
ARRIVALS_KEPT = 1 << 18
# Batch service times kept per (app, model, instance type, batch size): a few calibration windows
# (50 batches each by default) at every batch size ...
BATCH_TIMES_KEPT = 256
# ... of one call in every n, so that they span at least this long (SpannedSample): at 500
# calls a second the newest 256 are half a second's, and on a host the workers share the
# calibration stored factors of 2.35, 0.64, 0.61, 1.53 and 0.71 within 13 s of a steady load.
BATCH_TIMES_SPAN_S = 60.0
# A batch size's times reach the calibration once they span this long: its evidence is never
# the few calls of the last fraction of a second, whatever the rate.
BATCH_EVIDENCE_S = 10.0
# The API's part (receipt to submit) of the newest answered queries kept per app: the
# calibration loop's control-plane overhead is their median.
API_TIMES_KEPT = 1024
# ... of one query in every n, so that they span at least this long (SpannedSample): at 2,000
# q/s the newest 1,024 are half a second's, whose quantiles are that half-second's stalls (their
# p99 moved between 0.8 and 7.7 ms from one calibration tick to the next on a steady load, and
# each move was stored and re-sized the app).
API_TIMES_SPAN_S = 60.0
# The serving threads' CPU is read once per window of this many seconds (CpuMeter); the last
# CPU_WINDOWS_KEPT windows with answers give its CPU per query, once they hold CPU_MIN_QUERIES.
CPU_WINDOW_S = 5.0
CPU_WINDOWS_KEPT = 12
CPU_MIN_QUERIES = 200
# Latencies kept per window for its percentiles; past this, every other one is dropped (the
# percentiles of a window of 100 k queries move little by thinning).
MAX_WINDOW_LATENCIES = 100_000
# Upper bounds (ms) of the end-to-end latency histogram's buckets (``/metrics``), plus +Inf:
# from a fast answer on one machine to the give-up time, max(30 s, 20 x SLO).
LATENCY_BUCKETS_MS = (
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
    10_000.0,
    30_000.0,
    60_000.0,
)


class Outcome(StrEnum):
    """How a query the service was offered ended, as its client sees it."""

    ANSWERED = "answered"  # 200, within or over the SLO (``late``)
    REFUSED = "refused"  # 429 overloaded, 503 no serving instance or serving unavailable
    TIMED_OUT = "timed_out"  # 504: not answered within the give-up time
    FAILED = "failed"  # 502: every attempt failed (a refusal of the inputs is no outcome: 422)


# The client's own mistakes (422): the model refused the query's inputs, or no variant meets its
# requirements. Not offered, and no version's failure in a rollout's judgement (canary.py).
CLIENT_ERRORS = (QueryRejectedError, RequirementsUnmetError)


def outcome_of(error: ServingError) -> Outcome | None:
    """The outcome of a query that ended with ``error`` (the HTTP status it maps to); None for
    the client's own mistake (422: the model refused the query's inputs, or no variant meets
    its requirements), which is not counted as offered: a client sending bad token ids pulled
    the app's attainment down, in ``/metrics`` and on the dashboard, as if the service failed."""
    if isinstance(error, CLIENT_ERRORS):
        return None
    if isinstance(error, QueryTimeoutError):
        return Outcome.TIMED_OUT
    if isinstance(error, OverloadedError | NoServingInstanceError | ServingUnavailableError):
        return Outcome.REFUSED
    return Outcome.FAILED


@dataclass(frozen=True, slots=True)
class Split:
    """Where an answered query's time went (ms): ``api_ms`` the API's part before the serving
    loop (its receipt to the dispatcher's submit: body parsing, the token check, validation, the
    event loop's own queue), ``queue_ms`` everything else but its batches' round trips
    (admission, the stages' queues, the event loop), ``transport_ms`` the round trips less the
    workers' own service time, ``compute_ms`` the workers' service time (``served_ms``; the whole
    round trip when a worker does not say); ``lag_ms`` the part of ``queue_ms`` its dispatches
    waited on the event loop after being queued to a free instance (not the wait for a busy
    instance, nor the loop's turn after its answer, which a simulated queue models: that turn is
    the instance's, in its batch time). ``own_ms``, ``api_ms`` plus ``lag_ms``, is the service's
    own time per query that no worker profile or simulated queue covers: the calibration loop's
    overhead figure."""

    queue_ms: float = 0.0
    transport_ms: float = 0.0
    compute_ms: float = 0.0
    api_ms: float = 0.0
    lag_ms: float = 0.0

    @property
    def own_ms(self) -> float:
        return self.api_ms + self.lag_ms


@dataclass(frozen=True, slots=True)
class Accounting:
    """The outcomes of a set of queries against an SLO (:func:`account`)."""

    answered: int
    within: int
    refused: int
    timed_out: int
    failed: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None

    @property
    def errors(self) -> int:
        return self.refused + self.timed_out + self.failed

    @property
    def offered(self) -> int:
        return self.answered + self.errors

    @property
    def attainment_share(self) -> float | None:
        """Answered within the SLO over every query offered (None when none was)."""
        return self.within / self.offered if self.offered else None

    @property
    def answered_share(self) -> float | None:
        return self.answered / self.offered if self.offered else None


def account(
    latencies_ms: Sequence[float],
    slo_ms: float,
    *,
    refused: int = 0,
    timed_out: int = 0,
    failed: int = 0,
) -> Accounting:
    """The accounting of the answered queries' end-to-end ``latencies_ms`` and the counts of the
    queries that ended in an error, against ``slo_ms``.

    With A the answered latencies and E = refused + timed_out + failed, the attainment is
    ``|{a in A : a <= slo_ms}| / (|A| + E)``: an error is a miss, never within, so the attainment
    is at most the answered share ``|A| / (|A| + E)``. Percentiles (linear interpolation) are
    over A only: an error has no latency to the answer (None when nothing was answered).

    >>> a = account([10.0, 20.0, 500.0], slo_ms=100.0, refused=1)
    >>> a.within, a.offered, a.attainment_share, a.answered_share
    (2, 4, 0.5, 0.75)
    >>> account([], 100.0, failed=2).attainment_share
    0.0
    """
    if not slo_ms > 0 or math.isinf(slo_ms):
        raise ValueError(f"slo_ms must be finite and > 0, got {slo_ms!r}")
    if min(refused, timed_out, failed) < 0:
        raise ValueError("error counts must be >= 0")
    if not latencies_ms:
        return Accounting(0, 0, refused, timed_out, failed, None, None, None)
    values = np.asarray(latencies_ms, dtype=np.float64)
    p50, p95, p99 = (float(v) for v in np.percentile(values, [50, 95, 99]))
    within = int(np.count_nonzero(values <= slo_ms))
    return Accounting(int(values.size), within, refused, timed_out, failed, p50, p95, p99)


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """One window of an app's serving: arrival rate; latency percentiles of the queries answered
    in it (None when none was); SLO attainment of every query that ended in it, answered within
    the SLO over all of them, errors included (None when none ended); their accuracy on the
    validation samples they carried (None when none carried one); the gear in force at its end;
    and the queries that ended in an error, by outcome."""

    arrival_rate_qps: float
    answered: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    attainment_share: float | None
    accuracy: float | None = None
    gear: str | None = None
    refused: int = 0
    timed_out: int = 0
    failed: int = 0

    @property
    def errors(self) -> int:
        return self.refused + self.timed_out + self.failed

    @property
    def offered(self) -> int:
        return self.answered + self.errors


_STAGES = ("api", "queue", "transport", "compute", "total")


@dataclass(frozen=True, slots=True)
class AppTotals:
    """An app's counters since the service started: queries by outcome (``late`` of the
    answered ones), samples answered by model, the answered queries' summed time by stage
    (``latency_sum_ms``: api, queue, transport, compute and total) and every query's end-to-end
    latency by outcome as histogram counts over :data:`LATENCY_BUCKETS_MS` plus +Inf
    (``latency_buckets``, not cumulative) with their sums (``latency_outcome_sum_ms``)."""

    arrived: int = 0
    answered: int = 0
    late: int = 0
    failed: int = 0
    refused: int = 0
    timed_out: int = 0
    # 422 after arrival (the model refused the query's own inputs): the client's mistake, in no
    # outcome and not offered; arrived = offered + rejected + those in flight.
    rejected: int = 0
    samples_by_model: dict[str, int] = field(default_factory=dict)
    latency_sum_ms: dict[str, float] = field(default_factory=dict)
    latency_buckets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    latency_outcome_sum_ms: dict[str, float] = field(default_factory=dict)

    @property
    def within(self) -> int:
        return self.answered - self.late

    @property
    def errors(self) -> int:
        return self.refused + self.timed_out + self.failed

    @property
    def offered(self) -> int:
        return self.answered + self.errors

    @property
    def attainment_share(self) -> float | None:
        """Answered within the SLO over every query that ended (None before the first)."""
        return self.within / self.offered if self.offered else None

    def mean_ms(self, stage: str) -> float | None:
        """The answered queries' mean time in ``stage`` (api, queue, transport, compute,
        total)."""
        if stage not in _STAGES:
            raise ValueError(f"stage must be one of {_STAGES}, got {stage!r}")
        return self.latency_sum_ms.get(stage, 0.0) / self.answered if self.answered else None


def summarise(
    latencies_ms: Sequence[float],
    slo_ms: float,
    arrivals: int,
    elapsed_s: float,
    *,
    correct: int = 0,
    labelled: int = 0,
    gear: str | None = None,
    refused: int = 0,
    timed_out: int = 0,
    failed: int = 0,
) -> WindowSummary:
    """A window's summary: rate = arrivals / elapsed, the rest by :func:`account` (percentiles
    over the answered queries, attainment over every query that ended, errors as misses),
    accuracy = correct / labelled."""
    rate = arrivals / elapsed_s if elapsed_s > 0 else 0.0
    accuracy = correct / labelled if labelled else None
    a = account(latencies_ms, slo_ms, refused=refused, timed_out=timed_out, failed=failed)
    return WindowSummary(
        rate,
        a.answered,
        a.latency_p50_ms,
        a.latency_p95_ms,
        a.latency_p99_ms,
        a.attainment_share,
        accuracy,
        gear,
        refused,
        timed_out,
        failed,
    )


# SpannedSample sets its rate from this many values when they come within a second.
RATE_FIRST_VALUES = 8


class SpannedSample:
    """The newest ``kept`` values of a stream, taking one in every n, n set from the stream's rate
    (once a second, or from its first :data:`RATE_FIRST_VALUES` values where those come faster)
    so that the kept values span at least ``span_s`` (every value at a rate where
    they would anyway; every value also when :meth:`add` is given no time). A calibration's
    evidence is then the last minute's, not the last half-second's at a high rate.
    ``evidence_s``: the time from the first value kept since the start or the last
    :meth:`forget` to the newest (None where values came without a time)."""

    __slots__ = ("count", "every", "first_s", "last_s", "since_s", "skipped", "span_s", "values")

    def __init__(self, kept: int, span_s: float) -> None:
        self.values: deque[float] = deque(maxlen=kept)
        self.span_s = span_s
        self.every = 1  # one value in every this many is kept
        self.skipped = 0  # values passed since the last one kept
        self.count = 0  # values since since_s, which sets every once a second
        self.since_s: float | None = None
        self.first_s: float | None = None  # the first value kept since the start or a forget
        self.last_s: float | None = None  # the newest value kept

    @property
    def evidence_s(self) -> float | None:
        if self.first_s is None or self.last_s is None:
            return None
        return self.last_s - self.first_s

    def add(self, value: float, now_s: float | None = None) -> None:
        if now_s is not None:
            if self.since_s is None:
                self.since_s = now_s
            self.count += 1
            elapsed_s = now_s - self.since_s
            # Once a second, and at the first few values of a fresh stream or a surge after a
            # lull (else a second of them would all be kept: 1,000 of 1,024 at 2,000 q/s).
            if elapsed_s >= 1.0 or (self.count >= RATE_FIRST_VALUES and elapsed_s > 0):
                rate = self.count / elapsed_s
                kept = self.values.maxlen or 1
                self.every = max(1, math.ceil(rate * self.span_s / kept))
                self.count, self.since_s = 0, now_s
        self.skipped += 1
        if self.skipped >= self.every:
            self.skipped = 0
            self.values.append(value)
            if now_s is not None:
                if self.first_s is None:
                    self.first_s = now_s
                self.last_s = now_s

    def forget(self) -> None:
        """Drop the kept values (the rate stays: fresh evidence spans the same time again)."""
        self.values.clear()
        self.skipped = 0
        self.first_s = self.last_s = None


class _App:
    __slots__ = (
        "answered",
        "arrivals",
        "arrived",
        "buckets",
        "correct",
        "failed",
        "head",
        "labelled",
        "late",
        "latencies",
        "outcome_sum_ms",
        "own_ms",
        "refused",
        "rejected",
        "samples_by_model",
        "size",
        "stage_sum_ms",
        "timed_out",
        "window_arrivals",
        "window_errors",
        "window_since_s",
    )

    def __init__(self, now_s: float, api_span_s: float = API_TIMES_SPAN_S) -> None:
        self.arrivals = np.empty(ARRIVALS_KEPT, dtype=np.float64)
        self.head = 0  # next slot to write
        self.size = 0
        self.arrived = 0
        self.answered = 0
        self.late = 0
        self.failed = 0
        self.refused = 0
        self.rejected = 0
        self.timed_out = 0
        self.samples_by_model: Counter[str] = Counter()
        # api, queue, transport, compute, total (ms) summed over the answered queries
        self.stage_sum_ms = [0.0, 0.0, 0.0, 0.0, 0.0]
        # the newest answered queries' own time, Split.own_ms (the calibration loop's overhead)
        self.own_ms = SpannedSample(API_TIMES_KEPT, api_span_s)
        self.buckets: dict[Outcome, list[int]] = {}
        self.outcome_sum_ms: dict[Outcome, float] = {}
        self.window_since_s = now_s
        self.window_arrivals = 0
        self.window_errors: Counter[Outcome] = Counter()
        self.latencies: list[float] = []
        self.correct = 0
        self.labelled = 0

    def ended(self, outcome: Outcome, latency_ms: float) -> None:
        counts = self.buckets.get(outcome)
        if counts is None:
            counts = self.buckets[outcome] = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        counts[bisect.bisect_left(LATENCY_BUCKETS_MS, latency_ms)] += 1
        self.outcome_sum_ms[outcome] = self.outcome_sum_ms.get(outcome, 0.0) + latency_ms


class ServingThreadsCpu:
    """The CPU seconds the threads that serve have used since each was added (:meth:`add`, on
    the thread: the meter adds the thread that records each answer), read from any thread
    through each one's CPU clock (:func:`time.pthread_getcpuclockid`). A thread that ended
    keeps what it had used at its last reading. Where the platform has no per-thread clock
    (not Linux or another Unix), the process's CPU (:func:`time.process_time`) is read
    instead, every thread. Not thread-safe: :class:`CpuMeter`'s caller holds a lock.

    >>> threads = ServingThreadsCpu()
    >>> threads.add()
    >>> threads.cpu_s() >= 0.0
    True
    """

    __slots__ = ("_clocks", "_ended_s")

    def __init__(self) -> None:
        # thread ident -> (its CPU clock, the clock's reading when added, its last reading)
        self._clocks: dict[int, tuple[int, float, float]] = {}
        self._ended_s = 0.0  # what the threads that ended had used

    def add(self) -> None:
        """Count the calling thread's CPU from now on (again a no-op once it is counted)."""
        # Called for every answer: the ident (pthread_self) costs no system call, where the
        # native id is one.
        ident = threading.get_ident()
        if ident in self._clocks or not _THREAD_CLOCKS:
            return
        clock = time.pthread_getcpuclockid(ident)
        now_s = time.clock_gettime(clock)
        self._clocks[ident] = (clock, now_s, now_s)

    def cpu_s(self) -> float:
        """CPU seconds of the added threads since each was added."""
        if not _THREAD_CLOCKS:
            return time.process_time()
        total = self._ended_s
        for ident, (clock, since_s, last_s) in list(self._clocks.items()):
            try:
                now_s = time.clock_gettime(clock)
            except OSError:  # the thread ended: its clock is gone
                now_s = -1.0
            if now_s < last_s:  # gone, or its id taken by a new thread
                self._ended_s += last_s - since_s
                total += last_s - since_s
                del self._clocks[ident]
                continue
            self._clocks[ident] = (clock, since_s, now_s)
            total += now_s - since_s
        return total


# Per-thread CPU clocks (Linux and most Unixes; not macOS or Windows).
_THREAD_CLOCKS = hasattr(time, "pthread_getcpuclockid")


class CpuMeter:
    """The serving threads' CPU time per answered query, their idle share taken off (see the
    module docstring). ``cpu_s`` reads CPU seconds; by default (None) those of the threads that
    record the answers (:class:`ServingThreadsCpu`), so that a profile run or a loop in
    another thread of the process does not count. The windows follow the caller's clock. Not
    thread-safe: :class:`Observations` holds it under its lock.

    >>> cpu = [0.0]
    >>> meter = CpuMeter(lambda: cpu[0])
    >>> meter.per_query_ms(0.0) is None  # the first window starts
    True
    >>> cpu[0] = 0.05; meter.per_query_ms(5.0) is None  # 5 s idle: 1% of a core
    True
    >>> for i in range(300): meter.answered(5.0 + i / 100)
    >>> cpu[0] = 0.05 + 0.05 + 300 * 0.0004  # the idle share again, and 0.4 ms a query
    >>> round(meter.per_query_ms(10.0), 3)
    0.4
    """

    __slots__ = (
        "_cpu_s",
        "_idle_share",
        "_queries",
        "_since_cpu_s",
        "_since_s",
        "_threads",
        "_windows",
    )

    def __init__(self, cpu_s: Callable[[], float] | None = None) -> None:
        self._threads: ServingThreadsCpu | None = None
        if cpu_s is None:
            self._threads = ServingThreadsCpu()
            cpu_s = self._threads.cpu_s
        self._cpu_s = cpu_s
        self._since_s: float | None = None
        self._since_cpu_s = 0.0
        self._queries = 0
        # (seconds, CPU seconds, answered queries) of the newest windows with answers
        self._windows: deque[tuple[float, float, int]] = deque(maxlen=CPU_WINDOWS_KEPT)
        self._idle_share: float | None = None

    def answered(self, now_s: float) -> None:
        """One query answered at ``now_s``, on the calling thread (a serving thread)."""
        if self._threads is not None:
            self._threads.add()
        self._roll(now_s)
        self._queries += 1

    def per_query_ms(self, now_s: float) -> float | None:
        """CPU ms per answered query over the kept windows, less the idle share (none seen: 0);
        None before :data:`CPU_MIN_QUERIES` answers."""
        self._roll(now_s)
        queries = sum(n for _, _, n in self._windows)
        if queries < CPU_MIN_QUERIES:
            return None
        idle = self._idle_share or 0.0
        busy_s = sum(max(used_s - idle * span_s, 0.0) for span_s, used_s, _ in self._windows)
        return 1000.0 * busy_s / queries

    def _roll(self, now_s: float) -> None:
        if self._since_s is None:
            self._since_s, self._since_cpu_s = now_s, self._cpu_s()
            return
        span_s = now_s - self._since_s
        if span_s < CPU_WINDOW_S:
            return
        cpu_s = self._cpu_s()
        used_s = max(cpu_s - self._since_cpu_s, 0.0)
        if self._queries:
            self._windows.append((span_s, used_s, self._queries))
        else:
            share = used_s / span_s
            self._idle_share = share if self._idle_share is None else min(self._idle_share, share)
        self._since_s, self._since_cpu_s, self._queries = now_s, cpu_s, 0


class Observations:
    """Per-app arrivals, windows and counters (see the module docstring); ``cpu_s`` reads the
    serving threads' CPU seconds (:class:`CpuMeter`; None: the threads that record answers)."""

    def __init__(
        self,
        cpu_s: Callable[[], float] | None = None,
        *,
        span_s: float | None = None,
        batch_evidence_s: float = BATCH_EVIDENCE_S,
    ) -> None:
        self._cpu = CpuMeter(cpu_s)
        # the API times and batch times kept span this long (None: API_TIMES_SPAN_S and
        # BATCH_TIMES_SPAN_S; 0: every one kept), a batch size's are read once they span
        # batch_evidence_s (BATCH_EVIDENCE_S; 0: at once): tests of milliseconds take 0
        self._api_span_s = API_TIMES_SPAN_S if span_s is None else span_s
        self._batch_span_s = BATCH_TIMES_SPAN_S if span_s is None else span_s
        self._batch_evidence_s = batch_evidence_s
        self._lock = threading.Lock()
        self._apps: dict[str, _App] = {}
        # (app, model, instance type, batch size) -> the newest batch service times, ms
        self._batch_times: dict[tuple[str, str, str, int], SpannedSample] = {}

    def _app(self, app: str, now_s: float) -> _App:
        found = self._apps.get(app)
        if found is None:
            found = self._apps[app] = _App(now_s, self._api_span_s)
        return found

    # --- what the loop reports ----------------------------------------------------------------

    def arrival(self, app: str, now_s: float) -> None:
        with self._lock:
            entry = self._app(app, now_s)
            self._demand(entry, now_s)
            entry.arrived += 1
            entry.window_arrivals += 1

    def demand(self, app: str, now_s: float) -> None:
        """A query of ``app`` that another dispatcher answered (a rollout's new version, whose
        figures are its own): its arrival time joins :meth:`arrival_s`, the app's demand that
        the tuner, the gear switcher and the re-plan read, and nothing else of the app's."""
        with self._lock:
            self._demand(self._app(app, now_s), now_s)

    @staticmethod
    def _demand(entry: _App, now_s: float) -> None:
        entry.arrivals[entry.head] = now_s
        entry.head = (entry.head + 1) % ARRIVALS_KEPT
        entry.size = min(entry.size + 1, ARRIVALS_KEPT)

    def answered(
        self,
        app: str,
        now_s: float,
        latency_ms: float,
        *,
        late: bool,
        models: Iterable[str],
        correct: int = 0,
        labelled: int = 0,
        split: Split | None = None,
    ) -> None:
        """An answered query: ``latency_ms`` end to end (from the API's receipt), ``split``
        where it went (None: all of it counted as queueing)."""
        with self._lock:
            self._cpu.answered(now_s)
            entry = self._app(app, now_s)
            entry.answered += 1
            entry.late += int(late)
            entry.samples_by_model.update(models)
            entry.correct += correct
            entry.labelled += labelled
            sums = entry.stage_sum_ms
            if split is None:
                sums[1] += latency_ms
            else:
                sums[0] += split.api_ms
                sums[1] += split.queue_ms
                sums[2] += split.transport_ms
                sums[3] += split.compute_ms
                entry.own_ms.add(split.own_ms, now_s)
            sums[4] += latency_ms
            entry.ended(Outcome.ANSWERED, latency_ms)
            latencies = entry.latencies
            latencies.append(latency_ms)
            if len(latencies) > MAX_WINDOW_LATENCIES:
                del latencies[::2]

    def ended_in_error(self, app: str, now_s: float, outcome: Outcome, latency_ms: float) -> None:
        """A query that ended in an error (``outcome`` not answered), ``latency_ms`` after the
        API received it: a miss for the attainment."""
        if outcome is Outcome.ANSWERED:
            raise ValueError("an answered query is recorded with answered()")
        with self._lock:
            entry = self._app(app, now_s)
            if outcome is Outcome.REFUSED:
                entry.refused += 1
            elif outcome is Outcome.TIMED_OUT:
                entry.timed_out += 1
            else:
                entry.failed += 1
            entry.window_errors[outcome] += 1
            entry.ended(outcome, latency_ms)

    def failed(self, app: str, now_s: float, latency_ms: float = 0.0) -> None:
        self.ended_in_error(app, now_s, Outcome.FAILED, latency_ms)

    def refused(self, app: str, now_s: float, latency_ms: float = 0.0) -> None:
        self.ended_in_error(app, now_s, Outcome.REFUSED, latency_ms)

    def timed_out(self, app: str, now_s: float, latency_ms: float = 0.0) -> None:
        self.ended_in_error(app, now_s, Outcome.TIMED_OUT, latency_ms)

    def rejected(self, app: str, now_s: float) -> None:
        """A query that arrived and was refused for its own inputs (422): counted apart, not
        offered (:func:`outcome_of` gives it no outcome)."""
        with self._lock:
            self._app(app, now_s).rejected += 1

    def batch_served(
        self,
        app: str,
        model: str,
        instance_type: str,
        batch_size: int,
        service_ms: float,
        now_s: float | None = None,
    ) -> None:
        """A worker call of ``batch_size`` samples of ``model`` on ``instance_type`` that took
        ``service_ms`` (the round trip, transport and compute, plus the instance's turnaround
        before it when work was waiting: its busy time, as a simulated instance's), ended at
        ``now_s`` (given: kept so that the kept ones span :data:`BATCH_TIMES_SPAN_S`)."""
        key = (app, model, instance_type, int(batch_size))
        with self._lock:
            kept = self._batch_times.get(key)
            if kept is None:
                kept = SpannedSample(BATCH_TIMES_KEPT, self._batch_span_s)
                self._batch_times[key] = kept
            kept.add(float(service_ms), now_s)

    # --- what the tuner, the roll-up and /metrics read -----------------------------------------

    def arrival_s(self, app: str) -> np.ndarray:
        """The kept arrival times of ``app``, oldest first (empty when it had none)."""
        with self._lock:
            entry = self._apps.get(app)
            if entry is None or entry.size == 0:
                return np.empty(0, dtype=np.float64)
            if entry.size < ARRIVALS_KEPT:
                return entry.arrivals[: entry.size].copy()
            return np.concatenate((entry.arrivals[entry.head :], entry.arrivals[: entry.head]))

    def arrival_s_since(self, app: str, since_s: float | None) -> np.ndarray:
        """The kept arrival times of ``app`` after ``since_s`` (all when None), oldest first:
        only those are copied (a loops process running apart asks every 100 ms for the new ones).

        >>> o = Observations()
        >>> for t in (1.0, 2.0, 3.0):
        ...     o.arrival("a", t)
        >>> o.arrival_s_since("a", 1.0).tolist(), o.arrival_s_since("a", None).tolist()
        ([2.0, 3.0], [1.0, 2.0, 3.0])
        """
        if since_s is None:
            return self.arrival_s(app)
        with self._lock:
            entry = self._apps.get(app)
            if entry is None or entry.size == 0:
                return np.empty(0, dtype=np.float64)
            # The ring in time order is older + newer (views, not copies).
            if entry.size < ARRIVALS_KEPT:
                older, newer = entry.arrivals[:0], entry.arrivals[: entry.size]
            else:
                older, newer = entry.arrivals[entry.head :], entry.arrivals[: entry.head]
            if newer.size and newer[0] <= since_s:  # all of the older ones are before it
                return newer[int(np.searchsorted(newer, since_s, side="right")) :].copy()
            start = int(np.searchsorted(older, since_s, side="right"))
            return np.concatenate((older[start:], newer))

    def rate_qps(self, app: str, now_s: float, window_s: float) -> float:
        """Arrivals per second over the last ``window_s`` (CascadeServe's measured QPS)."""
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        arrivals = self.arrival_s(app)
        recent = arrivals.size - int(np.searchsorted(arrivals, now_s - window_s, side="right"))
        return recent / window_s

    def take_window(
        self, app: str, now_s: float, slo_ms: float, gear: str | None = None
    ) -> WindowSummary | None:
        """The summary of ``app``'s window since the last call (None when the loop never saw
        the app): the queries that ended in it, errors included; and a new window from
        ``now_s``."""
        with self._lock:
            entry = self._apps.get(app)
            if entry is None:
                return None
            latencies, entry.latencies = entry.latencies, []
            arrivals, entry.window_arrivals = entry.window_arrivals, 0
            correct, labelled = entry.correct, entry.labelled
            entry.correct = entry.labelled = 0
            errors, entry.window_errors = entry.window_errors, Counter()
            elapsed = now_s - entry.window_since_s
            entry.window_since_s = now_s
        return summarise(
            latencies,
            slo_ms,
            arrivals,
            elapsed,
            correct=correct,
            labelled=labelled,
            gear=gear,
            refused=errors[Outcome.REFUSED],
            timed_out=errors[Outcome.TIMED_OUT],
            failed=errors[Outcome.FAILED],
        )

    def batch_times_ms(self, app: str) -> dict[tuple[str, str], dict[int, list[float]]]:
        """The kept batch service times of ``app``: (model, instance type) -> batch size -> ms,
        oldest first (empty when it had none); a batch size's values only once they span
        ``batch_evidence_s`` (:data:`BATCH_EVIDENCE_S`; since the start or the last
        :meth:`forget_batch_times`), an empty list until then."""
        found: dict[tuple[str, str], dict[int, list[float]]] = {}
        with self._lock:
            for (name, model, instance_type, batch), kept in self._batch_times.items():
                if name != app or not kept.values:
                    continue
                evidence_s = kept.evidence_s
                short = evidence_s is not None and evidence_s < self._batch_evidence_s
                # Withheld with no values, not left out: the pair is known, so that a hold's
                # forget (controlplane.loops.calibration) drops what was kept meanwhile too.
                by_size = found.setdefault((model, instance_type), {})
                by_size[batch] = [] if short else list(kept.values)
        return found

    def serving_cpu_ms(self, app: str, now_s: float) -> float | None:
        """The serving threads' CPU ms per answered query (:class:`CpuMeter`; every app's
        queries: ``app`` is given the process's figure), None before enough answers."""
        with self._lock:
            return self._cpu.per_query_ms(now_s)

    def api_times_ms(self, app: str) -> list[float]:
        """The service's own time (ms, :attr:`Split.own_ms`: the API's part, from its receipt to
        the dispatcher's submit, plus the dispatches' wait on the event loop) of ``app``'s
        newest answered queries, oldest first (empty when none was answered): the newest
        :data:`API_TIMES_KEPT`, of one query in every few at a rate where those would span less
        than :data:`API_TIMES_SPAN_S`."""
        with self._lock:
            found = self._apps.get(app)
            return [] if found is None else list(found.own_ms.values)

    def forget_api_times(self, app: str) -> None:
        """Drop the service's own times kept for ``app`` (they were measured while its host was
        shared with a profile run's worker, and are not the service's own speed)."""
        with self._lock:
            found = self._apps.get(app)
            if found is not None:
                found.own_ms.forget()

    def holding(self) -> AbstractContextManager[None]:
        """The block in which a calibration pass reads an app's figures (the loops' view of a
        serving process apart reads each app's document once in it); in process every read is
        of the live figures, and there is nothing to hold."""
        return contextlib.nullcontext()

    def forget_batch_times(self, app: str, model: str, instance_type: str) -> None:
        """Drop the kept batch times of ``model`` on ``instance_type`` for ``app`` (the profile
        they were compared with has just been recalibrated)."""
        with self._lock:
            for key, kept in self._batch_times.items():
                if key[:3] == (app, model, instance_type):
                    kept.forget()

    def totals(self) -> dict[str, AppTotals]:
        with self._lock:
            return {
                app: AppTotals(
                    arrived=e.arrived,
                    answered=e.answered,
                    late=e.late,
                    failed=e.failed,
                    refused=e.refused,
                    timed_out=e.timed_out,
                    rejected=e.rejected,
                    samples_by_model=dict(e.samples_by_model),
                    latency_sum_ms=dict(zip(_STAGES, e.stage_sum_ms, strict=True)),
                    latency_buckets={str(o): tuple(c) for o, c in e.buckets.items()},
                    latency_outcome_sum_ms={str(o): v for o, v in e.outcome_sum_ms.items()},
                )
                for app, e in sorted(self._apps.items())
            }

    def apps(self) -> list[str]:
        with self._lock:
            return sorted(self._apps)
