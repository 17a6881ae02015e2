"""INFaaS's autoscaling (model level and VM level) as a pure policy over the variants' states.

This module owns what INFaaS (Romero et al., USENIX ATC'21, section 4.2) decides when the load
changes, for an app whose spec says ``scaling: infaas``: a pure function of a context record
(:func:`decide`: :class:`ScalingContext` and the :class:`ScalerState` it reached, in; decisions,
the fleet and the next state, out), and the arithmetic the results experiment shares with it
(:func:`instances_for`, :func:`scaling_cost_usd_per_s`, :func:`model_action`).

Vocabulary. A *variant* is a model of the app on an instance type (its batch cap is the
dispatcher's); an *instance* is one machine of the app, and every instance serves every model
of the app it is placed on. Each (model, instance) pair has the serving loop's INFaaS state
(:mod:`controlplane.serving.states`): *active*, *overloaded* (the model cannot keep up with its
load: within the state's window admission refused more of its samples than the SLO lets it miss,
or its arrivals reached its profiled capacity, or its queue takes longer than the SLO to drain
for a monitoring period) or *interfered* (measured
service times over the profile); a variant no running instance serves is *inactive*, and costs
its loading latency T_load (its type's start-up: every worker loads the whole family as it
starts) before it serves. Q_v is what one instance of variant v serves (qps, from its profile),
U the utilisation target (INFaaS's VM-Autoscaler threshold, 80%, section 4.2.3), lambda the
weight of loading latency (section 4.2.1).

The rules of :func:`decide`, per model m of the app, in order, at most one scaling action per
tick:

1. **Relieve interference** (section 4.1, "Mitigating performance degradation"). An instance
   interfered on m while another instance of m is not has its load moved: the dispatcher leaves
   it out of matching (its share of m's traffic drops to 0) and its capacity is not counted.
   One ``infaas_relieve`` decision per (model, instance) each time it becomes interfered. When
   *every* instance of m is interfered, each counts at ``interfered_share`` of Q_v (the
   interference margin: measured times are at least 1.5x the profile) and m needs capacity
   (VM-Autoscaler rule 2: "variants ... in the Interfered state across all workers").
2. **Scale up** (section 4.2.2, "Scaling up algorithm"). m needs capacity when one of its
   instances is *overloaded* and no instance is still loading, or when its measured load
   lambda_m exceeds U times its capacity, the capacity of the instances still loading counted
   (Constraint 1; they serve once their T_load is over, so they are not asked for twice).
   A scale-up that m's overload takes part in says so in its reason, with what the state was
   judged on (the context's ``overload``: refusals, arrival rate, backlog). An overload verdict
   whose window (the serving loop's, 10 s) reaches back before the app's last drain does not
   scale up alone: it was judged partly on the fleet before the drain, whose rule found the
   load gone (the state's refusals at a higher capacity outlive the load that caused them by
   up to the window, and the fleet would grow back at once); the load test still holds.
   The options are every variant (m, t) that meets the SLO at all (Q > 0; Constraint 2):
   delta_t = max(1, ceil((lambda_m / U - capacity) / Q_{m,t})) new instances of t, priced by
   the ILP's objective, C_t (delta_t + lambda T_load_t delta_t) (:func:`scaling_cost_usd_per_s`,
   section 4.2.1), within the budget and the spec's ``max_counts`` (Constraint 3: here the
   budget is the resource, a hard limit). The cheapest option that covers the need is taken;
   when none fits whole, the one adding the most capacity that fits (``infaas_budget_capped``
   says what was missing); when not even one instance fits, only ``infaas_budget_capped``,
   naming what stops it (the budget, the caps reached, or both).
   Taking a variant that is already loaded is ``infaas_replicate`` (model-horizontal); taking
   an inactive one is ``infaas_upgrade`` (model-vertical: another type, paying its loading
   latency). Adding an instance is the VM-level action (VM-Autoscaler rule 1): every variant
   instance here is a whole instance. The capacity is that of every instance that serves, so a
   scale-up first raises each type's count in the fleet to the instances of it that serve (a
   drain the reconciler has not carried out yet, deferred by the disruption budget, is taken
   back): the decision's counts, cost and capacity are of one fleet, and the ``delta`` it adds
   are launched (from the policy's lower count, a "+1" bought nothing where the drained
   instance still ran, and the next tick asked again).
3. **Drain** (section 4.2.2, "Scaling down algorithm", and VM-Autoscaler). An instance is
   *underused* when no model it serves is overloaded, its busy share (when known) is at most U, and
   without it every model it serves still carries its load at U_drain < U,
   (Q_m - Q_{m,t}) U_drain >= lambda_m (``drain_utilisation``, 0.7: the band between the two
   thresholds is the policy's hysteresis; a drain judged at U itself left a load just under U times
   the rest's capacity at U, and a load a little over it, 4 s later, bought the instance back,
   every hold while the load sat there), and no model it serves would be left at most a capacity it
   was found short at (``short_at`` in the state: overloaded at load L on the capacity that served,
   or its load over U times its capacity) unless its load is now at most U_drain / U of L (the same
   band, where the profiles' capacity was not what served: one cpu of Q 10 overloaded at 6.5 qps,
   two were drained to one by the profiles at 0.7 x 10, and the overload bought it back, every
   hold). A capacity short at L is short at L on less (each capacity is kept apart, with its least
   load); one the model has since carried (neither overloaded nor short at U_drain / U of L or
   more, on no more capacity, what is loading included), or not found short again for
   ``short_memory_s`` (300 s: a burst's backlog verdict also makes one, and kept for good each
   bought an instance that stayed), is forgotten. A type that has had an underused instance for the
   hold (``hold_s``; INFaaS's T_v, the variant's loading latency, when ``None``), with no scaling
   action within the hold, nothing of it still loading and no drain still to be carried out (the
   test counts every instance that serves: judged on them, a second drain the reconciler had not
   caught up with took the fleet below the load; which drains are still to be carried out is the
   reconciler's word, the context's ``held_back``: the instances it keeps past the fleet's count,
   or a fleet its last pass has not read yet, not a spot move's or an interruption's replacements
   or a stand-in serving beside the fleet), is drained: ``infaas_drain``, its count down by one,
   the most expensive type first (so a cheaper variant that carries the load alone is kept: a
   downgrade). The hold is the type's, not the instance's: the reconciler picks which instance of
   the type ends, and an instance's own clock, restarted for the one the decision named, let a
   cheaper type's older clock win the next drain (an idle app ended on its dearest type). The app
   keeps at least one instance.

A *stand-in* (an instance of type C the reconciler runs in place of one of type G of the fleet,
the context's ``held_back.stand_ins``) counts as present for G, by its share (k smaller ones
1/k each), never for C: its capacity is what it serves (Q_C), G is not loading, a take-back
raises G (never C, and a part of one is not rounded up), and a drain of G takes off, in the
underused test, the most one count of G serves.

Every decision carries its reason (one line, with the numbers) and the numbers as a mapping.

>>> instances_for(load_qps=90.0, saturation_qps=50.0, utilisation=0.8)
3
>>> round(scaling_cost_usd_per_s(3.6, delta=2, load_weight_per_s=0.01, loading_s=30.0), 6)
0.0026
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from estimator.numbers import money, plain

__all__ = [
    "DEFAULT_DRAIN_UTILISATION",
    "DEFAULT_LOAD_WEIGHT_PER_S",
    "DEFAULT_SHORT_MEMORY_S",
    "DEFAULT_UTILISATION",
    "HeldBack",
    "InstanceState",
    "ModelAction",
    "OverloadNote",
    "ScalerState",
    "ScalingConfig",
    "ScalingContext",
    "ScalingDecision",
    "ServedInstance",
    "StandIn",
    "VariantProfile",
    "decide",
    "initial_state",
    "instances_for",
    "model_action",
    "scaling_cost_usd_per_s",
]

InstanceState = Literal["inactive", "active", "overloaded", "interfered"]

# INFaaS's VM-Autoscaler threshold (section 4.2.3): "we empirically set the threshold to 80%".
DEFAULT_UTILISATION = 0.8
# lambda of the ILP's cost (section 4.2.1; INFaaS leaves it tunable): at 1/120 per s a CPU
# instance's 30 s of loading weighs a quarter of its price, as the results experiment's weight.
DEFAULT_LOAD_WEIGHT_PER_S = 1.0 / 120.0
# A drain leaves the rest at most this busy (U's 0.8 less a band of 0.1, the hysteresis between
# the scale-up's threshold and the drain's: one instance of Q 10 is added past 8 qps and the
# second of two taken away below 7).
DEFAULT_DRAIN_UTILISATION = 0.7
# An instance interfered everywhere serves at most 1 / (1 + margin) of its profile (the state's
# margin, 0.5: controlplane.serving.states.DEFAULT_MARGIN).
DEFAULT_INTERFERED_SHARE = 1.0 / 1.5

# How long a capacity a model was found short at holds drains to it back, unless found short
# again (s): the overload's backlog verdict also fires on a burst, and kept for good, each one
# bought an instance that stayed; forgotten at once, the drain and the overload took turns
# every hold. At a steady load one capacity can never carry, one drain and replicate a memory.
DEFAULT_SHORT_MEMORY_S = 300.0

_EPS = 1e-9
# Capacities and loads compared in the drain's guard (qps: sums of profiles' rates).
_TOL = 1e-6


@dataclass(frozen=True, slots=True)
class VariantProfile:
    """A variant: a model on an instance type, what one instance of it serves (Q_v, qps; 0
    when its profile misses the SLO even alone) and its loading latency (s)."""

    model: str
    instance_type: str
    saturation_qps: float
    loading_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.saturation_qps) and self.saturation_qps >= 0):
            raise ValueError(f"{self.model} on {self.instance_type}: saturation_qps must be >= 0")
        if not (math.isfinite(self.loading_s) and self.loading_s >= 0):
            raise ValueError(f"{self.model} on {self.instance_type}: loading_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ServedInstance:
    """A running instance of the app as the serving loop sees it: its type, the state of each
    model it serves, and its busy share of the last minute (None: not known yet)."""

    instance_id: str
    instance_type: str
    states: Mapping[str, InstanceState]
    utilisation_share: float | None = None


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """The policy's knobs: U, the drain's U_drain (at most U), lambda (per s), the capacity
    share of an instance interfered everywhere, the hold before a drain (None: the variant's
    loading latency, INFaaS's T_v), and how long a capacity a model was found short at holds
    drains to it back (s)."""

    utilisation: float = DEFAULT_UTILISATION
    drain_utilisation: float = DEFAULT_DRAIN_UTILISATION
    load_weight_per_s: float = DEFAULT_LOAD_WEIGHT_PER_S
    interfered_share: float = DEFAULT_INTERFERED_SHARE
    hold_s: float | None = None
    short_memory_s: float = DEFAULT_SHORT_MEMORY_S

    def __post_init__(self) -> None:
        if not 0 < self.utilisation <= 1:
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation!r}")
        if not 0 < self.drain_utilisation <= self.utilisation:
            raise ValueError(
                f"drain_utilisation must be in (0, utilisation = {self.utilisation!r}], got"
                f" {self.drain_utilisation!r}"
            )
        if not (math.isfinite(self.load_weight_per_s) and self.load_weight_per_s >= 0):
            raise ValueError(f"load_weight_per_s must be >= 0, got {self.load_weight_per_s!r}")
        if not 0 <= self.interfered_share <= 1:
            raise ValueError(f"interfered_share must be in [0, 1], got {self.interfered_share!r}")
        if self.hold_s is not None and not (math.isfinite(self.hold_s) and self.hold_s >= 0):
            raise ValueError(f"hold_s must be >= 0, got {self.hold_s!r}")
        if not (math.isfinite(self.short_memory_s) and self.short_memory_s >= 0):
            raise ValueError(f"short_memory_s must be >= 0, got {self.short_memory_s!r}")


@dataclass(frozen=True, slots=True)
class OverloadNote:
    """What a model's *overloaded* state was judged on, as the serving loop says it: one phrase
    per criterion that holds (with its numbers) and the numbers as a mapping
    (:class:`controlplane.serving.states.Overload`)."""

    reasons: tuple[str, ...]
    numbers: Mapping[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StandIn:
    """An instance the reconciler runs in place of one of another type of the fleet (its rule
    11's stand-in for a type the provider is short of, or rule 10's move off a risen spot
    price, docs/spot.md): the type it counts as (``stands_for``) and how much of one of it
    (``share``: 1/k for each of k smaller instances that together serve as much, else 1)."""

    stands_for: str
    share: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0 < self.share <= 1):
            raise ValueError(f"a stand-in for {self.stands_for}: share must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class HeldBack:
    """What the reconciler's last pass over the app did with the policy's fleet: the fleet it
    brought the app toward (``fleet``, counts by type, as the policy wanted it then) and, by the
    type it counts them as (a stand-in as the type it stands in for), the serving instances it
    kept past that fleet's count (``counts``: rule 5's guards, the disruption budget and the last
    serving instance). Those are the policy's drains still to be carried out; an instance that
    serves beside the fleet for the reconciler (a spot move's or an interruption's replacement
    with the row it replaces, a stand-in of another type) is none of them. ``stand_ins``: the
    app's instances that stand in for a type of the fleet (instance id -> :class:`StandIn`),
    which the policy counts as present for that type (by their share), never as their own."""

    fleet: Mapping[str, int]
    counts: Mapping[str, int] = field(default_factory=dict)
    stand_ins: Mapping[str, StandIn] = field(default_factory=dict)

    def pending(self, fleet: Mapping[str, int]) -> bool:
        """Whether a drain of the policy's (whose fleet is ``fleet`` now) is still to be carried
        out: the pass has not read ``fleet`` yet (a drain since), or kept instances past it."""
        wanted = {t: n for t, n in fleet.items() if n > 0}
        seen = {t: n for t, n in self.fleet.items() if n > 0}
        return seen != wanted or any(n > 0 for n in self.counts.values())


@dataclass(frozen=True, slots=True)
class ScalingContext:
    """What one tick sees for one app: the time, the measured load of each model (qps, in the
    queries Q_v counts: what the model's queue receives), the running instances, the
    variants, prices, the budget (USD/hr, a hard limit), the spec's caps per type, per
    overloaded model what its state was judged on, and what the reconciler still holds back of
    the policy's drains (``held_back``; ``None``, not known: a type with more instances serving
    than the fleet wants reads as a drain still to be carried out)."""

    app: str
    now_s: float
    load_qps: Mapping[str, float]
    instances: Sequence[ServedInstance]
    variants: Sequence[VariantProfile]
    prices_usd_per_hr: Mapping[str, float]
    budget_usd_per_hr: float
    max_counts: Mapping[str, int] = field(default_factory=dict)
    overload: Mapping[str, OverloadNote] = field(default_factory=dict)
    held_back: HeldBack | None = None


@dataclass(frozen=True, slots=True)
class ScalerState:
    """What the policy carries from tick to tick: the fleet it wants (counts by type, what the
    reconciler launches or terminates toward), the last scaling action, since when each type
    has had an underused instance, the (model, instance) pairs already relieved, the last cap
    said and the last drain."""

    fleet: Mapping[str, int]
    last_change_s: float
    underused_since_s: Mapping[str, float] = field(default_factory=dict)
    relieved: frozenset[tuple[str, str]] = frozenset()
    capped: tuple[str, str, int] | None = None
    # None: no drain yet. An overload verdict whose window reaches back before it was judged on
    # the fleet before the drain (rule 2).
    drained_s: float | None = None
    # Per model, the capacities (qps) it was found short at, with the least load (qps) and the
    # last time (s) it was (rule 3's guard): a drain that leaves it at most such a capacity
    # waits for the load to fall well below.
    short_at: Mapping[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One decision: its action (``infaas_replicate``, ``infaas_upgrade``, ``infaas_drain``,
    ``infaas_relieve``, ``infaas_budget_capped``), the model and type it concerns, the instance
    (relieve, drain), the count added or removed, a one-line reason and its numbers."""

    action: str
    model: str
    instance_type: str
    count: int
    reason: str
    numbers: Mapping[str, object]
    instance_id: str | None = None


