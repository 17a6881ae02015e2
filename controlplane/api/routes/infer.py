"""``POST /v1/apps/{app}/infer`` (infer scope): a batch of samples in, per sample the output, the
model that answered it and its certainty out (a sample is checked against the app's models'
input, :func:`check_inputs`; ``/v2/models/{app}/infer``, :mod:`controlplane.api.routes.oip`,
speaks the Open Inference Protocol and answers the raw outputs); ``GET /v1/apps/{app}/serving``
(viewer): what the serving loop sees of the app (gear, workers, queues, INFaaS model states,
counters).

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
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from controlplane.api.deps import Inferrer, ServicesDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.api.limits import HEAD_S
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import (
    EXACT_FLOAT_INT,
    INFER_FEATURES,
    INFER_PIXEL_MAX,
    InferIn,
    InferOut,
    ServingLatencyOut,
    ServingOut,
    ServingStageOut,
    ServingTotalsOut,
    ServingWorkerOut,
)
from controlplane.errors import ServingUnavailableError
from controlplane.policies.variants import Requirements
from controlplane.serving.modelio import ModelIO, resolve_sample_shape
from controlplane.serving.observations import AppTotals

__all__ = [
    "RECEIVED_S",
    "ReceivedAtMiddleware",
    "answer_document",
    "check_inputs",
    "received_s",
    "router",
]

router = APIRouter(prefix="/v1", tags=["serving"])

# The ASGI scope key of the receipt stamp (seconds on the clock the middleware was given).
RECEIVED_S = "heteroplane.received_s"
# A client's id of its query: while a rollout moves the app's traffic, which version answers
# is a function of it (docs/rollouts.md); the /v2 route reads the request's own ``id``.
REQUEST_ID_HEADER = "x-request-id"


def stamp_receipt(scope: Scope, clock_s: Callable[[], float], head_stamps: bool) -> float:
    """Stamp the request's receipt in ``scope[RECEIVED_S]`` and return it: with
    ``head_stamps`` (the serving loop's clock is ``time.monotonic``) the protocol's stamp of its
    head as whole (:data:`~controlplane.api.limits.HEAD_S`, ``heteroplane serve``'s protocol),
    where there is one, so that the service's own time counts the event loop's wait between
    reading the request and calling the app (under load, the serving process's queue); else
    ``clock_s()`` now, as the app is called."""
    head = scope.get(HEAD_S) if head_stamps else None
    stamp = head if isinstance(head, float) else clock_s()
    scope[RECEIVED_S] = stamp
    return stamp


class ReceivedAtMiddleware:
    """Stamp every HTTP request's receipt (``scope[RECEIVED_S]``, :func:`stamp_receipt`) as the
    ASGI app is first called, or, with ``head_stamps``, as the protocol read its head."""

    def __init__(
        self,
        app: ASGIApp,
        clock_s: Callable[[], float] = time.monotonic,
        head_stamps: bool = False,
    ) -> None:
        self.app = app
        self.clock_s = clock_s
        self.head_stamps = head_stamps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and RECEIVED_S not in scope:  # the fast path's stamp stays
            stamp_receipt(scope, self.clock_s, self.head_stamps)
        await self.app(scope, receive, send)


def received_s(request: Request) -> float | None:
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
    received = received_s(request)
    config = (await serving.dispatcher_for(app, received)).config
    inputs = check_inputs(app, config.model_io(config.models[0]), body.inputs)
    result = await serving.infer(
        app,
        inputs,
        body.sample_ids,
        requirements,
        received,
        request_id=request.headers.get(REQUEST_ID_HEADER),
    )
    return InferOut.model_validate(answer_document(result))


def answer_document(result: Any) -> dict[str, Any]:
    """The route's answer (:class:`~controlplane.api.schemas.InferOut`) to an
    :class:`~controlplane.serving.dispatcher.InferResult`, as JSON-ready data (the fast path,
    :mod:`controlplane.api.fast_infer`, writes it as it is). A 502 where a certainty is not
    finite: the model answered a NaN or an infinity, whose argmax is no class (it was answered
    as class 0, where ``/v2`` says so)."""
    certainty = [float(c) for c in result.certainty]
    if not all(map(math.isfinite, certainty)):
        raise ApiError(
            502,
            "bad_gateway",
            "the model's output holds values that are not finite (NaN, infinity): no class can be"
            " read off it (POST /v2/models/APP/infer with parameters.binary_data_output answers"
            " the raw outputs)",
        )
    return {
        "outputs": list(result.outputs),
        "models": list(result.models),
        "certainty": certainty,
        "gear": result.gear,
        "timings": {
            "queue_ms": float(result.queue_ms),
            "service_ms": float(result.service_ms),
            "total_ms": float(result.total_ms),
            "transport_ms": float(result.transport_ms),
            "compute_ms": float(result.compute_ms),
            "api_ms": float(result.api_ms),
        },
        "late": bool(result.late),
    }


def check_inputs(app: str, io: ModelIO, inputs: list[list[float]]) -> list[list[Any]]:
    """The rows of a ``/v1`` request for the app whose first model is ``io``'s: a demo family
    model takes 64 pixel values in 0..16; a model brought to the registry its first (and only)
    input's sample, flattened, of that input's datatype (integers for an integer type, 0 or 1
    for ``BOOL``). Raises a 422 ``invalid_request`` naming the sample (``inputs[i]``) or value
    (``inputs[i][j]``)."""
    if io.family:
        for i, row in enumerate(inputs):
            if len(row) != INFER_FEATURES:
                raise _invalid(f"has {len(row)} values; a sample is {INFER_FEATURES} pixels", i)
            if min(row) < 0.0 or max(row) > INFER_PIXEL_MAX:
                j = next(j for j, v in enumerate(row) if not 0.0 <= v <= INFER_PIXEL_MAX)
                raise _invalid(f"{_shown(row[j])} is outside 0..{INFER_PIXEL_MAX:g}", i, j)
        return inputs
    specs = io.signature.inputs
    if len(specs) != 1:
        names = ", ".join(spec.name for spec in specs)
        raise ApiError(
            422,
            "invalid_request",
            f"app {app}'s model {io.model} takes {len(specs)} inputs ({names}): send them to"
            f" POST /v2/models/{app}/infer",
            "inputs",
        )
    spec = specs[0]
    kind = spec.dtype.kind
    # What each value must lie within, from the input's datatype (once, not per row).
    limit = float(np.finfo(spec.dtype).max) if kind == "f" else math.inf
    low, high = (0, 1) if kind == "b" else (0, 0) if kind == "f" else _int_range(spec.dtype)
    rows: list[list[Any]] = []
    for i, row in enumerate(inputs):
        if resolve_sample_shape(spec, len(row)) is None:
            raise _invalid(
                f"has {len(row)} values; input {spec.name!r} takes samples of shape"
                f" {list(spec.sample_shape)}, flattened",
                i,
            )
        if kind == "f":
            if max(abs(v) for v in row) > limit:
                j = next(j for j, v in enumerate(row) if abs(v) > limit)
                raise _invalid(f"{_shown(row[j])} is too large for {spec.datatype}", i, j)
            rows.append(row)
            continue
        for j, v in enumerate(row):
            # JSON integers reach here as int, others as float; a float past 2**53 is no exact
            # integer (orjson reads an integer past 64 bits as one: -2**63 - 1 became -2**63).
            if not (
                (type(v) is int or (v.is_integer() and abs(v) < EXACT_FLOAT_INT))
                and low <= v <= high
            ):
                raise _invalid(f"{_shown(v)} is not a {spec.datatype} value ({low}..{high})", i, j)
        rows.append([bool(v) for v in row] if kind == "b" else [int(v) for v in row])
    return rows


def _shown(value: float) -> str:
    """A value as a refusal quotes it: ``:g``; a JSON integer past any float (the route reads
    one exactly, and ``:g`` cannot format it) by its number of digits."""
    try:
        return f"{value:g}"
    except OverflowError:
        return f"an integer of {len(str(abs(int(value))))} digits"


def _int_range(dtype: np.dtype[Any]) -> tuple[int, int]:
    limits = np.iinfo(dtype)
    return int(limits.min), int(limits.max)


def _invalid(message: str, i: int, j: int | None = None) -> ApiError:
    field = f"inputs[{i}]" if j is None else f"inputs[{i}][{j}]"
    return ApiError(422, "invalid_request", f"{field}: {message}", field)


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
                shares=dict(s.shares),
                lp_utilisation=s.lp_utilisation,
                reach=s.reach,
                reach_samples=s.reach_samples,
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
            rejected=totals.rejected,
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
