"""``/v1/models``: the model registry (:mod:`controlplane.registry`): push a version, list and
read versions, download a version's bytes.

``POST /v1/models/{name}`` takes the artifact as the raw body (``application/octet-stream``;
any content type is read as bytes). The body is streamed to a file in the data directory with
``model_max_bytes`` enforced as it arrives (a declared ``Content-Length`` over it is refused
before a byte is read), so the API's 1 MiB body limit does not apply to it
(:func:`streams_own_body`); then the registry inspects it, hashes it, stores the blob and
inserts the row (201), off the event loop, or answers the model's newest version when that
is the same file, format and signature (200, ``created`` false: a push run twice). The staged
file is removed whatever happens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from controlplane.api.deps import Operator, Services, ServicesDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.api.model_schemas import (
    ModelListOut,
    ModelOut,
    ModelPushOut,
    ModelVersionOut,
    version_out,
)
from controlplane.api.routes import errors
from controlplane.crashpoints import crash_point
from controlplane.errors import ModelTooLargeError, NotFoundError
from controlplane.registry import Registry, check_model_name
from provisioners.artifacts import NAME_PATTERN

__all__ = ["PREFIX", "router", "streams_own_body"]

PREFIX = "/v1/models/"
router = APIRouter(prefix="/v1", tags=["models"])

# The pattern is documented, not enforced by FastAPI: a name that is not a DNS label is the
# registry's 400 naming the rule (one line), not a generic 422.
ModelName = Annotated[
    str,
    Path(
        description="the model's name (a DNS label)",
        json_schema_extra={"pattern": NAME_PATTERN, "maxLength": 63},
    ),
]
ModelVersion = Annotated[int, Path(ge=1, le=2**31 - 1, description="the version number")]

_ARTIFACT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the artifact's bytes: an ONNX model or a TorchScript archive",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
_ARTIFACT_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the artifact's bytes",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def streams_own_body(scope: Scope) -> bool:
    """Whether the request is a push, whose route enforces its own (larger) body limit."""
    return bool(scope.get("method") == "POST" and str(scope.get("path", "")).startswith(PREFIX))


def _registry(services: Services) -> Registry:
    if services.registry is None:
        raise ApiError(503, "unavailable", "this service runs no model registry")
    return services.registry


@router.post(
    "/models/{name}",
    status_code=201,
    summary="Push a new version of a model (operator): the body is the artifact's bytes",
    openapi_extra=_ARTIFACT_BODY,
    responses={
        200: {
            "description": "the model's newest version, which holds these bytes, format, inputs"
            " and outputs already (`created`: false)",
            "model": ModelPushOut,
        },
        **errors(400, 401, 403, 409, 413, 422, 503),
    },
)
async def push_model(
    name: ModelName,
    request: Request,
    response: Response,
    services: ServicesDep,
    _who: Operator,
    format: Annotated[
        Literal["onnx", "torchscript"] | None,
        Query(description="the artifact's format; detected when left out"),
    ] = None,
    inputs: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=4096,
            description="a TorchScript model's inputs: name:FP32:-1x13[,name:...]",
        ),
    ] = None,
) -> ModelPushOut:
    registry = _registry(services)
    registry.check_push(name, format, inputs)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > registry.max_bytes:
        raise ModelTooLargeError(registry.max_bytes)
    with registry.staged_file() as path:
        received = 0
        # Plain writes on the event loop: a chunk is at most the server's read size (64 KiB)
        # and goes to the page cache; the slow parts (inspection, hashing, the blob store, the
        # database) run in the thread pool below.
        with path.open("wb") as handle:
            async for chunk in request.stream():
                received += len(chunk)
                if received > registry.max_bytes:
                    raise ModelTooLargeError(registry.max_bytes)
                handle.write(chunk)
                crash_point("model_push.mid_upload")
        pushed = await run_in_threadpool(registry.push_version, name, path, format, inputs)
    if not pushed.created:
        response.status_code = 200
    document = version_out(pushed.record).model_dump()
    return ModelPushOut(**document, created=pushed.created)


@router.get(
    "/models", summary="List every version of every model (viewer)", responses=errors(401, 403, 422)
)
def list_models(services: ServicesDep, _who: Viewer) -> ModelListOut:
    return ModelListOut(models=[version_out(r) for r in _registry(services).versions()])


@router.get(
    "/models/{name}",
    summary="A model's versions, oldest first (viewer)",
    responses=errors(400, 401, 403, 404, 422),
)
def get_model(name: ModelName, services: ServicesDep, _who: Viewer) -> ModelOut:
    versions = _registry(services).versions(check_model_name(name))
    if not versions:
        raise NotFoundError("model", name)
    return ModelOut(name=name, versions=[version_out(r) for r in versions])


@router.get(
    "/models/{name}/versions/{version}",
    summary="One version of a model (viewer)",
    responses=errors(400, 401, 403, 404, 422),
)
def get_model_version(
    name: ModelName, version: ModelVersion, services: ServicesDep, _who: Viewer
) -> ModelVersionOut:
    registry = _registry(services)
    return version_out(registry.store.get_model_version(check_model_name(name), version))


@router.get(
    "/models/{name}/versions/{version}/artifact",
    summary="The bytes of one version of a model (viewer)",
    response_class=StreamingResponse,
    responses={**_ARTIFACT_ANSWER, **errors(400, 401, 403, 404, 422, 503)},
)
def get_artifact(
    name: ModelName, version: ModelVersion, services: ServicesDep, _who: Viewer
) -> StreamingResponse:
    registry = _registry(services)
    record = registry.store.get_model_version(check_model_name(name), version)
    suffix = "onnx" if record.format == "onnx" else "pt"
    return StreamingResponse(
        registry.open(record),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(record.size_bytes),
            "Content-Disposition": f'attachment; filename="{name}-{version}.{suffix}"',
            "ETag": f'"{record.sha256}"',
        },
    )
