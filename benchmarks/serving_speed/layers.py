"""What each layer of the inference API path costs in CPU per request, measured in process.

    .venv/bin/python -m benchmarks.serving_speed layers [--quick] [--json] [--requests 2000]
        [--repeats 5]

Each figure is the CPU time of a loop of ``--requests`` requests (``time.process_time``: every
thread of this process, so the thread pool's share of a request counts too) divided by their
number, in microseconds; it is measured ``--repeats`` times and printed as the median with the
smallest and largest (``name: median (min-max) us/request``). The figures are for this machine
only (a shared 2-core one when written): compare them with each other, and with a run of the
same script after a change, not with another machine's. The load average before and after is
printed with them; a high one means other work shared the cores.

The request is the service's common one: ``POST /v1/apps/bench/infer`` with the body
``{"inputs": [[64 whole numbers in 0..16]]}`` (one sample of the demo family's 64 pixels) and
an ``infer`` token; the answer is the document the route answers for one sample
(:func:`~controlplane.api.routes.infer.answer_document`: outputs, models, certainty, gear,
timings, late).

- ``json_parse_stdlib_us``, ``json_parse_orjson_us``: parsing that request body with
  ``json.loads`` and with ``orjson.loads``.
- ``json_dump_stdlib_us``, ``json_dump_orjson_us``: writing that answer as bytes with
  ``json.dumps(...).encode()`` and with ``orjson.dumps``.
- ``token_check_db_us``: :meth:`~controlplane.db.store.Store.verify_token` with ``fresh``
  against a real SQLite store on disk (built as ``heteroplane serve`` builds it): the database
  read a request pays when its token's answer is not cached.
- ``token_check_cached_us``: :meth:`~controlplane.db.store.Store.cached_token`, the fast path's
  check while the token's answer is cached (no database read).
- ``asgi_route_us``: one request through the real FastAPI app
  (:func:`~controlplane.service.app.create_app`) called directly as an ASGI callable (the
  scope, ``receive`` and ``send`` made here: no HTTP, no sockets), taking FastAPI's route: every
  middleware, routing, the token check as a dependency in the thread pool (its answer cached),
  pydantic's validation of the body and of the answer, the JSON response. The request's
  ``Content-Type`` is ``application/vnd.heteroplane+json``: the fast path
  (:class:`~controlplane.api.fast_infer.FastInferMiddleware`) takes only ``application/json``
  and hands it on, and FastAPI reads any ``+json`` type's body as JSON, so it is the same
  request answered the route's way. Each request is checked to have been answered 200 by the
  route (the router's ``endpoint`` in its scope).
- ``asgi_fast_path_us``: the same request with ``Content-Type: application/json``, answered by
  the fast path itself (token answer cached; checked: 200, and the router not entered).
- ``fast_path_saves_us``: ``asgi_route_us`` less ``asgi_fast_path_us``, per repeat.
- ``asgi_oip_route_us``, ``asgi_oip_fast_path_us``: the same sample as an Open Inference
  Protocol request (``{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64],
  "data": [...]}]}``), what tritonclient sends: to ``POST /v2/models/bench/versions/1/infer``
  (the route's: FastAPI, its dependencies, the token check in the thread pool) and to
  ``POST /v2/models/bench/infer`` (answered by the fast path); the answer, the protocol's
  document of the model's ``logits``, checked the same in both.
- ``asgi_oip_binary_fast_path_us``: the same sample in Triton's binary tensor extension, as
  ``tritonclient.http`` sends it by default (the input's raw bytes after the JSON part, whose
  length ``Inference-Header-Content-Length`` gives, and ``binary_data_output``: the answer's
  ``logits`` in binary too), to ``POST /v2/models/bench/infer`` (the fast path); the answer's
  JSON part checked.
- ``asgi_fast_path_refused_us``, ``asgi_oip_fast_path_refused_us``: the fast path's requests of
  ``/v1`` and ``/v2`` when admission refuses them (the serving loop's ``infer`` raises the
  :class:`~controlplane.errors.OverloadedError` admission raises, and its ``refuse_early``
  too, which the fast path asks first, before it reads the body): each answered 429
  ``overloaded`` (checked), the answer most requests get past saturation.
- ``uvicorn_http_us``: the CPU of a uvicorn server per request, as ``heteroplane serve`` runs it
  (httptools' protocol and asyncio's loop,
  :func:`~controlplane.service.protocol.server_options`; its socket bound by
  :func:`~controlplane.cli.serve.listen`, so with ``TCP_NODELAY``), serving an ASGI app that
  reads the body and answers a constant 200 JSON document (the answer above): uvicorn, HTTP
  parsing and writing, the ASGI hop, no FastAPI. The server is a child process; this process
  drives it over a few kept-alive HTTP/1.1 connections (closed loop: the next request on a
  connection goes when its answer is in) with the request above as prebuilt bytes. The server's
  CPU is read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds; each thread's time on a CPU)
  before and after, falling back to ``/proc/<pid>/stat``'s utime and stime (10 ms ticks) where
  schedstat is missing.

In the ASGI figures the serving loop answers at once: a real
:class:`~controlplane.serving.loop.ServingLoop` (running; its ``dispatcher_for``, which the route
and the fast path call for the app's model signature, is its own, the app's config read from the
store once) whose ``infer`` returns a fixed answer instead of dispatching to workers. What the
serving loop's dispatcher costs is the ``dispatcher`` part's; what the whole service costs over
real HTTP is the ``api`` part's. A service request costs roughly uvicorn's
figure plus one of the ASGI figures (plus the dispatcher).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from starlette.types import Message, Receive, Scope, Send

from benchmarks import local_service
from benchmarks.serving_speed.api import median_spread
from benchmarks.sizes import add_quick, chosen
from controlplane.api.routes.infer import answer_document
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import SystemClock
from controlplane.db.store import Store
from controlplane.errors import OverloadedError
from controlplane.policies.variants import Requirements
from controlplane.service.app import create_app
from controlplane.serving.dispatcher import InferResult
from controlplane.serving.loop import ServingLoop, ServingSettings
from controlplane.serving.modelio import ReplyTensor, Row, WorkerReply
from controlplane.serving.workers import StaticInstances
from controlplane.settings import Settings
from provisioners.worker.oip import HEADER_LENGTH, binary_request_body

ROOT = Path(__file__).resolve().parents[2]
APP = "bench"
MODEL = "tiny"
INSTANCE_TYPE = "emu.cpu.large"
PATH = f"/v1/apps/{APP}/infer"
OIP_PATH = f"/v2/models/{APP}/infer"
OIP_ROUTE_PATH = f"/v2/models/{APP}/versions/1/infer"  # the route's (the fast path's is above)
SAMPLE = [i % 17 for i in range(64)]
BODY = orjson.dumps({"inputs": [SAMPLE]})
OIP_BODY = orjson.dumps(
    {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": SAMPLE}]}
)
OIP_BINARY_BODY, OIP_BINARY_HEADER = binary_request_body(
    [("input", "FP32", np.asarray([SAMPLE], dtype=np.float32))],
    parameters={"binary_data_output": True},
)
LOGITS = [0.1 * i for i in range(10)]
# JSON to the route, not to the fast path (which takes application/json only).
ROUTE_CONTENT_TYPE = b"application/vnd.heteroplane+json"
# What the stand-in serving loop answers every request with (one sample).
ANSWER = InferResult(
    outputs=(3,),
    models=(MODEL,),
    certainty=(0.93,),
    gear=MODEL,
    queue_ms=0.12,
    service_ms=0.85,
    total_ms=1.05,
    late=False,
    transport_ms=0.31,
    compute_ms=0.54,
    api_ms=0.08,
    replies=(
        (
            WorkerReply(
                (3,),
                (0.93,),
                0.54,
                INSTANCE_TYPE,
                (ReplyTensor("logits", "FP32", (1, 10), LOGITS),),
            ),
            0,
        ),
    ),
)
BINARY_LOGITS_BYTES = 4 * len(LOGITS)  # the answer's logits in binary (FP32)
CONNECTIONS = 4  # kept-alive connections to the uvicorn server
WARMUP = 100  # untimed requests before each loop (at most the loop's own count)
FIGURES = (
    "json_parse_stdlib_us",
    "json_parse_orjson_us",
    "json_dump_stdlib_us",
    "json_dump_orjson_us",
    "token_check_db_us",
    "token_check_cached_us",
    "asgi_route_us",
    "asgi_fast_path_us",
    "fast_path_saves_us",
    "asgi_oip_route_us",
    "asgi_oip_fast_path_us",
    "asgi_oip_binary_fast_path_us",
    "asgi_fast_path_refused_us",
    "asgi_oip_fast_path_refused_us",
    "uvicorn_http_us",
)


def cpu_us_per_call(call: Callable[[], object], n: int) -> float:
    """The process's CPU time per ``call()`` over ``n`` calls (after a few untimed ones), us."""
    for _ in range(min(n, WARMUP)):
        call()
    start = time.process_time()
    for _ in range(n):
        call()
    return (time.process_time() - start) / n * 1e6


