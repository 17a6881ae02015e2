"""The model registry's rows: immutable, numbered versions of the models users bring."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from controlplane.db import models as m
from controlplane.db.session import transaction
from controlplane.db.store.base import (
    StoreBase,
    _json_document,
    _translated,
)
from controlplane.db.store.records import (
    ModelVersionRecord,
    _model_version_record,
)
from controlplane.errors import (
    ConflictError,
    InvalidValueError,
    NotFoundError,
)
from provisioners.artifacts import ArtifactError, ArtifactRef, ModelSignature

__all__ = ["ModelVersionStore"]


class ModelVersionStore(StoreBase):
    """The model registry's rows (see the module docstring)."""

    # --- the model registry and measured profiles -----------------------------------------------

    @_translated
    def next_model_version(self, name: str) -> int:
        """The version a new push of ``name`` takes: one past its newest (1 for a new name).
        Two pushes may both see the same number; :meth:`add_model_version` lets one win."""
        with transaction(self._sessions) as session:
            newest = session.scalar(
                select(func.max(m.ModelVersion.version)).where(m.ModelVersion.name == name)
            )
            return 1 if newest is None else int(newest) + 1

    @_translated
    def add_model_version(
        self,
        name: str,
        version: int,
        format: str,
        sha256: str,
        size_bytes: int,
        signature: ModelSignature,
        uri: str,
        *,
        at: datetime | None = None,
    ) -> ModelVersionRecord:
        """Record version ``version`` of model ``name`` (its blob already stored at ``uri``).
        :class:`ConflictError` when that version exists (a concurrent push took it: ask
        :meth:`next_model_version` again); :class:`InvalidValueError` for a value that is not
        a registry version's (a bad name, format, checksum, size or URI)."""
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise InvalidValueError("size_bytes", f"must be an integer >= 0, got {size_bytes!r}")
        try:
            # The reference's own checks: a DNS-label name, a version >= 1, a known format,
            # a sha256 of 64 hex digits, a file:// or s3:// URI.
            ArtifactRef(name, name, version, format, sha256, uri)
        except ArtifactError as error:
            raise InvalidValueError("model", str(error)) from None
        now = self._now(at)
        try:
            with transaction(self._sessions) as session:
                row = m.ModelVersion(
                    name=name,
                    version=version,
                    format=format,
                    sha256=sha256,
                    size_bytes=size_bytes,
                    signature=_json_document(signature.to_json(), "signature"),
                    uri=uri,
                    created_at=now,
                )
                session.add(row)
                session.flush()
                return _model_version_record(row)
        except IntegrityError:
            raise ConflictError(
                f"model {name!r} version {version} was pushed by another request; push again"
            ) from None

    @_translated
    def list_model_versions(self, name: str | None = None) -> list[ModelVersionRecord]:
        """Every version of every model (of ``name`` only, when given), by name then version;
        an unknown name has none."""
        query = select(m.ModelVersion).order_by(m.ModelVersion.name, m.ModelVersion.version)
        if name is not None:
            query = query.where(m.ModelVersion.name == name)
        with transaction(self._sessions) as session:
            return [_model_version_record(row) for row in session.scalars(query)]

    @_translated
    def get_model_version(self, name: str, version: int | None = None) -> ModelVersionRecord:
        """Version ``version`` of model ``name``, its newest when ``version`` is None;
        :class:`NotFoundError` (kind ``model``) when there is none."""
        query = select(m.ModelVersion).where(m.ModelVersion.name == name)
        if version is None:
            query = query.order_by(m.ModelVersion.version.desc()).limit(1)
        else:
            query = query.where(m.ModelVersion.version == version)
        with transaction(self._sessions) as session:
            row = session.scalar(query)
            if row is None:
                raise NotFoundError("model", name if version is None else f"{name}@{version}")
            return _model_version_record(row)
