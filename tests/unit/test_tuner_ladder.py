"""The tuner on the sizing model's ladder (a pure policy): the target fleet for a load, a mix
change when another mix is cheaper (adding before removing), the saving that a mix change must
bring, the budget while two mixes overlap, and a blip read as noise."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from controlplane.policies.tuner import (
    ScalingDecision,
    TunerConfig,
    TunerStage,
    TunerState,
    fleet_cost_usd_per_hr,
    initial_state,
    ladder_fleet,
    ready_fleets,
    tune,
)
from estimator.envelope import DEFAULT_PERSISTENCE_S
from estimator.errors import WorkloadError
from estimator.fleet import Fleet

WINDOWS_S = (1.0, 2.0, 4.0, 8.0)
PLANNED_QPS = 32.0
PRICES = {"cpu": 0.1, "gpu": 0.5, "mid": 0.19}
BOOT_S = {"cpu": 30.0, "gpu": 60.0, "mid": 30.0}
# mu: a cpu serves 10 qps (100 qps per USD/hr), a gpu 100 qps (200 qps per USD/hr), a mid 20.
MU = {"cpu": 10.0, "gpu": 100.0, "mid": 20.0}


def steady(rate_qps: int, start_s: float, end_s: float) -> np.ndarray:
    """Evenly spaced arrivals; a power-of-two rate keeps every time exact in binary."""
    return start_s + np.arange(int((end_s - start_s) * rate_qps)) / rate_qps


def stage(
    ladder: tuple[tuple[float, Mapping[str, int]], ...] | None = None,
    fleet: Mapping[str, int] | None = None,
    mu: Mapping[str, float] = MU,
) -> TunerStage:
    # Planned at 32 qps: 4 cpu (40 qps). At twice the load the planner chose one gpu (100 qps,
    # $0.5/hr), cheaper than the 8 cpu ($0.8/hr) the same mix would need.
    rungs = ladder or ((0.5, {"cpu": 2}), (1.0, {"cpu": 4}), (2.0, {"gpu": 1}))
    return TunerStage(
        "m",
        1.0,
        fleet or {"cpu": 4},
        mu,
        1.0,
        capacity_curve=((0.5, 0.5), (1.0, 1.0), (2.0, 2.0)),
        ladder=rungs,
    )


def config(
    budget_usd_per_hr: float = 10.0,
    persistence_s: float | None = None,
    prices: Mapping[str, float] = PRICES,
    boot_s: Mapping[str, float] = BOOT_S,
) -> TunerConfig:
    return TunerConfig(
        windows_s=WINDOWS_S,
        planned_rate_qps=(PLANNED_QPS,) * len(WINDOWS_S),
        budget_usd_per_hr=budget_usd_per_hr,
        prices_usd_per_hr=prices,
        boot_s=boot_s,
        scale_down_delay_s=15.0,
        persistence_s=persistence_s,
    )


def minute_config() -> TunerConfig:
    """The tuner with a minute's memory, InferLine's windows up to it, the persistence test on
    and the plan's 32 qps at every window."""
    windows = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
    return dataclasses.replace(
        config(persistence_s=DEFAULT_PERSISTENCE_S),
        windows_s=windows,
        planned_rate_qps=(PLANNED_QPS,) * len(windows),
        recent_s=60.0,
    )


def ticks(
    plan: TunerStage, cfg: TunerConfig, arrivals: np.ndarray, until_s: float
) -> tuple[list[ScalingDecision], TunerState]:
    """Tick once a second from 1 to ``until_s`` with ``arrivals`` seen as they come (the tuner
    started at 0); every decision, and the final state. The fleet stays within the budget."""
    state = initial_state([plan], now_s=0.0)
    made: list[ScalingDecision] = []
    for now in np.arange(1.0, until_s + 1.0):
        seen = arrivals[arrivals <= now]
        decisions, state = tune(seen, float(now), state, [plan], cfg)
        made += decisions
        assert fleet_cost_usd_per_hr(state, PRICES) <= cfg.budget_usd_per_hr + 1e-9
    return made, state


