"""INFaaS: model-less selection against a static GPU choice, in cost and SLO attainment.

This experiment owns the INFaaS result (Romero et al., USENIX ATC'21, sections 4.1
and 4.2): the cost in USD of serving a load, and the share of queries answered within the
latency SLO, when a query names only its app and its needs (``controlplane.policies.variants``) and
the system picks and scales the variant, against a user's static choice: the most accurate model
pinned on the GPU type and provisioned for the peak. Both are simulated
(``estimator.simulator``) on a flat low load and on a fluctuating one, for two apps that differ
only in their accuracy floor.

**Variants.** Every model of the demo family (``benchmarks/gear_demo.py``) on every emulated type
of the catalog (``emu.cpu.small``, ``emu.cpu.large``, ``emu.gpu``: speed factors 0.5, 1 and 4,
made-up prices 0.05, 0.10 and 0.526 USD/hr) with a batch cap. A variant's latency profile is
the family's slowed profile (the most accurate model takes 20 ms at batch size 1 at speed 1,
the measured shape of every curve kept) over the type's speed factor. Its saturation rate Q_v
(the highest Poisson rate one instance serves with the P99 within the SLO) is found in the
simulator by bisection (:func:`saturation`, as the gear planner finds a cascade's max QPS, at
most 90% of the bound); of the batch caps (powers of two whose mean latency is within the SLO)
the one with the highest Q_v is kept: INFaaS's variants include the batch size.

**Model-less selection and autoscaling** (INFaaS, as modelled here). Every :data:`TICK_S` (the
Model-Autoscaler's 1 s) the controller measures the load lambda over the last :data:`WINDOW_S`
(the monitoring daemon's 2 s) and offers ``controlplane.policies.variants.choose`` every variant v
with

- n_v = ceil(lambda / (U Q_v)) instances, U = :data:`UTILISATION` (the VM-Autoscaler adds a
  worker when utilisation passes 80%, section 4.2.3);
- predicted latency: the P99 of one instance at lambda / n_v (interpolated between the probes);
- cost per query: C_v (n_v + w max(0, n_v - running_v)) / lambda, C_v the type's price per
  second and w = :data:`LOAD_WEIGHT` the ILP's lambda T_load (section 4.2.1: newly loaded
  instances cost extra, so that a variant already running is preferred at equal cost);

and takes the cheapest variant that meets the app's latency SLO and accuracy floor. Then

- same variant, more instances: the new ones start at once and serve after the type's boot time
  (``controlplane.policies.tuner.default_boot_s``: 30 s for CPU types, 60 s for GPU types), billed
  from their start (model-horizontal and VM-level scaling);
- same variant, fewer: instances are removed only down to the largest n the variant needed over
  the last T_v, T_v = the type's boot time (section 4.2.2 waits T_v, the loading latency);
- another variant (model-vertical scaling: another model or another type): taken at once when
  the current variant is short of instances (an upgrade), else only when every tick of the last
  T_v chose it (a downgrade); its n_v instances start, the current variant serves until they are
  ready, then arrivals go to the new variant and the old instances drain and stop.

The sizing rule, the ILP's cost and the Model-Autoscaler's step (replicate, switch, remove after
T_v) are the service's (``controlplane.policies.infaas_scaling``: :func:`instances_for`,
:func:`scaling_cost_usd_per_s`, :func:`model_action`; the service runs the same rules per
instance on live states for apps with ``scaling: infaas``); this module keeps the bookkeeping of
a simulated schedule. The controller sees only past arrivals, so its whole schedule is computed
from the trace first;
then each stretch of one variant is simulated with its instances joining and leaving
(``InstanceSpec`` ready and stop times). Cost: every instance's price from its start to its stop
(or, for instances retired by a switch, to the later of the switch and their last answer).

**Static GPU choice**: the most accurate model on ``emu.gpu``, n = ceil(peak rate / (U Q_v))
instances for the whole trace (the same sizing rule on the trace's known peak), the variant's
batch cap; one simulation.

Caveats: the emulated types' prices are made up (docs/catalog.md); the slowed profile makes the
models about a hundred times heavier than on this machine, so loads are a hundred times lower
than the real models would carry (cost ratios are unaffected, USD per query is not); INFaaS's
interference state, its bin-packing of several variants per worker and model-load times shorter
than a boot are not modelled (a variant instance is a whole instance).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.gear_demo import DemoFamily
from benchmarks.results.cascades import demo_family
from benchmarks.results.common import (
    Context,
    Section,
    experiment_main,
    md_table,
    pyplot,
    save_figure,
)
from benchmarks.results.findings import finding
from controlplane.apps.profiler import emulated_profiles
from controlplane.policies.infaas_scaling import instances_for, model_action, scaling_cost_usd_per_s
from controlplane.policies.tuner import default_boot_s
from controlplane.policies.variants import Requirements, VariantOption, choose
from estimator.capacity import highest_rate
from estimator.catalog import default_catalog
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage, simulate
from estimator.traces import RateProfile, Trace, constant_profile, diurnal_profile, renewal_arrivals

KEY = "infaas"
SEED = 0
TYPES = ("emu.cpu.small", "emu.cpu.large", "emu.gpu")
STATIC_TYPE = "emu.gpu"
# The latency SLO (P99): this multiple of the most accurate model's batch-1 latency at speed 1.
SLO_MULTIPLE = 5.0
UTILISATION = 0.8  # INFaaS's VM-Autoscaler threshold (section 4.2.3)
TICK_S = 1.0  # the Model-Autoscaler's period (section 5)
WINDOW_S = 2.0  # the monitoring daemon's period (section 5)
# lambda x T_load of the ILP's cost of loading an instance (section 4.2.1; INFaaS leaves lambda
# tunable): a newly started instance weighs a quarter more than a running one in the choice.
LOAD_WEIGHT = 0.25
# The saturation probes of a variant, as the gear planner's (controlplane.policies.gears).
PROBE_QUERIES = 2_000
BISECTION_STEPS = 6
PROBE_UTILISATION_CAP = 0.9
# Loads, as multiples of Q_gpu (one GPU instance of the most accurate model, saturated within the
# SLO): a flat low load, and a day-like one, mean x (1 - 0.6 cos(2 pi t / T)) over one period T
# (lowest at the start, crest in the middle: 1.6x the mean) with a 1.5x spike for a twentieth of
# the trace three quarters in.
FLAT_SHARE = 0.25
FLUCTUATING_MEAN_SHARE = 0.9
AMPLITUDE = 0.6
SPIKE_FACTOR = 1.5
SPIKE_AT_SHARE = 0.75
SPIKE_LENGTH_SHARE = 0.05
FLAT_S, FLUCTUATING_S = 300.0, 1200.0
QUICK_FLAT_S, QUICK_FLUCTUATING_S = 60.0, 300.0


# --- variants --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    """A model on an instance type with its batch cap, and what one instance of it serves within
    the SLO: Q_v, and the probes (rate qps, P99 ms) it was found from."""

    model: str
    instance_type: str
    accuracy: float
    price_usd_per_hr: float
    boot_s: float
    batch_cap: int
    saturation_qps: float
    probes: tuple[tuple[float, float], ...]

    @property
    def name(self) -> str:
        return f"{self.model} on {self.instance_type}"

    def instances_for(self, load_qps: float) -> int:
        """n_v = ceil(lambda / (U Q_v)), at least one (the service's policy's arithmetic)."""
        return instances_for(load_qps, self.saturation_qps, UTILISATION)

    def tail_ms_at(self, rate_qps: float) -> float:
        """The P99 of one instance at ``rate_qps``: linear between the probes, infinite past
        the highest one."""
        rates = [r for r, _ in self.probes]
        if rate_qps > rates[-1]:
            return math.inf
        return float(np.interp(rate_qps, rates, [t for _, t in self.probes]))


def variant_profiles(family: DemoFamily) -> dict[str, dict[str, LatencyProfile]]:
    """Every model's profile on every type of :data:`TYPES`: the family's (slowed) profile as
    the speed-1 reference, over each type's speed factor."""
    catalog = default_catalog()
    types = [catalog[t] for t in TYPES]
    reference = [family.profiles[m][family.instance_type] for m in family.models]
    profiles: dict[str, dict[str, LatencyProfile]] = {m: {} for m in family.models}
    for profile in emulated_profiles(reference, types):
        profiles[profile.model][profile.instance_type] = profile
    return profiles


