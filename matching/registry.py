"""Dispatch policies by name: the one list of them, and one :func:`make`.

Each policy is a class that carries its ``name``, what it needs as class attributes
(:class:`matching.policy.RegisteredPolicy`: a base type, a threshold, prediction noise, whether
a plan may name it, whether its mixed-fleet capacity is Kairos' matching bound) and a
``factory(setting)`` classmethod. Callers read those attributes instead of comparing names.

:data:`POLICIES` names each built-in policy's class by module path, so importing this module
loads neither numpy nor the policies: the command line reads :func:`names` for its choices
and stays fast (docs/cli.md). A policy's module is imported the first time it is asked for.
Adding a policy is its module plus one line here, or :func:`register` on the class (a test's
throw-away policy, an extension)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from matching.errors import MatchingError
from matching.policy import DispatchPolicy, PolicySetting, RegisteredPolicy

__all__ = [
    "POLICIES",
    "PolicySettingError",
    "UnknownPolicyError",
    "make",
    "names",
    "noise_refused",
    "plan_names",
    "policy_class",
    "register",
]

# name -> "module:Class" (imported when first used) or the class itself (registered).
POLICIES: dict[str, str | type[RegisteredPolicy]] = {
    "fcfs": "matching.fcfs:FcfsPolicy",
    "drs": "matching.drs:DrsPolicy",
    "clockwork": "matching.clockwork:ClockworkPolicy",
    "kairos": "matching.kairos:KairosPolicy",
}


class UnknownPolicyError(MatchingError):
    """A dispatch policy name that is not registered."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown policy {name!r} (one of {', '.join(names())})")


class PolicySettingError(MatchingError):
    """A setting that lacks what a policy's class says it needs (``policy`` is its name)."""

    def __init__(self, policy: str, problem: str) -> None:
        self.policy = policy
        super().__init__(problem)


def names() -> tuple[str, ...]:
    """Every registered policy's name, in registration order."""
    return tuple(POLICIES)


def policy_class(name: str) -> type[RegisteredPolicy]:
    """The class registered as ``name`` (its module imported on first use).

    Raises:
        UnknownPolicyError: no policy has that name.
    """
    entry = POLICIES.get(name)
    if entry is None:
        raise UnknownPolicyError(name)
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = cast("type[RegisteredPolicy]", getattr(importlib.import_module(module), attribute))
        POLICIES[name] = entry
    return entry


def plan_names() -> tuple[str, ...]:
    """The policies a plan may name (``in_plans``)."""
    return tuple(name for name in POLICIES if policy_class(name).in_plans)


def register(cls: type[RegisteredPolicy]) -> type[RegisteredPolicy]:
    """Register ``cls`` under its ``name`` (usable as a class decorator); a name already taken
    by another class is an error."""
    taken = POLICIES.get(cls.name)
    if taken is not None and taken is not cls and policy_class(cls.name) is not cls:
        raise MatchingError(f"a dispatch policy named {cls.name!r} is already registered")
    POLICIES[cls.name] = cls
    return cls


def noise_refused(name: str) -> PolicySettingError:
    """The error for prediction noise asked of ``name``, a policy that takes none."""
    takers = " and ".join(n for n in names() if policy_class(n).takes_noise) or "no"
    return PolicySettingError(
        name, f"prediction noise applies to the {takers} policy only, not {name!r}"
    )


def make(name: str, setting: PolicySetting) -> Callable[[], DispatchPolicy]:
    """A maker of fresh ``name`` policies for ``setting``, after checking that the setting
    gives the policy what its class says it needs.

    Raises:
        UnknownPolicyError: no policy has that name.
        PolicySettingError: a needed base type or threshold is missing, or noise for a policy that
            takes none.
    """
    cls = policy_class(name)
    if setting.noise_share and not cls.takes_noise:
        raise noise_refused(name)
    if cls.needs_base_type and not setting.base_types:
        raise PolicySettingError(name, f"the {name} policy needs a base type")
    if cls.needs_threshold and setting.threshold is None:
        raise PolicySettingError(
            name, f"the {name} policy needs a batch-size threshold (--drs-threshold)"
        )
    return cls.factory(setting)
