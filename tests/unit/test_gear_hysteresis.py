"""The gear switcher's hysteresis (controlplane.policies.gears, "Hysteresis"): a dead band below
each range, a hold before a move down, a dwell between switches, and no switch between gears of
the same cascade. The switcher is driven tick by tick (100 ms) on readings made here."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from controlplane.policies.gears import (
    DEFAULT_DOWN_DWELL_S,
    DEFAULT_DOWN_HOLD_S,
    DEFAULT_UP_DWELL_S,
    GearDecision,
    GearSwitcher,
    Hysteresis,
    same_cascade,
    switch,
)
from estimator.errors import CascadeError
from tests.unit.test_gears import fake_plan

TICK_S = 0.1


def drive(
    state: GearSwitcher, load: Callable[[float], float], seconds: float, start_s: float = 0.0
) -> tuple[list[GearDecision], GearSwitcher]:
    """Every tick's decision over ``seconds`` of readings ``load(t)``, and the last state."""
    decisions = []
    for k in range(round(seconds / TICK_S)):
        now_s = start_s + k * TICK_S
        decision, state = switch(load(now_s), 0, state, now_s)
        decisions.append(decision)
    return decisions, state


def switches(decisions: list[GearDecision]) -> list[tuple[int, int]]:
    return [(d.previous, d.gear) for d in decisions if d.switched]


def noisy(mean_qps: float, seed: int, spread: float = 0.15) -> Callable[[float], float]:
    """Readings of a steady load: each tick's off by up to ``spread`` either way, at random."""
    rng = np.random.default_rng(seed)
    return lambda _now_s: mean_qps * (1.0 + rng.uniform(-spread, spread))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_around_a_boundary_switches_at_most_once(seed: int) -> None:
    plan = fake_plan()  # ranges of 10 qps, each gear its own cascade
    # A steady 20 qps, read 17 to 23: on both sides of the boundary between gears 1 and 2.
    decisions, _ = drive(GearSwitcher(plan, gear=1), noisy(20.0, seed), 600.0)
    assert len(switches(decisions)) <= 1
    # The paper's rule on the same readings flaps (what the hysteresis is for).
    paper, _ = drive(
        GearSwitcher(plan, gear=1, hysteresis=Hysteresis.off()), noisy(20.0, seed), 600.0
    )
    assert len(switches(paper)) > 100


def test_a_step_up_switches_once_at_once() -> None:
    plan = fake_plan()
    state = GearSwitcher(plan, gear=1, since_s=-100.0)
    decisions, state = drive(state, lambda t: 15.0 if t < 60.0 else 35.0, 120.0)
    assert switches(decisions) == [(1, 3)]
    (up,) = [d for d in decisions if d.switched]
    assert up.at_s == pytest.approx(60.0)  # the first tick past the boundary
    assert state.gear == 3 and state.since_s == pytest.approx(60.0)


def test_a_step_down_switches_once_after_the_hold_and_the_dwell() -> None:
    plan = fake_plan()
    state = GearSwitcher(plan, gear=3, since_s=0.0)
    decisions, state = drive(state, lambda t: 35.0 if t < 5.0 else 5.0, 120.0)
    assert switches(decisions) == [(3, 0)]
    (down,) = [d for d in decisions if d.switched]
    # The load fell at 5 s; the hold (10 s) ends at 15 s, the dwell (30 s from 0) at 30 s.
    assert DEFAULT_DOWN_HOLD_S < DEFAULT_DOWN_DWELL_S
    assert down.at_s == pytest.approx(DEFAULT_DOWN_DWELL_S)
    held = [d for d in decisions if 15.0 < d.at_s < DEFAULT_DOWN_DWELL_S]
    assert held and all("before a switch down" in d.reason for d in held)


def test_a_fall_into_the_band_does_not_switch_down() -> None:
    plan = fake_plan()
    # Gear 2 is [20, 30); the band reaches down to 20 x (1 - 0.25) = 15 qps.
    decisions, state = drive(GearSwitcher(plan, gear=2), lambda _t: 15.5, 300.0)
    assert switches(decisions) == [] and state.gear == 2
    # Below the band the gear moved to is that of load / (1 - band): 14 / 0.75 = 18.7, gear 1.
    decisions, state = drive(state, lambda _t: 14.0, 60.0, start_s=300.0)
    assert switches(decisions) == [(2, 1)]


def test_a_dip_shorter_than_the_hold_does_not_switch_down() -> None:
    plan = fake_plan()
    dip_s = DEFAULT_DOWN_HOLD_S - 1.0

    def load(t: float) -> float:  # a dip to 5 qps for less than the hold, every 30 s
        return 5.0 if t % 30.0 < dip_s else 25.0

    decisions, state = drive(GearSwitcher(plan, gear=2), load, 300.0)
    assert switches(decisions) == [] and state.gear == 2


