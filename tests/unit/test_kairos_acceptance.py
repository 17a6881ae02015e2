"""Kairos' goals in the paper's setting, on the shared measurements (slow: a minute of a core).

With the Kairos dispatcher, the configuration Kairos picks from its bounds alone reaches at least
1.5x the allowable throughput of the best homogeneous fleet (same dispatcher) and at least 2x what
FCFS base-first reaches on the same fleet, for each of the five models; Kairos+ finds its best
configuration after evaluating under 5% of the affordable ones.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from estimator.batches import parse_batch_distribution
from estimator.capacity import Workload, fleet_capacity
from estimator.catalog import default_catalog
from estimator.kairos_setting import KairosSetting, Selection, select
from estimator.profiles import ProfileSet, load_profiles
from estimator.search import kairos_plus
from tests.conftest import KAIROS_CSV, needs_shared

pytestmark = [needs_shared, pytest.mark.slow]
# 6,000 queries per capacity search (10,000 until 2026-12-01: the suite's CPU, 87 -> 57 CPU-s for
# this file; the workload is seeded, so the margins asserted are those of this sample).
QUERIES = 6_000
# Kairos+'s pruning is checked on a shorter workload: what is asserted is how the search prunes,
# not how precise each measurement is, and each of its evaluations is a bisection of simulations.
# Measured on 2026-12-01: dien evaluates 12 of its 331 configurations with 4,000, 6,000 and
# 10,000 queries, rm2 4 and 3 with 4,000 and 6,000; the bound is under 5%, 16.
SEARCH_QUERIES = 4_000


@cache
def profiles() -> ProfileSet:
    return load_profiles(KAIROS_CSV)


@cache
def prices() -> dict[str, float]:
    catalog = default_catalog()
    return {name: catalog.price_usd_per_hr(name) for name in catalog}


@cache
def workload(queries: int = QUERIES) -> Workload:
    rng = np.random.default_rng(0)
    return Workload.poisson(parse_batch_distribution("kairos").sample(queries, rng), rng)


def allowable(
    selection: Selection, counts: np.ndarray, policy: str, queries: int = QUERIES
) -> float:
    by_type = {t: profiles().get_profile(selection.model, t) for t in selection.ranking.types}
    return fleet_capacity(
        by_type,
        selection.fleet_types(counts),
        policy,
        selection.qos_ms,
        workload(queries),
        prices(),
    ).allowable_qps


@pytest.mark.parametrize("model", sorted(KairosSetting().qos_ms))
def test_chosen_mix_beats_homogeneous_and_fcfs(model: str) -> None:
    selection = select(profiles(), model, prices())
    chosen = selection.ranking.counts[selection.chosen]
    kairos = allowable(selection, chosen, "kairos")
    homogeneous = allowable(selection, selection.homogeneous_counts, "kairos")
    fcfs = allowable(selection, chosen, "fcfs")
    assert kairos >= 1.5 * homogeneous, (chosen.tolist(), kairos, homogeneous)
    assert kairos >= 2.0 * fcfs, (chosen.tolist(), kairos, fcfs)
    # Nothing beats its own bound by more than the sampling noise of a finite run.
    assert kairos <= 1.05 * selection.ranking.upper_bound_qps[selection.chosen]


@pytest.mark.parametrize("model", ["rm2", "dien"])
def test_kairos_plus_evaluates_under_5_percent(model: str) -> None:
    selection = select(profiles(), model, prices())
    ranking = selection.ranking
    measured: dict[tuple[int, ...], float] = {}

    def evaluate(counts: np.ndarray) -> float:
        measured[tuple(int(n) for n in counts)] = allowable(
            selection, counts, "kairos", SEARCH_QUERIES
        )
        return measured[tuple(int(n) for n in counts)]

    result = kairos_plus(ranking.counts, ranking.upper_bound_qps, evaluate)
    assert result.evaluations < 0.05 * len(ranking)
    assert result.best_throughput_qps == max(measured.values())
    best = tuple(int(n) for n in ranking.counts[result.best_index])
    assert measured[best] == result.best_throughput_qps
    # Every configuration it did not evaluate was pruned: its bound is at most the best measured,
    # or it is a sub-configuration of one it evaluated.
    evaluated = np.array(list(measured))
    for row in range(len(ranking)):
        counts = ranking.counts[row]
        if tuple(int(n) for n in counts) in measured:
            continue
        below = ranking.upper_bound_qps[row] <= result.best_throughput_qps
        subset = bool(np.any(np.all(counts <= evaluated, axis=1)))
        assert below or subset
