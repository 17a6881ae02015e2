"""Model runtimes: a model file loaded, its signature read, and batches run through it.

This module owns how the worker (and ``heteroplane cascade evaluate``, and the inspection the
registry runs before it stores a model) executes a model a user brings, whatever its format:

- ONNX, through onnxruntime's ``InferenceSession`` (``CPUExecutionProvider``; with
  ``device="cuda"`` the ``CUDAExecutionProvider`` first when onnxruntime has it). The signature
  is the graph's: onnxruntime's type strings (``tensor(float)``) become protocol datatypes
  (``FP32``, :data:`ONNX_DATATYPES`), symbolic or unknown dimensions ``-1``. It is run on zeros
  twice, the batch 1, then 2: each output must answer one row per input row (a symbolic first
  dimension is only a name), and an output of unknown rank takes its shape from these runs; a
  dynamic dimension past the batch is 1 in them, else 64 where the model takes no 1, and where
  it takes neither the rows are not checked.
- TorchScript, through ``torch.jit.load`` (``eval()``, run under ``torch.inference_mode``). An
  archive holds no shapes, so the inputs' datatypes and shapes come from the extra file
  :data:`SIGNATURE_FILE` inside it (``{"inputs": [TensorSpec JSON, ...]}``, written with
  ``torch.jit.save(..., _extra_files=...)``), or from ``inputs=`` (the registry's
  ``--inputs NAME:FP32:-1x13``); their names must be ``forward``'s arguments. The outputs are
  found by running the model on zeros twice, every dynamic dimension 1, then 2: an output's
  dimension that follows is dynamic (``-1``), the others fixed. A tensor returned is the output
  ``output0``; a tuple or list of tensors ``output0``, ``output1``, ...; a dict of tensors its
  keys; unless the extra file names them (``"outputs": [{"name": "logits"}, ...]``, one entry
  per output in order: only the names are read; names that are the model's own, a dict's keys
  in another order, each name the output of that name), so that a TorchScript model can answer
  under the same names as an ONNX model of a cascade.
- The demo family's models, served by name (:func:`family_runtime`): the family's forward pass
  in numpy (:class:`provisioners.worker.family.ArrayModel`, no torch), or a torch module of the
  family, either returning raw logits, under :data:`~provisioners.artifacts.FAMILY_SIGNATURE`.

Every runtime answers :meth:`ModelRuntime.run` with numpy arrays, in the signature's output
order, and casts its inputs to the signature's types first. heteroplane batches along the first
dimension, so a model whose inputs or outputs have a fixed first dimension is refused
(:class:`ModelLoadError`, one line). torch and onnxruntime are imported only when a model of
their format is loaded.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from provisioners.artifacts import (
    FAMILY_SIGNATURE,
    FORMATS,
    ArtifactError,
    ModelSignature,
    TensorSpec,
    datatype_of,
)

__all__ = [
    "DEVICES",
    "ONNX_DATATYPES",
    "PLATFORMS",
    "SIGNATURE_FILE",
    "ModelLoadError",
    "ModelRuntime",
    "check_batchable",
    "detect_format",
    "family_runtime",
    "first_line",
    "load_runtime",
    "torchscript_error",
    "torchscript_reason",
]

DEVICES: tuple[str, ...] = ("cpu", "cuda")
# The extra file of a TorchScript archive that holds its inputs' signature.
SIGNATURE_FILE = "heteroplane/signature.json"
# The platform names of the Open Inference Protocol's model metadata (Triton's spellings).
PLATFORMS: Mapping[str, str] = {
    "onnx": "onnxruntime_onnx",
    "torchscript": "pytorch_libtorch",
    "family": "pytorch_torch",
}
# onnxruntime's element types that map to a protocol datatype heteroplane serves.
ONNX_DATATYPES: Mapping[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}
_ZIP_MAGIC = b"PK\x03\x04"
_BATCH_ADVICE = "heteroplane batches along the first dimension; export with a dynamic batch axis"
# The first line of every error the TorchScript interpreter raises; the reason is at its end.
_TORCHSCRIPT_FAILED = "The following operation failed in the TorchScript interpreter."


class ModelLoadError(Exception):
    """A model file that cannot be served: not a model, truncated, of a type not served, not
    batchable, without the input shapes it needs. The message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ModelRuntime(Protocol):
    """A loaded model: its signature, its protocol platform name, and a batch run."""

    @property
    def signature(self) -> ModelSignature: ...

    @property
    def platform(self) -> str: ...

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs of one batch, by name in the signature's order. ``inputs`` holds every
        input of the signature by name (cast to its type here when it is not already)."""
        ...


def detect_format(path: str | Path) -> str:
    """``torchscript`` for a zip archive (TorchScript is a zip), else ``onnx``;
    :class:`ModelLoadError` for a missing or empty file."""
    try:
        with Path(path).open("rb") as handle:
            head = handle.read(4)
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror or error}") from None
    if not head:
        raise ModelLoadError(f"{path} is empty")
    return "torchscript" if head == _ZIP_MAGIC else "onnx"


# The sizes an ONNX model's probe batches give a dynamic input dimension past the batch, in
# turn: 1 (a sequence of one token), then an image a few convolutions and poolings still fit.
_PROBE_INNER_SIZES = (1, 64)


def check_batchable(signature: ModelSignature) -> None:
    """:class:`ModelLoadError` unless every input and output has a dynamic first dimension."""
    for kind, specs in (("input", signature.inputs), ("output", signature.outputs)):
        for spec in specs:
            if not spec.batched:
                raise ModelLoadError(
                    f"{kind} {spec.name!r} has shape {list(spec.shape)}: {_BATCH_ADVICE}"
                )


def load_runtime(
    path: str | Path,
    format: str | None = None,
    *,
    device: str = "cpu",
    inputs: Sequence[TensorSpec] | None = None,
    threads: int | None = None,
) -> ModelRuntime:
    """Load the model at ``path`` (``format`` ``onnx`` or ``torchscript``; detected when
    ``None``) on ``device`` (``cpu`` or ``cuda``) and check it is servable.

    ``inputs`` gives a TorchScript model's input signature (it wins over the archive's
    :data:`SIGNATURE_FILE`; an ONNX model carries its own: given for one, it is refused).
    ``threads`` caps the intra-op threads (onnxruntime's session; torch's process-wide setting).
    Raises :class:`ModelLoadError` with a one-line reason.
    """
    detected = format is None
    if format is None:
        format = detect_format(path)
    if format not in FORMATS:
        raise ModelLoadError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    if device not in DEVICES:
        raise ModelLoadError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if not Path(path).is_file():
        raise ModelLoadError(f"no model file at {path}")
    runtime: ModelRuntime
    if format == "onnx":
        if inputs:
            raise ModelLoadError(
                "an ONNX model's inputs come from its graph: give inputs (--inputs) only for a"
                " TorchScript model"
            )
        runtime = _OnnxRuntime(Path(path), device, threads, detected=detected)
    else:
        runtime = _TorchScriptRuntime(Path(path), device, inputs, threads)
    check_batchable(runtime.signature)
    return runtime


def family_runtime(model: Any) -> ModelRuntime:
    """A demo family model (raw pixels in, logits out) as a runtime of
    :data:`~provisioners.artifacts.FAMILY_SIGNATURE`: an
    :class:`~provisioners.worker.family.ArrayModel` (what the worker serves: numpy, no torch), or
    a family ``nn.Module``. Either answers under the platform of the model's framework
    (``pytorch_torch``: the family is PyTorch models, whatever runs their forward pass)."""
    from provisioners.worker.family import ArrayModel

    if isinstance(model, ArrayModel):
        return _ArrayRuntime(model)
    return _ModuleRuntime(model, FAMILY_SIGNATURE, PLATFORMS["family"], "cpu")


class _ArrayRuntime:
    """A family model's forward pass in numpy under the family's signature."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.signature = FAMILY_SIGNATURE
        self.platform = PLATFORMS["family"]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        (pixels,) = _cast(inputs, self.signature.inputs)
        spec = self.signature.inputs[0]
        if pixels.shape[1:] != spec.shape[1:]:
            raise ValueError(
                f"input {spec.name!r} has shape {list(pixels.shape)}, the model takes"
                f" {list(spec.shape)}"
            )
        return {self.signature.outputs[0].name: self._model(pixels)}


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name when it says nothing): a one-line reason. A
    TorchScript error's first line says only that the interpreter failed: its reason is the
    error its traceback ends with (:func:`torchscript_reason`)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return torchscript_error(error) or text.splitlines()[0]


