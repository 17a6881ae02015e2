"""Bring your own model, end to end (issue 18's acceptance test): a model that is not the demo
family, pushed, profiled, planned, applied and queried over the Open Inference Protocol by a
client nobody here wrote.

The model is a 13-feature, 3-class classifier of sklearn's wine data (a small torch MLP with the
features' standardisation inside it, trained for a few hundred full-batch steps), exported twice:
to ONNX (``torch.onnx.export``, a dynamic batch axis) and to TorchScript (``torch.jit.script``
with the input signature in the archive's extra file). Both are pushed with ``heteroplane model
push``; the app ``wine`` is a cascade of the two (the ONNX model first, forwarding what it is
less than :data:`THRESHOLD` sure of to the TorchScript one) on the two emulated local types.

Through the real service behind a real uvicorn server, with its CLI: ``profile run`` measures
both models on both types through real worker processes that load the artifacts from the
registry; ``plans preview`` and ``plans apply``; the reconciler launches the plan's workers.
Then ``tritonclient.http.InferenceServerClient`` (with the ``Authorization`` header) sends the
wine data: every output row equals the output of the model that answered it (``parameters``
name it) run in-process by its own runtime (onnxruntime, torch.jit) within 1e-5; a wrong shape
and a wrong datatype are refused with a 400. ``cascade evaluate --app wine --data`` writes the
validation records of both models on the same data.

Everything is polled against deadlines; nothing is timed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.service.build import Service
from tests.integration.conftest import ApiServer, launch_fleet, running_local_service

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

APP = "wine"
ONNX_MODEL = "wine-onnx"
TS_MODEL = "wine-ts"
THRESHOLD = 0.9
TYPES = "emu.cpu.small,emu.cpu.large"
DEADLINE_S = 240.0
POLL_S = 0.25


def _wine_model() -> tuple[Any, np.ndarray, np.ndarray]:
    """A trained 13 -> 16 -> 3 MLP of the wine data (raw features in, logits out), the data
    (float32) and the labels."""
    from sklearn.datasets import load_wine

    data = load_wine()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    mean = torch.from_numpy(x.mean(axis=0))
    std = torch.from_numpy(x.std(axis=0) + 1e-6)

    class Wine(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", mean)
            self.register_buffer("std", std)
            self.hidden = torch.nn.Linear(13, 16)
            self.out = torch.nn.Linear(16, 3)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.hidden((input - self.mean) / self.std)))

    torch.manual_seed(0)
    model = Wine()
    optimiser = torch.optim.Adam(model.parameters(), lr=0.05)
    inputs, labels = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(200):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimiser.step()
    model.eval()
    return model, x, y


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The wine model exported to ONNX and to TorchScript, and the data as an .npz file."""
    model, x, y = _wine_model()
    folder = tmp_path_factory.mktemp("wine")
    onnx_path = folder / "wine.onnx"
    torch.onnx.export(
        model,
        (torch.zeros((2, 13)),),
        str(onnx_path),
        dynamo=False,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )
    ts_path = folder / "wine.pt"
    signature = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}],
        "outputs": [{"name": "logits"}],  # the ONNX model's name: the cascade stacks both
    }
    torch.jit.save(
        torch.jit.script(model),
        str(ts_path),
        _extra_files={"heteroplane/signature.json": json.dumps(signature)},
    )
    data = folder / "wine.npz"
    np.savez(data, inputs=x, labels=y)
    return {"onnx": onnx_path, "torchscript": ts_path, "data": data, "x": x, "y": y}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with running_local_service(data_dir, reconcile_s=0.5) as built:
        yield built


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """Run the CLI with ``--json``; its JSON answer (the exit status must be 0)."""
    capsys.readouterr()
    status = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads(captured.out)


def _in_process(artifacts: dict[str, Any], x: np.ndarray) -> dict[str, np.ndarray]:
    """Each artifact's own output on ``x``, run by its own runtime in this process."""
    import onnxruntime

    session = onnxruntime.InferenceSession(
        str(artifacts["onnx"]), providers=["CPUExecutionProvider"]
    )
    (onnx_out,) = session.run(None, {"input": x})
    scripted = torch.jit.load(str(artifacts["torchscript"]))
    with torch.inference_mode():
        ts_out = scripted(torch.from_numpy(x)).numpy()
    return {ONNX_MODEL: np.asarray(onnx_out), TS_MODEL: ts_out}


