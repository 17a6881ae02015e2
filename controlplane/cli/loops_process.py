"""The loops process that ``heteroplane serve`` (and ``heteroplane demo``) starts beside its
serving process, and supervises (docs/service.md, "Serving apart from the loops").

The process the user started serves the API and inference with no periodic job
(``build_service(role="serving")``); :class:`LoopsProcess` runs the periodic jobs in a child
(``python -m controlplane.cli.loops_process``: ``build_service(role="loops")``, under the leader
lease), which reads the serving process over its internal feed:

- **The secret** the child sends to the internal routes is made up here
  (:func:`secrets.token_urlsafe`) for each start of the service and given to the serving
  process's settings (``internal_token``: its internal routes take it) and to the child in its
  environment (``HETEROPLANE_INTERNAL_TOKEN``; a process's environment is readable by its user
  alone, ``/proc/PID/environ`` is mode 0400). It is never printed, logged or written to a file.
- **The child's API** (``/healthz``, ``/metrics`` of the jobs) listens on a loopback port bound
  here once and handed to each child (``pass_fds``), so its address stays the same across
  restarts; the serving process's ``/healthz`` says it (``loops.url``) with the child's pid, its
  restarts and its role under the lease.
- **Supervision.** A thread waits on the child; a child that exits while the service runs is
  logged and started again, after 0.5 s, doubling up to 30 s while it keeps dying within a minute
  of its start. :meth:`LoopsProcess.stop` sends the child the signal that stopped the serving
  process (SIGTERM or SIGINT), waits :data:`STOP_WAIT_S` for it to finish its running jobs, and
  kills it past that. The child runs in a session of its own, so a terminal's Ctrl-C reaches the
  serving process alone, which forwards it.
- **No orphan.** A serving process killed outright (``kill -9``) cannot stop its child: the child
  watches its parent (every :data:`PARENT_CHECK_S`) and stops itself, as on SIGTERM, when it has
  gone.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "PARENT_CHECK_S",
    "RESTART_FIRST_S",
    "RESTART_MAX_S",
    "STOP_WAIT_S",
    "LoopsProcess",
    "main",
]

logger = logging.getLogger("controlplane.serve")

# A child that died is started again after RESTART_FIRST_S, the wait doubling up to
# RESTART_MAX_S while it keeps dying within STABLE_S of its start.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 60.0
# How long a stopped child may take to finish its running jobs before it is killed.
STOP_WAIT_S = 30.0
# How often the child looks for its parent.
PARENT_CHECK_S = 1.0
# How long the serving process's /healthz waits for the child's.
HEALTH_TIMEOUT_S = 1.0


class LoopsProcess:
    """The supervised loops child of a serving process whose API is at ``serving_url`` (see the
    module docstring); ``config`` and ``log_level`` are the serving process's own."""

    def __init__(self, serving_url: str, config: Path | None, log_level: str) -> None:
        self.serving_url = serving_url
        self.config = config
        self.log_level = log_level
        # The secret of this start of the service; repr=False is not enough for a plain
        # attribute, so it is never formatted anywhere.
        self.token = secrets.token_urlsafe(32)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._mutex = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The running child's pid (None between a death and its restart, or once stopped)."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self) -> None:
        """Start the child and the thread that supervises it."""
        with self._mutex:
            self._spawn_locked()
        self._thread = threading.Thread(target=self._supervise, name="loops-process", daemon=True)
        self._thread.start()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop supervising, send the child ``signum`` and wait for it (killed past
        :data:`STOP_WAIT_S`); then close the child's listening socket. Safe to call twice."""
        self._stopping.set()
        with self._mutex:
            process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signum)
            try:
                process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the loops process (pid %d) did not stop: killed", process.pid)
                process.kill()
                process.wait()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._sock.close()

    def health(self) -> dict[str, Any]:
        """The child as the serving process's ``/healthz`` says it: pid, restarts, its API's URL
        and its role under the leader lease (None while it does not answer)."""
        role: str | None = None
        if self.pid is not None:
            try:
                role = httpx.get(f"{self.url}/healthz", timeout=HEALTH_TIMEOUT_S).json()["role"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                role = None
        return {"pid": self.pid, "restarts": self.restarts, "url": self.url, "role": role}

    def _spawn_locked(self) -> None:
        fd = self._sock.fileno()
        command = [
            sys.executable,
            "-m",
            "controlplane.cli.loops_process",
            "--fd",
            str(fd),
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            self.log_level,
        ]
        if self.config is not None:
            command += ["--config", str(self.config)]
        env = {
            **os.environ,
            "HETEROPLANE_SERVING_URL": self.serving_url,
            "HETEROPLANE_INTERNAL_TOKEN": self.token,
        }
        self._process = subprocess.Popen(
            command, env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL, start_new_session=True
        )
        logger.info("loops process started (pid %d, its API on %s)", self._process.pid, self.url)

    def _supervise(self) -> None:
        wait_s = RESTART_FIRST_S
        while True:
            with self._mutex:
                process = self._process
            if process is None:
                return
            started = time.monotonic()
            code = process.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started >= STABLE_S:
                wait_s = RESTART_FIRST_S
            logger.warning(
                "the loops process (pid %d) exited with status %d: starting it again in %g s",
                process.pid,
                code,
                wait_s,
            )
            if self._stopping.wait(wait_s):
                return
            with self._mutex:
                if self._stopping.is_set():
                    return
                self.restarts += 1
                self._spawn_locked()
            wait_s = min(2 * wait_s, RESTART_MAX_S)


# --- the child ------------------------------------------------------------------------------


def _watch_parent(parent_pid: int, stopped: threading.Event) -> None:
    """Stop this process (as SIGTERM does) once its parent, the serving process, is gone."""
    while not stopped.wait(PARENT_CHECK_S):
        if os.getppid() != parent_pid:
            logger.warning("the serving process (pid %d) is gone: stopping", parent_pid)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main(argv: list[str] | None = None) -> int:
    """The child: the loops of the service (``build_service(role="loops")``) and their API on
    the socket it was handed, until SIGTERM, SIGINT or its parent's death."""
    from controlplane.cli.output import UsageError, fail
    from controlplane.cli.serve import configure_logging, serve_until_stopped
    from controlplane.crashpoints import crash_with
    from controlplane.errors import ControlPlaneError
    from controlplane.service.build import build_service
    from controlplane.settings import load_settings
    from estimator.errors import EstimatorError

    parser = argparse.ArgumentParser(prog="heteroplane serve (loops process)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--config", type=Path)
    args = parser.parse_args(argv)
    # A crash point of the loops (a test-only hook) kills the service whole, serving included.
    crash_with(args.parent_pid)
    sock = socket.socket(fileno=args.fd)
    stopped = threading.Event()
    watcher = threading.Thread(
        target=_watch_parent, args=(args.parent_pid, stopped), name="parent-watch", daemon=True
    )
    watcher.start()
    try:
        settings = load_settings(args.config)
        configure_logging(args.log_level, process="loops")
        service = build_service(settings, role="loops")
        # What is alive now (the imported libraries, the service) is left out of the cyclic
        # collector's full passes, as the serving loop's and the workers' are: this process
        # walked about 250,000 objects in each, 140-150 ms of a core that the serving process
        # and the workers share on a small machine (a diagnostic of gc.callbacks in the
        # fidelity benchmark's runs).
        gc.collect()
        gc.freeze()
        return serve_until_stopped(service, sock, args.log_level)
    except (EstimatorError, UsageError, ControlPlaneError) as error:
        fail(f"heteroplane serve (loops process): {error}")
    finally:
        stopped.set()


if __name__ == "__main__":
    raise SystemExit(main())
