"""The reconciler's pure half: what :func:`controlplane.loops.reconciler.reconcile` decides from the
database's rows, the provider's list, the prices and the budget."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.db.store import InstanceRecord
from controlplane.loops.reconciler import (
    Action,
    Adopt,
    BudgetCapped,
    Launch,
    LaunchSkipped,
    Mark,
    Orphan,
    Report,
    Terminate,
    reconcile,
)
from controlplane.policies.lifecycle import InstanceState
from provisioners.base import APP_TAG, MANAGED_TAG, REQUEST_TAG, ProvisionedInstance

NOW = datetime(2024, 1, 1, 12, tzinfo=UTC)
PRICES = {"small": 0.05, "large": 0.1, "gpu": 0.5}
# Q_t: large serves 4x small for 2x the price, so it is the more cost-effective; gpu the most.
QPS = {"small": 10.0, "large": 40.0, "gpu": 400.0}
PREFIX = "app-0000"
_ids = itertools.count(1)


def row(
    instance_type: str,
    state: str = "running",
    *,
    provider_id: str | None = "auto",
    request_id: str | None = None,
    age_s: float = 60.0,
    updated_age_s: float | None = None,
    price: float | None = None,
) -> InstanceRecord:
    n = next(_ids)
    created = NOW - timedelta(seconds=age_s)
    return InstanceRecord(
        id=f"i-{n}",
        app="app",
        request_id=request_id or f"{PREFIX}-{n}",
        provider_id=(f"p-{n}" if state != "requested" else None)
        if provider_id == "auto"
        else provider_id,
        instance_type=instance_type,
        state=state,
        price_usd_per_hr=PRICES[instance_type] if price is None else price,
        created_at=created,
        updated_at=created if updated_age_s is None else NOW - timedelta(seconds=updated_age_s),
    )


def profile_row(instance_type: str, state: str = "running", **kwargs: object) -> InstanceRecord:
    n = next(_ids)
    return row(instance_type, state, request_id=f"profile:app-run{n}-{instance_type}", **kwargs)  # type: ignore[arg-type]


def seen(
    record: InstanceRecord | None = None,
    state: str = "running",
    *,
    provider_id: str | None = None,
    instance_type: str | None = None,
    request_id: str | None = None,
    managed: bool = True,
) -> ProvisionedInstance:
    tags = {APP_TAG: "app"}
    if managed:
        tags[MANAGED_TAG] = "true"
    rid = request_id or (record.request_id if record is not None else None)
    if rid is not None:
        tags[REQUEST_TAG] = rid
    pid = provider_id or (record.provider_id if record is not None else None)
    assert pid is not None
    itype = instance_type or (record.instance_type if record is not None else "small")
    return ProvisionedInstance(pid, itype, state, tags)  # type: ignore[arg-type]


def run(
    desired: Mapping[str, int] | None,
    rows: Sequence[InstanceRecord],
    observed: Sequence[ProvisionedInstance] | None = None,
    budget: float = 10.0,
    **kwargs: object,
) -> list[Action]:
    if observed is None:  # by default the provider agrees with every launched row
        observed = [
            seen(r, "running" if r.state != "pending" else "pending")
            for r in rows
            if r.provider_id is not None and r.state not in ("terminated", "failed")
        ]
    return reconcile(
        desired,
        rows,
        observed,
        PRICES,
        budget,
        NOW,
        600.0,
        request_prefix=PREFIX,
        qps_by_type=QPS,
        **kwargs,  # type: ignore[arg-type]
    )


def of(actions: Sequence[Action], kind: type[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, kind)]


def launches(actions: Sequence[Action]) -> list[Launch]:
    return [a for a in actions if isinstance(a, Launch)]


def terminations(actions: Sequence[Action]) -> list[Terminate]:
    return [a for a in actions if isinstance(a, Terminate)]


def marks(actions: Sequence[Action]) -> list[Mark]:
    return [a for a in actions if isinstance(a, Mark)]


# --- fleet size ------------------------------------------------------------------------------


def test_launches_the_shortfall_most_cost_effective_first_with_fresh_request_ids() -> None:
    actions = run({"small": 2, "large": 1}, [row("small", request_id=f"{PREFIX}-7")])
    assert [(a.instance_type, a.request_id, a.retry) for a in launches(actions)] == [
        ("large", f"{PREFIX}-8", False),
        ("small", f"{PREFIX}-9", False),
    ]
    assert not terminations(actions)


def test_a_fleet_as_desired_needs_nothing() -> None:
    rows = [row("small"), row("large"), row("large")]
    assert run({"small": 1, "large": 2}, rows) == []


def test_terminates_the_excess_newest_first_and_fails_unlaunched_rows() -> None:
    old = row("small", age_s=500)
    new = row("small", age_s=100)
    waiting = row("small", "requested", age_s=10)
    actions = run({"small": 1}, [old, new, waiting])
    # The row that never launched goes first (marked failed: there is nothing to stop) ...
    # ... then the newest running one, which drains first (no new queries; rule 9 terminates
    # it once drained); the oldest stays.
    assert [(m.instance_id, m.to_state) for m in marks(actions)] == [
        (new.id, InstanceState.DRAINING),
        (waiting.id, InstanceState.FAILED),
    ]
    assert marks(actions)[0].reason.startswith("scale_down: small: 3 kept, 1 desired")
    assert not terminations(actions) and not launches(actions)
    # Drained for drain_s, it is terminated (cause scale_down: the store's event says why it
    # drains); nothing is launched for it.
    draining = row("small", "draining", age_s=11)
    later = run({"small": 1}, [old, draining], drain_causes={draining.id: "scale_down"})
    (stop,) = terminations(later)
    assert stop.instance_ids == (draining.id,) and stop.cause == "scale_down"
    assert stop.reason == "drained for 10 s after its scale-down"
    assert not launches(later)
    assert not terminations(run({"small": 1}, [old, row("small", "draining", age_s=5)]))


def test_a_scale_downs_draining_worker_is_taken_back_when_the_count_rises_again() -> None:
    old = row("small", age_s=500)
    drained_first = row("small", "draining", age_s=300, updated_age_s=8)
    drained_last = row("small", "draining", age_s=200, updated_age_s=4)
    causes = {drained_first.id: "scale_down", drained_last.id: "scale_down"}
    # One more wanted: the latest drained serves again at once, nothing is launched.
    actions = run({"small": 2}, [old, drained_first, drained_last], drain_causes=causes)
    assert [(m.instance_id, m.to_state) for m in marks(actions)] == [
        (drained_last.id, InstanceState.RUNNING)
    ]
    assert marks(actions)[0].reason.startswith("taken back while it drained")
    assert not launches(actions) and not terminations(actions)
    # Both, and one launched past them.
    actions = run({"small": 4}, [old, drained_first, drained_last], drain_causes=causes)
    assert {m.instance_id for m in marks(actions)} == {drained_first.id, drained_last.id}
    assert len(launches(actions)) == 1
    # A row draining for another cause (an interruption, a spot move) is not taken back, nor is
    # one whose machine has a notice since.
    other = row("small", "draining", age_s=200, updated_age_s=4)
    actions = run({"small": 2}, [old, other])
    assert not marks(actions) and len(launches(actions)) == 1
    noticed = {drained_last.provider_id: NOW + timedelta(seconds=100)}
    actions = run({"small": 2}, [old, drained_last], drain_causes=causes, notices=noticed)
    assert not any(m.to_state is InstanceState.RUNNING for m in marks(actions))


def test_no_desired_fleet_launches_and_scales_nothing() -> None:
    rows = [row("small"), row("small")]
    assert run(None, rows) == []
    assert run({}, rows) != []  # an empty fleet, by contrast, is a fleet of nothing


# --- the budget ------------------------------------------------------------------------------


def test_never_launches_past_the_budget_and_says_what_was_capped() -> None:
    actions = run({"gpu": 1, "small": 3}, [row("small")], budget=0.62)
    # 0.05 kept; the gpu (most cost-effective) fits (0.55), then one small (0.60), not two.
    assert [a.instance_type for a in launches(actions)] == ["gpu", "small"]
    (capped,) = of(actions, BudgetCapped)
    assert isinstance(capped, BudgetCapped)
    assert dict(capped.wanted) == {"small": 1}
    assert abs(capped.committed_usd_per_hr - 0.60) < 1e-9


def test_a_lowered_budget_drains_the_least_cost_effective_first() -> None:
    smalls = [row("small") for _ in range(2)]
    larges = [row("large") for _ in range(2)]
    gpu = row("gpu")
    # Fleet 0.1 + 0.2 + 0.5 = 0.8; budget 0.62: the smalls (1 qps per cent) go first, then
    # one large.
    actions = run({"small": 2, "large": 2, "gpu": 1}, [*smalls, *larges, gpu], budget=0.62)
    (drain,) = terminations(actions)
    assert drain.cause == "budget"
    assert set(drain.instance_ids[:2]) == {r.id for r in smalls}
    assert drain.instance_ids[2] in {r.id for r in larges} and len(drain.instance_ids) == 3
    assert not launches(actions)
    (capped,) = of(actions, BudgetCapped)
    assert isinstance(capped, BudgetCapped)
    assert dict(capped.wanted) == {"large": 1, "small": 2}


def test_a_type_without_a_price_is_skipped_not_launched() -> None:
    actions = run({"mystery": 2}, [])
    assert not launches(actions)
    assert of(actions, LaunchSkipped) == [LaunchSkipped("mystery", 2, "no price known for mystery")]


def test_held_types_are_not_launched() -> None:
    actions = run({"small": 1, "large": 1}, [], held_types={"large"})
    assert [a.instance_type for a in launches(actions)] == ["small"]


# --- liveness and stragglers -----------------------------------------------------------------


def test_a_dead_instance_is_failed_and_replaced() -> None:
    alive, dead = row("small"), row("small")
    actions = run({"small": 2}, [alive, dead], [seen(alive), seen(dead, "terminated")])
    assert [(m.instance_id, m.to_state) for m in marks(actions)] == [
        (dead.id, InstanceState.FAILED)
    ]
    assert [a.instance_type for a in launches(actions)] == ["small"]


def test_a_missing_instance_is_failed_only_after_the_grace() -> None:
    fresh = row("small", updated_age_s=5)
    lost = row("small", updated_age_s=120)
    actions = run({"small": 2}, [fresh, lost], [], missing_grace_s=30.0)
    assert [(m.instance_id, m.to_state) for m in marks(actions)] == [
        (lost.id, InstanceState.FAILED)
    ]
    assert len(launches(actions)) == 1


def test_stragglers_are_terminated_and_replaced() -> None:
    slow = row("large", "pending", age_s=700)
    never = row("large", "requested", age_s=700)
    fine = row("large", "pending", age_s=30)
    actions = run(
        {"large": 3},
        [slow, never, fine],
        [seen(slow, "pending"), seen(fine, "pending")],
    )
    assert (never.id, InstanceState.FAILED) in [(m.instance_id, m.to_state) for m in marks(actions)]
    (stop,) = terminations(actions)
    assert stop.cause == "straggler" and stop.instance_ids == (slow.id,)
    assert [a.instance_type for a in launches(actions)] == ["large", "large"]


def test_pending_becomes_running_only_when_healthy() -> None:
    booting = row("small", "pending")
    healthy = run({"small": 1}, [booting], [seen(booting, "running")])
    assert marks(healthy) == [Mark(booting.id, InstanceState.RUNNING, "running and healthy")]
    sick = run({"small": 1}, [booting], [seen(booting, "running")], unhealthy={booting.provider_id})
    assert sick == []


def test_a_running_worker_that_stopped_answering_is_terminated_and_replaced() -> None:
    hung = row("small", "running")
    fine = row("small", "running")
    why = {hung.provider_id: "its worker has not answered /health for 61 s"}
    actions = run({"small": 2}, [hung, fine], unresponsive=why)
    (stop,) = terminations(actions)
    assert stop.cause == "unresponsive" and stop.instance_ids == (hung.id,)
    assert stop.provider_ids == (hung.provider_id,) and "61 s" in stop.reason
    # Its row is no longer kept, so the fleet is made whole in the same tick.
    assert [a.instance_type for a in launches(actions)] == ["small"]
    # A worker that is not running yet (rule 4's) or already leaving is not this rule's.
    booting = row("small", "pending")
    leaving = row("small", "terminating")
    why = {r.provider_id: "silent" for r in (booting, leaving)}
    observed = [seen(booting, "running"), seen(leaving, "running")]
    actions = run({"small": 1}, [booting, leaving], observed, unresponsive=why)
    assert [t.cause for t in terminations(actions)] == ["ended"]


def test_a_shrinking_fleet_ends_the_worker_gone_silent_first() -> None:
    silent = row("small", "running", age_s=600)
    newer = row("small", "running", age_s=60)
    actions = run({"small": 1}, [silent, newer])
    # The newest, as a rule: it drains first.
    assert [(m.instance_id, m.to_state) for m in marks(actions)] == [
        (newer.id, InstanceState.DRAINING)
    ]
    # A silent worker serves nothing to drain: terminated at once.
    actions = run({"small": 1}, [silent, newer], silent={silent.provider_id})
    assert terminations(actions)[0].instance_ids == (silent.id,) and not marks(actions)


def test_a_requested_row_is_launched_again_with_its_own_request_id() -> None:
    waiting = row("small", "requested", age_s=20)
    actions = run({"small": 1}, [waiting], [])
    assert launches(actions) == [
        Launch(
            waiting.request_id,
            "small",
            0.05,
            "launch again (the last attempt did not go through)",
            retry=True,
        )
    ]


def test_terminating_rows_end_when_the_provider_says_so_or_are_asked_again() -> None:
    done = row("small", "terminating")
    stubborn = row("small", "terminating")
    gone = row("small", "terminating")
    actions = run({}, [done, stubborn, gone], [seen(done, "terminated"), seen(stubborn)])
    assert {(m.instance_id, m.to_state) for m in marks(actions)} == {
        (done.id, InstanceState.TERMINATED),
        (gone.id, InstanceState.TERMINATED),
    }
    (again,) = terminations(actions)
    assert again.instance_ids == () and again.provider_ids == (stubborn.provider_id,)


def test_an_instance_stopped_by_someone_else_is_failed_terminated_and_replaced() -> None:
    stopped = row("small")
    actions = run({"small": 1}, [stopped], [seen(stopped, "stopping")])
    assert marks(actions)[0].to_state is InstanceState.FAILED
    assert terminations(actions)[0].provider_ids == (stopped.provider_id,)
    assert len(launches(actions)) == 1


# --- adoption and orphans --------------------------------------------------------------------


def test_an_instance_of_a_waiting_request_is_adopted() -> None:
    waiting = row("small", "requested", age_s=20)
    found = seen(waiting, "running", provider_id="p-found")
    actions = run({"small": 1}, [waiting], [found])
    assert of(actions, Adopt) == [
        Adopt(
            waiting.id,
            waiting.request_id,
            "p-found",
            f"the provider runs p-found for request {waiting.request_id}",
        )
    ]
    assert marks(actions) == [Mark(waiting.id, InstanceState.RUNNING, "running and healthy")]
    assert not launches(actions) and not terminations(actions)


def test_tagged_instances_the_database_did_not_ask_for_are_orphans() -> None:
    launched = row("small")
    given_up = row("small", "failed", provider_id=None)
    unknown = seen(provider_id="p-x", request_id="someone-else-1")
    duplicate = seen(launched, provider_id="p-dup")
    late = seen(given_up, provider_id="p-late")
    actions = run({"small": 1}, [launched, given_up], [seen(launched), unknown, duplicate, late])
    orphans = [a for a in actions if isinstance(a, Orphan)]
    assert [o.instance.provider_id for o in orphans] == ["p-x", "p-dup", "p-late"]
    assert all(o.price_usd_per_hr == 0.05 for o in orphans)
    assert "unknown to the database" in orphans[0].reason
    assert not launches(actions)


def test_instances_without_the_managed_tag_are_reported_never_touched() -> None:
    stranger = seen(provider_id="p-stranger", managed=False)
    actions = run({}, [], [stranger])
    assert actions == [
        Report("p-stranger", "small", "listed without the managed tag: not ours, left alone")
    ]


def test_an_ended_row_whose_machine_runs_on_is_terminated_again() -> None:
    failed = row("small", "failed")
    actions = run({}, [failed], [seen(failed)])
    (again,) = terminations(actions)
    assert again.cause == "ended" and again.provider_ids == (failed.provider_id,)


# --- the invariant ---------------------------------------------------------------------------

_KEPT = {"requested", "pending", "running"}


def _apply(
    rows: Sequence[InstanceRecord], actions: Sequence[Action]
) -> dict[str, tuple[str, float]]:
    """The rows' (state, price) after the actions, the launches added as requested rows."""
    after = {r.id: (r.state, r.price_usd_per_hr) for r in rows}
    for action in actions:
        if isinstance(action, Mark):
            after[action.instance_id] = (action.to_state.value, after[action.instance_id][1])
        elif isinstance(action, Adopt):
            after[action.instance_id] = ("pending", after[action.instance_id][1])
        elif isinstance(action, Terminate):
            for instance_id in action.instance_ids:
                after[instance_id] = ("terminating", after[instance_id][1])
        elif isinstance(action, Launch) and not action.retry:
            after[action.request_id] = ("requested", action.price_usd_per_hr)
    return after


