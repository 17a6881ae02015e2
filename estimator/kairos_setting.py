"""The Kairos paper's evaluation setting, and the selection it runs for one model.

Kairos section 7 and KAIROS_MATH.md: a budget of $2.5/hr; candidate types g4dn.xlarge,
c5n.2xlarge, r5n.large and t3.xlarge capped at 5, 6, 17 and 15 instances; QoS (P99 target) rm2
350 ms, wnd 25 ms, mtwnd 25 ms, dien 35 ms, ncf 5 ms; the Kairos production batch mix. Tests and
benchmarks reproduce the paper's results on the shared measurements through this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from estimator.batches import kairos_batch_pmf
from estimator.bounds import (
    KairosQuantities,
    Ranking,
    best_homogeneous,
    kairos_quantities,
    rank_configurations,
    similarity_pick,
)
from estimator.profiles import ProfileSet


@dataclass(frozen=True, slots=True)
class KairosSetting:
    budget_usd_per_hr: float = 2.5
    max_counts: Mapping[str, int] = field(
        default_factory=lambda: {
            "g4dn.xlarge": 5,
            "c5n.2xlarge": 6,
            "r5n.large": 17,
            "t3.xlarge": 15,
        }
    )
    qos_ms: Mapping[str, float] = field(
        default_factory=lambda: {
            "rm2": 350.0,
            "wnd": 25.0,
            "mtwnd": 25.0,
            "dien": 35.0,
            "ncf": 5.0,
        }
    )

    @property
    def instance_types(self) -> list[str]:
        return list(self.max_counts)


@dataclass(frozen=True, slots=True, eq=False)
class Selection:
    """What Kairos picks for one model without trying anything: the ranking, the similarity
    pick, and the best homogeneous configuration for comparison."""

    model: str
    qos_ms: float
    quantities: KairosQuantities
    ranking: Ranking
    chosen: int  # index into the ranking
    homogeneous_counts: np.ndarray
    homogeneous_bound_qps: float

    def fleet_types(self, counts: np.ndarray) -> list[str]:
        """One instance type per instance of ``counts`` (in the ranking's column order)."""
        return [t for t, n in zip(self.ranking.types, counts, strict=True) for _ in range(int(n))]


def select(
    profiles: ProfileSet,
    model: str,
    prices_usd_per_hr: Mapping[str, float],
    setting: KairosSetting | None = None,
    pmf: tuple[np.ndarray, np.ndarray] | None = None,
) -> Selection:
    """Rank every affordable configuration by bound and pick one (KAIROS_MATH.md), on the batch
    sizes' pmf ``(sizes, probabilities)`` (default: the Kairos mix)."""
    setting = setting or KairosSetting()
    qos_ms = setting.qos_ms[model]
    quantities = kairos_quantities(
        profiles,
        model,
        setting.instance_types,
        {t: prices_usd_per_hr[t] for t in setting.instance_types},
        qos_ms,
        kairos_batch_pmf() if pmf is None else pmf,
    )
    ranking = rank_configurations(quantities, setting.budget_usd_per_hr, setting.max_counts)
    homogeneous, bound = best_homogeneous(quantities, setting.budget_usd_per_hr, setting.max_counts)
    return Selection(
        model,
        qos_ms,
        quantities,
        ranking,
        similarity_pick(ranking),
        homogeneous,
        bound,
    )
