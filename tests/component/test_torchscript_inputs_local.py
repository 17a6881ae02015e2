"""The commands that run an app's registered models here, in process (``cascade evaluate --app``
and ``rollout start --validation-data``), on TorchScript modules pushed with ``--inputs``: the
documented route for a scripted module whose archive names no input shapes (docs/models.md).

A worker loads such a version with the inputs the registry stored for it (the artifact reference
carries them); these commands loaded the bare file, and ``_embedded_inputs``' ModelLoadError
ended them in a traceback. Here they take the same inputs from the version document, and a model
that still cannot load (a blob damaged in the store) is the CLI's one line and exit status 2.

The real service app (FastAPI's TestClient) over a SQLite store migrated through the real
migrations and the registry with its real inspector (a subprocess with torch); the CLI in
process, its API client sent over the TestClient. A rollout's start is kept, not sent: what is
tested is the validation records the command makes (the rollout itself:
test_rollout_cascade.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from controlplane.cli import cascade_registered, main, model, rollout
from controlplane.cli.client import ApiClient
from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.service.app import create_app
from controlplane.settings import Settings

torch = pytest.importorskip("torch")

APP = "app-lin"
INPUTS = "input:FP32:-1x13"
FEATURES = 13
CLASSES = 3
SAMPLES = 40


class InProcessClient(ApiClient):
    """The CLI's API client over the service app in this process. The TestClient outlives
    each command, so a command's ``with`` block does not close it; a rollout's start is kept
    in ``started`` and answered with a stand-in."""

    def __init__(self, http: TestClient, token: str, started: list[dict[str, Any]]) -> None:
        super().__init__("http://testserver", token)
        self._http = http
        self.started = started

    def close(self) -> None:
        pass

    def post(self, path: str, body: Any = None) -> Any:
        if path == f"/v1/apps/{APP}/rollouts":
            self.started.append(body)
            return {"id": len(self.started), "app": APP, "state": "pending"}
        return super().post(path, body)


@dataclass
class Service:
    http: TestClient
    token: str
    data_dir: Path
    started: list[dict[str, Any]]


def linear_module(weights: np.ndarray) -> Any:
    """A scripted ``nn.Linear`` (its ``forward`` takes ``input``) with these weights and no
    bias: the archive holds no signature file, only ``--inputs`` gives its inputs' shapes."""
    layer = torch.nn.Linear(FEATURES, CLASSES, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weights.astype(np.float32)))
    return torch.jit.script(layer.eval())


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three archives and the data: ``lin-v1`` answers the class of the largest of features 0
    to 2 (always right on the data), ``lin-v2`` the class before it (never right), ``big`` as
    ``lin-v1`` but surer. Made once: the same bytes are inspected once (the registry keeps an
    inspection by the file's SHA-256)."""
    folder = tmp_path_factory.mktemp("torchscript-inputs")
    right = np.hstack([np.eye(CLASSES), np.zeros((CLASSES, FEATURES - CLASSES))])
    before = right[[1, 2, 0]]  # output j reads feature (j + 1) % 3
    found = {}
    for name, weights in (("lin-v1", right), ("lin-v2", before), ("big", 5 * right)):
        found[name] = folder / f"{name}.pt"
        torch.jit.save(linear_module(weights), str(found[name]))
    rng = np.random.default_rng(0)
    inputs = rng.random((SAMPLES, FEATURES)).astype(np.float32)
    found["data"] = folder / "val13.npz"
    np.savez(found["data"], inputs=inputs, labels=inputs[:, :CLASSES].argmax(axis=1))
    return found


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    settings = Settings(data_dir=tmp_path / "data", provisioner="fake")
    settings.ensure_data_dir()
    store = Store.from_url(settings.database_url, FakeClock(), upgrade=True)
    token = store.create_token("operator", name="operator")
    started: list[dict[str, Any]] = []
    with TestClient(
        create_app(settings, store, FakeClock()), raise_server_exceptions=False
    ) as http:
        for module in (model, cascade_registered, rollout):
            monkeypatch.setattr(
                module, "client_from", lambda _args: InProcessClient(http, token, started)
            )
        yield Service(http, token, settings.data_dir, started)
    store.close()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """Run the CLI with ``--json``; its JSON answer (the exit status must be 0)."""
    capsys.readouterr()
    status = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads(captured.out)


def push_and_register(
    service: Service, capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    """``lin`` (versions 1 and 2) and ``big`` pushed with ``--inputs``; the app a cascade of
    ``lin`` then ``big``, ``lin`` at version 1."""
    for name, file in (("lin", "lin-v1"), ("lin", "lin-v2"), ("big", "big")):
        pushed = cli(capsys, "model", "push", name, str(files[file]), "--inputs", INPUTS)
        assert pushed["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}]
    spec = {
        "name": APP,
        "models": [
            {"name": "lin", "artifact": "lin@1"},
            {"name": "big", "artifact": "big@1"},
        ],
        "cascade": ["lin", "big"],
        "thresholds": [0.5],
        "slo": {"latency_ms": 5000},
        "budget_usd_per_hr": 5,
        "instance_types": ["emu.cpu.small"],
    }
    answer = service.http.post(
        "/v1/apps", json=spec, headers={"Authorization": f"Bearer {service.token}"}
    )
    assert answer.status_code == 201, answer.text


def test_cascade_evaluate_runs_torchscript_models_pushed_with_inputs(
    service: Service, capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    push_and_register(service, capsys, files)
    out = tmp_path / "v.json"
    summary = cli(
        capsys, "cascade", "evaluate", "--app", APP, "--data", str(files["data"]), "--out", str(out)
    )
    assert [(m["name"], m["artifact"]) for m in summary["models"]] == [
        ("lin", "lin@1"),
        ("big", "big@1"),
    ]
    records = json.loads(out.read_text())
    assert [(m["name"], m["accuracy"]) for m in records["models"]] == [("lin", 1.0), ("big", 1.0)]


def test_rollout_start_runs_the_new_version_pushed_with_inputs(
    service: Service, capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    push_and_register(service, capsys, files)
    argv = ["rollout", "start", "--app", APP, "--model", "lin@2"]
    cli(capsys, *argv, "--validation-data", str(files["data"]))
    (body,) = service.started
    assert body["model"] == "lin@2"
    # lin@2 answers the class before the right one: its records, not lin@1's, are sent.
    by_name = {m["name"]: m for m in body["validation"]["models"]}
    assert by_name["lin"]["accuracy"] == 0.0 and by_name["big"]["accuracy"] == 1.0


@pytest.mark.parametrize(
    ("command", "damaged"),
    [
        (["cascade", "evaluate", "--app", APP, "--out", "{out}", "--data", "{data}"], "lin@1"),
        (
            ["rollout", "start", "--app", APP, "--model", "lin@2", "--validation-data", "{data}"],
            "lin@2",
        ),
    ],
)
def test_a_model_that_cannot_load_here_is_one_line(
    service: Service,
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    command: list[str],
    damaged: str,
) -> None:
    """The blob of the first model the command loads damaged in the store (its size kept):
    torch cannot load what the service sends, whatever inputs it is given, and the command says
    so in one line with exit status 2, not a traceback."""
    push_and_register(service, capsys, files)
    name, version = damaged.split("@")
    (blob,) = (service.data_dir / "registry").rglob(f"{name}/{version}/*.pt")
    blob.write_bytes(b"PK\x03\x04" + bytes(blob.stat().st_size - 4))
    out = tmp_path / "v.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main([word.format(out=out, data=files["data"]) for word in command])
    errors = [line for line in capsys.readouterr().err.splitlines() if "fetching" not in line]
    assert stop.value.code == 2 and len(errors) == 1, errors
    assert f"model lin ({damaged})" in errors[0] and "not a TorchScript archive" in errors[0]
    assert service.started == [] and not out.exists()
