"""INFaaS's autoscaling policy (controlplane.policies.infaas_scaling), hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controlplane.policies.infaas_scaling import (
    HeldBack,
    OverloadNote,
    ScalingConfig,
    ScalingContext,
    ServedInstance,
    StandIn,
    VariantProfile,
    decide,
    initial_state,
    instances_for,
    scaling_cost_usd_per_s,
)

VARIANTS = [VariantProfile("m", "cpu", 10.0, 30.0), VariantProfile("m", "gpu", 100.0, 60.0)]
PRICES = {"cpu": 0.1, "gpu": 0.5}


def context(
    now_s: float, load_qps: float, instances: list[ServedInstance], budget: float = 2.0
) -> ScalingContext:
    return ScalingContext("a", now_s, {"m": load_qps}, instances, VARIANTS, PRICES, budget)


def cpu(name: str, state: str = "active", busy: float | None = 0.1) -> ServedInstance:
    return ServedInstance(name, "cpu", {"m": state}, busy)  # type: ignore[dict-item]


def test_the_cheaper_option_by_the_ilps_cost_is_an_upgrade_to_an_inactive_variant() -> None:
    # 80 qps at U 0.8 wants 100 qps; 10 are there: 9 cpu (0.1 x 9 x 1.25 = 1.125 USD/hr) or one
    # gpu (0.5 x (1 + 60/120) = 0.75 USD/hr), which is inactive and loads for 60 s.
    decisions, state = decide(context(10.0, 80.0, [cpu("i-1")]), initial_state({"cpu": 1}, 0.0))
    (up,) = decisions
    assert (up.action, up.instance_type, up.count) == ("infaas_upgrade", "gpu", 1)
    assert up.numbers["loading_s"] == 60.0
    assert "inactive" in up.reason
    assert dict(state.fleet) == {"cpu": 1, "gpu": 1}
    # While it loads, its capacity counts: nothing more is asked.
    again, _ = decide(context(11.0, 80.0, [cpu("i-1", "overloaded")]), state)
    assert again == []


def test_an_overloaded_variant_is_replicated_with_what_its_state_was_judged_on() -> None:
    # 7 qps on one cpu (Q 10) is within U: only the state says it cannot keep up (admission
    # refused queries of it). One more instance of what serves it, the reason says why.
    note = OverloadNote(
        ("4 queries refused (429) in the last 10 s",), {"refused": 4.0, "capacity_sps": 10.0}
    )
    ctx = replace(context(10.0, 7.0, [cpu("i-1", "overloaded", busy=0.9)]), overload={"m": note})
    decisions, state = decide(ctx, initial_state({"cpu": 1}, 0.0))
    (up,) = decisions
    assert (up.action, up.instance_type, up.count) == ("infaas_replicate", "cpu", 1)
    assert up.reason.startswith(
        "infaas_replicate: m is overloaded on i-1: 4 queries refused (429) in the last 10 s;"
        " replicate the loaded variant m on cpu: +1 x cpu"
    ), up.reason
    assert up.numbers["overloaded"] is True
    assert up.numbers["overloaded_instances"] == ["i-1"]
    assert up.numbers["overload"] == {"refused": 4.0, "capacity_sps": 10.0}
    assert dict(state.fleet) == {"cpu": 2}
    # Overloaded and short of capacity at once: the reason names both.
    both = context(10.0, 12.0, [cpu("i-1", "overloaded", busy=0.9)])
    (up,) = decide(both, initial_state({"cpu": 1}, 0.0))[0]
    assert up.reason.startswith("infaas_replicate: m is overloaded on i-1; load 12 qps > U 0.8")
    assert up.numbers["overload"] is None  # the serving loop said nothing more
    # Active at that load: no overload in the reason.
    (up,) = decide(context(10.0, 12.0, [cpu("i-1")]), initial_state({"cpu": 1}, 0.0))[0]
    assert up.reason.startswith("infaas_replicate: load 12 qps")
    assert up.numbers["overloaded"] is False and up.numbers["overloaded_instances"] == []


def test_the_budget_is_a_hard_limit() -> None:
    decisions, state = decide(
        context(10.0, 80.0, [cpu("i-1")], budget=0.35), initial_state({"cpu": 1}, 0.0)
    )
    assert [(d.action, d.count) for d in decisions] == [
        ("infaas_replicate", 2),
        ("infaas_budget_capped", 2),
    ]
    assert dict(state.fleet) == {"cpu": 3}
    full, _ = decide(context(10.0, 80.0, [cpu("i-1")], budget=0.1), initial_state({"cpu": 1}, 0))
    assert [d.action for d in full] == ["infaas_budget_capped"]


def test_a_scale_up_the_caps_stop_says_so_not_the_budget() -> None:
    """Two cpus short of 30 qps, a budget with room (2 USD/hr) and max_counts at cpu 2, gpu 0:
    the cap said as the budget read "no variant of m fits: the fleet costs 0.2 of 2 USD/hr"."""
    two = [cpu("i-1", busy=0.9), cpu("i-2", busy=0.9)]
    capped_ctx = replace(context(10.0, 30.0, two), max_counts={"cpu": 2, "gpu": 0})
    (capped,), state = decide(capped_ctx, initial_state({"cpu": 2}, 0.0))
    assert capped.action == "infaas_budget_capped"
    assert capped.reason.endswith(
        "no variant of m fits: max_counts allows no more (cpu 2 of 2, gpu 0 of 0; the fleet"
        " costs 0.2 of 2 USD/hr)"
    ), capped.reason
    assert capped.numbers["max_counts"] == {"cpu": 2, "gpu": 0}
    assert dict(state.fleet) == {"cpu": 2}
    # The cpu at its cap, the gpu past what the budget has left: both are said.
    mixed = replace(context(10.0, 30.0, two, budget=0.5), max_counts={"cpu": 2})
    (capped,), _ = decide(mixed, initial_state({"cpu": 2}, 0.0))
    assert capped.reason.endswith(
        "no variant of m fits: the fleet costs 0.2 of 0.5 USD/hr, no more of gpu fits it, and"
        " max_counts allows no more of the others (cpu 2 of 2)"
    ), capped.reason
    # A scale-up the cap cuts short says the cap, not the budget ("the budget (2 USD/hr) and
    # caps allow 1 x cpu"); one the budget cuts short says the budget.
    one = replace(context(10.0, 30.0, [cpu("i-1")]), max_counts={"cpu": 2, "gpu": 0})
    (_, short), _ = decide(one, initial_state({"cpu": 1}, 0.0))
    assert short.reason.endswith(
        "m wanted 27.5 qps more; max_counts allows 1 x cpu (cpu 2 of 2; the budget 2 USD/hr)"
    ), short.reason
    (_, short), _ = decide(
        context(10.0, 30.0, [cpu("i-1")], budget=0.2), initial_state({"cpu": 1}, 0)
    )
    assert short.reason.endswith("the budget (0.2 USD/hr) allows 1 x cpu"), short.reason


def test_reasons_write_large_numbers_without_an_exponent() -> None:
    """1500 qps on one gpu (Q 100): the reason read "load 1.5e+03 qps ... capacity 100 ->
    1.9e+03 qps"; the drain of one of 30 gpus at 1200 qps read "1.2e+03 qps on 2.9e+03"."""
    (up,), _ = decide(
        context(10.0, 1500.0, [gpu("g-1")], budget=20.0), initial_state({"gpu": 1}, 0)
    )
    assert "e+0" not in up.reason, up.reason
    assert "load 1500 qps > U 0.8 x capacity 100 qps" in up.reason
    assert "capacity 100 -> 1900 qps for 1500 qps" in up.reason
    config = ScalingConfig(hold_s=0.0)
    many = [gpu(f"g-{k:02d}", busy=0.4) for k in range(30)]
    (drain,), _ = decide(
        context(10.0, 1200.0, many, budget=20.0), initial_state({"gpu": 30}, 0.0), config
    )
    assert drain.action == "infaas_drain" and "e+0" not in drain.reason, drain.reason
    assert "m 1200 qps on 2900 qps left" in drain.reason
    assert "cost 15 -> 14.5 USD/hr" in drain.reason


