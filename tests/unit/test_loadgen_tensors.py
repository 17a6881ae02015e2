"""The load generator's inputs for any model (:mod:`controlplane.clients.tensors`,
:func:`controlplane.clients.loadgen.build_tensor_queries`): files read (``.npz``, Open Inference
Protocol JSON rows), fitted to the app's inputs with one-line refusals, rows drawn in order, and
the bodies of ``/v1``, ``/v2`` JSON and ``/v2`` binary tensors read back as the service reads
them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.clients.loadgen import (
    build_tensor_queries,
    draw_rows,
    infer_url,
    judge_answer,
    late_flag,
)
from controlplane.clients.rawload import request_head
from controlplane.clients.tensors import (
    HEADER_LENGTH,
    InputSpec,
    fit_inputs,
    input_specs,
    read_inputs,
    tensor_body,
)
from estimator.traces import Trace, write_trace_csv

TWO = [InputSpec("ids", "INT64", (-1, 3)), InputSpec("mask", "BOOL", (-1, 3))]
IMAGE = [InputSpec("image", "FP32", (-1, 2, 2))]


def test_an_npz_and_oip_json_rows_read_alike(tmp_path: Path) -> None:
    ids = np.arange(12, dtype=np.int64).reshape(4, 3)
    mask = ids % 2 == 0
    np.savez(tmp_path / "rows.npz", ids=ids, mask=mask)
    document = [
        {
            "inputs": [
                {"name": "ids", "datatype": "INT64", "shape": [2, 3], "data": ids[:2].tolist()},
                {"name": "mask", "datatype": "BOOL", "shape": [2, 3], "data": mask[:2].tolist()},
            ]
        },
        {
            "inputs": [
                {
                    "name": "ids",
                    "datatype": "INT64",
                    "shape": [2, 3],
                    "data": ids[2:].ravel().tolist(),
                },
                {"name": "mask", "datatype": "BOOL", "shape": [2, 3], "data": mask[2:].tolist()},
            ]
        },
    ]
    (tmp_path / "rows.json").write_text(json.dumps(document))
    for name in ("rows.npz", "rows.json"):
        arrays = fit_inputs(read_inputs(tmp_path / name), TWO)
        assert list(arrays) == ["ids", "mask"]
        np.testing.assert_array_equal(arrays["ids"], ids)
        np.testing.assert_array_equal(arrays["mask"], mask)
        assert arrays["mask"].dtype == np.bool_


@pytest.mark.parametrize(
    ("arrays", "specs", "fragment"),
    [
        ({"ids": np.zeros((2, 3))}, TWO, "inputs are 'ids', 'mask'; the file has 'ids'"),
        # Names are quoted, so one with a line break keeps the message one line.
        (
            {"a\nb": np.zeros((2, 3)), "c": np.zeros((2, 3))},
            [InputSpec("x\ny", "INT64", (-1, 3)), InputSpec("mask", "BOOL", (-1, 3))],
            "inputs are 'x\\ny', 'mask'; the file has 'a\\nb', 'c'",
        ),
        ({"ids": np.zeros((2, 4)), "mask": np.zeros((2, 3))}, TWO, "'ids': rows of shape [4]"),
        ({"ids": np.zeros((2, 3)), "mask": np.zeros((3, 3))}, TWO, "'mask': 3 rows, the others 2"),
        ({"ids": np.full((1, 3), 0.5), "mask": np.zeros((1, 3))}, TWO, "not whole for INT64"),
        # Values a cast would change (the service refuses them): refused, never sent changed.
        ({"ids": np.zeros((1, 3)), "mask": np.full((1, 3), 2)}, TWO, "outside BOOL's 0..1"),
        ({"ids": np.full((1, 3), 2.0**63), "mask": np.ones((1, 3))}, TWO, "outside INT64's"),
        ({"x": np.full((1, 4), np.nan)}, IMAGE, "'image': NaN or infinity"),
        ({"x": np.full((1, 4), 1e39)}, IMAGE, "past FP32's largest"),
        ({"x": np.full((1, 4), "a")}, IMAGE, "FP32 takes numbers"),
        ({"x": np.ones((1, 4), dtype=bool)}, IMAGE, "FP32 takes numbers, not true or false"),
        ({"ids": np.ones((1, 3), dtype=bool), "mask": np.ones((1, 3))}, TWO, "not true or false"),
        ({"x": np.zeros((2, 5))}, IMAGE, "'image': rows of shape [5] do not fit [-1, 2, 2]"),
    ],
)
def test_inputs_that_do_not_fit_are_one_line_naming_the_input(
    arrays: dict[str, np.ndarray], specs: list[InputSpec], fragment: str
) -> None:
    with pytest.raises(ValueError) as refused:
        fit_inputs(arrays, specs)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_one_array_for_one_input_takes_any_name_and_flat_rows() -> None:
    arrays = fit_inputs({"whatever": np.arange(8).reshape(2, 4)}, IMAGE)
    assert arrays["image"].shape == (2, 2, 2) and arrays["image"].dtype == np.float32


def test_json_rows_keep_their_values_or_are_refused(tmp_path: Path) -> None:
    """A JSON file's values are its datatype's as they are: 300 is no UINT8 and 5.5 no INT64
    (a cast had sent 44 and 5, and the run measured other inputs than the file's)."""

    def rows(datatype: str, data: list[object]) -> Path:
        path = tmp_path / "rows.json"
        tensor = {"name": "x", "datatype": datatype, "shape": [1, len(data)], "data": data}
        path.write_text(json.dumps({"inputs": [tensor]}))
        return path

    assert read_inputs(rows("UINT8", [1, 2, 255]))["x"].tolist() == [[1, 2, 255]]
    top = 2**64 - 1  # beside small integers numpy reads it as a float: kept exact all the same
    assert read_inputs(rows("UINT64", [1, 2**63 + 1, top]))["x"].tolist() == [[1, 2**63 + 1, top]]
    refused: list[tuple[str, list[object], str]] = [
        ("UINT8", [1, 2, 300], "outside UINT8's 0..255"),
        ("INT64", [1, 2, 5.5], "INT64 data must be integers"),
        ("INT64", [True, False], "INT64 data must be integers"),
        ("BOOL", [True, 2], "BOOL data must be true or false"),
        ("FP32", [1.0, True], "FP32 data must be numbers"),
        ("FP16", [1.0, 70000.0], "too large for FP16"),
    ]
    for datatype, data, fragment in refused:
        with pytest.raises(ValueError, match=fragment):
            read_inputs(rows(datatype, data))


def test_files_that_are_not_inputs_are_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"rows": []}')
    (tmp_path / "short.json").write_text(
        '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3]}]}'
    )
    for name, fragment in [
        ("bad.json", "expected an inference request"),
        ("short.json", "3 values for shape [2, 2]"),
        ("missing.npz", "No such file"),
    ]:
        with pytest.raises(ValueError) as refused:
            read_inputs(tmp_path / name)
        assert fragment in str(refused.value) and name in str(refused.value)
    with pytest.raises(ValueError, match="no inputs"):
        input_specs({"name": "m"})


