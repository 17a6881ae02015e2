"""A model's rows on the wire to a worker and its answer back: the Open Inference Protocol v2
(REST; the request in binary tensors, the answer in JSON) as the dispatcher speaks it
(:class:`ModelIO`), the answer as the dispatcher reads it (:class:`WorkerReply`), and the raw
outputs handed back to ``/v2`` callers (:func:`stack_outputs`).

A *row* is one sample of a query: for a model of one input, that input's sample (a flat sequence
of numbers, the sample's values in row-major order, or a numpy array of the sample's shape); for
a model of several inputs, a tuple of them, one per input in the signature's order. A batch of
rows is sent as ``POST /v2/models/{model}/infer`` with each input's samples stacked along the
first (batch) dimension; the answer's first output gives, per row, the prediction (the index of
the largest value of the row's sample) and the certainty, from the softmax ``p`` of the sample:

- ``margin``: ``p(1) - p(2)``, the top-1 minus the top-2 probability (the cascade's certainty of
  the demo family: :mod:`provisioners.worker.family`);
- ``max_prob``: ``p(1)``.

A first output of one value per sample (a score, a label) gives certainty 1.0 and, for an
integer or boolean output, the value itself as the prediction (0 for a float one).

``parameters.served_ms`` and ``parameters.instance_type`` are read when the worker gives them
(the worker agent does; another Open Inference Protocol server does not: None and ``""``).

Speed: the dispatcher encodes and decodes every batch on the event loop that serves the API
(``benchmarks/serving_speed/dispatcher.py``). Encoding stacks each input's samples into one array
of its type (rows of flat lists flattened with :func:`itertools.chain` into one ``np.asarray``),
checks it as the worker would and writes its bytes after a small JSON part (Triton's binary
tensor extension, :func:`~provisioners.worker.oip.binary_request_body`): a CNN's [3, 32, 32]
FP32 sample as JSON text was 60 KB and about 115 us of the event loop, as bytes 12 KB and 10 us.
Decoding computes the softmax in plain Python for small answers (up to :data:`_PY_VALUES`
values: numpy's fixed cost per call, about 8 us for ten logits, is four times Python's there)
and with numpy above. The two agree to a few ulps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any
from urllib.parse import quote

import numpy as np
import orjson

from controlplane.errors import WorkerCallError
from provisioners.artifacts import (
    FAMILY_SIGNATURE,
    ArtifactError,
    ModelSignature,
    TensorSpec,
    numpy_dtype,
)
from provisioners.worker.oip import OipError, binary_request_body, tensor_values

__all__ = [
    "CERTAINTY_KINDS",
    "ModelIO",
    "ModelIOError",
    "ReplyTensor",
    "Row",
    "WorkerReply",
    "app_signature",
    "stack_outputs",
]

CERTAINTY_KINDS: tuple[str, ...] = ("margin", "max_prob")

# A row: one input's sample, or a tuple of the samples of each input (see the module docstring).
Row = Any

# Answers with at most this many values in their first output are decoded in plain Python.
_PY_VALUES = 64


class ModelIOError(ValueError):
    """Rows that cannot be encoded against the model's signature (one line)."""


class ReplyTensor:
    """One output of a worker's answer, as received: ``shape`` (batch first) and ``data`` (the
    values, flat or nested as the worker sent them). A plain slotted class, not a frozen
    dataclass: one is made per output of every batch, and a frozen dataclass' ``__init__`` costs
    several times as much. Treat it as immutable."""

    __slots__ = ("data", "datatype", "name", "shape")

    def __init__(self, name: str, datatype: str, shape: tuple[int, ...], data: list[Any]) -> None:
        self.name = name
        self.datatype = datatype
        self.shape = shape
        self.data = data

    def __repr__(self) -> str:
        return f"ReplyTensor({self.name!r}, {self.datatype}, {list(self.shape)})"

    def array(self) -> np.ndarray:
        """The values as an array of the datatype's numpy type and ``shape``."""
        try:
            dtype = numpy_dtype(self.datatype)
        except ArtifactError:
            dtype = np.dtype(np.float64)
        return np.asarray(self.data, dtype=dtype).reshape(self.shape)


@dataclass(frozen=True, slots=True)
class WorkerReply:
    """A worker's answer to one batch: per row its prediction and certainty (see the module
    docstring); ``served_ms`` the batch's service time on the worker (compute plus emulation
    padding; None when the worker does not say), ``instance_type`` what the worker runs as
    (``""`` when it does not say); ``outputs`` every output as received (the raw outputs of
    ``/v2``)."""

    predictions: tuple[int, ...]
    certainty: tuple[float, ...]
    served_ms: float | None
    instance_type: str
    outputs: tuple[ReplyTensor, ...] = ()


