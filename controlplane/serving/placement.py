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

Placement runs again whenever the fleet or a worker's health changes; it also drops the stages'
capacity estimates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from controlplane.policies.plan import StagePlan
from controlplane.serving.config import AppConfig
from controlplane.serving.stages import LatencyTable, Slot, Stage
from controlplane.serving.workers import Worker, WorkerEndpoint
from estimator.policies import full_range_types, policy_factory
from estimator.profiles import LatencyProfile

__all__ = ["Placement", "build_stage", "policy_name"]


def policy_name(
    plan: StagePlan | None, profiles: Mapping[str, LatencyProfile], slo_ms: float
) -> tuple[str, list[str]]:
    """The dispatch policy of a stage over the instance types in ``profiles`` and its base
    types: the plan's when it names one of fcfs or kairos, else the planner's rule (FCFS for one
    type; Kairos over a mix when a type serves the whole batch range within the SLO, the most
    cost-effective first; else FCFS)."""
    types = sorted(profiles)
    wanted = plan.policy if plan is not None else None
    if len(types) <= 1 or wanted == "fcfs":
        return "fcfs", types
    base = full_range_types(profiles, np.array([1]), slo_ms)
    if base and wanted in (None, "kairos"):
        return "kairos", base
    return "fcfs", base


def build_stage(stage: Stage, workers: Sequence[Worker], config: AppConfig) -> None:
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
        name, base = policy_name(config.stage_plans.get(stage.model), used, config.slo_ms)
        stage.policy = policy_factory(name, used, base)()
        stage.policy_name = name
        stage.policy_key = key
    elif not types:
        stage.policy = None
        stage.policy_key = ()
        stage.policy_name = ""


class Placement:
    """An app's workers by instance id, and their placement on its stages (see the module
    docstring)."""

    __slots__ = ("workers",)

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}

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

    def place(self, config: AppConfig, stages: Mapping[str, Stage]) -> None:
        """Assign the workers to ``stages`` (one per model of ``config``) and rebuild each
        (:func:`build_stage`)."""
        workers = sorted(self.workers.values(), key=lambda w: w.instance_id)
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
