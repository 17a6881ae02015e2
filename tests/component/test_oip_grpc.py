"""The Open Inference Protocol over gRPC (:mod:`controlplane.api.grpc_oip`) on a real server over
the serving loop and fake workers, driven by ``tritonclient.grpc.InferenceServerClient`` as it
is: health and server metadata without a token; model metadata, readiness and inference with
one (raw tensors as the client sends them, and the typed ``contents`` another client may send);
the REST route's answer for the same query; each error as the gRPC code of the REST answer's
status (a bad token, a viewer's token, an unknown model or version, a wrong shape or datatype),
with the REST answer's message, counted for ``/metrics`` under the REST status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.api.grpc_oip import (
    SERVICE,
    DispatcherRefusedError,
    _refusal,
    attach,
    grpc_code,
)
from controlplane.errors import QueryFailedError
from controlplane.serving.dispatcher import DispatcherSettings
from tests.component.test_oip_routes import family_request, live_server
from tests.component.test_serving import LARGE, SMALL, ApiWorld, row, world
from tests.fake_worker import FakeWorker

__all__ = ["world"]  # the fixture, imported for this module's tests

code_internal = grpc.StatusCode.INTERNAL

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture
def served(world: ApiWorld) -> Iterator[tuple[ApiWorld, str, str]]:
    """The world's API on a real server with gRPC beside it: (world, REST host:port, gRPC
    host:port)."""
    listener = attach(world.app, "127.0.0.1", 0, world.settings.oip_body_max_bytes)
    with live_server(world, [SMALL, LARGE]) as (_, address):
        yield world, address, f"127.0.0.1:{listener.port}"


def _status(call: object) -> str | None:
    """The gRPC status a tritonclient call raised, as its name (``StatusCode.NOT_FOUND``)."""
    with pytest.raises(InferenceServerException) as raised:
        call()  # type: ignore[operator]
    status: str | None = raised.value.status()
    return status


def test_tritonclient_grpc_health_metadata_and_inference(
    served: tuple[ApiWorld, str, str],
) -> None:
    world, rest, address = served
    headers = {"authorization": f"Bearer {world.tokens['infer']}"}
    client = grpcclient.InferenceServerClient(address)
    try:
        assert client.is_server_live() and client.is_server_ready()
        server = client.get_server_metadata()
        assert server.name == "heteroplane" and server.version
        assert client.is_model_ready("demo", headers=headers)
        metadata = client.get_model_metadata("demo", headers=headers, as_json=True)
        assert metadata == {
            "name": "demo",
            "versions": ["1"],
            "platform": "heteroplane",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": ["-1", "64"]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": ["-1", "10"]}],
        }
        pixels = np.array([row(8, 0.9), row(9, 0.1)], dtype=np.float32)
        given = grpcclient.InferInput("input", list(pixels.shape), "FP32")
        given.set_data_from_numpy(pixels)
        result = client.infer(
            "demo",
            [given],
            outputs=[grpcclient.InferRequestedOutput("logits")],
            request_id="r7",
            headers=headers,
        )
        logits = result.as_numpy("logits")
        assert logits.shape == (2, 10) and logits.argmax(axis=1).tolist() == [8, 9]
        response = result.get_response()
        assert response.id == "r7" and response.model_version == "1"
        assert response.parameters["models"].string_param == "tiny,large"
        assert response.parameters["total_ms"].double_param > 0
        # The REST route answers the same query with the same outputs.
        answer = httpx.post(
            f"http://{rest}/v2/models/demo/infer",
            json=family_request(pixels.tolist()),
            headers=world.auth(),
            trust_env=False,
        )
        assert answer.status_code == 200, answer.text
        (tensor,) = answer.json()["outputs"]
        np.testing.assert_array_equal(np.array(tensor["data"], dtype=np.float32), logits.ravel())
    finally:
        client.close()


def test_typed_contents_and_a_deadline(served: tuple[ApiWorld, str, str]) -> None:
    """A client that sends typed ``contents`` (not raw bytes) is served alike; so is a call
    with a gRPC deadline."""
    world, _, address = served
    pixels = np.array([row(3, 0.9)], dtype=np.float32)
    request = pb.ModelInferRequest(model_name="demo", model_version="1")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(pixels.shape))
    tensor.contents.fp32_contents.extend(pixels.ravel().tolist())
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(
            f"/{SERVICE}/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        metadata = (("authorization", f"Bearer {world.tokens['infer']}"),)
        answer = infer(request, metadata=metadata, timeout=30.0)
        (output,) = answer.outputs
        assert (output.name, output.datatype, list(output.shape)) == ("logits", "FP32", [1, 10])
        logits = np.frombuffer(answer.raw_output_contents[0], dtype="<f4")
        assert int(logits.argmax()) == 3
        # Both typed contents and raw bytes for one input: refused, naming it.
        request.raw_input_contents.append(pixels.tobytes())
        with pytest.raises(grpc.RpcError) as refused:
            infer(request, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'input'" in refused.value.details()


def test_errors_are_the_rest_answers_as_grpc_codes(served: tuple[ApiWorld, str, str]) -> None:
    world, _, address = served
    good = {"authorization": f"Bearer {world.tokens['infer']}"}
    client = grpcclient.InferenceServerClient(address)
    pixels = np.array([row(1, 0.9)], dtype=np.float32)

    def given(array: np.ndarray = pixels, datatype: str = "FP32") -> list[object]:
        tensor = grpcclient.InferInput("input", list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return [tensor]

    try:
        for headers, code in (
            ({}, "StatusCode.UNAUTHENTICATED"),
            ({"authorization": "Bearer nope"}, "StatusCode.UNAUTHENTICATED"),
            ({"authorization": "Basic abc"}, "StatusCode.UNAUTHENTICATED"),
            (
                {"authorization": f"Bearer {world.tokens['viewer']}"},
                "StatusCode.PERMISSION_DENIED",
            ),
        ):
            assert _status(lambda h=headers: client.infer("demo", given(), headers=h)) == code
            assert _status(lambda h=headers: client.get_model_metadata("demo", headers=h)) == code
        with pytest.raises(InferenceServerException) as unknown:
            client.infer("nope", given(), headers=good)
        assert unknown.value.status() == "StatusCode.NOT_FOUND"
        assert "no model 'nope'" in unknown.value.message()
        assert (
            _status(lambda: client.infer("demo", given(), model_version="2", headers=good))
            == "StatusCode.NOT_FOUND"
        )
        assert (
            _status(lambda: client.get_model_metadata("nope", headers=good))
            == "StatusCode.NOT_FOUND"
        )
        wrong_shape = np.zeros((1, 63), dtype=np.float32)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("demo", given(wrong_shape), headers=good)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "'input'" in refused.value.message()
        wrong_type = np.zeros((1, 64), dtype=np.float64)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("demo", given(wrong_type, "FP64"), headers=good)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "datatype 'FP64', expected 'FP32'" in refused.value.message()
        # Counted for /metrics as REST's answers are: by app and the REST status (401 and 403
        # under no app).
        counts = world.app.state.services.requests.snapshot()
        assert counts[("", 401)] == 6 and counts[("", 403)] == 2
        assert counts[("demo", 400)] == 2 and counts[("", 404)] == 3
        # A version quoted whole had made the message a header past the client's 16 KiB:
        # RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit"), not the refusal.
        with pytest.raises(InferenceServerException) as long_version:
            client.infer("demo", given(), model_version="9" * 20_000, headers=good)
        assert long_version.value.status() == "StatusCode.NOT_FOUND"
        assert long_version.value.message().endswith("...")
    finally:
        client.close()


def test_every_http_status_of_the_api_has_a_grpc_code() -> None:
    code = grpc.StatusCode
    expected = {
        400: code.INVALID_ARGUMENT,
        401: code.UNAUTHENTICATED,
        403: code.PERMISSION_DENIED,
        404: code.NOT_FOUND,
        422: code.INVALID_ARGUMENT,
        429: code.RESOURCE_EXHAUSTED,
        502: code.INTERNAL,
        503: code.UNAVAILABLE,
        504: code.DEADLINE_EXCEEDED,
    }
    assert {status: grpc_code(status) for status in expected} == expected
    assert grpc_code(418) is grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_code(599) is grpc.StatusCode.INTERNAL
    # A 502 that says when to send again: the worker failed, not the model.
    assert grpc_code(502, retry_after=True) is grpc.StatusCode.UNAVAILABLE
    assert grpc_code(500, retry_after=True) is grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("transport", "code", "retry"),
    [(True, grpc.StatusCode.UNAVAILABLE, (("retry-after", "1"),)), (False, code_internal, ())],
)
def test_a_lost_worker_is_unavailable_and_a_model_failure_internal(
    transport: bool, code: grpc.StatusCode, retry: tuple[tuple[str, str], ...]
) -> None:
    """A query whose worker failed (a dead worker's broken connection) may be answered if sent
    again: REST's 502 says when (Retry-After), and gRPC answers UNAVAILABLE, which clients
    retry; a model that raised stays INTERNAL, as its REST 502 has no Retry-After."""
    error = QueryFailedError("demo", "connection refused", 2, transport=transport)
    refusal = _refusal("ModelInfer", error)
    assert (refusal.status, refusal.code, refusal.trailers) == (502, code, retry)
    assert "connection refused" in refusal.message
    forwarded = DispatcherRefusedError(502, "the query failed", "1" if transport else None)
    assert _refusal("ModelInfer", forwarded).code is code


def test_a_malformed_message_is_invalid_argument_in_one_line(
    served: tuple[ApiWorld, str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that are not a ModelInferRequest (garbage, or an ``id`` that is not UTF-8) are
    ``INVALID_ARGUMENT`` with one line, not grpc's UNKNOWN and a traceback; without a valid
    token they are ``UNAUTHENTICATED``, as REST's 401 comes before the body is read; a string
    ``parameters.timeout`` is refused as REST refuses it, deadline or not."""
    world, _, address = served
    metadata = (("authorization", f"Bearer {world.tokens['infer']}"),)
    valid = pb.ModelInferRequest(model_name="demo", id="r1").SerializeToString()
    not_utf8_id = valid.replace(b"r1", b"\xed\xa0")  # id is field 3, 2 bytes long
    with caplog.at_level("WARNING"), grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        for payload in (b"\xff\xff\xff\xff", not_utf8_id):
            with pytest.raises(grpc.RpcError) as refused:
                raw(payload, metadata=metadata, timeout=30.0)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = refused.value.details()
            assert "not a valid ModelInferRequest" in details and "\n" not in details
            for who in ((), (("authorization", "Bearer nope"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    raw(payload, metadata=who, timeout=30.0)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "ModelInferRequest" not in refused.value.details()
        infer = channel.unary_unary(
            f"/{SERVICE}/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        request = pb.ModelInferRequest(model_name="demo")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
        tensor.contents.fp32_contents.extend(row(1, 0.9))
        request.parameters["timeout"].string_param = "soon"
        for timeout in (30.0, None):
            with pytest.raises(grpc.RpcError) as refused:
                infer(request, metadata=metadata, timeout=timeout)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "parameters.timeout" in refused.value.details()
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]
    counts = world.app.state.services.requests.snapshot()
    assert counts[("", 400)] == 2 and counts[("", 401)] == 4 and counts[("demo", 400)] == 2


def test_a_port_taken_after_the_check_is_a_warning_and_rest_serves_alone(
    world: ApiWorld, caplog: pytest.LogCaptureFixture
) -> None:
    """Another service took gRPC's port between `heteroplane serve`'s check and the server's
    start (two demos starting at once): REST serves alone, said as the warning the check says,
    not an error."""
    import logging
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listener = attach(world.app, "127.0.0.1", port, world.settings.oip_body_max_bytes)
        with caplog.at_level(logging.WARNING), live_server(world, [SMALL]) as (_, address):
            assert listener.port is None
            assert httpx.get(f"http://{address}/healthz").status_code == 200
    refused = [r for r in caplog.records if "no gRPC served" in r.getMessage()]
    assert [r.levelname for r in refused] == ["WARNING"]
    assert f"cannot listen on 127.0.0.1:{port}" in refused[0].getMessage()


def test_a_request_past_the_apps_own_limit_is_refused_as_on_rest(
    served: tuple[ApiWorld, str, str],
) -> None:
    """The app's limit is REST's ``/v2`` body limit (256 rows of its inputs), not gRPC's
    64 MiB message limit: 10 MB of rows is RESOURCE_EXHAUSTED naming the app's limit, before
    its contents are read; 256 rows are answered."""
    world, _, address = served
    good = {"authorization": f"Bearer {world.tokens['infer']}"}
    client = grpcclient.InferenceServerClient(address)

    def given(rows: int) -> list[object]:
        tensor = grpcclient.InferInput("input", [rows, 64], "FP32")
        tensor.set_data_from_numpy(np.zeros((rows, 64), dtype=np.float32))
        return [tensor]

    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer("demo", given(40_000), headers=good)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "past the app's limit" in refused.value.message()
        assert "\n" not in refused.value.message()
        answer = client.infer("demo", given(256), headers=good)
        assert answer.as_numpy("logits").shape == (256, 10)
    finally:
        client.close()


# --- a query nobody waits for, and admission's refusal, over gRPC ---------------------------------


@contextlib.contextmanager
def _hung(world: ApiWorld, **limits: Any) -> Iterator[tuple[ApiWorld, FakeWorker, str, str]]:
    listener = attach(world.app, "127.0.0.1", 0, world.settings.oip_body_max_bytes, **limits)
    with live_server(world, [LARGE]) as ((worker,), address):
        worker.hang = True
        yield world, worker, f"127.0.0.1:{listener.port}", f"http://{address}"


@pytest.fixture
def held(world: ApiWorld) -> Iterator[tuple[ApiWorld, FakeWorker, str, str]]:
    """gRPC beside the API over one fake worker (batch cap 1 in the demo's plan) that never
    answers (``hang``): the first query holds it and what follows queues. Calls are held for
    as long as the test may take. Yields (world, worker, gRPC host:port, REST URL)."""
    with _hung(world) as held:
        yield held


@pytest.fixture
def capped(world: ApiWorld) -> Iterator[tuple[ApiWorld, FakeWorker, str, str]]:
    """:func:`held`'s, with the gRPC server's calls in flight capped at 2."""
    with _hung(world, max_calls=2) as held:
        yield held


def _hold(world: ApiWorld, **settings: Any) -> None:
    world.serving.settings = dataclasses.replace(
        world.serving.settings,
        dispatcher=DispatcherSettings(call_timeout_floor_s=60.0, idle_probe_s=None, **settings),
    )


def _queued(world: ApiWorld, url: str) -> tuple[int, dict[str, Any]]:
    """The demo's queued queries and its totals (``GET /v1/apps/demo/serving``)."""
    answer = httpx.get(f"{url}/v1/apps/demo/serving", headers=world.auth("viewer"), trust_env=False)
    assert answer.status_code == 200, answer.text
    status = answer.json()
    return int(status["stages"][0]["queued_queries"]), dict(status["totals"])


def _until(what: str, check: Any) -> None:
    deadline = time.monotonic() + 20.0
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _model_infer(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        f"/{SERVICE}/ModelInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelInferResponse.FromString,
    )


def _one_row(value: int) -> Any:
    request = pb.ModelInferRequest(model_name="demo")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    tensor.contents.fp32_contents.extend(row(value, 0.9))
    return request


@contextlib.contextmanager
def _worker_held(
    world: ApiWorld, worker: FakeWorker, address: str
) -> Iterator[tuple[Any, tuple[tuple[str, str], ...], Any]]:
    """A gRPC channel to ``address``: its ModelInfer, the infer token's metadata, and a first
    query (a future) that has reached ``worker``, which holds it."""
    metadata = (("authorization", f"Bearer {world.tokens['infer']}"),)
    with grpc.insecure_channel(address) as channel:
        infer = _model_infer(channel)
        first = infer.future(_one_row(1), metadata=metadata, timeout=60.0)
        _until("the first query never reached the worker", lambda: worker.received == 1)
        yield infer, metadata, first


def test_a_call_past_its_deadline_or_cancelled_costs_no_worker_call(
    held: tuple[ApiWorld, FakeWorker, str, str],
) -> None:
    """Over gRPC as over REST (docs/serving.md, "Overload without collapse"): a call whose
    deadline passes while its query waits behind a busy worker is ``DEADLINE_EXCEEDED`` and its
    query leaves the queue; so does the query of a call its client cancels; the worker never
    sees either."""
    world, worker, address, url = held
    _hold(world, admission=False)
    with _worker_held(world, worker, address) as (infer, metadata, first):
        late = infer.future(_one_row(2), metadata=metadata, timeout=2.0)
        _until("the query with a deadline never queued", lambda: _queued(world, url)[0] == 1)
        with pytest.raises(grpc.RpcError) as expired:
            late.result(timeout=30.0)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _until("the expired query is still queued", lambda: _queued(world, url)[0] == 0)
        cancelled = infer.future(_one_row(3), metadata=metadata, timeout=60.0)
        _until("the query to cancel never queued", lambda: _queued(world, url)[0] == 1)
        assert cancelled.cancel()
        _until("the cancelled query is still queued", lambda: _queued(world, url)[0] == 0)
        assert _queued(world, url)[1]["timed_out"] == 2
        assert worker.received == 1  # only the first, held, query ever reached it
        first.cancel()


def test_admissions_refusal_is_resource_exhausted_with_retry_after(
    held: tuple[ApiWorld, FakeWorker, str, str],
) -> None:
    """REST's 429 over gRPC: ``RESOURCE_EXHAUSTED``, REST's message, the ``retry-after``
    trailing metadata (seconds); the query never reaches a worker."""
    world, worker, address, url = held
    _hold(world, admission=True, max_queued_samples=1)  # room for one queued query
    with _worker_held(world, worker, address) as (infer, metadata, first):
        queued = infer.future(_one_row(2), metadata=metadata, timeout=60.0)
        _until("the second query never queued", lambda: _queued(world, url)[0] == 1)
        with pytest.raises(grpc.RpcError) as refused:
            infer(_one_row(3), metadata=metadata, timeout=30.0)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in refused.value.details()
        trailers = dict(refused.value.trailing_metadata() or ())
        assert int(trailers["retry-after"]) >= 1
        assert _queued(world, url)[1]["refused"] == 1
        assert worker.received == 1
        for call in (queued, first):
            call.cancel()


def _answers(world: ApiWorld, url: str, status: int) -> float:
    """``heteroplane_api_requests_total`` of the demo's answers of ``status``, as ``GET
    /metrics`` says it (Prometheus' parser)."""
    answer = httpx.get(f"{url}/metrics", headers=world.auth("viewer"), trust_env=False)
    assert answer.status_code == 200, answer.text
    labels = {"app": "demo", "status": str(status)}
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name == "heteroplane_api_requests_total" and sample.labels == labels
    )


def test_a_call_cut_by_its_deadline_is_counted_as_rests_504(
    held: tuple[ApiWorld, FakeWorker, str, str],
) -> None:
    """A call whose gRPC deadline passes while its query waits (grpc cancels its handler) is
    counted in ``/metrics`` as REST counts a query past its ``parameters.timeout``: a 504 under
    its app. A call its client cancels is not, as a REST client gone is not."""
    world, worker, address, url = held
    _hold(world, admission=False)
    before = _answers(world, url, 504)
    with _worker_held(world, worker, address) as (infer, metadata, first):
        late = infer.future(_one_row(2), metadata=metadata, timeout=1.0)
        with pytest.raises(grpc.RpcError) as expired:
            late.result(timeout=30.0)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _until(
            "the call cut by its deadline was not counted",
            lambda: _answers(world, url, 504) == before + 1,
        )
        cancelled = infer.future(_one_row(3), metadata=metadata, timeout=60.0)
        _until("the query to cancel never queued", lambda: _queued(world, url)[0] == 1)
        assert cancelled.cancel()
        _until("the cancelled query is still queued", lambda: _queued(world, url)[0] == 0)
        first.cancel()
    # The REST routes the test asked (the demo's serving status) count 200s under it too.
    counts = world.app.state.services.requests.snapshot()
    assert {key: n for key, n in counts.items() if key[0] == "demo" and key[1] != 200} == {
        ("demo", 504): 1
    }


def _live(address: str) -> bool:
    try:
        return bool(grpcclient.InferenceServerClient(address).is_server_live())
    except InferenceServerException:
        return False


def test_connections_past_the_cap_are_closed(
    world: ApiWorld,
) -> None:
    """gRPC's connections were not capped (REST caps those without a token): a client could
    open connections until the process ran out of descriptors. At most
    ``grpc_connections_max`` are open: with two connections holding both places, a client's
    call on a new one is ``UNAVAILABLE``; once one of them closes, the server serves again."""
    with _hung(world, max_connections=2) as (_world, _worker, address, _url):
        host, port = address.split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            with pytest.raises(InferenceServerException) as refused:
                grpcclient.InferenceServerClient(address).is_server_live(client_timeout=10.0)
            assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value.message()
            held.pop().close()
            _until("the server never served again", lambda: _live(address))
        finally:
            for connection in held:
                connection.close()


def test_a_connection_that_never_speaks_is_closed_after_the_handshake_time(
    world: ApiWorld,
) -> None:
    """A connection that opened and sent nothing held its place for good; it is closed once the
    handshake time has passed (``http_head_timeout_s``, REST's time for a request head; here
    half a second), and the server serves on."""
    with _hung(world, handshake_s=0.5) as (_world, _worker, address, _url):
        host, port = address.split(":")
        with socket.create_connection((host, int(port))) as silent:
            silent.settimeout(20.0)
            while silent.recv(4096):  # the server's preface, then the end of the connection
                pass
        assert _live(address)


def test_settings_past_grpcs_int_still_serve_grpc(world: ApiWorld) -> None:
    """grpc's channel arguments are C ints: an ``http_keep_alive_s`` over about 24.8 days (in
    ms), valid, failed the server's creation (OverflowError) and with it the service's start,
    and a ``grpc_connections_max`` of 2**31 - 1 aborted the process (grpc's core checks the cap
    is under it). They are taken as grpc's largest, and gRPC serves."""
    services = world.app.state.services
    settings = services.settings.model_copy(
        update={
            "http_keep_alive_s": 3e6,
            "http_head_timeout_s": 3e6,
            "grpc_connections_max": 2**31 - 1,
        }
    )
    world.app.state.services = dataclasses.replace(services, settings=settings)
    with _hung(world) as (_world, _worker, address, _url):
        assert _live(address)


def test_a_client_whose_idle_connection_was_closed_calls_again_on_a_new_one(
    world: ApiWorld,
) -> None:
    """The server closes a connection that has had no call for ``http_keep_alive_s`` (here half
    a second): its client's channel goes idle and its next call opens a new connection and is
    answered, not refused."""
    with _hung(world, idle_s=0.5) as (_world, _worker, address, _url):
        states: list[grpc.ChannelConnectivity] = []
        idle = threading.Event()

        def seen(state: grpc.ChannelConnectivity) -> None:
            states.append(state)
            if grpc.ChannelConnectivity.READY in states and state == grpc.ChannelConnectivity.IDLE:
                idle.set()

        with grpc.insecure_channel(address) as channel:
            live = channel.unary_unary(
                f"/{SERVICE}/ServerLive",
                request_serializer=pb.ServerLiveRequest.SerializeToString,
                response_deserializer=pb.ServerLiveResponse.FromString,
            )
            channel.subscribe(seen)
            assert live(pb.ServerLiveRequest(), timeout=30.0).live
            assert idle.wait(20.0), f"the idle connection was never closed: {states}"
            assert live(pb.ServerLiveRequest(), timeout=30.0).live
            channel.unsubscribe(seen)


def test_calls_past_the_cap_are_resource_exhausted_and_the_server_serves_on(
    capped: tuple[ApiWorld, FakeWorker, str, str],
) -> None:
    """With ``grpc_calls_max`` calls in flight (2: one held by the worker, one queued behind
    it), one more is ``RESOURCE_EXHAUSTED`` at once, whatever its connection, with
    ``retry-after`` (REST's 429's code), and counted as a 429, rather than held too; the health
    calls are still answered. Once a call ends the server answers again, and the cap holds as
    before (grpcio's own cap had let every call through once it had refused some)."""
    world, worker, address, url = capped
    _hold(world, admission=False)
    client = grpcclient.InferenceServerClient(address)  # a connection of its own
    headers = {"authorization": f"Bearer {world.tokens['infer']}"}
    refusals = 0

    def answered() -> bool:
        nonlocal refusals
        try:
            metadata = client.get_model_metadata("demo", headers=headers, as_json=True)
        except InferenceServerException as error:  # the call still ending
            assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error.message()
            refusals += 1
            return False
        assert metadata["name"] == "demo"
        return True

    try:
        with _worker_held(world, worker, address) as (infer, metadata, first):
            for value in (2, 3):
                queued = infer.future(_one_row(value), metadata=metadata, timeout=60.0)
                _until("the second query never queued", lambda: _queued(world, url)[0] == 1)
                with pytest.raises(grpc.RpcError) as refused:
                    infer(_one_row(9), metadata=metadata, timeout=30.0)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "grpc_calls_max" in refused.value.details()
                assert dict(refused.value.trailing_metadata() or ())["retry-after"] == "1"
                with pytest.raises(InferenceServerException) as other:
                    client.get_model_metadata("demo", headers=headers, client_timeout=30.0)
                assert other.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
                refusals += 2
                assert client.is_server_live() and client.is_server_ready()
                assert worker.received == 1 and _queued(world, url)[0] == 1
                assert queued.cancel()
                _until("the cancelled query is still queued", lambda: _queued(world, url)[0] == 0)
                _until("the server never answered again", answered)
            first.cancel()
    finally:
        client.close()
    assert world.app.state.services.requests.snapshot()[("", 429)] == refusals
