"""The worker agent without processes: the padding arithmetic, the compute and profile curves,
the command line, the agent's Open Inference Protocol answers with a stand-in model and clock,
its HTTP routes in-process, real ONNX and TorchScript artifacts loaded and served, and the local
provisioner's worker command line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.serving.modelio import ModelIO
from estimator.profiles import LatencyProfile, write_profiles_json
from provisioners.artifacts import (
    FAMILY_SIGNATURE,
    ArtifactRef,
    TensorSpec,
    file_sha256,
)
from provisioners.base import LaunchRequest
from provisioners.local import LocalProvisioner
from provisioners.worker import agent
from provisioners.worker.agent import (
    MAX_BODY_BYTES,
    AgentConfig,
    LoadFailedError,
    RequestError,
    WorkerAgent,
    build_emulation,
    input_at_fault,
    latency_summary,
    load_models,
    parse_args,
)
from provisioners.worker.emulation import (
    EMULATED_COMPUTE,
    ComputeCurve,
    Emulation,
    EmulationError,
    LatencyCurve,
    compute_document,
    padding_ms,
    read_curves,
)
from provisioners.worker.oip import HEADER_LENGTH, binary_request_body

MODELS = ("tiny", "large")
SHA = "ab" * 32


def body(document: Any) -> bytes:
    return json.dumps(document).encode()


def rows(n: int, value: float = 1.0) -> list[list[float]]:
    return [[value] * 64 for _ in range(n)]


def infer_body(n: int, value: float = 1.0, **extra: Any) -> bytes:
    """An Open Inference Protocol request of ``n`` family rows (flattened data)."""
    tensor = {"name": "input", "shape": [n, 64], "datatype": "FP32", "data": [value] * (64 * n)}
    return body({"inputs": [tensor], **extra})


def test_the_family_signature_is_the_familys_shape() -> None:
    pytest.importorskip("torch")
    from provisioners.worker import family

    assert FAMILY_SIGNATURE.inputs[0].shape == (-1, family.N_FEATURES)
    assert FAMILY_SIGNATURE.outputs[0].shape == (-1, family.N_CLASSES)
    assert agent.DEFAULT_MODELS == family.MODEL_NAMES


# --- padding arithmetic ---------------------------------------------------------------------------


def test_padding_fills_the_gap_to_the_target_and_never_goes_negative() -> None:
    assert padding_ms(3.0, 5.0) == 2.0
    assert padding_ms(5.0, 3.0) == 0.0
    assert padding_ms(4.0, 4.0) == 0.0


def test_without_a_profile_the_target_is_measured_over_the_speed_factor() -> None:
    half = Emulation("emu.cpu.small", 0.5)
    assert half.target_ms("tiny", 8, measured_ms=3.0) == 6.0
    assert half.padding_ms("tiny", 8, measured_ms=3.0) == 3.0
    assert half.emulated and half.source("tiny") == "measured"
    # A faster type cannot be emulated by waiting: no padding.
    gpu = Emulation("emu.gpu", 4.0)
    assert gpu.target_ms("tiny", 1, measured_ms=4.0) == 1.0
    assert gpu.padding_ms("tiny", 1, measured_ms=4.0) == 0.0


def test_the_own_curve_wins_over_the_reference_curve_and_that_over_measured() -> None:
    reference = {"tiny": LatencyCurve((1, 8), (2.0, 9.0)), "large": LatencyCurve((1,), (10.0,))}
    own = {"tiny": LatencyCurve((1, 8), (5.0, 40.0))}
    emulation = Emulation("emu.cpu.small", 0.5, own, reference, "profile:local.cpu")
    assert emulation.target_ms("tiny", 8, measured_ms=1.0) == 40.0
    assert emulation.source("tiny") == "profile:emu.cpu.small"
    assert emulation.target_ms("large", 1, measured_ms=1.0) == 20.0  # 10 / 0.5
    assert emulation.source("large") == "profile:local.cpu"
    assert emulation.target_ms("small", 1, measured_ms=1.5) == 3.0
    assert emulation.padding_ms("large", 1, measured_ms=25.0) == 0.0


def test_a_compute_curve_is_a_cost_per_call_and_per_row_over_the_speed_factor() -> None:
    curve = ComputeCurve(4.0, 12.0)
    assert [curve.latency_ms(b) for b in (1, 2, 8)] == [16.0, 28.0, 100.0]
    emulation = Emulation("emu.cpu.small", 0.5, reference={"tiny": curve})
    assert emulation.target_ms("tiny", 2, measured_ms=0.2) == 56.0
    assert emulation.padding_ms("tiny", 2, measured_ms=0.2) == pytest.approx(55.8)
    assert emulation.source("tiny") == "compute"
    for base, per_row in [(-1.0, 1.0), (1.0, float("inf")), (float("nan"), 1.0)]:
        with pytest.raises(EmulationError):
            ComputeCurve(base, per_row)


def test_the_builtin_compute_is_tens_of_ms_and_rises_with_the_model() -> None:
    one_row = [EMULATED_COMPUTE[m].latency_ms(1) for m in ("tiny", "small", "medium", "large")]
    assert one_row == sorted(one_row) and one_row[0] >= 10.0 and one_row[-1] <= 100.0
    for curve in EMULATED_COMPUTE.values():
        assert curve.per_row_ms > curve.base_ms  # a CPU: a row costs more than the call


def test_not_emulated_means_no_padding_and_the_measured_latency() -> None:
    plain = Emulation("g4dn.xlarge", None)
    assert not plain.emulated
    assert plain.target_ms("tiny", 4, measured_ms=7.0) == 7.0
    assert plain.padding_ms("tiny", 4, measured_ms=7.0) == 0.0
    assert plain.source("tiny") == "none"
    with pytest.raises(EmulationError):
        Emulation("emu.gpu", 0.0)
    with pytest.raises(EmulationError):
        Emulation("emu.gpu", float("nan"))


def test_a_curve_interpolates_holds_below_and_scales_above() -> None:
    curve = LatencyCurve((2, 4, 8), (2.0, 3.0, 7.0))
    assert curve.latency_ms(1) == 2.0
    assert curve.latency_ms(3) == 2.5
    assert curve.latency_ms(4) == 3.0
    assert curve.latency_ms(6) == 5.0
    assert curve.latency_ms(16) == 14.0
    for sizes, means in [((), ()), ((1, 1), (1.0, 2.0)), ((0,), (1.0,)), ((1,), (-1.0,))]:
        with pytest.raises(EmulationError):
            LatencyCurve(sizes, means)


def profile_file(tmp_path: Path, **meta: Any) -> Path:
    """A profile JSON of the older kind (no compute section: its latencies are compute)."""
    cells = (np.array([1.0, 3.0]), np.array([4.0, 6.0]))
    measured = [
        LatencyProfile("tiny", "local.cpu", np.array([1, 4]), cells),
        LatencyProfile("large", "local.cpu", np.array([1, 4]), cells),
        LatencyProfile("tiny", "emu.gpu", np.array([1, 4]), cells),
        LatencyProfile("medium", "local.cpu", np.array([1, 4]), cells),
    ]
    path = tmp_path / "family.json"
    write_profiles_json(measured, path, source="measured", reference_type="local.cpu", **meta)
    return path


def test_reference_curves_are_read_from_a_profile_file_without_a_compute_section(
    tmp_path: Path,
) -> None:
    curves = read_curves(profile_file(tmp_path), MODELS, "emu.cpu.small")
    assert curves.own == {} and curves.origin == "profile:local.cpu"
    assert sorted(curves.reference) == ["large", "tiny"]  # medium is not served here
    assert curves.reference["tiny"] == LatencyCurve((1, 4), (2.0, 5.0))  # the means
    assert sorted(read_curves(profile_file(tmp_path), MODELS, "emu.gpu").own) == ["tiny"]


def test_a_compute_section_wins_over_the_end_to_end_profiles(tmp_path: Path) -> None:
    section = compute_document({"tiny": ComputeCurve(4.0, 12.0), "medium": ComputeCurve(1, 1)})
    curves = read_curves(profile_file(tmp_path, compute=section), MODELS, "emu.gpu")
    # The profiles are what a caller sees, not what a worker pads to: none of them is read.
    assert curves.own == {} and curves.origin == "compute:profile"
    assert curves.reference == {"tiny": ComputeCurve(4.0, 12.0)}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{", "not JSON"),
        ('{"profiles": 3}', "'profiles' list"),
        ('{"format": "other", "profiles": []}', "unsupported format"),
        ('{"profiles": [1]}', "must be an object"),
        (
            '{"profiles": [{"model": "tiny", "instance_type": "local.cpu",'
            ' "batch_sizes": [1, 2], "latency_ms": [1]}]}',
            "equal length",
        ),
        (
            '{"profiles": [{"model": "tiny", "instance_type": "local.cpu",'
            ' "batch_sizes": [1], "latency_ms": [["x"]]}]}',
            "hold numbers",
        ),
        ('{"profiles": [], "compute": {"models": []}}', "compute: expected an object"),
        ('{"profiles": [], "compute": {"models": {"tiny": 3}}}', "base_ms and per_row_ms"),
        (
            '{"profiles": [], "compute": {"models": {"tiny": {"base_ms": "4", "per_row_ms": 1}}}}',
            "base_ms must be a number",
        ),
        (
            '{"profiles": [], "compute": {"models": {"tiny": {"base_ms": -4, "per_row_ms": 1}}}}',
            "finite and >= 0",
        ),
    ],
)
def test_unusable_profile_files_are_refused(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(EmulationError, match=fragment):
        read_curves(path, MODELS, "emu.cpu.small")
    with pytest.raises(EmulationError, match="cannot read"):
        read_curves(tmp_path / "missing.json", MODELS, "emu.cpu.small")


def config(**changes: Any) -> AgentConfig:
    base = AgentConfig(host="127.0.0.1", port=0, instance_type="emu.cpu.small", models=MODELS)
    return dataclasses.replace(base, **changes)


def test_build_emulation_follows_the_command_line(tmp_path: Path) -> None:
    assert not build_emulation(config()).emulated  # no speed factor
    assert not build_emulation(config(speed_factor=0.5, pad=False)).emulated
    assert not build_emulation(config(instance_type="local.cpu", speed_factor=1.0)).emulated
    # No profile file: the measured latency over the speed factor.
    plain = build_emulation(config(speed_factor=0.5))
    assert plain.speed_factor == 0.5 and not plain.reference
    assert plain.source("large") == "measured"
    profiled = build_emulation(config(speed_factor=0.5, profile=profile_file(tmp_path)))
    assert profiled.target_ms("tiny", 1, measured_ms=0.1) == 4.0  # 2 / 0.5
    section = compute_document({"tiny": ComputeCurve(1.0, 1.0)})
    other = tmp_path / "other"
    other.mkdir()
    computed = build_emulation(
        config(speed_factor=0.5, profile=profile_file(other, compute=section))
    )
    assert computed.target_ms("tiny", 1, measured_ms=0.1) == 4.0  # (1 + 1) / 0.5
    assert computed.source("tiny") == "compute:profile"
    assert computed.source("large") == "measured"  # the file's section has no curve of it
    third = tmp_path / "third"
    third.mkdir()
    builtin = compute_document(EMULATED_COMPUTE)
    served = build_emulation(config(speed_factor=0.5, profile=profile_file(third, compute=builtin)))
    expected_ms = EMULATED_COMPUTE["large"].latency_ms(3) / 0.5
    assert served.target_ms("large", 3, measured_ms=0.1) == pytest.approx(expected_ms)


def test_the_command_line_is_parsed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    parsed = parse_args(["--instance-type", "emu.gpu", "--speed-factor", "4", "--no-pad"])
    assert parsed.models == ("tiny", "small", "medium", "large")
    assert (parsed.speed_factor, parsed.pad, parsed.port, parsed.threads) == (4.0, False, 8080, 1)
    parsed = parse_args(["--instance-type", "t", "--models", "tiny, large", "--listen-fd", "5"])
    assert parsed.models == ("tiny", "large") and parsed.listen_fd == 5
    for wrong in (
        [],
        ["--instance-type", "t", "--speed-factor", "0"],
        ["--instance-type", "t", "--speed-factor", "inf"],
        ["--instance-type", "t", "--models", "tiny,,large"],
        ["--instance-type", "t", "--models", "tiny,tiny"],
        ["--instance-type", "t", "--port", "70000"],
        ["--instance-type", "t", "--threads", "0"],
    ):
        with pytest.raises(SystemExit) as exited:
            parse_args(wrong)
        assert exited.value.code == 2
    capsys.readouterr()


def test_latency_summary() -> None:
    summary = latency_summary([1.0, 2.0, 3.0, 4.0])
    assert summary == {"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97, "max": 4.0}
    assert latency_summary([]) == dict.fromkeys(("mean", "p50", "p90", "p99", "max"))


def artifact_arg(name: str, model: str = "tabular", fmt: str = "onnx") -> str:
    return f"{name}:{model}:3:{fmt}:{SHA}:s3://bucket/models/{model}/3"


def test_artifacts_on_the_command_line_replace_the_family() -> None:
    parsed = parse_args(["--instance-type", "t", "--artifact", artifact_arg("a")])
    assert parsed.models == ("a",) and parsed.family_models == ()
    assert parsed.artifacts == (ArtifactRef.from_arg(artifact_arg("a")),)
    assert parsed.artifacts[0].uri == "s3://bucket/models/tabular/3"
    both = parse_args(
        [
            "--instance-type",
            "t",
            "--models",
            "tiny",
            "--artifact",
            artifact_arg("a"),
            "--artifact",
            artifact_arg("b", "other", "torchscript"),
            "--device",
            "cuda",
        ]
    )
    assert both.models == ("tiny", "a", "b") and both.family_models == ("tiny",)
    assert both.device == "cuda"


def test_a_torchscript_artifacts_inputs_travel_on_the_command_line() -> None:
    inputs = (TensorSpec("x", "FP32", (-1, 4)), TensorSpec("ids", "INT64", (-1, 2)))
    ref = ArtifactRef.from_arg(artifact_arg("ts", "plain", "torchscript"))
    with_inputs = dataclasses.replace(ref, inputs=inputs)
    argv = [part for pair in with_inputs.worker_options() for part in pair]
    assert argv[0::2] == ["--artifact", "--artifact-inputs"]
    parsed = parse_args(["--instance-type", "t", *argv])
    assert parsed.artifacts == (with_inputs,)
    assert with_inputs.to_json()["inputs"][1] == {
        "name": "ids",
        "datatype": "INT64",
        "shape": [-1, 2],
    }
    assert "inputs" not in ref.to_json() and ref.worker_options() == [("--artifact", ref.to_arg())]


@pytest.mark.parametrize(
    "wrong",
    [
        ["--artifact", artifact_arg("a"), "--artifact-inputs", "b=[]"],
        ["--artifact", artifact_arg("a"), "--artifact-inputs", "a=[]"],
        ["--artifact", artifact_arg("a"), "--artifact-inputs", "a:x"],
        ["--artifact", artifact_arg("a"), "--artifact-inputs", 'a=[{"name": "x"}]'],
        ["--artifact", "a:tabular:3:onnx"],
        ["--artifact", f"a:tabular:x:onnx:{SHA}:file:///m.onnx"],
        ["--artifact", f"a:tabular:3:pickle:{SHA}:file:///m.onnx"],
        ["--artifact", "a:tabular:3:onnx:abc:file:///m.onnx"],
        ["--artifact", f"a:tabular:3:onnx:{SHA}:http://host/m.onnx"],
        ["--artifact", artifact_arg("a"), "--artifact", artifact_arg("a")],
        ["--models", "tiny", "--artifact", artifact_arg("tiny")],
        ["--device", "tpu"],
    ],
)
def test_bad_artifacts_on_the_command_line_are_refused(
    wrong: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--instance-type", "t", *wrong])
    assert exited.value.code == 2
    capsys.readouterr()


# --- the agent with a stand-in model and clock ----------------------------------------------------


class FakeTime:
    """A clock that only moves when the model computes or the agent sleeps."""

    def __init__(self, compute_ms: float) -> None:
        self.now_s = 100.0
        self.compute_ms = compute_ms
        self.slept_s: list[float] = []

    def clock(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.now_s += seconds


class FakeRuntime:
    """A family model that takes ``compute_ms`` of fake time and answers logits whose class is
    ``label`` for every row."""

    platform = "fake"

    def __init__(self, times: FakeTime, label: int) -> None:
        self.signature = FAMILY_SIGNATURE
        self.times = times
        self.label = label
        self.batches: list[np.ndarray] = []

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.times.now_s += self.times.compute_ms / 1000.0
        batch = inputs["input"]
        self.batches.append(batch)
        logits = np.zeros((len(batch), 10), dtype=np.float32)
        logits[:, self.label] = 1.0
        return {"logits": logits}


def ready_agent(times: FakeTime, emulation: Emulation, **changes: Any) -> WorkerAgent:
    worker = WorkerAgent(
        config(worker_id="w-1", **changes), emulation, sleep=times.sleep, clock=times.clock
    )
    worker.set_models({"tiny": FakeRuntime(times, 3), "large": FakeRuntime(times, 7)})
    return worker


def test_an_answer_is_the_models_outputs_and_the_serving_parameters() -> None:
    times = FakeTime(compute_ms=2.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", 0.5), speed_factor=0.5)
    answer = worker.infer("large", infer_body(2, id="q-7"))
    assert answer["model_name"] == "large" and answer["model_version"] == "1"
    assert answer["id"] == "q-7"
    (logits,) = answer["outputs"]
    assert (logits["name"], logits["datatype"], logits["shape"]) == ("logits", "FP32", [2, 10])
    assert np.argmax(np.reshape(logits["data"], (2, 10)), axis=1).tolist() == [7, 7]
    parameters = answer["parameters"]
    assert set(parameters) == {
        "instance_type",
        "served_ms",
        "latency_ms",
        "padded_ms",
        "queued_ms",
        "emulated",
        "emulated_ms",
        "emulation_source",
    }
    assert parameters["latency_ms"] == pytest.approx(2.0)
    assert parameters["padded_ms"] == pytest.approx(2.0)
    assert parameters["served_ms"] == pytest.approx(4.0)
    assert parameters["emulated_ms"] == pytest.approx(4.0)
    assert parameters["queued_ms"] == 0.0
    assert parameters["emulated"] is True and parameters["instance_type"] == "emu.cpu.small"
    assert parameters["emulation_source"] == "measured"
    assert times.slept_s == [pytest.approx(0.002)]
    assert "id" not in worker.infer("large", infer_body(1))


def test_the_batch_reaches_the_model_as_float32_rows() -> None:
    times = FakeTime(compute_ms=1.0)
    worker = WorkerAgent(config(), Emulation("emu.cpu.small", None), clock=times.clock)
    model = FakeRuntime(times, 0)
    worker.set_models({"tiny": model})
    nested = {"name": "input", "shape": [2, 64], "datatype": "FP32", "data": rows(2, 16)}
    worker.infer("tiny", body({"inputs": [nested]}))
    (batch,) = model.batches
    assert batch.dtype == np.float32 and batch.shape == (2, 64) and batch.max() == 16.0


def test_a_batch_in_binary_tensors_reaches_the_model_as_its_values() -> None:
    """The dispatcher's encoding (Triton's binary tensors, :meth:`ModelIO.encode`) read by the
    agent: the same float32 rows; sizes that do not add up, NaN, a header length past the body
    are 400s naming what is wrong."""
    times = FakeTime(compute_ms=1.0)
    worker = WorkerAgent(config(), Emulation("emu.cpu.small", None), clock=times.clock)
    model = FakeRuntime(times, 0)
    worker.set_models({"tiny": model})
    values = np.random.default_rng(3).normal(size=(2, 64)).astype(np.float32)
    encoded, header_length = ModelIO("tiny").encode(list(values))
    answer = worker.infer("tiny", encoded, str(header_length))
    assert answer["outputs"][0]["shape"] == [2, 10]
    (batch,) = model.batches
    assert batch.dtype == np.float32 and np.array_equal(batch, values)
    nan = values.copy()
    nan[1, 5] = np.nan
    bad_body, bad_length = binary_request_body([("input", "FP32", nan)])
    for body_bytes, length, fragment in [
        (encoded[:-4], str(header_length), "ends before its 512 bytes"),
        (encoded + b"xyzw", str(header_length), "4 bytes no input claims"),
        (encoded, str(len(encoded) + 1), "not a size within the body"),
        (encoded, "seven", "not a size within the body"),
        (bad_body, str(bad_length), "a value is NaN: FP32 inputs must be finite"),
    ]:
        with pytest.raises(RequestError) as refused:
            worker.infer("tiny", body_bytes, length)
        assert refused.value.status == 400 and fragment in str(refused.value)
    assert len(model.batches) == 1


def test_http_takes_binary_tensors_by_their_header(server: str) -> None:
    import http.client

    host, port = server.removeprefix("http://").split(":")
    encoded, header_length = ModelIO("tiny").encode([[1.0] * 64, [2.0] * 64, [3.0] * 64])
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        headers = {
            "Content-Type": "application/octet-stream",
            HEADER_LENGTH: str(header_length),
        }
        connection.request("POST", "/v2/models/tiny/infer", body=encoded, headers=headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200 and answer["outputs"][0]["shape"] == [3, 10]
        # Without the header the same bytes are not JSON: a 400, and the connection still serves.
        connection.request("POST", "/v2/models/tiny/infer", body=encoded)
        response = connection.getresponse()
        assert response.status == 400 and "not JSON" in json.loads(response.read())["error"]
    finally:
        connection.close()


def test_a_worker_that_emulates_nothing_never_sleeps() -> None:
    times = FakeTime(compute_ms=5.0)
    worker = ready_agent(times, Emulation("g4dn.xlarge", None), instance_type="g4dn.xlarge")
    parameters = worker.infer("tiny", infer_body(1))["parameters"]
    assert (parameters["latency_ms"], parameters["padded_ms"], parameters["served_ms"]) == (
        5.0,
        0.0,
        5.0,
    )
    assert parameters["emulated"] is False and parameters["emulated_ms"] is None
    assert times.slept_s == []


def test_requests_that_do_not_fit_the_signature_are_400_naming_the_input() -> None:
    worker = ready_agent(FakeTime(1.0), Emulation("emu.cpu.small", None))
    bad_shape = {"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [1.0] * 63}
    bad_type = {"name": "input", "shape": [1, 64], "datatype": "INT64", "data": [1] * 64}
    for document, fragment in [
        ({"inputs": [bad_shape]}, "does not fit [-1, 64]"),
        ({"inputs": [bad_type]}, "datatype 'INT64', expected 'FP32'"),
        ({"inputs": [{**bad_shape, "name": "pixels"}]}, "input 'pixels' is not an input"),
    ]:
        with pytest.raises(RequestError) as refused:
            worker.infer("tiny", body(document))
        assert refused.value.status == 400
        assert fragment in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(RequestError) as not_json:
        worker.infer("tiny", b"{")
    assert not_json.value.status == 400
    small = WorkerAgent(config(max_batch_size=4), Emulation("emu.cpu.small", None))
    small.set_models({"tiny": FakeRuntime(FakeTime(1.0), 0)})
    with pytest.raises(RequestError, match=r"outside 1\.\.4"):
        small.infer("tiny", infer_body(5))


def test_an_unknown_model_is_404_and_a_failing_model_500() -> None:
    times = FakeTime(1.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", None))
    with pytest.raises(RequestError) as unknown:
        worker.infer("medium", infer_body(1))
    assert unknown.value.status == 404 and "large, tiny" in str(unknown.value)
    with pytest.raises(RequestError) as metadata:
        worker.metadata("medium")
    assert metadata.value.status == 404

    class Broken(FakeRuntime):
        def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            raise RuntimeError("device-side assert triggered\ninside the graph")

    worker.set_models({"tiny": Broken(times, 0)})
    for n in (1, 3):
        with pytest.raises(RequestError) as failed:
            worker.infer("tiny", infer_body(n))
        assert failed.value.status == 500 and str(failed.value).endswith("assert triggered")
        assert failed.value.failed_rows == list(range(n))  # every row fails alone too


class Poisoned(FakeRuntime):
    """Raises, as an embedding does on a token outside its vocabulary, on any batch holding a
    row whose first value is over 16; ``max_batch`` > 0: also on any batch larger than it."""

    def __init__(self, times: FakeTime, max_batch: int = 0) -> None:
        super().__init__(times, 3)
        self.max_batch = max_batch

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = inputs["input"]
        if (batch[:, 0] > 16).any():
            raise IndexError("index out of range in self")
        if self.max_batch and len(batch) > self.max_batch:
            raise RuntimeError("out of memory")
        return super().run(inputs)


def test_a_bad_row_fails_alone_and_is_named_with_a_422() -> None:
    times = FakeTime(1.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", None))
    model = Poisoned(times)
    worker.set_models({"tiny": model})
    data = [1.0] * 64 * 3
    data[64] = 999.0  # row 1's first value: out of the vocabulary
    tensor = {"name": "input", "shape": [3, 64], "datatype": "FP32", "data": data}
    with pytest.raises(RequestError) as refused:
        worker.infer("tiny", body({"inputs": [tensor]}))
    assert refused.value.status == 422 and refused.value.failed_rows == [1]
    assert "1 of 3 rows: index out of range" in str(refused.value)
    # The batch, then each row alone: the model saw the good rows and the bad one.
    assert [len(b) for b in model.batches] == [1, 1]
    # The worker still serves, and a query alone that the model raises on is a 422 too.
    assert worker.health()[0] == 200
    with pytest.raises(RequestError) as alone:
        worker.infer("tiny", infer_body(1, value=999.0))
    assert (alone.value.status, alone.value.failed_rows) == (422, [0])


def test_rows_alone_stop_at_half_the_callers_timeout_and_name_no_rows() -> None:
    """A slow model (20 ms a call) fails a batch of 100 rows on its last one: run again row by
    row, the rows took 2 s, past the dispatcher's call of 1 s, which took the worker for hung
    over a bad row. Within the caller's timeout (parameters.timeout), the rows run alone for
    half of it at most; then the answer names no rows (the dispatcher tries each query alone),
    and a 422 since rows passed."""
    times = FakeTime(20.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", None))
    model = Poisoned(times)
    worker.set_models({"tiny": model})
    data = [1.0] * 64 * 100
    data[64 * 99] = 999.0  # the last row: out of the vocabulary
    tensor = {"name": "input", "shape": [100, 64], "datatype": "FP32", "data": data}
    started = times.now_s
    with pytest.raises(RequestError) as refused:
        worker.infer("tiny", {"inputs": [tensor], "parameters": {"timeout": 1_000_000}})
    assert refused.value.status == 422 and refused.value.failed_rows is None
    assert times.now_s - started <= 0.5 + 0.02  # half the timeout, and the row in hand
    assert "run again alone before half the caller's timeout" in str(refused.value)
    # Without a timeout (a direct caller), every row runs alone and the bad one is named.
    with pytest.raises(RequestError) as named:
        worker.infer("tiny", {"inputs": [tensor]})
    assert named.value.failed_rows == [99]


def test_a_batch_whose_rows_pass_alone_is_answered_row_by_row() -> None:
    times = FakeTime(1.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", None))
    worker.set_models({"tiny": Poisoned(times, max_batch=2)})
    answer = worker.infer("tiny", infer_body(4))
    (logits,) = answer["outputs"]
    assert logits["shape"] == [4, 10]
    assert np.argmax(np.reshape(logits["data"], (4, 10)), axis=1).tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize(
    ("error", "at_fault"),
    [
        (IndexError("index out of range in self"), True),
        (ValueError("bad value"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x3 and 4x2)"), True),
        (type("InvalidArgument", (Exception,), {})("[ONNXRuntimeError] : 2"), True),
        (RuntimeError("indices element out of data bounds, idx=100"), True),
        (RuntimeError("CUDA out of memory"), False),
        (MemoryError(), False),
    ],
)
def test_input_at_fault_reads_the_models_error(error: Exception, at_fault: bool) -> None:
    assert input_at_fault(error) is at_fault


def _torchscript_error(raises: str) -> Exception:
    """The error a scripted TorchScript model raises: ``raises`` is ``value`` (a ``raise
    ValueError`` in the model's code) or ``internal`` (a ``RuntimeError`` whose code beside it
    reads ``x.shape``)."""
    torch = pytest.importorskip("torch")

    class RaisesValueError(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool((x < 100.0).all()):
                raise ValueError("a value under 100")
            return x

    class FailsInside(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 0:
                raise RuntimeError("internal failure")
            return x

    model = torch.jit.script(RaisesValueError() if raises == "value" else FailsInside())
    try:
        model(torch.zeros((1, 4)))
    except Exception as error:
        return error
    raise AssertionError("the model did not raise")


@pytest.mark.parametrize(("raises", "at_fault"), [("value", True), ("internal", False)])
def test_input_at_fault_reads_a_torchscript_error_by_the_error_it_ends_with(
    raises: str, at_fault: bool
) -> None:
    # A TorchScript error's text quotes the model's code: a `raise ValueError` there is the
    # inputs' fault (as in Python), and a `x.shape` in the code beside a RuntimeError is no
    # shape error (the words were read in the code).
    error = _torchscript_error(raises)
    assert input_at_fault(error) is at_fault


def test_stats_count_requests_rows_and_latency_per_model() -> None:
    times = FakeTime(compute_ms=2.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", 0.5), speed_factor=0.5)
    for n in (1, 3):
        worker.infer("tiny", infer_body(n))
    stats = worker.stats()
    assert stats["models"]["tiny"]["requests"] == 2
    assert stats["models"]["tiny"]["rows"] == 4
    assert stats["models"]["tiny"]["latency_ms"]["p50"] == pytest.approx(2.0)
    assert stats["models"]["tiny"]["served_ms"]["max"] == pytest.approx(4.0)
    assert stats["models"]["large"]["requests"] == 0
    assert stats["models"]["large"]["latency_ms"]["p99"] is None
    assert stats["emulated"] is True and stats["instance_type"] == "emu.cpu.small"


def test_health_follows_the_lifecycle_and_only_a_ready_worker_serves() -> None:
    times = FakeTime(compute_ms=1.0)
    worker = WorkerAgent(config(worker_id="w-1"), Emulation("emu.cpu.small", None))
    status, health = worker.health()
    assert (status, health["status"], health["worker_id"]) == (503, "loading", "w-1")
    assert worker.ready() == (503, {"ready": False, "status": "loading"})
    for call_route in (
        lambda: worker.infer("tiny", infer_body(1)),
        lambda: worker.metadata("tiny"),
        lambda: worker.model_ready("tiny"),
    ):
        with pytest.raises(RequestError) as loading:
            call_route()
        assert loading.value.status == 503
    worker.set_models({"tiny": FakeRuntime(times, 1), "large": FakeRuntime(times, 2)})
    status, health = worker.health()
    assert (status, health["status"], health["models"]) == (200, "ok", ["tiny", "large"])
    assert health["artifacts"] == []
    assert worker.ready() == (
        200,
        {"ready": True, "busy": False, "in_flight": 0, "busy_s": 0.0, "busy_timeout_s": None},
    )
    assert worker.model_ready("tiny") == {"name": "tiny", "ready": True}
    assert worker.metadata("tiny")["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 64]}
    ]
    worker.stop()
    assert worker.health()[0] == 503 and worker.health()[1]["status"] == "stopping"
    with pytest.raises(RequestError):
        worker.infer("tiny", infer_body(1))
    assert worker.drain(0.0)
    broken = WorkerAgent(config(), Emulation("emu.cpu.small", None))
    broken.fail("cannot load\nthe models")
    assert broken.health()[0] == 503 and broken.health()[1]["status"] == "failed"
    assert broken.health()[1]["error"] == "cannot load the models"
    assert broken.ready()[1] == {
        "ready": False,
        "status": "failed",
        "error": "cannot load the models",
    }


class Blocking(FakeRuntime):
    """A family model whose batches wait for ``go`` (a slow query still running)."""

    def __init__(self, times: FakeTime) -> None:
        super().__init__(times, 3)
        self.go = threading.Event()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.go.wait(30.0), "never let go"
        return super().run(inputs)


def test_health_says_whether_a_batch_is_under_way_and_since_when() -> None:
    """A batch running (and one waiting for it) make the agent busy in both health answers,
    with the age of the oldest and how long its caller waits for it (its
    ``parameters.timeout``); once they end it is not. The dispatcher reads it of a worker back
    from a timed-out call: busy, it is not sent work; the liveness probe of a stuck one."""
    times = FakeTime(compute_ms=1.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", None))
    model = Blocking(times)
    worker.set_models({"tiny": model})
    idle = {"busy": False, "in_flight": 0, "busy_s": 0.0, "busy_timeout_s": None}
    assert worker.ready() == (200, {"ready": True, **idle})
    with ThreadPoolExecutor(2) as pool:
        timed = infer_body(1, parameters={"timeout": 4_000_000})  # 4 s, in microseconds
        first = pool.submit(worker.infer, "tiny", timed)
        deadline = time.monotonic() + 30.0
        while worker.ready()[1]["in_flight"] < 1:
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.01)
        times.now_s += 2.5
        second = pool.submit(worker.infer, "tiny", infer_body(1))
        while worker.ready()[1]["in_flight"] < 2:
            assert time.monotonic() < deadline, "the second batch never arrived"
            time.sleep(0.01)
        busy = {"busy": True, "in_flight": 2, "busy_s": 2.5, "busy_timeout_s": 4.0}
        assert worker.ready() == (200, {"ready": True, **busy})
        status, health = worker.health()
        assert status == 200 and {k: health[k] for k in busy} == busy
        model.go.set()
        first.result(30.0)
        second.result(30.0)
    assert worker.ready() == (200, {"ready": True, **idle})
    assert {k: worker.health()[1][k] for k in idle} == idle


def test_health_answers_when_two_batches_arrive_at_the_same_instant() -> None:
    """Two batches in flight that arrived on the same clock reading, one whose caller said no
    timeout and one that did: health still answers, with the first one's (the batches'
    arrivals had been compared whole, a timeout against None: a TypeError, no health answer)."""
    times = FakeTime(compute_ms=1.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", None))
    model = Blocking(times)
    worker.set_models({"tiny": model})
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(worker.infer, "tiny", infer_body(1))  # no timeout said
        deadline = time.monotonic() + 30.0
        while worker.ready()[1]["in_flight"] < 1:
            assert time.monotonic() < deadline, "the batch never started"
            time.sleep(0.01)
        timed = infer_body(1, parameters={"timeout": 4_000_000})  # same instant: the clock stays
        second = pool.submit(worker.infer, "tiny", timed)
        try:
            while worker.busy()["in_flight"] < 2:
                assert time.monotonic() < deadline, "the second batch never arrived"
                time.sleep(0.01)
            busy = {"busy": True, "in_flight": 2, "busy_s": 0.0, "busy_timeout_s": None}
            assert worker.ready() == (200, {"ready": True, **busy})
            status, health = worker.health()
            assert status == 200 and {k: health[k] for k in busy} == busy
        finally:
            model.go.set()
        first.result(30.0)
        second.result(30.0)


# --- HTTP, in-process -----------------------------------------------------------------------------


@contextlib.contextmanager
def serving(worker: WorkerAgent) -> Iterator[str]:
    """The agent's HTTP server for ``worker`` on a free loopback port."""
    http = agent._Server(("127.0.0.1", 0), worker, None)
    thread = threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}"
    finally:
        http.shutdown()
        http.server_close()
        thread.join()


