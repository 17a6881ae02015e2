"""Kairos+ search against an exhaustive search, with fake evaluators."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.search import kairos_plus


def configurations(caps: tuple[int, ...]) -> np.ndarray:
    return np.array(list(itertools.product(*(range(c + 1) for c in caps))))


@settings(max_examples=100, deadline=None)
@given(
    st.tuples(st.integers(1, 4), st.integers(0, 4), st.integers(0, 5)),
    st.lists(st.floats(0.1, 10.0), min_size=3, max_size=3),
    st.floats(0.5, 1.0),
)
def test_kairos_plus_finds_the_exhaustive_best_when_bounds_hold(caps, rates, tightness) -> None:
    """Throughput is monotone (a weighted sum with a concave bonus) and below the bound: then
    the pruned search returns exactly what trying every configuration returns."""
    counts = configurations(caps)
    weights = np.array(rates)

    def throughput(c: np.ndarray) -> float:
        return float(np.sqrt(c @ weights) + 0.01 * c[0])

    true = np.array([throughput(c) for c in counts])
    bounds = true / tightness + 0.001
    calls: list[int] = []

    def evaluate(c: np.ndarray) -> float:
        calls.append(1)
        return throughput(c)

    result = kairos_plus(counts, bounds, evaluate)
    assert result.best_throughput_qps == true.max()
    assert result.evaluations == len(calls) <= counts.shape[0]
    # Everything not evaluated was pruned by one of the two rules.
    pruned = counts.shape[0] - result.evaluations
    assert pruned == result.pruned_by_bound + result.pruned_as_subconfiguration
    # The best measured is the best among those evaluated.
    assert result.best_throughput_qps == max(result.throughput_qps)


def test_subconfigurations_of_an_evaluated_configuration_are_skipped() -> None:
    counts = np.array([[2, 2], [1, 2], [2, 1], [3, 0]])
    bounds = np.array([10.0, 9.0, 8.0, 7.0])
    seen: list[list[int]] = []

    def evaluate(c: np.ndarray) -> float:
        seen.append(c.tolist())
        return 5.0

    result = kairos_plus(counts, bounds, evaluate)
    assert seen == [[2, 2], [3, 0]]
    assert result.pruned_as_subconfiguration == 2
    assert result.best_index == 0


def test_search_stops_when_the_bound_falls_below_the_best_measured() -> None:
    counts = np.array([[1, 0], [0, 3], [0, 2], [0, 1]])
    bounds = np.array([10.0, 6.0, 4.0, 2.0])
    result = kairos_plus(counts, bounds, lambda c: 8.0 if c[0] else 5.0)
    assert result.evaluated == (0,)
    assert result.pruned_by_bound == 3
