"""The gear switcher on live traffic: CascadeServe's producer (:mod:`controlplane.policies.gears`)
fed by the service.

This module owns :class:`LiveGears`, the composition of the pure switcher with the service. An
app whose applied plan carries a ``gear_plan`` (the planner adds one to a cascade with validation
records, ``controlplane.policies.planner``) is served by gears. The work is split in two:

- :meth:`LiveGears.refresh`, once per tuner tick (about 1 s), after the tuner, does what reads
  the store: which apps have an applied gear plan (parsed, with its profiles, once per plan:
  each placed model's on every type of the placement; the profiles of a type the fleet gains
  outside the placement when it appears),
  the share of the fleet the budget pays for, and whether the tuner's budget caps the app now;
- :meth:`LiveGears.switch_tick`, CascadeServe's producer, runs every ``gear_interval_s`` (the
  settings', 0.1 s as in the paper: the service's ``gears`` job) on that cached state only: it
  measures the app's arrival rate over the sliding window of the last ``window_s`` (the serving
  loop's observed arrivals), reads the first model's queue and the ready workers (their types
  and the stages whose slots they hold) from the loop's status snapshot (in memory) and calls
  :func:`controlplane.policies.gears.switch`.
  It touches the store only to record a change. The paper counts the queries of each 100 ms
  interval, at thousands of QPS; at the tens of QPS of a small fleet a 100 ms count is 0 to a
  few queries, so the rate is measured over a sliding window (``DEFAULT_WINDOW_S``, 5 s)
  evaluated every 100 ms: the gear reacts within 100 ms to what the window shows, the window
  keeps the count from being noise.

Each evaluation:

- the QPS is divided by the capacity share (the share of every placed model's planned capacity
  that the healthy workers serve at once, each worker's time split among the models it hosts:
  :func:`ready_share`), so that while instances boot, or after one died,
  a faster gear carries the load, and a more accurate one follows once they serve (or once the
  tuner's added instances serve: the share then passes 1);
- a move to a slower, more accurate gear waits while qps < alpha x the first queue (the backlog of
  the fast interval drains first, alpha = 8) or while the tuner reports that the budget caps the
  fleet (``capped(app)``; the gear holds ``cap_hold_s`` past the last such tick): the load the
  budget cannot buy is carried by the faster gear instead of missing the SLO;
- the switcher's :class:`~controlplane.policies.gears.Hysteresis` (the settings' ``gear_*``: a
  dead band below each range, a hold before a move down, a dwell between switches) keeps the
  gear from flapping on the window's noise.

Every switch to another cascade (and the start, when a plan with gears is applied) is recorded
as a ``gear_switch`` decision with its reason and numbers; a move between gears of the same
cascade changes only the batch trigger the loop is given, and is not recorded.
:meth:`LiveGears.gear` is the serving loop's hook (``controlplane.serving.loop.GearHook``): the
gear in force as a :class:`~controlplane.serving.dispatcher.ServingGear` (its cascade, batch caps,
and the fastest gear of the plan, which admission control judges by, and the gear's batch
trigger: the minimum queue length of each model and the starvation guard). Apps without a gear
plan are served as their spec says (the hook answers None). :meth:`LiveGears.tick` is both steps
at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from controlplane.clock import Clock
from controlplane.db.store import AppRecord, DecisionRecord, InstanceRecord, PlanRecord, Store
from controlplane.errors import ControlPlaneError, NotFoundError
from controlplane.loops.live_tuner import ArrivalSource, ResolveFn
from controlplane.policies.gears import (
    ALPHA,
    DEFAULT_CAP_HOLD_S,
    NO_CAPACITY_SHARE,
    GearDecision,
    GearPlan,
    GearSwitcher,
    Hysteresis,
    WorkerGroup,
    pooled_share,
    start_switcher,
    switch,
)
from controlplane.policies.lifecycle import KEPT_STATES, is_profile_worker
from controlplane.policies.variants import percent_places
from controlplane.serving.config import batch_gear
from controlplane.serving.dispatcher import AppStatus, ServingGear
from estimator.errors import EstimatorError
from estimator.profiles import LatencyProfile

__all__ = ["DEFAULT_WINDOW_S", "GearTable", "LiveGears", "logged_gear"]

logger = logging.getLogger(__name__)

# The producer's measuring window, sliding: evaluated every gear_interval_s (0.1 s). CascadeServe
# counts each 100 ms at thousands of QPS; at the tens of QPS of a small fleet a few seconds are
# needed for a count that is not noise.
DEFAULT_WINDOW_S = 5.0
# Shares kept per app (ready ones by workers and batch caps, the kept fleet's by its counts and
# caps) before the cache starts again.
_CACHED_SHARES = 64


@dataclass(slots=True)
class _AppGears:
    plan_id: int
    plan: GearPlan
    state: GearSwitcher
    profiles: Mapping[str, Mapping[str, LatencyProfile]]
    # Whether any of the app's stages has had ready capacity since the plan took force: before
    # the first worker is up there is nothing to switch for (the share would read as none).
    ready_once: bool = False
    # From the last refresh (the store and the tuner): the share of the fleet the budget pays
    # for, and whether the budget caps the fleet.
    affordable: float = 1.0
    budget_capped: bool = False
    # The kept fleet (requested, pending, running) by type, from the last refresh.
    kept: dict[str, int] = field(default_factory=dict)
    # The types whose profiles were looked for (the placement's, then the kept fleet's).
    looked_up: set[str] = field(default_factory=set)
    shares: dict[object, float] = field(default_factory=dict)  # solved shares (_CACHED_SHARES)


def serving_gear(plan: GearPlan, gear: int) -> ServingGear:
    """The dispatcher's view of gear ``gear`` of ``plan``: its cascade and batch caps, and the
    plan's fastest option as the cheapest gear admission control may count on."""
    option = plan.option_of(gear)
    fastest = max(plan.options, key=lambda o: (o.max_qps, o.quality.accuracy))
    return ServingGear(
        cascade=option.cascade,
        max_batch_queries=dict(zip(option.cascade.models, option.max_batch_queries, strict=True)),
        cheapest=fastest.cascade,
        min_queue=dict(zip(option.cascade.models, plan.min_queue_of(gear), strict=True)),
        max_wait_s=plan.gears[gear].max_wait_ms / 1000.0,
    )


