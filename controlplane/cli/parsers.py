"""Every command's parser: its name, options, help text and the function that runs it.

Nothing here imports more than the standard library and the light parts of the command line
(:mod:`controlplane.cli.client`, :mod:`controlplane.cli.output`, the token scopes), so that
``heteroplane --help``, ``heteroplane COMMAND --help`` and the commands that call a running service
start in a fraction of a second (docs/cli.md, benchmarks/cli_speed.py). A parser names its
command's implementation as a :class:`Handler`, a module of this package and a function in it;
the module, with what it needs (numpy and the estimator, SQLAlchemy and Alembic, FastAPI and
uvicorn, torch), is imported when the command runs.

Defaults and choices that belong to the libraries the commands run (the cascade threshold grid,
the profiler's defaults, ...) are copies here, since importing their modules would load numpy,
scipy and numba; :data:`LIBRARY_COPIES` names the source of each, and
tests/unit/test_cli_startup.py checks that every copy equals it. The dispatch policies' names
come from their registry (:mod:`matching.registry`), which loads no policy to list them.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.cli.client import (
    APP_NAME_MAX,
    APP_NAME_PATTERN,
    DEFAULT_URL,
    TOKEN_ENV,
    URL_ENV,
    add_client_options,
    wait_seconds,
)
from controlplane.cli.output import fail
from controlplane.policies import scaling
from controlplane.policies.auth import Scope
from matching import registry

if TYPE_CHECKING:
    from typing import TypeAlias

__all__ = [
    "LIBRARY_COPIES",
    "PARETO_GRID",
    "Handler",
    "Parser",
    "add_config_option",
    "add_pareto_arguments",
    "add_profiles_option",
    "add_workload_options",
    "register_commands",
]

# --- copies of the libraries' defaults and choices (see the module docstring) ------------------

THRESHOLD_GRID: tuple[float, ...] = tuple(round(0.1 * k, 10) for k in range(1, 10))
ACCURACY_TOLERANCE = 0.005
GEAR_RANGES = 8
PLANNING_QUERIES = 20_000
PEAK_WINDOW_S = 10.0
PROFILE_REFERENCE_TYPE = "local.cpu"
PROFILE_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)
PROFILE_SAMPLES = 30
PROFILE_WARMUP = 5
PROFILE_THREADS = 1
DEMO_RATE_QPS = 12.0
DEMO_PROFILE_SAMPLES = 20
LOADGEN_TIMEOUT_S = 10.0
LOADGEN_PROGRESS_S = 5.0
LOADGEN_MAX_IN_FLIGHT = 512
MODEL_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
MODEL_FORMATS = ("onnx", "torchscript")
MAX_BATCH_SIZE = 1_000_000
MAX_PROBE_QUERIES = 1_000_000
MIN_PLANNING_RATE_QPS = 1e-3

# Each copy above and the name it copies, as ``module.NAME``.
LIBRARY_COPIES: dict[str, object] = {
    "estimator.cascades.DEFAULT_THRESHOLD_GRID": THRESHOLD_GRID,
    "controlplane.policies.cascade_choice.ACCURACY_TOLERANCE": ACCURACY_TOLERANCE,
    "controlplane.policies.gears.DEFAULT_RANGES": GEAR_RANGES,
    "controlplane.policies.planner.PLANNING_QUERIES": PLANNING_QUERIES,
    "controlplane.policies.baselines.PEAK_WINDOW_S": PEAK_WINDOW_S,
    "controlplane.apps.profiler.REFERENCE_TYPE": PROFILE_REFERENCE_TYPE,
    "controlplane.apps.profiler.DEFAULT_BATCH_SIZES": PROFILE_BATCH_SIZES,
    "controlplane.apps.profiler.DEFAULT_SAMPLES": PROFILE_SAMPLES,
    "controlplane.apps.profiler.DEFAULT_WARMUP": PROFILE_WARMUP,
    "controlplane.apps.profiler.DEFAULT_THREADS": PROFILE_THREADS,
    "controlplane.service.demo.DEMO_RATE_QPS": DEMO_RATE_QPS,
    "controlplane.service.demo.PROFILE_SAMPLES": DEMO_PROFILE_SAMPLES,
    "controlplane.clients.loadgen.DEFAULT_TIMEOUT_S": LOADGEN_TIMEOUT_S,
    "controlplane.clients.loadgen.DEFAULT_PROGRESS_S": LOADGEN_PROGRESS_S,
    "controlplane.clients.loadgen.DEFAULT_MAX_IN_FLIGHT": LOADGEN_MAX_IN_FLIGHT,
    "provisioners.artifacts.NAME_PATTERN": MODEL_NAME_PATTERN,
    "provisioners.artifacts.FORMATS": MODEL_FORMATS,
    "estimator.batches.MAX_BATCH_SIZE": MAX_BATCH_SIZE,
    "estimator.capacity.MAX_PROBE_QUERIES": MAX_PROBE_QUERIES,
    "controlplane.api.schemas.MIN_RATE_QPS": MIN_PLANNING_RATE_QPS,
    # The app name rule the client commands hold a name to (controlplane.cli.client.app_path).
    "controlplane.spec._APP_NAME_PATTERN": APP_NAME_PATTERN,
    "controlplane.spec._APP_NAME_MAX": APP_NAME_MAX,
}

# --- the command line's own defaults and choices (some implementations import them from here) --

TRACE_KINDS = ("poisson", "gamma", "step", "ramp", "diurnal")
# The default thresholds of ``plan --pareto``: 0 (everyone answered at that stage, so the shorter
# chains are on the front too) and the cascade grid.
PARETO_GRID: tuple[float, ...] = (0.0, *THRESHOLD_GRID)
# A batch-size spec other than kairos or fixed:N becomes an empirical pmf from this many seeded
# draws (the mean of a 1e6-draw sample is within about 0.1% of the exact one).
EMPIRICAL_DRAWS = 1_000_000
EMPIRICAL_SEED = 0
DEFAULT_MAX_STAGES = 3
# Timed runs per model at batch size 1: the mean of 500 runs of a sub-millisecond model is stable
# to a few percent even on a shared machine, and all of them take well under a second.
DEFAULT_COMPUTE_SAMPLES = 500
DEFAULT_COMPUTE_WARMUP = 50
LOG_LEVELS = ("debug", "info", "warning", "error")
DEMO_OFFLINE_PROFILES = Path("../shared/data/kairos_latency_samples.csv.gz")
DEMO_OFFLINE_DURATION_S = 600.0
DEMO_OFFLINE_SEED = 0
# The most QPS ranges of a gear plan: each is a gear to choose and to switch between, a thousand
# is past any use (planning 10**8 of them runs for minutes).
MAX_GEAR_RANGES = 1_000
# The highest --qps-max of a gear plan: a billion queries per second is past any fleet; more is a
# typo (and 1e308 overflows the ranges' ends to inf).
MAX_GEAR_QPS = 1e9


class Parser(argparse.ArgumentParser):
    """argparse with the project's one-line error format (argparse already exits 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{self.prog}: {message}")


if TYPE_CHECKING:
    Subparsers: TypeAlias = argparse._SubParsersAction[Parser]


@dataclass(frozen=True, slots=True)
class Handler:
    """What runs a command: ``function`` of ``controlplane.cli.<module>``, called with the parsed
    arguments and returning the exit status; the module is imported on the call."""

    module: str
    function: str

    def __call__(self, args: argparse.Namespace) -> int:
        module = importlib.import_module(f"controlplane.cli.{self.module}")
        status: int = getattr(module, self.function)(args)
        return status


