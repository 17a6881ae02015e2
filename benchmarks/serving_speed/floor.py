"""The floor under the serving path's added latency: the least a Python front can add here.

    .venv/bin/python -m benchmarks.serving_speed.floor --port P --workers HOST:PORT[,...]
        --documents FILE [--mode forward|answer]

Not a benchmark by itself: ``python -m benchmarks.serving_speed api --floor`` starts it beside
the service, on the same worker agents, and sends it the same runs (:mod:`benchmarks.
serving_speed.api`), so that the service's p99 added is read against the least that any
front built the way it is (uvicorn on uvloop with the service's own HTTP protocol class, the
service's own worker transport) adds on the same machine in the same minutes.

What it does for ``POST /v1/apps/{app}/infer`` and ``POST /v2/models/{app}/infer``, and
nothing else:

- ``forward``: reads the body, takes its rows (``/v1``'s ``inputs``; ``/v2``'s first input's
  ``data`` in its ``shape``) with orjson, sends them as one batch to the worker with the fewest
  calls in flight (round robin among ties) through
  :class:`~controlplane.serving.transport.HttpWorkerTransport` (the dispatcher's transport: the
  same binary tensors, the same kept-alive connections), and answers the worker's outputs with
  its own time for the query (``timings.total_ms`` on ``/v1``, ``parameters.total_ms`` on
  ``/v2``, as the service does, so the load generator's "outside" figure reads the same);
- ``answer``: answers at once, no worker call: the HTTP server and the client alone.

No token check, no validation beyond the parse, no admission, no queue, no batching, no
observations, no database, no loops: what it adds at p99 over a worker's straight round trip
is a floor under what the service adds on this machine, not a service. ``GET`` of a path in
``--documents`` (a JSON object of path -> document, the service's own answers for the app and
its model, fetched by ``api --floor``) answers that document, so ``heteroplane loadgen`` reads
the app's SLO and inputs from it as from the service.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import uvicorn

from controlplane.service.protocol import server_options
from controlplane.serving.modelio import ModelIO
from controlplane.serving.transport import HttpWorkerTransport

MODES = ("forward", "answer")
MODEL = "tiny"
CALL_TIMEOUT_S = 5.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def rows_of(path: str, body: bytes) -> list[Any]:
    """The query's rows: ``/v1``'s ``inputs``; ``/v2``'s first input's ``data`` in its shape.

    >>> rows_of("/v1/apps/a/infer", b'{"inputs": [[1, 2], [3, 4]]}')
    [[1, 2], [3, 4]]
    >>> rows_of("/v2/models/a/infer", b'{"inputs": [{"shape": [2, 2], "data": [1, 2, 3, 4]}]}')
    [[1, 2], [3, 4]]
    """
    document = orjson.loads(body)
    if path.startswith("/v1/"):
        rows: list[Any] = document["inputs"]
        return rows
    tensor = document["inputs"][0]
    data, (n, width) = tensor["data"], tensor["shape"]
    flat = data if not data or not isinstance(data[0], list) else list(itertools.chain(*data))
    return [flat[i * width : (i + 1) * width] for i in range(n)]


class Floor:
    """The ASGI app (module docstring)."""

    def __init__(self, workers: list[str], documents: dict[str, Any], mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.workers = workers
        self.documents = {path: orjson.dumps(doc) for path, doc in documents.items()}
        self.mode = mode
        self.io = ModelIO(MODEL)
        self.transport: HttpWorkerTransport | None = None
        self.in_flight = dict.fromkeys(workers, 0)
        self.turn = 0

    def pick(self) -> str:
        """The worker with the fewest calls in flight, round robin among ties."""
        self.turn += 1
        n = len(self.workers)
        order = [self.workers[(self.turn + i) % n] for i in range(n)]
        return min(order, key=self.in_flight.__getitem__)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if scope["method"] == "GET":
            document = self.documents.get(path)
            await _answer(send, 200 if document is not None else 404, document or b"{}")
            return
        started = time.perf_counter()
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        rows = rows_of(path, b"".join(chunks))
        outputs: list[Any] = []
        if self.mode == "forward":
            if self.transport is None:
                self.transport = HttpWorkerTransport()
            address = self.pick()
            self.in_flight[address] += 1
            try:
                reply = await self.transport.infer(address, self.io, rows, CALL_TIMEOUT_S)
            finally:
                self.in_flight[address] -= 1
            outputs = [
                {"name": t.name, "shape": list(t.shape), "data": t.data} for t in reply.outputs
            ]
        total_ms = (time.perf_counter() - started) * 1000.0
        if path.startswith("/v1/"):
            answer = {"outputs": outputs, "timings": {"total_ms": total_ms}}
        else:
            answer = {"outputs": outputs, "parameters": {"total_ms": total_ms}}
        await _answer(send, 200, orjson.dumps(answer))


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_speed.floor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", required=True, help="worker addresses, HOST:PORT[,...]")
    parser.add_argument("--documents", type=Path, required=True)
    parser.add_argument("--mode", choices=MODES, default="forward")
    args = parser.parse_args(argv)
    workers = [part for part in args.workers.split(",") if part]
    documents = json.loads(args.documents.read_text(encoding="utf-8"))
    app = Floor(workers, documents, args.mode)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        **server_options(),
    )
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
