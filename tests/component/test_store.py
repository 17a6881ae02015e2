"""The store on a SQLite file migrated to the newest revision: apps, budgets, plans, instances,
decisions, metrics and tokens, with the errors callers tell apart.

Concurrency (two writers at once) and PostgreSQL are in tests/integration/test_store_databases.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from controlplane.db import migrate
from controlplane.db.store import TOKEN_CACHE_S, AppRecord, Principal, Store
from controlplane.errors import (
    AppExistsError,
    ConflictError,
    DatabaseError,
    InvalidTransitionError,
    InvalidValueError,
    NotFoundError,
    UnknownScopeError,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)


class StepClock:
    """A wall clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = T0

    def utcnow(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def spec(name: str = "recs", budget: float = 10.0) -> dict[str, Any]:
    return {
        "name": name,
        "models": [{"name": "rm2", "profiles": "profiles.csv"}],
        "slo": {"latency_ms": 350, "percentile": 99},
        "budget_usd_per_hr": budget,
        "instance_types": ["g4dn.xlarge", "r5n.large"],
    }


PLAN = {"feasible": True, "cost_usd_per_hr": 3.5, "stages": [], "steps": ["start"]}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "heteroplane.db"


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def store(db_path: Path, clock: StepClock) -> Iterator[Store]:
    url = f"sqlite:///{db_path}"
    migrate.upgrade(url)
    store = Store.from_url(url, clock)
    yield store
    store.close()


# --- apps ------------------------------------------------------------------------------------


def test_create_get_and_list_apps(store: Store) -> None:
    app = store.create_app(spec("recs"), who="alice")
    assert isinstance(app, AppRecord)
    assert dataclasses.is_dataclass(app)
    assert (app.name, app.version, app.budget_usd_per_hr) == ("recs", 1, 10.0)
    assert app.spec == spec("recs")
    assert app.applied_plan_id is None
    assert app.created_at == app.updated_at == T0
    store.create_app(spec("ads", budget=4), who="alice")
    assert [a.name for a in store.list_apps()] == ["ads", "recs"]
    assert store.get_app("recs") == app


def test_an_explicit_budget_overrides_the_spec(store: Store) -> None:
    app = store.create_app(spec(budget=10), 7.5, who="alice")
    assert app.budget_usd_per_hr == 7.5
    assert app.spec["budget_usd_per_hr"] == 7.5


def test_duplicate_app_name(store: Store) -> None:
    store.create_app(spec("recs"), who="alice")
    with pytest.raises(AppExistsError, match="an app named 'recs' already exists"):
        store.create_app(spec("recs"), who="bob")
    assert isinstance(AppExistsError("x"), ConflictError)


def test_missing_app(store: Store) -> None:
    with pytest.raises(NotFoundError, match="no app 'nope'") as caught:
        store.get_app("nope")
    assert (caught.value.kind, caught.value.key) == ("app", "nope")


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({**spec(), "budget_usd_per_hr": 0}, "budget_usd_per_hr"),
        ({**spec(), "budget_usd_per_hr": float("nan")}, "budget_usd_per_hr"),
        ({**spec(), "budget_usd_per_hr": "10"}, "budget_usd_per_hr"),
        ({**spec(), "name": ""}, "name"),
        ({**spec(), "extra": float("inf")}, "spec"),
    ],
)
def test_bad_app_values(store: Store, document: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidValueError) as caught:
        store.create_app(document, who="alice")
    assert caught.value.field == field
    assert store.list_apps() == []


def test_update_app_bumps_version_and_audits_a_new_budget(store: Store, clock: StepClock) -> None:
    store.create_app(spec(), who="alice")
    clock.advance(60)
    new = {**spec(budget=12), "instance_types": ["g4dn.xlarge"]}
    app = store.update_app("recs", new, who="bob", expected_version=1)
    assert (app.version, app.budget_usd_per_hr, app.spec) == (2, 12.0, new)
    assert app.updated_at == T0 + timedelta(seconds=60)
    changes = store.list_budget_changes("recs")
    assert [(c.old_usd_per_hr, c.new_usd_per_hr, c.who) for c in changes] == [
        (None, 10.0, "alice"),
        (10.0, 12.0, "bob"),
    ]
    with pytest.raises(ConflictError, match=r"changed meanwhile \(version 1 -> 2"):
        store.update_app("recs", new, who="bob", expected_version=1)
    with pytest.raises(InvalidValueError, match="cannot be renamed"):
        store.update_app("recs", spec("other"), who="bob")


