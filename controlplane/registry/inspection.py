"""What an uploaded artifact is: its format and signature, read by loading it in another process.

The control plane never loads a user's model itself (no torch or onnxruntime in its process, and
a hostile or broken file must not take it down): :func:`inspect_artifact` runs
``python -m provisioners.worker.inspect FILE [--format F] [--inputs SPEC]`` (the worker's own
loader, :mod:`provisioners.worker.runtime`) as a subprocess of this interpreter with

- a time limit (:data:`INSPECT_TIMEOUT_S`): past it the process group is killed and the push
  refused;
- limits of its own, which hold without the parent: an address-space limit (``RLIMIT_AS``:
  :data:`INSPECT_MEMORY_BYTES` plus twice the file's size, room for the runtime and one copy of
  the weights) and a CPU-time limit (``RLIMIT_CPU``: the time limit plus
  :data:`CPU_GRACE_S`, so a forward that never returns dies by ``SIGXCPU``/``SIGKILL`` even if
  nobody waits for it any more);
- the parent's death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes, Linux): the
  child dies with the service (a ``kill -9`` of the service takes its inspector along), and
  exits at once should the parent be gone before that was set;
- a process group (session) of its own, killed whole on a timeout.

The limits and the death signal are set by a short bootstrap inside the child before it imports
anything (not ``preexec_fn``, which is unsafe in a threaded server). The child's command line
carries :data:`INSPECTOR_MARKER`, its owner's pid and start time:
:func:`end_orphaned_inspectors` (the service's start) ends any inspector whose owner is gone,
what a service without the death signal (another OS, an older version) leaves running.

Its contract: one JSON object ``{"format", "inputs", "outputs"}`` on stdout and exit status 0, or
exit status 2 and one line on stderr saying what is wrong with the artifact. Any refusal (that
line, a timeout, a crash) is a :class:`~controlplane.errors.ModelRejectedError` whose message
is one line; an answer that breaks the contract is a bug (``RuntimeError``).

:class:`Inspector` is the seam: the registry takes any callable of that shape (tests pass a fake).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from controlplane.errors import ModelRejectedError
from provisioners.artifacts import FORMATS, ArtifactError, ModelSignature
from provisioners.base import model_process_env

__all__ = [
    "CPU_GRACE_S",
    "INSPECTOR_MARKER",
    "INSPECT_MEMORY_BYTES",
    "INSPECT_MODULE",
    "INSPECT_TIMEOUT_S",
    "KEPT_INSPECTIONS",
    "Inspection",
    "Inspector",
    "SubprocessInspector",
    "end_orphaned_inspectors",
    "inspect_artifact",
    "inspect_kept",
    "inspector_command",
    "running_inspectors",
]

logger = logging.getLogger(__name__)

INSPECT_MODULE = "provisioners.worker.inspect"
INSPECT_TIMEOUT_S = 60.0
# torch and onnxruntime import within 1 GiB of address space (measured: CPU builds); 4 GiB leaves
# room for a model's working memory on top of its weights (added per file, below).
INSPECT_MEMORY_BYTES = 4 << 30
# CPU seconds the inspector may use past its time limit before the kernel ends it.
CPU_GRACE_S = 5.0
# The first argument of every inspector's bootstrap: how the service's start finds them.
INSPECTOR_MARKER = "heteroplane-inspector"
_MESSAGE_CHARS = 400
_PR_SET_PDEATHSIG = 1

# Runs in the child (argv: marker, owner pid, owner start, address-space limit, CPU limit,
# module, arguments): the death signal and the limits are set before the inspector (and torch)
# is imported.
_BOOTSTRAP = f"""\
import ctypes, os, resource, runpy, signal, sys
_, _marker, owner, _start, memory, cpu, *rest = sys.argv
try:
    ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, int(signal.SIGKILL))
except (OSError, AttributeError):
    pass
if os.getppid() != int(owner):
    os._exit(3)
resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
sys.argv = rest
runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
"""


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


# The same bytes inspected the same way give the same answer: the last few inspections that
# succeeded are kept, by the file's SHA-256, the format and inputs asked for and the inspector
# (for SubprocessInspector: its interpreter, module and limits), so bytes this process has
# inspected already (pushed again, under another name, to another registry) start no inspector
# again; one costs seconds of a core (importing torch or onnxruntime and loading the model). A
# refusal is never kept: a timeout on a busy machine may pass the next time.
KEPT_INSPECTIONS = 64
_kept: OrderedDict[tuple[object, ...], Inspection] = OrderedDict()
_kept_lock = threading.Lock()


def inspect_kept(
    inspector: Inspector,
    path: Path,
    sha256: str,
    format: str | None = None,
    inputs_spec: str | None = None,
) -> Inspection:
    """``inspector(path, format, inputs_spec)``, or what it answered before for the bytes of
    ``sha256`` (the file's, which the caller has) asked the same way (:data:`KEPT_INSPECTIONS`
    of them, this process)."""
    key = (sha256, format, inputs_spec, inspector)
    with _kept_lock:
        kept = _kept.get(key)
        if kept is not None:
            _kept.move_to_end(key)
            return kept
    found = inspector(path, format, inputs_spec)
    with _kept_lock:
        _kept[key] = found
        while len(_kept) > KEPT_INSPECTIONS:
            _kept.popitem(last=False)
    return found


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
    command = inspector_command(
        python,
        module,
        arguments,
        memory_bytes=memory_bytes + 2 * _size(path),
        cpu_s=timeout_s + CPU_GRACE_S,
    )
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_environment(),
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(child.pid)
        child.communicate()
        raise ModelRejectedError(
            f"inspecting the model took longer than {timeout_s:g} s; is it a model this size"
            " loads in that time?"
        ) from None
    except BaseException:
        _kill_group(child.pid)
        child.communicate()
        raise
    finished = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    if finished.returncode != 0:
        message = _refusal(finished.returncode, finished.stderr)
        # The file is the server's staging copy: its path means nothing to the one who pushed.
        for shown in (str(path), Path(path).name):
            message = message.replace(shown, "the artifact")
        raise ModelRejectedError(message)
    return _parse(finished.stdout)


def inspector_command(
    python: str,
    module: str,
    arguments: list[str],
    *,
    memory_bytes: int,
    cpu_s: float,
    owner: tuple[int, int] | None = None,
) -> list[str]:
    """The command line of an inspector: ``python -m module arguments`` under the bootstrap
    (death signal, ``RLIMIT_AS`` of ``memory_bytes``, ``RLIMIT_CPU`` of ``cpu_s`` rounded up),
    marked with its ``owner`` (pid, start time; default: this process)."""
    pid, start = owner if owner is not None else (os.getpid(), _start_time(os.getpid()) or 0)
    return [
        python,
        "-c",
        _BOOTSTRAP,
        INSPECTOR_MARKER,
        str(pid),
        str(start),
        str(memory_bytes),
        str(max(1, math.ceil(cpu_s))),
        module,
        *arguments,
    ]


def running_inspectors() -> list[tuple[int, int, int]]:
    """The inspectors running on this machine, by their marker: (pid, owner pid, owner start
    time). Linux (``/proc``); elsewhere none."""
    found: list[tuple[int, int, int]] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    marker = INSPECTOR_MARKER.encode()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            at = argv.index(marker)
            found.append((int(entry.name), int(argv[at + 1]), int(argv[at + 2])))
        except (OSError, ValueError, IndexError):
            continue
    return found


def end_orphaned_inspectors() -> list[int]:
    """SIGKILL every inspector (its process group) whose owner is no longer alive (its pid is
    gone, or taken by a process that started at another time); their pids."""
    ended: list[int] = []
    for pid, owner, start in running_inspectors():
        if _start_time(owner) == start:
            continue  # its service is alive: its inspection is running
        logger.warning("ending inspector %d, left by a service (pid %d) that is gone", pid, owner)
        _kill_group(pid)
        ended.append(pid)
    return ended


def _kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (the inspector's session), else the process."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGKILL)


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/PID/stat``); None when it is gone
    or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0  # the inspector says what is wrong with a missing file


def _environment() -> dict[str, str]:
    # The same interpreter and import path as the service (a source checkout, a venv), one
    # thread per runtime: inspection loads a model once, it does not need the machine's cores.
    # The control plane's secrets stay out of it, as out of a worker's: it loads a user's model.
    environment = model_process_env()
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
