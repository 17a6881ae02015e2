"""A rollout moving an app's live traffic: the real serving loop and API (ASGI), fake worker
agents on loopback (tests/fake_worker.py), a real SQLite store through the
migrations, the rollout loop ticked by hand on a fake clock (the reconciler's one move, a
launched worker's row to ``running``, is done by hand too).

- a good version: the split follows the request ids (a client can reproduce it), the steps
  promote after each interval, the last completes: the app's spec names the new version, the
  rollout's workers end; no query fails at the client; /metrics shows the figures by version;
- a slow one rolls back on latency at once, and every query goes back to the old version;
- a wrong one rolls back on agreement in shadow, while every client got the old version's answer;
- a restart mid-rollout (a new store, rollout loop and meter) resumes at the step the database
  says, with the step's clock kept;
- a version under the user's accuracy floor on labelled queries rolls back at once;
- before traffic, the start returns at once and the rollout loop profiles the new version on
  the app's candidate types (a profile run's workers on a fake worker) and plans the app again
  with it: a slower version gets a bigger stage fleet than the old version's, its steps' extra
  fleets sized from it, and the app's own profiles stay; at promotion they become the run's, and
  the app planned again with them after the handover applies that stage fleet;
- the extra fleet grows step by step, and waits (a decision with the amount) where the budget
  cannot pay for the next step's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.apps.plans import PlanRequest, apply_plan, preview_plan
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.apps.rollouts import (
    NewVersionProfiling,
    RolloutRequest,
    rollout_phase,
    start_rollout,
)
from controlplane.clock import FakeClock, SystemClock
from controlplane.db.store import Store
from controlplane.errors import RolloutBudgetError
from controlplane.loops.rollouts import ROUTE_GRACE_S, RolloutLoop, _base36
from controlplane.policies.lifecycle import InstanceState
from controlplane.policies.rollout import Thresholds, rollout_request_prefix, routed_to_new
from controlplane.service.app import create_app
from controlplane.serving.loop import ServingLoop, ServingSettings
from controlplane.serving.versions import VersionMeter
from controlplane.serving.workers import StaticInstances, WorkerEndpoint
from controlplane.settings import Settings
from provisioners.artifacts import FAMILY_SIGNATURE
from provisioners.base import ProvisionedInstance
from provisioners.fake import FakeProvisioner
from tests.fake_worker import FakeWorker

T = TypeVar("T")
SMALL = "emu.cpu.small"
APP = "digits"
SHA = "ef" * 32
DEADLINE_S = 60.0


class Addressed(FakeProvisioner):
    """The fake provisioner, every instance at ``address`` (a fake worker's: the rollout loop
    times the new version there before traffic)."""

    def __init__(self) -> None:
        super().__init__(running_on_launch=True)
        self.address = ""

    def list(self, tags: Mapping[str, str]) -> list[ProvisionedInstance]:
        return [replace(i, address=self.address) for i in super().list(tags)]


# A model served from the registry with measured profiles (no profiles file).
MEASURED_SPEC = {
    "name": APP,
    "models": [{"name": "tiny", "artifact": "digits-tiny@1"}],
    "slo": {"latency_ms": 5000},
    "budget_usd_per_hr": 5,
    "instance_types": [SMALL],
}


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, DEADLINE_S))


def row(klass: int) -> list[float]:
    return [float(klass), 16.0 * 0.9] + [0.0] * 62


def write_profiles(folder: Path, models: Mapping[str, float]) -> None:
    """Profiles of ``models`` (name -> latency at batch size 1, ms) on :data:`SMALL`."""
    lines = ["model,instance_type,batch_size,sample,infer_ms,load_ms"]
    for model, ms in models.items():
        for b in (1, 2, 4, 8, 16, 32):
            lines += [f"{model},{SMALL},{b},{i},{ms + 0.01 * b:.4f},0" for i in range(3)]
    (folder / "profiles.csv").write_text("\n".join(lines) + "\n")


class World:
    """The store with the app (``spec``: its models, each ``digits-<model>`` versions 1 and 2
    in the registry, version 1 served), the serving loop and API over static workers, the
    rollout loop over :class:`Addressed`; ``files`` are written to the data directory first."""

    def __init__(
        self,
        tmp_path: Path,
        spec: Mapping[str, Any] | None = None,
        profiles: Mapping[str, float] | None = None,
        files: Mapping[str, str] | None = None,
    ) -> None:
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        write_profiles(data_dir, profiles or {"tiny": 1.0})
        for name, text in (files or {}).items():
            (data_dir / name).write_text(text)
        self.clock = FakeClock()
        settings = Settings(data_dir=data_dir, provisioner="fake")
        self.database_url = settings.database_url
        self.store = Store.from_url(settings.database_url, self.clock, upgrade=True)
        if spec is None:
            spec = {
                "name": APP,
                "models": [
                    {"name": "tiny", "profiles": "profiles.csv", "artifact": "digits-tiny@1"}
                ],
                # Generous: a good version on a loaded machine stays within it (no timing
                # asserts).
                "slo": {"latency_ms": 5000},
                "budget_usd_per_hr": 5,
                "instance_types": [SMALL],
            }
        for model in spec["models"]:
            for version in (1, 2):
                name = f"digits-{model['name']}"
                self.store.add_model_version(
                    name, version, "onnx", SHA, 10, FAMILY_SIGNATURE, f"file:///{name}/{version}"
                )
        self.token = self.store.create_token("admin", name="admin")
        self.resolver = AppResolver(
            data_dir, artifacts=self.store.get_model_version, measured=self.store.get_app_profiles
        )
        self.store.create_app(spec_document(self.resolver.check(spec).spec), who="test")
        self.instances = StaticInstances()
        self.serving = ServingLoop(
            self.store,
            self.resolver,
            self.instances,
            clock=SystemClock(),
            settings=ServingSettings(refresh_s=3600.0),
        )
        self.provider = Addressed()
        self.rollouts = RolloutLoop(
            self.store,
            self.resolver,
            self.provider,
            self.clock,
            self.serving.versions,
            alone_calls=5,
            alone_warmup=1,
        )
        self.serving.routes = self.rollouts.route
        self.app = create_app(settings, self.store, self.clock, serving=self.serving)

    def start(
        self,
        shadow: bool = False,
        steps: Sequence[float] = (0.5, 1.0),
        max_p99_ms: float | None = None,
    ) -> int:
        thresholds = Thresholds(max_p99_ms=max_p99_ms, min_queries=10)
        request = RolloutRequest("digits-tiny@2", steps, 10.0, shadow, thresholds)
        return start_rollout(self.store, self.resolver, APP, request, who="test").id

    async def tick(self) -> list[str]:
        return [t.what for t in await asyncio.to_thread(self.rollouts.tick)]

    async def workers_up(
        self, rollout_id: int, workers: Sequence[FakeWorker], expect: str = "running"
    ) -> list[str]:
        """The rollout loop launched its workers; the reconciler saw them healthy; the loop
        timed the new version alone and (``expect``) let traffic move."""
        self.provider.address = workers[0].address
        await self.tick()
        prefix = rollout_request_prefix(APP, rollout_id)
        rows = [r for r in self.store.list_instances(APP) if r.request_id.startswith(prefix)]
        assert [r.state for r in rows] == ["pending"]
        # The rollout's start time in the id (base 36): a rollout id SQLite gives again, once an
        # app is deleted and made anew, names new workers, not the dead ones a provider recorded.
        started = self.store.get_rollout(APP, rollout_id).created_at
        assert rows[0].request_id == f"{prefix}{_base36(int(started.timestamp()))}-{SMALL}-1"
        for r in rows:
            self.store.transition_instance(r.id, InstanceState.RUNNING.value, reason="healthy")
        self.instances.set(
            prefix, [WorkerEndpoint(f"new-{k}", SMALL, w.address) for k, w in enumerate(workers)]
        )
        said = await self.tick()
        if expect == "running":
            assert "workers of the new version running" in said[0], said
        return said

    def state(self, rollout_id: int) -> Any:
        return self.store.get_rollout(APP, rollout_id)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    made = World(tmp_path)
    yield made
    made.store.close()


async def fleet(n: int = 1, **knobs: Any) -> list[FakeWorker]:
    workers = [FakeWorker(SMALL, **knobs) for _ in range(n)]
    for worker in workers:
        await worker.start()
    return workers


def scenario(world: World, body: Callable[[httpx.AsyncClient], Coroutine[Any, Any, T]]) -> T:
    async def inner() -> T:
        await world.serving.start()
        try:
            transport = httpx.ASGITransport(app=world.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://hp") as client:
                return await body(client)
        finally:
            await world.serving.stop()

    return run(inner())


async def until(condition: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
    """Poll ``condition`` until it holds; an AssertionError naming ``what`` past ``within_s``."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        await asyncio.sleep(0.001)


