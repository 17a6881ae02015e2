"""Rule 10's move back to spot, decided by :func:`controlplane.loops.reconciler.reconcile` alone:
the disruption budget it shares with the scale-down, and the plan's on-demand base it keeps."""

from __future__ import annotations

import dataclasses

from controlplane.db.store import InstanceRecord
from controlplane.loops.reconciler import Action, Launch, Mark, SpotReturned, Terminate
from controlplane.policies.disruption import DisruptionBudget
from tests.unit.test_reconciler import PREFIX, profile_row, row, run

SPOT = {"small": 0.015, "large": 0.5}


def spot_row(instance_type: str, age_s: float) -> InstanceRecord:
    record = row(instance_type, age_s=age_s)
    return dataclasses.replace(record, market="spot", price_usd_per_hr=SPOT[instance_type])


def test_the_move_back_and_a_scale_down_share_one_disruption_budget() -> None:
    # Two small ones on demand whose spot replacements serve, and one large one too many: the
    # disruption budget lets one serving instance go this tick, not one for each rule.
    rows = [
        row("small", age_s=600.0),
        row("small", age_s=500.0),
        spot_row("small", age_s=60.0),
        spot_row("small", age_s=60.0),
        row("large", age_s=300.0),
        row("large", age_s=200.0),
    ]
    actions = run(
        {"small": 2, "large": 1},
        rows,
        desired_spot={"small": 2},
        spot_prices_usd_per_hr=SPOT,
        spot_fallen={"small"},
        disruption=DisruptionBudget(max_instances=1, max_share=0.0, window_s=60.0),
    )
    drained = _drained(actions)
    ended = [a for a in actions if isinstance(a, Terminate)]
    assert len(drained) + sum(len(a.instance_ids) for a in ended) <= 1, actions


def test_an_on_demand_stand_in_does_not_move_the_on_demand_base_to_spot() -> None:
    # The plan {small: 4} with 2 on spot: 2 small on demand (its base), 1 small on spot and a
    # large one on demand standing in for the other spot one. The base stays on demand: what
    # goes back to spot is the stand-in, its slot (one small on spot launched next to it).
    base = [row("small", age_s=600.0), row("small", age_s=500.0)]
    stand_in = row("large", age_s=100.0)
    rows = [*base, spot_row("small", age_s=300.0), stand_in]
    actions = run(
        {"small": 4},
        rows,
        desired_spot={"small": 2},
        spot_prices_usd_per_hr=SPOT,
        spot_fallen={"small"},
        stand_ins={stand_in.id: "small"},
    )
    returned = [a for a in actions if isinstance(a, SpotReturned)]
    assert [(a.instance_ids, a.stand_in) for a in returned] == [((stand_in.id,), True)], actions
    launched = [a for a in actions if isinstance(a, Launch)]
    assert [(a.instance_type, a.market) for a in launched] == [("small", "spot")], actions
    assert not _gone(actions), actions


def test_a_lingering_stand_in_does_not_drain_the_on_demand_base() -> None:
    # The plan {small: 4} with 2 on spot, served as planned, and a large stand-in left over:
    # the base is not drained to move it to spot.
    base = [row("small", age_s=600.0), row("small", age_s=500.0)]
    stand_in = row("large", age_s=100.0)
    rows = [*base, spot_row("small", age_s=300.0), spot_row("small", age_s=300.0), stand_in]
    actions = run(
        {"small": 4},
        rows,
        desired_spot={"small": 2},
        spot_prices_usd_per_hr=SPOT,
        spot_fallen={"small"},
        stand_ins={stand_in.id: "small"},
    )
    gone = {i for a in actions if isinstance(a, Terminate) for i in a.instance_ids}
    gone |= {a.instance_id for a in actions if isinstance(a, Mark) and a.to_state == "draining"}
    assert not gone & {r.id for r in base}, actions


