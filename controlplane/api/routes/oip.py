"""The Open Inference Protocol v2 (REST) in front of the serving loop: an app is a model.

- ``GET /v2`` (no token): the server's metadata, ``{"name": "heteroplane", "version",
  "extensions": []}``.
- ``GET /v2/health/live`` and ``GET /v2/health/ready`` (no token, like ``/healthz``): 200
  ``{"live": true}``; 200 ``{"ready": true}`` while the service runs its serving loop, else 503
  ``{"ready": false}``.
- ``GET /v2/models/{app}`` (infer scope): ``{"name", "versions": ["1"], "platform":
  "heteroplane", "inputs", "outputs"}``, the app's first model's inputs (a cascade's models share
  them) and its last model's outputs.
- ``GET /v2/models/{app}/ready`` (infer): 200 ``{"name", "ready": true}`` when a query would be
  served now, 503 with the reason when no healthy worker serves a model of the app's gear (or
  its registered models have no latency profiles yet: the metadata is the registry's then).
- ``POST /v2/models/{app}/infer`` (infer): an Open Inference Protocol request checked against
  the app's input signature (:func:`provisioners.worker.oip.parse_infer_request`: a mismatch is
  a 400 naming the input, its datatype or its shape), its rows (the batch dimension, at most
  256) served through the serving loop as ``/v1/apps/{app}/infer`` serves them (dispatcher,
  cascade, gear, admission: 429 with ``Retry-After``; 503 without a worker; ``parameters.
  timeout``, microseconds as Triton's clients send it, is the client's deadline: a query whose
  batch would end past it is answered 504 instead of being sent). The answer:
  ``{"model_name": app, "model_version": "1", "id"? (the request's), "outputs": [...],
  "parameters": {"models": [per row, the model that answered it], "gear", "late", and the
  timings of ``/v1`` (``total_ms``, ``queue_ms``, ...)}}``, each output the answering models'
  raw outputs stacked per request row, in the request's order. ``/v2/models/{app}/versions/1``
  serves the same (another version: 404).

Tensors travel as JSON (``data``, flat or nested) or with Triton's binary tensor extension, as
``tritonclient.http`` sends them: the header ``Inference-Header-Content-Length`` gives the size
of the JSON part, the rest of the body is the raw little-endian bytes of the inputs whose
``parameters.binary_data_size`` says how many, in order. Outputs are answered in binary when
the request's ``parameters.binary_data_output`` is true or the output's own
``parameters.binary_data`` is (the latter wins), with ``parameters.binary_data_size`` and the
same header; else as JSON. Either switch given is a boolean (:func:`check_binary_switches`:
a 400 otherwise).

Errors are the protocol's ``{"error": "one line"}`` with the status the rest of the API gives
(:mod:`controlplane.api.errors`: 401/403 without an infer token, 404 ``no model 'x'`` for an
unknown app, ...): the route class rewrites the API's error body, and
:class:`~controlplane.api.errors.OipErrorShapeMiddleware` the answers of the layers around the
routes (the limits, an unknown route, 405). A query's body is read under the limit of its model
(:func:`body_limit`: what 256 rows of its inputs take as JSON, up to ``oip_body_max_bytes``; 413
past it, declared or chunked) and its JSON's nesting checked before it is decoded (400 past
:data:`~controlplane.api.limits.MAX_JSON_DEPTH`). These routes are left out of the OpenAPI
document: the protocol is documented by KServe
(https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import re
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.types import Scope

from controlplane import __version__
from controlplane.api.deps import Inferrer, Services, ServicesDep
from controlplane.api.errors import ApiError, oip_error_body, render_error
from controlplane.api.limits import MAX_BODY_BYTES, MAX_JSON_DEPTH, json_depth_exceeds
from controlplane.api.routes import AppName
from controlplane.api.routes.infer import received_s
from controlplane.api.schemas import MAX_INFER_SAMPLES
from controlplane.errors import NotFoundError, ServingUnavailableError
from controlplane.serving.config import AppConfig
from controlplane.serving.dispatcher import InferResult
from controlplane.serving.loop import ServingLoop, model_io
from controlplane.serving.modelio import ModelIOError, app_signature, stack_outputs
from controlplane.spec import UnprofiledModelError
from estimator.errors import EstimatorError
from provisioners.artifacts import ArtifactError, ModelSignature, numpy_dtype
from provisioners.worker.oip import (
    HEADER_LENGTH,
    MODEL_VERSION,
    InferRequest,
    OipError,
    load_json,
    model_metadata,
    parse_infer_request,
    split_infer_body,
    with_binary_inputs,
)

__all__ = [
    "HEADER_LENGTH",
    "PLATFORM",
    "Answered",
    "as_model_error",
    "body_limit",
    "check_binary_switches",
    "parse_query",
    "raw_bytes",
    "reads_own_body",
    "registered_signature",
    "result_parameters",
    "router",
    "serve_query",
    "serving_of",
    "signature_of",
    "timeout_us",
    "unserved",
]

# The inference routes (body_limit): with and without a version.
_INFER_PATH = re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/infer")
# The most JSON text one tensor value takes: a float printed in full (-1.2345678901234567e-05)
# and its separator.
_JSON_VALUE_BYTES = 25
PLATFORM = "heteroplane"


class _OipRoute(APIRoute):
    """A route whose errors are the protocol's ``{"error": "..."}``: whatever the API answers
    for an exception (its handlers, with their statuses and headers), the body rewritten."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OipError as error:
                return JSONResponse({"error": str(error)}, status_code=error.status)
            except Exception as error:
                answer = await _api_answer(request, error)
                if answer is None:
                    raise
                return answer

        return route


