"""Kairos throughput upper bounds: which heterogeneous fleets are worth buying under a budget.

This module owns the Kairos resource allocator (Kairos, HPDC'23, section 5.2 "throughput upper
bound" and "similarity"; the equations are restated in ``shared/KAIROS_MATH.md``):

- :func:`kairos_quantities`: the offline quantities of one model (Q_G; per auxiliary type b_a,
  s_a, tau_a, Q_a(beta)) from latency profiles, a batch-size mix and a QoS target;
- :func:`upper_bounds`: the bound of many configurations at once (a closed form, vectorised);
- :func:`rank_configurations`: every affordable configuration ranked by its bound (or the exact
  top K by branch and bound when the space is too large to list);
- :func:`similarity_pick` (the paper's pick without online evaluation) and
  :func:`best_homogeneous` (the single-type fleet to compare with).

In the paper's form (one base type G, auxiliaries a, b* = max b_a over the auxiliaries present)
the bound of KAIROS_MATH.md steps 1-8 is, after a little algebra, the optimum of a fluid linear
program (small queries b <= b* may go to auxiliaries, large ones only to the base)::

    UB = min( n_G Q_G / (1 - tau*),  n_G Q_G + (tau* / s*) sum_a n_a Q_a(b*) )

(the first term is step 7, "the base is the bottleneck"; the second is step 8). Generalisations
(any number of types, several full-range types, the threshold chosen per configuration so that
the bound is monotone in every count) are stated on :func:`upper_bounds` and argued in
``docs/kairos-bounds.md``. Everything here is pure: numpy, no I/O, no clock, no randomness.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from estimator import deadline
from estimator.errors import (
    BatchSizeOutOfRangeError,
    BudgetError,
    FleetError,
    InfeasibleQoSError,
    SearchSpaceError,
    UnknownInstanceTypeError,
    WorkloadError,
)
from estimator.numbers import plain
from estimator.profiles import ProfileSet

__all__ = [
    "KairosQuantities",
    "QosStatistic",
    "Ranking",
    "SearchMethod",
    "ThresholdRule",
    "TypeQuantities",
    "best_homogeneous",
    "kairos_quantities",
    "rank_configurations",
    "similarity_pick",
    "upper_bounds",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

QosStatistic = Literal["median", "mean"]
"""Which latency of a (type, batch size) cell is compared with QoS to find b_a and the base.
``median`` reproduces every b_a of the authors' ``allocator_profile.json``; ``mean`` is what
KAIROS_MATH.md says (they differ for 4 of the 15 (model, type) pairs of the paper)."""

ThresholdRule = Literal["best", "widest"]
"""``widest``: the paper's b* = max b_a over the auxiliary types present (not monotone in the
counts); ``best``: the largest bound over the b_a of the types present (monotone; the default)."""

SearchMethod = Literal["auto", "exhaustive", "bound"]

SIMILARITY_TOP = 10  # the paper's pick looks at the top-10 configurations ...
SIMILARITY_AGREE = 3  # ... unless the top-3 agree on the number of base instances

# Ranking ties: bounds equal to 1e-6 qps are equal (then cheaper first, then lexicographic).
_UB_DECIMALS = 6
_COST_DECIMALS = 9
# A box of counts up to this size is listed in full by rank_configurations(method="auto").
_EXHAUSTIVE_BOX = 1 << 22
# Rows of partial configurations expanded at once by the search.
_CHUNK_ROWS = 1 << 16
_HUGE_QPS = 1e300
# Multipliers of the Lagrangian bound max min(X, Y) <= max (lam X + (1 - lam) Y).
_LAMBDAS = (0.0, 0.25, 0.5, 0.75, 1.0)


# ---------------------------------------------------------------------------------------------
# Offline quantities
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TypeQuantities:
    """The Kairos quantities of one candidate instance type for one model, mix and QoS.

    - ``throughput_qps``: Q_t = 1000 / sum_b p(b) L_t(b), one instance's rate on the whole mix
      (``inf`` if every latency is zero). For the base type this is Q_G.
    - ``full_range``: the type meets QoS at every batch size of the mix (it can serve alone).
    - ``violation_batch``: b_a, the smallest batch size of the mix at which the type misses QoS
      (``None`` for a full-range type).
    - ``small_share``: s_a = sum_{b <= b_a} p(b) (1 for a full-range type).
    - ``time_share``: tau_a = sum_{b <= b_a} p(b) L_G(b) / sum_b p(b) L_G(b) (1 when full-range).
    - ``aux_rate_qps``: Q_a(beta) = 1000 / E[L_a(b) | b <= beta] for each threshold beta of the
      model's :attr:`KairosQuantities.thresholds` (auxiliary types only; a missing beta counts as
      a rate of 0).
    - ``base_equivalents``: for a full-range type, kappa_t(beta) = max(S_G / S_t, T_G / T_t) for
      each threshold beta, with S_t = sum_{b <= beta} p L_t and T_t = sum_{b > beta} p L_t: how
      many base instances one instance of t is worth, on its better side of the threshold (1 for
      the base type itself). Empty for auxiliary types.
    """

    instance_type: str
    price_usd_per_hr: float
    throughput_qps: float
    full_range: bool
    violation_batch: int | None
    small_share: float
    time_share: float
    aux_rate_qps: Mapping[int, float]
    base_equivalents: Mapping[int, float]

    def __post_init__(self) -> None:
        where = f"quantities of {self.instance_type!r}"
        if not math.isfinite(self.price_usd_per_hr) or self.price_usd_per_hr < 0:
            raise ValueError(f"{where}: price must be finite and >= 0")
        if not self.throughput_qps >= 0:
            raise ValueError(f"{where}: throughput must be >= 0")
        if self.full_range != (self.violation_batch is None):
            raise ValueError(f"{where}: a full-range type has no violation batch, and vice versa")
        if not (0 < self.small_share <= 1 and 0 <= self.time_share <= 1):
            raise ValueError(f"{where}: shares must lie in (0, 1]")
        if any(not v >= 0 for v in (*self.aux_rate_qps.values(), *self.base_equivalents.values())):
            raise ValueError(f"{where}: rates and base equivalents must be >= 0")
        if self.full_range and self.aux_rate_qps:
            raise ValueError(f"{where}: a full-range type has no auxiliary rates")
        if not self.full_range and self.base_equivalents:
            raise ValueError(f"{where}: an auxiliary type has no base equivalents")


@dataclass(frozen=True, slots=True)
class KairosQuantities:
    """Everything the bound of a model needs (KAIROS_MATH.md, "Offline quantities").

    ``types`` are the usable candidate types in column order (the order of the count vectors);
    ``excluded`` the candidates that meet QoS at no batch size (useless, left out). ``thresholds``
    are the distinct b_a of the auxiliary types, ascending; ``small_share_at[beta]`` = s(beta) and
    ``time_share_at[beta]`` = tau(beta) are the shares of queries and of base busy time at
    b <= beta.
    """

    model: str
    qos_ms: float
    base_type: str
    types: tuple[TypeQuantities, ...]
    excluded: tuple[str, ...]
    thresholds: tuple[int, ...]
    small_share_at: Mapping[int, float]
    time_share_at: Mapping[int, float]
    qos_statistic: QosStatistic = "median"

    def __post_init__(self) -> None:
        names = self.type_names
        if len(set(names)) != len(names) or not names:
            raise ValueError("KairosQuantities needs distinct, non-empty types")
        if self.base_type not in names or not self.types[names.index(self.base_type)].full_range:
            raise ValueError(f"the base type {self.base_type!r} must be a full-range type")
        if list(self.thresholds) != sorted(set(self.thresholds)):
            raise ValueError("thresholds must be distinct and ascending")
        for t in self.types:
            if t.violation_batch is not None and t.violation_batch not in self.thresholds:
                raise ValueError(f"b_a of {t.instance_type!r} is not among the thresholds")
            if t.full_range and set(t.base_equivalents) != set(self.thresholds):
                raise ValueError(f"base equivalents of {t.instance_type!r} miss a threshold")
        for beta in self.thresholds:
            if beta not in self.small_share_at or beta not in self.time_share_at:
                raise ValueError(f"shares at threshold {beta} are missing")

    @property
    def type_names(self) -> tuple[str, ...]:
        """The usable types, in column order."""
        return tuple(t.instance_type for t in self.types)

    @property
    def prices_usd_per_hr(self) -> FloatArray:
        return np.array([t.price_usd_per_hr for t in self.types], dtype=np.float64)

    @property
    def base_rate_qps(self) -> float:
        """Q_G, the base type's rate on the whole mix."""
        return self[self.base_type].throughput_qps

    def __getitem__(self, instance_type: str) -> TypeQuantities:
        for t in self.types:
            if t.instance_type == instance_type:
                return t
        raise UnknownInstanceTypeError(instance_type, list(self.type_names), "usable types")


