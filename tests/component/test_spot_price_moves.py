"""Rule 10 of the reconciler when spot prices move (docs/spot.md, "Launching by purchase option,
and the cap when prices move"), on a real store (SQLite through the migrations), the fake
provisioner and a fake clock: a rise into the headroom below the budget moves the risen spot
capacity before the budget is breached, to the cheapest choice that serves as much (another
type on spot, or on demand); and over random price paths, with interruption notices draining
instances meanwhile, the fleet's cost at the prices now never exceeds the budget after a tick."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.errors import DatabaseError
from controlplane.loops.reconciler import AppPricing, Launch, Reconciler, Terminate
from controlplane.policies.lifecycle import billed_cost_usd_per_hr
from tests.component.test_reconciler_fake import APP, LARGE, PRICES, QPS, SMALL, template_db
from tests.component.test_spot_interruptions import (
    World,
    apply_spot_plan,
    assert_a_restart_changes_nothing,
    kept_types,
    launches,
)
from tests.dying_writes import decision_write_fails

__all__ = ["template_db"]  # the fixture, imported for pytest

_LIVE = ("requested", "pending", "running", "draining")


class PricedWorld(World):
    """One app on the fake provisioner whose spot prices (and on-demand prices) the test
    moves; :meth:`tick` checks the hard cap at the prices now after every tick (not at the
    prices the instances were launched at: those may be above the prices now)."""

    def __init__(
        self,
        template: Path,
        directory: Path,
        budget: float,
        spot_prices: dict[str, float],
        prices: dict[str, float] | None = None,
        headroom_share: float = 0.1,
    ) -> None:
        super().__init__(template, directory, budget)
        self.spot_prices = spot_prices
        self.prices = dict(PRICES if prices is None else prices)
        self.reconciler.pricing = lambda _app: AppPricing(
            self.prices, QPS, spot_prices_usd_per_hr=self.spot_prices
        )
        self.reconciler.spot_headroom_share = headroom_share
        self.worst_usd_per_hr = 0.0

    def tick(self, seconds: float = 5.0) -> list[object]:
        self.clock.advance(seconds)
        self.fake.step()
        actions: list[object] = list(self.reconciler.run_once().apps[APP].actions)
        cost = self.cost_now()
        self.worst_usd_per_hr = max(self.worst_usd_per_hr, cost)
        assert cost <= self.budget + 1e-9, (cost, self.spot_prices, actions)
        # What the views read (the fleet route, the dashboard, /metrics, the roll-up): every
        # live spot row at its type's spot price now, its launch price kept beside it.
        for row in self.store.list_instances(APP, states=list(_LIVE)):
            if row.market == "spot":
                assert abs(row.cost_usd_per_hr - self.spot_prices[row.instance_type]) <= 1e-9
        return actions

    def cost_now(self) -> float:
        """The live fleet (draining included) at the prices now: spot rows at the spot price
        now, on-demand rows at the on-demand price."""
        return sum(
            self.spot_prices[r.instance_type]
            if r.market == "spot"
            else self.prices[r.instance_type]
            for r in self.store.list_instances(APP, states=list(_LIVE))
        )

    def serve_three_small_on_spot(self) -> None:
        """Apply a plan of three small instances, all on spot, and let them launch and run."""
        apply_spot_plan(self.store, {SMALL: 3}, {SMALL: 3})
        for _ in range(3):
            self.tick()
        assert self.kept() == [(SMALL, "spot")] * 3

    def kept(self) -> list[tuple[str, str]]:
        return kept_types(self)

    def close(self) -> None:
        self.store.close()


def _stand_in_world(template_db: Path, tmp_path: Path) -> PricedWorld:
    """Small at 0.015 and large at 0.03 on spot, under a budget of 0.2, half of it the headroom."""
    return PricedWorld(template_db, tmp_path, 0.2, {SMALL: 0.015, LARGE: 0.03}, headroom_share=0.5)


def _small_risen_past_large(world: PricedWorld) -> None:
    """Three small ones on spot whose price rises from 0.015 to 0.035: three large ones on spot
    (0.03 each: as much capacity for less) are launched in their stead."""
    world.serve_three_small_on_spot()
    world.spot_prices[SMALL] = 0.035
    assert launches(world.tick()) == [(LARGE, "spot", SMALL)] * 3


def test_a_rise_into_the_headroom_moves_capacity_before_the_budget_is_breached(
    template_db: Path, tmp_path: Path
) -> None:
    # Three small ones on spot; the move starts at 0.09 USD/hr (a tenth below the budget).
    spot_prices = {SMALL: 0.015, LARGE: 0.03}
    world = PricedWorld(template_db, tmp_path, 0.1, spot_prices)
    try:
        world.serve_three_small_on_spot()

        # A rise that stays short of the headroom (3 x 0.025 = 0.075) moves nothing.
        spot_prices[SMALL] = 0.025
        assert not launches(world.tick())

        # Into the headroom (3 x 0.031 = 0.093, within the budget): the small ones move to large
        # ones on spot (0.03 each: as much capacity for less) before any breach.
        spot_prices[SMALL] = 0.031
        actions = world.tick()
        assert launches(actions) == [(LARGE, "spot", SMALL)] * 3
        decision = world.store.list_decisions(APP, kinds=["spot_price"])[-1]
        assert "less its headroom" in decision.reason and "before the budget" in decision.reason
        assert decision.numbers["threshold_usd_per_hr"] == 0.09
        (moved,) = world.store.list_decisions(APP, kinds=["terminate"])
        assert moved.numbers["cause"] == "spot_price" and "less its headroom" in moved.reason

        # The rise goes on past the budget: nothing of the risen type is left to pay for.
        spot_prices[SMALL] = 0.05
        for _ in range(4):
            assert not launches(world.tick())
        assert world.kept() == [(LARGE, "spot")] * 3
        assert world.worst_usd_per_hr <= 0.093 + 1e-9  # never past what the headroom allowed
    finally:
        world.close()


def test_where_the_budget_pays_for_both_the_move_is_made_before_the_risen_ones_go(
    template_db: Path, tmp_path: Path
) -> None:
    # The move starts at 0.1 USD/hr (half the budget of 0.2), with room to launch three large
    # ones on spot (0.09) next to the three risen small ones (0.105).
    world = _stand_in_world(template_db, tmp_path)
    try:
        _small_risen_past_large(world)

        assert len(world.store.list_instances(APP, states=["running"])) == 3  # they serve on
        assert not world.store.list_decisions(APP, kinds=["terminate"])
        for _ in range(6):
            world.tick()
            # Never less serving than the plan's three: the small ones drain once the large
            # ones serve.
            assert len(world.store.list_instances(APP, states=["running"])) >= 3
        assert world.kept() == [(LARGE, "spot")] * 3
        running = world.store.list_instances(APP, states=["running"])
        assert sorted(r.instance_type for r in running) == [LARGE] * 3
        ended = world.store.list_instances(APP, states=["terminating", "terminated"])
        assert sorted(r.instance_type for r in ended) == [SMALL] * 3
    finally:
        world.close()


def test_without_headroom_the_same_rise_moves_nothing_and_its_price_now_is_what_they_cost(
    template_db: Path, tmp_path: Path
) -> None:
    spot_prices = {SMALL: 0.015, LARGE: 0.03}
    world = PricedWorld(template_db, tmp_path, 0.1, spot_prices, headroom_share=0.0)
    try:
        world.serve_three_small_on_spot()
        rows = world.store.list_instances(APP, states=["running"])
        assert all(r.price_now_usd_per_hr is None for r in rows)
        spot_prices[SMALL] = 0.031
        assert not launches(world.tick())
        assert world.kept() == [(SMALL, "spot")] * 3
        # Nothing moved, the cost did: the price now recorded beside the launch price...
        rows = world.store.list_instances(APP, states=["running"])
        assert [(r.price_usd_per_hr, r.price_now_usd_per_hr) for r in rows] == [(0.015, 0.031)] * 3
        assert billed_cost_usd_per_hr(rows) == pytest.approx(0.093)
        # ... and cleared when the price is back at the launch price.
        spot_prices[SMALL] = 0.015
        world.tick()
        rows = world.store.list_instances(APP, states=["running"])
        assert [(r.price_usd_per_hr, r.price_now_usd_per_hr) for r in rows] == [(0.015, None)] * 3
    finally:
        world.close()


def test_a_rise_moves_capacity_on_demand_where_that_is_the_cheapest_choice(
    template_db: Path, tmp_path: Path
) -> None:
    # The large type is not sold on spot here, and on demand (0.04) it costs less than a small
    # one on spot once the small one's price rises to 0.045: the move goes on demand.
    spot_prices = {SMALL: 0.015}
    prices = {SMALL: 0.05, LARGE: 0.04}
    world = PricedWorld(template_db, tmp_path, 0.13, spot_prices, prices=prices)
    try:
        world.serve_three_small_on_spot()
        spot_prices[SMALL] = 0.045  # 3 x 0.045 = 0.135: over the budget

        actions = world.tick()

        assert launches(actions) == [(LARGE, "on-demand", SMALL)] * 3
        reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["stand_in"])]
        assert "on demand at 0.04 USD/hr serves as much for less" in reasons[0]
        for _ in range(3):
            world.tick()
        assert world.kept() == [(LARGE, "on-demand")] * 3
    finally:
        world.close()


# --- the hard cap over random price paths -------------------------------------------------------

_PRICE = st.sampled_from([0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05])
_STEP = st.tuples(_PRICE, _PRICE.map(lambda p: 2 * p), st.booleans())


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    budget=st.sampled_from([0.08, 0.12, 0.2]),
    headroom=st.sampled_from([0.0, 0.1, 0.3]),
    path=st.lists(_STEP, min_size=4, max_size=8),
)
def test_the_cap_holds_at_every_tick_over_random_spot_price_paths(
    template_db: Path, budget: float, headroom: float, path: list[tuple[float, float, bool]]
) -> None:
    spot_prices = {SMALL: 0.015, LARGE: 0.03}
    with tempfile.TemporaryDirectory() as directory:
        world = PricedWorld(
            template_db, Path(directory), budget, spot_prices, headroom_share=headroom
        )
        try:
            apply_spot_plan(world.store, {SMALL: 2, LARGE: 2}, {SMALL: 2, LARGE: 1})
            for _ in range(3):
                world.tick()
            for small, large, notice in path:
                spot_prices[SMALL], spot_prices[LARGE] = small, large
                if notice:  # an interruption notice too: its instance drains meanwhile
                    running = world.store.list_instances(APP, states=["running"])
                    spot = [r.provider_id for r in running if r.market == "spot"]
                    if spot and spot[0] is not None:
                        world.fake.interrupt(spot[0], 60.0)
                world.tick()  # checks the cap at the prices now
        finally:
            world.close()


def test_a_rise_moves_one_large_instance_to_smaller_ones_that_together_serve_as_much(
    template_db: Path, tmp_path: Path
) -> None:
    # A large one serves four times a small one (Q_t 40 and 10): when the large one's spot price
    # rises to 0.06, four small ones on spot at 0.01 (0.04 in all) serve as much for less.
    spot_prices = {SMALL: 0.01, LARGE: 0.03}
    world = PricedWorld(template_db, tmp_path, 0.065, spot_prices)
    try:
        apply_spot_plan(world.store, {LARGE: 1}, {LARGE: 1})
        for _ in range(3):
            world.tick()
        spot_prices[LARGE] = 0.06

        actions = world.tick()

        assert launches(actions) == [(SMALL, "spot", LARGE)] * 4
        shares = [a.share for a in actions if isinstance(a, Launch)]
        assert shares == [0.25] * 4
        (decision, *_) = world.store.list_decisions(APP, kinds=["stand_in"])
        assert "4 x emu.cpu.small on spot at 0.01 USD/hr each serve as much" in decision.reason
        assert decision.numbers["share"] == 0.25
        # The four count as the one large instance the plan wants: nothing more, nothing less.
        for _ in range(4):
            assert not launches(world.tick())
        assert world.kept() == [(SMALL, "spot")] * 4
        # Read back after a restart, too.
        assert_a_restart_changes_nothing(world)
    finally:
        world.close()


@pytest.mark.parametrize(
    ("budget", "headroom", "before_break"), [(0.19, 0.1, False), (0.35, 0.5, True)]
)
def test_a_spot_price_risen_past_its_own_on_demand_price_moves_that_type_on_demand(
    template_db: Path, tmp_path: Path, budget: float, headroom: float, before_break: bool
) -> None:
    # The large type costs far more on spot and on demand than a small one: no other type is
    # a cheaper choice. The small one's spot price rises to 0.06, past its own on-demand price
    # (0.05), and the fleet (0.18) past the budget less its headroom: the same type on demand
    # serves exactly as much for less. (A tester's sweep saw the three stay on spot, paying
    # 0.06 for what costs 0.05 on demand, every tick's decision saying that they "move to
    # cheaper choices"; a further rise to 0.07 then drained one, capacity lost, where three on
    # demand fitted the budget.)
    spot_prices = {SMALL: 0.015, LARGE: 0.5}
    prices = {SMALL: 0.05, LARGE: 1.0}
    world = PricedWorld(
        template_db, tmp_path, budget, spot_prices, prices=prices, headroom_share=headroom
    )
    try:
        world.serve_three_small_on_spot()
        spot_prices[SMALL] = 0.06

        actions = world.tick()

        assert launches(actions) == [(SMALL, "on-demand", None)] * 3
        for _ in range(6):
            world.tick()  # the cap at the prices now, every tick
            if before_break:  # made before the risen ones go: never fewer than three serving
                assert len(world.store.list_instances(APP, states=["running"])) >= 3
        assert world.kept() == [(SMALL, "on-demand")] * 3
        assert world.cost_now() == pytest.approx(0.15)
        if not before_break:  # the move's decision, in words ("on on demand" before)
            (moved,) = world.store.list_decisions(APP, kinds=["terminate"])
            assert moved.numbers["cause"] == "spot_price"
            assert "1 x emu.cpu.small on demand at 0.05 USD/hr" in moved.reason, moved.reason
        # A further rise changes nothing: nothing is left on spot to pay it.
        spot_prices[SMALL] = 0.07
        assert not launches(world.tick())
        assert world.kept() == [(SMALL, "on-demand")] * 3
    finally:
        world.close()


def test_a_spot_price_decision_says_a_move_only_where_the_tick_moves_capacity(
    template_db: Path, tmp_path: Path
) -> None:
    # Three small ones on spot. Their spot price rises to 0.045: the fleet (0.135) is past the
    # budget of 0.14 less its headroom (0.126), but no choice serves as much for less (a large
    # one costs 0.2 on spot, a small one 0.05 on demand): nothing moves, and the decision says
    # so. (A tester's sweep saw every such tick's decision say that the risen capacity "moves to
    # cheaper choices before the budget is breached" while nothing moved.)
    spot_prices = {SMALL: 0.015, LARGE: 0.2}
    prices = {SMALL: 0.05, LARGE: 0.4}
    world = PricedWorld(template_db, tmp_path, 0.14, spot_prices, prices=prices)
    try:
        world.serve_three_small_on_spot()
        spot_prices[SMALL] = 0.045
        assert not launches(world.tick())
        assert world.kept() == [(SMALL, "spot")] * 3
        decision = world.store.list_decisions(APP, kinds=["spot_price"])[-1]
        assert "less its headroom" in decision.reason
        assert "move to cheaper choices" not in decision.reason, decision.reason
        assert "no choice of the plan's ranking serves as much for less" in decision.reason
        assert decision.numbers["moved"] == 0

        # The large type's spot price falls to 0.03: the next tick moves the three, and says so.
        spot_prices[LARGE] = 0.03
        assert launches(world.tick()) == [(LARGE, "spot", SMALL)] * 3
        decision = world.store.list_decisions(APP, kinds=["spot_price"])[-1]
        assert "3 of them move to cheaper choices before the budget" in decision.reason
        assert decision.numbers["moved"] == 3
    finally:
        world.close()


def test_a_budget_cap_says_the_price_and_market_of_what_it_did_not_launch(
    template_db: Path, tmp_path: Path
) -> None:
    # The plan: three large ones, two on spot (0.03 each) and one on demand (0.1). The budget
    # of 0.12 pays for the two on spot (0.06), not the one on demand next to them: the cap's
    # decision says what that launch would have cost, on which market. (A tester's sweep read
    # "1 x emu.cpu.large (the fleet already costs 0.210 USD/hr)" under a budget of 0.3, with
    # large ones at 0.03 on spot: room for one, it seemed; the one capped was on demand.)
    spot_prices = {SMALL: 0.015, LARGE: 0.03}
    world = PricedWorld(template_db, tmp_path, 0.12, spot_prices)
    try:
        apply_spot_plan(world.store, {LARGE: 3}, {LARGE: 2})
        for _ in range(3):
            world.tick()
        assert world.kept() == [(LARGE, "spot")] * 2
        (capped,) = world.store.list_decisions(APP, kinds=["budget_capped"])
        assert "1 x emu.cpu.large (on demand at 0.1 USD/hr)" in capped.reason, capped.reason
        assert "the fleet already costs 0.060 USD/hr" in capped.reason
    finally:
        world.close()


# --- back to spot once the price has fallen -----------------------------------------------------

_HOLD_S = 30.0  # the tests' spot_return_hold_s: six ticks of 5 s


def _risen_on_demand_then_fallen(world: PricedWorld) -> None:
    """Three small ones on spot at 0.015 whose price rises to 0.06 (past its own on-demand
    price, 0.05): they move on demand; then the price falls back to 0.015."""
    world.reconciler.spot_return_hold_s = _HOLD_S
    world.serve_three_small_on_spot()
    world.spot_prices[SMALL] = 0.06
    for _ in range(6):
        world.tick()
    assert world.kept() == [(SMALL, "on-demand")] * 3
    world.spot_prices[SMALL] = 0.015


def _fall_world(template_db: Path, tmp_path: Path) -> PricedWorld:
    """Small at 0.015 on spot (0.05 on demand), large out of reach, under a budget of 0.35 that
    pays for a move back made before the break, half a price as the headroom."""
    prices = {SMALL: 0.05, LARGE: 1.0}
    return PricedWorld(template_db, tmp_path, 0.35, {SMALL: 0.015, LARGE: 0.5}, prices, 0.5)


def _new_leader(world: PricedWorld) -> None:
    """A restart: a reconciler started afresh on ``world``, set as the tests set the first (half a
    price as the headroom, the hold of :data:`_HOLD_S`); it reads the rest back from the store."""
    world.reconciler = Reconciler(world.store, world.fake, world.clock, world.reconciler.pricing)
    world.reconciler.spot_headroom_share = 0.5
    world.reconciler.spot_return_hold_s = _HOLD_S


def _restarted_while_moving_back(world: PricedWorld) -> None:
    """Three small ones risen on demand and fallen back (:func:`_risen_on_demand_then_fallen`),
    ticked until the move back has begun (its first spot_return decision), then a new leader."""
    _risen_on_demand_then_fallen(world)
    while not world.store.list_decisions(APP, kinds=["spot_return"]):
        world.tick()
    _new_leader(world)


def _assert_the_move_back_goes_on(world: PricedWorld) -> None:
    """Sixty ticks in which nothing is ended as a surplus (a scale-down) and never fewer than
    three serve."""
    for _ in range(60):
        actions = world.tick()
        ended = [a for a in actions if isinstance(a, Terminate)]
        assert not [a for a in ended if a.cause == "scale_down"], ended
        assert len(world.store.list_instances(APP, states=["running"])) >= 3


@pytest.mark.parametrize(
    ("budget", "headroom", "before_break"), [(0.16, 0.1, False), (0.35, 0.5, True)]
)
def test_a_fall_after_a_rise_moves_the_fleet_back_to_spot(
    template_db: Path, tmp_path: Path, budget: float, headroom: float, before_break: bool
) -> None:
    # A tester's sweep: after a rise had moved the plan's spot instances on demand, a fall
    # moved nothing back, and the app paid the on-demand price for good after a transient
    # spike. Under the budget of 0.16 the three on demand (0.15) leave no room for a spot one
    # next to them (0.015): one goes before its spot replacement is launched (break then
    # make), the others move while the room allows; under 0.35 each spot one is launched next
    # to the one it replaces (make before break: never fewer than three serving).
    prices = {SMALL: 0.05, LARGE: 1.0}
    world = PricedWorld(template_db, tmp_path, budget, {SMALL: 0.015, LARGE: 0.5}, prices, headroom)
    try:
        _risen_on_demand_then_fallen(world)
        # The fall must hold for spot_return_hold_s before anything moves.
        for _ in range(int(_HOLD_S // 5) - 1):
            assert not launches(world.tick())
        # The on-demand ones drain one per window of the disruption budget (60 s: 12 ticks).
        for _ in range(60):
            world.tick()  # the cap at the prices now, every tick
            if before_break:
                assert len(world.store.list_instances(APP, states=["running"])) >= 3
        assert world.kept() == [(SMALL, "spot")] * 3
        assert world.cost_now() == pytest.approx(0.045)
        moves = world.store.list_decisions(APP, kinds=["spot_return"])
        assert sum(d.numbers["count"] for d in moves) == 3
        assert {d.numbers["how"] for d in moves} >= (
            {"make_before_break"} if before_break else {"break_then_make"}
        )
        assert all(d.numbers["spot_usd_per_hr"] == 0.015 for d in moves)
        assert all(d.numbers["on_demand_usd_per_hr"] == 0.05 for d in moves)
        assert "fell to 0.015 USD/hr" in moves[0].reason, moves[0].reason
    finally:
        world.close()


def test_a_fall_that_does_not_hold_moves_nothing_back(template_db: Path, tmp_path: Path) -> None:
    # The price falls for less than the hold, rises back to 0.06 and falls again, over and
    # over: the fleet stays on demand (no flapping), then moves once a fall holds.
    world = _fall_world(template_db, tmp_path)
    try:
        _risen_on_demand_then_fallen(world)
        for _ in range(4):
            for _ in range(int(_HOLD_S // 5) - 1):
                assert not launches(world.tick())
            world.spot_prices[SMALL] = 0.06
            assert not launches(world.tick())
            world.spot_prices[SMALL] = 0.015
        assert world.kept() == [(SMALL, "on-demand")] * 3
        # A fall to just under the on-demand price, within the margin (the headroom share of
        # it), is no reason to move either.
        world.spot_prices[SMALL] = 0.049
        for _ in range(20):
            assert not launches(world.tick())
        assert world.kept() == [(SMALL, "on-demand")] * 3
    finally:
        world.close()


@pytest.mark.parametrize(("budget", "headroom", "moves"), [(0.055, 0.1, False), (0.07, 0.5, True)])
def test_a_stage_of_one_instance_is_not_broken_to_move_it_back(
    template_db: Path, tmp_path: Path, budget: float, headroom: float, moves: bool
) -> None:
    # One small one on demand after the rise, under a budget that pays for it alone (0.055):
    # break then make would leave the stage serving nothing while the spot one boots, so it
    # stays on demand; with room for both (0.07) it moves, made before the break.
    prices = {SMALL: 0.05, LARGE: 1.0}
    world = PricedWorld(template_db, tmp_path, budget, {SMALL: 0.015, LARGE: 0.5}, prices, headroom)
    try:
        world.reconciler.spot_return_hold_s = _HOLD_S
        apply_spot_plan(world.store, {SMALL: 1}, {SMALL: 1})
        for _ in range(3):
            world.tick()
        world.spot_prices[SMALL] = 0.06
        for _ in range(6):
            world.tick()
        assert world.kept() == [(SMALL, "on-demand")]
        world.spot_prices[SMALL] = 0.015
        for _ in range(40):
            world.tick()
            assert world.store.list_instances(APP, states=["running"])
        assert world.kept() == [(SMALL, "spot" if moves else "on-demand")]
    finally:
        world.close()


_SMALL_PRICE = st.sampled_from([0.005, 0.015, 0.03, 0.045, 0.06, 0.07])


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    budget=st.sampled_from([0.16, 0.2, 0.35]),
    headroom=st.sampled_from([0.0, 0.1, 0.5]),
    on_demand_base=st.booleans(),
    path=st.lists(
        st.tuples(_SMALL_PRICE, st.booleans(), st.integers(1, 10)), min_size=4, max_size=8
    ),
)
def test_the_cap_holds_at_every_tick_while_prices_rise_and_fall_back(
    template_db: Path,
    budget: float,
    headroom: float,
    on_demand_base: bool,
    path: list[tuple[float, bool, int]],
) -> None:
    # Small ones the plan buys on spot (one more on demand with ``on_demand_base``), the large
    # type too dear to stand in: rises past 0.05 move them on demand, falls move them back
    # (a short hold, 5 s), each price held for some ticks, notices draining instances meanwhile;
    # the cost at the prices now within the budget after every tick.
    spot_prices = {SMALL: 0.015, LARGE: 0.5}
    prices = {SMALL: 0.05, LARGE: 1.0}
    with tempfile.TemporaryDirectory() as directory:
        world = PricedWorld(
            template_db, Path(directory), budget, spot_prices, prices, headroom_share=headroom
        )
        world.reconciler.spot_return_hold_s = 5.0
        try:
            apply_spot_plan(world.store, {SMALL: 3 + on_demand_base}, {SMALL: 3})
            for _ in range(3):
                world.tick()
            for small, notice, ticks in path:
                spot_prices[SMALL] = small
                if notice:
                    running = world.store.list_instances(APP, states=["running"])
                    spot = [r.provider_id for r in running if r.market == "spot"]
                    if spot and spot[0] is not None:
                        world.fake.interrupt(spot[0], 60.0)
                for _ in range(ticks):
                    world.tick()  # checks the cap at the prices now
        finally:
            world.close()


def test_a_move_back_under_way_goes_on_after_a_restart(template_db: Path, tmp_path: Path) -> None:
    # The move back made before the break, a new leader midway: it reads which on-demand ones
    # are returning back from the spot_return decisions, so their spot replacements, past the
    # type's count until the on-demand ones drain, are not taken for a surplus and ended.
    world = _fall_world(template_db, tmp_path)
    try:
        _restarted_while_moving_back(world)
        _assert_the_move_back_goes_on(world)
        assert world.kept() == [(SMALL, "spot")] * 3
    finally:
        world.close()


def test_a_price_that_swings_back_gives_the_rise_replacements_back_only_through_the_hold(
    template_db: Path, tmp_path: Path
) -> None:
    # A review's finding: three small ones on spot whose price rises past the threshold for
    # one tick (0.06, past its own on-demand price of 0.05): the budget pays for both, so their
    # on-demand replacements are launched next to them; the next tick the price is back at
    # 0.015. The replacements were drained once they served, without the hold: the fall that
    # gives them back to spot must hold for spot_return_hold_s as any other.
    world = _fall_world(template_db, tmp_path)
    try:
        world.reconciler.spot_return_hold_s = _HOLD_S
        world.serve_three_small_on_spot()
        world.spot_prices[SMALL] = 0.06
        assert launches(world.tick()) == [(SMALL, "on-demand", None)] * 3
        world.spot_prices[SMALL] = 0.015
        fell_at = world.clock.now_s()
        world.tick()
        # A new leader reads which rows replaced spot ones back from the decisions.
        _new_leader(world)
        while world.clock.now_s() - fell_at < _HOLD_S:
            world.tick()
            on_demand = [
                r
                for r in world.store.list_instances(APP)
                if r.market == "on-demand" and r.instance_type == SMALL
            ]
            assert len(on_demand) == 3
            assert all(r.state in ("pending", "running") for r in on_demand), on_demand
        # Once the fall has held, they go back to spot, never fewer than three serving.
        for _ in range(40):
            world.tick()
            assert len(world.store.list_instances(APP, states=["running"])) >= 3
        assert world.kept() == [(SMALL, "spot")] * 3
        for row in on_demand:  # drained by the move back (its spot replacements serve)
            reasons = [e.reason for e in world.store.list_instance_events(instance_id=row.id)]
            assert any(r.startswith("spot_return:") for r in reasons), reasons
    finally:
        world.close()


def test_a_rise_whose_launch_decision_a_crash_lost_gives_them_back_only_through_the_hold(
    template_db: Path, tmp_path: Path
) -> None:
    # As above, but the process dies after the rise's on-demand rows and before their launch
    # decision (reconcile.after_row). The reconciler started again launched them as retries and
    # said them without replaces_spot: once the price swung back, it drained them as a surplus
    # (scale_down) as soon as they served, before the hold, the spot ones kept.
    world = _fall_world(template_db, tmp_path)
    try:
        world.reconciler.spot_return_hold_s = _HOLD_S
        world.serve_three_small_on_spot()
        world.spot_prices[SMALL] = 0.06
        with decision_write_fails("launch 3 x emu.cpu.small") as failing:
            with pytest.raises(RuntimeError, match="died writing"):
                world.tick()
            assert failing == []
        _new_leader(world)
        assert launches(world.tick()) == [(SMALL, "on-demand", None)] * 3  # launched again
        said = world.store.list_decisions(APP, kinds=["launch"])[-1].numbers["launches"]
        assert [x.get("replaces_spot") for x in said] == [True] * 3
        world.spot_prices[SMALL] = 0.015
        fell_at = world.clock.now_s()
        while world.clock.now_s() - fell_at < _HOLD_S:
            ended = [a for a in world.tick() if isinstance(a, Terminate)]
            assert not [a for a in ended if a.cause == "scale_down"], ended
            on_demand = [
                r
                for r in world.store.list_instances(APP)
                if r.market == "on-demand" and r.instance_type == SMALL
            ]
            assert len(on_demand) == 3
            assert all(r.state in ("pending", "running") for r in on_demand), on_demand
        for _ in range(40):
            world.tick()
            assert len(world.store.list_instances(APP, states=["running"])) >= 3
        assert world.kept() == [(SMALL, "spot")] * 3
        for row in on_demand:  # drained by the move back, once the fall held
            reasons = [e.reason for e in world.store.list_instance_events(instance_id=row.id)]
            assert any(r.startswith("spot_return:") for r in reasons), reasons
    finally:
        world.close()


def test_a_failed_read_after_a_restart_is_read_again(
    template_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The move back under way after a restart, as above, the new leader's first read of the
    # decisions failing (a database hiccup: that tick of the app fails, the next starts
    # afresh): the next tick reads them again, so the returning ones' spot replacements are
    # not taken for a surplus and ended.
    world = _fall_world(template_db, tmp_path)
    try:
        _restarted_while_moving_back(world)
        read = world.store.list_decisions
        failed: list[bool] = []

        def flaky(*args: object, **kwargs: object) -> object:
            if not failed and "spot_return" in (kwargs.get("kinds") or ()):  # type: ignore[operator]
                failed.append(True)
                raise DatabaseError("the database is not reachable")
            return read(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(world.store, "list_decisions", flaky)
        _assert_the_move_back_goes_on(world)
        assert failed
        assert world.kept() == [(SMALL, "spot")] * 3
    finally:
        world.close()


def test_stand_ins_of_another_type_go_back_to_spot_once_the_fall_holds(
    template_db: Path, tmp_path: Path
) -> None:
    # A transient spike: three small ones on spot at 0.015 rise to 0.035 and move to three large
    # ones on spot (0.03 each: as much for less), stand-ins of another type. Until 2026-12-06
    # they stayed until a new plan. Now, once small's fall (0.015, below 0.05 less half) has held,
    # small on spot is launched in each one's slot (room: 0.2 less 0.09), and the large ones
    # drain once those serve: never fewer than three serving, the cap at every tick, a new
    # leader midway included.
    world = _stand_in_world(template_db, tmp_path)
    world.reconciler.spot_return_hold_s = _HOLD_S
    try:
        _small_risen_past_large(world)
        for _ in range(6):
            world.tick()
        assert world.kept() == [(LARGE, "spot")] * 3
        world.spot_prices[SMALL] = 0.015
        for _ in range(int(_HOLD_S // 5) - 1):  # the fall must hold first
            assert not launches(world.tick())
        launched: list[tuple[str, str, str | None]] = []
        restarted = False
        for _ in range(60):  # one at a time, as the disruption budget's window lets them go
            actions = world.tick()
            launched += launches(actions)
            ended = [a for a in actions if isinstance(a, Terminate)]
            assert all(a.cause == "spot_return" for a in ended), ended
            assert len(world.store.list_instances(APP, states=["running"])) >= 3
            if launched and not restarted:  # a new leader reads the returning ones back
                _new_leader(world)
                restarted = True
        assert launched == [(SMALL, "spot", None)] * 3
        assert world.kept() == [(SMALL, "spot")] * 3
        assert world.cost_now() == pytest.approx(0.045)
        moves = world.store.list_decisions(APP, kinds=["spot_return"])
        assert [(d.numbers["count"], d.numbers["stand_in"]) for d in moves] == [(1, True)] * 3
        assert "fell to 0.015 USD/hr" in moves[0].reason, moves[0].reason
        ended_rows = world.store.list_instances(APP, states=["terminating", "terminated"])
        assert sorted(r.instance_type for r in ended_rows) == [LARGE] * 3 + [SMALL] * 3
        assert world.reconciler.held_back(APP).stand_ins == {}
    finally:
        world.close()
