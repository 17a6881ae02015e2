"""Capacity fallback (``controlplane/loops/capacity_replan.py``) over the service as
``build_service`` wires it: the real store through its migrations, the reconciler on the fake
provisioner (whose ``fail_capacity`` answers launches of a type with ``InsufficientCapacityError``,
as the EC2 provisioner does once every subnet missed), the planner on measured-shape profiles, a
fake clock.

An app planned on three types loses the capacity of the planned type that carries the most
instances: the reconciler keeps retrying it and reports the miss; once the miss is older than
``after_s`` the replanner plans again with that type capped at what runs of it (nothing), applies
the plan and records why; the reconciler then drops the requests it could not fill and launches
the new mix, within the budget. Where no plan without the type serves the planned rate, the
applied plan stays and one decision says so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.apps.plans import (
    PlanRequest,
    TraceRequest,
    planning_trace,
    preview_plan,
    provider_prices,
)
from controlplane.apps.resolver import AppResolver, spec_document
from controlplane.clock import FakeClock
from controlplane.loops.capacity_replan import CapacityReplanner
from controlplane.policies.planner import plan_app
from controlplane.policies.spot import plan_with_spot
from controlplane.provisioning import provider_spot_prices
from controlplane.service.build import Service, build_service
from controlplane.settings import Settings
from provisioners.fake import FakeProvisioner
from tests.component.test_api import spec, write_profiles
from tests.dying_writes import decision_write_fails

AFTER_S = 60.0
LIVE = ("requested", "pending", "running")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Service, FakeClock, AppResolver]]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_profiles(data_dir)
    clock = FakeClock()
    service = build_service(Settings(data_dir=data_dir, provisioner="fake"), clock)
    yield service, clock, AppResolver(data_dir)
    service.close()


# The planning trace of the tests' plans: bursty, so that a re-plan on a Poisson trace would differ.
REQUEST = PlanRequest(trace=TraceRequest(kind="gamma", rate_qps=100.0, cv2=4.0), seed=3)


def _apply(
    service: Service,
    resolver: AppResolver,
    document: dict[str, Any],
    request: PlanRequest = REQUEST,
) -> dict[str, int]:
    """Register the app, plan it as an API preview of ``request`` does, apply; its fleet."""
    store = service.store
    store.create_app(spec_document(resolver.check(document).spec), who="test")
    record = preview_plan(store, resolver, document["name"], request)
    assert record.plan.feasible
    store.apply_plan(document["name"], record.id)
    return record.plan.fleet


def _replanner(service: Service, resolver: AppResolver, **options: Any) -> CapacityReplanner:
    return CapacityReplanner(
        service.store,
        lambda app: resolver.resolve(app.spec, check_budget=False),
        service.reconciler.capacity_misses,
        after_s=AFTER_S,
        **options,
    )


def _replanned_around(
    service: Service, clock: Any, replanner: CapacityReplanner, missing: str
) -> Any:
    """The launches of ``missing`` fail for :data:`AFTER_S`, the re-planner re-plans "toy"
    around it: the plan it applied, which places none of it."""
    reconciler = service.reconciler
    assert reconciler is not None
    reconciler.run_once()
    clock.advance(AFTER_S)
    reconciler.run_once()
    assert replanner.tick() == ["toy"]
    applied = service.store.get_applied_plan("toy")
    assert applied is not None and applied.plan.fleet.get(missing, 0) == 0
    return applied


def _fail_busiest(service: Service, planned: dict[str, int]) -> tuple[str, FakeProvisioner]:
    """No capacity, from now on, for the planned type with the most instances."""
    missing = max(planned, key=lambda t: (planned[t], t))
    provisioner = service.provisioner
    assert isinstance(provisioner, FakeProvisioner)
    provisioner.fail_capacity(missing)
    return missing, provisioner


def _kept_cost(service: Service, app: str) -> float:
    return sum(i.price_usd_per_hr for i in service.store.list_instances(app, LIVE))


def test_a_type_without_capacity_is_planned_around_within_the_budget(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    document = spec(budget=4.0, latency_ms=40.0)
    planned = _apply(service, resolver, document)
    missing, provisioner = _fail_busiest(service, planned)
    replanner = _replanner(service, resolver)

    service.reconciler.run_once()
    assert set(service.reconciler.capacity_misses("toy")) == {missing}
    assert replanner.tick() == []  # a fresh miss: retried first
    clock.advance(AFTER_S)
    service.reconciler.run_once()
    assert service.reconciler.capacity_misses("toy") == {missing: AFTER_S}
    assert replanner.tick() == ["toy"]

    applied = service.store.get_applied_plan("toy")
    assert applied is not None
    fleet = applied.plan.fleet
    assert fleet.get(missing, 0) == 0 and sum(fleet.values()) > 0
    assert applied.document["feasible"] is True
    assert applied.document["cost_usd_per_hr"] <= document["budget_usd_per_hr"]
    assert missing in applied.document["steps"][0]
    # Planned again on the same trace: the generator's parameters stored with the first plan.
    assert applied.document["trace"]["request"] == REQUEST.trace.to_document()
    assert applied.document["seed"] == REQUEST.seed
    (decision,) = [d for d in service.store.list_decisions("toy") if d.kind == "capacity_replan"]
    assert decision.numbers["missing_types"] == [missing]
    assert decision.numbers["caps"] == {missing: 0}
    assert decision.numbers["fleet"] == fleet and decision.numbers["old_fleet"] == planned

    # The reconciler drops the requests it could not fill and launches the new mix.
    for _ in range(3):
        service.reconciler.run_once()
        provisioner.step()
        assert _kept_cost(service, "toy") <= document["budget_usd_per_hr"] + 1e-9
    kept = Counter(i.instance_type for i in service.store.list_instances("toy", LIVE))
    assert kept == Counter(fleet)
    assert service.reconciler.capacity_misses("toy") == {}
    assert replanner.tick() == []  # handled: nothing more to do


def test_a_re_plan_whose_decision_was_not_written_is_not_applied_either(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    """The write of the re-plan's decision fails (the loops process dies there): the plan is
    not applied either, and the next attempt re-plans and says it once. The decision used to be
    written after the apply, in a transaction of its own: the plan was applied and nothing ever
    said why (``heteroplane events`` showed the fleet change with no decision)."""
    service, clock, resolver = world
    planned = _apply(service, resolver, spec(budget=4.0, latency_ms=40.0))
    first = service.store.get_app("toy").applied_plan_id
    missing, _provisioner = _fail_busiest(service, planned)
    replanner = _replanner(service, resolver)
    reconciler = service.reconciler
    assert reconciler is not None
    reconciler.run_once()
    clock.advance(AFTER_S)
    reconciler.run_once()
    with decision_write_fails(f"no capacity of {missing}") as failing:
        with pytest.raises(RuntimeError, match="died writing the decision"):
            replanner.tick()
        assert failing == []
    assert service.store.get_app("toy").applied_plan_id == first
    assert service.store.list_decisions("toy", kinds=["capacity_replan"]) == []
    applied = _replanned_around(service, clock, _replanner(service, resolver), missing)
    (decision,) = service.store.list_decisions("toy", kinds=["capacity_replan"])
    assert decision.numbers["plan_id"] == applied.id != first


def test_without_a_feasible_plan_around_it_the_plan_stays_and_the_operator_is_told(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    # At 12 ms only g4dn.xlarge serves the model within the SLO (its batch of 1 takes 4 ms,
    # r5n.large's 12 ms, t3.xlarge's 18 ms): without it no plan exists.
    document = spec(budget=4.0, latency_ms=12.0)
    planned = _apply(service, resolver, document, PlanRequest(rate_qps=100.0))
    assert set(planned) == {"g4dn.xlarge"}
    _fail_busiest(service, planned)
    replanner = _replanner(service, resolver)
    before = service.store.get_applied_plan("toy")

    service.reconciler.run_once()
    clock.advance(AFTER_S)
    service.reconciler.run_once()
    assert replanner.tick() == []
    assert replanner.tick() == []  # said once
    after = service.store.get_applied_plan("toy")
    assert before is not None and after is not None and after.id == before.id
    (decision,) = [
        d for d in service.store.list_decisions("toy") if d.kind == "capacity_unavailable"
    ]
    assert "g4dn.xlarge" in decision.reason and "stays" in decision.reason
    assert decision.numbers["missing_types"] == ["g4dn.xlarge"]


def test_a_miss_that_a_retry_fixes_costs_no_plan(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    planned = _apply(service, resolver, spec(budget=4.0, latency_ms=40.0))
    missing, provisioner = _fail_busiest(service, planned)
    replanner = _replanner(service, resolver)
    service.reconciler.run_once()
    assert missing in service.reconciler.capacity_misses("toy")
    provisioner.restore_capacity(missing)
    clock.advance(AFTER_S)
    service.reconciler.run_once()  # the retry launches it: the run of misses ends
    assert service.reconciler.capacity_misses("toy") == {}
    assert replanner.tick() == []
    assert not [d for d in service.store.list_decisions("toy") if d.kind.startswith("capacity")]


def _run_fleet(service: Service, provisioner: FakeProvisioner, app: str, count: int) -> None:
    """Reconcile and step the fake provider until ``count`` instances of ``app`` run."""
    for _ in range(5):
        service.reconciler.run_once()
        provisioner.step()
        if len(service.store.list_instances(app, ["running"])) >= count:
            return
    raise AssertionError(f"no {count} running instances")


def _planned_and_running(
    service: Service, resolver: AppResolver
) -> tuple[dict[str, int], FakeProvisioner, str]:
    """The app planned and its whole fleet running: (its plan's fleet, the provider, the planned
    type with the most instances)."""
    planned = _apply(service, resolver, spec(budget=4.0, latency_ms=40.0))
    provisioner = service.provisioner
    assert isinstance(provisioner, FakeProvisioner)
    _run_fleet(service, provisioner, "toy", sum(planned.values()))
    return planned, provisioner, max(planned, key=lambda t: (planned[t], t))


def test_a_lost_instance_without_capacity_caps_its_type_at_what_still_runs(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, clock, resolver = world
    planned, provisioner, busiest = _planned_and_running(service, resolver)
    assert planned[busiest] >= 2
    victim = next(i for i in service.store.list_instances("toy") if i.instance_type == busiest)
    assert victim.provider_id is not None
    provisioner.crash([victim.provider_id])
    provisioner.fail_capacity(busiest)
    replanner = _replanner(service, resolver)
    service.reconciler.run_once()  # the first tick that finds it missing: the grace starts
    clock.advance(31.0)  # past the missing grace: the row ends and its replacement cannot launch
    service.reconciler.run_once()
    assert busiest in service.reconciler.capacity_misses("toy")
    clock.advance(AFTER_S)
    service.reconciler.run_once()
    assert replanner.tick() == ["toy"]
    applied = service.store.get_applied_plan("toy")
    assert applied is not None
    left = planned[busiest] - 1
    assert applied.plan.fleet.get(busiest, 0) <= left
    (decision,) = [d for d in service.store.list_decisions("toy") if d.kind == "capacity_replan"]
    assert decision.numbers["caps"] == {busiest: left}
    # The new plan asks for no more than runs: the miss ends, and nothing is planned again.
    for _ in range(3):
        clock.advance(AFTER_S)
        service.reconciler.run_once()
        provisioner.step()
        assert replanner.tick() == []
    assert service.reconciler.capacity_misses("toy") == {}
    assert len(service.store.list_plans("toy")) == 2


def test_launches_above_the_plan_are_not_a_reason_to_replan(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    service, _clock, resolver = world
    _planned, _provisioner, busiest = _planned_and_running(service, resolver)
    # As if the tuner had asked for one more of a planned type and the cloud had none for long.
    replanner = CapacityReplanner(
        service.store,
        lambda app: resolver.resolve(app.spec, check_budget=False),
        lambda _app: {busiest: 10 * AFTER_S},
        after_s=AFTER_S,
    )
    assert replanner.tick() == []
    assert len(service.store.list_plans("toy")) == 1
    assert not [d for d in service.store.list_decisions("toy") if d.kind.startswith("capacity")]


def test_an_app_that_buys_spot_is_planned_around_with_spot_as_every_plan_of_it(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    """An app whose spec buys spot is planned with spot by the API, the traffic and spot
    re-planners alike (``plan_with_spot``): the capacity re-plan around a missing type made an
    on-demand plan of it instead (the mix chosen at on-demand prices, none of it on spot), for
    the same app, trace and caps."""
    service, clock, resolver = world
    document = {
        **spec(budget=4.0, latency_ms=40.0),
        "spot": {"enabled": True, "survive_share": 0.0},
    }
    planned = _apply(service, resolver, document)
    first = service.store.get_applied_plan("toy")
    assert first is not None and any(stage.spot_fleet for stage in first.plan.stages)
    missing, _provisioner = _fail_busiest(service, planned)
    replanner = _replanner(service, resolver, spot_prices=provider_spot_prices(service.provisioner))
    applied = _replanned_around(service, clock, replanner, missing)

    # What the API plans for the same app with the type capped at what runs of it (nothing).
    resolved = resolver.resolve(service.store.get_app("toy").spec, check_budget=False)
    capped = resolved.with_constraints(resolved.constraints.capped({missing: 0}))
    trace, _ = planning_trace(capped, REQUEST)
    now = provider_prices(capped, provider_spot_prices(service.provisioner))
    expected = plan_with_spot(capped, trace, plan=plan_app, seed=REQUEST.seed, spot_prices=now)
    assert any(stage.spot_fleet for stage in applied.plan.stages)
    assert [(dict(s.fleet), dict(s.spot_fleet)) for s in applied.plan.stages] == [
        (dict(s.fleet), dict(s.spot_fleet)) for s in expected.stages
    ]
    assert applied.document["spot_prices_source"] == expected.to_document()["spot_prices_source"]


def test_a_plan_made_on_recorded_traffic_is_planned_around_on_its_burstiness(
    world: tuple[Service, FakeClock, AppResolver],
) -> None:
    """A plan the traffic re-planner made on recorded arrivals of CV^2 4 keeps their statistics,
    no generator parameters: planned around a missing type on gamma arrivals of that CV^2, as
    the rollout loop and the live tuner's ladders plan it again, where it took a Poisson trace
    at its rate (CV^2 1)."""
    service, clock, resolver = world
    document = spec(budget=4.0, latency_ms=40.0)
    _apply(service, resolver, document)
    first = service.store.get_applied_plan("toy")
    assert first is not None
    recorded = {**first.document, "trace": {"source": "recorded traffic", "cv2": 4.0}}
    service.store.apply_plan("toy", service.store.create_plan("toy", recorded).id)
    missing, _provisioner = _fail_busiest(service, first.plan.fleet)
    applied = _replanned_around(service, clock, _replanner(service, resolver), missing)
    request = applied.document["trace"]["request"]
    assert (request["kind"], request["cv2"]) == ("gamma", 4.0)
