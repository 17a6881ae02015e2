"""Re-planning on recorded traffic: a new plan when live arrivals have left the plan's envelope for
good.

This module owns :class:`TrafficReplanner`, the scheduler's ``replan`` job (every ``replan_s``,
60 s by default; ``replan_enabled`` turns it off). The tuner (``controlplane.loops.live_tuner``)
keeps an app on its plan through short excursions by adding and removing instances of the
plan's own stages; it never changes the hardware mix, the batch size or the dispatch policy, and
it measures everything against the planned envelope. When traffic has moved for good (twice the
load, half of it, a burstier workload), the plan itself is wrong: this job plans the app again on
the arrivals the serving loop recorded, which lets the planner pick another mix (Kairos' ranking
at the new load), and applies the new plan.

Each check, per app with an applied plan and observed traffic (:func:`compare_envelopes`, pure):
the live arrival envelope of the *recent* arrivals (the last ``max(replan_s, W)`` seconds) on the
plan's own envelope windows, against the planned envelope (the plan document's ``envelope``; a
plan without one, the envelope of a seeded Poisson trace at its planned rate on 1 s and 60 s),
at two windows:

- the **sustained** ratio, r_live(W) / r_plan(W) at the plan's longest window W (up to 60 s);
- the **peak** ratio, r_live(w) / r_plan(w) at its shortest window w (the 1 s peak; longer when
  an instance's service time is).

The check is out of the band (:class:`ReplanBand`, ``replan_above`` 1.3 and ``replan_below``
0.6) *above* when either ratio exceeds ``above`` (more load, or burstier), *below* when both are
under ``below`` (less load, no burst the plan would still be needed for); otherwise inside.

**Hysteresis.** A check judges only the recent arrivals, not the whole ``replan_window_s``: an
envelope is a maximum, so a burst would stay in a ten-minute envelope for ten minutes after it
ended, and a two-minute burst would look like a lasting change. Instead, the app is re-planned
only when *every* check for ``replan_hold_s`` (5 minutes) was out of the band in the same
direction; one check inside the band (or in the other direction), a new applied plan or a change
of the app (its spec, its budget) starts the count again. The tuner handles what is shorter.

**The re-plan.** The planning trace is the recorded arrivals of the episode (from the start of the
first out-of-band check's span to now, at most the last ``replan_window_s``, 10 minutes, and at
most the newest :data:`controlplane.policies.planner.PLANNING_QUERIES`), shifted to start at 0.
The serving loop records arrival times, not batch sizes, so each query's batch size is drawn (the
plan's seed) from the batch-size distribution the plan was made on (its ``trace.request``), or is
the smallest batch size every profile covers, as for a plan made on a rate. Fewer than
``replan_min_queries`` (1,000) recorded queries is too little to plan on: the job waits for more.
:func:`controlplane.policies.planner.plan_app` plans it within the app's budget (the spec's) and
``plan_deadline_s``. Then

- a feasible plan whose fleet differs from the applied one is stored (its steps say why) and
  applied through :func:`controlplane.apps.plans.apply_plan`, the use case of ``POST
  /v1/apps/{app}/plans/{id}/apply`` (a ``plan_applied`` decision by ``the traffic replanner``),
  and a ``replan`` decision records the numbers: the direction, both ratios with the live and
  planned rates at their windows, the old and new planned rates, fleets and costs, the budget and
  the trace (queries, span). The tuner restarts from the new plan (a new plan id); the reconciler
  launches what the new fleet adds and drains what it drops at the disruption budget's pace
  (``disruption_*`` settings: one instance or a quarter of the serving fleet per minute), keeping
  the last serving instance of each stage until another of the stage serves, and never above the
  budget;
- a feasible plan with the applied plan's fleet is applied all the same (its decision says "the
  same fleet") where the app runs the plan's fleet: no scaling loop has written another fleet on
  the applied plan since it was applied (:func:`_loop_fleet`). The restart of the tuner from the
  new plan's fleet then moves no instance, and the planned envelope and rate, which the tuner
  sizes by (its utilisation target rho_m, the ladder's load factor) and the next checks compare
  with, follow the traffic;
- a plan with the same fleet where the tuner (or the INFaaS scaler) has grown or shrunk the fleet
  on the applied plan is not applied: applying would restart the loop from the plan's fleet, a
  drain (or a launch) no scaling decision asked for. One ``replan_same_fleet`` decision per plan
  and direction (keyed) records it, and the job waits while the traffic stays inside the band of
  the plan it found (``settled``); traffic that leaves that band starts the count again;
- a plan that cannot serve the recorded traffic within the budget is not applied: one
  ``replan_infeasible`` decision (with the highest rate a plan within the budget serves) per plan
  and direction (keyed, so a repeat is one more count on that row); the tuner keeps the app as
  close as the budget allows.

After an attempt that did not apply a plan (infeasible, an error, the deadline), the next comes a
further ``replan_hold_s`` later, if the traffic is still out of the band. An app
marked for teardown is not re-planned. The job runs on the leader only (the scheduler's fence,
``controlplane.loops.leadership``); its state is in memory, so a new leader starts the count
afresh.

>>> band = ReplanBand(above=1.3, below=0.6)
>>> steady = np.arange(0.0, 60.0, 1 / 256)  # 256 qps for a minute
>>> c = compare_envelopes(steady, 60.0, 60.0, (1.0, 32.0), (160.0, 128.0))
>>> c.peak_ratio, c.sustained_ratio, band.direction(c)
(1.6, 2.0, 'above')
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from controlplane.apps.plans import apply_plan, provider_prices
from controlplane.apps.resolver import smallest_common_batch_size
from controlplane.apps.teardown import teardown_requested
from controlplane.clock import Clock
from controlplane.db.store import AppRecord, PlanRecord, Store
from controlplane.errors import ConflictError, ControlPlaneError, app_gone
from controlplane.loops.capacity_replan import fleet_text
from controlplane.loops.live_tuner import (
    FLEETS_AFTER,
    ArrivalSource,
    ResolveFn,
    synthetic_planning_arrivals,
)
from controlplane.loops.reached import PLAN_ID, SCALING_KINDS, counts, newest
from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import MIN_ENVELOPE_WINDOW_S, PLANNING_QUERIES, plan_app
from controlplane.policies.spot import SpotPricesFn, plan_with_spot
from controlplane.spec import ResolvedApp, SpecError
from estimator import deadline
from estimator.batches import parse_batch_distribution
from estimator.envelope import DEFAULT_MAX_WINDOW_S, arrival_envelope
from estimator.errors import EstimatorError
from estimator.fleet import nonzero
from estimator.numbers import plain
from estimator.traces import Trace, trace_stats

__all__ = [
    "DEFAULT_REPLAN_ABOVE",
    "DEFAULT_REPLAN_BELOW",
    "DEFAULT_REPLAN_HOLD_S",
    "DEFAULT_REPLAN_MIN_QUERIES",
    "DEFAULT_REPLAN_S",
    "DEFAULT_REPLAN_WINDOW_S",
    "Direction",
    "EnvelopeComparison",
    "ReplanBand",
    "TrafficReplanner",
    "compare_envelopes",
]

logger = logging.getLogger(__name__)

Direction = Literal["above", "below"]

# The job's period: a check a minute, the tuner's longest window.
DEFAULT_REPLAN_S = 60.0
# The most recorded traffic one re-plan plans on: ten minutes hold a P99's worth of queries at
# any rate worth a plan and let the planner see the bursts of several minutes.
DEFAULT_REPLAN_WINDOW_S = 600.0
# How long every check must have been out of the band: five checks, longer than any burst the
# tuner's burst memory and its 60 s windows are meant to ride out.
DEFAULT_REPLAN_HOLD_S = 300.0
# The band: 30% above the plan is past the headroom a plan keeps (the planner's start mix has
# ~30% more Kairos bound than the peak, ``planner.HEADROOM``); 60% of it leaves a plan roughly
# twice too big, worth a cheaper one. Asymmetric on purpose: too little costs queries, too much
# only money.
DEFAULT_REPLAN_ABOVE = 1.3
DEFAULT_REPLAN_BELOW = 0.6
# Fewer recorded queries than this is too little to plan on (a P99 resolved by 10 queries).
DEFAULT_REPLAN_MIN_QUERIES = 1_000
DEFAULT_PLAN_DEADLINE_S = 60.0

# The planned envelope of a plan without one: the live tuner's stand-in planning trace at its
# planned rate (live_tuner.synthetic_planning_arrivals), on the shortest and the longest of the
# tuner's windows.
_PROXY_WINDOWS_S = (MIN_ENVELOPE_WINDOW_S, DEFAULT_MAX_WINDOW_S)

WHO = "the traffic replanner"


# --- the comparison (pure) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnvelopeComparison:
    """The live envelope of the recent arrivals against the planned one, at the plan's shortest
    (``peak``) and longest (``sustained``) envelope windows; rates in qps."""

    peak_window_s: float
    live_peak_qps: float
    planned_peak_qps: float
    sustained_window_s: float
    live_sustained_qps: float
    planned_sustained_qps: float
    span_s: float
    queries: int

    @property
    def peak_ratio(self) -> float:
        return self.live_peak_qps / self.planned_peak_qps

    @property
    def sustained_ratio(self) -> float:
        return self.live_sustained_qps / self.planned_sustained_qps

    def numbers(self) -> dict[str, float]:
        """What a decision records of the comparison."""
        return {
            "peak_window_s": self.peak_window_s,
            "live_peak_qps": self.live_peak_qps,
            "planned_peak_qps": self.planned_peak_qps,
            "peak_ratio": self.peak_ratio,
            "sustained_window_s": self.sustained_window_s,
            "live_sustained_qps": self.live_sustained_qps,
            "planned_sustained_qps": self.planned_sustained_qps,
            "sustained_ratio": self.sustained_ratio,
        }

    def describe(self) -> str:
        return (
            f"sustained {self.live_sustained_qps:.4g} qps vs planned"
            f" {self.planned_sustained_qps:.4g} at {self.sustained_window_s:g} s (x"
            f"{self.sustained_ratio:.2f}), peak {self.live_peak_qps:.4g} vs"
            f" {self.planned_peak_qps:.4g} at {self.peak_window_s:g} s (x{self.peak_ratio:.2f})"
        )


def compare_envelopes(
    arrival_s: ArrayLike,
    now_s: float,
    span_s: float,
    windows_s: Sequence[float],
    planned_rate_qps: Sequence[float],
) -> EnvelopeComparison:
    """The arrival envelope of the arrivals in ``[now_s - span_s, now_s]`` (sorted, in seconds)
    at the first and the last of ``windows_s`` (increasing, > 0), against the planned rates there.

    With N(t, w) the arrivals in [t, t + w), the live rate at a window w is
    max_t N(t, w) / w over the span (InferLine Algorithm 3, line 4; ``estimator.envelope``); a
    window longer than the span is measured as the span (the mean rate over it), so an envelope
    of a short span is not diluted by time it has not seen.

    >>> c = compare_envelopes([9.0, 9.5, 9.6, 9.7], 10.0, 2.0, (1.0, 2.0), (2.0, 1.0))
    >>> c.live_peak_qps, c.live_sustained_qps, c.queries
    (4.0, 2.0, 4)
    """
    if not (math.isfinite(span_s) and span_s > 0):
        raise ValueError(f"span_s must be finite and > 0, got {span_s!r}")
    if len(windows_s) != len(planned_rate_qps) or not windows_s:
        raise ValueError("one planned rate per window, at least one window")
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    start = int(np.searchsorted(arrivals, now_s - span_s, side="left"))
    end = int(np.searchsorted(arrivals, now_s, side="right"))
    recent = arrivals[start:end]
    shortest, longest = float(windows_s[0]), float(windows_s[-1])
    measured = (min(shortest, span_s), min(longest, span_s))
    envelope = arrival_envelope(recent, measured)
    live = envelope.rate_qps
    return EnvelopeComparison(
        peak_window_s=shortest,
        live_peak_qps=float(live[0]),
        planned_peak_qps=float(planned_rate_qps[0]),
        sustained_window_s=longest,
        live_sustained_qps=float(live[1]),
        planned_sustained_qps=float(planned_rate_qps[-1]),
        span_s=float(span_s),
        queries=int(recent.size),
    )


@dataclass(frozen=True, slots=True)
class ReplanBand:
    """The band of live / planned envelope ratios a plan is kept in: out of it *above* when
    either ratio is above ``above``, *below* when both are below ``below``
    (0 < below < 1 < above)."""

    above: float = DEFAULT_REPLAN_ABOVE
    below: float = DEFAULT_REPLAN_BELOW

    def __post_init__(self) -> None:
        if not (0.0 < self.below < 1.0 < self.above and math.isfinite(self.above)):
            raise ValueError(
                f"the band needs 0 < below < 1 < above, got below {self.below!r},"
                f" above {self.above!r}"
            )

    def direction(self, comparison: EnvelopeComparison) -> Direction | None:
        """Where ``comparison`` lies: ``above`` or ``below`` the band, or ``None`` inside it."""
        ratios = (comparison.peak_ratio, comparison.sustained_ratio)
        if max(ratios) > self.above:
            return "above"
        if max(ratios) < self.below:
            return "below"
        return None


# --- the job -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Episode:
    """An app's current run of out-of-band checks against one applied plan."""

    plan_id: int
    app_version: int
    direction: Direction
    since_s: float  # the first out-of-band check of the run
    recorded_from_s: float  # where the run's recorded traffic starts (that check's span)
    attempt_at_s: float  # the next re-plan is due then
    comparison: EnvelopeComparison
    # The envelope (windows s, rates qps) of the plan with the applied fleet that an attempt found
    # and did not apply (the tuner had moved the fleet): no attempt while the traffic stays
    # inside its band.
    settled: tuple[tuple[float, ...], tuple[float, ...]] | None = None


