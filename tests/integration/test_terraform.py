"""The terraform module with the real terraform binary and the AWS provider from a local mirror.

Static: ``terraform fmt -check``, ``terraform validate`` and ``terraform test`` (the variables'
validation and the module's wiring, against a mock provider) on the root and on the module, and
the offline checkov scan when its virtualenv exists (``terraform/scan.sh`` makes it).

End to end against a moto server: tests/integration/test_terraform_apply.py (a file of its own,
so that another test process runs it meanwhile).

Skipped, saying why, without terraform or the provider mirror.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.terraform_support import (
    MODULE_DIR,
    TERRAFORM_DIR,
    Terraform,
    copy_module,
    require_terraform,
)

CHECKOV_VENV_ENV = "HETEROPLANE_CHECKOV_VENV"
# Set to 1 by .ci/run once terraform/scan.sh has passed on the tree under test.
CHECKOV_SCANNED_ENV = "HETEROPLANE_CHECKOV_SCANNED"


# --- static checks ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def initialized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Terraform]]:
    """A copy of terraform/ with the root and the module each initialised from the mirror."""
    binary, mirror = require_terraform()
    workdir = copy_module(tmp_path_factory.mktemp("terraform") / "terraform")
    root = Terraform(binary, mirror, workdir)
    module = Terraform(binary, mirror, workdir / MODULE_DIR.relative_to(TERRAFORM_DIR))
    root.init()
    module.init()
    yield {"root": root, "module": module}


def test_fmt() -> None:
    binary, mirror = require_terraform()
    # -check writes nothing: the repository's own files are checked.
    done = Terraform(binary, mirror, TERRAFORM_DIR).run(
        "fmt", "-check", "-recursive", "-diff", "-no-color", ok=(0, 3)
    )
    assert done.returncode == 0, f"terraform fmt would change:\n{done.stdout}"


@pytest.mark.parametrize("where", ["root", "module"])
def test_validate(initialized: dict[str, Terraform], where: str) -> None:
    done = initialized[where].run("validate", "-json", "-no-color")
    report = json.loads(done.stdout)
    assert report["valid"], report
    assert report["warning_count"] == 0, report["diagnostics"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "module"])
def test_terraform_test(initialized: dict[str, Terraform], where: str) -> None:
    done = initialized[where].run("test", "-no-color", timeout_s=600.0, ok=(0, 1))
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert "0 failed" in done.stdout


def _checkov() -> Path | None:
    configured = os.environ.get(CHECKOV_VENV_ENV)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    venv = Path(configured) if configured else cache / "heteroplane" / "checkov-venv"
    binary = venv / "bin" / "checkov"
    return binary if binary.is_file() else None


def test_checkov_finds_nothing_unsuppressed() -> None:
    if os.environ.get(CHECKOV_SCANNED_ENV) == "1":
        # .ci/run ran terraform/scan.sh on this tree before the tests, and fails on its failure:
        # the same scan again would cost the suite half a minute of a core.
        pytest.skip(f"terraform/scan.sh scanned this tree in this CI run ({CHECKOV_SCANNED_ENV})")
    checkov = _checkov()
    if checkov is None:
        pytest.skip(
            "checkov's virtualenv is not there (terraform/scan.sh makes it; or set"
            f" {CHECKOV_VENV_ENV})"
        )
    done = subprocess.run(
        [
            str(checkov),
            "--directory",
            str(TERRAFORM_DIR),
            "--skip-download",
            "--quiet",
            "--compact",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    reports = json.loads(done.stdout or "[]")
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{check['check_id']} {check['resource']} ({check['file_path']})"
        for report in reports
        for check in report.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "checkov: failed checks:\n" + "\n".join(failed)
    assert done.returncode == 0, done.stderr[-4000:]
    skipped = [
        check for report in reports for check in report.get("results", {}).get("skipped_checks", [])
    ]
    for check in skipped:
        reason = (check.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 20, f"{check['check_id']} is suppressed without a reason"
