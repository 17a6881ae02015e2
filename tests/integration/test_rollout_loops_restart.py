"""A rollout survives its loops process killed (docs/service.md, "Supervision"): one ``heteroplane
serve`` (its default start: a serving process and the loops process it supervises) on SQLite with
the local provisioner, the bag-of-tokens ONNX model of ``benchmarks/bad_queries.py`` served by a
local worker, and a client sending queries all along, each with its own request id.

A rollout of a second version (the same weights saved again; steps 50 % and 100 %) is started
through the CLI, and the loops process alone is killed with SIGKILL four times, each time once
the serving process has started it again and it leads:

- **while the new version is profiled** (its profile run's worker started): the loops process
  started again runs the profile again (the dead run's worker, not heard of, is ended by the
  reconciler; the app's budget, sized for one profile worker beside the fleet, makes the new
  run wait for that);
- **while the rollout's worker starts** (launched, booting, then timed alone): the same worker
  is timed alone and the rollout moves to its first step;
- **at the first step**, its worker taking half the queries: the step resumes with the same
  worker (none launched again), passes and the rollout is promoted;
- **during the handover**, once the old version's worker was ended: the loops process started
  again launches its replacement, ends the handover and the rollout's worker, and plans the
  app again.

Every client query is answered (200) while no loops process runs and after; the app's billed
instances never cost more than its budget (read at every poll); every move of the rollout is
said once; the app ends on the new version with one worker, the replacement, and nothing left
``requested``. Each kill lands inside a moment that lasts seconds (the workers pad each batch
to 10 ms, a step lasts :data:`STEP_S`, the handover's route outlives the ended worker by 5 s),
and the test checks after each kill that the rollout was still there.

Everything waits by polling with a deadline; nothing is timed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.bad_queries import MODEL, export_model, service_curves
from controlplane.db.store import Store
from controlplane.policies.lifecycle import BILLED_STATES, LIVE_STATES
from controlplane.policies.rollout import rollout_request_prefix
from controlplane.settings import DATABASE_FILE
from tests.integration.conftest import process_alive
from tests.integration.test_byom import _cli
from tests.integration.test_replicas import stop_local_workers, wait_for
from tests.integration.test_rollouts_local import APP, Client, _same_weights, plan_one_worker
from tests.integration.test_serve import Server, create_token
from tests.integration.test_serve_two_processes import loops_of

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

# A step of the rollout, s: judged no sooner, so that the rollout cannot pass its first step
# between the poll that finds it there and the kill.
STEP_S = 5
# The app's budget: its worker and one more (a profile run's, or the rollout's), 0.1 USD/hr each.
BUDGET_USD_PER_HR = 0.25
# A profile run touches its workers' rows every second: the dead run's worker is ended 4 s after
# its run was last heard of (the default, 10 s, would make that 40 s).
HEARTBEAT_S = 1


class Fleet:
    """The app's instances, read at every poll, which keeps the most its billed ones cost
    together."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store, self.prefix = store, prefix
        self.most_usd_per_hr = 0.0

    def rows(self) -> list[Any]:
        rows = self.store.list_instances(APP)
        billed = sum(r.price_usd_per_hr for r in rows if r.state in BILLED_STATES)
        self.most_usd_per_hr = max(self.most_usd_per_hr, billed)
        return rows

    def step_workers(self) -> list[Any]:
        """The rollout's own workers (request ids ``profile:rollout-APP-ID-...``)."""
        return [r for r in self.rows() if r.request_id.startswith(self.prefix)]

    def profile_workers(self) -> list[Any]:
        """The workers of the profile runs of the new version (``profile:APP-RUN-TYPE``)."""
        return [r for r in self.rows() if r.request_id.startswith(f"profile:{APP}-")]


def _kill_loops(server: Server, logs: Callable[[], str]) -> int:
    """SIGKILL the loops process the serving process's /healthz names, once it leads; its pid,
    once it is gone."""
    loops = wait_for(
        "the loops process leading",
        lambda: found if (found := loops_of(server)) and found["role"] == "leader" else None,
        logs,
    )
    pid: int = loops["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the loops process gone", lambda: None if process_alive(pid) else True, logs)
    return pid


