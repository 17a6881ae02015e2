"""Rule 9 of the reconciler (docs/spot.md, "Acting on a notice") on a real store (SQLite through
the migrations), the fake provisioner's interruption knob and a fake clock, tick by tick: a
notice drains the doomed instance, launches its replacement in the same tick, terminates the
doomed one before its deadline, and never pays past the budget; and rule 10: a plan's spot_fleet
launched on spot, and the budget cap held when spot prices rise mid-run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.api.routes.fleet import instance_out
from controlplane.apps import teardown
from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.loops.reconciler import (
    DEFAULT_LAUNCH_BACKOFF_S,
    AppPricing,
    InterruptionHandled,
    Launch,
    Reconciler,
    SpotRepriced,
)
from provisioners.fake import FakeProvisioner
from provisioners.interruptions import MARKET_TAG
from tests.component.test_reconciler_fake import (
    APP,
    LARGE,
    PRICES,
    SMALL,
    apply_fleet,
    pricing,
    spec,
    template_db,
)
from tests.dying_writes import decision_write_fails

__all__ = ["template_db"]  # the fixture, imported for pytest

DRAIN_S, MARGIN_S, NOTICE_S = 10.0, 15.0, 120.0
_LIVE = ("requested", "pending", "running", "draining")


class World:
    def __init__(self, template: Path, directory: Path, budget: float) -> None:
        path = directory / "heteroplane.db"
        shutil.copy(template, path)
        self.clock = FakeClock()
        self.fake = FakeProvisioner(now=self.clock.utcnow)
        self.store = Store.from_url(f"sqlite:///{path}", self.clock)
        self.store.create_app(spec(budget), who="test")
        self.reconciler = Reconciler(
            self.store,
            self.fake,
            self.clock,
            pricing,
            interruption_drain_s=DRAIN_S,
            interruption_margin_s=MARGIN_S,
        )
        self.budget = budget
        self.spot_prices: dict[str, float] = {}

    def tick(self, seconds: float = 5.0) -> list[object]:
        self.clock.advance(seconds)
        self.fake.step()
        report = self.reconciler.run_once()
        # The hard cap, after every tick: what is live (draining included) fits the budget.
        assert self.live_cost() <= self.budget + 1e-9
        return list(report.apps[APP].actions)

    def live_cost(self) -> float:
        return sum(i.price_usd_per_hr for i in self.store.list_instances(APP, states=_LIVE))

    def price_spot(self, spot_prices: dict[str, float]) -> None:
        """Price the app with ``spot_prices`` (the test changes the dict to move them), Q_t of a
        large four times a small's."""
        self.spot_prices = spot_prices
        self.reconciler.pricing = lambda _app: AppPricing(
            PRICES, {SMALL: 10.0, LARGE: 40.0}, spot_prices_usd_per_hr=spot_prices
        )

    def cost_now(self) -> float:
        """What the live fleet costs at the spot prices now (spot rows), else as launched."""
        live = self.store.list_instances(APP, states=list(_LIVE))
        return sum(
            self.spot_prices[r.instance_type] if r.market == "spot" else r.price_usd_per_hr
            for r in live
        )

    def rows(self, state: str) -> list[str]:
        return [i.provider_id or "" for i in self.store.list_instances(APP, states=[state])]

    def serve(self, fleet: dict[str, int]) -> None:
        apply_fleet(self.store, fleet)
        for _ in range(3):
            self.tick()
        assert len(self.rows("running")) == sum(fleet.values())


@pytest.fixture
def roomy(template_db: Path, tmp_path: Path) -> Iterator[World]:
    world = World(template_db, tmp_path, budget=1.0)
    yield world
    world.store.close()


