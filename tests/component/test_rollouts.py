"""Rollouts through the API (controlplane.api.routes.rollouts, controlplane.apps.rollouts): a
real SQLite store through the migrations, the real resolver and registry records, the fake
provisioner.

- start, read, pause, resume, abort; one active rollout per app (409); every move a ``rollout``
  decision with its reason; what a rollout is survives a new store on the same database;
- bad input is a one-line 4xx: a model the app does not serve, the version it serves, another
  signature, steps that do not end at 100 %, an unknown version;
- the budget: the rollout's extra instances must fit next to the fleet, else 409 with the amount.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controlplane.apps.resolver import AppResolver
from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.service.app import create_app
from controlplane.settings import Settings
from estimator.catalog import default_catalog
from provisioners.artifacts import FAMILY_SIGNATURE, ModelSignature, TensorSpec
from provisioners.fake import FakeProvisioner
from tests.dying_writes import decision_write_fails

SMALL = "emu.cpu.small"
APP = "wine"
SHA = "ab" * 32
PRICE = {t.name: t.price_usd_per_hr for t in default_catalog().values()}[SMALL]


def spec(budget: float) -> dict[str, Any]:
    return {
        "name": APP,
        "models": [{"name": "clf", "artifact": "wine-model"}],
        "slo": {"latency_ms": 200},
        "budget_usd_per_hr": budget,
        "instance_types": [SMALL],
    }


@dataclass
class World:
    store: Store
    client: TestClient
    auth: dict[str, str]
    db_url: str


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    clock = FakeClock()
    url = f"sqlite:///{tmp_path / 'hp.db'}"
    store = Store.from_url(url, clock, upgrade=True)
    for version in (1, 2):
        store.add_model_version(
            "wine-model", version, "onnx", SHA, 10, FAMILY_SIGNATURE, f"file:///r/{version}.onnx"
        )
    other = ModelSignature(
        inputs=(TensorSpec("x", "FP32", (-1, 13)),), outputs=FAMILY_SIGNATURE.outputs
    )
    store.add_model_version("wine-model", 3, "onnx", SHA, 10, other, "file:///r/3.onnx")
    resolver = AppResolver(
        tmp_path, artifacts=store.get_model_version, measured=store.get_app_profiles
    )
    # These tests are of the API and the budget check on the applied plan's fleet: the start
    # does not profile the new version (the fake provider's instances never answer;
    # tests/component/test_rollout_serving.py profiles it on fake workers).
    settings = Settings(data_dir=tmp_path, provisioner="fake", rollout_profile_run=False)
    token = store.create_token("operator", name="op")
    app = create_app(settings, store, clock, resolver=resolver, provisioner=FakeProvisioner())
    with TestClient(app, raise_server_exceptions=False) as client:
        yield World(store, client, {"Authorization": f"Bearer {token}"}, url)
    store.close()


def register(world: World, budget: float, pinned: str = "wine-model@1") -> None:
    document = spec(budget)
    document["models"][0]["artifact"] = pinned
    created = world.client.post("/v1/apps", json=document, headers=world.auth)
    assert created.status_code == 201, created.text


def post(world: World, path: str, body: dict[str, Any] | None = None) -> Any:
    return world.client.post(f"/v1/apps/{APP}/{path}", json=body, headers=world.auth)


def test_the_life_cycle_of_a_rollout(world: World) -> None:
    register(world, budget=10 * PRICE)
    started = post(world, "rollouts", {"model": "wine-model@2", "interval_s": 30})
    assert started.status_code == 201, started.text
    body = started.json()
    assert {k: body[k] for k in ("model", "from_version", "to_version", "state")} == {
        "model": "clf",
        "from_version": 1,
        "to_version": 2,
        "state": "pending",
    }
    # Pending: no query moves yet; the first step will move 5%.
    assert body["step_share"] == 0.0 and body["steps"] == [0.05, 0.25, 0.5, 1.0]
    assert body["extra_fleet"] == {SMALL: 1}
    assert body["extra_cost_usd_per_hr"] == pytest.approx(PRICE)
    rid = body["id"]
    again = post(world, "rollouts", {"model": "wine-model@2"})
    assert again.status_code == 409 and "one rollout per app" in again.json()["error"]["message"]
    # Pending, it is checked before traffic moves: nothing to pause (a resume would go to
    # running and skip those checks).
    refused = post(world, f"rollouts/{rid}/pause")
    assert refused.status_code == 409 and "nothing to pause" in refused.json()["error"]["message"]
    # Its checks passed (what the rollout loop does), it runs the first step.
    (pending,) = world.store.list_rollouts(APP)
    world.store.move_rollout(pending, state="running", reason="checked", new_step=True)
    assert post(world, f"rollouts/{rid}/pause").json()["state"] == "paused"
    assert post(world, f"rollouts/{rid}/pause").status_code == 409  # paused -> paused
    assert post(world, f"rollouts/{rid}/resume").json()["state"] == "running"
    aborted = post(world, f"rollouts/{rid}/abort")
    assert aborted.json()["state"] == "aborted" and aborted.json()["step_share"] == 0.0
    assert post(world, f"rollouts/{rid}/abort").status_code == 404  # nothing active
    listed = world.client.get(f"/v1/apps/{APP}/rollouts", headers=world.auth).json()
    assert [r["state"] for r in listed] == ["aborted"]
    one = world.client.get(f"/v1/apps/{APP}/rollouts/{rid}", headers=world.auth)
    assert one.json()["reason"] == "aborted: all traffic back on the old version by op"
    reasons = [d.reason for d in world.store.list_decisions(APP, kinds=["rollout"])]
    assert len(reasons) == 4 and "started by op" in reasons[0] and "aborted" in reasons[-1]
    # A second rollout may start once the first is over.
    assert post(world, "rollouts", {"model": "wine-model@2"}).status_code == 201
    # Persisted: a new store on the same database reads the same rollouts.
    fresh = Store.from_url(world.db_url)
    try:
        assert [r.state for r in fresh.list_rollouts(APP)] == ["aborted", "pending"]
    finally:
        fresh.close()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "other@2"}, 422, "serves no registry model 'other'"),
        ({"model": "wine-model@1"}, 422, "already serves wine-model@1"),
        ({"model": "wine-model@3"}, 422, "other tensors"),
        ({"model": "wine-model@9"}, 404, "wine-model@9"),
        ({"model": "Not A Name"}, 422, "NAME or NAME@VERSION"),
        ({"model": "wine-model@2", "steps": [0.5, 0.2, 1.0]}, 422, "must increase"),
        ({"model": "wine-model@2", "steps": [0.5]}, 422, "each in (0, 1], the last 1; got 0.5"),
        ({"model": "wine-model@2", "steps": [25, 50, 100]}, 422, "got 25,50,100"),
        ({"model": "wine-model@2", "interval_s": 0.1}, 422, "interval_s"),
        ({"model": "wine-model@2", "thresholds": {"max_error_share": 3}}, 422, "max_error_share"),
        ({"model": "wine-model@2", "surprise": 1}, 422, "surprise"),
    ],
)
def test_bad_input_is_a_one_line_4xx(
    world: World, body: dict[str, Any], status: int, message: str
) -> None:
    register(world, budget=10 * PRICE)
    answer = post(world, "rollouts", body)
    assert answer.status_code == status, answer.text
    text = answer.json()["error"]["message"]
    assert message in text and "\n" not in text
    assert world.store.list_rollouts(APP) == []


def test_a_spec_that_changes_what_a_rollout_works_on_is_refused_while_it_runs(
    world: World,
) -> None:
    """Removing a model or changing the thresholds under a running rollout made the new
    version's share of the queries fail 422 against the new shape, counted nowhere, and a
    promotion wrote the old thresholds back (a tester)."""
    register(world, budget=10 * PRICE)
    started = post(world, "rollouts", {"model": "wine-model@2", "interval_s": 30})
    assert started.status_code == 201, started.text
    current = world.client.get(f"/v1/apps/{APP}", headers=world.auth).json()["spec"]
    renamed = [dict(m, name=f"{m['name']}2") for m in current["models"]]
    changed = current | {"models": renamed}
    refused = world.client.put(f"/v1/apps/{APP}", json=changed, headers=world.auth)
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert f"has rollout {started.json()['id']} of clf pending" in message
    assert "works on its models as they were" in message and "rollout abort" in message
    # Nor its instance types (its extra instances run on them, priced at the spec's prices: with
    # the type left out, the rollout loop failed every tick and the rollout stood still).
    wider = current | {"instance_types": [*current["instance_types"], "emu.cpu.large"]}
    refused = world.client.put(f"/v1/apps/{APP}", json=wider, headers=world.auth)
    assert refused.status_code == 409, refused.text
    assert "works on its instance_types as they were" in refused.json()["error"]["message"]
    # What the rollout does not read may change meanwhile: the SLO.
    slower = current | {"slo": {**current["slo"], "latency_ms": current["slo"]["latency_ms"] + 5}}
    assert world.client.put(f"/v1/apps/{APP}", json=slower, headers=world.auth).status_code == 200
    # Once it ended, the models may change too.
    post(world, f"rollouts/{started.json()['id']}/abort")
    replaced = world.client.put(
        f"/v1/apps/{APP}", json=changed | {"slo": slower["slo"]}, headers=world.auth
    )
    assert replaced.status_code != 409, replaced.text


def test_an_abort_while_pending_says_no_query_had_moved(world: World) -> None:
    """Its decision said "at step 1 of 4 (5% of queries)": what the first step would have moved
    (a tester)."""
    register(world, budget=10 * PRICE)
    rid = post(world, "rollouts", {"model": "wine-model@2"}).json()["id"]
    assert post(world, f"rollouts/{rid}/abort").json()["state"] == "aborted"
    decision = world.store.list_decisions(APP, kinds=["rollout"])[-1]
    assert decision.reason.endswith(
        "aborted: all traffic back on the old version by op while pending (no query had moved"
        " to the new version)"
    )
    assert decision.numbers["step_share"] == 0.0


def test_a_start_whose_decision_was_not_written_is_not_recorded_either(world: World) -> None:
    """The write of the start's decision fails (the process dies there, or its database write
    does): the rollout is not recorded either, and starting it again starts it and says it
    once. The decision used to be written after the rollout, in a transaction of its own: the
    rollout was recorded and never said (``heteroplane events`` showed no start), and starting
    it again was a 409 naming it."""
    register(world, budget=10 * PRICE)
    with decision_write_fails("started by") as failing:
        died = post(world, "rollouts", {"model": "wine-model@2"})
        assert died.status_code == 500 and failing == [], died.text
        assert world.store.list_rollouts(APP) == []
        started = post(world, "rollouts", {"model": "wine-model@2"})
        assert started.status_code == 201, started.text
    (rollout,) = world.store.list_rollouts(APP)
    decided = world.store.list_decisions(APP, kinds=["rollout"])
    assert [d.numbers["rollout_id"] for d in decided] == [rollout.id], decided
    assert decided[0].reason.startswith(f"rollout {rollout.id}: wine-model@1 -> wine-model@2")


def test_a_rollout_waits_for_the_last_ones_handover(world: World) -> None:
    """A promoted rollout's handover (its route stands while the old version's instances are
    replaced) is one in progress: a start meanwhile is a 409 naming it; once its route went
    (``done_at``), a rollout may start."""
    register(world, budget=10 * PRICE)
    rid = post(world, "rollouts", {"model": "wine-model@2"}).json()["id"]
    (first,) = world.store.list_rollouts(APP)
    first = world.store.move_rollout(first, state="running", reason="checked", new_step=True)
    handover = {"ended": [], "promoted_at": "2024-01-01T00:00:00+00:00", "plan_after": True}
    first = world.store.move_rollout(first, state="promoted", figures={"handover": handover})
    refused = post(world, "rollouts", {"model": "wine-model@2"})
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert f"rollout {rid} was promoted and still hands the app over" in message, message
    done = {**handover, "done_at": "2024-01-01T00:01:00+00:00"}
    world.store.move_rollout(first, figures={"handover": done})
    assert post(world, "rollouts", {"model": "wine-model@2"}).status_code == 201


def test_a_rollout_the_budget_cannot_pay_for_is_refused_with_the_amount(world: World) -> None:
    register(world, budget=1.5 * PRICE)
    world.store.record_instance(
        APP, request_id="wine-1", instance_type=SMALL, price_usd_per_hr=PRICE, reason="fleet"
    )
    answer = post(world, "rollouts", {"model": "wine-model@2"})
    assert answer.status_code == 409, answer.text
    message = answer.json()["error"]["message"]
    assert f"needs {PRICE:.4g} USD/hr of extra instances ({SMALL}=1 for its first step)" in message
    assert f"together {2 * PRICE:.4g} USD/hr" in message
    assert world.store.list_rollouts(APP) == []
    assert world.client.get(f"/v1/apps/{APP}/rollouts/1", headers=world.auth).status_code == 404


@dataclass
class Handover:
    """A promoted rollout about to hand over: the app's two old instances (running), the
    rollout's one worker, on the fake provisioner and a fake clock."""

    clock: FakeClock
    store: Store
    provider: FakeProvisioner
    old: list[Any]
    prefix: str  # the request ids of the rollout's workers start with it

    def row(self, request_id: str, state: str = "running") -> Any:
        from provisioners.base import APP_TAG, LaunchRequest

        (made,) = self.provider.launch(LaunchRequest(request_id, SMALL, 1, {APP_TAG: APP}))
        return self.store.record_instance(
            APP,
            request_id=request_id,
            instance_type=SMALL,
            price_usd_per_hr=PRICE,
            provider_id=made.provider_id,
            state=state,
        )

    def start(self) -> Any:
        """A rollout of the app (version 1 again: the handover does not look at it), pending."""
        return self.store.create_rollout(
            APP,
            model="clf",
            artifact="wine-model",
            from_version=1,
            to_version=1,
            settings={"steps": [1.0], "interval_s": 1.0, "extra_fleet": {SMALL: 1}},
            reason="test",
            who="test",
        )

    def rate_plan(self) -> Any:
        """A plan of the app's two instances with a planned rate to plan on again, applied."""
        stages = [{"name": "clf", "fleet": {SMALL: 2}, "batch_size": 1, "policy": "fcfs"}]
        plan = self.store.create_plan(
            APP,
            {"feasible": True, "cost_usd_per_hr": 2 * PRICE, "rate_qps": 10.0, "stages": stages},
        )
        return self.store.apply_plan(APP, plan.id)

    def loop(self, tmp_path: Path, **knobs: Any) -> Any:
        from controlplane.loops.rollouts import RolloutLoop
        from controlplane.serving.versions import VersionMeter

        resolver = AppResolver(tmp_path, artifacts=self.store.get_model_version)
        return RolloutLoop(self.store, resolver, self.provider, self.clock, VersionMeter(), **knobs)


