"""The local provisioner with real worker processes on 127.0.0.1.

Three workers of two emulated types serve real inferences that match the family's own
``predict``; a worker killed with SIGKILL is reported failed (once); a second provisioner on the
same state directory adopts the live workers and launches nothing twice for a request id
already seen; terminated workers exit and are forgotten. A launch cut short between a worker's
record and its start, or between its start and its pid, leaves a record the next provisioner
resolves: the worker found and adopted, or reported failed if it never started. Stand-in
interpreters (shell scripts) cover what a real worker does not do on demand: ignore SIGTERM,
never become healthy.

Waits poll with a deadline; nothing is timed. Every worker is stopped by the fixtures.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from provisioners.base import APP_TAG, MANAGED_TAG, REQUEST_TAG, LaunchRequest
from provisioners.errors import InvalidConfigurationError, QuotaExceededError
from provisioners.local import LocalProvisioner, WorkerRecord

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
SPEEDS = {SMALL: 0.5, LARGE: 1.0, "local.cpu": 1.0}
MODELS = ("tiny", "large")
# Workers import torch and load the models: seconds each, more on a busy shared machine.
START_DEADLINE_S = 240.0
STOP_DEADLINE_S = 60.0
POLL_S = 0.1


def wait_for(condition: Callable[[], bool], deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {deadline_s:g} s")
        time.sleep(POLL_S)


def wait_for_exec(pid: int, worker_id: str) -> None:
    """Until ``pid``'s command line, once its exec has set it up, names ``worker_id`` (for a
    moment after Popen returns it reads empty: the kernel wakes the parent before the new
    program's arguments are mapped, and a provisioner scanning /proc then finds no worker)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    wait_for(lambda: worker_id.encode() in cmdline.read_bytes(), 10.0, "the exec")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, not yet reaped by this process, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self").exists()
    return text.rsplit(")", 1)[-1].split()[0] != "Z"


class Provisioners:
    """Makes LocalProvisioners and, at the end, stops every worker any of them knows of."""

    def __init__(self) -> None:
        self.made: list[LocalProvisioner] = []
        self.pids: set[int] = set()

    def make(self, state_dir: Path, **options: Any) -> LocalProvisioner:
        options.setdefault("grace_s", 2.0)
        options.setdefault("catalog_speed", SPEEDS)
        options.setdefault("models", MODELS)
        options.setdefault("cache_dir", None)
        provisioner = LocalProvisioner(state_dir, **options)
        self.made.append(provisioner)
        return provisioner

    def note(self, provisioner: LocalProvisioner) -> None:
        self.pids.update(r.pid for r in provisioner.records() if r.pid is not None)

    def stop_all(self) -> None:
        for provisioner in self.made:
            self.note(provisioner)
            provisioner.terminate([r.provider_id for r in provisioner.records()])
        deadline = time.monotonic() + STOP_DEADLINE_S
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.pids):
            time.sleep(POLL_S)
        for pid in self.pids:
            if pid_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        for provisioner in self.made:
            provisioner.close(timeout_s=STOP_DEADLINE_S)
        assert not [p for p in self.pids if pid_alive(p)], "workers outlived the test"


@pytest.fixture
def provisioners() -> Iterator[Provisioners]:
    made = Provisioners()
    try:
        yield made
    finally:
        made.stop_all()


