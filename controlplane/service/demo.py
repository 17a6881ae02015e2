"""The demo app on a running service: the demo model family's cascade, its spec, and making sure it
is registered, planned and reachable with a token, whatever state a previous run left
(``heteroplane demo``); and the demo load that makes the fleet and the dashboard move.

The demo app ``demo`` is a cascade of the demo model family (``provisioners.worker.family``: four
classifiers of sklearn's digits) served by local worker processes of the emulated types
``emu.cpu.small`` and ``emu.cpu.large``, which pad each batch to the compute of a real model of
the family's sizes (``provisioners.worker.emulation.EMULATED_COMPUTE``: tens of ms a batch;
docs/catalog.md, "Emulated types"):

1. the family is trained into the data directory's model cache (``<data_dir>/models``, where the
   local provisioner's workers load it) unless it is there already;
2. its latency profiles are measured once on this machine through the serving path
   (``controlplane.apps.profiler.measure_serving_path``: a worker of the reference type
   ``local.cpu`` and of each demo type, batches of :data:`PROFILE_BATCH_SIZES` sent to them over
   HTTP) into ``<data_dir>/profiles/family.json``, with the compute curves the workers pad to;
   they are measured again only when that file is missing, was measured another way (compute
   only, or by an older version), pads to other curves, or does not cover the family on those
   types and batch sizes;
3. each model of the family is exported to TorchScript and pushed to the model registry as a
   user would push a model (:func:`ensure_demo_artifacts`; a version holding the same bytes is
   reused), and the spec names each model's registry version (``artifact: tiny@1``): the
   workers load the family from the registry, through the same path as any user's models
   (docs/models.md);
4. the cascade is the cheapest of the Pareto set (``estimator.cascades.pareto_cascades``, on
   the *choose* half of the validation records and each model's cost per query, its end-to-end
   latency at batch size 1 on :data:`COST_TYPE`) within
   :data:`~controlplane.policies.cascade_choice.ACCURACY_TOLERANCE` of the most accurate model
   alone, as ``heteroplane cascade evaluate`` picks it; its accuracy is the held-out one, on the
   other half (:func:`~controlplane.policies.cascade_choice.choose_held_out`);
5. the spec (:func:`demo_spec`) names those models, the cascade with its thresholds, the
   validation records, a :data:`DEMO_SLO_MS` p99 SLO, a :data:`DEMO_BUDGET_USD_PER_HR` budget and
   the two emulated types (capped by :data:`DEMO_MAX_COUNTS`, so that the local machine runs at
   most eight workers); it is registered, a plan is previewed for :data:`DEMO_RATE_QPS` (the demo
   load's mean) and applied, and the reconciler launches the plan's workers. The live tuner then
   grows the fleet as the demo load rises above the planned rate and drains it as the load falls.

Each step is idempotent, so the demo can be started any number of times on the same data
directory: the app is registered only when it is not there (an app that is there is left as it
is, budget changes and what rollouts changed included; only a ``demo`` app of another shape,
the rm2 demo of earlier versions or a cascade demo whose spec differs from :func:`demo_spec` in
more than its budget, its artifacts' versions, validation records and thresholds, is replaced by
the current one and planned again; a demo app being taken down is refused, nothing changed, with
the way to finish it), a first plan is previewed and applied only
when the app has no applied plan or its profiles were measured anew (a plan made on other numbers
would predict fiction), and an admin token is made only when the token file
(``<data_dir>/demo-token``, mode 0600) is missing or holds a token that no longer verifies as an
admin. Registering and planning run the same code as ``POST /v1/apps``, ``POST
/v1/apps/demo/plans`` and ``POST .../apply`` do, on the service's own resolver and store, before
the API is served: once the service answers, the demo app is there.

``heteroplane demo --down`` (:func:`stop_demo`) takes the demo app down the way ``heteroplane app
down`` does (:mod:`controlplane.apps.teardown`), on the same database, running the reconciler
itself until the app is gone and its provisioner runs no worker of it: the workers that a stopped
demo leaves running (they run in sessions of their own) stop, and the next ``heteroplane demo``
registers and plans the app again.

The demo load (:class:`DemoLoad`) is ``controlplane.clients.loadgen`` in a background thread against
the service itself: Poisson arrivals whose rate follows a day-like curve compressed into
:data:`LOAD_PERIOD_S` (from a fifth of :data:`LOAD_MEAN_QPS` up to 1.8 times it), one period
after another, each query a validation sample drawn at random; after each period it prints one
line with what it sent and what came back, and how many of its queries were answered within the
SLO.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from numpy.typing import NDArray

from controlplane.api.deps import Services
from controlplane.apps import plans, profiler
from controlplane.apps.plans import PlanRequest, TraceRequest
from controlplane.apps.resolver import spec_document
from controlplane.apps.teardown import request_teardown, teardown_requested
from controlplane.clients import loadgen
from controlplane.db.store import AppRecord, PlanRecord, Principal, Store
from controlplane.errors import AppExistsError, ConflictError, NotFoundError
from controlplane.policies.auth import Scope
from controlplane.policies.cascade_choice import choose_held_out
from controlplane.provisioning import LOCAL_MODELS_DIR, LOCAL_PROFILE_FILE
from controlplane.registry import Registry
from controlplane.service.build import Service
from estimator.cascades import Cascade, ValidationRecords, load_validation
from estimator.catalog import default_catalog
from estimator.errors import EstimatorError
from estimator.numbers import plain
from estimator.profiles import load_profiles, write_profiles_json
from estimator.traces import Trace, diurnal_profile, renewal_arrivals
from provisioners.artifacts import file_sha256
from provisioners.base import APP_TAG, MANAGED_TAG
from provisioners.worker.emulation import compute_document

__all__ = [
    "COST_TYPE",
    "DEMO_APP",
    "DEMO_BUDGET_USD_PER_HR",
    "DEMO_INSTANCE_TYPES",
    "DEMO_MAX_COUNTS",
    "DEMO_RATE_QPS",
    "DEMO_SLO_MS",
    "LOAD_MEAN_QPS",
    "LOAD_PERIOD_S",
    "PROFILES_FILE",
    "PROFILE_BATCH_SIZES",
    "PROFILE_SAMPLES",
    "TOKEN_FILE",
    "TOKEN_NAME",
    "DemoDown",
    "DemoFamily",
    "DemoLoad",
    "DemoState",
    "DemoToken",
    "choose_cascade",
    "demo_spec",
    "ensure_demo_app",
    "ensure_demo_artifacts",
    "ensure_demo_plan",
    "ensure_demo_profiles",
    "ensure_demo_token",
    "load_trace",
    "prepare_demo",
    "prepare_family",
    "stop_demo",
]

DEMO_APP = "demo"
# The rate the first plan is made for: the demo load's mean (LOAD_MEAN_QPS). Above it the tuner
# grows the fleet, below it the tuner drains it.
DEMO_RATE_QPS = 12.0
# A cascade of three stages of tens of ms each (the planner gives each stage a third), with room
# for the service's own path (the API, the dispatcher: ~10 ms at p50 on a 2-core machine).
DEMO_SLO_MS = 300.0
DEMO_BUDGET_USD_PER_HR = 0.5
# The emulated types the local provisioner runs (docs/catalog.md, "Emulated types"): a small
# one at half the speed of the reference for $0.05/hr and one as fast for $0.10/hr.
DEMO_INSTANCE_TYPES = ("emu.cpu.small", "emu.cpu.large")
# Each worker is a process holding torch and the family (about 300 MiB): at most eight at once,
# which is also what the budget buys at the load's peak (6 x $0.05 + 2 x $0.10).
DEMO_MAX_COUNTS = {"emu.cpu.small": 6, "emu.cpu.large": 2}
# The type whose end-to-end latency at batch size 1 costs the cascade's models (speed factor 1).
COST_TYPE = "emu.cpu.large"
# The batch sizes the demo's profiles cover: an emulated CPU type gains little from batching
# (C_m(b) grows with every row), so the planner's batches stay small, and a batch of 8 of the
# large model already takes about half a second on emu.cpu.small.
PROFILE_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8)
# Timed calls per model, type and batch size when the demo measures its profiles (the emulated
# types compute in real time: about a minute and a half on a 2-core machine).
PROFILE_SAMPLES = 20
PROFILE_WARMUP = 3
# Where the local workers find the profiles they pad to (controlplane.provisioning).
PROFILES_FILE = LOCAL_PROFILE_FILE
TOKEN_FILE = "demo-token"
TOKEN_NAME = "demo-admin"
# The demo load: Poisson arrivals at a day-like rate squeezed into a few minutes, repeated; a
# period long enough for the tuner to scale up to the peak and back down (its windows look back
# 60 s, and it waits 15 s after a change before it scales down).
LOAD_MEAN_QPS = 12.0
LOAD_PERIOD_S = 240.0
LOAD_AMPLITUDE = 0.8
_LOAD_TIMEOUT_S = 10.0
_LOAD_PROBE_S = 1.0

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoFamily:
    """What the demo app is made of: the family's model cache and validation records, the
    measured profiles (``profiles_measured``: measured by this run), and the cascade chosen from
    them with its held-out accuracy (:func:`choose_cascade`) and its cost per query (ms, end to
    end on :data:`COST_TYPE`)."""

    cache_dir: Path
    validation: Path
    profiles: Path
    cascade: Cascade
    accuracy: float
    compute_ms_per_query: float
    profiles_measured: bool = False
    # Each model's registry reference (``tiny@1``): the demo serves the family from the model
    # registry, as a user's models are served (:func:`ensure_demo_artifacts`); empty until then.
    artifacts: Mapping[str, str] = field(default_factory=dict)


def demo_spec(family: DemoFamily) -> dict[str, Any]:
    """The demo app's spec: the cascade of ``family`` on its measured profiles and validation
    records, a :data:`DEMO_SLO_MS` p99 SLO, a :data:`DEMO_BUDGET_USD_PER_HR` budget and the two
    emulated CPU types capped by :data:`DEMO_MAX_COUNTS`. The one place the demo's app is
    defined."""
    profiles = str(family.profiles.resolve())
    spec: dict[str, Any] = {
        "name": DEMO_APP,
        "models": [
            {"name": name, "profiles": profiles}
            | ({"artifact": family.artifacts[name]} if name in family.artifacts else {})
            for name in family.cascade.models
        ],
    }
    if len(family.cascade.models) > 1:
        spec["cascade"] = list(family.cascade.models)
        spec["thresholds"] = list(family.cascade.thresholds)
        spec["validation"] = str(family.validation.resolve())
    return spec | {
        "slo": {"latency_ms": DEMO_SLO_MS, "percentile": 99},
        "budget_usd_per_hr": DEMO_BUDGET_USD_PER_HR,
        "instance_types": list(DEMO_INSTANCE_TYPES),
        "max_counts": dict(DEMO_MAX_COUNTS),
    }


def ensure_demo_artifacts(
    registry: Registry,
    cache_dir: Path,
    progress: Progress,
    pinned: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Each family model in the model registry, as a user would push it: exported to
    TorchScript (``provisioners.worker.family.export_torchscript``) and pushed as the next
    version of its name unless a version of it holds those very bytes already; its reference
    (``tiny@1``) by model name. Of several versions with those bytes (a user pushed the same
    file again), the one the registered app pins (``pinned``: model -> ``NAME@VERSION``), else
    the first: a start took the newest and so moved the app to it outside a rollout. The demo's
    workers then load the family from the registry like any user's models (docs/models.md)."""
    from provisioners.worker import family

    references: dict[str, str] = {}
    for name in family.MODEL_NAMES:
        path = family.export_torchscript(name, cache_dir)
        digest = file_sha256(path)
        same = [record for record in registry.versions(name) if record.sha256 == digest]
        if same:
            kept = (pinned or {}).get(name)
            record = next((r for r in same if f"{r.name}@{r.version}" == kept), same[0])
        else:
            progress(f"pushing {name} (TorchScript, {path}) to the model registry")
            record = registry.push(name, path, "torchscript")
        references[name] = f"{record.name}@{record.version}"
    return references


