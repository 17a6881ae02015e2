"""INFaaS's autoscaler in the service: an app with ``scaling: infaas`` whose variant becomes
overloaded is replicated, and drained once the load is gone.

Real parts but the machines: a store through the migrations, the serving loop with its
dispatcher over fake in-process workers (:mod:`tests.fake_worker`, held back by
a gate so that a queue builds up and the INFaaS state becomes *overloaded* without timing), the
reconciler over the fake provisioner, and the scaler wired as the service wires it
(:func:`controlplane.service.build.scaled_fleet`). The clock is a fake one, advanced by hand;
nothing sleeps. ``tests/integration/test_infaas_scaling.py`` runs the same replicate and drain on
the whole service, with real worker processes and load through the HTTP API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.errors import OverloadedError
from controlplane.loops.infaas_scaler import InfaasScaler
from controlplane.loops.live_tuner import LiveTuner
from controlplane.policies.infaas_scaling import ScalingConfig
from controlplane.service.build import (
    build_reconciler,
    scaled_fleet,
    stored_apps,
    stored_overhead,
)
from controlplane.serving.loop import ServingLoop, ServingSettings
from controlplane.serving.workers import WorkerEndpoint
from provisioners.fake import FakeProvisioner
from tests.component.test_sizing import tiny_models
from tests.fake_worker import FakeWorker

LARGE = "emu.cpu.large"
APP = "recs"
HOLD_S = 5.0
BATCHES = (1, 2, 4, 8, 16, 32)
# tiny: 10 ms a sample on emu.cpu.large at every batch size (one instance: 100 samples/s).
PROFILES = {
    "format": "heteroplane.profiles/v1",
    "profiles": [
        {
            "model": "tiny",
            "instance_type": LARGE,
            "batch_sizes": list(BATCHES),
            "latency_ms": [[10.0 * b] for b in BATCHES],
        }
    ],
}


def spec(folder: Path) -> dict[str, Any]:
    (folder / "profiles.json").write_text(json.dumps(PROFILES))
    return {
        "name": APP,
        "models": [{"name": "tiny", "profiles": str(folder / "profiles.json")}],
        "slo": {"latency_ms": 100},
        "budget_usd_per_hr": 0.25,  # two emu.cpu.large (0.10 USD/hr each), not three
        "instance_types": [LARGE],
        "scaling": "infaas",
    }


PLAN = {
    "feasible": True,
    "cost_usd_per_hr": 0.1,
    "stages": [
        {
            "name": "tiny",
            "fleet": {LARGE: 1},
            "batch_size": 1,
            "predicted_p99_ms": 20.0,
            "throughput_qps": 100.0,
            "policy": "fcfs",
        }
    ],
    "planned_rate_qps": 5.0,
    "steps": [],
}


class GatedWorker(FakeWorker):
    """A fake worker whose answers to inference requests wait until :meth:`release`."""

    def __init__(self) -> None:
        super().__init__(LARGE)
        self.gated = True
        self.held: list[tuple[Any, ...]] = []

    def _handle(
        self,
        connection: Any,
        method: str,
        path: str,
        body: bytes,
        header_length: str | None = None,
    ) -> None:
        if self.gated and method == "POST":
            self.held.append((connection, method, path, body, header_length))
            return
        super()._handle(connection, method, path, body, header_length)

    def release(self) -> None:
        self.gated = False
        held, self.held = self.held, []
        for args in held:
            super()._handle(*args)


class PooledInstances:
    """The serving loop's instance source: the store's running instances of the app, each
    answered by the next fake worker of the pool (as a launched worker would be)."""

    def __init__(self, store: Store, pool: Sequence[FakeWorker]) -> None:
        self.store = store
        self.pool = list(pool)
        self.assigned: dict[str, FakeWorker] = {}

    def running(self, app: str) -> list[WorkerEndpoint]:
        out = []
        for inst in self.store.list_instances(app, states=["running"]):
            worker = self.assigned.get(inst.id)
            if worker is None:
                worker = self.assigned[inst.id] = self.pool[len(self.assigned)]
            out.append(WorkerEndpoint(inst.id, inst.instance_type, worker.address))
        return out


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (the scenario's deadline bounds it)."""
    while not condition():
        await asyncio.sleep(0)


def kinds(store: Store) -> list[str]:
    return [d.kind for d in reversed(store.list_decisions(APP))]


