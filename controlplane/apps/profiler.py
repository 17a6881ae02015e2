"""The profiler: what a batch of each of the demo family's models costs on this machine, per
instance type and batch size.

This module owns how a latency profile is measured, in two ways:

- **Through the serving path** (:func:`measure_serving_path`, what ``heteroplane profile measure``
  and the demo do): for every instance type to profile, one real worker agent process
  (``python -m provisioners.worker``, started by :class:`provisioners.local.LocalProvisioner` as
  the local provisioner starts any worker, on loopback), and once it is ready, batches of real
  validation inputs sent to it over kept-alive HTTP/1.1 as the serving loop's transport sends them
  (``controlplane.serving.transport``: Open Inference Protocol v2, ``POST
  /v2/models/{m}/infer`` with the family's signature, an FP32 input ``input`` of [n, 64], in
  binary tensors); each sample is one call's round trip as the caller sees it: writing the
  request, the worker's parsing and validation, the model, the emulation's padding (emulated
  types), the answer's JSON and its parsing. The types are measured side by side (one
  thread and one connection per type, each worker sent one batch at a time, as the dispatcher
  sends them), the models in turn within each round (interleaved, so that load from other
  processes on a shared machine falls on every model alike).
- **Compute only** (:func:`measure_family`, :func:`time_models`): the models' forward pass in this
  process as a worker computes it (the family's arrays in numpy,
  ``provisioners.worker.family.ArrayModel``; numpy's BLAS on a fixed number of threads, warm-up
  runs, then timed runs with ``time.perf_counter``), no serving path; kept for the per-query
  compute that ``heteroplane
  cascade evaluate`` costs cascades with (:func:`measure_compute_ms`) and for
  ``heteroplane profile measure --compute-only``.

An emulated type (family ``emu``) is a worker on this machine that pads each batch to the
emulated compute of the model, C_m(b) / f for a type of speed factor f
(``provisioners.worker.emulation.EMULATED_COMPUTE``; docs/catalog.md, "Emulated types"). Two
curves must not be confused: the *compute* curves the workers pad to, and the *end-to-end*
profiles a caller sees, which the planner reads. A profile file keeps them apart: its
``compute`` section is the former (the workers of a service read it), its ``profiles`` the latter
(:func:`profile_meta`). The reference type :data:`REFERENCE_TYPE` (``local.cpu``) is this machine
serving the digits models as they are, unpadded.

torch is imported only where the family must be trained first (``ensure_family``).
"""

from __future__ import annotations

import datetime
import http.client
import json
import platform
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from controlplane.errors import ControlPlaneError
from estimator.catalog import Catalog, InstanceType
from estimator.profiles import LatencyProfile, write_profiles_json
from provisioners.artifacts import FAMILY_SIGNATURE, datatype_of
from provisioners.base import APP_TAG, LaunchRequest
from provisioners.worker.emulation import EMULATED_COMPUTE, ComputeCurve, compute_document
from provisioners.worker.oip import HEADER_LENGTH, binary_request_body

if TYPE_CHECKING:
    from provisioners.local import LocalProvisioner
    from provisioners.worker.family import ArrayModel

REFERENCE_TYPE = "local.cpu"
EMULATED_FAMILY = "emu"
# Emulated CPU types compute a batch in time proportional to its rows (C_m(b)), so a batch of
# 64 of the large model on emu.cpu.small takes seconds: the serving path is timed up to 16.
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)
DEFAULT_SAMPLES = 30
DEFAULT_WARMUP = 5
# One thread: the timings of a shared machine are steadier, and a worker serving one model per
# core is the deployment the emulated types stand for.
DEFAULT_THREADS = 1
MAX_BATCH_SIZE = 4096
# Workers load the family (and train it first where the cache lacks it): seconds each, more on a
# busy shared machine.
WORKER_START_TIMEOUT_S = 180.0
# One call may take a batch of the slowest emulated compute; a minute means a worker is stuck.
CALL_TIMEOUT_S = 60.0
_POLL_S = 0.2
# The tag the profiler's workers carry (they are no app's).
_PROFILER_TAGS = {APP_TAG: "profiler"}

Measurement = Literal["serving_path", "compute_only"]
ProgressFn = Callable[[str], None]


class ProfilingError(ControlPlaneError):
    """A measurement that could not be made: a worker that did not start or refused a batch."""