def test_delete_app_cascades(store: Store) -> None:
    store.create_app(spec(), who="alice")
    plan = store.create_plan("recs", PLAN)
    store.apply_plan("recs", plan.id)
    instance = store.record_instance(
        "recs", request_id="r1", instance_type="g4dn.xlarge", price_usd_per_hr=0.526
    )
    store.record_decision("recs", "scale_up", "load")
    store.add_metric_sample("recs", arrival_rate_qps=5, fleet_cost_usd_per_hr=0.5)
    with pytest.raises(ConflictError, match="still has 1 live instance"):
        store.delete_app("recs")
    store.transition_instance(instance.id, "failed", reason="lost")
    store.delete_app("recs")
    assert store.list_apps() == []
    assert store.list_instances() == []
    assert store.list_decisions() == []
    assert store.list_instance_events() == []
    with pytest.raises(NotFoundError):
        store.get_instance(instance.id)
    # The name is free again.
    assert store.create_app(spec(), who="alice").version == 1


def test_delete_app_with_live_instances_when_forced(store: Store) -> None:
    store.create_app(spec(), who="alice")
    store.record_instance("recs", request_id="r1", instance_type="t3.xlarge", price_usd_per_hr=1)
    store.delete_app("recs", force=True)
    assert store.list_instances() == []


# --- budgets ---------------------------------------------------------------------------------


def test_change_budget_audits_and_bumps_version(store: Store, clock: StepClock) -> None:
    store.create_app(spec(budget=10), who="alice")
    clock.advance(5)
    change = store.change_budget("recs", 6.0, reason="cost review", who="ops-token")
    assert (change.app, change.who, change.reason) == ("recs", "ops-token", "cost review")
    assert (change.old_usd_per_hr, change.new_usd_per_hr) == (10.0, 6.0)
    assert change.at == T0 + timedelta(seconds=5)
    app = store.get_app("recs")
    assert (app.budget_usd_per_hr, app.spec["budget_usd_per_hr"], app.version) == (6.0, 6.0, 2)
    assert store.list_budget_changes("recs")[-1] == change
    assert len(store.list_budget_changes("recs", limit=1)) == 1


def test_budget_history_is_listed_in_chain_order_not_by_time(store: Store) -> None:
    """Two replicas whose clocks disagree: the second change carries the earlier time, and the
    history still lists it after the first (each change's old budget is the one before's new)."""
    store.create_app(spec(budget=10), who="alice")
    store.change_budget("recs", 8.0, reason="a", who="x", at=T0 + timedelta(seconds=30))
    store.change_budget("recs", 6.0, reason="b", who="y", at=T0 + timedelta(seconds=10))
    store.change_budget("recs", 4.0, reason="c", who="z", at=T0 + timedelta(seconds=20))
    history = store.list_budget_changes("recs")
    assert [c.new_usd_per_hr for c in history] == [10.0, 8.0, 6.0, 4.0]
    assert all(a.new_usd_per_hr == b.old_usd_per_hr for a, b in itertools.pairwise(history))
    assert [c.new_usd_per_hr for c in store.list_budget_changes("recs", limit=2)] == [6.0, 4.0]


def test_change_budget_refusals(store: Store) -> None:
    store.create_app(spec(), who="alice")
    for bad in (0, -1, float("inf")):
        with pytest.raises(InvalidValueError, match="budget_usd_per_hr"):
            store.change_budget("recs", bad, reason="x", who="y")
    with pytest.raises(ConflictError, match="at version 1, not 7"):
        store.change_budget("recs", 5, reason="x", who="y", expected_version=7)
    with pytest.raises(NotFoundError):
        store.change_budget("nope", 5, reason="x", who="y")
    assert store.get_app("recs").version == 1


# --- plans -----------------------------------------------------------------------------------


def test_plans_are_numbered_per_app_and_previewed(store: Store) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    first = store.create_plan("recs", PLAN)
    second = store.create_plan("recs", {**PLAN, "cost_usd_per_hr": 2.0})
    other = store.create_plan("ads", PLAN)
    assert (first.number, second.number, other.number) == (1, 2, 1)
    assert first.status == "previewed" and first.applied_at is None
    assert first.document == PLAN and first.app_version == 1
    assert store.get_plan("recs", second.id) == second
    assert [p.number for p in store.list_plans("recs")] == [1, 2]
    assert [p.number for p in store.list_plans("recs", limit=1)] == [2]
    with pytest.raises(NotFoundError, match="no plan"):
        store.get_plan("ads", first.id)
    assert store.get_applied_plan("recs") is None


def test_apply_plan_supersedes_the_previous_one(store: Store, clock: StepClock) -> None:
    store.create_app(spec(), who="alice")
    first = store.create_plan("recs", PLAN)
    clock.advance(1)
    applied = store.apply_plan("recs", first.id, expected_version=1)
    assert (applied.status, applied.applied_at) == ("applied", T0 + timedelta(seconds=1))
    app = store.get_app("recs")
    assert (app.applied_plan_id, app.version) == (first.id, 2)
    second = store.create_plan("recs", PLAN)
    assert second.app_version == 2
    store.apply_plan("recs", second.id)
    assert store.get_plan("recs", first.id).status == "superseded"
    assert store.get_applied_plan("recs") == store.get_plan("recs", second.id)