def kairos_quantities(
    profiles: ProfileSet,
    model: str,
    instance_types: Sequence[str],
    prices_usd_per_hr: Mapping[str, float],
    qos_ms: float,
    batch_pmf: tuple[ArrayLike, ArrayLike],
    *,
    qos_statistic: QosStatistic = "median",
) -> KairosQuantities:
    """The offline quantities of ``model`` on ``instance_types`` (KAIROS_MATH.md; paper 5.2).

    With p(b) the mix (``batch_pmf`` = (sizes, probabilities)), L_t(b) the mean latency of type t
    at b (linear between measured sizes) and M_t(b) the latency compared with QoS (the median by
    default, see :data:`QosStatistic`):

    - Q_t = 1000 / sum_b p(b) L_t(b) for every type;
    - a type is *full-range* when M_t(b) <= QoS for every b of the mix; the *base* G is the
      full-range type with the largest Q_t / P_t (ties: cheaper, then by name);
    - every other type a is *auxiliary*, with b_a = min{b : M_a(b) > QoS},
      s_a = sum_{b <= b_a} p(b), tau_a = sum_{b <= b_a} p(b) L_G(b) / sum_b p(b) L_G(b) and
      Q_a(beta) = 1000 sum_{b <= beta} p(b) / sum_{b <= beta} p(b) L_a(b) at every threshold
      beta in {b_a}. The sums include b = b_a itself: that is the authors' convention (it
      reproduces their s_a to 0.4% where excluding b_a is 0.5-1% low);
    - a type that misses QoS at the smallest batch size of the mix is excluded.

    Raises:
        BatchSizeOutOfRangeError: a batch size of the mix outside a type's profile (names both).
        InfeasibleQoSError: no type meets QoS at every batch size.
        UnknownInstanceTypeError: a type without a price; MissingProfileError: without a profile.
    """
    if not (isinstance(qos_ms, int | float) and math.isfinite(qos_ms) and qos_ms > 0):
        raise WorkloadError(f"QoS must be a finite number of ms > 0, got {qos_ms!r}")
    if qos_statistic not in ("median", "mean"):
        raise ValueError(f"qos_statistic must be 'median' or 'mean', got {qos_statistic!r}")
    sizes, p = _checked_pmf(batch_pmf)
    names = list(instance_types)
    if not names:
        raise WorkloadError("no candidate instance types")
    if len(set(names)) != len(names):
        raise WorkloadError(f"candidate instance types repeat: {', '.join(names)}")

    mean_ms: dict[str, FloatArray] = {}
    within: dict[str, NDArray[np.bool_]] = {}
    prices: dict[str, float] = {}
    for name in names:
        if name not in prices_usd_per_hr:
            raise UnknownInstanceTypeError(name, list(prices_usd_per_hr), "price list")
        prices[name] = float(prices_usd_per_hr[name])
        profile = profiles.get_profile(model, name)
        outside = (sizes < profile.min_batch_size) | (sizes > profile.max_batch_size)
        if outside.any():
            raise BatchSizeOutOfRangeError(
                model,
                name,
                int(sizes[np.argmax(outside)]),
                profile.min_batch_size,
                profile.max_batch_size,
            )
        mean_ms[name] = np.interp(sizes, profile.batch_sizes, profile.mean_ms)
        if qos_statistic == "mean":
            compared = mean_ms[name]
        else:
            medians = np.array([np.median(cell) for cell in profile.samples_ms])
            compared = np.interp(sizes, profile.batch_sizes, medians)
        within[name] = compared <= qos_ms

    full = [name for name in names if within[name].all()]
    if not full:
        reach = {
            name: (int(sizes[np.argmin(within[name]) - 1]) if within[name][0] else None)
            for name in names
        }
        raise InfeasibleQoSError(model, float(qos_ms), reach)
    excluded = tuple(name for name in names if not within[name][0])
    usable = [name for name in names if name not in excluded]

    total_ms = {name: float(np.dot(p, mean_ms[name])) for name in usable}
    rate_qps = {name: _ratio(1000.0, total_ms[name]) for name in usable}
    base = min(full, key=lambda n: (-_ratio(rate_qps[n], prices[n]), prices[n], n))
    violation = {name: int(sizes[np.argmin(within[name])]) for name in usable if name not in full}
    thresholds = tuple(sorted(set(violation.values())))
    at = np.searchsorted(sizes, thresholds)
    # Sums over b <= beta and over b > beta, each accumulated on its own side so that an empty
    # side is exactly 0 (a difference of totals leaves rounding residue, and 0 / residue = inf).
    head_p, tail_p = _split_sums(p)
    head_ms, tail_ms = {}, {}
    for name in usable:
        head_ms[name], tail_ms[name] = _split_sums(p * mean_ms[name])

    def small_ms(name: str, i: int) -> float:
        return float(head_ms[name][i])

    def large_ms(name: str, i: int) -> float:
        return float(tail_ms[name][i])

    small_share = {
        beta: float(head_p[i] / (head_p[i] + tail_p[i]))
        for beta, i in zip(thresholds, at, strict=True)
    }
    # With a zero-latency base every share of its time is 0/0: take the share of queries.
    time_share = {
        beta: _ratio(small_ms(base, i), small_ms(base, i) + large_ms(base, i))
        if total_ms[base] > 0
        else share
        for (beta, share), i in zip(small_share.items(), at, strict=True)
    }
    types = []
    for name in usable:
        if name in full:
            equivalents = {
                beta: 1.0
                if name == base
                else max(
                    _ratio(small_ms(base, i), small_ms(name, i)),
                    _ratio(large_ms(base, i), large_ms(name, i)),
                )
                for beta, i in zip(thresholds, at, strict=True)
            }
            types.append(
                TypeQuantities(
                    name, prices[name], rate_qps[name], True, None, 1.0, 1.0, {}, equivalents
                )
            )
            continue
        b_a = violation[name]
        rates = {
            beta: _ratio(1000.0 * small_share[beta], small_ms(name, i))
            for beta, i in zip(thresholds, at, strict=True)
        }
        types.append(
            TypeQuantities(
                name,
                prices[name],
                rate_qps[name],
                False,
                b_a,
                small_share[b_a],
                time_share[b_a],
                rates,
                {},
            )
        )
    return KairosQuantities(
        model=model,
        qos_ms=float(qos_ms),
        base_type=base,
        types=tuple(types),
        excluded=excluded,
        thresholds=thresholds,
        small_share_at=small_share,
        time_share_at=time_share,
        qos_statistic=qos_statistic,
    )