def test_a_notice_replaces_at_once_drains_and_terminates_before_the_deadline(
    roomy: World,
) -> None:
    roomy.serve({SMALL: 2})
    doomed = roomy.rows("running")[0]
    notice = roomy.fake.interrupt(doomed, NOTICE_S)

    actions = roomy.tick(1.0)

    handled = [a for a in actions if isinstance(a, InterruptionHandled)]
    assert [a.provider_id for a in handled] == [doomed]
    # The replacement is launched at once; the doomed one serves on until it serves.
    assert [a.instance_type for a in actions if isinstance(a, Launch)] == [SMALL]
    assert doomed in roomy.rows("running")
    (decision,) = roomy.store.list_decisions(APP, kinds=["spot_interruption"])
    assert decision.numbers["provider_id"] == doomed
    assert "spot interruption warning" in decision.reason

    seen: list[object] = []
    while doomed in roomy.rows("running"):
        seen += roomy.tick(1.0)
    # It leaves the serving set (draining) once its replacement serves: two serve throughout.
    assert doomed in roomy.rows("draining")
    assert len(roomy.rows("running")) == 2
    terminated_at = None
    while terminated_at is None:
        seen += roomy.tick(1.0)
        if doomed not in roomy.rows("draining"):
            terminated_at = roomy.clock.utcnow()
    assert (notice.deadline - terminated_at).total_seconds() >= MARGIN_S
    for _ in range(3):
        seen += roomy.tick(1.0)
    assert not [a for a in seen if isinstance(a, InterruptionHandled)]  # acted on once
    row = {i.provider_id: i for i in roomy.store.list_instances(APP)}[doomed]
    assert row.state == "terminated"  # terminated by us, not lost (failed)
    assert len(roomy.rows("running")) == 2


def test_a_notice_too_short_to_serve_on_says_it_drains_now(roomy: World) -> None:
    """A notice whose deadline leaves less than the drain and the margin (an EventBridge state
    change reads as a deadline of now): its decision said the instance served until a time
    before the notice itself ("... or 19:15:20 at the latest" at 19:15:45, a tester's sweep)."""
    roomy.serve({SMALL: 2})
    doomed = roomy.rows("running")[0]
    roomy.fake.interrupt(doomed, 5.0)
    roomy.tick(1.0)
    assert doomed not in roomy.rows("running")  # out of service at once
    (decision,) = roomy.store.list_decisions(APP, kinds=["spot_interruption"])
    assert "it drains now and is terminated" in decision.reason
    assert "at the latest" not in decision.reason


def test_a_notice_on_an_instance_not_serving_yet_terminates_it_at_once(roomy: World) -> None:
    apply_fleet(roomy.store, {SMALL: 1})
    roomy.fake.never_run(SMALL)
    roomy.tick()
    roomy.tick()
    (booting,) = roomy.rows("pending")
    roomy.fake.interrupt(booting, NOTICE_S)
    roomy.fake.never_run(SMALL, stuck=False)

    actions = roomy.tick(1.0)

    assert [a.provider_id for a in actions if isinstance(a, InterruptionHandled)] == [booting]
    assert booting in roomy.rows("terminating")
    assert [a.instance_type for a in actions if isinstance(a, Launch)] == [SMALL]


def test_the_replacement_waits_for_the_doomed_instance_when_the_budget_is_full(
    template_db: Path, tmp_path: Path
) -> None:
    # The budget pays for exactly the fleet: a replacement next to the doomed one would breach it.
    full = World(template_db, tmp_path, budget=2 * PRICES[LARGE])
    try:
        full.serve({LARGE: 2})
        doomed = full.rows("running")[0]
        notice = full.fake.interrupt(doomed, NOTICE_S)

        actions = full.tick(1.0)

        # No replacement next to it: the budget is full. It serves on meanwhile.
        assert doomed in full.rows("running")
        assert not [a for a in actions if isinstance(a, Launch)]
        assert full.store.list_decisions(APP, kinds=["budget_capped"])
        while doomed in full.rows("running"):
            full.tick(1.0)
        # Drained near its deadline, then terminated before it.
        drained_at = full.clock.utcnow()
        assert (notice.deadline - drained_at).total_seconds() <= MARGIN_S + DRAIN_S
        while doomed in full.rows("draining"):
            full.tick(1.0)
        assert (notice.deadline - full.clock.utcnow()).total_seconds() >= MARGIN_S
        # The doomed one gone, the replacement fits; tick() checked the cap all along.
        for _ in range(3):
            full.tick(1.0)
        assert len(full.rows("running")) == 2
    finally:
        full.store.close()


