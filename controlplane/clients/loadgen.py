"""The load generator: an open loop that sends a trace's queries to an app's inference endpoint.

This module owns how a trace becomes requests and how their answers become a summary:

- **Queries.** Row i of a trace (arrival ``a_i`` s, batch size ``b_i``, optional ``sample_id``)
  is one request to ``POST /v1/apps/{app}/infer`` carrying ``b_i`` inputs: the validation samples
  ``s_i, s_i + 1, ..., s_i + b_i - 1`` (mod n), where ``s_i`` is the row's ``sample_id``, else
  ``i`` (:func:`sample_rows`). The inputs are given by the caller as an (n, features) array (the
  demo family's validation pixels, in the order of its validation records); each request body is
  encoded once, before the run.
- **Any model's inputs** (:func:`build_tensor_queries`): rows from a file, fitted to the app's
  inputs (:mod:`controlplane.clients.tensors`), drawn in order (:func:`draw_rows`: query i with
  batch size b_i takes the next b_i rows, wrapping around; a ``sample_id`` column gives each
  query's first row instead), sent to ``/v1`` or to ``POST /v2/models/{app}/infer`` (the Open
  Inference Protocol, JSON or binary tensors; :func:`infer_url`).
- **Open loop.** Query i is sent at ``start + a_i`` whatever the answers to earlier ones do:
  a slow or failing service never slows the sending down (InferLine's and Clockwork's load
  generators work this way; a closed loop would hide overload by sending less). Each query's
  latency is measured from the time the trace says it is sent, not from when the request left,
  so a generator that falls behind shows up as latency instead of hiding it (the *coordinated
  omission* of closed-loop benchmarks).
- **Outcomes and the summary** (:func:`summarise`, pure): a query is *answered* when the service
  answers 200 with a JSON body (its ``late``, or on ``/v2`` its ``parameters.late``, is the
  service's late flag); otherwise its error kind is ``http_<status>`` (429 when the
  service sheds load, 503 when no instance serves), ``timeout`` (no answer within the per-request
  timeout, or no free connection), ``connection`` (refused, reset) or ``bad_response`` (a 200
  that is not JSON). p50 and p99 are over the answered queries' latencies; *attainment* is the
  share of all sent queries answered within the SLO (an error is a miss); the achieved rate is
  answered queries per second of the run (first scheduled send to the last answer).
- **The path the service does not see** (``outside_p50_ms``, ``outside_p99_ms``): an answer
  carries the service's own time for the query (``timings.total_ms`` on ``/v1``,
  ``parameters.total_ms`` on ``/v2``: from the API's receipt to the answer, :func:`served_ms`);
  a query's latency less it is the part outside the service's count: the client's HTTP stack,
  the connection, the server reading and parsing the request before the API is called and
  writing the answer back. The planner's model holds only what the service counts, so this is
  what a client should add to a plan's ``predicted_p99_ms`` (benchmarks/fidelity measures it).
- **The service's queue** (``queue_p50_ms``, ``queue_p99_ms``, over the answered queries that
  give it): the part of the service's own time neither in the API's hands nor in a worker's
  (``timings.queue_ms`` on ``/v1``, ``parameters.queue_ms`` on ``/v2``: admission, the stages'
  queues, the event loop's turns, :func:`queued_ms`): where a tail longer than the plan's comes
  from inside the service.

The ``--json`` contract of ``heteroplane loadgen`` is :meth:`LoadSummary.to_json`: ``sent``,
``answered``, ``errors``, ``p50_ms``, ``p99_ms``, ``attainment``, ``achieved_qps``,
``errors_by_kind``, ``send_lag_p99_ms`` (how late the generator itself sent, p99: above a few
ms it, not the service, was the limit), ``outside_p50_ms``, ``outside_p99_ms`` (null when no
answer gave the service's time), ``queue_p50_ms``, ``queue_p99_ms`` (null when no answer
gave its queue) and ``late_by_service`` (how many answers the service itself flagged late,
``late``: its count of late queries as its counters keep it; null when no answer carried the
flag; the client's misses are these and those the time outside the service pushed past the SLO).

Time comes through a :class:`Timer` (the event loop's clock by default), so tests run a trace
spanning minutes in virtual time. Requests go out over one ``httpx.AsyncClient`` (keep-alive, up
to ``max_in_flight`` connections).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import math
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np
from numpy.typing import NDArray

from controlplane.clients.tensors import HEADER_LENGTH, InputSpec, tensor_body
from estimator.traces import Trace

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_PROGRESS_S",
    "DEFAULT_TIMEOUT_S",
    "ENGINES",
    "MAX_QUERY_ROWS",
    "LoadProgress",
    "LoadResult",
    "LoadSummary",
    "Query",
    "QueryResult",
    "RealTimer",
    "Timer",
    "build_queries",
    "build_tensor_queries",
    "check_batch_sizes",
    "draw_rows",
    "error_message",
    "infer_url",
    "judge_answer",
    "late_flag",
    "outcome",
    "queued_ms",
    "run_load",
    "run_load_async",
    "sample_rows",
    "served_ms",
    "summarise",
]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_PROGRESS_S = 5.0
# Connections the client may open at once: an open loop needs one per query in flight, and a
# service that falls behind by more than this many queries is overloaded whatever we measure.
DEFAULT_MAX_IN_FLIGHT = 512
# Idle sleeps are cut into pieces this long, so that a stop request is noticed promptly.
_STOP_POLL_S = 0.25
OK = "ok"
# How requests go out: httpx (any URL) or raw HTTP/1.1 connections (controlplane.clients.rawload).
ENGINES = ("httpx", "raw")
# The most samples (rows) the service takes in one query, on /v1 and /v2 alike: its
# controlplane.api.schemas.MAX_INFER_SAMPLES (a client does not import the API; a test holds
# the two equal).
MAX_QUERY_ROWS = 256


# --- queries -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Query:
    """One request of the run: sent ``send_at_s`` after the start, carrying ``sample_ids`` (the
    rows of the inputs); ``content_type`` and, for Triton's binary tensors, ``header_length``
    (the size of the body's JSON part) are how the body is sent."""

    index: int
    send_at_s: float
    sample_ids: tuple[int, ...]
    body: bytes = field(repr=False)
    content_type: str = "application/json"
    header_length: int | None = None

    def headers(self) -> dict[str, str]:
        """The request headers the body needs beyond the run's own (JSON) ones."""
        if self.header_length is None and self.content_type == "application/json":
            return {}
        headers = {"Content-Type": self.content_type}
        if self.header_length is not None:
            headers[HEADER_LENGTH] = str(self.header_length)
        return headers


def sample_rows(
    trace: Trace, n_samples: int, what: str = "validation samples"
) -> list[tuple[int, ...]]:
    """The validation samples each query of ``trace`` carries: for row i with batch size b_i,
    ``s_i + j (mod n)`` for j < b_i, s_i the row's ``sample_id`` or else i. A ``sample_id``
    past them is a ValueError naming them ``what``.

    >>> trace = Trace(np.array([0.0, 0.1, 0.2]), np.array([1, 2, 1]), np.array([4, 0, 2]))
    >>> sample_rows(trace, 5)
    [(4,), (0, 1), (2,)]
    >>> sample_rows(Trace(np.array([0.0, 0.1]), np.array([1, 3])), 3)
    [(0,), (1, 2, 0)]
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    ids = trace.sample_id
    if ids is not None and ids.size and int(ids.max()) >= n_samples:
        row = int(np.argmax(ids >= n_samples))
        raise ValueError(
            f"the trace's sample_id {int(ids[row])} at row {row + 1} is outside the"
            f" {n_samples} {what} (0..{n_samples - 1})"
        )
    starts = ids.tolist() if ids is not None else range(len(trace))
    return [
        tuple((start + j) % n_samples for j in range(int(batch)))
        for start, batch in zip(starts, trace.batch_size.tolist(), strict=True)
    ]


def check_batch_sizes(trace: Trace) -> None:
    """Refuse (``ValueError`` of one line) a trace with a query of more rows than the service
    takes (:data:`MAX_QUERY_ROWS`), before any body is built: every such query is a 4xx, and
    the bodies are built up front (a batch size of 30,000 of an image input is gigabytes).

    >>> check_batch_sizes(Trace(np.array([0.0, 1.0]), np.array([1, 300])))
    Traceback (most recent call last):
    ...
    ValueError: batch_size 300 at row 2 is more than the 256 rows the service takes in a query
    """
    sizes = trace.batch_size
    if sizes.size and int(sizes.max()) > MAX_QUERY_ROWS:
        row = int(np.argmax(sizes > MAX_QUERY_ROWS))
        raise ValueError(
            f"batch_size {int(sizes[row])} at row {row + 1} is more than the {MAX_QUERY_ROWS}"
            " rows the service takes in a query"
        )


def build_queries(trace: Trace, inputs: NDArray[np.floating] | NDArray[np.integer]) -> list[Query]:
    """The requests for ``trace``: send times relative to its first arrival, and for each query
    the body ``{"inputs": [...], "sample_ids": [...]}`` with the rows of ``inputs`` (shape (n,
    features)) that :func:`sample_rows` names. Whole-number inputs (the digits' pixels, 0..16)
    are written as integers."""
    rows = np.asarray(inputs)
    if rows.ndim != 2 or rows.shape[0] < 1:
        raise ValueError(f"inputs must be an (n, features) array with n >= 1, got {rows.shape}")
    if not np.all(np.isfinite(rows)):
        raise ValueError("inputs must be finite")
    whole = bool(np.all(rows == np.round(rows)))
    encoded = [row.astype(np.int64).tolist() if whole else row.tolist() for row in rows]
    origin = float(trace.arrival_s[0]) if len(trace) else 0.0
    queries = []
    for index, (arrival, samples) in enumerate(
        zip(trace.arrival_s.tolist(), sample_rows(trace, rows.shape[0]), strict=True)
    ):
        body = {"inputs": [encoded[s] for s in samples], "sample_ids": list(samples)}
        queries.append(
            Query(
                index,
                arrival - origin,
                samples,
                json.dumps(body, separators=(",", ":")).encode(),
            )
        )
    return queries


def draw_rows(trace: Trace, n_rows: int) -> list[tuple[int, ...]]:
    """The rows each query of ``trace`` takes (see the module docstring): the next rows in order, or
    from each row's ``sample_id`` on.

    >>> draw_rows(Trace(np.array([0.0, 0.1, 0.2]), np.array([2, 2, 1])), 3)
    [(0, 1), (2, 0), (1,)]
    """
    if n_rows < 1:
        raise ValueError(f"n_rows must be >= 1, got {n_rows}")
    if trace.sample_id is not None:
        return sample_rows(trace, n_rows, "rows")
    drawn = []
    cursor = 0
    for batch in trace.batch_size.tolist():
        drawn.append(tuple((cursor + j) % n_rows for j in range(int(batch))))
        cursor = (cursor + int(batch)) % n_rows
    return drawn


def build_tensor_queries(
    trace: Trace,
    arrays: Mapping[str, NDArray[Any]],
    specs: Sequence[InputSpec],
    protocol: str = "v2",
    binary: bool = False,
    timeout_s: float | None = None,
) -> list[Query]:
    """The requests for ``trace`` carrying rows of ``arrays`` (fitted to the app's inputs
    ``specs``: :func:`~controlplane.clients.tensors.fit_inputs`), drawn in order
    (:func:`draw_rows`), as ``protocol`` (``v1`` or ``v2``) bodies, ``binary`` tensors on
    ``v2``, each with the client's ``timeout_s`` (``parameters.timeout`` on ``v2``);
    ValueError for ``v1`` and a model of several inputs."""
    n_rows = next(iter(arrays.values())).shape[0]
    origin = float(trace.arrival_s[0]) if len(trace) else 0.0
    queries = []
    for index, (arrival, rows) in enumerate(
        zip(trace.arrival_s.tolist(), draw_rows(trace, n_rows), strict=True)
    ):
        made = tensor_body(arrays, specs, rows, protocol, binary, timeout_s)
        queries.append(
            Query(index, arrival - origin, rows, made.body, made.content_type, made.header_length)
        )
    return queries


def infer_url(base_url: str, app: str, protocol: str = "v1") -> str:
    """The inference endpoint of ``app`` on the service at ``base_url`` (``v2``: the Open
    Inference Protocol's).

    >>> infer_url("http://127.0.0.1:8000/", "demo")
    'http://127.0.0.1:8000/v1/apps/demo/infer'
    >>> infer_url("http://127.0.0.1:8000", "demo", "v2")
    'http://127.0.0.1:8000/v2/models/demo/infer'
    """
    name = urllib.parse.quote(app, safe="")
    if protocol == "v2":
        return f"{base_url.rstrip('/')}/v2/models/{name}/infer"
    return f"{base_url.rstrip('/')}/v1/apps/{name}/infer"


def late_flag(answer: object) -> bool | None:
    """The service's late flag in an answer: ``late`` (``/v1``) or ``parameters.late``
    (``/v2``); None when it gives none."""
    if not isinstance(answer, dict):
        return None
    flag = answer.get("late")
    if flag is None and isinstance(answer.get("parameters"), dict):
        flag = answer["parameters"].get("late")
    return flag if isinstance(flag, bool) else None


def served_ms(answer: object) -> float | None:
    """The service's own time for the query in an answer: ``timings.total_ms`` (``/v1``) or
    ``parameters.total_ms`` (``/v2``); None when it gives none.

    >>> served_ms({"timings": {"total_ms": 2.5}}), served_ms({"parameters": {"total_ms": 3}})
    (2.5, 3.0)
    >>> served_ms({"outputs": []}) is None
    True
    """
    return _timing_ms(answer, "total_ms")


def queued_ms(answer: object) -> float | None:
    """The service's queue for the query in an answer: ``timings.queue_ms`` (``/v1``) or
    ``parameters.queue_ms`` (``/v2``), the part of its own time neither in the API's hands nor
    in a worker's (admission, the stages' queues, the event loop); None when it gives none.

    >>> queued_ms({"timings": {"queue_ms": 1.5}}), queued_ms({"parameters": {}})
    (1.5, None)
    """
    return _timing_ms(answer, "queue_ms")


def _timing_ms(answer: object, name: str) -> float | None:
    """The answer's timing ``name``: in ``timings`` (``/v1``) or ``parameters`` (``/v2``)."""
    if not isinstance(answer, dict):
        return None
    for key in ("timings", "parameters"):
        part = answer.get(key)
        if isinstance(part, dict):
            value = part.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value) if math.isfinite(value) else None
    return None


# --- outcomes and the summary ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueryResult:
    """What became of one query: ``kind`` is ``ok`` or the error kind (module docstring);
    ``latency_ms`` runs from its scheduled send to its answer or failure; ``send_lag_ms`` is how
    late the request left; ``late`` is the service's own flag (``None`` when it gave none);
    ``served_ms`` the service's own time for it (:func:`served_ms`; ``None`` when it gave
    none), ``queued_ms`` the part of it in the service's queue (:func:`queued_ms`)."""

    index: int
    kind: str
    latency_ms: float
    send_lag_ms: float = 0.0
    finished_s: float = 0.0
    late: bool | None = None
    served_ms: float | None = None
    queued_ms: float | None = None
    # An error answer's own message (:func:`error_message`; None: none, or an answer).
    error: str | None = None

    @property
    def outside_ms(self) -> float | None:
        """The part of the latency outside the service's own count (module docstring)."""
        if not self.answered or self.served_ms is None:
            return None
        return self.latency_ms - self.served_ms

    @property
    def answered(self) -> bool:
        return self.kind == OK


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """The run's numbers (see the module docstring for each definition)."""

    sent: int
    answered: int
    errors: int
    errors_by_kind: Mapping[str, int]
    p50_ms: float | None
    p99_ms: float | None
    attainment: float | None
    achieved_qps: float
    duration_s: float
    slo_ms: float | None
    send_lag_p99_ms: float | None = None
    outside_p50_ms: float | None = None
    outside_p99_ms: float | None = None
    queue_p50_ms: float | None = None
    queue_p99_ms: float | None = None
    late_by_service: int | None = None
    # The first message the service gave per error kind (a run's 502s said nothing of why).
    error_examples: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """The ``loadgen --json`` contract."""
        return {
            "sent": self.sent,
            "answered": self.answered,
            "errors": self.errors,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "attainment": self.attainment,
            "achieved_qps": self.achieved_qps,
            "errors_by_kind": dict(self.errors_by_kind),
            "send_lag_p99_ms": self.send_lag_p99_ms,
            "outside_p50_ms": self.outside_p50_ms,
            "outside_p99_ms": self.outside_p99_ms,
            "queue_p50_ms": self.queue_p50_ms,
            "queue_p99_ms": self.queue_p99_ms,
            "late_by_service": self.late_by_service,
            "error_examples": dict(self.error_examples),
        }


def summarise(
    outcomes: Sequence[QueryResult], slo_ms: float | None, elapsed_s: float
) -> LoadSummary:
    """The summary of ``outcomes`` over a run of ``elapsed_s`` seconds, attainment against
    ``slo_ms`` (``None``: not known, attainment ``None``).

    >>> runs = [QueryResult(0, "ok", 10.0), QueryResult(1, "ok", 30.0)]
    >>> runs.append(QueryResult(2, "http_503", 1.0))
    >>> s = summarise(runs, slo_ms=20.0, elapsed_s=2.0)
    >>> s.sent, s.answered, s.errors, dict(s.errors_by_kind), s.attainment, s.achieved_qps
    (3, 2, 1, {'http_503': 1}, 0.3333333333333333, 1.0)
    >>> s.late_by_service is None  # no answer carried the service's late flag
    True
    """
    if elapsed_s < 0 or not math.isfinite(elapsed_s):
        raise ValueError(f"elapsed_s must be finite and >= 0, got {elapsed_s!r}")
    answered = np.array([o.latency_ms for o in outcomes if o.answered], dtype=np.float64)
    errors = Counter(o.kind for o in outcomes if not o.answered)
    lags = np.array([o.send_lag_ms for o in outcomes], dtype=np.float64)
    outside_each = (o.outside_ms for o in outcomes)
    outside = np.array([ms for ms in outside_each if ms is not None], dtype=np.float64)
    queued = np.array(
        [o.queued_ms for o in outcomes if o.answered and o.queued_ms is not None],
        dtype=np.float64,
    )

    def percentile(values: NDArray[np.float64], q: float) -> float | None:
        return float(np.percentile(values, q)) if values.size else None

    examples: dict[str, str] = {}
    for o in outcomes:
        if o.error is not None and o.kind not in examples:
            examples[o.kind] = o.error
    flagged = [o for o in outcomes if o.answered and o.late is not None]
    attainment: float | None = None
    if slo_ms is not None and outcomes:
        attainment = float(np.count_nonzero(answered <= slo_ms)) / len(outcomes)
    return LoadSummary(
        sent=len(outcomes),
        answered=int(answered.size),
        errors=sum(errors.values()),
        errors_by_kind=dict(sorted(errors.items())),
        p50_ms=percentile(answered, 50.0),
        p99_ms=percentile(answered, 99.0),
        attainment=attainment,
        achieved_qps=float(answered.size) / elapsed_s if elapsed_s > 0 else 0.0,
        duration_s=elapsed_s,
        slo_ms=slo_ms,
        send_lag_p99_ms=percentile(lags, 99.0),
        outside_p50_ms=percentile(outside, 50.0),
        outside_p99_ms=percentile(outside, 99.0),
        queue_p50_ms=percentile(queued, 50.0),
        queue_p99_ms=percentile(queued, 99.0),
        late_by_service=sum(1 for o in flagged if o.late) if flagged else None,
        error_examples=dict(sorted(examples.items())),
    )


# --- the run -------------------------------------------------------------------------------------


class Timer(Protocol):
    """Where the run reads the time (seconds, any origin) and how it waits."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealTimer:
    """The wall clock: ``time.perf_counter`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """A snapshot during the run, for a progress line."""

    elapsed_s: float
    total: int
    sent: int
    answered: int
    errors: int
    in_flight: int
    p99_ms: float | None

    def line(self) -> str:
        p99 = "-" if self.p99_ms is None else f"{self.p99_ms:.1f} ms"
        return (
            f"{self.elapsed_s:7.1f} s: sent {self.sent}/{self.total}, answered {self.answered},"
            f" errors {self.errors}, in flight {self.in_flight}, p99 so far {p99}"
        )


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Every query's outcome, in trace order, and the run's length (first scheduled send to the
    last answer, s); ``stopped``: the run was asked to stop, after ``sent`` queries (those still
    in flight then have no outcome)."""

    outcomes: tuple[QueryResult, ...]
    elapsed_s: float
    sent: int
    stopped: bool = False

    def summary(self, slo_ms: float | None) -> LoadSummary:
        return summarise(self.outcomes, slo_ms, self.elapsed_s)


ProgressFn = Callable[[LoadProgress], None]


def check_run(queries: Sequence[Query], timeout_s: float, max_in_flight: int) -> None:
    """Refuse a run's arguments (``ValueError``): a timeout that is not > 0, fewer than one
    connection, queries out of send order. Both engines check the same."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if any(b.send_at_s < a.send_at_s for a, b in itertools.pairwise(queries)):
        raise ValueError("queries must be in send order")


def snapshot(
    elapsed_s: float,
    total: int,
    sent: int,
    done: Sequence[QueryResult],
    answered_ms: Sequence[float],
    in_flight: int,
) -> LoadProgress:
    """The progress of a run so far, from its outcomes (both engines report the same)."""
    errors = sum(1 for o in done if not o.answered)
    p99 = float(np.percentile(answered_ms, 99.0)) if answered_ms else None
    return LoadProgress(elapsed_s, total, sent, len(done) - errors, errors, in_flight, p99)


async def _send(
    client: httpx.AsyncClient, url: str, query: Query, scheduled_s: float, timer: Timer
) -> QueryResult:
    lag_ms = max(0.0, (timer.now() - scheduled_s) * 1000.0)
    late: bool | None = None
    served: float | None = None
    queued: float | None = None
    error: str | None = None
    try:
        response = await client.post(url, content=query.body, headers=query.headers())
    except httpx.TimeoutException:
        kind = "timeout"
    except httpx.TransportError:
        kind = "connection"
    else:
        kind, late, served, queued = judge_answer(response.status_code, response.content)
        if kind != OK:
            error = error_message(response.content)
    return outcome(query, kind, scheduled_s, lag_ms, timer.now(), late, served, queued, error)


def outcome(
    query: Query,
    kind: str,
    scheduled_s: float,
    lag_ms: float,
    finished_s: float,
    late: bool | None = None,
    served: float | None = None,
    queued: float | None = None,
    error: str | None = None,
) -> QueryResult:
    """What became of ``query`` (:class:`QueryResult`), scheduled at ``scheduled_s`` and
    finished at ``finished_s`` (the run's clock, s): both engines record outcomes here."""
    latency_ms = (finished_s - scheduled_s) * 1000.0
    return QueryResult(
        query.index,
        kind,
        latency_ms,
        lag_ms,
        finished_s,
        late=late,
        served_ms=served,
        queued_ms=queued,
        error=error,
    )


# The most of an error answer's message kept (the summary shows one per kind).
ERROR_MESSAGE_CHARS = 300


def error_message(body: bytes) -> str | None:
    """The message of an error answer's body, on one line and at most
    :data:`ERROR_MESSAGE_CHARS`: the API's ``{"error": {"code", "message"}}`` (as ``code:
    message``), the Open Inference Protocol's ``{"error": "..."}``, or a ``detail``; None for
    a body that is none of them.

    >>> error_message(b'{"error": {"code": "model_error", "message": "the model raised"}}')
    'model_error: the model raised'
    >>> error_message(b'{"error": "input x: expected FP32"}'), error_message(b"<html>")
    ('input x: expected FP32', None)
    >>> error_message(b'{"error": "\\\\u001b[31mred\\\\u001b[0m"}')
    '[31mred [0m'
    >>> error_message(b'{"error": null, "detail": "d"}')
    'd'
    """
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if error is None:
        error = document.get("detail")
    if isinstance(error, dict):
        code, message = error.get("code"), error.get("message")
        if not isinstance(message, str):
            return None
        error = f"{code}: {message}" if isinstance(code, str) and code else message
    if not isinstance(error, str) or not error.strip():
        return None
    # One line, and nothing a terminal would act on (a service's ESC sequences): printed as
    # the summary's example.
    line = " ".join("".join(c if c.isprintable() else " " for c in error).split())
    if not line:
        return None
    if len(line) > ERROR_MESSAGE_CHARS:
        line = line[: ERROR_MESSAGE_CHARS - 3] + "..."
    return line


def judge_answer(status: int, body: bytes) -> tuple[str, bool | None, float | None, float | None]:
    """An answer's outcome kind (module docstring), the service's late flag, its own time for
    the query and the part of it queued (:func:`late_flag`, :func:`served_ms`,
    :func:`queued_ms`); both engines judge answers here.

    >>> judge_answer(200, b'{"late": true, "timings": {"total_ms": 2.0, "queue_ms": 0.5}}')
    ('ok', True, 2.0, 0.5)
    >>> judge_answer(200, b"<html>"), judge_answer(503, b"{}")
    (('bad_response', None, None, None), ('http_503', None, None, None))
    """
    if status != 200:
        return f"http_{status}", None, None, None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = _json_part(body)
        if answer is None:
            return "bad_response", None, None, None
    return OK, late_flag(answer), served_ms(answer), queued_ms(answer)


def _json_part(body: bytes) -> Any:
    """The JSON part of an answer with binary outputs (Triton's binary tensor extension: the
    JSON, then the tensors' raw bytes); None when the body does not start with a JSON object.

    >>> _json_part(b'{"parameters": {"total_ms": 1.5}}\\x00\\x00\\xc0\\x7f')
    {'parameters': {'total_ms': 1.5}}
    >>> _json_part(b"<html>") is None, _json_part(b"[1]") is None
    (True, True)
    """
    try:  # each byte a character: the tensors' bytes after the JSON are not read as UTF-8
        answer, _ = json.JSONDecoder().raw_decode(body.decode("latin-1"))
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


async def run_load_async(
    queries: Sequence[Query],
    url: str,
    token: str | None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    timer: Timer | None = None,
    progress: ProgressFn | None = None,
    progress_every_s: float = DEFAULT_PROGRESS_S,
    stop: threading.Event | None = None,
) -> LoadResult:
    """Send ``queries`` to ``url`` (the app's inference endpoint) on their schedule, open loop.

    Query q is sent at ``start + q.send_at_s`` (queries in send order), each in a task of its
    own; then the run waits for the answers still due (each at most ``timeout_s``). ``progress``
    is called at most every ``progress_every_s`` while queries are sent or answered, and once
    at the end. Setting ``stop`` ends the sending; the queries in flight are cancelled and not
    counted.
    """
    check_run(queries, timeout_s, max_in_flight)
    clock = timer if timer is not None else RealTimer()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    limits = httpx.Limits(
        max_connections=max_in_flight,
        max_keepalive_connections=max_in_flight,
        keepalive_expiry=30.0,
    )
    done: list[QueryResult] = []
    answered_ms: list[float] = []
    failures: list[BaseException] = []
    tasks: set[asyncio.Task[QueryResult]] = set()
    start = clock.now()
    last_report = start
    stopped = False

    def report(force: bool = False) -> None:
        nonlocal last_report
        now = clock.now()
        if progress is None or (not force and now - last_report < progress_every_s):
            return
        last_report = now
        progress(snapshot(now - start, len(queries), sent, done, answered_ms, len(tasks)))

    def finished(task: asyncio.Task[QueryResult]) -> None:
        tasks.discard(task)
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            failures.append(failure)
            return
        outcome = task.result()
        done.append(outcome)
        if outcome.answered:
            answered_ms.append(outcome.latency_ms)

    sent = 0
    async with httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(timeout_s),
        limits=limits,
        trust_env=False,  # a proxy from the environment must not sit between us and loopback
    ) as client:
        for query in queries:
            scheduled = start + query.send_at_s
            while (wait_s := scheduled - clock.now()) > 0:
                if stop is not None and stop.is_set():
                    break
                await clock.sleep(min(wait_s, _STOP_POLL_S))
            if stop is not None and stop.is_set():
                stopped = True
                break
            task = asyncio.create_task(_send(client, url, query, scheduled, clock))
            tasks.add(task)
            task.add_done_callback(finished)
            sent += 1
            report()
            # Let the tasks just made start their requests before the next wait.
            await asyncio.sleep(0)
        if stopped:
            for task in list(tasks):
                task.cancel()
        while tasks:
            waiting = list(tasks)
            await asyncio.wait(waiting, timeout=_STOP_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if stop is not None and stop.is_set() and not stopped:
                stopped = True
                for task in list(tasks):
                    task.cancel()
            report()
        end = max((o.finished_s for o in done), default=clock.now())
    if failures:  # a bug in _send: raise it rather than drop its queries silently
        raise failures[0]
    report(force=True)
    ordered = tuple(sorted(done, key=lambda o: o.index))
    return LoadResult(ordered, max(0.0, end - start), sent, stopped)


def run_load(
    queries: Sequence[Query],
    url: str,
    token: str | None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    progress: ProgressFn | None = None,
    progress_every_s: float = DEFAULT_PROGRESS_S,
    stop: threading.Event | None = None,
    engine: str = "httpx",
) -> LoadResult:
    """:func:`run_load_async` (``engine`` httpx) or
    :func:`controlplane.clients.rawload.run_raw_load_async` (``engine`` raw) in real time on a
    new event loop (the calling thread waits).

    With the raw engine the cyclic garbage collector is off while the run lasts (everything
    built before it frozen, :func:`gc.freeze`, and no collection during it, :func:`gc.disable`):
    a full collection walking the queries and outcomes held the answers' handling up for over
    100 ms, which read as the service's latency. The run's garbage is freed by reference
    counting; what cycles it leaves are collected when the collector is back on."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    send: Callable[..., Coroutine[Any, Any, LoadResult]] = run_load_async
    if engine == "raw":
        from controlplane.clients import rawload  # it imports this module: here, not on top

        send = rawload.run_raw_load_async
        gc.collect()
        gc.freeze()
        gc.disable()
    try:
        return asyncio.run(
            send(
                queries,
                url,
                token,
                timeout_s=timeout_s,
                max_in_flight=max_in_flight,
                progress=progress,
                progress_every_s=progress_every_s,
                stop=stop,
            )
        )
    finally:
        if engine == "raw":
            gc.enable()
            gc.unfreeze()