def test_an_overloaded_variant_is_replicated_and_drained_once_the_load_is_gone(
    tmp_path: Path,
) -> None:
    clock = FakeClock(start_s=1000.0)
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", clock, upgrade=True)
    resolver = AppResolver(tmp_path)
    store.create_app(spec_document(resolver.check(spec(tmp_path)).spec), who="test")
    plan = store.create_plan(APP, PLAN)
    store.apply_plan(APP, plan.id)
    provisioner = FakeProvisioner(running_on_launch=True)

    async def scenario() -> None:
        pool = [GatedWorker() for _ in range(3)]
        for worker in pool:
            await worker.start()
        instances = PooledInstances(store, pool)
        serving = ServingLoop(
            store, resolver, instances, clock=clock, settings=ServingSettings(refresh_s=3600.0)
        )
        scaler = InfaasScaler(
            store,
            clock,
            serving.observed_arrivals,
            serving.statuses,
            stored_apps(resolver),
            config=ScalingConfig(hold_s=HOLD_S),
        )
        tuner = LiveTuner(store, clock, serving.observed_arrivals, stored_apps(resolver))
        reconciler = build_reconciler(
            store, clock, provisioner, resolver, scaled_fleet(tuner, scaler)
        )

        def reconcile() -> None:
            for _ in range(3):  # launch, then see it running
                reconciler.run_once()
                provisioner.step()

        await serving.start()
        try:
            await asyncio.to_thread(reconcile)
            assert len(store.list_instances(APP, states=["running"])) == 1
            await serving.dispatcher(APP)
            await serving.refresh()

            # A query of 12 samples takes 120 ms on the held worker: the queue cannot drain
            # within the 100 ms SLO, so tiny is overloaded; admission refuses what follows.
            tasks = [
                asyncio.create_task(serving.infer(APP, [[1.0, 8.0] + [0.0] * 62] * 12))
                for _ in range(4)
            ]
            await until(lambda: bool(pool[0].held))  # the first batch is on the worker
            await until(lambda: all(t.done() for t in tasks[1:]))  # the others refused
            await serving.refresh()
            (status,) = serving.statuses()
            (stage,) = status.stages
            assert set(stage.states.values()) == {"overloaded"}, stage

            # While a decision is written, the reconciler (another thread) still sees the old
            # fleet: the decision is in the log before what the reconciler does about it.
            seen: list[dict[str, int]] = []
            record = store.record_decisions  # the tick's decisions, in one transaction

            def recording(*args: Any, **kwargs: Any) -> Any:
                seen.append(dict(scaler.desired_fleet(store.get_app(APP))))
                return record(*args, **kwargs)

            store.record_decisions = recording  # type: ignore[method-assign]
            made = await asyncio.to_thread(scaler.tick)
            assert [d.action for _, d in made] == ["infaas_replicate"]
            assert seen == [{LARGE: 1}]
            (replicate,) = store.list_decisions(APP, kinds=["infaas_replicate"])
            assert replicate.numbers["instance_type"] == LARGE
            assert replicate.numbers["count_after"] == 2
            assert replicate.numbers["overloaded"] is True
            assert "overloaded" in replicate.reason
            assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 2}
            # A restarted scaler (a restarted loops process) starts from the fleet it had
            # reached, not the plan's one: the reconciler's first pass drained the replica.
            restarted = InfaasScaler(
                store, clock, serving.observed_arrivals, serving.statuses, stored_apps(resolver)
            )
            assert restarted.desired_fleet(store.get_app(APP)) == {LARGE: 2}
            # Not asked twice while the new instance loads.
            assert await asyncio.to_thread(scaler.tick) == []

            await asyncio.to_thread(reconcile)
            assert kinds(store).count("launch") == 2
            assert len(store.list_instances(APP, states=["running"])) == 2
            await serving.refresh()
            (status,) = serving.statuses()
            assert len(status.workers) == 2

            # The load goes away: the held answers go out, nothing more arrives.
            for worker in pool:
                worker.release()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert any(not isinstance(o, BaseException) for o in outcomes)
            assert all(
                not isinstance(o, BaseException) or isinstance(o, OverloadedError) for o in outcomes
            ), outcomes
            clock.advance(3.0)  # past the 2 s load window
            await serving.refresh()
            (stage,) = serving.statuses()[0].stages
            assert set(stage.states.values()) == {"active"}
            assert await asyncio.to_thread(scaler.tick) == []  # underused from now
            clock.advance(HOLD_S)
            await serving.refresh()
            made = await asyncio.to_thread(scaler.tick)
            assert [d.action for _, d in made] == ["infaas_drain"]
            assert seen[-1] == {LARGE: 2}
            (drain,) = store.list_decisions(APP, kinds=["infaas_drain"])
            assert drain.numbers["instance_type"] == LARGE
            assert drain.numbers["count_after"] == 1
            assert drain.numbers["underused_s"] >= HOLD_S
            assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 1}

            await asyncio.to_thread(reconcile)
            # The drained replica takes no new query, then goes once drained (rule 9).
            assert len(store.list_instances(APP, states=["draining"])) == 1
            assert len(store.list_instances(APP, states=["running"])) == 1
            clock.advance(10.0)
            await asyncio.to_thread(reconcile)
            assert "terminate" in kinds(store)
            assert "terminate" in provisioner.calls
            assert [i.state for i in provisioner.list({})] == ["running"]
            # The live tuner would have wanted the plan's fleet: the reconciler read INFaaS's.
            assert kinds(store).count("launch") == 2
        finally:
            await serving.stop()
            for worker in pool:
                await worker.stop()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60.0))
    finally:
        store.close()