def run(plan: TunerStage, cfg: TunerConfig, rate_qps: int, until_s: float) -> list[tuple[Any, ...]]:
    """Tick once a second from 0 to ``until_s`` with ``rate_qps`` arriving from 0; every
    decision as (at, action, type, count), and the final state's fleet."""
    decisions, state = ticks(plan, cfg, steady(rate_qps, 0.0, until_s), until_s)
    made: list[tuple[Any, ...]] = [(d.at_s, d.action, d.instance_type, d.count) for d in decisions]
    ready = ready_fleets(state, until_s + 1.0)["m"]
    made.append(("final", {t: n for t, n in ready.items() if n}))
    return made


def test_the_ladder_gives_the_planned_fleet_at_the_planned_load() -> None:
    plan = stage()
    target = ladder_fleet(plan, plan.capacity_at_load_qps(1.0), PRICES, 10.0)
    assert dict(target or {}) == {"cpu": 4}


def test_a_load_twice_the_plan_changes_the_mix_when_another_is_cheaper() -> None:
    plan = stage()
    # The target at 2x: the gpu rung ($0.5/hr) beats filling the cpu rung ($0.8/hr or more).
    assert dict(ladder_fleet(plan, 80.0, PRICES, 10.0) or {}) == {"gpu": 1}
    made = run(plan, config(), 64, 200.0)
    actions = [m for m in made if m[0] != "final"]
    # First the gpu comes (adding before removing), and only once it serves do the cpus stop.
    assert actions[0][1:] == ("scale_up", "gpu", 1)
    stops = [m for m in actions if m[1] == "scale_down"]
    assert stops and stops[0][2] == "cpu" and stops[0][0] >= actions[0][0] + BOOT_S["gpu"]
    assert made[-1] == ("final", {"gpu": 1})


def test_without_a_cheaper_mix_the_stage_grows_in_its_own_mix() -> None:
    # The 2x rung is the cpu mix doubled: no gpu is ever launched.
    plan = stage(((1.0, {"cpu": 4}), (2.0, {"cpu": 8})))
    made = run(plan, config(), 64, 120.0)
    assert all(m[2] == "cpu" for m in made if m[0] != "final")
    assert made[-1] == ("final", {"cpu": 8})


@pytest.mark.parametrize(("mid_usd_per_hr", "changes"), [(0.19, False), (0.15, True)])
def test_a_mix_change_needs_a_real_saving(mid_usd_per_hr: float, changes: bool) -> None:
    # At half the load the stage needs 20 qps: 2 cpu ($0.2/hr) in its own mix, or one mid. At
    # $0.19/hr the mid saves 5%, too little to launch it; at $0.15/hr it saves 25%.
    plan = stage(((0.5, {"mid": 1}), (1.0, {"cpu": 4})))
    cfg = config(prices={**PRICES, "mid": mid_usd_per_hr})
    state = initial_state([plan], now_s=0.0)
    arrivals = steady(16, 0.0, 300.0)
    launched = []
    for now in np.arange(1.0, 300.0):
        decisions, state = tune(arrivals[arrivals <= now], float(now), state, [plan], cfg)
        launched += [d.instance_type for d in decisions if d.action == "scale_up"]
    final = {t: n for t, n in state.fleets["m"].items() if n}
    if changes:
        assert launched == ["mid"] and final == {"mid": 1}
    else:
        assert launched == [] and final == {"cpu": 2}


def test_the_budget_holds_while_two_mixes_overlap() -> None:
    # $0.6/hr: the cpus ($0.4) and the gpu ($0.5) cannot run together, so the stage grows in
    # its own mix as far as the budget goes and says it is capped.
    plan = stage()
    made = run(plan, config(budget_usd_per_hr=0.6), 64, 120.0)
    assert all(m[2] != "gpu" for m in made if m[0] != "final" and m[1] == "scale_up")
    assert any(m[1] == "budget_capped" for m in made if m[0] != "final")