@pytest.fixture
def handover(tmp_path: Path) -> Iterator[Handover]:
    from controlplane.policies.rollout import rollout_request_prefix

    clock = FakeClock()
    store = Store.from_url(f"sqlite:///{tmp_path / 'hp.db'}", clock, upgrade=True)
    try:
        store.add_model_version("wine-model", 1, "onnx", SHA, 10, FAMILY_SIGNATURE, "file:///1")
        document = spec(10 * PRICE)
        document["models"][0]["artifact"] = "wine-model@1"
        store.create_app(document, who="test")
        made = Handover(clock, store, FakeProvisioner(running_on_launch=True), [], "")
        made.old = [made.row(f"wine-{n}") for n in (1, 2)]
        clock.advance(1.0)
        rollout = made.start()
        made.prefix = rollout_request_prefix(APP, rollout.id)
        made.row(f"{made.prefix}{SMALL}-1")
        rollout = store.move_rollout(rollout, state="running")
        clock.advance(1.0)
        store.move_rollout(
            rollout,
            state="promoted",
            figures={"handover": {"ended": [], "promoted_at": clock.utcnow().isoformat()}},
        )
        yield made
    finally:
        store.close()


def test_the_handover_ends_the_old_fleet_under_the_disruption_budget(
    handover: Handover, tmp_path: Path
) -> None:
    """After promotion the old version's serving instances end one per window of the
    disruption budget (the reconciler replaces them with the new version), the first once the
    route to the new version is a grace old; once as many replacements run as were ended and
    the last ended a grace ago, the route goes and the rollout's workers end a grace later."""
    from controlplane.loops.rollouts import ROUTE_GRACE_S
    from controlplane.policies.disruption import DisruptionBudget

    clock, store, old = handover.clock, handover.store, handover.old
    loop = handover.loop(
        tmp_path, disruption=DisruptionBudget(max_instances=1, max_share=0.0, window_s=60.0)
    )
    # Every query goes to the new version at once; the old version's instances end only
    # once that route is ROUTE_GRACE_S old (what they hold is answered first).
    assert loop.tick() == [] and loop.route(APP) is not None
    assert loop.route(APP).share == 1.0
    assert {store.get_instance(r.id).state for r in old} == {"running"}
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 1 instance(s) of the old version"]
    assert loop.route(APP) is not None and loop.route(APP).share == 1.0
    assert loop.tick() == []  # the window's one disruption is spent
    assert sorted(store.get_instance(r.id).state for r in old) == ["running", "terminated"]
    clock.advance(61.0)
    assert [t.what for t in loop.tick()] == ["ended 1 instance(s) of the old version"]
    clock.advance(1.0)
    handover.row("wine-3")  # the reconciler's replacement, loading the new version
    assert loop.tick() == [] and loop.route(APP) is not None  # one of two replaced
    handover.row("wine-4")
    # Both replaced, but the last old instance ended 1 s ago: a serving process may still list
    # it, and the queries the route's going sends back to the fleet would reach it first.
    assert loop.tick() == [] and loop.route(APP) is not None
    clock.advance(ROUTE_GRACE_S - 1.0)
    (done,) = [t.what for t in loop.tick()]
    assert done.startswith("handover done: 2 instance(s) serve wine-model@1")
    assert loop.route(APP) is None
    # The route went; the rollout's worker ends once that is ROUTE_GRACE_S old.
    prefix = handover.prefix
    (canary,) = [r for r in store.list_instances(APP) if r.request_id.startswith(prefix)]
    loop.refresh_routes()  # what a serving replica reads: no route from now on
    assert loop.route(APP) is None
    assert loop.tick() == [] and store.get_instance(canary.id).state == "running"
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 1 worker(s) of the new version"]
    assert store.get_instance(canary.id).state == "terminated"


