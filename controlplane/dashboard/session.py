"""The dashboard's sign-in cookie: what it holds, how long it lasts, when it is ``Secure``.

A sign-in is a server-side session (the ``dashboard_sessions`` table, through
:meth:`~controlplane.db.store.Store.open_dashboard_session`): the cookie holds a random session
id (``hs_`` and 256 random bits), never the API token; the database holds only the id's SHA-256,
the token it was opened with and when it ends. So a sign-in is

- **revocable**: signing out deletes the row, revoking the token ends every session opened with
  it (the store checks the token at each request), deleting the token deletes them (``ON DELETE
  CASCADE``);
- **expiring**: a session ends ``session_lifetime_s`` after sign-in, whatever the browser does
  with the cookie's ``Max-Age``;
- **shared**: every replica of the API on the same database accepts it;
- **harmless when copied out of the browser**: the id opens the dashboard's pages and data only,
  never a ``/v1`` route, and never outlives its session.

The cookie is ``HttpOnly``, ``SameSite=Strict``, on path ``/dashboard``, and ``Secure`` when the
request came over HTTPS (``request.url.scheme``: uvicorn takes ``X-Forwarded-Proto`` from the
proxies ``FORWARDED_ALLOW_IPS`` names) or when ``HETEROPLANE_DASHBOARD_SECURE_COOKIE`` says TLS
ends in front of the service (the terraform module sets both behind its load balancer).
"""

from __future__ import annotations

import re

from fastapi import Request, Response
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.errors import SettingsError, shown

__all__ = [
    "COOKIE_NAME",
    "COOKIE_PATH",
    "DEFAULT_SESSION_LIFETIME_S",
    "SessionSettings",
    "forget_cookie",
    "load_session_settings",
    "set_cookie",
]

COOKIE_NAME = "heteroplane_dashboard"
COOKIE_PATH = "/dashboard"
# A working day: long enough not to ask again, short enough that a forgotten browser forgets.
DEFAULT_SESSION_LIFETIME_S = 8 * 3600.0
# At most a week: a longer sign-in is a token in all but name.
_MAX_SESSION_LIFETIME_S = 7 * 24 * 3600.0


class SessionSettings(BaseSettings):
    """The dashboard's sign-in settings, from ``HETEROPLANE_DASHBOARD_*`` environment
    variables (the service's own settings hold none of the dashboard's)."""

    model_config = SettingsConfigDict(
        env_prefix="HETEROPLANE_DASHBOARD_", extra="ignore", frozen=True
    )

    secure_cookie: bool = Field(
        default=False,
        description="send the cookie Secure on every request: TLS ends in front of the service",
    )
    # At least a second: the cookie's Max-Age is whole seconds, and a lifetime under one gave
    # Max-Age=0, a cookie the browser drops at once (every sign-in "succeeded" to the form).
    session_lifetime_s: float = Field(
        default=DEFAULT_SESSION_LIFETIME_S,
        ge=1,
        le=_MAX_SESSION_LIFETIME_S,
        allow_inf_nan=False,
        description="how long a sign-in lasts, s",
    )

    def secure(self, request: Request) -> bool:
        """Whether the cookie goes ``Secure`` in answer to ``request``."""
        return self.secure_cookie or request.url.scheme == "https"


def load_session_settings() -> SessionSettings:
    """The sign-in settings from the environment; a bad value is a one-line
    :class:`SettingsError` naming its variable (``heteroplane serve`` reads them before it
    starts anything)."""
    try:
        return SessionSettings()
    except ValidationError as error:
        detail = error.errors(include_url=False)[0]
        name = str(detail["loc"][0]) if detail["loc"] else "?"
        message = re.sub(r"^\w+ should ", "must ", str(detail["msg"]).removeprefix("Value error, "))
        env = SessionSettings.model_config.get("env_prefix", "") + name.upper()
        got = shown(detail.get("input"))
        raise SettingsError(f"dashboard.{name}", f"{message}, got {got} ({env})") from None


def set_cookie(
    response: Response, request: Request, session_id: str, settings: SessionSettings
) -> Response:
    """Give the browser the session id (never the token)."""
    response.set_cookie(
        COOKIE_NAME,
        session_id,
        max_age=int(settings.session_lifetime_s),
        path=COOKIE_PATH,
        secure=settings.secure(request),
        httponly=True,
        samesite="strict",
    )
    return response


def forget_cookie(response: Response, request: Request, settings: SessionSettings) -> Response:
    """Tell the browser to drop the cookie."""
    response.delete_cookie(
        COOKIE_NAME,
        path=COOKIE_PATH,
        secure=settings.secure(request),
        httponly=True,
        samesite="strict",
    )
    return response
