"""The load generator against a tiny fake service on 127.0.0.1: which samples a query carries,
the open-loop schedule (in virtual time), the summary's statistics, the ``--json`` contract and
one-line refusals of bad input.

The fake service is ``http.server`` in a thread. It answers ``GET /v1/apps/{app}``, ``GET
/v2/models/{app}`` (the app's inputs: the demo's, 64 pixels, unless a test says otherwise) and
``POST /v1/apps/{app}/infer``; what an inference request gets is chosen by its first sample id
(:data:`SCRIPT`). Nothing here sleeps or asserts on how long anything took.
"""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.clients import loadgen
from controlplane.clients.loadgen import (
    LoadProgress,
    QueryResult,
    build_queries,
    sample_rows,
    summarise,
)
from estimator.traces import Trace, write_trace_csv

TOKEN = "hp_admin-token"
INFER_TOKEN = "hp_infer-token"
APP = "demo"
SLO_MS = 100.0
N_FEATURES = 64
# First sample id of a request -> what the fake service does with it.
SCRIPT = {7: "429", 8: "503", 9: "not-json", 10: "drop", 11: "hang"}
CONTRACT_KEYS = {
    "sent",
    "answered",
    "errors",
    "p50_ms",
    "p99_ms",
    "attainment",
    "achieved_qps",
    "errors_by_kind",
    "send_lag_p99_ms",
    "outside_p50_ms",
    "outside_p99_ms",
    "queue_p50_ms",
    "queue_p99_ms",
    "late_by_service",
    "error_examples",
}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # an open loop's burst of connections (the default backlog is 5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up (a stopped run, a timeout): nothing to report


class FakeService:
    """The routes loadgen uses, with a record of every inference request."""

    def __init__(self, validation: Path | None = None) -> None:
        self.validation = validation
        self.inputs: list[dict[str, Any]] = [
            {"name": "input", "datatype": "FP32", "shape": [-1, N_FEATURES]}
        ]
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()  # what a "hang" request waits for
        self.barrier: threading.Barrier | None = None  # answers wait for every request
        self._lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, code: str) -> None:
                self._json(status, {"error": {"code": code, "message": code, "field": None}})

            def _token(self) -> str:
                return self.headers.get("Authorization", "").removeprefix("Bearer ")

            def do_GET(self) -> None:
                if self._token() not in (TOKEN, INFER_TOKEN):
                    return self._error(401, "unauthorized")
                if self.path == f"/v2/models/{APP}/ready":  # the demo load's readiness probe
                    return self._json(200, {"name": APP, "ready": True})
                if self.path == f"/v2/models/{APP}":  # infer scope, as the service's
                    outputs = [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
                    return self._json(
                        200,
                        {"name": APP, "versions": ["1"], "platform": "heteroplane",
                         "inputs": service.inputs, "outputs": outputs},
                    )  # fmt: skip
                if self.path != f"/v1/apps/{APP}":
                    return self._error(404, "not_found")
                if self._token() == INFER_TOKEN:
                    return self._error(403, "forbidden")
                spec: dict[str, Any] = {"name": APP, "slo": {"latency_ms": SLO_MS}}
                if service.validation is not None:
                    spec["validation"] = str(service.validation)
                self._json(200, {"name": APP, "spec": spec})

            def do_POST(self) -> None:
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                except ValueError:  # a request cut short (the client stopped)
                    return self._error(400, "bad_request")
                with service._lock:
                    service.requests.append(body)
                if service.barrier is not None:
                    service.barrier.wait(timeout=30.0)
                if self._token() not in (TOKEN, INFER_TOKEN):
                    return self._error(401, "unauthorized")
                if self.path != f"/v1/apps/{APP}/infer":
                    return self._error(404, "not_found")
                action = SCRIPT.get(body["sample_ids"][0], "ok")
                if action == "429":
                    return self._json(429, {"error": {"code": "overloaded"}}, {"Retry-After": "1"})
                if action == "503":
                    return self._error(503, "no_instance")
                if action == "not-json":
                    data = b"<html>"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return None
                if action == "hang":
                    service.release.wait(timeout=30.0)
                n = len(body["inputs"])
                return self._json(
                    200,
                    {
                        "outputs": [0] * n,
                        "models": ["tiny"] * n,
                        "certainty": [1.0] * n,
                        "gear": "0",
                        "timings": {"queue_ms": 0.25, "service_ms": 0.75, "total_ms": 1.0},
                        "late": body["sample_ids"][0] == 12,
                    },
                )

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeService]:
    service = FakeService()
    try:
        yield service
    finally:
        service.close()


