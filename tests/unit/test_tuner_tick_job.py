"""The service's tuner-tick job (``controlplane.service.build.build_scheduler``): the store's apps
are read once a tick and the same snapshot goes to the tuner, the INFaaS scaler, the gear
refresh and the calibrator, in that order. Each of them listing the apps again cost the serving
process's interpreter a transaction each, every second (docs/serving.md, "Through the API").

The sub-loops are stand-ins that record what they were given; the job is called directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from controlplane.clock import SystemClock
from controlplane.loops.calibration import ProfileCalibrator
from controlplane.loops.infaas_scaler import InfaasScaler
from controlplane.loops.live_gears import LiveGears
from controlplane.loops.live_tuner import LiveTuner
from controlplane.service.build import build_scheduler
from controlplane.settings import Settings


class CountingStore:
    def __init__(self, apps: list[str]) -> None:
        self.apps = apps
        self.listings = 0

    def list_apps(self) -> list[str]:
        self.listings += 1
        return list(self.apps)


class SubLoop:
    """What the job calls on each sub-loop, recording (its name, the apps it got)."""

    def __init__(self, name: str, seen: list[tuple[str, Any]]) -> None:
        self.name = name
        self.seen = seen

    def tick(self, apps: Sequence[str] | None = None) -> list[Any]:
        self.seen.append((self.name, apps))
        return []

    def refresh(self, capped: Callable[[str], bool], apps: Sequence[str] | None = None) -> None:
        self.seen.append((self.name, apps))

    def budget_capped(self, app: str) -> bool:
        return False


def test_one_read_of_the_apps_serves_every_sub_loop_of_a_tick() -> None:
    store = CountingStore(["a", "b"])
    seen: list[tuple[str, Any]] = []
    scheduler = build_scheduler(
        Settings(),
        cast(Any, store),
        SystemClock(),
        live_tuner=cast(LiveTuner, SubLoop("tuner", seen)),
        infaas_scaler=cast(InfaasScaler, SubLoop("infaas", seen)),
        live_gears=cast(LiveGears, SubLoop("gears", seen)),
        calibrator=cast(ProfileCalibrator, SubLoop("calibration", seen)),
    )
    assert scheduler.jobs["tuner_tick"]() == "ran"
    assert store.listings == 1
    assert [name for name, _ in seen] == ["tuner", "infaas", "gears", "calibration"]
    assert all(apps == ["a", "b"] for _, apps in seen)
    # The next tick reads the store again: a snapshot lives for one tick only.
    store.apps.append("c")
    assert scheduler.jobs["tuner_tick"]() == "ran"
    assert store.listings == 2
    assert all(apps == ["a", "b", "c"] for _, apps in seen[4:])