def initial_state(fleet: Mapping[str, int], now_s: float) -> ScalerState:
    """The state of a policy starting from ``fleet`` (an applied plan's) at ``now_s``."""
    return ScalerState({t: n for t, n in fleet.items() if n > 0}, now_s)


def instances_for(load_qps: float, saturation_qps: float, utilisation: float) -> int:
    """n_v = ceil(lambda / (U Q_v)), at least one: the instances of a variant that carry
    ``load_qps`` at utilisation U (INFaaS's Constraint 1 with the VM-Autoscaler's threshold)."""
    if saturation_qps <= 0:
        raise ValueError("a variant that serves nothing within the SLO carries no load")
    return max(1, math.ceil(load_qps / (utilisation * saturation_qps) - _EPS))


def scaling_cost_usd_per_s(
    price_usd_per_hr: float, delta: int, load_weight_per_s: float, loading_s: float
) -> float:
    """INFaaS's cost of a scaling action (section 4.2.1): C (delta + lambda T_load max(delta,
    0)), C the type's price per second, delta the instances added (negative: removed)."""
    return price_usd_per_hr / 3600.0 * (delta + load_weight_per_s * loading_s * max(delta, 0))


ModelAction = Literal["keep", "replicate", "switch", "remove"]


def model_action(
    *,
    chosen_is_current: bool,
    need: int,
    running: int,
    recent_needs: Sequence[int],
    recent_same_choice: Sequence[bool],
    held: bool,
) -> tuple[ModelAction, int]:
    """The Model-Autoscaler's step for an app served by one variant at a time (section 4.2.2),
    as the results experiment runs it: the variant selection chose a variant at the current
    load (``chosen_is_current``: the one in force), the one in force needs ``need`` instances
    and runs ``running``; ``recent_*`` are the last T_v's ticks (the needs of the variant in
    force, and whether the tick chose the variant chosen now), ``held`` whether they span T_v.
    Returns the action and its count:

    - another variant is taken at once when the current one is short of instances (an upgrade),
      else only when every tick of the last T_v chose it (a downgrade): ``switch``;
    - same variant, short: ``replicate`` the missing instances;
    - same variant, more than the largest need of the last T_v, once T_v has passed:
      ``remove`` the extra (scaling down waits T_v, the loading latency);
    - else ``keep``.

    >>> model_action(chosen_is_current=True, need=3, running=2, recent_needs=[3],
    ...              recent_same_choice=[True], held=False)
    ('replicate', 1)
    >>> model_action(chosen_is_current=True, need=1, running=3, recent_needs=[2, 1],
    ...              recent_same_choice=[True, True], held=True)
    ('remove', 1)
    """
    short = need > running
    if not chosen_is_current and (short or (held and all(recent_same_choice))):
        return "switch", 0
    if short:
        return "replicate", need - running
    keep = max(recent_needs, default=need)
    if running - keep > 0 and held:
        return "remove", running - keep
    return "keep", 0