class VirtualTimer:
    """Time that passes only when the run sleeps: a trace of minutes runs at once."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.slept_s = 0.0

    def now(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.now_s += seconds
        self.slept_s += seconds
        await asyncio.sleep(0)


def inputs(n: int = 20) -> np.ndarray:
    return np.arange(n * N_FEATURES, dtype=np.float32).reshape(n, N_FEATURES) % 17


def trace_of(arrivals: list[float], ids: list[int] | None = None) -> Trace:
    batch = np.ones(len(arrivals), dtype=np.int64)
    return Trace(np.array(arrivals), batch, None if ids is None else np.array(ids))


def run(
    queries: list[loadgen.Query], url: str, timer: VirtualTimer | None = None, **options: Any
) -> loadgen.LoadResult:
    async def go() -> loadgen.LoadResult:
        return await loadgen.run_load_async(
            queries, loadgen.infer_url(url, APP), TOKEN, timer=timer, **options
        )

    return asyncio.run(go())


# --- queries -------------------------------------------------------------------------------------


def test_each_row_carries_its_sample_and_the_ones_after_it_for_a_batch() -> None:
    trace = Trace(np.array([0.0, 1.0, 1.0, 2.5]), np.array([1, 3, 1, 2]), np.array([5, 18, 0, 19]))
    assert sample_rows(trace, 20) == [(5,), (18, 19, 0), (0,), (19, 0)]
    without_ids = Trace(np.array([0.0, 1.0, 2.0]), np.array([2, 1, 1]))
    assert sample_rows(without_ids, 2) == [(0, 1), (1,), (0,)]

    queries = build_queries(trace, inputs())
    assert [q.send_at_s for q in queries] == [0.0, 1.0, 1.0, 2.5]
    second = json.loads(queries[1].body)
    assert second["sample_ids"] == [18, 19, 0]
    assert second["inputs"] == [inputs()[s].astype(int).tolist() for s in (18, 19, 0)]
    assert all(isinstance(v, int) for v in second["inputs"][0])


def test_send_times_are_relative_to_the_first_arrival() -> None:
    queries = build_queries(trace_of([10.0, 10.5, 12.0]), inputs())
    assert [q.send_at_s for q in queries] == [0.0, 0.5, 2.0]


def test_a_sample_id_outside_the_validation_set_is_refused() -> None:
    with pytest.raises(ValueError, match="sample_id 20 at row 2 is outside the 20 validation"):
        sample_rows(trace_of([0.0, 1.0], [3, 20]), 20)


# --- the open loop -------------------------------------------------------------------------------


def test_queries_go_out_on_the_schedule_in_virtual_time(fake: FakeService) -> None:
    arrivals = [0.0, 0.5, 0.5, 3.0, 60.0, 61.25]
    timer = VirtualTimer()
    result = run(build_queries(trace_of(arrivals), inputs()), fake.url, timer)
    assert [o.index for o in result.outcomes] == list(range(len(arrivals)))
    assert all(o.answered for o in result.outcomes)
    # Every request left exactly when the trace says (virtual time stands still otherwise).
    assert [o.send_lag_ms for o in result.outcomes] == [0.0] * len(arrivals)
    assert timer.slept_s == pytest.approx(61.25)
    assert result.elapsed_s == pytest.approx(61.25)
    assert sorted(r["sample_ids"][0] for r in fake.requests) == list(range(len(arrivals)))


def test_the_loop_is_open_no_query_waits_for_an_answer(fake: FakeService) -> None:
    # The service answers nothing until it has every request: a closed loop would never get
    # there (and the barrier would break, answering 500s that fail the test).
    n = 8
    fake.barrier = threading.Barrier(n)
    ids = [0, 1, 2, 3, 4, 5, 6, 13]  # none scripted to fail
    queries = build_queries(trace_of([0.1 * i for i in range(n)], ids), inputs())
    result = run(queries, fake.url, VirtualTimer())
    assert [o.kind for o in result.outcomes] == ["ok"] * n
    assert not fake.barrier.broken


def test_errors_are_counted_by_kind(fake: FakeService) -> None:
    ids = [0, 7, 8, 9, 10, 1, 7]
    result = run(build_queries(trace_of([0.0] * len(ids), ids), inputs()), fake.url, VirtualTimer())
    summary = result.summary(SLO_MS)
    assert summary.sent == 7 and summary.answered == 2 and summary.errors == 5
    assert dict(summary.errors_by_kind) == {
        "bad_response": 1,
        "connection": 1,
        "http_429": 2,
        "http_503": 1,
    }
    # What the service said of an error, one per kind (a 429 here says nothing but its code).
    assert dict(summary.error_examples) == {"http_503": "no_instance: no_instance"}
    assert summary.to_json()["error_examples"] == {"http_503": "no_instance: no_instance"}
    # The answers carry the service's time (1 ms): each answered query's outside part is known.
    assert [o.served_ms for o in result.outcomes if o.answered] == [1.0, 1.0]
    assert [o.queued_ms for o in result.outcomes if o.answered] == [0.25, 0.25]
    assert summary.outside_p99_ms is not None and summary.queue_p99_ms == 0.25


def test_a_query_without_an_answer_in_time_is_a_timeout(fake: FakeService) -> None:
    result = run(build_queries(trace_of([0.0, 0.0], [11, 0]), inputs()), fake.url, timeout_s=1.0)
    # The answered query has a second, not 50 ms: on a loaded CI machine 50 ms was missed.
    fake.release.set()
    assert [o.kind for o in result.outcomes] == ["timeout", "ok"]


def test_a_service_that_is_not_there_is_a_connection_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    result = run(build_queries(trace_of([0.0, 1.0]), inputs()), url, VirtualTimer())
    assert [o.kind for o in result.outcomes] == ["connection", "connection"]


def test_progress_is_reported_while_sending_and_at_the_end(fake: FakeService) -> None:
    seen: list[LoadProgress] = []
    arrivals = [float(t) for t in range(0, 30)]
    result = run(
        build_queries(trace_of(arrivals, [0] * 30), inputs()),
        fake.url,
        VirtualTimer(),
        progress=seen.append,
        progress_every_s=10.0,
    )
    assert len(seen) >= 3
    assert [s.sent for s in seen] == sorted(s.sent for s in seen)
    last = seen[-1]
    assert last.errors == 0, result.summary(None).errors_by_kind
    assert (last.sent, last.total, last.answered, last.errors, last.in_flight) == (30, 30, 30, 0, 0)
    assert "sent 30/30, answered 30, errors 0" in last.line()


def test_a_stop_ends_the_sending(fake: FakeService) -> None:
    stop = threading.Event()
    seen: list[LoadProgress] = []

    def progress(snapshot: LoadProgress) -> None:
        seen.append(snapshot)
        if snapshot.sent >= 3:
            stop.set()

    result = run(
        build_queries(trace_of([float(t) for t in range(100)], [0] * 100), inputs()),
        fake.url,
        VirtualTimer(),
        progress=progress,
        progress_every_s=0.5,
        stop=stop,
    )
    assert result.stopped
    assert 3 <= result.sent < 100
    assert len(result.outcomes) <= result.sent  # those cut short are not counted


# --- the summary ---------------------------------------------------------------------------------


def test_the_summary_statistics() -> None:
    latencies = [float(v) for v in range(1, 101)]  # 1..100 ms
    outcomes = [QueryResult(i, "ok", ms, send_lag_ms=0.5) for i, ms in enumerate(latencies)]
    outcomes += [QueryResult(100, "timeout", 10_000.0), QueryResult(101, "http_503", 2.0)]
    summary = summarise(outcomes, slo_ms=50.0, elapsed_s=20.0)
    assert (summary.sent, summary.answered, summary.errors) == (102, 100, 2)
    assert summary.p50_ms == pytest.approx(np.percentile(latencies, 50))
    assert summary.p99_ms == pytest.approx(np.percentile(latencies, 99))
    # 50 answered within 50 ms out of 102 sent: errors are misses.
    assert summary.attainment == pytest.approx(50 / 102)
    assert summary.achieved_qps == pytest.approx(100 / 20.0)
    assert dict(summary.errors_by_kind) == {"http_503": 1, "timeout": 1}
    assert summary.send_lag_p99_ms == pytest.approx(0.5)


def test_the_path_outside_the_service_is_the_latency_less_the_services_own_time() -> None:
    outcomes = [QueryResult(i, "ok", 10.0 + i, served_ms=8.0) for i in range(100)]
    outcomes.append(QueryResult(100, "ok", 50.0))  # no time from the service: left out
    outcomes.append(QueryResult(101, "http_503", 1.0, served_ms=0.5))  # not answered
    summary = summarise(outcomes, slo_ms=None, elapsed_s=1.0)
    expected = [2.0 + i for i in range(100)]
    assert summary.outside_p50_ms == pytest.approx(np.percentile(expected, 50))
    assert summary.outside_p99_ms == pytest.approx(np.percentile(expected, 99))
    assert summarise(outcomes[100:], slo_ms=None, elapsed_s=1.0).outside_p99_ms is None


def test_the_services_queue_is_summarised_over_the_answers_that_give_it() -> None:
    outcomes = [QueryResult(i, "ok", 10.0, served_ms=8.0, queued_ms=float(i)) for i in range(100)]
    outcomes.append(QueryResult(100, "ok", 50.0, served_ms=8.0))  # no queue given: left out
    outcomes.append(QueryResult(101, "http_503", 1.0, queued_ms=500.0))  # not answered
    summary = summarise(outcomes, slo_ms=None, elapsed_s=1.0)
    assert summary.queue_p50_ms == pytest.approx(np.percentile(range(100), 50))
    assert summary.queue_p99_ms == pytest.approx(np.percentile(range(100), 99))
    assert summary.to_json()["queue_p99_ms"] == summary.queue_p99_ms
    assert summarise(outcomes[100:], slo_ms=None, elapsed_s=1.0).queue_p99_ms is None


def test_the_services_late_flags_are_counted_over_the_answers_that_carry_them() -> None:
    outcomes = [QueryResult(i, "ok", 10.0, late=i % 4 == 0) for i in range(20)]  # 5 late
    outcomes.append(QueryResult(20, "ok", 500.0))  # no flag: not counted, though slow
    outcomes.append(QueryResult(21, "http_503", 1.0, late=True))  # not answered: not counted
    summary = summarise(outcomes, slo_ms=100.0, elapsed_s=1.0)
    assert summary.late_by_service == 5
    assert summary.to_json()["late_by_service"] == 5
    # The client's misses hold the service's and more (the unflagged slow one, the error).
    assert summary.attainment == pytest.approx(20 / 22)
    assert summarise(outcomes[20:], slo_ms=None, elapsed_s=1.0).late_by_service is None


def test_a_summary_of_nothing_answered() -> None:
    summary = summarise([QueryResult(0, "connection", 1.0)], slo_ms=None, elapsed_s=0.0)
    assert (summary.p50_ms, summary.p99_ms, summary.attainment) == (None, None, None)
    assert summary.achieved_qps == 0.0
    empty = summarise([], slo_ms=10.0, elapsed_s=1.0)
    assert (empty.sent, empty.attainment, empty.p99_ms) == (0, None, None)


# --- the command ---------------------------------------------------------------------------------


def write_trace(path: Path, arrivals: list[float], ids: list[int] | None = None) -> Path:
    write_trace_csv(trace_of(arrivals, ids), path)
    return path


def loadgen_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(["loadgen", *argv])
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_json_contract(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.01, 0.02, 0.03], [0, 8, 12, 3])
    status, out, err = loadgen_cli(
        capsys, "--url", fake.url, "--app", APP, "--trace", str(trace), "--token", TOKEN, "--json"
    )
    assert status == 0, err
    data = json.loads(out)
    assert set(data) == CONTRACT_KEYS
    assert (data["sent"], data["answered"], data["errors"]) == (4, 3, 1)
    assert data["errors_by_kind"] == {"http_503": 1}
    assert isinstance(data["p50_ms"], float) and data["p99_ms"] >= data["p50_ms"]
    assert 0.0 <= data["attainment"] <= 0.75
    assert data["achieved_qps"] > 0
    assert "SLO 100 ms (the app's p99 SLO)" in err
    # The inputs are the family's validation digits, in the order of its records.
    from provisioners.worker.family import load_split

    pixels = load_split().validation_inputs
    sent = {r["sample_ids"][0]: r["inputs"][0] for r in fake.requests}
    assert sent[3] == pixels[3].astype(int).tolist()


def test_human_summary_and_the_token_from_the_environment(
    fake: FakeService,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HETEROPLANE_TOKEN", TOKEN)
    monkeypatch.setenv("HETEROPLANE_URL", fake.url)
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.01])
    status, out, err = loadgen_cli(capsys, "--app", APP, "--trace", str(trace))
    assert status == 0, err
    assert out.startswith("sent 2 queries in ")
    assert "answered 2" in out and "latency: p50" in out and "attainment:" in out


def test_an_infer_token_needs_the_slo_on_the_command_line(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0])
    base = ["--url", fake.url, "--app", APP, "--trace", str(trace), "--token", INFER_TOKEN]
    status, out, err = loadgen_cli(capsys, *base, "--json")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "give --slo-ms" in err
    status, out, err = loadgen_cli(capsys, *base, "--slo-ms", "250", "--json")
    assert status == 0, err
    assert json.loads(out)["answered"] == 1


def test_every_querys_outcome_can_be_written_out(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.01, 0.02, 0.03], [0, 8, 12, 3])
    out_path = tmp_path / "outcomes.csv"
    argv = ("--url", fake.url, "--app", APP, "--trace", str(trace), "--token", TOKEN, "--json")
    status, out, err = loadgen_cli(capsys, *argv, "--outcomes", str(out_path))
    assert status == 0, err
    with out_path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["index"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["send_at_s"]) for r in rows] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    # The same queries the summary counts: three answered, the fake's 503 for sample 8.
    assert [r["kind"] for r in rows] == ["ok", "http_503", "ok", "ok"]
    assert json.loads(out)["answered"] == sum(r["kind"] == "ok" for r in rows)
    assert all(float(r["latency_ms"]) >= 0.0 and float(r["send_lag_ms"]) >= 0.0 for r in rows)
    # A file that cannot be written is one line and exit 2, before anything is sent; an
    # existing file is left as it is until the run's outcomes replace it.
    sent = len(fake.requests)
    for bad in (tmp_path / "no" / "x.csv", tmp_path):
        status, _, err = loadgen_cli(capsys, *argv, "--outcomes", str(bad))
        assert status == 2 and err.count("\n") == 1 and "--outcomes" in err, err
    assert len(fake.requests) == sent


@pytest.mark.parametrize("protocol", ["v1", "v2"])
def test_the_demos_digits_are_checked_against_the_apps_inputs_before_sending(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str], protocol: str
) -> None:
    # An app that is not the demo's (13 features): over v1 too, refused up front, not 422s.
    fake.inputs = [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}]
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.01])
    status, out, err = loadgen_cli(
        capsys,
        *("--url", fake.url, "--app", APP, "--trace", str(trace), "--token", TOKEN),
        *("--protocol", protocol),
    )
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert "the demo's digits: app 'demo': input 'input': rows of shape [64] do not fit" in err
    assert fake.requests == []


def test_a_run_without_one_answer_exits_1_after_its_report(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.01], [8, 8])  # both answered 503
    argv = ("--url", fake.url, "--app", APP, "--trace", str(trace), "--token", TOKEN)
    status, out, err = loadgen_cli(capsys, *argv, "--json")
    assert status == 1, err
    data = json.loads(out)
    assert (data["sent"], data["answered"], data["errors_by_kind"]) == (2, 0, {"http_503": 2})
    last = err.strip().splitlines()[-1]
    assert last == (
        "heteroplane loadgen: not one query was answered (2 sent; errors: http_503 2):"
        " exit status 1"
    )
    assert "http_503, e.g.: no_instance: no_instance" in err  # why, with --json on stderr
    status, out, err = loadgen_cli(capsys, *argv)
    assert status == 1 and "latency: no query was answered" in out
    assert "http_503, e.g.: no_instance: no_instance" in out
    assert "Traceback" not in err


def test_the_seed_comes_from_the_apps_validation_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "validation.json"
    records.write_text(json.dumps({"format": "heteroplane.validation/v1", "seed": 3}))
    service = FakeService(records)
    try:
        trace = write_trace(tmp_path / "t.csv", [0.0], [5])
        status, _, err = loadgen_cli(
            capsys,
            *("--url", service.url, "--app", APP, "--trace", str(trace), "--token", TOKEN),
            "--json",
        )
        assert status == 0, err
        from provisioners.worker.family import load_split

        assert (
            service.requests[0]["inputs"][0]
            == load_split(3).validation_inputs[5].astype(int).tolist()
        )
    finally:
        service.close()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--app", "nope"], "not_found"),
        (["--token", "hp_wrong"], "unauthorized"),
        (["--url", "ftp://x"], "--url must be an http:// or https:// URL"),
        (["--timeout-s", "0"], "--timeout-s: must be a number > 0"),
        (["--max-in-flight", "0"], "--max-in-flight: must be >= 1"),
        (["--trace", "/nonexistent/t.csv"], "/nonexistent/t.csv"),
        (["--trace", "IDS"], "sample_id 900 at row 1 is outside the 719 validation samples"),
        (["--trace", "BAD"], "arrival_s decreases at row 3"),
        (["--trace", "EMPTY"], "has a header but no data rows"),
        # More rows than the service takes in a query: refused before the bodies are built (a
        # typo of 30000 had the generator build gigabytes of JSON, then every query a 4xx).
        (["--trace", "BIG"], "batch_size 257 at row 2 is more than the 256 rows"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    fake: FakeService,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    expected: str,
) -> None:
    good = write_trace(tmp_path / "good.csv", [0.0, 1.0])
    files = {
        "IDS": write_trace(tmp_path / "ids.csv", [0.0], [900]),
        "BAD": tmp_path / "bad.csv",
        "EMPTY": tmp_path / "empty.csv",
        "BIG": tmp_path / "big.csv",
    }
    files["BAD"].write_text("arrival_s,batch_size\n0.0,1\n2.0,1\n1.0,1\n")
    files["BIG"].write_text("arrival_s,batch_size\n0.0,256\n1.0,257\n")
    files["EMPTY"].write_text("arrival_s,batch_size\n")
    options = {"--url": fake.url, "--app": APP, "--trace": str(good), "--token": TOKEN}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        options[flag] = str(files[value]) if value in files else value
    argv = [part for pair in options.items() for part in pair]
    status, out, err = loadgen_cli(capsys, *argv, "--json")
    assert status == 2, err
    assert out == "" and err.count("\n") == 1 and expected in err, err
    assert not any(r.get("sample_ids") for r in fake.requests)  # nothing was sent


def test_a_service_that_is_not_there_is_refused_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    trace = write_trace(tmp_path / "t.csv", [0.0])
    status, out, err = loadgen_cli(
        capsys, "--url", url, "--app", APP, "--trace", str(trace), "--token", TOKEN
    )
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "cannot reach the heteroplane API" in err


def test_the_clients_most_rows_a_query_are_the_services() -> None:
    from controlplane.api.schemas import MAX_INFER_SAMPLES

    assert loadgen.MAX_QUERY_ROWS == MAX_INFER_SAMPLES
