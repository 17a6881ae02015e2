"""The planner: the cheapest instance mix, batch size and replica counts that meet the SLO.

This module owns InferLine's low-frequency planner (Crankshaw et al., SoCC'20, section 4.3,
Algorithms 1 and 2), with the "hardware" of a stage generalised to a heterogeneous instance mix
whose starting point comes from the Kairos throughput upper bound (Kairos, HPDC'23, section 5.2;
``estimator.bounds``). The estimator (``estimator.simulator``) is the only judge of feasibility:
a configuration is feasible when the simulated P-th percentile of the response times on the
planning trace is within the SLO (P = ``slo.percentile``, 99 by default), and it is not
simulated at all when its capacity (each instance's throughput at the batch size, an upper
bound) does not exceed the trace's mean rate: such a queue grows without bound, which a short
trace (5,000 queries at a high rate last a fraction of a second) would not show.

docs/planner.md states the algorithm step by step (the service-time bound, the Kairos start mix,
Algorithm 1's added capacity, Algorithm 2's greedy cuts, the budget rule, cascades planned
jointly against the end-to-end SLO (Cascadia's MILP proposes, the pipeline simulation judges),
the end-to-end prediction, the planned envelope and
the document's contract); the functions below cite the step they implement. Why the constants
have their values is said where they are defined.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from controlplane.policies.calibration import OVERHEAD_QUANTILES, draw_overhead_ms
from controlplane.policies.gears import CascadePlacement, plan_gears
from controlplane.policies.pipeline import (
    answering_stages,
    dispatch_choice,
    dispatch_factory,
    pipeline_stages,
    reaching_batch_sizes,
)
from controlplane.policies.plan import DispatchName, PlanDocument, StagePlan
from controlplane.policies.replay import rate_per_instance_qps
from controlplane.spec import ResolvedApp
from estimator import deadline
from estimator.allocation import cheapest_within
from estimator.bounds import KairosQuantities, Ranking, kairos_quantities, rank_configurations
from estimator.capacity import bisect_rate
from estimator.envelope import DEFAULT_MAX_WINDOW_S, arrival_envelope, tuner_windows_s
from estimator.errors import (
    BatchSizeOutOfRangeError,
    BudgetError,
    CascadeError,
    EstimatorError,
    InfeasibleQoSError,
    SearchSpaceError,
)
from estimator.fleet import Fleet
from estimator.numbers import money, plain
from estimator.profiles import LatencyProfile, ProfileSet
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace

__all__ = [
    "HEADROOM",
    "MIN_ENVELOPE_WINDOW_S",
    "MIN_STAGE_QUERIES",
    "PEAK_WINDOW_S",
    "PLANNING_QUERIES",
    "InfeasibleSLOError",
    "ServingCapacityError",
    "busiest_segment",
    "end_to_end_tail_ms",
    "front_waits_ms",
    "overhead_draws_ms",
    "peak_rate_qps",
    "plan_app",
    "scale_trace",
]

# The planner simulates at most this many queries per configuration: 20,000 queries keep one
# Kairos-dispatched simulation near a second while resolving a P99 by 200 queries above it.
PLANNING_QUERIES = 20_000
# A later stage of a cascade that fewer queries reach is planned on the trace's first this many,
# so that it keeps an instance (its simulated tail then says nothing of the traffic).
MIN_STAGE_QUERIES = 2
# The Kairos bound is an upper bound on the allowable rate; a start mix should have ~30% more
# bound than the peak it must carry (InferLine's rho_m, the maximum provisioning ratio, is
# of the same spirit). Algorithm 1 adds to a start that is too small, Algorithm 2 cuts one too big.
HEADROOM = 0.7
# The start mix is found among every affordable mix when there are at most this many; past it
# (large budgets: $20/hr over four types already), among every mix up to the smallest budget,
# doubling from the cheapest full-range price, whose mixes hold one that covers the peak.
MAX_RANKED_MIXES = 200_000
# The window over which the peak arrival rate is measured (the tuner's longest windows are 60 s;
# 10 s is the burst a plan must absorb without the tuner's help).
PEAK_WINDOW_S = 10.0
# Relative tolerance of the bisection for the highest feasible rate.
RATE_REL_TOL = 0.02
# Algorithm 1 gives up after this many added instances (a guard; budgets end it sooner).
MAX_ADDED_INSTANCES = 500
# The shortest window of the tuner's envelopes: a service time of milliseconds would make windows
# that hold one or two arrivals, whose rates are noise. The live tuner takes the same floor, so a
# plan's envelope and the tuner's proxy one have the same windows.
MIN_ENVELOPE_WINDOW_S = 1.0
# The random stream (with the plan's seed) of the overhead drawn per simulated query.
_OVERHEAD_STREAM = 7919


class InfeasibleSLOError(EstimatorError):
    """No configuration can meet the SLO: the service time alone exceeds it."""

    def __init__(
        self, model: str, instance_type: str, latency_ms: float, slo_ms: float, percentile: float
    ) -> None:
        self.model = model
        self.instance_type = instance_type
        self.latency_ms = latency_ms
        self.slo_ms = slo_ms
        super().__init__(
            f"infeasible: the service time alone exceeds the SLO: model {model!r} on its fastest"
            f" type {instance_type} takes {latency_ms:.2f} ms (p{percentile:.15g} of the trace's"
            f" batch sizes at batch 1) > SLO {slo_ms:g} ms"
        )


class ServingCapacityError(EstimatorError):
    """The trace's rate is past what the serving process carries: its queue in front of the
    workers grows without bound, whatever the fleet."""

    def __init__(self, rate_qps: float, cpu_ms: float) -> None:
        self.rate_qps = rate_qps
        self.cpu_ms = cpu_ms
        super().__init__(
            f"infeasible: the serving process carries at most {1000.0 / cpu_ms:.0f} qps of this"
            f" app ({cpu_ms:.3f} ms of its CPU per query, as the service measured it) and the"
            f" trace's mean rate is {rate_qps:.1f} qps: no fleet of workers serves that through"
            " it (a smaller rate, or a lighter request: binary tensors, fewer rows)"
        )


# --- traces ----------------------------------------------------------------------------------


def peak_rate_qps(trace: Trace, window_s: float = PEAK_WINDOW_S) -> float:
    """The most arrivals in any window of ``window_s`` starting at an arrival, per second (the
    mean rate when the trace is shorter than the window).

    >>> peak_rate_qps(Trace(np.array([0.0, 1.0, 1.5, 2.0, 20.0]), np.ones(5)), 10.0)
    0.4
    """
    arrival = trace.arrival_s
    if trace.duration_s <= window_s:
        return (len(trace) - 1) / trace.duration_s if trace.duration_s > 0 else 0.0
    ends = np.searchsorted(arrival, arrival + window_s, side="left")
    return float(np.max(ends - np.arange(arrival.size))) / window_s


def _rate_qps(trace: Trace) -> float:
    return (len(trace) - 1) / trace.duration_s if trace.duration_s > 0 else 0.0


def busiest_segment(arrival_s: NDArray[np.float64], n: int) -> int:
    """Where the ``n`` consecutive queries of sorted ``arrival_s`` that arrive within the shortest
    time start (the earliest such start on a tie; 0 when there are at most ``n``).

    The planner simulates at most :data:`PLANNING_QUERIES` queries; a static plan must hold
    through the trace's busiest stretch, not through whichever part comes first (a burst after the
    first 20,000 queries was planned as if it did not exist).

    >>> busiest_segment(np.array([0.0, 1.0, 2.0, 2.5, 2.6, 5.0]), 3)
    2
    """
    if arrival_s.size <= n:
        return 0
    spans = arrival_s[n - 1 :] - arrival_s[: arrival_s.size - n + 1]
    return int(np.argmin(spans))


def scale_trace(trace: Trace, rate_qps: float) -> Trace:
    """``trace`` with its arrival times scaled so that its mean rate is ``rate_qps``."""
    factor = _rate_qps(trace) / rate_qps
    return Trace((trace.arrival_s - trace.arrival_s[0]) * factor, trace.batch_size)


# --- one stage -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StageInputs:
    model: str
    profiles: Mapping[str, LatencyProfile]  # the candidate types that cover the trace
    prices_usd_per_hr: Mapping[str, float]
    max_counts: Mapping[str, int]
    slo_ms: float
    percentile: float
    budget_usd_per_hr: float
    profile_set: ProfileSet


@dataclass(slots=True)
class _Evaluator:
    """Simulates (fleet, batch size) on the planning trace with one seed; caches the answers."""

    inputs: _StageInputs
    trace: Trace
    seed: int
    cache: dict[tuple[tuple[tuple[str, int], ...], int], tuple[float, float, DispatchName]] = field(
        default_factory=dict
    )
    simulations: int = 0

    def __call__(self, fleet: Mapping[str, int], batch: int) -> tuple[float, float, DispatchName]:
        """(P-th percentile response ms, throughput qps, policy name) of ``fleet`` at ``batch``."""
        key = (tuple(sorted((t, n) for t, n in fleet.items() if n)), batch)
        if key not in self.cache:
            self.cache[key] = self._simulate(dict(key[0]), batch)
            self.simulations += 1
        return self.cache[key]

    def _simulate(self, fleet: dict[str, int], batch: int) -> tuple[float, float, DispatchName]:
        deadline.check()  # a bounded preview stops between simulations
        name, stage = _simulated_stage(self.inputs, fleet, batch, self.trace.batch_size)
        capacity_qps = _capacity_qps(self.inputs, self.trace.batch_size, fleet, batch)
        if capacity_qps <= _rate_qps(self.trace):
            # Unstable: its queue grows without bound, however long the trace. A short one (a
            # high rate's 5,000 queries last a fraction of a second) ends before the queue has
            # grown past the SLO, and its simulated P99 would call the fleet feasible.
            return math.inf, capacity_qps, name
        result = simulate(
            self.trace,
            [stage],
            np.random.default_rng(self.seed),
            prices_usd_per_hr=self.inputs.prices_usd_per_hr,
            qos_ms=self.inputs.slo_ms,
        )
        tail_ms = float(np.percentile(result.response_ms, self.inputs.percentile))
        return tail_ms, result.summary().throughput_qps, name


def _simulated_stage(
    inputs: _StageInputs,
    fleet: Mapping[str, int],
    batch: int,
    batch_sizes: NDArray[np.int64],
    forward: NDArray[np.bool_] | None = None,
) -> tuple[DispatchName, Stage]:
    """The simulator's stage for ``fleet`` at ``batch`` and the name of its dispatch policy (see
    the module docstring, Dispatch); ``batch_sizes`` are those of the queries that reach the
    stage (they pick the Kairos base), ``forward`` which queries go on to the next stage."""
    used = {t: inputs.profiles[t] for t in fleet if fleet[t]}
    name, make = dispatch_factory(None, used, inputs.prices_usd_per_hr, batch_sizes, inputs.slo_ms)
    instances = tuple(InstanceSpec(t) for t in sorted(used) for _ in range(fleet[t]))
    stage = Stage(inputs.model, instances, used, make(), max_batch_queries=batch, forward=forward)
    return name, stage


def _cost(fleet: Mapping[str, int], prices: Mapping[str, float]) -> float:
    return money(sum(prices[t] * n for t, n in fleet.items()))


def _fleet_text(fleet: Mapping[str, int]) -> str:
    return ", ".join(f"{n} x {t}" for t, n in sorted(fleet.items()) if n) or "no instances"


def _check_service_time(inputs: _StageInputs, sizes: np.ndarray) -> None:
    """Algorithm 1, line 2: the fastest type per query, at batch 1, must leave room in the SLO."""
    names = sorted(inputs.profiles)
    latency = np.stack([inputs.profiles[t].mean_latencies_ms(sizes) for t in names])
    best_ms = latency.min(axis=0)
    bound_ms = float(np.percentile(best_ms, inputs.percentile))
    if bound_ms > inputs.slo_ms:
        # The query at the percentile: the type fastest for it, and its latency.
        q = int(np.argmin(np.abs(best_ms - bound_ms)))
        fastest = names[int(np.argmin(latency[:, q]))]
        raise InfeasibleSLOError(inputs.model, fastest, bound_ms, inputs.slo_ms, inputs.percentile)


def _start_fleet(
    inputs: _StageInputs, trace: Trace, value: Mapping[str, float]
) -> tuple[dict[str, int], str]:
    """Algorithm 1's start: the cheapest ranked mix whose bound covers the peak with headroom."""
    sizes, counts = np.unique(trace.batch_size, return_counts=True)
    names = sorted(inputs.profiles)
    peak = peak_rate_qps(trace)
    try:
        q = kairos_quantities(
            inputs.profile_set,
            inputs.model,
            names,
            inputs.prices_usd_per_hr,
            inputs.slo_ms,
            (sizes, counts / counts.sum()),
        )
        caps = _free_type_caps(
            inputs,
            trace.batch_size,
            peak,
            {t: inputs.max_counts[t] for t in q.type_names if t in inputs.max_counts},
        )
        if _mixes_estimate(q, inputs.budget_usd_per_hr, caps) > MAX_RANKED_MIXES:
            # Far more mixes than can be ranked: straight to the doubling budgets (the full
            # budget's enumeration would spend time and memory only to give up).
            ranking = _ranking_below(q, inputs.budget_usd_per_hr, caps, peak)
        else:
            try:
                ranking = rank_configurations(
                    q, inputs.budget_usd_per_hr, caps, None, max_ranked=MAX_RANKED_MIXES
                )
            except SearchSpaceError:
                ranking = _ranking_below(q, inputs.budget_usd_per_hr, caps, peak)
    except (InfeasibleQoSError, BudgetError):
        best = max(names, key=lambda t: (value[t], t))
        return {best: 1}, (
            f"no Kairos ranking (no type meets the SLO at every batch size within the budget);"
            f" start from one {best}"
        )
    covering = np.flatnonzero(HEADROOM * ranking.upper_bound_qps >= peak)
    if covering.size:
        index = int(covering[np.argmin(ranking.cost_usd_per_hr[covering])])
        within = ""
        if ranking.budget_usd_per_hr < inputs.budget_usd_per_hr:
            within = f" (mixes up to {ranking.budget_usd_per_hr:.4g} USD/hr)"
        why = (
            f"the cheapest of {len(ranking):,} ranked mixes{within} whose Kairos bound"
            f" {ranking.upper_bound_qps[index]:.1f} qps x headroom {HEADROOM:g} covers the peak"
            f" {peak:.1f} qps"
        )
    else:
        index = 0
        why = (
            f"no affordable mix has a Kairos bound x headroom {HEADROOM:g} above the peak"
            f" {peak:.1f} qps; start from the highest bound, {ranking.upper_bound_qps[0]:.1f} qps"
        )
    fleet = {t: n for t, n in ranking.fleet(index).items() if n}
    return fleet, why


