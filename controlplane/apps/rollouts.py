"""What a caller asks of a rollout (docs/rollouts.md): start one, pause, resume or abort it, read
it. The API and the command line call these; :mod:`controlplane.loops.rollouts` moves a rollout
through its steps.

Starting a rollout checks, before anything is recorded:

- the model: ``NAME[@VERSION]`` names a registry model that one of the app's models serves
  (``models[].artifact``); the version (default: the latest) exists, differs from the one the
  app serves, and answers with the same inputs and outputs (the dispatcher talks to both);
- the settings: steps (increasing shares, the last 1), interval, thresholds;
- the budget, as far as it can be known before the new version is measured: the start's
  profile run (one worker of each candidate type, with ``profile_run``) and the extra
  instances of the first step (:func:`~controlplane.policies.rollout.step_fleet`: the applied
  plan's fleet of the model's stage -- every stage's, for a cascade member -- at the step's
  share, at least one instance) must each fit in the app's budget next to everything the app
  already runs; else :class:`~controlplane.errors.RolloutBudgetError` names what it needs.

The start then records the rollout (``pending``) and returns at once. The rollout loop
(:mod:`controlplane.loops.rollouts`) carries on: with ``profile_run``, the new version is timed
on every candidate type of the app as ``profile run`` times it (:func:`profile_and_plan`:
:func:`~controlplane.apps.profile_run.run_profile` with the new version served under the
model's name), and the app is planned again with those profiles, under its own constraints
(``ResolvedApp.constraints``), on the trace its applied plan was planned on; the new plan's
stage fleet is what the rollout's extra instances are sized from, step by step. Without an
applied plan to plan on, the applied plan's stage fleet stays the measure (one instance of the
cheapest candidate type without a plan).

Every move is a ``rollout`` decision of the app with its reason (the events, the dashboard).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from controlplane.apps.budget import live_instances
from controlplane.apps.plans import planning_trace, replanning_request
from controlplane.apps.profile_run import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_SAMPLES,
    ProfileRunRequest,
    run_profile,
)
from controlplane.apps.profiler import DEFAULT_BATCH_SIZES, DEFAULT_WARMUP
from controlplane.apps.resolver import AppResolver
from controlplane.apps.teardown import refuse_torn_down
from controlplane.clock import Clock
from controlplane.crashpoints import crash_point
from controlplane.db.store import RolloutRecord, Store
from controlplane.errors import ConflictError, InvalidValueError, NotFoundError, RolloutBudgetError
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app
from controlplane.policies.rollout import (
    DEFAULT_INTERVAL_S,
    DEFAULT_STEPS,
    RolloutState,
    Thresholds,
    rederive_thresholds,
    step_fleet,
    step_shares,
)
from controlplane.spec import SpecError, parse_artifact
from estimator.cascades import (
    DEFAULT_CHOOSE_SHARE,
    DEFAULT_SPLIT_SEED,
    Cascade,
    evaluate,
    validation_document,
    validation_from_document,
)
from estimator.errors import EstimatorError
from estimator.profiles import ProfileSet
from provisioners.base import Provisioner

__all__ = [
    "DECISION_KIND",
    "WATCH_S",
    "NewVersionProfiling",
    "RolloutRequest",
    "abort_rollout",
    "budget_shortfall",
    "fleet_cost",
    "fleet_text",
    "handing_over",
    "pause_rollout",
    "planned_text",
    "profile_and_plan",
    "resume_rollout",
    "rollout_document",
    "rollout_phase",
    "running_cost",
    "stage_fleet",
    "start_rollout",
]

DECISION_KIND = "rollout"
# How long after its last move a finished rollout is still looked at by the rollout loop (its
# workers ending, a handover going on): longer than the reconciler's reaping of untouched workers.
WATCH_S = 3600.0
# Interval bounds: shorter than a second cannot measure a P99; longer than a day is a mistake.
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 86_400.0
# Prices are floats: a rollout that fits to the cent is not refused for a rounding error.
_BUDGET_SLACK_USD_PER_HR = 1e-9


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """What a caller asks for: ``model`` as ``NAME[@VERSION]``; ``steps`` shares."""

    model: str
    steps: Sequence[float] = DEFAULT_STEPS
    interval_s: float = DEFAULT_INTERVAL_S
    shadow: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)
    # heteroplane.validation/v1 records of a cascade's members with the new version (a
    # cascade member's rollout needs them: its thresholds are re-derived on them).
    validation: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class NewVersionProfiling:
    """How a start times the new version on the app's candidate types before it plans its fleet
    (``profile run``'s settings: the service's provisioner, the port of a worker whose address
    has none, the heartbeat; ``samples`` timed and ``warmup`` untimed calls per batch size)."""

    provisioner: Provisioner
    clock: Clock
    worker_port: int
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    samples: int = DEFAULT_SAMPLES
    warmup: int = DEFAULT_WARMUP


def handing_over(rollout: RolloutRecord, now: datetime) -> bool:
    """Whether ``rollout`` was promoted and its handover still goes on at ``now``: the old
    version's instances still end, the route to the rollout's workers stands, and the rollout
    loop still looks at it (:data:`WATCH_S`). A rollout started meanwhile would split the
    traffic of an app whose fleet is being replaced, and the handover's route and its own would
    be one app's two routes. (Once the route went, a new rollout may start: the plan after the
    handover waits for it to end.)"""
    handover = rollout.figures.get("handover")
    if rollout.state != RolloutState.PROMOTED or not isinstance(handover, Mapping):
        return False
    return "done_at" not in handover and (now - rollout.updated_at).total_seconds() < WATCH_S


def start_rollout(
    store: Store,
    resolver: AppResolver,
    app: str,
    request: RolloutRequest,
    *,
    who: str,
    profile_run: bool = False,
    now: datetime | None = None,
) -> RolloutRecord:
    """Record a rollout of ``request.model`` into ``app`` in ``pending`` and return at once: the
    rollout loop (:mod:`controlplane.loops.rollouts`) profiles the new version and plans its
    fleet (with ``profile_run``), starts its workers, then moves traffic. What can be known up
    front is checked here (module docstring), the budget included: the profile run's workers
    and the first step's extra instances must each fit next to what the app runs. Raises
    NotFoundError (no such app or model version), InvalidValueError (a request that does not fit
    the app), RolloutBudgetError, ConflictError (a rollout of the app is in progress, or a
    promoted one's handover, :func:`handing_over` at ``now``, the clock's time; a model of the
    app without profiles to plan with)."""
    record = store.get_app(app)
    refuse_torn_down(store, record, "no rollout starts in it")
    steps = step_shares(request.steps)
    if not MIN_INTERVAL_S <= request.interval_s <= MAX_INTERVAL_S:
        raise InvalidValueError(
            "interval_s",
            f"must be in [{MIN_INTERVAL_S:g}, {MAX_INTERVAL_S:g}] s, got {request.interval_s:g}",
        )
    try:
        name, version = parse_artifact(request.model)
    except SpecError as error:
        raise InvalidValueError("model", error.problem) from None
    resolved = resolver.resolve(record.spec, check_budget=False)
    served = {
        model: artifact.ref
        for model, artifact in resolved.artifacts.items()
        if artifact.ref.model == name
    }
    if not served:
        names = sorted({a.ref.model for a in resolved.artifacts.values()})
        raise InvalidValueError(
            "model",
            f"app {app!r} serves no registry model {name!r}"
            + (f" (it serves {', '.join(names)})" if names else " (it serves no registry model)"),
        )
    if len(served) > 1:
        raise InvalidValueError(
            "model", f"app {app!r} serves {name!r} as {', '.join(sorted(served))}: ambiguous"
        )
    ((model, current),) = served.items()
    target = store.get_model_version(name, version)
    if target.version == current.version:
        raise InvalidValueError("model", f"app {app!r} already serves {name}@{target.version}")
    old_signature = resolved.artifacts[model].signature
    if target.signature.inputs != old_signature.inputs or (
        target.signature.outputs != old_signature.outputs
    ):
        raise InvalidValueError(
            "model",
            f"{name}@{target.version} takes or answers other tensors than {name}@{current.version}"
            " (a rollout needs the same inputs and outputs)",
        )
    cascade = _cascade_thresholds(resolver, resolved, app, model, name, target.version, request)
    rollouts = store.list_rollouts(app)
    busy = [r for r in rollouts if r.active]
    if busy:
        raise ConflictError(
            f"app {app!r} has rollout {busy[-1].id} in progress; one rollout per app at a time"
            f" (heteroplane rollout status --app {app})"
        )
    handing = [r for r in rollouts if handing_over(r, now or datetime.now(UTC))]
    if handing:
        raise ConflictError(
            f"app {app!r}: rollout {handing[-1].id} was promoted and still hands the app over to"
            f" {handing[-1].artifact}@{handing[-1].to_version} (the old version's instances are"
            " being replaced); one rollout per app at a time: start this one once its handover"
            f" is done (heteroplane rollout status --app {app})"
        )
    shares = (0.0, *steps) if request.shadow else steps
    plan = store.get_applied_plan(app)
    stages = stage_fleet(resolved, model, None if plan is None else plan.plan.stages)
    prices = dict(resolved.prices_usd_per_hr)
    fleet = step_fleet(stages, prices, shares, 0, {})
    if not fleet:
        raise InvalidValueError("model", f"app {app!r} has no priced instance type to run it on")
    cost = fleet_cost(fleet, prices)
    running = running_cost(store, app)
    budget = record.budget_usd_per_hr
    if profile_run:
        unprofiled = {m for m in resolved.unprofiled if m != model}
        if unprofiled and plan is not None:
            raise ConflictError(
                f"app {app!r}: cannot plan the new version: {', '.join(sorted(unprofiled))} has"
                " no profiles yet (heteroplane profile run)"
            )
        workers = dict.fromkeys(resolved.instance_types, 1)
        workers_cost = fleet_cost(workers, prices)
        if running + workers_cost > budget + _BUDGET_SLACK_USD_PER_HR:
            raise RolloutBudgetError(
                app,
                running,
                workers_cost,
                budget,
                f"the start's profile run: one worker of each of {', '.join(workers)}",
            )
    if running + cost > budget + _BUDGET_SLACK_USD_PER_HR:
        raise RolloutBudgetError(
            app, running, cost, budget, f"{fleet_text(fleet)} for its first step"
        )
    settings = {
        "steps": list(shares),
        "interval_s": float(request.interval_s),
        "shadow": bool(request.shadow),
        "thresholds": request.thresholds.to_json(),
        "stage_fleet": stages,
        "extra_fleet": fleet,
        "extra_cost_usd_per_hr": cost,
        "slo_ms": float(resolved.spec.slo.latency_ms),
        "profile_run": bool(profile_run),
    }
    if cascade is not None:
        settings["cascade"] = cascade
    steps_text = ", ".join(f"{100 * s:g}%" for s in shares)
    shadow_text = ", shadow first" if request.shadow else ""
    cascade_text = "" if cascade is None else "; " + _cascade_text(cascade)
    then = (
        f"; first the new version is profiled on {', '.join(resolved.instance_types)} and the"
        " app planned again for it (the rollout loop; heteroplane rollout status)"
        if profile_run
        else ""
    )
    # Said in the start's transaction (a crash leaves both or neither).
    rollout = store.create_rollout(
        app,
        model=model,
        artifact=name,
        from_version=current.version,
        to_version=target.version,
        settings=settings,
        reason=f"started by {who}"
        + ("; profiling the new version first" if profile_run else "; starting its workers"),
        who=who,
        app_spec=record.spec,
        said=lambda started: [
            (
                DECISION_KIND,
                f"rollout {started.id}: {name}@{current.version} -> {name}@{target.version} of"
                f" model {model} started by {who} (steps {steps_text}{shadow_text},"
                f" every {request.interval_s:g} s); extra instances for its first step"
                f" {fleet_text(fleet)} cost {cost:.4g} USD/hr{cascade_text}{then}",
                {"rollout_id": started.id, "state": started.state, **settings},
            )
        ],
    )
    crash_point("rollout.after_start")
    return rollout


def stage_fleet(resolved: Any, model: str, stages: Sequence[Any] | None) -> dict[str, int]:
    """What the new version's fleet is sized from: the fleet of ``model``'s stage of ``stages``
    (every stage's, for a cascade member: the rollout's workers serve the whole cascade with
    the new version in its place), summed by type; empty without stages."""
    chain = tuple(resolved.spec.cascade or ())
    copied = set(chain) if model in chain else {model}
    fleet: dict[str, int] = {}
    for stage in stages or ():
        if stage.name in copied:
            for t, n in stage.fleet.items():
                fleet[t] = fleet.get(t, 0) + int(n)
    return dict(sorted(fleet.items()))


def fleet_cost(fleet: Mapping[str, int], prices_usd_per_hr: Mapping[str, float]) -> float:
    return float(sum(prices_usd_per_hr[t] * n for t, n in fleet.items()))


def running_cost(store: Store, app: str) -> float:
    """What the app's live instances cost (its fleet, profile runs' and rollouts' workers)."""
    return float(sum(i.cost_usd_per_hr for i in live_instances(store, app)))


