"""gRPC ``ModelInfer`` requests as the REST route's queries
(:func:`controlplane.api.grpc_oip.request_document`, then
:func:`controlplane.api.routes.oip.parse_query`): every datatype REST's ``/v2`` serves, sent as
``raw_input_contents`` (as ``tritonclient.grpc`` sends it) and as typed ``contents``, reads back
as the array sent; what does not fit is refused naming the input; the call's deadline becomes
the request's ``parameters.timeout``. A forwarded query's REST answer
(:func:`controlplane.api.grpc_oip.forwarded_response`) reads back as the dispatcher gave it.
REST's checks of the binary switches and of output parameters apply; typed contents are counted
before they are copied; an answer past the message limit is refused (before the workers compute
it where the signature tells its size).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from controlplane.api import grpc_oip
from controlplane.api.forwarding import forward_oip
from controlplane.api.grpc_oip import (
    DispatcherRefusedError,
    GrpcOip,
    answer_bytes_at_least,
    forwarded_response,
    request_document,
)
from controlplane.api.routes.oip import Answered, parse_query, raw_bytes
from provisioners.artifacts import DATATYPES, ModelSignature, TensorSpec, datatype_of
from provisioners.worker.oip import OipError

pb = pytest.importorskip("tritonclient.grpc.service_pb2")
grpcclient = pytest.importorskip("tritonclient.grpc")


def _signature(datatype: str) -> ModelSignature:
    return ModelSignature((TensorSpec("x", datatype, (-1, 3)),), (TensorSpec("y", "FP32", (-1,)),))


def _array(datatype: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    dtype = DATATYPES[datatype]
    if dtype.kind == "b":
        return rng.integers(0, 2, size=(2, 3)).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        # UINT64 up to 2**63 - 1: past it, REST's own reading of the values (numpy's, of a list
        # of Python integers) takes them for floats, on /v2 over HTTP alike.
        return np.array([[info.min, 0, min(int(info.max), 2**63 - 1)], [1, 2, 3]], dtype=dtype)
    return rng.normal(size=(2, 3)).astype(dtype)


def _raw(datatype: str, array: np.ndarray) -> object:
    """The request ``tritonclient.grpc`` builds (its own InferInput)."""
    given = grpcclient.InferInput("x", list(array.shape), datatype)
    given.set_data_from_numpy(array)
    request = pb.ModelInferRequest(model_name="app")
    request.inputs.append(given._get_tensor())
    request.raw_input_contents.append(given._get_content())
    return request


_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_every_datatype_raw_and_typed(datatype: str) -> None:
    array = _array(datatype)
    signature = _signature(datatype)
    parsed = parse_query(signature, *request_document(_raw(datatype, array), None))
    np.testing.assert_array_equal(parsed.inputs["x"], array)
    assert parsed.inputs["x"].dtype == DATATYPES[datatype]
    request = pb.ModelInferRequest(model_name="app", id="q1")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=list(array.shape))
    if datatype == "FP16":
        with pytest.raises(OipError, match="FP16 travels in raw_input_contents"):
            request_document(request, None)
        return
    getattr(tensor.contents, _FIELDS[datatype]).extend(array.ravel().tolist())
    parsed = parse_query(signature, *request_document(request, None))
    np.testing.assert_array_equal(parsed.inputs["x"], array)
    assert parsed.id == "q1"


def test_what_does_not_fit_is_refused_naming_the_input() -> None:
    signature = _signature("FP32")
    array = np.zeros((2, 3), dtype=np.float32)
    short = _raw("FP32", array)
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]  # type: ignore[attr-defined]
    with pytest.raises(OipError, match="input 'x'"):
        parse_query(signature, *request_document(short, None))
    other = _raw("FP64", array.astype(np.float64))
    with pytest.raises(OipError, match="input 'x': datatype 'FP64', expected 'FP32'"):
        parse_query(signature, *request_document(other, None))
    extra = _raw("FP32", array)
    extra.raw_input_contents.append(b"\0\0\0\0")  # type: ignore[attr-defined]
    with pytest.raises(OipError, match="raw_input_contents holds 2 tensors for 1 inputs"):
        request_document(extra, None)


def test_the_calls_deadline_is_the_requests_timeout() -> None:
    request = _raw("FP32", np.zeros((1, 3), dtype=np.float32))
    document, _ = request_document(request, 0.25)
    assert document["parameters"]["timeout"] == pytest.approx(250_000)
    request.parameters["timeout"].int64_param = 100_000  # type: ignore[attr-defined]
    document, _ = request_document(request, 0.25)
    assert document["parameters"]["timeout"] == 100_000  # the request's own, shorter
    document, _ = request_document(request, None)
    assert document["parameters"] == {"timeout": 100_000}


@pytest.mark.parametrize("deadline_s", [0.25, None])
def test_a_timeout_that_is_not_a_number_is_refused(deadline_s: float | None) -> None:
    """A string or boolean ``parameters.timeout`` is refused, not replaced unread by the call's
    deadline."""
    request = _raw("FP32", np.zeros((1, 3), dtype=np.float32))
    request.parameters["timeout"].string_param = "soon"  # type: ignore[attr-defined]
    with pytest.raises(OipError, match=r"parameters\.timeout must be microseconds > 0, got .soon."):
        request_document(request, deadline_s)
    request.parameters["timeout"].bool_param = True  # type: ignore[attr-defined]
    with pytest.raises(OipError, match="got True"):
        request_document(request, deadline_s)


@pytest.mark.parametrize("deadline_s", [0.25, None])
@pytest.mark.parametrize(
    ("value", "says"),
    [
        (float("inf"), "must be a finite number of microseconds, got inf"),
        (float("nan"), "must be microseconds > 0, got nan"),
        (-1.0, "must be microseconds > 0, got -1.0"),
    ],
)
def test_a_timeout_rest_refuses_is_refused_deadline_or_not(
    deadline_s: float | None, value: float, says: str
) -> None:
    """A ``parameters.timeout`` REST refuses (an infinity, a NaN, a negative number) is refused
    whether the call has a deadline or not: an infinity, longer than any deadline, had been
    replaced by the call's unread and the query served."""
    request = _raw("FP32", np.zeros((1, 3), dtype=np.float32))
    request.parameters["timeout"].double_param = value  # type: ignore[attr-defined]
    with pytest.raises(OipError, match=rf"parameters\.timeout {says}"):
        request_document(request, deadline_s)