def _rates_and_demand(
    plan: GearPlan,
    caps: Mapping[str, int],
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """Per (model, type) with a profile its rate at the model's batch cap k (1000 k / L(k)
    samples/s), and per placed model the placement's capacity at the same cap (its demand: the
    capacity the plan gives it)."""
    rates: dict[tuple[str, str], float] = {}
    for model, by_type in profiles.items():
        for instance_type, profile in by_type.items():
            k = caps.get(model, profile.min_batch_size)
            k = max(profile.min_batch_size, min(k, profile.max_batch_size))
            ms = profile.mean_latency_ms(k)
            if ms > 0:  # a cell of no time (no profile stores one) gives no rate
                rates[(model, instance_type)] = 1000.0 * k / ms
    demand = {
        model: sum(
            count * rates.get((model, instance_type), 0.0)
            for instance_type, count in plan.placement.fleets[model].items()
            if count > 0
        )
        for model in plan.placement.order
        if model in caps
    }
    return rates, demand


def ready_share(
    plan: GearPlan,
    status: AppStatus | None,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    cache: dict[object, float] | None = None,
) -> float:
    """Ready capacity over the placement's: the largest share of every placed model's planned
    capacity (at its stage's batch cap in force) that the app's healthy workers serve at once
    (:func:`~controlplane.policies.gears.pooled_share`: each worker's time split among the
    models it hosts, as the stages' slots in the status say; a worker of a co-located cascade
    counts once, not once per model, and a worker of a type outside the placement counts where
    ``profiles`` has its rate). 1 without a status (the loop has not served the app yet); above
    1 once more workers serve than planned; never below 1e-6 (no capacity at all: the fastest
    gear). ``cache``: the shares solved before for these profiles, by workers and caps (the
    switcher asks every 100 ms; the workers seldom change)."""
    if status is None:
        return 1.0
    stages = {stage.model: stage for stage in status.stages if stage.model in plan.placement.fleets}
    caps = {model: stage.max_batch_queries for model, stage in stages.items()}
    hosted: dict[str, set[str]] = {}
    for model, stage in stages.items():
        for instance_id in stage.states:
            hosted.setdefault(instance_id, set()).add(model)
    groups: Counter[WorkerGroup] = Counter(
        (worker.instance_type, frozenset(hosted.get(worker.instance_id, ())))
        for worker in status.workers
        if worker.healthy
    )

    def solve() -> float:
        rates, demand = _rates_and_demand(plan, caps, profiles)
        return max(pooled_share(groups, rates, demand), NO_CAPACITY_SHARE)

    key = (frozenset(groups.items()), frozenset(caps.items()))
    return solve() if cache is None else _cached(cache, key, solve)


def _cached(cache: dict[object, float], key: object, solve: Callable[[], float]) -> float:
    """``cache[key]``, solved and kept when missing (the cache starts again past
    :data:`_CACHED_SHARES` entries)."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= _CACHED_SHARES:
            cache.clear()
        found = cache[key] = solve()
    return found


def kept_share(
    plan: GearPlan,
    kept: Mapping[str, int],
    caps: Mapping[str, int],
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
) -> float:
    """The share of the placement's capacity that the kept fleet (``kept``: instances by type,
    booting ones included) would serve with every instance hosting every placed model it has
    a profile for, at the batch caps ``caps`` (a model absent from ``caps`` at its smallest)."""
    every = {model: caps.get(model, 1) for model in plan.placement.order}
    rates, demand = _rates_and_demand(plan, every, profiles)
    models = frozenset(plan.placement.order)
    groups = {(instance_type, models): count for instance_type, count in kept.items()}
    return pooled_share(groups, rates, demand)


def logged_gear(store: Store, app: str, plan: PlanRecord, gears: int) -> DecisionRecord | None:
    """The newest ``gear_switch`` decision of ``app`` where it names a gear (of ``gears``) of
    ``plan`` since it was applied: the gear in force when the switcher that made it stopped;
    None where the newest names none (a set-aside, the plan new to the log)."""
    if plan.applied_at is None:
        return None
    found = store.list_decisions(app, kinds=["gear_switch"], limit=1)
    if not found:
        return None
    last = found[-1]
    gear = last.numbers.get("gear")
    if (
        last.at < plan.applied_at
        or last.numbers.get("plan_id", plan.id) != plan.id
        or type(gear) is not int
        or not 0 <= gear < gears
    ):
        return None
    return last


def _under_floor(document: Mapping[str, Any], floor: float) -> list[str]:
    """The cascades (with their accuracy) that gears of the gear plan ``document`` serve under
    ``floor``: the accuracy each gear states, held-out where the plan was scored on held-out
    records (the figure a floor is checked against, ``GearOption.accuracy``)."""
    missed: dict[str, str] = {}
    for gear in document.get("gears", ()):
        if not isinstance(gear, Mapping):
            continue
        accuracy = gear.get("held_out_accuracy")
        if not isinstance(accuracy, int | float):
            accuracy = gear.get("accuracy")
        if isinstance(accuracy, int | float) and accuracy < floor:
            label = str(gear.get("cascade"))
            missed[label] = f"{label} ({100 * accuracy:.{percent_places(accuracy, floor)}f}%)"
    return list(missed.values())


class LiveGears:
    """CascadeServe's gear switcher over every app whose applied plan has a gear plan
    (thread-safe: :meth:`gear` is read by the serving loop, :meth:`refresh` and
    :meth:`switch_tick` run in the scheduler's threads).

    ``arrivals`` and ``statuses`` are the serving loop's (``observed_arrivals``, ``statuses``);
    ``resolve`` gives an app's profiles (the API's resolver).
    """

    def __init__(
        self,
        store: Store,
        clock: Clock,
        arrivals: ArrivalSource,
        statuses: Callable[[], Sequence[AppStatus]],
        resolve: ResolveFn,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        alpha: float = ALPHA,
        cap_hold_s: float = DEFAULT_CAP_HOLD_S,
        hysteresis: Hysteresis | None = None,
    ) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be finite and > 0, got {window_s!r}")
        self._store = store
        self._clock = clock
        self._arrivals = arrivals
        self._statuses = statuses
        self._resolve = resolve
        self._window_s = float(window_s)
        self._alpha = float(alpha)
        self._cap_hold_s = float(cap_hold_s)
        self._hysteresis = Hysteresis() if hysteresis is None else hysteresis
        self._apps: dict[str, _AppGears] = {}
        self._serving: dict[str, ServingGear] = {}
        # Per app, the (plan id, the spec's serving order, its accuracy floor) whose gear plan was
        # set aside because the spec changed under it (recorded once, not every refresh).
        self._set_aside: dict[str, tuple[int, tuple[str, ...], object]] = {}
        self._lock = threading.Lock()  # _apps and _serving (read by the serving loop)
        # The leader term in which refresh last read the store (None: not yet). ``term`` says
        # the term now (a loops process's leader lease, ``Leadership.terms``; one term without).
        self._refreshed: int | None = None
        self.term: Callable[[], int] = lambda: 0
        self._ticking = threading.RLock()  # one refresh or switch at a time
        # The spot prices now (the reconciler's, docs/spot.md): the affordable share costs spot
        # instances at them, so that a spot price rise past the budget moves the gear before
        # the reconciler drains. None: at the prices they were launched at.
        self.spot_prices: Callable[[AppRecord, Collection[str]], Mapping[str, float]] | None = None

    def gear(self, app: str) -> ServingGear | None:
        """The gear in force for ``app``; None when it is not served by gears."""
        with self._lock:
            return self._serving.get(app)

    def in_force(self) -> dict[str, tuple[int, int]]:
        """Every app served by gears: its applied plan's id and the gear in force (what a loops
        process running apart sends the serving process, :class:`GearTable`)."""
        with self._lock:
            return {app: (t.plan_id, t.state.gear) for app, t in self._apps.items()}

    def tick(self, capped: Callable[[str], bool] = lambda _app: False) -> list[GearDecision]:
        """:meth:`refresh` then :meth:`switch_tick`: the decisions that switched a gear."""
        self.refresh(capped)
        return self.switch_tick()

    def refresh(
        self,
        capped: Callable[[str], bool] = lambda _app: False,
        apps: Sequence[AppRecord] | None = None,
    ) -> None:
        """Read the store (once per tuner tick): every app with an applied gear plan is tracked
        (a new plan starts its switcher, recorded), the others are served as their spec says;
        each tracked app's affordable share and ``capped(app)`` (whether the tuner's budget caps
        it now) are kept for :meth:`switch_tick`. ``apps``: the tick's snapshot of the store's
        apps, else read now."""
        with self._ticking:
            term = self.term()
            if self._refreshed is not None and self._refreshed != term:
                # Led again after a term of another replica's: what it tracked is of before
                # that (the other's switches are in the log), so it starts again from the log.
                # The gears it serves stay until this refresh has read each app again.
                with self._lock:
                    self._apps.clear()
                self._set_aside.clear()
            now_s = self._clock.now_s()
            listed = set()
            for app in self._store.list_apps() if apps is None else apps:
                listed.add(app.name)
                try:
                    self._refresh_app(app, now_s, capped(app.name))
                except NotFoundError:  # deleted since the tick listed it: forgotten below
                    listed.discard(app.name)
                except (EstimatorError, KeyError, ValueError) as error:
                    # A gear plan that no longer reads (a profile gone): the app is served as
                    # its spec says until the next refresh reads one again.
                    logger.warning("gears: %s served without gears: %s", app.name, error)
                    self._forget(app.name)
            with self._lock:
                gone = [name for name in self._apps if name not in listed]
                # What it served before a term of another replica's and tracks no more.
                gone += [name for name in self._serving if name not in self._apps]
            for name in gone:
                self._forget(name)
            self._refreshed = term

    def refreshed(self) -> bool:
        """Whether :meth:`refresh` has read the store in the leader term now (:attr:`term`):
        until then :meth:`in_force` names no app, not for want of gears, or names what the
        switcher tracked before another replica led (a loops process running apart sends the
        serving process no gears until then,
        :class:`~controlplane.loops.remote_serving.RemoteServing`)."""
        return self._refreshed is not None and self._refreshed == self.term()

    def switch_tick(self) -> list[GearDecision]:
        """One producer evaluation (every ``gear_interval_s``) for every tracked app, on the
        state the last :meth:`refresh` cached and the serving loop's memory: no store reads;
        a switch is recorded. The decisions that switched a gear's cascade."""
        with self._ticking:
            if not self.refreshed():
                return []  # led again: the switcher tracks nothing before its refresh reads
            now_s = self._clock.now_s()
            with self._lock:
                tracked_apps = list(self._apps.items())
            if not tracked_apps:
                return []
            statuses = {status.app: status for status in self._statuses()}
            changed: list[GearDecision] = []
            for name, tracked in tracked_apps:
                decision = self._switch_app(name, tracked, now_s, statuses.get(name))
                if decision is not None:
                    changed.append(decision)
            return changed

    def budget_changed(self, app: str) -> GearDecision | None:
        """Run the switcher for ``app`` now (its budget has just changed): a budget below the
        fleet's cost moves the gear before the reconciler drains (the switch is recorded before
        this returns). The decision that switched the cascade, if any."""
        try:
            record = self._store.get_app(app)
        except NotFoundError:
            return None
        with self._ticking:
            now_s = self._clock.now_s()
            try:
                self._refresh_app(record, now_s, False)
            except (EstimatorError, KeyError, ValueError) as error:
                logger.warning("gears: %s served without gears: %s", app, error)
                self._forget(app)
                return None
            with self._lock:
                tracked = self._apps.get(app)
            if tracked is None:
                return None
            status = next((s for s in self._statuses() if s.app == app), None)
            return self._switch_app(app, tracked, now_s, status)

    def _look_up_profiles(self, app: AppRecord, tracked: _AppGears) -> None:
        """The profiles of the kept fleet's types outside the placement (a stand-in, a type the
        tuner chose), where the app has them: its workers count where they have a rate."""
        new = set(tracked.kept) - tracked.looked_up
        if not new:
            return
        resolved = self._resolve(app)
        profiles = {m: dict(by_type) for m, by_type in tracked.profiles.items()}
        for instance_type in sorted(new):
            for model in tracked.plan.placement.order:
                with contextlib.suppress(EstimatorError, KeyError, ValueError):
                    profiles[model][instance_type] = resolved.profile(model, instance_type)
            if any(instance_type in by_type for by_type in profiles.values()):
                tracked.looked_up.add(instance_type)  # else asked again at the next refresh
        if tracked.looked_up & new:  # a profile found: the shares solved without it are stale
            tracked.profiles = profiles
            tracked.shares.clear()

    def _affordable_share(self, app: AppRecord, kept: Sequence[InstanceRecord]) -> float:
        """The share of the app's kept fleet (requested, pending, running) its budget pays for:
        budget / fleet cost when the fleet costs more, else 1 (never below 1e-6). Spot
        instances are costed at the spot prices now where :attr:`spot_prices` is given (a rise
        past the budget is a cut of the budget: the faster gear carries the load the budget no
        longer buys, before the reconciler drains)."""
        spot_types = {i.instance_type for i in kept if i.market == "spot"}
        now = (
            self.spot_prices(app, spot_types) if spot_types and self.spot_prices is not None else {}
        )
        cost = sum(
            now.get(i.instance_type, i.price_usd_per_hr)
            if i.market == "spot"
            else i.price_usd_per_hr
            for i in kept
        )
        if cost <= app.budget_usd_per_hr or cost <= 0:
            return 1.0
        return max(app.budget_usd_per_hr / cost, NO_CAPACITY_SHARE)

    def _forget(self, app: str) -> None:
        with self._lock:
            self._apps.pop(app, None)
            self._serving.pop(app, None)

    def _aside(self, app: AppRecord, plan_id: int, document: Mapping[str, Any]) -> bool:
        """Whether the applied plan's gear plan (``document``) is set aside because the app's
        spec changed under it since the plan was made (``PUT`` or ``app apply``): it serves
        another cascade than the gear plan's order (its gears were chosen among the old models),
        or asks an accuracy floor (``slo.accuracy``) that the plan was not made for and that a
        gear of it misses (its accuracy, held-out where the plan has it, below the floor). The
        spec's own cascade serves until a plan is made for the new spec. Recorded as a
        ``gear_switch`` once per plan and spec."""
        spec = app.spec
        cascade = spec.get("cascade")
        if not isinstance(cascade, list):
            cascade = [m.get("name") for m in spec.get("models", ()) if isinstance(m, Mapping)]
        serving = tuple(str(m) for m in cascade)
        order = document.get("order")
        planned = tuple(str(m) for m in order) if isinstance(order, list) else ()
        slo = spec.get("slo")
        floor = slo.get("accuracy") if isinstance(slo, Mapping) else None
        why = None
        if planned and serving != planned:
            why = (
                f"it was made for the cascade {' -> '.join(planned)}, the spec now serves"
                f" {' -> '.join(serving)} (its own thresholds)"
            )
        elif isinstance(floor, int | float) and floor != document.get("accuracy_floor"):
            missed = _under_floor(document, float(floor))
            if missed:
                made = document.get("accuracy_floor")
                made_for = (
                    "no accuracy floor"
                    if not isinstance(made, int | float)
                    else f"an accuracy floor of {100 * made:g}%"
                )
                why = (
                    f"it was made for {made_for}, the spec now asks {100 * floor:g}%, which"
                    f" {', '.join(missed)} {'misses' if len(missed) == 1 else 'miss'} (the"
                    " spec's own cascade and thresholds serve)"
                )
        if why is None:
            self._set_aside.pop(app.name, None)
            return False
        if self._set_aside.get(app.name) != (plan_id, serving, floor):
            self._set_aside[app.name] = (plan_id, serving, floor)
            self._forget(app.name)
            reason = (
                f"gear plan of plan {plan_id} set aside: {why}; plan the app again for gears of"
                " this spec"
            )
            # Said already where the log's newest gear decision says it (a restarted loops
            # process, a new leader: each recorded it again at its first refresh).
            newest = self._store.list_decisions(app.name, kinds=["gear_switch"], limit=1)
            if not newest or newest[-1].reason != reason:
                self._store.record_decision(
                    app.name,
                    "gear_switch",
                    reason,
                    {"plan_id": plan_id, "cascade": " -> ".join(serving)},
                )
        return True

    def _measured_qps(self, app: str, now_s: float) -> float | None:
        """Arrivals per second over the sliding window; None for an app not served yet."""
        observed = self._arrivals(app)
        if observed is None:
            return None
        since = int(np.searchsorted(observed, now_s - self._window_s, side="right"))
        return float(observed.size - since) / self._window_s

    def _refresh_app(self, app: AppRecord, now_s: float, budget_capped: bool) -> None:
        plan_record = (
            self._store.get_applied_plan(app.name) if app.applied_plan_id is not None else None
        )
        document = plan_record.plan.gear_plan if plan_record is not None else None
        if plan_record is None or not document:
            self._forget(app.name)
            self._set_aside.pop(app.name, None)
            return
        if self._aside(app, plan_record.id, document):
            return
        with self._lock:
            tracked = self._apps.get(app.name)
        if tracked is None or tracked.plan_id != plan_record.id:
            measured_qps = self._measured_qps(app.name, now_s)
            if measured_qps is None and tracked is not None:
                return  # the new plan not served yet: nothing measured, nothing to switch
            plan = GearPlan.from_document(document)
            start = functools.partial(
                start_switcher,
                plan,
                alpha=self._alpha,
                cap_hold_s=self._cap_hold_s,
                hysteresis=self._hysteresis,
            )
            state = start(expected_qps=measured_qps or 0.0)
            resumed = (
                self._resumed(app.name, plan_record, state, now_s) if tracked is None else None
            )
            if measured_qps is None and resumed is None:
                return  # not served yet: nothing measured, nothing to switch
            resolved = self._resolve(app)
            profiles = {
                m: {t: resolved.profile(m, t) for t in plan.placement.fleets[m]}
                for m in plan.placement.order
            }
            # A worker of a type the placement puts on another stage serves a stage left
            # without its own (the serving loop's placement): it counts where the app has
            # that model's profile on it. Without the rate, a stage served only so read as no
            # capacity at all, and the fastest gear served every load.
            placed = sorted({t for m in plan.placement.order for t in plan.placement.fleets[m]})
            for m in plan.placement.order:
                for t in placed:
                    if t not in profiles[m]:
                        with contextlib.suppress(EstimatorError, KeyError, ValueError):
                            profiles[m][t] = resolved.profile(m, t)
            share = 1.0
            if resumed is None and measured_qps is not None:
                # The gear of the load on the capacity that serves (the tuner's workers past the
                # placement lift it): started on the measured rate alone, a fleet the tuner had
                # doubled started in a faster gear than its load needs, and the first switch
                # came a hold later.
                status = next((s for s in self._statuses() if s.app == app.name), None)
                if status is not None and any(s.capacity_sps > 0 for s in status.stages):
                    share = ready_share(plan, status, profiles)
                    state = start(expected_qps=measured_qps / share)
            tracked = _AppGears(plan_record.id, plan, resumed or state, profiles)
            tracked.looked_up = {t for m in plan.placement.order for t in plan.placement.fleets[m]}
            if resumed is not None:
                # Resumed where the serving process serves the app by it (a restarted loops
                # process sends it at its first feed after this refresh), measured or not yet.
                logger.info(
                    "gears: %s resumes gear %d of plan %d (%s qps measured)",
                    app.name,
                    resumed.gear,
                    plan_record.id,
                    "no" if measured_qps is None else f"{measured_qps:.3g}",
                )
            else:
                measured = measured_qps or 0.0  # measured: not resumed
                on = (
                    ""
                    if share == 1.0
                    else f", {measured / share:.3g} qps on the planned capacity (share {share:.3g})"
                )
                self._record(
                    app.name,
                    tracked,
                    f"gear plan of plan {plan_record.id} in force: gear {state.gear} for"
                    f" {measured:.3g} qps measured{on}",
                    {"gear": state.gear, "measured_qps": measured, "capacity_share": share},
                )
        # The fleet: a profile run's or a rollout's workers serve no query of the app's own
        # stages, and the reconciler ends them first when the budget is short.
        kept = [
            i
            for i in self._store.list_instances(app.name, [s.value for s in KEPT_STATES])
            if not is_profile_worker(i.request_id)
        ]
        tracked.affordable = self._affordable_share(app, kept)
        tracked.kept = dict(Counter(i.instance_type for i in kept))
        self._look_up_profiles(app, tracked)
        tracked.budget_capped = budget_capped
        self._keep(app.name, tracked)

    def _resumed(
        self, app: str, plan_record: PlanRecord, start: GearSwitcher, now_s: float
    ) -> GearSwitcher | None:
        """The switcher as the newest ``gear_switch`` decision left it on the applied plan
        (its gear, and since when its cascade serves where it was a switch), for a switcher
        that starts with the app already served by that plan's gears (a restarted loops process
        or service, a new leader); None where there is none (the plan is new to the log, or
        set aside since). Started afresh, a restart moved the gear to the one of the load
        measured then, with no hold and no dwell: a load in a gear's dead band moved down at the
        restart and back up seconds later."""
        last = logged_gear(self._store, app, plan_record, len(start.plan.gears))
        if last is None:
            return None
        gear = int(last.numbers["gear"])
        since_s = start.since_s  # the start of a plan is no switch: no dwell
        if "previous" in last.numbers:
            since_s = now_s - max(0.0, (self._clock.utcnow() - last.at).total_seconds())
        return replace(start, gear=gear, since_s=since_s)

    def _switch_app(
        self, app: str, tracked: _AppGears, now_s: float, status: AppStatus | None
    ) -> GearDecision | None:
        measured_qps = self._measured_qps(app, now_s)
        if measured_qps is None:
            return None
        if status is not None and any(s.capacity_sps > 0 for s in status.stages):
            tracked.ready_once = True
        if status is not None and not tracked.ready_once:
            return None  # no worker up yet: the gear in force stays
        share = ready_share(tracked.plan, status, tracked.profiles, tracked.shares)
        budget_cut = False
        if tracked.affordable < 1.0:
            # A budget below the fleet's cost: the reconciler is about to drain to it. The gear
            # moves first (no dwell), for the capacity the budget leaves: the budget's share of
            # the kept fleet (booting instances included) times what that fleet serves of the
            # placement, where that is less than what serves now.
            caps = {s.model: s.max_batch_queries for s in status.stages} if status else {}
            key = ("kept", frozenset(tracked.kept.items()), frozenset(caps.items()))
            kept = _cached(
                tracked.shares,
                key,
                lambda: kept_share(tracked.plan, tracked.kept, caps, tracked.profiles),
            )
            left = max(tracked.affordable * kept, NO_CAPACITY_SHARE)
            if left < share * (1.0 - 1e-9):  # a drain that leaves what serves is no cut
                budget_cut, share = True, left
        first = tracked.state.option.cascade.models[0]
        first_queue = next(
            (s.queued_queries for s in (status.stages if status else ()) if s.model == first), 0
        )
        budget_capped = tracked.budget_capped
        decision, tracked.state = switch(
            measured_qps,
            first_queue,
            tracked.state,
            now_s,
            capacity_share=share,
            budget_capped=budget_capped,
            budget_cut=budget_cut,
        )
        if decision.changed:  # a new gear, or only a new batch trigger on the same cascade
            self._keep(app, tracked)
        if not decision.switched:
            return None
        self._record(
            app,
            tracked,
            decision.reason,
            {
                "gear": decision.gear,
                "previous": decision.previous,
                "measured_qps": decision.measured_qps,
                "effective_qps": decision.effective_qps,
                "first_queue_len": decision.first_queue_len,
                "capacity_share": share,
                "budget_capped": budget_capped,
            },
        )
        return decision

    def _keep(self, app: str, tracked: _AppGears) -> None:
        with self._lock:
            self._apps[app] = tracked
            self._serving[app] = serving_gear(tracked.plan, tracked.state.gear)

    def _record(
        self, app: str, tracked: _AppGears, reason: str, numbers: dict[str, object]
    ) -> None:
        cascade = tracked.state.option.cascade
        self._store.record_decision(
            app,
            "gear_switch",
            f"{reason} ({cascade.label})",
            {
                **numbers,
                "plan_id": tracked.plan_id,
                "cascade": cascade.label,
                "accuracy": tracked.state.option.quality.accuracy,
            },
        )


