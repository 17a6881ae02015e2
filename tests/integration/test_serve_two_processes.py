"""``heteroplane serve``'s default start as two processes (docs/service.md, "Serving apart from the
loops"), on the embedded SQLite database:

- the process started serves the API and runs no periodic job (its /metrics counts no job run),
  the loops process it started runs them (its /metrics, at the address the serving process's
  /healthz gives, counts them) and leads; the loops process is forked by the zygote (a child
  of the serving process's own child), which hands it the made-up internal secret over a
  socket: the secret is in no process's environment (``/proc/PID/environ``) nor in the log,
  and the serving process's internal routes take the child's feed exchanges and refuse another
  secret;
- the loops process killed with SIGKILL is started again from the zygote (a new pid, one
  restart) and leads again; then the serving process killed with SIGKILL: its zygote stops the
  loops process and exits (no orphan);
- with the local provisioner: the loops process killed, the serving process goes on answering
  queries, and of a standby loops process started by hand on the same SQLite file and the
  restarted one, one takes the leader lease (a file lock, freed by the kill: whichever tries
  first) and the other stands by; SIGTERM to the serving process stops it and its loops
  process, exit status 0.

Two serving processes on PostgreSQL: tests/integration/test_dispatch_forwarding.py.

Everything waits by polling with a deadline; nothing is timed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import needs_shared
from tests.integration.conftest import process_alive
from tests.integration.test_replicas import (
    _local_profile,
    answered_role,
    apply_local_app,
    role,
    stop_local_workers,
    tails_of,
    wait_for,
)
from tests.integration.test_serve import Server, create_token

pytestmark = [
    needs_shared,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

APP = "two"
LEADER_AND_STANDBY = {"leader", "standby"}
DIGIT = [float(i % 17) for i in range(64)]


def loops_of(server: Server) -> dict[str, Any] | None:
    """The loops process the serving process's /healthz names, once it answers as the lease's
    leader or standby; else None."""
    try:
        health = httpx.get(f"{server.url}/healthz", timeout=5.0).json()
    except httpx.TransportError:
        return None
    loops: dict[str, Any] | None = health.get("loops")
    return loops if loops is not None and loops["role"] is not None else None


def job_runs(metrics: str) -> float:
    """The runs the scheduler finished, every job (a /metrics text)."""
    wanted = "heteroplane_scheduler_job_runs_total{"
    return sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith(wanted) and 'outcome="ran"' in line
    )


def parent_of(pid: int) -> int:
    """``pid``'s parent (/proc/PID/stat's fourth field, after the command's parenthesis)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(): value.decode() for key, value in pairs}