def _free_type_caps(
    inputs: _StageInputs, batch_sizes: NDArray[np.int64], peak_qps: float, caps: dict[str, int]
) -> dict[str, int]:
    """``caps`` with each free type's count held to what covers ``peak_qps`` alone (with
    HEADROOM, one more for the bound's rounding): a price bounds a priced type's count within
    the budget, but a free type's is bounded only by its cap, which may be any number (a cap
    of a billion ranked and simulated fleets of a billion instances, without end)."""
    held = dict(caps)
    for t, profile in inputs.profiles.items():
        if inputs.prices_usd_per_hr.get(t, 0.0) > 0:
            continue
        try:
            rate = profile.rate_qps(batch_sizes)
        except EstimatorError:  # a batch size past its profile: no bound here
            continue
        if math.isfinite(rate) and rate > 0:
            need = math.ceil(peak_qps / (HEADROOM * rate)) + 1
            held[t] = min(held.get(t, need), need)
    return held


def _mixes_estimate(
    q: KairosQuantities, budget_usd_per_hr: float, caps: Mapping[str, int]
) -> float:
    """About how many mixes ``budget_usd_per_hr`` affords: the smaller of the box of counts
    (prod_t (cap_t + 1), cap_t = min(floor(B / P_t), max count)) and the volume of the simplex
    sum_t n_t P_t <= B over the priced types (B^k / (k! prod_t P_t)), each type's count at least
    1 wide. An estimate to skip a hopeless enumeration, never a bound the ranking relies on."""
    box = 1.0
    priced = []
    for t in q.types:
        price = t.price_usd_per_hr
        cap = caps.get(t.instance_type)
        most = math.inf if price <= 0 else math.floor(budget_usd_per_hr / price)
        if cap is not None:
            most = min(most, cap)
        box *= (most + 1) if math.isfinite(most) else math.inf
        if price > 0 and (cap is None or budget_usd_per_hr / price < cap):
            priced.append(price)
    volume = math.inf
    if len(priced) == len(q.types):
        volume = budget_usd_per_hr ** len(priced) / math.factorial(len(priced))
        for price in priced:
            volume /= price
    return min(box, volume)


def _ranking_below(
    q: KairosQuantities, budget_usd_per_hr: float, caps: Mapping[str, int], peak_qps: float
) -> Ranking:
    """Every mix up to the smallest budget b = P_min 2^i (P_min the cheapest full-range price;
    the last b is the budget itself) whose mixes include one with HEADROOM x bound >= the peak:
    its cheapest covering mix is then the cheapest of all, exactly. When the mixes up to some b
    are more than :data:`MAX_RANKED_MIXES` before one covers, the 5,000 of highest bound up to
    that b (the cheapest covering one among them, an approximation, is still far cheaper than
    among the 5,000 of highest bound within the whole budget)."""
    cheapest = min(t.price_usd_per_hr for t in q.types if t.full_range)
    b = max(cheapest, 1e-9)
    while True:
        b = min(b, budget_usd_per_hr)
        try:
            ranking = rank_configurations(q, b, caps, None, max_ranked=MAX_RANKED_MIXES)
        except SearchSpaceError:
            return rank_configurations(q, b, caps, 5_000)
        except BudgetError:  # b affords no full-range instance (within the caps) yet
            if b >= budget_usd_per_hr:
                raise
            b *= 2.0
            continue
        if b >= budget_usd_per_hr or np.any(HEADROOM * ranking.upper_bound_qps >= peak_qps):
            return ranking
        b *= 2.0