_rows = st.lists(
    st.tuples(
        st.sampled_from(sorted(PRICES)),
        st.sampled_from(["requested", "pending", "running", "terminating", "failed"]),
        st.floats(0, 1000),
        st.sampled_from(["agree", "terminated", "missing", "running"]),
        st.booleans(),  # a profile run's worker (rule 8)
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    rows_spec=_rows,
    desired=st.dictionaries(st.sampled_from(sorted(PRICES)), st.integers(0, 5)),
    budget=st.floats(0.0, 3.0),
)
def test_the_kept_fleet_never_exceeds_the_budget_and_every_row_moves_legally(
    rows_spec: list[tuple[str, str, float, str, bool]], desired: dict[str, int], budget: float
) -> None:
    from controlplane.policies.lifecycle import can_transition, is_profile_worker

    rows: list[InstanceRecord] = []
    observed: list[ProvisionedInstance] = []
    for instance_type, state, age_s, provider, profiling in rows_spec:
        r = (profile_row if profiling else row)(instance_type, state, age_s=age_s)
        rows.append(r)
        if r.provider_id is not None and provider != "missing":
            where = {"agree": "pending" if state == "pending" else "running"}.get(
                provider, provider
            )
            observed.append(seen(r, where))
    actions = run(desired, rows, observed, budget=budget)
    state = {r.id: r.state for r in rows}
    for action in actions:
        if isinstance(action, Mark):
            assert can_transition(state[action.instance_id], action.to_state.value)
            state[action.instance_id] = action.to_state.value
        elif isinstance(action, Terminate):
            for instance_id in action.instance_ids:
                assert can_transition(state[instance_id], "terminating")
                state[instance_id] = "terminating"
    after = _apply(rows, actions)
    # Profile workers included: they cost money like the fleet.
    kept_cost = sum(price for s, price in after.values() if s in _KEPT)
    assert kept_cost <= budget + 1e-6
    # And no more than desired of any type is kept (profile workers are not the fleet).
    profiling = {r.id for r in rows if is_profile_worker(r.request_id)}
    for instance_type in PRICES:
        kept = sum(
            1
            for key, (s, _) in after.items()
            if s in _KEPT
            and key not in profiling
            and (
                next((r.instance_type for r in rows if r.id == key), None)
                or next(a.instance_type for a in launches(actions) if a.request_id == key)
            )
            == instance_type
        )
        assert kept <= desired.get(instance_type, 0)


def test_a_failed_instance_is_cleaned_up_at_the_provider() -> None:
    broken = row("small")
    actions = run({"small": 1}, [broken], [seen(broken, "failed")])
    assert marks(actions)[0].to_state is InstanceState.FAILED
    (cleanup,) = terminations(actions)
    assert cleanup.cause == "ended" and cleanup.provider_ids == (broken.provider_id,)
    assert len(launches(actions)) == 1


def test_without_the_providers_list_only_the_budget_guard_acts() -> None:
    rows = [row("small"), row("large"), row("small", "requested", age_s=5000)]
    actions = reconcile({"small": 5}, rows, None, PRICES, 0.1, NOW, 600.0, qps_by_type=QPS)
    # Nothing launched, no straggler failed, no excess: only the drain to fit 0.1 USD/hr.
    assert not launches(actions)
    assert [(m.instance_id, m.to_state) for m in marks(actions)] == [
        (rows[2].id, InstanceState.FAILED)
    ]
    (drain,) = terminations(actions)
    assert drain.cause == "budget" and drain.instance_ids == (rows[0].id,)


# --- rule 8: profile workers ---------------------------------------------------------------------


def test_profile_workers_are_not_the_fleet_but_their_cost_is_reserved() -> None:
    worker = profile_row("gpu", updated_age_s=1.0)
    # Desired: one gpu. The profile run's gpu is not it: a gpu for the fleet would not fit next
    # to it (0.5 + 0.5 > 0.8), and the profile worker is neither ended nor launched again.
    actions = run({"gpu": 1}, [worker], budget=0.8)
    assert not any(isinstance(a, Launch | Terminate) for a in actions)
    (capped,) = [a for a in actions if isinstance(a, BudgetCapped)]
    assert capped.wanted == {"gpu": 1} and capped.committed_usd_per_hr == 0.5
    # Desired: nothing. The profile worker is not excess.
    assert not any(isinstance(a, Terminate) for a in run({}, [worker], budget=0.8))


def test_a_profile_worker_whose_run_stopped_beating_is_ended() -> None:
    beating = profile_row("small", updated_age_s=10.0)
    gone = profile_row("large", updated_age_s=41.0)
    unlaunched = profile_row("small", "requested", updated_age_s=41.0)
    actions = run({}, [beating, gone, unlaunched], profile_run_timeout_s=40.0)
    (ended,) = [a for a in actions if isinstance(a, Terminate)]
    assert ended.cause == "profile_run_gone" and ended.instance_ids == (gone.id,)
    marks = [a for a in actions if isinstance(a, Mark)]
    assert [(m.instance_id, m.to_state) for m in marks] == [(unlaunched.id, InstanceState.FAILED)]
    # A requested profile row is the run's to launch, never the reconciler's.
    fresh = profile_row("small", "requested", updated_age_s=1.0)
    assert not any(isinstance(a, Launch) for a in run({}, [fresh]))


def test_over_the_budget_the_profile_workers_go_first() -> None:
    fleet = row("large")
    worker = profile_row("gpu", updated_age_s=1.0)
    actions = run({"large": 1}, [fleet, worker], budget=0.3)
    (ended,) = [a for a in actions if isinstance(a, Terminate)]
    assert ended.cause == "budget" and ended.instance_ids == (worker.id,)


def test_app_down_ends_the_profile_workers_too() -> None:
    worker = profile_row("small", updated_age_s=1.0)
    actions = run({"small": 1}, [row("small"), worker], teardown=True)
    (ended,) = [a for a in actions if isinstance(a, Terminate)]
    assert ended.cause == "teardown" and worker.id in ended.instance_ids


def test_without_the_providers_list_the_profile_workers_still_go_first() -> None:
    fleet = row("large")
    worker = profile_row("gpu", updated_age_s=1.0)
    actions = reconcile({"large": 1}, [fleet, worker], None, PRICES, 0.3, NOW, 600.0)
    (ended,) = terminations(actions)
    assert ended.cause == "budget" and ended.instance_ids == (worker.id,)


def test_a_row_another_writer_ended_meanwhile_is_no_error_of_the_tick() -> None:
    """A profile run ended its workers' rows (pending -> terminating) while the tick moved them
    to running: the tick reported "1 error(s)" with a warning (a tester's race sweep). A row
    ended meanwhile leaves nothing to move; any other refused move is still an error."""
    from controlplane.errors import InvalidTransitionError
    from controlplane.loops.reconciler import _Errors

    def refused(from_state: str) -> Callable[[], InstanceRecord]:
        def call() -> InstanceRecord:
            raise InvalidTransitionError(from_state, "running")

        return call

    errors = _Errors()
    for ended in ("terminating", "terminated", "failed"):
        assert errors.guard(refused(ended)) is None
    assert errors == []
    assert errors.guard(refused("draining")) is None
    assert errors == ["an instance cannot go from 'draining' to 'running'"]

    def launched(from_state: str) -> Callable[[], InstanceRecord]:
        def call() -> InstanceRecord:
            raise InvalidTransitionError(from_state, "pending")

        return call

    assert errors.guard(launched("failed")) is None  # a launched machine's row: still said
    assert errors[-1] == "an instance cannot go from 'failed' to 'pending'"
