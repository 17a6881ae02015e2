"""The worker agent: what a provisioned instance runs to serve the app's models over HTTP.

This module owns the agent's command line, its HTTP interface, the validation of inference
requests, the batch execution (one batch at a time, as the simulator and the dispatcher assume
of an instance), latency padding on emulated types (arithmetic in
:mod:`provisioners.worker.emulation`), the per-model latency statistics it reports, and its
lifecycle (listening at once, loading the models behind it, draining on SIGTERM).

Routes (every body is JSON; every error is ``{"error": "one line"}``):

- ``GET /health``: 200 ``{"status": "ok", "instance_type", "models", "emulated", "speed_factor",
  "uptime_s", "worker_id", "pid"}`` once the models are loaded; 503 with ``status`` ``loading``,
  ``stopping`` or ``failed`` before or after.
- ``GET /stats``: per model, the requests and rows served and percentiles (p50, p90, p99, max,
  mean) of the measured compute ``latency_ms``, of ``served_ms`` and of ``padded_ms`` over the
  last :data:`STATS_WINDOW` requests.
- ``POST /infer`` ``{"model": "tiny", "inputs": [[64 numbers in 0..16], ...]}``: the inputs are
  one batch, computed in one call of the family's ``predict``; 200 ``{"model", "instance_type",
  "batch_size", "predictions", "certainty", "latency_ms" (measured compute), "padded_ms" (slept
  after it), "served_ms" (compute plus padding, as measured), "queued_ms" (waiting for the
  previous batch), "emulated", "emulated_ms" (the emulated type's latency for this batch, null
  when not emulated), "emulation_source"}``. 400 on a malformed request, 404 on a model this
  worker does not serve, 413 on a body over :data:`MAX_BODY_BYTES`, 503 while loading or
  stopping.

Emulation: with ``--speed-factor F`` (the local provisioner passes the catalog's), the worker
stands in for ``--instance-type`` and pads every batch to that type's latency; ``--profile FILE``
(the profile JSON of ``heteroplane profile measure``) supplies the curves, its ``compute`` section
(a real model's compute on a type of speed factor 1, over F) when it has one, and without a file
the target is the measured latency / F. ``--no-pad``, no speed factor, or the reference type
``local.cpu`` itself: no padding, ``emulated: false``. The padding sleep holds the batch lock, so
an emulated slow type also serves fewer batches per second, not only slower ones.

Like the rest of ``provisioners/``, it imports nothing else from the repository. torch comes in
with the family when the models are loaded, so ``--help`` and the request parsing do not need it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from provisioners.worker.emulation import (
    REFERENCE_TYPE,
    Emulation,
    EmulationError,
    read_curves,
)

__all__ = [
    "DEFAULT_MODELS",
    "MAX_BATCH_SIZE",
    "MAX_BODY_BYTES",
    "STATS_WINDOW",
    "AgentConfig",
    "InferRequest",
    "RequestError",
    "WorkerAgent",
    "build_emulation",
    "latency_summary",
    "main",
    "parse_args",
    "parse_infer_request",
    "serve",
]

# The family's input shape and pixel range (provisioners.worker.family.N_FEATURES, PIXEL_MAX;
# repeated here so that parsing a request does not import torch; a unit test keeps them equal).
N_FEATURES = 64
PIXEL_MAX = 16.0
DEFAULT_MODELS: tuple[str, ...] = ("tiny", "small", "medium", "large")
# The profiler's largest batch size; a bigger batch is a client's mistake, not a load to serve.
MAX_BATCH_SIZE = 4096
# A batch of MAX_BATCH_SIZE rows of 64 numbers written as JSON is about 1.5 MiB (up to ~6 bytes
# a number); 16 MiB leaves room for long float spellings.
MAX_BODY_BYTES = 16 * 1024 * 1024
STATS_WINDOW = 4096
DEFAULT_DRAIN_S = 3.0
# An idle keep-alive connection is closed after this long, so its thread does not linger.
IDLE_CONNECTION_S = 30.0

PredictFn = Callable[[Any, np.ndarray], tuple[np.ndarray, np.ndarray]]
SleepFn = Callable[[float], None]


class RequestError(Exception):
    """A request the agent refuses: ``status`` is the HTTP status, the message one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status