def _split_sums(values: FloatArray) -> tuple[FloatArray, FloatArray]:
    """For each index i: (sum of values[: i + 1], sum of values[i + 1 :])."""
    head = np.cumsum(values)
    tail = np.zeros_like(head)
    tail[:-1] = np.cumsum(values[::-1])[::-1][1:]
    return head, tail


def _ratio(num: float, den: float) -> float:
    """num / den with x / 0 = inf for x > 0 and 0 / 0 = 0 (a class with no work is no help)."""
    if den > 0:
        return num / den
    return math.inf if num > 0 else 0.0


def _checked_pmf(batch_pmf: tuple[ArrayLike, ArrayLike]) -> tuple[IntArray, FloatArray]:
    try:
        raw_sizes, raw_p = batch_pmf
        sizes_f = np.asarray(raw_sizes, dtype=np.float64).ravel()
        p = np.asarray(raw_p, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise WorkloadError("a batch-size pmf is a pair (sizes, probabilities)") from None
    if sizes_f.size == 0 or sizes_f.size != p.size:
        raise WorkloadError("a batch-size pmf needs as many probabilities as sizes, at least one")
    whole = np.all(np.isfinite(sizes_f)) and np.all(sizes_f == np.round(sizes_f))
    if not whole or sizes_f.min() < 1:
        raise WorkloadError("batch sizes of a pmf must be whole numbers >= 1")
    if not np.all(np.isfinite(p)) or p.min() < 0 or abs(p.sum() - 1.0) > 1e-6:
        raise WorkloadError(f"pmf probabilities must be >= 0 and sum to 1 (sum {p.sum():.9g})")
    sizes = sizes_f.astype(np.int64)
    order = np.argsort(sizes, kind="stable")
    sizes, p = sizes[order], p[order]
    if np.any(np.diff(sizes) == 0):
        raise WorkloadError("a batch size appears twice in the pmf")
    keep = p > 0
    return sizes[keep], p[keep] / p[keep].sum()


# ---------------------------------------------------------------------------------------------
# The bound
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Tables:
    """The bound's coefficients: every term is a count vector times a column."""

    prices: FloatArray  # (k,)
    mix_qps: FloatArray  # (k,) Q_t for full-range types, 0 for auxiliaries
    full: NDArray[np.bool_]  # (k,)
    pool_qps: FloatArray  # (k, J) kappa_t(beta_j) Q_G for full-range types, else 0
    aux_qps: FloatArray  # (k, J) Q_a(beta_j) tau_j / s_j for auxiliaries, else 0
    member: FloatArray  # (k, J) 1 where b_a == beta_j
    alpha: FloatArray  # (J,) 1 / (1 - tau_j), inf when tau_j == 1
    # (k, 2J): [pool, pool + aux], so that one product gives N and N + A.
    both_qps: FloatArray
    # The thresholds as groups of columns: ``members[j]`` are the types with b_a == beta_j.
    members: tuple[tuple[int, ...], ...]


def _tables(q: KairosQuantities) -> _Tables:
    k, J = len(q.types), len(q.thresholds)
    base_qps = q.base_rate_qps
    mix = np.zeros(k)
    full = np.zeros(k, dtype=bool)
    pool = np.zeros((k, J))
    aux = np.zeros((k, J))
    member = np.zeros((k, J))
    for i, t in enumerate(q.types):
        if t.full_range:
            full[i] = True
            mix[i] = t.throughput_qps
            for j, beta in enumerate(q.thresholds):
                pool[i, j] = t.base_equivalents[beta] * base_qps
        else:
            for j, beta in enumerate(q.thresholds):
                share = q.time_share_at[beta] / q.small_share_at[beta]
                aux[i, j] = t.aux_rate_qps.get(beta, 0.0) * share
                member[i, j] = float(t.violation_batch == beta)
    tau = np.array([q.time_share_at[beta] for beta in q.thresholds], dtype=np.float64)
    with np.errstate(divide="ignore"):
        alpha = np.where(tau < 1.0, 1.0 / (1.0 - np.minimum(tau, 1.0)), np.inf)
    # A zero-latency type has an infinite rate; a huge finite one keeps 0 instances at 0 qps.
    mix, pool, aux = (np.minimum(x, _HUGE_QPS) for x in (mix, pool, aux))
    members = tuple(tuple(int(i) for i in np.flatnonzero(member[:, j])) for j in range(J))
    both = np.hstack([pool, pool + aux])
    return _Tables(q.prices_usd_per_hr, mix, full, pool, aux, member, alpha, both, members)


def upper_bounds(
    q: KairosQuantities, counts: ArrayLike, *, rule: ThresholdRule = "best"
) -> FloatArray:
    """The Kairos throughput upper bound (qps) of each configuration in ``counts``.

    ``counts`` has shape (..., k): instance counts in the column order of ``q.types``; the result
    has shape (...). The budget is not checked here (see :func:`rank_configurations`).

    Math (KAIROS_MATH.md steps 1-8, Kairos section 5.2, generalised). For a threshold beta with
    s = s(beta), tau = tau(beta):

    - the *pool* N(beta) = Q_G sum_f n_f kappa_f(beta) over full-range types f (kappa_G = 1: with
      the base alone, N = n_G Q_G as in the paper);
    - the *auxiliary term* A(beta) = (tau / s) sum_a n_a Q_a(beta) (the paper's Q_aux tau / s);
    - UB(beta) = min(N / (1 - tau), N + A): the base-bottleneck case (step 7) and the
      auxiliary-bottleneck case (step 8), in one expression.

    The bound is max(sum_f n_f Q_f, max over the thresholds beta in the active set of UB(beta)),
    and 0 when no full-range instance is present (step 1). The active set is
    {b_a : n_a > 0} with ``rule="best"`` (the default: UB is then non-decreasing in every count),
    or only its largest element with ``rule="widest"`` (the paper's b* = max b_a exactly).

    >>> import numpy as np
    >>> base = TypeQuantities("gpu", 1.0, 10.0, True, None, 1.0, 1.0, {}, {100: 1.0})
    >>> cpu = TypeQuantities("cpu", 0.2, 5.0, False, 100, 0.8, 0.5, {100: 4.0}, {})
    >>> q = KairosQuantities("m", 50.0, "gpu", (base, cpu), (), (100,), {100: 0.8}, {100: 0.5})
    >>> upper_bounds(q, np.array([[1, 0], [1, 1], [1, 10], [0, 3]])).round(3).tolist()
    [10.0, 12.5, 20.0, 0.0]
    """
    array = np.asarray(counts)
    k = len(q.types)
    if array.ndim == 0 or array.shape[-1] != k:
        raise ValueError(f"counts must have shape (..., {k}), got {array.shape}")
    if array.dtype.kind not in "iu":
        if array.dtype.kind != "f" or not np.all(array == np.round(array)):
            raise ValueError("counts must be whole numbers")
        array = array.astype(np.int64)
    if array.size and array.min() < 0:
        raise ValueError("counts must be >= 0")
    if rule not in ("best", "widest"):
        raise ValueError(f"rule must be 'best' or 'widest', got {rule!r}")
    flat = array.reshape(-1, k)
    return _bounds(_tables(q), flat, rule).reshape(array.shape[:-1])


@dataclass(slots=True, eq=False)
class _Terms:
    """The linear parts of the bound for a block of M configurations (all along contiguous rows).

    ``mix`` = sum_f n_f Q_f; ``both[j]`` = N(beta_j) and ``both[J + j]`` = N(beta_j) + A(beta_j);
    ``present[j]``: some type with b_a == beta_j has an instance; ``has_full``: some full-range
    type has one.
    """

    mix: FloatArray  # (M,)
    both: FloatArray  # (2J, M)
    present: NDArray[np.bool_]  # (J, M)
    has_full: NDArray[np.bool_]  # (M,)

    def take(self, rows: IntArray) -> _Terms:
        return _Terms(
            self.mix[rows], self.both[:, rows], self.present[:, rows], self.has_full[rows]
        )


def _terms(t: _Tables, counts: NDArray[np.integer]) -> _Terms:
    """The terms of each row of ``counts`` (M, k)."""
    c = counts.T.astype(np.float64)
    present = np.zeros((len(t.members), c.shape[1]), dtype=bool)
    for j, members in enumerate(t.members):
        for i in members:
            present[j] |= c[i] > 0
    has_full: NDArray[np.bool_] = np.any(c[t.full] > 0, axis=0)
    return _Terms(t.mix_qps @ c, t.both_qps.T @ c, present, has_full)


def _terms_added(
    t: _Tables, parent: _Terms, rows: IntArray, column: int, added: IntArray
) -> _Terms:
    """The terms of ``parent`` row ``rows[i]`` with ``added[i]`` instances of ``column`` more."""
    n = added.astype(np.float64)
    mix = parent.mix[rows] + n * t.mix_qps[column]
    both = parent.both[:, rows] + t.both_qps[column][:, None] * n
    present = parent.present[:, rows]
    has_full = parent.has_full[rows]
    if t.full[column]:
        has_full |= added > 0
    for j, members in enumerate(t.members):
        if column in members:
            present[j] |= added > 0
    return _Terms(mix, both, present, has_full)


def _combine(t: _Tables, terms: _Terms, rule: ThresholdRule) -> FloatArray:
    """The bound from its terms (see :func:`upper_bounds`); overwrites ``terms.both``."""
    ub: FloatArray = terms.mix.copy()
    J = t.alpha.size
    if J:
        X, Y = terms.both[:J], terms.both[J:]  # X = N, Y = N + A
        with np.errstate(invalid="ignore"):
            # N * inf is nan when N = 0; fmin then keeps N + A (the row is zeroed below anyway).
            np.multiply(X, t.alpha[:, None], out=X)
            np.fmin(X, Y, out=Y)
        present = terms.present
        if rule == "widest":
            # Only the widest present threshold of each configuration counts.
            wider = np.zeros_like(present)
            wider[:-1] = np.logical_or.accumulate(present[:0:-1], axis=0)[::-1]
            present = present & ~wider
        np.maximum(ub, np.where(present, Y, 0.0).max(axis=0), out=ub)
    ub[~terms.has_full] = 0.0
    return ub


def _bounds(t: _Tables, counts: NDArray[np.integer], rule: ThresholdRule) -> FloatArray:
    """The bound of each row of ``counts`` (M, k); see :func:`upper_bounds`."""
    return _combine(t, _terms(t, counts), rule)


# ---------------------------------------------------------------------------------------------
# Ranking
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Ranking:
    """Configurations ranked by their bound, best first (ties: cheaper, then lexicographic).

    ``counts[i]`` follows the column order ``types``; ``enumerated`` is how many affordable
    configurations (with at least one full-range instance) had their bound computed, and
    ``exhaustive`` whether that was all of them; ``note`` says in words what was searched.
    """

    types: tuple[str, ...]
    base_type: str
    counts: IntArray
    upper_bound_qps: FloatArray
    cost_usd_per_hr: FloatArray
    budget_usd_per_hr: float
    enumerated: int
    exhaustive: bool
    note: str

    def __len__(self) -> int:
        return int(self.counts.shape[0])

    def fleet(self, index: int) -> dict[str, int]:
        """Configuration ``index`` as type -> count (every type, zeros included)."""
        return {name: int(n) for name, n in zip(self.types, self.counts[index], strict=True)}


def rank_configurations(
    q: KairosQuantities,
    budget_usd_per_hr: float,
    max_counts: Mapping[str, int] | None = None,
    top: int | None = None,
    *,
    rule: ThresholdRule = "best",
    method: SearchMethod = "auto",
    max_ranked: int = 5_000_000,
) -> Ranking:
    """Rank the configurations whose cost sum_t n_t P_t is within the budget by their bound.

    Counts are capped by the budget (n_t <= floor(B / P_t)) and by ``max_counts`` (a type left out
    is capped by the budget alone; a free type must have a cap). A configuration without a
    full-range instance cannot serve large queries and is not ranked (KAIROS_MATH.md step 1).

    ``method="exhaustive"`` lists every affordable configuration; ``"bound"`` finds the exact top
    ``top`` by a depth-first branch and bound whose bound at a partial configuration is the
    Lagrangian relaxation max min(X, Y) <= min_lam max(lam X + (1 - lam) Y) of each threshold's
    two terms, each maximised over the remaining budget as a fractional knapsack; ``"auto"``
    lists everything when the box of counts holds at most 2^22 configurations or ``top`` is
    ``None``, and searches otherwise. Either way the ranking is exact; the note says which.

    Raises:
        BudgetError: a budget that is not finite and > 0, or affords no full-range instance.
        SearchSpaceError: ``top=None`` and more than ``max_ranked`` configurations.
    """
    budget = _checked_budget(budget_usd_per_hr)
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"top must be an integer >= 1 or None, got {top!r}")
    if rule not in ("best", "widest"):
        raise ValueError(f"rule must be 'best' or 'widest', got {rule!r}")
    if method not in ("auto", "exhaustive", "bound"):
        raise ValueError(f"method must be 'auto', 'exhaustive' or 'bound', got {method!r}")
    caps = _caps(q, budget, max_counts)
    box = math.prod(int(c) + 1 for c in caps)
    if method == "auto":
        method = "exhaustive" if top is None or box <= _EXHAUSTIVE_BOX else "bound"
    if method == "bound" and top is None:
        raise ValueError("method='bound' needs top")
    search = _Search(_tables(q), caps, budget, top, rule, method == "bound", max_ranked)
    counts, ub = search.run()
    cost = counts.astype(np.float64) @ q.prices_usd_per_hr
    order = _rank_order(ub, cost, counts)
    counts, ub, cost = counts[order], ub[order], cost[order]
    if method == "exhaustive":
        note = (
            f"every affordable configuration with a full-range instance: {search.enumerated:,}"
            f" bounded" + (f", top {len(counts)} kept" if top is not None else "")
        )
    else:
        note = (
            f"exact top {top} by branch and bound over a box of {box:.3g} count vectors:"
            f" {search.enumerated:,} affordable configurations bounded,"
            f" {search.pruned:,} partial configurations cut by a fractional-knapsack bound"
        )
    return Ranking(
        types=q.type_names,
        base_type=q.base_type,
        counts=counts,
        upper_bound_qps=ub,
        cost_usd_per_hr=cost,
        budget_usd_per_hr=budget,
        enumerated=search.enumerated,
        exhaustive=method == "exhaustive",
        note=note,
    )


