"""Which cascade of a Pareto front to serve: the cheapest within a tolerance of the best model.

The rule ``heteroplane cascade evaluate`` calls "best" and the demo serves: among the points of
the accuracy / compute Pareto front (``estimator.cascades.pareto_cascades``), the one of least
compute per query whose accuracy is at least the most accurate single model's minus
:data:`ACCURACY_TOLERANCE` (half a point: the cascade may answer a few validation samples
differently from the best model without being worse in any way a test split could show).

>>> best_point([], top_accuracy=0.9) is None
True
"""

from __future__ import annotations

from collections.abc import Sequence

from estimator.cascades import CascadePoint

__all__ = ["ACCURACY_TOLERANCE", "best_point"]

ACCURACY_TOLERANCE = 0.005
# Accuracies are means of the same 0/1 flags: a hair of slack keeps equal means equal.
_EPSILON = 1e-12


def best_point(
    front: Sequence[CascadePoint],
    top_accuracy: float,
    tolerance: float = ACCURACY_TOLERANCE,
) -> CascadePoint | None:
    """The point of ``front`` of least compute per query among those whose accuracy is at least
    ``top_accuracy - tolerance``; ``None`` when no point is that accurate."""
    floor = top_accuracy - tolerance - _EPSILON
    eligible = [p for p in front if p.quality.accuracy >= floor]
    return min(eligible, key=lambda p: p.compute_ms_per_query) if eligible else None