def torchscript_error(error: BaseException) -> str | None:
    """A TorchScript interpreter's error as the one line its traceback ends with (its type and
    message: :func:`torchscript_reason`); None for any other error. The rest of such an error's
    text is the model's own code, which says nothing of what went wrong."""
    lines = str(error).strip().splitlines()
    if not lines or lines[0].strip() != _TORCHSCRIPT_FAILED:
        return None
    return torchscript_reason(lines)


def torchscript_reason(lines: Sequence[str]) -> str | None:
    """The error a TorchScript interpreter's traceback (``lines``) ends with, on one line
    (``RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x7 and 8x3)``; a ``raise`` in
    the model's code as its type and message, without ``builtins.``): the lines after the last
    ``<--- HERE`` marker from the first one that is not code (indented) on; None when there is
    none.

    >>> torchscript_reason([_TORCHSCRIPT_FAILED, "  File ...", "    raise ...", "    ~~~ <--- HERE",
    ...     "    return x", "builtins.RuntimeError: too big", "for this model"])
    'RuntimeError: too big for this model'
    """
    marks = [index for index, line in enumerate(lines) if line.rstrip().endswith("<--- HERE")]
    rest = lines[marks[-1] + 1 if marks else 1 :]
    for index, line in enumerate(rest):
        if line.strip() and not line[0].isspace() and not line.startswith("Traceback of"):
            reason = " ".join(" ".join(rest[index:]).split())
            return reason.removeprefix("builtins.")
    return None


