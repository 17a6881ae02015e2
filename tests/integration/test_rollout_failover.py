"""A rollout survives a leader failover (issue 34, point 6): two ``heteroplane serve`` replicas
on one PostgreSQL database and one data directory (the local provisioner's worker records and
the registry's blobs are files there, as in tests/integration/test_replicas.py), the bag-of-tokens
ONNX model of ``benchmarks/bad_queries.py`` served by a local worker.

Everything goes through the *standby*: the model's two versions pushed, the app registered,
planned and applied, the rollout started (it answers at once; the leader's rollout loop
profiles the new version, starts its worker and moves the rollout to its first step), and a
client's queries, each with its own request id. The leader's serving process may be the app's
dispatcher (the standby's then forwards the queries to it, and the leader measures them), so
the step lasts :data:`STEP_S`, longer than the test takes to see the rollout at its first step
and kill the leader with SIGKILL.
The standby takes the lease and its rollout loop resumes the rollout at the step the database
says, with the same worker (none launched again), judges it on the queries it served, and
promotes it; every client query, before and after the failover, is answered (200).

Everything waits by polling with a deadline; nothing is timed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks.bad_queries import MODEL, export_model, profile_file
from controlplane.db.store import Store
from tests.integration.test_replicas import (
    local_replicas,
    one_leader,
    role,
    stop_local_workers,
    tails_of,
    wait_for,
)
from tests.integration.test_rollouts_local import APP, Client, _same_weights, plan_one_worker
from tests.integration.test_serve import store_token

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

# A step of the rollout, s: judged no sooner, so the leader (whose serving process may dispatch
# the app's queries) cannot move the rollout past its first step between the poll that finds it
# there and the kill, nor while its loops process stops after the kill (it looks for its
# parent every second).
STEP_S = 5


@pytest.mark.slow  # two replicas, a profile run's worker, the fleet's, the rollout's, a handover
def test_a_new_leader_resumes_the_rollout_at_its_step(postgres_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    model = export_model(tmp_path)
    profiles = profile_file(data_dir, (1, 4))
    servers = local_replicas(data_dir, postgres_url, tmp_path)
    store = Store.from_url(postgres_url)
    client: Client | None = None
    try:
        logs = tails_of(servers)
        leader, standby = wait_for("single leader", lambda: one_leader(servers), logs)
        headers = {"Authorization": f"Bearer {store_token(postgres_url)}"}
        api = httpx.Client(base_url=standby.url, headers=headers, timeout=120.0)
        for path in (model, _same_weights(model)):
            pushed = api.post(f"/v1/models/{MODEL}?format=onnx", content=path.read_bytes())
            assert pushed.status_code == 201, pushed.text
        plan_one_worker(api, profiles, 1.0)

        def serving() -> bool | None:
            rows = api.get("/v1/instances", params={"app": APP, "state": "running"}).json()
            return True if rows else None

        wait_for("the fleet's worker", serving, logs)
        client = Client(standby.url, store_token(postgres_url, "infer", "client"))
        client.start()
        started = api.post(
            f"/v1/apps/{APP}/rollouts",
            json={
                "model": f"{MODEL}@2",
                "steps": [0.5, 1.0],
                "interval_s": STEP_S,
                "thresholds": {"min_queries": 5},
            },
        )
        assert started.status_code == 201, started.text
        rid = started.json()["id"]
        assert started.json()["phase"] == "profiling"

        def rollout() -> dict[str, object]:
            found: dict[str, object] = api.get(f"/v1/apps/{APP}/rollouts/{rid}").json()
            return found

        first = wait_for(
            "the rollout's first step",
            lambda: r if (r := rollout())["state"] == "running" else None,
            logs,
        )
        assert first["step_index"] == 0 and first["step_share"] == 0.5
        prefix = f"profile:rollout-{APP}-{rid}-"
        workers = [r for r in store.list_instances(APP) if r.request_id.startswith(prefix)]
        assert [r.state for r in workers] == ["running"]

        leader.process.kill()  # SIGKILL, mid-rollout: its lock connection simply goes
        leader.process.wait(timeout=60)
        wait_for("takeover", lambda: True if role(standby) == "leader" else None, logs)

        done = wait_for(
            "the rollout's end",
            lambda: r if (r := rollout())["state"] not in ("pending", "running") else None,
            logs,
        )
        assert done["state"] == "promoted", done
        spec_now = api.get(f"/v1/apps/{APP}").json()["spec"]
        assert spec_now["models"][0]["artifact"] == f"{MODEL}@2"
        # The same worker, not launched again; one "running" move, made by the dead leader.
        again = [r for r in store.list_instances(APP) if r.request_id.startswith(prefix)]
        assert [r.id for r in again] == [r.id for r in workers], again
        reasons = [d.reason for d in store.list_decisions(APP, kinds=["rollout"])]
        assert sum("workers of the new version running" in r for r in reasons) == 1, reasons
        assert any("step 1 passed" in r for r in reasons), reasons
        api.close()
    finally:
        if client is not None:
            client.stop.set()
            client.join(timeout=60.0)
        store.close()
        for server in servers:
            server.stop()
        stop_local_workers(data_dir)
    assert client is not None
    assert client.statuses[200] > 0 and set(client.statuses) == {200}, client.statuses