def choose_cascade(
    records: ValidationRecords, compute_ms: Mapping[str, float]
) -> tuple[Cascade, float, float]:
    """The cheapest cascade of the Pareto set (accuracy against compute per query, chains of up
    to three models) whose accuracy is within ``ACCURACY_TOLERANCE`` of the most accurate model
    alone, chosen on the *choose* half of ``records`` (the held-out protocol, ``choose_held_out``):
    (cascade, its held-out accuracy on the *score* half, its compute per query in ms)."""
    models = [name for name in records.models if name in compute_ms]
    choice = choose_held_out(records, compute_ms, models=models, max_length=3)
    best = choice.best
    if best is None:  # the most accurate model alone is on the front
        raise AssertionError("the Pareto front lacks the most accurate model")
    return best.cascade, choice.held_out_accuracy(best.cascade), best.compute_ms_per_query


def ensure_demo_profiles(
    data_dir: Path, cache_dir: Path, samples: int, progress: Progress
) -> tuple[Path, bool]:
    """``<data_dir>/profiles/family.json`` and whether it was measured now: measured here through
    the serving path (a worker of ``local.cpu`` and of each demo type, :data:`PROFILE_BATCH_SIZES`,
    ``samples`` timed calls each) when it is missing, was measured another way, pads to other
    compute curves than the workers' (:func:`controlplane.apps.profiler.emulated_compute`), or
    lacks a model of the family on one of those types or batch sizes."""
    from provisioners.worker import family

    path = data_dir / PROFILES_FILE
    catalog = default_catalog()
    types = [catalog[name] for name in (profiler.REFERENCE_TYPE, *DEMO_INSTANCE_TYPES)]
    compute = profiler.emulated_compute(family.MODEL_NAMES)
    stale = _stale_profiles(path, family.MODEL_NAMES, [t.name for t in types], compute)
    if stale is None:
        return path, False
    progress(f"{path} {stale}")
    warmup = min(PROFILE_WARMUP, samples)
    settings = profiler.MeasureSettings(samples=samples, warmup=warmup)
    progress(
        f"measuring the family's latency through a worker of each of"
        f" {', '.join(t.name for t in types)} ({samples} calls per model, type and batch size;"
        " the emulated types compute in real time, a minute or two) into"
        f" {path}"
    )
    profiles = profiler.measure_serving_path(
        family.MODEL_NAMES,
        PROFILE_BATCH_SIZES,
        types,
        settings,
        cache_dir=cache_dir,
        compute=compute,
        progress=progress,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    meta = profiler.profile_meta(settings, types[1:], compute)
    write_profiles_json(profiles, partial, **meta)
    partial.replace(path)
    return path, True


def _stale_profiles(
    path: Path, models: Sequence[str], types: Sequence[str], compute: Mapping[str, Any]
) -> str | None:
    """Why the profile file at ``path`` cannot serve the demo (``None``: it can)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        found = load_profiles(path)
    except FileNotFoundError:
        return "is missing"
    except (OSError, UnicodeError, ValueError, EstimatorError):
        return "is not a readable profile file"
    if not isinstance(document, dict) or document.get("measurement") != "serving_path":
        return "was not measured through the serving path"
    if document.get("compute") != compute_document(compute):
        return "was measured on workers padding to other compute curves"
    for model in models:
        for name in types:
            if (model, name) not in found:
                return f"has no profile of {model} on {name}"
            sizes = set(found.get_profile(model, name).batch_sizes.tolist())
            if not sizes.issuperset(PROFILE_BATCH_SIZES):
                return f"does not cover the batch sizes {list(PROFILE_BATCH_SIZES)}"
    return None


def prepare_family(data_dir: Path, profile_samples: int, progress: Progress) -> DemoFamily:
    """The family trained into ``<data_dir>/models`` (where the local workers load it), its
    profiles measured (:func:`ensure_demo_profiles`) and the demo's cascade chosen, each model
    costed by its end-to-end latency at batch size 1 on :data:`COST_TYPE`."""
    from provisioners.worker import family

    cache_dir = family.ensure_family(data_dir / LOCAL_MODELS_DIR, progress=progress)
    validation = cache_dir / family.VALIDATION_FILE
    profiles, measured_now = ensure_demo_profiles(data_dir, cache_dir, profile_samples, progress)
    measured = load_profiles(profiles)
    cost_ms = {
        name: measured.get_profile(name, COST_TYPE).mean_latency_ms(1)
        for name in family.MODEL_NAMES
    }
    cascade, accuracy, cost = choose_cascade(load_validation(validation), cost_ms)
    return DemoFamily(cache_dir, validation, profiles, cascade, accuracy, cost, measured_now)


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
    family: DemoFamily


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


def _is_cascade_demo(spec: Mapping[str, Any]) -> bool:
    """Whether a registered demo app is the family's cascade on emulated types (and not the rm2
    demo of earlier versions, whose EC2 types the local provisioner cannot run)."""
    from provisioners.worker import family

    models = [m.get("name") for m in spec.get("models", []) if isinstance(m, dict)]
    types = spec.get("instance_types", [])
    return (
        bool(models)
        and all(name in family.MODEL_NAMES for name in models)
        and isinstance(types, list)
        and all(isinstance(t, str) and t.startswith(f"{profiler.EMULATED_FAMILY}.") for t in types)
    )


def ensure_demo_app(
    services: Services, family: DemoFamily, who: Principal, progress: Progress
) -> tuple[AppRecord, bool]:
    """The demo app, registered from :func:`demo_spec` when it is not there yet (checked
    against its catalog and profiles like ``POST /v1/apps``); whether it was registered (or its
    spec replaced) now. A ``demo`` app that is not the family's cascade on emulated types (the
    rm2 demo of earlier versions) has its spec replaced, as ``PUT /v1/apps/demo`` would; so has
    a cascade demo whose spec differs from :func:`demo_spec` in more than what the operator and
    rollouts change (:func:`_demo_shape`: an older version's SLO, types or caps, or another
    cascade), its budget kept."""
    store = services.store
    label = (
        f"the cascade {family.cascade.label} ({family.accuracy * 100:.2f}% accurate held-out,"
        f" {family.compute_ms_per_query:.1f} ms per query end to end on {COST_TYPE})"
    )
    try:
        found = store.get_app(DEMO_APP)
    except NotFoundError:
        found = None
    resolved = services.resolver.check(demo_spec(family), confine=False)
    document = spec_document(resolved.spec)
    if found is not None and _is_cascade_demo(found.spec):
        if _demo_shape(found.spec) == _demo_shape(document):
            return found, False
        progress(
            f"the app {DEMO_APP!r} is a demo of another shape: replacing its spec by {label},"
            f" its budget ${plain(found.budget_usd_per_hr)}/hr kept"
        )
        kept = document | {"budget_usd_per_hr": found.budget_usd_per_hr}
        return store.update_app(DEMO_APP, kept, who=who.name), True
    if found is not None:
        progress(f"the app {DEMO_APP!r} is an older demo: replacing its spec by {label}")
        return store.update_app(DEMO_APP, document, who=who.name), True
    progress(f"registering the app {DEMO_APP!r}: {label}")
    try:
        return store.create_app(document, who=who.name), True
    except AppExistsError:  # another demo on the same database registered it meanwhile
        return store.get_app(DEMO_APP), False


def _demo_shape(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec less what the operator and rollouts change on a running demo: its budget, the
    versions of the models' artifacts (not whether a model has one), the validation records and
    the thresholds (a promoted rollout pins the new version and writes its own records and
    thresholds)."""
    kept = {
        key: value
        for key, value in spec.items()
        if key not in ("budget_usd_per_hr", "validation", "thresholds")
    }
    models = spec.get("models")
    if isinstance(models, list):
        kept["models"] = [
            {
                **m,
                "artifact": str(m["artifact"]).partition("@")[0],
            }
            if isinstance(m, dict) and "artifact" in m
            else m
            for m in models
        ]
    return kept


