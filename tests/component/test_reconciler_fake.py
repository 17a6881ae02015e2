"""The reconciler on a real store (SQLite through the migrations), the fake provisioner and a
fake clock, tick by tick: launches recorded before acting, restarts that launch nothing twice, a
lowered budget, provider failures, orphans; and a property test over random sequences of all
of them."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db import models as m
from controlplane.db.store import AppRecord, InstanceRecord, Store
from controlplane.loops.reconciler import (
    ENDED_ROWS_S,
    AppPricing,
    Launch,
    Reconciler,
    ReconcileReport,
    Terminate,
)
from controlplane.policies.lifecycle import LIVE_STATES
from controlplane.service.build import build_service
from controlplane.settings import Settings
from provisioners.base import (
    APP_TAG,
    LaunchRequest,
    ProvisionedInstance,
    ProvisionerEvent,
)
from provisioners.fake import FakeProvisioner
from tests.dying_writes import decision_write_fails, instance_move_fails

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
PRICES = {SMALL: 0.05, LARGE: 0.1}
# Q_t: a large serves 4x a small for 2x the price, so it is the more cost-effective.
QPS = {SMALL: 10.0, LARGE: 40.0}
APP = "recs"
STRAGGLER_S = 300.0
GRACE_S = 30.0
_KEPT = ("requested", "pending", "running")


def spec(budget: float) -> dict[str, Any]:
    return {
        "name": APP,
        "models": [{"name": "tiny", "profiles": "profiles.json"}],
        "slo": {"latency_ms": 50},
        "budget_usd_per_hr": budget,
        "instance_types": [SMALL, LARGE],
    }


def pricing(_app: AppRecord) -> AppPricing:
    return AppPricing(PRICES, QPS)


def apply_fleet(store: Store, fleet: Mapping[str, int]) -> None:
    document = {
        "feasible": True,
        "cost_usd_per_hr": sum(PRICES.get(t, 1.0) * n for t, n in fleet.items()),
        "stages": [{"name": "tiny", "fleet": dict(fleet)}],
    }
    plan = store.create_plan(APP, document)
    store.apply_plan(APP, plan.id)


def kept_cost(store: Store) -> float:
    return sum(i.price_usd_per_hr for i in store.list_instances(APP, states=_KEPT))


def by_state(store: Store) -> dict[str, int]:
    counts: dict[str, int] = {}
    for instance in store.list_instances(APP):
        counts[instance.state] = counts.get(instance.state, 0) + 1
    return counts


def live_types(store: Store) -> dict[str, int]:
    counts: dict[str, int] = {}
    for instance in store.list_instances(APP, states=_KEPT):
        counts[instance.instance_type] = counts.get(instance.instance_type, 0) + 1
    return counts


class CrashError(Exception):
    """The control plane dies in the middle of a tick."""


class SpyProvisioner:
    """The fake, with hooks: look at the store when the provider is asked to launch, or die
    right after the provider launched (before the answer is recorded)."""

    name = "spy"

    def __init__(self, fake: FakeProvisioner) -> None:
        self.fake = fake
        self.on_launch: list[Any] = []
        self.crash_after_launch = False

    def launch(self, request: LaunchRequest) -> list[ProvisionedInstance]:
        for hook in self.on_launch:
            hook(request)
        launched = self.fake.launch(request)
        if self.crash_after_launch:
            self.crash_after_launch = False
            raise CrashError(request.request_id)
        return launched

    def terminate(self, provider_ids: Sequence[str]) -> None:
        self.fake.terminate(provider_ids)

    def poll_events(self) -> list[ProvisionerEvent]:
        return self.fake.poll_events()

    def list(self, tags: Mapping[str, str]) -> list[ProvisionedInstance]:
        return self.fake.list(tags)


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database migrated once; each test (and each hypothesis example) copies it."""
    path = tmp_path_factory.mktemp("template") / "heteroplane.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@dataclass
class World:
    """A control plane (store + reconciler) over one database file and one fake provider."""

    path: Path
    clock: FakeClock
    fake: FakeProvisioner
    spy: SpyProvisioner
    store: Store
    reconciler: Reconciler

    @classmethod
    def create(cls, template: Path, directory: Path, budget: float = 1.0) -> World:
        path = directory / "heteroplane.db"
        shutil.copy(template, path)
        clock = FakeClock()
        fake = FakeProvisioner(now=clock.utcnow)
        spy = SpyProvisioner(fake)
        store = Store.from_url(f"sqlite:///{path}", clock)
        store.create_app(spec(budget), who="test")
        return cls(path, clock, fake, spy, store, cls._reconciler(store, spy, clock))

    @staticmethod
    def _reconciler(store: Store, spy: SpyProvisioner, clock: FakeClock) -> Reconciler:
        return Reconciler(
            store,
            spy,
            clock,
            pricing,
            straggler_timeout_s=STRAGGLER_S,
            missing_grace_s=GRACE_S,
        )

    def restart(self) -> None:
        """A new control plane process: a new store object and reconciler, same database and
        same provider."""
        self.store.close()
        self.store = Store.from_url(f"sqlite:///{self.path}", self.clock)
        self.reconciler = self._reconciler(self.store, self.spy, self.clock)

    def tick(self, seconds: float = 5.0) -> ReconcileReport:
        self.clock.advance(seconds)
        return self.reconciler.run_once()

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def world(template_db: Path, tmp_path: Path) -> Iterator[World]:
    w = World.create(template_db, tmp_path)
    yield w
    w.close()


def decisions(store: Store, kind: str) -> list[Any]:
    return store.list_decisions(APP, kinds=[kind])


# --- launching -------------------------------------------------------------------------------


def test_launches_are_recorded_before_the_provider_is_asked(world: World) -> None:
    seen_at_launch: list[tuple[str, str | None, bool]] = []

    def check(request: LaunchRequest) -> None:
        rows = {r.request_id: r for r in world.store.list_instances(APP)}
        row = rows.get(request.request_id)
        (decision,) = decisions(world.store, "launch")
        listed = [launch["request_id"] for launch in decision.numbers["launches"]]
        seen_at_launch.append(
            (
                row.state if row is not None else "missing",
                row.provider_id if row is not None else None,
                request.request_id in listed,
            )
        )

    world.spy.on_launch.append(check)
    apply_fleet(world.store, {SMALL: 2, LARGE: 1})
    report = world.tick()
    assert report.apps[APP].count(Launch) == 3
    assert seen_at_launch == [("requested", None, True)] * 3
    assert by_state(world.store) == {"pending": 3}
    assert world.fake.launched_total == 3
    world.fake.step()
    world.tick()
    assert by_state(world.store) == {"running": 3}
    assert live_types(world.store) == {SMALL: 2, LARGE: 1}
    # The provider's instances carry the row's id and the app.
    rows = {r.provider_id: r for r in world.store.list_instances(APP)}
    for instance in world.fake.list({}):
        assert instance.tags["heteroplane:instance-id"] == rows[instance.provider_id].id
        assert instance.tags[APP_TAG] == APP