def _algorithm_1(
    inputs: _StageInputs,
    evaluate: _Evaluator,
    value: Mapping[str, float],
    steps: list[str],
) -> tuple[dict[str, int], int] | None:
    """A feasible (fleet, batch size) within the budget and caps, or ``None``: InferLine's
    Algorithm 1 at batch 1; when the budget or the caps allow no instance that helps, the
    fleet's batch size is doubled while the profiles hold it (:func:`_batched`)."""
    fleet, why = _start_fleet(inputs, evaluate.trace, value)
    prices = inputs.prices_usd_per_hr
    tail_ms, _, _ = evaluate(fleet, 1)
    steps.append(
        f"{inputs.model}: start from {_fleet_text(fleet)} (${_cost(fleet, prices):.3f}/hr): {why};"
        f" simulated P{inputs.percentile:.15g} {tail_ms:.1f} ms"
    )
    by_value = sorted(inputs.profiles, key=lambda t: (-value[t], t))
    for _ in range(MAX_ADDED_INSTANCES):
        if tail_ms <= inputs.slo_ms:
            return fleet, 1
        for t in by_value:
            grown = {**fleet, t: fleet.get(t, 0) + 1}
            if grown[t] > inputs.max_counts.get(t, math.inf):
                continue
            if _cost(grown, prices) > inputs.budget_usd_per_hr + 1e-9:
                continue
            grown_ms, _, _ = evaluate(grown, 1)
            if grown_ms < tail_ms:
                steps.append(
                    f"{inputs.model}: add one {t} (P{inputs.percentile:.15g} {tail_ms:.1f} ->"
                    f" {grown_ms:.1f} ms, ${_cost(grown, prices):.3f}/hr)"
                )
                fleet, tail_ms = grown, grown_ms
                break
        else:
            steps.append(
                f"{inputs.model}: no instance that fits the budget"
                f" ${plain(inputs.budget_usd_per_hr)}/hr lowers P{inputs.percentile:.15g} below"
                f" {inputs.slo_ms:g} ms (it is {tail_ms:.1f} ms on {_fleet_text(fleet)})"
            )
            return _batched(inputs, evaluate, fleet, tail_ms, steps)
    if tail_ms <= inputs.slo_ms:
        return fleet, 1
    return _batched(inputs, evaluate, fleet, tail_ms, steps)


def _batched(
    inputs: _StageInputs,
    evaluate: _Evaluator,
    fleet: dict[str, int],
    tail_ms: float,
    steps: list[str],
) -> tuple[dict[str, int], int] | None:
    """``fleet`` at the smallest of the batch sizes 2, 4, 8, ... (while every type's profile
    holds it) whose simulated tail meets the SLO, or ``None``: when no more instances can be
    bought, batching is what raises the fleet's throughput (it is among Algorithm 2's actions;
    here it makes a fleet feasible that is not at batch 1)."""
    smallest = int(evaluate.trace.batch_size.min())
    batch = 2
    while _batch_fits(inputs, fleet, batch, smallest):
        batched_ms, _, _ = evaluate(fleet, batch)
        if batched_ms <= inputs.slo_ms:
            steps.append(
                f"{inputs.model}: batch up to {batch} queries on {_fleet_text(fleet)}"
                f" (P{inputs.percentile:.15g} {tail_ms:.1f} -> {batched_ms:.1f} ms)"
            )
            return fleet, batch
        batch *= 2
    return None


def _batch_fits(inputs: _StageInputs, fleet: Mapping[str, int], batch: int, smallest: int) -> bool:
    return all(inputs.profiles[t].max_batch_size >= batch * smallest for t in fleet if fleet[t])


def _algorithm_2(
    inputs: _StageInputs,
    evaluate: _Evaluator,
    fleet: dict[str, int],
    steps: list[str],
    batch: int = 1,
) -> tuple[dict[str, int], int]:
    """Greedy cost cuts from a feasible (fleet, batch) while the estimator says feasible."""
    prices = inputs.prices_usd_per_hr
    smallest = int(evaluate.trace.batch_size.min())
    while True:
        actions: list[tuple[float, int, str, dict[str, int], int, str]] = []
        total = sum(fleet.values())
        for t in sorted(t for t in fleet if fleet[t]):
            if total > 1:
                fewer = {**fleet, t: fleet[t] - 1}
                actions.append((prices[t], 0, t, fewer, batch, f"remove one {t}"))
                if _batch_fits(inputs, fewer, 2 * batch, smallest):
                    actions.append(
                        (
                            prices[t],
                            2,
                            t,
                            fewer,
                            2 * batch,
                            f"double the batch size to {2 * batch} and remove one {t}",
                        )
                    )
            for u in sorted(inputs.profiles):
                if prices[u] < prices[t] and fleet.get(u, 0) + 1 <= inputs.max_counts.get(
                    u, math.inf
                ):
                    moved = {**fleet, t: fleet[t] - 1, u: fleet.get(u, 0) + 1}
                    actions.append(
                        (prices[t] - prices[u], 1, t + u, moved, batch, f"move one {t} to {u}")
                    )
        actions.sort(key=lambda a: (-a[0], a[1], a[2]))
        for saving, _, _, candidate, new_batch, what in actions:
            tail_ms, _, _ = evaluate(candidate, new_batch)
            if tail_ms <= inputs.slo_ms:
                fleet = {t: n for t, n in candidate.items() if n}
                batch = new_batch
                steps.append(
                    f"{inputs.model}: {what}: saves ${saving:.3f}/hr (now"
                    f" ${_cost(fleet, prices):.3f}/hr), P{inputs.percentile:.15g} {tail_ms:.1f} ms"
                )
                break
        else:
            steps.append(
                f"{inputs.model}: no action that cuts cost keeps P{inputs.percentile:.15g} within"
                f" {inputs.slo_ms:g} ms; done"
            )
            return fleet, batch


# Trades (docs/planner.md, "Trades after the cuts"): at most this many trades a stage; each is
# followed by Algorithm 2 again, and each saves money, so the rounds end long before it in
# practice (a bound on time, not a tuned figure).
MAX_TRADE_ROUNDS = 32


def _trade_candidates(
    inputs: _StageInputs,
    fleet: Mapping[str, int],
    batch: int,
    smallest: int,
    value: Mapping[str, float],
) -> list[tuple[str, str, str, int]]:
    """The trades worth trying on ``fleet``, best value first: ("buy", dear, cheap, k) sheds the
    fewest cheap instances that cost more than one dear one (k = floor(P_d / P_c) + 1) for one
    dear one; ("sell", dear, cheap, j) sells one dear one for at most j = ceil(P_d / P_c) - 1
    more cheap ones (which cost less). Algorithm 2's moves already cover j = 1."""
    prices = inputs.prices_usd_per_hr
    caps = inputs.max_counts
    buys: list[tuple[float, str, str, int]] = []
    sells: list[tuple[float, str, str, int]] = []
    for dear in sorted(inputs.profiles):
        for cheap in sorted(inputs.profiles):
            p_d, p_c = prices[dear], prices[cheap]
            if not p_d > p_c > 0:
                continue
            k = math.floor(p_d / p_c) + 1
            if (
                fleet.get(cheap, 0) >= k
                and fleet.get(dear, 0) + 1 <= caps.get(dear, math.inf)
                and _batch_fits(inputs, {dear: 1}, batch, smallest)
            ):
                buys.append((-value[dear], dear, cheap, k))
            j = math.ceil(p_d / p_c) - 1
            if cheap in caps:
                j = min(j, caps[cheap] - fleet.get(cheap, 0))
            if (
                fleet.get(dear, 0) >= 1
                and j >= 2
                and _batch_fits(inputs, {cheap: 1}, batch, smallest)
            ):
                sells.append((-value[cheap], dear, cheap, j))
    buys.sort()
    sells.sort()
    return [("buy", d, c, k) for _, d, c, k in buys] + [("sell", d, c, j) for _, d, c, j in sells]