def test_the_costs_in_the_numbers_are_without_float_noise() -> None:
    """Two cpus at 0.1 USD/hr and one more: the numbers read 0.30000000000000004 USD/hr (a sum
    of floats), in the API's JSON and the decisions' listing."""
    two = [cpu("i-1", busy=0.9), cpu("i-2", busy=0.9)]
    (up,), _ = decide(context(10.0, 17.0, two), initial_state({"cpu": 2}, 0.0))
    assert up.numbers["cost_usd_per_hr_before"] == 0.2
    assert up.numbers["cost_usd_per_hr_after"] == 0.3
    three = [*two, cpu("i-3", busy=0.0)]
    config = ScalingConfig(hold_s=0.0)
    (drain,), _ = decide(context(10.0, 0.0, three), initial_state({"cpu": 3}, 0.0), config)
    assert drain.numbers["cost_usd_per_hr_after"] == 0.2


def test_a_cap_is_said_once_a_shortage_and_again_when_one_comes_back() -> None:
    """Two cpus at a budget of 0.2 USD/hr, short of 30 qps: capped, said once. The load drops,
    then an hour later comes back: said again (it was not: the newest cap in the log was the
    hour-old one while the app ran short)."""
    two = [cpu("i-1", busy=0.5), cpu("i-2", busy=0.5)]
    state = initial_state({"cpu": 2}, 0.0)
    said = []
    for now, load in ((0.0, 30.0), (1.0, 30.0), (2.0, 10.0), (3600.0, 30.0), (3601.0, 30.0)):
        decisions, state = decide(context(now, load, two, budget=0.2), state)
        said += [(now, d.action) for d in decisions]
    assert said == [(0.0, "infaas_budget_capped"), (3600.0, "infaas_budget_capped")]


