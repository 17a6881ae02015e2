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
  alone, ``/proc/PID/environ`` is mode 0400; a child forked by the zygote below gets it over
  the zygote's socket, so it is not in its ``/proc/PID/environ`` at all). It is never printed,
  logged or written to a file.
- **The zygote.** The child imports the whole service (about 2 s of a core), which the serving
  process has imported already. Where the platform allows (Linux's ``pidfd_open``) and the
  serving process runs no other Python thread and has not imported torch when
  :class:`LoopsProcess` is made (before its database, its threads or its event loop;
  :func:`_forkable`), it forks a zygote (:class:`_Zygote`): a process of its own session
  that holds the imported modules, closes every other inherited descriptor and forks each loops
  child on request, already imported (the child's argv, environment and API socket come over a
  Unix socket pair; its pid and its exit status go back). A serving process with more threads
  (the demo's, after torch trained its family) starts the child with ``python -m`` as before.
  The zygote stops its child and exits when the serving process's end of the pair closes
  (its stop, or its death).
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
import contextlib
import gc
import json
import logging
import os
import queue
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
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
# How long a spawn request waits for the zygote's answer before the child is started with
# ``python -m`` instead, s.
ZYGOTE_ANSWER_S = 10.0
# The largest message over the zygote's socket pair (the child's environment is most of it).
_MESSAGE_MAX = 1 << 20


class LoopsProcess:
    """The supervised loops child of a serving process whose API is at ``serving_url`` (see the
    module docstring); ``config`` and ``log_level`` are the serving process's own."""

    def __init__(self, serving_url: str, config: Path | None, log_level: str) -> None:
        self.serving_url = serving_url
        self.config = config
        self.log_level = log_level
        # First, while this process may still be a single thread with nothing open but what
        # it was started with (see the module docstring). The solvers the loops' planners call
        # (scipy.optimize: the Kairos matching's assignment in a simulated fleet of fewer than
        # 32 instances, a cascade's LPs) are imported before the fork, so that every loops
        # child has them already: the serving loop loads them at its start anyway
        # (matching.assignment.load_solver), and a child that plans would import them again
        # (about 0.7 s of a core, for each start of the child). The fork's own check comes
        # after the import, so a solver that started a thread would keep the zygote away.
        from matching.assignment import load_solver

        load_solver()
        self._zygote = _Zygote.fork()
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
        self._process: subprocess.Popen[bytes] | _ForkedChild | None = None
        self._mutex = threading.Lock()
        self._stopping = threading.Event()
        self._signalled = False
        self._begun = False  # begin_stop was called (a plain flag: no lock in a signal handler)
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

    def begin_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop supervising and send the child ``signum`` without waiting for it, so that it
        finishes its running jobs while the serving process drains its requests (a signal
        handler's call: it does not block). :meth:`stop` then waits; once is enough.

        A second call returns at once: it is a signal handler's, and a second signal (a
        ``pkill`` that reached ``timeout`` and the process both, which ``timeout`` forwards)
        runs it on the main thread while the first still holds the event's or the mutex's lock,
        neither of which a thread may take twice: the demo hung in its stop for good."""
        if self._begun:
            return
        self._begun = True
        self._stopping.set()
        with self._mutex:
            process, self._signalled = self._process, True
        if process is not None and process.poll() is None:
            process.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop supervising, send the child ``signum`` (unless :meth:`begin_stop` has) and wait for
        it (killed past :data:`STOP_WAIT_S`); then close the child's listening socket. Safe to
        call twice."""
        self._stopping.set()
        with self._mutex:
            process, signalled = self._process, self._signalled
        if process is not None and process.poll() is None:
            if not signalled:
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
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()
        self._sock.close()

    def health(self) -> dict[str, Any]:
        """The child as the serving process's ``/healthz`` says it: pid, restarts, its API's URL,
        its role under the leader lease and whether its feed from this process answers (both
        None while it does not answer)."""
        role = feed = None
        if self.pid is not None:
            try:
                health = httpx.get(f"{self.url}/healthz", timeout=HEALTH_TIMEOUT_S).json()
                role, feed = health["role"], health.get("serving_feed")
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                role = feed = None
        return {
            "pid": self.pid,
            "restarts": self.restarts,
            "url": self.url,
            "role": role,
            "serving_feed": feed if feed in ("ok", "down") else None,
        }

    def _spawn_locked(self) -> None:
        fd = self._sock.fileno()
        arguments = ["--parent-pid", str(os.getpid()), "--log-level", self.log_level]
        if self.config is not None:
            arguments += ["--config", str(self.config)]
        env = {
            **os.environ,
            "HETEROPLANE_SERVING_URL": self.serving_url,
            "HETEROPLANE_INTERNAL_TOKEN": self.token,
        }
        forked = None
        if self._zygote is not None:
            forked = self._zygote.spawn(arguments, env, fd)
            if forked is None:
                logger.warning("the loops zygote did not answer: loops processes start anew")
                self._zygote.close()
                self._zygote = None
        if forked is not None:
            self._process = forked
            how = "forked by the zygote"
        else:
            command = [sys.executable, "-m", "controlplane.cli.loops_process", "--fd", str(fd)]
            self._process = subprocess.Popen(
                command + arguments,
                env=env,
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            how = "started"
        logger.info("loops process %s (pid %d, its API on %s)", how, self._process.pid, self.url)

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


# --- the zygote -----------------------------------------------------------------------------


class _ForkedChild:
    """A loops child forked by the zygote, as much of :class:`subprocess.Popen` as
    :class:`LoopsProcess` uses; its exit status comes from the zygote, which reaps it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"loops process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        # Until the zygote has reaped it the pid is the child's (a zombie at worst).
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


def _forkable() -> bool:
    """Whether this process may fork a zygote: no Python thread but this one, and no torch (its
    OpenMP pool, once used, is not safe in a forked child). NumPy's OpenBLAS starts a pool of
    native threads when imported; it re-creates the pool in a forked child (its ``atfork``
    handlers), so those threads do not count."""
    return threading.active_count() == 1 and "torch" not in sys.modules


class _Zygote:
    """The serving process's end of the zygote (the module docstring): :meth:`fork` makes it,
    :meth:`spawn` asks it for a loops child, :meth:`close` ends it."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self._conn = conn
        self._started: queue.Queue[int] = queue.Queue()
        self._child: _ForkedChild | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    @classmethod
    def fork(cls) -> _Zygote | None:
        """A zygote forked from this process, or None where that is not safe or possible
        (another platform, or more than this one thread)."""
        if not hasattr(os, "pidfd_open") or not _forkable():
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # What this process has buffered would otherwise be written twice (by it and the zygote).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:  # the zygote
            code = 0
            try:
                ours.close()
                _zygote_main(theirs)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid, ours)

    def spawn(self, arguments: list[str], env: dict[str, str], fd: int) -> _ForkedChild | None:
        """A loops child with ``arguments`` (``--fd`` added), ``env`` and the socket ``fd``;
        None when the zygote does not answer (gone, or stuck)."""
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read, name="loops-zygote", daemon=True)
                self._reader.start()
            request = json.dumps({"arguments": arguments, "env": env}).encode()
            try:
                socket.send_fds(self._conn, [request], [fd])
                pid = self._started.get(timeout=ZYGOTE_ANSWER_S)
            except (OSError, queue.Empty):
                return None
            if pid <= 0:
                return None
            self._child = _ForkedChild(pid)
            return self._child

    def close(self) -> None:
        """End the zygote (it stops a child of its own still running) and reap it."""
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        deadline = time.monotonic() + STOP_WAIT_S + 5.0
        while True:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)

    def _read(self) -> None:
        """The zygote's messages: a child started (its pid, to :meth:`spawn`) or exited (its
        status, to the child's handle). An end of the pair ends any child it still had."""
        while True:
            try:
                message = self._conn.recv(_MESSAGE_MAX)
            except OSError:
                message = b""
            if not message:
                self._started.put(0)
                child = self._child
                if child is not None and child.returncode is None:
                    child.exited(-signal.SIGKILL)
                return
            event = json.loads(message)
            if "started" in event:
                self._started.put(int(event["started"]))
            elif "exited" in event:
                child = self._child
                if child is not None and child.pid == event["exited"]:
                    child.exited(int(event["code"]))


