"""``heteroplane serve`` as a real process on a loopback port: register an app, change its budget,
plan and apply, stop the server with SIGTERM, start it again on the same data directory and find
everything still there; and the operator's client commands against a live server.

Readiness is polled against ``/healthz`` with a deadline (no fixed sleeps).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from controlplane.cli import main
from controlplane.db.store import Store
from controlplane.settings import DATABASE_FILE
from tests.conftest import KAIROS_CSV, needs_shared
from tests.integration.conftest import free_port, start_on_a_free_port
from tests.serve_forks import Forked, popen

REPO = Path(__file__).resolve().parents[2]
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0

pytestmark = needs_shared


def service_env(data_dir: Path, **settings: str) -> dict[str, str]:
    """The environment of a service on ``data_dir`` with the fake provisioner; ``settings``
    are more HETEROPLANE_* variables (``reconcile_s="60"``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROPLANE_")}
    env |= {"HETEROPLANE_DATA_DIR": str(data_dir), "HETEROPLANE_PROVISIONER": "fake"}
    env |= {f"HETEROPLANE_{name.upper()}": value for name, value in settings.items()}
    if "HETEROPLANE_SHARED" in os.environ:
        env["HETEROPLANE_SHARED"] = os.environ["HETEROPLANE_SHARED"]
    return env


class Server:
    """``python -m controlplane serve`` on a free loopback port (forked from the test process's
    fork server, tests/serve_forks.py, unless ``forked`` is False)."""

    def __init__(
        self,
        data_dir: Path,
        log: Path,
        *,
        role: str = "all",
        forked: bool = True,
        **settings: str,
    ) -> None:
        self.data_dir = data_dir
        self.log_path = log
        self._log = log.open("ab")
        roles = () if role == "all" else ("--role", role)
        env = service_env(data_dir, **settings)
        # Forked from a process that has imported the service (tests/serve_forks.py), unless a
        # test looks at what a fork does not give: the process's own /proc/PID/environ is the
        # fork server's.
        start = popen if forked else subprocess.Popen

        def launch(port: int) -> Forked | subprocess.Popen[bytes]:
            command = [sys.executable, "-m", "controlplane", "serve", "--port", str(port), *roles]
            return start(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

        self.process, self.port = start_on_a_free_port(
            launch, log, lambda url: f"heteroplane serving on {url} ", "serve", START_DEADLINE_S
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text()

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


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    return folder


def store_token(database_url: str, scope: str = "admin", name: str = "ops") -> str:
    """A token of ``scope`` in the database at ``database_url``, written through the store in
    this process."""
    store = Store.from_url(database_url, upgrade=True)
    try:
        return store.create_token(scope, name=name)
    finally:
        store.close()


def create_token(
    data_dir: Path, scope: str = "admin", name: str = "ops", *, cli: bool = False
) -> str:
    """A token of ``scope`` in the database of the service on ``data_dir``: made by
    ``heteroplane token create`` as an operator makes it with ``cli``, else written through the
    store in this process (a second of a core less than the command, which imports the store
    and its migrations to make it; the command itself is tested here, in
    :func:`test_serve_survives_a_restart`, and in tests/component/test_cli_db_token.py)."""
    if not cli:
        # The service's database as service_env leaves it (the default under data_dir), whatever
        # HETEROPLANE_* this process's environment holds.
        return store_token(f"sqlite:///{data_dir / DATABASE_FILE}", scope, name)
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "token", "create", "--scope", scope, "--name", name],
        cwd=REPO,
        env=service_env(data_dir),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def rm2_spec(data_dir: Path) -> dict[str, Any]:
    """examples/rm2.yaml with its profiles copied into the service's ``data_dir`` (a spec sent
    to the API may name files there only) and named by their absolute path."""
    document: dict[str, Any] = yaml.safe_load((REPO / "examples" / "rm2.yaml").read_text())
    profiles = data_dir / KAIROS_CSV.name
    if not profiles.exists():
        shutil.copyfile(KAIROS_CSV, profiles)
    document["models"][0]["profiles"] = str(profiles)
    return document


# The reconciler held off in the restart test: it compares the state the API wrote before and
# after a restart, which a reconcile tick between the snapshot and the stop would add to (the
# fake provisioner's launches). A reconcile at the jobs' start finds no app yet.
HELD_OFF = {"reconcile_s": "86400"}


def test_serve_survives_a_restart(data_dir: Path, tmp_path: Path) -> None:
    server = Server(data_dir, tmp_path / "serve.log", **HELD_OFF)
    try:
        token = create_token(data_dir, cli=True)
        api = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=120.0
        )
        assert api.get("/v1/apps").json() == []
        assert httpx.get(f"{server.url}/v1/apps").status_code == 401

        created = api.post("/v1/apps", json=rm2_spec(data_dir))
        assert created.status_code == 201, created.text
        changed = api.put(
            "/v1/apps/rm2-kairos/budget", json={"budget_usd_per_hr": 6.0, "reason": "quarter end"}
        )
        assert changed.status_code == 200, changed.text
        plan = api.post(
            "/v1/apps/rm2-kairos/plans",
            json={"trace": {"rate_qps": 40.0, "batch_dist": "kairos", "duration_s": 60.0}},
        )
        assert plan.status_code == 201, plan.text
        plan_id = plan.json()["id"]
        assert plan.json()["feasible"] is True
        applied = api.post(f"/v1/apps/rm2-kairos/plans/{plan_id}/apply")
        assert applied.status_code == 200, applied.text
        before = {
            "app": api.get("/v1/apps/rm2-kairos").json(),
            "budget": api.get("/v1/apps/rm2-kairos/budget").json(),
            "plans": api.get("/v1/apps/rm2-kairos/plans").json(),
            "decisions": api.get("/v1/apps/rm2-kairos/decisions").json(),
        }
        api.close()
    finally:
        code = server.stop()
    assert code == 0, server.log_path.read_text()
    log = server.log_path.read_text()
    assert "stopped by SIGTERM" in log
    assert "Traceback" not in log

    # The restarted service serves alone (no loops process): a new leader reconciles at once
    # (the applied plan's fleet launched on the fake provider), where this reads what the API
    # wrote before the restart.
    again = Server(data_dir, tmp_path / "serve-again.log", role="serving", **HELD_OFF)
    try:
        api = httpx.Client(
            base_url=again.url, headers={"Authorization": f"Bearer {token}"}, timeout=60.0
        )
        app = api.get("/v1/apps/rm2-kairos").json()
        assert app == before["app"]
        assert app["budget_usd_per_hr"] == 6.0
        assert app["applied_plan_id"] == plan_id
        budget = api.get("/v1/apps/rm2-kairos/budget").json()
        assert budget == before["budget"]
        assert [(c["who"], c["new_usd_per_hr"], c["reason"]) for c in budget["changes"]] == [
            ("ops", 10.0, "app registered"),
            ("ops", 6.0, "quarter end"),
        ]
        plans = api.get("/v1/apps/rm2-kairos/plans").json()
        assert plans == before["plans"]
        assert [p["status"] for p in plans] == ["applied"]
        decisions = api.get("/v1/apps/rm2-kairos/decisions").json()
        assert decisions == before["decisions"]
        assert [d["kind"] for d in decisions] == ["plan_applied"]
        api.close()
    finally:
        assert again.stop() == 0


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``heteroplane argv`` in-process; (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def live(data_dir: Path, tmp_path: Path) -> Iterator[Server]:
    # The reconciler held off: the fleet commands check what the API wrote, which a reconcile
    # tick after `plans apply` (the fake provisioner's launches) would add to on a slow machine.
    server = Server(data_dir, tmp_path / "serve.log", **HELD_OFF)
    yield server
    assert server.stop() == 0, server.log_path.read_text()


def test_client_commands_against_a_live_server(
    live: Server,
    data_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = create_token(data_dir, "operator", "deployer")
    monkeypatch.setenv("HETEROPLANE_URL", live.url)
    monkeypatch.setenv("HETEROPLANE_TOKEN", token)
    spec_file = tmp_path / "rm2.yaml"
    spec_file.write_text(yaml.safe_dump(rm2_spec(data_dir)))

    status, out, _ = cli(capsys, "app", "apply", "-f", str(spec_file))
    assert status == 0 and out.startswith("registered rm2-kairos: budget $10/hr")
    status, out, _ = cli(capsys, "app", "apply", "-f", str(spec_file))
    assert status == 0 and out.startswith("unchanged: rm2-kairos")
    status, out, _ = cli(capsys, "app", "list")
    assert status == 0 and "rm2-kairos" in out and "BUDGET_USD_PER_HR" in out

    preview_rm2 = ["plans", "preview", "--app", "rm2-kairos", "--rate-qps", "40"]
    preview_rm2 += ["--batch-dist", "kairos", "--duration", "60"]
    status, out, _ = cli(capsys, *preview_rm2, "--json")
    assert status == 0
    plan = json.loads(out)
    assert plan["status"] == "previewed" and plan["feasible"] is True
    status, out, _ = cli(capsys, "plans", "list", "--app", "rm2-kairos")
    assert status == 0 and "previewed" in out
    status, out, _ = cli(capsys, "plans", "apply", "--app", "rm2-kairos", "--id", str(plan["id"]))
    assert status == 0 and f"plan {plan['id']} of rm2-kairos (applied)" in out
    status, _, err = cli(capsys, "plans", "apply", "--app", "rm2-kairos", "--id", str(plan["id"]))
    assert status == 2
    assert err.count("\n") == 1 and "already applied" in err and "409" in err

    status, out, _ = cli(
        capsys, "budget", "set", "--app", "rm2-kairos", "--usd-per-hr", "7.5", "--reason", "more"
    )
    assert status == 0 and "budget $7.5/hr (was $10/hr)" in out
    status, out, _ = cli(capsys, "budget", "get", "--app", "rm2-kairos", "--json")
    budget = json.loads(out)
    assert [(c["who"], c["new_usd_per_hr"]) for c in budget["changes"]] == [
        ("deployer", 10.0),
        ("deployer", 7.5),
    ]
    status, _, err = cli(
        capsys, "budget", "set", "--app", "rm2-kairos", "--usd-per-hr", "-1", "--reason", "x"
    )
    assert status == 2 and "budget_usd_per_hr" in err and "422" in err

    status, out, _ = cli(capsys, "fleet", "--app", "rm2-kairos")
    assert status == 0 and "0 live instance(s)" in out
    status, out, _ = cli(capsys, "fleet", "--json")
    assert status == 0 and json.loads(out) == {"instances": []}
    # The ended instances are left out unless asked for (a cycling fleet leaves thousands), and
    # the newest --limit are shown, saying so when older ones are left out.
    store = Store.from_url(f"sqlite:///{data_dir / 'heteroplane.db'}")
    ended = store.record_instance(
        "rm2-kairos", request_id="gone", instance_type="r5n.large", price_usd_per_hr=0.149
    )
    store.transition_instance(ended.id, "failed", reason="capacity")
    live_ids = [
        store.record_instance(
            "rm2-kairos", request_id=f"r{n}", instance_type="r5n.large", price_usd_per_hr=0.149
        ).id
        for n in range(3)
    ]
    store.close()
    status, out, _ = cli(capsys, "fleet", "--json")
    assert status == 0 and [i["id"] for i in json.loads(out)["instances"]] == live_ids
    status, out, _ = cli(capsys, "fleet", "--all", "--json")
    assert [i["id"] for i in json.loads(out)["instances"]] == [ended.id, *live_ids]
    status, out, _ = cli(capsys, "fleet", "--all", "--limit", "2")
    assert status == 0 and ended.id not in out and live_ids[0] not in out
    assert out.rstrip().endswith("(the newest 2 shown; --limit N for more)")
    status, _, err = cli(capsys, "fleet", "--limit", "0")
    assert status == 2 and err.count("\n") == 1 and "--limit must be 1 to 10,000" in err
    status, out, _ = cli(capsys, "events", "--app", "rm2-kairos")
    assert status == 0 and "plan_applied" in out

    status, _, err = cli(capsys, "events", "--app", "ghost")
    assert status == 2 and "no app 'ghost'" in err and "404" in err
    status, _, err = cli(capsys, "app", "delete", "rm2-kairos")  # an operator may not
    assert status == 2 and "403" in err
    status, _, err = cli(capsys, "fleet", "--token", "hp_wrong")
    assert status == 2 and "401" in err

    dead = f"http://127.0.0.1:{free_port()}"
    status, _, err = cli(capsys, "fleet", "--url", dead)
    assert status == 2
    assert err.strip() == (
        f"heteroplane fleet: cannot reach the heteroplane API at {dead}"
        " (is `heteroplane serve` running?)"
    )
    monkeypatch.delenv("HETEROPLANE_TOKEN")
    status, _, err = cli(capsys, "fleet")
    assert status == 2 and "no API token" in err

    # --wait: no worker ever serves rm2 here (the fake provisioner), so it gives up in one line;
    # its readiness route needs an infer-scoped token, which the operator's is not.
    monkeypatch.setenv("HETEROPLANE_TOKEN", token)
    admin = create_token(data_dir, "admin", "root")
    wait = ["--wait", "--timeout-s", "0.2", "--poll-s", "0.05"]
    again = json.loads(cli(capsys, *preview_rm2, "--json")[1])
    status, _, err = cli(
        capsys, "plans", "apply", "--app", "rm2-kairos", "--id", str(again["id"]), *wait
    )
    assert status == 2 and err.count("\n") == 2  # the progress line, then the reason
    assert "has scope operator; this needs infer" in err
    again = json.loads(cli(capsys, *preview_rm2, "--json")[1])
    apply_again = ["plans", "apply", "--app", "rm2-kairos", "--id", str(again["id"])]
    status, _, err = cli(capsys, *apply_again, *wait, "--token", admin)
    assert status == 2
    assert err.splitlines()[-1].startswith(
        "heteroplane plans: rm2-kairos is not served after 0.2 s (app 'rm2-kairos'"
    )
    assert "503" in err and "heteroplane fleet --app rm2-kairos" in err
    unknown = httpx.get(
        f"{live.url}/v2/models/ghost/ready", headers={"Authorization": f"Bearer {admin}"}
    )
    assert (unknown.status_code, unknown.json()) == (404, {"error": "no model 'ghost'"})


def test_serve_refuses_a_port_in_use(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "controlplane", "serve", "--port", str(port)],
            cwd=REPO,
            env=service_env(data_dir),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("heteroplane serve: cannot listen on")
    assert "Traceback" not in done.stderr