def _cast(inputs: Mapping[str, np.ndarray], specs: Sequence[TensorSpec]) -> list[np.ndarray]:
    try:
        return [np.ascontiguousarray(inputs[spec.name], dtype=spec.dtype) for spec in specs]
    except KeyError as missing:
        raise ValueError(f"input {missing.args[0]!r} is missing") from None


# --- ONNX -----------------------------------------------------------------------------------------


class _OnnxRuntime:
    def __init__(self, path: Path, device: str, threads: int | None, *, detected: bool) -> None:
        # Only where an ONNX model is loaded; onnxruntime ships no type information.
        import onnxruntime  # type: ignore[import-untyped]

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only: warnings would reach a caller's stderr
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if device == "cuda" and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self._session = onnxruntime.InferenceSession(
                str(path), sess_options=options, providers=providers
            )
        except Exception as error:  # onnxruntime's own exception types (Fail, InvalidProtobuf)
            if "external data" in str(error).lower():
                # The registry takes one file: the weights are not beside the uploaded copy
                # (onnxruntime's message names where it looked, the service's own folders).
                raise ModelLoadError(
                    f"{path.name} keeps tensors in external data files, which heteroplane does"
                    " not take: a model is one file; save it with onnx.save_model(model, path,"
                    " save_as_external_data=False)"
                ) from None
            # Tried as ONNX because it is not a zip: then it is not TorchScript either.
            what = "is neither a TorchScript archive (not a zip file) nor" if detected else "is not"
            raise ModelLoadError(
                f"{path.name} {what} an ONNX model onnxruntime can load: {first_line(error)}"
            ) from None
        self.platform = PLATFORMS["onnx"]
        self.providers = tuple(self._session.get_providers())
        inputs = tuple(_onnx_spec("input", arg) for arg in self._session.get_inputs())
        if not inputs:
            raise ModelLoadError(f"{path.name}: the ONNX graph has no inputs")
        self._input_specs = inputs
        self._output_names = [arg.name for arg in self._session.get_outputs()]
        if not self._output_names:
            # It loads, but nothing can be asked of it (onnxruntime: "At least one output
            # should be requested"): every query would fail.
            raise ModelLoadError(f"{path.name}: the ONNX graph has no outputs")
        outputs = [_onnx_spec("output", arg) for arg in self._session.get_outputs()]
        check_batchable(ModelSignature(inputs, tuple(s for s in outputs if s is not None)))
        # The graph's symbolic dimensions are names, not promises: two probe batches say
        # whether each output answers one row per input row (an output of unknown rank takes
        # its shape from them).
        probes = self._probes(inputs)
        if probes is None:
            # Zeros fit no size tried of a dynamic dimension past the batch (a convolution
            # over an image of any size): what the model takes is not known, so its rows are
            # not checked, and its outputs are as the graph declares them.
            self.signature = ModelSignature(inputs, tuple(s for s in outputs if s is not None))
            if len(self.signature.outputs) != len(outputs):
                raise ModelLoadError(
                    "an output of unknown rank, and the model runs on no batch of zeros tried"
                    " (every dynamic dimension past the batch 1 or "
                    f"{_PROBE_INNER_SIZES[-1]}): its shape cannot be told"
                )
            return
        one, two = probes
        for name, first, second in zip(self._output_names, one, two, strict=True):
            if first.ndim and second.ndim:
                _check_rows(name, (int(first.shape[0]), int(second.shape[0])))
        self.signature = ModelSignature(
            inputs,
            tuple(
                spec if spec is not None else _probed_spec(name, first, tuple(second.shape))
                for spec, name, first, second in zip(
                    outputs, self._output_names, one, two, strict=True
                )
            ),
        )

    def _probes(
        self, inputs: Sequence[TensorSpec]
    ) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """The outputs of batches of zeros of 1 and 2 rows (:meth:`_probe`). With a dynamic
        dimension past the batch, which sizes fit is the model's own (a 3x3 convolution takes
        no 1x1 image): each of :data:`_PROBE_INNER_SIZES` is tried there, and None when the
        model runs on none of them. Without one, a model that fails on zeros is refused."""
        inner = any(-1 in spec.shape[1:] for spec in inputs)
        for size in _PROBE_INNER_SIZES if inner else _PROBE_INNER_SIZES[:1]:
            try:
                return self._probe(inputs, 1, size), self._probe(inputs, 2, size)
            except ModelLoadError:
                if not inner:
                    raise
        return None

    def _probe(self, inputs: Sequence[TensorSpec], size: int, inner: int) -> list[np.ndarray]:
        """The outputs of a batch of zeros of ``size`` rows, every other dynamic input
        dimension ``inner``."""
        feed = {spec.name: np.zeros(_probe_shape(spec, size, inner), spec.dtype) for spec in inputs}
        import onnxruntime

        quiet = onnxruntime.RunOptions()
        quiet.log_severity_level = 4  # a probe's failure is an answer, not a line on stderr
        try:
            values = self._session.run(self._output_names, feed, quiet)
        except Exception as error:
            raise ModelLoadError(
                f"the model fails on a batch of zeros: {first_line(error)}"
            ) from None
        return [np.asarray(value) for value in values]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = _cast(inputs, self._input_specs)
        feed = {spec.name: array for spec, array in zip(self._input_specs, arrays, strict=True)}
        values = self._session.run(self._output_names, feed)
        return dict(zip(self._output_names, values, strict=True))


