"""The service's composition root: settings -> database -> store -> provisioner -> reconciler ->
scheduler -> API.

:func:`build_service` is what ``heteroplane serve`` runs (and what a test that wants the whole
service in-process calls): it creates the data directory, migrates the database to the newest
revision, opens the store on the clock, builds the provisioner the settings name
(:func:`controlplane.provisioning.build_provisioner`) and the :class:`~controlplane.reconciler.
Reconciler` over it, and the scheduler with the job bodies there are so far (the reconcile tick
and the metric roll-up; the tuner and replan bodies are the scheduler's idle defaults until their
issues land) and the FastAPI app around them.

The reconciler learns each app's prices and Q_t (for the budget guard's ranking) from the app's
resolved spec (:func:`spec_pricing`), and which types it may launch from the provisioner: the
local provisioner runs only the emulated types (``emu.*``, and ``local.cpu``), so a plan naming
EC2 types is not launched under it (one ``plan_not_launched`` decision says so).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from fastapi import FastAPI

from controlplane.api import create_app
from controlplane.api.resolver import AppResolver, smallest_common_batch_size
from controlplane.budget import qps_by_type
from controlplane.clock import Clock, SystemClock
from controlplane.db import migrate
from controlplane.provisioning import build_provisioner
from controlplane.reconciler import (
    AppPricing,
    LaunchableFn,
    PricingFn,
    Reconciler,
    ReconcileReport,
)
from controlplane.rollup import make_rollup
from controlplane.scheduler import JobBodies, Scheduler, service_schedule
from controlplane.settings import Settings
from controlplane.store import AppRecord, Store
from estimator.catalog import default_catalog
from estimator.errors import EstimatorError
from provisioners.base import Provisioner
from provisioners.local import LocalProvisioner

__all__ = [
    "Service",
    "build_reconciler",
    "build_scheduler",
    "build_service",
    "launchable_types",
    "spec_pricing",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Service:
    """The running service's parts; :meth:`close` releases the database."""

    settings: Settings
    store: Store
    scheduler: Scheduler
    app: FastAPI
    provisioner: Provisioner
    reconciler: Reconciler

    def close(self) -> None:
        """Stop the jobs and release the database. The provisioner's instances are left running
        (a restarted service finds them again by their tags)."""
        self.scheduler.shutdown(wait=True)
        if isinstance(self.provisioner, LocalProvisioner):
            self.provisioner.close()
        self.store.close()


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
            return AppPricing(prices, qps_by_type(resolved, smallest_common_batch_size(resolved)))
        except EstimatorError as error:
            if (app.name, app.version) not in warned:
                warned.add((app.name, app.version))
                logger.warning("app %s: priced from the default catalog: %s", app.name, error)
            return fallback

    return pricing


def launchable_types(provisioner: Provisioner) -> LaunchableFn:
    """Which instance types ``provisioner`` can launch: the local one only those it emulates;
    the others every type (a type EC2 does not know fails at launch, as a decision)."""
    if not isinstance(provisioner, LocalProvisioner):
        return lambda _instance_type: None
    runs = frozenset(provisioner.catalog_speed)
    why = "the local provisioner emulates only emu.* types"

    def launchable(instance_type: str) -> str | None:
        return None if instance_type in runs else why

    return launchable


def build_reconciler(
    settings: Settings, store: Store, clock: Clock, provisioner: Provisioner
) -> Reconciler:
    """The reconciler over ``provisioner``, pricing apps from their specs."""
    return Reconciler(
        store,
        provisioner,
        clock,
        spec_pricing(AppResolver(settings.data_dir)),
        launchable=launchable_types(provisioner),
    )


def build_scheduler(
    settings: Settings, store: Store, clock: Clock, reconciler: Reconciler | None = None
) -> Scheduler:
    """The service's periodic jobs at the settings' periods (reconcile idles without a
    reconciler)."""
    bodies = JobBodies(rollup=make_rollup(store, clock))
    if reconciler is not None:

        def reconcile() -> None:
            _log_report(reconciler.run_once())

        bodies = dataclasses.replace(bodies, reconcile=reconcile)
    return Scheduler(service_schedule(settings, bodies))


def _log_report(report: ReconcileReport) -> None:
    for app in report.apps.values():
        if app.actions or app.errors:
            logger.info(
                "reconcile %s: %d action(s), %d error(s)",
                app.app,
                len(app.actions),
                len(app.errors),
            )


def build_service(settings: Settings, clock: Clock | None = None) -> Service:
    """Migrate the database and wire the service (nothing runs until the app is served)."""
    clock = clock if clock is not None else SystemClock()
    settings.ensure_data_dir()
    migrate.upgrade(settings.database_url)
    store = Store.from_url(settings.database_url, clock)
    try:
        provisioner = build_provisioner(settings)
    except BaseException:
        store.close()
        raise
    reconciler = build_reconciler(settings, store, clock, provisioner)
    scheduler = build_scheduler(settings, store, clock, reconciler)
    app = create_app(settings, store, clock, scheduler)
    return Service(settings, store, scheduler, app, provisioner, reconciler)