def test_an_unlaunched_on_demand_row_is_launched_again_not_moved_back() -> None:
    # Of three small ones on demand, the oldest is a request whose launch failed retryably:
    # the move back takes the launched ones only; the request is tried again as before (taken
    # as returning, it was never launched again nor ended, its cost reserved for good).
    waiting = row("small", "requested", age_s=400.0, updated_age_s=1.0)
    rows = [waiting, row("small", age_s=300.0), row("small", age_s=200.0)]
    actions = run(
        {"small": 3},
        rows,
        desired_spot={"small": 3},
        spot_prices_usd_per_hr=SPOT,
        spot_fallen={"small"},
    )
    again = [a for a in actions if isinstance(a, Launch) and a.request_id == waiting.request_id]
    assert again, actions


def test_a_plan_cut_beside_the_spot_share_drains_under_the_scale_down() -> None:
    # The plan cut from {small: 5} to {small: 4}, 2 on spot, the spot price well above its
    # fall: the extra on-demand one is a scale-down (which rule 5 takes back when the count
    # rises again), not a move back to spot.
    rows = [
        row("small", age_s=600.0),
        row("small", age_s=500.0),
        row("small", age_s=400.0),
        spot_row("small", age_s=300.0),
        spot_row("small", age_s=300.0),
    ]
    actions = run(
        {"small": 4},
        rows,
        desired_spot={"small": 2},
        spot_prices_usd_per_hr=SPOT,
    )
    drained = _drained(actions)
    assert len(drained) == 1, actions
    assert drained[0].reason.startswith("scale_down"), drained[0].reason


def _drained(actions: list[Action]) -> list[Mark]:
    """The rows a tick marks draining."""
    return [a for a in actions if isinstance(a, Mark) and a.to_state == "draining"]


def _gone(actions: list[Action]) -> set[str]:
    """The rows a tick ends or drains."""
    gone = {i for a in actions if isinstance(a, Terminate) for i in a.instance_ids}
    return gone | {
        a.instance_id for a in actions if isinstance(a, Mark) and a.to_state != "running"
    }


def test_a_price_that_swings_back_keeps_the_rise_replacements_until_the_hold() -> None:
    # Three small ones on spot; the price rises past the budget's headroom line (and past the
    # on-demand price) for one tick: the budget pays for both, so their on-demand replacements
    # are launched next to them. The next ticks the price is back at 0.015, the fall not yet
    # held: the replacements (booting, then serving) stay, and the rise's move completes (the
    # spot ones drain once the replacements serve); only once the fall has held do on-demand
    # ones go back to spot, under the move back.
    spot = [spot_row("small", age_s=600.0) for _ in range(3)]
    plan = {"desired_spot": {"small": 3}, "headroom_share": 0.5}
    rise = run({"small": 3}, spot, budget=0.35, spot_prices_usd_per_hr={"small": 0.06}, **plan)
    launched = [a for a in rise if isinstance(a, Launch)]
    assert [(a.market, a.replaces_spot) for a in launched] == [("on-demand", True)] * 3, rise

    def after_the_rise(replacements: list[InstanceRecord], **fall: object) -> list[Action]:
        """A tick with the price back at 0.015 beside the rise's ``replacements``."""
        return run(
            {"small": 3},
            [*spot, *replacements],
            budget=0.35,
            spot_prices_usd_per_hr=SPOT,
            spot_replacements={r.id for r in replacements},
            **plan,
            **fall,
        )

    for state in ("pending", "running"):
        replacements = [row("small", state, age_s=30.0) for _ in launched]
        ids = {r.id for r in replacements}
        actions = after_the_rise(replacements)
        assert not _gone(actions) & ids, (state, actions)
        assert not [a for a in actions if isinstance(a, Launch)], (state, actions)
        drained = _drained(actions)
        if state == "pending":
            assert not drained, actions  # the spot ones serve until the replacements do
        else:
            assert {a.instance_id for a in drained} == {r.id for r in spot}, actions
            assert all(a.reason.startswith("moved off") for a in drained), actions
    # Had the spot ones stayed (their drain deferred), the fall once held gives the
    # replacements back to spot.
    back = after_the_rise(replacements, spot_fallen={"small"})
    drained = [a for a in back if isinstance(a, Mark) and a.to_state == "draining"]
    assert {a.instance_id for a in drained} == ids, back
    assert all(a.reason.startswith("spot_return:") for a in drained), back