def test_apply_plan_conflicts(store: Store) -> None:
    store.create_app(spec(), who="alice")
    a = store.create_plan("recs", PLAN)
    b = store.create_plan("recs", PLAN)
    store.apply_plan("recs", a.id)
    with pytest.raises(ConflictError, match="already applied"):
        store.apply_plan("recs", a.id)
    with pytest.raises(ConflictError, match=r"made for version 1 .* now at version 2"):
        store.apply_plan("recs", b.id)
    c = store.create_plan("recs", PLAN)
    store.change_budget("recs", 3, reason="cut", who="bob")
    with pytest.raises(ConflictError, match="preview a new plan"):
        store.apply_plan("recs", c.id)
    d = store.create_plan("recs", PLAN)
    with pytest.raises(ConflictError, match=r"changed meanwhile \(version 2 -> 3"):
        store.apply_plan("recs", d.id, expected_version=2)
    assert store.get_app("recs").applied_plan_id == a.id
    with pytest.raises(NotFoundError):
        store.apply_plan("recs", 999)


def test_plan_documents_must_be_json(store: Store) -> None:
    store.create_app(spec(), who="alice")
    with pytest.raises(InvalidValueError, match="document"):
        store.create_plan("recs", {"max_feasible_qps": float("nan")})
    with pytest.raises(InvalidValueError, match="document"):
        store.create_plan("recs", {"when": datetime.now(UTC)})


# --- instances -------------------------------------------------------------------------------


def launch(store: Store, request_id: str = "r1", app: str = "recs", **extra: Any) -> Any:
    return store.record_instance(
        app, request_id=request_id, instance_type="g4dn.xlarge", price_usd_per_hr=0.526, **extra
    )


def test_record_instance_is_idempotent_by_request_id(store: Store, clock: StepClock) -> None:
    store.create_app(spec(), who="alice")
    first = launch(store)
    assert (first.state, first.app, first.provider_id, first.request_id) == (
        "requested",
        "recs",
        None,
        "r1",
    )
    clock.advance(10)
    again = launch(store)
    assert again == first
    assert len(store.list_instances()) == 1
    events = store.list_instance_events(instance_id=first.id)
    assert [(e.from_state, e.to_state) for e in events] == [(None, "requested")]


def test_a_request_id_belongs_to_one_app(store: Store) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    launch(store, app="recs")
    with pytest.raises(ConflictError, match="request id 'r1' already launched"):
        launch(store, app="ads")


def test_transitions_follow_the_lifecycle_and_are_logged(store: Store, clock: StepClock) -> None:
    store.create_app(spec(), who="alice")
    instance = launch(store)
    clock.advance(1)
    pending = store.transition_instance(
        instance.id, "pending", reason="provider accepted", provider_id="i-0abc"
    )
    assert (pending.state, pending.provider_id) == ("pending", "i-0abc")
    assert pending.updated_at == T0 + timedelta(seconds=1)
    store.transition_instance(instance.id, "running", reason="healthy")
    with pytest.raises(InvalidTransitionError, match="from 'running' to 'requested'"):
        store.transition_instance(instance.id, "requested", reason="no")
    with pytest.raises(InvalidTransitionError):
        store.transition_instance(instance.id, "exploded", reason="no")
    with pytest.raises(NotFoundError, match="no instance"):
        store.transition_instance("nope", "running", reason="no")
    assert store.get_instance(instance.id).state == "running"
    assert store.find_instance(provider_id="i-0abc") == store.get_instance(instance.id)
    assert store.find_instance(provider_id="i-none") is None
    events = store.list_instance_events(app="recs")
    assert [(e.from_state, e.to_state, e.reason) for e in events] == [
        (None, "requested", "launch requested"),
        ("requested", "pending", "provider accepted"),
        ("pending", "running", "healthy"),
    ]


def test_provider_ids_are_unique(store: Store) -> None:
    store.create_app(spec(), who="alice")
    a = launch(store, "r1", provider_id="i-1")
    b = launch(store, "r2")
    with pytest.raises(ConflictError, match="provider id 'i-1'"):
        store.set_provider_id(b.id, "i-1")
    with pytest.raises(ConflictError, match="provider id 'i-1'"):
        launch(store, "r3", provider_id="i-1")
    assert store.set_provider_id(b.id, "i-2").provider_id == "i-2"
    assert a.provider_id == "i-1"


def test_list_instances_by_app_and_state(store: Store, clock: StepClock) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    a = launch(store, "r1")
    clock.advance(1)
    b = launch(store, "r2")
    clock.advance(1)
    c = launch(store, "r3", app="ads")
    store.transition_instance(b.id, "failed", reason="capacity")
    assert [i.id for i in store.list_instances()] == [a.id, b.id, c.id]
    assert [i.id for i in store.list_instances("recs")] == [a.id, b.id]
    assert [i.id for i in store.list_instances(states=["requested"])] == [a.id, c.id]
    assert [i.id for i in store.list_instances("recs", ["failed", "running"])] == [b.id]
    with pytest.raises(InvalidValueError, match="unknown state 'up'"):
        store.list_instances(states=["up"])


