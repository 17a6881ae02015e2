"""The model registry: versions of the ONNX and TorchScript models users bring (``heteroplane
model push``, ``/v1/models``), their rows in the store and their bytes in a blob store.

- :mod:`controlplane.registry.registry`: :class:`Registry` (push, resolve) and
  :func:`registry_from_settings`;
- the blob stores, :class:`LocalArtifactStorage` (the data directory) and
  :class:`S3ArtifactStorage`, are the providers' (:mod:`provisioners.storage`): each provider
  says where its workers fetch artifacts from;
- :mod:`controlplane.registry.inspection`: reading an artifact's format and signature in a
  separate, limited process.

docs/models.md is the user's guide.
"""

from __future__ import annotations

from controlplane.registry.inspection import (
    Inspection,
    Inspector,
    SubprocessInspector,
    inspect_artifact,
    inspect_kept,
)
from controlplane.registry.registry import (
    Pushed,
    Registry,
    artifact_key,
    check_model_name,
    parse_reference,
    registry_from_settings,
)
from provisioners.storage import (
    ArtifactStorage,
    LocalArtifactStorage,
    S3ArtifactStorage,
)

__all__ = [
    "ArtifactStorage",
    "Inspection",
    "Inspector",
    "LocalArtifactStorage",
    "Pushed",
    "Registry",
    "S3ArtifactStorage",
    "SubprocessInspector",
    "artifact_key",
    "check_model_name",
    "inspect_artifact",
    "inspect_kept",
    "parse_reference",
    "registry_from_settings",
]
