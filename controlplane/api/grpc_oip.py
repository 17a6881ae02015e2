"""The Open Inference Protocol over gRPC: KServe v2's ``inference.GRPCInferenceService``, as
Triton's clients speak it (``tritonclient.grpc`` works as it is), next to REST's ``/v2``.

The messages are the ones ``tritonclient[grpc]`` ships (``tritonclient.grpc.service_pb2``,
generated from Triton's ``grpc_service.proto``); the methods served:

- ``ServerLive`` (true), ``ServerReady`` (true while the service runs its serving loop) and
  ``ServerMetadata`` (``heteroplane``, its version, no extensions): no token, like
  ``/v2/health/*``.
- ``ModelMetadata``, ``ModelReady`` and ``ModelInfer`` (infer scope, the token in the
  ``authorization`` metadata: ``Bearer <token>``): an app is a model, its version ``1`` (or
  none given), exactly as on REST. ``ModelReady`` answers ``ready: false`` where REST's route
  answers 503 (no healthy worker serves a model of the app's gear, or its registered models
  are not profiled yet).
- ``ModelInfer`` takes its inputs in ``raw_input_contents`` (little-endian bytes, what
  ``tritonclient.grpc`` sends) or in each input's typed ``contents`` (``bool_contents``,
  ``int_contents``, ``int64_contents``, ``uint_contents``, ``uint64_contents``,
  ``fp32_contents``, ``fp64_contents``; FP16 only raw; their count is checked against the
  declared shape before they are copied, and values in another datatype's field are refused
  naming the field expected) and answers its outputs in
  ``raw_output_contents``, with REST's answer ``parameters`` (``models``, comma-separated,
  ``gear``, ``late``, the timings). The query is served by the REST route's own path
  (:func:`~controlplane.api.routes.oip.serve_query`: the same checks against the app's input
  signature, the same serving loop, the request's ``parameters.timeout`` or the call's gRPC
  deadline as the client's deadline). Where several serving processes share the workers and
  another one dispatches the app, the query is forwarded to it as REST's query
  (:func:`~controlplane.api.forwarding.forward_oip`) and its answer, or its refusal, given back
  (:func:`forwarded_response`), as REST's ``/v2`` is forwarded. The request's ``parameters``
  are REST's: the binary switches are checked as REST checks them
  (:func:`~controlplane.api.routes.oip.check_binary_switches`; every output is raw whatever
  they say), and an output's other parameters (shared memory, classification) are refused. An
  answer past the server's message limit (``oip_body_max_bytes``) is ``RESOURCE_EXHAUSTED``
  (413) with one line naming the app, its size and the limit: before the workers compute it
  where the signature fixes the outputs' sizes (:func:`answer_bytes_at_least`), else before
  it is sent (grpc had failed to send it, with a traceback in the log). A request past the
  app's own limit (REST's ``/v2`` body limit, :func:`~controlplane.api.routes.oip.body_limit`:
  256 rows of the model's inputs) is ``RESOURCE_EXHAUSTED`` too, before its contents are read.

Every other method of the service (model configuration, statistics, the repository, shared
memory, streaming) answers ``UNIMPLEMENTED``. The model calls are counted in ``GET /metrics``'
``heteroplane_api_requests_total`` under their app, as REST's answer would be (200, or the
status below; a call cut by its own deadline, a 504, as REST's query past its timeout: one its
client cancelled sooner is not counted, as a REST client gone is not). At most the setting
``grpc_calls_max`` calls that need a token are in flight: one more is ``RESOURCE_EXHAUSTED`` at
once, before its token is checked or its message parsed (``retry-after`` 1 s trailing metadata;
counted as a 429 under no app); the health calls are never refused. An error is the REST
answer's status and one-line
message (:func:`~controlplane.api.errors.render_error`, the same mapping) as a gRPC status:

====================  ======================  ==================================================
HTTP status           gRPC code               e.g.
====================  ======================  ==================================================
400, 422              ``INVALID_ARGUMENT``    a wrong shape or datatype; the model raised on the
                                              query's inputs
401                   ``UNAUTHENTICATED``     no, a malformed, unknown or revoked token
403                   ``PERMISSION_DENIED``   a token without the infer scope
404                   ``NOT_FOUND``           ``no model 'x'``; another version than ``1``
413, 429              ``RESOURCE_EXHAUSTED``  admission refused the query (``retry-after``
                                              trailing metadata, seconds); an answer past
                                              the message limit
502, 500              ``INTERNAL``            the model failed on a query (not its inputs)
502 with              ``UNAVAILABLE``         the worker failed (no answer, a broken
``Retry-After``                               connection): sent again, the query may be
                                              answered (``retry-after`` trailing metadata)
503                   ``UNAVAILABLE``         no worker serves the app; no serving loop
504                   ``DEADLINE_EXCEEDED``   the query could not be answered by its deadline
====================  ======================  ==================================================

:func:`attach` runs the server with the API: it starts on the API's event loop after the
serving loop starts (``heteroplane serve``'s lifespan) and stops, giving the calls in flight
:data:`STOP_GRACE_S`, before it stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import numpy as np
import orjson
from fastapi import FastAPI
from fastapi.security.utils import get_authorization_scheme_param
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]
from grpc import aio
from starlette.requests import Request
from tritonclient.grpc import service_pb2 as pb

from controlplane import __version__
from controlplane.api.deps import Services, check_scope, verify_bearer
from controlplane.api.errors import render_error
from controlplane.api.fast_infer import TokenCheck
from controlplane.api.forwarding import forward_oip
from controlplane.api.routes.oip import (
    HEADER_LENGTH,
    PLATFORM,
    as_model_error,
    body_limit,
    check_binary_switches,
    parse_query,
    raw_bytes,
    result_parameters,
    serve_parsed,
    serving_of,
    signature_of,
    timeout_us,
    unserved,
)
from controlplane.db.store import Principal
from controlplane.policies.auth import Scope
from provisioners.artifacts import ArtifactError, ModelSignature, numpy_dtype
from provisioners.worker.oip import MODEL_VERSION, OipError, model_metadata, value_count_error

__all__ = [
    "DEADLINE_SLACK_S",
    "SERVICE",
    "STOP_GRACE_S",
    "GrpcOip",
    "Listener",
    "answer_bytes_at_least",
    "attach",
    "cut_by_deadline",
    "forwarded_response",
    "grpc_code",
    "request_document",
]

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# How long the calls in flight may take to finish when the server stops, s.
STOP_GRACE_S = 5.0
# A call cancelled this close to its deadline, s, was cut by it: the client's cancel at its
# deadline reaches the server a trip after the client's deadline, and the server's deadline is
# a trip after it too (the grpc-timeout header's), so it comes a trip's jitter before or after
# the server's (5 ms before it on a loaded test machine). At most half the call's deadline
# (:func:`cut_by_deadline`).
DEADLINE_SLACK_S = 1.0

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    502: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Each datatype's typed field of InferTensorContents (FP16 has none: it travels raw).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_FIELDS = tuple(dict.fromkeys(_CONTENTS.values()))


def grpc_code(status: int, retry_after: bool = False) -> grpc.StatusCode:
    """The gRPC code of an HTTP error status (the table of the module docstring); with
    ``retry_after`` (the answer says when to send again) a 502 is ``UNAVAILABLE``: its worker
    failed, not its model, and gRPC clients retry ``UNAVAILABLE``, not ``INTERNAL``."""
    if status == 502 and retry_after:
        return grpc.StatusCode.UNAVAILABLE
    code = _CODES.get(status)
    if code is not None:
        return code
    return grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A call's gRPC error: the REST answer's status, its code, message and trailing
    metadata."""

    status: int
    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


