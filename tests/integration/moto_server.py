"""A real moto server on 127.0.0.1 for the tests that talk to EC2 through boto3 over HTTP.

``moto_server`` starts ``python -m moto.server`` on a free port as a subprocess, once per test
process, and waits for it (polling, with a deadline); ``aws_env`` points boto3 at it the standard
way (``AWS_ENDPOINT_URL``, dummy credentials, a region; no user config files) and resets its
state for each test; ``ec2_network`` makes a VPC with one subnet in each of two zones and a
security group. Where moto is not installed, the tests that use them are skipped with the reason.

Import the fixtures into a test module (``from tests.integration.moto_server import ...``).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import free_port

REGION = "us-east-1"
ZONES = ("us-east-1a", "us-east-1b")
_START_TIMEOUT_S = 60.0

needs_moto = pytest.mark.skipif(
    importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None,
    reason="moto[server] is not installed (pip install -e '.[test]')",
)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


# The server of this test process: the modules that use the fixtures import them into their own
# namespace, so each is a fixture of its own to pytest and a session-scoped one would start a
# server per module, each living to the session's end (moto's start is several seconds of a
# core). One process serves them all; ``aws_env`` resets its state for every test.
_SERVER: tuple[subprocess.Popen[bytes], str] | None = None


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _start(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / "moto.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _answers(f"{url}/moto-api/"):
        if process.poll() is not None:
            pytest.fail(f"moto server exited with {process.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            _stop(process)
            pytest.fail(f"moto server did not answer within {_START_TIMEOUT_S:g} s")
        time.sleep(0.1)
    atexit.register(_stop, process)
    return process, url


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of a moto server on 127.0.0.1 that lives for the test process (one for every
    module that imports this fixture; started again should it have exited)."""
    global _SERVER
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        pytest.skip("moto[server] is not installed (pip install -e '.[test]')")
    if _SERVER is None or _SERVER[0].poll() is not None:
        _SERVER = _start(Path(tmp_path_factory.mktemp("moto")))
    return _SERVER[1]


@pytest.fixture
def aws_env(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """boto3 pointed at the moto server through the environment alone; moto's state reset."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_EC2", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    request = urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    return moto_server


@dataclass(frozen=True, slots=True)
class Ec2Network:
    """What ``ec2_network`` made: subnet ids by zone, a security group, an AMI."""

    vpc_id: str
    subnet_ids: tuple[str, ...]
    zone_of: dict[str, str]
    security_group_id: str
    ami_id: str


@pytest.fixture
def ec2_network(aws_env: str) -> Ec2Network:
    import boto3

    ec2: Any = boto3.client("ec2", region_name=REGION)
    vpc_id = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet_ids = []
    zone_of = {}
    for index, zone in enumerate(ZONES):
        subnet = ec2.create_subnet(
            VpcId=vpc_id, CidrBlock=f"10.0.{index + 1}.0/24", AvailabilityZone=zone
        )["Subnet"]
        subnet_ids.append(subnet["SubnetId"])
        zone_of[subnet["SubnetId"]] = zone
    group_id = ec2.create_security_group(
        GroupName="heteroplane-workers", Description="workers", VpcId=vpc_id
    )["GroupId"]
    return Ec2Network(vpc_id, tuple(subnet_ids), zone_of, group_id, _ami_id(aws_env))


@functools.cache
def _ami_id(moto_url: str) -> str:
    """One of moto's stock AMIs (they survive a reset; listing them takes a second, so once)."""
    import boto3

    ec2: Any = boto3.client("ec2", region_name=REGION, endpoint_url=moto_url)
    images = ec2.describe_images(Owners=["amazon"])["Images"]
    return str(images[0]["ImageId"]) if images else "ami-12c6146b"
