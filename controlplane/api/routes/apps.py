"""``/v1/apps``: register, list, read, replace and delete apps (``?drain=true``: take it down,
:mod:`controlplane.apps.teardown`).

The body of ``POST`` and ``PUT`` is the app spec document (docs/app-spec.md), checked with
:func:`controlplane.spec.validate_spec` and against its catalog and profiles (relative paths
resolve against the service's ``data_dir``) and the model registry; a problem is a 422 naming the
field. A model's ``artifact: NAME`` is stored pinned to ``NAME@VERSION``, the latest version when
the app is registered (or replaced).

``POST /v1/apps/{app}/profiles`` measures the latency profiles of the app's registered models
through one worker per candidate type (:mod:`controlplane.apps.profile_run`; minutes, in a
thread), ``GET`` reads the ones stored.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.deps import Admin, Operator, Services, ServicesDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.api.routes import AppName, errors
from controlplane.api.routes.fleet import instance_out
from controlplane.api.schemas import AppOut, TeardownOut
from controlplane.apps.budget import budget_drain, check_serving_floor
from controlplane.apps.profile_run import (
    DEFAULT_SAMPLES,
    ProfileRunRequest,
    check_profile_run,
    moved_profiles,
    run_profile,
)
from controlplane.apps.profiler import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_WARMUP,
    MAX_BATCH_SIZE,
    ProfilingError,
)
from controlplane.apps.resolver import spec_document
from controlplane.apps.scaling import scaling_switch
from controlplane.apps.teardown import request_teardown
from controlplane.db.store import AppRecord
from controlplane.errors import BudgetBelowServingFleetError, NotFoundError
from controlplane.policies.lifecycle import KEPT_STATES, LIVE_STATES, profiling_group
from controlplane.policies.rollout_states import spec_held_by_rollout
from controlplane.serving.workers import DEFAULT_WORKER_PORT

__all__ = ["SPEC_BODY_MARK", "app_out", "router"]

SPEC_BODY_MARK = "x-heteroplane-spec-body"

router = APIRouter(prefix="/v1", tags=["apps"])

# Marks the operations whose body is an app spec: api.app gives them the AppSpec schema.
_SPEC_BODY: dict[str, Any] = {SPEC_BODY_MARK: True}
SpecDocument = Annotated[dict[str, Any], Body(description="the app spec document")]


def app_out(record: AppRecord) -> AppOut:
    return AppOut.model_validate(record)


@router.post(
    "/apps",
    status_code=201,
    summary="Register an app (operator)",
    openapi_extra=_SPEC_BODY,
    responses=errors(400, 401, 403, 409, 422),
)
def create_app(document: SpecDocument, services: ServicesDep, who: Operator) -> AppOut:
    resolved = services.resolver.check(document)
    record = services.store.create_app(spec_document(resolved.spec), who=who.name)
    return app_out(record)


@router.get("/apps", summary="List the apps (viewer)", responses=errors(401, 403, 422))
def list_apps(services: ServicesDep, _who: Viewer) -> list[AppOut]:
    return [app_out(record) for record in services.store.list_apps()]


@router.get(
    "/apps/{app}",
    summary="Read an app (viewer); its ETag is its version, for If-Match on a replace",
    responses=errors(401, 403, 404, 422),
)
def get_app(app: AppName, services: ServicesDep, _who: Viewer, response: Response) -> AppOut:
    record = services.store.get_app(app)
    response.headers["ETag"] = _etag(record.version)
    return app_out(record)


def _etag(version: int) -> str:
    return f'"{version}"'


def _if_match(header: str | None, app: str, version: int) -> None:
    """A 412 when ``If-Match`` (the ETags of ``GET /v1/apps/{app}``, or ``*``) names none of the
    app's version: the client read the app before another change, which its replace would
    undo. A 400 for a value that is no ETag list."""
    if header is None or header.strip() == "*":
        return
    tags = []
    for part in header.split(","):
        tag = part.strip()
        bare = tag.removeprefix("W/")  # a weak tag is well formed, and never matches (RFC 9110)
        if len(bare) < 2 or bare[0] != '"' or bare[-1] != '"':
            raise ApiError(
                400,
                "invalid_request",
                f'If-Match: expected ETags such as "{version}" (GET /v1/apps/{app}),'
                f" got {header!r}",
                "If-Match",
            )
        tags.append(tag)
    if _etag(version) not in tags:
        raise ApiError(
            412,
            "precondition_failed",
            f"app {app!r} is at version {version}, not the one If-Match names ({header}):"
            " it changed since it was read; read it again and send the change again",
            "If-Match",
        )


@router.put(
    "/apps/{app}",
    summary="Replace an app's spec (operator); a new budget in it is audited; with If-Match,"
    " only at the version it names",
    openapi_extra=_SPEC_BODY,
    responses=errors(400, 401, 403, 404, 409, 412, 422),
)
def replace_app(
    app: AppName,
    document: SpecDocument,
    services: ServicesDep,
    who: Operator,
    response: Response,
    if_match: Annotated[
        str | None,
        Header(description='the app\'s ETag as read (GET /v1/apps/{app}: "VERSION"), or *'),
    ] = None,
) -> AppOut:
    name = document.get("name")
    if name != app:
        raise ApiError(
            422, "invalid_request", f"name: must be the app's name {app!r}, got {name!r}", "name"
        )
    current = services.store.get_app(app)  # 404 before the spec is checked against its files
    _if_match(if_match, app, current.version)
    response.headers["ETag"] = _etag(current.version)
    resolved = services.resolver.check(document)
    replaced = spec_document(resolved.spec)
    if replaced == current.spec:
        # The same spec once pinned (``artifact: wine`` is stored as the ``wine@N`` it named):
        # nothing changes, and the app's version (which its previewed plans were made for)
        # stays.
        return app_out(current)
    moved = _check_rollout_allows(services, app, current.spec, replaced)
    _check_types_in_use(services, app, resolved.spec.instance_types)
    changed = changed_artifacts(current.spec, replaced)
    if changed:
        # A profile run's workers being ended (just after `heteroplane profile run`) serve
        # nothing and never will: they do not hold the change back. Measuring ones still do.
        live = [
            instance
            for instance in services.store.list_instances(app, LIVE_STATES)
            if instance.state in KEPT_STATES
            or not profiling_group(app, instance.request_id).startswith("run ")
        ]
        if live:
            raise ApiError(
                409,
                "conflict",
                f"app {app!r} serves {'; '.join(changed)} on {len(live)} live instance(s),"
                " which would keep serving it: a new model version goes into a running app"
                f" through a rollout (heteroplane rollout start --app {app} ...;"
                f" docs/rollouts.md), or take the app down first (heteroplane app down {app})",
            )
    budget = replaced.get("budget_usd_per_hr")
    lowered = None
    if isinstance(budget, int | float) and budget < current.budget_usd_per_hr:
        # A lower budget in the spec is held to PUT .../budget's rule (not forced): below the
        # smallest serving fleet a 409; the reconciler drains what is over it, as after that,
        # and the same budget_drain decision says so.
        try:
            # At the prices of the spec being applied (its catalog may differ from the old).
            lowered = check_serving_floor(
                services.store, services.resolver, app, float(budget), spec=replaced
            )
        except BudgetBelowServingFleetError as error:
            raise ApiError(
                409,
                "conflict",
                f"{error.shortfall}: set it with heteroplane budget set --app"
                f" {app} --usd-per-hr {budget:g} --force to drain it anyway, then apply the spec",
            ) from None
    # What the replace drops and says, written with it (a crash leaves all or none: after the
    # spec alone, the old bytes' profiles stayed for good, and a loop the scaling was handed to
    # started again on the fleet it had reached before).
    dropped, said = (
        moved_profiles(services.store, app, current.spec, replaced, who.name)
        if changed
        else ([], [])
    )
    said = [*said, *scaling_switch(current.spec, replaced, who.name)]
    if lowered is not None and isinstance(budget, int | float):
        stages, values = lowered
        said += budget_drain(services.store, app, float(budget), who.name, stages, values)[3]
    # At the version read: a budget changed meanwhile is not undone by this replace (409), and
    # a rollout started meanwhile refuses what it works on (its start and this take one lock).
    record = services.store.update_app(
        app,
        replaced,
        who=who.name,
        expected_version=current.version,
        unless_rollout=", ".join(moved) if moved else None,
        drop_profiles=dropped,
        said=said,
    )
    response.headers["ETag"] = _etag(record.version)
    if dropped:
        services.resolver.invalidate(app)
    return app_out(record)


# What a rollout reads from the spec it started on: changed under it, the new version's share of
# the queries failed 422 against the new shape (counted nowhere, so it never rolled back), and a
# promotion wrote the old thresholds back over the new.
_ROLLOUT_FIELDS = ("models", "cascade", "thresholds", "validation", "instance_types")


def _check_types_in_use(services: Services, app: str, types: list[str]) -> None:
    """A 409 for a spec that leaves out an instance type the app runs now (its applied plan's
    fleet, a live instance): its plan would go on asking for the type while serving and the
    tuner no longer took it as a candidate (the app answered 503 until a new plan), and nothing
    could price or replace it."""
    plan = services.store.get_applied_plan(app)
    planned = set() if plan is None else {t for t, n in plan.plan.fleet.items() if n > 0}
    live = [i.instance_type for i in services.store.list_instances(app, LIVE_STATES)]
    dropped = (planned | set(live)) - set(types)
    if not dropped:
        return
    uses = []
    if plan is not None and planned & dropped:
        uses.append(f"its applied plan {plan.id}")
    count = sum(1 for t in live if t in dropped)
    if count:
        uses.append(f"{count} live instance(s)")
    names = ", ".join(sorted(dropped))
    caps = ", ".join(f"{t}: 0" for t in sorted(dropped))
    raise ApiError(
        409,
        "conflict",
        f"app {app!r} runs {names} ({' and '.join(uses)}), which the spec leaves out: to move"
        f" off it, keep it listed with max_counts {{{caps}}}, plan and apply (heteroplane plans"
        f" preview --app {app}, plans apply), then leave it out once none runs; or take the"
        f" app down first (heteroplane app down {app})",
        "instance_types",
    )


def _check_rollout_allows(
    services: Services, app: str, old: dict[str, Any], new: dict[str, Any]
) -> list[str]:
    """A 409 for a spec that changes what an active rollout of ``app`` works on; else those of
    its fields the spec changes that a rollout works on (the store checks them again under the
    app's lock, as a rollout's start records it)."""

    def models(spec: dict[str, Any]) -> list[Any]:  # their artifacts aside: checked below
        return [
            {k: v for k, v in m.items() if k != "artifact"} if isinstance(m, dict) else m
            for m in spec.get("models") or ()
        ]

    moved = [
        field
        for field in _ROLLOUT_FIELDS
        if (models(old) != models(new) if field == "models" else old.get(field) != new.get(field))
    ]
    rollout = services.store.current_rollout(app)
    if rollout is None or not rollout.active:
        return moved
    if moved:
        raise ApiError(
            409,
            "conflict",
            spec_held_by_rollout(app, rollout.id, rollout.model, rollout.state, ", ".join(moved)),
        )
    return moved


def changed_artifacts(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The models of both stored spec documents (pinned: ``NAME@VERSION``) whose registered
    artifact differs, each as ``model M (A -> B)``: what an app's running workers have loaded
    and would go on serving under the new spec."""
    before = {m["name"]: m.get("artifact") for m in old.get("models") or ()}
    return [
        f"model {m['name']!r} ({before[m['name']] or 'no artifact'} ->"
        f" {m.get('artifact') or 'no artifact'})"
        for m in new.get("models") or ()
        if m["name"] in before and before[m["name"]] != m.get("artifact")
    ]


