"""The dashboard's routes: the page, signing in and out with a token, the data and the assets.

- ``GET /dashboard``: the page; without a valid sign-in, the sign-in form instead (401 with the
  reason when the session has ended, or when the page asks with ``ended=1`` after the data route
  refused it: the browser may have dropped an expired cookie already).
- ``POST /dashboard/login``: the form's token (``application/x-www-form-urlencoded``, field
  ``token``) is checked with the store like a bearer token and must have the viewer scope (an
  operator's or admin's token does; an ``infer`` token does not). On success a server-side
  session is opened and its random id (never the token) kept in a cookie (``HttpOnly``: the
  page's scripts cannot read it; ``SameSite=Strict``: no other site's page can send it;
  ``Secure`` over HTTPS or whenever TLS is on; path ``/dashboard``; 8 hours by default: see
  :mod:`controlplane.dashboard.session`) and the browser is sent to the page (on the ``app``,
  ``window_s`` and ``kind`` of the form's own address); otherwise the form again with what was
  wrong, 401 for an unknown or revoked token, 403 for a token without the
  scope. A sign-in posted from another origin is refused (403).
- ``POST /dashboard/logout``: deletes the session and forgets the cookie (403 when posted from
  another origin).
- ``GET /dashboard/data?app=APP&window_s=S``: one JSON snapshot for every panel
  (:func:`controlplane.dashboard.snapshot.build_snapshot`), for the cookie or for an
  ``Authorization: Bearer`` token (viewer scope); errors are the API's JSON errors (401, 403,
  404, 422).
- ``GET /dashboard/static/NAME``: the page's script and style sheet (no data, no token).

The session is checked on every request (it must exist, not have ended, and its token must not
be revoked): signing out or revoking the token ends the sign-in at once, on every replica of the
API. The ``/v1`` routes never read the cookie:
they keep bearer tokens only, so a page on another site cannot use a signed-in browser against
them. Pages are sent with a content security policy that allows only this origin's script and
style (no inline script), and are never cached.
"""

from __future__ import annotations

import html
import math
import re
import string
import urllib.parse
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from controlplane.api.deps import Services, ServicesDep
from controlplane.api.errors import ApiError, unauthorized
from controlplane.api.routes import APP_NAME_MAX, APP_NAME_PATTERN
from controlplane.apps.resolver import smallest_common_batch_size
from controlplane.dashboard.ranking import RankingCache, bound_ranking
from controlplane.dashboard.session import (
    COOKIE_NAME,
    COOKIE_PATH,
    SessionSettings,
    forget_cookie,
    load_session_settings,
    set_cookie,
)
from controlplane.dashboard.snapshot import (
    DEFAULT_WINDOW_S,
    MAX_WINDOW_S,
    MIN_WINDOW_S,
    RankingFn,
    ServingFn,
    SpendLedger,
    StageRatesFn,
    WorkersFn,
    build_snapshot,
)
from controlplane.db.store import AppRecord, PlanRecord, Principal
from controlplane.errors import ControlPlaneError, NotFoundError
from controlplane.loops.live_tuner import stage_rates_qps
from controlplane.policies.auth import Scope, scope_allows
from controlplane.policies.plan import PlanDocument
from controlplane.serving.observations import AppTotals
from estimator.errors import EstimatorError

__all__ = ["COOKIE_NAME", "DashboardState", "install_dashboard", "router"]

# The longest token the form takes (ours are 46 characters), and the longest session id a
# cookie may hold (ours are 46 too).
_MAX_TOKEN_CHARS = 512
_MAX_SESSION_ID_CHARS = 128

_STATIC = resources.files("controlplane.dashboard") / "static"
_ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # same-origin, not no-referrer: under no-referrer a browser sends "Origin: null" with the
    # sign-in form, and the origin check below could not tell it from a sandboxed foreign page.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/dashboard", include_in_schema=False)


@dataclass
class DashboardState:
    """What the dashboard keeps between requests (per app of FastAPI, on ``app.state``): the
    running spend per app, the bound rankings of plans, and the sign-in settings (the sessions
    themselves are in the database)."""

    ledger: SpendLedger = field(default_factory=SpendLedger)
    rankings: RankingCache = field(default_factory=RankingCache)
    sessions: SessionSettings = field(default_factory=load_session_settings)