class GearTable:
    """The serving process's gear hook when the loops run in a process of their own: the gears
    in force as the loops' switcher last sent them (:meth:`LiveGears.in_force`: an app's plan id
    and gear), each made into a :class:`ServingGear` from the applied plan in ``store``
    (thread-safe: :meth:`gear` is read on the event loop, :meth:`set_all` runs in a thread).

    A plan id that is not the app's applied plan (applied anew since) is left out until the
    switcher sends the new one; each plan's document is parsed once, kept by app and plan id
    while the switcher names that pair (plan ids are never given twice, migration 0013; the app
    in the key keeps a table made before it right too).
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._plans: dict[tuple[str, int], GearPlan] = {}
        self._serving: dict[str, tuple[int, int, ServingGear]] = {}
        # Single-model apps' batch caps from the loops' tuner (:meth:`set_caps`).
        self._caps: dict[str, ServingGear] = {}
        self._lock = threading.Lock()

    def gear(self, app: str) -> ServingGear | None:
        """The gear in force for ``app``: the switcher's, else its batch cap's
        (:meth:`set_caps`); None when it is served by neither."""
        with self._lock:
            found = self._serving.get(app)
            capped = self._caps.get(app)
        return found[2] if found is not None else capped

    def resume(self) -> None:
        """Serve each app by the gear its log names (:func:`logged_gear`) until the loops
        process sends the gears (blocking: reads the store; the serving process's start). A
        serving process started served every geared app by its spec's cascade until the loops
        process it starts had read the store, about 3 s on the demo."""
        in_force: dict[str, tuple[int, int]] = {}
        try:
            for app in self._store.list_apps():
                if app.applied_plan_id is None:
                    continue
                record = self._store.get_applied_plan(app.name)
                plan = None if record is None else self._plan(app.name, record.id)
                if record is None or plan is None:
                    continue
                last = logged_gear(self._store, app.name, record, len(plan.gears))
                if last is not None:
                    in_force[app.name] = (record.id, int(last.numbers["gear"]))
        except ControlPlaneError as error:  # the loops process sends the gears all the same
            logger.warning("gears: the gears in force were not read from the log: %s", error)
            return
        self.set_all(in_force)

    def set_caps(self, caps: Mapping[str, Mapping[str, int]]) -> None:
        """The batch caps the loops' tuner sets now, app -> {model: cap}
        (:meth:`~controlplane.loops.live_tuner.LiveTuner.batch_caps`: single-model apps sized
        by their ladders); apps not named batch as their plans say."""
        with self._lock:
            before = self._caps
        made: dict[str, ServingGear] = {}
        for app, by_model in caps.items():
            if len(by_model) != 1:
                continue
            ((model, cap),) = by_model.items()
            kept = before.get(app)
            # The same gear while the cap holds: the dispatcher notices a new one by identity.
            if kept is None or kept.max_batch_queries != {model: cap}:
                kept = batch_gear(model, cap)
            made[app] = kept
        with self._lock:
            self._caps = made

    def set_all(self, in_force: Mapping[str, tuple[int, int]]) -> None:
        """The gears in force now, app -> (plan id, gear); apps not named are served as their
        specs say (blocking: a new plan is read from the store)."""
        kept, moved = self._split(in_force)
        for app, plan_id, gear in moved:
            plan = self._plan(app, plan_id)
            if plan is not None and 0 <= gear < len(plan.gears):
                kept[app] = (plan_id, gear, serving_gear(plan, gear))
        named = {(app, plan_id) for app, (plan_id, _gear) in in_force.items()}
        with self._lock:  # _plan adds under it too: two set_all calls may overlap
            self._serving = kept
            self._plans = {key: plan for key, plan in self._plans.items() if key in named}

    def reads_store(self, in_force: Mapping[str, tuple[int, int]]) -> bool:
        """Whether :meth:`set_all` of ``in_force`` would read the store (a gear moved to a plan
        not parsed yet): the serving process's fast path runs it on the event loop only when
        not (:mod:`controlplane.api.fast_internal`)."""
        _kept, moved = self._split(in_force)
        return any((app, plan_id) not in self._plans for app, plan_id, _gear in moved)

    def _split(
        self, in_force: Mapping[str, tuple[int, int]]
    ) -> tuple[dict[str, tuple[int, int, ServingGear]], list[tuple[str, int, int]]]:
        """``in_force`` as the gears already served (kept as they are) and those that moved
        (app, plan id, gear)."""
        with self._lock:
            current = dict(self._serving)
        kept: dict[str, tuple[int, int, ServingGear]] = {}
        moved = []
        for app, (plan_id, gear) in in_force.items():
            found = current.get(app)
            if found is not None and found[:2] == (plan_id, gear):
                kept[app] = found
            else:
                moved.append((app, plan_id, gear))
        return kept, moved

    def _plan(self, app: str, plan_id: int) -> GearPlan | None:
        found = self._plans.get((app, plan_id))
        if found is not None:
            return found
        try:
            record = self._store.get_applied_plan(app)
        except NotFoundError:
            return None
        if record is None or record.id != plan_id or not record.plan.gear_plan:
            return None
        try:
            plan = GearPlan.from_document(record.plan.gear_plan)
        except (EstimatorError, KeyError, ValueError) as error:
            logger.warning("gears: %s served without gears: %s", app, error)
            return None
        with self._lock:
            self._plans[(app, plan_id)] = plan
        return plan
