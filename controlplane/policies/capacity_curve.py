"""The planner's capacity as a function of load: the tuner's model of how much a stage needs.

InferLine's tuner sizes a stage for a live rate r as r s_m / rho_m with one provisioning ratio
rho_m, measured at the planned rate: capacity proportional to load. The planner (the estimator,
:mod:`controlplane.policies.planner`) does not scale so: a fleet's burst headroom shrinks
relative to the rate as the fleet grows (more instances multiplex the bursts, and a queue of c
servers waits less at the same utilisation), so the capacity that meets the SLO grows slower than
the rate. A constant rho then over-provisions every load above the planned one (and
under-provisions below it).

This module owns the measured alternative, :func:`capacity_curve`: the points (f, m(f)) where
m(f) = cap(plan at f) / cap(plan at 1), "plan at f" is the planner's plan for the planning trace
compressed in time by f (at f times its rate, the same arrival process) and cap() a fleet's
capacity in the stage's units (the Kairos throughput bound for a Kairos-dispatched mix, else the
sum of mu_t). :meth:`controlplane.policies.tuner.TunerStage.capacity_at_load_qps` reads it: at
the live load f (:func:`controlplane.policies.tuner.load_factors`) the tuner needs the planned
capacity times m(f), so a live envelope equal to the planned one keeps the planned fleet. Each
point costs one plan (a second or two for one model).

:func:`build_ladder` keeps the plans' fleets as well (the sizing model's rungs,
:mod:`controlplane.policies.sizing`), from 0.2x to 5x of the plan: the tuner then re-chooses the
mix as the load moves, not only the capacity.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from controlplane.policies.pipeline import mix_dispatch
from controlplane.policies.plan import PlanDocument, StagePlan
from controlplane.policies.planner import ServingCapacityError, plan_app, scale_trace
from controlplane.policies.replay import (
    matched_capacity_model,
    rate_per_instance_qps,
    stage_slo_targets_ms,
)
from controlplane.policies.sizing import DEFAULT_LADDER_LOADS, SizingLadder
from controlplane.policies.tuner import DEFAULT_RECENT_S
from controlplane.spec import ResolvedApp
from estimator.envelope import DEFAULT_PERSISTENCE_S, arrival_cv2
from estimator.traces import Trace, constant_profile, renewal_arrivals

__all__ = [
    "DEFAULT_BURSTINESS",
    "DEFAULT_LOADS",
    "LOAD_MODEL_RECENT_S",
    "LadderStage",
    "build_ladder",
    "build_ladders",
    "burst_stand_in",
    "capacity_curve",
    "cascade_sizing",
    "replay_sizing",
]

# The loads the curve is measured at: from half the planned rate to twice it, finer near the plan
# where the tuner spends most of its time. Outside them the tuner extrapolates proportionally
# from the nearest end, InferLine's constant ratio.
DEFAULT_LOADS: tuple[float, ...] = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
# How far back the live envelope looks with the load model (the tuner's ``recent_s``; InferLine's
# is 60 s, its longest window). The planned envelope is the most arrivals in any window over the
# whole planning trace (10 minutes); the same traffic seen through 60 s has fewer windows, so its
# maxima read low (rm2 at 60 qps, CV^2 = 4: the 1 s peak over a minute is 104-119 qps where the
# ten minutes say 119), and the tuner sheds capacity the plan was sized to hold, then misses when
# the bursts come back (benchmarks/tuner_oracle.py measured 60, 120 and 180 s and kept 180 s).
# With the ladder sized for the live burstiness (DEFAULT_BURSTINESS), one minute, InferLine's
# own: on the held-out benchmark's tuning seed (101, never its test seeds) it met the per-trace
# goal on 12 of 24 traces against 8 at 120 s, losing none (falls, steps down and daily cycles
# followed sooner), at a mean miss share of 0.92% against 0.81% (recurring spikes ridden on less
# memory: wnd's 2.9% against 2.0%); docs/tuner.md, "Burstiness" ("Memory").
LOAD_MODEL_RECENT_S = 60.0
# The burstiness (CV^2 of the gaps) a ladder is planned for besides the planning trace's own
# (docs/tuner.md, "Burstiness"): a Poisson stream to twice the bursts of the usual CV^2 4 guess,
# a factor of two apart, so that an estimate within 40% picks the right one. Not chosen on the
# tuning seed: it is the set of CV^2 the held-out benchmark draws from (docs/tuner.md says so).
DEFAULT_BURSTINESS: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
# The loads of the ladders for other burstiness: the planned one's from 0.45x to 2.8x (eight
# plans each, not twelve: beyond them the tuner fills the nearest rung with the instances of
# most capacity per USD/hr, as it does past the planned ladder's ends).
BURSTINESS_LADDER_LOADS: tuple[float, ...] = (0.45, 0.65, 0.8, 1.0, 1.25, 1.6, 2.0, 2.8)


# A cascade's stages run few instances each (one to a handful), so between two rungs the fleet
# changes by a whole instance, a third or half of the stage; the ladder plans in between where
# the fleet changes until its rungs are at most 10% apart in load (a few plans per change: a
# cascade's plan takes about a second). On the held-out benchmark's tuning seed this cut the
# cascade's cost from 1.12x the oracle to 1.07x on average (its step trace 1.26x -> 1.09x, its
# spikes 1.27x -> 1.13x); its rising trace missed more (0.3% -> 3.3%: on finer rungs the large
# stage keeps one instance closer to the planner's limit, and the load rises while the second
# boots). A single stage's ladder (four to twelve instances, which the tuner trims or fills
# between rungs one instance at a time) is not refined.
CASCADE_LADDER_REFINE = 1.1


def burst_stand_in(planning: Trace, cv2: float, seed: int = 0) -> Trace:
    """A planning trace of burstiness ``cv2``: gamma renewal arrivals (exponential for 1) at
    ``planning``'s mean rate over its span, with its batch sizes in its order (repeated as far
    as needed); deterministic for a seed."""
    rate_qps = (len(planning) - 1) / planning.duration_s
    rng = np.random.default_rng([seed, round(100 * cv2)])
    arrival_s = renewal_arrivals(constant_profile(rate_qps), planning.duration_s, cv2, rng)
    return Trace(arrival_s, np.resize(planning.batch_size, arrival_s.size))


@dataclasses.dataclass(frozen=True, slots=True)
class LadderStage:
    """One stage a ladder is built for: its name, dispatch policy, batch size (the most queries
    per batch), types its rates must cover besides the rungs' (an applied plan's own) and, for a
    Kairos-dispatched stage of a cascade, its share of the SLO (the Kairos bound's QoS)."""

    name: str
    dispatch: str | None
    batch_size: int = 1
    also_types: tuple[str, ...] = ()
    slo_ms: float | None = None


def build_ladder(
    app: ResolvedApp,
    stage: str,
    planning: Trace,
    *,
    dispatch: str | None,
    batch_size: int = 1,
    loads: Sequence[float] = DEFAULT_LADDER_LOADS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    also_types: Iterable[str] = (),
    burstiness: Sequence[float] = (),
) -> SizingLadder | None:
    """The ladder of ``stage`` on ``planning``: the planner's plan for the planning trace at f
    times its rate, for each f in ``loads`` and 1 (module docstring); None when the planner
    places nothing at f = 1. Its rates and capacity model cover the rungs' types and
    ``also_types`` (an applied plan's own, where it differs). For each CV^2 in ``burstiness``
    that is not the planning trace's own (within 25%), a ladder on :func:`burst_stand_in` at
    those of :data:`BURSTINESS_LADDER_LOADS` among ``loads`` (``families``; skipped where the
    planner places nothing at 1x), all on the same rates and capacity model; the ladder's
    ``cv2`` is the planning trace's (:func:`estimator.envelope.arrival_cv2`). Deterministic for
    a seed. :func:`build_ladders` makes the ladders of several stages of one app (a cascade)
    from the same plans."""
    wanted = LadderStage(stage, dispatch, batch_size, tuple(also_types))
    return build_ladders(
        app,
        [wanted],
        planning,
        loads=loads,
        seed=seed,
        progress=progress,
        burstiness=burstiness,
    )[stage]


def build_ladders(
    app: ResolvedApp,
    stages: Sequence[LadderStage],
    planning: Trace,
    *,
    loads: Sequence[float] = DEFAULT_LADDER_LOADS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    burstiness: Sequence[float] = (),
    refine: float = 0.0,
) -> dict[str, SizingLadder | None]:
    """:func:`build_ladder` for each of ``stages`` of one app at once: each rung is one plan of
    the whole app (a cascade's stages are planned together, as the planner plans them), and
    each stage's ladder keeps its own fleet of it. The rates mu_t are on the planning trace's
    batch mix for every stage (a cascade forwards queries regardless of their batch size).
    A stage the planner places nothing for at f = 1 gets None. With ``refine`` > 1, wherever
    some stage's fleet differs between two neighbouring loads more than ``refine`` apart, the
    load between them (their geometric mean) is planned too, until none is left (a ladder of
    ``loads`` alone when 0)."""
    say = progress or (lambda _message: None)
    names = [s.name for s in stages]

    # The planner's batch per stage at each rung, by the ladder's label ("": the planning
    # trace's own; " CV^2 c": a burstiness family's).
    batches: dict[tuple[str, str], dict[float, int]] = {}

    def rungs(
        trace: Trace, label: str, at: Sequence[float]
    ) -> dict[str, dict[float, Mapping[str, int]]]:
        rate_qps = (len(trace) - 1) / trace.duration_s
        fleets: dict[str, dict[float, Mapping[str, int]]] = {name: {} for name in names}
        for name in names:
            batches[name, label] = {}

        def plan_at(f: float) -> None:
            try:
                plan = plan_app(app, scale_trace(trace, f * rate_qps), seed=seed)
            except ServingCapacityError as error:
                # Past the serving process's capacity no fleet serves: the ladder ends below.
                say(f"ladder{label} x{f:g}: none ({error})")
                return
            for s in plan.stages:
                fleet = {t: n for t, n in s.fleet.items() if n}
                if s.name in fleets and fleet:
                    fleets[s.name][f] = MappingProxyType(fleet)
                    batches[s.name, label][f] = s.batch_size
            placed = {s.name: {t: n for t, n in s.fleet.items() if n} for s in plan.stages}
            shown = placed[names[0]] if len(names) == 1 and names[0] in placed else placed
            say(f"ladder{label} x{f:g}: {shown} ${plan.cost_usd_per_hr:.3f}/hr")

        done = sorted({1.0, *(float(x) for x in at)})
        for f in done:
            plan_at(f)
        # Between two rungs the tuner provisions the upper one's capacity (the lower one's
        # fleet serves up to some load in between that only a plan can tell): where the fleet
        # changes, plan in between until the rungs are at most ``refine`` apart.
        while refine > 1.0:
            gaps = [
                (a, b)
                for a, b in itertools.pairwise(done)
                if b / a > refine and any(fleets[n].get(a) != fleets[n].get(b) for n in names)
            ]
            if not gaps:
                break
            for a, b in gaps:
                plan_at(round(math.sqrt(a * b), 4))
            done = sorted({*done, *(round(math.sqrt(a * b), 4) for a, b in gaps)})
        return fleets

    found = rungs(planning, "", loads)
    own_cv2, _gaps = arrival_cv2(planning.arrival_s)
    others: list[tuple[float, Trace, dict[str, dict[float, Mapping[str, int]]], str]] = []
    if any(1.0 in found[name] for name in names):
        for cv2 in burstiness:
            if np.isfinite(own_cv2) and abs(np.log(cv2 / own_cv2)) < np.log(1.25):
                continue
            trace = burst_stand_in(planning, cv2, seed)
            at = [f for f in BURSTINESS_LADDER_LOADS if f in loads]
            label = f" CV^2 {cv2:g}"
            others.append((arrival_cv2(trace.arrival_s)[0], trace, rungs(trace, label, at), label))
    return {
        stage.name: _stage_ladder(app, stage, planning, found[stage.name], others, own_cv2, batches)
        for stage in stages
    }


def _stage_ladder(
    app: ResolvedApp,
    stage: LadderStage,
    planning: Trace,
    fleets: dict[float, Mapping[str, int]],
    others: Sequence[tuple[float, Trace, dict[str, dict[float, Mapping[str, int]]], str]],
    own_cv2: float,
    batches: Mapping[tuple[str, str], Mapping[float, int]],
) -> SizingLadder | None:
    if 1.0 not in fleets:
        return None
    # This stage's fleets in the other burstiness' plans, where the planner placed it at 1x.
    mine = [
        (cv2, trace, found[stage.name], label)
        for cv2, trace, found, label in others
        if 1.0 in found[stage.name]
    ]
    every = [fleets, *(f for _, _, f, _ in mine)]
    types = sorted(
        {*stage.also_types, *(t for rung in every for fleet in rung.values() for t in fleet)}
    )
    mu = MappingProxyType(
        {
            t: rate_per_instance_qps(
                app.profile(stage.name, t), planning.batch_size, stage.batch_size
            )
            for t in types
        }
    )
    model = matched_capacity_model(
        app, stage.dispatch, stage.name, types, stage.batch_size, planning, stage.slo_ms
    )

    def laddered(found: dict[float, Mapping[str, int]], label: str) -> SizingLadder | None:
        batched = tuple(sorted(batches.get((stage.name, label), {}).items()))
        ladder = SizingLadder(stage.name, tuple(sorted(found.items())), mu, (), model)
        anchor = ladder.capacity_qps(found[1.0])
        if anchor <= 0.0:
            return None
        points = []
        running = 0.0
        for f, planned in ladder.rungs:
            running = max(running, ladder.capacity_qps(planned) / anchor)
            points.append((f, running))
        return SizingLadder(stage.name, ladder.rungs, mu, tuple(points), model, batches=batched)

    base = laddered(fleets, "")
    if base is None:
        return None
    families = []
    for cv2, trace, found, label in mine:
        other = laddered(found, label)
        if other is not None:
            families.append((cv2, trace.arrival_s, other))
    if not families:
        return base
    return dataclasses.replace(base, cv2=own_cv2, families=tuple(families))


def capacity_curve(
    app: ResolvedApp,
    stage: str,
    planning: Trace,
    *,
    dispatch: str | None,
    batch_size: int = 1,
    loads: Sequence[float] = DEFAULT_LOADS,
    seed: int = 0,
) -> tuple[tuple[float, float], ...]:
    """The points (f, m(f)) for ``stage`` of a single-stage app (the module docstring), m made
    non-decreasing in f (a running maximum): :func:`build_ladder`'s curve at ``loads``; empty
    when the planner places nothing at f = 1. Deterministic for a seed."""
    ladder = build_ladder(
        app, stage, planning, dispatch=dispatch, batch_size=batch_size, loads=loads, seed=seed
    )
    return () if ladder is None else ladder.curve


def replay_sizing(
    app: ResolvedApp,
    stage: StagePlan,
    planning: Trace,
    *,
    dispatch: str | None = None,
    seed: int = 0,
    burstiness: Sequence[float] = DEFAULT_BURSTINESS,
    loads: Sequence[float] = DEFAULT_LADDER_LOADS,
    progress: Callable[[str], None] | None = None,
) -> tuple[SizingLadder | None, dict[str, Any]]:
    """What ``heteroplane replay``'s tuner sizes a single-stage plan with, by default: the
    sizing ladder of ``planning`` (:func:`build_ladder`, covering the plan's own types too),
    the load model's memory (:data:`LOAD_MODEL_RECENT_S`) and bursts shorter than
    :data:`estimator.envelope.DEFAULT_PERSISTENCE_S` read as noise; InferLine's 60 s memory
    where the planner places nothing at the planning rate (no ladder). ``loads``: the ladder's
    rungs (:func:`build_ladder`); ``dispatch``: the replay's (None: the policy that dispatches
    the stage's mixes, :func:`~controlplane.policies.pipeline.mix_dispatch`, as the live tuner's
    ladder takes). Returns (the ladder or None, keyword arguments of
    :func:`controlplane.policies.replay.replay`)."""
    ladder = build_ladder(
        app,
        stage.name,
        planning,
        dispatch=dispatch if dispatch is not None else mix_dispatch(stage),
        batch_size=stage.batch_size,
        loads=loads,
        seed=seed,
        also_types=[t for t, n in stage.fleet.items() if n],
        burstiness=burstiness,
        progress=progress,
    )
    options: dict[str, Any] = {"tuner_persistence_s": DEFAULT_PERSISTENCE_S}
    if ladder is None:
        options["tuner_recent_s"] = DEFAULT_RECENT_S
    else:
        options.update(tuner_ladder=ladder, tuner_recent_s=LOAD_MODEL_RECENT_S)
    return ladder, options


def cascade_sizing(
    app: ResolvedApp,
    plan: PlanDocument,
    planning: Trace,
    *,
    dispatch: str | None = None,
    seed: int = 0,
    burstiness: Sequence[float] = DEFAULT_BURSTINESS,
    progress: Callable[[str], None] | None = None,
    refine: float = CASCADE_LADDER_REFINE,
    loads: Sequence[float] = DEFAULT_LADDER_LOADS,
) -> tuple[dict[str, SizingLadder], dict[str, Any]]:
    """:func:`replay_sizing` for a plan of several stages (a cascade): the ladder of each stage
    (:func:`build_ladders`: one plan of the whole cascade per load, each stage keeping its own
    fleet; a Kairos-dispatched stage's bound at its share of the SLO), the load model's memory
    and bursts that must persist. A stage the planner places nothing for at the planning rate
    has no ladder (its tuner runs InferLine's model); with none at all, InferLine's 60 s
    memory. Returns (the ladders by stage name, keyword arguments of
    :func:`controlplane.policies.replay.replay`)."""
    targets = stage_slo_targets_ms(plan, app)
    wanted = [
        LadderStage(
            stage.name,
            dispatch if dispatch is not None else mix_dispatch(stage),
            stage.batch_size,
            tuple(t for t, n in stage.fleet.items() if n),
            target,
        )
        for stage, target in zip(plan.stages, targets, strict=True)
    ]
    made = build_ladders(
        app,
        wanted,
        planning,
        seed=seed,
        burstiness=burstiness,
        progress=progress,
        refine=refine,
        loads=loads,
    )
    ladders = {name: ladder for name, ladder in made.items() if ladder is not None}
    options: dict[str, Any] = {"tuner_persistence_s": DEFAULT_PERSISTENCE_S}
    if ladders:
        options.update(tuner_ladders=ladders, tuner_recent_s=LOAD_MODEL_RECENT_S)
    else:
        options["tuner_recent_s"] = DEFAULT_RECENT_S
    return ladders, options
