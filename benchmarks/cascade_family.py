"""Cascades of the demo model family against its models alone (docs/cascade-family.md).

    .venv/bin/python benchmarks/cascade_family.py [--samples N] [--threads N] [--cache-dir DIR]
        [--out FILE] [--json]

Runs ``heteroplane cascade evaluate --json`` (trains the family on first use; measures each
model's compute per query here as its mean latency at batch size 1 over N timed runs) and prints
the table: each model alone, then the chosen cascades (the best: the cheapest within 0.5 points of
the most accurate single model; the cheapest at least as accurate as it; the most accurate one)
with accuracy, compute per query and the share of queries reaching each stage. Checks the cascades'
acceptance point: the best cascade matches the accuracy of the most accurate single model within
0.5 points while spending at least 2x less measured compute per query (exit status 1 if not).
Writes the table and the command to docs/cascade-family.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_RATIO = 2.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def evaluate(samples: int, threads: int, cache_dir: str | None) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "controlplane",
        "cascade",
        "evaluate",
        "--json",
        "--samples",
        str(samples),
        "--warmup",
        str(max(50, samples // 10)),
        "--threads",
        str(threads),
    ]
    if cache_dir is not None:
        command += ["--cache-dir", cache_dir]
    log("running: heteroplane " + " ".join(command[3:]))
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise SystemExit(done.returncode)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def chosen(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The cascades the table shows, each with why it was chosen (no cascade twice)."""
    top = next(m for m in result["models"] if m["name"] == result["most_accurate_model"])
    front = [c for c in result["cascades"] if len(c["models"]) > 1]
    picks: list[tuple[str, dict[str, Any]]] = []
    if result["best"] is not None:
        picks.append(("best: cheapest within 0.5 points of the best model", result["best"]))
    at_least = [c for c in front if c["accuracy"] >= top["accuracy"]]
    if at_least:
        picks.append((f"cheapest at least as accurate as {top['name']}", at_least[0]))
    if front:
        picks.append(("most accurate", front[-1]))
    seen: set[str] = set()
    unique = []
    for why, cascade in picks:
        if cascade["label"] not in seen:
            seen.add(cascade["label"])
            unique.append((why, cascade))
    return unique


def table(result: dict[str, Any]) -> str:
    top = next(m for m in result["models"] if m["name"] == result["most_accurate_model"])
    rows = [
        "| | accuracy | compute, ms/query | vs " + top["name"] + " | share reaching each stage |",
        "|---|---:|---:|---:|---|",
    ]
    for model in result["models"]:
        rows.append(
            f"| {model['name']} alone | {model['accuracy'] * 100:.2f}% |"
            f" {model['compute_ms_per_query']:.4f} |"
            f" {_versus(top, model)} | 1 |"
        )
    for why, cascade in chosen(result):
        reach = ", ".join(f"{r:.3f}" for r in cascade["reach_share"])
        rows.append(
            f"| `{cascade['label']}` ({why}) | {cascade['accuracy'] * 100:.2f}% |"
            f" {cascade['compute_ms_per_query']:.4f} |"
            f" {_versus(top, cascade)} |"
            f" {reach} |"
        )
    return "\n".join(rows)


def _versus(top: dict[str, Any], row: dict[str, Any]) -> str:
    if row is top:
        return "-"
    return f"{top['compute_ms_per_query'] / row['compute_ms_per_query']:.1f}x less"


def verdict(result: dict[str, Any]) -> tuple[bool, str]:
    top = next(m for m in result["models"] if m["name"] == result["most_accurate_model"])
    best = result["best"]
    if best is None:
        return False, "no cascade within 0.5 points of the most accurate model"
    gap_points = (top["accuracy"] - best["accuracy"]) * 100
    ratio = top["compute_ms_per_query"] / best["compute_ms_per_query"]
    holds = gap_points <= 0.5 + 1e-9 and ratio >= REQUIRED_RATIO
    return holds, (
        f"{'HOLDS' if holds else 'DOES NOT HOLD'}: the best cascade `{best['label']}` is"
        f" {gap_points:.2f} points below {top['name']} alone ({best['accuracy'] * 100:.2f}% vs"
        f" {top['accuracy'] * 100:.2f}%) at {ratio:.1f}x less measured compute per query"
        f" (needs <= 0.5 points and >= {REQUIRED_RATIO:g}x)"
    )


def cpu_model() -> str:
    """The CPU's model name where Linux says it, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(result: dict[str, Any], command: str, seconds: float) -> str:
    _, line = verdict(result)
    front = "\n".join(
        f"| `{c['label']}` | {c['accuracy'] * 100:.2f}% | {c['compute_ms_per_query']:.4f} |"
        f" {', '.join(f'{r:.3f}' for r in c['reach_share'])} |"
        for c in result["cascades"]
    )
    thresholds = ", ".join(f"{h:g}" for h in result["thresholds"])
    return f"""# Cascades of the demo model family

Written by `{command}`; do not edit by hand, run the command again.

- Run: {time.strftime("%Y-%m-%d")}, {seconds:.0f} s, on {cpu_model()} ({platform.machine()}),
  Python {platform.python_version()}.
- Family: `provisioners/worker/family.py` (docs/cascades.md), four classifiers of sklearn's
  handwritten digits trained at first use with a fixed seed; {result["validation_samples"]}
  validation samples.
- Compute per query: the mean latency at batch size 1, {result["compute_source"]}.
  This is the models' bare forward pass, timed in process (`heteroplane profile measure
  --compute-only` measures the same): not what serving a query costs. An emulated worker pads each
  batch to the compute of a real model of these sizes, C_m(b) / f, tens of ms
  (docs/catalog.md, "Emulated types"), and a caller also pays the request's parsing, the JSON and
  the HTTP round trip; `heteroplane profile measure` times that end to end through a worker of each
  type, and the planner, the tuner and the demo read those profiles, never the numbers below. The
  demo picks its cascade by the same rule, on each model's end-to-end latency at batch size 1 on
  `emu.cpu.large` (`controlplane/service/demo.py`).
- A cascade answers a query at the first model whose certainty (top-1 minus top-2 softmax score)
  reaches that stage's threshold: in `tiny@0.5 -> large` tiny answers when its certainty is
  >= 0.5 and large answers the rest. Its compute per query is the sum over stages of the share
  of queries reaching the stage times that model's compute.

**Goal: {line}.**

{table(result)}

## The Pareto set

Every chain of up to {result["max_stages"]} models, cheapest first, with every combination of the
thresholds {thresholds}: the cascades that no other beats on both accuracy and compute, cheapest
first.

| cascade | accuracy | compute, ms/query | share reaching each stage |
|---|---:|---:|---|
{front}

Measured compute moves from run to run and machine to machine (other processes, CPU frequency);
accuracies and reach shares do not: they come from the validation records alone.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000, help="timed runs per model")
    parser.add_argument("--threads", type=int, default=1, help="numpy threads while timing")
    parser.add_argument("--cache-dir", help="the family's model cache (default: the user's)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "cascade-family.md")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    start = time.perf_counter()
    result = evaluate(args.samples, args.threads, args.cache_dir)
    seconds = time.perf_counter() - start
    command = f"python benchmarks/cascade_family.py --samples {args.samples}"
    if args.threads != 1:
        command += f" --threads {args.threads}"
    holds, line = verdict(result)
    args.out.write_text(markdown(result, command, seconds))
    log(f"wrote {args.out}")
    print(json.dumps(result) if args.json else f"{table(result)}\n\n{line}")
    return 0 if holds else 1


if __name__ == "__main__":
    raise SystemExit(main())
