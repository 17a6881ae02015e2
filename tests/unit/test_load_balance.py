"""CascadeServe's hardware mapping (SP3): the load-balancing LP against hand-computed optima,
the memory-aware pruning's invariants and errors, and the share-following dispatch policy."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pytest

from controlplane.policies.load_balance import (
    DEFAULT_MODEL_MEMORY_MB,
    HOST_RESERVE_MB,
    DemandPoint,
    balance,
    instance_memory_mb,
    model_memory_mb,
    prune_placement,
)
from controlplane.serving.shares import SharePolicy
from estimator.errors import CascadeError
from matching.policy import QueuedQuery, StageContext


def point(
    demand: Mapping[str, float], runtime: Mapping[tuple[str, str], float], label: str = ""
) -> DemandPoint:
    return DemandPoint(dict(demand), dict(runtime), label)


def uniform_runtime(
    models: Mapping[str, float], instances: Mapping[str, float]
) -> dict[tuple[str, str], float]:
    """runtime(m, d) = base(m) x slowdown(d)."""
    return {(m, d): base * slow for m, base in models.items() for d, slow in instances.items()}


# --- the LP ------------------------------------------------------------------------------------


def test_the_lp_splits_the_shared_model_to_even_out_the_devices() -> None:
    # b runs only on d1 (0.02 s x 20 qps = 0.4); a (0.01 s, 60 qps) is split so that
    # 0.4 + 0.01 x = 0.01 (60 - x): x = 10, u = 0.5.
    lp = balance(
        {"d1": {"a", "b"}, "d2": {"a"}},
        point(
            {"a": 60.0, "b": 20.0},
            {("a", "d1"): 0.01, ("b", "d1"): 0.02, ("a", "d2"): 0.01},
        ),
    )
    assert lp.utilisation == pytest.approx(0.5)
    assert lp.qps[("a", "d1")] == pytest.approx(10.0)
    assert lp.shares[("a", "d1")] == pytest.approx(1 / 6)
    assert lp.shares[("a", "d2")] == pytest.approx(5 / 6)
    assert lp.shares[("b", "d1")] == pytest.approx(1.0)
    assert lp.load == pytest.approx({"d1": 0.5, "d2": 0.5})


def test_a_device_twice_as_fast_takes_two_thirds_of_the_work() -> None:
    # All of it on d1 would be 30 x 0.01 + 10 x 0.02 = 0.5 s per s; d2 is half as fast, so
    # the two together serve it at u = 0.5 / (1 + 1/2) = 1/3.
    runtime = uniform_runtime({"a": 0.01, "b": 0.02}, {"d1": 1.0, "d2": 2.0})
    lp = balance({"d1": {"a", "b"}, "d2": {"a", "b"}}, point({"a": 30.0, "b": 10.0}, runtime))
    assert lp.utilisation == pytest.approx(1 / 3)
    assert lp.load == pytest.approx({"d1": 1 / 3, "d2": 1 / 3})
    for model in ("a", "b"):
        assert lp.shares[(model, "d1")] + lp.shares[(model, "d2")] == pytest.approx(1.0)


def test_over_one_hundred_percent_is_an_error_unless_allowed() -> None:
    hosts = {"d1": {"a"}}
    overload = point({"a": 200.0}, {("a", "d1"): 0.01}, "at a, 200 qps")
    with pytest.raises(CascadeError, match=r"200% busy at a, 200 qps"):
        balance(hosts, overload)
    assert balance(hosts, overload, max_utilisation=math.inf).utilisation == pytest.approx(2.0)
    assert balance(hosts, point({"a": 100.0}, {("a", "d1"): 0.01})).utilisation == pytest.approx(
        1.0
    )


def test_spread_splits_by_speed_among_the_optimal_splits() -> None:
    # Three devices, d3 half as fast: u = 40 x 0.01 / 2.5 = 0.16 whichever way the identical
    # d1 and d2 trade; spread gives each its speed's share of each model.
    runtime = uniform_runtime({"a": 0.01, "b": 0.01}, {"d1": 1.0, "d2": 1.0, "d3": 2.0})
    hosts = {d: {"a", "b"} for d in ("d1", "d2", "d3")}
    demand = point({"a": 30.0, "b": 10.0}, runtime)
    lp = balance(hosts, demand, spread=True)
    assert lp.utilisation == pytest.approx(0.16)
    for model in ("a", "b"):
        assert lp.shares[(model, "d1")] == pytest.approx(0.4)
        assert lp.shares[(model, "d3")] == pytest.approx(0.2)
    assert balance(hosts, demand).utilisation == pytest.approx(lp.utilisation)


def test_a_model_without_demand_is_split_by_speed_and_adds_no_load() -> None:
    runtime = uniform_runtime({"a": 0.01, "b": 0.03}, {"d1": 1.0, "d2": 3.0})
    lp = balance({"d1": {"a", "b"}, "d2": {"a", "b"}}, point({"a": 10.0}, runtime))
    assert lp.shares[("b", "d1")] == pytest.approx(0.75)
    assert lp.shares[("b", "d2")] == pytest.approx(0.25)
    assert lp.qps[("b", "d1")] == 0.0
    assert lp.utilisation == pytest.approx(max(lp.load.values()))


def test_a_model_with_demand_that_no_device_hosts_is_an_error() -> None:
    with pytest.raises(CascadeError, match="no instance hosts 'b'"):
        balance({"d1": {"a"}}, point({"a": 1.0, "b": 1.0}, {("a", "d1"): 0.01}))
    with pytest.raises(CascadeError, match="no positive runtime"):
        balance({"d1": {"a"}}, point({"a": 1.0}, {}))


def test_the_lp_is_optimal_against_a_grid_of_splits() -> None:
    """Two devices, two models on both, random runtimes: no split of a 101-point grid beats
    the LP's u."""
    rng = np.random.default_rng(7)
    for _ in range(5):
        runtime = {(m, d): float(rng.uniform(0.002, 0.02)) for m in "ab" for d in ("d1", "d2")}
        demand = {"a": float(rng.uniform(5, 40)), "b": float(rng.uniform(5, 40))}
        lp = balance(
            {"d1": {"a", "b"}, "d2": {"a", "b"}},
            point(demand, runtime),
            max_utilisation=math.inf,
        )
        best = math.inf
        for x, y in itertools.product(np.linspace(0, 1, 101), repeat=2):
            d1 = x * demand["a"] * runtime[("a", "d1")] + y * demand["b"] * runtime[("b", "d1")]
            d2 = (1 - x) * demand["a"] * runtime[("a", "d2")] + (1 - y) * demand["b"] * runtime[
                ("b", "d2")
            ]
            best = min(best, max(d1, d2))
        assert lp.utilisation <= best + 1e-9
        assert max(lp.load.values()) == pytest.approx(lp.utilisation)


