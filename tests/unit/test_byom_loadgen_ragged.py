"""``heteroplane loadgen --inputs`` with Open Inference Protocol JSON rows whose shapes differ
along a variable axis (a sequence's length: :mod:`controlplane.clients.tensors`): each query
carries its rows in their own shape; rows of different shapes drawn into one query are a
one-line refusal, not numpy's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from controlplane.clients.loadgen import build_tensor_queries
from controlplane.clients.tensors import InputSpec, fit_inputs, read_inputs, tensor_body
from estimator.traces import Trace

IDS = [InputSpec("ids", "INT64", (-1, -1))]
LENGTHS = (2, 5, 9)


def ragged_file(tmp_path: Path) -> Path:
    requests = [
        {"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, n], "data": list(range(n))}]}
        for n in LENGTHS
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(requests))
    return path


def test_rows_of_their_own_lengths_go_one_a_query_in_their_shapes(tmp_path: Path) -> None:
    arrays = fit_inputs(read_inputs(ragged_file(tmp_path)), IDS)
    assert len(arrays["ids"]) == 3
    trace = Trace(np.array([0.0, 0.1, 0.2, 0.3]), np.array([1, 1, 1, 1]))
    queries = build_tensor_queries(trace, arrays, IDS, "v2")
    sent = [json.loads(q.body)["inputs"][0] for q in queries]
    assert [t["shape"] for t in sent] == [[1, 2], [1, 5], [1, 9], [1, 2]]
    assert [t["data"] for t in sent[:3]] == [list(range(n)) for n in LENGTHS]
    assert all(t["datatype"] == "INT64" for t in sent)
    binary = build_tensor_queries(trace, arrays, IDS, "v2", binary=True)
    header = json.loads(binary[1].body[: binary[1].header_length])
    assert header["inputs"][0]["shape"] == [1, 5]
    raw = binary[1].body[binary[1].header_length :]
    assert np.frombuffer(raw, "<i8").tolist() == list(range(5))
    assert json.loads(tensor_body(arrays, IDS, [2], "v1").body) == {"inputs": [list(range(9))]}


def test_rows_of_different_shapes_in_one_query_are_one_line(tmp_path: Path) -> None:
    arrays = fit_inputs(read_inputs(ragged_file(tmp_path)), IDS)
    trace = Trace(np.array([0.0]), np.array([2]))
    with pytest.raises(ValueError) as refused:
        build_tensor_queries(trace, arrays, IDS, "v2")
    message = str(refused.value)
    assert "\n" not in message and "input 'ids'" in message, message
    assert "[2], [5]" in message and "batch size 1" in message, message
    # Rows of one shape share a query still.
    same = fit_inputs({"ids": arrays["ids"][[0, 0]]}, IDS)
    (query,) = build_tensor_queries(trace, same, IDS, "v2")
    assert json.loads(query.body)["inputs"][0]["shape"] == [2, 2]


def test_ragged_rows_are_still_fitted_to_the_input(tmp_path: Path) -> None:
    arrays = read_inputs(ragged_file(tmp_path))
    with pytest.raises(ValueError, match=r"'ids': rows of shape \[2\] do not fit \[-1, 4\]"):
        fit_inputs(arrays, [InputSpec("ids", "INT64", (-1, 4))])
    as_floats = fit_inputs(arrays, [InputSpec("ids", "FP32", (-1, -1))])
    assert {row.dtype for row in as_floats["ids"]} == {np.dtype(np.float32)}


def test_requests_of_different_ranks_are_refused_naming_the_file(tmp_path: Path) -> None:
    requests = [
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]},
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1, 2], "data": [1, 2]}]},
    ]
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps(requests))
    with pytest.raises(ValueError) as refused:
        read_inputs(path)
    message = str(refused.value)
    assert str(path) in message and "different ranks" in message and "\n" not in message
