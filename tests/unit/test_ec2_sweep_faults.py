"""The EC2 provisioner under the faults of a sweep against a moto server: terminations while
``DescribeInstances`` is throttled, a request the reconciler tagged on demand with the
deployment-wide ``spot`` on, a hung endpoint, and a spot price read that answers nothing.

Real boto3 against moto's in-process mock (``mock_aws``); faults are injected through botocore's
``before-send`` hook on the session the provisioner is given, never by patching the provisioner.
The hung endpoint is a local socket that accepts connections and never answers.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")
from botocore.awsrequest import AWSResponse  # noqa: E402

from provisioners.base import LaunchRequest  # noqa: E402
from provisioners.ec2 import Ec2Config, Ec2Provisioner  # noqa: E402
from provisioners.errors import ProvisionerError  # noqa: E402
from provisioners.interruptions import MARKET_TAG  # noqa: E402

REGION = "us-east-1"
AMI = "ami-12c6146b"  # one of moto's stock images


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Any:
        yield self._data


class Answer:
    """A ``before-send`` hook, registered first (ahead of moto's own): counts the calls and,
    while ``body`` is set, answers them with it instead of moto."""

    def __init__(self, status: int = 503, body: str | None = None) -> None:
        self.status = status
        self.body = body
        self.calls = 0

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        self.calls += 1
        if self.body is None:
            return None
        headers = {"Content-Type": "text/xml;charset=UTF-8"}
        return AWSResponse(request.url, self.status, headers, _Body(self.body.encode()))


THROTTLED = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
    "<Code>RequestLimitExceeded</Code><Message>Request limit exceeded.</Message>"
    "</Error></Errors><RequestID>injected</RequestID></Response>"
)
NO_SPOT_PRICES = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotPriceHistoryResponse'
    ' xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>injected</requestId>'
    "<spotPriceHistorySet/><nextToken/></DescribeSpotPriceHistoryResponse>"
)


def session_answering(event: str, hook: Answer) -> Any:
    session = boto3.Session()
    session.events.register_first(event, hook)
    return session


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """boto3 with dummy credentials and no user files, answered by moto in process."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    with moto.mock_aws():
        yield


@pytest.fixture
def subnet_id(aws: None) -> str:
    ec2: Any = boto3.client("ec2", region_name=REGION)
    vpc_id = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc_id, CidrBlock="10.0.1.0/24", AvailabilityZone="us-east-1a")
    return str(subnet["Subnet"]["SubnetId"])


def states(*provider_ids: str) -> dict[str, str]:
    ec2: Any = boto3.client("ec2", region_name=REGION)
    found = ec2.describe_instances(InstanceIds=list(provider_ids))["Reservations"]
    return {i["InstanceId"]: i["State"]["Name"] for r in found for i in r["Instances"]}


def answered_lookups(subnet_id: str, answer: Answer) -> Ec2Provisioner:
    """A provisioner in ``subnet_id`` whose DescribeInstances ``answer`` answers, one try."""
    return Ec2Provisioner(
        Ec2Config(REGION, (subnet_id,), ami_id=AMI, max_attempts=1),
        session_answering("before-send.ec2.DescribeInstances", answer),
    )


def run_one_instance() -> str:
    """An instance run straight through boto3 (moto): its id."""
    ec2: Any = boto3.client("ec2", region_name=REGION)
    raw = ec2.run_instances(ImageId=AMI, InstanceType="t3.large", MinCount=1, MaxCount=1)
    return str(raw["Instances"][0]["InstanceId"])


def test_a_budget_cut_terminates_while_describe_instances_is_throttled(subnet_id: str) -> None:
    """A throttled lookup used to fail the termination ("terminate failed (throttled:
    DescribeInstances ...)"): the instances ran on until the throttle ended."""
    throttle = Answer()
    provisioner = answered_lookups(subnet_id, throttle)
    launched = provisioner.launch(LaunchRequest("r-1", "t3.large", 2, {}))
    ids = [i.provider_id for i in launched]
    throttle.body = THROTTLED
    provisioner.terminate(ids)
    assert set(states(*ids).values()) <= {"shutting-down", "terminated"}
    kinds = {e.kind: e.message for e in provisioner.poll_events()}
    assert "DescribeInstances" in kinds["throttled"]  # the lookup was throttled indeed
    assert "by id" in kinds["info"]


def test_a_lookup_that_fails_for_good_still_fails_the_terminate(subnet_id: str) -> None:
    """Only a lookup that may pass is skipped: no permission to look is no licence to act."""
    refused = Answer(
        status=403, body=THROTTLED.replace("RequestLimitExceeded", "UnauthorizedOperation")
    )
    provisioner = answered_lookups(subnet_id, refused)
    pid = run_one_instance()
    with pytest.raises(ProvisionerError, match="UnauthorizedOperation"):
        provisioner.terminate([pid])
    assert states(pid)[pid] == "running"


def test_terminating_by_id_skips_an_id_ec2_does_not_know(subnet_id: str) -> None:
    provisioner = answered_lookups(subnet_id, Answer(body=THROTTLED))
    ours = run_one_instance()
    provisioner.terminate(["i-0000000000000dead", ours])
    assert states(ours)[ours] in {"shutting-down", "terminated"}


