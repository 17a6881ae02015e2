"""CascadeServe's hardware mapping (SP3): which instances host which models, and which share of
each model's traffic each of them serves.

This module owns the two halves of Kossmann et al., "CascadeServe", section 4.4, as pure
functions over plain values (instance ids, model names, numbers; no I/O, no clock):

**Load balancing** (:func:`balance`). Given which models each instance (the paper's *device*)
hosts, the QPS each model must serve, QPS_m (the cascade's QPS times the model's reach share,
the paper's footnote 2), and runtime(r), the seconds per sample of replica r = (m, d), the load
balancer solves, with decision variables q_r (the QPS replica r serves) and u::

    minimise    u
    subject to  sum_{r in R[m]} q_r = QPS_m                for every model m      (paper Eq. 2)
                sum_{r in R[d]} q_r runtime(r) <= u       for every device d     (paper Eq. 3)
                0 <= q_r <= QPS_m,  u >= 0

The paper minimises sum_r q_r (its Eq. 1) at a fixed u and lowers u, LP after LP, until the LP
has no solution; it returns the last feasible u. The problem is the same with u a variable: the
feasible set shrinks monotonically as u falls, so the paper's search converges to the optimum of
the LP above (and at that optimum Eq. 2 holds with equality: serving more than QPS_m only adds
load). One LP (HiGHS, ``scipy.optimize.linprog``) gives it exactly. u is the busy share of the
busiest instance; u > ``max_utilisation`` (1: 100%, the paper's bound) is an error. A model
whose demand is 0 takes no part in the LP; its shares are proportional to each host's speed
(1 / runtime), so that traffic the plan did not count on still goes where it is served fastest.
Ties between optimal vertices are HiGHS's choice.

**Model placement** (:func:`prune_placement`). The initial placement hosts every model on every
instance that can run it; the greedy pruning removes one replica at a time until every
instance's memory holds its models. With m_over(d) = max(0, sum of the memory of d's models -
d's memory) and m_freed(r) = min(memory(m), m_over(d)), the over-allocated memory that pruning
r = (m, d) frees, and u_max(r) the largest optimal u of :func:`balance` over the demand points
(one per QPS point of a gear whose cascade uses any model: the paper takes the maximum over
"every QPS with a cascade that uses replica r") with r pruned, the utility of pruning r is::

    util(r) = m_freed(r) / (M_over * max(u_max(r), 1e-9))   M_over = sum_d m_over(d)

and -inf when r is the last replica of its model (a cascade would become unrunnable) or a load
balancing LP fails (no solution, or u above ``max_utilisation``). The paper's Eq. 4 was lost in
extraction (what survives divides an over-allocation term by u_max(r)); this reading keeps both
of its factors: the share of the over-allocated memory pruning r frees (0 on an instance that
fits: nothing there needs pruning) over the utilisation the fleet is left with (a replica whose
loss raises u more is worth more). Each step prunes the replica of highest utility (ties: the
larger model, then the lowest instance id, then model name); when no utility is above 0 while
some instance is over its memory, no placement serves the demand and
:class:`~estimator.errors.CascadeError` says so (the paper's error).

Instances of equal memory, hosting the same models at the same runtimes at every point, are
interchangeable: the LPs of pruning (m, d) are solved once per such class (a fleet of 16
instances of two types needs a handful of LPs per step, not 48).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

# scipy.optimize is imported in the functions that solve (about a second of CPU to import, which
# a process that never solves one, such as a CLI command or a serving process, does not pay).
import numpy as np

from estimator.errors import CascadeError

__all__ = [
    "ARTIFACT_MEMORY_FACTOR",
    "DEFAULT_MODEL_MEMORY_MB",
    "HOST_RESERVE_MB",
    "Balance",
    "DemandPoint",
    "Pruning",
    "balance",
    "instance_memory_mb",
    "model_memory_mb",
    "prune_placement",
]

# A model's resident memory: the file's weights loaded once plus one working copy (what the
# registry's inspection allows a model of that size: memory + 2 x the file's size).
ARTIFACT_MEMORY_FACTOR = 2.0
# The demo family's models (provisioners.worker.family) are a few thousand to a few hundred
# thousand parameters; 64 MB covers the weights with their activations at the largest batch.
DEFAULT_MODEL_MEMORY_MB = 64.0
# Host memory the operating system and the worker agent itself keep (a CPU instance hosts its
# models in host memory; a GPU instance in its GPU memory, which nothing else uses).
HOST_RESERVE_MB = 1024.0
# u above the bound by less than this is the LP solver's rounding, not an overload.
_TOLERANCE = 1e-9


def model_memory_mb(spec_memory_mb: float | None, artifact_size_bytes: int | None = None) -> float:
    """The memory a model takes on an instance: the spec's ``memory_mb`` when it gives one,
    else ``ARTIFACT_MEMORY_FACTOR`` x its registered artifact's file size, else
    ``DEFAULT_MODEL_MEMORY_MB`` (a demo family model).

    >>> model_memory_mb(None, 100 * 2**20), model_memory_mb(300.0, 100 * 2**20)
    (200.0, 300.0)
    """
    if spec_memory_mb is not None:
        return float(spec_memory_mb)
    if artifact_size_bytes is not None and artifact_size_bytes > 0:
        return ARTIFACT_MEMORY_FACTOR * artifact_size_bytes / 2**20
    return DEFAULT_MODEL_MEMORY_MB


def instance_memory_mb(
    memory_gib: float | None, gpus: int = 0, gpu_memory_gib: float = 0.0
) -> float:
    """The memory an instance type has for models: its GPU memory when it has GPUs (the paper's
    VRAM), else its host memory less ``HOST_RESERVE_MB``; infinite when the catalog does not
    say (``local.cpu``: whatever machine runs it).

    >>> instance_memory_mb(16, gpus=1, gpu_memory_gib=16), instance_memory_mb(8)
    (16384.0, 7168.0)
    """
    if gpus > 0 and gpu_memory_gib > 0:
        return float(gpu_memory_gib) * 1024.0
    if memory_gib is None:
        return math.inf
    return max(float(memory_gib) * 1024.0 - HOST_RESERVE_MB, 0.0)


@dataclass(frozen=True, slots=True)
class DemandPoint:
    """One load the placement must serve: QPS_m per model (models left out: 0) and runtime(r),
    seconds per sample of each (model, instance) pair that can host the model; ``label`` names
    it in errors (a gear's cascade and QPS)."""

    demand_qps: Mapping[str, float]
    runtime_s: Mapping[tuple[str, str], float]
    label: str = ""


@dataclass(frozen=True, slots=True)
class Balance:
    """The LP's answer: ``utilisation`` u (the busiest instance's busy share), ``qps`` q_r per
    (model, instance), ``shares`` q_r / QPS_m (summing to 1 over a model's hosts) and each
    instance's ``load`` sum_r q_r runtime(r)."""

    utilisation: float
    qps: Mapping[tuple[str, str], float]
    shares: Mapping[tuple[str, str], float]
    load: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Pruning:
    """What pruning kept: the models each instance hosts, the replicas pruned in order, and the
    utilisation u of each demand point on the kept placement."""

    hosts: Mapping[str, frozenset[str]]
    pruned: tuple[tuple[str, str], ...] = ()
    utilisation: tuple[float, ...] = field(default=())


def balance(
    hosts: Mapping[str, Collection[str]],
    point: DemandPoint,
    *,
    max_utilisation: float = 1.0,
    spread: bool = False,
) -> Balance:
    """Solve the load-balancing LP of the module docstring for the instances ``hosts`` (instance
    id -> the models it hosts) at ``point``.

    The optimal u is often reached by many splits (identical instances can trade a model's
    queries), and the solver returns one vertex, which may give an instance none of a model it
    hosts. With ``spread`` a second LP picks, among the splits within u (1 + 1e-6), the one
    closest to each model's split by speed, t_r = QPS_m (1 / runtime(r)) / sum_{r' in R[m]}
    1 / runtime(r'): minimise sum_r |q_r - t_r| / QPS_m (linearised with one deviation variable
    per replica). u is unchanged; the serving placement asks for it, the pruning does not.

    Raises:
        CascadeError: a model with demand that no instance hosts, a hosted pair without a
            positive runtime, an LP without solution, or u > ``max_utilisation``.

    >>> point = DemandPoint({"a": 10.0, "b": 10.0}, {("a", "i"): 0.01, ("b", "i"): 0.03,
    ...     ("a", "j"): 0.01, ("b", "j"): 0.03})
    >>> round(balance({"i": {"a", "b"}, "j": {"a", "b"}}, point).utilisation, 6)
    0.2
    """
    replicas: list[tuple[str, str]] = []
    instances = sorted(hosts)
    demand = {m: float(q) for m, q in point.demand_qps.items()}
    for model, rate in demand.items():
        if not math.isfinite(rate) or rate < 0:
            raise CascadeError("load_balance", f"QPS of {model!r} must be finite and >= 0")
    hosting: dict[str, list[str]] = {}
    for instance in instances:
        for model in sorted(hosts[instance]):
            runtime = point.runtime_s.get((model, instance))
            if runtime is None or not runtime > 0 or not math.isfinite(runtime):
                raise CascadeError(
                    "load_balance", f"no positive runtime for {model!r} on {instance!r}"
                )
            hosting.setdefault(model, []).append(instance)
    for model, rate in demand.items():
        if rate > 0 and model not in hosting:
            raise CascadeError("load_balance", f"no instance hosts {model!r} {point.label}")
    for model in sorted(hosting):
        if demand.get(model, 0.0) > 0:
            replicas.extend((model, instance) for instance in hosting[model])
    qps: dict[tuple[str, str], float] = {}
    utilisation = 0.0
    if replicas:
        qps, utilisation = _solve(replicas, instances, demand, point)
        if spread and utilisation <= max_utilisation * (1.0 + _TOLERANCE) + _TOLERANCE:
            qps = _spread(replicas, instances, demand, point, utilisation, hosting) or qps
    if utilisation > max_utilisation * (1.0 + _TOLERANCE) + _TOLERANCE:
        raise CascadeError(
            "load_balance",
            f"the busiest instance would be {utilisation:.0%} busy {point.label}".rstrip()
            + f" (at most {max_utilisation:.0%})",
        )
    shares: dict[tuple[str, str], float] = {}
    for model, on in hosting.items():
        total = demand.get(model, 0.0)
        if total > 0:
            for instance in on:
                shares[(model, instance)] = qps[(model, instance)] / total
        else:  # no demand: by speed
            speeds = {i: 1.0 / point.runtime_s[(model, i)] for i in on}
            whole = sum(speeds.values())
            for instance in on:
                qps[(model, instance)] = 0.0
                shares[(model, instance)] = speeds[instance] / whole
    load = dict.fromkeys(instances, 0.0)
    for (model, instance), q in qps.items():
        load[instance] += q * point.runtime_s[(model, instance)]
    return Balance(utilisation, qps, shares, load)


def _solve(
    replicas: Sequence[tuple[str, str]],
    instances: Sequence[str],
    demand: Mapping[str, float],
    point: DemandPoint,
) -> tuple[dict[tuple[str, str], float], float]:
    from scipy.optimize import linprog

    n = len(replicas)
    row_of = {instance: k for k, instance in enumerate(instances)}
    models = sorted({m for m, _ in replicas})
    model_row = {m: k for k, m in enumerate(models)}
    a_ub = np.zeros((len(instances), n + 1))
    a_ub[:, n] = -1.0
    a_eq = np.zeros((len(models), n + 1))
    bounds: list[tuple[float, float | None]] = []
    for k, (model, instance) in enumerate(replicas):
        a_ub[row_of[instance], k] = point.runtime_s[(model, instance)]
        a_eq[model_row[model], k] = 1.0
        bounds.append((0.0, demand[model]))
    bounds.append((0.0, None))
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    b_eq = np.array([demand[m] for m in models])
    result = linprog(
        cost,
        A_ub=a_ub,
        b_ub=np.zeros(len(instances)),
        A_eq=a_eq,
        b_eq=b_eq,
        bounds=bounds,
        method="highs",
    )
    if result.status != 0 or result.x is None:
        raise CascadeError("load_balance", f"no load assignment {point.label}: {result.message}")
    x = np.maximum(result.x, 0.0)
    qps = {replica: float(x[k]) for k, replica in enumerate(replicas)}
    return qps, float(x[n])


def _spread(
    replicas: Sequence[tuple[str, str]],
    instances: Sequence[str],
    demand: Mapping[str, float],
    point: DemandPoint,
    utilisation: float,
    hosting: Mapping[str, Sequence[str]],
) -> dict[tuple[str, str], float] | None:
    """The split within ``utilisation`` closest to each model's split by speed (see
    :func:`balance`); variables q_r then e_r >= |q_r - t_r|."""
    from scipy.optimize import linprog

    n = len(replicas)
    runtime = point.runtime_s
    target = np.empty(n)
    for k, (model, instance) in enumerate(replicas):
        speed = sum(1.0 / runtime[(model, i)] for i in hosting[model])
        target[k] = demand[model] / runtime[(model, instance)] / speed
    row_of = {instance: k for k, instance in enumerate(instances)}
    models = sorted({m for m, _ in replicas})
    model_row = {m: k for k, m in enumerate(models)}
    a_ub = np.zeros((len(instances) + 2 * n, 2 * n))
    b_ub = np.zeros(len(instances) + 2 * n)
    b_ub[: len(instances)] = utilisation * (1.0 + 1e-6) + 1e-12
    a_eq = np.zeros((len(models), 2 * n))
    cost = np.zeros(2 * n)
    bounds: list[tuple[float, float | None]] = []
    for k, (model, instance) in enumerate(replicas):
        a_ub[row_of[instance], k] = runtime[(model, instance)]
        top = len(instances) + 2 * k
        a_ub[top, k], a_ub[top, n + k], b_ub[top] = 1.0, -1.0, target[k]
        a_ub[top + 1, k], a_ub[top + 1, n + k], b_ub[top + 1] = -1.0, -1.0, -target[k]
        a_eq[model_row[model], k] = 1.0
        cost[n + k] = 1.0 / demand[model]
        bounds.append((0.0, demand[model]))
    bounds.extend([(0.0, None)] * n)
    b_eq = np.array([demand[m] for m in models])
    result = linprog(
        cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs"
    )
    if result.status != 0 or result.x is None:  # numerically off: the first vertex stands
        return None
    x = np.maximum(result.x[:n], 0.0)
    return {replica: float(x[k]) for k, replica in enumerate(replicas)}


def prune_placement(
    hosts: Mapping[str, Collection[str]],
    points: Sequence[DemandPoint],
    model_memory: Mapping[str, float],
    instance_memory: Mapping[str, float],
    *,
    max_utilisation: float = 1.0,
) -> Pruning:
    """Greedily prune ``hosts`` (instance id -> the models it may host: the initial placement,
    every model everywhere it runs) until every instance's models fit its memory
    (``instance_memory``, MB; an instance left out has no limit), by the utility of the module
    docstring, with the load-balancing LPs at ``points``.

    Raises:
        CascadeError: a model without memory, or no replica left whose pruning has a positive
            utility while an instance is still over its memory.
    """
    current = {i: set(models) for i, models in hosts.items()}
    for models in current.values():
        for model in models:
            size = model_memory.get(model)
            if size is None or not size >= 0:
                raise CascadeError("placement", f"no memory for model {model!r}")
    pruned: list[tuple[str, str]] = []
    while True:
        over = {i: _over_mb(current[i], model_memory, instance_memory.get(i)) for i in current}
        total_over = sum(over.values())
        if total_over <= 0:
            break
        counts: dict[str, int] = {}
        for models in current.values():
            for model in models:
                counts[model] = counts.get(model, 0) + 1
        # In (instance, model) order, so that on ties the first (lowest id) wins.
        best: tuple[float, float, str, str] | None = None  # (utility, memory, instance, model)
        memo: dict[tuple[object, ...], float] = {}
        for instance in sorted(current):
            if over[instance] <= 0:
                continue
            for model in sorted(current[instance]):
                freed = min(model_memory[model], over[instance])
                if freed <= 0:
                    continue
                utility = -math.inf
                if counts[model] > 1:
                    cls = (_signature(instance, current, points, instance_memory), model)
                    if cls not in memo:
                        memo[cls] = _u_max(current, instance, model, points, max_utilisation)
                    u_max = memo[cls]
                    if math.isfinite(u_max):
                        utility = freed / (total_over * max(u_max, _TOLERANCE))
                if best is None or (utility, model_memory[model]) > best[:2]:
                    best = (utility, model_memory[model], instance, model)
        if best is None or not best[0] > 0:
            worst = max(over, key=lambda i: (over[i], i))
            raise CascadeError(
                "placement",
                f"no placement fits memory: instance {worst!r} is {over[worst]:.0f} MB over and"
                " no replica can be pruned without leaving a model unhosted or the load"
                " unservable",
            )
        _, _, instance, model = best
        current[instance].discard(model)
        pruned.append((model, instance))
    utilisation = tuple(balance(current, p, max_utilisation=math.inf).utilisation for p in points)
    return Pruning({i: frozenset(m) for i, m in current.items()}, tuple(pruned), utilisation)


def _over_mb(
    models: Collection[str], model_memory: Mapping[str, float], capacity: float | None
) -> float:
    if capacity is None or math.isinf(capacity):
        return 0.0
    return max(0.0, sum(model_memory[m] for m in models) - capacity)


def _u_max(
    current: Mapping[str, set[str]],
    instance: str,
    model: str,
    points: Sequence[DemandPoint],
    max_utilisation: float,
) -> float:
    """u_max(r) for r = (model, instance): the largest optimal u over ``points`` with r pruned;
    -inf when an LP fails."""
    trial = {i: (m - {model} if i == instance else m) for i, m in current.items()}
    worst = 0.0
    for point in points:
        try:
            worst = max(worst, balance(trial, point, max_utilisation=max_utilisation).utilisation)
        except CascadeError:
            return -math.inf
    return worst


def _signature(
    instance: str,
    current: Mapping[str, set[str]],
    points: Sequence[DemandPoint],
    instance_memory: Mapping[str, float],
) -> tuple[object, ...]:
    """What makes two instances interchangeable for the LPs: memory, hosted models and their
    runtimes at every point."""
    models = tuple(sorted(current[instance]))
    runtimes = tuple(tuple(p.runtime_s.get((m, instance)) for m in models) for p in points)
    return (instance_memory.get(instance), models, runtimes)