def test_a_spot_price_now_is_kept_beside_the_launch_price(store: Store, clock: StepClock) -> None:
    store.create_app(spec("recs"), who="alice")
    a = launch(store, "r1")
    b = launch(store, "r2")
    ended = launch(store, "r3")
    store.transition_instance(ended.id, "failed", reason="capacity")
    assert a.price_now_usd_per_hr is None and a.cost_usd_per_hr == a.price_usd_per_hr
    updated = store.get_instance(a.id).updated_at
    clock.advance(5)
    # The live rows take the price now; an ended one keeps what it cost.
    assert store.set_prices_now([a.id, b.id, ended.id], 0.75) == 2
    now = {i.id: i for i in store.list_instances("recs")}
    assert now[a.id].price_usd_per_hr == a.price_usd_per_hr  # the launch price stays
    assert now[a.id].cost_usd_per_hr == now[b.id].cost_usd_per_hr == 0.75
    assert now[ended.id].price_now_usd_per_hr is None
    assert now[a.id].updated_at == updated and now[a.id].state == a.state
    # Back at the launch price: cleared.
    assert store.set_prices_now([a.id], None) == 1
    assert store.get_instance(a.id).cost_usd_per_hr == a.price_usd_per_hr
    with pytest.raises(InvalidValueError, match="price_usd_per_hr"):
        store.set_prices_now([b.id], -1.0)
    assert store.set_prices_now([], 1.0) == 0


def test_the_reads_a_loop_makes_every_tick_leave_the_old_ended_rows(
    store: Store, clock: StepClock
) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    old = launch(store, "recs_x-1")
    store.transition_instance(old.id, "pending", reason="up", provider_id="i-old")
    store.transition_instance(old.id, "terminating", reason="down")
    store.transition_instance(old.id, "terminated", reason="gone")
    clock.advance(10)
    cutoff = clock.utcnow()
    clock.advance(1)
    live = launch(store, "recs-2")
    clock.advance(1)
    recent = launch(store, "recs-3")
    store.transition_instance(recent.id, "failed", reason="capacity")
    clock.advance(1)
    other = launch(store, "recs-9", app="ads")
    assert [i.id for i in store.list_instances("recs", ended_after=cutoff)] == [live.id, recent.id]
    assert [i.id for i in store.list_instances(ended_after=cutoff)] == [
        live.id,
        recent.id,
        other.id,
    ]
    # An ended row is found by the ids a provider still lists, however old; a live one is not.
    found = store.list_ended_instances("recs", provider_ids=["i-old"], request_ids=["recs-2"])
    assert [i.id for i in found] == [old.id]
    ended = store.list_ended_instances("recs", request_ids=["recs-3", "recs-9"])
    assert [(i.id, i.state) for i in ended] == [(recent.id, "failed")]
    # Request ids by prefix, every one: '_' and '%' are the prefix's own characters.
    assert sorted(store.list_request_ids("recs", "recs-")) == ["recs-2", "recs-3"]
    assert store.list_request_ids("recs", "recs_") == ["recs_x-1"]
    assert store.list_request_ids("recs", "%") == []
    assert store.count_instances() == {
        ("recs", "terminated"): 1,
        ("recs", "requested"): 1,
        ("recs", "failed"): 1,
        ("ads", "requested"): 1,
    }


def test_the_retention_deletes_old_ended_rows_with_their_events_but_the_kept_ones(
    store: Store, clock: StepClock
) -> None:
    store.create_app(spec("recs"), who="alice")
    # A live row is never deleted, however old its last move.
    live = launch(store, "recs_live")
    clock.advance(1)
    old = launch(store, "recs-1")
    store.transition_instance(old.id, "failed", reason="capacity")
    clock.advance(1)
    newest_old = launch(store, "recs-2")
    store.transition_instance(newest_old.id, "failed", reason="capacity")
    clock.advance(10)
    cutoff = clock.utcnow()
    clock.advance(1)
    recent = launch(store, "recs-3")
    store.transition_instance(recent.id, "failed", reason="capacity")
    assert store.delete_ended_instances(before=cutoff, keep=["recs-2"]) == 1
    assert [i.id for i in store.list_instances("recs")] == [live.id, newest_old.id, recent.id]
    assert store.list_instance_events(instance_id=old.id) == []
    assert len(store.list_instance_events(instance_id=newest_old.id)) == 2
    clock.advance(1)
    assert store.delete_ended_instances(before=clock.utcnow()) == 2
    assert [i.id for i in store.list_instances("recs")] == [live.id]
    # By request prefix (its '_' is the prefix's own character, not LIKE's any one).
    assert [i.id for i in store.list_instances("recs", request_prefix="recs_")] == [live.id]
    assert store.list_instances("recs", request_prefix="recs-") == []


