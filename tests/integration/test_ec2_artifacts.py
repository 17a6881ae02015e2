"""Workers on EC2 that serve models a user brings, against a real moto server (EC2 and S3 on one
port, boto3 over HTTP): an artifact in the model bucket under ``models/<name>/<version>/``, a
launch template carrying terraform's worker user data, and :class:`~provisioners.ec2.
Ec2Provisioner` launching a :class:`~provisioners.base.LaunchRequest` with the artifact. The
instance's user data (read back with DescribeInstanceAttribute) hands the agent the artifact's
s3 URI and sha256 (the provider's bootstrap, then terraform's script as it is);
:func:`~provisioners.fetch.fetch_artifact` downloads it from moto's S3 and verifies it, and
refuses it once the object is changed. Too much user data is refused with one line, and nothing
is launched.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from provisioners.artifacts import ArtifactError, ArtifactRef
from provisioners.base import APP_TAG, MANAGED_TAG, REQUEST_TAG, LaunchRequest
from provisioners.errors import InvalidConfigurationError
from provisioners.fetch import fetch_artifact
from tests.integration.moto_server import (
    REGION,
    Ec2Network,
    aws_env,
    ec2_network,
    moto_server,
    needs_moto,
)
from tests.worker_template import render_worker_template

__all__ = ["aws_env", "ec2_network", "moto_server"]  # fixtures, imported for pytest

pytestmark = needs_moto

boto3 = pytest.importorskip("boto3")

from provisioners.ec2 import (  # noqa: E402
    ARTIFACTS_OPTION,
    Ec2Config,
    Ec2Provisioner,
    worker_user_data,
)

BUCKET = "heteroplane-models-0123"
TYPE = "t3.large"
# Not a real ONNX file: the worker loads it, fetch_artifact only checks its bytes.
MODEL_BYTES = b"an onnx model, as far as the sha256 goes\n" * 100


def put_artifact(s3: Any, name: str = "wine", version: int = 1) -> ArtifactRef:
    """``MODEL_BYTES`` in the bucket where the registry keeps ``name`` v``version``."""
    sha256 = hashlib.sha256(MODEL_BYTES).hexdigest()
    key = f"models/{name}/{version}/{sha256}.onnx"
    s3.put_object(Bucket=BUCKET, Key=key, Body=MODEL_BYTES)
    return ArtifactRef(name, name, version, "onnx", sha256, f"s3://{BUCKET}/{key}")


@pytest.fixture
def s3(aws_env: str) -> Any:
    client = boto3.client("s3", region_name=REGION)
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.fixture
def worker_template(ec2_network: Ec2Network) -> str:
    """A launch template for ``TYPE`` as terraform makes it (the worker's user data, the managed
    tag); its id."""
    ec2 = boto3.client("ec2", region_name=REGION)
    user_data = render_worker_template(TYPE, model_bucket=BUCKET)
    created = ec2.create_launch_template(
        LaunchTemplateName=f"heteroplane-{TYPE}",
        LaunchTemplateData={
            "ImageId": ec2_network.ami_id,
            "InstanceType": TYPE,
            "UserData": base64.b64encode(user_data.encode()).decode(),
        },
        TagSpecifications=[
            {"ResourceType": "launch-template", "Tags": [{"Key": MANAGED_TAG, "Value": "true"}]}
        ],
    )
    return str(created["LaunchTemplate"]["LaunchTemplateId"])


def provisioner(network: Ec2Network, templates: dict[str, str], **changes: Any) -> Ec2Provisioner:
    values: dict[str, Any] = {
        "region": REGION,
        "subnet_ids": network.subnet_ids,
        "security_group_ids": (network.security_group_id,),
        "launch_templates": templates,
        "ami_id": None,
    }
    values.update(changes)
    return Ec2Provisioner(Ec2Config(**values))


def request(request_id: str, artifacts: tuple[ArtifactRef, ...], count: int = 1) -> LaunchRequest:
    return LaunchRequest(request_id, TYPE, count, {APP_TAG: "wine-app"}, artifacts)


def user_data_of(instance_id: str) -> str:
    ec2 = boto3.client("ec2", region_name=REGION)
    attribute = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(attribute["UserData"]["Value"]).decode()


def agent_line(script: str) -> str:
    (line,) = [row for row in script.splitlines() if row.startswith("ExecStart=")]
    return line


def artifact_lines(script: str) -> list[str]:
    """The agent's artifact options the provider's bootstrap writes (one a line)."""
    return [row for row in script.splitlines() if row.startswith("--artifact")]


def test_a_worker_serving_an_artifact_gets_it_in_its_user_data(
    ec2_network: Ec2Network, s3: Any, worker_template: str, tmp_path: Path
) -> None:
    ref = put_artifact(s3)
    ec2p = provisioner(ec2_network, {TYPE: worker_template})
    (instance,) = ec2p.launch(request("r-wine", (ref,)))

    script = user_data_of(instance.provider_id)
    assert artifact_lines(script) == [f"--artifact {ref.to_arg()}"]
    assert f"s3://{BUCKET}/models/wine/1/{ref.sha256}.onnx" in artifact_lines(script)[0]
    # The rest is terraform's template as it is, its agent reading the artifacts' file.
    template = render_worker_template(TYPE, model_bucket=BUCKET)
    assert script == worker_user_data(template, [ref])
    assert script.endswith(template)
    line = agent_line(script)
    assert "python -m provisioners.worker --host 0.0.0.0 --port 8080 --instance-type" in line
    assert ARTIFACTS_OPTION in line

    # What the worker does with it: download from the bucket, check the sha256.
    fetched = fetch_artifact(ref, tmp_path / "cache", s3_client=s3)
    assert fetched.read_bytes() == MODEL_BYTES

    # Idempotent by request id: the same request launches nothing more.
    assert [i.provider_id for i in ec2p.launch(request("r-wine", (ref,)))] == [instance.provider_id]


def test_a_changed_object_is_refused_by_the_worker(
    ec2_network: Ec2Network, s3: Any, tmp_path: Path
) -> None:
    ref = put_artifact(s3)
    key = ref.uri.removeprefix(f"s3://{BUCKET}/")
    s3.put_object(Bucket=BUCKET, Key=key, Body=MODEL_BYTES[:-1] + b"!")
    with pytest.raises(ArtifactError) as caught:
        fetch_artifact(ref, tmp_path / "cache", s3_client=s3)
    assert "sha256" in str(caught.value) and "\n" not in str(caught.value)
    missing = ArtifactRef("gone", "gone", 1, "onnx", ref.sha256, f"s3://{BUCKET}/models/gone/1/x")
    with pytest.raises(ArtifactError, match="cannot download"):
        fetch_artifact(missing, tmp_path / "cache", s3_client=s3)


def test_without_artifacts_the_template_user_data_is_left_alone(
    ec2_network: Ec2Network, s3: Any, worker_template: str
) -> None:
    ec2p = provisioner(ec2_network, {TYPE: worker_template})
    (instance,) = ec2p.launch(request("r-family", ()))
    script = user_data_of(instance.provider_id)
    assert script == render_worker_template(TYPE, model_bucket=BUCKET)
    assert artifact_lines(script) == []


def test_spot_launches_artifact_workers_on_demand(
    ec2_network: Ec2Network, s3: Any, worker_template: str
) -> None:
    ref = put_artifact(s3)
    ec2p = provisioner(ec2_network, {TYPE: worker_template}, spot=True)
    launched = ec2p.launch(request("r-spot", (ref,), count=2))
    assert len(launched) == 2
    for instance in launched:
        assert artifact_lines(user_data_of(instance.provider_id)) == [f"--artifact {ref.to_arg()}"]
    ec2 = boto3.client("ec2", region_name=REGION)
    raws = ec2.describe_instances(InstanceIds=[i.provider_id for i in launched])
    markets = {
        raw.get("InstanceLifecycle", "on-demand")
        for r in raws["Reservations"]
        for raw in r["Instances"]
    }
    assert markets == {"on-demand"}
    events = ec2p.poll_events()
    assert any(e.kind == "info" and "on demand" in e.message for e in events), events


def test_user_data_over_16_kb_is_refused_and_nothing_launches(
    ec2_network: Ec2Network, s3: Any, worker_template: str
) -> None:
    ref = put_artifact(s3)
    long_uri = f"s3://{BUCKET}/models/" + "x" * 900 + f"/{ref.sha256}.onnx"
    many = tuple(ArtifactRef(f"m{i}", "wine", 1, "onnx", ref.sha256, long_uri) for i in range(20))
    ec2p = provisioner(ec2_network, {TYPE: worker_template})
    with pytest.raises(InvalidConfigurationError) as caught:
        ec2p.launch(request("r-big", many))
    assert caught.value.field == "artifacts"
    assert "16 KB" in str(caught.value) and "\n" not in str(caught.value)
    assert ec2p.list({REQUEST_TAG: "r-big"}) == []


def test_a_template_without_the_worker_user_data_cannot_serve_artifacts(
    ec2_network: Ec2Network, s3: Any
) -> None:
    ref = put_artifact(s3)
    made = provisioner(ec2_network, {}, ami_id=ec2_network.ami_id).ensure_launch_templates([TYPE])
    for ec2p in (
        provisioner(ec2_network, made),  # the development path's template: no user data
        provisioner(ec2_network, {}, ami_id=ec2_network.ami_id),  # no template at all
    ):
        with pytest.raises(InvalidConfigurationError) as caught:
            ec2p.launch(request("r-dev", (ref,)))
        assert caught.value.field == "launch_templates"
        assert "\n" not in str(caught.value)
    assert provisioner(ec2_network, made).list({REQUEST_TAG: "r-dev"}) == []


def test_an_artifact_stored_by_the_registry_reaches_the_worker(
    ec2_network: Ec2Network, s3: Any, worker_template: str, tmp_path: Path
) -> None:
    from provisioners.storage import S3ArtifactStorage

    source = tmp_path / "wine.onnx"
    source.write_bytes(MODEL_BYTES)
    sha256 = hashlib.sha256(MODEL_BYTES).hexdigest()
    storage = S3ArtifactStorage(BUCKET, "models/", client=s3)
    uri = storage.put(source, f"wine/2/{sha256}.onnx")
    assert uri.startswith(f"s3://{BUCKET}/models/")
    ref = ArtifactRef("wine", "wine", 2, "onnx", sha256, uri)

    (instance,) = provisioner(ec2_network, {TYPE: worker_template}).launch(
        request("r-registry", (ref,))
    )
    assert artifact_lines(user_data_of(instance.provider_id)) == [f"--artifact {ref.to_arg()}"]
    assert fetch_artifact(ref, tmp_path / "cache", s3_client=s3).read_bytes() == MODEL_BYTES
