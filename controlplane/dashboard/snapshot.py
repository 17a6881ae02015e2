"""The dashboard's snapshot: one JSON document holding everything its panels draw for one app.

:func:`build_snapshot` reads the store (metric samples, instances and their lifecycle events,
decisions, budget changes, the applied plan) over a window ending now and shapes it for the
page's charts. Every series is a list of epoch seconds ``t`` with parallel value lists (``None``
where a value is unknown, so that a chart breaks its line there). The sections:

- ``fleet``: the live instances by type over the window (a step function rebuilt from the
  instance events: the state of each instance at the window's start, then every move), and the
  instance table (live ones first, then those that ended within the window);
- ``cost``: the fleet cost of each metric sample (the burn rate) against the budget (a step
  function of the budget's audit trail); the spend since midnight UTC (the samples' fleet cost
  integrated over time, :class:`SpendLedger`), and the forecast for the day,
  spend + burn rate x hours left until midnight;
- ``load``: the arrival rate against the provisioned capacity (the applied plan's throughput
  scaled by how much of the plan's fleet is running, :func:`capacity_scale`), the planned rate,
  and the plan's arrival envelope when it carries one;
- ``latency``: P50/P95/P99 against the SLO and the plan's predicted end-to-end P99, and the
  share of queries within the SLO (attainment). Latencies run from the API's receipt of each
  request; the percentiles are over the answered queries, the attainment over every query that
  ended, refused (429, 503), timed-out (504) and failed (502) ones as misses. The tiles read the
  newest window in which queries ended: when every query of it failed, its attainment is 0 and
  its P99 unknown (``answered_none``), never an older window's figure; ``slo_met`` says whether
  that window's attainment reaches the SLO's percentile. With a :data:`ServingFn`, ``outcomes``
  is what the serving loop counted since the service started: queries by outcome and the
  answered ones' mean time by stage (queue, transport, compute);
- ``cascade``: the gear and the accuracy over time, against the accuracy floor; the accuracy
  the plan's gear plan scored each gear's cascade at (``planned_accuracy``, held out and
  in-sample) and the held-out figure of the gear in force (``held_out_accuracy``);
- ``decisions``: the newest decisions first (what the policies did, why, and the numbers), a run
  of consecutive decisions of one kind folded into one entry (:func:`collapse_runs`);
- ``rollout``: the app's active rollout, else its latest (None without one), as the API shows
  it (docs/rollouts.md): state, step and share, reason, the figures per version as last judged;
- ``plan``: the applied plan (or the newest preview): the rate it is planned for, its predicted
  end-to-end P99, its stages, its steps and the Kairos bound ranking that explains the chosen mix
  (:mod:`controlplane.dashboard.ranking`).

An instance's utilisation and the INFaaS state of each model on it come from the serving loop
(a :data:`WorkersFn`: what its dispatcher last measured of each running worker). Fields that
other parts of the service add over time (latencies, gears, those measurements, a plan's
envelope) are read defensively: a missing one is ``None`` and the panel says what it is
waiting for.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.apps.rollouts import rollout_document
from controlplane.db.store import (
    AppRecord,
    BudgetChangeRecord,
    DecisionRecord,
    InstanceEventRecord,
    InstanceRecord,
    MetricSampleRecord,
    PlanRecord,
    Store,
)
from controlplane.policies.lifecycle import LIVE_STATES, InstanceState, billed_cost_usd_per_hr
from controlplane.policies.plan import PlanDocument, PlanError
from controlplane.policies.rollout_states import decision_subject
from controlplane.serving.observations import AppTotals

logger = logging.getLogger(__name__)

__all__ = [
    "DECISIONS_READ",
    "DECISIONS_SHOWN",
    "DEFAULT_WINDOW_S",
    "MAX_POINTS",
    "MAX_WINDOW_S",
    "MIN_WINDOW_S",
    "FleetSeries",
    "RankingFn",
    "ServingFn",
    "SpendLedger",
    "StageRatesFn",
    "WorkersFn",
    "build_snapshot",
    "capacity_scale",
    "collapse_runs",
    "fleet_capacity_qps",
    "fleet_series",
    "integrate_cost_usd",
]

# The charts' default span: half an hour reads well at 2 s polls and 10 s roll-ups.
DEFAULT_WINDOW_S = 1800.0
# The shortest span the charts show (a young app's window starts at its registration).
MIN_SPAN_S = 300.0
MIN_WINDOW_S = 60.0
# The longest span a chart shows (the forecast and the spend are per day anyway).
MAX_WINDOW_S = 86_400.0
# A chart is about 400 px wide: more points than this are thinned before they are sent.
MAX_POINTS = 600
# Samples read for one window: a day at the default 10 s roll-up is 8,640.
_MAX_SAMPLES = 10_000
DECISIONS_SHOWN = 50
# Decisions read for them: runs of one kind are folded into one entry (:func:`collapse_runs`).
DECISIONS_READ = 1000
# Ended instances listed under the live ones in the table (the newest first).
ENDED_SHOWN = 20
_LIVE = frozenset(state.value for state in LIVE_STATES)
_RUNNING = InstanceState.RUNNING.value
_HOUR_S = 3600.0

RankingFn = Callable[[AppRecord, PlanRecord], dict[str, Any] | None]
# Per stage of the plan, mu_t: the queries per second one instance of each type serves of the
# stage's model, as the tuner rates it (``controlplane.loops.live_tuner.stage_rates_qps``);
# None when the app's profiles cannot be read.
StageRatesFn = Callable[[AppRecord, PlanDocument], Sequence[Mapping[str, float]] | None]
# Per instance id, what the serving loop measures of a worker: ``utilisation_share`` (its busy
# share of about the last minute) and ``models`` (model -> INFaaS state on it).
WorkersFn = Callable[[AppRecord], Mapping[str, Mapping[str, Any]]]
# The serving loop's counters of an app since the service started (None: it serves no such app).
ServingFn = Callable[[AppRecord], AppTotals | None]


def _epoch_s(at: datetime) -> float:
    return round(at.timestamp(), 3)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (JSON has no NaN)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _clean(value: Any) -> Any:
    """A JSON-safe copy of a stored document: non-finite floats become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _thin(items: Sequence[Any], limit: int = MAX_POINTS) -> list[Any]:
    """Every k-th item so that at most ``limit`` remain, the newest always kept."""
    if len(items) <= limit:
        return list(items)
    stride = math.ceil(len(items) / limit)
    kept = list(items[::-1][::stride])
    kept.reverse()
    return kept