async def error_answer(request: Request, error: Exception) -> Response:
    """The answer the route gives ``error`` (:class:`_OipRoute`), with the protocol's body also
    for one no handler takes (the catch-all's 500): for the inference fast path
    (:mod:`controlplane.api.fast_infer`), which answers outside the route's layers."""
    if isinstance(error, OipError):
        return JSONResponse({"error": str(error)}, status_code=error.status)
    answer = await _api_answer(request, error)
    if answer is not None:
        return answer
    plain = render_error(request, error)
    return Response(
        oip_error_body(bytes(plain.body)),
        status_code=plain.status_code,
        media_type="application/json",
    )


def as_model_error(error: Exception) -> Exception:
    """``error`` as the protocol says it: an app is a model here (``no model 'x'``)."""
    if isinstance(error, NotFoundError) and error.kind == "app":
        return NotFoundError("model", error.key)
    return error


async def _api_answer(request: Request, error: Exception) -> Response | None:
    error = as_model_error(error)
    handlers = request.app.exception_handlers
    for kind in type(error).__mro__:
        handler = handlers.get(kind)
        if handler is not None:
            break
    else:
        return None
    answer: Response = handler(request, error)
    if inspect.isawaitable(answer):
        answer = await answer
    try:
        message = json.loads(bytes(answer.body))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return answer
    headers = {
        k: v for k, v in answer.headers.items() if k not in ("content-length", "content-type")
    }
    return JSONResponse({"error": message}, status_code=answer.status_code, headers=headers)


router = APIRouter(
    prefix="/v2", tags=["open inference protocol"], route_class=_OipRoute, include_in_schema=False
)


@router.get("")
async def server_metadata() -> dict[str, Any]:
    """The protocol's server metadata (``GET /v2``; tritonclient's ``get_server_metadata``): no
    token, as the health routes and gRPC's ``ServerMetadata``; no extension is claimed."""
    return {"name": PLATFORM, "version": __version__, "extensions": []}


@router.get("/health/live")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
async def ready(services: ServicesDep) -> JSONResponse:
    serving = services.serving
    running = serving is not None and serving.running
    return JSONResponse({"ready": running}, status_code=200 if running else 503)


def serving_of(services: Services, app: str) -> ServingLoop:
    serving: ServingLoop | None = services.serving
    if serving is None:
        raise ServingUnavailableError(app, "this service runs no serving loop")
    return serving


def _version(version: str) -> None:
    if version != MODEL_VERSION:
        raise OipError(f"version {version!r} is not served (versions: {MODEL_VERSION})", 404)


async def signature_of(serving: ServingLoop, app: str, received: float | None) -> ModelSignature:
    """The app's signature on ``/v2``: its dispatcher's; for an app of registered models not
    profiled yet, which has no dispatcher (nothing to plan or serve with), its registry
    models' (:func:`registered_signature`)."""
    try:
        config = (await serving.dispatcher_for(app, received)).config
    except UnprofiledModelError:
        return await asyncio.to_thread(registered_signature, serving, app)
    return config_signature(config)


# An app's config is replaced, not changed, when its spec or plan changes (AppDispatcher.update),
# and compares by identity: its signature is worked out once per config, not once per query.
# A few configs are kept (each holds its app's profiles and validation records): more apps
# served at once than that each work theirs out again, as every query did before.
@functools.lru_cache(maxsize=16)
def config_signature(config: AppConfig) -> ModelSignature:
    """The ``/v2`` signature of an app served by ``config`` (:func:`signature_of`)."""
    return app_signature([config.model_io(m) for m in config.models])


