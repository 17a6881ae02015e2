"""The reconciler: the one place that acts on provisioners.

Every tick it brings each app's fleet toward what is desired, within the app's budget. It is
two halves, as STYLE.md asks of the control plane:

- :func:`reconcile`, a pure function: the desired fleet (instance type -> count), the database's
  records of the app's instances, the provider's list of them, prices, the budget and ``now`` in;
  a list of :data:`Action` out. It reads no clock and calls nothing.
- :class:`Reconciler`, which gathers those inputs (the store, the provisioner, the clock), calls
  :func:`reconcile` per app and carries the actions out, writing to the store *before* it asks
  the provider for anything.

The rules (docs/provisioners.md, "Reconciler", says why):

1. **Matching.** A provider instance belongs to the database row with its provider id; failing
   that, to the row whose request id it carries (:data:`~provisioners.base.REQUEST_TAG`) when that
   row is still ``requested``, has no provider id and is of the same type: the launch went through
   but its answer was lost (a crash, a timeout), and the instance is *adopted* into that row.
2. **Orphans.** A managed instance (tag :data:`~provisioners.base.MANAGED_TAG`) that matches no
   row is recorded in the database (request id ``orphan:<provider id>``, state ``terminating``)
   and terminated: the rule is *adopt only what the database asked for* (the app tag names an
   existing app and the request id is a launch of that app still waiting for its instance);
   anything else tagged ours is a leftover (a database restored from a backup, a forced app
   delete, a launch given up on) and costs money nobody planned. Managed instances whose app tag
   names no app are terminated by :meth:`Reconciler.run_once`. Instances without our managed tag
   are never touched, only reported.
3. **Liveness.** The provider's word moves rows along the lifecycle: ``pending`` and ``running``
   (``running`` only once the optional health probe passes) forward; ``terminated`` or
   ``failed`` ends a row (``terminated`` if we were terminating it, ``failed`` otherwise); a
   ``stopping`` instance we did not stop is marked ``failed`` and terminated. A row whose instance
   the provider no longer lists is ended once it has been missing for ``missing_grace_s`` (EC2's
   list is eventually consistent just after a launch). An instance whose row has ended but which
   the provider still runs (or lists as ``failed``) is terminated again, which also lets the
   provider clean a failed machine up. A ``running`` row whose worker has stopped answering
   (:mod:`controlplane.loops.liveness`: no answer to ``GET /health`` for a minute, once past
   its boot) is terminated (cause ``unresponsive``) and so replaced by rule 5.
4. **Stragglers.** A row still ``requested`` or ``pending`` ``straggler_timeout_s`` after it was
   recorded never became healthy: ``requested`` ones are marked ``failed``, ``pending`` ones
   terminated; the shortfall they leave is launched again in the same tick.
5. **Fleet size.** Per type, the rows that are ``requested``, ``pending`` or ``running`` (the
   *kept* ones) are compared with the desired count. The excess goes first (rows not launched yet
   first, then ``pending``, then ``running``, of which those whose last liveness probe went
   unanswered first; the newest first within each). Two guards hold
   back the excess that serves (docs/operations.md, "Budget changes that cannot take an app
   down"): the last serving instance of each stage of the applied plan stays until another of
   the stage serves (:func:`controlplane.policies.drain.spare_last_serving`; for an app INFaaS's
   autoscaler scales, any instance of the plan's types serves every stage: ``_stage_types``),
   unless the budget needs its cost for the launches that replace it; and the *disruption budget*
   (:class:`controlplane.policies.disruption.DisruptionBudget`) caps how many serving instances
   go per window, counting the ones that left in the window, least cost-effective first. What
   either keeps is one :class:`DrainDeferred` action (one decision per episode). A serving row
   that goes (unless its worker went silent) moves to ``draining`` first: the serving loop sends
   it no new query from its next refresh, and rule 9 terminates it after ``drain_s`` (cause
   ``scale_down``, read back from its move's reason); it is paid for until then, and taken back
   (``draining -> running``) where the desired count rises again meanwhile. Terminated at once,
   it still got the queries dispatched before that refresh, which found it gone.
6. **Budget guard.** The kept fleet's cost (the recorded price of each kept row) must stay within
   the app's budget, a hard limit: no guard above defers this drain. When it does not (the budget
   was lowered), the least cost-effective kept instances are drained at once by
   :func:`controlplane.policies.drain.guard_drain` (lowest queries per second per dollar first),
   keeping the last instance of a stage, and its last serving one (not one still booting
   beside it), when the budget can pay for it (the budget change was not forced below the
   app's smallest serving fleet); a budget change's ``budget_drain`` decision names the same.
   A launch happens only if the kept cost plus its price stays within the budget; shortfall
   types are launched most cost-effective first, first fit, and what does not fit is one
   :class:`BudgetCapped` action. So after every tick, requested + pending + running <= budget.
7. **Launches** are one instance per request id (the database keeps one row per request id, the
   idempotency key): ``<prefix>-<n>`` with ``n`` one past the highest used by the app, so two
   reconcilers that see the same rows pick the same ids (and the store returns the first row). A
   ``requested`` row whose launch failed with a retryable error (capacity, throttling) is launched
   again each tick with the *same* request id until it succeeds or becomes a straggler; one the
   provider answers with an ended instance of its id (a database restored from a backup reuses
   ids the provider has seen; a launch whose lost answer's instance ended since) fails at once,
   and the next tick launches under a new id. A type's
   run of capacity misses (from its first :class:`~provisioners.errors.InsufficientCapacityError`
   to a launch of it that works, or until no row of it waits any more) is what
   :meth:`Reconciler.capacity_misses` reports; :mod:`controlplane.loops.capacity_replan` re-plans an
   app around a type that has missed for long enough.

8. **Profile workers** (:mod:`controlplane.apps.profile_run`; request ids starting
   ``profile:``, :func:`~controlplane.policies.lifecycle.is_profile_worker`) are rows of the app
   like any other for rules 1-4 and 6 and the teardown: matched, adopted, orphaned, followed,
   counted against the budget (drained first by the guard: they serve nothing) and ended by
   ``app down``. They are no part of the fleet of rule 5 (neither counted against the desired
   count nor launched again by the reconciler), and while their run lives it touches their rows
   (a heartbeat); a kept profile row untouched for ``profile_run_timeout_s`` belongs to a run
   that is gone (its replica crashed or lost the lead) and is ended (cause ``profile_run_gone``).

9. **Interruption notices** (docs/spot.md): ``notices`` maps the provider id of an instance the
   provider will take away to its deadline (a spot interruption warning: two minutes). A
   ``running`` row with a notice is no longer kept: rule 7 launches its replacement in the same
   tick, while it goes on serving until the replacement does (a ``running`` row of its type
   without a notice for each one desired) or until ``margin_s + drain_s`` before its deadline,
   whichever comes first; then it moves to ``draining``: the serving loop stops sending it new
   queries (it serves ``running`` rows only) while what it holds finishes. A ``draining`` row is
   terminated (cause ``interruption``) once it has drained for ``drain_s``, and never later than
   ``margin_s`` before its deadline. A row with a notice that serves nothing yet is terminated at
   once. Until they go, their cost still counts: a replacement is launched only if the budget
   pays for both (the budget is a hard limit), else it waits for the doomed instance to go. Each
   notice acted on is one :class:`InterruptionHandled` action (a ``spot_interruption``
   decision).
10. **Purchase options** (docs/spot.md): ``desired_spot`` says how many of each type's desired
    instances are spot (the applied plan's ``spot_fleet``). A shortfall launch is on spot while
    the type has fewer kept spot rows than that and its spot price now is below its on-demand
    price, on demand otherwise; the row records its market and the price it is launched at.
    Every tick a kept spot row is costed at the type's spot price now
    (``spot_prices_usd_per_hr``: the provider's where it reads them, the EC2 provisioner's
    ``DescribeSpotPriceHistory``, else the app's catalog's), not at its launch price; a
    :class:`SpotRepriced` action (a ``spot_price`` decision) says what moved. Once a rise takes
    the live fleet (draining rows included) past the budget less its headroom
    (``headroom_share`` of it), before any breach, the capacity moves where it can: the kept
    spot rows of a risen type for which the plan's ranking (rule 11) has a choice that serves as
    much for less now (one of a type that serves at least as much, or k smaller ones, each
    counted as 1/k of the risen type; on spot or on demand; the cheapest) go (cause
    ``spot_price``, a ``terminate`` decision with the prices and the budget), and that choice is
    launched for them in the same tick (``stand_in`` decisions), within the budget: the
    removals are carried out before the launches, so the fleet is never over it. While the
    fleet is still within the budget and it pays for the choice next to them, the move is made
    before the break instead: those risen rows stay out of the kept fleet but serve on until the
    choices launched for them serve, then drain (rule 9 ends them). Then the hard cap at the
    prices now: the rows leaving (rule 9: draining, or serving until their replacement does)
    go first where the fleet and they cost more than the budget, then the budget guard (rule 6)
    drains the least cost-effective kept rows (the dearer spot ones first), and rule 7 replaces
    them where the budget allows, on demand once spot is no cheaper. Back to spot: where the plan
    wants more of a type on spot than are kept on spot and its spot price has stayed at or below
    its on-demand price less ``headroom_share`` of it for the hold (``spot_fallen``), the type's
    own on-demand rows return to spot (a :class:`SpotReturned` action, a ``spot_return``
    decision): made before the break as the budget pays for both, else one row of the app at a
    time terminated (cause ``spot_return``) before its spot replacement is launched, where its
    stage keeps another serving row of at least its capacity; within the disruption budget.
    Once their spot replacements serve, the returning rows drain (``spot_returning``); so do a
    rise's on-demand replacements (``spot_replacements``) that the spot rows still kept made
    extra, but only once the fall has held (a replacement counts so only beside spot rows of
    its type older than it; where the price falls back before the hold, the rise's move
    completes: its spot rows drain once the replacements serve). Any other row past the type's
    count (a plan cut) is rule 5's. The type's stand-ins of another type (rule 11's, or a
    rise's cheaper choices; k smaller ones for one together) go back too, once the fall has
    held and but for a type whose launches missed capacity within the back-off
    (``spot_failing``): made before the break only (the type launched on spot in the
    stand-in's slot where the budget pays for both; the stand-in, returning, drains once the
    type's rows serve its count, within the same disruption budget), else they stay.
11. **Stand-ins** (docs/spot.md): for a type the applied plan buys on spot, ``ranking`` lists
    the types that may stand in for it (its stage's base types, the stage's other types, then
    for a plan of one stage the app's other types; each group by Q_t per dollar). When the
    provider is short of the type (``short_types``: a capacity miss running; ``held_types``: a
    launch refused), or when a launch of it on spot would land where its spot instances are
    under notice, a missing instance is launched as the first type of the ranking that serves
    at least as much (Q_t; unknown: any), is not short itself and fits the budget: on spot
    where the plan wants spot and its spot is cheaper and under no notice, else on demand;
    failing that, where only the type's spot is short, the type itself on demand. A
    ``requested`` row of the short type that waits for capacity is given up for it (marked
    ``failed``). The stand-in counts as the type it stands in for (rules 5 and 9; ``stand_ins``,
    read back from the ``stand_in`` decisions after a restart), one for one, until rule 10's
    move back returns it to the type on spot (above) or a new plan ends it as any excess. Each
    is one ``stand_in`` decision (which type, which market, the price, why).

**Teardown** (``heteroplane app down``, :mod:`controlplane.apps.teardown`): every kept row is
ended at once (cause ``teardown``; neither guard of rule 5 applies) and nothing is launched;
once no row of the app is live, :meth:`Reconciler.reconcile_app` deletes the app.

A ``desired`` of ``None`` means "no target": nothing is launched and nothing is terminated for
being excess (liveness, stragglers, the budget guard and orphans still apply). The reconciler
uses it when the plan names types the provisioner cannot launch. An ``observed`` of ``None``
means the provider's list could not be read (throttled, down): then only the budget guard's
drain is decided, from the database alone, so that a lowered budget holds meanwhile.

>>> from datetime import UTC, datetime
>>> actions = reconcile({"emu.cpu.small": 2}, [], [], {"emu.cpu.small": 0.05}, 0.08,
...                     datetime(2024, 1, 1, tzinfo=UTC), request_prefix="demo-1a2b")
>>> [(type(a).__name__, getattr(a, "request_id", "")) for a in actions]
[('Launch', 'demo-1a2b-1'), ('BudgetCapped', '')]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from controlplane.apps.plans import LaunchRefusalFn
from controlplane.apps.profile_run import DEFAULT_HEARTBEAT_S, RUN_GONE_BEATS
from controlplane.apps.teardown import teardown_requested
from controlplane.clock import Clock
from controlplane.crashpoints import crash_point
from controlplane.db.store import AppRecord, InstanceRecord, Store
from controlplane.db.store.decisions import Keyed, Words
from controlplane.errors import ControlPlaneError, InvalidTransitionError, NotFoundError
from controlplane.loops.infaas_scaler import scales_with_infaas
from controlplane.loops.liveness import Liveness
from controlplane.policies.disruption import DisruptionBudget, count_disruptions
from controlplane.policies.drain import (
    DrainInstance,
    guard_drain,
    pooled_stages,
    spare_last_serving,
    with_leftover_types,
    workers_to_end,
)
from controlplane.policies.infaas_scaling import HeldBack, StandIn
from controlplane.policies.lifecycle import (
    KEPT_STATES,
    LIVE_STATES,
    TERMINAL_STATES,
    InstanceState,
    billed_cost_usd_per_hr,
    is_profile_worker,
    profiling_group,
)
from controlplane.settings import Settings
from estimator.catalog import Catalog
from estimator.errors import EstimatorError
from estimator.numbers import plain
from provisioners.artifacts import ArtifactRef
from provisioners.base import (
    APP_TAG,
    INSTANCE_TAG,
    MANAGED_TAG,
    PLAN_TAG,
    LaunchRequest,
    ProvisionedInstance,
    Provisioner,
)
from provisioners.errors import (
    InsufficientCapacityError,
    ProvisionerError,
    SpotUnavailableError,
    UnknownInstanceError,
)
from provisioners.interruptions import (
    INTERRUPTION_NOTICE_S,
    MARKET_TAG,
    InterruptionNotice,
    InterruptionSource,
    SpotPriceSource,
)

__all__ = [
    "DEFAULT_LAUNCH_BACKOFF_S",
    "DEFAULT_MISSING_GRACE_S",
    "DEFAULT_PROFILE_RUN_TIMEOUT_S",
    "DEFAULT_SPOT_HEADROOM_SHARE",
    "DEFAULT_SPOT_RETURN_HOLD_S",
    "DEFAULT_STRAGGLER_TIMEOUT_S",
    "PROFILE_RUN_MISSED_BEATS",
    "SPOT_READ_WARN_EVERY_S",
    "SPOT_RETURN_DRAIN",
    "Action",
    "Adopt",
    "AppPricing",
    "AppReport",
    "ArtifactsFn",
    "BudgetCapped",
    "DrainDeferred",
    "InterruptionHandled",
    "Launch",
    "LaunchSkipped",
    "Mark",
    "Orphan",
    "ReconcileReport",
    "Reconciler",
    "Report",
    "SpotRepriced",
    "SpotReturned",
    "Terminate",
    "applied_plan_fleet",
    "applied_plan_spot",
    "catalog_pricing",
    "disruption_budget",
    "newest_launch",
    "reconcile",
    "request_prefix",
]

logger = logging.getLogger(__name__)

# A worker on a GPU instance boots, pulls its image and loads its models in a few minutes; ten
# is well past that, and short enough that a stuck launch is replaced within the quarter hour.
DEFAULT_STRAGGLER_TIMEOUT_S = 600.0
# EC2's DescribeInstances is eventually consistent: an instance launched a moment ago may be
# missing from it for a few seconds. A row is not ended for being missing before this.
DEFAULT_MISSING_GRACE_S = 30.0
# A failed spot price read is logged again only this long after the same failure, s.
SPOT_READ_WARN_EVERY_S = 60.0
# A profile run touches its workers' rows every DEFAULT_HEARTBEAT_S; four missed beats and the run
# is taken for gone (the run's own count: a second run of the app waits as long for it).
PROFILE_RUN_MISSED_BEATS = RUN_GONE_BEATS
DEFAULT_PROFILE_RUN_TIMEOUT_S = PROFILE_RUN_MISSED_BEATS * DEFAULT_HEARTBEAT_S
# After a launch error that waiting does not cure (a quota, a bad configuration), the type is
# not launched again for the app before this (then one new attempt, one new row).
DEFAULT_LAUNCH_BACKOFF_S = 300.0
# 0.1 + 0.2 must fit a budget of 0.3 (as in controlplane.policies.drain).
_BUDGET_SLACK_USD_PER_HR = 1e-9
# Rule 10's sized stand-ins count as 1/k of an instance: k of them are one, give or take this.
_UNIT_SLACK = 1e-6

_S = InstanceState
# The states another writer moves a row to that leave the reconciler nothing to move.
_ENDING = frozenset({_S.TERMINATING.value, _S.TERMINATED.value, _S.FAILED.value})
# The rows that count toward the fleet's size and its cost.
_KEPT = KEPT_STATES
_LIVE = LIVE_STATES
# Which kept rows go first when a type has too many: not launched yet, booting, serving.
_DROP_ORDER = {_S.REQUESTED: 0, _S.PENDING: 1, _S.RUNNING: 2}

# The end of the reason recorded with the row of a launch in place of spot (rule 10's rise,
# :attr:`Launch.replaces_spot`): a reconciler started again after a crash between the row and
# its ``launch`` decision reads it there (:meth:`Reconciler._replaced_spot`).
_REPLACES_SPOT_SAID = " (on demand in place of spot)"

ORPHAN_REQUEST_PREFIX = "orphan:"
# How long a tick goes on reading a row after it ended (older ended rows are read only where the
# provider still lists their machine): an hour of a fleet's recent past.
ENDED_ROWS_S = 3600.0
# Rule 9: how long an interrupted instance drains (the serving loop drops it within a refresh,
# and what it holds finishes) before it is terminated, and how long before its deadline it is
# terminated at the latest.
DEFAULT_INTERRUPTION_DRAIN_S = 10.0
# How the reason of rule 5's move to draining starts: what tells a later tick why it drains.
SCALE_DOWN_DRAIN = "scale_down:"
DEFAULT_INTERRUPTION_MARGIN_S = 15.0
# Rule 10: a spot price rise moves capacity once the fleet costs more than the budget less this
# share of it at the prices now, so that a rise in steps is acted on before it breaches the
# budget (a tenth: a 10 % rise of an all-spot fleet planned at 90 % of its budget is caught).
DEFAULT_SPOT_HEADROOM_SHARE = 0.1
# Rule 10's move back to spot: a type the plan buys on spot whose instances run on demand (a rise
# moved them there) goes back once its spot price has stayed at or below its on-demand price less
# the headroom share of it for this long, so that a price that flaps does not flap the fleet
# (the launch back-off's five minutes).
DEFAULT_SPOT_RETURN_HOLD_S = DEFAULT_LAUNCH_BACKOFF_S
# How the reason of the move back's drain starts: what tells a later tick why it drains.
SPOT_RETURN_DRAIN = "spot_return:"


# --- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    """Launch one instance of ``instance_type`` under ``request_id`` (recorded as a ``requested``
    row first). ``retry``: the row exists already (a launch that failed retryably, or whose
    answer was lost); the provider returns the first call's instance if there was one."""

    request_id: str
    instance_type: str
    price_usd_per_hr: float
    reason: str
    retry: bool = False
    market: str = "on-demand"
    # Rule 11: the type this instance stands in for (its own type short), counted as that type;
    # rule 10's sized moves: as ``share`` of one (k smaller instances for one, each 1/k).
    stands_for: str | None = None
    share: float = 1.0
    # Rule 10: an on-demand launch in place of a spot instance of its own type whose price rose
    # (the rise's replacement): given back to spot only by the move back, once the fall has held.
    replaces_spot: bool = False


@dataclass(frozen=True, slots=True)
class Terminate:
    """Terminate: the rows ``instance_ids`` move to ``terminating`` (a decision recorded first),
    then the provider is asked to stop ``provider_ids``. ``cause`` is ``scale_down``, ``budget``,
    ``straggler``, ``unresponsive``, ``profile_run_gone``, ``teardown``, ``spot_price``,
    ``spot_return``, ``stopped`` or ``ended``
    (a row that ended while its machine runs on: only the provider is asked, again)."""

    instance_ids: tuple[str, ...]
    provider_ids: tuple[str, ...]
    cause: str
    reason: str
    saved_usd_per_hr: float = 0.0


@dataclass(frozen=True, slots=True)
class Mark:
    """Move the row ``instance_id`` to ``to_state`` (and record its provider id, when given)."""

    instance_id: str
    to_state: InstanceState
    reason: str
    provider_id: str | None = None


@dataclass(frozen=True, slots=True)
class Adopt:
    """The provider runs the instance a ``requested`` row asked for, but the row never learnt
    its id: record ``provider_id`` on the row and move it to ``pending``."""

    instance_id: str
    request_id: str
    provider_id: str
    reason: str
    # A spot row whose instance the provider runs on demand: recorded so, at this price.
    on_demand_usd_per_hr: float | None = None


@dataclass(frozen=True, slots=True)
class Orphan:
    """A managed instance the database does not know (rule 2): record it as ``terminating`` under
    the request id ``orphan:<provider id>`` and terminate it."""

    instance: ProvisionedInstance
    price_usd_per_hr: float
    reason: str


@dataclass(frozen=True, slots=True)
class Report:
    """An instance the provider listed that is not ours to touch (no managed tag)."""

    provider_id: str
    instance_type: str
    reason: str


