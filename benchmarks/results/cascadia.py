"""Cascadia: the latency/accuracy Pareto front of a cascade against single models and a
CascadeServe-style plan on the same fleet budget.

This experiment owns the Cascadia result (Jiang et al., section 5, the latency/quality fronts
against single-model and cascade baselines at one budget): on the demo model family
(``benchmarks/gear_demo.py``, loaded once per run as the CascadeServe experiment does,
``benchmarks.results.cascades.demo_family``), a fleet budget of :data:`BUDGET_INSTANCES`
instances of the family's one instance type and a Poisson load at :data:`LOAD_SHARE` of what the
most accurate model serves on the whole budget, it compares

- **Cascadia** (``estimator.allocation.tchebycheff_front``): the chain of every model of the
  family, cheapest first; for every threshold setting of the sweep's grid, the MILP's allocation
  of instances to stages (minimise the worst stage's M/D/1 mean latency within the budget), and
  the weighted-Tchebycheff sweep's picks: the front;
- **single models**: each model alone on the whole budget's instances;
- **CascadeServe-style**: the cascade ``controlplane.policies.cascade_choice.choose_held_out``
  picks (the cheapest point of the accuracy/compute front within half a point of the most
  accurate model), its instances split by load share (stage i's share of the work, reach_i x
  compute_i, :func:`split_by_load`); and the same cascade with the MILP's allocation, which
  separates the choice of thresholds from the allocation.

Held-out protocol (docs/cascades.md): the validation records are split half and half
(``ValidationRecords.split``, seed :data:`SEED`); the sweep, the MILP's reach shares and the
CascadeServe choice see the *choose* half only; every accuracy compared is the *score* half's,
and the simulated queries carry score-half samples (so the forwarding is held-out too). The
in-sample (choose half) accuracies are reported beside them.

Latency: every point is simulated end to end (``estimator.simulator.simulate``: the pipeline of
its stages, each with its fleet, FCFS and one query per batch, the M/D/1 model's service
discipline, the queries forwarded by the validation records' certainty) on one Poisson trace at
the load rate; P99 is the headline. Beside it, per stage, the MILP's M/D/1 mean latency
(``estimator.allocation.stage_latency_ms``) and the stage's simulated mean sojourn, measured by
replaying the stages one after another (:func:`stage_sojourns_ms`: stage i+1's arrivals are
stage i's completions of the forwarded queries, which is exactly what the pipeline does with
FCFS and no batching).

Caveats: the profiles are measured when the experiment runs (clipped as the CascadeServe
experiment clips them), so the front moves a little from run to run; the score half holds about
360 samples, so one sample is about 0.28 points of accuracy; one instance type, so the MILP only
chooses counts; no batching (the MILP's latency model has none).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.results.cascades import Family, demo_family
from benchmarks.results.common import (
    Context,
    Figure,
    Section,
    experiment_main,
    md_table,
    pyplot,
    save_figure,
)
from benchmarks.results.findings import finding
from controlplane.cli.parsers import PARETO_GRID
from controlplane.policies.cascade_choice import choose_held_out
from estimator.allocation import (
    ParetoPoint,
    StageDemand,
    allocate,
    stage_latency_ms,
    tchebycheff_front,
)
from estimator.cascades import (
    DEFAULT_CHOOSE_SHARE,
    Cascade,
    ValidationRecords,
    evaluate,
    forward_flags,
)
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace, poisson_arrivals

KEY = "cascadia"
SEED = 0
# The fleet budget: this many instances of the family's type, for every approach.
BUDGET_INSTANCES = 8
# The load: this share of what the most accurate model serves on the whole budget (M/D/1
# utilisation 0.75 for it alone), so that it queues noticeably and the cheap models do not.
LOAD_SHARE = 0.75
TRACE_S = 300.0
QUICK_TRACE_S = 20.0
# The sweep's threshold grid (``heteroplane plan --pareto``'s default), every other value in quick.
GRID: tuple[float, ...] = PARETO_GRID
QUICK_GRID: tuple[float, ...] = PARETO_GRID[::2]

KINDS = ("cascadia", "single", "cascadeserve", "cascadeserve-milp")


# --- pure helpers ----------------------------------------------------------------------------


def split_by_load(work: Sequence[float], total: int) -> tuple[int, ...]:
    """``total`` instances split over stages in proportion to their ``work`` (reach x compute),
    CascadeServe-style: every stage with work gets at least one, the rest by largest remainder
    (ties to the earlier stage); a stage without work gets none.

    >>> split_by_load([0.5, 0.3, 0.2], 8)
    (4, 2, 2)
    >>> split_by_load([1.0, 0.01, 0.0], 4)
    (3, 1, 0)

    Raises:
        ValueError: no work, negative work, or fewer instances than stages with work.
    """
    weights = np.asarray(work, dtype=np.float64)
    if weights.size == 0 or (weights < 0).any() or not weights.sum() > 0:
        raise ValueError(f"needs non-negative work with a positive sum, got {list(work)}")
    busy = weights > 0
    if total < int(busy.sum()):
        raise ValueError(f"{total} instances cannot give each of {int(busy.sum())} stages one")
    counts = busy.astype(np.int64)
    spare = total - int(counts.sum())
    ideal = weights / weights.sum() * total
    # Each stage's claim beyond what it holds; the floors first, then the largest remainders.
    extra = np.floor(np.maximum(ideal - counts, 0.0)).astype(np.int64)
    while extra.sum() > spare:  # the floors can overshoot once the minimum of one is given
        extra[int(np.argmax(extra))] -= 1
    counts += extra
    spare -= int(extra.sum())
    remainder = np.where(busy, ideal - counts, -np.inf)
    for i in np.argsort(-remainder, kind="stable")[:spare]:
        counts[i] += 1
    return tuple(int(c) for c in counts)


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether (P99 ms, accuracy) ``a`` Pareto-dominates ``b``: no slower, no less accurate, and
    better in one of the two.

    >>> dominates((5.0, 0.98), (9.0, 0.98)), dominates((5.0, 0.98), (5.0, 0.98))
    (True, False)
    """
    return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])


