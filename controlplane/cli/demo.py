"""``heteroplane demo``: the main job. It starts the control plane on the embedded defaults (SQLite
in the data directory, the local provisioner, http://127.0.0.1:8000; the settings of ``heteroplane
serve``, with ``--host``/``--port`` over them) with the demo app registered, planned and served
by local workers, drives a demo load against it, and serves until SIGINT or SIGTERM.

Before serving it makes sure, idempotently (:mod:`controlplane.service.demo`), that the demo model
family is trained into the data directory, that its latency profiles are measured
(``<data_dir>/profiles/family.json``, ``--profile-samples`` runs per cell, once), that the demo
app is registered (the cheapest cascade of the family as accurate as its best model, on the
emulated types ``emu.cpu.small`` and ``emu.cpu.large``), that it has an applied plan (one previewed
for ``--rate-qps`` and applied when it has none; the reconciler then launches its workers), and
that an admin token for the demo is in ``<data_dir>/demo-token``; then it prints a "ready"
banner on stderr with the URL, where the token is and commands to try, and, unless
``--no-load``, starts the demo load (``controlplane.clients.loadgen`` against itself at a rate that
rises and falls every few minutes, a line per period on stderr) so that the dashboard moves.
Starting it again on the same data directory finds everything there and adds nothing.

``heteroplane demo --offline`` is the estimator demo, with no service
(:mod:`controlplane.cli.demo_offline`): rm2 on a GPU fleet and on a mixed fleet over a sweep of
rates, with ``--profiles`` (the Kairos samples), ``--json``, ``--duration`` and ``--seed``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from controlplane.api.errors import ApiError
from controlplane.apps import profiler
from controlplane.cli import demo_offline
from controlplane.cli.db import add_config_option
from controlplane.cli.output import UsageError, progress
from controlplane.cli.serve import (
    LOG_LEVELS,
    SERVE_LOGGER,
    configure_logging,
    listen,
    port_number,
    serve_until_stopped,
)
from controlplane.db.session import redact_url
from controlplane.db.store import PlanRecord
from controlplane.service.build import build_service
from controlplane.service.demo import (
    DEMO_APP,
    DEMO_RATE_QPS,
    DemoLoad,
    DemoState,
    prepare_demo,
    prepare_family,
)
from controlplane.settings import load_settings

__all__ = ["DEFAULT_PROFILES", "register"]

DEFAULT_PROFILES = Path("../shared/data/kairos_latency_samples.csv.gz")
_OFFLINE_DURATION_S = 600.0
_OFFLINE_SEED = 0


def _rate_qps(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r}") from None
    if not 0 < rate <= 1e5:
        raise argparse.ArgumentTypeError(f"a rate is in (0, 100000] qps, got {text}")
    return rate


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job: serve the control plane with the demo app registered and planned"
        " (--offline: the estimator demo, no service)",
        description=__doc__,
    )
    parser.add_argument("--host", metavar="H", help="address to listen on (default: settings)")
    parser.add_argument(
        "--port", type=port_number, metavar="P", help="port to listen on; 0 picks a free one"
    )
    parser.add_argument(
        "--rate-qps",
        type=_rate_qps,
        default=DEMO_RATE_QPS,
        metavar="R",
        help=f"the rate the first plan is made for (default {DEMO_RATE_QPS:g} qps)",
    )
    parser.add_argument(
        "--no-load", action="store_true", help="serve only: no demo load against the service"
    )
    parser.add_argument(
        "--profile-samples",
        type=_samples,
        default=profiler.DEFAULT_SAMPLES,
        metavar="N",
        help="timed runs per model and batch size when the family's profiles are measured"
        " (once per data directory; default %(default)s)",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="warning", help="log level (default warning)"
    )
    add_config_option(parser)
    offline = parser.add_argument_group("the offline estimator demo")
    offline.add_argument(
        "--offline", action="store_true", help="simulate rm2 on two fleets instead of serving"
    )
    offline.add_argument(
        "--profiles",
        type=Path,
        metavar="FILE",
        help=f"the Kairos samples CSV (default: {DEFAULT_PROFILES}; --offline only, accepted"
        " and unused without it, as older `make demo` lines pass it)",
    )
    offline.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help=f"per rate, s (default {_OFFLINE_DURATION_S:g}; --offline only)",
    )
    offline.add_argument(
        "--seed", type=int, help=f"random seed (default {_OFFLINE_SEED}; --offline only)"
    )
    offline.add_argument("--json", action="store_true", help="print one JSON object (--offline)")
    parser.set_defaults(handler=run)


def _samples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.offline:
        if args.profiles is None:
            args.profiles = DEFAULT_PROFILES
        if args.duration is None:
            args.duration = _OFFLINE_DURATION_S
        if args.seed is None:
            args.seed = _OFFLINE_SEED
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
        progress(
            f"heteroplane demo: data in {settings.data_dir}, database"
            f" {redact_url(settings.database_url)}, provisioner {settings.provisioner}"
        )
        # The family and its profiles first: the local provisioner hands the profiles to the
        # workers it launches, so they must be there when the service is built.
        family = prepare_family(settings.data_dir, args.profile_samples, progress)
        service = build_service(settings)
    except BaseException:
        sock.close()
        raise
    try:
        state = prepare_demo(service, args.rate_qps, progress, family=family)
    except BaseException as error:
        service.close()
        sock.close()
        if isinstance(error, ApiError):
            raise UsageError(error.message) from None
        raise
    # Listening before the banner: a client that reads it and connects at once is queued until
    # uvicorn accepts, not refused.
    sock.listen()
    url = _client_url(sock)
    load = None if args.no_load else _demo_load(state, url)
    print(_banner(state, url, load), file=sys.stderr, flush=True)
    if load is not None:
        load.start()
    try:
        return serve_until_stopped(service, sock, args.log_level)
    finally:
        if load is not None:
            load.stop()


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


def _client_url(sock: socket.socket) -> str:
    """The URL a client on this machine uses for the service bound to ``sock``."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _plan_summary(plan: PlanRecord | None, budget_usd_per_hr: float) -> str:
    if plan is None:
        return f"no plan applied (none feasible within ${budget_usd_per_hr:g}/hr)"
    document = plan.document
    fleets = "; ".join(
        ",".join(f"{name}={count}" for name, count in sorted(stage.get("fleet", {}).items()))
        for stage in document.get("stages", [])
    )
    p99_ms = max(
        (stage.get("predicted_p99_ms", 0.0) for stage in document.get("stages", [])), default=0.0
    )
    rate_qps = document.get("trace", {}).get("rate_qps", document.get("planned_rate_qps", 0.0))
    return (
        f"plan {plan.number} applied: {fleets}, ${document.get('cost_usd_per_hr', 0.0):.2f}/hr,"
        f" predicted p99 {p99_ms:.0f} ms on a {rate_qps:.0f} qps planning trace"
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
            f" {slo.get('latency_ms', 0):g} ms, budget ${app.budget_usd_per_hr:g}/hr;"
            f" {_plan_summary(state.plan, app.budget_usd_per_hr)}",
            traffic,
            f"  an admin token ({state.token.principal.name}) is in {state.token.path}",
            "  try, in another terminal (more in README.md, 'Talk to it'):",
            f"    TOKEN=$(cat {token_file})",
            f"    curl -sS {url}/healthz",
            f"    curl -sS {bearer} {url}/v1/apps/{DEMO_APP}",
            f"    curl -sS {bearer} {url}/v1/apps/{DEMO_APP}/plans",
            f"    {infer}",
            "  Ctrl-C stops it; started again, it picks up where it stopped (the workers run on).",
            "",
        ]
    )
