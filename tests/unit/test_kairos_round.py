"""The Kairos round solved as a chain flow (matching/chain_flow.py) against the old formulation,
the penalised cost matrix and SciPy's dense solve.

The optimum is rarely unique (with at least as many queries as instances every instance is used,
so which of two queries that fit everywhere runs now and which waits for a busy instance is a tie,
and the dense solver's choice among ties changes when the columns are merely permuted). So the
two are compared on what the matrix minimises, in Kairos' lexicographic order: the number of QoS
misses, then of pairs inside the safety margin (both exactly), then the total usage (to rounding);
and on feasibility: a one-to-one assignment of min(#queries, #instances) pairs.
"""

from __future__ import annotations

import doctest
import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

import matching.chain_flow
from benchmarks.matching_speed import (
    BASE,
    QOS_MS,
    SYNTHETIC_POINTS,
    SYNTHETIC_TAIL_RATIO,
    BenchInstance,
    random_states,
    rm2_kairos,
)
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching.chain_flow import chain_assignment_kernel
from matching.cost import SAFETY, CostMatrix, build_cost_matrix
from matching.errors import MatchingError
from matching.kairos import FLOW_FROM_INSTANCES, KairosPolicy, round_costs_kernel, round_flow_kernel
from matching.latency_model import LatencyModel
from matching.policy import Dispatch, QueuedQuery, StageContext
from tests.conftest import needs_shared
from tests.unit.test_kairos_policy import PRICES, PROFILES, kairos


def test_doctests() -> None:
    failures, _ = doctest.testmod(matching.chain_flow, raise_on_error=False)
    assert failures == 0


@dataclass(frozen=True)
class Round:
    """A round's inputs as the round kernels pass them: latencies per fleet type."""

    latency_ms: np.ndarray  # (m, T)
    tail_ms: np.ndarray  # (m, T)
    column_type: np.ndarray  # (n,)
    remaining_ms: np.ndarray  # (n,)
    heterogeneity: np.ndarray  # (n,), one h per type
    waited_ms: np.ndarray  # (m,)
    qos_ms: float

    def matrix(self) -> CostMatrix:
        ct = self.column_type
        return build_cost_matrix(
            self.latency_ms[:, ct],
            self.remaining_ms,
            self.heterogeneity,
            self.waited_ms,
            self.qos_ms,
            tail_ms=self.tail_ms[:, ct],
        )

    def flow(self) -> tuple[np.ndarray, np.ndarray]:
        return chain_assignment_kernel(
            self.latency_ms,
            self.tail_ms,
            self.column_type,
            self.remaining_ms,
            self.heterogeneity,
            self.waited_ms,
            self.qos_ms,
            SAFETY,
        )


def random_round(rng: np.random.Generator, m: int, n: int, n_types: int) -> Round:
    """Half the time on grids (many exact ties, repeated busy times), else continuous. Waits
    reach past the QoS target (late queries carry no penalty); long latencies and busy times
    make misses and margins common (QoS 100 ms, margin 2 ms)."""
    grid = rng.random() < 0.5
    if grid:
        latency = rng.choice([0.0, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0], size=(m, n_types))
        remaining = rng.choice([0.0, 0.0, 10.0, 20.0, 30.0], size=n)
        waited = rng.choice([0.0, 20.0, 50.0, 88.0, 90.0, 100.0, 130.0], size=m)
    else:
        latency = rng.uniform(0.0, 150.0, size=(m, n_types))
        remaining = np.where(rng.random(n) < 0.5, 0.0, rng.uniform(0.0, 100.0, size=n))
        waited = rng.uniform(0.0, 130.0, size=m)
    tail = latency * rng.choice([1.0, 1.2, 1.5], size=(m, n_types))
    column_type = rng.integers(0, n_types, size=n)
    h_by_type = rng.choice([1.0, 0.5, 0.3], size=n_types)
    return Round(latency, tail, column_type, remaining, h_by_type[column_type], waited, 100.0)


def objective(matrix: CostMatrix, rows: np.ndarray, cols: np.ndarray) -> tuple[int, int, float]:
    """(QoS misses, pairs inside the margin, total usage) of an assignment."""
    return (
        int(matrix.miss[rows, cols].sum()),
        int(matrix.margin[rows, cols].sum()),
        float(matrix.usage_ms[rows, cols].sum()),
    )


