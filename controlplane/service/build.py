"""The service's composition root: settings -> database -> store -> provisioner -> reconciler ->
scheduler -> API.

:func:`build_service` is what ``heteroplane serve`` runs (and what a test that wants the whole
service in-process calls): it creates the data directory, migrates the database to the newest
revision, opens the store on the clock, builds the provisioner the settings name
(:func:`controlplane.provisioning.build_provisioner`) and the
:class:`~controlplane.loops.reconciler. Reconciler` over it, the serving loop
(:class:`~controlplane.serving.loop.ServingLoop`: the dispatchers behind ``POST
/v1/apps/{app}/infer``, finding workers through the store and the provisioner), the live tuner
(:class:`~controlplane.loops.live_tuner.LiveTuner`: InferLine's tuner on the arrivals the serving
loop observes; its fleet is the reconciler's desired fleet), the live gear switcher
(:class:`~controlplane.loops.live_gears.LiveGears`: CascadeServe's producer for apps whose plans
carry a gear plan; the serving loop's gear hook, told by the tuner when the budget caps the fleet),
the capacity replanner (:class:`~controlplane.loops.capacity_replan.CapacityReplanner`: an app whose
planned type the cloud cannot supply is re-planned around it, after the reconcile tick), and the
scheduler with its job bodies (the tuner tick, then the gear tick; the reconcile tick, then the
capacity replanner; the metric roll-up, which reads the serving loop's windows; the replan job,
the :class:`~controlplane.loops.traffic_replan.TrafficReplanner`: an app whose observed traffic has
stayed out of its plan's envelope band for ``replan_hold_s`` is re-planned on it, unless
``replan_enabled`` is off) and the FastAPI app around them. The online calibration
(:class:`~controlplane.loops.calibration.ProfileCalibrator`) runs in the tuner's tick after the
gear switcher; the one resolver (shared with the API) reads the calibration factors from the
store, so every resolved app carries the calibrated profiles.

Scaling is per app (the spec's ``scaling``): InferLine's live tuner by default, INFaaS's
autoscaler (:class:`~controlplane.loops.infaas_scaler.InfaasScaler`, on the serving loop's
states) for ``scaling: infaas``. The INFaaS scaler runs in the tuner's tick right after the live
tuner, and the reconciler's desired fleet is the scaler's for those apps, the tuner's for the
others (:func:`scaled_fleet`).

Replicas (docs/service.md, "Replicas and the leader lease"): every job body is fenced by the
replica's :class:`~controlplane.loops.leadership.Leadership`, whose lock is a PostgreSQL advisory
lock (:class:`~controlplane.db.lease.AdvisoryLock`) or, on a SQLite file, an ``flock``
(:class:`~controlplane.db.lease.FileLeaderLock`; the database file's serving lock,
:func:`~controlplane.db.lease.lock_sqlite_database`, taken before anything else, keeps a second
serving process out). The API's lifespan runs the lease, which starts the scheduler on the leader
only; the serving loop runs on every replica (it reads the fleet from the database).

Roles (docs/service.md, "Serving apart from the loops"): ``build_service(..., role=)`` wires the
whole of the above in one process (``"all"``, the default), or one half of it: ``"serving"`` the
serving loop and the API with no scheduler (its gear hook a
:class:`~controlplane.loops.live_gears.GearTable` the loops set over the internal feed; on
PostgreSQL one such process per database, held by an advisory lock, unless ``sole_serving`` is
false: ``heteroplane serve``'s own serving process is a replica), ``"loops"`` the scheduler and
its jobs under the leader lease and the API without inference, reading the serving process
through a :class:`~controlplane.loops.remote_serving.RemoteServing` where they would read the
serving loop (:class:`~controlplane.loops.remote_serving.ServingView`). ``heteroplane serve``
runs the two halves as two processes (:mod:`controlplane.cli.loops_process`).

The reconciler learns each app's prices and Q_t (for the budget guard's ranking) from the app's
resolved spec (:func:`spec_pricing`), and which types it may launch from the provisioner
(:meth:`~provisioners.base.Provisioner.launch_refusal`): the local provisioner runs only the
emulated types (``emu.*``, and ``local.cpu``), so a plan naming EC2 types is not launched under it
(one ``plan_not_launched`` decision says so). The registry keeps artifacts where the provisioner
says (:meth:`~provisioners.base.Provisioner.artifact_storage`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from fastapi import FastAPI

from controlplane.apps.plans import launchable_only
from controlplane.apps.resolver import (
    AppResolver,
    Calibrated,
    OverheadSource,
    ScaleSource,
    smallest_common_batch_size,
)
from controlplane.apps.rollouts import NewVersionProfiling
from controlplane.clock import Clock, SystemClock
from controlplane.db import migrate
from controlplane.db.lease import (
    SERVING_APPLICATION_NAME,
    SERVING_LOCK_KEY,
    AdvisoryLock,
    KeptLock,
    SqliteFileLock,
    lock_sqlite_database,
    migration_lock,
    sqlite_leader_lock,
)
from controlplane.db.session import is_in_memory_sqlite
from controlplane.db.store import AppRecord, Store
from controlplane.errors import DatabaseError, NotFoundError, SettingsError
from controlplane.loops.calibration import ProfileCalibrator
from controlplane.loops.capacity_replan import CapacityReplanner
from controlplane.loops.infaas_scaler import InfaasScaler, scales_with_infaas
from controlplane.loops.leadership import TRY_EVERY_S, LeaderLock, Leadership, SoleLock
from controlplane.loops.live_gears import GearTable, LiveGears
from controlplane.loops.live_tuner import LiveTuner, ResolveFn
from controlplane.loops.liveness import Liveness, http_probe
from controlplane.loops.reconciler import (
    DEFAULT_STRAGGLER_TIMEOUT_S,
    PROFILE_RUN_MISSED_BEATS,
    AppPricing,
    ArtifactsFn,
    DesiredFleet,
    LaunchableFn,
    PricingFn,
    Reconciler,
    ReconcileReport,
    disruption_budget,
)
from controlplane.loops.remote_serving import RemoteServing, ServingView
from controlplane.loops.rollouts import RolloutLoop
from controlplane.loops.rollup import make_rollup
from controlplane.loops.scheduler import JobBodies, Scheduler, service_schedule
from controlplane.loops.spot_replan import SpotReplanner
from controlplane.loops.traffic_replan import ReplanBand, TrafficReplanner
from controlplane.policies.calibration import CalibrationRule
from controlplane.policies.disruption import DisruptionBudget
from controlplane.policies.drain import qps_by_type
from controlplane.policies.gears import Hysteresis
from controlplane.policies.infaas_scaling import ScalingConfig
from controlplane.policies.lifecycle import (
    BILLED_STATES,
    KEPT_STATES,
    PROFILE_REQUEST_PREFIX,
    billed_cost_usd_per_hr,
)
from controlplane.provisioning import build_provisioner, provider_spot_prices
from controlplane.service.app import create_app
from controlplane.serving.config import ServingGear
from controlplane.serving.loop import GearHook, ServingLoop
from controlplane.serving.owners import DispatchOwners
from controlplane.serving.workers import DEFAULT_WORKER_PORT, ProvisionedInstances
from controlplane.settings import Settings
from estimator.catalog import default_catalog
from estimator.errors import EstimatorError
from provisioners.artifacts import ArtifactRef
from provisioners.base import Provisioner

__all__ = [
    "SERVICE_ROLES",
    "Service",
    "ServiceRole",
    "app_artifacts",
    "build_calibrator",
    "build_infaas_scaler",
    "build_leadership",
    "build_live_gears",
    "build_live_tuner",
    "build_reconciler",
    "build_scheduler",
    "build_service",
    "build_traffic_replanner",
    "check_served_database",
    "launchable_types",
    "profile_runs_beside",
    "scaled_fleet",
    "spec_pricing",
    "stored_apps",
    "stored_scales",
]

logger = logging.getLogger(__name__)

# What one ``heteroplane serve`` process runs (docs/service.md, "Serving apart from the loops"):
# all of it; the API and inference without the periodic jobs; the periodic jobs and the API
# without inference, reading the serving process's observations over its internal routes.
ServiceRole = Literal["all", "serving", "loops"]
SERVICE_ROLES: tuple[ServiceRole, ...] = ("all", "serving", "loops")


@dataclass(frozen=True, slots=True)
class Service:
    """The running service's parts; :meth:`close` releases the database."""

    settings: Settings
    store: Store
    scheduler: Scheduler
    app: FastAPI
    provisioner: Provisioner
    # None in a serving process whose loops run apart (``role="serving"``).
    reconciler: Reconciler | None
    serving: ServingLoop | None = None
    leadership: Leadership | None = None
    database_lock: SqliteFileLock | None = None
    live_tuner: LiveTuner | None = None
    role: ServiceRole = "all"
    # A loops process's view of the serving process (``role="loops"``).
    remote: RemoteServing | None = None
    # A serving process's lock: one serving process per database (``role="serving"``).
    serving_lock: KeptLock | None = None

    def close(self) -> None:
        """Stop the jobs, give up the leader lease and release the database. The provisioner's
        instances are left running (a restarted service finds them again by their tags)."""
        if self.leadership is not None:
            self.leadership.stop()
        self.scheduler.shutdown(wait=True)
        if self.remote is not None:
            self.remote.close()
        if self.live_tuner is not None:
            self.live_tuner.close()
        self.provisioner.close()
        self.store.close()
        if self.leadership is not None and isinstance(self.leadership.lock, AdvisoryLock):
            self.leadership.lock.close()
        if self.serving_lock is not None:
            self.serving_lock.close()
        if self.database_lock is not None:
            self.database_lock.close()


