"""Kairos upper bounds (estimator/bounds.py): the authors' numbers, closed forms and invariants."""

from __future__ import annotations

import itertools
import json
import math
from functools import cache
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from estimator.batches import kairos_batch_pmf
from estimator.bounds import (
    KairosQuantities,
    Ranking,
    TypeQuantities,
    best_homogeneous,
    kairos_quantities,
    rank_configurations,
    similarity_pick,
    upper_bounds,
)
from estimator.catalog import load_catalog
from estimator.errors import (
    BatchSizeOutOfRangeError,
    BudgetError,
    EstimatorError,
    FleetError,
    InfeasibleQoSError,
    MissingProfileError,
    SearchSpaceError,
    UnknownInstanceTypeError,
    WorkloadError,
)
from estimator.profiles import LatencyProfile, ProfileSet, load_profiles
from tests.conftest import KAIROS_CSV, SHARED, needs_shared

# The Kairos setting (paper section 7; KAIROS_MATH.md).
TYPES = ("g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge")
MAX_COUNTS = dict(zip(TYPES, (5, 6, 17, 15), strict=True))
QOS_MS = {"rm2": 350.0, "wnd": 25.0, "mtwnd": 25.0, "dien": 35.0, "ncf": 5.0}
BUDGET = 2.5
AUTHORS_JSON = SHARED / "data" / "kairos_allocator_profile.json"

# Q_a(b_a) of a type at its own b_a ("qps" in the authors' file) that the published samples do not
# reproduce by any latency statistic or mix we tried (docs/kairos-bounds.md); every other entry
# (Q_a at the b_a of the other types, Q_G, s_a, tau_a) is within 3%.
OWN_RATE_OUTLIERS = {
    ("dien", "t3.xlarge"): -0.094,
    ("mtwnd", "t3.xlarge"): -0.104,
    ("ncf", "c5n.2xlarge"): -0.060,
    ("ncf", "t3.xlarge"): -0.034,
    ("wnd", "t3.xlarge"): -0.040,
}


@cache
def kairos_profiles() -> ProfileSet:
    return load_profiles(KAIROS_CSV)


@cache
def authors() -> dict[str, dict[str, dict[str, object]]]:
    document: dict[str, dict[str, dict[str, object]]] = json.loads(AUTHORS_JSON.read_text())
    return document


def paper_quantities(model: str, qos_statistic: str = "median") -> KairosQuantities:
    catalog = load_catalog()
    prices = {name: catalog.price_usd_per_hr(name) for name in TYPES}
    return kairos_quantities(
        kairos_profiles(),
        model,
        TYPES,
        prices,
        QOS_MS[model],
        kairos_batch_pmf(),
        qos_statistic=qos_statistic,  # type: ignore[arg-type]
    )


def authors_quantities(model: str) -> KairosQuantities:
    """The authors' own numbers as KairosQuantities (one base, three auxiliaries)."""
    doc = authors()[model]
    catalog = load_catalog()
    shares = {}
    types = [
        TypeQuantities(
            "g4dn.xlarge",
            catalog.price_usd_per_hr("g4dn.xlarge"),
            float(doc["g4dn.xlarge"]["qps"]),  # type: ignore[arg-type]
            True,
            None,
            1.0,
            1.0,
            {},
            {},
        )
    ]
    for name in TYPES[1:]:
        entry = doc[name]
        b_a = int(entry["vio_batch"])  # type: ignore[call-overload]
        shares[b_a] = (float(entry["small_ratio"]), float(entry["time_ratio"]))  # type: ignore[arg-type]
        rates = {int(b): float(v) for b, v in entry["all_batch"].items()}  # type: ignore[attr-defined]
        types.append(
            TypeQuantities(
                name,
                catalog.price_usd_per_hr(name),
                0.0,
                False,
                b_a,
                shares[b_a][0],
                shares[b_a][1],
                rates,
                {},
            )
        )
    thresholds = tuple(sorted(shares))
    base = types[0]
    types[0] = TypeQuantities(
        base.instance_type,
        base.price_usd_per_hr,
        base.throughput_qps,
        True,
        None,
        1.0,
        1.0,
        {},
        dict.fromkeys(thresholds, 1.0),
    )
    return KairosQuantities(
        model,
        QOS_MS[model],
        "g4dn.xlarge",
        tuple(types),
        (),
        thresholds,
        {b: s for b, (s, _) in shares.items()},
        {b: tau for b, (_, tau) in shares.items()},
    )