def assert_same_optimum(matrix: CostMatrix, flow: tuple[np.ndarray, np.ndarray]) -> None:
    rows, cols = flow
    m, n = matrix.costs.shape
    assert rows.size == cols.size == min(m, n)
    assert np.all(np.diff(rows) > 0) and np.unique(cols).size == cols.size
    assert np.all((rows >= 0) & (rows < m)) and np.all((cols >= 0) & (cols < n))
    old = objective(matrix, *linear_sum_assignment(matrix.costs))
    new = objective(matrix, rows, cols)
    assert new[:2] == old[:2]
    assert new[2] == pytest.approx(old[2], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(
    ("m", "n", "n_types", "count"),
    [
        (1, 1, 1, 20),
        (5, 3, 2, 200),
        (3, 5, 2, 200),
        (8, 8, 3, 200),
        (12, 6, 4, 100),
        (32, 16, 2, 50),
        (16, 40, 3, 50),
        (64, 32, 2, 30),
        (128, 128, 3, 10),
        (256, 128, 2, 10),
    ],
)
def test_same_optimum_as_the_matrix_and_scipy_on_random_rounds(m, n, n_types, count) -> None:
    rng = np.random.default_rng(1000 * m + n)
    misses = 0
    for _ in range(count):
        round_ = random_round(rng, m, n, n_types)
        matrix = round_.matrix()
        assert_same_optimum(matrix, round_.flow())
        misses += int(matrix.miss.any())
    assert misses > 0  # the workloads include infeasible pairs


def lexicographic_brute_force(matrix: CostMatrix) -> tuple[int, int, float]:
    m, n = matrix.costs.shape
    best: tuple[int, int, float] | None = None
    if m >= n:
        candidates = ((rows, range(n)) for rows in itertools.permutations(range(m), n))
    else:
        candidates = ((range(m), cols) for cols in itertools.permutations(range(n), m))
    for rows, cols in candidates:
        value = objective(matrix, np.array(rows), np.array(cols))
        if best is None or value[:2] < best[:2] or (value[:2] == best[:2] and value[2] < best[2]):
            best = value
    assert best is not None
    return best


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(1, 5), st.integers(1, 3))
def test_optimal_against_brute_force(seed, m, n, n_types) -> None:
    """Fewest misses, then fewest margins, then least usage, among all assignments."""
    round_ = random_round(np.random.default_rng(seed), m, n, n_types)
    matrix = round_.matrix()
    rows, cols = round_.flow()
    best = lexicographic_brute_force(matrix)
    got = objective(matrix, rows, cols)
    assert got[:2] == best[:2]
    assert got[2] == pytest.approx(best[2], rel=1e-9, abs=1e-9)


def test_queries_that_fit_everywhere_fill_the_free_instances_in_queue_order() -> None:
    """The tie rule: within a type, the queries with the least room first, then queue order,
    onto the instances in order of busy time, then index."""
    # One type, QoS 100 ms: queries 0-2 take 10 ms and fit anywhere; query 3 takes 60 ms and
    # fits only on an idle instance (busy 50 ms: 110 ms > 100). Instances 1 and 3 are idle.
    round_ = Round(
        latency_ms=np.array([[10.0], [10.0], [10.0], [60.0]]),
        tail_ms=np.array([[10.0], [10.0], [10.0], [60.0]]),
        column_type=np.zeros(4, dtype=np.int64),
        remaining_ms=np.array([50.0, 0.0, 50.0, 0.0]),
        heterogeneity=np.ones(4),
        waited_ms=np.zeros(4),
        qos_ms=100.0,
    )
    rows, cols = round_.flow()
    assert dict(zip(rows.tolist(), cols.tolist(), strict=True)) == {3: 1, 0: 3, 1: 0, 2: 2}
    assert_same_optimum(round_.matrix(), (rows, cols))


