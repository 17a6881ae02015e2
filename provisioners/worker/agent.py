"""The worker agent: what a provisioned instance runs to serve the app's models over HTTP.

This module owns the agent's command line, its HTTP interface (the Open Inference Protocol v2,
REST; the wire format is :mod:`provisioners.worker.oip`), the batch execution (one batch at a
time, as the simulator and the dispatcher assume of an instance), latency padding on emulated
types (arithmetic in :mod:`provisioners.worker.emulation`), the per-model latency statistics it
reports, and its lifecycle (listening at once, loading the models behind it, draining on
SIGTERM).

What it serves: the demo family's models by name (``--models tiny,small``; each under
:data:`~provisioners.artifacts.FAMILY_SIGNATURE`, answering the family's raw logits), and models
users bring (``--artifact NAME:MODEL:VERSION:FORMAT:SHA256:URI``, repeatable: fetched and
verified with :func:`~provisioners.fetch.fetch_artifact` into ``--cache-dir``'s
``artifacts/`` or a temporary folder, loaded with :mod:`provisioners.worker.runtime`, served as
NAME; ``--artifact-inputs NAME=JSON`` gives the inputs of a TorchScript module whose archive does
not name them, as the registry stored them; ``--artifacts-file FILE`` adds both from a file, one
``OPTION VALUE`` a line, as the EC2 provisioner's bootstrap writes them). With artifacts and no
``--models``, no family model is loaded.

Routes (every body is JSON, but an infer request's in binary tensors; every error is
``{"error": "one line"}``):

- ``GET /v2/health/live``: 200 ``{"live": true}`` while the process serves HTTP.
- ``GET /v2/health/ready``: 200 ``{"ready": true, "busy", "in_flight", "busy_s",
  "busy_timeout_s"}`` once the models are loaded, else 503 ``{"ready": false, "status"}``.
  ``busy``: a batch is under way (``in_flight`` batches, running or waiting for the one
  running; the oldest arrived ``busy_s`` ago, and its caller waits ``busy_timeout_s`` for it:
  the request's ``parameters.timeout``, null without one), which the dispatcher reads of a
  worker back from a timed-out call and the reconciler's liveness probe of a stuck one.
- ``GET /v2/models/{m}``: 200 ``{"name", "versions": ["1"], "platform", "inputs", "outputs"}``
  (:func:`~provisioners.worker.oip.model_metadata`). ``GET /v2/models/{m}/ready``: 200
  ``{"name", "ready": true}``.
- ``POST /v2/models/{m}/infer`` (``/v2/models/{m}/versions/1/infer`` too): an Open Inference
  Protocol request (:func:`~provisioners.worker.oip.parse_infer_request`), in JSON or, with the
  header ``Inference-Header-Content-Length``, in Triton's binary tensors (how the dispatcher
  sends every batch); its inputs are one batch, run in one call of the model. 200
  ``{"model_name", "model_version": "1", "id" (when the request has one), "outputs": [{"name",
  "datatype", "shape", "data"}], "parameters":
  {"instance_type", "served_ms" (compute plus padding, as measured), "latency_ms" (measured
  compute), "padded_ms" (slept after it), "queued_ms" (waiting for the previous batch),
  "emulated", "emulated_ms" (the emulated type's latency for this batch, null when not
  emulated), "emulation_source"}}``.
- ``GET /health``: 200 ``{"status": "ok", "instance_type", "models", "artifacts", "emulated",
  "speed_factor", "uptime_s", "worker_id", "pid", "protocol", "busy", "in_flight", "busy_s",
  "busy_timeout_s"}``
  (``busy`` and the others as ``/v2/health/ready``'s; ``protocol``: what it reads,
  :data:`~provisioners.worker.oip.WORKER_PROTOCOL`) once the models are loaded; 503 with
  ``status`` ``loading``, ``stopping`` or ``failed`` before or after (the local provisioner
  polls it).
- ``GET /stats``: per model, the requests and rows served and percentiles (p50, p90, p99, max,
  mean) of the measured compute ``latency_ms``, of ``served_ms`` and of ``padded_ms`` over the
  last :data:`STATS_WINDOW` requests.

Errors: 400 on a malformed request or one that does not fit the model's signature (the message
names the input), 404 on a model this worker does not serve (or a route it does not have), 413
on a body over :data:`MAX_BODY_BYTES`, 503 while loading or stopping. When the model raises on
a batch, each of its rows is run again alone: when every row passes, the batch is answered
(200); else the answer names the rows that fail, ``{"error", "failed_rows": [i, ...]}``, with
422 when the inputs are at fault (some rows pass, or the model's error says so: an index out of
range, a wrong shape or type) and 500 otherwise. Either way the worker serves on: the
dispatcher fails the queries of those rows alone and sends the others again
(:func:`input_at_fault`). The rows run alone for half the request's ``parameters.timeout`` at
most (the dispatcher sends its call's timeout); past it the answer names no rows.

Emulation: with ``--speed-factor F`` (the local provisioner passes the catalog's), the worker
stands in for ``--instance-type`` and pads every batch to that type's latency; ``--profile FILE``
(the profile JSON of ``heteroplane profile measure``) supplies the curves, its ``compute`` section
(a real model's compute on a type of speed factor 1, over F) when it has one, and without a file
the target is the measured latency / F. ``--no-pad``, no speed factor, or the reference type
``local.cpu`` itself: no padding, ``emulated: false``. The padding sleep holds the batch lock, so
an emulated slow type also serves fewer batches per second, not only slower ones. Curves are per
served name, artifacts included.

Like the rest of ``provisioners/``, it imports nothing else from the repository. torch and
onnxruntime come in with the models when they are loaded, so ``--help`` and the request parsing
do not need them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np

from provisioners.artifacts import ArtifactError, ArtifactRef, parse_artifact_inputs
from provisioners.fetch import fetch_artifact
from provisioners.worker.emulation import (
    REFERENCE_TYPE,
    Emulation,
    EmulationError,
    read_curves,
)
from provisioners.worker.oip import (
    HEADER_LENGTH,
    MODEL_VERSION,
    WORKER_PROTOCOL,
    InferRequest,
    OipError,
    infer_response,
    load_json,
    model_metadata,
    parse_infer_request,
    split_infer_body,
    with_binary_inputs,
)
from provisioners.worker.runtime import DEVICES, ModelRuntime, first_line, torchscript_error

__all__ = [
    "DEFAULT_MODELS",
    "MAX_BATCH_SIZE",
    "MAX_BODY_BYTES",
    "STATS_WINDOW",
    "AgentConfig",
    "LoadFailedError",
    "RequestError",
    "WorkerAgent",
    "build_emulation",
    "input_at_fault",
    "latency_summary",
    "load_models",
    "main",
    "parse_args",
    "serve",
]

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
# Where fetched artifacts are kept under --cache-dir.
ARTIFACTS_DIR = "artifacts"

SleepFn = Callable[[float], None]


class RequestError(Exception):
    """A request the agent refuses: ``status`` is the HTTP status, the message one line;
    ``failed_rows``: for a batch the model raised on, the rows (0-based) that fail alone."""

    def __init__(self, status: int, message: str, failed_rows: Sequence[int] | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status
        self.failed_rows = None if failed_rows is None else list(failed_rows)


# What a model raises on inputs it cannot take (an index out of range, a wrong shape or type):
# the types, and words of the message (torch raises RuntimeError for a shape mismatch,
# onnxruntime its own InvalidArgument).
_INPUT_ERRORS = (IndexError, ValueError, TypeError, KeyError)
_INPUT_ERROR_NAMES = frozenset({"InvalidArgument", "InvalidGraph"})
_INPUT_ERROR_TYPE_NAMES = frozenset(error.__name__ for error in _INPUT_ERRORS)
_INPUT_WORDS = re.compile(
    r"out of (\w+ )?(range|bounds)|invalid argument|shape|dimension|dtype|size mismatch|"
    r"must match the size|expected .*type",
    re.IGNORECASE,
)


def input_at_fault(error: BaseException) -> bool:
    """Whether a model's exception says its inputs are at fault (see :data:`_INPUT_WORDS`). A
    TorchScript model's error is judged by the error its traceback ends with (a ``raise
    ValueError(...)`` in the model's code is one of :data:`_INPUT_ERRORS`), not by the model's
    code the rest of its text quotes (a ``x.shape`` there is no shape error)."""
    if isinstance(error, _INPUT_ERRORS) or type(error).__name__ in _INPUT_ERROR_NAMES:
        return True
    reason = torchscript_error(error)
    if reason is not None:
        name = reason.partition(":")[0].strip()
        if name in _INPUT_ERROR_TYPE_NAMES or name in _INPUT_ERROR_NAMES:
            return True
        return _INPUT_WORDS.search(reason) is not None
    return _INPUT_WORDS.search(str(error)) is not None


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
    """The agent's settings, from its command line (see :func:`parse_args`). ``models`` are
    every name served, the family's first, then the artifacts' (``artifacts[i].name``)."""

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
    artifacts: tuple[ArtifactRef, ...] = ()
    device: str = "cpu"

    @property
    def family_models(self) -> tuple[str, ...]:
        """The served names that are the demo family's models (not artifacts)."""
        brought = {ref.name for ref in self.artifacts}
        return tuple(name for name in self.models if name not in brought)


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

    The models are :class:`~provisioners.worker.runtime.ModelRuntime` objects by served name
    (stand-ins in unit tests), given by :meth:`set_models` once loaded; ``sleep`` pads
    (seconds), ``clock`` times (seconds). Batches run one at a time under a lock; the padding
    sleep holds it too.
    """

    def __init__(
        self,
        config: AgentConfig,
        emulation: Emulation,
        *,
        sleep: SleepFn = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.emulation = emulation
        self._sleep = sleep
        self._clock = clock
        self._started = clock()
        self._models: dict[str, ModelRuntime] = {}
        self._status = "loading"
        self._failure: str | None = None
        self._batch_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = {name: _ModelStats() for name in config.models}
        # When each batch in flight (running, or waiting for the one running) arrived (clock),
        # and how long its caller waits for it (s; None: not said).
        self._arrivals: list[tuple[float, float | None]] = []
        self._idle = threading.Condition()

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def status(self) -> str:
        """``loading``, ``ok``, ``stopping`` or ``failed``."""
        return self._status

    def set_models(self, models: Mapping[str, ModelRuntime]) -> None:
        """The loaded models by served name; the agent is ready from now on."""
        self._models = dict(models)
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
            return self._idle.wait_for(lambda: not self._arrivals, timeout=timeout_s)

    def busy(self) -> dict[str, Any]:
        """Whether a batch is under way: ``busy``, ``in_flight`` (batches running or waiting
        for the one running), ``busy_s`` (since the oldest of them arrived; 0 when none) and
        ``busy_timeout_s`` (how long the oldest one's caller waits for it; None when it did not
        say, or none is under way)."""
        with self._idle:
            in_flight = len(self._arrivals)
            # By arrival alone: two on the same clock reading compared their timeouts, a
            # number against None (a TypeError, no health answer).
            oldest = min(self._arrivals, key=lambda arrival: arrival[0], default=None)
        if oldest is None:
            busy_s, timeout_s = 0.0, None
        else:
            busy_s, timeout_s = round(max(0.0, self._clock() - oldest[0]), 3), oldest[1]
        return {
            "busy": in_flight > 0,
            "in_flight": in_flight,
            "busy_s": busy_s,
            "busy_timeout_s": timeout_s,
        }

    # --- routes ---------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``."""
        body: dict[str, Any] = {
            "status": self._status,
            "instance_type": self.config.instance_type,
            "models": list(self.config.models),
            "artifacts": [ref.to_json() for ref in self.config.artifacts],
            "emulated": self.emulation.emulated,
            "speed_factor": self.emulation.speed_factor,
            "uptime_s": round(self._clock() - self._started, 3),
            "worker_id": self.config.worker_id,
            "pid": os.getpid(),
            "protocol": WORKER_PROTOCOL,
            **self.busy(),
        }
        if self._failure is not None:
            body["error"] = self._failure
        return (HTTPStatus.OK if self._status == "ok" else HTTPStatus.SERVICE_UNAVAILABLE), body

    def ready(self) -> tuple[int, dict[str, Any]]:
        """``GET /v2/health/ready``."""
        if self._status == "ok":
            return HTTPStatus.OK, {"ready": True, **self.busy()}
        body: dict[str, Any] = {"ready": False, "status": self._status}
        if self._failure is not None:
            body["error"] = self._failure
        return HTTPStatus.SERVICE_UNAVAILABLE, body

    def metadata(self, model: str) -> dict[str, Any]:
        """``GET /v2/models/{model}``; raises :class:`RequestError` (404, 503)."""
        runtime = self._runtime(model)
        return model_metadata(model, runtime.signature, runtime.platform, (MODEL_VERSION,))

    def model_ready(self, model: str) -> dict[str, Any]:
        """``GET /v2/models/{model}/ready``; raises :class:`RequestError` (404, 503)."""
        self._runtime(model)
        return {"name": model, "ready": True}

    def stats(self) -> dict[str, Any]:
        """``GET /stats``."""
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

    def infer(
        self, model: str, body: bytes | Mapping[str, Any], header_length: str | None = None
    ) -> dict[str, Any]:
        """Serve one ``POST /v2/models/{model}/infer`` body (bytes, or its JSON decoded;
        ``header_length``, the header :data:`~provisioners.worker.oip.HEADER_LENGTH`: the bytes
        are binary tensors after a JSON part that long); raises :class:`RequestError` on a
        refusal."""
        runtime = self._runtime(model)
        try:
            if header_length is not None and isinstance(body, bytes):
                document, binary = split_infer_body(body, header_length)
                if isinstance(document, Mapping):
                    body = with_binary_inputs(document, binary, runtime.signature)
                else:
                    body = document  # parse_infer_request says what is wrong
            elif isinstance(body, bytes):
                # Decoded here, once: its parameters.timeout is read below as well (a JSON
                # body's went unread: no bound on its rows alone, no timeout in health).
                body = load_json(body)
            request = parse_infer_request(
                body, runtime.signature, max_batch_size=self.config.max_batch_size
            )
        except OipError as error:
            raise RequestError(error.status, str(error)) from None
        timeout_s = caller_timeout_s(body)
        budget_s = None if timeout_s is None else timeout_s / 2.0
        stop_s = None if budget_s is None else self._clock() + budget_s
        arrived = (self._clock(), timeout_s)
        with self._idle:
            self._arrivals.append(arrived)
        try:
            return self._run(model, runtime, request, stop_s)
        finally:
            with self._idle:
                self._arrivals.remove(arrived)
                self._idle.notify_all()

    def _runtime(self, model: str) -> ModelRuntime:
        if self._status != "ok":
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"worker is {self._status}")
        runtime = self._models.get(model)
        if runtime is None:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                f"model {model!r} is not served here (served: {', '.join(sorted(self._models))})",
            )
        return runtime

    def _run(
        self, model: str, runtime: ModelRuntime, request: InferRequest, stop_s: float | None
    ) -> dict[str, Any]:
        batch_size = request.batch_size
        arrived = self._clock()
        with self._batch_lock:
            start = self._clock()
            try:
                outputs = runtime.run(request.inputs)
            except Exception as error:  # the model's own failure on this batch
                outputs = _rows_alone(model, runtime, request, error, self._clock, stop_s)
            measured_ms = (self._clock() - start) * 1000.0
            target_ms = self.emulation.target_ms(model, batch_size, measured_ms=measured_ms)
            pad_ms = self.emulation.padding_ms(model, batch_size, measured_ms=measured_ms)
            if pad_ms > 0:
                self._sleep(pad_ms / 1000.0)
            served_ms = (self._clock() - start) * 1000.0
        queued_ms = (start - arrived) * 1000.0
        with self._stats_lock:
            entry = self._stats[model]
            entry.requests += 1
            entry.rows += batch_size
            entry.latency_ms.append(measured_ms)
            entry.served_ms.append(served_ms)
            entry.padded_ms.append(pad_ms)
        names = request.outputs or tuple(spec.name for spec in runtime.signature.outputs)
        parameters = {
            "instance_type": self.config.instance_type,
            "served_ms": round(served_ms, 3),
            "latency_ms": round(measured_ms, 3),
            "padded_ms": round(pad_ms, 3),
            "queued_ms": round(queued_ms, 3),
            "emulated": self.emulation.emulated,
            "emulated_ms": round(target_ms, 3) if self.emulation.emulated else None,
            "emulation_source": self.emulation.source(model),
        }
        try:
            return infer_response(
                model, outputs, names=names, request_id=request.id, parameters=parameters
            )
        except (OipError, KeyError) as error:
            raise RequestError(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                f"model {model!r} answered outputs that do not fit its signature: {error}",
            ) from None


