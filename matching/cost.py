"""Kairos' cost matrix: what it costs, in base-instance time, to serve queued query i on instance j.

Kairos (HPDC'23) section 5.1 distributes the queued queries over the instances by a min-cost
bipartite matching. Its objective (Eq. 2) is the fleet's resource usage, each instance's time
weighted by how much that instance is worth; its QoS constraint (Eq. 5) is folded into the matrix
as penalties (Eq. 8). In our notation (shared/KAIROS_MATH.md, "Query distribution"):

- r_j >= 0: instance j's remaining busy time; l_ij: query i's predicted (mean) latency on j's
  type; l~_ij >= 0: its predicted *tail* latency there (e.g. the p99; l~ = l when none is given);
- w_i: how long query i has waited; t_i = max(0, QoS - w_i): what is left of its latency budget;
- h_j = L_base(b_max) / L_type(j)(b_max): the heterogeneity coefficient (base type = 1, slower
  types < 1: "one second of GPU is not equivalent to one second of CPU");
- usage u_ij = h_j (r_j + l_ij): the weighted time query i would hold instance j, counted from now;
- *miss*: t_i > 0 and t_i - (r_j + l~_ij) < 0 (the query would finish after its QoS target);
- *margin*: t_i > 0, not a miss, and t_i - (r_j + l~_ij) < (1 - s) QoS with s = 0.98: it would
  finish within the last 2% of the target (Kairos' "noise safeguard": "we replace QoS with
  0.98 QoS", i.e. w_i + r_j + l~_ij > 0.98 QoS);
- cost_ij = u_ij + P_miss [miss] + P_margin [margin].

Kairos judges both from the mean (l~ = l). QoS is a P99 target, so the Kairos policy passes a tail
prediction for the checks and keeps the mean for the usage, which is what Eq. 2 sums
(docs/matching.md, "Tail-aware feasibility").

A query already past its target (t_i = 0) carries no penalty: every instance is equally late for
it, and the usage alone decides (the authors' code does the same).

**The penalties.** The authors use the constants 1000 and 500 (ms), which dominate the usage of
their rm2 setting but not every setting. Here they scale with the matrix so that they provably
dominate: with k = min(#rows, #columns) (every complete assignment matches exactly k pairs) and
U = max_ij u_ij,

    P_margin = k U + 1,    P_miss = k (U + P_margin) + 1    (ms).

Then any assignment with fewer misses costs strictly less than one with more, whatever their
margins and usages (the difference is at least P_miss - k U - k P_margin = 1), and with as many
misses, fewer margins win (the difference is at least P_margin - k U = 1). So the optimal
assignment minimises, in order: the number of QoS misses, the number of pairs inside the safety
margin, and the total usage (Eq. 2). The unit slack survives floating-point rounding while the
summed costs (about k^2 U) stay below ~1e12 ms.

:func:`build_cost_matrix` is the reference (vectorised numpy); :func:`costs_kernel` computes the
same numbers, bit for bit, in compiled code for the Kairos policy's rounds (tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numpy.typing import ArrayLike

from matching.errors import InvalidCostMatrixError

SAFETY = 0.98  # Kairos section 5.1: a predicted finish beyond 0.98 QoS counts as a violation
PENALTY_SLACK_MS = 1.0  # the strict gap the penalties keep over any usage difference


@dataclass(frozen=True, slots=True, eq=False)
class CostMatrix:
    """A round's costs and how they were made (the flags say which pairs are penalised)."""

    costs: np.ndarray  # (m, n): usage plus penalties, what the assignment minimises
    usage_ms: np.ndarray  # (m, n): h_j (r_j + l_ij)
    miss: np.ndarray  # (m, n) bool: the pair would miss QoS
    margin: np.ndarray  # (m, n) bool: the pair would finish inside the safety margin
    miss_penalty_ms: float
    margin_penalty_ms: float


