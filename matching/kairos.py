"""The Kairos dispatcher: each round, a min-cost matching of queued queries to instances.

Kairos (HPDC'23) section 5.1; shared/KAIROS_MATH.md, "Query distribution (the dispatcher)". At
every scheduling round (the simulator's: an arrival, a completion, an instance joining):

1. rows: the first min(#queued, 2 x #instances) queued queries in arrival order; columns: every
   instance, busy or idle (a busy one is worth waiting for when it would still meet QoS);
2. the penalised cost matrix of :mod:`matching.cost` from the online latency predictions of
   :mod:`matching.latency_model`, each instance's remaining busy time r_j = max(0, busy_until - now)
   and each query's wait. The usage uses the mean prediction l_ij; the QoS checks (miss, margin)
   use the tail prediction l~_ij = k_type(j)(b_i) l_ij when the policy has tail ratios k (e.g. a
   profile's p99 over its mean by batch size, :data:`TAIL_QUANTILE`), else the mean as Kairos
   does (docs/matching.md, "Tail-aware feasibility");
3. the rectangular min-cost assignment of :mod:`matching.assignment`: from
   :data:`FLOW_FROM_INSTANCES` instances on, an optimum of that matrix found without building it,
   as the chain flow of :mod:`matching.chain_flow` (the same numbers of QoS misses and margins and
   the same usage; ties broken its own way), below that SciPy's dense solve of the matrix;
4. dispatch only the pairs whose instance is idle now; the other queries stay queued for a later
   round (the implicit "wait for the better instance"). An instance whose busy time is over but
   that is not idle (it stopped taking work) is dropped from the columns and the round solved
   again; one not ready yet counts as busy until it is.

Each query runs alone (the Kairos setting: a query already is a batch), so the stage's
``max_batch_queries`` is never exceeded. Completed batches feed the latency model through
:meth:`KairosPolicy.observe`.

The round runs in compiled code (:func:`round_costs_kernel`: predictions and costs, bit for bit
those of :func:`matching.cost.build_cost_matrix`; :func:`round_flow_kernel`: the same predictions
and the chain flow), and a round with a single row skips the solver: the assignment of one row is
the lowest-index argmin of that row, which is what SciPy's solver returns too (tests check both).
Why the threshold (docs/matching.md, "The chain flow"): the dense solve of a 256 x 128 round takes
about 2 ms, the flow about 0.2 ms; below 32 instances the two are about as fast, and SciPy keeps
the decisions of the fleets the simulator runs in the Kairos setting (at most about 20
instances) bit for bit.

In the simulator an instance's ``busy_until_s`` is the drawn service time, so r_j is exact; in
the live loop it is what the serving loop knows (start plus predicted latency), as in the
authors' code.

The heterogeneity coefficients h_j come from the latency model's predictions at the largest batch
size it knows, computed when the policy first sees a fleet (as the authors compute them once from
the profiled means), so that costs do not drift while the model learns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numba
import numpy as np
from numpy.typing import ArrayLike

from matching.assignment import linear_assignment
from matching.chain_flow import chain_assignment_kernel
from matching.cost import SAFETY, costs_kernel
from matching.errors import MatchingError, MissingQosError, TailRatioError
from matching.latency_model import LatencyModel, predict_kernel
from matching.policy import Dispatch, InstanceView, PolicySetting, QueuedQuery, StageContext

ROWS_PER_INSTANCE = 2  # Kairos' authors cap a round at twice as many queries as instances
FLOW_FROM_INSTANCES = 32  # rounds this wide or wider: the chain flow (docs/matching.md)
TAIL_QUANTILE = 0.99  # QoS is a P99 target: the tail the feasibility checks use (docs/matching.md)

_busy_until = attrgetter("busy_until_s")
_type_of = attrgetter("instance_type")
_batch_of = attrgetter("batch_size")
_arrival_of = attrgetter("arrival_s")
_NO_NOISE = np.zeros((0, 0))


@numba.njit(cache=True)
def _round_inputs(
    batch_size: np.ndarray,
    arrival_s: np.ndarray,
    busy_until_s: np.ndarray,
    now_s: float,
    fleet_model_type: np.ndarray,
    counts: np.ndarray,
    sums_ms: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    line: np.ndarray,
    table_after: int,
    noise_factor: np.ndarray,
    tail_ratio: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A round's l (rows x fleet types), l~ (the same array when there are no tail ratios), r_j
    and w_i, in ms (see :func:`round_costs_kernel`)."""
    m = batch_size.size
    n = busy_until_s.size
    n_types = fleet_model_type.size
    latency = np.empty((m, n_types))
    tail_cap = tail_ratio.shape[1] - 1
    tail = np.empty((m, n_types)) if tail_cap >= 0 else latency
    for i in range(m):
        b_tail = min(batch_size[i], tail_cap)
        for f in range(n_types):
            value = predict_kernel(
                counts, sums_ms, left, right, line, table_after, fleet_model_type[f], batch_size[i]
            )
            if noise_factor.shape[0] > 0:
                value = max(value * noise_factor[i, f], 0.0)
            latency[i, f] = value
            if tail_cap >= 0:
                tail[i, f] = value * tail_ratio[f, b_tail]
    remaining = np.empty(n)
    for j in range(n):
        remaining[j] = max((busy_until_s[j] - now_s) * 1000.0, 0.0)
    waited = np.empty(m)
    for i in range(m):
        waited[i] = (now_s - arrival_s[i]) * 1000.0
    return latency, tail, remaining, waited


