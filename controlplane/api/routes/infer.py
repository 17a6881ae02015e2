"""``POST /v1/apps/{app}/infer`` (infer scope): a batch of samples in, per sample the output, the
model that answered it and its certainty out; ``GET /v1/apps/{app}/serving`` (viewer): what the
serving loop sees of the app (gear, workers, queues, INFaaS model states, counters).

The request may carry INFaaS's model-less requirements (a latency bound, a minimum accuracy):
the serving loop then picks the cheapest variant that meets them, or the answer is 422 with the
closest offer. A query the queue cannot serve within the SLO even at the cheapest gear is 429
with ``Retry-After``; an app with no serving instance is 503; a query late past its SLO is still
answered, with ``late: true``. docs/serving.md has the whole contract.
"""

from __future__ import annotations

from fastapi import APIRouter

from controlplane.api.deps import Inferrer, ServicesDep, Viewer
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import (
    InferIn,
    InferOut,
    ServingOut,
    ServingStageOut,
    ServingTotalsOut,
    ServingWorkerOut,
    TimingsOut,
)
from controlplane.errors import ServingUnavailableError
from controlplane.policies.variants import Requirements
from controlplane.serving.observations import AppTotals

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["serving"])


@router.post(
    "/apps/{app}/infer",
    summary="Run a batch of samples through the app's models (infer)",
    responses=errors(400, 401, 403, 404, 422, 429, 502, 503, 504),
)
async def infer(app: AppName, body: InferIn, services: ServicesDep, _who: Inferrer) -> InferOut:
    serving = services.serving
    if serving is None:
        raise ServingUnavailableError(app, "this service runs no serving loop")
    requirements = None
    if body.requirements is not None:
        requirements = Requirements(
            app, body.requirements.latency_ms, body.requirements.min_accuracy
        )
    result = await serving.infer(app, body.inputs, body.sample_ids, requirements)
    return InferOut(
        outputs=list(result.outputs),
        models=list(result.models),
        certainty=list(result.certainty),
        gear=result.gear,
        timings=TimingsOut(
            queue_ms=result.queue_ms, service_ms=result.service_ms, total_ms=result.total_ms
        ),
        late=result.late,
    )


@router.get(
    "/apps/{app}/serving",
    summary="The serving loop's view of the app: gear, workers, queues, model states (viewer)",
    responses=errors(401, 403, 404, 422, 503),
)
async def serving_status(app: AppName, services: ServicesDep, _who: Viewer) -> ServingOut:
    serving = services.serving
    if serving is None:
        raise ServingUnavailableError(app, "this service runs no serving loop")
    status = await serving.status(app)
    totals = serving.observations.totals().get(app, AppTotals())
    return ServingOut(
        app=status.app,
        gear=status.gear,
        slo_ms=status.slo_ms,
        in_flight_requests=status.in_flight_requests,
        workers=[
            ServingWorkerOut(
                instance_id=w.instance_id,
                instance_type=w.instance_type,
                address=w.address,
                healthy=w.healthy,
                busy=w.busy,
                last_error=w.last_error,
                utilisation_share=w.utilisation_share,
            )
            for w in status.workers
        ],
        stages=[
            ServingStageOut(
                model=s.model,
                queued_queries=s.queued_queries,
                queued_samples=s.queued_samples,
                in_service_samples=s.in_service_samples,
                capacity_sps=s.capacity_sps,
                policy=s.policy,
                max_batch_queries=s.max_batch_queries,
                states=dict(s.states),
            )
            for s in status.stages
        ],
        totals=ServingTotalsOut(
            arrived=totals.arrived,
            answered=totals.answered,
            late=totals.late,
            failed=totals.failed,
            refused=totals.refused,
            samples_by_model=dict(totals.samples_by_model),
        ),
    )
