"""Replicas of ``heteroplane serve``: a leader and a standby on one PostgreSQL database, and the
SQLite single-replica rule.

- The PostgreSQL advisory lock itself (:class:`~controlplane.db.lease.AdvisoryLock`): one session
  holds it, and it is free once that session's connection is gone.
- Two real ``serve`` processes on one PostgreSQL database with the EC2 provisioner against a moto
  server (the cloud both replicas share): exactly one says ``leader`` on ``/healthz``; an app
  registered, planned and applied through the *standby* is launched by the leader; the leader is
  killed with SIGKILL; the standby becomes leader and reconciles (an instance terminated behind
  the control plane's back is replaced); at the end the cloud runs exactly the plan's instances,
  each one recorded once in the database (no duplicate launch, no orphan).
- A second ``serve`` on the SQLite file another one serves exits at once with one line.

Everything waits by polling with a deadline; nothing is timed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from sqlalchemy import text

from controlplane.db.lease import AdvisoryLock, lock_sqlite_database, sqlite_leader_lock
from controlplane.db.session import make_engine
from controlplane.errors import DatabaseError
from provisioners.base import APP_TAG
from tests.conftest import needs_shared
from tests.integration.moto_server import (
    REGION,
    Ec2Network,
    aws_env,
    ec2_network,
    moto_server,
    needs_moto,
)
from tests.integration.test_serve import REPO, Server, rm2_spec, service_env, store_token

__all__ = ["aws_env", "ec2_network", "moto_server"]  # fixtures, imported for pytest

APP = "rm2-kairos"
# Launches, a takeover (the lease is tried every 2 s) and a replacement: generous on a busy host.
DEADLINE_S = 180.0
POLL_S = 0.25

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], diagnose: Callable[[], str]) -> T:
    """Poll ``probe`` until it returns something other than None (returned), or fail after
    DEADLINE_S naming ``what`` with ``diagnose()``."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {DEADLINE_S:g} s:\n{diagnose()}")
        time.sleep(POLL_S)


# --- the lock ---------------------------------------------------------------------------------


def test_the_advisory_lock_has_one_holder_and_is_freed_with_its_session(postgres_url: str) -> None:
    first, second = AdvisoryLock(postgres_url), AdvisoryLock(postgres_url)
    engine = make_engine(postgres_url)
    try:
        assert first.try_acquire() and first.check() and first.held
        assert first.try_acquire()  # already ours
        assert not second.try_acquire() and not second.check()
        # The holder's connection goes (what a kill -9 of its process does to it).
        with engine.connect() as admin:
            ended = admin.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'heteroplane-leader-lease'"
                    " AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'"
                    " AND granted)"
                )
            ).all()
        assert [row[0] for row in ended] == [True]
        assert not first.check() and not first.held
        assert wait_for("takeover", lambda: True if second.try_acquire() else None, str)
        assert not first.try_acquire()  # it reconnects, and finds the lock taken
        second.release()
        assert first.try_acquire()
    finally:
        first.close()
        second.close()
        engine.dispose()


def test_a_holder_that_stops_checking_loses_the_lock(postgres_url: str) -> None:
    """A frozen leader (its socket open, no statement sent) loses the lock once PostgreSQL ends
    its idle session (idle_session_timeout on the lock's connection)."""
    frozen, standby = AdvisoryLock(postgres_url), AdvisoryLock(postgres_url)
    try:
        assert frozen.try_acquire() and not standby.try_acquire()
        assert wait_for("takeover", lambda: True if standby.try_acquire() else None, str)
        assert not frozen.check()  # when it wakes up, its fence finds the lock gone
    finally:
        frozen.close()
        standby.close()


def test_one_process_per_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'data' / 'heteroplane.db'}"
    held = lock_sqlite_database(url)
    assert held is not None
    try:
        with pytest.raises(DatabaseError, match="SQLite serves one replica") as refused:
            lock_sqlite_database(url)
        assert "\n" not in str(refused.value)
    finally:
        held.close()
    again = lock_sqlite_database(url)
    assert again is not None
    again.close()
    assert lock_sqlite_database("sqlite://") is None


def test_the_leader_lock_of_a_sqlite_file_has_one_holder_at_a_time(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'data' / 'heteroplane.db'}"
    first, second = sqlite_leader_lock(url), sqlite_leader_lock(url)
    assert first is not None and second is not None
    try:
        assert not first.check()  # never tried
        assert first.try_acquire() and first.check() and first.try_acquire()
        assert not second.try_acquire() and not second.check()
        first.release()
        assert not first.check()
        assert second.try_acquire() and not first.try_acquire()
    finally:
        first.release()
        second.release()
    assert sqlite_leader_lock("sqlite://") is None