def caller_timeout_s(document: object) -> float | None:
    """How long the caller waits for the answer, s: the request's ``parameters.timeout``
    (microseconds, the protocol's way, which the dispatcher sends with each batch: its call's
    timeout); None without one (no bound). A failed batch's rows may be run again alone for
    half of it; the health answers say it of the oldest batch under way."""
    parameters = document.get("parameters") if isinstance(document, Mapping) else None
    timeout = parameters.get("timeout") if isinstance(parameters, Mapping) else None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        return None
    try:
        timeout_s = float(timeout) / 1e6
    except OverflowError:  # a JSON integer past any float: no bound
        return None
    return timeout_s if math.isfinite(timeout_s) and timeout_s > 0 else None


def _rows_alone(
    model: str,
    runtime: ModelRuntime,
    request: InferRequest,
    error: Exception,
    clock: Callable[[], float] = time.monotonic,
    stop_s: float | None = None,
) -> dict[str, np.ndarray]:
    """After the model raised ``error`` on a batch: each row of it run alone, so that a bad row
    fails alone. The rows' outputs stacked when every one passes (the batch failed, its rows do
    not); else :class:`RequestError` naming the rows that fail (``failed_rows``), 422 when the
    inputs are at fault (some rows pass, or the model's error says so: :func:`input_at_fault`),
    else 500. Past ``stop_s`` (on ``clock``; half of :func:`caller_timeout_s`) no more rows
    run: the error names none, and the caller tries each of its queries alone. A slow model's
    batch of hundreds of rows, run again row by row, outlasted the dispatcher's call: the worker
    was taken for hung over a bad row."""
    n = request.batch_size
    failures: dict[int, Exception] = {0: error} if n == 1 else {}
    outputs: list[dict[str, np.ndarray]] = []
    if n > 1:
        for i in range(n):
            if stop_s is not None and clock() > stop_s:
                first = next(iter(failures.values()), error)
                fault = bool(outputs) or input_at_fault(first)
                raise RequestError(
                    HTTPStatus.UNPROCESSABLE_ENTITY if fault else HTTPStatus.INTERNAL_SERVER_ERROR,
                    f"model {model!r} failed on a batch of {n} rows ({i} run again alone before"
                    f" half the caller's timeout): {_reason(first)}",
                )
            row = {name: array[i : i + 1] for name, array in request.inputs.items()}
            try:
                outputs.append(runtime.run(row))
            except Exception as row_error:  # this row's own failure
                failures[i] = row_error
    if not failures:
        try:
            return {name: np.concatenate([o[name] for o in outputs]) for name in outputs[0]}
        except ValueError:  # rows whose outputs differ in shape: the batch's error stands
            failures = dict.fromkeys(range(n), error)
    first = next(iter(failures.values()))
    fault = len(failures) < n or input_at_fault(first)
    rows = sorted(failures)
    which = "the query" if n == 1 else f"{len(rows)} of {n} rows"
    raise RequestError(
        HTTPStatus.UNPROCESSABLE_ENTITY if fault else HTTPStatus.INTERNAL_SERVER_ERROR,
        f"model {model!r} failed on {which}: {_reason(first)}",
        rows,
    )


