"""The serving path at full speed, measured where clients enter: through the real API.

    .venv/bin/python -m benchmarks.serving_speed api [--json] [--rate-qps 2000] [--duration-s 10]
        [--workers 2] [--runs 3] [--protocols v1,v2] [--service-setting HETEROPLANE_X=V ...]
        [--floor forward,answer]

What runs: ``heteroplane serve`` (uvicorn, FastAPI, the token check, validation, the serving
loop's dispatcher, its HTTP transport) with the local provisioner, an app whose model ``tiny``
runs on ``--workers`` real worker agents (``python -m provisioners.worker``, processes of their
own) of an emulated type padded to nothing: each answers as soon as the digits model has run
(well under a millisecond), so what a query waits for is the serving path. The load generator is
``heteroplane loadgen --engine raw`` (``controlplane.clients.rawload``: raw keep-alive HTTP/1.1
connections, about 0.1 ms of CPU a query where httpx took 0.5) in a process of its own: open loop
(query i sent at its scheduled time whatever happened to the earlier ones, latency from the
scheduled time, so a path that falls behind shows as latency), a Poisson trace at
``--rate-qps`` for ``--duration-s``, one sample of 64 pixels a query, sent to each of
``--protocols`` in turn (a service of its own for each): ``v1``, ``POST /v1/apps/{app}/infer``,
and ``v2``, ``POST /v2/models/{app}/infer`` (the Open Inference Protocol's JSON, what
tritonclient and KServe clients send; ``loadgen --protocol v2``). It is ours, not wrk2 or
oha (neither is in the package registries this machine reaches; Debian's wrk and hey are closed
loop, which hides queueing): its own send lag is printed, and a run whose send lag p99 exceeds
10 ms says the load generator, not the service, was the limit.

Printed, per run and as the median over ``--runs`` with the spread: ``sustained_qps`` (answered
over the span of the trace), ``p50_ms``, ``p99_ms`` (at the client), ``p99_added_ms`` (the P99
less the worker round trip's P99, timed straight to a worker with no service in between: the
control plane's share), ``cpu_ms_per_query`` (the service process's CPU time per query,
``/proc/<pid>/stat``), ``worker_cpu_ms_per_query`` (the worker agents', together),
``loops_cpu_share`` (the CPU the service's other processes, its loops, used over the run, in
cores), ``errors``
and the load generator's ``send_lag_p99_ms``; the load average before and after each run (the
machine's other work moves these figures: they are recorded, not subtracted); and, once per
service, what the calibration stored over its life (``calibration``: its decisions by kind,
and the tuner's ladder builds that each store that re-sizes the app sets off). The service runs
every loop at its default period; before the first run the benchmark waits until the service's
processes (the serving one and those it started, the worker agents aside) use under a tenth of a
core over 2 s (:func:`settle`, at most 120 s): the loops process plans and builds the tuner's
sizing ladder once a plan is applied, about 6 s of a core that used to fall on each set's first
run. ``--floor``: after each run, the same trace through floor fronts on the same worker agents
(:mod:`benchmarks.serving_speed.floor`: ``answer`` answers at once, ``forward`` makes one worker
call a query with nothing else), the same figures under ``floor``: what the machine allows in
the same minutes. Goal (issue 30): >= 2,000 q/s at <= 3 ms added P99 on this
machine, on ``/v1`` and ``/v2`` alike (the median of the runs; issue 13 had 10 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import local_service
from benchmarks.serving_speed.floor import MODES as FLOOR_MODES
from controlplane.clients import loadgen
from controlplane.provisioning import LOCAL_PROFILE_FILE, LOCAL_WORKERS_DIR
from controlplane.serving.modelio import ModelIO
from estimator.profiles import LatencyProfile, write_profiles_json
from estimator.traces import poisson_arrivals
from provisioners.worker.emulation import ComputeCurve, compute_document
from provisioners.worker.oip import HEADER_LENGTH

ROOT = Path(__file__).resolve().parents[2]
APP = "speed"
MODEL = "tiny"
INSTANCE_TYPE = "emu.cpu.large"
GOAL_QPS = 2000.0
GOAL_ADDED_MS = 3.0
PROTOCOLS = ("v1", "v2")
LAG_LIMIT_MS = 10.0
DIRECT_QUERIES = 300
# settle(): the service is quiet when its processes use under SETTLE_SHARE of a core over
# SETTLE_WINDOW_S (the loops' periodic work at idle is well under it), waited for at most
# SETTLE_DEADLINE_S.
SETTLE_WINDOW_S = 2.0
SETTLE_SHARE = 0.1
SETTLE_DEADLINE_S = 120.0
JSON = {"Content-Type": "application/json"}
# The figures of each run that are summarised as median and spread over the runs.
# The decisions a calibration store writes (controlplane.loops.calibration).
CALIBRATION_KINDS = ("profile_drift", "profile_calibrated", "profile_spread", "serving_overhead")
FIGURES = (
    "sustained_qps",
    "goodput_qps",
    "p50_ms",
    "p99_ms",
    "p99_added_ms",
    "cpu_ms_per_query",
    "worker_cpu_ms_per_query",
    "loops_cpu_share",
)


def profile_file(data_dir: Path) -> Path:
    """A profile of ``tiny`` on ``emu.cpu.large`` as the serving path sees it on this machine:
    a batch's round trip is about 1 ms whatever its size (the HTTP exchange, not the model,
    which takes microseconds), 1.0 + 0.05 (b - 1) ms for b queries up to 4, so one worker
    answers 1,000 q/s one query a call and 3,480 q/s four at a time (the plan below, 3,600 q/s,
    needs both workers and batches); a compute section that pads nothing."""
    path = data_dir / LOCAL_PROFILE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    sizes = np.array([1, 2, 4])
    cells = tuple(np.full(8, 1.0 + 0.05 * (size - 1)) for size in sizes)
    profiles = [LatencyProfile(MODEL, INSTANCE_TYPE, sizes, cells)]
    compute = compute_document({MODEL: ComputeCurve(0.0, 0.0)})
    write_profiles_json(profiles, path, source="benchmarks/serving_speed/api.py", compute=compute)
    return path


def worker_records(data_dir: Path) -> list[Any]:
    """The worker agents' records (pid, address) from the local provisioner."""
    from provisioners.local import LocalProvisioner

    provisioner = LocalProvisioner(data_dir / LOCAL_WORKERS_DIR, {}, [MODEL], None)
    try:
        return list(provisioner.records())
    finally:
        provisioner.close()


