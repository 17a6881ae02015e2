"""The tuner on live traffic: a step up and down in the load, and what the service does about it.

    .venv/bin/python benchmarks/live_tuner_step.py [--low-qps 4] [--high-qps 15]
        [--service-ms 100] [--max-workers 3] [--low-s 60] [--high-s 90] [--after-s 240]
        [--seed 0] [--json]

The tuner acting on live traffic, with the service's default settings (InferLine's timing: the
tuner ticks every second over windows up to 60 s and scales down no sooner than 15 s after its
last change; the reconciler runs every 5 s):

1. A temporary data directory gets the demo model family (copied from the default cache when it
   is there, else trained) and a profile file in which ``large`` on ``emu.cpu.large`` serves a
   batch of one in ``--service-ms`` (the workers pad every batch to it, as in
   ``benchmarks/fidelity/serving.py``), so one worker serves about 1000 / service-ms queries/s.
2. ``heteroplane serve`` starts on it with the local provisioner; an app ``step`` is registered
   (``large`` on ``emu.cpu.large``, 1 s SLO at P99) with a budget of ``--max-workers`` workers
   and half of another at the catalog's price, so the tuner may run that many and never one
   more; a plan is previewed for ``--low-qps`` (one worker) and applied.
3. Once the planned worker answers, ``controlplane.clients.loadgen`` sends one seeded Poisson trace
   open loop: ``--low-qps`` for ``--low-s``, ``--high-qps`` (more than one worker carries) for
   ``--high-s``, ``--low-qps`` for ``--after-s``.
4. From the service's own records (``GET /v1/apps/{app}/decisions`` and ``/events``) it prints,
   relative to the step up and to the drop: each tuner decision (``scale_up``, ``scale_down``,
   ``budget_capped``) with its reason, the reconciler's launches and terminations, when each
   worker ran and when it was gone; the fleet over time; p50, p99 and attainment per phase from
   loadgen; and the budget check (the requested + pending + running fleet's cost over the whole
   instance history, and every tuner decision's cost after it, against the budget).

What it shows: how long the tuner takes to see a step (its shortest window is 1 s), how long the
reconciler and a local worker's start add before the new capacity serves, how the phase's
latency and attainment suffer meanwhile (admission control refuses what one worker cannot
serve), and how the 60 s live envelope keeps the fleet for about a minute after the drop before
the scale-downs. Exit status 1 when no scale_up came in the high phase, no scale_down after
the drop, or the budget was exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from controlplane.clients import loadgen
from estimator.catalog import default_catalog
from estimator.traces import Trace, poisson_arrivals

try:  # imported as benchmarks.live_tuner_step
    from benchmarks import local_service
except ModuleNotFoundError:  # run as a script: the sibling module
    import local_service

APP = "step"
MODEL = "large"
INSTANCE_TYPE = "emu.cpu.large"
SLO_MS = 1000.0
# After the trace: how long to wait for the last terminations to land.
SETTLE_S = 20.0
KEPT = frozenset({"requested", "pending", "running"})
TUNER_KINDS = ("scale_up", "scale_down", "budget_capped")
COST_SLACK_USD_PER_HR = 1e-9


def epoch_s(at: str) -> float:
    """An API timestamp (ISO 8601, UTC) as seconds since the epoch."""
    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


# --- the service ---------------------------------------------------------------------------------


def deploy(
    api: httpx.Client, profile: Path, budget_usd_per_hr: float, rate_qps: float
) -> dict[str, Any]:
    """Register the app, preview a plan for ``rate_qps`` and apply it; the plan."""
    spec = {
        "name": APP,
        "models": [{"name": MODEL, "profiles": str(profile)}],
        "slo": {"latency_ms": SLO_MS, "percentile": 99},
        "budget_usd_per_hr": budget_usd_per_hr,
        "instance_types": [INSTANCE_TYPE],
    }
    api.post("/v1/apps", json=spec).raise_for_status()
    preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": rate_qps})
    preview.raise_for_status()
    plan: dict[str, Any] = preview.json()
    api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()
    return plan


# --- the load ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of the trace: ``rate_qps`` from ``start_s`` for ``duration_s`` (seconds from the
    trace's start), and loadgen's summary of the queries sent in it."""

    name: str
    rate_qps: float
    start_s: float
    duration_s: float
    sent: int
    answered: int
    errors_by_kind: Mapping[str, int]
    p50_ms: float | None
    p99_ms: float | None
    attainment: float | None