def test_events_since_and_limit(store: Store, clock: StepClock) -> None:
    store.create_app(spec(), who="alice")
    instance = launch(store)
    for state in ("pending", "running", "draining"):
        clock.advance(1)
        store.transition_instance(instance.id, state, reason=state)
    events = store.list_instance_events()
    assert [e.to_state for e in events] == ["requested", "pending", "running", "draining"]
    since = store.list_instance_events(since=T0 + timedelta(seconds=1))
    assert [e.to_state for e in since] == ["running", "draining"]
    assert [e.to_state for e in store.list_instance_events(limit=2)] == ["running", "draining"]


# --- decisions and metrics -------------------------------------------------------------------


def test_decisions(store: Store, clock: StepClock) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    store.record_decision("recs", "scale_up", "r_max above envelope", {"r_max_qps": 41.5, "k": 3})
    clock.advance(1)
    store.record_decision("ads", "replan", "every 6 h")
    clock.advance(1)
    last = store.record_decision("recs", "gear_switch", "budget cap", {"gear": 2})
    assert last.at == T0 + timedelta(seconds=2)
    assert [d.kind for d in store.list_decisions()] == ["scale_up", "replan", "gear_switch"]
    assert [d.kind for d in store.list_decisions("recs")] == ["scale_up", "gear_switch"]
    assert store.list_decisions("recs")[0].numbers == {"r_max_qps": 41.5, "k": 3}
    assert [d.kind for d in store.list_decisions(since=T0)] == ["replan", "gear_switch"]
    assert [d.kind for d in store.list_decisions(limit=1)] == ["gear_switch"]
    assert [d.kind for d in store.list_decisions(kinds=["replan"])] == ["replan"]
    with pytest.raises(InvalidValueError, match="numbers"):
        store.record_decision("recs", "scale_up", "x", {"k": float("nan")})
    with pytest.raises(InvalidValueError, match="limit"):
        store.list_decisions(limit=-1)


def test_a_repeated_keyed_decision_is_one_row_with_a_count(store: Store, clock: StepClock) -> None:
    store.create_app(spec("recs"), who="alice")
    first = store.record_decision("recs", "launch_failed", "no capacity", {"n": 1}, key="r-1:ICE")
    assert (first.count, first.last_at, first.key) == (1, None, "r-1:ICE")
    for n in range(2, 6):
        clock.advance(5)
        again = store.record_decision(
            "recs", "launch_failed", f"no capacity ({n})", {"n": n}, key="r-1:ICE"
        )
    (row,) = store.list_decisions("recs")
    assert row == again
    assert (row.id, row.at, row.count) == (first.id, T0, 5)
    assert row.last_at == T0 + timedelta(seconds=20)
    assert (row.reason, row.numbers) == ("no capacity (5)", {"n": 5})
    # No key: never merged.
    store.record_decision("recs", "scale_up", "load")
    store.record_decision("recs", "scale_up", "load")
    assert [d.count for d in store.list_decisions("recs", kinds=["scale_up"])] == [1, 1]


def test_decisions_recorded_together_are_written_all_or_none(
    store: Store, clock: StepClock
) -> None:
    """One pass of a loop's decisions (the tuner's stages): a bad one writes none of them; a
    keyed one repeats the row it would repeat alone."""
    store.create_app(spec("recs"), who="alice")
    store.record_decision("recs", "budget_capped", "capped", {"n": 1}, key="tiny")
    clock.advance(1)
    with pytest.raises(InvalidValueError, match="numbers"):
        store.record_decisions(
            "recs",
            [("scale_up", "a", {"k": 1}, None), ("scale_up", "b", {"k": float("nan")}, None)],
        )
    assert [d.kind for d in store.list_decisions("recs")] == ["budget_capped"]
    made = store.record_decisions(
        "recs",
        [("scale_up", "a", {"k": 1}, None), ("budget_capped", "capped", {"n": 2}, "tiny")],
    )
    assert [(d.kind, d.count) for d in made] == [("scale_up", 1), ("budget_capped", 2)]
    assert len(store.list_decisions("recs")) == 2


def test_a_decision_made_again_after_since_is_listed_since(store: Store, clock: StepClock) -> None:
    """A failed launch repeated every 5 s since 20 s ago is one row first made at T0: asked for
    what was decided in the last 10 s (``events --since``), it was left out, the repeats in
    that span with it; retention already judged it by its last time."""
    store.create_app(spec("recs"), who="alice")
    store.record_decision("recs", "launch_failed", "no capacity", key="r-1:ICE")
    store.record_decision("recs", "scale_up", "load")
    for _ in range(4):
        clock.advance(5)
        store.record_decision("recs", "launch_failed", "no capacity", key="r-1:ICE")
    since = store.list_decisions("recs", since=T0 + timedelta(seconds=10))
    assert [(d.kind, d.count) for d in since] == [("launch_failed", 5)]
    assert store.list_decisions("recs", since=T0 + timedelta(seconds=20)) == []


