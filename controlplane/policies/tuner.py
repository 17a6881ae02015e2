"""The tuner: InferLine's high-frequency scaling policy, as a pure function of what it observes.

This module owns the tuner's value objects (:class:`TunerStage`, :class:`TunerConfig`,
:class:`TunerState`, :class:`Booting`, :class:`ScalingDecision`) and :func:`tune`, which maps
(recent live arrivals, the clock's reading, the state, the plan) to decisions and the next state.
It reads no clock and does no I/O: the control loop passes ``now_s`` in and a reconciler acts on
the decisions.

The math (InferLine, SoCC'20, "High-Frequency Tuning"):

* Algorithm 3 (scale up). For window lengths w_i from the service time doubling to 60 s
  (:func:`estimator.envelope.tuner_windows_s`), the live rate r_i = (most arrivals in any window of
  length w_i) / w_i is compared with the planning trace's rate at the same window. When some
  r_i exceeds it, r_max = max over the exceeding windows of r_i, and stage m (scale factor s_m,
  per-replica throughput mu_m at the planned batch size, utilisation target rho_m) needs

      k_m = ceil(r_max s_m / (mu_m rho_m))  replicas.

  A stage of mixed instance types needs capacity r_max s_m / rho_m (qps); the tuner adds the most
  cost-effective type (largest mu_t / price_t) that the budget still affords until the stage's
  capacity, booting instances included, reaches it. For one type this is exactly k_m.
* Algorithm 4 (scale down). No sooner than ``scale_down_delay_s`` (15 s) after the last change,
  r = the max over the windows of the recent live rates (the last ``recent_s``), and each stage
  sheds its least cost-effective instances while its capacity stays >= r s_m / rho_m and it keeps
  ``min_instances``. The first scale-down waits for the longest window's watching, or from
  ``first_down_s`` for arrivals that tell their mean rate within ``first_down_precision``.

A stage of several types may carry a *capacity model* (a function from counts by type to qps):
the sum of mu_t assumes every instance serves every query, which a Kairos mix breaks (its
auxiliary types serve only the queries up to their violation batch, so past some count adding one
adds nothing while the base type is the bottleneck). With a model, "the most cost-effective
capacity" is the type whose next instance raises the modelled capacity most per USD/hr, one
instance at a time, and scale-down stops the instance whose loss costs the least capacity per
USD/hr saved. The replay uses the Kairos throughput bound (:mod:`estimator.bounds`) as the model
of a Kairos-dispatched stage.

Past the paper: (1) a stage the tuner scaled below its plan is brought back up to the smaller of
its planned capacity and r s_m / rho_m when the recent rate needs it, although no window exceeds
the planned envelope (without this a scaled-down stage stays short until the planned envelope is
exceeded); (2) instances take ``boot_s`` to start, count for capacity from launch so that the tuner
does not launch twice while they boot, and cost money from launch; (3) the fleet of all stages,
booting instances included, never costs more than the budget; where the budget stops a scale-up
the tuner says so with a ``budget_capped`` decision, for the cascade's gear logic to react.

The utilisation target rho_m is the planned stage's utilisation at the planning trace's peak rate,
rho_m = r_plan s_m / (planned capacity) (:func:`utilisation_target`); with that rho a live envelope
equal to the planned one keeps exactly the planned fleet.

The load model (a stage with a ``capacity_curve``; docs/tuner.md, "The load model"): instead of
r s_m / rho_m the stage needs f C_plan / rho(f_L), where f is the largest equivalent load over the
windows (:func:`equivalent_loads`: the rate multiple of the planning trace that is as busy), f_L
the longest window's, and rho(f_L) the planner's provisioning ratio at f_L, read off the curve of
the planner's capacity by load (:meth:`TunerStage.capacity_for_loads_qps`,
:mod:`controlplane.policies.capacity_curve`).

The trend (a laddered stage; docs/tuner.md, "Lead on a rise"): while the recent arrivals rise
steadily the equivalent load is read a boot ahead (:func:`rise_ahead`), while they fall steadily
as the load now rather than the memory's highest (:func:`fall_now`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import numpy as np
from numpy.typing import ArrayLike

from estimator.catalog import Catalog
from estimator.envelope import (
    DEFAULT_MAX_WINDOW_S,
    DEFAULT_PERSISTENCE_S,
    arrival_cv2,
    arrival_envelope,
    clip_short_bursts,
    recurring_envelope,
    tuner_windows_s,
)
from estimator.errors import BudgetError, UnknownInstanceTypeError, WorkloadError
from estimator.fleet import Fleet
from estimator.numbers import plain

if TYPE_CHECKING:
    from controlplane.spec import PlanningConstraints

__all__ = [
    "CPU_BOOT_S",
    "DEFAULT_RECENT_S",
    "DEFAULT_SCALE_DOWN_DELAY_S",
    "GPU_BOOT_S",
    "Action",
    "Booting",
    "CapacityModel",
    "ScalingDecision",
    "TunerConfig",
    "TunerStage",
    "TunerState",
    "default_boot_s",
    "equivalent_loads",
    "fall_now",
    "fleet_cost_usd_per_hr",
    "initial_state",
    "ladder_fleet",
    "load_factors",
    "load_stopped",
    "planning_envelope",
    "ready_fleets",
    "rise_ahead",
    "tune",
    "utilisation_target",
]

# Start-up times of an EC2 instance to a serving worker: a GPU type pulls a larger image and loads
# the model onto the device, so it takes about twice a CPU type's time (this project's defaults).
GPU_BOOT_S = 60.0
CPU_BOOT_S = 30.0
# InferLine Algorithm 4 waits 15 s after the last change before scaling down.
DEFAULT_SCALE_DOWN_DELAY_S = 15.0
# The recent envelope covers the tuner's longest window.
DEFAULT_RECENT_S = DEFAULT_MAX_WINDOW_S

# Slack for float comparisons of costs (USD/hr) and capacities (qps): a fleet that costs the budget
# to the last bit is within it, and r s / rho = k mu to the last bit needs k, not k + 1.
_COST_SLACK_USD_PER_HR = 1e-9
_RELATIVE_SLACK = 1e-12
# A mix change (launching other types to stop more expensive ones) must save at least this share
# of the stage's cost: two mixes a few cents apart do not trade places at every wobble of the
# load, and the saving pays for the new instances' boot (at 10% a 60 s GPU boot is paid back
# within ten minutes).
MIX_CHANGE_SAVING_SHARE = 0.1
# The sizing model's target fleets are cached per stage, by the need itself (the ladder's flat
# stretches give the same need over a range of loads). The need is not rounded up for the
# lookup: a need equal to a rung's capacity (a load between two rungs of the same fleet) then
# passed the rung and bought one more instance than it for as long as the load stayed there.
# The cache holds at most this many needs (emptied when full).
_TARGET_CACHE_SIZE = 4096
# A stage sized for several burstinesses (``TunerStage.burstiness``) reads the live CV^2
# (:func:`estimator.envelope.arrival_cv2`) only on at least this many gaps of its recent
# arrivals; on fewer it keeps the planned burstiness. The estimate of a CV^2 of 4 on 2,000 gaps
# is within about 15% (one standard deviation), well inside the factor of two between sizings.
BURSTINESS_MIN_GAPS = 2000
# Lead on a rise (:func:`rise_ahead`): the recent span in RISE_BINS bins, a line through their
# counts whose slope is over RISE_Z standard errors and whose residuals' chi-square is within
# RISE_FIT_CHI2 (the 99th percentile for the line's RISE_BINS - 2 = 4 degrees of freedom), each
# bin's variance a renewal count's plus RISE_FIT_SLACK of the count squared; nothing is read on
# fewer than RISE_MIN_ARRIVALS; the load ahead is at most RISE_MAX_GROWTH times the load now.
RISE_BINS = 6
RISE_Z = 2.0
RISE_FIT_CHI2 = 13.28
RISE_FIT_SLACK = 0.05
RISE_MIN_ARRIVALS = 300
RISE_MAX_GROWTH = 2.0
# A fall is read as the load now (:func:`fall_now`) only once the recent arrivals have fallen
# along a line at every tick for this long: one tick's line flickers on a steady load (a bin of
# 70 against 100-110), and a scale-down on it was bought back at the next tick's "below plan"
# (four chases of 1-6 s in a tester's 20 minutes of Poisson load at the planned rate).
FALL_PERSIST_S = 5.0
# TunerConfig.first_down_s: twice the default persistence test's stretch (the least memory in
# which that test can take a burst out; a fixed figure, not read from TunerConfig.persistence_s).
FIRST_DOWN_S = 2.0 * DEFAULT_PERSISTENCE_S
# TunerConfig.first_down_precision: the mean rate's relative standard error that lets a scale-down
# come before the longest window has been watched.
FIRST_DOWN_PRECISION = 0.05
# Load that has stopped: no arrival for STOPPED_GAPS of the gaps the last persistence stretch's
# rate makes (Poisson: a pause that long comes once in e**20 gaps; gamma arrivals of CV^2 8 leave
# about 0.4% of their gaps over it), and at least STOPPED_FLOOR_S (a busy app's pause of a few
# tenths of a second is its burstiness); at most the persistence stretch itself.
STOPPED_GAPS = 20.0
STOPPED_FLOOR_S = 2.0

Action = Literal["scale_up", "scale_down", "budget_capped"]


def planning_envelope(
    planning_arrival_s: ArrayLike,
    service_time_s: float,
    max_window_s: float = DEFAULT_MAX_WINDOW_S,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The planning trace's envelope on the tuner's windows (:func:`tuner_windows_s` from
    ``service_time_s`` doubling to ``max_window_s``) no longer than the trace's span (by more
    than the shortest window; the shortest one at least): (windows s, the peak rate at each,
    qps).

    A window longer than the trace sees all of it, a rate (count / window) that falls with the
    window although the trace never slowed, as the planner's own envelope says
    (:mod:`controlplane.policies.planner`): a replay planned on a 12 s planning trace read a
    flat load at its planned rate as 4.1 times the plan on the 60 s window and bought 2.8 times
    the plan's fleet.

    >>> windows, _ = planning_envelope(np.arange(0.0, 12.0, 0.05), 1.0, 60.0)
    >>> windows
    (1.0, 2.0, 4.0, 8.0)
    """
    windows = tuner_windows_s(service_time_s, max_window_s)
    arrivals = np.asarray(planning_arrival_s, dtype=np.float64)
    span_s = float(arrivals.max() - arrivals.min()) if arrivals.size > 1 else 0.0
    # (Past the span by less than the shortest window: a 60 s window on a minute's trace,
    # whose last arrival comes a little before its end, reads its rate.)
    kept = windows[windows <= span_s + windows[0]]
    windows = kept if kept.size else windows[:1]
    envelope = arrival_envelope(arrivals, windows)
    return tuple(float(w) for w in windows), tuple(float(r) for r in envelope.rate_qps)


CapacityModel = Callable[[Mapping[str, int]], float]
"""A stage's throughput (qps) for counts by type; non-decreasing in every count."""


def _finite(name: str, value: float, *, low: float = 0.0, strict: bool = False) -> float:
    number = float(value)
    if not math.isfinite(number) or number < low or (strict and number == low):
        relation = ">" if strict else ">="
        raise WorkloadError(f"{name} must be a finite number {relation} {low:g}, got {value!r}")
    return number


