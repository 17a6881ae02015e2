"""Profile runs: the latency profiles of an app's registered models, measured by the service on
the instance types it would serve them on.

A model a user brings (``artifact:`` in the spec, :mod:`controlplane.registry`) has no profile
file; :func:`run_profile` (``POST /v1/apps/{app}/profiles``, ``heteroplane profile run``) makes
one:

1. **One run at a time.** A second run of an app while one is in progress is refused
   (:class:`ProfileRunInProgressError`, 409, naming the run): the older run would otherwise
   store its profiles over the newer one's when it ended last. A run is in progress while a
   row of its workers is kept (requested, pending, running) and touched within
   :data:`RUN_GONE_BEATS` heartbeats: a run that ended moved its rows out (step 6), and one
   that died with its replica (a crash, a restart) stops beating, so its rows hold the app for
   a few heartbeats at most, whether or not the reconciler has reaped them yet. A run records
   its rows (step 2) before it looks for another, as the budget check does: two asked for at
   the same moment may both be refused (each finds the other's rows), never both taken. A
   rollout's timing of a new version (``serve``) stores nothing and is neither refused nor a
   run that refuses. Before any row, the request itself is checked (the types, the batch
   sizes, a batch's bytes, and a batch size the app's current profiles say takes longer than
   a worker call may: :func:`predicted_ms` past the profiler's
   :data:`~controlplane.apps.profiler.CALL_TIMEOUT_S`).
2. **Rows first.** One worker per type profiled runs next to the app's fleet. Each gets an
   instance row of the app (request id ``profile:<app>-<run>-<type>``,
   :data:`~controlplane.policies.lifecycle.PROFILE_REQUEST_PREFIX`) *before* the provider is
   asked for it, as the reconciler records its own launches: the row counts against the budget
   while the worker lives, ``app down`` ends it, and the reconciler reaps it when the run is gone.
3. **Budget.** With the rows recorded, everything the app pays for must stay within its budget,
   else :class:`~controlplane.errors.ProfilingBudgetError` naming the cost (and the rows are
   ended unlaunched): its kept rows (the fleet, other runs' workers, these) plus every instance
   the provider lists with the app's tags that has no live row (an orphan the reconciler has not
   ended yet still costs money). Recording before checking means two runs at once can both be
   refused, never both admitted past the budget.
4. **Workers.** One worker per type, launched through the service's provisioner with the app's
   artifacts (the reconciler's :class:`~provisioners.base.LaunchRequest`, so EC2 workers get
   the same user data the app's own would), tagged with the app, :data:`PROFILE_RUN_TAG` and
   their row's id. While the run lasts, a heartbeat thread touches the rows every
   ``heartbeat_s``; the reconciler (:mod:`controlplane.loops.reconciler`, rule 8) terminates a
   profile worker whose row has not been touched for its ``profile_run_timeout_s``: the run died
   with its replica (a crash, a failover). The reconciler never counts these rows against the
   desired fleet, and the serving loop never sends them traffic. The run waits for each worker's
   address and for ``GET /v2/health/ready``.
5. **Measurement,** as :func:`controlplane.apps.profiler.measure_serving_path` measures the
   serving path: per batch size, every type's worker at once (a thread and a kept-alive
   connection each), warm-up rounds then ``samples`` timed rounds, each round sending every
   model in turn one batch; a sample is the round trip of an Open Inference Protocol v2
   ``POST /v2/models/{m}/infer`` of random inputs matching the model's signature (uniform in
   [0, 1) for floats, small integers otherwise; a dynamic dimension past the batch is 1).
6. **Cleanup.** The workers are ended in a ``finally``, after a failure too: their rows move to
   ``terminating`` (written before the provider is asked), the provider terminates them, and the
   rows of workers the provider no longer runs become ``terminated``. That ends the run for
   step 1 too.
7. **Result.** The profile JSON document (``estimator.profiles``' format, what the resolver
   reads for the app's artifact models) is stored with ``store.put_app_profiles``, the resolver
   forgets the app's old ones, and a ``profiles_measured`` decision is recorded.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from controlplane.apps.profiler import (
    CALL_TIMEOUT_S,
    DEFAULT_BATCH_SIZES,
    DEFAULT_WARMUP,
    ProfilingError,
    WorkerClient,
)
from controlplane.apps.resolver import AppResolver
from controlplane.apps.teardown import refuse_torn_down
from controlplane.clock import Clock, SystemClock
from controlplane.crashpoints import crash_point
from controlplane.errors import (
    ConflictError,
    ControlPlaneError,
    InvalidValueError,
    NotFoundError,
    ProfilingBudgetError,
)
from controlplane.policies.lifecycle import (
    KEPT_STATES,
    LIVE_STATES,
    PROFILE_REQUEST_PREFIX,
    InstanceState,
    is_profile_worker,
    profiling_group,
)
from controlplane.spec import SpecError, parse_artifact
from estimator.errors import EstimatorError
from estimator.profiles import LatencyProfile, profiles_document
from provisioners.base import (
    APP_TAG,
    INSTANCE_TAG,
    MANAGED_TAG,
    PLAN_TAG,
    LaunchRequest,
    ProvisionedInstance,
    Provisioner,
    with_port,
)
from provisioners.errors import ProvisionerError

if TYPE_CHECKING:
    from datetime import datetime

    from controlplane.db.store import AppRecord, InstanceRecord, Store
    from controlplane.db.store.decisions import Words
    from controlplane.spec import ResolvedApp
    from provisioners.artifacts import ArtifactRef, ModelSignature, TensorSpec

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_SAMPLES",
    "LOCAL_PROVISIONERS",
    "PROFILE_RUN_TAG",
    "RUN_GONE_BEATS",
    "ProfileRunCheck",
    "ProfileRunInProgressError",
    "ProfileRunRequest",
    "ProfileRunResult",
    "ProfilingInterruptedError",
    "ProfilingRequestError",
    "check_profile_run",
    "end_workers",
    "ended_reason",
    "launch_worker",
    "moved_profiles",
    "predicted_ms",
    "random_inputs",
    "run_profile",
    "unrecorded_cost",
]

logger = logging.getLogger(__name__)

PROFILE_RUN_TAG = "heteroplane:profile-run"
# The plan tag of a profile run's workers (they serve no plan).
PROFILE_PLAN = "profile"
# Fewer than the profiler's 30: every sample here is a paid machine's time.
DEFAULT_SAMPLES = 20
# An EC2 worker boots, installs and loads its models in a few minutes (the reconciler's
# straggler timeout is ten).
DEFAULT_START_TIMEOUT_S = 600.0
# How often a run touches its workers' rows (the reconciler reaps them after a few missed beats:
# its profile_run_timeout_s, by default four of these).
DEFAULT_HEARTBEAT_S = 10.0
# The largest batch a run sends a worker, bytes: the setting oip_body_max_bytes's default (the
# service passes its own), the most a worker's inference body may be.
DEFAULT_MAX_BATCH_BYTES = 64 << 20
# Provisioners whose workers are processes on the service's machine (seconds to start), not
# instances that boot (minutes): what ``heteroplane profile run`` tells its user to expect.
LOCAL_PROVISIONERS = frozenset({"local", "fake"})
# A run whose rows went untouched for this many heartbeats is gone (its replica crashed): the
# reconciler reaps its workers then (its PROFILE_RUN_MISSED_BEATS is this).
RUN_GONE_BEATS = 4
_POLL_S = 0.5
_BUDGET_SLACK_USD_PER_HR = 1e-9
DECISION_KIND = "profiles_measured"

ProgressFn = Callable[[str], None]


# A worker in one of these was moved out of service (by the run's end, or before it).
_ENDED_STATES = frozenset(state.value for state in InstanceState if state not in KEPT_STATES)


class ProfilingInterruptedError(ConflictError):
    """A profile run whose workers the control plane ended before it was done (the budget
    guard on a budget cut, a teardown): a 409 saying why, not the 502 of a failing worker."""


def ended_reason(store: Store, instance_id: str) -> str | None:
    """The first line of the reason of the move that took an instance out of service (to
    ``terminating`` or ``failed``: the budget guard's, a teardown's, a failed launch's); None
    when no such move says why."""
    for event in store.list_instance_events(instance_id=instance_id):
        if event.to_state in ("terminating", "failed") and event.reason:
            return event.reason.splitlines()[0]
    return None


def _ended_meanwhile(store: Store, rows: Sequence[InstanceRecord]) -> str | None:
    """Which of the run's ``rows`` the control plane moved out of service before the run ended
    them, and why (:func:`ended_reason`); None when none was."""
    for row in rows:
        now = store.get_instance(row.id)
        if now.state not in _ENDED_STATES:
            continue
        why = ended_reason(store, row.id)
        said = f"its {now.instance_type} worker was ended during the run"
        return said if why is None else f"{said}: {why[:300]}"
    return None


class ProfileRunInProgressError(ConflictError):
    """A profile run of an app that has one in progress (module docstring, step 1): ``run`` its
    id, ``by`` who started it (None where its rows do not say), ``since`` when, ``types`` its
    workers' types."""

    def __init__(
        self, app: str, run: str, by: str | None, since: datetime, types: Sequence[str]
    ) -> None:
        self.app, self.run, self.by, self.since, self.types = app, run, by, since, tuple(types)
        who = "" if by is None else f" by {by}"
        super().__init__(
            f"app {app!r} has a profile run in progress: run {run}{who} on {', '.join(types)},"
            f" started {since.isoformat(timespec='seconds')}; wait for it to end"
        )


@dataclass(frozen=True, slots=True)
class _Run:
    """A profile run of an app as its kept rows show it: its id, its first row (recorded
    first: when it started, and who started it) and its workers' types."""

    run: str
    first: InstanceRecord
    types: tuple[str, ...]


def _runs_in_progress(store: Store, app: str, now: datetime, gone_after_s: float) -> list[_Run]:
    """The profile runs of ``app`` in progress (module docstring, step 1), oldest first: kept
    rows of a run (not a rollout's) touched within ``gone_after_s``."""
    rows: dict[str, list[InstanceRecord]] = {}
    for row in store.list_instances(app, KEPT_STATES, request_prefix=PROFILE_REQUEST_PREFIX):
        group = profiling_group(app, row.request_id)
        if group.startswith("run ") and (now - row.updated_at).total_seconds() <= gone_after_s:
            rows.setdefault(group.removeprefix("run "), []).append(row)
    runs = [
        _Run(run, min(found, key=lambda r: r.created_at), tuple(r.instance_type for r in found))
        for run, found in rows.items()
    ]
    return sorted(runs, key=lambda run: run.first.created_at)


def _refuse_a_second_run(
    store: Store,
    app: str,
    now: datetime,
    heartbeat_s: float,
    ours: Sequence[InstanceRecord] = (),
) -> None:
    """:class:`ProfileRunInProgressError` naming the oldest run of ``app`` in progress but ours
    (``ours``: this run's rows, recorded; none: a check before any row)."""
    own = {row.id for row in ours}
    for run in _runs_in_progress(store, app, now, RUN_GONE_BEATS * heartbeat_s):
        if run.first.id not in own:
            by = _started_by(store, run.first.id)
            raise ProfileRunInProgressError(app, run.run, by, run.first.created_at, run.types)


def _started_by(store: Store, instance_id: str) -> str | None:
    """Who started the run of a worker's row: its first event's reason, ``profile run R by
    WHO``."""
    events = store.list_instance_events(instance_id=instance_id)
    reason = (events[0].reason or "") if events else ""
    if " by " not in reason:
        return None
    return reason.split(" by ", 1)[1].splitlines()[0]


class ProfilingRequestError(InvalidValueError):
    """A profile run that cannot be asked for: an app without registered models, a type that
    is not one of its candidates, a bad batch size or sample count."""


@dataclass(frozen=True, slots=True)
class ProfileRunRequest:
    """What to measure: ``types`` (None: every candidate type of the app), ``batch_sizes``
    (increasing), ``samples`` timed calls and ``warmup`` untimed ones per model, type and batch
    size."""

    types: tuple[str, ...] | None = None
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    samples: int = DEFAULT_SAMPLES
    warmup: int = DEFAULT_WARMUP


@dataclass(frozen=True, slots=True)
class ProfileRunCheck:
    """A run the service would take (:func:`check_profile_run`): the models and types it would
    measure, its workers' cost, the calls each worker answers in turn (warm-up and timed, every
    model at every batch size) and whether its workers are processes on the service's machine
    (``local_workers``: they start in seconds; an EC2 instance boots for minutes)."""

    app: str
    models: tuple[str, ...]
    instance_types: tuple[str, ...]
    cost_usd_per_hr: float
    calls_per_worker: int = 0
    local_workers: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "app": self.app,
            "checked": True,
            "models": list(self.models),
            "instance_types": list(self.instance_types),
            "cost_usd_per_hr": self.cost_usd_per_hr,
            "calls_per_worker": self.calls_per_worker,
            "local_workers": self.local_workers,
        }


