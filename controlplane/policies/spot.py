"""Spot capacity in a plan: which of a planned fleet's instances run on spot, under the budget.

A policy in the STYLE.md sense (pure: prices, rates and the planner in, a plan out). The model
(docs/spot.md):

- **Prices.** Each type has its on-demand price P_t and, when it can be bought on spot, a spot
  price S_t <= P_t (the catalog's, or prices read at run time, ``spot_prices``) and an
  interruption rate lambda_t per spot instance-hour (the catalog's ``interruptions_per_hr``).
- **Which types.** The planner (:func:`~controlplane.policies.planner.plan_app`) chooses the
  types at the price a mix of them will be paid at: P'_t = w P_t + (1 - w) S_t, with w =
  max(survive_share, 1 - max_share) the least share that stays on demand; so a type whose spot
  discount is deep is chosen where it serves the SLO, as its on-demand price alone would not
  allow.
- **The split** (:func:`split_stage`). Each planned instance starts on demand; one at a time, an
  instance is moved to spot, from the type with the smallest spot share first (spreading spot
  across types, so that one type's interruption wave does not take all of it), the largest
  saving among equals, while (1) the on-demand capacity left is at least ``survive_share`` of
  the stage's planned capacity (what must remain if every spot instance is lost at once) and (2)
  spot holds at most ``max_share`` of the stage's capacity. Capacity is what one instance of a
  type serves, Q_t = b / mean latency at the stage's batch size b.
- **Over-provisioning** (SpotHedge's idea). While an interrupted instance's replacement boots,
  its capacity is missing. The number of spot instances down at once is Poisson with mean
  E = sum_t s_t lambda_t g, g the gap (``replacement_gap_s``); the stage gets the k spare spot
  instances of its cheapest spot type (per unit of capacity) for which P(N > k) <= 1 %, when the
  budget pays for them.
- **Never dearer than on demand.** Each prefix of the split's moves, with the spares its
  interruptions need, has a cost; the cheapest prefix is kept (none: all on demand), so spot
  plus spares never costs more than the same fleet on demand. The mix chosen at P'_t and the
  on-demand plan's mix are both split and the cheaper kept, so the plan never costs more than
  the on-demand plan.
- **The budget is a hard cap at the price paid**: the plan's ``cost_usd_per_hr`` is
  sum (n_t - s_t) P_t + sum s_t S_t, within the budget (the on-demand plan split always fits,
  S_t <= P_t). The plan states ``expected_cost_usd_per_hr`` (at the prices used),
  ``cost_if_on_demand_usd_per_hr`` (every instance at P_t: what it costs if spot prices rise to
  on demand; the reconciler's reaction to such a rise: docs/spot.md), the spot prices it used
  and where they came from (``spot_prices_usd_per_hr``, ``spot_prices_source``), and
  ``predicted_slo_attainment``, the share of queries within the SLO it predicts with
  interruptions (the estimator's share with the whole fleet and with each stage's most capable
  spot instance missing, weighted by how often the interruptions leave one missing).
- **The SpotHedge-style baseline** (:func:`plan_spothedge`): one type, all on spot, spares
  whatever they cost, no base (docs/spot.md).

>>> split = split_stage({"a": 4}, {"a": 10.0}, {"a": 1.0}, {"a": 0.3}, {"a": 0.0},
...                     survive_share=0.5, max_share=1.0)
>>> split.spot_fleet, split.cost_usd_per_hr, split.cost_if_on_demand_usd_per_hr
({'a': 2}, 2.6, 4.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from controlplane.policies.plan import PlanDocument, StagePlan
from controlplane.spec import ResolvedApp, SpotSpec
from estimator.errors import EstimatorError
from estimator.fleet import Fleet
from estimator.numbers import money
from estimator.traces import Trace

__all__ = [
    "DEFAULT_REPLACEMENT_GAP_S",
    "SPARE_TAIL",
    "SpotPricesFn",
    "SpotSplit",
    "plan_spothedge",
    "plan_with_spot",
    "spare_count",
    "split_stage",
    "spot_prices_used",
]

# How long an interrupted instance's capacity is missing: a replacement launched at the
# two-minute notice that boots in about three minutes leaves about a minute; one launched with no
# notice (a notice missed) about three. The planner takes the worse.
DEFAULT_REPLACEMENT_GAP_S = 180.0
# Spares cover the spot instances down at once but with this probability.
SPARE_TAIL = 0.01
_SLACK = 1e-9

PlanFn = Callable[..., PlanDocument]
# Instance types -> their spot prices now as the provider reads them (None: not sold on spot);
# the types it cannot say are left out, and the catalog's serve for them (docs/spot.md).
SpotPricesFn = Callable[[Sequence[str]], Mapping[str, float | None]]


@dataclass(frozen=True, slots=True)
class SpotSplit:
    """One stage's fleet split into purchase options: ``fleet`` (every instance, spares
    included), ``spot_fleet`` (how many of them are spot), ``spares`` (spot instances added over
    the planned fleet), and its costs."""

    fleet: dict[str, int]
    spot_fleet: dict[str, int]
    spares: int
    cost_usd_per_hr: float
    cost_if_on_demand_usd_per_hr: float
    expected_interruptions_per_hr: float
    # Instances the spread and the shares would put on spot that stay on demand because spot
    # with the spares it needs would cost more (the cap against on demand).
    kept_on_demand: int = 0


def spare_count(expected_down: float, tail: float = SPARE_TAIL) -> int:
    """The smallest k with P(N > k) <= ``tail`` for N ~ Poisson(``expected_down``).

    >>> spare_count(1e-5), spare_count(0.1), spare_count(1.0)
    (0, 1, 4)
    """
    if expected_down <= 0:
        return 0
    k, term = 0, math.exp(-expected_down)
    cumulative = term
    while 1.0 - cumulative > tail:
        k += 1
        term *= expected_down / k
        cumulative += term
    return k


def split_stage(
    fleet: Mapping[str, int],
    capacity_qps: Mapping[str, float],
    on_demand_usd_per_hr: Mapping[str, float],
    spot_usd_per_hr: Mapping[str, float | None],
    interruptions_per_hr: Mapping[str, float],
    *,
    survive_share: float,
    max_share: float,
    budget_left_usd_per_hr: float = math.inf,
    replacement_gap_s: float = DEFAULT_REPLACEMENT_GAP_S,
    cap_at_on_demand: bool = True,
) -> SpotSplit:
    """Split one stage's ``fleet`` into on demand and spot (see the module docstring);
    ``budget_left_usd_per_hr`` bounds the spares (what the rest of the plan leaves).
    ``cap_at_on_demand``: keep on demand what spot with its spares would cost more as (False:
    every instance the shares allow goes to spot, whatever its spares cost: SpotHedge's way)."""
    counts = {t: n for t, n in fleet.items() if n > 0}
    total = sum(counts[t] * capacity_qps[t] for t in counts)
    spot = dict.fromkeys(counts, 0)
    on_demand_capacity = total

    def movable(t: str) -> bool:
        price = spot_usd_per_hr.get(t)
        # Spot only where it is cheaper (a price read now may have risen to on demand or past).
        if price is None or price >= on_demand_usd_per_hr[t] or spot[t] >= counts[t]:
            return False
        q = capacity_qps[t]
        spot_capacity = total - on_demand_capacity + q
        return (
            on_demand_capacity - q >= survive_share * total - _SLACK
            and spot_capacity <= max_share * total + _SLACK
        )

    moves: list[str] = []
    while True:
        candidates = [t for t in counts if movable(t)]
        if not candidates:
            break
        saving = {t: on_demand_usd_per_hr[t] - (spot_usd_per_hr[t] or 0.0) for t in candidates}
        chosen = min(candidates, key=lambda t: (spot[t] / counts[t], -saving[t], t))
        spot[chosen] += 1
        on_demand_capacity -= capacity_qps[chosen]
        moves.append(chosen)

    rates = {t: interruptions_per_hr.get(t, 0.0) for t in counts}

    def with_spares(spots: Mapping[str, int], budget: float) -> tuple[float, int, str | None]:
        """The cost of ``spots`` with the spares its interruptions need (as many as ``budget``
        and the spot cap allow), the spares and their type."""
        cost = float(
            sum(
                (counts[t] - spots.get(t, 0)) * on_demand_usd_per_hr[t]
                + spots.get(t, 0) * (spot_usd_per_hr.get(t) or 0.0)
                for t in counts
            )
        )
        spot_types = [t for t in counts if spots.get(t, 0) > 0]
        if not spot_types:
            return cost, 0, None
        cheapest = min(spot_types, key=lambda t: ((spot_usd_per_hr[t] or 0.0) / capacity_qps[t], t))
        price = spot_usd_per_hr[cheapest] or 0.0
        spot_capacity = sum(spots.get(t, 0) * capacity_qps[t] for t in counts)
        expected_down = sum(spots.get(t, 0) * rates[t] for t in counts) * replacement_gap_s / 3600.0
        spares = 0
        for _ in range(spare_count(expected_down)):
            extra = (spares + 1) * capacity_qps[cheapest]
            if cost + price > budget + _SLACK:
                break
            if spot_capacity + extra > max_share * (total + extra) + _SLACK:
                break
            spares += 1
            cost += price
        return cost, spares, cheapest

    # The cap against on demand: each prefix of the moves above, with the spares its
    # interruptions need, costs so much; the cheapest prefix is kept (the empty one is the fleet
    # all on demand), so spot plus spares never costs more than the same capacity on demand.
    # Ranked with every spare it needs, whatever the budget; the budget then bounds the spares.
    best, best_cost = len(moves), math.inf
    for m in range(len(moves) + 1) if cap_at_on_demand else ():
        prefix: dict[str, int] = {}
        for t in moves[:m]:
            prefix[t] = prefix.get(t, 0) + 1
        cost_m = with_spares(prefix, math.inf)[0]
        if cost_m < best_cost - _SLACK:
            best, best_cost = m, cost_m
    spot = dict.fromkeys(counts, 0)
    for t in moves[:best]:
        spot[t] += 1
    capped = len(moves) - best
    cost, spares, spare_type = with_spares(spot, budget_left_usd_per_hr)
    if spare_type is not None:
        counts[spare_type] += spares
        spot[spare_type] += spares
    spot_fleet = {t: s for t, s in spot.items() if s > 0}
    return SpotSplit(
        fleet=counts,
        spot_fleet=spot_fleet,
        spares=spares,
        cost_usd_per_hr=money(cost),
        cost_if_on_demand_usd_per_hr=money(
            sum(n * on_demand_usd_per_hr[t] for t, n in counts.items())
        ),
        expected_interruptions_per_hr=float(sum(s * rates[t] for t, s in spot_fleet.items())),
        kept_on_demand=capped,
    )


def _capacity_qps(app: ResolvedApp, stage: StagePlan) -> dict[str, float]:
    """Q_t: what one instance of each of the stage's types serves at its batch size."""
    found = {}
    for t in stage.fleet:
        profile = app.profile(stage.name, t)
        sizes = [int(b) for b in profile.batch_sizes]
        at = max([b for b in sizes if b <= stage.batch_size] or [min(sizes)])
        mean_ms = float(profile.mean_ms[sizes.index(at)])
        found[t] = at / (mean_ms / 1000.0) if mean_ms > 0 else 1.0
    return found


def _blended(app: ResolvedApp, spot: SpotSpec, spot_prices: Mapping[str, float | None]) -> Any:
    keep = max(spot.survive_share, 1.0 - spot.max_share)
    prices = {
        t: (p if spot_prices.get(t) is None else keep * p + (1 - keep) * (spot_prices[t] or 0.0))
        for t, p in app.prices_usd_per_hr.items()
    }
    return dataclasses.replace(app, prices_usd_per_hr=prices)


def _split_plan(
    app: ResolvedApp,
    plan: PlanDocument,
    spot: SpotSpec,
    spot_prices: Mapping[str, float | None],
    replacement_gap_s: float,
    *,
    cap_at_on_demand: bool = True,
) -> PlanDocument:
    on_demand = {t: app.catalog.price_usd_per_hr(t) for t in app.prices_usd_per_hr}
    rates = {t: app.catalog[t].interruptions_per_hr for t in app.prices_usd_per_hr}

    def split(stage: StagePlan, budget_left_usd_per_hr: float = math.inf) -> SpotSplit:
        return split_stage(
            stage.fleet,
            _capacity_qps(app, stage),
            on_demand,
            spot_prices,
            rates,
            survive_share=spot.survive_share,
            max_share=spot.max_share,
            budget_left_usd_per_hr=budget_left_usd_per_hr,
            replacement_gap_s=replacement_gap_s,
            cap_at_on_demand=cap_at_on_demand,
        )

    splits = [split(stage) for stage in plan.stages]
    # Spares only where the budget pays for them, stage by stage.
    budget = app.spec.budget_usd_per_hr
    base = [s.cost_usd_per_hr for s in splits]
    final: list[SpotSplit] = []
    for i, (stage, first) in enumerate(zip(plan.stages, splits, strict=True)):
        left = budget - sum(s.cost_usd_per_hr for s in final) - sum(base[i + 1 :])
        final.append(split(stage, left) if first.spares else first)

    stages = tuple(
        dataclasses.replace(
            stage,
            fleet=type(stage.fleet).of(split.fleet),
            spot_fleet=split.spot_fleet,
            cost_usd_per_hr=split.cost_usd_per_hr,
        )
        for stage, split in zip(plan.stages, final, strict=True)
    )
    cost = money(sum(s.cost_usd_per_hr for s in final))
    if_on_demand = money(sum(s.cost_if_on_demand_usd_per_hr for s in final))
    spares = sum(s.spares for s in final)
    kept = sum(s.kept_on_demand for s in final)
    kept_text = (
        f"; {kept} kept on demand, where spot with the spares it needs would cost more"
        if kept
        else ""
    )
    steps = (
        *plan.steps,
        f"spot: {sum(sum(s.spot_fleet.values()) for s in final)} of"
        f" {sum(sum(s.fleet.values()) for s in final)} instances on spot ({spares} spare),"
        f" at least {spot.survive_share:.0%} of each stage's capacity on demand, at most"
        f" {spot.max_share:.0%} on spot: {cost:.3f} USD/hr at the prices used,"
        f" {if_on_demand:.3f} USD/hr if spot rose to on demand; expected"
        f" {sum(s.expected_interruptions_per_hr for s in final):.3g} interruptions an hour"
        f"{kept_text}",
    )
    return dataclasses.replace(
        plan,
        stages=stages,
        cost_usd_per_hr=cost,
        expected_cost_usd_per_hr=cost,
        cost_if_on_demand_usd_per_hr=if_on_demand,
        steps=steps,
    )


def spot_prices_used(
    app: ResolvedApp, spot_prices: Mapping[str, float | None] | None
) -> tuple[dict[str, float | None], str]:
    """The spot price of each of ``app``'s types a plan uses and where they come from:
    ``spot_prices`` (the provider's now, type -> price, ``None`` where it sells none) over the
    catalog's; ``"catalog"``, ``"provider"`` (every type's from ``spot_prices``) or
    ``"provider and catalog"``."""
    catalog = {t: app.catalog[t].spot_price_usd_per_hr for t in app.prices_usd_per_hr}
    given = {t: p for t, p in (spot_prices or {}).items() if t in catalog}
    if not given:
        return catalog, "catalog"
    source = "provider" if len(given) == len(catalog) else "provider and catalog"
    return {**catalog, **given}, source


def plan_with_spot(
    app: ResolvedApp,
    trace: Trace,
    *,
    plan: PlanFn,
    seed: int = 0,
    spot_prices: Mapping[str, float | None] | None = None,
    replacement_gap_s: float = DEFAULT_REPLACEMENT_GAP_S,
    **planner_args: Any,
) -> PlanDocument:
    """``plan(app, trace, seed=seed, ...)`` with spot capacity when the app's spec enables it
    (see the module docstring); the plain plan otherwise. ``spot_prices``: type -> spot price
    now as the provider reads it (``None`` for a type it does not sell on spot); the catalog's
    serve for the types it leaves out. Never dearer than the on-demand plan: the mix chosen at
    blended prices and the on-demand plan's mix are both split, and the cheaper is kept (the
    on-demand plan's split costs at most the on-demand plan: :func:`split_stage`'s cap)."""
    spot = app.spec.spot
    if spot is None or not spot.enabled:
        return plan(app, trace, seed=seed, **planner_args)
    prices, source = spot_prices_used(app, spot_prices)
    on_demand = plan(app, trace, seed=seed, **planner_args)
    chosen = plan(_blended(app, spot, prices), trace, seed=seed, **planner_args)
    candidates = [_split_plan(app, on_demand, spot, prices, replacement_gap_s)]
    if chosen.feasible or not on_demand.feasible:
        candidates.append(_split_plan(app, chosen, spot, prices, replacement_gap_s))
    budget = app.spec.budget_usd_per_hr
    fits = [c for c in candidates if c.cost_usd_per_hr <= budget + _SLACK] or candidates[:1]
    # The on-demand plan's split first: the blended mix is kept only where it is cheaper.
    best = min(fits, key=lambda c: (not c.feasible, c.cost_usd_per_hr))
    which = "the on-demand plan's mix" if best is candidates[0] else "the mix at blended prices"
    step = (
        f"spot: kept {which} ({best.cost_usd_per_hr:.3f} USD/hr; the on-demand plan"
        f" {on_demand.cost_usd_per_hr:.3f} USD/hr); spot prices from the {source}"
    )
    return _stated(app, best, step, prices, source, trace, seed, replacement_gap_s)


def plan_spothedge(
    app: ResolvedApp,
    trace: Trace,
    *,
    plan: PlanFn,
    seed: int = 0,
    spot_prices: Mapping[str, float | None] | None = None,
    replacement_gap_s: float = DEFAULT_REPLACEMENT_GAP_S,
    **planner_args: Any,
) -> PlanDocument:
    """A SpotHedge-style plan (SkyServe, as issue 33 describes it: spot over-provisioning with
    on-demand fallback, no mix choice), the baseline of ``benchmarks/spot.py``: one instance
    type, the one a homogeneous planner chooses (``plan`` restricted to each type that is sold
    on spot; the cheapest feasible fleet at the spot price), every instance on spot with the
    spares its interruptions need (the same tail as :func:`split_stage`'s, kept whatever they
    cost), no on-demand base. On-demand fallback is the control plane's when spot is short (a
    replacement launched on demand), not part of the plan. The plan states its cost and
    predicted attainment as :func:`plan_with_spot`'s do."""
    prices, source = spot_prices_used(app, spot_prices)
    found: list[PlanDocument] = []
    for t in app.instance_types:
        price = prices.get(t)
        if price is None:
            continue
        alone = dataclasses.replace(
            app,
            spec=app.spec.model_copy(update={"instance_types": [t]}),
            prices_usd_per_hr={t: app.prices_usd_per_hr[t]},
        )
        try:
            made = plan(alone, trace, seed=seed, **planner_args)
        except EstimatorError:  # the type alone cannot serve the SLO
            continue
        if made.feasible:
            found.append(made)
    if not found:
        raise ValueError("no single type sold on spot serves the SLO: no SpotHedge-style plan")

    def at_spot(p: PlanDocument) -> tuple[float, float]:
        spot_cost = sum(n * (prices[t] or 0.0) for t, n in p.fleet.items())
        return spot_cost, p.cost_usd_per_hr

    homogeneous = min(found, key=at_spot)
    hedge = SpotSpec(enabled=True, survive_share=0.0, max_share=1.0)
    split = _split_plan(app, homogeneous, hedge, prices, replacement_gap_s, cap_at_on_demand=False)
    step = (
        f"spothedge: one type, {next(iter(homogeneous.fleet))}, the cheapest homogeneous fleet at"
        f" spot prices of {len(found)} feasible; spot prices from the {source}"
    )
    return _stated(app, split, step, prices, source, trace, seed, replacement_gap_s)


def _stated(
    app: ResolvedApp,
    plan: PlanDocument,
    step: str,
    prices: Mapping[str, float | None],
    source: str,
    trace: Trace,
    seed: int,
    gap_s: float,
) -> PlanDocument:
    """``plan`` with ``step``, the spot prices it was made at and where they came from, and the
    attainment it predicts with interruptions."""
    stated = dataclasses.replace(
        plan,
        steps=(*plan.steps, step),
        spot_prices_usd_per_hr={t: p for t, p in prices.items() if p is not None},
        spot_prices_source=source,
    )
    return _with_attainment(app, stated, trace, seed, gap_s)


def _replay_share(app: ResolvedApp, plan: PlanDocument, trace: Trace, seed: int) -> float:
    """The share of ``trace``'s queries within the SLO on ``plan``'s fleets, static (the
    stage's dispatch, first come first served where it cannot run on what is left), refusing
    what the service's admission control refuses (a refused query is a miss; docs/spot.md)."""
    from controlplane.policies.replay import (
        ReplayError,
        replay_pipeline,
        replay_timeline,
        static_timeline,
    )

    if any(sum(stage.fleet.values()) == 0 for stage in plan.stages):
        return 0.0
    for dispatch in (None, "fcfs"):
        try:
            if len(plan.stages) == 1:
                stage = plan.stages[0]
                result = replay_timeline(
                    trace,
                    app,
                    stage,
                    static_timeline(Fleet.of(dict(stage.fleet))),
                    np.random.default_rng(seed),
                    dispatch=dispatch,
                )
            else:
                result = replay_pipeline(
                    trace,
                    app,
                    plan,
                    np.random.default_rng(seed),
                    dispatch=dispatch,
                )
            return 1.0 - result.slo_miss_share
        except ReplayError:
            # The stage's dispatch cannot run on what is left (Kairos' base types need a type
            # that meets the SLO at every batch size): first come, first served instead.
            continue
    return 0.0


def _with_attainment(
    app: ResolvedApp, plan: PlanDocument, trace: Trace, seed: int, gap_s: float
) -> PlanDocument:
    """The plan with the share of queries within the SLO it predicts with interruptions
    (``predicted_slo_attainment`` and a step): A = (1 - sum_i q_i) A_0 + sum_i q_i A_i, A_0 the
    share on the planning trace with every stage's whole fleet, A_i with stage i's most capable
    spot instance missing, q_i the expected share of time one of stage i's spot instances is
    missing (sum_t s_t lambda_t g; the q_i scaled down together where they sum past 1)."""
    spot_stages = [i for i, s in enumerate(plan.stages) if s.spot_fleet]
    if not spot_stages or len(trace) < 2:
        return plan
    start = Trace(trace.arrival_s - trace.arrival_s[0], trace.batch_size, trace.sample_id)
    whole = _replay_share(app, plan, start, seed)
    parts = []
    for i in spot_stages:
        stage = plan.stages[i]
        capacity = _capacity_qps(app, stage)
        rates = {t: app.catalog[t].interruptions_per_hr for t in stage.spot_fleet}
        q = sum(n * rates[t] for t, n in stage.spot_fleet.items()) * gap_s / 3600.0
        lost = max(stage.spot_fleet, key=lambda t: (capacity[t], t))
        shorter = dict(stage.fleet)
        shorter[lost] -= 1
        stages = list(plan.stages)
        stages[i] = dataclasses.replace(
            stage, fleet=type(stage.fleet).of({t: n for t, n in shorter.items() if n > 0})
        )
        short = _replay_share(app, dataclasses.replace(plan, stages=tuple(stages)), start, seed)
        parts.append((stage.name, lost, q, short))
    total_q = sum(q for _, _, q, _ in parts)
    scale = 1.0 / total_q if total_q > 1.0 else 1.0
    predicted = (1.0 - total_q * scale) * whole + sum(q * scale * a for _, _, q, a in parts)
    missing = "; ".join(
        f"{a:.4%} with one {lost} of {name} missing, {q * scale:.3%} of the time"
        for name, lost, q, a in parts
    )
    step = (
        f"spot: predicted share within the SLO with interruptions {predicted:.4%}"
        f" ({whole:.4%} with the whole fleet; {missing}, at the catalog's interruption rates)"
    )
    return dataclasses.replace(plan, steps=(*plan.steps, step), predicted_slo_attainment=predicted)
