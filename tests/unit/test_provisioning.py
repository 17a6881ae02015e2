"""The provisioner factory: settings in, a configured provisioner out; a provider nobody wrote
yet is its module, one factory line and its settings block (docs/design.md, "Adding a provider")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from controlplane.clock import FakeClock
from controlplane.db import migrate
from controlplane.db.store import Store
from controlplane.errors import SettingsError
from controlplane.provisioning import FACTORIES, build_provisioner, ec2_config_from
from controlplane.registry import registry_from_settings
from controlplane.service.build import launchable_types
from controlplane.settings import Ec2Settings, Settings
from provisioners.base import (
    REQUEST_TAG,
    LaunchRequest,
    ProvisionedInstance,
    Provisioner,
    ProvisionerEvent,
    launch_refusal,
    launch_tags,
    tags_match,
)
from provisioners.fake import FakeProvisioner
from provisioners.storage import ArtifactStorage, LocalArtifactStorage

EC2 = Ec2Settings(
    region="us-east-1",
    subnet_ids=["subnet-a", "subnet-b"],
    security_group_ids=["sg-1"],
    launch_templates={"g4dn.xlarge": "lt-1"},
    spot=True,
    unavailable_ttl_s=60,
    max_attempts=3,
    connect_timeout_s=2,
    read_timeout_s=7,
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
    assert (config.connect_timeout_s, config.read_timeout_s) == (2, 7)


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


# --- a provider nobody wrote yet: its module, one factory line, its settings block ------------


class ThrowawaySettings(BaseModel):
    """The new provider's settings block."""

    types: list[str]


class SettingsWithThrowaway(Settings):
    """The service's settings with the new provider's block (in settings.py, for a real one)."""

    provisioner: Literal["local", "ec2", "fake", "throwaway"] = "local"
    throwaway: ThrowawaySettings | None = None


class ThrowawayProvisioner:
    """The new provider's module: the protocol, in memory."""

    name = "throwaway"

    def __init__(self, types: list[str]) -> None:
        self.types = frozenset(types)
        self.instances: dict[str, ProvisionedInstance] = {}
        self.closed = False

    def launch(self, request: LaunchRequest) -> list[ProvisionedInstance]:
        for number in range(request.count):
            provider_id = f"tw-{request.request_id}-{number}"
            self.instances[provider_id] = ProvisionedInstance(
                provider_id, request.instance_type, "running", launch_tags(request)
            )
        return self.list({REQUEST_TAG: request.request_id})

    def terminate(self, provider_ids: Sequence[str]) -> None:
        for provider_id in provider_ids:
            self.instances.pop(provider_id, None)

    def poll_events(self) -> list[ProvisionerEvent]:
        return []

    def instance_types(self) -> frozenset[str]:
        return self.types

    def launch_refusal(self, instance_type: str) -> str | None:
        return launch_refusal(self.name, self.types, instance_type)

    def artifact_storage(self, root: Path) -> ArtifactStorage:
        return LocalArtifactStorage(root / "throwaway")

    def close(self) -> None:
        self.closed = True

    def list(self, tags: Mapping[str, str]) -> list[ProvisionedInstance]:
        return [i for i in self.instances.values() if tags_match(i.tags, tags)]


def test_a_new_provider_is_built_from_settings_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The one factory line.
    monkeypatch.setitem(
        FACTORIES,
        "throwaway",
        lambda settings: ThrowawayProvisioner(settings.throwaway.types),
    )
    settings = SettingsWithThrowaway(
        data_dir=tmp_path, provisioner="throwaway", throwaway={"types": ["tw.small"]}
    )
    provisioner = build_provisioner(settings)
    assert isinstance(provisioner, ThrowawayProvisioner) and isinstance(provisioner, Provisioner)

    # What the service asks of it: which types it launches, where artifacts go, closing.
    launchable = launchable_types(provisioner)
    assert launchable("tw.small") is None
    assert launchable("g4dn.xlarge") == (
        "the throwaway provisioner cannot launch g4dn.xlarge (it launches tw.small)"
    )
    (instance,) = provisioner.launch(LaunchRequest("r-1", "tw.small", 1, {}))
    assert provisioner.list({}) == [instance]

    url = f"sqlite:///{tmp_path / 'heteroplane.db'}"
    migrate.upgrade(url)
    store = Store.from_url(url, FakeClock())
    try:
        registry = registry_from_settings(settings, store)
    finally:
        store.close()
    assert isinstance(registry.storage, LocalArtifactStorage)
    assert registry.storage.root == (tmp_path / "registry" / "throwaway").resolve()
