"""Errors on the wire: the one place that maps domain errors to HTTP statuses and bodies.

Every error answer has the body ``{"error": {"code": ..., "message": ..., "field": ...}}``
(:class:`~controlplane.api.schemas.ErrorBody`): ``code`` is a stable word a client may branch on,
``message`` one line for a person, ``field`` the path of the offending value when there is one.

=====================================  ======  ===================
what was raised                        status  code
=====================================  ======  ===================
:class:`ApiError` (auth, bad path)     its own its own
malformed JSON body                    400     ``malformed_json``
``RequestValidationError`` (pydantic)  422     ``invalid_request``
:class:`~controlplane.spec.SpecError`  422     ``invalid_spec``
other ``EstimatorError`` (a trace the  422     ``unplannable``
profiles cannot serve, an SLO no type
can meet)
``UnprofiledModelError`` (a query to   503     ``serving_unavailable``
an app whose registered model is not
profiled yet)
:class:`NotFoundError`                 404     ``not_found``
:class:`AppExistsError`                409     ``app_exists``
:class:`InvalidTransitionError`        409     ``invalid_transition``
:class:`ConflictError`                 409     ``conflict``
:class:`InvalidValueError` (the store  422     ``invalid_value``
refuses a value the schemas let by)
:class:`DatabaseError`                 503     ``database_unavailable``
:class:`ModelNameError` (registry)     400     ``invalid_model_name``
:class:`ModelTooLargeError`            413     ``too_large``
:class:`ModelRejectedError` (the       422     ``invalid_model``
inspection refused the artifact)
:class:`ArtifactStoreError`            503     ``artifact_store_unavailable``
:class:`OverloadedError` (admission)   429     ``overloaded`` (with
                                               ``Retry-After``)
:class:`RequirementsUnmetError`        422     ``requirements_unmet``
:class:`QueryRejectedError` (the       422     ``query_rejected``
model raised on the query's inputs)
:class:`QueryFailedError`              502     ``query_failed`` (with
                                               ``Retry-After`` where
                                               the worker failed,
                                               not the model)
:class:`NoServingInstanceError`        503     ``no_serving_instance``
:class:`ServingUnavailableError`       503     ``serving_unavailable``
:class:`QueryTimeoutError`             504     ``query_timeout``
Starlette's own (unknown route, 405)   same    ``not_found``, ...
anything else                          500     ``internal`` (logged;
                                               the body says nothing
                                               of the cause)
=====================================  ======  ===================
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.errors import (
    AppExistsError,
    ArtifactStoreError,
    ConflictError,
    ControlPlaneError,
    DatabaseError,
    InvalidTransitionError,
    InvalidValueError,
    ModelError,
    ModelNameError,
    ModelRejectedError,
    ModelTooLargeError,
    NoServingInstanceError,
    NotFoundError,
    OverloadedError,
    QueryFailedError,
    QueryRejectedError,
    QueryTimeoutError,
    RequirementsUnmetError,
    ServingError,
    ServingUnavailableError,
)
from controlplane.spec import SpecError, UnprofiledModelError
from estimator.errors import EstimatorError

__all__ = [
    "RETRY_AFTER_LOST_WORKER_S",
    "ApiError",
    "CatchAllMiddleware",
    "OipErrorShapeMiddleware",
    "error_document",
    "error_response",
    "install_error_handlers",
    "is_oip_path",
    "oip_error_body",
    "render_error",
    "unauthorized",
]

logger = logging.getLogger(__name__)

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "too_many_requests",
    431: "headers_too_large",
    502: "bad_gateway",
    503: "unavailable",
    504: "gateway_timeout",
}
_MAX_MESSAGE_CHARS = 500
# The Retry-After of a 502 whose worker failed (not its model): the dispatcher takes a worker out
# of matching at its first transport failure and sends its queries to the others, so a query
# sent again a second later meets a healthy one if the app has any.
RETRY_AFTER_LOST_WORKER_S = 1
# The methods an Allow header may name, in the order it names them (OPTIONS is never served).
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


class ApiError(Exception):
    """An answer decided in the API layer itself (a missing token, a path that contradicts the
    body): its status, code, one-line message, field and extra headers."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = dict(headers or {})


