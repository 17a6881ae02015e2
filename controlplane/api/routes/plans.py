"""``/v1/apps/{app}/plans``: preview a plan (the planner on a planning trace), list, read and
apply plans. The use cases are :mod:`controlplane.apps.plans` (what a request may ask for, how the
trace is made); a preview's body is ``{"rate_qps": R}`` (a Poisson trace at R) or ``{"trace":
{...}}`` (a Poisson or gamma trace). Applying a plan is refused (409) once the app has changed,
another plan was applied, or it was applied already.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request

from controlplane.api.deps import Operator, ServicesDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.api.routes import AppName, PlanId, errors
from controlplane.api.schemas import MIN_RATE_QPS, PlanIn, PlanOut
from controlplane.apps import plans
from controlplane.apps.plans import PlanRequest, PlanRequestError, TraceRequest
from controlplane.db.store import PlanRecord
from controlplane.provisioning import provider_spot_prices

__all__ = ["MIN_RATE_QPS", "plan_request", "router"]

router = APIRouter(prefix="/v1", tags=["plans"])


def plan_out(record: PlanRecord) -> PlanOut:
    document: dict[str, Any] = dict(record.document)
    return PlanOut.model_validate(
        {
            **document,
            "id": record.id,
            "app": record.app,
            "number": record.number,
            "status": record.status,
            "app_version": record.app_version,
            "created_at": record.created_at,
            "applied_at": record.applied_at,
        }
    )


def plan_request(body: PlanIn) -> PlanRequest:
    """The use case's request from the API's body (validated by its schema: a rate within
    :data:`~controlplane.api.schemas.MIN_RATE_QPS` and ``MAX_RATE_QPS``)."""
    trace = None
    if body.trace is not None:
        trace = TraceRequest(
            rate_qps=body.trace.rate_qps,
            kind=body.trace.kind,
            cv2=body.trace.cv2,
            duration_s=body.trace.duration_s,
            batch_dist=body.trace.batch_dist,
            seed=body.trace.seed,
        )
    return PlanRequest(trace=trace, rate_qps=body.rate_qps, seed=body.seed)


_DISCONNECT_POLL_S = 0.5


@router.post(
    "/apps/{app}/plans",
    status_code=201,
    summary="Preview a plan for the app (operator): the planner on a planning trace",
    responses=errors(400, 401, 403, 404, 409, 422),
    # The body is optional to FastAPI only so that a missing one is the 422 naming rate_qps;
    # the document says what a client must send.
    openapi_extra={"requestBody": {"required": True}},
)
async def preview_plan(
    app: AppName,
    services: ServicesDep,
    _who: Operator,
    http: Request,
    body: Annotated[PlanIn | None, Body(description="what to plan for")] = None,
) -> PlanOut:
    request = plan_request(body if body is not None else PlanIn())
    # The planner runs in a thread, bounded by the settings' deadline (past it: 422 with the
    # reason) and cancelled when the client goes away (checked every half second).
    cancelled = threading.Event()
    work = asyncio.ensure_future(
        asyncio.to_thread(
            plans.preview_plan,
            services.store,
            services.resolver,
            app,
            request,
            deadline_s=services.settings.plan_deadline_s,
            cancelled=cancelled,
            spot_prices=provider_spot_prices(services.provisioner),
        )
    )
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=_DISCONNECT_POLL_S)
            if not work.done() and await http.is_disconnected():
                cancelled.set()
        record = work.result()
    except PlanRequestError as error:
        # A request the schema let through that no trace can be made of is the caller's.
        raise ApiError(422, "invalid_request", str(error), error.field) from None
    finally:
        if not work.done():  # this request itself was cancelled (a shutdown): stop the planner
            cancelled.set()
    return plan_out(record)


@router.get(
    "/apps/{app}/plans",
    summary="List the app's plans, oldest first (viewer)",
    responses=errors(401, 403, 404, 422),
)
def list_plans(
    app: AppName,
    services: ServicesDep,
    _who: Viewer,
    limit: Annotated[int, Query(ge=1, le=1000, description="the newest this many")] = 100,
) -> list[PlanOut]:
    return [plan_out(record) for record in services.store.list_plans(app, limit=limit)]


@router.get(
    "/apps/{app}/plans/{plan_id}",
    summary="Read a plan (viewer)",
    responses=errors(401, 403, 404, 422),
)
def get_plan(app: AppName, plan_id: PlanId, services: ServicesDep, _who: Viewer) -> PlanOut:
    return plan_out(services.store.get_plan(app, plan_id))


@router.post(
    "/apps/{app}/plans/{plan_id}/apply",
    summary="Apply a previewed plan (operator); 409 when it is stale or another apply won",
    responses=errors(401, 403, 404, 409, 422),
)
def apply_plan(app: AppName, plan_id: PlanId, services: ServicesDep, who: Operator) -> PlanOut:
    refusal = services.provisioner.launch_refusal if services.provisioner is not None else None
    return plan_out(plans.apply_plan(services.store, app, plan_id, who.name, refusal))