def refused_serve(data_dir: Path, *args: str, **settings: str) -> str:
    """The one line on stderr of a ``serve`` (with ``args`` and ``settings``) that must be
    refused at start (exit status 2). Without gRPC: the default gRPC port, which the first
    server holds, would add a warning line."""
    second = subprocess.run(
        [sys.executable, "-m", "controlplane", "serve", "--port", "0", "--no-grpc", *args],
        cwd=REPO,
        env=service_env(data_dir, **settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    return lines[0]


def test_a_second_serve_on_one_sqlite_file_exits_with_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    first = Server(data_dir, tmp_path / "first.log")
    try:
        line = refused_serve(data_dir)
        assert line.startswith("heteroplane serve: another heteroplane process (pid ")
        assert "SQLite serves one replica" in line
        # Its loops process leads (it starts beside the serving process, so not at once).
        wait_for("the leader", lambda: True if role(first) == "leader" else None, first.log_text)
    finally:
        assert first.stop() == 0


# --- two replicas on PostgreSQL -----------------------------------------------------------------


def ec2_settings(network: Ec2Network, database_url: str) -> dict[str, str]:
    return {
        "database_url": database_url,
        "provisioner": "ec2",
        "ec2_region": REGION,
        "ec2_subnet_ids": ",".join(network.subnet_ids),
        "ec2_security_group_ids": network.security_group_id,
        "ec2_ami_id": network.ami_id,
        "reconcile_s": "1",
    }


def cloud_instances() -> dict[str, str]:
    """The app's live instances in the (moto) cloud: provider id -> type."""
    import boto3

    ec2: Any = boto3.client("ec2", region_name=REGION)
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": f"tag:{APP_TAG}", "Values": [APP]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )
    return {
        i["InstanceId"]: i["InstanceType"]
        for page in pages
        for reservation in page["Reservations"]
        for i in reservation["Instances"]
    }


def terminate_in_cloud(provider_id: str) -> None:
    import boto3

    boto3.client("ec2", region_name=REGION).terminate_instances(InstanceIds=[provider_id])


def role(server: Server) -> str | None:
    """The role ``server``'s /healthz says; None while it does not answer. A ``serve`` process's
    role is the one of the loops process it supervises, which it asks with a 1 s timeout and
    calls ``standby`` when that one does not answer in time (a busy machine): None then too, so
    that a missed answer is never read as the lease's standby."""
    try:
        answer = httpx.get(f"{server.url}/healthz", timeout=5.0)
    except httpx.TransportError:
        return None
    health = answer.json()
    loops = health.get("loops")
    if loops is not None and loops["role"] is None:
        return None
    found: str = health["role"]
    return found


def answered_role(server: Server, diagnose: Callable[[], str]) -> str:
    """:func:`role` once ``server`` answers it (waiting, with :func:`wait_for`'s deadline)."""
    return wait_for("an answer to /healthz", lambda: role(server), diagnose)


def tails_of(servers: Sequence[Server]) -> Callable[[], str]:
    """What a failed wait shows: the tail of each server's log."""

    def logs() -> str:
        return "\n".join(
            f"--- {s.log_path.name}\n{s.log_path.read_text()[-4000:]}" for s in servers
        )

    return logs


def one_leader(servers: Sequence[Server]) -> tuple[Server, Server] | None:
    """(leader, standby) once exactly one of the two servers leads; else None."""
    roles = [role(s) for s in servers]
    if sorted(map(str, roles)) != ["leader", "standby"]:
        return None
    return (servers[0], servers[1]) if roles[0] == "leader" else (servers[1], servers[0])


def reconcile_runs(api: httpx.Client) -> float:
    """How many reconcile runs the replica behind ``api`` has finished: the /metrics of the
    loops process it supervises (``heteroplane serve``'s default), else its own."""
    wanted = 'heteroplane_scheduler_job_runs_total{job="reconcile",outcome="ran"}'
    loops = api.get("/healthz").json().get("loops")
    where = "/metrics" if loops is None else f"{loops['url']}/metrics"
    for line in api.get(where).text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def replicas(
    ec2_network: Ec2Network, postgres_url: str, tmp_path: Path
) -> Iterator[tuple[Server, Server]]:
    """Two ``serve`` processes on one PostgreSQL database and one (moto) cloud, each with a data
    directory of its own (two hosts); both stopped at the end (the killed one already is)."""
    settings = ec2_settings(ec2_network, postgres_url)
    servers: list[Server] = []
    try:
        for name in ("a", "b"):
            data_dir = tmp_path / name
            data_dir.mkdir()
            servers.append(Server(data_dir, tmp_path / f"{name}.log", **settings))
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()


@needs_moto
@needs_shared
def test_a_standby_takes_over_from_a_killed_leader_without_duplicates(
    replicas: tuple[Server, Server], postgres_url: str, tmp_path: Path
) -> None:
    servers = replicas

    logs = tails_of(servers)
    leader, standby = wait_for("single leader", lambda: one_leader(servers), logs)
    headers = {"Authorization": f"Bearer {store_token(postgres_url)}"}
    api = httpx.Client(base_url=standby.url, headers=headers, timeout=120.0)

    # Everything through the standby: every replica serves the API.
    created = api.post("/v1/apps", json=rm2_spec(standby.data_dir))
    assert created.status_code == 201, created.text
    plan = api.post(
        f"/v1/apps/{APP}/plans",
        json={"trace": {"rate_qps": 40.0, "batch_dist": "kairos", "duration_s": 60.0}},
    )
    assert plan.status_code == 201 and plan.json()["feasible"], plan.text
    planned: Counter[str] = Counter()
    for stage in plan.json()["stages"]:
        planned.update(stage["fleet"])
    assert sum(planned.values()) >= 1
    applied = api.post(f"/v1/apps/{APP}/plans/{plan.json()['id']}/apply")
    assert applied.status_code == 200, applied.text

    def running_as_planned() -> dict[str, str] | None:
        rows = api.get("/v1/instances", params={"app": APP, "state": "running"}).json()
        cloud = cloud_instances()
        recorded = {r["provider_id"]: r["instance_type"] for r in rows}
        return cloud if recorded == cloud and Counter(cloud.values()) == planned else None

    first_fleet = wait_for("fleet as planned", running_as_planned, logs)
    assert answered_role(standby, logs) == "standby"

    leader.process.kill()  # SIGKILL: no shutdown, its lock connection simply goes
    leader.process.wait(timeout=60)
    wait_for("takeover", lambda: True if role(standby) == "leader" else None, logs)

    # The new leader reconciles: an instance lost behind its back is replaced.
    lost = sorted(first_fleet)[0]
    terminate_in_cloud(lost)

    def replaced() -> dict[str, str] | None:
        fleet = running_as_planned()
        return fleet if fleet is not None and lost not in fleet else None

    final = wait_for("replacement", replaced, logs)
    # ...and keeps reconciling without adding anything (two more of its ticks).
    runs = reconcile_runs(api)
    wait_for("reconcile runs", lambda: True if reconcile_runs(api) >= runs + 2 else None, logs)
    assert running_as_planned() == final

    # No duplicate launch, no orphan: the cloud runs exactly the plan's instances, each recorded
    # once, and every other row has ended.
    assert Counter(final.values()) == planned
    assert set(final) - set(first_fleet) and len(set(first_fleet) & set(final)) == len(final) - 1
    rows = api.get("/v1/instances", params={"app": APP}).json()
    live = [r for r in rows if r["state"] in ("requested", "pending", "running", "terminating")]
    assert sorted(r["provider_id"] for r in live) == sorted(final)
    assert [r["provider_id"] for r in rows if r["state"] == "failed"] == [lost]
    assert len({r["provider_id"] for r in rows}) == len(rows)
    assert answered_role(standby, logs) == "leader"
    api.close()
    assert standby.stop() == 0, standby.log_path.read_text()
    assert "leader lease acquired" in standby.log_path.read_text()


def local_spec(name: str, profile: Path) -> dict[str, Any]:
    """An app of ``tiny`` on up to two ``emu.cpu.large`` local workers (``profile``:
    :func:`_local_profile`'s)."""
    return {
        "name": name,
        "models": [{"name": "tiny", "profiles": str(profile)}],
        "slo": {"latency_ms": 500, "percentile": 99},
        "budget_usd_per_hr": 0.25,
        "instance_types": ["emu.cpu.large"],
        "max_counts": {"emu.cpu.large": 2},
    }


def apply_local_app(api: httpx.Client, name: str, profile: Path, rate_qps: float = 30.0) -> None:
    """Register :func:`local_spec`'s app ``name`` through ``api``, plan it for ``rate_qps`` and
    apply the plan."""
    assert api.post("/v1/apps", json=local_spec(name, profile)).status_code == 201
    plan = api.post(f"/v1/apps/{name}/plans", json={"rate_qps": rate_qps})
    assert plan.status_code == 201, plan.text
    applied = api.post(f"/v1/apps/{name}/plans/{plan.json()['id']}/apply")
    assert applied.status_code == 200, applied.text


def _local_profile(data_dir: Path) -> Path:
    """A profile file in which ``tiny`` on ``emu.cpu.large`` takes 20 ms a batch (and the
    workers pad to it): one instance carries about 50 qps."""
    import numpy as np

    from controlplane.provisioning import LOCAL_PROFILE_FILE
    from estimator.profiles import LatencyProfile, write_profiles_json
    from provisioners.worker.emulation import ComputeCurve, compute_document

    path = data_dir / LOCAL_PROFILE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    cell = (np.full(8, 20.0),)
    write_profiles_json(
        [LatencyProfile("tiny", t, np.array([1]), cell) for t in ("local.cpu", "emu.cpu.large")],
        path,
        source="tests/integration/test_replicas.py",
        compute=compute_document({"tiny": ComputeCurve(20.0, 0.0)}),
    )
    return path


def test_a_standby_adopts_the_killed_leaders_local_workers(
    postgres_url: str, tmp_path: Path, trained_family: Path
) -> None:
    """Two replicas on one host and one data directory (the local provisioner's worker records
    are files there): the leader launches the plan's local workers and is killed with SIGKILL;
    its workers outlive it (sessions of their own), and the new leader adopts them: no second
    launch, no orphan, the same worker processes serving."""
    from controlplane.provisioning import LOCAL_WORKERS_DIR
    from provisioners.local import LocalProvisioner
    from tests.integration.conftest import local_data_dir

    data_dir = local_data_dir(tmp_path, trained_family)
    profile = _local_profile(data_dir)
    servers = local_replicas(data_dir, postgres_url, tmp_path)
    try:
        logs = tails_of(servers)
        leader, standby = wait_for("single leader", lambda: one_leader(servers), logs)
        headers = {"Authorization": f"Bearer {store_token(postgres_url)}"}
        api = httpx.Client(base_url=standby.url, headers=headers, timeout=120.0)
        assert api.post("/v1/apps", json=local_spec("local-app", profile)).status_code == 201
        plan = api.post("/v1/apps/local-app/plans", json={"rate_qps": 70.0})
        assert plan.status_code == 201, plan.text
        planned = sum(n for s in plan.json()["stages"] for n in s["fleet"].values())
        assert planned == 2, plan.json()
        assert api.post(f"/v1/apps/local-app/plans/{plan.json()['id']}/apply").status_code == 200

        def workers() -> dict[str, int]:
            """Alive local worker processes recorded for the app: provider id -> pid."""
            local = LocalProvisioner(data_dir / LOCAL_WORKERS_DIR, {}, ["tiny"], None)
            try:
                # list() first, records() second: the leader may launch a worker between the two
                # reads, and a record read first would lack the newcomer that list() then sees.
                listed = [i.provider_id for i in local.list({})]
                pids = {r.provider_id: r.pid for r in local.records() if r.pid is not None}
                return {i: pids[i] for i in listed if i in pids}
            finally:
                local.close()

        def running_as_planned() -> dict[str, int] | None:
            rows = api.get("/v1/instances", params={"app": "local-app", "state": "running"})
            recorded = {r["provider_id"] for r in rows.json()}
            alive = workers()
            return alive if len(recorded) == planned and set(alive) == recorded else None

        first = wait_for("the plan's workers", running_as_planned, logs)
        leader.process.kill()
        leader.process.wait(timeout=60)
        wait_for("takeover", lambda: True if role(standby) == "leader" else None, logs)
        runs = reconcile_runs(api)
        wait_for("reconcile runs", lambda: True if reconcile_runs(api) >= runs + 3 else None, logs)

        # The same worker processes serve; nothing was launched again, nothing is orphaned.
        assert running_as_planned() == first
        rows = api.get("/v1/instances", params={"app": "local-app"}).json()
        assert len(rows) == planned and {r["state"] for r in rows} == {"running"}
        api.close()
    finally:
        for server in servers:
            server.stop()
        stop_local_workers(data_dir)


def local_replicas(data_dir: Path, postgres_url: str, logs: Path) -> list[Server]:
    """Two ``serve`` replicas on one PostgreSQL database and one data directory, with the local
    provisioner (fast reconcile ticks; the tuner idle, so that the fleet stays the plan's)."""
    settings = {
        "database_url": postgres_url,
        "provisioner": "local",
        "reconcile_s": "0.5",
        "tuner_tick_s": "3600",
    }
    return [Server(data_dir, logs / f"{n}.log", **settings) for n in ("a", "b")]


def stop_local_workers(data_dir: Path) -> None:
    """Stop every local worker recorded in ``data_dir`` (they outlive the services that
    launched them)."""
    from controlplane.provisioning import LOCAL_WORKERS_DIR
    from provisioners.local import LocalProvisioner

    stopper = LocalProvisioner(data_dir / LOCAL_WORKERS_DIR, {}, ["tiny"], None)
    try:
        stopper.terminate([record.provider_id for record in stopper.records()])
    finally:
        stopper.close()
