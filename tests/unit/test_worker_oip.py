"""The Open Inference Protocol v2 wire format against a model's signature
(provisioners.worker.oip): requests checked and decoded, answers and metadata spelled."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from provisioners.artifacts import FAMILY_SIGNATURE, ModelSignature, TensorSpec
from provisioners.worker.oip import (
    MAX_MESSAGE_CHARS,
    OipError,
    encode_tensor,
    infer_response,
    load_json,
    model_metadata,
    parse_infer_request,
)

TABULAR = ModelSignature(
    (TensorSpec("features", "FP32", (-1, 13)), TensorSpec("ids", "INT64", (-1, 2))),
    (TensorSpec("logits", "FP32", (-1, 3)), TensorSpec("embedding", "FP16", (-1, 4))),
)


def tensor(name: str, shape: list[int], data: Any, datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def request(batch: int = 2, **changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "inputs": [
            tensor("features", [batch, 13], [0.5] * (13 * batch)),
            tensor("ids", [batch, 2], list(range(2 * batch)), "INT64"),
        ]
    }
    document.update(changes)
    return document


def refusal(document: Any, signature: ModelSignature = TABULAR, limit: int = 8) -> OipError:
    with pytest.raises(OipError) as refused:
        parse_infer_request(document, signature, max_batch_size=limit)
    assert "\n" not in str(refused.value)
    return refused.value


def test_a_request_becomes_arrays_of_the_signatures_types_in_its_order() -> None:
    document = request(batch=3, id="q-1")
    document["inputs"].reverse()  # any order on the wire
    parsed = parse_infer_request(json.dumps(document).encode(), TABULAR, max_batch_size=8)
    assert list(parsed.inputs) == ["features", "ids"]
    assert parsed.batch_size == 3 and parsed.id == "q-1" and parsed.outputs is None
    features, ids = parsed.inputs["features"], parsed.inputs["ids"]
    assert features.dtype == np.float32 and features.shape == (3, 13)
    assert ids.dtype == np.int64 and ids.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_nested_data_is_accepted_like_flat_data_and_integers_fill_floats() -> None:
    rows = [[float(i + 13 * r) for i in range(13)] for r in range(2)]
    nested = request(
        inputs=[tensor("features", [2, 13], rows), tensor("ids", [2, 2], [[1, 2]] * 2, "INT64")]
    )
    flat = request(
        inputs=[
            tensor("features", [2, 13], list(range(26))),
            tensor("ids", [2, 2], [1, 2, 1, 2], "INT64"),
        ]
    )
    one = parse_infer_request(nested, TABULAR, max_batch_size=8)
    two = parse_infer_request(flat, TABULAR, max_batch_size=8)
    np.testing.assert_array_equal(one.inputs["features"], two.inputs["features"])
    np.testing.assert_array_equal(one.inputs["ids"], two.inputs["ids"])
    assert one.inputs["features"].dtype == np.float32


def test_requested_outputs_are_kept_in_the_order_asked() -> None:
    parsed = parse_infer_request(
        request(outputs=[{"name": "embedding"}, {"name": "logits"}]), TABULAR, max_batch_size=8
    )
    assert parsed.outputs == ("embedding", "logits")


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ([1, 2], "JSON object"),
        (request(extra=1), "unknown keys: extra"),
        (request(id=3), "'id'"),
        ({"inputs": []}, "'inputs'"),
        ({"inputs": [3]}, "inputs[0] must be an object"),
        (request(inputs=[{"shape": [1, 13]}]), "inputs[0]: 'name'"),
        (request(inputs=[tensor("other", [1, 1], [1])]), "input 'other' is not an input"),
        (request(inputs=[tensor("features", [1, 13], [0] * 13)] * 2), "given twice"),
        (request(inputs=[tensor("features", [1, 13], [0] * 13)]), "input 'ids' is missing"),
    ],
)
def test_malformed_requests_are_refused_with_one_line(document: Any, fragment: str) -> None:
    error = refusal(document)
    assert error.status == 400
    assert fragment in str(error)


def with_features(entry: dict[str, Any], batch: int = 1) -> dict[str, Any]:
    ids = tensor("ids", [batch, 2], [0] * (2 * batch), "INT64")
    return {"inputs": [entry, ids]}


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        (tensor("features", [1, 13], [0] * 13, "FP64"), "datatype 'FP64', expected 'FP32'"),
        ({"name": "features", "shape": [1, 13], "data": [0] * 13}, "datatype None"),
        (tensor("features", [1, 13], [0] * 12), "holds 12 values, shape [1, 13] needs 13"),
        (tensor("features", [1, 12], [0] * 12), "does not fit [-1, 13] (dimension 1)"),
        (tensor("features", [13], [0] * 13), "has 1 dimensions"),
        (tensor("features", [1, 13.0], [0] * 13), "'shape' must be a list of integers"),
        (tensor("features", "1x13", [0] * 13), "'shape' must be a list of integers"),
        (tensor("features", [1, 13], "zeros"), "'data' must be a list"),
        (tensor("features", [1, 13], ["1"] * 13), "must hold FP32 values"),
        (tensor("features", [1, 13], [None] * 13), "must hold FP32 values"),
        (tensor("features", [1, 13], [[1, 2], [3]]), "must hold FP32 values"),
        (tensor("features", [1, 13], [True] * 13), "must be numbers"),
        (tensor("features", [1, 13], [1e39] * 13), "too large for FP32"),
        (tensor("features", [1, 13], [0.0] * 12 + [float("nan")]), "a value is NaN"),
        ({**tensor("features", [1, 13], [0] * 13), "extra": 1}, "unknown keys: extra"),
    ],
)
def test_a_tensor_that_does_not_fit_is_refused_naming_the_input(
    entry: dict[str, Any], fragment: str
) -> None:
    error = refusal(with_features(entry))
    assert error.status == 400
    assert "input 'features'" in str(error)
    assert fragment in str(error)


def test_batch_sizes_are_bounded_and_shared_by_the_inputs() -> None:
    assert "outside 1..8" in str(refusal(request(batch=9)))
    empty = with_features(tensor("features", [0, 13], []), batch=0)
    assert "outside 1..8" in str(refusal(empty))
    mixed = {
        "inputs": [
            tensor("features", [2, 13], [0] * 26),
            tensor("ids", [1, 2], [0, 0], "INT64"),
        ]
    }
    assert "batch size 1 differs from input 'features''s 2" in str(refusal(mixed))


def test_integer_and_bool_inputs_take_only_their_values() -> None:
    signature = ModelSignature(
        (TensorSpec("mask", "BOOL", (-1, 2)), TensorSpec("small", "UINT8", (-1,))),
        (TensorSpec("out", "FP32", (-1,)),),
    )

    def document(mask: Any, small: Any) -> dict[str, Any]:
        return {
            "inputs": [
                tensor("mask", [1, 2], mask, "BOOL"),
                tensor("small", [1], small, "UINT8"),
            ]
        }

    parsed = parse_infer_request(document([True, False], [255]), signature, max_batch_size=4)
    assert parsed.inputs["mask"].dtype == np.bool_ and parsed.inputs["small"].tolist() == [255]
    assert "true or false" in str(refusal(document([1, 0], [1]), signature))
    assert "must be integers" in str(refusal(document([True, True], [1.5]), signature))
    assert "outside UINT8's 0..255" in str(refusal(document([True, True], [256]), signature))
    assert "outside UINT8's 0..255" in str(refusal(document([True, True], [-1]), signature))
    assert "input 'small'" in str(refusal(document([True, True], [2**70]), signature))


def test_an_integer_past_64_bits_read_as_a_float_is_out_of_range() -> None:
    """orjson (the service's JSON reader) gives an integer past 64 bits as a float: refused
    as past the datatype's range, not as "must be integers"."""
    import orjson

    signature = ModelSignature(
        (TensorSpec("ids", "INT64", (-1, 2)),), (TensorSpec("out", "FP32", (-1,)),)
    )
    data = orjson.loads(b"[1, -9223372036854775809]")
    assert isinstance(data[1], float)
    document = {"inputs": [tensor("ids", [1, 2], data, "INT64")]}
    message = str(refusal(document, signature))
    assert "outside INT64's -9223372036854775808..9223372036854775807" in message
    # A fraction is still no integer.
    document = {"inputs": [tensor("ids", [1, 2], [1, 2.5], "INT64")]}
    assert "must be integers" in str(refusal(document, signature))


def test_uint64_takes_its_whole_range_beside_small_integers() -> None:
    """numpy reads [1, 2**63] as floats (no signed 64-bit integer holds both): the values are
    still UINT64's, to its top, and refused past it or beside a fraction or a negative."""
    signature = ModelSignature(
        (TensorSpec("x", "UINT64", (-1, 3)),), (TensorSpec("out", "FP32", (-1,)),)
    )
    top = 2**64 - 1

    def document(data: Any) -> dict[str, Any]:
        return {"inputs": [tensor("x", [1, 3], data, "UINT64")]}

    parsed = parse_infer_request(document([1, 2**63, top]), signature, max_batch_size=4)
    assert parsed.inputs["x"].dtype == np.uint64
    assert parsed.inputs["x"].tolist() == [[1, 2**63, top]]
    assert "must be integers" in str(refusal(document([1.5, 2, 2**63]), signature))
    assert "outside UINT64's" in str(refusal(document([-1, 2, 2**63]), signature))
    assert "input 'x'" in str(refusal(document([1, 2, 2**64]), signature))


def test_unknown_or_repeated_outputs_are_refused() -> None:
    assert "output 'x' is not an output" in str(refusal(request(outputs=[{"name": "x"}])))
    twice = request(outputs=[{"name": "logits"}, {"name": "logits"}])
    assert "asked for twice" in str(refusal(twice))
    assert "'outputs'" in str(refusal(request(outputs={"name": "logits"})))
    assert "outputs[0]" in str(refusal(request(outputs=["logits"])))


def test_bodies_that_are_not_json_are_refused() -> None:
    for body in (b"{", b"\xff\xfe", b'{"inputs": [NaN]}'):
        with pytest.raises(OipError) as refused:
            load_json(body)
        assert refused.value.status == 400
        assert "not JSON" in str(refused.value)
    assert "NaN is not a number" in str(refusal(b'{"inputs": [NaN]}'))


def test_a_body_nested_past_the_stack_is_a_400() -> None:
    """orjson refuses 1,024 levels and more; the json module it falls back to raised
    RecursionError, which the worker agent's handler did not take: the connection closed with
    no answer and a traceback in the worker's log."""
    depth = 100_000
    for body in (b"[" * depth + b"]" * depth, b'{"inputs": ' + b"[" * depth + b"]" * depth + b"}"):
        with pytest.raises(OipError) as refused:
            load_json(body)
        assert refused.value.status == 400 and "nested too deeply" in str(refused.value)
        with pytest.raises(OipError, match="nested too deeply"):
            parse_infer_request(body, TABULAR, max_batch_size=8)


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "\\ud800", "inputs": []}',
        b'{"\\ud800": 1, "inputs": []}',
        b'{"inputs": [{"name": "x\\udfff"}]}',
        b'{"parameters": {"tag": ["a", "\\ud83d"]}, "inputs": []}',
    ],
)
def test_text_that_is_not_utf8_is_refused_in_a_message_that_encodes(body: bytes) -> None:
    """json takes a lone surrogate (orjson does not): a string no answer could encode, refused
    before the document is read, by a message that quotes it escaped."""
    with pytest.raises(OipError) as refused:
        load_json(body)
    message = str(refused.value)
    assert refused.value.status == 400 and "is not UTF-8 text" in message
    assert "\\ud" in message
    json.dumps({"error": message}, ensure_ascii=False).encode("utf-8")
    # The same body as a str (parse_infer_request takes one) is refused alike.
    with pytest.raises(OipError, match="is not UTF-8 text"):
        parse_infer_request(body.decode(), TABULAR, max_batch_size=8)


