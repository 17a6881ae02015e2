"""The matching library's pieces: Kairos' cost matrix, the assignment solve, the latency model."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import matching.assignment
import matching.cost
import matching.latency_model
from matching.assignment import solve_assignment
from matching.cost import build_cost_matrix, costs_kernel, heterogeneity_coefficients, penalties_ms
from matching.errors import InvalidCostMatrixError, LatencyModelError, UnknownLatencyError
from matching.latency_model import LatencyModel


@pytest.mark.parametrize("module", [matching.assignment, matching.cost, matching.latency_model])
def test_doctests(module) -> None:
    failures, _ = doctest.testmod(module, raise_on_error=False)
    assert failures == 0


# ---------------------------------------------------------------------------------------------
# The cost matrix
# ---------------------------------------------------------------------------------------------


def test_cost_matrix_by_hand_with_penalties_and_the_safety_margin() -> None:
    # QoS 100 ms, so the safety margin is the last 2 ms. Instance 0 is a base instance busy for
    # 10 more ms; instance 1 is idle and half as fast at b_max (h = 0.5).
    # Query 0 has waited 0 ms (budget 100), query 1 50 ms (budget 50), query 2 120 ms (late).
    m = build_cost_matrix(
        latency_ms=[[40.0, 80.0], [39.0, 60.0], [20.0, 30.0]],
        remaining_ms=[10.0, 0.0],
        heterogeneity=[1.0, 0.5],
        waited_ms=[0.0, 50.0, 120.0],
        qos_ms=100.0,
    )
    # usage h_j (r_j + l_ij)
    assert m.usage_ms.tolist() == [[50.0, 40.0], [49.0, 30.0], [30.0, 15.0]]
    # query 1 on instance 0 finishes at 50 + 10 + 39 = 99 ms > 98 ms: inside the margin;
    # on instance 1 at 50 + 60 = 110 ms > 100 ms: a miss. Query 2 is late: no penalty at all.
    assert m.margin.tolist() == [[False, False], [True, False], [False, False]]
    assert m.miss.tolist() == [[False, False], [False, True], [False, False]]
    # k = min(3, 2) = 2 pairs, U = 50: P_margin = 2 * 50 + 1, P_miss = 2 * (50 + 101) + 1.
    assert (m.margin_penalty_ms, m.miss_penalty_ms) == (101.0, 303.0)
    assert m.costs.tolist() == [[50.0, 40.0], [150.0, 333.0], [30.0, 15.0]]
    # Best: query 0 to the base instance, the late query 2 to the idle one; query 1 waits.
    assert solve_assignment(m.costs).pairs() == [(0, 0), (2, 1)]


def test_cost_matrix_by_hand_with_a_tail() -> None:
    # QoS 100 ms. Both queries fit by their mean everywhere; their tails (the p99, say) do not:
    # query 0's tail misses on instance 1 (0 + 90 + 15 > 100) and lands inside the margin on
    # instance 0 (10 + 89 = 99 > 98); query 1's tail fits on instance 0 and misses on instance 1.
    # The usage stays the mean's: h_j (r_j + l_ij).
    m = build_cost_matrix(
        latency_ms=[[40.0, 60.0], [30.0, 50.0]],
        tail_ms=[[89.0, 105.0], [60.0, 101.0]],
        remaining_ms=[10.0, 0.0],
        heterogeneity=[1.0, 0.5],
        waited_ms=[0.0, 0.0],
        qos_ms=100.0,
    )
    assert m.usage_ms.tolist() == [[50.0, 30.0], [40.0, 25.0]]
    assert m.miss.tolist() == [[False, True], [False, True]]
    assert m.margin.tolist() == [[True, False], [False, False]]
    # k = 2, U = 50: P_margin = 101, P_miss = 2 * (50 + 101) + 1 = 303.
    assert m.costs.tolist() == [[151.0, 333.0], [40.0, 328.0]]
    # Judged by the mean alone (Kairos' check, the default tail), nothing is penalised.
    latency = [[40.0, 60.0], [30.0, 50.0]]
    mean_only = build_cost_matrix(latency, [10.0, 0.0], [1.0, 0.5], [0.0, 0.0], 100.0)
    assert not mean_only.miss.any() and not mean_only.margin.any()
    assert mean_only.costs.tolist() == m.usage_ms.tolist()


def test_margin_and_miss_boundaries_are_strict() -> None:
    # Finishing exactly at QoS meets it; finishing exactly at 0.98 QoS is outside the margin.
    m = build_cost_matrix([[100.0, 98.0, 98.5]], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0], 100.0)
    assert m.miss.tolist() == [[False, False, False]]
    assert m.margin.tolist() == [[True, False, True]]


def test_heterogeneity_is_base_over_type_latency_at_b_max() -> None:
    # The paper's example: 100 ms on the base, 200 ms and 500 ms elsewhere.
    assert heterogeneity_coefficients([100, 200, 500], 100).tolist() == [1.0, 0.5, 0.2]
    with pytest.raises(InvalidCostMatrixError):
        heterogeneity_coefficients([0.0], 100)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latency_ms": [1.0, 2.0]}, "2-D"),
        ({"remaining_ms": [0.0]}, "shapes disagree"),
        ({"latency_ms": [[np.nan, 1.0]]}, "latency_ms must be finite"),
        ({"tail_ms": [[1.0, 2.0, 3.0]]}, "shapes disagree: tail"),
        ({"tail_ms": [[-1.0, 2.0]]}, "tail_ms must be finite and >= 0"),
        ({"remaining_ms": [-1.0, 0.0]}, "remaining_ms must be finite and >= 0"),
        ({"heterogeneity": [1.0, 0.0]}, "heterogeneity"),
        ({"waited_ms": [np.inf]}, "waited_ms"),
        ({"qos_ms": 0.0}, "qos_ms"),
        ({"safety": 1.5}, "safety"),
    ],
)
def test_cost_matrix_refuses_bad_inputs(kwargs, message) -> None:
    args = {
        "latency_ms": [[1.0, 2.0]],
        "remaining_ms": [0.0, 0.0],
        "heterogeneity": [1.0, 1.0],
        "waited_ms": [0.0],
        "qos_ms": 10.0,
    }
    args.update(kwargs)
    with pytest.raises(InvalidCostMatrixError, match=message):
        build_cost_matrix(**args)


@st.composite
def rounds(draw, max_rows: int = 6, max_cols: int = 6):
    """Inputs of one round on a coarse grid, so that ties, misses and margins are common."""
    m = draw(st.integers(1, max_rows))
    n = draw(st.integers(1, max_cols))
    n_types = draw(st.integers(1, 3))
    grid = st.integers(0, 12).map(lambda k: 10.0 * k)
    latency_by_type = np.array(draw(st.lists(grid, min_size=m * n_types, max_size=m * n_types)))
    # The tail: the mean (Kairos' check), or the mean times a ratio per (query, type).
    ratio = st.sampled_from([1.0, 1.0, 1.25, 1.5, 2.0])
    tail_ratio = np.array(draw(st.lists(ratio, min_size=m * n_types, max_size=m * n_types)))
    column_type = np.array(draw(st.lists(st.integers(0, n_types - 1), min_size=n, max_size=n)))
    remaining = np.array(draw(st.lists(grid, min_size=n, max_size=n)))
    h_of_type = np.array(
        draw(st.lists(st.sampled_from([1.0, 0.5, 0.65, 0.2]), min_size=n_types, max_size=n_types))
    )
    waited = np.array(
        draw(st.lists(st.integers(0, 16).map(lambda k: 10.0 * k), min_size=m, max_size=m))
    )
    return (
        latency_by_type.reshape(m, n_types),
        (latency_by_type * tail_ratio).reshape(m, n_types),
        column_type,
        remaining,
        h_of_type[column_type],
        waited,
    )


@settings(max_examples=300, deadline=None)
@given(rounds(max_rows=30, max_cols=16), st.sampled_from([100.0, 105.0, 350.0]))
def test_compiled_costs_equal_the_numpy_reference_bit_for_bit(round_, qos_ms) -> None:
    latency_by_type, tail_by_type, column_type, remaining, h, waited = round_
    reference = build_cost_matrix(
        latency_by_type[:, column_type],
        remaining,
        h,
        waited,
        qos_ms,
        tail_ms=tail_by_type[:, column_type],
    )
    compiled = costs_kernel(
        latency_by_type, tail_by_type, column_type, remaining, h, waited, qos_ms, 0.98
    )
    np.testing.assert_array_equal(compiled, reference.costs)


def brute_force(costs: np.ndarray) -> list[list[tuple[int, int]]]:
    """Every complete assignment (min(m, n) pairs) of an m x n matrix."""
    m, n = costs.shape
    if m <= n:
        return [list(enumerate(cols)) for cols in itertools.permutations(range(n), m)]
    return [
        sorted((r, c) for c, r in enumerate(rows)) for rows in itertools.permutations(range(m), n)
    ]


@settings(max_examples=200, deadline=None)
@given(rounds(max_rows=6, max_cols=4) | rounds(max_rows=4, max_cols=6))
def test_penalties_make_the_optimum_lexicographic(round_) -> None:
    """The optimal assignment has the fewest misses, then the fewest margins, then the least
    usage, among all assignments (the dominance argument of matching.cost)."""
    latency_by_type, tail_by_type, column_type, remaining, h, waited = round_
    m = build_cost_matrix(
        latency_by_type[:, column_type],
        remaining,
        h,
        waited,
        100.0,
        tail_ms=tail_by_type[:, column_type],
    )

    def key(pairs):
        rows, cols = (np.array(x, dtype=np.int64) for x in zip(*pairs, strict=True))
        usage = float(m.usage_ms[rows, cols].sum())
        return int(m.miss[rows, cols].sum()), int(m.margin[rows, cols].sum()), usage

    best = min(key(pairs) for pairs in brute_force(m.costs))
    got = key(solve_assignment(m.costs).pairs())
    assert got[:2] == best[:2]
    assert got[2] == pytest.approx(best[2], abs=1e-9)


def test_penalty_constants() -> None:
    assert penalties_ms(50.0, 2) == (303.0, 101.0)
    assert penalties_ms(0.0, 1) == (2.0, 1.0)


# ---------------------------------------------------------------------------------------------
# The assignment
# ---------------------------------------------------------------------------------------------

matrices = (
    st.tuples(st.integers(1, 6), st.integers(1, 6))
    .filter(lambda s: min(s) <= 4 and max(s) <= 6)
    .flatmap(
        lambda shape: st.one_of(
            hnp.arrays(np.float64, shape, elements=st.integers(0, 3).map(float)),  # many ties
            hnp.arrays(np.float64, shape, elements=st.floats(0, 1000, allow_subnormal=False)),
            hnp.arrays(  # penalty-like: a few huge entries
                np.float64, shape, elements=st.sampled_from([0.0, 1.0, 2.5, 500.0, 1000.0, 1e6])
            ),
        )
    )
)


@settings(max_examples=400, deadline=None)
@given(matrices)
def test_assignment_is_optimal_against_brute_force(costs) -> None:
    got = solve_assignment(costs)
    m, n = costs.shape
    assert len(got) == min(m, n)
    assert len(set(got.rows.tolist())) == len(got) == len(set(got.cols.tolist()))
    assert np.all(np.diff(got.rows) > 0)
    best = min(sum(costs[r, c] for r, c in pairs) for pairs in brute_force(costs))
    assert got.total_cost == pytest.approx(best, rel=1e-12, abs=1e-9)


def test_assignment_of_one_row_takes_the_lowest_index_minimum() -> None:
    assert solve_assignment([[3.0, 1.0, 1.0, 2.0]]).pairs() == [(0, 1)]
    assert solve_assignment([[2.0], [1.0], [1.0]]).pairs() == [(1, 0)]


def test_assignment_validates_at_the_boundary() -> None:
    with pytest.raises(InvalidCostMatrixError, match="2-D"):
        solve_assignment([1.0, 2.0])
    with pytest.raises(InvalidCostMatrixError, match="finite"):
        solve_assignment([[1.0, np.inf]])
    with pytest.raises(InvalidCostMatrixError, match="real numbers"):
        solve_assignment([["a"]])
    assert len(solve_assignment(np.zeros((0, 3)))) == 0
    assert solve_assignment([[1, 2], [0, 5]]).total_cost == 2.0  # integers are fine


# ---------------------------------------------------------------------------------------------
# The latency model
# ---------------------------------------------------------------------------------------------


def test_linear_fit_is_exact_on_linear_data() -> None:
    points = [(b, 3.0 + 0.25 * b) for b in (10, 20, 50, 100, 1000)]
    model = LatencyModel({"gpu": points})
    intercept, slope = model.line("gpu")
    assert (intercept, slope) == (pytest.approx(3.0), pytest.approx(0.25))
    for b in (1, 15, 333, 1000, 5000):
        assert model.predict_ms("gpu", b) == pytest.approx(3.0 + 0.25 * b)
        assert model.source("gpu", b) == "fit"


def test_one_distinct_batch_size_gives_a_proportional_line() -> None:
    model = LatencyModel({"cpu": [(10, 20.0), (10, 22.0)]})
    assert model.predict_ms("cpu", 20) == pytest.approx(42.0)


def test_switches_to_the_table_after_enough_measurements() -> None:
    model = LatencyModel({"gpu": [(10, 10.0), (20, 20.0)]}, table_after=3)
    for k in range(3):
        assert model.source("gpu", 30) == "fit"
        assert model.predict_ms("gpu", 30) == pytest.approx(30.0)  # these points lie on the line
        model.observe("gpu", 30, 30.0 + (3.0 if k == 2 else 0.0))
    assert model.measurements("gpu", 30) == 3
    assert model.source("gpu", 30) == "table"
    assert model.predict_ms("gpu", 30) == pytest.approx(31.0)  # the mean of 30, 30, 33
    # Later measurements refine the table mean but no longer move the fit.
    line = model.line("gpu")
    model.observe("gpu", 30, 35.0)
    assert model.predict_ms("gpu", 30) == pytest.approx(32.0)
    assert model.line("gpu") == line


def test_interpolates_between_measured_sizes_and_extrapolates_with_the_fit_slope() -> None:
    model = LatencyModel({"gpu": [(10, 10.0), (20, 20.0)]}, table_after=1)  # slope 1 ms/item
    model.observe("gpu", 100, 150.0)
    model.observe("gpu", 200, 250.0)
    assert model.source("gpu", 150) == "interpolated"
    assert model.predict_ms("gpu", 150) == pytest.approx(200.0)
    assert model.predict_ms("gpu", 125) == pytest.approx(175.0)
    slope = model.line("gpu")[1]
    assert model.source("gpu", 50) == "extrapolated"
    assert model.predict_ms("gpu", 50) == pytest.approx(150.0 - 50 * slope)
    assert model.predict_ms("gpu", 300) == pytest.approx(250.0 + 100 * slope)
    # Beyond what the model has seen (its arrays grow only on a measurement).
    assert model.predict_ms("gpu", 10_000) == pytest.approx(250.0 + 9_800 * slope)


def test_a_new_measured_size_splits_an_interpolation_interval() -> None:
    model = LatencyModel({"gpu": [(1, 1.0), (2, 2.0)]}, table_after=1)
    for b, ms in ((10, 10.0), (30, 50.0)):
        model.observe("gpu", b, ms)
    assert model.predict_ms("gpu", 25) == pytest.approx(40.0)
    model.observe("gpu", 20, 20.0)
    assert model.predict_ms("gpu", 25) == pytest.approx(35.0)
    assert model.predict_ms("gpu", 15) == pytest.approx(15.0)


def test_learns_a_type_from_its_first_measurements_and_grows() -> None:
    model = LatencyModel(table_after=2)
    assert not model.knows("cpu")
    with pytest.raises(UnknownLatencyError, match="cpu"):
        model.predict_ms("cpu", 10)
    model.observe("cpu", 10, 40.0)
    assert model.knows("cpu")
    assert model.predict_ms("cpu", 20) == pytest.approx(80.0)  # proportional to one point
    model.observe("cpu", 2000, 8000.0)
    assert model.max_batch_size == 2000
    assert model.predict_ms("cpu", 1000) == pytest.approx(4000.0)


def test_predictions_are_never_negative() -> None:
    model = LatencyModel({"gpu": [(100, 10.0), (200, 110.0)]})  # the line crosses 0 at b = 90
    assert model.predict_ms("gpu", 1) == 0.0


def test_copies_learn_independently() -> None:
    model = LatencyModel({"gpu": [(1, 1.0), (2, 2.0)]}, table_after=1)
    twin = model.copy()
    twin.observe("gpu", 2, 100.0)
    assert model.predict_ms("gpu", 2) == pytest.approx(2.0)
    assert twin.predict_ms("gpu", 2) == pytest.approx(100.0)


def test_from_means_reads_profile_like_objects() -> None:
    class Profile:
        batch_sizes = np.array([10, 20])
        mean_ms = np.array([5.0, 9.0])

    model = LatencyModel.from_means({"gpu": Profile()})
    assert model.predict_ms("gpu", 30) == pytest.approx(13.0)
    assert model.max_batch_size == 20


@pytest.mark.parametrize(
    ("batch_size", "latency_ms"), [(0, 1.0), (1.5, 1.0), (True, 1.0), (1, -1.0), (1, np.nan)]
)
def test_latency_model_refuses_bad_measurements(batch_size, latency_ms) -> None:
    model = LatencyModel({"gpu": [(1, 1.0)]})
    with pytest.raises(LatencyModelError):
        model.observe("gpu", batch_size, latency_ms)
    with pytest.raises(LatencyModelError):
        LatencyModel({"gpu": [(batch_size, latency_ms)]})
    with pytest.raises(LatencyModelError, match="table_after"):
        LatencyModel(table_after=0)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 60), st.floats(0, 500)), min_size=1, max_size=60),
    st.integers(1, 4),
)
def test_table_means_and_nearest_measured_sizes_stay_consistent(measurements, table_after) -> None:
    model = LatencyModel({"t": [(1, 1.0), (60, 60.0)]}, table_after=table_after)
    for b, ms in measurements:
        model.observe("t", b, ms)
    by_size: dict[int, list[float]] = {}
    for b, ms in measurements:
        by_size.setdefault(b, []).append(ms)
    measured = sorted(b for b, v in by_size.items() if len(v) >= table_after)
    for b in range(1, 70):
        expected_source = (
            "table"
            if b in measured
            else "interpolated"
            if measured and measured[0] < b < measured[-1]
            else "extrapolated"
            if measured
            else "fit"
        )
        assert model.source("t", b) == expected_source
        if b in measured:
            assert model.predict_ms("t", b) == pytest.approx(np.mean(by_size[b]))
        elif expected_source == "interpolated":
            lo = max(s for s in measured if s < b)
            hi = min(s for s in measured if s > b)
            w = (b - lo) / (hi - lo)
            expected = (1 - w) * np.mean(by_size[lo]) + w * np.mean(by_size[hi])
            assert model.predict_ms("t", b) == pytest.approx(max(expected, 0.0), abs=1e-9)