def test_a_restart_launches_nothing_twice(world: World) -> None:
    apply_fleet(world.store, {SMALL: 2, LARGE: 2})
    world.tick()
    world.restart()
    world.tick()
    world.fake.step()
    world.restart()
    for _ in range(3):
        world.tick()
    assert world.fake.launched_total == 4
    assert by_state(world.store) == {"running": 4}
    assert len(decisions(world.store, "launch")) == 1


def test_launches_recorded_and_never_said_are_said_once_by_the_restarted_reconciler(
    world: World,
) -> None:
    """The process dies after the launches' rows and before their decision (the crash point
    ``reconcile.after_row``; here the decision's write fails): the restarted reconciler launches
    the rows again under their request ids and says so, once. It used to launch them as retries,
    which say nothing: instances ran that no ``launch`` decision named."""
    apply_fleet(world.store, {SMALL: 2, LARGE: 1})
    with decision_write_fails("launch 1 x emu.cpu.large") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            world.tick()
        assert failing == []
    assert by_state(world.store) == {"requested": 3} and world.fake.launched_total == 0
    assert decisions(world.store, "launch") == []
    world.restart()
    world.tick()
    world.tick()
    world.restart()
    world.tick()
    assert world.fake.launched_total == 3 and by_state(world.store) == {"pending": 3}
    (said,) = decisions(world.store, "launch")
    rows = {r.request_id: r.id for r in world.store.list_instances(APP)}
    assert {(x["request_id"], x["instance_id"]) for x in said.numbers["launches"]} == set(
        rows.items()
    )


def test_a_crash_between_launch_and_record_is_adopted_not_launched_again(world: World) -> None:
    apply_fleet(world.store, {LARGE: 2})
    world.spy.crash_after_launch = True
    with pytest.raises(CrashError):
        world.tick()
    # The first launch went through but its answer was lost: a row requested, no provider id.
    assert by_state(world.store) == {"requested": 2}
    assert world.fake.launched_total == 1
    world.restart()
    world.tick()
    assert world.fake.launched_total == 2
    (adopted,) = decisions(world.store, "adopt")
    assert adopted.numbers["provider_id"] == world.fake.list({})[0].provider_id
    world.fake.step()
    world.tick()
    assert by_state(world.store) == {"running": 2}


def test_an_adoption_whose_row_did_not_move_is_not_said_either(world: World) -> None:
    """The process dies moving the row of a machine it adopts (here the write of the move
    fails): the ``adopt`` decision is not kept either, and the reconciler started again adopts
    it and says it once. The decision used to be written first, in a transaction of its own:
    the reconciler started again adopted the machine again and said it twice."""
    apply_fleet(world.store, {LARGE: 2})
    world.spy.crash_after_launch = True
    with pytest.raises(CrashError):
        world.tick()
    world.restart()
    with instance_move_fails("adopted:") as failing:
        with pytest.raises(RuntimeError, match="died writing the instance_events row"):
            world.tick()
        assert failing == []
    assert decisions(world.store, "adopt") == []
    world.restart()
    world.tick()
    (adopted,) = decisions(world.store, "adopt")
    assert adopted.numbers["provider_id"] == world.fake.list({})[0].provider_id
    assert world.fake.launched_total == 2


# --- the budget ------------------------------------------------------------------------------


def test_a_lowered_budget_terminates_the_least_cost_effective(world: World) -> None:
    apply_fleet(world.store, {SMALL: 2, LARGE: 2})
    world.tick()
    world.fake.step()
    world.tick()
    smalls = {r.id for r in world.store.list_instances(APP) if r.instance_type == SMALL}
    world.store.change_budget(APP, 0.2, reason="cut", who="test")
    # The hook before a drain to the budget (the gear switcher's) runs before any terminate.
    before: list[tuple[str, int]] = []
    world.reconciler.before_budget_drain = lambda app: before.append(
        (app, len(decisions(world.store, "terminate")))
    )
    report = world.tick()
    (drain,) = [a for a in report.apps[APP].actions if isinstance(a, Terminate)]
    assert drain.cause == "budget" and set(drain.instance_ids) == smalls
    assert before == [(APP, 0)] and len(decisions(world.store, "terminate")) == 1
    assert live_types(world.store) == {LARGE: 2}
    assert kept_cost(world.store) <= 0.2 + 1e-9
    # The smalls are stopped at the provider, and end there.
    world.fake.step()
    world.tick()
    assert by_state(world.store) == {"running": 2, "terminated": 2}
    # The plan still wants the smalls: the budget says no, once, not once per tick.
    for _ in range(3):
        world.tick()
    (capped,) = decisions(world.store, "budget_capped")
    assert capped.numbers["wanted"] == {SMALL: 2}
    assert world.fake.launched_total == 4
    assert len(before) == 1  # one drain, one call


def test_a_terminate_whose_rows_did_not_move_is_not_said_either(world: World) -> None:
    """The process dies moving the rows of a terminate it decided (here the write of a row's
    move fails): neither the moves nor the decision are kept, and the reconciler started again
    terminates them and says it once. The decision used to be written first, in a
    transaction of its own: the restarted reconciler decided the terminate again and said it
    twice."""
    apply_fleet(world.store, {SMALL: 2, LARGE: 2})
    world.tick()
    world.fake.step()
    world.tick()
    smalls = {r.id for r in world.store.list_instances(APP) if r.instance_type == SMALL}
    world.store.change_budget(APP, 0.2, reason="cut", who="test")
    with instance_move_fails("budget:") as failing:
        with pytest.raises(RuntimeError, match="died writing the instance_events row"):
            world.tick()
        assert failing == []
    assert decisions(world.store, "terminate") == []
    assert by_state(world.store) == {"running": 4}
    world.restart()
    world.tick()
    (said,) = decisions(world.store, "terminate")
    assert set(said.numbers["instance_ids"]) == smalls
    assert by_state(world.store) == {"running": 2, "terminating": 2}


