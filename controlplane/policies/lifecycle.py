"""The lifecycle of an instance: its states and the one table of moves between them.

An instance we run is *requested* (the reconciler asked a provisioner for it), *pending* (the
provider knows it, it is booting), *running* (its worker serves), *draining* (no new queries; it
finishes what it holds, and may go back to running if load returns before it is let go),
*terminating* (asked to stop), and finally *terminated*; any live state may also end in *failed*
(a launch refused, a boot that never finished, a machine lost). Terminal states have no moves out.

The table is the contract (Karpenter and Ray's autoscaler v2 keep theirs the same way): the store
refuses any move it does not list, so an instance's history in ``instance_events`` always reads as
a path through it.

>>> check_transition("running", "draining")
>>> check_transition("terminated", "running")
Traceback (most recent call last):
...
controlplane.errors.InvalidTransitionError: an instance cannot go from 'terminated' to 'running'
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

from controlplane.errors import InvalidTransitionError
from estimator.numbers import money

__all__ = [
    "BILLED_STATES",
    "KEPT_STATES",
    "LIVE_STATES",
    "PROFILE_REQUEST_PREFIX",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "InstanceState",
    "billed_cost_usd_per_hr",
    "can_transition",
    "check_transition",
    "is_profile_worker",
    "parse_state",
    "profiling_group",
]


class InstanceState(StrEnum):
    REQUESTED = "requested"
    PENDING = "pending"
    RUNNING = "running"
    DRAINING = "draining"
    TERMINATING = "terminating"
    TERMINATED = "terminated"
    FAILED = "failed"


_S = InstanceState

# from state -> the states it may move to. Every state is a key; terminal states map to nothing.
TRANSITIONS: MappingProxyType[InstanceState, frozenset[InstanceState]] = MappingProxyType(
    {
        _S.REQUESTED: frozenset({_S.PENDING, _S.FAILED}),
        _S.PENDING: frozenset({_S.RUNNING, _S.FAILED, _S.TERMINATING}),
        _S.RUNNING: frozenset({_S.DRAINING, _S.TERMINATING, _S.FAILED}),
        _S.DRAINING: frozenset({_S.TERMINATING, _S.RUNNING, _S.FAILED}),
        _S.TERMINATING: frozenset({_S.TERMINATED, _S.FAILED}),
        _S.TERMINATED: frozenset(),
        _S.FAILED: frozenset(),
    }
)

TERMINAL_STATES = frozenset(state for state, moves in TRANSITIONS.items() if not moves)
# States that count toward a fleet's size and cost (everything not yet ended).
LIVE_STATES = frozenset(InstanceState) - TERMINAL_STATES
# The instances a fleet keeps (not draining or ending): what a budget drain chooses among.
KEPT_STATES = frozenset({InstanceState.REQUESTED, InstanceState.PENDING, InstanceState.RUNNING})
# What the budget counts as spent: the live instances but those terminating (EC2 stops billing
# at shutting-down; the reconciler's budget guard does not count them either). A requested row
# is a reservation: its launch may come through any moment.
BILLED_STATES = LIVE_STATES - {InstanceState.TERMINATING}
_BILLED_VALUES = frozenset(state.value for state in BILLED_STATES)


# The request ids of a profile run's workers (controlplane.apps.profile_run) start with this: their
# rows count toward the app's cost but are no part of its serving fleet (not counted against the
# desired fleet, never served traffic).
PROFILE_REQUEST_PREFIX = "profile:"


def is_profile_worker(request_id: str) -> bool:
    """Whether the instance launched under ``request_id`` is a profile run's worker.

    >>> is_profile_worker("profile:digits-1a2b3c4d-emu.gpu"), is_profile_worker("digits-1a2b-3")
    (True, False)
    """
    return request_id.startswith(PROFILE_REQUEST_PREFIX)


def profiling_group(app: str, request_id: str) -> str:
    """Which profile run or rollout of ``app`` the worker launched under ``request_id`` serves:
    ``run R`` (a profile run's id), ``rollout N``, else the request id itself.

    >>> profiling_group("digits", "profile:digits-1a2b3c4d-emu.gpu")
    'run 1a2b3c4d'
    >>> profiling_group("digits", "profile:rollout-digits-7-t6kdc0-emu.cpu.small-1")
    'rollout 7'
    """
    rollout = f"{PROFILE_REQUEST_PREFIX}rollout-{app[:20]}-"
    run = f"{PROFILE_REQUEST_PREFIX}{app[:20]}-"
    for prefix, kind in ((rollout, "rollout"), (run, "run")):
        if request_id.startswith(prefix):
            return f"{kind} {request_id[len(prefix) :].split('-', 1)[0]}"
    return request_id


def parse_state(state: str) -> InstanceState:
    """``state`` as an :class:`InstanceState`; ``ValueError`` naming the known states otherwise."""
    try:
        return InstanceState(state)
    except ValueError:
        known = ", ".join(s.value for s in InstanceState)
        raise ValueError(f"unknown instance state {state!r} (known: {known})") from None


def can_transition(from_state: str, to_state: str) -> bool:
    """Whether the table allows the move (unknown states allow nothing)."""
    try:
        return InstanceState(to_state) in TRANSITIONS[InstanceState(from_state)]
    except ValueError:
        return False


def check_transition(from_state: str, to_state: str) -> None:
    """Raise :class:`InvalidTransitionError` unless the table allows ``from_state -> to_state``."""
    if not can_transition(from_state, to_state):
        raise InvalidTransitionError(str(from_state), str(to_state))


class _Priced(Protocol):
    @property
    def state(self) -> str: ...

    @property
    def cost_usd_per_hr(self) -> float: ...


def billed_cost_usd_per_hr(instances: Iterable[_Priced]) -> float:
    """What ``instances`` cost an hour as the budget counts it: those in :data:`BILLED_STATES`,
    each at its price now (a spot instance's moved price, else its launch price: docs/spot.md;
    the fleet route, the budget's, the dashboard's burn and the roll-up all read this)."""
    # Rounded past the float noise of the sum (three instances at 0.1 read 0.30000000000000004
    # USD/hr against a budget of 0.3, over it to a client that compares).
    return money(sum(i.cost_usd_per_hr for i in instances if str(i.state) in _BILLED_VALUES))