def _fewest_cheap(
    inputs: _StageInputs,
    evaluate: _Evaluator,
    fleet: Mapping[str, int],
    batch: int,
    dear: str,
    cheap: str,
    most: int,
) -> tuple[int, dict[str, int], float] | None:
    """Sell one ``dear`` for the fewest more ``cheap`` (2..``most``) whose tail meets the SLO:
    ``most`` is tried first (when it fails, fewer fail too: the tail falls as instances are
    added), then a bisection."""

    def traded(j: int) -> dict[str, int]:
        return {**fleet, dear: fleet[dear] - 1, cheap: fleet.get(cheap, 0) + j}

    tail_ms, _, _ = evaluate(traded(most), batch)
    if tail_ms > inputs.slo_ms:
        return None
    low, high, best_ms = 1, most, tail_ms  # j = low fails (Algorithm 2's move), j = high holds
    while high - low > 1:
        mid = (low + high) // 2
        mid_ms, _, _ = evaluate(traded(mid), batch)
        if mid_ms <= inputs.slo_ms:
            high, best_ms = mid, mid_ms
        else:
            low = mid
    return high, traded(high), best_ms


def _trades(
    inputs: _StageInputs,
    evaluate: _Evaluator,
    fleet: dict[str, int],
    batch: int,
    value: Mapping[str, float],
    steps: list[str],
) -> tuple[dict[str, int], int]:
    """Trades between two types that no single cut of Algorithm 2 makes, each followed by
    Algorithm 2 again: buy one dear instance for several cheap ones that cost more, or sell one
    for several cheap ones that cost less (docs/planner.md, "Trades after the cuts"). The first
    trade (best value first) whose simulated tail meets the SLO is made."""
    prices = inputs.prices_usd_per_hr
    smallest = int(evaluate.trace.batch_size.min())
    pct = f"P{inputs.percentile:.15g}"
    for _ in range(MAX_TRADE_ROUNDS):
        made = None
        for kind, dear, cheap, n in _trade_candidates(inputs, fleet, batch, smallest, value):
            if kind == "buy":
                candidate = {**fleet, dear: fleet.get(dear, 0) + 1, cheap: fleet[cheap] - n}
                tail_ms, _, _ = evaluate(candidate, batch)
                if tail_ms <= inputs.slo_ms:
                    made = (candidate, tail_ms, f"trade {n} x {cheap} for one {dear}")
                    break
            else:
                found = _fewest_cheap(inputs, evaluate, fleet, batch, dear, cheap, n)
                if found is not None:
                    j, candidate, tail_ms = found
                    made = (candidate, tail_ms, f"trade one {dear} for {j} more {cheap}")
                    break
        if made is None:
            steps.append(
                f"{inputs.model}: no trade between two types cuts cost within the SLO; done"
            )
            return fleet, batch
        candidate, tail_ms, what = made
        saving = _cost(fleet, prices) - _cost(candidate, prices)
        fleet = {t: n for t, n in candidate.items() if n}
        steps.append(
            f"{inputs.model}: {what}: saves ${saving:.3f}/hr (now ${_cost(fleet, prices):.3f}/hr),"
            f" {pct} {tail_ms:.1f} ms"
        )
        fleet, batch = _algorithm_2(inputs, evaluate, fleet, steps, batch)
    steps.append(f"{inputs.model}: {MAX_TRADE_ROUNDS} trades made; stopped")
    return fleet, batch


@dataclass(frozen=True, slots=True)
class _Setup:
    """What planning each stage of an app needs, independent of the trace's rate."""

    stages: tuple[_StageInputs, ...]
    cheapest_usd_per_hr: tuple[float, ...]  # per stage: its cheapest candidate's price
    # per stage: which of the trace's queries reach it (None: all of them, s_m = 1)
    reach: tuple[NDArray[np.bool_] | None, ...]
    # per query: the stage that answers it (None: one stage, or every query reaches every stage)
    answered: NDArray[np.int64] | None = None

    def stage_trace(self, i: int, trace: Trace) -> Trace:
        """The queries of ``trace`` that reach stage ``i`` (the whole trace when all do)."""
        mask = self.reach[i]
        if mask is None:
            return trace
        return Trace(trace.arrival_s[mask], trace.batch_size[mask])

    def scale_factor(self, i: int) -> float:
        """s_i, the share of the app's queries that reach stage ``i``."""
        mask = self.reach[i]
        return 1.0 if mask is None else float(np.count_nonzero(mask)) / mask.size


def _reach(
    app: ResolvedApp, trace: Trace, seed: int, slo_ms: float, steps: list[str]
) -> tuple[tuple[NDArray[np.bool_] | None, ...], NDArray[np.int64] | None]:
    """Per stage, which queries reach it (see the module docstring; ``None`` for all), and per
    query the stage that answers it (``None``: one stage, or no validation records)."""
    order = app.spec.serving_order
    cascade, records = app.cascade, app.validation
    if len(order) == 1:
        return (None,), None
    if cascade is None or records is None:
        steps.append(
            f"cascade {' -> '.join(order)}: planned jointly with scale factor 1.0 (every query"
            f" reaches every stage: the spec gives no thresholds or validation records) against"
            f" the end-to-end SLO {slo_ms:g} ms"
        )
        return tuple(None for _ in order), None
    if trace.sample_id is not None:
        source = "the trace's sample ids"
    else:
        source = f"validation samples drawn uniformly (seed {seed})"
    stage = answering_stages(app, trace, np.random.default_rng(seed))
    assert stage is not None
    masks: list[NDArray[np.bool_] | None] = [None]
    for i in range(1, len(order)):
        mask = stage >= i
        if np.count_nonzero(mask) < MIN_STAGE_QUERIES:
            # A stage almost nobody reaches still needs an instance: plan it on the trace's
            # first queries too.
            mask = mask.copy()
            mask[:MIN_STAGE_QUERIES] = True
        masks.append(mask)
    shares = ", ".join(
        f"{model} {1.0 if m is None else np.count_nonzero(m) / m.size:.3f}"
        for model, m in zip(order, masks, strict=True)
    )
    steps.append(
        f"cascade {cascade.label}: scale factors from the validation records ({source}):"
        f" {shares}; the stages planned jointly against the end-to-end SLO {slo_ms:g} ms, the"
        f" whole pipeline simulated with each query forwarded as its sample says"
    )
    return tuple(masks), stage


def _setup(app: ResolvedApp, trace: Trace, steps: list[str], seed: int = 0) -> _Setup:
    limits = app.constraints
    order = app.spec.serving_order
    overhead_ms = limits.serving_overhead_ms
    if overhead_ms >= limits.slo_ms:
        raise InfeasibleSLOError(
            order[0],
            "the control plane's own path",
            overhead_ms,
            limits.slo_ms,
            limits.percentile,
        )
    rate_qps = _rate_qps(trace)
    if app.serving_cpu_ms > 0 and rate_qps * app.serving_cpu_ms / 1000.0 >= 1.0:
        raise ServingCapacityError(rate_qps, app.serving_cpu_ms)
    # The control plane's own time per query (measured by the service) comes off the SLO first:
    # the stages (planned jointly when there are several) share what is left.
    slo_ms = limits.stage_slo_ms
    if overhead_ms > 0:
        steps.append(
            f"the control plane's own time per query, {overhead_ms:.2f} ms as the service"
            f" measured it (the API before the serving loop), is added to every query's"
            f" simulated latency: the stages share the SLO less it"
        )
    if not any(limits.usable(t) for t in app.instance_types):
        raise EstimatorError(
            f"max_counts allows no instance of any candidate type"
            f" ({', '.join(app.instance_types)}): nothing can be planned; raise a count"
            " above 0 or drop it"
        )
    reach, answered = _reach(app, trace, seed, slo_ms, steps)
    smallest, largest = int(trace.batch_size.min()), int(trace.batch_size.max())
    stages = []
    for model in order:
        profiles: dict[str, LatencyProfile] = {}
        for t in app.instance_types:
            profile = app.profile(model, t)
            if not limits.usable(t):
                continue
            if profile.min_batch_size <= smallest and profile.max_batch_size >= largest:
                profiles[t] = profile
            else:
                steps.append(
                    f"{model}: {t} left out: its profile ({profile.min_batch_size}.."
                    f"{profile.max_batch_size}) does not cover the trace's batch sizes"
                    f" {smallest}..{largest}"
                )
        if not profiles:
            first = next(t for t in app.instance_types if limits.usable(t))
            profile = app.profile(model, first)
            raise BatchSizeOutOfRangeError(
                model,
                first,
                largest if profile.max_batch_size < largest else smallest,
                profile.min_batch_size,
                profile.max_batch_size,
            )
        stages.append(
            _StageInputs(
                model=model,
                profiles=profiles,
                prices_usd_per_hr={t: app.prices_usd_per_hr[t] for t in profiles},
                max_counts=limits.caps(profiles),
                slo_ms=slo_ms,
                percentile=limits.percentile,
                budget_usd_per_hr=limits.budget_usd_per_hr,
                profile_set=app.profiles[model],
            )
        )
    cheapest = tuple(min(s.prices_usd_per_hr.values()) for s in stages)
    return _Setup(tuple(stages), cheapest, reach, answered)