def test_a_new_plan_that_trades_a_type_keeps_the_old_one_until_the_new_one_serves(
    world: World,
) -> None:
    """A plan applied that serves the stage with another type (a new plan, not the tuner's
    trade within one) is make-before-break: the old type's last serving instance stays until
    the new type's runs (an instance of a type no stage plans serves every stage), also when
    another plan is applied meanwhile, then goes."""
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    world.fake.step()
    world.tick()
    assert live_types(world.store) == {SMALL: 2} and by_state(world.store) == {"running": 2}
    apply_fleet(world.store, {LARGE: 1})
    world.tick()
    assert live_types(world.store) == {SMALL: 1, LARGE: 1}  # one small ends, one serves on
    (kept,) = decisions(world.store, "drain_deferred")
    assert "last" in kept.reason, kept.reason
    apply_fleet(world.store, {LARGE: 2})  # another plan before the large runs
    world.tick()
    assert live_types(world.store) == {SMALL: 1, LARGE: 2}
    world.fake.step()  # the larges boot
    world.tick()
    world.tick(61.0)  # past the disruption budget's window, which the first small's end spent
    assert live_types(world.store) == {LARGE: 2}


def test_each_deferral_episode_is_a_decision_of_its_own(world: World) -> None:
    """A deferral repeated tick after tick is one decision (its count rises); a later trade's
    deferral for the same cause, after ticks without one, is a new decision, not a repeat of
    the old one (one row had read "84x over 17.3 min" over four scale-downs)."""
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    world.fake.step()
    world.tick()
    apply_fleet(world.store, {LARGE: 1})
    world.tick()
    world.tick()  # the large still boots: the small's deferral again, the same episode
    (first,) = decisions(world.store, "drain_deferred")
    assert first.count == 2 and first.numbers["cause"] == "last_instance"
    world.fake.step()
    world.tick()  # the large serves; the small's end waits for the disruption budget
    world.tick(61.0)  # the budget's next window: it goes, nothing deferred
    assert live_types(world.store) == {LARGE: 1}
    apply_fleet(world.store, {SMALL: 1})  # back: the large's end waits for the budget again
    world.tick()
    world.tick()
    waits = [
        r for r in decisions(world.store, "drain_deferred") if r.numbers["cause"] == "disruption"
    ]
    assert [r.count for r in waits] == [1, 1], waits
    assert waits[0].numbers["instance_ids"] != waits[1].numbers["instance_ids"]


@pytest.mark.parametrize("scaling", ["inferline", "infaas"])
def test_infaas_drains_a_stages_only_type_the_tuner_keeps(
    template_db: Path, tmp_path: Path, scaling: str
) -> None:
    """A cascade planned with its last stage on the large type. The tuner's shrink keeps the
    stage's last serving instance until another of its type serves. INFaaS's autoscaler drains
    the dearer type when the other instances carry every model (a downgrade: each worker serves
    the whole family, and a stage with none of its planned types serves on all of them), so the
    reconciler carries that drain out: kept, the large stayed for good, a ``drain_deferred``
    every tick, while the scaler's fleet (and the cost its decisions stated) had it gone."""
    path = tmp_path / "heteroplane.db"
    shutil.copy(template_db, path)
    clock = FakeClock()
    fake = FakeProvisioner(now=clock.utcnow)
    store = Store.from_url(f"sqlite:///{path}", clock)
    try:
        document = {
            **spec(1.0),
            "models": [
                {"name": "tiny", "profiles": "profiles.json"},
                {"name": "large", "profiles": "profiles.json"},
            ],
            "cascade": ["tiny", "large"],
            "scaling": scaling,
        }
        store.create_app(document, who="test")
        plan = store.create_plan(
            APP,
            {
                "feasible": True,
                "cost_usd_per_hr": 0.15,
                "stages": [
                    {"name": "tiny", "fleet": {SMALL: 1}},
                    {"name": "large", "fleet": {LARGE: 1}},
                ],
            },
        )
        store.apply_plan(APP, plan.id)
        desired = {SMALL: 1, LARGE: 1}
        reconciler = Reconciler(
            store,
            fake,
            clock,
            pricing,
            desired_fleet=lambda _app: desired,
            straggler_timeout_s=STRAGGLER_S,
            missing_grace_s=GRACE_S,
        )
        clock.advance(5.0)
        reconciler.run_once()
        fake.step()
        clock.advance(5.0)
        reconciler.run_once()
        assert {i.instance_type: i.state for i in store.list_instances(APP)} == {
            SMALL: "running",
            LARGE: "running",
        }
        desired = {SMALL: 1}  # the scaler's drain of the large
        clock.advance(5.0)
        reconciler.run_once()
        states = {i.instance_type: i.state for i in store.list_instances(APP)}
        deferred = store.list_decisions(APP, kinds=["drain_deferred"])
        if scaling == "infaas":
            # It drains (no new queries), then goes once drained.
            assert states == {SMALL: "running", LARGE: "draining"}
            assert deferred == []
            clock.advance(10.0)
            reconciler.run_once()
            states = {i.instance_type: i.state for i in store.list_instances(APP)}
            assert states == {SMALL: "running", LARGE: "terminating"}
        else:
            assert states == {SMALL: "running", LARGE: "running"}
            assert [d.numbers["cause"] for d in deferred] == ["last_instance"]
    finally:
        store.close()


