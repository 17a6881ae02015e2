"""The EC2 provisioner against a real moto server on 127.0.0.1 (real boto3 over HTTP).

boto3 finds the server through ``AWS_ENDPOINT_URL`` alone. Failures (no capacity, throttling,
quotas) are injected through botocore's event hooks on the session the provisioner is given
(``before-send`` answers with an EC2 error response instead of sending), never by patching the
provisioner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import pytest

from provisioners.base import APP_TAG, MANAGED_TAG, PLAN_TAG, REQUEST_TAG, LaunchRequest
from provisioners.errors import (
    InsufficientCapacityError,
    QuotaExceededError,
    ThrottledError,
    UnknownInstanceError,
)
from tests.integration.moto_server import (
    REGION,
    Ec2Network,
    aws_env,
    ec2_network,
    moto_server,
    needs_moto,
)

__all__ = ["aws_env", "ec2_network", "moto_server"]  # fixtures, imported for pytest

pytestmark = needs_moto

boto3 = pytest.importorskip("boto3")
from botocore.awsrequest import AWSResponse  # noqa: E402

from provisioners.ec2 import Ec2Config, Ec2Provisioner  # noqa: E402

PLAN = {"t3.large": 2, "c5.xlarge": 1}


class _Body:
    """The raw body of an injected response (what AWSResponse reads)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        yield self._data


