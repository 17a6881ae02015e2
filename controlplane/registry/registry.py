"""The model registry: immutable, numbered versions of the models users bring.

:meth:`Registry.push` takes a model file and makes it version N+1 of its name, unless version
N is that file already (the same SHA-256, format and signature: a push run twice), which it
answers instead (:meth:`Registry.push_version` says which):

1. the name is a DNS label (:data:`provisioners.artifacts.NAME_PATTERN`; it becomes part of
   URLs, S3 keys and file names), the format ``onnx``, ``torchscript`` or None (detected), the
   file at most ``max_bytes`` (``Settings.model_max_bytes``);
2. the inspector (:mod:`controlplane.registry.inspection`: another process, time and memory
   limits) reads its format and signature; every input and output must be batched along a
   dynamic first dimension;
3. its sha256 and size are read from the file;
4. the blob is stored under ``<name>/<version>/<sha256>.<onnx|pt>`` (the storage adds its
   prefix, ``models/``), then the row is inserted (:meth:`Store.add_model_version`).

Nothing half-written stays: a failure after the blob was stored deletes it, and the row goes in
last, so there is never a row without its blob. Two concurrent pushes of one name may pick the
same version; the database's unique (name, version) lets one insert win, and the other deletes
its blob and tries once more with the next number (then it is a 409 to retry), or answers
the winner's version when that is the same file.

A crash leaves no more: an upload is staged in ``<staging_dir>/upload-*`` (:meth:`Registry.
staged_file`), ``flock``-ed by the process that writes it and removed however the push ends;
:meth:`Registry.sweep`, at the service's start, removes the staged files and the blob store's
temporary files that no live process holds, and (no push in flight) blobs without a row.

:meth:`Registry.resolve` turns ``"name"`` (the newest version) or ``"name@3"`` into a version
record; :func:`registry_from_settings` builds the registry the settings describe, its blobs where
the provider keeps them (S3 with the EC2 provisioner and ``ec2.model_bucket`` set, else
``<data_dir>/registry``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

from controlplane.crashpoints import crash_point
from controlplane.db.store import ModelVersionRecord, Store
from controlplane.errors import (
    ArtifactStoreError,
    ConflictError,
    ModelNameError,
    ModelRejectedError,
    ModelTooLargeError,
    NotFoundError,
)
from controlplane.provisioning import build_provisioner
from controlplane.registry.inspection import (
    Inspection,
    Inspector,
    SubprocessInspector,
    inspect_kept,
)
from controlplane.settings import Settings
from provisioners.artifacts import FORMATS, NAME_PATTERN, file_sha256
from provisioners.base import Provisioner
from provisioners.storage import ArtifactStorage, locked_file, sweep_unheld
from provisioners.worker.inspect import InspectError, parse_inputs_spec

__all__ = [
    "REGISTRY_DIR",
    "STAGING_PREFIX",
    "Pushed",
    "Registry",
    "artifact_key",
    "check_model_name",
    "parse_reference",
    "registry_from_settings",
]

logger = logging.getLogger(__name__)

REGISTRY_DIR = "registry"
# Staged uploads are <staging_dir>/upload-*.
STAGING_PREFIX = "upload-"
_NAME = re.compile(NAME_PATTERN)
_REFERENCE = re.compile(r"^(?P<name>[^@]+)(@(?P<version>[0-9]+))?$")
_SUFFIX = {"onnx": "onnx", "torchscript": "pt"}
# One retry after a concurrent push took the version (the contract: retry once, then 409).
_PUSH_ATTEMPTS = 2


def check_model_name(name: str) -> str:
    """``name`` if it is a DNS label, else :class:`ModelNameError`."""
    # fullmatch: "$" also matches before a trailing newline, and "wine\n" passed.
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ModelNameError(
            str(name),
            f"model name {name!r} is not a DNS label: 1 to 63 lower-case letters, digits and"
            " '-', starting and ending with a letter or digit",
        )
    return name


def parse_reference(reference: str) -> tuple[str, int | None]:
    """``"wine"`` -> ``("wine", None)`` (the newest), ``"wine@3"`` -> ``("wine", 3)``;
    :class:`ModelNameError` for anything else.

    >>> parse_reference("wine@3")
    ('wine', 3)
    """
    found = _REFERENCE.fullmatch(reference) if isinstance(reference, str) else None
    if found is None:
        raise ModelNameError(
            str(reference), f"model reference {reference!r}: expected NAME or NAME@VERSION"
        )
    name = check_model_name(found["name"])
    version = found["version"]
    if version is None:
        return name, None
    number = int(version)
    if not 1 <= number <= 2**31 - 1:
        raise ModelNameError(reference, f"model reference {reference!r}: version must be >= 1")
    return name, number


def artifact_key(name: str, version: int, sha256: str, format: str) -> str:
    """Where a version's blob lives, under the storage's prefix.

    >>> artifact_key("wine", 2, "0" * 64, "torchscript") == "wine/2/" + "0" * 64 + ".pt"
    True
    """
    return f"{name}/{version}/{sha256}.{_SUFFIX[format]}"


class Pushed(NamedTuple):
    """What a push answered: the version and whether the push made it (False: the name's newest
    version holds those very bytes, format and signature already, and is answered instead)."""

    record: ModelVersionRecord
    created: bool


class Registry:
    """Model versions: rows in ``store``, bytes in ``storage`` (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        storage: ArtifactStorage,
        *,
        staging_dir: Path,
        max_bytes: int = 1 << 30,
        inspector: Inspector | None = None,
    ) -> None:
        self.store = store
        self.storage = storage
        # Uploads are streamed here first (a folder of the data directory: the same disk as the
        # local blob store, never a RAM-backed /tmp).
        self.staging_dir = Path(staging_dir)
        self.max_bytes = max_bytes
        self.inspector: Inspector = inspector if inspector is not None else SubprocessInspector()

    # --- pushing ---------------------------------------------------------------------------------

    @contextmanager
    def staged_file(self) -> Iterator[Path]:
        """A fresh empty file in the staging folder, removed when the block ends (whatever
        happened): where an upload is streamed before :meth:`push`, which runs inside the block.
        This process holds the file's ``flock`` meanwhile, so :meth:`sweep` (another replica's
        start, or this one's after a crash) tells a push in flight from a crashed one."""
        with ExitStack() as stack:
            try:
                path = stack.enter_context(locked_file(self.staging_dir, STAGING_PREFIX))
            except OSError as error:
                raise ArtifactStoreError(
                    f"cannot stage an upload in {self.staging_dir}: {error.strerror or error}"
                ) from None
            yield path

    def sweep(self) -> list[str]:
        """Remove what crashed pushes left (the service's start calls it): staged uploads no
        live process holds, the blob store's temporary files and, when no push is in flight,
        blobs without a row. What went (paths or URIs)."""
        removed, busy = sweep_unheld(self.staging_dir, STAGING_PREFIX)
        known = None if busy else {r.uri for r in self.store.list_model_versions()}
        removed.extend(self.storage.sweep(known))
        for item in removed:
            logger.warning("registry: removed %s, left by a push that did not finish", item)
        return removed

    def check_push(self, name: str, format: str | None, inputs_spec: str | None = None) -> None:
        """Refuse a push by its name, format and inputs spec alone, before any byte is read."""
        check_model_name(name)
        if format is not None and format not in FORMATS:
            raise ModelRejectedError(
                f"format {format!r} is not one of {', '.join(FORMATS)} (or leave it out)",
                field="format",
            )
        if inputs_spec is not None:
            try:
                parse_inputs_spec(inputs_spec, what="inputs")
            except InspectError as error:
                raise ModelRejectedError(str(error), field="inputs") from None

    def push(
        self,
        name: str,
        source_path: Path,
        format: str | None = None,
        inputs_spec: str | None = None,
    ) -> ModelVersionRecord:
        """Make the file at ``source_path`` the next version of ``name`` (the module docstring
        says how), or answer the newest version when it is the same (:meth:`push_version`)."""
        return self.push_version(name, source_path, format, inputs_spec).record

    def push_version(
        self,
        name: str,
        source_path: Path,
        format: str | None = None,
        inputs_spec: str | None = None,
    ) -> Pushed:
        """:meth:`push`, saying whether it made a version: the file is not stored again when
        the name's newest version has its SHA-256, format and signature (inputs and outputs),
        so a push run twice answers the version the first made (which an app may serve: a new
        version of the same bytes would be a change only a rollout makes). The source is only
        read; the caller keeps (or removes) it."""
        self.check_push(name, format, inputs_spec)
        source = Path(source_path)
        try:
            size_bytes = source.stat().st_size
        except OSError as error:
            raise ModelRejectedError(
                f"cannot read the model file: {error.strerror or error}"
            ) from None
        if size_bytes > self.max_bytes:
            raise ModelTooLargeError(self.max_bytes)
        if size_bytes == 0:
            raise ModelRejectedError("the model file is empty")
        try:
            sha256 = file_sha256(source)
        except OSError as error:
            raise ModelRejectedError(
                f"cannot read the model file: {error.strerror or error}"
            ) from None
        # Bytes inspected already the same way take that inspection (inspection.py says why).
        inspection = inspect_kept(self.inspector, source, sha256, format, inputs_spec)
        _check_batched(inspection)
        for attempt in range(_PUSH_ATTEMPTS):
            version = self.store.next_model_version(name)
            # After the number is chosen (and again after a lost race): a push of these very
            # bytes that got in before it is the newest version now; one after it takes the
            # same number, and the insert that loses comes back here.
            same = self._newest_if_same(name, sha256, inspection)
            if same is not None:
                return Pushed(same, created=False)
            key = artifact_key(name, version, sha256, inspection.format)
            uri = self.storage.put(source, key)
            crash_point("model_push.before_row")
            try:
                record = self.store.add_model_version(
                    name,
                    version,
                    inspection.format,
                    sha256,
                    size_bytes,
                    inspection.signature,
                    uri,
                )
                crash_point("model_push.after_row")
                return Pushed(record, created=True)
            except ConflictError:
                self._forget(name, version, uri)
                if attempt + 1 == _PUSH_ATTEMPTS:
                    raise
            except BaseException:
                self._forget(name, version, uri)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _newest_if_same(
        self, name: str, sha256: str, inspection: Inspection
    ) -> ModelVersionRecord | None:
        """The newest version of ``name`` when it has these bytes, format and signature."""
        try:
            newest = self.store.get_model_version(name)
        except NotFoundError:
            return None
        same = (
            newest.sha256 == sha256
            and newest.format == inspection.format
            and newest.signature.to_json() == inspection.signature.to_json()
        )
        return newest if same else None

    def _forget(self, name: str, version: int, uri: str) -> None:
        """Delete a blob whose row was not inserted, unless the version that did get in is
        the same file at the same URI (two pushes of one file racing for one version)."""
        try:
            winner = self.store.get_model_version(name, version)
        except Exception:
            winner = None
        if winner is not None and winner.uri == uri:
            return
        try:
            self.storage.delete(uri)
        except ArtifactStoreError as error:
            logger.error("model %s: cannot remove the blob of a failed push: %s", name, error)

    # --- reading -------------------------------------------------------------------------------

    def resolve(self, reference: str) -> ModelVersionRecord:
        """``"name"`` (its newest version) or ``"name@3"``; :class:`NotFoundError` when there is
        no such version, :class:`ModelNameError` for a malformed reference."""
        name, version = parse_reference(reference)
        return self.store.get_model_version(name, version)

    def versions(self, name: str | None = None) -> list[ModelVersionRecord]:
        """Every version (of ``name``), by name then version."""
        return self.store.list_model_versions(name)

    def open(self, record: ModelVersionRecord) -> Iterator[bytes]:
        """The bytes of a version's blob, in chunks."""
        return self.storage.open(record.uri)

    def download(self, record: ModelVersionRecord, destination: Path) -> Path:
        """Copy a version's blob to ``destination`` (a file path); the path."""
        destination = Path(destination)
        with destination.open("wb") as handle:
            for chunk in self.open(record):
                handle.write(chunk)
        return destination