async def send(world: World, client: httpx.AsyncClient, ids: Sequence[str]) -> list[int]:
    """One query per id (ten at a time); each answer's class (every one must be a 200)."""

    async def one(request_id: str, k: int) -> int:
        answer = await client.post(
            f"/v1/apps/{APP}/infer",
            json={"inputs": [row(k % 10)]},
            headers={"Authorization": f"Bearer {world.token}", "X-Request-Id": request_id},
        )
        assert answer.status_code == 200, answer.text
        return int(answer.json()["outputs"][0])

    outputs: list[int] = []
    for start in range(0, len(ids), 10):
        chunk = enumerate(ids[start : start + 10], start)
        outputs += await asyncio.gather(*(one(i, k) for k, i in chunk))
    return outputs


def test_a_good_version_promotes_step_by_step_with_no_failed_query(world: World) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start()
        await world.workers_up(rid, new)
        # Timed alone before traffic (the fake worker's calls), stated in a decision.
        (alone,) = [
            d for d in world.store.list_decisions(APP, kinds=["rollout"]) if "alone" in d.reason
        ]
        assert alone.reason.startswith(f"rollout {rid}: timed alone before traffic: {SMALL}: P99")
        (timed,) = alone.numbers["figures"]["pre_traffic"]["workers"].values()
        assert timed["calls"] == 5 and timed["old_profile_mean_ms"] is not None
        base = new[0].requests  # the 6 calls that timed it
        ids = [f"q-{k}" for k in range(120)]
        outputs = await send(world, client, ids)
        assert outputs == [k % 10 for k in range(120)]
        expected_new = sum(routed_to_new(i, 0.5) for i in ids)
        assert new[0].requests - base == expected_new and old[0].requests == 120 - expected_new
        assert await world.tick() == []  # the interval is not over: hold
        assert world.state(rid).reason.startswith("holding: interval not over")
        world.clock.advance(11.0)
        (promoted,) = await world.tick()
        assert "step 1 passed" in promoted and world.state(rid).step_share == 1.0
        more = [f"r-{k}" for k in range(40)]
        await send(world, client, more)
        assert new[0].requests - base == expected_new + 40  # every query on the new version
        metrics = await client.get("/metrics", headers={"Authorization": f"Bearer {world.token}"})
        samples = {
            (s.name, s.labels.get("version")): s.value
            for family in text_string_to_metric_families(metrics.text)
            for s in family.samples
            if s.name.startswith("heteroplane_rollout")
        }
        assert samples[("heteroplane_rollout_queries", "digits-tiny@2")] == 40
        assert samples[("heteroplane_rollout_errors", "digits-tiny@2")] == 0
        world.clock.advance(11.0)
        (completed,) = await world.tick()
        assert completed.startswith("promoted: last step passed")
        assert world.state(rid).state == "promoted"
        spec = world.store.get_app(APP).spec
        assert spec["models"][0]["artifact"] == "digits-tiny@2"
        # No old fleet row here to hand over: the route goes, the rollout's workers end.
        (handed,) = await world.tick()
        assert handed.startswith("handover done") and world.rollouts.route(APP) is None
        prefix = rollout_request_prefix(APP, rid)

        def canary_states() -> set[str]:
            rows = world.store.list_instances(APP)
            return {r.state for r in rows if r.request_id.startswith(prefix)}

        # The rollout's worker ends only once the route's going is a grace old.
        assert await world.tick() == [] and canary_states() == {"running"}
        world.clock.advance(ROUTE_GRACE_S)
        assert await world.tick() == ["ended 1 worker(s) of the new version"]
        assert canary_states() == {"terminated"}
        reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["rollout"])]
        assert len(reasons) == 6, reasons  # start, alone, running, step, promoted, handover

    scenario(world, body)


