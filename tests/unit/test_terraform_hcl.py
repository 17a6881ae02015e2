"""The terraform module read as HCL (python-hcl2), against the code it deploys: the control
plane's IAM role allows exactly the EC2 calls ``provisioners/ec2.py`` makes and no wildcard
action; every candidate type gets a launch template; every variable and output is documented
and typed; the root passes the module's variables through; the settings and the worker command
line it writes are the ones the service and the agent accept. No terraform binary needed."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.terraform_support import MODULE_DIR, REPO, TERRAFORM_DIR, labelled, parse_dir, typed

pytest.importorskip("hcl2", reason="python-hcl2 is not installed (pip install -e '.[test]')")

PROVISIONER = REPO / "provisioners" / "ec2.py"
SPOT = REPO / "provisioners" / "spot.py"
ROOT_ONLY_VARIABLES = {"region", "aws_endpoint_url"}
# boto3 client methods that are no API operation.
_NOT_API_CALLS = {"get_paginator", "get_waiter", "can_paginate", "close", "generate_presigned_url"}


@pytest.fixture(scope="module")
def module() -> dict[str, list[Any]]:
    return parse_dir(MODULE_DIR)


@pytest.fixture(scope="module")
def root() -> dict[str, list[Any]]:
    return parse_dir(TERRAFORM_DIR)


def resources(hcl: Mapping[str, list[Any]], kind: str) -> dict[str, Any]:
    return {name: body for k, name, body in typed(hcl.get("resource", [])) if k == kind}


def policy_documents(hcl: Mapping[str, list[Any]]) -> dict[str, Any]:
    return {
        name: body for k, name, body in typed(hcl.get("data", [])) if k == "aws_iam_policy_document"
    }


def statements(document: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The statements of a policy document, those of ``dynamic "statement"`` blocks included."""
    yield from document.get("statement", [])
    for dynamic in document.get("dynamic", []):
        yield from dynamic.get("statement", {}).get("content", [])


def role_documents(hcl: Mapping[str, list[Any]], role: str) -> dict[str, Any]:
    """The policy documents attached to ``aws_iam_role.<role>`` (inline role policies)."""
    documents = policy_documents(hcl)
    attached = {}
    for name, body in resources(hcl, "aws_iam_role_policy").items():
        if body["role"] != f"${{aws_iam_role.{role}.id}}":
            continue
        match = re.fullmatch(r"\$\{data\.aws_iam_policy_document\.(\w+)\.json\}", body["policy"])
        assert match, f"aws_iam_role_policy.{name} must use a policy document of the module"
        attached[match.group(1)] = documents[match.group(1)]
    return attached


def allowed_actions(documents: Mapping[str, Any]) -> set[str]:
    return {
        action
        for document in documents.values()
        for statement in statements(document)
        if statement.get("effect", "Allow") == "Allow"
        for action in statement.get("actions", [])
    }


def provisioner_ec2_actions() -> set[str]:
    """The EC2 API actions provisioners/ec2.py calls: ``_call("Operation", ...)``,
    ``get_paginator("operation")`` and direct client methods; tags given at creation
    (TagSpecifications) need ec2:CreateTags."""
    source = PROVISIONER.read_text()
    operations = set(re.findall(r'_call\(\s*"([A-Z][A-Za-z]+)"', source))
    snake = set(re.findall(r'get_paginator\(\s*"([a-z_]+)"', source))
    snake |= set(re.findall(r"self\._client\.([a-z][a-z_]+)\(", source)) - _NOT_API_CALLS
    # The spot price reader's calls (provisioners/spot.py, on the provisioner's client).
    snake |= set(re.findall(r"self\.ec2\.([a-z][a-z_]+)\(", SPOT.read_text())) - _NOT_API_CALLS
    operations |= {"".join(part.title() for part in name.split("_")) for name in snake}
    actions = {f"ec2:{operation}" for operation in operations}
    if "TagSpecifications" in source:
        actions.add("ec2:CreateTags")
    return actions


# --- the control plane's role ----------------------------------------------------------------


def test_the_provisioner_calls_are_found() -> None:
    # A guard on the extraction itself: these are certainly among them.
    assert {
        "ec2:RunInstances",
        "ec2:TerminateInstances",
        "ec2:DescribeInstances",
        "ec2:DescribeSubnets",
        "ec2:CreateFleet",
        "ec2:CreateTags",
    } <= provisioner_ec2_actions()