def test_the_newest_decisions_count_one_made_again_by_its_last_time(
    store: Store, clock: StepClock
) -> None:
    """``events --kind budget_capped --limit 1`` showed a cap made once, long over, where a cap
    made again for 30 s more was the newest: ``limit`` ranked a repeated decision by its first
    time. It ranks by the last (as ``since`` and retention judge it); the list stays oldest
    first by first time."""
    store.create_app(spec("recs"), who="alice")
    store.record_decision("recs", "budget_capped", "capped", key="tiny:a")
    clock.advance(5)
    store.record_decision("recs", "budget_capped", "capped once", key="tiny:b")
    for _ in range(6):
        clock.advance(5)
        store.record_decision("recs", "budget_capped", "capped", key="tiny:a")
    (newest,) = store.list_decisions("recs", limit=1)
    assert (newest.reason, newest.count) == ("capped", 7)
    both = store.list_decisions("recs", limit=2)
    assert [d.reason for d in both] == ["capped", "capped once"]  # oldest first, by first time


def test_a_different_key_or_kind_or_app_is_a_new_decision(store: Store, clock: StepClock) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    store.record_decision("recs", "launch_failed", "x", key="r-1:ICE")
    store.record_decision("recs", "launch_failed", "x", key="r-2:ICE")
    store.record_decision("recs", "launch_failed", "x", key="r-1:Quota")
    store.record_decision("recs", "budget_capped", "x", key="r-1:ICE")
    store.record_decision("ads", "launch_failed", "x", key="r-1:ICE")
    assert len(store.list_decisions()) == 5
    # Alternating keys within the window each land on their own row.
    for _ in range(3):
        clock.advance(5)
        store.record_decision("recs", "launch_failed", "x", key="r-1:ICE")
        store.record_decision("recs", "launch_failed", "x", key="r-2:ICE")
    counts = {d.key: d.count for d in store.list_decisions("recs", kinds=["launch_failed"])}
    assert counts == {"r-1:ICE": 4, "r-2:ICE": 4, "r-1:Quota": 1}
    with pytest.raises(InvalidValueError, match="key"):
        store.record_decision("recs", "launch_failed", "x", key="")


def test_a_keyed_decision_past_the_window_is_new_unless_it_is_still_the_latest(
    store: Store, clock: StepClock
) -> None:
    store.create_app(spec("recs"), who="alice")
    store.record_decision("recs", "budget_capped", "x", key="s:a")
    clock.advance(store.decision_merge_window_s + 1)
    # Still the app's latest budget cap: the same decision, however long ago.
    assert store.record_decision("recs", "budget_capped", "x", key="s:a").count == 2
    store.record_decision("recs", "budget_capped", "y", key="s:b")
    clock.advance(store.decision_merge_window_s + 1)
    # Another cap came since, and the window is over: a new row.
    assert store.record_decision("recs", "budget_capped", "x", key="s:a").count == 1
    assert [d.key for d in store.list_decisions("recs")] == ["s:a", "s:b", "s:a"]


def test_decision_retention_by_age_and_by_count(store: Store, clock: StepClock) -> None:
    store.create_app(spec("recs"), who="alice")
    store.create_app(spec("ads"), who="alice")
    store.record_decision("recs", "scale_up", "old")
    store.record_decision("recs", "budget_capped", "old, but repeated lately", key="s:a")
    clock.advance(100)
    store.record_decision("recs", "budget_capped", "repeated", key="s:a")
    for i in range(5):
        store.record_decision("ads", "scale_up", f"ads {i}")
        clock.advance(1)
    removed = store.delete_decisions(before=T0 + timedelta(seconds=50))
    assert removed == 1
    assert [d.reason for d in store.list_decisions("recs")] == ["repeated"]
    assert store.delete_decisions(keep=3) == 2
    assert [d.reason for d in store.list_decisions("ads")] == ["ads 2", "ads 3", "ads 4"]
    assert [d.reason for d in store.list_decisions("recs")] == ["repeated"]
    assert store.delete_decisions(before=T0, keep=10) == 0
    with pytest.raises(InvalidValueError, match="keep"):
        store.delete_decisions(keep=-1)


