"""The demo app on a running service: its spec, and making sure it is registered, planned and
reachable with a token, whatever state a previous run left (``heteroplane demo``).

Each step is idempotent, so the demo can be started any number of times on the same data
directory: the app is registered only when it is not there (an app that is there is left as it
is, budget changes included), a first plan is previewed and applied only when the app has no
applied plan, and an admin token is made only when the token file (``<data_dir>/demo-token``,
mode 0600) is missing or holds a token that no longer verifies as an admin. Registering and
planning run the same code as ``POST /v1/apps``, ``POST /v1/apps/demo/plans`` and ``POST
.../apply`` do, on the service's own resolver and store, before the API is served: once the
service answers, the demo app is there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.api.deps import Services
from controlplane.api.resolver import spec_document
from controlplane.api.routes import plans as plan_routes
from controlplane.api.schemas import PlanIn, TraceIn
from controlplane.auth import Scope
from controlplane.errors import AppExistsError, NotFoundError
from controlplane.service import Service
from controlplane.store import AppRecord, PlanRecord, Principal, Store

__all__ = [
    "DEMO_APP",
    "DEMO_RATE_QPS",
    "TOKEN_FILE",
    "TOKEN_NAME",
    "DemoState",
    "DemoToken",
    "demo_spec",
    "ensure_demo_app",
    "ensure_demo_plan",
    "ensure_demo_token",
    "prepare_demo",
]

DEMO_APP = "demo"
# The rate the first plan is made for: mid-range for rm2 in the Kairos setting, where the best
# $2.5/hr mix serves about 130 qps within 350 ms (docs/kairos-reproduction.md).
DEMO_RATE_QPS = 60.0
# The batch sizes of the planning trace: the Kairos production mix the samples were taken on.
DEMO_BATCH_DIST = "kairos"
TOKEN_FILE = "demo-token"
TOKEN_NAME = "demo-admin"

Progress = Callable[[str], None]


def demo_spec(profiles: Path) -> dict[str, Any]:
    """The demo app's spec: rm2 on the Kairos authors' samples (``profiles``), the paper's four
    instance types, a 350 ms p99 SLO and a budget of $10/hr (the Kairos setting, as in
    ``examples/rm2.yaml``). The one place the demo's app is defined."""
    return {
        "name": DEMO_APP,
        "models": [{"name": "rm2", "profiles": str(profiles.resolve())}],
        "slo": {"latency_ms": 350, "percentile": 99},
        "budget_usd_per_hr": 10,
        "instance_types": ["g4dn.xlarge", "c5n.2xlarge", "r5n.large", "t3.xlarge"],
    }


@dataclass(frozen=True, slots=True)
class DemoToken:
    """The demo's admin token: the file it is in, and whose it is."""

    path: Path
    principal: Principal
    created: bool


@dataclass(frozen=True, slots=True)
class DemoState:
    """What :func:`prepare_demo` found or made."""

    token: DemoToken
    app: AppRecord
    app_created: bool
    plan: PlanRecord | None  # None: the planner found no feasible plan (nothing applied)
    plan_created: bool


def ensure_demo_token(store: Store, data_dir: Path, progress: Progress) -> DemoToken:
    """The admin token in ``<data_dir>/demo-token`` when it still verifies as an admin; else a
    new one named ``demo-admin`` (``demo-admin-2``, ... when that name is taken), written there
    with mode 0600. A demo token whose file was lost or replaced is revoked: nobody can use it
    through the demo any more, and an admin token should not linger unaccounted for."""
    path = data_dir / TOKEN_FILE
    found = _read_token(path)
    if found is not None:
        principal = store.verify_token(found)
        if principal is not None and principal.scope == Scope.ADMIN.value:
            return DemoToken(path, principal, created=False)
    taken = {record.name: record for record in store.list_tokens()}
    for name, record in taken.items():
        if _is_demo_token_name(name) and record.revoked_at is None:
            store.revoke_token(name)
            progress(f"revoked the demo's old token {name!r} (its file was missing or changed)")
    name = TOKEN_NAME
    number = 1
    while name in taken:
        number += 1
        name = f"{TOKEN_NAME}-{number}"
    token, record = store.issue_token(Scope.ADMIN.value, name)
    _write_private(path, token + "\n")
    progress(f"made an admin token {record.name!r}, written to {path}")
    return DemoToken(path, Principal(record.name, record.scope), created=True)


