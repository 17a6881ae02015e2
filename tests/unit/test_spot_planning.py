"""Spot capacity in plans (controlplane.policies.spot): the split of a stage's fleet into on
demand and spot (the survive share, the cap on the spot share, the spread across types, the
spares), and whole plans: under the budget at the price paid, cheaper than the on-demand plan,
stating their cost if spot rose to on demand."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.policies.plan import PlanDocument, PlanError
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import (
    plan_spothedge,
    plan_with_spot,
    spare_count,
    split_stage,
)
from controlplane.policies.spot_replay import replay_with_interruptions
from controlplane.provisioning import provider_spot_prices
from controlplane.spec import ResolvedApp, SpotSpec, load_spec, resolve_spec
from provisioners.errors import ProvisionerError
from tests.unit.test_planner import poisson_trace, write_cascade_app, write_spec

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
    # Spot with its spares never costs more than the planned fleet on demand (the cap).
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


def test_spot_whose_spares_cost_more_than_on_demand_stays_on_demand() -> None:
    # One instance interrupted 8 times an hour needs two spares (E = 0.4): three on spot at 0.4
    # cost 1.2, more than the one on demand at 1.0.
    args = ({"a": 1}, {"a": 1.0}, {"a": 1.0}, {"a": 0.4}, {"a": 8.0})
    capped = split_stage(*args, survive_share=0.0, max_share=1.0)
    assert capped.spot_fleet == {} and capped.fleet == {"a": 1}
    assert capped.kept_on_demand == 1 and capped.cost_usd_per_hr == 1.0
    # A spot price at on demand (or past it) buys nothing on spot.
    risen = split_stage(*args[:3], {"a": 1.0}, args[4], survive_share=0.0, max_share=1.0)
    assert risen.spot_fleet == {} and risen.kept_on_demand == 0
    # SpotHedge's way: spot and its spares whatever they cost.
    hedged = split_stage(*args, survive_share=0.0, max_share=1.0, cap_at_on_demand=False)
    assert hedged.spot_fleet == {"a": 3} and hedged.cost_usd_per_hr == pytest.approx(1.2)


def _with_rate(app: ResolvedApp, rate_per_hr: float) -> ResolvedApp:
    catalog = app.catalog.with_overrides(
        dataclasses.replace(app.catalog[t], interruptions_per_hr=rate_per_hr)
        for t in app.instance_types
    )
    return dataclasses.replace(app, catalog=catalog)


def _spot_app(
    tmp_path: Path, survive: float, rate_per_hr: float
) -> tuple[ResolvedApp, ResolvedApp]:
    spec = load_spec(
        write_spec(tmp_path, 40.0, 4.0, spot=f"{{enabled: true, survive_share: {survive}}}")
    )
    on_demand = resolve_spec(spec.model_copy(update={"spot": None}))
    return _with_rate(resolve_spec(spec), rate_per_hr), on_demand


@pytest.mark.parametrize("rate_per_hr", [0.5, 8.0, 40.0])
def test_a_spot_plan_never_costs_more_than_the_on_demand_plan(
    tmp_path: Path, rate_per_hr: float
) -> None:
    app, on_demand_app = _spot_app(tmp_path, 0.5, rate_per_hr)
    trace = poisson_trace(200.0, queries=800)
    plan = plan_with_spot(app, trace, plan=plan_app)
    on_demand = plan_app(on_demand_app, trace)
    assert plan.feasible
    assert plan.cost_usd_per_hr <= on_demand.cost_usd_per_hr + 1e-9
    assert any(step.startswith("spot: kept ") for step in plan.steps)
    assert plan.spot_prices_source == "catalog"
    if rate_per_hr == 40.0:  # every spare dearer than on demand: nothing on spot
        assert all(not s.spot_fleet for s in plan.stages)
        assert plan.cost_usd_per_hr == pytest.approx(on_demand.cost_usd_per_hr)


def test_the_spothedge_style_plan_is_one_type_all_on_spot_with_spares(tmp_path: Path) -> None:
    app, _ = _spot_app(tmp_path, 0.5, 2.0)
    trace = poisson_trace(200.0, queries=800)
    hedge = plan_spothedge(app, trace, plan=plan_app)
    (stage,) = hedge.stages
    assert len(stage.fleet) == 1
    assert dict(stage.spot_fleet) == dict(stage.fleet)
    (t,) = stage.fleet
    alone = dataclasses.replace(
        app,
        spec=app.spec.model_copy(update={"instance_types": [t]}),
        prices_usd_per_hr={t: app.prices_usd_per_hr[t]},
    )
    planned = plan_app(alone, trace).fleet[t]
    assert stage.fleet[t] > planned  # the spares over the homogeneous plan
    assert hedge.predicted_slo_attainment is not None
    assert any(step.startswith("spothedge: one type") for step in hedge.steps)


def test_a_plan_records_the_provider_spot_prices_it_was_made_at(tmp_path: Path) -> None:
    app, _ = _spot_app(tmp_path, 0.2, 0.01)
    trace = poisson_trace(200.0, queries=800)
    catalog = plan_with_spot(app, trace, plan=plan_app)
    # The provider says g4dn.xlarge is sold on spot at a tenth of on demand, r5n.large not at all.
    now = {"g4dn.xlarge": 0.05, "r5n.large": None}
    live = plan_with_spot(app, trace, plan=plan_app, spot_prices=now)
    assert catalog.spot_prices_source == "catalog"
    assert live.spot_prices_source == "provider and catalog"
    assert live.spot_prices_usd_per_hr is not None
    assert live.spot_prices_usd_per_hr["g4dn.xlarge"] == 0.05
    assert "r5n.large" not in live.spot_prices_usd_per_hr
    assert all("r5n.large" not in s.spot_fleet for s in live.stages)
    document = live.to_document()
    assert document["spot_prices_source"] == "provider and catalog"
    again = PlanDocument.parse(document)
    assert again.spot_prices_usd_per_hr == live.spot_prices_usd_per_hr
    assert again.predicted_slo_attainment == live.predicted_slo_attainment


class _Prices:
    """A provider that reads spot prices (the EC2 provisioner's seam)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def spot_price(self, instance_type: str) -> float | None:
        if self.fail:
            raise ProvisionerError("throttled")
        return 0.1 if instance_type == "a" else None


def test_the_planner_reads_spot_prices_from_providers_that_have_them() -> None:
    prices = provider_spot_prices(_Prices())  # type: ignore[arg-type]
    assert prices is not None and prices(["a", "b"]) == {"a": 0.1}  # b: none read, the catalog's
    failing = provider_spot_prices(_Prices(fail=True))  # type: ignore[arg-type]
    assert failing is not None and failing(["a"]) == {}  # the catalog's serve
    assert provider_spot_prices(None) is None
    assert provider_spot_prices(object()) is None  # type: ignore[arg-type]


def test_a_cascade_is_planned_with_spot_and_replayed_with_interruptions(tmp_path: Path) -> None:
    base = write_cascade_app(tmp_path, records=True)
    spot = SpotSpec(enabled=True, survive_share=0.0)
    app = _with_rate(
        resolve_spec(base.spec.model_copy(update={"spot": spot}), base_dir=tmp_path), 2.0
    )
    trace = poisson_trace(600.0, queries=3000)
    plan = plan_with_spot(app, trace, plan=plan_app, seed=2)
    assert len(plan.stages) == 2 and any(s.spot_fleet for s in plan.stages)
    assert plan.predicted_slo_attainment is not None
    assert 0.0 <= plan.predicted_slo_attainment <= 1.0
    (step,) = [s for s in plan.steps if "predicted share within the SLO" in s]
    assert " of cheap missing" in step or " of large missing" in step
    result, log = replay_with_interruptions(
        trace, app, plan, np.random.default_rng(0), dict.fromkeys(app.instance_types, 2.0)
    )
    spot_instances = sum(sum(s.spot_fleet.values()) for s in plan.stages)
    assert log.spot_instances == spot_instances
    assert any(s.instance_type.endswith("@spot") for s in result.fleet_timeline.instances)
    assert result.simulation.response_ms.size == len(trace)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("predicted_slo_attainment", 1.5, "must be a share"),
        ("spot_prices_usd_per_hr", [0.1], "must be an object"),
        ("spot_prices_usd_per_hr", {"a": -1}, "must be >= 0"),
        ("spot_prices_source", 3, "must be a text"),
    ],
)
def test_a_plan_documents_spot_fields_are_checked(key: str, value: object, message: str) -> None:
    document = {"feasible": True, "cost_usd_per_hr": 1.0, "stages": [], key: value}
    with pytest.raises(PlanError, match=message):
        PlanDocument.parse(document)
