"""The configuration searches of estimator.exploration: the sub-configuration pruning, branch and
bound's exactness against brute force, and how evaluations are counted."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.exploration import (
    bayesian_search,
    branch_and_bound,
    genetic_search,
    maximal_configurations,
    random_search_expected_evaluations,
)

PRICES = np.array([0.526, 0.432, 0.149, 0.1664])  # g4dn, c5n, r5n, t3 ($/hr)
CAPS = np.array([5, 6, 17, 15])
BUDGET = 2.5


def affordable(prices: np.ndarray, caps: np.ndarray, budget: float) -> np.ndarray:
    box = itertools.product(*(range(int(c) + 1) for c in caps))
    counts = np.array([c for c in box if np.dot(c, prices) <= budget + 1e-9])
    return counts


def test_maximal_configurations_are_those_nothing_more_fits_into() -> None:
    counts = affordable(PRICES, CAPS, BUDGET)
    mask = maximal_configurations(counts, PRICES, BUDGET, CAPS)
    for row, is_maximal in zip(counts, mask, strict=True):
        room = BUDGET - row @ PRICES
        fits = any(row[t] < CAPS[t] and PRICES[t] <= room + 1e-9 for t in range(4))
        assert is_maximal == (not fits)
    # Every affordable configuration is a sub-configuration of a maximal one.
    maximal = counts[mask]
    assert all(np.any(np.all(row <= maximal, axis=1)) for row in counts)


def test_a_cap_makes_a_configuration_maximal() -> None:
    mask = maximal_configurations(
        np.array([[1, 2], [1, 1]]), np.array([1.0, 0.1]), 10.0, np.array([1, 2])
    )
    assert mask.tolist() == [True, False]


def test_an_unaffordable_configuration_is_not_maximal() -> None:
    mask = maximal_configurations(np.array([[3, 0]]), np.array([1.0, 1.0]), 2.0, np.array([3, 3]))
    assert mask.tolist() == [False]


def synthetic(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Bounds and throughputs with X <= UB: X = UB * a random tightness in (0.3, 1]."""
    rng = np.random.default_rng(seed)
    bounds = rng.uniform(10.0, 100.0, n)
    return bounds, bounds * rng.uniform(0.3, 1.0, n)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 60), st.sampled_from([0.0, 0.02, 0.1]))
def test_branch_and_bound_finds_the_brute_force_best(seed: int, n: int, slack: float) -> None:
    bounds, qps = synthetic(seed, n)
    qps = np.minimum(qps * (1 + slack), bounds * (1 + slack))  # within the slack of the bound
    calls: list[int] = []

    def evaluate(row: int) -> float:
        calls.append(row)
        return float(qps[row])

    found = branch_and_bound(bounds, evaluate, slack=slack)
    assert found.best_qps == qps.max()
    assert found.proven
    assert found.evaluations == len(calls) == len(set(calls))
    assert list(found.evaluated) == calls
    # Evaluated in descending bound order, and every row skipped could not have won.
    assert np.all(np.diff(bounds[list(found.evaluated)]) <= 0)
    skipped = np.setdiff1d(np.arange(n), found.evaluated)
    assert np.all(bounds[skipped] * (1 + slack) <= found.best_qps)
    assert found.throughput_qps[found.evaluations_to_best - 1] == found.best_qps


def test_branch_and_bound_on_the_kairos_space_evaluates_few() -> None:
    """On the paper's space of maximal configurations, with a synthetic throughput that follows
    the bound closely, the search stops long before the end."""
    counts = affordable(PRICES, CAPS, BUDGET)
    counts = counts[maximal_configurations(counts, PRICES, BUDGET, CAPS) & (counts[:, 0] > 0)]
    rates = np.array([15.0, 9.0, 4.0, 3.0])
    bounds = counts @ rates
    qps = bounds * (0.9 + 0.1 * np.cos(np.arange(len(bounds))))
    found = branch_and_bound(bounds, lambda row: float(qps[row]))
    brute = int(np.argmax(qps))
    assert found.best_row == brute
    assert found.evaluations < len(counts) // 4


def test_a_capped_search_reports_what_it_left() -> None:
    bounds = np.array([10.0, 9.0, 8.0, 7.0])
    found = branch_and_bound(bounds, lambda row: 1.0, max_evaluations=2)
    assert not found.proven
    assert found.evaluated == (0, 1)
    assert found.next_bound_qps == 8.0


def test_branch_and_bound_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        branch_and_bound(np.array([]), lambda row: 0.0)
    with pytest.raises(ValueError):
        branch_and_bound(np.array([1.0]), lambda row: 0.0, slack=-0.1)
    with pytest.raises(ValueError):
        branch_and_bound(np.array([1.0]), lambda row: 0.0, max_evaluations=0)


def test_random_search_expectation_matches_sampling() -> None:
    n, targets = 30, 2
    rng = np.random.default_rng(0)
    marked = set(range(targets))
    firsts = [
        1 + next(i for i, row in enumerate(rng.permutation(n)) if row in marked)
        for _ in range(20_000)
    ]
    assert np.mean(firsts) == pytest.approx(
        random_search_expected_evaluations(n, targets), rel=0.02
    )
    with pytest.raises(ValueError):
        random_search_expected_evaluations(3, 0)


@pytest.mark.parametrize("search", [genetic_search, bayesian_search])
def test_online_searches_count_distinct_evaluations_and_stop_at_the_target(search) -> None:
    counts = affordable(PRICES, CAPS, BUDGET)
    counts = counts[maximal_configurations(counts, PRICES, BUDGET, CAPS)]
    qps = counts @ np.array([15.0, 9.0, 4.0, 3.0])
    target = float(qps.max())
    calls: list[int] = []

    def evaluate(row: int) -> float:
        calls.append(row)
        return float(qps[row])

    trace = search(counts, evaluate, target, np.random.default_rng(1), len(counts))
    assert len(calls) == len(set(calls)) == len(trace.evaluated)
    assert trace.reached_at == len(trace.evaluated)  # it stops at the target
    assert qps[trace.evaluated[-1]] == target
    assert list(trace.throughput_qps) == [qps[r] for r in trace.evaluated]


@pytest.mark.parametrize("search", [genetic_search, bayesian_search])
def test_online_searches_stop_at_their_cap(search) -> None:
    counts = affordable(PRICES, CAPS, BUDGET)
    counts = counts[maximal_configurations(counts, PRICES, BUDGET, CAPS)]
    trace = search(counts, lambda row: 1.0, 2.0, np.random.default_rng(0), 7)
    assert len(trace.evaluated) == 7
    assert trace.reached_at is None


@pytest.mark.parametrize("search", [genetic_search, bayesian_search])
def test_online_searches_are_seeded(search) -> None:
    counts = affordable(PRICES, CAPS, BUDGET)
    counts = counts[maximal_configurations(counts, PRICES, BUDGET, CAPS)]
    qps = counts @ np.array([15.0, 9.0, 4.0, 3.0])

    def run() -> tuple[int, ...]:
        return search(
            counts, lambda row: float(qps[row]), qps.max(), np.random.default_rng(5), 40
        ).evaluated

    assert run() == run()