def budget_shortfall(store: Store, app: str, more_usd_per_hr: float) -> tuple[float, float] | None:
    """None when ``more_usd_per_hr`` of instances fit in the app's budget next to what it
    runs; else (what it runs, its budget), USD/hr."""
    running = running_cost(store, app)
    budget = store.get_app(app).budget_usd_per_hr
    if running + more_usd_per_hr > budget + _BUDGET_SLACK_USD_PER_HR:
        return running, budget
    return None


def _cascade_thresholds(
    resolver: AppResolver,
    resolved: Any,
    app: str,
    model: str,
    artifact: str,
    to_version: int,
    request: RolloutRequest,
) -> dict[str, Any] | None:
    """For a cascade member: its cascade's thresholds re-derived on the validation records
    with the new version (:func:`~controlplane.policies.rollout.rederive_thresholds`), the
    held-out accuracy before and after, and where the records are kept (the spec names them
    once the rollout is promoted); None for a model outside a cascade."""
    spec = resolved.spec
    chain = tuple(spec.cascade or ())
    if model not in chain:
        if request.validation is not None:
            raise InvalidValueError(
                "validation", f"model {model} is in no cascade: there are no thresholds to derive"
            )
        return None
    if request.validation is None:
        raise InvalidValueError(
            "validation",
            f"model {model} is a member of the cascade {' -> '.join(chain)}: its thresholds are"
            " re-derived for the new version on validation records of the members (heteroplane"
            " rollout start ... --validation-data FILE.npz)",
        )
    try:
        records = validation_from_document(request.validation, "validation")
    except EstimatorError as error:
        raise InvalidValueError("validation", str(error)) from None
    except (KeyError, TypeError, ValueError) as error:  # a document of another shape
        raise InvalidValueError(
            "validation", f"not heteroplane.validation/v1 records ({type(error).__name__}: {error})"
        ) from None
    missing = [m for m in chain if m not in records.models]
    if missing:
        raise InvalidValueError(
            "validation", f"no records of {', '.join(missing)} (the cascade's members)"
        )
    floor = spec.slo.accuracy
    choice = rederive_thresholds(records, chain, _compute_ms(resolved, chain), accuracy_floor=floor)
    if floor is not None and choice.held_out_accuracy < floor:
        raise ConflictError(
            f"app {app!r}: with {artifact}@{to_version} the cascade {' -> '.join(chain)} reaches"
            f" {choice.held_out_accuracy:.4f} held-out accuracy at its best thresholds"
            f" {list(choice.thresholds)}, under the floor {floor:g}"
        )
    before = None
    if resolved.validation is not None and spec.thresholds:
        _, score = resolved.validation.split(DEFAULT_CHOOSE_SHARE, DEFAULT_SPLIT_SEED)
        before = float(evaluate(Cascade(chain, tuple(spec.thresholds)), score).accuracy)
    # Named relative to the data directory, as a spec may name its files: the rollout's
    # document and, after promotion, the app's spec show a viewer no path of the server's.
    name = f"rollouts/{app}-{model}-{to_version}-validation.json"
    path = Path(resolver.base_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(validation_document(records)) + "\n", encoding="utf-8")
    return {
        "chain": list(chain),
        "thresholds_before": list(spec.thresholds or []),
        "held_out_accuracy_before": before,
        **choice.to_json(),
        "validation": name,
    }


