"""Allocation of instances to the stages of a cascade (Cascadia's MILP) and the weighted-Tchebycheff
sweep of thresholds that yields the latency/quality Pareto front.

This module owns the two levels of Cascadia (Jiang et al., "Cascadia", sections 3.2 and 3.3),
on instance types with prices instead of GPUs of one kind:

**Per-stage latency model.** Stage i (a model of the cascade) receives lambda_i = s_i lambda
queries per second (s_i its reach share, lambda the app's rate). An allocation a_i gives it n_t
instances of each type t, one of which serves mu_{i,t} queries per second. The stage is read as
one M/D/1 queue whose server has the pooled rate mu = sum_t n_t mu_{i,t}, N = sum_t n_t:

    l_i(a) = N / mu + rho / (2 mu (1 - rho)),    rho = lambda_i / mu < 1

The first term is the mean service time of a query (type t serves the share n_t mu_t / mu of
the queries, each in 1/mu_t: sum_t (n_t mu_t / mu)(1 / mu_t) = N / mu); the second the M/D/1
mean wait (Pollaczek-Khinchine with deterministic service at the pooled rate). With one instance
it is the M/D/1 sojourn time exactly. A stage with rho >= 1 is unstable (l = infinity), and a
stage no query reaches (s_i = 0) needs no instance (l = 0).

**The MILP** (section 3.2, "MILP problem formulation"). As the paper does, the allocations are
discretised and each one's latency precomputed, so the non-linear l_i becomes data: a binary
x_{i,a} per stage i and candidate allocation a, and the continuous L,

    minimise L
    subject to  sum_a x_{i,a} = 1                                   (one allocation per stage)
                sum_a l_i(a) x_{i,a} - L <= 0                      (L is the worst stage latency)
                sum_i sum_a n_t(a) x_{i,a} <= c_t                  (instance caps, per type)
                sum_i sum_a P(a) x_{i,a} <= B                      (budget, USD/hr)

(the paper's "all N GPUs are used" becomes caps and a budget). Ties on L are broken by a second
solve that fixes L at its optimum and minimises cost. Candidate allocations are every count
vector within the caps and what the budget buys, less those that are unstable, over the budget
once the other stages have their cheapest stable allocation, or *dominated*: a is dropped when
removing one instance of some type does not raise its latency (a - e_t costs less, uses less
and is no slower, so no optimum needs a). The pruning keeps the optimum: every dropped a has a
kept a' <= a with l(a') <= l(a).

**The sweep** (section 3.3). For thresholds theta of the cascade the records give the quality
Q(theta) (accuracy) and the shares, the MILP gives L(theta). With the utopia point z* = (min L,
max Q) over the thresholds swept (which include everyone answered by the first model, the least
latency, and the most accurate routing) and both objectives normalised by their range over the
sweep, the weighted Tchebycheff scalarisation

    T(theta) = max(lambda_1 (L(theta) - z1*) / range_L,  lambda_2 (z2* - Q(theta)) / range_Q)

is minimised for each weight pair, lambda_1 / lambda_2 on a logarithmic scale from 0.1 to 10
(the paper's range); each minimiser is Pareto-optimal for its weights, and together they are the
front. (Normalising is ours: latency in ms and accuracy in [0, 1] are otherwise on scales so far
apart that the paper's weights would all pick the same point.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

# scipy.optimize is imported in the functions that solve (about a second of CPU to import, which
# a process that never solves one, such as a CLI command or a serving process, does not pay).
import numpy as np
from numpy.typing import NDArray

from estimator.cascades import (
    Cascade,
    CascadeQuality,
    ValidationRecords,
    evaluate,
    pareto_mask,
)
from estimator.errors import (
    CascadeError,
    InfeasibleAllocationError,
    SearchSpaceError,
)

__all__ = [
    "DEFAULT_WEIGHT_RATIOS",
    "MAX_BOX",
    "Allocation",
    "ParetoPoint",
    "StageDemand",
    "allocate",
    "candidate_allocations",
    "cheapest_within",
    "stage_latency_ms",
    "tchebycheff_front",
]

# The paper varies lambda_1 / lambda_2 "over a logarithmic scale (e.g., 0.1 to 10)".
DEFAULT_WEIGHT_RATIOS: tuple[float, ...] = tuple(float(r) for r in np.logspace(-1.0, 1.0, 21))
# The count vectors enumerated per stage before pruning: the product over types of (cap + 1).
MAX_BOX = 1_000_000
# Slack when fixing the optimal worst latency for the cost tie-break (relative).
_TIE_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class StageDemand:
    """One stage of a cascade: its reach share s_i in [0, 1] and, per instance type that can
    serve it, one instance's throughput mu_{i,t} (queries per second, > 0)."""

    name: str
    share: float
    rate_per_instance_qps: Mapping[str, float]

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0.0 <= self.share <= 1.0):
            raise CascadeError(f"stage {self.name}", f"share must be in [0, 1], got {self.share}")
        if not self.rate_per_instance_qps:
            raise CascadeError(f"stage {self.name}", "names no instance type that can serve it")
        for t, mu in self.rate_per_instance_qps.items():
            if not (math.isfinite(mu) and mu > 0):
                raise CascadeError(f"stage {self.name}", f"rate of {t} must be > 0, got {mu!r}")
        rates = {str(t): float(mu) for t, mu in self.rate_per_instance_qps.items()}
        object.__setattr__(self, "rate_per_instance_qps", MappingProxyType(rates))