def heterogeneity_coefficients(
    latency_at_max_ms: ArrayLike, base_latency_at_max_ms: float
) -> np.ndarray:
    """h_j = L_base(b_max) / L_j(b_max) (Kairos section 5.1, Definition 1).

    ``latency_at_max_ms``: each instance's (or type's) latency at the largest batch size b_max;
    the base type gets 1 and a type k times slower gets 1/k.

    >>> heterogeneity_coefficients([100.0, 200.0, 500.0], 100.0).tolist()
    [1.0, 0.5, 0.2]
    """
    latency = np.asarray(latency_at_max_ms, dtype=np.float64)
    if not (np.all(np.isfinite(latency)) and np.all(latency > 0)):
        raise InvalidCostMatrixError("latencies at b_max must be finite and > 0")
    if not (np.isfinite(base_latency_at_max_ms) and base_latency_at_max_ms > 0):
        raise InvalidCostMatrixError("the base latency at b_max must be finite and > 0")
    coefficients: np.ndarray = base_latency_at_max_ms / latency
    return coefficients


def penalties_ms(max_usage_ms: float, pairs: int) -> tuple[float, float]:
    """(P_miss, P_margin) for a matrix whose largest usage is ``max_usage_ms`` and whose
    assignments match ``pairs`` = min(#rows, #columns) pairs (see the module docstring)."""
    margin = pairs * max_usage_ms + PENALTY_SLACK_MS
    miss = pairs * (max_usage_ms + margin) + PENALTY_SLACK_MS
    return miss, margin


def build_cost_matrix(
    latency_ms: ArrayLike,
    remaining_ms: ArrayLike,
    heterogeneity: ArrayLike,
    waited_ms: ArrayLike,
    qos_ms: float,
    *,
    tail_ms: ArrayLike | None = None,
    safety: float = SAFETY,
) -> CostMatrix:
    """Kairos' penalised cost matrix (Eqs. 2, 5 and 8; the math is in the module docstring).

    ``latency_ms`` (m, n): l_ij; ``remaining_ms`` (n,): r_j; ``heterogeneity`` (n,): h_j;
    ``waited_ms`` (m,): w_i; ``tail_ms`` (m, n): l~_ij for the miss and margin checks (default:
    ``latency_ms``, Kairos' own checks); all finite, latencies and remaining times >= 0, h_j > 0.

    >>> m = build_cost_matrix(
    ...     latency_ms=[[100.0, 150.0], [300.0, 450.0]],
    ...     remaining_ms=[0.0, 0.0],
    ...     heterogeneity=[1.0, 0.5],
    ...     waited_ms=[0.0, 0.0],
    ...     qos_ms=350.0,
    ... )
    >>> m.usage_ms.tolist()
    [[100.0, 75.0], [300.0, 225.0]]
    >>> m.miss.tolist(), m.margin_penalty_ms, m.miss_penalty_ms
    ([[False, False], [False, True]], 601.0, 1803.0)

    With a tail 20% above the mean (the p99, say), query 1 misses on instance 0 too (360 ms >
    350 ms), while query 0 still fits everywhere; the usage stays the mean's:

    >>> build_cost_matrix(
    ...     [[100.0, 150.0], [300.0, 450.0]], [0.0, 0.0], [1.0, 0.5], [0.0, 0.0], 350.0,
    ...     tail_ms=[[120.0, 180.0], [360.0, 540.0]],
    ... ).miss.tolist()
    [[False, False], [True, True]]
    """
    latency = np.asarray(latency_ms, dtype=np.float64)
    tail = latency if tail_ms is None else np.asarray(tail_ms, dtype=np.float64)
    remaining = np.asarray(remaining_ms, dtype=np.float64)
    h = np.asarray(heterogeneity, dtype=np.float64)
    waited = np.asarray(waited_ms, dtype=np.float64)
    _check_inputs(latency, tail, remaining, h, waited, qos_ms, safety)

    usage = h[None, :] * (remaining[None, :] + latency)
    budget = np.maximum(qos_ms - waited, 0.0)  # t_i
    slack = budget[:, None] - (remaining[None, :] + tail)
    at_stake = (budget > 0.0)[:, None]
    miss = at_stake & (slack < 0.0)
    margin = at_stake & ~miss & (slack < qos_ms - safety * qos_ms)
    pairs = min(latency.shape)
    max_usage = float(usage.max()) if usage.size else 0.0
    miss_penalty, margin_penalty = penalties_ms(max_usage, pairs)
    costs = usage + np.where(miss, miss_penalty, np.where(margin, margin_penalty, 0.0))
    return CostMatrix(costs, usage, miss, margin, miss_penalty, margin_penalty)


