"""The install script terraform's user data share (``templates/install.sh.tftpl``): its checkout
of heteroplane (``hp_checkout``) run for real by bash against a local git repository, for a
branch, a tag and a whole commit id (``git clone --branch`` took only the first two, so a
deployment could not pin the code its hosts install: hosts booted later ran the branch's newer
head)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker_template import TEMPLATES, WORKER_VARIABLES, render_template

_GIT = ["git", "-c", "user.email=test@example.com", "-c", "user.name=test"]


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        [*_GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A repository of three commits on ``main``, the first tagged ``v1``; the commits by
    name (first, second, head)."""
    repo = tmp_path / "src"
    subprocess.run(["git", "init", "--quiet", "--initial-branch", "main", str(repo)], check=True)
    commits = {}
    for name in ("first", "second", "head"):
        (repo / "VERSION").write_text(name)
        _git(repo, "add", "VERSION")
        _git(repo, "commit", "--quiet", "-m", name)
        commits[name] = _git(repo, "rev-parse", "HEAD")
        if name == "first":
            _git(repo, "tag", "v1")
    return repo, commits


def _checkout(repo: Path, ref: str, into: Path) -> str:
    """``hp_checkout`` of the rendered script for ``ref``; what ``into`` holds (its VERSION)."""
    script = render_template(
        (TEMPLATES / "install.sh.tftpl").read_text(),
        {**WORKER_VARIABLES, "git_url": repo.as_uri(), "git_ref": ref},
    )
    subprocess.run(
        ["bash", "-c", f'set -euo pipefail\n{script}\nhp_checkout "$1"', "bash", str(into)],
        check=True,
        capture_output=True,
    )
    return (into / "VERSION").read_text()


@pytest.mark.parametrize(
    ("ref", "expected"), [("main", "head"), ("v1", "first"), ("second", "second")]
)
def test_a_branch_a_tag_or_a_whole_commit_id_is_checked_out(
    source: tuple[Path, dict[str, str]], tmp_path: Path, ref: str, expected: str
) -> None:
    repo, commits = source
    wanted = commits.get(ref, ref)  # "second": its commit id, no name
    assert _checkout(repo, wanted, tmp_path / "out") == expected
    assert _git(tmp_path / "out", "rev-parse", "HEAD") == commits[expected]


def test_a_ref_that_does_not_exist_fails_the_script(
    source: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    repo, _ = source
    with pytest.raises(subprocess.CalledProcessError):
        _checkout(repo, "no-such-branch", tmp_path / "out")


def _install(root: Path) -> subprocess.CompletedProcess[str]:
    """``hp_install`` of the rendered script with ``/opt/heteroplane`` moved under ``root``, the
    system's parts stubbed (no user made, no directory owned) and no way out to the internet
    (``curl`` fails, ``sleep`` returns at once)."""
    script = render_template((TEMPLATES / "install.sh.tftpl").read_text(), WORKER_VARIABLES)
    stubs = "useradd() { :; }\ninstall() { :; }\ncurl() { return 7; }\nsleep() { :; }\n"
    body = script.replace("/opt/heteroplane", str(root / "opt"))
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{stubs}{body}\nhp_install '[worker,aws]'"],
        capture_output=True,
        text=True,
    )


def test_an_install_baked_into_the_ami_needs_no_way_out(tmp_path: Path) -> None:
    """A new VPC without its NAT gateway (``create_nat_gateway = false``) is for an AMI with
    heteroplane baked in; the script waited for the internet all the same and failed the boot.
    Baked (the checkout, and a virtualenv that imports the package), it boots without one."""
    (tmp_path / "opt" / "src" / ".git").mkdir(parents=True)
    (tmp_path / "opt" / "venv" / "bin").mkdir(parents=True)
    python = tmp_path / "opt" / "venv" / "bin" / "python"
    repo = Path(__file__).resolve().parents[2]
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{repo}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    done = _install(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "baked into the AMI" in done.stdout


def test_without_a_baked_install_or_a_way_out_the_boot_fails_saying_why(tmp_path: Path) -> None:
    done = _install(tmp_path)
    assert done.returncode == 1
    assert "no way out to the internet" in done.stderr and "NAT gateway" in done.stderr