@pytest.mark.parametrize(
    "reached",
    [{"cpu": 4, "gpu": 1}, {"gpu": 1}],
    ids=["mid-change: cpus and the gpu", "changed: the gpu alone"],
)
def test_a_budget_cut_under_the_mix_moved_to_sheds_to_a_fleet_within_it(
    reached: dict[str, int],
) -> None:
    """The tuner moved the stage from the plan's cpus towards a gpu ($0.5/hr); the budget is cut
    to $0.45/hr, which the plan's floor (one cpu, $0.1/hr) fits (the API takes such a cut
    unforced). The gpu alone is over it, so it goes and the stage serves on cpus within the
    budget. Kept as the stage's last instance, the gpu was drained by the reconciler's budget
    guard and never bought back: the app served nothing, for good."""
    plan, cfg = stage(), config(budget_usd_per_hr=0.45)
    state = TunerState(fleets={"m": Fleet.of(reached)}, last_change_s=90.0, started_s=0.0)
    decisions, after = tune(steady(32, 40.0, 100.0), 100.0, state, [plan], cfg)
    assert fleet_cost_usd_per_hr(after, cfg.prices_usd_per_hr) <= 0.45 + 1e-9
    fleet = {t: n for t, n in after.fleets["m"].items() if n}
    assert fleet == {"cpu": 4}  # the planned load on the plan's mix, within the budget
    stopped = [(d.instance_type, d.count) for d in decisions if d.action == "scale_down"]
    assert stopped == [("gpu", 1)]  # the cpus that serve stay; the gpu goes
    assert decisions[-1].cost_usd_per_hr_after <= 0.45 + 1e-9


@pytest.mark.parametrize("persistence_s", [None, DEFAULT_PERSISTENCE_S])
def test_a_blip_buys_nothing_once_bursts_must_persist(persistence_s: float | None) -> None:
    # The planned rate with 200 extra queries inside half a second at 100 s.
    base = steady(32, 0.0, 200.0)
    blip = 100.0 + np.arange(200) / 400
    arrivals = np.sort(np.concatenate([base, blip]))
    plan, cfg = stage(), config(persistence_s=persistence_s)
    state = initial_state([plan], now_s=0.0)
    ups = []
    for now in np.arange(1.0, 200.0):
        decisions, state = tune(arrivals[arrivals <= now], float(now), state, [plan], cfg)
        ups += [d for d in decisions if d.action == "scale_up"]
    if persistence_s is None:
        assert ups  # read as load, the blip buys instances that boot after it is over
    else:
        assert ups == []
        assert dict(state.fleets["m"]) == {"cpu": 4}


def test_a_blip_in_a_minutes_memory_buys_nothing_at_the_windows_the_test_cannot_read() -> None:
    """The persistence test takes a burst out of a window w once the memory spans twice
    max(w, persistence): a minute's memory never does for the 32 and 60 s windows. At 28 qps
    against a plan of 32, five seconds' worth of queries inside the memory's last second lifted
    the 32 s window to 32.4 qps, over the plan: a replayed blip bought an instance that booted
    after it was over. The second that stands out of its stretch is read at the traffic's level
    (``clip_short_bursts``), so the blip buys nothing; a rise to 40 qps still buys."""
    cfg = minute_config()
    plan = stage()
    traffic = 40.0 + np.arange(60 * 28) / 28.0
    blip = 99.0 + np.arange(140) / 140.0
    with_blip = np.sort(np.concatenate([traffic, blip]))
    state = TunerState(fleets={"m": Fleet.of({"cpu": 4})}, last_change_s=0.0, started_s=0.0)
    decisions, after = tune(with_blip, 100.0, state, [plan], cfg)
    assert [d for d in decisions if d.action == "scale_up"] == []
    assert dict(after.fleets["m"]) == {"cpu": 4}
    rise = np.sort(np.concatenate([traffic, 70.0 + np.arange(30 * 12) / 12.0]))  # 40 qps, 30 s
    decisions, _ = tune(rise, 100.0, state, [plan], cfg)
    assert any(d.action == "scale_up" for d in decisions)


