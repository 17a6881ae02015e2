"""``heteroplane capacity``: the allowable throughput of a fleet under a dispatch policy.

Kairos' metric: the highest Poisson arrival rate at which at least 99% of queries finish within
QoS (DESIGN.md section 4, "Kairos-setting semantics"). Each query is a batch that runs alone.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from controlplane.cli.common import (
    at_most,
    check_drs_threshold,
    check_seed,
    load_inputs,
    parse_fleet,
    positive,
)
from controlplane.cli.output import UsageError, emit, progress
from estimator.batches import parse_batch_distribution
from estimator.capacity import MAX_PROBE_QUERIES, Workload, fleet_capacity
from estimator.errors import BatchSizeOutOfRangeError
from estimator.policies import full_range_types


def run(args: argparse.Namespace) -> int:
    positive("--qos-ms", args.qos_ms)
    positive("--queries", args.queries)
    at_most("--queries", args.queries, MAX_PROBE_QUERIES)
    check_drs_threshold(args.drs_threshold, args.policy)
    check_seed(args.seed)
    profiles, catalog = load_inputs(args)
    fleet = parse_fleet(args.fleet, catalog)
    model_profiles = {name: profiles.get_profile(args.model, name) for name in fleet}
    prices = {name: catalog.price_usd_per_hr(name) for name in fleet}
    rng = np.random.default_rng(args.seed)
    sizes = parse_batch_distribution(args.batch_dist).sample(args.queries, rng)
    try:
        for profile in model_profiles.values():
            profile.check_batch_size(int(sizes.min()))
            profile.check_batch_size(int(sizes.max()))
    except BatchSizeOutOfRangeError as error:
        # The default mix is Kairos' (1-1,000 samples a query): a profile measured on small
        # batches (the demo's, 1..8) refused it without saying which option to change.
        raise UsageError(
            f"--batch-dist {args.batch_dist}: draws batch size {error.batch_size}, outside the"
            f" profile of {error.model} on {error.instance_type} (measured"
            f" {error.low}..{error.high}); give a mix within it, e.g. --batch-dist"
            f" fixed:{error.low}"
        ) from None
    cost = sum(prices[name] * count for name, count in fleet.items())
    found = fleet_capacity(
        model_profiles,
        fleet.expand(),
        args.policy,
        args.qos_ms,
        Workload.poisson(sizes, rng),
        prices,
        drs_threshold=args.drs_threshold,
        model=args.model,
        progress=progress,
    )
    allowable = found.allowable_qps
    extra: dict[str, Any] = {}
    if found.drs_threshold is not None:
        extra = {
            "drs_threshold": found.drs_threshold,
            "threshold_evaluations": found.threshold_evaluations,
        }
    data = {
        "model": args.model,
        "fleet": dict(fleet),
        "policy": args.policy,
        "qos_ms": args.qos_ms,
        "allowable_qps": allowable,
        "cost_usd_per_hr": cost,
        "qps_per_usd_per_hr": allowable / cost if cost > 0 else None,
        "base_types": full_range_types(model_profiles, sizes, args.qos_ms, prices),
        "evaluations": found.evaluations,
        **extra,
    }

    def human() -> str:
        return (
            f"{args.model} on {fleet} (${cost:.4f}/hr) with {args.policy}: allowable throughput"
            f" {allowable:.2f} qps (>= 99% of queries within {args.qos_ms:g} ms)"
        )

    return emit(args.json, data, human)