# --- rule 10: purchase options, and the cap when spot prices move -----------------------------


def apply_spot_plan(store: Store, fleet: dict[str, int], spot_fleet: dict[str, int]) -> None:
    document = {
        "feasible": True,
        "cost_usd_per_hr": 0.0,
        "stages": [{"name": "tiny", "fleet": fleet, "spot_fleet": spot_fleet}],
    }
    store.apply_plan(APP, store.create_plan(APP, document).id)


@pytest.mark.parametrize("spot_block", [True, False])
def test_an_app_with_spot_on_tags_each_launch_with_its_market(
    template_db: Path, tmp_path: Path, spot_block: bool
) -> None:
    """An app whose spec turns spot on says which of its instances run on demand (its
    survive_share's base): those launches are tagged on demand, so that a deployment's
    spot-first setting (EC2's ``spot``) does not put them on spot (a tester's sweep found all
    five of such an app's instances on spot in the cloud, three recorded on demand). An app
    without a spot block leaves its on-demand launches untagged, to the deployment's setting."""
    world = World(template_db, tmp_path, budget=1.0)
    world.price_spot({LARGE: 0.03})
    try:
        if spot_block:
            document = {**spec(1.0), "spot": {"enabled": True, "survive_share": 0.5}}
            world.store.update_app(APP, document, who="test")
        apply_spot_plan(world.store, {LARGE: 3}, {LARGE: 1})
        world.tick()
        markets = sorted(str(i.tags.get(MARKET_TAG)) for i in world.fake.list({}))
        expected = ["on-demand", "on-demand", "spot"] if spot_block else ["None", "None", "spot"]
        assert markets == expected
    finally:
        world.store.close()


def test_the_cap_holds_when_spot_prices_rise_mid_run(template_db: Path, tmp_path: Path) -> None:
    spot_prices = {LARGE: 0.03}
    budget = 0.15  # two spot LARGE at 0.03; not two at on demand (0.1 each)
    world = World(template_db, tmp_path, budget=budget)
    world.price_spot(spot_prices)
    kept_cost_now = world.cost_now

    try:
        apply_spot_plan(world.store, {LARGE: 2}, {LARGE: 2})
        world.tick()
        rows = world.store.list_instances(APP)
        assert [(r.market, r.price_usd_per_hr) for r in rows] == [("spot", 0.03)] * 2
        assert all(world.fake.list({})[i].tags.get(MARKET_TAG) == "spot" for i in range(2))
        for _ in range(2):
            world.tick()
        assert len(world.rows("running")) == 2

        # Spot rises to the on-demand price: two now cost 0.2, past the budget.
        spot_prices[LARGE] = PRICES[LARGE]
        actions = world.tick()
        assert kept_cost_now() <= budget + 1e-9
        assert any(isinstance(a, SpotRepriced) for a in actions)
        (decision,) = world.store.list_decisions(APP, kinds=["spot_price"])
        assert "over it" in decision.reason
        assert world.store.list_decisions(APP, kinds=["budget_capped"])
        for _ in range(3):
            world.tick()
            assert kept_cost_now() <= budget + 1e-9
        assert len(world.rows("running")) == 1

        # It falls again: the second spot instance is back, within the budget.
        spot_prices[LARGE] = 0.03
        for _ in range(3):
            world.tick()
            assert kept_cost_now() <= budget + 1e-9
        running = world.store.list_instances(APP, states=["running"])
        assert [r.market for r in running] == ["spot", "spot"]
    finally:
        world.store.close()


def test_spot_is_launched_only_as_the_plan_says_and_while_it_is_cheaper(
    template_db: Path, tmp_path: Path
) -> None:
    spot_prices = {SMALL: 0.05}  # no cheaper than on demand: on demand it is
    world = World(template_db, tmp_path, budget=1.0)
    world.reconciler.pricing = lambda _app: AppPricing(
        PRICES, spot_prices_usd_per_hr={LARGE: 0.03, **spot_prices}
    )
    try:
        apply_spot_plan(world.store, {LARGE: 3, SMALL: 1}, {LARGE: 1, SMALL: 1})
        world.tick()
        markets = sorted((r.instance_type, r.market) for r in world.store.list_instances(APP))
        assert markets == [
            (LARGE, "on-demand"),
            (LARGE, "on-demand"),
            (LARGE, "spot"),
            (SMALL, "on-demand"),
        ]
    finally:
        world.store.close()