def _value_per_usd(inputs: _StageInputs, sizes: np.ndarray) -> dict[str, float]:
    """Q_t / P_t: queries per second per USD/hr of each type on the trace's batch sizes."""
    # A free type (price 0, which a spec allows only with a cap) is of unbounded value per USD.
    return {
        t: p.rate_qps(sizes) / price if (price := inputs.prices_usd_per_hr[t]) > 0 else math.inf
        for t, p in inputs.profiles.items()
    }


def _run(
    setup: _Setup,
    app: ResolvedApp,
    trace: Trace,
    seed: int,
    steps: list[str],
    optimise: bool,
    counter: list[int],
) -> list[StagePlan] | None:
    """Plan every stage on ``trace``; ``None`` when some stage has no plan within the budget.
    Without ``optimise`` only Algorithm 1 runs (a feasibility probe). Several stages are planned
    jointly (:func:`_run_joint`)."""
    if len(setup.stages) > 1:
        return _run_joint(setup, app, trace, seed, steps, optimise, counter)
    left_usd_per_hr = app.constraints.budget_usd_per_hr
    plans = []
    for i, stage in enumerate(setup.stages):
        reserve = sum(setup.cheapest_usd_per_hr[i + 1 :])
        inputs = _replace_budget(stage, left_usd_per_hr - reserve)
        if inputs.budget_usd_per_hr < min(inputs.prices_usd_per_hr.values()):
            steps.append(f"{stage.model}: the budget left buys no instance")
            return None
        stage_trace = setup.stage_trace(i, trace)
        evaluate = _Evaluator(inputs, stage_trace, seed)
        value = _value_per_usd(inputs, stage_trace.batch_size)
        try:
            found = _algorithm_1(inputs, evaluate, value, steps)
            if found is None:
                return None
            fleet, batch = found
            if optimise:
                fleet, batch = _algorithm_2(inputs, evaluate, fleet, steps, batch)
                if app.spec.planning is not None and app.spec.planning.trades:
                    fleet, batch = _trades(inputs, evaluate, fleet, batch, value, steps)
        finally:
            counter[0] += evaluate.simulations
        tail_ms, throughput, policy = evaluate(fleet, batch)
        cost = _cost(fleet, inputs.prices_usd_per_hr)
        left_usd_per_hr -= cost
        _, base = dispatch_choice(
            None,
            {t: inputs.profiles[t] for t in fleet if fleet[t]},
            inputs.prices_usd_per_hr,
            stage_trace.batch_size,
            inputs.slo_ms,
        )
        plans.append(
            StagePlan(
                stage.model,
                Fleet.of(dict(sorted(fleet.items()))),
                batch,
                tail_ms,
                throughput,
                cost,
                policy,
                setup.scale_factor(i),
                tuple(base),
            )
        )
    return plans


# --- cascades: the stages planned jointly ----------------------------------------------------

# The pipeline simulations one joint plan may spend on Algorithm 2's cuts (each of a 20,000-query
# planning sample through three stages takes about half a second on the event engine): past it
# the plan keeps the cheapest feasible allocation reached so far, and a step says so.
MAX_JOINT_CUT_SIMULATIONS = 60
# The proposal's candidate allocations per stage, type and batch size: counts from the fewest
# that keep the stage stable to this many more (the stage's latency has flattened long before on
# every trace we plan; the enumeration also stops once one more instance gains under 2%).
MAX_PROPOSAL_EXTRA = 12
PROPOSAL_FLAT = 0.98
# The largest batch size (queries per batch) the proposal tries; Algorithm 2 may double past it.
MAX_PROPOSAL_BATCH = 16
# The sum of stage latencies over-states the pipeline's tail (the slowest queries of one stage
# are rarely those of the next), so the MILP is solved with the SLO times each of these as the
# bound and the cheapest proposal that the pipeline simulation finds feasible is taken (on the
# test cascade the feasible proposals reach twice the SLO in the sum of stage tails).
PROPOSAL_BOUND_FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0)

# A joint allocation: per stage, its fleet as sorted (type, count) pairs and its batch size.
_Joint = tuple[tuple[tuple[tuple[str, int], ...], int], ...]


def _joint(fleets: list[dict[str, int]], batches: list[int]) -> _Joint:
    return tuple(
        (tuple(sorted((t, n) for t, n in f.items() if n)), b)
        for f, b in zip(fleets, batches, strict=True)
    )


@dataclass(slots=True)
class _PipelineJudge:
    """Simulates joint allocations end to end on the planning trace with one seed (the pipeline
    of :mod:`controlplane.policies.pipeline`, the one ``replay`` builds); caches the answers.
    The tail includes the control plane's own time per query."""

    setup: _Setup
    app: ResolvedApp
    trace: Trace
    seed: int
    cache: dict[_Joint, float] = field(default_factory=dict)
    simulations: int = 0

    def __call__(self, joint: _Joint) -> float:
        if joint not in self.cache:
            deadline.check()
            stages = pipeline_stages(
                self.app,
                [
                    (s.model, [InstanceSpec(t) for t, n in fleet for _ in range(n)], batch, None)
                    for s, (fleet, batch) in zip(self.setup.stages, joint, strict=True)
                ],
                self.trace,
                self.setup.answered,
            )
            result = simulate(
                self.trace,
                stages,
                np.random.default_rng(self.seed),
                prices_usd_per_hr=self.app.prices_usd_per_hr,
                qos_ms=self.app.constraints.slo_ms,
            )
            self.simulations += 1
            self.cache[joint] = end_to_end_tail_ms(
                result.response_ms,
                self.app,
                self.app.constraints.percentile,
                self.seed,
                result.arrival_s,
            )
        return self.cache[joint]


def end_to_end_tail_ms(
    response_ms: np.ndarray,
    app: ResolvedApp,
    percentile: float,
    seed: int,
    arrival_s: np.ndarray,
) -> float:
    """The ``percentile`` of simulated responses with the control plane's own time per query
    added: a draw from its measured distribution for each query when the service measured one
    (on a random stream of its own, from ``seed``: the tail of the sum, not the sum of a tail
    and a median), else its median (a constant shifts every percentile by itself); and, when
    the service measured its CPU per query (``app.serving_cpu_ms``), each query's wait at the
    serving process (:func:`front_waits_ms`) on the queries' ``arrival_s``."""
    if response_ms.size and app.serving_cpu_ms > 0:
        response_ms = response_ms + front_waits_ms(arrival_s, app.serving_cpu_ms)
    if app.serving_overhead_quantiles_ms and response_ms.size:
        draws = overhead_draws_ms(
            response_ms.size, seed, app.serving_overhead_ms, app.serving_overhead_quantiles_ms
        )
        return float(np.percentile(response_ms + draws, percentile))
    return float(np.percentile(response_ms, percentile)) + app.serving_overhead_ms


def front_waits_ms(arrival_s: np.ndarray, cpu_ms: float) -> np.ndarray:
    """Each query's wait (ms) at the serving process, a first-come first-served queue in front
    of the workers that serves every query in ``cpu_ms`` (its measured CPU per query): Lindley's
    recursion, departure d_i = max(a_i, d_(i-1)) + s, in closed form d_i = max over j <= i of
    (a_j - j s) + (i + 1) s; the wait is d_i - a_i - s (the serving itself is the own time the
    planner draws apart). In the order of ``arrival_s`` (sorted here when it is not). A rate
    past 1000 / ``cpu_ms`` makes the waits grow with the trace, as the queue would.

    >>> front_waits_ms(np.array([0.0, 0.0005, 0.0010, 0.5]), 1.0).round(3).tolist()
    [0.0, 0.5, 1.0, 0.0]
    """
    arrival = np.asarray(arrival_s, dtype=np.float64)
    if arrival.size == 0 or cpu_ms <= 0:
        return np.zeros(arrival.size)
    order = np.argsort(arrival, kind="stable")
    ordered = arrival[order]
    service_s = cpu_ms / 1000.0
    index = np.arange(ordered.size, dtype=np.float64)
    departure = np.maximum.accumulate(ordered - index * service_s) + (index + 1.0) * service_s
    waits = np.empty(arrival.size)
    waits[order] = np.maximum((departure - ordered - service_s) * 1000.0, 0.0)
    return waits


def overhead_draws_ms(
    count: int, seed: int, overhead_ms: float, quantiles_ms: Sequence[float]
) -> np.ndarray:
    """The control plane's own time for each of ``count`` simulated queries, as the planner
    adds it (:func:`end_to_end_tail_ms`): draws from ``quantiles_ms`` (its measured distribution
    at :data:`~controlplane.policies.calibration.OVERHEAD_QUANTILES`) on the plan's ``seed``'s
    stream of its own, or ``overhead_ms`` (the median) for every query when there is none."""
    if not quantiles_ms:
        return np.full(count, float(overhead_ms))
    return draw_overhead_ms(quantiles_ms, count, np.random.default_rng([seed, _OVERHEAD_STREAM]))


def _joint_cost(setup: _Setup, joint: _Joint) -> float:
    return sum(
        _cost(dict(fleet), s.prices_usd_per_hr)
        for s, (fleet, _) in zip(setup.stages, joint, strict=True)
    )


