"""The rollout loop (docs/rollouts.md): each tick moves every active rollout one step of its
life, writing the store before it acts, so a restart (or a new leader) picks up where the
database says it was.

Per rollout, each tick:

0. **Profile and plan** (a rollout started with ``settings.profile_run``, before anything
   else): the start returned at once; the new version is profiled on the app's candidate types
   and the app planned again for it (:func:`~controlplane.apps.rollouts.profile_and_plan`) in a
   thread of this loop, the rollout ``pending`` meanwhile. Its result (``settings.profiled``,
   ``settings.stage_fleet``) is written before anything acts on it; a run that dies with its
   process is run again by the next leader (the dead run's workers are the reconciler's to
   reap). A run the budget cannot pay for waits (an interval, then again); one that fails, or
   a new version that cannot be planned, rolls the rollout back before traffic.
1. **Workers.** The rollout's extra instances (``settings.extra_fleet``) are rows of the app
   under request ids ``rollout_request_prefix(app, id) + started-type-n`` (``started`` the rollout's
   start time, base 36, so a rollout id that SQLite gives again after an app is made anew names new
   workers; recorded before the provider is asked: idempotent), launched with the new version served
   under the model's name; their rows are touched (the reconciler keeps them out of the fleet, in
   the budget, and ends them once untouched: rule 8). A row that failed rolls the rollout back (the
   new version cannot start). The extra fleet is granted step by step (``settings.extra_fleet``,
   sized by :func:`~controlplane.policies.rollout.step_fleet` from the stage fleet at the step's
   share): the first step's before its workers launch, each next step's before the step moves; a
   grant the budget cannot pay for next to what the app runs waits (the rollout holds, a ``rollout``
   decision says how much it needs).
2. **Pending -> running** once every worker runs: the first step begins (its clock starts).
3. **Judgement** of a running step (:func:`controlplane.policies.rollout.judge`) on the new
   version's figures over the step (:class:`~controlplane.serving.versions.VersionMeter`):
   hold (figures stored), promote (next step, its clock starts), roll back (at once: the route
   goes, every query back on the old version), or complete: the app's spec is pinned to the new
   version and the rollout is ``promoted``.
4. **Handover** after promotion: the new version's workers answer every query while the old
   version's instances (the app's fleet recorded before the promotion) are ended; the
   reconciler launches their replacements, which load the version the spec now names; once as
   many replacements run as were ended (or fewer, once the fleet has settled: the app scaled
   down meanwhile, :data:`FLEET_SETTLE_S`), and the last old instance ended at least
   :data:`ROUTE_GRACE_S` ago, the route goes and the rollout's workers end. Once none of them
   is billed any more, the app is planned again as it now is, once per promotion, and the plan
   applied where it changes what the app serves with (:meth:`RolloutLoop._plan_again`): the
   reconciler then moves the fleet to it with the budget the rollout's workers held.
   **Nothing serving ends with its route**: a worker ends :data:`ROUTE_GRACE_S` after the
   route that sent it queries changed (the old version's instances that long after the
   promotion, the rollout's own that long after the route went at a roll-back, an abort or
   the handover's end), so that every serving process has read the new route and the queries
   already sent are answered (a query in flight on a worker that ends fails: nothing else of
   its stage may be there to take it again); and **no route sends queries back to a fleet an
   instance just left**: the handover's route goes a grace after its last ended instance, once
   every serving process has read the fleet without it.
5. **Routes** (:meth:`RolloutLoop.route`, the serving loop's hook): running and paused rollouts
   split traffic at their step; a promoted one in handover sends everything to the new version.

Every move is a ``rollout`` decision with its reason, written in the move's transaction
(``said``): a crash leaves both or neither.
"""

from __future__ import annotations

import http.client
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from controlplane.apps.plans import apply_plan, burstiness_replanning_request, preview_plan
from controlplane.apps.profile_run import end_workers, ended_reason, launch_worker, random_inputs
from controlplane.apps.profiler import WorkerClient
from controlplane.apps.resolver import AppResolver
from controlplane.apps.rollouts import (
    DECISION_KIND,
    WATCH_S,
    NewVersionProfiling,
    budget_shortfall,
    fleet_cost,
    fleet_text,
    planned_text,
    profile_and_plan,
    stage_fleet,
)
from controlplane.apps.teardown import teardown_requested
from controlplane.clock import Clock
from controlplane.crashpoints import crash_point
from controlplane.db.store import InstanceRecord, RolloutRecord, Store
from controlplane.db.store.rollouts import Said
from controlplane.errors import (
    ConflictError,
    ControlPlaneError,
    InvalidValueError,
    ProfilesNotMeasuredError,
    ProfilingBudgetError,
    RolloutBudgetError,
    first_line,
)
from controlplane.loops.capacity_replan import DEFAULT_PLAN_DEADLINE_S
from controlplane.loops.reconciler import DEFAULT_LAUNCH_BACKOFF_S
from controlplane.policies.disruption import DisruptionBudget, count_disruptions
from controlplane.policies.lifecycle import (
    BILLED_STATES,
    KEPT_STATES,
    LIVE_STATES,
    InstanceState,
    is_profile_worker,
)
from controlplane.policies.plan import PlanDocument
from controlplane.policies.rollout import (
    RolloutState,
    Thresholds,
    Verdict,
    VersionFigures,
    judge,
    rollout_request_prefix,
    step_fleet,
)
from controlplane.policies.spot import SpotPricesFn
from controlplane.serving.versions import CanaryRoute, VersionSource
from controlplane.serving.workers import DEFAULT_WORKER_PORT
from controlplane.spec import SpecError
from estimator.errors import EstimatorError
from estimator.fleet import nonzero
from estimator.numbers import plain
from estimator.profiles import PROFILE_FORMAT
from provisioners.base import APP_TAG, Provisioner, with_port
from provisioners.errors import ProvisionerError

__all__ = ["RECENT_S", "RolloutLoop", "RolloutTick"]

logger = logging.getLogger(__name__)

# Before traffic, the new version is timed alone on each of its workers: this many calls of one
# sample, after a few not kept (a fresh runtime's first calls are slow).
ALONE_WARMUP = 3
ALONE_CALLS = 20

# How long after its last move a finished rollout is still looked at (its workers ending, a
# handover going on): the start of a rollout reads the same (handing_over).
RECENT_S = WATCH_S

# How long a worker keeps running after the route that sent it queries changed (module
# docstring, step 4): the serving loops read the routes every second (DEFAULT_REFRESH_S), and a
# query already on a worker is answered within a call's timeout (2 s at the least, the
# dispatcher's floor; longer only for a batch predicted slower); with room for a busy machine.
ROUTE_GRACE_S = 5.0

# How long after the handover's last ended instance left a fleet with fewer replacements than it
# ended counts as settled (the app scaled down meanwhile): the reconciler ticks every second or
# so, and launches a replacement within one; a busy machine's ticks run late.
FLEET_SETTLE_S = 30.0
# How many times the plan after the handover is tried when the app changes while it is made.
PLAN_ATTEMPTS = 3
# Tries to pin the new version in the app's spec at the version read (another write between the
# read and the write is read again).
_PIN_ATTEMPTS = 3
# How much of an error's first line a decision about the plan after the handover quotes.
REASON_CHARS = 200


