"""What happened to an app: ``/v1/apps/{app}/decisions`` (what the policies decided and why),
``/v1/apps/{app}/events`` (its instances' lifecycle moves) and ``/v1/apps/{app}/metrics`` (the
rolled-up time series the dashboard draws). Each is oldest first; ``since`` (exclusive, ISO 8601,
UTC when no offset is given) and ``limit`` (the newest that many) narrow it. Decisions also take
``kind`` and ``exclude_kind`` (each repeatable, or comma-separated): filtered in the store's query,
so ``limit`` counts only the decisions that pass."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from controlplane.api.deps import ServicesDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.api.routes import AppName, errors
from controlplane.api.schemas import DecisionOut, InstanceEventOut, MetricSampleOut

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["events"])


def _iso_only(value: object) -> object:
    """Refuse a number: pydantic reads one as Unix seconds, so ``20261202`` (a date in ISO
    8601's basic form) would be August 1970 and filter nothing."""
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9.]+(e[+-]?[0-9]+)?\s*", value, re.I):
        raise ValueError("must be an ISO 8601 time such as 2026-12-01T10:00:00Z, not a number")
    return value


IsoTime = Annotated[datetime, BeforeValidator(_iso_only)]
Since = Annotated[
    IsoTime | None,
    Query(description="only after this time (exclusive; ISO 8601, UTC when no offset is given)"),
]
Limit = Annotated[int, Query(ge=1, le=10_000, description="the newest this many")]


def _utc(at: datetime | None, field: str) -> datetime | None:
    if at is None:
        return None
    try:
        return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    except OverflowError:
        raise ApiError(
            422, "invalid_request", f"{field}: out of range, got {at.isoformat()}", field
        ) from None


def _kinds(values: list[str] | None, field: str) -> list[str] | None:
    """The kinds of ``kind=a&kind=b`` or ``kind=a,b`` (None: no filter); empty names (``kind=``,
    ``kind=a,``) name nothing, so a parameter of only empty names filters nothing."""
    if values is None:
        return None
    kinds = [name.strip() for value in values for name in value.split(",")]
    return [name for name in kinds if name] or None


@router.get(
    "/apps/{app}/decisions",
    summary="What the policies decided for the app, and why (viewer)",
    responses=errors(401, 403, 404, 422),
)
def list_decisions(
    app: AppName,
    services: ServicesDep,
    _who: Viewer,
    since: Since = None,
    kind: Annotated[
        list[str] | None, Query(description="only these kinds (repeatable, or comma-separated)")
    ] = None,
    exclude_kind: Annotated[
        list[str] | None, Query(description="none of these kinds (repeatable, or comma-separated)")
    ] = None,
    limit: Limit = 1000,
) -> list[DecisionOut]:
    records = services.store.list_decisions(
        app,
        since=_utc(since, "since"),
        kinds=_kinds(kind, "kind"),
        exclude_kinds=_kinds(exclude_kind, "exclude_kind"),
        limit=limit,
    )
    return [DecisionOut.model_validate(d) for d in records]


@router.get(
    "/apps/{app}/events",
    summary="The lifecycle moves of the app's instances (viewer)",
    responses=errors(401, 403, 404, 422),
)
def list_events(
    app: AppName, services: ServicesDep, _who: Viewer, since: Since = None, limit: Limit = 1000
) -> list[InstanceEventOut]:
    records = services.store.list_instance_events(app=app, since=_utc(since, "since"), limit=limit)
    return [InstanceEventOut.model_validate(e) for e in records]


@router.get(
    "/apps/{app}/metrics",
    summary="The app's rolled-up load, latency, SLO attainment and cost over time (viewer)",
    responses=errors(401, 403, 404, 422),
)
def metric_series(
    app: AppName,
    services: ServicesDep,
    _who: Viewer,
    since: Since = None,
    until: Annotated[IsoTime | None, Query(description="only up to this time (inclusive)")] = None,
    limit: Limit = 1000,
) -> list[MetricSampleOut]:
    records = services.store.metric_series(
        app, since=_utc(since, "since"), until=_utc(until, "until"), limit=limit
    )
    return [MetricSampleOut.model_validate(s) for s in records]
