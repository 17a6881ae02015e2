"""CG-Peak and CG-Mean: static plans for a trace's peak or its mean rate.

This module owns InferLine's coarse-grained baselines (Crankshaw et al., SoCC'20, section 6: the
planner's configuration for the peak or the mean arrival rate, never changed while serving) as
``heteroplane replay --policy peak|mean`` makes them: the rate (:func:`baseline_rate_qps`) and the
plan for it (:func:`plan_baseline`).

The rates of a trace of n arrivals a_1 <= ... <= a_n:

* the **mean rate** is (n - 1) / (a_n - a_1), the planner's own measure of a trace's rate;
* the **peak rate** over a window w is max_i #{j : a_i <= a_j < a_i + w} / w, the most arrivals in
  any window of length w that starts at an arrival (:func:`controlplane.policies.planner.
  peak_rate_qps`), with w = :data:`PEAK_WINDOW_S` = 10 s by default: the planner's own peak window,
  the burst a plan must carry without help (a trace shorter than w has its mean rate as peak).

The plan for a rate r is the planner's (:func:`controlplane.policies.planner.plan_app`) on a
*steady* trace at r: the planning trace (the shape: its arrival process and batch sizes), its
arrival times scaled so that its mean rate is r (:func:`controlplane.policies.planner.scale_trace`).
By default the shape is the replayed trace's first 10% (the part an operator saw before planning,
as for the tuner, :data:`controlplane.policies.replay.DEFAULT_PLANNING_SHARE`). The planner
then adds the burst headroom the shape's arrival process needs on top of r, as it does for any
plan: CG-Peak provisions for its peak rate with bursts at that rate, which is what makes it the
costly baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import PEAK_WINDOW_S, peak_rate_qps, plan_app, scale_trace
from controlplane.policies.replay import DEFAULT_PLANNING_SHARE, ReplayError
from controlplane.spec import ResolvedApp
from estimator.traces import Trace

__all__ = [
    "BASELINES",
    "PEAK_WINDOW_S",
    "Baseline",
    "BaselinePlan",
    "baseline_rate_qps",
    "leading_share",
    "plan_baseline",
]

Baseline = Literal["peak", "mean"]
BASELINES: tuple[Baseline, ...] = ("peak", "mean")


@dataclass(frozen=True, slots=True)
class BaselinePlan:
    """The plan a baseline replays: ``plan`` was made for ``rate_qps``, the replayed trace's peak
    (over ``window_s``) or mean (``window_s`` None) rate."""

    baseline: Baseline
    rate_qps: float
    window_s: float | None
    plan: PlanDocument


def baseline_rate_qps(trace: Trace, baseline: Baseline, window_s: float = PEAK_WINDOW_S) -> float:
    """The trace's peak rate over ``window_s`` or its mean rate (the module docstring).

    >>> import numpy as np
    >>> t = Trace(np.array([0.0, 1.0, 1.5, 2.0, 20.0]), np.ones(5, dtype=np.int64))
    >>> baseline_rate_qps(t, "mean"), baseline_rate_qps(t, "peak", 2.0)
    (0.2, 1.5)

    Raises:
        ReplayError: an unknown baseline, a window that is not a finite number > 0, or a trace
            with fewer than two arrivals or no duration.
    """
    if baseline not in BASELINES:
        raise ReplayError(f"unknown baseline {baseline!r} (peak or mean)")
    if not (window_s > 0 and window_s < float("inf")):
        raise ReplayError(f"the peak window must be a finite number > 0 s, got {window_s!r}")
    if len(trace) < 2 or trace.duration_s <= 0:
        raise ReplayError("a rate needs a trace of at least two arrivals over some time")
    if baseline == "mean":
        return (len(trace) - 1) / trace.duration_s
    return peak_rate_qps(trace, window_s)


def leading_share(trace: Trace, share: float = DEFAULT_PLANNING_SHARE) -> Trace:
    """The queries of the trace's first ``share`` of its duration (arrival times and batch sizes).

    Raises:
        ReplayError: a share outside (0, 1].
    """
    if not 0.0 < share <= 1.0:
        raise ReplayError(f"the planning share must be in (0, 1], got {share!r}")
    arrival = trace.arrival_s
    end_s = float(arrival[0]) + share * trace.duration_s if arrival.size else 0.0
    keep = arrival <= end_s
    ids = trace.sample_id
    return Trace(arrival[keep], trace.batch_size[keep], None if ids is None else ids[keep])


def plan_baseline(
    app: ResolvedApp,
    trace: Trace,
    baseline: Baseline,
    *,
    shape: Trace | None = None,
    window_s: float = PEAK_WINDOW_S,
    seed: int = 0,
) -> BaselinePlan:
    """CG-Peak or CG-Mean for ``trace``: the planner's plan on ``shape`` (by default the trace's
    first 10%, :func:`leading_share`) with its arrival times scaled to the trace's peak or mean
    rate (:func:`baseline_rate_qps`). Deterministic for a seed.

    Raises:
        ReplayError: a bad baseline or window, or a trace or shape too short to plan on.
        EstimatorError: the planner's errors (an SLO the service time alone exceeds).
    """
    rate_qps = baseline_rate_qps(trace, baseline, window_s)
    steady = leading_share(trace) if shape is None else shape
    if len(steady) < 2 or steady.duration_s <= 0:
        raise ReplayError(
            "the planning trace needs at least two arrivals over some time to plan "
            f"CG-{baseline.capitalize()} on"
        )
    plan = plan_app(app, scale_trace(steady, rate_qps), seed=seed)
    return BaselinePlan(baseline, rate_qps, window_s if baseline == "peak" else None, plan)
