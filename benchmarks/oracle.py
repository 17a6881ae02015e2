"""The clairvoyant per-minute oracle the tuner benchmarks compare with.

For each whole minute m of a test trace, the planner's plan for that minute's mean rate r_m
(arrivals in [60 m, 60 m + 60) / 60 s) on a steady trace of the test trace's arrival process
(``shape``: its gamma CV^2, scaled to r_m); its cost is sum_m cost_m (USD/hr) x 60 s / 3600
(instance-seconds: no boot, no scale-down delay, instantly the right fleet). Plans are cached by
r_m rounded to ``rate_step_qps`` (to the nearest, so the rounding is unbiased).

Used by ``benchmarks/tuner_oracle.py`` and ``benchmarks/autoscaling_heldout.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import plan_app, scale_trace
from controlplane.policies.replay import FleetTimeline
from controlplane.spec import ResolvedApp
from estimator.simulator import InstanceSpec
from estimator.traces import Trace

__all__ = [
    "MINUTE_S",
    "ORACLE_RATE_STEP_QPS",
    "Oracle",
    "fleet_of",
    "minute_rates_qps",
    "oracle_batches",
    "oracle_cost",
    "oracle_timeline",
]

MINUTE_S = 60.0
ORACLE_RATE_STEP_QPS = 0.5


def minute_rates_qps(trace: Trace, duration_s: float) -> list[float]:
    """The mean arrival rate of each whole minute of ``trace`` over ``duration_s``."""
    edges = np.arange(0.0, duration_s + MINUTE_S / 2, MINUTE_S)
    counts, _ = np.histogram(trace.arrival_s, bins=edges)
    return [float(c) / MINUTE_S for c in counts]


def fleet_of(plan: PlanDocument) -> dict[str, int]:
    """The plan's instances by type (every stage together, types with none left out)."""
    fleet: dict[str, int] = {}
    for stage in plan.stages:
        for name, count in sorted(stage.fleet.items()):
            if count:
                fleet[name] = fleet.get(name, 0) + count
    return fleet


class Oracle:
    """Plans per rate, cached by the rate rounded to ``rate_step_qps``."""

    def __init__(
        self,
        app: ResolvedApp,
        shape: Trace,
        seed: int,
        rate_step_qps: float = ORACLE_RATE_STEP_QPS,
    ) -> None:
        self.app, self.shape, self.seed = app, shape, seed
        self.rate_step_qps = rate_step_qps
        self.plans: dict[float, PlanDocument] = {}

    def plan(self, rate_qps: float) -> PlanDocument:
        step = self.rate_step_qps
        key = max(
            step, round(rate_qps / step) * step
        )  # a minute with no arrivals plans for one step
        if key not in self.plans:
            self.plans[key] = plan_app(self.app, scale_trace(self.shape, key), seed=self.seed)
        return self.plans[key]


def oracle_cost(
    oracle: Oracle, rates_qps: Sequence[float]
) -> tuple[float, list[dict[str, int]], bool]:
    """(USD, fleet per minute, every minute's plan feasible)."""
    cost = 0.0
    fleets = []
    feasible = True
    for rate in rates_qps:
        plan = oracle.plan(rate)
        cost += plan.cost_usd_per_hr * MINUTE_S / 3600.0
        fleets.append(fleet_of(plan))
        feasible = feasible and plan.feasible
    return cost, fleets, feasible


def oracle_batches(oracle: Oracle, rates_qps: Sequence[float]) -> list[int]:
    """Each minute's plan's batch size (the most queries a batch takes; a single stage's)."""
    return [oracle.plan(rate).stages[0].batch_size for rate in rates_qps]


def oracle_timeline(
    fleets: Sequence[dict[str, int]], batches: Sequence[int] = (), planned_batch: int = 1
) -> FleetTimeline:
    """The oracle's fleet as the simulator takes it: minute m runs ``fleets[m]``, switched at the
    minute's start with no boot (instance j of a type serves in every minute whose plan has more
    than j of it; the last minute's serve to the run's end). With ``batches`` (each minute's
    plan's batch size, :func:`oracle_batches`), minute m serves with its plan's batch cap too
    (``batch_caps`` where it differs from the minute before, the first from ``planned_batch``,
    the batch the replayed stage's plan has), as the planner simulated that minute's fleet."""
    instances = []
    types = sorted({name for fleet in fleets for name in fleet})
    for name in types:
        most = max(fleet.get(name, 0) for fleet in fleets)
        for j in range(most):
            alive = [fleet.get(name, 0) > j for fleet in fleets] + [False]
            start = None
            for m, on in enumerate(alive):
                if on and start is None:
                    start = m
                elif not on and start is not None:
                    stop = math.inf if m == len(fleets) else m * MINUTE_S
                    instances.append(InstanceSpec(name, start * MINUTE_S, stop, start * MINUTE_S))
                    start = None
    caps: list[tuple[float, int]] = []
    for m, batch in enumerate(batches):
        if (caps[-1][1] if caps else planned_batch) != batch:
            caps.append((m * MINUTE_S, int(batch)))
    return FleetTimeline(tuple(instances), batch_caps=tuple(caps))
