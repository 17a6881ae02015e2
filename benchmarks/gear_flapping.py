"""How often the gear switcher switches over the demo's load cycle, with and without hysteresis.

    .venv/bin/python benchmarks/gear_flapping.py [--seeds 10] [--cycles 1] [--json]

The goal (issue 29): at most 10 gear switches per demo load cycle, at most a few per real load
change. The live demo's switcher made 169 switches in its first 3.8 minutes, 112 of them between
gears of the same cascade.

Setup (every number a constant here or in the modules named; none tuned to the result):

- **the plan**: the demo's cascade as docs/catalog.md reports the demo's plan for 12 qps: tiny on
  2 x ``emu.cpu.small``, medium on 2 x ``emu.cpu.small``, large on 1 x ``emu.cpu.large``, SLO
  P99 300 ms (``controlplane.service.demo``). Latency profiles are the compute the emulated
  workers pad to (``provisioners.worker.emulation.EMULATED_COMPUTE`` over the type's speed
  factor) plus :data:`SERVING_MS` for the serving path, with 5% log-normal jitter; validation
  records are :func:`estimator.cascades.synthetic_validation` at the digits models' accuracies
  (:data:`ACCURACY`). The gear plan is ``plan_gears`` on them (8 ranges, the service's default).
- **the load**: the demo's, ``controlplane.service.demo.load_trace`` (Poisson arrivals at 12 (1
  - 0.8 cos(2 pi t / 240 s)) qps: 2.4 up to 21.6 and back every 240 s), seeds 0..N-1.
- **the switcher**: as the live loop runs it (``controlplane.loops.live_gears``): every 100 ms the
  rate over the last 5 s (``DEFAULT_WINDOW_S``), divided by the capacity share, into
  ``controlplane.policies.gears.switch``; the first queue is taken as empty (at these loads the
  fleet keeps no backlog; the alpha rule then never holds a gear).
- **the fleet**, two ways: *fixed* (capacity share 1: the plan's placement throughout) and
  *tuned*, a simple stand-in for the live tuner: the fleet grows in steps of a third of the plan
  (one worker of the three) so that it carries the last 30 s's mean rate at
  :data:`TUNED_UTILISATION` of the planned rate per step, each step ready :data:`BOOT_S` after it
  is asked for and drained after :data:`DRAIN_QUIET_S` without need, never below the plan. The
  capacity share (ready over planned) then moves in steps, as it does live while workers boot
  and drain.

Rules compared: *before*, the paper's rule (``Hysteresis.off()``; every gear index change was a
logged ``gear_switch``, so "logged" counts those) and *after*, the service's default
``Hysteresis()`` (only changes of cascade are switches and logged). Printed per rule and fleet:
switches per cycle (cascade changes), gear index changes per cycle, both as the median and the
range over the runs; the share of time the gear in force was of a lower range than the load's
(a faster cascade was due: the SLO's risk, which only the up dwell can cause), and the accuracy
lost against the gear of the load's range, in points, time-weighted (what the band, the hold and
the down dwell cost: time in a faster, less accurate cascade than the load needs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from controlplane.loops.live_gears import DEFAULT_WINDOW_S
from controlplane.policies.gears import (
    DEFAULT_TICK_S,
    CascadePlacement,
    GearPlan,
    Hysteresis,
    plan_gears,
    start_switcher,
    switch,
)
from controlplane.service.demo import (
    DEMO_RATE_QPS,
    DEMO_SLO_MS,
    LOAD_PERIOD_S,
    load_trace,
)
from estimator.cascades import synthetic_validation
from estimator.catalog import default_catalog
from estimator.profiles import LatencyProfile
from provisioners.worker.emulation import EMULATED_COMPUTE

PLACEMENT = "tiny:emu.cpu.small=2;medium:emu.cpu.small=2;large:emu.cpu.large=1"
# The digits models' validation accuracies (docs/gear-switching.md's family).
ACCURACY = {"tiny": 0.9569, "medium": 0.9805, "large": 0.9875}
SERVING_MS = 2.0  # the serving path on top of the compute (docs/catalog.md: about 1-2 ms)
BATCH_SIZES = (1, 2, 4, 8)
PLAN_SEED = 0
# The tuned fleet's stand-in (module docstring).
TUNED_UTILISATION = 0.8
TUNED_STEP = 1.0 / 3.0
RATE_SPAN_S = 30.0
BOOT_S = 10.0
DRAIN_QUIET_S = 15.0
GOAL_PER_CYCLE = 10
RULES = {"before": Hysteresis.off(), "after": Hysteresis()}


def demo_plan() -> GearPlan:
    """The demo cascade's gear plan on the emulated compute (module docstring)."""
    catalog = default_catalog()
    placement = CascadePlacement.parse(PLACEMENT)
    rng = np.random.default_rng(PLAN_SEED)
    models = placement.order
    records = synthetic_validation(
        rng, [ACCURACY[m] for m in models], names=models, n_samples=2000, dataset="synthetic"
    )
    profiles: dict[str, dict[str, LatencyProfile]] = {}
    prices: dict[str, float] = {}
    for model in models:
        for instance_type in placement.fleets[model]:
            speed = catalog.get(instance_type).speed_factor
            curve = EMULATED_COMPUTE[model]
            samples = tuple(
                (curve.latency_ms(b) / speed + SERVING_MS) * rng.lognormal(0.0, 0.05, size=20)
                for b in BATCH_SIZES
            )
            profiles.setdefault(model, {})[instance_type] = LatencyProfile(
                model, instance_type, np.array(BATCH_SIZES), samples
            )
            prices[instance_type] = catalog.price_usd_per_hr(instance_type)
    return plan_gears(records, placement, profiles, prices, slo_ms=DEMO_SLO_MS, seed=PLAN_SEED)