def stage_sojourns_ms(
    arrival_s: np.ndarray,
    flags: Sequence[np.ndarray],
    fleets: Sequence[int],
    profiles: Sequence[LatencyProfile],
    price_usd_per_hr: float,
    rng: np.random.Generator,
) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per stage, the queries that reach it (indices into ``arrival_s``) and the sojourn of each
    there (queue + service, ms), the stages
    replayed one after another: stage 0 gets every arrival, stage i + 1 the completions at stage
    i of the queries whose ``flags[i]`` say they go on (in completion order). With FCFS and one
    query per batch this is what the pipeline does; each stage is one single-stage simulation.
    A stage no query reaches gets empty arrays; one with queries but no instances is an error.

    >>> profile = LatencyProfile("m", "c", np.array([1]), (np.array([10.0]),))
    >>> flags = [np.array([True, False]), np.array([False, False])]
    >>> [(ids.tolist(), ms.round(6).tolist()) for ids, ms in stage_sojourns_ms(
    ...     np.array([0.0, 0.001]), flags, [1, 1], [profile, profile], 1.0,
    ...     np.random.default_rng(0))]
    [([0, 1], [10.0, 19.0]), ([0], [10.0])]
    """
    out: list[tuple[np.ndarray, np.ndarray]] = []
    ids = np.arange(arrival_s.size)
    arrivals = np.asarray(arrival_s, dtype=np.float64)
    for i, (n, profile) in enumerate(zip(fleets, profiles, strict=True)):
        if ids.size == 0:
            out.append((ids, np.empty(0)))
            continue
        if n < 1:
            raise ValueError(f"stage {i} ({profile.model}) gets {ids.size} queries, no instances")
        itype = profile.instance_type
        stage = Stage(profile.model, tuple(InstanceSpec(itype) for _ in range(n)), {itype: profile})
        trace = Trace(arrivals, np.ones(ids.size, dtype=np.int64))
        result = simulate(trace, [stage], rng, prices_usd_per_hr={itype: price_usd_per_hr})
        out.append((ids, result.response_ms))
        onward = np.asarray(flags[i])[ids]
        finish = result.finish_s[onward]
        order = np.argsort(finish, kind="stable")
        ids, arrivals = ids[onward][order], finish[order]
    return tuple(out)


# --- the experiment --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    family: Family
    choose: ValidationRecords
    score: ValidationRecords
    rate_per_instance_qps: Mapping[str, float]  # mu of each model on the family's type
    compute_ms: Mapping[str, float]  # mean batch-1 latency of each model
    rate_qps: float
    budget_usd_per_hr: float
    trace: Trace  # Poisson at rate_qps, each query carrying a score-half sample
    grid: tuple[float, ...]

    @property
    def itype(self) -> str:
        return self.family.family.instance_type

    @property
    def price(self) -> float:
        return self.family.family.price_usd_per_hr


@dataclass(frozen=True, slots=True)
class Point:
    """One served configuration: a cascade (a single model is a one-stage cascade), its
    instances per stage, its accuracies and its latencies, modelled and simulated."""

    kind: str  # one of KINDS
    cascade: Cascade
    counts: tuple[int, ...]  # instances per stage
    in_sample_accuracy: float  # choose half
    held_out_accuracy: float  # score half
    reach_share: tuple[float, ...]  # choose half: what the MILP and the M/D/1 figures assume
    md1_stage_ms: tuple[float, ...]  # M/D/1 mean latency per stage (MILP's l_i)
    sim_stage_mean_ms: tuple[float | None, ...]  # simulated mean sojourn per stage
    sim_stage_p99_ms: tuple[float | None, ...]
    p50_ms: float  # end to end, simulated pipeline
    p99_ms: float
    mean_ms: float
    tandem_p99_ms: float  # end to end from the stage-by-stage replay (a consistency check)
    weight_ratios: tuple[float, ...] = ()  # Cascadia: the lambda_1 / lambda_2 that picked it

    @property
    def label(self) -> str:
        return self.cascade.label

    @property
    def md1_worst_ms(self) -> float:
        return max(self.md1_stage_ms)

    def fleet_text(self) -> str:
        """``1 + 1 + 6 + 0``: instances per stage, in the cascade's order."""
        return " + ".join(f"{n}" for n in self.counts)


