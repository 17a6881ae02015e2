"""The load generator's inputs for any model: rows from a file, fitted to the model's inputs, and
the request bodies that carry them over ``/v1`` or the Open Inference Protocol (``/v2``, JSON or
binary tensors).

- **Files** (:func:`read_inputs`): a ``.npz`` with one array per model input (the batch
  dimension first; its names are the inputs' names, or any name for a model of one input), or
  a JSON file of Open Inference Protocol rows: an inference request (``{"inputs": [{"name",
  "datatype", "shape", "data"}, ...]}``, each tensor's first dimension the rows, the same in
  each of a request's tensors) or a list of them naming the same inputs, their rows
  concatenated in order (rows whose shapes differ, along an input's variable
  axis, are kept as they are: a query's rows must share their shapes, so such rows go one a
  query, batch size 1). A file that is not what it says (a corrupt ``.npz``,
  a ``.npy`` renamed ``.npz``: :func:`read_npz`; a tensor without ``data``) is one line.
- **Fitting** (:func:`fit_inputs`): against the app's inputs as ``GET /v2/models/{app}`` gives
  them (:class:`InputSpec`): every input given, each array's sample shape the input's (a
  ``-1`` takes any size), its values cast to the input's datatype where they are that type's
  values as they are (whole and in range for an integer type, 0 or 1 for BOOL, finite and in
  range for a float: a JSON file's values to its own datatype too), the same number of rows in
  each. Anything else is a :class:`ValueError` of one line naming the input.
- **Bodies** (:func:`tensor_body`): ``/v1`` (``{"inputs": [flattened rows]}``: a model of one
  input), ``/v2`` JSON (``data`` flat, row-major), or ``/v2`` with Triton's binary tensor
  extension (each input's raw little-endian bytes after the JSON part,
  ``parameters.binary_data_size``, and the header ``Inference-Header-Content-Length``: the size
  of the JSON part), whose outputs are asked for in binary too (``parameters.binary_data_output``,
  what tritonclient asks when no output is named): a model's NaN or infinity, which JSON cannot
  carry, is answered.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from provisioners.artifacts import ArtifactError, TensorSpec, numpy_dtype
from provisioners.worker.oip import HEADER_LENGTH, OipError, binary_request_body, tensor_values

__all__ = [
    "HEADER_LENGTH",
    "PROTOCOLS",
    "InputSpec",
    "TensorBody",
    "fit_inputs",
    "input_specs",
    "read_inputs",
    "read_npz",
    "tensor_body",
]

PROTOCOLS = ("v1", "v2")


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input of the app as ``GET /v2/models/{app}`` gives it: its name, Open Inference
    Protocol datatype and shape (batch first, ``-1`` dynamic)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shape[1:]


@dataclass(frozen=True, slots=True)
class TensorBody:
    """A request body and how it is sent: its ``Content-Type`` and, for binary tensors, the
    size of its JSON part (:data:`HEADER_LENGTH`; None for plain JSON)."""

    body: bytes
    content_type: str = "application/json"
    header_length: int | None = None


def input_specs(metadata: object) -> list[InputSpec]:
    """The inputs of a ``GET /v2/models/{app}`` answer; ValueError when it has none."""
    entries = metadata.get("inputs") if isinstance(metadata, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError("the service gave no inputs for the app's model")
    specs = []
    for entry in entries:
        try:
            specs.append(
                InputSpec(
                    str(entry["name"]),
                    str(entry["datatype"]),
                    tuple(int(d) for d in entry["shape"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"the service gave an input that is not one: {entry!r}") from None
    return specs


def read_inputs(path: Path) -> dict[str, NDArray[Any]]:
    """The arrays of an inputs file (see the module docstring), by name in the file's order;
    ValueError of one line naming the file."""
    try:
        # Read once: a pipe (--inputs /dev/stdin, <(...)) gives its bytes once, and a second
        # open had read the file without the first bytes, looked at for the archive's magic.
        content = path.read_bytes()
        # By its name or its first bytes (a zip, or an .npy): an archive named rows.NPZ or
        # rows.dat had been read as JSON text ("'utf-8' codec can't decode byte 0x89").
        if path.suffix.lower() == ".npz" or content.startswith((b"PK\x03\x04", b"\x93NUMPY")):
            arrays = _npz_arrays(content)
        else:
            arrays = _oip_rows(json.loads(content.decode("utf-8")))
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    except (ValueError, KeyError, TypeError, ArtifactError) as error:
        raise ValueError(f"{path}: {error}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None
    if not arrays:
        raise ValueError(f"{path}: no arrays")
    for name, array in arrays.items():
        if array.ndim < 1 or array.shape[0] < 1:
            raise ValueError(f"{path}: array {name!r} has no rows (shape {list(array.shape)})")
    return arrays


# What numpy's reading of a zip archive raises besides OSError: a file that is not a zip
# (BadZipFile), cut short (EOFError, zlib.error), encrypted (RuntimeError), compressed in a way
# zipfile cannot read (NotImplementedError), or holding a member that is not an .npy (ValueError).
_NOT_AN_NPZ = (
    zipfile.BadZipFile,
    EOFError,
    zlib.error,
    RuntimeError,
    NotImplementedError,
    ValueError,
    KeyError,
)


def read_npz(path: Path) -> dict[str, NDArray[Any]]:
    """The arrays of the ``.npz`` archive at ``path``, by name in the archive's order, the file
    read once (a pipe too).

    A file that is not one (a single ``.npy`` array, which ``np.load`` would hand back as it is;
    a corrupt or cut-short zip; a member that is not an ``.npy``) is a ValueError of one line,
    not naming the file; OSError (a missing file) is the caller's."""
    return _npz_arrays(path.read_bytes())


