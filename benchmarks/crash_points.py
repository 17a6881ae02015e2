"""Crash points: ``heteroplane serve`` (SQLite, local provisioner) SIGKILLed at each named point of
each long operation, restarted, and checked for what a crash must not leave behind.

    .venv/bin/python benchmarks/crash_points.py [--points P,...] [--keep DIR]

For each point of :data:`controlplane.crashpoints.POINTS` (or those given), on a fresh data
directory: the service starts with ``HETEROPLANE_CRASH_AT=<point>`` and the app's life runs
through the API in order (:data:`OPERATIONS`: push an ONNX model, register the app, profile it,
plan and apply, roll a second version of the model out, lower the budget, take it down) until
the service kills itself at the point. It is started again without the hook and, polled until
they hold (within :data:`SETTLE_S`), the checks of the crash guarantees (docs/operations.md,
"Crash guarantees"):

- ``orphans``: live worker processes without a live row in the database;
- ``rowless``: live rows (``pending``, ``running``) whose worker process is not running;
- ``stale``: kept rows of profile workers whose run died with the service (reaped by the
  reconciler after four missed heartbeats);
- ``excess_usd_per_hr``: what the live workers cost above the app's budget;
- ``leftovers``: staged uploads, blob temporaries and model inspectors left by the dead service;
- ``outcome``: the interrupted operation is ``done`` or ``not done`` (cleanly: nothing of it
  half there), then it is run again and must succeed (``redo``), and the rest of the app's life
  after it (``--no-finish`` skips that).

Prints one row per point and exits 1 if any check failed. ``tests/integration/
test_crash_points.py`` runs a few points the same way in CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

try:  # imported as benchmarks.crash_points
    from benchmarks.local_service import (
        clean_env,
        family_onnx,
        free_port,
        issue_token,
        stop,
        stop_workers,
    )
except ModuleNotFoundError:  # run as a script: the sibling module
    from local_service import (  # type: ignore[no-redef]
        clean_env,
        family_onnx,
        free_port,
        issue_token,
        stop,
        stop_workers,
    )

from controlplane.apps.teardown import teardown_requested
from controlplane.crashpoints import CRASH_AT_ENV, POINTS
from controlplane.db.store import Store
from controlplane.policies.lifecycle import KEPT_STATES, InstanceState, is_profile_worker
from controlplane.policies.rollout import ACTIVE_STATES
from controlplane.provisioning import LOCAL_WORKERS_DIR
from controlplane.registry.inspection import running_inspectors
from controlplane.registry.registry import REGISTRY_DIR, STAGING_PREFIX
from estimator.catalog import default_catalog

ROOT = Path(__file__).resolve().parents[1]
APP = "crash-app"
MODEL = "clf"
TYPES = ("emu.cpu.small", "emu.cpu.large")
BUDGET_USD_PER_HR = 0.4
LOWERED_USD_PER_HR = 0.06  # one emu.cpu.small: the budget change drains the rest
START_S = 60.0
SETTLE_S = 60.0
REQUEST_S = 120.0
# Fast loops, so that a restarted service settles within seconds.
SETTINGS = {
    "HETEROPLANE_RECONCILE_S": "0.5",
    "HETEROPLANE_PROFILE_RUN_HEARTBEAT_S": "0.5",
    "HETEROPLANE_DISRUPTION_MAX_SHARE": "1",
}
_LIVE_ROWS = (InstanceState.PENDING.value, InstanceState.RUNNING.value)
ROLLOUT_ACTIVE = frozenset(state.value for state in ACTIVE_STATES)
# A rollout's workers' request ids start with this (their rollout loop owns them).
ROLLOUT_WORKERS = f"profile:rollout-{APP}-"
_KEPT_ROWS = frozenset(s.value for s in KEPT_STATES)


# --- the service -------------------------------------------------------------------------------


# What starts a service's process: subprocess.Popen, or a callable taking its arguments that
# returns what answers as one (the tests fork it from a process that has imported the service:
# tests/serve_forks.py).
Launch = Callable[..., Any]


class Service:
    """``heteroplane serve`` on ``data_dir`` (local provisioner), optionally crash-hooked."""

    def __init__(
        self,
        data_dir: Path,
        token: str,
        crash_at: str | None = None,
        launch: Launch = subprocess.Popen,
    ) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = clean_env(
            HETEROPLANE_DATA_DIR=str(data_dir), HETEROPLANE_PROVISIONER="local", **SETTINGS
        )
        if crash_at is not None:
            env[CRASH_AT_ENV] = crash_at
        self.log_path = data_dir / f"serve-{'crash' if crash_at else 'after'}.log"
        self._log = self.log_path.open("ab")
        self.process = launch(
            [sys.executable, "-m", "controlplane", "serve", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=REQUEST_S
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            try:
                if self.client.get("/healthz", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            try:
                code = self.process.wait(timeout=0.2)  # the pause between polls
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"serve exited with {code}: {self.log_path.read_text()[-2000:]}")
        raise RuntimeError(f"serve not ready in {START_S:g} s")

    @property
    def dead(self) -> bool:
        return self.process.poll() is not None

    def close(self) -> None:
        self.client.close()
        stop(self.process)
        self._log.close()


class ServiceCrashedError(Exception):
    """The service died during a request (at its crash point)."""


def call(service: Service, method: str, url: str, ok: Sequence[int], **kwargs: Any) -> Any:
    """One API call; :class:`ServiceCrashedError` when the service died meanwhile."""
    try:
        response = service.client.request(method, url, **kwargs)
    except httpx.TransportError:
        service.process.wait(timeout=30)
        raise ServiceCrashedError from None
    if response.status_code not in ok:
        if service.dead:
            raise ServiceCrashedError
        raise RuntimeError(f"{method} {url}: {response.status_code} {response.text[:300]}")
    return response.json() if response.content else None


def until(what: str, service: Service, check: Callable[[], Any], deadline_s: float = 180.0) -> Any:
    """Poll ``check`` until it returns something true; :class:`ServiceCrashedError` if the
    service dies."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if service.dead:
            raise ServiceCrashedError
        try:
            found = check()
        except httpx.TransportError:
            found = None
        if found:
            return found
        time.sleep(0.2)
    if service.dead:
        raise ServiceCrashedError
    raise RuntimeError(f"{what}: not within {deadline_s:g} s")