# --- the service's policy ----------------------------------------------------------------------


def _cost_usd_per_hr(fleet: Mapping[str, int], prices: Mapping[str, float]) -> float:
    """What ``fleet`` costs, without the binary float's noise (:func:`estimator.numbers.money`:
    the decisions' numbers read 0.30000000000000004 USD/hr for three instances at 0.1)."""
    return money(sum(n * prices.get(t, 0.0) for t, n in fleet.items()))


def decide(
    ctx: ScalingContext, state: ScalerState, config: ScalingConfig | None = None
) -> tuple[list[ScalingDecision], ScalerState]:
    """One tick of INFaaS's autoscaling for one app (the module docstring's rules, one function
    each: :func:`_relieve_interference`, :func:`_scale_up`, :func:`_drain`); returns the
    decisions and the next state, whose ``fleet`` the reconciler keeps.

    >>> v = [VariantProfile("m", "cpu", 10.0, 30.0), VariantProfile("m", "gpu", 40.0, 60.0)]
    >>> ctx = ScalingContext("a", 100.0, {"m": 12.0}, [ServedInstance("i-1", "cpu",
    ...     {"m": "overloaded"}, 1.0)], v, {"cpu": 0.1, "gpu": 0.5}, budget_usd_per_hr=1.0)
    >>> decisions, after = decide(ctx, initial_state({"cpu": 1}, 0.0))
    >>> [(d.action, d.instance_type, d.count) for d in decisions], dict(after.fleet)
    ([('infaas_replicate', 'cpu', 1)], {'cpu': 2})
    """
    tick = _Tick.of(ctx, state, config or ScalingConfig())
    relieved = _relieve_interference(tick, state.relieved)
    tick.short_at = _found_short(tick, state.short_at)
    scaled_up, capped = _scale_up(tick, state.capped)
    underused_since: dict[str, float] = {}
    drained = False
    if not scaled_up:
        underused_since, underused = _underused(tick, state)
        drained = _drain(tick, state, underused_since, underused)
    fleet = {t: n for t, n in tick.fleet.items() if n > 0}
    return tick.decisions, replace(
        state,
        fleet=fleet,
        last_change_s=ctx.now_s if scaled_up or drained else state.last_change_s,
        # A scale-up restarts every hold: the load that needed it is recent.
        underused_since_s={} if scaled_up else underused_since,
        relieved=frozenset(relieved),
        capped=capped,
        drained_s=ctx.now_s if drained else state.drained_s,
        short_at=tick.short_at,
    )


