"""Model artifacts a user brings, as the worker and the control plane both see them.

This module is the small vocabulary that the registry (``controlplane.registry``), the launch
path (``provisioners.base.LaunchRequest.artifacts``), the worker agent and the Open Inference
Protocol code share, without torch or onnxruntime:

- :class:`TensorSpec`: one input or output of a model, named, typed with an Open Inference
  Protocol v2 datatype (``FP32``, ``INT64``, ...) and shaped, ``-1`` for a dynamic dimension.
  heteroplane batches queries along the first dimension, so a servable model's inputs and outputs
  have a dynamic first dimension; :meth:`TensorSpec.sample_shape` is the rest.
- :class:`ArtifactRef`: what a worker needs to load one model: the name it serves it as, the
  registry's name and version, the format, the sha256 of the file and where the file is
  (``file:///abs/path`` or ``s3://bucket/key``). :meth:`ArtifactRef.to_arg` and
  :meth:`ArtifactRef.from_arg` are its spelling on the worker's command line (``--artifact``).
- :func:`file_sha256`: what a reference's checksum is of. Fetching the file behind a reference
  (S3 through boto3) is :mod:`provisioners.fetch`'s, so that what imports this vocabulary (the app
  spec, the policies) does not reach a cloud client.

Like the rest of ``provisioners/``, it imports nothing else from the repository.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

__all__ = [
    "DATATYPES",
    "FAMILY_SIGNATURE",
    "FORMATS",
    "MAX_TENSOR_DIM",
    "NAME_PATTERN",
    "ArtifactError",
    "ArtifactRef",
    "ModelSignature",
    "TensorSpec",
    "datatype_of",
    "file_sha256",
    "numpy_dtype",
    "parse_artifact_inputs",
    "signature_document",
]

FORMATS: tuple[str, ...] = ("onnx", "torchscript")

# The Open Inference Protocol's tensor datatypes that heteroplane serves, and their numpy types
# (BYTES, strings, is not served: a model of strings is outside what the planner can profile).
DATATYPES: Mapping[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}

# A model name is a DNS label: lower-case letters, digits and '-', 1 to 63 characters, starting
# and ending with a letter or digit (it becomes part of URLs, S3 keys and file names).
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
_NAME = re.compile(NAME_PATTERN)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


class ArtifactError(Exception):
    """An artifact that cannot be used: a bad reference, a missing file, a wrong checksum. The
    message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy type of an Open Inference Protocol ``datatype``; :class:`ArtifactError` when it
    is not one heteroplane serves."""
    try:
        return DATATYPES[datatype]
    except KeyError:
        raise ArtifactError(
            f"datatype {datatype!r} is not served (one of {', '.join(DATATYPES)})"
        ) from None


def datatype_of(dtype: np.dtype[Any] | type) -> str:
    """The Open Inference Protocol datatype of a numpy type; :class:`ArtifactError` when none."""
    wanted = np.dtype(dtype)
    for name, candidate in DATATYPES.items():
        if candidate == wanted:
            return name
    raise ArtifactError(f"numpy type {wanted} has no Open Inference Protocol datatype served")


# The most a tensor's dimension may be (a signed 32-bit size; numpy refuses far less memory
# long before, and no model's signature names more).
MAX_TENSOR_DIM = 2**31 - 1


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor of a model: its datatype and its shape (``-1``: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ArtifactError("a tensor needs a name")
        numpy_dtype(self.datatype)
        if any((not isinstance(d, int)) or d < -1 for d in self.shape):
            raise ArtifactError(f"tensor {self.name!r}: bad shape {list(self.shape)}")
        if any(d > MAX_TENSOR_DIM for d in self.shape):
            # numpy refuses such a shape with "Maximum allowed dimension exceeded" and nothing
            # else: said here, naming the tensor.
            raise ArtifactError(
                f"tensor {self.name!r}: shape {list(self.shape)} has a dimension past"
                f" {MAX_TENSOR_DIM:,}, the most one may have"
            )

    @property
    def batched(self) -> bool:
        """Whether the first dimension is dynamic (heteroplane batches along it)."""
        return len(self.shape) >= 1 and self.shape[0] == -1

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample: the shape without its first (batch) dimension."""
        return self.shape[1:]

    @property
    def dtype(self) -> np.dtype[Any]:
        return numpy_dtype(self.datatype)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> TensorSpec:
        """A tensor from ``{"name", "datatype", "shape"}``; :class:`ArtifactError` when
        malformed."""
        try:
            name = document["name"]
            datatype = document["datatype"]
            shape = document["shape"]
        except (KeyError, TypeError):
            raise ArtifactError("a tensor needs 'name', 'datatype' and 'shape'") from None
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise ArtifactError("a tensor's 'name' and 'datatype' are strings")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise ArtifactError(f"tensor {name!r}: 'shape' must be a list of integers")
        return cls(name, datatype, tuple(shape))


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """A model's inputs and outputs, in order. Certainty (cascades) is read off the first
    output."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        """``{"inputs": [...], "outputs": [...]}`` as the registry and the protocol spell them."""
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> ModelSignature:
        """The inverse of :meth:`to_json`; :class:`ArtifactError` when malformed."""
        try:
            inputs = document["inputs"]
            outputs = document["outputs"]
        except (KeyError, TypeError):
            raise ArtifactError("a signature needs 'inputs' and 'outputs'") from None
        if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
            raise ArtifactError("a signature's 'inputs' (non-empty) and 'outputs' are lists")
        return cls(
            tuple(TensorSpec.from_json(t) for t in inputs),
            tuple(TensorSpec.from_json(t) for t in outputs),
        )


def signature_document(
    inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> dict[str, list[dict[str, Any]]]:
    """``{"inputs": [...], "outputs": [...]}`` as the registry and the protocol spell them."""
    return ModelSignature(tuple(inputs), tuple(outputs)).to_json()


# The demo family's models (provisioners.worker.family: raw 8x8 pixels in, ten logits out), as
# the Open Inference Protocol sees them; what a worker serving a family model by name answers.
FAMILY_SIGNATURE = ModelSignature(
    (TensorSpec("input", "FP32", (-1, 64)),),
    (TensorSpec("logits", "FP32", (-1, 10)),),
)


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """One model for a worker to load: served as ``name``; the registry's ``model`` at
    ``version``; its ``format`` and ``sha256``; ``uri`` where the file is; ``inputs``, the input
    signature the registry stored, for a TorchScript module whose archive does not name its
    inputs (pushed with ``--inputs``: the worker cannot read them off the file); empty when the
    file says them itself."""

    name: str
    model: str
    version: int
    format: str
    sha256: str
    uri: str
    inputs: tuple[TensorSpec, ...] = ()

    def __post_init__(self) -> None:
        # fullmatch: "$" also matches before a trailing newline.
        if not _NAME.fullmatch(self.name) and not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", self.name):
            raise ArtifactError(f"artifact served as {self.name!r}: not a model name")
        if not _NAME.fullmatch(self.model):
            raise ArtifactError(f"registry model {self.model!r} is not a DNS label")
        if self.version < 1:
            raise ArtifactError(f"version must be >= 1, got {self.version}")
        if self.format not in FORMATS:
            raise ArtifactError(f"format {self.format!r} is not one of {', '.join(FORMATS)}")
        if not _SHA256.fullmatch(self.sha256):
            raise ArtifactError("sha256 must be 64 lower-case hex digits")
        if urlparse(self.uri).scheme not in ("file", "s3"):
            raise ArtifactError(f"artifact uri {self.uri!r}: expected file:// or s3://")

    def to_arg(self) -> str:
        """The worker's ``--artifact`` value: ``name:model:version:format:sha256:uri``."""
        return ":".join(
            (self.name, self.model, str(self.version), self.format, self.sha256, self.uri)
        )

    @classmethod
    def from_arg(cls, text: str) -> ArtifactRef:
        """Parse :meth:`to_arg`'s spelling; :class:`ArtifactError` when it is not one."""
        parts = text.split(":", 5)
        if len(parts) != 6:
            raise ArtifactError(
                f"--artifact {text!r}: expected NAME:MODEL:VERSION:FORMAT:SHA256:URI"
            )
        name, model, version, fmt, sha256, uri = parts
        try:
            number = int(version)
        except ValueError:
            raise ArtifactError(
                f"--artifact {text!r}: version {version!r} is not a number"
            ) from None
        return cls(name, model, number, fmt, sha256, uri)

    def worker_options(self) -> list[tuple[str, str]]:
        """The worker's command-line options for this artifact, as (option, value):
        ``--artifact`` (:meth:`to_arg`) and, when the reference carries its inputs,
        ``--artifact-inputs NAME=JSON`` (:func:`parse_artifact_inputs` reads it back)."""
        options = [("--artifact", self.to_arg())]
        if self.inputs:
            specs = [spec.to_json() for spec in self.inputs]
            text = json.dumps(specs, separators=(",", ":"), ensure_ascii=False)
            options.append(("--artifact-inputs", f"{self.name}={text}"))
        return options

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": self.name,
            "model": self.model,
            "version": self.version,
            "format": self.format,
            "sha256": self.sha256,
            "uri": self.uri,
        }
        if self.inputs:
            document["inputs"] = [spec.to_json() for spec in self.inputs]
        return document


def parse_artifact_inputs(text: str) -> tuple[str, tuple[TensorSpec, ...]]:
    """The served name and the inputs of a worker's ``--artifact-inputs NAME=JSON`` value
    (:meth:`ArtifactRef.worker_options`); :class:`ArtifactError` when it is not one.

    >>> parse_artifact_inputs('m=[{"name":"x","datatype":"FP32","shape":[-1,4]}]')
    ('m', (TensorSpec(name='x', datatype='FP32', shape=(-1, 4)),))
    """
    name, equals, spec_text = text.partition("=")
    if not equals or not name:
        raise ArtifactError(f"--artifact-inputs {text!r}: expected NAME=JSON")
    try:
        document = json.loads(spec_text)
    except ValueError:
        raise ArtifactError(f"--artifact-inputs for {name!r}: not JSON") from None
    if not isinstance(document, list) or not document:
        raise ArtifactError(f"--artifact-inputs for {name!r}: expected a list of tensors")
    return name, tuple(TensorSpec.from_json(entry) for entry in document)


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