class ProfilingTimeoutError(ProfilingError):
    """A worker that did not answer a batch of ``rows`` of ``model`` within the call's
    ``timeout_s``."""

    def __init__(self, address: str, model: str, rows: int, timeout_s: float) -> None:
        self.address, self.model, self.rows, self.timeout_s = address, model, rows, timeout_s
        super().__init__(
            f"the worker at {address} timed out on a batch of {rows} of {model}: no answer"
            f" within {timeout_s:g} s (the profiler's call timeout); a batch that size takes"
            " longer there, or the worker is stuck: profile smaller batch sizes"
        )


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """How each cell is timed: ``warmup`` untimed runs, then ``samples`` timed ones, on
    ``threads`` threads."""

    samples: int = DEFAULT_SAMPLES
    warmup: int = DEFAULT_WARMUP
    threads: int = DEFAULT_THREADS

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


def emulated_compute(models: Iterable[str]) -> dict[str, ComputeCurve]:
    """The compute curves the emulated workers pad ``models`` to (those that have one):
    ``provisioners.worker.emulation.EMULATED_COMPUTE``."""
    return {name: EMULATED_COMPUTE[name] for name in models if name in EMULATED_COMPUTE}


def measure_serving_path(
    models: Sequence[str],
    batch_sizes: Sequence[int],
    types: Sequence[InstanceType],
    settings: MeasureSettings,
    *,
    cache_dir: str | Path | None = None,
    compute: Mapping[str, ComputeCurve] | None = None,
    progress: ProgressFn | None = None,
) -> list[LatencyProfile]:
    """End-to-end profiles of ``models`` on each of ``types`` (one profile per model and type,
    types in the order given, then models), one cell per batch size of ``batch_sizes``
    (increasing), ``settings.samples`` samples each, in ms: the round trip of a batch to a worker
    agent of that type on this machine (module docstring).

    The emulated workers pad to ``compute`` (default: :func:`emulated_compute` of the models);
    ``settings.threads`` are the workers' threads per batch. Trains the family first when its cache
    lacks it. Every worker started is stopped before this returns.

    Raises :class:`ProfilingError` when a worker does not become ready or refuses a batch.
    """
    from provisioners.local import LocalProvisioner

    say = progress or (lambda _message: None)
    if not types:
        raise ValueError("no instance type to profile")
    directory, inputs = _family_inputs(models, cache_dir, say)
    curves = dict(compute) if compute is not None else emulated_compute(models)
    names = [t.name for t in types]
    with tempfile.TemporaryDirectory(prefix="heteroplane-profiler-") as scratch:
        compute_file = Path(scratch) / "compute.json"
        write_profiles_json([], compute_file, compute=compute_document(curves))
        provisioner = LocalProvisioner(
            Path(scratch) / "workers",
            {t.name: t.speed_factor for t in types},
            models,
            directory,
            profile=compute_file,
            threads=settings.threads,
            start_timeout_s=WORKER_START_TIMEOUT_S,
            max_workers=len(types),
        )
        try:
            say(f"starting a worker of each of {', '.join(names)} on this machine")
            addresses = _start_workers(provisioner, names)
            clients = {name: WorkerClient(addresses[name]) for name in names}
            try:
                samples = _time_calls(clients, models, inputs, batch_sizes, settings, say)
            finally:
                for client in clients.values():
                    client.close()
        finally:
            _stop_workers(provisioner)
    sizes = np.array(batch_sizes)
    return [
        LatencyProfile(model, name, sizes, tuple(samples[name][model]))
        for name in names
        for model in models
    ]


def measure_family(
    models: Sequence[str],
    batch_sizes: Sequence[int],
    settings: MeasureSettings,
    *,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
) -> list[LatencyProfile]:
    """Compute-only profiles of the family ``models`` in this process (:data:`REFERENCE_TYPE`),
    one cell per batch size of ``batch_sizes`` (increasing), ``settings.samples`` samples each,
    in ms: the forward pass alone, none of the serving path.

    Trains the family first when its cache lacks it (``provisioners.worker.family``).
    """
    say = progress or (lambda _message: None)
    loaded, inputs = _load_family(models, cache_dir, say)
    samples: dict[str, list[np.ndarray]] = {name: [] for name in models}
    for batch_size in batch_sizes:
        say(
            f"timing {', '.join(models)} at batch size {batch_size}:"
            f" {settings.warmup} warm-up and {settings.samples} timed runs each"
        )
        cell = time_models(loaded, inputs, batch_size, settings)
        for name in models:
            samples[name].append(cell[name])
    return [
        LatencyProfile(name, REFERENCE_TYPE, np.array(batch_sizes), tuple(samples[name]))
        for name in models
    ]


