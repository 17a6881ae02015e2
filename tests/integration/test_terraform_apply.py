"""The terraform module end to end, against a moto server on 127.0.0.1 (the static checks are in
tests/integration/test_terraform.py; two files, so that two test processes run them at once).

``terraform apply`` creates the network, the roles, the security groups, the launch templates,
the control-plane host and, with a certificate (one moto's ACM issues), the load balancer that
ends TLS in front of the API (the host has no public IP and admits the load balancer alone; the
role launches only the allowed instance types, with heteroplane's request tags); a second plan
shows no changes (and the admin token, once the host has stored it, is nowhere in terraform's
state); then the control plane's own provisioner and reconciler, configured from ``terraform
output``, apply a plan, and the workers come up from terraform's launch templates; they are
terminated by a smaller plan; ``terraform destroy`` leaves nothing behind.

Skipped, saying why, without terraform, the provider mirror, or moto.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.integration.moto_server import REGION, aws_env, moto_server, needs_moto
from tests.terraform_support import (
    Terraform,
    copy_module,
    require_terraform,
)

__all__ = ["aws_env", "moto_server"]  # fixtures, imported for pytest

WORKER_TYPES = ("t3.large", "c5.xlarge")
FLEET = {"t3.large": 2, "c5.xlarge": 1}
APP = "recs"
ALLOWED_CIDR = "203.0.113.0/24"
API_DOMAIN = "api.e2e.example.com"
TOKEN = "hp_" + "e2e-admin-token-never-in-the-state-0000000000"


# --- end to end against moto ----------------------------------------------------------------------


def _client(service: str) -> Any:
    import boto3

    return boto3.client(service, region_name=REGION)


def _outputs(terraform: Terraform) -> dict[str, Any]:
    raw = json.loads(terraform.run("output", "-json", "-no-color").stdout)
    return {name: entry["value"] for name, entry in raw.items()}


def _user_data(ec2: Any, instance_id: str) -> str:
    attribute = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    return base64.b64decode(attribute["UserData"]["Value"]).decode()


@pytest.mark.slow
@needs_moto
def test_apply_serve_and_destroy_against_moto(
    aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary, mirror = require_terraform()
    ec2, iam, ssm, s3 = (_client(s) for s in ("ec2", "iam", "ssm", "s3"))
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    certificate = _client("acm").request_certificate(DomainName=API_DOMAIN)["CertificateArn"]
    # The model bucket is the user's own (the module makes one when none is named): terraform
    # must leave it alone. (It also keeps S3's slow lifecycle waiter off this test's path.)
    s3.create_bucket(Bucket="e2e-models")

    terraform = Terraform(binary, mirror, copy_module(tmp_path / "terraform"))
    (terraform.workdir / "terraform.tfvars.json").write_text(
        json.dumps(
            {
                "region": REGION,
                "aws_endpoint_url": aws_env,
                "api_allowed_cidr": ALLOWED_CIDR,
                "worker_ami_id": ami,
                "worker_instance_types": list(WORKER_TYPES),
                "heteroplane_git_url": "https://git.example.com/heteroplane.git",
                "model_bucket_name": "e2e-models",
                "api_certificate_arn": certificate,
                "api_domain_name": API_DOMAIN,
                # moto does not implement detailed monitoring: the provider would wait for it.
                "detailed_monitoring": False,
            }
        )
    )
    terraform.init()
    try:
        terraform.run("apply", "-auto-approve", "-input=false", "-no-color", "-parallelism=20")
        out = _outputs(terraform)
        _check_created(ec2, iam, ssm, out)
        _check_tls(ec2, out, certificate)

        # The host stores its admin token; terraform never reads it into its state, and a
        # second plan shows no changes.
        ssm.put_parameter(
            Name=out["admin_token_ssm_parameter"], Value=TOKEN, Type="SecureString", Overwrite=True
        )
        plan = terraform.run(
            "plan",
            "-detailed-exitcode",
            "-input=false",
            "-no-color",
            "-out=second.tfplan",
            ok=(0, 2),
        )
        assert plan.returncode == 0, f"the second plan has changes:\n{plan.stdout[-6000:]}"
        shown = terraform.run("show", "-json", "second.tfplan").stdout
        state = (terraform.workdir / "terraform.tfstate").read_text()
        assert TOKEN not in shown and TOKEN not in state

        _serve_a_plan(ec2, ami, out, tmp_path, monkeypatch)
        _serve_an_artifact(ec2, iam, s3, out, tmp_path, monkeypatch)
    except BaseException:
        # Clean up, but report what failed first.
        with contextlib.suppress(Exception, pytest.fail.Exception):
            _terminate_leftovers(ec2)
            terraform.run("destroy", "-auto-approve", "-input=false", "-no-color")
        raise
    terraform.run("destroy", "-auto-approve", "-input=false", "-no-color", "-parallelism=20")
    _check_destroyed(ec2, iam, ssm, s3, out)


def _check_created(ec2: Any, iam: Any, ssm: Any, out: Mapping[str, Any]) -> None:
    # The network: a VPC, private worker subnets in two zones that give no public IPs.
    (vpc,) = ec2.describe_vpcs(VpcIds=[out["vpc_id"]])["Vpcs"]
    assert {"Key": "Deployment", "Value": "heteroplane"} in vpc["Tags"]
    subnets = ec2.describe_subnets(SubnetIds=out["worker_subnet_ids"])["Subnets"]
    assert len({s["AvailabilityZone"] for s in subnets}) == 2
    assert not any(s["MapPublicIpOnLaunch"] for s in subnets)

    # The roles: the control plane's may launch and pass the worker role; the worker's reads.
    for role in ("heteroplane-control-plane", "heteroplane-worker"):
        iam.get_role(RoleName=role)
    provisioner = iam.get_role_policy(
        RoleName="heteroplane-control-plane", PolicyName="provisioner"
    )
    document = provisioner["PolicyDocument"]
    document = json.loads(document) if isinstance(document, str) else document
    actions = {a for s in document["Statement"] for a in _as_list(s["Action"])}
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "iam:PassRole"} <= actions
    assert not any("*" in a for a in actions)
    # Instances: only the catalog's EC2 types (the default allowed_instance_types), only with
    # heteroplane's tags in the request.
    (launch,) = [s for s in document["Statement"] if s.get("Sid") == "LaunchTaggedInstances"]
    from estimator.catalog import default_catalog

    catalog = default_catalog()
    allowed = _as_list(launch["Condition"]["StringEquals"]["ec2:InstanceType"])
    assert allowed == [n for n in catalog.names if catalog[n].family not in ("local", "emu")]
    assert set(WORKER_TYPES) <= set(allowed)
    assert launch["Condition"]["StringEquals"]["aws:RequestTag/heteroplane:managed"] in (
        "true",
        ["true"],
    )
    nulls = launch["Condition"]["Null"]
    assert {k: _as_list(v) for k, v in nulls.items()} == {
        "aws:RequestTag/heteroplane:app": ["false"],
        "aws:RequestTag/heteroplane:request-id": ["false"],
    }

    # Security groups: the API from the load balancer only (_check_tls: the load balancer from
    # the allowed CIDR only); the agent from the control plane only.
    groups = out["security_group_ids"]
    (control,) = ec2.describe_security_groups(GroupIds=[groups["control_plane"]])["SecurityGroups"]
    assert [
        (
            p["FromPort"],
            [r["CidrIp"] for r in p["IpRanges"]],
            [g["GroupId"] for g in p["UserIdGroupPairs"]],
        )
        for p in control["IpPermissions"]
    ] == [(8000, [], [groups["load_balancer"]])]
    (workers,) = ec2.describe_security_groups(GroupIds=[groups["workers"]])["SecurityGroups"]
    ((rule,),) = [p["UserIdGroupPairs"] for p in workers["IpPermissions"]]
    assert rule["GroupId"] == groups["control_plane"]
    assert [p["IpRanges"] for p in workers["IpPermissions"]] == [[]]

    # A launch template per candidate type: IMDSv2, encrypted, the worker role, the agent.
    assert set(out["launch_templates"]) == set(WORKER_TYPES)
    profile = iam.get_instance_profile(InstanceProfileName="heteroplane-worker")
    for instance_type, template_id in out["launch_templates"].items():
        versions = ec2.describe_launch_template_versions(LaunchTemplateId=template_id)
        data = versions["LaunchTemplateVersions"][0]["LaunchTemplateData"]
        assert data["InstanceType"] == instance_type
        assert data["MetadataOptions"]["HttpTokens"] == "required"
        assert all(m["Ebs"]["Encrypted"] for m in data["BlockDeviceMappings"])
        assert data["IamInstanceProfile"]["Arn"] == profile["InstanceProfile"]["Arn"]
        assert data["SecurityGroupIds"] == [groups["workers"]]
        assert "NetworkInterfaces" not in data
        script = base64.b64decode(data["UserData"]).decode()
        assert f"--instance-type {instance_type} " in script
        assert "python -m provisioners.worker --host 0.0.0.0 --port 8080" in script
        _assert_bash_syntax(script)

    # The control-plane host: running, IMDSv2, its role, its settings from terraform's resources.
    reservation = ec2.describe_instances(InstanceIds=[out["control_plane_instance_id"]])
    (host,) = reservation["Reservations"][0]["Instances"]
    assert host["State"]["Name"] in ("pending", "running")
    assert host["MetadataOptions"]["HttpTokens"] == "required"
    assert host["IamInstanceProfile"]["Arn"].endswith("/heteroplane-control-plane")
    assert "PublicIpAddress" not in host, "behind the load balancer the host has no public IP"
    assert out["api_url"] == f"https://{API_DOMAIN}"
    script = _user_data(ec2, host["InstanceId"])
    for name, value in out["control_plane_environment"].items():
        assert f"\n{name}={value}\n" in script
    lt = ",".join(f"{t}={out['launch_templates'][t]}" for t in WORKER_TYPES)
    assert out["control_plane_environment"]["HETEROPLANE_EC2_LAUNCH_TEMPLATES"] == lt
    assert "systemctl enable --now heteroplane.service" in script
    _assert_bash_syntax(script)
    volume_id = out["database"]["volume_id"]
    (volume,) = ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"]
    assert volume["Encrypted"]
    assert [a["InstanceId"] for a in volume["Attachments"]] == [host["InstanceId"]]

    # The admin token's parameter exists (a placeholder until the host stores its token).
    assert ssm.get_parameter(Name=out["admin_token_ssm_parameter"])["Parameter"]["Type"] == (
        "SecureString"
    )


def _check_tls(ec2: Any, out: Mapping[str, Any], certificate: str) -> None:
    """The load balancer: HTTPS with the certificate (TLS 1.2+), HTTP redirected, the host its
    only target, open to the allowed CIDR only."""
    elbv2 = _client("elbv2")
    (balancer,) = elbv2.describe_load_balancers(Names=["heteroplane-api"])["LoadBalancers"]
    # (The provider sends no Scheme for internet-facing, EC2's default, and moto then shows none.)
    assert balancer.get("Scheme", "internet-facing") == "internet-facing"
    assert balancer["DNSName"] == out["load_balancer_dns_name"]
    assert balancer["SecurityGroups"] == [out["security_group_ids"]["load_balancer"]]
    # In the public subnets, one per zone (the workers' are private).
    subnets = {zone["SubnetId"] for zone in balancer["AvailabilityZones"]}
    assert len(subnets) == 2 and not subnets & set(out["worker_subnet_ids"])
    listeners = {
        item["Port"]: item
        for item in elbv2.describe_listeners(LoadBalancerArn=balancer["LoadBalancerArn"])[
            "Listeners"
        ]
    }
    assert set(listeners) == {443, 80}
    https = listeners[443]
    assert https["Protocol"] == "HTTPS"
    assert https["SslPolicy"] == "ELBSecurityPolicy-TLS13-1-2-2021-06"
    assert [c["CertificateArn"] for c in https["Certificates"]] == [certificate]
    (forward,) = https["DefaultActions"]
    assert forward["Type"] == "forward"
    health = elbv2.describe_target_health(TargetGroupArn=forward["TargetGroupArn"])
    targets = [d["Target"] for d in health["TargetHealthDescriptions"]]
    assert [(t["Id"], t["Port"]) for t in targets] == [(out["control_plane_instance_id"], 8000)]
    (redirect,) = listeners[80]["DefaultActions"]
    assert redirect["Type"] == "redirect"
    assert redirect["RedirectConfig"]["Protocol"] == "HTTPS"
    assert redirect["RedirectConfig"]["Port"] == "443"
    (group,) = ec2.describe_security_groups(GroupIds=[out["security_group_ids"]["load_balancer"]])[
        "SecurityGroups"
    ]
    assert sorted(
        (p["FromPort"], [r["CidrIp"] for r in p["IpRanges"]]) for p in group["IpPermissions"]
    ) == [(80, [ALLOWED_CIDR]), (443, [ALLOWED_CIDR])]
    environment = out["control_plane_environment"]
    assert environment["HETEROPLANE_DASHBOARD_SECURE_COOKIE"] == "true"


def _host_settings(monkeypatch: pytest.MonkeyPatch, out: Mapping[str, Any], tmp_path: Path) -> Any:
    """The control plane's settings as the host has them: terraform's outputs as the whole
    ``HETEROPLANE_*`` environment, a data folder of the test's own."""
    from controlplane.settings import load_settings

    for name in list(os.environ):
        if name.startswith("HETEROPLANE_"):
            monkeypatch.delenv(name)
    for name, value in out["control_plane_environment"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HETEROPLANE_DATA_DIR", str(tmp_path / "data"))
    return load_settings()


def _serve_a_plan(
    ec2: Any, ami: str, out: Mapping[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control plane, configured as the host is (terraform's outputs as its environment),
    applies a plan: the workers come up from terraform's launch templates; an empty plan ends
    all but the stage's last serving instance, and the app's teardown ends that one."""
    from controlplane.apps.teardown import request_teardown
    from controlplane.clock import FakeClock
    from controlplane.db.store import Store
    from controlplane.loops.reconciler import (
        DEFAULT_INTERRUPTION_DRAIN_S,
        Launch,
        Mark,
        Reconciler,
        Terminate,
        catalog_pricing,
    )
    from controlplane.policies.lifecycle import InstanceState
    from controlplane.provisioning import build_provisioner
    from estimator.catalog import default_catalog

    settings = _host_settings(monkeypatch, out, tmp_path)
    provisioner = build_provisioner(settings)
    assert provisioner.name == "ec2"
    settings.ensure_data_dir()
    # The wall time now, moved on by hand past a drain (no sleeping in a test).
    clock = FakeClock(start_utc=datetime.now(UTC))
    store = Store.from_url(settings.database_url, clock, upgrade=True)
    try:
        store.create_app(
            {
                "name": APP,
                "models": [{"name": "tiny", "profiles": "profiles.json"}],
                "slo": {"latency_ms": 350},
                "budget_usd_per_hr": 10,
                "instance_types": list(WORKER_TYPES),
            },
            who="e2e",
        )
        reconciler = Reconciler(store, provisioner, clock, catalog_pricing(default_catalog()))
        _apply_fleet(store, FLEET)
        report = reconciler.run_once()
        assert report.apps[APP].count(Launch) == sum(FLEET.values()), report

        workers = _managed_instances(ec2)
        assert sorted(i["InstanceType"] for i in workers) == sorted(
            t for t, n in FLEET.items() for _ in range(n)
        )
        for worker in workers:
            tags = {t["Key"]: t["Value"] for t in worker["Tags"]}
            assert (
                tags["aws:ec2launchtemplate:id"] == out["launch_templates"][worker["InstanceType"]]
            )
            assert tags["heteroplane:app"] == APP
            assert worker["SubnetId"] in out["worker_subnet_ids"]
            assert [g["GroupId"] for g in worker["SecurityGroups"]] == [
                out["security_group_ids"]["workers"]
            ]
            assert "PublicIpAddress" not in worker
            # What moto takes from a template: the image, the groups, the user data (not the
            # role or the metadata options, which the templates' own checks above cover).
            assert worker["ImageId"] == ami
            script = _user_data(ec2, worker["InstanceId"])
            assert f"--instance-type {worker['InstanceType']} " in script
        reconciler.run_once()
        assert {i.state for i in store.list_instances(APP)} == {"running"}

        _apply_fleet(store, {})
        report = reconciler.run_once()
        # A serving worker drains first (no new queries), then goes once drained.
        drained = [
            a
            for a in report.apps[APP].actions
            if isinstance(a, Mark) and a.to_state is InstanceState.DRAINING
        ]
        assert drained and not report.apps[APP].count(Terminate), report
        clock.advance(DEFAULT_INTERRUPTION_DRAIN_S + 1.0)
        report = reconciler.run_once()
        assert report.apps[APP].count(Terminate) >= 1, report
        running = [i for i in _managed_instances(ec2) if i["State"]["Name"] == "running"]
        # The disruption budget drains a few at a time, and a stage's last instance goes only on
        # teardown (or force).
        assert 1 <= len(running) < sum(FLEET.values())
        request_teardown(store, APP, "test")
        reconciler.run_once()
        assert not [i for i in _managed_instances(ec2) if i["State"]["Name"] == "running"]
    finally:
        store.close()


def _apply_fleet(store: Any, fleet: Mapping[str, int]) -> None:
    document = {
        "feasible": True,
        "cost_usd_per_hr": 0.0,
        "stages": [{"name": "tiny", "fleet": dict(fleet)}],
    }
    plan = store.create_plan(APP, document)
    store.apply_plan(APP, plan.id)


def _serve_an_artifact(
    ec2: Any,
    iam: Any,
    s3: Any,
    out: Mapping[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model a user brought, in the model bucket where the registry keeps it (the control
    plane's settings name the bucket; its role may write there): a worker launched from
    terraform's template gets the provider's bootstrap handing the agent the artifact, then the
    template's user data as it is, and what the worker would download is the artifact, verified."""
    import hashlib

    from controlplane.provisioning import build_provisioner
    from provisioners.artifacts import ArtifactRef
    from provisioners.base import APP_TAG, LaunchRequest
    from provisioners.ec2 import ARTIFACTS_OPTION, worker_user_data
    from provisioners.fetch import fetch_artifact

    settings = _host_settings(monkeypatch, out, tmp_path)
    assert settings.ec2 is not None
    assert settings.ec2.model_bucket == out["model_bucket"] == "e2e-models"
    assert settings.ec2.model_prefix == "models/"
    registry = iam.get_role_policy(
        RoleName="heteroplane-control-plane", PolicyName="model-registry"
    )["PolicyDocument"]
    registry = json.loads(registry) if isinstance(registry, str) else registry
    (objects,) = [s for s in registry["Statement"] if s.get("Sid") == "RegistryObjects"]
    assert _as_list(objects["Resource"]) == ["arn:aws:s3:::e2e-models/models/*"]

    blob = b"an onnx model, as far as the sha256 goes\n" * 64
    sha256 = hashlib.sha256(blob).hexdigest()
    key = f"models/wine/1/{sha256}.onnx"
    s3.put_object(Bucket="e2e-models", Key=key, Body=blob)
    ref = ArtifactRef("wine", "wine", 1, "onnx", sha256, f"s3://e2e-models/{key}")

    provisioner = build_provisioner(settings)
    instance_type = WORKER_TYPES[0]
    request = LaunchRequest("e2e-artifact", instance_type, 1, {APP_TAG: "wine-app"}, (ref,))
    (worker,) = provisioner.launch(request)
    try:
        versions = ec2.describe_launch_template_versions(
            LaunchTemplateId=out["launch_templates"][instance_type], Versions=["$Default"]
        )["LaunchTemplateVersions"]
        template = base64.b64decode(versions[0]["LaunchTemplateData"]["UserData"]).decode()
        script = _user_data(ec2, worker.provider_id)
        assert script == worker_user_data(template, [ref])
        assert script.endswith(template)
        written = [row for row in script.splitlines() if row.startswith("--artifact")]
        assert written == [f"--artifact {ref.to_arg()}"]
        (line,) = [row for row in script.splitlines() if row.startswith("ExecStart=")]
        assert line.endswith(f" {ARTIFACTS_OPTION} --worker-id ${{HETEROPLANE_WORKER_ID}}")
        _assert_bash_syntax(script)
        fetched = fetch_artifact(ref, tmp_path / "worker-cache", s3_client=s3)
        assert fetched.read_bytes() == blob
    finally:
        provisioner.terminate([worker.provider_id])
        s3.delete_object(Bucket="e2e-models", Key=key)


def _managed_instances(ec2: Any) -> list[dict[str, Any]]:
    filters = [{"Name": "tag:heteroplane:managed", "Values": ["true"]}]
    pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def _terminate_leftovers(ec2: Any) -> None:
    """Workers are the control plane's, not terraform's: end any a failed test left."""
    live = [i["InstanceId"] for i in _managed_instances(ec2) if i["State"]["Name"] != "terminated"]
    if live:
        ec2.terminate_instances(InstanceIds=live)


def _check_destroyed(ec2: Any, iam: Any, ssm: Any, s3: Any, out: Mapping[str, Any]) -> None:
    vpc = [{"Name": "vpc-id", "Values": [out["vpc_id"]]}]
    assert ec2.describe_vpcs(Filters=vpc)["Vpcs"] == []
    assert ec2.describe_subnets(Filters=vpc)["Subnets"] == []
    assert ec2.describe_security_groups(Filters=vpc)["SecurityGroups"] == []
    # (Not the network interfaces: moto keeps those of ended instances and NAT gateways,
    # detached, where AWS deletes them; the VPC itself is gone.)
    assert ec2.describe_launch_templates()["LaunchTemplates"] == []
    assert _client("elbv2").describe_load_balancers()["LoadBalancers"] == []
    assert ec2.describe_addresses()["Addresses"] == []
    assert ec2.describe_nat_gateways(Filter=vpc)["NatGateways"] in ([],) or all(
        g["State"] == "deleted" for g in ec2.describe_nat_gateways(Filter=vpc)["NatGateways"]
    )
    reservations = ec2.describe_instances()["Reservations"]
    states = {i["State"]["Name"] for r in reservations for i in r["Instances"]}
    assert states <= {"terminated"}, states
    named = [{"Name": "tag:Project", "Values": ["heteroplane"]}]
    assert ec2.describe_volumes(Filters=named)["Volumes"] == []
    assert not [r for r in iam.list_roles()["Roles"] if r["RoleName"].startswith("heteroplane")]
    assert iam.list_instance_profiles()["InstanceProfiles"] == []
    assert ssm.describe_parameters()["Parameters"] == []
    kms = _client("kms")
    for key in kms.list_keys()["Keys"]:
        state = kms.describe_key(KeyId=key["KeyId"])["KeyMetadata"]["KeyState"]
        assert state == "PendingDeletion"
    assert [
        a["AliasName"] for a in kms.list_aliases()["Aliases"] if "heteroplane" in a["AliasName"]
    ] == []
    # The user's own bucket is still there.
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["e2e-models"]


def _assert_bash_syntax(script: str) -> None:
    """The rendered user data parses as bash (``bash -n``: read, not run)."""
    done = subprocess.run(
        ["bash", "-n"], input=script, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