def saturation(
    profile: LatencyProfile, cap: int, slo_ms: float, price_usd_per_hr: float
) -> tuple[float, tuple[tuple[float, float], ...]]:
    """Q_v of one instance with batch cap ``cap``: bisection (:data:`BISECTION_STEPS` halvings)
    over the Poisson rate in [0, u k / L(k)] for the highest rate whose simulated P99 is within
    the SLO, on one fixed pattern of :data:`PROBE_QUERIES` arrivals (common random numbers);
    u = :data:`PROBE_UTILISATION_CAP`, as the gear planner caps its probes. Returns (Q_v, the
    probes sorted by rate); Q_v is 0 when even the lightest probe misses."""
    rng = np.random.default_rng(SEED)
    unit = np.cumsum(rng.exponential(1.0, size=PROBE_QUERIES))
    ones = np.ones(PROBE_QUERIES, dtype=np.int64)
    stage = Stage(
        profile.model,
        (InstanceSpec(profile.instance_type),),
        {profile.instance_type: profile},
        max_batch_queries=cap,
    )

    def p99(rate_qps: float) -> float:
        result = simulate(
            Trace(unit / rate_qps, ones),
            [stage],
            np.random.default_rng(SEED + 1),
            prices_usd_per_hr={profile.instance_type: price_usd_per_hr},
        )
        return float(np.percentile(result.response_ms, 99))

    bound = PROBE_UTILISATION_CAP * cap / (profile.mean_latency_ms(cap) / 1000.0)
    probes: list[tuple[float, float]] = []

    def meets(rate_qps: float) -> bool:
        tail = p99(rate_qps)
        probes.append((rate_qps, tail))
        return tail <= slo_ms

    found = highest_rate(meets, 0.02 * bound, bound, steps=BISECTION_STEPS)
    return found, tuple(sorted(probes))


