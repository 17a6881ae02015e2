"""Taking an app down through the API (``DELETE /v1/apps/{app}?drain=true``) on the whole service
in-process (:func:`controlplane.service.build.build_service` with the fake provisioner and a fake
clock), the reconcile job run tick by tick: the instances are drained at once, nothing is launched
again, and the app is deleted once none is left; a budget change calls a teardown off; the
disruption budget holds back a plan's shrink, one decision for the whole episode; and ``heteroplane
demo --down`` (:func:`controlplane.service.demo.stop_demo`) takes the demo app down the same way."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from controlplane.apps.teardown import teardown_requested
from controlplane.cli import main
from controlplane.clock import FakeClock
from controlplane.service.build import Service, build_service
from controlplane.service.demo import DEMO_APP, stop_demo
from controlplane.settings import Settings
from provisioners.fake import FakeProvisioner

SMALL, LARGE = "emu.cpu.small", "emu.cpu.large"
APP = "recs"


def spec(name: str = APP, budget: float = 1.0) -> dict[str, Any]:
    return {
        "name": name,
        "models": [{"name": "tiny", "profiles": "profiles.json"}],
        "slo": {"latency_ms": 50},
        "budget_usd_per_hr": budget,
        "instance_types": [SMALL, LARGE],
    }


def apply_fleet(service: Service, fleet: Mapping[str, int], app: str = APP) -> None:
    document = {
        "feasible": True,
        "cost_usd_per_hr": 0.05 * sum(fleet.values()),
        "stages": [{"name": "tiny", "fleet": dict(fleet)}],
    }
    plan = service.store.create_plan(app, document)
    service.store.apply_plan(app, plan.id)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    built = build_service(
        Settings(data_dir=tmp_path / "data", provisioner="fake"), clock=FakeClock()
    )
    yield built
    built.close()


@pytest.fixture
def client(service: Service) -> TestClient:
    # No lifespan (no `with`): the scheduler does not run; the test runs the reconcile job.
    token = service.store.create_token("admin", name="admin-token")
    return TestClient(
        service.app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {token}"}
    )


def tick(service: Service, seconds: float = 5.0) -> None:
    clock = service.reconciler.clock
    assert isinstance(clock, FakeClock)
    clock.advance(seconds)
    assert service.scheduler.jobs["reconcile"]() == "ran"


def start(service: Service) -> None:
    """Two ticks: the launches, then the provider's word that they run."""
    tick(service)
    tick(service)


def live(service: Service, app: str = APP) -> dict[str, int]:
    states: dict[str, int] = {}
    for instance in service.store.list_instances(app):
        if instance.state not in ("terminated", "failed"):
            states[instance.state] = states.get(instance.state, 0) + 1
    return states


def launched_total(service: Service) -> int:
    assert isinstance(service.provisioner, FakeProvisioner)
    return service.provisioner.launched_total


def test_drain_true_drains_every_instance_then_deletes_the_app(
    service: Service, client: TestClient
) -> None:
    service.store.create_app(spec(), who="test")
    apply_fleet(service, {SMALL: 2, LARGE: 1})
    start(service)
    assert live(service) == {"running": 3}
    assert launched_total(service) == 3

    both = client.delete(f"/v1/apps/{APP}?drain=true&force=true")
    assert both.status_code == 422 and "choose one" in both.json()["error"]["message"]
    answer = client.delete(f"/v1/apps/{APP}?drain=true")
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert body["status"] == "draining" and len(body["instances"]) == 3
    assert "\n" not in body["message"]
    (mark,) = service.store.list_decisions(APP, kinds=["teardown"])
    assert mark.numbers["who"] == "admin-token"

    # One tick: every instance at once (no disruption budget for a teardown), nothing launched.
    tick(service)
    assert live(service) == {"terminating": 3}
    (terminate,) = service.store.list_decisions(APP, kinds=["terminate"])
    assert terminate.numbers["cause"] == "teardown"
    # The next: the provider has ended them; the app goes.
    tick(service)
    assert client.get(f"/v1/apps/{APP}").status_code == 404
    assert {i.state for i in service.provisioner.list({})} == {"terminated"}
    tick(service)
    assert launched_total(service) == 3


def test_drain_true_on_an_app_without_instances_deletes_it_at_once(
    service: Service, client: TestClient
) -> None:
    service.store.create_app(spec(), who="test")
    assert client.delete(f"/v1/apps/{APP}?drain=true").status_code == 204
    assert client.get(f"/v1/apps/{APP}").status_code == 404
    assert client.delete(f"/v1/apps/{APP}?drain=true").status_code == 404
    # Plain delete is unchanged: refused while instances live.
    service.store.create_app(spec(), who="test")
    apply_fleet(service, {SMALL: 1})
    start(service)
    refused = client.delete(f"/v1/apps/{APP}")
    assert refused.status_code == 409 and "drain" in refused.json()["error"]["message"]


