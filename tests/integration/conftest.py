"""A throwaway PostgreSQL server for the tests that need a real one.

``postgres_server`` (session scope) starts a server from Debian's packages (``apt-get install
postgresql``; the binaries under ``/usr/lib/postgresql/<version>/bin``, or ``initdb`` on the PATH)
in a temporary directory, listening on 127.0.0.1 on a free port and on a socket in that directory,
trusting local connections, and stops and removes it at the end. PostgreSQL refuses to run as
root, so as root it runs as the ``postgres`` system user the package creates. ``postgres_url``
gives each test a database of its own on that server. Where PostgreSQL is not installed, the tests
that use them are skipped with the reason.

``trained_family`` (tests/conftest.py: trained once for the whole run) is a cache directory
holding the trained demo model family, for the tests that start real worker agents.
``local_service`` is the whole service on the local provisioner in ``tmp_path``
(:func:`local_data_dir`, :func:`running_local_service` for a test that must put files in the
data directory before the service is built), and :class:`ApiServer` serves a service's API on a
free loopback port.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from controlplane.db.store import InstanceRecord
from controlplane.service.build import Service, build_service
from controlplane.service.protocol import ConnectionLimits, server_options
from controlplane.settings import Settings
from provisioners.local import LocalProvisioner

_START_TIMEOUT_S = 60


def _server_bin() -> Path | None:
    """The newest installed PostgreSQL's bin directory (with initdb and pg_ctl)."""

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path.parent.parent.name)) or (0,)

    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=version)
    if found:
        return found[-1].parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (every integration test's servers take one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def log_since(path: Path, offset: int) -> str:
    """What ``path`` holds past byte ``offset`` (one start's lines in a log restarts append to)."""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


# Starts on a fresh free port when another process took the one chosen before the bind.
PORT_TRIES = 3


P = TypeVar("P")  # a subprocess.Popen, or what tests/serve_forks.py forks


def start_on_a_free_port(
    launch: Callable[[int], P],
    log: Path,
    ready_line: Callable[[str], str],
    what: str,
    deadline_s: float,
) -> tuple[P, int]:
    """Start a service process with ``launch(port)`` on a free loopback port, its output
    appended to ``log``; the process and its port once its own lines (past what ``log`` held
    before) say ``ready_line(url)`` and ``url``/healthz answers. Its log line is waited for, not
    ``/healthz`` alone: another test's server may take a free port between ``free_port`` and
    the bind, and its ``/healthz`` answers too; a start that could not bind is tried again on
    another port (:data:`PORT_TRIES` in all). Any other exit, or no start within
    ``deadline_s`` (the process stopped first), fails the test."""
    for _ in range(PORT_TRIES):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        offset = log.stat().st_size
        process = launch(port)
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if ready_line(url) in log_since(log, offset):
                try:
                    if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                        return process, port
                except httpx.TransportError:
                    pass
            try:
                # Waiting on the process is the pause between polls, and catches an exit.
                code = process.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            if f"cannot listen on 127.0.0.1:{port}" in log_since(log, offset):
                break
            pytest.fail(f"{what} exited with {code}:\n{log.read_text()}")
        else:
            process.kill()
            process.wait()
            pytest.fail(f"{what} not ready in {deadline_s} s:\n{log.read_text()}")
    pytest.fail(f"{what}: no free port held in {PORT_TRIES} tries:\n{log.read_text()}")


class _Server:
    def __init__(self, bin_dir: Path, root: Path, user: str | None) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = free_port()
        self.user = user

    def run(self, *command: str) -> None:
        prefix = ["runuser", "-u", self.user, "--"] if self.user else []
        done = subprocess.run(
            [*prefix, str(self.bin_dir / command[0]), *command[1:]],
            capture_output=True,
            text=True,
            check=False,
            cwd=self.root,
            timeout=_START_TIMEOUT_S * 2,
        )
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(
                f"{command[0]} failed ({done.returncode}): {done.stderr.strip()} {log[-2000:]}"
            )

    def start(self) -> None:
        self.run(
            "initdb", "-A", "trust", "-U", "postgres", "-E", "UTF8", "-N", "-D", str(self.data)
        )
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        # -w: pg_ctl polls until the server accepts connections, up to -t seconds.
        self.run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.log),
            "-w",
            "-t",
            str(_START_TIMEOUT_S),
            "start",
        )

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[_Server]:
    bin_dir = _server_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")
    user: str | None = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
        if shutil.which("runuser") is None:
            pytest.skip("running as root and runuser (util-linux) is missing")
        user = "postgres"
    # The postgres user must reach the directory: under root's own TMPDIR it may not.
    parent = "/tmp" if user is not None and Path("/tmp").is_dir() else None
    root = Path(tempfile.mkdtemp(prefix="heteroplane-pg-", dir=parent))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    root.chmod(0o700)
    server = _Server(bin_dir, root, user)
    try:
        server.start()
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: _Server, request: pytest.FixtureRequest) -> Iterator[str]:
    """A URL of an empty database of its own on the throwaway server."""
    import psycopg

    name = "t_" + re.sub(r"\W+", "_", request.node.name.lower())[:40] + "_" + os.urandom(3).hex()
    admin = f"host=127.0.0.1 port={postgres_server.port} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    yield postgres_server.url(name)
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, and a database on the throwaway PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'heteroplane.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


