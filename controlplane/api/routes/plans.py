"""``/v1/apps/{app}/plans``: preview a plan (the planner on a planning trace), list, read and
apply plans.

A preview runs :func:`controlplane.policies.planner.plan_app` on a synthetic trace: the app spec
carries no trace and no expected rate, so the request says what to plan for, either ``{"rate_qps":
R}`` (a Poisson trace at R) or ``{"trace": {...}}`` (a Poisson or gamma trace; the generators of
``heteroplane trace generate``). The trace holds
:data:`~controlplane.api.schemas.DEFAULT_TRACE_QUERIES` queries unless ``duration_s`` says
otherwise. The plan is stored with the app version it was made for; applying it is refused (409)
once the app has changed, another plan was applied, or it was applied already.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Body, Query

from controlplane.api.deps import Operator, ServicesDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.api.routes import AppName, PlanId, errors
from controlplane.api.schemas import DEFAULT_TRACE_QUERIES, PlanIn, PlanOut, TraceIn
from controlplane.apps.resolver import smallest_common_batch_size
from controlplane.db.store import PlanRecord
from controlplane.errors import ConflictError
from controlplane.policies.planner import plan_app
from controlplane.spec import ResolvedApp
from estimator.batches import parse_batch_distribution
from estimator.errors import WorkloadError
from estimator.traces import Trace, constant_profile, renewal_arrivals, trace_stats

__all__ = ["planning_trace", "router"]

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


def planning_trace(app: ResolvedApp, request: PlanIn) -> tuple[Trace, dict[str, Any]]:
    """The trace a preview plans on, and its statistics with how it was made (``source`` in
    words; ``request``, the generator's parameters, from which the same trace can be made
    again: the capacity replanner does)."""
    params = request.trace
    if params is None:
        if request.rate_qps is None:
            raise ApiError(
                422,
                "invalid_request",
                "rate_qps: the app spec carries no trace or expected rate; send"
                ' {"rate_qps": R} or {"trace": {"rate_qps": R, ...}}',
                "rate_qps",
            )
        params = TraceIn(rate_qps=request.rate_qps)
    batch_dist = params.batch_dist or f"fixed:{smallest_common_batch_size(app)}"
    try:
        batches = parse_batch_distribution(batch_dist)
    except WorkloadError as error:
        raise ApiError(422, "invalid_request", str(error), "trace.batch_dist") from None
    duration_s = params.duration_s or DEFAULT_TRACE_QUERIES / params.rate_qps
    rng = np.random.default_rng(params.seed)
    arrival_s = renewal_arrivals(constant_profile(params.rate_qps), duration_s, params.cv2, rng)
    if arrival_s.size < 2:
        raise WorkloadError(
            f"the trace has {arrival_s.size} queries in {duration_s:g} s at {params.rate_qps:g}"
            " qps; raise rate_qps or duration_s"
        )
    try:
        sizes = batches.sample(arrival_s.size, rng)
    except (OverflowError, ValueError) as error:
        # A batch size beyond int64 ("fixed:1e20") overflows inside numpy.
        raise ApiError(
            422, "invalid_request", f"batch sizes {batch_dist!r}: {error}", "trace.batch_dist"
        ) from None
    trace = Trace(arrival_s, sizes)
    stats = trace_stats(trace)
    cv2 = f", cv2 {params.cv2:g}" if params.kind == "gamma" else ""
    source = (
        f"{params.kind} at {params.rate_qps:g} qps{cv2} for {duration_s:g} s,"
        f" batch sizes {batches.spec}, seed {params.seed}"
    )
    return trace, {
        "count": stats.count,
        "rate_qps": stats.rate_qps,
        "cv2": stats.cv2,
        "mean_batch_size": stats.mean_batch_size,
        "source": source,
        "request": params.model_dump(mode="json"),
    }


@router.post(
    "/apps/{app}/plans",
    status_code=201,
    summary="Preview a plan for the app (operator): the planner on a planning trace",
    responses=errors(400, 401, 403, 404, 409, 422),
)
def preview_plan(
    app: AppName,
    services: ServicesDep,
    _who: Operator,
    body: Annotated[PlanIn | None, Body(description="what to plan for")] = None,
) -> PlanOut:
    request = body if body is not None else PlanIn()
    store = services.store
    record = store.get_app(app)
    resolved = services.resolver.resolve(record.spec)
    trace, stats = planning_trace(resolved, request)
    plan = plan_app(resolved, trace, seed=request.seed)
    if store.get_app(app).version != record.version:
        raise ConflictError(f"app {app!r} changed while it was being planned; preview again")
    document = {**plan.to_document(), "seed": request.seed, "trace": stats}
    return plan_out(store.create_plan(app, document))


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
    store = services.store
    record = store.apply_plan(app, plan_id)
    fleet: dict[str, int] = {}
    for stage in record.document.get("stages", []):
        for instance_type, count in stage.get("fleet", {}).items():
            fleet[instance_type] = fleet.get(instance_type, 0) + int(count)
    store.record_decision(
        app,
        "plan_applied",
        f"plan {record.number} applied by {who.name}",
        {
            "plan_id": record.id,
            "plan_number": record.number,
            "cost_usd_per_hr": record.document.get("cost_usd_per_hr"),
            "fleet": fleet,
        },
    )
    return plan_out(record)