def register_commands(subparsers: Subparsers) -> None:
    """Add every command, in the order ``heteroplane --help`` lists them."""
    for register in (
        _demo,
        _trace,
        _simulate,
        _capacity,
        _bounds,
        _plan,
        _replay,
        _loadgen,
        _profile,
        _cascade,
        _gears,
        _db,
        _token,
        _serve,
        _app,
        _model,
        _plans,
        _budget,
        _fleet,
        _events,
        _rollout,
    ):
        register(subparsers)


# --- argument types ----------------------------------------------------------------------------


def port_number(text: str) -> int:
    """argparse type of ``--port``: 0..65535 (0 picks a free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


# The most queries a second the command line plans or generates for (the API's limit too).
MAX_RATE_QPS = 1e5


def rate_qps(text: str) -> float:
    """argparse type of the demo's ``--rate-qps``: in (0, 100000]."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r}") from None
    if not 0 < rate <= MAX_RATE_QPS:
        raise argparse.ArgumentTypeError(f"a rate is in (0, {MAX_RATE_QPS:,.0f}] qps, got {text}")
    return rate


def positive_number(text: str) -> float:
    """argparse type of a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def finite_number(text: str) -> float:
    """argparse type of a number sent to the service as it is (its range is the service's to
    judge): finite, so that a NaN or an infinity (``1e400``) is refused naming its option
    rather than by the JSON encoder, which cannot say whose it was."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def count(text: str) -> int:
    """argparse type of a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def revision(text: str) -> str:
    """argparse type of ``db upgrade|downgrade --revision``: not blank (Alembic fails an
    assertion, with a traceback, on an empty one)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"no revision in {text!r}: give head, base, a revision id (db current names the"
            " database's) or a step such as -1"
        )
    return text


# --- the commands ------------------------------------------------------------------------------

_DEMO_DESCRIPTION = """\
The main job: the control plane on http://127.0.0.1:8000 (the settings of `heteroplane serve`)
with the demo app, a cascade of digit classifiers, trained, profiled, planned and served by local
workers, and a demo load against it, until Ctrl-C. The first start takes a few minutes; a restart
finds everything there. The admin token is in <data dir>/demo-token (--print-token prints it).
--down takes the demo down instead (stop a running demo first); --offline is the estimator demo,
with no service. More: README.md and docs/cli.md.
"""

_CAPACITY_DESCRIPTION = """\
``heteroplane capacity``: the allowable throughput of a fleet under a dispatch policy.

Kairos' metric: the highest Poisson arrival rate at which at least 99% of queries finish within
QoS (DESIGN.md section 4, "Kairos-setting semantics"). Each query is a batch that runs alone.
"""

_LOADGEN_DESCRIPTION = """\
``heteroplane loadgen``: replay a trace against an app's inference endpoint, open loop.

Each row of the trace (``arrival_s``, ``batch_size``, optional ``sample_id``) is one query to
``POST /v1/apps/APP/infer``, sent at its arrival time whatever the answers do; its inputs are the
demo family's validation samples (the row's ``sample_id``, else the row's index, and the ones
after it for a batch: :mod:`controlplane.clients.loadgen`). The samples are the digits of the
family's validation split, rebuilt from the seed in the app's validation records when that file can
be read here (else the family's default seed), so sample i is the one the records describe;
they are checked against the app's inputs (``GET /v2/models/APP``) before anything is sent, so an
app of another model is refused up front: give it ``--inputs``.

Any model: ``--inputs FILE`` gives the rows instead (a ``.npz`` with one array per model input,
rows first, or a JSON file of Open Inference Protocol rows), checked against the app's inputs
(``GET /v2/models/APP``) and drawn in order (query i takes the next ``batch_size`` rows, wrapping
around). With it the queries go to ``POST /v2/models/APP/infer`` (``--protocol v1`` for ``/v1``,
a model of one input); ``--binary`` sends the tensors in Triton's binary extension.

Progress goes to stderr every ``--progress-s`` seconds; at the end it prints the queries sent,
answered and failed (by kind: HTTP status, timeout, connection), p50 and p99 of the end-to-end
latency, the attainment (share of sent queries answered within the app's SLO, read from ``GET
/v1/apps/APP`` unless ``--slo-ms`` gives it) and the achieved rate; ``--json`` prints the
contract's object instead. A token of scope ``infer`` cannot read the app: give ``--slo-ms``.
A run in which not one query was answered exits 1 after its report.
"""


def _demo(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job: serve the control plane with the demo app registered and planned"
        " (--offline: the estimator demo, no service)",
        description=_DEMO_DESCRIPTION,
    )
    parser.add_argument("--host", metavar="H", help="address to listen on (default: settings)")
    parser.add_argument(
        "--port", type=port_number, metavar="P", help="port to listen on; 0 picks a free one"
    )
    parser.add_argument(
        "--rate-qps",
        type=rate_qps,
        metavar="R",
        help=f"the rate the first plan is made for (default {DEMO_RATE_QPS:g} qps)",
    )
    parser.add_argument(
        "--no-load", action="store_true", help="serve only: no demo load against the service"
    )
    parser.add_argument(
        "--down",
        action="store_true",
        help="take the demo down instead: drain and delete the demo app, stop its local"
        " workers (which a stopped demo leaves running), and exit",
    )
    parser.add_argument(
        "--print-token",
        action="store_true",
        help="print the demo's admin token (from <data dir>/demo-token) and exit",
    )
    parser.add_argument(
        "--profile-samples",
        type=count,
        metavar="N",
        help="timed calls per model, instance type and batch size when the family's profiles are"
        f" measured through the workers (once per data directory; default {DEMO_PROFILE_SAMPLES})",
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
        help=f"the Kairos samples CSV (default: {DEMO_OFFLINE_PROFILES}; --offline only, accepted"
        " and unused without it, as older `make demo` lines pass it)",
    )
    offline.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help=f"per rate, s (default {DEMO_OFFLINE_DURATION_S:g}; --offline only)",
    )
    offline.add_argument(
        "--seed", type=int, help=f"random seed (default {DEMO_OFFLINE_SEED}; --offline only)"
    )
    offline.add_argument("--json", action="store_true", help="print one JSON object (--offline)")
    parser.set_defaults(handler=Handler("demo", "run"))