# ---------------------------------------------------------------------------------------------
# The authors' quantities and the paper's configurations
# ---------------------------------------------------------------------------------------------


@needs_shared
@pytest.mark.parametrize("model", sorted(QOS_MS))
def test_derived_quantities_match_the_authors_within_3_percent(model: str) -> None:
    q = paper_quantities(model)
    doc = authors()[model]
    assert q.base_type == "g4dn.xlarge"
    assert q.base_rate_qps == pytest.approx(doc["g4dn.xlarge"]["qps"], rel=0.03)
    for name in TYPES[1:]:
        mine, theirs = q[name], doc[name]
        assert not mine.full_range
        assert mine.violation_batch == theirs["vio_batch"], name
        assert mine.small_share == pytest.approx(theirs["small_ratio"], rel=0.03), name
        assert mine.time_share == pytest.approx(theirs["time_ratio"], rel=0.03), name
        for beta, rate in theirs["all_batch"].items():  # type: ignore[attr-defined]
            error = mine.aux_rate_qps[int(beta)] / rate - 1
            if int(beta) == mine.violation_batch and (model, name) in OWN_RATE_OUTLIERS:
                assert error == pytest.approx(OWN_RATE_OUTLIERS[(model, name)], abs=0.005)
            else:
                assert abs(error) < 0.03, (name, beta, error)


@needs_shared
def test_the_median_reproduces_every_violation_batch_and_the_mean_misses_four() -> None:
    missed = []
    for model in QOS_MS:
        q = paper_quantities(model, "mean")
        for name in TYPES[1:]:
            if q[name].violation_batch != authors()[model][name]["vio_batch"]:
                missed.append((model, name))
    assert sorted(missed) == [
        ("ncf", "c5n.2xlarge"),
        ("ncf", "r5n.large"),
        ("ncf", "t3.xlarge"),
        ("wnd", "t3.xlarge"),
    ]


@needs_shared
@pytest.mark.parametrize(
    ("model", "top", "top_qps", "homogeneous_qps"),
    [
        ("rm2", (1, 0, 13, 0), 144.0, 60.0),
        ("dien", (2, 0, 9, 0), 733.0, 419.0),
        ("wnd", (1, 0, 13, 0), 1556.0, 984.0),
        ("mtwnd", (2, 0, 9, 0), 1061.0, 667.0),
        ("ncf", (1, 0, 13, 0), 7181.0, 3498.0),
    ],
)
def test_the_paper_setting_ranks_the_papers_configurations(
    model: str, top: tuple[int, ...], top_qps: float, homogeneous_qps: float
) -> None:
    q = paper_quantities(model)
    ranking = rank_configurations(q, BUDGET, MAX_COUNTS)
    assert ranking.exhaustive and ranking.enumerated == len(ranking) == 331  # "a few hundred"
    assert tuple(ranking.counts[0]) == top
    assert ranking.upper_bound_qps[0] == pytest.approx(top_qps, rel=0.03)
    counts, ub = best_homogeneous(q, BUDGET, MAX_COUNTS)
    assert tuple(counts) == (4, 0, 0, 0)
    assert ub == pytest.approx(homogeneous_qps, rel=0.03)
    # With the authors' own quantities and the paper's rule the same top comes out.
    theirs = rank_configurations(authors_quantities(model), BUDGET, MAX_COUNTS, rule="widest")
    assert tuple(theirs.counts[0]) == top
    assert theirs.upper_bound_qps[0] == pytest.approx(top_qps, rel=0.002)


@needs_shared
def test_the_similarity_pick_in_the_paper_setting() -> None:
    picks = {}
    for model in QOS_MS:
        ranking = rank_configurations(paper_quantities(model), BUDGET, MAX_COUNTS, top=10)
        picks[model] = tuple(ranking.counts[similarity_pick(ranking)])
    assert picks == {
        "rm2": (1, 0, 13, 0),  # the top-3 share one base instance: the top one
        "dien": (2, 0, 9, 0),
        "ncf": (1, 0, 13, 0),
        "wnd": (2, 0, 9, 0),  # the top-3 disagree: the centre of the top-10
        "mtwnd": (2, 0, 8, 1),
    }


