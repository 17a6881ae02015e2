"""CascadeServe: cascades and gear switching against single models, in instances needed.

This experiment owns the CascadeServe result (Kossmann et al., section 6.3 and
Figure 7: "the minimum number of GPUs that are required to achieve different points in the
latency-accuracy space"): for a grid of (accuracy target, P99 latency SLO) points and one
fluctuating load trace, the least number of instances each of three approaches needs to keep
the P99 response time over the whole trace within the SLO at an accuracy of at least the target.
Every number comes from the simulator (``estimator.simulator``) running the demo model family
(``benchmarks/gear_demo.py``).

The approaches, all on one instance type and all simulated on the same trace:

- **single model** (the paper's DynBa baseline): one model on N instances, statically provisioned,
  with dynamic batching (FCFS, an idle instance takes up to k queued queries). Per model and SLO,
  every batch cap k (a power of two whose mean batch latency is within the SLO) is tried, as the
  paper grid-searches its baselines, and the least N whose P99 over the trace is within the SLO
  kept; at a target, the cheapest model whose validation accuracy reaches it.
- **model switching** (the paper's MS+): a gear plan restricted to single-model gears
  (``controlplane.policies.gears.plan_gears`` with an empty threshold grid, so every candidate is
  one model) on a placement of N instances over the models, switched by CascadeServe's rule inside
  the simulator (``simulate_gear_switching``: every 100 ms the gear of the QPS counted over the last
  :data:`WINDOW_S`, alpha = 8).
- **cascades with gear switching** (CascadeServe): the same, with every cascade of the placed
  models (thresholds 0.1 to 0.9) as candidate gears.

How a placement is found for N instances (the two gear approaches), level by level from N = 1:
for cascades a beam search, level N holding the placements reached by adding one instance to a
model of the :data:`BEAM` best placements of level N - 1 (and of the one with the most
capacity); for model switching, whose plans are cheap (one model per candidate, planned once
per model and count), every placement of N instances. A placement is scored by its plan's
prediction: the arrival-weighted accuracy of the gears the trace's rate passes through
(``plan.gear_for`` of the rate every 100 ms), or infeasible when a range the rate reaches has no
gear within the SLO. When a level's best prediction reaches a target the best accuracy verified
so far does not, its best predicted placements are simulated on the whole trace (at most
:data:`VERIFY_TRIES`); the first whose P99 is within the SLO and that reaches more targets is
the level's result. The search stops when every target is reached, when the approach's most
accurate gear is predicted and verified, for cascades after :data:`PATIENCE` levels without a
better prediction, or at :data:`MAX_INSTANCES`.

Held-out accuracy (docs/cascades.md, "The held-out protocol"): the validation records are split
half and half (``ValidationRecords.split``, label-stratified, seed :data:`SEED`). The gear plans
choose thresholds, finalists and gears on the *choose* half (``plan_gears(choose, ...,
held_out=score)``); every accuracy the experiment compares with a target (a model's, a gear's, a
run's) is measured on the *score* half, and the trace's queries carry samples of the score half.
The in-sample (choose half) figures are reported beside them.

Accuracy of a run: the mean over queries of the held-out accuracy of the cascade (or model) in
force when the query arrived (the same measure as a single model's held-out accuracy, so the
three approaches compare on one scale); the accuracy of the answers to the drawn (score half)
samples is in the data too. Accuracies are compared with the targets at two decimals of a
percent, as the tables show them.

Caveats: the placement search is a heuristic (a beam for cascades, and only the best predicted
placements simulated), so the gear approaches' counts are upper bounds on their least counts;
the score half holds about 360 samples, so one sample is about 0.28 points; each
model has its own instances (``controlplane.policies.gears.CascadePlacement``), where the
paper's MS+ and
CascadeServe co-locate several models on a GPU; the latency profiles are measured when the
experiment runs, with preempted samples clipped (:func:`clip_outliers`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.gear_demo import DemoFamily, load_demo_family
from benchmarks.results.common import (
    Context,
    Section,
    experiment_main,
    md_table,
    pyplot,
    save_figure,
)
from benchmarks.results.findings import finding
from controlplane.policies.gears import (
    CascadePlacement,
    GearPlan,
    plan_gears,
    simulate_gear_switching,
)
from estimator.cascades import (
    DEFAULT_CHOOSE_SHARE,
    ValidationRecords,
    candidate_cascades,
    cascade_chains,
    evaluate,
)
from estimator.errors import NoFeasibleGearError
from estimator.fleet import Fleet
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import RateProfile, Trace, diurnal_profile, renewal_arrivals

KEY = "cascadeserve"
SEED = 0
# SLOs as multiples of the most accurate model's mean batch-1 latency (gear_demo's SLO is 10x):
# 50, 100 and 200 ms for the real family, whose most accurate model takes 20 ms there.
SLO_MULTIPLES = (2.5, 5.0, 10.0)
QUICK_SLO_MULTIPLES = (5.0,)
# The trace's peak is this many instances' worth of the most accurate model at the loosest SLO
# (one instance: batch cap k by the gear planner's one-stage rule 2 L(k) <= SLO, k / L(k) qps),
# so that the single-model approach needs about this many instances there.
PEAK_INSTANCES = 8
TRACE_S = 120.0
QUICK_TRACE_S = 40.0
# lambda(t) = mean (1 - a cos(2 pi t / period)): two periods over the trace, and a spike of 1.5x
# for a twelfth of the trace around the first crest; peak / mean = 1.5 x 1.5 = 2.25.
AMPLITUDE = 0.5
PERIODS = 2
SPIKE_FACTOR = 1.5
SPIKE_SHARE = 1.0 / 12.0
# Accuracy targets: the models' and the best cascade's accuracies, and a grid of this step in
# points above the second most accurate model (accuracy_targets).
TARGET_STEP_POINTS = 0.1
QUICK_TARGET_STEP_POINTS = 0.25
# The gear plans: q_max = this x the trace's peak rate (measured QPS over 100 ms is noisy), in
# N_RANGES equal ranges (gear_switching.py uses 10).
QPS_MAX_HEADROOM = 1.2
N_RANGES = 10
MAX_INSTANCES = 32
BEAM = 3
QUICK_BEAM = 2
VERIFY_TRIES = 3
PATIENCE = 3
RATE_STEP_S = 0.1  # the switcher's tick: the rate is sampled this often for the predictions
# The switcher counts arrivals over this window every 100 ms tick. CascadeServe counts over the
# tick itself (100 ms); at a few hundred qps that count is off by 10-15% (Poisson), enough to
# push the load into a faster gear's range at every crest, so the count spans 5 ticks.
WINDOW_S = 0.5

Counts = tuple[int, ...]  # instances per model, in the family's order (cheapest first)


# --- the family, shared with the INFaaS experiment -------------------------------------------

# Outlier fences of a profile cell (clip_outliers): Tukey's far-out fence Q3 + 3 IQR, and never
# above this multiple of the cell's median.
TUKEY_K = 3.0
OUTLIER_FACTOR = 3.0


@dataclass(frozen=True, slots=True)
class Family:
    """The demo family as the experiments use it, and how many profile samples were clipped."""

    family: DemoFamily
    clipped: int
    samples: int

    def note(self) -> str:
        """What was done to the measured profiles, for a section's `what`."""
        return (
            f"{self.clipped} of {self.samples} latency samples lay beyond their cell's outlier"
            f" fence (Q3 + {TUKEY_K:g} IQR, at most {OUTLIER_FACTOR:g}x the median) and were"
            " clipped to it (other processes preempting the measurement, not the model), then"
            f" every profile scaled so that `{self.family.most_accurate}` keeps its batch-1 mean"
        )