def test_an_app_taken_down_while_launches_are_decided_launches_none(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``app down`` committed after a tick read that the app was not being taken down and
    before its launches went out: they went out (a tester's sweep saw four RunInstances after
    the teardown request, each terminated on the next tick). The teardown is read again with
    the budget once the rows are written, and none goes."""
    from controlplane.apps import teardown
    from controlplane.loops import reconciler as module

    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    world.fake.step()
    world.tick()
    apply_fleet(world.store, {SMALL: 3})
    reads: list[bool] = []

    def first_read_before_the_mark(store: Store, app: Any) -> bool:
        if not reads:  # the tick's own read, then the app down commits
            teardown.request_teardown(store, APP, who="test")
            reads.append(False)
            return False
        reads.append(teardown.teardown_requested(store, app))
        return reads[-1]

    monkeypatch.setattr(module, "teardown_requested", first_read_before_the_mark)
    report = world.tick()
    assert report.apps[APP].count(Launch) == 2  # decided before the mark
    assert reads == [False, True]
    assert world.fake.launched_total == 1  # the first instance only
    assert by_state(world.store) == {"running": 1, "failed": 2}
    (refused,) = decisions(world.store, "launch_refused")
    assert "the app is being taken down" in refused.reason
    world.tick()  # and the next tick tears the app down
    assert by_state(world.store) == {"terminating": 1, "failed": 2}


def test_a_budget_lowered_while_launches_are_decided_refuses_them(world: World) -> None:
    """run_once reads the apps once; a budget the serving process lowers after that read and
    before the launch's rows are written was not seen: the launch went through at twice the new
    budget until the next tick's guard (a tester's 0.5 -> 0.15 under load). The budget is read
    again after the rows are written, and what no longer fits is not launched."""
    world.store.change_budget(APP, 0.5, reason="room", who="test")
    stale = world.store.get_app(APP)  # what run_once read
    apply_fleet(world.store, {LARGE: 3})
    world.store.change_budget(APP, 0.15, reason="cut", who="test")  # committed meanwhile
    world.clock.advance(5.0)
    report = world.reconciler.reconcile_app(stale, world.fake.list({}))
    assert report.count(Launch) == 3  # decided on the stale budget
    assert world.fake.launched_total == 1  # the first fits the new one: 0.1 <= 0.15
    assert kept_cost(world.store) <= 0.15 + 1e-9
    assert by_state(world.store) == {"pending": 1, "failed": 2}
    (refused,) = decisions(world.store, "launch_refused")
    assert refused.numbers["budget_usd_per_hr"] == 0.15
    assert refused.numbers["decided_budget_usd_per_hr"] == 0.5
    assert len(refused.numbers["instance_ids"]) == 2
    assert "the budget is 0.15 USD/hr now (it was 0.5" in refused.reason
    # The next tick reads the new budget: no further launch, no further refusal.
    world.tick()
    assert world.fake.launched_total == 1 and len(decisions(world.store, "launch_refused")) == 1


def test_a_refusal_whose_second_row_did_not_fail_fails_none_and_says_nothing(
    world: World,
) -> None:
    """The process dies failing the rows of a refused launch (here the write of the second
    row's move): neither the moves nor the ``launch_refused`` decision are kept. The decision
    used to be written after the rows, each move in a transaction of its own: the first row was
    left failed and no decision ever said why."""
    world.store.change_budget(APP, 0.5, reason="room", who="test")
    stale = world.store.get_app(APP)
    apply_fleet(world.store, {LARGE: 3})
    world.store.change_budget(APP, 0.15, reason="cut", who="test")
    world.clock.advance(5.0)
    with instance_move_fails("launch refused", after=1) as failing:
        with pytest.raises(RuntimeError, match="died writing the instance_events row"):
            world.reconciler.reconcile_app(stale, world.fake.list({}))
        assert failing == []
    assert by_state(world.store) == {"requested": 3}
    assert decisions(world.store, "launch_refused") == []
    assert world.fake.launched_total == 0
    # Started again on the budget as it is: one is launched and the others not, each said.
    world.restart()
    world.tick()
    assert by_state(world.store) == {"pending": 1, "failed": 2}
    (launched,) = decisions(world.store, "launch")
    (capped,) = decisions(world.store, "budget_capped")
    assert len(launched.numbers["launches"]) == 1 and capped.numbers["wanted"] == {LARGE: 2}


def test_rows_recorded_meanwhile_count_against_the_launches(world: World) -> None:
    """A profile run's (or a rollout's) workers recorded between this tick's read of the rows
    and its launches are counted before launching: they write their rows before their own check,
    so one of the two sees the other."""
    world.store.change_budget(APP, 0.25, reason="room", who="test")
    apply_fleet(world.store, {LARGE: 2})
    artifacts = world.reconciler.artifacts

    def meanwhile(app: AppRecord) -> Any:  # read as the launches begin, after the decision
        world.store.record_instance(
            APP, request_id="profile-recs-x-emu", instance_type=LARGE, price_usd_per_hr=0.1
        )
        return artifacts(app)

    world.reconciler.artifacts = meanwhile
    report = world.tick()
    assert report.apps[APP].count(Launch) == 2  # decided without the profile worker: 0.2
    assert world.fake.launched_total == 1  # launched with it: 0.1 + 0.1 <= 0.25
    assert kept_cost(world.store) <= 0.25 + 1e-9
    (refused,) = decisions(world.store, "launch_refused")
    assert "1 instance(s) recorded meanwhile" in refused.reason


def test_a_budget_cut_ends_whole_profile_runs_before_rollouts_and_no_more_than_it_needs(
    world: World,
) -> None:
    """The guard ended every profile and rollout worker on any excess (a tester: 0.30 USD/hr
    ended where the budget needed 0.10, a promoted rollout's serving workers among them). Now a
    profile run goes before a rollout, a whole one at a time, until the rest fits."""
    apply_fleet(world.store, {LARGE: 3})
    world.tick()
    world.fake.step()
    world.tick()
    run = [
        world.store.record_instance(
            APP, request_id=f"profile:{APP}-1a2b3c4d-{t}", instance_type=t, price_usd_per_hr=p
        ).id
        for t, p in ((SMALL, 0.05), (LARGE, 0.1))
    ]
    rollout = [
        world.store.record_instance(
            APP,
            request_id=f"profile:rollout-{APP}-4-t6kdc0-{SMALL}-{n}",
            instance_type=SMALL,
            price_usd_per_hr=0.05,
        ).id
        for n in (1, 2)
    ]
    assert kept_cost(world.store) == pytest.approx(0.55)
    world.store.change_budget(APP, 0.45, reason="cut", who="test")
    world.tick()
    # Not launched yet (rows only): marked failed, as the guard ends a requested row.
    for instance_id in run:
        (event, *_) = reversed(world.store.list_instance_events(instance_id=instance_id))
        assert event.to_state == "failed" and "(run 1a2b3c4d)" in event.reason
    live = {r.id for r in world.store.list_instances(APP, states=_KEPT)}
    assert set(rollout) <= live and live_types(world.store)[LARGE] == 3
    assert kept_cost(world.store) <= 0.45 + 1e-9


def test_launches_stop_at_the_budget(template_db: Path, tmp_path: Path) -> None:
    w = World.create(template_db, tmp_path, budget=0.25)
    try:
        apply_fleet(w.store, {SMALL: 3, LARGE: 2})
        w.tick()
        # Larges first (more queries per dollar): 0.2, then one small: 0.25.
        assert live_types(w.store) == {LARGE: 2, SMALL: 1}
        assert kept_cost(w.store) <= 0.25 + 1e-9
    finally:
        w.close()


# --- provider failures -----------------------------------------------------------------------


def test_a_capacity_error_is_recorded_and_retried_with_the_same_request_id(world: World) -> None:
    world.fake.fail_capacity(LARGE)
    apply_fleet(world.store, {LARGE: 1, SMALL: 1})
    world.tick()
    world.tick()
    rows = world.store.list_instances(APP)
    (large,) = [r for r in rows if r.instance_type == LARGE]
    assert large.state == "requested"
    (failed,) = decisions(world.store, "launch_failed")
    assert "insufficient capacity" in failed.reason and failed.numbers["retryable"]
    world.fake.restore_capacity(LARGE)
    world.tick()
    (large_after,) = [r for r in world.store.list_instances(APP) if r.instance_type == LARGE]
    assert large_after.id == large.id and large_after.state == "pending"
    assert len(world.store.list_instances(APP)) == 2


def test_failing_launches_are_one_decision_per_request_and_error(world: World) -> None:
    """Two requests failing every tick alternate in the log: each is still one decision, counted
    once per tick, with its first and last time."""
    world.fake.fail_capacity(LARGE)
    world.fake.fail_capacity(SMALL)
    apply_fleet(world.store, {LARGE: 1, SMALL: 1})
    ticks = 40  # 200 s: not yet stragglers
    for _ in range(ticks):
        world.tick()
    failed = decisions(world.store, "launch_failed")
    requests = {r.request_id: r for r in world.store.list_instances(APP)}
    assert len(requests) == 2
    assert len(failed) == 2
    assert {d.numbers["request_id"] for d in failed} == set(requests)
    for d in failed:
        assert d.key == f"{d.numbers['request_id']}:InsufficientCapacityError"
        assert d.count == ticks
        assert d.last_at is not None and (d.last_at - d.at).total_seconds() == 5.0 * (ticks - 1)
    # Another error of the same request is another decision.
    world.fake.restore_capacity(LARGE)
    world.fake.set_quota(LARGE, 0)
    world.tick()
    failed = decisions(world.store, "launch_failed")
    assert len(failed) == 3
    assert failed[-1].numbers["error"] == "QuotaExceededError" and failed[-1].count == 1


def test_a_quota_error_fails_the_row_and_holds_the_type(world: World) -> None:
    world.fake.set_quota(LARGE, 0)
    apply_fleet(world.store, {LARGE: 1})
    world.tick()
    assert by_state(world.store) == {"failed": 1}
    world.tick()
    assert by_state(world.store) == {"failed": 1}  # held: not tried again at once
    world.fake.set_quota(LARGE, None)
    world.tick(world.reconciler.launch_backoff_s)
    assert by_state(world.store) == {"failed": 1, "pending": 1}


def test_a_launch_failed_for_good_whose_row_did_not_fail_is_said_once(world: World) -> None:
    """The process dies failing the row of a launch the provider refused for good (a quota):
    neither the row's move nor the ``launch_failed`` decision is kept. The decision used to be
    written first, in a transaction of its own: the row stayed requested, failed again after the
    restart, and its one failure was said twice (the decision counted 2)."""
    world.fake.set_quota(LARGE, 0)
    apply_fleet(world.store, {LARGE: 1})
    with instance_move_fails("launch refused") as failing:
        with pytest.raises(RuntimeError, match="died writing the instance_events row"):
            world.tick()
        assert failing == []
    assert by_state(world.store) == {"requested": 1}
    assert decisions(world.store, "launch_failed") == []
    world.restart()
    world.tick()
    assert by_state(world.store) == {"failed": 1}
    (failed,) = decisions(world.store, "launch_failed")
    assert failed.numbers["error"] == "QuotaExceededError" and failed.count == 1


def test_a_launch_failed_for_good_whose_move_the_database_refused_is_said_once(
    world: World,
) -> None:
    """The database refuses the move of a launch's row the provider refused for good (an
    error, not a crash: a lock held, a connection lost): the row is still requested. Its
    failure was said alone then, as for a row ended meanwhile, and said again with the move
    when the next tick launched the row again and it was refused again (the decision counted
    2); it is said once, with the move."""
    world.fake.set_quota(LARGE, 0)
    apply_fleet(world.store, {LARGE: 1})
    refused = [True]

    def locked(_mapper: Any, _connection: Any, row: Any) -> None:
        if refused and "launch refused" in row.reason:
            refused.pop()
            raise OperationalError("INSERT", {}, Exception("test: database is locked"))

    event.listen(m.InstanceEvent, "before_insert", locked)
    try:
        world.tick()
    finally:
        event.remove(m.InstanceEvent, "before_insert", locked)
    assert refused == []
    assert by_state(world.store) == {"requested": 1}
    assert decisions(world.store, "launch_failed") == []
    world.tick()
    assert by_state(world.store) == {"failed": 1}
    (failed,) = decisions(world.store, "launch_failed")
    assert failed.numbers["error"] == "QuotaExceededError" and failed.count == 1


def test_a_launch_failed_for_good_whose_row_ended_meanwhile_is_still_said(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row of a launch the provider refused for good was ended by another writer while the
    launch was asked (an app taken down): its move fails, and the failure is said alone."""
    world.fake.set_quota(LARGE, 0)
    apply_fleet(world.store, {LARGE: 1})
    launch = world.fake.launch

    def meanwhile(request: Any) -> Any:
        for row in world.store.list_instances(APP, states=("requested",)):
            world.store.transition_instance(row.id, "failed", reason="test: ended meanwhile")
        return launch(request)

    monkeypatch.setattr(world.fake, "launch", meanwhile)
    world.tick()
    (row,) = world.store.list_instances(APP)
    assert row.state == "failed"
    (failed,) = decisions(world.store, "launch_failed")
    assert failed.numbers["instance_id"] == row.id and failed.count == 1
    reasons = [e.reason for e in world.store.list_instance_events(instance_id=row.id)]
    assert "test: ended meanwhile" in reasons
    assert not any(r.startswith("launch refused") for r in reasons)


