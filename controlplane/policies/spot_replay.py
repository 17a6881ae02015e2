"""Replay with spot interruptions: a plan's spot instances taken away as a Poisson process.

The static replay of a plan (:func:`controlplane.policies.replay.replay_timeline`) on a fleet
timeline in which each of the plan's spot instances (its stages' ``spot_fleet``) is interrupted
at ``rate`` per instance-hour (one rate, or one per type), drawn from a seeded generator. Each
interruption follows what the control plane does on a notice (docs/spot.md, "Acting on a
notice"):

- the notice comes ``notice_s`` (two minutes) before the deadline D;
- the replacement (spot again, of the same type) is launched at the notice, billed from then,
  and serves from the notice plus ``replacement_boot_s`` (an instance's boot, its image and its
  models: 180 s by default, so a replacement serves a minute after its predecessor went);
- the doomed instance serves on until its replacement serves, or until ``margin_s + drain_s``
  before the deadline, whichever is first (then it drains and goes), and is billed until then;
- the replacement is interrupted in its turn, from its launch on.

Spot instances are billed at their type's spot price (the catalog's): in the simulation they are
a type of their own, ``<type>@spot``, with the type's latency profile and the spot price. On-demand
instances run throughout. Exact as the static replay is: nothing here depends on latencies. A
cascade's stages are each interrupted so, and replayed together as the static replay of a
pipeline replays them.

>>> timeline, log = interrupted_timeline({"a": 2}, {"a": 1}, 3600.0, {"a": 0.0},
...     np.random.default_rng(0))
>>> sorted(s.instance_type for s in timeline.instances), log.interruptions
(['a', 'a@spot'], 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from controlplane.policies.pipeline import answering_stages, pipeline_stages
from controlplane.policies.plan import PlanDocument, StagePlan
from controlplane.policies.replay import (
    FleetTimeline,
    ReplayResult,
    check_plan,
    check_stages,
    outcome,
    replay_timeline,
    spot_price_usd_per_hr,
    timeline_windows,
)
from controlplane.spec import ResolvedApp
from estimator.profiles import ProfileSet
from estimator.simulator import InstanceSpec, simulate
from estimator.traces import Trace

__all__ = [
    "DEFAULT_REPLACEMENT_BOOT_S",
    "SPOT_SUFFIX",
    "InterruptionLog",
    "interrupted_timeline",
    "parse_interruption_rates",
    "replay_with_interruptions",
]

SPOT_SUFFIX = "@spot"
DEFAULT_REPLACEMENT_BOOT_S = 180.0
NOTICE_S = 120.0
DRAIN_S = 10.0
MARGIN_S = 15.0


@dataclass(frozen=True, slots=True)
class InterruptionLog:
    """What the injection did: ``interruptions`` in all, and the instance-seconds of spot
    capacity missing between a doomed instance's last work and its replacement's first."""

    spot_instances: int
    interruptions: int
    missing_instance_s: float


def parse_interruption_rates(text: str, types: list[str]) -> dict[str, float]:
    """``R`` (one rate for every type) or ``type=R,type=R`` (a rate per type, 0 for the others),
    interruptions per spot instance-hour; ``ValueError`` (one line) for anything else."""
    rates = dict.fromkeys(types, 0.0)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("expected RATE or TYPE=RATE,... (interruptions an hour), got nothing")
    if len(parts) == 1 and "=" not in parts[0]:
        rates = dict.fromkeys(types, _rate(parts[0]))
        return rates
    given: set[str] = set()
    for part in parts:
        name, equals, value = part.partition("=")
        if not equals:
            raise ValueError(f"{part!r}: expected TYPE=RATE (or one RATE for every type)")
        name = name.strip()
        if name not in rates:
            raise ValueError(f"{name!r} is not a type of the plan ({', '.join(types)})")
        if name in given:
            raise ValueError(f"{name!r} is given twice")
        given.add(name)
        rates[name] = _rate(value)
    return rates


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"{text.strip()!r} is not a number of interruptions an hour") from None
    if not math.isfinite(rate) or rate < 0:
        raise ValueError(f"the interruption rate must be a finite number >= 0, got {text.strip()}")
    return rate


def interrupted_timeline(
    fleet: Mapping[str, int],
    spot_fleet: Mapping[str, int],
    end_s: float,
    rates_per_hr: Mapping[str, float],
    rng: np.random.Generator,
    *,
    notice_s: float = NOTICE_S,
    drain_s: float = DRAIN_S,
    margin_s: float = MARGIN_S,
    replacement_boot_s: float = DEFAULT_REPLACEMENT_BOOT_S,
    wave_at_s: float | None = None,
) -> tuple[FleetTimeline, InterruptionLog]:
    """The fleet over [0, ``end_s``): on-demand instances throughout, each spot slot a chain of
    instances, each interrupted as the module docstring says. ``wave_at_s``: besides, every spot
    instance serving then is interrupted then (one wave takes all the spot capacity at once)."""
    instances: list[InstanceSpec] = []
    interruptions = 0
    missing_s = 0.0
    spot_total = 0
    for name in sorted(fleet):
        spot = min(spot_fleet.get(name, 0), fleet[name])
        instances += [InstanceSpec(name) for _ in range(fleet[name] - spot)]
        rate = rates_per_hr.get(name, 0.0)
        for _ in range(spot):
            spot_total += 1
            launched, ready = 0.0, 0.0
            waved = wave_at_s is None
            while True:
                life_s = rng.exponential(3600.0 / rate) if rate > 0 else math.inf
                deadline = launched + life_s
                if not waved and wave_at_s is not None and deadline >= wave_at_s:
                    deadline, waved = wave_at_s, True
                notice = max(ready, deadline - notice_s)
                if notice >= end_s:
                    instances.append(InstanceSpec(name + SPOT_SUFFIX, ready, math.inf, launched))
                    break
                replacement_ready = notice + replacement_boot_s
                last_s = max(notice, deadline - margin_s - drain_s)
                stop = max(min(replacement_ready, last_s), ready + 1e-6)
                instances.append(InstanceSpec(name + SPOT_SUFFIX, ready, stop, launched))
                interruptions += 1
                launched, ready = notice, replacement_ready
                missing_s += max(0.0, min(ready, end_s) - stop)
    return FleetTimeline(tuple(instances)), InterruptionLog(spot_total, interruptions, missing_s)


def replay_with_interruptions(
    trace: Trace,
    app: ResolvedApp,
    plan: PlanDocument,
    rng: np.random.Generator,
    rates_per_hr: Mapping[str, float],
    *,
    replacement_boot_s: float = DEFAULT_REPLACEMENT_BOOT_S,
    wave_at_s: float | None = None,
    admission: bool = True,
) -> tuple[ReplayResult, InterruptionLog]:
    """The static replay of ``plan`` with its spot instances interrupted (see the module
    docstring; ``wave_at_s``: all at once then, too); ``rng`` draws the interruptions (stage by
    stage), then the service times. A plan of several stages (a cascade) is replayed through
    every stage at once, each query forwarded as the validation records say, as
    :func:`~controlplane.policies.replay.replay_pipeline` replays it static. ``admission``
    refuses, as the service does, a query whose queue cannot be served within the SLO (a miss,
    ``ReplayResult.refused_share``); without it every query is served however late."""
    stages = check_stages(plan, app) if len(plan.stages) > 1 else (check_plan(plan, app),)
    end_s = float(trace.arrival_s[-1]) if len(trace) else 0.0
    timelines, logs = [], []
    for stage in stages:
        timeline, log = interrupted_timeline(
            stage.fleet,
            stage.spot_fleet,
            end_s,
            rates_per_hr,
            rng,
            replacement_boot_s=replacement_boot_s,
            wave_at_s=wave_at_s,
        )
        timelines.append(timeline)
        logs.append(log)
    spot_prices = {
        name + SPOT_SUFFIX: spot_price_usd_per_hr(app, name)
        for name in sorted({t for stage in stages for t in stage.spot_fleet})
    }
    log = InterruptionLog(
        sum(entry.spot_instances for entry in logs),
        sum(entry.interruptions for entry in logs),
        sum(entry.missing_instance_s for entry in logs),
    )
    aliases = {alias: alias.removesuffix(SPOT_SUFFIX) for alias in spot_prices}
    if len(stages) == 1:
        result = replay_timeline(
            trace,
            app,
            stages[0],
            timelines[0],
            rng,
            policy="static",
            profile_types=aliases,
            extra_prices_usd_per_hr=spot_prices,
            admission=admission,
        )
        return result, log
    cascade = _replay_cascade(
        trace, app, plan, stages, timelines, rng, aliases, spot_prices, admission
    )
    return cascade, log


def _replay_cascade(
    trace: Trace,
    app: ResolvedApp,
    plan: PlanDocument,
    stages: tuple[StagePlan, ...],
    timelines: list[FleetTimeline],
    rng: np.random.Generator,
    aliases: Mapping[str, str],
    spot_prices: Mapping[str, float],
    admission: bool,
) -> ReplayResult:
    """Every stage of a cascade at once on its interrupted timeline: the app seen with each
    spot alias a type of its own (the profile of its type, the spot price)."""
    profiles = {
        model: ProfileSet(
            [
                *(found[key] for key in found),
                *(
                    dataclasses.replace(found[(model, base)], instance_type=alias)
                    for alias, base in aliases.items()
                    if (model, base) in found
                ),
            ],
            found.source,
        )
        for model, found in app.profiles.items()
    }
    seen = dataclasses.replace(
        app,
        profiles=profiles,
        prices_usd_per_hr={**app.prices_usd_per_hr, **spot_prices},
    )
    answered = answering_stages(app, trace, rng)
    built = pipeline_stages(
        seen,
        [
            (stage.name, timeline.instances, stage.batch_size, stage.policy)
            for stage, timeline in zip(stages, timelines, strict=True)
        ],
        trace,
        answered,
    )
    prices = dict(seen.prices_usd_per_hr)
    qos_ms = app.constraints.slo_ms
    result = simulate(
        trace, built, rng, prices_usd_per_hr=prices, qos_ms=qos_ms, admission=admission
    )
    p99_ms, missed, refused = outcome(result, qos_ms)
    timeline = FleetTimeline(tuple(spec for t in timelines for spec in t.instances))
    types = list(dict.fromkeys(spec.instance_type for spec in timeline.instances))
    return ReplayResult(
        policy="static",
        p99_ms=p99_ms,
        slo_miss_share=missed,
        refused_share=refused,
        cost_usd=result.cost_usd,
        scaling_actions=timeline.scaling_actions,
        timeline=timeline_windows(result, timeline, types, prices),
        fleet_timeline=timeline,
        simulation=result,
    )
