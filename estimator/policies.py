"""Build a dispatch policy by name for a fleet: the one place that wires profiles into policies.

``matching`` holds the policies and knows nothing of profiles; this module gives them what they
predict with (mean latency by batch size, from the profiles) and the base types of the fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from estimator.errors import SimulationError
from estimator.profiles import LatencyProfile
from matching.clockwork import ClockworkPolicy
from matching.drs import DrsPolicy
from matching.fcfs import FcfsPolicy
from matching.policy import DispatchPolicy

POLICY_NAMES = ("fcfs", "drs", "clockwork", "kairos")


def full_range_types(
    profiles: Mapping[str, LatencyProfile], batch_sizes: np.ndarray, qos_ms: float
) -> list[str]:
    """Types whose mean latency meets QoS at every batch size of the workload (base candidates)."""
    largest = int(np.max(batch_sizes))
    return sorted(
        name
        for name, profile in profiles.items()
        if profile.max_batch_size >= largest and profile.mean_latency_ms(largest) <= qos_ms
    )


def policy_factory(
    name: str,
    profiles: Mapping[str, LatencyProfile],
    base_types: Sequence[str],
    drs_threshold: int | None = None,
) -> Callable[[], DispatchPolicy]:
    """A factory of fresh policies (policies keep state during a run, so each run needs one)."""
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
    raise SimulationError(f"unknown policy {name!r} (one of {', '.join(POLICY_NAMES)})")