class DispatcherRefusedError(Exception):
    """The app's dispatcher (another serving process) refused a forwarded query: its status,
    message and ``Retry-After``, given to the caller as they came."""

    def __init__(self, status: int, message: str, retry_after: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def _refusal(method: str, error: Exception) -> _Refusal:
    """``error`` as the REST API answers it (its status, its message), as a gRPC error."""
    if isinstance(error, OipError):
        return _Refusal(error.status, grpc_code(error.status), str(error))
    if isinstance(error, DispatcherRefusedError):
        retried = (("retry-after", error.retry_after),) if error.retry_after is not None else ()
        return _Refusal(error.status, grpc_code(error.status, bool(retried)), str(error), retried)
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": f"/{SERVICE}/{method}",
        "raw_path": f"/{SERVICE}/{method}".encode(),
        "query_string": b"",
        "headers": [],
        "scheme": "http",
        "server": None,
        "root_path": "",
    }
    answer = render_error(Request(scope), as_model_error(error))
    try:
        message = str(json.loads(bytes(answer.body))["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = "internal error; the server log has the details"
    retry = answer.headers.get("retry-after")
    trailers = (("retry-after", retry),) if retry is not None else ()
    code = grpc_code(answer.status_code, retry is not None)
    return _Refusal(answer.status_code, code, message, trailers)


class GrpcOip:
    """The service's methods over the API's :class:`~controlplane.api.deps.Services`."""

    def __init__(
        self,
        services: Services,
        max_message_bytes: int | None = None,
        max_calls: int | None = None,
    ) -> None:
        self.services = services
        self.tokens = TokenCheck(services.store)
        # The server's limit on a message it sends (attach's): an answer past it is refused.
        self.max_message_bytes = (
            services.settings.oip_body_max_bytes if max_message_bytes is None else max_message_bytes
        )
        # The calls that need a token in flight, and their cap: one more is refused at once
        # (each holds a task and its message until it ends). Counted here, not by grpcio's
        # maximum_concurrent_rpcs: grpcio releases before 2024 held the calls past it waiting,
        # and later ones (1.76 among them) let calls past it once they had refused some, their
        # count gone below zero (grpc/grpc#41531).
        self.calls = 0
        self.max_calls = services.settings.grpc_calls_max if max_calls is None else max_calls

    async def server_live(self, _request: Any, _who: Principal | None, _call: _Call) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _request: Any, _who: Principal | None, _call: _Call) -> Any:
        serving = self.services.serving
        return pb.ServerReadyResponse(ready=serving is not None and serving.running)

    async def server_metadata(self, _request: Any, _who: Principal | None, _call: _Call) -> Any:
        return pb.ServerMetadataResponse(name=PLATFORM, version=__version__, extensions=[])

    async def model_metadata(self, request: Any, _who: Principal | None, _call: _Call) -> Any:
        _version(request.version)
        serving = serving_of(self.services, request.name)
        signature = await signature_of(serving, request.name, None)
        document = model_metadata(request.name, signature, PLATFORM, (MODEL_VERSION,))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=document["name"],
            versions=document["versions"],
            platform=document["platform"],
            inputs=[tensor(**t) for t in document["inputs"]],
            outputs=[tensor(**t) for t in document["outputs"]],
        )

    async def model_ready(self, request: Any, _who: Principal | None, _call: _Call) -> Any:
        _version(request.version)
        reason = await unserved(serving_of(self.services, request.name), request.name)
        return pb.ModelReadyResponse(ready=reason is None)

    async def model_infer(self, request: Any, _who: Principal | None, call: _Call) -> Any:
        app = request.model_name
        _version(request.model_version)
        forwarder = self.services.forwarder
        url = forwarder.owners.forward_to(app) if forwarder is not None else None
        if forwarder is not None and url is not None:
            document, binary = request_document(request, call.remaining_s)
            answer = await forward_oip(forwarder, url, app, document, binary, call.authorization)
            if answer is not None:
                return self._within_limit(app, forwarded_response(app, answer))
            # The dispatcher cannot be reached: served here (as REST's forwarding does).
        serving = serving_of(self.services, app)
        signature = await signature_of(serving, app, call.received_s)
        # The app's own limit, as REST's /v2 body's (256 rows of its inputs as JSON text, which
        # the same rows in a message never pass), before the contents are copied.
        limit = body_limit(signature, self.max_message_bytes)
        if (received := request.ByteSize()) > limit:
            raise OipError(
                f"app {app!r}: the request takes {received:,} bytes, past the app's limit of"
                f" {limit:,} bytes (256 rows of the model's inputs, as on REST's /v2)",
                413,
            )
        document, binary = request_document(request, call.remaining_s)
        parsed = parse_query(signature, document, binary)
        names = parsed.outputs or tuple(spec.name for spec in signature.outputs)
        # Refused before the workers compute it where the signature tells the answer's size.
        size = answer_bytes_at_least(signature, names, parsed.batch_size)
        if size > self.max_message_bytes:
            raise _too_large(app, size, self.max_message_bytes)
        answered = await serve_parsed(serving, app, signature, document, parsed, call.received_s)
        response = pb.ModelInferResponse(model_name=app, model_version=MODEL_VERSION)
        if answered.id is not None:
            response.id = answered.id
        for name, datatype, array in answered.outputs:
            response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
            response.raw_output_contents.append(raw_bytes(datatype, array))
        for key, value in result_parameters(answered.result).items():
            _set_parameter(response.parameters[key], value)
        return self._within_limit(app, response)

    def _within_limit(self, app: str, response: Any) -> Any:
        """``response`` when it fits the server's message limit, else the refusal: grpc had
        failed to send it, with its own text and a traceback in the log, the call counted as
        answered."""
        size = response.ByteSize()
        if size > self.max_message_bytes:
            raise _too_large(app, size, self.max_message_bytes)
        return response

    async def principal(self, metadata: Mapping[str, str]) -> Principal:
        """The caller of a call that needs the infer scope, from its ``authorization``
        metadata: the fast path's cached check first, else the REST routes' own (which says
        why not)."""
        header = metadata.get("authorization")
        scheme, token = get_authorization_scheme_param(header)
        if scheme.lower() == "bearer" and token:
            cached: Principal | None = await self.tokens.principal(token)
            if cached is not None:
                check_scope(cached, Scope.INFER)
                return cached
        principal = await asyncio.to_thread(verify_bearer, self.services.store, header)
        check_scope(principal, Scope.INFER)
        return principal


