"""The live service for a benchmark: ``heteroplane serve`` on a temporary data directory.

What the benchmarks that measure the running service (``benchmarks/fidelity/serving.py``,
``benchmarks/live_tuner_step.py``) share: a data directory holding the demo model family and a
profile file for one emulated instance type (the local workers pad every batch to its service
time), an admin token in that directory's store, the service itself as a subprocess with the
local provisioner (the caller's ``HETEROPLANE_*`` environment left out, the benchmark's own
settings put in) stopped with its workers at the end, polling it for a condition with a
deadline; and the small helpers around it (a log line on stderr, a free port, the CPU's name).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from controlplane.db.store import Store
from controlplane.provisioning import (
    LOCAL_MODELS_DIR,
    LOCAL_PROFILE_FILE,
    LOCAL_WORKERS_DIR,
)
from estimator.profiles import LatencyProfile, write_profiles_json

try:  # imported as benchmarks.local_service
    from benchmarks.cascade_family import cpu_model as cpu_model  # re-exported
except ModuleNotFoundError:  # run as a script: the sibling module
    from cascade_family import cpu_model as cpu_model  # re-exported

ROOT = Path(__file__).resolve().parents[1]
# Long enough for a first run that trains the demo family before the service can plan.
START_DEADLINE_S = 300.0


def log(message: str) -> None:
    """A progress line on stderr (stdout is the benchmark's result)."""
    print(message, file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (``/proc/<pid>/stat``)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def prepare_family(data_dir: Path) -> Path:
    """The demo family in ``data_dir/models`` (copied from the default cache when it is there,
    else trained); its folder."""
    from provisioners.worker import family

    default = family.default_cache_dir()
    target = data_dir / LOCAL_MODELS_DIR
    if (default / "manifest.json").is_file():
        shutil.copytree(default, target)
    family.ensure_family(target, progress=log)  # checks the copy; trains what is missing
    return target


def prepare_data_dir(
    data_dir: Path, service_ms: float, *, model: str, instance_type: str, source: str
) -> Path:
    """The family in ``data_dir/models`` and a profile file in which ``model`` serves a batch of
    one in ``service_ms`` on ``instance_type`` (and on ``local.cpu``); the profile's path.
    ``source`` is the profile file's provenance (the benchmark that wrote it)."""
    prepare_family(data_dir)
    # A deterministic service time: every sample the same, as the worker pads every batch to it.
    cell = (np.full(8, service_ms),)
    profiles = [
        LatencyProfile(model, name, np.array([1]), cell) for name in ("local.cpu", instance_type)
    ]
    path = data_dir / LOCAL_PROFILE_FILE
    path.parent.mkdir(parents=True)
    write_profiles_json(profiles, path, source=source)
    return path


def family_onnx(path: Path, doc_string: str = "") -> Path:
    """input FP32 [n, 64] -> logits FP32 [n, 10], a fixed linear map (the family's signature);
    another ``doc_string`` makes other bytes of the same model (a push of the newest version's
    own file makes no new version)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = np.random.default_rng(0).normal(size=(64, 10)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "clf",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    model.doc_string = doc_string
    onnx.save(model, path)
    return path


def issue_token(data_dir: Path, label: str) -> str:
    """An admin token, labelled ``label``, in the store of ``data_dir`` (created if need be)."""
    store = Store.from_url(f"sqlite:///{data_dir / 'heteroplane.db'}", upgrade=True)
    try:
        token, _ = store.issue_token("admin", label)
    finally:
        store.close()
    return token


@contextmanager
def running_service(
    data_dir: Path, port: int, *, model: str, settings: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``heteroplane serve`` on ``data_dir`` with the local provisioner, its output in
    ``data_dir/serve.log``; stopped, with its workers (which serve ``model``), at the end.

    The service gets none of the caller's ``HETEROPLANE_*`` variables, so it runs with the
    default settings but for ``settings`` (more ``HETEROPLANE_*`` variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROPLANE_")}
    env |= {"HETEROPLANE_DATA_DIR": str(data_dir), "HETEROPLANE_PROVISIONER": "local"}
    env |= settings or {}
    log_file = (data_dir / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "controlplane", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()
        stop_workers(data_dir / LOCAL_WORKERS_DIR, model)


@contextmanager
def serving_api(
    data_dir: Path, port: int, token: str, *, model: str, settings: Mapping[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client, Path]]:
    """:func:`running_service`, once it answers ``/healthz``: the process, a client of its API
    with ``token`` and the path of its log."""
    with running_service(data_dir, port, model=model, settings=settings) as process:
        log_path = data_dir / "serve.log"
        headers = {"Authorization": f"Bearer {token}"}
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, headers=headers, timeout=120.0) as api:
            wait_for(
                "the service", lambda: api.get("/healthz").status_code == 200, process, log_path
            )
            yield process, api, log_path


def stop_workers(state_dir: Path, model: str) -> None:
    """Terminate every local worker recorded in ``state_dir`` (those the service left behind)."""
    from provisioners.local import LocalProvisioner

    if not state_dir.is_dir():
        return
    provisioner = LocalProvisioner(state_dir, {}, [model], None)
    try:
        provisioner.terminate([r.provider_id for r in provisioner.records()])
    finally:
        provisioner.close()


def wait_for(
    what: str,
    check: Any,
    process: subprocess.Popen[bytes],
    log_path: Path,
    *,
    deadline_s: float = START_DEADLINE_S,
) -> Any:
    """Poll ``check()`` every 0.5 s until it returns something true (returned); an HTTP error
    counts as not yet. Exits (SystemExit, with the end of ``log_path``) when the service exits
    or ``deadline_s`` passes first."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the service exited: {log_path.read_text()[-2000:]}")
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        time.sleep(0.5)
    raise SystemExit(f"{what}: not within {deadline_s:g} s; {log_path.read_text()[-2000:]}")


def clean_env(**values: str) -> dict[str, str]:
    """This environment without heteroplane's settings, XDG folders or home, plus ``values``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETEROPLANE_", "XDG_")) and k != "HOME"
    }
    return env | values


def wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, deadline_s: float = START_DEADLINE_S
) -> None:
    """Until ``/healthz`` answers (a demo listens only once its app is planned), else exit
    with the process's log."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"exited with {process.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    raise SystemExit(f"not ready in {deadline_s:g} s:\n{log.read_text()}")


def stop(process: subprocess.Popen[Any], deadline_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL past ``deadline_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