def test_the_scaler_leaves_inferline_apps_alone(tmp_path: Path) -> None:
    clock = FakeClock(start_s=1000.0)
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", clock, upgrade=True)
    try:
        resolver = AppResolver(tmp_path)
        document = {**spec(tmp_path), "scaling": "inferline"}
        store.create_app(spec_document(resolver.check(document).spec), who="test")
        plan = store.create_plan(APP, PLAN)
        store.apply_plan(APP, plan.id)
        scaler = InfaasScaler(
            store, clock, lambda _app: np.empty(0), lambda: [], stored_apps(resolver)
        )
        assert scaler.tick() == []
        assert store.get_app(APP).spec["scaling"] == "inferline"
    finally:
        store.close()


@contextmanager
def planned_app(
    tmp_path: Path, *, budget_usd_per_hr: float
) -> Iterator[tuple[FakeClock, Store, AppResolver, Any]]:
    """The app (at ``budget_usd_per_hr``) with PLAN applied, on a store of its own."""
    clock = FakeClock(start_s=1000.0)
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", clock, upgrade=True)
    try:
        resolver = AppResolver(tmp_path)
        document = {**spec(tmp_path), "budget_usd_per_hr": budget_usd_per_hr}
        store.create_app(spec_document(resolver.check(document).spec), who="test")
        plan = store.create_plan(APP, PLAN)
        store.apply_plan(APP, plan.id)
        yield clock, store, resolver, plan
    finally:
        store.close()


def idle_scaler(
    store: Any,
    clock: Any,
    resolver: Any,
    arrivals: Callable[[str], np.ndarray] = lambda _app: np.empty(0),
) -> InfaasScaler:
    """The scaler over an app the serving loop serves with no worker, its arrivals
    ``arrivals`` (nothing arriving by default)."""
    from controlplane.serving.dispatcher import AppStatus

    idle = AppStatus(APP, "", 100.0, (), (), 0)
    return InfaasScaler(store, clock, arrivals, lambda: [idle], stored_apps(resolver))


def test_a_variant_is_judged_against_the_slo_less_the_services_own_time(tmp_path: Path) -> None:
    """The service measured 50 ms of its own per query of a 100 ms SLO, so the workers have 50
    ms, as the planner holds a stage to: an emu.cpu.small taking 60 ms a query misses it, and at
    30 qps over one emu.cpu.large (25 qps, booting) the scaler adds another large. It judged the
    variants against the whole SLO and upgraded to the small (the cheaper cover), whose answers
    then took 110 ms end to end."""
    small = "emu.cpu.small"
    clock = FakeClock(start_s=1000.0)
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", clock, upgrade=True)
    try:
        resolver = AppResolver(tmp_path, overheads=stored_overhead(store))
        document = {
            **spec(tmp_path),
            "models": tiny_models(tmp_path / "mixed.json", {small: 60.0, LARGE: 40.0}),
            "budget_usd_per_hr": 1.0,
            "instance_types": [small, LARGE],
        }
        store.create_app(spec_document(resolver.check(document).spec), who="test")
        store.apply_plan(APP, store.create_plan(APP, PLAN).id)
        store.set_serving_overhead(APP, 50.0, 100)
        resolver.invalidate(APP)
        arrivals = 990.0 + np.arange(3000) / 30.0  # 30 qps
        scaler = idle_scaler(
            store, clock, resolver, lambda _app: arrivals[arrivals <= clock.now_s()]
        )
        clock.advance(1.0)
        made = scaler.tick()
        assert [(d.action, d.instance_type) for _, d in made] == [("infaas_upgrade", LARGE)]
        assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 2}
    finally:
        store.close()