# --- rule 11: a replacement from the plan's ranking where the same type is short --------------

SPOT_PRICES = {SMALL: 0.015, LARGE: 0.03}


def spot_world(template_db: Path, tmp_path: Path, budget: float) -> World:
    world = World(template_db, tmp_path, budget=budget)
    world.price_spot(dict(SPOT_PRICES))
    return world


def launches(actions: list[object]) -> list[tuple[str, str, str | None]]:
    return [(a.instance_type, a.market, a.stands_for) for a in actions if isinstance(a, Launch)]


def assert_a_restart_changes_nothing(world: World) -> None:
    """A reconciler started afresh on ``world`` (a restart) reads the stand-ins back from the
    decisions: three ticks launch and end nothing."""
    world.reconciler = Reconciler(world.store, world.fake, world.clock, world.reconciler.pricing)
    for _ in range(3):
        actions = world.tick()
        assert not launches(actions)
        assert not [a for a in actions if type(a).__name__ == "Terminate"]


def kept_types(world: World) -> list[tuple[str, str]]:
    kept = world.store.list_instances(APP, states=["requested", "pending", "running"])
    return sorted((r.instance_type, r.market) for r in kept)


@pytest.fixture
def short_of_small(template_db: Path, tmp_path: Path) -> Iterator[World]:
    """Spot priced (:func:`spot_world`, a budget of 1.0), no capacity of small, and a plan of two
    small ones on spot."""
    world = spot_world(template_db, tmp_path, budget=1.0)
    try:
        world.fake.fail_capacity(SMALL)
        apply_spot_plan(world.store, {SMALL: 2}, {SMALL: 2})
        yield world
    finally:
        world.store.close()


def test_a_type_without_capacity_is_stood_in_for_by_the_next_of_the_ranking(
    short_of_small: World,
) -> None:
    first = short_of_small.tick()
    assert launches(first) == [(SMALL, "spot", None)] * 2  # refused: no capacity

    second = short_of_small.tick()

    # The waiting launches are given up for a type that serves at least as much, on spot.
    assert launches(second) == [(LARGE, "spot", SMALL)] * 2
    decisions = short_of_small.store.list_decisions(APP, kinds=["stand_in"])
    assert [d.numbers["stands_for"] for d in decisions] == [SMALL, SMALL]
    assert "short of emu.cpu.small" in decisions[0].reason
    failed = short_of_small.store.list_instances(APP, states=["failed"])
    assert [r.instance_type for r in failed] == [SMALL, SMALL]
    # The stand-ins count as the type they stand in for: kept, nothing more launched.
    for _ in range(4):
        assert not launches(short_of_small.tick())
    assert kept_types(short_of_small) == [(LARGE, "spot"), (LARGE, "spot")]
    assert len(short_of_small.rows("running")) == 2

    # A reconciler started afresh (a restart) reads the stand-ins back from the decisions.
    assert_a_restart_changes_nothing(short_of_small)


def test_a_stand_in_whose_decision_was_not_written_is_not_recorded_either(
    short_of_small: World,
) -> None:
    """The write of a stand-in's decision fails (the process dies there): its row is not kept
    either, and the reconciler started again stands in for small, each said once. The decision,
    what a reconciler started again reads the stand-ins back from, was written after the row,
    in a transaction of its own: the row was kept and never said, not known as a stand-in (the
    reconciler started again ended it unlaunched and tried small again first)."""
    assert launches(short_of_small.tick()) == [(SMALL, "spot", None)] * 2  # no capacity
    with decision_write_fails("launched for emu.cpu.small") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            short_of_small.tick()
        assert failing == []
    assert short_of_small.store.list_instances(APP, states=["requested"]) == []
    short_of_small.reconciler = Reconciler(
        short_of_small.store,
        short_of_small.fake,
        short_of_small.clock,
        short_of_small.reconciler.pricing,
    )
    for _ in range(4):
        short_of_small.tick()
    assert kept_types(short_of_small) == [(LARGE, "spot"), (LARGE, "spot")]
    decisions = short_of_small.store.list_decisions(APP, kinds=["stand_in"])
    assert [d.numbers["stands_for"] for d in decisions] == [SMALL, SMALL]
    assert_a_restart_changes_nothing(short_of_small)


