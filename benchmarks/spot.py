"""Spot capacity: on-demand-only, spot-aware and SpotHedge-style plans under interruptions.

    .venv/bin/python benchmarks/spot.py [--rate-qps 100] [--duration-s 1800]
        [--interruptions 0.01,0.5,2,8] [--seed 0] [--json] [--spec examples/rm2.yaml]

The Kairos setting (``examples/rm2.yaml``: rm2 on g4dn.xlarge, c5n.2xlarge, r5n.large and
t3.xlarge, 350 ms at p99, 10 USD/hr; the Kairos batch mix; ``--spec examples/dien.yaml``: dien,
35 ms), a Poisson trace at ``--rate-qps``.
Each policy plans on its own 300 s trace at the rate and is replayed static on
``--duration-s`` of the same rate (``heteroplane replay --policy static
--interruptions-per-hour R``: docs/spot.md), its spot instances interrupted at each rate R per
instance-hour, each replaced at its two-minute notice and serving 180 s later:

- ``on-demand``: the planner's plan (InferLine over Kairos mixes), all on demand;
- ``spot-aware s=0.5`` and ``spot-aware s=0.2``: ``plan_with_spot`` with ``survive_share`` 0.5
  and 0.2 (``max_share`` 1): the mix chosen at blended prices, an on-demand base that keeps that
  share of the capacity, spot on top spread across types, spares where interruptions are
  frequent;
- ``spothedge``: SpotHedge-style, no mix choice: the on-demand plan's mix, every instance on spot
  (``survive_share`` 0), the same spares.

A last block, ``wave``, has no Poisson interruptions but one wave mid-run that takes every spot
instance at once (the correlated loss the survive share is for), planned for 0.5 an hour.

The planners are told the interruption rate (the catalog's ``interruptions_per_hr`` set to R), as
a deployment would know its recent rate. For each (R, policy) the table gives the cost in USD/hr
(what the run cost over its length, spot at the catalog's spot prices, replacements billed from
their launch), the share of queries within the spec's SLO, the saving against on-demand, and the
interruptions drawn. Figures are for the seed given; they are simulations, not a live fleet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import numpy as np

from controlplane.policies.planner import plan_app
from controlplane.policies.spot import plan_with_spot
from controlplane.policies.spot_replay import replay_with_interruptions
from controlplane.spec import ResolvedApp, SpecError, SpotSpec, load_spec, resolve_spec
from estimator.batches import parse_batch_distribution
from estimator.traces import Trace, poisson_arrivals

SPEC = "examples/rm2.yaml"
PLANNING_S = 300.0


def _trace(rate_qps: float, duration_s: float, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rate_qps, duration_s, rng)
    return Trace(arrivals, parse_batch_distribution("kairos").sample(arrivals.size, rng))


def _with_rate(app: ResolvedApp, rate_per_hr: float) -> ResolvedApp:
    catalog = app.catalog.with_overrides(
        dataclasses.replace(app.catalog[t], interruptions_per_hr=rate_per_hr)
        for t in app.instance_types
    )
    return dataclasses.replace(app, catalog=catalog)


def run(
    rate_qps: float,
    duration_s: float,
    rates_per_hr: list[float],
    seed: int,
    spec_path: str = SPEC,
) -> list[dict[str, Any]]:
    spec = load_spec(spec_path)
    base = resolve_spec(spec)
    planning = _trace(rate_qps, PLANNING_S, seed + 1)
    replayed = _trace(rate_qps, duration_s, seed + 2)
    rows: list[dict[str, Any]] = []
    # A rate of -1 stands for the wave: no Poisson interruptions, one wave mid-run (planned for
    # 0.5 an hour).
    for rate_or_wave in [*rates_per_hr, -1.0]:
        wave = rate_or_wave < 0
        rate = 0.5 if wave else rate_or_wave
        on_demand_plan = plan_app(base, planning, seed=seed)
        plans = {"on-demand": (base, on_demand_plan)}
        for survive in (0.5, 0.2):
            app = _with_rate(
                resolve_spec(
                    spec.model_copy(update={"spot": SpotSpec(enabled=True, survive_share=survive)})
                ),
                rate,
            )
            plans[f"spot-aware s={survive:g}"] = (
                app,
                plan_with_spot(app, planning, plan=plan_app, seed=seed),
            )
        hedge = _with_rate(
            resolve_spec(
                spec.model_copy(update={"spot": SpotSpec(enabled=True, survive_share=0.0)})
            ),
            rate,
        )

        def same_mix(
            _app: ResolvedApp, _trace: Trace, *, chosen: Any = on_demand_plan, **_: Any
        ) -> Any:
            return chosen

        plans["spothedge"] = (hedge, plan_with_spot(hedge, planning, plan=same_mix, seed=seed))
        cost_on_demand = None
        for name, (app, plan) in plans.items():
            stage = plan.stages[0]
            result, log = replay_with_interruptions(
                replayed,
                app,
                plan,
                np.random.default_rng(seed + 3),
                dict.fromkeys(stage.fleet, 0.0 if wave else rate),
                wave_at_s=duration_s / 2 if wave else None,
            )
            hours = float(replayed.arrival_s[-1]) / 3600.0
            cost = result.cost_usd / hours
            if cost_on_demand is None:
                cost_on_demand = cost
            rows.append(
                {
                    "interruptions_per_hr": "wave" if wave else rate,
                    "policy": name,
                    "fleet": dict(stage.fleet),
                    "spot_fleet": dict(stage.spot_fleet),
                    "cost_usd_per_hr": cost,
                    "saving_vs_on_demand": 1.0 - cost / cost_on_demand,
                    "slo_attainment": 1.0 - result.slo_miss_share,
                    "p99_ms": result.p99_ms,
                    "interruptions": log.interruptions,
                    "missing_instance_s": log.missing_instance_s,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-qps", type=float, default=100.0)
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--interruptions", default="0.01,0.5,2,8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--spec", default=SPEC, help="a spec of one model (default: %(default)s)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.interruptions.split(",")]
    try:
        rows = run(args.rate_qps, args.duration_s, rates, args.seed, args.spec)
    except SpecError as error:
        print(f"spot: {error}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"{args.spec}, {args.rate_qps:g} qps, {args.duration_s:g} s replayed,"
        f" seed {args.seed}; 'wave': no interruption but one wave taking every spot instance at"
        " once mid-run"
    )
    print("R/hr   policy             USD/hr  saving  within SLO  p99 ms    interr.  fleet (spot)")
    for row in rows:
        fleet = ", ".join(
            f"{n} {t}" + (f" ({row['spot_fleet'][t]})" if row["spot_fleet"].get(t) else "")
            for t, n in row["fleet"].items()
            if n
        )
        print(
            f"{row['interruptions_per_hr']!s:<6} {row['policy']:<18} {row['cost_usd_per_hr']:6.3f}"
            f"  {100 * row['saving_vs_on_demand']:5.1f}%  {100 * row['slo_attainment']:8.2f}%"
            f"  {row['p99_ms']:8.1f}  {row['interruptions']:7d}  {fleet}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