def _compute_ms(resolved: Any, chain: Sequence[str]) -> dict[str, float]:
    """Each member's mean latency at batch size 1 on its fastest candidate type (1 ms where it
    has no profile yet: an unmeasured artifact model)."""
    found: dict[str, float] = {}
    for model in chain:
        means = []
        for instance_type in resolved.instance_types:
            try:
                means.append(resolved.profile(model, instance_type).mean_latency_ms(1))
            except (KeyError, LookupError, EstimatorError):
                continue
        found[model] = min(means) if means else 1.0
    return found


def _cascade_text(cascade: Mapping[str, Any]) -> str:
    before = cascade.get("held_out_accuracy_before")
    was = "" if before is None else f" (was {before:.4f} at {cascade['thresholds_before']})"
    return (
        f"cascade thresholds re-derived for the new version: {cascade['thresholds']},"
        f" held-out accuracy {cascade['held_out_accuracy']:.4f} on"
        f" {cascade['held_out_samples']} samples{was}"
    )


def profile_and_plan(
    store: Store,
    resolver: AppResolver,
    rollout: RolloutRecord,
    profiling: NewVersionProfiling,
) -> tuple[dict[str, Any], Sequence[Any] | None]:
    """The new version of ``rollout`` profiled on every candidate type of its app (``profile
    run``, at the batch sizes of the old version's profiles) and the app planned again with it:
    (what was measured and planned, for the rollout's settings; the new plan's stages, None
    without an applied plan to plan on). The rollout loop runs it, in a thread of its own.
    Raises ProfilingBudgetError, ProfilingError (the run) and ConflictError (no plan)."""
    app, model = rollout.app, rollout.model
    resolved = resolver.resolve(store.get_app(app).spec, check_budget=False)
    new_ref = store.get_model_version(rollout.artifact, rollout.to_version).ref(model)
    who = f"rollout {rollout.id}"
    unprofiled = {m: t for m, t in resolved.unprofiled.items() if m != model}
    if unprofiled and store.get_applied_plan(app) is not None:  # before the run is paid for
        raise ConflictError(
            f"app {app!r}: cannot plan the new version: {', '.join(sorted(unprofiled))} has no"
            " profiles yet (heteroplane profile run)"
        )
    sizes: set[int] = set()
    for instance_type in resolved.instance_types:
        try:
            sizes |= {int(b) for b in resolved.profile(model, instance_type).batch_sizes}
        except (KeyError, LookupError, EstimatorError):
            continue
    request = ProfileRunRequest(
        types=None,
        batch_sizes=tuple(sorted(sizes)) or DEFAULT_BATCH_SIZES,
        samples=profiling.samples,
        warmup=profiling.warmup,
    )
    result = run_profile(
        store,
        resolver,
        profiling.provisioner,
        profiling.clock,
        app,
        request,
        who=who,
        worker_port=profiling.worker_port,
        heartbeat_s=profiling.heartbeat_s,
        serve={model: new_ref},
    )
    planned: dict[str, Any] = {
        "instance_types": list(result.instance_types),
        "batch_sizes": list(result.batch_sizes),
        "samples": result.samples,
        "profiles": list(result.document.get("profiles", [])),
        "mean_ms_at_1": {
            p.instance_type: p.mean_latency_ms(int(p.batch_sizes[0])) for p in result.profiles
        },
        "plan": None,
    }
    applied = store.get_applied_plan(app)
    if applied is None:
        planned["not_planned"] = "no applied plan to plan on"
        return planned, None
    try:
        replan = replanning_request(applied.plan)
    except ValueError as error:  # a plan written by hand: its fleet is what there is to copy
        planned["not_planned"] = str(error)
        return planned, applied.plan.stages
    profiles = dict(resolved.profiles)
    profiles[model] = ProfileSet(result.profiles, "measured for the rollout")
    new_app = dataclasses.replace(resolved, profiles=profiles, unprofiled=unprofiled)
    try:  # under the app's constraints (ResolvedApp.constraints), as every plan of it
        trace, _ = planning_trace(new_app, replan)
        document: PlanDocument = plan_app(new_app, trace, seed=replan.seed)
    except (EstimatorError, InvalidValueError, ValueError) as error:
        raise ConflictError(f"app {app!r}: cannot plan the new version: {error}") from None
    planned["plan"] = {
        "planned_rate_qps": document.planned_rate_qps,
        "cost_usd_per_hr": document.cost_usd_per_hr,
        "fleet": dict(document.fleet),
        "stages": {s.name: dict(s.fleet) for s in document.stages},
    }
    return planned, document.stages


