"""``heteroplane demo`` as a real process, and README.md's code blocks run against it as written.

The demo runs with ``HOME`` in a temporary folder, its data directory chosen through
``XDG_DATA_HOME`` (one of the documented settings) and its port through ``HETEROPLANE_PORT`` (a
free one, not 8000, so that a developer's own demo does not get in the way). README.md's blocks
read both settings, so they run as written (:mod:`tests.readme_blocks`: every ``sh`` and
``python`` block in order, but those the README marks as skipped, from a working directory whose
``.venv/bin`` is this interpreter): talking to the demo with curl and the command line, then
"Your own model": the ONNX export, push, app, profile run, plan, ``plans apply --wait`` and a
query over the Open Inference Protocol.

The demo serves the model family from local worker processes: the session's trained family is
copied into the data directory first (so the demo does not train it again) and the profiles are
measured through real workers with a few samples (``--profile-samples``), which the emulated
types' real-time compute makes take a few tens of seconds before the service answers. The first
start runs without the demo load (the README's own load generator and profile run are load
enough on two cores); the restart runs with it. Readiness is polled against ``/healthz``, then
against the inference route until the workers answer, with deadlines (no fixed sleeps). The
workers outlive the demo by design; the test stops them at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.cli import main
from controlplane.cli.loops_process import STOP_WAIT_S
from controlplane.db.lease import lock_sqlite_database
from controlplane.db.store import Store
from provisioners.local import LocalProvisioner
from tests.integration.conftest import start_on_a_free_port, stop_every_worker
from tests.readme_blocks import README, Block, BlockRunner, readme_blocks

REPO = Path(__file__).resolve().parents[2]
# The profiles are measured through real workers before the service listens.
START_DEADLINE_S = 300.0
# A stop waits for the loops child's running jobs (up to STOP_WAIT_S, then it is killed) while
# the requests in flight drain: past that, and a margin for a busy machine, it hangs.
STOP_DEADLINE_S = STOP_WAIT_S + 30.0
# A README block: its commands may start workers and wait for them (profile run, --wait).
BLOCK_TIMEOUT_S = 600.0
PROFILE_SAMPLES = "3"
# The first zero of sklearn's digits, as README.md's inference example sends it.
A_DIGIT = [0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4]
A_DIGIT += [12, 0, 0, 8, 8, 0, 0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5]
A_DIGIT += [10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0]

pytest.importorskip("torch")


def data_home(home: Path) -> Path:
    """The ``XDG_DATA_HOME`` the test gives the user whose home is ``home`` (not the default
    ``~/.local/share``, so that nothing may write that path out)."""
    return home / "xdg-data"


def demo_env(home: Path, port: int) -> dict[str, str]:
    """The environment of a user whose home is ``home``, with no heteroplane settings but the
    port, and ``XDG_DATA_HOME`` (the data directory is ``$XDG_DATA_HOME/heteroplane``)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETEROPLANE_", "XDG_")) and k != "HOME"
    }
    env |= {
        "HOME": str(home),
        "XDG_DATA_HOME": str(data_home(home)),
        "HETEROPLANE_PORT": str(port),
    }
    return env


class Demo:
    """``python -m controlplane demo`` on a free loopback port, its stderr in a log file."""

    def __init__(self, home: Path, log: Path, *options: str) -> None:
        self.home = home
        self.log_path = log
        self._log = log.open("ab")
        command = [sys.executable, "-m", "controlplane", "demo"]
        command += ["--profile-samples", PROFILE_SAMPLES, *options]

        def launch(port: int) -> subprocess.Popen[bytes]:
            self.env = demo_env(home, port)
            return subprocess.Popen(
                command, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
            )

        self.process, self.port = start_on_a_free_port(
            launch, log, lambda url: f"heteroplane demo is ready on {url}", "demo", START_DEADLINE_S
        )
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        return data_home(self.home) / "heteroplane"

    def wait_served(self) -> dict[str, Any]:
        """Send the README's digit until the workers answer it; the answer."""
        deadline = time.monotonic() + START_DEADLINE_S
        last = ""
        with self.api() as api:
            while time.monotonic() < deadline:
                answer = api.post("/v1/apps/demo/infer", json={"inputs": [A_DIGIT]})
                if answer.status_code == 200:
                    body: dict[str, Any] = answer.json()
                    return body
                last = answer.text
                try:
                    code = self.process.wait(timeout=0.5)  # the pause between tries
                except subprocess.TimeoutExpired:
                    continue
                pytest.fail(f"demo exited with {code}:\n{self.log_path.read_text()}")
        pytest.fail(f"the demo's workers did not answer in {START_DEADLINE_S} s: {last}")

    def wait_logged(self, text: str) -> None:
        """Until the demo's log holds ``text`` (or fail after START_DEADLINE_S)."""
        deadline = time.monotonic() + START_DEADLINE_S
        while text not in self.log_path.read_text():
            if time.monotonic() > deadline:
                pytest.fail(f"no {text!r} in the demo's log:\n{self.log_path.read_text()}")
            try:
                code = self.process.wait(timeout=0.2)  # the pause between looks
            except subprocess.TimeoutExpired:
                continue
            pytest.fail(f"demo exited with {code}:\n{self.log_path.read_text()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def api(self) -> httpx.Client:
        token = (self.data_dir / "demo-token").read_text().strip()
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60.0
        )


