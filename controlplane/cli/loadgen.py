"""``heteroplane loadgen``: replay a trace against an app's inference endpoint, open loop.

Each row of the trace (``arrival_s``, ``batch_size``, optional ``sample_id``) is one query to
``POST /v1/apps/APP/infer``, sent at its arrival time whatever the answers do; its inputs are the
demo family's validation samples (the row's ``sample_id``, else the row's index, and the ones
after it for a batch: :mod:`controlplane.clients.loadgen`). The samples are the digits of the
family's validation split, rebuilt from the seed in the app's validation records when that file can
be read here (else the family's default seed), so sample i is the one the records describe.

Progress goes to stderr every ``--progress-s`` seconds; at the end it prints the queries sent,
answered and failed (by kind: HTTP status, timeout, connection), p50 and p99 of the end-to-end
latency, the attainment (share of sent queries answered within the app's SLO, read from ``GET
/v1/apps/APP`` unless ``--slo-ms`` gives it) and the achieved rate; ``--json`` prints the
contract's object instead. A token of scope ``infer`` cannot read the app: give ``--slo-ms``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.cli.client import (
    DEFAULT_URL,
    TOKEN_ENV,
    URL_ENV,
    ApiClient,
    ApiClientError,
    app_path,
)
from controlplane.cli.output import UsageError, emit, progress
from controlplane.cli.profile import load_family
from estimator.traces import read_trace_csv

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from controlplane.clients.loadgen import LoadProgress, LoadSummary

__all__ = ["AppTarget", "app_target", "register", "validation_inputs"]

# Reading the app takes milliseconds; a service that does not answer in this long is not up.
_APP_TIMEOUT_S = 30.0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``loadgen``."""
    from controlplane.clients import loadgen

    parser = subparsers.add_parser(
        "loadgen",
        help="replay a trace against an app's inference endpoint (open loop): p50, p99,"
        " attainment, errors, achieved rate",
        description=__doc__,
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
        type=_positive,
        metavar="MS",
        help="latency for the attainment (default: the app's SLO, read from the service)",
    )
    parser.add_argument(
        "--timeout-s",
        type=_positive,
        default=loadgen.DEFAULT_TIMEOUT_S,
        metavar="S",
        help="a query without an answer after this long is a timeout (default %(default)g)",
    )
    parser.add_argument(
        "--progress-s",
        type=_positive,
        default=loadgen.DEFAULT_PROGRESS_S,
        metavar="S",
        help="seconds between progress lines on stderr (default %(default)g)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=_count,
        default=loadgen.DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help="connections open at once at most (default %(default)d)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


@dataclass(frozen=True, slots=True)
class AppTarget:
    """What the run needs to know of the app: its SLO (and where it came from) and the seed of
    its validation records (``None``: not readable here)."""

    slo_ms: float
    seed: int | None
    source: str


def app_target(client: ApiClient, app: str, slo_ms: float | None) -> AppTarget:
    """The app's SLO (``slo_ms`` when given) and the seed of its validation split (``None``: the
    records are not readable here), from ``GET /v1/apps/APP``. One-line errors: an unknown app,
    a bad token, a service that does not answer, or a token that cannot read the app without
    ``--slo-ms``."""
    try:
        document = client.get(app_path(app))
    except ApiClientError as error:
        if error.status == 403 and slo_ms is not None:
            return AppTarget(slo_ms, None, "--slo-ms (the token cannot read the app)")
        if error.status == 403:
            raise UsageError(
                f"{error}; a token of scope infer cannot read the app's SLO: give --slo-ms"
            ) from None
        raise
    spec = document.get("spec", {}) if isinstance(document, dict) else {}
    if slo_ms is None:
        latency = spec.get("slo", {}).get("latency_ms") if isinstance(spec, dict) else None
        if not isinstance(latency, int | float) or not latency > 0:
            raise UsageError(f"app {app!r}: the service gave no SLO latency; give --slo-ms")
        slo_ms, source = float(latency), f"the app's p{_percentile(spec):g} SLO"
    else:
        source = "--slo-ms"
    validation = spec.get("validation") if isinstance(spec, dict) else None
    return AppTarget(slo_ms, _records_seed(validation), source)


def _percentile(spec: dict[str, Any]) -> float:
    value = spec.get("slo", {}).get("percentile", 99.0)
    return float(value) if isinstance(value, int | float) else 99.0


def _records_seed(path: object) -> int | None:
    """The ``seed`` of the validation records at ``path`` when they can be read here."""
    if not isinstance(path, str):
        return None
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    seed = document.get("seed") if isinstance(document, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def validation_inputs(seed: int | None) -> NDArray[np.float32]:
    """The demo family's validation pixels, (n, 64), in the order of its validation records."""
    family = load_family()
    split = family.load_split(family.SEED if seed is None else seed)
    inputs: NDArray[np.float32] = split.validation_inputs
    return inputs


def run(args: argparse.Namespace) -> int:
    from controlplane.clients import loadgen

    url: str = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    token: str | None = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise UsageError(f"no API token: pass --token or set {TOKEN_ENV}")
    client = ApiClient(url, token, _APP_TIMEOUT_S)  # checks the URL's shape
    trace = read_trace_csv(args.trace)
    if len(trace) == 0:
        raise UsageError(f"--trace {args.trace}: the trace has no queries")
    target = app_target(client, args.app, args.slo_ms)
    try:
        queries = loadgen.build_queries(trace, validation_inputs(target.seed))
    except ValueError as error:
        raise UsageError(f"--trace {args.trace}: {error}") from None
    duration_s = queries[-1].send_at_s
    offered = f", {(len(queries) - 1) / duration_s:.1f} qps offered" if duration_s > 0 else ""
    progress(
        f"loadgen: {len(queries)} queries over {duration_s:.1f} s{offered} to"
        f" {loadgen.infer_url(client.url, args.app)}; SLO {target.slo_ms:g} ms ({target.source})"
    )

    def show(snapshot: LoadProgress) -> None:
        progress(snapshot.line())

    result = loadgen.run_load(
        queries,
        loadgen.infer_url(client.url, args.app),
        token,
        timeout_s=args.timeout_s,
        max_in_flight=args.max_in_flight,
        progress=show,
        progress_every_s=args.progress_s,
    )
    summary = result.summary(target.slo_ms)
    return emit(args.json, summary.to_json(), lambda: human(summary, duration_s))


def human(summary: LoadSummary, offered_s: float) -> str:
    """The summary as a few lines of text."""
    offered = (
        f" (offered {(summary.sent - 1) / offered_s:.1f} qps)"
        if offered_s > 0 and summary.sent > 1
        else ""
    )
    kinds = ", ".join(f"{kind} {count}" for kind, count in summary.errors_by_kind.items())
    lines = [
        f"sent {summary.sent} queries in {summary.duration_s:.1f} s{offered}: answered"
        f" {summary.answered} ({summary.achieved_qps:.1f} qps achieved), errors {summary.errors}"
        + (f" ({kinds})" if kinds else ""),
    ]
    if summary.p50_ms is None or summary.p99_ms is None:
        lines.append("latency: no query was answered")
    else:
        lines.append(f"latency: p50 {summary.p50_ms:.1f} ms, p99 {summary.p99_ms:.1f} ms")
    if summary.attainment is not None and summary.slo_ms is not None:
        lines.append(
            f"attainment: {summary.attainment * 100:.2f}% of the queries sent were answered"
            f" within {summary.slo_ms:g} ms"
        )
    if summary.send_lag_p99_ms is not None and summary.send_lag_p99_ms > 5.0:
        lines.append(
            f"note: the generator fell behind its schedule (p99 send lag"
            f" {summary.send_lag_p99_ms:.1f} ms); the latencies include it"
        )
    return "\n".join(lines)
