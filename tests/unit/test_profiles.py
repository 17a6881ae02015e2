"""Profiles: the Kairos samples CSV, the project's JSON, interpolation and draws."""

from __future__ import annotations

import copy
import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from estimator.errors import (
    BatchSizeOutOfRangeError,
    MissingProfileError,
    ProfileError,
    UnknownModelError,
)
from estimator.profiles import LatencyProfile, load_profiles, write_profiles_json
from tests.conftest import KAIROS_CSV, needs_shared


def write_csv(path: Path, rows: list[str], header: str | None = None) -> Path:
    header = header or "model,instance_type,batch_size,sample,infer_ms,load_ms"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


@pytest.fixture(scope="module")
def kairos():  # only used by tests marked needs_shared
    return load_profiles(KAIROS_CSV)


@needs_shared
def test_kairos_samples_load_with_the_largest_sample_dropped(kairos) -> None:
    assert kairos.models == ["dien", "mtwnd", "ncf", "rm2", "wnd"]
    assert kairos.instance_types("rm2") == ["c5n.2xlarge", "g4dn.xlarge", "r5n.large", "t3.xlarge"]
    profile = kairos.get_profile("rm2", "g4dn.xlarge")
    assert profile.batch_sizes.tolist() == list(range(10, 1001, 10))
    assert all(cell.size == 99 for cell in profile.samples_ms)
    # The warm-up outlier of the first cell (hundreds of ms) is gone.
    assert profile.samples_ms[0].max() < 50


@needs_shared
def test_cell_means_match_an_independent_read_of_the_raw_csv(kairos) -> None:
    """latency = infer_ms + load_ms, largest sample of each cell dropped (the authors' rule)."""
    with gzip.open(KAIROS_CSV, "rt") as handle:
        next(handle)
        raw: dict[int, list[float]] = {}
        for line in handle:
            model, itype, batch, _, infer, load = line.strip().split(",")
            if model == "ncf" and itype == "t3.xlarge":
                raw.setdefault(int(batch), []).append(float(infer) + float(load))
    profile = kairos.get_profile("ncf", "t3.xlarge")
    for batch, mean in zip(profile.batch_sizes, profile.mean_ms, strict=True):
        values = sorted(raw[int(batch)])[:-1]
        assert mean == pytest.approx(sum(values) / len(values))


def test_interpolation_between_measured_sizes_and_refusal_outside(tmp_path: Path) -> None:
    rows = [f"m,x,10,{i},{10 + i},0" for i in range(3)] + [
        f"m,x,20,{i},{30 + i},0" for i in range(3)
    ]
    profiles = load_profiles(write_csv(tmp_path / "p.csv", rows))
    profile = profiles.get_profile("m", "x")
    # Largest sample dropped: cells {10, 11} and {30, 31}, means 10.5 and 30.5.
    assert profile.mean_latency_ms(15) == pytest.approx(20.5)
    table = profile.quantile_table_ms(2)
    assert table.shape == (11, 2)
    assert table[5].tolist() == pytest.approx([20.0, 21.0])
    with pytest.raises(BatchSizeOutOfRangeError, match=r"batch size 25 .*measured 10\.\.20"):
        profile.mean_latency_ms(25)
    with pytest.raises(BatchSizeOutOfRangeError):
        profile.draw_ms(5, np.random.default_rng(0))


def test_a_quantile_table_is_computed_once_and_cannot_be_changed(tmp_path: Path) -> None:
    """Each table is kept once made (every simulation and Kairos policy of a search asks for the
    same ones), and kept read-only: a caller that wrote into it would change every later
    answer."""
    rows = [f"m,x,{b},{i},{b * (10 + i)},0" for b in (1, 4) for i in range(4)]
    profile = load_profiles(write_csv(tmp_path / "p.csv", rows)).get_profile("m", "x")
    for ask in (lambda: profile.quantile_table_ms(3), lambda: profile.quantile_by_batch_ms(0.99)):
        table = ask()
        assert ask() is table
        assert not table.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            table[-1] = 0.0
    # Other arguments are other tables, each as it would be made anew.
    assert profile.quantile_table_ms(2).shape == (4, 2)
    assert profile.quantile_table_ms(2).tolist() == profile._quantile_table_ms(2).tolist()
    assert np.array_equal(
        profile.quantile_by_batch_ms(0.5), profile._quantile_by_batch_ms(0.5), equal_nan=True
    )
    # A copy (pickled, as a process pool sends it) makes its own tables, read-only too.
    for copied in (pickle.loads(pickle.dumps(profile)), copy.deepcopy(profile)):
        again = copied.quantile_table_ms(3)
        assert not again.flags.writeable
        assert again.tolist() == profile.quantile_table_ms(3).tolist()