def spec_pricing(resolver: AppResolver) -> PricingFn:
    """Each app's prices (its spec's catalog: the default one with the spec's ``catalog`` file
    over it) and Q_t of its candidate types on the smallest batch size all profiles cover (as
    ``PUT /v1/apps/{app}/budget`` ranks them). An app whose spec no longer resolves (a profile
    file gone) is priced from the default catalog and ranked by price alone."""
    fallback = AppPricing({t.name: t.price_usd_per_hr for t in default_catalog().values()})
    warned: set[tuple[str, int]] = set()

    def pricing(app: AppRecord) -> AppPricing:
        try:
            resolved = resolver.resolve(app.spec, check_budget=False)
            prices = {t.name: t.price_usd_per_hr for t in resolved.catalog.values()}
            spot = {  # the catalog's spot prices (docs/spot.md; live ones are not read yet)
                t.name: t.spot_price_usd_per_hr
                for t in resolved.catalog.values()
                if t.spot_price_usd_per_hr is not None
            }
            if resolved.unprofiled:  # a registered model not profiled yet: by price alone
                return AppPricing(prices, spot_prices_usd_per_hr=spot)
            return AppPricing(
                prices,
                qps_by_type(resolved, smallest_common_batch_size(resolved)),
                spot_prices_usd_per_hr=spot,
            )
        except EstimatorError as error:
            if (app.name, app.version) not in warned:
                warned.add((app.name, app.version))
                logger.warning("app %s: priced from the default catalog: %s", app.name, error)
            return fallback

    return pricing