def test_infaas_counts_the_reconcilers_stand_ins_as_the_type_they_stand_in_for(
    short_of_small: World,
) -> None:
    """The reconciler says which of its instances stand in for which type (``held_back``'s
    ``stand_ins``, as the service passes it to INFaaS's autoscaler), also once started afresh.
    The policy, its fleet one small (a drain of the second it made, still serving), reads the two
    large stand-ins as its two smalls: at 75 qps on 80 (two large, 40 qps each) it takes the
    drain back as a small and adds smalls. Read by their own type, a small was "loading" (its
    10 qps counted beside the 80) and the scale-up took both large ones into the fleet, which the
    reconciler, counting them as smalls already, would have bought."""
    from controlplane.policies.infaas_scaling import (
        ScalingContext,
        ServedInstance,
        StandIn,
        VariantProfile,
        decide,
        initial_state,
    )

    for _ in range(4):
        short_of_small.tick()
    running = short_of_small.store.list_instances(APP, states=["running"])
    assert sorted(r.instance_type for r in running) == [LARGE, LARGE]
    held = short_of_small.reconciler.held_back(APP)
    assert dict(held.stand_ins) == {r.id: StandIn(SMALL) for r in running}
    assert_a_restart_changes_nothing(short_of_small)
    held = short_of_small.reconciler.held_back(APP)
    assert dict(held.stand_ins) == {r.id: StandIn(SMALL) for r in running}

    variants = [
        VariantProfile("tiny", SMALL, 10.0, 20.0),
        VariantProfile("tiny", LARGE, 40.0, 30.0),
    ]
    serving = [ServedInstance(r.id, r.instance_type, {"tiny": "active"}, 0.9) for r in running]
    context = ScalingContext(
        "recs", 100.0, {"tiny": 75.0}, serving, variants, PRICES, 1.0, held_back=held
    )
    (up,), after = decide(context, initial_state({SMALL: 1}, 0.0))
    assert up.numbers["capacity_qps_before"] == 80.0, up.reason
    assert up.numbers["taken_back"] == {SMALL: 1}, up.reason
    assert dict(after.fleet) == {SMALL: 4}, up.reason


def test_a_refused_type_is_stood_in_for_within_the_budget_or_not_at_all(
    template_db: Path, tmp_path: Path
) -> None:
    # Room for the two small ones on spot and one large stand-in, not two.
    world = spot_world(template_db, tmp_path, budget=0.05)
    try:
        world.fake.set_quota(SMALL, 0)  # refused: a quota, not retried for the backoff
        apply_spot_plan(world.store, {SMALL: 2}, {SMALL: 2})
        world.tick()
        assert world.store.list_decisions(APP, kinds=["launch_failed"])

        actions = world.tick()

        assert launches(actions) == [(LARGE, "spot", SMALL)]
        assert kept_types(world) == [(LARGE, "spot")]
    finally:
        world.store.close()