def test_a_throttled_list_skips_all_but_the_budget_guard(world: World) -> None:
    apply_fleet(world.store, {SMALL: 2, LARGE: 1})
    world.tick()
    world.fake.step()
    world.tick()
    apply_fleet(world.store, {SMALL: 3, LARGE: 1})
    world.store.change_budget(APP, 0.1, reason="cut", who="test")
    world.fake.throttle_next(2)  # the list, then the terminate
    report = world.tick()
    assert report.errors
    # No launch without the provider's list, but the budget holds: the smalls are let go.
    assert not report.apps[APP].count(Launch)
    assert live_types(world.store) == {LARGE: 1}
    assert by_state(world.store) == {"running": 1, "terminating": 2}
    # The terminate was throttled too: the next tick asks again.
    world.tick()
    world.fake.step()
    world.tick()
    assert by_state(world.store) == {"running": 1, "terminated": 2}


def test_a_failed_terminate_is_asked_again(world: World) -> None:
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    world.fake.step()
    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    assert by_state(world.store) == {"running": 1, "draining": 1}
    world.fake.fail_terminate_next(1)
    world.tick(10.0)  # drained: terminated, and the terminate fails
    assert by_state(world.store) == {"running": 1, "terminating": 1}
    assert len([i for i in world.fake.list({}) if i.state == "running"]) == 2
    world.tick()
    world.fake.step()
    world.tick()
    assert by_state(world.store) == {"running": 1, "terminated": 1}