def test_a_rollout_tick_reads_the_fleet_and_its_recent_past_not_its_whole_history(
    handover: Handover, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An app that has cycled for weeks has mostly ended rows; a rollout's tick (every few
    seconds while it runs) reads its own workers and the rows the handover needs: those live or
    moved since the promotion or within the disruption budget's window."""
    from datetime import timedelta

    from controlplane.loops.rollouts import ROUTE_GRACE_S
    from controlplane.policies.disruption import DisruptionBudget

    clock, store = handover.clock, handover.store
    long_ago = clock.utcnow() - timedelta(days=1)
    gone = store.record_instance(
        APP, request_id="wine-0", instance_type=SMALL, price_usd_per_hr=PRICE, at=long_ago
    )
    store.transition_instance(gone.id, "failed", reason="capacity", at=long_ago)
    read: list[str] = []
    real = store.list_instances

    def spy(*args: Any, **kwargs: Any) -> Any:
        rows = real(*args, **kwargs)
        read.extend(r.id for r in rows)
        return rows

    monkeypatch.setattr(store, "list_instances", spy)
    loop = handover.loop(
        tmp_path, disruption=DisruptionBudget(max_instances=1, max_share=0.0, window_s=60.0)
    )
    assert loop.tick() == []
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 1 instance(s) of the old version"]
    assert {r.id for r in handover.old} <= set(read)
    assert gone.id not in read