def tuned_share(arrival_s: np.ndarray, ticks_s: np.ndarray) -> np.ndarray:
    """The capacity share of the tuned fleet at each tick (module docstring)."""
    share = np.ones(ticks_s.size)
    ready, asked, pending_s, quiet_since = 1.0, 1.0, math.inf, -math.inf
    for k, now_s in enumerate(ticks_s):
        lo, hi = np.searchsorted(arrival_s, [now_s - RATE_SPAN_S, now_s], side="right")
        rate = (hi - lo) / RATE_SPAN_S
        need = rate / (TUNED_UTILISATION * DEMO_RATE_QPS)
        wanted = max(1.0, math.ceil(need / TUNED_STEP - 1e-9) * TUNED_STEP)
        if wanted > asked:
            asked, pending_s = wanted, now_s + BOOT_S
        if now_s >= pending_s:
            ready, pending_s = asked, math.inf
        if wanted < ready and pending_s == math.inf:
            if quiet_since == -math.inf:
                quiet_since = now_s
            if now_s - quiet_since >= DRAIN_QUIET_S:
                ready = asked = max(wanted, ready - TUNED_STEP)
                quiet_since = -math.inf
        else:
            quiet_since = -math.inf
        share[k] = ready
    return share


@dataclass(frozen=True, slots=True)
class CycleRun:
    switches: int  # changes of cascade
    changes: int  # changes of the gear index
    slow_share: float  # time in a gear of a lower range than the load's (an SLO risk)
    accuracy_loss_points: float  # time-weighted, against the gear of the load's range