def stage_latency_ms(
    counts: Mapping[str, int], rate_per_instance_qps: Mapping[str, float], arrival_qps: float
) -> float:
    """l(a) of the module docstring, in ms: N / mu + rho / (2 mu (1 - rho)); infinity when
    unstable; 0 when no query arrives.

    >>> stage_latency_ms({"c": 1}, {"c": 100.0}, 50.0)  # M/D/1: 10 ms + 0.5 x 10 / (2 x 0.5)
    15.0
    """
    if arrival_qps <= 0:
        return 0.0
    n = sum(counts.values())
    mu = sum(k * rate_per_instance_qps[t] for t, k in counts.items() if k)
    if n == 0 or arrival_qps >= mu:
        return math.inf
    rho = arrival_qps / mu
    return 1000.0 * (n / mu + rho / (2.0 * mu * (1.0 - rho)))


def _latencies_ms(
    counts: NDArray[np.int64], mu: NDArray[np.float64], arrival: float
) -> NDArray[np.float64]:
    """Vectorised :func:`stage_latency_ms` over count vectors (rows)."""
    if arrival <= 0:
        return np.zeros(counts.shape[0])
    n = counts.sum(axis=1).astype(np.float64)
    pooled = counts @ mu
    out = np.full(counts.shape[0], np.inf)
    ok = (n > 0) & (pooled > arrival)
    rho = arrival / pooled[ok]
    out[ok] = 1000.0 * (n[ok] / pooled[ok] + rho / (2.0 * pooled[ok] * (1.0 - rho)))
    return out


@dataclass(frozen=True, slots=True, eq=False)
class _Candidates:
    counts: NDArray[np.int64]  # (K, T)
    latency_ms: NDArray[np.float64]  # (K,)
    cost_usd_per_hr: NDArray[np.float64]  # (K,)


def _upper_counts(
    types: Sequence[str],
    prices: Mapping[str, float],
    budget_usd_per_hr: float | None,
    max_counts: Mapping[str, int] | None,
) -> list[int]:
    upper = []
    for t in types:
        cap = (max_counts or {}).get(t)
        by_budget = (
            math.inf
            if budget_usd_per_hr is None or prices[t] <= 0
            else math.floor(budget_usd_per_hr / prices[t] + 1e-9)
        )
        bound = min(math.inf if cap is None else cap, by_budget)
        if math.isinf(bound):
            raise SearchSpaceError(
                f"instance type {t} has neither a cap nor a price that the budget bounds"
            )
        upper.append(int(bound))
    return upper