def make_setup(ctx: Context) -> Setup:
    return setup_for(
        demo_family(ctx),
        QUICK_TRACE_S if ctx.quick else TRACE_S,
        QUICK_GRID if ctx.quick else GRID,
    )


def setup_for(family: Family, trace_s: float, grid: Sequence[float]) -> Setup:
    """The experiment's inputs for ``family``: the split, each model's mu and batch-1 compute,
    the load rate (:data:`LOAD_SHARE` of the most accurate model's capacity on the budget) and
    a Poisson trace of ``trace_s`` whose queries carry score-half samples (seed :data:`SEED`)."""
    fam = family.family
    itype = fam.instance_type
    choose, score = fam.records.split(DEFAULT_CHOOSE_SHARE, SEED)
    one = np.ones(1, dtype=np.int64)
    mu = {m: fam.profiles[m][itype].rate_qps(one) for m in fam.models}
    compute = {m: fam.profiles[m][itype].mean_latency_ms(1) for m in fam.models}
    rate = LOAD_SHARE * BUDGET_INSTANCES * mu[fam.most_accurate]
    rng = np.random.default_rng(SEED)
    arrival_s = poisson_arrivals(rate, trace_s, rng)
    sample_id = rng.integers(0, score.n_samples, size=arrival_s.size)
    trace = Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64), sample_id)
    return Setup(
        family,
        choose,
        score,
        mu,
        compute,
        rate,
        BUDGET_INSTANCES * fam.price_usd_per_hr,
        trace,
        tuple(float(h) for h in grid),
    )


def measure(
    setup: Setup,
    kind: str,
    cascade: Cascade,
    counts: Sequence[int],
    weight_ratios: Sequence[float] = (),
) -> Point:
    """Score ``cascade`` on both halves and simulate it with ``counts`` instances per stage.
    Trailing stages without instances are left out of the pipeline (the sweep gives none to a
    stage no choose-half query reaches; the stage before then forwards nothing)."""
    fam = setup.family.family
    itype = setup.itype
    trace = setup.trace
    assert trace.sample_id is not None
    flags = forward_flags(cascade, setup.score, trace.sample_id)
    quality = evaluate(cascade, setup.choose)
    served = max(i for i, n in enumerate(counts) if n > 0) + 1
    if flags[served - 1].any():
        raise ValueError(f"{cascade.label}: stage {served} gets queries but no instances")
    stages = [
        Stage(
            m,
            tuple(InstanceSpec(itype) for _ in range(n)),
            fam.profiles[m],
            forward=flags[i] if i < served - 1 else None,
        )
        for i, (m, n) in enumerate(zip(cascade.models[:served], counts[:served], strict=True))
    ]
    prices = {itype: setup.price}
    summary = simulate(
        trace, stages, np.random.default_rng(SEED + 1), prices_usd_per_hr=prices
    ).summary()
    profiles = [fam.profiles[m][itype] for m in cascade.models[:served]]
    sojourns = stage_sojourns_ms(
        trace.arrival_s,
        flags[:served],
        counts[:served],
        profiles,
        setup.price,
        np.random.default_rng(SEED + 2),
    )
    empty = (np.empty(0, dtype=np.int64), np.empty(0))
    sojourns += tuple(empty for _ in range(len(cascade.models) - served))
    # End to end from the replay: each query's sojourns along the stages it reached.
    total_ms = np.zeros(len(trace))
    for ids, sojourn in sojourns:
        total_ms[ids] += sojourn
    md1 = tuple(
        stage_latency_ms({itype: n}, {itype: setup.rate_per_instance_qps[m]}, s * setup.rate_qps)
        for m, n, s in zip(cascade.models, counts, quality.reach_share, strict=True)
    )
    return Point(
        kind=kind,
        cascade=cascade,
        counts=tuple(int(n) for n in counts),
        in_sample_accuracy=quality.accuracy,
        held_out_accuracy=evaluate(cascade, setup.score).accuracy,
        reach_share=quality.reach_share,
        md1_stage_ms=md1,
        sim_stage_mean_ms=tuple(float(s.mean()) if s.size else None for _, s in sojourns),
        sim_stage_p99_ms=tuple(
            float(np.percentile(s, 99)) if s.size else None for _, s in sojourns
        ),
        p50_ms=summary.p50_ms,
        p99_ms=summary.p99_ms,
        mean_ms=summary.mean_ms,
        tandem_p99_ms=float(np.percentile(total_ms, 99)),
        weight_ratios=tuple(float(r) for r in weight_ratios),
    )


