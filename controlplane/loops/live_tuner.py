"""The tuner on live traffic: InferLine's tuner (:mod:`controlplane.policies.tuner`) with the load
model of docs/tuner.md, fed by the service.

This module owns :class:`LiveTuner`, the composition of the pure tuner with the service: once per
scheduler tick it reads each app's applied plan, the app's recent arrival times (an injected
:data:`ArrivalSource`, the serving loop's observations) and the clock, calls
:func:`controlplane.policies.tuner.tune`, records every decision with its reason and numbers in the
store, and keeps the fleet the tuner wants, which the reconciler reads through :meth:`desired_fleet`
(the reconciler stays the only code that acts on provisioners).

Per app the tuner is set up from the applied plan document: each stage's fleet, batch size and
scale factor (``scale_factor``, 1 when absent), mu_t from the app's profiles at the plan's batch
size, and the planned envelope, the InferLine envelope of the planning trace. The planner writes
that envelope into the document (``envelope``: ``windows_s`` and ``rate_qps``, on the tuner's
windows up to the planning trace's span: :mod:`controlplane.policies.planner`), and the tuner takes
its windows and rates as they are, keeping the windows up to its ``max_window_s`` (with the default
60 s, all of them: they are the windows it would pick itself). A plan without one (made before
plans carried it), or with one that is malformed (not a list of finite windows > 0, increasing,
each with a finite rate > 0, or no window within ``max_window_s``), falls back to a proxy,
logged: the envelope of a seeded Poisson trace at the plan's ``planned_rate_qps`` (10 minutes)
on the windows from the slowest planned instance's service time (at least
:data:`controlplane.policies.planner.MIN_ENVELOPE_WINDOW_S`) doubling to ``max_window_s``. Either
way rho_m keeps the planned fleet while traffic looks like the planned envelope. A new applied plan
(a new plan id) restarts the tuner from the plan's fleet; a change of the app's spec (its budget,
its caps) keeps the fleet it has reached, shed to a lower budget (``LiveTuner._new_limits``); a
restarted tuner (a restarted loops process, a new leader) starts from the fleet it had reached on
the applied plan, which each scale decision records (:mod:`controlplane.loops.reached`).
Instances take
:func:`controlplane.policies.tuner.default_boot_s` to boot; the tuner counts them from launch, as
the reconciler does, and an instance whose row is still ``requested`` or ``pending`` boots
however long that takes (:func:`_still_booting`: a GPU worker serves minutes after its launch).

Two timings are the caller's (the service takes them from its settings, ``tuner_max_window_s``
and ``tuner_scale_down_delay_s``): the longest envelope window, which is also how far back the
live envelope looks (InferLine's 60 s), and how long after the last change a scale-down may
come (InferLine's 15 s). Shorter ones make the tuner react, and forget a burst, sooner; a test
uses them to see a whole step up and down in a minute.

The load model (``model="curve"``, the default; docs/tuner.md, "The model now"): a stage is sized
by the planner's fleet at the live load rather than by one provisioning ratio, which needs the
applied plan's sizing ladders (:func:`plan_ladders`: tens of plans, tens of seconds; a builder
may give a single stage's capacity curve instead, :func:`plan_capacity_curve`). That never runs
in the tick: when the tuner first sets up an app on a plan it hands the build to a worker
(``submit``; by default a daemon thread) under a
deadline (``curve_deadline_s``, :mod:`estimator.deadline`; :meth:`LiveTuner.close` cancels it),
and caches the answer per (app, plan id, budget). Until the curve is ready the app runs
InferLine's model; once it is, the next tick gives the stage the curve and the live envelope
:data:`controlplane.policies.capacity_curve.LOAD_MODEL_RECENT_S` (60 s; scaled with the
longest window where the service shortens them) of memory, keeping the fleet the tuner has reached.
A curve that cannot be made (the planner fails, runs past the deadline, or places nothing at
the planned rate) leaves the app on InferLine's model, with the reason logged. A recalibration
builds the ladders again on the new profiles; the old ones size the stages until then where the
instances are no slower than they were planned for (else InferLine's model on the new rates does,
at once). A cascade
(several stages) keeps InferLine's model by default, the stage's load the app's times its
``scale_factor``, or the reach at the spec's thresholds the serving loop measures where it
differs from that beyond its noise (:func:`live_reach`, from ``statuses``); with
``cascade_ladders`` it is sized by its stages' ladders
(:func:`plan_ladders`: the replay's :func:`controlplane.policies.capacity_curve.cascade_sizing`,
each rung a plan of the whole cascade), every stage reading the app's arrivals against the app's
planned envelope, since its rungs are indexed by the app's load (its reach at the spec's
thresholds is in them; the gear the switcher picks is not). A stage without a ladder stays on
InferLine's model. docs/tuner.md ("The load model in the service") says why the default
is InferLine's.
Every recorded decision says which model decided (``model`` in its numbers, and ``model_note``
for why InferLine's decided where the load model was asked for).

A single stage sized by its ladder also sets the batch the serving loop batches its queries by:
each tick, the batch of the rung its ready fleet reaches (:func:`controlplane.policies.tuner.
live_batch`, what the replay serves it with; :meth:`LiveTuner.batch_caps`), given to the serving
loop as the app's own gear (:meth:`LiveTuner.gear`; the gear switcher's comes first) or sent over
the feed when the loops run apart (docs/tuner.md, "The rung's batch, live").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from controlplane.apps.plans import burstiness_replanning_request, planning_trace
from controlplane.clock import Clock
from controlplane.db.store import AppRecord, InstanceRecord, PlanRecord, Store
from controlplane.errors import ControlPlaneError, NotFoundError, first_line
from controlplane.loops.reached import (
    PLAN_ID,
    TUNER_KINDS,
    counts,
    lowest_budget_since,
    newest,
)
from controlplane.policies import scaling
from controlplane.policies.capacity_curve import (
    DEFAULT_BURSTINESS,
    DEFAULT_LOADS,
    LOAD_MODEL_RECENT_S,
    build_ladder,
    cascade_sizing,
)
from controlplane.policies.lifecycle import InstanceState, is_profile_worker
from controlplane.policies.pipeline import mix_dispatch
from controlplane.policies.plan import PlanDocument, StagePlan
from controlplane.policies.planner import MIN_ENVELOPE_WINDOW_S
from controlplane.policies.replay import (
    has_matched_capacity,
    kairos_capacity_model,
    rate_per_instance_qps,
    stage_slo_targets_ms,
)
from controlplane.policies.sizing import DEFAULT_LADDER_LOADS, SizingLadder, tuner_stage
from controlplane.policies.tuner import (
    DEFAULT_SCALE_DOWN_DELAY_S,
    Booting,
    ScalingDecision,
    TunerConfig,
    TunerStage,
    TunerState,
    initial_state,
    live_batch,
    planning_envelope,
    ready_fleets,
    tune,
    utilisation_target,
)
from controlplane.serving.config import ServingGear, batch_gear
from controlplane.serving.dispatcher import AppStatus
from controlplane.serving.observations import ARRIVALS_KEPT
from controlplane.spec import ResolvedApp
from estimator import deadline
from estimator.envelope import DEFAULT_MAX_WINDOW_S, DEFAULT_PERSISTENCE_S
from estimator.errors import EstimatorError
from estimator.fleet import Fleet
from estimator.numbers import money
from estimator.profiles import LatencyProfile
from estimator.traces import Trace, poisson_arrivals

__all__ = [
    "DEFAULT_CURVE_DEADLINE_S",
    "ArrivalSource",
    "CurveBuilder",
    "LiveTuner",
    "ResolveFn",
    "StatusSource",
    "Submit",
    "TunerModel",
    "plan_capacity_curve",
    "plan_ladder",
    "plan_ladders",
    "stage_rates_qps",
]

logger = logging.getLogger(__name__)

ArrivalSource = Callable[[str], NDArray[np.float64] | None]
"""App name -> the app's recent arrival times, sorted, in the clock's ``now_s`` seconds; ``None``
when nothing observes the app's traffic (no serving loop): the tuner then leaves it on its plan."""
ResolveFn = Callable[[AppRecord], ResolvedApp]
"""An app record -> its spec checked against its data (the API's resolver)."""
CurveBuilder = Callable[
    [ResolvedApp, PlanRecord],
    "Mapping[str, SizingLadder] | SizingLadder | tuple[tuple[float, float], ...]",
]
"""(the app, its applied plan) -> the sizing ladders of the plan's stages by name
(:func:`plan_ladders`, the default: the mix is re-chosen as the load moves, a cascade's stages
too), or a single stage's ladder (:func:`plan_ladder`), or only a single stage's capacity curve,
points (f, m(f)) (:func:`plan_capacity_curve`: the planned types alone); raises when there is
none to be had."""
Submit = Callable[[Callable[[], None]], None]
"""Runs a piece of work off the tick (by default on a daemon thread; a test may run it at once,
or later, or never)."""
StatusSource = Callable[[], Sequence[AppStatus]]
"""The serving loop's statuses as of its last refresh (``ServingLoop.statuses``): a cascade's
later stages carry their reach at the spec's thresholds (:mod:`controlplane.serving.reach`)."""
TunerModel = Literal["curve", "inferline"]

