"""``python -m provisioners.worker.inspect FILE``: what a model file is, or why it is not servable.

This module owns the inspection the registry runs (in a subprocess, with a timeout and a memory
limit) before it stores a model a user pushes: load the file with the runtime
(:func:`provisioners.worker.runtime.load_runtime`) and print its signature as one JSON object on
stdout, ``{"format", "inputs": [...], "outputs": [...]}`` (tensors as ``{"name", "datatype",
"shape"}``, ``-1`` a dynamic dimension), exit 0. A file that is not an ONNX model or a
TorchScript archive, a truncated one, a TorchScript archive without its input shapes, a model
without a dynamic first (batch) dimension: exit 2 and ONE line on stderr, the reason, never a
traceback (the registry hands the line to the user).

Options: ``--format onnx|torchscript`` (detected when omitted: a zip, ``PK\\x03\\x04``, is
TorchScript, anything else is tried as ONNX); ``--inputs SPEC``, a TorchScript model's inputs
``NAME:DATATYPE:SHAPE[,NAME:...]`` with the shape's dimensions joined by ``x`` and ``-1`` for a
dynamic one (``input:FP32:-1x13``). Only the runtime of the file's format is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from provisioners.artifacts import FORMATS, ArtifactError, TensorSpec

__all__ = ["EXIT_BAD_ARTIFACT", "InspectError", "inspect_file", "main", "parse_inputs_spec"]

EXIT_BAD_ARTIFACT = 2


class InspectError(Exception):
    """A bad command line or a bad ``--inputs`` spec; the message is one line."""


def parse_inputs_spec(text: str, what: str = "--inputs") -> tuple[TensorSpec, ...]:
    """``NAME:DATATYPE:SHAPE[,NAME:DATATYPE:SHAPE...]`` as tensors; ``SHAPE`` is dimensions
    joined by ``x``, ``-1`` for a dynamic one. Raises :class:`InspectError` when malformed, its
    message naming the spec as ``what`` (the option, or the API's query parameter).

    >>> parse_inputs_spec("input:FP32:-1x13")
    (TensorSpec(name='input', datatype='FP32', shape=(-1, 13)),)
    >>> parse_inputs_spec("bad", what="inputs")
    Traceback (most recent call last):
    ...
    provisioners.worker.inspect.InspectError: inputs 'bad': expected NAME:DATATYPE:SHAPE
    """
    if not text.isprintable():
        raise InspectError(f"{what} {text!r}: control characters are not allowed")
    specs: list[TensorSpec] = []
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) != 3 or not all(fields):
            raise InspectError(f"{what} {part.strip()!r}: expected NAME:DATATYPE:SHAPE")
        name, datatype, shape_text = fields
        try:
            shape = tuple(int(d) for d in shape_text.lower().split("x"))
        except ValueError:
            raise InspectError(
                f"{what} {part.strip()!r}: shape {shape_text!r} is not dimensions joined by x"
            ) from None
        try:
            specs.append(TensorSpec(name, datatype.upper(), shape))
        except ArtifactError as error:
            raise InspectError(f"{what} {part.strip()!r}: {error}") from None
    if len({s.name for s in specs}) != len(specs):
        raise InspectError(f"{what} {text!r}: an input is named twice")
    return tuple(specs)


def inspect_file(
    path: str, format: str | None = None, inputs: Sequence[TensorSpec] | None = None
) -> dict[str, object]:
    """``{"format", "inputs", "outputs"}`` of the model at ``path``; raises
    :class:`provisioners.worker.runtime.ModelLoadError` when it cannot be served."""
    from provisioners.worker.runtime import detect_format, load_runtime

    chosen = format or detect_format(path)
    runtime = load_runtime(path, format or None, inputs=inputs, threads=1)
    return {"format": chosen, **runtime.signature.to_json()}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _refuse(message)


def _refuse(message: str) -> NoReturn:
    print(" ".join(str(message).split()), file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_ARTIFACT)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the C++ runtimes log there, and torch warns) so that a refusal
    is the one line printed after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with Path(os.devnull).open("wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m provisioners.worker.inspect",
        description="Print a model file's signature as JSON (exit 0), or why heteroplane cannot"
        " serve it as one line on stderr (exit 2).",
    )
    parser.add_argument("file", help="an ONNX model or a TorchScript archive")
    parser.add_argument("--format", choices=FORMATS, help="the file's format (detected if not)")
    parser.add_argument(
        "--inputs",
        metavar="SPEC",
        help="a TorchScript model's inputs: NAME:DATATYPE:SHAPE[,...], e.g. input:FP32:-1x13",
    )
    args = parser.parse_args(argv)
    try:
        inputs = parse_inputs_spec(args.inputs) if args.inputs else None
        with _quiet_stderr():
            document = inspect_file(args.file, args.format, inputs)
    except Exception as error:  # every failure is the one line; the runtime's own or another
        _refuse(str(error) or type(error).__name__)
    print(json.dumps(document, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