def _onnx_spec(kind: str, arg: Any) -> Any:
    datatype = ONNX_DATATYPES.get(arg.type)
    if datatype is None:
        raise ModelLoadError(f"{kind} {arg.name!r} has type {arg.type}, which is not served")
    shape = arg.shape
    if shape is None:
        if kind == "input":
            raise ModelLoadError(f"input {arg.name!r} has no shape in the ONNX graph")
        return None
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)
    return TensorSpec(arg.name, datatype, dims)


# --- TorchScript and torch modules ----------------------------------------------------------------


class _ModuleRuntime:
    """A torch module (a TorchScript one, or a family ``nn.Module``) under a signature."""

    def __init__(self, module: Any, signature: ModelSignature, platform: str, device: str) -> None:
        self._module = module
        self.signature = signature
        self.platform = platform
        self._device = device

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        arrays = _cast(inputs, self.signature.inputs)
        tensors = [torch.from_numpy(a).to(self._device) for a in arrays]
        with torch.inference_mode():
            result = self._module(*tensors)
        values = _output_tensors(result)
        names = [spec.name for spec in self.signature.outputs]
        if len(values) != len(names):
            raise ValueError(f"the model returned {len(values)} outputs, not {len(names)}")
        by_name = dict(values)
        if not all(name in by_name for name in names):
            # Named by position (a family module's one tensor is its signature's ``logits``).
            by_name = {name: value for name, (_, value) in zip(names, values, strict=True)}
        return {name: by_name[name].detach().cpu().numpy() for name in names}