def _joint_text(setup: _Setup, joint: _Joint) -> str:
    return "; ".join(
        f"{s.model}: {_fleet_text(dict(fleet))} at batch {batch}"
        for s, (fleet, batch) in zip(setup.stages, joint, strict=True)
    )


def _within_caps(app: ResolvedApp, joint: _Joint) -> bool:
    """The spec's caps hold for the whole pipeline (a type's instances summed over stages)."""
    used: dict[str, int] = {}
    for fleet, _ in joint:
        for t, n in fleet:
            used[t] = used.get(t, 0) + n
    caps = app.constraints.max_counts
    return all(n <= caps.get(t, math.inf) for t, n in used.items())


def _stage_rate_qps(setup: _Setup, i: int, trace: Trace) -> float:
    mask = setup.reach[i]
    share = 1.0 if mask is None else float(np.count_nonzero(mask)) / mask.size
    return share * _rate_qps(trace)


def _stable(setup: _Setup, i: int, trace: Trace, fleet: Mapping[str, int], batch: int) -> bool:
    """Whether stage ``i``'s fleet serves at least its share of the trace's mean rate (an
    unstable stage's queue grows without bound: no need to simulate it)."""
    sizes = setup.stage_trace(i, trace).batch_size
    return _capacity_qps(setup.stages[i], sizes, fleet, batch) > _stage_rate_qps(setup, i, trace)


def _capacity_qps(
    inputs: _StageInputs, sizes: NDArray[np.int64], fleet: Mapping[str, int], batch: int
) -> float:
    """The most queries a second ``fleet`` serves at ``batch`` on the batch mix ``sizes``: the
    sum of its instances' rates (an upper bound, every batch full)."""
    return sum(
        n * rate_per_instance_qps(inputs.profiles[t], sizes, batch) for t, n in fleet.items() if n
    )


def _stage_options(
    setup: _Setup, i: int, trace: Trace, seed: int, bound_percentile: float, counter: list[int]
) -> tuple[list[tuple[dict[str, int], int]], NDArray[np.float64], NDArray[np.float64]]:
    """The proposal's candidates for stage ``i``: one type, a batch size and a count, each with
    the stage's simulated latency alone on the queries that reach it (the ``bound_percentile``-th
    percentile of their response times) and its cost."""
    inputs = setup.stages[i]
    stage_trace = setup.stage_trace(i, trace)
    sizes = stage_trace.batch_size
    smallest = int(sizes.min())
    rate = _stage_rate_qps(setup, i, trace)
    options: list[tuple[dict[str, int], int]] = []
    latency: list[float] = []
    cost: list[float] = []
    for t in sorted(inputs.profiles):
        price = inputs.prices_usd_per_hr[t]
        cap = min(inputs.max_counts.get(t, MAX_ADDED_INSTANCES), MAX_ADDED_INSTANCES)
        batch = 1
        while batch <= MAX_PROPOSAL_BATCH and _batch_fits(inputs, {t: 1}, batch, smallest):
            mu = rate_per_instance_qps(inputs.profiles[t], sizes, batch)
            first = max(1, math.floor(rate / mu) + 1) if mu > 0 else cap + 1
            previous = math.inf
            for n in range(first, min(cap, first + MAX_PROPOSAL_EXTRA) + 1):
                if n * price > inputs.budget_usd_per_hr + 1e-9:
                    break
                deadline.check()
                _, stage = _simulated_stage(inputs, {t: n}, batch, sizes)
                result = simulate(
                    stage_trace,
                    [stage],
                    np.random.default_rng(seed),
                    prices_usd_per_hr=inputs.prices_usd_per_hr,
                )
                counter[0] += 1
                tail_ms = float(np.percentile(result.response_ms, bound_percentile))
                options.append(({t: n}, batch))
                latency.append(tail_ms)
                cost.append(n * price)
                if tail_ms > PROPOSAL_FLAT * previous:
                    break
                previous = tail_ms
            batch *= 2
    return options, np.array(latency), np.array(cost)


def _proposal(
    setup: _Setup,
    app: ResolvedApp,
    trace: Trace,
    seed: int,
    judge: _PipelineJudge,
    steps: list[str],
    counter: list[int],
) -> _Joint | None:
    """Cascadia's MILP (:func:`estimator.allocation.cheapest_within`) over each stage's
    simulated candidates: the cheapest choice whose stage latencies sum to the SLO times each of
    :data:`PROPOSAL_BOUND_FACTORS`; of those proposals, the cheapest the pipeline simulation
    finds within the SLO, else the one of lowest simulated tail. A stage reached by the share s of
    the queries contributes to the pipeline's P-th percentile through its own
    (100 - (100 - P) / s)-th (at least its median), so that is its latency. When no choice fits,
    each stage takes the cheapest candidate within its share of the SLO by load (s_i over its
    fastest type's rate, summed over stages to 1), else its fastest."""
    limits = app.constraints
    bound_ms = limits.stage_slo_ms
    types = sorted({t for s in setup.stages for t in s.profiles})
    blocks = []
    choices = []
    load = []
    for i, inputs in enumerate(setup.stages):
        share = setup.scale_factor(i)
        percentile = min(limits.percentile, max(50.0, 100.0 - (100.0 - limits.percentile) / share))
        options, latency, cost = _stage_options(setup, i, trace, seed, percentile, counter)
        if not options:
            steps.append(f"{inputs.model}: no candidate allocation within the budget is stable")
            return None
        counts = np.array([[f.get(t, 0) for t in types] for f, _ in options], dtype=np.int64)
        blocks.append((counts, latency, cost))
        choices.append(options)
        sizes = setup.stage_trace(i, trace).batch_size
        load.append(share / max(p.rate_qps(sizes) for p in inputs.profiles.values()))
    caps = limits.caps(types)
    proposals: dict[_Joint, float] = {}
    for factor in PROPOSAL_BOUND_FACTORS:
        picked = cheapest_within(
            blocks,
            types,
            factor * bound_ms,
            budget_usd_per_hr=limits.budget_usd_per_hr,
            max_counts=caps,
        )
        if picked is not None:
            joint = _joint(
                [dict(choices[i][k][0]) for i, k in enumerate(picked)],
                [choices[i][k][1] for i, k in enumerate(picked)],
            )
            proposals.setdefault(joint, factor)
    candidates = len([None for c in choices for _ in c])
    if proposals:
        ordered = sorted(proposals, key=lambda j: (_joint_cost(setup, j), proposals[j]))
        tails = {}
        for joint in ordered:
            tails[joint] = judge(joint)
            if tails[joint] <= limits.slo_ms:
                break
        feasible = [j for j in tails if tails[j] <= limits.slo_ms]
        joint = (
            feasible[0] if feasible else min(tails, key=lambda j: (tails[j], _joint_cost(setup, j)))
        )
        how = (
            f"Cascadia's MILP over {candidates} simulated stage candidates (one type, count and"
            f" batch size each): the cheapest whose stage latencies sum to"
            f" {proposals[joint]:g} x {bound_ms:g} ms, the cheapest of {len(tails)} such"
            f" proposals {'within the SLO' if feasible else 'of lowest tail'} end to end"
        )
    else:
        picked = []
        for i, (_, latency, cost) in enumerate(blocks):
            within = np.flatnonzero(latency <= bound_ms * load[i] / sum(load))
            picked.append(
                int(within[np.argmin(cost[within])]) if within.size else int(np.argmin(latency))
            )
        joint = _joint(
            [dict(choices[i][k][0]) for i, k in enumerate(picked)],
            [choices[i][k][1] for i, k in enumerate(picked)],
        )
        how = (
            "no choice of the simulated stage candidates sums to the SLO within the budget (the"
            " MILP); per stage, the cheapest within its share of the SLO by load, else the fastest"
        )
    steps.append(
        f"joint proposal: {_joint_text(setup, joint)} (${_joint_cost(setup, joint):.3f}/hr): {how}"
    )
    return joint


