"""``heteroplane loadgen``: replay a trace against an app's inference endpoint, open loop.

The sending and the statistics are :mod:`controlplane.clients.loadgen`; this module reads the
app's SLO and validation seed from the service, builds the queries from the trace and the demo
family's validation samples, and prints the summary. What the command does, for its user, is its
description (``heteroplane loadgen --help``), kept in :mod:`controlplane.cli.parsers` so that the
help needs none of this module's imports.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse
from collections.abc import Sequence
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
from controlplane.clients import loadgen
from controlplane.clients.loadgen import LoadProgress, LoadSummary, Query, QueryResult
from controlplane.clients.tensors import InputSpec, fit_inputs, input_specs, read_inputs
from estimator.traces import Trace, read_trace_csv

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["AppTarget", "app_target", "build", "model_inputs", "run", "validation_inputs"]

# Reading the app takes milliseconds; a service that does not answer in this long is not up.
_APP_TIMEOUT_S = 30.0

# The exit status of a run in which not one query was answered: the report is printed, but a
# script (or CI) must not read such a run as a success. Bad input stays EXIT_BAD_INPUT (2).
EXIT_NOTHING_ANSWERED = 1


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
    except (OSError, ValueError, RecursionError):
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
    url: str = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    token: str | None = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        raise UsageError(f"no API token: pass --token or set {TOKEN_ENV}")
    if args.engine == "raw" and not url.startswith("http://"):
        raise UsageError(f"--engine raw sends to http:// URLs only, got {url}")
    client = ApiClient(url, token, _APP_TIMEOUT_S)  # checks the URL's shape
    trace = read_trace_csv(args.trace)
    if len(trace) == 0:
        raise UsageError(f"--trace {args.trace}: the trace has no queries")
    protocol: str = args.protocol or ("v2" if args.inputs is not None else "v1")
    if args.binary and protocol != "v2":
        raise UsageError(
            "--binary sends binary tensors over the Open Inference Protocol: --protocol v2"
        )
    with client:
        target = app_target(client, args.app, args.slo_ms)
        # Over v1 too: the rows are checked against the app's inputs before anything is sent.
        specs = model_inputs(client, args.app)
    queries = build(args, trace, target, specs, protocol)
    if args.outcomes is not None:
        # Before sending: a file that cannot be written is found now, not after the run.
        _writable(args.outcomes)
    duration_s = queries[-1].send_at_s
    offered = f", {(len(queries) - 1) / duration_s:.1f} qps offered" if duration_s > 0 else ""
    progress(
        f"loadgen: {len(queries)} queries over {duration_s:.1f} s{offered} to"
        f" {loadgen.infer_url(client.url, args.app, protocol)}; SLO {target.slo_ms:g} ms"
        f" ({target.source})"
    )

    def show(snapshot: LoadProgress) -> None:
        progress(snapshot.line())

    result = loadgen.run_load(
        queries,
        loadgen.infer_url(client.url, args.app, protocol),
        token,
        timeout_s=args.timeout_s,
        max_in_flight=args.max_in_flight,
        progress=show,
        progress_every_s=args.progress_s,
        engine=args.engine,
    )
    summary = result.summary(target.slo_ms)
    status = emit(args.json, summary.to_json(), lambda: human(summary, duration_s))
    if args.outcomes is not None:  # after the summary: a failed write does not lose it
        write_outcomes(args.outcomes, queries, result.outcomes)
    if summary.answered == 0:
        errors = _kinds(summary)
        if args.json:  # the human summary, which says why, went unprinted
            for line in _examples(summary):
                progress(line)
        progress(
            f"heteroplane loadgen: not one query was answered ({summary.sent} sent"
            + (f"; errors: {errors}" if errors else "")
            + f"): exit status {EXIT_NOTHING_ANSWERED}"
        )
        return EXIT_NOTHING_ANSWERED
    return status


def _kinds(summary: LoadSummary) -> str:
    """``http_503 3, timeout 1``: the errors by kind."""
    return ", ".join(f"{kind} {count}" for kind, count in summary.errors_by_kind.items())


def _examples(summary: LoadSummary) -> list[str]:
    """One line per error kind the service said something of: its first message."""
    return [f"{kind}, e.g.: {message}" for kind, message in summary.error_examples.items()]


def model_inputs(client: ApiClient, app: str) -> list[InputSpec]:
    """The app's inputs, from ``GET /v2/models/APP`` (one-line errors)."""
    document = client.get(f"/v2/models/{urllib.parse.quote(app, safe='')}")
    try:
        return input_specs(document)
    except ValueError as error:
        raise UsageError(f"app {app!r}: {error}") from None


