"""Use case: change an app's budget, and say which instances must go for it.

A change is audited by the store (who, when, old, new, why). A budget below the app's smallest
serving fleet (:func:`controlplane.policies.drain.serving_floor`: one instance of the cheapest
planned type on every stage of the applied plan; for an app INFaaS's autoscaler scales,
``scaling: infaas``, one instance of the cheapest type the plan places, which serves every
stage, docs/operations.md rule 3) is refused with
:class:`~controlplane.errors.BudgetBelowServingFleetError` (a 409) and changes nothing, unless
``force``; an app without an applied plan has no such floor. A budget that buys no instance of
any of the app's candidate types is refused as registering the app at it is
(:func:`~controlplane.spec.check_budget_buys_one`: a :class:`~controlplane.spec.SpecError`
naming ``budget_usd_per_hr``, a 422), with a plan or without, unless ``force``: taken, it left an
app whose own stored spec failed its validation (a plan preview, a ``PUT`` of that spec). When
the new budget is below what
the live fleet costs, :func:`change_budget` asks the drain policy
(:func:`controlplane.policies.drain.guard_drain`, the reconciler's budget guard's own) which
instances to drain, least cost-effective first, keeping the last instance of each planned stage
(of such an app, its last instance), and its last serving one, where the budget pays for it,
and records a
``budget_drain`` decision; the reconciler acts on it, not this use case. The
API's ``PUT /v1/apps/{app}/budget`` and the command line's ``budget set`` go through it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.apps.resolver import AppResolver, smallest_common_batch_size
from controlplane.crashpoints import crash_point
from controlplane.db.store import BudgetChangeRecord, InstanceRecord, Store
from controlplane.db.store.decisions import Words
from controlplane.errors import BudgetBelowServingFleetError
from controlplane.policies import scaling
from controlplane.policies.drain import (
    DrainInstance,
    DrainPlan,
    guard_drain,
    pooled_stages,
    qps_by_type,
    serving_floor,
    with_leftover_types,
)
from controlplane.policies.lifecycle import (
    KEPT_STATES,
    LIVE_STATES,
    InstanceState,
    billed_cost_usd_per_hr,
    is_profile_worker,
    profiling_group,
)
from controlplane.policies.scaling import UnknownScalingPolicyError
from controlplane.spec import ResolvedApp, SpecError, check_budget_buys_one
from estimator.errors import EstimatorError
from estimator.numbers import plain

__all__ = [
    "BudgetChange",
    "budget_drain",
    "change_budget",
    "check_serving_floor",
    "live_instances",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BudgetChange:
    """A budget change as made: the audit row, the drain plan under the new budget, the live
    instances it was made on, and the note the decision carries (``None``: nothing to drain)."""

    change: BudgetChangeRecord
    drain: DrainPlan
    live: tuple[InstanceRecord, ...]
    note: str | None


_KEPT_VALUES = frozenset(state.value for state in KEPT_STATES)


def live_instances(store: Store, app: str) -> list[InstanceRecord]:
    """The app's instances in a live state (every state but terminated and failed)."""
    return store.list_instances(app, states=[s.value for s in LIVE_STATES])


def _planned_stages(store: Store, app: str, *, every_type: bool) -> dict[str, dict[str, int]]:
    """The applied plan's stages (name -> fleet); empty without an applied plan. ``every_type``
    (an app INFaaS's autoscaler scales): each stage with every type the plan places on any
    stage, as the reconciler's guard counts them (``controlplane.loops.reconciler``
    ``_stage_types``, :func:`~controlplane.policies.drain.pooled_stages`)."""
    record = store.get_applied_plan(app)
    if record is None:
        return {}
    try:
        stages = record.plan.stages
    except EstimatorError as error:
        logger.warning(
            "app %s: the applied plan does not read, so it sets no floor: %s", app, error
        )
        return {}
    planned = {stage.name: dict(stage.fleet) for stage in stages}
    return pooled_stages(planned) if every_type else planned


def _floor(
    stages: Mapping[str, Mapping[str, int]],
    prices: Mapping[str, float],
    *,
    every_type: bool,
) -> tuple[float, str]:
    """The smallest serving fleet's cost and what it is, in words: one instance of the cheapest
    planned type on every stage (:func:`~controlplane.policies.drain.serving_floor`); for an app
    INFaaS's autoscaler scales (``every_type``: each stage lists every planned type), one
    instance of the cheapest of them, which serves every stage (that policy keeps one instance,
    and the reconciler's guard the app's last serving one)."""
    if every_type and stages:
        floor = serving_floor({"app": next(iter(stages.values()))}, prices)
        if not floor.cheapest:
            return 0.0, floor.describe()
        return floor.cost_usd_per_hr, f"one {floor.cheapest[0][1]}, which serves every stage"
    floor = serving_floor(stages, prices)
    return floor.cost_usd_per_hr, floor.describe()


