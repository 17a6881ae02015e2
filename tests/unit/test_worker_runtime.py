"""Model runtimes and inspection (provisioners.worker.runtime, provisioners.worker.inspect):
small models exported to ONNX and TorchScript here, loaded, their signatures read, their outputs
equal to torch's own; and the inspection command's JSON or one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from provisioners.artifacts import FAMILY_SIGNATURE, ModelSignature, TensorSpec
from provisioners.worker import inspect as inspection
from provisioners.worker.inspect import InspectError, parse_inputs_spec
from provisioners.worker.runtime import (
    ModelLoadError,
    check_batchable,
    detect_format,
    family_runtime,
    load_runtime,
)
from tests.unit.worker_models import (
    export_onnx,
    export_torchscript,
    sample_inputs,
    tabular_model,
    torch_outputs,
)

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[2]
INPUT = {"name": "input", "datatype": "FP32", "shape": [-1, 13]}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tabular model as ONNX (batchable and not) and TorchScript (with and without its
    signature), truncated copies, and a text file."""
    folder = tmp_path_factory.mktemp("models")
    model = tabular_model()
    made = {
        "onnx": export_onnx(model, folder / "model.onnx"),
        "onnx_fixed": export_onnx(model, folder / "fixed.onnx", dynamic=False),
        "torchscript": export_torchscript(model, folder / "model.pt"),
        "torchscript_bare": export_torchscript(model, folder / "bare.pt", signature=None),
        "text": folder / "notes.txt",
    }
    made["text"].write_text("not a model\n")
    for name in ("onnx", "torchscript"):
        data = made[name].read_bytes()
        truncated = folder / f"truncated-{made[name].name}"
        truncated.write_bytes(data[: len(data) // 2])
        made[f"{name}_truncated"] = truncated
    return made


# --- runtimes -------------------------------------------------------------------------------------


def test_onnx_runs_as_torch_does_with_the_graphs_signature(files: dict[str, Path]) -> None:
    runtime = load_runtime(files["onnx"], "onnx")
    assert runtime.signature == ModelSignature(
        (TensorSpec("input", "FP32", (-1, 13)),), (TensorSpec("logits", "FP32", (-1, 3)),)
    )
    assert runtime.platform == "onnxruntime_onnx"
    inputs = sample_inputs(7)
    outputs = runtime.run({"input": inputs})
    assert list(outputs) == ["logits"]
    assert outputs["logits"].dtype == np.float32 and outputs["logits"].shape == (7, 3)
    np.testing.assert_allclose(outputs["logits"], torch_outputs(tabular_model(), inputs), atol=1e-5)


def test_torchscript_runs_as_torch_does_with_the_archives_signature(
    files: dict[str, Path],
) -> None:
    runtime = load_runtime(files["torchscript"])  # a zip: detected as TorchScript
    assert runtime.signature == ModelSignature(
        (TensorSpec("input", "FP32", (-1, 13)),), (TensorSpec("output0", "FP32", (-1, 3)),)
    )
    assert runtime.platform == "pytorch_libtorch"
    inputs = sample_inputs(5, seed=1)
    # Inputs of another type are cast to the signature's.
    outputs = runtime.run({"input": inputs.astype(np.float64)})
    assert outputs["output0"].dtype == np.float32
    np.testing.assert_allclose(
        outputs["output0"], torch_outputs(tabular_model(), inputs), atol=1e-5
    )


def test_a_torchscript_archive_needs_its_input_shapes_given_or_embedded(
    files: dict[str, Path],
) -> None:
    with pytest.raises(ModelLoadError, match="holds no input shapes") as refused:
        load_runtime(files["torchscript_bare"], "torchscript")
    assert "\n" not in str(refused.value)
    given = (TensorSpec("input", "FP32", (-1, 13)),)
    runtime = load_runtime(files["torchscript_bare"], "torchscript", inputs=given)
    assert runtime.signature.inputs == given
    assert runtime.signature.outputs == (TensorSpec("output0", "FP32", (-1, 3)),)
    with pytest.raises(ModelLoadError, match="not forward's arguments"):
        load_runtime(files["torchscript_bare"], inputs=(TensorSpec("x", "FP32", (-1, 13)),))
    with pytest.raises(ModelLoadError, match="fails on a batch of zeros"):
        load_runtime(files["torchscript_bare"], inputs=(TensorSpec("input", "FP32", (-1, 5)),))


def test_a_torch_save_file_is_told_apart_from_a_torchscript_archive(tmp_path: Path) -> None:
    # torch.save writes a zip too: it was refused as a TorchScript archive "likely corrupted"
    # (torch's "failed locating file constants.pkl ... your checkpoint file is corrupted").
    model = tabular_model()
    for what, saved in (("weights", model.state_dict()), ("module", model)):
        path = tmp_path / f"{what}.pt"
        torch.save(saved, str(path))
        with pytest.raises(ModelLoadError, match=r"written by torch\.save") as refused:
            load_runtime(path)
        assert "torch.jit.save(torch.jit.script(model)" in str(refused.value)
        assert "corrupted" not in str(refused.value)


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(13, 4)

    def forward(self, input: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(input) * mask.unsqueeze(1).to(torch.float32)
        return hidden, hidden.sum(dim=1).to(torch.float64)


class Named(torch.nn.Module):
    def forward(self, input: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": input * 2.0, "count": (input > 0).sum(dim=1)}


class Doubled(torch.nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.cat([input, input + 1.0], dim=0)  # two rows per row: not batchable


class Pooled(torch.nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.sum(dim=0, keepdim=True)  # one row whatever the batch: not batchable


def test_torchscript_outputs_are_named_by_position_or_by_key(tmp_path: Path) -> None:
    signature = {"inputs": [INPUT, {"name": "mask", "datatype": "BOOL", "shape": [-1]}]}
    two = load_runtime(export_torchscript(TwoHeads(), tmp_path / "two.pt", signature=signature))
    assert two.signature.outputs == (
        TensorSpec("output0", "FP32", (-1, 4)),
        TensorSpec("output1", "FP64", (-1,)),
    )
    outputs = two.run({"input": sample_inputs(3), "mask": np.array([True, False, True])})
    assert list(outputs) == ["output0", "output1"]
    assert outputs["output0"][1].tolist() == [0.0] * 4
    named = load_runtime(
        export_torchscript(Named(), tmp_path / "named.pt", signature={"inputs": [INPUT]})
    )
    assert [(s.name, s.datatype, s.shape) for s in named.signature.outputs] == [
        ("scores", "FP32", (-1, 13)),
        ("count", "INT64", (-1,)),
    ]


def test_a_dicts_keys_named_in_another_order_keep_their_tensors(tmp_path: Path) -> None:
    """A signature file listing a dict's own keys in another order: each name is the output of
    that key, in the file's order. They had been renamed by position (the signature said
    "count" was the FP32 [-1, 13] scores) while the runtime answered each name by key."""
    signature = {"inputs": [INPUT], "outputs": [{"name": "count"}, {"name": "scores"}]}
    runtime = load_runtime(export_torchscript(Named(), tmp_path / "keys.pt", signature=signature))
    assert [(s.name, s.datatype, s.shape) for s in runtime.signature.outputs] == [
        ("count", "INT64", (-1,)),
        ("scores", "FP32", (-1, 13)),
    ]
    rows = sample_inputs(3)
    outputs = runtime.run({"input": rows})
    assert list(outputs) == ["count", "scores"]
    assert outputs["count"].tolist() == (rows > 0).sum(axis=1).tolist()
    assert np.allclose(outputs["scores"], rows * 2.0)
    for spec in runtime.signature.outputs:  # the answer is what the signature says it is
        assert outputs[spec.name].dtype == spec.dtype
        assert outputs[spec.name].shape[1:] == spec.shape[1:]
    # Names of its own (not the keys) still rename by position.
    other = {"inputs": [INPUT], "outputs": [{"name": "logits"}, {"name": "n"}]}
    renamed = load_runtime(export_torchscript(Named(), tmp_path / "other.pt", signature=other))
    assert [(s.name, s.shape) for s in renamed.signature.outputs] == [
        ("logits", (-1, 13)),
        ("n", (-1,)),
    ]
    assert np.allclose(renamed.run({"input": rows})["logits"], rows * 2.0)


def test_output_names_in_the_signature_file_each_once_and_as_many_as_the_outputs(
    tmp_path: Path,
) -> None:
    # It said "names 2 distinct outputs; the model returns 2" of two outputs named alike.
    inputs = [INPUT, {"name": "mask", "datatype": "BOOL", "shape": [-1]}]
    twice = {"inputs": inputs, "outputs": [{"name": "logits"}, {"name": "logits"}]}
    path = export_torchscript(TwoHeads(), tmp_path / "twice.pt", signature=twice)
    with pytest.raises(ModelLoadError, match="names output 'logits' more than once"):
        load_runtime(path)
    three = {"inputs": inputs, "outputs": [{"name": "a"}, {"name": "b"}, {"name": "c"}]}
    path = export_torchscript(TwoHeads(), tmp_path / "three.pt", signature=three)
    with pytest.raises(ModelLoadError, match="names 3 outputs; the model returns 2"):
        load_runtime(path)


def test_models_without_a_dynamic_batch_dimension_are_refused(
    files: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="export with a dynamic batch axis") as fixed:
        load_runtime(files["onnx_fixed"], "onnx")
    assert "input 'input' has shape [1, 13]" in str(fixed.value)
    pooled = export_torchscript(Pooled(), tmp_path / "pooled.pt", signature={"inputs": [INPUT]})
    with pytest.raises(ModelLoadError, match="output 'output0' has shape \\[1, 13\\]"):
        load_runtime(pooled)
    # Two rows per input row: its first dimension followed the batch, so it was taken for the
    # batch dimension and pushed; every query then failed (502, 'shape [2, 13] for a batch of
    # 1 rows').
    doubled = export_torchscript(Doubled(), tmp_path / "doubled.pt", signature={"inputs": [INPUT]})
    with pytest.raises(ModelLoadError, match="has 2 rows for a batch of 1 and 4 for a batch of 2"):
        load_runtime(doubled)
    one_row = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 13]}]}
    single = export_torchscript(tabular_model(), tmp_path / "single.pt", signature=one_row)
    with pytest.raises(ModelLoadError, match="dynamic batch axis"):
        load_runtime(single)
    check_batchable(FAMILY_SIGNATURE)


def onnx_graph(path: Path, node: Any, output: list[str | int] | None, *weights: Any) -> Path:
    """A one-node ONNX graph from ``x`` (-1 x 4, FP32) to ``y``, declared of shape ``output``
    (None: of unknown rank)."""
    onnx = pytest.importorskip("onnx")
    helper = onnx.helper
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, output)],
        list(weights),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_an_onnx_model_must_answer_one_row_per_input_row(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    helper = onnx.helper
    # Its output's first dimension is symbolic, so the graph calls it batched; but it answers two
    # rows for one. It was pushed, profiled and planned; then every query failed (502, "output
    # 'y': shape [2, 4] for a batch of 1 rows").
    concat = helper.make_node("Concat", ["x", "x"], ["y"], axis=0)
    doubled = onnx_graph(tmp_path / "doubled.onnx", concat, ["rows", 4])
    with pytest.raises(ModelLoadError, match="has 2 rows for a batch of 1 and 4 for a batch of 2"):
        load_runtime(doubled)
    # A graph that loads but fails when run on a batch of one: refused with onnxruntime's reason.
    shape = helper.make_tensor("shape", onnx.TensorProto.INT64, [2], [-1, 8])
    reshape = helper.make_node("Reshape", ["x", "shape"], ["y"])
    pairs = onnx_graph(tmp_path / "pairs.onnx", reshape, ["half", 8], shape)
    with pytest.raises(ModelLoadError, match="fails on a batch of zeros") as failed:
        load_runtime(pairs)
    assert "\n" not in str(failed.value)
    # An output of unknown rank takes its shape from the probes.
    relu = onnx_graph(tmp_path / "relu.onnx", helper.make_node("Relu", ["x"], ["y"]), None)
    assert load_runtime(relu).signature.outputs == (TensorSpec("y", "FP32", (-1, 4)),)


def test_an_onnx_model_without_outputs_is_refused(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    helper = onnx.helper
    # onnxruntime loads it, so it was pushed with "outputs" empty and taken into an app; then
    # its worker could not start ("At least one output should be requested"), a 502.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "silent.onnx"))
    with pytest.raises(ModelLoadError, match=r"silent\.onnx: the ONNX graph has no outputs"):
        load_runtime(tmp_path / "silent.onnx")


@pytest.mark.parametrize(
    ("name", "format", "fragment"),
    [
        ("text", None, "neither a TorchScript archive .* nor an ONNX model"),
        ("text", "onnx", "is not an ONNX model"),
        ("onnx_truncated", "onnx", "is not an ONNX model"),
        ("torchscript_truncated", None, "is not a TorchScript archive"),
        ("onnx", "torchscript", "is not a TorchScript archive"),
    ],
)
def test_files_that_are_not_models_are_refused_with_one_line(
    files: dict[str, Path], name: str, format: str | None, fragment: str
) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as refused:
        load_runtime(files[name], format)
    assert "\n" not in str(refused.value)


def test_formats_are_detected_and_bad_arguments_refused(
    files: dict[str, Path], tmp_path: Path
) -> None:
    assert detect_format(files["torchscript"]) == "torchscript"
    assert detect_format(files["onnx"]) == "onnx"
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is empty"):
        detect_format(empty)
    with pytest.raises(ModelLoadError, match="cannot read"):
        detect_format(tmp_path / "missing.onnx")
    with pytest.raises(ModelLoadError, match="format 'pickle'"):
        load_runtime(files["onnx"], "pickle")
    with pytest.raises(ModelLoadError, match="device 'tpu'"):
        load_runtime(files["onnx"], "onnx", device="tpu")
    # Asked for the GPU where there is none, both runtimes fall back to the CPU.
    if not torch.cuda.is_available():
        runtime = load_runtime(files["onnx"], "onnx", device="cuda")
        assert runtime.run({"input": sample_inputs(1)})["logits"].shape == (1, 3)
        assert load_runtime(files["torchscript"], device="cuda").signature.outputs[0].batched


def test_a_family_model_answers_its_logits_under_the_family_signature() -> None:
    from provisioners.worker.family import build_model, model_spec

    torch.manual_seed(0)
    model = build_model(model_spec("small")).eval()
    runtime = family_runtime(model)
    assert runtime.signature == FAMILY_SIGNATURE
    pixels = np.random.default_rng(2).integers(0, 17, size=(4, 64)).astype(np.float32)
    logits = runtime.run({"input": pixels})["logits"]
    assert logits.shape == (4, 10)
    with torch.inference_mode():
        expected = model(torch.from_numpy(pixels)).numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-6)


def test_a_family_models_arrays_answer_under_the_family_signature() -> None:
    from provisioners.worker.family import ArrayModel, build_model, model_spec

    torch.manual_seed(0)
    module = build_model(model_spec("large")).eval()
    state = {key: value.numpy() for key, value in module.state_dict().items()}
    runtime = family_runtime(ArrayModel(model_spec("large"), state))
    assert runtime.signature == FAMILY_SIGNATURE and runtime.platform == "pytorch_torch"
    pixels = np.random.default_rng(3).integers(0, 17, size=(5, 64)).astype(np.float32)
    logits = runtime.run({"input": pixels})["logits"]
    with torch.inference_mode():
        expected = module(torch.from_numpy(pixels)).numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"has shape \[5, 8, 8\], the model takes \[-1, 64\]"):
        runtime.run({"input": pixels.reshape(5, 8, 8)})