def registered_signature(serving: ServingLoop, app: str) -> ModelSignature:
    """The signature of ``app``'s models as its spec resolves them, without their profiles
    (blocking): what the registry says of its artifacts."""
    record = serving.store.get_app(app)
    try:
        resolved = serving.resolver.resolve(record.spec, check_budget=False)
        return app_signature([model_io(resolved, m) for m in resolved.spec.serving_order])
    except (EstimatorError, ValueError) as error:
        raise ServingUnavailableError(app, f"its spec does not resolve: {error}") from None


async def unserved(serving: ServingLoop, app: str) -> str | None:
    """Why ``app`` cannot serve a query now (:meth:`ServingLoop.unserved`), or None when it
    can; an app of registered models not profiled yet is not ready, and says why (what to run)."""
    try:
        return await serving.unserved(app)
    except UnprofiledModelError as error:
        return str(error)


@router.get("/models/{app}")
async def metadata(app: AppName, services: ServicesDep, _who: Inferrer) -> dict[str, Any]:
    signature = await signature_of(serving_of(services, app), app, None)
    return model_metadata(app, signature, PLATFORM, (MODEL_VERSION,))


@router.get("/models/{app}/versions/{version}")
async def metadata_of_version(
    app: AppName, version: str, services: ServicesDep, who: Inferrer
) -> dict[str, Any]:
    _version(version)
    return await metadata(app, services, who)


@router.get("/models/{app}/ready")
async def model_ready(app: AppName, services: ServicesDep, _who: Inferrer) -> dict[str, Any]:
    reason = await unserved(serving_of(services, app), app)
    if reason is not None:
        raise OipError(reason, 503)
    return {"name": app, "ready": True}


@router.get("/models/{app}/versions/{version}/ready")
async def model_ready_of_version(
    app: AppName, version: str, services: ServicesDep, who: Inferrer
) -> dict[str, Any]:
    _version(version)
    return await model_ready(app, services, who)


@router.post("/models/{app}/infer")
async def infer(app: AppName, services: ServicesDep, _who: Inferrer, request: Request) -> Response:
    received = received_s(request)
    serving = serving_of(services, app)
    if request.headers.get("content-encoding", "identity").lower() != "identity":
        raise OipError("compressed requests are not served (Content-Encoding)")
    lengths = request.headers.getlist(HEADER_LENGTH)
    if len(lengths) > 1:
        # Which one was meant is not ours to guess (the fast path took the last, this route
        # the first: one body answered two ways).
        raise OipError(f"{HEADER_LENGTH} is given {len(lengths)} times; a request has one")
    signature = await signature_of(serving, app, received)
    limit = body_limit(signature, services.settings.oip_body_max_bytes)
    body = await _read_body(request, limit)
    document, binary = split_body(body, lengths[0] if lengths else None)
    if not isinstance(document, Mapping):
        raise OipError("body must be a JSON object")
    check_binary_switches(document)
    answered = await serve_query(serving, app, signature, document, binary, received)
    return answer_response(app, document, answered)


@dataclass(frozen=True, slots=True)
class Answered:
    """A query's answer (:func:`serve_query`): the request's ``id``, the outputs asked for
    (name, datatype, the answering models' outputs stacked per request row) and the serving
    loop's result."""

    id: str | None
    outputs: Sequence[tuple[str, str, np.ndarray]]
    result: InferResult


async def serve_query(
    serving: ServingLoop,
    app: str,
    signature: ModelSignature,
    document: Mapping[str, Any],
    binary: bytes,
    received: float | None,
) -> Answered:
    """One Open Inference Protocol query for ``app`` (``document``, its JSON part as a mapping,
    ``binary`` the raw bytes of the inputs whose ``parameters.binary_data_size`` says how many)
    checked against ``signature`` and served through the serving loop: REST's
    ``POST /v2/models/{app}/infer`` and gRPC's ``ModelInfer``
    (:mod:`controlplane.api.grpc_oip`) both serve here. Raises what the serving loop raises,
    :class:`OipError` for a request the protocol refuses."""
    return await serve_parsed(
        serving, app, signature, document, parse_query(signature, document, binary), received
    )