def test_metric_series(store: Store, clock: StepClock) -> None:
    store.create_app(spec(), who="alice")
    for i in range(5):
        store.add_metric_sample(
            "recs",
            arrival_rate_qps=10 + i,
            fleet_cost_usd_per_hr=2.5,
            latency_p50_ms=20,
            latency_p95_ms=80,
            latency_p99_ms=120 + i,
            attainment_share=0.99,
            gear="g1" if i < 3 else None,
            accuracy=0.97,
        )
        clock.advance(10)
    series = store.metric_series("recs")
    assert [s.arrival_rate_qps for s in series] == [10, 11, 12, 13, 14]
    assert series[0].at == T0 and series[0].gear == "g1" and series[4].gear is None
    window = store.metric_series(
        "recs", since=T0 + timedelta(seconds=10), until=T0 + timedelta(seconds=30)
    )
    assert [s.latency_p99_ms for s in window] == [122, 123]
    assert len(store.metric_series("recs", limit=2)) == 2
    assert store.delete_metric_samples(before=T0 + timedelta(seconds=20)) == 2
    assert len(store.metric_series("recs")) == 3


def test_metric_sample_without_latencies(store: Store) -> None:
    store.create_app(spec(), who="alice")
    sample = store.add_metric_sample("recs", arrival_rate_qps=0, fleet_cost_usd_per_hr=0)
    assert sample.latency_p99_ms is None and sample.attainment_share is None


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"arrival_rate_qps": float("nan")}, "arrival_rate_qps"),
        ({"arrival_rate_qps": -1}, "arrival_rate_qps"),
        ({"attainment_share": 1.5}, "attainment_share"),
        ({"latency_p99_ms": float("inf")}, "latency_p99_ms"),
    ],
)
def test_bad_metric_samples(store: Store, values: dict[str, Any], field: str) -> None:
    store.create_app(spec(), who="alice")
    arguments: dict[str, Any] = {"arrival_rate_qps": 1.0, "fleet_cost_usd_per_hr": 1.0, **values}
    with pytest.raises(InvalidValueError) as caught:
        store.add_metric_sample("recs", **arguments)
    assert caught.value.field == field


# --- tokens ----------------------------------------------------------------------------------