# --- the app's life ----------------------------------------------------------------------------


def push(service: Service, model_file: Path) -> None:
    """A push; run again after a crash that left the version in, it answers that one (200)."""
    call(
        service,
        "POST",
        f"/v1/models/{MODEL}?format=onnx",
        (200, 201),
        content=model_file.read_bytes(),
    )


def register(service: Service) -> None:
    spec = {
        "name": APP,
        "models": [{"name": MODEL, "artifact": MODEL}],
        "slo": {"latency_ms": 500},
        "budget_usd_per_hr": BUDGET_USD_PER_HR,
        "instance_types": list(TYPES),
    }
    if any(a["name"] == APP for a in call(service, "GET", "/v1/apps", (200,))):
        return
    call(service, "POST", "/v1/apps", (201,), json=spec)


def profile(service: Service) -> None:
    body = {"batch_sizes": [1, 2], "samples": 2, "warmup": 0}
    call(service, "POST", f"/v1/apps/{APP}/profiles", (200,), json=body)


def plan_apply(service: Service) -> None:
    plan = call(service, "POST", f"/v1/apps/{APP}/plans", (201,), json={"rate_qps": 20})
    call(service, "POST", f"/v1/apps/{APP}/plans/{plan['id']}/apply", (200,))

    def serving() -> bool:
        rows = call(service, "GET", "/v1/instances", (200,), params={"app": APP})
        return any(r["state"] == "running" for r in rows)

    until("a running instance", service, serving)


