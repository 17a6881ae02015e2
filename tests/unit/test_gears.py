"""Gear plans and gear switching (CascadeServe): the plan, the switcher, switching in simulation."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from controlplane.cli import main
from controlplane.policies.gears import (
    ALPHA,
    NO_CAPACITY_SHARE,
    CascadePlacement,
    Gear,
    GearDecision,
    GearOption,
    GearPlan,
    GearSwitcher,
    Hysteresis,
    _batch_caps,
    _gear,
    _split_first,
    capacity_share,
    plan_gears,
    same_cascade,
    simulate_gear_switching,
    start_switcher,
    switch,
    switch_with_tuner,
    time_weighted_accuracy,
)
from controlplane.policies.tuner import ScalingDecision
from estimator.cascades import (
    Cascade,
    CascadeQuality,
    answering_stage,
    evaluate,
    validation_document,
)
from estimator.errors import CascadeError, NoFeasibleGearError
from estimator.profiles import LatencyProfile, write_profiles_json
from estimator.traces import Trace, constant_profile, renewal_arrivals, with_spikes
from tests.unit import cascade_support as family

SLO_MS = 120.0
PLACEMENT = "tiny:c5.xlarge=1;small:c5.xlarge=1;large:c5.xlarge=2"


@pytest.fixture(scope="module")
def plan() -> GearPlan:
    return plan_gears(
        family.records(),
        CascadePlacement.parse(PLACEMENT),
        family.profiles(),
        family.PRICES,
        slo_ms=SLO_MS,
        grid=(0.3, 0.6, 0.9),
        n_ranges=6,
        seed=1,
    )


def fake_plan(
    n_ranges: int = 4, qps_max: float = 40.0, options: Sequence[int] | None = None
) -> GearPlan:
    """A plan whose gears are ranges, each with an option of its own (another batch cap of one
    model: another cascade to the switcher) unless ``options`` (one per gear) says which."""
    width = qps_max / n_ranges
    chosen = list(range(n_ranges)) if options is None else list(options)
    gears = tuple(Gear(k * width, (k + 1) * width, chosen[k], True) for k in range(n_ranges))
    quality = CascadeQuality(0.9, (1.0,), (1.0,))
    found = tuple(
        GearOption(Cascade(("m",)), quality, (k + 1,), 10.0, 9.0, ((1.0, 5.0),), 1.0)
        for k in range(max(chosen) + 1)
    )
    return GearPlan(CascadePlacement.parse("m:c=1"), 100.0, 99.0, None, found, gears, qps_max, 0, 0)


# --- the placement ---------------------------------------------------------------------------


def test_placement_parses_and_refuses_nonsense() -> None:
    placement = CascadePlacement.parse(PLACEMENT)
    assert placement.order == family.MODELS
    assert placement.fleets["large"]["c5.xlarge"] == 2
    assert placement.cost_usd_per_hr(family.PRICES) == pytest.approx(4 * 0.17)
    with pytest.raises(CascadeError, match="must look like model:type=count"):
        CascadePlacement.parse("tiny=c5.xlarge")
    with pytest.raises(CascadeError, match=r"tiny: count of c5\.xlarge must be >= 0"):
        CascadePlacement.parse("tiny:c5.xlarge=-1")
    with pytest.raises(CascadeError, match="model 'tiny' has no instances"):
        CascadePlacement.parse("tiny:c5.xlarge=0")


# --- the plan --------------------------------------------------------------------------------


def test_gears_cover_the_span_and_lose_accuracy_as_load_grows(plan: GearPlan) -> None:
    assert plan.gears[0].low_qps == 0.0
    assert plan.gears[-1].high_qps == pytest.approx(plan.qps_max)
    for left, right in zip(plan.gears, plan.gears[1:], strict=False):
        assert left.high_qps == pytest.approx(right.low_qps)
    accuracy = [plan.option_of(g).quality.accuracy for g in range(len(plan.gears))]
    assert accuracy == sorted(accuracy, reverse=True)
    for gear in plan.gears:
        option = plan.options[gear.option]
        assert gear.meets_slo == (option.max_qps >= gear.high_qps - 1e-9)
    # The top range is the fastest option's own max.
    assert plan.qps_max == pytest.approx(max(o.max_qps for o in plan.options))
    assert len(plan.gears) == 6 and plan.simulations > 0


def test_every_option_is_within_the_slo_at_its_max_and_the_caps_fit(plan: GearPlan) -> None:
    for option in plan.options:
        assert option.max_qps > 0 and option.max_qps <= option.bound_qps
        feasible = [tail for rate, tail in option.latency_curve if rate <= option.max_qps]
        assert max(feasible) <= SLO_MS
        assert len(option.max_batch_queries) == len(option.cascade.models)
        assert all(k >= 1 for k in option.max_batch_queries)


def test_the_plan_is_deterministic(plan: GearPlan) -> None:
    again = plan_gears(
        family.records(),
        CascadePlacement.parse(PLACEMENT),
        family.profiles(),
        family.PRICES,
        slo_ms=SLO_MS,
        grid=(0.3, 0.6, 0.9),
        n_ranges=6,
        seed=1,
    )
    assert again.to_document() == plan.to_document()


def test_an_accuracy_floor_picks_cascades_that_meet_it() -> None:
    records = family.records()
    floor = 0.96
    plan = plan_gears(
        records,
        CascadePlacement.parse(PLACEMENT),
        family.profiles(),
        family.PRICES,
        slo_ms=SLO_MS,
        accuracy_floor=floor,
        grid=(0.3, 0.6, 0.9),
        n_ranges=4,
        seed=1,
    )
    for gear in plan.gears:
        assert plan.options[gear.option].quality.accuracy >= floor
        # Within the latency SLO where the accurate cascade sustains the range's top.
        assert gear.meets_slo == (plan.options[gear.option].max_qps >= gear.high_qps)
    assert plan.gears[0].meets_slo


def test_a_slo_below_every_service_time_has_no_gear() -> None:
    with pytest.raises(NoFeasibleGearError, match=r"no cascade meets the latency SLO of 0\.5 ms"):
        plan_gears(
            family.records(),
            CascadePlacement.parse(PLACEMENT),
            family.profiles(),
            family.PRICES,
            slo_ms=0.5,
            grid=(0.5,),
        )


def test_a_placed_type_without_a_profile_is_refused() -> None:
    with pytest.raises(CascadeError, match=r"no profile for model 'tiny' on 'g4dn\.xlarge'"):
        plan_gears(
            family.records(),
            CascadePlacement.parse("tiny:g4dn.xlarge=1"),
            family.profiles(),
            {"g4dn.xlarge": 0.5},
            slo_ms=SLO_MS,
        )


# --- batch caps (SP4) -----------------------------------------------------------------------

# Mean latency by batch size as measured profiles show it: cap 2 serves less than cap 1, caps 4
# and 8 serve more, and cap 16 is far too slow for the SLO below.
NOISY_MS = {1: 10.0, 2: 25.0, 4: 30.0, 8: 32.0, 16: 200.0}
NOISY_SLO_MS = 100.0


def one_type(
    latency_ms: Mapping[str, Mapping[int, float]], instances: int = 1
) -> tuple[CascadePlacement, dict[str, dict[str, LatencyProfile]]]:
    """Each model on ``instances`` of one type, its profile exactly ``latency_ms[model]``."""
    profiles = {}
    for model, by_batch in latency_ms.items():
        sizes = sorted(by_batch)
        samples = tuple(np.array([by_batch[b]]) for b in sizes)
        profiles[model] = {
            family.TYPE: LatencyProfile(model, family.TYPE, np.array(sizes), samples)
        }
    placement = CascadePlacement.parse(
        ";".join(f"{m}:{family.TYPE}={instances}" for m in latency_ms)
    )
    return placement, profiles


def one_model(
    latency_ms: Mapping[int, float], instances: int = 1
) -> tuple[CascadePlacement, dict[str, dict[str, LatencyProfile]]]:
    """Model "m" on ``instances`` of one type, its profile exactly ``latency_ms``."""
    return one_type({"m": latency_ms}, instances)


def path_bound_ms(
    cascade: Cascade,
    caps: Sequence[int],
    placement: CascadePlacement,
    profiles: Mapping[str, Mapping[str, LatencyProfile]],
    batch_size: int = 1,
) -> float:
    """sum_i 2 max_t L_{m_i,t}(k_i b), by hand from the profiles."""
    return sum(
        2.0 * max(profiles[m][t].mean_latency_ms(k * batch_size) for t in placement.fleets[m])
        for m, k in zip(cascade.models, caps, strict=True)
    )


def test_the_bottleneck_takes_its_best_cap_past_a_doubling_that_loses() -> None:
    instances = 2
    placement, profiles = one_model(NOISY_MS, instances)
    qps = {k: instances * k / (ms / 1000.0) for k, ms in NOISY_MS.items()}
    assert qps[2] < qps[1]  # the first doubling loses: the old rule stopped at cap 1
    within = [k for k, ms in NOISY_MS.items() if 2.0 * ms <= NOISY_SLO_MS]
    best = max(within, key=lambda k: (qps[k], -k))
    assert best == 8  # the profile is the case it is meant to be
    caps, bound_qps = _batch_caps(
        Cascade(("m",)), (1.0,), placement, profiles, NOISY_SLO_MS, batch_size=1
    )
    assert caps == (best,)
    assert bound_qps == pytest.approx(qps[best])


def test_a_cap_beyond_the_slo_is_not_taken_even_if_it_serves_more() -> None:
    # Cap 16 serves the most here (16 / 40 ms), but its path bound, 80 ms, is over the SLO.
    latency_ms = {1: 10.0, 2: 25.0, 4: 30.0, 8: 32.0, 16: 40.0}
    slo_ms = 70.0
    placement, profiles = one_model(latency_ms)
    rate = {k: k / ms for k, ms in latency_ms.items()}
    assert max(rate, key=lambda k: rate[k]) == 16 and 2.0 * latency_ms[16] > slo_ms
    caps, _ = _batch_caps(Cascade(("m",)), (1.0,), placement, profiles, slo_ms, batch_size=1)
    within = [k for k, ms in latency_ms.items() if 2.0 * ms <= slo_ms]
    assert caps == (max(within, key=lambda k: rate[k]),)
    assert path_bound_ms(Cascade(("m",)), caps, placement, profiles) <= slo_ms


def test_a_tie_keeps_the_smaller_cap() -> None:
    # Latency proportional to the batch (doubling a float is exact): every cap serves as much.
    latency_ms = {b: 8.0 * b for b in (1, 2, 4, 8)}
    placement, profiles = one_model(latency_ms)
    capacities = {
        k: k / (profiles["m"][family.TYPE].mean_latency_ms(k) / 1000.0) for k in latency_ms
    }
    assert len(set(capacities.values())) == 1
    caps, _ = _batch_caps(Cascade(("m",)), (1.0,), placement, profiles, 1e6, batch_size=1)
    assert caps == (1,)


def test_a_bottleneck_takes_the_first_doubling_that_serves_more_not_the_best() -> None:
    # Stage a serves most at cap 8, but cap 8 takes so much of the SLO that b could not double;
    # a's first doubling that serves more leaves b room, and the cascade serves more.
    latency_ms = {
        "a": {1: 20.0, 2: 22.0, 4: 24.0, 8: 40.0},
        "b": {1: 10.0, 2: 12.0, 4: 14.0},
    }
    slo_ms = 100.0
    cascade, reach = Cascade(("a", "b"), (0.5,)), (1.0, 1.0)
    placement, profiles = one_type(latency_ms)

    def capacity(model: str, cap: int) -> float:
        return cap / (profiles[model][family.TYPE].mean_latency_ms(cap) / 1000.0)

    best_a = max(latency_ms["a"], key=lambda k: capacity("a", k))
    assert best_a == 8 and capacity("a", 1) < capacity("b", 1)  # a is the first bottleneck
    assert path_bound_ms(cascade, (best_a, 1), placement, profiles) <= slo_ms
    assert path_bound_ms(cascade, (best_a, 2), placement, profiles) > slo_ms
    greedy_bound = min(capacity("a", best_a), capacity("b", 1))
    caps, bound_qps = _batch_caps(cascade, reach, placement, profiles, slo_ms, batch_size=1)
    assert path_bound_ms(cascade, caps, placement, profiles) <= slo_ms
    assert bound_qps == pytest.approx(min(capacity(m, k) for m, k in zip("ab", caps, strict=True)))
    assert bound_qps > greedy_bound


@pytest.mark.parametrize("slo_ms", [20.0, 40.0, 80.0, 160.0, 400.0])
@pytest.mark.parametrize(
    ("models", "reach"),
    [
        (("large",), (1.0,)),
        (("tiny", "large"), (1.0, 0.3)),
        (("tiny", "small", "large"), (1.0, 0.5, 0.2)),
        (("small", "large"), (1.0, 0.9)),
    ],
)
def test_the_caps_keep_the_path_bound_within_the_slo(
    models: tuple[str, ...], reach: tuple[float, ...], slo_ms: float
) -> None:
    cascade = Cascade(models, (0.5,) * (len(models) - 1))
    placement = CascadePlacement.parse(PLACEMENT)
    profiles = family.profiles()
    caps, bound_qps = _batch_caps(cascade, reach, placement, profiles, slo_ms, batch_size=1)
    if path_bound_ms(cascade, (1,) * len(models), placement, profiles) > slo_ms:
        assert caps == (1,) * len(models)  # nothing to do: even cap 1 is over
        return
    assert path_bound_ms(cascade, caps, placement, profiles) <= slo_ms

    def per_query(i: int, cap: int) -> float:
        profile = profiles[models[i]][family.TYPE]
        n = placement.fleets[models[i]][family.TYPE]
        return n * cap / (profile.mean_latency_ms(cap) / 1000.0) / reach[i]

    assert bound_qps == pytest.approx(min(per_query(i, k) for i, k in enumerate(caps)))
    # The rule stopped because no doubling of the bottleneck's cap within the SLO and the
    # profiled batches serves more.
    i = min(range(len(models)), key=lambda j: per_query(j, caps[j]))
    k = caps[i] * 2
    while k <= profiles[models[i]][family.TYPE].max_batch_size:
        tried = list(caps)
        tried[i] = k
        if path_bound_ms(cascade, tried, placement, profiles) > slo_ms:
            break
        assert per_query(i, k) <= per_query(i, caps[i])
        k *= 2


def test_every_option_of_the_plan_keeps_its_path_bound_within_the_slo(plan: GearPlan) -> None:
    profiles = family.profiles()
    for option in plan.options:
        caps = option.max_batch_queries
        assert path_bound_ms(option.cascade, caps, plan.placement, profiles) <= SLO_MS


# --- the switcher ----------------------------------------------------------------------------


def test_gear_for_finds_the_range() -> None:
    plan = fake_plan()  # ranges of 10 qps
    assert [plan.gear_for(q) for q in (0.0, 9.9, 10.0, 35.0, 1e9)] == [0, 0, 1, 3, 3]


# The paper's rule (Hysteresis.off()); tests/unit/test_gear_hysteresis.py has the band and dwell.
PAPER = Hysteresis.off()


def test_a_faster_gear_is_taken_at_once_even_with_a_queue() -> None:
    state = GearSwitcher(fake_plan(), gear=0, hysteresis=PAPER)
    decision, state = switch(35.0, 1000, state, 1.0)
    assert (decision.gear, decision.previous, decision.changed) == (3, 0, True)
    assert "up from gear 0 to 3" in decision.reason and state.since_s == 1.0


def test_the_fast_gear_stays_while_the_backlog_drains() -> None:
    # CascadeServe: keep the gear while qps < alpha x Q0 (alpha = 8): 5 qps < 8 x 1.
    state = GearSwitcher(fake_plan(), gear=3, since_s=0.0, hysteresis=PAPER)
    decision, state = switch(5.0, 1, state, 2.0)
    assert decision.gear == 3 and not decision.changed
    assert f"qps < alpha {ALPHA:g} x first queue 1" in decision.reason
    assert state.since_s == 0.0
    # Once the queue is short enough (8 >= 8 x 1 holds: no longer qps < alpha Q0), it moves down.
    decision, state = switch(8.0, 1, state, 2.1)
    assert (decision.gear, state.gear) == (0, 0)
    assert "down from gear 3 to 0" in decision.reason


def test_budget_cap_holds_downshifts_for_the_hold_time() -> None:
    state = GearSwitcher(fake_plan(), gear=3, cap_hold_s=5.0, hysteresis=PAPER)
    decision, state = switch(35.0, 0, state, 10.0, budget_capped=True)
    assert decision.gear == 3 and state.capped_until_s == 15.0
    decision, state = switch(5.0, 0, state, 12.0)
    assert decision.gear == 3 and "the budget caps the fleet" in decision.reason
    decision, state = switch(5.0, 0, state, 15.0)
    assert decision.gear == 0


def test_booting_capacity_scales_the_measured_load() -> None:
    state = GearSwitcher(fake_plan(), gear=0)
    # 12 qps on half the planned capacity reads as 24 qps on the plan: gear 2 (the cascade in
    # force has served past the up dwell).
    decision, _ = switch(12.0, 0, state, 10.0, capacity_share=0.5)
    assert decision.gear == 2 and decision.effective_qps == pytest.approx(24.0)
    assert "share 0.5" in decision.reason


def test_switch_refuses_bad_readings() -> None:
    state = GearSwitcher(fake_plan(), gear=0)
    with pytest.raises(CascadeError, match="measured_qps"):
        switch(-1.0, 0, state, 0.0)
    with pytest.raises(CascadeError, match="capacity_share"):
        switch(1.0, 0, state, 0.0, capacity_share=0.0)
    with pytest.raises(CascadeError, match="no gear 9"):
        GearSwitcher(fake_plan(), gear=9)


def test_the_tuners_tick_feeds_the_switcher(plan: GearPlan) -> None:
    profiles = family.profiles()
    state = GearSwitcher(plan, gear=len(plan.gears) - 1)
    capped = ScalingDecision(
        3.0, "large", "budget_capped", family.TYPE, 2, "budget_capped: ...", 0.68
    )
    top = plan.gears[-1].low_qps
    decision, held = switch_with_tuner(
        top, 0, state, 3.0, decisions=[capped], ready={}, profiles=profiles
    )
    assert decision.gear == len(plan.gears) - 1 and held.capped_until_s > 3.0
    # A report made at a load below the gear's range (the tuner's memory of a load gone) does
    # not extend the hold.
    _, after = switch_with_tuner(
        0.0, 0, state, 3.0, decisions=[capped], ready={}, profiles=profiles
    )
    assert after.capped_until_s == state.capped_until_s
    # Half the large stage still boots: the load reads as twice what was measured.
    half = {"large": {family.TYPE: 1}}
    free = GearSwitcher(plan, gear=0)
    rate = 0.3 * plan.qps_max
    decision, _ = switch_with_tuner(rate, 0, free, 4.0, decisions=[], ready=half, profiles=profiles)
    assert decision.effective_qps == pytest.approx(2 * rate)
    assert decision.gear == plan.gear_for(2 * rate)


def test_start_switcher_picks_the_expected_load() -> None:
    assert start_switcher(fake_plan(), expected_qps=25.0).gear == 2


def test_capacity_share_is_the_shortest_stage() -> None:
    placement = CascadePlacement.parse(PLACEMENT)
    profiles = family.profiles()
    assert capacity_share(placement, {}, profiles) == pytest.approx(1.0)
    ready = {"large": {"c5.xlarge": 1}}
    assert capacity_share(placement, ready, profiles) == pytest.approx(0.5)


def test_time_weighted_accuracy_by_hand() -> None:
    def option(accuracy: float) -> GearOption:
        quality = CascadeQuality(accuracy, (1.0,), (1.0,))
        return GearOption(Cascade(("m",)), quality, (1,), 10.0, 9.0, ((1.0, 5.0),), 1.0)

    gears = (Gear(0, 20, 0, True), Gear(20, 40, 1, True))
    two = GearPlan(
        fake_plan().placement, 100.0, 99.0, None, (option(0.9), option(0.6)), gears, 40.0, 0, 0
    )
    up = GearDecision(4.0, 1, 0, 30.0, 30.0, 0, "up")
    down = GearDecision(6.0, 0, 1, 5.0, 5.0, 0, "down")
    # 0.9 for 4 s, 0.6 for 2 s, 0.9 for 4 s over [0, 10).
    assert time_weighted_accuracy(two, 0, [up, down], 0.0, 10.0) == pytest.approx(0.84)
    assert time_weighted_accuracy(two, 0, [up, down], 4.0, 6.0) == pytest.approx(0.6)
    assert time_weighted_accuracy(two, 0, [up, down], 5.0, 10.0) == pytest.approx(0.84)


# --- switching in the simulator --------------------------------------------------------------


def test_switching_absorbs_a_jump_and_keeps_every_query(plan: GearPlan) -> None:
    records = family.records()
    base = 0.2 * plan.qps_max
    load = with_spikes(constant_profile(base), [(5.0, 5.0, 4.0)])
    rng = np.random.default_rng(3)
    arrival = renewal_arrivals(load, 15.0, 1.0, rng)
    trace = Trace(
        arrival,
        np.ones(arrival.size, dtype=np.int64),
        rng.integers(0, records.n_samples, size=arrival.size),
    )
    run = simulate_gear_switching(
        trace,
        plan,
        records,
        family.profiles(),
        family.PRICES,
        np.random.default_rng(4),
        start_gear=plan.gear_for(base),
        hysteresis=PAPER,  # back down within 5 s of the jump: no hold, no dwell
    )
    result = run.simulation
    assert not np.isnan(result.finish_s).any()
    # Within a tick or two of the jump a faster gear holds, and a slower one after it.
    at_jump = run.gear[(arrival >= 5.3) & (arrival < 10.0)]
    assert at_jump.min() > run.start_gear
    assert run.gear[arrival > 14.0].min() < at_jump.max()
    # Every query answers at a model of the cascade in force when it arrived.
    order = plan.placement.order
    assert result.answered_stage is not None
    for g in np.unique(run.gear):
        mine = run.gear == g
        cascade = plan.option_of(int(g)).cascade
        expected = answering_stage(cascade, records, trace.sample_id[mine])
        answered = [order[s] for s in result.answered_stage[mine]]
        assert answered == [cascade.models[i] for i in expected]
    assert 0.0 < run.correct.mean() <= 1.0
    assert all(d.changed for d in run.changes)


def test_switching_needs_sample_ids(plan: GearPlan) -> None:
    trace = Trace(np.array([0.0, 0.1]), np.ones(2, dtype=np.int64))
    with pytest.raises(CascadeError, match="sample ids"):
        simulate_gear_switching(
            trace,
            plan,
            family.records(),
            family.profiles(),
            family.PRICES,
            np.random.default_rng(0),
        )


# --- the command -----------------------------------------------------------------------------


def _app(tmp_path: Path) -> tuple[Path, Path]:
    write_profiles_json(
        [p for by_type in family.profiles().values() for p in by_type.values()],
        tmp_path / "profiles.json",
    )
    validation = tmp_path / "validation.json"
    validation.write_text(json.dumps(validation_document(family.records())))
    spec = tmp_path / "app.yaml"
    spec.write_text(
        "name: digits\n"
        "models:\n"
        + "".join(f"  - {{name: {m}, profiles: profiles.json}}\n" for m in family.MODELS)
        + "cascade: [tiny, small, large]\n"
        f"slo: {{latency_ms: {SLO_MS:g}}}\n"
        "budget_usd_per_hr: 2\n"
        "instance_types: [c5.xlarge]\n"
    )
    return spec, validation


def test_gears_command_prints_one_json_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, validation = _app(tmp_path)
    args = ["gears", "--spec", str(spec), "--validation", str(validation)]
    args += ["--placement", PLACEMENT, "--thresholds", "0.3,0.9", "--ranges", "3", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    # Three equal ranges, the first split at the r* of the more accurate cascade it holds.
    assert out["app"] == "digits" and len(out["gears"]) >= 3
    first, second = out["gears"][:2]
    assert first["low_qps"] == 0 and first["high_qps"] <= second["low_qps"] + 1e-9
    assert out["cost_usd_per_hr"] == pytest.approx(4 * 0.17)
    assert all(math.isfinite(o["max_qps"]) for o in out["options"])
    # The held-out protocol: chosen on one half of the records, scored on the other.
    assert out["split"]["choose_samples"] + out["split"]["score_samples"] == 400
    assert out["held_out_samples"] == out["split"]["score_samples"]
    for entry in (*out["options"], *out["gears"]):
        assert 0 <= entry["accuracy"] <= 1 and 0 <= entry["held_out_accuracy"] <= 1


def test_gears_command_prints_both_accuracies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, validation = _app(tmp_path)
    args = ["gears", "--spec", str(spec), "--validation", str(validation)]
    assert main([*args, "--placement", PLACEMENT, "--thresholds", "0.3,0.9", "--ranges", "2"]) == 0
    out = capsys.readouterr().out
    assert "held-out" in out and "in-sample" in out
    # Tiny ranges print bounds that differ (`--qps-max 0.001 --ranges 2` printed [0.0, 0.0)).
    tiny = ["--placement", PLACEMENT, "--thresholds", "0.3", "--ranges", "2", "--qps-max", "0.001"]
    assert main([*args, *tiny]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ") qps:" in line]
    bounds = [line.split(")")[0].strip(" [").split(",") for line in lines]
    assert [(float(lo), float(hi)) for lo, hi in bounds] == [(0.0, 0.0005), (0.0005, 0.001)]


def test_gears_command_says_why_a_range_misses_and_shows_the_accuracy_under_the_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A floor a hair above the best held-out accuracy: every range gets the most accurate
    cascade and misses the SLO. The lines read "98.33% held-out ... (does not meet the SLO)"
    under a goal of ">= 98.33%"; they show the accuracy in as many decimals as put it under the
    floor, and say which half of the SLO is missed."""
    spec, validation = _app(tmp_path)
    args = ["gears", "--spec", str(spec), "--validation", str(validation)]
    args += ["--placement", PLACEMENT, "--thresholds", "0.3,0.9", "--ranges", "2"]
    assert main([*args, "--json"]) == 0
    best = max(o["held_out_accuracy"] for o in json.loads(capsys.readouterr().out)["options"])
    floor = best + 1e-6
    assert f"{100 * best:.2f}" == f"{100 * floor:.2f}"  # the same at two decimals
    text = spec.read_text().replace("slo: {latency_ms:", f"slo: {{accuracy: {floor!r}, latency_ms:")
    spec.write_text(text)
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ") qps:" in line]
    assert lines
    for line in lines:
        assert "(does not meet the SLO: under the accuracy floor of" in line, line
        shown, floor_shown = line.split("(")[1].split("%")[0], line.split("floor of ")[1][:-2]
        assert float(shown) < float(floor_shown), line
    # Without a floor, a range past what its cascade sustains says that.
    spec.write_text(text.replace(f"accuracy: {floor!r}, ", ""))
    assert main([*args, "--qps-max", "1000000"]) == 0
    out = capsys.readouterr().out
    assert (
        "(does not meet the SLO: it sustains" in out and f"qps within P99 <= {SLO_MS:g} ms" in out
    )


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ("huge:c5.xlarge=1", "'huge', not a model of the app"),
        # As replay refuses a plan over the budget (it planned gears on $17/hr for a $2 app).
        (
            "tiny:c5.xlarge=100;small:c5.xlarge=1;large:c5.xlarge=2",
            "over the app's budget of 2 USD/hr",
        ),
    ],
)
def test_gears_command_refuses_a_placement_it_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], placement: str, message: str
) -> None:
    spec, validation = _app(tmp_path)
    args = ["gears", "--spec", str(spec), "--validation", str(validation)]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--placement", placement])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_gears_command_plans_queries_of_several_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Profiles that start above batch size 1 (the Kairos samples start at 10): the command
    # could plan no gear for them.
    spec, validation = _app(tmp_path)
    document = json.loads((tmp_path / "profiles.json").read_text())
    for entry in document["profiles"]:
        for key in ("batch_sizes", "latency_ms"):
            entry[key] = entry[key][1:]
    assert {entry["batch_sizes"][0] for entry in document["profiles"]} == {2}
    (tmp_path / "profiles.json").write_text(json.dumps(document))
    args = ["gears", "--spec", str(spec), "--validation", str(validation)]
    args += ["--placement", PLACEMENT, "--thresholds", "0.3,0.9", "--ranges", "2"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size 1: the profile of" in err and "measures batch sizes 2.." in err
    assert main([*args, "--batch-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_size"] == 2 and out["gears"]


# --- the held-out protocol -------------------------------------------------------------------


def test_options_carry_held_out_accuracy_and_round_trip() -> None:
    choose, score = family.records().split(0.5, 0)
    plan = plan_gears(
        choose,
        CascadePlacement.parse(PLACEMENT),
        family.profiles(),
        family.PRICES,
        slo_ms=SLO_MS,
        grid=(0.3, 0.9),
        n_ranges=3,
        seed=1,
        held_out=score,
    )
    assert plan.held_out_samples == score.n_samples
    for option in plan.options:
        assert option.held_out_accuracy == evaluate(option.cascade, score).accuracy
        assert option.quality.accuracy == evaluate(option.cascade, choose).accuracy
        assert option.accuracy == option.held_out_accuracy
    document = plan.to_document()
    assert all("held_out_accuracy" in g for g in document["gears"])
    again = GearPlan.from_document(json.loads(json.dumps(document)))
    assert [o.held_out_accuracy for o in again.options] == [
        o.held_out_accuracy for o in plan.options
    ]
    assert again.held_out_samples == plan.held_out_samples


def test_the_accuracy_floor_is_checked_against_the_held_out_accuracy() -> None:
    from tests.unit.test_cascades import overfit_records

    records = overfit_records()
    choose, score = records.split(0.5, 0)
    placement = CascadePlacement.parse("tiny:c5.xlarge=1;large:c5.xlarge=1")
    common = {
        "slo_ms": SLO_MS,
        "accuracy_floor": 0.9,
        "grid": (0.3, 0.6),
        "n_ranges": 2,
        "seed": 1,
    }
    profiles = family.profiles()
    in_sample = plan_gears(choose, placement, profiles, family.PRICES, **common)
    held_out = plan_gears(choose, placement, profiles, family.PRICES, held_out=score, **common)
    # In-sample, tiny's certainty looks perfect: a cascade meets the floor in every range (and
    # the whole SLO in the first).
    assert in_sample.gears[0].meets_slo
    assert all(in_sample.options[g.option].quality.accuracy >= 0.9 for g in in_sample.gears)
    # Held-out, the same cascades score 50%: no finalist meets the floor, and the plan says so.
    assert any(o.quality.accuracy >= 0.9 for o in held_out.options)
    assert all(o.accuracy < 0.9 for o in held_out.options)
    assert not any(g.meets_slo for g in held_out.gears)


def test_switching_in_the_simulator_keeps_the_hysteresis(plan: GearPlan) -> None:
    # A steady load at a boundary between two cascades: the paper's rule flaps on the 100 ms
    # counts, the service's rule (the default) switches at most once, as the live loop does.
    records = family.records()
    k = next(k for k in range(1, len(plan.gears)) if not same_cascade(plan, k - 1, k))
    rate = plan.gears[k].low_qps
    rng = np.random.default_rng(5)
    arrival = renewal_arrivals(constant_profile(rate), 20.0, 1.0, rng)
    samples = rng.integers(0, records.n_samples, size=arrival.size)
    trace = Trace(arrival, np.ones(arrival.size, dtype=np.int64), samples)

    def run(hysteresis: Hysteresis | None) -> int:
        simulated = simulate_gear_switching(
            trace, plan, records, family.profiles(), family.PRICES, np.random.default_rng(6),
            start_gear=k - 1, hysteresis=hysteresis,
        )  # fmt: skip
        return len(simulated.switches)

    assert run(None) <= 1
    assert run(PAPER) > 5


def _option(accuracy: float, max_qps: float) -> SimpleNamespace:
    """What :func:`_split_first` and :func:`_gear` read of a gear option."""
    return SimpleNamespace(quality=SimpleNamespace(accuracy=accuracy), max_qps=max_qps)


def test_the_first_range_goes_to_a_more_accurate_cascade_where_it_sustains_the_load() -> None:
    """Equal ranges of [0, q_max] with a fast cascade's q_max far above the accurate cascades'
    r*: the first range is split at their r*, so the lowest loads get the most accurate one that
    sustains them, where every range went to the fast, least accurate cascade."""

    fast, middle, best = _option(0.70, 2293.0), _option(0.90, 120.0), _option(1.00, 36.0)
    options = [fast, middle, best]
    top = 2293.0
    equal = tuple(Gear(top * k / 8, top * (k + 1) / 8, 0, True) for k in range(8))
    split = _split_first(equal, options, None)  # type: ignore[arg-type]
    assert [(g.low_qps, g.high_qps, g.option) for g in split[:3]] == [
        (0.0, 36.0, 2),
        (36.0, 120.0, 1),
        (120.0, top / 8, 0),
    ]
    assert split[3:] == equal[1:]
    # Nothing to split where the first range's gear is the most accurate, or with a floor.
    assert _split_first(equal, [fast], None) == equal  # type: ignore[list-item]
    assert _split_first(equal, options, 0.8) == equal  # type: ignore[arg-type]


def test_a_qps_max_past_every_cascade_leaves_the_loads_they_sustain_within_the_slo() -> None:
    """`gears --qps-max 1e9` with a fastest cascade of 8,645 q/s: the first range was
    [0, 1.25e8), its gear the fastest, not meeting the SLO, so from 0 q/s the plan said no
    gear met it."""

    fast, accurate = _option(0.90, 8645.3), _option(0.97, 900.0)
    options = [fast, accurate]
    top = 1e9
    ranges = tuple(
        _gear(options, top * k / 8, top * (k + 1) / 8, None)  # type: ignore[arg-type]
        for k in range(8)
    )
    assert not ranges[0].meets_slo
    split = _split_first(ranges, options, None)  # type: ignore[arg-type]
    assert [(g.low_qps, g.high_qps, g.option, g.meets_slo) for g in split[:3]] == [
        (0.0, 900.0, 1, True),
        (900.0, 8645.3, 0, True),
        (8645.3, top / 8, 0, False),
    ]


def test_with_an_accuracy_floor_a_range_past_the_cascades_rate_does_not_meet_the_slo() -> None:
    """A spec with both a latency and an accuracy SLO: the range above the accurate cascade's
    r* was marked as meeting the SLO (the floor's branch checked the accuracy alone)."""

    def option(accuracy: float, max_qps: float, tails: tuple[tuple[float, float], ...]) -> Any:
        held = SimpleNamespace(quality=SimpleNamespace(accuracy=accuracy), max_qps=max_qps)
        held.accuracy = accuracy
        held.latency_curve = tails
        held.tail_ms_at = lambda rate: GearOption.tail_ms_at(held, rate)  # type: ignore[arg-type]
        return held

    curve = ((10.0, 150.0), (19.8, 300.0), (24.0, 383.0))
    accurate, fast = option(0.97, 19.8, curve), option(0.90, 50.0, ((50.0, 290.0),))
    options = [accurate, fast]
    below, above = _gear(options, 10.0, 19.8, 0.96), _gear(options, 19.8, 24.0, 0.96)
    assert (below.option, below.meets_slo) == (0, True)
    assert (above.option, above.meets_slo) == (0, False)


def test_a_switch_with_no_capacity_ready_says_so() -> None:
    """Every worker down: the decision read "4 qps measured, 4e+06 qps on the planned capacity
    (share 1e-06)", the divisor's floor shown to the user."""
    plan = fake_plan()
    state = GearSwitcher(plan, gear=0, hysteresis=Hysteresis.off())
    decision, _ = switch(4.0, 0, state, 1.0, capacity_share=NO_CAPACITY_SHARE)
    assert decision.gear == len(plan.gears) - 1
    assert decision.reason.startswith("4 qps measured, no planned capacity ready: up from")
    assert "e+" not in decision.reason
