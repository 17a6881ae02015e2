"""The simulated pipeline of a plan: every stage's simulator stage and the cascade's forwarding.

This module owns how a multi-stage plan becomes one end-to-end simulation (InferLine section 4.2,
"conditional control flow using scale factor s", with the scale factors made per query by the
validation records): which stage answers each query (:func:`answering_stages`: the trace's
``sample_id`` column, else samples drawn uniformly with the caller's generator, and the spec's
thresholds), which queries each stage forwards (:func:`forward_flags`), and each stage's fleet,
batch size and dispatch policy (:func:`dispatch_factory`, :func:`pipeline_stages`). The planner
judges joint cascade allocations with it and ``replay`` re-simulates multi-stage plans with it, so
the two build the same pipeline from the same plan (docs/planner.md, Cascades).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from controlplane.policies.plan import DispatchName, StagePlan
from controlplane.spec import ResolvedApp
from estimator.cascades import answering_stage, with_sample_ids
from estimator.policies import full_range_types, policy_class, policy_factory
from estimator.profiles import LatencyProfile
from estimator.simulator import InstanceSpec, Stage
from estimator.traces import Trace
from matching.policy import (
    Dispatch,
    DispatchPolicy,
    InstanceView,
    QueuedQuery,
    StageContext,
    queries_per_call,
)

__all__ = [
    "MIX_POLICY",
    "SINGLE_TYPE_POLICY",
    "FleetRulePolicy",
    "answering_stages",
    "by_fleet",
    "dispatch_choice",
    "dispatch_factory",
    "forward_flags",
    "mix_dispatch",
    "mix_policy",
    "pipeline_stages",
    "reaching_batch_sizes",
]

# The planner's dispatch: FCFS over one type (and where a mix has no base type), Kairos' matching
# over a mix of types (the plan may name another policy a plan may name).
SINGLE_TYPE_POLICY: DispatchName = "fcfs"
MIX_POLICY: DispatchName = "kairos"


def mix_policy(
    policy: DispatchName | None, planned_fleet: Mapping[str, int]
) -> DispatchName | None:
    """The dispatch a plan's stage names for a mix of types: its ``policy``, but None (the
    planner's rule for a mix, :func:`dispatch_choice`: :data:`MIX_POLICY` where a type serves
    every batch size within the SLO, FCFS where none does) where the plan placed one type. Such a
    stage names FCFS by the single-type rule, which says nothing of a mix the tuner moves it to:
    the sizing ladder's rungs of several types are the planner's under Kairos, and the live
    dispatcher, the replay and the ladder's capacity model follow them.

    >>> mix_policy("fcfs", {"a": 2}), mix_policy("fcfs", {"a": 2, "b": 1})
    (None, 'fcfs')
    """
    return None if sum(1 for n in planned_fleet.values() if n) == 1 else policy


def mix_dispatch(stage: StagePlan) -> DispatchName:
    """The policy that dispatches ``stage``'s types when they are several (:func:`mix_policy`,
    :data:`MIX_POLICY` by the planner's rule): the one a sizing ladder's capacity model is
    that of, for the live tuner and the replay alike."""
    return mix_policy(stage.policy, stage.fleet) or MIX_POLICY


def answering_stages(
    app: ResolvedApp, trace: Trace, rng: np.random.Generator
) -> NDArray[np.int64] | None:
    """Per query of ``trace``, the index of the stage that answers it (the first whose certainty
    reaches its threshold, :func:`estimator.cascades.answering_stage`); ``None`` when the app has
    one stage or no validation records (every query then reaches every stage). The trace's
    ``sample_id`` column picks each query's validation sample; without it one is drawn uniformly
    with ``rng`` (the planner passes ``default_rng(seed)``)."""
    cascade, records = app.cascade, app.validation
    if len(app.spec.serving_order) < 2 or cascade is None or records is None:
        return None
    ids = trace.sample_id
    if ids is None:
        ids = with_sample_ids(trace, records, rng).sample_id
        assert ids is not None
    return answering_stage(cascade, records, ids)


def forward_flags(
    answered: NDArray[np.int64] | None, stages: int, queries: int
) -> tuple[NDArray[np.bool_] | None, ...]:
    """Per stage, which queries it forwards to the next one (the last stage: ``None``): those
    answered later than it, or every query when ``answered`` is ``None``.

    >>> [None if f is None else f.tolist() for f in forward_flags(np.array([0, 1, 1]), 2, 3)]
    [[False, True, True], None]
    """
    flags: list[NDArray[np.bool_] | None] = []
    for i in range(stages):
        if i + 1 == stages:
            flags.append(None)
        elif answered is None:
            flags.append(np.ones(queries, dtype=np.bool_))
        else:
            flags.append(answered >= i + 1)
    return tuple(flags)


def reaching_batch_sizes(
    trace: Trace, answered: NDArray[np.int64] | None, stage: int
) -> NDArray[np.int64]:
    """The batch sizes of the queries of ``trace`` that reach ``stage`` (all of them when
    ``answered`` is ``None`` or no query does)."""
    if answered is None or stage == 0 or not np.any(answered >= stage):
        return trace.batch_size
    return trace.batch_size[answered >= stage]


def dispatch_factory(
    policy: DispatchName | None,
    profiles: Mapping[str, LatencyProfile],
    prices_usd_per_hr: Mapping[str, float],
    batch_sizes: NDArray[np.int64],
    slo_ms: float,
) -> tuple[DispatchName, Callable[[], DispatchPolicy]]:
    """The dispatch of a stage whose fleet uses the types of ``profiles``, as the planner chooses
    it: one type is FCFS (:data:`SINGLE_TYPE_POLICY`); several are ``policy``, by default Kairos
    (:data:`MIX_POLICY`), with the full-range types (those that meet ``slo_ms`` at every size of
    ``batch_sizes``, the sizes of the queries reaching the stage) as its base where it needs one,
    FCFS when there is none."""
    name, base = dispatch_choice(policy, profiles, prices_usd_per_hr, batch_sizes, slo_ms)
    return name, policy_factory(name, dict(profiles), base)


def single_type_spans(instances: Sequence[InstanceSpec]) -> tuple[list[float], list[bool]]:
    """Where the instances serving (``ready_s`` <= t < ``stop_s``) are of one type or none: the
    times the answer changes (the first 0) and, from each, whether they are.

    >>> single_type_spans([InstanceSpec("a"), InstanceSpec("b", 5.0, 9.0)])
    ([0.0, 5.0, 9.0], [True, False, True])
    """
    changes: dict[float, list[tuple[str, int]]] = {}
    for spec in instances:
        changes.setdefault(spec.ready_s, []).append((spec.instance_type, 1))
        if math.isfinite(spec.stop_s):
            changes.setdefault(spec.stop_s, []).append((spec.instance_type, -1))
    serving: dict[str, int] = {}
    times: list[float] = [0.0]
    single: list[bool] = [True]
    for t in sorted(changes):
        for name, step in changes[t]:
            serving[name] = serving.get(name, 0) + step
        now_single = sum(1 for n in serving.values() if n > 0) <= 1
        if t <= 0.0:
            single[0] = now_single
        elif now_single != single[-1]:
            times.append(t)
            single.append(now_single)
    return times, single


class FleetRulePolicy:
    """The dispatch of a stage whose fleet changes, as the live dispatcher runs it
    (``controlplane.serving.placement.policy_name``, which rebuilds a stage's policy when its
    workers' types change): FCFS (:data:`SINGLE_TYPE_POLICY`) while the instances serving are of
    one type, the mix's policy while they are several. ``times`` and ``single`` are
    :func:`single_type_spans`'s. Both policies learn from every completed batch."""

    name = "fleet rule"

    def __init__(
        self,
        single_policy: DispatchPolicy,
        mix_policy: DispatchPolicy,
        times: Sequence[float],
        single: Sequence[bool],
    ) -> None:
        self.single_policy, self.mix_policy = single_policy, mix_policy
        self.times, self.single = list(times), list(single)

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]:
        return self._at(now_s).dispatch(now_s, queue, instances, context)

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        self.single_policy.observe(instance_type, batch_size, latency_ms)
        self.mix_policy.observe(instance_type, batch_size, latency_ms)

    def queries_per_call(self, now_s: float, batch_cap: int) -> int:
        """What the policy deciding at ``now_s`` sends a call (FCFS batches, Kairos does not),
        as the live stage's policy of that fleet would say."""
        return queries_per_call(self._at(now_s), now_s, batch_cap)

    def _at(self, now_s: float) -> DispatchPolicy:
        at = max(0, bisect.bisect_right(self.times, now_s) - 1)
        return self.single_policy if self.single[at] else self.mix_policy


