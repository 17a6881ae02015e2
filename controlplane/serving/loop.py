"""The serving loop of the service: one :class:`~controlplane.serving.dispatcher.AppDispatcher`
per app, kept in step with the store and the fleet, started and stopped with the API.

:class:`ServingLoop` owns

- the dispatchers, made on an app's first request (or status read) from its stored spec,
  resolved against its profiles, catalog and validation records, and its applied plan's stages,
  each model spoken to through the signature of its artifact (the demo family's without one)
  and the certainty kind its spec names (:func:`load_config`, :func:`model_io`);
- a background task that every ``refresh_s`` re-reads, for each app it serves, the app's version
  and applied plan (a change rebuilds the configuration in place: queues carry over) and its
  running workers (:class:`~controlplane.serving.workers.InstanceSource`), and probes the
  workers marked unhealthy; an app deleted meanwhile is dropped. A request for an app with no
  worker known reads the fleet at once instead of waiting for the next refresh;
- the transport (one kept-alive connection pool for all apps), the INFaaS state tracker and the
  observations (:mod:`controlplane.serving.observations`) that the roll-up job and ``/metrics``
  read (:meth:`ServingLoop.take_window`);
- a record of each worker marked unhealthy as a ``worker_unhealthy`` decision of its app (the
  dashboard's events), written off the event loop, with how many queries were in flight on it
  then and how many of them were re-dispatched or failed
  (:class:`~controlplane.serving.dispatcher.WorkerLoss`).

Reads of the store and the provider are blocking I/O: they run in threads
(``asyncio.to_thread``), never on the event loop that serves the API and the dispatchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controlplane.apps.resolver import AppResolver
from controlplane.clock import Clock, SystemClock
from controlplane.db.store import Store
from controlplane.errors import ControlPlaneError, NotFoundError, ServingUnavailableError
from controlplane.policies.gears import GearPlan
from controlplane.policies.load_balance import instance_memory_mb, model_memory_mb
from controlplane.policies.plan import PlanDocument
from controlplane.policies.variants import Requirements
from controlplane.serving.canary import split_infer
from controlplane.serving.collector import FullCollections
from controlplane.serving.dispatcher import (
    AppConfig,
    AppDispatcher,
    AppStatus,
    DispatcherSettings,
    InferResult,
    ServingGear,
    StagePlan,
    WorkerLoss,
)
from controlplane.serving.modelio import ModelIO, Row
from controlplane.serving.observations import Observations, WindowSummary
from controlplane.serving.states import StateTracker
from controlplane.serving.transport import HttpWorkerTransport, WorkerTransport
from controlplane.serving.versions import CanaryRoute, VersionMeter
from controlplane.serving.workers import InstanceSource
from controlplane.spec import ResolvedApp, SpecError
from estimator.cascades import Cascade
from estimator.errors import EstimatorError
from matching.assignment import load_solver

__all__ = [
    "DEFAULT_REFRESH_S",
    "GearHook",
    "RouteHook",
    "ServingLoop",
    "ServingSettings",
    "load_config",
    "model_io",
]

logger = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 1.0
# How long a canary dispatcher whose route went may take to answer what it holds before it
# closes (what is left then is answered with an error): within the rollout loop's grace before
# it ends the workers (controlplane.loops.rollouts.ROUTE_GRACE_S).
RETIRE_S = 4.0

# The gear switcher's hook: the gear in force for an app (None: the app's own cascade).
GearHook = Callable[[str], ServingGear | None]
# The rollout loop's hook: where an app's queries go while a rollout moves them (None: no
# rollout moves them now). Read per query: it must be a dictionary look-up, not I/O.
RouteHook = Callable[[str], CanaryRoute | None]


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """How often the fleet is re-read, how long a health probe may take, and the dispatchers'
    own settings."""

    refresh_s: float = DEFAULT_REFRESH_S
    probe_timeout_s: float = 0.5
    dispatcher: DispatcherSettings = field(default_factory=DispatcherSettings)


def _version(store: Store, app: str, resolver: AppResolver) -> tuple[object, ...]:
    """What the dispatcher's configuration of ``app`` was read from: its spec's version, its
    applied plan and its calibrations (:meth:`AppResolver.generation`)."""
    generation = resolver.generation(app)
    record = store.get_app(app)
    plan = store.get_applied_plan(app)
    return (record.version, plan.id if plan is not None else None, generation)


def load_config(store: Store, resolver: AppResolver, app: str) -> AppConfig:
    """The dispatcher's configuration of ``app`` from its stored spec and applied plan
    (blocking). A cascade with thresholds serves as given; a cascade without them answers with
    its last model (the most accurate) until a gear says otherwise; a single model is the
    cascade of one.

    Raises:
        NotFoundError: no such app.
        ServingUnavailableError: the spec no longer resolves (a profile file gone).
    """
    generation = resolver.generation(app)  # before the resolve: a drift meanwhile reads again
    record = store.get_app(app)
    plan = store.get_applied_plan(app)
    try:
        resolved = resolver.resolve(record.spec, check_budget=False)
    except EstimatorError as error:
        raise ServingUnavailableError(app, f"its spec does not resolve: {error}") from None
    spec = resolved.spec
    models = tuple(spec.serving_order)
    cascade = resolved.cascade or Cascade((models[-1],), ())
    profiles = {
        model: {t: resolved.profile(model, t) for t in resolved.instance_types} for model in models
    }
    try:
        ios = {model: model_io(resolved, model) for model in models}
    except ValueError as error:  # a signature or certainty kind the dispatcher cannot serve
        raise ServingUnavailableError(app, str(error)) from None
    stage_plans: dict[str, StagePlan] = {}
    if plan is not None:
        for stage in plan.plan.stages:
            if stage.name in models:
                stage_plans[stage.name] = stage
    return AppConfig(
        **placement_inputs(resolved, plan.plan if plan is not None else None, models),
        name=app,
        slo_ms=float(spec.slo.latency_ms),
        slo_percentile=float(spec.slo.percentile),
        stage_slo_ms=float(resolved.constraints.stage_slo_ms),
        models=models,
        cascade=cascade,
        profiles=profiles,
        prices_usd_per_hr=dict(resolved.prices_usd_per_hr),
        validation=resolved.validation,
        stage_plans=stage_plans,
        version=(record.version, plan.id if plan is not None else None, generation),
        io=ios,
    )


def placement_inputs(
    resolved: ResolvedApp, plan: PlanDocument | None, models: Sequence[str]
) -> dict[str, Any]:
    """What the cascade placement (:mod:`controlplane.policies.load_balance`) needs of an app:
    its plan's rate and gear plan (None when the document is not one: the placement then
    serves the planned rate), each model's memory (the spec's ``memory_mb``, else twice its
    artifact's size, else the demo family's default) and each candidate type's memory for
    models (:func:`~controlplane.policies.load_balance.instance_memory_mb`; a type the catalog
    gives no memory has no limit)."""
    gear_plan = None
    if plan is not None and plan.gear_plan is not None:
        with contextlib.suppress(EstimatorError):
            gear_plan = GearPlan.from_document(plan.gear_plan)
    given = {entry.name: entry.memory_mb for entry in resolved.spec.models}
    artifacts = resolved.artifacts
    model_memory = {
        m: model_memory_mb(given.get(m), artifacts[m].size_bytes if m in artifacts else None)
        for m in models
    }
    instance_memory: dict[str, float] = {}
    for name in resolved.instance_types:
        found = resolved.catalog.get(name)
        if found is not None:
            memory = instance_memory_mb(found.memory_gib, found.gpus, found.gpu_memory_gib)
            if math.isfinite(memory):
                instance_memory[name] = memory
    return {
        "planned_rate_qps": plan.rate_qps if plan is not None else 0.0,
        "gear_plan": gear_plan,
        "model_memory_mb": model_memory,
        "instance_memory_mb": instance_memory,
    }


def model_io(resolved: object, model: str) -> ModelIO:
    """How the dispatcher talks to ``model`` of a resolved app: the signature of its artifact
    (``resolved.artifacts``), else the demo family's; the certainty kind its spec names."""
    artifacts = getattr(resolved, "artifacts", None) or {}
    certainty_of = getattr(resolved, "certainty", None)
    artifact = artifacts.get(model)
    if artifact is not None:
        return ModelIO(model, artifact.signature, artifact.certainty, family=False)
    certainty = certainty_of(model) if callable(certainty_of) else "margin"
    return ModelIO(model, certainty=certainty, family=True)