def demo_pins(store: Store) -> dict[str, str]:
    """The artifacts the registered demo app pins, by model (empty without the app)."""
    try:
        spec = store.get_app(DEMO_APP).spec
    except NotFoundError:
        return {}
    return {
        m["name"]: m["artifact"]
        for m in spec.get("models", [])
        if isinstance(m, dict) and isinstance(m.get("artifact"), str)
    }


def _check_startable(store: Store) -> None:
    """Refuse a start on a demo app that is being taken down (``app down`` unfinished) or in
    the middle of a rollout, before anything changes: a start replaced the spec and plan of
    such an app (a tester: the remedy it then gave needed the service it refused to run, and
    the workers ran on unmanaged)."""
    try:
        app = store.get_app(DEMO_APP)
    except NotFoundError:
        return
    if teardown_requested(store, app):
        raise ConflictError(
            f"the app {DEMO_APP!r} is being taken down (heteroplane app down), not finished:"
            " finish it with heteroplane demo --down, then start the demo again"
        )


def ensure_demo_plan(
    services: Services,
    who: Principal,
    rate_qps: float,
    progress: Progress,
    *,
    replan: bool = False,
) -> tuple[PlanRecord | None, bool]:
    """The demo app's applied plan; when it has none (or ``replan``), a plan previewed for a
    Poisson trace at ``rate_qps`` and applied, like ``POST /v1/apps/demo/plans`` and ``POST
    .../apply`` (a ``plan_applied`` decision included). An infeasible plan is kept as a preview
    and not applied: (None, False)."""
    store = services.store
    applied = store.get_applied_plan(DEMO_APP)
    if applied is not None and not replan:
        return applied, False
    progress(
        f"planning {DEMO_APP!r} for {rate_qps:g} qps (Poisson): the planner simulates candidate"
        " fleets for each stage of the cascade, a few seconds"
    )
    request = PlanRequest(trace=TraceRequest(rate_qps=rate_qps))
    preview = plans.preview_plan(services.store, services.resolver, DEMO_APP, request)
    if not preview.plan.feasible:
        progress(
            f"plan {preview.id} is infeasible (no fleet within the budget meets the SLO at"
            f" {rate_qps:g} qps); left as a preview, nothing applied"
        )
        return None, False
    return plans.apply_plan(store, DEMO_APP, preview.id, who.name), True