def _rest_answer(arrays: dict[str, np.ndarray], binary: set[str]) -> httpx.Response:
    """REST ``/v2``'s answer to a forwarded query: ``binary`` outputs raw, the others in JSON."""
    tensors, blobs = [], []
    for name, array in arrays.items():
        datatype = datatype_of(array.dtype)
        tensor: dict[str, object] = {"name": name, "datatype": datatype, "shape": [*array.shape]}
        if name in binary:
            blobs.append(raw_bytes(datatype, array))
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    parameters = {"models": ["m", "m"], "late": False, "total_ms": 1.5}
    header = json.dumps({"model_name": "app", "id": "q1", "outputs": tensors,
                         "parameters": parameters}).encode()  # fmt: skip
    headers = {"inference-header-content-length": str(len(header))} if blobs else {}
    return httpx.Response(200, content=header + b"".join(blobs), headers=headers)


@pytest.mark.parametrize("binary", [{"y", "z"}, {"z"}, set()])
def test_a_forwarded_answer_reads_back_as_the_dispatcher_gave_it(binary: set[str]) -> None:
    arrays: dict[str, np.ndarray] = {
        "y": np.array([[0.5, -1.25], [3.0, 4.0]], dtype=np.float32),
        "z": np.array([1, -7], dtype=np.int64),
    }
    response = forwarded_response("app", _rest_answer(arrays, binary))
    assert response.id == "q1"
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("y", "FP32", [2, 2]),
        ("z", "INT64", [2]),
    ]
    for output, raw, (name, array) in zip(
        response.outputs, response.raw_output_contents, arrays.items(), strict=True
    ):
        got = np.frombuffer(raw, dtype=array.dtype.newbyteorder("<")).reshape(output.shape)
        np.testing.assert_array_equal(got, array, err_msg=name)
    assert response.parameters["models"].string_param == "m,m"
    assert response.parameters["late"].bool_param is False
    assert response.parameters["total_ms"].double_param == 1.5


def test_a_forwarded_refusal_keeps_its_status_message_and_retry_after() -> None:
    refused = httpx.Response(
        429, content=b'{"error": "over capacity"}', headers={"retry-after": "2"}
    )
    with pytest.raises(DispatcherRefusedError) as raised:
        forwarded_response("app", refused)
    assert (raised.value.status, str(raised.value), raised.value.retry_after) == (
        429,
        "over capacity",
        "2",
    )
    for body in (b'{"outputs": [{"name": "y"}]}', b"[1]", b"<html>"):
        with pytest.raises(OipError) as broken:
            forwarded_response("app", httpx.Response(200, content=body))
        assert broken.value.status == 502, body