def test_an_interfered_instance_is_relieved_once_and_one_interfered_everywhere_scales() -> None:
    two = [cpu("i-1"), cpu("i-2", "interfered")]
    decisions, state = decide(context(10.0, 2.0, two), initial_state({"cpu": 2}, 0.0))
    assert [(d.action, d.instance_id) for d in decisions] == [("infaas_relieve", "i-2")]
    assert decisions[0].numbers["share"] == 0.0
    again, state = decide(context(11.0, 2.0, two), state)
    assert [d.action for d in again] == []
    alone = [cpu("i-1", "interfered")]
    up, _ = decide(context(12.0, 2.0, alone), initial_state({"cpu": 1}, 0.0))
    assert [d.action for d in up] == ["infaas_replicate"]
    assert "interfered on every instance" in up[0].reason


def test_an_underused_instance_is_drained_after_the_hold_the_dearest_first() -> None:
    config = ScalingConfig(hold_s=5.0)
    fleet = [cpu("i-1"), ServedInstance("g-1", "gpu", {"m": "active"}, 0.0)]
    state = initial_state({"cpu": 1, "gpu": 1}, 0.0)
    decisions, state = decide(context(10.0, 4.0, fleet), state, config)
    assert decisions == []
    decisions, state = decide(context(14.0, 4.0, fleet), state, config)
    assert decisions == []
    (drain,) = decide(context(15.0, 4.0, fleet), state, config)[0]
    assert (drain.action, drain.instance_id, drain.instance_type) == ("infaas_drain", "g-1", "gpu")
    assert drain.numbers["underused_s"] == 5.0


def test_a_model_nothing_fits_for_does_not_hold_back_the_next() -> None:
    """Model a serves only on the gpu (its cpu variant misses the SLO), at its cap; model b is
    short and a cpu for it fits the budget. The scaler stopped at a (first by name) with its
    cap, every tick, and b was never scaled: a is capped, said once, and b is replicated."""
    variants = [
        VariantProfile("a", "gpu", 100.0, 60.0),
        VariantProfile("a", "cpu", 0.0, 30.0),
        VariantProfile("b", "gpu", 100.0, 60.0),
        VariantProfile("b", "cpu", 10.0, 30.0),
    ]
    both = {"a": "active", "b": "active"}
    fleet = [ServedInstance("g-1", "gpu", both, 0.9), ServedInstance("c-1", "cpu", both, 0.9)]  # type: ignore[arg-type]

    def tick(now: float) -> ScalingContext:
        loads = {"a": 90.0, "b": 95.0}  # over U x 100 and U x 110
        return ScalingContext("x", now, loads, fleet, variants, PRICES, 2.0, max_counts={"gpu": 1})

    decisions, state = decide(tick(10.0), initial_state({"gpu": 1, "cpu": 1}, 0.0))
    assert [(d.action, d.model) for d in decisions] == [
        ("infaas_budget_capped", "a"),
        ("infaas_replicate", "b"),
    ], [d.reason for d in decisions]
    assert "max_counts allows no more (gpu 1 of 1" in decisions[0].reason
    assert decisions[1].instance_type == "cpu" and state.fleet["cpu"] > 1
    # The next tick, b's cpus still loading: a's cap is not said again.
    again, _ = decide(tick(11.0), state)
    assert [d.action for d in again] == []