def test_a_budget_cut_keeps_the_fleet_reached_cut_to_the_budget(tmp_path: Path) -> None:
    """The policy had reached three instances (0.30 USD/hr); the budget is cut to 0.25: it keeps
    two, what the new budget pays for and what the reconciler drains to. Started again from the
    plan's one, it wanted one (the reconciler drained to it, then the policy bought back)."""
    from controlplane.loops.infaas_scaler import _AppScaler
    from controlplane.policies.infaas_scaling import initial_state

    with planned_app(tmp_path, budget_usd_per_hr=0.35) as (clock, store, resolver, plan):
        scaler = idle_scaler(store, clock, resolver)
        scaler.tick()
        assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 1}  # the plan's
        # The fleet the policy reached (its replications are the other tests' business).
        scaler._apps[APP] = _AppScaler(plan.id, 0.35, initial_state({LARGE: 3}, clock.now_s()))
        store.change_budget(APP, 0.25, reason="cut", who="test")
        clock.advance(1.0)
        scaler.tick()
        assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 2}


def test_a_restarted_scaler_ticks_on_from_the_fleet_it_had_reached(tmp_path: Path) -> None:
    from controlplane.loops.infaas_scaler import FLEET_AFTER
    from controlplane.loops.reached import PLAN_ID
    from controlplane.serving.dispatcher import AppStatus

    with planned_app(tmp_path, budget_usd_per_hr=0.35) as (clock, store, resolver, plan):
        numbers = {PLAN_ID: plan.id, FLEET_AFTER: {LARGE: 3}}
        store.record_decision(APP, "infaas_replicate", "before the restart", numbers)
        idle = AppStatus(APP, "", 100.0, (), (), 0)

        def started() -> dict[str, int]:
            scaler = InfaasScaler(
                store, clock, lambda _app: np.empty(0), lambda: [idle], stored_apps(resolver)
            )
            scaler.tick()
            return dict(scaler.desired_fleet(store.get_app(APP)))

        assert started() == {LARGE: 3}
        # Cut to a budget lowered meanwhile, as a budget change cuts the fleet reached.
        store.change_budget(APP, 0.25, reason="cut", who="test")
        assert started() == {LARGE: 2}
        # A plan applied since is the start, as ever.
        again = store.create_plan(APP, PLAN)
        store.apply_plan(APP, again.id)
        assert started() == {LARGE: 1}


def started_on(
    store: Any,
    clock: Any,
    resolver: Any,
    plan: Any,
    decided: tuple[str, str],
    fleet: dict[str, int],
) -> InfaasScaler:
    """An idle scaler started after a decision of the policy's (``decided``: its kind and
    reason) that reached ``fleet`` on ``plan``: it starts from that fleet."""
    from controlplane.loops.infaas_scaler import FLEET_AFTER
    from controlplane.loops.reached import PLAN_ID

    kind, reason = decided
    store.record_decision(APP, kind, reason, {PLAN_ID: plan.id, FLEET_AFTER: fleet})
    scaler = idle_scaler(store, clock, resolver)
    scaler.tick()
    assert scaler.desired_fleet(store.get_app(APP)) == fleet
    return scaler


def test_a_restarted_scaler_keeps_a_budget_cut_a_raise_came_after(tmp_path: Path) -> None:
    """The policy cut its three instances to two at a budget of 0.25 (a cut writes no decision)
    and kept two when the budget went back to 0.35. Restarted, it read the three of its last
    decision and cut them to the budget now: it wanted three, one more than it had reached."""

    with planned_app(tmp_path, budget_usd_per_hr=0.35) as (clock, store, resolver, plan):
        scaler = started_on(
            store, clock, resolver, plan, ("infaas_replicate", "before the cut"), {LARGE: 3}
        )
        clock.advance(1.0)
        store.change_budget(APP, 0.25, reason="cut", who="test")
        scaler.tick()
        clock.advance(1.0)
        store.change_budget(APP, 0.35, reason="back", who="test")
        scaler.tick()
        reached = dict(scaler.desired_fleet(store.get_app(APP)))
        assert reached == {LARGE: 2}

        restarted = idle_scaler(store, clock, resolver)
        assert restarted.desired_fleet(store.get_app(APP)) == reached  # before its first tick
        restarted.tick()
        assert restarted.desired_fleet(store.get_app(APP)) == reached


