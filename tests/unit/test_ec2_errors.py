"""The EC2 provisioner's classification of boto errors, its config checks and its client tokens
(no network: botocore's error objects are built by hand)."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from botocore.stub import Stubber

from provisioners.base import LaunchRequest
from provisioners.ec2 import (
    CAPACITY_ERROR_CODES,
    QUOTA_ERROR_CODES,
    THROTTLING_ERROR_CODES,
    Ec2Config,
    Ec2Provisioner,
    _client_token,
    map_client_error,
)
from provisioners.errors import (
    InsufficientCapacityError,
    InvalidConfigurationError,
    ProvisionerError,
    QuotaExceededError,
    ThrottledError,
    UnknownInstanceError,
)


def client_error(code: str, message: str = "it says so\nover two lines") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, "RunInstances")


@pytest.mark.parametrize("code", sorted(CAPACITY_ERROR_CODES))
def test_capacity_codes(code: str) -> None:
    error = map_client_error(client_error(code), instance_type="g4dn.xlarge", zone="us-east-1a")
    assert isinstance(error, InsufficientCapacityError)
    assert (error.instance_type, error.zone, error.code) == ("g4dn.xlarge", "us-east-1a", code)
    assert error.retryable
    assert "\n" not in str(error)
    assert str(error).startswith("insufficient capacity for g4dn.xlarge in us-east-1a: ")


@pytest.mark.parametrize("code", sorted(QUOTA_ERROR_CODES))
def test_quota_codes(code: str) -> None:
    error = map_client_error(client_error(code), instance_type="p4d.24xlarge")
    assert isinstance(error, QuotaExceededError)
    assert error.instance_type == "p4d.24xlarge"
    assert not error.retryable


@pytest.mark.parametrize("code", sorted(THROTTLING_ERROR_CODES))
def test_throttling_codes(code: str) -> None:
    error = map_client_error(client_error(code), operation="DescribeInstances")
    assert isinstance(error, ThrottledError)
    assert error.retryable
    assert "DescribeInstances" in str(error)


@pytest.mark.parametrize(
    ("code", "field"),
    [
        ("InvalidAMIID.NotFound", "ami_id"),
        ("InvalidAMIID.Malformed", "ami_id"),
        ("InvalidSubnetID.NotFound", "subnet_ids"),
        ("InvalidGroup.NotFound", "security_group_ids"),
        ("InvalidLaunchTemplateId.NotFound", "launch_templates"),
        ("InvalidLaunchTemplateName.NotFoundException", "launch_templates"),
        ("IdempotentParameterMismatch", "request_id"),
        ("UnauthorizedOperation", "credentials"),
        ("AuthFailure", "credentials"),
        ("InvalidParameterValue", "request"),
        ("InvalidParameterCombination", "request"),
        ("OptInRequired", "region"),
    ],
)
def test_configuration_codes(code: str, field: str) -> None:
    error = map_client_error(client_error(code), operation="RunInstances")
    assert isinstance(error, InvalidConfigurationError)
    assert error.field == field
    assert code in str(error)
    assert not error.retryable


def test_other_codes_are_the_root_class_retryable_when_the_service_failed() -> None:
    unavailable = map_client_error(client_error("ServiceUnavailable"))
    assert type(unavailable) is ProvisionerError and unavailable.retryable
    odd = map_client_error(client_error("SomethingNew"), operation="RunInstances")
    assert type(odd) is ProvisionerError and not odd.retryable
    assert str(odd).startswith("RunInstances: SomethingNew: ")


def test_errors_without_a_response() -> None:
    assert isinstance(map_client_error(NoCredentialsError()), InvalidConfigurationError)
    offline = map_client_error(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert type(offline) is ProvisionerError and offline.retryable
    ours = UnknownInstanceError("i-1")
    assert map_client_error(ours) is ours


def test_every_mapped_error_is_one_line_and_never_a_client_error() -> None:
    codes = [*CAPACITY_ERROR_CODES, *QUOTA_ERROR_CODES, *THROTTLING_ERROR_CODES, "X", "AuthFailure"]
    for code in codes:
        error = map_client_error(client_error(code))
        assert isinstance(error, ProvisionerError)
        assert not isinstance(error, ClientError)
        assert "\n" not in str(error)


def test_client_token_is_short_stable_and_distinct() -> None:
    long_id = "r-" + "x" * 200
    token = _client_token(long_id, "subnet-1", "on-demand")
    assert len(token) <= 64 and token.isascii()
    assert token == _client_token(long_id, "subnet-1", "on-demand")
    assert token != _client_token(long_id, "subnet-2", "on-demand")
    assert token != _client_token(long_id, "subnet-1", "spot")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"region": ""}, "region"),
        ({"subnet_ids": ()}, "subnet_ids"),
        ({"ami_id": None, "launch_templates": {}}, "launch_templates"),
        ({"tag_prefix": "a:b"}, "tag_prefix"),
        ({"unavailable_ttl_s": -1.0}, "unavailable_ttl_s"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_config_is_checked(changes: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"region": "us-east-1", "subnet_ids": ("s-1",), "ami_id": "ami-1"}
    values.update(changes)
    with pytest.raises(InvalidConfigurationError) as caught:
        Ec2Config(**values)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_launch_without_template_or_image_for_the_type_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No network: the idempotency lookup before the check is answered by botocore's Stubber.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    config = Ec2Config("us-east-1", ("subnet-1",), launch_templates={"t3.large": "lt-1"})
    provisioner = Ec2Provisioner(config)
    with Stubber(provisioner._client) as stub:
        stub.add_response("describe_instances", {"Reservations": []})
        with pytest.raises(InvalidConfigurationError, match=r"no launch template for c5\.xlarge"):
            provisioner.launch(LaunchRequest("r-1", "c5.xlarge", 1, {}))


def test_an_answer_that_is_not_ec2s_is_one_retryable_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTML error page where EC2's XML should be (a wrong region's endpoint, moto asked for
    a region it lacks): botocore's ResponseParserError is no BotoCoreError, and it escaped the
    provisioner with a traceback on every reconcile."""
    from botocore.parsers import ResponseParserError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    provisioner = Ec2Provisioner(Ec2Config("us-east-1", ("subnet-1",), ami_id="ami-1"))
    page = (
        "Unable to parse response, invalid XML received:\nb'<!doctype html>\\n<title>500</title>'"
    )

    def broken(*args: object, **kwargs: object) -> None:
        raise ResponseParserError(page)

    monkeypatch.setattr(provisioner._client, "get_paginator", broken)
    with pytest.raises(ProvisionerError) as caught:
        provisioner.list({"heteroplane:app": "a"})
    assert caught.value.retryable and "\n" not in str(caught.value)
    assert "not EC2's API (a wrong region or endpoint?)" in str(caught.value)