def test_the_handover_ends_with_fewer_replacements_once_the_fleet_has_settled(
    handover: Handover, tmp_path: Path
) -> None:
    """The app scaled down during the handover (its tuner sized the fleet for less load than
    the old one served): two old instances ended, the fleet wants one. The handover waits for
    the second replacement while one boots, then takes the fleet as it is once nothing boots
    and the last old instance left FLEET_SETTLE_S ago (it used to wait for a second
    replacement that never came, the rollout's workers kept and paid for)."""
    from controlplane.loops.rollouts import FLEET_SETTLE_S, ROUTE_GRACE_S

    clock, store = handover.clock, handover.store
    loop = handover.loop(tmp_path)
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 2 instance(s) of the old version"]
    assert {store.get_instance(r.id).state for r in handover.old} == {"terminated"}
    clock.advance(1.0)
    handover.row("wine-3")  # the one replacement the fleet wants
    booting = handover.row("wine-4", state="pending")  # and one the reconciler still boots
    clock.advance(FLEET_SETTLE_S)
    assert loop.tick() == [] and loop.route(APP) is not None  # something boots: wait
    store.transition_instance(booting.id, "failed", reason="test: the fleet wants one")
    (done,) = [t.what for t in loop.tick()]
    assert done.startswith("handover done: 1 instance(s) serve wine-model@1")
    assert loop.route(APP) is None


def test_the_app_is_planned_again_once_after_the_handover(
    handover: Handover, tmp_path: Path
) -> None:
    """Once the handover is done and the rollout's workers have ended (their budget free
    again), the app is planned again as it now is, once: a ``rollout`` decision says what came
    of it. Here the app's registered model has no measured profiles, so the applied plan stays
    and the decision says why; later ticks plan no more (the planning itself, a plan applied
    or kept: tests/component/test_rollout_serving.py)."""
    from controlplane.loops.rollouts import ROUTE_GRACE_S

    clock, store = handover.clock, handover.store
    plan = handover.rate_plan()
    (rollout,) = store.list_rollouts(APP)
    figures = rollout.figures
    # A promotion says the app is to be planned again after its handover (one promoted before
    # that step was built is not planned again by surprise).
    rollout = store.move_rollout(
        rollout, figures={**figures, "handover": {**figures["handover"], "plan_after": True}}
    )
    loop = handover.loop(tmp_path)
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 2 instance(s) of the old version"]
    clock.advance(1.0)
    handover.row("wine-3")
    handover.row("wine-4")
    clock.advance(ROUTE_GRACE_S)
    (done,) = [t.what for t in loop.tick()]
    assert done.startswith("handover done: 2 instance(s)")
    # The rollout's worker still runs (and still costs): nothing is planned yet.
    assert loop.tick() == []
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 1 worker(s) of the new version"]
    (planned,) = [t.what for t in loop.tick()]
    stays = f"plan {plan.id} stays: the app could not be planned again ("
    assert planned.startswith(stays), planned
    assert "profile" in planned and len(planned.splitlines()) == 1
    assert store.get_applied_plan(APP).id == plan.id  # type: ignore[union-attr]
    assert loop.tick() == [] and loop.tick() == []  # once
    decided = [d.reason for d in store.list_decisions(APP, kinds=["rollout"])]
    assert decided.count(f"rollout {rollout.id}: {planned}") == 1, decided