def make_variants(
    family: DemoFamily, profiles: dict[str, dict[str, LatencyProfile]], slo_ms: float
) -> list[Variant]:
    """Every (model, type) that meets the SLO at all, each with the batch cap (a power of two
    whose mean latency is within the SLO) of the highest Q_v."""
    catalog = default_catalog()
    boot = default_boot_s(catalog, TYPES)
    variants = []
    for model in family.models:
        for itype in TYPES:
            profile = profiles[model][itype]
            price = catalog.price_usd_per_hr(itype)
            caps = [
                k
                for k in (2**i for i in range(13))
                if k <= profile.max_batch_size and profile.mean_latency_ms(k) <= slo_ms
            ]
            found = [(saturation(profile, k, slo_ms, price), k) for k in caps]
            feasible = [(q, probes, k) for (q, probes), k in found if q > 0]
            if not feasible:
                continue  # even a trickle of queries misses the SLO
            q, probes, cap = max(feasible, key=lambda f: (f[0], -f[2]))
            variants.append(
                Variant(
                    model,
                    itype,
                    family.records.model_accuracy(model),
                    price,
                    boot[itype],
                    cap,
                    q,
                    probes,
                )
            )
    return variants


def offers(
    variants: Sequence[Variant], load_qps: float, running: Sequence[int]
) -> list[VariantOption]:
    """What ``choose`` sees at ``load_qps``: each variant with the instances it would need, its
    predicted P99 there and its cost per query (module docstring); ``running[i]`` instances of
    variant i are running or starting now."""
    options = []
    for variant, have in zip(variants, running, strict=True):
        n = variant.instances_for(load_qps)
        # The ILP's cost of the action (n - have instances, lambda T_load = LOAD_WEIGHT) plus
        # the instances kept: C (n + lambda T_load max(0, n - have)).
        kept_usd_per_s = variant.price_usd_per_hr / 3600.0 * have
        action = scaling_cost_usd_per_s(
            variant.price_usd_per_hr, n - have, LOAD_WEIGHT / variant.boot_s, variant.boot_s
        )
        cost = (kept_usd_per_s + action) / max(load_qps, 1.0)
        options.append(
            VariantOption(
                name=variant.name,
                predicted_latency_ms=variant.tail_ms_at(load_qps / n),
                accuracy=variant.accuracy,
                cost_usd_per_query=cost,
            )
        )
    return options


# --- the controller --------------------------------------------------------------------------


@dataclass(slots=True)
class Instance:
    variant: int
    epoch: int
    started_s: float
    ready_s: float
    stop_s: float = math.inf  # removed by a scale-down
    retired_s: float = math.inf  # its variant was switched away from


@dataclass(slots=True)
class Schedule:
    """What the controller did: the variant in force from each epoch's start, every instance,
    and per tick the measured load and the choice."""

    epochs: list[tuple[int, float]] = field(default_factory=list)  # (variant, from_s)
    instances: list[Instance] = field(default_factory=list)
    ticks: list[dict[str, Any]] = field(default_factory=list)
    switches: int = 0
    scale_ups: int = 0
    scale_downs: int = 0