def _checked_budget(budget_usd_per_hr: float) -> float:
    if (
        isinstance(budget_usd_per_hr, bool)
        or not isinstance(budget_usd_per_hr, int | float | np.floating | np.integer)
        or not math.isfinite(float(budget_usd_per_hr))
        or budget_usd_per_hr <= 0
    ):
        raise BudgetError(
            f"the budget must be a finite number of USD/hr > 0, got {budget_usd_per_hr!r}",
            float("nan") if isinstance(budget_usd_per_hr, bool) else float(budget_usd_per_hr),
        )
    return float(budget_usd_per_hr)


def _tolerance(budget: float) -> float:
    # Sums of decimal prices are inexact in binary: $2.5 must afford 5 x $0.5.
    return 1e-9 * max(1.0, budget)


_MAX_COUNT = 2**31 - 1


def _caps(q: KairosQuantities, budget: float, max_counts: Mapping[str, int] | None) -> IntArray:
    """The largest count of each type: min(floor(B / P_t), max count)."""
    limits = dict(max_counts or {})
    known = list(q.type_names) + list(q.excluded)
    for name, count in limits.items():
        if name not in known:
            raise UnknownInstanceTypeError(name, known, "candidate types")
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
            raise FleetError(f"max count of {name} must be an integer >= 0, got {count!r}")
    caps = np.zeros(len(q.types), dtype=np.int64)
    for i, t in enumerate(q.types):
        limit = limits.get(t.instance_type)
        if t.price_usd_per_hr > 0:
            # Capped before the floor, so that an absurd budget (1e308, whose quotient is inf)
            # cannot overflow int64 (the ranking's own size limits refuse such a space with a
            # clear error later).
            affordable = math.floor(
                min((budget + _tolerance(budget)) / t.price_usd_per_hr, float(_MAX_COUNT))
            )
            caps[i] = affordable if limit is None else min(affordable, int(limit))
        elif limit is None:
            raise BudgetError(
                f"{t.instance_type} costs nothing, so the budget does not bound its count:"
                " give it a max count",
                budget,
            )
        else:
            caps[i] = int(limit)
    full = [i for i, t in enumerate(q.types) if t.full_range]
    if not any(caps[i] > 0 for i in full):
        cheapest = min(
            (q.types[i] for i in full), key=lambda t: (t.price_usd_per_hr, t.instance_type)
        )
        why = (
            f"the cheapest full-range type {cheapest.instance_type} costs"
            f" ${plain(cheapest.price_usd_per_hr)}/hr"
        )
        if budget + _tolerance(budget) >= cheapest.price_usd_per_hr:
            why = "the max counts allow no full-range instance"
        raise BudgetError(f"budget ${plain(budget)}/hr affords no configuration: {why}", budget)
    return caps