def test_the_apps_arrivals_count_the_queries_the_new_version_answers(world: World) -> None:
    """The tuner, the gear switcher and the re-plan read the app's arrivals: every query of the
    app, whichever version answers it. (They counted only the old version's: at a 100 % step
    and through the handover the tuner saw no load and scaled the app's fleet down, then up
    again once the queries came back to it.)"""

    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start()
        await world.workers_up(rid, new)
        ids = [f"q-{k}" for k in range(40)]
        await send(world, client, ids)
        assert 0 < sum(routed_to_new(i, 0.5) for i in ids) < 40
        assert world.serving.arrivals(APP).size == 40
        world.clock.advance(11.0)
        (promoted,) = await world.tick()
        assert "step 1 passed" in promoted and world.state(rid).step_share == 1.0
        await send(world, client, [f"r-{k}" for k in range(20)])
        assert world.serving.arrivals(APP).size == 60
        # Counted once each, not in the old version's window (its figures stay its own).
        totals = world.serving.observations.totals()[APP]
        assert totals.arrived == totals.answered == 40 - sum(routed_to_new(i, 0.5) for i in ids)

    scenario(world, body)


def test_a_slow_version_rolls_back_on_latency_at_once(world: World) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        # Every answer of the new version takes 150 ms or more: over the 100 ms asked for.
        old, new = await fleet(), await fleet(4)
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start(steps=(0.5, 1.0), max_p99_ms=100.0)
        await world.workers_up(rid, new)
        for worker in new:  # fast alone, slow once it serves traffic
            worker.delay_s = 0.15
        base = sum(w.requests for w in new)
        ids = [f"q-{k}" for k in range(40)]
        await send(world, client, ids)
        assert sum(w.requests for w in new) - base == sum(routed_to_new(i, 0.5) for i in ids)
        assert sum(routed_to_new(i, 0.5) for i in ids) >= 10
        (rolled,) = await world.tick()  # no time passed: a breach does not wait
        assert rolled.startswith("rolled back at step 1 (50% of queries): P99")
        assert world.state(rid).state == "rolled_back"
        assert world.rollouts.route(APP) is None
        before = sum(w.requests for w in new)
        await send(world, client, [f"r-{k}" for k in range(20)])
        assert sum(w.requests for w in new) == before  # all back on the old version
        assert await world.tick() == []  # the route went now: the worker ends a grace later
        world.clock.advance(ROUTE_GRACE_S)
        (ended,) = await world.tick()
        assert ended == "ended 1 worker(s) of the new version"
        assert world.store.get_app(APP).spec["models"][0]["artifact"] == "digits-tiny@1"

    scenario(world, body)