def direct_p99_ms(record: Any, inputs: np.ndarray) -> float:
    """P99 of single batches sent one after another straight to the worker of ``record``."""
    io = ModelIO(MODEL)  # the request the dispatcher sends: Open Inference Protocol v2
    body, header_length = io.encode([inputs[0].astype(float).tolist()])
    url = f"http://{record.address}{io.path}"
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(header_length)}
    times = []
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        for _ in range(DIRECT_QUERIES):
            start = time.perf_counter()
            client.post(url, content=body, headers=headers).raise_for_status()
            times.append((time.perf_counter() - start) * 1000.0)
    return float(np.percentile(times, 99))


def load_process(
    base: str, token: str, trace_path: Path, env: dict[str, str], protocol: str = "v1"
) -> dict[str, Any]:
    """``heteroplane loadgen --json`` on the trace against the service at ``base`` over
    ``protocol``, in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "loadgen", "--url", base,
         "--token", token, "--app", APP, "--trace", str(trace_path), "--json",
         "--engine", "raw", "--protocol", protocol],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def one_run(
    args: argparse.Namespace,
    n: int,
    base: str,
    token: str,
    pid: int,
    worker_pids_: list[int],
    root: Path,
    env: dict[str, str],
    direct_ms: float,
) -> dict[str, Any]:
    """Run ``n``'s trace against ``base``: its figures, ``p99_added_ms`` over ``direct_ms``
    (a worker's p99 timed straight)."""
    arrivals = poisson_arrivals(args.rate_qps, args.duration_s, np.random.default_rng(n + 1))
    trace_path = root / f"trace-{n}.csv"
    trace_path.write_text(
        "arrival_s,batch_size\n" + "".join(f"{a:.6f},1\n" for a in arrivals), encoding="utf-8"
    )
    load_before = [round(x, 2) for x in os.getloadavg()]
    # The service's other processes (its loops process): what their periodic jobs take from
    # the cores the serving process shares.
    loops = [p for p in descendants(pid) if p not in worker_pids_]
    before = local_service.cpu_s(pid)
    workers_before = sum(local_service.cpu_s(w) for w in worker_pids_)
    loops_before = sum(_cpu_or_zero(p) for p in loops)
    started = time.monotonic()
    summary = load_process(base, token, trace_path, env, args.protocol)
    wall_s = time.monotonic() - started
    used = local_service.cpu_s(pid) - before
    workers_used = sum(local_service.cpu_s(w) for w in worker_pids_) - workers_before
    loops_used = sum(_cpu_or_zero(p) for p in loops) - loops_before
    answered = int(summary["answered"])
    return {
        "run": n + 1,
        "sent": int(summary["sent"]),
        "answered": answered,
        "errors": int(summary["errors"]),
        "errors_by_kind": dict(summary.get("errors_by_kind") or {}),
        "sustained_qps": answered / float(arrivals[-1]) if arrivals.size else 0.0,
        # Queries answered within the app's SLO a second (loadgen's attainment of those sent):
        # past saturation, what the service still does for its clients.
        "goodput_qps": (
            float(summary["attainment"]) * int(summary["sent"]) / float(arrivals[-1])
            if arrivals.size and summary.get("attainment") is not None
            else None
        ),
        "p50_ms": summary.get("p50_ms"),
        "p99_ms": summary.get("p99_ms"),
        "p99_added_ms": None if summary.get("p99_ms") is None else summary["p99_ms"] - direct_ms,
        "cpu_ms_per_query": 1000.0 * used / max(1, answered),
        "worker_cpu_ms_per_query": 1000.0 * workers_used / max(1, answered),
        "loops_cpu_share": loops_used / wall_s if wall_s > 0 else 0.0,
        "send_lag_p99_ms": summary.get("send_lag_p99_ms"),
        "outside_p99_ms": summary.get("outside_p99_ms"),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its children, theirs, and so on), from ``/proc``'s parent
    ids; empty where ``/proc`` has none."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(entry.name)] = local_service.parent_of(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, its_parent in parents.items() if its_parent == parent]
        found += children
        frontier += children
    return found


def _cpu_or_zero(pid: int) -> float:
    try:
        return local_service.cpu_s(pid)
    except (OSError, IndexError, ValueError):  # gone meanwhile
        return 0.0


def settle(pid: int, worker_pids_: Sequence[int]) -> float:
    """Wait until the service's processes (``pid`` and those below it but the worker agents)
    use under :data:`SETTLE_SHARE` of a core over :data:`SETTLE_WINDOW_S`, at most
    :data:`SETTLE_DEADLINE_S`; the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < SETTLE_DEADLINE_S:
        pids = [pid, *(p for p in descendants(pid) if p not in worker_pids_)]
        before = sum(_cpu_or_zero(p) for p in pids)
        time.sleep(SETTLE_WINDOW_S)
        if sum(_cpu_or_zero(p) for p in pids) - before < SETTLE_SHARE * SETTLE_WINDOW_S:
            break
    return time.monotonic() - start


def calibration_stores(api: httpx.Client, log_path: Path) -> dict[str, int]:
    """What the calibration stored over the service's life, by decision kind (each store a
    decision, repeats counted in one row), and how often the tuner built its sizing ladders
    (``capacity_builds``: its log lines; each store that re-sizes the app builds them again).
    On a steady load these are the calibration's noise: each store changes what the planner,
    admission and the tuner believe."""
    answer = api.get(
        f"/v1/apps/{APP}/decisions",
        params={"kind": ",".join(CALIBRATION_KINDS)},
    )
    answer.raise_for_status()
    stores = dict.fromkeys(CALIBRATION_KINDS, 0)
    for row in answer.json():
        stores[row["kind"]] += int(row.get("count", 1))
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    # "tuner: APP: building plan N's capacity curve" (controlplane.loops.live_tuner)
    stores["capacity_builds"] = text.count("'s capacity curve")
    return stores


def median_spread(values: Sequence[float]) -> dict[str, float]:
    """The median of ``values`` with the smallest and the largest."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure of ``runs`` (``FIGURES`` and the "outside" p99) as its median and spread."""
    summary: dict[str, Any] = {}
    for key in (*FIGURES, "outside_p99_ms"):
        values = [float(r[key]) for r in runs if r[key] is not None]
        summary[key] = median_spread(values) if values else None
    return summary