def _rank_order(ub: FloatArray, cost: FloatArray, counts: IntArray) -> IntArray:
    """Indices best first: bound descending, then cost ascending, then counts lexicographic."""
    keys: list[NDArray[np.generic]] = [counts[:, i] for i in range(counts.shape[1] - 1, -1, -1)]
    keys += [np.round(cost, _COST_DECIMALS), -np.round(ub, _UB_DECIMALS)]
    order: IntArray = np.lexsort(keys)
    return order


def _slack(theta: float) -> float:
    """How far below the k-th best bound a candidate may be and still tie with it."""
    return 10.0**-_UB_DECIMALS + 1e-9 * abs(theta)


class _Knapsack:
    """max sum_t n_t v_t subject to sum_t n_t P_t <= R, 0 <= n_t <= cap_t (n real): concave and
    piecewise linear in R; evaluated for many R at once."""

    __slots__ = ("offset", "x", "y")

    def __init__(self, values: FloatArray, prices: FloatArray, caps: IntArray) -> None:
        useful = (values > 0) & (caps > 0)
        free = useful & (prices <= 0)
        self.offset = float(np.sum(values[free] * caps[free]))
        paid = useful & ~free
        v, p, c = values[paid], prices[paid], caps[paid].astype(np.float64)
        order = np.argsort(-v / p, kind="stable")
        self.x = np.concatenate(([0.0], np.cumsum(c[order] * p[order])))
        self.y = np.concatenate(([0.0], np.cumsum(c[order] * v[order])))

    def __call__(self, room: FloatArray) -> FloatArray:
        value: FloatArray = self.offset + np.interp(room, self.x, self.y)
        return value


