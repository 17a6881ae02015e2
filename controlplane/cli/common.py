"""Loaders that several commands share (profiles, catalog, fleet, workload); their options are in
:mod:`controlplane.cli.parsers`."""

from __future__ import annotations

import argparse
import math

import numpy as np

from controlplane.cli.output import UsageError
from estimator.batches import MAX_BATCH_SIZE, parse_batch_distribution
from estimator.catalog import Catalog, load_catalog
from estimator.fleet import Fleet
from estimator.profiles import ProfileSet, load_profiles
from estimator.traces import Trace, poisson_arrivals, read_trace_csv


def load_workload(args: argparse.Namespace, rng: np.random.Generator) -> Trace:
    """The trace named by ``--trace``, or a Poisson trace from ``--qps`` and ``--duration``."""
    if args.trace is not None:
        if args.qps is not None or args.duration is not None or args.batch_dist is not None:
            raise UsageError("give either --trace FILE or --qps/--duration/--batch-dist, not both")
        return read_trace_csv(args.trace)
    if args.qps is None or args.duration is None:
        raise UsageError("give --trace FILE, or --qps R and --duration S")
    arrivals = poisson_arrivals(args.qps, args.duration, rng)
    if arrivals.size == 0:
        raise UsageError(
            f"a Poisson trace at {args.qps} qps over {args.duration} s has no queries;"
            " raise --qps or --duration"
        )
    if args.batch_dist is None:
        sizes = np.ones(arrivals.size, dtype=np.int64)
    else:
        sizes = parse_batch_distribution(args.batch_dist).sample(arrivals.size, rng)
    return Trace(arrivals, sizes)


def load_inputs(args: argparse.Namespace) -> tuple[ProfileSet, Catalog]:
    return load_profiles(args.profiles), load_catalog(args.catalog)


def parse_fleet(text: str, catalog: Catalog) -> Fleet:
    """A fleet whose every type is in the catalog, with at least one instance."""
    fleet = Fleet.parse(text)
    for name in fleet:
        catalog[name]  # raises UnknownInstanceTypeError naming the known types
    if fleet.total == 0:
        raise UsageError(f"fleet {text!r} has no instances")
    return fleet


def positive(name: str, value: float | None) -> None:
    """Refuse a value that is not a finite number > 0 (``--qos-ms inf`` was taken, and printed
    "within inf ms: 100.00% of queries")."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name} must be a finite number > 0, got {value:g}")


def at_most(name: str, value: int | None, largest: int) -> None:
    """Refuse a count past ``largest`` (a typo that would allocate or run for ever)."""
    if value is not None and value > largest:
        raise UsageError(f"{name} must be at most {largest:,}, got {value}")


def check_has_rate(trace: Trace, where: str, what: str) -> None:
    """A one-line :class:`UsageError` naming ``where`` (the option and file) when ``trace`` has
    no rate for ``what`` (fewer than two arrivals, or all at one time)."""
    if len(trace) < 2 or trace.duration_s <= 0:
        raise UsageError(
            f"{where}: {what} needs at least two arrivals at different times for its rate,"
            f" got {len(trace)} over {trace.duration_s:g} s"
        )


def check_seed(seed: int | None) -> None:
    """``--seed`` as numpy's generators take it: a whole number >= 0."""
    if seed is not None and seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")


def check_drs_threshold(threshold: int | None, policy: str) -> None:
    """``--drs-threshold``: a batch size, 0 (no auxiliaries) up to the largest batch size, and
    only with ``--policy drs`` (any other policy ignores it)."""
    if threshold is None:
        return
    if not 0 <= threshold <= MAX_BATCH_SIZE:
        raise UsageError(
            f"--drs-threshold must be in 0..{MAX_BATCH_SIZE:,} (a batch size), got {threshold}"
        )
    if policy != "drs":
        raise UsageError(f"--drs-threshold is drs's option; --policy is {policy}")
