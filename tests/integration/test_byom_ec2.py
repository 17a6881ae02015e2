"""A model a user brings, served on the EC2 provisioner against a real moto server, up to the
launch (issue 18's acceptance): the whole service (``build_service`` with ``provisioner: ec2`` and
the model bucket) and its API (a TestClient, no lifespan: the reconciler is run by hand).

An ONNX model is pushed through ``POST /v1/models/wine`` and the registry stores it in the moto
S3 bucket under ``models/``; an app of it is registered (its version pinned), planned and
applied through the API; one reconciler pass launches the plan's instance from terraform's
worker launch template. The instance's user data (read back with DescribeInstanceAttribute)
starts the worker agent with the artifact's s3 URI and sha256, and what that URI names
downloads from the bucket and verifies (``provisioners.fetch.fetch_artifact``), as the worker
would at boot.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from controlplane.apps.resolver import spec_document
from controlplane.service.build import Service, build_service
from controlplane.settings import Ec2Settings, Settings
from estimator.profiles import LatencyProfile, write_profiles_json
from provisioners.artifacts import ArtifactRef
from provisioners.base import APP_TAG
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
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi.testclient")
from fastapi.testclient import TestClient  # noqa: E402

BUCKET = "heteroplane-models-byom"
TYPE = "t3.large"
APP = "wine"


def _onnx_model() -> bytes:
    """A 13-feature, 3-class linear classifier as ONNX (MatMul + Add), batch axis dynamic."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.normal(size=(13, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.normal(size=(3,)).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
        ],
        "wine",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 13])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [weights, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    buffer = io.BytesIO()
    onnx.save(model, buffer)
    return buffer.getvalue()


@pytest.fixture
def service(aws_env: str, ec2_network: Ec2Network, tmp_path: Path) -> Iterator[Service]:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    ec2 = boto3.client("ec2", region_name=REGION)
    template = ec2.create_launch_template(
        LaunchTemplateName=f"heteroplane-{TYPE}",
        LaunchTemplateData={
            "ImageId": ec2_network.ami_id,
            "InstanceType": TYPE,
            "UserData": base64.b64encode(
                render_worker_template(TYPE, model_bucket=BUCKET).encode()
            ).decode(),
        },
    )["LaunchTemplate"]["LaunchTemplateId"]
    settings = Settings(
        data_dir=tmp_path / "data",
        provisioner="ec2",
        ec2=Ec2Settings(
            region=REGION,
            subnet_ids=list(ec2_network.subnet_ids),
            security_group_ids=[ec2_network.security_group_id],
            launch_templates={TYPE: template},
            model_bucket=BUCKET,
        ),
    )
    built = build_service(settings)
    try:
        yield built
    finally:
        built.close()


def test_an_app_of_a_pushed_model_launches_ec2_workers_that_fetch_it_from_s3(
    service: Service, tmp_path: Path
) -> None:
    token = service.store.create_token("admin", name="operator")
    client = TestClient(service.app)
    client.headers["Authorization"] = f"Bearer {token}"

    data = _onnx_model()
    pushed = client.post(
        "/v1/models/wine",
        params={"format": "onnx"},
        content=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    assert pushed.status_code == 201, pushed.text
    record: dict[str, Any] = pushed.json()
    assert record["uri"].startswith(f"s3://{BUCKET}/models/wine/1/")
    assert record["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 13]}]

    profiles = tmp_path / "data" / "wine-profiles.json"  # specs name files in the data dir
    write_profiles_json(
        [LatencyProfile("wine", TYPE, np.array([1, 2]), (np.full(8, 5.0), np.full(8, 6.0)))],
        profiles,
        source="tests/integration/test_byom_ec2.py",
    )
    spec = {
        "name": APP,
        "models": [{"name": "wine", "artifact": "wine", "profiles": str(profiles)}],
        "slo": {"latency_ms": 200},
        "budget_usd_per_hr": 1.0,
        "instance_types": [TYPE],
    }
    registered = client.post("/v1/apps", json=spec)
    assert registered.status_code == 201, registered.text
    assert registered.json()["spec"]["models"][0]["artifact"] == "wine@1"

    plan = client.post(f"/v1/apps/{APP}/plans", json={"rate_qps": 10})
    assert plan.status_code == 201, plan.text
    assert plan.json()["feasible"]
    applied = client.post(f"/v1/apps/{APP}/plans/{plan.json()['id']}/apply")
    assert applied.status_code == 200, applied.text

    service.reconciler.run_once()
    launched = service.provisioner.list({APP_TAG: APP})
    assert launched, "the reconciler launched nothing"

    ref = ArtifactRef("wine", "wine", 1, "onnx", record["sha256"], record["uri"])
    ec2 = boto3.client("ec2", region_name=REGION)
    for instance in launched:
        attribute = ec2.describe_instance_attribute(
            InstanceId=instance.provider_id, Attribute="userData"
        )
        script = base64.b64decode(attribute["UserData"]["Value"]).decode()
        written = [row for row in script.splitlines() if row.startswith("--artifact")]
        assert f"--artifact {ref.to_arg()}" in written
        (line,) = [row for row in script.splitlines() if row.startswith("ExecStart=")]
        assert "-m provisioners.worker" in line

    fetched = fetch_artifact(ref, tmp_path / "worker-cache")
    assert fetched.read_bytes() == data


def test_a_profile_run_on_ec2_launches_artifact_workers_within_the_budget_and_stops_them(
    service: Service, tmp_path: Path
) -> None:
    """``profile run`` on EC2: the profiling workers are real instances (here moto's, which
    never answer), launched with the artifact in their user data and terminated when the run
    fails; a budget that cannot carry them refuses the run before anything launches."""
    from controlplane.apps.profile_run import PROFILE_RUN_TAG, ProfileRunRequest, run_profile
    from controlplane.apps.profiler import ProfilingError
    from controlplane.errors import ProfilingBudgetError

    services = service.app.state.services
    record = services.registry.push("wine", _write(tmp_path, _onnx_model()))
    spec = {
        "name": APP,
        "models": [{"name": "wine", "artifact": "wine"}],
        "slo": {"latency_ms": 200},
        "budget_usd_per_hr": 1.0,
        "instance_types": [TYPE],
    }
    service.store.create_app(spec_document(services.resolver.check(spec).spec), who="test")
    request = ProfileRunRequest(types=None, batch_sizes=(1, 2), samples=2, warmup=0)

    def run() -> Any:
        return run_profile(
            service.store,
            services.resolver,
            service.provisioner,
            services.clock,
            APP,
            request,
            who="test",
            worker_port=8080,
            start_timeout_s=1.0,
        )

    with pytest.raises(ProfilingError):
        run()
    ref = ArtifactRef("wine", "wine", 1, "onnx", record.sha256, record.uri)
    ec2 = boto3.client("ec2", region_name=REGION)
    launched = service.provisioner.list({PROFILE_RUN_TAG: APP})
    assert launched, "the profile run launched no worker"
    for instance in launched:
        assert instance.state in ("shutting-down", "terminated"), instance
        attribute = ec2.describe_instance_attribute(
            InstanceId=instance.provider_id, Attribute="userData"
        )
        script = base64.b64decode(attribute["UserData"]["Value"]).decode()
        assert f"--artifact {ref.to_arg()}" in script

    service.store.change_budget(APP, 0.01, who="test", reason="too small for a worker")
    before = len(service.provisioner.list({PROFILE_RUN_TAG: APP}))
    with pytest.raises(ProfilingBudgetError):
        run()
    assert len(service.provisioner.list({PROFILE_RUN_TAG: APP})) == before


def _write(folder: Path, data: bytes) -> Path:
    path = folder / "wine.onnx"
    path.write_bytes(data)
    return path