def test_a_switch_back_to_infaas_starts_from_the_fleet_that_runs(tmp_path: Path) -> None:
    """The policy had reached one instance; the app moved to InferLine's tuner, which went back
    to three (setting up from the plan writes no decision), then back to ``scaling: infaas``.
    The policy starts from the three that run, not from the one it had reached before the
    switch: that drained two with no decision of the policy's (seen live, "scale_down: 3 kept,
    1 desired"). A restart on the same mode starts from the fleet reached, as above."""

    with planned_app(tmp_path, budget_usd_per_hr=0.35) as (clock, store, resolver, plan):
        scaler = started_on(
            store, clock, resolver, plan, ("infaas_drain", "before the switch"), {LARGE: 1}
        )

        def scaling(mode: str) -> None:
            store.update_app(APP, {**store.get_app(APP).spec, "scaling": mode}, who="test")

        scaling("inferline")
        clock.advance(1.0)
        assert scaler.tick() == []
        for k in range(3):  # the tuner's fleet, which the reconciler launched
            store.record_instance(
                APP, request_id=f"t{k}", instance_type=LARGE, price_usd_per_hr=0.1, state="running"
            )
        scaling("infaas")
        # Before its first tick (the reconciler may ask first) and after it: the three.
        assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 3}
        clock.advance(1.0)
        assert scaler.tick() == []
        assert scaler.desired_fleet(store.get_app(APP)) == {LARGE: 3}
        assert [d.reason for d in store.list_decisions(APP)] == ["before the switch"]


def test_a_new_leader_after_a_switch_back_starts_from_the_fleet_that_runs(tmp_path: Path) -> None:
    """As above, but the scaler that sees the app back on ``scaling: infaas`` is a new one (a
    new leader, a restarted loops process) that never saw it under the tuner: the switches'
    ``scaling_switched`` decisions (what ``PUT /v1/apps/{app}`` records) tell it the fleet it
    had reached is not what runs. Before, it started from the one it had reached and drained
    two that the tuner had grown. A switch before the plan was applied changes nothing."""
    from controlplane.apps.scaling import SCALING_SWITCHED, scaling_switch

    with planned_app(tmp_path, budget_usd_per_hr=0.35) as (clock, store, resolver, plan):
        started_on(store, clock, resolver, plan, ("infaas_drain", "before the switch"), {LARGE: 1})

        def scaling(mode: str) -> None:
            old = store.get_app(APP).spec
            new = {**old, "scaling": mode}
            said = scaling_switch(old, new, "test")
            assert said
            store.update_app(APP, new, who="test", said=said)

        clock.advance(1.0)
        scaling("inferline")
        for k in range(3):  # the tuner's fleet, which the reconciler launched
            store.record_instance(
                APP, request_id=f"t{k}", instance_type=LARGE, price_usd_per_hr=0.1, state="running"
            )
        clock.advance(1.0)
        scaling("infaas")
        # The same mode again is no switch.
        same = store.get_app(APP).spec
        assert scaling_switch(same, dict(same), "test") == []
        new_leader = idle_scaler(store, clock, resolver)
        assert new_leader.desired_fleet(store.get_app(APP)) == {LARGE: 3}
        clock.advance(1.0)
        assert new_leader.tick() == []
        assert new_leader.desired_fleet(store.get_app(APP)) == {LARGE: 3}
        switches = [d for d in store.list_decisions(APP) if d.kind == SCALING_SWITCHED]
        assert [(d.numbers["from"], d.numbers["to"]) for d in switches] == [
            ("infaas", "inferline"),
            ("inferline", "infaas"),
        ]

        # A plan applied after the switch: the policy starts from the plan's fleet.
        clock.advance(1.0)
        again = store.create_plan(APP, PLAN)
        store.apply_plan(APP, again.id)
        fresh = idle_scaler(store, clock, resolver)
        applied = store.get_applied_plan(APP)
        assert applied is not None
        assert fresh.desired_fleet(store.get_app(APP)) == applied.plan.fleet