def autoscale(
    variants: Sequence[Variant],
    needs: Requirements,
    arrival_s: np.ndarray,
    duration_s: float,
    initial_qps: float,
) -> Schedule:
    """INFaaS's selection and scaling over a trace (module docstring), from past arrivals only."""
    out = Schedule()
    names = {v.name: i for i, v in enumerate(variants)}

    def alive(variant: int, now_s: float) -> list[Instance]:
        return [
            inst
            for inst in out.instances
            if inst.variant == variant and inst.stop_s > now_s and inst.retired_s > now_s
        ]

    def start(variant: int, count: int, now_s: float, epoch: int, boot: bool) -> None:
        ready = now_s + (variants[variant].boot_s if boot else 0.0)
        out.instances += [Instance(variant, epoch, now_s, ready) for _ in range(count)]

    zero = [0] * len(variants)
    first = names[choose(needs, offers(variants, initial_qps, zero)).option.name]
    start(first, variants[first].instances_for(initial_qps), 0.0, 0, boot=False)
    out.epochs.append((first, 0.0))
    current = first
    pending: tuple[int, float] | None = None  # (variant, ready_s)
    history: list[tuple[float, int, int]] = []  # (time, chosen variant, current's need)
    for now in np.arange(TICK_S, duration_s, TICK_S):
        now = float(now)
        if pending is not None and pending[1] <= now:
            variant, ready = pending
            for inst in alive(current, ready):
                inst.retired_s = ready
            out.epochs.append((variant, ready))
            current, pending = variant, None
        window = min(WINDOW_S, now)
        lo, hi = np.searchsorted(arrival_s, [now - window, now])
        load = float(hi - lo) / window
        running = [len(alive(i, now)) for i in range(len(variants))]
        choice = choose(needs, offers(variants, load, running))
        chosen = names[choice.option.name]
        need = variants[current].instances_for(load)
        history.append((now, chosen, need))
        out.ticks.append(
            {"at_s": now, "load_qps": load, "choice": choice.option.name, "met": choice.met}
        )
        epoch = len(out.epochs) - 1
        if pending is not None:
            wanted = variants[pending[0]].instances_for(load)
            have = len(alive(pending[0], now))
            if chosen == pending[0] and wanted > have:
                start(pending[0], wanted - have, now, epoch + 1, boot=True)
                out.scale_ups += 1
            continue
        hold = variants[current].boot_s
        recent = [h for h in history if h[0] > now - hold]
        action, count = model_action(
            chosen_is_current=chosen == current,
            need=need,
            running=running[current],
            recent_needs=[h[2] for h in recent],
            recent_same_choice=[h[1] == chosen for h in recent],
            held=len(recent) * TICK_S >= hold,
        )
        if action == "switch":
            start(chosen, variants[chosen].instances_for(load), now, epoch + 1, boot=True)
            pending = (chosen, now + variants[chosen].boot_s)
            out.switches += 1
        elif action == "replicate":
            start(current, count, now, epoch, boot=True)
            out.scale_ups += 1
        elif action == "remove":
            # Booting instances go first, then the youngest.
            victims = sorted(alive(current, now), key=lambda i: (-i.ready_s, -i.started_s))
            for inst in victims[:count]:
                inst.stop_s = now
            out.scale_downs += 1
    return out


# --- simulation and cost ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One approach on one load: cost, latency, accuracy, and the cost rate over time."""

    name: str
    cost_usd: float
    queries: int
    p99_ms: float
    attainment: float
    accuracy: float
    variants: dict[str, float]  # share of queries per variant
    usd_per_hr: list[float]  # per second of the trace
    switches: int = 0
    scale_ups: int = 0
    scale_downs: int = 0
    max_instances: int = 0

    def to_data(self) -> dict[str, Any]:
        return {
            "cost_usd": self.cost_usd,
            "usd_per_hr_mean": float(np.mean(self.usd_per_hr)),
            "queries": self.queries,
            "p99_ms": self.p99_ms,
            "attainment": self.attainment,
            "accuracy": self.accuracy,
            "variant_share": self.variants,
            "switches": self.switches,
            "scale_ups": self.scale_ups,
            "scale_downs": self.scale_downs,
            "max_instances": self.max_instances,
        }


def cost_series(
    spans: Sequence[tuple[float, float, float]], duration_s: float
) -> tuple[float, list[float]]:
    """Total USD of instances billed over (start_s, end_s, USD/hr) spans, and the USD/hr billed
    at each whole second of the trace.

    >>> total, per_second = cost_series([(0.0, 3600.0, 1.0), (1.0, 3.0, 2.0)], 4.0)
    >>> round(total, 6), per_second
    (1.001111, [1.0, 3.0, 3.0, 1.0])
    """
    total = sum(price * (end - begin) / 3600.0 for begin, end, price in spans)
    seconds = np.arange(math.ceil(duration_s), dtype=np.float64)
    rate = np.zeros(seconds.size)
    for begin, end, price in spans:
        rate[(seconds >= begin) & (seconds < end)] += price
    return total, [float(r) for r in rate]