def post_infer(address: str, model: str, inputs: np.ndarray) -> dict[str, Any]:
    """One Open Inference Protocol request of ``inputs`` (one tensor ``input``) to a worker."""
    tensor = {
        "name": "input",
        "shape": list(inputs.shape),
        "datatype": "FP32",
        "data": inputs.ravel().tolist(),
    }
    request = urllib.request.Request(
        f"http://{address}/v2/models/{model}/infer",
        data=json.dumps({"inputs": [tensor]}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        assert response.status == 200
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def first_output(answer: dict[str, Any]) -> np.ndarray:
    output = answer["outputs"][0]
    return np.reshape(np.asarray(output["data"], dtype=np.float32), output["shape"])


def states(provisioner: LocalProvisioner) -> dict[str, str]:
    return {i.provider_id: i.state for i in provisioner.list({})}


def test_local_workers_serve_fail_are_adopted_and_stop(
    tmp_path: Path, trained_family: Path, provisioners: Provisioners
) -> None:
    from provisioners.worker.family import load_model, load_split, predict

    state_dir = tmp_path / "state"
    first = provisioners.make(state_dir, cache_dir=trained_family)
    smalls = first.launch(LaunchRequest("req-small", SMALL, 2, {APP_TAG: "digits"}))
    larges = first.launch(LaunchRequest("req-large", LARGE, 1, {APP_TAG: "digits"}))
    provisioners.note(first)
    launched = smalls + larges
    assert [i.state for i in launched] == ["pending"] * 3
    assert len({i.address for i in launched}) == 3
    for instance in launched:
        assert instance.tags[MANAGED_TAG] == "true"
        assert instance.tags[APP_TAG] == "digits"
        assert instance.address is not None and instance.address.startswith("127.0.0.1:")
    assert {i.tags[REQUEST_TAG] for i in smalls} == {"req-small"}

    wait_for(
        lambda: set(states(first).values()) == {"running"}, START_DEADLINE_S, "3 running workers"
    )

    # Real inferences, one batch each, against the family's own predict on the same inputs.
    inputs = load_split().validation_inputs[:16]
    for model in MODELS:
        expected, certainty = predict(load_model(model, trained_family), inputs)
        for instance in first.list({APP_TAG: "digits"}):
            assert instance.address is not None
            answer = post_infer(instance.address, model, inputs)
            assert answer["model_name"] == model
            parameters = answer["parameters"]
            assert parameters["instance_type"] == instance.instance_type
            logits = first_output(answer)
            assert logits.shape == (16, 10)
            assert np.argmax(logits, axis=1).tolist() == expected.tolist()
            top = np.sort(np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True), axis=1)
            np.testing.assert_allclose(top[:, -1] - top[:, -2], certainty, atol=1e-5)
            assert parameters["emulated"] is True
            if instance.instance_type == SMALL:
                # Half as fast as this machine: every batch is padded.
                assert parameters["padded_ms"] > 0
                assert parameters["emulation_source"] == "measured"
            else:
                assert parameters["padded_ms"] == 0

    # A worker killed behind the provisioner's back is reported failed, and its death once.
    victim = next(r for r in first.records() if r.instance_type == SMALL)
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: states(first)[victim.provider_id] == "failed", 30.0, "failed state")
    deaths = [e for e in first.poll_events() if e.kind == "failed"]
    assert [e.provider_id for e in deaths] == [victim.provider_id]
    assert first.poll_events() == []

    # A restarted control plane: a new provisioner on the same directory adopts the workers.
    second = provisioners.make(state_dir, cache_dir=trained_family)
    adopted = states(second)
    assert adopted == states(first)
    assert adopted[victim.provider_id] == "failed"
    assert sorted(adopted.values()) == ["failed", "running", "running"]
    events = second.poll_events()
    assert [e.kind for e in events] == ["info"]  # the adoption; the death was reported already
    again = second.launch(LaunchRequest("req-small", SMALL, 2, {APP_TAG: "digits"}))
    assert [i.provider_id for i in again] == [i.provider_id for i in smalls]
    assert len(second.records()) == 3
    with pytest.raises(InvalidConfigurationError):
        second.launch(LaunchRequest("req-small", LARGE, 2, {}))
    with pytest.raises(InvalidConfigurationError):
        second.launch(LaunchRequest("req-small", SMALL, 3, {}))

    # Terminate: the failed one is forgotten at once, the live ones exit on SIGTERM.
    live = [r for r in second.records() if r.provider_id != victim.provider_id]
    second.terminate([victim.provider_id, live[0].provider_id])
    first.terminate([live[1].provider_id, "local-unknown"])
    assert states(second).get(live[0].provider_id) in ("stopping", None)
    wait_for(lambda: not second.list({}), STOP_DEADLINE_S, "terminated workers gone")
    assert not first.list({})
    assert not [r for r in live if pid_alive(r.pid)]
    assert not list((state_dir / "instances").glob("*.json"))
    # The request id is remembered: launching it again starts nothing.
    gone = first.launch(LaunchRequest("req-small", SMALL, 2, {}))
    assert [i.state for i in gone] == ["terminated", "terminated"]
    assert first.records() == []


class CrashError(Exception):
    """Stands in for the SIGKILL of a control plane at one point of a launch."""