@needs_shared
def test_the_papers_widest_threshold_is_not_monotone_but_best_is() -> None:
    q = paper_quantities("ncf")
    before, after = np.array([2, 0, 0, 14]), np.array([2, 0, 1, 14])  # add one r5n.large
    assert upper_bounds(q, after, rule="widest") < upper_bounds(q, before, rule="widest") - 20
    assert upper_bounds(q, after) >= upper_bounds(q, before)
    assert upper_bounds(q, before) == upper_bounds(q, before, rule="widest")


# ---------------------------------------------------------------------------------------------
# Closed forms on synthetic profiles
# ---------------------------------------------------------------------------------------------


def synthetic_profiles(latencies: dict[str, list[float]], sizes: list[int]) -> ProfileSet:
    """One sample per cell (so the median is the mean)."""
    return ProfileSet(
        LatencyProfile("m", name, np.array(sizes), tuple(np.array([x]) for x in values))
        for name, values in latencies.items()
    )


SIZES = [1, 2, 3, 4]
PMF = ([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1])
TINY = {"gpu": [10.0, 20.0, 30.0, 40.0], "cpu": [20.0, 60.0, 100.0, 200.0]}


def tiny_quantities() -> KairosQuantities:
    return kairos_quantities(
        synthetic_profiles(TINY, SIZES), "m", ["gpu", "cpu"], {"gpu": 1.0, "cpu": 0.2}, 50.0, PMF
    )


def test_hand_computed_quantities_and_bound() -> None:
    q = tiny_quantities()
    # sum_b p L_G = 4 + 6 + 6 + 4 = 20 ms: Q_G = 50 qps. The CPU misses 50 ms first at b = 2
    # (60 ms): s = 0.7, tau = (4 + 6) / 20 = 0.5, Q_a(2) = 1000 * 0.7 / (0.4 * 20 + 0.3 * 60).
    assert q.base_type == "gpu" and q.thresholds == (2,)
    cpu = q["cpu"]
    assert (q.base_rate_qps, cpu.violation_batch) == (pytest.approx(50.0), 2)
    assert (cpu.small_share, cpu.time_share) == (pytest.approx(0.7), pytest.approx(0.5))
    q_a = 700 / 26
    assert cpu.aux_rate_qps[2] == pytest.approx(q_a)
    # One of each: Q_GL = 50 * 0.3 / 0.5 = 30; T = Q_a / 0.7; D_L = 0.3 T < 30, so the CPU is the
    # bottleneck: u = D_L / 30, UB = T + 50 (1 - u).
    T = q_a / 0.7
    one_each = T + 50 * (1 - 0.3 * T / 30)
    # Five CPUs: D_L = 0.3 * 5 T >= 30, the GPU is: UB = 30 / 0.3 = 100.
    ub = upper_bounds(q, np.array([[1, 0], [1, 1], [1, 5], [0, 5], [2, 0]]))
    assert ub == pytest.approx([50.0, one_each, 100.0, 0.0, 100.0])
    assert one_each == pytest.approx(50 + 0.5 / 0.7 * q_a)  # the closed form min(.., N + A)


def paper_steps(q: KairosQuantities, counts: np.ndarray) -> float:
    """KAIROS_MATH.md steps 1-8, one configuration at a time, with the generalisations written
    out: the pool N of full-range types in base units, the best threshold among those present."""
    types = q.types
    if not any(n > 0 for n, t in zip(counts, types, strict=True) if t.full_range):
        return 0.0
    homogeneous = sum(
        n * t.throughput_qps for n, t in zip(counts, types, strict=True) if t.full_range
    )
    best = homogeneous
    present = {
        t.violation_batch for n, t in zip(counts, types, strict=True) if n and not t.full_range
    }
    for beta in present:
        s, tau = q.small_share_at[beta], q.time_share_at[beta]
        Q_G = q.base_rate_qps * sum(
            n * t.base_equivalents[beta] for n, t in zip(counts, types, strict=True) if t.full_range
        )
        Q_aux = sum(
            n * t.aux_rate_qps.get(beta, 0.0)
            for n, t in zip(counts, types, strict=True)
            if not t.full_range
        )
        if s >= 1.0:  # every query is small: the auxiliaries and the pool share them all
            best = max(best, Q_aux + Q_G)
            continue
        Q_GL = Q_G * (1 - s) / (1 - tau)
        T = Q_aux / s
        D_L = T - Q_aux
        if D_L >= Q_GL:
            ub = Q_GL / (1 - s)
        else:
            u = D_L / Q_GL
            ub = T + Q_G * (1 - u)
        best = max(best, ub)
    return best