def test_a_refusal_quoting_a_long_name_stays_one_bounded_line() -> None:
    """An input name (or a version, an output name) of any length was quoted whole: over gRPC
    the message is a header a client refuses past 16 KiB. Cut as the API cuts its own."""
    name = "q" * 20_000
    document = {"inputs": [{"name": name, "datatype": "FP32", "shape": [1, 13], "data": []}]}
    message = str(refusal(document))
    assert message.startswith("input 'qqq") and message.endswith("...")
    assert len(message) == MAX_MESSAGE_CHARS
    assert len(str(OipError("\ud800" * 1000))) == MAX_MESSAGE_CHARS  # escaped, then cut
    assert str(OipError("short")) == "short"


def test_a_refusals_message_always_encodes() -> None:
    error = OipError("unknown keys: \ud800")
    assert str(error) == "unknown keys: \\ud800"
    str(error).encode("utf-8")


@pytest.mark.parametrize("given", ["x", [1], None, 3])
def test_parameters_must_be_objects(given: Any) -> None:
    """The protocol's ``$parameters`` is an object: of the request, of an input and of a
    requested output (``tritonclient`` never sends null: neither is it taken)."""
    assert "'parameters' must be an object" in str(refusal(request(parameters=given)))
    entry = {**tensor("features", [1, 13], [0] * 13), "parameters": given}
    assert "input 'features': 'parameters' must be an object" in str(refusal(with_features(entry)))
    asked = request(outputs=[{"name": "logits", "parameters": given}])
    assert "outputs[0]: 'parameters' must be an object" in str(refusal(asked))
    parse_infer_request(request(parameters={"timeout": 5}), TABULAR, max_batch_size=8)