# The sizing ladder is twelve plans for the planned burstiness and eight for each other one
# (36 in all; rm2's twelve took 26-48 s on the 2-core machine); past this the planner stops and
# the app stays on InferLine's model. Ten of the settings' plan_deadline_s (60 s, as long as any
# one plan may take): the build runs off the tick, so only the time the app spends on
# InferLine's model grows with it.
DEFAULT_CURVE_DEADLINE_S = 600.0
# A cascade's later stage on InferLine's model is sized for the reach the serving loop measures
# at the spec's thresholds (docs/tuner.md, "The reach, live") where it rests on at least
# REACH_MIN_SAMPLES samples of the first model and lies more than REACH_NOISE_SD binomial standard
# deviations from the plan's scale factor, and while it stays more than REACH_HOLD_SD from it
# once it has (a reading about the band's edge moved the need by three sd at every crossing);
# else for the plan's.
REACH_MIN_SAMPLES = 200
REACH_NOISE_SD = 3.0
REACH_HOLD_SD = 1.0
MIN_REACH = 1e-6
# How long close() waits for the curve builds it cancelled to stop.
CLOSE_WAIT_S = 10.0

# The planned envelope of a plan without one in its document: a Poisson trace this long, with this
# seed.
SYNTHETIC_PLANNING_S = 600.0
SYNTHETIC_SEED = 0


@dataclass(slots=True)
class _AppTuner:
    """One app's tuner: the plan it was set up from and the state it has reached."""

    plan_id: int
    stages: list[TunerStage]
    config: TunerConfig
    state: TunerState
    # The last budget_capped (stage, type, count) recorded: the tuner says it every tick while the
    # budget binds, the decision log keeps it once per change.
    capped: tuple[str, str, int] | None = None
    # Whether the last tick said budget_capped (the gear switcher's signal).
    capped_now: bool = False
    # Why the stages run InferLine's model where the load model was asked for (None: they run
    # the load model, or InferLine's was asked for).
    model_note: str | None = None
    # The profiles were recalibrated while the stages ran the load model: its ladders are built
    # again, and the stages keep the old ones until the new ones are ready.
    rebuild: bool = False
    # The app's version (its spec, budget included) the limits were read from.
    app_version: int = 0
    # A single stage sized by its ladder: the batch cap of its ready fleet's rung as the
    # serving loop's gear (None: the plan's batch), made anew only when the cap changes (the
    # dispatcher notices a new gear by its identity).
    batch_gear: ServingGear | None = None
    # The later stages sized for the live reach at the last tick (:func:`live_reach`'s ``held``).
    reach_held: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Curve:
    """The capacity curve of one (app, plan id, budget): being built, built, or failed."""

    status: Literal["building", "ready", "failed"]
    # A single stage's capacity curve alone (a builder without ladders).
    curve: tuple[tuple[float, float], ...] = ()
    reason: str = ""
    # The sizing ladders by stage name (empty: a capacity curve only).
    ladders: Mapping[str, SizingLadder] = dataclasses.field(default_factory=dict)