def _trace(subparsers: Subparsers) -> None:
    """Add ``trace generate`` and ``trace stats``."""
    parser = subparsers.add_parser(
        "trace",
        help="generate or summarise a query trace (CSV of arrival_s, batch_size)",
        description="Generate a synthetic query trace, or print the statistics of a trace file.",
    )
    actions = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    actions.required = True

    generate = actions.add_parser(
        "generate",
        help="write a synthetic trace CSV and print its statistics",
        description=(
            "Write a synthetic trace: arrivals from a renewal process (Poisson, or gamma gaps "
            "with --cv2) whose rate is constant, a step, a linear ramp, or diurnal, optionally "
            "with spikes; batch sizes from --batch-dist."
        ),
    )
    generate.add_argument(
        "--kind",
        choices=TRACE_KINDS,
        required=True,
        help="arrival process: poisson, gamma (needs --cv2), step or ramp (need --to-rate and "
        "--at; ramp also --over), diurnal (mean rate --rate, see --period, --amplitude)",
    )
    generate.add_argument(
        "--rate",
        type=float,
        required=True,
        metavar="QPS",
        help="arrival rate in queries per second (the starting rate for step/ramp, the mean "
        "rate for diurnal)",
    )
    generate.add_argument(
        "--duration",
        type=float,
        required=True,
        metavar="S",
        help="length of the trace in seconds",
    )
    generate.add_argument(
        "--cv2",
        type=float,
        metavar="X",
        help="squared coefficient of variation of the inter-arrival gaps (gamma gaps; 1 is "
        "Poisson, > 1 bursty); required for gamma, default 1 for step, ramp and diurnal",
    )
    generate.add_argument(
        "--to-rate",
        type=float,
        metavar="QPS",
        help="step/ramp: the rate after the change, in queries per second",
    )
    generate.add_argument(
        "--at",
        type=float,
        metavar="S",
        help="step/ramp: when the rate starts to change, in seconds from the start (before"
        " --duration)",
    )
    generate.add_argument(
        "--over",
        type=float,
        metavar="S",
        help="ramp: how long the linear change from --rate to --to-rate takes, in seconds",
    )
    generate.add_argument(
        "--period",
        type=float,
        metavar="S",
        help="diurnal: period of the sinusoidal rate in seconds (default 86400)",
    )
    generate.add_argument(
        "--amplitude",
        type=float,
        metavar="A",
        help="diurnal: relative amplitude in [0, 1]; the rate swings between (1 - A) and "
        "(1 + A) times --rate (default 0.5)",
    )
    generate.add_argument(
        "--spike",
        action="append",
        default=[],
        metavar="START:LENGTH:FACTOR",
        help="multiply the rate by FACTOR from START for LENGTH seconds (repeatable; 0 is an "
        "outage)",
    )
    generate.add_argument(
        "--batch-dist",
        default="fixed:1",
        metavar="SPEC",
        help="batch sizes: fixed:N, kairos, lognormal:mu=M,sigma=S[,low=,high=,step=] or "
        "gaussian:mean=M,sd=S[,low=,high=,step=] (default fixed:1)",
    )
    generate.add_argument(
        "--seed", type=int, default=0, metavar="N", help="random seed (default 0: reproducible)"
    )
    generate.add_argument("--out", required=True, metavar="FILE", help="where to write the CSV")
    generate.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a summary"
    )
    generate.set_defaults(handler=Handler("trace", "generate_trace"))

    stats = actions.add_parser(
        "stats",
        help="print the statistics of a trace CSV",
        description="Print the count, duration, rate, CV^2 and batch sizes of a trace CSV.",
    )
    stats.add_argument("file", metavar="FILE", help="trace CSV (arrival_s[, batch_size])")
    stats.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a summary"
    )
    stats.set_defaults(handler=Handler("trace", "show_stats"))


