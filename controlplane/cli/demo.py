"""``heteroplane demo``: the main job. It serves the control plane on the embedded defaults with
the demo app registered, planned and served by local workers, and drives a demo load against it;
``--offline`` is the estimator demo, with no service (:mod:`controlplane.cli.demo_offline`);
``--down`` takes the demo app down (its workers stop) and exits
(:func:`controlplane.service.demo.stop_demo`).

What it makes sure of before serving, and what it prints, is the command's description
(``heteroplane demo --help``), kept in :mod:`controlplane.cli.parsers` so that the help needs none
of this module's imports.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections import Counter
from typing import Any

from controlplane.api.errors import ApiError
from controlplane.cli import demo_offline
from controlplane.cli.common import check_seed
from controlplane.cli.output import UsageError, progress
from controlplane.cli.parsers import (
    DEMO_OFFLINE_DURATION_S,
    DEMO_OFFLINE_PROFILES,
    DEMO_OFFLINE_SEED,
    DEMO_PROFILE_SAMPLES,
    DEMO_RATE_QPS,
)
from controlplane.cli.serve import (
    SERVE_LOGGER,
    build_served,
    client_url,
    configure_logging,
    grpc_address,
    listen,
    serve_until_stopped,
)
from controlplane.dashboard.session import load_session_settings
from controlplane.db.lease import lock_sqlite_database
from controlplane.db.session import redact_url
from controlplane.db.store import PlanRecord
from controlplane.errors import DatabaseInUseError
from controlplane.policies.lifecycle import LIVE_STATES
from controlplane.service.build import build_service, check_served_database
from controlplane.service.demo import (
    DEMO_APP,
    TOKEN_FILE,
    DemoLoad,
    DemoState,
    prepare_demo,
    prepare_family,
    stop_demo,
)
from controlplane.settings import load_settings
from estimator.numbers import plain

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    if args.print_token:
        if args.down or args.offline:
            raise UsageError("--print-token: alone (it reads the token a demo made and exits)")
        return _print_token(args)
    if args.down:
        if args.offline:
            raise UsageError("--down and --offline: choose one (the offline demo runs no workers)")
        return _down(args)
    if args.offline:
        served = [
            flag
            for flag, given in (
                ("--host", args.host is not None),
                ("--port", args.port is not None),
                ("--rate-qps", args.rate_qps is not None),
                ("--no-load", args.no_load),
                ("--profile-samples", args.profile_samples is not None),
            )
            if given
        ]
        if served:
            raise UsageError(
                f"{', '.join(served)}: not with --offline (the estimator demo runs no service)"
            )
        if args.profiles is None:
            args.profiles = DEMO_OFFLINE_PROFILES
        if args.duration is None:
            args.duration = DEMO_OFFLINE_DURATION_S
        if args.seed is None:
            args.seed = DEMO_OFFLINE_SEED
        check_seed(args.seed)
        return demo_offline.run(args)
    stray = [
        flag
        for flag, given in (
            ("--json", args.json),
            ("--duration", args.duration is not None),
            ("--seed", args.seed is not None),
        )
        if given
    ]
    if stray:
        raise UsageError(f"{', '.join(stray)}: only with --offline (the estimator demo)")
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    # Refused now, not after the minutes of training and measuring below (build_service too).
    check_served_database(settings)
    load_session_settings()  # the dashboard's: a bad one is refused before anything starts
    _check_family()
    host: str = args.host if args.host is not None else settings.host
    port: int = args.port if args.port is not None else settings.port
    configure_logging(args.log_level)
    # "stopped by SIGTERM" is worth a line even when the rest of the log is quiet.
    serve_log = logging.getLogger(SERVE_LOGGER)
    serve_log.setLevel(min(serve_log.getEffectiveLevel(), logging.INFO))
    # Bound first: an address in use is a one-line error before any work is done.
    sock = listen(host, port)
    try:
        grpc = grpc_address(settings, host)
        progress(
            f"heteroplane demo: data in {settings.data_dir}, database"
            f" {redact_url(settings.database_url)}, provisioner {settings.provisioner}"
        )
        # Another service on this SQLite database: refused now, as `serve` is, not after the
        # minutes of training and measuring below (build_served takes the lock for good).
        held = lock_sqlite_database(settings.database_url)
        if held is not None:
            held.close()
        # The family and its profiles first: the local provisioner hands the profiles to the
        # workers it launches, so they must be there when the service is built.
        samples = DEMO_PROFILE_SAMPLES if args.profile_samples is None else args.profile_samples
        family = prepare_family(settings.data_dir, samples, progress)
        service, loops = build_served(settings, sock, args.config, args.log_level)
    except BaseException:
        sock.close()
        raise
    try:
        rate = DEMO_RATE_QPS if args.rate_qps is None else args.rate_qps
        state = prepare_demo(service, rate, progress, family=family)
    except BaseException as error:
        if loops is not None:
            loops.stop()
        service.close()
        sock.close()
        if isinstance(error, ApiError):
            raise UsageError(error.message) from None
        raise
    # Listening before the banner: a client that reads it and connects at once is queued until
    # uvicorn accepts, not refused.
    sock.listen()
    url = client_url(sock)
    load = None if args.no_load else _demo_load(state, url)
    print(_banner(state, url, load), file=sys.stderr, flush=True)
    if load is not None:
        load.start()
    try:
        return serve_until_stopped(service, sock, args.log_level, grpc, loops)
    finally:
        if load is not None:
            load.stop()


def _down(args: argparse.Namespace) -> int:
    """``demo --down``: the demo app drained and deleted, its workers stopped; exit status 1
    when workers still run after the wait (what is left is said)."""
    settings = load_settings(args.config)
    configure_logging(args.log_level)
    try:
        service = build_service(settings)
    except DatabaseInUseError as error:
        who = f" (pid {error.holder})" if error.holder else ""
        raise UsageError(
            f"--down: the demo{who} is running on {settings.data_dir}; stop it with Ctrl-C,"
            f" then run --down again, or take the app down on the running service:"
            f" heteroplane app down {DEMO_APP} (with HETEROPLANE_TOKEN set, as in README.md)"
        ) from None
    # Said once the database is ours: a refusal above is the only line a refused --down prints.
    progress(
        f"heteroplane demo --down: data in {settings.data_dir}, database"
        f" {redact_url(settings.database_url)}, provisioner {settings.provisioner}"
    )
    try:
        # Apps of the user's own on the same data directory (the README's own model beside the
        # demo) keep their workers: said, with the way to take them down.
        others = Counter(
            i.app for i in service.store.list_instances(states=LIVE_STATES) if i.app != DEMO_APP
        )
        down = stop_demo(service, progress)
    finally:
        service.close()
    if others:
        listed = ", ".join(f"{app} ({n})" for app, n in sorted(others.items()))
        progress(
            f"heteroplane demo --down: other apps still run instances here: {listed}; take"
            " each down on a running service: heteroplane app down APP"
        )
    if not down.done:
        progress(
            f"heteroplane demo --down: the demo's workers did not all stop in time; run it again"
            f" (or see {settings.data_dir / 'workers'})"
        )
        return 1
    if down.app_found or down.stopped:
        progress(f"heteroplane demo --down: app {DEMO_APP!r} is down, its workers stopped")
    else:
        progress(f"heteroplane demo --down: no app {DEMO_APP!r} and no worker of it: nothing to do")
    return 0


def _print_token(args: argparse.Namespace) -> int:
    """The demo's admin token on stdout, read from the data directory the settings name (so
    ``HETEROPLANE_DATA_DIR`` and ``XDG_DATA_HOME`` are respected); one line when there is none."""
    path = load_settings(args.config).data_dir / TOKEN_FILE
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise UsageError(f"no demo token in {path}: start the demo first (make demo)") from None
    print(token)
    return 0


def _check_family() -> None:
    """The demo trains and serves the model family: torch and scikit-learn must be there."""
    try:
        import sklearn  # noqa: F401
        import torch  # noqa: F401
    except ImportError as error:
        raise UsageError(
            f"the demo serves the model family, which needs torch and scikit-learn ({error});"
            " install the worker extra: pip install -e '.[worker]'"
        ) from None


def _demo_load(state: DemoState, url: str) -> DemoLoad:
    from provisioners.worker import family

    token = state.token.path.read_text(encoding="utf-8").strip()
    inputs = family.load_split().validation_inputs
    return DemoLoad(url, token, inputs, progress)


def _plan_summary(plan: PlanRecord | None, budget_usd_per_hr: float) -> str:
    if plan is None:
        return f"no plan applied (none feasible within ${plain(budget_usd_per_hr)}/hr)"
    typed = plan.plan
    # Each stage's fleet, named by its stage where there are several (a cascade's three fleets
    # of one type each read "emu.cpu.small=1; emu.cpu.small=1; emu.cpu.small=1" without them).
    named = len(typed.stages) > 1
    fleets = "; ".join(
        (f"{stage.name}: " if named else "")
        + ",".join(f"{name}={count}" for name, count in sorted(stage.fleet.items()))
        for stage in typed.stages
    )
    p99 = "n/a" if typed.predicted_p99_ms is None else f"{typed.predicted_p99_ms:.0f} ms"
    return (
        f"plan {plan.id} applied: {fleets}, ${typed.cost_usd_per_hr:.2f}/hr,"
        f" predicted end-to-end p99 {p99} at {typed.rate_qps:.0f} qps"
    )


def _served(spec: dict[str, Any]) -> str:
    """``cascade tiny@0.5 -> medium@0.6 -> large`` or the single model's name."""
    models = [model["name"] for model in spec.get("models", [])]
    cascade, thresholds = spec.get("cascade"), spec.get("thresholds")
    if not cascade:
        return ", ".join(models)
    if thresholds and len(thresholds) == len(cascade) - 1:
        parts = [f"{m}@{h:g}" for m, h in zip(cascade, thresholds, strict=False)]
        return "cascade " + " -> ".join([*parts, cascade[-1]])
    return "cascade " + " -> ".join(cascade)


