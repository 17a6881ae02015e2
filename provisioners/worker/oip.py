"""The Open Inference Protocol v2 (REST, JSON tensors) against a model's signature.

This module owns what an inference request and its answer look like on the wire, apart from any
HTTP server and without torch: :func:`parse_infer_request` checks a ``POST /v2/models/{m}/infer``
body against the model's :class:`~provisioners.artifacts.ModelSignature` and turns its tensors
into numpy arrays of the signature's types; :func:`infer_response` and :func:`encode_tensor`
spell the answer; :func:`model_metadata` is ``GET /v2/models/{m}``. The worker agent
(:mod:`provisioners.worker.agent`) serves these; the control plane's ``/v2`` routes may reuse
the same pure functions.

A request (https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/)::

    {"id"?: str, "parameters"?: {...},
     "inputs": [{"name", "shape": [b, ...], "datatype": "FP32", "data": [...]}, ...],
     "outputs"?: [{"name"}, ...]}

Every input of the signature is given once, with the signature's datatype; ``data`` is the
row-major flattened list or the same values nested, holding exactly prod(shape) values;
``shape[0]``, the batch size, is 1..``max_batch_size`` and the same for every input; the other
dimensions equal the signature's where it fixes them (not ``-1``). Values are cast to the
signature's numpy type exactly; an integer type takes integers in its range, ``BOOL`` takes
``true``/``false``, a float type takes numbers finite in it. An output's only parameter served
is ``binary_data`` (shared memory and classification are refused, not ignored). A refusal is an
:class:`OipError` (status 400, 404 for an unknown model) whose one-line message names the input.

Conversion is numpy's (one ``np.asarray`` per tensor), not a loop over values: the worker parses
every batch on the serving path. A JSON tensor of a numeric type is also searched for booleans
(numpy reads ``[true, 1.5]`` as floats), by the types of each innermost list, in C.

Strings (the ``id``, keys, names, ``parameters``) are UTF-8 text: a lone surrogate (``\\ud800``,
which Python's json reads) is refused when the body is read, before anything is served, and a
refusal that quotes the client's text escapes what is not UTF-8 in it.

**Binary tensors** (Triton's binary tensor data extension, which the control plane's dispatcher
sends every batch in): a body whose JSON part is followed by the inputs' raw bytes, the size of
the JSON part in the header :data:`HEADER_LENGTH`, each such input's byte count in its
``parameters.binary_data_size`` and no ``data`` (:func:`split_infer_body`,
:func:`with_binary_inputs`; :func:`binary_request_body` spells one). Values are little-endian,
row-major; they are checked as JSON values are (a NaN or a ``BOOL`` byte other than 0 or 1 is
refused). For a CNN's [3, 32, 32] FP32 sample the JSON text is about 60 KB, which the dispatcher
spent about 115 us writing and the worker about 100 us reading (``orjson`` and ``np.asarray``
of 3,072 numbers); its 12 KB of bytes take a few microseconds each way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import numpy as np
import orjson

from provisioners.artifacts import (
    ArtifactError,
    ModelSignature,
    TensorSpec,
    datatype_of,
    numpy_dtype,
)

__all__ = [
    "HEADER_LENGTH",
    "MODEL_VERSION",
    "WORKER_PROTOCOL",
    "InferRequest",
    "OipError",
    "binary_request_body",
    "decode_tensor",
    "encode_tensor",
    "infer_response",
    "load_json",
    "model_metadata",
    "parse_infer_request",
    "requested_outputs",
    "split_infer_body",
    "tensor_values",
    "value_count_error",
    "with_binary_inputs",
]

# A worker serves one version of each model name (the registry's version is in the name's
# artifact reference); the protocol's version string for it.
MODEL_VERSION = "1"
# Triton's binary tensor extension: the size of the JSON part of a body whose binary parts (the
# tensors' raw bytes, in the order of the inputs that have them) follow it.
HEADER_LENGTH = "Inference-Header-Content-Length"
# What a worker agent of this release reads, in its /health answer (``protocol``), which the
# control plane's liveness probe checks: 2, the protocol's JSON bodies and Triton's binary
# tensors, in which the dispatcher sends every batch (since 2026-11-29; the agents said no
# protocol until 2026-12-06, and those of before 2026-11-29, JSON only, cannot be told from the
# others by /health). A later change of what the dispatcher sends raises it, so that a worker an
# older release started (kept running across an upgrade and adopted) is replaced.
WORKER_PROTOCOL = 2

# The largest finite value of each float type, and of a 64-bit integer (what tensor_values checks).
_FLOAT_MAX = {np.dtype(t): float(np.finfo(t).max) for t in (np.float16, np.float32, np.float64)}
_INT_MAX = float(2**64)

# The longest refusal message (the API's limit, controlplane.api.errors).
MAX_MESSAGE_CHARS = 500
_REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
_INPUT_KEYS = frozenset({"name", "shape", "datatype", "data", "parameters"})
_OUTPUT_KEYS = frozenset({"name", "parameters"})
# The output parameters served: the binary tensor extension's switch. Shared memory
# (shared_memory_region, ...) and classification (Triton's class_count) would change what is
# answered, so they are refused rather than ignored.
_OUTPUT_PARAMETERS = frozenset({"binary_data"})


class OipError(Exception):
    """A request the protocol refuses: ``status`` is the HTTP status, the message one line.

    The message may quote the client's text: what is not UTF-8 in it (a lone surrogate that
    JSON's ``\\ud800`` spells) is written as its escape, so that the error body can always be
    encoded; and it is cut at :data:`MAX_MESSAGE_CHARS`, as the API's own messages are, so that
    a quoted name or version of any length stays a line (over gRPC the message travels in a
    header, which a client refuses past 16 KiB: it had seen RESOURCE_EXHAUSTED, "received
    metadata size exceeds hard limit", not the refusal).
    """

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        line = " ".join(message.split()).encode("utf-8", "backslashreplace").decode("utf-8")
        if len(line) > MAX_MESSAGE_CHARS:
            line = line[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(line)
        self.status = int(status)


@dataclass(frozen=True, slots=True, eq=False)
class InferRequest:
    """One checked inference request: ``inputs`` by name in the signature's order, each of the
    signature's numpy type and ``batch_size`` rows; ``outputs``: the output names asked for, in
    the order asked (``None``: all, in the signature's order)."""

    inputs: dict[str, np.ndarray]
    batch_size: int
    id: str | None = None
    outputs: tuple[str, ...] | None = None


def load_json(body: bytes | str) -> Any:
    """A request body as JSON; :class:`OipError` (400) when it is not (``NaN`` and
    ``Infinity``, which JSON does not have, included) or is nested too deeply to read (the
    worker agent's handler had died on the RecursionError, the connection closed unanswered)."""
    try:  # orjson parses a tensor's numbers several times faster, and refuses NaN too
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass  # json's answer, word for word (and integers past 64 bits, which orjson refuses)
    try:
        document = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise OipError(f"body is not JSON: {error}") from None
    except RecursionError:  # nested past orjson's 1,024 levels and then past Python's stack
        raise OipError("body is not JSON this service takes: nested too deeply") from None
    # json takes a lone surrogate (\ud800), which orjson refuses: text that is not UTF-8,
    # which no answer could echo. Only this path can hold one.
    text = _text_not_utf8(document)
    if text is not None:
        raise OipError(f"body is not JSON this service takes: {text!a} is not UTF-8 text")
    return document


def _text_not_utf8(document: Any) -> str | None:
    """The first string (a key or a value) of ``document`` that UTF-8 cannot encode (one with a
    lone surrogate), or None."""
    pending = [document]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return value if len(value) <= 40 else value[:40] + "..."
    return None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def parse_infer_request(
    document: Mapping[str, Any] | bytes | str,
    signature: ModelSignature,
    *,
    max_batch_size: int,
) -> InferRequest:
    """Check an infer request (a body, or its JSON already decoded) against ``signature``.

    Raises :class:`OipError` (400) naming the field on any mismatch (see the module
    docstring).
    """
    if isinstance(document, bytes | str):
        document = load_json(document)
    if not isinstance(document, Mapping):
        raise OipError("body must be a JSON object")
    if not _REQUEST_KEYS.issuperset(document):
        unknown = sorted(set(document) - _REQUEST_KEYS)
        raise OipError(f"unknown keys: {', '.join(map(str, unknown))}")
    _check_parameters(document, "'parameters'")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise OipError("'id' must be a string")
    entries = document.get("inputs")
    if not isinstance(entries, list) or not entries:
        raise OipError("'inputs' must be a non-empty list of tensors")
    specs = {spec.name: spec for spec in signature.inputs}
    given: dict[str, Mapping[str, Any]] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise OipError(f"inputs[{index}] must be an object")
        name = entry.get("name")
        if not isinstance(name, str):
            raise OipError(f"inputs[{index}]: 'name' must be a string")
        if name not in specs:
            raise OipError(
                f"input {name!r} is not an input of the model (inputs: {', '.join(specs)})"
            )
        if name in given:
            raise OipError(f"input {name!r} is given twice")
        given[name] = entry
    if len(given) != len(specs):  # each one given is one of specs, once
        missing = next(name for name in specs if name not in given)
        raise OipError(f"input {missing!r} is missing")
    arrays: dict[str, np.ndarray] = {}
    batch_size: int | None = None
    first = ""
    for spec in signature.inputs:
        array = decode_tensor(given[spec.name], spec, max_batch_size=max_batch_size)
        rows = int(array.shape[0])
        if batch_size is None:
            batch_size, first = rows, spec.name
        elif rows != batch_size:
            raise OipError(
                f"input {spec.name!r}: batch size {rows} differs from input {first!r}'s"
                f" {batch_size}"
            )
        arrays[spec.name] = array
    assert batch_size is not None
    outputs = requested_outputs(document.get("outputs"), signature)
    return InferRequest(arrays, batch_size, request_id, outputs)


def requested_outputs(entries: object, signature: ModelSignature) -> tuple[str, ...] | None:
    """The ``outputs`` of a request: ``None`` when absent (all of them), else the names asked
    for, each an output of ``signature`` and asked once, with no parameters but
    ``binary_data`` (shared memory and classification are not served)."""
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise OipError("'outputs' must be a list of {\"name\": ...}")
    known = [spec.name for spec in signature.outputs]
    names: list[str] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise OipError(f"outputs[{index}] must be an object with a 'name'")
        unknown = sorted(set(entry) - _OUTPUT_KEYS)
        if unknown:
            raise OipError(f"outputs[{index}]: unknown keys: {', '.join(map(str, unknown))}")
        _check_parameters(entry, f"outputs[{index}]: 'parameters'")
        name = entry["name"]
        if name not in known:
            raise OipError(
                f"output {name!r} is not an output of the model (outputs: {', '.join(known)})"
            )
        unserved = sorted(set(entry.get("parameters") or ()) - _OUTPUT_PARAMETERS)
        if unserved:
            raise OipError(
                f"output {name!r}: parameters are not served ({', '.join(map(str, unserved))})"
            )
        if name in names:
            raise OipError(f"output {name!r} is asked for twice")
        names.append(name)
    return tuple(names)


def decode_tensor(entry: Mapping[str, Any], spec: TensorSpec, *, max_batch_size: int) -> np.ndarray:
    """One request tensor as an array of ``spec``'s numpy type and the request's shape;
    :class:`OipError` naming the input when its datatype, shape or values do not fit ``spec``."""
    name = spec.name
    if not _INPUT_KEYS.issuperset(entry):
        unknown = sorted(set(entry) - _INPUT_KEYS)
        raise OipError(f"input {name!r}: unknown keys: {', '.join(map(str, unknown))}")
    if "parameters" in entry:
        _check_parameters(entry, f"input {name!r}: 'parameters'")
    datatype = entry.get("datatype")
    if datatype != spec.datatype:
        raise OipError(f"input {name!r}: datatype {datatype!r}, expected {spec.datatype!r}")
    shape = _shape(entry.get("shape"), spec, max_batch_size)
    data = entry.get("data")
    if not isinstance(data, list | np.ndarray):  # an array: binary data (with_binary_inputs)
        raise OipError(f"input {name!r}: 'data' must be a list of values")
    count = math.prod(shape)
    array = tensor_values(data, spec)
    if array.size != count:
        raise value_count_error(name, array.size, shape)
    return array.reshape(shape)


def value_count_error(name: str, held: int, shape: Sequence[int]) -> OipError:
    """The refusal of an input whose values are not as many as its ``shape`` holds (REST's
    ``data``, gRPC's typed contents alike)."""
    return OipError(
        f"input {name!r}: 'data' holds {held} values, shape {list(shape)} needs {math.prod(shape)}"
    )


def _check_parameters(entry: Mapping[str, Any], field: str) -> None:
    """A request's, an input's or an output's ``parameters``, when given, is an object (the
    protocol's ``$parameters``; neither its text nor ``tritonclient`` has a null one)."""
    if "parameters" in entry and not isinstance(entry["parameters"], Mapping):
        given = type(entry["parameters"]).__name__.replace("NoneType", "null")
        raise OipError(f"{field} must be an object, got {given}")


def _holds_bool(data: list[Any]) -> bool:
    """Whether flat or nested ``data`` holds a ``true`` or ``false``: numpy makes ``[true,
    1.5]`` a float array, so the array cannot tell. One set of types per innermost list, built
    in C: about as long as ``np.asarray`` of the values takes."""
    pending = [data]
    while pending:
        values = pending.pop()
        kinds = set(map(type, values))
        if bool in kinds:
            return True
        if list in kinds:
            pending.extend(value for value in values if type(value) is list)
    return False


def _shape(shape: object, spec: TensorSpec, max_batch_size: int) -> tuple[int, ...]:
    name = spec.name
    # type(d) is int: JSON's integers (a bool is not one, nor is a float)
    if type(shape) is not list or not all(type(d) is int for d in shape):
        raise OipError(f"input {name!r}: 'shape' must be a list of integers")
    if len(shape) != len(spec.shape):
        raise OipError(
            f"input {name!r}: shape {shape} has {len(shape)} dimensions, expected"
            f" {len(spec.shape)} like {list(spec.shape)}"
        )
    if not 1 <= shape[0] <= max_batch_size:
        raise OipError(
            f"input {name!r}: batch size (shape[0]) {shape[0]} is outside 1..{max_batch_size}"
        )
    for index, (given, wanted) in enumerate(zip(shape, spec.shape, strict=True)):
        if given < 0 or (wanted != -1 and given != wanted):
            raise OipError(
                f"input {name!r}: shape {shape} does not fit {list(spec.shape)} (dimension {index})"
            )
    return tuple(shape)


def tensor_values(data: list[Any] | np.ndarray, spec: TensorSpec) -> np.ndarray:
    """``data`` (flat or nested lists, or an array) as a flat array of ``spec``'s type, checked
    value by kind (see the module docstring); :class:`OipError` naming the input."""
    name, dtype = spec.name, spec.dtype
    try:
        raw = data if isinstance(data, np.ndarray) else np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        raw = None  # ragged nesting
    # JSON numbers give an integer or float array, booleans alone a bool one; strings, nulls,
    # objects, ragged nesting or integers past 64 bits give none of these.
    if raw is None or raw.dtype.kind not in "biuf":
        raise OipError(
            f"input {name!r}: 'data' must hold {spec.datatype} values (flat or nested lists)"
        )
    if raw.size == 0:
        return raw.astype(dtype).reshape(-1)
    kind = dtype.kind
    if kind == "b":
        if raw.dtype.kind != "b":
            raise OipError(f"input {name!r}: BOOL data must be true or false")
    elif kind in "iu":
        if raw.dtype.kind == "f" and isinstance(data, list):
            raw = _integers_past_int64(data, raw, spec)
        if raw.dtype.kind not in "iu" or (isinstance(data, list) and _holds_bool(data)):
            raise OipError(f"input {name!r}: {spec.datatype} data must be integers")
        limits = np.iinfo(dtype)
        if not np.can_cast(raw.dtype, dtype) and (raw.min() < limits.min or raw.max() > limits.max):
            raise _outside(spec)
    else:
        if raw.dtype.kind == "b" or (isinstance(data, list) and _holds_bool(data)):
            raise OipError(f"input {name!r}: {spec.datatype} data must be numbers")
        # Refused before the cast, which would make an overflow inf (a np.errstate around it
        # cost as much as the cast at thousands of queries a second). Floats no wider than the
        # input's type (binary tensors are of its type) fit it unless NaN or infinite: one
        # pass of isfinite, cheaper than max and min. Wider ones (JSON's numbers are read as
        # FP64) by max and min: a NaN makes both NaN, which fails both comparisons, so no
        # pass over the cast values is needed to find it. Integers (64 bits at most) are all
        # finite in FP32 and FP64: only FP16 needs their check.
        largest = _FLOAT_MAX[dtype]
        if raw.dtype.kind == "f" and raw.dtype.itemsize <= dtype.itemsize:
            fits = np.isfinite(raw).all()
        elif raw.dtype.kind == "f" or largest < _INT_MAX:
            fits = raw.max() <= largest and raw.min() >= -largest
        else:
            fits = True
        if not fits:
            raise OipError(f"input {name!r}: {_not_finite(raw, spec.datatype)}")
        return raw.astype(dtype).reshape(-1)
    return raw.astype(dtype).reshape(-1)


def _outside(spec: TensorSpec) -> OipError:
    limits = np.iinfo(spec.dtype)
    return OipError(
        f"input {spec.name!r}: a value lies outside {spec.datatype}'s {limits.min}..{limits.max}"
    )


def _integers_past_int64(data: list[Any], raw: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """Integers an integer input was given that numpy read as floats (``raw``): JSON integers
    of 2**63 and more beside smaller ones (64 bits would not hold them all as signed integers),
    as UINT64 when they fit it; ``raw`` itself when they are not all integers (the caller's
    error then says so), unless they are whole floats past 64 bits (and -2**63, which an integer
    just past it rounds to: a JSON reader gives an exact -2**63 as an integer), which orjson
    gives for a JSON integer past 64 bits."""
    values = np.asarray(data, dtype=object).reshape(-1)
    if not all(type(value) is int for value in values):  # a float, or a bool among them
        whole = np.isfinite(raw).all() and (raw == np.floor(raw)).all()
        top = 2.0**64 if spec.dtype.kind == "u" else 2.0**63
        if whole and (raw.max() >= top or raw.min() <= -(2.0**63)):
            raise _outside(spec)
        return raw
    if min(values) < 0 or max(values) > np.iinfo(np.uint64).max:
        raise _outside(spec)
    return np.asarray(values.tolist(), dtype=np.uint64).reshape(raw.shape)


def _not_finite(raw: np.ndarray, datatype: str) -> str:
    """Why float values ``raw`` do not fit ``datatype`` (a NaN, an infinity, or a value past its
    largest), once :func:`tensor_values` has found that one does not."""
    if raw.dtype.kind == "f" and np.isnan(raw).any():
        return f"a value is NaN: {datatype} inputs must be finite numbers"
    if raw.dtype.kind == "f" and np.isinf(raw).any():
        return f"a value is infinite: {datatype} inputs must be finite numbers"
    return f"a value is too large for {datatype}"


def split_infer_body(
    body: bytes, header_length: str | None, load: Callable[[bytes], Any] | None = None
) -> tuple[Any, bytes]:
    """An infer body's JSON part, decoded (by ``load``, :func:`load_json` by default), and its
    binary part: with no :data:`HEADER_LENGTH` (``header_length`` None) the whole body is JSON.
    :class:`OipError` when the length is not a size within the body."""
    load = load_json if load is None else load
    if header_length is None:
        return load(body), b""
    try:
        size = int(header_length)
    except ValueError:
        size = -1
    if not 0 <= size <= len(body):
        raise OipError(f"{HEADER_LENGTH} {header_length!r} is not a size within the body")
    return load(body[:size]), body[size:]


def with_binary_inputs(
    document: Mapping[str, Any], binary: bytes, signature: ModelSignature
) -> Mapping[str, Any]:
    """``document`` with the ``data`` of its binary inputs filled in from ``binary`` (in the
    order of the inputs; each an array of the input's type, read-only, over ``binary``'s bytes);
    :class:`OipError` naming the input when the sizes do not add up. What else is wrong with
    the document :func:`parse_infer_request` says."""
    entries = document.get("inputs")
    if not isinstance(entries, list):
        return document  # parse_infer_request says what is wrong
    if not binary and not any(isinstance(e, Mapping) and "parameters" in e for e in entries):
        return document  # a JSON-only query (the common one): nothing to fill in
    specs = {spec.name: spec for spec in signature.inputs}
    offset = 0
    filled = []
    for entry in entries:
        parameters = entry.get("parameters") if isinstance(entry, Mapping) else None
        size = parameters.get("binary_data_size") if isinstance(parameters, Mapping) else None
        if size is None:
            filled.append(entry)
            continue
        name = entry.get("name")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise OipError(f"input {name!r}: binary_data_size must be a byte count")
        if "data" in entry:
            raise OipError(f"input {name!r}: both 'data' and binary_data_size")
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise OipError(
                f"input {name!r} is not an input of the model (inputs: {', '.join(specs)})"
            )
        # Before the bytes are counted in the input's item size: a wrong datatype is the cause.
        datatype = entry.get("datatype")
        if datatype != spec.datatype:
            raise OipError(f"input {name!r}: datatype {datatype!r}, expected {spec.datatype!r}")
        chunk = binary[offset : offset + size]
        if len(chunk) != size:
            raise OipError(f"input {name!r}: the body ends before its {size} bytes")
        offset += size
        dtype = spec.dtype.newbyteorder("<")
        if size % dtype.itemsize:
            raise OipError(
                f"input {name!r}: {size} bytes are not a whole number of {spec.datatype} values"
            )
        values = np.frombuffer(chunk, dtype=dtype)
        if spec.datatype == "BOOL" and values.size and values.view(np.uint8).max() > 1:
            raise OipError(f"input {name!r}: BOOL bytes must be 0 or 1")
        # Kept as parse_infer_request checks them: the shape against the values' count.
        rest = {k: v for k, v in entry.items() if k != "parameters"}
        filled.append({**rest, "data": values})
    if offset != len(binary):
        raise OipError(f"the body has {len(binary) - offset} bytes no input claims")
    return {**document, "inputs": filled}


def binary_request_body(
    tensors: Sequence[tuple[str, str, np.ndarray]],
    *,
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int]:
    """An infer request of ``tensors`` (name, datatype, array: batch first) as binary tensors
    (see the module docstring), with the request's ``parameters`` when given: the body and the
    size of its JSON part (:data:`HEADER_LENGTH`). The arrays are written as they are, in the
    datatype's little-endian type: they are checked by whoever made them."""
    inputs = []
    blobs = []
    for name, datatype, array in tensors:
        raw = np.ascontiguousarray(array, dtype=numpy_dtype(datatype).newbyteorder("<")).tobytes()
        inputs.append(
            {
                "name": name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        blobs.append(raw)
    document: dict[str, Any] = {"inputs": inputs}
    if parameters is not None:
        document["parameters"] = dict(parameters)
    header = orjson.dumps(document)
    return b"".join([header, *blobs]), len(header)


def encode_tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    """``{"name", "datatype", "shape", "data"}`` of one output; ``data`` row-major flattened.
    :class:`OipError` (500) when numpy's type has no protocol datatype."""
    values = np.asarray(array)
    try:
        datatype = datatype_of(values.dtype)
    except ArtifactError as error:
        raise OipError(f"output {name!r}: {error}", HTTPStatus.INTERNAL_SERVER_ERROR) from None
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(values.shape),
        "data": values.ravel().tolist(),
    }


def infer_response(
    model_name: str,
    outputs: Mapping[str, np.ndarray],
    *,
    names: Sequence[str] | None = None,
    request_id: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    model_version: str = MODEL_VERSION,
) -> dict[str, Any]:
    """The answer to an infer request: ``{"model_name", "model_version", "id"? (when the request
    had one), "outputs": [encoded tensors], "parameters"? (when given)}``; ``names`` chooses and
    orders the outputs (default: all of ``outputs``, in its order)."""
    chosen = list(outputs) if names is None else list(names)
    answer: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        answer["id"] = request_id
    answer["outputs"] = [encode_tensor(name, outputs[name]) for name in chosen]
    if parameters is not None:
        answer["parameters"] = dict(parameters)
    return answer


def model_metadata(
    name: str, signature: ModelSignature, platform: str, versions: Collection[str] = ("1",)
) -> dict[str, Any]:
    """``GET /v2/models/{name}``: ``{"name", "versions", "platform", "inputs", "outputs"}``
    (tensors as ``{"name", "datatype", "shape"}``, ``-1`` a dynamic dimension)."""
    document = signature.to_json()
    return {
        "name": name,
        "versions": list(versions),
        "platform": platform,
        "inputs": document["inputs"],
        "outputs": document["outputs"],
    }