def test_the_role_allows_every_ec2_call_of_the_provisioner(module: dict[str, Any]) -> None:
    allowed = allowed_actions(role_documents(module, "control_plane"))
    missing = provisioner_ec2_actions() - allowed
    assert not missing, f"the control plane's role lacks {sorted(missing)}"


def test_the_role_allows_no_other_ec2_call(module: dict[str, Any]) -> None:
    allowed = allowed_actions(role_documents(module, "control_plane"))
    extra = {a for a in allowed if a.startswith("ec2:")} - provisioner_ec2_actions()
    assert not extra, f"the provisioner never calls {sorted(extra)}"


@pytest.mark.parametrize("role", ["control_plane", "worker"])
def test_no_wildcard_action(module: dict[str, Any], role: str) -> None:
    documents = role_documents(module, role)
    assert documents
    for name, document in documents.items():
        for statement in statements(document):
            assert "not_actions" not in statement, name
            wild = [a for a in statement.get("actions", []) if "*" in a]
            assert not wild, f"{name}: wildcard actions {wild}"


def test_only_describe_calls_have_every_resource(module: dict[str, Any]) -> None:
    for document in role_documents(module, "control_plane").values():
        for statement in statements(document):
            if "*" in statement["resources"]:
                assert statement["resources"] == ["*"]
                assert all(a.startswith("ec2:Describe") for a in statement["actions"]), statement


def _conditions(statement: Mapping[str, Any]) -> dict[str, tuple[str, list[str]]]:
    return {c["variable"]: (c["test"], c["values"]) for c in statement.get("condition", [])}


def test_instances_are_launched_and_terminated_by_the_managed_tag(module: dict[str, Any]) -> None:
    provisioner = role_documents(module, "control_plane")["control_plane_provisioner"]
    by_action: dict[str, list[Mapping[str, Any]]] = {}
    for statement in statements(provisioner):
        for action in statement["actions"]:
            by_action.setdefault(action, []).append(statement)
    managed = "${local.managed_tag}"
    (terminate,) = by_action["ec2:TerminateInstances"]
    assert _conditions(terminate) == {f"aws:ResourceTag/{managed}": ("StringEquals", ["true"])}
    launches_instances = [
        s for s in by_action["ec2:RunInstances"] if any("instance/*" in r for r in s["resources"])
    ]
    assert [_conditions(s) for s in launches_instances] == [
        {
            "ec2:InstanceType": ("StringEquals", "${var.allowed_instance_types}"),
            f"aws:RequestTag/{managed}": ("StringEquals", ["true"]),
            "aws:RequestTag/${var.name}:app": ("Null", ["false"]),
            "aws:RequestTag/${var.name}:request-id": ("Null", ["false"]),
        }
    ]
    for statement in by_action["ec2:CreateTags"]:
        assert "ec2:CreateAction" in _conditions(statement), "tags only on creation"
    templates = [
        s
        for s in by_action["ec2:RunInstances"]
        if any("launch-template" in r for r in s["resources"])
    ]
    assert [_conditions(s) for s in templates] == [
        {f"aws:ResourceTag/{managed}": ("StringEquals", ["true"])}
    ]
    # The launch templates carry that tag.
    template_tags = resources(module, "aws_launch_template")["worker"]["tags"]
    assert '(local.managed_tag) = "true"' in template_tags
    # ... and it is the provisioner's: the tag prefix is the deployment's name.
    (managed_tag,) = [b["managed_tag"] for b in module["locals"] if "managed_tag" in b]
    assert managed_tag == "${var.name}:managed"
    assert _control_plane_environment(module)["HETEROPLANE_EC2_TAG_PREFIX"] == "${var.name}"


def test_the_role_passes_only_the_worker_role_to_ec2(module: dict[str, Any]) -> None:
    passing = [
        s
        for document in role_documents(module, "control_plane").values()
        for s in statements(document)
        if "iam:PassRole" in s["actions"]
    ]
    assert len(passing) == 1
    (statement,) = passing
    assert statement["actions"] == ["iam:PassRole"]
    assert statement["resources"] == ["${aws_iam_role.worker.arn}"]
    assert _conditions(statement) == {
        "iam:PassedToService": ("StringEquals", ["ec2.amazonaws.com"])
    }


def test_no_managed_policy_is_attached(module: dict[str, Any]) -> None:
    # Everything a role may do is in the inline documents checked above.
    assert not resources(module, "aws_iam_role_policy_attachment")
    assert not resources(module, "aws_iam_policy")


