"""Files that are not what an option asks for (:func:`controlplane.clients.tensors.read_npz`,
:func:`~controlplane.clients.tensors.read_inputs`, :func:`controlplane.cli.cascade_registered.
load_data`): a corrupt ``.npz``, a ``.npy`` renamed ``.npz``, a JSON input without ``data`` are
one line naming the file and what is wrong, exit 2 on the command line, never a traceback."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.cli.cascade_registered import load_data
from controlplane.cli.output import UsageError
from controlplane.clients.tensors import read_inputs, read_npz
from tests.unit.test_loadgen import APP, TOKEN, FakeService, fake, loadgen_cli, write_trace

__all__ = ["fake"]  # the fixture, imported for this module's tests


def bad_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file that is not an .npz archive, what the error says)."""
    corrupt = folder / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04garbage")
    renamed = folder / "renamed.npz"
    with renamed.open("wb") as handle:
        np.save(handle, np.zeros((3, 4)))
    empty = folder / "empty.npz"
    empty.write_bytes(b"")
    text = folder / "text.npz"
    text.write_text("inputs,labels\n1,2\n")
    member = folder / "member.npz"
    with zipfile.ZipFile(member, "w") as archive:
        archive.writestr("inputs.npy", b"not an array")
    cut = folder / "cut.npz"
    np.savez(cut, inputs=np.zeros((100, 4)), labels=np.zeros(100, dtype=int))
    cut.write_bytes(cut.read_bytes()[:200])
    return {
        "corrupt": (corrupt, "not a readable .npz archive (File is not a zip file)"),
        "renamed": (renamed, "not an .npz archive but a single .npy array"),
        "empty": (empty, "not an .npz archive"),
        "text": (text, "not an .npz archive"),
        "member": (member, "member 'inputs' is not an .npy array"),
        "cut": (cut, "not a readable .npz archive"),
    }


CASES = ["corrupt", "renamed", "empty", "text", "member", "cut"]


@pytest.mark.parametrize("case", CASES)
def test_a_file_that_is_not_an_npz_is_one_line(tmp_path: Path, case: str) -> None:
    path, fragment = bad_files(tmp_path)[case]
    with pytest.raises(ValueError) as refused:
        read_npz(path)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError) as refused:
        read_inputs(path)
    assert fragment in str(refused.value) and str(path) in str(refused.value)
    with pytest.raises(UsageError) as refused:
        load_data(path)
    assert str(refused.value).startswith(f"--data {path}: ") and fragment in str(refused.value)


def test_an_npz_reads_back_and_a_missing_one_is_the_callers(tmp_path: Path) -> None:
    np.savez(tmp_path / "ok.npz", b=np.arange(3), a=np.ones((2, 2)))
    arrays = read_npz(tmp_path / "ok.npz")
    assert list(arrays) == ["b", "a"] and arrays["b"].tolist() == [0, 1, 2]
    with pytest.raises(FileNotFoundError):
        read_npz(tmp_path / "missing.npz")
    with pytest.raises(UsageError, match=r"--validation-data .*missing\.npz: no such file"):
        load_data(tmp_path / "missing.npz", "--validation-data")


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        (
            {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2]}]},
            "input 1 ('input') has no 'data' (an input tensor has name, datatype, shape, data)",
        ),
        (
            [
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]},
                {"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]},
            ],
            "request 2, input 1 has no 'name' (an input tensor has name, datatype, shape, data)",
        ),
        ({"inputs": [3]}, "input 1 is not an object with name, datatype, shape, data"),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": 2, "data": [1, 2]}]},
            "input 1 ('x'): shape 2 is not a list of whole numbers >= 0",
        ),
    ],
)
def test_a_json_input_without_a_key_says_which_and_where(
    tmp_path: Path, document: object, fragment: str
) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError) as refused:
        read_inputs(path)
    assert str(refused.value) == f"{path}: {fragment}"


@pytest.mark.parametrize("case", ["corrupt", "renamed"])
def test_the_commands_refuse_a_bad_npz_with_exit_2(
    fake: FakeService, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    path, fragment = bad_files(tmp_path)[case]
    trace = write_trace(tmp_path / "t.csv", [0.0])
    status, out, err = loadgen_cli(
        capsys,
        *("--url", fake.url, "--app", APP, "--trace", str(trace), "--token", TOKEN),
        *("--inputs", str(path)),
    )
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert f"--inputs {path}: {fragment}" in err
    assert fake.requests == []
    commands = [
        ("--data", ["cascade", "evaluate", "--app", "a", "--data", str(path)]),
        (
            "--validation-data",
            ["rollout", "start", "--app", "a", "--model", "m@2", "--validation-data", str(path)],
        ),
    ]
    for flag, argv in commands:
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--url", fake.url, "--token", TOKEN])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1, err
        assert f"{flag} {path}: {fragment}" in err and "Traceback" not in err