@dataclass(slots=True)
class _Tick:
    """What the rules of one tick share: the context, Q and T_load per variant, the fleet the
    rules change (counts by type), the instances still loading per type, the capacity each
    model counts now (after rule 1) and each (model, instance)'s part of it, and the decisions
    so far."""

    ctx: ScalingContext
    config: ScalingConfig
    q: dict[tuple[str, str], float]
    loading: dict[tuple[str, str], float]
    models: list[str]
    types: list[str]
    fleet: dict[str, int]
    pending: dict[str, float]
    ready: dict[str, float] = field(default_factory=dict)
    drained_s: float | None = None
    # Instance id -> the stand-in it is (the type it counts as, how much of one); else its own.
    counted_as: dict[str, StandIn] = field(default_factory=dict)
    capacity_now: dict[str, float] = field(default_factory=dict)
    counted: dict[tuple[str, str], float] = field(default_factory=dict)
    decisions: list[ScalingDecision] = field(default_factory=list)
    # Per model, the capacities it was found short at, the least load and when (rule 3's guard).
    short_at: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, ctx: ScalingContext, state: ScalerState, config: ScalingConfig) -> _Tick:
        fleet = dict(state.fleet)
        stand_ins = ctx.held_back.stand_ins if ctx.held_back is not None else {}
        counted_as: dict[str, StandIn] = {}
        ready: dict[str, float] = {}
        for inst in ctx.instances:
            # A stand-in is present for the type it stands in for (by its share), not for its
            # own: counted as its own, the type it stands for read as still loading (never
            # drained; its capacity counted again as loading) and its own as serving past the
            # fleet (taken into the fleet by a scale-up, and bought).
            stand_in = stand_ins.get(inst.instance_id)
            if stand_in is not None and stand_in.stands_for != inst.instance_type:
                counted_as[inst.instance_id] = stand_in
            counted = counted_as.get(inst.instance_id, StandIn(inst.instance_type))
            ready[counted.stands_for] = ready.get(counted.stands_for, 0.0) + counted.share
        pending = {t: fleet.get(t, 0) - ready.get(t, 0.0) for t in set(fleet) | set(ready)}
        return cls(
            ctx=ctx,
            config=config,
            q={(v.model, v.instance_type): v.saturation_qps for v in ctx.variants},
            loading={(v.model, v.instance_type): v.loading_s for v in ctx.variants},
            models=sorted({v.model for v in ctx.variants}),
            types=sorted({v.instance_type for v in ctx.variants}),
            fleet=fleet,
            pending={t: n if n > _EPS else 0.0 for t, n in pending.items()},
            ready=ready,
            drained_s=state.drained_s,
            counted_as=counted_as,
        )

    def type_of(self, inst: ServedInstance) -> str:
        """The type ``inst`` counts as in the fleet: a stand-in's, the type it stands in for."""
        return self.counted_as.get(inst.instance_id, StandIn(inst.instance_type)).stands_for

    def one_count_qps(self, model: str, inst: ServedInstance) -> float:
        """The capacity of ``model`` that one count of ``inst``'s type takes away, ``inst``
        among those the reconciler may pick: its own part, or, where stand-ins count as that
        type, the most one count of them serves (k smaller ones, each 1/k, serve k Q_C; the
        reconciler ends the newest first, often a stand-in serving more than the one judged)."""
        t = self.type_of(inst)
        share = self.counted_as.get(inst.instance_id, StandIn(t)).share
        removed = self.counted.get((model, inst.instance_id), 0.0) / share
        for other in self.serving(model):
            counted = self.counted_as.get(other.instance_id)
            if counted is not None and counted.stands_for == t:
                removed = max(
                    removed, self.counted.get((model, other.instance_id), 0.0) / counted.share
                )
        return removed

    def serving(self, model: str) -> list[ServedInstance]:
        """The instances that serve ``model``."""
        return [i for i in self.ctx.instances if model in i.states]

    def cost_usd_per_hr(self) -> float:
        return _cost_usd_per_hr(self.fleet, self.ctx.prices_usd_per_hr)

    def take_back(self) -> dict[str, int]:
        """Raise each type's count in the fleet to the instances of it that serve (a drain the
        reconciler has not carried out yet, deferred by the disruption budget): a scale-up is
        judged on the capacity of every instance that serves, so it starts from their count and
        cost, and what it adds is launched. Returns the counts taken back, by type.

        By the type each counts as: a stand-in's own type is never taken into the fleet (the
        reconciler counts it as the type it stands in for, and would buy one of its own type
        too), and a part of one (k smaller stand-ins, each 1/k) is not rounded up to a whole one
        (the reconciler would launch the rest)."""
        taken = {t: math.floor(n - self.fleet.get(t, 0) + _EPS) for t, n in self.ready.items()}
        taken = {t: k for t, k in taken.items() if k > 0}
        for t, k in taken.items():
            self.fleet[t] = self.fleet.get(t, 0) + k
        return taken