def test_a_launch_cut_short_is_resolved_by_the_next_provisioner(
    tmp_path: Path,
    trained_family: Path,
    provisioners: Provisioners,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A control plane killed between a worker's start and the write of its pid leaves a record
    with the port and no pid: the next provisioner on the directory finds the worker by its
    ``--worker-id``, adopts it (it answers /health on the recorded port) and terminate ends it.
    One killed before the start leaves such a record and no process: the next reports it failed
    (a death event, once) and terminate clears it. One killed before the first record leaves the
    id in the request ledger only: launching the request again starts nothing. (Each crash is
    the launch raising at that point; the crashed provisioner is not used again.)"""
    crashed: dict[str, WorkerRecord] = {}

    def crash_at(where: str, write: Callable[[WorkerRecord], None]) -> Any:
        def write_or_crash(record: WorkerRecord) -> None:
            if record.pid is not None:  # started: the fixture ends it, whatever the test finds
                provisioners.pids.add(record.pid)
            if where == "after_start" and record.pid is None:
                write(record)
                return
            crashed[where] = record
            raise CrashError

        return write_or_crash

    def crash_popen(*args: Any, **kwargs: Any) -> None:
        raise CrashError

    # Killed between the start and the record of the pid (a real worker).
    started_dir = tmp_path / "started"
    crashing = provisioners.make(started_dir, models=("tiny",), cache_dir=trained_family)
    with monkeypatch.context() as patch, pytest.raises(CrashError):
        patch.setattr(crashing, "_write_record", crash_at("after_start", crashing._write_record))
        crashing.launch(LaunchRequest("req-started", SMALL, 1, {APP_TAG: "digits"}))
    (orphan_pid,) = provisioners.pids
    assert pid_alive(orphan_pid)
    (path,) = (started_dir / "instances").glob("*.json")
    left = json.loads(path.read_text())
    assert left["pid"] is None
    assert left["provider_id"] == crashed["after_start"].provider_id
    # A control plane started again after a crash comes seconds later; this test at once.
    wait_for_exec(orphan_pid, left["provider_id"])

    after = provisioners.make(started_dir, models=("tiny",), cache_dir=trained_family)
    events = [(e.kind, e.message) for e in after.poll_events()]
    assert events == [("info", f"adopted 1 local worker(s) from {started_dir}")]
    (adopted,) = after.records()
    assert (adopted.provider_id, adopted.pid) == (left["provider_id"], orphan_pid)
    assert adopted.port == left["port"] and adopted.start_ticks is not None
    wait_for(
        lambda: states(after) == {adopted.provider_id: "running"},  # /health on the port
        START_DEADLINE_S,
        "the adopted worker running",
    )
    (again,) = after.launch(LaunchRequest("req-started", SMALL, 1, {APP_TAG: "digits"}))
    assert (again.provider_id, again.state) == (adopted.provider_id, "running")
    after.terminate([adopted.provider_id])
    wait_for(lambda: not after.list({}), STOP_DEADLINE_S, "the adopted worker gone")
    assert not pid_alive(orphan_pid)
    assert not list((started_dir / "instances").glob("*.json"))

    # Killed before a first record, and before a start: no process runs (should one start all
    # the same, a stand-in interpreter that exits at once: nothing is left behind).
    unstarted_dir = tmp_path / "unstarted"
    idle = stand_in_python(tmp_path, "exit 3")
    crashing = provisioners.make(unstarted_dir, python=idle)
    with monkeypatch.context() as patch, pytest.raises(CrashError):
        patch.setattr(crashing, "_write_record", crash_at("before_record", crashing._write_record))
        crashing.launch(LaunchRequest("req-unrecorded", SMALL, 1, {}))
    with monkeypatch.context() as patch, pytest.raises(CrashError):
        patch.setattr(subprocess, "Popen", crash_popen)
        crashing.launch(LaunchRequest("req-unstarted", SMALL, 1, {}))
    assert not provisioners.pids - {orphan_pid}
    (path,) = (unstarted_dir / "instances").glob("*.json")
    left = json.loads(path.read_text())
    assert left["pid"] is None and left["request_id"] == "req-unstarted"

    after = provisioners.make(unstarted_dir, python=idle)
    (death,) = after.poll_events()
    assert (death.kind, death.provider_id) == ("failed", left["provider_id"])
    assert states(after) == {death.provider_id: "failed"}
    assert after.poll_events() == []  # said once
    for request_id, expected in [
        ("req-unstarted", (death.provider_id, "failed")),
        ("req-unrecorded", (crashed["before_record"].provider_id, "terminated")),
    ]:
        instances = after.launch(LaunchRequest(request_id, SMALL, 1, {}))
        assert [(i.provider_id, i.state) for i in instances] == [expected]
    assert [r.provider_id for r in after.records()] == [death.provider_id]
    after.terminate([death.provider_id])
    assert after.records() == []
    assert not provisioners.pids - {orphan_pid}


def test_terminate_looks_again_for_a_worker_resolved_as_never_started(
    tmp_path: Path, provisioners: Provisioners, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch killed between its fork and its exec leaves, for a moment, a child that holds
    no lock and shows the parent's command line: a provisioner reading then resolves the record
    as never started, and the worker then runs. The reconciler terminates a failed worker; the
    terminate looks for it once more, by its ``--worker-id``, and ends it."""
    idle = stand_in_python(tmp_path, "exit 3")
    crashing = provisioners.make(tmp_path / "state", python=idle)

    def crash_popen(*args: Any, **kwargs: Any) -> None:
        raise CrashError

    with monkeypatch.context() as patch, pytest.raises(CrashError):
        patch.setattr(subprocess, "Popen", crash_popen)
        crashing.launch(LaunchRequest("req-late", SMALL, 1, {}))
    after = provisioners.make(tmp_path / "state", python=idle)
    (record,) = after.records()
    assert record.pid is None and record.exited_at is not None  # resolved: never started
    # The worker execs now: a process of its own session with the worker id.
    late = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "--worker-id", record.provider_id],
        start_new_session=True,
    )
    provisioners.pids.add(late.pid)
    wait_for_exec(late.pid, record.provider_id)
    after.terminate([record.provider_id])
    wait_for(lambda: late.poll() is not None, STOP_DEADLINE_S, "the late worker ended")
    wait_for(lambda: not after.list({}), STOP_DEADLINE_S, "its record forgotten")