def launchable_types(provisioner: Provisioner) -> LaunchableFn:
    """Which instance types ``provisioner`` can launch (its
    :meth:`~provisioners.base.Provisioner.launch_refusal`: the local one only those it emulates,
    EC2 every type, a type it does not know failing at launch, as a decision)."""
    return provisioner.launch_refusal


def app_artifacts(resolver: AppResolver) -> ArtifactsFn:
    """An app record -> the registered models its workers load (its resolved spec's, each
    served as the model's name; none for an app of profile files only)."""

    def artifacts(app: AppRecord) -> tuple[ArtifactRef, ...]:
        if not any("artifact" in model for model in app.spec.get("models", ())):
            return ()
        resolved = resolver.resolve(app.spec, check_budget=False)
        return tuple(artifact.ref for artifact in resolved.artifacts.values())

    return artifacts


def stored_apps(resolver: AppResolver, launchable: LaunchableFn | None = None) -> ResolveFn:
    """An app record -> its stored spec resolved (the budget not checked: it is the app's own);
    with ``launchable`` (the provisioner's :meth:`~provisioners.base.Provisioner.launch_refusal`)
    the types it cannot launch capped at 0 (:func:`~controlplane.apps.plans.launchable_only`),
    for the loops that size and plan what the reconciler then launches."""
    if launchable is None:
        return lambda app: resolver.resolve(app.spec, check_budget=False)
    return lambda app: launchable_only(resolver.resolve(app.spec, check_budget=False), launchable)


def build_reconciler(
    store: Store,
    clock: Clock,
    provisioner: Provisioner,
    resolver: AppResolver,
    desired_fleet: DesiredFleet | None = None,
    *,
    disruption: DisruptionBudget | None = None,
    profile_run_heartbeat_s: float | None = None,
    spot_headroom_share: float | None = None,
    liveness: Liveness | None = None,
    spot_return_hold_s: float | None = None,
) -> Reconciler:
    """The reconciler over ``provisioner``, pricing apps from their specs (through
    ``resolver``); ``desired_fleet`` is the live tuner's (default: each app's applied plan);
    ``disruption`` bounds its voluntary drains (default: the reconciler's); a profile run's
    workers are its run's for four ``profile_run_heartbeat_s`` after its last heartbeat
    (default: the reconciler's); ``spot_headroom_share`` and ``spot_return_hold_s`` are rule
    10's (default: the reconciler's); ``liveness`` finds the running workers to replace
    (default: none probed; :func:`worker_liveness`)."""
    extra: dict[str, Any] = {} if disruption is None else {"disruption": disruption}
    if spot_headroom_share is not None:
        extra["spot_headroom_share"] = spot_headroom_share
    if spot_return_hold_s is not None:
        extra["spot_return_hold_s"] = spot_return_hold_s
    if profile_run_heartbeat_s is not None:
        extra["profile_run_timeout_s"] = PROFILE_RUN_MISSED_BEATS * profile_run_heartbeat_s
    return Reconciler(
        store,
        provisioner,
        clock,
        spec_pricing(resolver),
        desired_fleet=desired_fleet,
        launchable=launchable_types(provisioner),
        artifacts=app_artifacts(resolver),
        liveness=liveness,
        **extra,
    )


def worker_liveness(settings: Settings) -> Liveness | None:
    """The reconciler's probe of running workers (:mod:`controlplane.loops.liveness`): for the
    provisioners that run real workers (local, EC2) unless ``worker_unresponsive_s`` is 0; the
    fake provisioner's instances have no worker to ask."""
    if settings.provisioner == "fake" or settings.worker_unresponsive_s <= 0:
        return None
    return Liveness(
        http_probe(DEFAULT_WORKER_PORT, stuck_after_s=settings.worker_stuck_s),
        after_s=settings.worker_unresponsive_s,
        never_after_s=DEFAULT_STRAGGLER_TIMEOUT_S,
    )


def _either_gear(first: GearHook, second: GearHook) -> GearHook:
    """The serving loop's gear hook from two: ``first``'s gear for an app, else ``second``'s
    (the gear switcher's for a cascade, else the tuner's batch cap for a single model)."""

    def gear(app: str) -> ServingGear | None:
        found = first(app)
        return found if found is not None else second(app)

    return gear


