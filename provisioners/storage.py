"""Where the registry keeps artifact bytes: a folder of the data directory, or an S3 bucket.

The provider owns the choice (:meth:`provisioners.base.Provisioner.artifact_storage`): its
workers must be able to fetch what the registry stores (the local workers read ``file://``
URIs, EC2 workers ``s3://`` ones with their instance role). The control plane's registry
(``controlplane.registry``) only uses the store it is given.

A blob store is an :class:`ArtifactStorage`: :meth:`~ArtifactStorage.put` stores a local file
under a key (``<name>/<version>/<sha256>.<onnx|pt>``, relative to the store's prefix) and returns
its URI, the one a worker fetches (:func:`provisioners.fetch.fetch_artifact`);
:meth:`~ArtifactStorage.delete` removes a blob by that URI (nothing there is fine: a push that
failed half-way cleans up with it); :meth:`~ArtifactStorage.open` reads one back in chunks (``GET
/v1/models/{name}/versions/{v}/artifact``). Failures are one-line
:class:`~provisioners.errors.ArtifactStoreError`; botocore's errors never escape.

- :class:`LocalArtifactStorage`: files under ``root`` (``<data_dir>/registry``) with the prefix
  ``models/``; URIs ``file:///abs/path``. A blob is written beside its final name (a
  ``.incoming-*`` file, ``flock``-ed while it is written) and renamed into place, so a reader never
  sees half a file; :meth:`~LocalArtifactStorage.sweep` removes what a crash left (a temporary
  file no live process holds, a blob without a registry row).
- :class:`S3ArtifactStorage`: objects in ``bucket`` under ``prefix`` (``Ec2Config.model_prefix``,
  ``models/``); URIs ``s3://bucket/key``. Uploaded with boto3's managed transfer (multipart for
  large files); an object appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from provisioners.errors import ArtifactStoreError

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_PREFIX",
    "S3_ENDPOINT_ENV",
    "ArtifactStorage",
    "LocalArtifactStorage",
    "S3ArtifactStorage",
    "held",
    "locked_file",
    "sweep_unheld",
]

# Points the S3 clients of the artifact store and of the workers' fetch at another endpoint (a
# moto server in tests); boto3's own AWS_ENDPOINT_URL works too.
S3_ENDPOINT_ENV = "HETEROPLANE_S3_ENDPOINT_URL"
# How much of a blob one read hands on (the artifact route streams it in these).
CHUNK_BYTES = 1 << 20
DEFAULT_PREFIX = "models/"
_TEMPORARY_PREFIX = ".incoming-"


class ArtifactStorage(Protocol):
    """A blob store of the registry (see the module docstring)."""

    def put(self, source: Path, key: str) -> str:
        """Store the file ``source`` under ``key``; its URI."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the blob at ``uri`` (one of this store's); nothing there is fine."""
        ...

    def open(self, uri: str) -> Iterator[bytes]:
        """The bytes of the blob at ``uri``, in chunks."""
        ...

    def sweep(self, known_uris: Collection[str] | None) -> list[str]:
        """Remove what a crashed push left: temporary files no live process holds and, when
        ``known_uris`` is given (no push is in flight), blobs not among them; what went."""
        ...


@contextlib.contextmanager
def locked_file(folder: Path, prefix: str) -> Iterator[Path]:
    """A fresh empty file in ``folder``, ``flock``-ed by this process until the block ends, then
    removed (whatever happened). A crash releases the lock with the process, so :func:`held`
    tells a file in use from one a dead process left."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=folder, prefix=prefix)
    path = Path(name)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(descriptor)


def held(path: Path) -> bool:
    """Whether a live process holds ``path``'s lock (:func:`locked_file`); a file that is gone
    counts as held (nothing to remove)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(descriptor)  # also releases the lock just taken
    return False


def sweep_unheld(folder: Path, prefix: str) -> tuple[list[str], bool]:
    """Remove the files of ``folder`` named ``prefix*`` that no live process holds; what went,
    and whether any is still held (a push in flight)."""
    removed: list[str] = []
    busy = False
    for path in sorted(folder.rglob(f"{prefix}*")) if folder.is_dir() else []:
        if not path.is_file():
            continue
        if held(path):
            busy = True
            continue
        path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed, busy