def test_the_budget_floor_of_an_infaas_app_is_one_instance_of_its_cheapest_type(
    tmp_path: Path,
) -> None:
    """A cascade's plan places emu.cpu.large on each of its three stages; the policy has scaled
    the app to one instance. INFaaS's policy drains a stage's planned type once the other
    instances carry it, and the reconciler keeps the app's last serving instance
    (docs/operations.md rule 3), so the smallest serving fleet is one instance, not one per
    stage: a cut to 0.15 USD/hr (above one, below three) is taken, and its drain keeps one.
    Below one it is refused; and a refusal does not say an on-demand fleet risks a spot price
    rise."""
    from controlplane.apps.budget import change_budget
    from controlplane.errors import BudgetBelowServingFleetError

    cascade = json.loads(json.dumps(PLAN))
    stage = cascade["stages"][0]
    cascade["stages"] = [{**stage, "name": name} for name in ("tiny", "medium", "large")]
    cascade["cost_usd_per_hr"] = 0.3
    with planned_app(tmp_path, budget_usd_per_hr=0.35) as (_clock, store, resolver, _plan):
        plan = store.create_plan(APP, cascade)
        store.apply_plan(APP, plan.id)
        for k in range(2):
            store.record_instance(
                APP, request_id=f"r{k}", instance_type=LARGE, price_usd_per_hr=0.1, state="running"
            )
        made = change_budget(store, resolver, APP, 0.15, "cut", "test")
        assert store.get_app(APP).budget_usd_per_hr == 0.15
        assert len(made.drain.drain) == 1  # one of the two goes; the other serves every stage

        store.change_budget(APP, 0.35, reason="back", who="test")
        with pytest.raises(BudgetBelowServingFleetError) as raised:
            change_budget(store, resolver, APP, 0.05, "cut", "test")
        assert raised.value.floor_usd_per_hr == pytest.approx(0.1)
        assert raised.value.fleet == f"one {LARGE}, which serves every stage"

        # Scaled by the tuner, the floor is one per stage. The two on-demand instances (0.2
        # USD/hr) fit a cut to 0.25, below it: a refusal, which does not speak of a spot price
        # rise (it did, of a fleet all on demand).
        spec_now = store.get_app(APP).spec
        store.update_app(APP, {**spec_now, "scaling": "inferline"}, who="test")
        with pytest.raises(BudgetBelowServingFleetError) as raised:
            change_budget(store, resolver, APP, 0.25, "cut", "test")
        assert raised.value.floor_usd_per_hr == pytest.approx(0.3)
        assert raised.value.fleet == f"one {LARGE} per stage"
        assert "spot" not in str(raised.value) and "runs at" not in str(raised.value)


def drains_to_three(tmp_path: Path, *, beside: bool) -> None:
    """Five large instances serve 200 qps (100 each): two can go. The reconciler carries out the
    first drain and defers the second (one serving instance per 60 s window). The policy's
    fleet must reach three, one drain at a time, and stay there. With ``beside``, the scaler
    reads the reconciler's word on what it holds back (``Reconciler.held_back``, as the service
    wires it) and one more worker serves beside the policy's fleet: a small instance of another
    type (as a stand-in the reconciler launched for a spot move)."""
    from controlplane.loops.infaas_scaler import _AppScaler
    from controlplane.policies.infaas_scaling import initial_state
    from controlplane.serving.dispatcher import AppStatus, StageStatus, WorkerStatus

    with planned_app(tmp_path, budget_usd_per_hr=0.55) as (clock, store, resolver, plan):

        def statuses() -> list[AppStatus]:
            rows = store.list_instances(APP, states=["running"])
            workers = tuple(
                WorkerStatus(r.id, r.instance_type, "", True, True, "", 0.5) for r in rows
            )
            if beside:
                workers += (WorkerStatus("stand-in", "emu.cpu.small", "", True, True, "", 0.5),)
            states = {w.instance_id: "active" for w in workers}
            stage = StageStatus("tiny", 0, 0, 0, 100.0, "fcfs", 1, states)  # type: ignore[arg-type]
            return [AppStatus(APP, "", 100.0, workers, (stage,), 0)]

        def arrivals(_app: str) -> np.ndarray:
            return np.linspace(clock.now_s() - 1.999, clock.now_s(), 400)  # 200 qps

        scaler = InfaasScaler(
            store, clock, arrivals, statuses, stored_apps(resolver), config=ScalingConfig(hold_s=15)
        )
        tuner = LiveTuner(store, clock, lambda _app: np.empty(0), stored_apps(resolver))
        provisioner = FakeProvisioner(running_on_launch=True)
        reconciler = build_reconciler(
            store, clock, provisioner, resolver, scaled_fleet(tuner, scaler)
        )
        if beside:
            scaler.held_back = reconciler.held_back
        scaler._apps[APP] = _AppScaler(plan.id, 0.55, initial_state({LARGE: 5}, clock.now_s()))
        for _ in range(3):
            reconciler.run_once()
            provisioner.step()
        assert len(store.list_instances(APP, states=["running"])) == 5
        wanted = []
        for _ in range(40):
            clock.advance(5.0)
            scaler.tick()
            wanted.append(scaler.desired_fleet(store.get_app(APP))[LARGE])
            reconciler.run_once()
            provisioner.step()
        assert min(wanted) == 3, f"the policy's {LARGE} count tick by tick: {wanted}"
        assert "drain_deferred" in kinds(store)  # the second drain waited for its window
        assert kinds(store).count("infaas_drain") == 2, kinds(store)
        assert "infaas_replicate" not in kinds(store)
        assert len(store.list_instances(APP, states=["running"])) == 3