def _npz_arrays(content: bytes) -> dict[str, NDArray[Any]]:
    """The arrays of the ``.npz`` archive ``content`` (:func:`read_npz`)."""
    if content.startswith(b"\x93NUMPY"):
        raise ValueError("not an .npz archive but a single .npy array (write it with numpy.savez)")
    if not content.startswith(b"PK"):
        raise ValueError("not an .npz archive (a .npz is a zip of .npy arrays)")
    try:
        with np.load(io.BytesIO(content), allow_pickle=False) as archive:  # a zip: an NpzFile
            arrays: dict[str, NDArray[Any]] = {}
            for name in archive.files:
                value = archive[name]
                if not isinstance(value, np.ndarray):  # numpy gives a member's raw bytes
                    raise ValueError(f"member {name!r} is not an .npy array")
                arrays[name] = value
    except _NOT_AN_NPZ as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"not a readable .npz archive ({reason})") from None
    return arrays


_TENSOR_KEYS = ("name", "datatype", "shape", "data")


def _oip_rows(document: object) -> dict[str, NDArray[Any]]:
    """The rows of an inference request, or of a list of them, per input name."""
    requests = document if isinstance(document, list) else [document]
    parts: dict[str, list[NDArray[Any]]] = {}
    first_names: list[str] | None = None
    for r, request in enumerate(requests, 1):
        if not isinstance(request, Mapping) or not isinstance(request.get("inputs"), list):
            raise ValueError('expected an inference request, {"inputs": [...]}, or a list of them')
        label = f"request {r}" if len(requests) > 1 else "the request"
        # A request is one batch: its own rows of every input. Joined per input without this,
        # requests of 2 + 1 and 1 + 2 rows passed, and a query paired rows of two requests.
        rows: dict[str, int] = {}
        for i, tensor in enumerate(request["inputs"], 1):
            where = f"request {r}, input {i}" if len(requests) > 1 else f"input {i}"
            if not isinstance(tensor, Mapping):
                raise ValueError(f"{where} is not an object with {', '.join(_TENSOR_KEYS)}")
            if "name" in tensor:
                where = f"{where} ({str(tensor['name'])!r})"
            missing = [key for key in _TENSOR_KEYS if key not in tensor]
            if missing:
                raise ValueError(
                    f"{where} has no {' or '.join(map(repr, missing))}"
                    f" (an input tensor has {', '.join(_TENSOR_KEYS)})"
                )
            name = str(tensor["name"])
            given = tensor["shape"]
            # Sizes as they are (2 or 2.0): int() had made 2.5 a 2, true a 1, the string "26"
            # the shape [2, 6], and a negative size reached numpy's reshape.
            if type(given) is not list or not all(_size(d) for d in given):
                raise ValueError(f"{where}: shape {given!r} is not a list of whole numbers >= 0")
            shape = [int(d) for d in given]
            datatype = str(tensor["datatype"])
            numpy_dtype(datatype)  # a datatype the protocol has, or a one-line error
            try:
                # The values as the service reads a request's (a fraction for INT64, 300 for
                # UINT8, a number for BOOL, true for FP32, a NaN: refused, never cast).
                spec = TensorSpec(name, datatype, tuple(-1 for _ in shape))
                values = tensor_values(tensor["data"], spec)
            except (OipError, ArtifactError) as error:
                raise ValueError(f"{where}: data: {error}") from None
            if values.size != math.prod(shape):
                raise ValueError(f"input {name!r}: {values.size} values for shape {shape}")
            if not shape:
                raise ValueError(f"input {name!r}: a tensor without a batch dimension (shape [])")
            if name in rows:
                raise ValueError(f"{label} gives input {name!r} twice")
            if rows and shape[0] != next(iter(rows.values())):
                other, count = next(iter(rows.items()))
                raise ValueError(
                    f"{label}: input {name!r} has {shape[0]} rows, input {other!r} {count}:"
                    " a request's inputs have the same rows"
                )
            rows[name] = shape[0]
            parts.setdefault(name, []).append(values.reshape(shape))
        if first_names is None:
            first_names = list(rows)
        elif set(rows) != set(first_names):
            raise ValueError(
                f"{label} has inputs {', '.join(rows) or 'none'},"
                f" request 1 {', '.join(first_names) or 'none'}:"
                " every request gives the same inputs"
            )
    return {name: _joined(name, arrays) for name, arrays in parts.items()}


