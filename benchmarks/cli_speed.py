"""How fast the command line starts: CPU time of ``heteroplane`` up to its first answer.

    .venv/bin/python benchmarks/cli_speed.py [--json] [--runs N]

Three commands, each run as a subprocess of this script (the installed ``heteroplane`` beside the
interpreter, else ``python -m controlplane``):

- ``heteroplane --help``: the parser of every command, nothing else;
- ``heteroplane plans --help``: one command group's parser;
- ``heteroplane fleet --url http://127.0.0.1:PORT --token x`` against a port that is bound but not
  listening, so the connection is refused at once and the command exits with status 2: start-up,
  the HTTP client's import and one failed request, without any server time in the figure.

Measured: the CPU time (user + system) of the child, from ``resource.getrusage(RUSAGE_CHILDREN)``
before and after each run (the interpreter's own start-up included; wall time on a shared machine
says little). Each command runs once untimed (the bytecode caches are written), then ``--runs``
times; the median is reported with the smallest and largest run, and the goal is met when every
median is under it.

Goal (issue "a fast command line"): each of them under 0.3 s of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

try:  # imported as benchmarks.cli_speed
    from benchmarks.paths import ROOT
except ModuleNotFoundError:  # run as a script: the sibling module
    from paths import ROOT

GOAL_CPU_S = 0.3
DEFAULT_RUNS = 5


def heteroplane() -> list[str]:
    """The command that starts the CLI: the console script installed beside this interpreter."""
    script = Path(sys.executable).with_name("heteroplane")
    return [str(script)] if script.exists() else [sys.executable, "-m", "controlplane"]


def child_cpu_s(argv: Sequence[str], expect_status: int) -> float:
    """CPU seconds (user + system) that one run of ``argv`` took; its exit status is checked."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != expect_status:
        raise RuntimeError(
            f"{' '.join(argv)} exited with {done.returncode}, not {expect_status}:"
            f" {done.stderr.strip()[-500:]}"
        )
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


COMMANDS = {
    "help": "heteroplane --help",
    "group_help": "heteroplane plans --help",
    "client": "heteroplane fleet (nothing listening)",
}


def measure(runs: int = DEFAULT_RUNS) -> dict[str, tuple[float, float, float]]:
    """For each of :data:`COMMANDS`: the median, smallest and largest CPU seconds of ``runs``
    runs, after one untimed run."""
    base = heteroplane()
    # Bound, never listening: a connection to it is refused at once (no server, no race).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        argvs = {
            "help": ([*base, "--help"], 0),
            "group_help": ([*base, "plans", "--help"], 0),
            "client": ([*base, "fleet", "--url", url, "--token", "x"], 2),
        }
        figures = {}
        for key, (argv, status) in argvs.items():
            child_cpu_s(argv, status)
            samples = [child_cpu_s(argv, status) for _ in range(runs)]
            figures[key] = (statistics.median(samples), min(samples), max(samples))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--runs", type=int, default=DEFAULT_RUNS, help=f"timed runs each (default {DEFAULT_RUNS})"
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    figures = measure(args.runs)
    met = all(median < GOAL_CPU_S for median, _, _ in figures.values())
    if args.json:
        document: dict[str, object] = {}
        for key, (median, low, high) in figures.items():
            document[f"{key}_cpu_s"] = median
            document[f"{key}_cpu_s_spread"] = [low, high]
        document |= {"goal_cpu_s": GOAL_CPU_S, "goal_met": met, "runs": args.runs}
        print(json.dumps(document))
        return 0
    print(
        f"heteroplane start-up, CPU time (user + system) of the process: median of {args.runs}"
        f" runs [min-max], {os.cpu_count()} cores; goal < {GOAL_CPU_S:g} s each"
    )
    for key, (median, low, high) in figures.items():
        verdict = "met" if median < GOAL_CPU_S else "NOT met"
        print(f"  {COMMANDS[key]:<38} {median:6.3f} s [{low:.3f}-{high:.3f}]  {verdict}")
    print(f"goal {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
