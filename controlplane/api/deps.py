"""What a route depends on: the service's parts (:class:`Services`) and who is calling.

Every route but ``/healthz`` requires ``Authorization: Bearer <token>`` (RFC 6750). A missing,
malformed, unknown or revoked token is 401 with ``WWW-Authenticate: Bearer``; a known token
whose scope does not include the one the route needs is 403 (scopes:
``controlplane.policies.auth``). Routes declare their scope with
``Depends(require(Scope.OPERATOR))`` and receive the :class:`~controlplane.db.store.Principal` (its
name is what audit rows record as *who*).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from controlplane.api.counters import RequestCounter
from controlplane.api.errors import ApiError, unauthorized
from controlplane.api.front_door import FrontDoor
from controlplane.api.limits import mark_authenticated
from controlplane.apps.resolver import AppResolver
from controlplane.clock import Clock
from controlplane.db.store import Principal, Store
from controlplane.loops.leadership import Leadership
from controlplane.loops.live_gears import GearTable
from controlplane.loops.scheduler import Scheduler
from controlplane.policies.auth import Scope, scope_allows
from controlplane.registry import Registry
from controlplane.settings import Settings
from provisioners.base import Provisioner

if TYPE_CHECKING:  # the serving loop imports the API's resolver: only a type here
    from controlplane.api.forwarding import Forwarder
    from controlplane.serving.loop import ServingLoop

__all__ = [
    "Internal",
    "Services",
    "check_scope",
    "get_services",
    "require",
    "require_internal",
    "shows_internal_secret",
    "verify_bearer",
]

# auto_error=False: the answer to a missing token is ours (the error body and the challenge),
# not FastAPI's 403. The scheme still documents bearer auth in the OpenAPI document.
_bearer = HTTPBearer(auto_error=False, description="an API token: heteroplane token create")


@dataclass(frozen=True, slots=True)
class Services:
    """The parts of the running service a route may use (one per FastAPI app, on
    ``app.state.services``: no module-level globals)."""

    settings: Settings
    store: Store
    clock: Clock
    resolver: AppResolver
    requests: RequestCounter
    scheduler: Scheduler | None = None
    serving: ServingLoop | None = None
    leadership: Leadership | None = None
    # Called with an app's name after its budget changed (the gear switcher's, so that a lower
    # budget moves a cascade's gear before the reconciler drains).
    budget_changed: Callable[[str], object] | None = None
    # The model registry behind /v1/models (create_app builds the settings' one by default).
    registry: Registry | None = None
    # The service's provisioner: profile runs launch their workers through it (None: refused).
    provisioner: Provisioner | None = None
    # The serving loop's gear hook when the loops run in a process of their own (set through
    # the internal feed route); None when they run here.
    gear_table: GearTable | None = None
    # Where the inference queries of apps another serving process dispatches go (None: one
    # serving process; :mod:`controlplane.api.forwarding`). gRPC's ModelInfer forwards here too.
    forwarder: Forwarder | None = None
    # A loops process running apart: how long its feed from the serving process has failed, s
    # (None while it answers); None where the loops read a serving loop of their own.
    serving_feed_down_s: Callable[[], float | None] | None = None
    # Inference queries refused as the HTTP protocol reads their head, past saturation
    # (controlplane.api.front_door); None: every query goes on to admission.
    front_door: FrontDoor | None = None


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def verify_bearer(store: Store, header: str | None) -> Principal:
    """The principal of a request's ``Authorization`` value ``header`` (None: none was sent),
    ``Bearer <token>`` read as FastAPI's :class:`~fastapi.security.HTTPBearer` reads it; a 401
    :class:`ApiError` (missing, malformed, unknown or revoked token) otherwise. The REST routes
    and the gRPC service (:mod:`controlplane.api.grpc_oip`: the ``authorization`` metadata)
    check tokens here."""
    scheme, token = get_authorization_scheme_param(header)
    if header is None:
        raise unauthorized("an API token is required: Authorization: Bearer <token>")
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("malformed Authorization header: expected Bearer <token>")
    principal = store.verify_token(token)
    if principal is None:
        raise unauthorized("unknown or revoked API token")
    return principal


def check_scope(principal: Principal, scope: Scope) -> None:
    """A 403 :class:`ApiError` unless ``principal``'s scope includes ``scope``."""
    if not scope_allows(principal.scope, scope):
        raise ApiError(
            403,
            "forbidden",
            f"token {principal.name!r} has scope {principal.scope}; this needs {scope.value}",
        )


def require(scope: Scope) -> Callable[..., Principal]:
    """A dependency that admits a bearer token whose scope includes ``scope``."""

    def check(
        request: Request,
        services: ServicesDep,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        # ``credentials`` declares the scheme in the OpenAPI document; the header is read here.
        principal = verify_bearer(services.store, request.headers.get("authorization"))
        mark_authenticated(request.scope)
        check_scope(principal, scope)
        return principal

    check.__name__ = f"require_{scope.value}"
    return check


# The principal of a request that showed the settings' ``internal_token`` (the loops process
# beside a serving process, docs/service.md, "Serving apart from the loops").
INTERNAL_PRINCIPAL = Principal("heteroplane-loops", Scope.ADMIN.value)


def require_internal(
    request: Request,
    services: ServicesDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The internal routes' check: the settings' ``internal_token`` (the secret a serving
    process shares with its loops; compared in constant time), or else an admin token."""
    header = request.headers.get("authorization")
    if shows_internal_secret(services.settings.internal_token, header):
        mark_authenticated(request.scope)
        return INTERNAL_PRINCIPAL
    return require(Scope.ADMIN)(request, services, credentials)


def shows_internal_secret(secret: str | None, header: str | None) -> bool:
    """Whether the ``Authorization`` value ``header`` is ``Bearer <secret>`` (compared in
    constant time; never with no secret set): the internal routes' check and their fast path's
    (:mod:`controlplane.api.fast_internal`).

    >>> shows_internal_secret("s3", "Bearer s3"), shows_internal_secret("s3", "Bearer s4")
    (True, False)
    >>> shows_internal_secret(None, "Bearer "), shows_internal_secret("s3", None)
    (False, False)
    """
    scheme, token = get_authorization_scheme_param(header)
    return bool(
        secret
        and token
        and scheme.lower() == "bearer"
        and hmac.compare_digest(token.encode(), secret.encode())
    )


Viewer = Annotated[Principal, Depends(require(Scope.VIEWER))]
Operator = Annotated[Principal, Depends(require(Scope.OPERATOR))]
Admin = Annotated[Principal, Depends(require(Scope.ADMIN))]
Internal = Annotated[Principal, Depends(require_internal)]
Inferrer = Annotated[Principal, Depends(require(Scope.INFER))]