def gears_by_lease(
    live_gears: LiveGears, leadership: Leadership, remote: RemoteServing | None
) -> None:
    """Tie the gear switcher to the leader lease: it knows its gears only once it has read
    the store in the lease's term now (a replica that leads again resumes them from the log,
    where it sent at once what it had tracked before another replica's term), and a loops
    process running apart sends them (``remote``'s feed) only while it leads (a standby's
    switcher does not run, and its empty gears undid the leader's at every other exchange)."""
    live_gears.term = lambda: leadership.terms
    if remote is not None:
        remote.gears_known = lambda: leadership.role == "leader" and live_gears.refreshed()


def build_live_tuner(
    settings: Settings,
    store: Store,
    clock: Clock,
    serving: ServingView,
    resolver: AppResolver,
    launchable: LaunchableFn | None = None,
) -> LiveTuner:
    """InferLine's tuner over the apps the serving loop observes (the others stay on their
    plans); apps resolve through ``resolver``, sized on the types ``launchable`` allows
    (:func:`stored_apps`)."""
    return LiveTuner(
        store,
        clock,
        serving.observed_arrivals,
        stored_apps(resolver, launchable),
        max_window_s=settings.tuner_max_window_s,
        scale_down_delay_s=settings.tuner_scale_down_delay_s,
        cascade_ladders=settings.tuner_cascade_ladders,
        statuses=serving.statuses,
    )


def build_infaas_scaler(
    settings: Settings,
    store: Store,
    clock: Clock,
    serving: ServingView,
    resolver: AppResolver,
    launchable: LaunchableFn | None = None,
) -> InfaasScaler:
    """INFaaS's autoscaler over the apps with ``scaling: infaas`` that the serving loop serves,
    on its states and arrivals (the types ``launchable`` allows, :func:`stored_apps`); a drain
    waits the tuner's ``tuner_scale_down_delay_s`` (the service's one scale-down delay)."""
    return InfaasScaler(
        store,
        clock,
        serving.observed_arrivals,
        serving.statuses,
        stored_apps(resolver, launchable),
        config=ScalingConfig(hold_s=settings.tuner_scale_down_delay_s),
    )


def scaled_fleet(live_tuner: LiveTuner, infaas: InfaasScaler | None) -> DesiredFleet:
    """The reconciler's desired fleet: INFaaS's autoscaler's for an app with ``scaling:
    infaas``, the live tuner's for the others."""

    def desired(app: AppRecord) -> Mapping[str, int]:
        if infaas is not None and scales_with_infaas(app):
            return infaas.desired_fleet(app)
        return live_tuner.desired_fleet(app)

    return desired


def build_live_gears(
    settings: Settings, store: Store, clock: Clock, serving: ServingView, resolver: AppResolver
) -> LiveGears:
    """CascadeServe's gear switcher over the apps whose plans carry a gear plan, on what the
    serving loop observes, with the settings' hysteresis (``gear_*``); its store side refreshes
    right after the tuner in the tuner's tick, its producer runs in the ``gears`` job (every
    ``gear_interval_s``). Apps resolve through ``resolver``."""
    return LiveGears(
        store,
        clock,
        serving.observed_arrivals,
        serving.statuses,
        stored_apps(resolver),
        hysteresis=Hysteresis(
            band_share=settings.gear_dead_band_share,
            down_hold_s=settings.gear_down_hold_s,
            down_dwell_s=settings.gear_down_dwell_s,
            up_dwell_s=settings.gear_up_dwell_s,
        ),
    )


def build_traffic_replanner(
    settings: Settings,
    store: Store,
    clock: Clock,
    serving: ServingView,
    resolver: AppResolver,
    provisioner: Provisioner | None = None,
) -> TrafficReplanner:
    """The re-planning on recorded traffic over the apps the serving loop observes (the others
    stay on their plans), with the settings' period, window, hold, band, minimum of queries and
    plan deadline; apps resolve through ``resolver``, planned on the types ``provisioner``
    launches (:func:`stored_apps`); spot priced at its prices where it reads them
    (:func:`~controlplane.provisioning.provider_spot_prices`)."""
    launchable = None if provisioner is None else launchable_types(provisioner)
    return TrafficReplanner(
        store,
        clock,
        serving.observed_arrivals,
        stored_apps(resolver, launchable),
        check_s=settings.replan_s,
        window_s=settings.replan_window_s,
        hold_s=settings.replan_hold_s,
        band=ReplanBand(above=settings.replan_above, below=settings.replan_below),
        min_queries=settings.replan_min_queries,
        deadline_s=settings.plan_deadline_s,
        spot_prices=provider_spot_prices(provisioner),
    )


def stored_scales(store: Store) -> ScaleSource:
    """An app's calibrations from ``store``: a factor, or (factor, spread) where a spread was
    stored (none for an app not registered)."""

    def scales(app: str) -> dict[tuple[str, str], Calibrated]:
        try:
            return {
                (s.model, s.instance_type): (s.factor, s.spread) if s.spread else s.factor
                for s in store.list_profile_scales(app)
            }
        except NotFoundError:
            return {}

    return scales


