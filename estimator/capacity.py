"""Allowable throughput: the highest arrival rate at which a fleet still meets its QoS target.

Kairos' metric (KAIROS_MATH.md, "The evaluation workload"): the highest Poisson arrival rate at
which at least 99% of queries finish within QoS. It is found by bracketing and bisection over the
rate, each probe one simulation. The bisection is the one search for "the highest rate that
meets the SLO" (:func:`highest_rate`, :func:`bisect_rate`, :func:`bracket_rate`): the planner's
highest feasible rate, the gear planner's max sustainable QPS and the INFaaS study's saturation
rate use it too, each with its own test of a rate. Probes share their randomness (common random
numbers): one unit-rate Poisson sequence scaled by 1/rate, one set of batch sizes, one seed for
service times, so attainment falls with the rate the way the fleet does, not the way the noise
does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from estimator.errors import SimulationError
from estimator.oracle import oracle_throughput_qps
from estimator.policies import full_range_types, policy_class, policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace
from matching import registry

TARGET_ATTAINMENT = 0.99
# The most queries one probe may simulate (50 times the command line's default): more is a typo
# that would allocate gigabytes per probe and simulate for hours.
MAX_PROBE_QUERIES = 1_000_000


@dataclass(frozen=True, slots=True)
class CapacityResult:
    allowable_qps: float  # the highest probed rate that met the target
    evaluations: int  # simulations run
    probes: tuple[tuple[float, float], ...]  # (rate_qps, attainment) in the order probed


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """A rate-free workload: arrival times at 1 query/s and a batch size per query."""

    unit_arrival_s: np.ndarray
    batch_size: np.ndarray
    seed: int

    @classmethod
    def poisson(cls, batch_size: np.ndarray, rng: np.random.Generator) -> Workload:
        gaps = rng.exponential(1.0, size=batch_size.size)
        return cls(
            np.cumsum(gaps), np.asarray(batch_size, dtype=np.int64), int(rng.integers(2**31))
        )

    def at(self, rate_qps: float) -> Trace:
        return Trace(self.unit_arrival_s / rate_qps, self.batch_size)


def attainment(
    stage_factory: Callable[[], Stage],
    workload: Workload,
    rate_qps: float,
    prices_usd_per_hr: Mapping[str, float],
    qos_ms: float,
) -> float:
    """Share of the workload's queries within ``qos_ms`` at ``rate_qps`` (a fresh policy each)."""
    result = simulate(
        workload.at(rate_qps),
        [stage_factory()],
        np.random.default_rng(workload.seed),
        prices_usd_per_hr=prices_usd_per_hr,
        qos_ms=qos_ms,
    )
    return float(np.count_nonzero(result.response_ms <= qos_ms) / workload.batch_size.size)


def bisect_rate(
    meets: Callable[[float], bool],
    low_qps: float,
    high_qps: float,
    *,
    steps: int | None = None,
    tolerance_qps: float | None = None,
    rel_tol: float | None = None,
) -> float:
    """The highest rate found to meet by bisecting [``low_qps``, ``high_qps``], where ``low_qps``
    meets (or is 0) and ``high_qps`` does not: halve the interval at its middle, keeping the
    half whose ends still differ in ``meets``, for ``steps`` halvings, or until it is at most
    ``tolerance_qps`` wide, or at most ``rel_tol`` times its upper end (exactly one of the
    three). Returns the low end. ``meets`` must fall with the rate (a fleet's SLO attainment,
    common random numbers) for the answer to be the boundary.

    >>> round(bisect_rate(lambda r: r <= 3.3, 0.0, 8.0, steps=10), 3)
    3.297
    >>> bisect_rate(lambda r: r <= 3.3, 0.0, 8.0, tolerance_qps=1.0)
    3.0
    """
    if sum(x is not None for x in (steps, tolerance_qps, rel_tol)) != 1:
        raise ValueError("give exactly one of steps, tolerance_qps and rel_tol")
    low, high = low_qps, high_qps
    done = 0
    while True:
        if steps is not None and done >= steps:
            return low
        if tolerance_qps is not None and high - low <= tolerance_qps:
            return low
        if rel_tol is not None and high - low <= rel_tol * high:
            return low
        middle = 0.5 * (low + high)
        if meets(middle):
            low = middle
        else:
            high = middle
        done += 1


