"""``POST /v1/apps/{app}/infer`` (infer scope): a batch of samples in, per sample the output, the
model that answered it and its certainty out; ``GET /v1/apps/{app}/serving`` (viewer): what the
serving loop sees of the app (gear, workers, queues, INFaaS model states, counters).

The request may carry INFaaS's model-less requirements (a latency bound, a minimum accuracy):
the serving loop then picks the cheapest variant that meets them, or the answer is 422 with the
closest offer. A query the queue cannot serve within the SLO even at the cheapest gear is 429
with ``Retry-After``; an app with no serving instance is 503; a query late past its SLO is still
answered, with ``late: true``. docs/serving.md has the whole contract.

A query's latency runs from the API's receipt of the request: :class:`ReceivedAtMiddleware`
stamps it, on the serving loop's clock, when the ASGI app is first called, before the body is
read, the token checked (a synchronous dependency, run in the thread pool) or the route entered;
the route hands the stamp to the serving loop, which records every outcome from it
(:mod:`controlplane.serving.observations`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.deps import Inferrer, ServicesDep, Viewer
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import (
    InferIn,
    InferOut,
    ServingLatencyOut,
    ServingOut,
    ServingStageOut,
    ServingTotalsOut,
    ServingWorkerOut,
    TimingsOut,
)
from controlplane.errors import ServingUnavailableError
from controlplane.policies.variants import Requirements
from controlplane.serving.observations import AppTotals

__all__ = ["RECEIVED_S", "ReceivedAtMiddleware", "router"]

router = APIRouter(prefix="/v1", tags=["serving"])

# The ASGI scope key of the receipt stamp (seconds on the clock the middleware was given).
RECEIVED_S = "heteroplane.received_s"


class ReceivedAtMiddleware:
    """Stamp every HTTP request's receipt (``scope[RECEIVED_S]``, ``clock_s()``) as the ASGI app
    is first called: the earliest point the service sees it (what the server did before, reading
    the bytes off the socket, is not seen)."""

    def __init__(self, app: ASGIApp, clock_s: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.clock_s = clock_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RECEIVED_S] = self.clock_s()
        await self.app(scope, receive, send)


def _received_s(request: Request) -> float | None:
    stamp = request.scope.get(RECEIVED_S)
    return float(stamp) if isinstance(stamp, int | float) else None


@router.post(
    "/apps/{app}/infer",
    summary="Run a batch of samples through the app's models (infer)",
    responses=errors(400, 401, 403, 404, 422, 429, 502, 503, 504),
)
async def infer(
    app: AppName, body: InferIn, services: ServicesDep, _who: Inferrer, request: Request
) -> InferOut:
    serving = services.serving
    if serving is None:
        raise ServingUnavailableError(app, "this service runs no serving loop")
    requirements = None
    if body.requirements is not None:
        requirements = Requirements(
            app, body.requirements.latency_ms, body.requirements.min_accuracy
        )
    result = await serving.infer(
        app, body.inputs, body.sample_ids, requirements, _received_s(request)
    )
    return InferOut(
        outputs=list(result.outputs),
        models=list(result.models),
        certainty=list(result.certainty),
        gear=result.gear,
        timings=TimingsOut(
            queue_ms=result.queue_ms,
            service_ms=result.service_ms,
            total_ms=result.total_ms,
            transport_ms=result.transport_ms,
            compute_ms=result.compute_ms,
            api_ms=result.api_ms,
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
    overhead = await asyncio.to_thread(services.store.get_serving_overhead, app)
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
            timed_out=totals.timed_out,
            within_slo=totals.within,
            offered=totals.offered,
            attainment_share=totals.attainment_share,
            samples_by_model=dict(totals.samples_by_model),
            mean_latency_ms=ServingLatencyOut(
                api_ms=totals.mean_ms("api"),
                overhead_ms=None if overhead is None else overhead.overhead_ms,
                queue_ms=totals.mean_ms("queue"),
                transport_ms=totals.mean_ms("transport"),
                compute_ms=totals.mean_ms("compute"),
                total_ms=totals.mean_ms("total"),
            ),
        ),
    )