def _simulate(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="predict latency, throughput and cost of a fleet on a workload",
        description="Replay a trace (or a generated Poisson workload) through a fleet of instances"
        " with the discrete-event simulator. Each query is a batch that runs on one instance for"
        " a service time drawn from the measured samples of its instance type.",
    )
    add_profiles_option(parser)
    parser.add_argument("--model", required=True, help="the model to serve (as in the profiles)")
    parser.add_argument(
        "--fleet",
        required=True,
        metavar="F",
        help="instances by type, e.g. g4dn.xlarge=1,r5n.large=13",
    )
    add_workload_options(parser)
    parser.add_argument(
        "--qos-ms", type=float, required=True, metavar="X", help="latency target of a query, ms"
    )
    parser.add_argument(
        "--policy",
        choices=registry.names(),
        default="fcfs",
        help="dispatch policy (one of %(choices)s; drs needs --drs-threshold; kairos is Kairos'"
        " min-cost matching)",
    )
    parser.add_argument(
        "--drs-threshold",
        type=int,
        metavar="N",
        help=f"drs: largest batch size for auxiliaries (0 to {MAX_BATCH_SIZE:,}; only with"
        " --policy drs)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=1,
        metavar="N",
        help="queued queries an instance may take at once (default 1: each query runs alone;"
        f" at most {MAX_BATCH_SIZE:,})",
    )
    parser.add_argument(
        "--service",
        choices=["sampled", "mean"],
        default="sampled",
        help="service times drawn from the measured samples, or the mean (default sampled)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=Handler("simulate", "run"))


def _capacity(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "capacity",
        help="allowable throughput of a fleet: highest rate with >= 99%% of queries within QoS",
        description=_CAPACITY_DESCRIPTION,
    )
    add_profiles_option(parser)
    parser.add_argument("--model", required=True, help="the model to serve (as in the profiles)")
    parser.add_argument(
        "--fleet", required=True, metavar="F", help="e.g. g4dn.xlarge=1,r5n.large=13"
    )
    parser.add_argument(
        "--policy",
        choices=[*registry.names(), "oracle"],
        default="kairos",
        help="dispatch policy (oracle: Kairos' offline sorted schedule, an upper reference)",
    )
    parser.add_argument("--qos-ms", type=float, required=True, metavar="X", help="latency target")
    parser.add_argument(
        "--batch-dist", default="kairos", metavar="SPEC", help="batch sizes (default kairos)"
    )
    parser.add_argument(
        "--queries",
        type=int,
        default=20_000,
        metavar="N",
        help=f"queries per probe (default 20000, at most {MAX_PROBE_QUERIES:,})",
    )
    parser.add_argument(
        "--drs-threshold",
        type=int,
        metavar="N",
        help=f"drs: batch-size threshold, 0 to {MAX_BATCH_SIZE:,} (default: tuned by hill"
        " climbing, as DeepRecSys does; only with --policy drs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=Handler("capacity", "run"))


def _bounds(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "bounds",
        help="rank the fleets a budget affords by their Kairos throughput upper bound",
        description="Enumerate every instance mix the budget affords (or search for the best ones"
        " when there are too many to list), rank them by the Kairos throughput upper bound, and"
        " pick one without online evaluation by the paper's similarity rule.",
    )
    add_profiles_option(parser)
    parser.add_argument("--model", required=True, help="the model to serve (as in the profiles)")
    parser.add_argument(
        "--qos-ms", type=float, required=True, metavar="X", help="latency target of a query, ms"
    )
    parser.add_argument(
        "--budget", type=float, required=True, metavar="USD_PER_HR", help="cost budget, USD/hr"
    )
    parser.add_argument(
        "--types",
        metavar="T1,T2,...",
        help="candidate instance types (default: every type the profiles have for the model)",
    )
    parser.add_argument(
        "--max-count",
        metavar="TYPE=N,...",
        help="largest number of instances of a type, e.g. g4dn.xlarge=5,r5n.large=17",
    )
    parser.add_argument(
        "--batch-dist",
        default="kairos",
        metavar="SPEC",
        help="batch-size mix: kairos (default, exact pmf), fixed:N, lognormal:..., gaussian:..."
        f" (the last two: empirical pmf of {EMPIRICAL_DRAWS:,} draws, seed {EMPIRICAL_SEED})",
    )
    parser.add_argument(
        "--top", type=int, default=10, metavar="K", help="configurations to list (default 10)"
    )
    parser.add_argument(
        "--rule",
        choices=["best", "widest"],
        default="best",
        help="threshold of a mix of auxiliaries: best (monotone bound, default) or widest (the"
        " paper's b* = max b_a exactly)",
    )
    parser.add_argument(
        "--qos-statistic",
        choices=["median", "mean"],
        default="median",
        help="latency compared with QoS to find which batch sizes a type serves (default median:"
        " reproduces the Kairos authors' b_a)",
    )
    parser.add_argument(
        "--kairos-plus",
        action="store_true",
        help="also run Kairos+: evaluate configurations in bound order with the simulator"
        " (allowable throughput under the Kairos dispatcher), pruning by bound and"
        " sub-configuration; reports how many it evaluated",
    )
    parser.add_argument(
        "--queries",
        type=int,
        default=20_000,
        metavar="N",
        help=f"--kairos-plus: queries per simulated probe (default 20000, at most"
        f" {MAX_PROBE_QUERIES:,})",
    )
    parser.add_argument("--seed", type=int, default=0, help="--kairos-plus: random seed")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=60.0,
        metavar="S",
        help="give up after S seconds with a one-line reason (default 60; a huge budget affords"
        " more mixes than can be ranked)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=Handler("bounds", "run"))


def _plan(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan the cheapest fleet that meets an app's SLO on a trace, within its budget",
        description="Find a feasible instance mix per stage (InferLine Algorithm 1, started from"
        " the Kairos bound), then cut cost greedily while the simulator says the SLO holds"
        f" (Algorithm 2). Simulates at most {PLANNING_QUERIES:,} queries: the"
        " trace's busiest stretch of that many.",
    )
    parser.add_argument("--spec", required=True, type=Path, metavar="FILE", help="app spec YAML")
    parser.add_argument("--trace", required=True, type=Path, metavar="FILE", help="trace CSV")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_pareto_arguments(parser)
    parser.set_defaults(handler=Handler("plan", "run"))


def _replay(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay a trace through a fleet under a scaling policy, or CG-Peak / CG-Mean",
        description="Replay a trace through a fleet while a scaling policy changes it:"
        " InferLine's tuner or a reactive utilisation autoscaler on the fleet of a plan document"
        " (heteroplane plan --json), that plan's fleet unchanged (--policy static), or InferLine's"
        " baselines CG-Peak and CG-Mean (--policy peak|mean), which plan for the trace's peak"
        f" rate (most arrivals in any {PEAK_WINDOW_S:g} s window, --peak-window-s) or mean rate"
        " themselves, on the planning trace scaled to that rate, and keep that fleet. New"
        " instances serve after their boot time and cost from launch. A plan of several stages"
        " (a cascade) replays as one pipeline, static or with one tuner per stage: each stage"
        " scaled on the queries that reach it (the validation records' forwarding), all stages"
        " within the one budget (docs/tuner.md, Cascades).",
    )
    parser.add_argument("--spec", required=True, type=Path, metavar="FILE", help="app spec YAML")
    parser.add_argument(
        "--plan",
        type=Path,
        metavar="FILE",
        help="plan document (JSON) for --policy tuner, utilization and static; peak and mean"
        " make their own",
    )
    parser.add_argument("--trace", required=True, type=Path, metavar="FILE", help="trace CSV")
    parser.add_argument(
        "--tuner",
        choices=("on", "off"),
        default="on",
        help="off: the plan's fleet never changes, as --policy static (default on)",
    )
    parser.add_argument(
        "--policy",
        choices=scaling.replay_names(),
        default=None,
        help="tuner (the default: InferLine's tuner, sized by the load model of --tuner-model),"
        " static (the plan's fleet, unchanged), peak or mean"
        " (CG-Peak, CG-Mean: plan for the trace's peak or mean rate, then static), utilization"
        " (target tracking at 70%%)",
    )
    parser.add_argument(
        "--planning-trace",
        type=Path,
        metavar="FILE",
        help="tuner: the trace its planned envelope comes from; peak, mean: the trace whose"
        " arrivals, scaled to the rate, they plan on (default: the replayed trace's first 10%%);"
        " at least two arrivals at different times",
    )
    parser.add_argument(
        "--tuner-model",
        choices=("curve", "inferline"),
        default=None,
        help="how the tuner sizes each stage: curve (the default: the sizing ladder, the"
        " planner's fleet for the planning trace at 0.2x-5x its rate and for other burstiness,"
        " a 60 s live envelope; for a cascade each stage's fleet in the plans of the whole"
        " cascade; docs/tuner.md) or inferline (InferLine's one provisioning ratio rho and a 60 s"
        " live envelope, for comparison)",
    )
    parser.add_argument(
        "--peak-window-s",
        type=float,
        default=None,
        metavar="S",
        help=f"--policy peak: the window of the peak rate (default {PEAK_WINDOW_S:g} s)",
    )
    parser.add_argument(
        "--dispatch",
        choices=registry.names(),
        default=None,
        help="how the stage's queue is dispatched to its instances, a policy a plan may name"
        " (default: the plan stage's policy, else fcfs)",
    )
    parser.add_argument(
        "--interruptions-per-hour",
        default=None,
        metavar="R",
        help="interrupt the plan's spot instances (its stages' spot_fleet) at R per instance-hour"
        " (or TYPE=R,TYPE=R per type), drawn with --seed: two minutes' notice, the replacement"
        " launched at the notice (docs/spot.md); the plan's fleet as it is (--policy static, the"
        " default with this option), one stage",
    )
    parser.add_argument(
        "--no-admission",
        action="store_true",
        help="serve every query however late, instead of refusing, as the service's admission"
        " control does, a query whose queue cannot be served within the SLO (a refused query"
        " counts as a miss)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=Handler("replay", "run"))


def _loadgen(subparsers: Subparsers) -> None:
    """Add ``loadgen``."""
    parser = subparsers.add_parser(
        "loadgen",
        help="replay a trace against an app's inference endpoint (open loop): p50, p99,"
        " attainment, errors, achieved rate",
        description=_LOADGEN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--url",
        metavar="URL",
        help=f"the service's base URL (default: ${URL_ENV} or {DEFAULT_URL})",
    )
    parser.add_argument("--app", required=True, metavar="APP", help="the app to send queries to")
    parser.add_argument(
        "--trace",
        required=True,
        type=Path,
        metavar="FILE",
        help="trace CSV: arrival_s, batch_size (default 1), optional sample_id",
    )
    parser.add_argument(
        "--token", metavar="T", help=f"API token, scope infer or admin (default: ${TOKEN_ENV})"
    )
    parser.add_argument(
        "--slo-ms",
        type=positive_number,
        metavar="MS",
        help="latency for the attainment (default: the app's SLO, read from the service)",
    )
    parser.add_argument(
        "--timeout-s",
        type=wait_seconds,
        default=LOADGEN_TIMEOUT_S,
        metavar="S",
        help="a query without an answer after this long is a timeout (default %(default)g)",
    )
    parser.add_argument(
        "--progress-s",
        type=wait_seconds,
        default=LOADGEN_PROGRESS_S,
        metavar="S",
        help="seconds between progress lines on stderr (default %(default)g)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=count,
        default=LOADGEN_MAX_IN_FLIGHT,
        metavar="N",
        help="connections open at once at most (default %(default)d)",
    )
    parser.add_argument(
        "--engine",
        choices=("httpx", "raw"),  # controlplane.clients.loadgen.ENGINES (not imported: startup)
        default="httpx",
        help="httpx (any URL, https and proxies included) or raw: HTTP/1.1 keep-alive"
        " connections of our own, http:// only, about a tenth of the CPU per query, for"
        " benchmarks at thousands of q/s (default %(default)s)",
    )
    parser.add_argument(
        "--outcomes",
        type=Path,
        metavar="FILE",
        help="also write every query's outcome to FILE, a CSV: index, send_at_s (scheduled),"
        " kind (ok or the error kind), latency_ms, send_lag_ms, late",
    )
    # Any model's inputs, over /v1 or the Open Inference Protocol (issue 30).
    parser.add_argument(
        "--inputs",
        type=Path,
        metavar="FILE",
        help="the queries' rows instead of the demo's digits: a .npz with one array per model"
        " input (rows first), or a JSON file of Open Inference Protocol rows (an inference"
        " request, or a list of them); rows are drawn in order",
    )
    parser.add_argument(
        "--protocol",
        choices=("v1", "v2"),  # controlplane.clients.tensors.PROTOCOLS
        help="v1: POST /v1/apps/APP/infer; v2: POST /v2/models/APP/infer, the Open Inference"
        " Protocol (default: v2 with --inputs, else v1)",
    )
    parser.add_argument(
        "--binary",
        action="store_true",
        help="with v2: send the inputs as binary tensors (Triton's binary tensor extension)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=Handler("loadgen", "run"))


def _profile(subparsers: Subparsers) -> None:
    """Add ``profile measure``, ``profile show`` and ``profile run``."""
    parser = subparsers.add_parser(
        "profile",
        help="measure the demo model family's latency profiles, summarise a profile file, or"
        " have the service measure an app's registered models",
        description="Measure latency profiles of the demo model family on this machine (and the"
        " emulated instance types derived from it), summarise a profile file, or (run) have the"
        " service measure an app's registered models on the app's instance types.",
    )
    actions = parser.add_subparsers(dest="profile_command", metavar="ACTION")
    actions.required = True

    measure = actions.add_parser(
        "measure",
        help="time the family's models per batch size here, through a worker of each type;"
        " write a profile JSON",
        description="Start a worker agent of each instance type on this machine (the reference"
        f" type {PROFILE_REFERENCE_TYPE}, which serves the models as they are, and the emulated"
        " types, which pad each batch to their model's compute curve over their speed factor),"
        " send each model batches of validation digits at each batch size over kept-alive HTTP"
        " (warm-up calls, then timed calls), and write the profile JSON: per type, model and"
        " batch size the round trips as the serving loop sees them (what the planner reads),"
        " and the compute curves the emulated workers pad to (its 'compute' section). The"
        " emulated types compute in real time, so this takes minutes. --compute-only times the"
        " models' forward pass in this process instead (no serving path). Trains the family"
        " first if its cache lacks it.",
    )
    measure.add_argument(
        "--models", metavar="M1,M2,...", help="models of the family (default: all of them)"
    )
    measure.add_argument(
        "--batch-sizes",
        default=",".join(str(b) for b in PROFILE_BATCH_SIZES),
        metavar="B1,B2,...",
        help="batch sizes to time (default %(default)s)",
    )
    measure.add_argument(
        "--samples",
        type=int,
        default=PROFILE_SAMPLES,
        metavar="N",
        help="timed runs per model and batch size (default %(default)s)",
    )
    measure.add_argument(
        "--warmup",
        type=int,
        default=PROFILE_WARMUP,
        metavar="N",
        help="untimed runs before them (default %(default)s)",
    )
    measure.add_argument(
        "--threads",
        type=int,
        default=PROFILE_THREADS,
        metavar="N",
        help="threads of each worker per batch, or of this process with --compute-only"
        " (default %(default)s)",
    )
    measure.add_argument(
        "--compute-only",
        action="store_true",
        help="time the models' forward pass in this process (no request parsing, JSON or HTTP)"
        " instead of through workers; the emulated types then get the compute their workers"
        " pad to",
    )
    measure.add_argument(
        "--instance-types",
        metavar="T1,T2,...",
        help="emulated types to measure besides the reference (default: every emu.* type of"
        " the catalog)",
    )
    measure.add_argument(
        "--catalog",
        type=Path,
        metavar="FILE",
        help="CSV or JSON of instance types that add to or override the default catalog",
    )
    measure.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="the family's model cache (default: $HETEROPLANE_DATA_DIR/models)",
    )
    measure.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="where to write the profile JSON"
        " (default: $HETEROPLANE_DATA_DIR/profiles/family.json)",
    )
    measure.add_argument("--json", action="store_true", help="print one JSON object")
    measure.set_defaults(handler=Handler("profile", "run_measure"))

    show = actions.add_parser(
        "show",
        help="summarise a profile file: mean latency by model, instance type and batch size",
        description="Summarise a profile file (the project's profile JSON or a Kairos samples"
        " CSV): for each model and instance type, the mean latency at each batch size.",
    )
    show.add_argument("file", type=Path, metavar="FILE", help="the profile file")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(handler=Handler("profile", "run_show"))

    run = actions.add_parser(
        "run",
        help="have the service measure an app's registered models on its instance types",
        description="Ask the service (POST /v1/apps/APP/profiles) to launch one worker per"
        " candidate type of the app (or --types) with the app's registered models, time Open"
        " Inference Protocol batches of random inputs matching each model's signature at each"
        " batch size through them, store the profiles for the planner and stop the workers."
        " The workers must fit the app's budget next to its fleet. EC2 instances take minutes"
        " to boot, the local provisioner's workers seconds to start; the line printed first"
        " says which and how many calls each worker answers. The request waits up to"
        " --timeout (default an hour).",
    )
    _app_option(run)
    run.add_argument("--types", metavar="T1,T2,...", help="types (default: every candidate)")
    run.add_argument(
        "--batch-sizes",
        metavar="B1,B2,...",
        help="batch sizes to time (default: the service's, "
        + ",".join(str(b) for b in PROFILE_BATCH_SIZES)
        + ")",
    )
    run.add_argument(
        "--samples", type=int, metavar="N", help="timed calls per model, type and batch size"
    )
    add_client_options(run)
    for action in run._actions:
        if action.dest == "timeout":
            action.default = None
            action.help = "seconds to wait for the run (default 3600)"
    run.set_defaults(handler=Handler("profile_run", "run_profile_run"))


def _cascade(subparsers: Subparsers) -> None:
    """Add ``cascade evaluate``."""
    parser = subparsers.add_parser(
        "cascade",
        help="evaluate cascades of the demo model family (accuracy against compute)",
        description="Cascades of the demo model family: a query stops at the first model whose"
        " certainty (top-1 minus top-2 softmax score) reaches that stage's threshold.",
    )
    actions = parser.add_subparsers(dest="cascade_command", metavar="ACTION")
    actions.required = True
    evaluate = actions.add_parser(
        "evaluate",
        help="each model alone and the Pareto set of cascades: accuracy, compute, reach",
        description="Train or load the demo family, measure each model's compute per query here"
        " (mean latency at batch size 1), evaluate every chain of models (cheapest first, up to"
        " --max-stages) with every threshold combination of --thresholds on the validation"
        " records, and print each model alone and the Pareto set of cascades (accuracy against"
        " compute per query, with the share of queries reaching each stage). The best cascade"
        f" is the cheapest within {ACCURACY_TOLERANCE * 100:g} points of the most accurate"
        " single model.",
    )
    evaluate.add_argument(
        "--models", metavar="M1,M2,...", help="models of the family to use (default: all)"
    )
    evaluate.add_argument(
        "--max-stages",
        type=int,
        default=DEFAULT_MAX_STAGES,
        metavar="K",
        help="longest chain of models (default %(default)s)",
    )
    evaluate.add_argument(
        "--thresholds",
        default=",".join(f"{h:g}" for h in THRESHOLD_GRID),
        metavar="H1,H2,...",
        help="certainty thresholds to try at each stage, in [0, 1] (default %(default)s)",
    )
    evaluate.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="the family's model cache (default: $HETEROPLANE_DATA_DIR/models)",
    )
    evaluate.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_COMPUTE_SAMPLES,
        metavar="N",
        help="timed runs per model at batch size 1 (default %(default)s)",
    )
    evaluate.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_COMPUTE_WARMUP,
        metavar="N",
        help="untimed runs before them (default %(default)s)",
    )
    evaluate.add_argument(
        "--threads",
        type=int,
        default=PROFILE_THREADS,
        metavar="N",
        help="numpy threads while timing the models (default %(default)s)",
    )
    evaluate.add_argument(
        "--profiles",
        type=Path,
        metavar="FILE",
        help="take compute from this profile file (mean latency at batch size 1) instead of"
        " measuring it",
    )
    evaluate.add_argument(
        "--instance-type",
        metavar="T",
        help=f"with --profiles: whose latency is the compute (default {PROFILE_REFERENCE_TYPE})",
    )
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    registered = evaluate.add_argument_group(
        "an app's registered models (--app): validation records instead of the family's"
    )
    registered.add_argument(
        "--app",
        metavar="APP",
        help="evaluate this app's registered models (fetched from the service) on --data and"
        " write their validation records (heteroplane.validation/v1) instead",
    )
    registered.add_argument(
        "--data",
        type=Path,
        metavar="FILE.npz",
        help="with --app: arrays 'inputs' (the first input's samples) and 'labels'",
    )
    registered.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="with --app: where to write the records (default: APP-validation.json)",
    )
    registered.add_argument(
        "--url", metavar="URL", help=f"the API's base URL (default: ${URL_ENV} or {DEFAULT_URL})"
    )
    registered.add_argument(
        "--token", metavar="TOKEN", help=f"the API token (default: ${TOKEN_ENV})"
    )
    registered.add_argument(
        "--timeout",
        type=wait_seconds,
        default=300.0,
        metavar="S",
        help="seconds to wait for each answer (default %(default)s)",
    )
    evaluate.set_defaults(handler=Handler("cascade", "run_evaluate"))


