"""A cheaper gear as the answer to a spot price rise (docs/spot.md): a cascade served by gears
whose fleet is on spot sees the spot price rise past the budget; the gear switcher, which costs
spot instances at the prices now (the reconciler's ``spot_prices_now`` in the service), moves to
the faster gear before the reconciler drains, as it does for a budget cut. A real store, a fake
clock, arrivals and the serving loop's status set by hand (as in test_live_gears)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pytest

from controlplane.clock import FakeClock
from controlplane.db.store import AppRecord, Store
from tests.component.test_live_gears import (
    ACCURATE,
    APP,
    FAST,
    PLAN,
    TYPE,
    Loop,
    applied,
    store,
    switcher,
)

__all__ = ["store"]  # the fixture, imported for pytest


def test_a_spot_price_rise_past_the_budget_moves_the_gear_before_the_drain(
    store: Store, tmp_path: Path
) -> None:
    applied(store, tmp_path, PLAN.to_document())
    for n in range(3):  # the placement's three instances on spot, 0.3 USD/hr each: 0.9 of 1.0
        store.record_instance(
            APP,
            request_id=f"r{n}",
            instance_type=TYPE,
            price_usd_per_hr=0.3,
            state="running",
            market="spot",
        )
    spot_now = {TYPE: 0.3}

    def spot_prices(_app: AppRecord, types: Collection[str]) -> dict[str, float]:
        return {t: p for t, p in spot_now.items() if t in types}

    clock, loop = FakeClock(start_s=100.0), Loop()
    gears = switcher(store, clock, loop, hysteresis=None)  # the service's hysteresis
    gears.spot_prices = spot_prices
    loop.rate(15.0, clock.now_s())
    gears.tick()
    assert gears.gear(APP).cascade == ACCURATE.cascade  # type: ignore[union-attr]

    # Within the budget (3 x 0.32 = 0.96): the gear stays.
    spot_now[TYPE] = 0.32
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    assert gears.tick() == []

    # Past it (3 x 0.5 = 1.5): two thirds of the fleet is what the budget buys now; 15 qps on
    # two thirds of the capacity is the fast gear's, at once (a budget cut waits for no dwell).
    spot_now[TYPE] = 0.5
    clock.advance(1.0)
    loop.rate(15.0, clock.now_s())
    (up,) = gears.tick()
    assert up.gear == 1 and gears.gear(APP).cascade == FAST.cascade  # type: ignore[union-attr]
    assert up.effective_qps == pytest.approx(1.5 * up.measured_qps)
    switch = store.list_decisions(APP, kinds=["gear_switch"])[-1]
    assert switch.numbers["capacity_share"] == pytest.approx(1.0 / 1.5)
    assert [i.state for i in store.list_instances(APP)] == ["running"] * 3  # nothing drained
