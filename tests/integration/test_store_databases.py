"""The store on both databases (a SQLite file and a throwaway PostgreSQL server), through the
migrations: concurrent writers (threads), idempotent launches, cascades and times.

Threads line up on a barrier and then race; the assertions hold whatever order the database lets
them through in (no sleeps, no timing).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest

from controlplane.db import migrate
from controlplane.db.store import Store
from controlplane.errors import ConflictError
from controlplane.policies.lifecycle import check_transition

_T = TypeVar("_T")
THREADS = 8


def spec(name: str = "recs", budget: float = 10.0) -> dict[str, Any]:
    return {
        "name": name,
        "models": [{"name": "rm2", "profiles": "profiles.csv"}],
        "slo": {"latency_ms": 350},
        "budget_usd_per_hr": budget,
        "instance_types": ["g4dn.xlarge"],
    }


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    migrate.upgrade(database_url)
    store = Store.from_url(database_url)
    yield store
    store.close()


def race(calls: list[Callable[[], _T]]) -> tuple[list[_T], list[BaseException]]:
    """Run the calls at once, one thread each; their results and their errors."""
    barrier = threading.Barrier(len(calls))
    results: list[_T] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(call: Callable[[], _T]) -> None:
        barrier.wait()
        try:
            result = call()
        except BaseException as error:
            with lock:
                errors.append(error)
        else:
            with lock:
                results.append(result)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_of_concurrent_applies_exactly_one_wins(store: Store) -> None:
    store.create_app(spec(), who="alice")
    plans = [store.create_plan("recs", {"n": i}) for i in range(THREADS)]
    version = store.get_app("recs").version

    def apply(plan_id: int) -> Callable[[], Any]:
        return lambda: store.apply_plan("recs", plan_id, expected_version=version)

    results, errors = race([apply(plan.id) for plan in plans])
    assert len(results) == 1
    assert len(errors) == THREADS - 1
    assert all(isinstance(error, ConflictError) for error in errors), errors
    app = store.get_app("recs")
    assert app.applied_plan_id == results[0].id
    assert app.version == version + 1
    statuses = [p.status for p in store.list_plans("recs")]
    assert statuses.count("applied") == 1 and statuses.count("previewed") == THREADS - 1


def test_of_concurrent_applies_of_one_plan_exactly_one_wins(store: Store) -> None:
    store.create_app(spec(), who="alice")
    plan = store.create_plan("recs", {"n": 1})
    results, errors = race([lambda: store.apply_plan("recs", plan.id)] * 2)
    assert len(results) == 1 and len(errors) == 1
    assert isinstance(errors[0], ConflictError)


def test_concurrent_budget_changes_serialise(store: Store) -> None:
    store.create_app(spec(budget=1.0), who="alice")
    per_thread = 3

    def changes(thread: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(per_thread):
                store.change_budget(
                    "recs", 100.0 + thread * 10 + i, reason=f"t{thread}", who=f"w{thread}"
                )

        return run

    _, errors = race([changes(t) for t in range(THREADS)])
    assert errors == []
    total = THREADS * per_thread
    app = store.get_app("recs")
    assert app.version == 1 + total
    audit = sorted(store.list_budget_changes("recs"), key=lambda change: change.id)
    assert len(audit) == 1 + total
    # No lost update: each change starts from the budget the one before it set.
    for before, after in itertools.pairwise(audit):
        assert after.old_usd_per_hr == before.new_usd_per_hr
    assert audit[-1].new_usd_per_hr == app.budget_usd_per_hr == app.spec["budget_usd_per_hr"]


def test_concurrent_launches_with_one_request_id_record_one_instance(store: Store) -> None:
    store.create_app(spec(), who="alice")

    def launch() -> Any:
        return store.record_instance(
            "recs", request_id="req-1", instance_type="g4dn.xlarge", price_usd_per_hr=0.526
        )

    results, errors = race([launch] * THREADS)
    assert errors == []
    assert len({instance.id for instance in results}) == 1
    assert len(store.list_instances("recs")) == 1
    assert len(store.list_instance_events(app="recs")) == 1


def test_concurrent_transitions_of_one_instance(store: Store) -> None:
    store.create_app(spec(), who="alice")
    instance = store.record_instance(
        "recs", request_id="r", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
    )
    results, errors = race(
        [lambda: store.transition_instance(instance.id, "pending", reason="go")] * 4
    )
    # One moves it; the others find it pending already, where pending -> pending is refused.
    assert len(results) == 1 and len(errors) == 3
    assert all(isinstance(error, ConflictError) for error in errors)
    assert [e.to_state for e in store.list_instance_events(instance_id=instance.id)] == [
        "requested",
        "pending",
    ]


def test_a_row_moved_meanwhile_is_moved_with_the_others_and_their_decision(
    store: Store, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transition_instances (a terminate's rows and its decision in one transaction): a row
    another writer moves between its read and its write (``app down`` drains it) is read again
    and moved from where it is, as transition_instance retries it, not left where the other put
    it with its machine terminated. Only PostgreSQL lets the other writer in (SQLite's writers
    take the database's lock at their start)."""
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite serialises the writers: no write comes between a read and a write")
    store.create_app(spec(), who="alice")
    row = store.record_instance(
        "recs", request_id="r", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
    )
    for state in ("pending", "running"):
        store.transition_instance(row.id, state, reason="up")
    drains: list[str] = []
    errors: list[BaseException] = []

    def drained_meanwhile(from_state: str, to_state: str) -> None:
        check_transition(from_state, to_state)
        if to_state == "terminating" and not drains:
            # Another connection commits its move between this read and its write.
            drains.append(from_state)
            thread = threading.Thread(
                target=_noted,
                args=(lambda: store.transition_instance(row.id, "draining", reason="x"), errors),
            )
            thread.start()
            thread.join(timeout=30)

    monkeypatch.setattr("controlplane.db.store.instances.check_transition", drained_meanwhile)
    moved, failed = store.transition_instances(
        "recs", [row.id], "terminating", reason="scale down", said=[("terminate", "go", {})]
    )
    assert drains == ["running"] and errors == []
    assert failed == []
    assert [r.state for r in moved] == ["terminating"]
    assert [r.state for r in store.list_instances("recs")] == ["terminating"]
    moves = {(e.from_state, e.to_state) for e in store.list_instance_events(instance_id=row.id)}
    assert {("running", "draining"), ("draining", "terminating")} <= moves
    assert [d.kind for d in store.list_decisions("recs")] == ["terminate"]