def test_a_query_in_flight_on_the_new_version_is_answered_when_its_route_goes(
    world: World,
) -> None:
    """A rollout aborted while a query is on its worker: the route goes at once (new queries
    go to the old version), the canary dispatcher answers what it holds before it closes, and
    the worker ends only a grace later. (The dispatcher used to close at once: the query
    failed on the new version, counted as its error, and the old one answered it again.)"""

    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start(steps=(1.0,))
        await world.workers_up(rid, new)
        new[0].holding = True  # the worker keeps its answers until released
        received = new[0].received
        headers = {"Authorization": f"Bearer {world.token}", "X-Request-Id": "held"}
        held = asyncio.create_task(
            client.post(f"/v1/apps/{APP}/infer", json={"inputs": [row(3)]}, headers=headers)
        )
        while new[0].received == received:  # on the new version's worker now
            await asyncio.sleep(0.001)
        aborted = await client.post(
            f"/v1/apps/{APP}/rollouts/{rid}/abort",
            headers={"Authorization": f"Bearer {world.token}"},
        )
        assert aborted.status_code == 200, aborted.text
        assert await world.tick() == [] and world.rollouts.route(APP) is None
        await world.serving.refresh()  # the serving loop reads that the route went
        assert await send(world, client, ["after-0"]) == [0]
        assert old[0].requests == 1  # the new query went to the old version
        new[0].release()
        answer = await held
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"] == [3]
        world.clock.advance(ROUTE_GRACE_S)
        assert await world.tick() == ["ended 1 worker(s) of the new version"]

    scenario(world, body)


def test_a_version_slow_alone_rolls_back_before_traffic(world: World) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet(delay_s=0.15)
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start(max_p99_ms=100.0)
        (said,) = await world.workers_up(rid, new, expect="rolled back")
        assert said.startswith("rolled back before traffic: alone, the new version's P99 is")
        assert said.endswith("over the limit 100 ms")
        assert world.state(rid).state == "rolled_back" and world.rollouts.route(APP) is None
        base = new[0].requests
        assert await send(world, client, ["q-0", "q-1"]) == [0, 1]
        assert new[0].requests == base and old[0].requests == 2

    scenario(world, body)


def test_a_wrong_version_rolls_back_on_agreement_in_shadow(world: World) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        old = await fleet()
        new = await fleet(predict=lambda _model, r: float((int(r[0]) + 1) % 10))
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start(shadow=True)
        assert world.state(rid).steps == (0.0, 0.5, 1.0)
        await world.workers_up(rid, new)
        outputs = await send(world, client, [f"q-{k}" for k in range(30)])
        assert outputs == [k % 10 for k in range(30)]  # the clients got the old version's
        assert old[0].requests == 30

        def compared() -> int:
            figures = world.serving.versions.figures(APP, rid, 0)
            return figures["digits-tiny@2"].compared if "digits-tiny@2" in figures else 0

        while compared() < 30:  # the shadow answers come back after the clients'
            await asyncio.sleep(0.001)
        (rolled,) = await world.tick()
        assert "agreement with the old version 0.000 (0 of 30 samples)" in rolled
        assert world.state(rid).state == "rolled_back"

    scenario(world, body)


def test_inputs_the_new_version_raises_on_and_the_old_serves_are_its_error(
    world: World,
) -> None:
    """A new version that raises on inputs the old one serves: the query is the new version's
    error and the client gets the old version's answer, in a canary step and in shadow; inputs
    both versions refuse are the client's 422, counted against neither. (A 422 was the
    client's error whatever the old version made of it: such a version passed its steps.)"""

    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        new[0].poison = lambda _model, r: int(r[0]) in (7, 8)  # the new version's regression
        old[0].poison = lambda _model, r: int(r[0]) == 8  # inputs bad for both
        rid = world.start(shadow=True)
        await world.workers_up(rid, new)
        headers = {"Authorization": f"Bearer {world.token}"}

        def figures(step: int) -> tuple[int, int, int]:
            f = world.serving.versions.figures(APP, rid, step).get("digits-tiny@2")
            return (0, 0, 0) if f is None else (f.queries, f.errors, f.compared)

        # Shadow: the client has the old version's answer; the new one's refusal is its error.
        poisoned = await client.post(
            f"/v1/apps/{APP}/infer", json={"inputs": [row(7)]}, headers=headers
        )
        assert poisoned.status_code == 200, poisoned.text
        assert poisoned.json()["outputs"] == [7]
        # The shadow's refusal comes back after the client's answer.
        await until(lambda: figures(0)[0] >= 1, "the new version's refusal counted")
        assert figures(0) == (1, 1, 0)
        refused = await client.post(
            f"/v1/apps/{APP}/infer", json={"inputs": [row(8)]}, headers=headers
        )
        assert refused.status_code == 422, refused.text  # the old version's own refusal
        assert await send(world, client, ["ok-0"]) == [0]
        await until(lambda: figures(0)[2] >= 1, "the good query compared")
        assert figures(0) == (2, 1, 1)  # the query both refused counted by neither

    scenario(world, body)


