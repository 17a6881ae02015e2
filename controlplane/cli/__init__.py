"""The ``heteroplane`` command line: one entry point, one module per command group.

Contract (DESIGN.md section 4): every command that computes prints a human summary, or one JSON
object on stdout with ``--json``; exit status 0 on success, 2 on bad input with a one-line reason on
stderr, never a traceback for a user's mistake.

Start-up is kept short (docs/cli.md): building the parser imports only
:mod:`controlplane.cli.parsers` and what it needs, no numpy, SQLAlchemy, FastAPI or torch; the
module that implements a command is imported when that command runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from controlplane import __version__
from controlplane.cli.output import UsageError, fail
from controlplane.cli.parsers import Parser, register_commands
from controlplane.errors import ControlPlaneError
from estimator.errors import EstimatorError

# 128 + SIGPIPE: what a shell reports for a writer whose reader left.
EXIT_BROKEN_PIPE = 141
# 128 + SIGTERM: a command stopped by SIGTERM (timeout, systemd, docker) after its clean-up.
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so that what a command
    started (profiling workers, a demo's preparation) is stopped by the same ``finally`` blocks
    rather than left running when the process dies outright. ``serve`` hands SIGTERM to uvicorn
    while it serves (its graceful stop)."""


def _terminate(_signum: int, _frame: object) -> None:
    raise Terminated


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="heteroplane",
        description="Plan, simulate and serve ML inference on a mixed GPU/CPU fleet"
        " under a cost budget.",
    )
    parser.add_argument("--version", action="version", version=f"heteroplane {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    subparsers.required = True
    register_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _run(args)  # signals reach the main thread alone
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args)
    finally:  # a caller's own handler back (main() is also called in process, by tests)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _run(args: argparse.Namespace) -> int:
    try:
        status: int = args.handler(args)
        sys.stdout.flush()  # a reader that left (`| head`) is found here, not at exit
    except BrokenPipeError:
        return _reader_left()
    except (EstimatorError, UsageError, ControlPlaneError) as error:
        fail(f"heteroplane {args.command}: {error}")
    except OSError as error:
        # A missing or unreadable file the user named: say which, without a traceback.
        name = f" {error.filename}" if error.filename else ""
        why = error.strerror or str(error)
        if isinstance(error, FileExistsError | NotADirectoryError):
            # A folder was wanted where a file is ("File exists" said nothing of that).
            why = f"{why} (a file where a folder is wanted)"
        fail(f"heteroplane {args.command}: cannot read or write{name}: {why}")
    except Terminated:
        print("terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status


def _reader_left() -> int:
    """stdout's reader closed the pipe (``heteroplane events | head``): stop quietly, with the
    status of a process that SIGPIPE ended (as ``seq 1000000 | head`` does). stdout points at
    /dev/null from here on, so that the interpreter's last flush at exit finds nothing to say."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE
