"""Which cascade of a Pareto front to serve: the cheapest within a tolerance of the best model,
chosen on one split of the validation records and scored on the other.

The rule ``heteroplane cascade evaluate`` calls "best" and the demo serves: among the points of
the accuracy / compute Pareto front (``estimator.cascades.pareto_cascades``), the one of least
compute per query whose accuracy is at least the most accurate single model's minus
:data:`ACCURACY_TOLERANCE` (half a point: the cascade may answer a few validation samples
differently from the best model without being worse in any way a test split could show).

The held-out protocol (docs/cascades.md, "The held-out protocol"): :func:`choose_held_out` splits
the records (``ValidationRecords.split``, label-stratified, half and half by default), builds the
front, finds the most accurate model and applies the rule on the *choose* split only, then scores
the chosen cascade (and every point of the front, and every model) on the *score* split. The
in-sample accuracy is the choose split's; the held-out accuracy is the one to report, since the
thresholds were fitted to the very samples the in-sample figure counts.

>>> best_point([], top_accuracy=0.9) is None
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from estimator.cascades import (
    DEFAULT_CHOOSE_SHARE,
    DEFAULT_SPLIT_SEED,
    DEFAULT_THRESHOLD_GRID,
    Cascade,
    CascadePoint,
    ValidationRecords,
    evaluate,
    pareto_cascades,
)

__all__ = ["ACCURACY_TOLERANCE", "HeldOutChoice", "best_point", "choose_held_out"]

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


@dataclass(frozen=True, slots=True, eq=False)
class HeldOutChoice:
    """A cascade chosen on the *choose* split and scored on the *score* split.

    ``front`` and its qualities, ``top_model`` (the most accurate single model, the cheaper of
    equals) and ``best`` (:func:`best_point`) are the choose split's; :meth:`held_out_accuracy`
    scores any cascade on the score split."""

    choose: ValidationRecords
    score: ValidationRecords
    share: float
    seed: int
    front: tuple[CascadePoint, ...]
    top_model: str
    best: CascadePoint | None

    def held_out_accuracy(self, cascade: Cascade) -> float:
        """The accuracy of ``cascade`` on the score split (the samples the choice never saw)."""
        return evaluate(cascade, self.score).accuracy

    def model_accuracy(self, model: str) -> tuple[float, float]:
        """(in-sample, held-out) accuracy of ``model`` alone."""
        return self.choose.model_accuracy(model), self.score.model_accuracy(model)


def choose_held_out(
    records: ValidationRecords,
    compute_ms: Mapping[str, float],
    *,
    models: Sequence[str] | None = None,
    grid: Sequence[float] = DEFAULT_THRESHOLD_GRID,
    max_length: int | None = None,
    tolerance: float = ACCURACY_TOLERANCE,
    share: float = DEFAULT_CHOOSE_SHARE,
    seed: int = DEFAULT_SPLIT_SEED,
) -> HeldOutChoice:
    """Split ``records`` (``share`` of the samples to choose on, ``seed``), then on the choose
    split: the Pareto front of cascades of ``models`` (default: all, in the records' order), the
    most accurate model alone and the best point within ``tolerance`` of it.

    Raises:
        CascadeError: a bad share, an unknown model, a model without compute.
    """
    choose, score = records.split(share, seed)
    names = list(records.models if models is None else models)
    front = pareto_cascades(choose, compute_ms, models=names, grid=grid, max_length=max_length)
    top = max(names, key=lambda m: (choose.model_accuracy(m), -float(compute_ms[m])))
    best = best_point(front, choose.model_accuracy(top), tolerance)
    return HeldOutChoice(choose, score, float(share), int(seed), front, top, best)