def test_a_canary_query_the_new_version_refuses_is_answered_by_the_old_one(
    world: World,
) -> None:
    """The canary half of the test above: at a 100% step every query goes to the new version
    first; one it raises on while the old version serves it is answered by the old version and
    counted as the new version's error; one both refuse is the client's 422, counted by
    neither."""

    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        new[0].poison = lambda _model, r: int(r[0]) in (7, 8)
        old[0].poison = lambda _model, r: int(r[0]) == 8
        rid = world.start(steps=(1.0,))
        await world.workers_up(rid, new)
        headers = {"Authorization": f"Bearer {world.token}"}

        def figures() -> tuple[int, int]:
            f = world.serving.versions.figures(APP, rid, 0).get("digits-tiny@2")
            return (0, 0) if f is None else (f.queries, f.errors)

        served_before = old[0].requests
        answer = await client.post(
            f"/v1/apps/{APP}/infer", json={"inputs": [row(7)]}, headers=headers
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"] == [7]  # the old version's answer
        assert old[0].requests == served_before + 1
        assert figures() == (1, 1)
        refused = await client.post(
            f"/v1/apps/{APP}/infer", json={"inputs": [row(8)]}, headers=headers
        )
        assert refused.status_code == 422, refused.text
        assert figures() == (1, 1)  # the inputs' fault: no version's error
        assert await send(world, client, ["ok-0"]) == [0]
        assert figures() == (2, 1)

    scenario(world, body)


def test_a_restart_mid_rollout_resumes_at_its_step(world: World) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start(steps=(0.25, 0.5, 1.0))
        await world.workers_up(rid, new)
        await send(world, client, [f"q-{k}" for k in range(80)])
        world.clock.advance(11.0)
        (promoted,) = await world.tick()
        assert promoted.startswith("step 1 passed") and world.state(rid).step_index == 1
        # The control plane restarts: a new store on the database, a new rollout loop and
        # meter (what was measured in memory is gone); nothing else is told.
        store = Store.from_url(world.database_url, world.clock)
        try:
            world.serving.versions = VersionMeter()
            restarted = RolloutLoop(
                store, world.resolver, FakeProvisioner(), world.clock, world.serving.versions
            )
            world.serving.routes = restarted.route
            assert await asyncio.to_thread(restarted.tick) == []
            route = restarted.route(APP)
            assert route is not None and (route.step_index, route.share) == (1, 0.5)
            # A replica whose loop does not run (a standby) reads the same route, acting on
            # nothing.
            standby = RolloutLoop(
                store, world.resolver, FakeProvisioner(), world.clock, VersionMeter()
            )
            standby.refresh_routes()
            assert standby.route(APP) == route
            # The step's clock kept its start: the interval is over, but this step's queries
            # were counted by the process that died, so it holds until it has enough.
            world.clock.advance(11.0)
            assert await asyncio.to_thread(restarted.tick) == []
            assert "only 0 queries answered" in store.get_rollout(APP, rid).reason
            ids = [f"r-{k}" for k in range(80)]
            before = new[0].requests
            await send(world, client, ids)
            assert new[0].requests - before == sum(routed_to_new(i, 0.5) for i in ids)
            (moved,) = [t.what for t in await asyncio.to_thread(restarted.tick)]
            assert moved.startswith("step 2 passed")
            assert store.get_rollout(APP, rid).step_index == 2
        finally:
            store.close()

    scenario(world, body)


def test_a_crash_as_the_first_step_begins_times_the_workers_again_and_says_it_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process dies as the rollout moves to its first step (the move not written): the
    loop started again times the workers alone again and moves on, each said once. The timing
    used to be a move of its own, written and said before the step's: it was said twice."""
    real = world.store.move_rollout
    dying = [True]

    def move(seen: Any, **changes: Any) -> Any:
        if dying and changes.get("state") == "running":
            dying.pop()
            raise RuntimeError("test: the process died moving to the first step")
        return real(seen, **changes)

    async def body(client: httpx.AsyncClient) -> None:
        old, new = await fleet(), await fleet()
        world.instances.set(APP, [WorkerEndpoint("old-0", SMALL, old[0].address)])
        rid = world.start()
        monkeypatch.setattr(world.store, "move_rollout", move)
        assert await world.workers_up(rid, new, expect="pending") == []
        assert not dying and world.state(rid).state == "pending"
        (running,) = await world.tick()
        assert running.startswith("workers of the new version running"), running
        decided = [d.reason for d in world.store.list_decisions(APP, kinds=["rollout"])]
        for said in ("timed alone before traffic", "workers of the new version running"):
            assert sum(said in r for r in decided) == 1, [r for r in decided if said in r]
        assert "pre_traffic" in world.state(rid).figures

    scenario(world, body)


def test_a_worker_ended_by_someone_else_rolls_the_rollout_back(world: World) -> None:
    """The budget guard, ``app down`` or the reconciler's reaping may end a rollout's worker;
    it is never launched again under its request id, so the rollout rolls back."""
    rid = world.start()
    world.rollouts.tick()
    prefix = rollout_request_prefix(APP, rid)
    (row,) = [r for r in world.store.list_instances(APP) if r.request_id.startswith(prefix)]
    guard = "budget: the fleet and its profile workers cost 0.1 USD/hr, over the budget"
    world.store.transition_instance(row.id, InstanceState.TERMINATING.value, reason=guard)
    world.store.transition_instance(row.id, InstanceState.TERMINATED.value, reason="gone")
    (said,) = [t.what for t in world.rollouts.tick()]
    # Why it ended, as the move out of service said (a budget cut said nothing of the budget).
    assert said == f"rolled back: a worker of the new version ended ({SMALL} terminated: {guard})"
    assert world.state(rid).state == "rolled_back" and world.rollouts.route(APP) is None


def test_promotion_gives_the_app_the_new_versions_measured_profiles(tmp_path: Path) -> None:
    """A model served from the registry with measured profiles (no profiles file): the new
    version, timed before traffic at the batch sizes of the app's profile, becomes what the
    planner and the tuner read once it is promoted."""
    world = World(tmp_path, MEASURED_SPEC, profiles={})
    old_profile = {
        "model": "tiny",
        "instance_type": SMALL,
        "batch_sizes": [1, 2, 4],
        "latency_ms": [[900.0, 901.0], [902.0, 903.0], [904.0, 905.0]],
    }
    world.store.put_app_profiles(
        APP, {"format": "heteroplane.profiles/v1", "profiles": [old_profile]}
    )
    world.resolver.invalidate(APP)

    async def body() -> None:
        (new,) = await fleet()
        rid = world.start(steps=(1.0,))
        await world.workers_up(rid, [new])
        route = world.rollouts.route(APP)
        assert route is not None
        for _ in range(10):  # the step's queries, as the serving loop records them
            world.serving.versions.answered(APP, route, "digits-tiny@2", 1.0)
        world.clock.advance(11.0)
        (promoted,) = await world.tick()
        assert promoted.endswith(
            f"the app's profiles of tiny on {SMALL} are now the new version's (timed before"
            " traffic)"
        )

    try:
        run(body())
        (profile,) = world.store.get_app_profiles(APP)["profiles"]
        assert profile["batch_sizes"] == [1, 2, 4]
        assert [len(cell) for cell in profile["latency_ms"]] == [5, 5, 5]
        assert max(max(cell) for cell in profile["latency_ms"]) < 900.0  # the fake's, not old
        resolved = world.resolver.resolve(world.store.get_app(APP).spec)
        assert resolved.profile("tiny", SMALL).mean_latency_ms(1) < 900.0
    finally:
        world.store.close()


def test_the_start_returns_at_once_and_the_loop_profiles_and_plans(tmp_path: Path) -> None:
    """The old version answers in 1 ms (its measured profile at batch sizes 1 and 2), the
    applied plan runs it on one instance; the new version (a fake worker that takes 100 ms a
    call) is to be profiled: the start returns at once (``pending``, phase ``profiling``, nothing
    launched), and the rollout loop profiles it at those batch sizes in a thread and plans the
    app again at the applied plan's rate: the new plan's stage fleet, more than one instance, is
    what the steps' extra fleets are sized from (half of it, rounded up, at 50 %)."""
    world = World(tmp_path, MEASURED_SPEC, profiles={})
    old_profile = {
        "model": "tiny",
        "instance_type": SMALL,
        "batch_sizes": [1, 2],
        "latency_ms": [[1.0, 1.1, 1.2], [1.3, 1.4, 1.5]],
    }
    old_document = {"format": "heteroplane.profiles/v1", "profiles": [old_profile]}
    world.store.put_app_profiles(APP, old_document)
    world.resolver.invalidate(APP)
    preview = preview_plan(world.store, world.resolver, APP, PlanRequest(rate_qps=50.0))
    applied = apply_plan(world.store, APP, preview.id, "test")
    assert dict(applied.plan.fleet) == {SMALL: 1}
    world.rollouts.profiling = NewVersionProfiling(world.provider, world.clock, 0, 0.5, 5, 1)

    def profile_rows() -> list[Any]:
        return [r for r in world.store.list_instances(APP) if r.request_id.startswith("profile:")]

    async def body() -> tuple[Any, list[str]]:
        (slow,) = await fleet(delay_s=0.1)
        world.provider.address = slow.address
        request = RolloutRequest("digits-tiny@2", (0.5, 1.0), 10.0)
        started = start_rollout(
            world.store, world.resolver, APP, request, who="test", profile_run=True
        )
        assert started.state == "pending" and rollout_phase(started) == "profiling"
        assert profile_rows() == [] and "profiled" not in started.settings
        assert await world.tick() == []  # the run starts, in a thread of the loop
        assert rollout_phase(world.state(started.id)) == "profiling"
        await asyncio.to_thread(world.rollouts.join_profile_runs, DEADLINE_S)
        return started, await world.tick()

    try:
        started, said = run(body())
        rollout = world.state(started.id)
        profiled = rollout.settings["profiled"]
        assert profiled["instance_types"] == [SMALL] and profiled["batch_sizes"] == [1, 2]
        assert profiled["mean_ms_at_1"][SMALL] >= 100.0  # the fake worker's delay, not 1 ms
        planned = profiled["plan"]
        assert planned["planned_rate_qps"] == pytest.approx(applied.plan.planned_rate_qps)
        stage = rollout.settings["stage_fleet"]
        assert stage == planned["stages"]["tiny"] and stage[SMALL] > 1
        assert rollout.settings["extra_fleet"] == {SMALL: math.ceil(0.5 * stage[SMALL])}
        assert rollout_phase(rollout) == "starting"
        reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["rollout"])]
        assert "profiled on emu.cpu.small" in reasons[1] and "planned at" in reasons[1], reasons
        assert reasons[2].endswith(
            f"step 1's extra instances granted: {SMALL}={stage[SMALL] // 2 + stage[SMALL] % 2}"
        )
        assert said == [], said
        # The profile run's workers ended; the app still serves (and is profiled as) version 1.
        workers = [r for r in profile_rows() if "rollout-" not in r.request_id]
        assert workers and all(r.state in ("terminating", "terminated") for r in workers)
        assert world.store.get_app_profiles(APP) == old_document
        # At promotion, the app's profiles become those of the run.
        loop_pin = world.rollouts._pin(rollout)
        assert "are now the new version's" in loop_pin
        (pinned,) = world.store.get_app_profiles(APP)["profiles"]
        assert pinned["batch_sizes"] == [1, 2] and min(pinned["latency_ms"][0]) >= 100.0
        # After the handover the app is planned again with them (what the rollout loop does
        # once the rollout's workers have ended, tests/component/test_rollouts.py): the new
        # plan, the stage fleet the rollout was sized from, is applied.
        replanned = world.rollouts._plan_again(rollout)
        now = world.store.get_applied_plan(APP)
        assert now is not None and now.id != applied.id
        assert dict(now.plan.fleet) == stage and now.plan.feasible
        assert replanned.startswith(
            f"planned again with the new version: plan {now.id} ({SMALL}={stage[SMALL]},"
            f" {now.plan.cost_usd_per_hr:.4g} USD/hr) replaces plan {applied.id} ({SMALL}=1,"
            f" {applied.plan.cost_usd_per_hr:.4g} USD/hr): "
        ), replanned
        # What differs, said (a plan with the same fleet says what else moved).
        assert f"fleet {SMALL}=1 -> {SMALL}={stage[SMALL]}" in replanned, replanned
        (decision,) = world.store.list_decisions(APP, kinds=["plan_applied"])[-1:]
        assert decision.reason == f"plan {now.id} applied by rollout {rollout.id}"
        # Planned again once more, the fleet is the same: the applied plan stays.
        again = world.rollouts._plan_again(rollout)
        assert again == f"planned again with the new version: the same plan, plan {now.id} stays"
        assert world.store.get_applied_plan(APP).id == now.id  # type: ignore[union-attr]
        # A budget cut since: no fleet within it serves the planned rate, and the plan stays.
        price = now.plan.cost_usd_per_hr / stage[SMALL]
        world.store.change_budget(APP, 1.5 * price, reason="cut", who="test")
        cut = world.rollouts._plan_again(rollout)
        assert cut.startswith(f"plan {now.id} stays: planned again with the new version, no"), cut
        assert world.store.get_applied_plan(APP).id == now.id  # type: ignore[union-attr]
    finally:
        world.store.close()