async def serve_parsed(
    serving: ServingLoop,
    app: str,
    signature: ModelSignature,
    document: Mapping[str, Any],
    parsed: InferRequest,
    received: float | None,
) -> Answered:
    """:func:`serve_query` for a query already checked (:func:`parse_query`): the inference
    fast path (:mod:`controlplane.api.fast_infer`) checks first, so that a query the protocol
    refuses goes to the route, which answers its error."""
    arrays = [parsed.inputs[spec.name] for spec in signature.inputs]
    rows: list[Any] = list(arrays[0]) if len(arrays) == 1 else list(zip(*arrays, strict=True))
    deadline = _deadline_s(document, serving.clock.now_s() if received is None else received)
    result = await serving.infer(app, rows, None, None, received, deadline, request_id=parsed.id)
    names = parsed.outputs or [spec.name for spec in signature.outputs]
    try:
        outputs = stack_outputs(result.replies, names)
    except ModelIOError as error:
        raise ApiError(
            502, "bad_gateway", f"the models' answers cannot be stacked: {error}"
        ) from None
    return Answered(parsed.id, outputs, result)


@router.post("/models/{app}/versions/{version}/infer")
async def infer_version(
    app: AppName, version: str, services: ServicesDep, who: Inferrer, request: Request
) -> Response:
    _version(version)
    return await infer(app, services, who, request)


def parse_query(
    signature: ModelSignature, document: Mapping[str, Any], binary: bytes
) -> InferRequest:
    """A query's document and binary part (:func:`serve_query`) checked against ``signature``:
    its input arrays, batch size, id and outputs asked for; :class:`OipError` naming the field
    that does not fit."""
    document = with_binary_inputs(document, binary, signature)
    return parse_infer_request(document, signature, max_batch_size=MAX_INFER_SAMPLES)


def _deadline_s(document: Mapping[str, Any], received_s: float) -> float | None:
    """When the client stops waiting, on the serving loop's clock: the request's
    ``parameters.timeout`` (microseconds, as Triton's clients send it: ``tritonclient``'s
    ``infer(..., timeout=...)``) after its receipt; None without one. A query whose batch would
    end past it is answered 504 instead of being sent (docs/serving.md, "Failures")."""
    parameters = document.get("parameters")
    timeout = parameters.get("timeout") if isinstance(parameters, Mapping) else None
    if timeout is None:
        return None
    return received_s + timeout_us(timeout) / 1e6


def timeout_us(timeout: object) -> float:
    """A request's ``parameters.timeout``, microseconds; :class:`OipError` for one that is not a
    finite number > 0 (gRPC checks it too before the call's deadline may replace it)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise OipError(f"parameters.timeout must be microseconds > 0, got {timeout!r}")
    try:
        microseconds = float(timeout)
    except OverflowError:  # a JSON integer past any float (the json module reads it exactly)
        raise OipError(
            f"parameters.timeout must be microseconds > 0, got an integer of"
            f" {len(str(timeout))} digits, past any deadline"
        ) from None
    if not math.isfinite(microseconds):  # 1e400 in JSON reads as an infinity
        raise OipError(
            f"parameters.timeout must be a finite number of microseconds, got {timeout!r}"
        )
    return microseconds


def split_body(body: bytes, header_length: str | None) -> tuple[Any, bytes]:
    """The JSON part of a body, decoded (its nesting bounded), and its binary part (Triton's
    extension: :func:`~provisioners.worker.oip.split_infer_body`)."""
    return split_infer_body(body, header_length, _load_bounded_json)


def reads_own_body(scope: Scope) -> bool:
    """Whether the request is an inference query, whose route reads its body under the limit
    of its model (:func:`body_limit`) instead of the API's 1 MiB."""
    return (
        scope.get("method") == "POST" and _INFER_PATH.fullmatch(scope.get("path", "")) is not None
    )


