"""``GET /v1/instances`` (the instances we run, of every app or one) and
``GET /v1/apps/{app}/fleet`` (an app's live fleet by type, and what it costs)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from controlplane.api.deps import ServicesDep, Viewer
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import FleetOut, FleetTypeOut, InstanceOut
from controlplane.db.store import InstanceRecord
from controlplane.policies.lifecycle import (
    LIVE_STATES,
    InstanceState,
    billed_cost_usd_per_hr,
    is_profile_worker,
)
from controlplane.policies.rollout import rollout_of
from estimator.numbers import money

__all__ = ["instance_out", "router"]

router = APIRouter(prefix="/v1", tags=["fleet"])


def instance_out(record: InstanceRecord) -> InstanceOut:
    """The instance as the API shows it, with what it is for (read off its request id)."""
    out = InstanceOut.model_validate(record)
    rollout = rollout_of(record.app, record.request_id)
    if rollout is not None:
        return out.model_copy(update={"role": "rollout", "rollout_id": rollout})
    if is_profile_worker(record.request_id):
        return out.model_copy(update={"role": "profile_run"})
    return out


@router.get(
    "/instances",
    summary="The instances we run, oldest first (viewer)",
    responses=errors(401, 403, 404, 422),
)
def list_instances(
    services: ServicesDep,
    _who: Viewer,
    app: Annotated[
        str | None,
        Query(
            pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$",
            max_length=63,
            description="only this app's",
        ),
    ] = None,
    state: Annotated[
        list[InstanceState] | None, Query(description="only in these states (repeatable)")
    ] = None,
    limit: Annotated[
        int | None,
        Query(ge=1, le=100_000, description="the newest this many (default: every one)"),
    ] = None,
) -> list[InstanceOut]:
    states = None if state is None else [s.value for s in state]
    found = services.store.list_instances(app, states=states, limit=limit)
    return [instance_out(i) for i in found]


@router.get(
    "/apps/{app}/fleet",
    summary="The app's live fleet by instance type, and its cost (viewer)",
    responses=errors(401, 403, 404, 422),
)
def get_fleet(app: AppName, services: ServicesDep, _who: Viewer) -> FleetOut:
    store = services.store
    record = store.get_app(app)
    live = store.list_instances(app, states=[s.value for s in LIVE_STATES])
    by_type: dict[str, list[InstanceRecord]] = {}
    for instance in live:
        by_type.setdefault(instance.instance_type, []).append(instance)
    rows = []
    for instance_type, instances in sorted(by_type.items()):
        states: dict[str, int] = {}
        for instance in instances:
            states[instance.state] = states.get(instance.state, 0) + 1
        prices = [i.cost_usd_per_hr for i in instances]
        rows.append(
            FleetTypeOut(
                instance_type=instance_type,
                count=len(instances),
                # Instances of a type may have been launched at different prices: the mean of
                # what they cost now (a spot instance at its type's spot price now).
                price_usd_per_hr=money(sum(prices) / len(instances)),
                # What is billed: a terminating instance is listed, not costed (as the budget
                # guard counts; it read as over the budget while a drained one ended).
                cost_usd_per_hr=billed_cost_usd_per_hr(instances),
                states=states,
            )
        )
    return FleetOut(
        app=app,
        budget_usd_per_hr=record.budget_usd_per_hr,
        cost_usd_per_hr=money(sum(row.cost_usd_per_hr for row in rows)),
        instances=len(live),
        by_type=rows,
    )
