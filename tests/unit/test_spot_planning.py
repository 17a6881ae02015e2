"""Spot capacity in plans (controlplane.policies.spot): the split of a stage's fleet into on
demand and spot (the survive share, the cap on the spot share, the spread across types, the
spares), and whole plans: under the budget at the price paid, cheaper than the on-demand plan,
stating their cost if spot rose to on demand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import plan_with_spot, spare_count, split_stage
from controlplane.spec import load_spec, resolve_spec
from tests.unit.test_planner import poisson_trace, write_spec

TYPES = ("a", "b", "c")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    counts=st.tuples(*(st.integers(0, 6) for _ in TYPES)),
    capacity=st.tuples(*(st.floats(1.0, 50.0) for _ in TYPES)),
    discount=st.tuples(*(st.sampled_from([None, 0.2, 0.5, 0.9]) for _ in TYPES)),
    survive=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    cap=st.sampled_from([0.0, 0.4, 0.8, 1.0]),
    rate=st.sampled_from([0.0, 1e-4, 2.0]),
    budget_left=st.sampled_from([0.0, 1.0, math.inf]),
)
def test_the_split_keeps_the_survive_share_on_demand_and_spot_under_its_cap(
    counts: tuple[int, ...],
    capacity: tuple[float, ...],
    discount: tuple[float | None, ...],
    survive: float,
    cap: float,
    rate: float,
    budget_left: float,
) -> None:
    fleet = dict(zip(TYPES, counts, strict=True))
    q = dict(zip(TYPES, capacity, strict=True))
    on_demand = {"a": 1.0, "b": 0.5, "c": 0.2}
    spot = {
        t: None if d is None else on_demand[t] * d for t, d in zip(TYPES, discount, strict=True)
    }
    split = split_stage(
        fleet,
        q,
        on_demand,
        spot,
        dict.fromkeys(TYPES, rate),
        survive_share=survive,
        max_share=cap,
        budget_left_usd_per_hr=budget_left,
    )
    planned = sum(fleet[t] * q[t] for t in TYPES)
    total = sum(split.fleet[t] * q[t] for t in split.fleet)
    on_demand_capacity = sum(
        (split.fleet[t] - split.spot_fleet.get(t, 0)) * q[t] for t in split.fleet
    )
    assert on_demand_capacity >= survive * planned - 1e-6
    assert total - on_demand_capacity <= cap * total + 1e-6
    assert all(spot[t] is not None for t in split.spot_fleet)
    assert all(split.spot_fleet[t] <= split.fleet[t] for t in split.spot_fleet)
    base_cost = sum(fleet[t] * on_demand[t] for t in TYPES)
    # Spot never costs more; the spares only what the budget left pays for.
    assert split.cost_usd_per_hr <= base_cost + min(budget_left, 1e9) + 1e-9
    if split.spares == 0:
        assert split.cost_usd_per_hr <= base_cost + 1e-9
    assert split.cost_if_on_demand_usd_per_hr >= split.cost_usd_per_hr - 1e-9


def test_spot_is_spread_across_types_before_a_type_is_filled() -> None:
    split = split_stage(
        {"a": 4, "b": 4},
        {"a": 1.0, "b": 1.0},
        {"a": 1.0, "b": 1.0},
        {"a": 0.1, "b": 0.5},
        {"a": 0.0, "b": 0.0},
        survive_share=0.5,
        max_share=1.0,
    )
    # Four may go to spot; the deeper discount (a) alone would take all four.
    assert split.spot_fleet == {"a": 2, "b": 2}


def test_spares_cover_the_interruption_gaps_where_interruptions_are_frequent() -> None:
    calm = split_stage(
        {"a": 4},
        {"a": 1.0},
        {"a": 1.0},
        {"a": 0.3},
        {"a": 1e-4},
        survive_share=0.5,
        max_share=1.0,
    )
    stormy = split_stage(
        {"a": 4},
        {"a": 1.0},
        {"a": 1.0},
        {"a": 0.3},
        {"a": 2.0},
        survive_share=0.5,
        max_share=1.0,
    )
    assert calm.spares == 0 and calm.fleet == {"a": 4}
    assert stormy.spares == spare_count(2 * 2.0 * 180 / 3600) >= 1
    assert stormy.fleet == {"a": 4 + stormy.spares}
    assert stormy.spot_fleet == {"a": 2 + stormy.spares}


@pytest.mark.parametrize(
    ("survive", "cap", "budget"), [(0.5, 1.0, 1.5), (0.3, 0.6, 0.8), (0.0, 1.0, 4.0)]
)
def test_spot_plans_fit_the_budget_at_the_price_paid_and_cost_less(
    tmp_path: Path, survive: float, cap: float, budget: float
) -> None:
    spot_spec = load_spec(
        write_spec(
            tmp_path,
            40.0,
            budget,
            spot=f"{{enabled: true, survive_share: {survive}, max_share: {cap}}}",
        )
    )
    app = resolve_spec(spot_spec)
    on_demand_app = resolve_spec(spot_spec.model_copy(update={"spot": None}))
    trace = poisson_trace(200.0, queries=800)

    plan = plan_with_spot(app, trace, plan=plan_app)
    on_demand = plan_with_spot(on_demand_app, trace, plan=plan_app)

    assert plan.feasible and on_demand.feasible
    assert plan.cost_usd_per_hr <= budget + 1e-9
    assert plan.cost_usd_per_hr < on_demand.cost_usd_per_hr
    assert plan.expected_cost_usd_per_hr == plan.cost_usd_per_hr
    assert plan.cost_if_on_demand_usd_per_hr is not None
    assert plan.cost_if_on_demand_usd_per_hr >= plan.cost_usd_per_hr
    catalog = app.catalog
    for stage in plan.stages:
        assert stage.spot_fleet, stage
        paid = sum(
            (n - stage.spot_fleet.get(t, 0)) * catalog.price_usd_per_hr(t)
            + stage.spot_fleet.get(t, 0) * (catalog.spot_price_usd_per_hr(t) or 0.0)
            for t, n in stage.fleet.items()
        )
        assert stage.cost_usd_per_hr == pytest.approx(paid)
    assert any(step.startswith("spot: ") for step in plan.steps)
    (predicted,) = [s for s in plan.steps if "predicted share within the SLO" in s]
    assert "with one " in predicted and "missing" in predicted
    # The document carries it all and reads back equal.
    document = plan.to_document()
    assert document["stages"][0]["spot_fleet"] == dict(plan.stages[0].spot_fleet)
    again = PlanDocument.parse(document)
    assert again == plan
    assert again.cost_if_on_demand_usd_per_hr == plan.cost_if_on_demand_usd_per_hr
    assert again.expected_cost_usd_per_hr == plan.expected_cost_usd_per_hr
    # Without spot the plan is the planner's own, all on demand.
    assert on_demand == plan_app(on_demand_app, trace)
    assert on_demand.to_document()["cost_if_on_demand_usd_per_hr"] == on_demand.cost_usd_per_hr