@st.composite
def synthetic_models(
    draw: st.DrawFn,
) -> tuple[KairosQuantities, dict[str, list[float]], list[float]]:
    """Random mixes and latency curves: 1-3 full-range types, 1-4 auxiliaries."""
    n_sizes = draw(st.integers(3, 8))
    sizes = [10 * (i + 1) for i in range(n_sizes)]
    weights = draw(st.lists(st.floats(0.05, 1.0), min_size=n_sizes, max_size=n_sizes))
    p = [w / sum(weights) for w in weights]
    qos = 100.0
    latencies: dict[str, list[float]] = {}
    n_full = draw(st.integers(1, 3))
    for i in range(n_full):
        start = draw(st.floats(1.0, 30.0))
        steps = draw(st.lists(st.floats(0.0, 10.0), min_size=n_sizes - 1, max_size=n_sizes - 1))
        latencies[f"full{i}"] = list(itertools.accumulate([start, *steps]))
    for i in range(draw(st.integers(1, 4))):
        reach = draw(st.integers(1, n_sizes - 1))  # meets QoS at sizes[:reach]
        inside = sorted(draw(st.lists(st.floats(1.0, qos), min_size=reach, max_size=reach)))
        outside = [qos + 1.0 + 20.0 * j for j in range(n_sizes - reach)]
        latencies[f"aux{i}"] = inside + outside
    prices = {name: draw(st.floats(0.05, 1.0)) for name in latencies}
    q = kairos_quantities(
        synthetic_profiles(latencies, sizes), "m", list(latencies), prices, qos, (sizes, p)
    )
    return q, latencies, p


def counts_for(q: KairosQuantities, maximum: int = 6) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, maximum), min_size=len(q.types), max_size=len(q.types))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_vectorised_bounds_equal_the_papers_steps(data: st.DataObject) -> None:
    q, _, _ = data.draw(synthetic_models())
    batch = np.array(data.draw(st.lists(counts_for(q), min_size=1, max_size=20)))
    expected = [paper_steps(q, row) for row in batch]
    assert upper_bounds(q, batch) == pytest.approx(expected, rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_bound_is_monotone_in_every_count(data: st.DataObject) -> None:
    q, _, _ = data.draw(synthetic_models())
    counts = np.array(data.draw(counts_for(q)))
    more = counts + np.eye(len(q.types), dtype=np.int64)  # one more of each type, row by row
    assert np.all(upper_bounds(q, more) >= upper_bounds(q, counts) * (1 - 1e-12))


def fluid_lp_qps(
    latencies: dict[str, list[float]], p: list[float], counts: dict[str, int], beta_index: int
) -> float:
    """The two-class fluid LP: small queries (the first ``beta_index + 1`` sizes) may run anywhere
    a type can serve them, large ones only on full-range types; maximise the total rate X."""
    names = list(counts)
    pr = np.array(p)
    small = slice(0, beta_index + 1)
    s = pr[small].sum()
    # Variables: X, then (small rate, large rate) per type.
    n = 1 + 2 * len(names)
    c = np.zeros(n)
    c[0] = -1.0
    a_eq, b_eq, a_ub, b_ub = [], [], [], []
    small_row, large_row = np.zeros(n), np.zeros(n)
    small_row[0], large_row[0] = -s, -(1 - s)
    bounds = [(0.0, None)] * n
    for i, name in enumerate(names):
        lat = np.array(latencies[name])
        small_row[1 + 2 * i] = large_row[2 + 2 * i] = 1.0
        row = np.zeros(n)
        row[1 + 2 * i] = (pr[small] @ lat[small]) / s
        if name.startswith("aux") or s >= 1:
            bounds[2 + 2 * i] = (0.0, 0.0)
        else:
            row[2 + 2 * i] = (pr[beta_index + 1 :] @ lat[beta_index + 1 :]) / (1 - s)
        a_ub.append(row)
        b_ub.append(1000.0 * counts[name])
    a_eq += [small_row, large_row]
    b_eq += [0.0, 0.0]
    result = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds)
    assert result.status == 0
    return float(-result.fun)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_bound_is_the_fluid_lp_with_one_base_and_relaxes_it_with_several(
    data: st.DataObject,
) -> None:
    q, latencies, p = data.draw(synthetic_models())
    # One threshold: auxiliaries of a single b_a (the others at 0).
    beta = data.draw(st.sampled_from(q.thresholds))
    counts = {}
    for t in q.types:
        usable = t.full_range or t.violation_batch == beta
        counts[t.instance_type] = data.draw(st.integers(0, 5)) if usable else 0
    counts[q.base_type] = max(1, counts[q.base_type])
    beta_index = [10 * (i + 1) for i in range(len(p))].index(beta)
    lp = fluid_lp_qps(latencies, p, counts, beta_index)
    ub = float(upper_bounds(q, np.array([counts[t.instance_type] for t in q.types])))
    others = [t for t in q.types if t.full_range and t.instance_type != q.base_type]
    if not any(counts[t.instance_type] for t in others):
        assert ub == pytest.approx(lp, rel=1e-6)  # the paper's setting: the bound is the LP
    elif any(counts[t.instance_type] for t in q.types if not t.full_range):
        assert ub >= lp * (1 - 1e-9)  # several full-range types: a relaxation of it
    else:
        # No auxiliary, no threshold: full-range types serve the mix side by side (no credit for
        # splitting it between them; docs/kairos-bounds.md).
        side_by_side = sum(counts[t.instance_type] * t.throughput_qps for t in q.types)
        assert ub == pytest.approx(side_by_side, rel=1e-9)