def test_a_json_request_is_rows_of_all_its_inputs_together(tmp_path: Path) -> None:
    """Each request in a JSON file is one batch of rows of every input: one whose inputs hold
    different numbers of rows, or that leaves an input out or names one twice, is refused
    naming it, as the service refuses such a request. The rows had been joined per input across
    the requests: two requests of 2 + 1 and 1 + 2 rows passed, and each query paired one
    request's ids with another's mask."""
    path = tmp_path / "rows.json"

    def tensor(name: str, rows: int) -> dict[str, object]:
        datatype, value = ("INT64", 1) if name == "ids" else ("BOOL", True)
        return {"name": name, "datatype": datatype, "shape": [rows, 3], "data": [value] * rows * 3}

    def read(*requests: list[dict[str, object]]) -> dict[str, np.ndarray]:
        path.write_text(json.dumps([{"inputs": inputs} for inputs in requests]))
        return read_inputs(path)

    arrays = read([tensor("ids", 2), tensor("mask", 2)], [tensor("mask", 1), tensor("ids", 1)])
    assert arrays["ids"].shape == arrays["mask"].shape == (3, 3)
    refused = [
        (
            ([tensor("ids", 2), tensor("mask", 1)], [tensor("ids", 1), tensor("mask", 2)]),
            "request 1: input 'mask' has 1 rows, input 'ids' 2",
        ),
        (
            ([tensor("ids", 1), tensor("mask", 1)], [tensor("ids", 1)], [tensor("mask", 1)]),
            "request 2 has inputs ids, request 1 ids, mask",
        ),
        (([tensor("ids", 1), tensor("ids", 1), tensor("mask", 2)],), "input 'ids' twice"),
    ]
    for requests, fragment in refused:
        with pytest.raises(ValueError) as error:
            read(*requests)
        assert fragment in str(error.value) and "\n" not in str(error.value), fragment


