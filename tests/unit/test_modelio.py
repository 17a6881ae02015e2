"""The dispatcher's Open Inference Protocol codec (:mod:`controlplane.serving.modelio`): request
bodies against a model's signature, predictions and certainty off the first output (margin and
max_prob against closed forms, the Python and numpy paths alike), the answer's parameters, raw
outputs stacked per request row, and the fake worker's logits that invert it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.errors import WorkerCallError
from controlplane.serving.modelio import (
    ModelIO,
    ModelIOError,
    WorkerReply,
    app_signature,
    resolve_sample_shape,
    stack_outputs,
)
from provisioners.artifacts import FAMILY_SIGNATURE, ModelSignature, TensorSpec
from provisioners.worker import agent
from provisioners.worker.oip import (
    InferRequest,
    parse_infer_request,
    split_infer_body,
    with_binary_inputs,
)
from tests.fake_worker import logits

TWO_INPUTS = ModelSignature(
    (TensorSpec("ids", "INT64", (-1, 3)), TensorSpec("mask", "BOOL", (-1, 3))),
    (TensorSpec("scores", "FP32", (-1, 4)), TensorSpec("label", "INT64", (-1,))),
)


def answer(outputs: list[dict[str, object]], parameters: dict[str, object] | None = None) -> bytes:
    document: dict[str, object] = {"model_name": "m", "model_version": "1", "outputs": outputs}
    if parameters is not None:
        document["parameters"] = parameters
    return json.dumps(document).encode()


def worker_reads(
    encoded: tuple[bytes, int], signature: ModelSignature = FAMILY_SIGNATURE
) -> InferRequest:
    """A body :meth:`ModelIO.encode` wrote, read as the worker agent reads it."""
    body, header_length = encoded
    document, binary = split_infer_body(body, str(header_length))
    filled = with_binary_inputs(document, binary, signature)
    return parse_infer_request(filled, signature, max_batch_size=256)


def test_a_family_batch_is_one_flat_fp32_tensor_in_binary_the_worker_parses() -> None:
    io = ModelIO("tiny")
    assert io.family and io.path == "/v2/models/tiny/infer"
    rows = [[float(i) + 0.1] * 64 for i in range(3)]
    body, header_length = io.encode(rows)
    document = json.loads(body[:header_length])
    (tensor,) = document["inputs"]
    assert tensor["name"] == "input" and tensor["datatype"] == "FP32"
    assert tensor["shape"] == [3, 64] and "data" not in tensor
    assert tensor["parameters"] == {"binary_data_size": 3 * 64 * 4}
    assert len(body) == header_length + 3 * 64 * 4
    parsed = worker_reads((body, header_length))
    assert parsed.inputs["input"].shape == (3, 64)
    # The values are the FP32 ones the rows round to, bit for bit (as JSON text gave them).
    assert np.array_equal(parsed.inputs["input"], np.asarray(rows, dtype=np.float32))


def test_a_batch_carries_the_calls_timeout_for_the_agent_to_budget_its_rows_alone() -> None:
    # The agent runs a failed batch's rows again alone within half the call's timeout (and its
    # health says it of the oldest batch): the dispatcher sends it as the protocol's
    # parameters.timeout (microseconds).
    body, header_length = ModelIO("tiny").encode([[0.5] * 64], timeout_s=2.0)
    document, _ = split_infer_body(body, str(header_length))
    assert document["parameters"] == {"timeout": 2_000_000}
    assert agent.caller_timeout_s(document) == 2.0
    assert worker_reads((body, header_length)).batch_size == 1  # the worker takes it
    plain, length = ModelIO("tiny").encode([[0.5] * 64])
    assert "parameters" not in json.loads(plain[:length])
    assert agent.caller_timeout_s(json.loads(plain[:length])) is None
    # What a direct caller may send instead: no bound, never an error.
    for timeout in (10**400, -5, 0, True, "100", float("inf")):
        assert agent.caller_timeout_s({"parameters": {"timeout": timeout}}) is None


def test_several_inputs_numpy_rows_and_dynamic_dimensions_encode() -> None:
    io = ModelIO("two", TWO_INPUTS, family=False)
    rows = [([1, 2, 3], [True, False, True]), (np.array([4, 5, 6]), np.array([False, True, True]))]
    parsed = worker_reads(io.encode(rows), TWO_INPUTS)
    assert parsed.inputs["ids"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert parsed.inputs["mask"].tolist() == [[True, False, True], [False, True, True]]
    with pytest.raises(ModelIOError, match="2 inputs"):
        io.encode([[1, 2, 3]])  # type: ignore[list-item]
    with pytest.raises(ModelIOError, match="3 values"):
        io.encode([([1, 2], [True, True, True])])
    # An image of any size: numpy rows keep their shape, flat rows fill the one dynamic one.
    image = ModelSignature(
        (TensorSpec("image", "FP32", (-1, 3, -1)),), (TensorSpec("y", "FP32", (-1, 2)),)
    )
    dynamic = ModelIO("img", image)
    body, header_length = dynamic.encode([np.zeros((3, 5)), [1.0] * 15])
    assert json.loads(body[:header_length])["inputs"][0]["shape"] == [2, 3, 5]
    assert worker_reads((body, header_length), image).inputs["image"][1].tolist() == [[1.0] * 5] * 3
    with pytest.raises(ModelIOError, match="cannot be stacked"):
        dynamic.encode([np.zeros((3, 5)), np.zeros((3, 4))])
    assert resolve_sample_shape(image.inputs[0], 12) == (3, 4)
    assert resolve_sample_shape(image.inputs[0], 13) is None
    with pytest.raises(ModelIOError, match="NaN or infinity"):
        ModelIO("tiny").encode([[math.nan] * 64])
    with pytest.raises(ModelIOError, match="NaN or infinity"):
        ModelIO("tiny").encode([np.full(64, np.inf, dtype=np.float32)])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([([1, 2, 3.5], [True, True, True])], "must be integers"),
        ([([1, 2, 2**63], [True, True, True])], "input 'ids'"),
        ([([1, 2, 3], [1, 0, 1])], "true or false"),
        ([(["1", "2", "3"], [True, True, True])], "INT64 values"),
        ([([1, [2], 3], [True, True, True])], "input 'ids'"),
    ],
)
def test_a_value_its_input_does_not_take_is_refused_before_the_call(
    rows: list[tuple[object, object]], message: str
) -> None:
    """What the worker would refuse (a fraction or a value past the range for an integer
    input, a number for BOOL, text, ragged rows) is a ModelIOError naming the input: the batch
    costs no call, and nothing is cast silently."""
    with pytest.raises(ModelIOError, match=message):
        ModelIO("two", TWO_INPUTS, family=False).encode(rows)


def test_uint64_values_past_int64_are_sent_as_they_are() -> None:
    signature = ModelSignature(
        (TensorSpec("n", "UINT64", (-1, 2)),), (TensorSpec("y", "FP32", (-1, 2)),)
    )
    body = ModelIO("big", signature, family=False).encode([[1, 2**63], [2, 2**64 - 1]])
    assert worker_reads(body, signature).inputs["n"].tolist() == [[1, 2**63], [2, 2**64 - 1]]
    dynamic = ModelSignature((TensorSpec("n", "UINT64", (-1, -1)),), signature.outputs)
    body = ModelIO("big", dynamic, family=False).encode([[1, 2**63], [2, 2**64 - 1]])
    assert worker_reads(body, dynamic).inputs["n"].tolist() == [[1, 2**63], [2, 2**64 - 1]]


def test_fp16_and_unsigned_values_keep_their_range() -> None:
    signature = ModelSignature(
        (TensorSpec("x", "FP16", (-1, 2)), TensorSpec("n", "UINT8", (-1, 2))),
        (TensorSpec("y", "FP32", (-1, 2)),),
    )
    io = ModelIO("h", signature, family=False)
    parsed = worker_reads(io.encode([([0.5, 65504], [0, 255])]), signature)
    assert parsed.inputs["x"].dtype == np.float16 and parsed.inputs["x"].tolist() == [
        [0.5, 65504.0]
    ]
    assert parsed.inputs["n"].tolist() == [[0, 255]]
    with pytest.raises(ModelIOError, match="too large for FP16"):
        io.encode([([0.5, 70000], [0, 1])])
    with pytest.raises(ModelIOError, match="outside UINT8"):
        io.encode([([0.5, 1.0], [-1, 1])])


@pytest.mark.parametrize("rows", [1, 3, 8, 40])  # both sides of the Python / numpy switch
def test_margin_and_max_prob_are_the_softmax_top_two(rows: int) -> None:
    rng = np.random.default_rng(rows)
    values = rng.normal(size=(rows, 10)) * 3
    body = answer(
        [
            {
                "name": "logits",
                "datatype": "FP32",
                "shape": [rows, 10],
                "data": values.ravel().tolist(),
            }
        ]
    )
    p = np.exp(values - values.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top2 = np.sort(p, axis=1)[:, -2:]
    margin = ModelIO("m").decode("w", body, rows)
    assert margin.predictions == tuple(values.argmax(axis=1).tolist())
    assert margin.certainty == pytest.approx((top2[:, 1] - top2[:, 0]).tolist(), abs=1e-12)
    most = ModelIO("m", certainty="max_prob").decode("w", body, rows)
    assert most.predictions == margin.predictions
    assert most.certainty == pytest.approx(top2[:, 1].tolist(), abs=1e-12)
    # A foreign server: no parameters, nested data, the outputs in another order.
    nested = answer(
        [
            {"name": "other", "datatype": "FP32", "shape": [rows, 1], "data": [[0.0]] * rows},
            {"name": "logits", "datatype": "FP32", "shape": [rows, 10], "data": values.tolist()},
        ]
    )
    foreign = ModelIO("m").decode("w", nested, rows)
    assert foreign.predictions == margin.predictions
    assert foreign.certainty == pytest.approx(margin.certainty, abs=1e-12)
    assert (foreign.served_ms, foreign.instance_type) == (None, "")


@given(
    st.integers(0, 9),
    st.floats(0.0, 1.0),
    st.sampled_from(["margin", "max_prob"]),
    st.integers(1, 12),
)
def test_the_fake_workers_logits_give_back_the_class_and_certainty(
    klass: int, certainty: float, kind: str, rows: int
) -> None:
    data = logits(klass, certainty, 10, kind) * rows
    body = answer([{"name": "logits", "datatype": "FP32", "shape": [rows, 10], "data": data}])
    reply = ModelIO("m", certainty=kind).decode("w", body, rows)
    assert reply.predictions == (klass,) * rows
    wanted = certainty if kind == "margin" else max(certainty, 0.1)
    assert reply.certainty == pytest.approx((wanted,) * rows, abs=1e-5)


def test_one_value_outputs_parameters_and_malformed_answers() -> None:
    labels = ModelSignature(FAMILY_SIGNATURE.inputs, (TensorSpec("label", "INT64", (-1, 1)),))
    body = answer(
        [{"name": "label", "datatype": "INT64", "shape": [2, 1], "data": [7, 3]}],
        {"served_ms": 2.5, "instance_type": "g4dn.xlarge", "emulated": False},
    )
    reply = ModelIO("m", labels).decode("w", body, 2)
    assert reply.predictions == (7, 3) and reply.certainty == (1.0, 1.0)
    assert (reply.served_ms, reply.instance_type) == (2.5, "g4dn.xlarge")
    score = ModelSignature(FAMILY_SIGNATURE.inputs, (TensorSpec("score", "FP32", (-1,)),))
    body = answer([{"name": "score", "datatype": "FP32", "shape": [2], "data": [0.2, 0.9]}])
    assert ModelIO("m", score).decode("w", body, 2).predictions == (0, 0)
    bad_served = answer(
        [{"name": "score", "datatype": "FP32", "shape": [1], "data": [0.2]}],
        {"served_ms": -1.0},
    )
    assert ModelIO("m", score).decode("w", bad_served, 1).served_ms is None
    for broken, match in [
        (b"not json", "not an inference answer"),
        (b'{"outputs": []}', "without outputs"),
        (answer([{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": 5}]), "not a list"),
    ]:
        with pytest.raises(WorkerCallError, match=match) as caught:
            ModelIO("m").decode("w", broken, 2)
        assert caught.value.kind == "malformed" and caught.value.worker_fault
    # An answer whose first output does not fit the batch is the model's fault (it answered):
    # the batch fails, the worker stays healthy.
    for unfit, match in [
        (answer([{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1]}]), "1 values"),
        (answer([{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]), "2 rows"),
    ]:
        with pytest.raises(WorkerCallError, match=match) as caught:
            ModelIO("m").decode("w", unfit, 2)
        assert caught.value.kind == "model" and not caught.value.worker_fault


def test_a_models_nan_and_infinity_are_read_as_the_agent_writes_them() -> None:
    """The agent writes a model's non-finite outputs as JSON's NaN and Infinity (as Python's
    json and Triton do); orjson refuses them, so the answer is read by the standard parser."""
    document = {
        "outputs": [
            {
                "name": "scores",
                "datatype": "FP16",
                "shape": [2, 3],
                "data": [float("inf"), 0.0, 1.0, float("nan"), 2.0, -float("inf")],
            }
        ]
    }
    body = json.dumps(document).encode()
    assert b"Infinity" in body and b"NaN" in body
    reply = ModelIO("m", family=False).decode("w", body, 2)
    data = reply.outputs[0].data
    assert data[0] == float("inf") and math.isnan(data[3]) and data[5] == -float("inf")
    assert reply.predictions[0] == 0
    with pytest.raises(ValueError, match="certainty"):
        ModelIO("m", certainty="entropy")


def test_raw_outputs_stack_per_request_row_across_replies() -> None:
    io = ModelIO("two", TWO_INPUTS, family=False)

    def reply(scores: list[list[float]], labels: list[int]) -> WorkerReply:
        n = len(labels)
        return io.decode(
            "w",
            answer(
                [
                    {"name": "scores", "datatype": "FP32", "shape": [n, 4], "data": scores},
                    {"name": "label", "datatype": "INT64", "shape": [n], "data": labels},
                ]
            ),
            n,
        )

    first = reply([[0, 0, 0, 1], [1, 0, 0, 0]], [3, 0])
    second = reply([[0, 1, 0, 0]], [1])
    stacked = stack_outputs([(first, 1), (second, 0), (first, 0)], ["label", "scores"])
    (label_name, label_type, labels), (_, scores_type, scores) = stacked
    assert (label_name, label_type, labels.tolist()) == ("label", "INT64", [0, 1, 3])
    assert labels.dtype == np.int64 and scores_type == "FP32" and scores.dtype == np.float32
    assert scores.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]]
    with pytest.raises(ModelIOError, match="no output 'nope'"):
        stack_outputs([(first, 0)], ["nope"])
    signature = app_signature([ModelIO("a"), io])
    assert signature.inputs == FAMILY_SIGNATURE.inputs and signature.outputs == TWO_INPUTS.outputs


def test_rank_one_inputs_take_the_scalar_rows_v2_splits_them_into() -> None:
    """A rank-1 input ([-1]: one value a sample) arrives from ``/v2`` and gRPC as the rows of a
    1-D array, numpy scalars (``list(array)``), alone or beside other inputs; they had reached
    the fixed-shape path that iterates each row ("'numpy.float32' object is not iterable", a
    422 on every query to a model the registry took)."""
    signature = ModelSignature(
        (TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "FP32", (-1, 2)),)
    )
    values = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    parsed = worker_reads(ModelIO("r", signature, family=False).encode(list(values)), signature)
    assert parsed.inputs["x"].shape == (3,) and parsed.inputs["x"].tolist() == [1.5, -2.0, 0.25]
    # /v1's rows of one value each, and plain numbers, as before.
    parsed = worker_reads(ModelIO("r", signature, family=False).encode([[1.5], [-2.0]]), signature)
    assert parsed.inputs["x"].tolist() == [1.5, -2.0]
    two = ModelSignature(
        (TensorSpec("n", "INT64", (-1,)), TensorSpec("m", "UINT8", (-1, 1, 2, 2))),
        signature.outputs,
    )
    n = np.array([7, -3], dtype=np.int64)
    m = np.arange(8, dtype=np.uint8).reshape(2, 1, 2, 2)
    rows = list(zip(n, m, strict=True))
    parsed = worker_reads(ModelIO("two", two, family=False).encode(rows), two)
    assert parsed.inputs["n"].tolist() == [7, -3]
    assert np.array_equal(parsed.inputs["m"], m)