def measure_compute_ms(
    models: Sequence[str],
    settings: MeasureSettings,
    *,
    cache_dir: str | Path | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, float]:
    """Per-query compute of each model: its mean latency at batch size 1 on this machine, ms."""
    profiles = measure_family(models, (1,), settings, cache_dir=cache_dir, progress=progress)
    return {p.model: float(p.mean_ms[0]) for p in profiles}


def time_models(
    models: Mapping[str, Callable[[np.ndarray], np.ndarray]],
    inputs: np.ndarray,
    batch_size: int,
    settings: MeasureSettings,
) -> dict[str, np.ndarray]:
    """Latency samples (ms) of each model (a function of a batch: the family's
    :class:`~provisioners.worker.family.ArrayModel`) on batches of ``batch_size`` rows of
    ``inputs``, numpy's BLAS on ``settings.threads`` threads.

    Round k feeds every model the same batch (rows k*b .. k*b+b-1, wrapping around), models in
    turn; the first ``settings.warmup`` rounds are not recorded.
    """
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    rounds = settings.warmup + settings.samples
    rows = np.asarray(inputs, dtype=np.float32)
    batches = [
        np.ascontiguousarray(rows[(k * batch_size + np.arange(batch_size)) % len(rows)])
        for k in range(rounds)
    ]
    timed: dict[str, list[float]] = {name: [] for name in models}
    with threadpool_limits(settings.threads):
        for k, batch in enumerate(batches):
            for name, model in models.items():
                start = time.perf_counter()
                model(batch)
                elapsed_ms = (time.perf_counter() - start) * 1000.0
                if k >= settings.warmup:
                    timed[name].append(elapsed_ms)
    return {name: np.array(values) for name, values in timed.items()}


def emulated_types(catalog: Catalog) -> list[InstanceType]:
    """The catalog's emulated types (family ``emu``), in catalog order."""
    return [t for t in catalog.values() if t.family == EMULATED_FAMILY]


def emulated_profiles(
    reference: Iterable[LatencyProfile],
    types: Iterable[InstanceType],
    compute: Mapping[str, ComputeCurve] | None = None,
) -> list[LatencyProfile]:
    """Compute-only profiles of emulated ``types`` from the ``reference`` ones measured in
    process (f > 1 is faster than the reference). Every sample of a type with speed factor f is
    the reference sample / f; with ``compute``, a model that has a curve there takes what its
    emulated worker serves that batch in instead, the padded compute C_m(b) / f or the sample
    itself where this machine computes slower still (``provisioners.worker.emulation``), which
    is not measured.

    >>> cells = (np.array([2.0]), np.array([3.0]))
    >>> base = LatencyProfile("m", "local.cpu", np.array([1, 2]), cells)
    >>> gpu = InstanceType("emu.gpu", 0.5, speed_factor=4.0)
    >>> emulated_profiles([base], [gpu])[0].mean_ms.tolist()
    [0.5, 0.75]
    >>> emulated_profiles([base], [gpu], {"m": ComputeCurve(4.0, 2.0)})[0].mean_ms.tolist()
    [2.0, 3.0]
    """
    measured = list(reference)
    curves = dict(compute or {})
    profiles = []
    for itype in types:
        factor = itype.speed_factor
        for profile in measured:
            curve = curves.get(profile.model)
            cells = tuple(
                cell / factor
                if curve is None
                else np.maximum(cell, curve.latency_ms(int(b)) / factor)
                for b, cell in zip(profile.batch_sizes, profile.samples_ms, strict=True)
            )
            profiles.append(LatencyProfile(profile.model, itype.name, profile.batch_sizes, cells))
    return profiles