def test_a_forwarded_query_asks_for_every_output_in_binary() -> None:
    """A gRPC client's ``binary_data`` on an output means nothing over gRPC (its outputs are
    raw); forwarded to the app's dispatcher, a false one would have the REST route answer the
    output as JSON. The forward asks for each output in binary instead."""
    request: Any = _raw("FP32", _array("FP32"))
    asked = request.outputs.add(name="y")
    asked.parameters["binary_data"].bool_param = False
    document, binary = request_document(request, None)
    sent: list[httpx.Request] = []

    def answer(given: httpx.Request) -> httpx.Response:
        sent.append(given)
        return httpx.Response(200, content=b"{}")

    class _Forwarder:
        def __init__(self) -> None:
            self._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))

        def client(self) -> httpx.AsyncClient:
            return self._client

        def reached(self, url: str) -> None:
            pass

    async def forward() -> None:
        forwarder = _Forwarder()
        await forward_oip(forwarder, "http://owner", "app", document, binary, None)  # type: ignore[arg-type]
        await forwarder.client().aclose()

    asyncio.run(forward())
    (forwarded,) = sent
    length = int(forwarded.headers["inference-header-content-length"])
    header = json.loads(forwarded.content[:length])
    assert header["parameters"]["binary_data_output"] is True
    assert header["outputs"] == [{"name": "y", "parameters": {}}]
    assert forwarded.content[length:] == binary


def test_binary_switches_that_are_not_booleans_are_refused_as_rest_refuses_them() -> None:
    request: Any = _raw("FP32", _array("FP32"))
    request.parameters["binary_data_output"].string_param = "x"
    with pytest.raises(OipError) as refused:
        request_document(request, None)
    assert str(refused.value) == "parameters.binary_data_output must be true or false, got str 'x'"
    request: Any = _raw("FP32", _array("FP32"))  # type: ignore[no-redef]
    request.outputs.add(name="y").parameters["binary_data"].string_param = "yes"
    with pytest.raises(OipError, match=r"^outputs\[0\]\.parameters\.binary_data must be true or"):
        request_document(request, None)
    request.outputs[0].parameters["binary_data"].bool_param = True
    assert parse_query(_signature("FP32"), *request_document(request, None)).outputs == ("y",)


def test_output_shared_memory_and_classification_are_refused_naming_the_output() -> None:
    """As ``tritonclient.grpc`` asks for them (``set_shared_memory``, ``class_count``)."""
    shared = grpcclient.InferRequestedOutput("y")
    shared.set_shared_memory("region1", 40)
    classified = grpcclient.InferRequestedOutput("y", class_count=3)
    for output, named in (
        (shared, "shared_memory_byte_size, shared_memory_region"),
        (classified, "classification"),
    ):
        request: Any = _raw("FP32", _array("FP32"))
        request.outputs.append(output._get_tensor())
        with pytest.raises(OipError) as refused:
            parse_query(_signature("FP32"), *request_document(request, None))
        assert str(refused.value) == f"output 'y': parameters are not served ({named})"


def test_typed_contents_are_counted_against_the_shape_before_they_are_copied() -> None:
    """60 MiB of values for a [2, 3] input had been copied into a list on the event loop before
    the route counted them: now :func:`request_document` refuses them itself, and says which
    field a datatype's values travel in."""
    request = pb.ModelInferRequest(model_name="app")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    tensor.contents.fp32_contents.extend([0.5] * 100_000)
    with pytest.raises(OipError) as refused:
        request_document(request, None)
    assert str(refused.value) == "input 'x': 'data' holds 100000 values, shape [2, 3] needs 6"
    for datatype, field, wrong in (
        ("FP32", "fp32_contents", "int_contents"),
        ("BOOL", "bool_contents", "int_contents"),
        ("INT8", "int_contents", "int64_contents"),
    ):
        request = pb.ModelInferRequest(model_name="app")
        tensor = request.inputs.add(name="x", datatype=datatype, shape=[2, 3])
        getattr(tensor.contents, wrong).extend([1] * 6)
        with pytest.raises(OipError) as refused:
            request_document(request, None)
        assert str(refused.value) == f"input 'x': {datatype} values travel in {field}, not {wrong}"


_WIDE = ModelSignature(
    (TensorSpec("x", "FP32", (-1, 3)),),
    (TensorSpec("y", "FP32", (-1, 1000)), TensorSpec("z", "INT8", (-1, -1))),
)


