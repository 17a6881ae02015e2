"""benchmarks/autoscaling_heldout.py: the trace family (deterministic per seed, disjoint seed
sets, each family the shape it claims) and the rows (ratios, goals, summary) on a tiny case."""

from __future__ import annotations

import functools
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from benchmarks import autoscaling_heldout as h
from benchmarks.autoscaling_heldout import (
    FAMILIES,
    TEST_SEEDS,
    TUNING_SEEDS,
    TraceCase,
    case_trace,
    make_case,
)

RATE_QPS = 100.0
DURATION_S = 600.0


def ones(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.ones(n, dtype=np.int64)


def trace_of(family: str, seed: int = 201, model: str = "rm2") -> tuple[TraceCase, np.ndarray]:
    case = make_case(family, model, seed, rate_qps=RATE_QPS, duration_s=DURATION_S)
    return case, case_trace(case, ones).arrival_s


def rate_in(arrival_s: np.ndarray, lo_s: float, hi_s: float) -> float:
    return float(np.count_nonzero((arrival_s >= lo_s) & (arrival_s < hi_s))) / (hi_s - lo_s)


def test_tuning_and_test_seeds_are_disjoint() -> None:
    assert TUNING_SEEDS and TEST_SEEDS
    assert not set(TUNING_SEEDS) & set(TEST_SEEDS)
    assert h.set_of(TUNING_SEEDS[0]) == "tuning" and h.set_of(TEST_SEEDS[0]) == "test"
    assert h.set_of(max(*TUNING_SEEDS, *TEST_SEEDS) + 1) == "other"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_case_is_the_same_for_its_seed_and_another_for_another_seed(family: str) -> None:
    case, arrivals = trace_of(family)
    again, arrivals_again = trace_of(family)
    assert case == again
    np.testing.assert_array_equal(arrivals, arrivals_again)
    other, other_arrivals = trace_of(family, seed=202)
    assert other.params != case.params or not np.array_equal(arrivals, other_arrivals)
    assert 1.0 <= case.cv2 <= 8.0
    assert arrivals.size and arrivals[0] >= 0.0 and arrivals[-1] < DURATION_S
    assert np.all(np.diff(arrivals) >= 0.0)


def test_the_model_keys_the_draw_too() -> None:
    assert trace_of("rise", model="rm2")[0].params != trace_of("rise", model="wnd")[0].params


@pytest.mark.parametrize("seed", [101, 201, 202])
def test_each_family_has_its_shape(seed: int) -> None:
    minute = 60.0
    end = DURATION_S - minute

    case, a = trace_of("rise", seed)
    assert rate_in(a, end, DURATION_S) > 1.5 * rate_in(a, 0.0, minute)

    case, a = trace_of("fall", seed)
    assert rate_in(a, 0.0, minute) > 1.5 * rate_in(a, end, DURATION_S)

    case, a = trace_of("step", seed)
    p = case.p
    before = rate_in(a, 0.0, p["at_s"])
    after = rate_in(a, p["at_s"], DURATION_S)
    assert (after > before) == (p["to"] > p["from"])
    assert max(before, after) / min(before, after) > 1.15
    assert case.steep == (p["factor"] > h.STEEP_STEP)

    case, a = trace_of("diurnal", seed)
    half = case.p["period_s"] / 2
    assert rate_in(a, half - 30.0, half + 30.0) > 1.3 * rate_in(a, 0.0, minute)

    case, a = trace_of("spikes", seed)
    p = case.p
    for k in range(int(p["count"])):
        start, length = p[f"start{k}_s"], p[f"length{k}_s"]
        assert start >= 0.0 and start + length <= DURATION_S
        assert rate_in(a, start, start + length) > 1.2 * RATE_QPS

    case, a = trace_of("blip", seed)
    at_s, extra = case.p["at_s"], case.p["extra"]
    assert 3 * RATE_QPS <= extra <= 6 * RATE_QPS
    # The extra queries all arrive within the one second, on top of the steady rate.
    assert rate_in(a, at_s, at_s + 1.0) >= extra
    assert rate_in(a, at_s + 1.0, DURATION_S) < 1.5 * RATE_QPS


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown family"):
        make_case("sawtooth", "rm2", 1, rate_qps=RATE_QPS)


def metrics(cost: float, miss: float, actions: int = 0) -> dict[str, object]:
    return {"cost_usd": cost, "miss_share": miss, "p99_ms": 1.0, "scaling_actions": actions}


def test_the_row_has_the_ratios_and_goals_of_each_policy() -> None:
    blip = make_case("blip", "rm2", 201, rate_qps=RATE_QPS)
    policies = {
        "tuner": metrics(1.04, 0.005, 3),
        "static": metrics(1.0, 0.004),
        "CG-Peak": metrics(1.3, 0.001),
        "CG-Mean": metrics(0.9, 0.05),
        "target tracking": None,
        "oracle": metrics(1.0, 0.002, 1) | {"feasible": True},
    }
    row = h.case_row(blip, 1000, policies)
    tuner = row["policies"]["tuner"]
    assert tuner["cost_over_oracle"] == pytest.approx(1.04)
    assert tuner["cost_over_peak"] == pytest.approx(0.8)
    assert tuner["cost_over_static"] == pytest.approx(1.04)
    assert tuner["meets_goal"] is True and len(tuner["goals"]) == 4
    assert row["policies"]["CG-Peak"]["meets_goal"] is False  # not cheaper than itself
    assert row["policies"]["CG-Mean"]["meets_goal"] is False  # 5% missed
    assert row["set"] == "test" and row["family"] == "blip"
    # The same fleet as CG-Peak's, its last answer a few milliseconds sooner: not cheaper.
    policies["static"] = metrics(1.3 * (1.0 - 1e-5), 0.004)
    row = h.case_row(blip, 1000, policies)
    assert row["policies"]["static"]["goals"]["cheaper than CG-Peak"] is False
    policies["static"] = metrics(1.0, 0.004)

    # A blip the tuner over-reacts to: within 1.15x the oracle but not within 5% of static.
    policies["tuner"] = metrics(1.1, 0.005, 9)
    row = h.case_row(blip, 1000, policies)
    failed = [g for g, ok in row["policies"]["tuner"]["goals"].items() if not ok]
    assert failed == ["cost <= 1.05x static"]

    summary = h.summarise([row])
    assert summary["policies"]["tuner"]["meets_goal"] == 0
    assert summary["policies"]["tuner"]["mean_peak_over_cost"] == pytest.approx(1.3 / 1.1)
    assert summary["tuner_mean_peak_over_cost_goal"] is False
    assert summary["blips"] == 1 and summary["blips_within_static"] == 0
    assert "target tracking" not in summary["policies"]
    text = h.set_markdown("test", [row], summary)
    assert "FAILS: cost <= 1.05x static" in text and "n/a" in text


def test_a_steep_step_allows_two_percent() -> None:
    seeds = range(300, 400)
    steps = [make_case("step", "rm2", s, rate_qps=RATE_QPS) for s in seeds]
    steep = next(c for c in steps if c.steep)
    gentle = next(c for c in steps if not c.steep)
    assert steep.max_miss == 0.02 and gentle.max_miss == 0.01


def test_a_tiny_case_runs_every_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cascade (synthetic, no shared data), a short trace and planning: every policy's row.
    monkeypatch.setattr(h, "QUICK_PLANNING_S", 20.0)
    monkeypatch.setitem(h.NOMINAL_RATE_QPS, h.CASCADE, 100.0)
    monkeypatch.setattr(h, "_SETUPS", {})
    # A short ladder (three loads, one burstiness): the rows, not the sizing, are tested here.
    monkeypatch.setattr(
        h,
        "cascade_sizing",
        functools.partial(h.cascade_sizing, loads=(0.5, 1.0, 2.0), burstiness=()),
    )
    case = make_case("step", h.CASCADE, 201, rate_qps=100.0, duration_s=60.0)
    row = h.run_case(case, quick=True)
    p = row["policies"]
    assert p["target tracking"] is None  # replay's utilisation policy scales one stage
    for name in ("tuner", "static", "CG-Peak", "CG-Mean"):
        assert p[name]["cost_usd"] > 0.0 and 0.0 <= p[name]["miss_share"] <= 1.0
        assert p[name]["cost_over_oracle"] == pytest.approx(
            p[name]["cost_usd"] / p["oracle"]["cost_usd"]
        )
    assert p["static"]["scaling_actions"] == 0
    assert row["queries"] > 0 and row["tuner_model"] == "ladder"


def _cascade_folder_in_worker() -> str:
    folder = h.cascade_folder()
    (folder / "profiles.json").write_text("{}")
    return str(folder)


def test_a_jobs_worker_removes_its_cascade_folder_when_it_ends() -> None:
    with ProcessPoolExecutor(max_workers=1) as pool:
        folder = Path(pool.submit(_cascade_folder_in_worker).result())
        assert folder.is_dir()
    assert not folder.exists()
