"""How big each speed benchmark's run is: :data:`FULL` (each script's defaults) and :data:`QUICK`
(what ``--quick`` runs, and ``make bench``: seconds each, indicative numbers only, one repeat).

The speed scripts (``estimator_speed.py``, ``bounds_speed.py``, ``matching_speed.py``,
``planner_speed.py``, ``gear_planner_speed.py``, the serving path's ``dispatcher`` and ``layers``
parts) and ``benchmarks/results/controlplane.py``
(``--quick``) read their sizes here, so that a quick run means the same everywhere.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["FULL", "QUICK", "QUICK_HELP", "Sizes", "add_quick", "chosen"]

# The --quick option's help, the same in every script.
QUICK_HELP = (
    "small sizes, one repeat: seconds, indicative numbers (make bench; benchmarks/sizes.py)"
)


@dataclass(frozen=True)
class Sizes:
    """How big each speed script's run is (full mode: the scripts' own defaults)."""

    estimator_queries: int = 1_000_000
    estimator_repeats: int = 5
    event_queries: int = 100_000
    envelope_arrivals: int = 1_000_000
    bound_vectors: int = 2_000_000
    bounds_repeats: int = 3
    ten_type_exhaustive: bool = True
    bounds_budgets_usd_per_hr: tuple[float, ...] = (50.0, 100.0)
    bounds_models: tuple[str, ...] = ("rm2", "wnd", "mtwnd", "dien", "ncf")
    matching_queries: int = 100_000
    matching_states: tuple[int, int] = (2000, 500)
    matching_repeats: int = 3
    matching_rates_qps: tuple[int, ...] = (100, 130)
    planner_rate_qps: float = 50.0
    planner_duration_s: float = 600.0
    planner_repeats: int = 3
    gear_families: tuple[str, ...] = ("auto", "synthetic")
    gear_repeats: int = 3
    dispatcher_rate_qps: float = 2000.0
    dispatcher_duration_s: float = 10.0
    dispatcher_warmup_s: float = 1.0
    dispatcher_headroom_qps: tuple[float, ...] = (4000.0,)
    dispatcher_repeats: int = 3  # runs of each scenario: the one of median p99 is reported
    # python -m benchmarks.serving_speed api: runs of the whole API path (0: not run, as in quick
    # mode: it starts the service and worker processes, which takes longer than the quick set).
    api_rate_qps: float = 2000.0
    api_duration_s: float = 10.0
    api_runs: int = 3
    layers_requests: int = 2000
    layers_repeats: int = 5


FULL = Sizes()
# Halved on 2026-12-07 (the simulated queries, arrivals, vectors and trace; the dispatcher runs
# are a third: 0.5 s after 0.25 s of warm-up, 1.5 s after 0.5 s before): the test suite runs the
# quick results, whose figures are indicative only.
QUICK = Sizes(
    estimator_queries=100_000,
    estimator_repeats=1,
    event_queries=10_000,
    envelope_arrivals=100_000,
    bound_vectors=100_000,
    bounds_repeats=1,
    ten_type_exhaustive=False,
    bounds_budgets_usd_per_hr=(50.0,),
    bounds_models=("rm2",),
    matching_queries=5_000,
    matching_states=(200, 50),
    matching_repeats=1,
    matching_rates_qps=(100,),
    planner_duration_s=60.0,
    planner_repeats=1,
    gear_families=("synthetic",),
    gear_repeats=1,
    dispatcher_duration_s=0.5,
    dispatcher_warmup_s=0.25,
    dispatcher_headroom_qps=(),
    dispatcher_repeats=1,
    api_runs=0,
    layers_requests=200,
    layers_repeats=1,
)


def add_quick(parser: argparse.ArgumentParser, help: str = QUICK_HELP) -> None:
    """The ``--quick`` option of a speed script."""
    parser.add_argument("--quick", action="store_true", help=help)


def chosen(args: argparse.Namespace) -> Sizes:
    """:data:`QUICK` with ``--quick``, else :data:`FULL`."""
    return QUICK if args.quick else FULL