def simulate_schedule(
    name: str,
    variants: Sequence[Variant],
    profiles: dict[str, dict[str, LatencyProfile]],
    schedule: Schedule,
    trace: Trace,
    duration_s: float,
    slo_ms: float,
) -> Outcome:
    """Each epoch's arrivals on that epoch's instances; the cost of every instance."""
    n = len(trace)
    response = np.empty(n)
    accuracy = np.empty(n)
    shares: dict[str, float] = {}
    spans = []
    bounds = [start for _, start in schedule.epochs] + [math.inf]
    for k, (variant_index, begin) in enumerate(schedule.epochs):
        variant = variants[variant_index]
        lo, hi = np.searchsorted(trace.arrival_s, [begin, bounds[k + 1]])
        members = [inst for inst in schedule.instances if inst.epoch == k]
        serving = [inst for inst in members if inst.stop_s > inst.ready_s]
        last_s = np.full(len(serving), -math.inf)
        if hi > lo:
            specs = tuple(
                InstanceSpec(variant.instance_type, ready_s=inst.ready_s, stop_s=inst.stop_s)
                for inst in serving
            )
            stage = Stage(
                variant.model,
                specs,
                {variant.instance_type: profiles[variant.model][variant.instance_type]},
                max_batch_queries=variant.batch_cap,
            )
            sub = Trace(trace.arrival_s[lo:hi], trace.batch_size[lo:hi])
            result = simulate(
                sub,
                [stage],
                np.random.default_rng(SEED + 1 + k),
                prices_usd_per_hr={variant.instance_type: variant.price_usd_per_hr},
                qos_ms=slo_ms,
            )
            response[lo:hi] = result.response_ms
            accuracy[lo:hi] = variant.accuracy
            shares[variant.name] = shares.get(variant.name, 0.0) + (hi - lo) / n
            np.maximum.at(last_s, result.instance, result.finish_s)
        last = dict(zip(map(id, serving), last_s, strict=True))
        for inst in members:
            if math.isfinite(inst.stop_s):
                end = inst.stop_s
            elif math.isfinite(inst.retired_s):
                end = max(inst.retired_s, last.get(id(inst), -math.inf))
            else:
                end = max(duration_s, last.get(id(inst), -math.inf))
            spans.append((inst.started_s, end, variant.price_usd_per_hr))
    total, series = cost_series(spans, duration_s)
    counts = [
        sum(1 for i in schedule.instances if i.started_s <= t < min(i.stop_s, i.retired_s))
        for t in np.arange(0.0, duration_s, TICK_S)
    ]
    return Outcome(
        name=name,
        cost_usd=total,
        queries=n,
        p99_ms=float(np.percentile(response, 99)),
        attainment=float(np.mean(response <= slo_ms)),
        accuracy=float(accuracy.mean()),
        variants=shares,
        usd_per_hr=series,
        switches=schedule.switches,
        scale_ups=schedule.scale_ups,
        scale_downs=schedule.scale_downs,
        max_instances=max(counts),
    )


def static_choice(
    variant: Variant,
    profiles: dict[str, dict[str, LatencyProfile]],
    trace: Trace,
    peak_qps: float,
    duration_s: float,
    slo_ms: float,
) -> Outcome:
    """The variant on n = ceil(peak / (U Q_v)) instances for the whole trace."""
    n = variant.instances_for(peak_qps)
    stage = Stage(
        variant.model,
        tuple(InstanceSpec(variant.instance_type) for _ in range(n)),
        {variant.instance_type: profiles[variant.model][variant.instance_type]},
        max_batch_queries=variant.batch_cap,
    )
    result = simulate(
        trace,
        [stage],
        np.random.default_rng(SEED + 1),
        prices_usd_per_hr={variant.instance_type: variant.price_usd_per_hr},
        qos_ms=slo_ms,
    )
    end = max(duration_s, float(result.finish_s.max()))
    total, series = cost_series([(0.0, end, n * variant.price_usd_per_hr)], duration_s)
    response = result.response_ms
    return Outcome(
        name=f"static: {variant.name} x {n}",
        cost_usd=total,
        queries=len(trace),
        p99_ms=float(np.percentile(response, 99)),
        attainment=float(np.mean(response <= slo_ms)),
        accuracy=variant.accuracy,
        variants={variant.name: 1.0},
        usd_per_hr=series,
        max_instances=n,
    )


# --- the experiment --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    name: str
    title: str
    profile: RateProfile
    trace: Trace
    duration_s: float
    peak_qps: float