class _Search:
    """Depth-first, vectorised enumeration of affordable count vectors, one type per level.

    Each stack entry is a block of partial configurations (the first ``level`` types of
    ``order`` decided, the rest 0). Blocks are expanded by every affordable count of the next
    type; with pruning, children whose bound is below the current k-th best are cut, and the
    best-bounded children are searched first so that the k-th best rises early.
    """

    def __init__(
        self,
        tables: _Tables,
        caps: IntArray,
        budget: float,
        top: int | None,
        rule: ThresholdRule,
        prune: bool,
        max_ranked: int,
    ) -> None:
        self.t = tables
        self.caps = caps
        self.budget = budget
        self.room_limit = budget + _tolerance(budget)
        self.top = top
        self.rule = rule
        self.prune = prune
        self.max_ranked = max_ranked
        k = caps.size
        # Expensive types first: fewer children per level near the root, and the cheap types
        # (whose fractional relaxation is nearly exact) last.
        self.order = [int(i) for i in np.argsort(-tables.prices, kind="stable")]
        self.levels = [self._level_bounds(self.order[level:]) for level in range(k)]
        self.enumerated = 0
        self.pruned = 0
        self.theta = -math.inf
        self.kept_counts: list[IntArray] = []
        self.kept_ub: list[FloatArray] = []
        self.kept_rows = 0

    # -- the bound of partial configurations --------------------------------------------------

    def _level_bounds(
        self, rest: list[int]
    ) -> tuple[_Knapsack, list[tuple[bool, list[tuple[float, _Knapsack]]]]]:
        """Knapsack curves of the undecided types ``rest``, for the mix term and each threshold."""
        t = self.t
        mask = np.zeros(self.caps.size, dtype=bool)
        mask[rest] = True
        caps = np.where(mask, self.caps, 0)
        mix = _Knapsack(t.mix_qps, t.prices, caps)
        per_threshold = []
        for j in range(t.alpha.size):
            could_appear = bool((t.member[mask, j] > 0).any())
            lams = _LAMBDAS if math.isfinite(t.alpha[j]) else (0.0,)
            curves = []
            for lam in lams:
                values = (1.0 - lam) * (t.pool_qps[:, j] + t.aux_qps[:, j])
                if lam > 0:
                    values = values + lam * t.alpha[j] * t.pool_qps[:, j]
                curves.append((lam, _Knapsack(values, t.prices, caps)))
            per_threshold.append((could_appear, curves))
        return mix, per_threshold

    def _partial_bounds(self, terms: _Terms, spent: FloatArray, level: int) -> FloatArray:
        """An upper bound of every completion of each partial configuration."""
        t = self.t
        room = self.room_limit - spent
        mix, per_threshold = self.levels[level]
        bound: FloatArray = terms.mix + mix(room)
        J = t.alpha.size
        for j, (could_appear, curves) in enumerate(per_threshold):
            active = terms.present[j] | could_appear
            if not active.any():
                continue
            N, Y = terms.both[j], terms.both[J + j]
            best = np.full(room.size, np.inf)
            for lam, curve in curves:
                value = (1.0 - lam) * Y + curve(room)
                if lam > 0:
                    value += lam * t.alpha[j] * N
                np.minimum(best, value, out=best)
            np.maximum(bound, np.where(active, best, 0.0), out=bound)
        return bound

    # -- the search ---------------------------------------------------------------------------

    def run(self) -> tuple[IntArray, FloatArray]:
        k = self.caps.size
        root = np.zeros((1, k), dtype=np.int64)
        stack: list[_Block] = [
            _Block(0, root, np.zeros(1), np.full(1, np.inf), _terms(self.t, root))
        ]
        while stack:
            deadline.check()  # a bounded preview stops mid-search
            block = stack.pop()
            if self.prune and math.isfinite(self.theta):
                alive = block.bound >= self.theta - _slack(self.theta)
                if not alive.all():
                    self.pruned += int((~alive).sum())
                    if not alive.any():
                        continue
                    block = block.take(np.flatnonzero(alive))
            column = self.order[block.level]
            price = float(self.t.prices[column])
            cap = int(self.caps[column])
            if price > 0:
                with np.errstate(over="ignore"):  # inf for an absurd budget: cap bounds it
                    room = np.floor((self.room_limit - block.spent) / price)
                n_max = np.minimum(cap, room).astype(np.int64)
            else:
                n_max = np.full(block.size, cap, dtype=np.int64)
            if block.stop is not None:
                n_max = np.minimum(n_max, block.stop - 1)
            n_opts = np.maximum(n_max - block.first + 1, 0)
            ends = np.cumsum(n_opts)
            if ends[-1] == 0:
                continue
            if block.size == 1 and ends[-1] > _CHUNK_ROWS:
                # One row with too many children at once: its counts a range at a time, the
                # highest first (their bounds are the highest, which raises the k-th best early).
                # One range now, the rest as one block split again when it is popped: a huge
                # budget's count range (10^14 counts) is never listed whole, and the deadline
                # is checked between ranges.
                first, stop = block.first, int(n_max[0]) + 1
                top = max(first, stop - _CHUNK_ROWS)
                if top > first:
                    stack.append(block.ranged(first, top))
                stack.append(block.ranged(top, stop))
                continue
            if ends[-1] > _CHUNK_ROWS and block.size > 1:
                # Too many children at once: split the block after each row whose children cross
                # a multiple of the chunk size (at least after the first row), searched in order.
                # The first row whose children reach each multiple below the total: where
                # the multiple counted so far rises (never the multiples themselves listed: a
                # huge budget makes them billions).
                reached = np.minimum(ends, ends[-1] - 1) // _CHUNK_ROWS
                crossing = np.flatnonzero(np.diff(reached, prepend=0) > 0)
                cuts = np.unique(np.clip(crossing + 1, 1, block.size - 1))
                bounds = [0, *cuts.tolist(), block.size]
                for lo, hi in reversed(list(itertools.pairwise(bounds))):
                    stack.append(block.take(np.arange(lo, hi)))
                continue
            rows = np.repeat(np.arange(block.size), n_opts)
            added = np.arange(rows.size) - np.repeat(ends - n_opts, n_opts) + block.first
            terms = _terms_added(self.t, block.terms, rows, column, added)
            if block.level + 1 == k:
                self._leaves(block.counts, rows, column, added, terms)
                continue
            children = block.counts[rows]
            children[:, column] = added
            spent = block.spent[rows] + added * price
            if not self.prune:
                bound = np.full(rows.size, np.inf)
                stack.append(_Block(block.level + 1, children, spent, bound, terms))
                continue
            bound = self._partial_bounds(terms, spent, block.level + 1)
            survivors = np.flatnonzero(bound >= self.theta - _slack(self.theta))
            self.pruned += rows.size - survivors.size
            if survivors.size == 0:
                continue
            survivors = survivors[np.argsort(-bound[survivors], kind="stable")]
            child = _Block(block.level + 1, children, spent, bound, terms)
            stack.append(child.take(survivors))
        if not self.kept_counts:
            return np.zeros((0, k), dtype=np.int64), np.zeros(0)
        return np.concatenate(self.kept_counts), np.concatenate(self.kept_ub)

    def _leaves(
        self, parents: IntArray, rows: IntArray, column: int, added: IntArray, terms: _Terms
    ) -> None:
        """Bound complete configurations (``parents[rows]`` with ``added`` of ``column``)."""
        feasible = terms.has_full
        if not feasible.all():
            keep = np.flatnonzero(feasible)
            rows, added, terms = rows[keep], added[keep], terms.take(keep)
        self.enumerated += int(rows.size)
        if rows.size == 0:
            return
        ub = _combine(self.t, terms, self.rule)
        if self.top is None:
            self.kept_rows += rows.size
            if self.kept_rows > self.max_ranked:
                raise SearchSpaceError(
                    f"the budget affords more than {self.max_ranked:,} configurations; rank only"
                    " the best ones (top=K)"
                )
        elif math.isfinite(self.theta):
            keep = np.flatnonzero(ub >= self.theta - _slack(self.theta))
            rows, added, ub = rows[keep], added[keep], ub[keep]
            if rows.size == 0:
                return
        counts = parents[rows]
        counts[:, column] = added
        if self.top is None:
            self.kept_counts.append(counts)
            self.kept_ub.append(ub)
            return
        if self.kept_counts:
            counts = np.concatenate([self.kept_counts[0], counts])
            ub = np.concatenate([self.kept_ub[0], ub])
        cost = counts.astype(np.float64) @ self.t.prices
        best = _rank_order(ub, cost, counts)[: self.top]
        self.kept_counts = [counts[best]]
        self.kept_ub = [ub[best]]
        if best.size == self.top:
            self.theta = float(ub[best[-1]])


