"""Gear plans and gear switching (CascadeServe): which cascade serves which load on a fixed fleet.

This module owns CascadeServe's offline gear plan (Kossmann et al., "CascadeServe", sections 4
and 5) on a fixed *placement* (the instances of each model, :class:`CascadePlacement`) and the
online
switcher, both as pure functions: :func:`plan_gears` returns a :class:`GearPlan`, :func:`switch`
maps (measured QPS, first-queue length, state, now) to a :class:`GearDecision` and the next
:class:`GearSwitcher`. Nothing here reads a clock or does I/O; :func:`simulate_gear_switching` runs
the switcher inside the simulator (its mode hook, ``estimator.simulator.Routing``).

**The gear plan** (section 4; the EM loop over four sub-problems collapses because the placement
is given, SP3, and SP4 is a closed-form cap rule per cascade plus the paper's minimum queue
length per gear, step 6):

1. *SP1, candidates.* Every ordered chain of the placed models (cheapest first) with every
   threshold combination of a grid (``estimator.cascades``), evaluated on the validation records:
   accuracy A(c) and reach shares s_i(c).
2. *Batch caps* (the upper bound of a batch; SP4's trigger is step 6). Stage i of c on model m
   with n_t instances of type t and batch cap k_i
   serves C_i(k_i) = sum_t n_t k_i / L_{m,t}(k_i b) queries per second (L the mean profiled
   latency, b the queries' batch size). The path bound is P = sum_i 2 max_t L_{m_i,t}(k_i b) (a
   query waits at most for the batch in service, then for its own, at each stage). Starting
   from k_i = 1 for every stage, each round takes the bottleneck stage i (least C_i / s_i, the
   first on ties) and tries the doublings 2k_i, 4k_i, ... of its cap in turn, while P (with the
   other caps as they are) stays within the SLO and the cap within floor(min_t M_{m_i,t} / b), M
   the largest profiled batch, t over m_i's placed types; the first doubling with C_i / s_i
   strictly above that at k_i becomes k_i. The rounds stop at the first where no doubling does;
   every other round strictly raises a bounded cap, so the rule ends. For a one-model cascade
   this is the cap of the highest C_1 within the bounds (ties: the smaller). Trying past the next
   doubling matters on measured profiles: cap 2 can serve less than cap 1 where cap 8 serves
   much more. Taking the first doubling that serves more, not the best, keeps a stage from
   spending more of the SLO than it needs to stop being the bottleneck. The throughput bound of
   c is B(c) = min_i C_i(k_i) / s_i. A batch takes at most k_i queued queries: the cap keeps
   every batch within the profile and the SLO's path bound.
3. *Finalists.* The candidates no other beats on both A and B (Pareto), thinned to at most
   ``max_finalists`` spread evenly over the accuracy range (the most accurate and the fastest
   always kept).
4. *Max sustainable QPS.* For each finalist the simulator finds, by bisection over the Poisson
   arrival rate (``bisection_steps`` halvings of [0, u B(c)], common random numbers), the highest
   rate r*(c) at which the P-th percentile of the simulated response time is within the SLO.
   u = ``PLAN_UTILISATION_CAP`` (0.9): a probe of ``PLAN_QUERIES`` queries lasts about a second
   at high rates, too short for a queue near saturation to build up, so the plan never counts on
   more than 90% of the bound (the long runs of ``benchmarks/gear_switching.py`` check it).
5. *SP2, gears.* [0, q_max] (q_max = the largest r*, unless given) is split into ``n_ranges``
   equal ranges. With a latency SLO, the range [lo, hi) gets the most accurate finalist with
   r* >= hi (ties: the faster); with an accuracy SLO, the finalist with A >= the floor and the
   lowest predicted tail latency at hi (interpolated from its bisection probes). A range no
   finalist serves within the SLO gets the fastest (or, with an accuracy floor none meets, the
   most accurate) and is marked ``meets_slo = False``; so is a range whose floor-meeting
   cascade does not sustain its top (r* < hi: accurate enough, not fast enough). With a latency
   SLO the first range is split at the r* of every finalist more accurate than its gear whose
   r* falls inside it (:func:`_split_first`; since 2026-12-01): q_max / n_ranges can exceed
   every accurate cascade's r* when a fast one sustains far more, and the accurate ones then
   served no load at all, not even the lowest; with an accuracy floor, a first range that does
   not meet the SLO is split at the r* of each cascade meeting the floor inside it.
6. *SP4, the minimum queue length* (section 4.5; :func:`choose_min_queue`). Online, a stage
   starts a batch only once its queue holds at least its minimum queue length (the batch then
   takes the queue up to its cap). For each gear [lo, hi) that meets the SLO, the minimum m of
   the cascade's first model starts at 1 and rises by 1 until the throughput at the batches
   the trigger forms, T(m) = min(C_1(m), min_{i>1} C_i(k_i) / s_i), reaches hi; the later
   models keep a minimum of 1 and are counted at their caps (in the paper the models of a
   cascade share GPUs and a first-model batch of m "includes more samples in each batch of
   the later models"; here each model has its own instances, and a later stage takes its
   queue, which grows by about m s_i per first-stage batch, up to its cap). SP4 errs (the
   message names the range and the bottleneck model) when m would pass the first model's cap
   k_1 (its largest profiled batch within the SLO) or the guard plus the path bound,
   sum_i 2 max_t L(batch_i b), would pass the SLO; the gear then keeps a minimum of 1. So that
   no query is stranded at low load, a stage below its minimum also starts once its oldest
   queued query has waited the *guard* ``max_wait_ms`` = min(``GUARD_FILLS`` (2) x the fill
   time (m - 1) / hi, ``GUARD_SLO_SHARE`` (1/4) x the SLO). The gear is then simulated at hi
   with its trigger and guard (the prober, common random numbers); if the tail misses the SLO
   there the gear falls back to a minimum of 1 (what the bisection simulated; past the paper).
   Gears that do not meet the SLO keep 1. The simulator (``estimator.simulator``) and the
   live dispatcher (``controlplane.serving.dispatcher``) run the same trigger and guard; a
   plan document without minimum queue lengths reads as 1 everywhere (dispatch at once).

*Held-out accuracy* (docs/cascades.md, "The held-out protocol"): given the *score* split of the
records as ``held_out`` (``records`` being the *choose* split), steps 1 to 5 run on the choose
split, every finalist is also scored on the score split, and the accuracy floor of step 5 is
checked against that held-out accuracy A'(c), not A(c): the floor is a promise about samples the
thresholds were not fitted to.

**Switching** (section 5, "Producer"): the producer measures the QPS over a fixed interval
(100 ms in the paper) and looks up the gear of the range it falls in (live, every
``gear_interval_s`` = 0.1 s over a sliding window: ``controlplane.loops.live_gears``).
CascadeServe keeps the gear "if qps < alpha x Q_0", Q_0 the length of the first model's
queue, alpha = 8. The paper states the rule for *high QPS followed by low QPS*: "CascadeServe
must avoid downgrading the gear while there are still many samples queued from the high QPS
interval". So the rule guards the move to a gear of a *lower* QPS range (slower, more
accurate): while the backlog Q_0 is more than 1/alpha of a second of arrivals, the faster gear
stays to drain it. A move to a faster gear is always taken at once: holding a slow gear under a
growing queue is what the rule must not do.

**Hysteresis** (past the paper; :class:`Hysteresis`, docs/gear-switching.md "Hysteresis"). The
paper's producer re-decides every 100 ms on a count that, at the tens of QPS of a small fleet, is
noise around any range boundary: the live demo switched 169 times in 3.8 minutes, every 100 ms at
times. So the rule has a dead band and a dwell, and a *switch* is a change of cascade:

- *dead band*: the gear moves up once the load reaches the next range's low boundary (as before),
  but moves down only once it falls below the current range's low boundary times (1 - ``band``);
  the gear moved down to is then that of load / (1 - ``band``), so no boundary it crossed is
  within the band;
- *hold*: a move down waits until the load has stayed below that line for ``down_hold_s`` (every
  evaluation in a row): a dip of the measuring window is not a fall of the load;
- *dwell*: a switch down to another cascade waits until the current cascade has been in force
  ``down_dwell_s``; a switch up (faster, for a load the current cascade cannot carry) waits only
  ``up_dwell_s``, so that no two switches come within seconds of each other, back or forth;
- *same cascade*: gears whose option (cascade, thresholds and caps) is the same differ only in
  their batch trigger; moving between them changes the trigger the loop uses, is no switch
  (:attr:`GearDecision.switched` is False), waits for no dwell and is not logged.
  ``since_s`` is the last switch (-inf before the first: the start waits for no dwell).

:meth:`Hysteresis.off` is the paper's rule without any of these (``benchmarks/gear_flapping.py``
measures both).

Past the paper, the fleet moves under the switcher (``controlplane.policies.tuner``):

- ``capacity_share`` = ready capacity / planned capacity of the placement (instances still
  booting do not count): the measured QPS is divided by it before the lookup, as CascadeServe
  rescales measured QPS onto the plan's (appendix C). While new instances boot, the gears absorb
  the load; once they serve, the share rises and a more accurate gear follows.
- ``budget_capped``: the tuner reports that the budget stops a scale-up, so capacity will not
  come. The switcher then holds its current gear against downshifts for ``cap_hold_s`` after the
  last such report: the load the budget cannot buy is absorbed by the faster gear, not by
  oscillating between gears while the tuner keeps reporting the same shortfall. Only a report
  made while the load is still in the gear's range (at or above its dead band) extends the
  hold: the tuner sizes on a minute's memory and reports the cap for that long after the load
  has gone, which held the least accurate gear for a minute at zero load.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controlplane.policies.tuner import ScalingDecision
from estimator.capacity import highest_rate
from estimator.cascades import (
    DEFAULT_THRESHOLD_GRID,
    Cascade,
    CascadeQuality,
    ValidationRecords,
    answering_stage,
    candidate_cascades,
    cascade_chains,
    cascade_stages,
    evaluate,
    pareto_mask,
)
from estimator.errors import CascadeError, FleetError, NoFeasibleGearError
from estimator.fleet import Fleet
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Routing, SimulationResult, Stage, simulate
from estimator.traces import Trace

__all__ = [
    "ALPHA",
    "DEFAULT_CAP_HOLD_S",
    "DEFAULT_DEAD_BAND_SHARE",
    "DEFAULT_DOWN_DWELL_S",
    "DEFAULT_DOWN_HOLD_S",
    "DEFAULT_RANGES",
    "DEFAULT_TICK_S",
    "DEFAULT_UP_DWELL_S",
    "GUARD_FILLS",
    "GUARD_SLO_SHARE",
    "NO_CAPACITY_SHARE",
    "PLAN_QUERIES",
    "PLAN_UTILISATION_CAP",
    "CascadePlacement",
    "Gear",
    "GearDecision",
    "GearOption",
    "GearPlan",
    "GearRun",
    "GearSwitcher",
    "Hysteresis",
    "WorkerGroup",
    "capacity_share",
    "choose_min_queue",
    "plan_gears",
    "pooled_share",
    "same_cascade",
    "simulate_gear_switching",
    "start_switcher",
    "switch",
    "switch_with_tuner",
    "time_weighted_accuracy",
]

# CascadeServe section 5: "We find that alpha = 8 works well for most scenarios."
ALPHA = 8.0
# CascadeServe's producer counts queries "over a fixed interval (e.g., 100ms)".
DEFAULT_TICK_S = 0.1
# Equal QPS ranges of the plan (CascadeServe's n_ranges; its planning time grows with it).
DEFAULT_RANGES = 8
# After the tuner's last budget_capped report, downshifts wait this long. The tuner ticks once a
# second and repeats the report every tick while short, so a few ticks without one mean the cap
# has cleared.
DEFAULT_CAP_HOLD_S = 5.0
# The capacity share that stands for none ready (the live switcher's floor: the share is a
# divisor): the fastest gear serves.
NO_CAPACITY_SHARE = 1e-6
# The switcher's hysteresis (module docstring, "Hysteresis"; the reasons and the measurement are
# in docs/gear-switching.md, "Hysteresis"). The band: a 5 s window of Poisson arrivals at the
# demo's 12 qps counts 60 queries, one standard deviation 13%; 25% is about two of them, so a
# steady load does not dip out of the band by chance within the hold.
DEFAULT_DEAD_BAND_SHARE = 0.25
# A dip must last this long, two measuring windows (live_gears.DEFAULT_WINDOW_S, 5 s), so that
# one window's noise does not switch down.
DEFAULT_DOWN_HOLD_S = 10.0
# A slower, more accurate cascade only after the current one has served this long: twice the
# tuner's scale-down quiet time (15 s), so a switch down does not race the fleet's own change.
DEFAULT_DOWN_DWELL_S = 30.0
# A faster cascade under overload after this long: the SLO cannot wait for the down dwell, but
# no two switches come within seconds of each other.
DEFAULT_UP_DWELL_S = 5.0
# Queries per simulated probe of the bisection: 2,000 resolve a P99 by 20 queries above it and
# keep a probe of a three-stage cascade near 40 ms.
PLAN_QUERIES = 2_000
DEFAULT_BISECTION_STEPS = 5
# Near saturation a short probe underestimates the tail (the queue has not built up yet): with
# 2,000 queries the bisection put one cascade at 98.5% of its bound where 30 s runs miss the
# SLO from about 94%; at 90% they hold.
PLAN_UTILISATION_CAP = 0.9
DEFAULT_MAX_FINALISTS = 8
# The starvation guard of a stage waiting for its minimum queue length (module docstring, step
# 6): twice the planned fill time at the top of the gear's range (a Poisson fill rarely takes
# longer there), never more than a quarter of the SLO.
GUARD_FILLS = 2.0
GUARD_SLO_SHARE = 0.25
# The lowest rate probed, as a share of the throughput bound: the cascade's latency at (almost)
# no load. If it misses the SLO there, the cascade misses it at every load.
_IDLE_SHARE = 0.02


# --- the placement ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CascadePlacement:
    """The instances of each model, in serving order (cheapest model first): the fixed
    allocation of models to instances that a gear plan is made for (CascadeServe keeps it fixed
    while it switches gears, so that no model has to load).

    >>> CascadePlacement.parse("tiny:c5.xlarge=1;large:c5.xlarge=3,g4dn.xlarge=1").order
    ('tiny', 'large')
    """

    fleets: Mapping[str, Fleet]
    order: tuple[str, ...]

    def __post_init__(self) -> None:
        order = tuple(self.order)
        if not order:
            raise CascadeError("placement", "places no model")
        if len(set(order)) != len(order):
            raise CascadeError("placement", f"a model appears twice in {order}")
        fleets = {m: self.fleets[m] for m in order if m in self.fleets}
        for model in order:
            if model not in fleets or fleets[model].total == 0:
                raise CascadeError("placement", f"model {model!r} has no instances")
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "fleets", fleets)

    @classmethod
    def parse(cls, text: str) -> CascadePlacement:
        """``model:type=count,type=count;model:...`` in serving order."""
        fleets: dict[str, Fleet] = {}
        order = []
        for item in (part.strip() for part in text.split(";")):
            model, sep, fleet_text = item.partition(":")
            model = model.strip()
            if not sep or not model or not fleet_text.strip():
                raise CascadeError(
                    "placement", f"{item!r} must look like model:type=count,type=count"
                )
            try:
                fleets[model] = Fleet.parse(fleet_text)
            except FleetError as error:
                raise CascadeError("placement", f"{model}: {error}") from None
            order.append(model)
        return cls(fleets, tuple(order))

    def instances(self, model: str) -> tuple[InstanceSpec, ...]:
        return tuple(InstanceSpec(name) for name in self.fleets[model].expand())

    def cost_usd_per_hr(self, prices_usd_per_hr: Mapping[str, float]) -> float:
        return float(
            sum(
                prices_usd_per_hr[t] * n for fleet in self.fleets.values() for t, n in fleet.items()
            )
        )

    def __str__(self) -> str:
        return ";".join(f"{m}:{self.fleets[m]}" for m in self.order)


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GearOption:
    """A finalist cascade with its batch caps (one per stage of the cascade), throughput bound
    B(c), simulated max sustainable QPS r*(c) and the probes of the bisection, (rate, tail ms)."""

    cascade: Cascade
    quality: CascadeQuality
    max_batch_queries: tuple[int, ...]
    bound_qps: float
    max_qps: float
    latency_curve: tuple[tuple[float, float], ...]
    compute_ms_per_query: float
    # Its accuracy on the held-out (score) split of the records, when the plan was given one;
    # ``quality`` is then the choose split's (in-sample).
    held_out_accuracy: float | None = None

    @property
    def accuracy(self) -> float:
        """The accuracy the plan reports and checks an accuracy floor against: the held-out one
        when the plan was scored on held-out records, else the in-sample one."""
        if self.held_out_accuracy is not None:
            return self.held_out_accuracy
        return self.quality.accuracy

    def tail_ms_at(self, rate_qps: float) -> float:
        """The predicted tail latency at ``rate_qps``: linear between the probes, infinite past
        the highest feasible probe when a probe beyond it missed."""
        rates = np.array([r for r, _ in self.latency_curve])
        tails = np.array([t for _, t in self.latency_curve])
        if rate_qps > rates[-1]:
            return math.inf
        return float(np.interp(rate_qps, rates, tails))


@dataclass(frozen=True, slots=True)
class Gear:
    """The gear of the QPS range [low_qps, high_qps): the option (index into the plan's
    options) that serves it, whether it meets the SLO over the whole range, and its batch
    trigger (SP4, module docstring step 6): the *minimum queue length* of each stage of the
    option's cascade (empty: 1 for every stage, dispatch at once) and the starvation guard
    ``max_wait_ms`` (a stage below its minimum starts anyway once its oldest query has waited
    that long)."""

    low_qps: float
    high_qps: float
    option: int
    meets_slo: bool
    min_queue: tuple[int, ...] = ()
    max_wait_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class GearPlan:
    """The gear plan of a placement: the finalist options and one gear per QPS range."""

    placement: CascadePlacement
    slo_ms: float
    percentile: float
    accuracy_floor: float | None
    options: tuple[GearOption, ...]
    gears: tuple[Gear, ...]
    qps_max: float
    candidates: int
    simulations: int
    # Samples of the held-out (score) split the options were scored on; None: in-sample only.
    held_out_samples: int | None = None

    def gear_for(self, qps: float) -> int:
        """The index of the gear whose range [low, high) holds ``qps`` (the last one above
        ``qps_max``, the first one below 0).

        >>> plan = GearPlan(CascadePlacement.parse("m:c=1"), 100.0, 99.0, None, (), (
        ...     Gear(0.0, 10.0, 0, True), Gear(10.0, 20.0, 0, True)), 20.0, 0, 0)
        >>> plan.gear_for(9.99), plan.gear_for(10.0), plan.gear_for(500.0)
        (0, 1, 1)
        """
        if not self.gears:
            raise CascadeError("gears", "the plan has no gears")
        lows = [gear.low_qps for gear in self.gears]
        return min(len(lows) - 1, max(0, bisect.bisect_right(lows, qps) - 1))

    def option_of(self, gear: int) -> GearOption:
        return self.options[self.gears[gear].option]

    def min_queue_of(self, gear: int) -> tuple[int, ...]:
        """The minimum queue length of each stage of gear ``gear``'s cascade (1 where the gear
        has none: a plan made before SP4 chose them)."""
        found = self.gears[gear].min_queue
        return found if found else (1,) * len(self.option_of(gear).cascade.models)

    def to_document(self) -> dict[str, Any]:
        """The plan as JSON (``heteroplane gears --json``; a cascade plan's ``gear_plan``);
        :meth:`from_document` reads it back."""
        return {
            "placement": {m: dict(self.placement.fleets[m]) for m in self.placement.order},
            "order": list(self.placement.order),
            "slo_ms": self.slo_ms,
            "percentile": self.percentile,
            "accuracy_floor": self.accuracy_floor,
            "qps_max": self.qps_max,
            "candidates": self.candidates,
            "simulations": self.simulations,
            "held_out_samples": self.held_out_samples,
            "options": [
                {
                    **o.cascade.to_document(),
                    "label": o.cascade.label,
                    "accuracy": o.quality.accuracy,
                    "held_out_accuracy": o.held_out_accuracy,
                    "reach_share": list(o.quality.reach_share),
                    "answered_share": list(o.quality.answered_share),
                    "max_batch_queries": list(o.max_batch_queries),
                    "bound_qps": o.bound_qps,
                    "max_qps": o.max_qps,
                    "latency_curve": [list(point) for point in o.latency_curve],
                    "compute_ms_per_query": o.compute_ms_per_query,
                }
                for o in self.options
            ],
            "gears": [
                {
                    "low_qps": g.low_qps,
                    "high_qps": g.high_qps,
                    "option": g.option,
                    "cascade": self.options[g.option].cascade.label,
                    "accuracy": self.options[g.option].quality.accuracy,
                    "held_out_accuracy": self.options[g.option].held_out_accuracy,
                    "meets_slo": g.meets_slo,
                    "min_queue": list(self.min_queue_of(k)),
                    "max_wait_ms": g.max_wait_ms,
                }
                for k, g in enumerate(self.gears)
            ],
        }

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> GearPlan:
        """The plan :meth:`to_document` wrote (a plan document's ``gear_plan``, stored as JSON:
        the serving order comes from ``order``, since a JSON object's keys may come back in
        another order). A gear without ``min_queue`` (a document written before SP4 chose
        minimum queue lengths) reads as 1 for every stage, and without ``max_wait_ms`` as 0:
        dispatch at once, as such plans were served.

        Raises:
            CascadeError: a document that is not a gear plan (its message names the field).
        """
        try:
            fleets = {m: Fleet.of(f) for m, f in dict(document["placement"]).items()}
            order = tuple(document.get("order") or fleets)
            options = tuple(
                GearOption(
                    cascade=Cascade(tuple(o["models"]), tuple(o["thresholds"])),
                    quality=CascadeQuality(
                        float(o["accuracy"]),
                        tuple(float(x) for x in o["reach_share"]),
                        tuple(float(x) for x in o.get("answered_share", ())),
                    ),
                    max_batch_queries=tuple(int(k) for k in o["max_batch_queries"]),
                    bound_qps=float(o["bound_qps"]),
                    max_qps=float(o["max_qps"]),
                    latency_curve=tuple(
                        (float(r), float(t)) for r, t in o.get("latency_curve", ())
                    ),
                    compute_ms_per_query=float(o["compute_ms_per_query"]),
                    held_out_accuracy=(
                        None
                        if o.get("held_out_accuracy") is None
                        else float(o["held_out_accuracy"])
                    ),
                )
                for o in document["options"]
            )
            gears = tuple(
                Gear(
                    float(g["low_qps"]),
                    float(g["high_qps"]),
                    int(g["option"]),
                    bool(g["meets_slo"]),
                    tuple(int(k) for k in g.get("min_queue") or ()),
                    float(g.get("max_wait_ms") or 0.0),
                )
                for g in document["gears"]
            )
            floor = document.get("accuracy_floor")
            held_out_samples = document.get("held_out_samples")
            plan = cls(
                placement=CascadePlacement(fleets, order),
                slo_ms=float(document["slo_ms"]),
                percentile=float(document["percentile"]),
                accuracy_floor=None if floor is None else float(floor),
                options=options,
                gears=gears,
                qps_max=float(document["qps_max"]),
                candidates=int(document.get("candidates", 0)),
                simulations=int(document.get("simulations", 0)),
                held_out_samples=None if held_out_samples is None else int(held_out_samples),
            )
        except CascadeError:
            raise
        except (KeyError, TypeError, ValueError, FleetError) as error:
            raise CascadeError("gear_plan", f"not a gear plan document: {error!r}") from None
        if not gears or any(not 0 <= g.option < len(options) for g in gears):
            raise CascadeError("gear_plan", "its gears must name options of the plan")
        for g in gears:
            stages = len(options[g.option].cascade.models)
            if g.min_queue and (len(g.min_queue) != stages or min(g.min_queue) < 1):
                raise CascadeError(
                    "gear_plan", f"a gear's min_queue needs {stages} numbers >= 1: {g.min_queue}"
                )
            if not (math.isfinite(g.max_wait_ms) and g.max_wait_ms >= 0):
                raise CascadeError("gear_plan", f"max_wait_ms must be >= 0: {g.max_wait_ms!r}")
        return plan


@dataclass(frozen=True, slots=True)
class _Candidate:
    cascade: Cascade
    quality: CascadeQuality
    caps: tuple[int, ...]
    bound_qps: float
    compute_ms: float


def _stage_capacity_qps(
    fleet: Fleet, profiles: Mapping[str, LatencyProfile], cap: int, batch_size: int
) -> float:
    return sum(
        n * cap / (profiles[t].mean_latency_ms(cap * batch_size) / 1000.0)
        for t, n in fleet.items()
        if n
    )


def _slowest_ms(fleet: Fleet, profiles: Mapping[str, LatencyProfile], size: int) -> float:
    return max(profiles[t].mean_latency_ms(size) for t, n in fleet.items() if n)


def _largest_cap(fleet: Fleet, profiles: Mapping[str, LatencyProfile], batch_size: int) -> int:
    return min(profiles[t].max_batch_size for t, n in fleet.items() if n) // batch_size


def _batch_caps(
    cascade: Cascade,
    reach: Sequence[float],
    placement: CascadePlacement,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    slo_ms: float,
    batch_size: int,
) -> tuple[tuple[int, ...], float]:
    """SP4's closed form (module docstring, step 2): caps and the throughput bound B(c)."""
    models = cascade.models
    caps = [1] * len(models)

    def capacity(i: int) -> float:
        m = models[i]
        return _stage_capacity_qps(placement.fleets[m], profiles[m], caps[i], batch_size)

    def per_query(i: int) -> float:
        return capacity(i) / reach[i] if reach[i] > 0 else math.inf

    def path_ms() -> float:
        return sum(
            2.0 * _slowest_ms(placement.fleets[m], profiles[m], caps[i] * batch_size)
            for i, m in enumerate(models)
        )

    # Each round strictly raises the bottleneck's cap or ends the loop, and every cap is bounded
    # by its largest profiled batch, so the loop ends.
    while True:
        i = min(range(len(models)), key=per_query)
        m = models[i]
        largest = _largest_cap(placement.fleets[m], profiles[m], batch_size)
        current, before = caps[i], per_query(i)
        # Measured profiles are noisy: a doubling can serve less where a later one serves much
        # more, so the doublings are tried until one serves more, not only the next. The first
        # that does is taken, not the best: a stage that takes more of the SLO than it needs to
        # stop being the bottleneck leaves the later bottlenecks less room (B(c) fell below the
        # one-doubling-a-round rule's on cascades of the demo family when it took the best).
        k, raised = current * 2, False
        while k <= largest and not raised:
            caps[i] = k
            if path_ms() > slo_ms:
                break
            raised = per_query(i) > before
            k *= 2
        if not raised:
            caps[i] = current
            break
    return tuple(caps), min(per_query(i) for i in range(len(models)))


def _guard_ms(min_queue: int, high_qps: float, slo_ms: float) -> float:
    """The starvation guard of a first stage with minimum queue length ``min_queue`` in a range
    up to ``high_qps`` (module docstring, step 6): ``GUARD_FILLS`` times the time the trigger
    takes to fill at ``high_qps``, at most ``GUARD_SLO_SHARE`` of the SLO; 0 for min_queue 1.

    >>> _guard_ms(1, 100.0, 200.0), _guard_ms(3, 100.0, 200.0), _guard_ms(9, 100.0, 200.0)
    (0.0, 40.0, 50.0)
    """
    if min_queue <= 1:
        return 0.0
    fill_ms = 1000.0 * (min_queue - 1) / high_qps if high_qps > 0 else math.inf
    return min(GUARD_FILLS * fill_ms, GUARD_SLO_SHARE * slo_ms)


def choose_min_queue(
    cascade: Cascade,
    reach: Sequence[float],
    caps: Sequence[int],
    placement: CascadePlacement,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    *,
    slo_ms: float,
    high_qps: float,
    batch_size: int = 1,
) -> tuple[tuple[int, ...], float]:
    """SP4 for one QPS range up to ``high_qps`` (module docstring, step 6): the minimum queue
    length of each stage of ``cascade`` (m for the first, 1 for the others) and the guard in ms.

    m starts at 1 and rises by 1 until the throughput at the batches the trigger forms, T(m) =
    min(C_1(m), min_{i>1} C_i(cap_i) / s_i), reaches ``high_qps``: the first stage is counted at
    batches of m (what its trigger guarantees), a later stage at its cap (its minimum stays 1:
    it takes its queue up to its cap, and the queue it gets grows with the first stage's
    batches, since each batch of m forwards about m s_i queries at once).

    Raises:
        CascadeError: no m meets the range: T(m) stays below ``high_qps`` up to m = cap_1 (the
            first stage's batch cap: its largest profiled batch within the SLO), or the guard
            plus the path bound, sum_i 2 max_t L_{m_i,t}(k_i b), passes the SLO first. The
            message names the range and the bottleneck model (CascadeServe's SP4 error).
    """
    models = cascade.models
    if not high_qps > 0:
        return (1,) * len(models), 0.0
    m = 1
    while True:
        batches = [m, *caps[1:]]
        per_query = [
            _stage_capacity_qps(placement.fleets[models[i]], profiles[models[i]], k, batch_size)
            / reach[i]
            if reach[i] > 0
            else math.inf
            for i, k in enumerate(batches)
        ]
        throughput = min(per_query)
        bottleneck = models[per_query.index(throughput)]
        guard = _guard_ms(m, high_qps, slo_ms)
        path = guard + sum(
            2.0 * _slowest_ms(placement.fleets[model], profiles[model], k * batch_size)
            for model, k in zip(models, batches, strict=True)
        )
        where = f"{cascade.label} up to {high_qps:.6g} qps"
        if path > slo_ms:
            raise CascadeError(
                "min_queue",
                f"{where}: at minimum queue length {m} the wait and the batches take"
                f" {path:.6g} ms, past the SLO of {slo_ms:g} ms, before the throughput"
                f" ({throughput:.6g} qps, bottleneck {bottleneck!r}) meets the range",
            )
        if throughput >= high_qps:
            return (m,) + (1,) * (len(models) - 1), guard
        if m + 1 > caps[0]:
            raise CascadeError(
                "min_queue",
                f"{where}: {throughput:.6g} qps at minimum queue length {m}, the largest batch"
                f" of {models[0]!r}; bottleneck {bottleneck!r}",
            )
        m += 1


def _thin(indices: list[int], accuracy: Sequence[float], keep: int) -> list[int]:
    """At most ``keep`` of ``indices`` (sorted by accuracy), spread evenly over the accuracy
    range, the first and the last always among them."""
    if len(indices) <= keep:
        return indices
    lo, hi = accuracy[indices[0]], accuracy[indices[-1]]
    chosen = {indices[0], indices[-1]}
    for k in range(1, keep - 1):
        target = lo + (hi - lo) * k / (keep - 1)
        chosen.add(min(indices, key=lambda i: (abs(accuracy[i] - target), i)))
    return sorted(chosen, key=lambda i: (accuracy[i], i))


@dataclass(slots=True)
class _Prober:
    """Simulates a cascade at a rate on one fixed Poisson pattern (common random numbers)."""

    records: ValidationRecords
    placement: CascadePlacement
    profiles: Mapping[str, Mapping[str, LatencyProfile]]
    prices: Mapping[str, float]
    slo_ms: float
    percentile: float
    batch_size: int
    seed: int
    unit_arrival_s: NDArray[np.float64] = field(init=False)
    sample_id: NDArray[np.int64] = field(init=False)
    simulations: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.unit_arrival_s = np.cumsum(rng.exponential(1.0, size=PLAN_QUERIES))
        self.sample_id = rng.integers(0, self.records.n_samples, size=PLAN_QUERIES)

    def tail_ms(
        self,
        candidate: _Candidate,
        rate_qps: float,
        min_queue: Sequence[int] = (),
        max_wait_ms: float = 0.0,
    ) -> float:
        """The tail at ``rate_qps``, each stage under its batch trigger (``min_queue``, one per
        stage; empty: dispatch at once) and the guard ``max_wait_ms``."""
        trace = Trace(
            self.unit_arrival_s / rate_qps,
            np.full(PLAN_QUERIES, self.batch_size, dtype=np.int64),
            self.sample_id,
        )
        stages = cascade_stages(
            candidate.cascade,
            self.records,
            trace.sample_id,
            {m: self.placement.instances(m) for m in candidate.cascade.models},
            self.profiles,
            max_batch_queries=dict(zip(candidate.cascade.models, candidate.caps, strict=True)),
        )
        if any(m > 1 for m in min_queue):
            stages = [
                replace(stage, min_queue=m, max_wait_s=max_wait_ms / 1000.0)
                for stage, m in zip(stages, min_queue, strict=True)
            ]
        result = simulate(
            trace, stages, np.random.default_rng(self.seed + 1), prices_usd_per_hr=self.prices
        )
        self.simulations += 1
        return float(np.percentile(result.response_ms, self.percentile))


def _max_qps(
    prober: _Prober, candidate: _Candidate, steps: int
) -> tuple[float, tuple[tuple[float, float], ...]]:
    """Bisection for r*(c) over [0, u B(c)] (:func:`estimator.capacity.highest_rate`); returns
    r* (0 when even the idle probe misses) and the probes (rate, tail) sorted by rate,
    infeasible ones included."""
    bound = PLAN_UTILISATION_CAP * candidate.bound_qps
    probes: list[tuple[float, float]] = []

    def meets(rate_qps: float) -> bool:
        tail = prober.tail_ms(candidate, rate_qps)
        probes.append((rate_qps, tail))
        return tail <= prober.slo_ms

    found = highest_rate(meets, _IDLE_SHARE * bound, bound, steps=steps)
    return found, tuple(sorted(probes))


def plan_gears(
    records: ValidationRecords,
    placement: CascadePlacement,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    prices_usd_per_hr: Mapping[str, float],
    *,
    slo_ms: float,
    percentile: float = 99.0,
    accuracy_floor: float | None = None,
    qps_max: float | None = None,
    n_ranges: int = DEFAULT_RANGES,
    grid: Sequence[float] = DEFAULT_THRESHOLD_GRID,
    batch_size: int = 1,
    max_finalists: int = DEFAULT_MAX_FINALISTS,
    bisection_steps: int = DEFAULT_BISECTION_STEPS,
    seed: int = 0,
    held_out: ValidationRecords | None = None,
) -> GearPlan:
    """The gear plan of ``placement`` (see the module docstring for the algorithm).

    ``profiles[m][t]`` is model m's latency profile on type t (every placed type needs one);
    ``batch_size`` the size of each query (cascades of single samples: 1). Deterministic for a
    seed.

    The held-out protocol (docs/cascades.md): with ``held_out`` (the *score* split of
    ``ValidationRecords.split``, ``records`` being its *choose* split), candidates, finalists and
    the most accurate gear of a range are chosen on ``records`` as before, each option is also
    scored on ``held_out`` (``GearOption.held_out_accuracy``), and an ``accuracy_floor`` is
    checked against that held-out figure, not the in-sample one.

    Raises:
        CascadeError: a placed model without records or profiles, bad parameters.
        NoFeasibleGearError: no candidate meets the latency SLO even at almost no load.
    """
    if held_out is not None and held_out.models != records.models:
        raise CascadeError("held_out", "must hold the same models as the records (a split)")
    if not (math.isfinite(slo_ms) and slo_ms > 0):
        raise CascadeError("slo_ms", f"must be a number > 0, got {slo_ms!r}")
    if n_ranges < 1 or max_finalists < 2 or bisection_steps < 1 or batch_size < 1:
        raise CascadeError(
            "", "needs n_ranges >= 1, max_finalists >= 2, bisection_steps >= 1, batch_size >= 1"
        )
    if accuracy_floor is not None and not 0 < accuracy_floor <= 1:
        raise CascadeError("accuracy_floor", f"must be in (0, 1], got {accuracy_floor!r}")
    for model in placement.order:
        records.model_index(model)
        for t in placement.fleets[model]:
            if t not in profiles.get(model, {}):
                raise CascadeError("profiles", f"no profile for model {model!r} on {t!r}")
            if t not in prices_usd_per_hr:
                raise CascadeError("prices", f"no price for instance type {t!r}")
            profiles[model][t].check_batch_size(batch_size)

    compute_ms = {
        m: min(profiles[m][t].mean_latency_ms(batch_size) for t in placement.fleets[m])
        for m in placement.order
    }
    candidates = []
    for cascade in candidate_cascades(cascade_chains(placement.order), grid):
        quality = evaluate(cascade, records)
        caps, bound = _batch_caps(
            cascade, quality.reach_share, placement, profiles, slo_ms, batch_size
        )
        compute = sum(
            r * compute_ms[m] for m, r in zip(cascade.models, quality.reach_share, strict=True)
        )
        candidates.append(_Candidate(cascade, quality, caps, bound, compute))
    accuracy = [c.quality.accuracy for c in candidates]
    front = np.flatnonzero(
        pareto_mask(np.array(accuracy), -np.array([c.bound_qps for c in candidates]))
    )
    ordered = sorted((int(i) for i in front), key=lambda i: (accuracy[i], i))
    finalists = _thin(ordered, accuracy, max_finalists)

    prober = _Prober(
        records, placement, profiles, prices_usd_per_hr, slo_ms, percentile, batch_size, seed
    )
    options = []
    best_idle: tuple[float, str] = (math.inf, "")
    for i in finalists:
        c = candidates[i]
        max_qps, curve = _max_qps(prober, c, bisection_steps)
        best_idle = min(best_idle, (curve[0][1], c.cascade.label))
        if max_qps > 0:
            scored = None if held_out is None else evaluate(c.cascade, held_out).accuracy
            options.append(
                GearOption(
                    c.cascade, c.quality, c.caps, c.bound_qps, max_qps, curve, c.compute_ms, scored
                )
            )
    if not options:
        raise NoFeasibleGearError(slo_ms, best_idle[0], best_idle[1])
    # Fastest first: the gear of the top range is the first option.
    options.sort(key=lambda o: (-o.max_qps, o.quality.accuracy))
    top = max(o.max_qps for o in options) if qps_max is None else float(qps_max)
    if not (math.isfinite(top) and top > 0):
        raise CascadeError("qps_max", f"must be a number > 0, got {qps_max!r}")
    gears = tuple(
        _gear(options, top * k / n_ranges, top * (k + 1) / n_ranges, accuracy_floor)
        for k in range(n_ranges)
    )
    gears = _split_first(gears, options, accuracy_floor)
    by_cascade = {c.cascade: c for c in candidates}
    gears = tuple(
        _triggered(gear, options[gear.option], by_cascade, prober, placement, profiles)
        for gear in gears
    )
    return GearPlan(
        placement=placement,
        slo_ms=slo_ms,
        percentile=percentile,
        accuracy_floor=accuracy_floor,
        options=tuple(options),
        gears=gears,
        qps_max=top,
        candidates=len(candidates),
        simulations=prober.simulations,
        held_out_samples=None if held_out is None else held_out.n_samples,
    )


def _triggered(
    gear: Gear,
    option: GearOption,
    candidates: Mapping[Cascade, _Candidate],
    prober: _Prober,
    placement: CascadePlacement,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
) -> Gear:
    """SP4 for one gear (module docstring, step 6): its minimum queue lengths and guard, checked
    in the simulator at the top of the range; 1 everywhere (dispatch at once, what the bisection
    simulated) where SP4 finds none or the simulated tail with them misses the SLO there."""
    stages = len(option.cascade.models)
    at_once = replace(gear, min_queue=(1,) * stages, max_wait_ms=0.0)
    if not gear.meets_slo:
        return at_once
    try:
        min_queue, wait_ms = choose_min_queue(
            option.cascade,
            option.quality.reach_share,
            option.max_batch_queries,
            placement,
            profiles,
            slo_ms=prober.slo_ms,
            high_qps=gear.high_qps,
            batch_size=prober.batch_size,
        )
    except CascadeError:
        return at_once
    if min_queue[0] == 1:
        return at_once
    tail = prober.tail_ms(candidates[option.cascade], gear.high_qps, min_queue, wait_ms)
    if tail > prober.slo_ms:
        return at_once
    return replace(gear, min_queue=min_queue, max_wait_ms=wait_ms)


def _split_first(
    gears: tuple[Gear, ...], options: Sequence[GearOption], accuracy_floor: float | None
) -> tuple[Gear, ...]:
    """The first range split at the r* of each option more accurate than its gear whose r* is
    below its top (module docstring, step 5): with equal ranges of [0, q_max], a fast cascade's
    q_max over n_ranges can exceed the r* of every more accurate one, which then served no range
    at all, not even at the lowest loads (an app answered by its 70% model at 5 q/s where its
    100% cascade sustains 36); where the first range's gear misses the SLO (its top is past
    every r*), at every r* inside it. With an accuracy floor the gears are picked by tail
    latency among the cascades that meet it, so the first range is cut only where its gear
    misses the SLO, at the r* of each of those cascades inside it: the loads below one are
    served within both halves of the SLO."""
    if not gears:
        return gears
    first = gears[0]
    if accuracy_floor is None:
        chosen = options[first.option].quality.accuracy
        # A first range past what every option sustains (a qps_max far above them) is cut at
        # each r* in it too: the loads below one are served within the SLO, whatever the top.
        cutting = [o for o in options if o.quality.accuracy > chosen or not first.meets_slo]
    elif first.meets_slo:
        return gears
    else:
        cutting = [o for o in options if o.accuracy >= accuracy_floor]
    cuts = sorted({o.max_qps for o in cutting if first.low_qps < o.max_qps < first.high_qps})
    if not cuts:
        return gears
    bounds = [first.low_qps, *cuts, first.high_qps]
    head = tuple(_gear(options, lo, hi, accuracy_floor) for lo, hi in itertools.pairwise(bounds))
    return head + gears[1:]


def _gear(
    options: Sequence[GearOption], low: float, high: float, accuracy_floor: float | None
) -> Gear:
    """SP2 for one range (module docstring, step 5); the floor is checked against
    ``GearOption.accuracy`` (held-out when the plan has it), the most accurate gear without a
    floor is the in-sample one (a choice, made on the choose split)."""
    indices = range(len(options))
    fastest = max(indices, key=lambda i: (options[i].max_qps, options[i].quality.accuracy))
    if accuracy_floor is None:
        serving = [i for i in indices if options[i].max_qps >= high]
        if not serving:
            return Gear(low, high, fastest, False)
        best = max(serving, key=lambda i: (options[i].quality.accuracy, options[i].max_qps))
        return Gear(low, high, best, True)
    accurate = [i for i in indices if options[i].accuracy >= accuracy_floor]
    if not accurate:
        best = max(indices, key=lambda i: (options[i].accuracy, options[i].max_qps))
        return Gear(low, high, best, False)
    best = min(
        accurate,
        key=lambda i: (
            options[i].tail_ms_at(high),
            -options[i].max_qps,
            -options[i].accuracy,
        ),
    )
    # Accurate enough is half the SLO: the range meets it only where that cascade also sustains
    # the range's top within the latency bound (r* >= hi, as without a floor).
    return Gear(low, high, best, options[best].max_qps >= high)


# --- switching -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hysteresis:
    """The switcher's guard against flapping (module docstring, "Hysteresis"): the dead band
    below each range's low boundary (a share of it), how long a low load must hold before a move
    down, and the least time a cascade stays in force before a switch down (``down_dwell_s``)
    or up (``up_dwell_s``).

    >>> Hysteresis.off()
    Hysteresis(band_share=0.0, down_hold_s=0.0, down_dwell_s=0.0, up_dwell_s=0.0)
    """

    band_share: float = DEFAULT_DEAD_BAND_SHARE
    down_hold_s: float = DEFAULT_DOWN_HOLD_S
    down_dwell_s: float = DEFAULT_DOWN_DWELL_S
    up_dwell_s: float = DEFAULT_UP_DWELL_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.band_share) and 0 <= self.band_share < 1):
            raise CascadeError("band_share", f"must be in [0, 1), got {self.band_share!r}")
        for name in ("down_hold_s", "down_dwell_s", "up_dwell_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise CascadeError(name, f"must be a finite number >= 0, got {value!r}")

    @classmethod
    def off(cls) -> Hysteresis:
        """CascadeServe's rule as the paper states it: no band, no hold, no dwell."""
        return cls(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class GearSwitcher:
    """The online switcher's state: the plan, the gear in force (an index into ``plan.gears``)
    and since when its cascade is (the last switch), since when the load has stayed below the
    gear's dead band (None: it has not), until when the budget cap holds downshifts, and the
    rule's parameters."""

    plan: GearPlan
    gear: int
    # When the cascade in force took force (the last switch); -inf: none yet, no dwell.
    since_s: float = -math.inf
    capped_until_s: float = -math.inf
    alpha: float = ALPHA
    cap_hold_s: float = DEFAULT_CAP_HOLD_S
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    below_since_s: float | None = None
    # The highest effective load read since ``below_since_s`` (the gear a move down goes to is
    # that of it, not of the tick that ends the hold: a dip then chose a gear the load left
    # again seconds later).
    below_peak_qps: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.gear < len(self.plan.gears):
            raise CascadeError("gear", f"no gear {self.gear} (the plan has {len(self.plan.gears)})")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise CascadeError("alpha", f"must be a finite number >= 0, got {self.alpha!r}")
        if not self.cap_hold_s >= 0:
            raise CascadeError("cap_hold_s", f"must be >= 0, got {self.cap_hold_s!r}")

    @property
    def option(self) -> GearOption:
        return self.plan.option_of(self.gear)


@dataclass(frozen=True, slots=True)
class GearDecision:
    """What :func:`switch` decided at ``at_s``: the gear now in force, the one before, and why.
    ``changed``: the gear index moved (the batch trigger may differ); ``switched``: the cascade
    did (a switch, what the live loop records)."""

    at_s: float
    gear: int
    previous: int
    measured_qps: float
    effective_qps: float
    first_queue_len: int
    reason: str
    switched: bool = False

    @property
    def changed(self) -> bool:
        return self.gear != self.previous


def start_switcher(
    plan: GearPlan,
    *,
    expected_qps: float = 0.0,
    alpha: float = ALPHA,
    cap_hold_s: float = DEFAULT_CAP_HOLD_S,
    hysteresis: Hysteresis | None = None,
) -> GearSwitcher:
    """The switcher in the gear of ``expected_qps`` (default: the lowest range's). The start is
    no switch for the dwell: a gear chosen for the load measured now has nothing to flap
    against, and a budget cut right after a plan applies must move it at once (the hold still
    applies to a move down)."""
    return GearSwitcher(
        plan,
        plan.gear_for(expected_qps),
        -math.inf,
        -math.inf,
        alpha,
        cap_hold_s,
        Hysteresis() if hysteresis is None else hysteresis,
    )


def same_cascade(plan: GearPlan, gear: int, other: int) -> bool:
    """Whether gears ``gear`` and ``other`` serve the same cascade (thresholds and caps too):
    a move between them changes only the batch trigger, no switch."""
    return plan.gears[gear].option == plan.gears[other].option or (
        plan.option_of(gear).cascade == plan.option_of(other).cascade
        and plan.option_of(gear).max_batch_queries == plan.option_of(other).max_batch_queries
    )


def switch(
    measured_qps: float,
    first_queue_len: int,
    state: GearSwitcher,
    now_s: float,
    *,
    capacity_share: float = 1.0,
    budget_capped: bool = False,
    budget_cut: bool = False,
) -> tuple[GearDecision, GearSwitcher]:
    """One producer tick: the gear for ``measured_qps`` and the next state.

    The load is q = measured_qps / capacity_share, the current gear's range [lo, hi), the band
    share w, the state's :class:`Hysteresis`. Up: at q >= hi the target is the gear of q's
    range; a switch to another cascade waits until that has been ``up_dwell_s`` since the last
    switch (a move within the cascade does not wait). Down: at q < lo (1 - w) the target is the
    gear of p / (1 - w), p the highest q read since q fell below lo (1 - w) (a reading that dips
    at the end of the hold does not choose the gear); the move waits until q has stayed below
    lo (1 - w) for ``down_hold_s``,
    while measured_qps < alpha x first_queue_len (CascadeServe's rule: the backlog of the
    high-QPS interval drains first) and while the budget cap holds (``budget_capped`` now or
    within ``cap_hold_s``); a switch to another cascade also until ``down_dwell_s`` since the
    last switch. ``budget_cut``: the capacity share is what a budget below the fleet's cost
    leaves, about to be drained; a switch up then waits for no dwell (the gear must move before
    the fleet shrinks). ``first_queue_len`` is the queue of the current gear's first model. Pure.

    >>> plan = GearPlan(CascadePlacement.parse("m:c=1"), 100.0, 99.0, None, (), (
    ...     Gear(0.0, 10.0, 0, True), Gear(10.0, 20.0, 0, True)), 20.0, 0, 0)
    >>> fast = GearSwitcher(plan, gear=1, hysteresis=Hysteresis.off())
    >>> switch(5.0, 2, fast, 1.0)[0].gear   # 5 < 8 x 2: the backlog holds the fast gear
    1
    >>> switch(5.0, 0, fast, 1.0)[0].gear
    0
    >>> banded = GearSwitcher(plan, gear=1, hysteresis=Hysteresis(0.25, 0.0, 0.0, 0.0))
    >>> switch(8.0, 0, banded, 1.0)[0].gear, switch(7.0, 0, banded, 1.0)[0].gear  # 7.5: the band
    (1, 0)
    """
    if not (math.isfinite(measured_qps) and measured_qps >= 0):
        raise CascadeError("measured_qps", f"must be a finite number >= 0, got {measured_qps!r}")
    if not (math.isfinite(capacity_share) and capacity_share > 0):
        raise CascadeError("capacity_share", f"must be > 0, got {capacity_share!r}")
    if first_queue_len < 0:
        raise CascadeError("first_queue_len", f"must be >= 0, got {first_queue_len}")
    plan, rule, current = state.plan, state.hysteresis, state.gear
    effective = measured_qps / capacity_share
    seen = f"{measured_qps:.6g} qps measured"
    if capacity_share <= NO_CAPACITY_SHARE:
        # The callers' floor for no capacity ready at all (every worker down or booting): the
        # load over it is a number of no meaning to a reader.
        seen += ", no planned capacity ready"
    elif capacity_share != 1.0:
        seen += f", {effective:.6g} qps on the planned capacity (share {capacity_share:.3g})"
    line = plan.gears[current].low_qps * (1.0 - rule.band_share)
    # A cap report extends the hold only while the load is still in the gear's range (at or
    # above its band): the tuner remembers its peak for a minute and reports the cap for as
    # long, where the load the budget could not buy may have ended (a gear held at zero load).
    capped_now = budget_capped and effective >= line
    capped_until = now_s + state.cap_hold_s if capped_now else state.capped_until_s
    below_since, below_peak = None, 0.0
    if current > 0 and effective < line:
        if state.below_since_s is None:
            below_since, below_peak = now_s, effective
        else:
            below_since, below_peak = state.below_since_s, max(state.below_peak_qps, effective)
    in_force_s = now_s - state.since_s
    gear, reason = current, f"{seen}: gear {current} holds"
    up = plan.gear_for(effective)
    if up > current:
        if budget_cut or same_cascade(plan, current, up) or in_force_s >= rule.up_dwell_s:
            gear, reason = up, f"{seen}: up from gear {current} to {up}"
        else:
            reason = (
                f"{seen}: keep gear {current} over {up}: its cascade has served {in_force_s:.3g}"
                f" s of the {rule.up_dwell_s:g} s before a switch up"
            )
    elif below_since is not None:
        down = min(current - 1, plan.gear_for(below_peak / (1.0 - rule.band_share)))
        held_s = now_s - below_since
        if held_s < rule.down_hold_s:
            reason = (
                f"{seen}: keep gear {current} over {down}: below {line:.6g} qps for {held_s:.3g}"
                f" s of the {rule.down_hold_s:g} s hold"
            )
        elif measured_qps < state.alpha * first_queue_len:
            reason = (
                f"{seen}: keep gear {current} over {down}: qps < alpha {state.alpha:g} x first"
                f" queue {first_queue_len} (backlog first)"
            )
        elif now_s < capped_until:
            reason = (
                f"{seen}: keep gear {current} over {down}: the budget caps the fleet (until"
                f" {capped_until:.6g} s)"
            )
        elif not same_cascade(plan, current, down) and in_force_s < rule.down_dwell_s:
            reason = (
                f"{seen}: keep gear {current} over {down}: its cascade has served"
                f" {in_force_s:.3g} s of the {rule.down_dwell_s:g} s before a switch down"
            )
        else:
            gear, reason = down, f"{seen}: down from gear {current} to {down}"
            if below_peak > effective:
                reason += f" (the gear of {below_peak:.6g} qps, the highest read over the hold)"
    switched = gear != current and not same_cascade(plan, current, gear)
    decision = GearDecision(
        now_s, gear, current, measured_qps, effective, first_queue_len, reason, switched
    )
    following = replace(
        state,
        gear=gear,
        since_s=now_s if switched else state.since_s,
        capped_until_s=capped_until,
        below_since_s=below_since if gear == current else None,
        below_peak_qps=below_peak if gear == current else 0.0,
    )
    return decision, following


def switch_with_tuner(
    measured_qps: float,
    first_queue_len: int,
    state: GearSwitcher,
    now_s: float,
    *,
    decisions: Iterable[ScalingDecision],
    ready: Mapping[str, Mapping[str, int]],
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    batch_size: int = 1,
) -> tuple[GearDecision, GearSwitcher]:
    """:func:`switch` fed from the tuner's tick: ``budget_capped`` when any of ``decisions``
    (``controlplane.policies.tuner.tune``'s, this tick) is one, ``capacity_share`` from ``ready``
    (the tuner's ``ready_fleets``: instances serving now, booting ones left out) against the plan's
    placement."""
    capped = any(d.action == "budget_capped" for d in decisions)
    share = capacity_share(state.plan.placement, ready, profiles, batch_size)
    return switch(
        measured_qps,
        first_queue_len,
        state,
        now_s,
        capacity_share=share,
        budget_capped=capped,
    )


def capacity_share(
    placement: CascadePlacement,
    ready: Mapping[str, Mapping[str, int]],
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    batch_size: int = 1,
) -> float:
    """Ready capacity over planned capacity, of the stage shortest of its plan: min over placed
    models m of sum_t ready_{m,t} / L_{m,t}(b) over sum_t planned_{m,t} / L_{m,t}(b) (instances
    still booting are not in ``ready``; an absent model counts as its placement).

    >>> from estimator.profiles import LatencyProfile
    >>> p = {"m": {"c": LatencyProfile("m", "c", np.array([1]), (np.array([10.0]),))}}
    >>> round(capacity_share(CascadePlacement.parse("m:c=4"), {"m": {"c": 3}}, p), 6)
    0.75
    """
    shares = []
    for model in placement.order:
        rate = {t: 1.0 / profiles[model][t].mean_latency_ms(batch_size) for t in profiles[model]}
        planned = sum(n * rate[t] for t, n in placement.fleets[model].items())
        counts = ready.get(model, placement.fleets[model])
        have = sum(n * rate[t] for t, n in counts.items() if t in rate)
        shares.append(have / planned)
    return min(shares)


# A group of identical workers for :func:`pooled_share`: its instance type and the models it
# hosts (those it may give time to).
WorkerGroup = tuple[str, frozenset[str]]


def pooled_share(
    groups: Mapping[WorkerGroup, int],
    rates_sps: Mapping[tuple[str, str], float],
    demand_sps: Mapping[str, float],
) -> float:
    """The largest share s of every model's demand that the workers serve at once: ``groups``
    counts the workers of each (type, hosted models); a worker of type t splits its time among
    the models it hosts, serving model m at ``rates_sps[(m, t)]`` samples/s (a model it hosts
    without a finite rate > 0 gets none of its time); model m needs s x ``demand_sps[m]``. One
    LP (HiGHS): maximise s over x_{g,m} >= 0 (workers of group g given to m) with
    sum_m x_{g,m} <= n_g and sum_g x_{g,m} r_{m,t_g} >= s d_m. A worker hosting every model of
    a co-located cascade is counted once, not once per model; a worker of any type counts where
    it has a rate; 0 when a model with demand has no worker able to serve it. Models of no
    demand (or not finite) are left out; without any, 1.

    >>> pooled_share({("c", frozenset("ab")): 3}, {("a", "c"): 10.0, ("b", "c"): 10.0},
    ...              {"a": 10.0, "b": 20.0})
    1.0
    >>> pooled_share({("c", frozenset("a")): 1}, {("a", "c"): 10.0}, {"a": 10.0, "b": 5.0})
    0.0
    """
    models = [m for m, d in demand_sps.items() if d > 0 and math.isfinite(d)]
    if not models:
        return 1.0
    columns = [
        (g, m)
        for g in groups
        for m in models
        if groups[g] > 0 and m in g[1] and 0 < rates_sps.get((m, g[0]), 0.0) < math.inf
    ]
    if {m for _, m in columns} != set(models):
        return 0.0
    from scipy.optimize import linprog

    n = len(columns)  # x_{g,m} in shares of d_m (x r / d), then s last
    a_ub = np.zeros((len(models) + len(groups), n + 1))
    b_ub = np.zeros(len(models) + len(groups))
    row_of_model = {m: i for i, m in enumerate(models)}
    row_of_group = {g: len(models) + i for i, g in enumerate(groups)}
    for j, (g, m) in enumerate(columns):
        # y = x r / d: the share of m's demand these workers serve; x = y d / r of their time.
        a_ub[row_of_model[m], j] = -1.0
        a_ub[row_of_group[g], j] = demand_sps[m] / rates_sps[(m, g[0])]
    for m in models:
        a_ub[row_of_model[m], n] = 1.0  # s - sum_g y_{g,m} <= 0
    for g, row in row_of_group.items():
        b_ub[row] = groups[g]
    cost = np.zeros(n + 1)
    cost[n] = -1.0
    result = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
    if result.status != 0:
        return 0.0
    return round(float(result.x[n]), 9)  # HiGHS's 0.9999999999999998 is 1


# --- switching inside the simulator ----------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class GearRun:
    """A simulated run with gear switching: the simulation, every tick's decision, and per query
    the gear in force when it arrived and whether its answer was right."""

    simulation: SimulationResult
    decisions: tuple[GearDecision, ...]
    gear: NDArray[np.int64]
    correct: NDArray[np.bool_]
    start_gear: int
    horizon_s: float

    @property
    def changes(self) -> tuple[GearDecision, ...]:
        """Every move of the gear index (a switch, or a new batch trigger on the same cascade)."""
        return tuple(d for d in self.decisions if d.changed)

    @property
    def switches(self) -> tuple[GearDecision, ...]:
        """The moves to another cascade (what the live loop records as ``gear_switch``)."""
        return tuple(d for d in self.decisions if d.switched)


class _Controller:
    """The simulator's mode controller around the pure :func:`switch` (holds the state)."""

    def __init__(
        self, state: GearSwitcher, arrival_s: NDArray[np.float64], tick_s: float, window_s: float
    ) -> None:
        self.state = state
        self.arrival_s = arrival_s
        self._period_s = tick_s
        self.window_s = window_s
        self.decisions: list[GearDecision] = []
        self.entry_stage = {
            g: state.plan.placement.order.index(state.plan.option_of(g).cascade.models[0])
            for g in range(len(state.plan.gears))
        }

    @property
    def period_s(self) -> float:
        return self._period_s

    def initial_mode(self) -> int:
        return self.state.gear

    def tick(self, now_s: float, queue_lengths: tuple[int, ...]) -> int:
        lo, hi = np.searchsorted(self.arrival_s, [now_s - self.window_s, now_s], side="right")
        measured = float(hi - lo) / self.window_s
        first = queue_lengths[self.entry_stage[self.state.gear]]
        decision, self.state = switch(measured, first, self.state, now_s)
        self.decisions.append(decision)
        return self.state.gear


def _routing(plan: GearPlan, records: ValidationRecords, sample_id: NDArray[np.int64]) -> Routing:
    """One mode per gear: its cascade's route for every query over the placement's stages."""
    order = plan.placement.order
    n, stages = sample_id.size, len(order)
    modes = len(plan.gears)
    entry = np.zeros((modes, n), dtype=np.int64)
    nxt = np.full((modes, stages, n), -1, dtype=np.int64)
    caps = np.ones((modes, stages), dtype=np.int64)
    trigger = np.ones((modes, stages), dtype=np.int64)
    wait_s = np.full((modes, stages), math.inf)
    routes: dict[int, tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]] = {}
    for g, gear in enumerate(plan.gears):
        positions = [order.index(m) for m in plan.option_of(g).cascade.models]
        trigger[g, positions] = plan.min_queue_of(g)
        wait_s[g, positions] = gear.max_wait_ms / 1000.0
        if gear.option not in routes:
            option = plan.options[gear.option]
            positions = [order.index(m) for m in option.cascade.models]
            stop = answering_stage(option.cascade, records, sample_id)
            table = np.full((stages, n), -1, dtype=np.int64)
            for i, s in enumerate(positions[:-1]):
                table[s] = np.where(stop > i, positions[i + 1], -1)
            cap = np.ones(stages, dtype=np.int64)
            cap[positions] = option.max_batch_queries
            routes[gear.option] = (np.full(n, positions[0], dtype=np.int64), table, cap)
        entry[g], nxt[g], caps[g] = routes[gear.option]
    return Routing(entry, nxt, caps, trigger, wait_s)


def simulate_gear_switching(
    trace: Trace,
    plan: GearPlan,
    records: ValidationRecords,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    prices_usd_per_hr: Mapping[str, float],
    rng: np.random.Generator,
    *,
    tick_s: float = DEFAULT_TICK_S,
    window_s: float | None = None,
    alpha: float = ALPHA,
    start_gear: int | None = None,
    hysteresis: Hysteresis | None = None,
) -> GearRun:
    """Simulate ``trace`` on the plan's placement (one stage per placed model, each with its own
    instances and queue) while :func:`switch` picks the gear every ``tick_s`` from the QPS
    measured over the last ``window_s`` (default ``tick_s``) and the current gear's first queue,
    with ``hysteresis`` (default :class:`Hysteresis`'s, as the live switcher).
    A query follows the cascade of the gear in force when it arrives; queues carry across gear
    changes (the simulator's mode hook, ``estimator.simulator.Routing``).

    Raises:
        CascadeError: a trace without sample ids, a sample outside the records.
    """
    if trace.sample_id is None:
        raise CascadeError("sample_id", "gear switching needs the trace's sample ids")
    order = plan.placement.order
    stages = [
        Stage(m, plan.placement.instances(m), profiles[m], max_batch_queries=1) for m in order
    ]
    routing = _routing(plan, records, trace.sample_id)
    first = 0 if start_gear is None else start_gear
    rule = Hysteresis() if hysteresis is None else hysteresis
    state = GearSwitcher(plan, first, 0.0, -math.inf, alpha, hysteresis=rule)
    controller = _Controller(
        state, trace.arrival_s, tick_s, tick_s if window_s is None else window_s
    )
    result = simulate(
        trace,
        stages,
        rng,
        prices_usd_per_hr=prices_usd_per_hr,
        qos_ms=plan.slo_ms,
        routing=routing,
        controller=controller,
    )
    assert result.mode is not None and result.answered_stage is not None
    rows = np.array([records.model_index(m) for m in order])
    correct = records.correct[rows[result.answered_stage], trace.sample_id]
    return GearRun(
        simulation=result,
        decisions=tuple(controller.decisions),
        gear=result.mode,
        correct=correct,
        start_gear=first,
        horizon_s=float(trace.arrival_s[-1]),
    )


def time_weighted_accuracy(
    plan: GearPlan,
    start_gear: int,
    changes: Sequence[GearDecision],
    start_s: float,
    end_s: float,
) -> float:
    """The validation accuracy of the gear in force (``GearOption.accuracy``: held-out when the
    plan has it), averaged over [start_s, end_s) by time (CascadeServe appendix C: "the
    time-weighted average of all cascades being used")."""
    if not end_s > start_s:
        raise CascadeError("", f"needs end_s > start_s, got {start_s}, {end_s}")
    gear, t, total = start_gear, start_s, 0.0
    for change in sorted(changes, key=lambda d: d.at_s):
        if change.at_s <= start_s:
            gear = change.gear
            continue
        if change.at_s >= end_s:
            break
        total += plan.option_of(gear).accuracy * (change.at_s - t)
        gear, t = change.gear, change.at_s
    total += plan.option_of(gear).accuracy * (end_s - t)
    return total / (end_s - start_s)