def by_fleet(
    name: DispatchName | str,
    make: Callable[[], DispatchPolicy],
    profiles: Mapping[str, LatencyProfile],
    instances: Sequence[InstanceSpec],
) -> Callable[[], DispatchPolicy]:
    """``make`` (policy ``name`` over ``profiles``' types) for a fleet that changes over time
    (``instances``), as the live dispatcher serves it: FCFS where the instances serving are of
    one type, ``make``'s policy where they are several (:class:`FleetRulePolicy` when the fleet
    is both in turn)."""
    if name == SINGLE_TYPE_POLICY or not instances:
        return make
    times, single = single_type_spans(instances)
    if not any(single):
        return make
    make_single = policy_factory(SINGLE_TYPE_POLICY, dict(profiles), sorted(profiles))
    if all(single):
        return make_single
    return lambda: FleetRulePolicy(make_single(), make(), times, single)


def dispatch_choice(
    policy: DispatchName | None,
    profiles: Mapping[str, LatencyProfile],
    prices_usd_per_hr: Mapping[str, float],
    batch_sizes: NDArray[np.int64],
    slo_ms: float,
) -> tuple[DispatchName, list[str]]:
    """:func:`dispatch_factory`'s choice: the policy's name and its base types, preferred first
    (Kairos takes the first as its base: the most throughput per USD/hr on the queries reaching
    the stage among those that serve every size within the SLO). A plan records both
    (``StagePlan.base_types``) so that the live dispatcher serves as the simulator did."""
    used = dict(profiles)
    if len(used) == 1:
        return SINGLE_TYPE_POLICY, list(used)
    chosen = policy or MIX_POLICY
    if not policy_class(chosen).needs_base_type:
        return chosen, []
    prices = {t: prices_usd_per_hr[t] for t in used}
    base = full_range_types(used, batch_sizes, slo_ms, prices)
    if base:
        return chosen, base
    return SINGLE_TYPE_POLICY, []


def pipeline_stages(
    app: ResolvedApp,
    stages: Sequence[tuple[str, Sequence[InstanceSpec], int, DispatchName | None]],
    trace: Trace,
    answered: NDArray[np.int64] | None,
) -> list[Stage]:
    """The simulator's stages of a pipeline on ``trace``: per stage (model, instances, batch
    size, dispatch policy name or ``None`` for the planner's choice), forwarding as ``answered``
    says (:func:`forward_flags`). The Kairos base is judged against the SLO less the control
    plane's own time per query, on the batch sizes of the queries that reach the stage."""
    slo_ms = app.constraints.stage_slo_ms
    flags = forward_flags(answered, len(stages), len(trace))
    built = []
    for i, (model, instances, batch, policy) in enumerate(stages):
        types = sorted({spec.instance_type for spec in instances})
        profiles = {t: app.profile(model, t) for t in types}
        sizes = reaching_batch_sizes(trace, answered, i)
        name, make = dispatch_factory(policy, profiles, app.prices_usd_per_hr, sizes, slo_ms)
        make = by_fleet(name, make, profiles, instances)
        built.append(
            Stage(
                model, tuple(instances), profiles, make(), max_batch_queries=batch, forward=flags[i]
            )
        )
    return built
