"""The serving path and the loops in processes of their own (``heteroplane serve --role
serving`` and ``--role loops``, docs/service.md, "Serving apart from the loops"), on one
PostgreSQL database with the local provisioner:

- one serving process (``/healthz`` says ``serving``) and two loops processes, of which exactly
  one leads; an app registered, planned and applied through the serving process is launched by
  the leading loops process, and the serving process answers its queries;
- what the serving loop observes reaches the loops: the leader's roll-up records windows with
  latencies (it has no serving loop of its own: they came over the internal routes);
- the leading loops process is killed with SIGKILL: the serving process goes on answering, the
  other loops process takes the lease and rolls up the serving process's windows in turn;
- a second serving process on the database is refused in one line (one serving process per
  database: docs/service.md says why).

Everything waits by polling with a deadline; nothing is timed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.integration.test_replicas import (
    _local_profile,
    apply_local_app,
    one_leader,
    refused_serve,
    role,
    stop_local_workers,
    tails_of,
    wait_for,
)
from tests.integration.test_serve import Server, store_token

APP = "apart"
DIGIT = [float(i % 17) for i in range(64)]


def _answers(api: httpx.Client) -> bool:
    answer = api.post(f"/v1/apps/{APP}/infer", json={"inputs": [DIGIT]})
    return answer.status_code == 200


def _rolled_up_latency_samples(api: httpx.Client) -> int:
    samples = api.get(f"/v1/apps/{APP}/metrics").json()
    return sum(1 for s in samples if s["latency_p50_ms"] is not None)


@pytest.mark.slow  # three service processes and two workers start (torch each): tens of seconds
def test_serving_answers_apart_from_the_loops_and_outlives_their_leader(
    postgres_url: str, tmp_path: Path, trained_family: Path
) -> None:
    from tests.integration.conftest import local_data_dir

    data_dir = local_data_dir(tmp_path, trained_family)
    profile = _local_profile(data_dir)
    common = {"database_url": postgres_url, "provisioner": "local", "tuner_tick_s": "3600"}
    servers: list[Server] = []
    try:
        serving = Server(data_dir, tmp_path / "serving.log", role="serving", **common)
        servers.append(serving)
        assert role(serving) == "serving"
        admin = store_token(postgres_url)
        loops_settings = {
            **common,
            "reconcile_s": "0.5",
            "rollup_s": "0.5",
            "serving_url": serving.url,
            "internal_token": admin,
        }
        loops = [
            Server(data_dir, tmp_path / f"loops-{n}.log", role="loops", **loops_settings)
            for n in ("a", "b")
        ]
        servers += loops
        logs = tails_of(servers)
        leader, standby = wait_for("single leader", lambda: one_leader(loops), logs)

        api = httpx.Client(
            base_url=serving.url, headers={"Authorization": f"Bearer {admin}"}, timeout=120.0
        )
        apply_local_app(api, APP, profile)

        # The loops launch the fleet; the serving process finds it in the database and answers.
        wait_for("an answer", lambda: True if _answers(api) else None, logs)
        # The serving loop's windows reach the leader's roll-up over the internal routes.
        wait_for(
            "rolled-up latencies",
            lambda: True if _answers(api) and _rolled_up_latency_samples(api) >= 1 else None,
            logs,
        )

        leader.process.kill()  # SIGKILL: its lock connection goes with it
        leader.process.wait(timeout=60)
        assert all(_answers(api) for _ in range(5)), logs()
        wait_for("takeover", lambda: True if role(standby) == "leader" else None, logs)
        before = _rolled_up_latency_samples(api)
        wait_for(
            "the new leader's roll-up",
            lambda: True if _answers(api) and _rolled_up_latency_samples(api) > before else None,
            logs,
        )
        assert role(serving) == "serving" and _answers(api)

        line = refused_serve(data_dir, "--role", "serving", **common)
        assert "another serving process already serves this database" in line
        api.close()
    finally:
        for server in servers:
            server.stop()
        stop_local_workers(data_dir)


def test_one_process_is_for_role_all_alone(tmp_path: Path) -> None:
    line = refused_serve(tmp_path, "--role", "serving", "--one-process")
    assert line == (
        "heteroplane serve: --one-process: only with --role all (not serving): it runs both"
    )


def test_the_loops_apart_need_the_serving_url_and_token(tmp_path: Path) -> None:
    line = refused_serve(tmp_path, "--role", "loops")  # the default database: a SQLite file
    assert "set serving_url (HETEROPLANE_SERVING_URL) and internal_token" in line