def _relieve_interference(
    tick: _Tick, relieved_before: frozenset[tuple[str, str]]
) -> set[tuple[str, str]]:
    """Rule 1: count each model's capacity now (an interfered instance at 0, or at the
    interfered share when every instance of the model is), and relieve each newly interfered
    (model, instance) while another instance of the model is not. Returns the pairs relieved."""
    ctx, config = tick.ctx, tick.config
    relieved = set(relieved_before)
    for m in tick.models:
        serving = tick.serving(m)
        interfered = [i for i in serving if i.states[m] == "interfered"]
        everywhere = bool(serving) and len(interfered) == len(serving)
        share = config.interfered_share if everywhere else 0.0
        for i in serving:
            rate = tick.q.get((m, i.instance_type), 0.0)
            tick.counted[(m, i.instance_id)] = rate * (
                share if i.states[m] == "interfered" else 1.0
            )
        tick.capacity_now[m] = sum(tick.counted[(m, i.instance_id)] for i in serving)
        for i in interfered:
            pair = (m, i.instance_id)
            if pair in relieved or everywhere:
                continue
            relieved.add(pair)
            tick.decisions.append(_relieve_decision(tick, m, i, len(serving) - len(interfered)))
    # Pairs no longer interfered may be relieved again when they are next time.
    return {
        (m, iid)
        for m, iid in relieved
        if any(i.instance_id == iid and i.states.get(m) == "interfered" for i in ctx.instances)
    }


def _relieve_decision(tick: _Tick, m: str, i: ServedInstance, left: int) -> ScalingDecision:
    capacity = tick.capacity_now[m]
    load = tick.ctx.load_qps.get(m, 0.0)
    return ScalingDecision(
        "infaas_relieve",
        m,
        i.instance_type,
        0,
        f"infaas_relieve: {m} is interfered on {i.instance_id} ({i.instance_type}):"
        f" its load moves to the {left} other instance(s) serving {m} (its share"
        f" drops to 0 while one of them is active); capacity counted without it"
        f" {plain(capacity, 3)} qps for a load of {plain(load, 3)} qps",
        {
            "model": m,
            "instance_id": i.instance_id,
            "instance_type": i.instance_type,
            "share": 0.0,
            "capacity_qps": capacity,
            "load_qps": load,
        },
        instance_id=i.instance_id,
    )


@dataclass(frozen=True, slots=True)
class _Need:
    """Why model ``model`` needs capacity (rule 2) and how much (``wanted_qps``)."""

    model: str
    load_qps: float
    capacity_qps: float  # counted now plus what is still loading
    overloaded_on: list[str]
    why: str
    wanted_qps: float


def _need(tick: _Tick, m: str) -> _Need | None:
    """Rule 2's test: ``m`` needs capacity when one of its instances is overloaded (or all are
    interfered) and nothing of it is still loading, or when its load exceeds U times its
    capacity, what is loading included; ``None`` when it does not."""
    u = tick.config.utilisation
    q, pending = tick.q, tick.pending
    load = float(tick.ctx.load_qps.get(m, 0.0))
    serving = tick.serving(m)
    loading_capacity = sum(pending.get(t, 0) * q.get((m, t), 0.0) for t in pending)
    capacity = tick.capacity_now[m] + loading_capacity
    overloaded_on = sorted(i.instance_id for i in serving if i.states[m] == "overloaded")
    overloaded = bool(overloaded_on)
    everywhere = bool(serving) and all(i.states[m] == "interfered" for i in serving)
    loading_any = any(pending.get(t, 0) > 0 and q.get((m, t), 0.0) > 0 for t in pending)
    short = load > u * capacity + _EPS
    note = tick.ctx.overload.get(m)
    if overloaded and not short and _judged_before_the_drain(tick, note):
        overloaded_on, overloaded = [], False
    if not (short or ((overloaded or everywhere) and not loading_any)):
        return None
    parts = []
    if overloaded:
        judged = f": {'; '.join(note.reasons)}" if note is not None and note.reasons else ""
        parts.append(f"{m} is overloaded on {', '.join(overloaded_on)}{judged}")
    if short:
        parts.append(
            f"load {plain(load, 3)} qps > U {u:g} x capacity {plain(capacity, 3)} qps"
            f" ({plain(loading_capacity, 3)} of it still loading)"
        )
    elif everywhere and not overloaded:
        parts.append(f"{m} is interfered on every instance serving it")
    wanted_qps = max(load / u - capacity, 0.0)
    if not short:
        # Overloaded (or interfered everywhere) at a load the profiles say it carries: the
        # queue, not the rate, says it is short; one more instance of what serves it now.
        wanted_qps = max((q.get((m, i.instance_type), 0.0) for i in serving), default=wanted_qps)
    return _Need(m, load, capacity, overloaded_on, "; ".join(parts), wanted_qps)


