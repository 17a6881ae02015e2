"""The ``heteroplane bounds`` command: the JSON contract, the paper's setting, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import main
from tests.conftest import KAIROS_CSV, needs_shared

HETEROPLANE = Path(sys.executable).with_name("heteroplane")
PAPER = [
    "--types", "g4dn.xlarge,c5n.2xlarge,r5n.large,t3.xlarge",
    "--max-count", "g4dn.xlarge=5,c5n.2xlarge=6,r5n.large=17,t3.xlarge=15",
    "--budget", "2.5",
]  # fmt: skip


def write_profile_csv(path: Path) -> Path:
    """A GPU that meets 50 ms everywhere and a CPU that serves batches up to 2 (sizes 1-4)."""
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    curves = {"g4dn.xlarge": [10, 20, 30, 40], "r5n.large": [20, 40, 100, 200]}
    for itype, latencies in curves.items():
        for batch, latency in zip((1, 2, 3, 4), latencies, strict=True):
            rows += [f"m,{itype},{batch},{i},{latency + 0.1 * i},0" for i in range(3)]
    path.write_text("\n".join(rows) + "\n")
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HETEROPLANE), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profiles = write_profile_csv(tmp_path / "p.csv")
    args = ["bounds", "--profiles", str(profiles), "--model", "m", "--qos-ms", "50"]
    dist = "gaussian:mean=2,sd=1,low=1,high=4"  # an empirical pmf over sizes 1-4
    assert main([*args, "--budget", "3", "--batch-dist", dist, "--top", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("ranking", "chosen", "best_homogeneous", "base_type", "quantities", "enumerated"):
        assert key in out
    assert len(out["ranking"]) == 3
    for entry in (*out["ranking"], out["chosen"], out["best_homogeneous"]):
        assert set(entry) >= {"fleet", "upper_bound_qps", "cost_usd_per_hr"}
        assert set(entry["fleet"]) == {"g4dn.xlarge", "r5n.large"}
        assert entry["cost_usd_per_hr"] <= 3 + 1e-9
    assert out["base_type"] == "g4dn.xlarge"
    ranked = [e["upper_bound_qps"] for e in out["ranking"]]
    assert ranked == sorted(ranked, reverse=True)
    # The CPU meets 50 ms up to batch size 2: an auxiliary with b_a = 3.
    cpu = out["quantities"]["r5n.large"]
    assert cpu["violation_batch"] == 3 and cpu["full_range"] is False
    assert out["best_homogeneous"]["fleet"] == {"g4dn.xlarge": 5, "r5n.large": 0}


def test_human_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profiles = write_profile_csv(tmp_path / "p.csv")
    args = ["bounds", "--profiles", str(profiles), "--model", "m", "--qos-ms", "50"]
    assert main([*args, "--budget", "2", "--batch-dist", "fixed:2"]) == 0
    text = capsys.readouterr().out
    # Every query has batch size 2, which the CPU serves in 40 ms: the cheaper full-range type.
    assert "base type r5n.large" in text and "UB qps" in text and "<- chosen" in text
    assert "best homogeneous: r5n.large=13" in text


@pytest.mark.parametrize(("top", "listed"), [(1, "; the first 1 listed"), (10, "")])
def test_the_note_says_how_many_are_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], top: int, listed: str
) -> None:
    """``--top`` below the ten the similarity pick reads: the note said "top 10 kept" over a
    list of one."""
    profiles = write_profile_csv(tmp_path / "p.csv")
    args = ["bounds", "--profiles", str(profiles), "--model", "m", "--qos-ms", "50"]
    assert main([*args, "--budget", "2", "--batch-dist", "fixed:2", "--top", str(top)]) == 0
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "kept" in line]
    assert note.endswith(" kept" + listed)


@needs_shared
def test_the_paper_setting_from_the_command_line() -> None:
    result = run_cli(
        "bounds", "--profiles", str(KAIROS_CSV), "--model", "rm2", "--qos-ms", "350", *PAPER,
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    top = out["ranking"][0]
    assert top["fleet"] == {"g4dn.xlarge": 1, "c5n.2xlarge": 0, "r5n.large": 13, "t3.xlarge": 0}
    assert top["upper_bound_qps"] == pytest.approx(144, rel=0.03)
    assert out["chosen"]["fleet"] == top["fleet"] and out["chosen"]["rank"] == 1
    assert out["best_homogeneous"]["fleet"]["g4dn.xlarge"] == 4
    assert out["best_homogeneous"]["upper_bound_qps"] == pytest.approx(60, rel=0.03)
    assert out["enumerated"] == 331 and out["exhaustive"] is True
    assert out["quantities"]["t3.xlarge"]["violation_batch"] == 400


BAD_INPUTS = {
    "unknown type in --max-count": (
        ["--max-count", "g9.huge=2"],
        "unknown instance type 'g9.huge'",
    ),
    "malformed --max-count": (["--max-count", "g4dn.xlarge"], "must look like type=count"),
    "negative --max-count": (["--max-count", "r5n.large=-1"], "must be >= 0"),
    "unaffordable budget": (
        ["--budget", "0.3"],
        "affords no configuration: the cheapest full-range type g4dn.xlarge costs $0.526/hr",
    ),
    "negative budget": (["--budget", "-1"], "budget must be a finite number"),
    "a QoS no type meets": (["--qos-ms", "5"], "no instance type meets QoS 5 ms"),
    "unknown type in --types": (["--types", "g4dn.xlarge,zz.large"], "unknown instance type"),
    "top below one": (["--top", "0"], "--top must be >= 1"),
    "bad batch spec": (["--batch-dist", "poisson:3"], "unknown batch-size spec"),
    "mix outside the profile": (["--batch-dist", "fixed:9"], "batch size 9 is outside"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path: Path, case: str) -> None:
    profiles = write_profile_csv(tmp_path / "p.csv")
    args = {"--model": "m", "--qos-ms": "50", "--budget": "3", "--profiles": str(profiles)}
    args["--batch-dist"] = "fixed:3"
    extra, message = BAD_INPUTS[case]
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        args[flag] = value
    result = run_cli("bounds", *(item for pair in args.items() for item in pair))
    assert result.returncode == 2, result.stdout
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert message in result.stderr
    assert result.stderr.startswith("heteroplane bounds: ")


def test_kairos_plus_reports_its_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profiles = write_profile_csv(tmp_path / "p.csv")
    args = ["bounds", "--profiles", str(profiles), "--model", "m", "--qos-ms", "50"]
    args += ["--budget", "1.5", "--batch-dist", "gaussian:mean=2,sd=1,low=1,high=4"]
    assert main([*args, "--kairos-plus", "--queries", "2000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plus = out["kairos_plus"]
    assert 1 <= plus["evaluations"] <= plus["configurations"]
    skipped = plus["configurations"] - plus["evaluations"]
    assert skipped == plus["pruned_by_bound"] + plus["pruned_as_subconfiguration"]
    assert plus["allowable_qps"] > 0
    assert plus["cost_usd_per_hr"] <= 1.5 + 1e-9