def test_a_profile_run_that_cannot_run_refuses_or_rolls_back(world: World) -> None:
    """Up front, a profile run the budget cannot pay for refuses the start with the amount; a
    profile run that fails in the rollout loop (the provider has no capacity for its worker)
    rolls the rollout back before traffic, with the reason."""
    world.rollouts.profiling = NewVersionProfiling(world.provider, world.clock, 0, 0.5, 5, 1)
    request = RolloutRequest("digits-tiny@2", (0.5, 1.0), 10.0)
    price = world.resolver.resolve(world.store.get_app(APP).spec).prices_usd_per_hr[SMALL]
    world.store.change_budget(APP, 0.5 * price, reason="tight", who="test")
    with pytest.raises(RolloutBudgetError, match="the start's profile run: one worker of each of"):
        start_rollout(world.store, world.resolver, APP, request, who="test", profile_run=True)
    assert world.store.list_rollouts(APP) == []
    world.store.change_budget(APP, 5.0, reason="room", who="test")
    world.provider.fail_capacity(SMALL)
    rid = start_rollout(world.store, world.resolver, APP, request, who="test", profile_run=True).id

    async def body() -> list[str]:
        await world.tick()
        await asyncio.to_thread(world.rollouts.join_profile_runs, DEADLINE_S)
        return await world.tick()

    run(body())
    rolled = world.state(rid)
    assert rolled.state == "rolled_back", rolled
    assert rolled.reason.startswith(
        "rolled back before traffic: the new version could not be profiled and planned: cannot"
        f" launch {SMALL} to profile"
    ), rolled.reason
    assert world.rollouts.route(APP) is None


