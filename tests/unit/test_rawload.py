"""The load generator's raw engine (``heteroplane loadgen --engine raw``) against the same tiny
fake service as the httpx engine's tests: the same outcomes by kind, timeouts, a service that is
not there, the open loop, and the ``--json`` contract. Nothing here sleeps or asserts on how
long anything took.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.clients import loadgen, rawload
from controlplane.clients.loadgen import build_queries
from tests.unit.test_loadgen import (
    APP,
    CONTRACT_KEYS,
    TOKEN,
    FakeService,
    inputs,
    loadgen_cli,
    trace_of,
    write_trace,
)


@pytest.fixture
def fake() -> Iterator[FakeService]:
    service = FakeService()
    try:
        yield service
    finally:
        service.close()


def run(queries: list[loadgen.Query], url: str, **options: Any) -> loadgen.LoadResult:
    async def go() -> loadgen.LoadResult:
        return await rawload.run_raw_load_async(
            queries, loadgen.infer_url(url, APP), TOKEN, **options
        )

    return asyncio.run(go())


def test_the_request_head_carries_the_token_and_the_length() -> None:
    head = rawload.request_head("http://h:81/v1/apps/a/infer?x=1", "hp_t", 12).decode()
    lines = head.split("\r\n")
    assert lines[0] == "POST /v1/apps/a/infer?x=1 HTTP/1.1"
    assert {"Host: h:81", "Content-Length: 12", "Authorization: Bearer hp_t"} <= set(lines)
    assert head.endswith("\r\n\r\n")


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="http:// URLs only"):
        run(build_queries(trace_of([0.0]), inputs()), "https://127.0.0.1:1")


def test_errors_are_counted_by_kind_as_the_httpx_engine_counts_them(fake: FakeService) -> None:
    ids = [0, 7, 8, 9, 10, 1, 7, 12]
    result = run(build_queries(trace_of([0.0] * len(ids), ids), inputs()), fake.url)
    summary = result.summary(100.0)
    assert summary.sent == 8 and summary.answered == 3 and summary.errors == 5
    assert dict(summary.errors_by_kind) == {
        "bad_response": 1,
        "connection": 1,
        "http_429": 2,
        "http_503": 1,
    }
    assert dict(summary.error_examples) == {"http_503": "no_instance: no_instance"}
    assert [o.index for o in result.outcomes] == list(range(8))
    assert [o.late for o in result.outcomes if o.answered] == [False, False, True]
    assert [o.served_ms for o in result.outcomes if o.answered] == [1.0, 1.0, 1.0]
    assert [o.queued_ms for o in result.outcomes if o.answered] == [0.25, 0.25, 0.25]
    # Each request carried its own body: the samples the trace gave it.
    assert sorted(r["sample_ids"][0] for r in fake.requests) == sorted(ids)


def test_the_loop_is_open_no_query_waits_for_an_answer(fake: FakeService) -> None:
    n = 8
    fake.barrier = threading.Barrier(n)  # no answer until every request is in
    queries = build_queries(trace_of([0.001 * i for i in range(n)], [*range(n - 1), 13]), inputs())
    result = run(queries, fake.url, max_in_flight=n)
    assert [o.kind for o in result.outcomes] == ["ok"] * n
    assert not fake.barrier.broken


def test_a_query_without_an_answer_in_time_is_a_timeout(fake: FakeService) -> None:
    result = run(build_queries(trace_of([0.0, 0.0], [11, 0]), inputs()), fake.url, timeout_s=1.0)
    # The answered query has a second, not 50 ms: on a loaded CI machine 50 ms was missed.
    fake.release.set()
    assert [o.kind for o in result.outcomes] == ["timeout", "ok"]


def test_queries_past_the_connection_cap_wait_and_still_go_out(fake: FakeService) -> None:
    ids = list(range(6))
    result = run(build_queries(trace_of([0.0] * 6, ids), inputs()), fake.url, max_in_flight=1)
    assert [o.kind for o in result.outcomes] == ["ok"] * 6
    assert len(fake.requests) == 6


def test_a_service_that_is_not_there_is_a_connection_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    result = run(build_queries(trace_of([0.0, 0.0, 0.01]), inputs()), url)
    assert [o.kind for o in result.outcomes] == ["connection"] * 3


def test_bad_arguments_are_refused() -> None:
    queries = build_queries(trace_of([0.0]), inputs())
    with pytest.raises(ValueError, match="timeout_s"):
        run(queries, "http://127.0.0.1:1", timeout_s=0.0)
    with pytest.raises(ValueError, match="max_in_flight"):
        run(queries, "http://127.0.0.1:1", max_in_flight=0)


def test_the_cli_engine_keeps_the_json_contract(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0, 0.01, 0.02, 0.03], [0, 8, 12, 3])
    status, out, err = loadgen_cli(
        capsys, "--url", fake.url, "--app", APP, "--trace", str(trace), "--token", TOKEN,
        "--json", "--engine", "raw",
    )  # fmt: skip
    assert status == 0, err
    data = json.loads(out)
    assert set(data) == CONTRACT_KEYS
    assert (data["sent"], data["answered"], data["errors"]) == (4, 3, 1)
    assert data["errors_by_kind"] == {"http_503": 1}


def test_the_cli_refuses_the_raw_engine_for_https(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.csv", [0.0], [0])
    status, _, err = loadgen_cli(
        capsys, "--url", "https://127.0.0.1:1", "--app", APP, "--trace", str(trace),
        "--token", TOKEN, "--engine", "raw",
    )  # fmt: skip
    assert status == 2 and "http:// URLs only" in err and "Traceback" not in err