def highest_rate(
    meets: Callable[[float], bool], low_qps: float, high_qps: float, *, steps: int
) -> float:
    """The highest rate in [``low_qps``, ``high_qps``] that meets: 0 when ``low_qps`` does not,
    ``high_qps`` when it does, else :func:`bisect_rate` for ``steps`` halvings in between.

    >>> highest_rate(lambda r: r <= 3.3, 0.5, 8.0, steps=3), highest_rate(bool, 0.5, 8.0, steps=3)
    (2.375, 8.0)
    """
    if not meets(low_qps):
        return 0.0
    if meets(high_qps):
        return high_qps
    return bisect_rate(meets, low_qps, high_qps, steps=steps)


def bracket_rate(
    meets: Callable[[float], bool], guess_qps: float, floor_share: float = 1e-6
) -> tuple[float, float] | None:
    """An interval (low, high) for :func:`bisect_rate`, from ``guess_qps``: double while the
    rate meets, else halve until one does (``None`` when none does above ``floor_share`` x the
    guess).

    >>> bracket_rate(lambda r: r <= 3.3, 1.0), bracket_rate(lambda r: r <= 3.3, 10.0)
    ((2.0, 4.0), (2.5, 5.0))
    """
    low, high = 0.0, guess_qps
    while meets(high):
        low, high = high, high * 2.0
    while low == 0.0:
        high = high / 2.0
        if high < guess_qps * floor_share:
            return None
        if meets(high):
            low, high = high, high * 2.0
    return low, high


def search_allowable_rate(
    evaluate: Callable[[float], float],
    guess_qps: float,
    target: float = TARGET_ATTAINMENT,
    rel_tol: float = 0.01,
    max_evaluations: int = 40,
) -> CapacityResult:
    """Largest rate with ``evaluate(rate) >= target``, to a relative tolerance ``rel_tol``.

    Brackets from ``guess_qps`` by doubling or halving, then bisects.
    """
    if not guess_qps > 0:
        raise SimulationError(f"the starting rate must be > 0, got {guess_qps}")
    probes: list[tuple[float, float]] = []

    def meets(rate: float) -> bool:
        if len(probes) >= max_evaluations:
            if all(value >= target for _, value in probes):
                # Doubling from the guess never found a rate that misses: the fleet keeps up
                # with every rate the workload's queries can be compressed to at this QoS.
                raise SimulationError(
                    f"every rate tried met the target, up to {probes[-1][0]:.4g} qps: the"
                    " capacity is unbounded at this QoS for this workload (a QoS longer than"
                    " the whole trace, or too few queries to queue); tighten the QoS or give"
                    " more queries"
                )
            raise SimulationError(f"no answer within {max_evaluations} simulations")
        value = evaluate(rate)
        probes.append((rate, value))
        return value >= target

    bracket = bracket_rate(meets, guess_qps)
    if bracket is None:
        return CapacityResult(0.0, len(probes), tuple(probes))
    low = bisect_rate(meets, *bracket, rel_tol=rel_tol)
    return CapacityResult(low, len(probes), tuple(probes))


def allowable_throughput(
    stage_factory: Callable[[], Stage],
    workload: Workload,
    prices_usd_per_hr: Mapping[str, float],
    qos_ms: float,
    guess_qps: float,
    rel_tol: float = 0.01,
) -> CapacityResult:
    """The allowable throughput of the stage's fleet and policy on ``workload`` (see module)."""
    return search_allowable_rate(
        lambda rate: attainment(stage_factory, workload, rate, prices_usd_per_hr, qos_ms),
        guess_qps,
        rel_tol=rel_tol,
    )


@dataclass(frozen=True, slots=True)
class ThresholdTuning:
    threshold: int
    allowable_qps: float
    evaluations: int  # capacity searches run


def tune_threshold(
    capacity_at: Callable[[int], float], start: int, step: int, low: int, high: int
) -> ThresholdTuning:
    """Coarse-to-fine hill climbing over an integer threshold (DeepRecSys' sweep, Kairos
    section 7 "DRS").

    Score ``start`` and a grid of 9 thresholds across ``low``..``high`` and climb from the best:
    move by the current stride in whichever direction raises ``capacity_at`` while it rises,
    then halve the stride, down to ``step``. The grid crosses the plateaus a fine climb stalls
    on (throughput changes only at batch sizes the workload has).
    """
    cache: dict[int, float] = {}

    def score(threshold: int) -> float:
        if threshold not in cache:
            cache[threshold] = capacity_at(threshold)
        return cache[threshold]

    grid = {min(max(low + round(k * (high - low) / 8 / step) * step, low), high) for k in range(9)}
    best = max(sorted(grid | {min(max(start, low), high)}), key=score)
    stride = step
    while stride * 2 <= (high - low) // 16:
        stride *= 2
    while stride >= step:
        for direction in (stride, -stride):
            while low <= best + direction <= high and score(best + direction) > score(best):
                best += direction
        stride //= 2
    return ThresholdTuning(best, score(best), len(cache))