def _noted(call: Callable[[], object], errors: list[BaseException]) -> None:
    try:
        call()
    except BaseException as error:
        errors.append(error)


def test_concurrent_registrations_of_one_name(store: Store) -> None:
    results, errors = race([lambda: store.create_app(spec(), who="alice")] * 4)
    assert len(results) == 1 and len(errors) == 3
    assert all(isinstance(error, ConflictError) for error in errors)


def test_concurrent_plans_get_distinct_numbers(store: Store) -> None:
    store.create_app(spec(), who="alice")
    results, errors = race([lambda: store.create_plan("recs", {})] * THREADS)
    assert errors == []
    assert sorted(plan.number for plan in results) == list(range(1, THREADS + 1))


def test_times_round_trip_as_aware_utc(store: Store) -> None:
    store.create_app(spec(), who="alice")
    at = datetime(2024, 3, 10, 23, 30, 0, 123456, tzinfo=timezone(timedelta(hours=-5)))
    store.record_decision("recs", "scale_up", "x", {"k": 1}, at=at)
    (decision,) = store.list_decisions("recs", since=at - timedelta(microseconds=1))
    assert decision.at == at
    assert decision.at.tzinfo is UTC
    assert decision.at == datetime(2024, 3, 11, 4, 30, 0, 123456, tzinfo=UTC)


def test_delete_cascades(store: Store) -> None:
    store.create_app(spec(), who="alice")
    plan = store.create_plan("recs", {})
    store.apply_plan("recs", plan.id)
    store.record_instance("recs", request_id="r", instance_type="t3.xlarge", price_usd_per_hr=1)
    store.add_metric_sample("recs", arrival_rate_qps=1, fleet_cost_usd_per_hr=1)
    store.delete_app("recs", force=True)
    assert store.list_apps() == [] and store.list_instances() == []
    store.create_app(spec(), who="alice")
    assert store.list_plans("recs") == []
    assert store.list_budget_changes("recs")[0].old_usd_per_hr is None


def test_tokens(store: Store) -> None:
    token = store.create_token("admin", "root")
    principal = store.verify_token(token)
    assert principal is not None and tuple(principal) == ("root", "admin")
    store.revoke_token("root")
    assert store.verify_token(token) is None


def test_the_per_tick_instance_reads(store: Store) -> None:
    """The reads the loops make every tick, on both databases: the live rows and the recent
    past, ended rows by the ids a provider lists, request ids by a prefix (``_`` and ``%`` are
    its own characters, not patterns) and the counts by state."""
    store.create_app(spec(), who="alice")
    old = store.record_instance(
        "recs", request_id="recs_a-1", instance_type="g4dn.xlarge", price_usd_per_hr=1
    )
    store.transition_instance(old.id, "failed", reason="capacity")
    live = store.record_instance(
        "recs", request_id="recs-2", instance_type="g4dn.xlarge", price_usd_per_hr=1
    )
    later = live.created_at + timedelta(seconds=1)
    assert [i.id for i in store.list_instances("recs", ended_after=later)] == [live.id]
    assert [i.id for i in store.list_ended_instances("recs", request_ids=["recs_a-1"])] == [old.id]
    assert store.list_request_ids("recs", "recs-") == ["recs-2"]
    assert store.list_request_ids("recs", "recs_") == ["recs_a-1"]
    assert store.count_instances() == {("recs", "failed"): 1, ("recs", "requested"): 1}
    # A rollout's rows by prefix, and the retention of ended rows with their events.
    assert [i.id for i in store.list_instances("recs", request_prefix="recs_")] == [old.id]
    assert store.delete_ended_instances(before=later, keep=["recs-2"]) == 1
    assert [i.id for i in store.list_instances("recs")] == [live.id]
    assert store.list_instance_events(instance_id=old.id) == []
    # A spot row's price now beside its launch price (the reconciler's rule 10 writes it).
    assert store.set_prices_now([live.id, old.id], 0.5) == 1
    (now,) = store.list_instances("recs")
    assert (now.price_usd_per_hr, now.cost_usd_per_hr) == (1.0, 0.5)