def rollout(service: Service, model_file: Path) -> None:
    """Version 2 of the model (the same weights saved again) moves into the app: a rollout of two
    steps (50 %, 100 %) judged on a few queries each, promoted, and handed over (its workers
    gone). Run again after a crash it carries on the rollout the database holds (a new leader's
    loop resumes it) rather than start another."""
    path = f"/v1/apps/{APP}/rollouts"
    counter = iter(range(10**9))

    def latest() -> dict[str, Any] | None:
        found = call(service, "GET", path, (200,))
        return found[-1] if found else None

    current = latest()
    spec = call(service, "GET", f"/v1/apps/{APP}", (200,))["spec"]
    pinned = spec["models"][0]["artifact"] == f"{MODEL}@2"
    if not pinned and (current is None or current["state"] not in ROLLOUT_ACTIVE):
        if len(call(service, "GET", f"/v1/models/{MODEL}", (200,))["versions"]) < 2:
            again = model_file.with_name(f"{model_file.stem}-2.onnx")
            push(service, family_onnx(again, doc_string="version 2"))
        body = {
            "model": f"{MODEL}@2",
            "steps": [0.5, 1.0],
            "interval_s": 1,
            # Judged on a few queries for crash safety, not speed: a shared machine's one slow
            # query (a cold worker's first, say) must not roll the version back.
            "thresholds": {"min_queries": 3, "max_p99_ms": 60_000},
        }
        call(service, "POST", path, (201,), json=body)

    def promoted() -> bool:
        # Queries of their own ids, so that both versions answer some at 50 %.
        headers = {"X-Request-Id": f"crash-{next(counter)}"}
        query = {"inputs": [[0.5] * 64]}
        call(service, "POST", f"/v1/apps/{APP}/infer", (200,), json=query, headers=headers)
        found = latest()
        if found is not None and found["state"] in ("rolled_back", "aborted"):
            raise RuntimeError(f"the rollout ended {found['state']}: {found['reason']}")
        return found is not None and found["state"] == "promoted"

    until("the rollout promoted", service, promoted)

    def handed_over() -> bool:
        rid = (latest() or {}).get("id")
        params = {"kind": "rollout"}
        decisions = call(service, "GET", f"/v1/apps/{APP}/decisions", (200,), params=params)
        return any(d["reason"].startswith(f"rollout {rid}: handover done") for d in decisions)

    until("the rollout's handover", service, handed_over)


def lower_budget(service: Service) -> None:
    body = {"budget_usd_per_hr": LOWERED_USD_PER_HR, "reason": "crash test", "force": True}
    call(service, "PUT", f"/v1/apps/{APP}/budget", (200,), json=body)

    def within() -> bool:
        found = call(service, "GET", f"/v1/apps/{APP}/budget", (200,))
        return bool(found["fleet_cost_usd_per_hr"] <= LOWERED_USD_PER_HR + 1e-9)

    until("the fleet within the lowered budget", service, within)


def app_down(service: Service) -> None:
    call(service, "DELETE", f"/v1/apps/{APP}?drain=true", (202, 204, 404))

    def gone() -> bool:
        response = service.client.get(f"/v1/apps/{APP}")
        return response.status_code == 404

    until("the app gone", service, gone)


@dataclass(frozen=True)
class Operation:
    name: str
    run: Callable[[Service, Path], None]


OPERATIONS: tuple[Operation, ...] = (
    Operation("model push", lambda s, f: push(s, f)),
    Operation("register", lambda s, _f: register(s)),
    Operation("profile run", lambda s, _f: profile(s)),
    Operation("plan apply", lambda s, _f: plan_apply(s)),
    Operation("rollout", rollout),
    Operation("budget change", lambda s, _f: lower_budget(s)),
    Operation("app down", lambda s, _f: app_down(s)),
)


# --- the checks --------------------------------------------------------------------------------


@dataclass
class Checks:
    orphans: list[str] = field(default_factory=list)
    rowless: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    excess_usd_per_hr: float = 0.0
    leftovers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        clean = not (self.orphans or self.rowless or self.stale or self.leftovers)
        return clean and self.excess_usd_per_hr <= 1e-9


def live_workers(data_dir: Path) -> dict[str, str]:
    """The live local workers of ``data_dir``: provider id -> instance type."""
    from provisioners.local import LocalProvisioner

    state_dir = data_dir / LOCAL_WORKERS_DIR
    if not state_dir.is_dir():
        return {}
    provisioner = LocalProvisioner(state_dir, {}, [MODEL], None)
    try:
        listed = provisioner.list({})
    finally:
        provisioner.close(timeout_s=0)
    return {i.provider_id: i.instance_type for i in listed if i.state in ("pending", "running")}