def test_a_request_tagged_on_demand_runs_on_demand_with_the_deployment_on_spot(
    subnet_id: str,
) -> None:
    """The deployment-wide ``spot`` put an app's on-demand base on spot, voiding its
    survive_share; untagged requests keep going to spot first."""
    templates = Ec2Provisioner(Ec2Config(REGION, (subnet_id,), ami_id=AMI)).ensure_launch_templates(
        ["m5.large"]
    )
    provisioner = Ec2Provisioner(
        Ec2Config(REGION, (subnet_id,), ami_id=AMI, spot=True, launch_templates=templates)
    )
    base = provisioner.launch(LaunchRequest("r-base", "m5.large", 2, {MARKET_TAG: "on-demand"}))
    saving = provisioner.launch(LaunchRequest("r-saving", "m5.large", 1, {}))
    ec2: Any = boto3.client("ec2", region_name=REGION)
    found = ec2.describe_instances()["Reservations"]
    lifecycle = {i["InstanceId"]: i.get("InstanceLifecycle") for r in found for i in r["Instances"]}
    assert [lifecycle[i.provider_id] for i in base] == [None, None]
    assert [i.market for i in base] == ["on-demand", "on-demand"]
    assert [lifecycle[i.provider_id] for i in saving] == ["spot"]


def test_a_hung_endpoint_fails_the_call_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A server that accepts the connection and never answers: the call ends with a
    ProvisionerError naming the timeout, after two tries (botocore's default: a 60 s read
    timeout, retried up to max_attempts times)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    sends = Answer()  # counts the tries, answers none
    session = boto3.Session()
    session.events.register("before-send", sends)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # the kernel completes the handshake; nothing ever reads or answers
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        config = Ec2Config(
            REGION,
            ("subnet-1",),
            ami_id=AMI,
            endpoint_url=url,
            max_attempts=5,
            read_timeout_s=0.2,
            interruption_queue_url=f"{url}/123456789012/q",
        )
        provisioner = Ec2Provisioner(config, session)
        with pytest.raises(ProvisionerError) as caught:
            provisioner.list({})
        assert caught.value.retryable
        assert str(caught.value).startswith("DescribeInstances: the endpoint did not answer")
        assert "Read timeout" in str(caught.value)
        assert sends.calls == 2
        with pytest.raises(ProvisionerError, match=r"ReceiveMessage: .*[Rr]ead timeout"):
            provisioner.poll_interruptions()
        assert sends.calls == 4


def test_both_clients_carry_the_configured_timeouts(aws: None) -> None:
    config = Ec2Config(
        REGION, ("subnet-1",), ami_id=AMI, interruption_queue_url="https://sqs/1/q", max_attempts=3
    )
    provisioner = Ec2Provisioner(config)
    assert provisioner._interruptions is not None
    for client in (provisioner._client, provisioner._interruptions.sqs):
        settings = client.meta.config
        assert (settings.connect_timeout, settings.read_timeout) == (3.0, 10.0)
        assert settings.retries["total_max_attempts"] == 3


@pytest.mark.parametrize("field", ["connect_timeout_s", "read_timeout_s"])
def test_timeouts_must_be_positive(field: str) -> None:
    from provisioners.errors import InvalidConfigurationError

    with pytest.raises(InvalidConfigurationError) as caught:
        Ec2Config(REGION, ("subnet-1",), ami_id=AMI, **{field: 0.0})  # type: ignore[arg-type]
    assert caught.value.field == field


def test_an_empty_spot_price_answer_is_cached_for_the_ttl_and_said_once(aws: None) -> None:
    """DescribeSpotPriceHistory with nothing for a type: the answer (no price) is kept for
    ``spot_price_ttl_s`` as any other, and a capacity event says so once per read."""
    prices = Answer(status=200, body=NO_SPOT_PRICES)
    now_s = [0.0]
    provisioner = Ec2Provisioner(
        Ec2Config(REGION, ("subnet-1",), ami_id=AMI, spot_price_ttl_s=10.0),
        session_answering("before-send.ec2.DescribeSpotPriceHistory", prices),
        clock=lambda: now_s[0],
    )
    for now_s[0] in (0.0, 4.0, 9.0):
        assert provisioner.spot_price("r5n.large") is None
    assert prices.calls == 1
    (event,) = provisioner.poll_events()
    assert event.kind == "capacity" and event.instance_type == "r5n.large"
    assert "no spot price for r5n.large" in event.message
    now_s[0] = 10.5
    assert provisioner.spot_price("r5n.large") is None
    assert prices.calls == 2


def test_a_failed_spot_price_read_is_not_asked_again_for_a_while(aws: None) -> None:
    """A DescribeSpotPriceHistory the role may not call (403) was asked again on every tick,
    twice a tick (31 calls and 31 warnings in 30 s, a tester's sweep): a failed read raises its
    error again without a call until FAILED_READ_RETRY_S has passed."""
    from provisioners.errors import ProvisionerError
    from provisioners.spot import FAILED_READ_RETRY_S

    refused = Answer(
        status=403,
        body=THROTTLED.replace("RequestLimitExceeded", "UnauthorizedOperation").replace(
            "Request limit exceeded.", "You are not authorized to perform this operation."
        ),
    )
    now_s = [0.0]
    provisioner = Ec2Provisioner(
        Ec2Config(REGION, ("subnet-1",), ami_id=AMI),
        session_answering("before-send.ec2.DescribeSpotPriceHistory", refused),
        clock=lambda: now_s[0],
    )
    for now_s[0] in (0.0, 1.0, FAILED_READ_RETRY_S - 1.0):
        with pytest.raises(ProvisionerError, match="not authorized"):
            provisioner.spot_price("r5n.large")
    assert refused.calls == 1
    now_s[0] = FAILED_READ_RETRY_S + 1.0
    refused.body = None  # allowed now: moto answers
    assert provisioner.spot_price("r5n.large") is not None
    assert refused.calls == 2