def _judged_before_the_drain(tick: _Tick, note: OverloadNote | None) -> bool:
    """Whether an overload verdict's window (the serving loop's, in ``note``) reaches back
    before the app's last drain: its refusals and arrivals were then partly those of the fleet
    before it, and a load that has since gone (the drain found it gone) would scale the fleet
    back up at once. The load test of rule 2 (fresh arrivals) still holds for such a tick."""
    if tick.drained_s is None or note is None:
        return False
    window_s = note.numbers.get("window_s")
    return window_s is not None and tick.ctx.now_s - tick.drained_s < window_s


def _found_short(
    tick: _Tick, before: Mapping[str, tuple[tuple[float, float, float], ...]]
) -> dict[str, tuple[tuple[float, float, float], ...]]:
    """Per model, the capacities (qps) it has been found short at, each with the least load
    (qps) and the last time (s) it was, with this tick's: overloaded (a verdict not judged
    partly before the last drain) at load L on the capacity that serves, or its load over U
    times its capacity, what is loading included. One the model has since carried on no more
    capacity, what is loading included (not overloaded, nor short of capacity), at a load the
    guard would not drain it to (:func:`_short_after_drain`) is forgotten, and so is one not
    found again for ``short_memory_s``. Each capacity is kept apart: one short at L is short at
    L on less too (the guard reads the least load of those at least as large), but a larger one
    forgotten says nothing of a smaller one (pruned as redundant, the smaller one went with it,
    and the drain to it came back)."""
    u = tick.config.utilisation
    ratio = tick.config.drain_utilisation / u
    now_s = tick.ctx.now_s
    out: dict[str, tuple[tuple[float, float, float], ...]] = {}
    for m in tick.models:
        load = float(tick.ctx.load_qps.get(m, 0.0))
        now = tick.capacity_now[m]
        loading = sum(tick.pending.get(t, 0) * tick.q.get((m, t), 0.0) for t in tick.pending)
        overloaded_any = any(i.states[m] == "overloaded" for i in tick.serving(m))
        overloaded = overloaded_any and not _judged_before_the_drain(tick, tick.ctx.overload.get(m))
        short = load > u * (now + loading) + _EPS
        kept = [
            (c, w, at)
            for c, w, at in before.get(m, ())
            if now_s - at <= tick.config.short_memory_s + _EPS
        ]
        if not (overloaded_any or short):
            # Carried on no more capacity at a load the guard would not drain it to: a burst's
            # verdict, or a capacity that serves more now (it held drains back for good where
            # the load stayed a little under the one it was found short at). What is still
            # loading counts: a tick between two overloaded ones, while the replica loaded, read
            # as carried, and the drain came back once the replica served.
            kept = [
                (c, w, at)
                for c, w, at in kept
                if not (now + loading <= c + _TOL and load >= ratio * w - _TOL)
            ]
        if overloaded:
            kept.append((now, load, now_s))
        if short:
            kept.append((now + loading, load, now_s))
        by_capacity: dict[float, tuple[float, float, float]] = {}
        for c, w, at in kept:
            key = round(c, 6)
            seen = by_capacity.get(key)
            if seen is not None:
                w, at = min(w, seen[1]), max(at, seen[2])
            by_capacity[key] = (c, w, at)
        if by_capacity:
            out[m] = tuple(sorted(by_capacity.values()))
    return out


def _short_after_drain(tick: _Tick, m: str, remaining_qps: float, load_qps: float) -> bool:
    """Rule 3's guard: whether a drain that leaves ``m`` ``remaining_qps`` of capacity would
    leave it at most a capacity it was found short at (:func:`_found_short`) with its load not
    yet below U_drain / U of the load it was short at: the drain's band under the scale-up's,
    measured where the profile's capacity was not what served."""
    ratio = tick.config.drain_utilisation / tick.config.utilisation
    return any(
        c >= remaining_qps - _TOL and load_qps > ratio * w + _TOL
        for c, w, _ in tick.short_at.get(m, ())
    )


def _scale_up_choice(tick: _Tick, need: _Need) -> tuple[str, int, bool] | None:
    """Rule 2's choice for ``need``: (type, instances added, whether it covers the need whole),
    the cheapest option by the ILP's cost that covers it within the budget and caps, else the
    one that adds the most capacity that fits; ``None`` when not one instance fits."""
    ctx, m = tick.ctx, need.model
    cost_now = tick.cost_usd_per_hr()
    serving = tick.serving(m)
    # (cost, inactive, type, delta): at equal cost the loaded variant (replication).
    whole: list[tuple[float, bool, str, int]] = []
    partial: list[tuple[float, bool, str, int]] = []
    for t in tick.types:
        rate = tick.q.get((m, t), 0.0)
        if rate <= 0 or t not in ctx.prices_usd_per_hr:
            continue
        price = ctx.prices_usd_per_hr[t]
        delta = max(1, math.ceil(need.wanted_qps / rate - _EPS))
        room = math.floor((ctx.budget_usd_per_hr - cost_now) / price + _EPS) if price else delta
        cap = ctx.max_counts.get(t)
        if cap is not None:
            room = min(room, cap - tick.fleet.get(t, 0))
        t_load = tick.loading.get((m, t), 0.0)
        loaded = any(i.instance_type == t for i in serving)
        if room >= delta:
            cost = scaling_cost_usd_per_s(price, delta, tick.config.load_weight_per_s, t_load)
            whole.append((round(cost * 3600.0, 9), not loaded, t, delta))
        elif room >= 1:
            partial.append((-room * rate, not loaded, t, room))
    if whole:
        _, _, t, delta = min(whole)
        return t, delta, True
    if partial:
        _, _, t, delta = min(partial)
        return t, delta, False
    return None


