"""Which of an app's workers serve which of its stages, and with which dispatch policy.

This module owns the app's workers as the fleet lists them (:class:`Placement`: joined and left by
:meth:`Placement.update`, one :class:`~controlplane.serving.workers.Worker` per running instance)
and their placement on the stages (:meth:`Placement.place`):

- The plan's stage fleets place instances by type, in the cascade's order: a stage takes as many
  of each type as its fleet names, from the workers not yet placed. Workers left over serve every
  stage, and a stage the placement leaves without any serves on all of them (a query must never
  wait for a stage with no instance). So does a stage whose placed workers are all unhealthy,
  until one of them is back or the fleet changes: every worker agent loads the whole family, and
  a plan of one instance per stage must survive the loss of one (its queries go to the other
  stages' workers rather than fail).
- A stage's serving workers become its slots (what its policy sees: an index, a speed rank by the
  profile's mean at batch 1, the profile's largest batch) and its latency tables; its policy is
  rebuilt (:func:`policy_name`, :func:`estimator.policies.policy_factory`) only when its instance
  types or the configuration change (a new policy starts without what the old one learnt).

An app of several models (a cascade) is placed as CascadeServe places it instead (section 4.4,
SP3; :func:`colocate`, docs/cascades.md "Placement and load balancing (SP3)"): every healthy
worker starts out hosting every model it has a profile for, the greedy pruning of
:func:`controlplane.policies.load_balance.prune_placement` removes replicas until each worker's
models fit its memory (:attr:`AppConfig.model_memory_mb`, :attr:`AppConfig.instance_memory_mb`),
and the load-balancing LP (:func:`~controlplane.policies.load_balance.balance`) splits each
model's traffic over its hosts at the load of the gear in force. A stage's slots are then its
model's hosts (and the unhealthy workers, which serve nothing until they are back and the
placement runs again); its policy is :class:`~controlplane.serving.shares.SharePolicy` over
the LP's shares. The loads (:func:`demand_points`): with a gear plan, each of its cascades at
the highest QPS of the gear ranges it serves, QPS_m = that QPS x the model's reach share, at the
cascade's batch caps; the gear in force at its own point (without a gear plan: the plan's
``rate_qps`` x the reach shares on the validation records, 1 without them, at the stage's
batch cap). runtime(r) is the profile's mean latency per sample at that batch cap,
L_{m,t}(k) / k. The pruning may not push any load's u above max(1, u with every model
everywhere): a fleet short of its plan is still placed (its shares are the LP's best split,
and the status shows u > 1) rather than refused. When the placement cannot be made (nothing
fits, a model no healthy worker runs) the stages are placed as for one model, and the reason is
logged once. The placement is cached by its inputs (configuration, healthy workers, the gear's
cascade and caps).

Placement runs again whenever the fleet, a worker's health or (for a cascade) the gear in force
changes; it also drops the stages' capacity estimates.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from controlplane.policies.load_balance import DemandPoint, balance, prune_placement
from controlplane.policies.pipeline import MIX_POLICY, SINGLE_TYPE_POLICY, mix_policy
from controlplane.policies.plan import StagePlan
from controlplane.serving.config import AppConfig, ServingGear, batch_cap
from controlplane.serving.shares import SHARE_POLICY, SharePolicy
from controlplane.serving.stages import LatencyTable, ServingStage, Slot
from controlplane.serving.workers import Worker, WorkerEndpoint
from estimator.cascades import Cascade, evaluate
from estimator.errors import CascadeError, EstimatorError
from estimator.policies import full_range_types, policy_class, policy_factory
from estimator.profiles import LatencyProfile

__all__ = [
    "Colocation",
    "Placement",
    "build_stage",
    "colocate",
    "demand_points",
    "policy_name",
]

logger = logging.getLogger(__name__)


def policy_name(
    plan: StagePlan | None,
    profiles: Mapping[str, LatencyProfile],
    slo_ms: float,
    prices_usd_per_hr: Mapping[str, float] | None = None,
) -> tuple[str, list[str]]:
    """The dispatch policy of a stage over the instance types in ``profiles`` and its base
    types: FCFS for one type; over a mix, the plan's, but where the plan placed one type the
    planner's rule for a mix (Kairos; a plan of one type names FCFS by the single-type rule,
    :func:`~controlplane.policies.pipeline.mix_policy`); a policy that needs a base type runs
    when a type serves the whole batch range within the SLO, else FCFS. The base types are in
    the plan's order (``StagePlan.base_types``, what the planner simulated), those of them the
    stage has; types the plan does not rank (no plan
    yet, an older plan, a type the tuner added) follow the planner's rule, the most throughput
    per USD/hr first (Kairos' base-type rule, at batch size 1) where ``prices_usd_per_hr``
    prices every type, else by name."""
    types = sorted(profiles)
    if len(types) <= 1:
        return SINGLE_TYPE_POLICY, types
    wanted = (mix_policy(plan.policy, plan.fleet) if plan is not None else None) or MIX_POLICY
    if not policy_class(wanted).needs_base_type:
        return wanted, types
    prices = None
    if prices_usd_per_hr is not None and all(t in prices_usd_per_hr for t in types):
        prices = {t: prices_usd_per_hr[t] for t in types}
    base = full_range_types(profiles, np.array([1]), slo_ms, prices)
    if plan is not None:
        base = plan.in_base_order(base)
    if base:
        return wanted, base
    return SINGLE_TYPE_POLICY, base


def build_stage(stage: ServingStage, workers: Sequence[Worker], config: AppConfig) -> None:
    """Make ``workers`` (those of them with a profile for the stage's model) the stage's slots,
    rebuild its latency tables, and its policy where its instance types or the configuration
    changed; the capacity estimates are dropped."""
    stage.capacity.clear()
    profiles = config.profiles.get(stage.model, {})
    usable = [w for w in workers if w.instance_type in profiles]
    types = sorted({w.instance_type for w in usable})
    stage.latency = {t: LatencyTable(profiles[t]) for t in types}
    ranked = sorted(types, key=lambda t: (stage.latency[t].ms(1), t))
    rank = {t: i for i, t in enumerate(ranked)}
    stage.slots = [
        Slot(i, w, rank[w.instance_type], stage.latency[w.instance_type].max_batch_size)
        for i, w in enumerate(usable)
    ]
    key = (*types, str(config.version))
    if types and key != stage.policy_key:
        used = {t: profiles[t] for t in types}
        name, base = policy_name(
            config.stage_plans.get(stage.model),
            used,
            config.dispatch_slo_ms,
            config.prices_usd_per_hr,
        )
        stage.policy = policy_factory(name, used, base)()
        stage.policy_name = name
        stage.policy_key = key
    elif not types:
        stage.policy = None
        stage.policy_key = ()
        stage.policy_name = ""


# --- the co-located placement of a cascade (SP3) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Colocation:
    """A cascade's placement on the healthy workers: the models each hosts (by instance id),
    each model's share per hosting instance, the LP's u at the load in force and that load's
    label."""

    hosts: Mapping[str, frozenset[str]]
    shares: Mapping[str, Mapping[str, float]]
    utilisation: float
    load: str


def _runtime_s(profile: LatencyProfile, cap: int) -> float:
    """Seconds per sample at a batch of ``cap`` (within the profiled sizes)."""
    k = max(profile.min_batch_size, min(max(cap, 1), profile.max_batch_size))
    return profile.mean_latency_ms(k) / 1000.0 / k


def _point(
    config: AppConfig,
    instances: Sequence[tuple[str, str]],
    cascade: Cascade,
    reach: Sequence[float],
    qps: float,
    caps: Mapping[str, int],
) -> DemandPoint:
    demand = {m: max(qps, 0.0) * float(r) for m, r in zip(cascade.models, reach, strict=False)}
    runtime: dict[tuple[str, str], float] = {}
    for model in config.models:
        profiles = config.profiles.get(model, {})
        cap = caps.get(model, 1)
        for instance_id, instance_type in instances:
            profile = profiles.get(instance_type)
            if profile is not None:
                runtime[(model, instance_id)] = _runtime_s(profile, cap)
    return DemandPoint(demand, runtime, f"at {cascade.label}, {qps:g} qps")


def demand_points(
    config: AppConfig, instances: Sequence[tuple[str, str]], gear: ServingGear
) -> tuple[list[DemandPoint], DemandPoint]:
    """The loads the placement must serve on ``instances`` ((id, type) pairs) and the load in
    force under ``gear`` (see the module docstring)."""
    points: list[DemandPoint] = []
    in_force: DemandPoint | None = None
    plan = config.gear_plan
    if plan is not None:
        top: dict[int, float] = {}
        for g in plan.gears:
            top[g.option] = max(top.get(g.option, 0.0), g.high_qps)
        for index, qps in sorted(top.items()):
            option = plan.options[index]
            cascade = option.cascade
            if not all(m in config.models for m in cascade.models) or not math.isfinite(qps):
                continue
            caps = dict(zip(cascade.models, option.max_batch_queries, strict=False))
            point = _point(config, instances, cascade, option.quality.reach_share, qps, caps)
            points.append(point)
            if cascade == gear.cascade:
                in_force = point
    if in_force is None:
        cascade = gear.cascade
        reach: Sequence[float] = [1.0] * len(cascade.models)
        records = config.validation
        if records is not None and all(m in records.models for m in cascade.models):
            with contextlib.suppress(EstimatorError):
                reach = evaluate(cascade, records).reach_share
        caps = {m: batch_cap(config, m, gear) for m in config.models}
        in_force = _point(config, instances, cascade, reach, config.planned_rate_qps, caps)
        points.append(in_force)
    return points, in_force


def colocate(config: AppConfig, workers: Sequence[Worker], gear: ServingGear) -> Colocation:
    """The co-located placement of ``config``'s models on the healthy ``workers`` and the LP's
    shares at the load in force under ``gear`` (see the module docstring).

    Raises:
        CascadeError: no healthy worker, a model no healthy worker runs, or no placement that
            fits memory (:func:`~controlplane.policies.load_balance.prune_placement`).
    """
    healthy = [(w.instance_id, w.instance_type) for w in workers if w.healthy]
    if not healthy:
        raise CascadeError("placement", "no healthy worker")
    hosts = {
        i: frozenset(m for m in config.models if t in config.profiles.get(m, {}))
        for i, t in healthy
    }
    for model in config.models:
        if not any(model in models for models in hosts.values()):
            raise CascadeError("placement", f"no healthy worker runs {model!r}")
    points, in_force = demand_points(config, healthy, gear)
    memory = {i: config.instance_memory_mb[t] for i, t in healthy if t in config.instance_memory_mb}
    over = any(
        sum(config.model_memory_mb.get(m, 0.0) for m in hosts[i]) > memory[i] for i in memory
    )
    if over:
        full = max(balance(hosts, p, max_utilisation=math.inf).utilisation for p in points)
        pruning = prune_placement(
            hosts,
            points,
            {m: config.model_memory_mb.get(m, 0.0) for m in config.models},
            memory,
            max_utilisation=max(1.0, full),
        )
        hosts = dict(pruning.hosts)
    lp = balance(hosts, in_force, max_utilisation=math.inf, spread=True)
    shares: dict[str, dict[str, float]] = {m: {} for m in config.models}
    for (model, instance_id), share in lp.shares.items():
        shares[model][instance_id] = share
    return Colocation(hosts, shares, lp.utilisation, in_force.label)


class Placement:
    """An app's workers by instance id, and their placement on its stages (see the module
    docstring)."""

    __slots__ = ("_cache", "_logged", "workers")

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self._cache: tuple[tuple[object, ...], Colocation | None] | None = None
        self._logged: set[str] = set()

    def update(self, endpoints: Sequence[WorkerEndpoint], now_s: float) -> bool:
        """The app's running workers now: new ones join (healthy), gone ones leave (a batch they
        hold still completes or fails as it will), a worker whose endpoint changed is new.
        Whether anything changed (then place again)."""
        listed = {e.instance_id: e for e in endpoints}
        workers = self.workers
        changed = False
        for instance_id in [i for i in workers if i not in listed]:
            del workers[instance_id]
            changed = True
        for instance_id, endpoint in listed.items():
            worker = workers.get(instance_id)
            if worker is None or worker.endpoint != endpoint:
                workers[instance_id] = Worker(endpoint, now_s)
                changed = True
        return changed

    def stale(self, config: AppConfig, gear: ServingGear) -> bool:
        """Whether placing again under ``gear`` may place a cascade otherwise (its gear's cascade
        or caps differ from those of the last placement)."""
        if len(config.models) <= 1 or self._cache is None:
            return False
        return self._cache[0][-1] != _gear_key(config, gear)

    def place(
        self, config: AppConfig, stages: Mapping[str, ServingStage], gear: ServingGear | None = None
    ) -> None:
        """Assign the workers to ``stages`` (one per model of ``config``) and rebuild each
        (:func:`build_stage`); a cascade is co-located under ``gear`` (default: the app's own
        cascade)."""
        workers = sorted(self.workers.values(), key=lambda w: w.instance_id)
        if len(config.models) > 1:
            layout = self._colocation(config, workers, gear or ServingGear(config.cascade))
            if layout is not None:
                _place_colocated(layout, config, stages, workers)
                return
        for stage in stages.values():
            stage.shares = {}
            stage.lp_utilisation = None
            if stage.policy_name == SHARE_POLICY:
                stage.policy_key = ()  # the stage's own policy again
        placed: dict[str, list[Worker]] = {m: [] for m in config.models}
        free = list(workers)
        for model in config.models:
            plan = config.stage_plans.get(model)
            if plan is None or not plan.fleet:
                continue
            for instance_type, count in plan.fleet.items():
                chosen = [w for w in free if w.instance_type == instance_type][: max(count, 0)]
                placed[model].extend(chosen)
                free = [w for w in free if w not in chosen]
        for model in config.models:
            own = placed[model]
            serving = own + free if any(w.healthy for w in own) else list(workers)
            build_stage(stages[model], serving, config)

    def _colocation(
        self, config: AppConfig, workers: Sequence[Worker], gear: ServingGear
    ) -> Colocation | None:
        """:func:`colocate`, cached by its inputs; None (logged once per reason) where it
        cannot be made."""
        healthy = tuple((w.instance_id, w.instance_type) for w in workers if w.healthy)
        key = (config, healthy, _gear_key(config, gear))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        layout: Colocation | None = None
        if healthy:
            try:
                layout = colocate(config, workers, gear)
            except CascadeError as error:
                reason = f"{config.name}: {error}"
                if reason not in self._logged:
                    self._logged.add(reason)
                    logger.warning(
                        "%s; its stages are placed as for one model (every worker serves)",
                        reason,
                    )
        self._cache = (key, layout)
        return layout


def _gear_key(config: AppConfig, gear: ServingGear) -> tuple[object, ...]:
    caps = tuple(batch_cap(config, m, gear) for m in config.models)
    return (gear.cascade.models, gear.cascade.thresholds, caps)


def _place_colocated(
    layout: Colocation,
    config: AppConfig,
    stages: Mapping[str, ServingStage],
    workers: Sequence[Worker],
) -> None:
    """Each stage's slots are its model's hosts (then the unhealthy workers), under a
    :class:`SharePolicy` of the layout's shares; a stage whose hosts and shares did not change
    keeps its policy (and its counts)."""
    unhealthy = [w for w in workers if not w.healthy]
    for model in config.models:
        stage = stages[model]
        hosting = [w for w in workers if w.healthy and model in layout.hosts.get(w.instance_id, ())]
        previous, previous_key = stage.policy, stage.policy_key
        build_stage(stage, hosting + unhealthy, config)
        own = layout.shares.get(model, {})
        stage.shares = {w.instance_id: own.get(w.instance_id, 0.0) for w in hosting}
        stage.lp_utilisation = layout.utilisation
        by_index = {
            slot.index: stage.shares.get(slot.worker.instance_id, 0.0) for slot in stage.slots
        }
        key = (SHARE_POLICY, *(slot.worker.instance_id for slot in stage.slots))
        if (
            isinstance(previous, SharePolicy)
            and previous_key == key
            and previous.shares == by_index
        ):
            stage.policy = previous
        else:
            stage.policy = SharePolicy(by_index)
        stage.policy_name = SHARE_POLICY
        stage.policy_key = key
