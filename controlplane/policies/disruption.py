"""The disruption budget: how many serving instances of an app may be drained per window of time
when nobody forced it (Kubernetes' PodDisruptionBudget and Karpenter's disruption budgets keep
the same guard: voluntary disruptions are rate-limited, involuntary ones are not).

A policy in the STYLE.md sense: pure, no clock; the reconciler passes the counts in. The rule:

- a *disruption* is a serving (``running``) instance moved out of service, whatever the cause;
  the ones made in the last ``window_s`` count against the budget;
- the budget of a window is ``max(N, floor(P x S))`` disruptions, where ``N`` is
  ``max_instances``, ``P`` is ``max_share`` and ``S`` is the app's serving fleet at the start of
  the window (the instances serving now plus those disrupted within the window);
- only *voluntary* drains wait for it: a plan or tuner shrink (the reconciler's rule 5). A drain
  the budget forces (the fleet costs more than the app's budget, which is a hard limit) and a
  teardown (``heteroplane app down``) happen at once, and still count, so that voluntary drains
  wait behind them. Instances that do not serve yet (requested, pending) are not disruptions.

The last instance of each planned stage is another guard, kept by the drain policy
(:mod:`controlplane.policies.drain`, ``spare_last_serving`` and ``plan_drain``'s keepers).

>>> budget = DisruptionBudget(max_instances=1, max_share=0.25, window_s=60.0)
>>> budget.allowance(serving=3), budget.allowance(serving=8)
(1, 2)
>>> budget.remaining(serving_now=7, disrupted_in_window=1)
1
>>> budget.remaining(serving_now=2, disrupted_in_window=1)
0
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from controlplane.policies.lifecycle import InstanceState

__all__ = [
    "DEFAULT_DISRUPTION_MAX_INSTANCES",
    "DEFAULT_DISRUPTION_MAX_SHARE",
    "DEFAULT_DISRUPTION_WINDOW_S",
    "DisruptionBudget",
    "count_disruptions",
]

# One instance or a quarter of the fleet per minute: a fleet of up to seven loses one serving
# instance a minute; at the tuner's 15 s scale-down delay, a fleet that shrinks by half
# still gets there in a few minutes, while a bad plan cannot empty it between two looks.
DEFAULT_DISRUPTION_MAX_INSTANCES = 1
DEFAULT_DISRUPTION_MAX_SHARE = 0.25
DEFAULT_DISRUPTION_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class DisruptionBudget:
    """At most ``max(max_instances, floor(max_share x S))`` serving instances of an app drained
    voluntarily per ``window_s`` (see the module docstring). ``max_instances`` >= 0,
    ``max_share`` in [0, 1], ``window_s`` > 0; a budget of ``max_instances=0`` and
    ``max_share=0`` defers every voluntary drain of a serving instance."""

    max_instances: int = DEFAULT_DISRUPTION_MAX_INSTANCES
    max_share: float = DEFAULT_DISRUPTION_MAX_SHARE
    window_s: float = DEFAULT_DISRUPTION_WINDOW_S

    def __post_init__(self) -> None:
        if self.max_instances < 0:
            raise ValueError(f"max_instances must be >= 0, got {self.max_instances}")
        if not 0.0 <= self.max_share <= 1.0:
            raise ValueError(f"max_share must be in [0, 1], got {self.max_share!r}")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"window_s must be finite and > 0, got {self.window_s!r}")

    def allowance(self, serving: int) -> int:
        """Disruptions a window allows a fleet of ``serving`` instances: max(N, floor(P x S))
        (a small tolerance so that 25% of 8 is 2, not 1.999...)."""
        return max(self.max_instances, math.floor(self.max_share * max(serving, 0) + 1e-9))

    def remaining(self, serving_now: int, disrupted_in_window: int) -> int:
        """How many more serving instances may go now: the window's allowance on the fleet as
        it was at the window's start (``serving_now + disrupted_in_window``), less what the
        window has used."""
        used = max(disrupted_in_window, 0)
        return max(0, self.allowance(max(serving_now, 0) + used) - used)


class _StateChange(Protocol):
    @property
    def instance_id(self) -> str: ...
    @property
    def from_state(self) -> str | None: ...
    @property
    def to_state(self) -> str: ...


# The moves out of service that are disruptions.
_OUT_OF_SERVICE = frozenset({InstanceState.DRAINING.value, InstanceState.TERMINATING.value})


def count_disruptions(events: Iterable[_StateChange], of: Collection[str] | None = None) -> int:
    """The disruptions among an app's instance events (oldest first): serving (``running``)
    instances moved to draining or terminating, less those taken back since (draining ->
    running: the instance serves again, and counts among those serving, where counting it here
    too had taken one instance for two in the budget's S and allowance); ``of``: only those of
    these instance ids (``None``: every one).

    >>> from types import SimpleNamespace as E
    >>> moves = [E(instance_id="a", from_state="running", to_state="draining"),
    ...          E(instance_id="b", from_state="pending", to_state="terminating"),
    ...          E(instance_id="c", from_state="running", to_state="terminating")]
    >>> count_disruptions(moves), count_disruptions(moves, of={"a", "b"})
    (2, 1)
    >>> count_disruptions([*moves, E(instance_id="a", from_state="draining", to_state="running")])
    1
    """
    out: dict[str, int] = {}
    for e in events:
        if of is not None and e.instance_id not in of:
            continue
        if e.from_state == InstanceState.RUNNING.value and e.to_state in _OUT_OF_SERVICE:
            out[e.instance_id] = out.get(e.instance_id, 0) + 1
        elif e.from_state == InstanceState.DRAINING.value and e.to_state == _RUNNING:
            out[e.instance_id] = max(0, out.get(e.instance_id, 0) - 1)
    return sum(out.values())


_RUNNING = InstanceState.RUNNING.value