def stored_overhead(store: Store) -> OverheadSource:
    """An app's measured control-plane overhead per query from ``store`` (None for an app not
    registered or not measured yet)."""

    def overhead(app: str) -> tuple[float, tuple[float, ...], float | None] | None:
        try:
            found = store.get_serving_overhead(app)
        except NotFoundError:
            return None
        return None if found is None else (found.overhead_ms, found.quantiles_ms, found.cpu_ms)

    return overhead


def build_calibrator(
    settings: Settings,
    store: Store,
    serving: ServingView,
    resolver: AppResolver,
    live_tuner: LiveTuner | None = None,
    also: Callable[[str], None] | None = None,
    clock: Clock | None = None,
) -> ProfileCalibrator:
    """The online calibration over the batch times the serving loop observes; it stores factors
    that ``resolver`` (built with :func:`stored_scales`) applies, and has ``live_tuner`` take the
    calibrated profiles at its next tick; ``also(app)`` is told too (a serving process apart,
    whose resolver forgets the app)."""
    observations = serving.observations

    def calibrated(app: str) -> None:
        resolver.invalidate(app)
        if also is not None:
            also(app)

    return ProfileCalibrator(
        store,
        observations.batch_times_ms,
        stored_apps(resolver),
        calibrated,
        observations.forget_batch_times,
        CalibrationRule(
            settings.calibration_min_batches,
            settings.calibration_threshold,
            settings.calibration_fine_threshold,
            settings.calibration_fine_min_batches,
            settings.calibration_fine_persist_s,
        ),
        observations.api_times_ms,
        resize=None if live_tuner is None else live_tuner.recalibrate,
        clock_s=None if clock is None else clock.now_s,
        serving_cpu=observations.serving_cpu_ms,
        reading=observations.holding,
        held=profile_runs_beside(store) if settings.provisioner == "local" else None,
        forget_api_times=observations.forget_api_times,
    )


def profile_runs_beside(store: Store) -> Callable[[], str | None]:
    """Why the calibration does not read batch times and the service's own times now: a profile
    run's worker is kept (the local provisioner runs it on the serving workers' own host, where
    its batches slow theirs and the serving process: the factor judged on them had stayed after
    the run). None: no run's worker is kept."""

    def held() -> str | None:
        rows = store.list_instances(
            states=[state.value for state in KEPT_STATES], request_prefix=PROFILE_REQUEST_PREFIX
        )
        if not rows:
            return None
        return f"{len(rows)} profile run worker(s) share the serving workers' host"

    return held