def test_a_worker_that_cannot_load_its_models_is_reported_failed(
    tmp_path: Path, trained_family: Path, provisioners: Provisioners
) -> None:
    provisioner = provisioners.make(tmp_path, models=("nonesuch",), cache_dir=trained_family)
    (instance,) = provisioner.launch(LaunchRequest("req-bad", LARGE, 1, {}))
    provisioners.note(provisioner)
    wait_for(lambda: states(provisioner)[instance.provider_id] == "failed", 120.0, "failure")
    (event,) = provisioner.poll_events()
    assert event.kind == "failed" and event.provider_id == instance.provider_id
    assert "nonesuch" in event.message  # the worker's last log line says why


def test_a_worker_serves_the_artifacts_of_its_launch_request(
    tmp_path: Path, provisioners: Provisioners
) -> None:
    """A launch that names an ONNX artifact: the worker fetches and verifies it, serves it under
    its name, and no family model; an artifact whose sha256 is wrong fails the worker."""
    pytest.importorskip("onnxruntime")
    from provisioners.artifacts import ArtifactRef, file_sha256
    from tests.unit.worker_models import export_onnx, sample_inputs, tabular_model, torch_outputs

    model = tabular_model()
    path = export_onnx(model, tmp_path / "tabular.onnx")
    ref = ArtifactRef("fraud", "tabular", 2, "onnx", file_sha256(path), path.as_uri())
    provisioner = provisioners.make(tmp_path / "state", cache_dir=tmp_path / "cache")
    (instance,) = provisioner.launch(LaunchRequest("req-art", LARGE, 1, {}, artifacts=(ref,)))
    provisioners.note(provisioner)
    wait_for(
        lambda: states(provisioner)[instance.provider_id] == "running",
        START_DEADLINE_S,
        "a running artifact worker",
    )
    (listed,) = provisioner.list({})
    assert listed.address is not None
    inputs = sample_inputs(3)
    answer = post_infer(listed.address, "fraud", inputs)
    assert answer["outputs"][0]["name"] == "logits"
    np.testing.assert_allclose(first_output(answer), torch_outputs(model, inputs), atol=1e-5)
    with pytest.raises(urllib.error.HTTPError) as unknown:
        post_infer(listed.address, "tiny", np.zeros((1, 64), dtype=np.float32))
    assert unknown.value.code == 404

    tampered = ArtifactRef("fraud", "tabular", 2, "onnx", "0" * 64, path.as_uri())
    (bad,) = provisioner.launch(LaunchRequest("req-bad", LARGE, 1, {}, artifacts=(tampered,)))
    provisioners.note(provisioner)
    wait_for(lambda: states(provisioner)[bad.provider_id] == "failed", 120.0, "failure")
    (event,) = [e for e in provisioner.poll_events() if e.provider_id == bad.provider_id]
    assert "sha256" in event.message


