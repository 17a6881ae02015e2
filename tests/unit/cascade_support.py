"""A small seeded cascade family for the cascade, gear, allocation and variant tests."""

from __future__ import annotations

import numpy as np

from estimator.cascades import ValidationRecords, synthetic_validation
from estimator.profiles import LatencyProfile

MODELS = ("tiny", "small", "large")
ACCURACY = (0.9, 0.95, 0.98)
# (base ms, ms per item) on the one instance type "c5.xlarge".
LATENCY_MS = {"tiny": (1.0, 0.25), "small": (3.0, 1.0), "large": (8.0, 6.0)}
TYPE = "c5.xlarge"
PRICES = {TYPE: 0.17}


def records(seed: int = 0, n_samples: int = 400) -> ValidationRecords:
    return synthetic_validation(
        np.random.default_rng(seed), ACCURACY, names=MODELS, n_samples=n_samples
    )


def profiles(seed: int = 0, jitter: float = 0.05) -> dict[str, dict[str, LatencyProfile]]:
    """Linear profiles L(b) = base + per-item x b, batch sizes 1..16, with log-normal jitter."""
    rng = np.random.default_rng(seed)
    sizes = np.array([1, 2, 4, 8, 16])
    return {
        m: {
            TYPE: LatencyProfile(
                m,
                TYPE,
                sizes,
                tuple((base + per * b) * rng.lognormal(0.0, jitter, size=8) for b in sizes),
            )
        }
        for m, (base, per) in LATENCY_MS.items()
    }