def profile_meta(
    settings: MeasureSettings,
    types: Iterable[InstanceType],
    compute: Mapping[str, ComputeCurve],
    measurement: Measurement = "serving_path",
) -> dict[str, Any]:
    """The top-level keys of a measured profile file: where, when and how it was measured, and
    its ``compute`` section, the curves the emulated workers pad to (what they padded to while
    they were measured, and what the workers of a service given the file pad to). ``numpy`` is
    the version that computed the family's forward pass (the workers', and this process's with
    ``compute_only``)."""
    how = {
        "serving_path": "each sample is one batch's round trip to a worker agent of the type on"
        " this machine over kept-alive HTTP: the request's JSON, its parsing and validation,"
        " the model, the emulation's padding, the answer's JSON and its parsing",
        "compute_only": "each sample of local.cpu is the model's forward pass in the profiler's"
        " process, no serving path; an emulated type's is what its worker pads that batch to",
    }[measurement]
    return {
        "source": "measured",
        "measurement": measurement,
        "measurement_detail": how,
        "host": socket.gethostname(),
        "machine": f"{platform.system()} {platform.machine()} {platform.processor()}".strip(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "reference_type": REFERENCE_TYPE,
        "threads": settings.threads,
        "warmup": settings.warmup,
        "samples": settings.samples,
        "speed_factors": {t.name: t.speed_factor for t in types},
        "compute": compute_document(compute),
    }


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` as increasing whole numbers in 1..:data:`MAX_BATCH_SIZE` (any order in,
    duplicates refused)."""
    parts = [part.strip() for part in text.split(",")]
    if not parts or any(not part for part in parts):
        raise ValueError(f"batch sizes {text!r}: expected whole numbers separated by commas")
    sizes = []
    for part in parts:
        try:
            size = int(part)
        except ValueError:
            raise ValueError(f"batch size {part!r} is not a whole number") from None
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch size {size} is outside 1..{MAX_BATCH_SIZE}")
        sizes.append(size)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"batch sizes {text!r} repeat a size")
    return tuple(sorted(sizes))


def _load_family(
    models: Sequence[str], cache_dir: str | Path | None, say: ProgressFn
) -> tuple[dict[str, ArrayModel], np.ndarray]:
    """The family's models as the workers compute them (their arrays) and the validation
    inputs."""
    from provisioners.worker import family

    directory, inputs = _family_inputs(models, cache_dir, say)
    arrays = family.load_arrays(models, directory)
    if arrays is None:  # ensure_family has just written them: another process altered the cache
        raise ProfilingError(f"the family's cache {directory} changed while it was read; try again")
    return arrays, inputs


def _family_inputs(
    models: Sequence[str], cache_dir: str | Path | None, say: ProgressFn
) -> tuple[Path, np.ndarray]:
    """The family's cache (trained first when it lacks the family) and its validation inputs."""
    from provisioners.worker import family

    for name in models:
        family.model_spec(name)
    directory = family.ensure_family(cache_dir, progress=say)
    return directory, family.load_split().validation_inputs


def _start_workers(provisioner: LocalProvisioner, names: Sequence[str]) -> dict[str, str]:
    """Launch one worker of each type and wait until each answers ``/health``: their addresses.
    A worker that dies or does not answer in time is a :class:`ProfilingError` with its log's
    last line."""
    for name in names:
        provisioner.launch(LaunchRequest(f"profile-{name}", name, 1, _PROFILER_TAGS))
    while True:
        listed = provisioner.list(_PROFILER_TAGS)
        failed = [i for i in listed if i.state == "failed"]
        if failed:
            events = [e.message for e in provisioner.poll_events() if e.kind == "failed"]
            why = "; ".join(events) or f"{failed[0].instance_type} failed"
            raise ProfilingError(f"a worker to profile did not start: {why}")
        running = {i.instance_type: i.address for i in listed if i.state == "running"}
        if len(running) == len(names):
            return {name: str(running[name]) for name in names}
        time.sleep(_POLL_S)


def _stop_workers(provisioner: LocalProvisioner) -> None:
    """Stop every worker the profiler started and wait until they are gone."""
    provisioner.terminate([r.provider_id for r in provisioner.records()])
    provisioner.close()


class WorkerClient:
    """One kept-alive HTTP/1.1 connection to a worker agent, without Nagle's delay (as
    ``controlplane.serving.transport`` talks to workers): the profiler's side of a call, an Open
    Inference Protocol v2 ``POST /v2/models/{model}/infer``."""

    def __init__(self, address: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self._host, self._port = host.strip("[]"), int(port)
        self._timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def infer_ms(self, model: str, inputs: Mapping[str, np.ndarray]) -> float:
        """One batch's round trip (ms): from encoding the request to decoding the answer. A
        connection that broke is replaced and the call made once more (the broken attempt is
        not a sample). A call not answered within the timeout is not made again
        (:class:`ProfilingTimeoutError`): the worker is still on that batch, or stuck, and a
        second try waits as long again (a batch of 4,096 that an emulated type serves in about
        123 s had waited out two minute-long timeouts and been called a broken connection)."""
        rows = next(iter(inputs.values())).shape[0] if inputs else 0
        try:
            return self._call(model, inputs)
        except TimeoutError:
            self.close()
            raise ProfilingTimeoutError(self.address, model, rows, self._timeout_s) from None
        except (OSError, http.client.HTTPException):  # a broken connection
            self.close()
        try:
            return self._call(model, inputs)
        except TimeoutError:
            self.close()
            raise ProfilingTimeoutError(self.address, model, rows, self._timeout_s) from None
        except (OSError, http.client.HTTPException) as error:
            # The worker closed the connection again (it refused the body, it died): the run's
            # failure, not the control plane's (it was a 500 with BrokenPipeError's traceback).
            self.close()
            raise ProfilingError(
                f"the worker at {self.address} broke the connection on a batch of {rows} of"
                f" {model} twice: {type(error).__name__}: {error}"
            ) from None

    def ready(self) -> bool:
        """Whether the worker answers ``GET /v2/health/ready`` with 200 (a fresh connection)."""
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            connection.request("GET", "/v2/health/ready")
            response = connection.getresponse()
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    def _call(self, model: str, inputs: Mapping[str, np.ndarray]) -> float:
        connection = self._connect()
        start = time.perf_counter()
        body, header_length = binary_request_body(
            [(name, datatype_of(array.dtype), array) for name, array in inputs.items()]
        )
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}/infer"
        headers = {
            "Content-Type": "application/octet-stream",
            HEADER_LENGTH: str(header_length),
        }
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw[:200].decode("utf-8", "replace")
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if response.status != 200:
            error = answer.get("error") if isinstance(answer, dict) else answer
            rows = next(iter(inputs.values())).shape[0] if inputs else 0
            raise ProfilingError(
                f"the worker at {self.address} refused a batch of {rows} of {model}:"
                f" HTTP {response.status}: {error}"
            )
        return elapsed_ms

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
            connection.connect()
            assert connection.sock is not None
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connection = connection
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _time_calls(
    clients: Mapping[str, WorkerClient],
    models: Sequence[str],
    inputs: np.ndarray,
    batch_sizes: Sequence[int],
    settings: MeasureSettings,
    say: ProgressFn,
) -> dict[str, dict[str, list[np.ndarray]]]:
    """Samples (ms) by type, model and batch size: for each batch size, every type's worker at
    once (a thread each), round k sending every model in turn the same batch (rows k*b ..
    k*b+b-1 of ``inputs``, wrapping around); the first ``settings.warmup`` rounds not kept."""
    # The family's signature (provisioners.artifacts.FAMILY_SIGNATURE): FP32 rows of 64 pixels.
    (tensor,) = FAMILY_SIGNATURE.inputs
    rows = np.asarray(inputs, dtype=tensor.dtype)
    rounds = settings.warmup + settings.samples
    samples: dict[str, dict[str, list[np.ndarray]]] = {
        name: {model: [] for model in models} for name in clients
    }

    # Set when the caller stops (Ctrl-C, SIGTERM, a failed worker): the other threads end at
    # their next call, so that the pool's shutdown does not wait out every round first.
    stopping = threading.Event()

    def one_type(name: str, batch_size: int) -> dict[str, np.ndarray]:
        timed: dict[str, list[float]] = {model: [] for model in models}
        for k in range(rounds):
            if stopping.is_set():
                break
            batch = rows[(k * batch_size + np.arange(batch_size)) % len(rows)]
            for model in models:
                elapsed_ms = clients[name].infer_ms(model, {tensor.name: batch})
                if k >= settings.warmup:
                    timed[model].append(elapsed_ms)
        return {model: np.array(values) for model, values in timed.items()}

    with ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="profile") as pool:
        try:
            for batch_size in batch_sizes:
                say(
                    f"timing {', '.join(models)} at batch size {batch_size} through the workers"
                    f" of {', '.join(clients)}: {settings.warmup} warm-up and"
                    f" {settings.samples} timed calls each"
                )
                futures = {name: pool.submit(one_type, name, batch_size) for name in clients}
                for name, future in futures.items():
                    for model, cell in future.result().items():
                        samples[name][model].append(cell)
        except BaseException:
            stopping.set()
            raise
    return samples