@dataclass(frozen=True, slots=True)
class FleetCapacity:
    """The allowable throughput of a fleet under one policy, and how it was found."""

    allowable_qps: float
    policy: str
    evaluations: int  # simulations in the final search (0 for the oracle)
    drs_threshold: int | None = None
    threshold_evaluations: int = 0


def fleet_capacity(
    profiles: Mapping[str, LatencyProfile],
    instance_types: Sequence[str],
    policy: str,
    qos_ms: float,
    workload: Workload,
    prices_usd_per_hr: Mapping[str, float],
    *,
    drs_threshold: int | None = None,
    model: str = "model",
    progress: Callable[[str], None] | None = None,
    noise_share: float = 0.0,
    noise_seed: int = 0,
) -> FleetCapacity:
    """Allowable throughput of the fleet ``instance_types`` under ``policy`` (or the oracle).

    The DRS threshold, unless given, is tuned by :func:`tune_threshold` as DeepRecSys does.
    ``noise_share``, ``noise_seed`` (a policy that takes noise: kairos): noise on the
    dispatcher's latency predictions, the same stream in every probe (see
    :func:`estimator.policies.policy_factory`).
    """
    takes_noise = policy != "oracle" and policy_class(policy).takes_noise
    if noise_share and not takes_noise:
        raise SimulationError(str(registry.noise_refused(policy)))
    used = {name: profiles[name] for name in set(instance_types)}
    base_types = full_range_types(used, workload.batch_size, qos_ms, prices_usd_per_hr)
    if not base_types:
        raise SimulationError(
            f"no instance type of the fleet meets QoS {qos_ms:g} ms at every batch size up to"
            f" {int(workload.batch_size.max())}"
        )
    if policy == "oracle":
        tables = {t: p.mean_by_batch_ms() for t, p in used.items()}
        qps = oracle_throughput_qps(
            workload.batch_size, list(instance_types), tables, qos_ms, base_types
        )
        return FleetCapacity(qps, policy, 0)
    instances = tuple(InstanceSpec(name) for name in instance_types)
    guess = _guess_qps(used, instance_types, workload.batch_size)

    def search(threshold: int | None) -> CapacityResult:
        make = policy_factory(
            policy, used, base_types, threshold, noise_share=noise_share, noise_seed=noise_seed
        )
        result = allowable_throughput(
            lambda: Stage(model, instances, used, make()),
            workload,
            prices_usd_per_hr,
            qos_ms,
            guess,
        )
        if progress is not None:
            label = "" if threshold is None else f" (threshold {threshold})"
            progress(
                f"  {policy}{label}: {result.allowable_qps:.2f} qps"
                f" after {result.evaluations} simulations"
            )
        return result

    has_auxiliary = any(name not in base_types for name in instance_types)
    if policy_class(policy).needs_threshold and drs_threshold is None:
        sizes = workload.batch_size
        if not has_auxiliary:  # every query goes to a base instance whatever the threshold
            result = search(int(sizes.max()))
            return FleetCapacity(result.allowable_qps, policy, result.evaluations, None)
        tuning = tune_threshold(
            lambda t: search(t).allowable_qps,
            start=int(np.median(sizes)),
            step=10,
            low=int(sizes.min()),
            high=int(sizes.max()),
        )
        result = search(tuning.threshold)
        return FleetCapacity(
            result.allowable_qps, policy, result.evaluations, tuning.threshold, tuning.evaluations
        )
    result = search(drs_threshold)
    return FleetCapacity(result.allowable_qps, policy, result.evaluations, drs_threshold)


def _guess_qps(
    profiles: Mapping[str, LatencyProfile], instance_types: Sequence[str], sizes: np.ndarray
) -> float:
    """A first rate to probe: every instance serving the mix at its mean latency."""
    rates = {t: p.rate_qps(sizes[:2000]) for t, p in profiles.items()}
    return sum(rates[t] for t in instance_types)