def check_serving_floor(
    store: Store,
    resolver: AppResolver,
    app: str,
    usd_per_hr: float,
    *,
    force: bool = False,
    spec: Mapping[str, Any] | None = None,
) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """Refuse a cut of the budget to ``usd_per_hr`` below ``app``'s smallest serving fleet (one
    instance of the cheapest planned type on every stage of its applied plan; with ``scaling:
    infaas``, one of the cheapest type the plan places, which serves every stage), or to one
    that buys no instance of any candidate type (the rule a spec is registered under), unless
    ``force``; a raise is never refused (it drains nothing). The refusal says what the fleet
    runs at now where it fits and has a spot instance (a spot price rise could not be paid
    for). Returns the planned stages (with ``scaling: infaas``, each with every planned type,
    as the reconciler's guard counts them) and each type's value (qps per USD/hr, empty when
    the profiles do not resolve), which a drain ranks by. Prices and ``scaling`` come from
    ``spec`` (a spec being applied, with its own catalog), by default the app's stored one.

    Raises:
        NotFoundError: no such app.
        BudgetBelowServingFleetError: below the smallest serving fleet, not forced.
        SpecError: buys no instance of any candidate type, not forced (a spec that does not
            resolve is not held to it).
    """
    record = store.get_app(app)
    live = live_instances(store, app)
    # The catalog's prices; the recorded ones stand in for a spec that does not resolve.
    prices = {i.instance_type: i.price_usd_per_hr for i in live}
    resolved: ResolvedApp | None = None
    try:
        resolved = resolver.resolve(record.spec if spec is None else spec, check_budget=False)
        prices.update(resolved.prices_usd_per_hr)
        values = qps_by_type(resolved, smallest_common_batch_size(resolved))
    except EstimatorError as error:
        # Without the profiles, instances rank by price alone.
        logger.warning("app %s: cannot rank instances by value: %s", app, error)
        values = {}
    every_type = _scaled_by_infaas(record.spec if spec is None else spec)
    stages = _planned_stages(store, app, every_type=every_type)
    floor_usd_per_hr, floor_fleet = _floor(stages, prices, every_type=every_type)
    # A raise drains nothing (the fleet is within the budget it raises): never refused, even
    # where it stays below the floor (a budget forced below it, or a plan applied over it).
    raised = usd_per_hr > record.budget_usd_per_hr + 1e-9
    # The same tolerance as the drain's: 0.1 + 0.2 is a floor of 0.3.
    below = usd_per_hr < floor_usd_per_hr - 1e-9 and not raised
    if below and not force:
        # On-demand prices: a spot instance kept at its launch price could be re-priced past the
        # budget (rule 10) or replaced on demand, leaving the stage empty. Say so when the fleet
        # running now fits and has a spot instance: forcing it drains nothing now. An on-demand
        # fleet has no such price to rise (said of one, it read as a spot fleet's risk).
        kept = [i for i in live if i.state in _KEPT_VALUES]
        running = billed_cost_usd_per_hr(kept)
        spot = any(i.market == "spot" for i in kept)
        raise BudgetBelowServingFleetError(
            app,
            usd_per_hr,
            floor_usd_per_hr,
            floor_fleet,
            running_usd_per_hr=running if spot and 0 < running <= usd_per_hr + 1e-9 else None,
        )
    if resolved is not None and not force and not raised:
        _check_buys_one(resolved, usd_per_hr)
    return stages, values


def _scaled_by_infaas(spec: Mapping[str, Any]) -> bool:
    """Whether ``spec`` hands the app's scaling to INFaaS's autoscaler (``scaling: infaas``);
    a value no policy scales live is not (the spec's own check says so where it matters)."""
    try:
        return scaling.live_owner(spec.get("scaling")) == "infaas"
    except UnknownScalingPolicyError:
        return False