# --- inspection -----------------------------------------------------------------------------------


def test_inputs_specs_are_parsed_and_checked() -> None:
    assert parse_inputs_spec("input:FP32:-1x13, ids:int64:-1x2x4") == (
        TensorSpec("input", "FP32", (-1, 13)),
        TensorSpec("ids", "INT64", (-1, 2, 4)),
    )
    for wrong, fragment in [
        ("input:FP32", "expected NAME:DATATYPE:SHAPE"),
        ("input:FP32:-1xA", "not dimensions joined by x"),
        ("input:STRING:-1", "is not served"),
        ("input:FP32:-2", "bad shape"),
        ("a:FP32:-1,a:FP32:-1", "named twice"),
        ("a\x00:FP32:-1", "control characters"),
        ("input:FP32:-1x99999999999999999999", "has a dimension past 2,147,483,647"),
    ]:
        with pytest.raises(InspectError, match=fragment):
            parse_inputs_spec(wrong)


def inspect_here(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    """``inspect.main`` in this process: its exit code, its JSON (or None) and its stderr."""
    try:
        code = inspection.main(list(args))
    except SystemExit as exited:
        code = int(exited.code or 0)
    out, err = capfd.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_inspect_prints_the_signature_as_json(
    files: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    code, document, err = inspect_here(capfd, str(files["onnx"]))
    assert (code, err) == (0, "")
    assert document == {
        "format": "onnx",
        "inputs": [INPUT],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}],
    }
    code, document, _ = inspect_here(capfd, str(files["torchscript"]), "--format", "torchscript")
    assert code == 0 and document["format"] == "torchscript"
    assert document["outputs"] == [{"name": "output0", "datatype": "FP32", "shape": [-1, 3]}]
    code, document, _ = inspect_here(
        capfd, str(files["torchscript_bare"]), "--inputs", "input:FP32:-1x13"
    )
    assert code == 0 and document["inputs"] == [INPUT]


