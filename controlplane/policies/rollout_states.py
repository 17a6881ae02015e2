"""A rollout's states and their moves (:data:`TRANSITIONS`), apart from the rest of the rollout
policy (:mod:`controlplane.policies.rollout`, which re-exports them) so that the database's
models read them without importing the estimator the policy's judgement uses.

>>> check_rollout_transition("running", "paused")
>>> sorted(str(state) for state in ACTIVE_STATES)
['paused', 'pending', 'running']
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

from controlplane.errors import InvalidRolloutTransitionError

__all__ = [
    "ACTIVE_STATES",
    "TRANSITIONS",
    "RolloutState",
    "check_rollout_transition",
    "decision_subject",
    "spec_held_by_rollout",
]


class RolloutState(StrEnum):
    PENDING = "pending"  # recorded, its workers starting: no traffic yet
    RUNNING = "running"
    PAUSED = "paused"  # traffic stays where it is, the judgement waits
    PROMOTED = "promoted"  # the new version is the app's
    ROLLED_BACK = "rolled_back"  # a threshold was breached: all traffic back at once
    ABORTED = "aborted"  # a user ended it: all traffic back


_R = RolloutState

TRANSITIONS: MappingProxyType[RolloutState, frozenset[RolloutState]] = MappingProxyType(
    {
        # Not paused while pending: its checks before traffic (the new version timed alone,
        # the plan for it) would be skipped by a resume, which goes to running.
        _R.PENDING: frozenset({_R.RUNNING, _R.ROLLED_BACK, _R.ABORTED}),
        _R.RUNNING: frozenset({_R.PAUSED, _R.PROMOTED, _R.ROLLED_BACK, _R.ABORTED}),
        _R.PAUSED: frozenset({_R.RUNNING, _R.ROLLED_BACK, _R.ABORTED}),
        _R.PROMOTED: frozenset(),
        _R.ROLLED_BACK: frozenset(),
        _R.ABORTED: frozenset(),
    }
)
# A rollout in one of these holds its app: no second one starts.
ACTIVE_STATES = frozenset(state for state, moves in TRANSITIONS.items() if moves)


def check_rollout_transition(from_state: str, to_state: str) -> None:
    """Raise :class:`InvalidRolloutTransitionError` unless the table lists the move."""
    try:
        allowed = to_state in TRANSITIONS[RolloutState(from_state)]
    except ValueError:
        allowed = False
    if not allowed:
        raise InvalidRolloutTransitionError(from_state, to_state)


def spec_held_by_rollout(app: str, rollout_id: int, model: str, state: str, fields: str) -> str:
    """Why a spec that changes ``fields`` is refused while rollout ``rollout_id`` of ``app`` is
    active (the API's check and the store's, under the app's lock, say it alike).

    >>> spec_held_by_rollout("recs", 3, "clf", "pending", "models")[:43]
    "app 'recs' has rollout 3 of clf pending, wh"
    """
    return (
        f"app {app!r} has rollout {rollout_id} of {model} {state}, which works on its {fields} as"
        f" they were: change them once it ends, or end it first (heteroplane rollout abort --app"
        f" {app})"
    )


def decision_subject(numbers: Mapping[str, object], reason: object) -> tuple[object, ...] | None:
    """What a ``rollout`` decision is about, where runs of decisions fold into one line
    (``heteroplane events``, the dashboard's event log): (rollout id, state, step index, the
    reason where it is a move, else None); None where ``numbers`` name no rollout. The rollout
    loop says which decisions hold the rollout where it is (``wait`` true): only those fold
    together within a state and step; each move (``wait`` false: profiled, a step passed,
    promoted, the handover done) folds only with itself made again. A decision without
    ``wait`` (recorded before 2026-12-07) folds by state and step.

    >>> decision_subject({"rollout_id": 3, "state": "pending", "step_index": 0, "wait": True},
    ...     "rollout 3: waiting for the budget")
    (3, 'pending', 0, None)
    >>> decision_subject({"rollout_id": 3, "state": "promoted", "step_index": 1, "wait": False},
    ...     "rollout 3: handover done")
    (3, 'promoted', 1, 'rollout 3: handover done')
    >>> decision_subject({"stage": "large"}, "scale_up") is None
    True
    """
    rollout = numbers.get("rollout_id")
    if rollout is None:
        return None
    move = reason if numbers.get("wait") is False else None
    return (rollout, numbers.get("state"), numbers.get("step_index"), move)
