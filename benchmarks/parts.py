"""One command per question: a package of benchmarks/ whose parts answer one question runs as
``python -m benchmarks.<package> PART [options]``; :func:`run_part` is its ``__main__``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence

__all__ = ["run_part"]


def run_part(
    package: str, doc: str, parts: Mapping[str, str], argv: Sequence[str] | None = None
) -> int:
    """Run ``parts[PART]``'s ``main`` (a module of ``package``) on the rest of ``argv``; without
    a known part, print ``doc`` (the package's docstring: the question, its parts) and exit 2
    (0 for ``--help``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in parts:
        asked_help = bool(args) and args[0] in ("-h", "--help")
        print(doc.strip(), file=sys.stdout if asked_help else sys.stderr)
        if args and not asked_help:
            print(f"\nunknown part {args[0]!r}; one of: {', '.join(parts)}", file=sys.stderr)
        return 0 if asked_help else 2
    module = importlib.import_module(f"{package}.{parts[args[0]]}")
    status: int = module.main(args[1:])
    return status