@dataclass(frozen=True, slots=True)
class BudgetCapped:
    """Launches the desired fleet needs that the budget does not allow (type -> count), and
    what one of each would cost (type -> its price and market: a type of a spot plan may be
    capped on demand)."""

    wanted: Mapping[str, int]
    committed_usd_per_hr: float
    budget_usd_per_hr: float
    each: Mapping[str, tuple[float, str]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LaunchSkipped:
    """Launches not made for another reason than the budget (a type without a price)."""

    instance_type: str
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class DrainDeferred:
    """Excess serving rows kept this tick (rule 5): ``cause`` is ``disruption`` (the disruption
    budget of the window is spent: ``allowed`` more may go now, ``window_s``) or
    ``last_instance`` (the last serving instance of a stage, kept until another serves)."""

    instance_ids: tuple[str, ...]
    cause: str
    reason: str
    allowed: int = 0
    window_s: float = 0.0


@dataclass(frozen=True, slots=True)
class InterruptionHandled:
    """Rule 9: the provider gave notice that ``provider_id`` (row ``instance_id``) goes by
    ``deadline``; the row was taken out of service (``draining``, or terminated when it served
    nothing yet), and its replacement is launched in the same tick where the budget allows."""

    instance_id: str
    provider_id: str
    instance_type: str
    deadline: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class SpotRepriced:
    """Rule 10: the live spot instances of ``instance_type`` are costed at ``price_usd_per_hr``
    now, not at ``launched_usd_per_hr`` (the highest launch price among them); the live fleet
    (draining instances included) costs ``fleet_cost_usd_per_hr`` at the prices now, and a rise
    moves capacity once that is past ``threshold_usd_per_hr`` (the budget less its headroom)."""

    instance_type: str
    count: int
    launched_usd_per_hr: float
    price_usd_per_hr: float
    fleet_cost_usd_per_hr: float
    budget_usd_per_hr: float
    threshold_usd_per_hr: float | None = None
    # How many of them the tick moves to a cheaper choice (None: not decided, as before a move).
    moved: int | None = None

    @property
    def risen(self) -> bool:
        return self.price_usd_per_hr > self.launched_usd_per_hr + _BUDGET_SLACK_USD_PER_HR

    @property
    def over_budget(self) -> bool:
        return self.fleet_cost_usd_per_hr > self.budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR

    @property
    def past_threshold(self) -> bool:
        threshold = (
            self.budget_usd_per_hr
            if self.threshold_usd_per_hr is None
            else (self.threshold_usd_per_hr)
        )
        return self.fleet_cost_usd_per_hr > threshold + _BUDGET_SLACK_USD_PER_HR

    def why(self) -> str:
        """Where the fleet's cost stands against the budget, in words."""
        if self.over_budget:
            return f"over the budget of {plain(self.budget_usd_per_hr)} USD/hr"
        return (
            f"past {self.threshold_usd_per_hr or self.budget_usd_per_hr:.4g} USD/hr, the budget"
            f" of {plain(self.budget_usd_per_hr)} USD/hr less its headroom"
        )


@dataclass(frozen=True, slots=True)
class SpotReturned:
    """Rule 10's move back: ``count`` of ``instance_type``'s on-demand instances go back to spot
    (the plan buys the type on spot), its spot price (``spot_usd_per_hr``) having stayed below
    its on-demand price (``on_demand_usd_per_hr``) by the margin for the hold; ``how`` is
    ``make_before_break`` (the spot one launched next to the one it replaces) or
    ``break_then_make`` (the on-demand one goes first: the budget has no room for both).
    ``instance_ids``: the rows that go (made before the break: the ones now returning, which
    drain once their spot replacements serve; broken first: the one terminated). ``stand_in``:
    they are a stand-in of another type for one of ``instance_type`` (k smaller ones together),
    ``count`` 1, made before the break only."""

    instance_type: str
    count: int
    spot_usd_per_hr: float
    on_demand_usd_per_hr: float
    how: str
    reason: str
    instance_ids: tuple[str, ...] = ()
    # The rows that go are stand-ins of another type for ``instance_type`` (rules 10 and 11),
    # not its own on-demand ones: one of at least its capacity, or k smaller ones for one.
    stand_in: bool = False


Action = (
    Launch
    | Terminate
    | Mark
    | Adopt
    | Orphan
    | Report
    | BudgetCapped
    | LaunchSkipped
    | DrainDeferred
    | InterruptionHandled
    | SpotRepriced
    | SpotReturned
)


# --- the pure function -------------------------------------------------------------------------


def request_prefix(app: AppRecord) -> str:
    """The request ids of ``app``'s launches start with this: the app's name (cut to 20
    characters) and a digest of its identity, so that an app deleted and registered again under
    the same name never reuses a request id (the provider would answer it with the old machine).
    Short enough that ``<prefix>-<n>`` fits EC2's 64-character client token."""
    digest = hashlib.sha256(f"{app.name}|{app.id}|{app.created_at.isoformat()}".encode())
    return f"{app.name[:20]}-{digest.hexdigest()[:8]}"


def _age_s(row: InstanceRecord, now: datetime) -> float:
    return (now - row.created_at).total_seconds()


def _since_update_s(row: InstanceRecord, now: datetime) -> float:
    return (now - row.updated_at).total_seconds()


def _launch_ordinals(request_ids: Iterable[str], prefix: str) -> list[tuple[int, str]]:
    pattern = re.compile(re.escape(prefix) + r"-(\d+)$")
    return [(int(m.group(1)), r) for r in request_ids if (m := pattern.match(r))]


def _next_ordinal(request_ids: Iterable[str], prefix: str) -> int:
    return max((n for n, _ in _launch_ordinals(request_ids, prefix)), default=0) + 1


def newest_launch(request_ids: Iterable[str], prefix: str) -> str | None:
    """Of ``request_ids``, the launch under ``prefix`` numbered highest: the row the next
    launch's number is read from, which the instance history's retention keeps.

    >>> newest_launch(["demo-1a2b-9", "demo-1a2b-10", "profile:demo-x"], "demo-1a2b")
    'demo-1a2b-10'
    """
    return max(_launch_ordinals(request_ids, prefix), default=(0, None))[1]


def _value_per_usd(instance_type: str, price: float, qps_by_type: Mapping[str, float]) -> float:
    if price <= 0:
        return math.inf
    return qps_by_type.get(instance_type, 0.0) / price


@dataclass
class _Row:
    """A row as this tick sees it: its state after the marks decided so far."""

    record: InstanceRecord
    state: InstanceState
    provider_id: str | None
    observed: ProvisionedInstance | None = None
    stands_for: str | None = None  # rule 11: counted as this type, not its own
    share: float = 1.0  # and as this much of one of it (rule 10's sized moves: 1/k)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def counted_type(self) -> str:
        return self.stands_for or self.record.instance_type

    @property
    def launched(self) -> bool:
        return self.provider_id is not None


def _still_billed(row: _Row) -> bool:
    """Whether ``row`` was on its way out or ended before this tick (terminating, failed,
    terminated) while the provider still lists its machine pending or running: the terminate
    has not taken, and the machine is billed."""
    return (
        row.record.state in _GONE_VALUES
        and row.observed is not None
        and row.observed.state in ("pending", "running")
    )


_GONE_VALUES = frozenset(
    s.value for s in (_S.TERMINATING, InstanceState.FAILED, InstanceState.TERMINATED)
)


def reconcile(
    desired: Mapping[str, int] | None,
    db_instances: Sequence[InstanceRecord],
    observed: Sequence[ProvisionedInstance] | None,
    prices_usd_per_hr: Mapping[str, float],
    budget_usd_per_hr: float,
    now: datetime,
    straggler_timeout_s: float = DEFAULT_STRAGGLER_TIMEOUT_S,
    *,
    request_prefix: str = "r",
    qps_by_type: Mapping[str, float] | None = None,
    unhealthy: Collection[str] = (),
    unresponsive: Mapping[str, str] | None = None,
    silent: Collection[str] = (),
    missing_grace_s: float = DEFAULT_MISSING_GRACE_S,
    held_types: Collection[str] = (),
    stage_types: Mapping[str, Collection[str]] | None = None,
    disruption: DisruptionBudget | None = None,
    disrupted_in_window: int = 0,
    teardown: bool = False,
    profile_run_timeout_s: float = DEFAULT_PROFILE_RUN_TIMEOUT_S,
    notices: Mapping[str, datetime] | None = None,
    handled: Collection[str] = (),
    drain_s: float = DEFAULT_INTERRUPTION_DRAIN_S,
    margin_s: float = DEFAULT_INTERRUPTION_MARGIN_S,
    desired_spot: Mapping[str, int] | None = None,
    spot_prices_usd_per_hr: Mapping[str, float] | None = None,
    ranking: Mapping[str, Sequence[str]] | None = None,
    short_types: Collection[str] = (),
    stand_ins: Mapping[str, str] | None = None,
    headroom_share: float = DEFAULT_SPOT_HEADROOM_SHARE,
    stand_in_shares: Mapping[str, float] | None = None,
    app: str = "",
    spot_on_demand: Collection[str] = (),
    used_request_ids: Callable[[], Iterable[str]] | None = None,
    drain_causes: Mapping[str, str] | None = None,
    missing_since: Mapping[str, datetime] | None = None,
    spot_fallen: Collection[str] = (),
    spot_returning: Collection[str] = (),
    spot_replacements: Collection[str] = (),
    spot_failing: Collection[str] = (),
) -> list[Action]:
    """What to do to bring one app's fleet to ``desired`` within ``budget_usd_per_hr``.

    ``db_instances``: the store's records of the app's instances: every live one, and the
    ended ones the provider may still list (all of them will do). ``used_request_ids``: reads every
    request id the app's rows have used, ended ones too (None: those of ``db_instances``), called
    only when the tick launches: launches are numbered past them, since the provider answers a
    request id it has seen with its old machine. ``observed``: the provider's list of the app's
    instances (by its tags); ``None`` when it could not be read (throttled, the provider down):
    then only the budget guard's drain is decided, from the database alone, so that a lowered
    budget holds even while the provider cannot be listed. ``qps_by_type``: Q_t, queries per
    second one instance of type t serves (ranks instances for the budget guard; missing types
    rank by price alone).
    ``unhealthy``: provider ids the provider calls ``running`` whose worker failed the health
    probe (their rows stay ``pending``). ``unresponsive``: provider id -> why, of the running
    workers that stopped answering (:mod:`controlplane.loops.liveness`): their rows are
    terminated (cause ``unresponsive``) and replaced; ``silent``: provider ids whose last probe
    went unanswered, which rule 5 ends first. ``held_types``: types not to launch now
    (backing off after a launch error). ``stage_types``: the applied plan's stages (name ->
    planned types), whose last serving instances rule 5 and the budget guard keep.
    ``disruption``: the disruption budget of rule 5 (``None``: none), with
    ``disrupted_in_window`` serving instances of the app already moved out within its window.
    ``teardown``: end every kept row, launch nothing. ``profile_run_timeout_s``: how long a
    profile worker's row may go untouched before its run is taken for gone (rule 8).
    ``notices``: provider id -> deadline of the instances the provider gave notice of (rule 9,
    with ``drain_s`` and ``margin_s``; ``handled``: the provider ids whose notice was acted on
    already).
    ``desired_spot``: how many of each type's desired instances are spot, and
    ``spot_prices_usd_per_hr`` the spot prices now (rule 10). ``ranking``: type -> the types
    that may stand in for it, preferred first; ``short_types``: the types the provider is short
    of now (a capacity miss running); ``stand_ins``: row id -> the type a row stands in for
    (rule 11). ``headroom_share``: the share of the budget below it at which a spot price rise
    starts moving capacity (rule 10); ``stand_in_shares``: row id -> how much of one instance of
    the type it stands for a stand-in counts as (default 1). ``spot_on_demand``: the types whose
    spot launches the provider ran on demand lately (EC2 without a launch template, or with no
    spot capacity): launched on demand, priced and budgeted so (rule 10). ``drain_causes``: row
    id -> why a draining row drains where it is not an interruption (``scale_down``: rule 5
    drained it; the cause of its ``terminate`` once drained). ``missing_since``: row id -> when
    the provider's list was first seen without the row's machine, in the run of ticks up to
    this one (None: every row is taken to have been missing since its last update); rule 3
    ends a row once it has been missing for ``missing_grace_s`` by both. ``spot_fallen``: the
    types whose spot price has stayed at or below their on-demand price less ``headroom_share``
    of it for the hold (rule 10's move back to spot). ``spot_returning``: the ids of the
    on-demand rows an earlier tick's move back took as returning (made before the break), whose
    spot replacements are the type's rows past its count; ``spot_replacements``: the ids of the
    on-demand rows launched in place of their own type's spot instances by a rise
    (:attr:`Launch.replaces_spot`), given back to spot only once the fall has held; the
    stand-ins of another type for a fallen type go back too (made before the break only, taken
    as returning by the ids of ``spot_returning`` as well), but for the types in
    ``spot_failing``: launches that failed for want of capacity within the back-off. The rules
    are the module docstring's; the actions come in the order they must be carried out.
    """
    if budget_usd_per_hr < 0 or not math.isfinite(budget_usd_per_hr):
        raise ValueError(f"budget_usd_per_hr must be finite and >= 0, got {budget_usd_per_hr!r}")
    for instance_type, count in (desired or {}).items():
        if count < 0:
            raise ValueError(f"desired count of {instance_type} must be >= 0, got {count}")
    values = qps_by_type or {}
    actions: list[Action] = []
    if not 0.0 <= headroom_share < 1.0:
        raise ValueError(f"headroom_share must be in [0, 1), got {headroom_share!r}")
    spot_prices = spot_prices_usd_per_hr or {}
    db_instances = _repriced(db_instances, spot_prices, budget_usd_per_hr, headroom_share, actions)
    standing = stand_ins or {}
    shares = stand_in_shares or {}
    rows = [
        _Row(
            r,
            InstanceState(r.state),
            r.provider_id,
            stands_for=standing.get(r.id),
            share=shares.get(r.id, 1.0) if r.id in standing else 1.0,
        )
        for r in db_instances
    ]
    stages = _with_leftovers(stage_types or {}, rows)
    if observed is None:
        kept = [row for row in rows if row.state in _KEPT]
        if teardown:
            _tear_down(kept, actions)
        else:
            fleet = [row for row in kept if not _profiling(row)]
            profiling = [row for row in kept if _profiling(row)]
            reserved = _end_profiling_over_budget(fleet, profiling, budget_usd_per_hr, actions, app)
            draining = [row for row in rows if row.state is _S.DRAINING]
            _shed_leaving(fleet, draining, budget_usd_per_hr - reserved, actions)
            _fit_budget(fleet, budget_usd_per_hr, values, stages, actions)
        return actions
    _match(rows, observed, prices_usd_per_hr, actions)
    for row in rows:
        _follow_provider(
            row,
            now,
            straggler_timeout_s,
            _missing_s(row, now, missing_since),
            missing_grace_s,
            unhealthy,
            unresponsive or {},
            actions,
        )
    _replace_stragglers(rows, now, straggler_timeout_s, actions)
    _reap_profile_workers(rows, now, profile_run_timeout_s, actions)
    doomed, leaving = _act_on_notices(
        rows, notices or {}, handled, desired, now, drain_s, margin_s, actions, drain_causes
    )
    kept = [row for row in rows if row.state in _KEPT and row.id not in doomed]
    if teardown:
        # The rows serving on under a notice until their replacement does go too: none will
        # be launched now (they were left serving, billed, until near their deadline).
        _tear_down(kept + [row for row in rows if row.id in doomed], actions)
        return actions
    profiling = [row for row in kept if _profiling(row)]
    kept = [row for row in kept if not _profiling(row)]
    if desired is not None:
        kept, leaving = _take_back(
            kept, leaving, desired, drain_causes or {}, notices or {}, actions
        )
    ranked = ranking or {}
    noticed_spot = frozenset(
        row.record.instance_type
        for row in rows
        if row.record.market == "spot" and (row.provider_id or "") in (notices or {})
    )
    unavailable = frozenset(short_types) | frozenset(held_types) | noticed_spot
    # Rule 10: a spot price rise that takes the fleet past the budget less its headroom moves
    # the risen capacity before the budget is breached: make-before-break while the budget pays
    # for both, else break-then-make.
    rise = _Rise.of(actions, budget_usd_per_hr, headroom_share)
    risen = rise.types
    choices = _Ranked(ranked, prices_usd_per_hr, spot_prices, values)
    moving: list[_Row] = []
    # A risen type may also move to itself on demand, unless the provider is short of it.
    blocked = frozenset(short_types) | frozenset(held_types)
    if risen and desired is not None and not rise.over_budget:
        kept, moving = _move_before_break(
            kept, rows, rise, choices, unavailable | risen, desired, notices or {}, actions, blocked
        )
        leaving += moving
    returned = 0  # serving rows the move back took out of service this tick
    if desired is not None and desired_spot:
        # Rule 10's move back: on-demand rows of a type the plan buys on spot return to spot once
        # its price has fallen back and stayed down.
        paid = float(
            sum(
                row.record.price_usd_per_hr
                for row in rows
                if row.state in _KEPT or row.state is _S.DRAINING or _still_billed(row)
            )
        )
        ctx = _Return(
            desired,
            desired_spot,
            frozenset(spot_fallen) - risen - unavailable - frozenset(spot_on_demand),
            risen,
            prices_usd_per_hr,
            spot_prices,
            values,
            stages,
            notices or {},
            budget_usd_per_hr - paid,
            frozenset(spot_returning),
            frozenset(spot_replacements),
            (
                disruption.remaining(
                    sum(1 for row in kept if row.state is _S.RUNNING), disrupted_in_window
                )
                if disruption is not None
                else len(rows)
            ),
            frozenset(short_types) | frozenset(held_types),
            frozenset(spot_failing),
        )
        kept, returning, returned = _move_back_to_spot(kept, rows, ctx, actions)
        leaving += returning
        # Then the stand-ins of another type, with what room and disruptions that left.
        kept, returning, stood_down = _return_stand_ins(kept, rows, ctx, actions)
        leaving += returning
        returned += stood_down
    spared: list[_Row] = []
    if desired is not None:
        # The serving rows the move back drained or ended this tick count against the same
        # disruption budget as the scale-down's.
        kept, spared, drained = _drop_excess(
            kept,
            desired,
            values,
            stages,
            disruption,
            disrupted_in_window + returned,
            actions,
            silent,
        )
        leaving += drained  # paid for until they go (rule 9 ends them once drained)
    reserved = _end_profiling_over_budget(kept, profiling, budget_usd_per_hr, actions, app)
    moved = Counter(row.record.instance_type for row in moving)
    if risen and desired is not None and not moving:
        staying_ids = {
            row.id
            for row in _move_off_risen(kept, rise, choices, unavailable | risen, actions, blocked)
        }
        moved.update(row.record.instance_type for row in kept if row.id not in staying_ids)
        kept = [row for row in kept if row.id in staying_ids]
    if risen:  # what the spot_price decisions say follows: a move, or none
        actions[:] = [
            dataclasses.replace(a, moved=moved[a.instance_type])
            if isinstance(a, SpotRepriced)
            else a
            for a in actions
        ]
    # The hard cap at the prices now, with what is leaving (rule 9) paid for until it goes.
    leaving = _shed_leaving(kept, leaving, budget_usd_per_hr - reserved, actions)
    kept = _fit_budget(kept, budget_usd_per_hr, values, stages, actions)
    _forget_deferred_that_went(actions)
    # The instances draining before their interruption are paid for until they go: the
    # replacements are launched next to them only where the budget pays for both.
    reserved += float(sum(row.record.price_usd_per_hr for row in leaving))
    # So is a machine the provider still runs whose row ended before this tick (a terminate
    # that failed, asked again every tick): nothing is launched next to it that the budget
    # cannot pay for with it.
    reserved += float(sum(row.record.price_usd_per_hr for row in rows if _still_billed(row)))
    staying = {row.id for row in kept}
    spared = [row for row in spared if row.id in staying]
    # Rule 11: a launch of a type the provider is short of waits no longer where another type
    # of the plan's ranking can stand in for it (decided with the shortfall, below).
    given_up = [
        row
        for row in kept
        if row.state is _S.REQUESTED
        and not row.launched
        and row.record.instance_type in short_types
        and ranked.get(row.record.instance_type)
        and desired is not None
    ]
    given_up_ids = {row.id for row in given_up}
    # Launches that failed retryably, or whose answer was lost: again, with the same request id.
    for row in kept:
        if row.state is _S.REQUESTED and not row.launched and row.id not in given_up_ids:
            actions.append(_launch_again(row))
    if desired is not None:
        launches = functools.partial(
            _launch_shortfall,
            desired=desired,
            rows=rows,
            prices_usd_per_hr=prices_usd_per_hr,
            budget_usd_per_hr=budget_usd_per_hr,
            qps_by_type=values,
            held_types=held_types,
            prefix=request_prefix,
            first_ordinal=lambda: _next_ordinal(
                (r.request_id for r in db_instances)
                if used_request_ids is None
                else used_request_ids(),
                request_prefix,
            ),
            reserved_usd_per_hr=reserved,
            desired_spot=desired_spot or {},
            spot_prices_usd_per_hr=spot_prices,
            ranking=ranked,
            short_types=frozenset(short_types),
            noticed_spot=noticed_spot,
            risen_spot=risen,
            risen_why=rise.why,
            given_up=given_up,
            spot_on_demand=frozenset(spot_on_demand),
        )
        kept = [row for row in kept if row.id not in given_up_ids]
        planned = launches(kept)
        if spared and any(isinstance(a, BudgetCapped) for a in planned):
            spared_ids = {row.id for row in spared}
            rest = [row for row in kept if row.id not in spared_ids]
            instead = launches(rest)
            if _launch_count(instead) > _launch_count(planned):
                # Make-before-break needs room in the budget for both; without it, the plan
                # (which fits the budget) wins over the last instance of the old mix: break,
                # then make.
                actions[:] = [
                    a
                    for a in actions
                    if not (isinstance(a, DrainDeferred) and a.cause == "last_instance")
                ]
                _terminate(
                    spared,
                    "scale_down",
                    "the budget needs its cost for the instances that replace it",
                    actions,
                )
                planned = instead
        actions.extend(planned)
    return actions


def _profiling(row: _Row) -> bool:
    return is_profile_worker(row.record.request_id)


def _with_leftovers(
    stage_types: Mapping[str, Collection[str]], rows: Sequence[_Row]
) -> dict[str, list[str]]:
    """The stages whose last serving instance is kept (name -> types), each with the types
    of the app's instances that no stage of the applied plan plans (a type a new plan dropped,
    one the tuner added): such instances serve every stage (controlplane.serving.placement), so
    a stage left with none of its own types running keeps one of them until its own type runs,
    however many plans were applied since (make-before-break on a change of type)."""
    return with_leftover_types(
        stage_types, (row.record.instance_type for row in rows if not _profiling(row))
    )


def _end_profiling_over_budget(
    fleet: Sequence[_Row],
    profiling: Sequence[_Row],
    budget_usd_per_hr: float,
    actions: list[Action],
    app: str = "",
) -> float:
    """Rule 8 and the budget guard: when the fleet and the profile runs' and rollouts' workers
    cost more than the budget, those workers go first, a whole run or rollout at a time, as
    many as the budget needs (:func:`~controlplane.policies.drain.workers_to_end`: a profile
    run's before a rollout's; the budget route's drain names the same). What the ones that stay
    cost."""
    reserved = float(sum(row.record.price_usd_per_hr for row in profiling))
    fleet_cost = float(sum(row.record.price_usd_per_hr for row in fleet))
    ending = set(
        workers_to_end(
            fleet_cost,
            (
                (row.id, profiling_group(app, row.record.request_id), row.record.price_usd_per_hr)
                for row in profiling
            ),
            budget_usd_per_hr,
        )
    )
    if not ending:
        return reserved
    ended = [row for row in profiling if row.id in ending]
    groups = sorted({profiling_group(app, row.record.request_id) for row in ended})
    _terminate(
        ended,
        "budget",
        f"the fleet and its profile workers cost {fleet_cost + reserved:.3f} USD/hr, over the"
        f" budget of {plain(budget_usd_per_hr)} USD/hr: the profile workers go first"
        f" ({', '.join(groups)})",
        actions,
    )
    return reserved - float(sum(row.record.price_usd_per_hr for row in ended))


def _reap_profile_workers(
    rows: Sequence[_Row], now: datetime, timeout_s: float, actions: list[Action]
) -> None:
    """Rule 8: end the kept profile workers whose run stopped touching their rows."""
    gone = [
        row
        for row in rows
        if row.state in _KEPT and _profiling(row) and _since_update_s(row.record, now) > timeout_s
    ]
    if gone:
        _terminate(
            gone,
            "profile_run_gone",
            f"a profile run's worker whose run has not been heard of for {timeout_s:g} s"
            " (its replica crashed or lost the lead)",
            actions,
        )


def _launch_count(actions: Sequence[Action]) -> int:
    return sum(1 for action in actions if isinstance(action, Launch))


def _tear_down(kept: Sequence[_Row], actions: list[Action]) -> None:
    """The teardown: every kept row goes at once."""
    if kept:
        _terminate(kept, "teardown", "app down: drain every instance, then delete the app", actions)


def _match(
    rows: list[_Row],
    observed: Sequence[ProvisionedInstance],
    prices_usd_per_hr: Mapping[str, float],
    actions: list[Action],
) -> None:
    """Rule 1 and 2: attach each provider instance to its row, adopt, orphan or report."""
    by_provider = {row.provider_id: row for row in rows if row.provider_id is not None}
    by_request = {row.record.request_id: row for row in rows}
    for instance in observed:
        if instance.tags.get(MANAGED_TAG) != "true":
            actions.append(
                Report(
                    instance.provider_id,
                    instance.instance_type,
                    "listed without the managed tag: not ours, left alone",
                )
            )
            continue
        row = by_provider.get(instance.provider_id)
        if row is not None:
            row.observed = instance
            continue
        request_id = instance.request_id
        candidate = by_request.get(request_id) if request_id is not None else None
        if (
            candidate is not None
            and candidate.state is _S.REQUESTED
            and not candidate.launched
            and candidate.record.instance_type == instance.instance_type
        ):
            candidate.provider_id = instance.provider_id
            candidate.observed = instance
            on_demand = prices_usd_per_hr.get(instance.instance_type)
            if candidate.record.market != "spot" or instance.market != "on-demand":
                on_demand = None
            if on_demand is not None:  # billed on demand: counted so from this tick
                candidate.record = dataclasses.replace(
                    candidate.record, market="on-demand", price_usd_per_hr=on_demand
                )
            actions.append(
                Adopt(
                    candidate.id,
                    candidate.record.request_id,
                    instance.provider_id,
                    f"the provider runs {instance.provider_id} for request {request_id}"
                    + ("" if on_demand is None else f" (on demand, at {plain(on_demand)} USD/hr)"),
                    on_demand_usd_per_hr=on_demand,
                )
            )
            candidate.state = _S.PENDING
            continue
        if instance.state in ("terminated", "failed"):
            continue  # gone already: nothing to pay for, nothing to do
        if candidate is None:
            why = f"its request id {request_id!r} is unknown to the database"
        elif candidate.launched:
            why = f"request {request_id} already has instance {candidate.provider_id}"
        else:
            why = f"request {request_id} was given up ({candidate.state.value})"
        actions.append(
            Orphan(
                instance,
                prices_usd_per_hr.get(instance.instance_type, 0.0),
                f"managed instance {instance.provider_id} is not in the database: {why};"
                " terminated (rule: adopt only launches still waiting for their instance)",
            )
        )


def _missing_s(row: _Row, now: datetime, missing_since: Mapping[str, datetime] | None) -> float:
    """How long rule 3 takes ``row``'s machine to have been missing from the provider's list:
    since the row's last update, and no longer than since the first tick that found it missing
    (a machine the list left out for a moment, an eventually consistent list or a tag put back,
    is not taken for lost on the first tick it is missing)."""
    since_update = _since_update_s(row.record, now)
    if missing_since is None:
        return since_update
    first = missing_since.get(row.id, now)
    return min(since_update, (now - first).total_seconds())


def _follow_provider(
    row: _Row,
    now: datetime,
    straggler_timeout_s: float,
    missing_s: float,
    missing_grace_s: float,
    unhealthy: Collection[str],
    unresponsive: Mapping[str, str],
    actions: list[Action],
) -> None:
    """Rule 3: move the row as the provider's list says (a running row whose worker stopped
    answering is terminated: ``unresponsive``; one the list has left out for ``missing_s``
    ends after ``missing_grace_s``)."""
    seen = row.observed
    if row.state in TERMINAL_STATES:
        if seen is not None and seen.state in ("pending", "running", "failed"):
            actions.append(
                Terminate(
                    (),
                    (seen.provider_id,),
                    "ended",
                    f"row {row.id} is {row.state.value} but the provider still runs"
                    f" {seen.provider_id}",
                )
            )
        return
    if seen is None:
        if not row.launched:
            if row.state is _S.REQUESTED and _age_s(row.record, now) > straggler_timeout_s:
                _mark(row, _S.FAILED, f"not launched within {straggler_timeout_s:g} s", actions)
            return
        if row.state is _S.TERMINATING:
            _mark(row, _S.TERMINATED, "the provider no longer lists it", actions)
        elif missing_s > missing_grace_s:
            _mark(row, _S.FAILED, "the provider no longer lists it (lost)", actions)
        return
    pid = seen.provider_id
    if seen.state in ("terminated", "failed"):
        if row.state is _S.TERMINATING:
            _mark(row, _S.TERMINATED, f"the provider reports it {seen.state}", actions)
        else:
            _mark(row, _S.FAILED, f"the provider reports it {seen.state}", actions)
        if seen.state == "failed":
            # A failed machine may still hold resources (a local worker's record, a volume).
            actions.append(Terminate((), (pid,), "ended", f"clean up the failed {pid}"))
        return
    if seen.state == "stopping":
        if row.state is not _S.TERMINATING:
            _mark(row, _S.FAILED, "stopping, not by the control plane", actions)
            actions.append(
                Terminate((), (pid,), "stopped", f"{pid} was stopped outside the control plane")
            )
        return
    # pending or running at the provider
    if row.state is _S.TERMINATING:
        actions.append(
            Terminate((), (pid,), "ended", f"{pid} is still {seen.state}: terminate again")
        )
        return
    if row.state is _S.REQUESTED:
        actions.append(Mark(row.id, _S.PENDING, f"the provider has {pid}", pid))
        row.state = _S.PENDING
    if seen.state == "running" and row.state is _S.PENDING and pid not in unhealthy:
        _mark(row, _S.RUNNING, "running and healthy", actions)
    elif seen.state == "running" and row.state is _S.RUNNING and pid in unresponsive:
        _terminate([row], "unresponsive", f"{pid}: {unresponsive[pid]}", actions)


def _mark(row: _Row, to_state: InstanceState, reason: str, actions: list[Action]) -> None:
    actions.append(Mark(row.id, to_state, reason))
    row.state = to_state


def _terminate(rows: Sequence[_Row], cause: str, reason: str, actions: list[Action]) -> None:
    """End ``rows``: the not-launched ones are marked failed, the others terminated."""
    unlaunched = [row for row in rows if not row.launched]
    for row in unlaunched:
        _mark(row, _S.FAILED, f"{reason} (not launched yet)", actions)
    launched = [row for row in rows if row.launched]
    if launched:
        actions.append(
            Terminate(
                tuple(row.id for row in launched),
                tuple(row.provider_id for row in launched if row.provider_id is not None),
                cause,
                reason,
                float(sum(row.record.price_usd_per_hr for row in launched)),
            )
        )
        for row in launched:
            row.state = _S.TERMINATING


def _act_on_notices(
    rows: Sequence[_Row],
    notices: Mapping[str, datetime],
    handled: Collection[str],
    desired: Mapping[str, int] | None,
    now: datetime,
    drain_s: float,
    margin_s: float,
    actions: list[Action],
    drain_causes: Mapping[str, str] | None = None,
) -> tuple[set[str], list[_Row]]:
    """Rule 9: the rows with a notice that still serve until their replacement does (no longer
    kept: rule 7 replaces them), and the rows leaving that are paid for until they go: those
    and the draining rows that stay. ``drain_causes``: row id -> why a draining row without a
    notice drains (``scale_down``: rule 5 drained it), the cause of its ``terminate``
    (``interruption`` where it is not given)."""
    doomed: set[str] = set()
    leaving: list[_Row] = []
    noticed = [row for row in rows if (row.provider_id or "") in notices]
    for row in noticed:
        if row.state not in (_S.PENDING, _S.RUNNING):
            continue
        pid = row.provider_id or ""
        deadline = notices[pid]
        left_s = (deadline - now).total_seconds()
        what = (
            f"the provider takes {pid} away by {deadline.isoformat()}"
            f" ({max(0.0, left_s):.0f} s left)"
        )
        drain_at = deadline - timedelta(seconds=margin_s + drain_s)
        if row.state is _S.PENDING:
            _terminate([row], "interruption", f"{what}; it serves nothing yet", actions)
            done = "served nothing yet: terminated, and its replacement is launched"
        else:
            instance_type = row.counted_type
            others = sum(
                other.share
                for other in rows
                if other.state is _S.RUNNING
                and other.counted_type == instance_type
                and (other.provider_id or "") not in notices
            )
            if now >= drain_at or others >= (desired or {}).get(instance_type, 0) - _UNIT_SLACK:
                why = "its replacement serves" if now < drain_at else "its deadline is near"
                _mark(row, _S.DRAINING, f"{what}: {why}; no new queries", actions)
            else:
                doomed.add(row.id)
                leaving.append(row)
            if now >= drain_at:  # no time to serve on: it drains now
                done = "a replacement is launched at once; it drains now and is terminated"
            else:
                done = (
                    "a replacement is launched at once; it serves until the replacement does"
                    f" (or {drain_at.isoformat()} at the latest), then drains and is terminated"
                )
        if pid not in handled:
            actions.append(
                InterruptionHandled(
                    row.id, pid, row.record.instance_type, deadline, f"{what}: {done}"
                )
            )
    for row in rows:
        if row.state is not _S.DRAINING:
            continue
        # Draining since this tick, or since the row's last move (an earlier tick).
        since = now if row.record.state != _S.DRAINING.value else row.record.updated_at
        # A row whose notice this process did not see: EC2's two minutes.
        unseen = since + timedelta(seconds=INTERRUPTION_NOTICE_S)
        deadline = notices.get(row.provider_id or "", unseen)
        end = min(since + timedelta(seconds=drain_s), deadline - timedelta(seconds=margin_s))
        if now >= end:
            has_notice = (row.provider_id or "") in notices
            cause = "interruption" if has_notice else (drain_causes or {}).get(row.id)
            if has_notice:
                why = f"drained before its interruption (deadline {deadline.isoformat()})"
            elif cause == "scale_down":
                why = f"drained for {drain_s:g} s after its scale-down"
            elif cause == "spot_return":
                why = f"drained for {drain_s:g} s: its spot replacement serves in its place"
            else:
                why = (
                    f"drained for {drain_s:g} s (its interruption, or a move off a risen spot"
                    " price; a notice not seen by this process is given two minutes)"
                )
            _terminate([row], cause or "interruption", why, actions)
        else:
            leaving.append(row)
    return doomed, leaving


def _spot_price_now(record: InstanceRecord, spot_prices: Mapping[str, float]) -> float | None:
    """The spot price now of a live spot row's type, where it is known; None for any other row."""
    if record.market != "spot" or record.state in TERMINAL_STATES:
        return None
    return spot_prices.get(record.instance_type)


def _price_moved(price: float, other: float) -> bool:
    """Two prices that differ by more than the budget's rounding slack."""
    return abs(price - other) > _BUDGET_SLACK_USD_PER_HR


def _repriced(
    db_instances: Sequence[InstanceRecord],
    spot_prices: Mapping[str, float],
    budget_usd_per_hr: float,
    headroom_share: float,
    actions: list[Action],
) -> list[InstanceRecord]:
    """Rule 10: the live spot rows costed at their type's spot price now (``price_usd_per_hr``,
    what the rules read; the row's recorded price now, a tick old, is dropped)."""
    repriced: list[InstanceRecord] = []
    changed: dict[str, list[float]] = defaultdict(list)
    for record in db_instances:
        now_price = _spot_price_now(record, spot_prices)
        if now_price is not None:
            moved = _price_moved(now_price, record.price_usd_per_hr)
            if moved:
                changed[record.instance_type].append(record.price_usd_per_hr)
            if moved or record.price_now_usd_per_hr is not None:
                record = dataclasses.replace(
                    record,
                    price_usd_per_hr=now_price if moved else record.price_usd_per_hr,
                    price_now_usd_per_hr=None,
                )
        repriced.append(record)
    if changed:
        paid_for = {state.value for state in _KEPT | {_S.DRAINING}}
        cost = float(sum(r.price_usd_per_hr for r in repriced if r.state in paid_for))
        for instance_type, launched in sorted(changed.items()):
            actions.append(
                SpotRepriced(
                    instance_type,
                    len(launched),
                    max(launched),
                    spot_prices[instance_type],
                    cost,
                    budget_usd_per_hr,
                    budget_usd_per_hr * (1.0 - headroom_share),
                )
            )
    return repriced


def _replace_stragglers(
    rows: Sequence[_Row], now: datetime, straggler_timeout_s: float, actions: list[Action]
) -> None:
    """Rule 4 for pending rows (requested ones are handled with the provider's word)."""
    late = [
        row
        for row in rows
        if row.state is _S.PENDING and _age_s(row.record, now) > straggler_timeout_s
    ]
    if late:
        _terminate(
            late,
            "straggler",
            f"not healthy {straggler_timeout_s:g} s after launch: replaced",
            actions,
        )


def _drain_instance(row: _Row) -> DrainInstance:
    return DrainInstance(
        row.id,
        row.record.instance_type,
        row.state.value,
        row.record.price_usd_per_hr,
        row.record.created_at,
    )


def _drop_excess(
    kept: list[_Row],
    desired: Mapping[str, int],
    qps_by_type: Mapping[str, float],
    stage_types: Mapping[str, Collection[str]],
    disruption: DisruptionBudget | None,
    disrupted_in_window: int,
    actions: list[Action],
    silent: Collection[str] = (),
) -> tuple[list[_Row], list[_Row], list[_Row]]:
    """Rule 5: per type, end the kept rows beyond the desired count, but for the last serving
    instance of a stage and what the disruption budget defers; of the running ones, those whose
    worker went ``silent`` (its last liveness probe unanswered) first. A serving one drains
    (rule 9 terminates it once drained), the others are terminated. The rows kept, of them the
    ones spared as the last of their stage, and the ones draining now."""
    by_type: dict[str, list[_Row]] = defaultdict(list)
    for row in kept:
        by_type[row.counted_type].append(row)
    extra: dict[str, list[_Row]] = {}
    for instance_type in sorted(by_type):
        have = by_type[instance_type]
        want = desired.get(instance_type, 0)
        total = _units(have)
        if total <= want + _UNIT_SLACK:
            continue
        order = sorted(
            have,
            key=lambda row: (
                _DROP_ORDER[row.state],
                row.provider_id not in silent,
                -row.record.created_at.timestamp(),
                row.id,
            ),
        )
        # As many as leave the desired count kept (a sized stand-in counts as its share).
        going_rows: list[_Row] = []
        for row in order:
            if total - row.share >= want - _UNIT_SLACK:
                going_rows.append(row)
                total -= row.share
        if going_rows:
            extra[instance_type] = going_rows
    leaving = [row for rows in extra.values() for row in rows]
    leaving_ids = {row.id for row in leaving}
    spared_ids = set(
        spare_last_serving(
            [_drain_instance(row) for row in kept if row.id not in leaving_ids],
            [_drain_instance(row) for row in leaving],
            stage_types,
        )
    )
    deferred_ids: set[str] = set()
    if disruption is not None:
        serving = [row for row in leaving if row.state is _S.RUNNING and row.id not in spared_ids]
        serving_now = sum(1 for row in kept if row.state is _S.RUNNING)
        allowed = disruption.remaining(serving_now, disrupted_in_window)
        if len(serving) > allowed:
            # The least cost-effective go first, as in the budget guard.
            serving.sort(
                key=lambda row: (
                    row.provider_id not in silent,
                    _value_per_usd(
                        row.record.instance_type, row.record.price_usd_per_hr, qps_by_type
                    ),
                    -row.record.price_usd_per_hr,
                    -row.record.created_at.timestamp(),
                    row.id,
                )
            )
            deferred = serving[allowed:]
            deferred_ids = {row.id for row in deferred}
            actions.append(
                DrainDeferred(
                    tuple(row.id for row in deferred),
                    "disruption",
                    f"the disruption budget allows"
                    f" {disruption.allowance(serving_now + disrupted_in_window)} of"
                    f" {serving_now + disrupted_in_window} serving instance(s) drained per"
                    f" {disruption.window_s:g} s ({disrupted_in_window} in this window,"
                    f" {allowed} now); the rest go later",
                    allowed=allowed,
                    window_s=disruption.window_s,
                )
            )
    if spared_ids:
        actions.append(
            DrainDeferred(
                tuple(sorted(spared_ids)),
                "last_instance",
                "the last serving instance of a stage stays until another of the stage serves",
            )
        )
    dropped: set[str] = set()
    drained: list[_Row] = []
    for instance_type, rows in extra.items():
        going = [row for row in rows if row.id not in spared_ids and row.id not in deferred_ids]
        if not going:
            continue
        why = (
            f"{instance_type}: {len(by_type[instance_type])} kept,"
            f" {desired.get(instance_type, 0)} desired"
        )
        # A serving worker drains first: the serving loop sends it no new query from its next
        # refresh, and rule 9 terminates it once it has drained (the queries it holds answered;
        # terminated at once, those dispatched before the refresh found it gone).
        serving = [
            row for row in going if row.state is _S.RUNNING and row.provider_id not in silent
        ]
        for row in serving:
            _mark(
                row,
                _S.DRAINING,
                f"{SCALE_DOWN_DRAIN} {why}; no new queries, then terminated",
                actions,
            )
        drained += serving
        ending = [row for row in going if row not in serving]
        if ending:
            _terminate(ending, "scale_down", why, actions)
        dropped.update(row.id for row in going)
    remaining = [row for row in kept if row.id not in dropped]
    return remaining, [row for row in remaining if row.id in spared_ids], drained


def _take_back(
    kept: list[_Row],
    leaving: list[_Row],
    desired: Mapping[str, int],
    drain_causes: Mapping[str, str],
    notices: Mapping[str, datetime],
    actions: list[Action],
) -> tuple[list[_Row], list[_Row]]:
    """Rule 5's drains taken back: a row draining for a scale-down (``drain_causes``) whose
    type the desired count now wants more of than is kept serves again (``draining ->
    running``; its worker never stopped), the latest drained first, instead of a launch that
    boots. A row draining for another cause (an interruption, a move off a risen spot price),
    or whose machine the provider has given notice of since, stays on its way out. The rows kept
    and those still leaving."""
    have: dict[str, float] = defaultdict(float)
    for row in kept:
        have[row.counted_type] += row.share
    back: list[_Row] = []
    candidates = [
        row
        for row in leaving
        if row.state is _S.DRAINING
        and drain_causes.get(row.id) == "scale_down"
        and (row.provider_id or "") not in notices
    ]
    for row in sorted(candidates, key=lambda r: (r.record.updated_at, r.id), reverse=True):
        instance_type = row.counted_type
        want = desired.get(instance_type, 0)
        if have[instance_type] + row.share <= want + _UNIT_SLACK:
            _mark(
                row,
                _S.RUNNING,
                f"taken back while it drained: {instance_type}'s desired count rose to {want}",
                actions,
            )
            have[instance_type] += row.share
            back.append(row)
    if not back:
        return kept, leaving
    ids = {row.id for row in back}
    return kept + back, [row for row in leaving if row.id not in ids]


def _forget_deferred_that_went(actions: list[Action]) -> None:
    """A deferral (rule 5) says nothing of rows a later rule of the same tick ended (the budget
    drain outranks the disruption budget): they leave it, and a deferral left with none goes.
    A tester read "2 serving instance(s) not drained yet ... the rest go later" beside the
    budget's "terminate 2 instance(s)" of the same two, 15 ms apart."""
    ended = {i for a in actions if isinstance(a, Terminate) for i in a.instance_ids}
    if not ended:
        return
    kept: list[Action] = []
    for action in actions:
        if isinstance(action, DrainDeferred) and ended & set(action.instance_ids):
            left = tuple(i for i in action.instance_ids if i not in ended)
            if not left:
                continue
            action = dataclasses.replace(action, instance_ids=left)
        kept.append(action)
    actions[:] = kept


def _fit_budget(
    kept: list[_Row],
    budget_usd_per_hr: float,
    qps_by_type: Mapping[str, float],
    stage_types: Mapping[str, Collection[str]],
    actions: list[Action],
) -> list[_Row]:
    """Rule 6, the drain: the least cost-effective kept rows go until the rest fits; the last
    instance of a stage, or its last serving one, stays when the budget can pay for it
    (:func:`controlplane.policies.drain.guard_drain`, which a budget change's ``budget_drain``
    decision names)."""
    instances = [_drain_instance(row) for row in kept]
    drain = guard_drain(instances, budget_usd_per_hr, qps_by_type, stage_types)
    if not drain.drain:
        return kept
    chosen = {candidate.id for candidate in drain.drain}
    rows = [row for row in kept if row.id in chosen]
    _terminate(
        rows,
        "budget",
        f"the fleet costs {drain.fleet_cost_usd_per_hr:.3f} USD/hr, over the budget of"
        f" {plain(budget_usd_per_hr)} USD/hr: least cost-effective first",
        actions,
    )
    return [row for row in kept if row.id not in chosen]


def _launch_shortfall(
    kept: list[_Row],
    *,
    desired: Mapping[str, int],
    rows: Sequence[_Row],
    prices_usd_per_hr: Mapping[str, float],
    budget_usd_per_hr: float,
    qps_by_type: Mapping[str, float],
    held_types: Collection[str],
    prefix: str,
    first_ordinal: Callable[[], int],
    reserved_usd_per_hr: float = 0.0,
    desired_spot: Mapping[str, int] | None = None,
    spot_prices_usd_per_hr: Mapping[str, float] | None = None,
    ranking: Mapping[str, Sequence[str]] | None = None,
    short_types: Collection[str] = (),
    noticed_spot: Collection[str] = (),
    risen_spot: Collection[str] = (),
    risen_why: str = "",
    given_up: Sequence[_Row] = (),
    spot_on_demand: Collection[str] = (),
) -> list[Action]:
    """Rules 6, 7, 10 and 11: launch what is missing, most cost-effective first, while it fits
    (next to ``reserved_usd_per_hr``: what the app pays for outside its fleet, its profile
    workers); on spot where ``desired_spot`` asks for more spot rows and spot is cheaper now; a
    type the provider is short of (``short_types``, ``held_types``, or on spot ``noticed_spot``)
    stood in for from ``ranking``. ``given_up``: ``requested`` rows of short types, launched
    again only where no stand-in is found (else marked failed). ``spot_on_demand``: types
    launched on demand only (their spot launches ran on demand lately)."""
    actions: list[Action] = []
    have: dict[str, float] = defaultdict(float)
    spot_kept: dict[str, float] = defaultdict(float)
    for row in kept:
        have[row.counted_type] += row.share
        if row.record.market == "spot":
            spot_kept[row.counted_type] += row.share
    spot_wanted = {t: n - spot_kept[t] for t, n in (desired_spot or {}).items()}
    spot_now = {t: p for t, p in (spot_prices_usd_per_hr or {}).items() if t not in spot_on_demand}
    choices = _Ranked(ranking or {}, prices_usd_per_hr, spot_now, qps_by_type)
    waiting: dict[str, list[_Row]] = defaultdict(list)
    for row in given_up:
        waiting[row.record.instance_type].append(row)
    committed = reserved_usd_per_hr + float(sum(row.record.price_usd_per_hr for row in kept))
    wanted: list[tuple[str, float]] = []
    for instance_type in sorted(desired):
        missing = math.ceil(desired[instance_type] - have[instance_type] - _UNIT_SLACK)
        if missing <= 0:
            continue
        if instance_type in held_types and not choices.ranking.get(instance_type):
            continue
        price = prices_usd_per_hr.get(instance_type)
        if price is None or not math.isfinite(price) or price < 0:
            actions.append(
                LaunchSkipped(instance_type, missing, f"no price known for {instance_type}")
            )
            continue
        wanted.extend([(instance_type, price)] * missing)
    wanted.sort(key=lambda item: (-_value_per_usd(item[0], item[1], qps_by_type), item[1], item[0]))
    # Past every request id used: read only when something is launched (a tick that launches
    # nothing does not read the ids of the app's whole history).
    ordinal = first_ordinal() if wanted else 0
    capped: Counter[str] = Counter()
    capped_at: dict[str, tuple[float, str]] = {}
    unavailable = set(short_types) | set(held_types)
    for instance_type, on_demand_price in wanted:
        spot_price = spot_now.get(instance_type)
        on_spot = (
            spot_wanted.get(instance_type, 0) > _UNIT_SLACK
            and spot_price is not None
            and spot_price < on_demand_price
        )
        price = spot_price if on_spot and spot_price is not None else on_demand_price
        room = budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR - committed
        short = instance_type in unavailable
        choice: tuple[str, str, float, str] | None = None
        count = 1
        moving = spot_wanted.get(instance_type, 0) > _UNIT_SLACK and instance_type in risen_spot
        if moving and not short:
            cheaper = _cheaper_choice(
                instance_type, price, choices, unavailable | set(noticed_spot) | set(risen_spot)
            )
            if cheaper is not None and cheaper.count * cheaper.price_usd_per_hr <= room:
                count = cheaper.count
                choice = (
                    cheaper.instance_type,
                    cheaper.market,
                    cheaper.price_usd_per_hr,
                    f"{instance_type}'s spot price rose to {plain(spot_price or price)} USD/hr"
                    f" and took the fleet {risen_why or 'over the budget'}: {cheaper.describe()}"
                    f" serve{'s' if count == 1 else ''} as much for less (the cheapest such"
                    " choice of the plan's ranking)",
                )
        if choice is None and (short or (on_spot and instance_type in noticed_spot)):
            choice = _stand_in(
                instance_type,
                choices,
                on_spot=on_spot,
                short=short,
                unavailable=unavailable,
                noticed_spot=noticed_spot,
                room_usd_per_hr=room,
            )
        if choice is not None:
            other, market, other_price, why = choice
            if waiting[instance_type]:
                _mark(waiting[instance_type].pop(), _S.FAILED, why, actions)
            if on_spot or moving:
                spot_wanted[instance_type] -= 1
            for _ in range(count):
                committed += other_price
                actions.append(
                    Launch(
                        f"{prefix}-{ordinal}",
                        other,
                        other_price,
                        why,
                        market=market,
                        stands_for=instance_type,
                        share=1.0 / count,
                    )
                )
                ordinal += 1
            have[instance_type] += 1
            continue
        if waiting[instance_type]:
            # No stand-in: the waiting launch is tried again (its cost is already the fleet's).
            row = waiting[instance_type].pop()
            committed += row.record.price_usd_per_hr
            actions.append(_launch_again(row))
            have[instance_type] += 1
            continue
        if instance_type in held_types:
            continue
        if price > room:
            capped[instance_type] += 1
            capped_at[instance_type] = (price, "spot" if on_spot else "on-demand")
            continue
        committed += price
        if on_spot or moving:  # a risen type's on-demand launch fills one of its spot share
            spot_wanted[instance_type] -= 1
        actions.append(
            Launch(
                f"{prefix}-{ordinal}",
                instance_type,
                price,
                f"{instance_type}: {have[instance_type]:g} kept, {desired[instance_type]} desired"
                + (" (spot)" if on_spot else "")
                + (_REPLACES_SPOT_SAID if moving and not on_spot else ""),
                market="spot" if on_spot else "on-demand",
                replaces_spot=moving and not on_spot,
            )
        )
        have[instance_type] += 1
        ordinal += 1
    for rows_left in waiting.values():  # not wanted any more: tried again as before
        for row in rows_left:
            committed += row.record.price_usd_per_hr
            actions.append(_launch_again(row))
    if capped:
        actions.append(
            BudgetCapped(dict(sorted(capped.items())), committed, budget_usd_per_hr, capped_at)
        )
    return actions


def _launch_again(row: _Row) -> Launch:
    """A ``requested`` row whose launch failed retryably, or whose answer was lost: launched
    again with the same request id."""
    return Launch(
        row.record.request_id,
        row.record.instance_type,
        row.record.price_usd_per_hr,
        "launch again (the last attempt did not go through)",
        retry=True,
        market=row.record.market,
    )


@dataclass(frozen=True, slots=True)
class _Rise:
    """Rule 10: the spot types whose price rose above what their instances were launched at,
    where the rise took the fleet past the budget less its headroom (else none), and why in
    words (for the decisions)."""

    types: frozenset[str]
    why: str
    fleet_cost_usd_per_hr: float
    budget_usd_per_hr: float = 0.0

    @property
    def over_budget(self) -> bool:
        return self.fleet_cost_usd_per_hr > self.budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR

    @staticmethod
    def of(actions: Sequence[Action], budget_usd_per_hr: float, headroom_share: float) -> _Rise:
        repriced = [a for a in actions if isinstance(a, SpotRepriced)]
        if not repriced or not repriced[0].past_threshold:
            return _Rise(frozenset(), "", 0.0)
        first = repriced[0]
        risen = frozenset(a.instance_type for a in repriced if a.risen)
        return _Rise(risen, first.why(), first.fleet_cost_usd_per_hr, budget_usd_per_hr)


def _move_before_break(
    kept: list[_Row],
    rows: Sequence[_Row],
    rise: _Rise,
    ranked: _Ranked,
    unavailable: Collection[str],
    desired: Mapping[str, int],
    notices: Mapping[str, datetime],
    actions: list[Action],
    blocked: Collection[str] = (),
) -> tuple[list[_Row], list[_Row]]:
    """Rule 10's move while the fleet is still within the budget (past its headroom): the kept
    spot rows of a risen type for which the plan's ranking has a cheaper choice that serves as
    much are *moving*, as many as the budget pays the choice for next to them (and those whose
    replacement is already kept: the type's rows beyond its desired count). A moving row is no
    longer kept (rule 7 launches the choice for it, within the budget, the moving rows' cost
    reserved); it serves on until the type's other rows serve its desired count, then drains
    (rule 9 ends a draining row after ``drain_s``). The kept rows, and the moving ones that are
    paid for until they go."""
    room = rise.budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR - rise.fleet_cost_usd_per_hr
    going: list[_Row] = []
    for instance_type in sorted(rise.types):
        price_now = ranked.spot_now.get(instance_type)
        own = [
            row
            for row in kept
            if row.record.instance_type == instance_type
            and row.record.market == "spot"
            and row.counted_type == instance_type
        ]
        if price_now is None or not own:
            continue
        own_on_demand = instance_type not in blocked
        choice = _cheaper_choice(
            instance_type, price_now, ranked, unavailable, own_on_demand=own_on_demand
        )
        if choice is None:
            continue
        price = choice.count * choice.price_usd_per_hr  # for one of the risen type
        counted = _units(row for row in kept if row.counted_type == instance_type)
        replaced = max(0, math.floor(counted - desired.get(instance_type, 0) + _UNIT_SLACK))
        more = min(len(own) - replaced, int(max(0.0, room) // price)) if price > 0 else 0
        room -= more * price
        take = min(len(own), replaced + more)
        if take == 0:
            continue
        # The oldest first (the first to have risen above their launch price), by id among equals.
        chosen = sorted(own, key=lambda r: (r.record.created_at, r.id))[:take]
        _drain_replaced(
            chosen,
            rows,
            instance_type,
            {row.id for row in chosen},
            desired,
            notices,
            math.inf,
            f"moved off {instance_type}'s risen spot price"
            f" ({plain(price_now)} USD/hr, the fleet {rise.why}): {choice.describe()} serve"
            " in its place; no new queries",
            actions,
        )
        going += chosen
    gone = {row.id for row in going}
    return [row for row in kept if row.id not in gone], going


@dataclass(slots=True)
class _Return:
    """What rule 10's move back to spot reads: the desired fleet and its spot share, the types
    whose fall has held (``fallen``) and those risen now, the prices (on demand, spot now), Q_t,
    the stages' types, the notices, the room left in the budget at the prices now (what the
    live fleet, draining rows included, leaves) and how many serving rows the disruption budget
    lets go now; the rows an earlier tick's move back took as returning (``returning``) and those
    a rise launched on demand in place of spot ones of their type (``replacements``)."""

    desired: Mapping[str, int]
    desired_spot: Mapping[str, int]
    fallen: frozenset[str]
    risen: frozenset[str]
    prices_usd_per_hr: Mapping[str, float]
    spot_now: Mapping[str, float]
    qps_by_type: Mapping[str, float]
    stages: Mapping[str, Collection[str]]
    notices: Mapping[str, datetime]
    room_usd_per_hr: float
    returning: frozenset[str]
    replacements: frozenset[str]
    allowed: int
    # The stand-ins' return: the types the provider is short of now (capacity, a refused
    # launch), and those whose launches failed for want of capacity within the back-off.
    blocked: frozenset[str] = frozenset()
    failing: frozenset[str] = frozenset()


def _serving_units(
    rows: Sequence[_Row],
    instance_type: str,
    leaving: Collection[str],
    notices: Mapping[str, datetime],
) -> float:
    """How much of ``instance_type`` (in units of one: a stand-in by its share) the running rows
    other than ``leaving`` (row ids) serve, those under an interruption notice left out, and
    profile workers (rule 8: they run next to the fleet and serve no query)."""
    return _units(
        row
        for row in rows
        if row.state is _S.RUNNING
        and not _profiling(row)
        and row.counted_type == instance_type
        and row.id not in leaving
        and (row.provider_id or "") not in notices
    )


def _drain_replaced(
    to_drain: Sequence[_Row],
    rows: Sequence[_Row],
    instance_type: str,
    leaving: Collection[str],
    desired: Mapping[str, int],
    notices: Mapping[str, datetime],
    allowed: float,
    reason: str,
    actions: list[Action],
) -> int:
    """Rule 10's moves: drain the running rows of ``to_drain`` (with ``reason``) once the type's
    other rows, those ``leaving`` (row ids) left out, serve its desired count
    (:func:`_serving_units`), at most ``allowed`` of them (the disruption budget's); how many
    drained. Until then they serve on."""
    serving = _serving_units(rows, instance_type, leaving, notices)
    if serving < desired.get(instance_type, 0) - _UNIT_SLACK:
        return 0
    drained = 0
    for row in to_drain:
        if row.state is _S.RUNNING and drained < allowed:
            drained += 1
            _mark(row, _S.DRAINING, reason, actions)
    return drained


def _move_back_to_spot(
    kept: list[_Row], rows: Sequence[_Row], ctx: _Return, actions: list[Action]
) -> tuple[list[_Row], list[_Row], int]:
    """Rule 10's move back to spot (docs/spot.md): a type's on-demand rows (its own, not
    stand-ins) return to spot while the plan wants more of its instances on spot than are kept
    on spot, once its spot price has held at or below its on-demand price less the margin
    (``ctx.fallen``). Make before break, as many as the budget pays the spot one for next to
    them and the disruption budget allows: a *returning* row is no longer kept (rule 7 launches
    its spot replacement, the returning rows' cost reserved), serves on until the type's other
    rows serve its desired count, then drains (within the disruption budget; rule 9 ends it).
    Where the budget has no room for one next to them: break then make, one row of the app at
    a time, the row terminated before its spot replacement is launched, only while nothing else
    of the move is under way, the fleet is within the budget, and its stage keeps another
    serving row of at least its capacity (the reconciler has no measure of the load, so the rest
    must carry at least what leaves). Rows past the type's count beside a full spot share are
    taken only where they are the move's own: those an earlier tick took as returning
    (``ctx.returning``: they drain once the type's other rows serve its count) and a rise's
    on-demand replacements beside spot rows of their type older than them (``ctx.replacements``:
    they serve on, not counted, and drain so only once the fall has held; where the price fell
    back below the rise's threshold before the hold, the rise's move completes instead,
    :func:`_complete_the_rise`); any other (a plan cut) is left to the scale-down. The kept rows,
    the returning ones (paid for until they go), and how many serving rows it took out of
    service (drained, or ended before their replacement): disruptions the scale-down after it
    counts against the same budget."""
    room = ctx.room_usd_per_hr + _BUDGET_SLACK_USD_PER_HR
    allowed = ctx.allowed
    disrupted = 0
    going: list[_Row] = []
    broken = False
    for instance_type in sorted(ctx.desired_spot):
        want_spot = ctx.desired_spot[instance_type]
        if want_spot <= 0 or instance_type in ctx.risen:
            continue
        own = [
            row
            for row in kept
            if row.record.instance_type == instance_type
            and row.counted_type == instance_type
            and row.record.market != "spot"
            and row.share >= 1.0 - _UNIT_SLACK
        ]
        # Only launched rows move: a request whose launch failed is launched again (rule 7),
        # never taken as returning (it would be neither launched again nor ended).
        own_on_demand = sorted(
            (row for row in own if row.launched), key=lambda r: (r.record.created_at, r.id)
        )
        # The plan's on-demand base of the type stays on demand: only the rows past it move
        # (a spot share filled by an on-demand stand-in leaves the base where it is).
        base = max(0, ctx.desired.get(instance_type, 0) - want_spot)
        surplus = min(len(own_on_demand), len(own) - base)
        if surplus <= 0:
            continue
        of_type = [row for row in kept if row.counted_type == instance_type]
        spot_units = _units(row for row in of_type if row.record.market == "spot")
        if spot_units <= 0 and instance_type not in ctx.fallen:
            continue
        # The rows whose spot replacement is kept already (the type's rows past its count): only
        # those an earlier move back took as returning, and once the fall has held those a rise
        # launched on demand in place of spot ones. Any other row past the count (a plan cut)
        # is the scale-down's (rule 5). A rise's replacement is past the count only beside the
        # spot rows it was launched in place of (older than it): beside spot rows launched after
        # it (a move back once the fall held, a relaunch), its rise is over and it is one of the
        # type's count.
        own_spot_born = sorted(
            row.record.created_at
            for row in of_type
            if row.record.market == "spot" and row.record.instance_type == instance_type
        )
        rise_made = [
            row
            for row in own_on_demand
            if row.id in ctx.replacements
            and row.id not in ctx.returning
            and own_spot_born
            and own_spot_born[0] < row.record.created_at
        ]
        replaced_spot = sum(
            1 for born in own_spot_born if rise_made and born < rise_made[-1].record.created_at
        )
        rise_ids = {row.id for row in rise_made} if instance_type in ctx.fallen else set()
        known = [row for row in own_on_demand if row.id in ctx.returning or row.id in rise_ids]
        replaced = 0
        over = 0
        if spot_units > 0 and spot_units <= want_spot + _UNIT_SLACK:
            over = max(
                0, math.floor(_units(of_type) - ctx.desired.get(instance_type, 0) + _UNIT_SLACK)
            )
            replaced = min(surplus, len(known), over)
        if instance_type not in ctx.fallen and over > replaced and rise_made:
            # A rise's move whose price fell back before the fall has held: it completes (the
            # spot rows its replacements stand for go once those serve); the replacements go
            # back to spot only through the hold.
            kept, leaving, drained = _complete_the_rise(
                kept,
                rows,
                instance_type,
                min(len(rise_made), replaced_spot, over - replaced),
                allowed,
                ctx,
                actions,
            )
            going += leaving
            allowed -= drained
            disrupted += drained
        known_ids = {row.id for row in known[:replaced]}
        own_on_demand = known[:replaced] + [r for r in own_on_demand if r.id not in known_ids]
        spot = ctx.spot_now.get(instance_type)
        on_demand = ctx.prices_usd_per_hr.get(instance_type)
        more = 0
        how = "make_before_break"
        if (
            instance_type in ctx.fallen
            and spot is not None
            and on_demand is not None
            and 0 <= spot < on_demand
        ):
            open_slots = math.floor(want_spot - spot_units + _UNIT_SLACK)
            candidates = min(surplus - replaced, open_slots)
            if candidates > 0 and allowed > 0:
                by_room = int(max(0.0, room) // spot) if spot > 0 else candidates
                more = min(candidates, by_room, allowed)
                if more > 0:
                    room -= more * spot
                    allowed -= more
                elif (
                    not broken
                    and not going
                    and replaced == 0
                    and room >= 0
                    and not any(r.state is not _S.RUNNING for r in of_type)
                    and _stage_carries(own_on_demand[0], kept, ctx)
                ):
                    more, how, broken = 1, "break_then_make", True
                    allowed -= 1
        if replaced + more == 0:
            continue
        fell = (
            f"{instance_type}'s spot price fell to {plain(spot or 0.0)} USD/hr, below its"
            f" on-demand price of {plain(on_demand or 0.0)} USD/hr, and stayed down: the plan"
            " buys it on spot;"
        )
        if how == "break_then_make":
            row = own_on_demand[0]
            why = (
                f"{fell} the budget has no room for a spot one next to it, so it goes first and"
                " its spot replacement is launched in its place (its stage keeps another serving"
                " instance of at least its capacity)"
            )
            actions.append(
                SpotReturned(instance_type, 1, spot or 0.0, on_demand or 0.0, how, why, (row.id,))
            )
            _terminate([row], "spot_return", why, actions)
            kept = [r for r in kept if r.id != row.id]
            disrupted += 1
            continue
        chosen = own_on_demand[: replaced + more]
        if more:
            actions.append(
                SpotReturned(
                    instance_type,
                    more,
                    spot or 0.0,
                    on_demand or 0.0,
                    how,
                    f"{fell} {more} on demand move back, each spot one launched next to the one"
                    " it replaces within the budget, which drains once it serves",
                    tuple(row.id for row in chosen[replaced:]),
                )
            )
        drained = _drain_replaced(
            chosen[:replaced],  # the newly returning ones wait for their replacement
            rows,
            instance_type,
            {row.id for row in chosen},
            ctx.desired,
            ctx.notices,
            allowed,
            f"{SPOT_RETURN_DRAIN} back to {instance_type} on spot at"
            f" {plain(spot or 0.0)} USD/hr (on demand {plain(on_demand or 0.0)} USD/hr):"
            " its spot replacement serves; no new queries",
            actions,
        )
        allowed -= drained
        disrupted += drained
        going += chosen
    # What is left of the budget's room and of the disruption budget, for the stand-ins' return.
    ctx.room_usd_per_hr = room - _BUDGET_SLACK_USD_PER_HR
    ctx.allowed = allowed
    gone = {row.id for row in going}
    return [row for row in kept if row.id not in gone], going, disrupted


def _launch_order(row: _Row) -> tuple[datetime, int, str, str]:
    """The order rows were launched in: by creation, then by the number of the request id
    (``<prefix>-<n>``: the launches of one tick share a creation time, and "-10" sorts before
    "-9" as text)."""
    number = re.search(r"-(\d+)$", row.record.request_id)
    return (
        row.record.created_at,
        int(number.group(1)) if number else -1,
        row.record.request_id,
        row.id,
    )


def _stand_in_groups(rows: Iterable[_Row]) -> list[list[_Row]]:
    """The stand-ins of one type grouped as the instances of it they stand in for: one of at
    least its capacity alone, k smaller ones (each 1/k) together, oldest first; only rows of
    one share make a group (k of 1/k: what is left of a set never makes one with another k's).
    A group short of one whole (one of its k gone) is left out: it returns as nothing."""
    by_share: dict[float, list[_Row]] = defaultdict(list)
    for row in rows:
        by_share[round(row.share, 6)].append(row)
    groups: list[list[_Row]] = []
    for share in sorted(by_share):
        group: list[_Row] = []
        units = 0.0
        for row in sorted(by_share[share], key=_launch_order):
            group.append(row)
            units += row.share
            if units >= 1.0 - _UNIT_SLACK:
                groups.append(group)
                group, units = [], 0.0
    return sorted(groups, key=lambda g: _launch_order(g[0]))


def _return_stand_ins(
    kept: list[_Row], rows: Sequence[_Row], ctx: _Return, actions: list[Action]
) -> tuple[list[_Row], list[_Row], int]:
    """Rule 10's move back for the stand-ins of another type (rule 11's, or a rise's cheaper
    choices): once the fall of a type the plan buys on spot has held (``ctx.fallen``, less the
    types whose launches failed for want of capacity within the back-off, ``ctx.failing``), a
    stand-in (k smaller ones for one: together) goes back to the type on spot, made before the
    break only: where the budget pays the spot one next to it (``ctx.room_usd_per_hr``, what the
    move back of the type's own rows left), the disruption budget lets it go, the type's other
    rows leave none past its count (a surplus is the scale-down's), and its on-demand rows fill
    the plan's on-demand base without it (so the launch in its slot is on spot). Such a stand-in
    is *returning*: no longer kept (rule 7 launches the type on spot in its slot, its cost
    reserved), it serves on until the type's other rows serve its desired count, then drains
    (within the disruption budget; rule 9 ends it, cause ``spot_return``). Where the budget has
    no room it stays: a gap is worse than its price. A stand-in an earlier tick took as
    returning (``ctx.returning``) stays out of the kept fleet only beside its replacement (the
    type's rows past its count) and while the provider is not short of the type
    (``ctx.blocked``): a replacement that could not be launched leaves it serving, counted. The
    kept rows, the returning ones (paid for until they go), and how many serving rows it took
    out of service (the disruptions the scale-down after it counts against the same budget)."""
    room = ctx.room_usd_per_hr + _BUDGET_SLACK_USD_PER_HR
    allowed = ctx.allowed
    disrupted = 0
    going: list[_Row] = []
    for instance_type in sorted(ctx.desired_spot):
        want_spot = ctx.desired_spot[instance_type]
        if want_spot <= 0 or instance_type in ctx.risen or instance_type in ctx.blocked:
            continue
        want = ctx.desired.get(instance_type, 0)
        of_type = [row for row in kept if row.counted_type == instance_type]
        groups = _stand_in_groups(
            row for row in of_type if row.record.instance_type != instance_type
        )
        if not groups:
            continue
        over = _units(of_type) - want
        # Those an earlier tick took as returning whose replacement is kept: past the count.
        returning: list[list[_Row]] = []
        for group in groups:
            if all(row.id in ctx.returning for row in group) and over >= 1.0 - _UNIT_SLACK:
                returning.append(group)
                over -= _units(group)
        spot = ctx.spot_now.get(instance_type)
        on_demand = ctx.prices_usd_per_hr.get(instance_type)
        new: list[list[_Row]] = []
        if (
            instance_type in ctx.fallen
            and instance_type not in ctx.failing
            and over <= _UNIT_SLACK
            and spot is not None
            and on_demand is not None
            and 0 <= spot < on_demand
        ):
            base = max(0, want - want_spot)
            returning_ids = {row.id for group in returning for row in group}
            on_demand_units = _units(
                row
                for row in of_type
                if row.record.market != "spot" and row.id not in returning_ids
            )
            for group in groups:
                if any(row.id in returning_ids for row in group):
                    continue  # (one taken as returning whose replacement went starts again)
                if any(row.state is not _S.RUNNING for row in group):
                    continue
                leaves = _units(row for row in group if row.record.market != "spot")
                if on_demand_units - leaves < base - _UNIT_SLACK:
                    continue  # its slot is the plan's on-demand base: the launch would be too
                if spot > room or allowed < len(group):
                    break
                room -= spot
                allowed -= len(group)
                on_demand_units -= leaves
                new.append(group)
        fell = (
            f"{instance_type}'s spot price fell to {plain(spot or 0.0)} USD/hr, below its"
            f" on-demand price of {plain(on_demand or 0.0)} USD/hr, and stayed down: the plan"
            " buys it on spot;"
        )
        for group in new:
            names = ", ".join(
                f"{n} {t}"
                for t, n in sorted(Counter(r.record.instance_type for r in group).items())
            )
            actions.append(
                SpotReturned(
                    instance_type,
                    1,
                    spot or 0.0,
                    on_demand or 0.0,
                    "make_before_break",
                    f"{fell} {names} standing in for one go back to it, the spot one launched"
                    " in their place within the budget; they drain once it serves",
                    tuple(row.id for row in group),
                    stand_in=True,
                )
            )
        for group in returning:
            ids = {row.id for row in group}
            serving = _serving_units(rows, instance_type, ids, ctx.notices)
            live = [row for row in group if row.state is _S.RUNNING]
            # Read before the drain marks: a row marked draining below still drains (rule 9
            # ends it after drain_s), it is not one that serves nothing yet.
            rest = [row for row in group if row.state is not _S.RUNNING]
            if serving < want - _UNIT_SLACK or allowed < len(live):
                continue  # serves on until its replacement does (or the budget lets it go)
            allowed -= len(live)
            disrupted += len(live)
            for row in live:
                _mark(
                    row,
                    _S.DRAINING,
                    f"{SPOT_RETURN_DRAIN} standing in for {instance_type}, back on spot at"
                    f" {plain(spot or 0.0)} USD/hr (on demand {plain(on_demand or 0.0)} USD/hr):"
                    " its replacement serves; no new queries",
                    actions,
                )
            if rest:
                _terminate(rest, "spot_return", "standing in: its replacement serves", actions)
        going += [row for group in (*returning, *new) for row in group]
    ctx.room_usd_per_hr = room - _BUDGET_SLACK_USD_PER_HR
    ctx.allowed = allowed
    gone = {row.id for row in going}
    return [row for row in kept if row.id not in gone], going, disrupted


def _complete_the_rise(
    kept: list[_Row],
    rows: Sequence[_Row],
    instance_type: str,
    count: int,
    allowed: int,
    ctx: _Return,
    actions: list[Action],
) -> tuple[list[_Row], list[_Row], int]:
    """Rule 10: a rise launched on-demand replacements for ``instance_type``'s spot rows, and its
    price fell back below the rise's threshold before they took over: the rise's move completes
    as it would have (:func:`_move_before_break`): the ``count`` oldest kept spot rows of the type
    are no longer kept, serve on until the type's other rows serve its desired count, then drain
    (within the disruption budget, ``allowed``). The kept rows, the leaving ones, and how many
    serving rows drained."""
    own_spot = sorted(
        (
            row
            for row in kept
            if row.record.instance_type == instance_type
            and row.counted_type == instance_type
            and row.record.market == "spot"
        ),
        key=lambda r: (r.record.created_at, r.id),
    )
    chosen = own_spot[:count]
    drained = _drain_replaced(
        chosen,
        rows,
        instance_type,
        {row.id for row in chosen},
        ctx.desired,
        ctx.notices,
        allowed,
        f"moved off {instance_type}'s risen spot price: the on-demand instances launched"
        " for it serve in its place; back to spot only once its fall has held for the"
        " hold; no new queries",
        actions,
    )
    gone = {row.id for row in chosen}
    return [row for row in kept if row.id not in gone], chosen, drained


def _stage_carries(leaving: _Row, kept: Sequence[_Row], ctx: _Return) -> bool:
    """Whether ``leaving``'s stage keeps another serving row (running, under no notice) of at
    least its capacity (Q_t; unknown: only its own type counts), so that the stage still serves
    while its replacement boots."""
    instance_type = leaving.record.instance_type
    groups = [set(types) for types in ctx.stages.values() if instance_type in types]
    need = ctx.qps_by_type.get(instance_type)
    for row in kept:
        if (
            row.id == leaving.id
            or row.state is not _S.RUNNING
            or (row.provider_id or "") in ctx.notices
        ):
            continue
        if groups and not any(
            row.counted_type in g or row.record.instance_type in g for g in groups
        ):
            continue
        other = row.record.instance_type
        serves = ctx.qps_by_type.get(other)
        if other == instance_type or (need is not None and serves is not None and serves >= need):
            return True
    return False


def _shed_leaving(
    kept: Sequence[_Row], leaving: Sequence[_Row], budget_usd_per_hr: float, actions: list[Action]
) -> list[_Row]:
    """The hard cap at the prices now: when the fleet and the rows leaving it (rule 9: draining,
    or serving until their replacement does) cost more than ``budget_usd_per_hr`` (a spot price
    rose), the leaving rows go first (the draining ones, then the dearest) until the rest fits.
    The leaving rows that stay."""
    cost = float(sum(row.record.price_usd_per_hr for row in (*kept, *leaving)))
    total = cost
    going: list[_Row] = []
    for row in sorted(
        leaving,
        key=lambda r: (r.state is not _S.DRAINING, -r.record.price_usd_per_hr, r.id),
    ):
        if cost <= budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR:
            break
        going.append(row)
        cost -= row.record.price_usd_per_hr
    if going:
        _terminate(
            going,
            "budget",
            f"the fleet and the instances leaving it cost {total:.3f} USD/hr at the prices now,"
            f" over the budget of {plain(budget_usd_per_hr)} USD/hr: the leaving ones go first",
            actions,
        )
    gone = {row.id for row in going}
    return [row for row in leaving if row.id not in gone]


@dataclass(frozen=True, slots=True)
class _Ranked:
    """Rules 10 and 11's view of the plan's ranking (type -> the types that may stand in for it,
    preferred first) with the prices (on demand, spot now) and Q_t."""

    ranking: Mapping[str, Sequence[str]]
    prices_usd_per_hr: Mapping[str, float]
    spot_now: Mapping[str, float]
    qps_by_type: Mapping[str, float]

    def alternatives(
        self, instance_type: str, unavailable: Collection[str]
    ) -> Iterator[tuple[str, float, float | None]]:
        """The types of ``instance_type``'s ranking, in its order, that serve at least as much
        (Q_t; unknown: any), are not ``unavailable`` and have an on-demand price: (type, its
        on-demand price, its spot price now or None)."""
        need = self.qps_by_type.get(instance_type)
        for other in self.ranking.get(instance_type, ()):
            if other == instance_type or other in unavailable:
                continue
            serves = self.qps_by_type.get(other)
            if need is not None and serves is not None and serves < need:
                continue
            on_demand = self.prices_usd_per_hr.get(other)
            if on_demand is None or not math.isfinite(on_demand):
                continue
            yield other, on_demand, self.spot_now.get(other)

    def sized(
        self, instance_type: str, unavailable: Collection[str]
    ) -> Iterator[tuple[str, float, float | None, int]]:
        """The types of ``instance_type``'s ranking, in its order, that are not ``unavailable``
        and have an on-demand price, with how many of each serve as much as one of it: 1 where
        it serves at least as much (or Q_t is not known for both), else ceil(Q_A / Q_B). (type,
        its on-demand price, its spot price now or None, that count)."""
        need = self.qps_by_type.get(instance_type)
        for other in self.ranking.get(instance_type, ()):
            if other == instance_type or other in unavailable:
                continue
            on_demand = self.prices_usd_per_hr.get(other)
            if on_demand is None or not math.isfinite(on_demand):
                continue
            serves = self.qps_by_type.get(other)
            count = 1
            if need is not None and serves is not None and serves < need:
                if serves <= 0:
                    continue
                count = math.ceil(need / serves - _UNIT_SLACK)
            yield other, on_demand, self.spot_now.get(other), count


def _units(rows: Iterable[_Row]) -> float:
    """How many instances of the type they are counted as ``rows`` are (sized stand-ins count
    as their share)."""
    return float(sum(row.share for row in rows))


# A market in words ("on on demand" was what the move's decisions said).
_ON_MARKET = {"spot": "on spot", "on-demand": "on demand"}


def _capped_words(instance_type: str, count: int, each: tuple[float, str] | None) -> str:
    """A budget cap's launches in words, with what one costs where known: "1 x emu.cpu.large
    (on demand at 0.1 USD/hr)". Without the price, a fleet at 0.21 of a budget of 0.3 read as
    having room for the type's spot price (0.03), while the launch capped was on demand."""
    if each is None:
        return f"{count} x {instance_type}"
    price, market = each
    several = " each" if count > 1 else ""
    return (
        f"{count} x {instance_type} ({_ON_MARKET.get(market, market)} at"
        f" {plain(price)} USD/hr{several})"
    )


@dataclass(frozen=True, slots=True)
class _Choice:
    """Rule 10's move for one instance of a risen type: ``count`` instances of
    ``instance_type`` on ``market`` at ``price_usd_per_hr`` each."""

    instance_type: str
    market: str
    price_usd_per_hr: float
    count: int = 1

    def describe(self) -> str:
        each = " each" if self.count > 1 else ""
        return (
            f"{self.count} x {self.instance_type} {_ON_MARKET.get(self.market, self.market)} at"
            f" {plain(self.price_usd_per_hr)} USD/hr{each}"
        )


def _cheaper_choice(
    instance_type: str,
    price_now_usd_per_hr: float,
    ranked: _Ranked,
    unavailable: Collection[str],
    *,
    own_on_demand: bool = False,
) -> _Choice | None:
    """Rule 10's move: the cheapest way to serve as much as one ``instance_type`` for less than
    ``price_now_usd_per_hr``, among the types of its ranking that are not ``unavailable`` (short,
    under notice, risen itself): one of a type that serves at least as much, or k of a type
    that serves less where k of it serve as much (Q_t known for both), each on spot (below its
    on-demand price) or on demand; with ``own_on_demand`` (the provider is not short of it),
    also ``instance_type`` itself on demand (it serves exactly as much: a spot price risen past
    the type's own on-demand price is no reason to pay it). The cheapest in all (fewer
    instances, then the ranking's order, the type itself last, among equals); None when none
    costs less."""
    found = []
    own = ranked.prices_usd_per_hr.get(instance_type)
    if own_on_demand and own is not None and math.isfinite(own) and own >= 0:
        last = len(ranked.ranking.get(instance_type, ())) + 1
        found.append((own, 1, last, 1, _Choice(instance_type, "on-demand", own)))
    for rank, (other, on_demand, spot, count) in enumerate(
        ranked.sized(instance_type, unavailable)
    ):
        if spot is not None and spot < on_demand:
            found.append((count * spot, count, rank, 0, _Choice(other, "spot", spot, count)))
        found.append(
            (count * on_demand, count, rank, 1, _Choice(other, "on-demand", on_demand, count))
        )
    found = [f for f in found if f[0] < price_now_usd_per_hr - _BUDGET_SLACK_USD_PER_HR]
    if not found:
        return None
    return min(found, key=lambda f: f[:4])[4]


def _move_off_risen(
    kept: list[_Row],
    rise: _Rise,
    ranked: _Ranked,
    unavailable: Collection[str],
    actions: list[Action],
    blocked: Collection[str] = (),
) -> list[_Row]:
    """Rule 10's move: a spot price rise took the fleet past the budget less its headroom. The
    kept spot rows of a risen type for which the plan's ranking has a type that serves as much
    for less (on spot or on demand) go (cause ``spot_price``), before anything is launched; rule
    7 then launches that type for them in the same tick, within the budget. The others are left
    to the budget guard."""
    risen = rise.types
    going: dict[str, list[_Row]] = defaultdict(list)
    moves: dict[str, _Choice] = {}
    for row in kept:
        instance_type = row.record.instance_type
        if (
            row.record.market != "spot"
            or instance_type not in risen
            or row.counted_type != instance_type
        ):
            continue
        price_now = ranked.spot_now.get(instance_type)
        if price_now is None:
            continue
        if instance_type not in moves:
            cheaper = _cheaper_choice(
                instance_type,
                price_now,
                ranked,
                unavailable,
                own_on_demand=instance_type not in blocked,
            )
            if cheaper is None:
                continue
            moves[instance_type] = cheaper
        going[instance_type].append(row)
    for instance_type, rows in sorted(going.items()):
        move = moves[instance_type]
        _terminate(
            rows,
            "spot_price",
            f"{instance_type}'s spot price rose to"
            f" {plain(ranked.spot_now[instance_type])} USD/hr: the"
            f" fleet costs {rise.fleet_cost_usd_per_hr:.3f} USD/hr at the prices now, {rise.why};"
            f" {move.describe()} for each serve{'s' if move.count == 1 else ''} as much for less"
            " and replace them within the budget",
            actions,
        )
    gone = {row.id for rows in going.values() for row in rows}
    return [row for row in kept if row.id not in gone]


def _stand_in(
    instance_type: str,
    ranked: _Ranked,
    *,
    on_spot: bool,
    short: bool,
    unavailable: Collection[str],
    noticed_spot: Collection[str],
    room_usd_per_hr: float,
) -> tuple[str, str, float, str] | None:
    """Rule 11: what launches for one instance of ``instance_type`` that the provider is short
    of (``short``: it refused it or has no capacity; else only its spot is under notice): the
    first type of the ranking that serves at least as much (Q_t; unknown: any), is not short
    itself and fits ``room_usd_per_hr``, on spot where ``on_spot`` and its spot is cheaper and
    under no notice, else on demand; failing that, where only spot is short, ``instance_type``
    on demand. (type, market, price, why), or None."""
    why_short = (
        f"the provider is short of {instance_type}"
        if short
        else f"{instance_type}'s spot instances are under an interruption notice"
    )
    for other, on_demand, spot in ranked.alternatives(instance_type, unavailable):
        options = []
        if on_spot and spot is not None and spot < on_demand and other not in noticed_spot:
            options.append(("spot", spot))
        options.append(("on-demand", on_demand))
        for market, price in options:
            if price <= room_usd_per_hr:
                return (
                    other,
                    market,
                    price,
                    f"{why_short}: {other} ({market}, {plain(price)} USD/hr) stands in for it, the"
                    f" next type of the plan's ranking that serves as much within the budget",
                )
    own = ranked.prices_usd_per_hr.get(instance_type)
    if not short and own is not None and own <= room_usd_per_hr:
        return (
            instance_type,
            "on-demand",
            own,
            f"{why_short} and no type of the plan's ranking stands in within the budget:"
            f" {instance_type} on demand ({plain(own)} USD/hr)",
        )
    return None


# --- what the reconciler is told ---------------------------------------------------------------


DesiredFleet = Callable[[AppRecord], Mapping[str, int]]


def applied_plan_fleet(store: Store) -> DesiredFleet:
    """The default desired fleet: the app's applied plan's (empty without one). The tuner's
    decisions replace it (a callable of the same shape) when the tuner runs live."""

    def desired(app: AppRecord) -> Mapping[str, int]:
        plan = store.get_applied_plan(app.name)
        return {} if plan is None else plan.plan.fleet

    return desired


def applied_plan_spot(store: Store) -> DesiredFleet:
    """How many of each type's desired instances are spot: the applied plan's ``spot_fleet``,
    summed over its stages (empty without a plan, or for a plan all on demand)."""

    def desired(app: AppRecord) -> Mapping[str, int]:
        plan = store.get_applied_plan(app.name)
        counts: Counter[str] = Counter()
        for stage in [] if plan is None else plan.plan.stages:
            counts.update(stage.spot_fleet)
        return dict(counts)

    return desired


@dataclass(frozen=True, slots=True)
class AppPricing:
    """What the reconciler needs to know of an app's instance types: their prices, and Q_t, the
    queries per second one instance of each serves (empty: the budget guard ranks by price)."""

    prices_usd_per_hr: Mapping[str, float]
    qps_by_type: Mapping[str, float] = field(default_factory=dict)
    # The spot prices now, of the types bought on spot (rule 10; empty: none).
    spot_prices_usd_per_hr: Mapping[str, float] = field(default_factory=dict)


PricingFn = Callable[[AppRecord], AppPricing]
# None when the provisioner can launch the type; else why not (one line): the plans' use case's.
LaunchableFn = LaunchRefusalFn


def catalog_pricing(catalog: Catalog) -> PricingFn:
    """Prices from ``catalog`` for every app, no Q_t (the service passes the app's resolved
    spec instead, see :mod:`controlplane.service.build`)."""
    prices = MappingProxyType({t.name: t.price_usd_per_hr for t in catalog.values()})
    spot = MappingProxyType(
        {
            t.name: t.spot_price_usd_per_hr
            for t in catalog.values()
            if t.spot_price_usd_per_hr is not None
        }
    )

    def pricing(_app: AppRecord) -> AppPricing:
        return AppPricing(prices, spot_prices_usd_per_hr=spot)

    return pricing


def _any_type(_instance_type: str) -> str | None:
    return None


ArtifactsFn = Callable[[AppRecord], Sequence[ArtifactRef]]
"""An app -> the registered models its workers load (empty: the provisioner's default models);
raises ``EstimatorError`` or ``ControlPlaneError`` when the app's spec does not resolve."""


def _no_artifacts(_app: AppRecord) -> Sequence[ArtifactRef]:
    return ()


_DEFAULT_DISRUPTION = DisruptionBudget()


def disruption_budget(settings: Settings) -> DisruptionBudget:
    """The disruption budget the settings give (``disruption_max_instances``,
    ``disruption_max_share``, ``disruption_window_s``)."""
    return DisruptionBudget(
        max_instances=settings.disruption_max_instances,
        max_share=settings.disruption_max_share,
        window_s=settings.disruption_window_s,
    )


def _stage_types(store: Store, app: AppRecord) -> dict[str, list[str]]:
    """The applied plan's stages (name -> the types that serve it); empty without one, or when
    the plan does not read (then no stage is guarded).

    A stage is served by the types the plan places on it; for an app INFaaS's autoscaler scales
    (``scaling: infaas``), by every type the plan places: that policy drains a variant (the
    dearer type first) once the other instances carry each of its models (every worker loads
    the whole family, and the serving loop serves a stage left without its planned types on all
    of them), so the guard keeps the app's last serving instance, not each stage's type, as the
    policy does. Guarded by stage, its drain of a stage's only type was deferred for good."""
    plan = store.get_applied_plan(app.name)
    if plan is None:
        return {}
    try:
        stages = plan.plan.stages
    except EstimatorError as error:
        logger.warning("reconcile %s: the applied plan's stages do not read: %s", app.name, error)
        return {}
    planned = {stage.name: dict(stage.fleet) for stage in stages}
    if scales_with_infaas(app):
        pooled = pooled_stages(planned)
        return {name: sorted(t for t, n in f.items() if n > 0) for name, f in pooled.items()}
    return {name: [t for t, n in fleet.items() if n > 0] for name, fleet in planned.items()}


# --- the reconciler ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AppReport:
    """What one app's tick decided (``actions``) and what went wrong carrying it out."""

    app: str
    actions: tuple[Action, ...]
    errors: tuple[str, ...] = ()

    def count(self, kind: type[Any]) -> int:
        return sum(1 for action in self.actions if isinstance(action, kind))


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """One :meth:`Reconciler.run_once`: per app, and what was found outside every app."""

    at: datetime
    apps: Mapping[str, AppReport]
    unknown_app: tuple[str, ...] = ()  # managed instances whose app tag names no app: terminated
    unmanaged: tuple[str, ...] = ()  # listed without the managed tag: reported, left alone
    errors: tuple[str, ...] = ()


class Reconciler:
    """The loop's acting half (see the module docstring): :meth:`run_once` is the scheduler's
    ``reconcile`` job.

    ``desired_fleet`` is the hook where the tuner plugs in (default: the applied plan's fleet);
    ``pricing`` gives each app's prices and Q_t; ``launchable`` says which types the provisioner
    can launch (a plan that names any other is not launched, with one decision saying so);
    ``artifacts`` the registered models an app's workers load (its resolved spec's);
    ``probe`` checks that the worker of an instance the provider calls running answers (None:
    the provider's ``running`` is taken as healthy); ``liveness`` finds the running workers
    that stopped answering, which are replaced (rule 3; None: never probed); ``disruption`` is
    the disruption budget of rule 5 (``None``: voluntary drains are not rate-limited);
    ``profile_run_timeout_s`` is rule 8's; ``spot_headroom_share`` and ``spot_return_hold_s``
    (how long a fall must hold before on-demand rows move back to spot) rule 10's.
    :attr:`before_budget_drain`, when set, runs with the app's name before a drain to the
    budget is carried out (the gear switcher's ``budget_changed``: a cascade moves to a faster
    gear before its fleet shrinks, whichever process took the budget change).
    """

    def __init__(
        self,
        store: Store,
        provisioner: Provisioner,
        clock: Clock,
        pricing: PricingFn,
        *,
        desired_fleet: DesiredFleet | None = None,
        launchable: LaunchableFn = _any_type,
        artifacts: ArtifactsFn = _no_artifacts,
        probe: Callable[[ProvisionedInstance], bool] | None = None,
        liveness: Liveness | None = None,
        straggler_timeout_s: float = DEFAULT_STRAGGLER_TIMEOUT_S,
        missing_grace_s: float = DEFAULT_MISSING_GRACE_S,
        launch_backoff_s: float = DEFAULT_LAUNCH_BACKOFF_S,
        disruption: DisruptionBudget | None = _DEFAULT_DISRUPTION,
        profile_run_timeout_s: float = DEFAULT_PROFILE_RUN_TIMEOUT_S,
        interruption_drain_s: float = DEFAULT_INTERRUPTION_DRAIN_S,
        interruption_margin_s: float = DEFAULT_INTERRUPTION_MARGIN_S,
        desired_spot: DesiredFleet | None = None,
        spot_headroom_share: float = DEFAULT_SPOT_HEADROOM_SHARE,
        spot_return_hold_s: float = DEFAULT_SPOT_RETURN_HOLD_S,
    ) -> None:
        if not 0.0 <= spot_headroom_share < 1.0:
            raise ValueError(f"spot_headroom_share must be in [0, 1), got {spot_headroom_share!r}")
        if not (spot_return_hold_s >= 0 and math.isfinite(spot_return_hold_s)):
            raise ValueError(
                f"spot_return_hold_s must be finite and >= 0, got {spot_return_hold_s!r}"
            )
        self.spot_headroom_share = spot_headroom_share
        self.spot_return_hold_s = spot_return_hold_s
        # Rule 10's move back: (app, type) -> since when (monotonic) its spot price has stayed
        # at or below its on-demand price less the headroom share (this process's ticks: a new
        # leader waits the hold again).
        self._spot_low_since_s: dict[tuple[str, str], float] = {}
        # Rule 10's move back, by app: the on-demand rows it took as returning (made before the
        # break), and those a rise launched in place of spot ones of their type; read back from
        # the decisions once per app after a start (``_spot_read``).
        self._spot_returning: dict[str, set[str]] = {}
        self._spot_replacements: dict[str, set[str]] = {}
        self._spot_read: set[str] = set()
        # By app, the rows launched again whose ``launch`` decision this process found written
        # (:meth:`_unsaid`): those of the app's retries now, each looked up once.
        self._said_rows: dict[str, set[str]] = {}
        self.store = store
        self.provisioner = provisioner
        self.clock = clock
        self.pricing = pricing
        self.desired_fleet = (
            desired_fleet if desired_fleet is not None else applied_plan_fleet(store)
        )
        self.launchable = launchable
        self.artifacts = artifacts
        self.probe = probe
        self.liveness = liveness
        # Rule 3: provider id -> why, the running workers found unresponsive this tick; and
        # those whose last probe went unanswered (rule 5 ends them first).
        self._unresponsive: dict[str, str] = {}
        self._silent: frozenset[str] = frozenset()
        # The last spot price read failure logged, and when (the same one once a minute).
        self._spot_read_warned: tuple[str, float] = ("", -math.inf)
        # Rule 3's grace: app -> live row id -> when a tick first found the provider's list
        # without its machine, for as long as the ticks since have (this process's ticks: a new
        # leader starts the count again, which only waits longer).
        self._missing_since: dict[str, dict[str, datetime]] = {}
        self.straggler_timeout_s = straggler_timeout_s
        self.missing_grace_s = missing_grace_s
        self.launch_backoff_s = launch_backoff_s
        self.disruption = disruption
        self.profile_run_timeout_s = profile_run_timeout_s
        self.desired_spot = desired_spot if desired_spot is not None else applied_plan_spot(store)
        self.interruption_drain_s = interruption_drain_s
        self.interruption_margin_s = interruption_margin_s
        self.before_budget_drain: Callable[[str], object] | None = None
        # Rule 9: provider id -> the notice the provider gave of it (kept until the row ends).
        self._notices: dict[str, InterruptionNotice] = {}
        self._handled: set[str] = set()  # the provider ids whose notice was acted on
        # (app, drain_deferred cause) -> (when its episode began, the last pass it was deferred
        # in): deferrals in consecutive passes are one episode, one decision row.
        self._deferrals: dict[tuple[str, str], tuple[datetime, int]] = {}
        # App -> what its last pass held back of the desired fleet's drains (held_back).
        self._held_back: dict[str, HeldBack] = {}
        self._passes = 0
        # (app, instance type) -> monotonic time before which it is not launched again.
        self._held_until_s: dict[tuple[str, str], float] = {}
        # (app, type) -> until when its launches go on demand: a spot launch of it ran on demand.
        self._spot_on_demand_until_s: dict[tuple[str, str], float] = {}
        self._reported: set[str] = set()
        # (app, instance type) -> monotonic time of the first capacity miss of its current run.
        self._capacity_missed_s: dict[tuple[str, str], float] = {}
        self._capacity_lock = threading.Lock()
        # (app, instance type) -> monotonic time of its last capacity miss: its stand-ins do
        # not go back to it for ``launch_backoff_s`` after (rule 10's move back).
        self._capacity_missed_last_s: dict[tuple[str, str], float] = {}
        # Rule 11: app -> row id -> the type the row stands in for (read back from the app's
        # stand_in decisions the first time the app is reconciled by this process).
        self._stand_ins: dict[str, dict[str, str]] = {}
        # Rule 10's sized moves: app -> row id -> the share of one it counts as (1 if missing).
        self._stand_in_shares: dict[str, dict[str, float]] = {}

    def capacity_misses(self, app: str) -> dict[str, float]:
        """The types of ``app`` the provider has had no capacity for, and for how many seconds
        (since the first miss of the current run; a launch of the type that works ends it, as
        does the last waiting row of the type leaving ``requested``). Thread-safe."""
        now_s = self.clock.now_s()
        with self._capacity_lock:
            return {
                t: max(0.0, now_s - since_s)
                for (name, t), since_s in self._capacity_missed_s.items()
                if name == app
            }

    # --- one tick ------------------------------------------------------------------------------

    def run_once(self) -> ReconcileReport:
        """Reconcile every app once; a failure of one app is logged and the others go on."""
        now = self.clock.utcnow()
        self._passes += 1
        # A deferral episode the last pass did not go on with is over: the next one begins anew.
        for key in [k for k, (_, at) in self._deferrals.items() if at < self._passes - 1]:
            del self._deferrals[key]
        self._log_events()
        self._poll_interruptions(now)
        apps = self.store.list_apps()
        names = {app.name for app in apps}
        self._forget_apps_gone(names)
        try:
            observed = self.provisioner.list({MANAGED_TAG: "true"})
        except ProvisionerError as error:
            # Without the provider's list only the budget guard runs (from the database).
            logger.warning("reconcile: cannot list instances (%s); budget guard only", error)
            for app in apps:
                self._provider_unreachable(app.name, error)
            reports = {app.name: self._guarded(app, None) for app in apps}
            return ReconcileReport(now, MappingProxyType(reports), errors=(f"list: {error}",))
        by_app: dict[str, list[ProvisionedInstance]] = defaultdict(list)
        unmanaged: list[str] = []
        strays: list[ProvisionedInstance] = []
        for instance in observed:
            if instance.tags.get(MANAGED_TAG) != "true":
                unmanaged.append(instance.provider_id)
                self._report_unmanaged(instance)
            elif instance.tags.get(APP_TAG) in names:
                by_app[instance.tags[APP_TAG]].append(instance)
            elif instance.state in ("pending", "running", "stopping"):
                strays.append(instance)
        errors = self._terminate_strays(strays)
        if self.liveness is not None:
            ours = [i for app in by_app.values() for i in app]
            self._unresponsive = self.liveness.check(ours, now)
            self._silent = frozenset(self.liveness.silent())
        reports = {app.name: self._guarded(app, by_app.get(app.name, [])) for app in apps}
        return ReconcileReport(
            now,
            MappingProxyType(reports),
            tuple(i.provider_id for i in strays),
            tuple(unmanaged),
            tuple(errors),
        )

    def _forget_apps_gone(self, names: Collection[str]) -> None:
        """Forget what this process remembers of the apps not in ``names`` (deleted): nothing of
        an app outlives it (one made again under its name starts afresh, as after a restart)."""
        with self._capacity_lock:
            for key in [k for k in self._capacity_missed_s if k[0] not in names]:
                del self._capacity_missed_s[key]
        by_type: list[dict[tuple[str, str], Any]] = [
            self._capacity_missed_last_s,
            self._held_until_s,
            self._spot_on_demand_until_s,
            self._spot_low_since_s,
            self._deferrals,
        ]
        by_app: list[dict[str, Any]] = [
            self._spot_returning,
            self._spot_replacements,
            self._stand_ins,
            self._stand_in_shares,
            self._held_back,
            self._missing_since,
            self._said_rows,
        ]
        for keyed in by_type:
            for key in [k for k in keyed if k[0] not in names]:
                del keyed[key]
        for memory in by_app:
            for app in [a for a in memory if a not in names]:
                del memory[app]
        self._spot_read.intersection_update(names)

    def _guarded(self, app: AppRecord, observed: Sequence[ProvisionedInstance] | None) -> AppReport:
        try:
            return self.reconcile_app(app, observed)
        except (ControlPlaneError, ProvisionerError) as error:
            # Deleted meanwhile, a database hiccup: the next tick starts afresh.
            logger.warning("reconcile %s: %s", app.name, error)
            return AppReport(app.name, (), (str(error),))

    def reconcile_app(
        self, app: AppRecord, observed: Sequence[ProvisionedInstance] | None
    ) -> AppReport:
        """Decide with :func:`reconcile` for one app (``observed``: the provider's instances with
        its app tag; ``None`` when they could not be listed) and carry the actions out."""
        now = self.clock.utcnow()
        now_s = self.clock.now_s()
        fleet = self.desired_fleet(app)
        desired: Mapping[str, int] | None = fleet
        refused: dict[str, str] = {}
        for instance_type, count in fleet.items():
            why = self.launchable(instance_type) if count > 0 else None
            if why is not None:
                refused[instance_type] = why
        if refused:
            reasons = sorted(set(refused.values()))
            self._record_once(
                app.name,
                "plan_not_launched",
                f"{'; '.join(reasons)}; plan not launched (it names {', '.join(sorted(refused))})",
                {"instance_types": sorted(refused), "fleet": dict(fleet)},
            )
            desired = None
        rows = self._rows(app.name, observed, now)
        desired_spot = self.desired_spot(app)
        spot_types = set(desired_spot) | {r.instance_type for r in rows if r.market == "spot"}
        pricing = self.pricing(app)
        ranking = self._ranking(app, pricing, desired_spot)
        # Rule 10's prices now, of the spot types and of the types that may stand in for them.
        stand_in_types = {t for types in ranking.values() for t in types}
        failed: list[bool] = []
        pricing = self._live_spot_prices(pricing, spot_types | stand_in_types, failed)
        if not failed:  # a provider that could not be read now leaves the rows as they are
            self._record_prices_now(app.name, rows, pricing.spot_prices_usd_per_hr)
        fallen = self._spot_fallen(app.name, desired_spot, pricing, now_s, read=not failed)
        waiting = {r.instance_type for r in rows if r.state == _S.REQUESTED.value}
        with self._capacity_lock:
            for key in [k for k in self._capacity_missed_s if k[0] == app.name]:
                if key[1] not in waiting:
                    del self._capacity_missed_s[key]
        # A hold, or a turn on demand, whose time has passed says nothing more: forgotten.
        for until_s in (self._held_until_s, self._spot_on_demand_until_s):
            for key in [k for k, until in until_s.items() if k[0] == app.name and until <= now_s]:
                del until_s[key]
        held = {t for (name, t) in self._held_until_s if name == app.name}
        spot_on_demand = {t for (name, t) in self._spot_on_demand_until_s if name == app.name}
        # A miss older than the back-off says nothing more: forgotten.
        for key in [
            k
            for k, at in self._capacity_missed_last_s.items()
            if k[0] == app.name and now_s - at >= self.launch_backoff_s
        ]:
            del self._capacity_missed_last_s[key]
        failing = {t for (name, t) in self._capacity_missed_last_s if name == app.name}
        teardown = teardown_requested(self.store, app)
        with self._capacity_lock:
            short = {t for (name, t) in self._capacity_missed_s if name == app.name}
        returning, replacements = self._spot_kept(app.name, rows)
        actions = reconcile(
            desired,
            rows,
            observed,
            pricing.prices_usd_per_hr,
            app.budget_usd_per_hr,
            now,
            self.straggler_timeout_s,
            request_prefix=request_prefix(app),
            qps_by_type=pricing.qps_by_type,
            unhealthy=self._unhealthy(rows, observed or ()),
            unresponsive=self._unresponsive,
            silent=self._silent,
            missing_grace_s=self.missing_grace_s,
            held_types=held,
            stage_types=_stage_types(self.store, app),
            disruption=self.disruption,
            disrupted_in_window=self._disrupted_in_window(app.name, now),
            teardown=teardown,
            profile_run_timeout_s=self.profile_run_timeout_s,
            notices={pid: notice.deadline for pid, notice in self._notices.items()},
            handled=frozenset(self._handled),
            drain_s=self.interruption_drain_s,
            margin_s=self.interruption_margin_s,
            desired_spot=desired_spot,
            spot_prices_usd_per_hr=pricing.spot_prices_usd_per_hr,
            ranking=ranking,
            short_types=short,
            stand_ins=self._stand_ins_of(app.name, rows),
            headroom_share=self.spot_headroom_share,
            stand_in_shares=self._stand_in_shares.get(app.name, {}),
            app=app.name,
            spot_on_demand=spot_on_demand,
            used_request_ids=functools.partial(
                self.store.list_request_ids, app.name, request_prefix(app)
            ),
            drain_causes=self._drain_causes(rows),
            missing_since=self._note_missing(app.name, rows, observed, now),
            spot_fallen=fallen,
            spot_returning=returning,
            spot_replacements=replacements,
            spot_failing=failing,
        )
        for action in actions:
            if isinstance(action, SpotReturned) and action.how == "make_before_break":
                self._spot_returning.setdefault(app.name, set()).update(action.instance_ids)
        if desired is not None and observed is not None and not teardown:
            self._held_back[app.name] = self._held_back_of(app.name, desired, rows, actions)
        errors = _Errors()
        hook = self.before_budget_drain
        if hook is not None and any(
            isinstance(a, Terminate) and a.cause == "budget" for a in actions
        ):
            try:
                hook(app.name)
            except Exception:  # the drain goes ahead: the budget is a hard limit
                logger.exception("reconcile %s: before the budget drain", app.name)
        launches = [a for a in actions if isinstance(a, Launch)]
        unstopped: set[str] = set()  # provider ids whose terminate failed in this tick
        for action in actions:
            if not isinstance(action, Launch):
                unstopped.update(self._carry_out(app, action, errors))
        if launches:
            # The launches were decided with those machines gone; they still run and are billed.
            price_of = {r.provider_id: r.cost_usd_per_hr for r in rows if r.provider_id}
            price_of |= {
                a.instance.provider_id: a.price_usd_per_hr for a in actions if isinstance(a, Orphan)
            }
            self._launch(
                app,
                launches,
                errors,
                known={r.id for r in rows},
                prices=pricing.prices_usd_per_hr,
                unstopped_usd_per_hr=float(sum(price_of.get(pid, 0.0) for pid in unstopped)),
            )
        if teardown and observed is not None:
            self._delete_if_drained(app.name, errors)
        return AppReport(app.name, tuple(actions), tuple(errors))

    def _rows(
        self, app: str, observed: Sequence[ProvisionedInstance] | None, now: datetime
    ) -> list[InstanceRecord]:
        """The rows a tick reads: the live ones, those that ended in the last
        ``ENDED_ROWS_S``, and the ended ones whose machine the provider still lists (by its id
        or its request id), however long ago they ended. Every row of a fleet that has cycled
        for weeks would be thousands a tick, nearly all of them ended and matched to nothing."""
        rows = self.store.list_instances(app, ended_after=now - timedelta(seconds=ENDED_ROWS_S))
        if not observed:
            return rows
        seen = {r.id for r in rows}
        older = self.store.list_ended_instances(
            app,
            provider_ids={i.provider_id for i in observed},
            request_ids={i.request_id for i in observed if i.request_id is not None},
        )
        extra = [r for r in older if r.id not in seen]
        if not extra:
            return rows
        return sorted([*rows, *extra], key=lambda r: (r.created_at, r.id))

    def _ranking(
        self, app: AppRecord, pricing: AppPricing, spot: Mapping[str, int]
    ) -> dict[str, list[str]]:
        """Rule 11: for each type the applied plan buys on spot (``spot``), the types that may
        stand in for it,
        preferred first: its stage's base types (the planner's order), the stage's other types,
        then (a plan of one stage) the other types of the app's spec (``instance_types``; without
        it, the types Q_t is known for); each group by queries per
        second per dollar, best first. Only types the provisioner can launch."""
        plan = self.store.get_applied_plan(app.name)
        if plan is None:
            return {}
        try:
            stages = plan.plan.stages
        except EstimatorError:
            return {}
        prices = pricing.prices_usd_per_hr

        def by_value(types: Iterable[str]) -> list[str]:
            return sorted(
                types,
                key=lambda t: (-_value_per_usd(t, prices[t], pricing.qps_by_type), prices[t], t),
            )

        listed = app.spec.get("instance_types")
        candidates = (
            [t for t in listed if isinstance(t, str)]
            if isinstance(listed, list)
            else list(pricing.qps_by_type)
        )
        ranking: dict[str, list[str]] = {}
        for stage in stages:
            planned = [t for t, n in stage.fleet.items() if n > 0]
            order = [t for t in stage.base_types if t in prices]
            order += by_value(t for t in planned if t not in order and t in prices)
            if len(stages) == 1:
                order += by_value(t for t in candidates if t not in order and t in prices)
            order = [t for t in order if self.launchable(t) is None]
            for instance_type in (t for t in planned if spot.get(t, 0) > 0):
                ranking.setdefault(instance_type, [t for t in order if t != instance_type])
        return ranking

    def held_back(self, app: str) -> HeldBack:
        """What the last pass over ``app`` (one that read the provider's list and acted on a
        desired fleet) held back of that fleet's drains: the serving rows rule 5's guards kept
        past the desired count (the disruption budget, the last serving instance), by the type
        they are counted as (a stand-in as the type it stands in for). Before any such pass, an
        empty fleet: a desired fleet no pass has read (INFaaS's autoscaler drains no further
        until one has, :class:`~controlplane.policies.infaas_scaling.HeldBack`). With it, the
        app's live stand-ins as they are now (rules 10 and 11: row id -> the type it stands in
        for and its share of one), launched in that pass included, which the policy counts as
        that type, never as their own."""
        # Copies: the scaler reads them from another thread than the passes that change them.
        standing = dict(self._stand_ins.get(app, {}))
        shares = dict(self._stand_in_shares.get(app, {}))
        stand_ins = {i: StandIn(t, shares.get(i, 1.0)) for i, t in standing.items()}
        return dataclasses.replace(self._held_back.get(app, HeldBack({})), stand_ins=stand_ins)

    def _held_back_of(
        self,
        app: str,
        desired: Mapping[str, int],
        rows: Sequence[InstanceRecord],
        actions: Sequence[Action],
    ) -> HeldBack:
        types = {r.id: r.instance_type for r in rows}
        standing = self._stand_ins.get(app, {})
        counts = Counter(
            standing.get(i) or types.get(i, "")
            for a in actions
            if isinstance(a, DrainDeferred)
            for i in a.instance_ids
        )
        return HeldBack(
            {t: int(n) for t, n in desired.items() if n > 0},
            {t: n for t, n in counts.items() if t and n > 0},
        )

    def _stand_ins_of(self, app: str, rows: Sequence[InstanceRecord]) -> dict[str, str]:
        """Rule 11: the app's live rows that stand in for another type (row id -> that type)."""
        known = self._stand_ins.get(app)
        shares = self._stand_in_shares.get(app, {})
        if known is None:
            known = {}
            for decision in self.store.list_decisions(app, kinds=["stand_in"]):
                instance_id = decision.numbers.get("instance_id")
                stands_for = decision.numbers.get("stands_for")
                share = decision.numbers.get("share", 1.0)
                if isinstance(instance_id, str) and isinstance(stands_for, str):
                    known[instance_id] = stands_for
                    if isinstance(share, int | float) and 0 < share < 1:
                        shares[instance_id] = float(share)
        live = {r.id for r in rows if r.state not in TERMINAL_STATES}
        self._stand_ins[app] = {i: t for i, t in known.items() if i in live}
        self._stand_in_shares[app] = {i: f for i, f in shares.items() if i in live}
        return dict(self._stand_ins[app])

    def _spot_kept(
        self, app: str, rows: Sequence[InstanceRecord]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Rule 10's memories of ``app`` whose rows are live (the others forgotten): the rows an
        earlier move back took as returning (``_spot_returning``) and those a rise launched on
        demand in place of spot ones (``_spot_replacements``); after a start, both read back
        from the decisions first (the ``spot_return`` decisions' rows, the launches that
        replaced spot ones)."""
        if app not in self._spot_read:
            # Marked read once read: a read that fails (a database hiccup) is tried again.
            decisions = self.store.list_decisions(app, kinds=["launch", "spot_return"])
            self._spot_read.add(app)
            for decision in decisions:
                if decision.kind == "spot_return" and decision.numbers.get("how") == (
                    "make_before_break"
                ):
                    ids = decision.numbers.get("instance_ids") or []
                    returning = self._spot_returning.setdefault(app, set())
                    returning.update(i for i in ids if isinstance(i, str))
                elif decision.kind == "launch":
                    for launch in decision.numbers.get("launches") or []:
                        instance_id = (
                            launch.get("instance_id") if isinstance(launch, dict) else None
                        )
                        if isinstance(instance_id, str) and launch.get("replaces_spot"):
                            self._spot_replacements.setdefault(app, set()).add(instance_id)
        live = {r.id for r in rows if r.state not in TERMINAL_STATES}

        def kept(known: dict[str, set[str]]) -> frozenset[str]:
            ids = known.get(app, set()) & live
            if ids:
                known[app] = ids
            else:
                known.pop(app, None)
            return frozenset(ids)

        return kept(self._spot_returning), kept(self._spot_replacements)

    def _spot_fallen(
        self,
        app: str,
        desired_spot: Mapping[str, int],
        pricing: AppPricing,
        now_s: float,
        *,
        read: bool,
    ) -> frozenset[str]:
        """Rule 10's move back: the types the plan buys on spot whose spot price now has stayed
        at or below their on-demand price less ``spot_headroom_share`` of it for
        ``spot_return_hold_s`` (the run of such ticks is timed here; a tick above it ends the
        run). A tick whose prices could not be read moves nothing back and ends no run."""
        if not read:
            return frozenset()
        fallen: set[str] = set()
        spot_now = pricing.spot_prices_usd_per_hr or {}
        for instance_type, count in desired_spot.items():
            key = (app, instance_type)
            spot = spot_now.get(instance_type)
            on_demand = pricing.prices_usd_per_hr.get(instance_type)
            low = (
                count > 0
                and spot is not None
                and on_demand is not None
                and spot <= on_demand * (1.0 - self.spot_headroom_share) + _BUDGET_SLACK_USD_PER_HR
                and spot < on_demand
            )
            if not low:
                self._spot_low_since_s.pop(key, None)
                continue
            since = self._spot_low_since_s.setdefault(key, now_s)
            if now_s - since >= self.spot_return_hold_s:
                fallen.add(instance_type)
        for key in [k for k in self._spot_low_since_s if k[0] == app and k[1] not in desired_spot]:
            del self._spot_low_since_s[key]
        return frozenset(fallen)

    def spot_prices_now(self, app: AppRecord, types: Collection[str]) -> dict[str, float]:
        """The spot prices now of those of ``types`` the app's catalog sells on spot: the
        provider's where it reads them (rule 10's prices), else the catalog's."""
        pricing = self._live_spot_prices(self.pricing(app), types)
        return {t: p for t, p in pricing.spot_prices_usd_per_hr.items() if t in types}

    def _provider_unreachable(self, app: str, error: ProvisionerError) -> None:
        """A ``provider_unreachable`` decision for ``app``: the provider's list could not be
        read, so this tick acts from the database alone (the budget guard). One row a run of
        such ticks (keyed: counted again, its ``last_at`` the latest), so that an operator
        who reads ``heteroplane events`` sees the outage and how long it lasted."""
        try:
            self.store.record_decision(
                app,
                "provider_unreachable",
                f"the provider's list could not be read ({str(error)[:300]}): only the budget"
                " guard acts, from the database, until it can",
                {"error": type(error).__name__},
                key="list",
            )
        except ControlPlaneError as failure:
            logger.warning("reconcile %s: provider_unreachable not recorded (%s)", app, failure)

    def _note_missing(
        self,
        app: str,
        rows: Sequence[InstanceRecord],
        observed: Sequence[ProvisionedInstance] | None,
        now: datetime,
    ) -> dict[str, datetime]:
        """Rule 3's ``missing_since`` for ``app``'s rows: the first tick in the run up to now
        whose provider list left out each launched live row's machine (listed, the run ends).
        A list that could not be read (``observed`` None) changes nothing."""
        live = {
            r.id: r for r in rows if r.provider_id is not None and r.state not in TERMINAL_STATES
        }
        missing = self._missing_since.get(app, {})
        if observed is not None:
            listed = {i.provider_id for i in observed if i.tags.get(MANAGED_TAG) == "true"}
            for row_id, row in live.items():
                if row.provider_id in listed:
                    missing.pop(row_id, None)
                else:
                    missing.setdefault(row_id, now)
        # Only the live rows' runs: an ended row's is over (and an ended row stays ended).
        missing = {k: v for k, v in missing.items() if k in live}
        if missing:
            self._missing_since[app] = missing
        else:
            self._missing_since.pop(app, None)
        return dict(missing)

    def _drain_causes(self, rows: Sequence[InstanceRecord]) -> dict[str, str]:
        """Why each draining row drains, where rule 5 drained it (``scale_down``): read from
        its newest event, the move to ``draining`` (one read per draining row, and only while
        one drains)."""
        causes: dict[str, str] = {}
        for row in rows:
            if row.state != _S.DRAINING.value:
                continue
            events = self.store.list_instance_events(instance_id=row.id, limit=1)
            if events and events[-1].reason.startswith(SCALE_DOWN_DRAIN):
                causes[row.id] = "scale_down"
            elif events and events[-1].reason.startswith(SPOT_RETURN_DRAIN):
                causes[row.id] = "spot_return"
        return causes

    def _record_prices_now(
        self, app: str, rows: Sequence[InstanceRecord], spot_prices: Mapping[str, float]
    ) -> None:
        """Rule 10's prices now written into the live spot rows whose type's price moved from
        their launch price (or moved back to it): what the fleet route, the dashboard,
        ``/metrics``, the roll-up and the budget's checks outside this loop cost them at.
        Only the rows whose price now changed are written (spot prices move hourly, not every
        tick). A failed write is logged: the next tick writes it again."""
        moved: dict[float | None, list[str]] = defaultdict(list)
        for row in rows:
            now_price = _spot_price_now(row, spot_prices)
            if now_price is None:
                continue
            wanted = now_price if _price_moved(now_price, row.price_usd_per_hr) else None
            recorded = row.price_now_usd_per_hr
            if (wanted is None) != (recorded is None) or (
                wanted is not None and recorded is not None and _price_moved(wanted, recorded)
            ):
                moved[wanted].append(row.id)
        for price, ids in moved.items():
            try:
                self.store.set_prices_now(ids, price)
            except ControlPlaneError as error:
                logger.warning("reconcile %s: spot prices now not recorded (%s)", app, error)

    def _live_spot_prices(
        self, pricing: AppPricing, types: Collection[str], read: list[bool] | None = None
    ) -> AppPricing:
        """Rule 10's prices of ``types`` (those the app buys on spot): the provider's spot
        prices now where it knows them (the EC2 provisioner: DescribeSpotPriceHistory, cached),
        else the app's (its catalog's). ``read`` (where given) gets False appended when the
        provider reads spot prices and failed to now (the catalog's stood in)."""
        wanted = sorted(t for t in types if t in pricing.spot_prices_usd_per_hr)
        if not wanted or not isinstance(self.provisioner, SpotPriceSource):
            return pricing
        live = dict(pricing.spot_prices_usd_per_hr)
        try:
            for instance_type in wanted:
                price = self.provisioner.spot_price(instance_type)
                if price is not None:
                    live[instance_type] = price
        except ProvisionerError as error:  # throttled, no permission: the app's prices serve
            said, at_s = self._spot_read_warned
            now_s = self.clock.now_s()
            if said != str(error) or now_s - at_s >= SPOT_READ_WARN_EVERY_S:
                logger.warning("reconcile: spot prices not read (%s); the catalog's serve", error)
                self._spot_read_warned = (str(error), now_s)
            if read is not None:
                read.append(False)
            return pricing
        return dataclasses.replace(pricing, spot_prices_usd_per_hr=live)

    def _poll_interruptions(self, now: datetime) -> None:
        """Rule 9's input: the provider's new notices; those past their deadline by more than
        the straggler timeout are forgotten (the row has ended by then)."""
        if isinstance(self.provisioner, InterruptionSource):
            try:
                for notice in self.provisioner.poll_interruptions():
                    logger.warning("reconcile: %s", notice.describe())
                    self._notices[notice.provider_id] = notice
            except ProvisionerError as error:  # throttled, unreachable: the next tick asks again
                logger.warning("reconcile: cannot read interruption notices: %s", error)
        forget = now - timedelta(seconds=self.straggler_timeout_s)
        for pid in [p for p, n in self._notices.items() if n.deadline < forget]:
            del self._notices[pid]
            self._handled.discard(pid)

    def _disrupted_in_window(self, app: str, now: datetime) -> int:
        """Serving instances of ``app`` moved out of service within the disruption window."""
        if self.disruption is None:
            return 0
        since = now - timedelta(seconds=self.disruption.window_s)
        return count_disruptions(self.store.list_instance_events(app=app, since=since))

    def _delete_if_drained(self, app: str, errors: _Errors) -> None:
        """The teardown's end: once no instance of ``app`` is live, the app goes."""
        if self.store.list_instances(app, states=[s.value for s in _LIVE]):
            return
        try:
            self.store.delete_app(app)
        except ControlPlaneError as error:  # deleted meanwhile, or a launch raced in
            logger.warning("reconcile %s: not deleted after the teardown: %s", app, error)
            errors.append(str(error))
            return
        logger.info("reconcile %s: every instance drained; the app is deleted (app down)", app)

    # --- carrying actions out ------------------------------------------------------------------

    def _carry_out(self, app: AppRecord, action: Action, errors: _Errors) -> list[str]:
        """Carry ``action`` out; the provider ids a terminate it asked for left running."""
        store = self.store
        if isinstance(action, Mark):
            errors.guard(
                lambda: store.transition_instance(
                    action.instance_id,
                    action.to_state.value,
                    reason=action.reason,
                    provider_id=action.provider_id,
                )
            )
        elif isinstance(action, Adopt):
            # The move and the decision in one transaction: the decision written first, a crash
            # before the move had the reconciler started again adopt the machine again and say
            # it twice.
            said: Words = [
                (
                    "adopt",
                    f"adopted {action.provider_id} into request {action.request_id}:"
                    f" {action.reason}",
                    {"instance_id": action.instance_id, "provider_id": action.provider_id},
                )
            ]
            price = action.on_demand_usd_per_hr
            billed: dict[str, Any] = (
                {} if price is None else {"market": "on-demand", "price_usd_per_hr": price}
            )
            errors.guard(
                lambda: store.transition_instance(
                    action.instance_id,
                    _S.PENDING.value,
                    reason=f"adopted: {action.reason}",
                    provider_id=action.provider_id,
                    said=said,
                    **billed,
                )
            )
        elif isinstance(action, Terminate):
            return self._terminate(app, action, errors)
        elif isinstance(action, Orphan):
            return self._end_orphan(app, action, errors)
        elif isinstance(action, BudgetCapped):
            self._record_once(
                app.name,
                "budget_capped",
                f"not launched within the budget of {plain(action.budget_usd_per_hr)} USD/hr: "
                + ", ".join(
                    _capped_words(t, n, action.each.get(t)) for t, n in action.wanted.items()
                )
                + f" (the fleet already costs {action.committed_usd_per_hr:.3f} USD/hr)",
                {
                    "wanted": dict(action.wanted),
                    "committed_usd_per_hr": round(action.committed_usd_per_hr, 9),
                    "budget_usd_per_hr": action.budget_usd_per_hr,
                },
            )
        elif isinstance(action, LaunchSkipped):
            # Once per type (several unpriced types would alternate every tick).
            self.store.record_decision(
                app.name,
                "launch_skipped",
                f"{action.count} x {action.instance_type} not launched: {action.reason}",
                {"instance_type": action.instance_type, "count": action.count},
                key=action.instance_type,
            )
        elif isinstance(action, DrainDeferred):
            # One decision per episode, however many ticks it lasts: an episode is the run of
            # consecutive passes that defer for the cause (keyed by the cause and its start; a
            # later scale-down's deferral is a decision of its own, not a repeat of the last).
            self.store.record_decision(
                app.name,
                "drain_deferred",
                f"{len(action.instance_ids)} serving instance(s) not drained yet: {action.reason}",
                {
                    "cause": action.cause,
                    "instance_ids": list(action.instance_ids),
                    "allowed_now": action.allowed,
                    "window_s": action.window_s,
                },
                key=self._deferral_key(app.name, action.cause),
            )
        elif isinstance(action, InterruptionHandled):
            self._handled.add(action.provider_id)
            notice = self._notices.get(action.provider_id)
            self.store.record_decision(
                app.name,
                "spot_interruption",
                f"{notice.describe() if notice else action.provider_id}: {action.reason}",
                {
                    "instance_id": action.instance_id,
                    "provider_id": action.provider_id,
                    "instance_type": action.instance_type,
                    "notice": notice.kind if notice else "interruption",
                    "deadline": action.deadline.isoformat(),
                },
            )
        elif isinstance(action, SpotRepriced):
            if action.over_budget:
                then = "; over it: the least cost-effective instances are drained and replaced"
            elif action.past_threshold and action.risen and action.moved:
                then = (
                    f"; {action.why()}: {action.moved} of them move to cheaper choices before"
                    " the budget is breached"
                )
            elif action.past_threshold and action.risen and action.moved is not None:
                then = (
                    f"; {action.why()}: no choice of the plan's ranking serves as much for less,"
                    " so they stay (the budget guard holds the fleet to the budget)"
                )
            else:
                then = ""
            self.store.record_decision(
                app.name,
                "spot_price",
                f"{action.count} spot {action.instance_type} now cost"
                f" {plain(action.price_usd_per_hr)} USD/hr each (launched at"
                f" {action.launched_usd_per_hr:g}): the fleet costs"
                f" {action.fleet_cost_usd_per_hr:.3f} USD/hr against the budget of"
                f" {plain(action.budget_usd_per_hr)} USD/hr{then}",
                {
                    "instance_type": action.instance_type,
                    "count": action.count,
                    "price_usd_per_hr": action.price_usd_per_hr,
                    "launched_usd_per_hr": action.launched_usd_per_hr,
                    "fleet_cost_usd_per_hr": round(action.fleet_cost_usd_per_hr, 9),
                    "budget_usd_per_hr": action.budget_usd_per_hr,
                    "threshold_usd_per_hr": (
                        None
                        if action.threshold_usd_per_hr is None
                        else round(action.threshold_usd_per_hr, 9)
                    ),
                    "moved": action.moved,
                },
                key=f"{action.instance_type}:{action.price_usd_per_hr:g}",
            )
        elif isinstance(action, SpotReturned):
            self.store.record_decision(
                app.name,
                "spot_return",
                f"{action.count} {action.instance_type} back to spot: {action.reason}",
                {
                    "instance_type": action.instance_type,
                    "count": action.count,
                    "spot_usd_per_hr": action.spot_usd_per_hr,
                    "on_demand_usd_per_hr": action.on_demand_usd_per_hr,
                    "how": action.how,
                    "instance_ids": list(action.instance_ids),
                    **({"stand_in": True} if action.stand_in else {}),
                },
            )
        elif isinstance(action, Report):
            logger.warning("reconcile %s: %s %s", app.name, action.provider_id, action.reason)
        return []

    def _terminate(self, app: AppRecord, action: Terminate, errors: _Errors) -> list[str]:
        if action.instance_ids:
            # The rows and the decision in one transaction: the decision written first, a crash
            # before the rows moved had the reconciler started again decide and say it again.
            _moved, failed = self.store.transition_instances(
                app.name,
                action.instance_ids,
                _S.TERMINATING.value,
                reason=f"{action.cause}: {action.reason}",
                said=[
                    (
                        "terminate",
                        f"terminate {len(action.instance_ids)} instance(s) ({action.cause}):"
                        f" {action.reason}",
                        {
                            "cause": action.cause,
                            "instance_ids": list(action.instance_ids),
                            "provider_ids": list(action.provider_ids),
                            "saved_usd_per_hr": action.saved_usd_per_hr,
                        },
                    )
                ],
            )
            for error in failed:
                errors.note(error)
        crash_point("reconcile.before_terminate")
        return self._provider_terminate(app.name, action.provider_ids, errors)

    def _provider_terminate(
        self, app: str, provider_ids: Sequence[str], errors: _Errors
    ) -> list[str]:
        """Ask the provider to stop ``provider_ids``; one it says is not ours is left out (and
        reported), the rest are asked again. A failure leaves the rows ``terminating``: the next
        tick asks again. Returns the ids a failure left running."""
        remaining = list(provider_ids)
        while remaining:
            try:
                self.provisioner.terminate(remaining)
                return []
            except UnknownInstanceError as error:
                logger.error("reconcile %s: %s; not terminated", app, error)
                errors.append(str(error))
                if error.provider_id not in remaining:
                    return []
                remaining.remove(error.provider_id)
            except ProvisionerError as error:
                logger.warning("reconcile %s: terminate failed (%s); next tick", app, error)
                errors.append(f"terminate: {error}")
                return remaining
        return []

    def _end_orphan(self, app: AppRecord, action: Orphan, errors: _Errors) -> list[str]:
        instance = action.instance
        # The row and the decision in one transaction: the decision written first, a crash
        # before the row had the reconciler started again find the orphan and say it again.
        said: Words = [
            (
                "orphan",
                action.reason,
                {
                    "provider_id": instance.provider_id,
                    "instance_type": instance.instance_type,
                    "request_id": instance.request_id,
                },
            )
        ]
        recorded = errors.guard(
            lambda: self.store.record_instance(
                app.name,
                request_id=f"{ORPHAN_REQUEST_PREFIX}{instance.provider_id}",
                instance_type=instance.instance_type,
                price_usd_per_hr=action.price_usd_per_hr,
                provider_id=instance.provider_id,
                state=_S.TERMINATING.value,
                reason=action.reason,
                said=lambda _row: said,
            )
        )
        if recorded is None:
            return []
        return self._provider_terminate(app.name, (instance.provider_id,), errors)

    def _launch(
        self,
        app: AppRecord,
        launches: Sequence[Launch],
        errors: _Errors,
        known: Collection[str] = (),
        prices: Mapping[str, float] | None = None,
        unstopped_usd_per_hr: float = 0.0,
    ) -> None:
        """Record every launch (rows, then one decision), then ask the provider for each, but
        those the budget no longer pays for (:meth:`_refused_now`; ``known``: the ids of the
        rows the launches were decided on; ``unstopped_usd_per_hr``: the machines whose
        terminate failed in this tick, still billed). A spot launch the provider ran on demand
        (EC2, for what spot cannot supply) is recorded on demand at its on-demand price
        (``prices``), the price it is billed at, so that the budget guard counts that."""
        try:
            artifacts = tuple(self.artifacts(app))
        except (ControlPlaneError, EstimatorError) as error:
            # Launched without its models a worker would serve nothing: not launched this tick.
            errors.append(f"launch: the app's models do not resolve: {error}")
            return
        rows: list[tuple[Launch, InstanceRecord]] = []
        for launch in launches:
            stand_in = launch.stands_for is not None and not launch.retry
            row = self.store.record_instance(
                app.name,
                request_id=launch.request_id,
                instance_type=launch.instance_type,
                price_usd_per_hr=launch.price_usd_per_hr,
                reason=launch.reason,
                market=launch.market,
                # A stand-in's decision, read back after a restart, in the row's transaction.
                said=functools.partial(_stand_in_said, launch) if stand_in else None,
            )
            rows.append((launch, row))
            if launch.replaces_spot and not launch.retry:
                self._spot_replacements.setdefault(app.name, set()).add(row.id)
            if stand_in:
                self._note_stand_in(app.name, launch, row)
        crash_point("reconcile.after_row")
        rows = self._refused_now(app, rows, set(known), errors, unstopped_usd_per_hr)
        unsaid = self._unsaid(app.name, [row for launch, row in rows if launch.retry])
        new = [(launch, row) for launch, row in rows if not launch.retry or row.id in unsaid]
        replaced_spot = self._replaced_spot(app.name, unsaid)
        if new:
            self.store.record_decision(
                app.name,
                "launch",
                "launch "
                + ", ".join(
                    f"{n} x {t}"
                    for t, n in sorted(Counter(launch.instance_type for launch, _ in new).items())
                ),
                {
                    "launches": [
                        {
                            "request_id": launch.request_id,
                            "instance_id": row.id,
                            "instance_type": launch.instance_type,
                            "price_usd_per_hr": launch.price_usd_per_hr,
                            "market": launch.market,
                        }
                        | (
                            {"replaces_spot": True}
                            if launch.replaces_spot or row.id in replaced_spot
                            else {}
                        )
                        for launch, row in new
                    ],
                    "budget_usd_per_hr": app.budget_usd_per_hr,
                },
            )
            if unsaid:
                self._said_rows.setdefault(app.name, set()).update(unsaid)
        plan = "none" if app.applied_plan_id is None else str(app.applied_plan_id)
        ran_on_demand: set[str] = set()  # types whose spot launch this tick ran on demand
        # An app with spot on says which of its instances run on spot and which on demand.
        own_market = app.spot_enabled
        for launch, row in rows:
            if row.market == "spot" and launch.instance_type in ran_on_demand:
                # Priced at spot, it would run on demand too, over what the budget was told:
                # the next tick launches it on demand, within the budget at that price.
                errors.guard(
                    functools.partial(
                        self.store.transition_instance,
                        row.id,
                        _S.FAILED.value,
                        reason=f"not launched: {launch.instance_type} on spot runs on demand",
                    )
                )
                continue
            tags = {APP_TAG: app.name, PLAN_TAG: plan, INSTANCE_TAG: row.id}
            if row.market == "spot":
                tags[MARKET_TAG] = "spot"
            elif own_market:
                # The app's on-demand base (its spot block's survive_share): a deployment's
                # spot-first setting (EC2's ``spot``) must not launch it on spot.
                tags[MARKET_TAG] = "on-demand"
            request = LaunchRequest(launch.request_id, launch.instance_type, 1, tags, artifacts)
            try:
                launched = self.provisioner.launch(request)
            except ProvisionerError as error:
                self._launch_failed(app, launch, row, error, errors, prices or {})
                if isinstance(error, SpotUnavailableError):
                    ran_on_demand.add(launch.instance_type)
                continue
            crash_point("reconcile.after_launch")
            live = [i for i in launched if i.state in ("pending", "running")]
            if not launched:
                errors.append(f"launch {launch.request_id}: the provider returned no instance")
                continue
            if not live:
                self._request_id_spent(app, launch, row, launched, errors)
                continue
            with self._capacity_lock:
                self._capacity_missed_s.pop((app.name, launch.instance_type), None)
            billed: dict[str, Any] = {}
            reason = "launched"
            on_demand = (prices or {}).get(launch.instance_type)
            if row.market == "spot" and live[0].market == "on-demand" and on_demand is not None:
                billed = {"market": "on-demand", "price_usd_per_hr": on_demand}
                reason = (
                    f"launched on demand (spot could not supply it), at {plain(on_demand)} USD/hr"
                )
                logger.warning("reconcile %s: %s: %s", app.name, launch.request_id, reason)
                # Its next launches go on demand, within the budget at that price: a spot
                # launch priced at spot and billed on demand went over it, then was drained.
                self._spot_on_demand_until_s[(app.name, launch.instance_type)] = (
                    self.clock.now_s() + self.launch_backoff_s
                )
                ran_on_demand.add(launch.instance_type)
            errors.guard(
                functools.partial(
                    self.store.transition_instance,
                    row.id,
                    _S.PENDING.value,
                    reason=reason,
                    provider_id=live[0].provider_id,
                    **billed,
                )
            )

    def _unsaid(self, app: str, retried: Sequence[InstanceRecord]) -> set[str]:
        """The ids of the ``retried`` rows (launched again) that no ``launch`` decision names: a
        process died after their rows and before their decision (``reconcile.after_row``). A
        retry says nothing, so that they would never be said; they are said with this tick's
        launches (:meth:`_launch` notes them said once written). Each row is looked up once per
        process."""
        said = self._said_rows.get(app, set())
        kept = {row.id for row in retried if row.id in said}
        unsaid = set()
        looked = [row for row in retried if row.id not in said]
        if looked:
            # A second before the oldest: the decision is written after its rows, at the same
            # time where the clock's resolution (or a fake clock) says so.
            since = min(row.created_at for row in looked) - timedelta(seconds=1)
            named = {
                str(launch.get("instance_id"))
                for decision in self.store.list_decisions(app, kinds=["launch"], since=since)
                for launch in decision.numbers.get("launches") or ()
                if isinstance(launch, Mapping)
            }
            unsaid = {row.id for row in looked if row.id not in named}
            kept |= {row.id for row in looked if row.id in named}
        if kept:
            self._said_rows[app] = kept
        else:
            self._said_rows.pop(app, None)
        return unsaid

    def _replaced_spot(self, app: str, unsaid: Collection[str]) -> set[str]:
        """Of the ``unsaid`` rows (:meth:`_unsaid`), those a rise launched on demand in place of
        spot ones (:attr:`Launch.replaces_spot`), by the reason recorded with each row: noted in
        ``_spot_replacements`` as the launch that recorded them would have, and said so."""
        replaced = {
            instance_id
            for instance_id in unsaid
            if any(
                event.from_state is None and event.reason.endswith(_REPLACES_SPOT_SAID)
                for event in self.store.list_instance_events(instance_id=instance_id)
            )
        }
        if replaced:
            self._spot_replacements.setdefault(app, set()).update(replaced)
        return replaced

    def _refused_now(
        self,
        app: AppRecord,
        rows: list[tuple[Launch, InstanceRecord]],
        known: set[str],
        errors: _Errors,
        unstopped_usd_per_hr: float = 0.0,
    ) -> list[tuple[Launch, InstanceRecord]]:
        """The launches whose rows are recorded that still fit the budget as it is now: the
        budget is read again after the rows are written, so that a budget lowered while they
        were decided (the serving process commits it between this tick's read of the app and
        the rows) refuses them, and one lowered after sees them among what it drains. The same
        for rows another writer recorded meanwhile (a profile run's, a rollout's workers, which
        write their rows before their own check), and for machines whose terminate failed in
        this tick (``unstopped_usd_per_hr``: the launches were decided with them gone, and
        they are still billed). Where any of these happened and the billed fleet is over the
        budget, the launches go from the last decided (the least cost-effective), each
        row marked failed with a ``launch_refused`` decision; else all go. An app marked for
        teardown meanwhile (``heteroplane app down``) launches none of them."""
        try:
            fresh = self.store.get_app(app.name)
        except NotFoundError:
            fresh = None  # deleted meanwhile: nothing of it is launched
        if fresh is None or teardown_requested(self.store, fresh):
            why = "the app is being taken down" if fresh is not None else "the app is gone"
            return self._refuse(app, rows, [], 0.0, f"{why} (since the launch was decided)", errors)
        budget = fresh.budget_usd_per_hr
        mine = {row.id for _, row in rows}
        live = self.store.list_instances(app.name, states=[s.value for s in _LIVE])
        others = [r for r in live if r.id not in known and r.id not in mine]
        if budget >= app.budget_usd_per_hr and not others and unstopped_usd_per_hr <= 0.0:
            return rows
        billed = before = billed_cost_usd_per_hr(live) + unstopped_usd_per_hr
        kept = list(rows)
        refused: list[tuple[Launch, InstanceRecord]] = []
        while kept and billed > budget + _BUDGET_SLACK_USD_PER_HR:
            launch, row = kept.pop()
            billed -= row.price_usd_per_hr
            refused.append((launch, row))
        if not refused:
            return rows
        why = (
            f"the budget is {plain(budget)} USD/hr now"
            f" (it was {plain(app.budget_usd_per_hr)} when the"
            f" launch was decided), and the fleet with {len(others)} instance(s) recorded"
            f" meanwhile costs {before:.4g} USD/hr"
        )
        if unstopped_usd_per_hr > 0.0:
            why += (
                f", {unstopped_usd_per_hr:.4g} of it machines whose terminate failed in this"
                " tick (still running and billed)"
            )
        return self._refuse(app, refused, kept, budget, why, errors, "by the budget")

    def _refuse(
        self,
        app: AppRecord,
        refused: Sequence[tuple[Launch, InstanceRecord]],
        kept: list[tuple[Launch, InstanceRecord]],
        budget: float,
        why: str,
        errors: _Errors,
        by: str = "",
    ) -> list[tuple[Launch, InstanceRecord]]:
        """:meth:`_refused_now`'s refusal: each of ``refused``'s rows failed, with one
        ``launch_refused`` decision; ``kept`` is what goes."""
        refused_by = f"launch refused {by}".rstrip()
        # The rows and the decision in one transaction: a crash between them left rows failed
        # that no decision said.
        _moved, failed = self.store.transition_instances(
            app.name,
            [row.id for _, row in refused],
            _S.FAILED.value,
            reason=f"{refused_by}: {why}",
            said=[
                (
                    "launch_refused",
                    f"not launched: {', '.join(r.instance_type for _, r in refused)}: {why}",
                    {
                        "instance_ids": [r.id for _, r in refused],
                        "budget_usd_per_hr": budget,
                        "decided_budget_usd_per_hr": app.budget_usd_per_hr,
                    },
                )
            ],
        )
        for error in failed:
            errors.note(error)
        logger.warning("reconcile %s: %d launch(es) refused: %s", app.name, len(refused), why)
        return kept

    def _request_id_spent(
        self,
        app: AppRecord,
        launch: Launch,
        row: InstanceRecord,
        launched: Sequence[ProvisionedInstance],
        errors: _Errors,
    ) -> None:
        """The provider answered the launch with an instance of this request id that has ended
        (idempotency: it launches nothing new under an id it has seen): a database restored from
        a backup gives ids the provider has already used, or a launch whose answer was lost
        ended before it was asked again. The row fails now, and the next tick launches in its
        place under a new id (it was retried under the same id, in vain, until it became a
        straggler ten minutes later, its cost counted all the while)."""
        states = ", ".join(sorted({i.state for i in launched}))
        reason = (
            f"request id {launch.request_id} names an instance that has already ended ({states}:"
            " the provider launches nothing new under an id it has seen); launched again under"
            " a new id"
        )
        errors.append(f"launch {launch.request_id}: {reason}")
        # The row fails with the decision that says so, in one transaction: said first, a crash
        # between the two left the row to fail again after a restart, said a second time.
        said = (
            "launch_failed",
            f"launch of {launch.instance_type} ({launch.request_id}) failed: {reason}",
            {
                "request_id": launch.request_id,
                "instance_id": row.id,
                "instance_type": launch.instance_type,
                "error": "RequestIdSpent",
                "retryable": False,
            },
            f"{launch.request_id}:RequestIdSpent",
        )
        self._fail_said(app, row, reason, said, errors)

    def _note_stand_in(self, app: str, launch: Launch, row: InstanceRecord) -> None:
        """Rule 11's stand-in, as this process keeps it (its decision, :func:`_stand_in_said`,
        is what a process started again reads)."""
        stands_for = launch.stands_for or launch.instance_type
        if stands_for != launch.instance_type:
            self._stand_ins.setdefault(app, {})[row.id] = stands_for
            if launch.share < 1.0:
                self._stand_in_shares.setdefault(app, {})[row.id] = launch.share

    def _launch_failed(
        self,
        app: AppRecord,
        launch: Launch,
        row: InstanceRecord,
        error: ProvisionerError,
        errors: _Errors,
        prices: Mapping[str, float],
    ) -> None:
        """A launch the provider refused: retried next tick where that may work, else the row
        fails and the type is held back for ``launch_backoff_s``; a launch priced at spot that
        spot cannot supply (:class:`SpotUnavailableError`: no launch template, artifacts aboard,
        no spot capacity; the provider launched nothing rather than run it on demand over what
        the budget was told) holds the type's launches for the app on demand instead, priced and
        budgeted so (rule 10): the next tick launches it on demand where the budget pays."""
        kind = type(error).__name__
        errors.append(f"launch {launch.request_id}: {error}")
        numbers = {
            "request_id": launch.request_id,
            "instance_id": row.id,
            "instance_type": launch.instance_type,
            "error": kind,
            "retryable": error.retryable,
        }
        if isinstance(error, InsufficientCapacityError):
            with self._capacity_lock:
                self._capacity_missed_s.setdefault(
                    (app.name, launch.instance_type), self.clock.now_s()
                )
            # Its stand-ins stay for the back-off after the last miss (a return would miss too).
            self._capacity_missed_last_s[(app.name, launch.instance_type)] = self.clock.now_s()
        if error.retryable:
            # The row stays requested (its cost still counts) and is launched again next tick
            # with the same request id, until it works or becomes a straggler.
            # Once per request and error: a repeat (every tick, alternating with other failing
            # requests) counts on the same row.
            self.store.record_decision(
                app.name,
                "launch_failed",
                f"launch of {launch.instance_type} ({launch.request_id}) failed: {error};"
                " retried next tick",
                numbers,
                key=f"{launch.request_id}:{kind}",
            )
            return
        until_s = self.clock.now_s() + self.launch_backoff_s
        if isinstance(error, SpotUnavailableError):
            self._spot_on_demand_until_s[(app.name, launch.instance_type)] = until_s
            on_demand = prices.get(launch.instance_type)
            price = "" if on_demand is None else f" at {plain(on_demand)} USD/hr"
            then = (
                f"launched on demand{price} for {self.launch_backoff_s:g} s where the budget"
                " pays for it"
            )
            held = {"on_demand_s": self.launch_backoff_s}
        else:
            self._held_until_s[(app.name, launch.instance_type)] = until_s
            then = f"{launch.instance_type} not launched again for {self.launch_backoff_s:g} s"
            held = {"held_s": self.launch_backoff_s}
        # The row fails with the decision that says so, in one transaction (as above).
        said = (
            "launch_failed",
            f"launch of {launch.instance_type} ({launch.request_id}) failed: {error}; {then}",
            {**numbers, **held},
            f"{launch.request_id}:{kind}",
        )
        self._fail_said(app, row, f"launch refused: {error}", said, errors)

    def _fail_said(
        self, app: AppRecord, row: InstanceRecord, reason: str, said: Keyed, errors: _Errors
    ) -> None:
        """The launch's row fails with the keyed decision ``said`` in one transaction; where
        another writer ended the row meanwhile (an app taken down), the failure is still said,
        alone. Any other error of the move (the database's) says nothing: the row is still
        requested, launched again next tick and its failure said then, with its move (said
        alone now as well, it counted 2)."""
        try:
            self.store.transition_instance(row.id, _S.FAILED.value, reason=reason, keyed=said)
        except InvalidTransitionError as error:
            errors.note(error)
            kind, text, numbers, key = said
            self.store.record_decision(app.name, kind, text, numbers, key=key)
        except ControlPlaneError as error:
            errors.note(error)

    def _terminate_strays(self, strays: Sequence[ProvisionedInstance]) -> list[str]:
        """Managed instances whose app tag names no app (a forced delete left them): they belong
        to nothing we run, so they are terminated (there is no app to record them under)."""
        if not strays:
            return []
        for instance in strays:
            logger.warning(
                "reconcile: %s (%s) is tagged for app %r, which does not exist; terminating",
                instance.provider_id,
                instance.instance_type,
                instance.tags.get(APP_TAG),
            )
        errors = _Errors()
        self._provider_terminate("-", [i.provider_id for i in strays], errors)
        return list(errors)

    # --- helpers -------------------------------------------------------------------------------

    def _unhealthy(
        self, rows: Sequence[InstanceRecord], observed: Sequence[ProvisionedInstance]
    ) -> set[str]:
        """Provider ids the provider calls running whose rows wait to be running and whose
        worker does not answer the probe yet."""
        if self.probe is None:
            return set()
        running = {r.provider_id for r in rows if r.state == _S.RUNNING}
        unhealthy: set[str] = set()
        for instance in observed:
            if instance.state != "running" or instance.provider_id in running:
                continue
            try:
                healthy = self.probe(instance)
            except Exception:  # a probe is I/O: any failure means not healthy yet
                logger.debug("probe of %s failed", instance.provider_id, exc_info=True)
                healthy = False
            if not healthy:
                unhealthy.add(instance.provider_id)
        return unhealthy

    def _deferral_key(self, app: str, cause: str) -> str:
        """The decision key of ``app``'s drain deferral for ``cause`` in this pass: the cause
        and the time its episode began (the pass before deferred for it too, or it begins now)."""
        known = self._deferrals.get((app, cause))
        began = self.clock.utcnow() if known is None or known[1] < self._passes - 1 else known[0]
        self._deferrals[(app, cause)] = (began, self._passes)
        return f"{cause}:{began.strftime('%Y%m%dT%H%M%S.%f')}"

    def _record_once(self, app: str, kind: str, reason: str, numbers: Mapping[str, Any]) -> None:
        """Record a decision unless the app's last decision of ``kind`` had the same numbers: a
        state that lasts (a budget cap, a plan that cannot be launched) is one decision, not one
        per tick."""
        last = self.store.list_decisions(app, kinds=[kind], limit=1)
        if last and last[0].numbers == dict(numbers):
            return
        self.store.record_decision(app, kind, reason, numbers)

    def _report_unmanaged(self, instance: ProvisionedInstance) -> None:
        if instance.provider_id in self._reported:
            return
        self._reported.add(instance.provider_id)
        logger.warning(
            "reconcile: the provider listed %s (%s) without the managed tag; left alone",
            instance.provider_id,
            instance.instance_type,
        )

    def _log_events(self) -> None:
        try:
            events = self.provisioner.poll_events()
        except ProvisionerError as error:
            logger.warning("reconcile: cannot poll provider events (%s)", error)
            return
        for event in events:
            level = logging.INFO if event.kind == "info" else logging.WARNING
            logger.log(level, "provider %s event: %s", event.kind, event.message)


def _stand_in_said(launch: Launch, row: InstanceRecord) -> Words:
    """Rule 11's decision: what launches for a type the provider is short of, and why."""
    stands_for = launch.stands_for or launch.instance_type
    return [
        (
            "stand_in",
            f"{launch.instance_type} ({launch.market}) launched for {stands_for}: {launch.reason}",
            {
                "instance_id": row.id,
                "request_id": launch.request_id,
                "instance_type": launch.instance_type,
                "stands_for": stands_for,
                "share": launch.share,
                "market": launch.market,
                "price_usd_per_hr": launch.price_usd_per_hr,
            },
        )
    ]


class _Errors(list[str]):
    """What went wrong carrying out a tick's actions (each is logged; the tick goes on)."""

    def guard(self, call: Callable[[], InstanceRecord]) -> InstanceRecord | None:
        """Run a store write; a conflict (the row moved meanwhile) is noted, not raised. A row
        another writer ended meanwhile (a profile run over, an app taken down: it is
        ``terminating`` or ended now) is no error: there is nothing left to move."""
        try:
            return call()
        except ControlPlaneError as error:
            self.note(error)
            return None

    def note(self, error: ControlPlaneError) -> None:
        """A store write's error, as :meth:`guard` takes it."""
        if isinstance(error, InvalidTransitionError):
            # Only a move to running (a worker found up): a launched machine's row ended
            # meanwhile (requested -> pending refused) is still said; the orphan sweep ends it.
            if error.from_state not in _ENDING or error.to_state != _S.RUNNING.value:
                logger.warning("reconcile: %s", error)
                self.append(str(error))
            else:
                logger.debug("reconcile: ended meanwhile: %s", error)
            return
        logger.warning("reconcile: %s", error)
        self.append(str(error))
