"""The worker agent without processes: request validation, the padding arithmetic, the compute
and profile curves, the agent's responses with a stand-in model and clock, and its HTTP routes
in-process."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estimator.profiles import LatencyProfile, write_profiles_json
from provisioners.worker import agent
from provisioners.worker.agent import (
    MAX_BODY_BYTES,
    AgentConfig,
    RequestError,
    WorkerAgent,
    build_emulation,
    latency_summary,
    parse_args,
    parse_infer_request,
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

MODELS = ("tiny", "large")


def body(document: Any) -> bytes:
    return json.dumps(document).encode()


def rows(n: int, value: float = 1.0) -> list[list[float]]:
    return [[value] * 64 for _ in range(n)]


# --- request validation ---------------------------------------------------------------------------


def test_a_valid_request_becomes_one_float32_batch() -> None:
    request = parse_infer_request(body({"model": "tiny", "inputs": rows(3, 16)}), MODELS)
    assert request.model == "tiny"
    assert request.batch_size == 3
    assert request.inputs.dtype == np.float32 and request.inputs.shape == (3, 64)
    mixed = [[0, 1.5] * 32]  # integers and floats mix
    assert parse_infer_request(body({"model": "large", "inputs": mixed}), MODELS).batch_size == 1


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"not json", "not JSON"),
        (b'{"model": "tiny", "inputs": [[NaN]]}', "NaN is not a number"),
        (b"\xff\xfe", "not JSON"),
        (body([1, 2]), "JSON object"),
        (body({"model": "tiny", "inputs": rows(1), "extra": 1}), "unknown keys: extra"),
        (body({"inputs": rows(1)}), "'model'"),
        (body({"model": 3, "inputs": rows(1)}), "'model'"),
        (body({"model": "tiny"}), "'inputs'"),
        (body({"model": "tiny", "inputs": []}), "'inputs'"),
        (body({"model": "tiny", "inputs": [[1.0] * 63]}), "64 numbers"),
        (body({"model": "tiny", "inputs": [1.0] * 64}), "64 numbers"),
        (body({"model": "tiny", "inputs": [["1"] * 64]}), "64 numbers"),
        (body({"model": "tiny", "inputs": [[True] * 64]}), "64 numbers"),
        (body({"model": "tiny", "inputs": [[None] * 64]}), "64 numbers"),
        (body({"model": "tiny", "inputs": [[[1.0]] * 64]}), "64 numbers"),
        (body({"model": "tiny", "inputs": rows(1, 16.5)}), "0..16"),
        (body({"model": "tiny", "inputs": rows(1, -0.1)}), "0..16"),
        (body({"model": "tiny", "inputs": [[1e39] * 64]}), "0..16"),
    ],
)
def test_malformed_requests_are_400_with_one_line(raw: bytes, fragment: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_infer_request(raw, MODELS)
    assert refused.value.status == 400
    assert fragment in str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_unknown_model_is_404_and_an_oversized_batch_400() -> None:
    with pytest.raises(RequestError) as unknown:
        parse_infer_request(body({"model": "medium", "inputs": rows(1)}), MODELS)
    assert unknown.value.status == 404
    assert "large, tiny" in str(unknown.value)
    with pytest.raises(RequestError) as big:
        parse_infer_request(body({"model": "tiny", "inputs": rows(5)}), MODELS, max_batch_size=4)
    assert big.value.status == 400 and "over the limit 4" in str(big.value)


def test_the_agent_agrees_with_the_family_on_the_input_shape() -> None:
    pytest.importorskip("torch")
    from provisioners.worker import family

    assert (agent.N_FEATURES, agent.PIXEL_MAX) == (family.N_FEATURES, family.PIXEL_MAX)
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

    def predict(self, model: Any, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.now_s += self.compute_ms / 1000.0
        n = len(inputs)
        return np.full(n, model, dtype=np.int64), np.linspace(0.0, 1.0, n)


def ready_agent(times: FakeTime, emulation: Emulation, **changes: Any) -> WorkerAgent:
    worker = WorkerAgent(
        config(worker_id="w-1", **changes), emulation, sleep=times.sleep, clock=times.clock
    )
    worker.set_models({"tiny": 3, "large": 7}, times.predict)
    return worker


def test_an_emulated_slow_type_pads_each_batch_to_its_latency() -> None:
    times = FakeTime(compute_ms=2.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", 0.5), speed_factor=0.5)
    answer = worker.infer(body({"model": "large", "inputs": rows(2)}))
    assert answer["predictions"] == [7, 7]
    assert answer["certainty"] == [0.0, 1.0]
    assert answer["batch_size"] == 2
    assert answer["latency_ms"] == pytest.approx(2.0)
    assert answer["padded_ms"] == pytest.approx(2.0)
    assert answer["served_ms"] == pytest.approx(4.0)
    assert answer["emulated_ms"] == pytest.approx(4.0)
    assert answer["queued_ms"] == 0.0
    assert answer["emulated"] is True and answer["instance_type"] == "emu.cpu.small"
    assert times.slept_s == [pytest.approx(0.002)]


def test_a_worker_that_emulates_nothing_never_sleeps() -> None:
    times = FakeTime(compute_ms=5.0)
    worker = ready_agent(times, Emulation("g4dn.xlarge", None), instance_type="g4dn.xlarge")
    answer = worker.infer(body({"model": "tiny", "inputs": rows(1)}))
    assert (answer["latency_ms"], answer["padded_ms"], answer["served_ms"]) == (5.0, 0.0, 5.0)
    assert answer["emulated"] is False and answer["emulated_ms"] is None
    assert times.slept_s == []


def test_stats_count_requests_rows_and_latency_per_model() -> None:
    times = FakeTime(compute_ms=2.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", 0.5), speed_factor=0.5)
    for n in (1, 3):
        worker.infer(body({"model": "tiny", "inputs": rows(n)}))
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
    with pytest.raises(RequestError) as loading:
        worker.infer(body({"model": "tiny", "inputs": rows(1)}))
    assert loading.value.status == 503
    worker.set_models({"tiny": 1, "large": 2}, times.predict)
    status, health = worker.health()
    assert (status, health["status"], health["models"]) == (200, "ok", ["tiny", "large"])
    worker.stop()
    assert worker.health()[0] == 503 and worker.health()[1]["status"] == "stopping"
    with pytest.raises(RequestError):
        worker.infer(body({"model": "tiny", "inputs": rows(1)}))
    assert worker.drain(0.0)
    broken = WorkerAgent(config(), Emulation("emu.cpu.small", None))
    broken.fail("cannot load\nthe models")
    assert broken.health()[0] == 503 and broken.health()[1]["status"] == "failed"
    assert broken.health()[1]["error"] == "cannot load the models"


# --- HTTP, in-process -----------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[str]:
    """The agent's HTTP server on a free loopback port, serving a stand-in model."""
    times = FakeTime(compute_ms=1.0)
    worker = ready_agent(times, Emulation("emu.cpu.small", 0.5), speed_factor=0.5)
    http = agent._Server(("127.0.0.1", 0), worker, None)
    thread = threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}"
    finally:
        http.shutdown()
        http.server_close()
        thread.join()


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
    status, answer = call(f"{server}/infer", body({"model": "tiny", "inputs": rows(2)}), "POST")
    assert status == 200 and answer["predictions"] == [3, 3] and answer["padded_ms"] > 0
    status, stats = call(f"{server}/stats")
    assert status == 200 and stats["models"]["tiny"]["requests"] == 1
    status, error = call(f"{server}/infer", b"{", "POST")
    assert status == 400 and set(error) == {"error"}
    assert call(f"{server}/infer", body({"model": "x", "inputs": rows(1)}), "POST")[0] == 404
    assert call(f"{server}/nowhere")[0] == 404
    assert call(f"{server}/elsewhere", b"{}", "POST")[0] == 404
    assert call(f"{server}/infer")[0] == 405
    assert call(f"{server}/health", b"{}", "POST")[0] == 405


def test_http_refuses_an_oversized_body_before_reading_it(server: str) -> None:
    import http.client

    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.putrequest("POST", "/infer")
        connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413
        assert "over the limit" in json.loads(response.read())["error"]
    finally:
        connection.close()