def cascadia_front(setup: Setup) -> tuple[ParetoPoint, ...]:
    """Cascadia's sweep on the choose half: the chain of every model, cheapest first."""
    models = setup.family.family.models
    itype = setup.itype
    return tchebycheff_front(
        setup.choose,
        models,
        {m: {itype: setup.rate_per_instance_qps[m]} for m in models},
        setup.rate_qps,
        {itype: setup.price},
        grid=setup.grid,
        budget_usd_per_hr=setup.budget_usd_per_hr,
        max_counts={itype: BUDGET_INSTANCES},
    )


def cascadeserve_cascade(setup: Setup) -> Cascade:
    """The cascade ``choose_held_out`` picks on the choose half (the most accurate model alone
    when no cascade is within the tolerance of it)."""
    choice = choose_held_out(
        setup.family.family.records, setup.compute_ms, share=DEFAULT_CHOOSE_SHARE, seed=SEED
    )
    if choice.best is None:
        return Cascade((choice.top_model,), ())
    return choice.best.cascade


def milp_counts(setup: Setup, cascade: Cascade) -> tuple[int, ...]:
    """The MILP's allocation (``estimator.allocation.allocate``) of the budget to ``cascade``'s
    stages at the choose half's reach shares."""
    itype = setup.itype
    quality = evaluate(cascade, setup.choose)
    demands = [
        StageDemand(m, share, {itype: setup.rate_per_instance_qps[m]})
        for m, share in zip(cascade.models, quality.reach_share, strict=True)
    ]
    allocation = allocate(
        demands,
        setup.rate_qps,
        {itype: setup.price},
        budget_usd_per_hr=setup.budget_usd_per_hr,
        max_counts={itype: BUDGET_INSTANCES},
    )
    return tuple(int(f.get(itype, 0)) for f in allocation.fleets)


def load_counts(setup: Setup, cascade: Cascade) -> tuple[int, ...]:
    """CascadeServe-style: the budget split by each stage's share of the work (choose half)."""
    quality = evaluate(cascade, setup.choose)
    work = [
        s * setup.compute_ms[m] for m, s in zip(cascade.models, quality.reach_share, strict=True)
    ]
    return split_by_load(work, BUDGET_INSTANCES)


@dataclass(frozen=True, slots=True)
class Outcome:
    setup: Setup
    front: tuple[Point, ...]  # Cascadia's, fastest (by the MILP's objective) first
    singles: tuple[Point, ...]  # the family's order
    cascadeserve: tuple[Point, ...]  # load-share split, then the MILP's allocation
    settings: int  # threshold settings swept
    sweep_s: float

    def dominated_singles(self, held_out: bool = True) -> dict[str, list[int]]:
        """Per single model, the indices of the front points that dominate it (P99, accuracy)."""
        return {
            s.cascade.models[0]: [
                i for i, p in enumerate(self.front) if dominates(_xy(p, held_out), _xy(s, held_out))
            ]
            for s in self.singles
        }

    def self_dominated(self, held_out: bool = True) -> list[int]:
        """The front points another front point dominates once P99 is simulated (and, with
        ``held_out``, accuracy scored on the score half)."""
        return [
            i
            for i, p in enumerate(self.front)
            if any(dominates(_xy(q, held_out), _xy(p, held_out)) for q in self.front)
        ]

    def dominating_cascadeserve(self, held_out: bool = True) -> list[list[int]]:
        return [
            [i for i, p in enumerate(self.front) if dominates(_xy(p, held_out), _xy(c, held_out))]
            for c in self.cascadeserve
        ]