def _joint_add(
    setup: _Setup, app: ResolvedApp, judge: _PipelineJudge, joint: _Joint, steps: list[str]
) -> _Joint | None:
    """Algorithm 1 on the pipeline: while the end-to-end tail is above the SLO, add the one
    instance (any stage, any type, within the budget and caps) that lowers it most; ``None``
    when none lowers it."""
    limits = app.constraints
    budget = limits.budget_usd_per_hr
    tail_ms = judge(joint)
    steps.append(
        f"end-to-end P{limits.percentile:.15g} of the proposal: {tail_ms:.1f} ms"
        f" (SLO {limits.slo_ms:g} ms)"
    )
    for _ in range(MAX_ADDED_INSTANCES):
        if tail_ms <= limits.slo_ms:
            return joint
        best: tuple[float, _Joint, str] | None = None
        for i, inputs in enumerate(setup.stages):
            fleet, batch = dict(joint[i][0]), joint[i][1]
            for t in sorted(inputs.profiles):
                grown = list(joint)
                grown[i] = _joint([{**fleet, t: fleet.get(t, 0) + 1}], [batch])[0]
                candidate = tuple(grown)
                if _joint_cost(setup, candidate) > budget + 1e-9 or not _within_caps(
                    app, candidate
                ):
                    continue
                grown_ms = judge(candidate)
                if best is None or grown_ms < best[0]:
                    best = (grown_ms, candidate, f"{inputs.model}: add one {t}")
        if best is None or best[0] >= tail_ms:
            steps.append(
                f"no instance that fits the budget ${plain(budget)}/hr lowers the end-to-end"
                f" P{limits.percentile:.15g} below {limits.slo_ms:g} ms (it is {tail_ms:.1f} ms on"
                f" {_joint_text(setup, joint)})"
            )
            return None
        steps.append(
            f"{best[2]} (end-to-end P{limits.percentile:.15g} {tail_ms:.1f} -> {best[0]:.1f} ms,"
            f" ${_joint_cost(setup, best[1]):.3f}/hr)"
        )
        tail_ms, joint = best[0], best[1]
    return joint if tail_ms <= limits.slo_ms else None


def _joint_cut(
    setup: _Setup,
    app: ResolvedApp,
    judge: _PipelineJudge,
    joint: _Joint,
    trace: Trace,
    steps: list[str],
) -> _Joint:
    """Algorithm 2 on the pipeline: the actions of :func:`_algorithm_2` on every stage, in order
    of saving, the first whose end-to-end tail stays within the SLO applied, until none does (or
    :data:`MAX_JOINT_CUT_SIMULATIONS` are spent). Stages left unstable are not simulated."""
    limits = app.constraints
    smallest = int(trace.batch_size.min())
    spent = judge.simulations
    while True:
        moves: list[tuple[float, int, str, int, dict[str, int], int, str]] = []
        for i, inputs in enumerate(setup.stages):
            fleet, batch = dict(joint[i][0]), joint[i][1]
            prices = inputs.prices_usd_per_hr
            total = sum(fleet.values())
            for t in sorted(t for t in fleet if fleet[t]):
                if total > 1:
                    fewer = {**fleet, t: fleet[t] - 1}
                    moves.append((prices[t], 0, t, i, fewer, batch, f"remove one {t}"))
                    if _batch_fits(inputs, fewer, 2 * batch, smallest):
                        what = f"double the batch size to {2 * batch} and remove one {t}"
                        moves.append((prices[t], 2, t, i, fewer, 2 * batch, what))
                for u in sorted(inputs.profiles):
                    if prices[u] < prices[t]:
                        moved = {**fleet, t: fleet[t] - 1, u: fleet.get(u, 0) + 1}
                        what = f"move one {t} to {u}"
                        moves.append((prices[t] - prices[u], 1, t + u, i, moved, batch, what))
        actions: list[tuple[float, int, str, _Joint, str]] = []
        for saving, kind, key, i, fleet, batch, what in moves:
            fleet = {t: n for t, n in fleet.items() if n}
            if not _stable(setup, i, trace, fleet, batch):
                continue
            changed = list(joint)
            changed[i] = _joint([fleet], [batch])[0]
            candidate = tuple(changed)
            if _within_caps(app, candidate):
                model = setup.stages[i].model
                actions.append((saving, kind, f"{i}:{key}", candidate, f"{model}: {what}"))
        actions.sort(key=lambda a: (-a[0], a[1], a[2]))
        for saving, _, _, candidate, what in actions:
            if judge.simulations - spent >= MAX_JOINT_CUT_SIMULATIONS:
                steps.append(
                    f"the cuts stop after {MAX_JOINT_CUT_SIMULATIONS} pipeline simulations (a"
                    f" bound on planning time); the plan keeps the last feasible allocation"
                )
                return joint
            tail_ms = judge(candidate)
            if tail_ms <= limits.slo_ms:
                joint = candidate
                steps.append(
                    f"{what}: saves ${saving:.3f}/hr (now ${_joint_cost(setup, joint):.3f}/hr),"
                    f" end-to-end P{limits.percentile:.15g} {tail_ms:.1f} ms"
                )
                break
        else:
            steps.append(
                f"no action that cuts cost keeps the end-to-end P{limits.percentile:.15g} within"
                f" {limits.slo_ms:g} ms; done"
            )
            return joint


def _run_joint(
    setup: _Setup,
    app: ResolvedApp,
    trace: Trace,
    seed: int,
    steps: list[str],
    optimise: bool,
    counter: list[int],
) -> list[StagePlan] | None:
    """Plan a cascade's stages together against the end-to-end SLO (docs/planner.md, Cascades):
    Cascadia's MILP proposes, the pipeline simulation judges, Algorithm 1 adds and Algorithm 2
    cuts on the joint allocation; the budget is the pipeline's. ``None`` when no allocation within
    the budget meets the SLO. Without ``optimise`` no cuts (a feasibility probe)."""
    judge = _PipelineJudge(setup, app, trace, seed)
    try:
        joint = _proposal(setup, app, trace, seed, judge, steps, counter)
        if joint is not None:
            joint = _joint_add(setup, app, judge, joint, steps)
        if joint is not None and optimise:
            joint = _joint_cut(setup, app, judge, joint, trace, steps)
    finally:
        counter[0] += judge.simulations
    if joint is None:
        return None
    budget = app.constraints.budget_usd_per_hr
    cost = _joint_cost(setup, joint)
    if cost > budget + 1e-9:
        # The proposal's fallback (no choice within the budget sums to the SLO) takes each
        # stage's cheapest candidate whatever it costs; where no cut brought it within the
        # budget, nothing within the budget meets the SLO.
        steps.append(
            f"{_joint_text(setup, joint)} costs ${cost:.3f}/hr, over the budget"
            f" ${plain(budget)}/hr: no allocation within the budget meets the SLO"
        )
        return None
    plans = []
    slo_ms = app.constraints.stage_slo_ms
    for i, (inputs, (fleet_items, batch)) in enumerate(zip(setup.stages, joint, strict=True)):
        fleet = dict(fleet_items)
        stage_trace = setup.stage_trace(i, trace)
        evaluate = _Evaluator(inputs, stage_trace, seed)
        tail_ms, throughput, _ = evaluate(fleet, batch)
        counter[0] += evaluate.simulations
        policy, base = dispatch_choice(
            None,
            {t: inputs.profiles[t] for t in fleet},
            inputs.prices_usd_per_hr,
            reaching_batch_sizes(trace, setup.answered, i),
            slo_ms,
        )
        plans.append(
            StagePlan(
                inputs.model,
                Fleet.of(dict(sorted(fleet.items()))),
                batch,
                tail_ms,
                throughput,
                _cost(fleet, inputs.prices_usd_per_hr),
                policy,
                setup.scale_factor(i),
                tuple(base),
            )
        )
    return plans


def _replace_budget(stage: _StageInputs, budget_usd_per_hr: float) -> _StageInputs:
    return dataclasses.replace(stage, budget_usd_per_hr=budget_usd_per_hr)