def test_fewer_queries_than_instances_take_the_cheapest_instances() -> None:
    # Two types; with 2 queries and 4 instances the usage h (r + l) decides: idle beats busy.
    round_ = Round(
        latency_ms=np.array([[10.0, 30.0], [20.0, 60.0]]),
        tail_ms=np.array([[10.0, 30.0], [20.0, 60.0]]),
        column_type=np.array([0, 1, 0, 1]),
        remaining_ms=np.array([5.0, 0.0, 0.0, 40.0]),
        heterogeneity=np.array([1.0, 0.25, 1.0, 0.25]),
        waited_ms=np.zeros(2),
        qos_ms=100.0,
    )
    rows, cols = round_.flow()
    assert set(cols.tolist()) == {1, 2}
    assert_same_optimum(round_.matrix(), (rows, cols))


# ---------------------------------------------------------------------------------------------
# The benchmark's workloads (benchmarks/matching_speed.py), through the policy's round kernels
# ---------------------------------------------------------------------------------------------


def synthetic_policy(**kwargs) -> KairosPolicy:
    return KairosPolicy(
        BASE, LatencyModel(SYNTHETIC_POINTS), tail_ratio=SYNTHETIC_TAIL_RATIO, **kwargs
    )


def kernel_inputs(policy: KairosPolicy, queue, instances, now_s: float) -> tuple:
    """What ``dispatch`` passes to the round kernels (after it has seen the fleet)."""
    policy.dispatch(now_s, queue[:1], instances, StageContext(1, QOS_MS))  # builds the layout
    layout = policy._layout
    assert layout is not None
    rows = queue[: policy.rows_per_instance * len(instances)]
    arrays = policy.latency.arrays
    return (
        np.array([q.batch_size for q in rows]),
        np.array([q.arrival_s for q in rows]),
        np.array([inst.busy_until_s for inst in instances]),
        now_s,
        layout.fleet_model_type,
        layout.column_type,
        layout.heterogeneity,
        arrays.counts,
        arrays.sums_ms,
        arrays.left,
        arrays.right,
        arrays.line,
        policy.latency.table_after,
        np.zeros((0, 0)),
        layout.tail_ratio,
        QOS_MS,
        policy.safety,
    )


@pytest.mark.parametrize("model", ["synthetic", pytest.param("rm2", marks=needs_shared)])
@pytest.mark.parametrize(
    ("n_queue", "n_instances", "count"),
    [(32, 16, 40), (64, 32, 20), (256, 128, 8), (20, 64, 20)],
)
def test_the_benchmark_rounds_reach_the_same_optimum(model, n_queue, n_instances, count) -> None:
    """The benchmark's states, with its policy: rm2's profiles when the shared data is here,
    else its synthetic lines."""
    rng = np.random.default_rng(n_queue)
    policy = synthetic_policy() if model == "synthetic" else rm2_kairos()
    misses = 0
    for state in random_states(count, n_queue, n_instances, rng):
        inputs = kernel_inputs(policy, state.queue, state.instances, 100.0)
        costs, _ = round_costs_kernel(*inputs)
        matrix = reference_matrix(policy, state)
        np.testing.assert_array_equal(costs, matrix.costs)  # the old formulation, unchanged
        assert_same_optimum(matrix, round_flow_kernel(*inputs))
        misses += int(matrix.miss.any())
    assert misses > 0


def reference_matrix(policy: KairosPolicy, state) -> CostMatrix:
    """The round's matrix from the latency model's predictions, spelled out."""
    model = policy.latency
    rows = state.queue[: policy.rows_per_instance * len(state.instances)]
    b_max = model.max_batch_size
    latency = np.array(
        [[model.predict_ms(i.instance_type, q.batch_size) for i in state.instances] for q in rows]
    )

    def ratio(instance_type: str, b: int) -> float:
        k = policy.tail_ratio[instance_type]
        return float(k[min(b, k.size - 1)])

    tail = latency * np.array(
        [[ratio(i.instance_type, q.batch_size) for i in state.instances] for q in rows]
    )
    base_ms = model.predict_ms(BASE, b_max)
    return build_cost_matrix(
        latency,
        [max(i.busy_until_s - 100.0, 0.0) * 1000.0 for i in state.instances],
        [base_ms / model.predict_ms(i.instance_type, b_max) for i in state.instances],
        [(100.0 - q.arrival_s) * 1000.0 for q in rows],
        QOS_MS,
        tail_ms=tail,
    )


