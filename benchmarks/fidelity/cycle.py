"""One demo load cycle: does the fleet grow and shrink, do service and client count misses alike?

    .venv/bin/python -m benchmarks.fidelity cycle [--json] [--cycles N] [--port P] [--seed S]

It runs ``heteroplane demo --no-load`` (what ``make demo`` runs, less the demo load) on a
temporary data directory, as ``benchmarks/fidelity/demo.py`` does (the trained family copied in
from the default cache when it is there; the demo measures its profiles and plans as on a first
start), waits for the ready banner and for the applied plan's workers, and sends single queries
until one is answered. Then it replays N periods of the demo's own load from the client side:
the trace is :func:`controlplane.service.demo.load_trace` (Poisson arrivals at lambda(t) = 12 (1
- 0.8 cos(2 pi t / 240 s)) qps: 2.4 qps up to 21.6 and back over 240 s, each query a validation
sample; periods 0..N-1 of seed S, the demo's own when S = 0), written as a trace CSV and sent by
the real command line, ``heteroplane loadgen --json`` (client-side latency, end to end).

It measures, over the replay:

- **the counts**: the service's serving totals (``GET /v1/apps/demo/serving``) before and after;
  the service's late-or-failed queries are the deltas of ``late`` (answered over the SLO),
  ``refused``, ``timed_out`` and ``failed``; loadgen's are the queries it sent less those it saw
  answered within the app's SLO (``sent - attainment x sent``: late answers and every error).
  Their difference as a share of the queries sent is judged against 1%;
- **the fleet**: the app's running instances (``GET /v1/instances?app=demo``) every
  :data:`POLL_S` seconds in a background thread, and the decisions recorded meanwhile (``GET
  /v1/apps/demo/decisions``): the tuner's ``scale_up`` (launch) and ``scale_down`` (drain) with
  their reasons, and the reconciler's ``launch`` and ``terminate`` that carry them out. The
  fleet grew and shrank when the running count rose above an earlier count and later fell
  below that peak, and the tuner decided at least one launch and one drain.

It prints the decisions, the fleet over time and a small table (with ``--json``, one JSON
document: ``queries``, ``client_late_or_failed``, ``service_late_or_failed``,
``difference_share``, ``within_1pct``, ``launches``, ``drains``, ``fleet_min``, ``fleet_max``,
``grew_and_shrank``, ``attainment`` and ``p99_ms`` as the client measured them, and more). The
exit status is 0 when both criteria hold, else 1. The demo and its workers are stopped at the
end, also on an error or Ctrl-C.

It takes the demo's start (about two minutes on a 2-core machine with the family cached: it
measures the family's profiles), then 240 s per cycle and the last answers: 6-8 minutes for one
cycle.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import local_service
from benchmarks.fidelity import demo as demo_fidelity
from controlplane.service.demo import LOAD_PERIOD_S, load_trace
from estimator.traces import Trace, read_trace_csv, write_trace_csv

REPO = Path(__file__).resolve().parents[2]
APP = demo_fidelity.APP
ACCEPT_SHARE = 0.01  # the issue's acceptance: the counts within 1% of all queries
DEFAULT_CYCLES = 1
POLL_S = 2.0
# After loadgen's last answer the service may still be finishing a query (its own give-up time).
SETTLE_DEADLINE_S = 30.0
SERVED_DEADLINE_S = 120.0
LOADGEN_PROGRESS_S = 30.0
# loadgen starts (imports, reads the app), replays the trace, waits for the last answers.
LOADGEN_SLACK_S = 180.0
# The counters of the serving totals whose deltas are the service's late-or-failed queries.
MISS_COUNTERS = ("late", "refused", "timed_out", "failed")
TOTAL_COUNTERS = ("arrived", "answered", *MISS_COUNTERS, "offered", "rejected")
# What decisions are listed: the tuner's (scale_up: launch, scale_down: drain, budget_capped)
# and the reconciler's acts on them; gear switches and calibration, which steer the same loop.
LISTED_KINDS = (
    "scale_up",
    "scale_down",
    "budget_capped",
    "launch",
    "terminate",
    "launch_failed",
    "drain_deferred",
    "gear_switch",
    "profile_drift",
    "profile_calibrated",
    "capacity_replan",
)
LAUNCH_KIND = "scale_up"
DRAIN_KIND = "scale_down"
GEAR_KIND = "gear_switch"


# --- the pure helpers ------------------------------------------------------------------------


def client_late_or_failed(summary: Mapping[str, Any]) -> int:
    """Loadgen's misses: the queries it sent less those answered within the SLO (``attainment``
    is that share of all sent; ``None``, no SLO known, counts every query a miss)."""
    sent = int(summary["sent"])
    attainment = summary.get("attainment")
    within = 0 if attainment is None else round(float(attainment) * sent)
    return sent - within


def totals_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    """The serving totals' counters (:data:`TOTAL_COUNTERS`) after less before."""
    return {key: int(after.get(key, 0)) - int(before.get(key, 0)) for key in TOTAL_COUNTERS}


