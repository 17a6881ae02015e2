"""Kairos+: search instance mixes in descending upper-bound order, pruning what cannot win.

Kairos section 5.3 (Algorithm 1) and KAIROS_MATH.md "Kairos+": evaluate configurations in
descending order of their throughput upper bound, keeping the best measured throughput X*. A
configuration whose bound is <= X* cannot beat it (its real throughput is below its bound), and
a sub-configuration of an evaluated one (the same or fewer instances of every type) cannot beat
the evaluated one (taking instances away does not add throughput); both are skipped. The search
stops when nothing is left. The evaluator is any function from counts to a measured throughput:
the simulator's allowable throughput here, a live measurement in production.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from estimator.errors import SimulationError


@dataclass(frozen=True, slots=True, eq=False)
class SearchResult:
    best_index: int  # row of the best configuration in the ranking given
    best_throughput_qps: float
    evaluated: tuple[int, ...]  # rows evaluated, in order
    throughput_qps: tuple[float, ...]  # their measured throughput
    pruned_by_bound: int
    pruned_as_subconfiguration: int

    @property
    def evaluations(self) -> int:
        return len(self.evaluated)


def kairos_plus(
    counts: np.ndarray,
    upper_bound_qps: np.ndarray,
    evaluate: Callable[[np.ndarray], float],
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search ``counts`` (one configuration a row) guided by ``upper_bound_qps`` (see module)."""
    counts = np.asarray(counts)
    bounds = np.asarray(upper_bound_qps, dtype=np.float64)
    if counts.ndim != 2 or bounds.shape != (counts.shape[0],) or counts.shape[0] == 0:
        raise SimulationError("Kairos+ needs one upper bound per configuration, and at least one")
    order = np.argsort(-bounds, kind="stable")
    evaluated: list[int] = []
    measured: list[float] = []
    best, best_qps = -1, -np.inf
    by_bound = by_subset = 0
    for position, row in enumerate(order):
        if bounds[row] <= best_qps:
            by_bound = order.size - position  # everything left has a bound this low or lower
            break
        if evaluated and bool(np.any(np.all(counts[row] <= counts[evaluated], axis=1))):
            by_subset += 1
            continue
        qps = float(evaluate(counts[row]))
        evaluated.append(int(row))
        measured.append(qps)
        if progress is not None:
            progress(f"  evaluated {counts[row].tolist()}: {qps:.2f} qps (bound {bounds[row]:.2f})")
        if qps > best_qps:
            best, best_qps = int(row), qps
    return SearchResult(best, best_qps, tuple(evaluated), tuple(measured), by_bound, by_subset)
