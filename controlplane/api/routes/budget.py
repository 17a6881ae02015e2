"""``/v1/apps/{app}/budget``: read the budget with its audit trail, and change it (the use case
:func:`controlplane.apps.budget.change_budget`: audited; when the new budget is below what the
fleet costs, the answer lists the instances to drain, least cost-effective first, and a
``budget_drain`` decision is recorded; the reconciler acts on it, not this route). A budget below
the app's smallest serving fleet is a 409 naming its cost, and one that buys no instance of any
candidate type a 422 as registering the app at it is, unless the body says ``"force": true``.
"""

from __future__ import annotations

import math

from fastapi import APIRouter

from controlplane.api.deps import Operator, ServicesDep, Viewer
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import (
    BudgetChangeIn,
    BudgetChangeOut,
    BudgetOut,
    BudgetSetOut,
    DrainOut,
)
from controlplane.apps.budget import change_budget, live_instances
from controlplane.policies.lifecycle import billed_cost_usd_per_hr

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["budget"])

_AUDIT_ROWS = 100


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
        fleet_cost_usd_per_hr=billed_cost_usd_per_hr(live_instances(store, app)),
        changes=[BudgetChangeOut.model_validate(c) for c in changes],
    )


@router.put(
    "/apps/{app}/budget",
    summary=(
        "Change the app's budget (operator); lists the instances to drain if it is too low;"
        " 409 below the smallest serving fleet, 422 if it buys no instance, unless forced"
    ),
    responses=errors(400, 401, 403, 404, 409, 422),
)
def set_budget(
    app: AppName, body: BudgetChangeIn, services: ServicesDep, who: Operator
) -> BudgetSetOut:
    made = change_budget(
        services.store,
        services.resolver,
        app,
        body.budget_usd_per_hr,
        reason=body.reason,
        who=who.name,
        force=body.force,
    )
    change, drain, note = made.change, made.drain, made.note
    if services.budget_changed is not None and drain.drain:
        # A cascade moves to the gear the lower budget can serve before the fleet shrinks.
        services.budget_changed(app)
    provider_ids = {i.id: i.provider_id for i in made.live}
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