def _check_batched(inspection: Inspection) -> None:
    for kind, tensors in (
        ("input", inspection.signature.inputs),
        ("output", inspection.signature.outputs),
    ):
        for tensor in tensors:
            if not tensor.batched:
                raise ModelRejectedError(
                    f"{kind} {tensor.name!r} has shape {list(tensor.shape)}: heteroplane batches"
                    " along the first dimension; export with a dynamic batch axis"
                )
            if kind == "input" and 0 in tensor.sample_shape:
                # A sample of no values: no query carries one (/v1 refuses an empty row).
                raise ModelRejectedError(
                    f"input {tensor.name!r} has shape {list(tensor.shape)}: a sample of no"
                    " values cannot be queried; give each dimension past the batch a size"
                    " (or leave it dynamic)"
                )


def registry_from_settings(
    settings: Settings,
    store: Store,
    *,
    provisioner: Provisioner | None = None,
    inspector: Inspector | None = None,
) -> Registry:
    """The registry the settings describe: blobs where the provider keeps them
    (:meth:`~provisioners.base.Provisioner.artifact_storage`: S3 for EC2 with ``ec2.model_bucket``
    set, else ``<data_dir>/registry/models/``); uploads staged in
    ``<data_dir>/registry/incoming``. ``provisioner`` is the service's; without one, the one the
    settings name is built for its store and closed again."""
    root = settings.data_dir / REGISTRY_DIR
    if provisioner is not None:
        storage = provisioner.artifact_storage(root)
    else:
        own = build_provisioner(settings)
        try:
            storage = own.artifact_storage(root)
        finally:
            own.close()
    return Registry(
        store,
        storage,
        staging_dir=root / "incoming",
        max_bytes=settings.model_max_bytes,
        inspector=inspector,
    )
