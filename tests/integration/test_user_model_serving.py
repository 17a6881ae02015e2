"""A user's model served by real worker processes, with bad queries among good ones (issue 30).

The model is a bag-of-tokens classifier that heteroplane has never seen: an embedding of a
:data:`VOCABULARY`-token vocabulary (INT64 token ids, [N, 4]), averaged, then a linear layer to
three scores, exported to ONNX with a dynamic batch axis and pushed with ``heteroplane model
push``. A token id outside the vocabulary makes the model raise (onnxruntime's Gather: "indices
element out of data bounds"): the poison query.

Through the real service behind a real uvicorn server, on the local provisioner (real worker
processes that fetch the artifact from the registry), one ``emu.cpu.large`` worker serves the
app with a batch cap of 8 and ``fcfs``. Concurrent clients send good queries over ``/v1`` (JSON
integers for an INT64 input) with a poison query among every few: every good query is
answered with the model's own output (run in-process by onnxruntime), every poison query gets
a 422 ``query_rejected``, and the worker is never taken out of matching (healthy in the
serving status, no ``worker_unhealthy`` decision).

``heteroplane loadgen --inputs`` then drives the same app over ``/v2`` with the model's rows
from a ``.npz`` and from Open Inference Protocol JSON rows, as JSON and as binary tensors, on both
engines: every query is answered.

A TorchScript module scripted without a signature file, pushed with ``--inputs`` (the
documented route for one), is profiled (``heteroplane profile run``), planned, applied and
served: the signature the registry stored reaches the workers with the artifact reference.

A TorchScript model that raises on some values (an error that names no input fault) and takes a
slow path on others, served by two workers one query a batch, with a call timeout of 1 s: a
query it raises on, alone, is a 422 once the model has answered on its worker (as it is beside
good rows), and the slow query is a 504 that takes one worker out of matching, not both. While
the slow query still runs there, that worker's agent says it is busy: it stays out (probed,
not put back), no later query is sent to it (none waits behind the slow one and times out),
and once the slow path ends it serves again. The slow path waits at a gate (a named pipe the
test opens when the slow query is to end): it outlasts the call timeout on a machine of any
speed and costs no CPU.

Everything is polled against deadlines; nothing is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from benchmarks.bad_queries import MODEL, TOKENS, VOCABULARY, export_model, profile_file
from controlplane.service.build import Service
from estimator.traces import Trace, write_trace_csv
from tests.integration.conftest import ApiServer, launch_fleet
from tests.integration.test_byom import _cli, service

__all__ = ["service"]  # the fixture, imported for this module's tests

torch = pytest.importorskip("torch")
onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

APP = "tokens"
TYPE = "emu.cpu.large"
GOOD_QUERIES = 96
POISON_EVERY = 6  # one query in six carries a token outside the vocabulary
IN_FLIGHT = 8
RUN_DEADLINE_S = 240.0


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model(tmp_path_factory.mktemp("tokens"))


def _serving_status(url: str, token: str, app: str = APP) -> dict[str, Any]:
    """``GET /v1/apps/{app}/serving``."""
    response = httpx.get(
        f"{url}/v1/apps/{app}/serving",
        headers={"Authorization": f"Bearer {token}"},
        trust_env=False,
        timeout=30.0,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _serve(service: Service, tmp_path: Path) -> None:
    """The app over the pushed model, with latency profiles from a file (the numbers only
    price and rank: nothing is timed), a plan of one worker with a batch cap of 8, applied, and
    its worker running."""
    _serve_app(service, APP, MODEL, profile_file(tmp_path), workers=1, batch_size=8)


def _serve_app(
    service: Service, app: str, model: str, profiles: Path, workers: int, batch_size: int
) -> None:
    """``app`` over the pushed ``model`` with the latency ``profiles``, a plan of ``workers``
    workers batching up to ``batch_size``, applied, and its workers running."""
    store = service.store
    store.create_app(
        {
            "name": app,
            "models": [{"name": model, "artifact": model, "profiles": str(profiles)}],
            "slo": {"latency_ms": 1000},
            "budget_usd_per_hr": 1.0,
            "instance_types": [TYPE],
        },
        who="test",
    )
    stage = {"name": model, "fleet": {TYPE: workers}, "batch_size": batch_size, "policy": "fcfs"}
    plan = store.create_plan(
        app, {"feasible": True, "cost_usd_per_hr": 0.2 * workers, "stages": [stage]}
    )
    store.apply_plan(app, plan.id)
    launch_fleet(service, app, workers)


def _queries() -> tuple[list[list[int]], list[bool]]:
    """The queries' token rows (one sample each) and which of them are poison."""
    rng = np.random.default_rng(0)
    rows: list[list[int]] = []
    poison: list[bool] = []
    for q in range(GOOD_QUERIES + GOOD_QUERIES // (POISON_EVERY - 1)):
        bad = q % POISON_EVERY == POISON_EVERY - 1
        tokens = rng.integers(0, VOCABULARY, size=TOKENS).tolist()
        if bad:
            tokens[int(rng.integers(0, TOKENS))] = VOCABULARY + int(rng.integers(0, 1000))
        rows.append(tokens)
        poison.append(bad)
    return rows, poison


async def _send(url: str, token: str, rows: list[list[int]]) -> list[httpx.Response]:
    """Every row as one query, IN_FLIGHT at once."""
    answers: list[httpx.Response | None] = [None] * len(rows)
    pending = iter(range(len(rows)))
    headers = {"Authorization": f"Bearer {token}"}

    async def sender(client: httpx.AsyncClient) -> None:
        for index in pending:
            answers[index] = await client.post(
                f"/v1/apps/{APP}/infer", json={"inputs": [rows[index]]}, headers=headers
            )

    async with httpx.AsyncClient(base_url=url, timeout=120.0, trust_env=False) as client:
        await asyncio.wait_for(
            asyncio.gather(*(sender(client) for _ in range(IN_FLIGHT))), RUN_DEADLINE_S
        )
    assert all(answer is not None for answer in answers)
    return [answer for answer in answers if answer is not None]


def test_a_poison_query_fails_alone_and_the_worker_keeps_serving(
    service: Service,
    model_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = service.store.create_token("admin", name="operator")
    infer_token = service.store.create_token("infer", name="client")
    session = onnxruntime.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        pushed = _cli(capsys, "model", "push", MODEL, str(model_file))
        assert pushed["inputs"] == [{"name": "tokens", "datatype": "INT64", "shape": [-1, 4]}]
        _serve(service, tmp_path)

        rows, poison = _queries()
        answers = asyncio.run(_send(url, infer_token, rows))
        serving = _serving_status(url, admin)
    for tokens, bad, answer in zip(rows, poison, answers, strict=True):
        if bad:
            assert answer.status_code == 422, answer.text
            error = answer.json()["error"]
            assert error["code"] == "query_rejected" and "out of" in error["message"], error
            continue
        assert answer.status_code == 200, answer.text
        (scores,) = session.run(None, {"tokens": np.array([tokens], dtype=np.int64)})
        assert answer.json()["outputs"] == [int(np.argmax(scores[0]))]
    (worker,) = serving["workers"]
    assert worker["healthy"] and worker["last_error"] == "", worker
    assert serving["totals"]["answered"] == GOOD_QUERIES
    decisions = [d.kind for d in service.store.list_decisions(APP)]
    assert "worker_unhealthy" not in decisions


def test_loadgen_drives_the_model_over_v2_json_and_binary(
    service: Service,
    model_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = service.store.create_token("admin", name="operator")
    infer_token = service.store.create_token("infer", name="client")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCABULARY, size=(24, TOKENS)).astype(np.int64)
    npz = tmp_path / "rows.npz"
    np.savez(npz, tokens=tokens)
    rows_json = tmp_path / "rows.json"
    rows_json.write_text(
        json.dumps(
            {
                "inputs": [
                    {
                        "name": "tokens",
                        "datatype": "INT64",
                        "shape": list(tokens.shape),
                        "data": tokens.tolist(),
                    }
                ]
            }
        )
    )
    queries = 40
    trace = tmp_path / "trace.csv"
    write_trace_csv(Trace(np.arange(queries) * 0.01, rng.integers(1, 4, size=queries)), trace)
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        _cli(capsys, "model", "push", MODEL, str(model_file))
        _serve(service, tmp_path)
        for inputs, extra in [
            (npz, []),
            (npz, ["--binary"]),
            (rows_json, ["--engine", "raw"]),
            (rows_json, ["--binary", "--engine", "raw"]),
            (npz, ["--protocol", "v1"]),
        ]:
            summary = _cli(
                capsys,
                "loadgen",
                "--app",
                APP,
                "--trace",
                str(trace),
                "--inputs",
                str(inputs),
                "--token",
                infer_token,
                "--slo-ms",
                "1000",
                *extra,
            )
            assert (summary["sent"], summary["answered"]) == (queries, queries), (extra, summary)
            assert summary["errors_by_kind"] == {}
        serving = _serving_status(url, admin)
    assert serving["totals"]["answered"] == 5 * queries


def test_torchscript_pushed_with_inputs_is_profiled_and_served(
    service: Service,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    scripted = torch.jit.script(module.eval())
    path = tmp_path / "plain.pt"
    torch.jit.save(scripted, str(path))  # no heteroplane/signature.json inside
    name, app = "plain-ts", "plain"
    admin = service.store.create_token("admin", name="operator")
    infer_token = service.store.create_token("infer", name="client")
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        pushed = _cli(
            capsys,
            "model",
            "push",
            name,
            str(path),
            "--format",
            "torchscript",
            "--inputs",
            "input:FP32:-1x4",
        )
        assert pushed["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
        spec = tmp_path / "plain.json"
        spec.write_text(
            json.dumps(
                {
                    "name": app,
                    "models": [{"name": name, "artifact": name}],
                    "slo": {"latency_ms": 1000},
                    "budget_usd_per_hr": 1.0,
                    "instance_types": [TYPE],
                }
            )
        )
        _cli(capsys, "app", "apply", "--file", str(spec))
        _cli(
            capsys,
            "profile",
            "run",
            "--app",
            app,
            "--types",
            TYPE,
            "--batch-sizes",
            "1,2",
            "--samples",
            "3",
        )
        plan = _cli(capsys, "plans", "preview", "--app", app, "--rate-qps", "5")
        assert plan["feasible"], plan
        _cli(capsys, "plans", "apply", "--app", app, "--id", str(plan["id"]))
        launch_fleet(service, app, 1)
        x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
        answer = httpx.post(
            f"{url}/v2/models/{app}/infer",
            json={
                "inputs": [
                    {"name": "input", "datatype": "FP32", "shape": [5, 4], "data": x.tolist()}
                ]
            },
            headers={"Authorization": f"Bearer {infer_token}"},
            trust_env=False,
            timeout=60.0,
        )
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    assert output["shape"] == [5, 3]
    with torch.inference_mode():
        expected = scripted(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.reshape(output["data"], (5, 3)), expected, rtol=0, atol=1e-5)


class _Moody(torch.nn.Module):  # type: ignore[name-defined,misc]
    """Raises on a row whose first value is over 100 with an error that names no input fault;
    a row whose first value is under -100 takes a slow path: it reads the named pipe ``gate``,
    whose opening blocks, costing no CPU, until the test opens the pipe to write (:func:`_gate`;
    the read then fails: an answer no client waits for any more); else the first three values,
    doubled."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # type: ignore[name-defined]
        x = input
        if bool((x[:, 0] < -100.0).any()):
            waited = torch.from_file(self.gate, False, 1, dtype=torch.uint8)
            x = x + waited.to(x.dtype).sum() * 0.0
        if bool((x[:, 0] > 100.0).any()):
            raise RuntimeError("the model hit a state it cannot go on from")
        return x[:, :3] * 2.0


@contextlib.contextmanager
def _gate(gate: Path) -> Iterator[Callable[[], None]]:
    """``gate`` a named pipe, opened to write at the end: the slow paths waiting to open it
    go on (and their workers can stop); none waiting, nothing to do. Nothing is written: the
    opening is what they wait for, and a reader goes on at once (``torch.from_file`` cannot
    map a pipe: it raises and closes it), which made a write fail now and then (EPIPE). What
    it yields opens the gate before the end and holds it open: every slow path from then on
    goes on at once (the agent's run of the slow row again alone, after the model raised,
    included)."""
    os.mkfifo(gate)
    held: list[int] = []

    def release() -> None:
        if not held:  # read and write: opens at once, reader or not (Linux)
            held.append(os.open(gate, os.O_RDWR | os.O_NONBLOCK))

    try:
        yield release
    finally:
        with contextlib.suppress(OSError):  # ENXIO: no slow path has it open
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        for fd in held:
            os.close(fd)


def test_a_raising_query_is_a_422_alone_and_a_slow_one_a_504_that_takes_out_one_worker(
    service: Service,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = tmp_path / "gate"
    path = tmp_path / "moody.pt"
    torch.jit.save(torch.jit.script(_Moody(str(gate)).eval()), str(path))
    # A call times out after 1 s (2 s by default), far more than a good query of this model
    # takes; the dispatcher reads it when the app's first query makes it.
    serving = service.serving
    assert serving is not None
    settings = serving.settings
    dispatcher = dataclasses.replace(settings.dispatcher, call_timeout_floor_s=1.0)
    serving.settings = dataclasses.replace(settings, dispatcher=dispatcher)
    name, app = "moody-ts", "moody"
    profiles = tmp_path / "moody-profiles.json"
    entry = {"model": name, "instance_type": TYPE, "batch_sizes": [1], "latency_ms": [1.0]}
    profiles.write_text(json.dumps({"profiles": [entry]}))
    admin = service.store.create_token("admin", name="operator")
    headers = {"Authorization": f"Bearer {service.store.create_token('infer', name='client')}"}
    with ApiServer(service) as url, _gate(gate) as release:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        _cli(capsys, "model", "push", name, str(path), "--format", "torchscript", "--inputs",
             "input:FP32:-1x4")  # fmt: skip
        _serve_app(service, app, name, profiles, workers=2, batch_size=1)

        def infer(first: float) -> httpx.Response:
            return httpx.post(
                f"{url}/v1/apps/{app}/infer",
                json={"inputs": [[first, 2.0, 0.5, 0.0]]},
                headers=headers,
                trust_env=False,
                timeout=120.0,
            )

        def answered(address: str) -> int:
            stats = httpx.get(f"http://{address}/stats", trust_env=False, timeout=30.0).json()
            return int(stats["models"].get(name, {}).get("requests", 0))

        # Good queries, four at once, until each worker has answered one: the model works there.
        deadline = time.monotonic() + RUN_DEADLINE_S
        with ThreadPoolExecutor(4) as pool:
            while True:
                goods = list(pool.map(infer, [1.0] * 4))
                assert all(g.status_code == 200 for g in goods), [g.text for g in goods]
                assert all(g.json()["outputs"] == [1] for g in goods)
                addresses = [w["address"] for w in _serving_status(url, admin, app)["workers"]]
                if len(addresses) == 2 and all(answered(a) for a in addresses):
                    break
                assert time.monotonic() < deadline, "a worker answered no query"
            raised = infer(200.0)  # alone in its batch
            assert raised.status_code == 422, raised.text
            error = raised.json()["error"]
            assert error["code"] == "query_rejected" and "cannot go on" in error["message"], error
            slow = infer(-200.0)
            assert slow.status_code == 504, slow.text
            error = slow.json()["error"]
            assert error["code"] == "query_timeout" and "within 1 s" in error["message"], error
            assert "Retry-After" not in slow.headers
            after = list(pool.map(infer, [1.0] * 4))
            assert all(a.status_code == 200 for a in after), [a.text for a in after]
            # The slow query's worker answers its probes but its agent says the slow batch
            # still runs there: it stays out, probed again and again (two probes seen), and
            # the good queries meanwhile go to the other worker only (its agent has the slow
            # batch alone in flight: no query waited behind it and timed out).
            seen: set[str] = set()
            while len(seen) < 2:
                workers = _serving_status(url, admin, app)["workers"]
                outs = [w for w in workers if not w["healthy"]]
                assert len(outs) == 1, f"the slow query's worker is not kept out: {workers}"
                (out,) = outs
                if out["last_error"].startswith("busy: 1 batch(es) under way"):
                    seen.add(out["last_error"])
                assert time.monotonic() < deadline, f"not kept out as busy: {out}"
                time.sleep(0.05)
            before = answered(out["address"])
            meanwhile = list(pool.map(infer, [1.0] * 8))
            assert all(m.status_code == 200 for m in meanwhile), [m.text for m in meanwhile]
            ready = httpx.get(f"http://{out['address']}/v2/health/ready", trust_env=False)
            assert ready.json()["busy"] is True and ready.json()["in_flight"] == 1, ready.text
            assert answered(out["address"]) == before
            # The slow batch ends: the worker's next probe puts it back, and it serves again.
            release()
            while answered(out["address"]) == before:
                assert time.monotonic() < deadline, "the worker never served again"
                again = list(pool.map(infer, [1.0] * 4))
                assert all(a.status_code == 200 for a in again), [a.text for a in again]
        # The slow query's worker was taken out once, and never the other. The loop records the
        # losses in a thread: polled for.
        while not (losses := _losses(service, app)):
            assert time.monotonic() < deadline, "no worker_unhealthy decision"
            time.sleep(0.05)
    assert len(losses) == 1 and losses[0].numbers["instance_id"] == out["instance_id"], losses


def _losses(service: Service, app: str) -> list[Any]:
    return [d for d in service.store.list_decisions(app) if d.kind == "worker_unhealthy"]
