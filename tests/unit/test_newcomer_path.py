"""The rough edges of a newcomer's first hour (issue 35): ``demo --help`` reads as plain text,
a reader that leaves the pipe (``| head``) ends the command quietly, a mistyped instance type
names the emulated ``emu.*`` types too, ``demo --print-token`` finds the token where the settings
put the data directory, and ``make demo`` installs the worker extra only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import EXIT_BROKEN_PIPE, main
from estimator.catalog import load_catalog
from estimator.errors import UnknownInstanceTypeError

REPO = Path(__file__).resolve().parents[2]


def test_demo_help_is_short_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":mod:" not in text and ":func:" not in text
    description = text.split("\n\n")[1]  # usage, the description, then the options
    assert len(description.splitlines()) <= 8, description
    assert "--down" in description and "demo-token" in description


def test_a_reader_that_leaves_the_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "controlplane", "trace", "generate", "--kind", "poisson"]
    command += ["--rate", "5", "--duration", "10", "--out", str(tmp_path / "t.csv")]
    read, write = os.pipe()
    os.close(read)  # the reader left before a line was written (`| head -0`)
    try:
        done = subprocess.run(
            command,
            cwd=REPO,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (EXIT_BROKEN_PIPE, "")


def test_a_mistyped_instance_type_names_close_matches_and_every_family() -> None:
    catalog = load_catalog(None)
    message = str(UnknownInstanceTypeError("emu.cpu.smal", catalog.names))
    assert "did you mean 'emu.cpu.small'?" in message
    for name in ("emu.cpu.large", "emu.gpu", "local.cpu", "g5.* (", "t3.* ("):
        assert name in message, message
    assert "\n" not in message


def test_demo_print_token_reads_the_settings_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in list(os.environ):
        if name.startswith("HETEROPLANE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    with pytest.raises(SystemExit) as refused:
        main(["demo", "--print-token"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1
    assert f"no demo token in {tmp_path / 'xdg' / 'heteroplane' / 'demo-token'}" in err
    (tmp_path / "xdg" / "heteroplane").mkdir(parents=True)
    (tmp_path / "xdg" / "heteroplane" / "demo-token").write_text("hp_abc\n")
    assert main(["demo", "--print-token"]) == 0
    assert capsys.readouterr().out == "hp_abc\n"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_installs_the_worker_extra_and_make_test_the_test_extra_too(
    tmp_path: Path,
) -> None:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)

    def planned(target: str) -> str:
        done = subprocess.run(
            ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    demo, test = planned("demo"), planned("test")
    assert "-e '.[worker]'" in demo and "test," not in demo
    assert "-e '.[test,worker]'" in test