def _scale_up(
    tick: _Tick, capped: tuple[str, str, int] | None
) -> tuple[bool, tuple[str, str, int] | None]:
    """Rule 2: the first model that needs capacity and can have it gets its choice of
    instances (at most one scaling action a tick); one for which nothing fits gets an
    ``infaas_budget_capped`` (said once until what is capped changes or no model needs
    capacity: a shortage that comes back is said again, where an hour later it had been said by
    nothing), and the next model is asked (where the first was, say, at its GPU's cap, a second
    whose CPU fits was never scaled). Returns (whether it scaled up, the cap last said)."""
    ctx = tick.ctx
    short = False
    for m in tick.models:
        need = _need(tick, m)
        if need is None:
            continue
        short = True
        wanted = dict(tick.fleet)
        taken = tick.take_back()
        cost_now = tick.cost_usd_per_hr()
        choice = _scale_up_choice(tick, need)
        if choice is None:
            # Nothing added: the drains still to be carried out stay wanted.
            tick.fleet = wanted
            key = (m, "", 0)
            if capped != key:
                capped = key
                tick.decisions.append(
                    ScalingDecision(
                        "infaas_budget_capped",
                        m,
                        "",
                        0,
                        f"infaas_budget_capped: {need.why}; {_nothing_fits(tick, m, cost_now)}",
                        {
                            "model": m,
                            "load_qps": need.load_qps,
                            "capacity_qps": need.capacity_qps,
                            "cost_usd_per_hr": cost_now,
                            "budget_usd_per_hr": ctx.budget_usd_per_hr,
                            "max_counts": {
                                t: ctx.max_counts[t] for t in tick.types if t in ctx.max_counts
                            },
                        },
                    )
                )
            continue
        t, delta, covered = choice
        numbers = _add_instances(tick, need, t, delta, cost_now, taken)
        if covered:
            return True, capped if capped is not None and capped[0] != m else None
        tick.decisions.append(
            ScalingDecision(
                "infaas_budget_capped",
                m,
                t,
                delta,
                f"infaas_budget_capped: {m} wanted {plain(need.wanted_qps, 3)} qps more;"
                f" {_what_allows(tick, t, delta)}",
                {**numbers, "wanted_qps": need.wanted_qps},
            )
        )
        return True, (m, t, delta)
    # No model needs capacity: the cap said has ended.
    return False, capped if short else None


def _what_allows(tick: _Tick, t: str, delta: int) -> str:
    """What stopped a scale-up at ``delta`` x ``t`` (added to the fleet): ``t``'s max_counts,
    else the budget (a cap read "the budget (2 USD/hr) and caps allow 1 x cpu")."""
    ctx = tick.ctx
    budget = f"{plain(ctx.budget_usd_per_hr, 4)} USD/hr"
    count, cap = tick.fleet.get(t, 0), ctx.max_counts.get(t)
    if cap is not None and count >= cap:
        return f"max_counts allows {delta} x {t} ({t} {count} of {cap}; the budget {budget})"
    return f"the budget ({budget}) allows {delta} x {t}"


def _nothing_fits(tick: _Tick, m: str, cost_now: float) -> str:
    """Why no variant of ``m`` adds an instance: the budget, the spec's ``max_counts`` or both
    (a cap said as the budget read "the fleet costs 0.2 of 2 USD/hr", a budget with room)."""
    ctx = tick.ctx
    cost = f"the fleet costs {plain(cost_now, 4)} of {plain(ctx.budget_usd_per_hr, 4)} USD/hr"
    offered = [t for t in tick.types if tick.q.get((m, t), 0.0) > 0 and t in ctx.prices_usd_per_hr]
    if not offered:
        return f"no variant of {m} meets the SLO"
    at_cap = [t for t in offered if tick.fleet.get(t, 0) >= ctx.max_counts.get(t, math.inf)]
    if not at_cap:
        return f"no variant of {m} fits: {cost}"
    capped = ", ".join(f"{t} {tick.fleet.get(t, 0)} of {ctx.max_counts[t]}" for t in at_cap)
    over = [t for t in offered if t not in at_cap]
    if not over:
        return f"no variant of {m} fits: max_counts allows no more ({capped}; {cost})"
    return (
        f"no variant of {m} fits: {cost}, no more of {', '.join(over)} fits it, and max_counts"
        f" allows no more of the others ({capped})"
    )


def _add_instances(
    tick: _Tick, need: _Need, t: str, delta: int, cost_now: float, taken: Mapping[str, int]
) -> dict[str, object]:
    """Add ``delta`` instances of ``t`` for ``need`` to the fleet (whose counts were raised to
    the instances that serve: ``taken``, the drains taken back) and record the
    ``infaas_replicate`` (a loaded variant) or ``infaas_upgrade`` (an inactive one); returns
    the decision's numbers. Its counts, cost and capacity are those of one fleet: the instances
    that serve or still load, then ``delta`` more."""
    ctx, m = tick.ctx, need.model
    rate = tick.q[(m, t)]
    active = any(i.instance_type == t for i in tick.serving(m))
    action = "infaas_replicate" if active else "infaas_upgrade"
    t_load = tick.loading.get((m, t), 0.0)
    before = tick.fleet.get(t, 0)
    tick.fleet[t] = before + delta
    after_cost = tick.cost_usd_per_hr()
    capacity, load = need.capacity_qps, need.load_qps
    kind = (
        f"replicate the loaded variant {m} on {t}"
        if active
        else f"upgrade to the inactive variant {m} on {t} (loading {t_load:g} s before it serves)"
    )
    back = ""
    if taken:
        kept = ", ".join(f"{n} x {name}" for name, n in sorted(taken.items()))
        back = f"; {kept} drained by the policy but still serving, taken back"
    reason = (
        f"{action}: {need.why}; {kind}: +{delta} x {t} ({before} -> {tick.fleet[t]}{back};"
        f" Q {plain(rate, 3)} qps each): capacity {plain(capacity, 3)} ->"
        f" {plain(capacity + delta * rate, 3)} qps for {plain(load, 3)} qps;"
        f" cost {plain(cost_now, 4)} -> {plain(after_cost, 4)} of"
        f" {plain(ctx.budget_usd_per_hr, 4)} USD/hr"
    )
    overloaded = bool(need.overloaded_on)
    note = ctx.overload.get(m)
    numbers: dict[str, object] = {
        "model": m,
        "instance_type": t,
        "count": delta,
        "count_before": before,
        "count_after": tick.fleet[t],
        "load_qps": load,
        "capacity_qps_before": capacity,
        "capacity_qps_after": capacity + delta * rate,
        "saturation_qps": rate,
        "loading_s": t_load,
        "overloaded": overloaded,
        "overloaded_instances": need.overloaded_on,
        "overload": dict(note.numbers) if overloaded and note is not None else None,
        "cost_usd_per_hr_before": cost_now,
        "cost_usd_per_hr_after": after_cost,
        "budget_usd_per_hr": ctx.budget_usd_per_hr,
        "taken_back": dict(taken),
        "at_s": ctx.now_s,
    }
    tick.decisions.append(ScalingDecision(action, m, t, delta, reason, numbers))
    return numbers


