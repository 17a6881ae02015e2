"""tests/serve_forks.py, which the integration tests' ``serve`` processes start through: a forked
``serve`` gets the request's arguments, environment and streams, and its exit status comes back
as a :class:`subprocess.Popen`'s would (an exit code, or minus the signal that ended it)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from controlplane.settings import DATABASE_FILE
from tests import serve_forks
from tests.conftest import needs_shared
from tests.integration.test_serve import REPO, Server, service_env
from tests.serve_forks import Forked, popen

pytestmark = needs_shared


def test_a_forked_serve_takes_its_arguments_and_streams_and_reports_its_exit(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = popen(
            [sys.executable, "-m", "controlplane", "serve", "--one-process", "--role", "loops"],
            cwd=REPO,
            env=service_env(tmp_path),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    assert isinstance(process, Forked)
    assert process.wait(timeout=60) == 2
    assert process.poll() == 2
    (line,) = log.read_text().splitlines()
    assert line.startswith("heteroplane serve: --one-process: only with --role all (not loops)")


def test_a_forked_serve_runs_in_its_environment_and_a_kill_is_its_status(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    server = Server(data_dir, tmp_path / "serve.log", reconcile_s="86400")
    try:
        assert isinstance(server.process, Forked)
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        assert (data_dir / DATABASE_FILE).exists()  # HETEROPLANE_DATA_DIR, the request's
        with pytest.raises(subprocess.TimeoutExpired):
            server.process.wait(timeout=0.1)
        server.process.kill()
        assert server.process.wait(timeout=60) == -signal.SIGKILL
    finally:
        server.stop()


def test_other_commands_and_pipes_are_started_as_before(tmp_path: Path) -> None:
    version = popen([sys.executable, "-m", "controlplane", "--version"], stdout=subprocess.PIPE)
    piped = popen(
        [sys.executable, "-m", "controlplane", "serve", "--one-process", "--role", "loops"],
        cwd=REPO,
        env=service_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for process in (version, piped):
        assert isinstance(process, subprocess.Popen)
        process.communicate(timeout=120)
    assert piped.returncode == 2


def test_a_forked_serve_dies_with_its_fork_server_and_the_next_start_gets_another(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    server = Server(data_dir, tmp_path / "serve.log", reconcile_s="86400")
    try:
        assert isinstance(server.process, Forked)
        (fork_server,) = serve_forks._SERVER
        fork_server._process.kill()  # killed outright: it cannot end its children itself
        assert server.process.wait(timeout=60) == -signal.SIGKILL
        serve_forks._wait_gone(server.process.pid, deadline_s=30.0)  # its parent death signal
        assert not Path(f"/proc/{server.process.pid}").exists(), "it outlived its fork server"
    finally:
        server.stop()
    again = Server(data_dir, tmp_path / "again.log", reconcile_s="86400")
    try:
        assert isinstance(again.process, Forked)
        assert serve_forks._SERVER[0] is not fork_server
    finally:
        again.stop()