@functools.lru_cache(maxsize=64)  # the same few signatures, query after query
def body_limit(signature: ModelSignature, ceiling: int) -> int:
    """The largest body ``signature``'s model takes: what its inputs take for
    :data:`MAX_INFER_SAMPLES` rows as JSON text (:data:`_JSON_VALUE_BYTES` a value: more than
    in binary) and :data:`MAX_BODY_BYTES` for the rest of the document, at most ``ceiling``
    (the setting ``oip_body_max_bytes``). An input of a size the signature leaves open (a
    ``-1`` past the batch dimension, text) takes the ceiling."""
    values = 0
    for spec in signature.inputs:
        if spec.datatype == "BYTES" or any(d < 0 for d in spec.sample_shape):
            return ceiling
        values += math.prod(spec.sample_shape)
    return min(ceiling, MAX_BODY_BYTES + MAX_INFER_SAMPLES * values * _JSON_VALUE_BYTES)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, 413 as soon as its declared length or what arrived (chunked, no
    length) passes ``limit``."""
    message = f"the body is larger than {limit:,} bytes (256 rows of the model's inputs)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "too_large", message)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "too_large", message)
        chunks.append(chunk)
    return b"".join(chunks)


def _load_bounded_json(body: bytes) -> Any:
    """:func:`load_json`, after a check of the nesting depth (a body nested a hundred thousand
    deep is a 400, not a decoder's RecursionError)."""
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise OipError(f"body is not JSON this service takes: nested deeper than {MAX_JSON_DEPTH}")
    return load_json(body)


def check_binary_switches(document: Mapping[str, Any]) -> None:
    """The binary tensor extension's switches of an answer's outputs, the request's
    ``parameters.binary_data_output`` and an output's ``parameters.binary_data``, are booleans
    when given: :class:`OipError` (400) naming the one that is not (``"true"`` or ``1`` had been
    taken for false, and the outputs answered as JSON without a word)."""
    _check_switch(document.get("parameters"), "binary_data_output", "parameters")
    entries = document.get("outputs")
    for index, entry in enumerate(entries if isinstance(entries, list) else ()):
        if isinstance(entry, Mapping):
            _check_switch(entry.get("parameters"), "binary_data", f"outputs[{index}].parameters")


def _check_switch(settings: object, key: str, where: str) -> None:
    """:func:`check_binary_switches` of one ``parameters`` object (``where`` names it)."""
    if isinstance(settings, Mapping) and key in settings:
        value = settings[key]
        if not isinstance(value, bool):
            given = "null" if value is None else f"{type(value).__name__} {value!r:.40}"
            raise OipError(f"{where}.{key} must be true or false, got {given}")


def binary_outputs(document: Mapping[str, Any], names: Sequence[str]) -> set[str]:
    """The outputs to answer in binary (see the module docstring)."""
    parameters = document.get("parameters")
    everything = isinstance(parameters, Mapping) and parameters.get("binary_data_output") is True
    own: dict[str, Any] = {}
    entries = document.get("outputs")
    for entry in entries if isinstance(entries, list) else ():
        settings = entry.get("parameters")
        own[entry["name"]] = settings.get("binary_data") if isinstance(settings, Mapping) else None
    return {n for n in names if own.get(n) is True or (own.get(n) is None and everything)}


def answer_response(app: str, document: Mapping[str, Any], answered: Answered) -> Response:
    """The answer to a query (``document``, its JSON part) served as ``answered``: its outputs
    in JSON or binary as the query asked (:func:`binary_outputs`)."""
    body, headers = answer_payload(app, document, answered)
    response = Response(body)
    response.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
    return response


def answer_payload(
    app: str, document: Mapping[str, Any], answered: Answered
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """:func:`answer_response`'s body and its content headers (its type, and with binary outputs
    the JSON part's length), for a caller that sends them itself (the inference fast path)."""
    request_id, outputs, result = answered.id, answered.outputs, answered.result
    binary_names = binary_outputs(document, [name for name, _, _ in outputs])
    tensors = []
    blobs = []
    for name, datatype, array in outputs:
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in binary_names:
            raw = raw_bytes(datatype, array)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            if array.dtype.kind in "fc" and not np.isfinite(array).all():
                raise ApiError(
                    502,
                    "bad_gateway",
                    "an output holds values JSON cannot carry (NaN, infinity): ask for it in"
                    " binary (parameters.binary_data)",
                )
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    answer: dict[str, Any] = {"model_name": app, "model_version": MODEL_VERSION}
    if request_id is not None:
        answer["id"] = request_id
    answer["outputs"] = tensors
    answer["parameters"] = result_parameters(result)
    header = orjson.dumps(answer)
    if not blobs:
        return header, [(b"content-type", b"application/json")]
    return b"".join([header, *blobs]), [
        (b"content-type", b"application/octet-stream"),
        (HEADER_LENGTH.lower().encode(), str(len(header)).encode()),
    ]


def result_parameters(result: InferResult) -> dict[str, Any]:
    """An answer's ``parameters``: per request row the model that answered it, the gear, whether
    it was late, and the timings of ``/v1``."""
    return {
        "models": list(result.models),
        "gear": result.gear,
        "late": result.late,
        "total_ms": result.total_ms,
        "queue_ms": result.queue_ms,
        "service_ms": result.service_ms,
        "transport_ms": result.transport_ms,
        "compute_ms": result.compute_ms,
        "api_ms": result.api_ms,
    }


def raw_bytes(datatype: str, array: np.ndarray) -> bytes:
    """An output's values as the protocol's raw tensor bytes: little-endian, row-major (REST's
    binary outputs, gRPC's ``raw_output_contents``)."""
    try:
        return array.astype(numpy_dtype(datatype).newbyteorder("<"), copy=False).tobytes()
    except ArtifactError:
        return array.tobytes()