def test_a_drain_the_disruption_budget_defers_is_not_drained_past(tmp_path: Path) -> None:
    """Judged on the four that still served, the policy drained on to one (each drain saying
    "200 qps on 300 qps left"), the reconciler followed down to two, and the policy replicated
    back: a fleet at 100 % of its capacity meanwhile. It waits for the deferred drain instead,
    and stays at three."""
    drains_to_three(tmp_path, beside=False)


def test_a_drain_waits_for_the_reconcilers_deferral_not_for_what_serves_beside_the_fleet(
    tmp_path: Path,
) -> None:
    """Counted from what serves, the worker beside the fleet read as a drain still to be
    carried out, and the policy never drained while it served (a stand-in stays). With the
    reconciler's word it drains to three, one drain at a time: the second waits for the
    reconciler's deferral, as before."""
    drains_to_three(tmp_path, beside=True)


def ticked(
    clock: FakeClock,
    store: Store,
    resolver: AppResolver,
    plan_id: int,
    statuses: Callable[[], list[Any]],
    *,
    qps: int,
    ticks: int = 60,
) -> None:
    """The scaler (``statuses`` its serving status, ``qps`` its measured arrivals), the
    reconciler and a fake provisioner over the app planned ``plan_id`` on one LARGE instance:
    that instance started, then ``ticks`` scaler ticks 2 s apart, each reconciled."""
    from controlplane.loops.infaas_scaler import _AppScaler
    from controlplane.policies.infaas_scaling import initial_state

    def arrivals(_app: str) -> np.ndarray:
        return np.linspace(clock.now_s() - 1.999, clock.now_s(), 2 * qps)

    scaler = InfaasScaler(
        store, clock, arrivals, statuses, stored_apps(resolver), config=ScalingConfig(hold_s=15)
    )
    tuner = LiveTuner(store, clock, lambda _app: np.empty(0), stored_apps(resolver))
    provisioner = FakeProvisioner(running_on_launch=True)
    reconciler = build_reconciler(store, clock, provisioner, resolver, scaled_fleet(tuner, scaler))
    scaler.held_back = reconciler.held_back
    scaler._apps[APP] = _AppScaler(plan_id, 0.25, initial_state({LARGE: 1}, clock.now_s()))
    for _ in range(3):
        reconciler.run_once()
        provisioner.step()
    assert len(store.list_instances(APP, states=["running"])) == 1
    for _ in range(ticks):
        clock.advance(2.0)
        scaler.tick()
        reconciler.run_once()
        provisioner.step()