def _size(value: object) -> bool:
    """Whether ``value`` is a dimension's size in a JSON file's shape: a whole number >= 0 (an
    integer, or a float without a fraction; not a bool)."""
    if type(value) is float:
        return value.is_integer() and value >= 0
    return type(value) is int and value >= 0


def _joined(name: str, arrays: Sequence[NDArray[Any]]) -> NDArray[Any]:
    """The requests' rows of one input, in order: one array when they share a sample shape, else
    (a variable axis: a sequence's length) an array of objects, each row an array of its own
    shape, sent in queries of rows of one shape (:func:`tensor_body`)."""
    if any(array.ndim < 1 for array in arrays):
        raise ValueError(f"input {name!r}: a tensor without a batch dimension (shape [])")
    if len({array.shape[1:] for array in arrays}) == 1:
        return np.concatenate(arrays)
    if len({array.ndim for array in arrays}) > 1:
        ranks = sorted({array.ndim for array in arrays})
        raise ValueError(f"input {name!r}: the requests' tensors have different ranks ({ranks})")
    rows: NDArray[Any] = np.empty(sum(array.shape[0] for array in arrays), dtype=object)
    for index, row in enumerate(row for array in arrays for row in array):
        rows[index] = row
    return rows


def fit_inputs(
    arrays: Mapping[str, NDArray[Any]], specs: Sequence[InputSpec]
) -> dict[str, NDArray[Any]]:
    """``arrays`` fitted to the model's inputs (see the module docstring), by input name in the
    model's order; ValueError of one line naming the input."""
    if len(specs) == 1 and len(arrays) == 1:
        arrays = {specs[0].name: next(iter(arrays.values()))}
    wanted = [spec.name for spec in specs]
    missing = [name for name in wanted if name not in arrays]
    extra = [name for name in arrays if name not in wanted]
    if missing or extra:
        raise ValueError(
            f"the model's inputs are {', '.join(map(repr, wanted))}; "
            f"the file has {', '.join(map(repr, arrays))}"
        )
    fitted: dict[str, NDArray[Any]] = {}
    rows = None
    for spec in specs:
        array = arrays[spec.name]
        try:
            dtype = numpy_dtype(spec.datatype)
        except ArtifactError as error:
            raise ValueError(f"input {spec.name!r}: {error}") from None
        if array.dtype == object:  # rows of their own shapes (_joined)
            cast: NDArray[Any] = np.empty(array.shape[0], dtype=object)
            for index, row in enumerate(array):
                cast[index] = _fitted(spec, dtype, row[np.newaxis])[0]
        else:
            cast = _fitted(spec, dtype, array)
        if rows is not None and array.shape[0] != rows:
            raise ValueError(
                f"input {spec.name!r}: {array.shape[0]} rows, the others {rows}: one row each"
            )
        rows = array.shape[0]
        fitted[spec.name] = cast
    return fitted


def _fitted(spec: InputSpec, dtype: np.dtype[Any], array: NDArray[Any]) -> NDArray[Any]:
    """Rows ``array`` of one shape fitted to ``spec`` and cast to ``dtype`` (:func:`fit_inputs`)."""
    sample = spec.sample_shape
    given = array.shape[1:]
    if len(given) != len(sample) and math.prod(given) == math.prod(sample) > 0:
        array = array.reshape((array.shape[0], *sample))  # flattened rows of a fixed shape
        given = array.shape[1:]
    fits = len(given) == len(sample) and all(
        d in (-1, g) for d, g in zip(sample, given, strict=True)
    )
    if not fits:
        raise ValueError(
            f"input {spec.name!r}: rows of shape {list(given)} do not fit {list(spec.shape)}"
        )
    return _exact(f"input {spec.name!r}", spec.datatype, dtype, array)