def step_trace(
    rates_qps: Sequence[float], durations_s: Sequence[float], seed: int
) -> tuple[Trace, list[float]]:
    """One Poisson trace of consecutive phases, starting at 0 (an arrival at 0 anchors it, so
    loadgen's send times are the trace's times); the phases' start times."""
    rng = np.random.default_rng(seed)
    parts = [np.zeros(1)]
    starts = []
    start = 0.0
    for rate, duration in zip(rates_qps, durations_s, strict=True):
        starts.append(start)
        arrivals = poisson_arrivals(rate, duration, rng)
        parts.append(start + arrivals[arrivals > 0.0])
        start += duration
    arrival_s = np.concatenate(parts)
    return Trace(arrival_s, np.ones(arrival_s.size, dtype=np.int64)), starts


def phase_summaries(
    result: loadgen.LoadResult,
    queries: Sequence[loadgen.Query],
    names: Sequence[str],
    rates_qps: Sequence[float],
    starts_s: Sequence[float],
    durations_s: Sequence[float],
) -> list[Phase]:
    """loadgen's summary (p50, p99, attainment) of the queries sent in each phase."""
    send_at = {q.index: q.send_at_s for q in queries}
    phases = []
    for name, rate, start, duration in zip(names, rates_qps, starts_s, durations_s, strict=True):
        mine = [o for o in result.outcomes if start <= send_at[o.index] < start + duration]
        summary = loadgen.summarise(mine, SLO_MS, duration)
        phases.append(
            Phase(
                name,
                rate,
                start,
                duration,
                summary.sent,
                summary.answered,
                dict(summary.errors_by_kind),
                summary.p50_ms,
                summary.p99_ms,
                summary.attainment,
            )
        )
    return phases


# --- what the service did ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Worker:
    """One instance's life, in seconds from the step up (None: it never got there)."""

    instance_id: str
    requested_s: float
    running_s: float | None
    terminating_s: float | None
    ended_s: float | None
    ended_as: str | None


def workers(events: Sequence[Mapping[str, Any]], step_at: float) -> list[Worker]:
    first: dict[str, dict[str, float]] = {}
    ended_as: dict[str, str] = {}
    for event in sorted(events, key=lambda e: int(e["id"])):
        moves = first.setdefault(event["instance_id"], {})
        moves.setdefault(event["to_state"], epoch_s(event["at"]) - step_at)
        if event["to_state"] in ("terminated", "failed"):
            ended_as[event["instance_id"]] = event["to_state"]
    lives = []
    for instance_id, moves in first.items():
        ended = ended_as.get(instance_id)
        lives.append(
            Worker(
                instance_id,
                moves.get("requested", min(moves.values())),
                moves.get("running"),
                moves.get("terminating"),
                moves.get(ended) if ended else None,
                ended,
            )
        )
    return sorted(lives, key=lambda w: w.requested_s)


def fleet_timeline(
    events: Sequence[Mapping[str, Any]], prices: Mapping[str, float], step_at: float
) -> list[dict[str, Any]]:
    """The fleet after every instance event: counts by state and the kept fleet's cost."""
    state: dict[str, str] = {}
    timeline = []
    for event in sorted(events, key=lambda e: int(e["id"])):
        state[event["instance_id"]] = event["to_state"]
        counts: dict[str, int] = {}
        for s in state.values():
            counts[s] = counts.get(s, 0) + 1
        kept_cost = sum(prices[i] for i, s in state.items() if s in KEPT)
        timeline.append(
            {
                "t_s": round(epoch_s(event["at"]) - step_at, 3),
                "running": counts.get("running", 0),
                "booting": counts.get("requested", 0) + counts.get("pending", 0),
                "terminating": counts.get("terminating", 0),
                "kept_cost_usd_per_hr": round(kept_cost, 9),
            }
        )
    return timeline