def test_a_move_whose_decision_was_not_written_is_made_again_and_said_once(
    handover: Handover, tmp_path: Path
) -> None:
    """The write of a move's decision fails (the process dies there, or its database write
    does): the move is not kept either, so the loop started again makes it again and says it
    once. Here the handover's end and the plan after it, each failing once. The decision used
    to be written after the move, in a transaction of its own: the move was kept, the loop
    started again read it done, and the move was never said (the plan, a "planned again"
    decision, too)."""
    from controlplane.loops.rollouts import ROUTE_GRACE_S

    clock, store = handover.clock, handover.store
    plan = handover.rate_plan()
    (rollout,) = store.list_rollouts(APP)
    figures = rollout.figures
    store.move_rollout(
        rollout, figures={**figures, "handover": {**figures["handover"], "plan_after": True}}
    )
    with decision_write_fails("handover done", "planned again") as failing:
        clock.advance(ROUTE_GRACE_S)
        assert [t.what for t in handover.loop(tmp_path).tick()] == [
            "ended 2 instance(s) of the old version"
        ]
        clock.advance(1.0)
        handover.row("wine-3")
        handover.row("wine-4")
        clock.advance(ROUTE_GRACE_S)
        assert handover.loop(tmp_path).tick() == []  # died saying the handover's end
        assert failing == ["planned again"]
        (done,) = [t.what for t in handover.loop(tmp_path).tick()]  # started again
        assert done.startswith("handover done: 2 instance(s)")
        clock.advance(ROUTE_GRACE_S)
        assert [t.what for t in handover.loop(tmp_path).tick()] == [
            "ended 1 worker(s) of the new version"
        ]
        assert handover.loop(tmp_path).tick() == []  # died saying the plan
        assert failing == []
        assert "planned" not in store.list_rollouts(APP)[0].figures["handover"]
        again = handover.loop(tmp_path)
        (planned,) = [t.what for t in again.tick()]
        assert planned.startswith(f"plan {plan.id} stays: the app could not be planned again (")
        assert again.tick() == [] and handover.loop(tmp_path).tick() == []
    decided = [d.reason for d in store.list_decisions(APP, kinds=["rollout"])]
    for move in ("handover done", "planned again"):
        assert sum(move in r for r in decided) == 1, decided
    assert store.list_rollouts(APP)[0].figures["handover"]["planned"] == planned


def _a_second_rollout_before_the_first_ones_plan(
    handover: Handover, tmp_path: Path
) -> tuple[Any, Any, Any, Callable[[], list[str]]]:
    """The first rollout's handover done and its plan due, a second rollout started: the plan,
    the two rollouts, and what a loop tick says of the first (its worker's end said already)."""
    from controlplane.loops.rollouts import ROUTE_GRACE_S

    clock, store = handover.clock, handover.store
    plan = handover.rate_plan()
    (first,) = store.list_rollouts(APP)
    store.move_rollout(
        first,
        figures={
            "handover": {
                **first.figures["handover"],
                "plan_after": True,
                "done_at": clock.utcnow().isoformat(),
            }
        },
    )
    second = handover.start()
    loop = handover.loop(tmp_path)
    clock.advance(ROUTE_GRACE_S)

    def said() -> list[str]:
        return [t.what for t in loop.tick() if t.rollout_id == first.id]

    assert said() == ["ended 1 worker(s) of the new version"]
    return plan, first, second, said


def test_the_plan_after_the_handover_waits_for_another_rollout_of_the_app(
    handover: Handover, tmp_path: Path
) -> None:
    """A second rollout of the app, started once the first was promoted, holds part of the
    budget with its workers: the first one's plan waits while it is under way, and is made
    once it is over (here aborted: the app must not keep a plan made for the version before)."""
    store = handover.store
    plan, first, second, said = _a_second_rollout_before_the_first_ones_plan(handover, tmp_path)
    assert said() == [] and said() == []  # waiting for the second
    assert "planned" not in store.get_rollout(APP, first.id).figures["handover"]
    store.move_rollout(store.get_rollout(APP, second.id), state="aborted", reason="test")
    (planned,) = said()
    assert planned.startswith(f"plan {plan.id} stays: the app could not be planned again (")
    assert store.get_rollout(APP, first.id).figures["handover"]["planned"] == planned


def test_the_plan_after_the_handover_leaves_the_app_to_a_rollout_promoted_since(
    handover: Handover, tmp_path: Path
) -> None:
    """A second rollout started in the window between the first one's handover and its plan,
    and promoted: the first one's plan waited while the second ran, then was made in the middle
    of the second one's handover, for the second one's version (a tester's sweep). It waits
    through that handover too, and is then left to the second, which plans the app after its
    own handover: the first says so, once."""
    clock, store = handover.clock, handover.store
    _plan, first, second, said = _a_second_rollout_before_the_first_ones_plan(handover, tmp_path)
    promoted_at = clock.utcnow().isoformat()
    running = store.move_rollout(store.get_rollout(APP, second.id), state="running", reason="test")
    store.move_rollout(
        running,
        state="promoted",
        reason="test",
        figures={"handover": {"ended": [], "promoted_at": promoted_at, "plan_after": True}},
    )
    assert said() == [] and said() == []  # the second one's handover is under way
    assert "planned" not in store.get_rollout(APP, first.id).figures["handover"]
    second = store.get_rollout(APP, second.id)
    done = {**second.figures["handover"], "done_at": clock.utcnow().isoformat()}
    store.move_rollout(second, figures={**second.figures, "handover": done})
    (left,) = said()
    assert left.startswith(f"not planned again: rollout {second.id} of the app, promoted since")
    assert store.get_rollout(APP, first.id).figures["handover"]["planned"] == left
    assert said() == []


def test_the_plan_after_the_handover_needs_no_ended_worker_nor_a_recent_rollout(
    handover: Handover, tmp_path: Path
) -> None:
    """A worker of the rollout's that the provider has not ended yet (its row terminating: not
    billed) does not hold the plan back, and a service that comes back long after the handover
    (past the loop's recent window) still plans the app once; a rollout promoted without the
    mark is not planned again."""
    from controlplane.loops.rollouts import RECENT_S

    clock, store = handover.clock, handover.store
    plan = handover.rate_plan()
    (rollout,) = store.list_rollouts(APP)
    done = {**rollout.figures["handover"], "done_at": clock.utcnow().isoformat()}
    rollout = store.move_rollout(rollout, figures={"handover": done})
    (worker,) = [r for r in store.list_instances(APP) if r.request_id.startswith(handover.prefix)]
    store.transition_instance(worker.id, "terminating", reason="test: the provider is slow")
    clock.advance(RECENT_S + 60.0)
    loop = handover.loop(tmp_path)
    assert loop.tick() == []  # no mark: not planned
    store.move_rollout(rollout, figures={"handover": {**done, "plan_after": True}})
    (said,) = [t.what for t in loop.tick()]
    assert said.startswith(f"plan {plan.id} stays: the app could not be planned again (")
    assert loop.tick() == []