def test_a_copy_of_the_base_counts_as_base_instances() -> None:
    latencies = {**TINY, "gpu2": TINY["gpu"]}
    prices = {"gpu": 1.0, "cpu": 0.2, "gpu2": 1.0}
    q = kairos_quantities(
        synthetic_profiles(latencies, SIZES), "m", ["gpu", "cpu", "gpu2"], prices, 50.0, PMF
    )
    assert q["gpu2"].base_equivalents == {2: pytest.approx(1.0)}
    ub = upper_bounds(q, np.array([[1, 3, 1], [2, 3, 0], [0, 3, 2], [0, 3, 0]]))
    assert ub[0] == pytest.approx(ub[1]) and ub[1] == pytest.approx(ub[2])
    assert ub[3] == 0.0


def test_a_faster_second_gpu_needs_no_base_instance() -> None:
    latencies = {**TINY, "fast": [x / 2 for x in TINY["gpu"]]}
    prices = {"gpu": 0.5, "cpu": 0.2, "fast": 1.5}  # fast is less cost-effective: gpu is base
    q = kairos_quantities(
        synthetic_profiles(latencies, SIZES), "m", ["gpu", "cpu", "fast"], prices, 50.0, PMF
    )
    assert q.base_type == "gpu" and q["fast"].full_range
    assert q["fast"].throughput_qps == pytest.approx(100.0)
    assert q["fast"].base_equivalents[2] == pytest.approx(2.0)
    assert upper_bounds(q, np.array([0, 0, 1])) == pytest.approx(100.0)
    assert upper_bounds(q, np.array([0, 1, 1])) == pytest.approx(
        upper_bounds(q, np.array([2, 1, 0]))
    )