def planned_text(planned: Mapping[str, Any] | None) -> str:
    if planned is None:
        return ""
    means = ", ".join(f"{t} {ms:.1f} ms" for t, ms in planned["mean_ms_at_1"].items())
    text = f"; profiled on {', '.join(planned['instance_types'])} (mean at batch size 1: {means})"
    plan = planned["plan"]
    if plan is None:
        return (
            text + f"; not planned ({planned['not_planned']}): the extra fleet is sized from the"
            " stage's"
        )
    return (
        text + f", planned at {plan['planned_rate_qps']:.4g} qps:"
        f" {fleet_text(plan['fleet'])} for {plan['cost_usd_per_hr']:.4g} USD/hr"
    )


def fleet_text(fleet: dict[str, int]) -> str:
    return ", ".join(f"{t}={n}" for t, n in fleet.items())


def _active(store: Store, app: str, rollout_id: int | None) -> RolloutRecord:
    """The app's active rollout (the one ``rollout_id`` names, when given); NotFoundError for
    none (or when that one is over)."""
    store.get_app(app)  # NotFoundError for an unknown app first
    if rollout_id is not None:
        found = store.get_rollout(app, rollout_id)
        if not found.active:
            raise NotFoundError("active rollout", rollout_id)
        return found
    active = store.list_rollouts(app, active=True)
    if not active:
        raise NotFoundError("active rollout of app", app)
    return active[-1]