def test_tokens(store: Store, clock: StepClock, db_path: Path) -> None:
    token = store.create_token("operator", "ci")
    assert token.startswith("hp_")
    assert store.verify_token(token) == Principal("ci", "operator")
    name, scope = store.verify_token(token)  # type: ignore[misc]
    assert (name, scope) == ("ci", "operator")
    assert store.get_token("ci").last_used_at == T0
    assert store.verify_token(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert store.verify_token("") is None
    assert store.verify_token("not-a-token") is None
    # Only the hash is kept.
    with sqlite3.connect(db_path) as connection:
        dump = "\n".join(connection.iterdump())
    assert token not in dump
    clock.advance(5)
    revoked = store.revoke_token("ci")
    assert revoked.revoked_at == T0 + timedelta(seconds=5)
    assert store.verify_token(token) is None
    assert store.revoke_token("ci").revoked_at == revoked.revoked_at


def test_token_last_used_is_refreshed_at_most_once_a_minute(store: Store, clock: StepClock) -> None:
    token = store.create_token("viewer", "dash")
    store.verify_token(token)
    clock.advance(30)
    store.verify_token(token)
    assert store.get_token("dash").last_used_at == T0
    clock.advance(31)
    store.verify_token(token)
    assert store.get_token("dash").last_used_at == T0 + timedelta(seconds=61)


def test_the_token_cache_says_when_to_verify_again_and_never_outlives_its_second(
    store: Store, clock: StepClock, db_path: Path
) -> None:
    token = store.create_token("infer", "client")
    principal = Principal("client", "infer")
    assert store.cached_token(token) == (None, True)  # nothing cached: a check is due
    assert store.cached_token("not-a-token") == (None, False)  # never worth a read
    assert store.verify_token(token) == principal
    assert store.cached_token(token) == (principal, False)
    clock.advance(TOKEN_CACHE_S * 0.6)  # past half its life: still good, a check is due
    assert store.cached_token(token) == (principal, True)
    assert store.verify_token(token, fresh=True) == principal  # read again: a new second
    clock.advance(TOKEN_CACHE_S * 0.6)
    assert store.cached_token(token) == (principal, True)
    clock.advance(TOKEN_CACHE_S * 0.6)  # past its second unverified: not trusted
    assert store.cached_token(token) == (None, True)
    # Revoked elsewhere (another replica's store: the database only): a fresh check sees it
    # and drops the cached answer at once, not a second later.
    assert store.verify_token(token) == principal
    with sqlite3.connect(db_path) as connection:
        connection.execute("UPDATE api_tokens SET revoked_at = created_at WHERE name = 'client'")
    assert store.cached_principal(token) == principal  # cached, as the contract allows
    assert store.verify_token(token, fresh=True) is None
    assert store.cached_token(token) == (None, True)
    assert store.verify_token(token) is None


def test_a_read_that_a_revocation_overtook_is_not_cached(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that read the row before a revocation committed (here: the revocation's own
    step after its commit, run while the read is under way) returns what it read but leaves
    nothing cached, so the next check reads the database again."""
    from controlplane.policies import auth

    token = store.create_token("infer", "client")
    matches = auth.hashes_match

    def revoked_meanwhile(presented: str, stored: str) -> bool:
        store._token_cache.revoked()  # what revoke_token does once its commit is done
        return matches(presented, stored)

    monkeypatch.setattr(auth, "hashes_match", revoked_meanwhile)
    assert store.verify_token(token, fresh=True) == Principal("client", "infer")
    assert store.cached_token(token) == (None, True)


def test_a_token_verified_before_the_database_went_down_stands_through_the_outage(
    store: Store, clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the database does not answer, a token verified within TOKEN_OUTAGE_S stands (the
    serving path answers on the fleet it has: a tester saw every query a 503 once its token's
    second had passed); a token never verified, or verified longer ago, is a database error; a
    revocation through this store forgets them."""
    import contextlib

    from sqlalchemy.exc import OperationalError

    from controlplane.db.store import tokens
    from controlplane.db.store.token_cache import TOKEN_OUTAGE_S
    from controlplane.errors import DatabaseError

    known = store.create_token("infer", "client")
    never = store.create_token("infer", "other")
    principal = Principal("client", "infer")
    assert store.verify_token(known) == principal

    @contextlib.contextmanager
    def down(_sessions: Any) -> Iterator[Any]:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        yield  # pragma: no cover

    monkeypatch.setattr(tokens, "transaction", down)
    clock.advance(TOKEN_CACHE_S * 2)  # its second is over: the database is asked, and is down
    assert store.verify_token(known, fresh=True) == principal
    assert store.cached_token(known) == (principal, False)  # cached again for a second
    with pytest.raises(DatabaseError):
        store.verify_token(never)
    clock.advance(TOKEN_OUTAGE_S + 2 * TOKEN_CACHE_S)  # too long since it was verified
    with pytest.raises(DatabaseError):
        store.verify_token(known)
    monkeypatch.undo()
    assert store.verify_token(known) == principal  # back: read from the database again
    store._token_cache.revoked()  # what revoke_token does after its commit
    monkeypatch.setattr(tokens, "transaction", down)
    with pytest.raises(DatabaseError):
        store.verify_token(known)


def test_token_refusals(store: Store) -> None:
    store.create_token("admin", "root")
    with pytest.raises(ConflictError, match="a token named 'root' already exists"):
        store.create_token("viewer", "root")
    with pytest.raises(UnknownScopeError, match="unknown scope 'god'"):
        store.create_token("god")
    with pytest.raises(NotFoundError, match="no token 'nobody'"):
        store.revoke_token("nobody")


def test_default_token_names_and_listing(store: Store) -> None:
    store.create_token("infer")
    store.create_token("infer")
    tokens = store.list_tokens()
    assert len(tokens) == 2 and len({t.name for t in tokens}) == 2
    assert all(t.name.startswith("infer-") and t.scope == "infer" for t in tokens)


def test_a_name_with_a_control_character_is_refused(store: Store) -> None:
    for name in ("two\nlines", "tab\there", "bell\x07"):
        with pytest.raises(InvalidValueError, match="control characters"):
            store.create_token("infer", name)
    assert store.list_tokens() == []
    with pytest.raises(InvalidValueError, match="control characters"):
        store.create_app(spec(), who="alice\nmallory")


def test_a_name_too_long_is_quoted_cut_in_the_error(store: Store) -> None:
    with pytest.raises(InvalidValueError) as refused:
        store.create_token("infer", "n" * 5000)
    assert "1 to 100 characters" in str(refused.value)
    assert len(str(refused.value)) < 200 and str(refused.value).endswith("...")


# --- times and the schema --------------------------------------------------------------------


def test_times_come_back_as_aware_utc(store: Store) -> None:
    store.create_app(spec(), who="alice")
    local = datetime(2024, 6, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    decision = store.record_decision("recs", "scale_up", "x", at=local)
    (stored,) = store.list_decisions()
    assert stored.at == decision.at == local
    assert stored.at.tzinfo is UTC and stored.at.hour == 12
    with pytest.raises(InvalidValueError, match="timezone-aware"):
        store.record_decision("recs", "scale_up", "x", at=datetime(2024, 1, 1))


def test_a_store_on_an_unmigrated_database_says_what_to_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    with pytest.raises(DatabaseError, match=r"not migrated.*run: heteroplane db upgrade"):
        Store.from_url(url)
    store = Store.from_url(url, upgrade=True)
    assert store.list_apps() == []
    store.close()


def test_database_errors_are_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate.upgrade(url)
    store = Store.from_url(url)
    migrate.downgrade(url, "base")
    with pytest.raises(DatabaseError, match=r"has no heteroplane tables.*heteroplane db upgrade"):
        store.list_apps()
    store.close()


def test_an_in_memory_store(clock: StepClock) -> None:
    store = Store.from_url("sqlite://", clock, upgrade=True)
    store.create_app(spec(), who="alice")
    assert [a.name for a in store.list_apps()] == ["recs"]
    store.close()