@dataclass(frozen=True, slots=True)
class RolloutTick:
    """What a tick did to one rollout (for the log)."""

    app: str
    rollout_id: int
    what: str


def _pinned(spec: Mapping[str, Any], rollout: RolloutRecord) -> dict[str, Any]:
    """``spec`` naming the rollout's new version of its model (and, for a cascade, the
    thresholds derived for it and the records behind them)."""
    pinned = dict(spec)
    pinned["models"] = [
        dict(m, artifact=f"{rollout.artifact}@{rollout.to_version}")
        if m.get("name") == rollout.model
        else dict(m)
        for m in spec["models"]
    ]
    cascade = rollout.settings.get("cascade")
    if cascade:
        pinned["thresholds"] = list(cascade["thresholds"])
        pinned["validation"] = cascade["validation"]
    return pinned


class RolloutLoop:
    """Moves the active rollouts (module docstring); :meth:`route` is the serving loop's hook."""

    def __init__(
        self,
        store: Store,
        resolver: AppResolver,
        provisioner: Provisioner,
        clock: Clock,
        meter: VersionSource,
        *,
        on_change: Callable[[str], object] | None = None,
        disruption: DisruptionBudget | None = None,
        worker_port: int = DEFAULT_WORKER_PORT,
        alone_calls: int = ALONE_CALLS,
        alone_warmup: int = ALONE_WARMUP,
        profiling: NewVersionProfiling | None = None,
        route_grace_s: float = ROUTE_GRACE_S,
        plan_deadline_s: float | None = DEFAULT_PLAN_DEADLINE_S,
        spot_prices: SpotPricesFn | None = None,
    ) -> None:
        self.store = store
        # The plan after the handover (:meth:`_plan_again`): its deadline, and the provider's
        # spot prices for an app that buys spot (the service's provisioner's).
        self.plan_deadline_s = plan_deadline_s
        self.spot_prices = spot_prices
        self.route_grace_s = route_grace_s
        # How a rollout started with a profile run profiles its new version (None: this
        # service does not; such a rollout's fleet is sized from the applied plan's stage).
        self.profiling = profiling
        self._runs: dict[int, _ProfileRun] = {}
        self._retry_at: dict[int, datetime] = {}
        # The pace at which the handover ends the old version's serving instances (None: all
        # at once; they serve nothing once the new version answers every query).
        self.disruption = disruption
        # A worker's port when the provider's address has none (EC2's private IP).
        self.worker_port = worker_port
        self.alone_calls = alone_calls
        self.alone_warmup = alone_warmup
        self.resolver = resolver
        self.provisioner = provisioner
        self.clock = clock
        self.meter = meter
        self.on_change = on_change
        self._routes: dict[str, CanaryRoute] = {}
        # Ticks and route reads run on different threads (the scheduler's; the serving loop's
        # refresh): each write counts, and a read is not written over a write made meanwhile.
        self._routes_lock = threading.Lock()
        self._routes_written = 0

    def route(self, app: str) -> CanaryRoute | None:
        return self._routes.get(app)

    def claim_workers(self) -> None:
        """Touch the live workers of every rollout this loop still moves (active, or promoted
        and handing over): their owner is alive. The reconciler ends a profile worker whose row
        went untouched for its ``profile_run_timeout_s`` (rule 8); a service started again, or
        a new leader, claims them before its first reconcile, however long it was down."""
        ids = [
            row.id
            for rollout in self._current()
            if rollout.active or rollout.state == RolloutState.PROMOTED
            for row in self._rows(rollout)
            if row.state in LIVE_STATES
        ]
        if ids:
            self.store.touch_instances(ids)

    def join_profile_runs(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the profile runs in flight to be over (the next tick
        takes their results): for a service that stops, and for tests."""
        for run in list(self._runs.values()):
            run.join(timeout_s)

    # --- the tick --------------------------------------------------------------------------

    def tick(self) -> list[RolloutTick]:
        """Move every active rollout (and end the workers of recently finished ones)."""
        done: list[RolloutTick] = []
        routes: dict[str, CanaryRoute] = {}
        current = self._current()
        for rollout in current:
            try:
                route, what = self._one(rollout)
            except Exception as error:  # the next tick tries again; traffic stays
                if isinstance(error, ControlPlaneError):
                    logger.warning("rollout %s of %s: %s", rollout.id, rollout.app, error)
                else:  # a bug: logged whole, and the other apps' rollouts go on
                    logger.exception("rollout %s of %s", rollout.id, rollout.app)
                kept = self._routes.get(rollout.app)
                if kept is not None and kept.rollout_id == rollout.id:
                    routes[rollout.app] = kept
                continue
            if route is not None:
                routes[rollout.app] = route
            if what:
                done.append(RolloutTick(rollout.app, rollout.id, what))
        self._set_routes(routes)
        waiting = {r.id for r in current if _profiling_due(r)}
        for gone in set(self._retry_at) - waiting:
            del self._retry_at[gone]
        return done

    def refresh_routes(self) -> None:
        """Read the routes from the database without acting: what a replica that does not run
        the loop (a standby serving queries) splits traffic by (the serving loop calls it at
        each refresh). Where a tick wrote the routes while this read the database (the leader
        runs both), the read is dropped: it may predate the tick's move (a route put back for a
        refresh after a roll-back or the handover's end)."""
        with self._routes_lock:
            written = self._routes_written
        routes: dict[str, CanaryRoute] = {}
        for rollout in self._current():
            if rollout.state in (RolloutState.RUNNING, RolloutState.PAUSED):
                if _ready(self._rows(rollout)):
                    routes[rollout.app] = _route(rollout)
            elif (
                rollout.state == RolloutState.PROMOTED
                and "done_at" not in (rollout.figures.get("handover") or {})
                and any(r.state in LIVE_STATES for r in self._rows(rollout))
            ):
                routes[rollout.app] = _full(rollout)
        self._set_routes(routes, unless_written_since=written)

    def _current(self) -> list[RolloutRecord]:
        """The active rollouts and those that finished within :data:`RECENT_S` (their workers
        may still be ending; older ones' are the reconciler's to reap, rule 8), and a promoted
        one whose handover is done but whose app is still to be planned again (a service down
        for longer than that plans it when it is back)."""
        since = self.clock.utcnow() - timedelta(seconds=RECENT_S)
        return [
            r
            for r in self.store.list_rollouts()
            if r.active or r.updated_at >= since or _plan_due(r)
        ]

    def _set_routes(
        self, routes: dict[str, CanaryRoute], unless_written_since: int | None = None
    ) -> None:
        with self._routes_lock:
            if unless_written_since is not None and self._routes_written != unless_written_since:
                return
            self._routes_written += 1
            for app in set(self._routes) - set(routes):
                self.meter.forget(app)
            self._routes = routes

    def _one(self, rollout: RolloutRecord) -> tuple[CanaryRoute | None, str]:
        rows = self._rows(rollout)
        live = [r for r in rows if r.state in LIVE_STATES]
        if rollout.state in (RolloutState.ROLLED_BACK, RolloutState.ABORTED):
            # The route went with the last move; the workers end once it is old enough.
            return None, self._end_after_grace(live, rollout.updated_at)
        if rollout.state == RolloutState.PROMOTED:
            return self._handover(rollout, rows)
        if teardown_requested(self.store, self.store.get_app(rollout.app)):
            # Nothing more is launched for an app about to go (its workers end with the app);
            # a profile run under way fails on its own as its workers are ended.
            self._runs.pop(rollout.id, None)
            what = "aborted: the app is being taken down (heteroplane app down)"
            self._finish(rollout, RolloutState.ABORTED, what)
            return None, what
        if _profiling_due(rollout):
            profiled = self._profile(rollout)
            if profiled is None:
                return None, ""
            rollout = profiled
        if not rollout.settings.get("extra_fleet"):
            # The first step's fleet is not granted yet (the budget could not pay for it).
            granted = self._grant(rollout, rollout.step_index)
            if granted is None:
                return None, ""
            rollout = granted
        rows = self._ensure_workers(rollout, rows)
        ended = [r for r in rows if r.state not in LIVE_STATES]
        if ended:
            # Failed to start or lost; or ended by someone else (the budget guard, app down, the
            # reconciler's reaping after the loop stopped touching it): never launched again
            # under its request id, so the rollout cannot go on.
            what = ", ".join(f"{r.instance_type} {r.state}{self._why_ended(r)}" for r in ended)
            moved = self._finish(
                rollout,
                RolloutState.ROLLED_BACK,
                f"rolled back: a worker of the new version ended ({what})",
            )
            return None, moved.reason
        self.store.touch_instances([r.id for r in rows])
        ready = _ready(rows)
        if rollout.state == RolloutState.PENDING:
            if not ready:
                return None, ""
            measured, breach = self._measure_alone(rollout, rows)
            if breach is not None:
                moved = self._finish(
                    rollout, RolloutState.ROLLED_BACK, breach, {"pre_traffic": measured}
                )
                return None, moved.reason
            # The timing and the first step in one move, each said: a crash between two moves
            # timed the workers again after the restart, and said so twice.
            timed = self._decision(rollout, _alone_text(measured), {"pre_traffic": measured})
            rollout = self.store.move_rollout(
                rollout,
                state=RolloutState.RUNNING.value,
                new_step=True,
                figures={**rollout.figures, "pre_traffic": measured},
                reason=f"workers of the new version running; step 1: {_share(rollout, 0)}",
                said=lambda moved: [timed, self._decision(moved, moved.reason)],
            )
            return _route(rollout), rollout.reason
        if not ready:  # a worker not (or no longer) running: no traffic to the new version
            return None, ""
        if rollout.state == RolloutState.PAUSED:
            return _route(rollout), ""
        return self._judge(rollout)

    def _judge(self, rollout: RolloutRecord) -> tuple[CanaryRoute | None, str]:
        settings = rollout.settings
        figures = self.meter.figures(rollout.app, rollout.id, rollout.step_index)
        new_label, old_label = _labels(rollout)
        new = figures.get(new_label, VersionFigures())
        elapsed_s = (self.clock.utcnow() - rollout.step_started_at).total_seconds()
        last = rollout.step_index >= len(rollout.steps) - 1
        judgement = judge(
            figures=new,
            shadow_step=rollout.shadow_step,
            last_step=last,
            elapsed_s=elapsed_s,
            interval_s=float(settings["interval_s"]),
            slo_ms=float(settings["slo_ms"]),
            thresholds=Thresholds(**settings["thresholds"]),
        )
        stored = {
            "versions": {v: f.to_json() for v, f in figures.items()},
            "elapsed_s": elapsed_s,
            "pre_traffic": rollout.figures.get("pre_traffic"),
        }
        verdict, reason = judgement.verdict, judgement.reason
        if verdict == Verdict.HOLD:
            self.store.move_rollout(rollout, figures=stored, reason=f"holding: {reason}")
            return _route(rollout), ""
        if verdict == Verdict.ROLL_BACK:
            moved = self._finish(
                rollout,
                RolloutState.ROLLED_BACK,
                f"rolled back at step {rollout.step_index + 1} ({_share(rollout)}): {reason}",
                stored,
            )
            return None, moved.reason
        if verdict == Verdict.PROMOTE:
            nxt = rollout.step_index + 1
            fleet, grown = self._fleet_at(rollout, nxt)
            if grown:
                wait = self._shortfall(rollout, nxt, fleet)
                if wait is not None:  # the step holds until the budget can pay for the next
                    self._wait(rollout, wait, figures=stored)
                    return _route(rollout), ""
            moved = self.store.move_rollout(
                rollout,
                step_index=nxt,
                new_step=True,
                figures=stored,
                reason=f"step {nxt} passed: {reason}; step {nxt + 1}: {_share(rollout, nxt)}"
                + (f"; its extra instances grow to {fleet_text(fleet)}" if grown else ""),
                settings=self._granted(rollout, fleet),
                said=self._said(None, stored),
            )
            crash_point("rollout.after_step")
            # Traffic at the new share once its workers run (the next ticks launch them).
            return (None if grown else _route(moved)), moved.reason
        # COMPLETE: the app serves the new version from now on.
        profiles = self._pin(rollout)
        crash_point("rollout.after_pin")
        moved = self._finish(
            rollout,
            RolloutState.PROMOTED,
            f"promoted: {reason}; {old_label} instances drain{profiles}",
            {
                **stored,
                "handover": {
                    "ended": [],
                    "promoted_at": self.clock.utcnow().isoformat(),
                    "plan_after": True,
                },
            },
        )
        return _full(moved), moved.reason

    # --- after promotion ---------------------------------------------------------------------

    def _why_ended(self, row: InstanceRecord) -> str:
        """``: <reason>`` of the move that took ``row`` out of service (the budget guard's, a
        failed launch's), so that a roll-back says why its worker ended; empty when unknown."""
        why = ended_reason(self.store, row.id)
        return "" if why is None else f": {why[:200]}"

    def _handover(
        self, rollout: RolloutRecord, rows: list[InstanceRecord]
    ) -> tuple[CanaryRoute | None, str]:
        live = [r for r in rows if r.state in LIVE_STATES]
        handover = dict(rollout.figures.get("handover") or {})
        if "done_at" in handover:  # the route went: the rollout's workers end after the grace
            done_at = datetime.fromisoformat(handover["done_at"])
            ended_workers = self._end_after_grace(live, done_at)
            billed = [r for r in live if r.state in BILLED_STATES]
            if billed or not _plan_due(rollout) or not self._grace_over(done_at):
                return None, ended_workers
            return None, self._plan_after_handover(rollout, handover)
        # The new version's queries go to the rollout's workers while the old instances are
        # replaced; when those workers ended before the handover did (the budget guard ends them
        # first on a budget cut, a spot interruption), the handover goes on without them: the
        # fleet serves until its old instances are replaced by the new version's, never left on
        # the old version with the spec naming the new one.
        full = _full(rollout) if live else None
        ended = set(handover.get("ended", []))
        promoted_at = (
            datetime.fromisoformat(handover["promoted_at"])
            if "promoted_at" in handover
            else rollout.updated_at
        )
        # The fleet's live rows and those that moved since the promotion or within the
        # disruption budget's window (a second's margin for a move at the same instant): every
        # row the handover reads, not the app's whole history.
        horizon = promoted_at
        if self.disruption is not None:
            window_start = self.clock.utcnow() - timedelta(seconds=self.disruption.window_s)
            horizon = min(horizon, window_start)
        fleet = [
            r
            for r in self.store.list_instances(
                rollout.app, ended_after=horizon - timedelta(seconds=1)
            )
            if not is_profile_worker(r.request_id)
        ]
        old = [r for r in fleet if r.created_at <= promoted_at and r.state in KEPT_STATES]
        if old:
            self.store.touch_instances([r.id for r in live])
            if not self._grace_over(promoted_at):  # the old ones may still hold queries
                return full, ""
            going = self._paced(rollout.app, old, fleet)
            if not live:
                # Nothing of the rollout's catches the queries: one serving instance at a time,
                # each once the replacement of the one before runs (an app of one instance is
                # without one while its replacement boots: the budget had no room for both).
                if not self._replaced(promoted_at, ended, fleet):
                    return None, ""
                serving = [r for r in going if r.state == InstanceState.RUNNING]
                going = [r for r in going if r.state != InstanceState.RUNNING] + serving[:1]
            if not going:  # the disruption budget's window is spent: the next tick goes on
                return full, ""
            # Which ones end is written first: a crash before they end ends them again after
            # the restart, and the replacements counted against them are the right number.
            handover["ended"] = sorted(ended | {r.id for r in going})
            handover["ended_at"] = self.clock.utcnow().isoformat()
            self.store.move_rollout(rollout, figures={**rollout.figures, "handover": handover})
            crash_point("rollout.handover_recorded")
            end_workers(self.store, self.provisioner, going, _log, owner="rollout's handover")
            return full, f"ended {len(going)} instance(s) of the old version"
        replaced = [
            r for r in fleet if r.created_at > promoted_at and r.state == InstanceState.RUNNING
        ]
        if len(replaced) < len(ended) and not self._settled(promoted_at, ended, fleet, replaced):
            self.store.touch_instances([r.id for r in live])
            return full, ""
        # When the last old instance ended (a handover recorded before ``ended_at`` was: the
        # latest move of the instances it ended, no earlier than their end).
        ended_at = handover.get("ended_at")
        last_end = (
            datetime.fromisoformat(ended_at)
            if ended_at is not None
            else max((r.updated_at for r in fleet if r.id in ended), default=None)
        )
        if live and last_end is not None and not self._grace_over(last_end):
            # The queries come back to the app's own dispatchers when the route goes (with no
            # live worker of the rollout's there is none: they are there already): not
            # before every serving process has read the fleet without the old instances the
            # handover ended (a grace after the last of them), or the first ones go to an
            # ended instance that dispatcher still lists, with nothing else there to take them.
            self.store.touch_instances([r.id for r in live])
            return full, ""
        # The route goes now; the rollout's workers end once every serving process has read
        # that and answered what they held (the next ticks after the grace).
        self.store.touch_instances([r.id for r in live])
        handover["done_at"] = self.clock.utcnow().isoformat()
        reason = (
            f"handover done: {len(replaced)} instance(s) serve {_labels(rollout)[0]}; the"
            f" rollout's workers end at the loop's first tick {self.route_grace_s:g} s from now"
        )
        self.store.move_rollout(
            rollout, figures={**rollout.figures, "handover": handover}, said=self._said(reason)
        )
        return None, reason

    def _replaced(
        self, promoted_at: datetime, ended: set[str], fleet: list[InstanceRecord]
    ) -> bool:
        """Whether a handover without the rollout's workers may end its next old instance: the
        ones it ended are replaced by running instances of the new version; or, fewer running,
        the fleet has been quiet for :data:`FLEET_SETTLE_S` (nothing of it boots, nothing ended
        or failed that recently: the app scaled down) and no launch of it failed within the
        reconciler's launch backoff (the type is held: its replacement is still to come)."""
        new = [r for r in fleet if r.created_at > promoted_at]
        if any(r.state in (InstanceState.REQUESTED, InstanceState.PENDING) for r in new):
            return False
        if sum(1 for r in new if r.state == InstanceState.RUNNING) >= len(ended):
            return True
        now = self.clock.utcnow()
        changed = [r.updated_at for r in fleet if r.id in ended or r.created_at > promoted_at]
        if changed and (now - max(changed)).total_seconds() < FLEET_SETTLE_S:
            return False
        return not any(
            r.state == InstanceState.FAILED
            and (now - r.updated_at).total_seconds() < DEFAULT_LAUNCH_BACKOFF_S
            for r in new
        )

    def _settled(
        self,
        promoted_at: datetime,
        ended: set[str],
        fleet: list[InstanceRecord],
        replaced: list[InstanceRecord],
    ) -> bool:
        """Whether the fleet the new version serves with is what the app wants now, with fewer
        replacements than the handover ended: the app scaled down meanwhile (its tuner sized
        the fleet for less load than the old one served), so the count of the ended is never
        reached. Taken as so when a replacement serves, nothing of the fleet boots, and the
        last ended instance left :data:`FLEET_SETTLE_S` ago (the reconciler has had many ticks
        to launch what the fleet wants)."""
        if not replaced:
            return False
        if any(
            r.created_at > promoted_at
            and r.state in (InstanceState.REQUESTED, InstanceState.PENDING)
            for r in fleet
        ):
            return False
        left = [r.updated_at for r in fleet if r.id in ended]
        if not left:
            return True
        return (self.clock.utcnow() - max(left)).total_seconds() >= FLEET_SETTLE_S

    def _grace_over(self, since: datetime) -> bool:
        """Whether a route changed at ``since`` is :attr:`route_grace_s` old."""
        return (self.clock.utcnow() - since).total_seconds() >= self.route_grace_s

    def _end_after_grace(self, live: list[InstanceRecord], since: datetime) -> str:
        """End the rollout's ``live`` workers, whose route went at ``since``, once that is
        :attr:`route_grace_s` old (until then they are touched: their owner is alive)."""
        if not live:
            return ""
        if not self._grace_over(since):
            self.store.touch_instances([r.id for r in live])
            return ""
        end_workers(self.store, self.provisioner, live, _log, owner="rollout")
        return f"ended {len(live)} worker(s) of the new version"

    def _paced(
        self, app: str, old: list[InstanceRecord], fleet: list[InstanceRecord]
    ) -> list[InstanceRecord]:
        """Which of the old version's kept instances end now: every one not serving yet, and
        as many serving ones as the disruption budget's window has left (counted as the
        reconciler counts it: serving instances of the fleet moved out of service within the
        window)."""
        waiting = [r for r in old if r.state != InstanceState.RUNNING]
        serving = sorted(
            (r for r in old if r.state == InstanceState.RUNNING), key=lambda r: r.created_at
        )
        if self.disruption is None:
            return waiting + serving
        since = self.clock.utcnow() - timedelta(seconds=self.disruption.window_s)
        # The fleet's own moves only: a profile run's worker ending (a rollout's start profiles
        # the new version) serves no query and spends none of the budget.
        events = self.store.list_instance_events(app=app, since=since)
        disrupted = count_disruptions(events, of={r.id for r in fleet})
        serving_now = sum(1 for r in fleet if r.state == InstanceState.RUNNING)
        allowed = self.disruption.remaining(serving_now, disrupted)
        return waiting + serving[:allowed]

    def _measure_alone(
        self, rollout: RolloutRecord, rows: list[InstanceRecord]
    ) -> tuple[dict[str, Any], str | None]:
        """Before any traffic: the new version timed alone on each of its workers, as
        ``profile run`` times the serving path (``alone_warmup`` + ``alone_calls`` calls of
        random inputs of its signature, over the Open Inference Protocol): at batch size 1
        first, next to the old version's profile on the type, then at each batch size of that
        profile (its measured profile per type, ``profiles``, which the app's measured profiles
        take at promotion). A worker whose P99 alone at batch size 1 is over the rollout's
        latency limit, or that refuses the calls, rolls the rollout back before traffic moves
        (the reason, else None). Workers whose address the provider does not give are left
        unmeasured."""
        settings = rollout.settings
        limit_ms = Thresholds(**settings.get("thresholds", {})).p99_limit_ms(
            float(settings.get("slo_ms", math.inf))
        )
        version = self.store.get_model_version(rollout.artifact, rollout.to_version)
        try:
            listed = self.provisioner.list({APP_TAG: rollout.app})
        except ProvisionerError as error:
            return {"measured": False, "reason": f"cannot list the workers: {error}"}, None
        addresses = {i.provider_id: i.address for i in listed if i.address}
        resolved = self.resolver.resolve(self.store.get_app(rollout.app).spec, check_budget=False)
        rng = np.random.default_rng(rollout.id)
        by_worker: dict[str, Any] = {}
        profiles: dict[str, dict[str, Any]] = {}  # instance type -> its profile entry
        measured: dict[str, Any] = {"measured": False, "workers": by_worker, "limit_ms": limit_ms}
        for row in rows:
            address = addresses.get(row.provider_id or "")
            if address is None:
                continue
            try:
                old = resolved.profile(rollout.model, row.instance_type)
            except (LookupError, EstimatorError):
                old = None
            sizes = [1] + [int(b) for b in (old.batch_sizes if old is not None else ()) if b > 1]
            client = WorkerClient(with_port(address, self.worker_port))
            cells: list[list[float]] = []
            try:
                for batch_size in sizes:
                    batches = [
                        random_inputs(version.signature, batch_size, rng)
                        for _ in range(self.alone_warmup + self.alone_calls)
                    ]
                    timed = [client.infer_ms(rollout.model, batch) for batch in batches]
                    cells.append(timed[self.alone_warmup :])
                    if batch_size == 1 and float(np.percentile(cells[0], 99)) > limit_ms:
                        break  # over the limit already: the other sizes do not matter
            except (ValueError, TypeError) as error:  # a signature random inputs cannot fill
                return {**measured, "reason": f"no random inputs: {error}"}, None
            except (OSError, http.client.HTTPException, ControlPlaneError) as error:
                reason = f"rolled back before traffic: the new version's worker failed: {error}"
                return {**measured, "measured": True}, reason
            finally:
                client.close()
            single = cells[0]
            by_worker[row.id] = {
                "instance_type": row.instance_type,
                "p99_ms": float(np.percentile(single, 99)),
                "mean_ms": float(np.mean(single)),
                "calls": len(single),
                "old_profile_mean_ms": old.mean_latency_ms(1) if old is not None else None,
            }
            if len(cells) == len(sizes):
                profiles.setdefault(
                    row.instance_type,
                    {
                        "model": rollout.model,
                        "instance_type": row.instance_type,
                        "batch_sizes": sizes,
                        "latency_ms": cells,
                    },
                )
        measured = {**measured, "measured": bool(by_worker), "profiles": list(profiles.values())}
        slowest = max(by_worker.values(), key=lambda w: w["p99_ms"], default=None)
        if slowest is not None and slowest["p99_ms"] > limit_ms:
            return measured, (
                f"rolled back before traffic: alone, the new version's P99 is"
                f" {slowest['p99_ms']:.1f} ms on {slowest['instance_type']}"
                f" ({slowest['calls']} calls of one sample), over the limit {limit_ms:g} ms"
            )
        return measured, None

    # --- helpers ---------------------------------------------------------------------------

    def _rows(self, rollout: RolloutRecord) -> list[InstanceRecord]:
        prefix = rollout_request_prefix(rollout.app, rollout.id)
        return self.store.list_instances(rollout.app, request_prefix=prefix)

    def _ensure_workers(
        self, rollout: RolloutRecord, rows: list[InstanceRecord]
    ) -> list[InstanceRecord]:
        """Record and launch the rollout's workers that are missing (idempotent)."""
        prefix = rollout_request_prefix(rollout.app, rollout.id)
        have = {r.request_id for r in rows}
        resolved = self.resolver.resolve(self.store.get_app(rollout.app).spec, check_budget=False)
        prices = resolved.prices_usd_per_hr
        version = self.store.get_model_version(rollout.artifact, rollout.to_version)
        # Every registered model of the app, the new version in its model's place: a cascade's
        # queries visit the other members on the same workers.
        refs = tuple(
            version.ref(rollout.model) if model == rollout.model else artifact.ref
            for model, artifact in resolved.artifacts.items()
        )
        # The rollout's start time in the ids too: a rollout's id is the table's row id, which
        # SQLite gives again once an app is deleted with its rollouts and made anew, and the
        # provider's request records outlive the app (the local provider's, on disk): the
        # same request id got the old, dead worker back ("no live emu.cpu.small").
        started = _base36(int(rollout.created_at.timestamp()))
        for instance_type, count in dict(rollout.settings["extra_fleet"]).items():
            for n in range(1, int(count) + 1):
                request_id = f"{prefix}{started}-{instance_type}-{n}"
                if request_id in have:
                    continue
                rows.append(
                    self.store.record_instance(
                        rollout.app,
                        request_id=request_id,
                        instance_type=instance_type,
                        price_usd_per_hr=float(prices[instance_type]),
                        reason=f"rollout {rollout.id}: a worker of {rollout.artifact}"
                        f"@{rollout.to_version}",
                    )
                )
                crash_point("rollout.after_worker_row")
        for row in rows:
            if row.state == InstanceState.REQUESTED and row.provider_id is None:
                try:
                    launch_worker(self.store, self.provisioner, rollout.app, row, refs)
                except ControlPlaneError as error:
                    logger.warning("rollout %s: %s", rollout.id, error)
                    self.store.transition_instance(
                        row.id, InstanceState.FAILED.value, reason=f"launch failed: {error}"
                    )
        return self._rows(rollout)

    # --- before traffic: the profile run, the fleet's grants ------------------------------------

    def _profile(self, rollout: RolloutRecord) -> RolloutRecord | None:
        """The start's profile run and plan of ``rollout``, in a thread of its own: started when
        none runs (again after an interval, when the budget could not pay for it), its result
        written once it is over. The rollout as moved, or None while it is not over (or when
        the rollout ended)."""
        settings = dict(rollout.settings)
        if self.profiling is None:
            settings["profile_run"] = False
            reason = "not profiled (this service does not profile a rollout's new version)"
            return self.store.move_rollout(
                rollout, settings=settings, reason=reason, said=self._said(reason)
            )
        run = self._runs.get(rollout.id)
        if run is None:
            due = self._retry_at.get(rollout.id)
            if due is not None and self.clock.utcnow() < due:
                return None
            self._runs[rollout.id] = _ProfileRun(self.store, self.resolver, rollout, self.profiling)
            return None
        if run.alive:
            return None
        del self._runs[rollout.id]
        if isinstance(run.error, (ProfilingBudgetError, RolloutBudgetError)):
            interval_s = float(settings["interval_s"])
            self._retry_at[rollout.id] = self.clock.utcnow() + timedelta(seconds=interval_s)
            # The profile run's own advice (--types) is not the rollout's: quote the cost.
            cost = run.error.cost if isinstance(run.error, ProfilingBudgetError) else run.error
            self._wait(
                rollout,
                f"waiting for the budget: the profile run of the new version does not fit"
                f" ({cost}); trying again in {interval_s:g} s",
            )
            return None
        if run.error is not None:
            if not isinstance(run.error, ControlPlaneError):
                logger.error("rollout %s: profile run", rollout.id, exc_info=run.error)
            self._finish(
                rollout,
                RolloutState.ROLLED_BACK,
                f"rolled back before traffic: the new version could not be profiled and"
                f" planned: {run.error}",
            )
            return None
        assert run.result is not None
        planned, stages = run.result
        resolved = self.resolver.resolve(self.store.get_app(rollout.app).spec, check_budget=False)
        if stages is not None:
            settings["stage_fleet"] = stage_fleet(resolved, rollout.model, stages)
        # Nothing is launched yet: the first step's fleet is granted anew from the new measure.
        settings.update(profiled=planned, extra_fleet={}, extra_cost_usd_per_hr=0.0)
        reason = (
            "profiled before traffic"
            + planned_text(planned)
            + f"; the extra instances are sized from {fleet_text(settings['stage_fleet']) or '-'}"
            " at each step's share"
        )
        moved = self.store.move_rollout(
            rollout,
            settings=settings,
            reason=reason,
            said=self._said(reason, {"profiled": planned}),
        )
        crash_point("rollout.after_profile")
        return moved

    def _fleet_at(self, rollout: RolloutRecord, index: int) -> tuple[dict[str, int], bool]:
        """The extra instances step ``index`` needs (the granted ones, and more where its share
        asks for them) and whether that is more than is granted. A rollout recorded without a
        stage fleet keeps the fleet it was given."""
        current = {t: int(n) for t, n in (rollout.settings.get("extra_fleet") or {}).items()}
        stages = rollout.settings.get("stage_fleet")
        if stages is None:
            return current, False
        resolved = self.resolver.resolve(self.store.get_app(rollout.app).spec, check_budget=False)
        wanted = step_fleet(stages, resolved.prices_usd_per_hr, rollout.steps, index, current)
        return wanted, wanted != current

    def _price(self, rollout: RolloutRecord, fleet: Mapping[str, int]) -> float:
        resolved = self.resolver.resolve(self.store.get_app(rollout.app).spec, check_budget=False)
        return fleet_cost(fleet, resolved.prices_usd_per_hr)

    def _shortfall(
        self, rollout: RolloutRecord, index: int, fleet: Mapping[str, int]
    ) -> str | None:
        """Why the budget cannot pay for ``fleet`` at step ``index`` (the instances it adds to
        what the app runs), or None when it can."""
        current = rollout.settings.get("extra_fleet") or {}
        more = {t: n - int(current.get(t, 0)) for t, n in fleet.items() if n > current.get(t, 0)}
        more_usd_per_hr = self._price(rollout, more)
        short = budget_shortfall(self.store, rollout.app, more_usd_per_hr)
        if short is None:
            return None
        running, budget = short
        return (
            f"waiting for the budget: step {index + 1} ({_share(rollout, index)}) needs"
            f" {fleet_text(more)} more for {more_usd_per_hr:.4g} USD/hr on top of the app's"
            f" {running:.4g} USD/hr, together {running + more_usd_per_hr:.4g} USD/hr, over the"
            f" budget of {plain(budget)} USD/hr"
        )

    def _granted(self, rollout: RolloutRecord, fleet: Mapping[str, int]) -> dict[str, Any]:
        """The rollout's settings with ``fleet`` granted."""
        return {
            **rollout.settings,
            "extra_fleet": dict(fleet),
            "extra_cost_usd_per_hr": self._price(rollout, fleet),
        }

    def _grant(self, rollout: RolloutRecord, index: int) -> RolloutRecord | None:
        """Grant step ``index``'s fleet to a rollout that has none yet (its first, after the
        profile run): the rollout as moved, or None while the budget cannot pay for it."""
        fleet, _ = self._fleet_at(rollout, index)
        if not fleet:
            resolved = self.resolver.resolve(
                self.store.get_app(rollout.app).spec, check_budget=False
            )
            shares = rollout.steps
            fleet = step_fleet({}, resolved.prices_usd_per_hr, shares, index, {})
        wait = self._shortfall(rollout, index, fleet)
        if wait is not None:
            self._wait(rollout, wait)
            return None
        reason = f"step {index + 1}'s extra instances granted: {fleet_text(fleet)}"
        return self.store.move_rollout(
            rollout, settings=self._granted(rollout, fleet), reason=reason, said=self._said(reason)
        )

    def _wait(
        self, rollout: RolloutRecord, reason: str, figures: dict[str, Any] | None = None
    ) -> None:
        """Hold ``rollout`` with ``reason``: a decision when the reason is new (not every
        tick)."""
        fresh = rollout.reason != reason
        said = self._said(reason, wait=True) if fresh else None
        self.store.move_rollout(rollout, reason=reason, figures=figures, said=said)

    def _pin(self, rollout: RolloutRecord) -> str:
        """The app's spec names the new version (registering pinned the old one); the app's
        measured profiles of the model take the new version's, timed before traffic (by the
        start's profile run on every candidate type, else alone on the rollout's workers: what
        the planner and the tuner read from now on), unless the spec names a profiles file.
        What happened to the profiles, in words."""
        record = self.store.get_app(rollout.app)
        profiles_file = None
        for model in record.spec["models"]:
            if model.get("name") == rollout.model:
                profiles_file = model.get("profiles")
        # The start's profile run on every candidate type, else the workers' timing alone.
        profiled = rollout.settings.get("profiled") or {}
        measured = (
            profiled.get("profiles")
            or (rollout.figures.get("pre_traffic") or {}).get("profiles")
            or []
        )
        said = ""
        if measured and profiles_file is None:
            types = {p["instance_type"] for p in measured}
            document = dict(self.store.get_app_profiles(rollout.app) or {})
            kept = [
                p
                for p in document.get("profiles", [])
                if not (p.get("model") == rollout.model and p.get("instance_type") in types)
            ]
            document = {"format": PROFILE_FORMAT, **document, "profiles": kept + measured}
            self.store.put_app_profiles(rollout.app, document)
            said = f"; the app's profiles of {rollout.model} on {', '.join(sorted(types))} are now"
            said += " the new version's (timed before traffic)"
        elif measured:
            said = f"; the spec's profiles file of {rollout.model} stays (profile run measures it)"
        # Written at the version read: a budget cut or another write meanwhile is kept (the pin
        # is made again on the spec as it is now), not undone by the spec read before it.
        for attempt in range(_PIN_ATTEMPTS):
            try:
                self.store.update_app(
                    rollout.app,
                    _pinned(record.spec, rollout),
                    who=f"rollout {rollout.id}",
                    expected_version=record.version,
                )
                break
            except ConflictError:
                if attempt == _PIN_ATTEMPTS - 1:
                    raise
                record = self.store.get_app(rollout.app)
        self.resolver.invalidate(rollout.app)
        if self.on_change is not None:
            self.on_change(rollout.app)
        return said

    def _plan_after_handover(self, rollout: RolloutRecord, handover: dict[str, Any]) -> str:
        """The handover is done and no worker of the rollout's costs anything any more: the app
        planned again (:meth:`_plan_again`), once, what came of it stored and decided (written
        after: a crash between plans again). Not while another rollout of the app is under
        way or in its handover (its workers hold part of the budget, and a plan applied then
        would not replace like with like): once it is over; and not at all where a rollout of
        the app started after this one was promoted, which plans the app after its own
        handover (the app serves that one's version now, not this one's). A conflict (the app
        changed while it was planned, a lost race to apply, a teardown) is tried again, up to
        :data:`PLAN_ATTEMPTS` tries in all."""
        others = [r for r in self.store.list_rollouts(rollout.app) if r.id != rollout.id]
        if any(r.active or _handing_over(r) for r in others):
            return ""  # the next ticks plan once it is over (promoted, rolled back or aborted)
        later = [
            r
            for r in others
            if r.id > rollout.id
            and r.state == RolloutState.PROMOTED
            and (r.figures.get("handover") or {}).get("plan_after")
        ]
        if later:
            said = (
                f"not planned again: rollout {later[-1].id} of the app, promoted since, serves"
                " its version now and plans the app after its own handover"
            )
            handover["planned"] = said
            self.store.move_rollout(
                rollout, figures={**rollout.figures, "handover": handover}, said=self._said(said)
            )
            return said
        try:
            said = self._plan_again(rollout)
        except _PlanConflictError as error:
            attempts = int(handover.get("plan_attempts", 0)) + 1
            if attempts < PLAN_ATTEMPTS:
                handover["plan_attempts"] = attempts
                self.store.move_rollout(rollout, figures={**rollout.figures, "handover": handover})
                return ""
            said = str(error)
        handover["planned"] = said
        self.store.move_rollout(
            rollout,
            figures={**rollout.figures, "handover": handover},
            said=self._said(said) if said else None,
        )
        return said

    def _plan_again(self, rollout: RolloutRecord) -> str:
        """After the handover, once no worker of the rollout's is billed: the app planned again as
        it now is (the new version's profiles, a cascade's new thresholds), on what its applied
        plan was planned on (its trace request, else its planned rate), under its constraints as
        they are now (the budget included), within :attr:`plan_deadline_s`; that plan applied
        where it serves the planned rate and changes what the app serves with
        (:func:`_serving_shape`). What came of it, in words for a
        ``rollout`` decision (empty without an applied plan). It fails softly: the applied plan
        stays and the words say why (plan again)."""
        applied = self.store.get_applied_plan(rollout.app)
        if applied is None:
            return ""
        old = applied.plan
        try:
            request = burstiness_replanning_request(old)
        except (InvalidValueError, ValueError) as error:  # a plan written by hand
            return f"plan {applied.id} stays ({error}): plan again for the new version"
        try:
            record = preview_plan(
                self.store,
                self.resolver,
                rollout.app,
                request,
                deadline_s=self.plan_deadline_s,
                spot_prices=self.spot_prices,
                launch_refusal=self.provisioner.launch_refusal,
            )
        except ConflictError as error:
            why = f"the app could not be planned again ({first_line(error, REASON_CHARS)})"
            if isinstance(error, ProfilesNotMeasuredError):
                return f"plan {applied.id} stays: {why}"
            raise _PlanConflictError(f"plan {applied.id} stays: {why}") from None
        except Exception as error:  # whatever it is, the applied plan serves on
            if isinstance(error, ControlPlaneError | EstimatorError | SpecError | ValueError):
                logger.warning(
                    "rollout %s of %s: not planned again: %s", rollout.id, rollout.app, error
                )
            else:  # a bug: logged whole, and tried no more (the rollout records this answer)
                logger.exception("rollout %s of %s: not planned again", rollout.id, rollout.app)
            why = first_line(error, REASON_CHARS)
            return f"plan {applied.id} stays: the app could not be planned again ({why})"
        new = record.plan
        if not new.feasible or not new.stages:
            return (
                f"plan {applied.id} stays: planned again with the new version, no fleet within"
                f" the budget serves its {old.planned_rate_qps:.4g} qps (at most"
                f" {new.max_feasible_qps or 0.0:.4g} qps)"
            )
        if _serving_shape(new) == _serving_shape(old):
            return f"planned again with the new version: the same plan, plan {applied.id} stays"
        # A crash from here to the rollout's record of it plans again after the restart, and
        # applies that plan where it differs from this one.
        try:
            done = apply_plan(self.store, rollout.app, record.id, f"rollout {rollout.id}")
        except ConflictError as error:  # the app changed meanwhile, or is being taken down
            why = first_line(error, REASON_CHARS)
            raise _PlanConflictError(
                f"plan {applied.id} stays (the plan made for the new version: {why})"
            ) from None
        except ControlPlaneError as error:  # gone meanwhile
            why = first_line(error, REASON_CHARS)
            return f"plan {applied.id} stays (the plan made for the new version: {why})"
        now, before = fleet_text(nonzero(new.fleet)), fleet_text(nonzero(old.fleet))
        return (
            f"planned again with the new version: plan {done.id} ({now},"
            f" {new.cost_usd_per_hr:.4g} USD/hr) replaces plan {applied.id}"
            f" ({before}, {old.cost_usd_per_hr:.4g} USD/hr): {_shape_changes(old, new)}"
        )

    def _finish(
        self,
        rollout: RolloutRecord,
        state: RolloutState,
        reason: str,
        figures: dict[str, Any] | None = None,
    ) -> RolloutRecord:
        return self.store.move_rollout(
            rollout,
            state=state.value,
            reason=reason,
            figures=figures,
            said=self._said(reason, figures),
        )

    def _said(
        self, reason: str | None, figures: dict[str, Any] | None = None, *, wait: bool = False
    ) -> Said:
        """What says a move: one ``rollout`` decision of the rollout as moved, with ``reason``
        (None: the move's own), written in the move's transaction (a crash leaves both or
        neither: the restarted loop makes the move again, and says it once)."""
        return lambda moved: [
            self._decision(moved, moved.reason if reason is None else reason, figures, wait=wait)
        ]

    def _decision(
        self,
        rollout: RolloutRecord,
        reason: str,
        figures: dict[str, Any] | None = None,
        *,
        wait: bool = False,
    ) -> tuple[str, str, dict[str, Any]]:
        """A ``rollout`` decision (kind, reason, numbers): ``wait`` (``numbers.wait``) says it
        holds the rollout where it is, else it is a move, so that ``heteroplane events`` folds
        only waits together."""
        return (
            DECISION_KIND,
            f"rollout {rollout.id}: {reason}",
            {
                "rollout_id": rollout.id,
                "state": rollout.state,
                "step_index": rollout.step_index,
                "step_share": rollout.step_share,
                "wait": wait,
                "figures": figures or {},
            },
        )


class _ProfileRun:
    """A rollout's profile run and plan (:func:`~controlplane.apps.rollouts.profile_and_plan`)
    in a daemon thread: its ``result`` or ``error`` once it is no longer ``alive``."""

    def __init__(
        self,
        store: Store,
        resolver: AppResolver,
        rollout: RolloutRecord,
        profiling: NewVersionProfiling,
    ) -> None:
        self.result: tuple[dict[str, Any], Any] | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.result = profile_and_plan(store, resolver, rollout, profiling)
            except Exception as error:  # reported by the loop's next tick
                self.error = error

        self._thread = threading.Thread(
            target=run, name=f"rollout-{rollout.id}-profile", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _profiling_due(rollout: RolloutRecord) -> bool:
    """Whether the start's profile run of ``rollout`` is still to be done (before traffic)."""
    return (
        rollout.state in (RolloutState.PENDING, RolloutState.PAUSED)
        and bool(rollout.settings.get("profile_run"))
        and "profiled" not in rollout.settings
    )


def _alone_text(measured: Mapping[str, Any]) -> str:
    workers = measured.get("workers") or {}
    if not workers:
        return "the new version's workers run (not timed alone: the provider gives no address)"
    parts = []
    types = [w["instance_type"] for w in workers.values()]
    for worker_id, w in workers.items():
        old = w.get("old_profile_mean_ms")
        was = "" if old is None else f" (the old version's profile: mean {old:.1f} ms)"
        # Workers of one type are told apart by their id (a reader saw one type named twice).
        label = w["instance_type"]
        if types.count(label) > 1:
            label = f"{label} {str(worker_id)[:8]}"
        parts.append(f"{label}: P99 {w['p99_ms']:.1f} ms, mean {w['mean_ms']:.1f} ms{was}")
    return "timed alone before traffic: " + "; ".join(parts)


def _ready(rows: list[InstanceRecord]) -> bool:
    """Whether every worker of a rollout runs (and it has some)."""
    return bool(rows) and all(r.state == InstanceState.RUNNING for r in rows)


def _labels(rollout: RolloutRecord) -> tuple[str, str]:
    """(new, old) version labels, ``NAME@VERSION``."""
    return (
        f"{rollout.artifact}@{rollout.to_version}",
        f"{rollout.artifact}@{rollout.from_version}",
    )


def _share(rollout: RolloutRecord, index: int | None = None) -> str:
    i = rollout.step_index if index is None else index
    share = rollout.steps[i]
    if share == 0.0:
        return "shadow (every query mirrored, 0% answered)"
    return f"{100 * share:g}% of queries"


def _route(rollout: RolloutRecord) -> CanaryRoute:
    new, old = _labels(rollout)
    return CanaryRoute(
        rollout.id,
        rollout.step_index,
        rollout.model,
        rollout.step_share,
        rollout.shadow_step,
        old,
        new,
        _thresholds(rollout),
    )


def _full(rollout: RolloutRecord) -> CanaryRoute:
    """Every query on the new version (a promoted rollout in handover)."""
    new, old = _labels(rollout)
    return CanaryRoute(
        rollout.id, len(rollout.steps), rollout.model, 1.0, False, old, new, _thresholds(rollout)
    )


class _PlanConflictError(Exception):
    """The app changed while it was planned again (or while the plan was applied): worth
    another try; the message is what to say when there is none."""


def _handing_over(rollout: RolloutRecord) -> bool:
    """Whether ``rollout`` is promoted and its handover is not done yet (the old version's
    instances are being replaced; its workers serve the new version meanwhile)."""
    handover = rollout.figures.get("handover") or {}
    return (
        rollout.state == RolloutState.PROMOTED
        and "promoted_at" in handover
        and "done_at" not in handover
    )


def _plan_due(rollout: RolloutRecord) -> bool:
    """Whether ``rollout``'s app is still to be planned again after its handover (a promotion
    since that step was built, its handover done, no answer recorded yet)."""
    handover = rollout.figures.get("handover") or {}
    return (
        rollout.state == RolloutState.PROMOTED
        and bool(handover.get("plan_after"))
        and "done_at" in handover
        and "planned" not in handover
    )


def _serving_shape(plan: PlanDocument) -> tuple[Any, ...]:
    """What of ``plan`` the app serves with (per stage its fleet, spot share, batch, dispatch
    policy, base types and scale factor, the share of queries that reach it, which the tuner
    sizes it by; the gear plan whole, whose load ranges come from the profiles), without the
    stages' predictions and costs."""
    stages = tuple(
        (
            s.name,
            nonzero(s.fleet),
            nonzero(s.spot_fleet),
            s.batch_size,
            s.policy,
            tuple(s.base_types),
            round(s.scale_factor, 4),
        )
        for s in plan.stages
    )
    return stages, plan.gear_plan


def _shape_changes(old: PlanDocument, new: PlanDocument) -> str:
    """What of :func:`_serving_shape` differs from ``old`` to ``new``, in words: a plan that
    replaces another with the same fleet says what else moved (a batch, the dispatch).

    >>> from controlplane.policies.plan import StagePlan
    >>> one = PlanDocument(True, 1.0, (StagePlan("clf", {"a": 2}, 4, policy="fcfs"),))
    >>> two = PlanDocument(True, 1.0, (StagePlan("clf", {"a": 2}, 8, policy="fcfs"),))
    >>> _shape_changes(one, two)
    'clf: batch 4 -> 8'
    """
    changes: list[str] = []
    before = {s.name: s for s in old.stages}
    for stage in new.stages:
        was = before.get(stage.name)
        if was is None:
            changes.append(f"stage {stage.name} is new")
            continue
        moved: list[str] = []
        for what, a, b in (
            ("fleet", fleet_text(nonzero(was.fleet)), fleet_text(nonzero(stage.fleet))),
            ("spot", fleet_text(nonzero(was.spot_fleet)), fleet_text(nonzero(stage.spot_fleet))),
            ("batch", str(was.batch_size), str(stage.batch_size)),
            ("dispatch", str(was.policy), str(stage.policy)),
            ("base types", ",".join(was.base_types), ",".join(stage.base_types)),
            ("scale factor", f"{was.scale_factor:.4g}", f"{stage.scale_factor:.4g}"),
        ):
            if a != b:
                moved.append(f"{what} {a or 'none'} -> {b or 'none'}")
        if moved:
            changes.append(f"{stage.name}: {', '.join(moved)}")
    kept = {s.name for s in new.stages}
    changes += [f"stage {name} is gone" for name in before if name not in kept]
    if old.gear_plan != new.gear_plan:
        changes.append("the gear plan")
    return "; ".join(changes) or "the plan's details"


def _thresholds(rollout: RolloutRecord) -> tuple[float, ...] | None:
    cascade = rollout.settings.get("cascade")
    return None if not cascade else tuple(float(h) for h in cascade["thresholds"])


def _log(message: str) -> None:
    logger.info("rollouts: %s", message)


def _base36(number: int) -> str:
    """``number`` >= 0 in base 36 (digits, then lower-case letters): a short, fixed text.

    >>> _base36(0), _base36(35), _base36(1764547200)
    ('0', 'z', 't6kdc0')
    """
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, rest = divmod(number, 36)
        text = digits[rest] + text
        if number == 0:
            return text