def test_the_worker_role_only_reads_the_model_bucket(module: dict[str, Any]) -> None:
    documents = role_documents(module, "worker")
    assert allowed_actions(documents) == {"s3:GetObject", "s3:ListBucket", "kms:Decrypt"}
    resources_used = {r for d in documents.values() for s in statements(d) for r in s["resources"]}
    assert resources_used == {
        "${local.model_bucket_arn}",
        "${local.model_bucket_arn}/*",
        "${local.kms_key_arn}",
    }


def test_the_control_plane_keeps_the_registry_under_models_only(module: dict[str, Any]) -> None:
    registry = role_documents(module, "control_plane")["control_plane_registry"]
    by_action = {a: s for s in statements(registry) for a in s["actions"]}
    assert {a for a in by_action if a.startswith("s3:")} == {
        "s3:PutObject",
        "s3:GetObject",
        "s3:DeleteObject",
        "s3:ListBucket",
    }
    objects = "${local.model_bucket_arn}/${local.registry_prefix}*"
    for action in ("s3:PutObject", "s3:GetObject", "s3:DeleteObject"):
        assert by_action[action]["resources"] == [objects]
    listing = by_action["s3:ListBucket"]
    assert listing["resources"] == ["${local.model_bucket_arn}"]
    assert _conditions(listing) == {"s3:prefix": ("StringLike", ["${local.registry_prefix}*"])}
    # No other statement of the control plane's touches S3.
    others = [
        a
        for name, document in role_documents(module, "control_plane").items()
        if name != "control_plane_registry"
        for s in statements(document)
        for a in s["actions"]
        if a.startswith("s3:")
    ]
    assert not others
    (prefix,) = [b["registry_prefix"] for b in module["locals"] if "registry_prefix" in b]
    assert prefix == "models/"
    assert _control_plane_environment(module)["HETEROPLANE_EC2_MODEL_PREFIX"] == (
        "${local.registry_prefix}"
    )


# --- launch templates, security groups --------------------------------------------------------


def test_a_launch_template_per_candidate_type(module: dict[str, Any]) -> None:
    templates = resources(module, "aws_launch_template")
    assert set(templates) == {"worker"}, "one launch template resource, over the types"
    template = templates["worker"]
    assert template["for_each"] == "${toset(var.worker_instance_types)}"
    assert template["instance_type"] == "${each.key}"
    assert template["name"] == "${var.name}-${each.key}"
    assert (
        "--instance-type ${instance_type} "
        in (MODULE_DIR / "templates" / "worker.sh.tftpl").read_text()
    )
    assert "instance_type = each.key" in template["user_data"]


def test_launch_templates_are_hardened(module: dict[str, Any]) -> None:
    template = resources(module, "aws_launch_template")["worker"]
    (metadata,) = template["metadata_options"]
    assert metadata["http_tokens"] == "required"
    assert metadata["http_put_response_hop_limit"] == 1
    (mapping,) = template["block_device_mappings"]
    assert mapping["ebs"][0]["encrypted"] is True
    assert "network_interfaces" not in template, "no public IP: the subnets decide, and are private"
    assert template["iam_instance_profile"][0]["arn"] == "${aws_iam_instance_profile.worker.arn}"


def test_the_control_plane_host_is_hardened(module: dict[str, Any]) -> None:
    host = resources(module, "aws_instance")["control_plane"]
    assert host["metadata_options"][0]["http_tokens"] == "required"
    assert host["root_block_device"][0]["encrypted"] is True
    assert resources(module, "aws_ebs_volume")["data"]["encrypted"] is True
    assert resources(module, "aws_db_instance")["this"]["storage_encrypted"] is True