def plan_app(
    app: ResolvedApp,
    trace: Trace,
    *,
    seed: int = 0,
    max_queries: int = PLANNING_QUERIES,
    progress: Callable[[str], None] | None = None,
) -> PlanDocument:
    """Plan ``app`` for ``trace`` (see the module docstring for the algorithm).

    Deterministic for a seed. Raises :class:`InfeasibleSLOError` when the service time alone
    exceeds the SLO, and the estimator's errors for a trace the profiles cannot serve.
    """
    if len(trace) < 2:
        raise EstimatorError("the trace needs at least two queries to plan for")
    if trace.duration_s <= 0:
        raise EstimatorError(
            "the trace's queries all arrive at one time: it has no rate to plan for"
        )
    if max_queries < 2:
        raise ValueError(f"max_queries must be >= 2, got {max_queries}")
    say = progress or (lambda _message: None)
    steps: list[str] = []
    ids = trace.sample_id
    if len(trace) > max_queries:
        start = busiest_segment(trace.arrival_s, max_queries)
        part = slice(start, start + max_queries)
        sample = Trace(
            trace.arrival_s[part], trace.batch_size[part], None if ids is None else ids[part]
        )
        t0 = float(sample.arrival_s[0] - trace.arrival_s[0])
        steps.append(
            f"planned on the busiest {max_queries:,} of {len(trace):,} queries"
            f" ({t0:.0f}-{t0 + sample.duration_s:.0f} s of {trace.duration_s:.0f} s,"
            f" {_rate_qps(sample):.2f} qps against {_rate_qps(trace):.2f} over the whole trace)"
            " to keep simulations short"
        )
    else:
        sample = trace
    sample = Trace(sample.arrival_s - sample.arrival_s[0], sample.batch_size, sample.sample_id)
    setup = _setup(app, sample, steps, seed)
    for stage in setup.stages:
        _check_service_time(stage, sample.batch_size)
    rate = _rate_qps(sample)
    counter = [0]
    say(f"planning {app.spec.name} for {rate:.2f} qps ({len(sample):,} queries)")
    plans = _run(setup, app, sample, seed, steps, True, counter)
    max_feasible: float | None = None
    planned_rate = rate
    if plans is None:
        say("no plan within the budget serves the trace; bisecting the highest feasible rate")

        def feasible(rate_qps: float) -> bool:
            probe = scale_trace(sample, rate_qps)
            found = bool(_run(setup, app, probe, seed, [], False, counter))
            say(f"  {rate_qps:.2f} qps: {'feasible' if found else 'infeasible'}")
            return found

        low = bisect_rate(feasible, 0.0, rate, tolerance_qps=RATE_REL_TOL * rate)
        max_feasible, planned_rate = low, low
        steps.append(
            f"no plan within the budget ${plain(app.constraints.budget_usd_per_hr)}/hr"
            f" meets the SLO at"
            f" {rate:.2f} qps; the highest rate one does (bisection, arrival times scaled) is"
            f" {low:.2f} qps, and the stages below are planned for it"
        )
        plans = []
        if low > 0:
            plans = _run(setup, app, scale_trace(sample, low), seed, steps, True, counter) or []
    predicted_ms: float | None = None
    windows_s: tuple[float, ...] = ()
    rates_qps: tuple[float, ...] = ()
    if plans:  # none when not even the lowest rate can be served (the planned rate is then 0)
        planned = sample if max_feasible is None else scale_trace(sample, planned_rate)
        predicted_ms = _pipeline_tail_ms(setup, app, plans, planned, seed, steps, counter, say)
        windows_s, rates_qps = _planned_envelope(app, plans, planned)
    say(f"done after {counter[0]} simulations")
    gear_plan = _gear_plan(app, plans, seed, steps, say)
    return PlanDocument(
        feasible=max_feasible is None,
        cost_usd_per_hr=money(sum(p.cost_usd_per_hr for p in plans)),
        stages=tuple(plans),
        steps=tuple(steps),
        rate_qps=planned_rate,
        predicted_p99_ms=predicted_ms,
        max_feasible_qps=max_feasible,
        simulations=counter[0],
        gear_plan=gear_plan,
        envelope_windows_s=windows_s,
        envelope_rate_qps=rates_qps,
    )


def _pipeline_tail_ms(
    setup: _Setup,
    app: ResolvedApp,
    plans: list[StagePlan],
    trace: Trace,
    seed: int,
    steps: list[str],
    counter: list[int],
    say: Callable[[str], None],
) -> float:
    """The P-th percentile of the end-to-end response time of the whole planned pipeline (one
    stage or more) on ``trace``, the one the stages were planned for (see the module docstring,
    End-to-end prediction)."""
    limits = app.constraints
    if len(plans) == 1 and not app.serving_overhead_quantiles_ms and not app.serving_cpu_ms:
        # One stage is the whole pipeline, and its own simulation (same trace, same seed) is the
        # pipeline's: nothing to simulate again. A constant overhead added to every query
        # shifts every percentile by itself (a measured distribution needs the responses).
        tail_ms = plans[0].predicted_p99_ms + app.serving_overhead_ms
        how = "the stage's own simulation (one stage is the whole pipeline)"
    else:
        say(f"simulating the whole pipeline ({len(plans)} stages) end to end")
        stages = pipeline_stages(
            app,
            [
                (
                    plan.name,
                    [InstanceSpec(t) for t, n in sorted(plan.fleet.items()) for _ in range(n)],
                    plan.batch_size,
                    plan.policy,
                )
                for plan in plans
            ],
            trace,
            setup.answered,
        )
        result = simulate(
            trace,
            stages,
            np.random.default_rng(seed),
            prices_usd_per_hr=app.prices_usd_per_hr,
            qos_ms=limits.slo_ms,
        )
        counter[0] += 1
        tail_ms = end_to_end_tail_ms(
            result.response_ms, app, limits.percentile, seed, result.arrival_s
        )
        reach_text = (
            "every query reaching every stage"
            if all(r is None for r in setup.reach)
            else "the queries forwarded as the validation records say"
        )
        how = (
            f"one simulation of the {len(plans)} stage(s) together ({reach_text}), each with"
            f" its planned fleet, batch size and dispatch"
        )
    if app.serving_overhead_quantiles_ms:
        p99_ms = app.serving_overhead_quantiles_ms[OVERHEAD_QUANTILES.index(99.0)]
        how += (
            f", plus the control plane's own time per query drawn for each query from its"
            f" measured distribution ({app.serving_overhead_ms:.2f} ms median, {p99_ms:.2f} ms"
            " p99)"
        )
    elif app.serving_overhead_ms > 0:
        how += f", plus the control plane's own {app.serving_overhead_ms:.2f} ms per query"
    if app.serving_cpu_ms > 0:
        how += (
            f", plus each query's wait at the serving process (a queue serving every query in"
            f" its measured {app.serving_cpu_ms:.3f} ms of CPU: at most"
            f" {1000.0 / app.serving_cpu_ms:.0f} qps)"
        )
    verdict = "within" if tail_ms <= limits.slo_ms else "ABOVE"
    steps.append(
        f"end to end: predicted P{limits.percentile:.15g} {tail_ms:.1f} ms on the planned"
        f" {_rate_qps(trace):.2f} qps, {verdict} the SLO {limits.slo_ms:g} ms; from {how}"
    )
    return tail_ms


def _planned_envelope(
    app: ResolvedApp, plans: list[StagePlan], trace: Trace
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The arrival envelope of ``trace`` on the tuner's windows up to the trace's span (see the
    module docstring): (windows s, rates qps), both empty when no window is left."""
    service_times_s = []
    for stage in plans:
        for t, count in stage.fleet.items():
            if count <= 0:
                continue
            profile = app.profile(stage.name, t)
            smallest = np.array([profile.min_batch_size], dtype=np.int64)
            rate = rate_per_instance_qps(profile, smallest, stage.batch_size)
            service_times_s.append(1.0 / rate if rate > 0 else math.inf)
    if not service_times_s:
        return (), ()
    shortest_s = max(*service_times_s, MIN_ENVELOPE_WINDOW_S)
    if not (math.isfinite(shortest_s) and shortest_s <= DEFAULT_MAX_WINDOW_S):
        return (), ()
    ladder = tuner_windows_s(shortest_s, DEFAULT_MAX_WINDOW_S)
    # A window longer than the trace sees all of it, a rate (count / window) that falls with the
    # window although the trace never slowed: live traffic at the planned rate would exceed it.
    windows = ladder[ladder <= trace.duration_s]
    if not windows.size:
        return (), ()
    envelope = arrival_envelope(trace.arrival_s, windows)
    return (
        tuple(float(w) for w in envelope.window_s),
        tuple(float(r) for r in envelope.rate_qps),
    )


def _gear_plan(
    app: ResolvedApp,
    plans: list[StagePlan],
    seed: int,
    steps: list[str],
    say: Callable[[str], None],
) -> dict[str, Any] | None:
    """CascadeServe's gear plan on the stages' placement, for a cascade with validation records
    (None otherwise, or when no gear fits the placement: the steps then say why)."""
    cascade, records = app.cascade, app.validation
    if cascade is None or records is None or len(cascade.models) < 2 or not plans:
        return None
    fleets = {p.name: Fleet.of(p.fleet) for p in plans if sum(p.fleet.values()) > 0}
    order = tuple(m for m in cascade.models if m in fleets)
    if len(order) < 2:
        return None
    limits = app.constraints
    say(f"planning the gears of the cascade on {len(order)} placed models")
    try:
        placement = CascadePlacement(fleets, order)
        # The held-out protocol (docs/cascades.md): gears chosen on one half of the records,
        # their accuracy (and the SLO's floor) judged on the other.
        choose, score = records.split()
        gears = plan_gears(
            choose,
            placement,
            {m: {t: app.profile(m, t) for t in placement.fleets[m]} for m in order},
            app.prices_usd_per_hr,
            slo_ms=limits.slo_ms,
            percentile=limits.percentile,
            accuracy_floor=limits.accuracy,
            seed=seed,
            held_out=score,
        )
    except (CascadeError, BatchSizeOutOfRangeError) as error:
        # A profile that does not reach batch size 1 (the Kairos data starts at 10): the gears'
        # simulation cannot run on it, the plan stands without a gear plan.
        steps.append(f"no gear plan for the cascade on this placement: {error}")
        return None
    ranges = ", ".join(
        f"[{g.low_qps:.1f}, {g.high_qps:.1f}) qps: {gears.options[g.option].cascade.label}"
        for g in gears.gears
    )
    steps.append(
        f"gear plan on the placement ({len(gears.options)} finalist cascades of"
        f" {gears.candidates}, {gears.simulations} simulations): {ranges}"
    )
    return gears.to_document()