def test_the_sustained_load_is_read_on_the_longest_window_the_arrivals_fill() -> None:
    """A trace's first seconds (or a restart's): 10 s of arrivals at 33 qps against a plan of
    32, on a capacity curve with headroom at low load (a rung at 0.2x keeps half the plan). The
    minute's window held 10 s of arrivals, read as a sustained load of x0.17, and the curve's
    need, C*(f_sustained) f_live / f_sustained, bought the stage as for a burst over a sixth of
    the load (106 qps, 2.5x the plan's capacity). The 8 s window is the longest the arrivals
    fill: the need is the load's own."""
    windows = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
    cfg = dataclasses.replace(
        config(), windows_s=windows, planned_rate_qps=(PLANNED_QPS,) * len(windows)
    )
    # The capacity curve's own model (no ladder: the need is capacity_for_loads_qps's).
    plan = TunerStage(
        "m", 1.0, {"cpu": 4}, MU, 1.0, capacity_curve=((0.2, 0.5), (1.0, 1.0), (2.0, 1.8))
    )
    arrivals = np.arange(330) / 33.0
    decisions, _ = tune(arrivals, 10.0, initial_state([plan], now_s=0.0), [plan], cfg)
    (up,) = [d for d in decisions if d.action == "scale_up"]
    assert "sustained load x1.035 (window 8 s)" in up.reason, up.reason
    need = re.search(r"the planner's capacity at that load ([0-9.]+) qps", up.reason)
    assert need is not None and float(need.group(1)) <= 1.1 * 40.0 * 1.063, up.reason


@pytest.mark.parametrize("backlog_s", [1.0, 8.0])
def test_a_young_memory_restoring_the_plan_says_so_not_the_window_it_held(
    backlog_s: float,
) -> None:
    """The live tuner's hold (``hold_young_memory``): a restarted service's backlog, then the
    plan's 32 qps, in a memory of 20 s; a stage below its plan comes back to it and no further.
    Its reason had opened with the window over the plan and called the capped target "the
    planner's capacity at that load": it says below plan, the capacity at the load read, and
    the hold. A backlog of 512 queries in one second stands out of its persistence stretch and
    is read at the traffic's level (``clip_short_bursts``: it had lifted the 32 s window, which
    the persistence test never reads in a minute's memory, over the plan); one of 1,024 over
    8 s is read, and lifts the capacity at that load over the plan's (held at the plan)."""
    plan = stage()
    cfg = dataclasses.replace(
        config(persistence_s=DEFAULT_PERSISTENCE_S),
        windows_s=(1.0, 2.0, 4.0, 32.0),
        recent_s=60.0,
        hold_young_memory=True,
    )
    size = 512 if backlog_s == 1.0 else 1024
    backlog = 80.0 + np.arange(size) * backlog_s / size
    arrivals = np.sort(np.concatenate([backlog, steady(32, 80.0 + backlog_s, 100.0)]))
    below = TunerState(fleets={"m": Fleet.of({"cpu": 2})}, last_change_s=0.0)
    decisions, after = tune(arrivals, 100.0, below, [plan], cfg)
    assert dict(after.fleets["m"]) == {"cpu": 4}
    (up,) = decisions
    assert up.reason.startswith("scale_up: below plan: planned capacity 40 qps;"), up.reason
    assert "window 32 s saw" not in up.reason
    at_load = re.search(r"the planner's capacity at that load ([0-9.]+) qps", up.reason)
    assert at_load is not None, up.reason
    if backlog_s == 1.0:
        assert float(at_load.group(1)) == 40.0, up.reason  # the plan's own load
    else:
        assert float(at_load.group(1)) > 40.0, up.reason
    assert "need 40 qps" in up.reason
    assert "a young memory buys back the plan at most" in up.reason