@pytest.mark.slow  # a service starts, and its loops process twice (imports each): ~15 s
def test_the_serving_process_runs_no_job_and_restarts_its_loops(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    # Started as a user starts it: the environment checks below read /proc/PID/environ, which
    # in a forked process is its fork server's.
    server = Server(data_dir, tmp_path / "serve.log", forked=False, rollup_s="0.2")
    try:
        first = wait_for("the loops process", lambda: loops_of(server), server.log_text)
        assert first["role"] == "leader" and first["restarts"] == 0
        # Its feed from this process, as its own /healthz says it (down only where a busy
        # machine timed an exchange out; null would be a loops process that does not say it).
        assert first["serving_feed"] in ("ok", "down")
        admin = {"Authorization": f"Bearer {create_token(data_dir)}"}
        # The serving process's role is its loops process's (asked with a 1 s timeout: read once
        # that one answers); it runs no job itself.
        assert answered_role(server, server.log_text) == "leader"
        assert httpx.get(f"{server.url}/healthz").json()["scheduler_running"] is False

        child = f"{first['url']}/metrics"
        wait_for(
            "the loops' job runs",
            lambda: True if job_runs(httpx.get(child, headers=admin).text) >= 3 else None,
            server.log_text,
        )
        assert job_runs(httpx.get(f"{server.url}/metrics", headers=admin).text) == 0

        # Forked by the zygote, the serving process's child, which runs no job either, with
        # the planners' solvers (scipy.optimize) imported before the fork: no child imports them.
        zygote = parent_of(first["pid"])
        assert zygote != server.process.pid and parent_of(zygote) == server.process.pid
        mapped = "/scipy/optimize/" in Path(f"/proc/{first['pid']}/maps").read_text()
        assert mapped, "the loops process was forked without scipy.optimize imported"
        assert job_runs(httpx.get(child, headers=admin).text) >= 3
        # The secret came over the zygote's socket: in no environment; the child's feed
        # exchanges (ten a second while the jobs ran) were taken, another secret is refused.
        for pid in (server.process.pid, zygote, first["pid"]):
            assert "HETEROPLANE_INTERNAL_TOKEN" not in environ_of(pid)
        # (A feed that timed out on a busy machine is no refusal: only the refusals count.)
        refused = [
            line
            for line in server.log_text().splitlines()
            if "does not answer" in line and "timed out" not in line
        ]
        assert not refused, refused
        feed = f"{server.url}/internal/v1/feed"
        assert httpx.post(feed, json={}, headers={"Authorization": "Bearer no"}).status_code == 401

        os.kill(first["pid"], signal.SIGKILL)
        again = wait_for(
            "the loops process again",
            lambda: found if (found := loops_of(server)) and found["pid"] != first["pid"] else None,
            server.log_text,
        )
        assert again["restarts"] == 1 and again["url"] == first["url"]
        assert parent_of(again["pid"]) == zygote
        wait_for(
            "the restarted loops leading",
            lambda: True if (found := loops_of(server)) and found["role"] == "leader" else None,
            server.log_text,
        )
        assert httpx.get(f"{server.url}/v1/apps", headers=admin).json() == []

        # The serving process killed outright: its zygote stops the loops process and exits
        # (no orphan).
        server.process.kill()
        server.process.wait(timeout=30)
        wait_for(
            "the orphans' stop",
            lambda: None if process_alive(again["pid"]) or process_alive(zygote) else True,
            server.log_text,
        )
    finally:
        server.stop()
    log = server.log_text()
    assert "exited with status -9: starting it again" in log
    assert f"the serving process (pid {server.process.pid}) is gone: stopping its loops" in log
    assert "stopped by SIGTERM" in log
    assert "Traceback" not in log


def _answers(api: httpx.Client) -> bool:
    return api.post(f"/v1/apps/{APP}/infer", json={"inputs": [DIGIT]}).status_code == 200


@pytest.mark.slow  # two service processes, a standby and a worker start (torch each): ~30 s
def test_serving_outlives_its_loops_and_one_loops_process_leads_on_sqlite(
    tmp_path: Path, trained_family: Path
) -> None:
    from tests.integration.conftest import local_data_dir

    data_dir = local_data_dir(tmp_path, trained_family)
    profile = _local_profile(data_dir)
    common = {"provisioner": "local", "tuner_tick_s": "3600", "reconcile_s": "0.5"}
    servers: list[Server] = []
    try:
        serving = Server(data_dir, tmp_path / "serving.log", **common)
        servers.append(serving)
        supervised = wait_for("the loops process", lambda: loops_of(serving), serving.log_text)
        assert supervised["role"] == "leader"
        admin = create_token(data_dir)
        standby = Server(
            data_dir,
            tmp_path / "standby.log",
            role="loops",
            serving_url=serving.url,
            internal_token=admin,
            **common,
        )
        servers.append(standby)
        logs = tails_of(servers)
        assert role(standby) == "standby"

        api = httpx.Client(
            base_url=serving.url, headers={"Authorization": f"Bearer {admin}"}, timeout=120.0
        )
        apply_local_app(api, APP, profile)
        wait_for("an answer", lambda: True if _answers(api) else None, logs)
        # The workers the loops process launched (they run users' models) hold none of the
        # control plane's secrets in their environment, the internal one above all.
        from controlplane.provisioning import LOCAL_WORKERS_DIR

        records = sorted((data_dir / LOCAL_WORKERS_DIR / "instances").glob("*.json"))
        # (read without the provisioner's lock: a record written before its worker's start has
        # no pid yet)
        pids = [json.loads(record.read_text())["pid"] for record in records]
        pids = [pid for pid in pids if pid is not None]
        assert pids and all(process_alive(pid) for pid in pids)
        for pid in pids:
            assert not {"HETEROPLANE_INTERNAL_TOKEN", "HETEROPLANE_DATABASE_URL"} & set(
                environ_of(pid)
            )

        os.kill(supervised["pid"], signal.SIGKILL)
        assert all(_answers(api) for _ in range(5)), logs()

        def one_leader() -> tuple[dict[str, Any], str] | None:
            """The restarted loops process and the standby's role, once one of the two leads
            and the other stands by. The kill freed the lock: the standby (trying every 2 s)
            and the loops process started again 0.5 s after the kill race for it, and either
            may win; a standby that takes a killed leader's lease alone is in test_replicas."""
            restarted = loops_of(serving)
            if restarted is None or restarted["pid"] == supervised["pid"]:
                return None
            other = role(standby)
            return (restarted, other) if {restarted["role"], other} == LEADER_AND_STANDBY else None

        restarted, _ = wait_for("one leader and one standby", one_leader, logs)
        assert _answers(api)
        api.close()
        assert serving.stop() == 0, serving.log_text()
        assert not process_alive(restarted["pid"])
    finally:
        for server in reversed(servers):
            server.stop()
        stop_local_workers(data_dir)