def _xy(point: Point, held_out: bool) -> tuple[float, float]:
    return (point.p99_ms, point.held_out_accuracy if held_out else point.in_sample_accuracy)


def run(ctx: Context) -> Section:
    setup = make_setup(ctx)
    fam = setup.family.family
    ctx.log(
        f"budget {BUDGET_INSTANCES} x {setup.itype}; Poisson load {setup.rate_qps:.0f} qps,"
        f" {len(setup.trace):,} queries; sweeping {len(setup.grid)}^{len(fam.models) - 1}"
        f" threshold settings of {' -> '.join(fam.models)}"
    )
    started = time.perf_counter()
    pareto = cascadia_front(setup)
    sweep_s = time.perf_counter() - started
    ctx.log(f"front: {len(pareto)} points ({sweep_s:.1f} s)")
    itype = setup.itype
    front = tuple(
        measure(
            setup,
            "cascadia",
            p.cascade,
            [int(f.get(itype, 0)) for f in p.allocation.fleets],
            p.weight_ratios,
        )
        for p in pareto
    )
    for p in front:
        ctx.log(f"  {p.label} [{p.fleet_text()}]: P99 {p.p99_ms:.2f} ms")
    singles = tuple(
        measure(setup, "single", Cascade((m,), ()), [BUDGET_INSTANCES]) for m in fam.models
    )
    chosen = cascadeserve_cascade(setup)
    cascadeserve = (
        measure(setup, "cascadeserve", chosen, load_counts(setup, chosen)),
        measure(setup, "cascadeserve-milp", chosen, milp_counts(setup, chosen)),
    )
    outcome = Outcome(
        setup, front, singles, cascadeserve, len(setup.grid) ** (len(fam.models) - 1), sweep_s
    )
    return Section(
        key=KEY,
        title="Cascadia: the latency/accuracy front against single models and CascadeServe",
        what=_what(outcome),
        rerun="python -m benchmarks.results.cascadia",
        body=_body(outcome),
        summary=_summary(outcome),
        data=_data(outcome),
        figures=[_figure(ctx, outcome)],
    )


# --- reporting -------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2f}"


def _names(indices: Sequence[int]) -> str:
    return ", ".join(f"C{i + 1}" for i in indices) or "none"


def _what(o: Outcome) -> str:
    s = o.setup
    fam = s.family.family
    top = fam.most_accurate
    return f"""\
- The demo family (`benchmarks/gear_demo.py`, {fam.source}): models
  {", ".join(f"`{m}`" for m in fam.models)}, cheapest first, on `{s.itype}`
  (${s.price:g}/hr); mean batch-1 latency
  {", ".join(f"{m} {s.compute_ms[m]:.2f} ms" for m in fam.models)}. {s.family.note()}.
- Fleet budget: {BUDGET_INSTANCES} instances (${s.budget_usd_per_hr:.2f}/hr) for every
  approach. Load: Poisson at {s.rate_qps:.0f} qps ({LOAD_SHARE:g} x what `{top}` serves on the
  whole budget, {BUDGET_INSTANCES} x {s.rate_per_instance_qps[top]:.0f} qps),
  {len(s.trace):,} queries over {s.trace.duration_s:.0f} s, each carrying a score-half
  validation sample.
- Held-out protocol (docs/cascades.md): the {fam.records.n_samples} validation samples are
  split by label into a choose half ({s.choose.n_samples}) and a score half
  ({s.score.n_samples}), seed {SEED}. Thresholds (the sweep's and CascadeServe's) and the reach
  shares the MILP sizes stages by come from the choose half; the accuracies compared are the
  score half's, and the simulated forwarding follows score-half samples.
- **Cascadia** (`estimator.allocation.tchebycheff_front`): the chain
  {" -> ".join(fam.models)} with every threshold setting of the grid
  {", ".join(f"{h:g}" for h in s.grid)} ({o.settings} settings, {o.sweep_s:.1f} s); each
  setting's MILP allocation (minimise the worst stage's M/D/1 mean latency within the budget,
  `scipy.optimize.milp`) and the weighted-Tchebycheff picks over 21 weight ratios from 0.1 to
  10: {len(o.front)} points (C1, C2, ... in the sweep's order: its M/D/1 objective, least
  first).
- **Single models**: each model alone on all {BUDGET_INSTANCES} instances.
- **CascadeServe-style**: the cascade `choose_held_out` picks on the choose half (the cheapest
  cascade within 0.5 points of the most accurate model,
  `controlplane/policies/cascade_choice.py`), with the instances split by each stage's share of
  the work (reach x batch-1 compute, at least one each, largest remainder); and the same
  cascade with the MILP's allocation.
- Latency: each point's pipeline simulated end to end (`estimator.simulator.simulate`, FCFS,
  one query per batch as the M/D/1 model assumes, service times drawn from the measured
  profiles); P50/P99 of the response time. Per stage, the MILP's M/D/1 mean latency beside the
  simulated mean sojourn (the stages replayed one after another, stage i+1 fed stage i's
  completions of the forwarded queries).
"""


