"""A worker whose model is stuck on a query is replaced, end to end (docs/provisioners.md, "A
worker stuck on a batch"; docs/serving.md, "Failures").

A real ``heteroplane serve`` (its serving process and the loops process it starts) on the local
provisioner and SQLite, with ``worker_stuck_s`` of 6 s, ``worker_unresponsive_s`` of 2 s and a
reconcile every 0.5 s, serves a TorchScript model through an app whose plan has one worker
(under a budget that pays for one, not two), then two (for two, not three) with a
``worker_stuck_s`` of 1 s, under the stuck call's timeout: the bound is then the caller's
timeout, which the agent's health says (``busy_timeout_s``), so the worker is not ended while its
call is still out (it was, and the query, tried again on the other worker, took that one out
too: a 502 and both replaced). The model doubles
the first three values of a row; a row whose first value is under -100 takes a slow path that
waits at a gate (a named pipe, as in tests/integration/test_user_model_serving.py) the test
opens only at its end: the model is stuck on that query while the worker's agent answers
``/health``, saying it is busy.

- the stuck query is answered 504 at its call's timeout (2 s: the call timed out, the worker
  answered its probe; a slow query, not a lost worker), not left hanging;
- meanwhile a good query is answered by the other worker, or with none, refused at once (503);
- the reconciler's liveness probe finds the agent's batch older than ``worker_stuck_s`` and its
  caller's timeout and terminates its instance (a ``terminate`` decision of cause
  ``unresponsive`` whose reason says the model is stuck and an age past the bound), the
  worker's process is gone and the local provisioner's record of it too (SIGTERM: its agent
  stops after its drain time, the stuck batch abandoned), and a replacement is launched and
  runs; the other worker is left alone;
- the billed fleet, sampled all along, never exceeds the budget; no instance is left
  ``requested``;
- good queries after the replacement runs are answered with the model's outputs.

Everything is polled against deadlines; nothing is timed.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest

from controlplane.provisioning import LOCAL_WORKERS_DIR
from tests.integration.conftest import process_alive
from tests.integration.test_byom import _cli
from tests.integration.test_replicas import stop_local_workers
from tests.integration.test_serve import Server, create_token
from tests.integration.test_user_model_serving import _gate, _Moody

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # a service, its loops process and two workers start (torch each)

APP = "stuck"
MODEL = "stuck-ts"
TYPE = "emu.cpu.large"  # 0.1 USD/hr
DEADLINE_S = 240.0
POLL_S = 0.1
SETTINGS = {
    "provisioner": "local",
    "reconcile_s": "0.5",
    "worker_unresponsive_s": "2",
    "tuner_tick_s": "3600",  # the tuner leaves the one-worker fleet as planned
}
CALL_TIMEOUT_S = 2  # the stuck query's call: max(2 s, 10 x the 1 ms profile)

T = TypeVar("T")


def _poll(what: str, probe: Callable[[], T | None], diagnose: Callable[[], str]) -> T:
    """``probe()`` until it is not None (returned), or fail after DEADLINE_S naming ``what``."""
    deadline = time.monotonic() + DEADLINE_S
    while (found := probe()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {DEADLINE_S:g} s:\n{diagnose()}")
        time.sleep(POLL_S)
    return found


def _pid_of(data_dir: Path, provider_id: str) -> int:
    """The worker process of ``provider_id`` (the local provisioner's record of it)."""
    return int(json.loads(_record(data_dir, provider_id).read_text())["pid"])


def _record(data_dir: Path, provider_id: str) -> Path:
    return data_dir / LOCAL_WORKERS_DIR / "instances" / f"{provider_id}.json"


def _row(first: float) -> list[float]:
    return [first, 2.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("workers", "rate_qps", "budget", "stuck_s"),
    [
        # One worker paid for, not two: it goes before its replacement comes. The bound, 6 s,
        # is past the call's timeout and its probe, with room for a busy machine.
        (1, 1.0, 0.15, 6),
        # The other worker serves meanwhile; two paid for, not three. The bound, 1 s, is under
        # the call's timeout: the caller's timeout is the bound then.
        (2, 1500.0, 0.25, 1),
    ],
)
def test_a_worker_stuck_on_a_query_is_terminated_and_replaced(
    workers: int,
    rate_qps: float,
    budget: float,
    stuck_s: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    gate = tmp_path / "gate"
    model_file = tmp_path / "moody.pt"
    torch.jit.save(torch.jit.script(_Moody(str(gate)).eval()), str(model_file))
    profiles = data_dir / "stuck-profiles.json"  # a spec names files in the data directory
    entry = {"model": MODEL, "instance_type": TYPE, "batch_sizes": [1], "latency_ms": [1.0]}
    profiles.write_text(json.dumps({"profiles": [entry]}))

    server = Server(data_dir, tmp_path / "serve.log", **SETTINGS, worker_stuck_s=str(stuck_s))
    costs: list[float] = []
    try:
        with _gate(gate):
            admin = create_token(data_dir)
            infer_token = create_token(data_dir, scope="infer", name="client")
            api = httpx.Client(
                base_url=server.url,
                headers={"Authorization": f"Bearer {admin}"},
                timeout=120.0,
                trust_env=False,
            )

            def diagnose() -> str:
                instances = api.get("/v1/instances", params={"app": APP}).json()
                decisions = api.get(f"/v1/apps/{APP}/decisions").json()
                return f"{instances}\n{decisions}\n{server.log_text()[-4000:]}"

            def instances() -> list[dict[str, Any]]:
                answer = api.get("/v1/instances", params={"app": APP})
                assert answer.status_code == 200, answer.text
                found: list[dict[str, Any]] = answer.json()
                return found

            def billed() -> float:
                fleet = api.get(f"/v1/apps/{APP}/fleet")
                assert fleet.status_code == 200, fleet.text
                cost = float(fleet.json()["cost_usd_per_hr"])
                costs.append(cost)
                return cost

            def running() -> list[dict[str, Any]]:
                billed()
                return [i for i in instances() if i["state"] == "running"]

            def infer(first: float) -> httpx.Response:
                tensor = {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": _row(first)}
                return httpx.post(
                    f"{server.url}/v2/models/{APP}/infer",
                    json={"inputs": [tensor]},
                    headers={"Authorization": f"Bearer {infer_token}"},
                    trust_env=False,
                    timeout=120.0,
                )

            def doubled(answer: httpx.Response, first: float) -> None:
                assert answer.status_code == 200, answer.text
                (output,) = answer.json()["outputs"]
                expected = (np.array([_row(first)[:3]], dtype=np.float32) * 2.0).ravel()
                np.testing.assert_allclose(output["data"], expected, rtol=0, atol=1e-6)

            monkeypatch.setenv("HETEROPLANE_URL", server.url)
            monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
            _cli(capsys, "model", "push", MODEL, str(model_file), "--format", "torchscript",
                 "--inputs", "input:FP32:-1x4")  # fmt: skip
            spec = {
                "name": APP,
                "models": [{"name": MODEL, "artifact": MODEL, "profiles": str(profiles)}],
                "slo": {"latency_ms": 1000},
                "budget_usd_per_hr": budget,
                "instance_types": [TYPE],
            }
            created = api.post("/v1/apps", json=spec)
            assert created.status_code == 201, created.text
            plan = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": rate_qps})
            assert plan.status_code == 201, plan.text
            (stage,) = plan.json()["stages"]
            assert stage["fleet"] == {TYPE: workers}, plan.json()
            applied = api.post(f"/v1/apps/{APP}/plans/{plan.json()['id']}/apply")
            assert applied.status_code == 200, applied.text

            fleet = _poll(
                f"{workers} running workers",
                lambda: up if len(up := running()) == workers else None,
                diagnose,
            )
            pids = {i["id"]: _pid_of(data_dir, i["provider_id"]) for i in fleet}
            assert all(process_alive(pid) for pid in pids.values())
            doubled(_poll("answer", lambda: r if (r := infer(1.0)).status_code == 200 else None,
                          diagnose), 1.0)  # fmt: skip

            # The stuck query: its call times out, the worker answers its probe (busy): a 504
            # (the protocol's error, a text), at the call's timeout, not the give-up time.
            stuck = infer(-200.0)
            assert stuck.status_code == 504, stuck.text
            assert f"not answered within {CALL_TIMEOUT_S} s" in stuck.json()["error"], stuck.text

            def taken_out() -> str | None:
                for decision in api.get(f"/v1/apps/{APP}/decisions?kind=worker_unhealthy").json():
                    return str(decision["numbers"]["instance_id"])
                return None

            out = _poll("worker_unhealthy decision", taken_out, diagnose)
            assert out in pids, (out, pids)
            (old,) = [i for i in fleet if i["id"] == out]

            # Meanwhile a good query is served by the other worker, or, with none, refused at
            # once (the stuck one is out of matching; no query waits behind its batch).
            meanwhile = infer(3.0)
            if workers > 1:
                doubled(meanwhile, 3.0)
            elif meanwhile.status_code != 200:  # 200: the replacement already runs
                assert meanwhile.status_code == 503, meanwhile.text

            def terminated() -> dict[str, Any] | None:
                billed()
                for decision in api.get(f"/v1/apps/{APP}/decisions?kind=terminate").json():
                    if out in decision["numbers"]["instance_ids"]:
                        found: dict[str, Any] = decision
                        return found
                return None

            decision = _poll("terminate of the stuck worker", terminated, diagnose)
            assert decision["numbers"]["cause"] == "unresponsive", decision
            assert "its model is stuck" in decision["reason"], decision
            bound_s = max(stuck_s, CALL_TIMEOUT_S)
            over = f"{stuck_s} s" if stuck_s >= CALL_TIMEOUT_S else "its caller's timeout of 2 s"
            ran = re.search(rf"one batch for ([0-9.]+) s, over {over}", decision["reason"])
            assert ran is not None and float(ran.group(1)) > bound_s, decision  # reads past it
            assert decision["numbers"]["instance_ids"] == [out], decision

            def replaced() -> list[dict[str, Any]] | None:
                up = running()
                (row,) = [i for i in instances() if i["id"] == out]
                gone = row["state"] == "terminated" and not process_alive(pids[out])
                if not gone or _record(data_dir, old["provider_id"]).exists():
                    return None
                return up if len(up) == workers else None

            now = _poll("replacement running, the stuck worker gone", replaced, diagnose)
            assert out not in {i["id"] for i in now}
            # The other worker was left alone.
            assert {i["id"] for i in now} >= set(pids) - {out}, (now, pids)
            for first in (1.0, 2.0, 4.0, 5.0):
                doubled(infer(first), first)
            rows = instances()
            assert not [i for i in rows if i["state"] == "requested"], rows
            assert sum(i["state"] == "running" for i in rows) == workers, rows
            unhealthy = api.get(f"/v1/apps/{APP}/decisions?kind=worker_unhealthy").json()
            assert [d["numbers"]["instance_id"] for d in unhealthy] == [out], unhealthy
            billed()
    finally:
        server.stop()
        stop_local_workers(data_dir)
    assert costs and max(costs) <= budget, costs
