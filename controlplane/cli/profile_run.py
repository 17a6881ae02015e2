"""``heteroplane profile run``: ask the service to measure an app's registered models.

A client command (``POST /v1/apps/{app}/profiles``): the service launches one worker per
candidate type (or ``--types``) with the app's artifacts, times OIP v2 batches of random inputs
through them, stores the profiles and stops the workers (:mod:`controlplane.apps.profile_run`).
On EC2 that takes minutes (the instances boot), so the request waits up to ``--timeout``
(default an hour, not the other commands' five minutes); the local provisioner's workers start
in seconds. The line printed before the run says which, and how many calls each worker answers
(the service's check says so); the summary is the mean latency per model, type and batch size.
"""

from __future__ import annotations

import argparse
from typing import Any

from controlplane.cli.client import app_path, client_from, table
from controlplane.cli.output import UsageError, emit, progress

__all__ = ["DEFAULT_RUN_TIMEOUT_S", "run_profile_run"]

# Workers boot (minutes on EC2), then every model, type and batch size is timed.
DEFAULT_RUN_TIMEOUT_S = 3600.0


def _names(text: str | None, option: str) -> list[str] | None:
    if text is None:
        return None
    names = [part.strip() for part in text.split(",")]
    if not names or any(not name for name in names):
        raise UsageError(f"{option} {text!r}: expected names separated by commas")
    return names


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    sizes = []
    for part in text.split(","):
        try:
            sizes.append(int(part.strip()))
        except ValueError:
            raise UsageError(f"--batch-sizes: {part.strip()!r} is not a whole number") from None
    if any(size < 1 for size in sizes) or len(set(sizes)) != len(sizes):
        raise UsageError(f"--batch-sizes {text!r}: distinct whole numbers >= 1")
    return sorted(sizes)


def run_profile_run(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    types = _names(args.types, "--types")
    if types is not None:
        body["types"] = types
    sizes = _sizes(args.batch_sizes)
    if sizes is not None:
        body["batch_sizes"] = sizes
    if args.samples is not None:
        if args.samples < 1:
            raise UsageError(f"--samples must be >= 1, got {args.samples}")
        body["samples"] = args.samples
    if args.timeout is None:
        args.timeout = DEFAULT_RUN_TIMEOUT_S
    with client_from(args) as client:
        # The service checks the request first (the types, the batches' size, the budget), so
        # that a run it refuses is refused before the line that says how long it takes.
        checked = client.post(app_path(args.app, "profiles") + "?check=true", body)
        progress(_progress_line(args.app, checked))
        result = client.post(app_path(args.app, "profiles"), body)
    return emit(args.json, result, lambda: _summary(result))


def _progress_line(app: str, checked: dict[str, Any]) -> str:
    """What the run will do and how long it takes: local workers (processes on the service's
    machine) start in seconds, EC2 instances boot for minutes; then each answers its calls."""
    head = (
        f"profiling {app} ({', '.join(checked['models'])}) on"
        f" {', '.join(checked['instance_types'])}: the service starts one worker per type"
        f" ({checked['cost_usd_per_hr']:.4g} USD/hr)"
    )
    calls = checked.get("calls_per_worker")
    if calls is None:  # a service from before the check said more
        return f"{head}; this can take minutes"
    if checked.get("local_workers"):
        start = "processes on the service's machine that start in seconds"
    else:
        start = "instances that take minutes to boot"
    return f"{head}, {start}, and times {calls:,} calls through each"


def _summary(result: dict[str, Any]) -> str:
    sizes = result["batch_sizes"]
    rows = []
    for profile in result["profiles"]:
        means = dict(zip(profile["batch_sizes"], profile["mean_ms"], strict=True))
        rows.append([profile["model"], profile["instance_type"], *(means.get(b) for b in sizes)])
    head = [
        f"profiles of {result['app']} stored: {', '.join(result['models'])} on"
        f" {', '.join(result['instance_types'])}, {result['samples']} samples per cell,"
        f" {result['elapsed_s']:.0f} s, workers at {result['cost_usd_per_hr']:.4g} USD/hr",
        "mean latency through each type's worker (end to end), ms",
    ]
    body = table(["MODEL", "TYPE", *(f"B={b}" for b in sizes)], rows)
    return "\n".join(
        [
            *head,
            body,
            f"plan it with: heteroplane plans preview --app {result['app']} --rate-qps QPS",
        ]
    )
