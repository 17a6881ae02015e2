"""``heteroplane serve``'s log: one line a record, each with its time, level and logger."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging
from controlplane.cli.serve import configure_logging
configure_logging("info", process="loops")
logging.getLogger("alembic.runtime.migration").info(
    "Running upgrade  -> 0001, The tables: apps,\\nmetric samples, API tokens."
)
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("x").exception("the feed failed:\\r\\nFor more information check: a link")
"""


def test_a_message_of_several_lines_is_logged_on_one() -> None:
    """Alembic's revision titles and some libraries' error texts hold newlines: the line after
    one had no time, level or logger, and read as a record of its own. A traceback still
    follows its record on lines of its own."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, check=True
    )
    lines = done.stderr.splitlines()
    assert lines[0].endswith(
        " INFO [loops] alembic.runtime.migration: Running upgrade  -> 0001, The tables: apps,"
        " metric samples, API tokens."
    )
    assert lines[1].endswith(
        " ERROR [loops] x: the feed failed: For more information check: a link"
    )
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ZeroDivisionError: division by zero"
