"""Re-planning at the spot prices now: an app that buys spot, planned at prices that have moved.

This module owns :class:`SpotReplanner`. A plan with spot capacity is made at the spot prices
of the app's catalog (or at the prices this loop gave it); at run time the reconciler costs spot
at the provider's prices now (the EC2 provisioner: ``DescribeSpotPriceHistory``, cached) and
moves the capacity of a risen type within the budget (its rule 10, docs/spot.md). That patches
the old plan; this loop makes the fleet converge to what a fresh plan at today's prices would
be. After each reconcile tick, for each app whose spec enables spot and that has an applied
plan, it reads the spot prices now of the app's candidate types
(:meth:`~controlplane.loops.reconciler.Reconciler.spot_prices_now`) and compares them with the
prices the applied plan was made at (the ones this loop planned it at, else the catalog's). When
one has moved by ``move_share`` or more (relative, up or down), it plans the app again with
:func:`controlplane.policies.spot.plan_with_spot` at the prices now, on the applied plan's own
planning trace (:func:`controlplane.loops.capacity_replan.planning_request`), and

- when that plan is feasible, differs from the applied one (its fleet or its spot fleet) and
  costs less at the prices now than the applied one does at them (or the applied one no longer
  fits the budget at them: the reconciler is holding it to the budget by moving or draining
  capacity), applies it and records a ``spot_replan`` decision with the prices that moved,
  both plans' fleets, spot fleets and costs; the reconciler then launches the new mix within
  the budget;
- otherwise records one ``spot_replan`` decision (``applied: false``) saying why the applied
  plan stays (the same plan at the prices now, a dearer one, or no plan within the budget
  serves).

The prices attempted become the applied plan's reference, so a price that keeps drifting
re-plans again only once it has moved ``move_share`` from there (a plan takes seconds). A plan
made elsewhere (the API, the traffic re-planner) is taken to be at the catalog's prices. The
budget holds throughout: a plan is within it at the prices it was made at, and the
reconciler's guard holds the fleet to it at the prices now.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from controlplane.apps.plans import planning_trace
from controlplane.db.store import AppRecord, PlanRecord, Store
from controlplane.loops.capacity_replan import each_planned_app, fleet_text, planning_request
from controlplane.loops.live_tuner import ResolveFn
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import plan_with_spot
from controlplane.spec import ResolvedApp
from estimator import deadline
from estimator.numbers import plain

__all__ = ["DEFAULT_SPOT_REPLAN_MOVE_SHARE", "SpotReplanner"]

logger = logging.getLogger(__name__)

# A quarter: well past the day-to-day noise of a spot market, and enough to change which types
# a plan prefers where their discounts differ by less than that.
DEFAULT_SPOT_REPLAN_MOVE_SHARE = 0.25
DEFAULT_PLAN_DEADLINE_S = 60.0

SpotPricesFn = Callable[[AppRecord, Collection[str]], Mapping[str, float]]
"""An app and instance types -> the spot prices now of those sold on spot (USD/hr)."""


def _spot_fleets(plan: Any) -> list[dict[str, int]]:
    return [dict(stage.spot_fleet) for stage in plan.stages]


def cost_at(
    plan: Any, prices_usd_per_hr: Mapping[str, float], spot_usd_per_hr: Mapping[str, float]
) -> float:
    """What ``plan`` costs an hour with its spot instances at ``spot_usd_per_hr`` (a type
    missing there: at its on-demand price) and the rest at ``prices_usd_per_hr``."""
    total = 0.0
    for stage in plan.stages:
        for instance_type, count in stage.fleet.items():
            on_demand = prices_usd_per_hr[instance_type]
            spot = min(stage.spot_fleet.get(instance_type, 0), count)
            total += (count - spot) * on_demand
            total += spot * spot_usd_per_hr.get(instance_type, on_demand)
    return total


class SpotReplanner:
    """Re-plans apps whose spot prices moved (see the module docstring); :meth:`tick` runs after
    each reconcile tick. ``move_share`` 0 turns it off."""

    def __init__(
        self,
        store: Store,
        resolve: ResolveFn,
        spot_prices: SpotPricesFn,
        *,
        move_share: float = DEFAULT_SPOT_REPLAN_MOVE_SHARE,
        deadline_s: float = DEFAULT_PLAN_DEADLINE_S,
    ) -> None:
        if not (math.isfinite(move_share) and move_share >= 0):
            raise ValueError(f"move_share must be finite and >= 0, got {move_share!r}")
        self._store = store
        self._resolve = resolve
        self._spot_prices = spot_prices
        self._move_share = float(move_share)
        self._deadline_s = float(deadline_s)
        # app -> (applied plan id, app version, the spot prices that plan is taken to be at).
        self._reference: dict[str, tuple[int, int, dict[str, float]]] = {}

    def tick(self) -> list[str]:
        """One pass over the apps; the names of those re-planned. An attempt that fails (the
        app deleted or changed meanwhile, a plan the planner cannot redo) leaves the app on its
        plan until the prices move again (they are its reference now)."""
        if self._move_share <= 0:
            return []
        return each_planned_app(self._store, self._reference, self._check, "spot")

    def _check(self, app: AppRecord) -> bool:
        if not app.spot_enabled:
            return False  # no spot bought: nothing to resolve every tick
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return False
        resolved = self._resolve(app)
        if resolved.spec.spot is None or not resolved.spec.spot.enabled:
            return False
        catalog = {t: resolved.catalog[t].spot_price_usd_per_hr for t in resolved.prices_usd_per_hr}
        offered = [t for t, price in catalog.items() if price is not None]
        if not offered:
            return False
        now = dict(self._spot_prices(app, offered))
        reference = self._reference.get(app.name)
        if reference is None or reference[:2] != (plan.id, app.version):
            base = {t: float(p) for t, p in catalog.items() if p is not None}
            base.update(self._planned_at(app.name, plan.id))
            reference = (plan.id, app.version, base)
            self._reference[app.name] = reference
        base = reference[2]
        moved = {
            t: (base[t], price)
            for t, price in sorted(now.items())
            if t in base and base[t] > 0 and abs(price / base[t] - 1.0) >= self._move_share
        }
        if not moved:
            return False
        # Whatever comes of it, these are the prices the applied plan is measured against now.
        self._reference[app.name] = (plan.id, app.version, {**base, **now})
        prices = {t: (now.get(t, p) if p is not None else None) for t, p in catalog.items()}
        return self._replan(app, plan, resolved, prices, moved)

    def _planned_at(self, app: str, plan_id: int) -> dict[str, float]:
        """The spot prices this loop planned ``plan_id`` at (after a restart: its decision)."""
        for decision in self._store.list_decisions(app, kinds=["spot_replan"], limit=1):
            prices = decision.numbers.get("spot_prices_usd_per_hr")
            if decision.numbers.get("plan_id") == plan_id and isinstance(prices, Mapping):
                return {str(t): float(p) for t, p in prices.items()}
        return {}

    def _replan(
        self,
        app: AppRecord,
        plan: PlanRecord,
        resolved: ResolvedApp,
        prices: Mapping[str, float | None],
        moved: Mapping[str, tuple[float, float]],
    ) -> bool:
        request = planning_request(plan)
        seed = request.seed
        trace, stats = planning_trace(resolved, request)
        with deadline.limit(self._deadline_s):
            new = plan_with_spot(resolved, trace, plan=plan_app, seed=seed, spot_prices=prices)
        if self._store.get_app(app.name).version != app.version:
            return False  # changed meanwhile: the next tick looks again
        old = plan.plan
        moves = ", ".join(
            f"{t} {plain(before)} -> {plain(after)} USD/hr" for t, (before, after) in moved.items()
        )
        spot_now = {t: p for t, p in prices.items() if p is not None}
        old_now = cost_at(old, resolved.prices_usd_per_hr, spot_now)
        numbers: dict[str, Any] = {
            "moved": {t: {"from": b, "to": a} for t, (b, a) in moved.items()},
            "move_share": self._move_share,
            "spot_prices_usd_per_hr": spot_now,
            "old_plan_id": plan.id,
            "old_fleet": dict(old.fleet),
            "old_spot_fleet": _spot_fleets(old),
            "old_cost_usd_per_hr": old.cost_usd_per_hr,
            "old_cost_now_usd_per_hr": round(old_now, 9),
            "budget_usd_per_hr": app.budget_usd_per_hr,
        }
        why = f"spot prices moved by {self._move_share:.0%} or more ({moves})"
        same = new.feasible and (
            new.fleet == dict(old.fleet) and _spot_fleets(new) == _spot_fleets(old)
        )
        dearer = (
            new.feasible
            and new.cost_usd_per_hr >= old_now - 1e-9
            and old_now <= app.budget_usd_per_hr + 1e-9
        )
        if not new.feasible or same or dearer:
            if not new.feasible:
                because = (
                    f"no plan within the budget serves {old.planned_rate_qps:g} qps at the"
                    f" prices now (at most {new.max_feasible_qps or 0.0:.4g} qps)"
                )
            elif same:
                because = "a fresh plan at the prices now is the same plan"
            else:
                because = (
                    f"a fresh plan at them ({fleet_text(new.fleet)}) would cost"
                    f" {new.cost_usd_per_hr:.4g} USD/hr, no less than plan {plan.id} does at"
                    f" them ({old_now:.4g})"
                )
            self._store.record_decision(
                app.name,
                "spot_replan",
                f"{why}: {because}; plan {plan.id} stays (the reconciler holds its cost at the"
                " prices now within the budget)",
                {**numbers, "applied": False, "plan_id": plan.id},
            )
            return False
        document = dataclasses.replace(
            new,
            seed=seed,
            trace=stats,
            steps=(f"re-planned at the spot prices now: {why}", *new.steps),
        ).to_document()
        record = self._store.create_plan(app.name, document)
        # Said in the apply's transaction (a crash leaves both or neither).
        applied = self._store.apply_plan(
            app.name,
            record.id,
            expected_version=app.version,
            said=lambda done: [
                (
                    "spot_replan",
                    f"{why}: plan {done.id} ({fleet_text(new.fleet)},"
                    f" {new.cost_usd_per_hr:.4g} USD/hr at the prices now) replaces plan"
                    f" {plan.id} ({fleet_text(old.fleet)}, {old_now:.4g} USD/hr at the prices"
                    " now)",
                    {
                        **numbers,
                        "applied": True,
                        "plan_id": done.id,
                        "fleet": dict(new.fleet),
                        "spot_fleet": _spot_fleets(new),
                        "cost_usd_per_hr": new.cost_usd_per_hr,
                    },
                )
            ],
        )
        # The plan is at the prices now: the next re-plan is measured from them.
        current = self._store.get_app(app.name)
        self._reference[app.name] = (applied.id, current.version, dict(spot_now))
        logger.warning("spot: %s re-planned at the spot prices now (%s)", app.name, moves)
        return True
