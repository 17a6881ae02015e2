"""The metric roll-up job on a real store: one sample per app with its fleet's cost; retention."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from controlplane.clock import FAKE_EPOCH, FakeClock
from controlplane.db.store import Store
from controlplane.loops.reconciler import request_prefix
from controlplane.loops.rollup import INSTANCE_RETENTION_EVERY_S, make_rollup, roll_up
from controlplane.loops.scheduler import GuardedJob
from controlplane.serving.observations import summarise


def spec(name: str) -> dict[str, object]:
    return {
        "name": name,
        "models": [{"name": "m", "profiles": "profiles.csv"}],
        "slo": {"latency_ms": 40.0},
        "budget_usd_per_hr": 4.0,
        "instance_types": ["g4dn.xlarge"],
    }


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[Store]:
    store = Store.from_url(f"sqlite:///{tmp_path / 'heteroplane.db'}", clock, upgrade=True)
    yield store
    store.close()


def test_one_sample_per_app_with_the_live_fleet_cost(store: Store, clock: FakeClock) -> None:
    store.create_app(spec("a"), who="t")
    store.create_app(spec("b"), who="t")
    store.record_instance("a", request_id="1", instance_type="g4dn.xlarge", price_usd_per_hr=0.5)
    gone = store.record_instance(
        "a", request_id="2", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
    )
    store.transition_instance(gone.id, "failed", reason="capacity")
    assert roll_up(store, clock) == 2
    (a,) = store.metric_series("a")
    (b,) = store.metric_series("b")
    assert a.fleet_cost_usd_per_hr == 0.5
    assert b.fleet_cost_usd_per_hr == 0.0
    assert a.arrival_rate_qps == 0.0 and a.latency_p99_ms is None
    assert a.at == clock.utcnow()


def test_samples_past_the_retention_are_removed(store: Store, clock: FakeClock) -> None:
    store.create_app(spec("a"), who="t")
    job = GuardedJob("rollup", make_rollup(store, clock, retention_s=25.0))
    for _ in range(5):
        assert job() == "ran"
        clock.advance(10.0)
    # Runs at 0, 10, 20, 30 and 40 s; the last keeps what is not older than 40 - 25 = 15 s.
    kept_s = [(s.at - FAKE_EPOCH).total_seconds() for s in store.metric_series("a")]
    assert kept_s == [20.0, 30.0, 40.0]


def test_decisions_past_the_retention_are_removed(store: Store, clock: FakeClock) -> None:
    store.create_app(spec("a"), who="t")
    store.create_app(spec("b"), who="t")
    store.record_decision("a", "scale_up", "old")
    clock.advance(86_400.0)
    for i in range(4):
        store.record_decision("a", "scale_up", f"a {i}")
        store.record_decision("b", "scale_up", f"b {i}")
        clock.advance(1.0)
    job = GuardedJob(
        "rollup",
        make_rollup(store, clock, decision_retention_days=0.5, decision_retention_count=3),
    )
    assert job() == "ran"
    assert [d.reason for d in store.list_decisions("a")] == ["a 1", "a 2", "a 3"]
    assert [d.reason for d in store.list_decisions("b")] == ["b 1", "b 2", "b 3"]


def test_by_default_decisions_are_kept_30_days(store: Store, clock: FakeClock) -> None:
    store.create_app(spec("a"), who="t")
    store.record_decision("a", "scale_up", "a month ago")
    clock.advance(29 * 86_400.0)
    store.record_decision("a", "scale_up", "now")
    roll_up(store, clock)
    assert len(store.list_decisions("a")) == 2
    clock.advance(2 * 86_400.0)
    roll_up(store, clock)
    assert [d.reason for d in store.list_decisions("a")] == ["now"]


def test_ended_instances_past_the_retention_go_but_the_newest_launch_of_each_app(
    store: Store, clock: FakeClock
) -> None:
    """An instance history that grows by a launch a minute stays bounded; the next launch is
    still numbered past every id the provider has seen."""
    app = store.create_app(spec("a"), who="t")
    prefix = request_prefix(app)
    for n in (9, 10, 11):
        row = store.record_instance(
            "a", request_id=f"{prefix}-{n}", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
        )
        store.transition_instance(row.id, "failed", reason="capacity")
        clock.advance(1.0)
    store.record_instance(
        "a", request_id=f"profile:{prefix}-x", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
    )
    clock.advance(2 * 86_400.0)
    job = make_rollup(store, clock, instance_retention_days=1.0)
    job()
    kept = {i.request_id for i in store.list_instances("a")}
    assert kept == {f"{prefix}-11", f"profile:{prefix}-x"}
    # The retention runs once an hour: a row recorded since as ended two days ago waits for
    # the next run.
    ago = clock.utcnow() - timedelta(days=2)
    row = store.record_instance(
        "a", request_id=f"{prefix}-12", instance_type="g4dn.xlarge", price_usd_per_hr=0.5, at=ago
    )
    store.transition_instance(row.id, "failed", reason="capacity", at=ago)
    clock.advance(60.0)
    job()
    assert len(store.list_instances("a")) == 3
    clock.advance(INSTANCE_RETENTION_EVERY_S)
    job()
    assert {i.request_id for i in store.list_instances("a")} == {
        f"{prefix}-12",
        f"profile:{prefix}-x",
    }


def test_a_long_history_is_forgotten_in_batches_run_after_run(
    store: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database upgraded with a long history is not locked by one long delete: each run
    deletes a batch, oldest first, and the next run goes on while more are left."""
    from controlplane.loops import rollup

    monkeypatch.setattr(rollup, "INSTANCE_RETENTION_BATCH", 2)
    store.create_app(spec("a"), who="t")
    for n in range(5):
        row = store.record_instance(
            "a", request_id=f"other-{n}", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
        )
        store.transition_instance(row.id, "failed", reason="capacity")
        clock.advance(1.0)
    clock.advance(2 * 86_400.0)
    job = make_rollup(store, clock, instance_retention_days=1.0)
    left = []
    for _ in range(5):
        job()
        left.append([i.request_id for i in store.list_instances("a")])
        clock.advance(10.0)
    assert left == [
        ["other-2", "other-3", "other-4"],
        ["other-4"],
        [],
        [],
        [],
    ]