def build_scheduler(
    settings: Settings,
    store: Store,
    clock: Clock,
    reconciler: Reconciler | None = None,
    serving: ServingView | None = None,
    live_tuner: LiveTuner | None = None,
    live_gears: LiveGears | None = None,
    replanner: CapacityReplanner | None = None,
    calibrator: ProfileCalibrator | None = None,
    leadership: Leadership | None = None,
    traffic_replanner: TrafficReplanner | None = None,
    infaas_scaler: InfaasScaler | None = None,
    rollouts: RolloutLoop | None = None,
    spot_replanner: SpotReplanner | None = None,
) -> Scheduler:
    """The service's periodic jobs at the settings' periods (reconcile idles without a
    reconciler, and re-plans around missing capacity after its tick when there is a replanner,
    and at the spot prices now when there is a spot replanner;
    the roll-up records the serving loop's windows when there is one; the replan job idles
    without a traffic replanner). With ``leadership``, each job runs only while the replica holds
    the leader lease (its fence)."""
    window = serving.take_window if serving is not None else None
    rollup = make_rollup(
        store,
        clock,
        window=window,
        decision_retention_days=settings.decision_retention_days,
        decision_retention_count=settings.decision_retention_count,
        instance_retention_days=settings.instance_retention_days,
    )
    bodies = JobBodies(rollup=rollup)
    # A budget lowered under an app's fleet, seen by the tuner tick while the reconcile job ran
    # (which then skipped the tick's call): the job reconciles again after the step it is in,
    # rather than after its re-planners and rollouts (seconds, where one plans).
    cut_seen = threading.Event()
    if reconciler is not None:

        def reconcile_cut() -> None:
            if cut_seen.is_set():
                cut_seen.clear()
                _log_report(reconciler.run_once())

        def rollouts_tick() -> None:
            if rollouts is not None:
                for moved in rollouts.tick():
                    logger.info("rollout %s of %s: %s", moved.rollout_id, moved.app, moved.what)

        def reconcile() -> None:
            cut_seen.clear()  # the pass below sees every budget written before it
            if rollouts is not None:
                # The rollouts' workers are their loop's, alive here: a leader that has just
                # taken over (or a service just restarted) claims them before the reconciler
                # would take them for a dead profile run's (rule 8).
                rollouts.claim_workers()
            _log_report(reconciler.run_once())
            # The rollouts' tick after the reconciler moved their workers along their
            # lifecycle; a cut seen meanwhile is reconciled between the steps.
            for step in (
                replanner.tick if replanner is not None else None,
                spot_replanner.tick if spot_replanner is not None else None,
                rollouts_tick,
            ):
                if step is not None:
                    step()
                    reconcile_cut()

        bodies = dataclasses.replace(bodies, reconcile=reconcile)
    if live_tuner is not None:
        budgets: dict[str, float] = {}
        # A cut seen and not yet reconciled (the sub-loops raised, or a periodic reconcile was
        # running and the call was skipped): the next tick reconciles for it.
        cut_pending = False

        def tuner_tick() -> None:
            nonlocal cut_pending
            # One read of the apps for the whole tick: each sub-loop listing them again took
            # the serving process's interpreter for a transaction each, every second.
            apps = store.list_apps()
            cut = [a for a in apps if a.name in budgets and a.budget_usd_per_hr < budgets[a.name]]
            if any(
                billed_cost_usd_per_hr(store.list_instances(a.name, BILLED_STATES))
                > a.budget_usd_per_hr
                for a in cut
            ):
                # Lowered under what its fleet costs (a cut the fleet fits drains nothing).
                cut_pending = True
                cut_seen.set()
            budgets.clear()
            budgets.update((app.name, app.budget_usd_per_hr) for app in apps)
            try:
                sub_loops(apps)
            finally:
                if cut_pending and reconciler is not None:
                    # A budget lowered under the fleet: the tuner shed its fleet to it above,
                    # and the reconciler drains the rest now, through the scheduler's guarded
                    # reconcile job (within a tuner tick of the change, where its own period is
                    # 5 s; the serving process answered the change and records the drain, the
                    # loops process carries it out).
                    cut_pending = scheduler.jobs["reconcile"]() == "skipped"

        def sub_loops(apps: list[AppRecord]) -> None:
            for app, decision in live_tuner.tick(apps):
                logger.info("tuner %s: %s", app, decision.reason)
            if infaas_scaler is not None:
                for app, scaled in infaas_scaler.tick(apps):
                    logger.info("infaas %s: %s", app, scaled.reason)
            if live_gears is not None:
                # The store's side of the switcher; the gears job switches every 100 ms.
                live_gears.refresh(live_tuner.budget_capped, apps)
            if calibrator is not None:
                for drift in calibrator.tick(apps):
                    logger.info("calibration %s: %s", drift.app, drift.calibration)

        bodies = dataclasses.replace(bodies, tuner_tick=tuner_tick)
    if live_gears is not None:

        def gears() -> None:
            for change in live_gears.switch_tick():
                logger.info("gears: %s", change.reason)

        bodies = dataclasses.replace(bodies, gears=gears)
    if traffic_replanner is not None:

        def replan() -> None:
            traffic_replanner.tick()

        bodies = dataclasses.replace(bodies, replan=replan)
    if leadership is not None:
        bodies = leadership.fence(bodies)
    scheduler = Scheduler(service_schedule(settings, bodies))
    return scheduler


def build_leadership(settings: Settings, *, inference: bool = True) -> Leadership:
    """The replica's leader lease: a PostgreSQL advisory lock, an ``flock`` next to a SQLite
    file (the loops processes on it take turns as replicas do), or for an in-memory database
    the lone replica's lock (always held)."""
    lock: LeaderLock
    if settings.is_postgresql:
        lock = AdvisoryLock(settings.database_url)
    else:
        on_file = sqlite_leader_lock(settings.database_url)
        if on_file is not None:
            # Tried at once (without waiting): a service alone on its file holds the lease from
            # the start, as the lone replica always did; a standby tries again with the lease.
            on_file.try_acquire()
        lock = on_file or SoleLock()
    serves = "the API and inference" if inference else "the API (no inference: a loops process)"
    return Leadership(lock, serves=serves)


def _log_report(report: ReconcileReport) -> None:
    for app in report.apps.values():
        if app.actions or app.errors:
            logger.info(
                "reconcile %s: %d action(s), %d error(s)",
                app.app,
                len(app.actions),
                len(app.errors),
            )
        if app.errors:
            # What went wrong, not only how often (the first three, each cut to one line).
            shown = "; ".join(error.splitlines()[0][:300] for error in app.errors[:3] if error)
            more = f" (and {len(app.errors) - 3} more)" if len(app.errors) > 3 else ""
            logger.warning("reconcile %s: %s%s", app.app, shown, more)