def _reason(error: BaseException) -> str:
    """A model error's one line, short: onnxruntime's ends with what went wrong (``... Status
    Message: indices element out of data bounds, ...``) after a long preamble."""
    line = first_line(error)
    _, marker, message = line.partition("Status Message: ")
    return message.strip() if marker and message.strip() else line


# --- HTTP -----------------------------------------------------------------------------------------

# /v2/models/{model}[/versions/{version}][/ready|/infer]
_MODEL_PATH = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<action>/ready|/infer)?$"
)
_GET_ONLY = frozenset({"/health", "/stats", "/v2", "/v2/health/live", "/v2/health/ready"})


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
        try:
            if path == "/health":
                self._reply(*agent.health())
            elif path == "/stats":
                self._reply(HTTPStatus.OK, agent.stats())
            elif path == "/v2/health/live":
                self._reply(HTTPStatus.OK, {"live": True})
            elif path == "/v2/health/ready":
                self._reply(*agent.ready())
            elif path == "/v2":
                self._reply(HTTPStatus.OK, {"name": "heteroplane-worker", "version": "1"})
            elif (match := _MODEL_PATH.match(path)) is not None:
                model = _model_of(match)
                if match["action"] == "/infer":
                    self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"use POST {path}")
                elif match["action"] == "/ready":
                    self._reply(HTTPStatus.OK, agent.model_ready(model))
                else:
                    self._reply(HTTPStatus.OK, agent.metadata(model))
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no route {path}")
        except RequestError as error:
            self._error(error.status, str(error))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self._body()
        except RequestError as error:
            self.close_connection = True
            self._error(error.status, str(error))
            return
        match = _MODEL_PATH.match(path)
        if match is None or match["action"] != "/infer":
            if path in _GET_ONLY or match is not None:
                self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"no route POST {path}")
            else:
                hint = " (use POST /v2/models/{model}/infer)" if path == "/infer" else ""
                self._error(HTTPStatus.NOT_FOUND, f"no route POST {path}{hint}")
            return
        try:
            header_length = self.headers.get(HEADER_LENGTH)
            self._reply(
                HTTPStatus.OK, self.server.agent.infer(_model_of(match), body, header_length)
            )
        except RequestError as error:
            if error.failed_rows is None:
                self._error(error.status, str(error))
            else:
                self._reply(error.status, {"error": str(error), "failed_rows": error.failed_rows})

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
        # The head and the body in one write (end_headers would send the head alone): one
        # segment, one wake-up of the reader, instead of two of each per answer.
        self._headers_buffer.extend((b"\r\n", data))  # type: ignore[attr-defined]
        self.flush_headers()

    def log_message(self, format: str, *args: Any) -> None:
        # One line per request would flood the log under load; errors reach the client instead.
        return