def ec2_error(request: Any, code: str, status: int) -> AWSResponse:
    """An EC2 (query protocol) error response, as AWS sends it."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
        f"<Code>{code}</Code><Message>injected {code}</Message>"
        "</Error></Errors><RequestID>injected</RequestID></Response>"
    ).encode()
    return AWSResponse(request.url, status, {"Content-Type": "text/xml;charset=UTF-8"}, _Body(body))


def params_of(request: Any) -> dict[str, str]:
    body = request.body
    text = body.decode() if isinstance(body, bytes) else str(body or "")
    return {key: values[0] for key, values in parse_qs(text).items()}


class Injector:
    """A ``before-send`` hook: answers the calls ``when`` picks with ``code``; counts calls."""

    def __init__(self, code: str, status: int, when: Callable[[dict[str, str]], bool]) -> None:
        self.code = code
        self.status = status
        self.when = when
        self.injected = 0
        self.sent: list[dict[str, str]] = []
        self.limit: int | None = None

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        params = params_of(request)
        self.sent.append(params)
        if self.when(params) and (self.limit is None or self.injected < self.limit):
            self.injected += 1
            return ec2_error(request, self.code, self.status)
        return None


def session_with(event: str, handler: Callable[..., Any]) -> Any:
    session = boto3.Session()
    session.events.register(event, handler)
    return session


def config(network: Ec2Network, **changes: Any) -> Ec2Config:
    values: dict[str, Any] = {
        "region": REGION,
        "subnet_ids": network.subnet_ids,
        "security_group_ids": (network.security_group_id,),
        "ami_id": network.ami_id,
    }
    values.update(changes)
    return Ec2Config(**values)


def apply_plan(provisioner: Ec2Provisioner, plan: dict[str, int], plan_id: str) -> None:
    for instance_type, count in plan.items():
        tags = {APP_TAG: "recs", PLAN_TAG: plan_id}
        provisioner.launch(LaunchRequest(f"{plan_id}-{instance_type}", instance_type, count, tags))


def live(instances: list[Any]) -> list[Any]:
    return [i for i in instances if i.state != "terminated"]


def raw_instances(**filters: str) -> list[dict[str, Any]]:
    ec2 = boto3.client("ec2", region_name=REGION)
    wanted = [{"Name": name, "Values": [value]} for name, value in filters.items()]
    pages = ec2.get_paginator("describe_instances").paginate(Filters=wanted)
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def test_apply_plan_launches_tagged_instances_of_the_right_types(ec2_network: Ec2Network) -> None:
    provisioner = Ec2Provisioner(config(ec2_network))
    apply_plan(provisioner, PLAN, "p-1")

    listed = provisioner.list({APP_TAG: "recs"})
    assert sorted(i.instance_type for i in listed) == ["c5.xlarge", "t3.large", "t3.large"]
    for instance in listed:
        assert instance.tags[MANAGED_TAG] == "true"
        assert instance.tags[PLAN_TAG] == "p-1"
        assert instance.tags[REQUEST_TAG] == f"p-1-{instance.instance_type}"
        assert instance.state in {"pending", "running"}
        assert instance.zone == "us-east-1a"  # the first subnet
        assert instance.address is not None and instance.address.startswith("10.0.1.")
        assert instance.launched_at is not None and instance.launched_at.tzinfo is not None
    # The tags are on AWS's side, where anyone (the console, terraform) sees them.
    on_aws = raw_instances(**{"tag:heteroplane:app": "recs"})
    assert len(on_aws) == 3
    assert all(i["SecurityGroups"][0]["GroupId"] == ec2_network.security_group_id for i in on_aws)
    ec2 = boto3.client("ec2", region_name=REGION)
    volumes = ec2.describe_volumes(Filters=[{"Name": "tag:heteroplane:plan", "Values": ["p-1"]}])
    assert len(volumes["Volumes"]) == 3


def test_lower_budget_terminates_the_right_ones(ec2_network: Ec2Network) -> None:
    provisioner = Ec2Provisioner(config(ec2_network))
    apply_plan(provisioner, PLAN, "p-1")
    # The budget fell: the planner keeps one t3.large; the c5.xlarge and a t3.large go.
    fleet = provisioner.list({APP_TAG: "recs"})
    t3 = sorted(i.provider_id for i in fleet if i.instance_type == "t3.large")
    c5 = [i.provider_id for i in fleet if i.instance_type == "c5.xlarge"]
    going = [*c5, t3[1]]
    provisioner.terminate(going)

    states = {i.provider_id: i.state for i in provisioner.list({APP_TAG: "recs"})}
    assert {pid for pid, state in states.items() if state == "terminated"} == set(going)
    assert [pid for pid, state in states.items() if state != "terminated"] == [t3[0]]
    # Again, and with an id AWS never heard of: nothing happens.
    provisioner.terminate([*going, "i-0123456789abcdef0"])
    assert live(provisioner.list({APP_TAG: "recs"}))[0].provider_id == t3[0]


def test_terminate_refuses_an_instance_that_is_not_ours(ec2_network: Ec2Network) -> None:
    ec2 = boto3.client("ec2", region_name=REGION)
    foreign = ec2.run_instances(
        ImageId=ec2_network.ami_id,
        InstanceType="t3.micro",
        MinCount=1,
        MaxCount=1,
        SubnetId=ec2_network.subnet_ids[0],
    )["Instances"][0]["InstanceId"]
    provisioner = Ec2Provisioner(config(ec2_network))
    (ours,) = provisioner.launch(LaunchRequest("r-1", "t3.large", 1, {}))
    with pytest.raises(UnknownInstanceError) as caught:
        provisioner.terminate([ours.provider_id, foreign])
    assert caught.value.provider_id == foreign
    assert raw_instances(**{"instance-id": foreign})[0]["State"]["Name"] == "running"
    assert live(provisioner.list({}))  # ours untouched too
    # Never listed: listing is by our tags.
    assert foreign not in {i.provider_id for i in provisioner.list({})}


def test_restart_launches_nothing_twice(ec2_network: Ec2Network) -> None:
    first = Ec2Provisioner(config(ec2_network))
    apply_plan(first, PLAN, "p-1")
    before = sorted(i.provider_id for i in first.list({}))

    counter = Injector("Unused", 500, lambda _: False)
    restarted = Ec2Provisioner(
        config(ec2_network), session_with("before-send.ec2.RunInstances", counter)
    )
    apply_plan(restarted, PLAN, "p-1")
    again = restarted.launch(LaunchRequest("p-1-t3.large", "t3.large", 2, {}))

    assert counter.sent == []  # no RunInstances at all
    assert sorted(i.provider_id for i in again) == sorted(
        pid for pid in before if pid in {i.provider_id for i in again}
    )
    assert sorted(i.provider_id for i in restarted.list({})) == before
    assert len(raw_instances(**{"tag:heteroplane:managed": "true"})) == 3


def test_run_instances_carries_a_client_token_from_the_request_id(
    ec2_network: Ec2Network,
) -> None:
    counter = Injector("Unused", 500, lambda _: False)
    provisioner = Ec2Provisioner(
        config(ec2_network), session_with("before-send.ec2.RunInstances", counter)
    )
    provisioner.launch(LaunchRequest("a-request-id-" + "x" * 80, "t3.large", 1, {}))
    (sent,) = counter.sent
    assert 0 < len(sent["ClientToken"]) <= 64
    assert sent["MinCount"] == sent["MaxCount"] == "1"


def test_no_capacity_in_one_zone_falls_back_to_the_other_with_an_event(
    ec2_network: Ec2Network,
) -> None:
    subnet_a = ec2_network.subnet_ids[0]
    no_g4dn_in_a = Injector(
        "InsufficientInstanceCapacity",
        500,  # as AWS answers it; botocore would retry a 500 as transient
        lambda p: p.get("InstanceType") == "g4dn.xlarge" and p.get("SubnetId") == subnet_a,
    )
    now_s = [1000.0]
    provisioner = Ec2Provisioner(
        config(ec2_network, unavailable_ttl_s=180.0),
        session_with("before-send.ec2.RunInstances", no_g4dn_in_a),
        clock=lambda: now_s[0],
    )

    launched = provisioner.launch(LaunchRequest("r-1", "g4dn.xlarge", 2, {APP_TAG: "recs"}))

    assert {i.zone for i in launched} == {"us-east-1b"}
    assert no_g4dn_in_a.injected == 1  # failed fast: not retried
    events = provisioner.poll_events()
    assert [e.kind for e in events] == ["capacity", "capacity"]
    assert events[0].zone == "us-east-1a"
    assert "InsufficientInstanceCapacity" in events[0].message
    assert events[-1].zone == "us-east-1b"
    assert "us-east-1a" in events[-1].message
    assert "InsufficientInstanceCapacity" in events[-1].message
    assert provisioner.unavailable_offerings() == {("g4dn.xlarge", "us-east-1a")}
    assert provisioner.poll_events() == []

    # Other types still use the first zone; g4dn skips it without asking while it is cached.
    (t3,) = provisioner.launch(LaunchRequest("r-2", "t3.large", 1, {}))
    assert t3.zone == "us-east-1a"
    (g4dn,) = provisioner.launch(LaunchRequest("r-3", "g4dn.xlarge", 1, {}))
    assert g4dn.zone == "us-east-1b"
    assert no_g4dn_in_a.injected == 1
    assert "recently" in provisioner.poll_events()[-1].message

    # When the cache expires the first zone is tried again.
    now_s[0] += 181.0
    no_g4dn_in_a.limit = 1  # and it has capacity again
    (back,) = provisioner.launch(LaunchRequest("r-4", "g4dn.xlarge", 1, {}))
    assert back.zone == "us-east-1a"
    assert provisioner.unavailable_offerings() == frozenset()


def test_no_capacity_anywhere_reports_back_for_the_next_configuration(
    ec2_network: Ec2Network,
) -> None:
    no_g4dn = Injector(
        "InsufficientInstanceCapacity", 500, lambda p: p.get("InstanceType") == "g4dn.xlarge"
    )
    provisioner = Ec2Provisioner(
        config(ec2_network), session_with("before-send.ec2.RunInstances", no_g4dn)
    )
    with pytest.raises(InsufficientCapacityError) as caught:
        provisioner.launch(LaunchRequest("r-1", "g4dn.xlarge", 1, {}))
    assert caught.value.instance_type == "g4dn.xlarge"
    assert caught.value.zone is None
    assert caught.value.retryable
    assert no_g4dn.injected == 2  # once per zone, no retries
    events = provisioner.poll_events()
    assert events[-1].kind == "capacity"
    assert "us-east-1a" in events[-1].message and "us-east-1b" in events[-1].message
    # The planner's next configuration (another type) launches.
    (fallback,) = provisioner.launch(LaunchRequest("r-2", "g4dn.2xlarge", 1, {}))
    assert fallback.instance_type == "g4dn.2xlarge"
    assert provisioner.list({REQUEST_TAG: "r-1"}) == []


def test_throttling_is_retried(ec2_network: Ec2Network) -> None:
    throttle = Injector("RequestLimitExceeded", 503, lambda _: True)
    throttle.limit = 2
    provisioner = Ec2Provisioner(
        config(ec2_network), session_with("before-send.ec2.RunInstances", throttle)
    )
    (instance,) = provisioner.launch(LaunchRequest("r-1", "t3.large", 1, {}))
    assert instance.instance_type == "t3.large"
    assert throttle.injected == 2
    assert len(throttle.sent) == 3  # two throttled attempts, then the one that went through
    assert len({p["ClientToken"] for p in throttle.sent}) == 1  # the same call, retried
    assert len(provisioner.list({})) == 1


def test_throttling_that_outlasts_the_retries_is_a_throttled_error(
    ec2_network: Ec2Network,
) -> None:
    throttle = Injector("RequestLimitExceeded", 503, lambda _: True)
    provisioner = Ec2Provisioner(
        config(ec2_network, max_attempts=2),
        session_with("before-send.ec2.DescribeInstances", throttle),
    )
    with pytest.raises(ThrottledError):
        provisioner.list({})
    assert throttle.injected == 2
    assert [e.kind for e in provisioner.poll_events()] == ["throttled"]


def test_quota_is_a_typed_error_with_an_event(ec2_network: Ec2Network) -> None:
    quota = Injector("VcpuLimitExceeded", 400, lambda _: True)
    provisioner = Ec2Provisioner(
        config(ec2_network), session_with("before-send.ec2.RunInstances", quota)
    )
    with pytest.raises(QuotaExceededError) as caught:
        provisioner.launch(LaunchRequest("r-1", "p4d.24xlarge", 1, {}))
    assert caught.value.instance_type == "p4d.24xlarge"
    assert caught.value.code == "VcpuLimitExceeded"
    assert quota.injected == 1  # not tried in the other zone: a quota is regional
    assert [e.kind for e in provisioner.poll_events()] == ["quota"]


def test_listing_is_always_filtered_by_tags(ec2_network: Ec2Network) -> None:
    seen = Injector("Unused", 500, lambda _: False)
    provisioner = Ec2Provisioner(
        config(ec2_network), session_with("before-send.ec2.DescribeInstances", seen)
    )
    apply_plan(provisioner, PLAN, "p-1")
    provisioner.list({APP_TAG: "recs"})
    provisioner.terminate([i.provider_id for i in provisioner.list({PLAN_TAG: "p-1"})])
    allowed = {f"tag:{key}" for key in (MANAGED_TAG, APP_TAG, PLAN_TAG, REQUEST_TAG)}
    allowed.add("instance-id")
    assert seen.sent
    for params in seen.sent:
        names = {v for k, v in params.items() if k.startswith("Filter.") and k.endswith(".Name")}
        assert names and names <= allowed
        assert not any(k.startswith("InstanceId") for k in params)


def test_launch_templates_made_in_development_are_used(ec2_network: Ec2Network) -> None:
    provisioner = Ec2Provisioner(config(ec2_network))
    made = provisioner.ensure_launch_templates(["t3.large", "c5.xlarge"])
    assert set(made) == {"t3.large", "c5.xlarge"}
    # A second call (or a second control plane) finds them instead of making more.
    assert Ec2Provisioner(config(ec2_network)).ensure_launch_templates(["t3.large"]) == {
        "t3.large": made["t3.large"]
    }
    ec2 = boto3.client("ec2", region_name=REGION)
    names = {t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]}
    assert names == {"heteroplane-t3.large", "heteroplane-c5.xlarge"}

    from_template = Ec2Provisioner(
        config(ec2_network, ami_id=None, launch_templates={"t3.large": made["t3.large"]})
    )
    (instance,) = from_template.launch(LaunchRequest("r-1", "t3.large", 1, {}))
    assert instance.instance_type == "t3.large"
    assert instance.tags[MANAGED_TAG] == "true"


def test_spot_fleet_then_on_demand_fallback(ec2_network: Ec2Network) -> None:
    maker = Ec2Provisioner(config(ec2_network))
    templates = maker.ensure_launch_templates(["m5.large"])
    spot = Ec2Provisioner(config(ec2_network, spot=True, launch_templates=templates))
    launched = spot.launch(LaunchRequest("r-1", "m5.large", 2, {APP_TAG: "recs"}))
    assert len(launched) == 2
    raws = raw_instances(**{"tag:heteroplane:request-id": "r-1"})
    assert {r.get("InstanceLifecycle") for r in raws} == {"spot"}
    assert all(i.tags[APP_TAG] == "recs" for i in launched)
    # Idempotent on the spot path too.
    assert {i.provider_id for i in spot.launch(LaunchRequest("r-1", "m5.large", 2, {}))} == {
        i.provider_id for i in launched
    }

    no_spot = Injector("UnfulfillableCapacity", 400, lambda _: True)
    fallback = Ec2Provisioner(
        config(ec2_network, spot=True, launch_templates=templates),
        session_with("before-send.ec2.CreateFleet", no_spot),
    )
    (on_demand,) = fallback.launch(LaunchRequest("r-2", "m5.large", 1, {}))
    raw = raw_instances(**{"instance-id": on_demand.provider_id})[0]
    assert raw.get("InstanceLifecycle") in (None, "scheduled", "on-demand")
    assert any("on demand" in e.message for e in fallback.poll_events())


def test_spot_fleets_tag_their_volumes_at_creation(ec2_network: Ec2Network) -> None:
    templates = Ec2Provisioner(config(ec2_network)).ensure_launch_templates(["m5.large"])
    seen = Injector("none", 200, lambda _: False)  # records, injects nothing
    session = session_with("before-send.ec2.*", seen)
    spot = Ec2Provisioner(config(ec2_network, spot=True, launch_templates=templates), session)
    launched = spot.launch(LaunchRequest("r-1", "m5.large", 2, {APP_TAG: "recs"}))
    assert len(launched) == 2
    # What AWS applies (an instant fleet may tag "volume"; moto 5.2 accepts it and drops it, so
    # the request is what can be checked here): the volumes get the instances' tags.
    (fleet,) = [p for p in seen.sent if p.get("Action") == "CreateFleet"]
    specs: dict[str, dict[str, str]] = {}
    for key, value in fleet.items():
        if key.startswith("TagSpecification.") and key.endswith(".ResourceType"):
            specs[value] = {}
            prefix = key[: -len("ResourceType")]
            for n in range(1, 100):
                tag_key = fleet.get(f"{prefix}Tag.{n}.Key")
                if tag_key is None:
                    break
                specs[value][tag_key] = fleet[f"{prefix}Tag.{n}.Value"]
    assert set(specs) == {"instance", "volume"}
    assert specs["volume"] == specs["instance"]
    assert specs["volume"]["heteroplane:request-id"] == "r-1"
    assert specs["volume"]["heteroplane:app"] == "recs"
    assert specs["volume"]["heteroplane:managed"] == "true"


def test_tag_prefix_renames_our_keys_on_aws_only(ec2_network: Ec2Network) -> None:
    provisioner = Ec2Provisioner(config(ec2_network, tag_prefix="hp-staging"))
    (instance,) = provisioner.launch(LaunchRequest("r-1", "t3.large", 1, {APP_TAG: "recs"}))
    assert instance.tags[APP_TAG] == "recs"
    assert raw_instances(**{"tag:hp-staging:app": "recs"})
    assert not raw_instances(**{"tag:heteroplane:app": "recs"})
    # Another deployment's provisioner does not see it.
    assert Ec2Provisioner(config(ec2_network)).list({}) == []


def test_service_settings_build_it_from_the_flat_environment(
    ec2_network: Ec2Network, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.provisioning import build_provisioner
    from controlplane.settings import load_settings

    monkeypatch.setenv("HETEROPLANE_PROVISIONER", "ec2")
    monkeypatch.setenv("HETEROPLANE_EC2_REGION", REGION)
    monkeypatch.setenv("HETEROPLANE_EC2_SUBNET_IDS", ",".join(reversed(ec2_network.subnet_ids)))
    monkeypatch.setenv("HETEROPLANE_EC2_SECURITY_GROUP_IDS", ec2_network.security_group_id)
    monkeypatch.setenv("HETEROPLANE_EC2_AMI_ID", ec2_network.ami_id)
    provisioner = build_provisioner(load_settings())
    assert provisioner.name == "ec2"
    (instance,) = provisioner.launch(LaunchRequest("r-1", "t3.large", 1, {}))
    assert instance.zone == "us-east-1b"  # the first subnet given