def forwarded_response(app: str, answer: httpx.Response) -> Any:
    """The ModelInferResponse of the REST answer of a forwarded query (:func:`forward_oip`: its
    outputs in binary, or in JSON where the query asked for that);
    :class:`DispatcherRefusedError` when the dispatcher refused it, a 502 :class:`OipError` for
    an answer that is not the protocol's."""
    if answer.status_code != 200:
        try:
            message = str(orjson.loads(answer.content)["error"])
        except (ValueError, KeyError, TypeError):
            message = f"the app's dispatcher answered HTTP {answer.status_code}"
        raise DispatcherRefusedError(answer.status_code, message, answer.headers.get("retry-after"))
    content = answer.content
    try:
        split = int(answer.headers.get(HEADER_LENGTH, len(content)))
        document = orjson.loads(content[:split])
        response = pb.ModelInferResponse(
            model_name=str(document.get("model_name", app)),
            model_version=str(document.get("model_version", MODEL_VERSION)),
        )
        if document.get("id") is not None:
            response.id = str(document["id"])
        offset = split
        for tensor in document["outputs"]:
            datatype = str(tensor["datatype"])
            response.outputs.add(name=tensor["name"], datatype=datatype, shape=tensor["shape"])
            if "data" in tensor:
                values = np.asarray(tensor["data"], dtype=numpy_dtype(datatype))
                raw = raw_bytes(datatype, values)
            else:
                size = int(tensor["parameters"]["binary_data_size"])
                raw = content[offset : offset + size]
                offset += size
            response.raw_output_contents.append(raw)
        for key, value in (document.get("parameters") or {}).items():
            _set_parameter(response.parameters[key], value)
    except (ValueError, KeyError, TypeError, AttributeError, ArtifactError) as error:
        raise OipError(
            f"the app's dispatcher gave an answer that is not the protocol's: {error}", 502
        ) from None
    return response