def test_a_scale_down_drains_first_and_a_rise_takes_the_worker_back(world: World) -> None:
    """A scale-down's serving worker drains (no new queries) rather than going at once; the
    count rising again while it drains takes it back (serving at once, nothing launched); one
    left to drain goes after drain_s, cause scale_down, as a restarted reconciler reads it."""
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    world.fake.step()
    world.tick()
    assert by_state(world.store) == {"running": 2}
    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    assert by_state(world.store) == {"running": 1, "draining": 1}
    launched = world.fake.launched_total
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    assert by_state(world.store) == {"running": 2}
    assert world.fake.launched_total == launched
    (back,) = [e for e in world.store.list_instance_events(app=APP) if e.from_state == "draining"]
    assert back.to_state == "running" and back.reason.startswith("taken back while it drained")
    # Down again (once the disruption budget's window has passed: the drain taken back counts
    # in it): drained, then gone; a new reconciler on the same store reads the cause back.
    apply_fleet(world.store, {SMALL: 1})
    world.tick(61.0)
    assert by_state(world.store) == {"running": 1, "draining": 1}
    world.restart()
    world.tick(10.0)
    assert by_state(world.store) == {"running": 1, "terminating": 1}
    (gone,) = decisions(world.store, "terminate")
    assert gone.numbers["cause"] == "scale_down"
    assert gone.reason.endswith("drained for 10 s after its scale-down")


def two_smalls_running(template_db: Path, tmp_path: Path) -> World:
    """A world whose budget pays for two smalls, both running on its plan."""
    world = World.create(template_db, tmp_path, budget=2 * PRICES[SMALL])
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    world.fake.step()
    world.tick()
    return world


def test_a_machine_whose_terminate_fails_is_paid_for_until_it_stops(
    template_db: Path, tmp_path: Path
) -> None:
    """A terminate that keeps failing leaves the machine running and billed: a plan that wants
    another instance gets one only where the budget pays for it next to that machine. (The row
    was counted as gone: a third small was launched under a budget of two, three ran.)"""
    world = two_smalls_running(template_db, tmp_path)
    try:
        apply_fleet(world.store, {SMALL: 1})
        world.fake.fail_terminate_next(100)
        world.tick()
        world.tick(10.0)  # drained: terminated, and the terminate fails
        assert by_state(world.store) == {"running": 1, "terminating": 1}
        apply_fleet(world.store, {SMALL: 2})

        def running() -> int:
            return len([i for i in world.fake.list({}) if i.state in ("pending", "running")])

        for _ in range(3):
            world.tick()
            world.fake.step()
            assert running() * PRICES[SMALL] <= world.store.get_app(APP).budget_usd_per_hr
        assert by_state(world.store) == {"running": 1, "terminating": 1}
        assert decisions(world.store, "budget_capped")
        # Once the terminate takes, the machine stops and the plan's second instance comes.
        world.fake.fail_terminate_next(0)
        for _ in range(3):
            world.tick()
            world.fake.step()
        assert running() == 2 and by_state(world.store) == {"running": 2, "terminated": 1}
    finally:
        world.close()


def test_rows_that_ended_long_ago_are_not_read_and_their_request_ids_are_not_used_again(
    world: World,
) -> None:
    """A tick reads the live rows and the recent past, not every row a fleet that has cycled
    for weeks has left (thousands, a transaction's worth of them every second); the request
    ids of the rows it no longer reads stay spent (the provider answers one it has seen with
    its old machine)."""
    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    world.fake.step()
    world.tick()
    (first,) = world.store.list_instances(APP)
    for state in ("draining", "terminating", "terminated"):
        world.store.transition_instance(first.id, state, reason="test")
    world.fake.crash()  # EC2 lists a terminated machine for about an hour, then forgets it
    world.clock.advance(ENDED_ROWS_S + 1)
    assert world.reconciler._rows(APP, world.fake.list({}), world.clock.utcnow()) == []
    world.tick()  # the plan's instance is launched again
    world.fake.step()
    world.tick()
    rows = world.store.list_instances(APP)
    assert [r.state for r in rows] == ["terminated", "running"]
    assert rows[1].request_id != first.request_id
    assert rows[1].request_id.endswith("-2") and first.request_id.endswith("-1")


def test_a_row_that_ended_long_ago_whose_machine_runs_is_ended_again_not_orphaned(
    world: World,
) -> None:
    """However long ago a row ended, a machine of it the provider still runs is matched to it
    and terminated again (rule 3), not taken for an unknown machine."""
    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    world.fake.step()
    world.tick()
    (row,) = world.store.list_instances(APP)
    # The database says it ended (a terminate it took for done); the machine runs on.
    world.store.transition_instance(row.id, "draining", reason="test")
    world.store.transition_instance(row.id, "terminating", reason="test")
    world.store.transition_instance(row.id, "terminated", reason="test")
    world.fake.fail_terminate_next(1_000)
    apply_fleet(world.store, {SMALL: 0})
    world.tick(ENDED_ROWS_S + 1)
    report = world.tick()
    ended = [a for a in report.apps[APP].actions if isinstance(a, Terminate)]
    assert [a.cause for a in ended] == ["ended"] and row.provider_id in ended[0].provider_ids
    assert decisions(world.store, "orphan") == []
    assert [r.id for r in world.store.list_instances(APP)] == [row.id]


def test_a_terminate_that_fails_in_the_tick_holds_the_launches_it_was_to_pay_for(
    template_db: Path, tmp_path: Path
) -> None:
    """Break-then-make in one tick (the budget pays for the plan's large only once both smalls
    go): when their terminate fails, both smalls still run and are billed, so the large waits.
    (It was launched beside them: 0.2 USD/hr ran under a budget of 0.1.)"""
    world = two_smalls_running(template_db, tmp_path)
    try:
        apply_fleet(world.store, {LARGE: 1})
        world.fake.fail_terminate_next(100)

        def running_cost() -> float:
            live = [i for i in world.fake.list({}) if i.state in ("pending", "running")]
            return sum(PRICES[i.instance_type] for i in live)

        for _ in range(3):
            world.tick()
            world.fake.step()
            assert running_cost() <= world.store.get_app(APP).budget_usd_per_hr + 1e-9
        (refused, *_) = decisions(world.store, "launch_refused")
        assert "terminate failed" in refused.reason
        # Once the terminate takes, the large comes.
        world.fake.fail_terminate_next(0)
        for _ in range(3):
            world.tick()
            world.fake.step()
        assert live_types(world.store) == {LARGE: 1}
        assert running_cost() == PRICES[LARGE]
    finally:
        world.close()


