"""The local provisioner: worker processes on 127.0.0.1 that stand in for instances.

This module owns how an "instance" is made on this machine: one worker agent process
(``python -m provisioners.worker``, :mod:`provisioners.worker.agent`) per instance, emulating its
instance type (the catalog's speed factor, given by the control plane), listening on a loopback
port; and the state directory through which a restarted control plane finds them again.

State directory (one JSON file per thing, written to a temporary name and renamed):

- ``instances/<provider_id>.json``: a :class:`WorkerRecord` (pid, port, type, tags, request id,
  when it was launched, became ready, exited or was told to stop), written before the worker's
  process starts (with the port and no pid) and again once it runs (with the pid);
- ``requests/<sha256 of the request id>.json``: the provider ids a request id launched, written
  before any process starts, so a repeated :meth:`LocalProvisioner.launch` (also after a crash or
  a restart) returns those and never launches twice;
- ``logs/<provider_id>.log``: the worker's stdout and stderr;
- ``.lock``: ``flock``-ed around every change, so two provisioners on one directory agree.

Lifecycle of a worker, as :meth:`LocalProvisioner.list` reports it:

======================  ========================================================================
state                   when
======================  ========================================================================
``pending``             its process is alive and ``GET /health`` has not yet answered ``ok``
``running``             ``/health`` answered ``ok`` once (afterwards only the process is checked)
``failed``              the process died without being told to stop, never started (below), or
                        did not become ready within ``start_timeout_s`` (``/health`` is asked
                        once more past the timeout before it is failed); the death is reported
                        once by :meth:`~LocalProvisioner.poll_events`;
                        :meth:`~LocalProvisioner.terminate` clears it
``stopping``            SIGTERM was sent; SIGKILL follows after ``grace_s``
(gone)                  the process has exited after a terminate; its record and log are removed
======================  ========================================================================

"Alive" means the pid exists, is not a zombie and is our worker: on Linux it started when the
record says (``/proc/PID/stat``; a pid reused by another process has another start time).

Workers run in sessions of their own (``start_new_session``), so a control plane that stops or
restarts does not take them down; the next :class:`LocalProvisioner` on the same directory adopts
them. None runs without a record: a control plane killed between a worker's first record and its
second leaves one without a pid, which the next read resolves (under the lock, which a launch
holds from its first write to its last): the process whose command line holds ``--worker-id
<provider_id>`` (found in ``/proc``) is adopted, with its pid filled in; with none, the worker
never started (or has ended since) and the record is ``failed``, as a worker that died. A
request's provider id with no record at all never had a process.

The listening socket is bound here and handed to the worker (``--listen-fd``), so no other
process can take the port between choosing it and the worker's start.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from provisioners.artifacts import ArtifactRef
from provisioners.base import (
    EventKind,
    LaunchRequest,
    ProviderState,
    ProvisionedInstance,
    ProvisionerEvent,
    launch_refusal,
    launch_tags,
    model_process_env,
    tags_match,
)
from provisioners.errors import InvalidConfigurationError, QuotaExceededError
from provisioners.interruptions import (
    INTERRUPTION_NOTICE_S,
    InterruptionNotice,
    NoticeBoard,
    SpotPriceBoard,
)
from provisioners.storage import ArtifactStorage, LocalArtifactStorage

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_MAX_WORKERS",
    "DEFAULT_START_TIMEOUT_S",
    "HOST",
    "PROVIDER_ID_PREFIX",
    "ZONE",
    "LocalProvisioner",
    "WorkerRecord",
]

HOST = "127.0.0.1"
ZONE = "local"
PROVIDER_ID_PREFIX = "local-"
DEFAULT_GRACE_S = 5.0
# A worker imports torch and loads four small models in a few seconds; with a cold model cache it
# first trains the family (about 15 s on one core), slower still on a busy machine.
DEFAULT_START_TIMEOUT_S = 120.0
# Each worker holds torch and the models (about 300 MiB); the cap keeps a runaway plan from
# exhausting the machine and shows up to the control plane as a quota.
DEFAULT_MAX_WORKERS = 16
HEALTH_TIMEOUT_S = 0.5
# How long a request id is remembered after its last worker is gone (then a launch with the same
# id would start new workers); the reconciler never reuses an id anywhere near that long.
REQUEST_RETENTION_S = 24 * 3600.0
# How long to wait for a worker's exit after SIGKILL before giving up on it for this call.
KILL_WAIT_S = 5.0
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What the state directory holds about one worker (``instances/<provider_id>.json``)."""

    provider_id: str
    request_id: str
    instance_type: str
    speed_factor: float
    # ``None`` from the record written before the start until the one written after it: a
    # record that keeps ``None`` was left by a launch cut short between the two.
    pid: int | None
    port: int
    tags: Mapping[str, str]
    launched_at: datetime
    ready_at: datetime | None = None
    exited_at: datetime | None = None
    exit_code: int | None = None
    failure: str | None = None
    terminating_at: datetime | None = None
    killed: bool = False
    # The process's start time (/proc/PID/stat, clock ticks after boot): with the pid, who it is.
    start_ticks: int | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        def when(value: datetime | None) -> str | None:
            return value.isoformat() if value is not None else None

        return {
            "provider_id": self.provider_id,
            "request_id": self.request_id,
            "instance_type": self.instance_type,
            "speed_factor": self.speed_factor,
            "pid": self.pid,
            "port": self.port,
            "tags": dict(self.tags),
            "launched_at": when(self.launched_at),
            "ready_at": when(self.ready_at),
            "exited_at": when(self.exited_at),
            "exit_code": self.exit_code,
            "failure": self.failure,
            "terminating_at": when(self.terminating_at),
            "killed": self.killed,
            "start_ticks": self.start_ticks,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkerRecord:
        """The record in ``data``; ``ValueError`` (or ``KeyError``/``TypeError``) when malformed."""

        def when(key: str) -> datetime | None:
            value = data.get(key)
            return datetime.fromisoformat(value) if isinstance(value, str) else None

        launched_at = when("launched_at")
        tags = data["tags"]
        if launched_at is None or not isinstance(tags, dict):
            raise ValueError("a worker record needs launched_at and tags")
        pid, exit_code, start_ticks = data["pid"], data.get("exit_code"), data.get("start_ticks")
        return cls(
            provider_id=str(data["provider_id"]),
            request_id=str(data["request_id"]),
            instance_type=str(data["instance_type"]),
            speed_factor=float(data["speed_factor"]),
            pid=int(pid) if pid is not None else None,
            port=int(data["port"]),
            tags={str(k): str(v) for k, v in tags.items()},
            launched_at=launched_at,
            ready_at=when("ready_at"),
            exited_at=when("exited_at"),
            exit_code=int(exit_code) if exit_code is not None else None,
            failure=str(data["failure"]) if data.get("failure") is not None else None,
            terminating_at=when("terminating_at"),
            killed=bool(data.get("killed", False)),
            start_ticks=int(start_ticks) if start_ticks is not None else None,
        )


@dataclass(frozen=True, slots=True)
class _Ledger:
    """``requests/<hash>.json``: the provider ids one request id launched."""

    request_id: str
    instance_type: str
    provider_ids: tuple[str, ...]
    created_at: datetime
    tags: Mapping[str, str] = field(default_factory=dict)


class LocalProvisioner:
    """Worker processes on 127.0.0.1, one per instance (see the module docstring).

    ``catalog_speed`` maps the instance types it may run to their speed factors (from the
    catalog: ``emu.*`` and ``local.cpu``); ``models`` are the family models every worker serves
    from ``cache_dir`` (``None``: the family's default cache), unless its launch request names
    artifacts: then the worker serves those (``--artifact`` each, fetched into ``cache_dir``'s
    ``artifacts/``) and no family model; ``profile`` is an optional profile
    JSON with the reference type's curves, passed to the workers; ``pad=False`` turns latency
    emulation off. ``python`` runs the workers (this interpreter by default).
    """

    name = "local"

    def __init__(
        self,
        state_dir: str | Path,
        catalog_speed: Mapping[str, float],
        models: Sequence[str],
        cache_dir: str | Path | None,
        *,
        python: str = sys.executable,
        grace_s: float = DEFAULT_GRACE_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        profile: str | Path | None = None,
        pad: bool = True,
        threads: int = 1,
        max_workers: int = DEFAULT_MAX_WORKERS,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        if not models or any(not m or "," in m for m in models):
            raise InvalidConfigurationError("models", f"expected model names, got {list(models)}")
        for itype, factor in catalog_speed.items():
            if not math.isfinite(factor) or factor <= 0:
                raise InvalidConfigurationError(
                    "catalog_speed", f"{itype}: the speed factor must be positive, got {factor}"
                )
        if not math.isfinite(grace_s) or grace_s < 0:
            raise InvalidConfigurationError("grace_s", f"must be >= 0, got {grace_s}")
        if not start_timeout_s > 0:
            raise InvalidConfigurationError("start_timeout_s", f"must be > 0: {start_timeout_s}")
        if threads < 1:
            raise InvalidConfigurationError("threads", f"must be >= 1, got {threads}")
        if max_workers < 1:
            raise InvalidConfigurationError("max_workers", f"must be >= 1, got {max_workers}")
        self.state_dir = Path(state_dir)
        self.catalog_speed = dict(catalog_speed)
        self.models = tuple(models)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.python = python
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.profile = Path(profile) if profile is not None else None
        self.pad = pad
        self.threads = threads
        self.max_workers = max_workers
        self.health_timeout_s = health_timeout_s
        try:
            for sub in ("instances", "requests", "logs"):
                (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            self._lock_file = (self.state_dir / ".lock").open("a+")
        except OSError as error:
            raise InvalidConfigurationError(
                "state_dir", f"{self.state_dir}: {error.strerror}"
            ) from None
        self._lock = threading.RLock()
        self._lock_depth = 0
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._events: builtins.list[ProvisionerEvent] = []
        self._unreadable: set[str] = set()
        self._reapers: builtins.list[threading.Thread] = []
        self._reaping: set[str] = set()
        self._notices = NoticeBoard()
        self._spot_prices = SpotPriceBoard()
        self._interrupters: builtins.list[threading.Timer] = []
        # Direct connections only: a proxy from the environment must not see loopback checks.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with self._locked():
            adopted = [r for r in self._read_records() if self._alive(r)]
        if adopted:
            self._event(
                "info",
                f"adopted {len(adopted)} local worker(s) from {self.state_dir}",
            )

    # --- the Provisioner protocol ---------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> builtins.list[ProvisionedInstance]:
        """Start ``request.count`` workers of ``request.instance_type`` (returned ``pending``), or
        return those an earlier launch with this request id started (never start twice; reusing
        the id for another type or more workers is an ``InvalidConfigurationError``)."""
        if request.instance_type not in self.catalog_speed:
            known = ", ".join(sorted(self.catalog_speed)) or "none"
            raise InvalidConfigurationError(
                "instance_type",
                f"{request.instance_type} is not a type the local provisioner runs"
                f" (known: {known})",
            )
        with self._locked():
            ledger = self._read_ledger(request.request_id)
            if ledger is not None:
                if (
                    ledger.instance_type != request.instance_type
                    or len(ledger.provider_ids) < request.count
                ):
                    raise InvalidConfigurationError(
                        "request_id",
                        f"{request.request_id} already launched"
                        f" {len(ledger.provider_ids)} x {ledger.instance_type}; it cannot launch"
                        f" {request.count} x {request.instance_type}",
                    )
                return self._ledger_instances(ledger)
            records = self._read_records()
            live = sum(1 for r in records if r.exited_at is None and r.terminating_at is None)
            if live + request.count > self.max_workers:
                raise QuotaExceededError(
                    request.instance_type,
                    f"{live} local workers running, {request.count} more would pass the cap"
                    f" of {self.max_workers}",
                )
            self._prune_ledgers({r.provider_id for r in records})
            ids = tuple(self._new_id() for _ in range(request.count))
            tags = launch_tags(request)
            ledger = _Ledger(request.request_id, request.instance_type, ids, _now(), tags)
            self._write_ledger(ledger)
            started = [self._spawn(provider_id, request, tags) for provider_id in ids]
        return [self._instance(record, "pending") for record in started]

    def terminate(self, provider_ids: Sequence[str]) -> None:
        """SIGTERM each worker (its whole session), SIGKILL after ``grace_s`` in a background
        thread, and forget it once gone. Unknown ids and workers already gone are ignored."""
        signalled: builtins.list[WorkerRecord] = []
        with self._locked():
            for provider_id in dict.fromkeys(provider_ids):
                record = self._read_record(provider_id)
                if record is None:
                    continue
                if record.pid is None:
                    # Resolved as never started: looked for once more before it is forgotten (a
                    # launch killed between its fork and its exec leaves a child that holds no
                    # lock and shows the parent's command line for a moment).
                    found = _find_worker(record.provider_id)
                    if found is not None:
                        record = self._adopt(record, found)
                if not self._alive(record):
                    self._forget(record)
                    continue
                if record.terminating_at is None:
                    self._signal(record, signal.SIGTERM)
                    record = replace(record, terminating_at=_now())
                    self._write_record(record)
                signalled.append(record)
        if signalled:
            with self._lock:
                self._reaping.update(r.provider_id for r in signalled)
            reaper = threading.Thread(
                target=self._reap, args=(signalled,), name="local-reaper", daemon=True
            )
            self._reapers = [t for t in self._reapers if t.is_alive()] + [reaper]
            reaper.start()

    def list(self, tags: Mapping[str, str]) -> builtins.list[ProvisionedInstance]:
        """Every worker whose tags include ``tags``, with its state (see the module docstring);
        checks ``/health`` of the pending ones, detects deaths and late SIGKILLs on the way."""
        listed = self._refresh(check_health=True)
        chosen = [(r, s) for r, s in listed if tags_match(r.tags, tags)]
        chosen.sort(key=lambda item: (item[0].launched_at, item[0].provider_id))
        return [self._instance(record, state) for record, state in chosen]

    def poll_events(self) -> builtins.list[ProvisionerEvent]:
        """Worker deaths, start timeouts and adoptions since the last call, oldest first."""
        self._refresh(check_health=False)
        with self._lock:
            events, self._events = self._events, []
        return events

    def instance_types(self) -> frozenset[str]:
        """The types it emulates (``catalog_speed``'s)."""
        return frozenset(self.catalog_speed)

    def launch_refusal(self, instance_type: str) -> str | None:
        # The line names what it launches ("emulates only emu.* types" was said of an emu.*
        # type a custom catalog adds, emu.cpu.ghost, which it cannot launch either), the same
        # line whatever the type: the reconciler says it once for a plan's types.
        launches = ", ".join(sorted(self.catalog_speed)) or "nothing"
        return launch_refusal(
            self.name,
            self.catalog_speed,
            instance_type,
            f"the local provisioner launches only {launches}",
        )

    def artifact_storage(self, root: Path) -> ArtifactStorage:
        """Files under ``root``: the workers run on this machine and read ``file://`` URIs."""
        return LocalArtifactStorage(root)

    def poll_interruptions(self) -> builtins.list[InterruptionNotice]:
        """The notices :meth:`interrupt` gave since the last call, oldest first."""
        return self._notices.take()

    def spot_price(self, instance_type: str) -> float | None:
        """The spot price set with :meth:`set_spot_price`, or ``None`` (the app's catalog's
        serves): local workers cost nothing, the price is the one the control plane accounts."""
        return self._spot_prices.get(instance_type)

    # --- beyond the protocol --------------------------------------------------------------------

    def set_spot_price(self, instance_type: str, price_usd_per_hr: float | None) -> None:
        """The spot price knob: what :meth:`spot_price` answers for ``instance_type`` from now
        on, as the EC2 provisioner's DescribeSpotPriceHistory read would (``None``: unset)."""
        self._spot_prices.set(instance_type, price_usd_per_hr)

    def interrupt(
        self, provider_id: str, notice_s: float = INTERRUPTION_NOTICE_S
    ) -> InterruptionNotice:
        """The interruption knob: a spot interruption warning for the worker now, as EC2 gives
        one, and its SIGKILL ``notice_s`` later unless it was terminated by then (a worker
        killed so is ``failed``, as a lost machine). Raises ``InvalidConfigurationError`` for a
        worker this provisioner does not run."""
        with self._locked():
            record = self._read_record(provider_id)
        if record is None or record.exited_at is not None:
            raise InvalidConfigurationError("provider_id", f"no running worker {provider_id}")
        notice = self._notices.post(provider_id, _now(), notice_s)
        timer = threading.Timer(notice_s, self._kill_interrupted, args=(provider_id,))
        timer.daemon = True
        self._interrupters = [t for t in self._interrupters if t.is_alive()] + [timer]
        timer.start()
        return notice

    def _kill_interrupted(self, provider_id: str) -> None:
        with self._locked():
            record = self._read_record(provider_id)
            if record is None or record.terminating_at is not None or not self._alive(record):
                return  # terminated in time (or gone already): nothing to take away
            self._signal(record, signal.SIGKILL)
        self._event("info", f"worker {provider_id} taken away at the end of its notice", record)

    def records(self) -> builtins.list[WorkerRecord]:
        """The state directory's worker records as they are now (no checks, but a record a launch
        cut short left without a pid resolved first: see ``_resolve``), by launch time."""
        with self._locked():
            records = self._read_records()
        return sorted(records, key=lambda r: (r.launched_at, r.provider_id))

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the background SIGKILL threads of earlier terminates (the workers themselves
        keep running: they outlive the control plane by design)."""
        for reaper in list(self._reapers):
            reaper.join(timeout_s)
        for interrupter in self._interrupters:
            interrupter.cancel()

    # --- processes ------------------------------------------------------------------------------

    def _spawn(
        self, provider_id: str, request: LaunchRequest, tags: Mapping[str, str]
    ) -> WorkerRecord:
        factor = self.catalog_speed[request.instance_type]
        record: WorkerRecord | None = None
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((HOST, 0))
            listener.listen(128)
            port = int(listener.getsockname()[1])
            command = self._command(
                provider_id, request.instance_type, factor, listener.fileno(), request.artifacts
            )
            # Recorded before the start (the port is known, the pid not yet): a control plane
            # killed from here on leaves a record that names the worker, which the next
            # provisioner on the directory resolves (``_resolve``).
            record = WorkerRecord(
                provider_id=provider_id,
                request_id=request.request_id,
                instance_type=request.instance_type,
                speed_factor=factor,
                pid=None,
                port=port,
                tags=dict(tags),
                launched_at=_now(),
            )
            try:
                self._write_record(record)
            except OSError as error:  # the state directory, not the interpreter
                raise InvalidConfigurationError(
                    "state_dir", f"cannot record worker {provider_id}: {error}"
                ) from None
            log_path = self.state_dir / "logs" / f"{provider_id}.log"
            with log_path.open("ab") as log:
                process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(listener.fileno(),),
                    start_new_session=True,
                    env=self._environment(),
                    cwd=self.state_dir,
                )
        except OSError as error:
            if record is not None:
                self._forget(record)  # nothing started: no worker to name
            raise InvalidConfigurationError(
                "python", f"cannot start a worker with {self.python}: {error}"
            ) from None
        finally:
            listener.close()
        self._children[provider_id] = process
        return self._adopt(record, process.pid)

    def _command(
        self,
        provider_id: str,
        instance_type: str,
        factor: float,
        fd: int,
        artifacts: Sequence[ArtifactRef] = (),
    ) -> builtins.list[str]:
        """The worker's command line: the family's models by name, or, when the launch names
        artifacts, one ``--artifact`` for each and no family model."""
        if artifacts:
            served = [arg for ref in artifacts for pair in ref.worker_options() for arg in pair]
        else:
            served = ["--models", ",".join(self.models)]
        command = [
            self.python,
            "-m",
            "provisioners.worker",
            "--host",
            HOST,
            "--listen-fd",
            str(fd),
            "--instance-type",
            instance_type,
            "--speed-factor",
            repr(factor),
            *served,
            "--threads",
            str(self.threads),
            "--worker-id",
            provider_id,
            # Leave the worker time to drain and exit before the SIGKILL.
            "--drain-s",
            f"{self.grace_s / 2:.3f}",
        ]
        if self.cache_dir is not None:
            command += ["--cache-dir", str(self.cache_dir.resolve())]
        if self.profile is not None:
            command += ["--profile", str(self.profile.resolve())]
        if not self.pad:
            command.append("--no-pad")
        return command

    def _environment(self) -> dict[str, str]:
        env = model_process_env()
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(self.threads)
        return env

    def _alive(self, record: WorkerRecord) -> bool:
        """Whether the record's process exists, is not a zombie, and is our worker.

        A child of this provisioner is asked through its ``Popen`` (its pid cannot be reused
        before it is reaped). Another's (an adopted worker) must exist, not be a zombie, and on
        Linux have the start time recorded at launch (a reused pid has another); without one
        recorded, its command line must hold the provider id. A record without a pid (a launch
        cut short, that :meth:`_resolve` found no process for) is not alive.
        """
        child = self._children.get(record.provider_id)
        if child is not None:
            return child.poll() is None
        if record.pid is None:
            return False  # never started (see _resolve)
        try:
            os.kill(record.pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or another user's by now
            return False
        if not _PROC.is_dir():
            return True  # no procfs: the pid is all there is to go by
        stat = _proc_stat(record.pid)
        if stat is None or stat.state == "Z":
            return False
        if record.start_ticks is not None:
            return stat.start_ticks == record.start_ticks
        try:
            cmdline = (_PROC / str(record.pid) / "cmdline").read_bytes()
        except OSError:
            return False
        return record.provider_id.encode() in cmdline

    def _exit_code(self, record: WorkerRecord) -> int | None:
        child = self._children.get(record.provider_id)
        return child.poll() if child is not None else None

    def _signal(self, record: WorkerRecord, signum: signal.Signals) -> None:
        """Send ``signum`` to the worker's session (its process group; pgid = pid)."""
        if record.pid is None:
            return  # never started: nothing to signal
        try:
            if os.getpgid(record.pid) == record.pid:
                os.killpg(record.pid, signum)
            else:
                os.kill(record.pid, signum)
        except ProcessLookupError:
            pass

    def _reap(self, records: Sequence[WorkerRecord]) -> None:
        """Background: wait ``grace_s`` for each worker to exit, SIGKILL those that did not,
        and forget those gone."""
        for record in records:
            try:
                self._reap_one(record)
            finally:
                with self._lock:
                    self._reaping.discard(record.provider_id)

    def _reap_one(self, record: WorkerRecord) -> None:
        if record.terminating_at is not None:
            deadline = record.terminating_at + timedelta(seconds=self.grace_s)
            if not self._wait_gone(record, (deadline - _now()).total_seconds()):
                with self._locked():
                    current = self._read_record(record.provider_id)
                    if current is None:
                        return
                    if self._alive(current):
                        self._signal(current, signal.SIGKILL)
                        self._write_record(replace(current, killed=True))
                self._wait_gone(record, KILL_WAIT_S)
        with self._locked():
            current = self._read_record(record.provider_id)
            if current is not None and not self._alive(current):
                self._forget(current)

    def _wait_gone(self, record: WorkerRecord, timeout_s: float) -> bool:
        child = self._children.get(record.provider_id)
        if child is not None:
            try:
                child.wait(max(0.0, timeout_s))
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self._alive(record):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def _health_ok(self, record: WorkerRecord) -> bool:
        url = f"http://{record.address}/health"
        try:
            with self._opener.open(url, timeout=self.health_timeout_s) as response:
                body = json.loads(response.read())
        except (OSError, ValueError):  # refused, timed out, 503 (HTTPError), not JSON
            return False
        return (
            isinstance(body, dict)
            and body.get("status") == "ok"
            and body.get("worker_id") == record.provider_id
        )

    # --- state ----------------------------------------------------------------------------------

    def _refresh(self, *, check_health: bool) -> builtins.list[tuple[WorkerRecord, ProviderState]]:
        """Every record with its state; records deaths, start timeouts and late SIGKILLs, forgets
        terminated workers that are gone."""
        listed: builtins.list[tuple[WorkerRecord, ProviderState]] = []
        pending: builtins.list[WorkerRecord] = []
        with self._locked():
            now = _now()
            for record in self._read_records():
                alive = self._alive(record)
                if record.terminating_at is not None:
                    if not alive:
                        self._forget(record)
                        continue
                    overdue = now - record.terminating_at >= timedelta(seconds=self.grace_s)
                    if overdue and not record.killed and record.provider_id not in self._reaping:
                        # Told to stop by an earlier control plane whose reaper is gone.
                        self._signal(record, signal.SIGKILL)
                        record = replace(record, killed=True)
                        self._write_record(record)
                    listed.append((record, "stopping"))
                elif record.exited_at is not None or record.failure is not None:
                    listed.append((record, "failed"))
                elif not alive:
                    listed.append((self._record_death(record, now), "failed"))
                elif record.ready_at is not None:
                    listed.append((record, "running"))
                else:
                    pending.append(record)
        if not pending:
            return listed
        if check_health:
            with ThreadPoolExecutor(max_workers=min(8, len(pending))) as pool:
                healthy = list(pool.map(self._health_ok, pending))
        else:
            healthy = [False] * len(pending)
        with self._locked():
            now = _now()
            for record, ok in zip(pending, healthy, strict=True):
                current = self._read_record(record.provider_id)
                if current is None or current.terminating_at is not None:
                    continue  # terminated meanwhile; the next call reports it
                # Another call (a provisioner on the same directory, or this one's other
                # thread) may have decided meanwhile: its decision stands, said once.
                if current.exited_at is not None or current.failure is not None:
                    listed.append((current, "failed"))
                    continue
                if current.ready_at is not None:
                    listed.append((current, "running"))
                    continue
                if ok:
                    current = replace(current, ready_at=_now())
                    self._write_record(current)
                    listed.append((current, "running"))
                elif check_health and now - current.launched_at > timedelta(
                    seconds=self.start_timeout_s
                ):
                    # Past its start timeout, and /health asked once more: a worker adopted
                    # after a control plane's restart that outlasted the timeout is not failed
                    # unasked (nor one whose readiness a busy control plane checked late).
                    failure = f"did not answer /health within {self.start_timeout_s:g} s"
                    current = replace(current, failure=failure)
                    self._write_record(current)
                    self._event("failed", f"worker {current.provider_id} {failure}", current)
                    listed.append((current, "failed"))
                else:
                    listed.append((current, "pending"))
        return listed

    def _record_death(self, record: WorkerRecord, now: datetime) -> WorkerRecord:
        code = self._exit_code(record)
        died = replace(record, exited_at=now, exit_code=code)
        self._write_record(died)
        status = f"with status {code}" if code is not None else "(status unknown)"
        last = self._log_tail(record.provider_id)
        detail = f": {last}" if last else ""
        self._event(
            "failed",
            f"worker {record.provider_id} ({record.instance_type}, pid {record.pid}, port"
            f" {record.port}) exited {status}{detail}",
            record,
        )
        return died

    def _log_tail(self, provider_id: str) -> str:
        try:
            with (self.state_dir / "logs" / f"{provider_id}.log").open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 2048))
                lines = log.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip()[:300] if lines else ""

    def _forget(self, record: WorkerRecord) -> None:
        (self.state_dir / "instances" / f"{record.provider_id}.json").unlink(missing_ok=True)
        (self.state_dir / "logs" / f"{record.provider_id}.log").unlink(missing_ok=True)
        child = self._children.pop(record.provider_id, None)
        if child is not None:
            child.poll()

    def _instance(self, record: WorkerRecord, state: ProviderState) -> ProvisionedInstance:
        return ProvisionedInstance(
            provider_id=record.provider_id,
            instance_type=record.instance_type,
            state=state,
            tags=dict(record.tags),
            address=record.address,
            zone=ZONE,
            launched_at=record.launched_at,
        )

    def _ledger_instances(self, ledger: _Ledger) -> builtins.list[ProvisionedInstance]:
        """The instances of an earlier launch: their current state, ``terminated`` once gone."""
        states = {r.provider_id: (r, s) for r, s in self._refresh(check_health=False)}
        instances = []
        for provider_id in ledger.provider_ids:
            if provider_id in states:
                instances.append(self._instance(*states[provider_id]))
            else:
                instances.append(
                    ProvisionedInstance(
                        provider_id,
                        ledger.instance_type,
                        "terminated",
                        dict(ledger.tags),
                        None,
                        ZONE,
                        ledger.created_at,
                    )
                )
        return instances

    def _event(self, kind: EventKind, message: str, record: WorkerRecord | None = None) -> None:
        with self._lock:
            self._events.append(
                ProvisionerEvent(
                    at=_now(),
                    kind=kind,
                    message=message,
                    instance_type=record.instance_type if record else None,
                    zone=ZONE if record else None,
                    provider_id=record.provider_id if record else None,
                )
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's threads, then other processes on the same state directory."""
        with self._lock:
            if self._lock_depth == 0:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX)
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
                if self._lock_depth == 0:
                    fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)

    def _new_id(self) -> str:
        while True:
            provider_id = PROVIDER_ID_PREFIX + secrets.token_hex(6)
            if not (self.state_dir / "instances" / f"{provider_id}.json").exists():
                return provider_id

    def _read_records(self) -> builtins.list[WorkerRecord]:
        records = []
        for path in sorted((self.state_dir / "instances").glob("*.json")):
            if path.name.startswith("."):
                continue
            record = self._read_record(path.stem)
            if record is not None:
                records.append(record)
        return records

    def _read_record(self, provider_id: str) -> WorkerRecord | None:
        if Path(provider_id).name != provider_id or not provider_id:
            return None
        path = self.state_dir / "instances" / f"{provider_id}.json"
        try:
            record = WorkerRecord.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            if path.name not in self._unreadable:
                self._unreadable.add(path.name)
                self._event("info", f"ignoring the unreadable worker record {path}: {error}")
            return None
        if record.pid is None and record.exited_at is None:
            return self._resolve(record)
        return record

    def _adopt(self, record: WorkerRecord, pid: int) -> WorkerRecord:
        """``record`` with its process ``pid`` and that process's start time, written."""
        stat = _proc_stat(pid)
        found = replace(record, pid=pid, start_ticks=stat.start_ticks if stat else None)
        self._write_record(found)
        return found

    def _resolve(self, record: WorkerRecord) -> WorkerRecord:
        """A record without a pid, written before its worker's start by a launch cut short
        before the pid was written (every read is under the lock, which a launch holds from its
        first write to its last, so no launch is halfway now): with the pid of the worker if it
        runs (found by the ``--worker-id`` on its command line; it is adopted, its port is in the
        record), else marked exited (never started, or ended since): ``failed`` from now on, and
        a ``failed`` event says so, once."""
        child = self._children.get(record.provider_id)
        pid = child.pid if child is not None else _find_worker(record.provider_id)
        if pid is not None:
            return self._adopt(record, pid)
        gone = replace(record, exited_at=_now())
        self._write_record(gone)
        last = self._log_tail(record.provider_id)
        self._event(
            "failed",
            f"worker {record.provider_id} ({record.instance_type}, port {record.port}) is not"
            " running: its launch was cut short before its pid was recorded"
            + (f"; its log: {last}" if last else ""),
            record,
        )
        return gone

    def _write_record(self, record: WorkerRecord) -> None:
        path = self.state_dir / "instances" / f"{record.provider_id}.json"
        _write_atomic(path, record.to_json())

    def _ledger_path(self, request_id: str) -> Path:
        digest = hashlib.sha256(request_id.encode()).hexdigest()[:32]
        return self.state_dir / "requests" / f"{digest}.json"

    def _read_ledger(self, request_id: str) -> _Ledger | None:
        try:
            data = json.loads(self._ledger_path(request_id).read_text())
            if data["request_id"] != request_id:
                return None
            return _Ledger(
                request_id=request_id,
                instance_type=str(data["instance_type"]),
                provider_ids=tuple(str(p) for p in data["provider_ids"]),
                created_at=datetime.fromisoformat(data["created_at"]),
                tags={str(k): str(v) for k, v in data.get("tags", {}).items()},
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise InvalidConfigurationError(
                "state_dir", f"unreadable request record {self._ledger_path(request_id)}: {error}"
            ) from None

    def _write_ledger(self, ledger: _Ledger) -> None:
        _write_atomic(
            self._ledger_path(ledger.request_id),
            {
                "request_id": ledger.request_id,
                "instance_type": ledger.instance_type,
                "provider_ids": list(ledger.provider_ids),
                "created_at": ledger.created_at.isoformat(),
                "tags": dict(ledger.tags),
            },
        )

    def _prune_ledgers(self, live_ids: set[str]) -> None:
        """Forget request ids older than :data:`REQUEST_RETENTION_S` whose workers are all gone."""
        cutoff = time.time() - REQUEST_RETENTION_S
        for path in (self.state_dir / "requests").glob("*.json"):
            try:
                if path.stat().st_mtime >= cutoff:
                    continue
                ids = json.loads(path.read_text()).get("provider_ids", [])
            except (OSError, ValueError, AttributeError):
                continue
            if not live_ids.intersection(ids):
                path.unlink(missing_ok=True)


def _now() -> datetime:
    return datetime.now(UTC)


_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class _ProcStat:
    state: str
    session: int
    start_ticks: int


def _proc_stat(pid: int) -> _ProcStat | None:
    """State, session and start time of ``pid`` from ``/proc/PID/stat`` (``None``: unreadable)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces and parentheses): state is field 3,
    # session field 6, starttime field 22 (proc(5)).
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return _ProcStat(fields[0], int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _find_worker(provider_id: str) -> int | None:
    """The pid of the live process started as worker ``provider_id``: its command line holds
    ``--worker-id provider_id`` and it leads a session (it was started in one of its own; a
    process it forked shares its command line, not its session id). ``None`` when there is none,
    or no procfs to look in."""
    if not _PROC.is_dir():
        return None
    needle = b"\0--worker-id\0" + provider_id.encode() + b"\0"
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "cmdline").read_bytes():
                continue
        except OSError:
            continue
        pid = int(entry.name)
        stat = _proc_stat(pid)
        if stat is not None and stat.state != "Z" and stat.session == pid:
            return pid
    return None


def _write_atomic(path: Path, document: Mapping[str, Any]) -> None:
    """Write via a temporary file and a rename, so a reader never sees half a record."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump(document, handle, indent=1)
            handle.write("\n")
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
