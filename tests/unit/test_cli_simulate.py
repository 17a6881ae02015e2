"""The ``heteroplane simulate`` and ``demo --offline`` commands: the JSON contract and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import main
from tests.conftest import KAIROS_CSV, needs_shared

HETEROPLANE = Path(sys.executable).with_name("heteroplane")


def write_profile_csv(path: Path) -> Path:
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for itype, base in (("g4dn.xlarge", 2.0), ("r5n.large", 9.0)):
        for batch in (1, 2, 4):
            rows += [f"m,{itype},{batch},{i},{base * batch + i * 0.1},0.5" for i in range(5)]
    path.write_text("\n".join(rows) + "\n")
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HETEROPLANE), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_simulate_prints_one_json_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    profiles = write_profile_csv(tmp_path / "p.csv")
    args = ["simulate", "--profiles", str(profiles), "--model", "m"]
    args += ["--fleet", "g4dn.xlarge=1,r5n.large=2", "--qps", "50", "--duration", "60"]
    args += ["--batch-dist", "fixed:2", "--qos-ms", "20", "--policy", "fcfs", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("p50_ms", "p99_ms", "attainment", "throughput_qps", "cost_usd_per_hr"):
        assert key in out
    assert out["cost_usd_per_hr"] == pytest.approx(0.526 + 2 * 0.149)
    assert 0 <= out["attainment"] <= 1
    assert out["p50_ms"] <= out["p99_ms"]
    assert out["throughput_qps"] == pytest.approx(50, rel=0.1)


def test_simulate_human_summary_and_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    profiles = write_profile_csv(tmp_path / "p.csv")
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,batch_size\n0.0,1\n0.001,4\n0.5,2\n")
    args = ["simulate", "--profiles", str(profiles), "--model", "m", "--fleet", "r5n.large=1"]
    assert main([*args, "--trace", str(trace), "--qos-ms", "100", "--max-batch", "2"]) == 0
    text = capsys.readouterr().out
    assert "3 queries" in text and "p99" in text and "r5n.large" in text


@needs_shared
def test_the_issue_example_runs_on_the_shared_samples() -> None:
    result = run_cli(
        "simulate", "--profiles", str(KAIROS_CSV), "--model", "rm2", "--fleet", "g4dn.xlarge=4",
        "--qps", "30", "--duration", "600", "--batch-dist", "kairos", "--qos-ms", "350",
        "--policy", "fcfs", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    # Four T4 instances at 30 qps are about half busy (Kairos: one serves about 15 qps of the mix).
    assert 0.35 < out["utilisation_by_type"]["g4dn.xlarge"] < 0.65
    assert out["attainment"] > 0.99
    assert out["cost_usd_per_hr"] == pytest.approx(4 * 0.526)


BAD_INPUTS = {
    "missing profiles file": (["--profiles", "/nonexistent/p.csv"], "No such file"),
    "malformed CSV": (["--profiles", "{bad}"], "missing column"),
    "unknown model": (["--model", "zz"], "unknown model 'zz'"),
    "unknown instance type": (["--fleet", "g9.huge=1"], "unknown instance type 'g9.huge'"),
    "type without a profile": (["--fleet", "g5.xlarge=1"], "no profile for model 'm'"),
    "batch outside profile": (["--batch-dist", "fixed:8"], "batch size 8 is outside"),
    "negative count": (["--fleet", "g4dn.xlarge=-1"], "must be >= 0"),
    "empty fleet": (["--fleet", "g4dn.xlarge=0"], "has no instances"),
    "negative qps": (["--qps", "-3"], "--qps must be a finite number > 0"),
    "zero qps": (["--qps", "0"], "--qps must be a finite number > 0"),
    "non-number qps": (["--qps", "abc"], "invalid float value"),
    "zero qos": (["--qos-ms", "0"], "--qos-ms must be a finite number > 0"),
    "infinite qos": (["--qos-ms", "inf"], "--qos-ms must be a finite number > 0"),
    "non-monotonic trace": (["--trace", "{nonmono}"], "decreases at row 2"),
    "bad batch spec": (["--batch-dist", "weird"], "batch-size spec"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path: Path, case: str) -> None:
    profiles = write_profile_csv(tmp_path / "p.csv")
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("a,b\n1,2\n")
    nonmono = tmp_path / "nonmono.csv"
    nonmono.write_text("arrival_s,batch_size\n0.5,1\n0.2,1\n")
    options = {
        "--profiles": str(profiles), "--model": "m", "--fleet": "g4dn.xlarge=1",
        "--qps": "5", "--duration": "10", "--qos-ms": "50",
    }  # fmt: skip
    override, expected = BAD_INPUTS[case]
    for flag, value in zip(override[::2], override[1::2], strict=True):
        options[flag] = value.format(bad=bad_csv, nonmono=nonmono)
    if "--trace" in options:
        del options["--qps"], options["--duration"]
    args = ["simulate"] + [item for pair in options.items() for item in pair]
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_python_dash_m_controlplane_is_the_same_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "controlplane", "--version"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stdout.startswith("heteroplane ")


@needs_shared
def test_offline_demo_runs_on_the_shared_samples(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--offline", "--profiles", str(KAIROS_CSV), "--duration", "60", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["simulations"]
    assert {row["fleet"] for row in rows} == {"g4dn.xlarge=4", "g4dn.xlarge=1,r5n.large=13"}
    # More load on the same fleet never raises attainment much (the queue only grows).
    gpu = [row for row in rows if row["fleet"] == "g4dn.xlarge=4"]
    assert gpu[0]["attainment"] > gpu[-1]["attainment"]
    assert len(out["workload"]["envelope"]) == 9


def test_a_trace_without_a_span_offers_no_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One query (or all at one time): the offered rate was len / 1e-12, 1e12 qps."""
    profiles = write_profile_csv(tmp_path / "p.csv")
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,batch_size\n5.0,1\n5.0,2\n")
    args = ["simulate", "--profiles", str(profiles), "--model", "m", "--fleet", "r5n.large=1"]
    args += ["--trace", str(trace), "--qos-ms", "100"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["offered_qps"] is None
    assert main(args) == 0
    assert "2 queries at no rate (the trace has no span) offered" in capsys.readouterr().out
