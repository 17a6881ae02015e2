"""The tests' ``heteroplane serve`` processes, forked from a process that has imported the service.

A ``python -m controlplane serve`` spends most of its start importing the service (FastAPI,
SQLAlchemy, Alembic, uvicorn, gRPC, numba, the planner: 1.5-2.5 s of a core before it does
anything), and the integration tests start dozens. :func:`popen` starts such a command as a child
of a *fork server*: ``python -m tests.serve_forks``, started once per test process, which imports
what a ``serve`` imports and then forks one child per request, already imported, as the service's
own zygote forks its loops process (controlplane/cli/loops_process.py). The child is a real
``heteroplane serve`` from there on: it runs ``python -m controlplane`` (:mod:`runpy`) with the
request's arguments, environment, working directory and standard streams, in the test process's
process group, with Python's default signal handlers, fresh random seeds and no other
descriptor, and exits as that command exits (atexit handlers, flushed streams, its threads
joined). Only the imports and ``/proc/PID/cmdline`` (the fork server's) differ from a
:class:`subprocess.Popen` of the same command; the command itself as a user runs it is tested
by the demo's tests (tests/integration/test_demo.py) and ``tests/unit/test_cli_startup.py``.

:func:`popen` returns a :class:`Forked`, which answers what the tests ask of a
:class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
``kill``, ``returncode``): the fork server reports each child's pid and, once it has reaped it,
its exit status over a socket of that child's own. A child dies with its fork server (Linux's
parent death signal), which exits, ending its children, when its test process's end closes. A
command that is not ``[sys.executable, "-m", "controlplane", "serve", ...]``, or one the fork
server cannot take (it does not start, or is gone), gets a :class:`subprocess.Popen` as before;
a fork server that takes a request and does not answer it within :data:`_ANSWER_S` is an error
(a Popen then could run the command twice).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

_MESSAGE_MAX = 1 << 20
_PR_SET_PDEATHSIG = 1
_ANSWER_S = 30.0
REPO = Path(__file__).resolve().parents[1]


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether ``sock`` has a message or its end (poll(2): any descriptor number)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def _wait_gone(pid: int, deadline_s: float = 5.0) -> None:
    deadline = time.monotonic() + deadline_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class Forked:
    """A ``serve`` process forked by the fork server: a :class:`subprocess.Popen`'s answers."""

    def __init__(self, args: Sequence[str], pid: int, conn: socket.socket) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def _read(self, timeout: float | None) -> None:
        """The exit status, when it comes within ``timeout`` (None: however long)."""
        if self.returncode is not None:
            return
        if not _readable(self._conn, timeout):
            return
        try:
            message = self._conn.recv(_MESSAGE_MAX)
        except OSError:
            message = b""
        if not message:
            # The fork server gone without a word: the child, which dies with it (its parent
            # death signal), is ended by SIGKILL; its pid is gone once the kernel has reaped it.
            _wait_gone(self.pid)
        self.returncode = int(json.loads(message)["code"]) if message else -signal.SIGKILL
        self._conn.close()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkServer:
    """The test process's end of its fork server."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.serve_forks", str(theirs.fileno())],
            cwd=REPO,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self._conn = ours

    def alive(self) -> bool:
        return self._process.poll() is None

    def spawn(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | str,
        streams: tuple[int, int, int],
    ) -> Forked:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            request = {"argv": list(args[3:]), "env": dict(env), "cwd": str(cwd)}
            socket.send_fds(self._conn, [json.dumps(request).encode()], [theirs.fileno(), *streams])
        finally:
            theirs.close()
        if not _readable(ours, _ANSWER_S):
            # Not started as a Popen instead: the fork server may still fork it.
            ours.close()
            raise RuntimeError(f"the tests' fork server did not answer in {_ANSWER_S:g} s")
        try:
            message = ours.recv(_MESSAGE_MAX)
        except OSError:
            message = b""
        if not message:  # it closed the request unanswered: nothing runs for it
            ours.close()
            raise OSError("the fork server did not start the process")
        return Forked(args, int(json.loads(message)["started"]), ours)


_SERVER: list[_ForkServer] = []


def _fork_server() -> _ForkServer:
    if not _SERVER or not _SERVER[0].alive():
        _SERVER[:] = [_ForkServer()]
    return _SERVER[0]


def _fd(stream: IO[Any] | int | None, default: int) -> int | None:
    """The descriptor of ``stream`` as Popen takes it; None for a pipe or DEVNULL (not forked)."""
    if stream is None:
        return default
    if isinstance(stream, int):
        return stream if stream >= 0 else None
    return stream.fileno()


def popen(
    args: Sequence[str],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
) -> Forked | subprocess.Popen[bytes]:
    """``args`` started as :class:`subprocess.Popen` starts them (``stderr`` may be
    :data:`subprocess.STDOUT`), forked from the fork server when they are a ``python -m
    controlplane serve`` whose streams are files or inherited."""
    out = _fd(stdout, 1)
    err = out if stderr == subprocess.STDOUT else _fd(stderr, 2)
    if list(args[:4]) == [sys.executable, "-m", "controlplane", "serve"] and None not in (out, err):
        try:
            return _fork_server().spawn(
                args, os.environ if env is None else env, cwd or Path.cwd(), (0, out, err)
            )
        except OSError:
            pass  # started as before
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr)


# The fork server itself.


def _serve_requests(conn: socket.socket) -> dict[str, Any]:
    """Fork a child for each request over ``conn`` and report its pid and exit status to the
    request's own socket; return, in a child, its request (its streams in place). When the test
    process's end closes, end the children still running and exit."""
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, reply socket)
    events = selectors.DefaultSelector()  # epoll: any descriptor number
    events.register(conn, selectors.EVENT_READ)
    while True:
        ready = {key.fd for key, _ in events.select()}
        for pidfd in [fd for fd in ready if fd in children]:
            pid, reply = children.pop(pidfd)
            events.unregister(pidfd)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            os.close(pidfd)
            with contextlib.suppress(OSError):  # the test no longer listens
                reply.send(json.dumps({"code": code}).encode())
            reply.close()
        if conn.fileno() not in ready:
            continue
        try:
            message, fds, _flags, _address = socket.recv_fds(conn, _MESSAGE_MAX, 4)
        except OSError:
            message, fds = b"", []
        if not message:  # the test process is gone
            for pid, _reply in children.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise SystemExit(0)
        reply = socket.socket(fileno=fds[0])
        streams = fds[1:]
        if _readable(reply, 0.0):  # the test process closed it (gone): nothing to start
            reply.close()
            for fd in streams:
                os.close(fd)
            continue
        request: dict[str, Any] = json.loads(message)
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            events.close()
            conn.close()
            reply.close()
            for pidfd, (_pid, other) in children.items():
                os.close(pidfd)
                other.close()
            for target, fd in enumerate(streams):
                os.dup2(fd, target)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            _die_with(server)
            return request
        for fd in streams:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
            reply.send(json.dumps({"started": pid}).encode())
        except OSError:  # no pidfd, or the test process gone: the child is no one's
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            reply.close()
            continue
        children[pidfd] = (pid, reply)
        events.register(pidfd, selectors.EVENT_READ)


def _die_with(parent: int) -> None:
    """SIGKILL this process when the fork server ``parent`` dies (Linux's parent death signal),
    so that no serve outlives a fork server that can no longer report or end it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def _main(fd: int) -> None:
    import random

    import numpy

    # What a `serve` imports before it serves (its command's module imports the service).
    import controlplane.cli
    import controlplane.cli.serve  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C ends the tests, which end this
    request = _serve_requests(socket.socket(fileno=fd))
    # A child: a fresh process's state, then the command.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    random.seed()
    numpy.random.seed()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import runpy

    sys.argv = ["controlplane", *request["argv"]]
    runpy.run_module("controlplane", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