# --- pruning -----------------------------------------------------------------------------------


def fits(
    hosts: Mapping[str, frozenset[str]], memory: Mapping[str, float], sizes: Mapping[str, float]
) -> bool:
    return all(sum(sizes[m] for m in hosts[d]) <= memory[d] for d in memory)


def test_pruning_fits_memory_keeps_every_model_and_serves_the_load() -> None:
    models = {"tiny": 0.001, "small": 0.004, "large": 0.012}
    sizes = {"tiny": 400.0, "small": 1500.0, "large": 3000.0}
    devices = {f"d{k}": (1.0 if k < 3 else 2.0) for k in range(6)}
    memory = {d: (4000.0 if slow == 1.0 else 2500.0) for d, slow in devices.items()}
    devices["big"], memory["big"] = 2.0, 8000.0
    runtime = uniform_runtime(models, devices)
    points = [
        point({"tiny": 300.0, "large": 60.0}, runtime, "accurate"),
        point({"tiny": 600.0, "small": 200.0, "large": 30.0}, runtime, "fast"),
    ]
    hosts = {d: set(models) for d in devices}
    result = prune_placement(hosts, points, sizes, memory)
    assert result.pruned
    assert fits(result.hosts, memory, sizes)
    for model in models:
        assert any(model in on for on in result.hosts.values())
    assert all(u <= 1.0 + 1e-9 for u in result.utilisation)
    for p, u in zip(points, result.utilisation, strict=True):
        assert balance(result.hosts, p).utilisation == pytest.approx(u)
    # Nothing is pruned from a device that fits, and each pruned one was over its memory.
    assert result.hosts["big"] == frozenset(models)
    assert all(sum(sizes[m] for m in models) > memory[d] for _, d in result.pruned)


def test_nothing_is_pruned_when_everything_fits() -> None:
    runtime = uniform_runtime({"a": 0.01}, {"d1": 1.0})
    result = prune_placement({"d1": {"a"}}, [point({"a": 10.0}, runtime)], {"a": 1.0}, {})
    assert result.pruned == ()
    assert result.hosts == {"d1": frozenset({"a"})}