def _move(
    store: Store,
    app: str,
    to_state: RolloutState,
    who: str,
    what: str,
    rollout_id: int | None,
) -> RolloutRecord:
    rollout = _active(store, app, rollout_id)
    if rollout.state == to_state.value:
        raise ConflictError(f"rollout {rollout.id} of {app!r} is already {to_state.value}")
    if to_state == RolloutState.RUNNING and rollout.state != RolloutState.PAUSED:
        raise ConflictError(f"rollout {rollout.id} of {app!r} is {rollout.state}, not paused")
    if to_state == RolloutState.PAUSED and rollout.state == RolloutState.PENDING:
        raise ConflictError(
            f"rollout {rollout.id} of {app!r} is pending (the new version is checked before any"
            " traffic moves: no query is on it yet): nothing to pause; abort it to stop it"
        )
    # Where it was when moved: a pending rollout had moved no query yet (its first step's share
    # is what that step would have moved; an abort said "at step 1 of 4 (5% of queries)").
    pending = rollout.state == RolloutState.PENDING
    share = 0.0 if pending else rollout.step_share
    where = (
        "while pending (no query had moved to the new version)"
        if pending
        else f"at step {rollout.step_index + 1} of {len(rollout.steps)} ({100 * share:g}% of"
        " queries)"
    )
    # Said in the move's transaction (a crash leaves both or neither).
    return store.move_rollout(
        rollout,
        state=to_state.value,
        reason=f"{what} by {who}",
        said=lambda moved: [
            (
                DECISION_KIND,
                f"rollout {moved.id}: {what} by {who} {where}",
                {"rollout_id": moved.id, "state": moved.state, "step_share": share},
            )
        ],
    )