def service_late_or_failed(delta: Mapping[str, int]) -> int:
    """The service's misses over a run: answered late, refused, timed out or failed."""
    return sum(int(delta[key]) for key in MISS_COUNTERS)


def compare_counts(queries: int, client: int, service: int) -> dict[str, Any]:
    """The two counts of misses against each other, as a share of ``queries``."""
    if queries <= 0:
        raise ValueError(f"queries must be > 0, got {queries}")
    difference = service - client
    share = abs(difference) / queries
    return {
        "queries": queries,
        "client_late_or_failed": client,
        "service_late_or_failed": service,
        "difference": difference,
        "difference_share": share,
        "within_1pct": share <= ACCEPT_SHARE,
    }


def rose_then_fell(series: Sequence[int]) -> bool:
    """Whether some value of ``series`` is above an earlier one and above a later one: the fleet
    grew and then shrank (a fleet that only shrank, or shrank and then grew, did not)."""
    lowest = float("inf")
    peak: int | None = None  # the highest value so far that rose above an earlier one
    for value in series:
        if peak is not None and value < peak:
            return True
        if value > lowest:
            peak = value if peak is None else max(peak, value)
        lowest = min(lowest, value)
    return False


@dataclass(frozen=True, slots=True)
class FleetSample:
    """The app's instances at ``t_s`` seconds into the replay: running, and live (any state but
    terminated or failed: booting and draining included)."""

    t_s: float
    running: int
    live: int


def fleet_judgement(samples: Sequence[FleetSample], launches: int, drains: int) -> dict[str, Any]:
    """Min, max, first and last running count of ``samples``, and whether the fleet grew and
    shrank: its running count rose then fell, and the tuner decided a launch and a drain."""
    running = [s.running for s in samples]
    if not running:
        return {
            "fleet_min": None,
            "fleet_max": None,
            "fleet_first": None,
            "fleet_last": None,
            "rose_then_fell": False,
            "grew_and_shrank": False,
        }
    shape = rose_then_fell(running)
    return {
        "fleet_min": min(running),
        "fleet_max": max(running),
        "fleet_first": running[0],
        "fleet_last": running[-1],
        "rose_then_fell": shape,
        "grew_and_shrank": shape and launches > 0 and drains > 0,
    }


def fleet_steps(samples: Sequence[FleetSample]) -> list[FleetSample]:
    """The samples at which the running or live count changed (and the first and the last)."""
    steps: list[FleetSample] = []
    for sample in samples:
        if not steps or (sample.running, sample.live) != (steps[-1].running, steps[-1].live):
            steps.append(sample)
    if samples and steps[-1] is not samples[-1]:
        steps.append(samples[-1])
    return steps


def cycle_trace(cycles: int, n_samples: int, seed: int) -> Trace:
    """Periods 0..``cycles - 1`` of the demo load (seed ``seed``) end to end, as one trace."""
    parts = [load_trace(cycle, n_samples, seed=seed) for cycle in range(cycles)]
    arrivals = np.concatenate([p.arrival_s + n * LOAD_PERIOD_S for n, p in enumerate(parts)])
    batches = np.concatenate([p.batch_size for p in parts])
    samples = np.concatenate([p.sample_id for p in parts if p.sample_id is not None])
    return Trace(arrivals, batches, samples)