def test_the_last_replica_of_a_model_is_never_pruned() -> None:
    # d1 is 100 MB over; pruning a or b frees 100 MB each, and a is the larger (the tie-break),
    # but a's only replica is on d1: b goes.
    runtime = uniform_runtime({"a": 0.001, "b": 0.001}, {"d1": 1.0, "d2": 1.0})
    result = prune_placement(
        {"d1": {"a", "b"}, "d2": {"b"}},
        [point({"a": 10.0, "b": 10.0}, runtime)],
        {"a": 800.0, "b": 300.0},
        {"d1": 1000.0, "d2": 1000.0},
    )
    assert result.pruned == (("b", "d1"),)
    assert result.hosts == {"d1": frozenset({"a"}), "d2": frozenset({"b"})}


def test_a_replica_the_load_needs_is_kept_over_one_it_does_not() -> None:
    # d1 (fast) hosts a and b and must drop one; d2 (slow) hosts both too. a carries the
    # load: pruning a from d1 leaves u = 0.8 on d2, pruning b leaves u lower: b goes.
    runtime = uniform_runtime({"a": 0.01, "b": 0.01}, {"d1": 1.0, "d2": 4.0})
    result = prune_placement(
        {"d1": {"a", "b"}, "d2": {"a", "b"}},
        [point({"a": 20.0, "b": 2.0}, runtime)],
        {"a": 500.0, "b": 500.0},
        {"d1": 600.0},
    )
    assert result.pruned == (("b", "d1"),)


def test_no_placement_that_fits_is_an_error() -> None:
    runtime = uniform_runtime({"a": 0.01, "b": 0.01}, {"d1": 1.0})
    with pytest.raises(CascadeError, match="no placement fits memory"):
        prune_placement(
            {"d1": {"a", "b"}},
            [point({"a": 1.0, "b": 1.0}, runtime)],
            {"a": 500.0, "b": 500.0},
            {"d1": 600.0},
        )
    # Pruning would leave the load unservable: d2 alone cannot serve a at 150 qps.
    runtime = uniform_runtime({"a": 0.01, "b": 0.01}, {"d1": 1.0, "d2": 1.0})
    with pytest.raises(CascadeError, match="no placement fits memory"):
        prune_placement(
            {"d1": {"a", "b"}, "d2": {"a", "b"}},
            [point({"a": 150.0, "b": 1.0}, runtime)],
            {"a": 500.0, "b": 500.0},
            {"d1": 600.0, "d2": 600.0},
        )


def test_the_memory_of_models_and_instance_types() -> None:
    assert model_memory_mb(None) == DEFAULT_MODEL_MEMORY_MB
    assert model_memory_mb(None, 50 * 2**20) == pytest.approx(100.0)
    assert model_memory_mb(12.5, 50 * 2**20) == 12.5
    assert instance_memory_mb(16, gpus=1, gpu_memory_gib=16) == 16 * 1024
    assert instance_memory_mb(4) == 4 * 1024 - HOST_RESERVE_MB
    assert instance_memory_mb(None) == math.inf


# --- following the shares ----------------------------------------------------------------------


class FakeSlot:
    def __init__(self, index: int, speed_rank: int = 0, max_batch_size: int = 64) -> None:
        self.index = index
        self.instance_type = "t"
        self.speed_rank = speed_rank
        self.busy_until_s = 0.0
        self.idle_since_s = 0.0
        self.max_batch_size = max_batch_size
        self.idle = True

    def is_idle(self, now_s: float) -> bool:
        return self.idle


def test_the_share_policy_tracks_the_shares_one_query_at_a_time() -> None:
    shares = {0: 0.5, 1: 0.3, 2: 0.2, 3: 0.0}
    policy = SharePolicy(shares)
    slots = [FakeSlot(i) for i in shares]
    context = StageContext(1, None)
    counts: Counter[int] = Counter()
    for q in range(1000):
        (dispatch,) = policy.dispatch(0.0, [QueuedQuery(q, 1, 0.0, 0.0)], slots, context)
        counts[dispatch.instance_index] += 1
    for index, share in shares.items():
        assert abs(counts[index] - share * 1000) <= 1


def test_the_share_policy_stays_work_conserving_and_batches_like_fcfs() -> None:
    policy = SharePolicy({0: 0.9, 1: 0.1})
    slots = [FakeSlot(0), FakeSlot(1, max_batch_size=3), FakeSlot(2)]  # 2: share 0
    queue = [QueuedQuery(q, 1, 0.0, 0.0) for q in range(10)]
    dispatches = policy.dispatch(0.0, queue, slots, StageContext(4, None))
    assert [d.instance_index for d in dispatches] == [0, 1, 2]
    assert [d.query_ids for d in dispatches] == [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
    slots[0].idle = False  # the one with most share is busy: the next goes to the others
    (first, *_) = policy.dispatch(0.0, queue[:1], slots, StageContext(1, None))
    assert first.instance_index == 1