def _row(name: str, p: Point) -> list[object]:
    return [
        name,
        f"`{p.label}`",
        p.fleet_text(),
        _pct(p.held_out_accuracy),
        _pct(p.in_sample_accuracy),
        _ms(p.p50_ms),
        _ms(p.p99_ms),
        _ms(p.md1_worst_ms),
    ]


def _body(o: Outcome) -> str:
    headers = [
        "point",
        "cascade",
        "instances per stage",
        "held-out acc.",
        "in-sample acc.",
        "P50 ms (sim.)",
        "P99 ms (sim.)",
        "MILP worst stage ms (M/D/1 mean)",
    ]
    rows = [_row(f"C{i + 1}", p) for i, p in enumerate(o.front)]
    rows += [_row("single", p) for p in o.singles]
    rows += [
        _row("CascadeServe, load share", o.cascadeserve[0]),
        _row("CascadeServe's cascade, MILP", o.cascadeserve[1]),
    ]
    parts = [
        "### Every point (P99 and P50 simulated end to end)",
        "",
        md_table(headers, rows, right="3,4,5,6,7"),
        "",
        "### Dominance (P99 simulated, accuracy held-out / in-sample)",
        "",
    ]
    held, ins = o.dominated_singles(True), o.dominated_singles(False)
    dom_rows = [[f"`{m}` alone", _names(held[m]), _names(ins[m])] for m in held]
    cs_held, cs_ins = o.dominating_cascadeserve(True), o.dominating_cascadeserve(False)
    dom_rows += [
        ["CascadeServe, load share", _names(cs_held[0]), _names(cs_ins[0])],
        ["CascadeServe's cascade, MILP", _names(cs_held[1]), _names(cs_ins[1])],
    ]
    parts += [
        md_table(["point", "front points dominating it (held-out)", "(in-sample)"], dom_rows),
        "",
        "### The MILP's stage latency against the simulator",
        "",
        "Per stage of each point: the reach share (choose half), the instances, the M/D/1 mean",
        "latency the MILP minimises the worst of, and the simulated sojourn there (mean and P99).",
        "",
    ]
    stage_rows = []
    for name, p in [(f"C{i + 1}", p) for i, p in enumerate(o.front)] + [
        ("CascadeServe, load share", o.cascadeserve[0]),
        ("CascadeServe's cascade, MILP", o.cascadeserve[1]),
    ]:
        for i, m in enumerate(p.cascade.models):
            stage_rows.append(
                [
                    name if i == 0 else "",
                    m,
                    f"{p.reach_share[i]:.3f}",
                    p.counts[i],
                    _ms(p.md1_stage_ms[i]),
                    _ms(p.sim_stage_mean_ms[i]),
                    _ms(p.sim_stage_p99_ms[i]),
                ]
            )
    parts += [
        md_table(
            [
                "point",
                "stage",
                "reach",
                "instances",
                "M/D/1 mean ms",
                "sim. mean ms",
                "sim. P99 ms",
            ],
            stage_rows,
            right="2,3,4,5,6",
        ),
        "",
        f"The end-to-end P99 of the stage-by-stage replay agrees with the pipeline's within"
        f" {_replay_gap(o):.1f}% over every point (different random draws).",
    ]
    return "\n".join(parts)


def _all(o: Outcome) -> list[Point]:
    return [*o.front, *o.singles, *o.cascadeserve]


def _replay_gap(o: Outcome) -> float:
    return max(100 * abs(p.tandem_p99_ms - p.p99_ms) / p.p99_ms for p in _all(o))


def _md1_error(o: Outcome) -> tuple[float, float]:
    """Median and largest relative error (%) of the M/D/1 stage mean against the simulated one,
    over the stages of the front that queries reach."""
    errors = [
        100 * abs(md1 - sim) / sim
        for p in o.front
        for md1, sim in zip(p.md1_stage_ms, p.sim_stage_mean_ms, strict=True)
        if sim is not None and math.isfinite(md1) and sim > 0
    ]
    return float(np.median(errors)), float(max(errors))


