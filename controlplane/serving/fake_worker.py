"""An in-process fake of the worker agent, with failure knobs: the seam's fake for the serving
loop's component tests and its benchmark.

:class:`FakeWorker` is an asyncio HTTP/1.1 server on 127.0.0.1 that speaks the agent's
interface (``POST /infer`` and ``GET /health``, :mod:`provisioners.worker.agent`) on the event
loop of its caller, answering at once or after ``delay_s``. Its answer for a row is
``predict(model, row)`` and ``certainty(model, row)``: by default the class ``int(row[0]) % 10``
and the certainty ``row[1] / 16``, so a test steers a cascade's forwarding through its inputs.
Knobs, settable at any time: ``status`` (answer every ``/infer`` with this HTTP status),
``drop`` (close the connection instead of answering), ``hang`` (never answer); :meth:`kill`
closes the listening socket and every connection, as a worker process that dies does.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Sequence

__all__ = ["FakeWorker", "default_certainty", "default_prediction"]

RowFn = Callable[[str, Sequence[float]], float]


def default_prediction(model: str, row: Sequence[float]) -> float:
    return int(row[0]) % 10


def default_certainty(model: str, row: Sequence[float]) -> float:
    return float(row[1]) / 16.0


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
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path = [*head[0].split(" "), "", ""][:2]
            self.worker._handle(self, method, path, body)

    def send(self, status: int, document: object) -> None:
        if self.transport is None or self.transport.is_closing():
            return
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
    ) -> None:
        self.instance_type = instance_type
        self.delay_s = delay_s
        self.predict = predict
        self.certainty = certainty
        self.status: int | None = None
        self.drop = False
        self.hang = False
        self.healthy = True
        self.requests = 0
        self.rows = 0
        self.rows_by_model: Counter[str] = Counter()
        self.batch_sizes: list[int] = []
        self._server: asyncio.Server | None = None
        self._connections: set[_Protocol] = set()
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

    def _handle(self, connection: _Protocol, method: str, path: str, body: bytes) -> None:
        if path == "/health":
            status = 200 if self.healthy else 503
            connection.send(status, {"status": "ok" if self.healthy else "stopping"})
            return
        if self.hang:
            return
        if self.drop:
            if connection.transport is not None:
                connection.transport.abort()
            return
        if self.status is not None:
            connection.send(self.status, {"error": f"fake failure {self.status}"})
            return
        document = json.loads(body)
        model = str(document["model"])
        rows = document["inputs"]
        self.requests += 1
        self.rows += len(rows)
        self.rows_by_model[model] += len(rows)
        self.batch_sizes.append(len(rows))
        answer = {
            "model": model,
            "instance_type": self.instance_type,
            "batch_size": len(rows),
            "predictions": [int(self.predict(model, row)) for row in rows],
            "certainty": [float(self.certainty(model, row)) for row in rows],
            "latency_ms": self.delay_s * 1000.0,
            "padded_ms": 0.0,
            "served_ms": self.delay_s * 1000.0,
            "queued_ms": 0.0,
            "emulated": False,
        }
        if self.delay_s > 0:
            asyncio.get_running_loop().call_later(self.delay_s, connection.send, 200, answer)
        else:
            connection.send(200, answer)