def _gears(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "gears",
        help="plan a cascade's gears: which cascade and batch caps serve each QPS range",
        description="CascadeServe's gear plan on a fixed placement: evaluate every ordered chain"
        " of the app's models with every threshold combination on the validation records, keep"
        " the Pareto set of accuracy against a throughput bound, simulate the finalists for their"
        " highest load within the latency SLO, and give each QPS range from 0 to the max the most"
        " accurate cascade that serves it (with slo.accuracy in the spec: the fastest one that"
        " meets the accuracy floor).",
    )
    parser.add_argument("--spec", required=True, type=Path, metavar="FILE", help="app spec YAML")
    parser.add_argument(
        "--validation",
        required=True,
        type=Path,
        metavar="FILE",
        help="validation records (heteroplane.validation/v1) of the app's models",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        metavar="FILE",
        help="profile file with every model (default: the ones the spec names)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--placement",
        metavar="TEXT",
        help="instances of each model: 'tiny:c5.xlarge=1;large:c5.xlarge=3,g4dn.xlarge=1'",
    )
    where.add_argument(
        "--plan", type=Path, metavar="FILE", help="take each model's fleet from a plan JSON"
    )
    parser.add_argument(
        "--qps-max",
        type=float,
        metavar="R",
        help=f"top of the planned QPS span, at most {MAX_GEAR_QPS:,.0f} qps (default: the fastest"
        " cascade's max)",
    )
    parser.add_argument(
        "--ranges",
        type=int,
        default=GEAR_RANGES,
        metavar="N",
        help=f"equal QPS ranges (default %(default)s, at most {MAX_GEAR_RANGES:,}); the first is"
        " split further where a more accurate cascade sustains less than its top",
    )
    parser.add_argument(
        "--thresholds",
        default=",".join(f"{h:g}" for h in THRESHOLD_GRID),
        metavar="H1,H2,...",
        help="certainty thresholds to try at each stage, in [0, 1] (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="samples in each query (default 1); every placed profile must measure it: profiles"
        " that start at batch size 10 (the Kairos samples) need --batch-size 10 or more",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=Handler("gears", "run"))