def test_answer_bytes_count_the_outputs_of_known_size() -> None:
    assert answer_bytes_at_least(_WIDE, ("y", "z"), 3) == 12_000
    assert answer_bytes_at_least(_WIDE, ("z",), 3) == 0


class _Services:
    forwarder = None
    store = None


def _served(
    monkeypatch: pytest.MonkeyPatch, outputs: list[tuple[str, str, np.ndarray]]
) -> list[object]:
    """:class:`GrpcOip` over a serving loop stood in for: ``_WIDE``'s signature, ``outputs``
    the answer; the queries sent to it."""
    sent: list[object] = []

    async def signature_of(*_: object) -> ModelSignature:
        return _WIDE

    async def serve_parsed(*args: Any) -> Answered:
        sent.append(args[4])
        timings = ("total_ms", "queue_ms", "service_ms", "transport_ms", "compute_ms", "api_ms")
        result = SimpleNamespace(models=("m",), gear="g", late=False, **dict.fromkeys(timings, 0.0))
        return Answered(None, outputs, result)  # type: ignore[arg-type]

    monkeypatch.setattr(grpc_oip, "serving_of", lambda *_: object())
    monkeypatch.setattr(grpc_oip, "signature_of", signature_of)
    monkeypatch.setattr(grpc_oip, "serve_parsed", serve_parsed)
    return sent


def _infer(rows: int, outputs: tuple[str, ...], limit: int) -> Any:
    request = _raw("FP32", np.zeros((rows, 3), dtype=np.float32))
    for name in outputs:
        request.outputs.add(name=name)  # type: ignore[attr-defined]
    service = GrpcOip(_Services(), max_message_bytes=limit, max_calls=1)  # type: ignore[arg-type]
    call = grpc_oip._Call(None, None)
    return asyncio.run(service.model_infer(request, None, call))


def test_an_answer_past_the_message_limit_is_refused_before_the_workers_compute_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3 rows of a [1000] FP32 output take 12,000 bytes: past a limit of 10,000 the query is
    RESOURCE_EXHAUSTED (413) with a message naming the app, the size and the limit, and never
    sent; 2 rows are answered."""
    sent = _served(monkeypatch, [("y", "FP32", np.zeros((2, 1000), np.float32))])
    with pytest.raises(OipError) as refused:
        _infer(3, ("y",), 10_000)
    assert refused.value.status == 413 and sent == []
    assert grpc_oip.grpc_code(413) == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = str(refused.value)
    assert message.startswith("app 'app': the answer takes 12,000 bytes")
    assert "limit of 10,000 bytes" in message and "fewer rows or fewer outputs" in message
    answer = _infer(2, ("y",), 10_000)
    assert len(sent) == 1 and len(answer.raw_output_contents[0]) == 8_000


def test_an_answer_of_unknown_size_is_measured_before_it_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An output whose size the signature leaves open (``z``: [-1, -1]) is computed; an answer
    past the limit is then refused as one of known size is, not handed to grpc to fail."""
    sent = _served(monkeypatch, [("z", "INT8", np.zeros((2, 20_000), np.int8))])
    with pytest.raises(OipError) as refused:
        _infer(2, ("z",), 10_000)
    assert refused.value.status == 413 and len(sent) == 1
    assert "past gRPC's message limit of 10,000 bytes" in str(refused.value)
    assert len(_infer(2, ("z",), 100_000).raw_output_contents[0]) == 40_000


def test_a_call_its_client_cancelled_sooner_is_not_counted_as_cut_by_its_deadline() -> None:
    """The 504 of a call grpc cancelled (``cut_by_deadline``): a cancel about at the deadline
    (a trip's jitter either side) is the deadline's; one of a call under 1 s that its client
    cancelled well before it is not (the slack of 1 s alone counted each as a 504); without a
    deadline, none is."""
    assert grpc_oip.cut_by_deadline(0.005, 1.0)
    assert grpc_oip.cut_by_deadline(-0.003, 0.2)
    assert grpc_oip.cut_by_deadline(0.9, 30.0)
    assert not grpc_oip.cut_by_deadline(0.7, 0.8)  # cancelled 0.1 s into a 0.8 s deadline
    assert not grpc_oip.cut_by_deadline(0.15, 0.2)
    assert not grpc_oip.cut_by_deadline(5.0, 30.0)
    assert not grpc_oip.cut_by_deadline(None, None)
