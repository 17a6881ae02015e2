"""``heteroplane serve``: run the control-plane service (the REST API and the periodic jobs).

It loads the settings (``--config``, ``HETEROPLANE_*``; docs/service.md), refuses an in-memory
SQLite database (:func:`~controlplane.service.build.check_served_database`), migrates the database
to the newest revision, and serves the API with uvicorn on ``--host``/``--port`` (default: the
settings', 127.0.0.1:8000), and the Open Inference Protocol over gRPC on the same host,
``--grpc-port`` (default: the setting ``grpc_port``, 8001; ``--no-grpc`` or ``grpc_enabled:
false``: none; :mod:`controlplane.api.grpc_oip`). The listening socket is bound here before
uvicorn starts, and the gRPC port tried, so an address in use is a one-line error and exit
status 2. SIGINT and SIGTERM stop it cleanly: uvicorn finishes the requests in flight, the gRPC
server its calls in flight, the scheduler waits for its running jobs, and the database
connections are closed.

By default (``--role all``) the service runs as two processes (docs/service.md, "Serving apart
from the loops"): this one serves the API and inference with no periodic job, and starts and
supervises a loops process beside it (:class:`~controlplane.cli.loops_process.LoopsProcess`),
stopped with the signal that stops this one. ``--one-process`` runs everything here instead
(for debugging). ``--role serving`` or ``--role loops`` runs one half alone
(:data:`controlplane.service.build.ServiceRole`); a loops process serves no inference, so no
gRPC either. ``heteroplane demo`` serves through the same :func:`listen`, :func:`grpc_address`,
:func:`build_served` and :func:`serve_until_stopped`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import uvicorn

from controlplane.api.grpc_oip import attach as attach_grpc
from controlplane.cli.loops_process import LoopsProcess
from controlplane.cli.output import UsageError
from controlplane.dashboard.session import load_session_settings
from controlplane.db.session import redact_url
from controlplane.service.build import Service, build_service, check_served_database
from controlplane.service.protocol import ConnectionLimits, server_options
from controlplane.settings import Settings, load_settings

__all__ = [
    "SERVE_LOGGER",
    "build_served",
    "client_url",
    "configure_logging",
    "grpc_address",
    "listen",
    "run",
    "serve_until_stopped",
]

# Where serving is logged ("stopped by SIGTERM"); the demo keeps it at info.
SERVE_LOGGER = "controlplane.serve"
# The interpreter's thread switch interval while serving, s (its default is 0.005).
SWITCH_INTERVAL_S = 0.001
_log = logging.getLogger(SERVE_LOGGER)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet) for uvicorn; an address in use, or one
    that is not an address, is a :class:`UsageError` (one line, exit status 2)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says it is
    # TCP, and without it every kept-alive answer (head and body in two writes) waited up to
    # 40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    except (OverflowError, UnicodeError) as error:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {error}") from None
    sock.set_inheritable(True)
    return sock


def grpc_address(
    settings: Settings, host: str, port: int | None = None, enabled: bool = True
) -> tuple[str, int] | None:
    """Where the Open Inference Protocol over gRPC is served: ``host`` and ``port`` (default:
    the setting ``grpc_port``; 0 picks a free one), None when it is off (``enabled`` false or
    the setting ``grpc_enabled``). The port is tried now: a port asked for (``port``, or the
    setting given) in use is the same one-line :class:`UsageError` as the API's; the default
    port in use (another service on the host has it) is a warning, and REST is served alone."""
    if not (enabled and settings.grpc_enabled):
        return None
    asked = port is not None or "grpc_port" in settings.model_fields_set
    port = settings.grpc_port if port is None else port
    if port:
        try:
            listen(host, port).close()
        except UsageError as error:
            if asked:
                raise
            _log.warning("%s: no gRPC served (set grpc_port or --grpc-port)", error)
            return None
    return host, port


def client_url(sock: socket.socket) -> str:
    """The URL a client on this machine uses for the service bound to ``sock``."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _OneLine(logging.Formatter):
    """A record's message on its one line: a newline in it (Alembic's revision titles, a
    library's error text) started a line without time, level or logger, which a reader of the
    log or a line-based collector takes for another record. A traceback still follows on the
    lines after it."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return " ".join(super().formatMessage(record).splitlines())


def configure_logging(log_level: str, process: str | None = None) -> None:
    """Log records at ``log_level`` and above to stderr, one line each (``process``, when
    given, in brackets on each line: the loops process beside a serving process)."""
    level = getattr(logging, log_level.upper())
    tag = f" [{process}]" if process else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(f"%(asctime)s %(levelname)s{tag} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    # APScheduler logs every run at info: only its warnings (a skipped run) unless debugging.
    logging.getLogger("apscheduler").setLevel(max(level, logging.WARNING))
    # httpx logs every request at info: the loops' feed exchange ten times a second.
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))


def run(args: argparse.Namespace) -> int:
    if args.one_process and args.role != "all":
        raise UsageError(f"--one-process: only with --role all (not {args.role}): it runs both")
    settings = load_settings(args.config)
    check_served_database(settings)  # before a socket or the loops' zygote; build_service too
    load_session_settings()  # the dashboard's: a bad one is refused before anything starts
    host: str = args.host if args.host is not None else settings.host
    port: int = args.port if args.port is not None else settings.port
    configure_logging(args.log_level)
    sock = listen(host, port)
    loops: LoopsProcess | None = None
    try:
        # A loops process serves no inference: no gRPC either.
        serves = not args.no_grpc and args.role != "loops"
        grpc = grpc_address(settings, host, args.grpc_port, serves)
        if grpc is not None and grpc[1] == sock.getsockname()[1]:
            # Bound beside the API's own socket, gRPC's listener failed later, in the running
            # service, which went on with REST alone.
            raise UsageError(
                f"gRPC's port {grpc[1]} (--grpc-port, or the setting grpc_port) is the API's"
                " port: give gRPC another one (0 picks a free one) or --no-grpc"
            )
        if args.role == "all":
            service, loops = build_served(
                settings, sock, args.config, args.log_level, args.one_process
            )
        else:
            service = build_service(settings, role=args.role, url=client_url(sock))
    except BaseException:
        sock.close()
        raise
    bound_host, bound_port = sock.getsockname()[:2]
    _log.info(
        "heteroplane serving on http://%s:%d (database %s, provisioner %s, role %s%s)",
        bound_host,
        bound_port,
        redact_url(settings.database_url),
        settings.provisioner,
        args.role,
        ", one process" if loops is None and args.role == "all" else "",
    )
    return serve_until_stopped(service, sock, args.log_level, grpc, loops)


def build_served(
    settings: Settings,
    sock: socket.socket,
    config: Path | None,
    log_level: str,
    one_process: bool = False,
) -> tuple[Service, LoopsProcess | None]:
    """The whole service on ``sock``: a serving process whose loops run in a child it will
    supervise (:class:`LoopsProcess`, started by :func:`serve_until_stopped`; the child reads
    this process's settings from ``config`` and the environment), or with ``one_process``
    everything in this process (no child)."""
    url = client_url(sock)
    if one_process:
        return build_service(settings, url=url), None
    loops = LoopsProcess(url, config, log_level)
    try:
        # This process's internal routes take the secret the child is given.
        served = settings.model_copy(update={"internal_token": loops.token})
        # A replica of the service: other serving processes on PostgreSQL are not refused.
        return build_service(served, role="serving", sole_serving=False, url=url), loops
    except BaseException:
        loops.stop()
        raise


def serve_until_stopped(
    service: Service,
    sock: socket.socket,
    log_level: str,
    grpc: tuple[str, int] | None = None,
    loops: LoopsProcess | None = None,
    *,
    supervised: bool = False,
    on_stop: Callable[[], None] | None = None,
) -> int:
    """Serve ``service`` on ``sock`` until SIGINT or SIGTERM (and the Open Inference Protocol
    over gRPC on ``grpc``, host and port, when given), then close the service and the socket.
    With ``loops``, its child is started once ``sock`` listens and stopped with the signal that
    stopped this process before the service closes. ``supervised`` (the loops child): a second
    signal while it stops does not force the exit (uvicorn's rule for a second Ctrl-C), since
    its parent sends one as it stops too, and forcing cut the lifespan with a traceback; the
    parent kills it if it does not stop in time. ``on_stop`` is called once, at the first stop
    signal. Exit status 0 after a clean stop, 1 when the server could not start."""
    if loops is not None:
        # /healthz says the child (controlplane.api.routes.health).
        service.app.state.loops_process = loops
    if grpc is not None:
        attach_grpc(service.app, *grpc, service.settings.oip_body_max_bytes)
    config = uvicorn.Config(
        service.app,
        log_level=log_level,
        lifespan="on",
        # The process is the service's only server: no access log on every poll by default.
        access_log=log_level == "debug",
        # httptools (h11 without it) on asyncio, with the settings' bounds on heads, bodies and
        # unauthenticated connections (an oversized head is a 431, not a connection reset).
        **server_options(
            ConnectionLimits.from_settings(service.settings),
            front=service.app.state.services.front_door,
        ),
    )
    server = _Server(config, loops, supervised=supervised, on_stop=on_stop)
    # The event loop answers queries; threads (the thread pool's sync routes and dependencies,
    # the database's) hold the interpreter in turns of sys.getswitchinterval(), 5 ms by
    # default, which a query queued behind one waits out whole. 1 ms turns bound that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    stopped_by: list[int] = []
    with _stop_quietly(stopped_by):
        try:
            if loops is not None:
                # Listening first: the child's first feed exchange waits in the backlog until
                # uvicorn accepts, rather than being refused.
                sock.listen(2048)
                loops.start()
            server.run(sockets=[sock])
        finally:
            if loops is not None:
                loops.stop(stopped_by[0] if stopped_by else signal.SIGTERM)
            service.close()
            sock.close()
    if not server.started:
        return 1
    if stopped_by:
        _log.info("stopped by %s", signal.Signals(stopped_by[0]).name)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server that, given the loops child, signals it as soon as a signal stops the
    server: the child finishes its running jobs while this process drains its requests, rather
    than after (a stop took the two one after the other, up to STOP_WAIT_S for the child)."""

    def __init__(
        self,
        config: uvicorn.Config,
        loops: LoopsProcess | None,
        *,
        supervised: bool = False,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._loops = loops
        self._supervised = supervised
        self._on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._supervised and self.should_exit:
            return  # stopping already: the parent's own signal, or the group's (docstring)
        if self._on_stop is not None and not self.should_exit:
            self._on_stop()
        super().handle_exit(sig, frame)
        if self._loops is not None:
            self._loops.begin_stop(sig)


@contextmanager
def _stop_quietly(stopped_by: list[int]) -> Iterator[None]:
    """While uvicorn serves, SIGINT and SIGTERM are its cue for a graceful shutdown; afterwards
    it raises the signal again for the handler it found. That handler is this one, which only
    notes the signal, so the process goes on to close the database and exit with status 0."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread; nothing to do
        return

    def note(signum: int, _frame: FrameType | None) -> None:
        stopped_by.append(signum)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