# ---------------------------------------------------------------------------------------------
# Ranking, picking
# ---------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_search_finds_the_exhaustive_top_and_respects_budget_and_caps(
    data: st.DataObject,
) -> None:
    q, _, _ = data.draw(synthetic_models())
    budget = data.draw(st.floats(0.5, 3.0))
    slack = 1e-9 * max(1.0, budget)  # the documented tolerance on sums of decimal prices
    names = list(q.type_names)
    prices = q.prices_usd_per_hr
    capped = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    max_counts = {name: data.draw(st.integers(0, 5)) for name in capped}
    caps = [
        min(max_counts.get(n, 10**6), math.floor((budget + slack) / p))
        for n, p in zip(names, prices, strict=True)
    ]
    if math.prod(c + 1 for c in caps) > 50_000:  # keep the brute force below small
        caps = [min(3, c) for c in caps]
        max_counts = dict(zip(names, caps, strict=True))
    top = data.draw(st.integers(1, 15))
    rule = data.draw(st.sampled_from(["best", "widest"]))
    try:
        full = rank_configurations(q, budget, max_counts, rule=rule, method="exhaustive")
    except BudgetError:
        return
    # Small blocks, so that the search prunes (one block of 65536 rows would hold everything).
    # Small blocks also split one row's children into ranges of counts: the same mixes.
    with mock.patch("estimator.bounds._CHUNK_ROWS", data.draw(st.integers(1, 64))):
        searched = rank_configurations(q, budget, max_counts, top, rule=rule, method="bound")
        chunked = rank_configurations(q, budget, max_counts, rule=rule, method="exhaustive")
    assert chunked.counts.tolist() == full.counts.tolist()
    assert searched.counts.tolist() == full.counts[:top].tolist()
    assert searched.upper_bound_qps == pytest.approx(full.upper_bound_qps[:top], rel=1e-9)
    assert np.all(full.counts @ prices <= budget + slack)
    assert full.cost_usd_per_hr == pytest.approx(full.counts @ prices)
    for name, cap in max_counts.items():
        assert np.all(full.counts[:, names.index(name)] <= cap)
    assert np.all(full.upper_bound_qps > 0)
    assert np.all(np.diff(full.upper_bound_qps) <= 1e-6)
    # Everything affordable with a full-range instance is there, once.
    box = np.indices([c + 1 for c in caps]).reshape(len(caps), -1).T
    full_range = np.array([t.full_range for t in q.types])
    affordable = box @ prices <= budget + slack
    expected = int(np.sum(affordable & (box[:, full_range] > 0).any(axis=1)))
    assert full.enumerated == len(full) == expected
    assert len({tuple(row) for row in full.counts.tolist()}) == expected


def test_ties_rank_cheaper_first() -> None:
    q = tiny_quantities()
    # The GPU is the bottleneck at 5 CPUs, so 6 or 7 CPUs add nothing: same bound, costlier.
    ranking = rank_configurations(q, 2.4, {"gpu": 1})
    rows = ranking.counts.tolist()
    assert rows.index([1, 5]) < rows.index([1, 6]) < rows.index([1, 7])
    assert ranking.upper_bound_qps[rows.index([1, 7])] == pytest.approx(100.0)


def ranking_of(counts: list[list[int]]) -> Ranking:
    n = len(counts)
    return Ranking(
        ("g", "c"), "g", np.array(counts), np.arange(n, 0, -1.0), np.zeros(n), 10.0, n, True, ""
    )


def test_similarity_pick() -> None:
    assert similarity_pick(ranking_of([[1, 9], [1, 4], [1, 8], [3, 0]])) == 0
    assert similarity_pick(ranking_of([[1, 9]])) == 0
    rows = [[2, 1], [1, 9], [3, 0], [1, 8], [2, 3], [2, 2], [1, 7], [2, 4], [3, 1], [2, 5], [0, 0]]
    pick = similarity_pick(ranking_of(rows))
    top = np.array(rows[:10])
    sums = [sum(int(((a - b) ** 2).sum()) for b in top) for a in top]
    assert pick == int(np.argmin(sums)) == 7  # [2, 4], nearest the centroid (1.9, 4) of the top-10
    with pytest.raises(ValueError):
        similarity_pick(ranking_of([]))


def test_best_homogeneous_takes_the_best_full_range_type() -> None:
    latencies = {**TINY, "fast": [x / 2 for x in TINY["gpu"]]}
    prices = {"gpu": 0.5, "cpu": 0.2, "fast": 1.5}
    q = kairos_quantities(
        synthetic_profiles(latencies, SIZES), "m", ["gpu", "cpu", "fast"], prices, 50.0, PMF
    )
    counts, ub = best_homogeneous(q, 3.0, {"gpu": 2})  # 2 gpu = 100 qps, 2 fast = 200 qps
    assert counts.tolist() == [0, 0, 2] and ub == pytest.approx(200.0)
    counts, ub = best_homogeneous(q, 3.0)  # 6 gpu = 300 qps
    assert counts.tolist() == [6, 0, 0] and ub == pytest.approx(300.0)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_a_qos_no_type_meets_is_refused_with_what_each_reaches() -> None:
    profiles = synthetic_profiles(TINY, SIZES)
    with pytest.raises(InfeasibleQoSError, match="gpu up to 2") as error:
        kairos_quantities(profiles, "m", ["gpu", "cpu"], {"gpu": 1, "cpu": 1}, 25.0, PMF)
    assert error.value.reach == {"gpu": 2, "cpu": 1}