def _banner(state: DemoState, url: str, load: DemoLoad | None) -> str:
    app = state.app
    slo = app.spec.get("slo", {})
    token_file = shlex.quote(str(state.token.path))
    bearer = '-H "Authorization: Bearer $TOKEN"'
    pixels = ",".join(["0"] * 64)
    infer = (
        f"curl -sS {bearer} -H 'Content-Type: application/json'"
        f" -d '{{\"inputs\": [[{pixels}]]}}' {url}/v1/apps/{DEMO_APP}/infer"
    )
    if load is not None:
        traffic = f"  a demo load runs against it: {load.describe()} (--no-load: none)"
    else:
        traffic = "  no demo load (--no-load): send your own with heteroplane loadgen"
    return "\n".join(
        [
            "",
            f"heteroplane demo is ready on {url} (the API's reference: {url}/docs)",
            f"  app {DEMO_APP!r}: {_served(app.spec)}, p{slo.get('percentile', 99):g} SLO"
            f" {slo.get('latency_ms', 0):g} ms, budget ${plain(app.budget_usd_per_hr)}/hr;"
            f" {_plan_summary(state.plan, app.budget_usd_per_hr)}",
            traffic,
            f"  an admin token ({state.token.principal.name}) is in {state.token.path}",
            "  try, in another terminal (more in README.md, 'Talk to it'):",
            f"    TOKEN=$(cat {token_file})",
            f"    curl -sS {url}/healthz",
            f"    curl -sS {bearer} {url}/v1/apps/{DEMO_APP}",
            f"    curl -sS {bearer} {url}/v1/apps/{DEMO_APP}/plans",
            f"    {infer}",
            "  Ctrl-C stops it; started again, it picks up where it stopped (the workers run on;"
            " heteroplane demo --down stops them).",
            "",
        ]
    )
