"""The Cascadia results experiment (benchmarks/results/cascadia.py): the load-share split, the
dominance test, the stage-by-stage replay against closed forms, and the points on a small
synthetic family (budget kept, held-out accuracy from the score half)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.gear_demo import load_demo_family
from benchmarks.results import cascadia
from benchmarks.results.cascades import Family
from benchmarks.results.cascadia import (
    BUDGET_INSTANCES,
    LOAD_SHARE,
    Outcome,
    Setup,
    cascadeserve_cascade,
    cascadia_front,
    dominates,
    load_counts,
    measure,
    milp_counts,
    setup_for,
    split_by_load,
    stage_sojourns_ms,
)
from estimator.cascades import Cascade, evaluate
from estimator.profiles import LatencyProfile


def test_doctests() -> None:
    result = doctest.testmod(cascadia)
    assert result.attempted > 0 and result.failed == 0


@given(
    st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=5).filter(
        lambda w: sum(w) > 0
    ),
    st.integers(0, 40),
)
def test_split_by_load_spends_every_instance_and_serves_every_busy_stage(
    work: list[float], extra: int
) -> None:
    busy = sum(1 for w in work if w > 0)
    total = busy + extra
    counts = split_by_load(work, total)
    assert sum(counts) == total
    assert all((n >= 1) == (w > 0) for n, w in zip(counts, work, strict=True))
    # No stage gets more than one instance beyond its share (the minimum of one given to a
    # stage of little work is taken from the others, never added to them).
    ideal = np.array(work) / sum(work) * total
    for n, x in zip(counts, ideal, strict=True):
        assert n <= max(1, np.floor(x + 1e-9) + 1)


def test_split_by_load_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="positive sum"):
        split_by_load([0.0, 0.0], 4)
    with pytest.raises(ValueError, match="cannot give"):
        split_by_load([1.0, 1.0, 1.0], 2)


def test_dominance_needs_one_strict_improvement() -> None:
    assert dominates((5.0, 0.97), (6.0, 0.97))
    assert dominates((6.0, 0.98), (6.0, 0.97))
    assert not dominates((6.0, 0.97), (6.0, 0.97))
    assert not dominates((5.0, 0.96), (6.0, 0.97))


def _profile(ms: float, jitter: float = 0.0) -> LatencyProfile:
    cell = np.array([ms]) if jitter == 0 else np.array([ms * (1 - jitter), ms * (1 + jitter)])
    return LatencyProfile("m", "c", np.array([1]), (cell,))


def test_replay_matches_a_deterministic_tandem_by_hand() -> None:
    # Arrivals 0, 1, 2 ms; stage 0 takes 2 ms on one instance: completions 2, 4, 6 ms (sojourns
    # 2, 3, 4). Queries 0 and 2 go on to stage 1 (3 ms, one instance): they arrive at 2 and
    # 6 ms, meet an idle instance, and stay 3 ms each.
    arrival_s = np.array([0.0, 0.001, 0.002])
    flags = [np.array([True, False, True]), np.zeros(3, dtype=bool)]
    profiles = [_profile(2.0), _profile(3.0)]
    (ids0, ms0), (ids1, ms1) = stage_sojourns_ms(
        arrival_s, flags, [1, 1], profiles, 1.0, np.random.default_rng(0)
    )
    assert ids0.tolist() == [0, 1, 2] and ms0 == pytest.approx([2.0, 3.0, 4.0])
    assert ids1.tolist() == [0, 2] and ms1 == pytest.approx([3.0, 3.0])


def test_replay_mean_sojourn_is_md1_for_one_poisson_stage() -> None:
    # One instance, deterministic 4 ms service, Poisson at 125 qps (rho 0.5): the M/D/1 mean
    # sojourn is 4 + 0.5 x 4 / (2 x 0.5) = 6 ms.
    rng = np.random.default_rng(3)
    arrival_s = np.cumsum(rng.exponential(1 / 125.0, size=200_000))
    ((_, ms),) = stage_sojourns_ms(
        arrival_s, [np.zeros(arrival_s.size, dtype=bool)], [1], [_profile(4.0)], 1.0, rng
    )
    assert ms.mean() == pytest.approx(6.0, rel=0.03)


def test_replay_refuses_queries_for_a_stage_without_instances() -> None:
    flags = [np.array([True]), np.array([False])]
    with pytest.raises(ValueError, match="no instances"):
        stage_sojourns_ms(
            np.array([0.0]), flags, [1, 0], [_profile(1.0), _profile(1.0)], 1.0,
            np.random.default_rng(0),
        )  # fmt: skip


@pytest.fixture(scope="module")
def setup() -> Setup:
    family = Family(load_demo_family("synthetic", seed=0), clipped=0, samples=0)
    return setup_for(family, trace_s=5.0, grid=(0.0, 0.5, 0.9))


def test_the_load_is_a_share_of_the_top_models_budget_capacity(setup: Setup) -> None:
    fam = setup.family.family
    top = setup.rate_per_instance_qps[fam.most_accurate]
    assert setup.rate_qps == pytest.approx(LOAD_SHARE * BUDGET_INSTANCES * top)
    assert setup.trace.sample_id is not None
    assert setup.trace.sample_id.max() < setup.score.n_samples
    assert setup.choose.n_samples + setup.score.n_samples == fam.records.n_samples


def test_points_keep_the_budget_and_score_on_the_held_out_half(setup: Setup) -> None:
    fam = setup.family.family
    pareto = cascadia_front(setup)
    assert pareto
    front = tuple(
        measure(
            setup,
            "cascadia",
            p.cascade,
            [f.get(setup.itype, 0) for f in p.allocation.fleets],
            p.weight_ratios,
        )
        for p in pareto
    )
    singles = tuple(
        measure(setup, "single", Cascade((m,), ()), [BUDGET_INSTANCES]) for m in fam.models
    )
    chosen = cascadeserve_cascade(setup)
    served = (
        measure(setup, "cascadeserve", chosen, load_counts(setup, chosen)),
        measure(setup, "cascadeserve-milp", chosen, milp_counts(setup, chosen)),
    )
    assert sum(served[0].counts) == BUDGET_INSTANCES
    for point in (*front, *singles, *served):
        assert sum(point.counts) <= BUDGET_INSTANCES
        assert point.held_out_accuracy == evaluate(point.cascade, setup.score).accuracy
        assert point.in_sample_accuracy == evaluate(point.cascade, setup.choose).accuracy
        assert 0 < point.p50_ms <= point.p99_ms
        # A stage some query reaches has instances, a simulated sojourn and an M/D/1 figure.
        for n, share, sim in zip(
            point.counts, point.reach_share, point.sim_stage_mean_ms, strict=True
        ):
            assert (n > 0) or (share == 0 and sim is None)
    for single in singles:
        assert single.counts == (BUDGET_INSTANCES,)
        model = single.cascade.models[0]
        assert single.held_out_accuracy == setup.score.model_accuracy(model)
    outcome = Outcome(setup, front, singles, served, 9, 0.0)
    held = outcome.dominated_singles(True)
    assert set(held) == set(fam.models)
    for model, indices in held.items():
        single = next(s for s in singles if s.cascade.models[0] == model)
        for i in indices:
            assert front[i].p99_ms <= single.p99_ms
            assert front[i].held_out_accuracy >= single.held_out_accuracy