def check(data_dir: Path, dead_pid: int) -> Checks:
    """The crash guarantees on ``data_dir`` as they stand now."""
    found = Checks()
    workers = live_workers(data_dir)
    store = Store.from_url(f"sqlite:///{data_dir / 'heteroplane.db'}")
    try:
        rows = [r for r in store.list_instances() if r.state not in ("terminated", "failed")]
        budgets = {a.name: a.budget_usd_per_hr for a in store.list_apps()}
    finally:
        store.close()
    recorded = {r.provider_id for r in rows if r.provider_id is not None}
    found.orphans = sorted(p for p in workers if p not in recorded)
    found.rowless = sorted(
        f"{r.request_id} ({r.state})"
        for r in rows
        if r.state in _LIVE_ROWS and r.provider_id not in workers
    )
    # No profile run is in flight while the checks run: a kept profile row is a dead run's. A
    # rollout's workers are its loop's, whose outcome says whether they are gone.
    found.stale = sorted(
        r.request_id
        for r in rows
        if is_profile_worker(r.request_id)
        and not r.request_id.startswith(ROLLOUT_WORKERS)
        and r.state in _KEPT_ROWS
    )
    prices = {t.name: t.price_usd_per_hr for t in default_catalog().values()}
    spend = sum(prices[t] for t in workers.values())
    found.excess_usd_per_hr = max(0.0, spend - budgets.get(APP, 0.0))
    registry = data_dir / REGISTRY_DIR
    found.leftovers = sorted(
        str(p.relative_to(data_dir))
        for p in registry.rglob("*")
        if p.is_file() and (p.name.startswith(STAGING_PREFIX) or p.name.startswith(".incoming-"))
    ) + [f"inspector {pid}" for pid, owner, _ in running_inspectors() if owner == dead_pid]
    return found


def outcome(data_dir: Path, operation: str) -> str:
    """Whether ``operation`` is done or cleanly not done, read from the database and the disk."""
    store = Store.from_url(f"sqlite:///{data_dir / 'heteroplane.db'}")
    try:
        apps = {a.name: a for a in store.list_apps()}
        app = apps.get(APP)
        if operation == "model push":
            versions = store.list_model_versions(MODEL)
            blobs = [p for p in (data_dir / REGISTRY_DIR / "models").rglob("*") if p.is_file()]
            if versions and all(Path(v.uri.removeprefix("file://")).is_file() for v in versions):
                return "done"
            return "not done" if not versions and not blobs else "HALF DONE"
        if app is None:
            return "done" if operation == "app down" else "not done"
        if teardown_requested(store, app):
            return "draining"  # app down goes on after a restart: not settled yet
        if operation == "register":
            return "done"
        if operation == "profile run":
            return "done" if store.get_app_profiles(APP) is not None else "not done"
        if operation == "plan apply":
            return "done" if app.applied_plan_id is not None else "not done"
        if operation == "rollout":
            return _rollout_outcome(store, app.spec)
        if operation == "budget change":
            return "done" if app.budget_usd_per_hr == LOWERED_USD_PER_HR else "not done"
        return "not done"
    finally:
        store.close()


def _rollout_outcome(store: Store, spec: dict[str, Any]) -> str:
    """``done``: version 2 pinned, the rollout promoted and its workers gone; ``not done``: no
    rollout, or one in progress (it resumes: the operation run again carries it on); else what
    a crash must not leave (a rollout ended otherwise, or the spec pinned without its rollout's
    promotion)."""
    rollouts = store.list_rollouts(APP)
    pinned = spec["models"][0]["artifact"] == f"{MODEL}@2"
    if not rollouts:
        return "HALF DONE" if pinned else "not done"
    last = rollouts[-1]
    if last.active:
        return "not done"
    if last.state != "promoted":
        return last.state.upper()
    workers = [
        r
        for r in store.list_instances(APP)
        if r.request_id.startswith(ROLLOUT_WORKERS) and r.state in _KEPT_ROWS
    ]
    return "done" if pinned and not workers else "handover"


