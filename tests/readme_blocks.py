"""README.md's code blocks, as the README test runs them (tests/integration/test_demo.py).

The convention, which README.md follows:

- every fenced block is ```` ```sh ```` or ```` ```python ````, and runs as written, in the order
  of the README, from one working directory (what the README calls the checkout: its
  ``.venv/bin/heteroplane`` and ``.venv/bin/python`` are the test's interpreter there), against a
  running demo whose port and data directory the test chose through the documented settings
  (``HETEROPLANE_PORT``, ``XDG_DATA_HOME``), which the blocks read;
- a ``sh`` block runs in bash with ``set -euo pipefail``, the variables the blocks before it
  exported still set, and ``curl`` failing on an HTTP error (``--fail-with-body``); a ``python``
  block runs with ``.venv/bin/python``; each must exit 0 without a traceback;
- a block right after the line ``<!-- readme-test: skip (REASON) -->`` is not run, for REASON
  (``make demo``, which runs until Ctrl-C and which the test starts itself; a package install).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["README", "Block", "BlockRunner", "readme_blocks"]

README = Path(__file__).resolve().parents[1] / "README.md"
LANGUAGES = ("sh", "python")
_SKIP = re.compile(r"^<!-- readme-test: skip \((?P<reason>.+)\) -->$")
_FENCE = re.compile(r"^```(?P<language>[A-Za-z0-9_+-]*)\s*$")
# Exported variables are carried from one sh block to the next through this file.
_STATE = ".readme-test-env"
_PRELUDE = """set -euo pipefail
curl() { command curl --fail-with-body "$@"; }
"""


@dataclass(frozen=True, slots=True)
class Block:
    """A fenced block of the README: its language, code, the line of its opening fence, the
    section (``## ...``) it is in, and why it is skipped (None: it runs)."""

    language: str
    code: str
    line: int
    section: str
    skip: str | None

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.section}, {self.language})"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, in order."""
    blocks: list[Block] = []
    lines = text.splitlines()
    section = ""
    previous = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            if line.strip():
                previous = line.strip()
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"README.md:{i + 1}: a code block that is never closed")
        skip = _SKIP.match(previous)
        code = "\n".join(lines[start:end]) + "\n"
        blocks.append(
            Block(fence["language"], code, i + 1, section, skip["reason"] if skip else None)
        )
        previous = ""
        i = end + 1
    return blocks


class BlockRunner:
    """Runs blocks from ``workdir`` with ``env``: there ``.venv/bin/heteroplane`` and
    ``.venv/bin/python`` are this interpreter (so the README's paths hold wherever the test runs,
    and what the blocks write stays in ``workdir``)."""

    def __init__(self, workdir: Path, env: dict[str, str], timeout_s: float) -> None:
        self.workdir = workdir
        self.env = env
        self.timeout_s = timeout_s
        bin_dir = workdir / ".venv" / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        python = shlex.quote(sys.executable)
        for name, command in (("python", python), ("heteroplane", f"{python} -m controlplane")):
            shim = bin_dir / name
            shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
            shim.chmod(0o755)

    def run(self, block: Block, number: int) -> subprocess.CompletedProcess[str]:
        """Run ``block`` (the ``number``-th run); its process, whatever its exit status."""
        if block.language == "python":
            script = self.workdir / f"readme-block-{number}.py"
            script.write_text(block.code)
            command = [str(self.workdir / ".venv" / "bin" / "python"), script.name]
        elif block.language == "sh":
            state = self.workdir / _STATE
            carried = f". {shlex.quote(str(state))}\n" if state.exists() else ""
            saved = f"\nexport -p > {shlex.quote(str(state))}\n"
            command = ["bash", "-c", _PRELUDE + carried + block.code + saved]
        else:
            raise ValueError(f"{block}: only sh and python blocks run")
        return subprocess.run(
            command,
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
        )