def test_draws_reproduce_the_cells_and_interpolate(tmp_path: Path) -> None:
    samples = np.arange(1.0, 101.0)
    profile = LatencyProfile("m", "x", np.array([1, 3]), (samples, samples + 100))
    rng = np.random.default_rng(0)
    exact = np.array([profile.draw_ms(1, rng) for _ in range(4000)])
    assert set(exact) <= set(samples)
    middle = np.array([profile.draw_ms(2, rng) for _ in range(4000)])
    assert middle.mean() == pytest.approx(100.5, rel=0.03)
    assert profile.draw_ms(2, rng, mode="mean") == pytest.approx(100.5)


def test_json_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    original = [
        LatencyProfile(
            "tiny", t, np.array([1, 2, 4]), tuple(rng.uniform(1, 5, 7) for _ in range(3))
        )
        for t in ("c5.xlarge", "g4dn.xlarge")
    ]
    path = tmp_path / "profiles.json"
    write_profiles_json(original, path, source="test")
    loaded = load_profiles(path)
    assert json.loads(path.read_text())["source"] == "test"
    for profile in original:
        again = loaded.get_profile(profile.model, profile.instance_type)
        assert again.batch_sizes.tolist() == profile.batch_sizes.tolist()
        for a, b in zip(again.samples_ms, profile.samples_ms, strict=True):
            np.testing.assert_allclose(a, np.sort(b))


def test_unknown_model_and_missing_type(tmp_path: Path) -> None:
    profiles = load_profiles(write_csv(tmp_path / "p.csv", ["m,x,10,0,1,0"]))
    with pytest.raises(UnknownModelError, match="unknown model 'zz'"):
        profiles.get_profile("zz", "x")
    with pytest.raises(MissingProfileError, match="no profile for model 'm' on instance type 'y'"):
        profiles.get_profile("m", "y")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("model,instance_type\nm,x\n", "missing column"),
        ("model,instance_type,batch_size,sample,infer_ms,load_ms\n", "no data rows"),
        (
            "model,instance_type,batch_size,sample,infer_ms,load_ms\nm,x,10,0,abc,1\n",
            "line 2: infer_ms 'abc' is not a number",
        ),
        (
            "model,instance_type,batch_size,sample,infer_ms,load_ms\nm,x,10,0,-5,1\n",
            "line 2 needs batch_size >= 1 and latencies >= 0",
        ),
        ("model,instance_type,batch_size,sample,infer_ms,load_ms\nm,x,10\n", "line 2 has 3 fields"),
        (  # a batch that takes no time: the capacity search and the bounds divided by it
            "model,instance_type,batch_size,sample,infer_ms,load_ms\nm,x,10,0,0,0\nm,x,10,1,0,0\n",
            "latencies at batch size 10 are all 0",
        ),
        ("{not json", "malformed JSON"),
        ('{"profiles": [{"model": "m"}]}', "lacks 'instance_type'"),
        (
            '{"profiles": [{"model": "m", "instance_type": "x", "batch_sizes": [2, 1],'
            ' "latency_ms": [[1], [2]]}]}',
            "strictly increasing",
        ),
        ('{"format": "other/v9", "profiles": []}', "unsupported format"),
        # A bare list of entries was read as a CSV ("missing column(s) model, ...").
        (
            '[{"model": "m", "instance_type": "x", "batch_sizes": [1], "latency_ms": [3]}]',
            "a JSON list; a profile JSON is an object whose 'profiles' is that list",
        ),
        ("  [1, 2", "malformed JSON"),
    ],
)
def test_malformed_files_give_one_line_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message) as caught:
        load_profiles(path)
    assert "\n" not in str(caught.value)


def test_binary_junk_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.csv.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ProfileError, match="gzip"):
        load_profiles(path)
