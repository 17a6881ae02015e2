"""The CascadeServe results experiment's pure helpers (benchmarks/results/cascades.py): targets,
the least-count search, the plan's prediction over a trace and the placement enumeration."""

from __future__ import annotations

import dataclasses
import doctest
import math

import numpy as np
import pytest

from benchmarks.results import cascades
from benchmarks.results.cascades import (
    Cell,
    SingleResult,
    Verified,
    accuracy_targets,
    compositions,
    expansions,
    gear_cell,
    least_instances,
    plan_prediction,
    predicted_accuracy,
    range_weights,
    reaches,
    single_cell,
)
from controlplane.policies.gears import CascadePlacement, Gear, GearOption, GearPlan
from estimator.cascades import Cascade, CascadeQuality


def test_doctests() -> None:
    result = doctest.testmod(cascades)
    assert result.attempted > 0 and result.failed == 0


def test_reaches_compares_at_two_decimals() -> None:
    assert reaches(0.98748, 98.75)  # shown as 98.75%
    assert not reaches(0.98744, 98.75)  # shown as 98.74%
    assert reaches(1.0, 100.0)


def test_targets_hold_every_model_the_best_cascade_and_a_grid_above_the_second_model() -> None:
    targets = accuracy_targets([0.93, 0.965, 0.985], 0.9893, 0.5)
    assert targets == (93.0, 96.5, 97.0, 97.5, 98.0, 98.5, 98.93)
    assert list(targets) == sorted(set(targets))
    # A grid point equal to a model's accuracy appears once.
    assert accuracy_targets([0.95, 0.97, 0.98], 0.98, 0.5) == (95.0, 97.0, 97.5, 98.0)


@pytest.mark.parametrize("answer", [1, 2, 3, 7, 8, 9, 31, 32])
def test_least_instances_finds_the_threshold_of_a_monotone_predicate(answer: int) -> None:
    asked: list[int] = []

    def meets(n: int) -> bool:
        asked.append(n)
        return n >= answer

    assert least_instances(meets, 32) == answer
    assert len(asked) <= 2 * math.ceil(math.log2(32)) + 2


def test_least_instances_is_none_past_the_cap() -> None:
    assert least_instances(lambda n: n >= 33, 32) is None
    assert least_instances(lambda n: False, 5) is None


def test_range_weights_sum_the_rates_per_range_and_clip_the_top() -> None:
    rates = np.array([0.5, 1.5, 1.9, 9.0, 50.0])
    weights = range_weights(rates, 10.0, 5)
    assert weights.tolist() == pytest.approx([0.5 + 1.5 + 1.9, 0.0, 0.0, 0.0, 59.0])
    assert weights.sum() == pytest.approx(rates.sum())


def test_predicted_accuracy_weights_by_arrivals_and_flags_unserved_ranges() -> None:
    weights = np.array([2.0, 0.0, 6.0])
    assert predicted_accuracy([0.9, None, 0.98], weights) == pytest.approx((2 * 0.9 + 6 * 0.98) / 8)
    assert predicted_accuracy([0.9, 0.95, None], weights) is None


def _option(label: tuple[str, ...], accuracy: float, max_qps: float) -> GearOption:
    cascade = Cascade(label, tuple(0.5 for _ in label[:-1]))
    quality = CascadeQuality(accuracy, (1.0,) * len(label), (1.0,))
    return GearOption(cascade, quality, (1,) * len(label), max_qps, max_qps, ((1.0, 1.0),), 1.0)


def test_plan_prediction_uses_each_range_gear_and_its_slo_flag() -> None:
    options = (_option(("a",), 0.90, 100.0), _option(("a", "b"), 0.99, 50.0))
    gears = (Gear(0.0, 50.0, 1, True), Gear(50.0, 100.0, 0, True))
    plan = GearPlan(
        CascadePlacement.parse("a:c=1;b:c=1"), 10.0, 99.0, None, options, gears, 100.0, 0, 0
    )
    # The load's rates each second: 60 queries' worth in each range (above 100 is the last).
    rates = np.array([10.0, 20.0, 30.0, 60.0])
    assert plan_prediction(plan, rates) == pytest.approx((60 * 0.99 + 60 * 0.90) / 120)
    missed = dataclasses.replace(plan, gears=(gears[0], Gear(50.0, 100.0, 0, False)))
    assert plan_prediction(missed, rates) is None
    assert plan_prediction(missed, np.array([10.0, 30.0])) == pytest.approx(0.99)
    # A plan whose first range is split (more gears than equal ranges): each rate to its gear.
    split = dataclasses.replace(
        plan, gears=(Gear(0.0, 25.0, 1, True), Gear(25.0, 50.0, 0, True), gears[1])
    )
    assert plan_prediction(split, rates) == pytest.approx((30 * 0.99 + 90 * 0.90) / 120)


