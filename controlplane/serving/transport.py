"""Calls to worker agents over kept-alive HTTP/1.1: the :class:`WorkerTransport` seam and the
client the serving loop uses (:class:`HttpWorkerTransport`).

Workers speak the Open Inference Protocol v2 (REST): the worker agent
(:mod:`provisioners.worker.agent`), or any other server of the protocol with Triton's binary
tensor extension (batches are sent in binary tensors, :class:`~controlplane.serving.modelio.
ModelIO`), answers ``POST /v2/models/{model}/infer`` and ``GET /v2/health/ready`` with bodies that
carry ``Content-Length`` (the agent's ready answer also says whether a batch is under way there:
:class:`WorkerBusy`). What a batch's body is and what its answer means is the business of the
model's :class:`~controlplane.serving.modelio.ModelIO`. This module owns the client side: one
pool of open connections per worker address (the dispatcher sends a worker one batch at a
time, so one connection per worker is what it uses; a health probe may take a second), reuse
while the worker keeps the connection alive, and the failure modes turned into one
:class:`~controlplane.errors.WorkerCallError` with a ``kind`` the dispatcher acts on.

Why not httpx: on this project's 2-core reference machine an ``httpx.AsyncClient`` against an
in-process loopback server that answers at once served about 1,200 requests per second, which
alone spends the dispatcher's whole budget (2,000 queries per second with at most 5 ms added at
p99, ``python -m benchmarks.serving_speed dispatcher``); the same exchange over plain asyncio
streams ran at about 38,000. The agent speaks a small, fixed subset of HTTP/1.1 (bodies whose
end a header gives, no redirects, no TLS on the private network), so a client of that subset is
short and is all the serving loop needs; the answers are parsed by httptools' response parser
(uvicorn's, so a dependency already), which took less time per answer than the hand parser it
replaced.

A connection taken from the pool may have been closed by the worker meanwhile (the agent closes
an idle connection after 30 s; connections idle for :data:`IDLE_S` are not reused for that
reason). When a reused connection breaks before any byte of the answer arrived, the request is
sent once more on a new connection: inference is idempotent, and the break says nothing of the
worker's health. Each connection is an :class:`asyncio.Protocol` that parses the answer as its
bytes arrive and resolves one future per request (fewer turns of the event loop per call than
asyncio's streams).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

from controlplane.errors import WorkerCallError
from controlplane.serving.modelio import ModelIO, ModelIOError, Row, WorkerReply
from provisioners.worker.oip import HEADER_LENGTH

__all__ = [
    "CONNECT_TIMEOUT_S",
    "IDLE_S",
    "INPUT_STATUSES",
    "MODEL_STATUS",
    "WATCH_S",
    "HttpWorkerTransport",
    "WorkerBusy",
    "WorkerReply",
    "WorkerTransport",
    "answer_error",
    "busy_of",
]

# The agent closes a connection idle for 30 s (provisioners.worker.agent.IDLE_CONNECTION_S); one
# idle for less than this is still open on its side.
IDLE_S = 20.0
CONNECT_TIMEOUT_S = 1.0
# How often the answers awaited are checked against their deadlines: a call times out up to this
# much after its deadline.
WATCH_S = 0.01
# Connections kept open per worker address beyond the ones in use.
MAX_IDLE_PER_ADDRESS = 4
# A worker's answer head is a few hundred bytes; anything past this is not the agent.
_MAX_HEAD_BYTES = 16 * 1024
# The headers that say where an answer's body ends (one of them is required: an answer whose body
# runs until the connection closes is not the agent's).
_BODY_FRAMING = frozenset({b"content-length", b"transfer-encoding"})


@dataclass(frozen=True, slots=True)
class WorkerBusy:
    """A worker's health answer: ready, but busy with ``in_flight`` batches, the oldest for
    ``busy_s``, its caller waiting ``timeout_s`` for it (None: not said) (the agent's
    ``/v2/health/ready`` says so; a server that does not is never busy). What
    :meth:`WorkerTransport.health` answers instead of True for it."""

    in_flight: int
    busy_s: float
    timeout_s: float | None = None


class WorkerTransport(Protocol):
    """How the dispatcher talks to workers (the live one, or a stub in a benchmark)."""

    async def infer(
        self, address: str, io: ModelIO, rows: Sequence[Row], timeout_s: float
    ) -> WorkerReply:
        """Run ``rows`` (one batch) through the model ``io`` speaks for, on the worker at
        ``address``; raises :class:`~controlplane.errors.WorkerCallError` when no answer comes
        (``input`` or ``model`` with ``worker_fault=False`` when the worker answered that the
        rows are refused or the model raised on them: :func:`answer_error`)."""
        ...

    async def health(self, address: str, timeout_s: float) -> bool | WorkerBusy:
        """Whether the worker at ``address`` answers ``GET /v2/health/ready`` with 200; a
        :class:`WorkerBusy` (answered, so alive) when it says a batch is under way there."""
        ...

    async def close(self) -> None:
        """Close every open connection."""
        ...


class _BrokenError(Exception):
    """A connection broke; ``answered`` says whether any byte of the answer had arrived."""

    def __init__(self, detail: str, answered: bool) -> None:
        super().__init__(detail)
        self.answered = answered


_Answer = tuple[int, bytes, bool]  # status, body, whether the worker closes the connection


class _Channel(asyncio.Protocol):
    """One kept-alive connection to a worker: one request at a time, its answer parsed as the
    bytes arrive by httptools' response parser (uvicorn's, a dependency already; a protocol, not
    streams: a call is one future, not a chain of awaits)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[_Answer] | None = None
        self.received = False  # any byte of the answer to the request in flight
        self.head_bytes = 0
        self.in_head = True
        self.has_length = False
        self.body: list[bytes] = []
        self.last_used_s = time.monotonic()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport: asyncio's or uvloop's (which does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            detail = "the worker closed the connection"
            if exc is not None:
                detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            waiter.set_exception(_BrokenError(detail, answered=self.received))

    def send(self, request: bytes) -> asyncio.Future[_Answer]:
        transport = self.transport
        waiter: asyncio.Future[_Answer] = asyncio.get_running_loop().create_future()
        if transport is None or transport.is_closing():
            waiter.set_exception(_BrokenError("the connection is closed", answered=False))
            return waiter
        self.waiter = waiter
        self.received = False
        self.head_bytes = 0
        self.in_head = True
        self.has_length = False
        self.body = []
        transport.write(request)
        return waiter

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self.received = True
        try:
            if self.in_head:
                self.head_bytes += len(data)
            self.parser.feed_data(data)
            if self.in_head and self.head_bytes > _MAX_HEAD_BYTES:
                raise WorkerCallError(self.address, "malformed", "an answer head too long")
        except httptools.HttpParserCallbackError as error:
            cause = error.__context__
            self._fail(
                cause
                if isinstance(cause, WorkerCallError)
                else WorkerCallError(self.address, "malformed", str(cause or error))
            )
        except httptools.HttpParserError as error:
            self._fail(WorkerCallError(self.address, "malformed", f"not an HTTP answer: {error}"))
        except WorkerCallError as error:
            self._fail(error)

    def _fail(self, error: WorkerCallError) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()

    # httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.has_length and name.lower() in _BODY_FRAMING:
            self.has_length = True

    def on_headers_complete(self) -> None:
        self.in_head = False
        if not self.has_length:
            # Else the body would run until the worker closes: not the agent's answer.
            raise WorkerCallError(self.address, "malformed", "an answer without Content-Length")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            status = self.parser.get_status_code()
            waiter.set_result((status, body, not self.parser.should_keep_alive()))
        self.body = []

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpWorkerTransport:
    """HTTP/1.1 to worker agents over kept-alive connections (see the module docstring)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        idle_s: float = IDLE_S,
        max_idle_per_address: int = MAX_IDLE_PER_ADDRESS,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.max_idle_per_address = max_idle_per_address
        self._idle: defaultdict[str, list[_Channel]] = defaultdict(list)
        self._swept_s = time.monotonic()
        self._closed = False
        # The answers awaited, with their deadlines: one watchdog timer checks them all every
        # WATCH_S (a timer per call would fill the event loop's heap with cancelled ones).
        self._pending: dict[asyncio.Future[_Answer], tuple[float, str, float]] = {}
        self._watchdog: asyncio.TimerHandle | None = None

    def _watch(self) -> None:
        self._watchdog = None
        now = time.monotonic()
        for waiter, (deadline_s, address, timeout_s) in list(self._pending.items()):
            if now >= deadline_s and not waiter.done():
                waiter.set_exception(
                    WorkerCallError(
                        address, "timeout", f"no answer within {timeout_s * 1000:.0f} ms"
                    )
                )
        if self._pending and not self._closed:
            self._watchdog = asyncio.get_running_loop().call_later(WATCH_S, self._watch)

    async def infer(
        self, address: str, io: ModelIO, rows: Sequence[Row], timeout_s: float
    ) -> WorkerReply:
        try:
            body, header_length = io.encode(rows, timeout_s)
        except ModelIOError as error:
            raise WorkerCallError(
                address, "input", str(error), status=400, worker_fault=False
            ) from None
        status, answer = await self._request(
            address, "POST", io.path, body, timeout_s, header_length
        )
        if status != 200:
            raise answer_error(address, status, answer, len(rows))
        return io.decode(address, answer, len(rows))

    async def health(self, address: str, timeout_s: float) -> bool | WorkerBusy:
        # Ready, not live: a worker still loading its models, or draining, answers 503.
        try:
            status, body = await self._request(address, "GET", "/v2/health/ready", b"", timeout_s)
        except WorkerCallError:
            return False
        if status != 200:
            return False
        return busy_of(_error_document(body)) or True

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        idle = [c for channels in self._idle.values() for c in channels]
        self._idle.clear()
        for channel in idle:
            channel.close()

    async def _request(
        self,
        address: str,
        method: str,
        path: str,
        body: bytes,
        timeout_s: float,
        header_length: int | None = None,
    ) -> tuple[int, bytes]:
        """One exchange; ``header_length``: the body is binary tensors whose JSON part is that
        long (:data:`~provisioners.worker.oip.HEADER_LENGTH`)."""
        if self._closed:
            raise WorkerCallError(address, "closed", "the transport is closed")
        if header_length is None:
            content = "Content-Type: application/json\r\n"
        else:
            content = (
                f"Content-Type: application/octet-stream\r\n{HEADER_LENGTH}: {header_length}\r\n"
            )
        request = (
            f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n{content}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        deadline_s = time.monotonic() + timeout_s
        channel = self._pooled(address)
        if channel is not None:
            try:
                return await self._exchange(address, channel, request, deadline_s, timeout_s)
            except _BrokenError as error:
                if error.answered:
                    raise WorkerCallError(address, "closed", str(error)) from None
                # The worker had closed the idle connection: once more on a new one.
        channel = await self._connect(address, min(self.connect_timeout_s, timeout_s))
        try:
            return await self._exchange(address, channel, request, deadline_s, timeout_s)
        except _BrokenError as error:
            raise WorkerCallError(address, "closed", str(error)) from None

    def _pooled(self, address: str) -> _Channel | None:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            channel = idle.pop()
            if now - channel.last_used_s < self.idle_s and channel.open:
                return channel
            channel.close()
        return None

    async def _connect(self, address: str, timeout_s: float) -> _Channel:
        host, _, port_text = address.rpartition(":")
        try:
            port = int(port_text)
        except ValueError:
            raise WorkerCallError(address, "connect", "the address has no port") from None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, channel = await loop.create_connection(
                    lambda: _Channel(address), host.strip("[]") or "127.0.0.1", port
                )
        except TimeoutError:
            raise WorkerCallError(
                address, "connect", f"no connection within {timeout_s:g} s"
            ) from None
        except OSError as error:
            raise WorkerCallError(address, "connect", error.strerror or str(error)) from None
        return channel

    async def _exchange(
        self, address: str, channel: _Channel, request: bytes, deadline_s: float, timeout_s: float
    ) -> tuple[int, bytes]:
        """Send ``request`` and wait for one answer until ``deadline_s``; the connection goes
        back to the pool when the worker keeps it alive, and is closed on any failure (a timeout
        included)."""
        keep = False
        waiter = channel.send(request)
        self._pending[waiter] = (deadline_s, address, timeout_s)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(WATCH_S, self._watch)
        try:
            status, body, close = await waiter
            keep = not close
            return status, body
        finally:
            self._pending.pop(waiter, None)
            if keep and not self._closed and channel.open:
                channel.last_used_s = time.monotonic()
                idle = self._idle[address]
                if len(idle) < self.max_idle_per_address:
                    idle.append(channel)
                else:
                    channel.close()
                self._sweep(channel.last_used_s)
            else:
                channel.close()

    def _sweep(self, now_s: float) -> None:
        """At most once per ``idle_s``: close the pooled connections idle past it (or closed) and
        forget the addresses left with none. A worker that went (the local provisioner gives each
        a port of its own) kept its address's entry and connections for good: the pool grew with
        every worker the fleet ever had."""
        if now_s - self._swept_s < self.idle_s:
            return
        self._swept_s = now_s
        for address in list(self._idle):
            kept = []
            for channel in self._idle[address]:
                if channel.open and now_s - channel.last_used_s < self.idle_s:
                    kept.append(channel)
                else:
                    channel.close()
            if kept:
                self._idle[address] = kept
            else:
                del self._idle[address]


# Statuses by which a worker refuses a batch's inputs themselves, and the one by which it says its
# model raised on the batch: either way it answered, and is no less healthy for it.
INPUT_STATUSES = frozenset({400, 413, 422})
MODEL_STATUS = 500


def answer_error(address: str, status: int, body: bytes, batch: int) -> WorkerCallError:
    """The error of a worker's answer with a status other than 200 to a batch of ``batch`` rows:

    - 400, 413, 422: ``input`` (the rows themselves are refused);
    - 500: ``model`` (the model raised on the batch);
    - any other (503 loading or stopping, 404 a model it does not serve, a proxy's 502 or 504):
      ``status``, the worker's fault (it cannot serve now).

    For ``input`` and ``model``, the body's ``failed_rows`` (the agent's: the rows that failed
    when it ran the batch again row by row) become ``rows`` when they are distinct indices of
    the batch.
    """
    document = _error_document(body)
    text = _error_text(body, document)
    if status not in INPUT_STATUSES and status != MODEL_STATUS:
        return WorkerCallError(address, "status", f"HTTP {status}: {text}", status=status)
    rows = None
    named = document.get("failed_rows") if isinstance(document, dict) else None
    if (
        isinstance(named, list)
        and named
        and all(type(i) is int and 0 <= i < batch for i in named)
        and len(set(named)) == len(named)
    ):
        rows = tuple(named)
    kind = "model" if status == MODEL_STATUS else "input"
    return WorkerCallError(
        address, kind, f"HTTP {status}: {text}", status=status, worker_fault=False, rows=rows
    )


def busy_of(document: object) -> WorkerBusy | None:
    """What a ready answer's body says of batches under way: the agent's ``"busy": true``
    with ``in_flight``, ``busy_s`` and ``busy_timeout_s`` (numbers; 1, 0 and None when
    missing or odd); None when not busy or not said (a server that is not the agent)."""
    if not isinstance(document, dict) or document.get("busy") is not True:
        return None
    in_flight = document.get("in_flight")
    busy_s = _number(document.get("busy_s"))
    timeout_s = _number(document.get("busy_timeout_s"))
    return WorkerBusy(
        in_flight if type(in_flight) is int and in_flight > 0 else 1,
        max(0.0, busy_s or 0.0),
        timeout_s if timeout_s is not None and timeout_s > 0 else None,
    )


def _number(value: object) -> float | None:
    """``value`` as a finite float; None when it is not a finite number (a bool is not)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def _error_document(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _error_text(body: bytes, document: object) -> str:
    if document is None:
        return body[:200].decode("utf-8", "replace").strip() or "no body"
    if isinstance(document, dict) and isinstance(document.get("error"), str):
        return str(document["error"])[:200]
    return str(document)[:200]