def _summary(o: Outcome) -> list[str]:
    """The section's findings (their wording: benchmarks/results/findings/cascadia.md)."""
    s = o.setup
    fam = s.family.family
    lo = min(o.front, key=lambda p: p.p99_ms)
    best = max(o.front, key=lambda p: (p.held_out_accuracy, -p.p99_ms))
    top = next(p for p in o.singles if p.cascade.models[0] == fam.most_accurate)
    held, ins = o.dominated_singles(True), o.dominated_singles(False)
    dominated = [m for m, d in held.items() if d] or ["none"]
    dominated_in = [m for m, d in ins.items() if d] or ["none"]
    lines = [
        finding(
            KEY,
            "front",
            instances=BUDGET_INSTANCES,
            rate_qps=f"{s.rate_qps:.0f}",
            points=len(o.front),
            first_model=fam.models[0],
            last_model=fam.models[-1],
            low_accuracy=_pct(lo.held_out_accuracy),
            low_p99_ms=f"{lo.p99_ms:.1f}",
            best_accuracy=_pct(best.held_out_accuracy),
            best_p99_ms=f"{best.p99_ms:.1f}",
            top_model=fam.most_accurate,
            top_accuracy=_pct(top.held_out_accuracy),
            top_p99_ms=f"{top.p99_ms:.1f}",
            dominated=", ".join(dominated),
            dominated_in_sample=", ".join(dominated_in),
        )
    ]
    cs, cs_milp = o.cascadeserve
    cs_dom = o.dominating_cascadeserve(True)
    lines.append(
        finding(
            KEY,
            "cascadeserve",
            label=cs.label,
            fleet=cs.fleet_text(),
            accuracy=_pct(cs.held_out_accuracy),
            p99_ms=f"{cs.p99_ms:.1f}",
            milp_fleet=cs_milp.fleet_text(),
            milp_accuracy=_pct(cs_milp.held_out_accuracy),
            milp_p99_ms=f"{cs_milp.p99_ms:.1f}",
            dominating=_names(cs_dom[0]),
            dominating_milp=_names(cs_dom[1]),
        )
    )
    median, worst = _md1_error(o)
    lines.append(
        finding(
            KEY,
            "milp",
            median_error=f"{median:.1f}",
            worst_error=f"{worst:.1f}",
            dominated_in_sample=len(o.self_dominated(False)),
            points=len(o.front),
            dominated_held_out=len(o.self_dominated(True)),
        )
    )
    return lines


def _point_data(p: Point, price: float) -> dict[str, Any]:
    return {
        "kind": p.kind,
        "label": p.label,
        **p.cascade.to_document(),
        "instances": list(p.counts),
        "cost_usd_per_hr": sum(p.counts) * price,
        "held_out_accuracy": p.held_out_accuracy,
        "accuracy": p.in_sample_accuracy,
        "reach_share": list(p.reach_share),
        "md1_stage_ms": [None if math.isinf(x) else x for x in p.md1_stage_ms],
        "md1_worst_ms": None if math.isinf(p.md1_worst_ms) else p.md1_worst_ms,
        "sim_stage_mean_ms": list(p.sim_stage_mean_ms),
        "sim_stage_p99_ms": list(p.sim_stage_p99_ms),
        "p50_ms": p.p50_ms,
        "p99_ms": p.p99_ms,
        "mean_ms": p.mean_ms,
        "replay_p99_ms": p.tandem_p99_ms,
        "weight_ratios": list(p.weight_ratios),
    }


def _data(o: Outcome) -> dict[str, Any]:
    s = o.setup
    fam = s.family.family
    median, worst = _md1_error(o)
    return {
        "family": fam.source,
        "models": list(fam.models),
        "instance_type": s.itype,
        "price_usd_per_hr": s.price,
        "budget_instances": BUDGET_INSTANCES,
        "budget_usd_per_hr": s.budget_usd_per_hr,
        "load_share": LOAD_SHARE,
        "rate_qps": s.rate_qps,
        "rate_per_instance_qps": dict(s.rate_per_instance_qps),
        "compute_ms": dict(s.compute_ms),
        "queries": len(s.trace),
        "trace_s": s.trace.duration_s,
        "grid": list(s.grid),
        "settings": o.settings,
        "sweep_s": o.sweep_s,
        "split": {
            "choose_share": DEFAULT_CHOOSE_SHARE,
            "seed": SEED,
            "choose_samples": s.choose.n_samples,
            "score_samples": s.score.n_samples,
        },
        "front": [_point_data(p, s.price) for p in o.front],
        "singles": [_point_data(p, s.price) for p in o.singles],
        "cascadeserve": [_point_data(p, s.price) for p in o.cascadeserve],
        "dominated_singles": {
            "held_out": o.dominated_singles(True),
            "in_sample": o.dominated_singles(False),
        },
        "dominating_cascadeserve": {
            "held_out": o.dominating_cascadeserve(True),
            "in_sample": o.dominating_cascadeserve(False),
        },
        "md1_error_pct": {"median": median, "worst": worst},
        "front_self_dominated": {
            "held_out": o.self_dominated(True),
            "in_sample": o.self_dominated(False),
        },
        "replay_gap_pct": _replay_gap(o),
    }