@pytest.mark.parametrize("budget", [0.0, -1.0, math.nan, math.inf])
def test_a_budget_must_be_positive_and_finite(budget: float) -> None:
    with pytest.raises(BudgetError, match="finite number of USD/hr > 0"):
        rank_configurations(tiny_quantities(), budget)


def test_a_budget_below_one_base_instance_says_what_it_costs() -> None:
    with pytest.raises(BudgetError, match=r"budget \$0.5/hr affords no configuration: the"
                       r" cheapest full-range type gpu costs \$1/hr"):  # fmt: skip
        rank_configurations(tiny_quantities(), 0.5)
    with pytest.raises(BudgetError, match="max counts allow no full-range instance"):
        rank_configurations(tiny_quantities(), 5.0, {"gpu": 0})


def test_bad_caps_and_types_are_named() -> None:
    q = tiny_quantities()
    with pytest.raises(UnknownInstanceTypeError, match="'tpu'"):
        rank_configurations(q, 5.0, {"tpu": 1})
    with pytest.raises(FleetError, match="max count of cpu"):
        rank_configurations(q, 5.0, {"cpu": -1})
    free = kairos_quantities(
        synthetic_profiles(TINY, SIZES), "m", ["gpu", "cpu"], {"gpu": 1, "cpu": 0}, 50.0, PMF
    )
    with pytest.raises(BudgetError, match="cpu costs nothing"):
        rank_configurations(free, 5.0)
    assert rank_configurations(free, 1.0, {"cpu": 3}).counts[0].tolist() == [1, 3]
    with pytest.raises(ValueError, match="shape"):
        upper_bounds(q, np.array([1, 2, 3]))


def test_mix_and_profile_mismatches_are_named() -> None:
    profiles = synthetic_profiles(TINY, SIZES)
    prices = {"gpu": 1.0, "cpu": 0.2}
    with pytest.raises(BatchSizeOutOfRangeError, match=r"batch size 5 is outside .* 'gpu'"):
        kairos_quantities(profiles, "m", ["gpu", "cpu"], prices, 50.0, ([1, 5], [0.5, 0.5]))
    with pytest.raises(UnknownInstanceTypeError, match="price list"):
        kairos_quantities(profiles, "m", ["gpu", "cpu"], {"gpu": 1.0}, 50.0, PMF)
    with pytest.raises(MissingProfileError):
        kairos_quantities(profiles, "m", ["gpu", "tpu"], {**prices, "tpu": 1}, 50.0, PMF)
    with pytest.raises(WorkloadError, match="sum to 1"):
        kairos_quantities(profiles, "m", ["gpu", "cpu"], prices, 50.0, ([1, 2], [0.5, 0.6]))
    with pytest.raises(WorkloadError, match="QoS"):
        kairos_quantities(profiles, "m", ["gpu", "cpu"], prices, -1.0, PMF)
    assert issubclass(InfeasibleQoSError, EstimatorError) and issubclass(
        BudgetError, EstimatorError
    )


def test_a_type_that_meets_qos_nowhere_is_excluded() -> None:
    latencies = {**TINY, "slow": [500.0, 600.0, 700.0, 800.0]}
    prices = {"gpu": 1.0, "cpu": 0.2, "slow": 0.01}
    q = kairos_quantities(
        synthetic_profiles(latencies, SIZES), "m", list(latencies), prices, 50.0, PMF
    )
    assert q.excluded == ("slow",) and q.type_names == ("gpu", "cpu")


def test_ranking_everything_has_a_limit_and_the_top_may_exceed_the_space() -> None:
    q = tiny_quantities()
    with pytest.raises(SearchSpaceError, match="more than 5 configurations"):
        rank_configurations(q, 3.0, max_ranked=5)
    everything = rank_configurations(q, 3.0)
    assert len(rank_configurations(q, 3.0, top=10_000)) == len(everything) == everything.enumerated
    assert everything.fleet(0) == {"gpu": 2, "cpu": 5}
