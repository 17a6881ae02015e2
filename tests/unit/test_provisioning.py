"""The provisioner factory: settings in, a configured provisioner out."""

from __future__ import annotations

import pytest

from controlplane.errors import SettingsError
from controlplane.service.provisioning import FACTORIES, build_provisioner, ec2_config_from
from controlplane.settings import Ec2Settings, Settings
from provisioners.base import LaunchRequest, Provisioner
from provisioners.fake import FakeProvisioner

EC2 = Ec2Settings(
    region="us-east-1",
    subnet_ids=["subnet-a", "subnet-b"],
    security_group_ids=["sg-1"],
    launch_templates={"g4dn.xlarge": "lt-1"},
    spot=True,
    unavailable_ttl_s=60,
    max_attempts=3,
)


def test_fake_runs_instances_at_once() -> None:
    provisioner = build_provisioner(Settings(provisioner="fake"))
    assert isinstance(provisioner, FakeProvisioner)
    assert isinstance(provisioner, Provisioner)
    (instance,) = provisioner.launch(LaunchRequest("r-1", "t3.large", 1, {}))
    assert instance.state == "running"


def test_ec2_config_from_settings() -> None:
    config = ec2_config_from(EC2)
    assert config.region == "us-east-1"
    assert config.subnet_ids == ("subnet-a", "subnet-b")
    assert config.security_group_ids == ("sg-1",)
    assert dict(config.launch_templates) == {"g4dn.xlarge": "lt-1"}
    assert (config.spot, config.unavailable_ttl_s, config.max_attempts) == (True, 60, 3)
    assert config.ami_id is None and config.endpoint_url is None
    assert config.tag_prefix == "heteroplane"


def test_ec2_is_built_without_touching_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    provisioner = build_provisioner(Settings(provisioner="ec2", ec2=EC2))
    assert provisioner.name == "ec2"
    assert isinstance(provisioner, Provisioner)


def test_a_provisioner_without_a_factory_is_a_settings_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(FACTORIES, "fake")
    with pytest.raises(SettingsError, match="provisioner: no provisioner 'fake'"):
        build_provisioner(Settings(provisioner="fake"))
