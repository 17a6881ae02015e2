"""Scaling policies by name: who changes a plan's fleet as the load changes, the one list of them.

Each policy is a :class:`ScalingEntry` whose attributes say what it does, read by the callers
instead of comparing names: ``replays``, the function (as ``"module:function"``, imported when
first asked for, so the command line lists the names without numpy) that rolls it over a trace
for ``heteroplane replay`` (:data:`controlplane.policies.replay.TimelineFunction`);
``changes_fleet``, whether it moves the fleet while the trace runs (the tuner, the utilisation
autoscaler) or holds one (static, the baselines); ``scales_cascades``, whether it scales a plan of
several stages (one per stage, within the one budget); ``plans_itself``, a baseline that plans for
the replayed trace (its peak or mean rate, :mod:`controlplane.policies.baselines`) and holds that
fleet; ``live``, the spec's ``scaling:`` value that hands a running app's fleet to it (``None``:
offline only).

Adding a replayed policy is its timeline function and one entry here (or :func:`register`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_LIVE",
    "POLICIES",
    "ScalingEntry",
    "UnknownScalingPolicyError",
    "entry",
    "live_names",
    "live_owner",
    "names",
    "register",
    "replay_names",
    "timeline_function",
]


@dataclass(frozen=True, slots=True)
class ScalingEntry:
    """A scaling policy (see the module docstring)."""

    name: str
    replays: str | Callable[..., Any] | None = None
    changes_fleet: bool = False
    scales_cascades: bool = False
    plans_itself: bool = False
    live: str | None = None


POLICIES: dict[str, ScalingEntry] = {
    e.name: e
    for e in (
        ScalingEntry(
            "tuner",
            "controlplane.policies.replay:tuner_policy_timeline",
            changes_fleet=True,
            scales_cascades=True,
            live="inferline",
        ),
        ScalingEntry(
            "static", "controlplane.policies.replay:static_policy_timeline", scales_cascades=True
        ),
        ScalingEntry(
            "peak", "controlplane.policies.replay:static_policy_timeline", plans_itself=True
        ),
        ScalingEntry(
            "mean", "controlplane.policies.replay:static_policy_timeline", plans_itself=True
        ),
        ScalingEntry(
            "utilization",
            "controlplane.policies.replay:utilization_policy_timeline",
            changes_fleet=True,
        ),
        ScalingEntry("infaas", changes_fleet=True, live="infaas"),
    )
}


class UnknownScalingPolicyError(ValueError):
    """A scaling policy name that is not registered (or not one that replays, ``replay``)."""

    def __init__(self, name: str, choices: tuple[str, ...]) -> None:
        self.name = name
        super().__init__(f"unknown scaling policy {name!r} ({', '.join(choices)})")


def names() -> tuple[str, ...]:
    """Every scaling policy's name, in registration order."""
    return tuple(POLICIES)


def replay_names() -> tuple[str, ...]:
    """The policies ``heteroplane replay`` runs."""
    return tuple(name for name, e in POLICIES.items() if e.replays is not None)


def live_names() -> tuple[str, ...]:
    """The spec's ``scaling:`` values: who may scale a running app."""
    return tuple(e.live for e in POLICIES.values() if e.live is not None)


# What the spec's ``scaling:`` says when it says nothing (controlplane.spec.AppSpec).
DEFAULT_LIVE = "inferline"


def live_owner(value: str | None) -> str:
    """The policy that scales a running app whose spec says ``scaling: value`` (``None``: the
    spec's default), e.g. ``tuner`` for ``inferline``: each live loop takes the apps it owns.

    Raises:
        UnknownScalingPolicyError: no policy scales live under that value.
    """
    wanted = DEFAULT_LIVE if value is None else value
    for found in POLICIES.values():
        if found.live == wanted:
            return found.name
    raise UnknownScalingPolicyError(wanted, live_names())


def entry(name: str) -> ScalingEntry:
    """The policy registered as ``name``.

    Raises:
        UnknownScalingPolicyError: none is.
    """
    found = POLICIES.get(name)
    if found is None:
        raise UnknownScalingPolicyError(name, names())
    return found


def timeline_function(name: str) -> Callable[..., Any]:
    """The function that rolls ``name`` over a trace for replay (imported on first use).

    Raises:
        UnknownScalingPolicyError: no policy of that name replays.
    """
    found = POLICIES.get(name)
    if found is None or found.replays is None:
        raise UnknownScalingPolicyError(name, replay_names())
    if isinstance(found.replays, str):
        module, _, attribute = found.replays.partition(":")
        function: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
        return function
    return found.replays


def register(new: ScalingEntry) -> ScalingEntry:
    """Register ``new`` under its name (a name already taken is an error)."""
    if new.name in POLICIES and POLICIES[new.name] != new:
        raise ValueError(f"a scaling policy named {new.name!r} is already registered")
    POLICIES[new.name] = new
    return new
