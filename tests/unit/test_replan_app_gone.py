"""A re-planner's pass over the apps it listed: an app deleted meanwhile is not a warning (the
log said ``replan: ifa not re-planned: no app 'ifa'`` after every ``app down``); any other
failure still is."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from controlplane.errors import NotFoundError
from controlplane.loops.capacity_replan import each_planned_app


def test_an_app_deleted_meanwhile_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    apps = [SimpleNamespace(name=n, applied_plan_id=1) for n in ("deleted", "broken", "fine")]
    store = SimpleNamespace(list_apps=lambda: apps)

    def check(app: SimpleNamespace) -> bool:
        if app.name == "deleted":
            raise NotFoundError("app", app.name)
        if app.name == "broken":
            raise NotFoundError("plan", 7)
        return True

    memory = {"deleted": 1, "old": 2}
    with caplog.at_level(logging.DEBUG):
        replanned = each_planned_app(store, memory, check, "replan")  # type: ignore[arg-type]
    assert replanned == ["fine"] and "old" not in memory
    levels = {r.getMessage().split(":")[1].split()[0]: r.levelname for r in caplog.records}
    assert levels == {"deleted": "DEBUG", "broken": "WARNING"}