def test_dead_and_vanished_instances_are_replaced(world: World) -> None:
    apply_fleet(world.store, {SMALL: 2})
    world.tick()
    world.fake.step()
    world.tick()
    first, second = (i.provider_id for i in world.fake.list({}))
    world.fake.set_state(first, "failed")
    world.fake.crash([second])
    world.tick()
    # The failed one is replaced at once; the vanished one once the grace has passed since
    # the first tick that found it missing (the one above).
    assert by_state(world.store) == {"failed": 1, "running": 1, "pending": 1}
    world.tick(GRACE_S + 1)
    assert by_state(world.store) == {"failed": 2, "pending": 2}
    assert world.fake.launched_total == 4


def test_a_request_id_the_provider_has_spent_fails_and_launches_under_a_new_one(
    world: World, tmp_path: Path
) -> None:
    """A database restored from a backup gives the next launch an id the provider has seen:
    the provider answers it with that id's ended instance (idempotency). The row fails at once
    and the next tick launches under a new id (it was retried under the spent one until it
    became a straggler, its cost counted all the while)."""
    import sqlite3

    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    world.fake.step()
    world.tick()
    backup = tmp_path / "backup.db"
    with sqlite3.connect(world.path) as source, sqlite3.connect(backup) as copy:
        source.backup(copy)
    # After the backup: the instance dies and is replaced under the next id.
    (first,) = (i.provider_id for i in world.fake.list({}))
    world.fake.set_state(first, "failed")
    world.tick()
    world.fake.step()
    world.tick()
    spent = {r.request_id for r in world.store.list_instances(APP)}
    # The backup is restored; its next id is one the provider has used.
    world.store.close()
    with sqlite3.connect(backup) as source, sqlite3.connect(world.path) as restored:
        source.backup(restored)
    world.restart()
    world.tick()  # the live instance the backup does not know is an orphan: terminated
    world.tick(GRACE_S + 1)  # the one it knows is gone; its replacement's id was spent
    (failed,) = decisions(world.store, "launch_failed")
    assert failed.numbers["error"] == "RequestIdSpent" and failed.numbers["request_id"] in spent
    world.tick()
    world.fake.step()
    world.tick()
    running = world.store.list_instances(APP, states=("running",))
    assert len(running) == 1 and running[0].request_id not in spent
    assert kept_cost(world.store) == pytest.approx(PRICES[SMALL])


def test_stragglers_are_replaced(world: World) -> None:
    world.fake.never_run(LARGE)
    apply_fleet(world.store, {LARGE: 1})
    world.tick()
    world.fake.step()
    world.tick(STRAGGLER_S + 1)
    (stop,) = decisions(world.store, "terminate")
    assert stop.numbers["cause"] == "straggler"
    assert by_state(world.store) == {"terminating": 1, "pending": 1}


# --- orphans and strangers -------------------------------------------------------------------


def test_tagged_instances_unknown_to_the_database_are_recorded_and_terminated(
    world: World,
) -> None:
    apply_fleet(world.store, {})
    stray = world.fake.launch(LaunchRequest("someone-1", SMALL, 1, {APP_TAG: APP}))[0]
    ghost = world.fake.launch(LaunchRequest("ghost-1", SMALL, 1, {APP_TAG: "ghost"}))[0]
    stranger = world.fake.add_unmanaged(SMALL)
    report = world.tick()
    assert report.unknown_app == (ghost.provider_id,)
    recorded = world.store.find_instance(provider_id=stray.provider_id)
    assert recorded is not None and recorded.state == "terminating"
    (orphan,) = decisions(world.store, "orphan")
    assert orphan.numbers["request_id"] == "someone-1"
    world.fake.step()
    world.tick()
    assert world.store.get_instance(recorded.id).state == "terminated"
    assert [i.provider_id for i in world.fake.list({})] == []
    assert stranger not in world.fake.calls  # never terminated: still running, unlisted


def test_an_orphan_whose_row_was_not_written_is_not_said_either(world: World) -> None:
    """The process dies recording an orphan's row (here the write of its row fails): its
    ``orphan`` decision is not kept either, and the reconciler started again records it and
    says it once. The decision used to be written first, in a transaction of its own: the
    reconciler started again found the orphan again and said it twice."""
    apply_fleet(world.store, {})
    stray = world.fake.launch(LaunchRequest("someone-1", SMALL, 1, {APP_TAG: APP}))[0]
    with instance_move_fails(stray.provider_id) as failing:
        with pytest.raises(RuntimeError, match="died writing the instance_events row"):
            world.tick()
        assert failing == []
    assert decisions(world.store, "orphan") == []
    world.restart()
    world.tick()
    (orphan,) = decisions(world.store, "orphan")
    assert orphan.numbers["provider_id"] == stray.provider_id
    recorded = world.store.find_instance(provider_id=stray.provider_id)
    assert recorded is not None and recorded.state == "terminating"


def test_a_plan_the_provisioner_cannot_launch_is_one_decision(world: World) -> None:
    world.reconciler.launchable = lambda t: (
        None if t.startswith("emu.") else "the local provisioner emulates only emu.* types"
    )
    apply_fleet(world.store, {"g4dn.xlarge": 2, SMALL: 1})
    for _ in range(3):
        world.tick()
    (decision,) = decisions(world.store, "plan_not_launched")
    assert decision.reason.startswith("the local provisioner emulates only emu.* types;")
    assert "g4dn.xlarge" in decision.reason
    assert world.fake.launched_total == 0


# --- the property ----------------------------------------------------------------------------

_types = st.sampled_from([SMALL, LARGE])
_step = st.one_of(
    st.tuples(st.just("plan"), st.dictionaries(_types, st.integers(0, 4))),
    st.tuples(st.just("budget"), st.sampled_from([0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0])),
    st.tuples(st.just("capacity"), _types, st.booleans()),
    st.tuples(st.just("quota"), _types, st.sampled_from([None, 0, 1, 2])),
    st.tuples(st.just("throttle"), st.integers(1, 3)),
    st.tuples(st.just("fail_start"), _types, st.booleans()),
    st.tuples(st.just("die"), st.integers(0, 7), st.sampled_from(["failed", "crash", "stopping"])),
    st.tuples(st.just("terminate_fails"), st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(1, 2)),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 40.0, 400.0])),
    st.tuples(st.just("restart"), st.booleans()),
)


def _known(store: Store, instances: Sequence[ProvisionedInstance]) -> list[str]:
    return [i.provider_id for i in instances if store.find_instance(provider_id=i.provider_id)]


