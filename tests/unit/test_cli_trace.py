"""``heteroplane trace generate`` and ``trace stats``: output, files, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from controlplane.cli import main
from estimator.traces import read_trace_csv, trace_stats

STATS_KEYS = {"count", "duration_s", "rate_qps", "cv2", "mean_batch_size", "max_batch_size", "path"}


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object
    data: dict[str, object] = json.loads(out)
    return data


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err.strip()


@pytest.mark.parametrize(
    "options",
    [
        ["--kind", "poisson", "--rate", "200"],
        ["--kind", "gamma", "--rate", "200", "--cv2", "4"],
        ["--kind", "step", "--rate", "100", "--to-rate", "300", "--at", "30"],
        ["--kind", "ramp", "--rate", "150", "--to-rate", "250", "--at", "20", "--over", "20"],
        ["--kind", "diurnal", "--rate", "200", "--period", "60", "--amplitude", "0.9"],
        ["--kind", "poisson", "--rate", "200", "--spike", "10:5:3", "--spike", "30:5:0"],
    ],
)
def test_generate_writes_the_trace_it_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    out = tmp_path / "trace.csv"
    argv = ["trace", "generate", *options, "--duration", "60", "--seed", "3", "--out", str(out)]
    data = run_json(capsys, argv)
    assert set(data) == STATS_KEYS and data["path"] == str(out)
    trace = read_trace_csv(out)
    stats = trace_stats(trace)
    assert data["count"] == len(trace) == stats.count > 1000
    assert data["rate_qps"] == pytest.approx(stats.rate_qps)
    assert data["cv2"] == pytest.approx(stats.cv2)
    assert data["max_batch_size"] == 1 and trace.batch_size.min() == 1
    assert trace.arrival_s[-1] < 60.0
    # the same seed writes the same file
    again = tmp_path / "again.csv"
    run_json(capsys, [*argv[:-1], str(again)])
    assert again.read_bytes() == out.read_bytes()


def test_generate_spikes_and_batch_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kairos.csv"
    argv = ["trace", "generate", "--kind", "poisson", "--rate", "100", "--duration", "100"]
    argv += ["--spike", "40:10:0", "--batch-dist", "kairos", "--out", str(out)]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert summary.startswith(f"wrote {out}:") and "qps" in summary
    trace = read_trace_csv(out)
    assert not np.any((trace.arrival_s >= 40.0) & (trace.arrival_s < 50.0))  # the outage
    assert np.all(trace.batch_size % 10 == 0) and 200 < trace.batch_size.mean() < 290


def test_stats_human_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hand.csv"
    path.write_text("arrival_s,batch_size\n0,1\n1,2\n2,3\n6,10\n", encoding="utf-8")
    assert main(["trace", "stats", str(path)]) == 0
    human = capsys.readouterr().out
    assert human.startswith(f"{path}: 4 queries over 6.000 s") and "max 10" in human
    data = run_json(capsys, ["trace", "stats", str(path)])
    assert data == {
        "count": 4,
        "duration_s": 6.0,
        "rate_qps": 0.5,
        "cv2": 0.5,
        "mean_batch_size": 4.0,
        "max_batch_size": 10,
        "path": str(path),
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--kind", "gamma", "--rate", "5"], "--kind gamma needs --cv2"),
        (["--kind", "poisson", "--rate", "5", "--cv2", "3"], "--kind poisson has cv2 = 1"),
        (["--kind", "poisson", "--rate", "5", "--period", "10"], "does not take --period"),
        (["--kind", "gamma", "--rate", "5", "--cv2", "2", "--at", "3"], "does not take --at"),
        (["--kind", "step", "--rate", "5", "--at", "3"], "--kind step needs --to-rate"),
        (["--kind", "step", "--rate", "5", "--to-rate", "1", "--at", "3", "--over", "2"], "--over"),
        (["--kind", "ramp", "--rate", "5", "--to-rate", "9", "--at", "3"], "needs --over"),
        (["--kind", "ramp", "--rate", "5", "--to-rate", "9", "--at", "3", "--over", "0"], "> 0"),
        (["--kind", "diurnal", "--rate", "5", "--amplitude", "2"], "amplitude must be in"),
        (["--kind", "poisson", "--rate", "-5"], "rate_qps must be > 0, got -5.0"),
        (["--kind", "poisson", "--rate", "nan"], "rate_qps must be finite"),
        (["--kind", "gamma", "--rate", "5", "--cv2", "0"], "cv2 must be > 0"),
        (["--kind", "poisson", "--rate", "5", "--spike", "1:2"], "expected START:LENGTH:FACTOR"),
        (["--kind", "poisson", "--rate", "5", "--spike", "1:2:-1"], "factor must be >= 0"),
        (["--kind", "poisson", "--rate", "5", "--spike", "20:5:3"], "would never happen"),
        (["--kind", "poisson", "--rate", "5", "--spike", "1:2:inf"], "must be finite"),
        (["--kind", "poisson", "--rate", "5", "--spike", "1:2:1e308"], "past any number"),
        (["--kind", "poisson", "--rate", "5", "--batch-dist", "zipf"], "unknown batch-size spec"),
        (["--kind", "poisson", "--rate", "5", "--seed", "-1"], "--seed must be >= 0"),
        (["--kind", "poisson", "--rate", "1e-9"], "no query arrived"),
        (["--kind", "wavy", "--rate", "5"], "invalid choice: 'wavy'"),
    ],
)
def test_generate_rejects_bad_options_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    out = tmp_path / "never.csv"
    error = one_line_error(
        capsys, ["trace", "generate", *options, "--duration", "10", "--out", str(out)]
    )
    assert error.startswith("heteroplane") and message in error
    assert not out.exists()


@pytest.mark.parametrize(
    "options",
    [
        ["--kind", "ramp", "--rate", "5", "--to-rate", "10", "--at", "1", "--over", "1e308"],
        ["--kind", "poisson", "--rate", "5", "--spike", "5:1e308:2"],
    ],
)
def test_a_ramp_or_spike_past_the_end_is_cut_there_without_overflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    """Their rate profile's pieces past the trace's end overflowed (numpy's warnings on
    stderr); cut at the end, the trace within it is the same."""
    out = tmp_path / "t.csv"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["trace", "generate", *options, "--duration", "10", "--out", str(out)]) == 0
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().err == ""
    assert out.exists()


def test_stats_errors_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.csv"
    assert "No such file" in one_line_error(capsys, ["trace", "stats", str(missing)])
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s\n1.0\n0.5\n", encoding="utf-8")
    assert "arrival_s decreases at row 2: 0.5 < 1.0" in one_line_error(
        capsys, ["trace", "stats", str(bad)]
    )
    assert "required" in one_line_error(capsys, ["trace"])


def console_script() -> list[str]:
    installed = shutil.which("heteroplane", path=str(Path(sys.executable).parent))
    return [installed] if installed else [sys.executable, "-m", "controlplane"]


def test_console_script_fails_with_one_line_and_status_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,batch_size\n0,1\n2,1\n1,1\n", encoding="utf-8")
    cases = [
        (["trace", "generate", "--kind", "poisson", "--rate", "-1", "--duration", "5"], "rate"),
        (["trace", "stats", str(bad)], "decreases at row 3"),
        (["trace", "stats", str(tmp_path / "missing.csv")], "missing.csv"),
    ]
    for argv, message in cases:
        if argv[1] == "generate":
            argv = [*argv, "--out", str(tmp_path / "out.csv")]
        done = subprocess.run(
            [*console_script(), *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