def make_loads(ctx: Context, gpu_qps: float) -> list[Load]:
    flat_s = QUICK_FLAT_S if ctx.quick else FLAT_S
    fluct_s = QUICK_FLUCTUATING_S if ctx.quick else FLUCTUATING_S
    flat = constant_profile(FLAT_SHARE * gpu_qps)
    mean = FLUCTUATING_MEAN_SHARE * gpu_qps
    fluctuating = diurnal_profile(
        mean,
        fluct_s,
        period_s=fluct_s,
        amplitude=AMPLITUDE,
        spikes=[(SPIKE_AT_SHARE * fluct_s, SPIKE_LENGTH_SHARE * fluct_s, SPIKE_FACTOR)],
    )
    loads = []
    for k, (name, title, profile, duration) in enumerate(
        (
            ("flat", f"flat {FLAT_SHARE * gpu_qps:.0f} qps", flat, flat_s),
            (
                "fluctuating",
                f"day-like, mean {mean:.0f} qps, {AMPLITUDE:g} amplitude, {SPIKE_FACTOR:g}x spike",
                fluctuating,
                fluct_s,
            ),
        )
    ):
        rng = np.random.default_rng(SEED + 10 * k)
        arrival = renewal_arrivals(profile, duration, 1.0, rng)
        peak = float(np.max(profile.rate_at(np.arange(0.0, duration, 0.1))))
        trace = Trace(arrival, np.ones(arrival.size, dtype=np.int64))
        loads.append(Load(name, title, profile, trace, duration, peak))
    return loads


def apps(family: DemoFamily, slo_ms: float) -> list[tuple[str, Requirements]]:
    """Two apps with the same latency SLO: one whose floor the second most accurate model meets
    (its accuracy rounded down to half a point), one that needs the most accurate model's."""
    ranked = sorted(family.records.model_accuracy(m) for m in family.models)
    second = math.floor(ranked[-2] * 200.0 + 1e-9) / 200.0
    return [
        (f"floor {100 * second:g}%", Requirements("digits", slo_ms, second)),
        (
            f"floor {100 * ranked[-1]:.2f}% (the best model)",
            Requirements("digits", slo_ms, ranked[-1]),
        ),
    ]


def run(ctx: Context) -> Section:
    started = time.perf_counter()
    loaded = demo_family(ctx)
    family = loaded.family
    profiles = variant_profiles(family)
    top = family.most_accurate
    catalog = default_catalog()
    speed_1 = family.profiles[top][family.instance_type].mean_latency_ms(1)
    slo_ms = float(f"{SLO_MULTIPLE * speed_1:.3g}")
    ctx.log(f"planning the {len(family.models) * len(TYPES)} variants (SLO {slo_ms:g} ms)")
    variants = make_variants(family, profiles, slo_ms)
    static = next(v for v in variants if v.model == top and v.instance_type == STATIC_TYPE)
    loads = make_loads(ctx, static.saturation_qps)
    needs = apps(family, slo_ms)
    results: list[dict[str, Any]] = []
    for load in loads:
        ctx.log(f"{load.name} load: {len(load.trace):,} queries over {load.duration_s:g} s")
        baseline = static_choice(
            static, profiles, load.trace, load.peak_qps, load.duration_s, slo_ms
        )
        for label, need in needs:
            ctx.log(f"  model-less, {label}: autoscaling and simulating")
            schedule = autoscale(
                variants,
                need,
                load.trace.arrival_s,
                load.duration_s,
                float(load.profile.rate_at(0.0)),
            )
            outcome = simulate_schedule(
                f"model-less, {label}",
                variants,
                profiles,
                schedule,
                load.trace,
                load.duration_s,
                slo_ms,
            )
            ctx.log(
                f"    ${outcome.cost_usd:.4f} vs static ${baseline.cost_usd:.4f}, attainment"
                f" {100 * outcome.attainment:.2f}% vs {100 * baseline.attainment:.2f}%"
            )
            results.append(
                {"load": load, "app": label, "needs": need, "infaas": outcome, "static": baseline}
            )
    figures = [_bars_figure(ctx, results), _cost_figure(ctx, loads, results)]
    return Section(
        key=KEY,
        title="INFaaS: model-less selection against a static GPU choice",
        what=_what(family, loaded.note(), variants, static, loads, slo_ms, catalog),
        rerun="python -m benchmarks.results.infaas",
        body=_body(variants, results),
        summary=_summary(results),
        data=_data(family, variants, static, loads, results, slo_ms, time.perf_counter() - started),
        figures=figures,
    )