def candidate_allocations(
    demand: StageDemand,
    arrival_qps: float,
    types: Sequence[str],
    prices: Mapping[str, float],
    *,
    budget_usd_per_hr: float | None = None,
    max_counts: Mapping[str, int] | None = None,
    prune: bool = True,
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """The allocations the MILP chooses from for one stage, and their latencies (ms): every
    count vector over ``types`` within the caps and the budget that keeps the stage stable (the
    empty one only when no query reaches the stage), less the dominated ones when ``prune``.

    Raises:
        SearchSpaceError: more than :data:`MAX_BOX` count vectors to enumerate.
    """
    return _stage_candidates(
        demand, arrival_qps, types, prices, budget_usd_per_hr, max_counts, prune, math.inf
    )[:2]


def _stage_candidates(
    demand: StageDemand,
    arrival_qps: float,
    types: Sequence[str],
    prices: Mapping[str, float],
    budget_usd_per_hr: float | None,
    max_counts: Mapping[str, int] | None,
    prune: bool,
    cost_limit: float,
) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]:
    upper = _upper_counts(types, prices, budget_usd_per_hr, max_counts)
    usable = [t in demand.rate_per_instance_qps for t in types]
    upper = [u if ok else 0 for u, ok in zip(upper, usable, strict=True)]
    box = math.prod(u + 1 for u in upper)
    if box > MAX_BOX:
        raise SearchSpaceError(
            f"stage {demand.name}: {box:,} allocations to enumerate (more than {MAX_BOX:,});"
            " cap the instance counts (max_counts) or offer fewer types"
        )
    shape = tuple(u + 1 for u in upper)
    counts = np.indices(shape).reshape(len(types), -1).T.astype(np.int64)
    mu = np.array([demand.rate_per_instance_qps.get(t, 0.0) for t in types])
    price = np.array([float(prices[t]) for t in types])
    arrival = demand.share * arrival_qps
    latency = _latencies_ms(counts, mu, arrival)
    # A stage no query reaches gets no instance; any other needs a stable allocation.
    keep = counts.sum(axis=1) == 0 if arrival <= 0 else np.isfinite(latency)
    cost = counts @ price
    limit = min(cost_limit, math.inf if budget_usd_per_hr is None else budget_usd_per_hr)
    keep &= cost <= limit + 1e-9
    if prune and arrival > 0:
        strides = np.array([math.prod(shape[k + 1 :]) for k in range(len(shape))])
        flat = np.arange(counts.shape[0])
        for k in range(len(types)):
            has = counts[:, k] > 0
            fewer = latency[flat[has] - strides[k]]
            dominated = np.zeros_like(keep)
            dominated[has] = fewer <= latency[has]
            keep &= ~dominated
    return counts[keep], latency[keep], cost[keep]


@dataclass(frozen=True, slots=True)
class Allocation:
    """The MILP's answer: per stage (in order) its fleet, counts by type, and its latency l_i."""

    stages: tuple[str, ...]
    fleets: tuple[Mapping[str, int], ...]
    latency_ms: tuple[float, ...]
    cost_usd_per_hr: float

    @property
    def worst_latency_ms(self) -> float:
        """L, the worst stage latency (the MILP's objective)."""
        return max(self.latency_ms)

    @property
    def bottleneck(self) -> str:
        return self.stages[int(np.argmax(self.latency_ms))]


