"""``heteroplane demo --offline``: the estimator on the Kairos authors' measurements, no service.

It generates a Kairos-mix Poisson workload, shows its statistics and arrival envelope, and
simulates rm2 (QoS 350 ms) on an all-GPU fleet and on a mixed GPU/CPU fleet of about the same
cost, over a sweep of arrival rates. ``args`` carries ``profiles``, ``duration``, ``seed`` and
``json`` (:mod:`controlplane.cli.demo` parses them).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from controlplane.cli.output import emit, progress
from estimator.batches import parse_batch_distribution
from estimator.catalog import load_catalog
from estimator.envelope import arrival_envelope, tuner_windows_s
from estimator.fleet import Fleet
from estimator.profiles import load_profiles
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import Trace, poisson_arrivals, trace_stats

__all__ = ["run"]

MODEL, QOS_MS = "rm2", 350.0
FLEETS = ("g4dn.xlarge=4", "g4dn.xlarge=1,r5n.large=13")
RATES_QPS = (20.0, 40.0, 60.0, 80.0, 100.0)


def run(args: argparse.Namespace) -> int:
    progress(f"loading profiles from {args.profiles}")
    profiles = load_profiles(args.profiles)
    catalog = load_catalog()
    mix = parse_batch_distribution("kairos")
    rng = np.random.default_rng(args.seed)

    sample_arrivals = poisson_arrivals(RATES_QPS[1], args.duration, rng)
    sample = Trace(sample_arrivals, mix.sample(sample_arrivals.size, rng))
    stats = trace_stats(sample)
    envelope = arrival_envelope(sample.arrival_s, tuner_windows_s(0.25))

    rows: list[dict[str, Any]] = []
    for text in FLEETS:
        fleet = Fleet.parse(text)
        stage = Stage(
            MODEL,
            tuple(InstanceSpec(name) for name in fleet.expand()),
            {name: profiles.get_profile(MODEL, name) for name in fleet},
        )
        prices = {name: catalog.price_usd_per_hr(name) for name in fleet}
        for rate in RATES_QPS:
            progress(f"simulating {MODEL} on {text} at {rate:g} qps")
            arrivals = poisson_arrivals(rate, args.duration, rng)
            trace = Trace(arrivals, mix.sample(arrivals.size, rng))
            summary = simulate(
                trace, [stage], rng, prices_usd_per_hr=prices, qos_ms=QOS_MS
            ).summary()
            rows.append(
                {
                    "fleet": text,
                    "rate_qps": rate,
                    "cost_usd_per_hr": summary.cost_usd_per_hr,
                    "p50_ms": summary.p50_ms,
                    "p99_ms": summary.p99_ms,
                    "attainment": summary.attainment,
                    "mean_utilisation": summary.mean_utilisation,
                }
            )
    data = {
        "model": MODEL,
        "qos_ms": QOS_MS,
        "workload": {
            "queries": stats.count,
            "rate_qps": stats.rate_qps,
            "cv2": stats.cv2,
            "mean_batch_size": stats.mean_batch_size,
            "envelope": [
                {"window_s": float(w), "max_rate_qps": float(r)}
                for w, r in zip(envelope.window_s, envelope.rate_qps, strict=True)
            ],
        },
        "simulations": rows,
    }

    def human() -> str:
        lines = [
            f"Workload: Poisson, Kairos batch mix, {stats.count} queries over {args.duration:g} s"
            f" ({stats.rate_qps:.1f} qps, CV^2 {stats.cv2:.2f},"
            f" mean batch {stats.mean_batch_size:.0f})",
            "  arrival envelope (max rate in any window):",
            "    "
            + "  ".join(
                f"{w:g}s:{r:.0f}" for w, r in zip(envelope.window_s, envelope.rate_qps, strict=True)
            ),
            "",
            f"{MODEL}, QoS {QOS_MS:g} ms, FCFS to the fastest idle instance:",
            f"  {'fleet':<28} {'$/hr':>6} {'qps':>6} {'p50 ms':>8} {'p99 ms':>9}"
            f" {'within QoS':>10} {'util':>6}",
        ]
        for row in rows:
            lines.append(
                f"  {row['fleet']:<28} {row['cost_usd_per_hr']:>6.3f} {row['rate_qps']:>6.0f}"
                f" {row['p50_ms']:>8.1f} {row['p99_ms']:>9.1f}"
                f" {100 * row['attainment']:>9.2f}% {100 * row['mean_utilisation']:>5.1f}%"
            )
        lines.append("")
        lines.append(
            "Next: heteroplane simulate --help, heteroplane trace generate --help (see README.md)"
        )
        return "\n".join(lines)

    return emit(args.json, data, human)
