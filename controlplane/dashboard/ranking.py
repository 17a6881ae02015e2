"""Why the plan chose its mix: the Kairos bound ranking of the app's instance mixes, for the
dashboard's plan panel.

The planner (:mod:`controlplane.policies.planner`, Algorithm 1's start) ranks every affordable
instance mix by its Kairos throughput upper bound (``estimator.bounds.rank_configurations``, Kairos
section 5.2) and starts from the cheapest mix whose bound, times the headroom, covers the
planning trace's peak; Algorithms 1 and 2 then add and cut instances with the simulator. The plan
document keeps the steps in words; this module recomputes the ranking itself, per stage, on the
same inputs (the app's profiles and prices, the stage's share of the SLO, the budget, the caps,
and the planning trace's batch mix, read back from the plan's trace description), and places the
chosen fleet against it: the top mixes by bound (the head of the ranking), the cheapest mixes
whose bound x headroom covers the peak (the planner's start is the first of them), and the
chosen fleet with its own bound and cost.

Ranking takes up to a second for a large catalog, so :class:`RankingCache` keeps the answer per
(app, plan, budget): a dashboard polling every 2 s computes it once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from controlplane.policies.plan import PlanDocument
from controlplane.policies.planner import HEADROOM
from controlplane.spec import ResolvedApp
from estimator import deadline
from estimator.batches import FixedBatch, KairosMix, kairos_batch_pmf, parse_batch_distribution
from estimator.bounds import Ranking, kairos_quantities, rank_configurations, upper_bounds
from estimator.errors import EstimatorError, SearchSpaceError

__all__ = ["TOP_MIXES", "RankingCache", "batch_pmf", "bound_ranking"]

# Mixes shown per stage: enough to see what the chosen one competed with.
TOP_MIXES = 5
# Batch sizes drawn to estimate the mix of a sampled distribution (lognormal, gaussian).
_PMF_DRAWS = 20_000
_CACHED = 32
_SOURCE_BATCHES = re.compile(r"batch sizes (?P<spec>.+), seed (?P<seed>\d+)$")
_STEP_PEAK = re.compile(r"(?:covers|above) the peak ([0-9.]+) qps")
# As the planner ranks: every affordable mix up to this many, else the top few thousand.
_MAX_RANKED = 200_000
_RANKING_DEADLINE_S = 10.0
_TOP_FALLBACK = 5_000

Pmf = tuple[np.ndarray, np.ndarray]


def batch_pmf(document: PlanDocument, fallback_batch_size: int) -> tuple[Pmf, str]:
    """The planning trace's batch mix (sizes, probabilities) and how it was found: from the
    plan's trace description (``.. batch sizes SPEC, seed N``, as ``POST .../plans`` writes it),
    else one fixed size, ``fallback_batch_size``."""
    trace = document.trace
    source = trace.get("source") if trace is not None else None
    found = _SOURCE_BATCHES.search(source) if isinstance(source, str) else None
    if found is not None:
        try:
            dist = parse_batch_distribution(found.group("spec"))
        except EstimatorError:
            dist = None
        if isinstance(dist, KairosMix):
            return kairos_batch_pmf(), "the Kairos batch mix"
        if isinstance(dist, FixedBatch):
            return (np.array([dist.size]), np.array([1.0])), f"batch size {dist.size}"
        if dist is not None:
            rng = np.random.default_rng(int(found.group("seed")))
            sizes, counts = np.unique(dist.sample(_PMF_DRAWS, rng), return_counts=True)
            return (sizes, counts / counts.sum()), f"batch sizes {dist.spec}"
    return (
        (np.array([fallback_batch_size]), np.array([1.0])),
        f"batch size {fallback_batch_size} (the planning trace's mix is not recorded)",
    )


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if np.isfinite(number) else None


def _peak_qps(document: PlanDocument) -> float | None:
    """The planning trace's peak rate, as the planner's first step states it."""
    for step in document.steps:
        found = _STEP_PEAK.search(step)
        if found is not None:
            return float(found.group(1))
    return None


def _mix(ranking: Ranking, index: int, chosen: Mapping[str, int]) -> dict[str, Any]:
    fleet = {t: n for t, n in ranking.fleet(index).items() if n}
    return {
        "fleet": fleet,
        "upper_bound_qps": float(ranking.upper_bound_qps[index]),
        "cost_usd_per_hr": float(ranking.cost_usd_per_hr[index]),
        "chosen": fleet == dict(chosen),
    }


def bound_ranking(
    app: ResolvedApp,
    document: PlanDocument,
    budget_usd_per_hr: float,
    fallback_batch_size: int,
    top: int = TOP_MIXES,
) -> dict[str, Any]:
    """Per stage of the plan ``document``: the ``top`` mixes by Kairos bound within the budget
    and the chosen fleet's own bound and cost (or why there is no ranking)."""
    pmf, mix = batch_pmf(document, fallback_batch_size)
    peak_qps = _peak_qps(document)
    sizes = pmf[0]
    spec = app.spec
    order = spec.serving_order
    slo_ms = spec.slo.latency_ms / max(1, len(order))
    stages: list[dict[str, Any]] = []
    for stage in document.stages:
        model = stage.name
        chosen = {t: n for t, n in stage.fleet.items() if n > 0}
        out: dict[str, Any] = {"stage": model, "chosen": {"fleet": chosen}}
        stages.append(out)
        if model not in app.profiles:
            out["note"] = f"no profiles of {model!r} in the app's spec"
            continue
        names = [
            t
            for t in app.instance_types
            if spec.max_count(t) != 0
            and app.profile(model, t).min_batch_size <= int(sizes.min())
            and app.profile(model, t).max_batch_size >= int(sizes.max())
        ]
        prices = {t: app.prices_usd_per_hr[t] for t in names}
        try:
            q = kairos_quantities(app.profiles[model], model, names, prices, slo_ms, pmf)
            caps = {t: n for t in q.type_names if (n := spec.max_count(t)) is not None}
            # A huge budget affords more mixes than a page can wait for: the search stops at
            # the deadline and the stage says why.
            with deadline.limit(_RANKING_DEADLINE_S):
                try:
                    ranking = rank_configurations(
                        q, budget_usd_per_hr, caps, None, max_ranked=_MAX_RANKED
                    )
                except SearchSpaceError:
                    ranking = rank_configurations(q, budget_usd_per_hr, caps, _TOP_FALLBACK)
        except (EstimatorError, ValueError) as error:
            out["note"] = f"no Kairos ranking: {error}"
            continue
        counts = np.array([[chosen.get(t, 0) for t in q.type_names]])
        out["chosen"] = {
            "fleet": chosen,
            "upper_bound_qps": float(upper_bounds(q, counts)[0]),
            "cost_usd_per_hr": sum(prices.get(t, 0.0) * n for t, n in chosen.items()),
            "left_out": sorted(set(chosen) - set(q.type_names)),
        }
        out["base_type"] = ranking.base_type
        out["ranked"] = ranking.enumerated
        out["note"] = ranking.note
        out["top"] = [_mix(ranking, i, chosen) for i in range(min(top, len(ranking)))]
        peak = peak_qps if peak_qps is not None else _finite(document.planned_rate_qps)
        out["peak_qps"] = peak
        if peak is not None:
            covering = np.flatnonzero(HEADROOM * ranking.upper_bound_qps >= peak)
            cheapest = covering[np.argsort(ranking.cost_usd_per_hr[covering], kind="stable")]
            out["covering"] = [_mix(ranking, int(i), chosen) for i in cheapest[:top]]
    return {
        "batch_mix": mix,
        "slo_ms_per_stage": slo_ms,
        "budget_usd_per_hr": budget_usd_per_hr,
        "headroom": HEADROOM,
        "stages": stages,
    }


class RankingCache:
    """:func:`bound_ranking` answers by (app id, plan id, budget), the newest few kept."""

    def __init__(self, capacity: int = _CACHED) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._answers: OrderedDict[tuple[int, int, float], dict[str, Any]] = OrderedDict()

    def get(self, key: tuple[int, int, float]) -> dict[str, Any] | None:
        with self._lock:
            found = self._answers.get(key)
            if found is not None:
                self._answers.move_to_end(key)
            return found

    def put(self, key: tuple[int, int, float], answer: dict[str, Any]) -> None:
        with self._lock:
            self._answers[key] = answer
            while len(self._answers) > self._capacity:
                self._answers.popitem(last=False)