def _name_process(name: str) -> None:
    """Name this process for ``ps -o comm`` and ``top`` (its command line stays the serving
    process's: a forked process keeps it)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name)


def _zygote_main(conn: socket.socket) -> None:
    """The zygote: fork a loops child on each request over ``conn``, report its pid and, once
    it has exited, its status; stop it and return when the serving process's end closes."""
    serving = os.getppid()
    os.setsid()  # a terminal's Ctrl-C reaches the serving process alone
    # It ends when the serving process's end of the pair closes, whatever stopped that one (a
    # `pkill -f "heteroplane serve"` reaches the three processes, whose command line is the same).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name_process("hp-loops-zygote")
    keep = conn.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    child: int | None = None
    pidfd: int | None = None

    def reap(pid: int) -> int:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def tell(event: dict[str, int]) -> None:
        # The serving process may be gone (its end closed): that is read next.
        with contextlib.suppress(OSError):
            conn.send(json.dumps(event).encode())

    while True:
        watched: list[Any] = [conn] if pidfd is None else [conn, pidfd]
        ready, _, _ = select.select(watched, [], [])
        if child is not None and pidfd is not None and pidfd in ready:
            code = reap(child)
            os.close(pidfd)
            tell({"exited": child, "code": code})
            child, pidfd = None, None
        if conn not in ready:
            continue
        try:
            message, fds, _flags, _address = socket.recv_fds(conn, _MESSAGE_MAX, 1)
        except OSError:  # reset: the serving process is gone
            message, fds = b"", []
        if not message:  # the serving process stopped, or died
            if child is not None and pidfd is not None:
                # Its stop stops the child first: a child still running means it died.
                logger.warning(
                    "the serving process (pid %d) is gone: stopping its loops process (pid %d)",
                    serving,
                    child,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGTERM)
                if not select.select([pidfd], [], [], STOP_WAIT_S)[0]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)
                reap(child)
            return
        if not fds:
            tell({"started": 0})
            continue
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            _forked_child(conn, fds[0], request["arguments"], request["env"])
        os.close(fds[0])
        child, pidfd = pid, os.pidfd_open(pid)
        tell({"started": pid})