@pytest.mark.parametrize(
    ("name", "args", "fragment"),
    [
        ("text", (), "neither a TorchScript archive (not a zip file) nor an ONNX model"),
        ("text", ("--format", "onnx"), "is not an ONNX model"),
        ("onnx_truncated", (), "an ONNX model onnxruntime can load"),
        ("torchscript_truncated", (), "is not a TorchScript archive"),
        ("torchscript_bare", (), "holds no input shapes"),
        ("onnx_fixed", (), "export with a dynamic batch axis"),
        ("missing", (), "cannot read"),
        ("torchscript_bare", ("--inputs", "input:FP32"), "expected NAME:DATATYPE:SHAPE"),
        ("onnx", ("--format", "pickle"), "invalid choice"),
    ],
)
def test_inspect_refuses_with_exit_2_and_one_line(
    files: dict[str, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    name: str,
    args: tuple[str, ...],
    fragment: str,
) -> None:
    path = files.get(name, tmp_path / "missing.onnx")
    code, _, err = inspect_here(capfd, str(path), *args)
    assert code == 2
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert fragment in err


def run_inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "provisioners.worker.inspect", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_python_dash_m_inspect_answers_json_or_one_line(files: dict[str, Path]) -> None:
    good = run_inspect(str(files["onnx"]))
    assert good.returncode == 0 and good.stderr == ""
    assert json.loads(good.stdout)["outputs"][0]["name"] == "logits"
    bad = run_inspect(str(files["torchscript_truncated"]))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_inspecting_onnx_does_not_import_torch(files: dict[str, Path]) -> None:
    code = (
        "import sys\n"
        "from provisioners.worker.inspect import main\n"
        f"assert main([{str(files['onnx'])!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr


def conv_graph(path: Path, kernel: int, output: list[str | int]) -> Path:
    """An ONNX CNN over images of any size (``x``: batch x 3 x h x w, FP32): a ``kernel`` x
    ``kernel`` convolution without padding, a global average pool, ``y`` declared ``output``."""
    onnx = pytest.importorskip("onnx")
    helper = onnx.helper
    weights = helper.make_tensor(
        "w", onnx.TensorProto.FLOAT, [2, 3, kernel, kernel], [0.5] * (6 * kernel * kernel)
    )
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[kernel, kernel]),
        helper.make_node("GlobalAveragePool", ["c"], ["g"]),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, output)],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_a_cnn_over_images_of_any_size_is_probed_where_its_kernel_fits(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # A 3x3 convolution takes no 1x1 image: the probe's zeros of 1 in h and w failed, and the
    # model, which serves images of 3x3 and more, was refused at push (and at every worker's
    # load). The probes try 64 there next.
    small = load_runtime(conv_graph(tmp_path / "small.onnx", 3, ["batch", 2]))
    assert small.signature.outputs == (TensorSpec("y", "FP32", (-1, 2)),)
    out = small.run({"x": np.ones((2, 3, 5, 7), np.float32)})["y"]
    assert out.shape == (2, 2)
    # A kernel no size tried fits: taken as the graph declares it, its rows not checked.
    wide = load_runtime(conv_graph(tmp_path / "wide.onnx", 100, ["batch", 2]))
    assert wide.signature.outputs == (TensorSpec("y", "FP32", (-1, 2)),)
    assert wide.run({"x": np.ones((1, 3, 100, 100), np.float32)})["y"].shape == (1, 2)
    # The probes' failures are answers, not onnxruntime's error lines on stderr.
    assert "ONNXRuntimeError" not in capfd.readouterr().err