# --- the live parts ---------------------------------------------------------------------------


class FleetPoller:
    """The app's instance counts every ``every_s`` seconds in a background thread."""

    def __init__(self, url: str, headers: Mapping[str, str], every_s: float = POLL_S) -> None:
        self._client = httpx.Client(
            base_url=url, headers=dict(headers), timeout=10.0, trust_env=False
        )
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-poller", daemon=True)
        self._start = time.monotonic()
        self.samples: list[FleetSample] = []
        self.misses = 0

    def sample(self) -> FleetSample | None:
        try:
            answer = self._client.get("/v1/instances", params={"app": APP})
            answer.raise_for_status()
        except httpx.HTTPError:
            self.misses += 1
            return None
        states = [i["state"] for i in answer.json()]
        return FleetSample(
            round(time.monotonic() - self._start, 1),
            states.count("running"),
            sum(1 for s in states if s not in ("terminated", "failed")),
        )

    def _run(self) -> None:
        while True:
            found = self.sample()
            if found is not None:
                self.samples.append(found)
            if self._stop.wait(self._every_s):
                return

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30.0)
        found = self.sample()  # the fleet at the end, whenever the last poll was
        if found is not None:
            self.samples.append(found)
        self._client.close()


def serving_totals(api: httpx.Client) -> dict[str, Any]:
    answer = api.get(f"/v1/apps/{APP}/serving")
    answer.raise_for_status()
    document: dict[str, Any] = answer.json()
    return document


def newest_decision_id(api: httpx.Client) -> int:
    answer = api.get(f"/v1/apps/{APP}/decisions", params={"limit": 1})
    answer.raise_for_status()
    decisions = answer.json()
    return int(decisions[-1]["id"]) if decisions else 0


def decisions_after(api: httpx.Client, after_id: int) -> list[dict[str, Any]]:
    """The listed kinds of decision recorded after decision ``after_id``, oldest first."""
    answer = api.get(
        f"/v1/apps/{APP}/decisions", params={"kind": list(LISTED_KINDS), "limit": 10_000}
    )
    answer.raise_for_status()
    return [d for d in answer.json() if int(d["id"]) > after_id]


def wait_served(api: httpx.Client, digit: list[int], process: subprocess.Popen[bytes]) -> None:
    """One query at a time until the demo's workers answer one (not counted: before the
    snapshot)."""
    deadline = time.monotonic() + SERVED_DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the demo exited with {process.returncode}")
        try:
            answer = api.post(f"/v1/apps/{APP}/infer", json={"inputs": [digit]})
            if answer.status_code == 200:
                return
            last = answer.text
        except httpx.HTTPError as error:
            last = str(error)
        time.sleep(1.0)
    raise SystemExit(f"the demo's workers did not answer within {SERVED_DEADLINE_S:g} s: {last}")


def settle(api: httpx.Client, before: Mapping[str, Any], sent: int) -> dict[str, Any]:
    """The serving status once every query sent since ``before`` has ended on the service
    (nothing in flight, ``offered`` up by as many as ``arrived``), or at the deadline."""
    deadline = time.monotonic() + SETTLE_DEADLINE_S
    while True:
        status = serving_totals(api)
        delta = totals_delta(before, status["totals"])
        done = delta["offered"] + delta["rejected"]  # a 422 after arrival is not offered
        ended = done >= delta["arrived"] and status["in_flight_requests"] == 0
        if (ended and delta["arrived"] >= sent) or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def run_loadgen(env: dict[str, str], url: str, token: str, trace: Path) -> dict[str, Any]:
    """``heteroplane loadgen --json`` on ``trace``, its progress on this stderr; its summary."""
    duration_s = float(read_trace_csv(trace).arrival_s[-1])
    command = [sys.executable, "-m", "controlplane", "loadgen", "--url", url, "--app", APP]
    command += ["--trace", str(trace), "--token", token, "--json"]
    command += ["--progress-s", f"{LOADGEN_PROGRESS_S:g}"]
    done = subprocess.run(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=None,  # progress lines go straight to ours
        text=True,
        timeout=duration_s + LOADGEN_SLACK_S,
    )
    if done.returncode != 0:
        raise SystemExit(f"loadgen exited {done.returncode}")
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def _decision_row(decision: Mapping[str, Any], origin: float | None) -> dict[str, Any]:
    from datetime import datetime

    at = datetime.fromisoformat(str(decision["at"])).timestamp()
    return {
        "id": decision["id"],
        "t_s": None if origin is None else round(at - origin, 1),
        "kind": decision["kind"],
        "reason": decision["reason"],
        "count": decision.get("count", 1),
        "numbers": decision.get("numbers", {}),
    }