def _model_of(match: re.Match[str]) -> str:
    """The model of a ``/v2/models/...`` path; :class:`RequestError` (404) for a version other
    than the one a worker serves."""
    model = unquote(match["model"])
    version = match["version"]
    if version is not None and unquote(version) != MODEL_VERSION:
        raise RequestError(
            HTTPStatus.NOT_FOUND,
            f"model {model!r} has no version {unquote(version)!r} here (only {MODEL_VERSION})",
        )
    return model


# --- command line and main loop -------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> AgentConfig:
    """The agent's command line (``python -m provisioners.worker --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m provisioners.worker",
        description="heteroplane's worker agent: serve the demo family's models and registered"
        " model artifacts over the Open Inference Protocol v2 (GET /v2/health/ready, GET"
        " /v2/models/{m}, POST /v2/models/{m}/infer; GET /health, GET /stats), padding latency"
        " to an emulated type's.",
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
        metavar="M1,M2,...",
        help="models of the family to serve (default: "
        + ",".join(DEFAULT_MODELS)
        + "; none when --artifact is given)",
    )
    parser.add_argument(
        "--artifact",
        action="append",
        default=[],
        metavar="NAME:MODEL:VERSION:FORMAT:SHA256:URI",
        help="a registered model to fetch, verify, load and serve as NAME (repeatable)",
    )
    parser.add_argument(
        "--artifact-inputs",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="the inputs of the artifact served as NAME, a JSON list of {name, datatype, shape}:"
        " for a TorchScript module whose archive does not name them (repeatable)",
    )
    parser.add_argument(
        "--artifacts-file",
        type=Path,
        metavar="FILE",
        help="more --artifact and --artifact-inputs options, one 'OPTION VALUE' a line (how the"
        " EC2 provisioner's bootstrap hands them over); a file that is not there adds none",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="the family's model cache; fetched artifacts go to its artifacts/ (default: a"
        " temporary folder)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where artifacts run (%(default)s; cuda falls back to the CPU where absent)",
    )
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
        "--threads",
        type=int,
        default=1,
        help="threads per batch: torch's, onnxruntime's and numpy's BLAS (%(default)s)",
    )
    parser.add_argument("--worker-id", help="an id to report in /health (the provider's id)")
    parser.add_argument(
        "--drain-s",
        type=float,
        default=DEFAULT_DRAIN_S,
        help="on SIGTERM, wait this long for batches under way (%(default)s)",
    )
    args = parser.parse_args(argv)
    if args.artifacts_file is not None:
        args.artifact, args.artifact_inputs = _artifact_options(
            parser, args.artifacts_file, args.artifact, args.artifact_inputs
        )
    try:
        artifacts = tuple(ArtifactRef.from_arg(text) for text in args.artifact)
        given = dict(parse_artifact_inputs(text) for text in args.artifact_inputs)
    except ArtifactError as error:
        parser.error(str(error))
    unknown = sorted(set(given) - {ref.name for ref in artifacts})
    if unknown:
        parser.error(f"--artifact-inputs for {', '.join(unknown)}: no such --artifact")
    artifacts = tuple(
        dataclasses.replace(ref, inputs=given[ref.name]) if ref.name in given else ref
        for ref in artifacts
    )
    if args.models is None:
        family: tuple[str, ...] = () if artifacts else DEFAULT_MODELS
    else:
        family = tuple(name.strip() for name in str(args.models).split(","))
        if not family or any(not name for name in family) or len(set(family)) != len(family):
            parser.error(f"--models {args.models!r}: expected distinct names separated by commas")
    models = family + tuple(ref.name for ref in artifacts)
    if len(set(models)) != len(models):
        parser.error(f"a model name is served twice: {', '.join(models)}")
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
        artifacts=artifacts,
        device=args.device,
    )


def _artifact_options(
    parser: argparse.ArgumentParser, path: Path, artifact: list[str], inputs: list[str]
) -> tuple[list[str], list[str]]:
    """``--artifact`` and ``--artifact-inputs`` values with those of the file at ``path`` after
    them (``--artifacts-file``); none from a file that is not there."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return artifact, inputs
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"--artifacts-file {path}: {getattr(error, 'strerror', None) or error}")
    found: dict[str, list[str]] = {"--artifact": list(artifact), "--artifact-inputs": list(inputs)}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        option, _, value = line.partition(" ")
        if option not in found or not value:
            parser.error(
                f"--artifacts-file {path}, line {number}: expected '--artifact VALUE' or"
                " '--artifact-inputs VALUE'"
            )
        found[option].append(value)
    return found["--artifact"], found["--artifact-inputs"]


