"""The budget drain policy: which instances go when the budget falls below the fleet's cost."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.apps.budget import budget_drain
from controlplane.db.store import InstanceRecord
from controlplane.loops.reconciler import Terminate, reconcile
from controlplane.policies.drain import DrainInstance, plan_drain, serving_floor

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
    """A draining instance still serves and is billed; a terminating one is not billed (EC2
    stops at shutting-down) and counts in no cost, as the fleet route says."""
    fleet = [
        instance("g", "gpu"),
        instance("c", "cpu", "draining"),
        instance("d", "cpu", "terminating"),
        instance("x", "cpu", "terminated"),
        instance("f", "cpu", "failed"),
    ]
    plan = plan_drain(fleet, 0.5, QPS)
    assert plan.fleet_cost_usd_per_hr == pytest.approx(0.9 - 0.2)
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


# --- the smallest serving fleet and the last instance of each stage ----------------------------


def test_the_serving_floor_is_the_cheapest_planned_type_per_stage_summed() -> None:
    stages = {"small": {"gpu": 1, "cpu": 2}, "large": {"gpu": 3, "mid": 0}}
    floor = serving_floor(stages, PRICE)
    # small: min(0.5, 0.2); large: gpu only (mid is not planned: count 0).
    assert floor.cost_usd_per_hr == pytest.approx(0.2 + 0.5)
    assert floor.cheapest == (("small", "cpu"), ("large", "gpu"))
    assert floor.describe() == "one cpu for small, one gpu for large"


def test_the_serving_floor_of_no_plan_or_unpriced_types_is_zero() -> None:
    assert serving_floor({}, PRICE).cost_usd_per_hr == 0.0
    assert serving_floor({"m": {"z9.odd": 1}}, PRICE).cost_usd_per_hr == 0.0
    assert serving_floor({}, PRICE).describe() == "no instance"
    same = serving_floor({"a": {"cpu": 1}, "b": {"cpu": 4, "gpu": 1}}, PRICE)
    assert same.cost_usd_per_hr == pytest.approx(0.4)
    assert same.describe() == "one cpu per stage"


def test_the_last_instance_of_each_stage_stays() -> None:
    # Least cost-effective first would drain both cpus (stage b's only type) before the gpu.
    fleet = [instance("g", "gpu"), instance("c1", "cpu"), instance("c2", "cpu", age_s=10)]
    stages = {"a": ["gpu", "mid"], "b": ["cpu"]}
    unguarded = plan_drain(fleet, 0.5, QPS)
    assert {c.id for c in unguarded.drain} == {"c1", "c2"}
    plan = plan_drain(fleet, 0.5, QPS, stage_types=stages)
    # The older cpu is kept for stage b, the gpu for stage a (over the budget: a floor of 0.7).
    assert [c.id for c in plan.drain] == ["c1"]
    assert plan.kept_cost_usd_per_hr == pytest.approx(0.7)


def test_the_keepers_stay_even_over_the_budget_and_prefer_serving_ones() -> None:
    fleet = [instance("new", "cpu", state="pending"), instance("old", "cpu", age_s=5.0)]
    plan = plan_drain(fleet, 0.05, QPS, stage_types={"m": ["cpu"]})
    assert [c.id for c in plan.drain] == ["new"]
    assert plan.kept_cost_usd_per_hr == pytest.approx(0.2)


def test_one_instance_of_a_type_two_stages_plan_keeps_both() -> None:
    fleet = [instance("g1", "gpu"), instance("g2", "gpu", age_s=1.0), instance("c", "cpu")]
    plan = plan_drain(fleet, 0.5, QPS, stage_types={"a": ["gpu"], "b": ["gpu", "cpu"]})
    assert {c.id for c in plan.drain} == {"g1", "c"}


@given(
    st.lists(st.sampled_from(["gpu", "cpu", "mid"]), min_size=1, max_size=8),
    st.floats(min_value=0.0, max_value=3.0),
)
def test_at_or_above_the_floor_every_stage_keeps_an_instance(
    types: list[str], extra_usd_per_hr: float
) -> None:
    stages = {"a": {"gpu": 1, "mid": 1}, "b": {"cpu": 2}}
    fleet = [instance(f"i{n}", t, age_s=float(n)) for n, t in enumerate(types)]
    floor = serving_floor(stages, PRICE).cost_usd_per_hr
    plan = plan_drain(
        fleet, floor + extra_usd_per_hr, QPS, stage_types={s: list(f) for s, f in stages.items()}
    )
    drained = {c.id for c in plan.drain}
    kept = [i for i in fleet if i.id not in drained]
    for planned in stages.values():
        if any(i.instance_type in planned for i in fleet):
            assert any(i.instance_type in planned for i in kept)


class _DecisionStore:
    """Just what ``budget_drain`` reads of a store."""

    def __init__(self, rows: list[InstanceRecord]) -> None:
        self.rows = rows

    def list_instances(self, app: str, states: list[str]) -> list[InstanceRecord]:
        return [r for r in self.rows if r.state in states]


def _row(name: str, itype: str, state: str, price: float) -> InstanceRecord:
    return InstanceRecord(name, "app", f"app-{name}", f"i-{name}", itype, state, price, T0, T0)


@pytest.mark.parametrize(
    ("rows", "budget"),
    [
        # A dear gpu serving beside a cheap cpu still booting: the stage's serving keeper (the
        # gpu) alone is over a budget at or above the floor (one cpu), so the guard drains the
        # gpu, not the cpu, and keeps within the budget.
        ([("g", "gpu", "running", 1.0), ("c", "cpu", "pending", 0.05)], 0.1),
        # A budget forced below the floor, then raised but still below it before the guard ran:
        # the guard drains the last instance (the budget is a hard limit).
        ([("c", "cpu", "running", 0.05)], 0.03),
    ],
)
def test_the_budget_drain_decision_names_what_the_guard_drains(
    rows: list[tuple[str, str, str, float]], budget: float
) -> None:
    """Not forced, ``budget_drain`` kept each stage's last instance even where the
    budget could not pay for it (``keep_last``): the decision named other instances than the
    reconciler's guard, which holds the budget, drained (and a kept cost over the budget)."""
    records = [_row(*r) for r in rows]
    store = _DecisionStore(records)
    stages = {"m": {"cpu": 1, "gpu": 1}}
    values = {"cpu": 25.0, "gpu": 100.0}  # per USD/hr: cpu 500, gpu 100
    drain, _, _, said = budget_drain(
        store,  # type: ignore[arg-type]
        "app",
        budget,
        "test",
        stages,
        values,
    )
    actions = reconcile(
        {"cpu": 1, "gpu": 1},
        records,
        None,
        {"cpu": 0.05, "gpu": 1.0},
        budget,
        T0,
        600.0,
        qps_by_type=values,
        stage_types={"m": ["cpu", "gpu"]},
    )
    guarded = [a for a in actions if isinstance(a, Terminate) and a.cause == "budget"]
    went = sorted(i for a in guarded for i in a.instance_ids)
    assert sorted(c.id for c in drain.drain) == went
    assert drain.kept_cost_usd_per_hr <= budget + 1e-9
    assert [d[2]["drain"] for d in said] == [[c.id for c in drain.drain]]
