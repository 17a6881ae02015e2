"""Re-planning on recorded traffic (``controlplane/loops/traffic_replan.py``) over the service as
``build_service`` wires it: the real store through its migrations, the reconciler on the fake
provisioner, the planner on measured-shape profiles (``tests/component/test_api.py``), a fake
clock, and the arrivals the serving loop would have recorded fed by hand (seeded Poisson traffic).

The app is planned on 50 qps (one r5n.large); each test drives the replan job once a simulated
minute, as the scheduler does. Traffic that doubles for longer than the hold is re-planned on
(two r5n.large, within the budget) and the reconciler launches the difference; a burst shorter
than the hold, or traffic inside the band, changes nothing; traffic the budget cannot serve is one
``replan_infeasible`` decision; traffic that falls to a quarter is re-planned to a smaller fleet
that the reconciler drains at the disruption budget's pace.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from controlplane.apps.plans import PlanRequest, TraceRequest, launchable_only, preview_plan
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import FakeClock
from controlplane.db.store import PlanRecord
from controlplane.loops.traffic_replan import TrafficReplanner, compare_envelopes
from controlplane.service.build import Service, build_service, stored_apps
from controlplane.settings import Settings
from provisioners.fake import FakeProvisioner
from tests.component.test_api import spec, write_profiles
from tests.dying_writes import decision_write_fails

APP = "toy"
CHECK_S = 60.0
HOLD_S = 300.0
LIVE = ("requested", "pending", "running")
R5N = "r5n.large"
BUDGET_FOR_TWO = 0.35  # USD/hr: two r5n.large, never three


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Service, FakeClock, AppResolver]]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    clock = FakeClock()
    service = build_service(Settings(data_dir=data_dir, provisioner="fake"), clock)
    yield service, clock, AppResolver(data_dir)
    service.close()


class Traffic:
    """What the serving loop would have recorded by the clock's now: seeded Poisson arrivals at
    a rate per segment of time."""

    def __init__(self, clock: FakeClock, *segments: tuple[float, float, float]) -> None:
        rng = np.random.default_rng(7)
        parts = []
        for start_s, end_s, rate_qps in segments:
            count = rng.poisson(rate_qps * (end_s - start_s))
            parts.append(np.sort(rng.uniform(start_s, end_s, count)))
        self.clock = clock
        self.arrival_s = np.concatenate(parts)

    def __call__(self, app: str) -> np.ndarray:
        assert app == APP
        return self.arrival_s[: np.searchsorted(self.arrival_s, self.clock.now_s(), side="right")]


def _apply(service: Service, resolver: AppResolver, budget: float, rate_qps: float) -> PlanRecord:
    """Register the app, plan it on Poisson traffic at ``rate_qps`` as an API preview does, and
    apply the plan; the applied plan's record."""
    store = service.store
    store.create_app(spec_document(resolver.check(spec(budget=budget)).spec), who="test")
    request = PlanRequest(trace=TraceRequest(rate_qps=rate_qps), seed=3)
    record = preview_plan(store, resolver, APP, request)
    assert record.plan.feasible
    store.apply_plan(APP, record.id)
    applied = store.get_applied_plan(APP)
    assert applied is not None
    return applied


def _replanner(
    service: Service, clock: FakeClock, resolver: AppResolver, traffic: Traffic
) -> TrafficReplanner:
    return TrafficReplanner(
        service.store,
        clock,
        traffic,
        lambda app: resolver.resolve(app.spec, check_budget=False),
        check_s=CHECK_S,
        hold_s=HOLD_S,
    )


def _run(replanner: TrafficReplanner, clock: FakeClock, until_s: float) -> list[float]:
    """The replan job once a minute until ``until_s``; when it re-planned."""
    replanned = []
    while clock.now_s() + CHECK_S <= until_s:
        clock.advance(CHECK_S)
        if replanner.tick():
            replanned.append(clock.now_s())
    return replanned


def _kinds(service: Service) -> list[str]:
    return [d.kind for d in service.store.list_decisions(APP)]


def _applied_fleet(service: Service) -> dict[str, int]:
    applied = service.store.get_applied_plan(APP)
    assert applied is not None
    return applied.plan.fleet


def _kept_cost(service: Service) -> float:
    return sum(i.price_usd_per_hr for i in service.store.list_instances(APP, LIVE))


