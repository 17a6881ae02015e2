"""The fake provisioner keeps the Provisioner contract, and each failure knob does what it says."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from provisioners.base import (
    APP_TAG,
    MANAGED_TAG,
    PLAN_TAG,
    REQUEST_TAG,
    LaunchRequest,
    Provisioner,
)
from provisioners.errors import (
    InsufficientCapacityError,
    InvalidConfigurationError,
    ProvisionerError,
    QuotaExceededError,
    ThrottledError,
    UnknownInstanceError,
)
from provisioners.fake import FAKE_NOW, FakeProvisioner

ZONES = ("zone-a", "zone-b")


@pytest.fixture
def fake() -> FakeProvisioner:
    return FakeProvisioner(zones=ZONES)


def request(
    request_id: str = "r-1", instance_type: str = "g4dn.xlarge", count: int = 2
) -> LaunchRequest:
    return LaunchRequest(request_id, instance_type, count, {APP_TAG: "recs", PLAN_TAG: "p-1"})


def test_is_a_provisioner(fake: FakeProvisioner) -> None:
    assert isinstance(fake, Provisioner)
    assert fake.name == "fake"


def test_launch_tags_and_deterministic_ids(fake: FakeProvisioner) -> None:
    launched = fake.launch(request())
    assert [i.provider_id for i in launched] == ["fake-00000001", "fake-00000002"]
    assert {i.state for i in launched} == {"pending"}
    assert {i.zone for i in launched} == {"zone-a"}
    assert all(i.address for i in launched)
    assert launched[0].launched_at == FAKE_NOW
    tags = launched[0].tags
    assert tags[MANAGED_TAG] == "true"
    assert tags[REQUEST_TAG] == "r-1"
    assert tags[APP_TAG] == "recs"
    assert launched[0].request_id == "r-1"


def test_launch_is_idempotent_by_request_id(fake: FakeProvisioner) -> None:
    first = fake.launch(request())
    fake.step()
    again = fake.launch(request())
    assert [i.provider_id for i in again] == [i.provider_id for i in first]
    assert {i.state for i in again} == {"running"}
    assert fake.launched_total == 2
    assert len(fake.list({})) == 2


def test_request_id_reused_for_another_launch_is_refused(fake: FakeProvisioner) -> None:
    fake.launch(request())
    with pytest.raises(InvalidConfigurationError, match="request_id"):
        fake.launch(request(count=3))


def test_launch_request_is_validated() -> None:
    with pytest.raises(ValueError, match="count"):
        LaunchRequest("r-1", "t3.large", 0, {})
    with pytest.raises(ValueError, match="request_id"):
        LaunchRequest("", "t3.large", 1, {})


def test_step_runs_pending_and_forgets_terminated(fake: FakeProvisioner) -> None:
    a, b = fake.launch(request())
    fake.step()
    assert {i.state for i in fake.list({})} == {"running"}
    fake.terminate([a.provider_id])
    states = {i.provider_id: i.state for i in fake.list({})}
    assert states == {a.provider_id: "terminated", b.provider_id: "running"}
    fake.step()
    assert [i.provider_id for i in fake.list({})] == [b.provider_id]


def test_running_on_launch() -> None:
    fake = FakeProvisioner(running_on_launch=True)
    assert {i.state for i in fake.launch(request())} == {"running"}


def test_list_matches_every_tag(fake: FakeProvisioner) -> None:
    fake.launch(request("r-1"))
    fake.launch(LaunchRequest("r-2", "t3.large", 1, {APP_TAG: "other"}))
    assert len(fake.list({APP_TAG: "recs"})) == 2
    assert len(fake.list({APP_TAG: "recs", PLAN_TAG: "p-1"})) == 2
    assert len(fake.list({APP_TAG: "recs", PLAN_TAG: "p-2"})) == 0
    assert [i.instance_type for i in fake.list({REQUEST_TAG: "r-2"})] == ["t3.large"]
    assert len(fake.list({})) == 3


def test_terminate_is_idempotent_and_ignores_unknown_ids(fake: FakeProvisioner) -> None:
    (a, _) = fake.launch(request())
    fake.terminate([a.provider_id, "fake-99999999"])
    fake.terminate([a.provider_id])
    assert {i.provider_id: i.state for i in fake.list({})}[a.provider_id] == "terminated"


def test_terminate_refuses_unmanaged_instances(fake: FakeProvisioner) -> None:
    (a, _) = fake.launch(request())
    foreign = fake.add_unmanaged("t3.large")
    with pytest.raises(UnknownInstanceError) as caught:
        fake.terminate([a.provider_id, foreign])
    assert caught.value.provider_id == foreign
    # Nothing was terminated, and the foreign instance is never listed.
    assert {i.state for i in fake.list({})} == {"pending"}
    assert foreign not in {i.provider_id for i in fake.list({})}


def test_capacity_in_one_zone_falls_back_with_an_event(fake: FakeProvisioner) -> None:
    fake.fail_capacity("g4dn.xlarge", "zone-a")
    launched = fake.launch(request())
    assert {i.zone for i in launched} == {"zone-b"}
    (event,) = fake.poll_events()
    assert (event.kind, event.instance_type, event.zone) == ("capacity", "g4dn.xlarge", "zone-b")
    assert "zone-a" in event.message
    assert fake.poll_events() == []
    # Other types are not affected.
    assert {i.zone for i in fake.launch(request("r-2", "t3.large", 1))} == {"zone-a"}


def test_capacity_nowhere_raises_typed_error(fake: FakeProvisioner) -> None:
    fake.fail_capacity("g4dn.xlarge", "zone-a")
    fake.fail_capacity("g4dn.xlarge", "zone-b")
    with pytest.raises(InsufficientCapacityError) as caught:
        fake.launch(request())
    assert caught.value.instance_type == "g4dn.xlarge"
    assert caught.value.zone is None
    assert caught.value.retryable
    assert [e.kind for e in fake.poll_events()] == ["capacity"]
    assert fake.list({}) == []
    fake.restore_capacity("g4dn.xlarge", "zone-a")
    assert len(fake.launch(request("r-2"))) == 2


def test_capacity_in_every_zone_at_once(fake: FakeProvisioner) -> None:
    fake.fail_capacity("g4dn.xlarge")
    with pytest.raises(InsufficientCapacityError):
        fake.launch(request())


def test_quota(fake: FakeProvisioner) -> None:
    fake.set_quota("g4dn.xlarge", 3)
    fake.launch(request("r-1", count=2))
    with pytest.raises(QuotaExceededError) as caught:
        fake.launch(request("r-2", count=2))
    assert caught.value.instance_type == "g4dn.xlarge"
    assert not caught.value.retryable
    assert [e.kind for e in fake.poll_events()] == ["quota"]
    fake.launch(request("r-3", count=1))
    fake.set_quota("g4dn.xlarge", None)
    fake.launch(request("r-4", count=5))


def test_throttle_next_calls(fake: FakeProvisioner) -> None:
    fake.throttle_next(2)
    with pytest.raises(ThrottledError):
        fake.launch(request())
    with pytest.raises(ThrottledError):
        fake.list({})
    assert len(fake.launch(request())) == 2
    assert [e.kind for e in fake.poll_events()] == ["throttled", "throttled"]


def test_never_run_stays_pending(fake: FakeProvisioner) -> None:
    fake.never_run("g4dn.xlarge")
    fake.launch(request())
    fake.launch(request("r-2", "t3.large", 1))
    fake.step()
    fake.step()
    states = {i.instance_type: i.state for i in fake.list({})}
    assert states == {"g4dn.xlarge": "pending", "t3.large": "running"}


def test_never_run_wins_over_running_on_launch() -> None:
    fake = FakeProvisioner(running_on_launch=True)
    fake.never_run("g4dn.xlarge")
    assert {i.state for i in fake.launch(request())} == {"pending"}


def test_fail_start(fake: FakeProvisioner) -> None:
    fake.fail_start("g4dn.xlarge")
    fake.launch(request())
    fake.step()
    assert {i.state for i in fake.list({})} == {"failed"}
    assert [e.kind for e in fake.poll_events()] == ["failed", "failed"]


def test_fail_terminate_next(fake: FakeProvisioner) -> None:
    (a, _) = fake.launch(request())
    fake.fail_terminate_next(1)
    with pytest.raises(ProvisionerError):
        fake.terminate([a.provider_id])
    assert {i.state for i in fake.list({})} == {"pending"}
    fake.terminate([a.provider_id])
    assert {i.provider_id: i.state for i in fake.list({})}[a.provider_id] == "terminated"


def test_crash_loses_instances(fake: FakeProvisioner) -> None:
    a, b = fake.launch(request())
    assert fake.crash([a.provider_id]) == [a.provider_id]
    assert [i.provider_id for i in fake.list({})] == [b.provider_id]
    # The request is still answered, the lost instance as terminated; nothing is relaunched.
    again = fake.launch(request())
    assert [(i.provider_id, i.state) for i in again] == [
        (a.provider_id, "terminated"),
        (b.provider_id, "pending"),
    ]
    assert fake.launched_total == 2
    assert fake.crash() == [b.provider_id]
    assert fake.list({}) == []


def test_set_state(fake: FakeProvisioner) -> None:
    (a, _) = fake.launch(request())
    fake.set_state(a.provider_id, "failed")
    assert {i.provider_id: i.state for i in fake.list({})}[a.provider_id] == "failed"


def test_injected_now_stamps_events_and_launches() -> None:
    at = datetime(2030, 5, 1, tzinfo=UTC)
    fake = FakeProvisioner(zones=ZONES, now=lambda: at)
    fake.fail_capacity("g4dn.xlarge", "zone-a")
    (instance, _) = fake.launch(request())
    assert instance.launched_at == at
    assert fake.poll_events()[0].at == at


def test_calls_are_recorded(fake: FakeProvisioner) -> None:
    fake.launch(request())
    fake.list({})
    fake.terminate([])
    assert fake.calls == ["launch", "list", "terminate"]


def test_needs_a_zone() -> None:
    with pytest.raises(InvalidConfigurationError, match="zones"):
        FakeProvisioner(zones=())
