"""The API's routes, one module per resource; shared here: the ``{app}`` path parameter and the
error responses every route declares in the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path

from controlplane.api.schemas import ErrorBody

__all__ = ["APP_NAME_MAX", "APP_NAME_PATTERN", "AppName", "PlanId", "errors"]

_DESCRIPTIONS = {
    400: "Malformed JSON body, or a model name that is not a DNS label",
    401: "Missing, malformed, unknown or revoked token (WWW-Authenticate: Bearer)",
    403: "The token's scope does not allow this",
    404: "No such app, plan, instance or model version",
    409: "Conflict: the name is taken, another write won, or the state does not allow it",
    412: "If-Match names another version of the app than it is at (read it again)",
    413: "The body is larger than the limit (1 MiB; a model: model_max_bytes)",
    422: "Invalid request: a field of the wrong type, out of range, unknown, or an invalid spec",
    429: "Overloaded: the queue cannot be served within the SLO (Retry-After says when to retry)",
    502: "The workers could not answer the query (every attempt failed)",
    503: "The database or the artifact store is unavailable, or no instance serves the app",
    504: "The query was not answered in time (far past its SLO)",
}

# An app name is a DNS label (controlplane.spec): anything else is a 422, not a 404.
APP_NAME_PATTERN = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"
APP_NAME_MAX = 63
AppName = Annotated[
    str,
    Path(
        pattern=f"^{APP_NAME_PATTERN}$",
        max_length=APP_NAME_MAX,
        description="the app's name",
    ),
]
# Plan ids are database integers: bounded so that a huge number is a 422, not a driver error.
PlanId = Annotated[int, Path(ge=1, le=2**31 - 1, description="the plan's id")]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with the error body's schema."""
    return {
        status: {"model": ErrorBody, "description": _DESCRIPTIONS[status]} for status in statuses
    }
