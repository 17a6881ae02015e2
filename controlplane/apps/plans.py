"""Use cases of plans: preview a plan for an app on a planning trace, and apply it.

The API (``/v1/apps/{app}/plans``), the demo and the capacity replanner all plan through
:func:`preview_plan` and :func:`apply_plan`, so a plan made by any of them is made the same way.
The app spec carries no trace and no expected rate, so a request says what to plan for: a
generated trace (:class:`TraceRequest`: Poisson, or gamma gaps with ``cv2``; the generators of
``heteroplane trace generate``) or just a rate (a Poisson trace at it). The trace holds
:data:`DEFAULT_TRACE_QUERIES` queries unless ``duration_s`` says otherwise, and the plan keeps the
generator's parameters (``trace.request``), from which the same trace can be made again.

A plan is stored with the app version it was made for; applying it is refused (a conflict) once
the app has changed, another plan was applied, or it was applied already (the store's rule).

>>> TraceRequest.from_document({"rate_qps": 5, "kind": "gamma", "cv2": 4}).cv2
4.0
>>> TraceRequest.from_document({"rate_qps": -1})
Traceback (most recent call last):
...
controlplane.errors.InvalidValueError: trace.rate_qps: must be a finite number > 0, got -1
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from controlplane.apps.resolver import AppResolver, smallest_common_batch_size
from controlplane.apps.teardown import teardown_requested
from controlplane.crashpoints import crash_point
from controlplane.db.store import PlanRecord, Store
from controlplane.db.store.decisions import Words
from controlplane.errors import ConflictError, InvalidValueError, ProfilesNotMeasuredError
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import SpotPricesFn, plan_with_spot
from controlplane.spec import ResolvedApp
from estimator import deadline
from estimator.batches import parse_batch_distribution
from estimator.errors import WorkloadError
from estimator.traces import MAX_CV2, Trace, constant_profile, renewal_arrivals, trace_stats

# Why the service's provider cannot launch an instance type (None: it can).
LaunchRefusalFn = Callable[[str], str | None]

__all__ = [
    "DEFAULT_TRACE_QUERIES",
    "LaunchRefusalFn",
    "PlanRequest",
    "PlanRequestError",
    "TraceRequest",
    "apply_plan",
    "burstiness_replanning_request",
    "launchable_only",
    "planning_trace",
    "preview_plan",
    "provider_prices",
    "rate_request",
    "replanning_request",
    "require_profiles",
]


class PlanRequestError(InvalidValueError):
    """A request no planning trace can be made of (no rate, batch sizes that cannot be drawn):
    the caller's to fix, unlike a value the store refuses."""