def _db(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "db",
        help="migrate the service's database (upgrade, downgrade, current)",
        description="Bring the configured database (SQLite or PostgreSQL) to a schema revision,"
        " or say which revision it is at.",
    )
    actions = parser.add_subparsers(dest="db_command", metavar="ACTION")
    actions.required = True

    upgrade = actions.add_parser(
        "upgrade", help="migrate up to a revision (default: the newest, 'head')"
    )
    upgrade.add_argument(
        "--revision", type=revision, default="head", metavar="R", help="target (default head)"
    )
    upgrade.set_defaults(handler=Handler("db", "upgrade"))

    downgrade = actions.add_parser(
        "downgrade", help="migrate down to a revision ('base' drops every table)"
    )
    downgrade.add_argument(
        "--revision", type=revision, required=True, metavar="R", help="target revision"
    )
    downgrade.set_defaults(handler=Handler("db", "downgrade"))

    current = actions.add_parser("current", help="print the revision the database is at")
    current.set_defaults(handler=Handler("db", "current"))

    for action in (upgrade, downgrade, current):
        add_config_option(action)
        action.add_argument("--json", action="store_true", help="print one JSON object")


def _token(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "token",
        help="make, list and revoke API tokens",
        description="API tokens for the service's REST API, stored as SHA-256 hashes in the"
        " configured database.",
    )
    actions = parser.add_subparsers(dest="token_command", metavar="ACTION")
    actions.required = True

    create = actions.add_parser(
        "create", help="make a token and print it (alone, on stdout; shown once)"
    )
    create.add_argument(
        "--scope",
        required=True,
        choices=[scope.value for scope in Scope],
        help="admin > operator > viewer; infer: only the inference route",
    )
    create.add_argument("--name", metavar="NAME", help="a name for the token (default: random)")
    create.set_defaults(handler=Handler("token", "create"))

    listing = actions.add_parser("list", help="list tokens (names, scopes, use; never tokens)")
    listing.set_defaults(handler=Handler("token", "list_tokens"))

    revoke = actions.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("--name", required=True, metavar="NAME", help="the token's name")
    revoke.set_defaults(handler=Handler("token", "revoke"))

    for action in (create, listing, revoke):
        add_config_option(action)
        action.add_argument("--json", action="store_true", help="print one JSON object")


def _serve(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the control-plane service: the REST API and the periodic jobs",
        description="Migrate the configured database and serve the REST API (docs/api.md) and"
        " inference, with the scheduler's jobs (tuner tick, reconcile with the capacity"
        " replanner, metric roll-up) in a loops process this one starts and supervises, until"
        " SIGINT or SIGTERM.",
    )
    parser.add_argument("--host", metavar="H", help="address to listen on (default: settings)")
    parser.add_argument(
        "--port", type=port_number, metavar="P", help="port to listen on; 0 picks a free one"
    )
    parser.add_argument(
        "--grpc-port",
        type=port_number,
        metavar="P",
        help="port of the Open Inference Protocol over gRPC (default: settings, 8001); 0 picks"
        " a free one",
    )
    parser.add_argument("--no-grpc", action="store_true", help="serve no gRPC: the REST API alone")
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)"
    )
    parser.add_argument(
        "--role",
        choices=("all", "serving", "loops"),
        default="all",
        help="what this process runs (default all: the API and inference here, the periodic jobs"
        " in a loops process it starts and supervises); serving: the API and inference, no"
        " periodic job; loops: the periodic jobs (under the leader lease) and the API without"
        " inference, reading the serving process at serving_url (docs/service.md, 'Serving"
        " apart from the loops')",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="with --role all: run the periodic jobs in this process too, no loops process"
        " (for debugging)",
    )
    add_config_option(parser)
    parser.set_defaults(handler=Handler("serve", "run"))