def install_dashboard(app: FastAPI, sessions: SessionSettings | None = None) -> None:
    """Mount the dashboard's routes on ``app`` (which carries ``Services``); ``sessions``: the
    sign-in settings (default: from the ``HETEROPLANE_DASHBOARD_*`` environment)."""
    app.state.dashboard = DashboardState(sessions=sessions or load_session_settings())
    app.include_router(router)


def _state(request: Request) -> DashboardState:
    state = getattr(request.app.state, "dashboard", None)
    if not isinstance(state, DashboardState):
        state = DashboardState()
        request.app.state.dashboard = state
    return state


# --- pages -----------------------------------------------------------------------------------


def _asset(name: str) -> str:
    return (_STATIC / name).read_text(encoding="utf-8")


def _page(body: str, status: int = 200) -> Response:
    return Response(body, status, headers=_PAGE_HEADERS, media_type="text/html; charset=utf-8")


_ENDED = "Your sign-in has ended (signed out, expired, or its token revoked): sign in again."
_APP_NAME_PATTERN = f"^{APP_NAME_PATTERN}$"
_APP_NAME = re.compile(_APP_NAME_PATTERN)
_DECISION_KIND = re.compile(r"^[a-z0-9_]{1,32}$")


def _return_query(request: Request) -> str:
    """The page's ``app``, ``window_s`` and ``kind`` from the request's query, for the page to
    open on after signing in (anything else, or a value the page could not use, is dropped)."""
    query = request.query_params
    kept: dict[str, str] = {}
    app = query.get("app", "")
    if len(app) <= APP_NAME_MAX and _APP_NAME.fullmatch(app):
        kept["app"] = app
    try:
        window_s = float(query.get("window_s", ""))
    except ValueError:
        window_s = math.nan
    if MIN_WINDOW_S <= window_s <= MAX_WINDOW_S:
        kept["window_s"] = f"{window_s:g}"
    kind = query.get("kind", "")
    if _DECISION_KIND.fullmatch(kind):
        kept["kind"] = kind
    return urllib.parse.urlencode(kept)


def _lifetime_text(seconds: float) -> str:
    """A session's lifetime in words, in its largest whole unit.

    >>> _lifetime_text(8 * 3600), _lifetime_text(25), _lifetime_text(86400), _lifetime_text(90)
    ('8 hours', '25 seconds', '1 day', '90 seconds')
    """
    whole = round(seconds)
    for unit_s, word in ((86_400, "day"), (3600, "hour"), (60, "minute"), (1, "second")):
        if whole >= unit_s and whole % unit_s == 0:
            count = whole // unit_s
            return f"{count} {word}{'' if count == 1 else 's'}"
    return f"{seconds:g} seconds"


def _login_page(request: Request, message: str | None = None, status: int = 200) -> Response:
    """The sign-in form: ``message`` what went wrong; the session's lifetime as configured; the
    form posts the page's app and window along, to open the page on them."""
    template = string.Template(_asset("login.html"))
    shown = (
        f'<p class="message" id="login-message" role="alert">{html.escape(message)}</p>'
        if message
        else ""
    )
    back = _return_query(request)
    action = f"{COOKIE_PATH}/login" + (f"?{back}" if back else "")
    lifetime = _lifetime_text(_state(request).sessions.session_lifetime_s)
    body = template.substitute(message=shown, action=html.escape(action), lifetime=lifetime)
    return _page(body, status)


def _forget(response: Response, request: Request) -> Response:
    return forget_cookie(response, request, _state(request).sessions)


def _verify(services: Services, token: str) -> Principal | None:
    if not token or len(token) > _MAX_TOKEN_CHARS:
        return None
    return services.store.verify_token(token)


def _signed_in(services: Services, session_id: str) -> Principal | None:
    """Who the browser's session belongs to (None: unknown, ended, or its token revoked)."""
    if not session_id or len(session_id) > _MAX_SESSION_ID_CHARS:
        return None
    return services.store.verify_dashboard_session(session_id)


def _sign_in(services: Services, token: str, lifetime_s: float) -> str | None:
    """A new session for ``token`` (None: the token was revoked a moment ago)."""
    try:
        return services.store.open_dashboard_session(token, lifetime_s=lifetime_s)
    except NotFoundError:
        return None


