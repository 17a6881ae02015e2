"""Re-planning at the spot prices now (``controlplane/loops/spot_replan.py``) over the service as
``build_service`` wires it: the real store through its migrations, the reconciler on the fake
provisioner with settable spot prices (as the EC2 provisioner reads them with
DescribeSpotPriceHistory), the planner on measured-shape profiles, a fake clock.

An app planned all on spot on r5n.large sees r5n.large's spot price rise to its on-demand price:
a small move re-plans nothing; this one re-plans the app at the prices now, and the applied plan
is what a fresh plan at them is (three t3.xlarge on spot), with a decision that says why; the
reconciler then converges to it within the budget at the prices now, at every tick."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from controlplane.apps.plans import PlanRequest, planning_trace, preview_plan
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import FakeClock
from controlplane.db.store import PlanRecord
from controlplane.loops.spot_replan import SpotReplanner, cost_at
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import plan_with_spot
from controlplane.service.build import Service
from controlplane.spec import ResolvedApp
from provisioners.fake import FakeProvisioner
from tests.component.test_api import spec
from tests.component.test_capacity import world
from tests.dying_writes import decision_write_fails

__all__ = ["world"]  # the fixture, imported for pytest

APP, R5N = "toy", "r5n.large"
REQUEST = PlanRequest(rate_qps=100.0, seed=3)
# All of it may be on spot: the planner chooses at the spot prices.
DOCUMENT = {**spec(budget=4.0, latency_ms=40.0), "spot": {"enabled": True, "survive_share": 0.0}}
_LIVE = ("requested", "pending", "running", "draining")


@dataclass
class Planned:
    """The app registered and planned at the catalog's spot prices, its plan applied."""

    first: PlanRecord
    fake: FakeProvisioner
    resolved: ResolvedApp
    replanner: SpotReplanner


def planned(service: Service, resolver: AppResolver) -> Planned:
    store = service.store
    store.create_app(spec_document(resolver.check(DOCUMENT).spec), who="test")
    first = preview_plan(store, resolver, APP, REQUEST)
    store.apply_plan(APP, first.id)
    fake = service.provisioner
    assert isinstance(fake, FakeProvisioner)
    replanner = a_replanner(service, resolver)
    resolved = resolver.resolve(store.get_app(APP).spec, check_budget=False)
    return Planned(first, fake, resolved, replanner)