def _app(subparsers: Subparsers) -> None:
    actions = _actions(subparsers, "app", "register and manage apps on the service", "app_command")
    apply = actions.add_parser(
        "apply",
        help="register an app from its spec file, or replace the spec of the app of that name",
        description="Read the spec (relative paths resolve against its folder and are sent"
        " absolute, so the service must see the same files), then create the app, or replace its"
        " spec when it exists (a budget change in it is audited).",
    )
    apply.add_argument("-f", "--file", required=True, type=Path, metavar="FILE", help="spec YAML")
    apply.set_defaults(handler=Handler("operate", "app_apply"))
    listing = actions.add_parser("list", help="list the apps")
    listing.set_defaults(handler=Handler("operate", "app_list"))
    get = actions.add_parser("get", help="show an app")
    get.add_argument("name", metavar="NAME")
    get.set_defaults(handler=Handler("operate", "app_get"))
    delete = actions.add_parser("delete", help="delete an app and its history (admin token)")
    delete.add_argument("name", metavar="NAME")
    delete.add_argument(
        "--force", action="store_true", help="even with live instances (their rows only)"
    )
    delete.set_defaults(handler=Handler("operate", "app_delete"))
    down = actions.add_parser(
        "down",
        help="take an app down: drain all its instances, then delete it (admin token)",
        description="Ask the service to drain every instance of the app at once (the disruption"
        " budget does not hold a teardown back) and to delete the app when none is left"
        " (DELETE /v1/apps/NAME?drain=true), then wait for it to be gone, with a line each time"
        " the fleet changes. Setting a budget again (budget set) calls a teardown off.",
    )
    down.add_argument("name", metavar="NAME")
    down.add_argument(
        "--no-wait", action="store_true", help="return once the teardown is asked for"
    )
    down.add_argument(
        "--wait-s",
        type=wait_seconds,
        default=600.0,
        metavar="S",
        help="give up waiting after this long, s (the teardown goes on; default %(default)g)",
    )
    down.add_argument(
        "--poll-s",
        type=wait_seconds,
        default=2.0,
        metavar="S",
        help="how often to look at the fleet while waiting, s (default %(default)g)",
    )
    down.set_defaults(handler=Handler("operate", "app_down"))
    for action in (apply, listing, get, delete, down):
        add_client_options(action)


def _model(subparsers: Subparsers) -> None:
    actions = _actions(
        subparsers,
        "model",
        "push ONNX or TorchScript models to the service's registry and list them",
        "model_command",
    )
    push = actions.add_parser(
        "push",
        help="upload a model file as the next version of NAME",
        description="Upload FILE (streamed) to the service, which inspects it in a separate"
        " process (format, inputs and outputs), stores it and answers the new version: 1 for a"
        " new name, then 2, 3, ...; a file the newest version holds already (the same bytes,"
        " format, inputs and outputs) answers that version, 'unchanged'. Refused with one"
        " line (exit 2): a name that is not a DNS label, a file that is not an ONNX model or"
        " TorchScript archive, one over the service's model_max_bytes, a model without a"
        " dynamic first (batch) dimension.",
    )
    push.add_argument("name", metavar="NAME", help="the model's name (a DNS label)")
    push.add_argument("file", type=Path, metavar="FILE", help="the .onnx or TorchScript file")
    push.add_argument(
        "--format", choices=MODEL_FORMATS, help="the file's format (default: detected)"
    )
    push.add_argument(
        "--inputs",
        metavar="SPEC",
        help="a TorchScript model's inputs when the archive does not name them:"
        " name:FP32:-1x13[,name:...]",
    )
    push.set_defaults(handler=Handler("model", "model_push"))
    listing = actions.add_parser("list", help="every version of every model")
    listing.set_defaults(handler=Handler("model", "model_list"))
    show = actions.add_parser("show", help="a model's versions, or one version (NAME@VERSION)")
    show.add_argument("reference", metavar="NAME[@VERSION]")
    show.set_defaults(handler=Handler("model", "model_show"))
    for action in (push, listing, show):
        add_client_options(action)


def _plans(subparsers: Subparsers) -> None:
    actions = _actions(
        subparsers,
        "plans",
        "preview and apply plans on the service (the offline planner is `heteroplane plan`)",
        "plans_command",
    )
    preview = actions.add_parser(
        "preview",
        help="plan the app on a synthetic trace and store the plan (nothing changes yet)",
        description="Ask the service for a plan on a Poisson trace at --rate-qps (or a gamma"
        " trace with --cv2); the plan is stored, and applied with `plans apply`.",
    )
    _app_option(preview)
    preview.add_argument(
        "--rate-qps",
        required=True,
        type=finite_number,
        metavar="R",
        help=f"arrival rate to plan for (at least {MIN_PLANNING_RATE_QPS:g} qps)",
    )
    preview.add_argument(
        "--cv2",
        type=finite_number,
        metavar="X",
        help="gamma gaps with this CV^2 (default: Poisson)",
    )
    preview.add_argument(
        "--duration", type=finite_number, metavar="S", help="trace length in seconds"
    )
    preview.add_argument(
        "--batch-dist", metavar="SPEC", help="batch sizes: fixed:N, kairos, lognormal:..., ..."
    )
    preview.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    preview.set_defaults(handler=Handler("operate", "plans_preview"))
    listing = actions.add_parser("list", help="list the app's plans")
    _app_option(listing)
    listing.set_defaults(handler=Handler("operate", "plans_list"))
    apply = actions.add_parser("apply", help="apply a previewed plan")
    _app_option(apply)
    apply.add_argument("--id", required=True, type=int, metavar="ID", help="the plan's id")
    apply.add_argument(
        "--wait",
        action="store_true",
        help="then wait until the app serves: GET /v2/models/APP/ready answers 200",
    )
    apply.add_argument(
        "--timeout-s",
        type=wait_seconds,
        default=300.0,
        metavar="S",
        help="with --wait: give up after this long, s (exit status 2; default %(default)g)",
    )
    apply.add_argument(
        "--poll-s",
        type=wait_seconds,
        default=0.5,
        metavar="S",
        help="with --wait: how often to ask, s (default %(default)g)",
    )
    apply.set_defaults(handler=Handler("operate", "plans_apply"))
    for action in (preview, listing, apply):
        add_client_options(action)


def _budget(subparsers: Subparsers) -> None:
    actions = _actions(
        subparsers, "budget", "read or change an app's budget (audited)", "budget_command"
    )
    get = actions.add_parser("get", help="the budget, the fleet's cost and the audit trail")
    _app_option(get)
    get.set_defaults(handler=Handler("operate", "budget_get"))
    put = actions.add_parser(
        "set", help="change the budget; lists the instances to drain if it is below the fleet"
    )
    _app_option(put)
    put.add_argument(
        "--usd-per-hr", required=True, type=finite_number, metavar="X", help="new budget"
    )
    put.add_argument("--reason", required=True, metavar="TEXT", help="why (kept in the audit)")
    put.add_argument(
        "--force",
        action="store_true",
        help="accept a budget below the app's smallest serving fleet (one instance of the"
        " cheapest planned type per stage; without it 409) or one that buys no instance of any"
        " candidate type (without it 422), draining what it cannot pay for",
    )
    put.set_defaults(handler=Handler("operate", "budget_set"))
    for action in (get, put):
        add_client_options(action)


def _fleet(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "fleet",
        help="the instances the service runs (of one app: its fleet by type and cost)",
        description="List the instances the service runs; with --app, the app's live fleet by"
        " instance type and what it costs, then its instances.",
    )
    parser.add_argument("--app", metavar="APP", help="only this app")
    parser.add_argument(
        "--all",
        action="store_true",
        help="list the ended instances (terminated, failed) too, those of the last"
        " instance_retention_days (30 days); without it, the live ones",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="the newest N instances (default 100, at most 10,000)",
    )
    add_client_options(parser)
    parser.set_defaults(handler=Handler("operate", "fleet"))