def test_a_model_of_ours_pushed_profiled_planned_and_served_over_oip(
    service: Service,
    artifacts: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = service.store.create_token("admin", name="operator")
    infer_token = service.store.create_token("infer", name="client")
    with ApiServer(service) as url:
        monkeypatch.setenv("HETEROPLANE_URL", url)
        monkeypatch.setenv("HETEROPLANE_TOKEN", admin)

        pushed_onnx = _cli(capsys, "model", "push", ONNX_MODEL, str(artifacts["onnx"]))
        pushed_ts = _cli(
            capsys,
            "model",
            "push",
            TS_MODEL,
            str(artifacts["torchscript"]),
            "--format",
            "torchscript",
        )
        assert (pushed_onnx["version"], pushed_onnx["format"]) == (1, "onnx")
        assert (pushed_ts["version"], pushed_ts["format"]) == (1, "torchscript")
        for pushed in (pushed_onnx, pushed_ts):
            assert pushed["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}]
            assert pushed["outputs"][0]["shape"] == [-1, 3]

        spec = tmp_path / "wine.yaml"
        spec.write_text(
            json.dumps(
                {
                    "name": APP,
                    "models": [
                        {"name": ONNX_MODEL, "artifact": ONNX_MODEL},
                        {"name": TS_MODEL, "artifact": f"{TS_MODEL}@1"},
                    ],
                    "cascade": [ONNX_MODEL, TS_MODEL],
                    "thresholds": [THRESHOLD],
                    "slo": {"latency_ms": 1000},
                    "budget_usd_per_hr": 1.0,
                    "instance_types": TYPES.split(","),
                    "max_counts": {"emu.cpu.small": 2, "emu.cpu.large": 2},
                }
            )
        )
        _cli(capsys, "app", "apply", "--file", str(spec))

        # No profiles yet: the plan preview says how to get them, in one line.
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(["plans", "preview", "--app", APP, "--rate-qps", "5"])
        assert exited.value.code == 2
        refusal = capsys.readouterr().err.strip()
        assert "profile run" in refusal and "\n" not in refusal

        measured = _cli(
            capsys,
            "profile",
            "run",
            "--app",
            APP,
            "--types",
            TYPES,
            "--batch-sizes",
            "1,2,4",
            "--samples",
            "5",
        )
        assert measured  # the summary names what was measured (its shape: docs/models.md)

        plan = _cli(capsys, "plans", "preview", "--app", APP, "--rate-qps", "5")
        assert plan["feasible"], plan
        _cli(capsys, "plans", "apply", "--app", APP, "--id", str(plan["id"]))
        launch_fleet(service, APP, 1)

        client = http.InferenceServerClient(url.removeprefix("http://"))
        headers = {"Authorization": f"Bearer {infer_token}"}
        assert client.is_server_ready()
        assert client.get_server_metadata()["name"] == "heteroplane"
        deadline = time.monotonic() + DEADLINE_S
        while not client.is_model_ready(APP, headers=headers):
            assert time.monotonic() < deadline, "the app never became ready"
            time.sleep(POLL_S)
        metadata = client.get_model_metadata(APP, headers=headers)
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}]

        x = artifacts["x"]
        expected = _in_process(artifacts, x)
        for start in range(0, len(x), 32):
            rows = x[start : start + 32]
            tensor = http.InferInput("input", list(rows.shape), "FP32")
            tensor.set_data_from_numpy(rows)
            answer = client.infer(APP, [tensor], headers=headers)
            logits = answer.as_numpy("logits")
            assert logits is not None and logits.shape == (len(rows), 3)
            models = answer.get_response()["parameters"]["models"]
            assert len(models) == len(rows)
            for i, model in enumerate(models):
                np.testing.assert_allclose(logits[i], expected[model][start + i], rtol=0, atol=1e-5)

        wrong_shape = http.InferInput("input", [2, 12], "FP32")
        wrong_shape.set_data_from_numpy(np.zeros((2, 12), dtype=np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer(APP, [wrong_shape], headers=headers)
        assert refused.value.status() == "400" and "shape" in refused.value.message()
        wrong_type = http.InferInput("input", [2, 13], "FP64")
        wrong_type.set_data_from_numpy(np.zeros((2, 13), dtype=np.float64))
        with pytest.raises(InferenceServerException) as refused:
            client.infer(APP, [wrong_type], headers=headers)
        assert refused.value.status() == "400" and "datatype" in refused.value.message()

        records_file = tmp_path / "validation.json"
        capsys.readouterr()
        assert (
            main(
                [
                    "cascade",
                    "evaluate",
                    "--app",
                    APP,
                    "--data",
                    str(artifacts["data"]),
                    "--out",
                    str(records_file),
                ]
            )
            == 0
        ), capsys.readouterr().err
        records = json.loads(records_file.read_text())
        by_name = {entry["name"]: entry for entry in records["models"]}
        assert set(by_name) == {ONNX_MODEL, TS_MODEL}
        truth = artifacts["y"]
        for name, out in expected.items():
            assert by_name[name]["predictions"] == np.argmax(out, axis=1).tolist()
            assert by_name[name]["accuracy"] == pytest.approx(
                float((np.argmax(out, 1) == truth).mean())
            )