class LocalArtifactStorage:
    """Blobs as files under ``root`` (``<data_dir>/registry``), keys under ``prefix``."""

    def __init__(self, root: Path, prefix: str = DEFAULT_PREFIX) -> None:
        self.root = Path(root).resolve()
        self.prefix = prefix

    def _path(self, key: str) -> Path:
        path = (self.root / (self.prefix + key)).resolve()
        if not path.is_relative_to(self.root):
            raise ArtifactStoreError(f"artifact key {key!r} leaves the registry folder")
        return path

    def _path_of(self, uri: str) -> Path:
        parsed = urlparse(uri)
        path = Path(unquote(parsed.path)).resolve() if parsed.scheme == "file" else None
        if path is None or not path.is_relative_to(self.root):
            raise ArtifactStoreError(f"{uri!r} is not a blob of the registry at {self.root}")
        return path

    def put(self, source: Path, key: str) -> str:
        path = self._path(key)
        try:
            with locked_file(path.parent, _TEMPORARY_PREFIX) as temporary:
                shutil.copyfile(source, temporary)
                temporary.replace(path)
        except OSError as error:
            raise ArtifactStoreError(
                f"cannot store {key} under {self.root}: {error.strerror or error}"
            ) from None
        return path.as_uri()

    def delete(self, uri: str) -> None:
        path = self._path_of(uri)
        try:
            path.unlink(missing_ok=True)
            # The version's folder, then the model's, when nothing else is left in them.
            for folder in (path.parent, path.parent.parent):
                if folder != self.root and folder.is_relative_to(self.root):
                    try:
                        folder.rmdir()
                    except OSError:
                        break  # not empty (another version), or gone already
        except OSError as error:
            raise ArtifactStoreError(f"cannot delete {path}: {error.strerror or error}") from None

    def open(self, uri: str) -> Iterator[bytes]:
        path = self._path_of(uri)
        try:
            handle = path.open("rb")
        except OSError as error:
            raise ArtifactStoreError(f"cannot read {path}: {error.strerror or error}") from None
        return _chunks(handle)

    def sweep(self, known_uris: Collection[str] | None) -> list[str]:
        blobs = self.root / self.prefix
        removed, busy = sweep_unheld(blobs, _TEMPORARY_PREFIX)
        if known_uris is None or busy or not blobs.is_dir():
            return removed
        known = set(known_uris)
        for path in sorted(blobs.rglob("*")):
            if path.is_file() and not path.name.startswith(".") and path.as_uri() not in known:
                self.delete(path.as_uri())
                removed.append(str(path))
        return removed


def _chunks(handle: Any) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


class S3ArtifactStorage:
    """Blobs as objects in ``bucket`` under ``prefix``, through ``client`` (a boto3 S3
    client)."""

    def __init__(self, bucket: str, prefix: str = DEFAULT_PREFIX, *, client: Any) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.client = client

    def _key_of(self, uri: str) -> str:
        parsed = urlparse(uri)
        key = parsed.path.lstrip("/")
        if parsed.scheme != "s3" or parsed.netloc != self.bucket or not key.startswith(self.prefix):
            raise ArtifactStoreError(
                f"{uri!r} is not a blob of the registry at s3://{self.bucket}/{self.prefix}"
            )
        return key

    def put(self, source: Path, key: str) -> str:
        full = self.prefix + key
        try:
            self.client.upload_file(str(source), self.bucket, full)
        except Exception as error:  # botocore's and boto3's errors, one line
            raise ArtifactStoreError(
                f"cannot upload s3://{self.bucket}/{full}: {_reason(error)}"
            ) from None
        return f"s3://{self.bucket}/{full}"

    def delete(self, uri: str) -> None:
        key = self._key_of(uri)
        try:
            # DeleteObject of a key that is not there succeeds: idempotent as the protocol says.
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as error:
            raise ArtifactStoreError(f"cannot delete {uri}: {_reason(error)}") from None

    def open(self, uri: str) -> Iterator[bytes]:
        key = self._key_of(uri)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except Exception as error:
            raise ArtifactStoreError(f"cannot read {uri}: {_reason(error)}") from None
        return _s3_chunks(body, uri)

    def sweep(self, known_uris: Collection[str] | None) -> list[str]:
        # An object appears whole or not at all, and a blob without a row is left to the
        # bucket's lifecycle rules (docs/operations.md, "Crash guarantees").
        return []


def _s3_chunks(body: Any, uri: str) -> Iterator[bytes]:
    try:
        while chunk := body.read(CHUNK_BYTES):
            yield chunk
    except Exception as error:
        raise ArtifactStoreError(f"cannot read {uri}: {_reason(error)}") from None
    finally:
        body.close()


def _reason(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