@contextlib.contextmanager
def floors(
    api: httpx.Client, records: Sequence[Any], modes: Sequence[str], root: Path, env: dict[str, str]
) -> Iterator[dict[str, tuple[str, int]]]:
    """The floor fronts of ``modes`` (:mod:`benchmarks.serving_speed.floor`), each a process of
    its own on the service's worker agents ``records``, answering the app's documents as the
    service does: mode -> (base URL, pid), stopped on the way out."""
    documents = {path: api.get(path).json() for path in (f"/v1/apps/{APP}", f"/v2/models/{APP}")}
    documents_path = root / "floor-documents.json"
    documents_path.write_text(json.dumps(documents), encoding="utf-8")
    addresses = ",".join(record.address for record in records)
    processes: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        for mode in modes:
            port = local_service.free_port()
            log_path = root / f"floor-{mode}.log"
            with log_path.open("wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.serving_speed.floor", "--port", str(port),
                     "--workers", addresses, "--documents", str(documents_path), "--mode", mode],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            base = f"http://127.0.0.1:{port}"
            processes[mode] = (base, process)
            url = f"{base}/v1/apps/{APP}"
            local_service.wait_for(
                f"the floor ({mode})",
                lambda url=url: httpx.get(url, timeout=1.0, trust_env=False).status_code == 200,
                process,
                log_path,
            )
        yield {mode: (base, process.pid) for mode, (base, process) in processes.items()}
    finally:
        for _, process in processes.values():
            process.terminate()
        for _, process in processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def measure(
    rate_qps: float,
    duration_s: float,
    workers: int,
    n_runs: int,
    service_settings: dict[str, str] | None = None,
    protocol: str = "v1",
    floor_modes: Sequence[str] = (),
) -> dict[str, Any]:
    """Start the service and ``workers`` worker agents, run the load ``n_runs`` times over
    ``protocol`` (``v1`` or ``v2``), return the figures (per run, and the median with the spread
    of each) with the load averages and whether the goal is met (``goal_met``: the medians meet
    it). ``service_settings``: more ``HETEROPLANE_*`` settings for the service than the
    benchmark's own."""
    from provisioners.worker import family

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    args = argparse.Namespace(
        rate_qps=rate_qps, duration_s=duration_s, workers=workers, runs=n_runs, protocol=protocol
    )
    load_before = [round(x, 2) for x in os.getloadavg()]
    root = Path(tempfile.mkdtemp(prefix="heteroplane-api-speed-"))
    data_dir = root / "data"
    try:
        local_service.prepare_family(data_dir)
        profile = profile_file(data_dir)
        token = local_service.issue_token(data_dir, "api-speed")
        port = local_service.free_port()
        base = f"http://127.0.0.1:{port}"
        url = loadgen.infer_url(base, APP)
        inputs = family.load_split().validation_inputs
        # The service runs on its defaults but for these: the fleet stays at --workers for the
        # measurement, no scale-down (the tuner would otherwise size it down to the offered
        # rate) and no re-plan on the recorded traffic.
        settings = {
            "HETEROPLANE_TUNER_SCALE_DOWN_DELAY_S": "86400",
            "HETEROPLANE_REPLAN_ENABLED": "false",
            **(service_settings or {}),
        }
        with local_service.serving_api(data_dir, port, token, model=MODEL, settings=settings) as (
            process,
            api,
            log_path,
        ):
            spec = {
                "name": APP,
                "models": [{"name": MODEL, "profiles": str(profile)}],
                "slo": {"latency_ms": 50, "percentile": 99},
                "budget_usd_per_hr": 0.1 * args.workers + 0.05,
                "instance_types": [INSTANCE_TYPE],
                "max_counts": {INSTANCE_TYPE: args.workers},
            }
            api.post("/v1/apps", json=spec).raise_for_status()
            # Planned for more than the workers serve (at most 3,480 q/s each, four
            # queries a call): the planner plans the highest rate the budget (--workers
            # instances) serves, on all of them.
            rate = 3600.0 * args.workers
            preview = api.post(f"/v1/apps/{APP}/plans", json={"rate_qps": rate})
            preview.raise_for_status()
            plan = preview.json()
            api.post(f"/v1/apps/{APP}/plans/{plan['id']}/apply").raise_for_status()
            (stage,) = plan["stages"]
            planned = sum(stage["fleet"].values())
            local_service.log(
                f"plan: {stage['fleet']} at batch {stage['batch_size']},"
                f" for {plan['rate_qps']:,.0f} q/s"
            )

            def running() -> bool:
                rows = api.get("/v1/instances", params={"app": APP}).json()
                return sum(r["state"] == "running" for r in rows) >= planned

            local_service.wait_for("the workers", running, process, log_path)
            probe = json.dumps({"inputs": [inputs[0].astype(int).tolist()]})
            local_service.wait_for(
                "an answer",
                lambda: api.post(url, content=probe, headers=JSON).status_code == 200,
                process,
                log_path,
            )
            records = worker_records(data_dir)
            direct = direct_p99_ms(records[0], inputs)
            local_service.log(f"straight to a worker: p99 {direct:.2f} ms")
            workers = [record.pid for record in records if record.pid is not None]
            settled_s = settle(process.pid, workers)
            local_service.log(f"the service quiet after {settled_s:.0f} s")
            env = local_service.clean_env()
            runs = []
            floor_runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in floor_modes}
            with floors(api, records, floor_modes, root, env) as fronts:
                for n in range(args.runs):
                    run = one_run(args, n, base, token, process.pid, workers, root, env, direct)
                    runs.append(run)
                    local_service.log(json.dumps(run))
                    # The same trace (the run's seed) through each floor, straight after.
                    for mode, (floor_base, floor_pid) in fronts.items():
                        floor_run = one_run(
                            args, n, floor_base, token, floor_pid, workers, root, env, direct
                        )
                        floor_runs[mode].append(floor_run)
                        local_service.log(f"floor {mode}: {json.dumps(floor_run)}")
            stores = calibration_stores(api, log_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "protocol": protocol,
        "rate_qps": args.rate_qps,
        "duration_s": args.duration_s,
        "workers": args.workers,
        "direct_p99_ms": direct,
        "settled_s": settled_s,
        "runs": runs,
        "calibration_stores": stores,
        "service_settings": dict(service_settings or {}),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    result.update(summarise_runs(runs))
    result["floor"] = {
        mode: {**summarise_runs(mode_runs), "runs": mode_runs}
        for mode, mode_runs in floor_runs.items()
    }
    lag = [float(r["send_lag_p99_ms"]) for r in runs if r["send_lag_p99_ms"] is not None]
    result["send_lag_p99_ms"] = median_spread(lag) if lag else None
    result["loadgen_kept_up"] = bool(lag) and statistics.median(lag) <= LAG_LIMIT_MS
    sustained = result["sustained_qps"]["median"] if result["sustained_qps"] else 0.0
    added = result["p99_added_ms"]["median"] if result["p99_added_ms"] else float("inf")
    result["goal_met"] = sustained >= GOAL_QPS * 0.99 and added <= GOAL_ADDED_MS
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_speed api", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rate-qps", type=float, default=GOAL_QPS)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--protocols",
        default=",".join(PROTOCOLS),
        help="the routes to measure, in turn: v1, v2 or both (default %(default)s)",
    )
    parser.add_argument(
        "--service-setting",
        action="append",
        default=[],
        metavar="HETEROPLANE_X=V",
        help="one more setting for the service (repeatable), e.g. HETEROPLANE_RECONCILE_S=1",
    )
    parser.add_argument(
        "--floor",
        default="",
        metavar="MODE[,MODE]",
        help="after each run, the same trace through the floor front of each MODE (forward,"
        " answer; benchmarks/serving_speed/floor.py) on the same workers (default: none)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not (args.rate_qps > 0 and args.duration_s > 0 and args.workers >= 1 and args.runs >= 1):
        parser.error("--rate-qps, --duration-s > 0; --workers, --runs >= 1")
    protocols = [part.strip() for part in args.protocols.split(",") if part.strip()]
    if not protocols or any(p not in PROTOCOLS for p in protocols):
        parser.error(f"--protocols: one or more of {', '.join(PROTOCOLS)}, got {args.protocols!r}")
    floor_modes = [part.strip() for part in args.floor.split(",") if part.strip()]
    if any(mode not in FLOOR_MODES for mode in floor_modes):
        parser.error(f"--floor: one or more of {', '.join(FLOOR_MODES)}, got {args.floor!r}")
    settings = {}
    for item in args.service_setting:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("HETEROPLANE_"):
            parser.error(f"--service-setting: expected HETEROPLANE_NAME=VALUE, got {item!r}")
        settings[key] = value
    results = {
        protocol: measure(
            args.rate_qps, args.duration_s, args.workers, args.runs, settings, protocol, floor_modes
        )
        for protocol in protocols
    }
    met = all(result["goal_met"] for result in results.values())
    if args.json:
        print(json.dumps({"protocols": results, "goal_met": met}, indent=2))
        return 0 if met else 1
    for protocol, result in results.items():
        print(f"/{protocol}:")
        for key in (*FIGURES, "send_lag_p99_ms", "outside_p99_ms"):
            v = result[key]
            if v is not None:
                print(f"{key:>18}: {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})")
        for mode, floor in result["floor"].items():
            for key in ("p99_ms", "p99_added_ms", "cpu_ms_per_query", "outside_p99_ms"):
                v = floor[key]
                if v is not None:
                    label = f"floor {mode} {key}"
                    print(f"{label:>18}: {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})")
        stores = ", ".join(f"{k} {v}" for k, v in result["calibration_stores"].items())
        print(f"{'calibration':>18}: {stores} (over the service's life)")
        loads = ", ".join(f"{r['loadavg_before'][0]:.2f}" for r in result["runs"])
        print(f"{'load average 1 min':>18}: {loads} (at each run's start)")
        behind = "" if result["loadgen_kept_up"] else " (the load generator fell behind)"
        verdict = "met" if result["goal_met"] else "NOT met"
        print(
            f"goal >= {GOAL_QPS:g} q/s at <= {GOAL_ADDED_MS:g} ms added p99 on /{protocol}:"
            f" {verdict}{behind}"
        )
    return 0 if met else 1
