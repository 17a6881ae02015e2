"""Use case: change an app's budget, and say which instances must go for it.

A change is audited by the store (who, when, old, new, why). When the new budget is below what
the live fleet costs, :func:`change_budget` asks the drain policy
(:func:`controlplane.policies.drain.plan_drain`) which instances to drain, least cost-effective
first, and records a ``budget_drain`` decision; the reconciler acts on it, not this use case. The
API's ``PUT /v1/apps/{app}/budget`` and the command line's ``budget set`` go through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from controlplane.apps.resolver import AppResolver, smallest_common_batch_size
from controlplane.db.store import BudgetChangeRecord, InstanceRecord, Store
from controlplane.policies.drain import DrainInstance, DrainPlan, plan_drain, qps_by_type
from controlplane.policies.lifecycle import LIVE_STATES
from estimator.errors import EstimatorError

__all__ = ["BudgetChange", "change_budget", "live_instances"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BudgetChange:
    """A budget change as made: the audit row, the drain plan under the new budget, the live
    instances it was made on, and the note the decision carries (``None``: nothing to drain)."""

    change: BudgetChangeRecord
    drain: DrainPlan
    live: tuple[InstanceRecord, ...]
    note: str | None


def live_instances(store: Store, app: str) -> list[InstanceRecord]:
    """The app's instances in a live state (every state but terminated and failed)."""
    return store.list_instances(app, states=[s.value for s in LIVE_STATES])


def change_budget(
    store: Store, resolver: AppResolver, app: str, usd_per_hr: float, reason: str, who: str
) -> BudgetChange:
    """Set ``app``'s budget to ``usd_per_hr`` and plan the drain it needs.

    Raises:
        NotFoundError: no such app.
        InvalidValueError: a budget the store refuses.
    """
    change = store.change_budget(app, usd_per_hr, reason=reason, who=who)
    try:
        resolved = resolver.resolve(store.get_app(app).spec, check_budget=False)
        values = qps_by_type(resolved, smallest_common_batch_size(resolved))
    except EstimatorError as error:
        # The budget is changed; without the profiles, instances rank by price alone.
        logger.warning("app %s: cannot rank instances by value: %s", app, error)
        values = {}
    live = live_instances(store, app)
    drain = plan_drain(
        [
            DrainInstance(i.id, i.instance_type, i.state, i.price_usd_per_hr, i.created_at)
            for i in live
        ],
        change.new_usd_per_hr,
        values,
    )
    note = None
    if drain.drain:
        note = (
            f"the fleet costs {drain.fleet_cost_usd_per_hr:.3f} USD/hr, above the new budget"
            f" {change.new_usd_per_hr:g} USD/hr: {len(drain.drain)} instance(s) to drain"
            f" ({drain.saved_usd_per_hr:.3f} USD/hr), least cost-effective first"
        )
        store.record_decision(
            app,
            "budget_drain",
            f"budget lowered to {change.new_usd_per_hr:g} USD/hr by {who}: {note}",
            {
                "budget_usd_per_hr": change.new_usd_per_hr,
                "fleet_cost_usd_per_hr": drain.fleet_cost_usd_per_hr,
                "kept_cost_usd_per_hr": drain.kept_cost_usd_per_hr,
                "drain": [c.id for c in drain.drain],
            },
        )
    return BudgetChange(change, drain, tuple(live), note)