def _day_start(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


# --- the fleet over time ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetSeries:
    """Instances by type over time, as a step function: ``live[type][i]`` instances of the type
    were live (requested to draining) from ``t_s[i]`` until ``t_s[i + 1]``; ``running`` counts
    those serving."""

    t_s: list[float]
    live: dict[str, list[int]]
    running: dict[str, list[int]]


def fleet_series(
    instances: Iterable[InstanceRecord],
    events: Iterable[InstanceEventRecord],
    start: datetime,
    now: datetime,
) -> FleetSeries:
    """The fleet by type from ``start`` to ``now``, from the instances and their events since
    ``start``: an instance's state at ``start`` is the state its first event in the window moved
    it from (none: it was recorded in the window), or its current state when it did not move in
    the window."""
    by_id = {i.id: i for i in instances}
    moves: dict[str, list[InstanceEventRecord]] = defaultdict(list)
    for event in events:
        if event.instance_id in by_id and event.at > start:
            moves[event.instance_id].append(event)
    state: dict[str, str | None] = {}
    for instance_id, instance in by_id.items():
        own = moves.get(instance_id)
        if own:
            own.sort(key=lambda e: (e.at, e.id))
            state[instance_id] = own[0].from_state
        else:
            state[instance_id] = instance.state if instance.created_at <= start else None
    types = sorted({i.instance_type for i in by_id.values()})
    t_s: list[float] = []
    live: dict[str, list[int]] = {t: [] for t in types}
    running: dict[str, list[int]] = {t: [] for t in types}

    def record(at: datetime) -> None:
        counts_live = dict.fromkeys(types, 0)
        counts_running = dict.fromkeys(types, 0)
        for instance_id, current in state.items():
            if current in _LIVE:
                kind = by_id[instance_id].instance_type
                counts_live[kind] += 1
                if current == _RUNNING:
                    counts_running[kind] += 1
        stamp = _epoch_s(at)
        if t_s and t_s[-1] == stamp:
            for t in types:
                live[t][-1] = counts_live[t]
                running[t][-1] = counts_running[t]
            return
        t_s.append(stamp)
        for t in types:
            live[t].append(counts_live[t])
            running[t].append(counts_running[t])

    record(start)
    ordered = sorted((e for own in moves.values() for e in own), key=lambda e: (e.at, e.id))
    for event in ordered:
        if event.at > now:
            break
        state[event.instance_id] = event.to_state
        record(event.at)
    record(now)
    # Types that had no live instance in the window take no room in the chart.
    shown = [t for t in types if any(live[t])]
    return FleetSeries(t_s, {t: live[t] for t in shown}, {t: running[t] for t in shown})


# --- cost ------------------------------------------------------------------------------------


def integrate_cost_usd(
    samples: Sequence[MetricSampleRecord],
    start: datetime,
    end: datetime,
    cost_before_usd_per_hr: float | None = None,
) -> float:
    """USD spent from ``start`` to ``end``: each sample's fleet cost (USD/hr) holds until the next
    sample (the last one until ``end``); before the first sample, ``cost_before_usd_per_hr`` (the
    cost of the newest sample before ``start``) when known, else nothing.

    >>> from datetime import timedelta
    >>> t0 = datetime(2024, 1, 1, tzinfo=UTC)
    >>> s = [_sample(t0 + timedelta(hours=1), 2.0), _sample(t0 + timedelta(hours=2), 4.0)]
    >>> integrate_cost_usd(s, t0, t0 + timedelta(hours=3))
    6.0
    >>> integrate_cost_usd(s, t0, t0 + timedelta(hours=3), cost_before_usd_per_hr=1.0)
    7.0
    """
    total = 0.0
    at, cost = start, cost_before_usd_per_hr
    for sample in samples:
        if sample.at <= start:
            cost = sample.fleet_cost_usd_per_hr
            continue
        moment = min(sample.at, end)
        if cost is not None and moment > at:
            total += cost * (moment - at).total_seconds() / _HOUR_S
        at, cost = moment, sample.fleet_cost_usd_per_hr
        if sample.at >= end:
            return total
    if cost is not None and end > at:
        total += cost * (end - at).total_seconds() / _HOUR_S
    return total


def _sample(at: datetime, cost: float) -> MetricSampleRecord:
    """A sample with only a time and a fleet cost (for the doctest)."""
    return MetricSampleRecord("x", at, 0.0, None, None, None, None, cost, None, None)


@dataclass(slots=True)
class _Spent:
    day: datetime
    through: datetime | None  # the newest sample integrated so far
    cost_usd_per_hr: float | None  # that sample's fleet cost
    spent_usd: float  # from the day's start to ``through``


@dataclass
class SpendLedger:
    """The spend since midnight UTC per app, integrated incrementally: each call reads only the
    samples recorded since the one before (a day of 10 s samples is read once, not every 2 s).
    Samples are taken to arrive in time order, as the roll-up writes them: one written later
    with an earlier time than those already integrated is not counted until the next day (or
    the next start of the service)."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _apps: dict[int, _Spent] = field(default_factory=dict)

    def spent_today_usd(self, store: Store, app: AppRecord, now: datetime) -> float:
        """USD spent by ``app``'s fleet from midnight UTC to ``now``."""
        day = _day_start(now)
        with self._lock:
            entry = self._apps.get(app.id)
            if entry is None or entry.day != day:
                before = store.metric_series(app.name, until=day, limit=1)
                cost = before[-1].fleet_cost_usd_per_hr if before else None
                entry = _Spent(day, None, cost, 0.0)
                self._apps[app.id] = entry
            since = entry.through if entry.through is not None else day
            fresh = store.metric_series(app.name, since=since, until=now)
            if fresh:
                entry.spent_usd += integrate_cost_usd(
                    fresh, since, fresh[-1].at, entry.cost_usd_per_hr
                )
                entry.through = fresh[-1].at
                entry.cost_usd_per_hr = fresh[-1].fleet_cost_usd_per_hr
            tail = integrate_cost_usd([], entry.through or day, now, entry.cost_usd_per_hr)
            return entry.spent_usd + tail


def _budget_steps(
    changes: Sequence[BudgetChangeRecord], start: datetime, now: datetime, current: float
) -> dict[str, list[Any]]:
    """The budget from ``start`` to ``now`` as a step function."""
    t_s: list[float] = []
    usd: list[float] = []
    at_start = None
    for change in changes:
        if change.at <= start:
            at_start = change.new_usd_per_hr
        elif change.at <= now:
            t_s.append(_epoch_s(change.at))
            usd.append(change.new_usd_per_hr)
    first = at_start if at_start is not None else (usd[0] if usd else current)
    return {
        "t": [_epoch_s(start), *t_s, _epoch_s(now)],
        "usd_per_hr": [first, *usd, current],
    }


# --- capacity --------------------------------------------------------------------------------


def _plan_capacity_qps(plan: PlanDocument) -> float | None:
    """The rate the plan's fleet serves at its front: min over stages of throughput / s_m (the
    share of queries that reach the stage)."""
    rates = [
        s.throughput_qps / s.scale_factor if s.scale_factor else s.throughput_qps
        for s in plan.stages
    ]
    return min(rates) if rates else None


def _typed(plan: PlanRecord | None) -> PlanDocument | None:
    """The record's plan, typed; ``None`` (logged) for a document that is not a plan."""
    if plan is None:
        return None
    try:
        return plan.plan
    except PlanError as error:
        logger.warning("dashboard: plan %s is not readable: %s", plan.id, error)
        return None


def fleet_capacity_qps(
    running: Mapping[str, int], plan: PlanDocument, rates: Sequence[Mapping[str, float]]
) -> float:
    """The rate the ``running`` fleet (counts by type) serves at the front, on the tuner's
    per-instance rates: min over stages of sum_t n_{s,t} mu_{s,t} / s_s (the share of queries
    that reach the stage), each type's running instances shared among the stages as the plan
    shares them (a type the plan has none of, as the plan shares its instances). On the planned
    fleet, the tuner's capacity of the plan.

    >>> plan = PlanDocument.parse({"feasible": True, "cost_usd_per_hr": 1.0,
    ...     "rate_qps": 10.0, "stages": [
    ...         {"name": "a", "fleet": {"g": 2}, "batch_size": 1, "scale_factor": 1.0},
    ...         {"name": "b", "fleet": {"g": 1, "h": 1}, "batch_size": 1, "scale_factor": 0.5}]})
    >>> fleet_capacity_qps({"g": 3, "h": 1}, plan, [{"g": 100.0}, {"g": 10.0, "h": 20.0}])
    60.0
    >>> fleet_capacity_qps({"g": 6, "h": 1}, plan, [{"g": 100.0}, {"g": 10.0, "h": 20.0}])
    80.0
    """
    shared: dict[str, int] = defaultdict(int)
    for stage in plan.stages:
        for t, n in stage.fleet.items():
            shared[t] += max(0, n)
    planned = sum(shared.values())
    fronts = []
    for stage, mu in zip(plan.stages, rates, strict=False):
        own = sum(max(0, n) for n in stage.fleet.values())
        served = 0.0
        for t, count in running.items():
            if count > 0 and t in mu:
                share = stage.fleet.get(t, 0) / shared[t] if shared.get(t) else own / planned
                served += mu[t] * count * share
        fronts.append(served / stage.scale_factor if stage.scale_factor else served)
    return min(fronts) if fronts else 0.0


def capacity_scale(
    running: Mapping[str, int], planned: Mapping[str, int], weights: Mapping[str, float] | None
) -> float:
    """How much of the planned fleet's capacity the ``running`` fleet has: the sum of Q_t (one
    instance's rate, ``weights``) over the running instances over the same sum over the planned
    ones; instance counts when the rates are unknown (a type without a rate weighs the mean).

    >>> capacity_scale({"a": 1, "b": 2}, {"a": 2}, {"a": 10.0, "b": 5.0})
    1.0
    >>> capacity_scale({"a": 1}, {"a": 2, "b": 2}, None)
    0.25
    """
    known = [w for w in (weights or {}).values() if math.isfinite(w) and w > 0]
    default = sum(known) / len(known) if known else 1.0

    def weight(name: str) -> float:
        value = (weights or {}).get(name)
        return value if value is not None and math.isfinite(value) and value > 0 else default

    total = sum(weight(t) * n for t, n in planned.items())
    if total <= 0:
        return 0.0
    return sum(weight(t) * n for t, n in running.items()) / total


# --- the sections ----------------------------------------------------------------------------


def _instance_row(
    instance: InstanceRecord,
    ended_at: datetime | None,
    now: datetime,
    measured: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    until = ended_at if ended_at is not None else now
    measured = measured or {}
    return {
        "id": instance.id,
        "provider_id": instance.provider_id,
        "instance_type": instance.instance_type,
        "state": instance.state,
        "live": instance.state in _LIVE,
        "price_usd_per_hr": instance.cost_usd_per_hr,  # now: a spot one's moved price
        "created_at": instance.created_at.isoformat(),
        "uptime_s": max(0.0, (until - instance.created_at).total_seconds()),
        # What the serving loop measures of a live worker (None for others).
        "utilisation_share": _finite(measured.get("utilisation_share")),
        "models": _clean(measured.get("models")) or None,
    }


def _fleet_section(
    store: Store,
    app: AppRecord,
    start: datetime,
    now: datetime,
    measured: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, Any], FleetSeries, list[InstanceRecord]]:
    # The live ones and those that ended in the view: an instance that ended before it shows
    # in no series, and a fleet that has cycled for weeks has thousands.
    instances = store.list_instances(app.name, ended_after=start)
    events = store.list_instance_events(app=app.name, since=start)
    series = fleet_series(instances, events, start, now)
    live = [i for i in instances if i.state in _LIVE]
    ended = sorted(
        (i for i in instances if i.state not in _LIVE and i.updated_at > start),
        key=lambda i: i.updated_at,
        reverse=True,
    )[:ENDED_SHOWN]
    by_type: dict[str, dict[str, Any]] = {}
    for instance in live:
        row = by_type.setdefault(
            instance.instance_type, {"count": 0, "running": 0, "cost_usd_per_hr": 0.0}
        )
        row["count"] += 1
        row["running"] += instance.state == _RUNNING
        row["cost_usd_per_hr"] += instance.cost_usd_per_hr
    section = {
        "series": {"t": series.t_s, "by_type": series.live},
        "now": {
            "instances": len(live),
            "running": sum(i.state == _RUNNING for i in live),
            "by_type": dict(sorted(by_type.items())),
        },
        "instances": [_instance_row(i, None, now, measured.get(i.id)) for i in live]
        + [_instance_row(i, i.updated_at, now) for i in ended],
    }
    return section, series, live


def _cost_section(
    store: Store,
    app: AppRecord,
    samples: Sequence[MetricSampleRecord],
    live: Sequence[InstanceRecord],
    ledger: SpendLedger,
    start: datetime,
    now: datetime,
) -> dict[str, Any]:
    burn = billed_cost_usd_per_hr(live)
    spent = ledger.spent_today_usd(store, app, now)
    day_end = _day_start(now) + timedelta(days=1)
    hours_left = (day_end - now).total_seconds() / _HOUR_S
    changes = store.list_budget_changes(app.name, limit=200)
    return {
        "burn_usd_per_hr": burn,
        "budget_usd_per_hr": app.budget_usd_per_hr,
        "spent_today_usd": spent,
        "hours_left_today": hours_left,
        "forecast_today_usd": spent + burn * hours_left,
        "budget_today_usd": app.budget_usd_per_hr * 24.0,
        "series": {
            "t": [_epoch_s(s.at) for s in samples],
            "fleet_cost_usd_per_hr": [s.fleet_cost_usd_per_hr for s in samples],
        },
        "budget": _budget_steps(changes, start, now, app.budget_usd_per_hr),
    }


def _envelope(plan: PlanDocument | None) -> dict[str, Any] | None:
    """The plan's planned arrival envelope (rate per window), when it carries one."""
    if plan is None or not plan.envelope_windows_s:
        return None
    return {"windows_s": list(plan.envelope_windows_s), "rate_qps": list(plan.envelope_rate_qps)}


def _live_envelope(
    samples: Sequence[MetricSampleRecord], windows_s: Sequence[float]
) -> list[float | None]:
    """The highest mean arrival rate over any run of samples spanning each window (the samples
    are roll-ups, so a window shorter than their spacing reads as the highest sample)."""
    out: list[float | None] = []
    times = [s.at.timestamp() for s in samples]
    rates = [s.arrival_rate_qps for s in samples]
    for window in windows_s:
        best: float | None = None
        lo = 0
        total = 0.0
        for hi, rate in enumerate(rates):
            total += rate
            while times[hi] - times[lo] > window and lo < hi:
                total -= rates[lo]
                lo += 1
            mean = total / (hi - lo + 1)
            best = mean if best is None else max(best, mean)
        out.append(best)
    return out


def _load_section(
    samples: Sequence[MetricSampleRecord],
    series: FleetSeries,
    document: PlanDocument | None,
    rates: Sequence[Mapping[str, float]] | None,
) -> dict[str, Any]:
    """The capacity is the tuner's (:func:`fleet_capacity_qps`) on its per-instance rates;
    without them, the plan's throughput scaled by the share of the planned fleet running."""
    planned_fleet = document.fleet if document else {}
    if document is not None and rates is not None:
        planned_capacity: float | None = fleet_capacity_qps(planned_fleet, document, rates)
    else:
        planned_capacity = _plan_capacity_qps(document) if document else None
    capacity: list[float | None] = []
    for i in range(len(series.t_s)):
        running = {t: counts[i] for t, counts in series.running.items()}
        if planned_capacity is None or not planned_fleet or document is None:
            capacity.append(None)
        elif rates is not None:
            capacity.append(fleet_capacity_qps(running, document, rates))
        else:
            capacity.append(planned_capacity * capacity_scale(running, planned_fleet, None))
    envelope = _envelope(document)
    if envelope is not None:
        envelope["live_rate_qps"] = _live_envelope(samples, envelope["windows_s"])
    arrivals = [s.arrival_rate_qps for s in samples]
    return {
        "series": {"t": [_epoch_s(s.at) for s in samples], "arrival_rate_qps": arrivals},
        "capacity": {"t": series.t_s, "capacity_qps": capacity},
        "capacity_qps": capacity[-1] if capacity else None,
        "planned_capacity_qps": planned_capacity,
        "planned_rate_qps": _finite(document.planned_rate_qps) if document else None,
        "arrival_rate_qps": arrivals[-1] if arrivals else None,
        "has_traffic": any(rate > 0 for rate in arrivals),
        "envelope": envelope,
    }


def _newest(values: Sequence[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


def _slo(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    slo = spec.get("slo")
    return slo if isinstance(slo, Mapping) else {}


def _outcomes(totals: AppTotals | None) -> dict[str, Any] | None:
    if totals is None:
        return None
    return {
        "offered": totals.offered,
        "answered": totals.answered,
        "within_slo": totals.within,
        "late": totals.late,
        "refused": totals.refused,
        "timed_out": totals.timed_out,
        "failed": totals.failed,
        "errors": totals.errors,
        "attainment_share": totals.attainment_share,
        "mean_ms": {
            stage: totals.mean_ms(stage) for stage in ("queue", "transport", "compute", "total")
        },
    }


def _latency_section(
    spec: Mapping[str, Any],
    samples: Sequence[MetricSampleRecord],
    document: PlanDocument | None,
    totals: AppTotals | None = None,
) -> dict[str, Any]:
    slo = _slo(spec)
    percentile = _finite(slo.get("percentile")) or 99.0
    p50 = [s.latency_p50_ms for s in samples]
    p95 = [s.latency_p95_ms for s in samples]
    p99 = [s.latency_p99_ms for s in samples]
    attainment = [s.attainment_share for s in samples]
    weighted = [
        (s.attainment_share, s.arrival_rate_qps)
        for s in samples
        if s.attainment_share is not None and s.arrival_rate_qps > 0
    ]
    total = sum(w for _, w in weighted)
    window_share = sum(a * w for a, w in weighted) / total if total > 0 else _newest(attainment)
    # The newest window in which queries ended (its attainment is known, errors included): its
    # P99 is None when none of them was answered, and an older window's must not stand in.
    ended = [s for s in samples if s.attainment_share is not None]
    newest = ended[-1] if ended else None
    if newest is not None:
        p50_now, p99_now = newest.latency_p50_ms, newest.latency_p99_ms
        share_now: float | None = newest.attainment_share
    else:
        p50_now, p99_now, share_now = _newest(p50), _newest(p99), None
    return {
        "slo_ms": _finite(slo.get("latency_ms")),
        "percentile": percentile,
        # The plan's end-to-end prediction, a reference beside the SLO (None: no plan, no stages,
        # or a plan made before plans carried it).
        "predicted_p99_ms": _finite(document.predicted_p99_ms) if document else None,
        "series": {
            "t": [_epoch_s(s.at) for s in samples],
            "p50_ms": p50,
            "p95_ms": p95,
            "p99_ms": p99,
            "attainment_share": attainment,
        },
        "p50_ms": p50_now,
        "p99_ms": p99_now,
        "attainment_share": share_now,
        "window_attainment_share": window_share,
        "answered_none": newest is not None and p99_now is None,
        "slo_met": None if share_now is None else share_now >= percentile / 100.0,
        "has_data": any(v is not None for v in (*p50, *p99, *attainment)),
        "outcomes": _outcomes(totals),
    }


def _planned_accuracy(plan: PlanDocument | None) -> dict[str, dict[str, float | None]]:
    """Per cascade label of the plan's gear plan, its accuracy as the planner scored it: held out
    (on validation samples its thresholds were not chosen on; None when the plan was scored
    in-sample only) and in-sample."""
    gear_plan = plan.gear_plan if plan is not None else None
    options = gear_plan.get("options") if gear_plan is not None else None
    found: dict[str, dict[str, float | None]] = {}
    for option in options if isinstance(options, list) else []:
        if isinstance(option, Mapping) and isinstance(option.get("label"), str):
            found[option["label"]] = {
                "held_out": _finite(option.get("held_out_accuracy")),
                "in_sample": _finite(option.get("accuracy")),
            }
    return found


def _cascade_section(
    spec: Mapping[str, Any], samples: Sequence[MetricSampleRecord], plan: PlanDocument | None
) -> dict[str, Any]:
    slo = _slo(spec)
    gears = [s.gear for s in samples]
    accuracy = [s.accuracy for s in samples]
    seen: list[str] = []
    for gear in gears:
        if gear is not None and gear not in seen:
            seen.append(gear)
    cascade = spec.get("cascade")
    planned = _planned_accuracy(plan)
    gear = next((g for g in reversed(gears) if g is not None), None)
    return {
        "cascade": list(cascade) if isinstance(cascade, list) else None,
        "planned_accuracy": planned,
        "held_out_accuracy": planned.get(gear, {}).get("held_out") if gear else None,
        "accuracy_floor": _finite(slo.get("accuracy")),
        "series": {"t": [_epoch_s(s.at) for s in samples], "gear": gears, "accuracy": accuracy},
        "gears": seen,
        "gear": gear,
        "accuracy": _newest(accuracy),
        "has_data": bool(seen) or any(a is not None for a in accuracy),
    }


def _subject_of(decision: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a decision is about, where its numbers say: its stage (``stage``: a cascade's tuner
    decides per model) and its rollout's subject
    (:func:`~controlplane.policies.rollout_states.decision_subject`, as ``heteroplane events`` folds
    it); Nones else."""
    numbers = decision.get("numbers")
    if not isinstance(numbers, Mapping):
        return (None, None)
    return (numbers.get("stage"), decision_subject(numbers, decision.get("reason")))


def collapse_runs(decisions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive decisions of one kind, and of one rollout's state and step where they are a
    rollout's waits (each of its moves its own entry: :func:`_subject_of`) and of one stage
    where they are a cascade's tuner's (newest first, as :func:`_decision` shapes them)
    as one
    entry, so that a burst of gear switches does not hide the scaling decisions around it: the
    newest one's id, reason and numbers, ``run`` (how many decisions), ``count`` (how many times
    they were made, together), ``at``/``t`` the oldest's time and ``last_at``/``last_t`` the
    newest time (None when the entry is one decision made once).

    >>> d = lambda i, kind, t: {"id": i, "kind": kind, "t": t, "at": str(t), "count": 1,
    ...     "last_t": None, "last_at": None, "reason": kind + str(i)}
    >>> runs = collapse_runs([d(4, "gear_switch", 40), d(3, "gear_switch", 30),
    ...     d(2, "scale_up", 20), d(1, "gear_switch", 10)])
    >>> for r in runs:
    ...     print(r["id"], r["kind"], r["run"], r["count"], r["t"], r["last_t"])
    4 gear_switch 2 2 30 40
    2 scale_up 1 1 20 None
    1 gear_switch 1 1 10 None
    >>> made_again = {**d(7, "budget_capped", 70), "last_t": 95, "last_at": "95"}
    >>> [(e["run"], e["t"], e["last_t"]) for e in collapse_runs([
    ...     {**d(8, "budget_capped", 80), "last_t": 90, "last_at": "90"}, made_again])]
    [(2, 70, 95)]
    >>> r = lambda i, rollout: {**d(i, "rollout", i), "numbers": {"rollout_id": rollout}}
    >>> [(e["id"], e["run"]) for e in collapse_runs([r(3, 2), r(2, 1), r(1, 1)])]
    [(3, 1), (2, 2)]

    A cascade's tuner caps two stages in the same tick: two entries, not one run showing the
    last stage's numbers.

    >>> s = lambda i, stage: {**d(i, "budget_capped", i), "numbers": {"stage": stage}}
    >>> capped = [s(4, "large"), s(3, "medium"), s(2, "medium")]
    >>> [(e["id"], e["run"]) for e in collapse_runs(capped)]
    [(4, 1), (3, 2)]
    """
    entries: list[dict[str, Any]] = []
    for decision in decisions:
        last = entries[-1] if entries else None
        if (
            last is None
            or last["kind"] != decision["kind"]
            or _subject_of(last) != _subject_of(decision)
        ):
            entries.append({**decision, "run": 1})
            continue
        # The newest time over the whole run, not its newest member's: a decision made again is
        # merged into its own (older) row, so an older member may have been made last.
        newest_t, newest_at = max(_made_last(last), _made_last(decision))
        last.update(
            run=last["run"] + 1,
            count=last["count"] + decision["count"],
            t=decision["t"],
            at=decision["at"],
            last_t=newest_t,
            last_at=newest_at,
        )
    return entries


def _made_last(decision: Mapping[str, Any]) -> tuple[float, str]:
    """When a decision (or a run of them) was last made: its ``last_t``/``last_at``, else its
    ``t``/``at``."""
    if decision["last_t"] is not None:
        return decision["last_t"], decision["last_at"]
    return decision["t"], decision["at"]


def _decision(record: DecisionRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "at": record.at.isoformat(),
        "t": _epoch_s(record.at),
        "kind": record.kind,
        "reason": record.reason,
        "numbers": _clean(record.numbers),
        # A repeated decision: how many times, and the last (None: made once).
        "count": record.count,
        "last_at": None if record.last_at is None else record.last_at.isoformat(),
        "last_t": None if record.last_at is None else _epoch_s(record.last_at),
    }


def _plan_section(
    app: AppRecord,
    plan: PlanRecord | None,
    document: PlanDocument | None,
    ranking: RankingFn | None,
) -> dict[str, Any] | None:
    if plan is None or document is None:
        return None
    return {
        "id": plan.id,
        "number": plan.number,
        "status": plan.status,
        "created_at": plan.created_at.isoformat(),
        "applied_at": plan.applied_at.isoformat() if plan.applied_at else None,
        "feasible": document.feasible,
        "cost_usd_per_hr": _finite(document.cost_usd_per_hr),
        "rate_qps": _finite(document.rate_qps),
        "planned_rate_qps": _finite(document.rate_qps),
        "predicted_p99_ms": _finite(document.predicted_p99_ms),
        "max_feasible_qps": _finite(document.max_feasible_qps),
        "simulations": document.simulations,
        "trace": _clean(dict(document.trace) if document.trace is not None else None),
        "fleet": document.fleet,
        "stages": [
            {
                "name": stage.name,
                "fleet": dict(stage.fleet),
                "batch_size": stage.batch_size,
                "predicted_p99_ms": _finite(stage.predicted_p99_ms),
                "throughput_qps": _finite(stage.throughput_qps),
                "cost_usd_per_hr": _finite(stage.cost_usd_per_hr),
                "policy": stage.policy,
                "scale_factor": _finite(stage.scale_factor),
            }
            for stage in document.stages
        ],
        "steps": list(document.steps),
        "ranking": ranking(app, plan) if ranking is not None else None,
    }


def _rollout_section(store: Store, app: AppRecord) -> dict[str, Any] | None:
    current = store.current_rollout(app.name)
    return rollout_document(current) if current is not None else None


def build_snapshot(
    store: Store,
    app: AppRecord,
    now: datetime,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    ledger: SpendLedger,
    rates: StageRatesFn | None = None,
    ranking: RankingFn | None = None,
    workers: WorkersFn | None = None,
    serving: ServingFn | None = None,
) -> dict[str, Any]:
    """Everything the dashboard's panels draw for ``app``, over the ``window_s`` before ``now``
    (see the module docstring); JSON-safe."""
    # A young app's charts start at its registration (at least MIN_SPAN_S back), not at an
    # empty stretch before it existed.
    start = max(
        now - timedelta(seconds=window_s),
        min(app.created_at, now - timedelta(seconds=MIN_SPAN_S)),
    )
    samples = _thin(store.metric_series(app.name, since=start, until=now, limit=_MAX_SAMPLES))
    measured = workers(app) if workers is not None else {}
    fleet, series, live = _fleet_section(store, app, start, now, measured)
    plan = store.get_applied_plan(app.name)
    if plan is None:
        newest = store.list_plans(app.name, limit=1)
        plan = newest[0] if newest else None
    document = _typed(plan)  # parsed once: a plan that is not one is logged once
    decisions = store.list_decisions(app.name, limit=DECISIONS_READ)
    decisions.reverse()
    spec = app.spec
    snapshot = {
        "app": {
            "name": app.name,
            "version": app.version,
            "budget_usd_per_hr": app.budget_usd_per_hr,
            "slo": _clean(spec.get("slo")),
            "cascade": _clean(spec.get("cascade")),
            "models": [
                str(m.get("name")) for m in spec.get("models") or [] if isinstance(m, Mapping)
            ],
            "instance_types": _clean(spec.get("instance_types")),
        },
        "generated_at": now.isoformat(),
        "now": _epoch_s(now),
        "window": {"start": _epoch_s(start), "end": _epoch_s(now), "window_s": window_s},
        "samples": len(samples),
        "fleet": fleet,
        "cost": _cost_section(store, app, samples, live, ledger, start, now),
        "load": _load_section(
            samples, series, document, rates(app, document) if rates and document else None
        ),
        "latency": _latency_section(
            spec, samples, document, serving(app) if serving is not None else None
        ),
        "cascade": _cascade_section(spec, samples, document),
        "decisions": collapse_runs([_decision(d) for d in decisions])[:DECISIONS_SHOWN],
        "plan": _plan_section(app, plan, document, ranking),
        "rollout": _rollout_section(store, app),
    }
    cleaned: dict[str, Any] = _clean(snapshot)
    return cleaned