def test_a_plan_cut_after_the_rise_is_given_back_drains_under_the_scale_down() -> None:
    # A rise's two on-demand replacements outlived its move: the fall held and the move back
    # returned the older base rows to spot, leaving the replacements as the plan's on-demand
    # base beside two newer spot ones. The plan is then cut from {small: 4} to {small: 3}, 2 on
    # spot: the extra one is the scale-down's (rule 5 takes its drain back if the count rises
    # again), whether or not the spot price is still down; neither a spot one drained as the
    # rise's move nor a replacement under spot_return.
    replacements = [row("small", age_s=900.0), row("small", age_s=800.0)]
    spot = [spot_row("small", age_s=100.0), spot_row("small", age_s=100.0)]
    for fallen in ((), ("small",)):
        actions = run(
            {"small": 3},
            [*replacements, *spot],
            desired_spot={"small": 2},
            spot_prices_usd_per_hr=SPOT,
            spot_replacements={r.id for r in replacements},
            spot_fallen=fallen,
        )
        drained = _drained(actions)
        assert len(drained) == 1, (fallen, actions)
        assert drained[0].reason.startswith("scale_down"), (fallen, drained[0].reason)


def test_only_the_rise_replacements_are_flagged_as_replacing_spot() -> None:
    # The plan {small: 2}, 1 on spot: its on-demand base is missing and the spot one's price
    # rises past the threshold and past the on-demand price. Both launches are on demand; only
    # the one in the spot one's place replaces spot (the base one is the plan's on demand).
    actions = run(
        {"small": 2},
        [spot_row("small", age_s=600.0)],
        budget=0.2,
        spot_prices_usd_per_hr={"small": 0.06},
        desired_spot={"small": 1},
        headroom_share=0.9,
    )
    launched = [a for a in actions if isinstance(a, Launch)]
    assert [a.market for a in launched] == ["on-demand"] * 2, actions
    assert sum(a.replaces_spot for a in launched) == 1, actions


def _stand_ins(instance_type: str, count: int, age_s: float) -> list[InstanceRecord]:
    return [row(instance_type, age_s=age_s) for _ in range(count)]


def test_stand_ins_of_another_type_go_back_once_the_fall_holds() -> None:
    # The plan {small: 3}, all on spot; a rise (or a shortage) left three large ones on demand
    # standing in for them. Once small's fall has held, each goes back made before the break:
    # small on spot launched in its slot while it serves on, drained only once those serve.
    stand_ins = _stand_ins("large", 3, age_s=900.0)
    standing = {r.id: "small" for r in stand_ins}
    plan = {
        "desired_spot": {"small": 3},
        "spot_prices_usd_per_hr": SPOT,
        "stand_ins": standing,
        "budget": 0.4,  # 0.3 paid: room for the three spot ones (0.045) next to them
    }
    held = run({"small": 3}, stand_ins, **plan)  # the fall not held yet: nothing moves
    assert not [a for a in held if isinstance(a, SpotReturned | Launch)], held
    first = run({"small": 3}, stand_ins, spot_fallen={"small"}, **plan)
    returned = [a for a in first if isinstance(a, SpotReturned)]
    assert [(a.instance_ids, a.how, a.stand_in) for a in returned] == [
        ((r.id,), "make_before_break", True) for r in stand_ins
    ], first
    launched = [a for a in first if isinstance(a, Launch)]
    assert [(a.instance_type, a.market, a.stands_for) for a in launched] == [
        ("small", "spot", None)
    ] * 3, first
    assert not _gone(first), first  # nothing leaves before its replacement serves
    returning = {r.id for r in stand_ins}
    for state in ("pending", "running"):
        replacements = [
            dataclasses.replace(spot_row("small", age_s=30.0), state=state) for _ in range(3)
        ]
        actions = run(
            {"small": 3},
            [*stand_ins, *replacements],
            spot_fallen={"small"},
            spot_returning=returning,
            **plan,
        )
        assert not [a for a in actions if isinstance(a, Launch)], (state, actions)
        assert not _gone(actions) & {r.id for r in replacements}, (state, actions)
        drained = _drained(actions)
        if state == "pending":
            assert not drained, actions  # the stand-ins serve until the spot ones do
        else:
            assert {a.instance_id for a in drained} == returning, actions
            assert all(a.reason.startswith("spot_return:") for a in drained), actions