def test_a_model_skewed_load_is_read_where_it_arrives_and_replicated_once(
    tmp_path: Path,
) -> None:
    """Model-less queries send the app's 90 qps to tiny, which the plan says a share of 0.02
    reaches (the cascade's share, not where the variant choice sends them). One instance (Q 100)
    reads overloaded, two carry the load. Read as the app's rate times the plan's share (1.8
    qps), the load looked gone to the drain's rule once the replica served, and the overload
    bought it back: replicate and drain took turns, every hold (seen live on the demo's `large`,
    0.19 qps read where 11.4 arrived). The scaler reads the 90 samples/s that tiny's queue
    receives (the serving loop's measured arrivals): one replicate, then two instances."""
    from controlplane.serving.dispatcher import AppStatus, StageStatus, WorkerStatus
    from controlplane.serving.states import Overload

    skewed = json.loads(json.dumps(PLAN))
    skewed["stages"][0]["scale_factor"] = 0.02
    with planned_app(tmp_path, budget_usd_per_hr=0.25) as (clock, store, resolver, _plan):
        plan = store.create_plan(APP, skewed)
        store.apply_plan(APP, plan.id)

        def statuses() -> list[AppStatus]:
            rows = store.list_instances(APP, states=["running"])
            workers = tuple(
                WorkerStatus(r.id, r.instance_type, "", True, True, "", 0.5) for r in rows
            )
            # One instance cannot keep up (admission refuses); two can.
            refused = 3 if len(rows) == 1 else 0
            overload = Overload(0.0, 100.0, refused, 90.0, 100.0 * len(rows), 10.0)
            state = "overloaded" if overload.overloaded else "active"
            states = {w.instance_id: state for w in workers}
            stage = StageStatus(
                "tiny",
                0,
                0,
                0,
                100.0 * len(rows),
                "fcfs",
                1,
                states,  # type: ignore[arg-type]
                overload=overload,
            )
            return [AppStatus(APP, "", 100.0, workers, (stage,), 0)]

        ticked(clock, store, resolver, plan.id, statuses, qps=90)
        scaled = [k for k in kinds(store) if k.startswith("infaas_")]
        assert scaled == ["infaas_replicate"], scaled
        (replicate,) = store.list_decisions(APP, kinds=["infaas_replicate"])
        assert replicate.numbers["load_qps"] == pytest.approx(90.0)
        assert len(store.list_instances(APP, states=["running"])) == 2


def test_a_poisson_queues_momentary_backlog_spikes_buy_no_replica(tmp_path: Path) -> None:
    """One instance of tiny (100 samples/s) at half its capacity under a Poisson load (50 qps,
    service 10 ms give or take 30%), SLO 100 ms: now and then a burst queues more than the SLO
    drains, at one reading (here at every third status the scaler reads). The backlog read at one
    moment marked the model overloaded and the scaler replicated on it (seen live on the demo's
    `large`: a drain and replicate every `short_memory_s`); the overload's backlog criterion
    holds over a monitoring period now, which a burst does not: no replicate, one instance."""
    from controlplane.serving.dispatcher import AppStatus, StageStatus, WorkerStatus
    from controlplane.serving.states import StateTracker, model_state

    rng = np.random.default_rng(3)
    tracker = StateTracker()
    queue = (APP, "tiny")
    with planned_app(tmp_path, budget_usd_per_hr=0.25) as (clock, store, resolver, plan):
        sim = {"t": clock.now_s(), "backlog": 0, "free": clock.now_s(), "reads": 0}
        ends: list[float] = []

        def serve_until(now_s: float) -> None:
            """The queue's readings (each arrival and completion) up to ``now_s``."""
            while True:
                at = sim["t"] + rng.exponential(1 / 50.0)
                while ends and ends[0] <= min(at, now_s):
                    sim["backlog"] -= 1
                    tracker.backlog(queue, ends.pop(0), sim["backlog"])
                if at > now_s:
                    return
                sim["t"] = at
                sim["free"] = max(sim["free"], at) + rng.uniform(0.007, 0.013)
                ends.append(sim["free"])
                sim["backlog"] += 1
                tracker.backlog(queue, at, sim["backlog"])

        def statuses() -> list[AppStatus]:
            now = clock.now_s()
            serve_until(now)
            sim["reads"] += 1
            # Every third read: a burst of 12 queued (120 ms of work > the SLO) at that moment.
            backlog = 12 if sim["reads"] % 3 == 0 else int(sim["backlog"])
            rows = store.list_instances(APP, states=["running"])
            workers = tuple(
                WorkerStatus(r.id, r.instance_type, "", True, True, "", 0.5) for r in rows
            )
            capacity = 100.0 * len(rows)
            overload = tracker.overload(queue, now, backlog, capacity, 100.0)
            assert overload.backlog_ms <= 100.0 or sim["reads"] % 3 == 0
            states = {
                w.instance_id: model_state(overloaded=overload.overloaded, interfered=False)
                for w in workers
            }
            stage = StageStatus(
                "tiny", 0, backlog, 0, capacity, "fcfs", 1, states, overload=overload
            )
            return [AppStatus(APP, "", 100.0, workers, (stage,), 0)]

        ticked(clock, store, resolver, plan.id, statuses, qps=50)
        assert sim["reads"] >= 60
        assert [k for k in kinds(store) if k.startswith("infaas_")] == []
        assert len(store.list_instances(APP, states=["running"])) == 1