class _TorchScriptRuntime(_ModuleRuntime):
    def __init__(
        self, path: Path, device: str, inputs: Sequence[TensorSpec] | None, threads: int | None
    ) -> None:
        import torch  # only where a TorchScript model is loaded

        if threads is not None:
            torch.set_num_threads(threads)
        if device == "cuda" and not torch.cuda.is_available():
            device = "cpu"
        extra = {SIGNATURE_FILE: ""}
        try:
            module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(path), map_location=device, _extra_files=extra
            )
        except Exception as error:  # torch's RuntimeError for a bad or truncated archive
            if _written_by_torch_save(path):
                raise ModelLoadError(
                    f"{path.name} was written by torch.save (a pickled module or state_dict),"
                    " not by torch.jit.save: save the model as TorchScript,"
                    " torch.jit.save(torch.jit.script(model), path) (or torch.jit.trace)"
                ) from None
            raise ModelLoadError(
                f"{path.name} is not a TorchScript archive torch can load: {first_line(error)}"
            ) from None
        module.eval()
        specs = tuple(inputs) if inputs else _embedded_inputs(extra[SIGNATURE_FILE], path)
        names = _forward_arguments(module)
        if names is not None and [s.name for s in specs] != names:
            raise ModelLoadError(
                f"the inputs given ({', '.join(s.name for s in specs)}) are not forward's"
                f" arguments ({', '.join(names)}), in order"
            )
        outputs = _named(_probe_outputs(module, specs, device), extra[SIGNATURE_FILE], path)
        super().__init__(module, ModelSignature(specs, outputs), PLATFORMS["torchscript"], device)


def _written_by_torch_save(path: Path) -> bool:
    """Whether ``path`` is a zip as ``torch.save`` writes one (``<name>/data.pkl``, the pickle)
    without what a TorchScript archive adds (``<name>/constants.pkl``, ``<name>/code/``): torch
    calls it a corrupted checkpoint, which tells its author nothing. Only the zip's directory is
    read (unpickling a user's file is what must not happen here)."""
    try:
        with zipfile.ZipFile(path) as archive:
            parts = [name.split("/", 1)[-1] for name in archive.namelist()]
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    scripted = "constants.pkl" in parts or any(part.startswith("code/") for part in parts)
    return "data.pkl" in parts and not scripted


def _embedded_inputs(raw: bytes | str, path: Path) -> tuple[TensorSpec, ...]:
    if not raw:
        raise ModelLoadError(
            f"{path.name}: a TorchScript archive holds no input shapes; give them"
            f" (--inputs NAME:FP32:-1x13,...) or save the archive with the extra file"
            f" {SIGNATURE_FILE}"
        )
    try:
        document = json.loads(raw)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"{path.name}: {SIGNATURE_FILE} is not JSON: {error}") from None
    try:
        if not isinstance(document, dict):
            raise ValueError(
                f'it must be a JSON object {{"inputs": [...]}}, not {_json_kind(document)}'
            )
        if "inputs" not in document:
            raise ValueError('it has no \'inputs\' (a list of {"name", "datatype", "shape"})')
        entries = document["inputs"]
        if not isinstance(entries, list) or not entries:
            raise ValueError("'inputs' must be a non-empty list")
        return tuple(TensorSpec.from_json(entry) for entry in entries)
    except (ValueError, KeyError, TypeError, ArtifactError) as error:
        raise ModelLoadError(f"{path.name}: {SIGNATURE_FILE} is not usable: {error}") from None