# --- JSON and the token check ----------------------------------------------------------------


def json_figures(n: int, repeats: int) -> dict[str, list[float]]:
    document = answer_document(ANSWER)
    calls: dict[str, Callable[[], object]] = {
        "json_parse_stdlib_us": lambda: json.loads(BODY),
        "json_parse_orjson_us": lambda: orjson.loads(BODY),
        "json_dump_stdlib_us": lambda: json.dumps(document).encode(),
        "json_dump_orjson_us": lambda: orjson.dumps(document),
    }
    return {
        name: [cpu_us_per_call(call, n) for _ in range(repeats)] for name, call in calls.items()
    }


def token_figures(store: Store, token: str, n: int, repeats: int) -> dict[str, list[float]]:
    if store.verify_token(token, fresh=True) is None:
        raise RuntimeError("the store does not know the benchmark's token")
    figures: dict[str, list[float]] = {"token_check_db_us": [], "token_check_cached_us": []}
    for _ in range(repeats):
        figures["token_check_db_us"].append(
            cpu_us_per_call(lambda: store.verify_token(token, fresh=True), n)
        )
        # Fresh from the read above: cached for the next TOKEN_CACHE_S (far longer than this).
        store.verify_token(token, fresh=True)
        figures["token_check_cached_us"].append(
            cpu_us_per_call(lambda: store.cached_token(token), n)
        )
    return figures


