"""Bad input to the estimator's readers and searches is a one-line EstimatorError, never an
OverflowError: a trace spanning 1e200 s, a profile batch size of 10**30, a budget of 1e308."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from estimator.batches import MAX_BATCH_SIZE
from estimator.bounds import kairos_quantities, rank_configurations
from estimator.errors import ProfileError, TraceError
from estimator.profiles import LatencyProfile, ProfileSet, load_profiles
from estimator.traces import Trace, trace_stats

# --- trace_stats ----------------------------------------------------------------------------


@pytest.mark.parametrize("gap_s", [1e200, 1e160, 1e-200, 1e-300])
def test_trace_stats_of_huge_or_tiny_gaps_is_finite(gap_s: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or underflow warning either
        stats = trace_stats(Trace(np.array([0.0, gap_s, 3 * gap_s]), np.ones(3, np.int64)))
    # Gaps of 1 and 2 units: mean 1.5, population variance 0.25, CV^2 = 1/9.
    assert stats.cv2 == pytest.approx(1 / 9)
    assert stats.rate_qps == pytest.approx(2 / (3 * gap_s))
    assert stats.duration_s == 3 * gap_s


def test_trace_stats_keeps_its_values_on_an_ordinary_trace() -> None:
    arrival = np.cumsum(np.random.default_rng(3).exponential(0.1, size=2000))
    gaps = np.diff(arrival)
    stats = trace_stats(Trace(arrival, np.ones(arrival.size, np.int64)))
    assert stats.cv2 == pytest.approx(gaps.var() / gaps.mean() ** 2, rel=1e-12)


def test_a_span_too_short_for_a_finite_rate_is_a_trace_error() -> None:
    trace = Trace(np.array([0.0, 5e-324, 1e-323]), np.ones(3, np.int64))
    with pytest.raises(TraceError, match="too short for a finite rate") as caught:
        trace_stats(trace)
    assert "\n" not in str(caught.value)


# --- profile batch sizes --------------------------------------------------------------------


def _profile_json(path: Path, sizes: list[int]) -> Path:
    document = {
        "format": "heteroplane.profiles/v1",
        "profiles": [
            {
                "model": "m",
                "instance_type": "g4dn.xlarge",
                "batch_sizes": sizes,
                "latency_ms": [[1.0, 2.0] for _ in sizes],
            }
        ],
    }
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("largest", [10**30, 2**63, MAX_BATCH_SIZE + 1])
def test_a_profile_json_batch_size_past_the_bound_names_the_field(
    tmp_path: Path, largest: int
) -> None:
    path = _profile_json(tmp_path / "p.json", [1, largest])
    with pytest.raises(ProfileError, match=r"profiles\[0\]: batch_sizes must be at most") as caught:
        load_profiles(path)
    assert "\n" not in str(caught.value) and str(largest) in str(caught.value)


def test_a_profile_json_at_the_bound_reads(tmp_path: Path) -> None:
    profiles = load_profiles(_profile_json(tmp_path / "p.json", [1, MAX_BATCH_SIZE]))
    assert profiles.get_profile("m", "g4dn.xlarge").max_batch_size == MAX_BATCH_SIZE


def test_a_kairos_csv_batch_size_past_the_bound_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text(
        "model,instance_type,batch_size,sample,infer_ms,load_ms\n"
        f"m,x,10,0,1,2\nm,x,{MAX_BATCH_SIZE + 1},0,1,2\n"
    )
    with pytest.raises(ProfileError, match=r"line 3: batch_size 1000001 is past the largest"):
        load_profiles(path)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("m,x,1,0,1,2\n,x,1,0,1,2\n", "line 3: model must be a non-empty name"),
        ("m,x,1,0,1,2\nm, ,1,0,1,2\n", "line 3: instance_type must be a non-empty name"),
    ],
)
def test_a_kairos_csv_name_must_not_be_empty(tmp_path: Path, rows: str, message: str) -> None:
    path = tmp_path / "p.csv"
    path.write_text("model,instance_type,batch_size,sample,infer_ms,load_ms\n" + rows)
    with pytest.raises(ProfileError, match=message):
        load_profiles(path)


def test_a_kairos_csv_with_a_byte_order_mark_reads(tmp_path: Path) -> None:
    # A spreadsheet's UTF-8 export: the mark was read as part of the first column's name.
    path = tmp_path / "p.csv"
    text = "model,instance_type,batch_size,sample,infer_ms,load_ms\nm,x,1,0,1,2\nm,x,1,1,1,2\n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_profiles(path).get_profile("m", "x").min_batch_size == 1


@pytest.mark.parametrize("sizes", [[1, 10**30], [1, MAX_BATCH_SIZE * 10]])
def test_a_latency_profile_refuses_batch_sizes_past_the_bound(sizes: list[int]) -> None:
    with pytest.raises(ProfileError, match="1,000,000") as caught:
        LatencyProfile("m", "x", np.array(sizes, dtype=object), (np.array([1.0]), np.array([2.0])))
    assert "\n" not in str(caught.value)


# --- the bounds' budget ---------------------------------------------------------------------


def test_an_absurd_budget_is_capped_not_an_overflow() -> None:
    profiles = ProfileSet(
        LatencyProfile("m", name, np.array([1, 2]), (np.array([a]), np.array([b])))
        for name, (a, b) in {"gpu": (10.0, 20.0), "cpu": (20.0, 60.0)}.items()
    )
    q = kairos_quantities(
        profiles, "m", ["gpu", "cpu"], {"gpu": 1.0, "cpu": 0.2}, 50.0, ([1, 2], [0.5, 0.5])
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning on the way
        ranking = rank_configurations(q, 1e308, {"gpu": 2, "cpu": 3}, top=3)
    assert ranking.counts.shape[0] == 3
    assert ranking.counts.max(axis=0).tolist() == [2, 3]
