"""``heteroplane cascade evaluate``: the JSON contract on the demo family, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli import main
from controlplane.policies.cascade_choice import ACCURACY_TOLERANCE
from estimator.profiles import load_profiles
from provisioners.worker.family import MODEL_NAMES

FEW = ["--samples", "5", "--warmup", "1"]


def evaluate(capsys: pytest.CaptureFixture[str], cache: Path, *options: str) -> Any:
    argv = ["cascade", "evaluate", "--cache-dir", str(cache), *FEW, *options, "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_contract(trained_family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = evaluate(capsys, trained_family, "--max-stages", "3", "--thresholds", "0.2,0.5,0.8")
    assert [m["name"] for m in out["models"]] == list(MODEL_NAMES)
    for model in out["models"]:
        assert set(model) >= {"name", "accuracy", "compute_ms_per_query"}
        assert 0 < model["accuracy"] <= 1
        assert math.isfinite(model["compute_ms_per_query"]) and model["compute_ms_per_query"] > 0
    assert out["cascades"]
    for cascade in out["cascades"]:
        assert set(cascade) >= {
            "models",
            "thresholds",
            "accuracy",
            "compute_ms_per_query",
            "reach_share",
        }
        stages = len(cascade["models"])
        assert 1 <= stages <= 3 and len(cascade["reach_share"]) == stages
        assert len(cascade["thresholds"]) == stages - 1
        assert set(cascade["thresholds"]) <= {0.2, 0.5, 0.8}
        assert cascade["reach_share"][0] == 1
        assert cascade["reach_share"] == sorted(cascade["reach_share"], reverse=True)
        assert cascade["compute_ms_per_query"] > 0
        order = [MODEL_NAMES.index(m) for m in cascade["models"]]
        assert order == sorted(order)  # cheapest first
    # The Pareto set: compute rises, and so does accuracy.
    compute = [c["compute_ms_per_query"] for c in out["cascades"]]
    accuracy = [c["accuracy"] for c in out["cascades"]]
    assert compute == sorted(compute) and accuracy == sorted(accuracy)
    # The best: flagged once, within the tolerance of the most accurate model, the cheapest such.
    flagged = [c for c in out["cascades"] if c["best"]]
    assert flagged == [out["best"]]
    top = max(m["accuracy"] for m in out["models"])
    assert out["best"]["accuracy"] >= top - ACCURACY_TOLERANCE - 1e-12
    cheaper = [
        c for c in out["cascades"] if c["compute_ms_per_query"] < flagged[0]["compute_ms_per_query"]
    ]
    assert all(c["accuracy"] < top - ACCURACY_TOLERANCE for c in cheaper)
    # The held-out protocol: ``accuracy`` is the choose split's, ``held_out_accuracy`` the
    # score split's; the two splits share nothing and hold every sample.
    split = out["split"]
    assert split["choose_samples"] + split["score_samples"] == out["validation_samples"]
    for entry in (*out["models"], *out["cascades"], out["best"]):
        assert 0 < entry["held_out_accuracy"] <= 1


def test_human_summary(trained_family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cascade", "evaluate", "--cache-dir", str(trained_family), *FEW, "--max-stages", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "Pareto set of cascades" in captured.out and "best:" in captured.out
    assert "held-out" in captured.out and "in-sample" in captured.out
    assert "timing" in captured.err  # progress goes to stderr


def test_single_models_only(trained_family: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = evaluate(capsys, trained_family, "--max-stages", "1", "--models", "tiny,large")
    assert {tuple(c["models"]) for c in out["cascades"]} <= {("tiny",), ("large",)}
    assert out["best"]["models"] == ["large"] and out["best"]["reach_share"] == [1.0]
    # In words: the model alone is the best, not "1.0x less compute" than itself.
    argv = ["cascade", "evaluate", "--cache-dir", str(trained_family), *FEW, "--max-stages", "1"]
    assert main([*argv, "--models", "tiny,large"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("best: large alone (") and "less compute" in summary, summary
    assert "x less compute" not in summary, summary


def test_compute_from_a_profile_file(
    trained_family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = tmp_path / "profiles.json"
    measure = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(profiles)]
    assert main([*measure, "--batch-sizes", "1,2", "--samples", "3", "--warmup", "1"]) == 0
    capsys.readouterr()
    out = evaluate(
        capsys, trained_family, "--profiles", str(profiles), "--instance-type", "emu.gpu"
    )
    expected = load_profiles(profiles)
    for model in out["models"]:
        profile = expected.get_profile(model["name"], "emu.gpu")
        assert model["compute_ms_per_query"] == pytest.approx(profile.mean_latency_ms(1))
    assert "emu.gpu" in out["compute_source"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--models", "tiny,giant"], "unknown model 'giant'"),
        (["--thresholds", "0.1,abc"], "'abc' is not a number"),
        (["--thresholds", "0.5,1.5"], "outside [0, 1]"),
        (["--max-stages", "0"], "--max-stages must be >= 1"),
        (["--samples", "0"], "must be >= 1"),
        (["--profiles", "/nonexistent/profiles.json"], "cannot read"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    trained_family: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cascade", "evaluate", "--cache-dir", str(trained_family), *options])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