def _forked_child(conn: socket.socket, fd: int, arguments: list[str], env: dict[str, str]) -> None:
    """A loops child of the zygote: :func:`main` as ``python -m`` would run it. Never returns."""
    code = 1
    try:
        conn.close()
        os.setsid()
        _name_process("hp-loops")
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # The serving process's logging configuration came with the fork: the child's own
        # (its lines tagged) replaces it.
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        code = main(["--fd", str(fd), "--zygote-pid", str(os.getppid()), *arguments])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# --- the child ------------------------------------------------------------------------------


def _watch_parent(parent_pid: int, what: str, stopped: threading.Event) -> None:
    """Stop this process (as SIGTERM does) once its parent (``what``: the serving process, or
    the zygote) is gone."""
    while not stopped.wait(PARENT_CHECK_S):
        if os.getppid() != parent_pid:
            logger.warning("the %s (pid %d) is gone: stopping", what, parent_pid)
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
    # Forked by the zygote: the process it watches is the zygote (which exits when the serving
    # process --parent-pid is gone); a crash point still kills the serving process.
    parser.add_argument("--zygote-pid", type=int)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--config", type=Path)
    args = parser.parse_args(argv)
    # A crash point of the loops (a test-only hook) kills the service whole, serving included.
    crash_with(args.parent_pid)
    sock = socket.socket(fileno=args.fd)
    stopped = threading.Event()
    watched = (
        (args.parent_pid, "serving process")
        if args.zygote_pid is None
        else (args.zygote_pid, "loops zygote")
    )
    watcher = threading.Thread(
        target=_watch_parent, args=(*watched, stopped), name="parent-watch", daemon=True
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
        on_stop = None if service.remote is None else service.remote.stopping
        return serve_until_stopped(service, sock, args.log_level, supervised=True, on_stop=on_stop)
    except (EstimatorError, UsageError, ControlPlaneError) as error:
        fail(f"heteroplane serve (loops process): {error}")
    finally:
        stopped.set()


if __name__ == "__main__":
    raise SystemExit(main())