def test_by_default_ended_instances_are_kept_30_days(store: Store, clock: FakeClock) -> None:
    store.create_app(spec("a"), who="t")
    for n in (1, 2):
        row = store.record_instance(
            "a", request_id=f"other-{n}", instance_type="g4dn.xlarge", price_usd_per_hr=0.5
        )
        store.transition_instance(row.id, "failed", reason="capacity")
    clock.advance(29 * 86_400.0)
    make_rollup(store, clock)()
    assert len(store.list_instances("a")) == 2
    clock.advance(2 * 86_400.0)
    make_rollup(store, clock)()
    assert store.list_instances("a") == []


def test_a_roll_up_with_no_apps_writes_nothing(store: Store, clock: FakeClock) -> None:
    assert roll_up(store, clock) == 0


def test_a_window_whose_queries_all_failed_is_recorded_as_all_misses(
    store: Store, clock: FakeClock
) -> None:
    store.create_app(spec("a"), who="t")
    failing = summarise([], 40.0, arrivals=30, elapsed_s=10.0, refused=25, timed_out=3, failed=2)
    mixed = summarise([10.0, 50.0], 40.0, arrivals=4, elapsed_s=10.0, refused=2)
    windows = iter([failing, mixed])
    roll_up(store, clock, window=lambda app: next(windows))
    clock.advance(10.0)
    roll_up(store, clock, window=lambda app: next(windows))
    first, second = store.metric_series("a")
    # Every query failed: attainment 0 (not unknown), no percentile, the demand still there.
    assert (first.attainment_share, first.latency_p99_ms) == (0.0, None)
    assert first.arrival_rate_qps == 3.0
    # One of four within: the refused ones are misses; the percentiles are the answered ones'.
    assert second.attainment_share == 0.25
    assert second.latency_p50_ms == 30.0
