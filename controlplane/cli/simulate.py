"""``heteroplane simulate``: replay a workload through a fleet with the discrete-event simulator."""

from __future__ import annotations

import argparse

import numpy as np

from controlplane.cli.common import (
    at_most,
    check_drs_threshold,
    check_seed,
    load_inputs,
    load_workload,
    parse_fleet,
    positive,
)
from controlplane.cli.output import UsageError, emit
from estimator.batches import MAX_BATCH_SIZE
from estimator.policies import full_range_types, policy_class, policy_factory
from estimator.simulator import InstanceSpec, Stage, simulate
from matching import registry


def run(args: argparse.Namespace) -> int:
    positive("--qos-ms", args.qos_ms)
    positive("--qps", args.qps)
    positive("--duration", args.duration)
    positive("--max-batch", args.max_batch)
    # A batch of more queries than the largest batch size holds is no batch a profile has.
    at_most("--max-batch", args.max_batch, MAX_BATCH_SIZE)
    check_drs_threshold(args.drs_threshold, args.policy)
    check_seed(args.seed)
    if args.max_batch > 1 and not policy_class(args.policy).batches:
        batching = [name for name in registry.names() if policy_class(name).batches]
        raise UsageError(
            f"--max-batch {args.max_batch}: the {args.policy} policy runs each query alone (in"
            f" the Kairos setting a query already is a batch); batches are {', '.join(batching)}'s"
        )
    profiles, catalog = load_inputs(args)
    fleet = parse_fleet(args.fleet, catalog)
    model_profiles = {name: profiles.get_profile(args.model, name) for name in fleet}
    rng = np.random.default_rng(args.seed)
    trace = load_workload(args, rng)
    prices = {name: catalog.price_usd_per_hr(name) for name in fleet}
    base_types = full_range_types(model_profiles, trace.batch_size, args.qos_ms, prices)
    if args.policy in ("drs", "kairos") and not base_types:
        raise UsageError(
            f"{args.policy} needs a type in the fleet that meets QoS {args.qos_ms:g} ms"
            f" at every batch size of the trace"
        )
    make_policy = policy_factory(args.policy, model_profiles, base_types, args.drs_threshold)
    stage = Stage(
        model=args.model,
        instances=tuple(InstanceSpec(name) for name in fleet.expand()),
        profiles=model_profiles,
        policy=make_policy(),
        max_batch_queries=args.max_batch,
    )
    result = simulate(
        trace, [stage], rng, prices_usd_per_hr=prices, qos_ms=args.qos_ms, service=args.service
    )
    summary = result.summary()
    types = result.instance_types[0]
    utilisation = {
        name: float(
            np.mean([u for t, u in zip(types, result.utilisation[0], strict=True) if t == name])
        )
        for name in fleet
        if fleet[name] > 0
    }
    data = {
        "model": args.model,
        "fleet": dict(fleet),
        "policy": args.policy,
        "qos_ms": args.qos_ms,
        "queries": summary.queries,
        "duration_s": float(trace.arrival_s[-1] - trace.arrival_s[0]),
        # None for a trace without a span (one query, or all at one time): no rate to offer.
        "offered_qps": float(len(trace) / trace.duration_s) if trace.duration_s > 0 else None,
        "p50_ms": summary.p50_ms,
        "p95_ms": summary.p95_ms,
        "p99_ms": summary.p99_ms,
        "mean_ms": summary.mean_ms,
        "mean_wait_ms": summary.mean_wait_ms,
        "attainment": summary.attainment,
        "throughput_qps": summary.throughput_qps,
        "cost_usd_per_hr": summary.cost_usd_per_hr,
        "utilisation_by_type": utilisation,
        "seed": args.seed,
    }

    def human() -> str:
        rate = data["offered_qps"]
        offered = "no rate (the trace has no span)" if rate is None else f"{rate:.2f} qps"
        lines = [
            f"model {args.model} on {fleet} (${summary.cost_usd_per_hr:.4f}/hr),"
            f" policy {args.policy}",
            f"  {summary.queries} queries at {offered} offered,"
            f" {summary.throughput_qps:.2f} qps served",
            f"  latency ms: p50 {summary.p50_ms:.2f}  p95 {summary.p95_ms:.2f}"
            f"  p99 {summary.p99_ms:.2f}  mean wait {summary.mean_wait_ms:.2f}",
            f"  within {args.qos_ms:g} ms: {100 * (summary.attainment or 0):.2f}% of queries",
            "  utilisation: "
            + ", ".join(f"{name} {100 * u:.1f}%" for name, u in utilisation.items()),
        ]
        return "\n".join(lines)

    return emit(args.json, data, human)