def test_a_notice_on_a_spot_type_is_replaced_by_another_type_on_spot_or_on_demand(
    template_db: Path, tmp_path: Path
) -> None:
    world = spot_world(template_db, tmp_path, budget=1.0)
    try:
        apply_spot_plan(world.store, {SMALL: 1, LARGE: 1}, {SMALL: 1, LARGE: 1})
        for _ in range(3):
            world.tick()
        by_type = {
            r.instance_type: r.provider_id or ""
            for r in world.store.list_instances(APP, states=["running"])
        }

        # The small one's spot is under notice: a large one on spot stands in for it.
        world.fake.interrupt(by_type[SMALL], NOTICE_S)
        actions = world.tick(1.0)
        assert launches(actions) == [(LARGE, "spot", SMALL)]
        (decision,) = world.store.list_decisions(APP, kinds=["stand_in"])
        assert "under an interruption notice" in decision.reason

        # The large one's: nothing in the ranking serves as much, so a large one on demand.
        world.fake.interrupt(by_type[LARGE], NOTICE_S)
        actions = world.tick(1.0)
        assert launches(actions) == [(LARGE, "on-demand", LARGE)]
        assert "on demand" in world.store.list_decisions(APP, kinds=["stand_in"])[-1].reason
        # Both doomed ones go before their deadline; the replacements serve.
        for _ in range(130):
            world.tick(1.0)
        assert kept_types(world) == [(LARGE, "on-demand"), (LARGE, "spot")]
        assert len(world.rows("running")) == 2
    finally:
        world.store.close()


def test_a_spot_price_rise_over_the_budget_moves_capacity_to_a_cheaper_spot_type(
    template_db: Path, tmp_path: Path
) -> None:
    spot_prices = {SMALL: 0.015, LARGE: 0.03}
    budget = 0.1
    world = World(template_db, tmp_path, budget=budget)
    world.price_spot(spot_prices)
    cost_now = world.cost_now

    try:
        apply_spot_plan(world.store, {SMALL: 3}, {SMALL: 3})
        for _ in range(3):
            world.tick()
        assert kept_types(world) == [(SMALL, "spot")] * 3

        # A rise within the budget (3 x 0.03 = 0.09) moves nothing.
        spot_prices[SMALL] = 0.03
        actions = world.tick()
        assert not launches(actions)
        assert kept_types(world) == [(SMALL, "spot")] * 3

        # A rise past it (3 x 0.05 = 0.15): the small ones go and three large ones on spot
        # (0.03 each: as much capacity, 0.09 in all) are launched in the same tick.
        spot_prices[SMALL] = 0.05
        actions = world.tick()
        assert cost_now() <= budget + 1e-9
        assert launches(actions) == [(LARGE, "spot", SMALL)] * 3
        (moved,) = world.store.list_decisions(APP, kinds=["terminate"])
        assert moved.numbers["cause"] == "spot_price"
        assert "rose to 0.05" in moved.reason and "over the budget of 0.1" in moved.reason
        reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["stand_in"])]
        assert len(reasons) == 3 and "serves as much for less" in reasons[0]
        for _ in range(5):
            actions = world.tick()
            assert cost_now() <= budget + 1e-9
            assert not launches(actions)
        assert kept_types(world) == [(LARGE, "spot")] * 3
        assert len(world.rows("running")) == 3
    finally:
        world.store.close()


