"""The service's tuner-tick job (``controlplane.service.build.build_scheduler``): the store's apps
are read once a tick and the same snapshot goes to the tuner, the INFaaS scaler, the gear
refresh and the calibrator, in that order. Each of them listing the apps again cost the serving
process's interpreter a transaction each, every second (docs/serving.md, "Through the API").

The sub-loops are stand-ins that record what they were given; the job is called directly. A
budget cut seen by a tick runs the reconcile job at once (its drain within a tick of the change).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, cast

from controlplane.clock import SystemClock
from controlplane.loops.calibration import ProfileCalibrator
from controlplane.loops.infaas_scaler import InfaasScaler
from controlplane.loops.live_gears import LiveGears
from controlplane.loops.live_tuner import LiveTuner
from controlplane.service.build import build_scheduler
from controlplane.settings import Settings


def app(name: str, budget: float = 1.0) -> Any:
    return SimpleNamespace(name=name, budget_usd_per_hr=budget)


class CountingStore:
    def __init__(self, apps: list[Any], instances: list[Any] | None = None) -> None:
        self.apps = apps
        self.instances = instances or []
        self.listings = 0

    def list_apps(self) -> list[Any]:
        self.listings += 1
        return list(self.apps)

    def list_instances(self, app: str, states: Any = None) -> list[Any]:
        wanted = None if states is None else {str(s) for s in states}
        return [
            i for i in self.instances if i.app == app and (wanted is None or str(i.state) in wanted)
        ]


class Reconciler:
    """Counts its ticks (the reconcile job's body runs ``run_once``)."""

    def __init__(self) -> None:
        self.runs = 0

    def run_once(self) -> Any:
        self.runs += 1
        return SimpleNamespace(apps={})


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
    a, b = app("a"), app("b")
    store = CountingStore([a, b])
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
    assert all(apps == [a, b] for _, apps in seen)
    # The next tick reads the store again: a snapshot lives for one tick only.
    c = app("c")
    store.apps.append(c)
    assert scheduler.jobs["tuner_tick"]() == "ran"
    assert store.listings == 2
    assert all(apps == [a, b, c] for _, apps in seen[4:])


def scheduler_of(
    store: CountingStore, reconciler: Reconciler, seen: list[tuple[str, Any]], **more: Any
) -> Any:
    """The service's scheduler over the stand-ins: the reconciler and the tuner (and ``more``)."""
    return build_scheduler(
        Settings(),
        cast(Any, store),
        SystemClock(),
        reconciler=cast(Any, reconciler),
        live_tuner=cast(LiveTuner, SubLoop("tuner", seen)),
        **more,
    )


def test_a_budget_cut_runs_the_reconcile_job_at_once() -> None:
    """A budget lowered under what the fleet costs: the tick that sees it runs the reconcile job
    after the tuner (the reconciler drains the fleet to it then, not at its next period, up to
    5 s later: a tester saw the fleet cost twice the budget for 4 s); a raise, a new app, the
    first tick, or a cut the fleet still fits do not."""
    fleet = [SimpleNamespace(app="a", cost_usd_per_hr=0.1, state="running") for _ in range(2)]
    store = CountingStore([app("a", 0.3)], fleet)
    reconciler = Reconciler()
    seen: list[tuple[str, Any]] = []
    scheduler = scheduler_of(store, reconciler, seen)
    tick = scheduler.jobs["tuner_tick"]
    assert tick() == "ran" and reconciler.runs == 0  # the first tick: nothing to compare
    store.apps = [app("a", 0.5), app("b", 0.1)]
    assert tick() == "ran" and reconciler.runs == 0  # a raise and a new app
    store.apps = [app("a", 0.2), app("b", 0.1)]
    assert tick() == "ran" and reconciler.runs == 0  # a cut the fleet (0.2 USD/hr) fits
    store.apps = [app("a", 0.15), app("b", 0.1)]
    assert tick() == "ran" and reconciler.runs == 1  # under the fleet: reconciled at once
    assert tick() == "ran" and reconciler.runs == 1  # once per cut
    assert scheduler.jobs["reconcile"].stats.runs == 1
    # A cut while a periodic reconcile runs (that run may have read the fleet before the cut):
    # the call is skipped, and the next tick reconciles for it.
    running = scheduler.jobs["reconcile"]._running
    running.acquire()
    store.apps = [app("a", 0.12), app("b", 0.1)]
    assert tick() == "ran" and reconciler.runs == 1
    running.release()
    assert tick() == "ran" and reconciler.runs == 2
    assert tick() == "ran" and reconciler.runs == 2


def test_a_cut_seen_while_the_reconcile_job_runs_is_reconciled_after_its_step() -> None:
    """The reconcile job runs the re-planners and the rollouts' tick after the reconciler
    (seconds where one plans); a cut the tuner tick sees meanwhile (its call of the job
    skipped) is reconciled by the job itself after the step it is in, not after the whole job
    and the next tuner tick (a tester saw a fleet over a budget cut for 4.2 s in a rollout's
    middle)."""
    fleet = [SimpleNamespace(app="a", cost_usd_per_hr=0.1, state="running") for _ in range(2)]
    store = CountingStore([app("a", 0.3)], fleet)
    reconciler = Reconciler()
    seen: list[tuple[str, Any]] = []
    runs_after: list[int] = []

    class Rollouts:
        def claim_workers(self) -> None:
            pass

        def tick(self) -> list[Any]:
            # The budget is cut while this step runs, and the tuner tick sees it.
            store.apps = [app("a", 0.15)]
            assert scheduler.jobs["tuner_tick"]() == "ran"
            runs_after.append(reconciler.runs)  # the tick's call was skipped: the job runs
            return []

    scheduler = scheduler_of(store, reconciler, seen, rollouts=cast(Any, Rollouts()))
    assert scheduler.jobs["tuner_tick"]() == "ran"  # the first tick: the budgets to compare
    assert scheduler.jobs["reconcile"]() == "ran"
    assert runs_after == [1]  # the job's own pass, then the cut inside its rollouts' step
    assert reconciler.runs == 2  # reconciled again after the step, within the same job