_FAMILY: dict[str, Family] = {}


def clip_outliers(family: DemoFamily) -> Family:
    """``family`` with every latency sample clipped to the outlier fence of its (model, batch
    size) cell, the lower of Tukey's far-out fence Q3 + :data:`TUKEY_K` (Q3 - Q1) and
    :data:`OUTLIER_FACTOR` x the median, then every profile multiplied by one factor so that the
    most accurate model's mean batch-1 latency is what it was (``gear_demo`` sets it).

    On this shared machine a profile of 20 timed runs per cell catches the odd run preempted by
    another process at tens of times the usual latency; the simulator draws service times from
    the samples, so one such run per cell would set a stage's P99 by itself."""
    itype = family.instance_type
    top = family.most_accurate
    before = family.profiles[top][itype].mean_latency_ms(1)
    cells: dict[str, list[np.ndarray]] = {}
    clipped = total = 0
    for model in family.models:
        profile = family.profiles[model][itype]
        cells[model] = []
        for cell in profile.samples_ms:
            q1, median, q3 = (float(v) for v in np.percentile(cell, [25, 50, 75]))
            limit = min(q3 + TUKEY_K * (q3 - q1), OUTLIER_FACTOR * median)
            clipped += int(np.count_nonzero(cell > limit))
            total += int(cell.size)
            cells[model].append(np.minimum(cell, limit))
    top_profile = family.profiles[top][itype]
    after = float(np.interp(1, top_profile.batch_sizes, [c.mean() for c in cells[top]]))
    scale = before / after
    profiles = {
        m: {
            itype: LatencyProfile(
                m,
                itype,
                family.profiles[m][itype].batch_sizes,
                tuple(cell * scale for cell in cells[m]),
            )
        }
        for m in family.models
    }
    return Family(dataclasses.replace(family, profiles=profiles), clipped, total)


def demo_family(ctx: Context) -> Family:
    """The demo family (``benchmarks/gear_demo.load_demo_family``: the real one when torch and
    its cache or training are available, else the seeded synthetic one) with its outliers
    clipped (:func:`clip_outliers`), loaded once per process so that every experiment of a run
    sees the same measured profiles."""
    if "auto" not in _FAMILY:
        ctx.log("loading the demo family (benchmarks/gear_demo.py)")
        loaded = load_demo_family("auto", seed=SEED, progress=ctx.log)
        _FAMILY["auto"] = clip_outliers(loaded)
        ctx.log(f"clipped {_FAMILY['auto'].clipped} of {_FAMILY['auto'].samples} latency samples")
    return _FAMILY["auto"]


# --- pure helpers ----------------------------------------------------------------------------


def reaches(accuracy: float, target_points: float) -> bool:
    """Whether ``accuracy`` (a share) reaches ``target_points`` (percent) at two decimals.

    >>> reaches(710 / 719, 98.75), reaches(0.9874, 98.75)
    (True, False)
    """
    return round(100.0 * accuracy, 2) >= target_points - 1e-9


def accuracy_targets(
    model_accuracy: Sequence[float], best: float, step_points: float
) -> tuple[float, ...]:
    """Targets in points, at two decimals: every model's accuracy, the best cascade's
    (``best``), and every multiple of ``step_points`` between the second most accurate model's
    accuracy and ``best`` (where switching and cascades can differ from a single model).

    >>> accuracy_targets([0.9569, 0.968, 0.9805, 0.98748], 0.98887, 0.25)
    (95.69, 96.8, 98.05, 98.25, 98.5, 98.75, 98.89)
    """
    models = sorted(round(100.0 * a, 2) for a in model_accuracy)
    top = round(100.0 * best, 2)
    low = models[-2] if len(models) > 1 else models[-1]
    k = math.floor(low / step_points + 1e-9) + 1
    grid = []
    while round(k * step_points, 2) < top:
        grid.append(round(k * step_points, 2))
        k += 1
    return tuple(sorted({*models, top, *grid}))


def least_instances(meets: Callable[[int], bool], most: int) -> int | None:
    """The least n in 1..``most`` with ``meets(n)``, assuming ``meets`` is monotone (false, then
    true): doubling, then bisection. None when ``meets(most)`` is false.

    >>> least_instances(lambda n: n >= 5, 32), least_instances(lambda n: n >= 40, 32)
    (5, None)
    """
    high = 1
    while not meets(high):
        if high >= most:
            return None
        high = min(2 * high, most)
    low = high // 2  # meets(low) is false (or low is 0)
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def range_weights(rates_qps: np.ndarray, qps_max: float, n_ranges: int) -> np.ndarray:
    """The arrival mass (sum of the sampled rates) in each of ``n_ranges`` equal QPS ranges of
    [0, ``qps_max``), the last range taking everything above (as ``GearPlan.gear_for`` does).

    >>> range_weights(np.array([1.0, 6.0, 30.0]), 10.0, 2).tolist()
    [1.0, 36.0]
    """
    width = qps_max / n_ranges
    index = np.minimum(np.floor(rates_qps / width).astype(np.int64), n_ranges - 1)
    return np.bincount(index, weights=rates_qps, minlength=n_ranges).astype(np.float64)


def predicted_accuracy(gear_accuracy: Sequence[float | None], weights: np.ndarray) -> float | None:
    """The arrival-weighted accuracy of the gears of the ranges the load reaches; None when a
    range it reaches has no gear within the SLO (``None`` in ``gear_accuracy``).

    >>> round(predicted_accuracy([0.9, 0.8, None], np.array([1.0, 3.0, 0.0])), 6)
    0.825
    """
    total = 0.0
    for accuracy, weight in zip(gear_accuracy, weights, strict=True):
        if weight <= 0:
            continue
        if accuracy is None:
            return None
        total += accuracy * float(weight)
    return total / float(weights.sum())


def compositions(total: int, parts: int) -> list[Counts]:
    """Every way to put ``total`` instances on ``parts`` models (zeros allowed).

    >>> compositions(2, 2)
    [(0, 2), (1, 1), (2, 0)]
    """
    if parts == 1:
        return [(total,)]
    return [
        (first, *rest)
        for first in range(total + 1)
        for rest in compositions(total - first, parts - 1)
    ]


def expansions(counts: Counts) -> list[Counts]:
    """The placements with one instance more than ``counts``, on each model in turn.

    >>> expansions((1, 0))
    [(2, 0), (1, 1)]
    """
    return [tuple(c + (i == j) for j, c in enumerate(counts)) for i in range(len(counts))]


# --- the setup -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    family: DemoFamily
    family_note: str
    slos_ms: tuple[float, ...]
    targets: tuple[float, ...]
    profile: RateProfile
    trace: Trace
    duration_s: float
    peak_qps: float
    mean_qps: float
    qps_max: float
    rates: np.ndarray  # the load's rate every RATE_STEP_S
    weights: np.ndarray  # its mass in each of N_RANGES equal ranges
    best_cascade: str
    best_cascade_accuracy: float  # held-out (score half)
    top_capacity_qps: float
    top_cap: int
    # The held-out protocol's halves of family.records: plans choose on ``choose``, every
    # accuracy compared with a target is measured on ``score``.
    choose: ValidationRecords
    score: ValidationRecords
    best_cascade_in_sample: float

    @property
    def prices(self) -> dict[str, float]:
        return {self.family.instance_type: self.family.price_usd_per_hr}


