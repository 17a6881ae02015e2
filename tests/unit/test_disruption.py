"""Budget changes that cannot take an app down by accident: the disruption budget
(:mod:`controlplane.policies.disruption`) and the last serving instance of a stage
(:func:`controlplane.policies.drain.spare_last_serving`), as the reconciler's pure half applies
them; and that neither holds back a drain the (hard) budget forces, nor a teardown."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.loops.reconciler import (
    Action,
    BudgetCapped,
    DrainDeferred,
    Launch,
    Mark,
    Terminate,
)
from controlplane.policies.disruption import DisruptionBudget
from controlplane.policies.drain import DrainInstance, spare_last_serving
from controlplane.policies.lifecycle import InstanceState
from tests.unit.test_reconciler import PRICES, row, run

ONE_A_MINUTE = DisruptionBudget(max_instances=1, max_share=0.25, window_s=60.0)
T0 = datetime(2024, 1, 1, tzinfo=UTC)


def terminated(actions: list[Action], cause: str | None = None) -> set[str]:
    """The instances ``actions`` take out of service (with ``cause``): terminated, or a serving
    one a scale-down drains first (rule 9 terminates it once drained)."""
    drained = {
        a.instance_id
        for a in actions
        if isinstance(a, Mark)
        and a.to_state is InstanceState.DRAINING
        and a.reason.startswith("scale_down:")
        and cause in (None, "scale_down")
    }
    return drained | {
        i
        for a in actions
        if isinstance(a, Terminate) and (cause is None or a.cause == cause)
        for i in a.instance_ids
    }


def deferred(actions: list[Action], cause: str) -> set[str]:
    return {
        i
        for a in actions
        if isinstance(a, DrainDeferred) and a.cause == cause
        for i in a.instance_ids
    }


# --- the budget itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("serving", "allowance"), [(0, 1), (1, 1), (4, 1), (7, 1), (8, 2), (12, 3), (40, 10)]
)
def test_the_allowance_is_the_larger_of_the_count_and_the_share(
    serving: int, allowance: int
) -> None:
    assert ONE_A_MINUTE.allowance(serving) == allowance


def test_what_the_window_used_counts_against_the_fleet_it_started_with() -> None:
    # 8 served at the start of the window, 2 have gone: the allowance of 2 is spent.
    assert ONE_A_MINUTE.remaining(serving_now=6, disrupted_in_window=2) == 0
    assert ONE_A_MINUTE.remaining(serving_now=7, disrupted_in_window=1) == 1
    assert ONE_A_MINUTE.remaining(serving_now=6, disrupted_in_window=1) == 0
    assert ONE_A_MINUTE.remaining(serving_now=12, disrupted_in_window=0) == 3


@given(
    st.integers(0, 5),
    st.floats(0, 1),
    st.integers(0, 200),
    st.integers(0, 50),
)
def test_remaining_never_exceeds_the_allowance_nor_goes_negative(
    count: int, share: float, serving: int, used: int
) -> None:
    budget = DisruptionBudget(max_instances=count, max_share=share)
    left = budget.remaining(serving, used)
    assert 0 <= left <= budget.allowance(serving + used)
    assert left + used <= max(budget.allowance(serving + used), used)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_instances": -1}, {"max_share": 1.5}, {"window_s": 0.0}, {"window_s": float("inf")}],
)
def test_a_budget_out_of_range_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        DisruptionBudget(**kwargs)  # type: ignore[arg-type]


# --- the disruption budget in the reconciler ---------------------------------------------------


def test_a_shrink_drains_one_serving_instance_a_minute() -> None:
    rows = [row("small", age_s=60 + i) for i in range(4)]
    actions = run({"small": 1}, rows, disruption=ONE_A_MINUTE)
    assert len(terminated(actions, "scale_down")) == 1
    held = deferred(actions, "disruption")
    assert len(held) == 2
    (decision,) = [a for a in actions if isinstance(a, DrainDeferred)]
    assert decision.allowed == 1 and decision.window_s == 60.0
    # A minute on, the window has one disruption in it: nothing more goes yet.
    gone = terminated(actions)
    left = [r for r in rows if r.id not in gone]
    later = run({"small": 1}, left, disruption=ONE_A_MINUTE, disrupted_in_window=1)
    assert terminated(later) == set() and len(deferred(later, "disruption")) == 2
    # Without the budget, the shrink is immediate (the reconciler's old behaviour).
    assert len(terminated(run({"small": 1}, rows))) == 3


def test_the_least_cost_effective_serving_instance_goes_first() -> None:
    small, large = row("small"), row("large")
    actions = run({}, [small, large], disruption=ONE_A_MINUTE)
    assert terminated(actions) == {small.id}
    assert deferred(actions, "disruption") == {large.id}


def test_instances_that_do_not_serve_yet_are_not_held_back() -> None:
    rows = [row("small", "pending"), row("small", "requested"), row("small"), row("small")]
    actions = run({"small": 1}, rows, disruption=DisruptionBudget(max_instances=0, max_share=0))
    # The requested one fails, the pending one is terminated; the serving excess waits.
    assert {a.instance_id for a in actions if isinstance(a, Mark)} == {rows[1].id}
    assert terminated(actions) == {rows[0].id}
    assert len(deferred(actions, "disruption")) == 1


def test_a_budget_drain_is_never_deferred() -> None:
    rows = [row("small") for _ in range(4)] + [row("large") for _ in range(2)]
    actions = run(
        {"small": 4, "large": 2},
        rows,
        budget=0.2,
        disruption=DisruptionBudget(max_instances=0, max_share=0),
        disrupted_in_window=10,
    )
    assert terminated(actions, "budget") == {r.id for r in rows if r.instance_type == "small"}
    assert not any(isinstance(a, DrainDeferred) for a in actions)


def test_deferred_drains_never_keep_the_fleet_over_the_budget() -> None:
    # The plan shrinks (deferred) and, in the same tick, the budget falls below what is kept.
    rows = [row("large") for _ in range(4)]
    actions = run({"large": 1}, rows, budget=0.15, disruption=ONE_A_MINUTE)
    kept = [r for r in rows if r.id not in terminated(actions)]
    assert sum(r.price_usd_per_hr for r in kept) <= 0.15 + 1e-9
    assert not any(isinstance(a, Launch) for a in actions)
    # What the budget drained is not said to wait as well (a tester read a deferral of two
    # instances beside the budget's terminate of the same two): only what is kept waits.
    assert terminated(actions, "budget")
    assert deferred(actions, "disruption") <= {r.id for r in kept}


# --- the last serving instance of a stage ----------------------------------------------------


def drain_instance(
    instance_id: str, instance_type: str, state: str = "running", age_s: float = 0.0
) -> DrainInstance:
    created = T0 - timedelta(seconds=age_s)
    return DrainInstance(instance_id, instance_type, state, PRICES[instance_type], created)


def test_spare_keeps_the_cheapest_then_oldest_running_instance_of_a_stage_left_empty() -> None:
    leaving = [
        drain_instance("a", "large", age_s=10),
        drain_instance("b", "small", age_s=5),
        drain_instance("c", "small", age_s=50),
        drain_instance("d", "small", "pending"),
    ]
    assert spare_last_serving([], leaving, {"m": ["small", "large"]}) == ("c",)
    # A stage that still has a running instance, or that never had one, spares nothing.
    assert spare_last_serving([drain_instance("e", "large")], leaving, {"m": ["large"]}) == ()
    assert spare_last_serving([], [drain_instance("f", "small", "pending")], {"m": ["small"]}) == ()
    # One spared instance of a type two stages plan serves both; a stage of its own gets one.
    two = spare_last_serving([], leaving, {"m1": ["small"], "m2": ["small"], "m3": ["large"]})
    assert two == ("c", "a")


def test_a_mix_change_keeps_the_old_instance_until_the_new_one_serves() -> None:
    stages = {"tiny": ["small", "large"]}
    small, large = row("small"), row("large", "pending")
    actions = run({"large": 1}, [small, large], stage_types=stages, disruption=ONE_A_MINUTE)
    assert terminated(actions) == set()
    assert deferred(actions, "last_instance") == {small.id}
    # Once the large serves, the small goes (one disruption, within the budget).
    serving = row("large")
    actions = run({"large": 1}, [small, serving], stage_types=stages, disruption=ONE_A_MINUTE)
    assert terminated(actions, "scale_down") == {small.id}
    assert not any(isinstance(a, DrainDeferred) for a in actions)


def test_the_last_instance_gives_way_when_the_budget_needs_its_cost() -> None:
    # Make-before-break needs 0.15 USD/hr; the budget is 0.1: break, then make.
    small = row("small")
    actions = run({"large": 1}, [small], budget=0.1, stage_types={"tiny": ["small", "large"]})
    assert terminated(actions, "scale_down") == {small.id}
    assert [a.instance_type for a in actions if isinstance(a, Launch)] == ["large"]
    assert not any(isinstance(a, BudgetCapped | DrainDeferred) for a in actions)


def test_the_last_instance_stays_when_its_replacement_does_not_fit_anyway() -> None:
    # The gpu does not fit 0.1 USD/hr even without the small: the small keeps serving.
    small = row("small")
    actions = run({"gpu": 1}, [small], budget=0.1, stage_types={"tiny": ["small", "gpu"]})
    assert terminated(actions) == set()
    assert deferred(actions, "last_instance") == {small.id}
    (capped,) = [a for a in actions if isinstance(a, BudgetCapped)]
    assert dict(capped.wanted) == {"gpu": 1}


def test_a_budget_drain_keeps_a_stage_when_the_budget_pays_for_it() -> None:
    stages = {"a": ["small"], "b": ["large"]}
    rows = [row("small"), row("small"), row("large"), row("large")]
    smalls = {r.id for r in rows if r.instance_type == "small"}
    # 0.2 USD/hr: the least cost-effective (both smalls) would empty stage a; one small stays.
    actions = run({"small": 2, "large": 2}, rows, budget=0.2, stage_types=stages)
    gone = terminated(actions, "budget")
    assert len(gone & smalls) == 1 and len(gone - smalls) == 1
    kept = [r for r in rows if r.id not in gone]
    assert {r.instance_type for r in kept} == {"small", "large"}
    assert sum(r.price_usd_per_hr for r in kept) <= 0.2 + 1e-9
    # Below the smallest serving fleet (0.15: a forced change), the budget wins.
    actions = run({"small": 2, "large": 2}, rows, budget=0.1, stage_types=stages)
    kept = [r for r in rows if r.id not in terminated(actions, "budget")]
    assert sum(r.price_usd_per_hr for r in kept) <= 0.1 + 1e-9


# --- teardown --------------------------------------------------------------------------------


def test_a_teardown_ends_everything_at_once_and_launches_nothing() -> None:
    rows = [row("small"), row("large"), row("small", "pending"), row("large", "requested")]
    actions = run(
        {"small": 5, "large": 5},
        rows,
        stage_types={"tiny": ["small", "large"]},
        disruption=DisruptionBudget(max_instances=0, max_share=0),
        teardown=True,
    )
    assert terminated(actions, "teardown") == {r.id for r in rows[:3]}
    assert [a.instance_id for a in actions if isinstance(a, Mark)] == [rows[3].id]
    assert not any(isinstance(a, Launch | DrainDeferred | BudgetCapped) for a in actions)


def test_a_teardown_goes_on_when_the_provider_cannot_be_listed() -> None:
    from controlplane.loops.reconciler import reconcile

    rows = [row("small"), row("large")]
    actions = reconcile({"small": 1}, rows, None, PRICES, 10.0, T0, teardown=True)
    assert terminated(actions, "teardown") == {r.id for r in rows}


# --- settings --------------------------------------------------------------------------------


def test_the_settings_give_the_disruption_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.errors import SettingsError
    from controlplane.loops.reconciler import disruption_budget
    from controlplane.settings import load_settings

    for name in (
        "CONFIG",
        "DISRUPTION_MAX_INSTANCES",
        "DISRUPTION_MAX_SHARE",
        "DISRUPTION_WINDOW_S",
    ):
        monkeypatch.delenv(f"HETEROPLANE_{name}", raising=False)
    assert disruption_budget(load_settings()) == DisruptionBudget(1, 0.25, 60.0)
    monkeypatch.setenv("HETEROPLANE_DISRUPTION_MAX_INSTANCES", "3")
    monkeypatch.setenv("HETEROPLANE_DISRUPTION_MAX_SHARE", "0.5")
    monkeypatch.setenv("HETEROPLANE_DISRUPTION_WINDOW_S", "120")
    assert disruption_budget(load_settings()) == DisruptionBudget(3, 0.5, 120.0)
    monkeypatch.setenv("HETEROPLANE_DISRUPTION_MAX_SHARE", "1.5")
    with pytest.raises(SettingsError, match="HETEROPLANE_DISRUPTION_MAX_SHARE"):
        load_settings()
