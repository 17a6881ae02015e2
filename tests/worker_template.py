"""The terraform worker template (``templates/worker.sh.tftpl``) rendered in Python, for the
tests of what the EC2 provisioner does with it (``provisioners.ec2.worker_user_data``).

The template uses nothing of terraform's template language but ``${name}`` interpolations and
``$${`` escapes (checked: a directive, ``%{``, would fail the rendering), so a substitution
renders it as ``templatefile`` does; an unknown name fails the rendering as it fails terraform's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tests.terraform_support import MODULE_DIR

__all__ = ["WORKER_VARIABLES", "render_template", "render_worker_template"]

TEMPLATES = MODULE_DIR / "templates"
# What workers.tf passes the worker template (and the install script), with example values.
WORKER_VARIABLES: Mapping[str, str] = {
    "name": "heteroplane",
    "worker_port": "8080",
    "model_bucket": "heteroplane-models-0123",
    "region": "us-east-1",
    "git_url": "https://example.com/heteroplane.git",
    "git_ref": "main",
}
_INTERPOLATION = re.compile(r"(\$\$\{)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def render_template(text: str, variables: Mapping[str, str]) -> str:
    """``text`` rendered as terraform's ``templatefile`` renders ``${name}`` and ``$${``."""
    if re.search(r"(?<!%)%\{", text):
        raise ValueError(
            "the template uses a terraform directive (%{...}): render it with terraform"
        )

    def substitute(match: re.Match[str]) -> str:
        if match.group(1):
            return "${"
        return variables[match.group(2)]

    return _INTERPOLATION.sub(substitute, text)


def render_worker_template(instance_type: str, **changes: str) -> str:
    """The user data terraform gives ``instance_type``'s launch template (before base64)."""
    variables = {**WORKER_VARIABLES, **changes}
    install = render_template((TEMPLATES / "install.sh.tftpl").read_text(), variables)
    worker = (TEMPLATES / "worker.sh.tftpl").read_text()
    return render_template(
        worker, {**variables, "install": install, "instance_type": instance_type}
    )
