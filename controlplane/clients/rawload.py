"""The load generator's fast engine: the same open loop over raw HTTP/1.1 keep-alive connections.

:mod:`controlplane.clients.loadgen` sends through ``httpx``, which costs about half a millisecond
of CPU per request: on a 2-core machine the generator, not the service, then limits a run at a
few hundred queries per second. This engine sends the same queries
(:class:`~controlplane.clients.loadgen.Query`) with the same open-loop semantics and returns
the same :class:`~controlplane.clients.loadgen.LoadResult`, for a tenth of the CPU:

- each request's bytes (request line, ``Host``, ``Authorization``, ``Content-Type``,
  ``Content-Length``, the body) are built once, before the run;
- connections are :class:`asyncio.Protocol` objects parsing answers with ``httptools`` (the
  parser uvicorn uses), one request in flight per connection (no pipelining);
- query i is written at ``start + a_i`` on an idle connection, on a new one while fewer than
  ``max_in_flight`` are open, or else waits in a FIFO for the next connection to come free; its
  latency runs from its scheduled time in every case (an overloaded service shows as latency,
  never as a lower offered rate);
- a query not answered within ``timeout_s`` is a ``timeout`` and its connection is closed; a
  refused or reset connection is ``connection``; a 200 whose body is not JSON is ``bad_response``.

Only ``http://`` URLs (no TLS, no proxies): it is a benchmark tool for a service on this host or
network, chosen with ``heteroplane loadgen --engine raw``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import urllib.parse
from collections.abc import Sequence
from typing import cast

import httptools

from controlplane.clients.loadgen import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PROGRESS_S,
    DEFAULT_TIMEOUT_S,
    OK,
    LoadResult,
    ProgressFn,
    Query,
    QueryResult,
    check_run,
    error_message,
    judge_answer,
    outcome,
    snapshot,
)
from controlplane.clients.tensors import HEADER_LENGTH

__all__ = ["request_head", "run_raw_load_async"]

# Connections opened before the run starts.
WARM_CONNECTIONS = 16
# How often the sender checks for queries past their timeout and for a stop request.
_SWEEP_S = 0.05


def request_head(
    url: str,
    token: str | None,
    length: int,
    content_type: str = "application/json",
    header_length: int | None = None,
) -> bytes:
    """The request line and headers of a POST of ``length`` bytes of ``content_type`` to
    ``url`` (``header_length``: the size of the JSON part of a body with binary tensors).

    >>> request_head("http://127.0.0.1:8000/v1/apps/a/infer", None, 2).decode().splitlines()[:2]
    ['POST /v1/apps/a/infer HTTP/1.1', 'Host: 127.0.0.1:8000']
    """
    parts = urllib.parse.urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.netloc}",
        f"Content-Type: {content_type}",
        "Accept: application/json",
        f"Content-Length: {length}",
    ]
    if header_length is not None:
        lines.append(f"{HEADER_LENGTH}: {header_length}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the raw engine sends to http:// URLs only, got {url!r}")
    return parts.hostname, parts.port or 80


class _Connection(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.query: Query | None = None
        self.scheduled_s = 0.0
        self.lag_ms = 0.0
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport: asyncio's or uvloop's (which does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.engine.failed(self, "bad_response")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.engine.lost(self)

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        body = b"".join(self.body)
        self.body.clear()
        self.engine.answered(self, status, body)

    def send(self, query: Query, head: bytes, scheduled_s: float, lag_ms: float) -> None:
        assert self.transport is not None
        self.query = query
        self.scheduled_s = scheduled_s
        self.lag_ms = lag_ms
        self.transport.write(head + query.body)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Engine:
    def __init__(
        self,
        url: str,
        token: str | None,
        timeout_s: float,
        max_in_flight: int,
    ) -> None:
        self.host, self.port = _address(url)
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.idle: list[_Connection] = []
        self.busy: set[_Connection] = set()
        self.opening = 0
        self.waiting: collections.deque[tuple[Query, float, float]] = collections.deque()
        self.heads: dict[tuple[int, str, int | None], bytes] = {}
        self.done: list[QueryResult] = []
        self.answered_ms: list[float] = []
        self.loop = asyncio.get_running_loop()

    def now(self) -> float:
        return self.loop.time()

    def head(self, query: Query) -> bytes:
        key = (len(query.body), query.content_type, query.header_length)
        head = self.heads.get(key)
        if head is None:
            head = self.heads[key] = request_head(self.url, self.token, *key)
        return head

    def submit(self, query: Query, scheduled_s: float) -> None:
        lag_ms = max(0.0, (self.now() - scheduled_s) * 1000.0)
        if self.idle:
            connection = self.idle.pop()
            self.busy.add(connection)
            connection.send(query, self.head(query), scheduled_s, lag_ms)
            return
        self.waiting.append((query, scheduled_s, lag_ms))
        if len(self.busy) + self.opening < self.max_in_flight:
            self.opening += 1
            self.loop.create_task(self.open())

    async def open(self) -> None:
        try:
            _, connection = await self.loop.create_connection(
                lambda: _Connection(self), self.host, self.port
            )
        except OSError:
            self.opening -= 1
            if self.waiting and not self.busy and not self.idle:
                # Nothing connects: fail the oldest waiting query rather than let it wait for a
                # connection that may never come (each query that waits started an attempt).
                query, scheduled_s, lag_ms = self.waiting.popleft()
                self.record(query, "connection", scheduled_s, lag_ms)
            return
        self.opening -= 1
        self.release(connection)

    def release(self, connection: _Connection) -> None:
        """``connection`` is free: it takes the oldest waiting query or goes idle."""
        connection.query = None
        if connection.closed:
            self.busy.discard(connection)
            return
        if self.waiting:
            query, scheduled_s, lag_ms = self.waiting.popleft()
            self.busy.add(connection)
            connection.send(query, self.head(query), scheduled_s, lag_ms)
        else:
            self.busy.discard(connection)
            self.idle.append(connection)

    def record(
        self,
        query: Query,
        kind: str,
        scheduled_s: float,
        lag_ms: float,
        late: bool | None = None,
        served: float | None = None,
        queued: float | None = None,
        error: str | None = None,
    ) -> None:
        result = outcome(query, kind, scheduled_s, lag_ms, self.now(), late, served, queued, error)
        self.done.append(result)
        if kind == OK:
            self.answered_ms.append(result.latency_ms)

    def answered(self, connection: _Connection, status: int, body: bytes) -> None:
        query = connection.query
        if query is None:
            return
        kind, late, served, queued = judge_answer(status, body)
        error = None if kind == OK else error_message(body)
        self.record(
            query, kind, connection.scheduled_s, connection.lag_ms, late, served, queued, error
        )
        self.release(connection)

    def failed(self, connection: _Connection, kind: str) -> None:
        query = connection.query
        connection.query = None
        if query is not None:
            self.record(query, kind, connection.scheduled_s, connection.lag_ms)
        connection.close()

    def lost(self, connection: _Connection) -> None:
        if connection in self.idle:
            self.idle.remove(connection)
        self.busy.discard(connection)
        query = connection.query
        connection.query = None
        if query is not None:
            self.record(query, "connection", connection.scheduled_s, connection.lag_ms)
        if self.waiting and len(self.busy) + self.opening < self.max_in_flight:
            self.opening += 1
            self.loop.create_task(self.open())

    def sweep(self) -> None:
        """Time out the queries past ``timeout_s``, in flight or still waiting."""
        deadline = self.now() - self.timeout_s
        for connection in [c for c in self.busy if c.query is not None]:
            if connection.scheduled_s < deadline:
                self.failed(connection, "timeout")
        while self.waiting and self.waiting[0][1] < deadline:
            query, scheduled_s, lag_ms = self.waiting.popleft()
            self.record(query, "timeout", scheduled_s, lag_ms)

    def pending(self) -> int:
        return len(self.waiting) + sum(1 for c in self.busy if c.query is not None)

    def close(self) -> None:
        for connection in [*self.idle, *self.busy]:
            connection.close()


async def run_raw_load_async(
    queries: Sequence[Query],
    url: str,
    token: str | None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    progress: ProgressFn | None = None,
    progress_every_s: float = DEFAULT_PROGRESS_S,
    stop: threading.Event | None = None,
) -> LoadResult:
    """:func:`controlplane.clients.loadgen.run_load_async`'s contract over raw connections."""
    check_run(queries, timeout_s, max_in_flight)
    engine = _Engine(url, token, timeout_s, max_in_flight)
    # Connections opened before the clock starts, as a client that has been running has them:
    # the first queries of a run must not pay the service's accepting of a burst of them.
    warm = min(max_in_flight, WARM_CONNECTIONS)
    engine.opening += warm
    await asyncio.gather(*(engine.open() for _ in range(warm)))
    start = engine.now()
    last_report = last_sweep = start
    sent = 0
    stopped = False

    def report(force: bool = False) -> None:
        nonlocal last_report
        now = engine.now()
        if progress is None or (not force and now - last_report < progress_every_s):
            return
        last_report = now
        progress(
            snapshot(
                now - start, len(queries), sent, engine.done, engine.answered_ms, engine.pending()
            )
        )

    try:
        while sent < len(queries) or engine.pending():
            now = engine.now()
            if stop is not None and stop.is_set():
                stopped = sent < len(queries) or engine.pending() > 0
                break
            while sent < len(queries) and start + queries[sent].send_at_s <= now:
                engine.submit(queries[sent], start + queries[sent].send_at_s)
                sent += 1
            if now - last_sweep >= _SWEEP_S:
                last_sweep = now
                engine.sweep()
                report()
            if sent < len(queries):
                wait_s = start + queries[sent].send_at_s - engine.now()
                await asyncio.sleep(max(0.0, min(wait_s, _SWEEP_S)))
            else:
                await asyncio.sleep(_SWEEP_S / 5)
    finally:
        engine.close()
    report(force=True)
    end = max((o.finished_s for o in engine.done), default=engine.now())
    ordered = tuple(sorted(engine.done, key=lambda o: o.index))
    return LoadResult(ordered, max(0.0, end - start), sent, stopped)