def build_service(
    settings: Settings,
    clock: Clock | None = None,
    role: ServiceRole = "all",
    *,
    sole_serving: bool = True,
    url: str | None = None,
) -> Service:
    """Migrate the database and wire the service (nothing runs until the app is served):
    everything in one process (``role="all"``), or the serving path or the loops of a service
    whose two run apart (:data:`ServiceRole`), on PostgreSQL or on one SQLite file. A serving
    process on PostgreSQL holds the serving lock unless ``sole_serving`` is false (a replica's,
    as ``heteroplane serve`` runs it). ``url``: where this process listens; on PostgreSQL a
    process that serves inference then holds dispatch leases as it (or as the setting
    ``dispatch_url``), among the other serving processes (:class:`DispatchOwners`)."""
    clock = clock if clock is not None else SystemClock()
    check_served_database(settings)
    if role == "loops":
        _check_loops(settings)
    settings.ensure_data_dir()
    # First: a second serving process on a SQLite file, or a second ``--role serving`` process,
    # stops here, before it migrates anything. The loops beside a serving process on a SQLite
    # file share it (the leader lease keeps their jobs to one of them).
    database_lock = lock_sqlite_database(settings.database_url) if role != "loops" else None
    serving_lock = (
        _serving_lock(settings)
        if role == "serving" and sole_serving and settings.is_postgresql
        else None
    )
    try:
        with migration_lock(settings.database_url):
            migrate.upgrade(settings.database_url)
        store = Store.from_url(settings.database_url, clock)
    except BaseException:
        if serving_lock is not None:
            serving_lock.close()
        if database_lock is not None:
            database_lock.close()
        raise
    try:
        provisioner = build_provisioner(settings)
        leadership = (
            build_leadership(settings, inference=role != "loops") if role != "serving" else None
        )
    except BaseException:
        store.close()
        if serving_lock is not None:
            serving_lock.close()
        if database_lock is not None:
            database_lock.close()
        raise
    # One resolver for the serving loop and the background jobs: it is thread-safe, and its
    # cache (keyed by the spec) then loads each app's profile files once, not once per part.
    resolver = AppResolver(
        settings.data_dir,
        scales=stored_scales(store),
        overheads=stored_overhead(store),
        artifacts=store.get_model_version,
        measured=store.get_app_profiles,
    )
    if role == "serving":
        serving = ServingLoop(
            store, resolver, ProvisionedInstances(store, provisioner), clock=clock
        )
        gear_table = GearTable(store)
        gear_table.resume()  # the gears the log names, until the loops process sends them
        serving.gears = gear_table.gear
        # The rollouts' routes as the database says (the loops process moves the rollouts).
        routes = RolloutLoop(store, resolver, provisioner, clock, serving.versions)
        serving.routes = routes.route
        serving.route_refresh = routes.refresh_routes
        app = create_app(
            settings,
            store,
            clock,
            serving=serving,
            resolver=resolver,
            provisioner=provisioner,
            gear_table=gear_table,
            owners=_dispatch_owners(settings, store, clock, url),
        )
        # Never started: a serving process runs no periodic job.
        idle = Scheduler(service_schedule(settings, JobBodies()))
        return Service(
            settings,
            store,
            idle,
            app,
            provisioner,
            None,
            serving,
            database_lock=database_lock,
            role=role,
            serving_lock=serving_lock,
        )
    assert leadership is not None
    remote: RemoteServing | None = None
    view: ServingView
    if role == "loops":
        assert settings.serving_url is not None and settings.internal_token is not None
        remote = RemoteServing(
            settings.serving_url, settings.internal_token, clock, pull_s=settings.loops_pull_s
        )
        view = remote
        local_serving = None
    else:
        local_serving = ServingLoop(
            store, resolver, ProvisionedInstances(store, provisioner), clock=clock
        )
        view = local_serving
    # What the loops size and plan names only types the provisioner launches.
    launchable = launchable_types(provisioner)
    live_tuner = build_live_tuner(settings, store, clock, view, resolver, launchable)
    infaas_scaler = build_infaas_scaler(settings, store, clock, view, resolver, launchable)
    live_gears = build_live_gears(settings, store, clock, view, resolver)
    rollouts = RolloutLoop(
        store,
        resolver,
        provisioner,
        clock,
        view.versions,
        disruption=disruption_budget(settings),
        profiling=(
            NewVersionProfiling(
                provisioner,
                clock,
                DEFAULT_WORKER_PORT,
                heartbeat_s=settings.profile_run_heartbeat_s,
            )
            if settings.rollout_profile_run
            else None
        ),
        plan_deadline_s=settings.plan_deadline_s,
        spot_prices=provider_spot_prices(provisioner),
    )
    if local_serving is not None:
        local_serving.gears = _either_gear(live_gears.gear, live_tuner.gear)
        local_serving.routes = rollouts.route
        local_serving.route_refresh = rollouts.refresh_routes
    if remote is not None:
        remote.gears = live_gears.in_force
        remote.batch_caps = live_tuner.batch_caps
    gears_by_lease(live_gears, leadership, remote)
    reconciler = build_reconciler(
        store,
        clock,
        provisioner,
        resolver,
        scaled_fleet(live_tuner, infaas_scaler),
        disruption=disruption_budget(settings),
        profile_run_heartbeat_s=settings.profile_run_heartbeat_s,
        spot_headroom_share=settings.spot_headroom_share,
        liveness=worker_liveness(settings),
        spot_return_hold_s=settings.spot_return_hold_s,
    )
    # A spot price rise past the budget moves the gear as a budget cut does (docs/spot.md).
    live_gears.spot_prices = reconciler.spot_prices_now
    # INFaaS's drain waits for the one the reconciler still holds back, not for what serves
    # beside the fleet (a spot move's, an interruption's replacements, a stand-in).
    infaas_scaler.held_back = reconciler.held_back
    replanner = CapacityReplanner(
        store,
        stored_apps(resolver, launchable),
        reconciler.capacity_misses,
        after_s=settings.capacity_replan_after_s,
        deadline_s=settings.plan_deadline_s,
        spot_prices=provider_spot_prices(provisioner),
    )
    calibrator = build_calibrator(
        settings,
        store,
        view,
        resolver,
        live_tuner,
        also=remote.recalibrated if remote is not None else None,
        clock=clock,
    )
    traffic_replanner = (
        build_traffic_replanner(settings, store, clock, view, resolver, provisioner)
        if settings.replan_enabled
        else None
    )
    scheduler = build_scheduler(
        settings,
        store,
        clock,
        reconciler,
        view,
        live_tuner,
        live_gears,
        replanner,
        calibrator,
        leadership,
        traffic_replanner,
        infaas_scaler,
        rollouts,
        SpotReplanner(
            store,
            stored_apps(resolver, launchable),
            reconciler.spot_prices_now,
            move_share=settings.spot_replan_move_share,
            deadline_s=settings.plan_deadline_s,
        ),
    )
    # A drain to the budget moves a cascade's gear first, here too: a budget change taken by a
    # serving process reaches this one through the database alone.
    reconciler.before_budget_drain = live_gears.budget_changed
    # The API resolves through the same resolver, so a plan preview sees the calibrated profiles.
    # A loops process serves the API without inference (no serving loop: 503).
    app = create_app(
        settings,
        store,
        clock,
        scheduler,
        local_serving,
        resolver,
        leadership,
        budget_changed=live_gears.budget_changed,
        provisioner=provisioner,
        owners=_dispatch_owners(settings, store, clock, url) if local_serving is not None else None,
        serving_feed_down_s=remote.down_for_s if remote is not None else None,
    )
    if remote is not None:
        remote.start()
    return Service(
        settings,
        store,
        scheduler,
        app,
        provisioner,
        reconciler,
        local_serving,
        leadership,
        database_lock,
        live_tuner,
        role=role,
        remote=remote,
    )


