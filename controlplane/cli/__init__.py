"""The ``heteroplane`` command line: one entry point, one module per command group.

Contract (DESIGN.md section 4): every command that computes prints a human summary, or one JSON
object on stdout with ``--json``; exit status 0 on success, 2 on bad input with a one-line reason on
stderr, never a traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from controlplane import __version__
from controlplane.cli import (
    bounds,
    capacity,
    cascade,
    db,
    demo,
    gears,
    loadgen,
    operate,
    plan,
    profile,
    replay,
    serve,
    simulate,
    token,
    trace,
)
from controlplane.cli.output import UsageError, fail
from controlplane.errors import ControlPlaneError
from estimator.errors import EstimatorError

# Each command module exposes ``register(subparsers)``; the parser it adds sets ``handler``.
COMMAND_MODULES = (
    demo,
    trace,
    simulate,
    capacity,
    bounds,
    plan,
    replay,
    loadgen,
    profile,
    cascade,
    gears,
    db,
    token,
    serve,
    operate,
)


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line error format (argparse already exits 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="heteroplane",
        description="Plan, simulate and serve ML inference on a mixed GPU/CPU fleet"
        " under a cost budget.",
    )
    parser.add_argument("--version", action="version", version=f"heteroplane {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args)
    except (EstimatorError, UsageError, ControlPlaneError) as error:
        fail(f"heteroplane {args.command}: {error}")
    except OSError as error:
        # A missing or unreadable file the user named: say which, without a traceback.
        name = f" {error.filename}" if error.filename else ""
        fail(f"heteroplane {args.command}: cannot read or write{name}: {error.strerror or error}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status
