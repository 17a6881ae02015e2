"""``heteroplane capacity``: the JSON contract, the policies, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.cli import main

HETEROPLANE = Path(sys.executable).with_name("heteroplane")


def write_profiles(path: Path) -> Path:
    rows = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for itype, per_item in (("g4dn.xlarge", 0.5), ("r5n.large", 2.0)):
        for batch in (10, 50, 100):
            rows += [
                f"m,{itype},{batch},{i},{per_item * batch * (1 + i / 100)},0" for i in range(6)
            ]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("policy", ["fcfs", "clockwork", "drs", "oracle"])
def test_capacity_prints_allowable_qps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    profiles = write_profiles(tmp_path / "p.csv")
    args = ["capacity", "--profiles", str(profiles), "--model", "m", "--policy", policy]
    args += ["--fleet", "g4dn.xlarge=1,r5n.large=3", "--qos-ms", "80", "--queries", "2000"]
    args += ["--batch-dist", "gaussian:mean=50,sd=20,low=10,high=100,step=10", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["allowable_qps"] > 0
    assert out["base_types"] == ["g4dn.xlarge"]  # r5n.large takes 200 ms at batch 100
    if policy == "drs":
        assert 10 <= out["drs_threshold"] <= 100


def test_the_oracle_bounds_the_online_policies(tmp_path: Path, capsys) -> None:
    profiles = write_profiles(tmp_path / "p.csv")
    results = {}
    for policy in ("fcfs", "clockwork", "oracle"):
        args = ["capacity", "--profiles", str(profiles), "--model", "m", "--policy", policy]
        args += ["--fleet", "g4dn.xlarge=1,r5n.large=3", "--qos-ms", "80", "--queries", "3000"]
        args += ["--batch-dist", "gaussian:mean=50,sd=20,low=10,high=100,step=10", "--json"]
        assert main(args) == 0
        results[policy] = json.loads(capsys.readouterr().out)["allowable_qps"]
    assert results["oracle"] >= results["clockwork"] >= results["fcfs"]


def test_a_fleet_without_a_full_range_type_is_refused(tmp_path: Path) -> None:
    profiles = write_profiles(tmp_path / "p.csv")
    result = subprocess.run(
        [str(HETEROPLANE), "capacity", "--profiles", str(profiles), "--model", "m",
         "--fleet", "r5n.large=3", "--qos-ms", "80", "--batch-dist", "fixed:100"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "meets QoS 80 ms at every batch size" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_capacity_without_bound_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A QoS no compression of the workload can miss: every rate meets the target, and the
    search's limit was "no answer within 40 simulations", which did not say why."""
    profiles = write_profiles(tmp_path / "p.csv")
    args = ["capacity", "--profiles", str(profiles), "--model", "m", "--policy", "fcfs"]
    args += ["--fleet", "g4dn.xlarge=1", "--qos-ms", "86400000", "--queries", "200"]
    args += ["--batch-dist", "fixed:10"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "the capacity is unbounded at this QoS" in err, err


def test_a_batch_mix_outside_the_profile_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default mix (Kairos', up to 1,000 samples a query) against a profile measured on
    batches 10..100: one line naming ``--batch-dist`` and a mix within the profile, where it
    said only that a batch size was outside it."""
    profiles = write_profiles(tmp_path / "p.csv")
    args = ["capacity", "--profiles", str(profiles), "--model", "m"]
    args += ["--fleet", "g4dn.xlarge=1", "--qos-ms", "80", "--queries", "200"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--batch-dist kairos: draws batch size" in err, err
    assert "(measured 10..100); give a mix within it, e.g. --batch-dist fixed:10" in err, err