def test_a_profile_run_the_budget_cut_since_the_start_waits_without_the_runs_advice(
    world: World,
) -> None:
    """A budget cut after the start leaves no room for the profile run's worker: the rollout
    waits for the budget with the amount, and does not pass on ``profile run``'s advice to
    profile fewer types (``--types``), which a rollout does not take."""
    world.rollouts.profiling = NewVersionProfiling(world.provider, world.clock, 0, 0.5, 5, 1)
    request = RolloutRequest("digits-tiny@2", (0.5, 1.0), 10.0)
    price = world.resolver.resolve(world.store.get_app(APP).spec).prices_usd_per_hr[SMALL]
    rid = start_rollout(world.store, world.resolver, APP, request, who="test", profile_run=True).id
    world.store.change_budget(APP, 0.5 * price, reason="cut", who="test")

    async def body() -> list[str]:
        await world.tick()
        await asyncio.to_thread(world.rollouts.join_profile_runs, DEADLINE_S)
        return await world.tick()

    run(body())
    assert world.state(rid).state == "pending"
    reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["rollout"])]
    (waited,) = [r for r in reasons if "waiting for the budget" in r]
    assert "the profile run of the new version does not fit" in waited, waited
    assert f"over the budget of {0.5 * price:g} USD/hr" in waited, waited
    assert "--types" not in waited, waited