def test_a_plan_made_on_recorded_traffic_is_planned_again_at_its_burstiness() -> None:
    """The plan after a handover plans on what the applied plan was planned on; one made on
    recorded traffic stored no generator parameters, only the recorded CV^2: gamma arrivals of
    that CV^2 (at most the generator's bound) stand in for it, not a Poisson trace."""
    from controlplane.apps.plans import burstiness_replanning_request
    from controlplane.policies.plan import PlanDocument
    from estimator.traces import MAX_CV2

    def plan(trace: dict[str, Any] | None) -> PlanDocument:
        stages = [{"name": "clf", "fleet": {SMALL: 1}, "batch_size": 1}]
        document = {"feasible": True, "cost_usd_per_hr": PRICE, "rate_qps": 40.0, "seed": 3}
        return PlanDocument.parse({**document, "stages": stages, "trace": trace})

    recorded = burstiness_replanning_request(plan({"count": 900, "rate_qps": 41.0, "cv2": 4.5}))
    assert recorded.trace is not None and recorded.seed == 3
    drawn = (recorded.trace.kind, recorded.trace.cv2, recorded.trace.rate_qps)
    assert drawn == ("gamma", 4.5, 40.0)
    assert burstiness_replanning_request(plan({"cv2": 1e6})).trace.cv2 == MAX_CV2  # type: ignore[union-attr]
    for smooth in ({"cv2": 1.0}, {"count": 10}, None):
        poisson = burstiness_replanning_request(plan(smooth))
        assert poisson.trace is None and poisson.rate_qps == 40.0
    generated = {"request": {"rate_qps": 30.0, "kind": "gamma", "cv2": 2.0}, "cv2": 2.2}
    kept = burstiness_replanning_request(plan(generated))
    assert kept.trace is not None and (kept.trace.rate_qps, kept.trace.cv2) == (30.0, 2.0)