def _underused(tick: _Tick, state: ScalerState) -> tuple[dict[str, float], list[ServedInstance]]:
    """Rule 3's test: the instances underused now (no model of theirs overloaded, busy at most
    U when known, and every model they serve carried at U_drain without them), and, per type,
    since
    when it has had one without a break (the hold is the type's: a drain takes one instance of
    the type off the count, and the reconciler picks which, so the survivor's clock goes on)."""
    u, u_drain = tick.config.utilisation, tick.config.drain_utilisation
    loads = {m: float(tick.ctx.load_qps.get(m, 0.0)) for m in tick.models}
    since: dict[str, float] = {}
    found: list[ServedInstance] = []
    for inst in tick.ctx.instances:
        served = [m for m in inst.states if m in tick.capacity_now]
        busy = inst.utilisation_share
        ok = (
            bool(served)
            and all(inst.states[m] != "overloaded" for m in served)
            and (busy is None or busy <= u)
            and all(
                (tick.capacity_now[m] - tick.one_count_qps(m, inst)) * u_drain >= loads[m] - _EPS
                and not _short_after_drain(
                    tick, m, tick.capacity_now[m] - tick.one_count_qps(m, inst), loads[m]
                )
                for m in served
            )
        )
        if ok:
            found.append(inst)
            t = tick.type_of(inst)
            since[t] = state.underused_since_s.get(t, tick.ctx.now_s)
    return since, found


def _drain(
    tick: _Tick, state: ScalerState, since: Mapping[str, float], underused: list[ServedInstance]
) -> bool:
    """Rule 3: drain one instance of the most expensive type that has had an underused one
    (``underused``) for the hold (``since``, per type), with no scaling action within the hold,
    nothing of its type loading, another instance left and no drain still to be carried out
    (every type's count at least the instances of it that serve). Returns whether one was
    drained."""
    ctx, u_drain, now = tick.ctx, tick.config.drain_utilisation, tick.ctx.now_s
    held = ctx.held_back
    if (
        held.pending(tick.fleet)
        if held is not None
        else any(n > tick.fleet.get(t, 0) + _EPS for t, n in tick.ready.items())
    ):
        # A drain the reconciler has not carried out yet (the disruption budget deferred it):
        # the underused test counts every instance that serves, so a second drain judged on
        # them took the fleet below the load (4 serving, 20 qps on Q 10: "20 qps on 30 qps
        # left" three times, down to one instance). The next drain waits for it. What the
        # reconciler says it holds back is that drain; counted from the instances that serve,
        # a spot move's or an interruption's replacement serving beside the row it replaces,
        # or a stand-in of a type the fleet does not name, read as one too, and no drain came
        # while they served (a stand-in stays: never again).
        return False
    loads = {m: float(ctx.load_qps.get(m, 0.0)) for m in tick.models}
    total = sum(tick.fleet.values())
    # One candidate per type (its first underused instance by id): the type's count goes down.
    # A stand-in is one of the type it stands in for (the reconciler picks which ends).
    first: dict[str, ServedInstance] = {}
    for inst in sorted(underused, key=lambda i: i.instance_id):
        first.setdefault(tick.type_of(inst), inst)
    candidates = sorted(
        first.items(), key=lambda item: (-ctx.prices_usd_per_hr.get(item[0], 0.0), item[0])
    )
    for t, inst in candidates:
        hold = tick.config.hold_s
        if hold is None:
            hold = max((tick.loading.get((m, t), 0.0) for m in inst.states), default=0.0)
        idle_s = now - since[t]
        if (
            total <= 1
            or tick.fleet.get(t, 0) <= 0
            or tick.pending.get(t, 0) > 0
            or idle_s < hold - _EPS
            or now - state.last_change_s < hold - _EPS
        ):
            continue
        before_cost = tick.cost_usd_per_hr()
        tick.fleet[t] -= 1
        after_cost = tick.cost_usd_per_hr()
        served = sorted(inst.states)
        remaining = {m: tick.capacity_now[m] - tick.one_count_qps(m, inst) for m in served}
        carry = ", ".join(
            f"{m} {plain(loads[m], 3)} qps on {plain(remaining[m], 3)} qps left" for m in served
        )
        shown = (
            "unknown" if inst.utilisation_share is None else f"{100 * inst.utilisation_share:.0f}%"
        )
        standing = (
            f", a {inst.instance_type} standing in for {t}," if inst.instance_type != t else ""
        )
        tick.decisions.append(
            ScalingDecision(
                "infaas_drain",
                ",".join(served),
                t,
                1,
                f"infaas_drain: {t} underused for {plain(idle_s, 3)} s >= hold {hold:g} s"
                f" ({inst.instance_id}{standing} now: busy {shown}; without it {carry}, within"
                f" U_drain {u_drain:g}):"
                f" -1 x {t} (the reconciler picks which), cost {plain(before_cost, 4)} ->"
                f" {plain(after_cost, 4)} USD/hr",
                {
                    "instance_id": inst.instance_id,
                    "instance_type": t,
                    "count": 1,
                    "count_after": tick.fleet[t],
                    "models": served,
                    "load_qps": {m: loads[m] for m in served},
                    "capacity_qps_after": remaining,
                    "underused_s": idle_s,
                    "hold_s": hold,
                    "utilisation_share": inst.utilisation_share,
                    "drain_utilisation": u_drain,
                    "cost_usd_per_hr_after": after_cost,
                    "at_s": now,
                },
                instance_id=inst.instance_id,
            )
        )
        return True
    return False