def run_readme(workdir: Path, demo: Demo) -> list[Block]:
    """Run README.md's blocks in order against ``demo`` (see the module docstring); each must
    exit 0 without a traceback. The blocks run."""
    assert shutil.which("bash") is not None
    runner = BlockRunner(workdir, demo.env, BLOCK_TIMEOUT_S)
    ran: list[Block] = []
    for block in readme_blocks(README.read_text(encoding="utf-8")):
        if block.skip is not None:
            continue
        done = runner.run(block, len(ran) + 1)
        said = f"{block} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert done.returncode == 0, said
        assert "Traceback" not in done.stderr, said
        ran.append(block)
    return ran


@pytest.fixture
def home(tmp_path: Path) -> Path:
    folder = tmp_path / "home"
    folder.mkdir()
    return folder


@pytest.fixture
def home_with_family(home: Path, trained_family: Path) -> Iterator[Path]:
    """``home`` whose data directory holds the session's trained family; the local workers the
    demos in it launched are stopped afterwards."""
    data_dir = data_home(home) / "heteroplane"
    data_dir.mkdir(parents=True)
    shutil.copytree(trained_family, data_dir / "models")
    try:
        yield home
    finally:
        stop_workers(data_dir / "workers")


def stop_workers(state_dir: Path) -> None:
    """Terminate every local worker recorded in ``state_dir`` and wait for them to exit."""
    if state_dir.is_dir():
        stop_every_worker(LocalProvisioner(state_dir, {}, ["tiny"], None))


