"""Cascadia's allocation MILP against brute force, its latency model, and the Tchebycheff front."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.cli.output import UsageError
from controlplane.cli.pareto import add_pareto_arguments, run_pareto
from estimator.allocation import (
    StageDemand,
    allocate,
    candidate_allocations,
    stage_latency_ms,
    tchebycheff_front,
)
from estimator.cascades import Cascade, evaluate, validation_document
from estimator.errors import InfeasibleAllocationError, SearchSpaceError
from estimator.profiles import write_profiles_json
from estimator.traces import Trace, poisson_arrivals, write_trace_csv
from tests.unit import cascade_support as family

TYPES = ("cpu", "gpu")


def test_one_instance_is_the_md1_sojourn_time() -> None:
    # M/D/1: W = D + rho D / (2 (1 - rho)); D = 10 ms, rho = 0.8: 10 + 0.8 x 10 / 0.4 = 30 ms.
    assert stage_latency_ms({"c": 1}, {"c": 100.0}, 80.0) == pytest.approx(30.0)
    assert stage_latency_ms({"c": 1}, {"c": 100.0}, 100.0) == math.inf
    assert stage_latency_ms({}, {"c": 100.0}, 0.0) == 0.0
    # Two types pooled: the mean service time is N / mu (each serves its share of the work).
    pooled = stage_latency_ms({"a": 1, "b": 1}, {"a": 100.0, "b": 300.0}, 1e-9)
    assert pooled == pytest.approx(1000.0 * 2 / 400.0)


def brute_force(
    demands: list[StageDemand],
    arrival_qps: float,
    prices: dict[str, float],
    budget: float | None,
    caps: dict[str, int],
) -> float:
    """The least worst-stage latency over every allocation within the caps (inf: none)."""
    boxes = [range(caps[t] + 1) for t in TYPES]
    vectors = list(itertools.product(*boxes))
    best = math.inf
    for choice in itertools.product(vectors, repeat=len(demands)):
        used = [sum(v[k] for v in choice) for k in range(len(TYPES))]
        if any(u > caps[t] for u, t in zip(used, TYPES, strict=True)):
            continue
        cost = sum(v[k] * prices[t] for v in choice for k, t in enumerate(TYPES))
        if budget is not None and cost > budget + 1e-9:
            continue
        worst = 0.0
        for d, v in zip(demands, choice, strict=True):
            counts = {t: n for t, n in zip(TYPES, v, strict=True) if n}
            if d.share == 0 and counts:
                worst = math.inf  # the MILP gives a stage nobody reaches no instance
                break
            if any(t not in d.rate_per_instance_qps for t in counts):
                worst = math.inf
                break
            worst = max(
                worst, stage_latency_ms(counts, d.rate_per_instance_qps, d.share * arrival_qps)
            )
        best = min(best, worst)
    return best


def check_against_brute_force(
    demands: list[StageDemand],
    arrival_qps: float,
    prices: dict[str, float],
    budget: float | None,
    caps: dict[str, int],
) -> None:
    expected = brute_force(demands, arrival_qps, prices, budget, caps)
    if math.isinf(expected):
        with pytest.raises(InfeasibleAllocationError):
            allocate(demands, arrival_qps, prices, budget_usd_per_hr=budget, max_counts=caps)
        return
    found = allocate(demands, arrival_qps, prices, budget_usd_per_hr=budget, max_counts=caps)
    assert found.worst_latency_ms == pytest.approx(expected, rel=1e-9)
    for t in TYPES:
        assert sum(f.get(t, 0) for f in found.fleets) <= caps[t]
    cost = sum(n * prices[t] for f in found.fleets for t, n in f.items())
    assert cost == pytest.approx(found.cost_usd_per_hr)
    if budget is not None:
        assert cost <= budget + 1e-9
    for d, fleet, latency in zip(demands, found.fleets, found.latency_ms, strict=True):
        assert latency == pytest.approx(
            stage_latency_ms(dict(fleet), d.rate_per_instance_qps, d.share * arrival_qps)
        )


def test_a_hand_sized_case_matches_brute_force() -> None:
    demands = [
        StageDemand("tiny", 1.0, {"cpu": 400.0, "gpu": 1500.0}),
        StageDemand("large", 0.3, {"cpu": 40.0, "gpu": 200.0}),
    ]
    prices = {"cpu": 0.17, "gpu": 0.526}
    check_against_brute_force(demands, 300.0, prices, 1.5, {"cpu": 4, "gpu": 2})


@settings(max_examples=40, deadline=None)
@given(
    n_stages=st.integers(2, 3),
    rates=st.lists(st.floats(5.0, 200.0), min_size=6, max_size=6),
    shares=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
    zero_share=st.booleans(),
    caps=st.tuples(st.integers(1, 3), st.integers(0, 2)),
    prices=st.tuples(st.floats(0.05, 1.0), st.floats(0.05, 2.0)),
    budget=st.one_of(st.none(), st.floats(0.1, 4.0)),
    arrival=st.floats(1.0, 150.0),
)
def test_the_milp_equals_brute_force_on_small_cases(
    n_stages: int,
    rates: list[float],
    shares: list[float],
    zero_share: bool,
    caps: tuple[int, int],
    prices: tuple[float, float],
    budget: float | None,
    arrival: float,
) -> None:
    reach = [1.0, *sorted(shares, reverse=True)][:n_stages]
    if zero_share:
        reach[-1] = 0.0
    demands = [
        StageDemand(f"s{i}", reach[i], {"cpu": rates[2 * i], "gpu": rates[2 * i + 1]})
        for i in range(n_stages)
    ]
    check_against_brute_force(
        demands,
        arrival,
        dict(zip(TYPES, prices, strict=True)),
        budget,
        dict(zip(TYPES, caps, strict=True)),
    )


def test_pruning_keeps_a_better_or_equal_smaller_allocation() -> None:
    demand = StageDemand("s", 1.0, {"cpu": 50.0, "gpu": 400.0})
    kept, kept_latency = candidate_allocations(
        demand, 60.0, TYPES, {"cpu": 0.1, "gpu": 0.5}, max_counts={"cpu": 5, "gpu": 3}
    )
    every, every_latency = candidate_allocations(
        demand, 60.0, TYPES, {"cpu": 0.1, "gpu": 0.5}, max_counts={"cpu": 5, "gpu": 3}, prune=False
    )
    assert 0 < len(kept) < len(every)
    for vector, latency in zip(every, every_latency, strict=True):
        assert any(
            np.all(k <= vector) and kl <= latency + 1e-12
            for k, kl in zip(kept, kept_latency, strict=True)
        )


def test_errors_name_the_stage_and_the_search_space() -> None:
    demands = [StageDemand("large", 1.0, {"cpu": 10.0})]
    with pytest.raises(InfeasibleAllocationError, match="stage large: no allocation") as caught:
        allocate(demands, 100.0, {"cpu": 0.1}, max_counts={"cpu": 5})
    assert caught.value.stage == "large"
    with pytest.raises(SearchSpaceError, match="allocations to enumerate"):
        allocate(demands, 1.0, {"cpu": 0.0001, "gpu": 0.0001}, budget_usd_per_hr=1e3)
    with pytest.raises(SearchSpaceError, match="neither a cap nor a price"):
        allocate(demands, 1.0, {"cpu": 0.1})


# --- the weighted-Tchebycheff sweep ----------------------------------------------------------


def _rates() -> dict[str, dict[str, float]]:
    profiles = family.profiles()
    return {
        m: {family.TYPE: 1000.0 / p[family.TYPE].mean_latency_ms(1)} for m, p in profiles.items()
    }


def test_the_front_is_nondominated_and_reaches_both_ends() -> None:
    records = family.records()
    grid = (0.0, 0.5, 0.9)
    rates = _rates()
    caps = {family.TYPE: 8}
    front = tchebycheff_front(
        records, family.MODELS, rates, 60.0, family.PRICES, grid=grid, max_counts=caps
    )
    latency = [p.latency_ms for p in front]
    assert latency == sorted(latency)
    for p in front:
        assert not any(
            q.quality.accuracy >= p.quality.accuracy
            and q.latency_ms <= p.latency_ms
            and (q.quality.accuracy > p.quality.accuracy or q.latency_ms < p.latency_ms)
            for q in front
        )
    # The utopia's latency end: the least worst-stage latency over every threshold setting.
    every = []
    for thresholds in itertools.product(grid, repeat=2):
        quality = evaluate(Cascade(family.MODELS, thresholds), records)
        demands = [
            StageDemand(m, s, rates[m])
            for m, s in zip(family.MODELS, quality.reach_share, strict=True)
        ]
        every.append(
            (
                allocate(demands, 60.0, family.PRICES, max_counts=caps).worst_latency_ms,
                quality.accuracy,
            )
        )
    assert front[0].latency_ms == pytest.approx(min(lat for lat, _ in every))
    assert max(p.quality.accuracy for p in front) <= max(acc for _, acc in every)
    assert all(p.weight_ratios for p in front)


# --- plan --pareto ---------------------------------------------------------------------------


def _pareto_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    write_profiles_json(
        [p for by_type in family.profiles().values() for p in by_type.values()],
        tmp_path / "profiles.json",
    )
    validation = tmp_path / "validation.json"
    validation.write_text(json.dumps(validation_document(family.records())))
    spec = tmp_path / "app.yaml"
    spec.write_text(
        "name: digits\nmodels:\n"
        + "".join(f"  - {{name: {m}, profiles: profiles.json}}\n" for m in family.MODELS)
        + "cascade: [tiny, small, large]\nslo: {latency_ms: 100}\nbudget_usd_per_hr: 1.5\n"
        "instance_types: [c5.xlarge]\n"
    )
    arrival = poisson_arrivals(50.0, 20.0, np.random.default_rng(0))
    write_trace_csv(Trace(arrival, np.ones(arrival.size, dtype=np.int64)), tmp_path / "t.csv")
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    add_pareto_arguments(parser)
    base = ["--spec", str(spec), "--trace", str(tmp_path / "t.csv"), "--pareto"]
    return parser.parse_args([*base, *extra])


def test_plan_pareto_prints_the_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _pareto_args(tmp_path, "--validation", str(tmp_path / "validation.json"))
    args.thresholds = "0,0.5,0.9"
    args.json = True
    assert run_pareto(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cascade"] == list(family.MODELS) and out["front"]
    for point in out["front"]:
        assert point["cost_usd_per_hr"] <= 1.5 + 1e-9
        assert len(point["fleets"]) == 3


def test_plan_pareto_needs_validation(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--pareto needs --validation"):
        run_pareto(_pareto_args(tmp_path))