# --- the ASGI app ----------------------------------------------------------------------------


class InstantServing(ServingLoop):
    """A running serving loop whose ``infer`` answers :data:`ANSWER` at once (its
    ``dispatcher_for`` is the real one: the route reads the app's model signature there), or,
    while ``refusing``, refuses as admission does, and as early as the service asks it
    (``refuse_early``: before the body is read)."""

    refusing = False

    def refuse_early(
        self, app: str, received_s: float | None = None, *, plain: bool = False
    ) -> bool:
        if self.refusing:
            raise _refusal(app)
        return False

    async def infer(
        self,
        app: str,
        inputs: Sequence[Row],
        sample_ids: list[int] | None = None,
        requirements: Requirements | None = None,
        received_s: float | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> InferResult:
        if self.refusing:
            raise _refusal(app)
        return ANSWER


def _refusal(app: str) -> OverloadedError:
    """Admission's refusal, as :class:`InstantServing` raises it."""
    return OverloadedError(app, predicted_ms=900.0, slo_ms=300.0, retry_after_s=1)


def profiles_csv(folder: Path) -> Path:
    """A latency profile of the model on the one instance type (the app must resolve)."""
    lines = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for batch in (1, 2, 4, 8, 16, 32, 64):
        ms = 1.0 + 0.01 * batch
        lines += [f"{MODEL},{INSTANCE_TYPE},{batch},{i},{ms:.4f},0" for i in range(3)]
    path = folder / "profiles.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


class World:
    """The service's parts in this process: settings on a temporary data folder, the SQLite
    store (migrated) with the app registered and an ``infer`` token, the stand-in serving loop
    and the FastAPI app over them."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        profiles = profiles_csv(data_dir)
        self.settings = Settings(data_dir=data_dir, provisioner="fake")
        clock = SystemClock()
        self.store = Store.from_url(self.settings.database_url, clock, upgrade=True)
        self.token = self.store.create_token("infer", name="bench")
        resolver = AppResolver(data_dir)
        spec = {
            "name": APP,
            "models": [{"name": MODEL, "profiles": str(profiles)}],
            "slo": {"latency_ms": 300},
            "budget_usd_per_hr": 5,
            "instance_types": [INSTANCE_TYPE],
        }
        self.store.create_app(spec_document(resolver.check(spec).spec), who="bench")
        self.serving = InstantServing(
            self.store,
            resolver,
            StaticInstances(),
            clock=clock,
            settings=ServingSettings(refresh_s=3600.0),
        )
        self.app = create_app(self.settings, self.store, clock, serving=self.serving)

    def close(self) -> None:
        self.store.close()


def asgi_scope(
    token: str, json_content: bool, path: str = PATH, body: bytes = BODY
) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"authorization", f"Bearer {token}".encode()),
        (b"content-length", str(len(body)).encode()),
        (b"content-type", b"application/json" if json_content else ROUTE_CONTENT_TYPE),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def asgi_cpu_us(
    world: World,
    n: int,
    route: bool,
    oip: bool = False,
    refused: bool = False,
    binary: bool = False,
) -> float:
    """CPU per request of ``n`` requests through the app (``oip``: the Open Inference
    Protocol's, with ``binary`` in binary tensors), each checked (200, or with ``refused``
    admission's 429; answered by the route when ``route``, by the fast path otherwise)."""
    body = (OIP_BINARY_BODY if binary else OIP_BODY) if oip else BODY
    if oip:
        template = asgi_scope(world.token, True, OIP_ROUTE_PATH if route else OIP_PATH, body)
        if binary:
            template["headers"] = [
                *(h for h in template["headers"] if h[0] != b"content-type"),
                (b"content-type", b"application/octet-stream"),
                (HEADER_LENGTH.lower().encode(), str(OIP_BINARY_HEADER).encode()),
            ]
    else:
        template = asgi_scope(world.token, json_content=not route)
    statuses: list[int] = []
    bodies: list[bytes] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        elif message["type"] == "http.response.body":
            bodies.append(message.get("body", b""))

    async def one() -> bool:
        scope = dict(template)
        await world.app(scope, receive, send)
        return "endpoint" in scope  # the router filled it in: the route answered

    for _ in range(min(n, WARMUP)):
        await one()
    statuses.clear()
    bodies.clear()
    routed = 0
    start = time.process_time()
    for _ in range(n):
        routed += await one()
    spent = time.process_time() - start
    which = "route" if route else "fast path"
    status = 429 if refused else 200
    if statuses.count(status) != n:
        bad = next((s for s in statuses if s != status), None)
        raise RuntimeError(
            f"{which}: {statuses.count(status)} of {n} answered {status} (saw {bad})"
        )
    if routed != (n if route else 0):
        raise RuntimeError(f"{which}: {routed} of {n} requests went through the route")
    answer = orjson.loads(bodies[-1][:-BINARY_LOGITS_BYTES] if binary else bodies[-1])
    if refused:
        error = answer.get("error")
        code = error if oip else (error or {}).get("code")
        if not isinstance(code, str) or "overloaded" not in code:
            raise RuntimeError(f"{which}: unexpected refusal {bodies[-1]!r}")
    elif oip:
        (output,) = answer.get("outputs", [{}])
        if output.get("name") != "logits" or output.get("shape") != [1, 10]:
            raise RuntimeError(f"{which} (/v2): unexpected answer {bodies[-1]!r}")
        if binary and output.get("parameters") != {"binary_data_size": BINARY_LOGITS_BYTES}:
            raise RuntimeError(f"{which} (/v2, binary): unexpected answer {bodies[-1]!r}")
    elif answer != answer_document(ANSWER):
        raise RuntimeError(f"{which}: unexpected answer {bodies[-1]!r}")
    return spent / n * 1e6


async def asgi_figures(world: World, n: int, repeats: int) -> dict[str, list[float]]:
    await world.serving.start()
    try:
        # The token's answer cached before the timing (as it stays while a client is busy).
        world.store.verify_token(world.token, fresh=True)
        figures: dict[str, list[float]] = {
            "asgi_route_us": [],
            "asgi_fast_path_us": [],
            "asgi_oip_route_us": [],
            "asgi_oip_fast_path_us": [],
            "asgi_oip_binary_fast_path_us": [],
            "asgi_fast_path_refused_us": [],
            "asgi_oip_fast_path_refused_us": [],
        }
        for _ in range(repeats):
            figures["asgi_route_us"].append(await asgi_cpu_us(world, n, route=True))
            figures["asgi_fast_path_us"].append(await asgi_cpu_us(world, n, route=False))
            figures["asgi_oip_route_us"].append(await asgi_cpu_us(world, n, True, oip=True))
            figures["asgi_oip_fast_path_us"].append(await asgi_cpu_us(world, n, False, oip=True))
            figures["asgi_oip_binary_fast_path_us"].append(
                await asgi_cpu_us(world, n, False, oip=True, binary=True)
            )
            world.serving.refusing = True
            try:
                for name, oip in (
                    ("asgi_fast_path_refused_us", False),
                    ("asgi_oip_fast_path_refused_us", True),
                ):
                    figures[name].append(await asgi_cpu_us(world, n, False, oip, refused=True))
            finally:
                world.serving.refusing = False
        return figures
    finally:
        await world.serving.stop()
        gc.unfreeze()  # start() froze this process's objects; a caller's (a test's) get them back


# --- uvicorn ---------------------------------------------------------------------------------


def serve_constant(body: bytes) -> None:
    """Serve, with uvicorn as ``heteroplane serve`` configures it, an ASGI app answering every
    HTTP request 200 with ``body`` (JSON); print the port, then serve until killed. The child
    process of :func:`uvicorn_figures`."""
    import uvicorn

    from controlplane.cli.serve import listen
    from controlplane.service.protocol import server_options

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    # Bound as `heteroplane serve` binds it (IPPROTO_TCP, so that asyncio sets TCP_NODELAY on
    # its connections; without it every answer waited ~40 ms on the client's delayed ACK).
    sock = listen("127.0.0.1", 0)
    sock.listen(128)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(
        app, lifespan="off", log_level="warning", access_log=False, **server_options()
    )
    uvicorn.Server(config).run(sockets=[sock])


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` so far: its threads' schedstat (ns), else utime + stime."""
    total_ns = 0
    found = False
    for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total_ns += int(path.read_text().split()[0])
            found = True
        except (OSError, ValueError, IndexError):
            continue
    if found:
        return total_ns / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HttpClient:
    """Kept-alive HTTP/1.1 connections sending one prebuilt request each, in rounds."""

    def __init__(self, port: int, request: bytes, connections: int) -> None:
        self.request = request
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
        for sock in self.socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffers = [b""] * connections

    def answer(self, i: int) -> None:
        """Read one response off connection ``i``; raise unless it is a 200."""
        buffer = self.buffers[i]
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            buffer += self._recv(i)
        head = buffer[:end].decode("latin-1")
        if not head.startswith("HTTP/1.1 200"):
            raise RuntimeError(f"uvicorn answered {head.splitlines()[0]!r}")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        total = end + 4 + length
        while len(buffer) < total:
            buffer += self._recv(i)
        self.buffers[i] = buffer[total:]

    def _recv(self, i: int) -> bytes:
        chunk = self.socks[i].recv(65536)
        if not chunk:
            raise RuntimeError("uvicorn closed a connection")
        return chunk

    def rounds(self, n: int) -> int:
        """Send about ``n`` requests, one in flight per connection; the number sent."""
        sent = 0
        while sent < n:
            k = min(len(self.socks), n - sent)
            for sock in self.socks[:k]:
                sock.sendall(self.request)
            for i in range(k):
                self.answer(i)
            sent += k
        return sent

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def uvicorn_figures(token: str, n: int, repeats: int) -> dict[str, list[float]]:
    body = orjson.dumps(answer_document(ANSWER))
    request = (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    script = f"from benchmarks.serving_speed.layers import serve_constant; serve_constant({body!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the uvicorn child did not start (exit {child.poll()})")
        client = HttpClient(int(line), request, CONNECTIONS)
        try:
            client.rounds(min(n, WARMUP))
            figures: list[float] = []
            for _ in range(repeats):
                before = process_cpu_s(child.pid)
                sent = client.rounds(n)
                figures.append((process_cpu_s(child.pid) - before) / sent * 1e6)
        finally:
            client.close()
    finally:
        local_service.stop(child, deadline_s=10.0)
    return {"uvicorn_http_us": figures}


# --- all of it -------------------------------------------------------------------------------


def measure(requests: int = 2000, repeats: int = 5) -> dict[str, Any]:
    """Every figure (the module docstring) as ``{"median", "min", "max"}`` over ``repeats``
    loops of ``requests`` requests each; the load average before and after."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    samples: dict[str, list[float]] = {}
    samples.update(json_figures(requests, repeats))
    with tempfile.TemporaryDirectory(prefix="heteroplane-api-layers-") as tmp:
        world = World(Path(tmp) / "data")
        try:
            samples.update(token_figures(world.store, world.token, requests, repeats))
            samples.update(asyncio.run(asgi_figures(world, requests, repeats)))
            token = world.token
        finally:
            world.close()
    samples["fast_path_saves_us"] = [
        route - fast
        for route, fast in zip(samples["asgi_route_us"], samples["asgi_fast_path_us"], strict=True)
    ]
    samples.update(uvicorn_figures(token, requests, repeats))
    result: dict[str, Any] = {name: median_spread(samples[name]) for name in FIGURES}
    result["loadavg_before"] = load_before
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_speed layers",
        description=(__doc__ or "").splitlines()[0],
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=None, help="requests per loop (2000)")
    parser.add_argument("--repeats", type=int, default=None, help="loops per figure (5)")
    add_quick(parser)
    args = parser.parse_args(argv)
    sizes = chosen(args)
    if args.requests is None:
        args.requests = sizes.layers_requests
    if args.repeats is None:
        args.repeats = sizes.layers_repeats
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1")
    result = measure(args.requests, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"CPU per request, {args.requests} requests x {args.repeats} repeats,"
        f" on {os.cpu_count()} cores (median (min-max)):"
    )
    for name in FIGURES:
        v = result[name]
        print(f"  {name}: {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f}) us/request")
    print(f"  load average (1, 5, 15 min): {result['loadavg_before']} -> {result['loadavg_after']}")
    return 0
