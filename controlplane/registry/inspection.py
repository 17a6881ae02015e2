"""What an uploaded artifact is: its format and signature, read by loading it in another process.

The control plane never loads a user's model itself (no torch or onnxruntime in its process, and
a hostile or broken file must not take it down): :func:`inspect_artifact` runs
``python -m provisioners.worker.inspect FILE [--format F] [--inputs SPEC]`` (the worker's own
loader, :mod:`provisioners.worker.runtime`) as a subprocess of this interpreter with

- a time limit (:data:`INSPECT_TIMEOUT_S`): past it the process is killed and the push refused;
- an address-space limit (``RLIMIT_AS``: :data:`INSPECT_MEMORY_BYTES` plus twice the file's
  size, room for the runtime and one copy of the weights), set by a two-line bootstrap inside the
  child before it imports anything (not ``preexec_fn``, which is unsafe in a threaded server).

Its contract: one JSON object ``{"format", "inputs", "outputs"}`` on stdout and exit status 0, or
exit status 2 and one line on stderr saying what is wrong with the artifact. Any refusal (that
line, a timeout, a crash) is a :class:`~controlplane.errors.ModelRejectedError` whose message
is one line; an answer that breaks the contract is a bug (``RuntimeError``).

:class:`Inspector` is the seam: the registry takes any callable of that shape (tests pass a fake).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from controlplane.errors import ModelRejectedError
from provisioners.artifacts import FORMATS, ArtifactError, ModelSignature

__all__ = [
    "INSPECT_MEMORY_BYTES",
    "INSPECT_MODULE",
    "INSPECT_TIMEOUT_S",
    "Inspection",
    "Inspector",
    "SubprocessInspector",
    "inspect_artifact",
]

INSPECT_MODULE = "provisioners.worker.inspect"
INSPECT_TIMEOUT_S = 60.0
# torch and onnxruntime import within 1 GiB of address space (measured: CPU builds); 4 GiB leaves
# room for a model's working memory on top of its weights (added per file, below).
INSPECT_MEMORY_BYTES = 4 << 30
_MESSAGE_CHARS = 400

# Runs in the child: the limit is set before the inspector (and torch) is imported.
_BOOTSTRAP = (
    "import resource, runpy, sys; limit = int(sys.argv[1]);"
    " resource.setrlimit(resource.RLIMIT_AS, (limit, limit));"
    " sys.argv = [sys.argv[2], *sys.argv[3:]];"
    " runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


@dataclass(frozen=True, slots=True)
class Inspection:
    """What the inspector read from an artifact."""

    format: str  # onnx, torchscript
    signature: ModelSignature


class Inspector(Protocol):
    """Reads an artifact's format and signature; :class:`ModelRejectedError` when it is not a
    model heteroplane can serve."""

    def __call__(
        self, path: Path, format: str | None = None, inputs_spec: str | None = None
    ) -> Inspection: ...


@dataclass(frozen=True, slots=True)
class SubprocessInspector:
    """:func:`inspect_artifact` with these limits (the registry's default inspector)."""

    timeout_s: float = INSPECT_TIMEOUT_S
    memory_bytes: int = INSPECT_MEMORY_BYTES
    python: str = sys.executable
    module: str = INSPECT_MODULE

    def __call__(
        self, path: Path, format: str | None = None, inputs_spec: str | None = None
    ) -> Inspection:
        return inspect_artifact(
            path,
            format,
            inputs_spec,
            timeout_s=self.timeout_s,
            memory_bytes=self.memory_bytes,
            python=self.python,
            module=self.module,
        )


def inspect_artifact(
    path: Path,
    format: str | None = None,
    inputs_spec: str | None = None,
    *,
    timeout_s: float = INSPECT_TIMEOUT_S,
    memory_bytes: int = INSPECT_MEMORY_BYTES,
    python: str = sys.executable,
    module: str = INSPECT_MODULE,
) -> Inspection:
    """Inspect the artifact at ``path`` in a subprocess (see the module docstring); ``format``
    None detects it, ``inputs_spec`` (``name:FP32:-1x13,...``) gives a TorchScript model's
    inputs. ``python -m module`` is the inspector (another one in tests)."""
    arguments = [str(path)]
    if format is not None:
        arguments += ["--format", format]
    if inputs_spec is not None:
        arguments += ["--inputs", inputs_spec]
    limit = memory_bytes + 2 * _size(path)
    command = [python, "-c", _BOOTSTRAP, str(limit), module, *arguments]
    try:
        finished = subprocess.run(
            command,
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            env=_environment(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ModelRejectedError(
            f"inspecting the model took longer than {timeout_s:g} s; is it a model this size"
            " loads in that time?"
        ) from None
    if finished.returncode != 0:
        message = _refusal(finished.returncode, finished.stderr)
        # The file is the server's staging copy: its path means nothing to the one who pushed.
        for shown in (str(path), Path(path).name):
            message = message.replace(shown, "the artifact")
        raise ModelRejectedError(message)
    return _parse(finished.stdout)


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0  # the inspector says what is wrong with a missing file


def _environment() -> dict[str, str]:
    # The same interpreter and import path as the service (a source checkout, a venv), one
    # thread per runtime: inspection loads a model once, it does not need the machine's cores.
    environment = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = root if not path else os.pathsep.join((root, path))
    environment.setdefault("OMP_NUM_THREADS", "1")
    return environment


def _refusal(returncode: int, stderr: bytes) -> str:
    """The inspector's one line (its last non-empty line, if it broke its contract and printed
    a traceback), or what ended it."""
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    if returncode == 2 and lines:
        message = lines[-1]
    elif returncode < 0:
        message = f"the inspector was killed by signal {-returncode} (out of memory?)"
    else:
        last = f": {lines[-1]}" if lines else ""
        message = f"cannot inspect the model: the inspector failed with status {returncode}{last}"
        if "MemoryError" in last:
            message = "cannot inspect the model: it needs more memory than the inspector's limit"
    message = " ".join(message.split())
    return message if len(message) <= _MESSAGE_CHARS else message[: _MESSAGE_CHARS - 3] + "..."


def _parse(stdout: bytes) -> Inspection:
    try:
        document = json.loads(stdout)
        fmt = document["format"]
        signature = ModelSignature.from_json(document)
    except (ValueError, KeyError, TypeError, ArtifactError) as error:
        raise RuntimeError(
            f"{INSPECT_MODULE} answered something that is not an inspection: {error}"
        ) from None
    if fmt not in FORMATS:
        raise RuntimeError(f"{INSPECT_MODULE} answered an unknown format {fmt!r}")
    return Inspection(fmt, signature)