def one_stage_cap(profile: Any, slo_ms: float) -> int:
    """The largest power of two k with 2 L(k) <= SLO: the largest cap the gear planner's path
    bound allows one stage (its rule may take a smaller one that serves more)."""
    cap = 1
    while cap * 2 <= profile.max_batch_size and 2.0 * profile.mean_latency_ms(cap * 2) <= slo_ms:
        cap *= 2
    return cap


def make_setup(ctx: Context) -> Setup:
    loaded = demo_family(ctx)
    family = loaded.family
    top = family.most_accurate
    top_profile = family.profiles[top][family.instance_type]
    top_ms = top_profile.mean_latency_ms(1)
    multiples = QUICK_SLO_MULTIPLES if ctx.quick else SLO_MULTIPLES
    slos = tuple(float(f"{m * top_ms:.3g}") for m in multiples)
    cap = one_stage_cap(top_profile, max(slos))
    capacity = cap / (top_profile.mean_latency_ms(cap) / 1000.0)
    peak = PEAK_INSTANCES * capacity
    mean = peak / ((1.0 + AMPLITUDE) * SPIKE_FACTOR)
    duration = QUICK_TRACE_S if ctx.quick else TRACE_S
    period = duration / PERIODS
    spike_s = SPIKE_SHARE * duration
    profile = diurnal_profile(
        mean,
        duration,
        period_s=period,
        amplitude=AMPLITUDE,
        spikes=[(0.5 * period - 0.5 * spike_s, spike_s, SPIKE_FACTOR)],
    )
    choose, score = family.records.split(DEFAULT_CHOOSE_SHARE, SEED)
    rng = np.random.default_rng(SEED)
    arrival = renewal_arrivals(profile, duration, 1.0, rng)
    # Queries carry samples of the score half: the answers a run counts are held-out too.
    trace = Trace(
        arrival,
        np.ones(arrival.size, dtype=np.int64),
        rng.integers(0, score.n_samples, size=arrival.size),
    )
    # The most accurate cascade of the grid on the choose half (the shortest of equals), and
    # its held-out accuracy.
    best = max(
        (
            (evaluate(c, choose).accuracy, -len(c.models), c.label, c)
            for c in candidate_cascades(cascade_chains(choose.models))
        ),
        key=lambda entry: entry[:3],
    )
    best_held_out = evaluate(best[3], score).accuracy
    step = QUICK_TARGET_STEP_POINTS if ctx.quick else TARGET_STEP_POINTS
    targets = accuracy_targets([score.model_accuracy(m) for m in score.models], best_held_out, step)
    rates = profile.rate_at(np.arange(0.0, duration, RATE_STEP_S))
    peak_rate = float(np.max(rates))
    qps_max = QPS_MAX_HEADROOM * peak_rate
    return Setup(
        family=family,
        family_note=loaded.note(),
        slos_ms=slos,
        targets=targets,
        profile=profile,
        trace=trace,
        duration_s=duration,
        peak_qps=peak_rate,
        mean_qps=float(len(trace) / duration),
        qps_max=qps_max,
        rates=rates,
        weights=range_weights(rates, qps_max, N_RANGES),
        best_cascade=best[2],
        best_cascade_accuracy=best_held_out,
        top_capacity_qps=capacity,
        top_cap=cap,
        choose=choose,
        score=score,
        best_cascade_in_sample=best[0],
    )


# --- the single-model approach ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SingleResult:
    model: str
    accuracy: float  # held-out (score half)
    instances: int | None
    batch_cap: int | None
    p99_ms: float | None
    in_sample_accuracy: float | None = None  # the choose half


def single_model(setup: Setup, model: str, slo_ms: float) -> SingleResult:
    """The least instances of ``model`` alone within the SLO on the trace, over every batch cap
    (a power of two whose mean batch latency is within the SLO; the paper grid-searches its
    baselines' settings): the cap with the fewest instances, ties to the lower P99."""
    family = setup.family
    itype = family.instance_type
    profile = family.profiles[model][itype]
    caps = [
        k
        for k in (2**i for i in range(13))
        if k <= profile.max_batch_size and profile.mean_latency_ms(k) <= slo_ms
    ] or [1]
    tails: dict[tuple[int, int], float] = {}

    def p99(n: int, cap: int) -> float:
        if (n, cap) not in tails:
            stage = Stage(
                model,
                tuple(InstanceSpec(itype) for _ in range(n)),
                {itype: profile},
                max_batch_queries=cap,
            )
            result = simulate(
                setup.trace,
                [stage],
                np.random.default_rng(SEED + 1),
                prices_usd_per_hr=setup.prices,
            )
            tails[n, cap] = float(np.percentile(result.response_ms, 99))
        return tails[n, cap]

    best: tuple[int, float, int] | None = None
    for cap in caps:
        n = least_instances(functools.partial(_within, p99, cap, slo_ms), MAX_INSTANCES)
        if n is not None and (best is None or (n, p99(n, cap)) < best[:2]):
            best = (n, p99(n, cap), cap)
    accuracy = setup.score.model_accuracy(model)
    in_sample = setup.choose.model_accuracy(model)
    if best is None:
        return SingleResult(model, accuracy, None, None, None, in_sample)
    return SingleResult(model, accuracy, best[0], best[2], best[1], in_sample)


def _within(p99: Callable[[int, int], float], cap: int, slo_ms: float, n: int) -> bool:
    return p99(n, cap) <= slo_ms


def planner_cap(setup: Setup, model: str, slo_ms: float) -> int | None:
    """The batch cap the gear planner gives ``model`` alone on one instance (its SP4 rule)."""
    counts = tuple(int(m == model) for m in setup.family.models)
    plan = make_plan(setup, counts, slo_ms, single_only=True)
    return None if plan is None else plan.options[0].max_batch_queries[0]


# --- the gear approaches ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """A placement and its plan's prediction: accuracy (None: infeasible) and best max QPS."""

    counts: Counts
    predicted: float | None
    max_qps: float
    plan: GearPlan | None = field(default=None, compare=False)

    @property
    def score(self) -> tuple[int, float, float]:
        return (self.predicted is not None, self.predicted or 0.0, self.max_qps)


@dataclass(frozen=True, slots=True)
class Verified:
    """A placement simulated on the whole trace with gear switching."""

    counts: Counts
    placement: str
    p99_ms: float
    attainment: float
    accuracy: float  # query-weighted held-out accuracy of the gear in force at arrival
    answered_accuracy: float  # answers to the drawn (score half) validation samples
    cascades: dict[str, float]  # share of queries per cascade
    cascade_changes: int
    predicted: float
    series_accuracy: list[float]  # per 1 s window by arrival: mean accuracy of the gear in force
    in_sample_accuracy: float | None = None  # as ``accuracy``, with the choose half's accuracies

    @property
    def instances(self) -> int:
        return sum(self.counts)

    def to_data(self) -> dict[str, Any]:
        return {
            "instances": self.instances,
            "placement": self.placement,
            "p99_ms": self.p99_ms,
            "attainment": self.attainment,
            "accuracy": self.accuracy,
            "held_out_accuracy": self.accuracy,
            "in_sample_accuracy": self.in_sample_accuracy,
            "answered_accuracy": self.answered_accuracy,
            "predicted_accuracy": self.predicted,
            "cascade_share": self.cascades,
            "cascade_changes": self.cascade_changes,
        }