@router.get("")
async def page(request: Request, services: ServicesDep) -> Response:
    """The dashboard, or the sign-in form when the browser is not signed in."""
    session_id = request.cookies.get(COOKIE_NAME)
    if session_id is None:
        # ``ended``: the page found its sign-in gone (the data route's 401), and the browser may
        # have dropped the cookie at its Max-Age already: say why the form is back.
        if request.query_params.get("ended"):
            return _login_page(request, _ENDED, 401)
        return _login_page(request)
    principal = await run_in_threadpool(_signed_in, services, session_id)
    if principal is None or not scope_allows(principal.scope, Scope.VIEWER):
        return _forget(_login_page(request, _ENDED, 401), request)
    return _page(_asset("dashboard.html"))


def _same_origin(request: Request) -> bool:
    """Whether a form post came from this origin (browsers send ``Origin`` with a POST; a
    client that sends none is not a browser on another site)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host", "")
    return urllib.parse.urlsplit(origin).netloc == host


@router.post("/login")
async def login(request: Request, services: ServicesDep) -> Response:
    """Check the form's token; keep it in a cookie and go to the page, or show the form again."""
    if not _same_origin(request):
        return _login_page(request, "Refused: the sign-in was posted from another site.", 403)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return _login_page(request, "Sign in with the form: paste a token and press Sign in.", 400)
    body = await request.body()
    try:
        fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    except ValueError:  # more fields than the form has
        return _login_page(request, "Sign in with the form: paste a token and press Sign in.", 400)
    token = (fields.get("token") or [""])[0].strip()
    if not token:
        return _login_page(
            request, "Paste an API token (heteroplane token create --scope viewer).", 401
        )
    principal = await run_in_threadpool(_verify, services, token)
    if principal is None:
        return _login_page(request, "That token is not valid: it is unknown or revoked.", 401)
    if not scope_allows(principal.scope, Scope.VIEWER):
        return _login_page(
            request,
            f"Token {principal.name!r} has scope {principal.scope}; the dashboard needs"
            " viewer (or operator, or admin).",
            403,
        )
    settings = _state(request).sessions
    session_id = await run_in_threadpool(_sign_in, services, token, settings.session_lifetime_s)
    if session_id is None:
        return _login_page(request, "That token is not valid: it is unknown or revoked.", 401)
    back = _return_query(request)
    target = COOKIE_PATH + (f"?{back}" if back else "")
    return set_cookie(RedirectResponse(target, status_code=303), request, session_id, settings)


@router.post("/logout")
def logout(request: Request, services: ServicesDep) -> Response:
    """End the sign-in: its session is deleted, the cookie forgotten (a sign-out posted from
    another site is refused, like a sign-in)."""
    if not _same_origin(request):
        return _login_page(request, "Refused: the sign-out was posted from another site.", 403)
    session_id = request.cookies.get(COOKIE_NAME)
    if session_id and len(session_id) <= _MAX_SESSION_ID_CHARS:
        services.store.close_dashboard_session(session_id)
    return _forget(RedirectResponse(COOKIE_PATH, status_code=303), request)