def _reconcile(service: Service, ticks: int) -> None:
    provisioner = service.provisioner
    assert isinstance(provisioner, FakeProvisioner)
    for _ in range(ticks):
        service.reconciler.run_once()
        provisioner.step()
        assert _kept_cost(service) <= service.store.get_app(APP).budget_usd_per_hr + 1e-9


def test_twice_the_planned_traffic_for_longer_than_the_hold_is_re_planned_within_the_budget(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    old = _apply(service, resolver, budget=4.0, rate_qps=50.0)
    assert old.plan.fleet == {R5N: 1}
    _reconcile(service, 3)
    traffic = Traffic(clock, (0.0, 600.0, 50.0), (600.0, 2400.0, 100.0))
    replanner = _replanner(service, clock, resolver, traffic)

    assert _run(replanner, clock, 600.0) == []  # the planned rate: inside the band
    assert replanner.episode(APP) is None
    # The first check of the doubled traffic starts the hold; nothing happens before its end.
    assert _run(replanner, clock, 600.0 + HOLD_S) == []
    episode = replanner.episode(APP)
    assert episode is not None and episode[0] == "above" and episode[1] == HOLD_S - CHECK_S
    assert _run(replanner, clock, 600.0 + HOLD_S + CHECK_S) == [600.0 + HOLD_S + CHECK_S]

    applied = service.store.get_applied_plan(APP)
    assert applied is not None and applied.id != old.id
    fleet = applied.plan.fleet
    assert sum(fleet.values()) > 1 and applied.plan.planned_rate_qps > 80.0
    assert applied.plan.feasible and applied.plan.cost_usd_per_hr <= 4.0
    assert "recorded traffic" in applied.plan.steps[0]
    assert applied.plan.trace is not None and "recorded arrivals" in applied.plan.trace["source"]

    (decision,) = [d for d in service.store.list_decisions(APP) if d.kind == "replan"]
    numbers = decision.numbers
    assert numbers["direction"] == "above" and numbers["held_s"] == HOLD_S
    assert 1.6 < numbers["sustained_ratio"] < 2.4 and numbers["peak_ratio"] > 1.3
    assert numbers["old_rate_qps"] == pytest.approx(old.plan.planned_rate_qps)
    assert 90.0 < numbers["new_rate_qps"] < 110.0
    assert 90.0 < numbers["recorded_rate_qps"] < 110.0
    assert numbers["old_fleet"] == {R5N: 1} and numbers["fleet"] == fleet
    assert numbers["old_cost_usd_per_hr"] == pytest.approx(old.plan.cost_usd_per_hr)
    assert numbers["cost_usd_per_hr"] == pytest.approx(applied.plan.cost_usd_per_hr)
    assert numbers["plan_id"] == applied.id and numbers["budget_usd_per_hr"] == 4.0
    # The episode's recorded traffic, the newest 20,000 queries of it (the planner's sample).
    assert numbers["trace_queries"] == 20_000 and numbers["trace_span_s"] < HOLD_S + CHECK_S
    # Applied through the API's use case.
    applies = [d for d in service.store.list_decisions(APP) if d.kind == "plan_applied"]
    assert applies and "traffic replanner" in applies[-1].reason

    # The reconciler launches the new mix within the budget.
    _reconcile(service, 3)
    kept = Counter(i.instance_type for i in service.store.list_instances(APP, LIVE))
    assert kept == Counter(fleet)
    # The traffic now matches the new plan: nothing more.
    assert _run(replanner, clock, 2400.0) == []
    assert _kinds(service).count("replan") == 1


def test_a_re_plan_whose_decision_was_not_written_is_not_applied_either(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    """The write of the re-plan's decision fails (the loops process dies there): the plan is
    not applied either, and the loop started again re-plans once the traffic held again, and
    says it once. The decision used to be written after the apply, in a transaction of its
    own: the plan was applied and the re-plan never said (its ``plan_applied`` decision alone,
    no why), the loop started again finding the traffic inside the new plan's band."""
    service, clock, resolver = world
    old = _apply(service, resolver, budget=4.0, rate_qps=50.0)
    traffic = Traffic(clock, (0.0, 600.0, 50.0), (600.0, 2400.0, 100.0))
    replanner = _replanner(service, clock, resolver, traffic)
    assert _run(replanner, clock, 600.0 + HOLD_S) == []
    clock.advance(CHECK_S)
    with decision_write_fails(f"replaces plan {old.id}") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            replanner.tick()
        assert failing == []
    assert service.store.get_app(APP).applied_plan_id == old.id
    assert _kinds(service) == []
    again = _replanner(service, clock, resolver, traffic)
    assert len(_run(again, clock, 2400.0)) == 1
    applied = service.store.get_applied_plan(APP)
    assert applied is not None and applied.id != old.id
    assert sorted(_kinds(service)) == ["plan_applied", "replan"]


def test_a_re_plan_names_only_the_types_the_provisioner_launches(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    """The loops resolve apps as the service wires them (``stored_apps`` with the provisioner's
    ``launch_refusal``): a provider that does not launch r5n.large (the cheapest mix at twice
    the rate is two of them) gets a re-plan of the types it launches, which the reconciler
    launches, not one it would refuse (``plan_not_launched``) and leave the app unscaled."""
    service, clock, resolver = world
    old = _apply(service, resolver, budget=4.0, rate_qps=50.0)
    assert old.plan.fleet == {R5N: 1}
    traffic = Traffic(clock, (0.0, 600.0, 50.0), (600.0, 2400.0, 100.0))

    def refusal(instance_type: str) -> str | None:
        return f"this provider does not launch {R5N}" if instance_type == R5N else None

    replanner = TrafficReplanner(
        service.store,
        clock,
        traffic,
        stored_apps(resolver, refusal),
        check_s=CHECK_S,
        hold_s=HOLD_S,
    )
    assert _run(replanner, clock, 600.0 + HOLD_S + CHECK_S) == [600.0 + HOLD_S + CHECK_S]
    new = _applied_fleet(service)
    assert new.get(R5N, 0) == 0 and sum(new.values()) >= 1, new
    assert all(refusal(t) is None for t, n in new.items() if n > 0)
    applied = service.store.get_applied_plan(APP)
    assert applied is not None and applied.plan.feasible
    assert applied.plan.cost_usd_per_hr <= 4.0


def test_launchable_only_caps_the_refused_types_and_keeps_the_specs_own_caps(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, _, resolver = world
    app = resolver.resolve({**spec(), "max_counts": {"t3.xlarge": 2}})
    capped = launchable_only(app, lambda t: "not here" if t == "g4dn.xlarge" else None)
    assert capped.spec.max_counts == {"t3.xlarge": 2, "g4dn.xlarge": 0}
    assert capped.instance_types == app.instance_types  # priced and profiled as before
    assert app.spec.max_counts == {"t3.xlarge": 2}  # the app's own spec untouched
    # A plan previewed for a loop (a rollout's for its new version) names launchable types only.
    _apply(service, resolver, budget=4.0, rate_qps=50.0)
    request = PlanRequest(trace=TraceRequest(rate_qps=100.0), seed=3)
    by_hand = preview_plan(service.store, resolver, APP, request).plan.fleet
    refused = {t for t, n in by_hand.items() if n > 0}
    looped = preview_plan(
        service.store,
        resolver,
        APP,
        request,
        launch_refusal=lambda t: "not here" if t in refused else None,
    ).plan
    assert looped.feasible and not refused & {t for t, n in looped.fleet.items() if n > 0}
    # Every type launchable, or none (the reconciler says so): the app as it is.
    assert launchable_only(app, lambda t: None) is app
    assert launchable_only(app, lambda t: "not here") is app


def test_a_burst_shorter_than_the_hold_changes_nothing(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    _apply(service, resolver, budget=4.0, rate_qps=50.0)
    plan_id = service.store.get_app(APP).applied_plan_id
    # Three minutes at twice the rate, then the planned rate again for twenty.
    traffic = Traffic(clock, (0.0, 600.0, 50.0), (600.0, 780.0, 100.0), (780.0, 2400.0, 50.0))
    replanner = _replanner(service, clock, resolver, traffic)

    assert _run(replanner, clock, 780.0) == []
    episode = replanner.episode(APP)
    assert episode is not None and episode[0] == "above"  # the tuner's to ride out
    assert _run(replanner, clock, 2400.0) == []
    assert replanner.episode(APP) is None
    assert service.store.get_app(APP).applied_plan_id == plan_id
    assert not {"replan", "replan_infeasible"} & set(_kinds(service))


@pytest.mark.parametrize("rate_qps", [35.0, 57.5])
def test_traffic_inside_the_band_changes_nothing(
    world: tuple[Service, FakeClock, AppResolver], rate_qps: float
) -> None:
    service, clock, resolver = world
    _apply(service, resolver, budget=4.0, rate_qps=50.0)
    plan_id = service.store.get_app(APP).applied_plan_id
    traffic = Traffic(clock, (0.0, 3000.0, rate_qps))
    replanner = _replanner(service, clock, resolver, traffic)

    assert _run(replanner, clock, 3000.0) == []
    assert replanner.episode(APP) is None
    assert service.store.get_app(APP).applied_plan_id == plan_id
    assert not {"replan", "replan_infeasible"} & set(_kinds(service))


def test_traffic_the_budget_cannot_serve_is_one_replan_infeasible_decision(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    # Two r5n.large ($0.298/hr) fit, three do not; three times the planned traffic needs more.
    _apply(service, resolver, budget=BUDGET_FOR_TWO, rate_qps=100.0)
    plan_id = service.store.get_app(APP).applied_plan_id
    traffic = Traffic(clock, (0.0, 600.0, 100.0), (600.0, 3600.0, 300.0))
    replanner = _replanner(service, clock, resolver, traffic)

    assert _run(replanner, clock, 3600.0) == []  # an attempt every hold, none applied
    assert service.store.get_app(APP).applied_plan_id == plan_id
    (decision,) = [d for d in service.store.list_decisions(APP) if d.kind == "replan_infeasible"]
    assert decision.count > 1  # every attempt is one more count on the one row
    assert decision.numbers["direction"] == "above"
    assert decision.numbers["budget_usd_per_hr"] == BUDGET_FOR_TWO
    assert 0.0 < decision.numbers["max_feasible_qps"] < 250.0
    assert "budget" in decision.reason and "stays" in decision.reason
    assert "replan" not in _kinds(service)
    _reconcile(service, 3)
    assert _kept_cost(service) <= BUDGET_FOR_TWO


def test_traffic_that_falls_is_re_planned_smaller_and_drained_at_the_disruption_budgets_pace(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    _apply(service, resolver, budget=4.0, rate_qps=400.0)
    assert _applied_fleet(service) == {R5N: 4}
    _reconcile(service, 3)
    traffic = Traffic(clock, (0.0, 1200.0, 100.0))
    replanner = _replanner(service, clock, resolver, traffic)

    assert _run(replanner, clock, 360.0) == [360.0]  # a quarter of the plan from the start
    (decision,) = [d for d in service.store.list_decisions(APP) if d.kind == "replan"]
    assert decision.numbers["direction"] == "below"
    assert decision.numbers["sustained_ratio"] < 0.6 and decision.numbers["peak_ratio"] < 0.6
    fleet = _applied_fleet(service)
    assert sum(fleet.values()) < 4
    assert decision.numbers["cost_usd_per_hr"] < decision.numbers["old_cost_usd_per_hr"]

    # The reconciler (every 5 s) drains the old instances no faster than the disruption budget
    # allows (one per 60 s on four), and never below the new fleet.
    provisioner = service.provisioner
    assert isinstance(provisioner, FakeProvisioner)
    running: list[int] = []
    for _ in range(60):
        service.reconciler.run_once()
        provisioner.step()
        running.append(len(service.store.list_instances(APP, ("running",))))
        assert _kept_cost(service) <= 4.0
        clock.advance(5.0)
    assert min(running) >= sum(fleet.values())
    assert running[-1] == sum(fleet.values())
    # One serving instance leaves per 60 s (12 ticks) at most.
    assert all(running[i] - running[i + 12] <= 1 for i in range(len(running) - 12))
    assert "drain_deferred" in _kinds(service)


def test_the_service_wires_the_replan_job_and_the_setting_turns_it_off(tmp_path: Path) -> None:
    for enabled, body in ((True, "fenced_replan"), (False, "fenced_idle_replan")):
        data_dir = tmp_path / str(enabled)
        settings = Settings(data_dir=data_dir, provisioner="fake", replan_enabled=enabled)
        service = build_service(settings, FakeClock())
        try:
            assert service.scheduler.jobs["replan"].body.__name__ == body
            assert service.scheduler.jobs["replan"]() == "ran"
        finally:
            service.close()


def test_a_check_compares_the_recent_envelope_with_the_planned_one() -> None:
    # 256 qps for two minutes, then 64: the last minute's envelope sees only the 64.
    arrivals = np.concatenate((np.arange(0.0, 120.0, 1 / 256), np.arange(120.0, 180.0, 1 / 64)))
    comparison = compare_envelopes(arrivals, 180.0, 60.0, (1.0, 32.0), (128.0, 128.0))
    assert comparison.live_peak_qps == 64.0 and comparison.live_sustained_qps == 64.0
    assert comparison.peak_ratio == 0.5 and comparison.queries == 60 * 64


def test_a_plan_with_the_same_fleet_is_applied_so_its_envelope_follows_the_traffic(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    old = _apply(service, resolver, budget=4.0, rate_qps=20.0)
    assert old.plan.fleet == {R5N: 1}
    # Twice the planned traffic, which one r5n.large still serves (the planner's own answer).
    traffic = Traffic(clock, (0.0, 600.0, 20.0), (600.0, 2400.0, 40.0))
    replanner = _replanner(service, clock, resolver, traffic)

    assert _run(replanner, clock, 2400.0) == [600.0 + HOLD_S + CHECK_S]
    applied = service.store.get_applied_plan(APP)
    assert applied is not None and applied.id != old.id
    assert applied.plan.fleet == {R5N: 1} and applied.plan.planned_rate_qps > 35.0
    (decision,) = [d for d in service.store.list_decisions(APP) if d.kind == "replan"]
    assert decision.numbers["same_fleet"] is True and "the same fleet" in decision.reason
    assert decision.numbers["old_rate_qps"] == pytest.approx(old.plan.planned_rate_qps)
    assert decision.numbers["new_rate_qps"] == pytest.approx(applied.plan.planned_rate_qps)
    # The traffic is inside the new plan's band: no attempt after it.
    assert replanner.episode(APP) is None
    assert "replan_same_fleet" not in _kinds(service)


def test_a_same_fleet_plan_does_not_undo_what_the_tuner_grew_and_waits_for_the_traffic_to_move(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    old = _apply(service, resolver, budget=4.0, rate_qps=20.0)
    stage = old.plan.stages[0].name
    # The tuner has grown the plan's one r5n.large to two (what it writes into its decision).
    service.store.record_decision(
        APP,
        "scale_up",
        "the live envelope exceeds the planned one",
        {"plan_id": old.id, "fleets_after": {stage: {R5N: 2}}, "cost_usd_per_hr_after": 0.3},
    )
    traffic = Traffic(clock, (0.0, 600.0, 20.0), (600.0, 1800.0, 40.0), (1800.0, 3000.0, 100.0))
    replanner = _replanner(service, clock, resolver, traffic)

    # The attempt after the hold finds the same fleet: recorded, not applied (applying would
    # restart the tuner from one r5n.large), and no attempt while the traffic stays there.
    assert _run(replanner, clock, 1800.0) == []
    assert service.store.get_app(APP).applied_plan_id == old.id
    (decision,) = [d for d in service.store.list_decisions(APP) if d.kind == "replan_same_fleet"]
    assert decision.count == 1 and decision.numbers["same_fleet"] is True
    assert decision.numbers["fleet"] == {R5N: 1} and decision.numbers["new_rate_qps"] > 35.0
    assert decision.numbers["direction"] == "above" and "2 x r5n.large" in decision.reason
    episode = replanner.episode(APP)
    assert episode is not None and episode[0] == "above"

    # The traffic moves again (100 qps): out of the band of the plan found for 40 qps, the count
    # starts again, and the plan for it (two r5n.large) is applied after the hold.
    assert _run(replanner, clock, 3000.0) == [1800.0 + CHECK_S + HOLD_S]
    applied = service.store.get_applied_plan(APP)
    assert applied is not None and applied.plan.fleet == {R5N: 2}
    assert applied.plan.planned_rate_qps > 80.0  # planned on the traffic since it moved
    assert [
        d.count for d in service.store.list_decisions(APP) if d.kind == "replan_same_fleet"
    ] == [1]
