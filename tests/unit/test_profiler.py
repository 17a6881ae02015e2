"""The profiler and ``heteroplane profile``: measured profiles, emulated types, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from controlplane.apps import profiler
from controlplane.apps.profiler import (
    REFERENCE_TYPE,
    MeasureSettings,
    emulated_profiles,
    emulated_types,
    measure_family,
    parse_batch_sizes,
)
from controlplane.cli import main
from estimator.catalog import InstanceType, default_catalog
from estimator.profiles import LatencyProfile, load_profiles

FEW = ["--samples", "3", "--warmup", "1"]


def bad_input(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command line, expect exit status 2; return its one line of stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_measure_family_times_each_model_and_batch_size(trained_family: Path) -> None:
    profiles = measure_family(
        ["tiny", "large"], (1, 4), MeasureSettings(samples=3, warmup=1), cache_dir=trained_family
    )
    assert [(p.model, p.instance_type) for p in profiles] == [
        ("tiny", REFERENCE_TYPE),
        ("large", REFERENCE_TYPE),
    ]
    for profile in profiles:
        assert profile.batch_sizes.tolist() == [1, 4]
        assert all(cell.size == 3 for cell in profile.samples_ms)
        assert all(math.isfinite(v) and v > 0 for cell in profile.samples_ms for v in cell)


def test_emulated_profiles_divide_by_the_speed_factor() -> None:
    base = LatencyProfile(
        "m", REFERENCE_TYPE, np.array([1, 8]), (np.array([2.0, 4.0]), np.array([8.0]))
    )
    slow, fast = (
        InstanceType("emu.a", 0.1, speed_factor=0.5),
        InstanceType("emu.b", 1, speed_factor=4),
    )
    derived = emulated_profiles([base], [slow, fast])
    assert [(p.model, p.instance_type) for p in derived] == [("m", "emu.a"), ("m", "emu.b")]
    assert derived[0].mean_ms.tolist() == [6.0, 16.0]
    assert derived[1].mean_ms.tolist() == [0.75, 2.0]


def test_the_default_catalog_emulates_three_types() -> None:
    names = {t.name: t.speed_factor for t in emulated_types(default_catalog())}
    assert names == {"emu.cpu.small": 0.5, "emu.cpu.large": 1.0, "emu.gpu": 4.0}


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("4, 1,2") == (1, 2, 4)
    for text, message in [
        ("1,x", "not a whole number"),
        ("0,2", "outside"),
        ("2,2", "repeat"),
        ("1,,2", "separated by commas"),
        ("", "separated by commas"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_batch_sizes(text)


def test_measure_writes_a_profile_file_with_emulated_types(
    trained_family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out)]
    assert main([*argv, "--models", "tiny,medium", "--batch-sizes", "1,2,4", *FEW, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["instance_types"] == [
        REFERENCE_TYPE,
        "emu.cpu.small",
        "emu.cpu.large",
        "emu.gpu",
    ]
    assert summary["models"] == ["tiny", "medium"]

    profiles = load_profiles(out)
    assert len(profiles) == 2 * 4
    catalog = default_catalog()
    for model in ("tiny", "medium"):
        measured = profiles.get_profile(model, REFERENCE_TYPE)
        assert measured.batch_sizes.tolist() == [1, 2, 4]
        assert np.all(np.isfinite(measured.mean_ms)) and np.all(measured.mean_ms > 0)
        for name in ("emu.cpu.small", "emu.cpu.large", "emu.gpu"):
            emulated = profiles.get_profile(model, name)
            np.testing.assert_allclose(
                emulated.mean_ms, measured.mean_ms / catalog[name].speed_factor
            )
    meta = json.loads(out.read_text())
    assert meta["format"] == "heteroplane.profiles/v1"
    assert meta["source"] == "measured" and meta["reference_type"] == REFERENCE_TYPE
    for key in ("host", "torch", "date"):
        assert meta[key]

    assert main(["profile", "show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["profiles"]) == 8 and shown["models"] == ["medium", "tiny"]
    assert main(["profile", "show", str(out)]) == 0
    assert "emu.gpu" in capsys.readouterr().out


def test_measure_takes_chosen_types_and_a_catalog(
    trained_family: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    catalog = tmp_path / "catalog.csv"
    catalog.write_text("instance_type,price_usd_per_hr,speed_factor\nmy.box,0.2,2.0\n")
    out = tmp_path / "p.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out), *FEW]
    more = ["--catalog", str(catalog), "--instance-types", "my.box,local.cpu", "--models", "tiny"]
    assert main([*argv, *more, "--batch-sizes", "1"]) == 0
    capsys.readouterr()
    profiles = load_profiles(out)
    assert sorted(profiles) == [("tiny", REFERENCE_TYPE), ("tiny", "my.box")]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--models", "tiny,huge"], "unknown model 'huge'"),
        (["--models", "tiny,tiny"], "twice"),
        (["--batch-sizes", "1,two"], "--batch-sizes: batch size 'two' is not a whole number"),
        (["--batch-sizes", "0"], "outside"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--instance-types", "emu.nope"], "emu.nope"),
        (["--instance-types", "g4dn.xlarge"], "real instance type"),
    ],
)
def test_measure_refuses_bad_input(
    trained_family: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    message: str,
) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "measure", "--cache-dir", str(trained_family), "--out", str(out)]
    assert message in bad_input(capsys, *argv, *options)
    assert not out.exists()


def test_measure_refuses_an_unwritable_out_path_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(profiler, "measure_family", never)
    cache = str(tmp_path / "unused")
    missing = tmp_path / "no" / "such" / "dir" / "p.json"
    argv = ["profile", "measure", "--cache-dir", cache]
    assert "does not exist" in bad_input(capsys, *argv, "--out", str(missing))
    assert "is a directory" in bad_input(capsys, *argv, "--out", str(tmp_path))


def test_show_refuses_a_missing_or_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "cannot read" in bad_input(capsys, "profile", "show", str(tmp_path / "none.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"profiles": 3}')
    assert "profiles" in bad_input(capsys, "profile", "show", str(bad))