def _check(world: World, report: ReconcileReport | None) -> None:
    store = world.store
    budget = store.get_app(APP).budget_usd_per_hr
    # The budget guard: what we run or asked for never costs more than the budget.
    assert kept_cost(store) <= budget + 1e-9
    rows: list[InstanceRecord] = store.list_instances(APP)
    # Nothing launched twice: the provider launched at most once per recorded request.
    launches = [r for r in rows if not r.request_id.startswith("orphan:")]
    assert world.fake.launched_total <= len(launches)
    if report is not None and not report.errors and not report.apps[APP].errors:
        # After a whole reconcile, every managed instance the provider lists is known (the tick
        # listed the provider, so the fake's throttling is used up: this list goes through).
        listed = [i for i in world.fake.list({}) if i.state != "terminated"]
        assert _known(store, listed) == [i.provider_id for i in listed]
    assert all(r.state in {s.value for s in LIVE_STATES} | {"terminated", "failed"} for r in rows)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(_step, min_size=1, max_size=14), budget=st.sampled_from([0.1, 0.3, 1.0]))
def test_the_budget_holds_and_every_managed_instance_is_known(
    template_db: Path, steps: list[tuple[Any, ...]], budget: float
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        world = World.create(template_db, Path(directory), budget)
        try:
            apply_fleet(world.store, {SMALL: 2, LARGE: 1})
            _check(world, world.tick())
            for step in steps:
                report = _act(world, step)
                _check(world, report)
            # However it went, with the knobs off the fleet converges.
            world.fake.throttle_next(0)
            for instance_type in (SMALL, LARGE):
                world.fake.restore_capacity(instance_type)
                world.fake.set_quota(instance_type, None)
                world.fake.fail_start(instance_type, False)
            for _ in range(4):
                report = world.tick(GRACE_S + 1)
                world.fake.step()
                _check(world, report)
        finally:
            world.close()


def _act(world: World, step: tuple[Any, ...]) -> ReconcileReport | None:
    kind = step[0]
    fake = world.fake
    if kind == "plan":
        apply_fleet(world.store, step[1])
    elif kind == "budget":
        world.store.change_budget(APP, step[1], reason="test", who="test")
    elif kind == "capacity":
        (fake.fail_capacity if step[2] else fake.restore_capacity)(step[1])
    elif kind == "quota":
        fake.set_quota(step[1], step[2])
    elif kind == "throttle":
        fake.throttle_next(step[1])
    elif kind == "fail_start":
        fake.fail_start(step[1], step[2])
    elif kind == "die":
        # The victim is picked from the database: listing the fake would use up its throttling.
        live = [
            r.provider_id
            for r in world.store.list_instances(APP, states=["pending", "running"])
            if r.provider_id is not None
        ]
        if live:
            victim = live[step[1] % len(live)]
            if step[2] == "crash":
                fake.crash([victim])
            else:
                with contextlib.suppress(KeyError):  # it vanished already
                    fake.set_state(victim, step[2])
    elif kind == "terminate_fails":
        fake.fail_terminate_next(step[1])
    elif kind == "step":
        for _ in range(step[1]):
            fake.step()
    elif kind == "wait":
        world.clock.advance(step[1])
    elif kind == "restart":
        if step[1]:  # die in the middle of a tick, right after a launch
            world.spy.crash_after_launch = True
            with contextlib.suppress(CrashError):
                world.tick()
            world.spy.crash_after_launch = False
        world.restart()
    return world.tick()


# --- wired into the service ------------------------------------------------------------------


def test_the_services_reconcile_job_runs_the_reconciler(tmp_path: Path) -> None:
    service = build_service(Settings(data_dir=tmp_path / "data", provisioner="fake"))
    try:
        service.store.create_app(spec(1.0), who="test")
        apply_fleet(service.store, {SMALL: 1, LARGE: 1})
        assert service.scheduler.jobs["reconcile"]() == "ran"
        assert service.scheduler.jobs["reconcile"]() == "ran"
        # The fake of a running service starts instances running; prices from the catalog.
        assert by_state(service.store) == {"running": 2}
        assert {r.price_usd_per_hr for r in service.store.list_instances(APP)} == {0.05, 0.1}
    finally:
        service.close()


def test_under_the_local_provisioner_a_plan_of_ec2_types_is_one_decision(tmp_path: Path) -> None:
    service = build_service(Settings(data_dir=tmp_path / "data", provisioner="local"))
    try:
        service.store.create_app(spec(10.0), who="test")
        apply_fleet(service.store, {"g4dn.xlarge": 1, "t3.xlarge": 2})
        for _ in range(3):
            assert service.scheduler.jobs["reconcile"]() == "ran"
        (decision,) = decisions(service.store, "plan_not_launched")
        assert decision.reason == (
            "the local provisioner launches only emu.cpu.large, emu.cpu.small, emu.gpu,"
            " local.cpu; plan not launched (it names g4dn.xlarge, t3.xlarge)"
        )
        assert service.store.list_instances(APP) == []
        assert not list((tmp_path / "data" / "workers" / "instances").iterdir())
    finally:
        service.close()


def test_a_machine_the_list_leaves_out_for_a_moment_is_not_lost(world: World) -> None:
    """Rule 3's grace runs from the first tick whose list leaves the machine out, not from the
    row's last update: a running instance whose tag was taken off for 3 s (a tester's sweep)
    was ended as lost on the first such tick, replaced, and terminated once it was listed
    again. It is ended only once the list has left it out for the grace."""
    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    world.fake.step()
    world.tick()
    world.tick(GRACE_S * 3)  # the row's last update is long past the grace
    (listed,) = world.fake.list({})
    app = world.store.get_app(APP)
    world.clock.advance(5.0)
    world.reconciler.reconcile_app(app, [])  # one list without it
    assert by_state(world.store) == {"running": 1}
    world.tick()  # listed again: the run of ticks without it is over
    assert by_state(world.store) == {"running": 1}
    assert world.fake.launched_total == 1
    assert [i.provider_id for i in world.fake.list({})] == [listed.provider_id]
    for _ in range(3):  # left out for longer than the grace: lost, and replaced
        world.clock.advance(GRACE_S / 2 + 1)
        world.reconciler.reconcile_app(world.store.get_app(APP), [])
    assert by_state(world.store) == {"failed": 1, "pending": 1}


def test_a_provider_that_cannot_be_listed_is_one_decision_an_operator_sees(world: World) -> None:
    """While the provider's list cannot be read only the budget guard acts, which the log said
    three times a tick and ``heteroplane events`` not at all (a tester's sweep with moto
    stopped). Each such tick counts one ``provider_unreachable`` decision, one row a run."""
    apply_fleet(world.store, {SMALL: 1})
    world.tick()
    world.fake.throttle_next(3)
    for _ in range(3):
        report = world.tick()
        assert report.errors and report.errors[0].startswith("list: ")
    (unreachable,) = decisions(world.store, "provider_unreachable")
    assert unreachable.count == 3
    assert "only the budget guard acts" in unreachable.reason
    assert unreachable.numbers["error"] == "ThrottledError"
    world.tick()  # listed again: nothing more recorded
    assert [d.count for d in decisions(world.store, "provider_unreachable")] == [3]