@router.get("/static/{name}")
def static(name: str) -> Response:
    """The page's script and style sheet."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise ApiError(404, "not_found", f"no dashboard asset {name!r}")
    return Response(
        _asset(name),
        media_type=media_type,
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
    )


# --- data ------------------------------------------------------------------------------------


def viewer(request: Request, services: ServicesDep) -> Principal:
    """The caller of the data route: a bearer token when the request has an ``Authorization``
    header, else the sign-in cookie's session; it must have the viewer scope (401 or 403
    otherwise)."""
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            raise unauthorized("malformed Authorization header: expected Bearer <token>")
        principal = _verify(services, credentials.strip())
        if principal is None:
            raise unauthorized("unknown or revoked API token")
    else:
        session_id = request.cookies.get(COOKIE_NAME)
        if session_id is None:
            raise unauthorized("sign in at /dashboard, or send Authorization: Bearer <token>")
        principal = _signed_in(services, session_id)
        if principal is None:
            raise unauthorized(
                "the sign-in has ended (signed out, expired or revoked): sign in again at"
                " /dashboard"
            )
    if not scope_allows(principal.scope, Scope.VIEWER):
        raise ApiError(
            403,
            "forbidden",
            f"token {principal.name!r} has scope {principal.scope}; this needs viewer",
        )
    return principal


def _rates(services: Services) -> StageRatesFn:
    """The tuner's per-instance rates of each stage of a plan (None: the app's profiles cannot
    be read)."""

    def rates(app: AppRecord, plan: PlanDocument) -> list[dict[str, float]] | None:
        try:
            resolved = services.resolver.resolve(app.spec, check_budget=False)
        except (EstimatorError, ControlPlaneError, ValueError):
            return None
        # Every candidate type (the fleet may run one the plan has none of); the plan's types
        # when a candidate has no profile for a stage's model.
        for types in (list(resolved.instance_types), None):
            try:
                return stage_rates_qps(resolved, plan, types)
            except (EstimatorError, ControlPlaneError, ValueError, KeyError):
                continue
        return None

    return rates


def _serving(services: Services) -> ServingFn:
    """The serving loop's totals of an app since the service started (its outcomes by kind:
    answered, refused, timed out, failed); ``None`` without a loop or before it served the app."""

    def serving(app: AppRecord) -> AppTotals | None:
        loop = services.serving
        return None if loop is None else loop.observations.totals().get(app.name)

    return serving


def _workers(services: Services) -> WorkersFn:
    """What the serving loop last measured of each worker of an app: its utilisation and the
    state of each model on it (nothing when the service runs no loop or it serves no such app)."""

    def workers(app: AppRecord) -> dict[str, dict[str, Any]]:
        serving = services.serving
        if serving is None:
            return {}
        status = next((s for s in serving.statuses() if s.app == app.name), None)
        if status is None:
            return {}
        out: dict[str, dict[str, Any]] = {
            w.instance_id: {"utilisation_share": w.utilisation_share, "models": {}}
            for w in status.workers
        }
        for stage in status.stages:
            for instance_id, state in stage.states.items():
                if instance_id in out:
                    out[instance_id]["models"][stage.model] = state
        return out

    return workers


def _ranking(services: Services, state: DashboardState) -> RankingFn:
    def ranking(app: AppRecord, plan: PlanRecord) -> dict[str, Any] | None:
        # The budget the plan was made under: the newest change at or before its preview.
        budget = app.budget_usd_per_hr
        for change in services.store.list_budget_changes(app.name, limit=200):
            if change.at <= plan.created_at:
                budget = change.new_usd_per_hr
        key = (app.id, plan.id, budget)
        found = state.rankings.get(key)
        if found is not None:
            return found
        try:
            resolved = services.resolver.resolve(app.spec, check_budget=False)
            answer = bound_ranking(
                resolved, plan.plan, budget, smallest_common_batch_size(resolved)
            )
        except (EstimatorError, ControlPlaneError, ValueError) as error:
            answer = {"note": f"no bound ranking: {error}", "stages": []}
        state.rankings.put(key, answer)
        return answer

    return ranking


@router.get("/data")
def data(
    request: Request,
    services: ServicesDep,
    who: Annotated[Principal, Depends(viewer)],
    app: Annotated[
        str | None,
        Query(pattern=_APP_NAME_PATTERN, max_length=APP_NAME_MAX),
    ] = None,
    window_s: Annotated[
        float, Query(ge=MIN_WINDOW_S, le=MAX_WINDOW_S, allow_inf_nan=False)
    ] = DEFAULT_WINDOW_S,
) -> JSONResponse:
    """The snapshot of ``app`` (default: the first app by name) for every panel."""
    store = services.store
    names = [record.name for record in store.list_apps()]
    chosen = app if app is not None else (names[0] if names else None)
    body: dict[str, Any] = {"viewer": {"name": who.name, "scope": who.scope}, "apps": names}
    if chosen is None:
        body["snapshot"] = None
    else:
        state = _state(request)
        body["snapshot"] = build_snapshot(
            store,
            store.get_app(chosen),
            services.clock.utcnow(),
            window_s=window_s,
            ledger=state.ledger,
            rates=_rates(services),
            ranking=_ranking(services, state),
            workers=_workers(services),
            serving=_serving(services),
        )
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