@router.delete(
    "/apps/{app}",
    status_code=204,
    summary="Delete an app and its history (admin); refused while it has live instances,"
    " unless drain=true (drain them, then delete: 202) or force=true",
    responses={
        202: {
            "model": TeardownOut,
            "description": "drain=true and the app has live instances: the reconciler drains"
            " them at once and deletes the app when none is left",
        },
        **errors(401, 403, 404, 409, 422),
    },
)
def delete_app(
    app: AppName,
    services: ServicesDep,
    who: Admin,
    force: Annotated[
        bool,
        Query(description="delete even with live instances (their rows only; they run on)"),
    ] = False,
    drain: Annotated[
        bool,
        Query(
            description="take the app down: drain its live instances, then delete it (202"
            " while they drain; 204 when it had none)"
        ),
    ] = False,
) -> Response:
    if force and drain:
        raise ApiError(
            422,
            "invalid_request",
            "drain and force: choose one (drain stops the instances, then deletes the app;"
            " force deletes the app's rows and leaves its instances running)",
            "drain",
        )
    if not drain:
        services.store.delete_app(app, force=force)
        return Response(status_code=204)
    teardown = request_teardown(services.store, app, who.name)
    if teardown.deleted:
        return Response(status_code=204)
    body = TeardownOut(
        app=app,
        instances=[instance_out(i) for i in teardown.live],
        message=teardown.describe(),
    )
    return JSONResponse(status_code=202, content=body.model_dump(mode="json"))