def test_a_spot_price_read_that_keeps_failing_is_logged_once_a_minute(
    template_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A provider that cannot read spot prices (no permission) had the reconciler log it on
    every read, twice a tick; the catalog's prices serve meanwhile, and the same failure is
    logged again only a minute later."""
    from controlplane.loops.reconciler import SPOT_READ_WARN_EVERY_S
    from provisioners.errors import ProvisionerError

    world = World(template_db, tmp_path, budget=1.0)
    world.price_spot({LARGE: 0.03})

    def refused(_instance_type: str) -> float | None:
        raise ProvisionerError("DescribeSpotPriceHistory: UnauthorizedOperation")

    monkeypatch.setattr(world.fake, "spot_price", refused)
    try:
        apply_spot_plan(world.store, {LARGE: 1}, {LARGE: 1})
        with caplog.at_level("WARNING", logger="controlplane.loops.reconciler"):
            for _ in range(4):
                world.tick()
            said = [r for r in caplog.records if "spot prices not read" in r.getMessage()]
            assert len(said) == 1
            world.tick(SPOT_READ_WARN_EVERY_S)
            said = [r for r in caplog.records if "spot prices not read" in r.getMessage()]
            assert len(said) == 2
        # The catalog's spot price served: the plan's spot instance was launched at it.
        assert [(r.market, r.price_usd_per_hr) for r in world.store.list_instances(APP)] == [
            ("spot", 0.03)
        ]
    finally:
        world.store.close()


def test_app_down_while_a_noticed_instance_waits_for_its_replacement_takes_it_down_too(
    roomy: World,
) -> None:
    # Two small ones; one gets a notice of two minutes and serves on until its replacement
    # does. The app goes down before the replacement serves: every instance goes at once, the
    # noticed one too. (A tester's sweep saw `app down` terminate the others and the replacement
    # and leave the noticed one serving, billed, until near its deadline: it was no longer
    # "kept", and the teardown ends the kept ones.)
    roomy.serve({SMALL: 2})
    doomed = roomy.rows("running")[0]
    roomy.fake.never_run(SMALL)  # the replacement boots on: it does not serve yet
    roomy.fake.interrupt(doomed, 120.0)
    actions = roomy.tick(1.0)
    assert [a.instance_type for a in actions if isinstance(a, Launch)] == [SMALL]
    assert doomed in roomy.rows("running")  # it serves on until the replacement does

    teardown.request_teardown(roomy.store, APP, who="test")
    roomy.tick(1.0)

    live = roomy.store.list_instances(APP, states=["requested", "pending", "running", "draining"])
    assert live == [], [(i.provider_id, i.state) for i in live]
    assert doomed in roomy.rows("terminating") + roomy.rows("terminated")


def test_the_instances_route_says_which_instances_run_on_spot(roomy: World) -> None:
    # A plan of three large ones, two on spot: GET /v1/instances (instance_out) says which are
    # (a tester's sweep could tell them apart only by their prices).
    roomy.price_spot({LARGE: 0.03})
    apply_spot_plan(roomy.store, {LARGE: 3}, {LARGE: 2})
    for _ in range(3):
        roomy.tick()
    listed = [instance_out(i).model_dump(mode="json") for i in roomy.store.list_instances(APP)]
    assert sorted(i["market"] for i in listed) == ["on-demand", "spot", "spot"]


def test_stand_ins_for_a_capacity_miss_go_back_only_once_its_launches_stop_failing(
    short_of_small: World,
) -> None:
    # No capacity of small: two large ones on spot stand in for the plan's two small ones. Its
    # spot price is low all along (the fall holds), but the stand-ins go back only once a
    # launch back-off has passed since small's last capacity miss: while spot still has none, a
    # try every back-off at most (its request ended as a surplus beside them, no further
    # stand-in); once it has, small on spot is launched in their slots and they drain once it
    # serves, never fewer than two serving.
    for _ in range(4):
        short_of_small.tick()
    assert kept_types(short_of_small) == [(LARGE, "spot")] * 2
    for _ in range(50):  # 250 s, within the back-off: nothing moves
        assert not launches(short_of_small.tick())
    for _ in range(150):  # spot still out of capacity past it: tried, never another stand-in
        actions = short_of_small.tick()
        assert all(stands_for is None for _, _, stands_for in launches(actions)), actions
        assert len(short_of_small.rows("running")) >= 2
        live = short_of_small.store.list_instances(APP, states=["pending", "running", "draining"])
        assert sorted(r.instance_type for r in live) == [LARGE] * 2
    short_of_small.fake.restore_capacity(SMALL)
    for _ in range(120):
        short_of_small.tick()
        assert len(short_of_small.rows("running")) >= 2
    assert kept_types(short_of_small) == [(SMALL, "spot")] * 2
    moves = short_of_small.store.list_decisions(APP, kinds=["spot_return"])
    assert moves and all(d.numbers["stand_in"] for d in moves)


def test_a_capacity_miss_is_forgotten_once_its_back_off_has_passed(
    short_of_small: World,
) -> None:
    # The time of small's last capacity miss holds its stand-ins for a back-off; once that has
    # passed without a miss it says nothing more, and is forgotten (kept, the entries of every
    # type and app that ever missed capacity stayed for the process's life).
    for _ in range(4):
        short_of_small.tick()
    assert (APP, SMALL) in short_of_small.reconciler._capacity_missed_last_s
    short_of_small.fake.restore_capacity(SMALL)
    short_of_small.tick(DEFAULT_LAUNCH_BACKOFF_S)
    assert (APP, SMALL) not in short_of_small.reconciler._capacity_missed_last_s


def test_a_hold_on_a_refused_type_is_forgotten_once_its_back_off_has_passed(
    template_db: Path, tmp_path: Path
) -> None:
    # A launch refused for good (a quota) holds its type for a back-off; past it the hold says
    # nothing more, and is forgotten (kept, every type and app ever refused stayed for the
    # process's life).
    world = spot_world(template_db, tmp_path, budget=1.0)
    try:
        world.fake.set_quota(SMALL, 0)
        apply_spot_plan(world.store, {SMALL: 2}, {SMALL: 2})
        world.tick()
        assert (APP, SMALL) in world.reconciler._held_until_s
        world.fake.set_quota(SMALL, None)
        world.tick(DEFAULT_LAUNCH_BACKOFF_S)
        assert (APP, SMALL) not in world.reconciler._held_until_s
    finally:
        world.store.close()


def test_a_drain_deferral_episode_is_forgotten_once_a_pass_goes_without_it(roomy: World) -> None:
    # Deferrals in consecutive passes are one episode (one decision row); once a pass has gone
    # without one, the next begins a new episode, and the last is forgotten (kept, each app and
    # cause ever deferred stayed for the process's life).
    roomy.serve({SMALL: 1})
    reconciler = roomy.reconciler
    reconciler._deferral_key(APP, "budget")  # deferred in this pass, as rule 5's carrying out
    roomy.tick()
    assert (APP, "budget") in reconciler._deferrals  # this pass could have gone on with it
    roomy.tick()
    assert (APP, "budget") not in reconciler._deferrals


# What the reconciler remembers of an app between passes.
_MEMORIES = (
    "_spot_low_since_s",
    "_spot_returning",
    "_spot_replacements",
    "_spot_read",
    "_missing_since",
    "_deferrals",
    "_held_back",
    "_held_until_s",
    "_spot_on_demand_until_s",
    "_capacity_missed_s",
    "_capacity_missed_last_s",
    "_stand_ins",
    "_stand_in_shares",
    "_said_rows",
)


def test_a_deleted_app_leaves_nothing_in_the_reconcilers_memories(
    short_of_small: World,
) -> None:
    # Stand-ins for small (no capacity), its spot price low, one of them lost by the provider.
    for _ in range(4):
        short_of_small.tick()
    short_of_small.fake.crash([short_of_small.rows("running")[0]])
    short_of_small.tick(1.0)
    reconciler = short_of_small.reconciler
    row_ids = {r.id for r in short_of_small.store.list_instances(APP)}
    # The memories these ticks leave empty, as the passes write them (a hold, a turn on demand,
    # a type waiting for capacity, a move back, a replacement, a deferral, a sized stand-in).
    now_s = short_of_small.clock.now_s()
    reconciler._held_until_s[(APP, LARGE)] = now_s + DEFAULT_LAUNCH_BACKOFF_S
    reconciler._spot_on_demand_until_s[(APP, SMALL)] = now_s + DEFAULT_LAUNCH_BACKOFF_S
    reconciler._capacity_missed_s[(APP, SMALL)] = now_s
    some_row = sorted(row_ids)[0]
    reconciler._spot_returning[APP] = {some_row}
    reconciler._spot_replacements[APP] = {some_row}
    reconciler._deferrals[(APP, "budget")] = (short_of_small.clock.utcnow(), reconciler._passes)
    reconciler._stand_in_shares[APP] = {some_row: 0.5}
    reconciler._said_rows[APP] = {some_row}
    for name in _MEMORIES:
        assert getattr(reconciler, name), name

    short_of_small.store.delete_app(APP, force=True)
    short_of_small.clock.advance(1.0)
    short_of_small.fake.step()
    reconciler.run_once()

    kept = {
        name: [
            k for k in memory if k == APP or k in row_ids or (isinstance(k, tuple) and k[0] == APP)
        ]
        for name, memory in vars(reconciler).items()
        if isinstance(memory, dict | set | frozenset)
    }
    assert {name: keys for name, keys in kept.items() if keys} == {}