def run_cycle(
    plan: GearPlan, arrival_s: np.ndarray, share: np.ndarray, rule: Hysteresis
) -> CycleRun:
    ticks = np.arange(share.size) * DEFAULT_TICK_S
    counts = np.searchsorted(arrival_s, ticks, side="right") - np.searchsorted(
        arrival_s, ticks - DEFAULT_WINDOW_S, side="right"
    )
    measured = counts / DEFAULT_WINDOW_S
    state = start_switcher(plan, expected_qps=float(measured[0]), hysteresis=rule)
    accuracy = [plan.option_of(g).accuracy for g in range(len(plan.gears))]
    switches = changes = slow = 0
    loss = 0.0
    for now_s, qps, capacity in zip(ticks, measured, share, strict=True):
        decision, state = switch(float(qps), 0, state, float(now_s), capacity_share=float(capacity))
        switches += decision.switched
        changes += decision.changed
        ideal = plan.gear_for(decision.effective_qps)
        slow += state.gear < ideal
        loss += accuracy[ideal] - accuracy[state.gear]
    return CycleRun(switches, changes, slow / ticks.size, 100.0 * loss / ticks.size)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(plan: GearPlan, seeds: int, cycles: int) -> dict[str, Any]:
    ticks = np.arange(round(LOAD_PERIOD_S / DEFAULT_TICK_S)) * DEFAULT_TICK_S
    runs: dict[tuple[str, str], list[CycleRun]] = {}
    for seed in range(seeds):
        for cycle in range(cycles):
            arrival = load_trace(cycle, 1, seed=seed).arrival_s
            shares = {"fixed": np.ones(ticks.size), "tuned": tuned_share(arrival, ticks)}
            for fleet, share in shares.items():
                for name, rule in RULES.items():
                    runs.setdefault((name, fleet), []).append(run_cycle(plan, arrival, share, rule))
    return {
        f"{name}/{fleet}": {
            "switches_per_cycle": spread([r.switches for r in found]),
            "gear_changes_per_cycle": spread([r.changes for r in found]),
            "slow_gear_time_share": spread([r.slow_share for r in found]),
            "accuracy_loss_points": spread([r.accuracy_loss_points for r in found]),
            "runs": len(found),
        }
        for (name, fleet), found in runs.items()
    }


def _cell(found: dict[str, float], form: str) -> str:
    return (
        f"{form.format(found['median'])} ({form.format(found['min'])}-{form.format(found['max'])})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="load seeds (default 10)")
    parser.add_argument("--cycles", type=int, default=1, help="load cycles per seed (default 1)")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.cycles < 1:
        parser.error("--seeds and --cycles must be >= 1")
    plan = demo_plan()
    results = measure(plan, args.seeds, args.cycles)
    rule = Hysteresis()
    document = {
        "plan": [
            {
                "low_qps": g.low_qps,
                "high_qps": g.high_qps,
                "cascade": plan.option_of(k).cascade.label,
            }
            for k, g in enumerate(plan.gears)
        ],
        "hysteresis": {
            "band_share": rule.band_share,
            "down_hold_s": rule.down_hold_s,
            "down_dwell_s": rule.down_dwell_s,
            "up_dwell_s": rule.up_dwell_s,
        },
        "goal_switches_per_cycle": GOAL_PER_CYCLE,
        "results": results,
    }
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(f"gear plan of {PLACEMENT}, SLO P99 {DEMO_SLO_MS:g} ms:")
    for gear in document["plan"]:
        print(f"  [{gear['low_qps']:7.2f}, {gear['high_qps']:7.2f}) qps: {gear['cascade']}")
    print(
        f"hysteresis after: band {rule.band_share:g}, hold {rule.down_hold_s:g} s, dwell down"
        f" {rule.down_dwell_s:g} s, up {rule.up_dwell_s:g} s;"
        f" {args.seeds} seeds x {args.cycles} cycle(s) of {LOAD_PERIOD_S:g} s"
    )
    print("median (min-max) over the runs")
    print(
        f"{'rule/fleet':<14}{'switches/cycle':>16}{'gear changes/cycle':>20}"
        f"{'slow-gear time':>20}{'accuracy loss, points':>26}"
    )
    for key, found in results.items():
        s, c, t, a = (
            found["switches_per_cycle"],
            found["gear_changes_per_cycle"],
            found["slow_gear_time_share"],
            found["accuracy_loss_points"],
        )
        print(
            f"{key:<14}{_cell(s, '{:g}'):>16}{_cell(c, '{:g}'):>20}"
            f"{_cell(t, '{:.1%}'):>20}{_cell(a, '{:.3f}'):>26}"
        )
    worst = max(r["switches_per_cycle"]["max"] for k, r in results.items() if k.startswith("after"))
    verdict = "holds" if worst <= GOAL_PER_CYCLE else "misses"
    print(
        f"at most {GOAL_PER_CYCLE} switches per cycle with the hysteresis (worst {worst:g}):",
        verdict,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