def test_security_group_rules(module: dict[str, Any]) -> None:
    rules = resources(module, "aws_security_group_rule")
    ingress = {name: rule for name, rule in rules.items() if rule["type"] == "ingress"}
    assert set(ingress) == {
        "api",
        "worker_agent",
        "database",
        "load_balancer_https",
        "load_balancer_http",
    }
    # The API port: the allowed CIDR, or with TLS the load balancer's group alone.
    assert ingress["api"]["cidr_blocks"] == "${local.tls ? null : [var.api_allowed_cidr]}"
    assert ingress["api"]["source_security_group_id"] == (
        "${local.tls ? aws_security_group.load_balancer[0].id : null}"
    )
    for name, port in (("load_balancer_https", 443), ("load_balancer_http", 80)):
        assert ingress[name]["cidr_blocks"] == ["${var.api_allowed_cidr}"]
        assert ingress[name]["from_port"] == ingress[name]["to_port"] == port
    assert ingress["api"]["from_port"] == ingress["api"]["to_port"] == "${var.api_port}"
    assert ingress["api"]["security_group_id"] == "${aws_security_group.control_plane.id}"
    for name in ("worker_agent", "database"):
        assert "cidr_blocks" not in ingress[name]
        assert ingress[name]["source_security_group_id"] == "${aws_security_group.control_plane.id}"
    assert ingress["worker_agent"]["security_group_id"] == "${aws_security_group.workers.id}"
    # Nothing is open to the world inbound, and no egress is every port.
    for name, rule in rules.items():
        if rule["type"] == "egress":
            assert rule["protocol"] == "tcp" and rule["from_port"] == rule["to_port"], name
    for group in resources(module, "aws_security_group").values():
        assert "ingress" not in group and "egress" not in group, "rules are resources of their own"


# --- variables and outputs -------------------------------------------------------------------


@pytest.mark.parametrize("where", ["root", "module"])
def test_every_variable_has_a_description_and_a_type(where: str) -> None:
    hcl = parse_dir(TERRAFORM_DIR if where == "root" else MODULE_DIR)
    variables = dict(labelled(hcl["variable"]))
    assert variables
    for name, body in variables.items():
        assert str(body.get("description", "")).strip(), f"variable {name} has no description"
        assert "type" in body, f"variable {name} has no type"


def test_module_variables_are_validated(module: dict[str, Any]) -> None:
    variables = dict(labelled(module["variable"]))
    for name in (
        "name",
        "api_allowed_cidr",
        "worker_instance_types",
        "worker_ami_id",
        "default_budget_usd_per_hr",
        "default_slo_latency_ms",
        "default_slo_percentile",
        "database",
        "vpc_id",
        "worker_subnet_ids",
    ):
        assert variables[name].get("validation"), f"variable {name} has no validation"


@pytest.mark.parametrize("where", ["root", "module"])
def test_every_output_has_a_description(where: str) -> None:
    hcl = parse_dir(TERRAFORM_DIR if where == "root" else MODULE_DIR)
    for name, body in labelled(hcl["output"]):
        assert str(body.get("description", "")).strip(), f"output {name} has no description"


def test_the_readme_lists_every_output(root: dict[str, Any]) -> None:
    """The README's Outputs section names them all (it had left interruption_queue_url out)."""
    readme = (TERRAFORM_DIR / "README.md").read_text()
    listed = readme.split("## Outputs", 1)[1].split("\n## ", 1)[0]
    missing = [name for name, _ in labelled(root["output"]) if f"`{name}`" not in listed]
    assert not missing, f"outputs missing from terraform/README.md's Outputs: {missing}"


def test_root_passes_the_module_through(root: dict[str, Any], module: dict[str, Any]) -> None:
    root_vars = dict(labelled(root["variable"]))
    module_vars = dict(labelled(module["variable"]))
    assert set(root_vars) - ROOT_ONLY_VARIABLES == set(module_vars)
    for name, body in module_vars.items():
        for key in ("type", "description", "default"):
            assert root_vars[name].get(key) == body.get(key), f"variable {name}: {key} differs"
    (call,) = [block["heteroplane"] for block in root["module"]]
    assert call["source"] == "./modules/heteroplane"
    for name in module_vars:
        assert call[name] == f"${{var.{name}}}", f"the root does not pass {name}"
    root_outputs = dict(labelled(root["output"]))
    module_outputs = dict(labelled(module["output"]))
    assert set(root_outputs) == set(module_outputs)
    for name, body in root_outputs.items():
        assert body["value"] == f"${{module.heteroplane.{name}}}"
        assert body["description"] == module_outputs[name]["description"]


def test_the_aws_provider_is_pinned(root: dict[str, Any], module: dict[str, Any]) -> None:
    for hcl in (root, module):
        (settings,) = hcl["terraform"]
        (providers,) = settings["required_providers"]
        assert providers["aws"]["source"] == "hashicorp/aws"
        assert providers["aws"]["version"] == "~> 5.0"
    assert "provider" not in module, "the module configures no provider; the root does"
    assert "provider" in root


# --- what the hosts run, against the code --------------------------------------------------------


