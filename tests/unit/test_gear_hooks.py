"""The serving loop's gear hook as the service composes it: the gear switcher's gear for a
cascade, else the tuner's batch cap for a single model sized by its ladder (docs/tuner.md,
"The rung's batch, live")."""

from __future__ import annotations

from typing import Any

from controlplane.loops.live_gears import GearTable
from controlplane.service.build import _either_gear
from controlplane.serving.config import ServingGear, batch_gear
from estimator.cascades import Cascade


def test_the_switchers_gear_comes_first_then_the_tuners_cap() -> None:
    cascade = ServingGear(Cascade(("tiny", "large"), (0.8,)), {"tiny": 8, "large": 2})
    switcher = {"shop": cascade}
    tuner = {"shop": batch_gear("large", 4), "recs": batch_gear("m", 2)}
    hook = _either_gear(switcher.get, tuner.get)
    assert hook("shop") is cascade
    assert hook("recs") == ServingGear(Cascade(("m",), ()), {"m": 2})
    assert hook("other") is None


def test_a_cap_is_at_least_one_query() -> None:
    assert batch_gear("m", 0).max_batch_queries == {"m": 1}


def test_the_gear_table_serves_the_caps_it_was_last_sent() -> None:
    store: Any = object()  # the caps never read the store (only a new gear plan does)
    table = GearTable(store)
    table.set_caps({"recs": {"m": 4}, "odd": {"a": 2, "b": 2}})
    gear = table.gear("recs")
    assert gear is not None and gear.max_batch_queries == {"m": 4}
    assert table.gear("odd") is None  # one model's cap only: a cascade's come with its gears
    table.set_caps({})
    assert table.gear("recs") is None


def test_a_cap_sent_again_keeps_its_gear() -> None:
    # The dispatcher places again on a new gear object: ten feeds a second must not make one.
    store: Any = object()
    table = GearTable(store)
    table.set_caps({"recs": {"m": 4}})
    first = table.gear("recs")
    table.set_caps({"recs": {"m": 4}})
    assert table.gear("recs") is first
    table.set_caps({"recs": {"m": 2}})
    moved = table.gear("recs")
    assert moved is not first and moved is not None and moved.max_batch_queries == {"m": 2}