def _what(
    family: DemoFamily,
    family_note: str,
    variants: Sequence[Variant],
    static: Variant,
    loads: Sequence[Load],
    slo_ms: float,
    catalog: Any,
) -> str:
    load_lines = "\n".join(
        f"  - *{load.name}*: {load.title}; {len(load.trace):,} Poisson arrivals over"
        f" {load.duration_s:g} s, peak rate {load.peak_qps:.0f} qps"
        for load in loads
    )
    types = ", ".join(f"`{t}`" for t in TYPES)
    boot = ", ".join(f"{s:g} (`{t}`)" for t, s in default_boot_s(catalog, TYPES).items())
    top = family.most_accurate
    top_ms = family.profiles[top][family.instance_type].mean_latency_ms(1)
    speeds = ", ".join(f"{catalog[t].speed_factor:g}" for t in TYPES)
    prices = ", ".join(f"${catalog.price_usd_per_hr(t):g}/hr" for t in TYPES)
    return f"""
- Family: {family.source}; {family_note}.
  Every model on {types} (speed factors {speeds}, made-up prices {prices}), the family's slowed
  profile (`{top}` {top_ms:.3g} ms at batch 1 at speed 1) over the speed factor:
  {len(variants)} variants meet the SLO at all.
- SLO: P99 <= {slo_ms:g} ms ({SLO_MULTIPLE:g}x `{family.most_accurate}` at batch 1 at speed 1);
  attainment = share of queries answered within it. Two apps with that SLO and different
  accuracy floors (see the tables).
- Loads (seeded, Q_gpu = {static.saturation_qps:.0f} qps, what one `{static.name}` instance
  carries within the SLO):
{load_lines}
- Model-less: `controlplane.policies.variants.choose` every {TICK_S:g} s on the load of the last
  {WINDOW_S:g} s, each variant with ceil(load / ({UTILISATION:g} Q_v)) instances and its cost
  per query, an instance still to start weighing {1 + LOAD_WEIGHT:g}x (the ILP's lambda T_load
  = {LOAD_WEIGHT:g}); new instances boot for {boot} s, billed from their start; scale-downs and
  downgrades wait the type's boot time; a switch keeps the old variant serving until the new
  one is ready (the full model in the module docstring of `benchmarks/results/infaas.py`).
- Static GPU choice: what a user without model-less serving picks, the most accurate model
  pinned on the GPU type, ceil(peak / ({UTILISATION:g} Q_gpu)) instances for the whole trace;
  the same for both apps.
- Cost: USD over the trace, every instance billed from its start to its stop.
- Caveats: the prices of the emulated types are made up; the slowed profiles make loads about a
  hundred times lower than the real models would carry (ratios hold, USD per query does not);
  no interference, no co-location of variants on a worker, model loading as slow as a boot.
"""


def _body(variants: Sequence[Variant], results: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            v.name,
            f"{100 * v.accuracy:.2f}%",
            f"{v.price_usd_per_hr:g}",
            v.batch_cap,
            f"{v.saturation_qps:.0f}",
            f"{v.price_usd_per_hr / (UTILISATION * v.saturation_qps) * 1000:.3f}",
        ]
        for v in sorted(variants, key=lambda v: (v.model, v.instance_type))
    ]
    table = md_table(
        ["variant", "accuracy", "USD/hr", "batch cap", "Q_v qps", "USD/hr per 1000 qps at 80%"],
        rows,
        "1,2,3,4,5",
    )
    outcome_rows = []
    for r in results:
        for o in (r["static"], r["infaas"]):
            outcome_rows.append(
                [
                    r["load"].name,
                    r["app"],
                    o.name,
                    f"{o.cost_usd:.4f}",
                    f"{o.cost_usd / r['load'].duration_s * 3600:.3f}",
                    f"{100 * o.attainment:.2f}%",
                    f"{o.p99_ms:.1f}",
                    f"{100 * o.accuracy:.2f}%",
                    o.max_instances,
                    f"{o.switches} / {o.scale_ups} / {o.scale_downs}",
                    ", ".join(
                        f"{name} {100 * share:.0f}%"
                        for name, share in sorted(o.variants.items(), key=lambda x: -x[1])
                    ),
                ]
            )
    outcomes = md_table(
        [
            "load",
            "app",
            "approach",
            "cost USD",
            "mean USD/hr",
            "within SLO",
            "P99 ms",
            "accuracy",
            "most instances",
            "switches / ups / downs",
            "queries per variant",
        ],
        outcome_rows,
        "3,4,5,6,7,8",
    )
    return (
        "### Variants (one instance each, Q_v by bisection in the simulator)\n\n"
        + table
        + "\n\n### Cost and SLO attainment\n\n"
        + outcomes
    )