def allocate(
    demands: Sequence[StageDemand],
    arrival_qps: float,
    prices_usd_per_hr: Mapping[str, float],
    *,
    budget_usd_per_hr: float | None = None,
    max_counts: Mapping[str, int] | None = None,
) -> Allocation:
    """The allocation of instances to ``demands`` that minimises the worst stage latency at
    ``arrival_qps`` within the budget and the caps (the MILP of the module docstring, solved by
    ``scipy.optimize.milp``); of equally fast ones, the cheapest.

    Every type of ``prices_usd_per_hr`` may be used, by the stages whose demand names it; a type
    needs a cap in ``max_counts`` or a price the budget bounds.

    >>> stages = [StageDemand("tiny", 1.0, {"c": 100.0}), StageDemand("large", 0.5, {"c": 20.0})]
    >>> a = allocate(stages, 50.0, {"c": 1.0}, max_counts={"c": 4})
    >>> [dict(f) for f in a.fleets]
    [{'c': 1}, {'c': 3}]

    Raises:
        InfeasibleAllocationError: some stage has no stable allocation within the budget and
            caps, or the stages cannot all have one at once.
        SearchSpaceError: a stage with too many allocations to enumerate.
    """
    if not demands:
        raise CascadeError("stages", "nothing to allocate: no stages")
    if not (math.isfinite(arrival_qps) and arrival_qps >= 0):
        raise CascadeError("arrival_qps", f"must be a finite number >= 0, got {arrival_qps!r}")
    if budget_usd_per_hr is not None and not budget_usd_per_hr >= 0:
        raise CascadeError("budget", f"must be >= 0, got {budget_usd_per_hr!r}")
    types = list(prices_usd_per_hr)
    for d in demands:
        for t in d.rate_per_instance_qps:
            if t not in prices_usd_per_hr:
                raise CascadeError(f"stage {d.name}", f"no price for instance type {t!r}")
    # The cheapest stable allocation of each stage, to bound what the others may spend.
    cheapest = []
    for d in demands:
        _, _, cost = _stage_candidates(
            d, arrival_qps, types, prices_usd_per_hr, budget_usd_per_hr, max_counts, True, math.inf
        )
        if cost.size == 0:
            raise InfeasibleAllocationError(
                f"stage {d.name}: no allocation within the budget and caps keeps it below"
                f" utilisation 1 at {d.share * arrival_qps:.6g} qps",
                stage=d.name,
            )
        cheapest.append(float(cost.min()))
    blocks = []
    for i, d in enumerate(demands):
        others = sum(cheapest) - cheapest[i]
        limit = math.inf if budget_usd_per_hr is None else budget_usd_per_hr - others
        blocks.append(
            _stage_candidates(
                d, arrival_qps, types, prices_usd_per_hr, budget_usd_per_hr, max_counts, True, limit
            )
        )
    if any(block[0].shape[0] == 0 for block in blocks):
        raise InfeasibleAllocationError(
            "the stages cannot all have a stable allocation within the budget together"
        )
    choice = _solve(blocks, types, budget_usd_per_hr, max_counts)
    fleets = []
    latencies = []
    total = 0.0
    for (counts, latency, cost), k in zip(blocks, choice, strict=True):
        fleets.append(
            MappingProxyType({t: int(n) for t, n in zip(types, counts[k], strict=True) if n})
        )
        latencies.append(float(latency[k]))
        total += float(cost[k])
    return Allocation(tuple(d.name for d in demands), tuple(fleets), tuple(latencies), total)