def placement_of(models: Sequence[str], counts: Counts, itype: str) -> CascadePlacement:
    order = tuple(m for m, c in zip(models, counts, strict=True) if c > 0)
    fleets = {m: Fleet.of({itype: c}) for m, c in zip(models, counts, strict=True) if c > 0}
    return CascadePlacement(fleets, order)


def make_plan(setup: Setup, counts: Counts, slo_ms: float, single_only: bool) -> GearPlan | None:
    family = setup.family
    try:
        return plan_gears(
            setup.choose,
            placement_of(family.models, counts, family.instance_type),
            family.profiles,
            setup.prices,
            slo_ms=slo_ms,
            qps_max=setup.qps_max,
            n_ranges=N_RANGES,
            grid=() if single_only else (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
            seed=SEED,
            held_out=setup.score,
        )
    except NoFeasibleGearError:
        return None


def plan_prediction(plan: GearPlan, rates_qps: np.ndarray) -> float | None:
    """The plan's predicted accuracy over the trace: its gears' ``GearOption.accuracy`` (held-out
    when the plan was scored on held-out records), weighted by the load's mass in each gear's
    range (:func:`gear_weights`)."""
    gear_accuracy = [plan.options[g.option].accuracy if g.meets_slo else None for g in plan.gears]
    return predicted_accuracy(gear_accuracy, gear_weights(plan, rates_qps))


def gear_weights(plan: GearPlan, rates_qps: np.ndarray) -> np.ndarray:
    """The arrival mass (sum of the sampled rates) in each of the plan's gears' ranges, a rate
    going to the gear ``GearPlan.gear_for`` picks. A plan's gears are not always the
    ``N_RANGES`` equal ranges: the first one is split where a more accurate cascade's capacity
    falls inside it (``controlplane.policies.gears``).

    >>> from controlplane.policies.gears import Gear
    >>> gears = (Gear(0.0, 4.0, 0, True), Gear(4.0, 10.0, 0, True), Gear(10.0, 20.0, 0, True))
    >>> plan = GearPlan(CascadePlacement.parse("m:c=1"), 100.0, 99.0, None, (), gears, 20.0, 0, 0)
    >>> gear_weights(plan, np.array([1.0, 5.0, 6.0, 30.0])).tolist()
    [1.0, 11.0, 30.0]
    """
    lows = np.array([gear.low_qps for gear in plan.gears])
    index = np.clip(np.searchsorted(lows, rates_qps, side="right") - 1, 0, len(lows) - 1)
    return np.bincount(index, weights=rates_qps, minlength=len(lows)).astype(np.float64)


def verify(setup: Setup, candidate: Candidate, slo_ms: float, plan: GearPlan) -> Verified:
    family = setup.family
    trace = setup.trace
    run = simulate_gear_switching(
        trace,
        plan,
        setup.score,
        family.profiles,
        setup.prices,
        np.random.default_rng(SEED + 1),
        window_s=WINDOW_S,
        start_gear=plan.gear_for(float(setup.profile.rate_at(0.0))),
    )
    response = run.simulation.response_ms
    gear_accuracy = np.array([plan.option_of(g).accuracy for g in range(len(plan.gears))])
    in_sample = np.array([plan.option_of(g).quality.accuracy for g in range(len(plan.gears))])
    served = gear_accuracy[run.gear]
    labels = [plan.option_of(g).cascade.label for g in range(len(plan.gears))]
    shares: dict[str, float] = {}
    for g, count in zip(*np.unique(run.gear, return_counts=True), strict=True):
        shares[labels[int(g)]] = shares.get(labels[int(g)], 0.0) + int(count) / len(trace)
    second = np.minimum(trace.arrival_s.astype(np.int64), int(setup.duration_s) - 1)
    sums = np.bincount(second, weights=served, minlength=int(setup.duration_s))
    counts = np.bincount(second, minlength=int(setup.duration_s))
    series = np.divide(sums, counts, out=np.full(sums.shape, np.nan), where=counts > 0)
    return Verified(
        counts=candidate.counts,
        placement=str(plan.placement),
        p99_ms=float(np.percentile(response, 99)),
        attainment=float(np.mean(response <= slo_ms)),
        accuracy=float(served.mean()),
        answered_accuracy=float(run.correct.mean()),
        cascades=shares,
        cascade_changes=sum(
            1 for d in run.changes if plan.gears[d.gear].option != plan.gears[d.previous].option
        ),
        predicted=candidate.predicted or 0.0,
        series_accuracy=[round(float(v), 6) for v in series],
        in_sample_accuracy=float(in_sample[run.gear].mean()),
    )


@dataclass(slots=True)
class SearchLog:
    levels: list[Verified] = field(default_factory=list)
    plans: int = 0
    simulations: int = 0
    stopped: str = ""


def search(
    setup: Setup,
    slo_ms: float,
    evaluate_counts: Callable[[Counts], Candidate],
    plan_for: Callable[[Candidate], GearPlan | None],
    beam: int | None,
    patience: int | None,
    ceiling: float,
    log: Callable[[str], None],
    name: str,
) -> SearchLog:
    """The search of the module docstring (every placement of each level when ``beam`` is
    None): per level of N instances, the verified best. ``ceiling``: the accuracy of the
    approach's most accurate gear (no placement predicts more).

    A level is simulated only when its best prediction reaches a target the best verified
    accuracy so far does not: the table needs the least count per target, nothing more."""
    n_models = len(setup.family.models)

    def covered(accuracy: float) -> int:
        return sum(reaches(accuracy, t) for t in setup.targets)

    seen: dict[Counts, Candidate] = {}
    out = SearchLog()
    frontier: list[Counts] = []
    best_score: tuple[int, float, float] | None = None
    best_verified = 0.0
    stale = 0
    for n in range(1, MAX_INSTANCES + 1):
        if beam is None:
            level = compositions(n, n_models)
        elif n == 1:
            level = [tuple(int(i == j) for j in range(n_models)) for i in range(n_models)]
        else:
            level = sorted({c for base in frontier for c in expansions(base)})
        for counts in level:
            if counts not in seen:
                seen[counts] = evaluate_counts(counts)
        ranked = sorted((seen[c] for c in level), key=lambda c: c.score, reverse=True)
        # The best predictions, and the most capacity (a placement that is infeasible now may
        # be the one that becomes feasible with one instance more).
        frontier = [c.counts for c in ranked[: beam or 0]]
        frontier.append(max(ranked, key=lambda c: c.max_qps).counts)
        better = [
            c
            for c in ranked
            if c.predicted is not None and covered(c.predicted) > covered(best_verified)
        ]
        for candidate in better[:VERIFY_TRIES]:
            plan = plan_for(candidate)
            assert plan is not None
            out.simulations += 1
            result = verify(setup, candidate, slo_ms, plan)
            if result.p99_ms <= slo_ms and covered(result.accuracy) > covered(best_verified):
                out.levels.append(result)
                best_verified = result.accuracy
                log(
                    f"  {name}, SLO {slo_ms:g} ms, {n} instances: {result.placement},"
                    f" accuracy {100 * result.accuracy:.2f}%, P99 {result.p99_ms:.1f} ms"
                )
                break
        if covered(best_verified) == len(setup.targets):
            out.stopped = f"every target reached at {n} instances"
            break
        top = ranked[0].score
        if best_score is not None and top[0] and top[:2] <= best_score[:2]:
            stale += 1
            if patience is not None and stale >= patience:
                out.stopped = f"no better prediction for {patience} levels (at {n} instances)"
                break
        else:
            stale = 0
        best_score = top if best_score is None or top > best_score else best_score
        if best_score[0] and covered(best_score[1]) == covered(best_verified) == covered(ceiling):
            out.stopped = f"the approach's most accurate gear reached at {n} instances"
            break
    else:
        out.stopped = f"the cap of {MAX_INSTANCES} instances"
    out.plans = len(seen)
    return out


def ceiling_accuracy(setup: Setup, single_only: bool) -> float:
    """The most accurate gear an approach has, held-out: the best model, or the best cascade."""
    records = setup.score
    top_model = max(records.model_accuracy(m) for m in records.models)
    # A cascade plan holds the single models too (chains of one).
    return top_model if single_only else max(top_model, setup.best_cascade_accuracy)


def cascade_search(setup: Setup, slo_ms: float, beam: int, log: Callable[[str], None]) -> SearchLog:
    """Cascades with gear switching: every candidate placement gets its own full gear plan."""

    def evaluate_counts(counts: Counts) -> Candidate:
        plan = make_plan(setup, counts, slo_ms, single_only=False)
        if plan is None:
            return Candidate(counts, None, 0.0)
        top = max(o.max_qps for o in plan.options)
        return Candidate(counts, plan_prediction(plan, setup.rates), top, plan)

    return search(
        setup,
        slo_ms,
        evaluate_counts,
        lambda c: c.plan,
        beam,
        PATIENCE,
        ceiling_accuracy(setup, False),
        log,
        "cascades",
    )


def switching_search(setup: Setup, slo_ms: float, log: Callable[[str], None]) -> SearchLog:
    """Model switching: a placement's single-model gears are the plans of each model alone on
    its instances (cached per model and count), combined by the plan's rule for a latency SLO
    (the range [lo, hi) gets the most accurate model whose max QPS reaches hi); the verified
    placements get their real plan (``plan_gears`` with an empty grid) and simulation."""
    family = setup.family
    alone: dict[tuple[int, int], tuple[float, float] | None] = {}

    def option(model: int, count: int) -> tuple[float, float] | None:
        if (model, count) not in alone:
            counts = tuple(count if j == model else 0 for j in range(len(family.models)))
            plan = make_plan(setup, counts, slo_ms, single_only=True)
            alone[model, count] = (
                None if plan is None else (plan.options[0].accuracy, plan.options[0].max_qps)
            )
        return alone[model, count]

    width = setup.qps_max / N_RANGES

    def evaluate_counts(counts: Counts) -> Candidate:
        options = [o for i, c in enumerate(counts) if c > 0 and (o := option(i, c)) is not None]
        if not options:
            return Candidate(counts, None, 0.0)
        gear_accuracy: list[float | None] = []
        for k in range(N_RANGES):
            serving = [a for a, r in options if r >= width * (k + 1)]
            gear_accuracy.append(max(serving) if serving else None)
        return Candidate(
            counts,
            predicted_accuracy(gear_accuracy, setup.weights),
            max(r for _, r in options),
        )

    def plan_for(candidate: Candidate) -> GearPlan | None:
        return make_plan(setup, candidate.counts, slo_ms, single_only=True)

    result = search(
        setup,
        slo_ms,
        evaluate_counts,
        plan_for,
        None,
        None,
        ceiling_accuracy(setup, True),
        log,
        "switching",
    )
    result.plans = len(alone) + result.simulations
    return result


# --- per target ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cell:
    """The least instances of one approach at one (target, SLO) point, and how."""

    instances: int | None
    how: str
    accuracy: float | None = None

    def text(self) -> str:
        return "unreachable" if self.instances is None else f"{self.instances} ({self.how})"


def single_cell(results: Sequence[SingleResult], target: float) -> Cell:
    fit = [r for r in results if r.instances is not None and reaches(r.accuracy, target)]
    if not fit:
        return Cell(None, "")
    best = min(fit, key=lambda r: (r.instances, -r.accuracy))
    return Cell(best.instances, f"{best.model}, batch cap {best.batch_cap}", best.accuracy)


def gear_cell(levels: Sequence[Verified], target: float) -> Cell:
    fit = [v for v in levels if reaches(v.accuracy, target)]
    if not fit:
        return Cell(None, "")
    best = min(fit, key=lambda v: (v.instances, -v.accuracy))
    return Cell(best.instances, best.placement, best.accuracy)


def _ratio(a: Cell, b: Cell) -> float | None:
    if a.instances is None or b.instances is None:
        return None
    return b.instances / a.instances


# --- the experiment --------------------------------------------------------------------------


def run(ctx: Context) -> Section:
    started = time.perf_counter()
    setup = make_setup(ctx)
    family = setup.family
    beam = QUICK_BEAM if ctx.quick else BEAM
    ctx.log(
        f"trace: {len(setup.trace):,} queries over {setup.duration_s:g} s, mean"
        f" {setup.mean_qps:.0f} qps, peak rate {setup.peak_qps:.0f} qps; SLOs"
        f" {', '.join(f'{s:g}' for s in setup.slos_ms)} ms; targets"
        f" {', '.join(f'{t:g}' for t in setup.targets)}%"
    )
    per_slo: list[dict[str, Any]] = []
    for slo in setup.slos_ms:
        ctx.log(f"SLO {slo:g} ms: single models")
        singles = [single_model(setup, m, slo) for m in family.models]
        for r in singles:
            ctx.log(
                f"  single {r.model}: "
                + (
                    "cannot meet the SLO"
                    if r.instances is None
                    else f"{r.instances} instances, batch cap {r.batch_cap}, P99 {r.p99_ms:.1f} ms"
                )
            )
        ctx.log(f"SLO {slo:g} ms: model switching")
        switching = switching_search(setup, slo, ctx.log)
        ctx.log(f"SLO {slo:g} ms: cascades with gear switching")
        cascades = cascade_search(setup, slo, beam, ctx.log)
        cells = [
            {
                "target": t,
                "single": single_cell(singles, t),
                "switching": gear_cell(switching.levels, t),
                "cascades": gear_cell(cascades.levels, t),
            }
            for t in setup.targets
        ]
        per_slo.append(
            {
                "slo_ms": slo,
                "singles": singles,
                "planner_caps": {m: planner_cap(setup, m, slo) for m in family.models},
                "switching": switching,
                "cascades": cascades,
                "cells": cells,
            }
        )
    figures = [_grid_figure(ctx, setup, per_slo)]
    headline = _headline(setup, per_slo)
    shown = _switching_point(per_slo) or headline
    if shown is not None:
        figures.append(_trace_figure(ctx, setup, per_slo, shown))
    return Section(
        key=KEY,
        title="CascadeServe: cascades and gear switching against single models",
        what=_what(setup, beam, _cap_note(setup, per_slo)),
        rerun="python -m benchmarks.results.cascades",
        body=_body(setup, per_slo),
        summary=_summary(setup, per_slo, headline),
        data=_data(setup, per_slo, beam, time.perf_counter() - started),
        figures=figures,
    )


def _cap_note(setup: Setup, per_slo: Sequence[dict[str, Any]]) -> str:
    """A caveat, when it applies: the planner batches the most accurate model less than the
    best single-model deployment does, with the reason: the single model's cap breaks the
    planner's path bound (2 L(k) for one stage), or, within it, serves no more by the mean
    latency (the simulated tail chose it)."""
    family = setup.family
    top = family.most_accurate
    profile = family.profiles[top][family.instance_type]
    beyond, within = [], []
    for block in per_slo:
        single = next(r for r in block["singles"] if r.model == top)
        planned = block["planner_caps"][top]
        if single.batch_cap is None or planned is None or planned >= single.batch_cap:
            continue
        path_ms = 2.0 * profile.mean_latency_ms(single.batch_cap)
        gap = f"{planned} against {single.batch_cap} at {block['slo_ms']:g} ms"
        if path_ms > block["slo_ms"]:
            beyond.append(f"{gap}, where cap {single.batch_cap}'s path bound is {path_ms:.0f} ms")
        else:
            within.append(gap)
    if not beyond and not within:
        return ""
    reasons = []
    if beyond:
        reasons.append(
            f"{'; '.join(beyond)}: the planner's rule (`controlplane/policies/gears.py`, SP4) takes"
            " only caps whose path bound, twice the batch's mean latency at each stage (a query"
            " may wait for the batch in service, then for its own), stays within the SLO, where"
            " the single-model search tries every cap whose mean batch latency is within it and"
            " keeps the one the simulated P99 allows with the fewest instances"
        )
    if within:
        reasons.append(
            f"{'; '.join(within)}: there the single model's cap is within the path bound but"
            " serves no more by the mean latency the planner compares caps by; the simulated P99"
            " chose it"
        )
    return (
        f" The gear planner batches `{top}` less than its best single-model deployment"
        f" ({'; '.join(reasons)}). With the 90% utilisation cap of the plans this is why model"
        " switching can need more instances than a single model at the single model's accuracy."
    )


def _headline(setup: Setup, per_slo: Sequence[dict[str, Any]]) -> tuple[int, int] | None:
    """(SLO index, target index): the middle SLO, the highest target all three approaches reach
    there (else the highest the cascades reach)."""
    s = len(per_slo) // 2
    cells = per_slo[s]["cells"]
    everyone = [
        i for i, c in enumerate(cells) if all(c[k].instances is not None for k in _APPROACHES)
    ]
    if everyone:
        return s, everyone[-1]
    mine = [i for i, c in enumerate(cells) if c["cascades"].instances is not None]
    return (s, mine[-1]) if mine else None


def _switching_point(per_slo: Sequence[dict[str, Any]]) -> tuple[int, int] | None:
    """(SLO index, target index) for the trace figure: at the tightest SLO where it happens,
    the highest target whose model-switching run serves with more than one model."""
    for s, block in enumerate(per_slo):
        for t in reversed(range(len(block["cells"]))):
            cell: Cell = block["cells"][t]["switching"]
            if cell.instances is None:
                continue
            run = next(v for v in block["switching"].levels if v.instances == cell.instances)
            if len(run.cascades) > 1:
                return s, t
    return None


_APPROACHES = ("single", "switching", "cascades")
_NAMES = {
    "single": "single model, dynamic batching",
    "switching": "switching between single models",
    "cascades": "cascades with gear switching",
}


def _what(setup: Setup, beam: int, cap_note: str) -> str:
    family = setup.family
    accuracy = ", ".join(
        f"{m} {100 * setup.score.model_accuracy(m):.2f}%"
        f" ({100 * setup.choose.model_accuracy(m):.2f}%)"
        for m in family.models
    )
    slos = ", ".join(f"{s:g}" for s in setup.slos_ms)
    targets = ", ".join(f"{t:g}" for t in setup.targets)
    window, n_ranges, headroom = WINDOW_S, N_RANGES, QPS_MAX_HEADROOM
    return f"""
- Family: {family.source}; {setup.family_note}.
  Held-out protocol (docs/cascades.md): the {family.records.n_samples} validation samples are
  split by label into a choose half ({setup.choose.n_samples}) and a score half
  ({setup.score.n_samples}), seed {SEED}; thresholds and gears are chosen on the choose half,
  every accuracy below is the score half's (held-out), in-sample (choose half) in parentheses.
  Accuracy: {accuracy}; the best cascade of the threshold grid 0.1-0.9 on the choose half is
  `{setup.best_cascade}` at {100 * setup.best_cascade_accuracy:.2f}% held-out
  ({100 * setup.best_cascade_in_sample:.2f}% in-sample). Every instance is
  `{family.instance_type}` (${family.price_usd_per_hr:g}/hr), so cost is proportional to the
  instance counts below.
- Load: {len(setup.trace):,} Poisson arrivals over {setup.duration_s:g} s (seed {SEED}), rate
  mean x (1 - {AMPLITUDE:g} cos(2 pi t / {setup.duration_s / PERIODS:g} s)) with a
  {SPIKE_FACTOR:g}x spike for {SPIKE_SHARE * setup.duration_s:.3g} s around the first crest:
  mean {setup.mean_qps:.0f} qps, peak rate {setup.peak_qps:.0f} qps, i.e. {PEAK_INSTANCES}
  instances' worth of `{family.most_accurate}` at batch cap {setup.top_cap}
  ({setup.top_capacity_qps:.0f} qps each). Each query carries a validation sample of the score
  half, drawn uniformly.
- SLO: P99 of the response time over the whole trace <= {slos} ms. Accuracy targets:
  {targets}%.
- Approaches (module docstring of `benchmarks/results/cascades.py`): *single model*: the least
  instances of one model, provisioned for the whole trace, FCFS dynamic batching with the best
  batch cap (every power of two tried in simulation); *switching between
  single models*: a gear plan (`controlplane/policies/gears.py`) with single-model gears only;
  *cascades with gear switching*: the gear plan over every cascade of the placed models (thresholds
  0.1-0.9); both switched by CascadeServe's rule (alpha = 8) in the simulator every 100 ms on the
  QPS counted over the last {window:g} s, {n_ranges} QPS ranges up to {headroom:g}x the peak rate.
- Placements for the gear approaches: for cascades a beam search over instance counts per model
  (width {beam}), for model switching every placement; scored by the plan's predicted accuracy
  over the trace, the best {VERIFY_TRIES} of a level simulated on the whole trace; up to
  {MAX_INSTANCES} instances. The cascade counts are therefore upper bounds on the least counts.
- Accuracy of a gear run: the mean over queries of the held-out accuracy of the cascade in force
  at arrival; compared with the targets at two decimals.
- Caveats: the score half holds {setup.score.n_samples} samples, so one sample moves an accuracy
  by {100 / setup.score.n_samples:.2f} points; each model runs on its own instances (the paper
  co-locates models on GPUs); the latency profiles are
  measured on this machine and move from run to run (see the family line above).{cap_note}
"""


def _body(setup: Setup, per_slo: Sequence[dict[str, Any]]) -> str:
    parts = []
    for block in per_slo:
        slo = block["slo_ms"]
        rows = []
        for cell in block["cells"]:
            ratio = _ratio(cell["cascades"], cell["single"])
            rows.append(
                [
                    f"{cell['target']:g}%",
                    cell["single"].text(),
                    cell["switching"].text(),
                    cell["cascades"].text(),
                    "-" if ratio is None else f"{ratio:.1f}x",
                ]
            )
        parts.append(
            f"### P99 <= {slo:g} ms: least instances per held-out accuracy target\n\n"
            + md_table(
                [
                    "held-out accuracy target",
                    _NAMES["single"],
                    _NAMES["switching"],
                    _NAMES["cascades"],
                    "single / cascades",
                ],
                rows,
                right="4",
            )
        )
        singles = [
            [
                r.model,
                f"{100 * r.accuracy:.2f}%",
                "-" if r.in_sample_accuracy is None else f"{100 * r.in_sample_accuracy:.2f}%",
                "cannot meet the SLO" if r.instances is None else r.instances,
                "-" if r.batch_cap is None else r.batch_cap,
                "-" if r.p99_ms is None else f"{r.p99_ms:.1f}",
                block["planner_caps"][r.model] or "-",
            ]
            for r in block["singles"]
        ]
        parts.append(
            f"Single models at {slo:g} ms (least instances within the SLO, best batch cap;"
            " the gear planner's cap for the model alone in the last column):\n\n"
            + md_table(
                [
                    "model",
                    "held-out accuracy",
                    "in-sample",
                    "instances",
                    "batch cap",
                    "P99 ms",
                    "planner's cap",
                ],
                singles,
                "1,2,3,4,5,6",
            )
        )
        for name in ("switching", "cascades"):
            log: SearchLog = block[name]
            rows = [
                [
                    v.instances,
                    f"`{v.placement}`",
                    f"{100 * v.predicted:.2f}%",
                    f"{100 * v.accuracy:.2f}%",
                    "-" if v.in_sample_accuracy is None else f"{100 * v.in_sample_accuracy:.2f}%",
                    f"{100 * v.answered_accuracy:.2f}%",
                    f"{v.p99_ms:.1f}",
                    ", ".join(
                        f"`{label}` {100 * share:.0f}%"
                        for label, share in sorted(v.cascades.items(), key=lambda x: -x[1])
                    ),
                ]
                for v in log.levels
            ]
            parts.append(
                f"{_NAMES[name].capitalize()} at {slo:g} ms, the verified placement of each"
                f" level ({log.plans} plans, {log.simulations} trace simulations; stopped:"
                f" {log.stopped}):\n\n"
                + md_table(
                    [
                        "instances",
                        "placement",
                        "predicted",
                        "held-out accuracy",
                        "in-sample",
                        "answers right",
                        "P99 ms",
                        "queries per gear cascade",
                    ],
                    rows,
                    "0,2,3,4,5,6",
                )
            )
    return "\n\n".join(parts)


def _summary(
    setup: Setup, per_slo: Sequence[dict[str, Any]], headline: tuple[int, int] | None
) -> list[str]:
    """The section's findings (their wording: benchmarks/results/findings/cascades.md)."""
    lines = []
    if headline is not None:
        s, t = headline
        block = per_slo[s]
        cell = block["cells"][t]
        single, switching, cascades = (cell[k] for k in _APPROACHES)

        def count(c: Cell) -> str:
            return finding(KEY, "cannot_reach") if c.instances is None else f"{c.instances}"

        run = next((v for v in block["cascades"].levels if v.instances == cascades.instances), None)
        in_sample = (
            finding(
                KEY,
                "headline_in_sample",
                held_out=f"{100 * run.accuracy:.2f}",
                in_sample=f"{100 * run.in_sample_accuracy:.2f}",
            )
            if run is not None and run.in_sample_accuracy is not None
            else ""
        )
        ratio = _ratio(cascades, single)
        lines.append(
            finding(
                KEY,
                "headline",
                target=f"{cell['target']:g}",
                choose_samples=setup.choose.n_samples,
                validation_samples=setup.family.records.n_samples,
                score_samples=setup.score.n_samples,
                in_sample=in_sample,
                slo_ms=f"{block['slo_ms']:g}",
                peak_qps=f"{setup.peak_qps:.0f}",
                cascades=count(cascades),
                switching=count(switching),
                single=count(single),
                ratio=" " + finding(KEY, "headline_ratio", ratio=f"{ratio:.1f}") if ratio else "",
            )
        )
    pairs = [
        (cell["single"].instances, r, _ratio(cell["cascades"], cell["switching"]))
        for block in per_slo
        for cell in block["cells"]
        if (r := _ratio(cell["cascades"], cell["single"])) is not None
    ]
    ratios = [r for n, r, _ in pairs if n is not None and n > 1]
    cells = sum(len(block["cells"]) for block in per_slo)
    if ratios:
        spread = (
            finding(
                KEY,
                "single_over_cascades_spread",
                low=f"{min(ratios):.1f}",
                high=f"{max(ratios):.1f}",
            )
            if max(ratios) > min(ratios)
            else ""
        )
        lines.append(
            finding(
                KEY,
                "single_over_cascades",
                points=len(ratios),
                cells=cells,
                geometric_mean=f"{math.exp(np.mean(np.log(ratios))):.1f}",
                spread=spread,
            )
        )
    versus = [
        (cell["switching"].instances, cell["single"].instances)
        for block in per_slo
        for cell in block["cells"]
        if cell["switching"].instances is not None
        and cell["single"].instances is not None
        and cell["single"].instances > 1
    ]
    if versus:
        fewer = sum(a < b for a, b in versus)
        more = sum(a > b for a, b in versus)
        lines.append(
            finding(
                KEY,
                "switching",
                fewer=fewer,
                points=len(versus),
                more=more,
                why=finding(KEY, "switching_why_more" if more else "switching_why"),
            )
        )
    only = [
        (cell["target"], block["slo_ms"])
        for block in per_slo
        for cell in block["cells"]
        if cell["cascades"].instances is not None and cell["single"].instances is None
    ]
    top_single = max(setup.score.model_accuracy(m) for m in setup.family.models)
    if only:
        lines.append(
            finding(
                KEY,
                "only_cascades",
                points=len(only),
                point_word="points" if len(only) > 1 else "point",
                highest=f"{max(t for t, _ in only):g}",
                best_model=f"{100 * top_single:.2f}",
            )
        )
    unreachable = [
        (cell["target"], block["slo_ms"])
        for block in per_slo
        for cell in block["cells"]
        if cell["cascades"].instances is None
    ]
    if unreachable:
        lines.append(
            finding(
                KEY,
                "unreachable",
                points=len(unreachable),
                cells=cells,
                max_instances=MAX_INSTANCES,
                target=f"{unreachable[0][0]:g}",
                slo_ms=f"{unreachable[0][1]:g}",
            )
        )
    return lines


def _data(
    setup: Setup, per_slo: Sequence[dict[str, Any]], beam: int, seconds: float
) -> dict[str, Any]:
    family = setup.family
    return {
        "family": family.source,
        "instance_type": family.instance_type,
        "price_usd_per_hr": family.price_usd_per_hr,
        "split": {
            "choose_share": DEFAULT_CHOOSE_SHARE,
            "seed": SEED,
            "choose_samples": setup.choose.n_samples,
            "score_samples": setup.score.n_samples,
        },
        "model_accuracy": {m: setup.score.model_accuracy(m) for m in family.models},
        "model_accuracy_in_sample": {m: setup.choose.model_accuracy(m) for m in family.models},
        "model_accuracy_all_samples": {m: family.records.model_accuracy(m) for m in family.models},
        "best_cascade": {
            "label": setup.best_cascade,
            "accuracy": setup.best_cascade_accuracy,
            "held_out_accuracy": setup.best_cascade_accuracy,
            "in_sample_accuracy": setup.best_cascade_in_sample,
        },
        "trace": {
            "queries": len(setup.trace),
            "duration_s": setup.duration_s,
            "mean_qps": setup.mean_qps,
            "peak_rate_qps": setup.peak_qps,
            "amplitude": AMPLITUDE,
            "periods": PERIODS,
            "spike_factor": SPIKE_FACTOR,
            "seed": SEED,
        },
        "settings": {
            "qps_max": setup.qps_max,
            "n_ranges": N_RANGES,
            "beam": beam,
            "verify_tries": VERIFY_TRIES,
            "max_instances": MAX_INSTANCES,
        },
        "targets": list(setup.targets),
        "slos": [
            {
                "slo_ms": block["slo_ms"],
                "single_models": [
                    {
                        "model": r.model,
                        "accuracy": r.accuracy,
                        "held_out_accuracy": r.accuracy,
                        "in_sample_accuracy": r.in_sample_accuracy,
                        "instances": r.instances,
                        "batch_cap": r.batch_cap,
                        "p99_ms": r.p99_ms,
                        "planner_cap": block["planner_caps"][r.model],
                    }
                    for r in block["singles"]
                ],
                "switching": [v.to_data() for v in block["switching"].levels],
                "cascades": [v.to_data() for v in block["cascades"].levels],
                "cells": [
                    {
                        "target": cell["target"],
                        **{
                            k: {
                                "instances": cell[k].instances,
                                "how": cell[k].how,
                                "accuracy": cell[k].accuracy,
                            }
                            for k in _APPROACHES
                        },
                    }
                    for cell in block["cells"]
                ],
            }
            for block in per_slo
        ],
        "seconds": seconds,
    }


_STYLE = {
    "single": ("tab:red", "s", "-"),
    "switching": ("tab:orange", "^", "--"),
    "cascades": ("tab:blue", "o", "-"),
}


def _grid_figure(ctx: Context, setup: Setup, per_slo: Sequence[dict[str, Any]]) -> Any:
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(per_slo), figsize=(max(7.0, 4.6 * len(per_slo)), 4.0), sharey=True, squeeze=False
    )
    top = max([c[k].instances or 0 for b in per_slo for c in b["cells"] for k in _APPROACHES] + [1])
    ceiling = top + 2
    for ax, block in zip(axes[0], per_slo, strict=True):
        targets = [c["target"] for c in block["cells"]]
        for k in _APPROACHES:
            color, marker, line = _STYLE[k]
            ys = [c[k].instances for c in block["cells"]]
            ax.plot(
                [t for t, y in zip(targets, ys, strict=True) if y is not None],
                [y for y in ys if y is not None],
                color=color,
                marker=marker,
                linestyle=line,
                label=_NAMES[k],
            )
            missed = [t for t, y in zip(targets, ys, strict=True) if y is None]
            if missed:  # one row per approach, so that the marks do not hide each other
                row = ceiling + 0.45 * (1 - _APPROACHES.index(k))
                ax.scatter(missed, [row] * len(missed), color=color, marker="x", s=40)
        ax.axhline(ceiling - 0.7, color="grey", linewidth=0.5, linestyle=":")
        ax.set_title(f"P99 <= {block['slo_ms']:g} ms")
        ax.set_xlabel("held-out accuracy target (%)")
        ax.grid(alpha=0.3)
    axes[0][0].yaxis.get_major_locator().set_params(integer=True)
    axes[0][0].set_ylabel(f"instances needed ({setup.family.instance_type})")
    axes[0][0].set_ylim(0, ceiling + 1.2)
    axes[0][-1].scatter([], [], color="grey", marker="x", label="x: unreachable (top row)")
    axes[0][-1].legend(fontsize=8, loc="center left")
    fig.suptitle(
        f"Least instances to serve a load peaking at {setup.peak_qps:.0f} qps (demo family)",
        fontsize=11,
    )
    return save_figure(
        ctx,
        fig,
        f"{KEY}-instances.png",
        "Least instances each approach needs to keep the P99 within the SLO at an accuracy of at"
        " least the target, over the fluctuating trace (x: unreachable within"
        f" {MAX_INSTANCES} instances).",
    )