def test_an_archive_is_read_as_one_whatever_its_name(tmp_path: Path) -> None:
    """rows.NPZ (or rows.dat) had been read as JSON text: "'utf-8' codec can't decode byte
    0x89", of a file numpy wrote; a single .npy so named gets read_npz's own line."""
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    np.savez(tmp_path / "rows.npz", ids=ids, mask=ids > 2)
    for name in ("rows.NPZ", "rows.dat"):
        (tmp_path / name).write_bytes((tmp_path / "rows.npz").read_bytes())
        arrays = read_inputs(tmp_path / name)
        assert list(arrays) == ["ids", "mask"] and arrays["ids"].tolist() == ids.tolist()
    np.save(tmp_path / "one.npy", ids)
    (tmp_path / "one.dat").write_bytes((tmp_path / "one.npy").read_bytes())
    with pytest.raises(ValueError, match=r"not an \.npz archive but a single \.npy array"):
        read_inputs(tmp_path / "one.dat")
    (tmp_path / "rows.json").write_text(
        '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}'
    )
    assert read_inputs(tmp_path / "rows.json")["x"].tolist() == [[1.0, 2.0]]


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev/fd (Linux)")
def test_inputs_from_a_pipe_are_read_once(tmp_path: Path) -> None:
    """``--inputs /dev/stdin`` or ``<(...)``: a pipe gives its bytes once. The file had been
    opened twice (its first bytes for the archive's magic, then the whole), so a good JSON file
    lost its first six bytes ("Extra data: line 1 column 5") and an .npz its zip header."""
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    np.savez(tmp_path / "rows.npz", ids=ids, mask=ids > 2)
    tensor = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}
    for content in (
        json.dumps({"inputs": [tensor]}).encode(),
        (tmp_path / "rows.npz").read_bytes(),
    ):
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, content)  # small: it fits in the pipe's buffer
            os.close(write_end)
            arrays = read_inputs(Path(f"/dev/fd/{read_end}"))
        finally:
            os.close(read_end)
        assert list(arrays) in (["x"], ["ids", "mask"])
        if "x" in arrays:
            assert arrays["x"].tolist() == [[1.0, 2.0]]
        else:
            assert arrays["ids"].tolist() == ids.tolist()


def test_a_json_shape_is_whole_sizes_as_they_are(tmp_path: Path) -> None:
    """A shape's sizes are taken as written or refused: int() had read 2.5 as 2 (two rows of a
    file that says two and a half), true as 1, the string "26" as [2, 6], and [-1, -13] reached
    numpy's reshape, whose message named nothing."""
    path = tmp_path / "rows.json"

    def read(shape: object, values: int) -> dict[str, np.ndarray]:
        data = list(range(values))
        path.write_text(
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": data}]}
            )
        )
        return read_inputs(path)

    assert read([2.0, 13], 26)["x"].shape == (2, 13)  # a whole float is its size
    for shape, values in (([2.5, 13], 26), ([True, 13], 13), ("26", 12), ([-1, -13], 13)):
        with pytest.raises(ValueError) as refused:
            read(shape, values)
        assert "input 1 ('x'): shape" in str(refused.value), shape
        assert "is not a list of whole numbers >= 0" in str(refused.value), shape


def test_rows_are_drawn_in_order_or_from_the_sample_id() -> None:
    trace = Trace(np.array([0.0, 0.1, 0.2, 0.3]), np.array([1, 2, 2, 1]))
    assert draw_rows(trace, 4) == [(0,), (1, 2), (3, 0), (1,)]
    with_ids = Trace(np.array([0.0, 0.1]), np.array([2, 1]), np.array([3, 1]))
    assert draw_rows(with_ids, 4) == [(3, 0), (1,)]
    # A sample_id past the file's rows names them as rows (they are not the demo's validation
    # samples, which the message had called them).
    with pytest.raises(ValueError) as refused:
        draw_rows(with_ids, 2)
    assert str(refused.value) == "the trace's sample_id 3 at row 1 is outside the 2 rows (0..1)"


def _read_back(
    body: bytes, header_length: int | None, specs: list[InputSpec]
) -> dict[str, np.ndarray]:
    """A /v2 body's tensors as the service reads them (JSON data, or the binary parts)."""
    from provisioners.artifacts import numpy_dtype

    split = len(body) if header_length is None else header_length
    document = json.loads(body[:split])
    binary = body[split:]
    arrays = {}
    offset = 0
    for entry, spec in zip(document["inputs"], specs, strict=True):
        assert (entry["name"], entry["datatype"]) == (spec.name, spec.datatype)
        dtype = numpy_dtype(spec.datatype).newbyteorder("<")
        if "data" in entry:
            values = np.asarray(entry["data"], dtype=dtype)
        else:
            size = entry["parameters"]["binary_data_size"]
            values = np.frombuffer(binary[offset : offset + size], dtype=dtype)
            offset += size
        arrays[spec.name] = values.reshape(entry["shape"])
    assert offset == len(binary)
    return arrays


