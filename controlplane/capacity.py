"""Capacity fallback: re-plan an app around an instance type the cloud cannot supply.

This module owns :class:`CapacityReplanner`, the composition of the planner with the
reconciler's record of capacity misses. On EC2 a type can run out of capacity in every zone we
may use (``InsufficientInstanceCapacity``; the EC2 provisioner tries each subnet first): the
reconciler then keeps the instance's row ``requested`` and tries again every tick
(:meth:`controlplane.reconciler.Reconciler.capacity_misses` says for how long), while the app runs
short of what its plan promised. Heterogeneity is the way out: once a type of the applied plan
has missed for ``after_s`` (default :data:`DEFAULT_REPLAN_AFTER_S`), the replanner plans the app
again (:func:`controlplane.planner.plan_app`, the same trace an API preview at the plan's
``planned_rate_qps`` would use, :func:`controlplane.api.routes.plans.planning_trace`) with that
type capped at the instances of it the app already runs or has pending (``max_counts``; 0 takes
the type out), and

- when that plan is feasible (it serves the planned rate within the SLO and the budget), applies
  it and records a ``capacity_replan`` decision with the missing types, the caps and both plans'
  fleets and costs; the tuner restarts from the new plan and the reconciler drops the requests it
  could not fill (rows never launched go first) and launches the new mix;
- when it is not, records one ``capacity_unavailable`` decision saying so (with the highest rate
  a plan without the missing capacity serves) and leaves the applied plan alone: the reconciler
  keeps trying, and the operator decides (raise the budget, re-plan for less).

Each (plan, app version, missing types) is handled once, successful or not (a failed attempt
is logged; a change of the app, such as a new budget, makes it worth another). The re-plan
never looks back: when the type's capacity returns, the app stays on the plan without it until
an operator plans again. Planning takes seconds, so it runs in the reconcile job, after the
tick, and only when a miss is due. The budget holds throughout: the new plan is within it by
construction, and the reconciler's budget guard applies to every launch as always.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from controlplane.api.routes.plans import planning_trace
from controlplane.api.schemas import PlanIn
from controlplane.errors import ControlPlaneError
from controlplane.lifecycle import InstanceState
from controlplane.planner import plan_app
from controlplane.spec import ResolvedApp, SpecError
from controlplane.store import AppRecord, PlanRecord, Store
from estimator.errors import EstimatorError

__all__ = ["DEFAULT_REPLAN_AFTER_S", "CapacityReplanner", "plan_fleet_counts"]

logger = logging.getLogger(__name__)

# How long a type of the applied plan must have been short of capacity before the app is
# re-planned around it: a few reconcile ticks, so that a miss one retry fixes costs no plan.
DEFAULT_REPLAN_AFTER_S = 60.0

ResolveFn = Callable[[AppRecord], ResolvedApp]
MissesFn = Callable[[str], Mapping[str, float]]
"""An app -> {instance type: seconds since its current run of capacity misses began}."""

_LIVE = (InstanceState.PENDING.value, InstanceState.RUNNING.value)


def plan_fleet_counts(document: Mapping[str, Any]) -> dict[str, int]:
    """A plan document's instances by type, summed over its stages.

    >>> plan_fleet_counts({"stages": [{"fleet": {"a": 1}}, {"fleet": {"a": 2, "b": 1}}]})
    {'a': 3, 'b': 1}
    """
    counts: Counter[str] = Counter()
    for stage in document.get("stages") or []:
        for instance_type, count in (stage.get("fleet") or {}).items():
            counts[str(instance_type)] += int(count)
    return dict(counts)


class CapacityReplanner:
    """Re-plans apps whose applied plan names a type the cloud has not supplied for ``after_s``
    (see the module docstring); :meth:`tick` runs after each reconcile tick."""

    def __init__(
        self,
        store: Store,
        resolve: ResolveFn,
        misses: MissesFn,
        *,
        after_s: float = DEFAULT_REPLAN_AFTER_S,
    ) -> None:
        if not (math.isfinite(after_s) and after_s >= 0):
            raise ValueError(f"after_s must be finite and >= 0, got {after_s!r}")
        self._store = store
        self._resolve = resolve
        self._misses = misses
        self._after_s = float(after_s)
        # (plan id, app version, missing types) already tried: each is re-planned (or reported)
        # once; a change of the app (its budget, say) makes it worth another try.
        self._handled: set[tuple[int, int, frozenset[str]]] = set()

    def tick(self) -> list[str]:
        """One pass over the apps; the names of those re-planned."""
        replanned = []
        for app in self._store.list_apps():
            if app.applied_plan_id is None:
                continue
            try:
                if self._check(app):
                    replanned.append(app.name)
            except (ControlPlaneError, EstimatorError, SpecError, KeyError, ValueError) as error:
                # Deleted meanwhile, changed meanwhile, a plan the planner cannot redo: the app
                # stays on its plan and the next tick looks again.
                logger.warning("capacity: %s not re-planned: %s", app.name, error)
        return replanned

    def _check(self, app: AppRecord) -> bool:
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return False
        planned = plan_fleet_counts(plan.document)
        missing = frozenset(
            t
            for t, since_s in self._misses(app.name).items()
            if since_s >= self._after_s and planned.get(t, 0) > 0
        )
        key = (plan.id, app.version, missing)
        if not missing or key in self._handled:
            return False
        self._handled.add(key)  # also when it fails: no re-planning every tick
        return self._replan(app, plan, planned, missing)

    def _replan(
        self, app: AppRecord, plan: PlanRecord, planned: Mapping[str, int], missing: frozenset[str]
    ) -> bool:
        live = Counter(i.instance_type for i in self._store.list_instances(app.name, _LIVE))
        caps = {t: live.get(t, 0) for t in sorted(missing)}
        resolved = self._resolve(app)
        max_counts = {**(resolved.spec.max_counts or {}), **caps}
        capped = ResolvedApp(
            resolved.spec.model_copy(update={"max_counts": max_counts}),
            resolved.catalog,
            resolved.profiles,
            resolved.prices_usd_per_hr,
            resolved.validation,
        )
        rate = float(plan.document.get("planned_rate_qps") or 0.0)
        seed = int(plan.document.get("seed") or 0)
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"plan {plan.number} has no planned rate to plan for again")
        trace, stats = planning_trace(capped, PlanIn(rate_qps=rate, seed=seed))
        new = plan_app(capped, trace, seed=seed)
        names = ", ".join(sorted(missing))
        caps_text = ", ".join(f"{t} <= {n}" for t, n in caps.items())
        numbers: dict[str, Any] = {
            "missing_types": sorted(missing),
            "caps": caps,
            "planned_rate_qps": rate,
            "old_plan_id": plan.id,
            "old_fleet": dict(planned),
            "old_cost_usd_per_hr": plan.document.get("cost_usd_per_hr"),
        }
        if not new.feasible:
            self._store.record_decision(
                app.name,
                "capacity_unavailable",
                f"no capacity of {names} for {self._after_s:g} s or more; no plan with"
                f" {caps_text} serves {rate:g} qps within the SLO and the budget (at most"
                f" {new.max_feasible_qps or 0.0:.4g} qps): plan {plan.number} stays, its"
                " launches are retried",
                {**numbers, "max_feasible_qps": new.max_feasible_qps},
            )
            return False
        document = {**new.to_document(), "seed": seed, "trace": stats}
        document["steps"] = [
            f"re-planned because {names} had no capacity for {self._after_s:g} s or more:"
            f" {caps_text}",
            *document.get("steps", []),
        ]
        record = self._store.create_plan(app.name, document)
        applied = self._store.apply_plan(app.name, record.id, expected_version=app.version)
        fleet = plan_fleet_counts(applied.document)
        self._store.record_decision(
            app.name,
            "capacity_replan",
            f"no capacity of {names} for {self._after_s:g} s or more: plan {applied.number}"
            f" ({_fleet_text(fleet)}, {new.cost_usd_per_hr:.4g} USD/hr) replaces plan"
            f" {plan.number} ({_fleet_text(planned)}), with {caps_text}",
            {
                **numbers,
                "plan_id": applied.id,
                "plan_number": applied.number,
                "fleet": fleet,
                "cost_usd_per_hr": new.cost_usd_per_hr,
            },
        )
        logger.warning("capacity: %s re-planned around %s", app.name, names)
        return True


def _fleet_text(fleet: Mapping[str, int]) -> str:
    return ", ".join(f"{n} x {t}" for t, n in sorted(fleet.items()) if n) or "nothing"