def _version(version: str) -> None:
    if version not in ("", MODEL_VERSION):
        raise OipError(f"version {version!r} is not served (versions: {MODEL_VERSION})", 404)


def answer_bytes_at_least(signature: ModelSignature, names: Sequence[str], rows: int) -> int:
    """The bytes of ``rows`` rows of the outputs ``names`` of ``signature`` in
    ``raw_output_contents``: those whose sample size the signature fixes (an output of text, or
    with a ``-1`` past the batch dimension, counts 0: :meth:`GrpcOip._within_limit` checks the
    answer itself)."""
    specs = {spec.name: spec for spec in signature.outputs}
    size = 0
    for name in names:
        spec = specs[name]
        if spec.datatype == "BYTES" or any(d < 0 for d in spec.sample_shape):
            continue
        size += rows * math.prod(spec.sample_shape) * spec.dtype.itemsize
    return size


def _too_large(app: str, size: int, limit: int) -> OipError:
    return OipError(
        f"app {app!r}: the answer takes {size:,} bytes, past gRPC's message limit of"
        f" {limit:,} bytes (oip_body_max_bytes): ask for fewer rows or fewer outputs",
        413,
    )


def request_document(request: Any, remaining_s: float | None) -> tuple[dict[str, Any], bytes]:
    """A ModelInferRequest as the REST route's request: its JSON document and its binary part
    (the raw inputs, in order, each sized by its ``parameters.binary_data_size``)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise OipError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs"
        )
    inputs: list[dict[str, Any]] = []
    for index, tensor in enumerate(request.inputs):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if tensor.parameters:
            names = ", ".join(sorted(tensor.parameters))
            raise OipError(f"input {tensor.name!r}: parameters are not served ({names})")
        if raw:
            if tensor.HasField("contents"):
                raise OipError(f"input {tensor.name!r}: both contents and raw_input_contents")
            entry["parameters"] = {"binary_data_size": len(raw[index])}
        else:
            entry["data"] = _contents(tensor)
        inputs.append(entry)
    document: dict[str, Any] = {"inputs": inputs}
    if request.id:
        document["id"] = request.id
    parameters = {key: _parameter(value) for key, value in request.parameters.items()}
    given = parameters.get("timeout")
    # What the REST route says of it (a deadline would otherwise replace it unread: an
    # infinity, longer than any deadline, had been served).
    given_us = None if given is None else timeout_us(given)
    if remaining_s is not None:
        # The call's deadline is the client's, as parameters.timeout is (microseconds).
        deadline_us = max(remaining_s, 1e-6) * 1e6
        if given_us is None or given_us > deadline_us:
            parameters["timeout"] = deadline_us
    if parameters:
        document["parameters"] = parameters
    if request.outputs:
        document["outputs"] = [_output(o) for o in request.outputs]
    # REST's check of the binary switches: all gRPC outputs are raw, but a switch that is not a
    # boolean is the same mistake, and the query forwarded to a dispatcher is REST's.
    check_binary_switches(document)
    return document, b"".join(raw)


def _contents(tensor: Any) -> list[Any]:
    """An input's typed contents as a list, their count first checked against its declared
    shape's: a message of 64 MiB of values had been copied, on the event loop, before the route
    refused it."""
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        if tensor.datatype == "FP16":
            raise OipError(f"input {tensor.name!r}: FP16 travels in raw_input_contents")
        return []  # the route names the datatype it expected
    values = getattr(tensor.contents, field)
    shape = list(tensor.shape)
    count = math.prod(shape)
    if len(values) != count and all(d >= 0 for d in shape):
        other = next((f for f in _FIELDS if f != field and len(getattr(tensor.contents, f))), None)
        if other is not None:
            raise OipError(
                f"input {tensor.name!r}: {tensor.datatype} values travel in {field}, not {other}"
            )
        raise value_count_error(tensor.name, len(values), shape)
    return list(values)


def _output(output: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": output.name}
    if output.parameters:
        entry["parameters"] = {k: _parameter(v) for k, v in output.parameters.items()}
    return entry


def _parameter(parameter: Any) -> Any:
    """An InferParameter's value (None when it holds none)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def _set_parameter(parameter: Any, value: Any) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, list | tuple):
        parameter.string_param = ",".join(map(str, value))
    else:
        parameter.string_param = str(value)