def test_v2_bodies_json_and_binary_carry_the_rows() -> None:
    ids = np.arange(12, dtype=np.int64).reshape(4, 3) - 5
    arrays = {"ids": ids, "mask": ids > 0}
    trace = Trace(np.array([1.0, 1.5]), np.array([3, 2]))
    for binary in (False, True):
        queries = build_tensor_queries(trace, arrays, TWO, "v2", binary)
        assert [q.send_at_s for q in queries] == [0.0, 0.5]
        assert [q.sample_ids for q in queries] == [(0, 1, 2), (3, 0)]
        for query in queries:
            got = _read_back(query.body, query.header_length, TWO)
            rows = list(query.sample_ids)
            np.testing.assert_array_equal(got["ids"], ids[rows])
            np.testing.assert_array_equal(got["mask"], ids[rows] > 0)
            headers = query.headers()
            if binary:
                assert headers == {
                    "Content-Type": "application/octet-stream",
                    HEADER_LENGTH: str(query.header_length),
                }
                head = request_head(
                    "http://h:1/v2/models/a/infer",
                    "t",
                    len(query.body),
                    query.content_type,
                    query.header_length,
                ).decode()
                assert f"{HEADER_LENGTH}: {query.header_length}\r\n" in head
                assert "Content-Type: application/octet-stream\r\n" in head
            else:
                assert headers == {} and query.header_length is None


def test_v1_bodies_are_flattened_rows_of_one_input() -> None:
    arrays = fit_inputs({"image": np.arange(8, dtype=np.float32).reshape(2, 2, 2)}, IMAGE)
    made = tensor_body(arrays, IMAGE, [1], "v1")
    assert json.loads(made.body) == {"inputs": [[4.0, 5.0, 6.0, 7.0]]}
    booleans = fit_inputs({"m": np.array([[True, False, True]])}, [TWO[1]])
    assert json.loads(tensor_body(booleans, [TWO[1]], [0], "v1").body) == {"inputs": [[1, 0, 1]]}
    # A UINT64 past INT64's top as it is: a cast to int64 had sent 2**63 + 5 as -2**63 + 5,
    # which the service refused (422) for a row the file held right.
    wide = [InputSpec("u", "UINT64", (-1, 2))]
    values = fit_inputs({"u": np.array([[2**63 + 5, 2**64 - 1]], dtype=np.uint64)}, wide)
    assert json.loads(tensor_body(values, wide, [0], "v1").body) == {
        "inputs": [[2**63 + 5, 2**64 - 1]]
    }
    with pytest.raises(ValueError, match="use --protocol v2"):
        tensor_body({"ids": np.zeros((1, 3)), "mask": np.zeros((1, 3))}, TWO, [0], "v1")


def test_the_v2_url_and_late_flag() -> None:
    assert infer_url("http://x:1", "a b", "v2") == "http://x:1/v2/models/a%20b/infer"
    assert late_flag({"parameters": {"late": True}}) is True
    assert late_flag({"late": False}) is False and late_flag([1]) is None


def test_binary_needs_v2_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    write_trace_csv(Trace(np.array([0.0]), np.array([1])), trace)
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "loadgen",
                "--url",
                "http://127.0.0.1:9",
                "--token",
                "t",
                "--app",
                "a",
                "--trace",
                str(trace),
                "--binary",
                "--protocol",
                "v1",
            ]
        )
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "--protocol v2" in error and "\n" not in error


def test_v2_bodies_carry_the_clients_timeout_in_microseconds() -> None:
    arrays = fit_inputs({"image": np.zeros((1, 2, 2))}, IMAGE)
    made = tensor_body(arrays, IMAGE, [0], "v2", timeout_s=2.5)
    assert json.loads(made.body)["parameters"] == {"timeout": 2_500_000}
    made = tensor_body(arrays, IMAGE, [0], "v2", True, timeout_s=2.5)
    header = json.loads(made.body[: made.header_length])
    assert header["parameters"] == {"timeout": 2_500_000, "binary_data_output": True}
    assert "parameters" not in json.loads(tensor_body(arrays, IMAGE, [0], "v2").body)


def test_binary_tensors_ask_for_binary_outputs_and_their_answers_are_judged() -> None:
    """With binary tensors the outputs come in binary too, as tritonclient asks by default: a
    model's NaN, which JSON cannot carry, is answered (it was a 502), and the answer's JSON part
    still gives the service's own time."""
    arrays = fit_inputs({"image": np.zeros((1, 2, 2))}, IMAGE)
    made = tensor_body(arrays, IMAGE, [0], "v2", True)
    assert json.loads(made.body[: made.header_length])["parameters"]["binary_data_output"]
    nan = np.array([np.nan, 1.0], dtype="<f4").tobytes()
    header = json.dumps(
        {
            "model_name": "m",
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2],
                         "parameters": {"binary_data_size": len(nan)}}],
            "parameters": {"total_ms": 1.25, "late": False},
        }
    ).encode()  # fmt: skip
    assert judge_answer(200, header + nan)[0::2] == ("ok", 1.25)
    assert judge_answer(200, b"\xff" + header)[0] == "bad_response"
