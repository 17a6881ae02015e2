"""What a model a user brings is told when it fails (provisioners.worker.runtime): a TorchScript
error's own reason (not the interpreter's first line), a ``forward`` whose module argument is not
called ``self``, ``--inputs`` given for an ONNX model, and a signature file that is not an object
or lacks its ``inputs``; each refusal one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from provisioners.artifacts import TensorSpec
from provisioners.worker.runtime import ModelLoadError, first_line, load_runtime
from tests.unit.worker_models import export_onnx, export_torchscript, tabular_model

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")


class Plain(torch.nn.Module):
    """An MLP expecting 8 features."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class Picky(torch.nn.Module):
    """Refuses a value over 1 with its own message."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.max() > 1.0):
            raise RuntimeError("value too big for this model")
        return x * 2.0


class NotSelf(torch.nn.Module):
    def forward(s, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: N805
        return torch.cat([x, y], dim=1)


def one_line(message: str) -> str:
    assert "\n" not in message and "The following operation failed" not in message, message
    return message


def test_a_torchscript_shape_error_names_the_shapes(tmp_path: Path) -> None:
    path = export_torchscript(Plain(), tmp_path / "mlp_plain.pt", signature=None)
    with pytest.raises(ModelLoadError) as refused:
        load_runtime(path, inputs=(TensorSpec("x", "FP32", (-1, 7)),))
    message = one_line(str(refused.value))
    assert message.startswith("the model fails on a batch of zeros")
    assert message.endswith(
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x7 and 8x3)"
    ), message


def test_a_torchscript_models_own_error_is_its_reason(tmp_path: Path) -> None:
    path = export_torchscript(Picky(), tmp_path / "picky.pt", signature=None)
    runtime = load_runtime(path, inputs=(TensorSpec("x", "FP32", (-1, 4)),))
    with pytest.raises(Exception) as failed:
        runtime.run({"x": np.full((1, 4), 5.0, np.float32)})
    assert one_line(first_line(failed.value)) == "RuntimeError: value too big for this model"


def test_first_line_of_other_errors_is_unchanged() -> None:
    assert first_line(ValueError("first\nsecond")) == "first"
    assert first_line(KeyError()) == "KeyError"


def test_forwards_module_argument_is_dropped_whatever_its_name(tmp_path: Path) -> None:
    path = export_torchscript(NotSelf(), tmp_path / "s.pt", signature=None)
    given = (TensorSpec("x", "FP32", (-1, 4)), TensorSpec("y", "FP32", (-1, 6)))
    runtime = load_runtime(path, inputs=given)
    assert [s.name for s in runtime.signature.inputs] == ["x", "y"]
    assert runtime.signature.outputs[0].shape == (-1, 10)
    with pytest.raises(ModelLoadError, match=r"not forward's arguments \(x, y\)"):
        load_runtime(path, inputs=(TensorSpec("s", "FP32", (-1, 4)), *given[:1]))


def test_inputs_given_for_an_onnx_model_are_refused(tmp_path: Path) -> None:
    path = export_onnx(tabular_model(), tmp_path / "model.onnx")
    with pytest.raises(ModelLoadError, match="ONNX model's inputs come from its graph"):
        load_runtime(path, inputs=(TensorSpec("input", "FP32", (-1, 13)),))
    assert load_runtime(path).signature.inputs[0].name == "input"


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"outputs": [{"name": "logits"}]}, "has no 'inputs'"),
        ([{"name": "input", "datatype": "FP32", "shape": [-1, 13]}], "not a list"),
        ("input", "not a string"),
    ],
)
def test_a_signature_file_that_is_not_usable_says_why(
    tmp_path: Path, document: object, expected: str
) -> None:
    path = export_torchscript(tabular_model(), tmp_path / "model.pt", signature=document)
    with pytest.raises(ModelLoadError) as refused:
        load_runtime(path)
    message = one_line(str(refused.value))
    assert "heteroplane/signature.json is not usable" in message and expected in message, message


def test_a_signature_file_that_is_not_json_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    extra = {"heteroplane/signature.json": "{inputs: nope"}
    torch.jit.save(torch.jit.script(tabular_model()), str(path), _extra_files=extra)
    with pytest.raises(ModelLoadError, match=r"signature\.json is not JSON"):
        load_runtime(path)