@pytest.fixture
def server() -> Iterator[str]:
    """The agent's HTTP server on a free loopback port, serving stand-in models."""
    times = FakeTime(compute_ms=1.0)
    with serving(ready_agent(times, Emulation("emu.cpu.small", 0.5), speed_factor=0.5)) as url:
        yield url


def call(url: str, data: bytes | None = None, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(url, data=data, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_http_routes_and_their_errors(server: str) -> None:
    assert call(f"{server}/health")[0] == 200
    assert call(f"{server}/v2/health/live") == (200, {"live": True})
    assert call(f"{server}/v2/health/ready") == (
        200,
        {"ready": True, "busy": False, "in_flight": 0, "busy_s": 0.0, "busy_timeout_s": None},
    )
    assert call(f"{server}/v2/models/tiny/ready") == (200, {"name": "tiny", "ready": True})
    status, metadata = call(f"{server}/v2/models/tiny")
    assert status == 200 and metadata["versions"] == ["1"] and metadata["platform"] == "fake"
    status, answer = call(f"{server}/v2/models/tiny/infer", infer_body(2), "POST")
    assert status == 200 and answer["outputs"][0]["shape"] == [2, 10]
    assert answer["parameters"]["padded_ms"] > 0
    status, answer = call(f"{server}/v2/models/large/versions/1/infer", infer_body(1), "POST")
    assert status == 200 and answer["model_name"] == "large"
    status, stats = call(f"{server}/stats")
    assert status == 200 and stats["models"]["tiny"]["requests"] == 1
    status, error = call(f"{server}/v2/models/tiny/infer", b"{", "POST")
    assert status == 400 and set(error) == {"error"}
    assert call(f"{server}/v2/models/x/infer", infer_body(1), "POST")[0] == 404
    assert call(f"{server}/v2/models/x")[0] == 404
    assert call(f"{server}/v2/models/tiny/versions/2/infer", infer_body(1), "POST")[0] == 404
    status, gone = call(f"{server}/infer", infer_body(1), "POST")
    assert status == 404 and "/v2/models/{model}/infer" in gone["error"]
    assert call(f"{server}/nowhere")[0] == 404
    assert call(f"{server}/elsewhere", b"{}", "POST")[0] == 404
    assert call(f"{server}/v2/models/tiny/infer")[0] == 405
    assert call(f"{server}/health", b"{}", "POST")[0] == 405
    assert call(f"{server}/v2/models/tiny", b"{}", "POST")[0] == 405


def test_http_refuses_an_oversized_body_before_reading_it(server: str) -> None:
    import http.client

    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.putrequest("POST", "/v2/models/tiny/infer")
        connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413
        assert "over the limit" in json.loads(response.read())["error"]
    finally:
        connection.close()


# --- real artifacts -------------------------------------------------------------------------------


def file_ref(name: str, path: Path, fmt: str, sha256: str | None = None) -> ArtifactRef:
    return ArtifactRef(name, "tabular", 1, fmt, sha256 or file_sha256(path), path.as_uri())


def test_artifacts_are_fetched_loaded_and_served_over_http(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from tests.unit.worker_models import (
        export_onnx,
        export_torchscript,
        sample_inputs,
        tabular_model,
        torch_outputs,
    )

    model = tabular_model()
    refs = (
        file_ref("fraud", export_onnx(model, tmp_path / "m.onnx"), "onnx"),
        file_ref("fraud-ts", export_torchscript(model, tmp_path / "m.pt"), "torchscript"),
    )
    settings = config(models=("fraud", "fraud-ts"), artifacts=refs, cache_dir=tmp_path / "cache")
    assert settings.family_models == ()
    runtimes = load_models(settings, tmp_path / "artifacts")
    worker = WorkerAgent(settings, Emulation("emu.cpu.small", None))
    worker.set_models(runtimes)
    inputs = sample_inputs(4)
    expected = torch_outputs(model, inputs)
    request = {
        "id": "r-1",
        "inputs": [
            {"name": "input", "shape": [4, 13], "datatype": "FP32", "data": inputs.tolist()}
        ],
    }
    with serving(worker) as url:
        status, metadata = call(f"{url}/v2/models/fraud")
        assert status == 200 and metadata["platform"] == "onnxruntime_onnx"
        assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}]
        for name, output in (("fraud", "logits"), ("fraud-ts", "output0")):
            status, answer = call(f"{url}/v2/models/{name}/infer", body(request), "POST")
            assert status == 200 and answer["id"] == "r-1"
            (tensor,) = answer["outputs"]
            assert (tensor["name"], tensor["shape"]) == (output, [4, 3])
            np.testing.assert_allclose(np.reshape(tensor["data"], (4, 3)), expected, atol=1e-5)
        wrong = {
            "inputs": [{"name": "input", "shape": [1, 12], "datatype": "FP32", "data": [0] * 12}]
        }
        status, error = call(f"{url}/v2/models/fraud/infer", body(wrong), "POST")
        assert status == 400 and "input 'input'" in error["error"]
        status, health = call(f"{url}/health")
        assert [a["name"] for a in health["artifacts"]] == ["fraud", "fraud-ts"]


def test_an_artifact_that_cannot_be_fetched_or_loaded_fails_the_worker(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    text = tmp_path / "notes.onnx"
    text.write_text("not a model\n")
    cases = [
        (file_ref("m", text, "onnx", sha256=SHA), "sha256"),
        (file_ref("m", tmp_path / "absent.onnx", "onnx", sha256=SHA), "no file"),
        (file_ref("m", text, "onnx"), "is not an ONNX model"),
    ]
    for ref, fragment in cases:
        settings = config(models=("m",), artifacts=(ref,))
        with pytest.raises(LoadFailedError, match=fragment) as refused:
            load_models(settings, tmp_path / "artifacts")
        assert str(refused.value).startswith("model m (tabular v1): ")
        # As the worker's loader reports it: health 503 'failed', one line, the loop told.
        worker = WorkerAgent(settings, Emulation("emu.cpu.small", None))
        failed = threading.Event()
        agent._load(worker, settings, tmp_path / "artifacts", failed)
        status, health = worker.health()
        assert failed.is_set() and status == 503 and health["status"] == "failed"
        assert fragment in health["error"] and "\n" not in health["error"]


# --- the local provisioner's worker command -------------------------------------------------------


def test_the_local_provisioner_starts_artifact_workers_with_artifact_args(tmp_path: Path) -> None:
    provisioner = LocalProvisioner(
        tmp_path / "state", {"emu.cpu.small": 0.5}, ["tiny", "large"], tmp_path / "cache"
    )
    refs = (
        ArtifactRef.from_arg(artifact_arg("fraud")),
        ArtifactRef.from_arg(artifact_arg("fraud-big", "big", "torchscript")),
    )
    request = LaunchRequest("r-1", "emu.cpu.small", 1, {}, artifacts=refs)
    command = provisioner._command("w-1", "emu.cpu.small", 0.5, 7, request.artifacts)
    assert command[1:3] == ["-m", "provisioners.worker"]
    assert "--models" not in command
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--artifact"] == [
        ref.to_arg() for ref in refs
    ]
    parsed = parse_args(command[3:])
    assert parsed.artifacts == refs and parsed.models == ("fraud", "fraud-big")
    assert parsed.cache_dir == (tmp_path / "cache").resolve()
    family = provisioner._command("w-2", "emu.cpu.small", 0.5, 7)
    assert "--artifact" not in family
    assert parse_args(family[3:]).models == ("tiny", "large")


def test_the_family_is_served_without_importing_torch(trained_family: Path, tmp_path: Path) -> None:
    """A worker of a trained family loads the models' arrays, not torch (seconds of a core per
    worker); its answers are the records' predictions."""
    script = f"""
import sys
from pathlib import Path
import numpy as np
from provisioners.worker.agent import AgentConfig, load_models
from provisioners.worker.family import load_split
settings = AgentConfig("127.0.0.1", 0, "emu.cpu.small", ("tiny", "large"),
                       cache_dir=Path({str(trained_family)!r}))
runtimes = load_models(settings, Path({str(tmp_path)!r}))
pixels = np.asarray(load_split().validation_inputs[:50])
for name in ("tiny", "large"):
    print(name, *runtimes[name].run({{"input": pixels}})["logits"].argmax(axis=1))
print("torch imported:", "torch" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "torch imported: False"
    records = json.loads((trained_family / "validation.json").read_text())
    predicted = {entry["name"]: entry["predictions"][:50] for entry in records["models"]}
    for line in lines[:-1]:
        name, *classes = line.split()
        assert [int(c) for c in classes] == predicted[name]