def plans_applied(api: httpx.Client) -> list[Any]:
    decisions = api.get("/v1/apps/demo/decisions").json()
    return [d for d in decisions if d["kind"] == "plan_applied"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.slow
def test_the_readme_runs_as_written_against_the_demo_and_a_restart_adds_nothing(
    home_with_family: Path, tmp_path: Path
) -> None:
    pytest.importorskip("onnx", reason="the README's ONNX export writes through onnx")
    home = home_with_family
    demo = Demo(home, tmp_path / "demo.log", "--no-load")
    try:
        banner = demo.log_path.read_text()
        assert f"heteroplane demo is ready on {demo.url}" in banner
        assert str(demo.data_dir / "demo-token") in banner
        assert "no demo load (--no-load)" in banner
        assert "training" not in banner  # the family was there already
        assert (demo.data_dir / "profiles" / "family.json").is_file()
        token_file = demo.data_dir / "demo-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text()
        answer = demo.wait_served()
        assert answer["outputs"] == [0] and len(answer["models"]) == 1

        workdir = tmp_path / "checkout"
        ran = run_readme(workdir, demo)
        sections = [block.section for block in ran]
        assert sections.count("Talk to it") == 2 and "Your own model" in sections
        assert (workdir / "wine.onnx").is_file() and (workdir / "demo-trace.csv").is_file()

        with demo.api() as api:
            apps = api.get("/v1/apps").json()
            assert sorted(app["name"] for app in apps) == ["demo", "wine"]
            demo_app = next(app for app in apps if app["name"] == "demo")
            spec = demo_app["spec"]
            assert len(spec["cascade"]) >= 2 and spec["validation"].endswith("validation.json")
            assert spec["instance_types"] == ["emu.cpu.small", "emu.cpu.large"]
            plans = api.get("/v1/apps/demo/plans").json()
            assert [plan["status"] for plan in plans] == ["applied"]
            assert demo_app["applied_plan_id"] == plans[0]["id"]
            assert plans[0]["feasible"] is True
            # The README's own model: applied, and served (`plans apply --wait` returned).
            wine = api.get("/v1/apps/wine").json()
            assert wine["applied_plan_id"] is not None
            assert api.get("/v2/models/wine/ready").json() == {"name": "wine", "ready": True}
            before = {
                "apps": api.get("/v1/apps").json(),
                "plans": plans,
                "budget": api.get("/v1/apps/demo/budget").json(),
                "plans_applied": plans_applied(api),
            }
        # The README changed the budget: the restart must keep it, not re-register the app.
        assert len(before["budget"]["changes"]) > 1
    finally:
        code = demo.stop()
    log = demo.log_path.read_text()
    assert code == 0, log
    assert "stopped by SIGTERM" in log
    assert "demo load:" not in log
    assert "Traceback" not in log

    again = Demo(home, tmp_path / "demo-again.log")
    try:
        assert "a demo load runs against it" in again.log_path.read_text()
        with again.api() as api:
            assert api.get("/v1/apps").json() == before["apps"]
            assert api.get("/v1/apps/demo/plans").json() == before["plans"]
            assert api.get("/v1/apps/demo/budget").json() == before["budget"]
            assert plans_applied(api) == before["plans_applied"]
        again.wait_logged("demo load: started")
    finally:
        assert again.stop() == 0, again.log_path.read_text()
    log = again.log_path.read_text()
    assert "registered already" in log and "applied already" in log
    assert "made an admin token" not in log and "measuring" not in log
    assert "Traceback" not in log
    assert (again.data_dir / "demo-token").read_text() == token

    store = Store.from_url(f"sqlite:///{again.data_dir / 'heteroplane.db'}")
    try:
        assert store.verify_token(token.strip()) is not None
        assert [(t.name, t.scope, t.revoked_at) for t in store.list_tokens()] == [
            ("demo-admin", "admin", None)
        ]
    finally:
        store.close()


def run_demo(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``heteroplane demo argv`` in-process; (exit status, stderr)."""
    try:
        status = main(["demo", *argv])
    except SystemExit as stop:
        status = int(stop.code or 0)
    return status, capsys.readouterr().err


@pytest.fixture
def quiet_env(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("HETEROPLANE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(home / "data"))


@pytest.mark.usefixtures("quiet_env")
def test_demo_refuses_bad_input_in_one_line(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run_demo(capsys, "--profile-samples", "0")
    assert status == 2
    assert err.count("\n") == 1 and "--profile-samples: must be >= 1" in err

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = run_demo(capsys, "--port", str(port))
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("heteroplane demo: cannot listen on")
    assert not (home / "data").exists()  # refused before any work

    status, err = run_demo(capsys, "--json")
    assert status == 2 and err.count("\n") == 1 and "only with --offline" in err


@pytest.mark.usefixtures("quiet_env")
def test_demo_down_while_the_demo_runs_says_what_to_do(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The running demo holds its SQLite database (here: this test holds the same lock)."""
    lock = lock_sqlite_database(f"sqlite:///{home / 'data' / 'heteroplane.db'}")
    assert lock is not None
    try:
        status, err = run_demo(capsys, "--down")
    finally:
        lock.close()
    assert status == 2
    (last,) = err.splitlines()  # the refusal alone, no banner before it
    assert f"the demo (pid {os.getpid()}) is running on {home / 'data'}" in last
    assert "stop it with Ctrl-C" in last and "heteroplane app down demo" in last
    assert "standby" not in err


@pytest.mark.usefixtures("quiet_env")
def test_demo_on_a_database_another_service_holds_is_refused_before_any_work(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second demo (or one beside a ``serve``) on the same SQLite file says so at once, as a
    second ``serve`` does, rather than train and measure the family into that data directory
    first (here: this test holds the serving process's lock)."""
    lock = lock_sqlite_database(f"sqlite:///{home / 'data' / 'heteroplane.db'}")
    assert lock is not None
    try:
        status, err = run_demo(capsys, "--port", "0", "--no-load")
    finally:
        lock.close()
    assert status == 2
    last = err.splitlines()[-1]
    assert "already serves the SQLite database" in last and "Traceback" not in err
    assert not (home / "data" / "models").exists() and not (home / "data" / "profiles").exists()