def test_traffic_smoother_than_planned_is_sized_on_the_ladder_of_its_burstiness() -> None:
    # Planned on CV^2 4 arrivals: 4 cpu at the planned rate. The same rate of Poisson (or
    # smoother) arrivals needs 2 (the ladder planned on a CV^2 1 stand-in).
    smooth = stage(((0.5, {"cpu": 1}), (1.0, {"cpu": 2}), (2.0, {"cpu": 4})), {"cpu": 2})
    envelope = (PLANNED_QPS,) * len(WINDOWS_S)
    plan = dataclasses.replace(stage(), cv2=4.0, burstiness=((1.0, envelope, smooth),))
    cfg = dataclasses.replace(config(), recent_s=120.0)
    arrivals = steady(32, 0.0, 150.0)
    state = initial_state([plan], now_s=0.0)
    downs = []
    for now in np.arange(1.0, 151.0):
        decisions, state = tune(arrivals[arrivals <= now], float(now), state, [plan], cfg)
        downs += [(float(now), d) for d in decisions if d.action == "scale_down"]
        if now == 60.0:  # 1,920 gaps: too few to read the burstiness, the planned sizing
            assert dict(state.fleets["m"]) == {"cpu": 4}
    assert [d.count for _, d in downs] == [2]
    at_s, down = downs[0]
    assert at_s > 62.0  # on at least BURSTINESS_MIN_GAPS gaps
    assert "sized as CV^2 1" in down.reason
    # Evenly spaced arrivals, as a load generator's: positional, not "CV^2 1e-06".
    assert re.search(r"arrivals' CV\^2 0\.00000\d+ \(", down.reason), down.reason
    assert "e-0" not in down.reason
    assert dict(ready_fleets(state, 151.0)["m"]) == {"cpu": 2}


def test_a_sizing_by_burstiness_needs_the_planned_cv2() -> None:
    other = stage()
    with pytest.raises(WorkloadError, match="planned cv2"):
        TunerStage(
            "m",
            1.0,
            {"cpu": 4},
            MU,
            1.0,
            capacity_curve=((1.0, 1.0),),
            ladder=((1.0, {"cpu": 4}),),
            burstiness=((1.0, (PLANNED_QPS,) * len(WINDOWS_S), other),),
        )


def test_a_load_on_a_flat_stretch_of_the_ladder_keeps_the_rung_it_needs() -> None:
    # Planned on 3 cpu (30 qps); from 1.25x to 1.6x the planner kept 7 cpu (70 qps): any load
    # there needs exactly 70 qps, which 7 cpu serve. 70 qps is no whole number of the target's
    # rounding steps (half a percent of 30 qps): rounded up, the need passed the rung and bought
    # an eighth instance for nothing, and kept it while the load stayed on the stretch.
    rungs = ((0.5, {"cpu": 2}), (1.0, {"cpu": 3}), (1.25, {"cpu": 7}), (1.6, {"cpu": 7}))
    curve = ((0.5, 2 / 3), (1.0, 1.0), (1.25, 7 / 3), (1.6, 7 / 3))
    plan = dataclasses.replace(stage(rungs, {"cpu": 3}), capacity_curve=curve)
    for load in (1.25, 1.3, 1.45, 1.6):
        need = plan.capacity_at_load_qps(load)
        assert need == pytest.approx(70.0)
        assert dict(ladder_fleet(plan, need, PRICES, 10.0) or {}) == {"cpu": 7}, load
    # Past the rung's capacity, by however little, more is needed.
    more = dict(ladder_fleet(plan, 70.5, PRICES, 10.0) or {})
    assert plan.capacity_qps(more) >= 70.5