@dataclass(frozen=True, slots=True, eq=False)
class InferRequest:
    """One validated inference request: a batch of ``inputs`` rows (float32, shape (n, 64))."""

    model: str
    inputs: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])


def parse_infer_request(
    body: bytes, models: Collection[str], *, max_batch_size: int = MAX_BATCH_SIZE
) -> InferRequest:
    """Validate a ``POST /infer`` body: a JSON object with ``model`` (one of ``models``, else
    404) and ``inputs``, a non-empty list of at most ``max_batch_size`` rows of 64 finite numbers
    in 0..16 (else 400)."""
    try:
        document = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
    unknown = sorted(set(document) - {"model", "inputs"})
    if unknown:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"unknown keys: {', '.join(unknown)}")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(HTTPStatus.BAD_REQUEST, "'model' must be a non-empty string")
    if model not in models:
        raise RequestError(
            HTTPStatus.NOT_FOUND,
            f"model {model!r} is not served here (served: {', '.join(sorted(models))})",
        )
    rows = document.get("inputs")
    if not isinstance(rows, list) or not rows:
        raise RequestError(HTTPStatus.BAD_REQUEST, "'inputs' must be a non-empty list of rows")
    if len(rows) > max_batch_size:
        raise RequestError(
            HTTPStatus.BAD_REQUEST, f"batch of {len(rows)} rows is over the limit {max_batch_size}"
        )
    return InferRequest(model, _pixel_rows(rows))


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _pixel_rows(rows: list[Any]) -> np.ndarray:
    if not all(isinstance(row, list) and len(row) == N_FEATURES for row in rows):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, f"every row of 'inputs' must be a list of {N_FEATURES} numbers"
        )
    try:
        array = np.asarray(rows)
    except ValueError:
        array = np.asarray([], dtype=object)
    # JSON numbers give an integer or float array; strings, booleans alone, nulls or nesting do
    # not (numpy turns them into str, bool or object arrays).
    if array.dtype.kind not in "iuf" or array.shape != (len(rows), N_FEATURES):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, f"every row of 'inputs' must be a list of {N_FEATURES} numbers"
        )
    values = array.astype(np.float64)
    if not np.all(np.isfinite(values)) or values.min() < 0 or values.max() > PIXEL_MAX:
        raise RequestError(
            HTTPStatus.BAD_REQUEST, f"pixel values must lie in 0..{PIXEL_MAX:g} (raw intensities)"
        )
    return values.astype(np.float32)


