"""The terraform module's hardening read as HCL (python-hcl2), against the code it deploys: the
instance types the control plane's role may launch default to the EC2 types of heteroplane's
catalog; the request tags its RunInstances grant demands are the ones the provisioner sets; the
API refuses 0.0.0.0/0 and plain HTTP unless asked; behind TLS the dashboard's cookie setting is
the dashboard's own. The variables' behaviour itself is tested by ``terraform test``
(modules/heteroplane/tests/, run by tests/integration/test_terraform.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.terraform_support import MODULE_DIR, TERRAFORM_DIR, labelled, parse_dir

pytest.importorskip("hcl2", reason="python-hcl2 is not installed (pip install -e '.[test]')")

# Types in the catalog that are no EC2 instance type (provisioners/local, the emulator).
_NOT_EC2_FAMILIES = {"local", "emu"}


@pytest.fixture(scope="module")
def module() -> dict[str, list[Any]]:
    return parse_dir(MODULE_DIR)


def _variables(where: str) -> dict[str, Any]:
    return dict(labelled(parse_dir(TERRAFORM_DIR if where == "root" else MODULE_DIR)["variable"]))


def _catalog_ec2_types() -> list[str]:
    from estimator.catalog import default_catalog

    catalog = default_catalog()
    return [name for name in catalog.names if catalog[name].family not in _NOT_EC2_FAMILIES]


@pytest.mark.parametrize("where", ["root", "module"])
def test_the_allowed_types_default_to_the_catalogs_ec2_types(where: str) -> None:
    allowed = _variables(where)["allowed_instance_types"]["default"]
    assert allowed == _catalog_ec2_types()
    assert not any(t.startswith(("local.", "emu.")) for t in allowed)


def test_the_default_worker_types_are_allowed() -> None:
    variables = _variables("module")
    worker_types = variables["worker_instance_types"]["default"]
    assert set(worker_types) <= set(variables["allowed_instance_types"]["default"])
    # ... and the module checks it for any value.
    checks = [v["condition"] for v in variables["worker_instance_types"]["validation"]]
    assert any("var.allowed_instance_types" in check for check in checks)


def test_the_request_tags_the_role_demands_are_the_provisioners() -> None:
    """Every launch carries <prefix>:managed, <prefix>:request-id (provisioners/base.py
    launch_tags) and <prefix>:app (the reconciler): the role's Null conditions name these."""
    from provisioners.base import APP_TAG, MANAGED_TAG, REQUEST_TAG, LaunchRequest, launch_tags

    tags = launch_tags(LaunchRequest("r-1", "t3.large", 1, {APP_TAG: "recs"}))
    assert {MANAGED_TAG, REQUEST_TAG, APP_TAG} <= set(tags)
    iam = (MODULE_DIR / "iam.tf").read_text()
    for tag in (APP_TAG, REQUEST_TAG):
        suffix = tag.split(":", 1)[1]
        assert f'variable = "aws:RequestTag/${{var.name}}:{suffix}"' in iam


def test_the_public_api_and_plain_http_are_refused_unless_asked() -> None:
    variables = _variables("module")
    cidr_checks = [v["condition"] for v in variables["api_allowed_cidr"]["validation"]]
    assert any("var.allow_public_api" in check and "/0" in check for check in cidr_checks)
    assert variables["allow_public_api"]["default"] is False
    assert variables["allow_plain_http"]["default"] is False
    (http_check,) = variables["allow_plain_http"]["validation"]
    assert "var.api_certificate_arn != null" in http_check["condition"]


def test_behind_tls_the_dashboard_cookie_is_secure(module: dict[str, Any]) -> None:
    from controlplane.dashboard import SessionSettings

    (block,) = [b for b in module["locals"] if "tls_environment" in b]
    text = str(block["tls_environment"])
    assert "HETEROPLANE_DASHBOARD_SECURE_COOKIE" in text
    # The name is the dashboard's setting, and "true" turns it on.
    field = "secure_cookie"
    assert field in SessionSettings.model_fields
    prefix = SessionSettings.model_config.get("env_prefix", "")
    assert f"{prefix}{field}".upper() == "HETEROPLANE_DASHBOARD_SECURE_COOKIE"
    assert "FORWARDED_ALLOW_IPS" in text


def test_the_load_balancer_ends_tls_with_a_modern_policy(module: dict[str, Any]) -> None:
    from tests.unit.test_terraform_hcl import resources

    listeners = resources(module, "aws_lb_listener")
    assert listeners["https"]["protocol"] == "HTTPS"
    assert listeners["https"]["ssl_policy"].startswith("ELBSecurityPolicy-TLS13-1-2")
    assert listeners["https"]["certificate_arn"] == "${var.api_certificate_arn}"
    (action,) = listeners["http"]["default_action"]
    assert action["type"] == "redirect"
    assert action["redirect"][0]["protocol"] == "HTTPS"
    assert resources(module, "aws_lb")["api"]["drop_invalid_header_fields"] is True
