"""``/v1/apps/{app}/budget``: read the budget with its audit trail, and change it.

A change is audited (who: the token's name, when, old, new, why). When the new budget is below
what the fleet costs, the answer lists the instances to drain, least cost-effective first
(:func:`controlplane.policies.drain.plan_drain`), and a ``budget_drain`` decision is recorded; the
reconciler acts on it, not this route.
"""

from __future__ import annotations

import logging
import math

from fastapi import APIRouter

from controlplane.api.deps import Operator, Services, ServicesDep, Viewer
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import (
    BudgetChangeIn,
    BudgetChangeOut,
    BudgetOut,
    BudgetSetOut,
    DrainOut,
)
from controlplane.apps.resolver import smallest_common_batch_size
from controlplane.db.store import InstanceRecord
from controlplane.policies.drain import DrainInstance, plan_drain, qps_by_type
from controlplane.policies.lifecycle import LIVE_STATES
from estimator.errors import EstimatorError

__all__ = ["router"]

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["budget"])

_AUDIT_ROWS = 100


def _live(services: Services, app: str) -> list[InstanceRecord]:
    return services.store.list_instances(app, states=[s.value for s in LIVE_STATES])


@router.get(
    "/apps/{app}/budget",
    summary="The app's budget, fleet cost and budget audit trail (viewer)",
    responses=errors(401, 403, 404, 422),
)
def get_budget(app: AppName, services: ServicesDep, _who: Viewer) -> BudgetOut:
    store = services.store
    record = store.get_app(app)
    changes = store.list_budget_changes(app, limit=_AUDIT_ROWS)
    return BudgetOut(
        app=app,
        budget_usd_per_hr=record.budget_usd_per_hr,
        fleet_cost_usd_per_hr=sum(i.price_usd_per_hr for i in _live(services, app)),
        changes=[
            BudgetChangeOut(
                at=c.at,
                who=c.who,
                old_usd_per_hr=c.old_usd_per_hr,
                new_usd_per_hr=c.new_usd_per_hr,
                reason=c.reason,
            )
            for c in changes
        ],
    )


@router.put(
    "/apps/{app}/budget",
    summary="Change the app's budget (operator); lists the instances to drain if it is too low",
    responses=errors(400, 401, 403, 404, 409, 422),
)
def set_budget(
    app: AppName, body: BudgetChangeIn, services: ServicesDep, who: Operator
) -> BudgetSetOut:
    store = services.store
    change = store.change_budget(app, body.budget_usd_per_hr, reason=body.reason, who=who.name)
    try:
        resolved = services.resolver.resolve(store.get_app(app).spec, check_budget=False)
        values = qps_by_type(resolved, smallest_common_batch_size(resolved))
    except EstimatorError as error:
        # The budget is changed; without the profiles, instances rank by price alone.
        logger.warning("app %s: cannot rank instances by value: %s", app, error)
        values = {}
    live = _live(services, app)
    drain = plan_drain(
        [
            DrainInstance(i.id, i.instance_type, i.state, i.price_usd_per_hr, i.created_at)
            for i in live
        ],
        change.new_usd_per_hr,
        values,
    )
    provider_ids = {i.id: i.provider_id for i in live}
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
            f"budget lowered to {change.new_usd_per_hr:g} USD/hr by {who.name}: {note}",
            {
                "budget_usd_per_hr": change.new_usd_per_hr,
                "fleet_cost_usd_per_hr": drain.fleet_cost_usd_per_hr,
                "kept_cost_usd_per_hr": drain.kept_cost_usd_per_hr,
                "drain": [c.id for c in drain.drain],
            },
        )
    return BudgetSetOut(
        app=app,
        budget_usd_per_hr=change.new_usd_per_hr,
        previous_usd_per_hr=change.old_usd_per_hr,
        fleet_cost_usd_per_hr=drain.fleet_cost_usd_per_hr,
        drain=[
            DrainOut(
                id=c.id,
                provider_id=provider_ids.get(c.id),
                instance_type=c.instance_type,
                state=c.state,
                price_usd_per_hr=c.price_usd_per_hr,
                qps_per_usd=c.qps_per_usd if math.isfinite(c.qps_per_usd) else None,
            )
            for c in drain.drain
        ],
        note=note,
    )
