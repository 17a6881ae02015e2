"""Build a dispatch policy by name for a fleet: the one place that wires profiles into policies.

``matching`` holds the policies and knows nothing of profiles; this module gives them what they
predict with (mean latency by batch size, from the profiles; for Kairos also the ratio of the p99
to the mean) and the base types of the fleet. For robustness studies (Kairos Fig. 16b) it can also
perturb Kairos' latency predictions: each policy it makes draws the noise from its own
``numpy.random.default_rng(noise_seed)``, so every run sees the same noise stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from estimator.errors import SimulationError
from estimator.profiles import LatencyProfile
from matching.clockwork import ClockworkPolicy
from matching.drs import DrsPolicy
from matching.fcfs import FcfsPolicy
from matching.kairos import TAIL_QUANTILE, KairosPolicy
from matching.latency_model import LatencyModel
from matching.policy import DispatchPolicy

POLICY_NAMES = ("fcfs", "drs", "clockwork", "kairos")


def full_range_types(
    profiles: Mapping[str, LatencyProfile],
    batch_sizes: np.ndarray,
    qos_ms: float,
    prices_usd_per_hr: Mapping[str, float] | None = None,
) -> list[str]:
    """Types whose mean latency meets QoS at every batch size of the workload (base candidates).

    With prices, the most cost-effective first (throughput on the workload per dollar, the
    Kairos base-type rule); otherwise by name.
    """
    largest = int(np.max(batch_sizes))
    names = [
        name
        for name, profile in profiles.items()
        if profile.max_batch_size >= largest and profile.mean_latency_ms(largest) <= qos_ms
    ]
    if prices_usd_per_hr is None:
        return sorted(names)
    sample = np.asarray(batch_sizes)[:2000]

    def qps_per_usd(name: str) -> float:
        return profiles[name].rate_qps(sample) / max(prices_usd_per_hr[name], 1e-12)

    return sorted(names, key=lambda name: (-qps_per_usd(name), name))


def policy_factory(
    name: str,
    profiles: Mapping[str, LatencyProfile],
    base_types: Sequence[str],
    drs_threshold: int | None = None,
    *,
    noise_share: float = 0.0,
    noise_seed: int = 0,
) -> Callable[[], DispatchPolicy]:
    """A factory of fresh policies (policies keep state during a run, so each run needs one).

    ``base_types``: the full-range types, preferred first (Kairos takes the first as its base).
    ``noise_share`` (kairos only): each latency prediction of the dispatcher is multiplied by
    (1 + noise_share x N(0, 1)) (:class:`matching.kairos.KairosPolicy`), drawn from a fresh
    ``numpy.random.default_rng(noise_seed)`` per policy; the simulated service times are not
    touched. 0 turns it off.
    """
    if noise_share and name != "kairos":
        raise SimulationError(f"prediction noise applies to the kairos policy only, not {name!r}")
    if name == "fcfs":
        order = tuple(base_types)
        return lambda: FcfsPolicy(type_order=order)
    if name == "drs":
        if drs_threshold is None:
            raise SimulationError("the drs policy needs a batch-size threshold")
        threshold = drs_threshold
        return lambda: DrsPolicy(threshold, base_types)
    if name == "clockwork":
        tables = {t: p.mean_by_batch_ms() for t, p in profiles.items()}
        return lambda: ClockworkPolicy(tables)
    if name == "kairos":
        if not base_types:
            raise SimulationError("the kairos policy needs a base type")
        model = LatencyModel.from_means(profiles)
        # The QoS checks use the profiled p99 (tail-aware feasibility, docs/matching.md): per
        # type and batch size, its ratio to the mean, applied to the policy's online mean.
        tail_ratio = {}
        for t, p in profiles.items():
            tail_ms, mean_ms = p.quantile_by_batch_ms(TAIL_QUANTILE), p.mean_by_batch_ms()
            known = mean_ms > 0  # NaN (below the smallest measured size) compares False
            tail_ratio[t] = np.divide(
                tail_ms, mean_ms, out=np.full_like(mean_ms, np.nan), where=known
            )
        base = base_types[0]
        return lambda: KairosPolicy(
            base,
            model,
            tail_ratio=tail_ratio,
            noise_share=noise_share,
            rng=np.random.default_rng(noise_seed) if noise_share else None,
        )
    raise SimulationError(f"unknown policy {name!r} (one of {', '.join(POLICY_NAMES)})")