def _json_kind(value: object) -> str:
    """What a decoded JSON value is, as JSON names it (``a list``, ``a string``, ...)."""
    if isinstance(value, bool):
        return "a boolean"
    kinds = ((list, "a list"), (str, "a string"), (int | float, "a number"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _named(outputs: tuple[TensorSpec, ...], raw: bytes | str, path: Path) -> tuple[TensorSpec, ...]:
    """``outputs`` renamed as the signature file's ``outputs`` entries say, when it has them."""
    if not raw:
        return outputs
    try:
        entries = json.loads(raw).get("outputs")
    except (ValueError, AttributeError):
        return outputs  # _embedded_inputs reports an unreadable file
    if entries is None:
        return outputs
    names: list[str] = []
    for entry in entries if isinstance(entries, list) else [None]:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise ModelLoadError(
                f"{path.name}: {SIGNATURE_FILE}: 'outputs' must list named entries"
            )
        names.append(name)
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ModelLoadError(
            f"{path.name}: {SIGNATURE_FILE} names output {', '.join(map(repr, twice))} more than"
            " once; each output needs a name of its own"
        )
    if len(names) != len(outputs):
        raise ModelLoadError(
            f"{path.name}: {SIGNATURE_FILE} names {len(names)} outputs; the model returns"
            f" {len(outputs)}"
        )
    probed = {spec.name: spec for spec in outputs}
    if set(names) == set(probed):
        # The model's own names (a dict's keys, or output0, ...) in another order: each is the
        # output of that name, as the runtime answers it (_ModuleRuntime.run), not the one at
        # its position (a dict {"double", "sum"} named ["sum", "double"] had its signature
        # give "sum" the doubled tensor's shape, while the worker answered "sum" by key).
        return tuple(probed[name] for name in names)
    return tuple(
        TensorSpec(name, spec.datatype, spec.shape)
        for name, spec in zip(names, outputs, strict=True)
    )


def _forward_arguments(module: Any) -> list[str] | None:
    try:
        arguments = module.forward.schema.arguments
    except (AttributeError, RuntimeError):
        return None
    # The schema's first argument is the module itself, whatever forward calls it (self, s).
    return [argument.name for argument in arguments[1:]]


def _probe_shape(spec: TensorSpec, size: int, inner: int | None = None) -> tuple[int, ...]:
    """``spec``'s shape with its dynamic dimensions ``size``, or past the first ``inner`` when
    given."""
    return tuple(
        (size if index == 0 or inner is None else inner) if d == -1 else d
        for index, d in enumerate(spec.shape)
    )


def _probe_outputs(module: Any, specs: Sequence[TensorSpec], device: str) -> tuple[TensorSpec, ...]:
    """The outputs of two runs on zeros (every dynamic input dimension 1, then 2): an output
    dimension that changes between them is dynamic."""
    import torch

    runs: list[list[tuple[str, Any]]] = []
    for size in (1, 2):
        tensors = [
            torch.from_numpy(np.zeros(_probe_shape(spec, size), spec.dtype)).to(device)
            for spec in specs
        ]
        try:
            with torch.inference_mode():
                result = module(*tensors)
        except Exception as error:
            raise ModelLoadError(
                f"the model fails on a batch of zeros shaped like its inputs: {first_line(error)}"
            ) from None
        try:
            runs.append(_output_tensors(result))
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    first, second = runs
    if [name for name, _ in first] != [name for name, _ in second]:
        raise ModelLoadError("the model's outputs change with the batch size")
    outputs = []
    for (name, one), (_, two) in zip(first, second, strict=True):
        try:
            value = one.detach().cpu().numpy()
        except (TypeError, RuntimeError) as error:
            raise ModelLoadError(f"output {name!r}: {first_line(error)}") from None
        rows = (int(one.shape[0]), int(two.shape[0])) if one.dim() and two.dim() else None
        if rows is not None and rows[0] != rows[1]:
            _check_rows(name, rows)
        outputs.append(_probed_spec(name, value, tuple(two.shape)))
    return tuple(outputs)


def _check_rows(name: str, rows: tuple[int, int]) -> None:
    """:class:`ModelLoadError` unless output ``name`` answered ``rows`` (1, 2) for the probe
    batches of 1 and 2 rows: a first dimension that follows the batch but is not it
    (``torch.cat([x, x])``, ONNX's ``Concat`` on axis 0: 2 rows for 1) would fail every query at
    serving."""
    if rows != (1, 2):
        raise ModelLoadError(
            f"output {name!r} has {rows[0]} rows for a batch of 1 and {rows[1]} for a batch of"
            " 2: heteroplane batches along the first dimension, one output row per input row"
        )


def _probed_spec(name: str, value: np.ndarray, other: tuple[int, ...]) -> TensorSpec:
    """An output's spec from a probe with batch 1 and the shape ``other`` of the probe with
    batch 2: dimensions that differ are dynamic."""
    try:
        datatype = datatype_of(value.dtype)
    except ArtifactError:
        raise ModelLoadError(
            f"output {name!r} has type {value.dtype}, which is not served"
        ) from None
    shape = tuple(int(d) for d in value.shape)
    if len(other) != len(shape):
        raise ModelLoadError(f"output {name!r} changes rank with the batch size")
    else:
        dims = tuple(-1 if a != b else a for a, b in zip(shape, other, strict=True))
    return TensorSpec(name, datatype, dims)


def _output_tensors(result: Any) -> list[tuple[str, Any]]:
    """A model's return value as named tensors (see the module docstring for the names)."""
    import torch

    if isinstance(result, torch.Tensor):
        return [("output0", result)]
    if (
        isinstance(result, tuple | list)
        and result
        and all(isinstance(item, torch.Tensor) for item in result)
    ):
        return [(f"output{index}", item) for index, item in enumerate(result)]
    if (
        isinstance(result, Mapping)
        and result
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in result.items())
    ):
        return list(result.items())
    raise ValueError(
        "the model must return a tensor, a tuple or list of tensors or a dict of tensors,"
        f" not {type(result).__name__}"
    )