def _summary(results: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for r in results:
        static, infaas = r["static"], r["infaas"]
        ratio = static.cost_usd / infaas.cost_usd
        than = (
            finding(KEY, "cheaper", ratio=f"{ratio:.1f}")
            if ratio >= 1
            else finding(KEY, "dearer", ratio=f"{1 / ratio:.1f}")
        )
        lines.append(
            finding(
                KEY,
                "cost_and_attainment",
                load=r["load"].name,
                title=r["load"].title,
                app=r["app"],
                infaas_cost_usd=f"{infaas.cost_usd:.4f}",
                static_cost_usd=f"{static.cost_usd:.4f}",
                static_variant=next(iter(static.variants)),
                than=than,
                infaas_within=f"{100 * infaas.attainment:.2f}",
                static_within=f"{100 * static.attainment:.2f}",
            )
        )
    return lines


def _data(
    family: DemoFamily,
    variants: Sequence[Variant],
    static: Variant,
    loads: Sequence[Load],
    results: Sequence[dict[str, Any]],
    slo_ms: float,
    seconds: float,
) -> dict[str, Any]:
    return {
        "family": family.source,
        "slo_ms": slo_ms,
        "settings": {
            "utilisation": UTILISATION,
            "tick_s": TICK_S,
            "window_s": WINDOW_S,
            "load_weight": LOAD_WEIGHT,
            "boot_s": default_boot_s(default_catalog(), TYPES),
        },
        "variants": [
            {
                "model": v.model,
                "instance_type": v.instance_type,
                "accuracy": v.accuracy,
                "price_usd_per_hr": v.price_usd_per_hr,
                "batch_cap": v.batch_cap,
                "saturation_qps": v.saturation_qps,
            }
            for v in variants
        ],
        "static_variant": static.name,
        "loads": [
            {
                "name": load.name,
                "title": load.title,
                "queries": len(load.trace),
                "duration_s": load.duration_s,
                "peak_rate_qps": load.peak_qps,
                "seed": SEED,
            }
            for load in loads
        ],
        "results": [
            {
                "load": r["load"].name,
                "app": r["app"],
                "min_accuracy": r["needs"].min_accuracy,
                "static": r["static"].to_data(),
                "model_less": r["infaas"].to_data(),
                "cost_ratio_static_over_model_less": r["static"].cost_usd / r["infaas"].cost_usd,
            }
            for r in results
        ],
        "seconds": seconds,
    }


def _cost_figure(ctx: Context, loads: Sequence[Load], results: Sequence[dict[str, Any]]) -> Any:
    plt = pyplot()
    load = loads[-1]
    mine = [r for r in results if r["load"] is load]
    fig, (load_ax, cost_ax) = plt.subplots(2, 1, figsize=(8.0, 5.4), sharex=True)
    seconds = np.arange(math.ceil(load.duration_s))
    counts = np.bincount(
        np.minimum(load.trace.arrival_s.astype(np.int64), seconds.size - 1),
        minlength=seconds.size,
    )
    load_ax.plot(seconds, counts, color="black", linewidth=0.8, label="arrivals per second")
    load_ax.set_ylabel("load (qps)")
    load_ax.set_title(f"The {load.name} load and what each approach pays for it")
    load_ax.legend(fontsize=8)
    cost_ax.plot(
        seconds,
        mine[0]["static"].usd_per_hr,
        color="tab:red",
        label=mine[0]["static"].name,
    )
    for r, color in zip(mine, ("tab:blue", "tab:green", "tab:purple"), strict=False):
        cost_ax.plot(seconds, r["infaas"].usd_per_hr, color=color, label=r["infaas"].name)
    cost_ax.set_xlabel("time (s)")
    cost_ax.set_ylabel("instances billed (USD/hr)")
    cost_ax.legend(fontsize=8)
    return save_figure(
        ctx,
        fig,
        f"{KEY}-cost-over-time.png",
        f"The {load.name} load (top) and the USD per hour each approach is billing (bottom).",
    )


def _bars_figure(ctx: Context, results: Sequence[dict[str, Any]]) -> Any:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    labels = [f"{r['load'].name} ({r['load'].duration_s:g} s)\n{r['app']}" for r in results]
    x = np.arange(len(results))
    width = 0.38
    static = [r["static"].cost_usd for r in results]
    infaas = [r["infaas"].cost_usd for r in results]
    ax.bar(x - width / 2, static, width, color="tab:red", label="static GPU choice")
    ax.bar(x + width / 2, infaas, width, color="tab:blue", label="model-less (INFaaS)")
    for k, r in enumerate(results):
        for dx, o in ((-width / 2, r["static"]), (width / 2, r["infaas"])):
            ax.text(
                k + dx,
                o.cost_usd,
                f"{100 * o.attainment:.1f}%",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("cost over the trace (USD)")
    ax.set_title("Cost per load and app (labels: share of queries within the SLO)")
    ax.legend(fontsize=8)
    return save_figure(
        ctx,
        fig,
        f"{KEY}-cost.png",
        "Cost of each load for each app, static GPU choice against model-less selection; the"
        " label on each bar is its SLO attainment.",
    )


def main(argv: list[str] | None = None) -> int:
    return experiment_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