def test_compositions_are_every_split_once() -> None:
    split = compositions(4, 3)
    assert len(split) == math.comb(4 + 2, 2)
    assert len(set(split)) == len(split)
    assert all(sum(c) == 4 and min(c) >= 0 for c in split)


def test_expansions_add_one_instance_to_each_model() -> None:
    assert expansions((0, 2, 1)) == [(1, 2, 1), (0, 3, 1), (0, 2, 2)]


def _verified(counts: tuple[int, ...], accuracy: float) -> Verified:
    return Verified(counts, str(counts), 10.0, 1.0, accuracy, accuracy, {}, 0, accuracy, [])


def test_cells_take_the_least_count_that_reaches_the_target() -> None:
    singles = [
        SingleResult("small", 0.97, 1, 64, 5.0),
        SingleResult("large", 0.99, 6, 2, 40.0),
        SingleResult("huge", 0.995, None, None, None),
    ]
    assert single_cell(singles, 96.0) == Cell(1, "small, batch cap 64", 0.97)
    assert single_cell(singles, 98.0).instances == 6
    assert single_cell(singles, 99.5).instances is None
    levels = [_verified((1, 0), 0.97), _verified((1, 2), 0.985), _verified((1, 3), 0.99)]
    assert gear_cell(levels, 98.0).instances == 3
    assert gear_cell(levels, 99.0).instances == 4
    assert gear_cell(levels, 99.1).text() == "unreachable"


def test_clip_outliers_clips_preempted_runs_and_keeps_the_top_models_batch_1_mean() -> None:
    from benchmarks.gear_demo import DemoFamily
    from estimator.cascades import synthetic_validation
    from estimator.profiles import LatencyProfile

    records = synthetic_validation(
        np.random.default_rng(0), (0.9, 0.99), names=("a", "b"), n_samples=200
    )
    sizes = np.array([1, 2])
    profiles = {
        "a": {"t": LatencyProfile("a", "t", sizes, (np.full(10, 1.0), np.full(10, 1.5)))},
        "b": {
            "t": LatencyProfile(
                "b", "t", sizes, (np.array([2.0] * 9 + [200.0]), np.array([3.0] * 10))
            )
        },
    }
    family = DemoFamily("test", records, profiles, "t", 0.1, 100.0)
    before = profiles["b"]["t"].mean_latency_ms(1)
    result = cascades.clip_outliers(family)
    assert (result.clipped, result.samples) == (1, 40)
    b = result.family.profiles["b"]["t"]
    assert b.mean_latency_ms(1) == pytest.approx(before)
    # Constant quartiles: Tukey's fence is the value itself.
    assert b.samples_ms[0].max() == pytest.approx(b.samples_ms[0].min())
    # Every profile is scaled by one factor: the ratios between cells hold.
    a = result.family.profiles["a"]["t"]
    assert a.mean_latency_ms(2) / a.mean_latency_ms(1) == pytest.approx(1.5)
    assert b.mean_latency_ms(2) / a.mean_latency_ms(1) == pytest.approx(3.0)


def test_clip_outliers_fence_is_tukeys_or_three_medians() -> None:
    from benchmarks.gear_demo import DemoFamily
    from estimator.cascades import synthetic_validation
    from estimator.profiles import LatencyProfile

    records = synthetic_validation(np.random.default_rng(0), (0.9,), names=("a",), n_samples=50)
    # Q1 6, median 8, Q3 10: Tukey's fence 22, below 3 medians (24).
    spread = np.array([4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 50.0])
    contaminated = np.array([1.0] * 5 + [10.0] * 4)  # Q3 10: Tukey lets 10 pass, 3x median not
    profiles = {"a": {"t": LatencyProfile("a", "t", np.array([1, 2]), (spread, contaminated))}}
    family = DemoFamily("test", records, profiles, "t", 0.1, 100.0)
    result = cascades.clip_outliers(family)
    assert result.clipped == 1 + 4
    cells = result.family.profiles["a"]["t"].samples_ms
    # One factor scales every cell, so the fences show against each cell's least sample.
    assert cells[0].max() / cells[0].min() == pytest.approx(22.0 / 4.0)
    assert cells[1].max() / cells[1].min() == pytest.approx(3.0)
