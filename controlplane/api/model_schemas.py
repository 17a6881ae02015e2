"""The bodies of ``/v1/models`` (the model registry): a version document, a model's versions,
every version. Built from :class:`~controlplane.db.store.ModelVersionRecord` by the routes; the
request side is the path, the query (``format``, ``inputs``) and the artifact's bytes."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from controlplane.db.store import ModelVersionRecord

__all__ = [
    "ModelListOut",
    "ModelOut",
    "ModelPushOut",
    "ModelVersionOut",
    "TensorOut",
    "version_out",
]

_RESPONSE = ConfigDict(frozen=True)


class TensorOut(BaseModel):
    """One input or output: its name, Open Inference Protocol datatype and shape (-1: any)."""

    model_config = _RESPONSE

    name: str
    datatype: str = Field(description="FP32, INT64, ... (Open Inference Protocol v2)")
    shape: list[int] = Field(description="-1 for a dynamic dimension; the first is the batch")


class ModelVersionOut(BaseModel):
    """One immutable version of a model, as its file's inspection found it."""

    model_config = _RESPONSE

    name: str
    version: int = Field(ge=1)
    format: Literal["onnx", "torchscript"]
    sha256: str = Field(description="hex SHA-256 of the artifact's bytes")
    size_bytes: int = Field(ge=0)
    inputs: list[TensorOut]
    outputs: list[TensorOut]
    uri: str = Field(description="where the blob is: file:///... or s3://bucket/key")
    created_at: datetime


class ModelPushOut(ModelVersionOut):
    """A push's answer: the version, and whether this push made it."""

    created: bool = Field(
        description="false: the model's newest version holds these bytes, format, inputs and"
        " outputs already and is answered (200) instead of a new one (201)"
    )


class ModelOut(BaseModel):
    """A model and its versions, oldest first."""

    model_config = _RESPONSE

    name: str
    versions: list[ModelVersionOut]


class ModelListOut(BaseModel):
    """Every version of every model, by name then version."""

    model_config = _RESPONSE

    models: list[ModelVersionOut]


def version_out(record: ModelVersionRecord) -> ModelVersionOut:
    document: dict[str, Any] = record.to_json()
    document["created_at"] = record.created_at
    return ModelVersionOut.model_validate(document)