def _check_inputs(
    latency: np.ndarray,
    tail: np.ndarray,
    remaining: np.ndarray,
    h: np.ndarray,
    waited: np.ndarray,
    qos_ms: float,
    safety: float,
) -> None:
    if latency.ndim != 2:
        raise InvalidCostMatrixError(
            f"latency_ms must be 2-D (queries x instances), got {latency.ndim}-D"
        )
    m, n = latency.shape
    if remaining.shape != (n,) or h.shape != (n,) or waited.shape != (m,):
        raise InvalidCostMatrixError(
            f"shapes disagree: latency {latency.shape}, remaining {remaining.shape},"
            f" heterogeneity {h.shape}, waited {waited.shape}"
        )
    if tail.shape != latency.shape:
        raise InvalidCostMatrixError(f"shapes disagree: tail {tail.shape}, latency {latency.shape}")
    for name, values in (
        ("latency_ms", latency),
        ("tail_ms", tail),
        ("remaining_ms", remaining),
    ):
        if not (np.all(np.isfinite(values)) and np.all(values >= 0)):
            raise InvalidCostMatrixError(f"{name} must be finite and >= 0")
    if not (np.all(np.isfinite(h)) and np.all(h > 0)):
        raise InvalidCostMatrixError("heterogeneity coefficients must be finite and > 0")
    if not np.all(np.isfinite(waited)):
        raise InvalidCostMatrixError("waited_ms must be finite")
    if not (np.isfinite(qos_ms) and qos_ms > 0):
        raise InvalidCostMatrixError(f"qos_ms must be finite and > 0, got {qos_ms!r}")
    if not 0 < safety <= 1:
        raise InvalidCostMatrixError(f"safety must be in (0, 1], got {safety!r}")


@numba.njit(cache=True)
def costs_kernel(
    latency_by_type_ms: np.ndarray,
    tail_by_type_ms: np.ndarray,
    column_type: np.ndarray,
    remaining_ms: np.ndarray,
    heterogeneity: np.ndarray,
    waited_ms: np.ndarray,
    qos_ms: float,
    safety: float,
) -> np.ndarray:
    """:func:`build_cost_matrix` in compiled code, bit for bit, with l_ij and l~_ij given per
    type: ``latency_by_type_ms[i, column_type[j]]`` and ``tail_by_type_ms[i, column_type[j]]``
    (pass the same array twice for Kairos' mean checks). No validation: the caller's inputs are
    trusted."""
    m = waited_ms.size
    n = column_type.size
    usage = np.empty((m, n))
    max_usage = 0.0
    for i in range(m):
        for j in range(n):
            u = heterogeneity[j] * (remaining_ms[j] + latency_by_type_ms[i, column_type[j]])
            usage[i, j] = u
            max_usage = max(max_usage, u)
    pairs = min(m, n)
    margin_penalty = pairs * max_usage + PENALTY_SLACK_MS
    miss_penalty = pairs * (max_usage + margin_penalty) + PENALTY_SLACK_MS
    margin_ms = qos_ms - safety * qos_ms
    for i in range(m):
        budget = max(qos_ms - waited_ms[i], 0.0)
        if budget > 0.0:
            for j in range(n):
                slack = budget - (remaining_ms[j] + tail_by_type_ms[i, column_type[j]])
                if slack < 0.0:
                    usage[i, j] += miss_penalty
                elif slack < margin_ms:
                    usage[i, j] += margin_penalty
    return usage