def test_a_mix_change_the_budget_cannot_hold_whole_goes_in_steps() -> None:
    """After a peak at 2x on cpus, the load falls to 1.5x. The sizing model's fleet for it is on
    a cheaper type (eff: 20 qps at $0.14/hr, against 10 qps at $0.1/hr), but the budget ($0.9/hr)
    does not hold the new mix beside the cpus while it boots. The change goes in steps: as many
    eff as the budget holds, then the cpus they make spare stop once they serve, never over the
    budget, each eff bought once. Before, the stage stayed on its cpus for good ($0.5/hr and
    more)."""
    prices = {"cpu": 0.1, "eff": 0.14}
    mu = {"cpu": 10.0, "eff": 20.0}
    plan = stage(((1.0, {"cpu": 4}), (1.5, {"eff": 3}), (2.0, {"cpu": 8})), {"cpu": 4}, mu)
    cfg = config(0.9, prices=prices, boot_s={"cpu": 30.0, "eff": 30.0})
    need = plan.capacity_at_load_qps(1.5)
    target = dict(ladder_fleet(plan, need, prices, 0.9) or {})
    assert target == {"eff": 3}  # what the ladder says, not affordable beside the cpus
    state = TunerState(fleets={"m": Fleet.of({"cpu": 8})}, last_change_s=0.0, started_s=-600.0)
    arrivals = steady(48, -600.0, 400.0)
    launched: list[tuple[str, int]] = []
    for now in np.arange(1.0, 400.0):
        decisions, state = tune(arrivals[arrivals <= now], float(now), state, [plan], cfg)
        launched += [(d.instance_type, d.count) for d in decisions if d.action == "scale_up"]
        assert fleet_cost_usd_per_hr(state, prices) <= cfg.budget_usd_per_hr + 1e-9
        # Never below the need once the cpus have been trimmed to it.
        assert plan.capacity_qps(ready_fleets(state, float(now))["m"]) + 1e-9 >= min(
            need, plan.capacity_qps(state.fleets["m"])
        )
    final = {t: n for t, n in state.fleets["m"].items() if n}
    assert launched and all(t == "eff" for t, _ in launched), launched
    assert sum(n for _, n in launched) <= 3, launched  # bought once, never back and forth
    assert plan.capacity_qps(final) + 1e-9 >= need
    # Cheaper than the cpus trimmed to the need, by at least the mix change's share.
    cpus_only = math.ceil(need / mu["cpu"]) * prices["cpu"]
    assert fleet_cost_usd_per_hr(state, prices) <= 0.9 * cpus_only + 1e-9, final


def test_a_step_of_a_mix_change_is_not_stopped_by_the_trim_that_follows_it() -> None:
    """The new type may be less cost-effective than the old (the saving is in its finer grain:
    two b, 48 qps at $1.3/hr, where a serves 40 qps at $1/hr and 42.5 qps needs two). After a
    step bought one b beside four a, the next tick could not afford the rest; its trim within the
    mix stopped the b first (the least qps per USD/hr, not a planned type), and a later tick
    bought b again. What the sizing model's fleet wants more of stays; the a it makes spare go."""
    prices = {"a": 1.0, "b": 0.65}
    mu = {"a": 40.0, "b": 24.0}
    plan = stage(
        ((1.0, {"a": 1}), (1.0625, {"b": 2}), (2.0, {"a": 2}), (4.0, {"a": 4})), {"a": 1}, mu
    )
    cfg = config(4.7, prices=prices, boot_s={"a": 30.0, "b": 30.0})
    need = plan.capacity_at_load_qps(34 / PLANNED_QPS)
    assert dict(ladder_fleet(plan, need, prices, 4.7) or {}) == {"b": 2}
    state = TunerState(fleets={"m": Fleet.of({"a": 4})}, last_change_s=0.0, started_s=-600.0)
    arrivals = steady(34, -600.0, 400.0)
    made: list[tuple[float, str, str, int]] = []
    for now in np.arange(1.0, 400.0):
        decisions, state = tune(arrivals[arrivals <= now], float(now), state, [plan], cfg)
        made += [(d.at_s, d.action, d.instance_type, d.count) for d in decisions]
        assert fleet_cost_usd_per_hr(state, prices) <= cfg.budget_usd_per_hr + 1e-9
    assert not [m for m in made if m[1] == "scale_down" and m[2] == "b"], made
    assert sum(m[3] for m in made if m[1] == "scale_up") == 2, made
    assert {t: n for t, n in state.fleets["m"].items() if n} == {"b": 2}, made


