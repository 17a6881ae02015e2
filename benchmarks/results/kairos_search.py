"""Kairos against each scheme on its own best fleet, and what each online search costs.

Kairos section 8, Figs. 9-11, at the paper's setting, for one model at a time
(:func:`search_model`):

- **Each scheme's best configuration** (Fig. 9: every competing scheme gets the best
  configuration an exhaustive offline search finds for it). FCFS base-first and the oracle are
  cheap to measure and are measured on every affordable configuration. Kairos, Clockwork-style and
  DRS (its threshold tuned per configuration) are searched over the maximal affordable
  configurations by :func:`estimator.exploration.branch_and_bound` in descending Kairos upper
  bound: no scheme's allowable throughput exceeds a configuration's bound (up to ``SLACK``, the
  bisection's 1% tolerance and finite-workload effects), so the search stops once the next bound
  is below the best found, with the exact best. Clockwork and DRS have an evaluation cap; a
  search stopped by it says so and reports the highest bound left (what an unevaluated
  configuration could at most reach). Kairos' search is Kairos+.
- **Evaluations to reach the best** (Figs. 10-11): Kairos+ (bound order, stop on the bound),
  random search (its expectation in closed form), a genetic algorithm and Bayesian optimisation,
  all over the same maximal configurations, all looking for the best configuration for the Kairos
  dispatcher; and for each scheme, the evaluations its own bound-ordered search took.
- **A brute-force check** (:func:`brute_force_check`): every maximal configuration of one model
  under Kairos at a small probe size, against branch and bound on the same numbers.

The searches measure at ``search_queries`` per probe; the winners are re-measured at the
section's probe size by the caller (:mod:`benchmarks.results.kairos`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from estimator.capacity import Workload, fleet_capacity
from estimator.exploration import (
    bayesian_search,
    branch_and_bound,
    genetic_search,
    maximal_configurations,
    random_search_expected_evaluations,
)
from estimator.kairos_setting import KairosSetting, Selection
from estimator.profiles import ProfileSet

# Allowable throughput may sit a little above the fluid bound: the bisection stops within 1% and
# a finite workload ends before its queue does (measured: up to +1% at 2,000 queries).
SLACK = 0.02
SEARCHED = ("kairos", "clockwork", "drs")  # branch and bound over the maximal configurations
SCANNED = ("fcfs", "oracle")  # measured on every affordable configuration


@dataclass(frozen=True, slots=True)
class SearchSizes:
    """How much a search may spend."""

    search_queries: int  # queries per probe of every capacity search in the search
    drs_tune_queries: int  # queries per probe of the DRS threshold tuning, per configuration
    caps: Mapping[str, int | None]  # evaluations per bound-ordered search (None: no cap)
    online_cap: int  # evaluations a genetic or Bayesian search may spend
    online_seeds: int  # runs of each of them
    scan_all: bool = True  # FCFS and the oracle on every affordable configuration (else maximal)


class Evaluator:
    """One model's capacity searches at the search's probe size, memoised per (policy, row)."""

    def __init__(
        self,
        profiles: ProfileSet,
        prices_usd_per_hr: Mapping[str, float],
        selection: Selection,
        workload: Workload,
        tune_workload: Workload,
        log: Callable[[str], None],
    ) -> None:
        self.selection = selection
        self.prices_usd_per_hr = dict(prices_usd_per_hr)
        self.by_type = {
            t: profiles.get_profile(selection.model, t) for t in selection.ranking.types
        }
        self.workload = workload
        self.tune_workload = tune_workload
        self.log = log
        self.cache: dict[tuple[str, int], float] = {}
        self.thresholds: dict[int, int | None] = {}
        self.seconds: dict[str, float] = {}

    def _capacity(self, row: int, policy: str, workload: Workload, **kw: Any) -> Any:
        return fleet_capacity(
            self.by_type,
            self.selection.fleet_types(self.selection.ranking.counts[row]),
            policy,
            self.selection.qos_ms,
            workload,
            self.prices_usd_per_hr,
            **kw,
        )

    def __call__(self, policy: str, row: int) -> float:
        key = (policy, row)
        if key not in self.cache:
            start = time.perf_counter()
            if policy == "drs":
                tuned = self._capacity(row, "drs", self.tune_workload)
                self.thresholds[row] = tuned.drs_threshold
                qps = self._capacity(
                    row, "drs", self.workload, drs_threshold=tuned.drs_threshold
                ).allowable_qps
            else:
                qps = self._capacity(row, policy, self.workload).allowable_qps
            self.cache[key] = float(qps)
            self.seconds[policy] = self.seconds.get(policy, 0.0) + time.perf_counter() - start
        return self.cache[key]

    def counted(self, policy: str) -> int:
        return sum(1 for p, _ in self.cache if p == policy)


def candidate_rows(
    selection: Selection, prices: Mapping[str, float], setting: KairosSetting
) -> np.ndarray:
    """Rows of the ranking that are maximal affordable configurations (bound order kept)."""
    ranking = selection.ranking
    mask = maximal_configurations(
        ranking.counts,
        np.array([prices[t] for t in ranking.types]),
        setting.budget_usd_per_hr,
        np.array([setting.max_counts[t] for t in ranking.types]),
    )
    return np.flatnonzero(mask)


def search_model(
    profiles: ProfileSet,
    prices_usd_per_hr: Mapping[str, float],
    selection: Selection,
    setting: KairosSetting,
    workload: Workload,
    tune_workload: Workload,
    sizes: SearchSizes,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every scheme's best configuration for one model and the online searches' evaluation
    counts (see module). Rows are rows of ``selection.ranking``."""
    ranking = selection.ranking
    bounds = ranking.upper_bound_qps
    candidates = candidate_rows(selection, prices_usd_per_hr, setting)
    evaluate = Evaluator(profiles, prices_usd_per_hr, selection, workload, tune_workload, log)
    schemes: dict[str, Any] = {}
    for policy in SEARCHED:
        found = branch_and_bound(
            bounds[candidates],
            lambda i, p=policy: evaluate(p, int(candidates[i])),
            slack=SLACK,
            max_evaluations=sizes.caps.get(policy),
        )
        row = int(candidates[found.best_row])
        schemes[policy] = {
            "row": row,
            "counts": [int(n) for n in ranking.counts[row]],
            "search_qps": found.best_qps,
            "evaluations": found.evaluations,
            "evaluations_to_best": found.evaluations_to_best,
            "proven": found.proven,
            "next_bound_qps": found.next_bound_qps,
            "space": int(candidates.size),
            "drs_threshold": evaluate.thresholds.get(row) if policy == "drs" else None,
        }
        log(
            f"search {selection.model} {policy}: best {ranking.counts[row].tolist()}"
            f" {found.best_qps:.1f} qps after {found.evaluations} evaluations"
            f" (best at {found.evaluations_to_best}, {'proven' if found.proven else 'capped'})"
        )
    scanned = np.arange(len(ranking)) if sizes.scan_all else candidates
    for policy in SCANNED:
        qps = np.array([evaluate(policy, int(row)) for row in scanned])
        row = int(scanned[int(np.argmax(qps))])
        # What the bound-ordered search over the maximal configurations would have needed.
        on_candidates = branch_and_bound(
            bounds[candidates], lambda i, p=policy: evaluate(p, int(candidates[i])), slack=SLACK
        )
        schemes[policy] = {
            "row": row,
            "counts": [int(n) for n in ranking.counts[row]],
            "search_qps": float(qps.max()),
            "evaluations": int(scanned.size),
            "evaluations_to_best": None,
            "proven": True,
            "next_bound_qps": 0.0,
            "space": int(scanned.size),
            "drs_threshold": None,
            "best_is_maximal": bool(row in set(candidates.tolist())),
            "bound_ordered_on_maximal": {
                "evaluations": on_candidates.evaluations,
                "evaluations_to_best": on_candidates.evaluations_to_best,
                "best_qps": on_candidates.best_qps,
            },
        }
        log(
            f"search {selection.model} {policy}: best of {scanned.size}"
            f" {ranking.counts[row].tolist()} {qps.max():.1f} qps"
        )
    online = online_searches(evaluate, candidates, schemes["kairos"], ranking.counts, sizes, log)
    ratios = [evaluate.cache[(p, r)] / bounds[r] for (p, r) in evaluate.cache if p in SEARCHED]
    return {
        "candidates": int(candidates.size),
        "affordable": len(ranking),
        "schemes": schemes,
        "online": online,
        "evaluated": {p: evaluate.counted(p) for p in (*SEARCHED, *SCANNED)},
        "max_measured_over_bound": float(max(ratios)),
        "seconds": evaluate.seconds,
    }