@pytest.mark.parametrize(
    ("datatype", "data", "fragment"),
    [
        ("FP32", [1.5] * 12 + [True], "FP32 data must be numbers"),
        ("FP32", [[0.5] * 12 + [False]], "FP32 data must be numbers"),
        ("FP64", [False] + [1] * 12, "FP64 data must be numbers"),
    ],
)
def test_booleans_among_numbers_are_refused(datatype: str, data: Any, fragment: str) -> None:
    """numpy makes ``[true, 1.5]`` a float array: a boolean among numbers is refused as one
    alone is (only ``BOOL`` takes them)."""
    entry = tensor("features", [1, 13], data, datatype)
    signature = ModelSignature(
        (TensorSpec("features", datatype, (-1, 13)), TensorSpec("ids", "INT64", (-1, 2))),
        TABULAR.outputs,
    )
    assert fragment in str(refusal(with_features(entry), signature))
    ids = tensor("ids", [1, 2], [[3], [True]], "INT64")
    mixed = {"inputs": [tensor("features", [1, 13], [0] * 13), ids]}
    assert "INT64 data must be integers" in str(refusal(mixed))


def test_an_answer_is_flattened_row_major_with_its_datatype_and_shape() -> None:
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    embedding = np.ones((2, 4), dtype=np.float16)
    answer = infer_response(
        "tabular",
        {"logits": logits, "embedding": embedding},
        names=("embedding", "logits"),
        request_id="q-1",
        parameters={"served_ms": 1.5},
    )
    assert answer == {
        "model_name": "tabular",
        "model_version": "1",
        "id": "q-1",
        "outputs": [
            {"name": "embedding", "datatype": "FP16", "shape": [2, 4], "data": [1.0] * 8},
            {
                "name": "logits",
                "datatype": "FP32",
                "shape": [2, 3],
                "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            },
        ],
        "parameters": {"served_ms": 1.5},
    }
    plain = infer_response("tabular", {"logits": logits})
    assert set(plain) == {"model_name", "model_version", "outputs"}
    assert encode_tensor("b", np.array([True]))["datatype"] == "BOOL"
    with pytest.raises(OipError) as refused:
        encode_tensor("s", np.array(["text"]))
    assert refused.value.status == 500


def test_metadata_names_the_models_tensors() -> None:
    assert model_metadata("tiny", FAMILY_SIGNATURE, "pytorch_torch") == {
        "name": "tiny",
        "versions": ["1"],
        "platform": "pytorch_torch",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
    }


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (float("nan"), "a value is NaN: FP32 inputs must be finite numbers"),
        (float("inf"), "a value is infinite: FP32 inputs must be finite numbers"),
        (float("-inf"), "a value is infinite"),
    ],
)
def test_a_binary_nan_or_infinity_is_refused_as_such(value: float, fragment: str) -> None:
    from provisioners.worker.oip import binary_request_body, split_infer_body, with_binary_inputs

    features = np.zeros((1, 13), np.float32)
    features[0, 4] = value
    ids = np.zeros((1, 2), np.int64)
    body, length = binary_request_body([("features", "FP32", features), ("ids", "INT64", ids)])
    document, binary = split_infer_body(body, str(length))
    error = refusal(with_binary_inputs(document, binary, TABULAR))
    assert error.status == 400 and f"input 'features': {fragment}" in str(error)


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        (
            {"shared_memory_region": "r1", "shared_memory_byte_size": 40},
            "shared_memory_byte_size, shared_memory_region",
        ),
        ({"shared_memory_offset": 0, "binary_data": True}, "shared_memory_offset"),
        ({"classification": 2}, "classification"),
    ],
)
def test_output_parameters_not_served_are_refused_naming_them(
    parameters: dict[str, Any], named: str
) -> None:
    """Shared memory or classification asked of an output had been ignored: the whole tensor
    answered inline, not what the client asked for."""
    error = refusal(request(outputs=[{"name": "logits", "parameters": parameters}]))
    assert error.status == 400
    assert str(error) == f"output 'logits': parameters are not served ({named})"
    served = request(outputs=[{"name": "logits", "parameters": {"binary_data": True}}])
    assert parse_infer_request(served, TABULAR, max_batch_size=8).outputs == ("logits",)


