"""The instance lifecycle table: the moves it allows, and nothing else."""

from __future__ import annotations

import itertools

import pytest

from controlplane.cli.operate import LIVE_INSTANCE_STATES
from controlplane.errors import ConflictError, InvalidTransitionError
from controlplane.policies.lifecycle import (
    LIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    InstanceState,
    can_transition,
    check_transition,
    parse_state,
)

S = InstanceState
ALLOWED = {
    (S.REQUESTED, S.PENDING),
    (S.REQUESTED, S.FAILED),
    (S.PENDING, S.RUNNING),
    (S.PENDING, S.FAILED),
    (S.PENDING, S.TERMINATING),
    (S.RUNNING, S.DRAINING),
    (S.RUNNING, S.TERMINATING),
    (S.RUNNING, S.FAILED),
    (S.DRAINING, S.TERMINATING),
    (S.DRAINING, S.RUNNING),
    (S.DRAINING, S.FAILED),
    (S.TERMINATING, S.TERMINATED),
    (S.TERMINATING, S.FAILED),
}


def test_the_table_is_exactly_the_documented_moves() -> None:
    assert set(TRANSITIONS) == set(InstanceState)
    table = {(a, b) for a, moves in TRANSITIONS.items() for b in moves}
    assert table == ALLOWED


@pytest.mark.parametrize(("from_state", "to_state"), sorted(ALLOWED))
def test_allowed_moves_pass(from_state: str, to_state: str) -> None:
    check_transition(from_state, to_state)
    assert can_transition(from_state, to_state)


@pytest.mark.parametrize(
    ("from_state", "to_state"),
    sorted(set(itertools.product(InstanceState, InstanceState)) - ALLOWED),
)
def test_every_other_move_is_refused(from_state: str, to_state: str) -> None:
    with pytest.raises(InvalidTransitionError) as caught:
        check_transition(from_state, to_state)
    assert (caught.value.from_state, caught.value.to_state) == (from_state, to_state)
    assert f"from {str(from_state)!r} to {str(to_state)!r}" in str(caught.value)


def test_terminal_states_have_no_way_out() -> None:
    assert {S.TERMINATED, S.FAILED} == TERMINAL_STATES
    assert set(InstanceState) - TERMINAL_STATES == LIVE_STATES


def test_every_live_state_can_reach_an_end() -> None:
    for start in LIVE_STATES:
        seen, frontier = {start}, [start]
        while frontier:
            for nxt in TRANSITIONS[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert seen & TERMINAL_STATES, start


def test_unknown_states_are_refused() -> None:
    assert not can_transition("running", "exploded")
    with pytest.raises(InvalidTransitionError):
        check_transition("limbo", "running")


def test_invalid_transition_is_a_conflict() -> None:
    assert issubclass(InvalidTransitionError, ConflictError)


def test_parse_state() -> None:
    assert parse_state("draining") is S.DRAINING
    with pytest.raises(ValueError, match="unknown instance state 'up' \\(known: requested"):
        parse_state("up")


def test_the_fleet_command_lists_the_live_states() -> None:
    # `heteroplane fleet` names the live states itself (the client commands stay light).
    assert set(LIVE_INSTANCE_STATES) == {state.value for state in LIVE_STATES}
