"""InferLine's tuner (Algorithms 3 and 4) as a pure policy: hand-computed replica counts, the
scale-down delay, boot times, the most cost-effective type, and the budget as a property."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.policies.tuner import (
    CPU_BOOT_S,
    GPU_BOOT_S,
    Booting,
    TunerConfig,
    TunerStage,
    TunerState,
    default_boot_s,
    fleet_cost_usd_per_hr,
    initial_state,
    load_stopped,
    ready_fleets,
    tune,
    utilisation_target,
)
from estimator.catalog import Catalog, InstanceType
from estimator.errors import UnknownInstanceTypeError, WorkloadError
from estimator.fleet import Fleet

WINDOWS_S = (1.0, 2.0, 4.0)


def steady(rate_qps: int, start_s: float, end_s: float) -> np.ndarray:
    """Evenly spaced arrivals; a power-of-two rate keeps every time exact in binary, so each window
    of w seconds holds exactly rate x w of them."""
    return start_s + np.arange(int((end_s - start_s) * rate_qps)) / rate_qps


def one_type_stage() -> TunerStage:
    # s 0.5, mu 32 qps, rho 0.8: a stage of 3 planned for 128 qps.
    return TunerStage("resnet", 0.5, {"g": 3}, {"g": 32.0}, 0.8)


def config(budget_usd_per_hr: float = 100.0, **kwargs: Any) -> TunerConfig:
    return TunerConfig(
        windows_s=WINDOWS_S,
        planned_rate_qps=(128.0, 128.0, 128.0),
        budget_usd_per_hr=budget_usd_per_hr,
        prices_usd_per_hr={"g": 1.0, "gpu": 1.0, "cpu": 0.05},
        boot_s={"g": 60.0, "gpu": 60.0, "cpu": 30.0},
        **kwargs,
    )


# --- Algorithm 3: scale up -------------------------------------------------------------------


def test_a_step_above_the_envelope_scales_up_to_k() -> None:
    plan, cfg = one_type_stage(), config()
    state = initial_state([plan], now_s=0.0)
    decisions, after = tune(steady(256, 90.0, 100.0), 100.0, state, [plan], cfg)
    # k = ceil(r_max s / (mu rho)) = ceil(256 x 0.5 / (32 x 0.8)) = ceil(5.0) = 5: add 2.
    assert [(d.action, d.stage, d.instance_type, d.count) for d in decisions] == [
        ("scale_up", "resnet", "g", 2)
    ]
    assert after.fleets["resnet"]["g"] == 5
    assert after.last_change_s == 100.0
    assert decisions[0].cost_usd_per_hr_after == pytest.approx(5.0)
    reason = decisions[0].reason
    for text in ("window 1 s", "256 qps > planned 128 qps", "r_max 256", "rho 0.8", "k 5"):
        assert text in reason, reason


def test_the_specs_max_counts_cap_a_scale_up_per_type() -> None:
    # The step above wants 5 x g (k 5); a cap of 4 stops it at 4, and the shortfall is said.
    plan = one_type_stage()
    cfg = dataclasses.replace(config(), max_counts={"g": 4})
    state = initial_state([plan], now_s=0.0)
    decisions, after = tune(steady(256, 90.0, 100.0), 100.0, state, [plan], cfg)
    assert after.fleets["resnet"]["g"] == 4
    assert (decisions[0].action, decisions[0].count) == ("scale_up", 1)
    # At the cap, nothing more is launched however high the load, and the shortfall names the
    # cap, not the budget (it read "the fleet costs 4 of the 100 USD/hr budget and no type
    # fits").
    decisions, again = tune(steady(1024, 190.0, 200.0), 200.0, after, [plan], cfg)
    assert again.fleets["resnet"]["g"] == 4
    assert not [d for d in decisions if d.action == "scale_up"]
    (capped,) = [d for d in decisions if d.action == "budget_capped"]
    assert "but max_counts allows no more of g (the fleet costs 4 of the" in capped.reason
    assert "no type fits" not in capped.reason
    with pytest.raises(WorkloadError, match="max count"):
        dataclasses.replace(config(), max_counts={"g": -1})


def test_a_budget_capped_replica_target_says_what_it_lacks_not_what_it_has() -> None:
    """InferLine's k (5 here) against a budget that pays for 4 instances: the stage has 4 x 32
    qps and lacks one instance; the reason said "short 128 qps" (the rate it has, as a tester
    read on the demo: "have 34.8 qps; short 34.8 qps")."""
    plan = one_type_stage()
    state = initial_state([plan], now_s=0.0)
    decisions, after = tune(steady(256, 90.0, 100.0), 100.0, state, [plan], config(4.0))
    assert after.fleets["resnet"]["g"] == 4
    capped = [d for d in decisions if d.action == "budget_capped"]
    assert [(d.instance_type, d.count) for d in capped] == [("g", 1)], decisions
    assert "have 128 qps; short 1 of the 5 instances its rate needs" in capped[0].reason


def test_the_caps_bound_a_type_over_all_the_stages_of_the_app() -> None:
    """A cap holds for the app's instances of a type summed over its stages, as the planner's:
    two stages of 3 x g each under a cap of 7 take one more g between them, whatever both want
    (a tester's demo ran 9 of a type capped at 6, each stage within it)."""
    first = TunerStage("small", 0.5, {"g": 3}, {"g": 32.0}, 0.8)
    second = TunerStage("large", 0.5, {"g": 3}, {"g": 32.0}, 0.8)
    cfg = dataclasses.replace(config(), max_counts={"g": 7})
    state = initial_state([first, second], now_s=0.0)
    decisions, after = tune(steady(256, 90.0, 100.0), 100.0, state, [first, second], cfg)
    assert after.fleets["small"]["g"] + after.fleets["large"]["g"] == 7
    assert sum(d.count for d in decisions if d.action == "scale_up") == 1
    decisions, again = tune(steady(1024, 190.0, 200.0), 200.0, after, [first, second], cfg)
    assert again.fleets["small"]["g"] + again.fleets["large"]["g"] == 7
    assert not [d for d in decisions if d.action == "scale_up"]


def test_r_max_is_the_largest_rate_of_the_exceeding_windows() -> None:
    # A 1 s burst at 512 qps inside 256 qps: the 1 s window sees 512, the 4 s window 320.
    arrivals = np.sort(np.concatenate([steady(256, 90.0, 100.0), steady(256, 95.0, 96.0)]))
    plan = one_type_stage()
    decisions, after = tune(arrivals, 100.0, initial_state([plan], 0.0), [plan], config())
    # ceil(512 x 0.5 / 25.6) = 10
    assert after.fleets["resnet"]["g"] == 10
    assert "r_max 512" in decisions[0].reason


def test_load_that_has_stopped_buys_nothing_however_busy_the_memory_reads() -> None:
    """Twice the planned rate for 30 s, then nothing: a second after it the tuner scales up;
    with the persistence test on, a pause of 20 of the load's own gaps, and at least 2 s, is
    load that has stopped, and the minute of memory that still holds the burst buys nothing (a
    live tuner had bought an instance 49 s after the load stopped, and until the pause had to
    last the persistence test's 15 s, one that had stopped 14 s before). InferLine's envelope as
    written (no persistence test) still reads it."""
    plan = one_type_stage()
    arrivals = steady(256, 60.0, 90.0)
    on = dataclasses.replace(config(), persistence_s=15.0)

    def ups(now_s: float, cfg: TunerConfig) -> int:
        decisions, _ = tune(arrivals, now_s, initial_state([plan], 0.0), [plan], cfg)
        return sum(d.count for d in decisions if d.action == "scale_up")

    assert ups(91.0, on) > 0  # the load is there
    assert ups(92.5, on) == 0  # 2.5 s without an arrival, at 256 qps: stopped
    assert ups(104.0, on) == 0
    assert ups(139.0, on) == 0
    assert ups(139.0, config()) > 0  # without the test, the memory's burst buys
    # A slow load's pause of a few seconds is its own pace; the persistence stretch bounds it.
    slow = np.arange(60.0, 100.0, 0.5)  # 2 qps: 20 gaps are 10 s
    assert not load_stopped(slow, 99.5 + 9.9, 15.0) and load_stopped(slow, 99.5 + 10.0, 15.0)
    trickle = np.arange(60.0, 100.0, 4.0)  # a query every 4 s: stopped after the stretch only
    assert not load_stopped(trickle, 96.0 + 14.9, 15.0) and load_stopped(trickle, 111.0, 15.0)


def test_no_change_within_the_envelope() -> None:
    plan = one_type_stage()
    state = initial_state([plan], 0.0)
    arrivals = steady(128, 0.0, 100.0)  # exactly the planned envelope
    for now_s in (5.0, 50.0, 100.0):  # before and after the scale-down delay
        decisions, after = tune(arrivals, now_s, state, [plan], config())
        assert decisions == []
        assert after == state


def test_booting_instances_count_for_capacity_and_cost_but_serve_only_after_boot() -> None:
    plan, cfg = one_type_stage(), config()
    arrivals = steady(256, 90.0, 102.0)
    _, state = tune(arrivals[arrivals <= 100.0], 100.0, initial_state([plan], 0.0), [plan], cfg)
    assert [(b.instance_type, b.ready_at_s) for b in state.booting] == [("g", 160.0)] * 2
    assert fleet_cost_usd_per_hr(state, cfg.prices_usd_per_hr) == pytest.approx(5.0)
    # The same burst a second later launches nothing more: the booting two already cover it.
    decisions, again = tune(arrivals, 101.0, state, [plan], cfg)
    assert decisions == [] and again.fleets == state.fleets
    assert ready_fleets(state, 159.9)["resnet"]["g"] == 3
    assert ready_fleets(state, 160.0)["resnet"]["g"] == 5
    _, later = tune(arrivals, 160.0, state, [plan], cfg)
    assert later.booting == ()


def test_boot_times_default_by_gpu_and_are_configurable() -> None:
    catalog = Catalog(
        [InstanceType("g4dn.xlarge", 0.526, gpus=1), InstanceType("c5.large", 0.085, vcpus=2)]
    )
    assert default_boot_s(catalog) == {"g4dn.xlarge": GPU_BOOT_S, "c5.large": CPU_BOOT_S}
    cfg = TunerConfig.from_planning_trace(
        steady(128, 0.0, 120.0),
        0.25,
        budget_usd_per_hr=10.0,
        catalog=catalog,
        boot_s={"c5.large": 12.0},
    )
    assert cfg.boot_s == {"g4dn.xlarge": 60.0, "c5.large": 12.0}
    assert cfg.windows_s == (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
    assert cfg.planned_rate_qps == pytest.approx([128.0] * 9)
    assert cfg.prices_usd_per_hr["g4dn.xlarge"] == 0.526


# --- Algorithm 4: scale down -----------------------------------------------------------------


def test_scale_down_waits_for_the_delay_and_follows_the_recent_rate() -> None:
    plan, cfg = one_type_stage(), config()
    arrivals = np.concatenate([steady(256, 90.0, 100.0), steady(32, 100.0, 200.0)])
    _, state = tune(arrivals[arrivals <= 100.0], 100.0, initial_state([plan], 0.0), [plan], cfg)
    assert state.fleets["resnet"]["g"] == 5

    def at(now_s: float) -> list[tuple[str, int]]:
        decisions, _ = tune(arrivals[arrivals <= now_s], now_s, state, [plan], cfg)
        return [(d.action, d.count) for d in decisions]

    assert at(112.0) == []  # 12 s < 15 s since the last change
    assert at(116.0) == []  # the burst is still in the last 60 s: 5 are needed
    decisions, after = tune(arrivals[arrivals <= 161.0], 161.0, state, [plan], cfg)
    # Recent rate 32 qps: k = ceil(32 x 0.5 / 25.6) = 1.
    assert [(d.action, d.count) for d in decisions] == [("scale_down", 4)]
    assert after.fleets["resnet"]["g"] == 1 and after.last_change_s == 161.0
    assert "recent peak 32 qps" in decisions[0].reason and "k 1" in decisions[0].reason


@pytest.mark.parametrize(
    ("rate_qps", "first_down_at_s"),
    # 32 qps: 960 arrivals by 30 s tell the rate within 5% (400 would): the first scale-down
    # comes at 30 s. 4 qps: 236 arrivals by 59 s do not: it waits for the longest window, 60 s.
    [(32, 30.0), (4, 60.0)],
)
def test_the_first_scale_down_waits_as_long_as_the_evidence_needs(
    rate_qps: int, first_down_at_s: float
) -> None:
    plan = one_type_stage()
    cfg = TunerConfig(
        windows_s=(1.0, 2.0, 60.0),
        planned_rate_qps=(128.0, 128.0, 128.0),
        budget_usd_per_hr=100.0,
        prices_usd_per_hr={"g": 1.0},
        boot_s={"g": 60.0},
    )
    assert cfg.first_down_s == 30.0 and cfg.first_down_precision == 0.05
    arrivals = steady(rate_qps, 0.0, 120.0)
    start = initial_state([plan], 0.0)

    def first_down_s() -> float:
        for now_s in np.arange(1.0, 120.0, 1.0):
            decisions, _ = tune(arrivals[arrivals <= now_s], float(now_s), start, [plan], cfg)
            if decisions:
                assert [(d.action, d.count) for d in decisions] == [("scale_down", 2)]
                return float(now_s)
        raise AssertionError("never scaled down")

    assert first_down_s() == first_down_at_s
    # Without the rule (None), the tuner watches its longest window first, as InferLine does.
    cfg = dataclasses.replace(cfg, first_down_s=None)
    assert first_down_s() == 60.0


def test_scale_down_keeps_min_instances_and_stops_booting_ones_first() -> None:
    plan = TunerStage("resnet", 0.5, {"g": 3}, {"g": 32.0}, 0.8, min_instances=2)
    cfg = config()
    _, state = tune(steady(256, 90.0, 100.0), 100.0, initial_state([plan], 0.0), [plan], cfg)
    assert len(state.booting) == 2
    decisions, after = tune(np.array([]), 130.0, state, [plan], cfg)
    assert [(d.action, d.count) for d in decisions] == [("scale_down", 3)]
    assert after.fleets["resnet"]["g"] == 2
    assert after.booting == ()  # both booting instances went first
    assert ready_fleets(after, 130.0)["resnet"]["g"] == 2


def test_a_stage_scaled_below_its_plan_comes_back_within_the_envelope() -> None:
    plan, cfg = one_type_stage(), config()
    state = TunerState(fleets={"resnet": Fleet.of({"g": 1})}, last_change_s=0.0)
    decisions, after = tune(steady(128, 0.0, 100.0), 100.0, state, [plan], cfg)
    # Within the envelope, but 128 x 0.5 / 0.8 = 80 qps needs 3 x 32: back to the plan.
    assert [(d.action, d.count) for d in decisions] == [("scale_up", 2)]
    assert after.fleets["resnet"]["g"] == 3
    assert "below plan" in decisions[0].reason


@pytest.mark.parametrize("curve", [None, ((0.5, 0.6), (1.0, 1.0), (2.0, 1.7))])
def test_a_young_memory_held_by_the_live_tuner_buys_back_the_plan_and_no_more(
    curve: tuple[tuple[float, float], ...] | None,
) -> None:
    """The live tuner's hold (``hold_young_memory``): 20 s of memory, a backlog of 256 queries
    in its first second then 128 qps (the plan's rate), reads 384 qps at the 1 s window, which
    the persistence test cannot take out of so young a memory. A stage at its plan buys nothing;
    one below it comes back to the plan and no further; past twice the persistence (30 s) the
    test reads the load as it is, and a rise that lasts is bought. The replay's tuner (the hold
    off) buys for the backlog. InferLine's model and a capacity curve alike."""
    plan = dataclasses.replace(one_type_stage(), capacity_curve=curve)
    arrivals = np.sort(np.concatenate([80.0 + np.arange(256) / 256, steady(128, 81.0, 100.0)]))
    held = dataclasses.replace(config(), persistence_s=15.0, hold_young_memory=True)
    at_plan = initial_state([plan], 0.0)
    below = TunerState(fleets={"resnet": Fleet.of({"g": 1})}, last_change_s=0.0)

    def fleet_after(state: TunerState, cfg: TunerConfig, seen: np.ndarray = arrivals) -> int:
        _, after = tune(seen, float(seen[-1]), state, [plan], cfg)
        return after.fleets["resnet"]["g"]

    assert fleet_after(at_plan, held) == 3
    assert fleet_after(below, held) == 3
    # The restore says why it stops at the plan.
    restored, _ = tune(arrivals, float(arrivals[-1]), below, [plan], held)
    assert restored and all("below plan" in d.reason for d in restored)
    assert all("a young memory buys back the plan at most" in d.reason for d in restored)
    replayed = dataclasses.replace(held, hold_young_memory=False)
    assert fleet_after(at_plan, replayed) > 3
    assert fleet_after(below, replayed) > 3
    rise = steady(256, 60.0, 100.0)  # twice the plan's rate for 40 s: old enough to be read
    assert fleet_after(at_plan, held, rise) > 3
    assert fleet_after(at_plan, held, rise[rise < 89.0]) == 3  # 29 s of it: held


def test_a_memory_that_fills_its_ring_is_never_held_young() -> None:
    """The live tuner's memory is the serving loop's ring of arrivals: at a rate that fills it
    in less than twice the persistence its span is the ring's, not the traffic's age, and the
    hold would never end (a stage at its plan would never grow). A rise of 40 s at twice the
    plan's rate, read through a ring of fewer arrivals than it holds, is bought; the same
    arrivals in a memory the hold reads as young (a ring large enough) are not."""
    plan = one_type_stage()
    rise = steady(256, 60.0, 100.0)
    ring = rise[rise >= 80.0]  # what a ring of that many arrivals keeps: the last 20 s
    held = dataclasses.replace(config(), persistence_s=15.0, hold_young_memory=True)

    def fleet_after(cfg: TunerConfig) -> int:
        _, after = tune(ring, float(ring[-1]), initial_state([plan], 0.0), [plan], cfg)
        return after.fleets["resnet"]["g"]

    assert fleet_after(held) == 3  # young: 20 s of arrivals, the hold at the plan
    assert fleet_after(dataclasses.replace(held, memory_ring=ring.size)) > 3
    assert fleet_after(dataclasses.replace(held, memory_ring=ring.size + 1)) == 3


def test_a_young_memorys_window_longer_than_the_persistence_is_held_until_it_is_tested() -> None:
    """The persistence test takes a burst out of a window w once the arrivals span twice
    max(w, persistence): with a persistence of 4 s, the 1 and 4 s windows at 8 s, the 16 s one
    at 32 s. A restarted service's backlog (2,048 queries in its first 2.5 s, then the plan's
    128 qps; over half the persistence, so no second of it stands out of its stretch,
    ``clip_short_bursts``) read 188 qps on the 16 s window at 10 s, and the stage's hold, over
    at 8 s, let it buy an instance; a window the test will read is held at the plan until it
    does. A rise (256 qps) is read on the shorter windows and bought as before."""
    plan = one_type_stage()
    held = dataclasses.replace(
        config(), windows_s=(1.0, 4.0, 16.0), persistence_s=4.0, hold_young_memory=True
    )
    backlog = np.sort(
        np.concatenate([80.0 + np.arange(2048) * 2.5 / 2048, steady(128, 82.5, 90.0)])
    )

    def fleet_after(seen: np.ndarray, cfg: TunerConfig = held) -> int:
        _, after = tune(seen, float(seen[-1]), initial_state([plan], 0.0), [plan], cfg)
        return after.fleets["resnet"]["g"]

    assert fleet_after(backlog) == 3
    assert fleet_after(steady(256, 80.0, 90.0)) > 3
    assert fleet_after(backlog, dataclasses.replace(held, hold_young_memory=False)) > 3
    # A 32 s window, planned at 64 qps, under 192 qps for 59 s: never tested in a minute's memory,
    # it is read whole, as it is in steady traffic (held, it would be held for good).
    longest = dataclasses.replace(
        held, windows_s=(1.0, 4.0, 32.0), planned_rate_qps=(256.0, 256.0, 64.0)
    )
    assert fleet_after(30.0 + np.arange(59 * 192) / 192, longest) == 4


# --- mixed stages and the budget -------------------------------------------------------------


def mixed_stage() -> TunerStage:
    # gpu: 100 qps per 1.00 USD/hr; cpu: 10 qps per 0.05 USD/hr, twice as cost-effective.
    return TunerStage("mix", 1.0, {"gpu": 1}, {"gpu": 100.0, "cpu": 10.0}, 0.8)


def test_a_mixed_stage_adds_the_most_cost_effective_type() -> None:
    plan = mixed_stage()
    decisions, after = tune(
        steady(256, 90.0, 100.0), 100.0, initial_state([plan], 0.0), [plan], config()
    )
    # Need 256 / 0.8 = 320 qps; have 100: 22 cpu instances (220 qps).
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [("scale_up", "cpu", 22)]
    assert dict(after.fleets["mix"]) == {"gpu": 1, "cpu": 22}
    assert [b.ready_at_s for b in after.booting] == [130.0] * 22


def test_the_budget_caps_a_scale_up_and_says_so() -> None:
    plan = mixed_stage()
    cfg = config(budget_usd_per_hr=1.5)
    decisions, after = tune(
        steady(256, 90.0, 100.0), 100.0, initial_state([plan], 0.0), [plan], cfg
    )
    # 0.5 USD/hr left buys 10 cpu (100 qps); a gpu no longer fits: 120 qps short.
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [
        ("scale_up", "cpu", 10),
        ("budget_capped", "cpu", 12),
    ]
    assert fleet_cost_usd_per_hr(after, cfg.prices_usd_per_hr) <= 1.5 + 1e-9
    assert "short 120 qps" in decisions[1].reason and "1.5 USD/hr budget" in decisions[1].reason


def test_a_fleet_over_a_lowered_budget_is_shed_least_cost_effective_first() -> None:
    """The budget lowered under the fleet the tuner reached (2 gpu + 10 cpu, 2.5 USD/hr, budget
    1.6), at once, whatever the scale-down delay: it stops a gpu (100 qps per USD/hr against the
    cpus' 200); the load (320 qps needed) then buys the two cpus the 0.1 USD/hr left pays for."""
    plan = mixed_stage()
    cfg = config(budget_usd_per_hr=1.6)
    state = TunerState(fleets={"mix": Fleet.of({"gpu": 2, "cpu": 10})}, last_change_s=99.0)
    decisions, after = tune(steady(256, 90.0, 100.0), 100.0, state, [plan], cfg)
    assert [(d.action, d.instance_type, d.count) for d in decisions[:1]] == [
        ("scale_down", "gpu", 1)
    ]
    # What it sheds from is the fleet it asks for: the live fleet may be within the budget
    # already (the budget guard's drain), so the reason does not call it "the fleet".
    assert "over the budget: the fleet the tuner asks for costs 2.5 USD/hr" in decisions[0].reason
    assert [(d.action, d.instance_type, d.count) for d in decisions[1:]] == [
        ("scale_up", "cpu", 2),
        ("budget_capped", "cpu", 10),
    ]
    assert dict(after.fleets["mix"]) == {"gpu": 1, "cpu": 12}
    assert fleet_cost_usd_per_hr(after, cfg.prices_usd_per_hr) == pytest.approx(1.6)
    assert after.last_change_s == 100.0
    # Never below a stage's last instance, even when that one alone is over the budget.
    alone = TunerState(fleets={"mix": Fleet.of({"gpu": 1})}, last_change_s=0.0)
    decisions, kept = tune(steady(8, 90.0, 100.0), 100.0, alone, [plan], config(0.5))
    assert dict(kept.fleets["mix"]) == {"gpu": 1}
    assert not [d for d in decisions if d.action == "scale_down"]


@pytest.mark.parametrize("gpu_boots", [True, False], ids=["gpu booting", "gpu serving"])
def test_a_budget_cut_keeps_the_stages_serving_instance_over_one_booting(gpu_boots: bool) -> None:
    """A stage serving on a cpu (2 qps for 0.05 USD/hr, 40 qps per USD/hr) beside a gpu the
    tuner launched on a rise (100 qps for 1.0, 100 per USD/hr); the budget cut to 1.0, which
    pays for either alone. While the gpu boots, the gpu goes: stopping the cpu (the least
    capacity per USD/hr lost) left the stage serving nothing until the gpu booted. Once the gpu
    serves, the cpu goes, as before."""
    plan = TunerStage("mix", 1.0, {"cpu": 1}, {"gpu": 100.0, "cpu": 2.0}, 0.8)
    state = TunerState(
        fleets={"mix": Fleet.of({"cpu": 1, "gpu": 1})},
        booting=(Booting("mix", "gpu", 95.0, 155.0),) if gpu_boots else (),
        last_change_s=95.0,
    )
    decisions, after = tune(steady(1, 90.0, 100.0), 100.0, state, [plan], config(1.0))
    shed = [(d.action, d.instance_type, d.count) for d in decisions if d.action == "scale_down"]
    assert shed == [("scale_down", "gpu" if gpu_boots else "cpu", 1)], [d.reason for d in decisions]
    assert after.fleets["mix"].get("gpu" if gpu_boots else "cpu", 0) == 0
    assert after.fleets["mix"].get("cpu" if gpu_boots else "gpu", 0) >= 1
    assert fleet_cost_usd_per_hr(after, config().prices_usd_per_hr) <= 1.0 + 1e-9
    assert not after.booting


def test_a_fleet_over_a_lowered_cap_is_shed_to_it() -> None:
    """A cap lowered under the fleet the tuner reached (5 x g, the spec now allows 3): two g
    stop at once, each said, whatever the load wants; then nothing more of g is launched."""
    plan = one_type_stage()
    cfg = dataclasses.replace(config(), max_counts={"g": 3})
    state = TunerState(fleets={"resnet": Fleet.of({"g": 5})}, last_change_s=99.0)
    decisions, after = tune(steady(256, 90.0, 100.0), 100.0, state, [plan], cfg)
    downs = [d for d in decisions if d.action == "scale_down"]
    assert [(d.instance_type, d.count) for d in downs] == [("g", 1), ("g", 1)]
    assert all("over the cap: " in d.reason and "allows 3" in d.reason for d in downs)
    assert not [d for d in decisions if d.action == "scale_up"]
    assert after.fleets["resnet"]["g"] == 3


def base_bound_capacity_qps(fleet: Mapping[str, int]) -> float:
    """A Kairos-like mix: the cpus serve only small queries, so the stage serves at most 3x what
    its gpus alone do (the gpus are the bottleneck past 20 cpus per gpu)."""
    gpu, cpu = fleet.get("gpu", 0), fleet.get("cpu", 0)
    return min(100.0 * gpu + 10.0 * cpu, 300.0 * gpu)


def kairos_like_stage(fleet: Mapping[str, int]) -> TunerStage:
    return TunerStage(
        "mix",
        1.0,
        fleet,
        {"gpu": 100.0, "cpu": 10.0},
        0.8,
        capacity_model=base_bound_capacity_qps,
    )


def test_with_a_capacity_model_a_base_bound_stage_adds_the_base_type() -> None:
    plan = kairos_like_stage({"gpu": 1, "cpu": 20})  # 300 qps, the gpu is the bottleneck
    assert plan.planned_capacity_qps == 300.0
    decisions, after = tune(
        steady(256, 90.0, 100.0), 100.0, initial_state([plan], 0.0), [plan], config()
    )
    # Need 320 qps: another cpu adds nothing (min(310, 300)); a gpu adds 100 qps for 1 USD/hr.
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [("scale_up", "gpu", 1)]
    assert dict(after.fleets["mix"]) == {"gpu": 2, "cpu": 20}
    # Without the model the sum of mu_t says the cheap cpus serve it, which they cannot.
    plain = TunerStage("mix", 1.0, {"gpu": 1, "cpu": 20}, {"gpu": 100.0, "cpu": 10.0}, 0.8)
    decisions, _ = tune(
        steady(256, 90.0, 100.0), 100.0, initial_state([plain], 0.0), [plain], config()
    )
    assert [(d.action, d.instance_type) for d in decisions] == [("scale_up", "cpu")]


def test_with_a_capacity_model_scale_up_takes_the_best_marginal_value_each_step() -> None:
    plan = kairos_like_stage({"gpu": 1, "cpu": 0})  # 100 qps
    decisions, after = tune(
        steady(256, 90.0, 100.0), 100.0, initial_state([plan], 0.0), [plan], config()
    )
    # Need 320: cpus at 200 qps per USD/hr until the gpu binds (20 cpus, 300 qps), then a gpu.
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [
        ("scale_up", "cpu", 20),
        ("scale_up", "gpu", 1),
    ]
    assert base_bound_capacity_qps(after.fleets["mix"]) >= 320.0


def test_with_a_capacity_model_scale_down_sheds_what_adds_nothing_first() -> None:
    plan = kairos_like_stage({"gpu": 1, "cpu": 1})
    state = TunerState(fleets={"mix": Fleet.of({"gpu": 1, "cpu": 30})}, last_change_s=0.0)
    decisions, after = tune(steady(64, 40.0, 100.0), 100.0, state, [plan], config())
    # Need 64 / 0.8 = 80 qps. The 10 cpus past the bottleneck add nothing, so they go first;
    # then cpus (10 qps lost per 0.05 USD/hr) while 80 qps stay: down to 1 gpu + 0 cpus would be
    # 100 qps, but one cpu stays (a planned type keeps an instance).
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [("scale_down", "cpu", 29)]
    assert dict(after.fleets["mix"]) == {"gpu": 1, "cpu": 1}


def test_with_a_capacity_model_the_budget_still_caps() -> None:
    plan = kairos_like_stage({"gpu": 1, "cpu": 20})
    cfg = config(budget_usd_per_hr=2.0)  # 1 + 20 x 0.05 = 2.0: nothing more fits
    decisions, after = tune(
        steady(256, 90.0, 100.0), 100.0, initial_state([plan], 0.0), [plan], cfg
    )
    assert [d.action for d in decisions] == ["budget_capped"]
    assert fleet_cost_usd_per_hr(after, cfg.prices_usd_per_hr) <= 2.0 + 1e-9


def test_utilisation_target_reads_the_capacity_model() -> None:
    fleet = {"gpu": 1, "cpu": 30}
    mu = {"gpu": 100.0, "cpu": 10.0}
    assert utilisation_target(fleet, mu, 1.0, 240.0) == pytest.approx(0.6)  # 240 / 400
    assert utilisation_target(fleet, mu, 1.0, 240.0, base_bound_capacity_qps) == 0.8  # / 300


def test_a_mixed_stage_stops_the_least_cost_effective_first() -> None:
    plan = TunerStage("mix", 1.0, {"cpu": 1}, {"gpu": 100.0, "cpu": 10.0}, 0.8)
    state = TunerState(fleets={"mix": Fleet.of({"gpu": 1, "cpu": 22})}, last_change_s=0.0)
    decisions, after = tune(steady(32, 40.0, 100.0), 100.0, state, [plan], config())
    # Need 32 / 0.8 = 40 qps: the gpu goes (320 -> 220 qps), then 18 cpu (-> 40 qps).
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [
        ("scale_down", "gpu", 1),
        ("scale_down", "cpu", 18),
    ]
    assert dict(after.fleets["mix"]) == {"gpu": 0, "cpu": 4}


def test_scale_down_keeps_one_instance_of_every_planned_type() -> None:
    # The planned gpu is the least cost-effective, but the planner chose it (in a mix it is the
    # type that serves the large queries within the SLO): its last instance stays.
    plan = mixed_stage()
    state = TunerState(fleets={"mix": Fleet.of({"gpu": 1, "cpu": 22})}, last_change_s=0.0)
    decisions, after = tune(steady(32, 40.0, 100.0), 100.0, state, [plan], config())
    assert [(d.action, d.instance_type, d.count) for d in decisions] == [
        ("scale_down", "cpu", 22),
    ]
    assert dict(after.fleets["mix"]) == {"gpu": 1, "cpu": 0}


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[TunerStage], TunerConfig, list[tuple[float, int]]]:
    types = ["a", "b", "c"]
    prices = {t: draw(st.floats(0.01, 5.0)) for t in types}
    plans = []
    for i in range(draw(st.integers(1, 3))):
        kinds = draw(st.lists(st.sampled_from(types), min_size=1, max_size=3, unique=True))
        mu = {t: draw(st.floats(1.0, 200.0)) for t in kinds}
        fleet = {kinds[0]: draw(st.integers(1, 3))}
        plans.append(
            TunerStage(f"s{i}", draw(st.floats(0.05, 1.0)), fleet, mu, draw(st.floats(0.3, 1.0)))
        )
    planned_cost = sum(prices[t] * n for plan in plans for t, n in plan.fleet.items())
    cfg = TunerConfig(
        windows_s=WINDOWS_S,
        planned_rate_qps=tuple(draw(st.floats(1.0, 300.0)) for _ in WINDOWS_S),
        budget_usd_per_hr=planned_cost + draw(st.floats(0.0, 20.0)),
        prices_usd_per_hr=prices,
        boot_s={t: draw(st.sampled_from([0.0, 30.0, 60.0])) for t in types},
        scale_down_delay_s=draw(st.sampled_from([0.0, 15.0])),
    )
    # (seconds of traffic, rate as a power of two) per tick
    ticks = draw(
        st.lists(st.tuples(st.sampled_from([1.0, 5.0, 20.0]), st.integers(0, 10)), max_size=12)
    )
    return plans, cfg, ticks


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_the_fleet_never_costs_more_than_the_budget(
    scenario: tuple[list[TunerStage], TunerConfig, list[tuple[float, int]]],
) -> None:
    plans, cfg, ticks = scenario
    state = initial_state(plans, 0.0)
    now_s, pieces = 0.0, [np.array([])]
    for duration_s, log2_rate in ticks:
        pieces.append(steady(2**log2_rate, now_s, now_s + duration_s))
        now_s += duration_s
        decisions, state = tune(np.concatenate(pieces), now_s, state, plans, cfg)
        cost = fleet_cost_usd_per_hr(state, cfg.prices_usd_per_hr)
        assert cost <= cfg.budget_usd_per_hr + 1e-9
        assert all(d.cost_usd_per_hr_after <= cfg.budget_usd_per_hr + 1e-9 for d in decisions)
        assert all(d.count > 0 and d.reason for d in decisions)
        for plan in plans:
            assert state.fleets[plan.name].total >= plan.min_instances
        for b in state.booting:
            assert b.ready_at_s > now_s
            assert ready_fleets(state, now_s)[b.stage][b.instance_type] >= 0


# --- the contract ----------------------------------------------------------------------------


def test_tune_is_deterministic_and_does_not_touch_its_inputs() -> None:
    plan, cfg = mixed_stage(), config(budget_usd_per_hr=1.5)
    state = initial_state([plan], 0.0)
    arrivals = steady(256, 90.0, 100.0)
    first = tune(arrivals, 100.0, state, [plan], cfg)
    assert tune(arrivals, 100.0, state, [plan], cfg) == first
    assert state == initial_state([plan], 0.0)


def test_utilisation_target_keeps_the_plan_at_the_planned_peak() -> None:
    rho = utilisation_target({"g": 3}, {"g": 32.0}, 0.5, 128.0)
    assert rho == pytest.approx(64.0 / 96.0)
    assert math.ceil(128.0 * 0.5 / (32.0 * rho) - 1e-9) == 3


def test_bad_inputs_are_rejected_at_the_boundary() -> None:
    with pytest.raises(WorkloadError, match="utilisation_target must be <= 1"):
        TunerStage("x", 1.0, {"g": 1}, {"g": 1.0}, 1.5)
    with pytest.raises(UnknownInstanceTypeError):
        TunerStage("x", 1.0, {"h": 1}, {"g": 1.0}, 0.5)
    with pytest.raises(WorkloadError, match="one planned rate per window"):
        TunerConfig((1.0, 2.0), (1.0,), 1.0, {"g": 1.0}, {"g": 1.0})
    with pytest.raises(WorkloadError, match="first_down_s must be a finite number >= 0"):
        config(first_down_s=-1.0)
    with pytest.raises(WorkloadError, match="first_down_precision must be a finite number > 0"):
        config(first_down_precision=0.0)
    plan = TunerStage("x", 1.0, {"z": 1}, {"z": 1.0}, 0.5)
    with pytest.raises(UnknownInstanceTypeError, match="tuner's prices"):
        tune(np.array([]), 0.0, initial_state([plan], 0.0), [plan], config())


def test_a_short_planning_trace_reads_no_rate_on_windows_longer_than_itself() -> None:
    """A window longer than the planning trace reads count / window, a rate that falls with
    the window though the load never slowed: on a 12 s trace of a flat 30 qps the 60 s window
    read about 6 qps, and the replay's tuner read the same flat load as four times its plan and
    bought 2.8 times the plan's fleet. Every window kept reads the load."""
    from controlplane.policies.tuner import planning_envelope
    from estimator.traces import poisson_arrivals

    arrivals = poisson_arrivals(30.0, 12.0, np.random.default_rng(1))
    windows, rates = planning_envelope(arrivals, 0.5, 60.0)
    assert max(windows) <= 12.0 + min(windows)
    assert min(rates) >= 0.8 * 30.0, dict(zip(windows, rates, strict=True))
    long_enough = poisson_arrivals(30.0, 600.0, np.random.default_rng(1))
    assert max(planning_envelope(long_enough, 0.5, 60.0)[0]) == 60.0