def _events(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "events",
        help="what happened to an app: decisions and instance events, in time order",
    )
    _app_option(parser)
    parser.add_argument("--since", metavar="TIME", help="only after this ISO 8601 time")
    parser.add_argument(
        "--limit", type=int, default=100, metavar="N", help="the newest N of each (default 100)"
    )
    # --- filter by kind and collapse repeats (issues 29 and 35) ---
    parser.add_argument(
        "--kind",
        action="append",
        metavar="KIND[,KIND]",
        help="only these decision kinds (gear_switch, scale_up, ...; 'instance' for the"
        " instances' events); repeatable; --limit counts after the filter",
    )
    parser.add_argument(
        "--exclude-kind",
        action="append",
        metavar="KIND[,KIND]",
        help="none of these kinds ('instance': no instance events); repeatable",
    )
    parser.add_argument(
        "--no-collapse",
        action="store_true",
        help="one line per record (default: a run of the same kind is one line with its count"
        " and time span)",
    )
    # --- end of the kind options ---
    add_client_options(parser)
    parser.set_defaults(handler=Handler("operate", "events"))


def _actions(subparsers: Subparsers, name: str, help_text: str, dest: str) -> Any:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    actions = parser.add_subparsers(dest=dest, metavar="ACTION")
    actions.required = True
    return actions


def _app_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", required=True, metavar="APP", help="the app's name")


def add_profiles_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profiles",
        required=True,
        type=Path,
        metavar="FILE",
        help="latency profiles: a Kairos samples CSV (.csv or .csv.gz) or a profile JSON",
    )
    parser.add_argument(
        "--catalog",
        type=Path,
        metavar="FILE",
        help="CSV or JSON of instance types that add to or override the default EC2 catalog",
    )


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("workload (a trace file, or a generated Poisson trace)")
    source.add_argument("--trace", type=Path, metavar="FILE", help="trace CSV (arrival_s, ...)")
    source.add_argument("--qps", type=float, metavar="R", help="Poisson arrival rate, queries/s")
    source.add_argument("--duration", type=float, metavar="S", help="generated trace length, s")
    source.add_argument(
        "--batch-dist",
        metavar="SPEC",
        help="batch size of each generated query: fixed:N, kairos, lognormal:mu=..,sigma=..,"
        " gaussian:mean=..,sd=.. (default: every query has batch size 1)",
    )


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="settings YAML (default: $HETEROPLANE_CONFIG; HETEROPLANE_* variables win over it)",
    )


def add_pareto_arguments(parser: argparse.ArgumentParser) -> None:
    """``--pareto``, ``--validation`` and ``--thresholds`` on ``plan``'s parser."""
    group = parser.add_argument_group("Pareto front of a cascade (--pareto)")
    group.add_argument(
        "--pareto",
        action="store_true",
        help="print the latency/accuracy Pareto front of the app's cascade instead of a plan:"
        " per threshold setting, Cascadia's MILP allocation of instances to stages (worst stage"
        " latency, M/D/1) at the trace's rate, within the budget and max_counts",
    )
    group.add_argument(
        "--validation",
        type=Path,
        metavar="FILE",
        help="validation records (heteroplane.validation/v1) of the cascade's models",
    )
    group.add_argument(
        "--thresholds",
        metavar="H1,H2,...",
        help="certainty thresholds to sweep at each stage, in [0, 1] (default"
        f" {','.join(f'{h:g}' for h in PARETO_GRID)})",
    )


# --- rollout -----------------------------------------------------------------------------------


def percent_steps(text: str) -> list[float]:
    """argparse type of ``--steps 5,25,50,100``: percentages, increasing, the last 100."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected percentages like 5,25,50,100, got {text!r}"
        ) from None
    ok = all(math.isfinite(v) and 0 < v <= 100 for v in values) and all(
        a < b for a, b in itertools.pairwise(values)
    )
    if not values or not ok or values[-1] != 100:
        raise argparse.ArgumentTypeError(
            f"steps must increase, each in (0, 100], the last 100; got {text}"
        )
    # The service keeps a share to six places (0.0001 %): refused here as it would be there,
    # in the option's terms (it answered "got 0,1" to 1e-9,100).
    kept = [round(v / 100.0, 6) for v in values]
    if kept[0] <= 0 or any(a >= b for a, b in itertools.pairwise(kept)):
        raise argparse.ArgumentTypeError(
            "steps are kept to 0.0001 %: each at least 0.0001 and at least 0.0001 above the"
            f" one before; got {text}"
        )
    return values


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(text: str) -> float:
    """argparse type of ``--interval``: ``90``, ``90s``, ``2m`` or ``1h``, in seconds > 0."""
    unit = text[-1:] if text[-1:] in _DURATION_UNITS else "s"
    number = text[:-1] if text[-1:] in _DURATION_UNITS else text
    try:
        value = float(number) * _DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration (90s, 2m, 1h): {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"a duration must be a finite number > 0, got {text}")
    return value


def _rollout(subparsers: Subparsers) -> None:
    actions = _actions(
        subparsers,
        "rollout",
        "move a new model version into a running app step by step (canary, shadow), judged"
        " after each interval: promoted or rolled back (docs/rollouts.md)",
        "rollout_command",
    )
    start = actions.add_parser(
        "start", help="start a rollout of NAME@VERSION (a registry model the app serves)"
    )
    _app_option(start)
    start.add_argument("--model", required=True, metavar="NAME@VERSION", help="the new version")
    start.add_argument(
        "--steps",
        type=percent_steps,
        default=[5.0, 25.0, 50.0, 100.0],
        metavar="P,P,...",
        help="percent of the queries on the new version, step by step (default 5,25,50,100)",
    )
    interval = start.add_mutually_exclusive_group()
    interval.add_argument(
        "--interval-s",
        type=positive_number,
        default=120.0,
        metavar="S",
        help="the least time a step lasts before it is judged, s (default %(default)g)",
    )
    interval.add_argument(
        "--interval",
        type=duration_s,
        dest="interval_s",
        metavar="DURATION",
        help="the same as a duration: 90s, 2m, 1h",
    )
    start.add_argument(
        "--shadow",
        action="store_true",
        help="first a shadow step: every query also goes to the new version, whose answers are"
        " compared with the old one's and discarded",
    )
    start.add_argument(
        "--validation-data",
        type=Path,
        metavar="FILE.npz",
        help="a cascade member: labelled data (arrays inputs, labels) the app's models run on"
        " here, the new version in its place; the service re-derives the cascade's thresholds"
        " on the records and states the held-out accuracy before traffic moves",
    )
    start.add_argument(
        "--max-p99-ms", type=positive_number, metavar="MS", help="roll back above (default: SLO)"
    )
    start.add_argument(
        "--max-error-share",
        type=finite_number,
        metavar="X",
        help="roll back above (default 0.01; before --min-queries, once the sample is clear)",
    )
    start.add_argument(
        "--min-agreement-share",
        type=finite_number,
        metavar="X",
        help="in shadow, roll back below this agreement with the old version (default 0.95)",
    )
    start.add_argument(
        "--min-queries",
        type=count,
        metavar="N",
        help="queries a step needs before it may advance (default 50)",
    )
    start.add_argument(
        "--min-accuracy",
        type=finite_number,
        metavar="X",
        help="roll back below this accuracy on labelled samples (queries naming validation"
        " samples; default: not judged)",
    )
    start.set_defaults(handler=Handler("rollout", "rollout_start"))
    status = actions.add_parser("status", help="the app's rollout: state, step, figures")
    _app_option(status)
    status.add_argument("--id", type=count, metavar="N", help="a rollout (default: the latest)")
    status.set_defaults(handler=Handler("rollout", "rollout_status"))
    parsers = [start, status]
    for name, text in (
        ("pause", "hold the active rollout where it is"),
        ("resume", "let a paused rollout go on"),
        ("abort", "end the active rollout: every query back on the old version at once"),
    ):
        action = actions.add_parser(name, help=text)
        _app_option(action)
        action.set_defaults(handler=Handler("rollout", "rollout_action"))
        parsers.append(action)
    for action in parsers:
        add_client_options(action)
