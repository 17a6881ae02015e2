"""The registry's S3 blob store against a real moto server on 127.0.0.1 (boto3 over HTTP): put,
read back, delete, foreign URIs refused, errors one line; a push through
:func:`registry_from_settings` with the EC2 provisioner and a model bucket lands in the bucket
under the prefix, and a worker's :func:`~provisioners.fetch.fetch_artifact` downloads and
verifies it. The inspector is a fake (the registry's seam): what is tested here is the storage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.clock import FakeClock
from controlplane.db.store import Store
from controlplane.errors import ArtifactStoreError
from controlplane.registry import (
    Inspection,
    Registry,
    S3ArtifactStorage,
    registry_from_settings,
)
from controlplane.settings import Ec2Settings, Settings
from provisioners.artifacts import ModelSignature, TensorSpec
from provisioners.fetch import fetch_artifact
from tests.integration.moto_server import REGION, aws_env, moto_server

__all__ = ["aws_env", "moto_server"]  # fixtures, imported for pytest

BUCKET = "heteroplane-models"
SIGNATURE = ModelSignature(
    (TensorSpec("input", "FP32", (-1, 13)),), (TensorSpec("logits", "FP32", (-1, 3)),)
)


def fake_inspector(path: Path, format: str | None = None, inputs: str | None = None) -> Inspection:
    return Inspection(format or "onnx", SIGNATURE)


@pytest.fixture
def s3(aws_env: str) -> Any:
    import boto3

    client = boto3.client("s3", region_name=REGION)
    client.create_bucket(Bucket=BUCKET)
    return client


def keys(s3: Any) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store.from_url(f"sqlite:///{tmp_path / 'db.sqlite'}", FakeClock(), upgrade=True)
    yield store
    store.close()


def test_s3_storage_put_open_delete(s3: Any, tmp_path: Path) -> None:
    storage = S3ArtifactStorage(BUCKET, "models/", client=s3)
    source = tmp_path / "m.onnx"
    content = b"\x00model bytes" * 100_000  # over one read chunk
    source.write_bytes(content)
    uri = storage.put(source, "wine/1/abc.onnx")
    assert uri == f"s3://{BUCKET}/models/wine/1/abc.onnx"
    assert keys(s3) == ["models/wine/1/abc.onnx"]
    assert b"".join(storage.open(uri)) == content
    storage.delete(uri)
    storage.delete(uri)  # nothing there is fine
    assert keys(s3) == []
    for foreign in ("s3://other/models/x", f"s3://{BUCKET}/elsewhere/x", "file:///tmp/x"):
        with pytest.raises(ArtifactStoreError):
            storage.delete(foreign)
    with pytest.raises(ArtifactStoreError, match="cannot read") as caught:
        storage.open(f"s3://{BUCKET}/models/gone.onnx")
    assert "\n" not in str(caught.value)
    missing = S3ArtifactStorage("no-such-bucket", client=s3)
    with pytest.raises(ArtifactStoreError, match="cannot upload s3://no-such-bucket/models/k"):
        missing.put(source, "k")


def test_push_to_s3_and_fetch_like_a_worker(
    s3: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        provisioner="ec2",
        ec2=Ec2Settings(
            region=REGION,
            subnet_ids=["subnet-1"],
            security_group_ids=[],
            ami_id="ami-1",
            model_bucket=BUCKET,
            model_prefix="registry/models/",
        ),
    )
    registry = registry_from_settings(settings, store, inspector=fake_inspector)
    assert isinstance(registry.storage, S3ArtifactStorage)
    source = tmp_path / "wine.onnx"
    source.write_bytes(b"wine model")
    record = registry.push("wine", source)
    sha = hashlib.sha256(b"wine model").hexdigest()
    assert record.uri == f"s3://{BUCKET}/registry/models/wine/1/{sha}.onnx"
    assert keys(s3) == [f"registry/models/wine/1/{sha}.onnx"]
    fetched = fetch_artifact(record.ref("wine"), tmp_path / "cache", s3_client=s3)
    assert fetched.read_bytes() == b"wine model"

    # A failed insert leaves no object behind.
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("insert failed (test)")

    monkeypatch.setattr(store, "add_model_version", refuse)
    source.write_bytes(b"second")
    with pytest.raises(RuntimeError):
        registry.push("wine", source)
    assert keys(s3) == [f"registry/models/wine/1/{sha}.onnx"]


def test_registry_uses_the_data_directory_without_a_bucket(store: Store, tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        provisioner="ec2",
        ec2=Ec2Settings(region=REGION, subnet_ids=["s"], security_group_ids=[], ami_id="ami-1"),
    )
    registry = registry_from_settings(settings, store, inspector=fake_inspector)
    assert not isinstance(registry.storage, S3ArtifactStorage)
    assert isinstance(registry, Registry)
