"""Slow and bloated connections against ``heteroplane serve``: what they cost the service, and
whether ``/healthz`` still answers promptly meanwhile.

    .venv/bin/python benchmarks/slow_connections.py [--connections 5000] [--duration-s 20]
        [--runs 3] [--reconnect-s 2] [--json] [--service-setting HETEROPLANE_X=V ...]

What runs, per run: a fresh ``heteroplane serve`` (default settings but for
``--service-setting``; the fake provisioner, no app) on a loopback port, and an attacker in a
process of its own (this script with ``--attack``) that keeps ``--connections`` connections
open against it for ``--duration-s``, a third of each kind:

- *slow*: a request line and a header, then one more header line every second, never the end;
- *bloated*: a head of 60,000 bytes (under the service's 64 KiB read limit, so it is held) sent
  at once, then one byte a second, never the end;
- *oversized*: a head that grows by 64 KiB a second without end (answered 431).

A connection the service closes (a 408, a 431, or pushed out by a newer one past
``http_unauthenticated_connections_max``) is opened again after ``--reconnect-s``. Meanwhile
this process opens a new connection every 20 ms and asks ``GET /healthz`` on it (as a load
balancer's probe does), timing the answer, and reads the service's resident memory
(``/proc/<pid>/status``) every 250 ms. The attacker runs at the lowest CPU priority (nice 19):
from another machine it would not take the service's CPUs, here it shares them.

Printed, per run and as the median over ``--runs`` with the spread (min-max):
``rss_growth_mb`` (the largest resident size during the attack less the size before it),
``healthz_p50_ms``, ``healthz_p99_ms``, ``healthz_failed`` (probes with no 200 within 5 s),
and the attacker's ``opened`` connections and ``closed_by_server``. Goals (issue 31): memory
growth < 100 MB and ``/healthz`` p99 < 50 ms with 5,000 connections, on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # imported as benchmarks.slow_connections
    from benchmarks.local_service import cpu_s, free_port, log, running_service, wait_ready
except ModuleNotFoundError:  # run as a script: the sibling module
    from local_service import cpu_s, free_port, log, running_service, wait_ready

PROBE_EVERY_S = 0.02
PROBE_TIMEOUT_S = 5.0
RSS_EVERY_S = 0.25
KINDS = ("slow", "bloated", "oversized")
BLOATED_HEAD_BYTES = 60_000
OVERSIZED_STEP_BYTES = 64 << 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reconnect-s", type=float, default=2.0)
    parser.add_argument("--json", action="store_true", help="the result as one JSON document")
    parser.add_argument("--service-setting", action="append", default=[], metavar="HETEROPLANE_X=V")
    parser.add_argument("--attack", nargs=2, metavar=("PORT", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _raise_open_files(2 * args.connections + 1024)
    if args.attack:
        port, result = int(args.attack[0]), Path(args.attack[1])
        stats = asyncio.run(attack(port, args.connections, args.duration_s, args.reconnect_s))
        result.write_text(json.dumps(stats))
        return 0
    settings = dict(item.split("=", 1) for item in args.service_setting)
    runs = [one_run(args, settings, k) for k in range(args.runs)]
    summary = {
        "connections": args.connections,
        "duration_s": args.duration_s,
        "runs": runs,
        "median": {
            key: statistics.median(r[key] for r in runs)
            for key in ("rss_growth_mb", "healthz_p50_ms", "healthz_p99_ms", "healthz_failed")
        },
        "spread": {
            key: [min(r[key] for r in runs), max(r[key] for r in runs)]
            for key in ("rss_growth_mb", "healthz_p99_ms")
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, run in enumerate(runs):
            print(f"run {k + 1}: " + ", ".join(f"{key} {value}" for key, value in run.items()))
        median, spread = summary["median"], summary["spread"]
        print(
            f"{args.connections} connections for {args.duration_s:g} s, median of {len(runs)}:"
            f" memory growth {median['rss_growth_mb']:.1f} MB"
            f" (spread {spread['rss_growth_mb'][0]:.1f}-{spread['rss_growth_mb'][1]:.1f}),"
            f" /healthz p99 {median['healthz_p99_ms']:.1f} ms"
            f" (spread {spread['healthz_p99_ms'][0]:.1f}-{spread['healthz_p99_ms'][1]:.1f}),"
            f" p50 {median['healthz_p50_ms']:.1f} ms, failed probes {median['healthz_failed']}"
        )
    return 0


def _raise_open_files(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def one_run(args: argparse.Namespace, settings: dict[str, str], index: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="slow-connections-") as folder:
        data_dir = Path(folder) / "data"
        data_dir.mkdir()
        port = free_port()
        settings = {"HETEROPLANE_PROVISIONER": "fake", **settings}
        with running_service(data_dir, port, model="none", settings=settings) as service:
            wait_ready(f"http://127.0.0.1:{port}", service, data_dir / "serve.log", 120.0)
            for _ in range(20):  # warm: the first answers import and cache
                probe(port)
            return measure(args, service.pid, port, Path(folder) / "attack.json", index)


def measure(
    args: argparse.Namespace, pid: int, port: int, result: Path, index: int
) -> dict[str, Any]:
    before = rss_mb(pid)
    cpu_before = cpu_s(pid)
    attacker = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--attack",
            str(port),
            str(result),
            "--connections",
            str(args.connections),
            "--duration-s",
            str(args.duration_s),
            "--reconnect-s",
            str(args.reconnect_s),
        ],
        # At the lowest priority: on loopback the attacker shares the CPUs it would not share
        # from another machine, and the figure is the service's, not the contention's.
        preexec_fn=lambda: os.nice(19),
    )
    log(f"run {index + 1}: {args.connections} connections for {args.duration_s:g} s")
    latencies: list[float] = []
    failed = 0
    peak = before
    next_rss = time.monotonic()
    while attacker.poll() is None:
        started = time.monotonic()
        answered = probe(port)
        if answered is None:
            failed += 1
        else:
            latencies.append(answered)
        if started >= next_rss:
            peak = max(peak, rss_mb(pid))
            next_rss = started + RSS_EVERY_S
        time.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - started)))
    cpu = cpu_s(pid) - cpu_before
    stats = json.loads(result.read_text()) if result.is_file() else {}
    latencies.sort()
    return {
        "rss_before_mb": round(before, 1),
        "rss_growth_mb": round(peak - before, 1),
        "healthz_p50_ms": round(1000 * latencies[len(latencies) // 2], 2) if latencies else None,
        "healthz_p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 2)
        if latencies
        else None,
        "healthz_probes": len(latencies) + failed,
        "healthz_failed": failed,
        "service_cpu_s": round(cpu, 2),
        **stats,
    }


def probe(port: int) -> float | None:
    """``GET /healthz`` on a new connection: seconds to the whole answer, None without a 200."""
    started = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError:
        return None
    if not answer.startswith(b"HTTP/1.1 200 "):
        return None
    return time.perf_counter() - started


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def attack(
    port: int, connections: int, duration_s: float, reconnect_s: float
) -> dict[str, int]:
    """Keep ``connections`` slow or bloated connections open until ``duration_s`` is over."""
    deadline = time.monotonic() + duration_s
    stats = {"opened": 0, "closed_by_server": 0, "connect_failed": 0}
    opening = asyncio.Semaphore(256)
    tasks = [
        asyncio.create_task(
            _hold(port, KINDS[k % len(KINDS)], deadline, reconnect_s, opening, stats)
        )
        for k in range(connections)
    ]
    await asyncio.gather(*tasks)
    return stats


async def _hold(
    port: int,
    kind: str,
    deadline: float,
    reconnect_s: float,
    opening: asyncio.Semaphore,
    stats: dict[str, int],
) -> None:
    while time.monotonic() < deadline:
        try:
            async with opening:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), timeout=5.0
                )
        except (OSError, TimeoutError):
            stats["connect_failed"] += 1
            await asyncio.sleep(reconnect_s)
            continue
        stats["opened"] += 1
        try:
            closed = await _drip(reader, writer, kind, deadline)
        except OSError:
            closed = True
        finally:
            writer.close()
        if closed:
            stats["closed_by_server"] += 1
            await asyncio.sleep(min(reconnect_s, max(0.0, deadline - time.monotonic())))


async def _drip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str, deadline: float
) -> bool:
    """Send ``kind``'s head piece by piece, a second apart, until the deadline (False) or the
    service closes the connection (True)."""
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if kind == "bloated":
        head += b"X-Bloat: " + b"b" * BLOATED_HEAD_BYTES
    writer.write(head)
    step = 0
    while time.monotonic() < deadline:
        try:
            data = await asyncio.wait_for(reader.read(65536), timeout=1.0)
        except TimeoutError:
            data = None
        if data == b"":
            return True
        if data is not None:
            continue  # an answer (408, 431): read on until the service closes
        step += 1
        if kind == "slow":
            writer.write(b"X-Slow-%d: x\r\n" % step)
        elif kind == "bloated":
            writer.write(b"b")
        else:
            writer.write(b"X-Over-%d: " % step + b"o" * OVERSIZED_STEP_BYTES + b"\r\n")
    return False


if __name__ == "__main__":
    sys.exit(main())