def test_a_load_at_the_threshold_does_not_drain_and_replicate_in_turn() -> None:
    """Two cpus (Q 10) while the load moves between 7.9 and 8.1 qps every 20 s: a drain judged
    at U (one cpu carries 7.9 at 0.8) was bought back by 8.1 four seconds later, every hold.
    The drain's U_drain (0.7) leaves a band: nothing changes; at 6.9 qps one cpu goes."""
    config = ScalingConfig(hold_s=5.0)
    state = initial_state({"cpu": 2}, 0.0)
    actions = []
    for now in range(1, 121):
        load = 7.9 if (now // 20) % 2 == 0 else 8.1
        n = state.fleet["cpu"]
        fleet = [cpu(f"i-{k}", busy=load / (10.0 * n)) for k in range(n)]
        decisions, state = decide(context(float(now), load, fleet), state, config)
        actions += [d.action for d in decisions]
    assert actions == [] and dict(state.fleet) == {"cpu": 2}
    fleet = [cpu("i-0", busy=0.345), cpu("i-1", busy=0.345)]
    drains = []
    for now in range(121, 131):
        decisions, state = decide(context(float(now), 6.9, fleet), state, config)
        drains += decisions
    (drain,) = drains
    assert drain.action == "infaas_drain" and dict(state.fleet) == {"cpu": 1}
    assert "m 6.9 qps on 10 qps left, within U_drain 0.7" in drain.reason, drain.reason
    assert drain.numbers["drain_utilisation"] == 0.7
    with pytest.raises(ValueError, match="drain_utilisation must be in"):
        ScalingConfig(utilisation=0.8, drain_utilisation=0.9)


def test_a_steady_load_one_instance_cannot_carry_is_replicated_once_and_not_drained() -> None:
    """One cpu (Q 10 by its profile) is overloaded at a steady 6.5 qps (it serves about 6; its
    backlog's verdict comes and goes tick by tick): the profile says two carry it at 0.7 x 10
    after a drain, the state says one does not. The drain and the overload took turns, every
    hold plus the serving loop's 10 s window (seen live on the demo's `large`, also while the
    measured load was right). Found short at 6.5 qps on 10, the model keeps its second cpu
    until the load is below U_drain / U of it; at 5 qps, which one cpu serves, the cpu goes.
    While the replica loads (4 s here), the one cpu that is not overloaded on a tick has not
    carried the load: what it was found short at stays (forgotten then, the drains came back)."""
    config = ScalingConfig(hold_s=5.0)
    note = OverloadNote(("backlog drains in 301 ms > SLO 300 ms",), {"window_s": 10.0})
    state = initial_state({"cpu": 1}, 0.0)
    actions = []
    serving = 1  # the cpus that serve
    loading: list[float] = []  # the times the others were launched

    def tick(now: float, load: float) -> list[str]:
        nonlocal state, serving, loading
        serving = min(serving + sum(now - t >= 4.0 for t in loading), state.fleet["cpu"])
        loading = [t for t in loading if now - t < 4.0]
        short = serving == 1 and load > 6.0 and int(now) % 2 == 1
        busy = load / 6.0 / serving
        fleet = [cpu(f"i-{k}", "overloaded" if short else "active", busy) for k in range(serving)]
        ctx = replace(context(now, load, fleet), overload={"m": note} if short else {})
        decisions, state = decide(ctx, state, config)
        loading += [
            now for d in decisions if d.action == "infaas_replicate" for _ in range(d.count)
        ]
        return [d.action for d in decisions]

    for now in range(1, 121):
        actions += tick(float(now), 6.5)
    assert actions == ["infaas_replicate"] and dict(state.fleet) == {"cpu": 2}, actions
    assert [(c, w) for c, w, _ in state.short_at["m"]] == [(10.0, 6.5)]
    # 5.9 qps is not below 0.875 x 6.5: still kept. At 5 qps one cpu goes, and stays enough.
    for now in range(121, 141):
        actions += tick(float(now), 5.9)
    assert actions == ["infaas_replicate"]
    for now in range(141, 201):
        actions += tick(float(now), 5.0)
    assert actions == ["infaas_replicate", "infaas_drain"] and dict(state.fleet) == {"cpu": 1}
    # One cpu left: once it carries a load the guard would not have drained it at (5.8 qps,
    # over 0.875 x 6.5), what it was found short at is forgotten; until then it is kept.
    for now in range(201, 211):
        actions += tick(float(now), 5.6)
    assert [(c, w) for c, w, _ in state.short_at["m"]] == [(10.0, 6.5)]
    for now in range(211, 221):
        actions += tick(float(now), 5.8)
    assert actions[2:] == [] and dict(state.short_at) == {}, actions


def test_a_capacity_found_short_is_kept_apart_and_forgotten_after_the_memory() -> None:
    """Found short at 10.1 qps on two cpus (20 qps), then, a burst's verdict, at 9.8 on three:
    three cpus carry 10.5 qps since, so the second is forgotten, and the first still holds the
    drain to two (pruned as redundant beside the second, it went with it, and the drain came
    back, seen live). Without another overload, it holds drains back for the memory only."""
    config = ScalingConfig(hold_s=5.0, short_memory_s=60.0)
    state = replace(
        initial_state({"cpu": 3}, 0.0), short_at={"m": ((20.0, 10.1, 0.0), (30.0, 9.8, 1.0))}
    )
    three = [cpu(f"i-{k}", busy=0.35) for k in range(3)]
    actions = []
    for now in range(2, 61):
        decisions, state = decide(context(float(now), 10.5, three), state, config)
        actions += [d.action for d in decisions]
    assert actions == [] and [(c, w) for c, w, _ in state.short_at["m"]] == [(20.0, 10.1)]
    drains = []
    for now in range(61, 67):  # forgotten at 61; then the hold
        decisions, state = decide(context(float(now), 10.5, three), state, config)
        drains += [(now, d.action) for d in decisions]
    assert drains == [(66, "infaas_drain")] and dict(state.fleet) == {"cpu": 2}
    assert dict(state.short_at) == {}
    with pytest.raises(ValueError, match="short_memory_s"):
        ScalingConfig(short_memory_s=-1.0)


def gpu(name: str, busy: float | None = 0.0) -> ServedInstance:
    return ServedInstance(name, "gpu", {"m": "active"}, busy)


def test_the_hold_is_the_types_so_an_idle_app_ends_on_its_cheapest_type() -> None:
    """2 gpu + 1 cpu, idle: the first drain names g-1 and the reconciler ends the other gpu (its
    own order). The gpu left keeps the type's clock, so the next drain is the gpu again, not
    the cpu whose clock is as old: the app ends on the cpu. An instance's own clock, restarted
    for the one the first drain named, gave the cpu's the older one (seen live: the app idled on
    its dearest type)."""
    config = ScalingConfig(hold_s=5.0)
    fleet = [gpu("g-1"), gpu("g-2"), cpu("c-1", busy=0.0)]
    state = initial_state({"cpu": 1, "gpu": 2}, 0.0)
    decisions, state = decide(context(10.0, 0.0, fleet), state, config)
    assert decisions == []
    (first,), state = decide(context(15.0, 0.0, fleet), state, config)
    assert (first.action, first.instance_type, first.instance_id) == ("infaas_drain", "gpu", "g-1")
    assert dict(state.fleet) == {"cpu": 1, "gpu": 1}
    # The reconciler ended g-2, not the g-1 the decision named.
    left = [gpu("g-1"), cpu("c-1", busy=0.0)]
    for now in (16.0, 17.0, 19.0):
        decisions, state = decide(context(now, 0.0, left), state, config)
        assert decisions == []
    (second,), state = decide(context(20.0, 0.0, left), state, config)
    assert (second.action, second.instance_type) == ("infaas_drain", "gpu")
    assert second.numbers["underused_s"] == 10.0
    assert dict(state.fleet) == {"cpu": 1}
    # The cpu is the last instance: it stays.
    decisions, state = decide(context(40.0, 0.0, [cpu("c-1", busy=0.0)]), state, config)
    assert decisions == [] and dict(state.fleet) == {"cpu": 1}


def test_a_scale_up_over_a_deferred_drain_counts_one_fleet_and_adds_what_it_says() -> None:
    """The policy drained one of two cpus, but the reconciler has not carried it out (the
    disruption budget deferred it): both still serve. A scale-up judged on both's capacity
    starts from both (the drain taken back): its counts, cost and capacity are of the fleet
    that serves, and its +1 is one instance more than runs, which the next tick counts as
    loading (seen live: two replicates 1 -> 2, 2 -> 3 at the cost of one instance, capacity of
    two, and one launch)."""
    config = ScalingConfig(hold_s=0.0)
    two = [cpu("i-1", busy=0.9), cpu("i-2", busy=0.9)]
    state = replace(initial_state({"cpu": 1}, 0.0), drained_s=5.0)
    (up,), state = decide(context(10.0, 17.0, two), state, config)
    assert (up.action, up.instance_type, up.count) == ("infaas_replicate", "cpu", 1)
    assert (up.numbers["count_before"], up.numbers["count_after"]) == (2, 3)
    assert up.numbers["capacity_qps_before"] == 20.0
    assert up.numbers["capacity_qps_after"] == 30.0
    assert up.numbers["cost_usd_per_hr_before"] == pytest.approx(0.2)
    assert up.numbers["cost_usd_per_hr_after"] == pytest.approx(0.3)
    assert up.numbers["taken_back"] == {"cpu": 1}
    assert "+1 x cpu (2 -> 3; 1 x cpu drained by the policy but still serving" in up.reason
    assert "capacity 20 -> 30 qps" in up.reason and "cost 0.2 -> 0.3 of" in up.reason
    assert dict(state.fleet) == {"cpu": 3}
    # The instance added is loading: the same load asks for nothing more.
    again, state = decide(context(11.0, 17.0, two), state, config)
    assert again == [] and dict(state.fleet) == {"cpu": 3}
    # Without a scale-up the drain still wanted stays wanted (the budget cap adds nothing).
    capped, kept = decide(
        context(12.0, 17.0, two, budget=0.2), replace(initial_state({"cpu": 1}, 0.0)), config
    )
    assert [d.action for d in capped] == ["infaas_budget_capped"]
    assert "the fleet costs 0.2 of 0.2 USD/hr" in capped[0].reason
    assert dict(kept.fleet) == {"cpu": 1}


def test_a_drain_waits_for_the_last_one_to_be_carried_out() -> None:
    """Four cpus serve 20 qps (Q 10): one can go (20 qps on 30 left, within U). The reconciler
    defers it (the disruption budget): four still serve, and a second drain judged on them took
    the fleet to two, then one, each saying "20 qps on 30 qps left", for a load two carry only
    past U. The next drain waits until the reconciler has carried out the last one."""
    config = ScalingConfig(hold_s=15.0)
    four = [cpu(f"i-{k}", busy=0.5) for k in range(4)]
    state = initial_state({"cpu": 4}, 0.0)
    decisions, state = decide(context(0.0, 20.0, four), state, config)
    assert decisions == []
    (drain,), state = decide(context(15.0, 20.0, four), state, config)
    assert (drain.action, drain.numbers["count_after"]) == ("infaas_drain", 3)
    for now in (30.0, 45.0, 60.0):
        decisions, state = decide(context(now, 20.0, four), state, config)
        assert decisions == [] and dict(state.fleet) == {"cpu": 3}, (now, decisions)
    # Carried out: three serve, and without one of them 20 qps is past U x 20: they stay.
    decisions, state = decide(context(75.0, 20.0, four[:3]), state, config)
    assert decisions == [] and dict(state.fleet) == {"cpu": 3}
    # At a lower load the next drain follows its hold.
    decisions, state = decide(context(76.0, 10.0, four[:3]), state, config)
    assert decisions == []
    (again,), state = decide(context(91.0, 10.0, four[:3]), state, config)
    assert (again.action, again.numbers["count_after"]) == ("infaas_drain", 2)


def test_instances_serving_beside_the_fleet_for_the_reconciler_do_not_hold_a_drain() -> None:
    """After a spot move the fleet is one gpu and two cpus, one of them a small instance the
    reconciler launched to stand in for a cpu (counted as one): three serve, one of a type the
    policy's fleet does not name. Counted from what serves, that read as a drain of the
    policy's still to be carried out, and the idle gpu was never drained (the stand-in stays).
    The reconciler says it holds nothing back: the gpu goes after its hold. A drain it holds
    back, or a fleet its last pass has not read, still waits (one drain at a time)."""
    config = ScalingConfig(hold_s=5.0)
    variants = [*VARIANTS, VariantProfile("m", "small", 10.0, 30.0)]
    prices = {**PRICES, "small": 0.05}
    serving = [
        ServedInstance("g-1", "gpu", {"m": "active"}, 0.0),
        cpu("c-1"),
        ServedInstance("s-1", "small", {"m": "active"}, 0.1),
    ]
    fleet = {"gpu": 1, "cpu": 2}

    def at(now_s: float, held_back: HeldBack | None) -> ScalingContext:
        return ScalingContext(
            "a", now_s, {"m": 4.0}, serving, variants, prices, 2.0, held_back=held_back
        )

    state = initial_state(fleet, 0.0)
    nothing_held = HeldBack(fleet)
    decisions, state = decide(at(10.0, nothing_held), state, config)
    assert decisions == []
    (drain,), after = decide(at(15.0, nothing_held), state, config)
    assert (drain.action, drain.instance_id, drain.instance_type) == ("infaas_drain", "g-1", "gpu")
    assert dict(after.fleet) == {"cpu": 2}
    # The reconciler holds back a drain of the policy's: the next one waits for it.
    held = HeldBack(fleet, {"cpu": 1})
    decisions, kept = decide(at(15.0, held), state, config)
    assert decisions == [] and dict(kept.fleet) == fleet, decisions


def test_with_the_reconcilers_word_a_drain_still_waits_for_the_last_one() -> None:
    """The case of test_a_drain_waits_for_the_last_one_to_be_carried_out, the reconciler saying
    what it holds back: four cpus serve 20 qps, one is drained; until a pass has read the fleet
    of three, and while it holds the fourth back, no second drain; once it is carried out and
    the load is lower, the next drain follows its hold."""
    config = ScalingConfig(hold_s=15.0)
    four = [cpu(f"i-{k}", busy=0.1) for k in range(4)]

    def at(
        now_s: float, load: float, serving: list[ServedInstance], held: HeldBack
    ) -> ScalingContext:
        return replace(context(now_s, load, serving), held_back=held)

    state = initial_state({"cpu": 4}, 0.0)
    decisions, state = decide(at(0.0, 10.0, four, HeldBack({"cpu": 4})), state, config)
    assert decisions == []
    (drain,), state = decide(at(15.0, 10.0, four, HeldBack({"cpu": 4})), state, config)
    assert (drain.action, drain.numbers["count_after"]) == ("infaas_drain", 3)
    # No pass since (it read four), then one that defers the drain: four serve, none goes.
    for now, held in ((30.0, HeldBack({"cpu": 4})), (45.0, HeldBack({"cpu": 3}, {"cpu": 1}))):
        decisions, state = decide(at(now, 10.0, four, held), state, config)
        assert decisions == [] and dict(state.fleet) == {"cpu": 3}, (now, decisions)
    # Carried out: three serve, nothing held back; the next drain follows its hold.
    (again,), state = decide(at(60.0, 10.0, four[:3], HeldBack({"cpu": 3})), state, config)
    assert (again.action, again.numbers["count_after"]) == ("infaas_drain", 2)


# A type that serves more than a gpu (rule 11's stand-in serves at least as much) and one that
# serves half as much (two of them stand in for one gpu, each as 1/2 of it: rule 10's sized move).
BIG = VariantProfile("m", "big", 120.0, 60.0)
HALF = VariantProfile("m", "half", 50.0, 60.0)
STANDING_PRICES = {**PRICES, "big": 0.6, "half": 0.3}


def standing(
    now_s: float, load_qps: float, serving: list[ServedInstance], held: HeldBack
) -> ScalingContext:
    variants = [*VARIANTS, BIG, HALF]
    return ScalingContext(
        "a", now_s, {"m": load_qps}, serving, variants, STANDING_PRICES, 5.0, held_back=held
    )


def test_a_stand_in_counts_for_the_type_it_stands_in_for_with_what_it_serves() -> None:
    """The policy's fleet is two gpus; the reconciler runs one gpu and a big instance standing
    in for the other (the provider short of gpus). Counted as its own type, the stand-in left a
    gpu "loading": its capacity was counted twice (120 serving as big, 100 loading as gpu: 320
    qps, so 200 qps read as within U) and no scale-up came. It is the gpu that serves: 220 qps
    of capacity, 200 qps > U 0.8 x 220, and the scale-up adds what is missing on the cheapest
    option (three cpus), the gpus kept at two and no big taken into the fleet."""
    serving = [
        ServedInstance("g-1", "gpu", {"m": "active"}, 0.9),
        ServedInstance("b-1", "big", {"m": "active"}, 0.9),
    ]
    fleet = {"gpu": 2}
    held = HeldBack(fleet, stand_ins={"b-1": StandIn("gpu")})
    (up,), after = decide(standing(10.0, 200.0, serving, held), initial_state(fleet, 0.0))
    assert (up.action, up.instance_type, up.count) == ("infaas_upgrade", "cpu", 3), up.reason
    assert up.numbers["capacity_qps_before"] == 220.0
    assert up.numbers["taken_back"] == {}
    assert dict(after.fleet) == {"gpu": 2, "cpu": 3}
    # Overloaded on the gpu at a load within U: nothing loads, so the state scales it up (a gpu
    # read as loading held it until the "load" was over, never). One more of what serves it,
    # the cheapest by the ILP's cost: a big instance of the policy's own, bought as such.
    hot = [replace(serving[0], states={"m": "overloaded"}), serving[1]]
    (up,), after = decide(standing(10.0, 150.0, hot, held), initial_state(fleet, 0.0))
    assert (up.action, up.instance_type, up.count) == ("infaas_replicate", "big", 1), up.reason
    assert up.numbers["taken_back"] == {}
    assert dict(after.fleet) == {"gpu": 2, "big": 1}


def test_a_type_stood_in_for_is_drained_not_a_cheaper_one_beside_it() -> None:
    """Fleet: two gpus and a cpu; a big instance stands in for one gpu. At 50 qps one gpu's
    count goes: without the most one count of it serves (the big one, 120 qps, the reconciler
    may end it) 110 qps carry 50 at U_drain 0.7. Counted as its own type, the gpu read as
    loading (never drained) and the big one as no type of the fleet: the cheap cpu went."""
    config = ScalingConfig(hold_s=5.0)
    serving = [
        ServedInstance("g-1", "gpu", {"m": "active"}, 0.1),
        ServedInstance("b-1", "big", {"m": "active"}, 0.1),
        cpu("c-1"),
    ]
    fleet = {"gpu": 2, "cpu": 1}
    held = HeldBack(fleet, stand_ins={"b-1": StandIn("gpu")})
    decisions, state = decide(
        standing(10.0, 50.0, serving, held), initial_state(fleet, 0.0), config
    )
    assert decisions == []
    (drain,), after = decide(standing(15.0, 50.0, serving, held), state, config)
    assert (drain.action, drain.instance_type) == ("infaas_drain", "gpu"), drain.reason
    assert drain.numbers["capacity_qps_after"] == {"m": 110.0}
    assert "b-1, a big standing in for gpu," in drain.reason
    assert dict(after.fleet) == {"gpu": 1, "cpu": 1}
    # At 80 qps, 110 qps left would not carry it at U_drain (77): the gpu stays, and so does
    # the cpu (a cheaper type is drained only where it is underused itself: 210 x 0.7 >= 80).
    decisions, _ = decide(standing(15.0, 80.0, serving, held), state, config)
    assert [(d.action, d.instance_type) for d in decisions] == [("infaas_drain", "cpu")]


def test_a_scale_up_takes_back_a_drain_as_the_type_stood_in_for_never_the_stand_ins() -> None:
    """The policy drained a gpu (fleet: one) the disruption budget still holds back; what
    serves is a gpu and a big instance standing in for the other. A scale-up takes that drain
    back as a gpu (the reconciler counts the big one as one), not as a big one: by count, the
    fleet took a big instance in, and the reconciler, already counting the stand-in as the
    gpu, bought a big one."""
    serving = [
        ServedInstance("g-1", "gpu", {"m": "active"}, 0.9),
        ServedInstance("b-1", "big", {"m": "active"}, 0.9),
    ]
    held = HeldBack({"gpu": 1}, {"gpu": 1}, {"b-1": StandIn("gpu")})
    (up,), after = decide(standing(10.0, 200.0, serving, held), initial_state({"gpu": 1}, 0.0))
    assert up.numbers["taken_back"] == {"gpu": 1}, up.reason
    assert (up.instance_type, up.count) == ("cpu", 3)
    assert dict(after.fleet) == {"gpu": 2, "cpu": 3}


def test_k_smaller_stand_ins_count_each_as_one_kth_of_the_type_they_stand_in_for() -> None:
    """Two half instances (50 qps each) stand in for the fleet's one gpu, each as 1/2 of it. At
    90 qps, 100 qps serve (> U 0.8 x 100): two cpus are added, nothing is taken back (by count,
    the fleet took both halves in and the reconciler bought two more). One half still booting
    (not serving yet): half a gpu loads, its 50 qps counted once."""
    serving = [
        ServedInstance("h-1", "half", {"m": "active"}, 0.9),
        ServedInstance("h-2", "half", {"m": "active"}, 0.9),
    ]
    halves = {"h-1": StandIn("gpu", 0.5), "h-2": StandIn("gpu", 0.5)}
    held = HeldBack({"gpu": 1}, stand_ins=halves)
    (up,), after = decide(standing(10.0, 90.0, serving, held), initial_state({"gpu": 1}, 0.0))
    assert (up.action, up.instance_type, up.count) == ("infaas_upgrade", "cpu", 2), up.reason
    assert up.numbers["capacity_qps_before"] == 100.0
    assert up.numbers["taken_back"] == {}
    assert dict(after.fleet) == {"gpu": 1, "cpu": 2}
    (up,), after = decide(standing(10.0, 90.0, serving[:1], held), initial_state({"gpu": 1}, 0.0))
    assert up.numbers["capacity_qps_before"] == 100.0, up.reason  # 50 serving, 50 loading
    assert dict(after.fleet) == {"gpu": 1, "cpu": 2}


def test_a_stand_ins_share_is_one_of_one_at_most() -> None:
    with pytest.raises(ValueError, match="share"):
        StandIn("gpu", 1.5)


def test_refusals_from_before_a_drain_do_not_scale_the_fleet_back_up() -> None:
    # The load has gone: the second cpu is drained after the hold. Within the serving loop's
    # 10 s window the one left still reads overloaded (refusals made while the load was on, at
    # the capacity of two): judged partly on the fleet before the drain, it buys nothing.
    config = ScalingConfig(hold_s=3.0)
    two = [cpu("i-1", busy=0.0), cpu("i-2", busy=0.0)]
    state = initial_state({"cpu": 2}, 0.0)
    decisions, state = decide(context(10.0, 0.0, two), state, config)
    assert decisions == []
    (drain,), state = decide(context(13.0, 0.0, two), state, config)
    assert drain.action == "infaas_drain" and state.drained_s == 13.0
    note = OverloadNote(("18 queries refused (429) in the last 10 s",), {"window_s": 10.0})
    stale = replace(context(14.0, 0.0, [cpu("i-1", "overloaded")]), overload={"m": note})
    decisions, state = decide(stale, state, config)
    assert decisions == [] and dict(state.fleet) == {"cpu": 1}
    # Fresh arrivals past U x capacity scale up within the window all the same.
    short = replace(context(15.0, 12.0, [cpu("i-1", "overloaded")]), overload={"m": note})
    (up,) = decide(short, state, config)[0]
    assert (up.action, up.count) == ("infaas_replicate", 1)
    # Once the window has passed since the drain, the verdict counts again.
    later = replace(context(23.5, 0.0, [cpu("i-1", "overloaded")]), overload={"m": note})
    (up,) = decide(later, state, config)[0]
    assert up.action == "infaas_replicate" and "overloaded on i-1" in up.reason


def test_the_last_instance_and_a_busy_one_stay() -> None:
    config = ScalingConfig(hold_s=0.0)
    (none, _) = decide(context(10.0, 0.0, [cpu("i-1")]), initial_state({"cpu": 1}, 0.0), config)
    assert none == []
    busy = [cpu("i-1", busy=0.9), cpu("i-2", busy=0.9)]
    (none, _) = decide(context(10.0, 0.0, busy), initial_state({"cpu": 2}, 0.0), config)
    assert none == []


def test_the_arithmetic() -> None:
    assert instances_for(0.0, 10.0, 0.8) == 1
    assert instances_for(16.0, 10.0, 0.8) == 2
    assert scaling_cost_usd_per_s(3.6, -1, 1.0, 30.0) == pytest.approx(-0.001)
    with pytest.raises(ValueError, match="utilisation"):
        ScalingConfig(utilisation=0.0)