# A planning trace of 5,000 queries resolves a P99 by 50 queries above it and plans in seconds.
DEFAULT_TRACE_QUERIES = 5_000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """A synthetic planning trace: a renewal process at a constant rate (Poisson, or gamma gaps
    with ``cv2``), with batch sizes from ``batch_dist`` (``heteroplane trace generate``'s
    syntax; ``None``: fixed at the smallest batch size every profile of the app has)."""

    rate_qps: float
    kind: Literal["poisson", "gamma"] = "poisson"
    cv2: float = 1.0
    duration_s: float | None = None
    batch_dist: str | None = None
    seed: int = 0

    def to_document(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> TraceRequest:
        """The request a plan stored (``trace.request``), checked again.

        Raises:
            InvalidValueError: a field of the wrong kind or out of range.
        """
        kind = document.get("kind", "poisson")
        if kind not in ("poisson", "gamma"):
            raise InvalidValueError("trace.kind", f"must be poisson or gamma, got {kind!r}")
        duration = document.get("duration_s")
        batch_dist = document.get("batch_dist")
        if batch_dist is not None and not isinstance(batch_dist, str):
            raise InvalidValueError("trace.batch_dist", f"must be a text, got {batch_dist!r}")
        seed = document.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidValueError("trace.seed", f"must be a whole number >= 0, got {seed!r}")
        return cls(
            rate_qps=_positive(document.get("rate_qps"), "trace.rate_qps"),
            kind="gamma" if kind == "gamma" else "poisson",
            cv2=_positive(document.get("cv2", 1.0), "trace.cv2"),
            duration_s=None if duration is None else _positive(duration, "trace.duration_s"),
            batch_dist=batch_dist,
            seed=seed,
        )


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What to plan for: a generated ``trace``, or just a ``rate_qps`` (a Poisson trace); the
    planner's ``seed``."""

    trace: TraceRequest | None = None
    rate_qps: float | None = None
    seed: int = 0


def replanning_request(document: PlanDocument) -> PlanRequest:
    """What the plan ``document`` was planned on, to plan on it again (the capacity re-planner,
    the live tuner's capacity curve): the trace generator's parameters the API stored with it
    (``trace.request``), else a Poisson trace at its planned rate.

    Raises:
        InvalidValueError: a stored trace request that is not usable.
        ValueError: a plan without a planned rate to plan for again.
    """
    stored = document.trace.get("request") if document.trace is not None else None
    if isinstance(stored, Mapping):
        return PlanRequest(trace=TraceRequest.from_document(stored), seed=document.seed or 0)
    return rate_request(document)


def burstiness_replanning_request(document: PlanDocument) -> PlanRequest:
    """:func:`replanning_request`, but a plan made on recorded traffic (no generator parameters,
    the recorded arrivals' CV^2 in its trace statistics) is planned again on gamma arrivals of
    that CV^2 (at most the trace generator's bound) at its planned rate, not on a Poisson
    stand-in that would read it as smoother than it was. The rollout loop's plan after a
    handover, the capacity re-planner and the live tuner's ladders use it."""
    request = replanning_request(document)
    cv2 = (document.trace or {}).get("cv2")
    if request.trace is not None or not isinstance(cv2, int | float) or not math.isfinite(cv2):
        return request
    if cv2 <= 0 or abs(cv2 - 1.0) < 1e-9:
        return request
    gamma = TraceRequest(
        rate_qps=document.planned_rate_qps,
        kind="gamma",
        cv2=min(float(cv2), MAX_CV2),
        seed=request.seed,
    )
    return PlanRequest(trace=gamma, seed=request.seed)


def rate_request(document: PlanDocument) -> PlanRequest:
    """A Poisson trace at the plan ``document``'s planned rate, with its seed; ValueError for a
    plan without a planned rate to plan for again."""
    rate = document.planned_rate_qps
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError("the plan has no planned rate to plan for again")
    return PlanRequest(rate_qps=rate, seed=document.seed or 0)


def planning_trace(app: ResolvedApp, request: PlanRequest) -> tuple[Trace, dict[str, Any]]:
    """The trace a preview plans on, and its statistics with how it was made (``source`` in
    words; ``request``, the generator's parameters, from which the same trace can be made
    again).

    Raises:
        PlanRequestError: a request without a rate, or batch sizes that cannot be drawn.
        WorkloadError: a trace too short to plan on.
    """
    params = request.trace
    if params is None:
        if request.rate_qps is None:
            raise PlanRequestError(
                "rate_qps",
                "the app spec carries no trace or expected rate; send"
                ' {"rate_qps": R} or {"trace": {"rate_qps": R, ...}}',
            )
        params = TraceRequest(rate_qps=request.rate_qps)
    batch_dist = params.batch_dist or f"fixed:{smallest_common_batch_size(app)}"
    try:
        batches = parse_batch_distribution(batch_dist)
    except WorkloadError as error:
        raise PlanRequestError("trace.batch_dist", str(error)) from None
    duration_s = params.duration_s or DEFAULT_TRACE_QUERIES / params.rate_qps
    rng = np.random.default_rng(params.seed)
    arrival_s = renewal_arrivals(constant_profile(params.rate_qps), duration_s, params.cv2, rng)
    if arrival_s.size < 2:
        raise WorkloadError(
            f"the trace has {arrival_s.size} queries in {duration_s:g} s at {params.rate_qps:g}"
            " qps; raise rate_qps or duration_s"
        )
    try:
        sizes = batches.sample(arrival_s.size, rng)
    except (OverflowError, ValueError) as error:
        # A batch size beyond int64 ("fixed:1e20") overflows inside numpy.
        raise PlanRequestError("trace.batch_dist", f"batch sizes {batch_dist!r}: {error}") from None
    trace = Trace(arrival_s, sizes)
    stats = trace_stats(trace)
    cv2 = f", cv2 {params.cv2:g}" if params.kind == "gamma" else ""
    source = (
        f"{params.kind} at {params.rate_qps:g} qps{cv2} for {duration_s:g} s,"
        f" batch sizes {batches.spec}, seed {params.seed}"
    )
    return trace, {
        "count": stats.count,
        "rate_qps": stats.rate_qps,
        "cv2": stats.cv2,
        "mean_batch_size": stats.mean_batch_size,
        "source": source,
        "request": params.to_document(),
    }


def preview_plan(
    store: Store,
    resolver: AppResolver,
    app: str,
    request: PlanRequest,
    *,
    deadline_s: float | None = None,
    cancelled: threading.Event | None = None,
    spot_prices: SpotPricesFn | None = None,
    launch_refusal: LaunchRefusalFn | None = None,
) -> PlanRecord:
    """Plan ``app`` on the trace ``request`` asks for and store the plan as a preview, within
    ``deadline_s`` (None: unbounded) and until ``cancelled`` is set (``estimator.deadline``).
    ``spot_prices``: the provider's spot prices now, for an app that buys spot
    (:func:`provider_prices`); the catalog's without. ``launch_refusal``: plan only the types
    the provider launches (:func:`launchable_only`; a loop that applies what it plans), where a
    plan previewed by hand names what the spec allows and is refused at :func:`apply_plan`.

    Raises:
        NotFoundError: no such app.
        ProfilesNotMeasuredError: a registered model of the app has no profiles yet.
        ConflictError: the app changed while it was being planned.
        InvalidValueError, EstimatorError: a request or a spec the planner cannot plan for
            (``PlanningDeadlineError`` past the deadline, ``PlanningCancelledError`` once
            cancelled).
    """
    record = store.get_app(app)
    resolved = resolver.resolve(record.spec)
    if launch_refusal is not None:
        resolved = launchable_only(resolved, launch_refusal)
    require_profiles(resolved)
    trace, stats = planning_trace(resolved, request)
    now = provider_prices(resolved, spot_prices)
    with deadline.limit(deadline_s, cancelled):
        plan = plan_with_spot(resolved, trace, plan=plan_app, seed=request.seed, spot_prices=now)
    if store.get_app(app).version != record.version:
        raise ConflictError(f"app {app!r} changed while it was being planned; preview again")
    document = dataclasses.replace(plan, seed=request.seed, trace=stats).to_document()
    return store.create_plan(app, document)


def launchable_only(app: ResolvedApp, launch_refusal: LaunchRefusalFn) -> ResolvedApp:
    """``app`` with each candidate type the provider cannot launch (``launch_refusal`` says why,
    the provisioner's :meth:`~provisioners.base.Provisioner.launch_refusal`) capped at 0
    instances, so what the loops plan and size for it (the tuner, INFaaS's scaler, the
    re-planners, a rollout's plan for its new version) names only types that can run: the
    reconciler launches no fleet naming one (a ``plan_not_launched`` decision, the app unscaled),
    and :func:`apply_plan` refuses such a plan applied by hand. ``app`` as it is when the
    provider launches every type, or none (the reconciler's decision says so then)."""
    refused = [t for t in app.instance_types if launch_refusal(t) is not None]
    if not refused or len(refused) == len(app.instance_types):
        return app
    caps = {**(app.spec.max_counts or {}), **dict.fromkeys(refused, 0)}
    return dataclasses.replace(app, spec=app.spec.model_copy(update={"max_counts": caps}))


def provider_prices(
    app: ResolvedApp, spot_prices: SpotPricesFn | None
) -> Mapping[str, float | None] | None:
    """The provider's spot prices of ``app``'s types now, for an app whose spec buys spot
    (``None``, the catalog's, for one that does not or without a provider that reads them): the
    plan records which it was made at (``spot_prices_source``, docs/spot.md)."""
    if spot_prices is None or app.spec.spot is None or not app.spec.spot.enabled:
        return None
    return spot_prices(app.instance_types)


def require_profiles(app: ResolvedApp) -> None:
    """Refuse to plan an app whose registered model has no latency profiles yet (measured by
    ``heteroplane profile run``).

    Raises:
        ProfilesNotMeasuredError: naming the first such model (in spec order).
    """
    for model in app.spec.model_names:
        lacking = app.unprofiled.get(model)
        if lacking:
            on = () if len(lacking) == len(app.instance_types) else lacking
            budget = app.spec.budget_usd_per_hr
            # A type dearer than the whole budget is never bought, and profile run cannot pay
            # for its worker either: the way out is the spec, not another profile run.
            dear = tuple(t for t in lacking if app.prices_usd_per_hr[t] > budget)
            raise ProfilesNotMeasuredError(app.spec.name, model, on, dear, budget)


def apply_plan(
    store: Store,
    app: str,
    plan_id: int,
    who: str,
    launch_refusal: LaunchRefusalFn | None = None,
    said: Callable[[PlanRecord], Words] | None = None,
) -> PlanRecord:
    """Apply a previewed plan and record a ``plan_applied`` decision with its fleet and cost
    (and the decisions ``said`` of the plan applied: a re-planning loop's why), in the apply's
    transaction: a crash leaves the plan applied and said, or neither.
    ``launch_refusal``: why the service's provider cannot launch a type (None: it can; the
    provisioner's :meth:`~provisioners.base.Provisioner.launch_refusal`), for a plan applied by
    hand: one naming a type it cannot launch is refused (its workers would never start, and
    the app would answer 503 with nothing to say why but a ``plan_not_launched`` decision).

    Raises:
        NotFoundError: no such app or plan.
        ConflictError: the plan is stale, applied already, or another apply won; or it has no
            stages (infeasible at every rate: applying it would drain the whole fleet); or the
            app is being taken down; or it names a type the provider cannot launch.
    """
    planned = store.get_plan(app, plan_id).plan
    if not planned.stages:
        raise ConflictError(
            f"plan {plan_id} of app {app!r} has no stages (no rate can be served within the"
            " budget and the SLO: it would drain every instance); it is not applied. Raise the"
            " budget or loosen the SLO and preview another"
        )
    if launch_refusal is not None:
        for instance_type in sorted(t for t, n in planned.fleet.items() if n > 0):
            why = launch_refusal(instance_type)
            if why is not None:
                raise ConflictError(
                    f"plan {plan_id} of app {app!r} is not applied: it names {instance_type},"
                    f" and {why}; leave it out of the app's instance_types (or cap it with"
                    f" max_counts: {{{instance_type}: 0}}) and preview another"
                )
    if teardown_requested(store, store.get_app(app)):
        raise ConflictError(
            f"app {app!r} is being taken down (heteroplane app down): plan {plan_id} is not"
            " applied to it; set its budget again (heteroplane budget set) to call the teardown"
            " off, then apply"
        )

    def words(applied: PlanRecord) -> Words:
        plan = applied.plan
        return [
            (
                "plan_applied",
                f"plan {applied.id} applied by {who}",
                {
                    "plan_id": applied.id,
                    "cost_usd_per_hr": plan.cost_usd_per_hr,
                    "fleet": plan.fleet,
                },
            ),
            *(said(applied) if said is not None else ()),
        ]

    record = store.apply_plan(app, plan_id, said=words)
    crash_point("plan_apply.after_apply")
    return record


def _positive(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidValueError(field, f"must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise InvalidValueError(field, f"must be a finite number > 0, got {value!r}")
    return float(value)