def test_no_switch_back_and_forth_within_the_up_dwell() -> None:
    plan = fake_plan()
    state = GearSwitcher(plan, gear=3, since_s=0.0)
    decisions, state = drive(state, lambda t: 5.0, DEFAULT_DOWN_DWELL_S + TICK_S)
    assert switches(decisions) == [(3, 0)]
    down_s = state.since_s
    assert down_s == pytest.approx(DEFAULT_DOWN_DWELL_S)
    # Right after the switch down the load is back: the switch up waits for the up dwell.
    decisions, state = drive(state, lambda t: 35.0, 10.0, start_s=down_s + TICK_S)
    (up,) = [d for d in decisions if d.switched]
    assert up.at_s - down_s == pytest.approx(DEFAULT_UP_DWELL_S)
    assert "before a switch up" in decisions[0].reason


def test_gears_of_the_same_cascade_never_count_as_a_switch() -> None:
    # Gears 0 and 1 share option 0, gears 2 and 3 option 1.
    plan = fake_plan(options=[0, 0, 1, 1])
    assert same_cascade(plan, 0, 1) and same_cascade(plan, 2, 3) and not same_cascade(plan, 1, 2)
    readings = noisy(10.0, seed=3, spread=0.5)  # 5 to 15 qps: across 10, both ways, often
    decisions, _ = drive(GearSwitcher(plan, gear=0, hysteresis=Hysteresis.off()), readings, 300.0)
    moves = [d for d in decisions if d.changed]
    assert len(moves) > 10  # the gear index (the batch trigger) follows the load
    assert not any(d.switched for d in decisions)  # never a switch: one cascade
    # And a move within a cascade waits for no dwell: straight from the start of gear 2's.
    state = GearSwitcher(plan, gear=2, since_s=0.0)
    decision, state = switch(35.0, 0, state, 0.1)
    assert (decision.gear, decision.switched, state.since_s) == (3, False, 0.0)


def test_the_hysteresis_refuses_nonsense() -> None:
    with pytest.raises(CascadeError, match="band_share"):
        Hysteresis(band_share=1.0)
    with pytest.raises(CascadeError, match="down_dwell_s"):
        Hysteresis(down_dwell_s=-1.0)
    with pytest.raises(CascadeError, match="up_dwell_s"):
        Hysteresis(up_dwell_s=float("nan"))


def test_the_service_settings_default_to_the_policys_hysteresis() -> None:
    from controlplane.settings import Settings

    settings, rule = Settings(), Hysteresis()
    assert (
        settings.gear_dead_band_share,
        settings.gear_down_hold_s,
        settings.gear_down_dwell_s,
        settings.gear_up_dwell_s,
    ) == (rule.band_share, rule.down_hold_s, rule.down_dwell_s, rule.up_dwell_s)


def test_a_budget_cut_switches_up_without_waiting_for_the_dwell() -> None:
    plan = fake_plan()
    state = GearSwitcher(plan, gear=0, since_s=10.0)  # a switch a second ago
    decision, _ = switch(5.0, 0, state, 11.0, capacity_share=0.25)  # 20 qps on a quarter
    assert decision.gear == 0 and "before a switch up" in decision.reason
    decision, _ = switch(5.0, 0, state, 11.0, capacity_share=0.25, budget_cut=True)
    assert (decision.gear, decision.switched) == (2, True)


def test_a_move_down_goes_to_the_gear_of_the_most_read_over_the_hold() -> None:
    """The gear a move down goes to is that of the highest load read while it held below the
    band, not of the reading that ends the hold: live, on the demo, a load held at about 11.5
    qps on the planned capacity (below the band of a gear from 15.7) dipped to 9.3 as the hold
    ended, the switcher moved to the accurate cascade of [9.4, 12.6) and back up 5.1 s later."""
    plan = fake_plan()  # ranges of 10 qps, each gear its own cascade
    state = GearSwitcher(plan, gear=3, since_s=-100.0)  # [30, 40): its band ends at 22.5

    def load(t: float) -> float:  # 21 qps, one low reading as the hold ends
        return 10.0 if DEFAULT_DOWN_HOLD_S <= t < DEFAULT_DOWN_HOLD_S + TICK_S else 21.0

    decisions, state = drive(state, load, DEFAULT_DOWN_HOLD_S + 1.0)
    # 21 / 0.75 = 28: gear 2 (the dip, 10 / 0.75 = 13.3, would be gear 1).
    assert switches(decisions) == [(3, 2)]
    (down,) = [d for d in decisions if d.switched]
    assert "(the gear of 21 qps, the highest read over the hold)" in down.reason
    # 21 qps stays within gear 2 and above its band (15): no switch back up, nor further down.
    decisions, state = drive(state, lambda _t: 21.0, 120.0, start_s=DEFAULT_DOWN_HOLD_S + 1.0)
    assert switches(decisions) == [] and state.gear == 2