def prepare_demo(
    service: Service,
    rate_qps: float,
    progress: Progress,
    *,
    family: DemoFamily | None = None,
    profile_samples: int = PROFILE_SAMPLES,
) -> DemoState:
    """Make sure the demo's token, family (models, profiles: :func:`prepare_family` unless
    ``family`` is given), app and applied plan exist on ``service`` (not served yet).

    ``heteroplane demo`` prepares the family before it builds the service, so that the local
    provisioner finds the profiles its workers pad to."""
    services = service.app.state.services
    if not isinstance(services, Services):
        raise TypeError(f"the service's app carries {type(services).__name__}, not Services")
    _check_startable(service.store)
    data_dir = service.settings.data_dir
    token = ensure_demo_token(service.store, data_dir, progress)
    if family is None:
        family = prepare_family(data_dir, profile_samples, progress)
    if services.registry is not None and not family.artifacts:
        family = replace(
            family,
            artifacts=ensure_demo_artifacts(
                services.registry, family.cache_dir, progress, demo_pins(service.store)
            ),
        )
    app, app_created = ensure_demo_app(services, family, token.principal, progress)
    if not app_created:
        progress(f"the app {DEMO_APP!r} is registered already (version {app.version})")
    if family.profiles_measured and not app_created:
        progress(f"the profiles were measured anew: planning {DEMO_APP!r} again on them")
    plan, plan_created = ensure_demo_plan(
        services,
        token.principal,
        rate_qps,
        progress,
        replan=app_created or family.profiles_measured,
    )
    if plan is not None and not plan_created:
        progress(f"plan {plan.id} of {DEMO_APP!r} is applied already")
    # Read again: applying a plan moved the app's version on.
    app = service.store.get_app(DEMO_APP)
    return DemoState(token, app, app_created, plan, plan_created, family)


