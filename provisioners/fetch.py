"""Fetching a model artifact for a worker: the file behind an
:class:`~provisioners.artifacts.ArtifactRef`, verified against its sha256.

A ``file://`` artifact is read where it is; an ``s3://`` one is downloaded with boto3 (the
instance's role, or the environment's credentials; ``HETEROPLANE_S3_ENDPOINT_URL`` points it at
another endpoint, a moto server in the tests) into a cache folder, once. Kept apart from
:mod:`provisioners.artifacts` so that the vocabulary does not bring the cloud client with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from provisioners.artifacts import ArtifactError, ArtifactRef, file_sha256
from provisioners.storage import S3_ENDPOINT_ENV

__all__ = ["fetch_artifact"]


def fetch_artifact(ref: ArtifactRef, cache_dir: str | Path, *, s3_client: Any = None) -> Path:
    """The local file of ``ref``, verified: a ``file://`` artifact is read where it is; an
    ``s3://`` one is downloaded into ``cache_dir`` (once; a cached copy is checked again).
    ``s3_client`` is a boto3 S3 client (made from the environment when ``None``). Raises
    :class:`ArtifactError` when the file is missing or its sha256 is not the reference's."""
    parsed = urlparse(ref.uri)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
        if not path.is_file():
            raise ArtifactError(f"artifact {ref.model} v{ref.version}: no file at {path}")
    else:
        cache = Path(cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        suffix = ".onnx" if ref.format == "onnx" else ".pt"
        path = cache / f"{ref.model}-{ref.version}-{ref.sha256[:16]}{suffix}"
        if not path.is_file() or file_sha256(path) != ref.sha256:
            _download_s3(parsed.netloc, parsed.path.lstrip("/"), path, s3_client)
    actual = file_sha256(path)
    if actual != ref.sha256:
        raise ArtifactError(
            f"artifact {ref.model} v{ref.version}: sha256 {actual[:12]}... is not the registry's"
            f" {ref.sha256[:12]}... (the file changed or was corrupted)"
        )
    return path


def _download_s3(bucket: str, key: str, path: Path, client: Any) -> None:
    if client is None:
        import boto3  # only where an artifact is in S3

        client = boto3.client("s3", endpoint_url=os.environ.get(S3_ENDPOINT_ENV))
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".download-")
    os.close(descriptor)
    try:
        try:
            client.download_file(bucket, key, temporary)
        except Exception as error:  # botocore's errors, without importing botocore here
            raise ArtifactError(f"cannot download s3://{bucket}/{key}: {error}") from None
        shutil.move(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