# --- a service on the local provisioner (real worker processes) -------------------------------

WORKER_POLL_S = 0.25


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie counts as dead (its parent may not have reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with Path(f"/proc/{pid}/stat").open() as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def stop_every_worker(provisioner: LocalProvisioner) -> None:
    """Terminate every worker ``provisioner`` knows and wait (with a deadline) until they exit."""
    records = provisioner.records()
    provisioner.terminate([r.provider_id for r in records])
    provisioner.close()
    pids = [r.pid for r in records if r.pid is not None]  # no pid: it never started
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(WORKER_POLL_S)
    assert not any(process_alive(pid) for pid in pids)


def local_data_dir(tmp_path: Path, trained_family: Path) -> Path:
    """``tmp_path/data`` with the session's trained family where the local workers look for it
    (``models``)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "models").symlink_to(trained_family, target_is_directory=True)
    return data_dir


@contextmanager
def running_local_service(data_dir: Path, **settings: Any) -> Iterator[Service]:
    """The whole service (``build_service``) on the local provisioner over ``data_dir``, with
    ``settings`` overriding the defaults; every worker is stopped at the end."""
    built = build_service(Settings(data_dir=data_dir, provisioner="local", **settings))
    assert isinstance(built.provisioner, LocalProvisioner)
    try:
        yield built
    finally:
        stop_every_worker(built.provisioner)
        built.close()


@pytest.fixture
def local_service(tmp_path: Path, trained_family: Path) -> Iterator[Service]:
    """The whole service on the local provisioner, its data dir in ``tmp_path`` and the session's
    trained family where the workers look for it; every worker is stopped at the end."""
    with running_local_service(local_data_dir(tmp_path, trained_family)) as built:
        yield built


# Workers import torch and load the family: seconds each, more on a busy shared machine.
FLEET_DEADLINE_S = 300.0


def reconcile_until(
    service: Service, app: str, done: Callable[[list[InstanceRecord]], bool], what: str
) -> list[InstanceRecord]:
    """Run the reconciler until ``done`` holds of ``app``'s instance records (returned), or fail
    after FLEET_DEADLINE_S with ``what`` and the tails of the workers' logs."""
    deadline = time.monotonic() + FLEET_DEADLINE_S
    while True:
        service.reconciler.run_once()
        rows = service.store.list_instances(app)
        if done(rows):
            return rows
        if time.monotonic() > deadline:
            logs = service.settings.data_dir / "workers" / "logs"
            tails = {p.name: p.read_text()[-800:] for p in sorted(logs.glob("*.log"))}
            pytest.fail(f"no {what} within {FLEET_DEADLINE_S:g} s: {rows}; logs: {tails}")
        time.sleep(WORKER_POLL_S)


def launch_fleet(service: Service, app: str, count: int) -> list[InstanceRecord]:
    """Run the reconciler until ``app`` has ``count`` running instances (their records)."""
    rows = reconcile_until(
        service,
        app,
        lambda rows: sum(r.state == "running" for r in rows) >= count,
        f"{count} running workers",
    )
    return [r for r in rows if r.state == "running"]


SERVER_DEADLINE_S = 60.0


class ApiServer:
    """The service's API on a free loopback port, served by uvicorn in a thread (lifespan on:
    the serving loop and the scheduler run as under ``heteroplane serve``). ``with ApiServer(s)
    as url:`` waits (with a deadline) until it listens; leaving the block stops it."""

    def __init__(self, service: Service) -> None:
        # Bound here and handed to uvicorn, which listens on it after the lifespan's start: a
        # port only chosen here could be taken by another test process's socket meanwhile.
        # IPPROTO_TCP, as uvicorn's own socket has it: asyncio sets TCP_NODELAY only on the
        # connections of a socket that says it is TCP (heteroplane serve's listen() says why).
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.bind(("127.0.0.1", 0))
        self.port: int = self.socket.getsockname()[1]
        # The server ``heteroplane serve`` runs: its protocol with the connection limits, and
        # its keep-alive timeout (75 s, longer than a client keeps an idle connection; with
        # uvicorn's 5 s a load generator's query now and then went out on a connection the
        # server was closing at that moment, and failed).
        limits = ConnectionLimits.from_settings(service.settings)
        config = uvicorn.Config(
            service.app,
            log_level="warning",
            lifespan="on",
            **server_options(limits, front=service.app.state.services.front_door),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="uvicorn", daemon=True
        )

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + SERVER_DEADLINE_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                pytest.fail("the API server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60.0)
        self.socket.close()


def measure_profiles(cache: Path, out: Path, models: str, batch_sizes: str) -> Path:
    """``heteroplane profile measure`` of ``models`` through workers of the two emulated types the
    local tests run (and of ``local.cpu``), a few samples: the numbers only price and rank,
    nothing is timed. The file's compute section is the built-in curves the workers pad to."""
    from controlplane.cli import main

    status = main(
        [
            "profile",
            "measure",
            "--models",
            models,
            "--batch-sizes",
            batch_sizes,
            "--samples",
            "3",
            "--warmup",
            "1",
            "--instance-types",
            "emu.cpu.small,emu.cpu.large",
            "--cache-dir",
            str(cache),
            "--out",
            str(out),
        ]
    )
    assert status == 0
    return out
