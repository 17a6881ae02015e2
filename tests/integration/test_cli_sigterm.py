"""SIGTERM (what ``timeout``, systemd and docker send) stops a command as Ctrl-C does: the
workers it started are stopped and its scratch folder removed before it exits, with status 143
and one line. Until 2026-12-01 ``profile measure`` (and the demo while it measured) died outright
and left its workers running, re-parented to init, in a temporary folder no service looks in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import process_alive
from tests.integration.test_replicas import wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three workers start (torch each)
def test_sigterm_during_profile_measure_stops_its_workers(
    tmp_path: Path, trained_family: Path
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    command = [
        sys.executable, "-m", "controlplane", "profile", "measure", "--models", "tiny",
        "--batch-sizes", "1,2,4,8", "--samples", "100000", "--instance-types",
        "emu.cpu.small,emu.cpu.large", "--cache-dir", str(trained_family),
        "--out", str(tmp_path / "never.json"),
    ]  # fmt: skip
    log = tmp_path / "measure.log"
    with log.open("wb") as out:
        measuring = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out)
    try:

        def workers_ready() -> list[int] | None:
            records = [
                json.loads(path.read_text())
                for path in scratch.glob("heteroplane-profiler-*/workers/instances/*.json")
            ]
            ready = [r["pid"] for r in records if r.get("ready_at")]
            # The two types asked for, and local.cpu (this machine's own, measured too).
            return ready if len(ready) == 3 and "timing" in log.read_text() else None

        pids = wait_for("three ready workers and the timing", workers_ready, log.read_text)
        measuring.send_signal(signal.SIGTERM)
        status = measuring.wait(timeout=120)
    finally:
        if measuring.poll() is None:
            measuring.kill()
            measuring.wait()
    said = log.read_text()
    assert status == 143, said
    assert said.splitlines()[-1] == "terminated"
    assert "Traceback" not in said
    assert not any(process_alive(pid) for pid in pids)
    assert not list(scratch.glob("heteroplane-profiler-*"))
