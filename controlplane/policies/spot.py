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
- **The budget is a hard cap at the price paid**: the plan's ``cost_usd_per_hr`` is
  sum (n_t - s_t) P_t + sum s_t S_t. A plan chosen at P'_t whose split costs more than the budget
  (rounding) is given up for the on-demand plan split the same way, which always fits (S_t <=
  P_t). The plan states ``expected_cost_usd_per_hr`` (at the prices used) and
  ``cost_if_on_demand_usd_per_hr`` (every instance at P_t: what it costs if spot prices rise to
  on demand; the reconciler's reaction to such a rise: docs/spot.md), and for a single stage the
  share of queries within the SLO it predicts with interruptions (a step of the plan: the
  estimator's share with the whole fleet and with its most capable spot instance missing,
  weighted by how often the interruptions leave one missing).

>>> split = split_stage({"a": 4}, {"a": 10.0}, {"a": 1.0}, {"a": 0.3}, {"a": 0.0},
...                     survive_share=0.5, max_share=1.0)
>>> split.spot_fleet, split.cost_usd_per_hr, split.cost_if_on_demand_usd_per_hr
({'a': 2}, 2.6, 4.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from controlplane.policies.plan import PlanDocument, StagePlan
from controlplane.spec import ResolvedApp, SpotSpec
from estimator.fleet import Fleet
from estimator.traces import Trace

__all__ = [
    "DEFAULT_REPLACEMENT_GAP_S",
    "SPARE_TAIL",
    "SpotSplit",
    "plan_with_spot",
    "spare_count",
    "split_stage",
]

# How long an interrupted instance's capacity is missing: a replacement launched at the
# two-minute notice that boots in about three minutes leaves about a minute; one launched with no
# notice (a notice missed) about three. The planner takes the worse.
DEFAULT_REPLACEMENT_GAP_S = 180.0
# Spares cover the spot instances down at once but with this probability.
SPARE_TAIL = 0.01
_SLACK = 1e-9

PlanFn = Callable[..., PlanDocument]


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
) -> SpotSplit:
    """Split one stage's ``fleet`` into on demand and spot (see the module docstring);
    ``budget_left_usd_per_hr`` bounds the spares (what the rest of the plan leaves)."""
    counts = {t: n for t, n in fleet.items() if n > 0}
    total = sum(counts[t] * capacity_qps[t] for t in counts)
    spot = dict.fromkeys(counts, 0)
    on_demand_capacity = total

    def movable(t: str) -> bool:
        price = spot_usd_per_hr.get(t)
        if price is None or spot[t] >= counts[t]:
            return False
        q = capacity_qps[t]
        spot_capacity = total - on_demand_capacity + q
        return (
            on_demand_capacity - q >= survive_share * total - _SLACK
            and spot_capacity <= max_share * total + _SLACK
        )

    while True:
        candidates = [t for t in counts if movable(t)]
        if not candidates:
            break
        saving = {t: on_demand_usd_per_hr[t] - (spot_usd_per_hr[t] or 0.0) for t in candidates}
        chosen = min(candidates, key=lambda t: (spot[t] / counts[t], -saving[t], t))
        spot[chosen] += 1
        on_demand_capacity -= capacity_qps[chosen]

    def cost_of(kind: Mapping[str, int], spots: Mapping[str, int]) -> float:
        return float(
            sum(
                (kind[t] - spots.get(t, 0)) * on_demand_usd_per_hr[t]
                + spots.get(t, 0) * (spot_usd_per_hr.get(t) or 0.0)
                for t in kind
            )
        )

    cost = cost_of(counts, spot)
    rates = {t: interruptions_per_hr.get(t, 0.0) for t in counts}
    expected_down = sum(spot[t] * rates[t] for t in counts) * replacement_gap_s / 3600.0
    spares = 0
    spot_types = [t for t in counts if spot[t] > 0]
    if spot_types:
        cheapest = min(spot_types, key=lambda t: ((spot_usd_per_hr[t] or 0.0) / capacity_qps[t], t))
        price = spot_usd_per_hr[cheapest] or 0.0
        for _ in range(spare_count(expected_down)):
            grown = total + (spares + 1) * capacity_qps[cheapest]
            spot_capacity = total - on_demand_capacity + (spares + 1) * capacity_qps[cheapest]
            if cost + price > budget_left_usd_per_hr + _SLACK:
                break
            if spot_capacity > max_share * grown + _SLACK:
                break
            spares += 1
            cost += price
        counts[cheapest] += spares
        spot[cheapest] += spares
    spot_fleet = {t: s for t, s in spot.items() if s > 0}
    return SpotSplit(
        fleet=counts,
        spot_fleet=spot_fleet,
        spares=spares,
        cost_usd_per_hr=cost,
        cost_if_on_demand_usd_per_hr=float(
            sum(n * on_demand_usd_per_hr[t] for t, n in counts.items())
        ),
        expected_interruptions_per_hr=float(sum(s * rates[t] for t, s in spot_fleet.items())),
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
    cost = float(sum(s.cost_usd_per_hr for s in final))
    if_on_demand = float(sum(s.cost_if_on_demand_usd_per_hr for s in final))
    spares = sum(s.spares for s in final)
    steps = (
        *plan.steps,
        f"spot: {sum(sum(s.spot_fleet.values()) for s in final)} of"
        f" {sum(sum(s.fleet.values()) for s in final)} instances on spot ({spares} spare),"
        f" at least {spot.survive_share:.0%} of each stage's capacity on demand, at most"
        f" {spot.max_share:.0%} on spot: {cost:.3f} USD/hr at the prices used,"
        f" {if_on_demand:.3f} USD/hr if spot rose to on demand; expected"
        f" {sum(s.expected_interruptions_per_hr for s in final):.3g} interruptions an hour",
    )
    return dataclasses.replace(
        plan,
        stages=stages,
        cost_usd_per_hr=cost,
        expected_cost_usd_per_hr=cost,
        cost_if_on_demand_usd_per_hr=if_on_demand,
        steps=steps,
    )


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
    now (``None`` for a type not offered on spot; default: the catalog's)."""
    spot = app.spec.spot
    if spot is None or not spot.enabled:
        return plan(app, trace, seed=seed, **planner_args)
    prices = (
        dict(spot_prices)
        if spot_prices is not None
        else {t: app.catalog[t].spot_price_usd_per_hr for t in app.prices_usd_per_hr}
    )
    chosen = plan(_blended(app, spot, prices), trace, seed=seed, **planner_args)
    split = _split_plan(app, chosen, spot, prices, replacement_gap_s)
    if split.cost_usd_per_hr > app.spec.budget_usd_per_hr + _SLACK:
        # The blended prices chose a mix whose split costs more than the budget (rounding): the
        # on-demand plan, split the same way, always fits (spot never costs more than on demand).
        fallback = plan(app, trace, seed=seed, **planner_args)
        split = _split_plan(app, fallback, spot, prices, replacement_gap_s)
    return _with_attainment(app, split, trace, seed, replacement_gap_s)


def _with_attainment(
    app: ResolvedApp, plan: PlanDocument, trace: Trace, seed: int, gap_s: float
) -> PlanDocument:
    """The plan with a step that states the share of queries within the SLO it predicts with
    interruptions: A = (1 - q) A_0 + q A_1, A_0 the share on the planning trace with the whole
    fleet, A_1 with the stage's most capable spot instance missing, q the expected share of
    time a spot instance is missing (sum_t s_t lambda_t g, at most 1). One stage only."""
    from controlplane.policies.replay import ReplayError, replay_timeline, static_timeline

    if len(plan.stages) != 1 or not plan.stages[0].spot_fleet or len(trace) < 2:
        return plan
    stage = plan.stages[0]
    capacity = _capacity_qps(app, stage)
    rates = {t: app.catalog[t].interruptions_per_hr for t in stage.spot_fleet}
    q = min(1.0, sum(n * rates[t] for t, n in stage.spot_fleet.items()) * gap_s / 3600.0)
    lost = max(stage.spot_fleet, key=lambda t: (capacity[t], t))
    shorter = {t: n - (t == lost) for t, n in stage.fleet.items()}
    start = Trace(trace.arrival_s - trace.arrival_s[0], trace.batch_size, trace.sample_id)
    shares = []
    for fleet in (stage.fleet, shorter):
        if sum(fleet.values()) == 0:
            shares.append(0.0)
            continue
        timeline = static_timeline(Fleet.of(fleet))
        try:
            result = replay_timeline(start, app, stage, timeline, np.random.default_rng(seed))
        except ReplayError:
            # The stage's dispatch cannot run on what is left (Kairos' base types need a type
            # that meets the SLO at every batch size): first come, first served instead.
            result = replay_timeline(
                start, app, stage, timeline, np.random.default_rng(seed), dispatch="fcfs"
            )
        shares.append(1.0 - result.slo_miss_share)
    whole, short = shares
    predicted = (1.0 - q) * whole + q * short
    step = (
        f"spot: predicted share within the SLO with interruptions {predicted:.4%}"
        f" ({whole:.4%} with the whole fleet, {short:.4%} with one {lost} missing, which the"
        f" interruptions at the catalog's rates leave it {q:.3%} of the time)"
    )
    return dataclasses.replace(plan, steps=(*plan.steps, step))