def test_spot_prices_that_moved_a_lot_re_plan_the_app_at_the_prices_now(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    store = service.store
    setup = planned(service, resolver)
    first, fake, resolved, replanner = setup.first, setup.fake, setup.resolved, setup.replanner
    assert first.plan.stages[0].spot_fleet == {R5N: 2}  # at the catalog's spot prices

    def tick() -> list[str]:
        clock.advance(5.0)
        fake.step()
        service.reconciler.run_once()
        replanned = replanner.tick()
        spot_now = service.reconciler.spot_prices_now(store.get_app(APP), [R5N, "t3.xlarge"])
        live = store.list_instances(APP, states=list(_LIVE))
        cost_now = sum(
            spot_now[r.instance_type] if r.market == "spot" else r.price_usd_per_hr for r in live
        )
        assert cost_now <= DOCUMENT["budget_usd_per_hr"] + 1e-9
        return replanned

    for _ in range(3):
        assert tick() == []  # the catalog's prices: nothing moved
    catalog = resolved.catalog[R5N].spot_price_usd_per_hr
    assert catalog is not None
    fake.set_spot_price(R5N, catalog * 1.1)  # 10 %: less than the 25 % that re-plans
    assert tick() == []

    on_demand = resolved.prices_usd_per_hr[R5N]
    fake.set_spot_price(R5N, on_demand)  # +150 %
    assert tick() == [APP]

    applied = store.get_applied_plan(APP)
    assert applied is not None and applied.id != first.id
    # What a fresh plan at the prices now is, made on the same trace.
    prices = {t: resolved.catalog[t].spot_price_usd_per_hr for t in resolved.prices_usd_per_hr}
    prices[R5N] = on_demand
    trace, _ = planning_trace(resolved, REQUEST)
    fresh = plan_with_spot(resolved, trace, plan=plan_app, seed=3, spot_prices=prices)
    assert applied.plan.fleet == fresh.fleet
    assert [s.spot_fleet for s in applied.plan.stages] == [s.spot_fleet for s in fresh.stages]
    assert R5N not in applied.plan.fleet
    spot_now = {t: p for t, p in prices.items() if p is not None}
    assert fresh.cost_usd_per_hr < cost_at(first.plan, resolved.prices_usd_per_hr, spot_now)
    (decision,) = store.list_decisions(APP, kinds=["spot_replan"])
    assert decision.numbers["applied"] is True
    assert decision.numbers["moved"] == {R5N: {"from": catalog, "to": on_demand}}
    assert "spot prices moved by 25% or more" in decision.reason
    assert f"replaces plan {first.id}" in decision.reason

    # The reconciler converges to the new plan (the old instances go as the disruption budget
    # allows, one a minute); the prices have not moved since: no re-plan.
    for _ in range(20):
        assert tick() == []
    kept = store.list_instances(APP, states=["requested", "pending", "running"])
    assert Counter(r.instance_type for r in kept) == Counter(applied.plan.fleet)
    assert len(store.list_decisions(APP, kinds=["spot_replan"])) == 1


def test_a_move_after_which_the_applied_plan_is_still_the_cheapest_leaves_it_applied(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, _clock, resolver = world
    store = service.store
    setup = planned(service, resolver)
    first, fake, resolved, replanner = setup.first, setup.fake, setup.resolved, setup.replanner
    catalog = resolved.catalog[R5N].spot_price_usd_per_hr
    assert catalog is not None
    fake.set_spot_price(R5N, catalog / 2)  # the planned type got cheaper still

    assert replanner.tick() == []

    assert store.get_app(APP).applied_plan_id == first.id
    (decision,) = store.list_decisions(APP, kinds=["spot_replan"])
    assert decision.numbers["applied"] is False
    assert f"plan {first.id} stays" in decision.reason
    assert replanner.tick() == []  # measured from the prices attempted now: no second attempt
    assert len(store.list_decisions(APP, kinds=["spot_replan"])) == 1


def test_a_re_plan_whose_decision_was_not_written_is_not_applied_either(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    """The write of the re-plan's decision fails (the loops process dies there): the plan is
    not applied either, and the loop started again re-plans at the prices now and says it once.
    The decision used to be written after the apply, in a transaction of its own: the plan was
    applied and never said, and the loop started again, which reads the prices a plan was made
    at from its decision, measured it from the catalog's prices and re-planned it again."""
    service, _clock, resolver = world
    store = service.store
    setup = planned(service, resolver)
    first, fake, resolved = setup.first, setup.fake, setup.resolved
    fake.set_spot_price(R5N, resolved.prices_usd_per_hr[R5N])  # +150 %
    with decision_write_fails("spot prices moved") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            setup.replanner.tick()
        assert failing == []
    assert store.get_app(APP).applied_plan_id == first.id
    assert store.list_decisions(APP, kinds=["spot_replan"]) == []
    again = a_replanner(service, resolver)
    assert again.tick() == [APP]
    assert again.tick() == [] and a_replanner(service, resolver).tick() == []
    applied = store.get_applied_plan(APP)
    assert applied is not None and applied.id != first.id
    (decision,) = store.list_decisions(APP, kinds=["spot_replan"])
    assert decision.numbers["applied"] is True and decision.numbers["plan_id"] == applied.id


def a_replanner(service: Service, resolver: AppResolver) -> SpotReplanner:
    """A loops process's re-planner (a new one: that of a process started again, what the
    last one kept in memory gone)."""
    reconciler = service.reconciler
    assert reconciler is not None
    return SpotReplanner(
        service.store,
        lambda app: resolver.resolve(app.spec, check_budget=False),
        reconciler.spot_prices_now,
        move_share=0.25,
    )
