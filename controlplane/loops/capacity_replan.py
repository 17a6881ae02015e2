"""Capacity fallback: re-plan an app around an instance type the cloud cannot supply.

This module owns :class:`CapacityReplanner`, the composition of the planner with the
reconciler's record of capacity misses. On EC2 a type can run out of capacity in every zone we
may use (``InsufficientInstanceCapacity``; the EC2 provisioner tries each subnet first): the
reconciler then keeps the instance's row ``requested`` and tries again every tick
(:meth:`controlplane.loops.reconciler.Reconciler.capacity_misses` says for how long), while the app
runs short of what its plan promised. Heterogeneity is the way out: once a type of the applied plan
has missed for ``after_s`` (default :data:`DEFAULT_REPLAN_AFTER_S`), the replanner plans the app
again (:func:`controlplane.policies.planner.plan_app`, with spot where the app buys it as every plan
of it is made, on the plan's own planning trace, made again
from the generator parameters the API stored with it, ``trace.request``; a plan without them, a
Poisson trace at its ``planned_rate_qps``: :func:`controlplane.apps.plans.planning_trace`)
with that type capped at the instances of it the app already runs or has pending (``max_counts``,
never above the spec's own cap; 0 takes the type out). A type counts as missing only while the
plan asks for more of it than run or are pending: launches the tuner added above the plan are
the tuner's to give up, not a reason to re-plan. Then

- when that plan is feasible (it serves the planned rate within the SLO and the budget), asks
  for no more of the missing types than the caps in all (the caps hold per stage: a cascade
  could otherwise place them twice) and differs from the applied one, applies it and records a
  ``capacity_replan`` decision with the missing types, the caps and both plans' fleets and
  costs; the tuner restarts from the new plan and the reconciler drops the requests it could not
  fill (rows never launched go first) and launches the new mix;
- when it is not feasible, or needs more of a missing type than its cap, records one
  ``capacity_unavailable`` decision saying so (with the highest rate a plan without the missing
  capacity serves) and leaves the applied plan alone: the reconciler keeps trying, and the
  operator decides (raise the budget, re-plan for less); when it is the applied plan again,
  nothing happens.

Each (plan, app version, missing types) is handled once, successful or not (a failed attempt
is logged; a change of the app, such as a new budget, makes it worth another). The re-plan
never looks back: when the type's capacity returns, the app stays on the plan without it until
an operator plans again. Planning takes seconds, so it runs in the reconcile job, after the
tick, and only when a miss is due. The budget holds throughout: the new plan is within it by
construction, and the reconciler's budget guard applies to every launch as always.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from controlplane.apps.plans import (
    PlanRequest,
    burstiness_replanning_request,
    planning_trace,
    provider_prices,
    rate_request,
)
from controlplane.db.store import AppRecord, PlanRecord, Store
from controlplane.errors import ControlPlaneError, InvalidValueError, app_gone
from controlplane.loops.live_tuner import ResolveFn
from controlplane.policies.lifecycle import InstanceState, is_profile_worker
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import SpotPricesFn, plan_with_spot
from controlplane.spec import SpecError
from estimator import deadline
from estimator.errors import EstimatorError

__all__ = ["DEFAULT_REPLAN_AFTER_S", "CapacityReplanner", "each_planned_app", "planning_request"]

logger = logging.getLogger(__name__)

# How long a type of the applied plan must have been short of capacity before the app is
# re-planned around it: a few reconcile ticks, so that a miss one retry fixes costs no plan.
DEFAULT_REPLAN_AFTER_S = 60.0
# One re-plan may run this long (the settings' plan_deadline_s default): past it, the reconcile
# job goes on and the app is reported, as any plan that fails.
DEFAULT_PLAN_DEADLINE_S = 60.0

MissesFn = Callable[[str], Mapping[str, float]]
"""An app -> {instance type: seconds since its current run of capacity misses began}."""

_LIVE = (InstanceState.PENDING.value, InstanceState.RUNNING.value)


class CapacityReplanner:
    """Re-plans apps whose applied plan names a type the cloud has not supplied for ``after_s``
    (see the module docstring); :meth:`tick` runs after each reconcile tick. An app whose spec
    buys spot is planned with it (:func:`~controlplane.policies.spot.plan_with_spot`), at
    ``spot_prices`` (the provider's) where given, else the catalog's."""

    def __init__(
        self,
        store: Store,
        resolve: ResolveFn,
        misses: MissesFn,
        *,
        after_s: float = DEFAULT_REPLAN_AFTER_S,
        deadline_s: float = DEFAULT_PLAN_DEADLINE_S,
        spot_prices: SpotPricesFn | None = None,
    ) -> None:
        if not (math.isfinite(after_s) and after_s >= 0):
            raise ValueError(f"after_s must be finite and >= 0, got {after_s!r}")
        self._store = store
        self._resolve = resolve
        self._misses = misses
        self._after_s = float(after_s)
        self._deadline_s = float(deadline_s)
        self._spot_prices = spot_prices  # the provider's, for apps that buy spot (docs/spot.md)
        # Per app, the (plan id, app version, missing types) already tried: each is re-planned
        # (or reported) once; a change of the app (its budget, say) makes it worth another try.
        # Only the applied plan's keys are kept.
        self._handled: dict[str, set[tuple[int, int, frozenset[str]]]] = {}

    def tick(self) -> list[str]:
        """One pass over the apps; the names of those re-planned. An attempt that fails (the
        app deleted or changed meanwhile, a plan the planner cannot redo) leaves the app on its
        plan, and is not repeated until the app changes."""
        return each_planned_app(self._store, self._handled, self._check, "capacity")

    def _check(self, app: AppRecord) -> bool:
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return False
        planned = plan.plan.fleet
        due = [t for t, since_s in self._misses(app.name).items() if since_s >= self._after_s]
        if not due:
            return False
        live = Counter(
            i.instance_type
            for i in self._store.list_instances(app.name, _LIVE)
            if not is_profile_worker(i.request_id)  # a profile run's worker serves no plan
        )
        # Missing: the plan asks for more than run (or are pending); what the tuner added above
        # the plan is the tuner's to give up.
        missing = frozenset(t for t in due if planned.get(t, 0) > live.get(t, 0))
        handled = self._handled.setdefault(app.name, set())
        key = (plan.id, app.version, missing)
        if not missing or key in handled:
            return False
        handled.intersection_update({k for k in handled if k[0] == plan.id})
        handled.add(key)  # also when it fails: no re-planning every tick
        return self._replan(app, plan, planned, missing, live)

    def _replan(
        self,
        app: AppRecord,
        plan: PlanRecord,
        planned: Mapping[str, int],
        missing: frozenset[str],
        live: Mapping[str, int],
    ) -> bool:
        resolved = self._resolve(app)
        limits = resolved.constraints.capped({t: live.get(t, 0) for t in sorted(missing)})
        caps = limits.caps(sorted(missing))
        capped = resolved.with_constraints(limits)
        request = planning_request(plan)
        rate = plan.plan.planned_rate_qps
        seed = request.seed
        trace, stats = planning_trace(capped, request)
        # As every plan of the app is made (the API's, the traffic and spot re-planners'): with
        # spot where its spec buys it, at the provider's prices now.
        now = provider_prices(capped, self._spot_prices)
        with deadline.limit(self._deadline_s):
            new = plan_with_spot(capped, trace, plan=plan_app, seed=seed, spot_prices=now)
        names = ", ".join(sorted(missing))
        caps_text = ", ".join(f"{t} <= {n}" for t, n in caps.items())
        numbers: dict[str, Any] = {
            "missing_types": sorted(missing),
            "caps": caps,
            "planned_rate_qps": rate,
            "old_plan_id": plan.id,
            "old_fleet": dict(planned),
            "old_cost_usd_per_hr": plan.plan.cost_usd_per_hr,
        }
        fleet = new.fleet
        over = {t: fleet.get(t, 0) for t in caps if fleet.get(t, 0) > caps[t]}
        if new.feasible and fleet == dict(planned):
            logger.info("capacity: %s: the plan without more %s is the same plan", app.name, caps)
            return False
        if not new.feasible or over:
            why = (
                f"the plan that serves it needs {fleet_text(over)} in all (the caps hold per stage)"
                if new.feasible
                else f"at most {new.max_feasible_qps or 0.0:.4g} qps"
            )
            self._store.record_decision(
                app.name,
                "capacity_unavailable",
                f"no capacity of {names} for {self._after_s:g} s or more; no plan with"
                f" {caps_text} serves {rate:g} qps within the SLO and the budget ({why}):"
                f" plan {plan.id} stays, its launches are retried",
                {**numbers, "max_feasible_qps": new.max_feasible_qps},
            )
            return False
        because = (
            f"re-planned because {names} had no capacity for {self._after_s:g} s or more:"
            f" {caps_text}"
        )
        document = dataclasses.replace(
            new, seed=seed, trace=stats, steps=(because, *new.steps)
        ).to_document()
        record = self._store.create_plan(app.name, document)
        # Said in the apply's transaction (a crash leaves both or neither).
        self._store.apply_plan(
            app.name,
            record.id,
            expected_version=app.version,
            said=lambda applied: [
                (
                    "capacity_replan",
                    f"no capacity of {names} for {self._after_s:g} s or more: plan {applied.id}"
                    f" ({fleet_text(fleet)}, {new.cost_usd_per_hr:.4g} USD/hr) replaces plan"
                    f" {plan.id} ({fleet_text(planned)}), with {caps_text}",
                    {
                        **numbers,
                        "plan_id": applied.id,
                        "fleet": fleet,
                        "cost_usd_per_hr": new.cost_usd_per_hr,
                    },
                )
            ],
        )
        logger.warning("capacity: %s re-planned around %s", app.name, names)
        return True


def each_planned_app(
    store: Store, memory: dict[str, Any], check: Callable[[AppRecord], bool], what: str
) -> list[str]:
    """One pass of a re-planner: ``check`` for each app with an applied plan (True: it was
    re-planned); an app whose check fails (deleted or changed meanwhile, a plan the planner
    cannot redo) is logged under ``what`` and the others go on. The apps gone are forgotten
    from ``memory`` (app name -> what the re-planner keeps of it). The names re-planned."""
    replanned = []
    apps = store.list_apps()
    for gone in set(memory) - {app.name for app in apps}:
        del memory[gone]
    for app in apps:
        if app.applied_plan_id is None:
            continue
        try:
            if check(app):
                replanned.append(app.name)
        except (ControlPlaneError, EstimatorError, SpecError, KeyError, ValueError) as error:
            level = logging.DEBUG if app_gone(error) else logging.WARNING  # deleted meanwhile
            logger.log(level, "%s: %s not re-planned: %s", what, app.name, error)
    return replanned


def planning_request(plan: PlanRecord) -> PlanRequest:
    """What ``plan`` was planned on (:func:`~controlplane.apps.plans.
    burstiness_replanning_request`: a plan made on recorded traffic on gamma arrivals of its
    recorded CV^2, as the rollout loop and the live tuner's ladders plan it again); a stored
    trace request that is no longer usable gives way to the planned rate."""
    try:
        return burstiness_replanning_request(plan.plan)
    except InvalidValueError as error:
        logger.warning("capacity: plan %s's trace request is not usable: %s", plan.id, error)
    return rate_request(plan.plan)


def fleet_text(fleet: Mapping[str, int]) -> str:
    """A fleet in words for decisions: ``2 x r5n.large, 1 x t3.xlarge`` (``nothing`` if empty)."""
    return ", ".join(f"{n} x {t}" for t, n in sorted(fleet.items()) if n) or "nothing"