def test_a_step_of_several_types_names_the_whole_step_in_each_decision() -> None:
    """Each decision of a step names what the whole step adds, whose cost its reason gives (the
    fleet with two c and one b, trimmed to the need, $1.75/hr), not only its own type."""
    prices = {"a": 1.0, "b": 0.65, "c": 0.1}
    mu = {"a": 40.0, "b": 24.0, "c": 10.0}
    plan = stage(((1.5, {"b": 2, "c": 2}), (4.0, {"a": 4})), {"a": 1}, mu)
    cfg = config(5.0, prices=prices, boot_s={"a": 30.0, "b": 30.0, "c": 30.0})
    state = TunerState(fleets={"m": Fleet.of({"a": 4})}, last_change_s=0.0, started_s=-600.0)
    arrivals = steady(48, -600.0, 20.0)
    ups: list[ScalingDecision] = []
    for now in np.arange(1.0, 20.0):
        decisions, state = tune(arrivals[arrivals <= now], float(now), state, [plan], cfg)
        ups += [d for d in decisions if d.action == "scale_up"]
    assert [(d.instance_type, d.count) for d in ups] == [("b", 1), ("c", 2)], ups
    for d in ups:
        assert "mix change in steps" in d.reason and "(the step: 1 x b + 2 x c)" in d.reason
        assert "$1.75/hr" in d.reason, d.reason


def test_load_that_comes_in_recurring_bursts_is_read_as_its_rate() -> None:
    """Clients that send twice the planned rate in bursts (320 queries inside 0.2 s every 5 s):
    each burst's second stands out of its stretch, but they recur through the memory, so the
    scale-up reads them as load: the sustained load (the 60 s window) is twice the plan. With
    each burst clipped to its stretch's level it read 0.57 of the plan."""
    cfg = minute_config()
    plan = stage()
    bursts = [t + np.arange(320) * 0.2 / 320 for t in np.arange(45.0, 105.0, 5.0)]
    arrivals = np.sort(np.concatenate(bursts))
    state = TunerState(fleets={"m": Fleet.of({"cpu": 4})}, last_change_s=0.0, started_s=0.0)
    decisions, _ = tune(arrivals, float(arrivals[-1]) + 0.05, state, [plan], cfg)
    (up,) = [d for d in decisions if d.action == "scale_up"]
    sustained = re.search(r"sustained load x([0-9.]+) \(window 60 s\)", up.reason)
    assert sustained is not None, up.reason
    assert float(sustained.group(1)) == pytest.approx(2.0, rel=0.05), up.reason


def test_a_free_type_makes_no_mix_change_out_of_a_scale_down() -> None:
    """A mix change must save a share of the stage's cost; on a type that costs nothing (the
    local provisioner's ``local.cpu``) $0 against $0 passed as a saving, and the scale-down,
    which reads the whole envelope (a blip in it), bought what the sizing model's fleet had more
    of as a "mix change": live, 56 queries in a second on an app planned at 5 qps added an
    instance a minute later. The scale-down keeps the fleet instead."""
    prices = {"loc": 0.0}
    plan = stage(
        ((1.0, {"loc": 1}), (2.0, {"loc": 2}), (4.0, {"loc": 4})), {"loc": 1}, {"loc": 40.0}
    )
    cfg = dataclasses.replace(minute_config(), prices_usd_per_hr=prices, boot_s={"loc": 30.0})
    traffic = 40.0 + np.arange(60 * 16) / 16.0
    blip = 99.0 + np.arange(140) / 140.0
    arrivals = np.sort(np.concatenate([traffic, blip]))
    state = TunerState(fleets={"m": Fleet.of({"loc": 1})}, last_change_s=0.0, started_s=0.0)
    decisions, after = tune(arrivals, 100.0, state, [plan], cfg)
    assert [d.reason for d in decisions if d.action == "scale_up"] == []
    assert dict(after.fleets["m"]) == {"loc": 1}