def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from provisioners.worker import family

    with demo_fidelity.running_demo(root, args.port) as demo:
        url, token, headers, env, process = (
            demo.url,
            demo.token,
            demo.headers,
            demo.env,
            demo.process,
        )
        plan = demo_fidelity.applied_plan(url, headers)
        workers = demo_fidelity.wait_for_workers(url, headers, plan, process)
        split = family.load_split()
        n_samples = len(split.validation_inputs)
        trace_path = root / "cycle.csv"
        trace = cycle_trace(args.cycles, n_samples, args.seed)
        write_trace_csv(trace, trace_path)
        with httpx.Client(base_url=url, headers=headers, timeout=30.0, trust_env=False) as api:
            wait_served(api, split.validation_inputs[0].astype(int).tolist(), process)
            local_service.log(
                f"plan {plan.get('number')} ({plan.get('rate_qps')} qps); {workers} workers"
                f" running; replaying {args.cycles} demo load cycle(s): {len(trace)} queries"
                f" over {float(trace.arrival_s[-1]):.0f} s ..."
            )
            before_status = serving_totals(api)
            before = before_status["totals"]
            last_id = newest_decision_id(api)
            poller = FleetPoller(url, headers)
            origin = time.time()
            poller.start()
            try:
                summary = run_loadgen(env, url, token, trace_path)
                after_status = settle(api, before, int(summary["sent"]))
            finally:
                poller.stop()
            after = after_status["totals"]
            decisions = [_decision_row(d, origin) for d in decisions_after(api, last_id)]

    delta = totals_delta(before, after)
    queries = int(summary["sent"])
    counts = compare_counts(queries, client_late_or_failed(summary), service_late_or_failed(delta))
    launches = [d for d in decisions if d["kind"] == LAUNCH_KIND]
    drains = [d for d in decisions if d["kind"] == DRAIN_KIND]
    fleet = fleet_judgement(poller.samples, len(launches), len(drains))
    return {
        "app": APP,
        "plan": plan.get("number"),
        "plan_rate_qps": plan.get("rate_qps"),
        "slo_ms": after_status.get("slo_ms"),
        "cycles": args.cycles,
        "seed": args.seed,
        **counts,
        "launches": len(launches),
        "drains": len(drains),
        # The tuner decides per stage; the reconciler acts per instance type (a stage's launch
        # can be met by an instance whose drain was deferred, so these may be fewer).
        "instances_launched": sum(d["numbers"].get("count", 0) for d in launches),
        "instances_drained": sum(d["numbers"].get("count", 0) for d in drains),
        "reconciler_launched": sum(
            len(d["numbers"].get("launches", [])) for d in decisions if d["kind"] == "launch"
        ),
        "reconciler_terminated": sum(
            len(d["numbers"].get("instance_ids", []))
            for d in decisions
            if d["kind"] == "terminate" and d["numbers"].get("cause") == DRAIN_KIND
        ),
        **fleet,
        "attainment": summary.get("attainment"),
        "p99_ms": summary.get("p99_ms"),
        "p50_ms": summary.get("p50_ms"),
        "loadgen": summary,
        "service": {
            **delta,
            "unfinished": delta["arrived"] - delta["offered"] - delta["rejected"],
            "never_arrived": queries - delta["arrived"],
            "attainment_share": (
                (delta["answered"] - delta["late"]) / delta["offered"] if delta["offered"] else None
            ),
        },
        "fleet": [
            {"t_s": s.t_s, "running": s.running, "live": s.live}
            for s in fleet_steps(poller.samples)
        ],
        "fleet_samples": len(poller.samples),
        "fleet_poll_misses": poller.misses,
        "decisions": decisions,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def print_report(result: dict[str, Any]) -> None:
    print(
        f"demo plan {result['plan']} (planned for {result['plan_rate_qps']} qps), SLO"
        f" {result['slo_ms']} ms; {result['cycles']} demo load cycle(s), seed {result['seed']}"
    )
    print("decisions during the cycle (t_s from the replay's start; gear switches counted):")
    listed = [d for d in result["decisions"] if d["kind"] != GEAR_KIND]
    for d in listed:
        repeat = f" (x{d['count']})" if d["count"] > 1 else ""
        print(f"  {_fmt(d['t_s'], '6.1f')} {d['kind']:<14} {d['reason']}{repeat}")
    if not listed:
        print("  none")
    gears = [d for d in result["decisions"] if d["kind"] == GEAR_KIND]
    ups = sum(1 for d in gears if " up from gear " in d["reason"])
    print(f"  gear switches: {len(gears)} ({ups} up, {len(gears) - ups} down)")
    print("fleet (running / live instances, at each change):")
    print("  " + ", ".join(f"{s['t_s']:.0f}s {s['running']}/{s['live']}" for s in result["fleet"]))
    loadgen = result["loadgen"]
    service = result["service"]
    print(
        f"loadgen: sent {loadgen['sent']}, answered {loadgen['answered']}, errors"
        f" {loadgen['errors']} {loadgen['errors_by_kind'] or ''}; p50"
        f" {_fmt(result['p50_ms'], '.1f')} ms, p99 {_fmt(result['p99_ms'], '.1f')} ms,"
        f" attainment {_fmt(result['attainment'], '.4f')}"
    )
    print(
        f"service: arrived {service['arrived']}, answered {service['answered']}, late"
        f" {service['late']}, refused {service['refused']}, timed out {service['timed_out']},"
        f" failed {service['failed']}; attainment {_fmt(service['attainment_share'], '.4f')}"
    )
    rows = [
        ("queries", str(result["queries"])),
        ("client late or failed", str(result["client_late_or_failed"])),
        ("service late or failed", str(result["service_late_or_failed"])),
        (
            "difference (share)",
            f"{result['difference']:+d} ({result['difference_share']:.2%})",
        ),
        ("within 1%", _yes(result["within_1pct"])),
        (
            "launches (scale_up)",
            f"{result['launches']} (+{result['instances_launched']} by stage;"
            f" {result.get('reconciler_launched', 'n/a')} instances launched)",
        ),
        (
            "drains (scale_down)",
            f"{result['drains']} (-{result['instances_drained']} by stage;"
            f" {result.get('reconciler_terminated', 'n/a')} instances terminated)",
        ),
        (
            "fleet running min-max",
            f"{result['fleet_min']}-{result['fleet_max']} (first {result['fleet_first']},"
            f" last {result['fleet_last']})",
        ),
        ("grew and shrank", _yes(result["grew_and_shrank"])),
        ("attainment (client)", _fmt(result["attainment"], ".4f")),
        ("p99 ms (client)", _fmt(result["p99_ms"], ".1f")),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(
        f"load average (1, 5, 15 min): start {result['loadavg_start']}, end {result['loadavg_end']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fidelity cycle", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--cycles",
        type=int,
        default=DEFAULT_CYCLES,
        help=f"demo load periods to replay, 240 s each (default {DEFAULT_CYCLES})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the demo load's seed (default 0: the demo's own)"
    )
    parser.add_argument("--port", type=int, default=0, help="the demo's port (default: a free one)")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.seed < 0:
        parser.error("--cycles must be >= 1 and --seed >= 0")
    result = demo_fidelity.measured(measure, args, "heteroplane-cycle-")
    if result is None:
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0 if result["within_1pct"] and result["grew_and_shrank"] else 1
