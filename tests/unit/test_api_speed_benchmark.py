"""``benchmarks/serving_speed/api.py``'s helpers that need no service (the benchmark itself
starts one and is run by hand: how fast the API is, its business, is not checked here)."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.serving_speed import api


def test_descendants_finds_a_grandchild_and_nothing_of_another_tree() -> None:
    # A child that starts a grandchild and prints its pid; both wait on stdin until closed.
    script = (
        "import subprocess, sys\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
        " stdin=subprocess.PIPE)\n"
        "print(grandchild.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "grandchild.stdin.close()\n"
        "grandchild.wait()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        below = api.descendants(child.pid)
        assert grandchild in below
        assert child.pid not in below
        assert child.pid in api.descendants(os.getpid())
        assert os.getpid() not in api.descendants(child.pid)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert api.descendants(child.pid) == []  # gone: nothing below it