def online_searches(
    evaluate: Evaluator,
    candidates: np.ndarray,
    kairos: Mapping[str, Any],
    counts: np.ndarray,
    sizes: SearchSizes,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Evaluations each search needs to reach Kairos+' best for the Kairos dispatcher."""
    target = float(kairos["search_qps"])
    measured = [evaluate.cache.get(("kairos", int(r))) for r in candidates]
    # Rows Kairos+ left unevaluated have bound (1 + SLACK) <= target: none of them is a best.
    targets = sum(1 for q in measured if q is not None and q >= target)
    out: dict[str, Any] = {
        "target_qps": target,
        "kairos_plus": {
            "evaluations_to_best": kairos["evaluations_to_best"],
            "evaluations": kairos["evaluations"],
        },
        "random_expected": random_search_expected_evaluations(int(candidates.size), targets),
    }
    for name, search in (("genetic", genetic_search), ("bayesian", bayesian_search)):
        reached = []
        for seed in range(sizes.online_seeds):
            trace = search(
                counts[candidates],
                lambda i: evaluate("kairos", int(candidates[i])),
                target,
                np.random.default_rng(seed),
                sizes.online_cap,
            )
            reached.append(trace.reached_at)
        out[name] = {"reached_at": reached, "cap": sizes.online_cap}
        log(f"search {evaluate.selection.model} {name}: reached at {reached}")
    return out


def brute_force_check(
    profiles: ProfileSet,
    prices_usd_per_hr: Mapping[str, float],
    selection: Selection,
    setting: KairosSetting,
    workload: Workload,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Kairos on every maximal configuration of ``selection``'s model, and what branch and bound
    finds on the same numbers: the same best, and the largest measured / bound."""
    candidates = candidate_rows(selection, prices_usd_per_hr, setting)
    evaluate = Evaluator(profiles, prices_usd_per_hr, selection, workload, workload, log)
    start = time.perf_counter()
    qps = np.array([evaluate("kairos", int(r)) for r in candidates])
    bounds = selection.ranking.upper_bound_qps[candidates]
    found = branch_and_bound(bounds, lambda i: float(qps[i]), slack=SLACK)
    brute = int(np.argmax(qps))
    result = {
        "model": selection.model,
        "queries": int(workload.batch_size.size),
        "candidates": int(candidates.size),
        "brute_force_counts": [int(n) for n in selection.ranking.counts[candidates[brute]]],
        "brute_force_qps": float(qps[brute]),
        "branch_and_bound_qps": found.best_qps,
        "branch_and_bound_evaluations": found.evaluations,
        "same_best": bool(found.best_qps >= qps[brute]),
        "max_measured_over_bound": float(np.max(qps / bounds)),
        "seconds": time.perf_counter() - start,
    }
    log(f"brute-force check {selection.model}: {result}")
    return result


def remeasure(
    profiles: ProfileSet,
    prices_usd_per_hr: Mapping[str, float],
    selection: Selection,
    schemes: Mapping[str, Mapping[str, Any]],
    workload: Workload,
    drs_tune_workload: Workload,
    known: Mapping[tuple[str, tuple[int, ...]], tuple[float, int | None]],
    log: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Each scheme's best configuration measured at the section's probe size (``workload``;
    DRS re-tuned on ``drs_tune_workload``), reusing ``known[(policy, counts)]`` (qps, DRS
    threshold)."""
    by_type = {t: profiles.get_profile(selection.model, t) for t in selection.ranking.types}
    out: dict[str, dict[str, Any]] = {}
    for policy, scheme in schemes.items():
        counts = tuple(scheme["counts"])
        threshold = None
        if (policy, counts) in known:
            qps, threshold = known[(policy, counts)]
        else:
            fleet = selection.fleet_types(np.array(counts))

            def capacity(
                wl: Workload, fleet: list[str] = fleet, policy: str = policy, **kw: Any
            ) -> Any:
                return fleet_capacity(
                    by_type, fleet, policy, selection.qos_ms, wl, dict(prices_usd_per_hr), **kw
                )

            if policy == "drs":
                threshold = capacity(drs_tune_workload).drs_threshold
                qps = capacity(workload, drs_threshold=threshold).allowable_qps
            else:
                qps = capacity(workload).allowable_qps
        out[policy] = {"allowable_qps": float(qps), "drs_threshold": threshold}
        log(f"best fleet {selection.model} {policy} {list(counts)}: {qps:.1f} qps")
    return out