def _frozen(mapping: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType({str(k): float(v) for k, v in mapping.items()})


@dataclass(frozen=True, slots=True)
class TunerStage:
    """One stage as the planner left it.

    ``scale_factor`` is s_m, the share of the app's queries that reach the stage;
    ``rate_per_instance_qps[t]`` is mu_t, one instance of type t's throughput at the planned batch
    size (the types the tuner may add: every type the stage has a profile for);
    ``utilisation_target`` is rho_m in (0, 1]; ``fleet`` is the planned counts by type.
    ``capacity_model`` (optional) gives the stage's throughput for counts by type where the sum
    of mu_t does not (a Kairos mix); the tuner then adds and stops instances one at a time by
    their marginal capacity per USD/hr.
    """

    name: str
    scale_factor: float
    fleet: Mapping[str, int]
    rate_per_instance_qps: Mapping[str, float]
    utilisation_target: float
    min_instances: int = 1
    capacity_model: CapacityModel | None = field(default=None, compare=False)
    capacity_curve: tuple[tuple[float, float], ...] | None = None
    # The sizing model's rungs (:mod:`controlplane.policies.sizing`): (load f, the planner's
    # counts by type at f times the planned rate). With them the tuner moves the stage towards
    # the cheapest fleet for the live load (:func:`ladder_fleet`), other types included.
    ladder: tuple[tuple[float, Mapping[str, int]], ...] | None = None
    # The sizing model for other burstiness (docs/tuner.md, "Burstiness"): ``cv2`` is the
    # planning trace's CV^2 (:func:`estimator.envelope.arrival_cv2`) and each entry of
    # ``burstiness`` is (the CV^2 of a stand-in planning trace at the planned rate, its envelope
    # on the config's windows, this stage sized on it: its own ladder, curve and planned fleet).
    # The tuner sizes the stage with the one whose CV^2 is nearest the live arrivals'.
    cv2: float | None = None
    burstiness: tuple[tuple[float, tuple[float, ...], TunerStage], ...] = ()
    # The planner's most queries per batch at the ladder's loads, (f, batch) (empty: not
    # recorded): a rung may batch more to serve its load on fewer instances (:meth:`batch_at`).
    rung_batches: tuple[tuple[float, int], ...] = ()
    # The plan's scale factor where ``scale_factor`` is a live reach standing in for it (the
    # live tuner's, docs/tuner.md, "The reach, live"; None: ``scale_factor`` is the plan's).
    # InferLine's model then reads the stage's load, the app's times ``scale_factor``, against
    # its planned one, the planned envelope times this: a reach above the plan's is more load
    # than planned at the app's planned load.
    planned_share: float | None = None
    _targets: dict[tuple[object, ...], Mapping[str, int] | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.name:
            raise WorkloadError("a stage needs a non-empty name")
        _finite(f"stage {self.name}: scale_factor", self.scale_factor, strict=True)
        rho = _finite(
            f"stage {self.name}: utilisation_target", self.utilisation_target, strict=True
        )
        if rho > 1.0:
            raise WorkloadError(f"stage {self.name}: utilisation_target must be <= 1, got {rho!r}")
        if not self.rate_per_instance_qps:
            raise WorkloadError(f"stage {self.name}: rate_per_instance_qps names no type")
        for type_name, mu in self.rate_per_instance_qps.items():
            _finite(f"stage {self.name}: rate of {type_name}", mu, strict=True)
        fleet = Fleet.of(dict(self.fleet))  # checks names and counts
        for type_name in fleet:
            if type_name not in self.rate_per_instance_qps:
                raise UnknownInstanceTypeError(
                    type_name, list(self.rate_per_instance_qps), where=f"stage {self.name}'s rates"
                )
        if isinstance(self.min_instances, bool) or self.min_instances < 0:
            raise WorkloadError(f"stage {self.name}: min_instances must be >= 0")
        object.__setattr__(self, "fleet", MappingProxyType(dict(fleet)))
        object.__setattr__(self, "rate_per_instance_qps", _frozen(self.rate_per_instance_qps))
        if self.capacity_curve is not None:
            points = tuple(sorted((float(f), float(c)) for f, c in self.capacity_curve))
            if not points:
                raise WorkloadError(f"stage {self.name}: capacity_curve has no point")
            for load, capacity in points:
                _finite(f"stage {self.name}: a capacity curve's load", load, strict=True)
                _finite(f"stage {self.name}: a capacity curve's multiplier", capacity, strict=True)
            if len({load for load, _ in points}) != len(points):
                raise WorkloadError(f"stage {self.name}: capacity_curve repeats a load")
            object.__setattr__(self, "capacity_curve", points)
        if self.ladder is not None:
            rungs = []
            for load, rung in sorted(self.ladder, key=lambda item: float(item[0])):
                _finite(f"stage {self.name}: a ladder's load", load, strict=True)
                counts = dict(Fleet.of(dict(rung)))
                for type_name in counts:
                    if type_name not in self.rate_per_instance_qps:
                        raise UnknownInstanceTypeError(
                            type_name,
                            list(self.rate_per_instance_qps),
                            where=f"stage {self.name}'s rates (its ladder uses it)",
                        )
                rungs.append((float(load), MappingProxyType(counts)))
            if not rungs:
                raise WorkloadError(f"stage {self.name}: the ladder has no rung")
            if self.capacity_curve is None:
                raise WorkloadError(f"stage {self.name}: a ladder needs its capacity curve")
            object.__setattr__(self, "ladder", tuple(rungs))
        if self.rung_batches:
            loads = {f for f, _ in self.ladder or ()}
            batches = tuple(sorted((float(f), int(b)) for f, b in self.rung_batches))
            if any(f not in loads for f, _ in batches) or any(b < 1 for _, b in batches):
                raise WorkloadError(
                    f"stage {self.name}: rung batches need a load of the ladder and a batch >= 1"
                )
            object.__setattr__(self, "rung_batches", batches)
        if self.planned_share is not None:
            _finite(f"stage {self.name}: planned_share", self.planned_share, strict=True)
        if self.burstiness and self.cv2 is None:
            raise WorkloadError(f"stage {self.name}: sizings by burstiness need the planned cv2")
        if self.cv2 is not None:
            _finite(f"stage {self.name}: cv2", self.cv2, strict=True)
        for cv2, _planned, other in self.burstiness:
            _finite(f"stage {self.name}: a sizing's cv2", cv2, strict=True)
            if other.name != self.name or other.ladder is None:
                raise WorkloadError(
                    f"stage {self.name}: a sizing by burstiness is a laddered stage of that name"
                )

    def batch_at(self, fleet: Mapping[str, int]) -> int | None:
        """The most queries per batch the planner serves ``fleet`` with: the batch of the
        ladder's rung at the highest load whose capacity the fleet reaches (the planner showed
        that batch to meet the SLO at that load with no more capacity, so at every lower load
        too, where its own batch at a lower rung was one of several that do), the lowest rung's
        when it reaches none; None without rung batches (the plan's batch throughout).

        >>> stage = TunerStage("m", 1.0, {"c": 2}, {"c": 10.0}, 1.0,
        ...     capacity_curve=((0.5, 0.5), (1.0, 1.0), (1.6, 1.0), (2.0, 1.5)),
        ...     ladder=((0.5, {"c": 1}), (1.0, {"c": 2}), (1.6, {"c": 2}), (2.0, {"c": 3})),
        ...     rung_batches=((0.5, 8), (1.0, 4), (1.6, 8), (2.0, 4)))
        >>> [stage.batch_at({"c": n}) for n in (1, 2, 3, 5)]
        [8, 8, 4, 4]
        """
        if not self.rung_batches or self.ladder is None:
            return None
        have = self.capacity_qps(fleet) * (1.0 + 1e-9)
        batch_of = dict(self.rung_batches)
        chosen = self.rung_batches[0][1]
        for f, rung in self.ladder:
            if f in batch_of and self.capacity_qps(rung) <= have:
                chosen = batch_of[f]
        return chosen

    @property
    def model(self) -> Literal["curve", "inferline"]:
        """Which load model sizes the stage: ``curve`` (the planner's capacity at the live load,
        with a ``capacity_curve``) or ``inferline`` (one provisioning ratio rho_m); the live
        tuner records it with each decision."""
        return "inferline" if self.capacity_curve is None else "curve"

    @property
    def planned_capacity_qps(self) -> float:
        """The planned fleet's throughput: the capacity model's, else sum over types of count x
        mu_t."""
        return self.capacity_qps(self.fleet)

    def capacity_at_load_qps(self, load: float) -> float:
        """C*(f): the capacity the stage needs when the live arrivals are ``load`` = f times the
        planned envelope (:func:`load_factors`): the planned capacity times the multiplier m(f)
        of ``capacity_curve`` (the planner's capacity for the planning trace at f times its rate
        over its capacity at f = 1), linear between the curve's points and proportional to f from
        the nearest end outside them. Without a curve, InferLine's constant provisioning ratio:
        m(f) = f.

        >>> stage = TunerStage("m", 1.0, {"g": 2}, {"g": 10.0}, 1.0,
        ...     capacity_curve=((0.5, 0.6), (1.0, 1.0), (2.0, 1.7)))
        >>> [round(stage.capacity_at_load_qps(f), 9) for f in (0.25, 0.75, 1.0, 1.5, 3.0)]
        [6.0, 16.0, 20.0, 27.0, 51.0]
        """
        f = max(0.0, float(load))
        points = self.capacity_curve
        if points is None:
            return f * self.planned_capacity_qps
        loads = [p[0] for p in points]
        multipliers = [p[1] for p in points]
        if f <= loads[0]:
            m = multipliers[0] * f / loads[0]
        elif f >= loads[-1]:
            m = multipliers[-1] * f / loads[-1]
        else:
            m = float(np.interp(f, loads, multipliers))
        return m * self.planned_capacity_qps

    def capacity_for_loads_qps(self, peak_load: float, sustained_load: float) -> float:
        """The capacity for live arrivals at ``peak_load`` f (the largest equivalent load over
        the windows, :func:`equivalent_loads`) whose sustained load (the longest window's) is
        f_L: f x C_plan / rho(f_L), with rho(f_L) = f_L C_plan / C*(f_L) the planner's
        provisioning ratio at the sustained load (:meth:`capacity_at_load_qps`). InferLine's
        k = ceil(r s / (mu rho)) with rho measured at the load the stage runs at rather than at
        the planned one: a pure change of rate (f = f_L) needs C*(f_L), the planner's own
        capacity there; arrivals burstier than planned (short windows above f_L) get the
        headroom of that load in proportion to their bursts.

        >>> stage = TunerStage("m", 1.0, {"g": 2}, {"g": 10.0}, 1.0,
        ...     capacity_curve=((0.5, 0.6), (1.0, 1.0), (2.0, 1.7)))
        >>> [round(stage.capacity_for_loads_qps(f, 1.5), 9) for f in (1.5, 1.8)]
        [27.0, 32.4]
        """
        f_peak = max(0.0, float(peak_load))
        f_sustained = min(max(0.0, float(sustained_load)), f_peak)
        if f_sustained <= 0.0:
            return self.capacity_at_load_qps(f_peak)
        return self.capacity_at_load_qps(f_sustained) * f_peak / f_sustained

    def capacity_qps(self, fleet: Mapping[str, int]) -> float:
        """The throughput of ``fleet`` (counts by type) for this stage."""
        if self.capacity_model is not None:
            return float(self.capacity_model(fleet))
        return _capacity_qps(fleet, self.rate_per_instance_qps)


@dataclass(frozen=True, slots=True)
class TunerConfig:
    """The tuner's settings: the planning trace's envelope and the guardrails.

    ``planned_rate_qps[i]`` is the planning trace's peak rate at window ``windows_s[i]``.
    ``boot_s[t]`` is how long an instance of type t takes to start serving; ``prices_usd_per_hr``
    and ``budget_usd_per_hr`` bound the whole fleet's cost, booting instances included.
    """

    windows_s: tuple[float, ...]
    planned_rate_qps: tuple[float, ...]
    budget_usd_per_hr: float
    prices_usd_per_hr: Mapping[str, float]
    boot_s: Mapping[str, float]
    scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S
    recent_s: float = DEFAULT_RECENT_S
    # The spec's max_counts: at most this many instances of a type in the app, over all its
    # stages (as the planner caps the pipeline); a type left out is bounded by the budget alone.
    max_counts: Mapping[str, int] = field(default_factory=dict)
    # A burst shorter than this is noise unless it recurs within ``recent_s``
    # (:func:`estimator.envelope.recurring_envelope`; the replay and the live tuner use
    # DEFAULT_PERSISTENCE_S); None reads every burst as load, InferLine's envelope as written.
    persistence_s: float | None = None
    # A laddered stage sizes for the load one boot ahead while the recent arrivals rise
    # steadily (:func:`rise_ahead`; docs/tuner.md, "Lead on a rise"); False: the load now.
    lead_on_rise: bool = True
    # A laddered stage whose recent arrivals fall steadily is sized for the load now rather than
    # the memory's highest (:func:`fall_now`; docs/tuner.md, "Lead on a rise").
    follow_fall: bool = True
    # ... once it has been read at every tick for this long (:data:`FALL_PERSIST_S`).
    fall_persist_s: float = FALL_PERSIST_S
    # The live tuner's (docs/tuner.md, "Noise: the persistence test"): while the arrivals in
    # memory span less than twice ``persistence_s`` (a restarted service's, or load after an
    # idle gap: the test can take no burst out), a scale-up goes no further than the stage's
    # planned capacity; after that a window the test has yet to read (2 max(w, persistence)
    # over the span, under ``recent_s``) reads no more than the plan. The replay leaves it off:
    # its memory starts with its trace.
    hold_young_memory: bool = False
    # The most arrivals the memory holds (the live tuner's: the serving loop's ring,
    # :data:`controlplane.serving.observations.ARRIVALS_KEPT`): a memory of that many spans the
    # ring, not the traffic's age, and is never young (at thousands of queries a second the
    # ring spans less than the persistence test needs: the hold would never end).
    memory_ring: int | None = None
    # The first scale-down may come this soon after the tuner starts (None: not before its
    # longest window) where the arrivals watched tell their mean rate within
    # ``first_down_precision`` (relative standard error sqrt(CV^2 / n) of n arrivals);
    # :func:`_first_down_due`.
    first_down_s: float | None = FIRST_DOWN_S
    first_down_precision: float = FIRST_DOWN_PRECISION

    def __post_init__(self) -> None:
        windows = tuple(_finite("a window", w, strict=True) for w in self.windows_s)
        rates = tuple(_finite("a planned rate", r) for r in self.planned_rate_qps)
        if not windows or len(windows) != len(rates):
            raise WorkloadError(
                f"the tuner needs one planned rate per window, got {len(windows)} windows and "
                f"{len(rates)} rates"
            )
        budget = float(self.budget_usd_per_hr)
        if not (math.isfinite(budget) and budget >= 0.0):
            raise BudgetError(f"budget must be a finite number >= 0, got {budget!r}", budget)
        for name, price in self.prices_usd_per_hr.items():
            _finite(f"price of {name}", price)
        for name, boot in self.boot_s.items():
            _finite(f"boot time of {name}", boot)
        object.__setattr__(self, "windows_s", windows)
        object.__setattr__(self, "planned_rate_qps", rates)
        object.__setattr__(self, "budget_usd_per_hr", budget)
        object.__setattr__(self, "prices_usd_per_hr", _frozen(self.prices_usd_per_hr))
        object.__setattr__(self, "boot_s", _frozen(self.boot_s))
        object.__setattr__(
            self, "scale_down_delay_s", _finite("scale_down_delay_s", self.scale_down_delay_s)
        )
        object.__setattr__(self, "recent_s", _finite("recent_s", self.recent_s, strict=True))
        if self.persistence_s is not None:
            persist = _finite("persistence_s", self.persistence_s)
            object.__setattr__(self, "persistence_s", persist)
        if self.first_down_s is not None:
            object.__setattr__(self, "first_down_s", _finite("first_down_s", self.first_down_s))
        precision = _finite("first_down_precision", self.first_down_precision, strict=True)
        object.__setattr__(self, "first_down_precision", precision)
        for name, cap in self.max_counts.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise WorkloadError(f"max count of {name} must be an integer >= 0, got {cap!r}")
        object.__setattr__(self, "max_counts", MappingProxyType(dict(self.max_counts)))

    @property
    def planned_peak_rate_qps(self) -> float:
        """r_plan, the planning envelope's highest rate over the windows."""
        return max(self.planned_rate_qps)

    @classmethod
    def from_planning_trace(
        cls,
        planning_arrival_s: ArrayLike,
        service_time_s: float,
        *,
        budget_usd_per_hr: float | None = None,
        constraints: PlanningConstraints | None = None,
        catalog: Catalog,
        types: Iterable[str] | None = None,
        boot_s: Mapping[str, float] | None = None,
        scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S,
        recent_s: float = DEFAULT_RECENT_S,
        max_window_s: float = DEFAULT_MAX_WINDOW_S,
        persistence_s: float | None = None,
    ) -> TunerConfig:
        """The windows from ``service_time_s`` doubling to ``max_window_s``, the planning trace's
        envelope on them, prices from ``catalog`` and boot times from :func:`default_boot_s`
        (``boot_s`` overrides per type); the limits as :meth:`from_envelope` takes them."""
        windows_s, rates_qps = planning_envelope(planning_arrival_s, service_time_s, max_window_s)
        return cls.from_envelope(
            windows_s,
            rates_qps,
            budget_usd_per_hr=budget_usd_per_hr,
            constraints=constraints,
            catalog=catalog,
            types=types,
            boot_s=boot_s,
            scale_down_delay_s=scale_down_delay_s,
            recent_s=recent_s,
            persistence_s=persistence_s,
        )

    @classmethod
    def from_envelope(
        cls,
        windows_s: Sequence[float],
        planned_rate_qps: Sequence[float],
        *,
        budget_usd_per_hr: float | None = None,
        constraints: PlanningConstraints | None = None,
        catalog: Catalog,
        types: Iterable[str] | None = None,
        boot_s: Mapping[str, float] | None = None,
        scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S,
        recent_s: float = DEFAULT_RECENT_S,
        persistence_s: float | None = None,
        hold_young_memory: bool = False,
        memory_ring: int | None = None,
    ) -> TunerConfig:
        """:meth:`from_planning_trace` with the planning envelope already known (a plan's own,
        or one computed once and kept): the rate at each window.

        The limits are the app's ``constraints`` (its budget, and its caps over ``types``);
        ``budget_usd_per_hr`` where given overrides the budget (required without constraints:
        a tuner with no caps)."""
        if budget_usd_per_hr is None:
            if constraints is None:
                raise BudgetError("the tuner needs a budget or the app's constraints", math.nan)
            budget_usd_per_hr = constraints.budget_usd_per_hr
        names = list(catalog) if types is None else list(types)
        boot = default_boot_s(catalog, names)
        boot.update(boot_s or {})
        return cls(
            windows_s=tuple(windows_s),
            planned_rate_qps=tuple(planned_rate_qps),
            budget_usd_per_hr=budget_usd_per_hr,
            prices_usd_per_hr={name: catalog.price_usd_per_hr(name) for name in names},
            boot_s=boot,
            scale_down_delay_s=scale_down_delay_s,
            recent_s=recent_s,
            max_counts={} if constraints is None else constraints.caps(names),
            persistence_s=persistence_s,
            hold_young_memory=hold_young_memory,
            memory_ring=memory_ring,
        )


@dataclass(frozen=True, slots=True)
class Booting:
    """An instance launched at ``launched_s`` that serves from ``ready_at_s``."""

    stage: str
    instance_type: str
    launched_s: float
    ready_at_s: float


@dataclass(frozen=True, slots=True)
class TunerState:
    """What the tuner has launched: counts by type per stage (booting instances included), the
    instances still booting, when the fleet last changed (None: never) and when the tuner started
    watching."""

    fleets: Mapping[str, Fleet]
    booting: tuple[Booting, ...] = ()
    last_change_s: float | None = None
    # When the tuner started watching (None: long ago). It stops nothing before it has seen its
    # longest window of traffic: a shorter history reads every long window's rate low.
    started_s: float | None = None
    # Since when the recent arrivals have fallen along a line at every tick (None: they do not
    # now): a fall is read once it has held ``TunerConfig.fall_persist_s``.
    falling_since_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fleets", MappingProxyType(dict(self.fleets)))
        object.__setattr__(self, "booting", tuple(self.booting))


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One thing the tuner decided at ``at_s``.

    ``scale_up``: launch ``count`` instances of ``instance_type`` for ``stage``; ``scale_down``:
    stop ``count`` of them (booting ones first); ``budget_capped``: the stage is short by about
    ``count`` instances of ``instance_type`` that the budget does not afford (nothing to do but
    react, e.g. switch the cascade to a cheaper gear). ``reason`` carries the numbers (window,
    observed and planned rates, r_max, the needed capacity, k); ``cost_usd_per_hr_after`` is the
    whole fleet's cost, booting instances included, after this decision.
    """

    at_s: float
    stage: str
    action: Action
    instance_type: str
    count: int
    reason: str
    cost_usd_per_hr_after: float


def default_boot_s(catalog: Catalog, types: Iterable[str] | None = None) -> dict[str, float]:
    """Start-up time per type: :data:`GPU_BOOT_S` for types with a GPU, :data:`CPU_BOOT_S` else.

    >>> from estimator.catalog import InstanceType
    >>> default_boot_s(Catalog([InstanceType("g4dn.xlarge", 0.526, gpus=1),
    ...                         InstanceType("c5.large", 0.085)]))
    {'g4dn.xlarge': 60.0, 'c5.large': 30.0}
    """
    names = list(catalog) if types is None else list(types)
    return {name: GPU_BOOT_S if catalog[name].is_gpu else CPU_BOOT_S for name in names}


def utilisation_target(
    fleet: Mapping[str, int],
    rate_per_instance_qps: Mapping[str, float],
    scale_factor: float,
    peak_rate_qps: float,
    capacity_model: CapacityModel | None = None,
    *,
    whole_instances: bool = False,
) -> float:
    """rho_m = r_plan s_m / (planned capacity), capped at 1: the planned stage's utilisation at the
    planning trace's peak rate (InferLine's maximum provisioning ratio). The planned capacity is
    the ``capacity_model``'s where one is given, else the sum of count x mu_t.

    With ``whole_instances`` rho_m is the geometric mean of that and the utilisation of the
    fleet less the one instance whose loss costs the least capacity (at most 1): the planner
    buys whole instances, and only the fleet with one fewer failed its SLO, so the tolerable
    utilisation lies between the two. A stage of one instance that serves four times the
    planned peak reads 0.5, not 0.25 (InferLine's ratio would buy a second instance at the first
    1 s window over the plan); a stage of many instances reads about its plain ratio.

    >>> utilisation_target({"g": 4}, {"g": 50.0}, 0.5, 320.0)
    0.8
    >>> utilisation_target({"g": 1}, {"g": 400.0}, 1.0, 100.0, whole_instances=True)
    0.5
    """

    def capacity_of(counts: Mapping[str, int]) -> float:
        if capacity_model is not None:
            return float(capacity_model(counts))
        return _capacity_qps(counts, rate_per_instance_qps)

    capacity = capacity_of(fleet)
    if capacity <= 0.0:
        raise WorkloadError("a stage with no planned capacity has no utilisation target")
    rho = min(1.0, peak_rate_qps * scale_factor / capacity)
    if whole_instances:
        less = max(
            (capacity_of({**fleet, t: n - 1}) for t, n in fleet.items() if n > 0), default=0.0
        )
        upper = 1.0 if less <= 0.0 else min(1.0, peak_rate_qps * scale_factor / less)
        rho = math.sqrt(rho * max(rho, upper))
    return rho


def initial_state(plans: Sequence[TunerStage], now_s: float) -> TunerState:
    """The planned fleets, all of them serving, changed last at ``now_s``."""
    return TunerState(
        fleets={plan.name: Fleet.of(dict(plan.fleet)) for plan in plans},
        last_change_s=now_s,
        started_s=now_s,
    )


def ready_fleets(state: TunerState, now_s: float) -> dict[str, Fleet]:
    """Counts by type per stage of the instances serving at ``now_s``: the launched ones less those
    whose ``ready_at_s`` is still ahead."""
    ready = {stage: dict(fleet) for stage, fleet in state.fleets.items()}
    for boot in state.booting:
        if boot.ready_at_s > now_s:
            ready[boot.stage][boot.instance_type] -= 1
    return {stage: Fleet.of(counts) for stage, counts in ready.items()}


def fleet_cost_usd_per_hr(state: TunerState, prices_usd_per_hr: Mapping[str, float]) -> float:
    """The fleet's cost: every launched instance, booting or serving, at its type's price."""
    return sum(
        count * prices_usd_per_hr[name]
        for fleet in state.fleets.values()
        for name, count in fleet.items()
    )


def _capacity_qps(fleet: Mapping[str, int], mu: Mapping[str, float]) -> float:
    # A type the fleet holds none of adds nothing (a fleet keeps the zero of a type it shed,
    # which a stage set up again on another plan's types may not rate).
    return sum(count * mu[name] for name, count in fleet.items() if count)


def _cost_effectiveness(plan: TunerStage, prices: Mapping[str, float], name: str) -> float:
    price = prices[name]
    return math.inf if price == 0.0 else plan.rate_per_instance_qps[name] / price


def _room(tick: _Tick, stage: str, fleet: Mapping[str, int], name: str) -> int:
    """How many more instances of ``name`` the stage ``stage`` (its fleet ``fleet``, or a trial
    of it) may take under the caps, which bound the app's instances of a type over all its
    stages, as the planner's do."""
    cap = tick.config.max_counts.get(name)
    return _UNCAPPED if cap is None else max(0, cap - fleet.get(name, 0) - tick.others(stage, name))


_UNCAPPED = 2**31 - 1


def _held_back(tick: _Tick, plan: TunerStage, fleet: Mapping[str, int]) -> str:
    """Why a short stage gets no more: the budget (no type fits in what is left of it), the
    caps (``max_counts`` allows no more of any type: a shortfall the caps made read as the
    budget's, at a fleet costing a sixth of it), or both, type by type."""
    config = tick.config
    cost = (
        f"the fleet costs {tick.cost_usd_per_hr:.6g} of the {config.budget_usd_per_hr:.6g}"
        " USD/hr budget"
    )
    left = config.budget_usd_per_hr - tick.cost_usd_per_hr + _COST_SLACK_USD_PER_HR
    types = sorted(plan.rate_per_instance_qps)
    capped = [t for t in types if _room(tick, plan.name, fleet, t) <= 0]
    if not capped:
        return f"but {cost} and no type fits"
    priced = [t for t in types if t not in capped and config.prices_usd_per_hr[t] > left]
    if len(capped) == len(types):
        return f"but max_counts allows no more of {', '.join(capped)} ({cost})"
    return (
        f"but {cost}: no more of {', '.join(priced)} fits it, and max_counts allows no more of"
        f" {', '.join(capped)}"
    )


def _short_qps(needed_qps: float, capacity_qps: float) -> float:
    """How much capacity is missing, with float noise (k mu vs r s / rho) read as none."""
    short = needed_qps - capacity_qps
    return short if short > _RELATIVE_SLACK * max(1.0, needed_qps) else 0.0


def _ceil(x: float) -> int:
    return math.ceil(x - _RELATIVE_SLACK * max(1.0, x))


@dataclass(slots=True)
class _Tick:
    """The mutable scratch of one call to :func:`tune` (never escapes it)."""

    now_s: float
    config: TunerConfig
    fleets: dict[str, dict[str, int]]
    booting: list[Booting]
    cost_usd_per_hr: float
    decisions: list[ScalingDecision] = field(default_factory=list)

    def others(self, stage: str, name: str) -> int:
        """The instances of ``name`` the app's stages other than ``stage`` run (booting too)."""
        return sum(fleet.get(name, 0) for other, fleet in self.fleets.items() if other != stage)

    def caps(self, stage: str) -> dict[str, int]:
        """The spec's caps as they bound ``stage`` now: less what the other stages run."""
        return {
            name: max(0, cap - self.others(stage, name))
            for name, cap in self.config.max_counts.items()
        }

    def launch(self, plan: TunerStage, name: str, count: int, reason: str) -> None:
        stage = self.fleets[plan.name]
        stage[name] = stage.get(name, 0) + count
        ready_at_s = self.now_s + self.config.boot_s[name]
        if ready_at_s > self.now_s:  # a zero boot time serves at once
            self.booting.extend(
                Booting(plan.name, name, self.now_s, ready_at_s) for _ in range(count)
            )
        self.cost_usd_per_hr += count * self.config.prices_usd_per_hr[name]
        self.decide(plan.name, "scale_up", name, count, reason)

    def stop(self, plan: TunerStage, name: str, count: int, reason: str) -> None:
        self.fleets[plan.name][name] -= count
        # Booting instances go first, the latest launched first: they serve nobody yet.
        mine = [b for b in self.booting if b.stage == plan.name and b.instance_type == name]
        dropped = set(map(id, sorted(mine, key=lambda b: -b.launched_s)[:count]))
        self.booting = [b for b in self.booting if id(b) not in dropped]
        self.cost_usd_per_hr -= count * self.config.prices_usd_per_hr[name]
        self.decide(plan.name, "scale_down", name, count, reason)

    def decide(self, stage: str, action: Action, name: str, count: int, reason: str) -> None:
        cost = max(0.0, self.cost_usd_per_hr)
        self.decisions.append(ScalingDecision(self.now_s, stage, action, name, count, reason, cost))


def _shed_to_limits(tick: _Tick, plans: Sequence[TunerStage]) -> bool:
    """A fleet over the app's limits (its budget or a type's cap was lowered under the fleet the
    tuner had reached): stop instances one at a time until it is within them (a type over its
    cap first, then the cost), each the one that costs the app the least capacity per USD/hr
    saved, the app's capacity being its bottleneck (the least of each stage's capacity over its
    share of the queries): within one stage, the least cost-effective type, as the reconciler's
    budget drain takes it; across a cascade's stages, first those whose loss leaves the
    bottleneck where it is. Ties: the dearer, then the stage with most of the type, then by
    name; booting instances of a type go first. Each stage keeps ``max(1, min_instances)``, as
    the drain keeps a stage's last instance; the planned mix's one instance of each type is not
    kept here (the limits are hard). Over the budget, an instance that no fleet within it can
    keep (with its stage's floor) goes first, then one whose loss leaves a fleet that can still
    be shed within it (a stage the sizing model moved to a dearer type kept that type and lost
    the cheap instances that fitted, or all but one of them), then one whose loss leaves its
    stage something serving: a stage's last serving instance stays over one still booting
    beside it (a budget cut during a rise stopped the cheap one that served and kept the dear
    one the tuner had just launched, and the stage served nothing until it booted; the tuner
    moves to the dearer type again only where the budget pays for both while they overlap,
    make-before-break). A stage at its floor whose instances alone are over the budget trades
    its dearest for one of its cheapest planned type (the serving floor a budget cut is held
    to, docs/operations.md): kept, the reconciler's budget guard drained it and the tuner never
    bought anything back. True when something changed."""
    config, prices = tick.config, tick.config.prices_usd_per_hr
    budget = config.budget_usd_per_hr + _COST_SLACK_USD_PER_HR

    def reach(plan: TunerStage, fleet: Mapping[str, int]) -> float:
        share = plan.scale_factor
        return math.inf if share <= 0.0 else plan.capacity_qps(fleet) / share

    def floor_cost(stage: str, fleet: Mapping[str, int], keeping: str | None = None) -> float:
        """The least the app's fleet costs shed, ``stage``'s being ``fleet``: each stage down to
        the cheapest ``max(1, min_instances)`` of its instances (``stage``'s including one of
        ``keeping`` where given)."""
        total = 0.0
        for plan in plans:
            left = max(1, plan.min_instances)
            counts = fleet if plan.name == stage else tick.fleets[plan.name]
            if plan.name == stage and keeping is not None:
                total += prices[keeping]
                left -= 1
                counts = {**counts, keeping: counts[keeping] - 1}
            for name in sorted((t for t, n in counts.items() if n > 0), key=prices.__getitem__):
                kept = min(left, counts[name])
                total += kept * prices[name]
                left -= kept
        return total

    def serving(fleet: Mapping[str, int], booting: Mapping[str, int]) -> int:
        """How many of a stage's instances (``fleet``) serve now: its ``booting`` ones (by type)
        left out (a stop takes a type's booting ones first)."""
        return sum(max(0, n - booting.get(name, 0)) for name, n in fleet.items())

    stuck: set[str] = set()  # over its cap, but every stage holding it is at its floor

    def over_cap() -> str | None:
        for name, cap in sorted(config.max_counts.items()):
            if name not in stuck and sum(f.get(name, 0) for f in tick.fleets.values()) > cap:
                return name
        return None

    shed = False
    while True:
        capped = over_cap()
        if capped is None and tick.cost_usd_per_hr <= (
            config.budget_usd_per_hr + _COST_SLACK_USD_PER_HR
        ):
            break
        reaches = {plan.name: reach(plan, tick.fleets[plan.name]) for plan in plans}
        app_qps = min(reaches.values(), default=math.inf)
        options = []
        for plan in plans:
            fleet = tick.fleets[plan.name]
            if sum(fleet.values()) <= max(1, plan.min_instances):
                continue
            others = min((r for n, r in reaches.items() if n != plan.name), default=math.inf)
            booting = Counter(b.instance_type for b in tick.booting if b.stage == plan.name)
            for name, count in fleet.items():
                price = prices[name]
                if count <= 0 or (name != capped if capped is not None else price <= 0.0):
                    continue
                less = {**fleet, name: count - 1}
                after = min(others, reach(plan, less))
                lost = max(app_qps - after, 0.0) if math.isfinite(app_qps) else 0.0
                per_usd = lost / price if price > 0.0 else lost
                # Over the budget: what no fleet within it can keep goes first, then what
                # leaves one that can still be shed within it.
                kept = capped is not None or floor_cost(plan.name, fleet, name) <= budget
                dead_end = capped is None and floor_cost(plan.name, less) > budget
                # Then what leaves the stage something serving: its last serving instance
                # stopped, it served nothing until the one booting beside it booted.
                strands = serving(fleet, booting) > 0 and serving(less, booting) == 0
                options.append(
                    (kept, dead_end, strands, per_usd, -price, -count, plan.name, name, plan)
                )
        if not options:
            if capped is None:
                if _trade_down(tick, plans):
                    shed = True
                    continue
                break
            stuck.add(capped)
            continue
        best = min(options, key=lambda option: option[:8])
        keeps, *_, name, plan = best
        whose = "the instance whose loss costs the app the least capacity per USD/hr"
        if not keeps:
            whose = f"which no fleet within the budget keeps beside {plan.name}'s floor"
        elif any(o[:2] == best[:2] and o[2] and o[3:8] < best[3:8] for o in options):
            whose = (
                f"still booting: {plan.name}'s last serving instance stays (stopped, the stage"
                " served nothing until this one booted)"
            )
        if capped is not None:
            total = sum(fleet.get(name, 0) for fleet in tick.fleets.values())
            why = f"over the cap: {total} x {name} where the spec allows {config.max_counts[name]}"
        else:
            why = (
                f"over the budget: the fleet the tuner asks for costs"
                f" {tick.cost_usd_per_hr:.6g} USD/hr, the budget is"
                f" {config.budget_usd_per_hr:.6g} USD/hr (the budget guard holds the live fleet"
                " to it at once)"
            )
        tick.stop(
            plan,
            name,
            1,
            f"scale_down: {why}; stopped 1 x {name}, {whose}",
        )
        shed = True
    return shed


def _trade_down(tick: _Tick, plans: Sequence[TunerStage]) -> bool:
    """A fleet over the budget with every stage at its floor: the dearest instance of any stage
    for which one of the stage's cheapest planned type costs less (and the caps allow one) is
    stopped and that one launched in its place. True when one was traded."""
    config, prices = tick.config, tick.config.prices_usd_per_hr
    trades = []
    for plan in plans:
        fleet = tick.fleets[plan.name]
        planned = [t for t, n in plan.fleet.items() if n > 0 and t in prices]
        cheapest = min(planned, key=lambda t: (prices[t], t), default=None)
        if cheapest is None:
            continue
        for name, count in fleet.items():
            if count > 0 and prices[name] > prices[cheapest]:
                trades.append((-prices[name], plan.name, name, cheapest, plan))
    for _, _, name, cheapest, plan in sorted(trades, key=lambda trade: trade[:4]):
        fleet = tick.fleets[plan.name]
        if _room(tick, plan.name, {**fleet, name: fleet[name] - 1}, cheapest) <= 0:
            continue
        why = (
            f"over the budget: the fleet the tuner asks for costs {tick.cost_usd_per_hr:.6g}"
            f" USD/hr, the budget is {config.budget_usd_per_hr:.6g} USD/hr and {plan.name} keeps"
            f" {max(1, plan.min_instances)} instance(s)"
        )
        tick.stop(
            plan,
            name,
            1,
            f"scale_down: {why}; stopped 1 x {name} for 1 x {cheapest}, the stage's cheapest"
            " planned type",
        )
        tick.launch(
            plan,
            cheapest,
            1,
            f"scale_up: {why}; 1 x {cheapest}, the stage's cheapest planned type, in place of"
            f" 1 x {name}",
        )
        return True
    return False


def _scale_up(
    tick: _Tick, plan: TunerStage, needed_qps: float, why: str, k_m: int | None = None
) -> None:
    """Add the most cost-effective affordable type until the stage serves ``needed_qps``; a stage
    of one type is brought to ``k_m`` instances where given."""
    if plan.capacity_model is not None:
        _scale_up_marginal(tick, plan, needed_qps, why)
        return
    config, prices, mu = tick.config, tick.config.prices_usd_per_hr, plan.rate_per_instance_qps
    fleet = tick.fleets[plan.name]
    by_value = sorted(mu, key=lambda name: (-_cost_effectiveness(plan, prices, name), name))
    capacity = _capacity_qps(fleet, mu)
    for name in by_value:
        short = _short_qps(needed_qps, capacity)
        if short == 0.0:
            return
        wanted = k_m - fleet.get(name, 0) if k_m is not None else _ceil(short / mu[name])
        if wanted <= 0:
            return
        left = config.budget_usd_per_hr - tick.cost_usd_per_hr + _COST_SLACK_USD_PER_HR
        price = prices[name]
        affordable = wanted if price == 0.0 else min(wanted, max(0, math.floor(left / price)))
        affordable = min(affordable, _room(tick, plan.name, fleet, name))
        if affordable <= 0:
            continue
        before = capacity
        capacity += affordable * mu[name]
        count_after = sum(fleet.values()) + affordable
        tick.launch(
            plan,
            name,
            affordable,
            f"scale_up: {why}; need {needed_qps:.6g} qps; added {affordable} x {name} "
            f"(mu {mu[name]:.6g} qps, {_cost_effectiveness(plan, prices, name):.6g} qps per "
            f"USD/hr): capacity {before:.6g} -> {capacity:.6g} qps, k {count_after}",
        )
    # What the stage lacks: the rate it cannot serve, or with a target of ``k_m`` instances the
    # instances it is short of (reported as instances: the rate they stand for is the
    # target's, not a difference of rates).
    short = _short_qps(needed_qps, capacity)
    best = by_value[0]
    missing = _ceil(short / mu[best]) if short > 0.0 else 0
    lacking = f"short {short:.6g} qps"
    if k_m is not None:
        missing = max(0, k_m - sum(fleet.values()))
        lacking = f"short {missing} of the {k_m} instances its rate needs"
    if missing > 0:
        tick.decide(
            plan.name,
            "budget_capped",
            best,
            missing,
            f"budget_capped: {why}; need {needed_qps:.6g} qps, have {capacity:.6g} qps; "
            f"{lacking} {_held_back(tick, plan, fleet)}",
        )


def _scale_down(
    tick: _Tick,
    plan: TunerStage,
    needed_qps: float,
    why: str,
    hold: Mapping[str, int] | None = None,
) -> bool:
    """Stop the least cost-effective instances while the stage still serves ``needed_qps``, keeps
    ``min_instances``, keeps one instance of every type of the planned fleet and at least
    ``hold[type]`` of a type (what the sizing model's fleet wants more of: a step of a mix change
    stays, :func:`_scale_down_ladder`); True when something stopped.

    The last instance of a planned type stays because the planner chose the mix, not only the
    capacity: in a heterogeneous fleet the least cost-effective type is often the only one that
    serves the large queries within the SLO (the Kairos base type), and the tuner tunes
    replication, not hardware, so it never adds that type back."""
    held = hold or {}
    if plan.capacity_model is not None:
        return _scale_down_marginal(tick, plan, needed_qps, why, held)
    prices, mu = tick.config.prices_usd_per_hr, plan.rate_per_instance_qps
    fleet = tick.fleets[plan.name]
    capacity = _capacity_qps(fleet, mu)
    changed = False
    by_value = sorted(fleet, key=lambda name: (_cost_effectiveness(plan, prices, name), name))
    for name in by_value:
        spare_qps = capacity - needed_qps
        spare_count = sum(fleet.values()) - plan.min_instances
        keep = _kept_by_scale_down(plan, held, name)
        slack = _RELATIVE_SLACK * max(1.0, needed_qps)
        count = min(fleet[name] - keep, spare_count, math.floor((spare_qps + slack) / mu[name]))
        if count <= 0:
            continue
        before = capacity
        capacity -= count * mu[name]
        tick.stop(
            plan,
            name,
            count,
            f"{why}; need {needed_qps:.6g} qps; stopped {count} x {name} (mu {mu[name]:.6g} "
            f"qps): capacity {before:.6g} -> {capacity:.6g} qps, k {sum(fleet.values()) - count}",
        )
        changed = True
    return changed


def _per_usd(gain_qps: float, price_usd_per_hr: float) -> float:
    if gain_qps <= 0.0:
        return 0.0
    return math.inf if price_usd_per_hr == 0.0 else gain_qps / price_usd_per_hr


def _best_addition(
    plan: TunerStage,
    trial: dict[str, int],
    capacity_qps: float,
    prices: Mapping[str, float],
    allowed: Callable[[str], bool],
) -> tuple[str, float] | None:
    """The type whose next instance adds the most of ``plan``'s modelled capacity per USD/hr to
    ``trial`` (ties: cheaper, then by name), among those ``allowed``, with what it adds; None
    when none adds any."""
    best: tuple[float, float, str, float] | None = None
    for name in sorted(plan.rate_per_instance_qps):
        if not allowed(name):
            continue
        trial[name] = trial.get(name, 0) + 1
        gained = plan.capacity_qps(trial) - capacity_qps
        trial[name] -= 1
        value = _per_usd(gained, prices[name])
        if value > 0.0 and (best is None or (-value, prices[name], name) < best[:3]):
            best = (-value, prices[name], name, gained)
    return None if best is None else (best[2], best[3])


def _best_removal(
    plan: TunerStage,
    trial: dict[str, int],
    capacity_qps: float,
    needed_qps: float,
    prices: Mapping[str, float],
    keep: Callable[[str], int],
) -> tuple[str, float] | None:
    """The instance of ``trial`` whose loss costs the least modelled capacity per USD/hr saved
    (ties: pricier, then by name) while ``trial`` still serves ``needed_qps`` and keeps
    ``keep(type)`` of each type, with the capacity after it; None when none may go."""
    slack = _RELATIVE_SLACK * max(1.0, needed_qps)
    best: tuple[float, float, str, float] | None = None
    for name in sorted(trial):
        if trial[name] <= keep(name):
            continue
        trial[name] -= 1
        after = plan.capacity_qps(trial)
        trial[name] += 1
        if after + slack < needed_qps:
            continue
        price = prices[name]
        rank = max(0.0, capacity_qps - after) / price if price > 0.0 else math.inf
        if best is None or (rank, -price, name) < best[:3]:
            best = (rank, -price, name, after)
    return None if best is None else (best[2], best[3])


def _scale_up_marginal(tick: _Tick, plan: TunerStage, needed_qps: float, why: str) -> None:
    """With a capacity model: add, one at a time, the affordable instance whose capacity gain per
    USD/hr is largest (ties: cheaper, then by name) until the stage serves ``needed_qps``; one
    decision per run of the same type."""
    config, prices = tick.config, tick.config.prices_usd_per_hr
    fleet = tick.fleets[plan.name]
    trial = dict(fleet)
    capacity = plan.capacity_qps(trial)
    start = capacity
    added: list[str] = []
    while _short_qps(needed_qps, capacity) > 0.0:
        left = config.budget_usd_per_hr - tick.cost_usd_per_hr + _COST_SLACK_USD_PER_HR
        left -= sum(prices[name] for name in added)
        found = _best_addition(
            plan,
            trial,
            capacity,
            prices,
            lambda t: prices[t] <= left and _room(tick, plan.name, trial, t) > 0,  # noqa: B023
        )
        if found is None:
            break
        name, gained = found
        trial[name] = trial.get(name, 0) + 1
        capacity += gained
        added.append(name)
    before = start
    for name, run in itertools.groupby(added):
        count = len(list(run))
        fleet_after = dict(fleet)
        fleet_after[name] = fleet_after.get(name, 0) + count
        after = plan.capacity_qps(fleet_after)
        tick.launch(
            plan,
            name,
            count,
            f"scale_up: {why}; need {needed_qps:.6g} qps; added {count} x {name} (the largest "
            f"capacity gain per USD/hr of the stage's capacity model): capacity {before:.6g} -> "
            f"{after:.6g} qps, k {sum(fleet_after.values())}",
        )
        before = after
    short = _short_qps(needed_qps, capacity)
    if short > 0.0:
        best_type = max(
            plan.rate_per_instance_qps,
            key=lambda name: (_cost_effectiveness(plan, prices, name), name),
        )
        tick.decide(
            plan.name,
            "budget_capped",
            best_type,
            max(1, _ceil(short / plan.rate_per_instance_qps[best_type])),
            f"budget_capped: {why}; need {needed_qps:.6g} qps, have {capacity:.6g} qps; short "
            f"{short:.6g} qps {_held_back(tick, plan, tick.fleets[plan.name])}",
        )


def _kept_by_scale_down(plan: TunerStage, held: Mapping[str, int], name: str) -> int:
    """How many instances of type ``name`` a scale-down keeps (:func:`_scale_down`): one of a
    planned type, and at least ``held[name]``."""
    return max(1 if plan.fleet.get(name, 0) > 0 else 0, held.get(name, 0))


def _scale_down_marginal(
    tick: _Tick, plan: TunerStage, needed_qps: float, why: str, held: Mapping[str, int]
) -> bool:
    """With a capacity model: stop, one at a time, the instance whose removal loses the least
    capacity per USD/hr saved while the stage still serves ``needed_qps``, keeping
    ``min_instances``, one instance of every planned type and ``held[type]`` of a type; True
    when something stopped."""
    prices = tick.config.prices_usd_per_hr
    fleet = tick.fleets[plan.name]
    trial = dict(fleet)
    capacity = plan.capacity_qps(trial)
    removed: list[str] = []
    while sum(trial.values()) > plan.min_instances:
        found = _best_removal(
            plan,
            trial,
            capacity,
            needed_qps,
            prices,
            lambda t: _kept_by_scale_down(plan, held, t),
        )
        if found is None:
            break
        name, capacity = found
        trial[name] -= 1
        removed.append(name)
    before = plan.capacity_qps(fleet)
    for name in sorted(set(removed)):
        count = removed.count(name)
        fleet_after = dict(fleet)
        fleet_after[name] -= count
        after = plan.capacity_qps(fleet_after)
        tick.stop(
            plan,
            name,
            count,
            f"{why}; need {needed_qps:.6g} qps; stopped {count} x {name} (the least capacity "
            f"lost per USD/hr saved): capacity {before:.6g} -> {after:.6g} qps, k "
            f"{sum(fleet_after.values())}",
        )
        before = after
    return bool(removed)


# --- the sizing model's ladder ----------------------------------------------------------------


def _fleet_cost(fleet: Mapping[str, int], prices: Mapping[str, float]) -> float:
    return sum(n * prices[t] for t, n in fleet.items() if n)


def _fleet_text(fleet: Mapping[str, int]) -> str:
    return " + ".join(f"{n} x {t}" for t, n in sorted(fleet.items()) if n) or "nothing"


def _trim(
    plan: TunerStage, rung: Mapping[str, int], need_qps: float, prices: Mapping[str, float]
) -> dict[str, int]:
    """``rung`` less the instances whose loss costs the least capacity per USD/hr saved, while
    it still serves ``need_qps``, keeps one instance of each of its types (the planner chose
    the mix) and ``min_instances``."""
    trial = {t: n for t, n in rung.items() if n}
    capacity = plan.capacity_qps(trial)
    while sum(trial.values()) > plan.min_instances:
        found = _best_removal(plan, trial, capacity, need_qps, prices, lambda _t: 1)
        if found is None:
            break
        name, capacity = found
        trial[name] -= 1
    return trial


def _fill(
    plan: TunerStage,
    rung: Mapping[str, int],
    need_qps: float,
    prices: Mapping[str, float],
    max_counts: Mapping[str, int],
) -> dict[str, int] | None:
    """``rung`` plus, one at a time, the instance with the largest capacity gain per USD/hr
    (any type the stage has a rate for, within the caps) until it serves ``need_qps``; None when
    the caps stop it first."""
    trial = {t: n for t, n in rung.items() if n}
    capacity = plan.capacity_qps(trial)
    while _short_qps(need_qps, capacity) > 0.0:
        found = _best_addition(
            plan,
            trial,
            capacity,
            prices,
            lambda t: trial.get(t, 0) < max_counts.get(t, _UNCAPPED),
        )
        if found is None:
            return None
        name, gained = found
        trial[name] = trial.get(name, 0) + 1
        capacity += gained
    return {t: n for t, n in trial.items() if n}


def ladder_fleet(
    plan: TunerStage,
    need_qps: float,
    prices_usd_per_hr: Mapping[str, float],
    budget_usd_per_hr: float,
    max_counts: Mapping[str, int] | None = None,
) -> Mapping[str, int] | None:
    """The sizing model's fleet for a stage that needs ``need_qps`` (docs/tuner.md, "The mix"):
    the cheaper of the lowest rung that serves it, trimmed to it (:func:`_trim`), and the highest
    rung that does not, filled up to it (:func:`_fill`), among those within the budget and the
    caps; None when the stage has no ladder or neither fits. At the planned load the planned
    fleet itself (its rung, nothing to trim), and at a load between two rungs of the same fleet
    that fleet. The answer is kept on the stage."""
    if plan.ladder is None:
        return None
    caps = dict(max_counts or {})
    need = max(0.0, float(need_qps))
    key = (need, round(budget_usd_per_hr, 9), tuple(sorted(caps.items())))
    if key in plan._targets:
        return plan._targets[key]
    if len(plan._targets) >= _TARGET_CACHE_SIZE:
        plan._targets.clear()
    rungs = [(fleet, plan.capacity_qps(fleet)) for _, fleet in plan.ladder]
    above = next((fleet for fleet, cap in rungs if cap + _RELATIVE_SLACK * need >= need), None)
    below = next((fleet for fleet, cap in reversed(rungs) if cap < need), None)
    candidates: list[dict[str, int]] = []
    if above is not None:
        candidates.append(_trim(plan, above, need, prices_usd_per_hr))
    if below is not None:
        filled = _fill(plan, below, need, prices_usd_per_hr, caps)
        if filled is not None:
            candidates.append(filled)
    fits = [
        c
        for c in candidates
        if _fleet_cost(c, prices_usd_per_hr) <= budget_usd_per_hr + _COST_SLACK_USD_PER_HR
        and all(n <= caps.get(t, _UNCAPPED) for t, n in c.items())
    ]
    best = (
        min(
            fits,
            key=lambda c: (_fleet_cost(c, prices_usd_per_hr), sum(c.values()), sorted(c.items())),
        )
        if fits
        else None
    )
    answer = None if best is None else MappingProxyType(best)
    plan._targets[key] = answer
    return answer


def _scale_up_ladder(tick: _Tick, plan: TunerStage, needed_qps: float, why: str) -> None:
    """Launch what the sizing model's fleet for ``needed_qps`` has that the stage lacks (other
    types included), as the budget allows; then, if the stage is still short (no target within
    the budget), :func:`_scale_up` buys the most capacity per USD/hr and says what is capped."""
    config, prices = tick.config, tick.config.prices_usd_per_hr
    fleet = tick.fleets[plan.name]
    target = ladder_fleet(plan, needed_qps, prices, config.budget_usd_per_hr, tick.caps(plan.name))
    if target is not None:
        before = plan.capacity_qps(fleet)
        for name in sorted(target, key=lambda t: (-prices[t], t)):
            wanted = target[name] - fleet.get(name, 0)
            left = config.budget_usd_per_hr - tick.cost_usd_per_hr + _COST_SLACK_USD_PER_HR
            price = prices[name]
            count = wanted if price == 0.0 else min(wanted, max(0, math.floor(left / price)))
            if count <= 0:
                continue
            after_fleet = {**fleet, name: fleet.get(name, 0) + count}
            after = plan.capacity_qps(after_fleet)
            tick.launch(
                plan,
                name,
                count,
                f"scale_up: {why}; need {needed_qps:.6g} qps; the sizing model's fleet for it "
                f"is {_fleet_text(target)} (${_fleet_cost(target, prices):.4g}/hr); added "
                f"{count} x {name} (mu {plan.rate_per_instance_qps[name]:.6g} qps): capacity "
                f"{before:.6g} -> {after:.6g} qps, k {sum(after_fleet.values())}",
            )
            before = after
    if _short_qps(needed_qps, plan.capacity_qps(fleet)) > 0.0:
        _scale_up(tick, plan, needed_qps, why)


def _scale_down_ladder(tick: _Tick, plan: TunerStage, needed_qps: float, why: str) -> bool:
    """Move the stage towards the sizing model's fleet for ``needed_qps``, adding before
    removing: stop what it has beyond that fleet when it has all of it; else, when that fleet
    saves at least :data:`MIX_CHANGE_SAVING_SHARE` of what the current mix trimmed to the need
    would cost (:func:`_trim`, keeping one of each type it has) and the budget holds
    both while they overlap, launch what it lacks (the surplus stops on a later tick, once they
    serve); where the budget does not hold both, a step of the change (:func:`_mix_step`: as
    much of it as the budget holds, where that alone saves the share); else trim within the
    current mix (:func:`_scale_down`). True when something changed."""
    config, prices = tick.config, tick.config.prices_usd_per_hr
    fleet = tick.fleets[plan.name]
    target = ladder_fleet(plan, needed_qps, prices, config.budget_usd_per_hr, tick.caps(plan.name))
    if target is None:
        return _scale_down(tick, plan, needed_qps, why)
    lacking = {t: n - fleet.get(t, 0) for t, n in target.items() if n > fleet.get(t, 0)}
    surplus = {t: n - target.get(t, 0) for t, n in fleet.items() if n > target.get(t, 0)}
    aim = f"the sizing model's fleet for it is {_fleet_text(target)}"
    if not lacking:
        before = plan.capacity_qps(fleet)
        for name, count in sorted(surplus.items()):
            after_fleet = {**fleet, name: fleet[name] - count}
            after = plan.capacity_qps(after_fleet)
            tick.stop(
                plan,
                name,
                count,
                f"{why}; need {needed_qps:.6g} qps; {aim}; stopped {count} x {name}: capacity "
                f"{before:.6g} -> {after:.6g} qps, k {sum(after_fleet.values())}",
            )
            before = after
        return bool(surplus)
    # The alternative is the current mix trimmed to the need, not the current fleet.
    cost_now = _fleet_cost(_trim(plan, fleet, needed_qps, prices), prices)
    cost_target = _fleet_cost(target, prices)
    extra = _fleet_cost(lacking, prices)
    affordable = tick.cost_usd_per_hr + extra <= config.budget_usd_per_hr + _COST_SLACK_USD_PER_HR
    # A mix that costs nothing saves nothing: $0 against $0 (a free type, local.cpu) passed the
    # share, and a scale-down that read a blip bought the larger fleet the need gave.
    saves = cost_now > 0.0 and cost_target <= cost_now * (1.0 - MIX_CHANGE_SAVING_SHARE)
    if saves and affordable:
        for name, count in sorted(lacking.items()):
            tick.launch(
                plan,
                name,
                count,
                f"mix change: {why}; need {needed_qps:.6g} qps; {aim} (${cost_target:.4g}/hr "
                f"against ${cost_now:.4g}/hr in the current mix); added {count} x {name}, the "
                f"surplus "
                f"({_fleet_text(surplus)}) stops once it serves",
            )
        return True
    if saves:
        step = _mix_step(tick, plan, needed_qps, lacking, cost_now)
        if step is not None:
            added, cost_after = step
            for name, count in sorted(added.items()):
                tick.launch(
                    plan,
                    name,
                    count,
                    f"mix change in steps: {why}; need {needed_qps:.6g} qps; {aim} "
                    f"(${cost_target:.4g}/hr against ${cost_now:.4g}/hr in the current mix), "
                    f"which the budget (${config.budget_usd_per_hr:.4g}/hr) does not hold "
                    f"beside the current fleet; added {count} x {name} (the step: "
                    f"{_fleet_text(added)}), what the fleet with the step needs costing "
                    f"${cost_after:.4g}/hr: the instances it makes spare stop once it serves",
                )
            return True
    # The trim within the mix keeps what the sizing model's fleet wants more of: a step already
    # taken (its type may be the less cost-effective, which the trim would stop first, and a
    # later step buy again) stays, and what it makes spare goes.
    return _scale_down(tick, plan, needed_qps, why, {t: fleet.get(t, 0) for t in lacking})


def _mix_step(
    tick: _Tick,
    plan: TunerStage,
    needed_qps: float,
    lacking: Mapping[str, int],
    cost_now: float,
) -> tuple[dict[str, int], float] | None:
    """A step of a mix change the budget cannot hold whole beside the current fleet (both mixes
    overlapping while the new one boots): as much of what the sizing model's fleet lacks as the
    budget holds now, the types adding the most capacity per USD/hr first, where the fleet with
    it, trimmed to the need (:func:`_trim`), saves at least :data:`MIX_CHANGE_SAVING_SHARE` of
    ``cost_now`` (the current mix trimmed to it). The trim that stops what it makes spare is a
    later tick's scale-down, once it serves; the next step then has that much more of the
    budget. The instances to add and the trimmed fleet's cost with them; None when no instance
    fits the budget or the step saves too little."""
    config, prices = tick.config, tick.config.prices_usd_per_hr
    mu = plan.rate_per_instance_qps
    left = config.budget_usd_per_hr - tick.cost_usd_per_hr + _COST_SLACK_USD_PER_HR
    added: dict[str, int] = {}
    for name in sorted(lacking, key=lambda t: (-_per_usd(mu[t], prices[t]), prices[t], t)):
        price = prices[name]
        count = lacking[name] if price == 0.0 else min(lacking[name], math.floor(left / price))
        if count > 0:
            added[name] = count
            left -= count * price
    if not added:
        return None
    fleet = tick.fleets[plan.name]
    with_step = {t: fleet.get(t, 0) + added.get(t, 0) for t in {*fleet, *added}}
    cost_after = _fleet_cost(_trim(plan, with_step, needed_qps, prices), prices)
    if cost_after > cost_now * (1.0 - MIX_CHANGE_SAVING_SHARE):
        return None
    return added, cost_after


def load_factors(live_qps: ArrayLike, planned_qps: ArrayLike) -> np.ndarray:
    """f_i = r_i / p_i: the live envelope's rate over the planned one's at each window (0 where
    the planned rate is 0). The live arrivals look like the planning trace at f times its rate
    when f_i = f at every window; max_i f_i is the smallest such f that covers the live envelope
    (a planning trace compressed in time by f has, at window w, the rate f p(f w) ~ f p(w)).

    >>> load_factors([120.0, 90.0], [100.0, 80.0]).round(3).tolist()
    [1.2, 1.125]
    """
    live = np.asarray(live_qps, dtype=np.float64)
    planned = np.asarray(planned_qps, dtype=np.float64)
    out = np.zeros_like(live)
    np.divide(live, planned, out=out, where=planned > 0)
    return out


def equivalent_loads(
    live_qps: ArrayLike, windows_s: Sequence[float], planned_qps: ArrayLike
) -> np.ndarray:
    """f_i: the rate multiple at which the planning trace, compressed in time by f, is as busy at
    window i as the live arrivals, f w_i = N^-1(r_i w_i), where N(w) = w p(w) is the most
    planned arrivals in any window w (the planned envelope as a count, non-decreasing in w).

    A planning trace at f times its rate has N_f(w) = N(f w): for f > 1 its short windows look
    relatively calmer than its long ones (its bursts are the same counts in less time), so a pure
    change of rate gives one f at every window, where the plain ratio r_i / p_i (InferLine's
    constant rho, :func:`load_factors`) reads the short windows lower. N between the windows is
    interpolated log-linearly; beyond the longest window it grows at that window's rate and
    below the shortest at the shortest's.

    >>> equivalent_loads([100.0, 60.0], [1.0, 10.0], [100.0, 50.0]).round(3).tolist()
    [1.0, 1.2]
    """
    live = np.asarray(live_qps, dtype=np.float64)
    w = np.asarray(windows_s, dtype=np.float64)
    counts = np.maximum.accumulate(np.asarray(planned_qps, dtype=np.float64) * w)
    out = np.zeros_like(live)
    for i, (rate, window) in enumerate(zip(live, w, strict=True)):
        target = rate * window
        if target <= 0.0 or counts[-1] <= 0.0:
            continue
        if target <= counts[0]:
            span = target / (counts[0] / w[0])
        elif target >= counts[-1]:
            span = w[-1] + (target - counts[-1]) / (counts[-1] / w[-1])
        else:
            k = int(np.searchsorted(counts, target, side="left"))
            lo, hi = max(k - 1, 0), k
            if counts[hi] == counts[lo]:
                span = w[lo]
            else:
                t = (math.log(target) - math.log(counts[lo])) / (
                    math.log(counts[hi]) - math.log(counts[lo])
                )
                span = math.exp(math.log(w[lo]) + t * (math.log(w[hi]) - math.log(w[lo])))
        out[i] = span / window
    return out


def _scale_up_to_load(
    tick: _Tick,
    plan: TunerStage,
    capacity_qps: float,
    target: float,
    exceed_why: str,
    why: str,
) -> None:
    """Algorithm 3 with a capacity curve: the stage needs ``target`` (:meth:`TunerStage.
    capacity_for_loads_qps`) when the live envelope exceeds the planned one (``exceed_why`` says
    where; empty when it does not); a stage below its planned capacity is brought back to
    min(planned capacity, target). The reasons open as InferLine's do (the window over the plan,
    or "below plan")."""
    needed = 0.0
    if exceed_why:
        needed = target
        why = f"{exceed_why}; {why}"
    elif capacity_qps < plan.planned_capacity_qps:
        needed = min(plan.planned_capacity_qps, target)
        why = f"below plan: planned capacity {plan.planned_capacity_qps:.6g} qps; {why}"
    if needed > 0.0:
        text = f"{why}; the planner's capacity at that load {target:.6g} qps"
        _scale_up(tick, plan, needed, text)


@dataclass(frozen=True, slots=True)
class _Reading:
    """What one live envelope says against the planned one: the recent peak rate and its window,
    r_max over the windows that exceed the plan (and where), and the equivalent loads f (the
    largest, f_live, and the longest window's, f_sustained) with the text the reasons quote."""

    r_recent: float
    peak: int
    r_max: float
    exceed_why: str
    f_live: float
    f_sustained: float
    load_why: str

    @classmethod
    def of(
        cls,
        live: np.ndarray,
        windows_s: Sequence[float],
        planned: Sequence[float],
        watched_s: float = math.inf,
    ) -> _Reading:
        """The reading of ``live`` against ``planned``. The sustained load is the longest
        window's that the arrivals have been watched for (``watched_s``; the shortest window
        when none): a window longer than that holds fewer arrivals than its length would (a
        trace's or a restart's first seconds read a minute's window at a fraction of the load,
        and the headroom f_live / f_sustained then bought a stage as for a burst)."""
        exceeding = [i for i in range(len(planned)) if live[i] > planned[i]]
        r_max = 0.0
        exceed_why = ""
        if exceeding:
            top = max(exceeding, key=lambda i: (live[i], -i))
            r_max = float(live[top])
            exceed_why = (
                f"window {windows_s[top]:g} s saw {r_max:.6g} qps > planned "
                f"{planned[top]:.6g} qps ({len(exceeding)} of {len(planned)} windows over); "
                f"r_max {r_max:.6g} qps"
            )
        loads = equivalent_loads(live, windows_s, planned)
        f_top = int(np.argmax(loads))
        f_live = float(loads[f_top])
        longest = max(
            (i for i, w in enumerate(windows_s) if w <= watched_s * (1.0 + 1e-9)), default=0
        )
        f_sustained = float(loads[longest])
        load_why = (
            f"load x{f_live:.4g} of the planned envelope (window {windows_s[f_top]:g} s: "
            f"{live[f_top]:.6g} qps vs planned {planned[f_top]:.6g} qps), sustained load "
            f"x{f_sustained:.4g} (window {windows_s[longest]:g} s)"
        )
        return cls(
            float(live.max()),
            int(np.argmax(live)),
            r_max,
            exceed_why,
            f_live,
            f_sustained,
            load_why,
        )


@dataclass(frozen=True, slots=True)
class _Line:
    """A line fitted to the arrivals' counts in the bins of a span (:func:`_steady_line`): its
    rate at the span's end and at its oldest bin's middle (qps), its slope (qps per s), and the
    counts (the reasons quote them)."""

    now_qps: float
    first_qps: float
    slope_qps_per_s: float
    counts: tuple[int, ...]
    width_s: float

    def text(self, span_s: float) -> str:
        counts = ", ".join(str(c) for c in self.counts)
        return (
            f"{plain(abs(self.slope_qps_per_s), 3)} qps a second over the last {span_s:g} s "
            f"({counts} arrivals a {self.width_s:g} s)"
        )

    def ahead(self, span_s: float, horizon_s: float) -> tuple[float, str]:
        """:func:`rise_ahead` on this line; none from an empty first bin (load that starts
        after an idle gap is a step from nothing, not a steady rise: a tester's 0, 38, 97, 108,
        170, 202 arrivals a bin bought a third instance, stopped a minute later)."""
        if self.slope_qps_per_s <= 0.0 or self.counts[0] == 0:
            return 1.0, ""
        ahead = self.now_qps + self.slope_qps_per_s * horizon_s
        growth = min(RISE_MAX_GROWTH, ahead / self.now_qps)
        return growth, f"rising: {self.text(span_s)}, x{growth:.3g} in {horizon_s:g} s (a boot)"

    def now(self, span_s: float) -> tuple[float, str]:
        """:func:`fall_now` on this line."""
        if self.slope_qps_per_s >= 0.0:
            return 1.0, ""
        factor = max(1.0 / RISE_MAX_GROWTH, self.now_qps / self.first_qps)
        return factor, f"falling: {self.text(span_s)}, the load now x{factor:.3g} the span's first"


def _steady_line(arrival_s: ArrayLike, now_s: float, span_s: float, cv2: float) -> _Line | None:
    """The line through the last ``span_s`` of arrivals when the load moves along it steadily,
    else None: the span's arrivals counted in :data:`RISE_BINS` bins, a line fitted to the
    counts, its slope over :data:`RISE_Z` standard errors either way and the line a fit (the
    residuals' chi-square within :data:`RISE_FIT_CHI2`). A bin's variance is that of a renewal
    count, ``cv2`` (at least 1) times the count, plus :data:`RISE_FIT_SLACK` of the count squared
    (a daily cycle's flank is not quite a line). A rise or a fall, or a daily cycle's flank,
    passes; a step or a spike (a jump, not a line) and noise do not; nothing is read on fewer
    than :data:`RISE_MIN_ARRIVALS` arrivals, or where the line is not above 0 over the span."""
    arrivals = np.ascontiguousarray(arrival_s, dtype=np.float64)
    width = span_s / RISE_BINS
    edges = now_s - width * np.arange(RISE_BINS, -1, -1, dtype=np.float64)
    counts = np.diff(np.searchsorted(arrivals, edges, side="right")).astype(np.float64)
    if counts.sum() < RISE_MIN_ARRIVALS:
        return None
    x = edges[:-1] + width / 2.0 - now_s  # the bins' middles, s before now
    dx = x - x.mean()
    sxx = float(dx @ dx)
    slope = float(dx @ (counts - counts.mean())) / sxx  # arrivals a bin, per s
    fit = counts.mean() + slope * dx
    now_count = counts.mean() - slope * x.mean()
    if fit.min() <= 0.0 or now_count <= 0.0:
        return None
    var = max(float(cv2), 1.0) if math.isfinite(cv2) else 1.0
    variance = var * fit + (RISE_FIT_SLACK * fit) ** 2
    error = math.sqrt(float((dx * dx) @ variance)) / sxx
    misfit = float(((counts - fit) ** 2 / variance).sum())
    if abs(slope) <= RISE_Z * error or misfit > RISE_FIT_CHI2:
        return None
    return _Line(
        now_qps=now_count / width,
        first_qps=float(fit[0]) / width,
        slope_qps_per_s=slope / width,
        counts=tuple(int(c) for c in counts),
        width_s=width,
    )


def rise_ahead(
    arrival_s: ArrayLike, now_s: float, span_s: float, horizon_s: float, cv2: float
) -> tuple[float, str]:
    """How much higher the arrival rate will be ``horizon_s`` from ``now_s`` if it goes on rising
    as it rose over the last ``span_s`` (a factor over the rate at ``now_s``, >= 1, at most
    :data:`RISE_MAX_GROWTH`), and the reason's text (empty: 1.0, no steady rise).

    A steady rise is a line through the span's counts (:func:`_steady_line`) that rises; the rate
    then goes on along it: growth = (r + slope horizon) / r, r the line's rate at ``now_s``.

    >>> rng = np.random.default_rng(1)
    >>> rising = np.sort(rng.uniform(0.0, 60.0, 6000) ** 0.5 * 60.0 ** 0.5)  # rate ~ t
    >>> growth, why = rise_ahead(rising, 60.0, 60.0, 30.0, 1.0)
    >>> bool(1.4 < growth < 1.6), why.startswith("rising")
    (True, True)
    >>> rise_ahead(np.sort(rng.uniform(0.0, 60.0, 6000)), 60.0, 60.0, 30.0, 1.0)
    (1.0, '')
    """
    line = _steady_line(arrival_s, now_s, span_s, cv2)
    return (1.0, "") if line is None else line.ahead(span_s, horizon_s)


def fall_now(arrival_s: ArrayLike, now_s: float, span_s: float, cv2: float) -> tuple[float, str]:
    """While the arrival rate falls steadily over the last ``span_s`` (a line through the span's
    counts that falls, :func:`_steady_line`), the line's rate at ``now_s`` over its rate at the
    span's oldest bin (< 1, at least 1 / :data:`RISE_MAX_GROWTH`), and the reason's text; else
    (1.0, ""). The memory's envelope holds the rate of a minute ago, the highest of a fall;
    capacity can be stopped at once, so nothing is led, the load now is read.

    >>> rng = np.random.default_rng(2)
    >>> flat = rng.uniform(0.0, 60.0, 6000)  # 100 qps
    >>> fading = 60.0 - rng.uniform(0.0, 60.0, 3000) ** 0.5 * 60.0**0.5  # 100 qps down to 0
    >>> factor, why = fall_now(np.sort(np.concatenate([flat, fading])), 60.0, 60.0, 1.0)
    >>> bool(0.45 < factor < 0.6), why.startswith("falling")  # 100 qps now against 192 at 5 s
    (True, True)
    """
    line = _steady_line(arrival_s, now_s, span_s, cv2)
    return (1.0, "") if line is None else line.now(span_s)


def _sized(
    plan: TunerStage, planned_qps: tuple[float, ...], live_cv2: tuple[float, int] | None
) -> tuple[TunerStage, tuple[float, ...], str]:
    """The stage as sized for the live burstiness (``TunerStage.burstiness``; ``live_cv2`` the
    arrivals' (CV^2, gaps), None when not read), the planned envelope it is sized against
    (``planned_qps`` for the planning trace's own), and what the reasons say about it."""
    if not plan.burstiness or plan.cv2 is None or live_cv2 is None:
        return plan, planned_qps, ""
    cv2, gaps = live_cv2
    if gaps < BURSTINESS_MIN_GAPS or not math.isfinite(cv2):
        return plan, planned_qps, ""
    cv2 = max(cv2, 1e-6)  # evenly spaced arrivals: the smoothest sizing
    options = [(plan.cv2, planned_qps, plan), *plan.burstiness]
    chosen, planned, stage = min(options, key=lambda o: (abs(math.log(o[0] / cv2)), -o[0]))
    # Positional (evenly spaced arrivals, a load generator's, read "CV^2 1e-06").
    return (
        stage,
        planned,
        f"arrivals' CV^2 {plain(cv2, 3)} ({gaps} gaps): sized as CV^2 {plain(chosen, 3)}",
    )


def live_batch(
    plan: TunerStage,
    fleet: Mapping[str, int],
    arrival_s: ArrayLike,
    now_s: float,
    config: TunerConfig,
) -> int | None:
    """The most queries per batch a laddered stage serving ``fleet`` takes at ``now_s``: the
    batch (:meth:`TunerStage.batch_at`) of the ladder :func:`tune` sizes it by, the one for the
    burstiness of the last ``config.recent_s`` of ``arrival_s``; None for a stage without rung
    batches (the plan's batch)."""
    if plan.ladder is None or not plan.rung_batches:
        return None
    live_cv2 = None
    if plan.burstiness and plan.cv2 is not None:
        arrivals = np.ascontiguousarray(arrival_s, dtype=np.float64)
        lo, hi = np.searchsorted(arrivals, [now_s - config.recent_s, now_s], side="right")
        live_cv2 = arrival_cv2(arrivals[lo:hi])
    stage, _planned, _why = _sized(plan, config.planned_rate_qps, live_cv2)
    return stage.batch_at(fleet)


def load_stopped(arrivals: np.ndarray, now_s: float, persistence_s: float) -> bool:
    """Whether the load has stopped at ``now_s``: no arrival for the persistence stretch, or
    for :data:`STOPPED_GAPS` of the gaps its rate over the stretch before the last arrival
    makes, and at least :data:`STOPPED_FLOOR_S` (a burst that short is over before an instance
    boots, and its queries are served by what runs).

    >>> steady = np.arange(0.0, 30.0, 0.02)  # 50 qps until 30 s
    >>> [load_stopped(steady, t, 15.0) for t in (30.5, 31.9, 32.1)]
    [False, False, True]
    >>> slow = np.arange(0.0, 30.0, 1.0)  # 1 qps: a pause of 2 s is its own pace
    >>> [load_stopped(slow, t, 15.0) for t in (33.0, 43.9, 44.0)]
    [False, False, True]
    """
    if arrivals.size == 0:
        return True
    last = float(arrivals[-1])
    pause = now_s - last
    if pause >= persistence_s:
        return True
    if pause < STOPPED_FLOOR_S:
        return False
    recent = arrivals.size - int(np.searchsorted(arrivals, last - persistence_s, side="right"))
    rate_qps = recent / persistence_s
    return pause >= min(persistence_s, max(STOPPED_FLOOR_S, STOPPED_GAPS / rate_qps))


def _young_span_s(arrivals: np.ndarray, config: TunerConfig) -> float | None:
    """The span of ``arrivals`` (the memory's), where ``config`` may hold the memory young
    (``hold_young_memory``; young while the span is under twice ``persistence_s``): None
    without ``hold_young_memory`` or a persistence test, for no arrivals, and for a memory that
    fills its ring (``memory_ring``: its span is the ring's, not the traffic's age).

    >>> config = TunerConfig((1.0,), (5.0,), 1.0, {}, {}, persistence_s=15.0,
    ...     hold_young_memory=True, memory_ring=3)
    >>> _young_span_s(np.array([0.0, 2.0]), config), _young_span_s(np.array([0.0, 1, 2]), config)
    (2.0, None)
    """
    if not config.hold_young_memory or config.persistence_s is None or arrivals.size == 0:
        return None
    if config.memory_ring is not None and arrivals.size >= config.memory_ring:
        return None
    return float(arrivals[-1] - arrivals[0])


def _untested_windows(span_s: float | None, config: TunerConfig) -> np.ndarray:
    """Which of ``config``'s windows a young memory (``span_s``: :func:`_young_span_s`'s)
    holds at the planned rate: those the persistence test reads once the arrivals span twice
    L = max(w, persistence) (:func:`estimator.envelope.recurring_envelope`), while they span
    less. A window with 2L >= ``recent_s`` is never tested in the memory and reads the whole
    envelope, as in steady traffic.

    >>> config = TunerConfig((1.0, 16.0, 32.0), (5.0,) * 3, 1.0, {}, {}, recent_s=60.0,
    ...     persistence_s=15.0)
    >>> [_untested_windows(span, config).tolist() for span in (29.0, 31.0, 32.0)]
    [[True, True, False], [False, True, False], [False, False, False]]
    """
    windows = np.asarray(config.windows_s, dtype=np.float64)
    if span_s is None or config.persistence_s is None:
        return np.zeros(windows.size, dtype=bool)
    twice = 2.0 * np.maximum(windows, config.persistence_s)
    untested: np.ndarray = (span_s < twice) & (twice < config.recent_s)
    return untested


def _first_down_due(
    since_start_s: float,
    arrivals: np.ndarray,
    burstiness: Callable[[], tuple[float, int]],
    config: TunerConfig,
) -> bool:
    """Whether the tuner has watched long enough to scale down: its longest window, or from
    ``first_down_s`` on once the arrivals it watched tell their mean rate within
    ``first_down_precision`` (n arrivals of burstiness CV^2 give a count whose relative standard
    error is sqrt(CV^2 / n), CV^2 read no lower than a Poisson stream's 1: at 5%, 400 Poisson
    arrivals, 3,200 of CV^2 8)."""
    if since_start_s >= config.windows_s[-1]:
        return True
    if config.first_down_s is None or since_start_s < config.first_down_s:
        return False
    cv2, gaps = burstiness()
    if gaps < 2 or not math.isfinite(cv2):
        return False
    return math.sqrt(max(cv2, 1.0) / arrivals.size) <= config.first_down_precision


def tune(
    arrival_s: ArrayLike,
    now_s: float,
    state: TunerState,
    plans: Sequence[TunerStage],
    config: TunerConfig,
) -> tuple[list[ScalingDecision], TunerState]:
    """One tick of InferLine's tuner (Algorithms 3 and 4): the decisions at ``now_s`` and the state
    after them.

    ``arrival_s`` are the live arrival times seen so far, sorted; those in
    (``now_s - recent_s``, ``now_s``] form the recent envelope r_i (one rate per window). Per stage:

    * scale up when some r_i exceeds the planning envelope's rate at window i, to
      r_max s_m / rho_m of capacity (k_m = ceil(r_max s_m / (mu_m rho_m)) for one type), or, for a
      stage below its planned capacity, to min(planned capacity, r s_m / rho_m) with r = max_i r_i
      (a stage whose s_m is a live reach standing in for the plan's, ``planned_share``, reads the
      planning envelope times ``planned_share / s_m``: the app's load at which the stage carries
      its planned load);
    * else, no sooner than ``scale_down_delay_s`` after the last change, scale down to
      r s_m / rho_m, keeping ``min_instances``.

    Booting instances count for capacity and cost from launch; the whole fleet's cost never
    exceeds ``budget_usd_per_hr`` (a stage the budget leaves short gets a ``budget_capped``
    decision). Instances whose ``ready_at_s`` has passed leave ``booting``. Deterministic.

    Raises:
        WorkloadError: a ``now_s`` that is not finite, stages with the same name, or a state
            without a fleet for a stage.
        UnknownInstanceTypeError: a stage's type without a price or a boot time in ``config``.
        TraceError: arrivals that are not one-dimensional, finite and sorted.
    """
    now = _finite("now_s", now_s, low=-math.inf)
    names = [plan.name for plan in plans]
    if len(set(names)) != len(names):
        raise WorkloadError(f"stage names must be unique, got {names}")
    for plan in plans:
        if plan.name not in state.fleets:
            raise WorkloadError(f"the tuner's state has no fleet for stage {plan.name!r}")
        for name in plan.rate_per_instance_qps:
            for table, what in ((config.prices_usd_per_hr, "prices"), (config.boot_s, "boot")):
                if name not in table:
                    raise UnknownInstanceTypeError(name, list(table), where=f"tuner's {what}")

    arrivals = np.ascontiguousarray(arrival_s, dtype=np.float64)
    if arrivals.ndim == 1 and arrivals.size:
        lo, hi = np.searchsorted(arrivals, [now - config.recent_s, now], side="right")
        arrivals = arrivals[lo:hi]
    full = arrival_envelope(arrivals, config.windows_s).rate_qps
    # How long the arrivals have been watched: since the tuner started, or since the earliest
    # arrival its memory holds where that is older (a restarted loops process is fed the
    # serving process's kept arrivals).
    since_start_s = math.inf if state.started_s is None else now - state.started_s
    watched_s = since_start_s
    if arrivals.ndim == 1 and arrivals.size:
        watched_s = max(watched_s, now - float(arrivals[0]))
    # Scale-up reads the envelope without a single short burst (one that will be over before
    # an instance boots buys nothing), scale-down the whole one (capacity stays while a burst is
    # in memory): the band between the two readings is the tuner's hysteresis.
    young_span = _young_span_s(arrivals, config)
    untested = _untested_windows(young_span, config)
    downs: dict[tuple[float, ...], _Reading] = {}
    ups: dict[tuple[float, ...], _Reading] = {}
    without_burst: list[np.ndarray] = []
    live_cv2: list[tuple[float, int]] = []

    def reading_down(planned: tuple[float, ...]) -> _Reading:
        if planned not in downs:
            downs[planned] = _Reading.of(full, config.windows_s, planned, watched_s)
        return downs[planned]

    def reading_up(planned: tuple[float, ...]) -> _Reading:
        # Computed once, and only for a stage that the whole envelope would scale up: the
        # envelope without a burst is never above the whole one (tens of ms at 2,000 q/s).
        if not without_burst:
            without_burst.append(
                full
                if config.persistence_s is None
                else recurring_envelope(calm(), config.windows_s, config.persistence_s).rate_qps
            )
        if planned not in ups:
            live = without_burst[0]
            if untested.any():  # a young memory: no burst the test cannot yet take out is load
                live = np.where(untested, np.minimum(live, planned), live)
            ups[planned] = _Reading.of(live, config.windows_s, planned, watched_s)
        return ups[planned]

    def burstiness() -> tuple[float, int]:
        if not live_cv2:
            live_cv2.append(arrival_cv2(arrivals))
        return live_cv2[0]

    calmed: list[np.ndarray] = []

    def calm() -> np.ndarray:
        # The arrivals without the excess of a second that stands out of its persistence
        # stretch (a blip; :func:`estimator.envelope.clip_short_bursts`): what the scale-up's
        # envelope and the trend's line read, at every window the memory holds.
        if not calmed:
            persistence_s = config.persistence_s
            calmed.append(
                arrivals
                if persistence_s is None or arrivals.size < 2
                else clip_short_bursts(arrivals, persistence_s, burstiness()[0])
            )
        return calmed[0]

    def sized(plan: TunerStage) -> tuple[TunerStage, tuple[float, ...], str]:
        read = burstiness() if plan.burstiness and plan.cv2 is not None else None
        return _sized(plan, config.planned_rate_qps, read)

    lines: list[_Line | None] = []
    falling_since: list[float | None] = []  # the tick's, once the line is read

    def trend(plan: TunerStage) -> tuple[float, str]:
        """The factor on a laddered stage's equivalent load, and the reason's words: on a steady
        rise the load one boot ahead (:func:`rise_ahead`), on a steady fall held for
        ``fall_persist_s`` the load now (:func:`fall_now`), else (1.0, "")."""
        if not lines:
            # A span not watched whole would read as a rise from nothing.
            steady = config.lead_on_rise or config.follow_fall
            read = (
                _steady_line(calm(), now, config.recent_s, burstiness()[0])
                if steady and since_start_s >= config.recent_s
                else None
            )
            lines.append(read)
            falls = read is not None and read.slope_qps_per_s < 0.0
            held = state.falling_since_s
            falling_since.append((now if held is None else held) if falls else None)
        line = lines[0]
        if line is None:
            return 1.0, ""
        if line.slope_qps_per_s > 0.0:
            if not config.lead_on_rise:
                return 1.0, ""
            # The boot of the stage's quickest type: the soonest an addition serves (the
            # slowest's, a GPU's minute, bought too much on the tuning seed's daily cycles:
            # docs/tuner.md, "Lead on a rise").
            horizon = min((config.boot_s[t] for t in plan.rate_per_instance_qps), default=0.0)
            return line.ahead(config.recent_s, horizon)
        since = falling_since[0]
        if not config.follow_fall or since is None or now - since < config.fall_persist_s:
            return 1.0, ""
        return line.now(config.recent_s)

    tick = _Tick(
        now_s=now,
        config=config,
        fleets={stage: dict(fleet) for stage, fleet in state.fleets.items()},
        booting=[b for b in state.booting if b.ready_at_s > now],
        cost_usd_per_hr=fleet_cost_usd_per_hr(state, config.prices_usd_per_hr),
    )

    # First the limits (lowered under the fleet reached): nothing is added to a fleet over them.
    shed = _shed_to_limits(tick, plans)
    down = reading_down(config.planned_rate_qps)
    # Load that has stopped buys nothing, however busy the memory still reads (a live tuner
    # with a minute of memory had bought an instance for load that stopped 49 s before).
    stopped = config.persistence_s is not None and load_stopped(arrivals, now, config.persistence_s)
    # While the arrivals span less than twice the persistence, the test can take no burst out
    # of any window (a restarted service's backlog, load after an idle gap): a young memory.
    held_why = ""
    twice_persistence_s = 2.0 * (config.persistence_s or 0.0)
    if young_span is not None and young_span < twice_persistence_s:
        held_why = (
            f"the memory's arrivals span {young_span:.3g} s < {twice_persistence_s:g} s:"
            " a young memory buys back the plan at most"
        )
    young = bool(held_why)
    for plan in [] if stopped else plans:
        s, rho = plan.scale_factor, plan.utilisation_target
        capacity = plan.capacity_qps(tick.fleets[plan.name])
        if plan.ladder is not None:
            # A young memory buys back the plan at most (TunerConfig.hold_young_memory).
            ceiling = plan.planned_capacity_qps if young else math.inf
            # The planning trace at f_live times its rate has an envelope over the live one at
            # every window: the planner's capacity for it serves the live traffic.
            plan, planned, burst_why = sized(plan)
            factor, trend_why = trend(plan)
            whole = reading_down(planned).f_live * factor
            if _short_qps(plan.capacity_at_load_qps(whole), capacity) == 0:
                continue  # not short even on the whole envelope
            up = reading_up(planned)
            at_load = plan.capacity_at_load_qps(up.f_live * factor)
            target = min(at_load, ceiling)
            if _short_qps(target, capacity) > 0.0:
                where = (
                    f"{trend_why}; the planner's capacity there"
                    if trend_why
                    else "the planner's capacity at that load"
                )
                text = f"{up.load_why}; {where} {at_load:.6g} qps"
                if burst_why:
                    text = f"{text}; {burst_why}"
                if up.exceed_why and not young:
                    text = f"{up.exceed_why}; {text}"
                elif young or capacity < plan.planned_capacity_qps:
                    # Not more load than planned (or a young memory reads none over it): the
                    # stage is short of what it was sized for.
                    restore = ceiling if young else plan.planned_capacity_qps
                    text = f"below plan: planned capacity {restore:.6g} qps; {text}"
                    if young:
                        text = f"{text}; {held_why}"
                _scale_up_ladder(tick, plan, target, text)
            continue
        if plan.capacity_curve is not None:
            up = reading_up(config.planned_rate_qps)
            target = plan.capacity_for_loads_qps(up.f_live, up.f_sustained)
            # A young memory restores the plan at most: no load over it is read.
            exceed_why = "" if young else up.exceed_why
            load_why = f"{up.load_why}; {held_why}" if young else up.load_why
            _scale_up_to_load(tick, plan, capacity, target, exceed_why, load_why)
            continue
        if plan.planned_share is None:
            up = reading_up(config.planned_rate_qps)
        else:  # the app's load against the envelope at which the stage carries its planned load
            ratio = plan.planned_share / s
            up = reading_up(tuple(rate * ratio for rate in config.planned_rate_qps))
        # A young memory restores the plan at most: no load over it is read.
        need_exceed = 0.0 if young else up.r_max * s / rho
        need_restore = 0.0
        if capacity < plan.planned_capacity_qps:
            need_restore = min(plan.planned_capacity_qps, up.r_recent * s / rho)
        if need_exceed >= need_restore and need_exceed > 0.0:
            why, needed = f"{up.exceed_why}, s {s:.6g}, rho {rho:.6g}", need_exceed
        else:
            why = (
                f"below plan: recent peak {up.r_recent:.6g} qps at window "
                f"{config.windows_s[up.peak]:g} s, s {s:.6g}, rho {rho:.6g}, planned capacity "
                f"{plan.planned_capacity_qps:.6g} qps"
            )
            if young:
                why = f"{why}; {held_why}"
            needed = need_restore
        k_m = None
        if (
            len(plan.rate_per_instance_qps) == 1
            and plan.capacity_model is None
            and needed == need_exceed
        ):
            # One type: k_m = ceil(r_max s_m / (mu_m rho_m)) exactly as InferLine writes it.
            (mu,) = plan.rate_per_instance_qps.values()
            k_m = _ceil(up.r_max * s / (mu * rho))
        _scale_up(tick, plan, needed, why, k_m)

    changed = shed or any(d.action == "scale_up" for d in tick.decisions)
    quiet_s = math.inf if state.last_change_s is None else now - state.last_change_s
    # A scale-down waits for the tuner's own watching (the readings' watched_s may be longer:
    # a fed memory): its longest window, or less where the arrivals already tell their rate.
    if (
        not changed
        and quiet_s >= config.scale_down_delay_s
        and _first_down_due(since_start_s, arrivals, burstiness, config)
    ):
        for plan in plans:
            s, rho = plan.scale_factor, plan.utilisation_target
            if plan.capacity_curve is not None:
                burst_why = ""
                if plan.ladder is None:
                    needed = plan.capacity_for_loads_qps(down.f_live, down.f_sustained)
                    read = down
                else:
                    plan, planned, burst_why = sized(plan)
                    read = reading_down(planned)
                    # Not below what a rise will need in a boot: what the lead bought stays.
                    factor, trend_why = trend(plan)
                    needed = plan.capacity_at_load_qps(read.f_live * factor)
                    burst_why = "; ".join(w for w in (burst_why, trend_why) if w)
                why = (
                    f"scale_down: {quiet_s:.6g} s since the last change >= "
                    f"{config.scale_down_delay_s:g} s; over the last {config.recent_s:g} s "
                    f"{read.load_why}; the planner's capacity at that load {needed:.6g} qps"
                )
                if burst_why:
                    why = f"{why}; {burst_why}"
                if plan.ladder is None:
                    changed = _scale_down(tick, plan, needed, why) or changed
                elif not any(b.stage == plan.name for b in tick.booting):
                    # Adding before removing: nothing stops while the stage still boots.
                    changed = _scale_down_ladder(tick, plan, needed, why) or changed
                continue
            why = (
                f"scale_down: {quiet_s:.6g} s since the last change >= "
                f"{config.scale_down_delay_s:g} s; recent peak {down.r_recent:.6g} qps at "
                f"window {config.windows_s[down.peak]:g} s over the last {config.recent_s:g} s, "
                f"s {s:.6g}, rho {rho:.6g}"
            )
            changed = _scale_down(tick, plan, down.r_recent * s / rho, why) or changed

    next_state = TunerState(
        fleets={stage: Fleet.of(counts) for stage, counts in tick.fleets.items()},
        booting=tuple(tick.booting),
        last_change_s=now if changed else state.last_change_s,
        started_s=state.started_s,
        falling_since_s=falling_since[0] if falling_since else None,
    )
    return tick.decisions, next_state
