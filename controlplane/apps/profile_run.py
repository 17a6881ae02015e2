"""Profile runs: the latency profiles of an app's registered models, measured by the service on
the instance types it would serve them on.

A model a user brings (``artifact:`` in the spec, :mod:`controlplane.registry`) has no profile
file; :func:`run_profile` (``POST /v1/apps/{app}/profiles``, ``heteroplane profile run``) makes
one:

1. **Budget.** One worker per type profiled runs next to the app's fleet, so the fleet's cost
   (its kept instances' recorded prices) plus one instance of each type must stay within the
   app's budget, else :class:`~controlplane.errors.ProfilingBudgetError` naming the cost.
2. **Workers.** One worker per type, launched through the service's provisioner with the app's
   artifacts (the reconciler's :class:`~provisioners.base.LaunchRequest`, so EC2 workers get
   the same user data the app's own would). They carry :data:`PROFILE_RUN_TAG` (the app) and
   :data:`PROFILE_UNTIL_TAG` (a time) and no app tag: the reconciler neither adopts them into
   the app's fleet nor terminates them as strays until that time has passed
   (:func:`profiling_until`), so a run cut short by a crash still leaves no machine behind for
   long. The run waits for each worker's address and for ``GET /v2/health/ready``.
3. **Measurement,** as :func:`controlplane.apps.profiler.measure_serving_path` measures the
   serving path: per batch size, every type's worker at once (a thread and a kept-alive
   connection each), warm-up rounds then ``samples`` timed rounds, each round sending every
   model in turn one batch; a sample is the round trip of an Open Inference Protocol v2
   ``POST /v2/models/{m}/infer`` of random inputs matching the model's signature (uniform in
   [0, 1) for floats, small integers otherwise; a dynamic dimension past the batch is 1).
4. **Cleanup.** The workers are terminated in a ``finally``: after a failure too.
5. **Result.** The profile JSON document (``estimator.profiles``' format, what the resolver
   reads for the app's artifact models) is stored with ``store.put_app_profiles``, the resolver
   forgets the app's old ones, and a ``profiles_measured`` decision is recorded.
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from controlplane.apps.profiler import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_WARMUP,
    ProfilingError,
    WorkerClient,
)
from controlplane.apps.resolver import AppResolver
from controlplane.clock import Clock
from controlplane.errors import InvalidValueError, ProfilingBudgetError
from controlplane.policies.lifecycle import KEPT_STATES
from estimator.profiles import LatencyProfile, profiles_document
from provisioners.base import LaunchRequest, ProvisionedInstance, Provisioner, with_port
from provisioners.errors import ProvisionerError

if TYPE_CHECKING:
    from controlplane.db.store import Store
    from provisioners.artifacts import ModelSignature, TensorSpec

__all__ = [
    "DEFAULT_SAMPLES",
    "PROFILE_RUN_TAG",
    "PROFILE_UNTIL_TAG",
    "ProfileRunRequest",
    "ProfileRunResult",
    "ProfilingRequestError",
    "profiling_until",
    "random_inputs",
    "run_profile",
]

PROFILE_RUN_TAG = "heteroplane:profile-run"
PROFILE_UNTIL_TAG = "heteroplane:profile-run-until"
# Fewer than the profiler's 30: every sample here is a paid machine's time.
DEFAULT_SAMPLES = 20
# An EC2 worker boots, installs and loads its models in a few minutes (the reconciler's
# straggler timeout is ten).
DEFAULT_START_TIMEOUT_S = 600.0
# How long the reconciler leaves a profile run's workers alone: the start plus an hour of
# measuring; a run still going then has gone wrong.
DEFAULT_LEASE_S = DEFAULT_START_TIMEOUT_S + 3600.0
_POLL_S = 0.5
_BUDGET_SLACK_USD_PER_HR = 1e-9
DECISION_KIND = "profiles_measured"

ProgressFn = Callable[[str], None]


class ProfilingRequestError(InvalidValueError):
    """A profile run that cannot be asked for: an app without registered models, a type that
    is not one of its candidates, a bad batch size or sample count."""


def profiling_until(tags: Mapping[str, str]) -> datetime.datetime | None:
    """When a profile run's worker (tags with :data:`PROFILE_UNTIL_TAG`) stops being the run's
    to end (UTC); ``None`` for any other instance, or a tag that does not read."""
    value = tags.get(PROFILE_UNTIL_TAG)
    if value is None:
        return None
    try:
        return datetime.datetime.fromtimestamp(int(value), datetime.UTC)
    except (ValueError, OverflowError, OSError):
        return None


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
    lease_s: float = DEFAULT_LEASE_S,
    progress: ProgressFn | None = None,
    rng: np.random.Generator | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ProfileRunResult:
    """Measure the latency profiles of ``app``'s registered models on the types ``request``
    names and store them (module docstring). ``worker_port`` is the port of a worker whose
    provider address has none (EC2's private IP).

    Raises:
        NotFoundError: no such app.
        ProfilingRequestError: nothing to profile, or a request that does not fit the app.
        ProfilingBudgetError: the workers do not fit the budget next to the fleet.
        ProfilingError: a worker did not start, or refused a batch.
    """
    say = progress or (lambda _message: None)
    started_s = time.monotonic()
    record = store.get_app(app)
    resolved = resolver.resolve(record.spec, check_budget=False)
    models = tuple(m for m in resolved.spec.model_names if m in resolved.artifacts)
    if not models:
        raise ProfilingRequestError(
            "app",
            f"app {app!r} serves no registered model (artifact:); the demo family is profiled"
            " with heteroplane profile measure",
        )
    types = _requested_types(request, resolved.instance_types)
    _check_numbers(request)
    prices = {t: resolved.prices_usd_per_hr[t] for t in types}
    cost = _check_budget(store, app, record.budget_usd_per_hr, prices)
    artifacts = tuple(resolved.artifacts[m].ref for m in models)
    signatures = {m: resolved.artifacts[m].signature for m in models}
    run_id = secrets.token_hex(4)
    until = clock.utcnow() + datetime.timedelta(seconds=lease_s)
    tags = {PROFILE_RUN_TAG: app, PROFILE_UNTIL_TAG: str(int(until.timestamp()))}
    launched: list[str] = []
    clients: dict[str, WorkerClient] = {}
    try:
        say(f"starting a worker of each of {', '.join(types)} for {app} ({', '.join(models)})")
        for instance_type in types:
            launch = LaunchRequest(
                f"profile-{app}-{run_id}-{instance_type}", instance_type, 1, tags, artifacts
            )
            try:
                instances = provisioner.launch(launch)
            except ProvisionerError as error:
                raise ProfilingError(f"cannot launch {instance_type} to profile: {error}") from None
            launched.extend(i.provider_id for i in instances)
        addresses = _wait_ready(
            provisioner, tags, launched, types, worker_port, start_timeout_s, sleep, say
        )
        clients = {t: WorkerClient(addresses[t]) for t in types}
        samples = _time_calls(clients, models, signatures, request, rng, say)
    finally:
        for client in clients.values():
            client.close()
        if launched:
            say(f"terminating the {len(launched)} profiling worker(s)")
            try:
                provisioner.terminate(launched)
            except ProvisionerError as error:
                # The reconciler ends them once their lease (PROFILE_UNTIL_TAG) is over.
                say(f"terminating the profiling workers failed ({error}); the reconciler will")
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
        artifacts={m: resolved.artifacts[m].ref.to_json() for m in models},
    )
    store.put_app_profiles(app, document)
    resolver.invalidate(app)
    elapsed_s = time.monotonic() - started_s
    store.record_decision(
        app,
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
    return ProfileRunResult(
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


def _check_budget(
    store: Store, app: str, budget_usd_per_hr: float, prices: Mapping[str, float]
) -> float:
    """The workers' cost; :class:`ProfilingBudgetError` when it does not fit next to the fleet."""
    fleet = sum(i.price_usd_per_hr for i in store.list_instances(app) if i.state in KEPT_STATES)
    workers = sum(prices.values())
    if fleet + workers > budget_usd_per_hr + _BUDGET_SLACK_USD_PER_HR:
        raise ProfilingBudgetError(app, fleet, workers, budget_usd_per_hr)
    return workers


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