def build(
    args: argparse.Namespace,
    trace: Trace,
    target: AppTarget,
    specs: list[InputSpec],
    protocol: str,
) -> list[Query]:
    """The run's queries: rows of ``--inputs`` (or the demo's digits) checked against the app's
    inputs ``specs`` (a misfit is a one-line UsageError before anything is sent), as
    ``protocol`` bodies; the digits over ``/v1`` as before, with their sample ids. A trace with
    a query of more rows than the service takes is refused first."""
    try:
        loadgen.check_batch_sizes(trace)
    except ValueError as error:
        raise UsageError(f"--trace {args.trace}: {error}") from None
    if args.inputs is not None:
        try:
            arrays = read_inputs(args.inputs)
        except ValueError as error:
            raise UsageError(f"--inputs {error}") from None
        where = f"--inputs {args.inputs}"
    else:
        arrays = {"input": validation_inputs(target.seed)}
        where = "the demo's digits"
    try:
        fitted = fit_inputs(arrays, specs)
    except ValueError as error:
        raise UsageError(f"{where}: app {args.app!r}: {error}") from None
    if args.inputs is None and protocol == "v1":
        try:
            return loadgen.build_queries(trace, arrays["input"])
        except ValueError as error:
            raise UsageError(f"--trace {args.trace}: {error}") from None
    try:
        return loadgen.build_tensor_queries(
            trace, fitted, specs, protocol, args.binary, args.timeout_s
        )
    except ValueError as error:
        raise UsageError(f"{where}: app {args.app!r}: {error}") from None


def _writable(path: Path) -> None:
    """Refuse a path the outcomes could not be written to, leaving an existing file as it is."""
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"--outcomes {path}: is a folder")
    if not folder.is_dir():
        raise UsageError(f"--outcomes {path}: no folder {folder}")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise UsageError(f"--outcomes {path}: not writable")


def write_outcomes(path: Path, queries: Sequence[Query], outcomes: Sequence[QueryResult]) -> None:
    """Every query's outcome as a CSV row (``--outcomes``): its trace index, scheduled send
    time (s from the start), kind, latency from the scheduled send and send lag (ms), and the
    service's late flag (empty when it gave none)."""
    rows = ["index,send_at_s,kind,latency_ms,send_lag_ms,late\n"]
    for o in outcomes:
        late = "" if o.late is None else str(o.late).lower()
        rows.append(
            f"{o.index},{queries[o.index].send_at_s:.6f},{o.kind},{o.latency_ms:.3f},"
            f"{o.send_lag_ms:.3f},{late}\n"
        )
    try:
        path.write_text("".join(rows), encoding="utf-8")
    except OSError as error:
        raise UsageError(f"--outcomes {path}: {error.strerror or error}") from None


def human(summary: LoadSummary, offered_s: float) -> str:
    """The summary as a few lines of text."""
    offered = (
        f" (offered {(summary.sent - 1) / offered_s:.1f} qps)"
        if offered_s > 0 and summary.sent > 1
        else ""
    )
    kinds = _kinds(summary)
    lines = [
        f"sent {summary.sent} queries in {summary.duration_s:.1f} s{offered}: answered"
        f" {summary.answered} ({summary.achieved_qps:.1f} qps achieved), errors {summary.errors}"
        + (f" ({kinds})" if kinds else ""),
    ]
    lines.extend(_examples(summary))
    if summary.p50_ms is None or summary.p99_ms is None:
        lines.append("latency: no query was answered")
    else:
        lines.append(f"latency: p50 {summary.p50_ms:.1f} ms, p99 {summary.p99_ms:.1f} ms")
    if summary.outside_p50_ms is not None and summary.outside_p99_ms is not None:
        lines.append(
            f"outside the service's own time: p50 {summary.outside_p50_ms:.1f} ms, p99"
            f" {summary.outside_p99_ms:.1f} ms (this client, the connection, the server's HTTP)"
        )
    if summary.queue_p50_ms is not None and summary.queue_p99_ms is not None:
        lines.append(
            f"in the service's queue: p50 {summary.queue_p50_ms:.1f} ms, p99"
            f" {summary.queue_p99_ms:.1f} ms (admission, the stages' queues, the event loop)"
        )
    if summary.late_by_service is not None:
        lines.append(
            f"late by the service's own count: {summary.late_by_service} of the"
            f" {summary.answered} answered"
        )
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