@dataclass(frozen=True, slots=True)
class _Call:
    """A call's receipt (on the serving loop's clock; None without a serving loop), the
    seconds its deadline leaves (None: no deadline) and its ``authorization`` metadata."""

    received_s: float | None
    remaining_s: float | None
    authorization: str | None = None


_Method = Callable[[Any, Principal | None, _Call], Awaitable[Any]]
_OPEN = frozenset({"ServerLive", "ServerReady", "ServerMetadata"})  # no token, as /v2/health


def _model_of(request: Any) -> str:
    """The app a model call names (ModelInfer's ``model_name``, the others' ``name``)."""
    return str(getattr(request, "model_name", "") or getattr(request, "name", ""))


def cut_by_deadline(remaining_s: float | None, deadline_s: float | None) -> bool:
    """Whether a call cancelled with ``remaining_s`` of its deadline left (None: it has none)
    was cut by its deadline (its client's cancel at the deadline, or the server's own timer),
    ``deadline_s`` being what its deadline left when it arrived: within
    :data:`DEADLINE_SLACK_S` of it, and within half of the call's deadline, so that a call its
    client cancelled sooner is not counted (with the slack alone, every cancel of a call of a
    deadline under 1 s counted as a 504)."""
    if remaining_s is None:
        return False
    slack = DEADLINE_SLACK_S if deadline_s is None else min(DEADLINE_SLACK_S, deadline_s / 2)
    return remaining_s <= slack