def _solve(
    blocks: Sequence[tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]],
    types: Sequence[str],
    budget_usd_per_hr: float | None,
    max_counts: Mapping[str, int] | None,
) -> list[int]:
    """The two MILP solves; returns the chosen candidate index per stage."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    sizes = [block[0].shape[0] for block in blocks]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    n_x = int(offsets[-1])
    n_var = n_x + 1  # the x's, then L
    rows: list[NDArray[np.int64]] = []
    cols: list[NDArray[np.int64]] = []
    vals: list[NDArray[np.float64]] = []
    lower: list[float] = []
    upper: list[float] = []
    row = 0

    def add(columns: NDArray[np.int64], values: NDArray[np.float64], lo: float, hi: float) -> None:
        nonlocal row
        rows.append(np.full(columns.size, row, dtype=np.int64))
        cols.append(columns)
        vals.append(values)
        lower.append(lo)
        upper.append(hi)
        row += 1

    all_counts = np.concatenate([b[0] for b in blocks]).astype(np.float64)
    all_latency = np.concatenate([b[1] for b in blocks])
    all_cost = np.concatenate([b[2] for b in blocks])
    for i in range(len(blocks)):
        span = np.arange(offsets[i], offsets[i + 1], dtype=np.int64)
        add(span, np.ones(span.size), 1.0, 1.0)
        add(
            np.append(span, n_x).astype(np.int64),
            np.append(all_latency[span], -1.0),
            -np.inf,
            0.0,
        )
    for k, t in enumerate(types):
        cap = (max_counts or {}).get(t)
        if cap is not None and all_counts[:, k].any():
            add(np.arange(n_x, dtype=np.int64), all_counts[:, k], -np.inf, float(cap))
    if budget_usd_per_hr is not None:
        add(np.arange(n_x, dtype=np.int64), all_cost, -np.inf, budget_usd_per_hr + 1e-9)
    matrix = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, n_var)
    ).tocsr()
    constraints = [LinearConstraint(matrix, np.array(lower), np.array(upper))]
    integrality = np.append(np.ones(n_x), 0.0)
    worst = float(all_latency.max()) if all_latency.size else 0.0
    bounds = Bounds(np.zeros(n_var), np.append(np.ones(n_x), max(worst, 0.0)))
    options = {"mip_rel_gap": 0.0}
    objective = np.append(np.zeros(n_x), 1.0)
    first = milp(
        objective, constraints=constraints, integrality=integrality, bounds=bounds, options=options
    )
    if first.x is None:
        raise InfeasibleAllocationError(
            f"no allocation meets the caps and the budget together ({first.message})"
        )
    best = float(first.x[-1])
    # The tie-break: the cheapest allocation whose worst latency is the optimum.
    tie = LinearConstraint(
        np.append(np.zeros(n_x), 1.0)[None, :], -np.inf, best * (1 + _TIE_SLACK) + 1e-12
    )
    second = milp(
        np.append(all_cost, 0.0),
        constraints=[*constraints, tie],
        integrality=integrality,
        bounds=bounds,
        options=options,
    )
    solution = second.x if second.x is not None else first.x
    return [int(np.argmax(solution[offsets[i] : offsets[i + 1]])) for i in range(len(blocks))]


def cheapest_within(
    options: Sequence[tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]],
    types: Sequence[str],
    latency_bound_ms: float,
    *,
    budget_usd_per_hr: float | None = None,
    max_counts: Mapping[str, int] | None = None,
) -> list[int] | None:
    """The cheapest choice of one option per stage whose latencies sum to at most
    ``latency_bound_ms``, within the budget and the caps; ``None`` when no choice is.

    Cascadia's MILP (section 3.2) with its objective and latency constraint exchanged, as a planner
    for an SLO needs them: ``options[i]`` is stage i's (counts by ``types``, latency l_i(a) ms,
    cost P(a) USD/hr) per candidate allocation a, the latencies precomputed (the planner
    simulates them), and with binaries x_{i,a}

        minimise    sum_i sum_a P(a) x_{i,a}
        subject to  sum_a x_{i,a} = 1                        (one allocation per stage)
                    sum_i sum_a l_i(a) x_{i,a} <= bound      (the pipeline's latency)
                    sum_i sum_a n_t(a) x_{i,a} <= c_t        (caps, per type)
                    sum_i sum_a P(a) x_{i,a} <= B            (budget)

    >>> one = (np.array([[1], [2]]), np.array([30.0, 12.0]), np.array([1.0, 2.0]))
    >>> two = (np.array([[1], [3]]), np.array([40.0, 15.0]), np.array([1.0, 3.0]))
    >>> cheapest_within([one, two], ["c"], 60.0)  # 12 + 40 ms at $3/hr (30 + 40 is $2, too slow)
    [1, 0]
    >>> cheapest_within([one, two], ["c"], 20.0) is None
    True
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    if not options or any(block[0].shape[0] == 0 for block in options):
        return None
    sizes = [block[0].shape[0] for block in options]
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    n_x = int(offsets[-1])
    all_counts = np.concatenate([b[0] for b in options]).astype(np.float64)
    all_latency = np.concatenate([b[1] for b in options])
    all_cost = np.concatenate([b[2] for b in options])
    rows: list[NDArray[np.float64]] = []
    lower: list[float] = []
    upper: list[float] = []
    for i in range(len(options)):
        row = np.zeros(n_x)
        row[offsets[i] : offsets[i + 1]] = 1.0
        rows += [row]
        lower.append(1.0)
        upper.append(1.0)
    rows.append(all_latency)
    lower.append(-np.inf)
    upper.append(latency_bound_ms)
    for k, t in enumerate(types):
        cap = (max_counts or {}).get(t)
        if cap is not None and all_counts[:, k].any():
            rows.append(all_counts[:, k])
            lower.append(-np.inf)
            upper.append(float(cap))
    if budget_usd_per_hr is not None:
        rows.append(all_cost)
        lower.append(-np.inf)
        upper.append(budget_usd_per_hr + 1e-9)
    constraints = [LinearConstraint(np.vstack(rows), np.array(lower), np.array(upper))]
    result = milp(
        all_cost,
        constraints=constraints,
        integrality=np.ones(n_x),
        bounds=Bounds(np.zeros(n_x), np.ones(n_x)),
        options={"mip_rel_gap": 0.0},
    )
    if result.x is None:
        return None
    return [int(np.argmax(result.x[offsets[i] : offsets[i + 1]])) for i in range(len(options))]


# --- the weighted-Tchebycheff sweep ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParetoPoint:
    """A threshold setting on the latency/quality front: the cascade, what the records say of it,
    the MILP's allocation at the sweep's rate, and the weight ratios lambda_1 / lambda_2 that
    picked it."""

    cascade: Cascade
    quality: CascadeQuality
    allocation: Allocation
    weight_ratios: tuple[float, ...]

    @property
    def latency_ms(self) -> float:
        return self.allocation.worst_latency_ms


def tchebycheff_front(
    records: ValidationRecords,
    models: Sequence[str],
    rate_per_instance_qps: Mapping[str, Mapping[str, float]],
    arrival_qps: float,
    prices_usd_per_hr: Mapping[str, float],
    *,
    grid: Sequence[float],
    budget_usd_per_hr: float | None = None,
    max_counts: Mapping[str, int] | None = None,
    weight_ratios: Sequence[float] = DEFAULT_WEIGHT_RATIOS,
) -> tuple[ParetoPoint, ...]:
    """The latency/quality Pareto front of the cascade ``models`` (cheapest first) over every
    threshold combination of ``grid``, by the weighted-Tchebycheff sweep of the module docstring.
    ``rate_per_instance_qps[m][t]`` is mu of model m on type t. Threshold settings whose stages
    cannot all be allocated stably are left out. Sorted by latency, fastest first.

    Raises:
        InfeasibleAllocationError: no threshold setting can be allocated.
    """
    if len(models) < 1:
        raise CascadeError("models", "needs at least one model")
    evaluated: list[tuple[Cascade, CascadeQuality, Allocation]] = []
    last_error: InfeasibleAllocationError | None = None
    cache: dict[tuple[float, ...], Allocation | None] = {}
    for thresholds in itertools.product(grid, repeat=len(models) - 1):
        cascade = Cascade(tuple(models), tuple(thresholds))
        quality = evaluate(cascade, records)
        key = tuple(round(s, 12) for s in quality.reach_share)
        if key not in cache:
            demands = [
                StageDemand(m, share, rate_per_instance_qps[m])
                for m, share in zip(models, quality.reach_share, strict=True)
            ]
            try:
                cache[key] = allocate(
                    demands,
                    arrival_qps,
                    prices_usd_per_hr,
                    budget_usd_per_hr=budget_usd_per_hr,
                    max_counts=max_counts,
                )
            except InfeasibleAllocationError as error:
                cache[key], last_error = None, error
        allocation = cache[key]
        if allocation is not None:
            evaluated.append((cascade, quality, allocation))
    if not evaluated:
        assert last_error is not None
        raise last_error
    latency = np.array([a.worst_latency_ms for _, _, a in evaluated])
    quality_values = np.array([q.accuracy for _, q, _ in evaluated])
    z1, z2 = float(latency.min()), float(quality_values.max())
    span_l = float(latency.max()) - z1 or 1.0
    span_q = z2 - float(quality_values.min()) or 1.0
    dev_l = (latency - z1) / span_l
    dev_q = (z2 - quality_values) / span_q
    picked: dict[int, list[float]] = {}
    for ratio in weight_ratios:
        lam1, lam2 = ratio / (1.0 + ratio), 1.0 / (1.0 + ratio)
        score = np.maximum(lam1 * dev_l, lam2 * dev_q)
        # Ties: the faster, then the more accurate, then the first.
        k = int(np.lexsort((np.arange(score.size), -quality_values, latency, score))[0])
        picked.setdefault(k, []).append(float(ratio))
    chosen = sorted(picked)
    keep = pareto_mask(quality_values[chosen], latency[chosen])
    points = [
        ParetoPoint(evaluated[k][0], evaluated[k][1], evaluated[k][2], tuple(picked[k]))
        for k, kept in zip(chosen, keep, strict=True)
        if kept
    ]
    return tuple(sorted(points, key=lambda p: (p.latency_ms, -p.quality.accuracy)))