def _started_again(server: Server, killed: int, logs: Callable[[], str]) -> dict[str, Any]:
    """The loops process the serving process started after ``killed``, once it leads."""

    def again() -> dict[str, Any] | None:
        found = loops_of(server)
        if found is None or found["pid"] == killed or found["role"] != "leader":
            return None
        return found

    return wait_for("the loops process started again, leading", again, logs)


@pytest.mark.slow  # a service, its loops process five times, five worker processes
def test_a_loops_process_killed_mid_rollout_resumes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    model = export_model(tmp_path)
    # The workers pad every batch to 10 ms and more (the local provisioner's emulation): the new
    # version's profile run (25 calls at each of 4 batch sizes) and its timing alone on the
    # rollout's worker last over a second each, well over the poll that sees them and the kill.
    profiles = service_curves(data_dir)
    server = Server(
        data_dir,
        tmp_path / "serve.log",
        provisioner="local",
        reconcile_s="0.5",
        tuner_tick_s="3600",
        profile_run_heartbeat_s=str(HEARTBEAT_S),
    )
    store: Store | None = None
    client: Client | None = None

    def logs() -> str:
        return server.log_text()[-6000:]

    try:
        wait_for(
            "the loops process leading",
            lambda: True if (found := loops_of(server)) and found["role"] == "leader" else None,
            logs,
        )
        admin = create_token(data_dir)
        monkeypatch.setenv("HETEROPLANE_URL", server.url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)
        store = Store.from_url(f"sqlite:///{data_dir / DATABASE_FILE}")
        for path in (model, _same_weights(model)):
            _cli(capsys, "model", "push", MODEL, str(path))
        api = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {admin}"}, timeout=120.0
        )
        plan_one_worker(api, profiles, BUDGET_USD_PER_HR)
        fleet_v1 = wait_for(
            "the fleet's worker",
            lambda: [r for r in store.list_instances(APP) if r.state == "running"] or None,
            logs,
        )
        client = Client(server.url, create_token(data_dir, "infer", "client"))
        client.start()

        started = _cli(
            capsys, "rollout", "start", "--app", APP, "--model", f"{MODEL}@2",
            "--steps", "50,100", "--interval-s", str(STEP_S), "--min-queries", "5",
        )  # fmt: skip
        rid = started["id"]
        assert (started["state"], started["phase"]) == ("pending", "profiling"), started
        fleet = Fleet(store, rollout_request_prefix(APP, rid))

        def rollout() -> dict[str, Any]:
            fleet.rows()
            found: dict[str, Any] = api.get(f"/v1/apps/{APP}/rollouts/{rid}").json()
            return found

        # 1. Killed while the new version is profiled (its profile run's worker started).
        live = tuple(LIVE_STATES)

        def profiling() -> list[Any] | None:
            running = [r for r in fleet.profile_workers() if r.state in live]
            return running if running and rollout()["phase"] == "profiling" else None

        dead_run = wait_for("the profile run", profiling, logs)
        killed = _kill_loops(server, logs)
        # Killed while it was still profiling (nothing moves it until a loops process leads).
        assert (lambda r: (r["phase"], r["profiled"]))(rollout()) == ("profiling", None)
        _started_again(server, killed, logs)

        # 2. Killed while the rollout's worker starts (profiled: the run again, by the loops
        # process started again).
        def starting() -> list[Any] | None:
            workers = fleet.step_workers()
            return workers if workers and rollout()["phase"] == "starting" else None

        step_workers = wait_for("the rollout's worker starting", starting, logs)
        killed = _kill_loops(server, logs)
        assert rollout()["phase"] == "starting"
        _started_again(server, killed, logs)

        # 3. Killed at the first step, its worker running.
        def first_step() -> dict[str, Any] | None:
            found = rollout()
            return found if found["state"] == "running" else None

        first = wait_for("the rollout's first step", first_step, logs)
        assert first["step_index"] == 0 and first["profiled"] is not None, first
        runs = {r.request_id for r in fleet.profile_workers()}
        assert len(runs) == 2 and {r.request_id for r in dead_run} < runs, runs
        # The worker launched before the kill, running (none launched again).
        workers = fleet.step_workers()
        assert [(r.id, r.state) for r in workers] == [(step_workers[0].id, "running")], workers
        killed = _kill_loops(server, logs)
        assert (lambda r: (r["state"], r["step_index"]))(rollout()) == ("running", 0)
        _started_again(server, killed, logs)

        # 4. Killed during the handover: promoted, the old version's worker still to replace.
        def handing_over() -> dict[str, Any] | None:
            found = rollout()
            if found["state"] in ("pending", "running"):
                return None
            if found["state"] == "promoted" and not found["figures"]["handover"].get("ended"):
                return None
            return found

        done = wait_for("the rollout's end", handing_over, logs)
        assert done["state"] == "promoted", done
        assert "done_at" not in done["figures"]["handover"], done["figures"]["handover"]
        killed = _kill_loops(server, logs)
        assert "done_at" not in rollout()["figures"]["handover"]
        _started_again(server, killed, logs)

        def reasons() -> list[str]:
            fleet.rows()
            return [d.reason for d in store.list_decisions(APP, kinds=["rollout"])]

        # The handover done, then the app planned again with the new version, once: waited for
        # by the answer the rollout stores with its handover (its decision is written after it).
        planned = wait_for(
            "the plan after the handover",
            lambda: rollout()["figures"]["handover"].get("planned"),
            logs,
        )

        # Nothing left half-done: the profile runs' workers (the dead one's and the second's)
        # and the rollout's own end, the old version's worker is replaced, nothing waits in
        # ``requested``.
        def settled() -> list[Any] | None:
            serving = [r for r in fleet.rows() if r.state in LIVE_STATES]
            return serving if [r.state for r in serving] == ["running"] else None

        (serving,) = wait_for("the rollout's workers ended", settled, logs)
        assert serving.request_id.startswith(f"{APP}-"), serving  # the fleet's
        assert serving.id not in {r.id for r in fleet_v1}, serving  # the replacement
        assert not [r for r in store.list_instances() if r.state == "requested"]
        # One worker for the rollout's steps all along, running once; every move said once.
        assert [r.id for r in fleet.step_workers()] == [step_workers[0].id]
        # The start's own decision first: it says what is to come ("... and the app planned
        # again for it"), so the moves are counted in the loop's decisions after it.
        start, *said = reasons()
        assert start.startswith(f"rollout {rid}: ") and "started by" in start, start
        assert f"rollout {rid}: {planned}" in said, planned
        for move in (
            "profiled before traffic",
            "timed alone before traffic",
            "workers of the new version running",
            "step 1 passed",
            "promoted: last step passed",
            "handover done",
            "planned again",
        ):
            # The ones that say it, whole (a list of all is cut short in pytest's report).
            assert sum(move in r for r in said) == 1, [r for r in said if move in r]
        assert fleet.most_usd_per_hr <= BUDGET_USD_PER_HR, fleet.most_usd_per_hr
        # Where the second profile run waited for the dead run's worker to be ended (the loops
        # process started again within its 4 s), the wait says that worker is part of the amount.
        for waited in (r for r in said if "waiting for the budget" in r):
            assert "0.1 USD/hr of it the workers of other profile runs" in waited, waited
        status = _cli(capsys, "rollout", "status", "--app", APP)
        assert (status["id"], status["state"], status["step_share"]) == (rid, "promoted", 1), status
        assert api.get(f"/v1/apps/{APP}").json()["spec"]["models"][0]["artifact"] == f"{MODEL}@2"
        api.close()
    finally:
        if client is not None:
            client.stop.set()
            client.join(timeout=60.0)
        if store is not None:
            store.close()
        server.stop()
        stop_local_workers(data_dir)
    log = server.log_text()
    assert log.count("exited with status -9: starting it again") == 4, log[-4000:]
    assert "Traceback" not in log, log
    assert client is not None
    assert client.statuses[200] > 0 and set(client.statuses) == {200}, client.statuses