def _parse(request_type: Any, payload: bytes) -> Any:
    """A call's request message from its bytes; :class:`OipError` (400: ``INVALID_ARGUMENT``)
    when they are not one (protobuf's message says where, on one line)."""
    try:
        return request_type.FromString(payload)
    except DecodeError as error:
        raise OipError(f"the request is not a valid {request_type.__name__}: {error}") from None


def _handlers(service: GrpcOip) -> Any:
    """The generic handler of the service's methods: each one's request and answer types, its
    token check (or none) and its errors as gRPC statuses."""

    def unary(name: str, method: _Method, request_type: Any, response_type: Any) -> Any:
        # The request arrives as bytes and is parsed here: a deserializer that raises (a
        # malformed message, a string field that is not UTF-8) is answered by grpc itself as
        # UNKNOWN, with a traceback in the log.
        async def handle(payload: bytes, context: aio.ServicerContext) -> Any:
            if name in _OPEN:
                return await serve(payload, context)
            if service.calls >= service.max_calls:
                service.services.requests.add("", 429)
                context.set_trailing_metadata((("retry-after", "1"),))
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{service.calls:,} gRPC calls are in flight, the server's limit"
                    " (grpc_calls_max): send again later",
                )
            service.calls += 1
            try:
                return await serve(payload, context)
            finally:
                service.calls -= 1

        async def serve(payload: bytes, context: aio.ServicerContext) -> Any:
            request = None
            serving = service.services.serving
            metadata = dict(context.invocation_metadata() or ())
            call = _Call(
                serving.clock.now_s() if serving is not None else None,
                context.time_remaining(),
                metadata.get("authorization"),
            )
            try:
                # The token first, as REST checks it before the body: a caller without one
                # learns nothing of its message (it had been INVALID_ARGUMENT, where REST
                # answers 401) and costs no parsing.
                who = None
                if name not in _OPEN:
                    who = await service.principal(metadata)
                request = _parse(request_type, payload)
                answer = await method(request, who, call)
            except asyncio.CancelledError:
                # grpc cancels the handler when the call's deadline passes (the client's cancel
                # at its deadline, or the server's own timer), before the serving loop's
                # deadline (the same instant, read later) refuses the query: REST's 504,
                # counted as REST counts it. A call its client cancelled sooner is not
                # counted, as a REST client gone is not (no answer).
                if name not in _OPEN and cut_by_deadline(
                    context.time_remaining(), call.remaining_s
                ):
                    model = "" if request is None else _model_of(request)
                    service.services.requests.add(model, 504)
                raise
            except Exception as error:
                refused = _refusal(name, error)
            else:
                if name not in _OPEN:
                    service.services.requests.add(_model_of(request), 200)
                return answer
            if name not in _OPEN:
                model = "" if request is None else _model_of(request)
                service.services.requests.add(model, refused.status)
            if refused.trailers:
                context.set_trailing_metadata(refused.trailers)
            await context.abort(refused.code, refused.message)

        return grpc.unary_unary_rpc_method_handler(
            handle, response_serializer=response_type.SerializeToString
        )

    methods: dict[str, _Method] = {
        "ServerLive": service.server_live,
        "ServerReady": service.server_ready,
        "ServerMetadata": service.server_metadata,
        "ModelMetadata": service.model_metadata,
        "ModelReady": service.model_ready,
        "ModelInfer": service.model_infer,
    }
    # Each method's types are the protocol's <Name>Request and <Name>Response.
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            name: unary(name, method, getattr(pb, f"{name}Request"), getattr(pb, f"{name}Response"))
            for name, method in methods.items()
        },
    )


