"""A picture of the dashboard at 1280x800 in headless Chromium (``docs/dashboard.png`` is one).

    .venv/bin/python benchmarks/dashboard_screenshot.py [--out FILE] [--url URL [--token T]]

It writes ``--out`` (default: ``heteroplane-dashboard.png`` in the temporary directory, so that
the tracked ``docs/dashboard.png`` changes only when asked: ``--out docs/dashboard.png``).

``--url URL`` photographs a service that runs already (``make demo``, say), signing in with
``--token`` (default ``$HETEROPLANE_TOKEN``; a viewer, operator or admin token) and showing
``--app`` (default: the dashboard's first app) over ``--window-s`` (default 30 min).

Without ``--url`` it runs the demo (``heteroplane demo`` in a temporary home, as a user would: the
demo family trained and profiled, the cascade app registered and planned, its local workers
launched, the demo load running), makes a viewer token with ``heteroplane token create``, waits
until the dashboard shows traffic and then ``--settle-s`` more seconds so that the charts have a
shape, signs in, and saves the first screen once every panel has drawn, the charts spanning the
demo's life (``--window-s`` another span). The demo's workers outlive the demo by design;
they are stopped at the end.

``--scripted`` makes a picture that is the same on every machine, without the demo: in a
temporary data directory it registers ``examples/rm2.yaml`` (the Kairos setting: rm2 on the
Kairos authors' samples, a 350 ms P99 SLO, $10/hr, four EC2 types), plans it for 60 qps (the
planner on a Poisson trace with the Kairos batch mix) and applies the plan, then writes a
scripted history through the store with back-dated times: the plan's instances booting, a load
surge from 52 to 92 qps that the tuner meets with two scale-ups (and, for a cascade app, a gear
switch while the new instances boot), a budget cut from $10 to $6/hr, a scale-down once the
surge is over and a replan that keeps the plan; one metric sample every 10 s (the arrival rate,
the fleet's cost, P50/P95/P99 from a queueing-shaped model of the load against the capacity, the
attainment). It serves that with ``heteroplane serve`` (the fake provisioner; the reconcile and
roll-up jobs held off for the run, so that the script stays as written). Everything the
dashboard derives (the fleet over time, capacity, spend and forecast, the plan's bound ranking)
is computed by the service as for real data.

Needs ``/usr/bin/chromium`` (Debian's ``chromium``) and Playwright for Python (``pip install
playwright``; its own browser downloads are not used); the demo needs the ``worker`` extra
(torch, scikit-learn), ``--scripted`` the shared Kairos samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import yaml

from controlplane.apps.plans import PlanRequest, TraceRequest, planning_trace
from controlplane.apps.resolver import AppResolver, smallest_common_batch_size, spec_document
from controlplane.db.store import Store
from controlplane.policies.drain import qps_by_type
from controlplane.policies.planner import HEADROOM, plan_app
from controlplane.settings import Settings
from controlplane.spec import ResolvedApp

try:  # imported as benchmarks.dashboard_screenshot
    from benchmarks import local_service
    from benchmarks.paths import kairos_samples
except ModuleNotFoundError:  # run as a script: benchmarks/ is on sys.path
    import local_service
    from paths import kairos_samples

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "examples" / "rm2.yaml"
APP = "rm2-kairos"
# What ``heteroplane demo`` plans its app for (controlplane.service.demo).
PLANNED_RATE_QPS = 60.0
PLANNED_BATCH_DIST = "kairos"
DEFAULT_OUT = Path(tempfile.gettempdir()) / "heteroplane-dashboard.png"
DEFAULT_PROFILES = kairos_samples()  # $HETEROPLANE_SHARED or ../shared
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
START_DEADLINE_S = 120.0
# The demo trains and profiles its model family before it serves (a minute or two, once).
DEMO_START_DEADLINE_S = 900.0
TRAFFIC_DEADLINE_S = 300.0
DEMO_SETTLE_S = 150.0
# Timed runs per model and batch size when the demo profiles its family (the demo's default is
# 30; the picture does not need the precision).
DEMO_PROFILE_SAMPLES = 5
STOP_DEADLINE_S = 30.0
DRAW_DEADLINE_S = 30.0
HISTORY_S = 34 * 60.0
SAMPLE_S = 10.0
# The jobs that would write over the script: held off for longer than the screenshot takes.
HELD_S = "86400"
SEED = 7


# --- the scripted history --------------------------------------------------------------------


@dataclass
class Machine:
    """One scripted instance: its type, price, and when it moved to each state."""

    instance_type: str
    price_usd_per_hr: float
    moves: list[tuple[datetime, str, str]] = field(default_factory=list)

    def state_at(self, at: datetime) -> str | None:
        state = None
        for when, to_state, _ in self.moves:
            if when <= at:
                state = to_state
        return state


@dataclass
class Script:
    """The history being written: the instances so far, and what the fleet serves."""

    store: Store
    resolved: ResolvedApp
    plan_capacity_qps: float
    plan_value: float
    value_qps: dict[str, float]
    machines: list[Machine] = field(default_factory=list)

    def launch(self, instance_type: str, at: datetime, boot_s: float) -> Machine:
        price = self.resolved.prices_usd_per_hr[instance_type]
        machine = Machine(instance_type, price)
        machine.moves = [
            (at, "requested", "launch requested"),
            (at + timedelta(seconds=12), "pending", "the provider launched it"),
            (at + timedelta(seconds=boot_s), "running", "its worker answers the health probe"),
        ]
        self.machines.append(machine)
        return machine

    def retire(self, machine: Machine, at: datetime) -> None:
        machine.moves += [
            (at, "draining", "scale down: no new queries"),
            (at + timedelta(seconds=25), "terminating", "drained"),
            (at + timedelta(seconds=70), "terminated", "the provider terminated it"),
        ]

    def running(self, at: datetime) -> list[Machine]:
        return [m for m in self.machines if m.state_at(at) == "running"]

    def cost_usd_per_hr(self, at: datetime) -> float:
        live = ("requested", "pending", "running", "draining", "terminating")
        return sum(m.price_usd_per_hr for m in self.machines if m.state_at(at) in live)

    def capacity_qps(self, at: datetime) -> float:
        value = sum(self.value_qps[m.instance_type] for m in self.running(at))
        return self.plan_capacity_qps * value / self.plan_value

    def write_instances(self) -> None:
        for n, machine in enumerate(self.machines, start=1):
            first_at, first_state, first_reason = machine.moves[0]
            record = self.store.record_instance(
                APP,
                request_id=f"{APP}-script-{n}",
                instance_type=machine.instance_type,
                price_usd_per_hr=machine.price_usd_per_hr,
                state=first_state,
                reason=first_reason,
                at=first_at,
            )
            for when, to_state, reason in machine.moves[1:]:
                provider_id = f"fake-{n:08d}" if to_state == "pending" else None
                self.store.transition_instance(
                    record.id, to_state, reason=reason, provider_id=provider_id, at=when
                )


def arrival_qps(minutes_before: float, rng: np.random.Generator) -> float:
    """The scripted load: 52 qps, a surge to 92 qps from 21 to 9 minutes ago, back to 60."""
    shape = [(34.0, 52.0), (21.0, 52.0), (15.0, 92.0), (9.0, 92.0), (5.0, 60.0), (0.0, 58.0)]
    for (m0, r0), (m1, r1) in itertools.pairwise(shape):
        if m1 <= minutes_before <= m0:
            share = (m0 - minutes_before) / (m0 - m1)
            rate = r0 + (r1 - r0) * share
            return max(0.0, rate * (1.0 + 0.04 * float(rng.standard_normal())))
    return 52.0


def write_history(store: Store, resolved: ResolvedApp, now: datetime) -> None:
    """The scripted half hour before ``now`` (see the module docstring)."""
    rng = np.random.default_rng(SEED)
    start = now - timedelta(seconds=HISTORY_S)
    spec = resolved.spec
    store.create_app(spec_document(spec), who="ops", at=start)

    request = PlanRequest(
        trace=TraceRequest(rate_qps=PLANNED_RATE_QPS, batch_dist=PLANNED_BATCH_DIST)
    )
    trace, stats = planning_trace(resolved, request)
    plan = plan_app(resolved, trace, seed=request.seed)
    document = dataclasses.replace(plan, seed=request.seed, trace=stats).to_document()
    previewed = store.create_plan(APP, document, at=start + timedelta(seconds=40))
    applied_at = start + timedelta(seconds=75)
    applied = store.apply_plan(APP, previewed.id, at=applied_at)
    fleet = {t: n for stage in plan.stages for t, n in stage.fleet.items() if n}
    store.record_decision(
        APP,
        "plan_applied",
        f"plan {applied.id} applied by ops",
        {"plan_id": applied.id, "cost_usd_per_hr": plan.cost_usd_per_hr, "fleet": fleet},
        at=applied_at,
    )

    value_qps = qps_by_type(resolved, smallest_common_batch_size(resolved))
    plan_capacity = min(s.throughput_qps / (s.scale_factor or 1.0) for s in plan.stages)
    script = Script(
        store,
        resolved,
        plan_capacity,
        sum(value_qps[t] * n for t, n in fleet.items()),
        value_qps,
    )
    for instance_type, count in sorted(fleet.items()):
        for _ in range(count):
            boot_s = 95.0 if instance_type.startswith("g") else 70.0
            script.launch(instance_type, applied_at + timedelta(seconds=3), boot_s)

    # The tuner adds the most cost-effective type until the capacity covers the live rate.
    best = max(fleet, key=lambda t: value_qps[t] / resolved.prices_usd_per_hr[t])
    added: list[Machine] = []
    cascade = spec.cascade is not None
    for minutes, rate in ((18.5, 78.0), (15.5, 93.0)):
        at = now - timedelta(minutes=minutes)
        before = script.capacity_qps(at)
        count = 0
        while script.capacity_qps(at) + count * _capacity_of(script, best) < rate:
            count += 1
        for _ in range(count):
            added.append(script.launch(best, at, 70.0))
        after = before + count * _capacity_of(script, best)
        store.record_decision(
            APP,
            "scale_up",
            f"the 10 s envelope is at {rate:.0f} qps, above the planned"
            f" {plan.planned_rate_qps:.0f} qps: add {count} x {best}",
            {
                "window_s": 10.0,
                "live_rate_qps": rate,
                "planned_rate_qps": round(plan.planned_rate_qps, 1),
                "add": {best: count},
                "capacity_qps": round(after, 1),
                "fleet_cost_usd_per_hr": round(script.cost_usd_per_hr(at), 3),
            },
            at=at,
        )
        if cascade and minutes == 18.5:
            store.record_decision(
                APP,
                "gear_switch",
                "the new instances are booting: switch to the faster gear meanwhile",
                {"from": "accurate", "to": "fast", "qps": rate, "capacity_share": 0.8},
                at=at + timedelta(seconds=5),
            )
    budget_at = now - timedelta(minutes=12)
    store.change_budget(APP, 6.0, reason="trim the monthly spend", who="ops", at=budget_at)
    down_at = now - timedelta(minutes=6)
    rate_then = 62.0
    retired: list[Machine] = []
    for machine in reversed(added):
        without = script.capacity_qps(down_at) - _capacity_of(script, best) * (len(retired) + 1)
        if without < rate_then:
            break
        retired.append(machine)
    for machine in retired:
        script.retire(machine, down_at)
    store.record_decision(
        APP,
        "scale_down",
        f"the recent envelope stayed below the planned one for 15 s: drain {len(retired)} x {best}",
        {
            "recent_rate_qps": rate_then,
            "remove": {best: len(retired)},
            "fleet_cost_usd_per_hr": round(
                script.cost_usd_per_hr(down_at) - len(retired) * resolved.prices_usd_per_hr[best],
                3,
            ),
        },
        at=down_at,
    )
    if cascade:
        store.record_decision(
            APP,
            "gear_switch",
            "capacity is back: the accurate gear again",
            {"from": "fast", "to": "accurate", "qps": 88.0, "capacity_share": 1.0},
            at=now - timedelta(minutes=14.5),
        )
    store.record_decision(
        APP,
        "replan",
        f"the last 6 h peaked at 92 qps, within plan {applied.id}'s bound x headroom: plan kept",
        {"peak_qps": 92.4, "plan_id": applied.id, "kept": True},
        at=now - timedelta(minutes=2),
    )
    script.write_instances()
    _write_samples(store, script, spec.slo.latency_ms, plan.stages[0].predicted_p99_ms, now, rng)


def _capacity_of(script: Script, instance_type: str) -> float:
    return script.plan_capacity_qps * script.value_qps[instance_type] / script.plan_value


def _write_samples(
    store: Store,
    script: Script,
    slo_ms: float,
    planned_p99_ms: float,
    now: datetime,
    rng: np.random.Generator,
) -> None:
    """One sample every 10 s: latency grows with the utilisation u as an M/M/1-like 1 / (1 - u)
    would, scaled so that the planned load sits at the plan's predicted P99. The capacity is
    the rate the plan serves within the SLO; the fleet saturates at capacity / headroom (the
    planner sizes mixes whose Kairos bound x 0.7 covers the peak), so u = 0.7 x rate /
    capacity."""
    cascade = script.resolved.spec.cascade is not None
    first = now - timedelta(seconds=HISTORY_S - 120.0)
    u_plan = min(0.9, HEADROOM * PLANNED_RATE_QPS / script.plan_capacity_qps)
    at = first
    while at <= now:
        minutes_before = (now - at).total_seconds() / 60.0
        rate = arrival_qps(minutes_before, rng)
        capacity = script.capacity_qps(at)
        u = min(0.97, HEADROOM * rate / capacity) if capacity > 0 else 0.97
        factor = (1.0 - u_plan) / (1.0 - u)
        jitter = math.exp(0.05 * float(rng.standard_normal()))
        p99 = planned_p99_ms * factor**0.8 * jitter
        p95 = p99 * 0.78
        p50 = p99 * 0.42
        attainment = max(0.0, min(1.0, 1.0 - 0.01 * (p99 / slo_ms) ** 6))
        gear = accuracy = None
        if cascade:
            fast = 14.5 <= minutes_before <= 18.5
            gear = "fast" if fast else "accurate"
            accuracy = (0.952 if fast else 0.971) + 0.002 * float(rng.standard_normal())
        store.add_metric_sample(
            APP,
            arrival_rate_qps=rate,
            fleet_cost_usd_per_hr=script.cost_usd_per_hr(at),
            latency_p50_ms=p50,
            latency_p95_ms=p95,
            latency_p99_ms=p99,
            attainment_share=attainment,
            gear=gear,
            accuracy=accuracy,
            at=at,
        )
        at += timedelta(seconds=SAMPLE_S)


# --- serving and the browser -----------------------------------------------------------------


def serve(data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = local_service.clean_env(
        HOME=str(data_dir.parent),
        HETEROPLANE_DATA_DIR=str(data_dir),
        HETEROPLANE_PROVISIONER="fake",
        HETEROPLANE_RECONCILE_S=HELD_S,
        HETEROPLANE_ROLLUP_S=HELD_S,
    )
    with log.open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def screenshot(
    url: str,
    token: str,
    out: Path,
    size: tuple[int, int],
    profile: Path,
    full_page: bool,
    query: str = "",
) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": size[0], "height": size[1]},
            timezone_id="UTC",
            locale="en-US",
        )
        messages: list[str] = []
        try:
            page = context.new_page()
            page.on("console", lambda message: messages.append(f"{message.type}: {message.text}"))
            page.on("pageerror", lambda error: messages.append(f"page error: {error}"))
            page.goto(f"{url}/dashboard")
            page.fill("#token", token)
            page.click("#login-button")
            page.wait_for_selector("#panel-fleet")
            if query:
                page.goto(f"{url}/dashboard?{query}")
            for panel in ("fleet", "cost", "load", "latency", "cascade", "decisions", "plan"):
                page.wait_for_selector(
                    f'[data-panel="{panel}"]:not([data-state="loading"])',
                    timeout=DRAW_DEADLINE_S * 1000,
                )
            page.wait_for_selector("#plan-ranking table", timeout=DRAW_DEADLINE_S * 1000)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=full_page)
        except Exception:
            print("\n".join(["the page said:", *messages]), file=sys.stderr)
            raise
        finally:
            context.close()


def stop_workers(state_dir: Path) -> None:
    """Terminate the local workers the demo launched (they outlive the demo by design)."""
    if not state_dir.is_dir():
        return
    from provisioners.local import LocalProvisioner

    provisioner = LocalProvisioner(state_dir, {}, ["tiny"], None)
    try:
        provisioner.terminate([r.provider_id for r in provisioner.records()])
    finally:
        provisioner.close()


def wait_for_traffic(url: str, token: str) -> None:
    """Until the dashboard's data show load and latency (the demo load's first answers)."""
    deadline = time.monotonic() + TRAFFIC_DEADLINE_S
    headers = {"Authorization": f"Bearer {token}"}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{url}/dashboard/data", headers=headers, timeout=30.0)
        snap = answer.json().get("snapshot") if answer.status_code == 200 else None
        if snap and snap["load"]["has_traffic"] and snap["latency"]["has_data"]:
            return
        time.sleep(2.0)
    raise SystemExit(f"no traffic on the dashboard after {TRAFFIC_DEADLINE_S:g} s")


def run_demo(args: argparse.Namespace, root: Path) -> None:
    home = root / "home"
    data_dir = home / ".local" / "share" / "heteroplane"
    data_dir.mkdir(parents=True)
    port = local_service.free_port()
    url = f"http://127.0.0.1:{port}"
    env = local_service.clean_env(HOME=str(home), HETEROPLANE_DATA_DIR=str(data_dir))
    log = root / "demo.log"
    command = [sys.executable, "-m", "controlplane", "demo", "--port", str(port)]
    command += ["--profile-samples", str(DEMO_PROFILE_SAMPLES)]
    print("starting the demo (training and profiling the family first) ...", file=sys.stderr)
    with log.open("ab") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=sink)
    try:
        local_service.wait_ready(url, process, log, DEMO_START_DEADLINE_S)
        ready_at = time.monotonic()
        create = ["token", "create", "--scope", "viewer", "--name", "dashboard"]
        made = subprocess.run(
            [sys.executable, "-m", "controlplane", *create],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        token = made.stdout.strip()
        wait_for_traffic(url, token)
        print(f"traffic flows; {args.settle_s:g} s more for the charts ...", file=sys.stderr)
        time.sleep(args.settle_s)
        profile = root / "chromium"
        profile.mkdir()
        # By default the charts span the demo's life so far (the time before it is blank).
        window_s = args.window_s or 60 * math.ceil((time.monotonic() - ready_at + 30) / 60)
        query = f"app=demo&window_s={window_s}"
        size = (args.width, args.height)
        screenshot(url, token, args.out, size, profile, args.full_page, query)
    finally:
        local_service.stop(process, STOP_DEADLINE_S)
        stop_workers(data_dir / "workers")


def run_against(args: argparse.Namespace, root: Path) -> None:
    """The dashboard of the service at ``--url``, as it is now."""
    token = args.token or os.environ.get("HETEROPLANE_TOKEN")
    if not token:
        raise SystemExit("--url needs a token: --token T or $HETEROPLANE_TOKEN")
    url = args.url.rstrip("/")
    try:
        httpx.get(f"{url}/healthz", timeout=10.0).raise_for_status()
    except httpx.HTTPError as error:
        raise SystemExit(f"no heteroplane service answers at {url}: {error}") from None
    query = urllib.parse.urlencode(
        {k: v for k, v in (("app", args.app), ("window_s", args.window_s)) if v is not None}
    )
    profile = root / "chromium"
    profile.mkdir()
    screenshot(url, token, args.out, (args.width, args.height), profile, args.full_page, query)


def run_scripted(args: argparse.Namespace, root: Path) -> None:
    profiles: Path = args.profiles.resolve()
    if not profiles.is_file():
        raise SystemExit(f"no profiles at {profiles} (--profiles FILE)")
    data_dir = root / "home" / "data"
    settings = Settings(data_dir=data_dir, provisioner="fake")
    settings.ensure_data_dir()
    store = Store.from_url(settings.database_url, upgrade=True)
    try:
        document = yaml.safe_load(SPEC.read_text())
        document["models"][0]["profiles"] = str(profiles)
        resolved = AppResolver(data_dir).check(document)
        now = datetime.now(UTC).replace(microsecond=0)
        print("writing the scripted history ...", file=sys.stderr)
        write_history(store, resolved, now)
        token = store.create_token("viewer", name="dashboard")
    finally:
        store.close()
    port = local_service.free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "serve.log"
    process = serve(data_dir, port, log)
    try:
        local_service.wait_ready(url, process, log, START_DEADLINE_S)
        profile = root / "chromium"
        profile.mkdir()
        size = (args.width, args.height)
        screenshot(url, token, args.out, size, profile, args.full_page)
    finally:
        local_service.stop(process, STOP_DEADLINE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the PNG to write (default {DEFAULT_OUT})"
    )
    parser.add_argument("--url", help="photograph the service that runs at this base URL")
    parser.add_argument("--token", help="--url: the token to sign in with ($HETEROPLANE_TOKEN)")
    parser.add_argument("--app", help="--url: the app to show (default: the first)")
    parser.add_argument(
        "--scripted", action="store_true", help="a scripted history instead of the demo"
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        default=DEFAULT_PROFILES,
        help="the Kairos samples CSV (--scripted)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=DEMO_SETTLE_S,
        help=f"seconds of demo load after the first answers (default {DEMO_SETTLE_S:g})",
    )
    parser.add_argument(
        "--window-s",
        type=int,
        default=None,
        help="the span of the charts, demo (default: since the demo started, whole minutes)",
    )
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument(
        "--full-page", action="store_true", help="the whole page, not just the first screen"
    )
    args = parser.parse_args(argv)
    if not CHROMIUM.exists():
        raise SystemExit(f"no {CHROMIUM}: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="heteroplane-shot-") as folder:
        if args.url is not None:
            run_against(args, Path(folder))
        elif args.scripted:
            run_scripted(args, Path(folder))
        else:
            run_demo(args, Path(folder))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