def _dispatch_owners(
    settings: Settings, store: Store, clock: Clock, url: str | None
) -> DispatchOwners | None:
    """A serving process's dispatch leases on PostgreSQL, where several serving processes may
    share the database (docs/service.md, "Several serving processes"); none on SQLite (one
    serving process per file) or without an address to be reached at."""
    where = settings.dispatch_url or url
    if where is None or not settings.is_postgresql:
        return None
    return DispatchOwners(store, clock, where, probe=_dispatch_owner_at)


def _dispatch_owner_at(url: str) -> str | None:
    """The dispatcher id the serving process at ``url`` answers with (its ``/healthz``); None
    when nothing answers there, or something that is not a serving process of ours."""
    try:
        answer = httpx.get(f"{url}/healthz", timeout=2.0)
        found = answer.json().get("dispatch_owner") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else ""


def check_served_database(settings: Settings) -> None:
    """:class:`SettingsError` for a database the service cannot run on: an in-memory SQLite one
    (``sqlite://``, ``sqlite:///:memory:``).

    Every process (``heteroplane serve`` runs the API and the loops as two) and every connection
    (the migrations open their own) would see its own empty database: it was migrated on one
    connection and then found "not migrated" on the next, with the advice to run ``heteroplane
    db upgrade``, which migrates yet another. Migrating it through the store's one engine would
    serve in ``--one-process`` alone, on one connection shared by every thread, and lose
    everything at exit; a file (``sqlite:///PATH``) costs nothing more."""
    if is_in_memory_sqlite(settings.database_url):
        raise SettingsError(
            "database_url",
            f"{settings.database_url} is an in-memory SQLite database, which the service cannot"
            " run on: every process and connection would see its own empty database; use a"
            " file (sqlite:///PATH, the default under data_dir) or PostgreSQL",
        )


def _check_loops(settings: Settings) -> None:
    """What the loops need to run apart: where the serving process is and the token its
    internal routes take (the database both open: :func:`check_served_database`)."""
    if settings.serving_url is None or settings.internal_token is None:
        raise SettingsError(
            "serving_url",
            "role loops reads the serving process: set serving_url (HETEROPLANE_SERVING_URL)"
            " and internal_token (HETEROPLANE_INTERNAL_TOKEN, an admin token)",
        )


def _stop_serving() -> None:
    """The serving lock went to another serving process (this one was frozen past the lock
    session's idle timeout, and another started meanwhile): stop, as SIGTERM stops it, so that
    one serving process dispatches to the fleet, not two."""
    logger.error(
        "another serving process holds this database's serving lock now: this one stops (one"
        " serving process per database; docs/service.md, 'Serving apart from the loops')"
    )
    os.kill(os.getpid(), signal.SIGTERM)


def _serving_lock(settings: Settings) -> KeptLock:
    """The one serving process's lock of the database, kept while it runs (a second one is
    refused: several serving processes dispatching to one fleet are not supported yet)."""
    lock = KeptLock(
        AdvisoryLock(
            settings.database_url,
            SERVING_LOCK_KEY,
            application_name=SERVING_APPLICATION_NAME,
            what="serving lock",
        ),
        TRY_EVERY_S,
        "the serving process's lock of the database",
        on_lost=_stop_serving,
    )
    if not lock.start():
        lock.close()
        raise DatabaseError(
            "another serving process already serves this database; several serving processes"
            " are not supported yet (docs/service.md, 'Serving apart from the loops')"
        )
    return lock