def _exact(where: str, datatype: str, dtype: np.dtype[Any], array: NDArray[Any]) -> NDArray[Any]:
    """``array`` cast to ``dtype`` (``datatype``'s) when every value is one of its values as it
    is: whole and within range for an integer type (0 and 1 for BOOL), finite and within range
    for a float type. The service refuses the same values; a cast would change them silently
    (300 into UINT8 is 44, 5.5 into INT64 is 5), and the load would measure other inputs than
    the file's."""
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{where}: {datatype} takes numbers, not values of type {array.dtype}")
    if array.dtype.kind == "b" and dtype.kind != "b":
        raise ValueError(f"{where}: {datatype} takes numbers, not true or false")
    if array.size == 0:
        return array.astype(dtype)
    # Python's numbers: exact, where numpy would compare 2**64 with an int64 by overflowing.
    low, high = array.min().item(), array.max().item()
    if dtype.kind in "biu":
        if array.dtype.kind == "f" and not np.all(array == np.round(array)):
            raise ValueError(f"{where}: values that are not whole for {datatype}")
        limits = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        # A float past the top: 2**63 - 1 is 2**63 as a float, which INT64 does not hold.
        past = float(limits[1]) + 1.0 if array.dtype.kind == "f" else limits[1] + 1
        if low < limits[0] or high >= past:
            raise ValueError(f"{where}: values outside {datatype}'s {limits[0]}..{limits[1]}")
    else:
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise ValueError(f"{where}: NaN or infinity: {datatype} values must be finite")
        largest = float(np.finfo(dtype).max)
        if high > largest or low < -largest:
            raise ValueError(f"{where}: values past {datatype}'s largest, {largest:g}")
    return array.astype(dtype)


def tensor_body(
    arrays: Mapping[str, NDArray[Any]],
    specs: Sequence[InputSpec],
    rows: Sequence[int],
    protocol: str,
    binary: bool = False,
    timeout_s: float | None = None,
) -> TensorBody:
    """The body of one query carrying ``rows`` of the fitted ``arrays`` (see the module
    docstring); on ``/v2``, ``timeout_s`` is sent as ``parameters.timeout`` (microseconds, as
    Triton's clients send it: the service drops a query that cannot be answered in time).
    ValueError for ``/v1`` and a model of several inputs."""
    index = list(rows)
    if protocol == "v1":
        if len(specs) != 1:
            names = ", ".join(spec.name for spec in specs)
            raise ValueError(f"the model takes {len(specs)} inputs ({names}): use --protocol v2")
        batch = _batch(specs[0].name, arrays[specs[0].name], index)
        flat = batch.reshape(len(index), -1)
        # BOOL as 0 and 1 (what /v1 takes for it); integers as they are (a cast to int64
        # made a UINT64 past 2**63 - 1 negative).
        values = flat.astype(np.int64) if flat.dtype.kind == "b" else flat
        text = json.dumps({"inputs": values.tolist()}, separators=(",", ":"))
        return TensorBody(text.encode())
    batches = [
        (spec.name, spec.datatype, _batch(spec.name, arrays[spec.name], index)) for spec in specs
    ]
    parameters = None if timeout_s is None else {"timeout": round(timeout_s * 1e6)}
    if binary:
        asked = {**(parameters or {}), "binary_data_output": True}
        body, header_length = binary_request_body(batches, parameters=asked)
        return TensorBody(body, "application/octet-stream", header_length)
    document: dict[str, Any] = {
        "inputs": [
            {
                "name": name,
                "datatype": datatype,
                "shape": list(batch.shape),
                "data": batch.ravel().tolist(),
            }
            for name, datatype, batch in batches
        ]
    }
    if parameters is not None:
        document["parameters"] = parameters
    return TensorBody(json.dumps(document, separators=(",", ":")).encode())


def _batch(name: str, array: NDArray[Any], index: Sequence[int]) -> NDArray[Any]:
    """Rows ``index`` of one input's ``array`` stacked as a query's batch; ValueError of one line
    when they are rows of their own shapes (:func:`_joined`) that differ."""
    if array.dtype != object:
        return array[list(index)]
    rows = [array[i] for i in index]
    shapes = sorted({row.shape for row in rows})
    if len(shapes) > 1:
        raise ValueError(
            f"input {name!r}: a query of {len(rows)} rows takes rows of shapes"
            f" {', '.join(str(list(s)) for s in shapes)}, which cannot be one batch: send rows"
            " whose shapes differ one a query (batch size 1)"
        )
    return np.stack(rows)
