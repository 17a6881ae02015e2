"""The service's composition root: settings -> database -> store -> scheduler -> API.

:func:`build_service` is what ``heteroplane serve`` runs (and what a test that wants the whole
service in-process calls): it creates the data directory, migrates the database to the newest
revision, opens the store on the clock, and builds the scheduler with the job bodies there are
so far (the metric roll-up; the tuner, reconciler and replan bodies are the scheduler's idle
defaults until their issues land) and the FastAPI app around them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from controlplane.api import create_app
from controlplane.clock import Clock, SystemClock
from controlplane.db import migrate
from controlplane.rollup import make_rollup
from controlplane.scheduler import JobBodies, Scheduler, service_schedule
from controlplane.settings import Settings
from controlplane.store import Store

__all__ = ["Service", "build_scheduler", "build_service"]


@dataclass(frozen=True, slots=True)
class Service:
    """The running service's parts; :meth:`close` releases the database."""

    settings: Settings
    store: Store
    scheduler: Scheduler
    app: FastAPI

    def close(self) -> None:
        self.scheduler.shutdown(wait=True)
        self.store.close()


def build_scheduler(settings: Settings, store: Store, clock: Clock) -> Scheduler:
    """The service's periodic jobs at the settings' periods."""
    bodies = JobBodies(rollup=make_rollup(store, clock))
    return Scheduler(service_schedule(settings, bodies))


def build_service(settings: Settings, clock: Clock | None = None) -> Service:
    """Migrate the database and wire the service (nothing runs until the app is served)."""
    clock = clock if clock is not None else SystemClock()
    settings.ensure_data_dir()
    migrate.upgrade(settings.database_url)
    store = Store.from_url(settings.database_url, clock)
    scheduler = build_scheduler(settings, store, clock)
    return Service(settings, store, scheduler, create_app(settings, store, clock, scheduler))