class ModelIO:
    """How the dispatcher talks to one model: its name, signature (:data:`~provisioners.
    artifacts.FAMILY_SIGNATURE` for a model of the demo family), certainty kind
    (:data:`CERTAINTY_KINDS`) and whether it is a family model (``family``: ``/v1`` checks its
    inputs as pixels). :meth:`encode` spells a batch's request body, :meth:`decode` reads the
    answer."""

    __slots__ = (
        "_first",
        "_fixed",
        "_integral",
        "certainty",
        "family",
        "model",
        "path",
        "signature",
        "varies",
    )

    def __init__(
        self,
        model: str,
        signature: ModelSignature = FAMILY_SIGNATURE,
        certainty: str = "margin",
        *,
        family: bool | None = None,
    ) -> None:
        if certainty not in CERTAINTY_KINDS:
            raise ValueError(f"certainty {certainty!r} is not one of {', '.join(CERTAINTY_KINDS)}")
        if not signature.inputs or not signature.outputs:
            raise ValueError(f"model {model!r}: a signature needs inputs and outputs")
        self.model = model
        self.signature = signature
        self.certainty = certainty
        self.family = signature == FAMILY_SIGNATURE if family is None else family
        self.path = f"/v2/models/{quote(model, safe='')}/infer"
        # Per input, its sample shape when the signature fixes it (no -1 after the batch).
        self._fixed = tuple(
            spec.sample_shape if all(d >= 0 for d in spec.sample_shape) else None
            for spec in signature.inputs
        )
        # Whether a sample's shape may differ from query to query (a dynamic dimension past the
        # batch: a sequence's length), so that not any rows stack in one batch (stack_key).
        self.varies = any(fixed is None for fixed in self._fixed)
        first = signature.outputs[0]
        self._first = first.name
        self._integral = first.dtype.kind in "biu"

    def __repr__(self) -> str:
        return f"ModelIO({self.model!r}, {self.certainty})"

    # --- requests -------------------------------------------------------------------------------

    def encode(self, rows: Sequence[Row], timeout_s: float | None = None) -> tuple[bytes, int]:
        """The ``POST /v2/models/{model}/infer`` body of ``rows`` (one batch, in order) in binary
        tensors, and the size of its JSON part (the header
        :data:`~provisioners.worker.oip.HEADER_LENGTH`); :class:`ModelIOError` when a row does
        not fit the signature or holds a value its input's type does not (the worker's own check,
        :func:`~provisioners.worker.oip.tensor_values`, made here: a refusal costs no call).
        ``timeout_s``: the call's timeout, sent as the protocol's ``parameters.timeout``
        (microseconds): the agent runs a failed batch's rows again alone within half of it."""
        if not rows:
            raise ModelIOError("a batch needs at least one row")
        inputs = self.signature.inputs
        if len(inputs) == 1:
            columns: Sequence[Sequence[Any]] = (rows,)
        else:
            try:
                columns = tuple(zip(*rows, strict=True))
            except (TypeError, ValueError):
                raise ModelIOError(
                    f"model {self.model!r} takes {len(inputs)} inputs: each row is a tuple of"
                    f" {len(inputs)} samples"
                ) from None
            if len(columns) != len(inputs):
                raise ModelIOError(f"model {self.model!r} takes {len(inputs)} inputs per row")
        tensors = []
        for spec, fixed, column in zip(inputs, self._fixed, columns, strict=True):
            try:
                array = self._column(spec, fixed, column)
            except OipError as error:
                raise ModelIOError(str(error)) from None
            except (TypeError, ValueError, OverflowError) as error:
                if isinstance(error, ModelIOError):
                    raise
                raise ModelIOError(f"input {spec.name!r}: {error}") from None
            tensors.append((spec.name, spec.datatype, array))
        if timeout_s is None or not math.isfinite(timeout_s) or timeout_s <= 0:
            return binary_request_body(tensors)
        return binary_request_body(tensors, parameters={"timeout": math.ceil(timeout_s * 1e6)})

    def stack_key(self, row: Row) -> tuple[tuple[int, ...], ...]:
        """The shapes ``row``'s samples come in, one per input: rows of equal keys stack in one
        batch (:meth:`encode` refuses samples of one batch that differ in shape). Meant where
        :attr:`varies`; a flat sample (``/v1``'s) counts as its length."""
        samples = (row,) if len(self.signature.inputs) == 1 else tuple(row)
        return tuple(
            sample.shape if isinstance(sample, np.ndarray | np.generic) else np.shape(sample)
            for sample in samples
        )

    def _column(
        self, spec: TensorSpec, fixed: tuple[int, ...] | None, column: Sequence[Any]
    ) -> np.ndarray:
        """One input's samples stacked: an array of the input's type, batch first."""
        # A rank-1 input's rows from /v2 are numpy scalars (a 1-D array's items), not sequences.
        if fixed is not None and not any(isinstance(r, (np.ndarray, np.generic)) for r in column):
            width = math.prod(fixed)
            flat = list(chain.from_iterable(column))
            if len(flat) != width * len(column):
                raise ModelIOError(
                    f"input {spec.name!r}: each sample holds {width} values"
                    f" (shape {list(spec.sample_shape)})"
                )
            return _checked(spec, flat).reshape((len(column), *fixed))
        samples = [self._sample(spec, fixed, r) for r in column]
        shape = samples[0].shape
        if any(s.shape != shape for s in samples):
            raise ModelIOError(
                f"input {spec.name!r}: the samples of one batch differ in shape"
                " (a dynamic dimension): they cannot be stacked"
            )
        stacked = np.stack(samples)
        return _checked(spec, stacked).reshape(stacked.shape)

    def _sample(self, spec: TensorSpec, fixed: tuple[int, ...] | None, row: Any) -> np.ndarray:
        sample = _array_of(spec, row)  # its values are checked stacked (_checked)
        wanted = spec.sample_shape
        if fixed is not None:
            if sample.size != math.prod(fixed):
                raise ModelIOError(
                    f"input {spec.name!r}: each sample holds {math.prod(fixed)} values"
                    f" (shape {list(wanted)})"
                )
            return sample.reshape(fixed)
        if sample.ndim == len(wanted):
            return sample
        resolved = resolve_sample_shape(spec, sample.size)
        if resolved is None:
            raise ModelIOError(
                f"input {spec.name!r}: a flat sample of {sample.size} values does not give"
                f" shape {list(wanted)}"
            )
        return sample.reshape(resolved)

    # --- answers --------------------------------------------------------------------------------

    def decode(self, address: str, body: bytes, rows: int) -> WorkerReply:
        """The answer ``body`` of the worker at ``address`` to a batch of ``rows`` rows;
        ``malformed`` :class:`~controlplane.errors.WorkerCallError` when it is not one (the
        worker's fault), ``model`` when it is one whose first output does not fit the batch (the
        model's: it answered, so the worker stays as healthy as it was). A model's NaN or
        infinity comes as JSON's ``NaN``/``Infinity`` (Python's and Triton's JSON write them),
        which orjson refuses: such an answer is read with the standard library's parser."""
        try:
            try:
                document = orjson.loads(body)
            except orjson.JSONDecodeError:
                document = json.loads(body)
            outputs = tuple([_tensor(entry) for entry in document["outputs"]])
            parameters = document.get("parameters") or {}
            served = parameters.get("served_ms")
            instance_type = parameters.get("instance_type")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise WorkerCallError(
                address, "malformed", f"not an inference answer: {error}"
            ) from None
        if not outputs:
            raise WorkerCallError(address, "malformed", "an inference answer without outputs")
        first = outputs[0]
        if first.name != self._first:
            first = next((t for t in outputs if t.name == self._first), first)
        try:
            predictions, certainty = self._read(first, rows)
        except (ValueError, TypeError) as error:
            raise WorkerCallError(
                address, "model", f"output {first.name!r}: {error}", worker_fault=False
            ) from None
        served_ms = float(served) if isinstance(served, int | float) else None
        if served_ms is not None and not (math.isfinite(served_ms) and served_ms >= 0):
            served_ms = None
        kind = instance_type if isinstance(instance_type, str) else ""
        return WorkerReply(predictions, certainty, served_ms, kind, outputs)

    def _read(self, tensor: ReplyTensor, rows: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Per row, the prediction and certainty of the first output (see the module
        docstring)."""
        shape = tensor.shape
        if not shape or shape[0] != rows:
            raise ValueError(f"shape {list(shape)} for a batch of {rows} rows")
        width = shape[1] if len(shape) == 2 else math.prod(shape[1:])
        data = tensor.data
        if data and isinstance(data[0], list):
            data = np.asarray(data, dtype=np.float64).ravel().tolist()
        if len(data) != rows * width:
            raise ValueError(f"{len(data)} values for shape {list(shape)}")
        if width <= 1:
            if width == 1 and self._integral:
                return tuple(int(v) for v in data), (1.0,) * rows
            return (0,) * rows, (1.0,) * rows
        if len(data) <= _PY_VALUES:
            return _softmax_py(data, rows, width, self.certainty == "margin")
        return _softmax_np(data, rows, width, self.certainty == "margin")


def _checked(spec: TensorSpec, values: Any) -> np.ndarray:
    """``values`` as a flat array of ``spec``'s type, checked as the worker checks them; a NaN
    or an infinity (which a JSON body could not carry either) is refused by name."""
    array = values if isinstance(values, np.ndarray) else _array_of(spec, values)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ModelIOError(f"input {spec.name!r}: NaN or infinity is not a value a model is sent")
    return tensor_values(array, spec)


def _array_of(spec: TensorSpec, values: Any) -> np.ndarray:
    """``values`` (a query's lists) as an array; integers past 2**63 beside smaller ones, which
    numpy reads as floats, as UINT64's when :func:`tensor_values` finds them so (else its
    one-line refusal)."""
    array = np.asarray(values)
    if array.dtype.kind == "f" and spec.dtype.kind in "iu" and isinstance(values, list):
        return tensor_values(values, spec).reshape(array.shape)
    return array


def _tensor(entry: Mapping[str, Any]) -> ReplyTensor:
    data = entry["data"]
    if not isinstance(data, list):
        raise TypeError("'data' is not a list")
    return ReplyTensor(
        str(entry["name"]), str(entry["datatype"]), tuple(map(int, entry["shape"])), data
    )


def _softmax_py(
    data: Sequence[float], rows: int, width: int, margin: bool
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    exp = math.exp
    predictions = []
    certainty = []
    for start in range(0, rows * width, width):
        row = data[start : start + width]
        top = max(row)
        best = row.index(top)
        weights = [exp(v - top) for v in row]
        total = sum(weights)
        if margin:
            weights[best] = -1.0
            certainty.append((1.0 - max(weights)) / total)
        else:
            certainty.append(1.0 / total)
        predictions.append(best)
    return tuple(predictions), tuple(certainty)


def _softmax_np(
    data: Sequence[float], rows: int, width: int, margin: bool
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    values = np.asarray(data, dtype=np.float64).reshape(rows, width)
    best = values.argmax(axis=1)
    weights = np.exp(values - values.max(axis=1, keepdims=True))
    total = weights.sum(axis=1)
    if margin:
        second = np.partition(weights, width - 2, axis=1)[:, width - 2]
        certainty = (1.0 - second) / total
    else:
        certainty = 1.0 / total
    return tuple(best.tolist()), tuple(certainty.tolist())


def resolve_sample_shape(spec: TensorSpec, size: int) -> tuple[int, ...] | None:
    """The sample shape of ``spec`` that ``size`` values fill: the signature's when it fixes
    every dimension, with its one dynamic dimension (``-1``) worked out when it has one; None
    when ``size`` does not fit (or more than one dimension is dynamic)."""
    sample = spec.sample_shape
    dynamic = [i for i, d in enumerate(sample) if d < 0]
    known = math.prod(d for d in sample if d >= 0)
    if not dynamic:
        return sample if size == known else None
    if len(dynamic) > 1 or known == 0 or size % known or size == 0:
        return None
    resolved = list(sample)
    resolved[dynamic[0]] = size // known
    return tuple(resolved)


def app_signature(ios: Sequence[ModelIO]) -> ModelSignature:
    """What an app of these models (in serving order) takes and answers on ``/v2``: the first
    model's inputs (a cascade's members share them) and the last model's outputs (the most
    accurate model, which answers whatever the cascade forwards)."""
    return ModelSignature(ios[0].signature.inputs, ios[-1].signature.outputs)


def stack_outputs(
    replies: Sequence[tuple[WorkerReply, int]], names: Sequence[str]
) -> list[tuple[str, str, np.ndarray]]:
    """The raw outputs ``names`` of a request, one row per sample in the request's order:
    ``replies[i]`` is the reply that answered sample i and the sample's row in its batch
    (:attr:`~controlplane.serving.dispatcher.InferResult.replies`). Returns (name, datatype,
    array of the samples stacked). :class:`ModelIOError` when a reply lacks an output or the
    answering models' outputs differ in datatype or sample shape."""
    arrays: dict[tuple[int, str], tuple[str, np.ndarray]] = {}
    stacked = []
    for name in names:
        datatype = ""
        samples = []
        for reply, row in replies:
            key = (id(reply), name)
            found = arrays.get(key)
            if found is None:
                tensor = next((t for t in reply.outputs if t.name == name), None)
                if tensor is None:
                    raise ModelIOError(f"the worker's answer has no output {name!r}")
                try:
                    found = (tensor.datatype, tensor.array())
                except ValueError as error:
                    raise ModelIOError(f"output {name!r}: {error}") from None
                arrays[key] = found
            if datatype and found[0] != datatype:
                raise ModelIOError(
                    f"output {name!r}: the answering models differ in datatype"
                    f" ({datatype}, {found[0]})"
                )
            datatype = found[0]
            samples.append(found[1][row])
        if len(samples) == 1:  # one sample (the common query): a view of its row, no copy
            stacked.append((name, datatype, samples[0][np.newaxis]))
            continue
        if any(s.shape != samples[0].shape for s in samples):
            raise ModelIOError(f"output {name!r}: the answering models differ in sample shape")
        stacked.append((name, datatype, np.stack(samples)))
    return stacked