def fleet_changes(timeline: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The timeline's points where the counts changed (the last of a burst of events)."""
    changes: list[Mapping[str, Any]] = []
    for point in timeline:
        key = (point["running"], point["booting"], point["terminating"])
        if changes and changes[-1]["t_s"] == point["t_s"]:
            changes[-1] = point
        elif not changes or key != (
            changes[-1]["running"],
            changes[-1]["booting"],
            changes[-1]["terminating"],
        ):
            changes.append(point)
    return changes


def summary(document: Mapping[str, Any]) -> dict[str, list[float]]:
    """The step's times: the scale_up decisions and the new workers running (from the step up),
    the scale_down decisions and the removed workers gone (from the drop)."""
    drop = float(document["drop_after_step_s"])
    decided = document["decisions"]
    lives = document["workers"]
    return {
        "scale_up_s": [d["t_s"] for d in decided if d["kind"] == "scale_up" and d["t_s"] >= 0],
        "new_workers_running_s": sorted(
            w["running_s"] for w in lives if w["requested_s"] >= 0 and w["running_s"] is not None
        ),
        "scale_down_after_drop_s": [
            round(d["t_s"] - drop, 3)
            for d in decided
            if d["kind"] == "scale_down" and d["t_s"] >= drop
        ],
        "workers_gone_after_drop_s": sorted(
            round(w["ended_s"] - drop, 3)
            for w in lives
            if w["ended_s"] is not None and w["ended_s"] >= drop
        ),
    }


def times(values: Sequence[float]) -> str:
    # No-break spaces keep "+1.5 s" on one line when wrapped; report() turns them back.
    return ", ".join(f"{v:+.1f}\N{NO-BREAK SPACE}s" for v in values) or "none"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def when(value: float | None) -> str:
    return "never" if value is None else f"{value:+.1f} s"


def report(document: Mapping[str, Any]) -> str:
    """The human-readable report (markdown, for docs/serving.md)."""
    args = document["args"]
    drop = document["drop_after_step_s"]
    intro = (
        f"Run {document['date']}, {document['wall_s']:.0f} s in all, on {document['cpu']}"
        f" ({document['cpus']} CPUs), load average before {document['load_before'][0]:.2f}."
        f" Step {args['low_qps']:g} -> {args['high_qps']:g} -> {args['low_qps']:g} qps"
        f" ({args['low_s']:g} s, {args['high_s']:g} s, {args['after_s']:g} s), service time"
        f" {args['service_ms']:g} ms, budget {document['budget_usd_per_hr']:g} USD/hr ="
        f" {args['max_workers']} x {document['price_usd_per_hr']:g} + half of one; the plan:"
        f" {json.dumps(document['planned_fleet'])}. Times are from the step up (t = 0); the"
        f" drop is at {drop:+.1f} s."
    )
    lines = [
        textwrap.fill(intro, 100),
        "",
        textwrap.fill(
            f"- scale_up decided at {times(document['summary']['scale_up_s'])} after the step;"
            f" the new workers running at {times(document['summary']['new_workers_running_s'])}.",
            100,
            subsequent_indent="  ",
        ),
        textwrap.fill(
            f"- scale_down decided at {times(document['summary']['scale_down_after_drop_s'])}"
            f" after the drop; the removed workers gone at"
            f" {times(document['summary']['workers_gone_after_drop_s'])}.",
            100,
            subsequent_indent="  ",
        ),
        "",
        "| t, s | after the drop, s | decision | reason |",
        "|---:|---:|---|---|",
    ]
    for d in document["decisions"]:
        t = d["t_s"]
        after = f"{t - drop:+.1f}" if t >= drop else ""
        reason = d["reason"] if len(d["reason"]) <= 240 else d["reason"][:237] + "..."
        lines.append(f"| {t:+.1f} | {after} | {d['kind']} | {reason} |")
    lines += [
        "",
        "| worker | requested | running | terminating | gone |",
        "|---|---:|---:|---:|---:|",
    ]
    for w in document["workers"]:
        lines.append(
            f"| {w['instance_id'][:8]} | {when(w['requested_s'])} | {when(w['running_s'])} |"
            f" {when(w['terminating_s'])} | {when(w['ended_s'])} |"
        )
    lines += ["", "Fleet over time (running / booting / terminating, kept cost):", ""]
    points = [
        f"{p['t_s']:+.1f} s: {p['running']}/{p['booting']}/{p['terminating']}"
        f"\N{NO-BREAK SPACE}({p['kept_cost_usd_per_hr']:g})"
        for p in document["fleet"]
    ]
    lines.append(
        textwrap.fill(", ".join(p.replace(" ", "\N{NO-BREAK SPACE}") for p in points), 100)
    )
    lines += [
        "",
        "| phase | rate, qps | sent | answered | errors | p50, ms | p99, ms | attainment |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for p in document["phases"]:
        errors = ", ".join(f"{k} {v}" for k, v in p["errors_by_kind"].items()) or "0"
        lines.append(
            f"| {p['name']} | {p['rate_qps']:g} | {p['sent']} | {p['answered']} | {errors} |"
            f" {ms(p['p50_ms'])} | {ms(p['p99_ms'])} | {share(p['attainment'])} |"
        )
    budget = document["budget"]
    check = (
        f"Budget check: the requested + pending + running fleet cost at most"
        f" {budget['most_kept_cost_usd_per_hr']:g} USD/hr over the whole instance history and"
        f" every tuner decision at most {budget['most_decided_cost_usd_per_hr']:g} USD/hr after it,"
        f" against {document['budget_usd_per_hr']:g}: {'within' if budget['holds'] else 'OVER'}."
    )
    lines += ["", textwrap.fill(check, 100)]
    return "\n".join(lines).replace("\N{NO-BREAK SPACE}", " ")


def command(args: argparse.Namespace) -> str:
    """The command line that repeats this run."""
    options = " ".join(
        f"--{name.replace('_', '-')} {value:g}"
        for name, value in vars(args).items()
        if name != "json"
    )
    return f"python benchmarks/live_tuner_step.py {options}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--low-qps", type=float, default=4.0)
    parser.add_argument("--high-qps", type=float, default=15.0)
    parser.add_argument("--service-ms", type=float, default=100.0)
    parser.add_argument("--max-workers", type=int, default=3, help="workers the budget affords")
    parser.add_argument("--low-s", type=float, default=60.0, help="the low phase before the step")
    parser.add_argument("--high-s", type=float, default=90.0)
    parser.add_argument("--after-s", type=float, default=240.0, help="the low phase after it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the run as one JSON document")
    args = parser.parse_args()
    if not (0 < args.low_qps < args.high_qps) or args.service_ms <= 0 or args.max_workers < 2:
        parser.error("need 0 < --low-qps < --high-qps, --service-ms > 0, --max-workers >= 2")
    if min(args.low_s, args.high_s, args.after_s) <= 0:
        parser.error("phase lengths must be > 0")
    from provisioners.worker import family

    load_before = os.getloadavg()
    started = time.monotonic()
    price = default_catalog().price_usd_per_hr(INSTANCE_TYPE)
    budget = (args.max_workers + 0.5) * price
    names = ["low", "high", "after the drop"]
    rates = [args.low_qps, args.high_qps, args.low_qps]
    durations = [args.low_s, args.high_s, args.after_s]
    trace, starts = step_trace(rates, durations, args.seed)
    data_dir = Path(tempfile.mkdtemp(prefix="heteroplane-step-"))
    try:
        profile = local_service.prepare_data_dir(
            data_dir,
            args.service_ms,
            model=MODEL,
            instance_type=INSTANCE_TYPE,
            source="benchmarks/live_tuner_step.py (emulated)",
        )
        token = local_service.issue_token(data_dir, "step-bench")
        port = local_service.free_port()
        base = f"http://127.0.0.1:{port}"
        url = loadgen.infer_url(base, APP)
        queries = loadgen.build_queries(trace, family.load_split().validation_inputs)
        log_path = data_dir / "serve.log"
        headers = {"Authorization": f"Bearer {token}"}
        with (
            # The service's default settings: none of ours from the environment.
            local_service.running_service(data_dir, port, model=MODEL) as process,
            httpx.Client(base_url=base, headers=headers, timeout=120.0, trust_env=False) as api,
        ):
            local_service.wait_for(
                "the service", lambda: api.get("/healthz").status_code == 200, process, log_path
            )
            plan = deploy(api, profile, budget, args.low_qps)
            planned = {str(t): int(n) for s in plan["stages"] for t, n in s["fleet"].items()}
            local_service.log(f"plan for {args.low_qps:g} qps: {planned}; budget {budget:g} USD/hr")

            def answers() -> bool:
                probe = queries[0].body
                json_headers = {"Content-Type": "application/json"}
                return api.post(url, content=probe, headers=json_headers).status_code == 200

            local_service.wait_for("the planned worker's first answer", answers, process, log_path)
            steps = zip(rates, durations, strict=True)
            local_service.log("load: " + " -> ".join(f"{r:g} qps for {d:g} s" for r, d in steps))
            load_start = time.time()
            result = loadgen.run_load(
                queries,
                url,
                token,
                progress=lambda snapshot: local_service.log("  " + snapshot.line()),
                progress_every_s=15.0,
            )
            time.sleep(SETTLE_S)  # the last terminations land in the store
            decisions = api.get(f"/v1/apps/{APP}/decisions").json()
            events = api.get(f"/v1/apps/{APP}/events").json()
            instances = api.get("/v1/instances", params={"app": APP}).json()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    wall_s = time.monotonic() - started

    step_at = load_start + starts[1]
    drop_at = load_start + starts[2]
    prices = {r["id"]: float(r["price_usd_per_hr"]) for r in instances}
    timeline = fleet_timeline(events, prices, step_at)
    tuner = [d for d in decisions if d["kind"] in TUNER_KINDS]
    shown = [d for d in decisions if d["kind"] in (*TUNER_KINDS, "launch", "terminate")]
    decided_cost = max(
        (float(d["numbers"].get("cost_usd_per_hr_after", 0.0)) for d in tuner), default=0.0
    )
    kept_cost = max((p["kept_cost_usd_per_hr"] for p in timeline), default=0.0)
    holds = max(kept_cost, decided_cost) <= budget + COST_SLACK_USD_PER_HR
    document: dict[str, Any] = {
        "command": command(args),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": wall_s,
        "cpu": local_service.cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": list(load_before),
        "price_usd_per_hr": price,
        "budget_usd_per_hr": budget,
        "planned_fleet": planned,
        "drop_after_step_s": drop_at - step_at,
        "decisions": [
            {
                "t_s": round(epoch_s(d["at"]) - step_at, 3),
                "kind": d["kind"],
                "reason": d["reason"],
                "numbers": d["numbers"],
            }
            for d in shown
        ],
        "workers": [asdict(w) for w in workers(events, step_at)],
        "fleet": fleet_changes(timeline),
        "phases": [
            asdict(p) for p in phase_summaries(result, queries, names, rates, starts, durations)
        ],
        "budget": {
            "most_kept_cost_usd_per_hr": kept_cost,
            "most_decided_cost_usd_per_hr": decided_cost,
            "holds": holds,
        },
    }
    document["summary"] = summary(document)
    ups = document["summary"]["scale_up_s"]
    downs = document["summary"]["scale_down_after_drop_s"]
    print(f"Written by `{document['command']}`.\n")
    print(report(document))
    if args.json:
        print(json.dumps(document))
    return 0 if ups and downs and holds else 1


if __name__ == "__main__":
    raise SystemExit(main())