def unauthorized(message: str) -> ApiError:
    """401 with the ``WWW-Authenticate: Bearer`` challenge (RFC 6750 section 3)."""
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def _one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= _MAX_MESSAGE_CHARS else line[: _MAX_MESSAGE_CHARS - 3] + "..."


def error_response(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The JSON error answer every failure takes."""
    return JSONResponse(
        error_document(False, code, message, field), status_code=status, headers=dict(headers or {})
    )


def is_oip_path(path: str) -> bool:
    """Whether ``path`` is under the Open Inference Protocol's ``/v2``."""
    return path.startswith("/v2/") or path == "/v2"


def error_document(oip: bool, code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """An error body: the API's ``{"error": {"code", "message", "field"}}``, or with ``oip``
    the Open Inference Protocol's ``{"error": "message"}``."""
    line = _one_line(message)
    if oip:
        return {"error": line}
    return {"error": {"code": code, "message": line, "field": field}}


def _field_path(loc: Sequence[int | str]) -> str | None:
    """``("body", "trace", "rate_qps")`` -> ``trace.rate_qps``; ``("query", "since")`` ->
    ``since``; ``("body",)`` -> None (the body as a whole)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif path:
            path += f".{part}"
        else:
            path = str(part)
    return path or None


def _validation_message(detail: Mapping[str, Any], field: str | None) -> str:
    kind = detail.get("type")
    if kind == "extra_forbidden":
        return f"{field}: unknown field" if field else "unknown field"
    if kind == "missing":
        return f"{field}: is required" if field else "a body is required"
    # pydantic says "Input should be ...", "String should match ...": say "must".
    message = str(detail.get("msg", "invalid value")).removeprefix("Value error, ")
    message = re.sub(r"^\w+ should ", "must ", message)
    if not field and kind in ("dict_type", "model_attributes_type"):
        message = "the body must be a JSON object"
    shown = ""
    # A check of several fields together says what it needs; the whole input is noise then, as
    # is a list whose length is at fault (the message says its length: "not 300").
    if kind not in ("value_error", "too_long", "too_short") and "input" in detail:
        text = repr(detail["input"])
        shown = f", got {text if len(text) <= 60 else text[:57] + '...'}"
    return f"{field}: {message}{shown}" if field else f"{message}{shown}"


def _on_validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    details = list(error.errors())
    if not details:
        return error_response(422, "invalid_request", "the request is invalid")
    # A body that is not JSON at all is a different mistake from JSON of the wrong shape.
    broken = next((d for d in details if d.get("type") == "json_invalid"), None)
    if broken is not None:
        compressed = _compressed(request)
        if compressed is not None:
            return error_response(400, "malformed_json", compressed)
        reason = (broken.get("ctx") or {}).get("error", "not valid JSON")
        return error_response(400, "malformed_json", f"the body is not valid JSON: {reason}")
    # An unknown field first: a misspelt key also makes the real one "missing".
    detail = next((d for d in details if d.get("type") == "extra_forbidden"), details[0])
    field = _field_path(tuple(detail.get("loc", ())))
    message = _validation_message(detail, field)
    if field is None and detail.get("type") in ("dict_type", "model_attributes_type"):
        message = _content_type_message(request) or message
    return error_response(422, "invalid_request", message, field)


def _compressed(request: Request) -> str | None:
    """What to say of a body sent compressed (a ``Content-Encoding`` other than identity),
    which no route reads: its bytes failed as JSON, and the answer said the JSON was bad."""
    encoding = request.headers.get("content-encoding", "identity").strip()
    if encoding.lower() in ("", "identity"):
        return None
    return (
        f"compressed request bodies are not served (Content-Encoding: {encoding[:40]}):"
        " send the body as it is"
    )


def _content_type_message(request: Request) -> str | None:
    """What is wrong when a JSON body was not taken as JSON because of its Content-Type (None
    when the request said JSON)."""
    given = request.headers.get("content-type")
    if given is None:
        return (
            "the body must be a JSON object sent with Content-Type: application/json;"
            " the request has no Content-Type"
        )
    kind = given.split(";", 1)[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        return None
    return (
        "the body must be a JSON object sent with Content-Type: application/json;"
        f" the request's Content-Type is {given[:60]!r}"
    )


def _on_api_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    return error_response(error.status, error.code, error.message, error.field, error.headers)


def _on_spec_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, SpecError)
    return error_response(422, "invalid_spec", str(error), error.field or None)


def _on_estimator_error(request: Request, error: Exception) -> JSONResponse:
    if isinstance(error, UnprofiledModelError):
        # Nothing wrong with the request: the app cannot serve until it is profiled (its
        # /v2 readiness says the same).
        return error_response(503, "serving_unavailable", str(error))
    return error_response(422, "unplannable", str(error))


def _on_serving_error(error: ServingError) -> JSONResponse | None:
    if isinstance(error, OverloadedError):
        return error_response(
            429, "overloaded", str(error), headers={"Retry-After": str(error.retry_after_s)}
        )
    if isinstance(error, RequirementsUnmetError):
        return error_response(422, "requirements_unmet", str(error), "requirements")
    if isinstance(error, QueryRejectedError):
        return error_response(422, "query_rejected", str(error), "inputs")
    if isinstance(error, QueryFailedError):
        # A worker's failure (not the model's): the query may be answered if sent again.
        retry = {"Retry-After": str(RETRY_AFTER_LOST_WORKER_S)} if error.transport else None
        return error_response(502, "query_failed", str(error), headers=retry)
    if isinstance(error, NoServingInstanceError):
        return error_response(503, "no_serving_instance", str(error))
    if isinstance(error, ServingUnavailableError):
        return error_response(503, "serving_unavailable", str(error))
    if isinstance(error, QueryTimeoutError):
        return error_response(504, "query_timeout", str(error))
    return None


def _on_control_plane_error(request: Request, error: Exception) -> JSONResponse:
    if isinstance(error, ServingError):
        answer = _on_serving_error(error)
        if answer is not None:
            return answer
    if isinstance(error, NotFoundError):
        return error_response(404, "not_found", str(error))
    if isinstance(error, AppExistsError):
        return error_response(409, "app_exists", str(error), "name")
    if isinstance(error, InvalidTransitionError):
        return error_response(409, "invalid_transition", str(error))
    if isinstance(error, ConflictError):
        return error_response(409, "conflict", str(error))
    if isinstance(error, InvalidValueError):
        return error_response(422, "invalid_value", str(error), error.field)
    if isinstance(error, DatabaseError):
        _DATABASE_ERRORS.log(f"database error on {request.method} {request.url.path}: {error}")
        return error_response(503, "database_unavailable", "the database is unavailable")
    if isinstance(error, ModelError):
        return _on_model_error(request, error)
    return _internal(request, error)


class _Thinned:
    """An error logged at most once every ``every_s`` with the count of those left out since:
    a database that went down was an ERROR line for each request (25 a second from a loops
    process's feed alone)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -math.inf
        self._left_out = 0

    def log(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s:
                self._left_out += 1
                return
            left_out, self._left_out, self._last = self._left_out, 0, now
        more = f" ({left_out} more since the last such line)" if left_out else ""
        logger.error("%s%s", message, more)


_DATABASE_ERRORS = _Thinned(every_s=10.0)


def _on_model_error(request: Request, error: ModelError) -> JSONResponse:
    if isinstance(error, ModelNameError):
        return error_response(400, "invalid_model_name", str(error), "name")
    if isinstance(error, ModelTooLargeError):
        return error_response(413, "too_large", str(error))
    if isinstance(error, ModelRejectedError):
        return error_response(422, "invalid_model", str(error), error.field)
    return _internal(request, error)


def _on_artifact_store_error(request: Request, error: Exception) -> JSONResponse:
    # The blob store failed; what it said is for the log, not the caller.
    logger.error("artifact store error on %s %s: %s", request.method, request.url.path, error)
    return error_response(503, "artifact_store_unavailable", "the artifact store is unavailable")


def _on_http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    code = _STATUS_CODES.get(error.status_code, "error")
    message = error.detail if isinstance(error.detail, str) else code.replace("_", " ")
    headers = error.headers
    if error.status_code == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    if error.status_code == 400 and message == "There was an error parsing the body":
        # FastAPI's answer to a body its JSON parser gave up on other than for its syntax (a
        # nesting past the interpreter's recursion limit, bytes that are not UTF-8, an integer
        # past the interpreter's 4,300 digits): said as malformed JSON is.
        return error_response(
            400,
            "malformed_json",
            _compressed(request)
            or "the body could not be read as JSON (not UTF-8, nested too deep, or a number"
            " longer than 4,300 digits)",
        )
    if error.status_code == 405:
        # Starlette's Allow names the methods of the one route it tried; a path served by
        # several routes (GET and POST /v1/apps) supports all of theirs (RFC 9110 section 15.5.6).
        allowed = _allowed_methods(request)
        headers = {**(headers or {}), "Allow": ", ".join(allowed)}
        message = (
            f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        )
    return error_response(error.status_code, code, message, None, headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves on the request's path: each one is tried
    against the app's routes (FastAPI nests included routers, so there is no flat list)."""
    routes = request.app.router.routes
    allowed = [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes
        )
    ]
    if "GET" in allowed and "HEAD" not in allowed:  # controlplane.api.head answers it
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    return allowed


def _internal(request: Request, error: BaseException) -> JSONResponse:
    logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(500, "internal", "internal error; the server log has the details")


def render_error(request: Request, error: BaseException) -> JSONResponse:
    """The answer the handlers below give ``error`` (the 500 for one none of them takes): for a
    path that answers outside FastAPI's exception handling (``controlplane.api.fast_infer``)."""
    if isinstance(error, ApiError):
        return _on_api_error(request, error)
    if isinstance(error, SpecError):
        return _on_spec_error(request, error)
    if isinstance(error, EstimatorError):
        return _on_estimator_error(request, error)
    if isinstance(error, ControlPlaneError):
        return _on_control_plane_error(request, error)
    if isinstance(error, ArtifactStoreError):
        return _on_artifact_store_error(request, error)
    return _internal(request, error)


def install_error_handlers(app: FastAPI) -> None:
    """Register the mapping above on ``app`` (and the catch-all for anything unexpected)."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(SpecError, _on_spec_error)
    app.add_exception_handler(EstimatorError, _on_estimator_error)
    app.add_exception_handler(ControlPlaneError, _on_control_plane_error)
    app.add_exception_handler(ArtifactStoreError, _on_artifact_store_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Answer 500 with the generic error body for any exception no handler took, and log it.

    A plain ASGI middleware rather than an ``Exception`` handler: Starlette re-raises after an
    ``Exception`` handler has answered, which would log every such error twice.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            request = Request(scope)
            response = _internal(request, error)
            if started:
                # Too late to change the answer: the client sees a cut-off response.
                return
            await response(scope, receive, send)


class OipErrorShapeMiddleware:
    """On ``/v2``, the Open Inference Protocol's error body ``{"error": "message"}`` in place of
    the API's ``{"error": {"code", "message", "field"}}`` for every error answer, whichever layer
    gave it (the body and header limits, an unknown route, 405, the catch-all 500); status and
    headers unchanged. Anything else passes through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_oip_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def shaping_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _is_json_error(message):
                start = message  # held until the body is whole
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = oip_error_body(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode("ascii")))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaping_send)


def _is_json_error(start: Message) -> bool:
    return start["status"] >= 400 and any(
        k == b"content-type" and v.startswith(b"application/json")
        for k, v in start.get("headers", [])
    )


def oip_error_body(body: bytes) -> bytes:
    """``body`` with an API error document rewritten to the protocol's (else as it was)."""
    try:
        document = json.loads(body)
        message = document["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(message, str):
        return body
    return json.dumps({"error": message}, separators=(",", ":")).encode()