def _limit_blas_threads(threads: int) -> None:
    """numpy's BLAS on ``threads`` threads, as torch's and onnxruntime's (the family's forward
    pass is numpy's products); threadpoolctl comes with scikit-learn, the worker extra's."""
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - the worker extra has it
        return
    threadpool_limits(threads)


class LoadFailedError(Exception):
    """A model the worker cannot serve (fetch, checksum, load or first batch); one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def load_models(config: AgentConfig, artifact_dir: Path) -> dict[str, ModelRuntime]:
    """Every model ``config`` serves, loaded and run once on a batch of zeros: the family's
    (their forward pass in numpy, from the cache's arrays; trained first, with torch, when the
    cache lacks them) and the artifacts (fetched into ``artifact_dir``). Raises
    :class:`LoadFailedError` naming the model."""
    runtimes: dict[str, ModelRuntime] = {}
    if config.family_models:
        try:
            from provisioners.worker import family
            from provisioners.worker.runtime import family_runtime

            _limit_blas_threads(config.threads)
            arrays = family.load_arrays(config.family_models, config.cache_dir)
            if arrays is None:  # not trained yet, or by another version: torch trains it
                import torch

                torch.set_num_threads(config.threads)
                directory = family.ensure_family(config.cache_dir)
                arrays = family.load_arrays(config.family_models, directory)
                if arrays is None:
                    raise LoadFailedError(f"the family's cache {directory} has no arrays")
            for name in config.family_models:
                runtimes[name] = family_runtime(arrays[name])
        except Exception as error:  # a family model that cannot load, for whatever reason
            raise LoadFailedError(f"family models: {first_line(error)}") from None
    for ref in config.artifacts:
        from provisioners.worker.runtime import load_runtime

        try:
            path = fetch_artifact(ref, artifact_dir)
            runtimes[ref.name] = load_runtime(
                path,
                ref.format,
                device=config.device,
                inputs=ref.inputs or None,
                threads=config.threads,
            )
        except Exception as error:  # ArtifactError, ModelLoadError, or the runtime's own
            raise LoadFailedError(
                f"model {ref.name} ({ref.model} v{ref.version}): {first_line(error)}"
            ) from None
    # One untimed batch each: the first call of a model pays for allocations and lazy
    # initialisation, which is no part of its serving latency.
    for name, runtime in runtimes.items():
        zeros = {
            spec.name: np.zeros(tuple(1 if d == -1 else d for d in spec.shape), spec.dtype)
            for spec in runtime.signature.inputs
        }
        try:
            runtime.run(zeros)
        except Exception as error:  # the model's own failure
            raise LoadFailedError(
                f"model {name} fails on a batch of zeros: {first_line(error)}"
            ) from None
    return runtimes


def _load(
    agent: WorkerAgent, config: AgentConfig, artifact_dir: Path, failed: threading.Event
) -> None:
    """Load the models behind the listening socket; a failure ends the worker with its reason."""
    try:
        models = load_models(config, artifact_dir)
    except Exception as error:  # LoadFailedError, or anything unforeseen: one line either way
        reason = " ".join(str(error).split()) or type(error).__name__
        agent.fail(f"cannot load the models: {reason}")
        print(f"worker: cannot load the models: {reason}", file=sys.stderr, flush=True)
        failed.set()
        return
    # The interpreter, torch and the models are here for the process's life: out of the
    # collector's sight, so that a full collection walks only what serving allocates (a walk
    # over torch's objects stalled answers for tens of ms).
    gc.collect()
    gc.freeze()
    agent.set_models(models)
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
    with tempfile.TemporaryDirectory(prefix="heteroplane-artifacts-") as temporary:
        artifact_dir = (
            config.cache_dir / ARTIFACTS_DIR if config.cache_dir is not None else Path(temporary)
        )
        serving = threading.Thread(
            target=server.serve_forever, args=(0.1,), name="http", daemon=True
        )
        serving.start()
        loading = threading.Thread(
            target=_load, args=(agent, config, artifact_dir, failed), name="load", daemon=True
        )
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
