"""``heteroplane cascade evaluate --app APP --data FILE.npz``: an app's registered models (small
ONNX models made here) fetched through a stand-in for the API client, run in process, their
certainty read as the spec says, and the records written as heteroplane.validation/v1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.cli import cascade_registered, main
from controlplane.cli.cascade_registered import certainty_of, scores_of
from estimator.cascades import load_validation

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def linear_onnx(path: Path, weights: np.ndarray) -> bytes:
    """An ONNX model y = x @ weights, with a dynamic batch axis."""
    from onnx import TensorProto, helper, numpy_helper

    rows, cols = weights.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", cols])],
        [numpy_helper.from_array(weights.astype(np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path.read_bytes()


class FakeClient:
    """What the command asks the API for: the app, each model version and its bytes."""

    def __init__(self, spec: dict[str, Any], artifacts: dict[str, bytes]) -> None:
        self.spec = spec
        self.artifacts = artifacts
        self.paths: list[str] = []

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def get(self, path: str) -> Any:
        self.paths.append(path)
        if path == f"/v1/apps/{self.spec['name']}":
            return {"spec": self.spec}
        name, version = path.split("/")[3], path.split("/")[5]
        assert f"{name}@{version}" in self.artifacts
        return {"name": name, "version": int(version), "format": "onnx"}

    def download(self, path: str) -> bytes:
        self.paths.append(path)
        parts = path.split("/")
        return self.artifacts[f"{parts[3]}@{parts[5]}"]


def test_softmax_margin_and_max_prob() -> None:
    scores = scores_of(np.array([[0.0, 0.0], [10.0, 0.0]]))
    assert scores[0].tolist() == [0.5, 0.5]
    assert certainty_of(scores, "margin")[0] == 0.0
    assert certainty_of(scores, "max_prob")[0] == 0.5
    assert certainty_of(scores, "margin")[1] == pytest.approx(1.0, abs=1e-4)


def test_evaluate_writes_validation_records_of_the_apps_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # small: the class is the larger of features 0 and 1 (never class 2); large: always right
    # (it reads the label's one-hot, features 3 to 5).
    small_weights = np.vstack([np.diag([1.0, 1.0, 0.0]), np.zeros((3, 3))])
    small = linear_onnx(tmp_path / "s.onnx", small_weights)
    large = linear_onnx(tmp_path / "l.onnx", np.vstack([np.zeros((3, 3)), 5 * np.eye(3)]))
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=50)
    inputs = np.hstack([rng.random((50, 3)), np.eye(3)[labels]]).astype(np.float32)
    np.savez(tmp_path / "data.npz", inputs=inputs, labels=labels)
    spec = {
        "name": "digits",
        "models": [
            {"name": "small", "artifact": "s@1", "certainty": "max_prob"},
            {"name": "large", "artifact": "l@2"},
        ],
        "cascade": ["small", "large"],
    }
    client = FakeClient(spec, {"s@1": small, "l@2": large})
    monkeypatch.setattr(cascade_registered, "client_from", lambda _args: client)
    out = tmp_path / "records.json"
    argv = ["cascade", "evaluate", "--app", "digits", "--data", str(tmp_path / "data.npz")]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in summary["models"]] == ["small", "large"]
    assert "/v1/models/s/versions/1/artifact" in client.paths
    records = load_validation(out)
    assert list(records.models) == ["small", "large"] and records.n_samples == 50
    assert records.model_accuracy("large") == 1.0
    expected_small = (np.argmax(inputs[:, :3] * [1, 1, 0], axis=1) == labels).mean()
    assert records.model_accuracy("small") == pytest.approx(expected_small)
    # max_prob of small: its top softmax score, at least a third with three classes.
    small_certainty = records.certainty[records.model_index("small")]
    assert (small_certainty >= 1 / 3 - 1e-9).all() and (small_certainty <= 1).all()


def test_a_model_without_an_artifact_or_bad_data_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "bad.npz", inputs=np.zeros((3, 6)))
    argv = ["cascade", "evaluate", "--app", "digits", "--data", str(tmp_path / "bad.npz")]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "o.json")])
    assert stop.value.code == 2
    assert "no array 'labels'" in capsys.readouterr().err
    np.savez(tmp_path / "ok.npz", inputs=np.zeros((3, 6)), labels=np.zeros(3, dtype=int))
    spec = {"name": "digits", "models": [{"name": "tiny", "profiles": "p.csv"}]}
    monkeypatch.setattr(cascade_registered, "client_from", lambda _a: FakeClient(spec, {}))
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "cascade",
                "evaluate",
                "--app",
                "digits",
                "--data",
                str(tmp_path / "ok.npz"),
                "--out",
                str(tmp_path / "o.json"),
            ]
        )
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "has no artifact" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("labels", "inputs", "message"),
    [
        (np.array([0, -1, 2]), np.zeros((3, 6)), "'labels' are class indices (>= 0), got -1"),
        (np.array([0, 1, 2]), np.full((3, 6), np.nan), "'inputs' hold NaN or infinity"),
        (np.array([0, 1, 99]), np.zeros((3, 6)), "'labels' go up to 99; model small answers 3"),
    ],
)
def test_labels_past_the_models_classes_and_nan_inputs_are_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    labels: np.ndarray,
    inputs: np.ndarray,
    message: str,
) -> None:
    """Not records whose accuracy counts a label no model can answer, nor a NaN sample the
    certainty then blames on the output file."""
    small = linear_onnx(tmp_path / "s.onnx", np.vstack([np.eye(3), np.zeros((3, 3))]))
    np.savez(tmp_path / "data.npz", inputs=inputs.astype(np.float32), labels=labels)
    spec = {"name": "digits", "models": [{"name": "small", "artifact": "s@1"}]}
    client = FakeClient(spec, {"s@1": small})
    monkeypatch.setattr(cascade_registered, "client_from", lambda _args: client)
    argv = ["cascade", "evaluate", "--app", "digits", "--data", str(tmp_path / "data.npz")]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "o.json")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "fetching" not in line]
    assert stop.value.code == 2 and len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "o.json").exists()


def test_a_model_that_raises_on_the_data_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's TorchScript model raising on some rows ended in the model's traceback."""
    from provisioners.worker import runtime as worker_runtime

    real_load = worker_runtime.load_runtime

    class Raising:
        def __init__(self, inner: object) -> None:
            self.signature = inner.signature  # type: ignore[attr-defined]

        def run(self, feeds: object) -> object:
            raise RuntimeError("The following operation failed\n  boom: feature 0 too big")

    monkeypatch.setattr(worker_runtime, "load_runtime", lambda *a: Raising(real_load(*a)))
    small = linear_onnx(tmp_path / "s.onnx", np.vstack([np.eye(3), np.zeros((3, 3))]))
    np.savez(tmp_path / "data.npz", inputs=np.zeros((3, 6), np.float32), labels=np.zeros(3, int))
    spec = {"name": "digits", "models": [{"name": "small", "artifact": "s@1"}]}
    monkeypatch.setattr(
        cascade_registered, "client_from", lambda _a: FakeClient(spec, {"s@1": small})
    )
    argv = ["cascade", "evaluate", "--app", "digits", "--data", str(tmp_path / "data.npz")]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "o.json")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "fetching" not in line]
    assert stop.value.code == 2 and len(errors) == 1
    assert "model small (s@1) failed on the --data inputs" in errors[0]
    assert "RuntimeError: boom: feature 0 too big" in errors[0]


@pytest.mark.parametrize("flag", ["--data", "--validation-data"])
def test_a_shape_error_names_the_option_the_data_came_from(flag: str) -> None:
    """``rollout start --validation-data`` shares this check with ``cascade evaluate --data``;
    its errors named --data for both."""
    from controlplane.cli.output import UsageError
    from provisioners.artifacts import ModelSignature, TensorSpec

    signature = ModelSignature(
        inputs=(TensorSpec("x", "FP32", (-1, 13)),), outputs=(TensorSpec("y", "FP32", (-1, 3)),)
    )
    with pytest.raises(UsageError) as refused:
        cascade_registered._shaped(np.zeros((4, 5)), signature, "wine", flag)
    assert str(refused.value).startswith(f"{flag} 'inputs' samples are [5]")