def test_a_route_read_from_the_database_is_not_written_over_a_tick_made_meanwhile(
    handover: Handover, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's serving refresh reads the routes from the database on its thread while the
    scheduler's tick moves the rollout: a read that began before the tick's move must not put
    the route back (it did, for up to a refresh, after the handover's end and a roll-back)."""
    from controlplane.loops.rollouts import ROUTE_GRACE_S

    clock = handover.clock
    loop = handover.loop(tmp_path)
    clock.advance(ROUTE_GRACE_S)
    assert [t.what for t in loop.tick()] == ["ended 2 instance(s) of the old version"]
    handover.row("wine-3")
    handover.row("wine-4")
    clock.advance(ROUTE_GRACE_S)
    assert loop.route(APP) is not None
    read = loop._current
    ticked: list[str] = []
    inside: list[bool] = []

    def read_then_tick() -> Any:
        if inside:  # the tick's own read
            return read()
        before = read()  # the rollout in handover, as the database had it
        inside.append(True)
        ticked.extend(t.what for t in loop.tick())  # meanwhile the tick ends the handover
        return before

    monkeypatch.setattr(loop, "_current", read_then_tick)
    loop.refresh_routes()
    assert len(ticked) == 1 and ticked[0].startswith("handover done"), ticked
    assert loop.route(APP) is None
    monkeypatch.undo()
    loop.refresh_routes()  # a read after the move agrees
    assert loop.route(APP) is None


def test_the_handover_goes_on_when_the_rollouts_workers_ended_first(
    handover: Handover, tmp_path: Path
) -> None:
    """A budget cut during the handover: the budget guard ends the rollout's workers first
    (they count as profile workers). The handover still replaces the old version's instances
    (queries go to the fleet meanwhile: no route), and ends once replacements run; it used to
    stop for good, the fleet left on the old version with the spec naming the new one."""
    from controlplane.loops.rollouts import ROUTE_GRACE_S

    clock, store = handover.clock, handover.store
    loop = handover.loop(tmp_path)
    assert loop.tick() == [] and loop.route(APP) is not None
    (canary,) = [r for r in store.list_instances(APP) if r.request_id.startswith(handover.prefix)]
    store.transition_instance(canary.id, "terminating", reason="test: the budget guard")
    store.transition_instance(canary.id, "terminated", reason="test: the budget guard")
    clock.advance(ROUTE_GRACE_S)
    # No worker of the rollout's catches the queries: the fleet serves (no route), and its old
    # instances go one at a time, each once the replacement of the one before runs.
    assert [t.what for t in loop.tick()] == ["ended 1 instance(s) of the old version"]
    assert loop.route(APP) is None
    assert sorted(store.get_instance(r.id).state for r in handover.old) == [
        "running",
        "terminated",
    ]
    clock.advance(1.0)
    refused = handover.row("wine-9", state="requested")
    store.transition_instance(refused.id, "failed", reason="test: launch refused")
    clock.advance(60.0)
    assert loop.tick() == []  # its launch failed, the type held: the last old one stays
    booting = handover.row("wine-3", state="pending")
    clock.advance(300.0)
    assert loop.tick() == []  # its replacement boots: the last old one stays
    store.transition_instance(booting.id, "running", reason="test: booted")
    assert [t.what for t in loop.tick()] == ["ended 1 instance(s) of the old version"]
    assert {store.get_instance(r.id).state for r in handover.old} == {"terminated"}
    clock.advance(1.0)
    handover.row("wine-4")
    (done,) = [t.what for t in loop.tick()]
    assert done.startswith("handover done: 2 instance(s) serve wine-model@1")
    assert loop.route(APP) is None


def test_an_accuracy_floor_is_stored_and_checked(world: World) -> None:
    """``thresholds.min_accuracy`` (default: not judged) is kept with the rollout; a share
    outside [0, 1] is a 422."""
    register(world, budget=10 * PRICE)
    bad = post(world, "rollouts", {"model": "wine-model@2", "thresholds": {"min_accuracy": 1.5}})
    assert bad.status_code == 422, bad.text
    plain = post(world, "rollouts", {"model": "wine-model@2"})
    assert plain.json()["thresholds"]["min_accuracy"] is None
    post(world, f"rollouts/{plain.json()['id']}/abort")
    floored = post(
        world, "rollouts", {"model": "wine-model@2", "thresholds": {"min_accuracy": 0.9}}
    )
    assert floored.status_code == 201 and floored.json()["thresholds"]["min_accuracy"] == 0.9


def test_a_spec_that_changes_a_served_models_artifact_is_refused_while_instances_live(
    world: World,
) -> None:
    """`heteroplane app apply` with another artifact for a model the app serves: its running
    workers have the old one loaded and would go on serving it under the new spec. With live
    instances that is a 409 pointing to a rollout; with none the spec is replaced."""
    register(world, budget=10 * PRICE)
    moved = spec(10 * PRICE)
    moved["models"][0]["artifact"] = "wine-model@2"
    live = world.store.record_instance(
        APP, request_id="r-1", instance_type=SMALL, price_usd_per_hr=PRICE, state="running"
    )
    refused = world.client.put(f"/v1/apps/{APP}", json=moved, headers=world.auth)
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert "model 'clf' (wine-model@1 -> wine-model@2)" in message
    assert "1 live instance" in message and "heteroplane rollout start" in message
    assert world.store.get_app(APP).spec["models"][0]["artifact"] == "wine-model@1"
    # Anything else may change under live instances (the budget here).
    kept = spec(12 * PRICE)
    kept["models"][0]["artifact"] = "wine-model@1"
    assert world.client.put(f"/v1/apps/{APP}", json=kept, headers=world.auth).status_code == 200
    # Once the instances are gone, the artifact may change.
    world.store.transition_instance(live.id, "terminating", reason="down")
    world.store.transition_instance(live.id, "terminated", reason="down")
    replaced = world.client.put(f"/v1/apps/{APP}", json=moved, headers=world.auth)
    assert replaced.status_code == 200, replaced.text
    assert world.store.get_app(APP).spec["models"][0]["artifact"] == "wine-model@2"


def test_a_profile_runs_workers_being_ended_do_not_hold_an_artifact_change(
    world: World,
) -> None:
    """Right after `heteroplane profile run` the run's workers are still terminating: they
    serve nothing, so `app apply` with another artifact was a 409 until they were gone (a
    tester). A profile worker still measuring, or a fleet worker terminating, still counts."""
    register(world, budget=10 * PRICE)
    moved = spec(10 * PRICE)
    moved["models"][0]["artifact"] = "wine-model@2"
    ending = world.store.record_instance(
        APP,
        request_id=f"profile:{APP}-1a2b3c4d-{SMALL}",
        instance_type=SMALL,
        price_usd_per_hr=PRICE,
        state="running",
    )
    refused = world.client.put(f"/v1/apps/{APP}", json=moved, headers=world.auth)
    assert refused.status_code == 409 and "1 live instance" in refused.text, refused.text
    world.store.transition_instance(ending.id, "terminating", reason="profile run ended")
    replaced = world.client.put(f"/v1/apps/{APP}", json=moved, headers=world.auth)
    assert replaced.status_code == 200, replaced.text
    assert world.store.get_app(APP).spec["models"][0]["artifact"] == "wine-model@2"


def test_applying_the_same_spec_again_changes_nothing(world: World) -> None:
    """A spec that names an artifact unpinned (``wine-model``) is stored pinned (the latest,
    ``wine-model@3``); applying the same file again is the same spec: the app's version (which
    its previewed plans were made for) stays, where it was bumped on every apply."""
    document = spec(10 * PRICE)
    assert document["models"][0]["artifact"] == "wine-model"
    created = world.client.post("/v1/apps", json=document, headers=world.auth)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["models"][0]["artifact"] == "wine-model@3"
    again = world.client.put(f"/v1/apps/{APP}", json=document, headers=world.auth)
    assert again.status_code == 200, again.text
    assert again.json()["version"] == created.json()["version"]
    assert len(world.store.list_budget_changes(APP)) == 1  # no new audit row either
    changed = world.client.put(
        f"/v1/apps/{APP}", json={**document, "budget_usd_per_hr": 12 * PRICE}, headers=world.auth
    )
    assert changed.json()["version"] == created.json()["version"] + 1


def test_no_rollout_starts_or_goes_on_in_an_app_being_taken_down(
    world: World, tmp_path: Path
) -> None:
    """`app down` launches nothing more for the app: a rollout is refused at its start (409, as
    a plan's apply is), and one already under way is aborted by the loop before it launches its
    workers."""
    from controlplane.apps.teardown import request_teardown

    register(world, budget=10 * PRICE)
    world.store.record_instance(  # a fleet to drain: the app is not deleted at once
        APP, request_id="r-1", instance_type=SMALL, price_usd_per_hr=PRICE, reason="test"
    )
    started = post(world, "rollouts", {"model": "wine-model@2", "interval_s": 30})
    assert started.status_code == 201, started.text
    assert request_teardown(world.store, APP, "test").deleted is False
    refused = post(world, "rollouts", {"model": "wine-model@2"})
    assert refused.status_code == 409, refused.text
    assert "is being taken down" in refused.json()["error"]["message"]

    from controlplane.loops.rollouts import RolloutLoop
    from controlplane.serving.versions import VersionMeter

    provider = FakeProvisioner(running_on_launch=True)
    resolver = AppResolver(tmp_path, artifacts=world.store.get_model_version)
    loop = RolloutLoop(world.store, resolver, provider, FakeClock(), VersionMeter())
    (ticked,) = loop.tick()
    assert ticked.what == "aborted: the app is being taken down (heteroplane app down)"
    assert provider.list({}) == []  # nothing launched
    (rollout,) = world.store.list_rollouts(APP)
    assert rollout.state == "aborted" and loop.route(APP) is None
    assert [r.request_id for r in world.store.list_instances(APP)] == ["r-1"]


def test_a_spec_replace_and_a_rollout_start_racing_do_not_both_pass(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replace that changed the instance types and a rollout's start sent together were both
    taken (a tester: 4 of 23 tries), the rollout started on the spec the replace then changed
    under it. The store checks again under the app's lock, which both take: the race is played
    here by starting the rollout between the replace's own check and its write, then by
    replacing the spec between the start's checks and its record."""
    register(world, budget=10 * PRICE)
    current = world.client.get(f"/v1/apps/{APP}", headers=world.auth).json()["spec"]
    wider = current | {"instance_types": [*current["instance_types"], "emu.cpu.large"]}
    checked = world.store.current_rollout
    started: list[int] = []

    def then_a_start(app: str) -> Any:
        found = checked(app)  # the replace's check: no rollout yet
        if not started:
            record = world.store.get_app(APP)
            started.append(
                world.store.create_rollout(
                    APP,
                    model="clf",
                    artifact="wine-model",
                    from_version=1,
                    to_version=2,
                    settings={},
                    reason="racing",
                    who="op",
                    app_spec=record.spec,
                ).id
            )
        return found

    monkeypatch.setattr(world.store, "current_rollout", then_a_start)
    refused = world.client.put(f"/v1/apps/{APP}", json=wider, headers=world.auth)
    assert refused.status_code == 409, refused.text
    assert f"has rollout {started[0]} of clf pending" in refused.json()["error"]["message"]
    assert world.store.get_app(APP).spec["instance_types"] == current["instance_types"]
    monkeypatch.undo()
    post(world, f"rollouts/{started[0]}/abort")

    # The other way: the spec replaced after the start read it, before it is recorded.
    listed = world.store.list_rollouts

    def then_a_replace(app: str | None = None, *, active: bool = False) -> Any:
        found = listed(app, active=active)
        record = world.store.get_app(APP)
        if record.spec["instance_types"] == current["instance_types"]:
            world.store.update_app(APP, wider, who="op")
        return found

    monkeypatch.setattr(world.store, "list_rollouts", then_a_replace)
    late = post(world, "rollouts", {"model": "wine-model@2", "interval_s": 30})
    assert late.status_code == 409, late.text
    assert "replaced while the rollout was being started" in late.json()["error"]["message"]
    monkeypatch.undo()
    assert [r.id for r in world.store.list_rollouts(APP, active=True)] == []


def test_a_spec_replace_does_not_undo_a_budget_cut_made_while_it_was_checked(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replace carrying the old budget, sent with a budget cut, put the old budget back (the
    audit read "0.12 -> 0.3, spec updated" right after the cut, whose drain never came; a
    tester). The replace is written at the version it read: a cut in between is a 409."""
    register(world, budget=10 * PRICE)
    current = world.client.get(f"/v1/apps/{APP}", headers=world.auth).json()["spec"]
    slower = current | {"slo": {**current["slo"], "latency_ms": current["slo"]["latency_ms"] + 5}}
    read = world.store.get_app
    cut: list[float] = []

    def then_a_cut(name: str) -> Any:
        found = read(name)
        if not cut:
            cut.append(5 * PRICE)
            world.store.change_budget(APP, cut[0], reason="cut", who="op2")
        return found

    monkeypatch.setattr(world.store, "get_app", then_a_cut)
    refused = world.client.put(f"/v1/apps/{APP}", json=slower, headers=world.auth)
    monkeypatch.undo()
    assert refused.status_code == 409, refused.text
    assert "changed meanwhile" in refused.json()["error"]["message"]
    assert world.store.get_app(APP).budget_usd_per_hr == pytest.approx(cut[0])
    # Sent again, read afresh: the replace carries the old budget, a raise it means.
    again = world.client.put(f"/v1/apps/{APP}", json=slower, headers=world.auth)
    assert again.status_code == 200, again.text


def test_a_replace_with_if_match_is_taken_only_at_the_version_it_read(world: World) -> None:
    """A client that read the app, then sent its change after another had changed it, undid
    that change without knowing (the last writer won). ``GET /v1/apps/{app}`` gives the app's
    version as its ETag; a replace with ``If-Match`` naming another version is a 412."""
    register(world, budget=10 * PRICE)
    read = world.client.get(f"/v1/apps/{APP}", headers=world.auth)
    etag = read.headers["ETag"]
    assert etag == f'"{read.json()["version"]}"'
    current = read.json()["spec"]
    slower = current | {"slo": {**current["slo"], "latency_ms": current["slo"]["latency_ms"] + 5}}
    # Another operator cuts the budget meanwhile.
    cut = world.client.put(
        f"/v1/apps/{APP}/budget",
        json={"budget_usd_per_hr": 5 * PRICE, "reason": "cut"},
        headers=world.auth,
    )
    assert cut.status_code == 200, cut.text
    stale = world.client.put(
        f"/v1/apps/{APP}", json=slower, headers={**world.auth, "If-Match": etag}
    )
    assert stale.status_code == 412, stale.text
    error = stale.json()["error"]
    assert error["code"] == "precondition_failed" and error["field"] == "If-Match"
    assert world.store.get_app(APP).budget_usd_per_hr == pytest.approx(5 * PRICE)
    # Read again: the ETag names the version now, and the replace is taken (its new ETag said).
    fresh = world.client.get(f"/v1/apps/{APP}", headers=world.auth)
    spec_now = fresh.json()["spec"]
    changed = spec_now | {"slo": slower["slo"]}
    taken = world.client.put(
        f"/v1/apps/{APP}", json=changed, headers={**world.auth, "If-Match": fresh.headers["ETag"]}
    )
    assert taken.status_code == 200, taken.text
    assert taken.headers["ETag"] == f'"{taken.json()["version"]}"' != fresh.headers["ETag"]
    assert world.store.get_app(APP).budget_usd_per_hr == pytest.approx(5 * PRICE)
    # "*" and no If-Match take any version; a value that is no ETag is a 400.
    for header in ({"If-Match": "*"}, {}):
        again = world.client.put(f"/v1/apps/{APP}", json=changed, headers={**world.auth, **header})
        assert again.status_code == 200, again.text
    etag = world.client.get(f"/v1/apps/{APP}", headers=world.auth).headers["ETag"]
    weak = world.client.put(
        f"/v1/apps/{APP}", json=changed, headers={**world.auth, "If-Match": f"W/{etag}"}
    )
    assert weak.status_code == 412, weak.text  # If-Match compares strongly (RFC 9110)
    bad = world.client.put(f"/v1/apps/{APP}", json=changed, headers={**world.auth, "If-Match": "3"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "If-Match", bad.text