@dataclass(frozen=True, slots=True)
class ProfileRunResult:
    """A finished run: the stored ``document`` and its ``profiles``, the ``cost_usd_per_hr`` of
    the workers it ran, and ``elapsed_s``."""

    app: str
    models: tuple[str, ...]
    instance_types: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    samples: int
    profiles: tuple[LatencyProfile, ...]
    document: Mapping[str, Any]
    cost_usd_per_hr: float
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        """The route's answer: what was measured and a summary of each profile."""
        return {
            "app": self.app,
            "models": list(self.models),
            "instance_types": list(self.instance_types),
            "batch_sizes": list(self.batch_sizes),
            "samples": self.samples,
            "cost_usd_per_hr": self.cost_usd_per_hr,
            "elapsed_s": self.elapsed_s,
            "measured_at": self.document.get("date"),
            "profiles": [
                {
                    "model": p.model,
                    "instance_type": p.instance_type,
                    "batch_sizes": p.batch_sizes.tolist(),
                    "mean_ms": p.mean_ms.tolist(),
                    "p99_ms": p.p99_ms.tolist(),
                }
                for p in self.profiles
            ],
        }


def random_inputs(
    signature: ModelSignature, batch_size: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One batch of ``batch_size`` random samples for each input of ``signature`` (a dynamic
    dimension past the batch is 1): floats uniform in [0, 1), integers in [0, 10), booleans
    fair coins.

    >>> from provisioners.artifacts import FAMILY_SIGNATURE
    >>> random_inputs(FAMILY_SIGNATURE, 3, np.random.default_rng(0))["input"].shape
    (3, 64)
    """
    return {tensor.name: _random_tensor(tensor, batch_size, rng) for tensor in signature.inputs}


def _random_tensor(tensor: TensorSpec, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    shape = (batch_size, *(d if d >= 0 else 1 for d in tensor.sample_shape))
    dtype = tensor.dtype
    if dtype.kind == "f":
        return rng.random(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, 10, size=shape).astype(dtype)


def run_profile(
    store: Store,
    resolver: AppResolver,
    provisioner: Provisioner,
    clock: Clock,
    app: str,
    request: ProfileRunRequest,
    *,
    who: str,
    worker_port: int,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    progress: ProgressFn | None = None,
    rng: np.random.Generator | None = None,
    sleep: Callable[[float], None] = time.sleep,
    serve: Mapping[str, ArtifactRef] | None = None,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
) -> ProfileRunResult:
    """Measure the latency profiles of ``app``'s registered models on the types ``request``
    names and store them (module docstring). ``worker_port`` is the port of a worker whose
    provider address has none (EC2's private IP).

    ``serve`` (a rollout's, :mod:`controlplane.apps.rollouts`): the models to time, each with
    the artifact to serve under its name (a new version, same signature) instead of the app's;
    their profiles are returned, not stored (the app serves the version it pins).

    Raises:
        NotFoundError: no such app.
        ProfilingRequestError: nothing to profile, or a request that does not fit the app.
        ProfilingBudgetError: the workers do not fit the budget next to the fleet.
        ProfilingError: a worker did not start, or refused a batch.
        ProfilingInterruptedError: the control plane ended a worker during the run, or the app
            was taken down or deleted while it measured (nothing is stored).
    """
    say = progress or (lambda _message: None)
    started_s = time.monotonic()
    record = store.get_app(app)
    refuse_torn_down(store, record, "no profile run starts for it")
    resolved = resolver.resolve(record.spec, check_budget=False)
    models, types = _checked_request(resolved, app, request, serve, max_batch_bytes)
    signatures = {m: resolved.artifacts[m].signature for m in models}
    prices = {t: resolved.prices_usd_per_hr[t] for t in types}
    artifacts = tuple(serve[m] if serve is not None else resolved.artifacts[m].ref for m in models)
    # Refused before any row is written where the budget cannot pay as things stand (a rollout
    # waiting for the budget tried every few seconds, each try writing rows that read as cost
    # over the budget until their refusal, and two failed rows more); the check after the rows
    # are written (below) is the one a concurrent launch cannot slip past.
    _check_workers_fit(store, provisioner, record, resolved.prices_usd_per_hr, types)
    run_id = secrets.token_hex(4)
    rows = {
        t: store.record_instance(
            app,
            request_id=f"{PROFILE_REQUEST_PREFIX}{app[:20]}-{run_id}-{t}",
            instance_type=t,
            price_usd_per_hr=prices[t],
            reason=f"profile run {run_id} by {who}",
        )
        for t in types
    }
    crash_point("profile_run.after_row")
    clients: dict[str, WorkerClient] = {}
    heartbeat = _Heartbeat(store, [row.id for row in rows.values()], heartbeat_s)
    refused: str | None = None  # why the rows end unlaunched, when the budget refused the run
    try:
        if serve is None:
            try:
                _refuse_a_second_run(store, app, clock.utcnow(), heartbeat_s, list(rows.values()))
            except ProfileRunInProgressError as error:
                refused = f"not launched: {error}"
                raise
        try:
            cost = _check_budget(
                store, provisioner, app, record.budget_usd_per_hr, rows, resolved.prices_usd_per_hr
            )
        except ProfilingBudgetError as error:
            refused = f"refused by the budget, not launched: {error}"
            raise
        say(f"starting a worker of each of {', '.join(types)} for {app} ({', '.join(models)})")
        for row in rows.values():
            launch_worker(store, provisioner, app, row, artifacts)
        crash_point("profile_run.after_launch")
        tags = {PROFILE_RUN_TAG: app, APP_TAG: app}
        launched = [
            found.provider_id
            for row in rows.values()
            if (found := store.get_instance(row.id)).provider_id is not None
        ]
        try:
            addresses = _wait_ready(
                provisioner, tags, launched, types, worker_port, start_timeout_s, sleep, say
            )
            clients = {t: WorkerClient(addresses[t]) for t in types}
            crash_point("profile_run.measuring")
            samples = _time_calls(clients, models, signatures, request, rng, say)
        except ProfilingError as error:
            # A worker the control plane ended meanwhile (a budget cut, app down) fails the
            # run's calls: say so, a conflict, not a worker's failure.
            ended = _ended_meanwhile(store, list(rows.values()))
            if ended is not None:
                raise ProfilingInterruptedError(f"profile run of {app} stopped: {ended}") from None
            raise error from None
    finally:
        heartbeat.stop()
        for client in clients.values():
            client.close()
        end_workers(store, provisioner, list(rows.values()), say, unlaunched=refused)
    sizes = np.array(request.batch_sizes)
    profiles = tuple(
        LatencyProfile(model, t, sizes, tuple(samples[t][model])) for t in types for model in models
    )
    document = profiles_document(
        profiles,
        source="measured",
        measurement="profile_run",
        measurement_detail="each sample is one batch's round trip to a worker of the type"
        " launched by the service's provisioner: an Open Inference Protocol v2 request of random"
        " inputs matching the model's signature, its JSON, the model, the answer and its parsing",
        app=app,
        date=clock.utcnow().isoformat(timespec="seconds"),
        warmup=request.warmup,
        samples=request.samples,
        artifacts={m: ref.to_json() for m, ref in zip(models, artifacts, strict=True)},
    )
    elapsed_s = time.monotonic() - started_s
    result = ProfileRunResult(
        app,
        models,
        types,
        tuple(request.batch_sizes),
        request.samples,
        profiles,
        document,
        cost,
        elapsed_s,
    )
    if serve is not None:
        return result
    # `app down` while the run measured: the app is about to go (or gone), so nothing is stored
    # and the run says so rather than "profiles stored ... plan it with".
    gone = f"profile run of {app} stopped: the app was deleted while it measured; nothing stored"
    # Said in the store's transaction (a crash leaves both or neither).
    said = (
        DECISION_KIND,
        f"latency profiles of {', '.join(models)} measured on {', '.join(types)} by {who}"
        f" ({len(request.batch_sizes)} batch sizes, {request.samples} samples each)",
        {
            "models": list(models),
            "instance_types": list(types),
            "batch_sizes": list(request.batch_sizes),
            "samples": request.samples,
            "cost_usd_per_hr": cost,
            "elapsed_s": elapsed_s,
        },
    )
    try:
        refuse_torn_down(store, store.get_app(app), "nothing measured is stored")
        store.put_app_profiles(
            app, kept_with(store.get_app_profiles(app), document, types), said=[said]
        )
    except NotFoundError:
        raise ProfilingInterruptedError(gone) from None
    except ConflictError as error:
        raise ProfilingInterruptedError(f"profile run of {app} stopped: {error}") from None
    resolver.invalidate(app)
    return result


def check_profile_run(
    store: Store,
    resolver: AppResolver,
    provisioner: Provisioner,
    app: str,
    request: ProfileRunRequest,
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    clock: Clock | None = None,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
) -> ProfileRunCheck:
    """What :func:`run_profile` would measure and what its workers would cost, with every check
    it makes before a worker starts (the request, the batches' size, another run in progress,
    the budget next to the fleet), launching nothing and recording nothing: a client asks
    first, so that it says how long a run takes only of a run the service takes. ``clock``
    (default the system's) and ``heartbeat_s`` tell a run in progress from one that is gone.

    Raises what :func:`run_profile` raises before it launches.
    """
    record = store.get_app(app)
    refuse_torn_down(store, record, "no profile run starts for it")
    resolved = resolver.resolve(record.spec, check_budget=False)
    models, types = _checked_request(resolved, app, request, None, max_batch_bytes)
    _refuse_a_second_run(store, app, (clock or SystemClock()).utcnow(), heartbeat_s)
    workers = _check_workers_fit(store, provisioner, record, resolved.prices_usd_per_hr, types)
    calls = len(request.batch_sizes) * (request.warmup + request.samples) * len(models)
    local = provisioner.name in LOCAL_PROVISIONERS
    return ProfileRunCheck(app, models, types, workers, calls, local)


def _checked_request(
    resolved: ResolvedApp,
    app: str,
    request: ProfileRunRequest,
    serve: Mapping[str, ArtifactRef] | None,
    max_batch_bytes: int,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The models and types a run measures, after the request's own checks."""
    models = tuple(
        m
        for m in resolved.spec.model_names
        if m in resolved.artifacts and (serve is None or m in serve)
    )
    if not models:
        raise ProfilingRequestError(
            "app",
            f"app {app!r} serves no registered model (artifact:); the demo family is profiled"
            " with heteroplane profile measure",
        )
    types = _requested_types(request, resolved.instance_types)
    _check_numbers(request)
    signatures = {m: resolved.artifacts[m].signature for m in models}
    _check_batch_bytes(signatures, request.batch_sizes, max_batch_bytes)
    _check_batch_times(resolved, models, types, request.batch_sizes, CALL_TIMEOUT_S)
    return models, types


def predicted_ms(profile: LatencyProfile, batch_size: int) -> float | None:
    """A batch's mean time by ``profile``: linear between its batch sizes (the smallest's below
    them), on the line through its two largest above them (a batch's time is about affine in
    its rows: the emulated types' ``C_m(b)``); None above a profile of one batch size.

    >>> p = LatencyProfile("m", "t", np.array([1, 4]), (np.array([2.0]), np.array([5.0])))
    >>> [predicted_ms(p, b) for b in (1, 2, 8)]
    [2.0, 3.0, 9.0]
    """
    sizes = profile.batch_sizes.astype(np.float64)
    means = profile.mean_ms
    if batch_size <= sizes[-1]:
        return float(np.interp(batch_size, sizes, means))
    if sizes.size < 2:
        return None
    slope = max((means[-1] - means[-2]) / (sizes[-1] - sizes[-2]), 0.0)
    return float(means[-1] + slope * (batch_size - sizes[-1]))


def _check_batch_times(
    resolved: ResolvedApp,
    models: Sequence[str],
    types: Sequence[str],
    batch_sizes: Sequence[int],
    timeout_s: float,
) -> None:
    """Refuse batch sizes that the app's current profiles (where it has them) say take longer
    than a call may (``timeout_s``, the profiler's call timeout), before any worker starts: the
    call would time out after the workers were paid for and started (a batch of 4,096 that
    takes about 123 s on emu.cpu.small)."""
    for model in models:
        for instance_type in types:
            try:
                profile = resolved.profile(model, instance_type)
            except (LookupError, EstimatorError):
                continue  # not measured yet: nothing to predict from
            largest = int(profile.batch_sizes[-1])
            for size in batch_sizes:
                expected_ms = predicted_ms(profile, size)
                if expected_ms is None or expected_ms <= timeout_s * 1000.0:
                    continue
                basis = "" if size <= largest else f", extrapolated from batches up to {largest}"
                raise ProfilingRequestError(
                    "batch_sizes",
                    f"a batch of {size} of {model} on {instance_type} takes about"
                    f" {expected_ms / 1000.0:.0f} s by the app's current profile{basis}, past the"
                    f" {timeout_s:g} s a worker call may take: profile smaller batch sizes"
                    " (--batch-sizes)",
                )


def _requested_types(request: ProfileRunRequest, candidates: Sequence[str]) -> tuple[str, ...]:
    if request.types is None:
        return tuple(candidates)
    if not request.types:
        raise ProfilingRequestError("types", "name at least one instance type")
    for name in request.types:
        if name not in candidates:
            raise ProfilingRequestError(
                "types", f"{name} is not a candidate type of the app ({', '.join(candidates)})"
            )
    if len(set(request.types)) != len(request.types):
        raise ProfilingRequestError("types", "names a type twice")
    return tuple(request.types)


def _check_batch_bytes(
    signatures: Mapping[str, ModelSignature], batch_sizes: Sequence[int], max_bytes: int
) -> None:
    """Refuse batch sizes whose random batch (:func:`random_inputs`) would be larger than an
    inference body may be (``max_bytes``, the setting ``oip_body_max_bytes``), before any worker
    starts: the batch was built in the control plane's memory whatever its size (a declared
    input of [N, 4, 100000000] took it to 12.8 GB) and the worker refused it."""
    for model, signature in signatures.items():
        row = sum(
            math.prod(d if d >= 0 else 1 for d in spec.sample_shape) * spec.dtype.itemsize
            for spec in signature.inputs
        )
        for size in batch_sizes:
            if size * row > max_bytes:
                what = "one row" if size == 1 else f"a batch of {size} rows"
                raise ProfilingRequestError(
                    "batch_sizes",
                    f"{what} of {model} takes {size * row:,} bytes as binary tensors, past the"
                    f" largest inference body, {max_bytes:,} bytes (the setting"
                    " oip_body_max_bytes): "
                    + (
                        "the model cannot be served at that setting"
                        if size == 1
                        else "profile smaller batch sizes (--batch-sizes)"
                    ),
                )


def _check_numbers(request: ProfileRunRequest) -> None:
    sizes = list(request.batch_sizes)
    if not sizes or any(b < 1 for b in sizes) or sizes != sorted(set(sizes)):
        raise ProfilingRequestError(
            "batch_sizes", f"must be distinct whole numbers >= 1, increasing; got {sizes}"
        )
    if request.samples < 1:
        raise ProfilingRequestError("samples", f"must be >= 1, got {request.samples}")
    if request.warmup < 0:
        raise ProfilingRequestError("warmup", f"must be >= 0, got {request.warmup}")


def unrecorded_cost(
    provisioner: Provisioner,
    app: str,
    rows: Sequence[InstanceRecord],
    prices_usd_per_hr: Mapping[str, float],
) -> float:
    """What the provider runs for ``app`` (its tags) that no live row of ``rows`` accounts for,
    USD/hr: orphans the reconciler has not ended yet (a crash between a launch and its row's
    update, a database restored from a backup). A type without a price counts at the highest
    price known. Raises :class:`~provisioners.errors.ProvisionerError` when the provider cannot
    be listed."""
    live = [r for r in rows if r.state in LIVE_STATES]
    known_ids = {r.provider_id for r in live if r.provider_id is not None}
    # A launch whose answer is not recorded yet is its row's (matched by request id).
    waiting = {r.request_id for r in live if r.provider_id is None}
    highest = max(prices_usd_per_hr.values(), default=0.0)
    cost = 0.0
    for instance in provisioner.list({MANAGED_TAG: "true"}):
        tags = instance.tags
        if app not in (tags.get(APP_TAG), tags.get(PROFILE_RUN_TAG)):
            continue
        if instance.state not in ("pending", "running", "stopping"):
            continue
        if instance.provider_id in known_ids or instance.request_id in waiting:
            continue
        cost += prices_usd_per_hr.get(instance.instance_type, highest)
    return cost


def kept_with(
    kept: Mapping[str, Any] | None, document: dict[str, Any], types: Sequence[str]
) -> dict[str, Any]:
    """The profiles document to store after a run on ``types``: the run's ``document``, and of
    the ``kept`` one the profiles on the types the run left out, for the models whose artifact
    (version and bytes) is still the one the run measured. A run on a subset of the types
    (``--types``, which the budget may ask for) replaced every profile, and an app whose spec
    still named the other types could neither plan nor serve (503 on every query).

    >>> ref = {"model": "m", "version": 1, "sha256": "ab"}
    >>> old = {"artifacts": {"m": ref}, "profiles": [
    ...     {"model": "m", "instance_type": "a", "x": 0},
    ...     {"model": "m", "instance_type": "b", "x": 0}]}
    >>> new = {"artifacts": {"m": ref}, "profiles": [{"model": "m", "instance_type": "a", "x": 1}]}
    >>> [(p["instance_type"], p["x"]) for p in kept_with(old, new, ["a"])["profiles"]]
    [('a', 1), ('b', 0)]
    >>> other = {**new, "artifacts": {"m": {**ref, "version": 2}}}
    >>> [p["instance_type"] for p in kept_with(old, other, ["a"])["profiles"]]
    ['a']
    """
    if not kept:
        return document
    before = kept.get("artifacts") or {}
    now = document.get("artifacts") or {}
    same = {model for model, ref in now.items() if before.get(model) == ref}
    carried = [
        entry
        for entry in kept.get("profiles") or ()
        if isinstance(entry, Mapping)
        and entry.get("model") in same
        and entry.get("instance_type") not in types
    ]
    if not carried:
        return document
    return {**document, "profiles": [*document["profiles"], *carried]}


def moved_profiles(
    store: Store, app: str, old_spec: Mapping[str, Any], new_spec: Mapping[str, Any], who: str
) -> tuple[list[str], Words]:
    """The models whose measured profiles of ``app`` the new spec document drops: those whose
    artifact it moves to other bytes (another sha256; a version of the same file keeps them),
    so that the app asks to be profiled again rather than being planned and served on another
    model's latencies; and the ``profiles_measured`` decision that says so. Both go with the
    spec (:meth:`AppStore.update_app`'s ``drop_profiles`` and ``said``: a crash after the spec
    left the old bytes' profiles for good); none when no profile of theirs is stored.

    A rollout's promotion is not this: it times the new version and stores its profiles."""
    before = {m.get("name"): m.get("artifact") for m in old_spec.get("models") or ()}
    moved = [
        str(m["name"])
        for m in new_spec.get("models") or ()
        if m.get("name") in before
        and before[m["name"]] != m.get("artifact")
        and _artifact_sha256(store, before[m["name"]]) != _artifact_sha256(store, m.get("artifact"))
    ]
    document = store.get_app_profiles(app)
    if not moved or not document:
        return [], []
    dropped = sorted(
        {p.get("model") for p in document.get("profiles") or () if p.get("model") in moved}
    )
    if not dropped:
        return [], []
    return moved, [
        (
            DECISION_KIND,
            f"latency profiles of {', '.join(dropped)} dropped by {who}: the spec serves another"
            f" artifact for {'it' if len(dropped) == 1 else 'them'}; run heteroplane profile run"
            f" --app {app}",
            {"models": dropped, "dropped": True},
        )
    ]


def _artifact_sha256(store: Store, artifact: object) -> str | None:
    """The sha256 of a spec's ``NAME`` or ``NAME@VERSION`` in the registry; None when there is
    none."""
    if not isinstance(artifact, str):
        return None
    try:
        return store.get_model_version(*parse_artifact(artifact)).sha256
    except (NotFoundError, SpecError):
        return None


def _check_budget(
    store: Store,
    provisioner: Provisioner,
    app: str,
    budget_usd_per_hr: float,
    ours: Mapping[str, InstanceRecord],
    prices_usd_per_hr: Mapping[str, float],
) -> float:
    """The workers' cost; :class:`ProfilingBudgetError` when it does not fit next to the rest
    of what the app pays for (its other kept rows and what the provider runs without a row)."""
    workers = sum(row.price_usd_per_hr for row in ours.values())
    own = {row.id for row in ours.values()}
    _check_budget_of(store, provisioner, app, budget_usd_per_hr, own, workers, prices_usd_per_hr)
    return workers


def _check_workers_fit(
    store: Store,
    provisioner: Provisioner,
    record: AppRecord,
    prices_usd_per_hr: Mapping[str, float],
    types: Sequence[str],
) -> float:
    """The cost of one worker of each of ``types``; :class:`ProfilingBudgetError` when they do
    not fit next to what the app pays for now (before any of their rows is written)."""
    workers = sum(prices_usd_per_hr[t] for t in types)
    _check_budget_of(
        store,
        provisioner,
        record.name,
        record.budget_usd_per_hr,
        set(),
        workers,
        prices_usd_per_hr,
    )
    return workers


def _check_budget_of(
    store: Store,
    provisioner: Provisioner,
    app: str,
    budget_usd_per_hr: float,
    own: set[str],
    workers: float,
    prices_usd_per_hr: Mapping[str, float],
) -> None:
    """:class:`ProfilingBudgetError` when workers costing ``workers`` USD/hr do not fit next to
    the app's kept rows but ``own`` (the workers' rows, where recorded) and its unrecorded
    instances."""
    rows = store.list_instances(app, LIVE_STATES)  # what unrecorded_cost reads: the live ones
    kept = [i for i in rows if i.state in KEPT_STATES and i.id not in own]
    fleet = sum(i.cost_usd_per_hr for i in kept)
    others = sum(i.cost_usd_per_hr for i in kept if is_profile_worker(i.request_id))
    try:
        fleet += unrecorded_cost(provisioner, app, rows, prices_usd_per_hr)
    except ProvisionerError as error:
        raise ProfilingError(
            f"cannot list the provider's instances to check the budget: {error}"
        ) from None
    if fleet + workers > budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR:
        raise ProfilingBudgetError(app, fleet, workers, budget_usd_per_hr, others)


def launch_worker(
    store: Store,
    provisioner: Provisioner,
    app: str,
    row: InstanceRecord,
    artifacts: tuple[ArtifactRef, ...],
) -> None:
    """Launch the worker of ``row`` (recorded already) and record its provider id (a profile
    run's, or a rollout's: :mod:`controlplane.loops.rollouts`)."""
    tags = {
        APP_TAG: app,
        PLAN_TAG: PROFILE_PLAN,
        PROFILE_RUN_TAG: app,
        INSTANCE_TAG: row.id,
    }
    request = LaunchRequest(row.request_id, row.instance_type, 1, tags, artifacts)
    try:
        instances = provisioner.launch(request)
    except ProvisionerError as error:
        raise ProfilingError(f"cannot launch {row.instance_type} to profile: {error}") from None
    live = [i for i in instances if i.state in ("pending", "running")]
    if not live:
        raise ProfilingError(f"the provider returned no live {row.instance_type} to profile")
    try:
        store.transition_instance(
            row.id, InstanceState.PENDING.value, reason="launched", provider_id=live[0].provider_id
        )
    except ControlPlaneError:
        # The reconciler adopted it meanwhile (rule 1): the row has its provider id. Or it ended
        # the row (app down, the budget): then the worker goes now, and the run with it.
        current = store.get_instance(row.id)
        if current.provider_id == live[0].provider_id and current.state in KEPT_STATES:
            return
        try:
            provisioner.terminate([live[0].provider_id])
        except ProvisionerError as error:  # an orphan now: the reconciler ends it
            logger.warning("profile worker %s: %s", live[0].provider_id, error)
        raise ProfilingError(
            f"the {row.instance_type} worker's row was ended meanwhile ({current.state}):"
            " the app is being taken down or its budget lowered"
        ) from None


def end_workers(
    store: Store,
    provisioner: Provisioner,
    rows: Sequence[InstanceRecord],
    say: ProgressFn,
    *,
    owner: str = "profile run",
    unlaunched: str | None = None,
) -> None:
    """End a run's workers (``owner``: whose, for the events; a rollout's workers end the same
    way): rows first (unlaunched ones ``failed``, with ``unlaunched`` as the reason where given,
    launched ones ``terminating``), then the provider, then ``terminated`` for those it no longer
    runs."""
    ending: dict[str, str] = {}  # provider id -> row id
    for row in rows:
        try:
            current = store.get_instance(row.id)
            if current.state == InstanceState.REQUESTED and current.provider_id is None:
                store.transition_instance(
                    row.id,
                    InstanceState.FAILED.value,
                    reason=unlaunched or f"{owner} over (not launched)",
                )
                continue
            if current.provider_id is None or current.state not in LIVE_STATES:
                continue
            if current.state != InstanceState.TERMINATING:
                store.transition_instance(
                    row.id, InstanceState.TERMINATING.value, reason=f"{owner} over"
                )
            ending[current.provider_id] = row.id
        except ControlPlaneError as error:  # moved meanwhile: the reconciler follows it
            logger.warning("profile worker %s: %s", row.id, error)
    if not ending:
        return
    say(f"terminating the {len(ending)} worker(s) of the {owner}")
    try:
        provisioner.terminate(list(ending))
        listed = {
            i.provider_id: i.state
            for i in provisioner.list({MANAGED_TAG: "true"})
            if i.provider_id in ending
        }
    except ProvisionerError as error:
        # The rows stay terminating: the reconciler asks the provider again.
        say(f"terminating the workers of the {owner} failed ({error}); the reconciler will")
        return
    for provider_id, row_id in ending.items():
        if listed.get(provider_id, "terminated") == "terminated":
            try:
                store.transition_instance(
                    row_id, InstanceState.TERMINATED.value, reason="the provider ended it"
                )
            except ControlPlaneError as error:
                logger.warning("profile worker %s: %s", row_id, error)


class _Heartbeat:
    """Touches a run's rows every ``interval_s`` until :meth:`stop` (the reconciler reaps a
    profile worker whose row goes untouched: its run is gone)."""

    def __init__(self, store: Store, instance_ids: Sequence[str], interval_s: float) -> None:
        self._store = store
        self._ids = tuple(instance_ids)
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="profile-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self._store.touch_instances(self._ids)
            except ControlPlaneError as error:  # a database hiccup: the next beat tries again
                logger.warning("profile run heartbeat: %s", error)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _wait_ready(
    provisioner: Provisioner,
    tags: Mapping[str, str],
    launched: Sequence[str],
    types: Sequence[str],
    port: int,
    timeout_s: float,
    sleep: Callable[[float], None],
    say: ProgressFn,
) -> dict[str, str]:
    """Each type's worker address once it runs and answers ``/v2/health/ready``."""
    deadline_s = time.monotonic() + timeout_s
    ours = set(launched)
    ready: dict[str, str] = {}
    while True:
        try:
            listed: list[ProvisionedInstance] = [
                i for i in provisioner.list(tags) if i.provider_id in ours
            ]
        except ProvisionerError as error:
            say(f"cannot list the profiling workers ({error}); trying again")
            listed = []
        for instance in listed:
            if instance.state in ("failed", "terminated", "stopping"):
                events = [
                    e.message
                    for e in provisioner.poll_events()
                    if e.kind == "failed" and e.provider_id in (None, instance.provider_id)
                ]
                why = "; ".join(events) or f"it is {instance.state}"
                raise ProfilingError(
                    f"the {instance.instance_type} worker to profile did not start: {why}"
                )
            if (
                instance.instance_type not in ready
                and instance.state == "running"
                and instance.address
            ):
                address = with_port(instance.address, port)
                if WorkerClient(address).ready():
                    ready[instance.instance_type] = address
                    say(f"{instance.instance_type} is ready at {address}")
        if all(t in ready for t in types):
            return ready
        if time.monotonic() > deadline_s:
            waiting = ", ".join(t for t in types if t not in ready)
            raise ProfilingError(
                f"the profiling worker(s) of {waiting} were not ready within {timeout_s:g} s"
            )
        sleep(_POLL_S)


def _time_calls(
    clients: Mapping[str, WorkerClient],
    models: Sequence[str],
    signatures: Mapping[str, ModelSignature],
    request: ProfileRunRequest,
    rng: np.random.Generator | None,
    say: ProgressFn,
) -> dict[str, dict[str, list[np.ndarray]]]:
    """Samples (ms) by type, model and batch size, as the profiler times the serving path:
    per batch size every type at once, round k sending every model in turn one batch (the same
    random batch to every type), the first ``request.warmup`` rounds not kept."""
    generator = rng if rng is not None else np.random.default_rng()
    rounds = request.warmup + request.samples
    samples: dict[str, dict[str, list[np.ndarray]]] = {t: {m: [] for m in models} for t in clients}
    with ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="profile-run") as pool:
        for batch_size in request.batch_sizes:
            say(
                f"timing {', '.join(models)} at batch size {batch_size} on {', '.join(clients)}:"
                f" {request.warmup} warm-up and {request.samples} timed calls each"
            )
            batches = [
                {m: random_inputs(signatures[m], batch_size, generator) for m in models}
                for _ in range(rounds)
            ]

            def one_type(
                instance_type: str, batches: list[dict[str, dict[str, np.ndarray]]] = batches
            ) -> dict[str, np.ndarray]:
                timed: dict[str, list[float]] = {m: [] for m in models}
                for k, batch in enumerate(batches):
                    for model in models:
                        elapsed_ms = clients[instance_type].infer_ms(model, batch[model])
                        if k >= request.warmup:
                            timed[model].append(elapsed_ms)
                return {m: np.array(values) for m, values in timed.items()}

            futures = {t: pool.submit(one_type, t) for t in clients}
            for t, future in futures.items():
                for model, cell in future.result().items():
                    samples[t][model].append(cell)
    return samples
