"""INFaaS's autoscaler on live traffic: the scaling policy of apps whose spec says
``scaling: infaas``.

This module owns :class:`InfaasScaler`, the composition of the pure policy
(:func:`controlplane.policies.infaas_scaling.decide`) with the service, as
:class:`~controlplane.loops.live_tuner.LiveTuner` is InferLine's: once per tuner tick (the
service runs it in the ``tuner_tick`` job, after the live tuner) it reads, for each app with
``scaling: infaas`` and an applied plan,

- the serving loop's status as of its last refresh (an injected :data:`StatusSource`,
  ``ServingLoop.statuses``): the running workers, their types and busy shares, and the INFaaS
  state of each model on each of them (:mod:`controlplane.serving.states`), and what an
  overloaded model's state was judged on (refusals, arrival rate, backlog: the decision's reason
  says it);
- the load of each model: what its queue receives, the serving loop's measured arrivals of the
  model (``StageStatus.overload.arrival_sps``, samples/s, admitted and refused, over the state's
  window) over the samples of a query its Q_v counts (the profile's smallest batch); where
  nothing measures it (no stage status, or no instance serves the model), the app's recent
  arrivals (an injected :data:`ArrivalSource`, ``ServingLoop.observed_arrivals``) of the last
  ``window_s`` (INFaaS's monitoring daemon reports every 2 s) over ``window_s``, times the share
  of queries reaching the model (the applied plan's ``scale_factor`` of its stage, 1 when
  absent): model-less queries go where the variant choice sends them, not by the plan's shares;
- what the reconciler's last pass held back of the fleet's drains (an injected
  :data:`HeldBackSource`, ``Reconciler.held_back``: the instances its guards kept past the fleet
  the policy wants), which the drain waits for (one drain at a time); a rollout's, a spot move's
  or an interruption's instances serving beside the fleet are none of it; with it, which
  serving instances stand in for which type (``HeldBack.stand_ins``), counted as that type;
- the app's resolved spec: per model and candidate type, Q_v, the rate one instance serves at
  the plan's batch size (:func:`controlplane.policies.replay.rate_per_instance_qps`; 0 when the
  profile's batch time misses the SLO less the service's measured time per query, as the
  planner holds a stage to: INFaaS's Constraint 2), and T_load, the type's start-up
  (:func:`controlplane.policies.tuner.default_boot_s`, the loading latency of an inactive
  variant); its prices, its ``max_counts`` and the app's budget;

calls the policy, records every decision (``infaas_replicate``, ``infaas_upgrade``,
``infaas_drain``, ``infaas_relieve``, ``infaas_budget_capped``) with its reason and numbers in the
store, and keeps the fleet the policy wants, which the reconciler reads through
:meth:`InfaasScaler.desired_fleet` (the reconciler stays the only code that acts on provisioners:
it launches toward a larger count and drains toward a smaller one, never past the budget).

The policy starts from the applied plan's fleet; a new applied plan (a new plan id) starts it
again from the plan's fleet, a budget change keeps the fleet it reached, cut to the new budget as
the reconciler's budget drain cuts it (:func:`_within_budget`). A restarted policy (a restarted
loops process, a new leader) starts from the fleet it had reached on the applied plan, which
each decision records (:mod:`controlplane.loops.reached`), cut the same way to the lowest
budget the app has had since that decision (a cut writes no decision, and a raise after it grows
nothing back); so does :meth:`InfaasScaler.desired_fleet` before the policy's first tick. An app
the scaler saw scaled by another policy (its spec's ``scaling`` switched, then back to
``infaas``) starts from the fleet that runs (its kept instances by type, cut to the budget; the
plan's where none runs): the other policy moved the fleet since without a decision this module
reads, and the fleet reached before the switch drained what runs with no decision; a scaler
that did not see the app under the other policy (a new leader) reads the switch from its
``scaling_switched`` decision (:func:`switched_since`). An app
the serving loop does not serve (no status, or no arrival source) stays on its plan. The live
tuner leaves these apps alone (``scaling`` decides which of the two scales an app).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
from numpy.typing import NDArray

from controlplane.apps.resolver import smallest_common_batch_size
from controlplane.apps.scaling import SCALING_SWITCHED
from controlplane.clock import Clock
from controlplane.db.store import AppRecord, PlanRecord, Store
from controlplane.errors import NotFoundError
from controlplane.loops.reached import (
    INFAAS_KINDS,
    PLAN_ID,
    counts,
    lowest_budget_since,
    newest,
)
from controlplane.policies import scaling
from controlplane.policies.drain import DrainInstance, plan_drain, qps_by_type
from controlplane.policies.infaas_scaling import (
    HeldBack,
    OverloadNote,
    ScalerState,
    ScalingConfig,
    ScalingContext,
    ScalingDecision,
    ServedInstance,
    VariantProfile,
    decide,
    initial_state,
)
from controlplane.policies.lifecycle import KEPT_STATES, InstanceState, is_profile_worker
from controlplane.policies.plan import StagePlan
from controlplane.policies.replay import rate_per_instance_qps
from controlplane.policies.tuner import default_boot_s
from controlplane.serving.dispatcher import AppStatus
from controlplane.serving.states import MONITORING_PERIOD_S
from controlplane.spec import ResolvedApp
from estimator.errors import EstimatorError

__all__ = [
    "DEFAULT_LOAD_WINDOW_S",
    "ArrivalSource",
    "HeldBackSource",
    "InfaasScaler",
    "StatusSource",
    "scales_with_infaas",
    "switched_since",
]

logger = logging.getLogger(__name__)

# The one launch time the budget cut's stand-in instances share (the drain's order does not
# read it among equals of one type).
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

ArrivalSource = Callable[[str], NDArray[np.float64] | None]
"""App name -> its recent arrival times (the clock's seconds), ``None`` when nothing observes it."""
StatusSource = Callable[[], Sequence[AppStatus]]
"""The serving loop's status of every app it serves, as of its last refresh."""
HeldBackSource = Callable[[str], HeldBack]
"""App name -> what the reconciler's last pass held back of the fleet's drains
(:meth:`controlplane.loops.reconciler.Reconciler.held_back`)."""
ResolveFn = Callable[[AppRecord], ResolvedApp]

# INFaaS's monitoring daemons report every 2 s (section 5): the load is measured over as long.
DEFAULT_LOAD_WINDOW_S = MONITORING_PERIOD_S


def scales_with_infaas(app: AppRecord) -> bool:
    """Whether ``app``'s spec hands its scaling to INFaaS's autoscaler (``scaling: infaas``,
    :func:`controlplane.policies.scaling.live_owner`)."""
    return scaling.live_owner(app.spec.get("scaling")) == "infaas"


@dataclass(slots=True)
class _AppScaler:
    plan_id: int
    budget_usd_per_hr: float
    state: ScalerState


def _within_budget(
    fleet: Mapping[str, int], resolved: ResolvedApp, budget_usd_per_hr: float
) -> dict[str, int]:
    """``fleet`` less what the reconciler's budget drain would take off it
    (:func:`~controlplane.policies.drain.plan_drain`, least cost-effective first, at the same
    per-type rates the reconciler prices the app's instances by; by price alone where a
    profile is missing, as it does)."""
    prices = resolved.prices_usd_per_hr
    units = [
        DrainInstance(f"{t}-{k}", t, InstanceState.RUNNING.value, prices.get(t, 0.0), _EPOCH)
        for t, n in fleet.items()
        for k in range(n)
    ]
    try:
        values = qps_by_type(resolved, smallest_common_batch_size(resolved))
    except (EstimatorError, KeyError, ValueError):
        values = {}
    kept = Counter({t: n for t, n in fleet.items() if n > 0})
    kept.subtract(c.instance_type for c in plan_drain(units, budget_usd_per_hr, values).drain)
    return {t: n for t, n in kept.items() if n > 0}


class InfaasScaler:
    """INFaaS's autoscaler over every app with ``scaling: infaas`` and an applied plan
    (thread-safe). ``tick()`` runs in the scheduler's tuner job; ``desired_fleet(app)`` is the
    reconciler's hook for these apps (the plan's fleet until the policy has run)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        arrivals: ArrivalSource,
        statuses: StatusSource,
        resolve: ResolveFn,
        *,
        config: ScalingConfig | None = None,
        window_s: float = DEFAULT_LOAD_WINDOW_S,
    ) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be finite and > 0, got {window_s!r}")
        self._store = store
        self._clock = clock
        self._arrivals = arrivals
        self._statuses = statuses
        self._resolve = resolve
        self._config = config or ScalingConfig()
        self._window_s = float(window_s)
        self._apps: dict[str, _AppScaler] = {}
        # Apps seen scaled by another loop (or none) since the policy last started on them: the
        # fleet it had reached is no longer what runs.
        self._elsewhere: set[str] = set()
        self._lock = threading.Lock()
        # The reconciler's word on the drains still to be carried out (set where the service
        # builds the reconciler, after this scaler); None: counted from the instances that serve.
        self.held_back: HeldBackSource | None = None

    def desired_fleet(self, app: AppRecord) -> Mapping[str, int]:
        """Counts by type ``app`` should run: the policy's fleet, or its applied plan's."""
        with self._lock:
            scaled = self._apps.get(app.name)
            if scaled is not None and scaled.plan_id == app.applied_plan_id:
                return dict(scaled.state.fleet)
            switched = app.name in self._elsewhere
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return {}
        # Before the policy's first tick on this plan (a restarted loops process), the fleet it
        # had reached, as its first tick starts from: the reconciler's first pass drained what
        # it had grown.
        try:
            resolved = self._resolve(app)
        except (EstimatorError, KeyError, ValueError, NotFoundError):
            return plan.plan.fleet
        return _start_fleet(self._store, app, plan, resolved, switched=switched)

    def tick(self, apps: Sequence[AppRecord] | None = None) -> list[tuple[str, ScalingDecision]]:
        """One tick for every app with ``scaling: infaas`` (``apps``, the tick's snapshot of the
        store's apps, else read now); the decisions it recorded."""
        made: list[tuple[str, ScalingDecision]] = []
        now_s = self._clock.now_s()
        statuses = {status.app: status for status in self._statuses()}
        for app in self._store.list_apps() if apps is None else apps:
            if not scales_with_infaas(app) or app.applied_plan_id is None:
                with self._lock:
                    self._apps.pop(app.name, None)
                    if not scales_with_infaas(app):
                        self._elsewhere.add(app.name)
                continue
            status = statuses.get(app.name)
            observed = self._arrivals(app.name)
            if status is None or observed is None:
                continue
            try:
                made.extend((app.name, d) for d in self._tick_app(app, status, observed, now_s))
            except NotFoundError:
                # Deleted since the tick read the apps (a teardown's end): the others go on.
                logger.info("infaas: %s was deleted during the tick", app.name)
                with self._lock:
                    self._apps.pop(app.name, None)
                    self._elsewhere.discard(app.name)
            except (EstimatorError, KeyError, ValueError) as error:
                # A spec or plan the policy cannot read leaves the app where it is; next tick
                # tries again.
                logger.warning("infaas: %s left as it is: %s", app.name, error)
        return made

    def _tick_app(
        self, app: AppRecord, status: AppStatus, observed: NDArray[np.float64], now_s: float
    ) -> list[ScalingDecision]:
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return []
        with self._lock:
            scaled = self._apps.get(app.name)
            switched = app.name in self._elsewhere
        resolved = self._resolve(app)
        if scaled is None or scaled.plan_id != plan.id:
            start = _start_fleet(self._store, app, plan, resolved, switched=switched)
            scaled = _AppScaler(plan.id, app.budget_usd_per_hr, initial_state(start, now_s))
        elif scaled.budget_usd_per_hr != app.budget_usd_per_hr:
            # The fleet the policy reached stays, cut to the new budget (started again from the
            # plan's fleet, it wanted what the reconciler then drained, or bought back).
            fleet = _within_budget(scaled.state.fleet, resolved, app.budget_usd_per_hr)
            scaled = _AppScaler(
                plan.id, app.budget_usd_per_hr, dataclasses.replace(scaled.state, fleet=fleet)
            )
        document = plan.plan
        stages = {stage.name: stage for stage in document.stages}
        models = list(resolved.spec.serving_order)
        types = list(resolved.instance_types)
        boot_s = default_boot_s(resolved.catalog, types)
        limits = resolved.constraints
        # A variant meets the SLO the planner holds a stage to: less the service's own time.
        slo_ms = limits.stage_slo_ms
        variants = []
        # Per model, the samples of a query its Q_v counts (the profile's smallest batch).
        query_samples: dict[str, int] = {}
        for model in models:
            entry = stages.get(model)
            batch = entry.batch_size if entry is not None else 1
            for t in types:
                profile = resolved.profile(model, t)
                smallest = profile.min_batch_size
                query_samples[model] = min(query_samples.get(model, smallest), smallest)
                meets = profile.mean_latency_ms(smallest) <= slo_ms
                rate = (
                    rate_per_instance_qps(profile, np.array([smallest], dtype=np.int64), batch)
                    if meets
                    else 0.0
                )
                variants.append(VariantProfile(model, t, rate, boot_s[t]))
        arrivals = np.asarray(observed, dtype=np.float64)
        recent = int(np.count_nonzero(arrivals > now_s - self._window_s))
        rate_qps = recent / self._window_s
        load = _model_loads(status, models, query_samples, rate_qps, stages)
        instances = []
        for worker in status.workers:
            if not worker.healthy:
                continue
            served = {
                stage.model: stage.states[worker.instance_id]
                for stage in status.stages
                if worker.instance_id in stage.states
            }
            instances.append(
                ServedInstance(
                    worker.instance_id, worker.instance_type, served, worker.utilisation_share
                )
            )
        # What each overloaded model's state was judged on, for the decision's reason.
        overload = {
            stage.model: OverloadNote(
                tuple(stage.overload.reasons()), dict(stage.overload.numbers())
            )
            for stage in status.stages
            if stage.overload is not None and stage.overload.overloaded
        }
        context = ScalingContext(
            app=app.name,
            now_s=now_s,
            load_qps=load,
            instances=instances,
            variants=variants,
            prices_usd_per_hr=dict(resolved.prices_usd_per_hr),
            budget_usd_per_hr=app.budget_usd_per_hr,
            max_counts=limits.caps(types),
            overload=overload,
            held_back=None if self.held_back is None else self.held_back(app.name),
        )
        decisions, state = decide(context, scaled.state, self._config)
        # The tick's decisions in one transaction: each carries the fleet after the whole tick
        # (FLEET_AFTER, what a restarted scaler starts from), so that a crash between two left
        # the second's change made and never said.
        if decisions:
            self._store.record_decisions(
                app.name,
                [
                    (
                        d.action,
                        d.reason,
                        {
                            **d.numbers,
                            "policy": "infaas",
                            "at_s": now_s,
                            # What a restarted policy starts from (_start_fleet).
                            PLAN_ID: plan.id,
                            FLEET_AFTER: {t: int(n) for t, n in state.fleet.items()},
                        },
                        # A cap that lasts is one row (per model and type), as the tuner's.
                        f"infaas:{d.model}:{d.instance_type}"
                        if d.action == "infaas_budget_capped"
                        else None,
                    )
                    for d in decisions
                ],
            )
        # Only now does the reconciler see the new fleet: a decision is in the log before what
        # the reconciler does about it (a drain before its terminate, a replica before its launch).
        # A write that fails leaves the scaler as it was, none of the tick's decisions written:
        # the next tick decides again.
        with self._lock:
            scaled.state = state
            self._apps[app.name] = scaled
            self._elsewhere.discard(app.name)
        return decisions


# The numbers key of a decision that holds the policy's fleet after its tick.
FLEET_AFTER = "fleet_after"


def _model_loads(
    status: AppStatus,
    models: Sequence[str],
    query_samples: Mapping[str, int],
    rate_qps: float,
    stages: Mapping[str, StagePlan],
) -> dict[str, float]:
    """The load of each model (qps, in queries of the samples its Q_v counts: ``query_samples``):
    what its queue received, the serving loop's measured arrivals of the model (samples/s,
    admitted and refused, over the state's window: ``StageStatus.overload.arrival_sps``) over
    those samples; where nothing measures it (no stage status, or no instance serves the model),
    the app's rate ``rate_qps`` times the plan's share of queries reaching the model (its stage's
    ``scale_factor``). The share alone read 0.19 qps for a variant model-less queries sent 11.4
    to (the plan's share is the cascade's, not where the variant choice sends them): the drain's
    capacity rule found the load gone while the overload state said it could not keep up."""
    measured = {
        stage.model: stage.overload.arrival_sps
        for stage in status.stages
        if stage.overload is not None and stage.states
    }
    loads: dict[str, float] = {}
    for model in models:
        sps = measured.get(model)
        if sps is not None:
            loads[model] = sps / max(query_samples.get(model, 1), 1)
        else:
            loads[model] = rate_qps * (stages[model].scale_factor if model in stages else 1.0)
    return loads


def _start_fleet(
    store: Store,
    app: AppRecord,
    plan: PlanRecord,
    resolved: ResolvedApp,
    *,
    switched: bool = False,
) -> dict[str, int]:
    """Where the policy starts on the applied ``plan``: after a switch of ``scaling`` to
    ``infaas`` (``switched``), the fleet that runs (:func:`_running_fleet`) cut to the budget,
    else the plan's; otherwise the fleet it had reached on the plan
    (:func:`controlplane.loops.reached.reached`) cut to the lowest budget the app has had since
    (:func:`controlplane.loops.reached.lowest_budget_since`: a cut writes no decision, and a
    raise after it grows nothing back), else the plan's fleet.

    The fleet reached is for a restart: after a switch, the other loop (or a fixed fleet) has
    moved the fleet since, without a decision of the kinds :func:`~controlplane.loops.reached.
    newest` reads where it set up from the plan, and starting from the old fleet drained what
    runs with no decision of this policy's."""
    if switched or switched_since(store, app.name, plan):
        running = _within_budget(
            _running_fleet(store, app, resolved), resolved, app.budget_usd_per_hr
        )
        return running or dict(plan.plan.fleet)
    decision = newest(store, app.name, plan, INFAAS_KINDS, FLEET_AFTER)
    fleet = None if decision is None else counts(decision.numbers[FLEET_AFTER])
    if decision is None or fleet is None or not set(fleet) <= set(resolved.instance_types):
        return dict(plan.plan.fleet)
    budget = lowest_budget_since(store, app.name, decision.at, app.budget_usd_per_hr)
    return _within_budget(fleet, resolved, budget)


def switched_since(store: Store, app: str, plan: PlanRecord) -> bool:
    """Whether ``app``'s scaling was handed to this loop (a ``scaling_switched`` decision,
    :func:`controlplane.apps.scaling.scaling_switch`) after ``plan`` was applied and
    after this loop last wrote a fleet: the fleet it had reached is then not what runs. What a
    loop that did not run through the switch (a new leader, a restarted loops process) knows of
    it; the one that did saw the app under the other loop (``InfaasScaler._elsewhere``)."""
    if plan.applied_at is None:
        return False
    read = sorted(INFAAS_KINDS | {SCALING_SWITCHED})
    found = store.list_decisions(app, kinds=read, limit=1)
    if not found:
        return False
    (last,) = found
    return last.kind == SCALING_SWITCHED and last.at >= plan.applied_at


def _running_fleet(store: Store, app: AppRecord, resolved: ResolvedApp) -> dict[str, int]:
    """The app's kept instances (requested, pending, running) by type, of the app's candidate
    types, profile runs' and rollouts' workers aside (no part of the fleet the reconciler keeps
    toward the desired one)."""
    rows = store.list_instances(app.name, states=[state.value for state in KEPT_STATES])
    types = set(resolved.instance_types)
    found = Counter(
        row.instance_type
        for row in rows
        if row.instance_type in types and not is_profile_worker(row.request_id)
    )
    return dict(found)