@numba.njit(cache=True)
def round_costs_kernel(
    batch_size: np.ndarray,
    arrival_s: np.ndarray,
    busy_until_s: np.ndarray,
    now_s: float,
    fleet_model_type: np.ndarray,
    column_type: np.ndarray,
    heterogeneity: np.ndarray,
    counts: np.ndarray,
    sums_ms: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    line: np.ndarray,
    table_after: int,
    noise_factor: np.ndarray,
    tail_ratio: np.ndarray,
    qos_ms: float,
    safety: float,
) -> tuple[np.ndarray, int]:
    """One round's cost matrix, and for a single row its lowest-index argmin (else -1).

    Rows are queries (``batch_size``, ``arrival_s``), columns instances (``busy_until_s``,
    ``column_type`` indexing the fleet's types, whose latency-model rows are
    ``fleet_model_type``). l_ij is the model's prediction for the query's batch size on the
    column's type, times ``noise_factor[i, type]`` when that array is not empty (clipped at 0).
    The tail l~_ij is l_ij times ``tail_ratio[type, min(b, last column)]``; with no columns,
    l~ = l (the mean checks).
    """
    latency, tail, remaining, waited = _round_inputs(
        batch_size,
        arrival_s,
        busy_until_s,
        now_s,
        fleet_model_type,
        counts,
        sums_ms,
        left,
        right,
        line,
        table_after,
        noise_factor,
        tail_ratio,
    )
    costs = costs_kernel(
        latency, tail, column_type, remaining, heterogeneity, waited, qos_ms, safety
    )
    best = -1
    if batch_size.size == 1:
        best = 0
        for j in range(1, busy_until_s.size):
            if costs[0, j] < costs[0, best]:
                best = j
    return costs, best


@numba.njit(cache=True)
def round_flow_kernel(
    batch_size: np.ndarray,
    arrival_s: np.ndarray,
    busy_until_s: np.ndarray,
    now_s: float,
    fleet_model_type: np.ndarray,
    column_type: np.ndarray,
    heterogeneity: np.ndarray,
    counts: np.ndarray,
    sums_ms: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    line: np.ndarray,
    table_after: int,
    noise_factor: np.ndarray,
    tail_ratio: np.ndarray,
    qos_ms: float,
    safety: float,
) -> tuple[np.ndarray, np.ndarray]:
    """One round's min-cost assignment (rows, columns) by the chain flow of
    :mod:`matching.chain_flow`: an optimum of the matrix :func:`round_costs_kernel` builds
    from the same arguments, without building it."""
    latency, tail, remaining, waited = _round_inputs(
        batch_size,
        arrival_s,
        busy_until_s,
        now_s,
        fleet_model_type,
        counts,
        sums_ms,
        left,
        right,
        line,
        table_after,
        noise_factor,
        tail_ratio,
    )
    return chain_assignment_kernel(
        latency, tail, column_type, remaining, heterogeneity, waited, qos_ms, safety
    )


@dataclass(frozen=True, slots=True, eq=False)
class _Layout:
    """What a round needs of a fleet that does not change between rounds."""

    instance_types: tuple[str, ...]
    fleet_model_type: np.ndarray  # fleet type -> latency-model row
    column_type: np.ndarray  # column -> fleet type
    heterogeneity: np.ndarray  # column -> h_j
    tail_ratio: np.ndarray  # fleet type x batch size -> k (empty columns: no tail, k = 1)