def stand_in_python(tmp_path: Path, script: str) -> str:
    """An executable that takes the worker's command line and runs ``script`` instead."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path, provisioners: Provisioners
) -> None:
    stubborn = stand_in_python(tmp_path, "trap '' TERM\nexec sleep 300")
    provisioner = provisioners.make(tmp_path / "state", python=stubborn, grace_s=0.5)
    (instance,) = provisioner.launch(LaunchRequest("req-stubborn", SMALL, 1, {}))
    provisioners.note(provisioner)
    (record,) = provisioner.records()
    assert states(provisioner) == {instance.provider_id: "pending"}
    provisioner.terminate([instance.provider_id])
    wait_for(lambda: not pid_alive(record.pid), STOP_DEADLINE_S, "SIGKILL after the grace")
    wait_for(lambda: not provisioner.list({}), STOP_DEADLINE_S, "the record forgotten")


def test_a_worker_that_never_answers_health_fails_after_the_start_timeout(
    tmp_path: Path, provisioners: Provisioners
) -> None:
    silent = stand_in_python(tmp_path, "exec sleep 300")
    provisioner = provisioners.make(tmp_path / "state", python=silent, start_timeout_s=0.5)
    (instance,) = provisioner.launch(LaunchRequest("req-silent", SMALL, 1, {}))
    provisioners.note(provisioner)
    wait_for(lambda: states(provisioner)[instance.provider_id] == "failed", 30.0, "timeout")
    (event,) = provisioner.poll_events()
    assert "did not answer /health" in event.message


def test_a_worker_adopted_past_its_start_timeout_is_asked_before_it_is_failed(
    tmp_path: Path, trained_family: Path, provisioners: Provisioners
) -> None:
    first = provisioners.make(tmp_path / "state", cache_dir=trained_family)
    (instance,) = first.launch(LaunchRequest("req-late", SMALL, 1, {}))
    provisioners.note(first)
    (record,) = first.records()
    # Ready, and never seen ready by a provisioner (as after a control plane's restart).
    wait_for(lambda: first._health_ok(record), START_DEADLINE_S, "the worker's /health")
    assert first.records()[0].ready_at is None
    later = provisioners.make(tmp_path / "state", cache_dir=trained_family, start_timeout_s=0.001)
    assert states(later) == {instance.provider_id: "running"}
    assert [e for e in later.poll_events() if e.kind == "failed"] == []


@pytest.mark.parametrize("other_sees", ["running", "failed"])
def test_what_another_provisioner_decides_during_the_health_checks_stands(
    tmp_path: Path, provisioners: Provisioners, monkeypatch: pytest.MonkeyPatch, other_sees: str
) -> None:
    silent = stand_in_python(tmp_path, "exec sleep 300")
    first = provisioners.make(tmp_path / "state", python=silent, start_timeout_s=0.001)
    (instance,) = first.launch(LaunchRequest("req-both", SMALL, 1, {}))
    provisioners.note(first)
    other = provisioners.make(tmp_path / "state", python=silent, start_timeout_s=0.001)
    monkeypatch.setattr(other, "_health_ok", lambda record: other_sees == "running")

    def meanwhile(record: WorkerRecord) -> bool:
        # While the first one's /health check is on the wire, the other one lists: it finds
        # the worker ready, or fails it past its start timeout.
        assert states(other) == {instance.provider_id: other_sees}
        return False

    monkeypatch.setattr(first, "_health_ok", meanwhile)
    assert states(first) == {instance.provider_id: other_sees}
    said = [e for p in (first, other) for e in p.poll_events() if e.kind == "failed"]
    assert len(said) == (other_sees == "failed")


def test_launch_refuses_unknown_types_and_past_the_cap_without_starting_anything(
    tmp_path: Path, provisioners: Provisioners
) -> None:
    provisioner = provisioners.make(tmp_path, max_workers=2)
    with pytest.raises(InvalidConfigurationError) as unknown:
        provisioner.launch(LaunchRequest("req-1", "g4dn.xlarge", 1, {}))
    assert unknown.value.field == "instance_type"
    with pytest.raises(QuotaExceededError) as quota:
        provisioner.launch(LaunchRequest("req-2", SMALL, 3, {}))
    assert quota.value.instance_type == SMALL
    assert provisioner.records() == []
    # An interpreter that cannot start leaves no record (the one written before the start goes).
    unstartable = provisioners.make(tmp_path / "unstartable", python=str(tmp_path / "nonesuch"))
    with pytest.raises(InvalidConfigurationError) as no_python:
        unstartable.launch(LaunchRequest("req-3", SMALL, 1, {}))
    assert no_python.value.field == "python"
    assert unstartable.records() == []
    with pytest.raises(InvalidConfigurationError):
        provisioners.make(tmp_path, catalog_speed={SMALL: 0.0})