class LiveTuner:
    """InferLine's tuner over every app with an applied plan (thread-safe).

    ``tick()`` is the scheduler's tuner job; ``desired_fleet(app)`` is the reconciler's hook (the
    plan's fleet until the tuner has run for the app). ``max_window_s`` is the longest envelope
    window and, with InferLine's model, the span of the live envelope; ``scale_down_delay_s`` the
    quiet time before a scale-down (both :class:`controlplane.policies.tuner.TunerConfig`'s,
    InferLine's 60 s and 15 s by default). ``model`` picks the load model (``curve``, the default;
    the module docstring) or InferLine's one provisioning ratio (``inferline``);
    ``load_model_recent_s`` is the load model's live envelope span (by default
    :data:`controlplane.policies.capacity_curve.LOAD_MODEL_RECENT_S`, 60 s, scaled by
    ``max_window_s`` / 60 s; never shorter than ``max_window_s``), ``build_curve`` makes a
    plan's sizing ladders (:func:`plan_ladders`) within ``curve_deadline_s``, and
    ``submit`` runs it off the tick. ``cascade_ladders`` sizes a cascade's stages by their ladders
    too (by default a cascade keeps InferLine's model: the module docstring).
    """

    def __init__(
        self,
        store: Store,
        clock: Clock,
        arrivals: ArrivalSource,
        resolve: ResolveFn,
        *,
        max_window_s: float = DEFAULT_MAX_WINDOW_S,
        scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S,
        model: TunerModel = "curve",
        load_model_recent_s: float | None = None,
        build_curve: CurveBuilder | None = None,
        curve_deadline_s: float = DEFAULT_CURVE_DEADLINE_S,
        submit: Submit | None = None,
        cascade_ladders: bool = False,
        statuses: StatusSource | None = None,
    ) -> None:
        if not (math.isfinite(max_window_s) and max_window_s > 0):
            raise ValueError(f"max_window_s must be finite and > 0, got {max_window_s!r}")
        if not (math.isfinite(scale_down_delay_s) and scale_down_delay_s >= 0):
            raise ValueError(
                f"scale_down_delay_s must be finite and >= 0, got {scale_down_delay_s!r}"
            )
        if model not in ("curve", "inferline"):
            raise ValueError(f"model must be curve or inferline, got {model!r}")
        if load_model_recent_s is None:
            # The load model's memory is its longest window (60 s at InferLine's windows):
            # a service that shortens its windows (a test, a demo) shortens the memory with them.
            load_model_recent_s = LOAD_MODEL_RECENT_S * max_window_s / DEFAULT_MAX_WINDOW_S
        for name, value in (
            ("load_model_recent_s", load_model_recent_s),
            ("curve_deadline_s", curve_deadline_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        self._store = store
        self._clock = clock
        self._arrivals = arrivals
        self._statuses = statuses
        self._resolve = resolve
        self._max_window_s = float(max_window_s)
        self._scale_down_delay_s = float(scale_down_delay_s)
        self._model: TunerModel = model
        self._load_model_recent_s = max(float(load_model_recent_s), self._max_window_s)
        self._build_curve = build_curve or plan_ladders
        self._cascade_ladders = bool(cascade_ladders)
        self._curve_deadline_s = float(curve_deadline_s)
        self._builds: list[threading.Thread] = []
        self._submit = submit or self._in_thread
        # Capacity curves by (app, plan id, budget), written by the workers.
        self._curves: dict[tuple[str, int, float], _Curve] = {}
        # Set by close(): curve builds in flight stop at the planner's next deadline check.
        self._closing = threading.Event()
        self._apps: dict[str, _AppTuner] = {}
        # Apps whose profiles were recalibrated: set up again at their next tick, state kept.
        self._recalibrated: set[str] = set()
        # Per app, the error its last tick failed on (said once per run of it).
        self._failures: dict[str, str] = {}
        self._lock = threading.Lock()

    def stages(self, app: str) -> tuple[TunerStage, ...]:
        """The stages the tuner sizes ``app`` with now (empty before its first tick): with the
        sizing model, each one's rates, capacity model and rungs."""
        with self._lock:
            tuned = self._apps.get(app)
            return () if tuned is None else tuple(tuned.stages)

    def desired_fleet(self, app: AppRecord) -> Mapping[str, int]:
        """Counts by type the app should run: the tuner's fleet, summed over its stages."""
        with self._lock:
            tuned = self._apps.get(app.name)
            if tuned is not None and tuned.plan_id == app.applied_plan_id:
                return _summed(tuned.state)
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return {}
        # Before the tuner's first tick on this plan (a restarted loops process), the fleet it had
        # reached: the reconciler's first pass drained what the tuner had grown under load.
        reached = _reached_fleets(self._store, app, plan)
        if reached is not None:
            return _summed_fleets(reached)
        return plan.plan.fleet

    def recalibrate(self, app: str) -> None:
        """Take ``app``'s profiles afresh at its next tick (they were recalibrated: the rates
        per instance change), keeping the fleet and timers the tuner has reached."""
        with self._lock:
            self._recalibrated.add(app)
            # The sizing ladder was planned on the old profiles: it is planned again.
            self._forget_curves(app, None)

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Cancel the capacity curves being built (the service is stopping) and wait up to
        ``timeout_s`` for their threads to stop at the planner's next deadline check: a thread
        left inside compiled code as the interpreter exits can abort the process. The tuner keeps
        whatever model each app runs."""
        self._closing.set()
        with self._lock:
            builds, self._builds = self._builds, []
        ends_at = time.monotonic() + timeout_s
        for thread in builds:
            thread.join(max(0.0, ends_at - time.monotonic()))

    def _in_thread(self, work: Callable[[], None]) -> None:
        """Run ``work`` on a daemon thread of its own, kept for :meth:`close` to wait for."""
        thread = threading.Thread(target=work, name="capacity-curve", daemon=True)
        with self._lock:
            self._builds = [t for t in self._builds if t.is_alive()]
            self._builds.append(thread)
        thread.start()

    def budget_capped(self, app: str) -> bool:
        """Whether the tuner's last tick for ``app`` found the budget stopping a scale-up (the
        gear switcher then keeps the faster gear: ``controlplane.loops.live_gears``)."""
        with self._lock:
            tuned = self._apps.get(app)
            return tuned is not None and tuned.capped_now

    def tick(self, apps: Sequence[AppRecord] | None = None) -> list[tuple[str, ScalingDecision]]:
        """One tuner tick for every app with an applied plan (``apps``, the tick's snapshot of
        the store's apps, else read now); the decisions it made."""
        made: list[tuple[str, ScalingDecision]] = []
        now_s = self._clock.now_s()
        for app in self._store.list_apps() if apps is None else apps:
            if (
                app.applied_plan_id is None
                or scaling.live_owner(app.spec.get("scaling")) != "tuner"
            ):
                # An app another policy scales (scaling: infaas) is that loop's.
                self._forget(app.name)
                continue
            try:
                made.extend((app.name, d) for d in self._tick_app(app, now_s))
            except NotFoundError:
                # Deleted since the tick read the apps (a teardown's end): forgotten, and the
                # other apps are tuned as ever.
                logger.info("tuner: %s was deleted during the tick", app.name)
                self._forget(app.name)
            except (EstimatorError, KeyError, ValueError) as error:
                # A plan the tuner cannot read (a type without a profile, a malformed stage)
                # leaves the app on its plan; the next tick sets it up afresh and tries again.
                self._failed(app, error)
            else:
                self._failures.pop(app.name, None)
        return made

    def _failed(self, app: AppRecord, error: Exception) -> None:
        """An app the tuner could not size this tick: what it kept of the app is dropped (the
        next tick sets it up again from its plan and the fleet it had reached, rather than
        failing on the same state every second), and the failure is a ``tuner_failed``
        decision, one row for a run of the same error (it was a log line a second, with no
        sign in the app's events, while the app went unscaled for minutes)."""
        text = first_line(error, 300)
        if isinstance(error, KeyError):
            text = f"no rate or price for {text}"
        self._forget(app.name)
        if self._failures.get(app.name) == text:
            return
        self._failures[app.name] = text
        logger.warning("tuner: %s left on its plan: %s", app.name, text)
        try:
            self._store.record_decision(
                app.name,
                "tuner_failed",
                f"the tuner cannot size the app: {text}; the fleet stays as it is, set up again"
                " from the plan each tick until it can",
                {"error": text},
                key=text,
            )
        except (NotFoundError, ControlPlaneError) as recorded:
            logger.warning("tuner: %s: the failure was not recorded: %s", app.name, recorded)

    def _forget(self, app: str) -> None:
        """Drop what the tuner keeps of ``app`` (its state, its sizing curves)."""
        with self._lock:
            self._apps.pop(app, None)
            self._forget_curves(app, None)

    def _tick_app(self, app: AppRecord, now_s: float) -> list[ScalingDecision]:
        observed = self._arrivals(app.name)
        if observed is None:
            return []
        with self._lock:
            tuned = self._apps.get(app.name)
            recalibrated = app.name in self._recalibrated
            self._recalibrated.discard(app.name)
        if tuned is None or tuned.plan_id != app.applied_plan_id:
            tuned = self._set_up(app, now_s)
            if tuned is None:
                return []
            recalibrated = False  # set up on the profiles as they are now
        elif tuned.app_version != app.version:
            self._new_limits(tuned, app)
        if recalibrated:  # the new budget is read too: _set_up reads the app's
            # The fleet the tuner reached stays: the fresh stages know every type in it (one the
            # plan does not place, that the sizing model added, was a KeyError every tick after
            # a drift: the app left on its plan until a restart).
            reached_types = {
                stage.name: {*stage.rate_per_instance_qps, *tuned.state.fleets.get(stage.name, {})}
                for stage in tuned.stages
            }
            fresh = self._set_up(app, now_s, reached_types)
            if fresh is not None and [s.name for s in fresh.stages] == [
                s.name for s in tuned.stages
            ]:
                if any(s.capacity_curve is not None for s in tuned.stages) and not _slower(
                    fresh.stages, tuned.stages
                ):
                    # Sized by the load model, on instances no slower than it was planned for:
                    # the old ladders, which provision at least what the new ones will, size
                    # the stages until those are built (InferLine's model meanwhile would buy
                    # what the ladders had just found unneeded, and drop it again). Slower
                    # instances fall back to InferLine's model on the new rates at once, as
                    # before: the old ladders would provision too little.
                    tuned.rebuild = True
                else:
                    fresh.stages = [
                        _recalibrated(new, old, tuned.config.planned_peak_rate_qps)
                        for new, old in zip(fresh.stages, tuned.stages, strict=True)
                    ]
                    fresh.state, fresh.capped = tuned.state, tuned.capped
                    fresh.reach_held = tuned.reach_held
                    tuned = fresh
        if self._model == "curve":
            self._load_model(app, tuned, now_s)
        arrivals = np.ascontiguousarray(observed, dtype=np.float64)
        waiting = self._store.list_instances(app.name, states=_NOT_SERVING_YET)
        start = _still_booting(tuned.state, waiting, now_s)
        stages, reaches = self._live_reach(
            app.name, tuned.stages, tuned.config.planned_peak_rate_qps, tuned.reach_held
        )
        decisions, state = tune(arrivals, now_s, start, stages, tuned.config)
        models = {stage.name: stage.model for stage in tuned.stages}
        recorded = []
        capped = tuned.capped
        for d in decisions:
            if d.action == "budget_capped":
                key = (d.stage, d.instance_type, d.count)
                if key == capped:
                    continue
                capped = key
            elif d.action == "scale_up":
                capped = None
            recorded.append(d)
        # The tick's decisions in one transaction: each carries the fleets after the whole tick
        # (FLEETS_AFTER, what a restarted tuner starts from), so that a crash between two left
        # the second stage's change made and never said.
        said: list[tuple[str, str, dict[str, Any], str | None]] = []
        for d in recorded:
            reach = reaches.get(d.stage)
            said.append(
                (
                    d.action,
                    d.reason if reach is None else f"{d.reason}; {_reach_words(reach)}",
                    {
                        "stage": d.stage,
                        "instance_type": d.instance_type,
                        "count": d.count,
                        # Summed price by price: 0.1 + 0.05 read 0.15000000000000002 in the API.
                        "cost_usd_per_hr_after": money(d.cost_usd_per_hr_after),
                        "at_s": d.at_s,
                        # Which load model sized the stage, and why not the load model if asked.
                        "model": models[d.stage],
                        "model_note": tuned.model_note if models[d.stage] == "inferline" else None,
                        # The stage's share sized for where the live reach stood in for the
                        # plan's.
                        **({"reach": reach} if reach is not None else {}),
                        # What a restarted tuner starts from (_reached_fleets): the fleet it had
                        # reached on this plan, not the plan's.
                        **(
                            {PLAN_ID: tuned.plan_id, FLEETS_AFTER: _fleets_of(state)}
                            if d.action in TUNER_KINDS
                            else {}
                        ),
                    },
                    # A cap that lasts (per stage and what it wanted) is one row with a count.
                    _cap_key(d) if d.action == "budget_capped" else None,
                )
            )
        if said:
            self._store.record_decisions(app.name, said)
        # Only now does the reconciler see the new fleet: a decision is in the log before what
        # the reconciler does about it (a scale-up before its launch). A write that fails leaves
        # the tuner as it was, none of the tick's decisions written: the next tick decides again.
        caps = _batch_caps(tuned, state, arrivals, now_s)
        with self._lock:
            tuned.state = state
            tuned.capped = capped
            tuned.capped_now = any(d.action == "budget_capped" for d in decisions)
            tuned.reach_held = frozenset(reaches)
            held = tuned.batch_gear.max_batch_queries if tuned.batch_gear is not None else {}
            if caps != held:
                tuned.batch_gear = batch_gear(*next(iter(caps.items()))) if caps else None
            self._apps[app.name] = tuned
        return recorded

    def _live_reach(
        self,
        app: str,
        stages: Sequence[TunerStage],
        peak_qps: float,
        held: Collection[str] = (),
    ) -> tuple[list[TunerStage], dict[str, dict[str, float]]]:
        """``stages`` with each later stage of a cascade on InferLine's model sized for the reach
        the serving loop measured at the spec's thresholds (:func:`live_reach`; ``held``: the
        stages it sized so at the last tick), and, by stage, the reach used where it stood in
        for the plan's (observed, planned, samples)."""
        if len(stages) < 2 or self._statuses is None:
            return list(stages), {}
        try:
            found = [s for s in self._statuses() if s.app == app]
        except Exception as error:  # the plan's shares size the stages meanwhile
            logger.warning("tuner: %s: the serving loop's status: %s", app, first_line(error))
            return list(stages), {}
        if not found:
            return list(stages), {}
        by_model = {entry.model: entry for entry in found[0].stages}
        out, used = [stages[0]], {}
        for stage in stages[1:]:
            status = by_model.get(stage.name)
            share = (
                None
                if status is None or stage.ladder is not None or stage.capacity_curve is not None
                else live_reach(
                    stage.scale_factor,
                    status.reach,
                    status.reach_samples,
                    held=stage.name in held,
                )
            )
            if share is None:
                out.append(stage)
                continue
            used[stage.name] = {
                "observed": share,
                "planned": stage.scale_factor,
                "samples": float(status.reach_samples) if status is not None else 0.0,
            }
            out.append(
                dataclasses.replace(
                    stage,
                    scale_factor=share,
                    planned_share=stage.scale_factor,
                    utilisation_target=_whole_rho(stage, peak_qps),
                )
            )
        return out, used

    def batch_caps(self) -> dict[str, dict[str, int]]:
        """App -> {model: batch cap} for every single-stage app sized by its ladder: the batch
        of the rung its ready fleet reaches (:func:`controlplane.policies.tuner.live_batch`, as
        the replay serves it), which a loops process running apart sends the serving process
        with the gears (:class:`~controlplane.loops.live_gears.GearTable`)."""
        with self._lock:
            return {
                app: dict(t.batch_gear.max_batch_queries)
                for app, t in self._apps.items()
                if t.batch_gear is not None
            }

    def gear(self, app: str) -> ServingGear | None:
        """The serving loop's gear hook for ``app`` (``controlplane.serving.loop.GearHook``):
        its model's batch cap from :meth:`batch_caps`; None where the tuner sets none (the
        plan's batch, or the gear switcher's for a cascade)."""
        with self._lock:
            tuned = self._apps.get(app)
            return tuned.batch_gear if tuned is not None else None

    def _new_limits(self, tuned: _AppTuner, app: AppRecord) -> None:
        """The app's spec changed (its plan did not): its budget and caps bound the tuner from
        this tick on, and the tuner keeps the fleet it has reached (a fleet over the budget is
        shed first, :func:`controlplane.policies.tuner.tune`). Set up again from the plan at a
        budget change, it started from the plan's fleet whatever ran, and recorded a scale-up
        to the running fleet beside the reconciler's drain that launched nothing. Stages sized
        by the load model keep their ladders until the new budget's are built (their targets
        are held to the new limits)."""
        config = tuned.config
        new_budget = config.budget_usd_per_hr != app.budget_usd_per_hr
        caps = dict(config.max_counts)
        try:
            constraints = self._resolve(app).constraints
        except (EstimatorError, KeyError, ValueError) as error:
            # A spec that no longer resolves (a profile file gone): the budget holds all the
            # same (it needs no profile), the caps stay as they were.
            logger.warning("tuner: %s: the caps stay as they were: %s", app.name, error)
        else:
            # A type the spec no longer lists may not be bought again (the planner's rule).
            caps = constraints.held_caps(config.prices_usd_per_hr)
        tuned.config = dataclasses.replace(
            config, budget_usd_per_hr=app.budget_usd_per_hr, max_counts=caps
        )
        tuned.app_version = app.version
        if new_budget and any(stage.capacity_curve is not None for stage in tuned.stages):
            tuned.rebuild = True  # the ladders are the plan's under the budget

    def _set_up(
        self,
        app: AppRecord,
        now_s: float,
        known: Mapping[str, Collection[str]] | None = None,
    ) -> _AppTuner | None:
        """The tuner of ``app`` on its applied plan: each stage's rates mu_t for the types of
        its planned fleet, of ``known`` (stage -> types the state it goes on with holds: a
        recalibration keeps the fleet the tuner reached, which may hold a type the plan does not
        place) and of the fleet it had reached on the plan (a restart starts from it)."""
        plan = self._store.get_applied_plan(app.name)
        if plan is None:
            return None
        resolved = self._resolve(app)
        document = plan.plan
        planned_rate = document.planned_rate_qps
        if not document.stages or not (math.isfinite(planned_rate) and planned_rate > 0):
            return None
        reached = _reached_fleets(self._store, app, plan)
        beyond: dict[str, set[str]] = {name: set(ts) for name, ts in (known or {}).items()}
        for name, fleet in (reached or {}).items():
            beyond.setdefault(name, set()).update(t for t, n in fleet.items() if n > 0)
        stages: list[TunerStage] = []
        service_time_s = 0.0
        types: set[str] = set()
        # A Kairos-dispatched stage's bound is at its share of the SLO less the control plane's
        # own time, as the replay's InferLine model and the planner judge it.
        targets_ms = stage_slo_targets_ms(document, resolved)
        by_stage = zip(
            document.stages, stage_rates_qps(resolved, document), targets_ms, strict=True
        )
        for entry, mu, target_ms in by_stage:
            name = entry.name
            fleet = {t: n for t, n in entry.fleet.items() if n > 0}
            batch = entry.batch_size
            for t in sorted(beyond.get(name, set()) - set(mu)):
                rate = _rate_or_none(resolved, entry, t)
                if rate is not None:
                    mu[t] = rate
                    types.add(t)
            service_time_s = max(service_time_s, *(1.0 / rate for rate in mu.values()))
            types.update(fleet)
            scale = entry.scale_factor
            model = None
            # The mix is measured as it is dispatched: a one-type plan's by the planner's rule.
            if has_matched_capacity(mix_dispatch(entry), list(mu), batch):
                planning = synthetic_planning_arrivals(planned_rate)
                ones = np.ones(planning.size, dtype=np.int64)
                model = kairos_capacity_model(
                    resolved, name, list(mu), Trace(planning, ones), target_ms
                )
            stages.append(TunerStage(name, scale, fleet, mu, 1.0, capacity_model=model))
        planned = _planned_envelope(document, self._max_window_s)
        if isinstance(planned, str):
            logger.warning(
                "tuner: %s: plan %s's envelope is not usable (%s); using a Poisson trace at"
                " its planned rate instead",
                app.name,
                plan.id,
                planned,
            )
        if not isinstance(planned, tuple):
            # Computed once per rate and windows (a recalibration sets the app up again with
            # the same plan): 600 s of arrivals at the planned rate, millions at thousands of
            # q/s, took the tick hundreds of milliseconds of the serving loop's interpreter.
            planned = synthetic_planning_envelope(
                planned_rate, max(service_time_s, MIN_ENVELOPE_WINDOW_S), self._max_window_s
            )
        # The app's budget and caps bound the tuner as they bound the planner (per stage and
        # type). A burst shorter than the persistence (scaled with the windows, as the memory
        # is) is ridden on the fleet unless it recurs: 56 queries in a second once buy nothing.
        config = TunerConfig.from_envelope(
            planned[0],
            planned[1],
            budget_usd_per_hr=app.budget_usd_per_hr,
            constraints=resolved.constraints,
            catalog=resolved.catalog,
            types=sorted(types),
            scale_down_delay_s=self._scale_down_delay_s,
            recent_s=self._max_window_s,
            persistence_s=DEFAULT_PERSISTENCE_S * self._max_window_s / DEFAULT_MAX_WINDOW_S,
            # Its memory starts at a restart, or after silence, not with the app's traffic.
            hold_young_memory=True,
            memory_ring=ARRIVALS_KEPT,
        )
        # A type the spec no longer lists may not be bought again (the planner's rule), as
        # :meth:`_new_limits` holds it: a recalibration (or a restart) sets the app up here, and
        # lost the cap, buying again the planned type a spec change had shed.
        held = resolved.constraints.held_caps(config.prices_usd_per_hr)
        config = dataclasses.replace(config, max_counts=held)
        stages = [
            TunerStage(
                s.name,
                s.scale_factor,
                s.fleet,
                s.rate_per_instance_qps,
                utilisation_target(
                    s.fleet,
                    s.rate_per_instance_qps,
                    s.scale_factor,
                    config.planned_peak_rate_qps,
                    s.capacity_model,
                ),
                capacity_model=s.capacity_model,
            )
            for s in stages
        ]
        state = initial_state(stages, now_s)
        if reached is not None and set(reached) == {s.name for s in stages}:
            rated = {s.name: s.rate_per_instance_qps for s in stages}
            if all(
                set(fleet) <= set(config.prices_usd_per_hr) and set(fleet) <= set(rated[name])
                for name, fleet in reached.items()
            ):
                state = dataclasses.replace(
                    state, fleets={name: Fleet.of(fleet) for name, fleet in reached.items()}
                )
                logger.info(
                    "tuner: %s starts from the fleet it had reached on plan %s: %s",
                    app.name,
                    plan.id,
                    _summed_fleets(reached),
                )
        return _AppTuner(
            plan_id=plan.id,
            app_version=app.version,
            stages=stages,
            config=config,
            state=state,
        )

    # --- the load model ------------------------------------------------------------------------

    def _load_model(self, app: AppRecord, tuned: _AppTuner, now_s: float) -> None:
        """Give ``tuned``'s stages their plan's sizing ladders (or a single stage its capacity
        curve) once they are ready (starting the build the first time, and again after a
        recalibration), else note why InferLine's model decides for now."""
        sized = any(s.capacity_curve is not None for s in tuned.stages)
        if sized and not tuned.rebuild:
            return
        if len(tuned.stages) > 1 and not self._cascade_ladders:
            tuned.model_note = "a cascade: InferLine's model per stage"
            return
        key = (app.name, tuned.plan_id, tuned.config.budget_usd_per_hr)
        with self._lock:
            entry = self._curves.get(key)
            if entry is None:
                self._forget_curves(app.name, key)
                entry = self._curves[key] = _Curve("building")
                start = True
            else:
                start = False
        if start:
            self._start_curve(app, key)
            with self._lock:  # a synchronous submit has finished it already
                entry = self._curves.get(key, entry)
        if sized:  # rebuilding after a recalibration: the old ladders size the stages meanwhile
            if entry.status == "building":
                return
            tuned.rebuild = False
            # The fleet the tuner reached stays, so the fresh stages must know every type in
            # it: a type the sizing model added that neither the plan nor the new ladders place
            # (a budget cut under its price) was a KeyError, a ``tuner_failed`` decision and the
            # tuner set up again from the plan, its ladders dropped.
            fresh = (
                self._set_up(app, now_s, _held_types(tuned.state))
                if entry.status == "ready"
                else None
            )
            if fresh is None or [s.name for s in fresh.stages] != [s.name for s in tuned.stages]:
                # A failed build (logged) keeps the old ladders, and the decisions say so.
                why = entry.reason if entry.status == "failed" else "its stages differ"
                tuned.model_note = f"the ladders of the profiles or budget before: {why}"
                return
            tuned.stages, tuned.config = fresh.stages, fresh.config
        if entry.status == "building":
            tuned.model_note = "the plan's capacity curve is being built"
        elif entry.status == "failed":
            tuned.model_note = f"no capacity curve: {entry.reason}"
        elif entry.ladders:
            self._use_ladders(app, tuned, entry.ladders)
        elif len(tuned.stages) > 1:
            # A capacity curve is one stage's: a cascade needs its stages' ladders.
            tuned.model_note = "a cascade: InferLine's model per stage (no ladders)"
        else:
            tuned.stages = [
                dataclasses.replace(stage, capacity_curve=entry.curve) for stage in tuned.stages
            ]
            tuned.config = dataclasses.replace(tuned.config, recent_s=self._load_model_recent_s)
            tuned.model_note = None
            logger.info(
                "tuner: %s: plan %s runs the load model, capacity curve %s",
                app.name,
                tuned.plan_id,
                ", ".join(f"x{f:g}: {m:.3f}" for f, m in entry.curve),
            )

    def _use_ladders(
        self, app: AppRecord, tuned: _AppTuner, ladders: Mapping[str, SizingLadder]
    ) -> None:
        """Size each of ``tuned``'s stages that has a ladder by it (a stage without one keeps
        InferLine's model, noted). Every stage reads the app's arrivals against the app's planned
        envelope: a cascade stage's rungs are its fleets in the plans of the whole cascade at f
        times the planned rate, so the app's load factor picks its rung."""
        config = tuned.config
        types = sorted(
            {
                *config.prices_usd_per_hr,
                *(t for ladder in ladders.values() for t in ladder.rate_per_instance_qps),
            }
        )
        resolved = self._resolve(app)
        tuned.config = TunerConfig.from_envelope(
            config.windows_s,
            config.planned_rate_qps,
            budget_usd_per_hr=config.budget_usd_per_hr,
            constraints=resolved.constraints,
            catalog=resolved.catalog,
            types=types,
            scale_down_delay_s=config.scale_down_delay_s,
            recent_s=self._load_model_recent_s,
            persistence_s=config.persistence_s,
            hold_young_memory=config.hold_young_memory,
            memory_ring=config.memory_ring,
        )
        held = _held_types(tuned.state)
        tuned.stages = [
            tuner_stage(
                _rating_held(ladders[stage.name], stage, held.get(stage.name, set())),
                stage.fleet,
                tuned.config,
                scale_factor=stage.scale_factor,
            )
            if stage.name in ladders
            else stage
            for stage in tuned.stages
        ]
        unsized = [stage.name for stage in tuned.stages if stage.name not in ladders]
        tuned.model_note = (
            f"no ladder for {', '.join(unsized)} (the planner places nothing for it at the"
            " planned rate): InferLine's model there"
            if unsized
            else None
        )
        for name, ladder in sorted(ladders.items()):
            logger.info(
                "tuner: %s: plan %s runs the sizing model, %s's rungs %s",
                app.name,
                tuned.plan_id,
                name,
                "; ".join(
                    f"x{f:g}: {', '.join(f'{n} {t}' for t, n in sorted(r.items()))}"
                    for f, r in ladder.rungs
                ),
            )

    def _start_curve(self, app: AppRecord, key: tuple[str, int, float]) -> None:
        """Hand the build of ``key``'s curve to ``submit``; what it finds (or why it failed)
        lands in the cache."""
        plan = self._store.get_applied_plan(app.name)
        try:
            if plan is None or plan.id != key[1]:
                raise ValueError("the applied plan changed before its curve was built")
            resolved = self._resolve(app)
        except Exception as error:  # the tick goes on; the app stays on InferLine's model
            self._curve_failed(key, error)
            return
        build, seconds, closing = self._build_curve, self._curve_deadline_s, self._closing

        def work() -> None:
            try:
                with deadline.limit(seconds, closing):
                    curve = build(resolved, plan)
            except Exception as error:  # any failure leaves the app on InferLine's model
                self._curve_failed(key, error)
                return
            if isinstance(curve, SizingLadder):
                ready = _Curve("ready", ladders={curve.stage: curve})
            elif isinstance(curve, Mapping):
                ready = _Curve("ready", ladders=dict(curve))
            else:
                ready = _Curve("ready", tuple(curve))
            with self._lock:
                if key in self._curves:  # not forgotten (a newer plan) meanwhile
                    self._curves[key] = ready

        logger.info("tuner: %s: building plan %s's capacity curve", key[0], key[1])
        try:
            self._submit(work)
        except Exception as error:  # no worker to run it
            self._curve_failed(key, error)

    def _curve_failed(self, key: tuple[str, int, float], error: BaseException) -> None:
        reason = str(error) or type(error).__name__
        logger.warning(
            "tuner: %s: plan %s has no capacity curve (%s); the tuner keeps InferLine's model",
            key[0],
            key[1],
            reason,
        )
        with self._lock:
            if key in self._curves:
                self._curves[key] = _Curve("failed", reason=reason)

    def _forget_curves(self, app: str, keep: tuple[str, int, float] | None) -> None:
        """Drop ``app``'s cached curves but ``keep`` (call with the lock held)."""
        for key in [k for k in self._curves if k[0] == app and k != keep]:
            del self._curves[key]


def live_reach(
    planned: float, observed: float | None, samples: int, *, held: bool = False
) -> float | None:
    """The share of the app's queries to size a cascade's later stage for: ``observed`` (the
    reach at the spec's thresholds the serving loop measured on ``samples`` of the first model's
    samples) where it rests on :data:`REACH_MIN_SAMPLES` and lies more than
    :data:`REACH_NOISE_SD` binomial standard deviations from ``planned`` (the plan's scale
    factor), or more than :data:`REACH_HOLD_SD` where it was ``held`` (used at the last tick:
    a reading about the band's edge stays where it is rather than move the need by the band's
    width at each crossing); None (the plan's) otherwise.

    >>> live_reach(0.3, 0.6, 1000), live_reach(0.3, 0.32, 1000), live_reach(0.3, 0.6, 50)
    (0.6, None, None)
    >>> live_reach(0.3, 0.33, 1000), live_reach(0.3, 0.33, 1000, held=True)
    (None, 0.33)
    """
    if observed is None or samples < REACH_MIN_SAMPLES or not math.isfinite(observed):
        return None
    p = min(max(planned, 0.0), 1.0)
    band = REACH_HOLD_SD if held else REACH_NOISE_SD
    noise = band * math.sqrt(p * (1.0 - p) / samples)
    if abs(observed - planned) <= noise:
        return None
    # A stage nothing reaches keeps a scale factor above 0 (a stage's is > 0): its fleet
    # falls to its minimum all the same.
    return min(max(observed, MIN_REACH), 1.0)


def _whole_rho(stage: TunerStage, peak_qps: float) -> float:
    """The utilisation target of a stage sized for a live reach: the plan's, or the one between
    its planned fleet and that fleet less an instance (:func:`utilisation_target`'s
    ``whole_instances``, as the replay's InferLine cascades take it) where higher. A later
    stage planned at one whole instance for a small planned share reads a tiny utilisation
    (0.09 on the demo's medium model), and a live reach seven times the plan's bought eleven
    times the capacity its live load needed."""
    whole = utilisation_target(
        stage.fleet,
        stage.rate_per_instance_qps,
        stage.scale_factor,
        peak_qps,
        stage.capacity_model,
        whole_instances=True,
    )
    return max(stage.utilisation_target, whole)


def _reach_words(reach: Mapping[str, float]) -> str:
    return (
        f"s is the reach at the spec's thresholds the last minute's answers show"
        f" ({reach['observed']:.3g} of {reach['samples']:.0f} samples; planned"
        f" {reach['planned']:.3g})"
    )


def plan_ladder(app: ResolvedApp, plan: PlanRecord) -> SizingLadder:
    """The sizing ladder of ``plan``'s single stage (:func:`controlplane.policies.capacity_curve.
    build_ladder`) on the plan's own planning trace, made again from the generator parameters
    the API stored with it (``trace.request``; a plan without them: a Poisson trace at its
    planned rate), with the plan's seed, for its own burstiness and those of
    :data:`controlplane.policies.capacity_curve.DEFAULT_BURSTINESS` (docs/tuner.md,
    "Burstiness"). Tens of plans: never on the tick.

    Raises:
        ValueError: a plan of several stages, or one the planner places nothing for at its rate.
        EstimatorError, InvalidValueError: what the planner or the trace generator raise.
    """
    return _plan_ladder(app, plan, DEFAULT_LADDER_LOADS, DEFAULT_BURSTINESS)


def plan_ladders(app: ResolvedApp, plan: PlanRecord) -> dict[str, SizingLadder]:
    """The sizing ladders of ``plan``'s stages by name, what the live tuner sizes with: a single
    stage's :func:`plan_ladder`; a cascade's :func:`controlplane.policies.capacity_curve.
    cascade_sizing` on the plan's own planning trace (made again as :func:`plan_ladder` makes
    it): each rung one plan of the whole cascade, each stage keeping its own fleet, refined where
    a fleet changes, with the same burstiness families, as ``heteroplane replay`` sizes the
    cascade. A stage the planner places nothing for has no ladder (InferLine's model there).
    Tens of plans of the whole cascade: never on the tick.

    Raises:
        ValueError: the planner places no stage at the plan's rate.
        EstimatorError, InvalidValueError: what the planner or the trace generator raise.
    """
    document = plan.plan
    if len(document.stages) == 1:
        ladder = plan_ladder(app, plan)
        return {ladder.stage: ladder}
    trace, _ = planning_trace(app, burstiness_replanning_request(document))
    ladders, _options = cascade_sizing(app, document, trace, seed=document.seed or 0)
    if not ladders:
        raise ValueError("the planner places no stage for the planning trace at its own rate")
    return ladders


def plan_capacity_curve(app: ResolvedApp, plan: PlanRecord) -> tuple[tuple[float, float], ...]:
    """The capacity curve of ``plan``'s single stage (:func:`controlplane.policies.capacity_curve.
    capacity_curve`) at its six loads, on the planning trace :func:`plan_ladder` uses: the load
    model without the mix (the planned types only).

    Raises:
        As :func:`plan_ladder`.
    """
    return _plan_ladder(app, plan, DEFAULT_LOADS).curve


def _plan_ladder(
    app: ResolvedApp,
    plan: PlanRecord,
    loads: Sequence[float],
    burstiness: Sequence[float] = (),
) -> SizingLadder:
    document = plan.plan
    if len(document.stages) != 1:
        raise ValueError(f"plan {plan.id} has {len(document.stages)} stages, not one")
    (stage,) = document.stages
    trace, _ = planning_trace(app, burstiness_replanning_request(document))
    ladder = build_ladder(
        app,
        stage.name,
        trace,
        dispatch=mix_dispatch(stage),
        batch_size=stage.batch_size,
        seed=document.seed or 0,
        loads=loads,
        also_types=[t for t, n in stage.fleet.items() if n],
        burstiness=burstiness,
    )
    if ladder is None or not ladder.curve:
        raise ValueError("the planner places nothing for the planning trace at its own rate")
    return ladder


def stage_rates_qps(
    resolved: ResolvedApp, document: PlanDocument, types: Sequence[str] | None = None
) -> list[dict[str, float]]:
    """mu_t of each stage of the plan, for each type of its fleet (or each of ``types``): what
    one instance of type t serves of the stage's model at the stage's batch size
    (:func:`rate_per_instance_qps` on the profile's smallest batch), the rate the tuner sizes
    the stage with (and the dashboard's capacity figure reads)."""
    rates: list[dict[str, float]] = []
    for entry in document.stages:
        mu: dict[str, float] = {}
        for t in types if types is not None else entry.fleet:
            if types is not None or entry.fleet[t] > 0:
                mu[t] = _rate_at(resolved.profile(entry.name, t), entry.batch_size)
        rates.append(mu)
    return rates


def _rate_at(profile: LatencyProfile, batch_size: int) -> float:
    """mu_t by ``profile`` at a stage's ``batch_size`` (see :func:`stage_rates_qps`)."""
    smallest = np.array([profile.min_batch_size], dtype=np.int64)
    return rate_per_instance_qps(profile, smallest, batch_size)


@functools.lru_cache(maxsize=4)
def synthetic_planning_arrivals(rate_qps: float) -> NDArray[np.float64]:
    """The stand-in planning trace of a plan at ``rate_qps``: :data:`SYNTHETIC_PLANNING_S` of
    Poisson arrivals, seeded :data:`SYNTHETIC_SEED` (read-only; drawn once per rate, since a
    recalibration or a re-plan check asks for the same one again)."""
    arrivals = poisson_arrivals(
        rate_qps, SYNTHETIC_PLANNING_S, np.random.default_rng(SYNTHETIC_SEED)
    )
    arrivals.flags.writeable = False
    return arrivals


@functools.lru_cache(maxsize=16)
def synthetic_planning_envelope(
    rate_qps: float, service_time_s: float, max_window_s: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """:func:`~controlplane.policies.tuner.planning_envelope` of
    :func:`synthetic_planning_arrivals` at ``rate_qps``, for a plan that stores none; kept, since
    a recalibration or a re-plan check asks for the same one again."""
    return planning_envelope(synthetic_planning_arrivals(rate_qps), service_time_s, max_window_s)


def _batch_caps(
    tuned: _AppTuner, state: TunerState, arrival_s: NDArray[np.float64], now_s: float
) -> dict[str, int]:
    """The batch cap of a single stage sized by its ladder (:func:`live_batch` on the fleet
    serving now, the booting instances left out, on the ladder of the burstiness the tuner
    reads); empty for a cascade (its gears set its caps) or a stage without rung batches."""
    if len(tuned.stages) != 1:
        return {}
    (stage,) = tuned.stages
    ready: Mapping[str, int] = ready_fleets(state, now_s).get(stage.name, {})
    cap = live_batch(stage, ready, arrival_s, now_s, tuned.config)
    return {} if cap is None else {stage.name: cap}


def _cap_key(decision: ScalingDecision) -> str:
    """The identity of a budget cap in the decision log: its stage and the type it lacks (the
    count it lacks may move from tick to tick; the row keeps the newest)."""
    return f"{decision.stage}:{decision.instance_type}"


# The rows of instances launched whose workers do not serve yet.
_NOT_SERVING_YET = (InstanceState.REQUESTED.value, InstanceState.PENDING.value)


def _still_booting(
    state: TunerState, waiting: Sequence[InstanceRecord], now_s: float
) -> TunerState:
    """``state`` with an instance booting for each of ``waiting`` (the app's rows launched and
    not yet serving, profile runs' and rollouts' workers aside) that its modelled boots do not
    cover, on the stage whose fleet holds its type, until its row runs. The tuner's boot times
    are a model (``default_boot_s``: a GPU's minute), while a GPU worker pulls its image and
    loads its models in minutes: a mix change from cpus to a gpu read the gpu as serving after
    its minute and stopped the cpus while it still booted (the reconciler's guard kept one of
    them, and the disruption budget slowed the rest), and the stage served on one cpu."""
    booting = [b for b in state.booting if b.ready_at_s > now_s]
    counts: dict[str, int] = {}
    for row in waiting:
        if not is_profile_worker(row.request_id):
            counts[row.instance_type] = counts.get(row.instance_type, 0) + 1
    # Ready a hair after now: booting at this tick, read again at the next.
    ready_at_s = math.nextafter(now_s, math.inf)
    added: list[Booting] = []
    for name, count in sorted(counts.items()):
        short = count - sum(1 for b in booting if b.instance_type == name)
        for stage, fleet in state.fleets.items():
            if short <= 0:
                break
            already = sum(
                1 for b in (*booting, *added) if (b.stage, b.instance_type) == (stage, name)
            )
            more = min(short, fleet.get(name, 0) - already)
            if more > 0:
                added.extend(Booting(stage, name, now_s, ready_at_s) for _ in range(more))
                short -= more
    if not added:
        return state
    return dataclasses.replace(state, booting=(*booting, *added))


def _held_types(state: TunerState) -> dict[str, set[str]]:
    """Stage -> the types the tuner's fleet names: those it runs (booting ones included) and
    those it shed (a fleet keeps the zero of a type it stopped, and the tick prices it)."""
    return {stage: set(fleet) for stage, fleet in state.fleets.items()}


def _rating_held(ladder: SizingLadder, stage: TunerStage, held: Collection[str]) -> SizingLadder:
    """``ladder`` with mu_t, from ``stage`` (set up on the profiles), for the types of ``held``
    it has no rate for: the ladders of a new budget place no type the budget makes too dear,
    while the fleet the tuner reached may still run one the sizing model added (it is shed on
    the tick, which needs its rate and price)."""
    rates = ladder.rate_per_instance_qps
    missing = {
        t: stage.rate_per_instance_qps[t]
        for t in sorted(held)
        if t not in rates and t in stage.rate_per_instance_qps
    }
    if not missing:
        return ladder
    return dataclasses.replace(ladder, rate_per_instance_qps={**rates, **missing})


def _rate_or_none(resolved: ResolvedApp, entry: StagePlan, instance_type: str) -> float | None:
    """mu_t of ``entry``'s model on a type its planned fleet does not hold (as
    :func:`stage_rates_qps` computes it), None where the app has no profile for it."""
    try:
        profile = resolved.profile(entry.name, instance_type)
    except (EstimatorError, KeyError, ValueError):
        return None
    return _rate_at(profile, entry.batch_size)


def _slower(new: Sequence[TunerStage], old: Sequence[TunerStage]) -> bool:
    """Whether any type of any stage serves fewer queries a second in ``new`` (set up on
    recalibrated profiles) than in ``old``."""
    return any(
        rate < old_stage.rate_per_instance_qps[t] * (1.0 - 1e-9)
        for new_stage, old_stage in zip(new, old, strict=True)
        for t, rate in new_stage.rate_per_instance_qps.items()
        if t in old_stage.rate_per_instance_qps
    )


# A stage whose utilisation target is under 1 / FAR_OVER_LOAD of its whole-instance one is sized
# by whole instances far over its load (one instance of 2,300 qps for 15 qps), not by its load:
# a recalibration restores what its load needs, not its capacity in qps.
FAR_OVER_LOAD = 2.0


def _recalibrated(new: TunerStage, old: TunerStage, peak_qps: float) -> TunerStage:
    """A stage set up again on recalibrated profiles (``new``), keeping what the plan meant: the
    capacity in qps its planned load needs at headroom rho_m, at most its capacity before
    (each type's count in ``old``, the stage as the tuner had it, scaled by that share of it
    and by old mu_t / new mu_t, rounded up, never below that count, so the tuner restores a
    plan the slower instances no longer carry), and that rho_m. A stage sized by its load (its
    rho_m before at least half its whole-instance headroom, :func:`_whole_rho`,
    :data:`FAR_OVER_LOAD`) keeps its rho_m and all its capacity in qps, as InferLine does. One
    far over its load takes rho_m as the whole-instance headroom, at most its rho_m before times
    the drift (the least old mu_t / new mu_t of its types, at least 1): a plan of one instance far
    over its load (rho 0.007: a planned peak of 15 qps on an instance serving 2,300) kept all
    of its capacity in qps, and a drift of 4x bought three more instances for an app planned
    at 5 qps; but instances found slower never make the tuner want fewer of them for a load
    than before (the whole-instance rho_m of a stage of two at rho 0.38, taken at a drift of
    1.1x, stopped one at the planned load), and the same profiles found again change nothing
    (each recalibration raised rho_m again; the second one restored the plan's counts, losing
    the first one's drift)."""
    rates_old, rates_new = old.rate_per_instance_qps, new.rate_per_instance_qps
    drift = max(
        1.0,
        min(
            (rates_old[t] / rates_new[t] for t in old.fleet if t in rates_old and t in rates_new),
            default=1.0,
        ),
    )
    whole = _whole_rho(old, peak_qps)
    if old.utilisation_target * FAR_OVER_LOAD >= whole:
        # Sized by its load (its headroom near the whole-instance one): the plan's capacity in
        # qps restored at its headroom, as InferLine keeps rho_m (a whole-instance rho_m there
        # restored one instance fewer of a stage of four at rho 0.8 found 3x slower).
        rho, share = old.utilisation_target, 1.0
    else:
        rho = min(whole, old.utilisation_target * drift)
        planned = old.planned_capacity_qps
        share = min(1.0, peak_qps * old.scale_factor / rho / planned) if planned > 0.0 else 1.0
    fleet = {}
    for t, n in new.fleet.items():
        had = old.fleet.get(t, n)
        fleet[t] = (
            max(had, math.ceil(had * share * rates_old[t] / rates_new[t] - 1e-9))
            if t in rates_old and t in rates_new
            else had
        )
    return dataclasses.replace(new, fleet=fleet, utilisation_target=rho)


def _planned_envelope(
    plan: PlanDocument, max_window_s: float
) -> tuple[tuple[float, ...], tuple[float, ...]] | str | None:
    """A plan's envelope as (windows s, rates qps), its windows up to ``max_window_s``; ``None``
    when the plan has none, and what is wrong (one line) when it is malformed or has no window
    the tuner uses."""
    if plan.envelope_problem is not None:
        return plan.envelope_problem
    if not plan.envelope_windows_s:
        return None
    kept = [
        (w, r)
        for w, r in zip(plan.envelope_windows_s, plan.envelope_rate_qps, strict=True)
        if w <= max_window_s
    ]
    if not kept:
        return f"no window within the tuner's longest, {max_window_s:g} s"
    return tuple(w for w, _ in kept), tuple(r for _, r in kept)


def _summed(state: TunerState) -> dict[str, int]:
    return _summed_fleets(state.fleets)


def _summed_fleets(fleets: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for fleet in fleets.values():
        for name, count in fleet.items():
            total[name] = total.get(name, 0) + count
    return total


# The numbers key of a scale decision that holds the tuner's fleets after it, by stage.
FLEETS_AFTER = "fleets_after"
# A reached fleet within a budget (the reconciler's and the drain's float tolerance).
_BUDGET_SLACK_USD_PER_HR = 1e-9


def _fleets_of(state: TunerState) -> dict[str, dict[str, int]]:
    return {stage: {t: int(n) for t, n in fleet.items()} for stage, fleet in state.fleets.items()}


def _reached_fleets(
    store: Store, app: AppRecord, plan: PlanRecord
) -> dict[str, dict[str, int]] | None:
    """The fleets by stage the tuner had reached on the applied ``plan``
    (:func:`controlplane.loops.reached.newest`), or None: none was reached, or it cost more
    than the lowest budget the app has had since (a budget cut while no tuner ran writes no
    tuner decision; the plan's fleet is the start then, and the first tick sheds what is still
    over)."""
    decision = newest(store, app.name, plan, TUNER_KINDS, FLEETS_AFTER)
    if decision is None:
        return None
    cost = decision.numbers.get("cost_usd_per_hr_after")
    budget = lowest_budget_since(store, app.name, decision.at, app.budget_usd_per_hr)
    if not isinstance(cost, int | float) or cost > budget + _BUDGET_SLACK_USD_PER_HR:
        return None
    value = decision.numbers[FLEETS_AFTER]
    if not isinstance(value, dict):
        return None
    fleets = {stage: counts(fleet) for stage, fleet in value.items() if isinstance(stage, str)}
    if len(fleets) != len(value) or any(fleet is None for fleet in fleets.values()):
        return None
    return {stage: fleet for stage, fleet in fleets.items() if fleet is not None}