class ServingLoop:
    """Every app's dispatcher on the API's event loop (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        resolver: AppResolver,
        instances: InstanceSource,
        *,
        transport: WorkerTransport | None = None,
        clock: Clock | None = None,
        settings: ServingSettings | None = None,
        gears: GearHook | None = None,
        observations: Observations | None = None,
        routes: RouteHook | None = None,
        versions: VersionMeter | None = None,
    ) -> None:
        self.store = store
        self.resolver = resolver
        self.instances = instances
        self.transport: WorkerTransport = transport or HttpWorkerTransport()
        self.clock: Clock = clock or SystemClock()
        self.settings = settings or ServingSettings()
        self.gears = gears
        self.observations = observations or Observations()
        self.tracker = StateTracker()
        self.routes = routes
        # Re-reads the routes (blocking: run in a thread at each refresh), so that a replica
        # whose rollout loop does not run still splits traffic as the database says.
        self.route_refresh: Callable[[], None] | None = None
        self.versions = versions or VersionMeter()
        # app -> (rollout id, the dispatcher of the rollout's workers): controlplane.serving.canary.
        self._canaries: dict[str, tuple[int, AppDispatcher]] = {}
        # Canary dispatchers whose route went, answering what they hold before they close.
        self._retiring: set[AppDispatcher] = set()
        self._request_ids = itertools.count()
        self._canary_lock = asyncio.Lock()
        self._dispatchers: dict[str, AppDispatcher] = {}
        self._snapshots: dict[str, AppStatus] = {}
        self._warned: dict[str, str] = {}  # app -> the refresh problem last logged
        self._routes_warned: str | None = None  # the rollouts' read problem last logged
        self._creating: dict[str, asyncio.Future[AppDispatcher]] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[object]] = set()
        self._running = False
        # Survivors of a full collection frozen at the next refresh (serving/collector.py).
        self._collections = FullCollections()

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        """Start the refresh task (on the running event loop).

        Also freezes the objects alive now (``gc.freeze``: the imported libraries, the app, the
        settings) out of the cyclic collector's reach: its full passes walked them all, and at
        2,000 queries per second a pass paused the loop for close to 100 ms
        (``python -m benchmarks.serving_speed dispatcher``); the objects of queries are young and
        die young. What becomes long-lived later (modules imported by the first plan, each app's
        dispatcher, the observations) is frozen after the full collection it survives
        (:class:`~controlplane.serving.collector.FullCollections`, at the next refresh).
        """
        if self._running:
            raise RuntimeError("the serving loop is already running")
        # The solvers a dispatch may call (the Kairos matching's assignment, a cascade's
        # placement LP: scipy.optimize, imported where they solve) are loaded now: a second of
        # CPU that must not fall on a query's turn of the event loop.
        load_solver()
        gc.collect()
        gc.freeze()
        self._collections.install()
        self._canary_lock = asyncio.Lock()  # of this event loop
        self._running = True
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def stop(self) -> None:
        """Stop refreshing, answer what is queued with an error, close the connections."""
        self._running = False
        self._collections.uninstall()
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        dispatchers, self._dispatchers = list(self._dispatchers.values()), {}
        dispatchers += [d for _, d in self._canaries.values()]
        dispatchers += list(self._retiring)
        self._canaries = {}
        self._snapshots = {}
        for dispatcher in dispatchers:
            await dispatcher.close()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.transport.close()

    # --- requests -------------------------------------------------------------------------------

    async def infer(
        self,
        app: str,
        inputs: Sequence[Row],
        sample_ids: list[int] | None = None,
        requirements: Requirements | None = None,
        received_s: float | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> InferResult:
        """Answer one inference request for ``app`` (raises the ServingError that says why
        not, :class:`NotFoundError` for an unknown app). ``deadline_s`` (the loop's clock): when
        its client stops waiting, if it said.

        ``received_s`` is when the API received the request, on the loop's clock (default: now):
        the query's latency runs from there, through making the dispatcher and reading the
        fleet, to its outcome. A query refused before it reaches a dispatcher because the app's
        spec no longer resolves is recorded as refused too: a miss, like every error (not while
        the loop is stopped: the name would not have been checked against the store).

        While a rollout moves the app's traffic (``routes``), ``request_id`` (the client's, else
        one of the loop's) says which version answers (:mod:`controlplane.serving.versions`).
        """
        received = self.clock.now_s() if received_s is None else received_s
        route = self.routes(app) if self.routes is not None else None
        if route is not None and requirements is None:
            rid = request_id if request_id is not None else f"loop-{next(self._request_ids)}"
            return await split_infer(
                self, app, route, rid, inputs, sample_ids, received, deadline_s
            )
        return await self.infer_on_spec_version(
            app, inputs, sample_ids, requirements, received, deadline_s
        )

    def refuse_early(
        self, app: str, received_s: float | None = None, *, plain: bool = False
    ) -> bool:
        """Raise the :class:`~controlplane.errors.OverloadedError` that a query of one sample
        for ``app`` would meet now (:meth:`AppDispatcher.refuse_early`, which says what
        ``plain`` and the answer mean: True, ask again with ``plain`` once the body shows no
        requirements), before its body is read; nothing where that cannot be told yet: no
        dispatcher made for the app, a rollout moving its traffic (its version decides which
        dispatcher judges the query)."""
        dispatcher = self._dispatchers.get(app)
        if dispatcher is None or (self.routes is not None and self.routes(app) is not None):
            return False
        return dispatcher.refuse_early(received_s, plain=plain)

    def refused_at_front(self, app: str) -> bool:
        """Record a query of ``app`` that the API's front refused (:meth:`AppDispatcher.
        refused_at_front`); False, nothing recorded, where the query must go on to be judged
        here: no dispatcher made for the app, a rollout moving its traffic (as
        :meth:`refuse_early`)."""
        dispatcher = self._dispatchers.get(app)
        if dispatcher is None or (self.routes is not None and self.routes(app) is not None):
            return False
        return dispatcher.refused_at_front()

    async def infer_on_spec_version(
        self,
        app: str,
        inputs: Sequence[Row],
        sample_ids: list[int] | None,
        requirements: Requirements | None,
        received: float,
        deadline_s: float | None,
    ) -> InferResult:
        """The query on the app's own dispatcher (the version its spec names)."""
        dispatcher = await self.dispatcher_for(app, received)
        if not dispatcher.workers():
            await self._refresh_app(app, dispatcher)
        return await dispatcher.infer(inputs, sample_ids, requirements, received, deadline_s)

    async def canary(self, app: str, route: CanaryRoute) -> AppDispatcher:
        """The dispatcher of ``app``'s rollout workers: the app's configuration (the new
        version takes and answers the same tensors: checked when the rollout started; a
        cascade's thresholds as the rollout re-derived them), its own observations (the
        queries it answers join the app's arrivals apart: ``canary.split_infer``), the
        rollout's workers only."""
        rollout_id = route.rollout_id
        found = self._canaries.get(app)
        if found is not None and found[0] == rollout_id:
            return found[1]
        async with self._canary_lock:  # the first query makes it; the others wait and use it
            found = self._canaries.get(app)
            if found is not None and found[0] == rollout_id:
                return found[1]
            if found is not None:
                del self._canaries[app]
                self._retire(found[1])
            return await self._make_canary(app, route)

    async def _make_canary(self, app: str, route: CanaryRoute) -> AppDispatcher:
        rollout_id = route.rollout_id
        config = await asyncio.to_thread(load_config, self.store, self.resolver, app)
        if route.thresholds is not None:
            cascade = Cascade(config.cascade.models, route.thresholds)
            config = dataclasses.replace(config, cascade=cascade)
        dispatcher = AppDispatcher(
            config,
            self.transport,
            Observations(),
            settings=self.settings.dispatcher,
            clock_s=self.clock.now_s,
            tracker=StateTracker(),
        )
        dispatcher.set_workers(await asyncio.to_thread(self._rollout_workers, app, rollout_id))
        self._canaries[app] = (rollout_id, dispatcher)
        return dispatcher

    def _rollout_workers(self, app: str, rollout_id: int) -> list[Any]:
        source = getattr(self.instances, "running_rollout", None)
        return list(source(app, rollout_id)) if source is not None else []

    async def _refresh_canary(self, app: str) -> None:
        found = self._canaries.get(app)
        if found is None:
            return
        rollout_id, dispatcher = found
        route = self.routes(app) if self.routes is not None else None
        if route is None or route.rollout_id != rollout_id:
            del self._canaries[app]
            self._retire(dispatcher)
            return
        dispatcher.set_workers(await asyncio.to_thread(self._rollout_workers, app, rollout_id))
        await dispatcher.probe(self.settings.probe_timeout_s)

    def _retire(self, dispatcher: AppDispatcher) -> None:
        """A canary dispatcher no query goes to any more answers the queries it holds, then
        closes (in the background; within :data:`RETIRE_S`): its route went, not its workers
        (the rollout loop ends them a grace later, ``controlplane.loops.rollouts``)."""
        self._retiring.add(dispatcher)
        task = asyncio.get_running_loop().create_task(dispatcher.retire(RETIRE_S))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda _: self._retiring.discard(dispatcher))

    async def dispatcher_for(self, app: str, received_s: float | None = None) -> AppDispatcher:
        """:meth:`dispatcher` for a query received at ``received_s``: when the app's spec no
        longer resolves, the query is recorded as refused before the error is raised (what the
        API reads before it submits, the app's model signatures, comes from here)."""
        try:
            return await self.dispatcher(app)
        except ServingUnavailableError:
            if not self._running:
                raise
            now = self.clock.now_s()
            received = now if received_s is None else received_s
            self.observations.arrival(app, now)
            self.observations.refused(app, now, max(now - received, 0.0) * 1000.0)
            raise

    async def unserved(self, app: str) -> str | None:
        """Why ``app`` cannot serve a query now (no healthy worker for a model of its gear), or
        None when it can (its fleet read at once when no worker is known yet)."""
        dispatcher = await self.dispatcher(app)
        if not dispatcher.workers():
            await self._refresh_app(app, dispatcher)
        return dispatcher.unserved()

    async def dispatcher(self, app: str) -> AppDispatcher:
        """The app's dispatcher, made (and its workers read) on first use."""
        if not self._running:
            raise ServingUnavailableError(app, "the serving loop is not running")
        found = self._dispatchers.get(app)
        if found is not None:
            return found
        pending = self._creating.get(app)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[AppDispatcher] = asyncio.get_running_loop().create_future()
        self._creating[app] = future
        try:
            config = await asyncio.to_thread(load_config, self.store, self.resolver, app)
            endpoints = await asyncio.to_thread(self.instances.running, app)
            dispatcher = AppDispatcher(
                config,
                self.transport,
                self.observations,
                settings=self.settings.dispatcher,
                clock_s=self.clock.now_s,
                gear=self._gear_of(app),
                tracker=self.tracker,
                on_unhealthy=self._recorder(app),
            )
            dispatcher.set_workers(endpoints)
            self._dispatchers[app] = dispatcher
            future.set_result(dispatcher)
            return dispatcher
        except Exception as error:
            future.set_exception(error)
            future.exception()  # retrieved: waiters get it through their own await
            raise
        except BaseException:
            future.cancel()
            raise
        finally:
            del self._creating[app]

    def _gear_of(self, app: str) -> Callable[[], ServingGear | None] | None:
        hook = self.gears
        if hook is None:
            return None
        return lambda: hook(app)

    def _recorder(self, app: str) -> Callable[[WorkerLoss], None]:
        def record(loss: WorkerLoss) -> None:
            endpoint = loss.endpoint
            numbers = {
                "instance_id": endpoint.instance_id,
                "instance_type": endpoint.instance_type,
                "address": endpoint.address,
                "in_flight_queries": loss.in_flight_queries,
                "redispatched_queries": loss.redispatched_queries,
                "failed_queries": loss.failed_queries,
            }
            reason = (
                f"worker {endpoint.instance_id} taken out of matching: {loss.reason};"
                f" {loss.in_flight_queries} queries in flight on it:"
                f" {loss.redispatched_queries} re-dispatched, {loss.failed_queries} failed"
            )

            def write() -> None:
                try:
                    self.store.record_decision(app, "worker_unhealthy", reason, numbers)
                except ControlPlaneError as error:
                    logger.warning("%s: cannot record worker_unhealthy: %s", app, error)

            task: asyncio.Task[object] = asyncio.get_running_loop().create_task(
                asyncio.to_thread(write)
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        return record

    # --- refresh --------------------------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            try:
                await self.refresh()
            except Exception:  # the loop must outlive a bad refresh: log it and go on
                logger.exception("serving refresh failed")
            self._collections.step()

    async def refresh(self) -> None:
        """Re-read every served app's configuration and workers, and probe the unhealthy ones."""
        if self.route_refresh is not None:
            try:
                await asyncio.to_thread(self.route_refresh)
            except ControlPlaneError as error:  # the routes stay as they were
                # Once per cause, as an app's refresh problem: a database down for an hour
                # logged this line every second of it.
                if self._routes_warned != str(error):
                    self._routes_warned = str(error)
                    logger.warning("serving refresh: cannot read the rollouts: %s", error)
            else:
                if self._routes_warned is not None:
                    self._routes_warned = None
                    logger.info("serving refresh: reads the rollouts again")
        # Concurrently: a worker that does not answer its probe holds up its own app only.
        apps = list(self._dispatchers.items())
        outcomes = await asyncio.gather(
            *(self._refresh_app(app, d) for app, d in apps), return_exceptions=True
        )
        for (app, _), outcome in zip(apps, outcomes, strict=True):
            if isinstance(outcome, Exception):
                logger.error("%s: serving refresh failed", app, exc_info=outcome)

    async def _refresh_app(self, app: str, dispatcher: AppDispatcher) -> None:
        try:
            version = await asyncio.to_thread(_version, self.store, app, self.resolver)
            if version != dispatcher.config.version:
                config = await asyncio.to_thread(load_config, self.store, self.resolver, app)
                dispatcher.reconfigure(config)
            endpoints = await asyncio.to_thread(self.instances.running, app)
        except NotFoundError:
            if self._dispatchers.get(app) is dispatcher:
                del self._dispatchers[app]
                self._snapshots.pop(app, None)
                await dispatcher.close()
            return
        except (ControlPlaneError, SpecError, EstimatorError) as error:
            # The app keeps its configuration (a spec naming a type its models have no profiles
            # on yet, say): one line per cause, not a traceback every second.
            if self._warned.get(app) != str(error):
                self._warned[app] = str(error)
                logger.warning("%s: serving refresh: %s", app, error)
            return
        self._warned.pop(app, None)
        dispatcher.set_workers(endpoints)
        await dispatcher.probe(self.settings.probe_timeout_s)
        self._snapshots[app] = dispatcher.status()
        await self._refresh_canary(app)

    # --- what others read -----------------------------------------------------------------------

    async def status(self, app: str) -> AppStatus:
        dispatcher = await self.dispatcher(app)
        return dispatcher.status()

    def statuses(self) -> list[AppStatus]:
        """The status of every app served so far as of its last refresh (thread-safe: what
        ``/metrics`` reads from its worker thread)."""
        snapshots = dict(self._snapshots)
        return [snapshots[app] for app in sorted(snapshots)]

    def served_apps(self) -> list[str]:
        """The apps the loop has a dispatcher for (it observes their traffic), by name."""
        return sorted(self._dispatchers)

    def served(self, app: str) -> AppDispatcher | None:
        """The app's dispatcher when the loop has made it (no I/O)."""
        return self._dispatchers.get(app)

    def serves(self, app: str) -> bool:
        """Whether the loop has a dispatcher for ``app`` (it observes the app's traffic)."""
        return app in self._dispatchers

    def observed_arrivals(self, app: str) -> NDArray[np.float64] | None:
        """:meth:`arrivals` for an app the loop serves, ``None`` for one it does not (the live
        tuner then leaves the app on its plan rather than reading silence as no load)."""
        return self.arrivals(app) if self.serves(app) else None

    def arrivals(self, app: str) -> NDArray[np.float64]:
        """The app's recent arrival times on the clock's ``now_s`` (oldest first): the live
        tuner's arrival source (``controlplane.loops.live_tuner.ArrivalSource``). Thread-safe."""
        return self.observations.arrival_s(app)

    def take_window(self, app: str) -> WindowSummary | None:
        """The app's serving window since the last call (thread-safe: the roll-up job's), with
        its SLO and the gear in force; None when the app was never served."""
        dispatcher = self._dispatchers.get(app)
        if dispatcher is None:
            return None
        config = dispatcher.config
        # The gear in force now, not at the last arrival: at no load the switcher moves back to
        # the most accurate gear, and the window (the dashboard's gear) kept the one the last
        # query of a burst was served by for as long as none came.
        gear = dispatcher.current_gear().cascade.label
        return self.observations.take_window(app, self.clock.now_s(), config.slo_ms, gear)