@pytest.mark.parametrize(("n_queue", "n_instances"), [(64, 32), (256, 128), (20, 64)])
def test_the_policy_dispatches_the_flow_assignment_on_the_free_instances(
    n_queue, n_instances
) -> None:
    rng = np.random.default_rng(7)
    context = StageContext(1, QOS_MS)
    for state in random_states(5, n_queue, n_instances, rng):
        flow_policy = synthetic_policy()
        matrix_policy = synthetic_policy(flow_from_instances=10**9)
        got = flow_policy.dispatch(100.0, state.queue, state.instances, context)
        rows, cols = round_flow_kernel(
            *kernel_inputs(flow_policy, state.queue, state.instances, 100.0)
        )
        expected = [
            Dispatch(state.instances[j].index, (state.queue[i].query_id,))
            for i, j in zip(rows.tolist(), cols.tolist(), strict=True)
            if state.instances[j].is_idle(100.0)
        ]
        assert got == expected
        old = matrix_policy.dispatch(100.0, state.queue, state.instances, context)
        assert len(got) == len(old)  # as many instances start work now


def test_small_rounds_keep_the_dense_solve_bit_for_bit() -> None:
    """Below FLOW_FROM_INSTANCES a round is the matrix and SciPy, as before: the benchmark's
    32 x 16 rounds and every fleet the simulator runs in the Kairos setting."""
    assert FLOW_FROM_INSTANCES > 20
    rng = np.random.default_rng(3)
    context = StageContext(1, QOS_MS)
    for state in random_states(20, 32, 16, rng):
        default = synthetic_policy().dispatch(100.0, state.queue, state.instances, context)
        policy = synthetic_policy()
        inputs = kernel_inputs(policy, state.queue, state.instances, 100.0)
        costs, _ = round_costs_kernel(*inputs)
        rows, cols = linear_sum_assignment(costs)
        assert default == [
            Dispatch(state.instances[j].index, (state.queue[i].query_id,))
            for i, j in zip(rows.tolist(), cols.tolist(), strict=True)
            if state.instances[j].is_idle(100.0)
        ]


def test_flow_from_instances_is_checked() -> None:
    with pytest.raises(MatchingError, match="flow_from_instances"):
        synthetic_policy(flow_from_instances=0)


def test_free_instances_that_do_not_take_work_are_left_out_of_the_flow_too() -> None:
    @dataclass
    class Stopped(BenchInstance):
        stopped: bool = False

        def is_idle(self, now_s: float) -> bool:
            return not self.stopped and self.busy_until_s <= now_s

    model = LatencyModel({BASE: [(1, 1.0), (100, 100.0)]})
    instances = [Stopped(j, BASE, 0.0, stopped=j % 2 == 0) for j in range(6)]
    queue = [QueuedQuery(q, 10, 0.0, 0.0) for q in range(4)]
    policy = KairosPolicy(BASE, model, flow_from_instances=1)
    got = policy.dispatch(0.0, queue, instances, StageContext(1, 100.0))
    assert got == [Dispatch(1, (0,)), Dispatch(3, (1,)), Dispatch(5, (2,))]


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.sampled_from(["gpu.x", "cpu.x"]), max_size=5))
def test_every_query_is_served_once_when_every_round_is_a_flow(seed, types) -> None:
    rng = np.random.default_rng(seed)
    n = 200
    trace = Trace(np.cumsum(rng.integers(0, 3, size=n) * 0.01), rng.integers(1, 101, size=n))
    specs = [InstanceSpec("gpu.x")]
    for k, t in enumerate(types):
        specs.append(InstanceSpec(t, ready_s=0.3 * k, stop_s=1.0 + k) if k % 2 else InstanceSpec(t))
    stage = Stage("m", tuple(specs), PROFILES, kairos(flow_from_instances=1), max_batch_queries=1)
    result = simulate(trace, [stage], rng, prices_usd_per_hr=PRICES, qos_ms=150.0, engine="events")
    assert np.all(result.stages_visited == 1)
    for index in np.unique(result.instance):
        mine = result.instance == index
        order = np.argsort(result.start_s[mine])
        starts, finishes = result.start_s[mine][order], result.finish_s[mine][order]
        assert np.all(starts[1:] >= finishes[:-1])
        assert np.all((starts >= specs[index].ready_s) & (starts < specs[index].stop_s))
