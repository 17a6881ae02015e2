"""The budget drain policy: which instances go when the budget falls below the fleet's cost."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.policies.drain import DrainInstance, plan_drain

T0 = datetime(2024, 1, 1, tzinfo=UTC)
QPS = {"gpu": 100.0, "cpu": 10.0, "mid": 30.0}
PRICE = {"gpu": 0.5, "cpu": 0.2, "mid": 0.2}


def instance(name: str, itype: str, state: str = "running", age_s: float = 0.0) -> DrainInstance:
    return DrainInstance(name, itype, state, PRICE[itype], T0 - timedelta(seconds=age_s))


def test_a_fleet_within_the_budget_drains_nothing() -> None:
    fleet = [instance("a", "gpu"), instance("b", "cpu")]
    plan = plan_drain(fleet, 0.7, QPS)
    assert plan.drain == ()
    assert plan.fleet_cost_usd_per_hr == plan.kept_cost_usd_per_hr == 0.7


def test_the_least_cost_effective_go_first_until_the_fleet_fits() -> None:
    # value per USD: gpu 200, mid 150, cpu 50
    fleet = [
        instance("g", "gpu"),
        instance("m", "mid"),
        instance("c1", "cpu"),
        instance("c2", "cpu"),
    ]
    plan = plan_drain(fleet, 0.75, QPS)
    assert [c.id for c in plan.drain] == ["c1", "c2"] or [c.id for c in plan.drain] == ["c2", "c1"]
    assert plan.kept_cost_usd_per_hr <= 0.75
    assert [c.qps_per_usd for c in plan.drain] == [50.0, 50.0]
    assert plan.saved_usd_per_hr == pytest.approx(0.4)


def test_instances_on_their_way_out_count_in_the_cost_but_are_not_drained_again() -> None:
    fleet = [
        instance("g", "gpu"),
        instance("c", "cpu", "draining"),
        instance("d", "cpu", "terminating"),
        instance("x", "cpu", "terminated"),
        instance("f", "cpu", "failed"),
    ]
    plan = plan_drain(fleet, 0.5, QPS)
    assert plan.fleet_cost_usd_per_hr == pytest.approx(0.9)
    assert plan.kept_cost_usd_per_hr == 0.5
    assert plan.drain == ()


def test_ties_drop_what_does_not_serve_yet_then_the_newest() -> None:
    fleet = [
        instance("old", "cpu", "running", age_s=100),
        instance("new", "cpu", "running", age_s=1),
        instance("booting", "cpu", "pending", age_s=50),
        instance("asked", "cpu", "requested", age_s=60),
    ]
    plan = plan_drain(fleet, 0.2, QPS)
    assert [c.id for c in plan.drain] == ["asked", "booting", "new"]


def test_an_unknown_type_serves_nothing_and_goes_first() -> None:
    fleet = [instance("g", "gpu"), DrainInstance("u", "z9.odd", "running", 0.1, T0)]
    plan = plan_drain(fleet, 0.5, QPS)
    assert [c.id for c in plan.drain] == ["u"]
    assert plan.drain[0].qps_per_usd == 0.0


FLEETS = st.lists(
    st.tuples(
        st.sampled_from(sorted(QPS)),
        st.sampled_from(["requested", "pending", "running", "draining", "terminated"]),
    ),
    max_size=12,
)


@given(fleet=FLEETS, budget=st.floats(min_value=0.01, max_value=5.0))
def test_the_kept_fleet_fits_and_no_drain_is_wasted(
    fleet: list[tuple[str, str]], budget: float
) -> None:
    instances = [instance(f"i{k}", t, s, age_s=k) for k, (t, s) in enumerate(fleet)]
    plan = plan_drain(instances, budget, QPS)
    assert plan.kept_cost_usd_per_hr <= budget + 1e-9
    if plan.drain:
        # Without the last one drained, the fleet would not fit: nothing is drained needlessly.
        assert plan.kept_cost_usd_per_hr + plan.drain[-1].price_usd_per_hr > budget
    values = [c.qps_per_usd for c in plan.drain]
    assert values == sorted(values)
    assert all(c.state in ("requested", "pending", "running") for c in plan.drain)
