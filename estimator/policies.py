"""Build a dispatch policy by name for a fleet: the one place that wires profiles into policies.

``matching`` holds the policies and their registry (:mod:`matching.registry`) and knows nothing
of profiles; this module gives a policy what it predicts with (the profiles, which the policy's
factory reads: mean latency by batch size, for Kairos also the ratio of the p99 to the mean) and
the base types of the fleet. For robustness studies (Kairos Fig. 16b) it can also perturb
Kairos' latency predictions: each policy it makes draws the noise from its own
``numpy.random.default_rng(noise_seed)``, so every run sees the same noise stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from estimator.errors import SimulationError
from estimator.profiles import LatencyProfile
from matching import registry
from matching.policy import DispatchPolicy, PolicySetting, RegisteredPolicy


def policy_class(name: str) -> type[RegisteredPolicy]:
    """The registered class of the dispatch policy ``name``: what callers read its needs from.

    Raises:
        SimulationError: no policy has that name.
    """
    try:
        return registry.policy_class(name)
    except registry.UnknownPolicyError as error:
        raise SimulationError(str(error)) from error


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
    """A factory of fresh ``name`` policies (:func:`matching.registry.make`; policies keep state
    during a run, so each run needs one).

    ``base_types``: the full-range types, preferred first (Kairos takes the first as its base).
    ``drs_threshold``: the threshold of a policy that needs one (DRS). ``noise_share`` (a policy
    that takes noise: Kairos): each latency prediction of the dispatcher is multiplied by
    (1 + noise_share x N(0, 1)) (:class:`matching.kairos.KairosPolicy`), drawn from a fresh
    ``numpy.random.default_rng(noise_seed)`` per policy; the simulated service times are not
    touched. 0 turns it off.

    Raises:
        SimulationError: an unknown name, or a setting without what the policy needs.
    """
    setting = PolicySetting(
        profiles, tuple(base_types), drs_threshold, noise_share=noise_share, noise_seed=noise_seed
    )
    try:
        return registry.make(name, setting)
    except (registry.UnknownPolicyError, registry.PolicySettingError) as error:
        raise SimulationError(str(error)) from error