def ensure_demo_app(
    services: Services, profiles: Path, who: Principal, progress: Progress
) -> tuple[AppRecord, bool]:
    """The demo app, registered from :func:`demo_spec` when it is not there yet (checked
    against its catalog and profiles like ``POST /v1/apps``); whether it was registered now."""
    store = services.store
    try:
        return store.get_app(DEMO_APP), False
    except NotFoundError:
        pass
    progress(f"registering the app {DEMO_APP!r}: rm2 on {profiles} (reading the samples)")
    resolved = services.resolver.check(demo_spec(profiles))
    try:
        return store.create_app(spec_document(resolved.spec), who=who.name), True
    except AppExistsError:  # another demo on the same database registered it meanwhile
        return store.get_app(DEMO_APP), False


def ensure_demo_plan(
    services: Services, who: Principal, rate_qps: float, progress: Progress
) -> tuple[PlanRecord | None, bool]:
    """The demo app's applied plan; when it has none, a plan previewed for a Poisson trace at
    ``rate_qps`` with the Kairos batch mix and applied, like ``POST /v1/apps/demo/plans`` and
    ``POST .../apply`` (a ``plan_applied`` decision included). An infeasible plan is kept as a
    preview and not applied: (None, False)."""
    store = services.store
    applied = store.get_applied_plan(DEMO_APP)
    if applied is not None:
        return applied, False
    progress(
        f"planning {DEMO_APP!r} for {rate_qps:g} qps (Poisson, Kairos batch mix): the planner"
        " simulates candidate fleets, a few seconds"
    )
    request = PlanIn(trace=TraceIn(rate_qps=rate_qps, batch_dist=DEMO_BATCH_DIST))
    preview = plan_routes.preview_plan(DEMO_APP, services, who, request)
    if not preview.feasible:
        progress(
            f"plan {preview.id} is infeasible (no fleet within the budget meets the SLO at"
            f" {rate_qps:g} qps); left as a preview, nothing applied"
        )
        return None, False
    plan_routes.apply_plan(DEMO_APP, preview.id, services, who)
    return store.get_plan(DEMO_APP, preview.id), True


def prepare_demo(
    service: Service, profiles: Path, rate_qps: float, progress: Progress
) -> DemoState:
    """Make sure the demo's token, app and applied plan exist on ``service`` (not served yet)."""
    services = service.app.state.services
    if not isinstance(services, Services):
        raise TypeError(f"the service's app carries {type(services).__name__}, not Services")
    token = ensure_demo_token(service.store, service.settings.data_dir, progress)
    app, app_created = ensure_demo_app(services, profiles, token.principal, progress)
    if not app_created:
        progress(f"the app {DEMO_APP!r} is registered already (version {app.version})")
    plan, plan_created = ensure_demo_plan(services, token.principal, rate_qps, progress)
    if plan is not None and not plan_created:
        progress(f"plan {plan.number} of {DEMO_APP!r} is applied already")
    # Read again: applying a plan moved the app's version on.
    app = service.store.get_app(DEMO_APP)
    return DemoState(token, app, app_created, plan, plan_created)


def _is_demo_token_name(name: str) -> bool:
    return name == TOKEN_NAME or (
        name.startswith(TOKEN_NAME + "-") and name[len(TOKEN_NAME) + 1 :].isdigit()
    )


def _read_token(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError):
        return None
    return text or None


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (mode 0600), atomically."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        # The file may have been there with a wider mode: O_CREAT's mode applies only to new ones.
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            descriptor = -1
            file.write(text)
    finally:
        if descriptor != -1:
            os.close(descriptor)
    partial.replace(path)