def _small_for_large(
    large: int, stand_ins: list[InstanceRecord], shares: dict[str, float], *, budget: float = 1.0
) -> list[Action]:
    """The reconciler's actions for a plan of ``large`` large on spot whose fall has held, served
    by ``stand_ins`` of small (on demand) with their ``shares`` of a large one."""
    return run(
        {"large": large},
        stand_ins,
        budget=budget,
        desired_spot={"large": large},
        spot_prices_usd_per_hr={"small": 0.015, "large": 0.03},
        stand_ins={r.id: "large" for r in stand_ins},
        stand_in_shares=shares,
        spot_fallen={"large"},
    )


def test_k_smaller_stand_ins_for_one_go_back_together_as_one() -> None:
    # The plan {large: 1} on spot, served by four small ones on demand, a quarter each.
    stand_ins = _stand_ins("small", 4, age_s=900.0)
    actions = _small_for_large(1, stand_ins, {r.id: 0.25 for r in stand_ins}, budget=0.3)
    returned = [a for a in actions if isinstance(a, SpotReturned)]
    assert [(a.count, set(a.instance_ids)) for a in returned] == [(1, {r.id for r in stand_ins})], (
        actions
    )
    launched = [a for a in actions if isinstance(a, Launch)]
    assert [(a.instance_type, a.market) for a in launched] == [("large", "spot")], actions
    assert not _gone(actions), actions


def test_stand_ins_stay_where_the_budget_does_not_pay_for_both() -> None:
    # The same three large stand-ins (0.3 on demand): under a budget of 0.314 a spot small one
    # (0.015) next to one of them is over it, and a gap (break then make) is worse than their
    # price: they stay. Under 0.315 the budget pays for one next to them: one goes back. None
    # does while small's launches fail for want of capacity (the back-off).
    stand_ins = _stand_ins("large", 3, age_s=900.0)
    for budget, failing, back in ((0.314, (), 0), (0.315, (), 1), (0.4, ("small",), 0)):
        actions = run(
            {"small": 3},
            stand_ins,
            budget=budget,
            desired_spot={"small": 3},
            spot_prices_usd_per_hr=SPOT,
            stand_ins={r.id: "small" for r in stand_ins},
            spot_fallen={"small"},
            spot_failing=failing,
        )
        returned = [a for a in actions if isinstance(a, SpotReturned)]
        assert [a.instance_ids for a in returned] == [(stand_ins[0].id,)] * back, actions
        launched = [a for a in actions if isinstance(a, Launch)]
        assert [(a.instance_type, a.market) for a in launched] == [("small", "spot")] * back
        assert not _gone(actions), actions


def test_a_returning_stand_in_drains_not_ended_in_the_tick_it_drains() -> None:
    # A large stand-in for small, returning, beside its small spot replacement that serves: it
    # drains (rule 9 ends it after drain_s), and is not also terminated in the same tick (its
    # state read after the drain mark took it for one that serves nothing: the queries it
    # held were cut).
    stand_in = row("large", age_s=900.0)
    actions = run(
        {"small": 1},
        [stand_in, spot_row("small", age_s=30.0)],
        desired_spot={"small": 1},
        spot_prices_usd_per_hr=SPOT,
        stand_ins={stand_in.id: "small"},
        spot_fallen={"small"},
        spot_returning={stand_in.id},
    )
    drained = _drained(actions)
    assert [a.instance_id for a in drained] == [stand_in.id], actions
    assert not [a for a in actions if isinstance(a, Terminate)], actions