def _check_buys_one(resolved: ResolvedApp, usd_per_hr: float) -> None:
    """The rule registration holds the app's spec to (its budget buys one instance of the
    cheapest candidate type, at the least it can cost), at ``usd_per_hr``: taken, the stored
    budget failed it (a plan preview's 422, a ``PUT`` of the app's own spec refused)."""
    at = resolved.spec.model_copy(update={"budget_usd_per_hr": usd_per_hr})
    try:
        check_budget_buys_one(at, resolved.catalog, measuring=bool(resolved.unprofiled))
    except SpecError as error:
        raise SpecError(
            error.field, f'{error.problem}; send "force": true to set it anyway (everything drains)'
        ) from None


def change_budget(
    store: Store,
    resolver: AppResolver,
    app: str,
    usd_per_hr: float,
    reason: str,
    who: str,
    *,
    force: bool = False,
) -> BudgetChange:
    """Set ``app``'s budget to ``usd_per_hr`` and plan the drain it needs.

    Not ``force``d, a budget below the app's smallest serving fleet, or one that buys no
    instance of any candidate type, is refused and nothing changes (no audit row, no decision);
    at or above it, the drain keeps one instance per stage (with ``scaling: infaas``, one).

    Raises:
        NotFoundError: no such app.
        BudgetBelowServingFleetError: below the smallest serving fleet, not forced.
        SpecError: buys no instance of any candidate type, not forced.
        InvalidValueError: a budget the store refuses.
    """
    stages, values = check_serving_floor(store, resolver, app, usd_per_hr, force=force)
    # The drain said in the change's transaction (a crash leaves both or neither).
    drain, live, note, said = budget_drain(
        store, app, float(usd_per_hr), who, stages, values, force=force
    )
    change = store.change_budget(app, usd_per_hr, reason=reason, who=who, said=said)
    crash_point("budget.after_change")
    return BudgetChange(change, drain, tuple(live), note)


def budget_drain(
    store: Store,
    app: str,
    usd_per_hr: float,
    who: str,
    stages: Mapping[str, Mapping[str, int]],
    values: Mapping[str, float],
    *,
    force: bool = False,
) -> tuple[DrainPlan, list[InstanceRecord], str | None, Words]:
    """As ``app``'s budget becomes ``usd_per_hr`` (by ``who``; ``stages`` and ``values`` as
    :func:`check_serving_floor` returned them): the drain plan over its live instances, those
    instances, the note of the ``budget_drain`` decision, and that decision when the fleet is
    over the budget (``None`` and none when it is not), to be written with the change
    (:func:`change_budget`; a new budget in an app's spec, ``PUT /v1/apps/{app}``, the same)."""
    live = live_instances(store, app)
    # The reconciler's budget guard's own drain (what it stops, the decision names): the
    # stages with the types no stage plans (the tuner's additions serve every stage).
    drain = guard_drain(
        [
            DrainInstance(i.id, i.instance_type, i.state, i.cost_usd_per_hr, i.created_at)
            for i in live
        ],
        usd_per_hr,
        values,
        with_leftover_types(
            {name: [t for t, n in fleet.items() if n > 0] for name, fleet in stages.items()},
            (i.instance_type for i in live if not is_profile_worker(i.request_id)),
        ),
        # Profile runs' and rollouts' workers go first, as the reconciler ends them.
        workers={
            i.id: profiling_group(app, i.request_id)
            for i in live
            if is_profile_worker(i.request_id)
        },
    )
    note = None
    if drain.drain:
        forced = " (forced)" if force else ""
        # Rows draining already (a scale-down's) are in the fleet's cost but not in the drain:
        # the reconciler's hard cap ends them at once too, so the note says so (its sum did not
        # add up without them).
        draining = [i for i in live if i.state == InstanceState.DRAINING.value]
        leaving = ""
        if draining:
            leaving = (
                f", and the {len(draining)} draining already"
                f" ({billed_cost_usd_per_hr(draining):.3f} USD/hr) end at once"
            )
        note = (
            f"the fleet costs {drain.fleet_cost_usd_per_hr:.3f} USD/hr, above the new budget"
            f" {plain(usd_per_hr)} USD/hr{forced}: {len(drain.drain)} instance(s) to"
            f" drain ({drain.saved_usd_per_hr:.3f} USD/hr), least cost-effective first{leaving}"
        )
        said: Words = [
            (
                "budget_drain",
                f"budget lowered to {plain(usd_per_hr)} USD/hr by {who}: {note}",
                {
                    "budget_usd_per_hr": usd_per_hr,
                    "fleet_cost_usd_per_hr": drain.fleet_cost_usd_per_hr,
                    "kept_cost_usd_per_hr": drain.kept_cost_usd_per_hr,
                    "drain": [c.id for c in drain.drain],
                },
            )
        ]
    else:
        said = []
    return drain, live, note, said