def test_the_extra_fleet_grows_step_by_step_within_the_budget(tmp_path: Path) -> None:
    """The applied plan's stage runs four instances: at 25 % the rollout runs one extra
    instance; the next step (100 %) needs three more, which the budget cannot pay for next to
    it, so the step holds with a decision naming the amount; once the budget is raised the step
    moves and the extra fleet grows to four (no traffic to the new version until they run)."""
    world = World(tmp_path)
    price = world.resolver.resolve(world.store.get_app(APP).spec).prices_usd_per_hr[SMALL]
    stages = [{"name": "tiny", "fleet": {SMALL: 4}, "batch_size": 4, "policy": "fcfs"}]
    plan = world.store.create_plan(
        APP, {"feasible": True, "cost_usd_per_hr": 4 * price, "stages": stages}
    )
    world.store.apply_plan(APP, plan.id)
    world.store.change_budget(APP, 2.5 * price, reason="tight", who="test")
    rid = world.start(steps=(0.25, 1.0))
    assert world.state(rid).settings["extra_fleet"] == {SMALL: 1}

    async def body() -> tuple[list[str], list[str]]:
        (new,) = await fleet()
        await world.workers_up(rid, [new])
        route = world.rollouts.route(APP)
        assert route is not None
        for _ in range(12):
            world.serving.versions.answered(APP, route, "digits-tiny@2", 5.0)
        world.clock.advance(11.0)
        held = await world.tick()
        world.store.change_budget(APP, 5 * price, reason="room", who="test")
        for _ in range(12):
            world.serving.versions.answered(APP, route, "digits-tiny@2", 5.0)
        return held, await world.tick()

    try:
        held, moved = run(body())
        assert held == []
        reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["rollout"])]
        waited = [r for r in reasons if "waiting for the budget" in r]
        assert len(waited) == 1, reasons
        assert (
            f"step 2 (100% of queries) needs {SMALL}=3 more for {3 * price:.4g} USD/hr"
            in (waited[0])
        )
        assert f"over the budget of {2.5 * price:g} USD/hr" in waited[0]
        (said,) = moved
        assert said.startswith("step 1 passed") and f"grow to {SMALL}=4" in said
        # The wait says it is one (numbers.wait), the move that it is not: `heteroplane
        # events` folds only a rollout's waits together, not its moves in one state and step.
        decided = world.store.list_decisions(APP, kinds=["rollout"])
        assert [d.numbers["wait"] for d in decided if "waiting for the budget" in d.reason] == [
            True
        ]
        assert [d.numbers["wait"] for d in decided if "step 1 passed" in d.reason] == [False]
        rollout = world.state(rid)
        assert rollout.step_index == 1 and rollout.settings["extra_fleet"] == {SMALL: 4}
        assert world.rollouts.route(APP) is None  # until the three new workers run
        prefix = rollout_request_prefix(APP, rid)
        rows = [r for r in world.store.list_instances(APP) if r.request_id.startswith(prefix)]
        assert len(rows) == 1  # launched by the next tick
        # A plan written by hand has no rate to plan on again: at promotion it stays.
        kept = world.rollouts._plan_again(rollout)
        assert kept == (
            f"plan {plan.id} stays (the plan has no planned rate to plan for again): plan again"
            " for the new version"
        )
    finally:
        world.store.close()


def test_a_version_under_the_accuracy_floor_rolls_back(world: World) -> None:
    """``min_accuracy`` set: once ``min_queries`` labelled samples were answered by the new
    version (queries naming validation samples, as the serving loop records them), an accuracy
    under the floor rolls the rollout back at once, before the interval is over."""
    thresholds = Thresholds(min_queries=10, min_accuracy=0.9)
    request = RolloutRequest("digits-tiny@2", (0.5, 1.0), 10.0, False, thresholds)
    rid = start_rollout(world.store, world.resolver, APP, request, who="test").id

    async def body() -> list[str]:
        (new,) = await fleet()
        await world.workers_up(rid, [new])
        route = world.rollouts.route(APP)
        assert route is not None
        for k in range(12):  # 12 labelled samples, 6 answered with their label
            world.serving.versions.answered(
                APP, route, "digits-tiny@2", 1.0, labelled=1, correct=k % 2
            )
        return await world.tick()

    (said,) = run(body())
    assert said == (
        "rolled back at step 1 (50% of queries): accuracy 0.500 (6 of 12 labelled samples)"
        " under the limit 0.9"
    )
    rolled = world.state(rid)
    assert rolled.state == "rolled_back" and world.rollouts.route(APP) is None
    assert rolled.figures["versions"]["digits-tiny@2"]["accuracy"] == 0.5
    assert rolled.settings["thresholds"]["min_accuracy"] == 0.9


def test_the_pin_at_promotion_keeps_a_budget_cut_made_meanwhile(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promotion pinned the new version by writing the spec it had read back whole: a
    budget cut between its read and its write was undone (a review of the spec-replace race).
    It writes at the version read now, and pins again on the spec as it is after a conflict."""
    rollout = world.store.create_rollout(
        APP,
        model="tiny",
        artifact="digits-tiny",
        from_version=1,
        to_version=2,
        settings={},
        reason="test",
        who="test",
    )
    before = world.store.get_app(APP).budget_usd_per_hr
    read = world.store.get_app
    cut: list[bool] = []

    def then_a_cut(name: str) -> Any:
        found = read(name)
        if not cut:
            cut.append(True)
            world.store.change_budget(APP, before / 2, reason="cut", who="op")
        return found

    monkeypatch.setattr(world.store, "get_app", then_a_cut)
    world.rollouts._pin(rollout)
    monkeypatch.undo()
    after = world.store.get_app(APP)
    assert after.budget_usd_per_hr == pytest.approx(before / 2)
    assert after.spec["budget_usd_per_hr"] == pytest.approx(before / 2)
    assert after.spec["models"][0]["artifact"] == "digits-tiny@2"