class TrafficReplanner:
    """Re-plans apps whose live traffic has stayed out of the plan's envelope band for
    ``hold_s`` (see the module docstring); :meth:`tick` is the scheduler's ``replan`` job."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        arrivals: ArrivalSource,
        resolve: ResolveFn,
        *,
        check_s: float = DEFAULT_REPLAN_S,
        window_s: float = DEFAULT_REPLAN_WINDOW_S,
        hold_s: float = DEFAULT_REPLAN_HOLD_S,
        band: ReplanBand | None = None,
        min_queries: int = DEFAULT_REPLAN_MIN_QUERIES,
        deadline_s: float = DEFAULT_PLAN_DEADLINE_S,
        spot_prices: SpotPricesFn | None = None,
    ) -> None:
        for name, value in (("check_s", check_s), ("window_s", window_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if not (math.isfinite(hold_s) and hold_s >= 0):
            raise ValueError(f"hold_s must be finite and >= 0, got {hold_s!r}")
        if min_queries < 2:
            raise ValueError(f"min_queries must be >= 2, got {min_queries!r}")
        self._store = store
        self._clock = clock
        self._arrivals = arrivals
        self._resolve = resolve
        self._check_s = float(check_s)
        self._window_s = float(window_s)
        self._hold_s = float(hold_s)
        self._band = band if band is not None else ReplanBand()
        self._min_queries = int(min_queries)
        self._deadline_s = float(deadline_s)
        self._spot_prices = spot_prices  # the provider's, for apps that buy spot (docs/spot.md)
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def episode(self, app: str) -> tuple[Direction, float] | None:
        """The direction of ``app``'s current run of out-of-band checks and how long it has
        lasted, s (``None`` when its last check was inside the band)."""
        with self._lock:
            found = self._episodes.get(app)
            return None if found is None else (found.direction, self._clock.now_s() - found.since_s)

    def tick(self) -> list[str]:
        """One check of every app with an applied plan; the names of those re-planned."""
        now_s = self._clock.now_s()
        replanned = []
        apps = self._store.list_apps()
        with self._lock:
            for gone in set(self._episodes) - {app.name for app in apps}:
                del self._episodes[gone]
        for app in apps:
            try:
                if self._check(app, now_s):
                    replanned.append(app.name)
            except (ControlPlaneError, EstimatorError, SpecError, KeyError, ValueError) as error:
                # Deleted or changed meanwhile, a plan the planner cannot redo: the app stays on
                # its plan, and the next attempt waits a hold.
                level = logging.DEBUG if app_gone(error) else logging.WARNING
                logger.log(level, "replan: %s not re-planned: %s", app.name, error)
                with self._lock:
                    found = self._episodes.get(app.name)
                    if found is not None:
                        found.attempt_at_s = now_s + self._hold_s
        return replanned

    def _check(self, app: AppRecord, now_s: float) -> bool:
        plan = self._store.get_applied_plan(app.name) if app.applied_plan_id is not None else None
        observed = self._arrivals(app.name) if plan is not None else None
        envelope = None if plan is None else _planned_envelope(plan.plan)
        if plan is None or observed is None or envelope is None:
            # No plan, nobody observing the app's traffic, or a plan without a rate.
            with self._lock:
                self._episodes.pop(app.name, None)
            return False
        windows_s, rates_qps = envelope
        span_s = max(self._check_s, windows_s[-1])
        # Arrivals stamped by concurrent requests may be out of order by microseconds; a stable
        # sort of an (almost) sorted array is linear.
        observed = np.sort(np.asarray(observed, dtype=np.float64), kind="stable")
        comparison = compare_envelopes(observed, now_s, span_s, windows_s, rates_qps)
        direction = self._band.direction(comparison)
        with self._lock:
            episode = self._episodes.get(app.name)
            if direction is None:
                self._episodes.pop(app.name, None)
                return False
            if (
                episode is None
                or episode.plan_id != plan.id
                or episode.app_version != app.version
                or episode.direction != direction
                or self._left(episode.settled, observed, now_s)
            ):
                episode = _Episode(
                    plan_id=plan.id,
                    app_version=app.version,
                    direction=direction,
                    since_s=now_s,
                    recorded_from_s=now_s - span_s,
                    attempt_at_s=now_s + self._hold_s,
                    comparison=comparison,
                )
                self._episodes[app.name] = episode
                logger.info(
                    "replan: %s %s the plan's envelope band (%s)",
                    app.name,
                    direction,
                    comparison.describe(),
                )
            episode.comparison = comparison
            if episode.settled is not None or now_s < episode.attempt_at_s:
                return False
        return self._replan(app, plan, episode, observed, now_s)

    def _left(
        self,
        settled: tuple[tuple[float, ...], tuple[float, ...]] | None,
        observed: NDArray[np.float64],
        now_s: float,
    ) -> bool:
        """Whether the recent arrivals are out of the band of the ``settled`` envelope (an
        attempt's same-fleet plan): the traffic has moved since that attempt."""
        if settled is None:
            return False
        windows_s, rates_qps = settled
        span_s = max(self._check_s, windows_s[-1])
        comparison = compare_envelopes(observed, now_s, span_s, windows_s, rates_qps)
        return self._band.direction(comparison) is not None

    def _replan(
        self,
        app: AppRecord,
        plan: PlanRecord,
        episode: _Episode,
        observed: NDArray[np.float64],
        now_s: float,
    ) -> bool:
        if teardown_requested(self._store, app):
            return False  # going away: nothing to plan for
        arrivals = observed
        start_s = max(episode.recorded_from_s, now_s - self._window_s)
        lo = int(np.searchsorted(arrivals, start_s, side="left"))
        hi = int(np.searchsorted(arrivals, now_s, side="right"))
        # The newest queries when there are more than the planner simulates (it would keep the
        # oldest): the traffic as it is now.
        recorded = arrivals[max(lo, hi - PLANNING_QUERIES) : hi]
        if recorded.size < self._min_queries:
            logger.info(
                "replan: %s: %d queries recorded since its traffic moved %s the plan, fewer"
                " than the %d a plan needs; waiting for more",
                app.name,
                recorded.size,
                episode.direction,
                self._min_queries,
            )
            return False
        episode.attempt_at_s = now_s + self._hold_s  # whatever comes of this attempt
        resolved = self._resolve(app)
        old = plan.plan
        seed = old.seed or 0
        sizes, batch_text = _batch_sizes(resolved, old, recorded.size, seed)
        trace = Trace(recorded - recorded[0], sizes)
        stats = trace_stats(trace)
        now = provider_prices(resolved, self._spot_prices)
        with deadline.limit(self._deadline_s):
            new = plan_with_spot(resolved, trace, plan=plan_app, seed=seed, spot_prices=now)
        if self._store.get_app(app.name).version != app.version:
            raise ConflictError(f"app {app.name!r} changed while it was being re-planned")
        held_s = now_s - episode.since_s
        comparison = episode.comparison
        budget = resolved.constraints.budget_usd_per_hr
        numbers: dict[str, Any] = {
            "direction": episode.direction,
            "held_s": held_s,
            **comparison.numbers(),
            "old_rate_qps": old.planned_rate_qps,
            "recorded_rate_qps": stats.rate_qps,
            "recorded_cv2": stats.cv2,
            "trace_queries": stats.count,
            "trace_span_s": stats.duration_s,
            "old_plan_id": plan.id,
            "old_fleet": old.fleet,
            "old_cost_usd_per_hr": old.cost_usd_per_hr,
            "budget_usd_per_hr": budget,
        }
        moved = (
            f"traffic {episode.direction} plan {plan.id}'s envelope for {held_s:g} s"
            f" ({comparison.describe()})"
        )
        if not new.feasible:
            self._store.record_decision(
                app.name,
                "replan_infeasible",
                f"{moved}: no plan within the budget ${plain(budget)}/hr serves the recorded"
                f" {stats.rate_qps:.4g} qps (at most {new.max_feasible_qps or 0.0:.4g} qps);"
                f" plan {plan.id} stays",
                {**numbers, "max_feasible_qps": new.max_feasible_qps},
                key=f"{plan.id}:{episode.direction}",
            )
            logger.warning("replan: %s: no plan within its budget serves its traffic", app.name)
            return False
        same_fleet = nonzero(new.fleet) == nonzero(old.fleet)
        numbers["same_fleet"] = same_fleet
        loop_fleet = _loop_fleet(self._store, app.name, plan) if same_fleet else None
        if loop_fleet is not None:
            # Applying would restart the scaling loop from the plan's fleet: a drain (or a launch)
            # of what it had grown (or shed) that no scaling decision asked for.
            self._store.record_decision(
                app.name,
                "replan_same_fleet",
                f"{moved}: the plan for the recorded {stats.rate_qps:.4g} qps has plan {plan.id}'s"
                f" fleet ({fleet_text(new.fleet)}, {new.planned_rate_qps:.4g} qps), but the"
                f" {loop_fleet} since plan {plan.id} was applied; plan {plan.id} stays (applying"
                " it would restart that loop from the plan's fleet) until the traffic leaves the"
                f" band of a plan for {new.planned_rate_qps:.4g} qps",
                {
                    **numbers,
                    "new_rate_qps": new.planned_rate_qps,
                    "fleet": new.fleet,
                    "cost_usd_per_hr": new.cost_usd_per_hr,
                },
                key=f"{plan.id}:{episode.direction}",
            )
            with self._lock:
                # No attempt while the traffic stays where this one found the same fleet (a plan
                # without a rate has no band: the next attempt comes a hold later).
                episode.settled = _planned_envelope(new)
            logger.info("replan: %s: the plan for its traffic has the same fleet", app.name)
            return False
        because = (
            f"re-planned on recorded traffic: {moved}; {stats.count} queries over"
            f" {stats.duration_s:.0f} s at {stats.rate_qps:.4g} qps"
        )
        trace_document = {
            "count": stats.count,
            "rate_qps": stats.rate_qps,
            "cv2": stats.cv2,
            "mean_batch_size": stats.mean_batch_size,
            "source": (
                f"recorded arrivals of {app.name} over {stats.duration_s:.0f} s, batch sizes"
                f" {batch_text}, seed {seed}"
            ),
        }
        document = dataclasses.replace(
            new, seed=seed, trace=trace_document, steps=(because, *new.steps)
        ).to_document()
        record = self._store.create_plan(app.name, document)
        same = (
            "; the same fleet, for the planned rate and envelope to follow the traffic"
            if same_fleet
            else ""
        )
        # Said in the apply's transaction (a crash leaves both or neither).
        apply_plan(
            self._store,
            app.name,
            record.id,
            WHO,
            said=lambda applied: [
                (
                    "replan",
                    f"{moved}: plan {applied.id} ({fleet_text(new.fleet)},"
                    f" {new.cost_usd_per_hr:.4g} USD/hr, {new.planned_rate_qps:.4g} qps) replaces"
                    f" plan {plan.id} ({fleet_text(old.fleet)}, {old.cost_usd_per_hr:.4g} USD/hr,"
                    f" {old.planned_rate_qps:.4g} qps){same}",
                    {
                        **numbers,
                        "new_rate_qps": new.planned_rate_qps,
                        "plan_id": applied.id,
                        "fleet": new.fleet,
                        "cost_usd_per_hr": new.cost_usd_per_hr,
                    },
                )
            ],
        )
        with self._lock:
            self._episodes.pop(app.name, None)
        logger.warning("replan: %s re-planned on its recorded traffic", app.name)
        return True


def _loop_fleet(store: Store, app: str, plan: PlanRecord) -> str | None:
    """What a scaling loop (the tuner, the INFaaS scaler) has made of ``plan``'s fleet since it
    was applied, in words, where the newest fleet one wrote on it
    (:func:`controlplane.loops.reached.newest`) is not the plan's; ``None``: the app runs the
    plan's fleet (no loop wrote one, or the tuner's is the plan's again)."""
    decision = newest(store, app, plan, SCALING_KINDS, PLAN_ID)
    if decision is None:
        return None
    value = decision.numbers.get(FLEETS_AFTER)
    fleets = [counts(fleet) for fleet in value.values()] if isinstance(value, dict) else [None]
    if not isinstance(value, dict) or any(fleet is None for fleet in fleets):
        return f"scaling loop has changed the fleet ({decision.kind})"
    reached = {stage: nonzero(counts(fleet) or {}) for stage, fleet in value.items()}
    if reached == {stage.name: nonzero(stage.fleet) for stage in plan.plan.stages}:
        return None
    summed: Counter[str] = Counter()
    for fleet in reached.values():
        summed.update(fleet)
    return f"tuner has taken the fleet to {fleet_text(summed)} ({decision.kind})"


def _planned_envelope(plan: PlanDocument) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The plan's envelope (windows s, rates qps); a plan without a usable one, the envelope of a
    seeded Poisson trace at its planned rate; ``None`` when it has no rate either."""
    if plan.envelope_problem is None and plan.envelope_windows_s:
        return plan.envelope_windows_s, plan.envelope_rate_qps
    rate = plan.planned_rate_qps
    if not (math.isfinite(rate) and rate > 0):
        return None
    envelope = arrival_envelope(synthetic_planning_arrivals(rate), _PROXY_WINDOWS_S)
    rates = tuple(max(float(r), rate) for r in envelope.rate_qps)
    return _PROXY_WINDOWS_S, rates


def _batch_sizes(
    app: ResolvedApp, plan: PlanDocument, count: int, seed: int
) -> tuple[NDArray[np.int64], str]:
    """Batch sizes for ``count`` recorded queries: drawn from the distribution ``plan`` was made
    on (its ``trace.request.batch_dist``), else the smallest batch size every profile covers."""
    request = plan.trace.get("request") if plan.trace is not None else None
    text = request.get("batch_dist") if isinstance(request, Mapping) else None
    if not isinstance(text, str) or not text:
        text = f"fixed:{smallest_common_batch_size(app)}"
    batches = parse_batch_distribution(text)
    sizes = np.asarray(batches.sample(count, np.random.default_rng(seed)), dtype=np.int64)
    return sizes, batches.spec