@dataclass(slots=True, eq=False)
class _Block:
    """Partial configurations of one search level: counts (M, k), money spent, their bound; the
    next type's counts to try are ``first`` up to (not including) ``stop`` (None: every
    affordable count), so that one row with very many children is searched a range at a time."""

    level: int
    counts: IntArray
    spent: FloatArray
    bound: FloatArray
    terms: _Terms
    first: int = 0
    stop: int | None = None

    @property
    def size(self) -> int:
        return int(self.counts.shape[0])

    def take(self, rows: IntArray) -> _Block:
        return _Block(
            self.level,
            self.counts[rows],
            self.spent[rows],
            self.bound[rows],
            self.terms.take(rows),
            self.first,
            self.stop,
        )

    def ranged(self, first: int, stop: int) -> _Block:
        """This block with the next type's counts limited to ``first``..``stop - 1``."""
        return dataclasses.replace(self, first=first, stop=stop)


# ---------------------------------------------------------------------------------------------
# Picking
# ---------------------------------------------------------------------------------------------


def similarity_pick(ranking: Ranking) -> int:
    """The index (into ``ranking``) of the configuration the paper picks without evaluation.

    Kairos section 5.2 ("similarity"): if the top-3 configurations have the same number of base
    instances, the top one; otherwise, among the top-10, the one whose summed squared Euclidean
    distance (over count vectors) to the other nine is smallest (ties: the higher ranked). With
    fewer than 3 configurations, the top one.

    >>> import numpy as np
    >>> r = Ranking(("g", "c"), "g", np.array([[1, 9], [2, 4], [1, 8], [2, 6]]),
    ...             np.array([4.0, 3, 2, 1]), np.zeros(4), 10.0, 4, True, "")
    >>> similarity_pick(r)  # the top-3 bases 1, 2, 1 differ; distance sums 37, 47, 23, 19
    3
    """
    n = len(ranking)
    if n == 0:
        raise ValueError("an empty ranking has nothing to pick")
    base = ranking.types.index(ranking.base_type)
    head = ranking.counts[: min(n, SIMILARITY_AGREE), base]
    if n < SIMILARITY_AGREE or np.all(head == head[0]):
        return 0
    top = ranking.counts[:SIMILARITY_TOP].astype(np.float64)
    distance = ((top[:, None, :] - top[None, :, :]) ** 2).sum(axis=2).sum(axis=1)
    return int(np.argmin(distance))


def best_homogeneous(
    q: KairosQuantities, budget_usd_per_hr: float, max_counts: Mapping[str, int] | None = None
) -> tuple[IntArray, float]:
    """The best single-type configuration: (counts, bound in qps).

    Only a full-range type can serve alone; with n_t = min(floor(B / P_t), max count) its bound is
    n_t Q_t (the paper's homogeneous baseline, 4 g4dn.xlarge at $2.5/hr). Ties: cheaper first.
    """
    budget = _checked_budget(budget_usd_per_hr)
    caps = _caps(q, budget, max_counts)
    best: tuple[float, float, int] | None = None
    for i, t in enumerate(q.types):
        if not t.full_range or caps[i] == 0:
            continue
        ub, cost = caps[i] * t.throughput_qps, caps[i] * t.price_usd_per_hr
        if best is None or (round(ub, _UB_DECIMALS), -cost) > (
            round(best[0], _UB_DECIMALS),
            -best[1],
        ):
            best = (float(ub), float(cost), i)
    assert best is not None  # _caps raised if no full-range type fits
    counts = np.zeros(len(q.types), dtype=np.int64)
    counts[best[2]] = caps[best[2]]
    return counts, best[0]