# --- the demo load -------------------------------------------------------------------------------


def load_trace(
    cycle: int,
    n_samples: int,
    *,
    mean_qps: float = LOAD_MEAN_QPS,
    period_s: float = LOAD_PERIOD_S,
    seed: int = 0,
) -> Trace:
    """One period of the demo load: Poisson arrivals at lambda(t) = mean (1 - 0.8 cos(2 pi t /
    period)) over one period, batch size 1, each query a validation sample drawn uniformly;
    seeded by (``seed``, ``cycle``)."""
    rng = np.random.default_rng((seed, cycle))
    profile = diurnal_profile(mean_qps, period_s, period_s, LOAD_AMPLITUDE)
    arrivals = renewal_arrivals(profile, period_s, 1.0, rng)
    samples = rng.integers(0, n_samples, size=arrivals.size)
    return Trace(arrivals, np.ones(arrivals.size, dtype=np.int64), samples)


class DemoLoad:
    """The demo load (module docstring): :meth:`start` it once the service listens, :meth:`stop`
    it when the service stops. It waits until the app answers a query before it starts, so that
    the first period is not spent on the workers' start."""

    def __init__(
        self,
        base_url: str,
        token: str,
        inputs: NDArray[np.floating],
        progress: Progress,
        *,
        mean_qps: float = LOAD_MEAN_QPS,
        period_s: float = LOAD_PERIOD_S,
        seed: int = 0,
    ) -> None:
        self.url = loadgen.infer_url(base_url, DEMO_APP)
        self.ready_url = f"{base_url.rstrip('/')}/v2/models/{DEMO_APP}/ready"
        self.token = token
        self.inputs = inputs
        self.progress = progress
        self.mean_qps = mean_qps
        self.period_s = period_s
        self.seed = seed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-load", daemon=True)

    def describe(self) -> str:
        low, high = self.mean_qps * (1 - LOAD_AMPLITUDE), self.mean_qps * (1 + LOAD_AMPLITUDE)
        return (
            f"Poisson arrivals from {low:g} to {high:g} qps and back every {self.period_s:g} s,"
            " looping"
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        if not self._wait_until_served():
            return
        self.progress(f"demo load: started, {self.describe()}")
        cycle = 0
        while not self._stop.is_set():
            trace = load_trace(
                cycle,
                len(self.inputs),
                mean_qps=self.mean_qps,
                period_s=self.period_s,
                seed=self.seed,
            )
            result = loadgen.run_load(
                loadgen.build_queries(trace, self.inputs),
                self.url,
                self.token,
                timeout_s=_LOAD_TIMEOUT_S,
                stop=self._stop,
            )
            if result.stopped:
                return
            self.progress(_load_line(result.summary(DEMO_SLO_MS)))
            cycle += 1

    def _wait_until_served(self) -> bool:
        """Ask the app's readiness route once a second until a query would be answered; False
        when stopped first. (It sent a query a second: each one refused counted as a miss of
        the SLO before the newcomer did anything.)"""
        headers = {"Authorization": f"Bearer {self.token}"}
        said = False
        with httpx.Client(timeout=_LOAD_TIMEOUT_S, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    if client.get(self.ready_url, headers=headers).is_success:
                        return True
                except httpx.HTTPError:
                    pass
                if not said:
                    self.progress("demo load: waiting for the demo's workers to answer")
                    said = True
                self._stop.wait(_LOAD_PROBE_S)
        return False


def _load_line(summary: loadgen.LoadSummary) -> str:
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary.errors_by_kind.items())
    latency = (
        "nothing answered"
        if summary.p50_ms is None or summary.p99_ms is None
        else f"p50 {summary.p50_ms:.1f} ms, p99 {summary.p99_ms:.1f} ms"
    )
    attained = "" if summary.attainment is None else f", {summary.attainment:.1%} within SLO"
    return (
        f"demo load: {summary.sent} queries in {summary.duration_s:.0f} s, answered"
        f" {summary.answered}: {latency}{attained}; errors {summary.errors}"
        + (f" ({kinds})" if kinds else "")
    )


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


# --- taking the demo down ----------------------------------------------------------------------

# The provider states of a worker whose process still runs (a failed one has exited).
_RUNNING_STATES = frozenset({"pending", "running", "stopping"})


@dataclass(frozen=True, slots=True)
class DemoDown:
    """What :func:`stop_demo` did: whether the app was there, the workers it stopped, and
    whether everything was gone within the time allowed."""

    app_found: bool
    stopped: int
    done: bool


def _demo_workers(service: Service) -> int:
    """Workers of the demo app the provisioner still runs (pending, running or stopping)."""
    listed = service.provisioner.list({MANAGED_TAG: "true", APP_TAG: DEMO_APP})
    return sum(1 for instance in listed if instance.state in _RUNNING_STATES)


def _app_exists(store: Store) -> bool:
    try:
        store.get_app(DEMO_APP)
    except NotFoundError:
        return False
    return True


def stop_demo(
    service: Service,
    say: Callable[[str], None],
    *,
    wait_s: float = 120.0,
    poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
) -> DemoDown:
    """Take the demo app down on ``service`` (built, not served): mark it for teardown (or
    delete it, when it has no live instance), then run the reconciler every ``poll_s`` until the
    app is gone and the provisioner lists no worker of it (a worker whose app is gone already is
    a stray the reconciler stops too), for at most ``wait_s``; a line through ``say`` each time
    what is left changes."""
    found = _app_exists(service.store)
    if found:
        teardown = request_teardown(service.store, DEMO_APP, who="demo --down")
        say(teardown.describe())
    first = _demo_workers(service)
    if not found:
        say(f"no app {DEMO_APP!r} in the database; {first} worker(s) of it still run")
    deadline_s = time.monotonic() + wait_s
    last = ""
    reconciler = service.reconciler
    assert reconciler is not None  # the demo's service runs everything in one process
    while True:
        reconciler.run_once()
        app_there = _app_exists(service.store)
        workers = _demo_workers(service)
        if not app_there and workers == 0:
            return DemoDown(found, first, True)
        line = f"{workers} worker(s) still running" + (
            "; the app is deleted when none is left" if app_there else ""
        )
        if line != last:
            say(line)
            last = line
        if time.monotonic() >= deadline_s:
            return DemoDown(found, first, False)
        sleep(poll_s)