class KairosPolicy:
    """Kairos' matching dispatcher (see the module docstring).

    ``base_type``: the base instance type (h = 1). ``latency``: the initial latency model, or
    initial (batch size, latency ms) points per instance type (e.g. each profile's means); the
    policy learns into its own copy, :attr:`latency`. ``safety``: Kairos' margin (a predicted
    finish beyond ``safety`` x QoS is penalised). ``rows_per_instance``: a round considers at most
    that many queued queries per instance. ``flow_from_instances``: a round with at least that
    many instances (and more than one query) is solved as a chain flow, a smaller one by SciPy on
    the matrix (the same optimum; 1 always takes the flow). ``noise_share`` with ``rng``: the
    robustness knob of Kairos Fig. 16b, each prediction times (1 + noise_share x N(0, 1)), drawn
    per round and per (query, instance type); 0 turns it off (the tail scales the noisy mean).
    ``tail_ratio``: per instance type, k(b) = tail latency / mean latency at batch size b, a 1-D
    array indexed by the batch size itself (NaN where unknown: filled linearly between known
    sizes, with the nearest known ratio outside them; sizes beyond the array take its last
    ratio; kept, filled, in :attr:`tail_ratio`); the QoS checks then use k(b) times the online
    mean. Types without one are checked on the mean (k = 1), as are all types when it is None
    (Kairos' own rule). Use one policy per run: it learns as it goes.
    """

    name = "kairos"
    needs_base_type = True
    needs_threshold = False
    takes_noise = True
    in_plans = True
    matched_capacity = True
    batches = False

    def __init__(
        self,
        base_type: str,
        latency: LatencyModel | Mapping[str, Iterable[tuple[int, float]]],
        *,
        safety: float = SAFETY,
        rows_per_instance: int = ROWS_PER_INSTANCE,
        flow_from_instances: int = FLOW_FROM_INSTANCES,
        noise_share: float = 0.0,
        rng: np.random.Generator | None = None,
        tail_ratio: Mapping[str, ArrayLike] | None = None,
    ) -> None:
        model = latency.copy() if isinstance(latency, LatencyModel) else LatencyModel(latency)
        model.type_index(base_type)  # the base type must be predictable: h is relative to it
        if not 0 < safety <= 1:
            raise MatchingError(f"safety must be in (0, 1], got {safety!r}")
        if isinstance(rows_per_instance, bool) or rows_per_instance < 1:
            raise MatchingError(f"rows_per_instance must be >= 1, got {rows_per_instance!r}")
        if isinstance(flow_from_instances, bool) or flow_from_instances < 1:
            raise MatchingError(f"flow_from_instances must be >= 1, got {flow_from_instances!r}")
        if not (np.isfinite(noise_share) and noise_share >= 0):
            raise MatchingError(f"noise_share must be finite and >= 0, got {noise_share!r}")
        if noise_share > 0 and rng is None:
            raise MatchingError("prediction noise needs a numpy Generator (rng=...)")
        self.base_type = base_type
        self.latency = model
        self.safety = float(safety)
        self.rows_per_instance = int(rows_per_instance)
        self.flow_from_instances = int(flow_from_instances)
        self.noise_share = float(noise_share)
        self._rng = rng
        self.tail_ratio = {t: _checked_ratios(t, k) for t, k in (tail_ratio or {}).items()}
        self._layout: _Layout | None = None

    @classmethod
    def factory(cls, setting: PolicySetting) -> Callable[[], KairosPolicy]:
        """Fresh policies with the setting's first base type as their base, each profile's mean
        latency by batch size as the initial model, and the QoS checks on the profiled tail
        (:data:`TAIL_QUANTILE`; per type and batch size its ratio to the mean, applied to the
        policy's online mean: tail-aware feasibility, docs/matching.md). With noise, each policy
        draws from a fresh ``numpy.random.default_rng(setting.noise_seed)``."""
        if not setting.base_types:
            raise MatchingError("the kairos policy needs a base type")
        model = LatencyModel.from_means(setting.profiles)
        tail_ratio = {}
        for t, p in setting.profiles.items():
            tail_ms, mean_ms = p.quantile_by_batch_ms(TAIL_QUANTILE), p.mean_by_batch_ms()
            known = mean_ms > 0  # NaN (below the smallest measured size) compares False
            tail_ratio[t] = np.divide(
                tail_ms, mean_ms, out=np.full_like(mean_ms, np.nan), where=known
            )
        base = setting.base_types[0]
        noise_share, noise_seed = setting.noise_share, setting.noise_seed
        return lambda: cls(
            base,
            model,
            tail_ratio=tail_ratio,
            noise_share=noise_share,
            rng=np.random.default_rng(noise_seed) if noise_share else None,
        )

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        qos_ms = context.qos_ms
        if qos_ms is None:
            raise MissingQosError(self.name)
        n_columns = len(instances)
        n_rows = min(len(queue), self.rows_per_instance * n_columns)
        if n_rows == 0:
            return []
        types = tuple(map(_type_of, instances))
        layout = self._layout
        if layout is None or layout.instance_types != types:
            layout = self._layout = self._build_layout(types)
        # The head by a slice: the central queue reads it without skipping what was taken from
        # behind it (matching.queues).
        rows: Sequence[QueuedQuery] = (queue[0],) if n_rows == 1 else queue[:n_rows]
        batch = np.fromiter(map(_batch_of, rows), np.int64, n_rows)
        arrival = np.fromiter(map(_arrival_of, rows), np.float64, n_rows)
        busy_until = np.fromiter(map(_busy_until, instances), np.float64, n_columns)
        noise = _NO_NOISE
        if self.noise_share > 0:
            assert self._rng is not None
            noise = 1.0 + self.noise_share * self._rng.standard_normal(
                (n_rows, layout.fleet_model_type.size)
            )
        column_type = layout.column_type
        heterogeneity = layout.heterogeneity
        columns: Sequence[int] = range(n_columns)  # column -> position in ``instances``
        model = self.latency.arrays
        while True:
            inputs = (
                batch,
                arrival,
                busy_until,
                now_s,
                layout.fleet_model_type,
                column_type,
                heterogeneity,
                model.counts,
                model.sums_ms,
                model.left,
                model.right,
                model.line,
                self.latency.table_after,
                noise,
                layout.tail_ratio,
                qos_ms,
                self.safety,
            )
            pairs: Iterable[tuple[int, int]]
            if n_rows > 1 and len(columns) >= self.flow_from_instances:
                row_ind, col_ind = round_flow_kernel(*inputs)
                pairs = zip(row_ind.tolist(), col_ind.tolist(), strict=True)
            else:
                costs, best = round_costs_kernel(*inputs)
                if best >= 0:
                    pairs = ((0, best),)
                else:
                    row_ind, col_ind = linear_assignment(costs)
                    pairs = zip(row_ind.tolist(), col_ind.tolist(), strict=True)
            dispatches = []
            stopped = []
            for i, j in pairs:
                instance = instances[columns[j]]
                if instance.busy_until_s > now_s:
                    continue  # the query waits for this busy instance
                if instance.is_idle(now_s):
                    dispatches.append(Dispatch(instance.index, (rows[i].query_id,)))
                else:
                    stopped.append(j)  # free but not taking work: drop the column, solve again
            if not stopped:
                return dispatches
            keep = np.ones(len(columns), dtype=bool)
            keep[stopped] = False
            columns = [c for c, k in zip(columns, keep.tolist(), strict=True) if k]
            if not columns:
                return []
            busy_until = busy_until[keep]
            column_type = column_type[keep]
            heterogeneity = heterogeneity[keep]

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """Feed a measured service time to the latency model."""
        self.latency.observe(instance_type, batch_size, latency_ms)

    def _build_layout(self, types: tuple[str, ...]) -> _Layout:
        model = self.latency
        fleet_types = list(dict.fromkeys(types))
        fleet_model_type = np.array([model.type_index(t) for t in fleet_types], dtype=np.int64)
        b_max = max(model.max_batch_size, 1)
        base_ms = model.predict_ms(self.base_type, b_max)
        at_max = {t: model.predict_ms(t, b_max) for t in fleet_types}
        for t, ms in at_max.items():
            if not ms > 0 or not base_ms > 0:
                raise MatchingError(
                    f"heterogeneity needs latencies > 0 at b_max = {b_max}: {self.base_type!r}"
                    f" predicts {base_ms} ms, {t!r} {ms} ms"
                )
        position = {t: f for f, t in enumerate(fleet_types)}
        tails = [self.tail_ratio.get(t) for t in fleet_types]
        width = max((k.size for k in tails if k is not None), default=0)
        tail_ratio = np.ones((len(fleet_types), width))
        for f, k in enumerate(tails):
            if k is not None:  # beyond its last batch size, a type keeps its last ratio
                tail_ratio[f] = k[np.minimum(np.arange(width), k.size - 1)]
        return _Layout(
            instance_types=types,
            fleet_model_type=fleet_model_type,
            column_type=np.array([position[t] for t in types], dtype=np.int64),
            heterogeneity=np.array([base_ms / at_max[t] for t in types]),
            tail_ratio=tail_ratio,
        )


def _checked_ratios(instance_type: str, ratios: ArrayLike) -> np.ndarray:
    """A type's tail ratios by batch size with the unknown (NaN) entries filled: linear between
    the known sizes around them, the nearest known ratio below the first or above the last."""
    try:
        k = np.array(ratios, dtype=np.float64)
    except (TypeError, ValueError):
        raise TailRatioError(instance_type, "must be an array of numbers") from None
    if k.ndim != 1:
        raise TailRatioError(instance_type, f"must be 1-D (indexed by batch size), got {k.ndim}-D")
    known = np.flatnonzero(~np.isnan(k))
    if known.size == 0:
        raise TailRatioError(instance_type, "has no known entry (all NaN)")
    if not (np.all(np.isfinite(k[known])) and np.all(k[known] >= 0)):
        raise TailRatioError(instance_type, "must be finite and >= 0 where known")
    filled: np.ndarray = np.interp(np.arange(k.size), known, k[known])
    return filled
