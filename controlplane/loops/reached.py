"""Where a scaling loop had taken an app's fleet, for the loop a restart sets up afresh.

The tuner and the INFaaS scaler keep the fleet they want in memory and set it up from the applied
plan's fleet when they first see an app. A restarted loops process (or a new leader) started from
the plan's fleet whatever the loop had grown under load: the reconciler's first pass drained it,
and the loop grew it again a minute later. Each loop writes the fleet it wants after a change into
the change's decision (:data:`PLAN_ID`, the loop's own key for the fleet); :func:`reached` reads
the newest back, for the plan applied now only.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from controlplane.db.store import DecisionRecord, PlanRecord, Store

__all__ = [
    "INFAAS_KINDS",
    "LOOKBACK",
    "PLAN_ID",
    "SCALING_KINDS",
    "TUNER_KINDS",
    "counts",
    "lowest_budget_since",
    "newest",
    "reached",
]

# The decision numbers' key of the plan the fleet was reached on.
PLAN_ID = "plan_id"
# How many of an app's newest decisions of the loops' kinds are read (another loop's decisions of
# those kinds carry no fleet and are passed over).
LOOKBACK = 20
# The decisions each scaling loop writes the fleet after a change into: the live tuner's and the
# INFaaS scaler's. A loop starts from its own only where it is the newest of them
# (:data:`SCALING_KINDS`): an app moved to the other loop and back on the same plan starts from
# the plan's fleet, not from the fleet the loop had reached before the move (the other loop has
# moved it since).
TUNER_KINDS = frozenset({"scale_up", "scale_down"})
INFAAS_KINDS = frozenset({"infaas_replicate", "infaas_upgrade", "infaas_drain", "infaas_relieve"})
SCALING_KINDS = TUNER_KINDS | INFAAS_KINDS


def reached(
    store: Store, app: str, plan: PlanRecord, kinds: Iterable[str], key: str
) -> object | None:
    """``numbers[key]`` of the newest of ``app``'s decisions of ``kinds`` that has it, where that
    decision was made on ``plan`` since it was applied and no scaling loop's fleet was written
    after it (:data:`SCALING_KINDS`); None: none has it, the newest is of another plan or an
    earlier application, or the other loop's is newer."""
    decision = newest(store, app, plan, kinds, key)
    return None if decision is None else decision.numbers[key]


def newest(
    store: Store, app: str, plan: PlanRecord, kinds: Iterable[str], key: str
) -> DecisionRecord | None:
    """The decision :func:`reached` reads, or None."""
    if plan.applied_at is None:
        return None
    own = frozenset(kinds)
    read = sorted(own | SCALING_KINDS)
    for decision in reversed(store.list_decisions(app, kinds=read, limit=LOOKBACK)):
        if PLAN_ID not in decision.numbers:
            continue  # a decision of those kinds that carries no loop's fleet
        if decision.kind not in own or key not in decision.numbers:
            return None  # the other loop's fleet is newer
        if decision.numbers.get(PLAN_ID) != plan.id or decision.at < plan.applied_at:
            return None
        return decision
    return None


def lowest_budget_since(store: Store, app: str, since: datetime, budget_usd_per_hr: float) -> float:
    """The lowest budget ``app`` has had since ``since``: ``budget_usd_per_hr`` (its budget now)
    or one a change set after it. A loop cuts the fleet it reached to a lowered budget without
    a decision, and a raise after does not grow it back (nor does the reconciler's drain)."""
    changes = store.list_budget_changes(app)
    return min([budget_usd_per_hr, *(c.new_usd_per_hr for c in changes if c.at > since)])


def counts(value: object) -> dict[str, int] | None:
    """``value`` as counts by instance type (names to whole counts >= 0), or None."""
    if not isinstance(value, dict):
        return None
    fleet: dict[str, int] = {}
    for name, count in value.items():
        if not isinstance(name, str) or type(count) is not int or count < 0:
            return None
        fleet[name] = count
    return fleet
