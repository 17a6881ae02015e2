"""The serving loop's watch on the cyclic garbage collector (controlplane/serving/collector.py):
what survives a full collection is frozen at the next step, and the whole heap is collected once
every thaw period."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest

from controlplane.serving.collector import FullCollections


class FakeCollector:
    """The gc module's callbacks, freeze, unfreeze and collect, recorded."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[str, dict[str, Any]], None]] = []
        self.calls: list[str] = []

    def run(self, generation: int) -> None:
        for callback in list(self.callbacks):
            callback("start", {"generation": generation})
        for callback in list(self.callbacks):
            callback("stop", {"generation": generation, "collected": 0, "uncollectable": 0})

    def freeze(self) -> None:
        self.calls.append("freeze")

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")

    def collect(self, generation: int = 2) -> int:
        self.calls.append("collect")
        self.run(generation)
        return 0


def test_the_survivors_of_a_full_collection_are_frozen_at_the_next_step() -> None:
    collector, now = FakeCollector(), [0.0]
    watch = FullCollections(thaw_s=100.0, clock_s=lambda: now[0], collector=collector)
    watch.step()
    assert collector.calls == []  # not installed: nothing seen
    watch.install()
    watch.install()
    assert len(collector.callbacks) == 1
    collector.run(0)
    collector.run(1)
    watch.step()
    assert collector.calls == []  # young collections: nothing to freeze
    collector.run(2)
    assert collector.calls == []  # never inside the collection
    watch.step()
    watch.step()
    assert collector.calls == ["freeze"] and watch.frozen == 1
    watch.uninstall()
    assert collector.callbacks == []
    collector.run(2)
    watch.step()
    assert collector.calls == ["freeze"]


def test_the_whole_heap_is_collected_once_a_thaw_period() -> None:
    collector, now = FakeCollector(), [0.0]
    watch = FullCollections(thaw_s=100.0, clock_s=lambda: now[0], collector=collector)
    watch.install()
    now[0] = 99.0
    watch.step()
    assert collector.calls == []
    now[0] = 100.0
    watch.step()
    # Its own full collection leaves nothing for the next step to freeze again.
    assert collector.calls == ["unfreeze", "collect", "freeze"] and watch.thawed == 1
    watch.step()
    assert collector.calls == ["unfreeze", "collect", "freeze"]
    now[0] = 150.0
    collector.run(2)
    watch.step()
    assert collector.calls[-1] == "freeze" and watch.frozen == 1
    now[0] = 199.0
    watch.step()
    now[0] = 200.0
    watch.step()
    assert watch.thawed == 2


def test_with_the_real_collector_a_full_collections_survivors_leave_its_reach() -> None:
    watch = FullCollections(thaw_s=3600.0)
    watch.install()
    try:
        survivors = [[i] for i in range(1000)]  # tracked, alive: long-lived
        before = gc.get_freeze_count()
        gc.collect()
        watch.step()
        assert gc.get_freeze_count() >= before + len(survivors)
        assert watch.frozen == 1
    finally:
        watch.uninstall()
        gc.unfreeze()


def test_a_thaw_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="thaw_s"):
        FullCollections(thaw_s=0.0)