def test_binary_bytes_of_another_datatype_are_refused_for_their_datatype() -> None:
    """14 bytes declared BYTES for an FP32 input: the datatype is the mistake, not the count
    of bytes in FP32's item size."""
    from provisioners.worker.oip import binary_request_body, split_infer_body, with_binary_inputs

    features = np.zeros((1, 13), np.float32)
    ids = np.zeros((1, 2), np.int64)
    body, length = binary_request_body([("features", "FP32", features), ("ids", "INT64", ids)])
    document, binary = split_infer_body(body, str(length))
    document["inputs"][0]["datatype"] = "BYTES"
    document["inputs"][0]["parameters"]["binary_data_size"] = 14
    with pytest.raises(OipError, match="input 'features': datatype 'BYTES', expected 'FP32'"):
        with_binary_inputs(document, binary[:14] + binary[52:], TABULAR)


HALF = ModelSignature((TensorSpec("half", "FP16", (-1, 2)),), FAMILY_SIGNATURE.outputs)
DOUBLE = ModelSignature((TensorSpec("double", "FP64", (-1, 2)),), FAMILY_SIGNATURE.outputs)


@pytest.mark.parametrize(
    ("signature", "data", "message"),
    [
        (TABULAR, [-1e39] + [0.0] * 12, "input 'features': a value is too large for FP32"),
        (TABULAR, [0.0] * 12 + [float("-inf")], "input 'features': a value is infinite:"),
        (HALF, [65504.0, -65504.0], None),
        (HALF, [65504, -65504], None),
        (HALF, [0.5, -65536.0], "input 'half': a value is too large for FP16"),
        (HALF, [1, -70000], "input 'half': a value is too large for FP16"),
        (HALF, [1, -(2**63)], "input 'half': a value is too large for FP16"),
        (HALF, [1, 2**64 - 1], "input 'half': a value is too large for FP16"),
        (DOUBLE, [1e308, -1e308], None),
        (DOUBLE, [0.5, float("inf")], "input 'double': a value is infinite: FP64 inputs must"),
        (DOUBLE, [float("nan"), 0.5], "input 'double': a value is NaN: FP64 inputs must"),
    ],
)
def test_values_past_a_float_types_range_are_refused_with_their_reason(
    signature: ModelSignature, data: list[float], message: str | None
) -> None:
    """Values of a float type no wider than the input's are checked for NaN and infinities
    alone, wider ones and integers by their least and largest: the same refusals either way."""
    spec = signature.inputs[0]
    document = {"inputs": [tensor(spec.name, [1, len(data)], data, spec.datatype)]}
    if signature is TABULAR:
        document["inputs"].append(tensor("ids", [1, 2], [0, 1], "INT64"))
    if message is None:
        parsed = parse_infer_request(document, signature, max_batch_size=8)
        assert parsed.inputs[spec.name].tolist() == [data]
        return
    assert str(refusal(document, signature)).startswith(message)


def test_a_missing_input_and_unknown_keys_are_named() -> None:
    assert str(refusal(request(zeta=1, alpha=2))) == "unknown keys: alpha, zeta"
    only_ids = request(inputs=[tensor("ids", [1, 2], [0, 1], "INT64")])
    assert str(refusal(only_ids)) == "input 'features' is missing"
    extra = {**tensor("features", [1, 13], [0] * 13), "b": 1, "a": 2}
    assert str(refusal(with_features(extra))) == "input 'features': unknown keys: a, b"
