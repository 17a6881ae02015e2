"""Helpers for the tests of the terraform module (``terraform/``): where it is, its HCL parsed
(python-hcl2), and the ``terraform`` binary with the AWS provider from a local mirror.

The registry cannot be reached from the machines that run the tests, so ``terraform init`` takes
the provider from a filesystem mirror: ``$HETEROPLANE_TF_PLUGIN_DIR``, else the first of
:data:`PLUGIN_DIR_CANDIDATES` that holds ``registry.terraform.io/hashicorp/aws``. Tests that need
terraform skip, saying why, when the binary or the mirror is missing. Every run works on a copy
of the module in a temporary directory, so no ``.terraform/``, lock file or state is ever written
into the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TERRAFORM_DIR = REPO / "terraform"
MODULE_DIR = TERRAFORM_DIR / "modules" / "heteroplane"
PLUGIN_DIR_ENV = "HETEROPLANE_TF_PLUGIN_DIR"
PLUGIN_DIR_CANDIDATES = (
    Path("/opt/tf-plugins"),
    Path.home() / ".terraform.d" / "plugins",
    Path("/usr/local/share/terraform/plugins"),
    Path("/usr/share/terraform/plugins"),
)
_PROVIDER = Path("registry.terraform.io") / "hashicorp" / "aws"
# What never goes into a working copy of the module (and never comes from the repository).
_NOT_COPIED = shutil.ignore_patterns(
    ".terraform", ".terraform.lock.hcl", "*.tfstate", "*.tfstate.*", "*.tfplan", "*.tfvars*"
)


def plugin_dir() -> Path | None:
    """The filesystem mirror holding hashicorp/aws, or None."""
    configured = os.environ.get(PLUGIN_DIR_ENV)
    candidates = (Path(configured),) if configured else PLUGIN_DIR_CANDIDATES
    for candidate in candidates:
        if (candidate / _PROVIDER).is_dir() and any((candidate / _PROVIDER).iterdir()):
            return candidate
    return None


def terraform_binary() -> str | None:
    return shutil.which("terraform")


def require_terraform() -> tuple[str, Path]:
    """The terraform binary and the provider mirror, or skip the test saying which is missing."""
    binary = terraform_binary()
    if binary is None:
        pytest.skip("terraform is not on PATH")
    mirror = plugin_dir()
    if mirror is None:
        where = os.environ.get(PLUGIN_DIR_ENV) or ", ".join(map(str, PLUGIN_DIR_CANDIDATES))
        pytest.skip(
            f"no filesystem mirror of the hashicorp/aws provider (looked in {where}; set"
            f" {PLUGIN_DIR_ENV})"
        )
    return binary, mirror


def copy_module(target: Path) -> Path:
    """A copy of ``terraform/`` (root and module) at ``target``, without working files."""
    shutil.copytree(TERRAFORM_DIR, target, ignore=_NOT_COPIED)
    return target


class Terraform:
    """``terraform`` in one working directory, with the provider from the mirror."""

    def __init__(self, binary: str, mirror: Path, workdir: Path) -> None:
        self.binary = binary
        self.mirror = mirror
        self.workdir = workdir

    def run(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
        ok: Sequence[int] = (0,),
    ) -> subprocess.CompletedProcess[str]:
        """Run ``terraform ARGS`` here; a status outside ``ok`` fails the test with the output."""
        environment = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1"}
        environment.update(env or {})
        done = subprocess.run(
            [self.binary, *args],
            cwd=self.workdir,
            env=environment,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode not in ok:
            pytest.fail(
                f"terraform {' '.join(args)} exited {done.returncode}:\n"
                f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
            )
        return done

    def init(self) -> None:
        self.run(
            "init", "-backend=false", f"-plugin-dir={self.mirror}", "-input=false", "-no-color"
        )


# --- HCL -----------------------------------------------------------------------------------------


def parse_dir(directory: Path) -> dict[str, list[Any]]:
    """Every top-level block of the ``*.tf`` files in ``directory`` (not below it), merged:
    ``{"resource": [...], "variable": [...], ...}``, strings without their quotes."""
    import hcl2

    options = hcl2.SerializationOptions(
        with_comments=False, explicit_blocks=False, strip_string_quotes=True
    )
    merged: dict[str, list[Any]] = {}
    for path in sorted(directory.glob("*.tf")):
        with path.open() as handle:
            parsed = hcl2.load(handle, serialization_options=options)
        for kind, blocks in parsed.items():
            merged.setdefault(kind, []).extend(blocks)
    return merged


def labelled(blocks: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(label, body) of one-label blocks (variable, output)."""
    for block in blocks:
        yield from block.items()


def typed(blocks: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, str, Any]]:
    """(type, name, body) of two-label blocks (resource, data)."""
    for block in blocks:
        for kind, named in block.items():
            for name, body in named.items():
                yield kind, name, body