# grpc's channel arguments are C ints: a larger one fails the server's creation (OverflowError);
# its core aborts the process on a connection cap that is not under the largest.
_GRPC_INT_MAX = 2**31 - 1


def _grpc_ms(seconds: float) -> int:
    """``seconds`` as a grpc time argument: whole ms, at least 1, at most grpc's largest (about
    24.8 days: a longer ``http_keep_alive_s`` had failed the service's start)."""
    return min(max(1, round(1000.0 * seconds)), _GRPC_INT_MAX)


@dataclass(slots=True)
class Listener:
    """Where :func:`attach` serves: ``port`` is the bound one (a free one for 0) while the API
    runs and the server with it, else None."""

    host: str
    port: int | None = None


def attach(
    app: FastAPI,
    host: str,
    port: int,
    max_message_bytes: int,
    max_calls: int | None = None,
    *,
    max_connections: int | None = None,
    handshake_s: float | None = None,
    idle_s: float | None = None,
) -> Listener:
    """Serve the protocol over gRPC on ``host:port`` (0: a free port) while ``app`` runs: the
    server starts in the app's lifespan, after what the lifespan starts (the serving loop), and
    stops before it. Messages up to ``max_message_bytes`` (the setting
    ``oip_body_max_bytes``, as on REST); a larger one is ``RESOURCE_EXHAUSTED``. At most
    ``max_calls`` calls that need a token in flight (default: the setting ``grpc_calls_max``;
    :class:`GrpcOip`).

    Connections are bounded as REST's are (:mod:`controlplane.service.protocol`): at most
    ``max_connections`` open (default: the setting ``grpc_connections_max``; grpc's core closes
    one more as it accepts it, before any byte is read), each to finish its handshake (the
    client's HTTP/2 preface) within ``handshake_s`` (default: ``http_head_timeout_s``, REST's
    time for a request head) and closed once it has had no call for ``idle_s`` (default:
    ``http_keep_alive_s``, REST's idle keep-alive; a client reconnects on its next call). A
    connection that opened and never spoke held a slot forever."""
    listener = Listener(host)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(running: FastAPI) -> AsyncIterator[Any]:
        async with inner(running) as state:
            services: Services = running.state.services
            settings = services.settings
            connections = (
                settings.grpc_connections_max if max_connections is None else max_connections
            )
            handshake = settings.http_head_timeout_s if handshake_s is None else handshake_s
            idle = settings.http_keep_alive_s if idle_s is None else idle_s
            server = aio.server(
                options=[
                    # Another process on the port is an error, not a second listener.
                    ("grpc.so_reuseport", 0),
                    ("grpc.max_receive_message_length", max_message_bytes),
                    ("grpc.max_send_message_length", max_message_bytes),
                    ("grpc.max_allowed_incoming_connections", min(connections, _GRPC_INT_MAX - 1)),
                    ("grpc.server_handshake_timeout_ms", _grpc_ms(handshake)),
                    ("grpc.max_connection_idle_ms", _grpc_ms(idle)),
                ]
            )
            service = GrpcOip(services, max_message_bytes, max_calls)
            server.add_generic_rpc_handlers((_handlers(service),))
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            bound: int | None = None
            try:
                bound = server.add_insecure_port(address)
            except RuntimeError as error:
                # Taken since heteroplane serve tried it: REST goes on alone, said once, as
                # the check says it (a warning: the service serves, without gRPC).
                logger.warning(
                    "no gRPC served: cannot listen on %s: %s (REST is served alone; set"
                    " grpc_port or --grpc-port)",
                    address,
                    error,
                )
            if bound is None:
                yield state
                return
            await server.start()
            listener.port = bound
            logger.info("Open Inference Protocol over gRPC on %s:%d", host, bound)
            try:
                yield state
            finally:
                listener.port = None
                await server.stop(STOP_GRACE_S)

    app.router.lifespan_context = lifespan
    return listener