def latency_summary(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90, p99 and max of ``values`` (ms), rounded to the microsecond; ``None``
    each when there are none. Percentiles by linear interpolation (numpy's default).

    >>> latency_summary([1.0, 2.0, 3.0, 4.0])["p50"]
    2.5
    """
    keys = ("mean", "p50", "p90", "p99", "max")
    if not values:
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    numbers = (array.mean(), p50, p90, p99, array.max())
    return {key: round(float(value), 3) for key, value in zip(keys, numbers, strict=True)}


class _ModelStats:
    """The last :data:`STATS_WINDOW` requests of one model, and the totals."""

    def __init__(self) -> None:
        self.requests = 0
        self.rows = 0
        self.latency_ms: deque[float] = deque(maxlen=STATS_WINDOW)
        self.served_ms: deque[float] = deque(maxlen=STATS_WINDOW)
        self.padded_ms: deque[float] = deque(maxlen=STATS_WINDOW)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The agent's settings, from its command line (see :func:`parse_args`)."""

    host: str
    port: int
    instance_type: str
    models: tuple[str, ...]
    cache_dir: Path | None = None
    speed_factor: float | None = None
    profile: Path | None = None
    pad: bool = True
    threads: int = 1
    worker_id: str | None = None
    listen_fd: int | None = None
    drain_s: float = DEFAULT_DRAIN_S
    max_batch_size: int = MAX_BATCH_SIZE


def build_emulation(config: AgentConfig) -> Emulation:
    """The emulation ``config`` asks for: none without a speed factor, with ``--no-pad`` or on
    the reference type; else the speed factor with the profile file's curves when one is given
    (its compute section, or its own-type and reference curves: see
    :mod:`provisioners.worker.emulation`).

    Raises :class:`~provisioners.worker.emulation.EmulationError` on a bad factor or file.
    """
    if config.speed_factor is None or not config.pad or config.instance_type == REFERENCE_TYPE:
        return Emulation(config.instance_type, None)
    if config.profile is None:
        return Emulation(config.instance_type, config.speed_factor)
    curves = read_curves(config.profile, config.models, config.instance_type)
    return Emulation(
        config.instance_type, config.speed_factor, curves.own, curves.reference, curves.origin
    )


class WorkerAgent:
    """The agent's state and behaviour, apart from HTTP: readiness, batches, statistics.

    ``predict`` is the family's ``predict`` (a stand-in in unit tests); ``sleep`` pads (seconds).
    Batches run one at a time under a lock; the padding sleep holds it too.
    """

    def __init__(
        self,
        config: AgentConfig,
        emulation: Emulation,
        *,
        predict: PredictFn | None = None,
        sleep: SleepFn = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.emulation = emulation
        self._predict = predict
        self._sleep = sleep
        self._clock = clock
        self._started = clock()
        self._models: dict[str, Any] = {}
        self._status = "loading"
        self._failure: str | None = None
        self._batch_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = {name: _ModelStats() for name in config.models}
        self._in_flight = 0
        self._idle = threading.Condition()

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        """``loading``, ``ok``, ``stopping`` or ``failed``."""
        return self._status

    def set_models(self, models: Mapping[str, Any], predict: PredictFn | None = None) -> None:
        """The loaded models (and the predict function); the agent is ready from now on."""
        self._models = dict(models)
        if predict is not None:
            self._predict = predict
        if self._status == "loading":
            self._status = "ok"

    def fail(self, reason: str) -> None:
        self._failure = " ".join(reason.split())
        self._status = "failed"

    def stop(self) -> None:
        """Refuse new batches from now on (health says ``stopping``)."""
        if self._status != "failed":
            self._status = "stopping"

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the batches under way; whether none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)

    # --- routes ---------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {
            "status": self._status,
            "instance_type": self.config.instance_type,
            "models": list(self.config.models),
            "emulated": self.emulation.emulated,
            "speed_factor": self.emulation.speed_factor,
            "uptime_s": round(self._clock() - self._started, 3),
            "worker_id": self.config.worker_id,
            "pid": os.getpid(),
        }
        if self._failure is not None:
            body["error"] = self._failure
        return (HTTPStatus.OK if self._status == "ok" else HTTPStatus.SERVICE_UNAVAILABLE), body

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            models = {
                name: {
                    "requests": s.requests,
                    "rows": s.rows,
                    "latency_ms": latency_summary(s.latency_ms),
                    "served_ms": latency_summary(s.served_ms),
                    "padded_ms": latency_summary(s.padded_ms),
                }
                for name, s in self._stats.items()
            }
        return {
            "instance_type": self.config.instance_type,
            "emulated": self.emulation.emulated,
            "speed_factor": self.emulation.speed_factor,
            "uptime_s": round(self._clock() - self._started, 3),
            "window": STATS_WINDOW,
            "models": models,
        }

    def infer(self, body: bytes) -> dict[str, Any]:
        """Serve one ``POST /infer`` body; raises :class:`RequestError` on a refusal."""
        if self._status != "ok":
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"worker is {self._status}")
        request = parse_infer_request(
            body, self.config.models, max_batch_size=self.config.max_batch_size
        )
        with self._idle:
            self._in_flight += 1
        try:
            return self._run(request)
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _run(self, request: InferRequest) -> dict[str, Any]:
        predict = self._predict
        if predict is None:
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "worker is loading")
        model = self._models[request.model]
        arrived = self._clock()
        with self._batch_lock:
            start = self._clock()
            predictions, certainty = predict(model, request.inputs)
            measured_ms = (self._clock() - start) * 1000.0
            target_ms = self.emulation.target_ms(
                request.model, request.batch_size, measured_ms=measured_ms
            )
            pad_ms = self.emulation.padding_ms(
                request.model, request.batch_size, measured_ms=measured_ms
            )
            if pad_ms > 0:
                self._sleep(pad_ms / 1000.0)
            served_ms = (self._clock() - start) * 1000.0
        queued_ms = (start - arrived) * 1000.0
        with self._stats_lock:
            entry = self._stats[request.model]
            entry.requests += 1
            entry.rows += request.batch_size
            entry.latency_ms.append(measured_ms)
            entry.served_ms.append(served_ms)
            entry.padded_ms.append(pad_ms)
        return {
            "model": request.model,
            "instance_type": self.config.instance_type,
            "batch_size": request.batch_size,
            "predictions": np.asarray(predictions).astype(int).tolist(),
            "certainty": np.asarray(certainty, dtype=np.float64).tolist(),
            "latency_ms": round(measured_ms, 3),
            "padded_ms": round(pad_ms, 3),
            "served_ms": round(served_ms, 3),
            "queued_ms": round(queued_ms, 3),
            "emulated": self.emulation.emulated,
            "emulated_ms": round(target_ms, 3) if self.emulation.emulated else None,
            "emulation_source": self.emulation.source(request.model),
        }