# --- one point ---------------------------------------------------------------------------------


@dataclass
class Result:
    point: str
    operation: str = "-"
    outcome: str = "-"
    checks: Checks = field(default_factory=Checks)
    redo: str = "-"
    settle_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.checks.ok
            and self.outcome in ("done", "not done")
            and self.redo == "ok"
        )


def run_point(
    point: str, workdir: Path, *, finish: bool = True, launch: Launch = subprocess.Popen
) -> Result:
    """Crash the service at ``point``, restart it, check (module docstring); each service's
    process started by ``launch``."""
    result = Result(point)
    data_dir = workdir / point
    data_dir.mkdir(parents=True)
    token = issue_token(data_dir, "crash-points")
    model_file = family_onnx(data_dir / "clf.onnx")
    service = Service(data_dir, token, crash_at=point, launch=launch)
    interrupted: int | None = None
    try:
        for index, operation in enumerate(OPERATIONS):
            try:
                operation.run(service, model_file)
            except ServiceCrashedError:
                interrupted = index
                break
    except RuntimeError as error:
        result.error = str(error)
    finally:
        dead_pid = service.process.pid
        service.close()
    if interrupted is None:
        result.error = result.error or "the service never reached the point"
        stop_workers(data_dir / LOCAL_WORKERS_DIR, MODEL)
        return result
    result.operation = OPERATIONS[interrupted].name
    again = Service(data_dir, token, launch=launch)
    try:
        started_s = time.monotonic()
        deadline = started_s + SETTLE_S
        while True:
            result.checks = check(data_dir, dead_pid)
            result.outcome = outcome(data_dir, result.operation)
            settled = result.outcome in ("done", "not done")
            if (result.checks.ok and settled) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        result.settle_s = time.monotonic() - started_s
        last = len(OPERATIONS) if finish else interrupted + 1
        try:
            for operation in OPERATIONS[interrupted:last]:
                operation.run(again, model_file)
            result.redo = "ok"
        except (ServiceCrashedError, RuntimeError) as error:
            result.redo = f"failed: {error}"[:200]
        if finish:  # after the whole life: nothing may be left either
            final = check(data_dir, dead_pid)
            if not final.ok:
                result.checks = final
    finally:
        again.close()
        stop_workers(data_dir / LOCAL_WORKERS_DIR, MODEL)
    return result


def table(results: Sequence[Result]) -> str:
    lines = [
        f"{'point':<28} {'operation':<14} {'outcome':<9} {'orphans':>7} {'rowless':>7}"
        f" {'stale':>5} {'excess':>7} {'left':>5} {'settle_s':>8} {'redo':<6} result",
    ]
    for r in results:
        c = r.checks
        lines.append(
            f"{r.point:<28} {r.operation:<14} {r.outcome:<9} {len(c.orphans):>7}"
            f" {len(c.rowless):>7} {len(c.stale):>5} {c.excess_usd_per_hr:>7.3f}"
            f" {len(c.leftovers):>5}"
            f" {r.settle_s:>8.1f} {r.redo[:6]:<6} {'ok' if r.ok else 'FAIL ' + r.error[:80]}"
        )
    failed = sum(not r.ok for r in results)
    lines.append(f"{len(results) - failed}/{len(results)} crash points clean")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", help="comma-separated points (default: all)")
    parser.add_argument("--keep", type=Path, help="keep the data directories here")
    parser.add_argument("--no-finish", action="store_true", help="redo only the interrupted step")
    args = parser.parse_args(argv)
    points = sorted(POINTS) if not args.points else args.points.split(",")
    unknown = [p for p in points if p not in POINTS]
    if unknown:
        parser.error(f"unknown point(s): {', '.join(unknown)} (known: {', '.join(sorted(POINTS))})")
    with tempfile.TemporaryDirectory(prefix="crash-points-") as scratch:
        workdir = args.keep or Path(scratch)
        results = []
        for point in points:
            print(f"crash point {point} ...", file=sys.stderr, flush=True)
            results.append(run_point(point, workdir, finish=not args.no_finish))
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    raise SystemExit(main())
