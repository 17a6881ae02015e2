"""An in-process fake of the worker agent, with failure knobs: the seam's fake for the serving
loop's component tests and its benchmark.

:class:`FakeWorker` is an asyncio HTTP/1.1 server on 127.0.0.1 that speaks the agent's
interface, the Open Inference Protocol v2 (``POST /v2/models/{m}/infer``, ``GET
/v2/models/{m}``, ``GET /v2/models/{m}/ready``, ``GET /v2/health/ready`` and ``/live``; ``GET
/health``: :mod:`provisioners.worker.agent`) on the event loop of its caller, answering at once
or after ``delay_s``. Every model it serves has a signature (``signatures``, by model name;
:data:`~provisioners.artifacts.FAMILY_SIGNATURE` for the others); a request whose inputs do not
fit it is a 400 naming the input (names, datatypes, shapes: the values are not checked), in JSON
or binary tensors as the agent takes them.

Its answer for a row (the first input's flattened sample) comes from ``predict(model, row)`` and
``certainty(model, row)``: by default the class ``int(row[0]) % 10`` and the certainty
``row[1] / 16``, so a test steers a cascade's forwarding through its inputs. The first output's
sample is the logarithm of a distribution whose argmax is the class and whose certainty, as
``kind`` measures it (``margin``: top-1 minus top-2 probability; ``max_prob``: top-1), is the
one asked for (to rounding); the other outputs are zeros. ``parameters`` (the agent's
``served_ms``, ``instance_type``, ...) are in every answer unless ``foreign`` (an Open Inference
Protocol server that is not the agent).

Knobs, settable at any time: ``status`` (answer every infer request with this HTTP status),
``drop`` (close the connection instead of answering), ``hang`` (never answer, its health probe
neither: a hung process), ``slow`` (a function of (model, row): the rows of a value-dependent
slow path; a batch holding one is never answered, while the health probe is, saying the worker
is busy, as the agent's does, until :meth:`end_slow`; ``reports_busy`` False: it never says
so, as a server that is not the agent), ``holding``
(keep the answers until :meth:`release`), ``poison`` (a
function of (model, row): the rows the model raises on; a batch holding one is answered as the
agent answers it, 422 with ``failed_rows``, or, when ``foreign``, 500 without them);
:meth:`kill` closes the listening socket and every connection, as a worker process that dies
does.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from provisioners.artifacts import FAMILY_SIGNATURE, ModelSignature
from provisioners.worker.oip import (
    HEADER_LENGTH,
    WORKER_PROTOCOL,
    OipError,
    split_infer_body,
    with_binary_inputs,
)

__all__ = ["FakeWorker", "default_certainty", "default_prediction", "logits"]

RowFn = Callable[[str, Sequence[float]], float]

_HEADER_LENGTH = HEADER_LENGTH.lower()
_TIE = 1e-6  # distinct in FP32, as a real worker's logits are
_UP = 1e-9


def default_prediction(model: str, row: Sequence[float]) -> float:
    return int(row[0]) % 10


def default_certainty(model: str, row: Sequence[float]) -> float:
    return float(row[1]) / 16.0


def logits(klass: int, certainty: float, width: int, kind: str = "margin") -> list[float]:
    """``width`` logits whose softmax has its maximum at ``klass`` and, as ``kind`` measures
    it, the ``certainty`` given (clipped into what ``width`` classes allow)."""
    if width <= 1:
        return [float(klass)] * width
    klass %= width
    # A gap of at least _TIE keeps the class the argmax when the certainty asked is nil; _UP
    # keeps a certainty asked at a cascade's threshold at or over it after the rounding of the
    # logits' text (12 digits).
    if kind == "max_prob":
        top = min(max(certainty + _UP, 1.0 / width + _TIE), 1.0)
        rest = (1.0 - top) / (width - 1)
    else:
        gap = min(max(certainty + _UP, _TIE), 1.0)
        rest = (1.0 - gap) / width
        top = rest + gap
    floor = 1e-30  # log(0) is not a JSON number
    values = [math.log(max(rest, floor))] * width
    values[klass] = math.log(max(top, floor))
    return values


def _listed(document: Any, binary: bytes, signature: ModelSignature) -> dict[str, Any]:
    """A request's document with its binary inputs' data as lists (as JSON gives them)."""
    if not isinstance(document, dict):
        raise ValueError("body must be a JSON object")
    filled = with_binary_inputs(document, binary, signature)
    inputs = [
        {**e, "data": e["data"].tolist()} if isinstance(e.get("data"), np.ndarray) else e
        for e in filled["inputs"]
    ]
    return {**filled, "inputs": inputs}


class _Protocol(asyncio.Protocol):
    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.waiting: list[tuple[str, str, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.worker._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.worker._connections.discard(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            header_length: str | None = None
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
                elif name.strip().lower() == _HEADER_LENGTH:
                    header_length = value.strip()
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path = [*head[0].split(" "), "", ""][:2]
            self.worker._handle(self, method, path, body, header_length)

    def send(self, status: int, document: object) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if isinstance(document, bytes):
            body = document
        else:
            body = json.dumps(document, separators=(",", ":")).encode()
        self.transport.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (status, len(body))
            + body
        )


class FakeWorker:
    """A fake worker agent on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        instance_type: str = "emu.cpu.small",
        *,
        delay_s: float = 0.0,
        predict: RowFn = default_prediction,
        certainty: RowFn = default_certainty,
        signatures: Mapping[str, ModelSignature] | None = None,
        kind: str = "margin",
        foreign: bool = False,
    ) -> None:
        self.instance_type = instance_type
        self.delay_s = delay_s
        self.predict = predict
        self.certainty = certainty
        self.signatures = dict(signatures or {})
        self.kind = kind
        self.foreign = foreign
        self.status: int | None = None
        self.poison: Callable[[str, Sequence[float]], bool] | None = None
        self.poisoned: list[int] = []  # the sizes of the batches refused for a poison row
        # Rows whose first output the model makes NaN and infinities (written as the agent's
        # JSON writes them: NaN, Infinity), and a model that drops a row of every batch of
        # several from its answer.
        self.non_finite: Callable[[str, Sequence[float]], bool] | None = None
        self.drops_a_row = False
        self.drop = False
        self.hang = False
        self.slow: Callable[[str, Sequence[float]], bool] | None = None
        self.slow_batches = 0  # the slow batches under way (never answered), till end_slow
        self.reports_busy = True
        self.holding = False
        self._held: list[tuple[_Protocol, bytes]] = []
        self.healthy = True
        self.requests = 0  # answered
        self.received = 0  # every inference request, answered or not
        self.rows = 0
        self.rows_by_model: Counter[str] = Counter()
        self.batch_sizes: list[int] = []
        self.last_request: dict[str, Any] | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[_Protocol] = set()
        # (model, class, certainty) -> the first output's sample as JSON text (without
        # brackets): the benchmark's workers answer thousands of rows a second on its loop.
        self._samples: dict[tuple[str, int, float], str] = {}
        self.address = ""

    async def start(self) -> str:
        """Listen on a free loopback port; return ``host:port``."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Protocol(self), "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self.address

    def kill(self) -> None:
        """Stop listening and cut every connection (a worker process that died)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.abort()
        self._connections.clear()

    async def stop(self) -> None:
        server = self._server
        self.kill()
        if server is not None:
            await server.wait_closed()

    def release(self) -> None:
        """Stop holding answers and send the ones held."""
        self.holding = False
        held, self._held = self._held, []
        for connection, answer in held:
            connection.send(200, answer)

    def end_slow(self) -> None:
        """The slow batches under way end (their answers go to no one): not busy any more."""
        self.slow_batches = 0

    def signature(self, model: str) -> ModelSignature:
        return self.signatures.get(model, FAMILY_SIGNATURE)

    def _handle(
        self,
        connection: _Protocol,
        method: str,
        path: str,
        body: bytes,
        header_length: str | None = None,
    ) -> None:
        if path in ("/health", "/v2/health/ready", "/v2/health/live"):
            if self.hang:
                return
            status = 200 if self.healthy or path.endswith("/live") else 503
            if path == "/health":
                health = {"status": "ok" if self.healthy else "stopping"}
                connection.send(status, health | {"protocol": WORKER_PROTOCOL})
            else:
                key = "live" if path.endswith("/live") else "ready"
                said: dict[str, object] = {key: status == 200}
                if key == "ready" and status == 200 and self.reports_busy and not self.foreign:
                    busy = self.slow_batches
                    said |= {"busy": busy > 0, "in_flight": busy, "busy_s": 0.0}
                connection.send(status, said)
            return
        parts = path.split("/")
        if len(parts) < 4 or parts[:3] != ["", "v2", "models"]:
            connection.send(404, {"error": f"no route {path}"})
            return
        model, action = parts[3], "/".join(parts[4:])
        signature = self.signature(model)
        if method == "GET":
            if action == "ready":
                connection.send(200, {"name": model, "ready": True})
            else:
                document = signature.to_json()
                connection.send(
                    200, {"name": model, "versions": ["1"], "platform": "fake", **document}
                )
            return
        self.received += 1
        if self.hang:
            return
        if self.drop:
            if connection.transport is not None:
                connection.transport.abort()
            return
        if self.status is not None:
            connection.send(self.status, {"error": f"fake failure {self.status}"})
            return
        try:
            document = _listed(*split_infer_body(body, header_length), signature)
            rows = self._rows(signature, document)
        except (ValueError, KeyError, TypeError, OipError) as error:
            connection.send(400, {"error": str(error)})
            return
        self.last_request = document
        slow = self.slow
        if slow is not None and any(slow(model, r) for r in rows):
            self.slow_batches += 1
            return
        poison = self.poison
        bad = [i for i, r in enumerate(rows) if poison(model, r)] if poison is not None else []
        if bad:
            self.poisoned.append(len(rows))
            message = (
                f"model {model!r} failed on {len(bad)} of {len(rows)} rows: index out of range"
            )
            if self.foreign:
                connection.send(500, {"error": message})
            else:
                connection.send(422, {"error": message, "failed_rows": bad})
            return
        n = len(rows)
        self.requests += 1
        self.rows += n
        self.rows_by_model[model] += n
        self.batch_sizes.append(n)
        answer = self._answer(model, signature, rows, document.get("id"))
        if self.holding:
            self._held.append((connection, answer))
        elif self.delay_s > 0:
            asyncio.get_running_loop().call_later(self.delay_s, connection.send, 200, answer)
        else:
            connection.send(200, answer)

    def _rows(self, signature: ModelSignature, document: Mapping[str, Any]) -> list[list[Any]]:
        """The first input's samples, flattened; ValueError naming the input when the inputs do
        not fit the signature."""
        given = {entry["name"]: entry for entry in document["inputs"]}
        rows: list[list[Any]] = []
        for index, spec in enumerate(signature.inputs):
            entry = given.pop(spec.name, None)
            if entry is None:
                raise ValueError(f"input {spec.name!r} is missing")
            if entry["datatype"] != spec.datatype:
                raise ValueError(
                    f"input {spec.name!r}: datatype {entry['datatype']!r}, expected"
                    f" {spec.datatype!r}"
                )
            shape = entry["shape"]
            if len(shape) != len(spec.shape) or any(
                want not in (-1, got) for got, want in zip(shape, spec.shape, strict=True)
            ):
                raise ValueError(f"input {spec.name!r}: shape {shape} does not fit {spec.shape}")
            data = entry["data"]
            if len(data) != math.prod(shape):
                raise ValueError(f"input {spec.name!r}: {len(data)} values for shape {shape}")
            if index == 0:
                width = math.prod(shape[1:])
                rows = [data[i : i + width] for i in range(0, len(data), width)]
        if given:
            raise ValueError(f"input {next(iter(given))!r} is not an input of the model")
        return rows

    def _answer(
        self,
        model: str,
        signature: ModelSignature,
        rows: list[list[Any]],
        request_id: object,
    ) -> bytes:
        n = len(rows)
        first, *others = signature.outputs
        sample = [1 if d < 0 else d for d in first.sample_shape]
        width = math.prod(sample)
        samples = self._samples
        texts = []
        non_finite = self.non_finite
        if self.drops_a_row and n > 1:
            rows, n = rows[1:], n - 1
        for row in rows:
            if non_finite is not None and non_finite(model, row):
                texts.append(",".join((["NaN", "Infinity", "-Infinity"] * width)[:width]))
                continue
            key = (model, int(self.predict(model, row)), float(self.certainty(model, row)))
            text = samples.get(key)
            if text is None:
                # 12 digits: the certainty to 1e-11, in half the text of a float's repr.
                text = ",".join(f"{v:.12g}" for v in logits(key[1], key[2], width, self.kind))
                if len(samples) < 100_000:
                    samples[key] = text
            texts.append(text)
        tensors = [_tensor_text(first.name, first.datatype, [n, *sample], ",".join(texts))]
        for spec in others:
            shape = [n, *(1 if d < 0 else d for d in spec.sample_shape)]
            zero = "false" if spec.datatype == "BOOL" else "0"
            tensors.append(
                _tensor_text(spec.name, spec.datatype, shape, ",".join([zero] * math.prod(shape)))
            )
        head = f'{{"model_name":"{model}","model_version":"1"'
        if isinstance(request_id, str):
            head += f',"id":{json.dumps(request_id)}'
        body = head + ',"outputs":[' + ",".join(tensors) + "]"
        if not self.foreign:
            served_ms = self.delay_s * 1000.0
            body += (
                f',"parameters":{{"instance_type":"{self.instance_type}","served_ms":{served_ms},'
                f'"latency_ms":{served_ms},"padded_ms":0.0,"queued_ms":0.0,"emulated":false}}'
            )
        return (body + "}").encode()


def _tensor_text(name: str, datatype: str, shape: list[int], data: str) -> str:
    """One output tensor as JSON text, its ``data`` given as text (without brackets); names are
    model and tensor names (no character JSON escapes)."""
    dims = ",".join(map(str, shape))
    return f'{{"name":"{name}","datatype":"{datatype}","shape":[{dims}],"data":[{data}]}}'