# --- HTTP -----------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], agent: WorkerAgent, sock: socket.socket | None):
        super().__init__(address, _Handler, bind_and_activate=sock is None)
        self.agent = agent
        if sock is not None:
            # A socket bound and listening already, handed over by the local provisioner: no
            # window in which another process could take the port.
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()[:2]
            self.server_name, self.server_port = str(address[0]), int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "heteroplane-worker/1"
    timeout = IDLE_CONNECTION_S
    # TCP_NODELAY: an answer leaves in two writes (the head, then the body). With Nagle's
    # algorithm the body waits for the client's ACK of the head, which a kept-alive client
    # delays by up to 40 ms (Linux's delayed ACK): every call took ~44 ms instead of ~1.
    disable_nagle_algorithm = True
    server: _Server

    def do_GET(self) -> None:
        agent = self.server.agent
        path = self.path.split("?", 1)[0]
        if path == "/health":
            status, body = agent.health()
            self._reply(status, body)
        elif path == "/stats":
            self._reply(HTTPStatus.OK, agent.stats())
        elif path == "/infer":
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST /infer")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self._body()
        except RequestError as error:
            self.close_connection = True
            self._error(error.status, str(error))
            return
        if path != "/infer":
            status = HTTPStatus.METHOD_NOT_ALLOWED if path in ("/health", "/stats") else 404
            self._error(status, f"no route POST {path}")
            return
        try:
            self._reply(HTTPStatus.OK, self.server.agent.infer(body))
        except RequestError as error:
            self._error(error.status, str(error))

    def _body(self) -> bytes:
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        try:
            length = int(length_text)
        except ValueError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if length < 0:
            raise RequestError(HTTPStatus.BAD_REQUEST, "Content-Length is negative")
        if length > MAX_BODY_BYTES:
            raise RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {length} bytes is over the limit {MAX_BODY_BYTES}",
            )
        return self.rfile.read(length)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, {"error": message})

    def _reply(self, status: int, body: Mapping[str, Any]) -> None:
        data = (json.dumps(body, separators=(",", ":")) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # One line per request would flood the log under load; errors reach the client instead.
        return


# --- command line and main loop -------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> AgentConfig:
    """The agent's command line (``python -m provisioners.worker --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m provisioners.worker",
        description="heteroplane's worker agent: serve the demo family's models over HTTP"
        " (GET /health, GET /stats, POST /infer), padding latency to an emulated type's.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (%(default)s)")
    parser.add_argument(
        "--listen-fd",
        type=int,
        metavar="FD",
        help="serve on this inherited, already listening socket instead of binding --port",
    )
    parser.add_argument(
        "--instance-type", required=True, help="the instance type this worker runs as"
    )
    parser.add_argument(
        "--speed-factor",
        type=float,
        metavar="F",
        help="emulate a type F times as fast as the reference machine (local.cpu)",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        metavar="M1,M2,...",
        help="models of the family to serve (default %(default)s)",
    )
    parser.add_argument("--cache-dir", type=Path, metavar="DIR", help="the family's model cache")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="profile JSON whose compute curves the worker pads to (heteroplane profile measure"
        " writes them; a file without them: its own type's, else the reference type's curves)",
    )
    parser.add_argument(
        "--pad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pad latency to the emulated type's (default: on when a speed factor is given)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per batch (%(default)s)"
    )
    parser.add_argument("--worker-id", help="an id to report in /health (the provider's id)")
    parser.add_argument(
        "--drain-s",
        type=float,
        default=DEFAULT_DRAIN_S,
        help="on SIGTERM, wait this long for batches under way (%(default)s)",
    )
    args = parser.parse_args(argv)
    models = tuple(name.strip() for name in str(args.models).split(","))
    if not models or any(not name for name in models) or len(set(models)) != len(models):
        parser.error(f"--models {args.models!r}: expected distinct names separated by commas")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is outside 0..65535")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    factor = args.speed_factor
    if factor is not None and (not math.isfinite(factor) or factor <= 0):
        parser.error(f"--speed-factor must be a positive number, got {factor}")
    return AgentConfig(
        host=args.host,
        port=args.port,
        instance_type=args.instance_type,
        models=models,
        cache_dir=args.cache_dir,
        speed_factor=factor,
        profile=args.profile,
        pad=args.pad,
        threads=args.threads,
        worker_id=args.worker_id,
        listen_fd=args.listen_fd,
        drain_s=max(0.0, args.drain_s),
    )


def _load(agent: WorkerAgent, config: AgentConfig, failed: threading.Event) -> None:
    """Load the family's models (training them first when the cache lacks them)."""
    try:
        import torch

        from provisioners.worker import family

        torch.set_num_threads(config.threads)
        directory = family.ensure_family(config.cache_dir)
        models = {name: family.load_model(name, directory) for name in config.models}
        # One untimed batch each: the first call of a model pays for allocations and lazy
        # initialisation, which is no part of its serving latency.
        warmup = np.zeros((1, N_FEATURES), dtype=np.float32)
        for model in models.values():
            family.predict(model, warmup)
    except Exception as error:  # any failure to load ends the worker with its reason
        agent.fail(f"cannot load the models: {error}")
        print(f"worker: cannot load the models: {error}", file=sys.stderr, flush=True)
        failed.set()
        return
    agent.set_models(models, family.predict)
    print(
        f"worker: serving {', '.join(config.models)} as {config.instance_type}"
        f" (emulated: {agent.emulation.emulated})",
        file=sys.stderr,
        flush=True,
    )


def serve(config: AgentConfig) -> int:
    """Listen, load the models behind the listening socket, serve until SIGTERM or SIGINT, drain
    the batches under way and exit: 0 after a signal, 1 when the models could not be loaded."""
    try:
        emulation = build_emulation(config)
    except EmulationError as error:
        print(f"worker: {error}", file=sys.stderr, flush=True)
        return 2
    agent = WorkerAgent(config, emulation)
    try:
        sock = socket.socket(fileno=config.listen_fd) if config.listen_fd is not None else None
        server = _Server((config.host, config.port), agent, sock)
    except OSError as error:
        where = f"fd {config.listen_fd}" if config.listen_fd is not None else config.port
        print(f"worker: cannot listen on {config.host}:{where}: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    failed = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    serving = threading.Thread(target=server.serve_forever, args=(0.1,), name="http", daemon=True)
    serving.start()
    loading = threading.Thread(target=_load, args=(agent, config, failed), name="load", daemon=True)
    loading.start()
    # The main thread waits for a signal (handlers run here) or a failed load.
    while not stop.wait(0.2):
        if failed.is_set():
            break
    agent.stop()
    agent.drain(config.drain_s)
    server.shutdown()
    server.server_close()
    return 1 if failed.is_set() else 0


def main(argv: Sequence[str] | None = None) -> int:
    return serve(parse_args(argv))
