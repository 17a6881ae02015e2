"""Use case: a spec that hands an app's scaling to another loop (``scaling: inferline`` <->
``infaas``) is recorded as a ``scaling_switched`` decision.

The loop the app is handed to starts from the fleet that runs, not from the fleet it had reached
before the app left it: the other loop moved the fleet since. A loop sees the switch itself
when it runs through it; the decision is what a loop that did not (a new leader, a restarted
loops process) reads (:func:`controlplane.loops.infaas_scaler.switched_since`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.db.store.decisions import Words
from controlplane.policies import scaling

__all__ = ["SCALING_SWITCHED", "scaling_switch"]

# The decision's kind.
SCALING_SWITCHED = "scaling_switched"


def scaling_switch(old: Mapping[str, Any], new: Mapping[str, Any], who: str) -> Words:
    """The ``scaling_switched`` decision when spec ``new`` hands the app's live scaling to
    another loop than spec ``old`` did (numbers ``from``, ``to``: the specs' ``scaling``
    values, the default spelt out), written with the spec (:meth:`AppStore.update_app`'s
    ``said``: a crash between the two left a loop started again on the fleet it had reached
    before the app left it); none when the loop stays."""
    before = old.get("scaling") or scaling.DEFAULT_LIVE
    after = new.get("scaling") or scaling.DEFAULT_LIVE
    if scaling.live_owner(before) == scaling.live_owner(after):
        return []
    return [
        (
            SCALING_SWITCHED,
            f"scaling switched from {before} to {after} by {who}: {after} starts from the fleet"
            " that runs",
            {"from": before, "to": after},
        )
    ]
