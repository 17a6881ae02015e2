"""How much CPU ``heteroplane serve`` takes to start: the serving process and its loops process.

    .venv/bin/python benchmarks/serve_start.py [--json] [--runs N]

Each run starts ``heteroplane serve --no-grpc`` on a free port with a fresh data directory (the
embedded SQLite database, the local provisioner, no app), polls ``/healthz`` until it names the
loops process and its role under the leader lease, then reads the CPU time (user + system, from
``/proc/PID/stat``) of the serving process, of the loops process and, where the loops process was
forked from a zygote (docs/service.md, "How it starts: the zygote"), of the zygote; then stops
the service with SIGTERM. The median over ``--runs`` is reported with the smallest and largest
run. Linux only (``/proc``). Wall time on a shared machine says little; CPU is what the service's
start takes from the other processes of a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

try:  # imported as benchmarks.serve_start
    from benchmarks.local_service import cpu_s, free_port, parent_of, stop
except ModuleNotFoundError:  # run as a script: the sibling module
    from local_service import cpu_s, free_port, parent_of, stop

READY_TIMEOUT_S = 120.0


def one_start() -> dict[str, float]:
    """Start a service, wait for its loops process to hold a role, read the CPU times."""
    with tempfile.TemporaryDirectory(prefix="hp-serve-start-") as data:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "HETEROPLANE_DATA_DIR"}
        env["XDG_DATA_HOME"] = data
        server = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve", "--port", str(port), "--no-grpc"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            loops: dict[str, Any] | None = None
            while time.monotonic() < deadline:
                try:
                    found = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).json()
                    loops = found.get("loops")
                except (httpx.HTTPError, ValueError):
                    loops = None
                if loops is not None and loops.get("role") is not None:
                    break
                time.sleep(0.05)
            else:
                raise SystemExit("serve_start: the service did not start in time")
            child = int(loops["pid"])
            zygote = parent_of(child)
            return {
                "serving_cpu_s": cpu_s(server.pid),
                "loops_cpu_s": cpu_s(child),
                "zygote_cpu_s": cpu_s(zygote) if zygote != server.pid else 0.0,
            }
        finally:
            stop(server, deadline_s=60.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="starts measured (default 5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    one_start()  # untimed: bytecode caches written
    runs = []
    for i in range(args.runs):
        runs.append(one_start())
        print(f"run {i + 1}/{args.runs}: {runs[-1]}", file=sys.stderr, flush=True)
    summary = {
        key: {
            "median": statistics.median(r[key] for r in runs),
            "min": min(r[key] for r in runs),
            "max": max(r[key] for r in runs),
        }
        for key in runs[0]
    }
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary}))
    else:
        for key, figures in summary.items():
            print(
                f"{key}: {figures['median']:.2f} s median"
                f" ({figures['min']:.2f}-{figures['max']:.2f}) over {args.runs} starts"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