class ProfileRunIn(BaseModel):
    """What a profile run measures (every field optional)."""

    model_config = ConfigDict(extra="forbid")

    types: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="instance types (default: every candidate type)"
    )
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]] = Field(
        default=list(DEFAULT_BATCH_SIZES), min_length=1, max_length=32
    )
    samples: int = Field(default=DEFAULT_SAMPLES, ge=1, le=1000)
    warmup: int = Field(default=DEFAULT_WARMUP, ge=0, le=100)


@router.post(
    "/apps/{app}/profiles",
    summary="Measure the latency profiles of the app's registered models (operator): one worker"
    " per type, within the app's budget; blocks for minutes",
    responses=errors(400, 401, 403, 404, 409, 422, 502, 503),
)
async def run_profiles(
    app: AppName,
    services: ServicesDep,
    who: Operator,
    body: Annotated[ProfileRunIn | None, Body(description="what to measure")] = None,
    check: Annotated[
        bool,
        Query(
            description="only check the request (the types, the batches' size, the budget next"
            " to the fleet) and answer what the run would measure and cost; nothing starts"
        ),
    ] = False,
) -> dict[str, Any]:
    if services.provisioner is None:
        raise ApiError(503, "no_provisioner", "this service runs no provisioner to profile with")
    given = body if body is not None else ProfileRunIn()
    request = ProfileRunRequest(
        types=tuple(given.types) if given.types is not None else None,
        batch_sizes=tuple(sorted(given.batch_sizes)),  # a size twice: refused below
        samples=given.samples,
        warmup=given.warmup,
    )
    if check:
        try:
            checked = await asyncio.to_thread(
                check_profile_run,
                services.store,
                services.resolver,
                services.provisioner,
                app,
                request,
                max_batch_bytes=services.settings.oip_body_max_bytes,
                clock=services.clock,
                heartbeat_s=services.settings.profile_run_heartbeat_s,
            )
        except ProfilingError as error:
            raise ApiError(502, "profiling_failed", str(error)) from None
        return checked.to_json()
    try:
        result = await asyncio.to_thread(
            run_profile,
            services.store,
            services.resolver,
            services.provisioner,
            services.clock,
            app,
            request,
            who=who.name,
            worker_port=DEFAULT_WORKER_PORT,
            heartbeat_s=services.settings.profile_run_heartbeat_s,
            max_batch_bytes=services.settings.oip_body_max_bytes,
        )
    except ProfilingError as error:
        raise ApiError(502, "profiling_failed", str(error)) from None
    return result.to_json()


@router.get(
    "/apps/{app}/profiles",
    summary="The latency profiles measured for the app (viewer): a profile JSON document",
    responses=errors(401, 403, 404, 422),
)
def get_profiles(app: AppName, services: ServicesDep, _who: Viewer) -> dict[str, Any]:
    services.store.get_app(app)
    document = services.store.get_app_profiles(app)
    if document is None:
        raise NotFoundError("profiles of app", app)
    return document
