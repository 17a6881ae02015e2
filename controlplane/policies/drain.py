"""Fitting a fleet under a budget: which instances to drain when the budget falls below the
fleet's cost.

A policy in the STYLE.md sense: a pure function of the instances, their prices and how much each
type serves, returning a decision (:class:`DrainPlan`); the reconciler acts on it. The rule:

- the fleet's cost is the price sum of its *live* instances (every state but terminated and
  failed); instances already draining or terminating are on their way out, so the *kept* cost
  is that of the requested, pending and running ones;
- while the kept cost exceeds the budget, drain the kept instance of lowest value per dollar
  v_t = Q_t / P_t (Q_t: queries per second one instance of type t serves, Kairos' Q_t on the
  reference batch size; P_t its price in USD/hr), the least cost-effective first; among equals,
  one that does not serve yet (requested, pending) before one that does, then the dearer, then
  the newer;
- given the plan's stages (``stage_types``: each stage's planned instance types), the last
  instance of each stage is kept: before ranking, each stage that still has a kept instance of
  one of its types gets a keeper (one that serves before one that does not, then the cheaper,
  then the older; an instance of a type two stages plan keeps both), and keepers are never
  drained. The kept cost may then stay above the budget; the caller checks the budget against
  :func:`serving_floor` first, and a forced change passes no stages (everything may go).

A shrink of the fleet (a plan or the tuner wanting fewer instances) keeps the last *serving*
instance of each stage the same way (:func:`spare_last_serving`): when the instances that stay
leave a stage that serves now with no ``running`` instance of its planned types (those that stay
may still be booting), the best running one of those leaving (the cheapest, then the oldest)
stays until another serves. Only a teardown (``heteroplane app down``) or a budget that cannot
pay for it (the budget is a hard limit) takes a stage's last instance.

The app's smallest serving fleet (:func:`serving_floor`) is one instance of the cheapest planned
type on every stage: F = sum over stages s of min over the types t planned on s of P_t.

>>> from datetime import UTC, datetime
>>> t = datetime(2024, 1, 1, tzinfo=UTC)
>>> fleet = [
...     DrainInstance("a", "g4dn.xlarge", "running", 0.526, t),
...     DrainInstance("b", "t3.xlarge", "running", 0.166, t),
... ]
>>> plan = plan_drain(fleet, 0.6, {"g4dn.xlarge": 100.0, "t3.xlarge": 10.0})
>>> [c.id for c in plan.drain], round(plan.kept_cost_usd_per_hr, 3)
(['b'], 0.526)
>>> floor = serving_floor({"m": {"g4dn.xlarge": 2, "t3.xlarge": 1}}, {"g4dn.xlarge": 0.526,
...     "t3.xlarge": 0.166})
>>> floor.cost_usd_per_hr, floor.describe()
(0.166, 'one t3.xlarge per stage')
>>> [c.id for c in plan_drain(fleet, 0.1, {}, stage_types={"m": ["t3.xlarge"]}).drain]
['a']
>>> spare_last_serving([], fleet, {"m": ["t3.xlarge", "g4dn.xlarge"]})
('b',)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from controlplane.policies.lifecycle import LIVE_STATES, InstanceState, billed_cost_usd_per_hr
from controlplane.spec import ResolvedApp

__all__ = [
    "DrainCandidate",
    "DrainInstance",
    "DrainPlan",
    "ServingFloor",
    "guard_drain",
    "plan_drain",
    "pooled_stages",
    "qps_by_type",
    "serving_floor",
    "spare_last_serving",
    "with_leftover_types",
    "workers_to_end",
]

_LEAVING = frozenset({InstanceState.DRAINING, InstanceState.TERMINATING})
# Among instances of equal value, drop first the ones that do not serve yet.
_STATE_ORDER = {InstanceState.REQUESTED: 0, InstanceState.PENDING: 1, InstanceState.RUNNING: 2}


@dataclass(frozen=True, slots=True)
class DrainInstance:
    """What the policy needs to know of an instance."""

    id: str
    instance_type: str
    state: str
    price_usd_per_hr: float  # the price now (a spot instance's may have moved since its launch)
    created_at: datetime

    @property
    def cost_usd_per_hr(self) -> float:
        return self.price_usd_per_hr


@dataclass(frozen=True, slots=True)
class DrainCandidate:
    """An instance to drain, with the value per dollar that ranked it."""

    id: str
    instance_type: str
    state: str
    price_usd_per_hr: float
    qps_per_usd: float


@dataclass(frozen=True, slots=True)
class DrainPlan:
    """The fleet's cost, what it costs once the drained and leaving instances are gone, and the
    instances to drain (least cost-effective first; empty when the fleet fits)."""

    budget_usd_per_hr: float
    fleet_cost_usd_per_hr: float
    kept_cost_usd_per_hr: float
    drain: tuple[DrainCandidate, ...]

    @property
    def saved_usd_per_hr(self) -> float:
        return float(sum(c.price_usd_per_hr for c in self.drain))


@dataclass(frozen=True, slots=True)
class ServingFloor:
    """The app's smallest serving fleet: its cost and, per stage, the cheapest planned type
    (``cheapest``: (stage, instance type) pairs, in the plan's order)."""

    cost_usd_per_hr: float
    cheapest: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """What the fleet is, in words (``one t3.xlarge per stage``)."""
        types = {instance_type for _, instance_type in self.cheapest}
        if not types:
            return "no instance"
        if len(types) == 1:
            return f"one {next(iter(types))} per stage"
        return ", ".join(f"one {t} for {stage}" for stage, t in self.cheapest)


def serving_floor(
    stages: Mapping[str, Mapping[str, int]], prices_usd_per_hr: Mapping[str, float]
) -> ServingFloor:
    """The cheapest fleet that keeps one instance on every stage of a plan: for each stage
    (name -> its fleet, type -> count), the cheapest of its planned types (count > 0), summed
    over the stages. A stage that plans no priced type adds nothing (it cannot be kept)."""
    cheapest: list[tuple[str, str]] = []
    cost = 0.0
    for stage, fleet in stages.items():
        priced = [t for t, count in fleet.items() if count > 0 and t in prices_usd_per_hr]
        if not priced:
            continue
        best = min(priced, key=lambda t: (prices_usd_per_hr[t], t))
        cheapest.append((stage, best))
        cost += prices_usd_per_hr[best]
    return ServingFloor(cost_usd_per_hr=cost, cheapest=tuple(cheapest))


def pooled_stages(stages: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Each stage (name -> its fleet) served by every type the plan places on any stage, the
    counts summed: how an app INFaaS's autoscaler scales (``scaling: infaas``) is served and
    guarded, since that policy drains a variant once the other instances carry each of its
    models and every worker serves every stage.

    >>> pooled_stages({"a": {"cpu": 2}, "b": {"gpu": 1, "cpu": 0}})
    {'a': {'cpu': 2, 'gpu': 1}, 'b': {'cpu': 2, 'gpu': 1}}
    """
    every: dict[str, int] = {}
    for fleet in stages.values():
        for instance_type, count in fleet.items():
            every[instance_type] = every.get(instance_type, 0) + count
    return {name: dict(every) for name in stages}


def _keepers(kept: list[DrainInstance], stage_types: Mapping[str, Collection[str]]) -> set[str]:
    """One kept instance per stage that has one (see the module docstring); their ids."""
    chosen: list[DrainInstance] = []
    for types in stage_types.values():
        if any(i.instance_type in types for i in chosen):
            continue
        serving = [i for i in kept if i.instance_type in types]
        if serving:
            chosen.append(
                min(
                    serving,
                    key=lambda i: (
                        -_STATE_ORDER.get(InstanceState(i.state), 3),
                        i.price_usd_per_hr,
                        i.created_at.timestamp(),
                        i.id,
                    ),
                )
            )
    return {i.id for i in chosen}


def spare_last_serving(
    staying: Iterable[DrainInstance],
    leaving: Iterable[DrainInstance],
    stage_types: Mapping[str, Collection[str]],
) -> tuple[str, ...]:
    """The ids of the instances of ``leaving`` to keep so that no stage that serves now is left
    without a serving instance (see the module docstring): for each stage (name -> its planned
    types) with no ``running`` instance of its types among ``staying`` nor among those spared
    already, the running one of ``leaving`` on its types that is cheapest, then oldest. A stage
    with no running instance in ``leaving`` either is left as it is (nothing of it serves)."""
    running = InstanceState.RUNNING.value
    staying_types = {i.instance_type for i in staying if i.state == running}
    candidates = [i for i in leaving if i.state == running]
    spared: list[DrainInstance] = []
    for types in stage_types.values():
        if staying_types.intersection(types) or any(i.instance_type in types for i in spared):
            continue
        serving = [i for i in candidates if i.instance_type in types]
        if serving:
            spared.append(
                min(serving, key=lambda i: (i.price_usd_per_hr, i.created_at.timestamp(), i.id))
            )
    return tuple(i.id for i in spared)


def _value_per_usd(qps: float, price_usd_per_hr: float) -> float:
    if price_usd_per_hr <= 0:
        return math.inf  # free capacity is never the one to drop
    return qps / price_usd_per_hr


def _fits(cost_usd_per_hr: float, budget_usd_per_hr: float) -> bool:
    """Whether a cost is within a budget, with a small tolerance: 0.1 + 0.2 fits a budget of
    0.3."""
    return cost_usd_per_hr <= budget_usd_per_hr + 1e-9


def workers_to_end(
    fleet_usd_per_hr: float,
    workers: Iterable[tuple[str, str, float]],
    budget_usd_per_hr: float,
) -> list[str]:
    """The profile runs' and rollouts' workers (``workers``: (id, group, price) each, the group
    a profile run's or a rollout's, :func:`~controlplane.policies.lifecycle.profiling_group`)
    that go first when the fleet (``fleet_usd_per_hr``) and they cost more than the budget:
    whole groups (a run or a rollout missing one of its workers is over anyway), a profile run's
    before a rollout's (which may serve queries), the dearest first, until the rest fits; their
    ids, none when all fits.

    >>> w = [("a", "run x", 0.1), ("b", "run x", 0.1), ("c", "rollout 1", 0.1)]
    >>> workers_to_end(0.3, w, 0.45), workers_to_end(0.3, w, 0.35), workers_to_end(0.3, w, 0.6)
    (['a', 'b'], ['a', 'b', 'c'], [])
    """
    groups: dict[str, list[tuple[str, float]]] = {}
    for worker_id, group, price in workers:
        groups.setdefault(group, []).append((worker_id, price))
    cost = {group: float(sum(p for _, p in members)) for group, members in groups.items()}
    reserved = float(sum(cost.values()))
    ended: list[str] = []
    for group in sorted(groups, key=lambda g: (g.startswith("rollout"), -cost[g], g)):
        if _fits(fleet_usd_per_hr + reserved, budget_usd_per_hr):
            break
        ended.extend(worker_id for worker_id, _ in groups[group])
        reserved -= cost[group]
    return ended


def plan_drain(
    instances: Iterable[DrainInstance],
    budget_usd_per_hr: float,
    qps_by_type: Mapping[str, float],
    *,
    stage_types: Mapping[str, Collection[str]] | None = None,
    workers: Mapping[str, str] | None = None,
) -> DrainPlan:
    """The instances to drain so that the kept fleet costs at most ``budget_usd_per_hr``
    (see the module docstring). A type missing from ``qps_by_type`` serves nothing (Q_t = 0).
    With ``stage_types`` (stage -> its planned types), the last instance of each stage stays.
    ``workers`` (id -> group): the instances among them that are a profile run's or a
    rollout's, not the fleet's; they go first, as the reconciler's budget guard ends them
    (:func:`workers_to_end`), and never stand for a stage."""
    live = [i for i in instances if i.state in LIVE_STATES]
    fleet_cost = billed_cost_usd_per_hr(live)  # as the fleet route costs it
    kept = [i for i in live if i.state not in _LEAVING]
    kept_cost = float(sum(i.price_usd_per_hr for i in kept))
    drain: list[DrainCandidate] = []
    groups = workers or {}
    if groups:
        extra = [i for i in kept if i.id in groups]
        kept = [i for i in kept if i.id not in groups]
        ending = set(
            workers_to_end(
                float(sum(i.price_usd_per_hr for i in kept)),
                ((i.id, groups[i.id], i.price_usd_per_hr) for i in extra),
                budget_usd_per_hr,
            )
        )
        for instance in (i for i in extra if i.id in ending):
            drain.append(_candidate(instance, 0.0))
            kept_cost -= instance.price_usd_per_hr
    keepers = _keepers(kept, stage_types) if stage_types else set()
    ranked = sorted(
        (i for i in kept if i.id not in keepers),
        key=lambda i: (
            _value_per_usd(qps_by_type.get(i.instance_type, 0.0), i.price_usd_per_hr),
            _STATE_ORDER.get(InstanceState(i.state), 3),
            -i.price_usd_per_hr,
            -i.created_at.timestamp(),
            i.id,
        ),
    )
    for instance in ranked:
        if _fits(kept_cost, budget_usd_per_hr):
            break
        drain.append(
            _candidate(
                instance,
                _value_per_usd(
                    qps_by_type.get(instance.instance_type, 0.0), instance.price_usd_per_hr
                ),
            )
        )
        kept_cost -= instance.price_usd_per_hr
    return DrainPlan(
        budget_usd_per_hr=budget_usd_per_hr,
        fleet_cost_usd_per_hr=fleet_cost,
        kept_cost_usd_per_hr=max(kept_cost, 0.0),
        drain=tuple(drain),
    )


def with_leftover_types(
    stage_types: Mapping[str, Collection[str]], instance_types: Iterable[str]
) -> dict[str, list[str]]:
    """``stage_types`` (stage -> its planned types) with, on every stage, the types of
    ``instance_types`` that no stage plans (a type a new plan dropped, one the tuner added):
    such instances serve every stage (``controlplane.serving.placement``), so the budget guard
    counts them on each.

    >>> with_leftover_types({"a": ["cpu"], "b": ["gpu"]}, ["cpu", "big", "gpu"])
    {'a': ['cpu', 'big'], 'b': ['gpu', 'big']}
    """
    planned = {t for types in stage_types.values() for t in types}
    leftover = sorted(set(instance_types) - planned)
    return {name: [*types, *leftover] for name, types in stage_types.items()}


def guard_drain(
    instances: Iterable[DrainInstance],
    budget_usd_per_hr: float,
    qps_by_type: Mapping[str, float],
    stage_types: Mapping[str, Collection[str]] | None = None,
    *,
    workers: Mapping[str, str] | None = None,
) -> DrainPlan:
    """The budget guard's drain (the reconciler's rule 6), which a budget change's
    ``budget_drain`` decision names too, so that the decision says what is drained:
    :func:`plan_drain`'s least cost-effective first, unless that leaves a stage (``stage_types``)
    that has a kept instance of its types with none, or one that serves now (``running``) with
    none serving, and the fleet that keeps one per stage (:func:`plan_drain` with the stages,
    whose keepers serve before those still booting) fits the budget: then that one. The budget
    is a hard limit, forced or not: where the fleet that keeps one per stage does not fit (its
    serving keeper dearer than the budget, or a budget still below the floor after a forced
    cut and a raise), the guard drains least cost-effective first, and so does the decision
    (a decision that kept more named instances the guard did not drain). A cheap
    instance serving beside a dear one still booting (a mix change on a rise) is the least
    cost-effective; drained first, the stage served nothing until the dear one booted.

    >>> from datetime import UTC, datetime
    >>> t = datetime(2024, 1, 1, tzinfo=UTC)
    >>> fleet = [
    ...     DrainInstance("cheap", "cpu", "running", 0.05, t),
    ...     DrainInstance("dear", "gpu", "pending", 0.1, t),
    ... ]
    >>> qps = {"cpu": 25.0, "gpu": 100.0}
    >>> [c.id for c in plan_drain(fleet, 0.1, qps).drain]
    ['cheap']
    >>> [c.id for c in guard_drain(fleet, 0.1, qps, {"m": ["cpu", "gpu"]}).drain]
    ['dear']
    """
    instances = list(instances)
    drain = plan_drain(instances, budget_usd_per_hr, qps_by_type, workers=workers)
    if not drain.drain or not stage_types:
        return drain
    groups = workers or {}
    kept = [
        i
        for i in instances
        if i.state in LIVE_STATES and i.state not in _LEAVING and i.id not in groups
    ]
    going = {c.id for c in drain.drain}
    staying = [i for i in kept if i.id not in going]
    running = InstanceState.RUNNING.value

    def emptied(types: Collection[str]) -> bool:
        had = [i for i in kept if i.instance_type in types]
        left = [i for i in staying if i.instance_type in types]
        if had and not left:
            return True
        return any(i.state == running for i in had) and not any(i.state == running for i in left)

    if not any(emptied(types) for types in stage_types.values()):
        return drain
    keeping = plan_drain(
        instances, budget_usd_per_hr, qps_by_type, stage_types=stage_types, workers=workers
    )
    if _fits(keeping.kept_cost_usd_per_hr, budget_usd_per_hr):
        return keeping
    return drain


def _candidate(instance: DrainInstance, qps_per_usd: float) -> DrainCandidate:
    return DrainCandidate(
        id=instance.id,
        instance_type=instance.instance_type,
        state=instance.state,
        price_usd_per_hr=instance.price_usd_per_hr,
        qps_per_usd=qps_per_usd,
    )


def qps_by_type(app: ResolvedApp, batch_size: int) -> dict[str, float]:
    """Q_t of each candidate type: the queries per second one instance serves at
    ``batch_size`` (1000 / mean latency; clipped to the type's measured range), for the first
    model every query visits."""
    model = app.spec.serving_order[0]
    rates: dict[str, float] = {}
    for instance_type in app.instance_types:
        profile = app.profile(model, instance_type)
        size = min(max(batch_size, profile.min_batch_size), profile.max_batch_size)
        rates[instance_type] = profile.rate_qps(np.array([size], dtype=np.int64))
    return rates
