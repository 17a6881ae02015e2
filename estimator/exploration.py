"""Online configuration search under a budget: the candidates, and the searches compared on them.

Kairos section 5.3 (Algorithm 1) and section 8 (Figs. 9-11). Evaluating a configuration (one
simulated or live capacity search) is the expensive step, so a search is judged by how many
evaluations it needs to reach the best configuration. This module owns

- the search space after sub-configuration pruning (:func:`maximal_configurations`): only the
  affordable configurations to which no further instance fits within the budget and the caps;
  every other one is a sub-configuration of one of these, and the paper gives every search this
  pruning;
- the bound-ordered branch and bound (:func:`branch_and_bound`): Kairos+ and the exhaustive
  offline search of each scheme's best. If no configuration's throughput exceeds its upper bound
  (times ``1 + slack``), a configuration whose inflated bound is <= the best throughput found so
  far cannot win, and evaluating in descending bound order until the next bound is that low finds
  the exact best;
- the searches Kairos+ is compared with (Fig. 11), all over the same pruned candidates: random
  search (:func:`random_search_expected_evaluations`, in closed form), a genetic algorithm
  (:func:`genetic_search`) and Bayesian optimisation with a Gaussian process and an upper
  confidence bound (:func:`bayesian_search`).

Every search calls ``evaluate(row) -> qps`` on a row of the candidates' count matrix and counts
distinct rows only (an online system remembers what it measured). Randomness only through the
``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Evaluate = Callable[[int], float]


def maximal_configurations(
    counts: NDArray[np.integer],
    prices_usd_per_hr: NDArray[np.floating],
    budget_usd_per_hr: float,
    max_counts: NDArray[np.integer],
    tolerance_usd_per_hr: float = 1e-9,
) -> NDArray[np.bool_]:
    """Which rows of ``counts`` are maximal: sum_t n_t P_t <= B, and for every type t either
    n_t = cap_t or P_t > B - sum n P (no further instance of any type is affordable).

    >>> maximal_configurations(np.array([[1, 0], [1, 1], [0, 2]]), np.array([1.0, 0.5]),
    ...                        1.5, np.array([1, 2]))
    array([False,  True,  True])
    """
    counts = np.asarray(counts)
    prices = np.asarray(prices_usd_per_hr, dtype=np.float64)
    caps = np.asarray(max_counts)
    if counts.ndim != 2 or prices.shape != (counts.shape[1],) or caps.shape != prices.shape:
        raise ValueError("counts must be (configurations, types), prices and caps one per type")
    room = budget_usd_per_hr - counts @ prices
    addable = (counts < caps[None, :]) & (prices[None, :] <= room[:, None] + tolerance_usd_per_hr)
    return (room >= -tolerance_usd_per_hr) & ~addable.any(axis=1)


@dataclass(frozen=True, slots=True, eq=False)
class BoundedSearch:
    """What a bound-ordered search evaluated and whether its best is proven.

    ``proven``: every row left unevaluated has ``bound * (1 + slack) <= best_qps`` (the search
    stopped on the bound, or evaluated everything); otherwise it stopped at ``max_evaluations``
    and ``next_bound_qps`` (the highest bound left) caps what an unevaluated row could reach.
    """

    best_row: int
    best_qps: float
    evaluated: tuple[int, ...]  # rows, in the order evaluated
    throughput_qps: tuple[float, ...]
    proven: bool
    next_bound_qps: float  # highest bound of a row left unevaluated (0 when none is left)

    @property
    def evaluations(self) -> int:
        return len(self.evaluated)

    @property
    def evaluations_to_best(self) -> int:
        """Evaluations until the best was first measured (it included)."""
        return self.evaluated.index(self.best_row) + 1


def branch_and_bound(
    upper_bound_qps: NDArray[np.floating],
    evaluate: Evaluate,
    slack: float = 0.0,
    max_evaluations: int | None = None,
) -> BoundedSearch:
    """Evaluate rows in descending bound order while ``bound * (1 + slack) > best`` (Kairos
    Algorithm 1 without its sub-configuration step, which the candidates have already had).

    With X(c) <= (1 + slack) UB(c) for every row, the result is the exact argmax of X: every row
    skipped has X <= (1 + slack) UB <= best. Ties in the bound keep the given row order.

    >>> bounds = np.array([10.0, 9.0, 5.0, 8.0])
    >>> found = branch_and_bound(bounds, lambda row: [7.0, 8.5, 5.0, 6.0][row])
    >>> found.best_row, found.evaluated, found.proven
    (1, (0, 1), True)
    """
    bounds = np.asarray(upper_bound_qps, dtype=np.float64)
    if bounds.ndim != 1 or bounds.size == 0:
        raise ValueError("branch and bound needs at least one configuration's bound")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    if max_evaluations is not None and max_evaluations < 1:
        raise ValueError(f"max_evaluations must be >= 1, got {max_evaluations}")
    order = np.argsort(-bounds, kind="stable")
    evaluated: list[int] = []
    measured: list[float] = []
    best, best_qps = -1, -np.inf
    proven, next_bound = True, 0.0
    for row in order:
        if bounds[row] * (1.0 + slack) <= best_qps:
            break
        if max_evaluations is not None and len(evaluated) >= max_evaluations:
            proven, next_bound = False, float(bounds[row])
            break
        qps = float(evaluate(int(row)))
        evaluated.append(int(row))
        measured.append(qps)
        if qps > best_qps:
            best, best_qps = int(row), qps
    return BoundedSearch(best, best_qps, tuple(evaluated), tuple(measured), proven, next_bound)


def random_search_expected_evaluations(candidates: int, targets: int) -> float:
    """Expected evaluations of a random search (a uniformly random order without repetition) to
    first hit one of ``targets`` best rows among ``candidates``: (N + 1) / (k + 1), the mean of
    the first of k marked positions in a random permutation of N.

    >>> random_search_expected_evaluations(70, 1)
    35.5
    """
    if not 1 <= targets <= candidates:
        raise ValueError(f"need 1 <= targets <= candidates, got {targets} of {candidates}")
    return (candidates + 1) / (targets + 1)


@dataclass(frozen=True, slots=True, eq=False)
class SearchTrace:
    """The distinct rows a search evaluated, in order, and when it reached the target."""

    evaluated: tuple[int, ...]
    throughput_qps: tuple[float, ...]
    reached_at: int | None  # evaluations until a row with qps >= target (None: not within cap)


class _Budgeted:
    """``evaluate`` counting distinct rows, stopping the search at the target or the cap."""

    def __init__(self, evaluate: Evaluate, target_qps: float, max_evaluations: int) -> None:
        self._evaluate = evaluate
        self.target_qps = target_qps
        self.max_evaluations = max_evaluations
        self.seen: dict[int, float] = {}
        self.reached_at: int | None = None

    @property
    def done(self) -> bool:
        return self.reached_at is not None or len(self.seen) >= self.max_evaluations

    def __call__(self, row: int) -> float:
        if row not in self.seen:
            self.seen[row] = float(self._evaluate(row))
            if self.reached_at is None and self.seen[row] >= self.target_qps:
                self.reached_at = len(self.seen)
        return self.seen[row]

    def trace(self) -> SearchTrace:
        return SearchTrace(tuple(self.seen), tuple(self.seen.values()), self.reached_at)


def _nearest_unseen(
    points: NDArray[np.floating], x: NDArray[np.floating], seen: dict[int, float]
) -> int | None:
    distance = ((points - x[None, :]) ** 2).sum(axis=1)
    for row in np.argsort(distance, kind="stable"):
        if int(row) not in seen:
            return int(row)
    return None


def genetic_search(
    counts: NDArray[np.integer],
    evaluate: Evaluate,
    target_qps: float,
    rng: np.random.Generator,
    max_evaluations: int,
    population: int = 6,
    mutation_rate: float = 0.3,
) -> SearchTrace:
    """A steady-state genetic algorithm over the candidate rows (Kairos Fig. 11, "GENE").

    Start from ``population`` random candidates; each step picks two parents by binary
    tournament, crosses their count vectors uniformly per type, mutates each count by +-1 with
    ``mutation_rate``, and repairs the child to the nearest candidate not yet evaluated (so every
    child is affordable and maximal, and every step is one new evaluation); the child replaces
    the worst member if it is better. Stops at a row with qps >= ``target_qps``, at
    ``max_evaluations`` or when every candidate is evaluated.
    """
    points = np.asarray(counts, dtype=np.float64)
    n = points.shape[0]
    budget = _Budgeted(evaluate, target_qps, min(max_evaluations, n))
    members = [int(r) for r in rng.choice(n, size=min(population, n), replace=False)]
    for row in members:
        if budget.done:
            return budget.trace()
        budget(row)
    while not budget.done:

        def tournament() -> int:
            a, b = (int(i) for i in rng.choice(len(members), size=2, replace=len(members) < 2))
            return members[a] if budget.seen[members[a]] >= budget.seen[members[b]] else members[b]

        mother, father = points[tournament()], points[tournament()]
        child = np.where(rng.random(points.shape[1]) < 0.5, mother, father)
        child = child + np.where(
            rng.random(points.shape[1]) < mutation_rate, rng.choice([-1.0, 1.0], child.size), 0.0
        )
        nearest = _nearest_unseen(points, child, budget.seen)
        if nearest is None:
            break
        qps = budget(nearest)
        worst = min(range(len(members)), key=lambda i: budget.seen[members[i]])
        if qps > budget.seen[members[worst]]:
            members[worst] = nearest
    return budget.trace()


def _gp_posterior(
    x: NDArray[np.floating],
    y: NDArray[np.floating],
    query: NDArray[np.floating],
    length_scales: tuple[float, ...],
    noise: float,
) -> tuple[NDArray[np.floating], NDArray[np.floating]]:
    """Posterior mean and sd of a zero-mean GP with a unit RBF kernel on standardised ``y``, its
    length scale the one of ``length_scales`` with the highest marginal likelihood (Rasmussen &
    Williams 2006, Algorithm 2.1)."""
    scale = y.std() or 1.0
    z = (y - y.mean()) / scale
    d_xx = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)
    d_qx = ((query[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)
    best: tuple[float, float, NDArray[np.floating], NDArray[np.floating]] | None = None
    for ell in length_scales:
        k = np.exp(-0.5 * d_xx / ell**2) + noise * np.eye(len(x))
        chol = np.linalg.cholesky(k)
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, z))
        evidence = -0.5 * z @ alpha - np.log(np.diag(chol)).sum()
        if best is None or evidence > best[0]:
            best = (float(evidence), ell, chol, alpha)
    assert best is not None
    _, chosen_ell, best_chol, best_alpha = best
    k_q = np.exp(-0.5 * d_qx / chosen_ell**2)
    mean = k_q @ best_alpha
    v = np.linalg.solve(best_chol, k_q.T)
    sd = np.sqrt(np.maximum(1.0 - (v * v).sum(axis=0), 0.0))
    return y.mean() + scale * mean, scale * sd


def bayesian_search(
    counts: NDArray[np.integer],
    evaluate: Evaluate,
    target_qps: float,
    rng: np.random.Generator,
    max_evaluations: int,
    initial: int = 3,
    kappa: float = 2.0,
    length_scales: tuple[float, ...] = (0.15, 0.3, 0.6, 1.2),
    noise: float = 1e-3,
) -> SearchTrace:
    """Bayesian optimisation over the candidate rows (Kairos Fig. 11, Ribbon's "BO").

    Features: counts divided by each type's largest count among the candidates. After
    ``initial`` random rows, evaluate the unevaluated row of highest mean + ``kappa`` sd under a
    GP posterior (:func:`_gp_posterior`). Stops as :func:`genetic_search` does.
    """
    raw = np.asarray(counts, dtype=np.float64)
    points = raw / np.maximum(raw.max(axis=0), 1.0)
    n = points.shape[0]
    budget = _Budgeted(evaluate, target_qps, min(max_evaluations, n))
    for row in rng.choice(n, size=min(initial, n), replace=False):
        if budget.done:
            return budget.trace()
        budget(int(row))
    while not budget.done:
        rows = np.fromiter(budget.seen, dtype=np.int64)
        left = np.setdiff1d(np.arange(n), rows)
        mean, sd = _gp_posterior(
            points[rows],
            np.fromiter(budget.seen.values(), dtype=np.float64),
            points[left],
            length_scales,
            noise,
        )
        budget(int(left[int(np.argmax(mean + kappa * sd))]))
    return budget.trace()