def _plain_ticks(axis: Any) -> None:
    """Log-axis ticks written as plain numbers (3, 10, 30), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))


def _figure(ctx: Context, o: Outcome) -> Figure:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11.5, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    front = sorted(o.front, key=lambda p: p.p99_ms)
    ax.plot(
        [p.p99_ms for p in front],
        [100 * p.held_out_accuracy for p in front],
        color="tab:blue",
        marker="o",
        label="Cascadia front (held-out)",
    )
    ax.plot(
        [p.p99_ms for p in front],
        [100 * p.in_sample_accuracy for p in front],
        color="tab:blue",
        marker="o",
        markerfacecolor="none",
        linestyle=":",
        alpha=0.6,
        label="Cascadia front (in-sample)",
    )
    for i, p in enumerate(o.front):
        ax.annotate(
            f"C{i + 1}", (p.p99_ms, 100 * p.held_out_accuracy), fontsize=7,
            xytext=(3, -9), textcoords="offset points", color="tab:blue",
        )  # fmt: skip
    ax.scatter(
        [p.p99_ms for p in o.singles],
        [100 * p.held_out_accuracy for p in o.singles],
        color="tab:red",
        marker="s",
        zorder=3,
        label=f"single model on {BUDGET_INSTANCES} instances",
    )
    ax.scatter(
        [p.p99_ms for p in o.singles],
        [100 * p.in_sample_accuracy for p in o.singles],
        color="tab:red", marker="s", facecolors="none", alpha=0.6, zorder=3,
        label="single model (in-sample)",
    )  # fmt: skip
    for p in o.singles:
        ax.annotate(
            p.cascade.models[0], (p.p99_ms, 100 * p.held_out_accuracy), fontsize=8,
            xytext=(4, 3), textcoords="offset points", color="tab:red",
        )  # fmt: skip
    for p, marker, name in (
        (o.cascadeserve[0], "*", "CascadeServe-style (load share)"),
        (o.cascadeserve[1], "P", "CascadeServe's cascade, MILP allocation"),
    ):
        ax.scatter(
            [p.p99_ms], [100 * p.held_out_accuracy], color="tab:green", marker=marker, s=90,
            zorder=3, label=name,
        )  # fmt: skip
    ax.set_xscale("log")
    _plain_ticks(ax.xaxis)
    ax.set_xlabel("P99 latency, simulated end to end (ms, log)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(
        f"{BUDGET_INSTANCES} x {o.setup.itype}, {o.setup.rate_qps:.0f} qps Poisson", fontsize=10
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    md1, sim = [], []
    for p in front:
        for a, b in zip(p.md1_stage_ms, p.sim_stage_mean_ms, strict=True):
            if b is not None and math.isfinite(a):
                md1.append(a)
                sim.append(b)
    bx.scatter(md1, sim, color="tab:blue", s=18)
    lo, hi = min(md1 + sim) * 0.8, max(md1 + sim) * 1.25
    bx.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle="--", label="y = x")
    bx.set_xscale("log")
    bx.set_yscale("log")
    _plain_ticks(bx.xaxis)
    _plain_ticks(bx.yaxis)
    bx.set_xlabel("MILP's stage latency, M/D/1 mean (ms)")
    bx.set_ylabel("simulated stage sojourn, mean (ms)")
    bx.set_title("Cascadia's stages: closed form vs simulator", fontsize=10)
    bx.grid(alpha=0.3, which="both")
    bx.legend(fontsize=8)
    return save_figure(
        ctx,
        fig,
        f"{KEY}.png",
        "Left: held-out accuracy against simulated P99 of Cascadia's front (hollow: the same"
        " points' in-sample accuracy, on the choose half the thresholds were fitted to), each"
        " single model on the whole budget and the"
        " CascadeServe-style plans. Right: per stage of the front, the MILP's M/D/1 mean"
        " latency against the simulated mean sojourn.",
    )


def main(argv: list[str] | None = None) -> int:
    return experiment_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