def _trace_figure(
    ctx: Context, setup: Setup, per_slo: Sequence[dict[str, Any]], headline: tuple[int, int]
) -> Any:
    plt = pyplot()
    s, t = headline
    block = per_slo[s]
    target = block["cells"][t]["target"]
    fig, (rate_ax, acc_ax) = plt.subplots(2, 1, figsize=(8.0, 5.2), sharex=True)
    seconds = np.arange(int(setup.duration_s))
    counts = np.bincount(
        np.minimum(setup.trace.arrival_s.astype(np.int64), seconds.size - 1),
        minlength=seconds.size,
    )
    rate_ax.plot(seconds, counts, color="black", linewidth=1.0, label="arrivals per second")
    rate_ax.plot(
        seconds,
        setup.profile.rate_at(seconds.astype(float)),
        color="grey",
        linestyle="--",
        label="rate lambda(t)",
    )
    rate_ax.set_ylabel("load (qps)")
    rate_ax.legend(fontsize=8)
    rate_ax.set_title(
        f"The trace, and the accuracy in force at {target:g}% and {block['slo_ms']:g} ms"
    )
    for k in ("switching", "cascades"):
        cell: Cell = block["cells"][t][k]
        if cell.instances is None:
            continue
        run = next(v for v in block[k].levels if v.instances == cell.instances)
        color, _, line = _STYLE[k]
        acc_ax.plot(
            seconds,
            100.0 * np.array(run.series_accuracy),
            color=color,
            linestyle=line,
            label=f"{_NAMES[k]}, {run.instances} instances",
        )
    single: Cell = block["cells"][t]["single"]
    if single.accuracy is not None:
        acc_ax.axhline(
            100.0 * single.accuracy,
            color=_STYLE["single"][0],
            label=f"{_NAMES['single']}, {single.instances} instances",
        )
    acc_ax.axhline(target, color="grey", linestyle=":", label=f"target {target:g}%")
    acc_ax.set_xlabel("time (s)")
    acc_ax.set_ylabel("held-out accuracy in force (%)")
    acc_ax.legend(fontsize=8)
    return save_figure(
        ctx,
        fig,
        f"{KEY}-trace.png",
        f"Top: the load trace. Bottom: per 1 s window, the mean held-out accuracy of the gear in"
        f" force for the placements that reach {target:g}% at P99 <= {block['slo_ms']:g} ms.",
    )


def main(argv: list[str] | None = None) -> int:
    return experiment_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