def test_a_budget_change_calls_a_teardown_off(service: Service, client: TestClient) -> None:
    service.store.create_app(spec(), who="test")
    apply_fleet(service, {SMALL: 2})
    start(service)
    assert client.delete(f"/v1/apps/{APP}?drain=true").status_code == 202
    assert teardown_requested(service.store, service.store.get_app(APP))
    tick(service, 1.0)
    put = client.put(
        f"/v1/apps/{APP}/budget", json={"budget_usd_per_hr": 1.0, "reason": "keep it after all"}
    )
    assert put.status_code == 200, put.text
    assert not teardown_requested(service.store, service.store.get_app(APP))
    tick(service)
    tick(service)
    # The plan's fleet is back and the app stays.
    assert live(service) == {"running": 2}
    assert client.get(f"/v1/apps/{APP}").status_code == 200


def test_a_plan_is_not_applied_to_an_app_being_taken_down(
    service: Service, client: TestClient
) -> None:
    """An apply while the app drains for its teardown is a 409 that says how to call the
    teardown off, not a 200 whose plan goes with the app moments later."""
    service.store.create_app(spec(), who="test")
    apply_fleet(service, {SMALL: 2})
    start(service)
    later = service.store.create_plan(
        APP,
        {
            "feasible": True,
            "cost_usd_per_hr": 0.05,
            "stages": [{"name": "tiny", "fleet": {SMALL: 1}}],
        },
    )
    assert client.delete(f"/v1/apps/{APP}?drain=true").status_code == 202
    refused = client.post(f"/v1/apps/{APP}/plans/{later.id}/apply")
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert "being taken down" in message and "heteroplane budget set" in message
    assert service.store.get_plan(APP, later.id).applied_at is None


def test_a_plan_shrink_waits_for_the_disruption_budget(service: Service) -> None:
    service.store.create_app(spec(), who="test")
    apply_fleet(service, {SMALL: 4})
    start(service)
    assert live(service) == {"running": 4}
    apply_fleet(service, {SMALL: 1})
    tick(service)
    # One serving instance a minute (the default budget: 1, or 25% of 4); it drains first.
    assert live(service) == {"running": 3, "draining": 1}
    for _ in range(3):
        tick(service)  # 20 s: the same window; drained for 10 s, it goes
    assert live(service) == {"running": 3}
    (held,) = service.store.list_decisions(APP, kinds=["drain_deferred"])
    assert held.numbers["cause"] == "disruption" and held.count == 4  # one per tick, one row
    tick(service, 61.0)
    assert live(service) == {"running": 2, "draining": 1}
    tick(service, 61.0)  # the next window: the drained one goes, the last excess one drains
    assert live(service) == {"running": 1, "draining": 1, "terminating": 1}
    for _ in range(3):
        tick(service)
    assert live(service) == {"running": 1}


def test_demo_down_drains_and_deletes_the_demo_app(service: Service) -> None:
    service.store.create_app(spec(DEMO_APP), who="test")
    apply_fleet(service, {SMALL: 2, LARGE: 1}, app=DEMO_APP)
    start(service)
    assert live(service, DEMO_APP) == {"running": 3}
    said: list[str] = []
    down = stop_demo(service, said.append, sleep=lambda _s: None)
    assert down.done and down.app_found and down.stopped == 3
    assert {i.state for i in service.provisioner.list({})} == {"terminated"}
    assert [a.name for a in service.store.list_apps()] == []
    assert said[0].startswith(f"app {DEMO_APP}: draining 3 instance(s)")
    # Again: nothing to do.
    again = stop_demo(service, said.append, sleep=lambda _s: None)
    assert again.done and not again.app_found and again.stopped == 0


def test_demo_down_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HETEROPLANE_PROVISIONER", "fake")
    monkeypatch.delenv("HETEROPLANE_CONFIG", raising=False)
    assert main(["demo", "--down"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--down", "--offline"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose one" in err


def test_demo_down_names_other_apps_that_still_run_instances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's own model served beside the demo keeps its workers after ``demo --down``
    (which takes the demo app down alone): it says so, and how to take them down."""
    settings = Settings(data_dir=tmp_path / "data", provisioner="fake")
    built = build_service(settings, clock=FakeClock())
    try:
        built.store.create_app(spec("wine"), who="test")
        built.store.record_instance(
            "wine", request_id="r0", instance_type=SMALL, price_usd_per_hr=0.05, state="running"
        )
    finally:
        built.close()
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HETEROPLANE_PROVISIONER", "fake")
    monkeypatch.delenv("HETEROPLANE_CONFIG", raising=False)
    assert main(["demo", "--down"]) == 0
    err = capsys.readouterr().err
    assert "other apps still run instances here: wine (1)" in err
    assert "heteroplane app down APP" in err