def _control_plane_environment(module: Mapping[str, Any]) -> dict[str, str]:
    """The service's settings on the host (those that do not depend on TLS)."""
    for block in module["locals"]:
        if "service_environment" in block:
            assert block["control_plane_environment"] == (
                "${merge(local.service_environment, local.tls_environment)}"
            )
            return dict(block["service_environment"])
    raise AssertionError("no local service_environment")


def test_the_control_plane_settings_are_the_service_settings(
    module: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from controlplane.settings import load_settings

    environment = _control_plane_environment(module)
    examples = {
        "HETEROPLANE_DATA_DIR": str(tmp_path),
        "HETEROPLANE_PORT": "8000",
        "HETEROPLANE_EC2_REGION": "us-east-1",
        "HETEROPLANE_EC2_SUBNET_IDS": "subnet-a,subnet-b",
        "HETEROPLANE_EC2_SECURITY_GROUP_IDS": "sg-1",
        "HETEROPLANE_EC2_LAUNCH_TEMPLATES": "g4dn.xlarge=lt-1,c5.xlarge=lt-2",
        "HETEROPLANE_EC2_TAG_PREFIX": "heteroplane",
        "HETEROPLANE_EC2_MODEL_BUCKET": "heteroplane-models-0123",
        "HETEROPLANE_EC2_MODEL_PREFIX": "models/",
        "HETEROPLANE_EC2_INTERRUPTION_QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/1/q",
    }
    for name in list(os.environ):
        if name.startswith("HETEROPLANE_"):
            monkeypatch.delenv(name)
    for name, value in environment.items():
        literal = value if "${" not in value else examples[name]
        monkeypatch.setenv(name, literal)
    settings = load_settings()
    assert settings.provisioner == "ec2"
    assert settings.host == "0.0.0.0"
    assert settings.ec2 is not None
    assert dict(settings.ec2.launch_templates) == {"g4dn.xlarge": "lt-1", "c5.xlarge": "lt-2"}
    assert settings.ec2.subnet_ids == ["subnet-a", "subnet-b"]
    assert environment["HETEROPLANE_EC2_TAG_PREFIX"] == "${var.name}"
    # The model registry: in the model bucket, under the prefix the workers' boot leaves alone.
    assert environment["HETEROPLANE_EC2_MODEL_BUCKET"] == "${local.model_bucket}"
    assert settings.ec2.model_bucket == "heteroplane-models-0123"
    assert settings.ec2.model_prefix == "models/"
    assert settings.ec2.interruption_queue_url == "https://sqs.us-east-1.amazonaws.com/1/q"


def test_the_worker_command_line_is_the_agents() -> None:
    from provisioners.worker.agent import parse_args

    text = (MODULE_DIR / "templates" / "worker.sh.tftpl").read_text()
    (line,) = [row for row in text.splitlines() if row.startswith("ExecStart=")]
    command = line.removeprefix("ExecStart=").split()
    assert command[1:3] == ["-m", "provisioners.worker"]
    values = {
        "${worker_port}": "8080",
        "${instance_type}": "g4dn.xlarge",
        "$${HETEROPLANE_WORKER_ID}": "i-0123456789abcdef0",
    }
    config = parse_args([values.get(arg, arg) for arg in command[3:]])
    assert config.instance_type == "g4dn.xlarge"
    assert config.host == "0.0.0.0"
    assert config.port == 8080


def test_the_interruption_queue_is_read_and_deleted_from_by_the_control_plane_only(
    module: dict[str, Any],
) -> None:
    sqs_statements = [
        s
        for body in role_documents(module, "control_plane").values()
        for s in statements(body)
        if any(a.startswith("sqs:") for a in s["actions"])
    ]
    (reader,) = sqs_statements
    assert sorted(reader["actions"]) == ["sqs:DeleteMessage", "sqs:ReceiveMessage"]
    assert reader["resources"] == ["${aws_sqs_queue.interruptions.arn}"]
    # Only EventBridge's rules send to the queue; nothing reaches it without TLS.
    send, deny = statements(policy_documents(module)["interruption_queue"])
    assert send["actions"] == ["sqs:SendMessage"]
    assert send["resources"] == ["${aws_sqs_queue.interruptions.arn}"]
    assert deny["effect"] == "Deny"
    rules = resources(module, "aws_cloudwatch_event_rule")["interruptions"]
    assert "for_each" in rules
    queue = resources(module, "aws_sqs_queue")["interruptions"]
    assert queue["sqs_managed_sse_enabled"] is True