def pause_rollout(
    store: Store, app: str, *, who: str, rollout_id: int | None = None
) -> RolloutRecord:
    """Hold the app's rollout where it is: traffic stays split, no judgement moves it."""
    return _move(store, app, RolloutState.PAUSED, who, "paused", rollout_id)


def resume_rollout(
    store: Store, app: str, *, who: str, rollout_id: int | None = None
) -> RolloutRecord:
    """Let a paused rollout's judgement go on (its step's clock keeps its start)."""
    return _move(store, app, RolloutState.RUNNING, who, "resumed", rollout_id)


def abort_rollout(
    store: Store, app: str, *, who: str, rollout_id: int | None = None
) -> RolloutRecord:
    """End the app's rollout: every query back on the old version at once; the rollout loop
    ends its extra instances."""
    what = "aborted: all traffic back on the old version"
    return _move(store, app, RolloutState.ABORTED, who, what, rollout_id)


def rollout_document(rollout: RolloutRecord) -> dict[str, Any]:
    """The rollout as the API and ``--json`` show it (the keys of DESIGN section 6 first)."""
    settings = rollout.settings
    return {
        "id": rollout.id,
        "app": rollout.app,
        "phase": rollout_phase(rollout),
        "model": rollout.model,
        "artifact": rollout.artifact,
        "from_version": rollout.from_version,
        "to_version": rollout.to_version,
        "state": rollout.state,
        # The share on the new version now: none while pending (no query moves before its
        # first step starts; steps[0] says what that step will move).
        "step_share": 0.0
        if rollout.state == RolloutState.PENDING
        else rollout.step_share
        if rollout.active
        else _final_share(rollout),
        "reason": rollout.reason,
        "step_index": rollout.step_index,
        "steps": list(rollout.steps),
        "shadow": bool(settings.get("shadow")),
        "shadow_step": rollout.shadow_step and rollout.active,
        "interval_s": settings.get("interval_s"),
        "thresholds": settings.get("thresholds"),
        "stage_fleet": settings.get("stage_fleet"),
        "extra_fleet": settings.get("extra_fleet"),
        "extra_cost_usd_per_hr": settings.get("extra_cost_usd_per_hr"),
        "profiled": settings.get("profiled"),
        "figures": dict(rollout.figures),
        "cascade": settings.get("cascade"),
        "who": rollout.who,
        "step_started_at": rollout.step_started_at.isoformat(),
        "created_at": rollout.created_at.isoformat(),
        "updated_at": rollout.updated_at.isoformat(),
    }


def rollout_phase(rollout: RolloutRecord) -> str | None:
    """What a ``pending`` rollout is doing before traffic: ``profiling`` (the start's profile run
    and plan), ``waiting_for_budget`` (its first step's instances), ``starting`` (its workers
    launching, then the new version timed alone); None in any other state."""
    if rollout.state != RolloutState.PENDING:
        return None
    settings = rollout.settings
    if settings.get("profile_run") and "profiled" not in settings:
        return "profiling"
    if rollout.reason.startswith("waiting for the budget"):
        return "waiting_for_budget"
    return "starting"


def _final_share(rollout: RolloutRecord) -> float:
    """A finished rollout's share: all (promoted) or none (rolled back, aborted)."""
    return 1.0 if rollout.state == RolloutState.PROMOTED else 0.0