def test_a_profile_worker_is_not_the_replacement_that_serves() -> None:
    # {small: 1} on spot, its only instance returning (a large stand-in, or its own on-demand
    # one) beside a small spot replacement still booting, and a profile run's small worker
    # next to the fleet: that worker serves no query, so the returning row serves on (else the
    # stage was left with nothing serving until the replacement booted).
    stand_in, own = row("large", age_s=900.0), row("small", age_s=900.0)
    booting = dataclasses.replace(spot_row("small", age_s=30.0), state="pending")
    worker = profile_row("small", age_s=20.0)
    for returning, standing in ((stand_in, {stand_in.id: "small"}), (own, {})):
        actions = run(
            {"small": 1},
            [returning, booting, worker],
            desired_spot={"small": 1},
            spot_prices_usd_per_hr=SPOT,
            stand_ins=standing,
            spot_fallen={"small"},
            spot_returning={returning.id},
        )
        assert returning.id not in _gone(actions), actions


def test_two_sets_of_smaller_stand_ins_launched_in_one_tick_go_back_as_their_sets() -> None:
    # {large: 2} on spot, moved in one tick (one created_at) to two small ones (a half each,
    # launches 9 and 10) and three small ones (a third each, 11 to 13). Grouped by the request
    # id as text ("-10" before "-9"), 10, 11 and 12 went back as one (7/6 of a large one) and
    # two large ones were launched for it; each set goes back as itself.
    ids = (9, 10, 11, 12, 13)
    stand_ins = [row("small", age_s=900.0, request_id=f"{PREFIX}-{n}") for n in ids]
    shares = {r.id: 0.5 if n < 11 else 1 / 3 for r, n in zip(stand_ins, ids, strict=True)}
    actions = _small_for_large(2, stand_ins, shares)
    returned = [set(a.instance_ids) for a in actions if isinstance(a, SpotReturned)]
    assert returned == [{r.id for r in stand_ins[:2]}, {r.id for r in stand_ins[2:]}], actions
    launched = [a for a in actions if isinstance(a, Launch)]
    assert [(a.instance_type, a.market) for a in launched] == [("large", "spot")] * 2, actions


def test_what_is_left_of_a_set_of_smaller_stand_ins_goes_back_with_none_of_another() -> None:
    # {large: 2} on spot: of two small ones standing in for one (a half each) one is gone; three
    # small ones (a third each) stand in for the other. The three go back as one; the half left
    # is not made one with two of the thirds (7/6 of a large one).
    half = row("small", age_s=900.0)
    thirds = [row("small", age_s=800.0) for _ in range(3)]
    actions = _small_for_large(2, [half, *thirds], {half.id: 0.5} | {r.id: 1 / 3 for r in thirds})
    returned = [set(a.instance_ids) for a in actions if isinstance(a, SpotReturned)]
    assert returned == [{r.id for r in thirds}], actions


def test_sets_of_smaller_stand_ins_launched_in_one_tick_pair_by_launch_number() -> None:
    # {large: 2} on spot, moved in one tick (one created_at) to two pairs of small ones, a half
    # each: launches 9 and 10 serve, 11 and 12 still boot. The pair that serves goes back (9
    # and 10), not 10 and 11 ("-10" sorting before "-9" as text paired across the sets).
    ids = (9, 10, 11, 12)
    stand_ins = [
        row("small", "running" if n < 11 else "pending", age_s=300.0, request_id=f"{PREFIX}-{n}")
        for n in ids
    ]
    actions = _small_for_large(2, stand_ins, {r.id: 0.5 for r in stand_ins})
    returned = [set(a.instance_ids) for a in actions if isinstance(a, SpotReturned)]
    assert returned == [{r.id for r in stand_ins[:2]}], actions
