"""The control-plane service's errors: one root class and the precise cases callers tell apart.

The API maps these to HTTP in one place (``NotFoundError`` -> 404, ``ConflictError`` and its
subclasses -> 409, ``InvalidValueError`` and ``UnknownScopeError`` -> 422, ``DatabaseError`` ->
503, the registry's ``ModelNameError`` -> 400, ``ModelTooLargeError`` -> 413,
``ModelRejectedError`` -> 422, ``ArtifactStoreError`` -> 503; ``SettingsError`` never reaches
it); the CLI turns any :class:`ControlPlaneError` into a one-line message and exit status 2.
Every message is one line that names what was wrong.

The serving loop's errors (:class:`ServingError` and below) are answers to an inference request:
the API maps them to 429 (:class:`OverloadedError`, with ``Retry-After``), 422
(:class:`RequirementsUnmetError`, :class:`QueryRejectedError`), 502 (:class:`QueryFailedError`), 503
(:class:`NoServingInstanceError`, :class:`ServingUnavailableError`) and 504
(:class:`QueryTimeoutError`); :class:`WorkerCallError` stays inside the serving loop.
"""

from __future__ import annotations

from estimator.numbers import plain
from provisioners.errors import ArtifactStoreError

# How long a value an error line quotes may be before it is cut (a 5,000-character name made a
# 5,000-character "one line").
SHOWN_MAX = 60


def shown(value: object) -> str:
    """``value`` as an error message quotes it: its repr, cut to :data:`SHOWN_MAX` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_MAX else text[: SHOWN_MAX - 3] + "..."


__all__ = [
    "AppExistsError",
    "ArtifactStoreError",
    "BudgetBelowServingFleetError",
    "ConflictError",
    "ControlPlaneError",
    "DatabaseError",
    "InvalidRolloutTransitionError",
    "InvalidTransitionError",
    "InvalidValueError",
    "ModelError",
    "ModelNameError",
    "ModelRejectedError",
    "ModelTooLargeError",
    "NoServingInstanceError",
    "NotFoundError",
    "OverloadedError",
    "ProfilesNotMeasuredError",
    "ProfilingBudgetError",
    "QueryFailedError",
    "QueryRejectedError",
    "QueryTimeoutError",
    "RequirementsUnmetError",
    "RolloutBudgetError",
    "ServingError",
    "ServingUnavailableError",
    "SettingsError",
    "UnknownScopeError",
    "WorkerCallError",
    "app_gone",
    "first_line",
    "shown",
]


class ControlPlaneError(Exception):
    """Root of the control plane's errors."""


class SettingsError(ControlPlaneError, ValueError):
    """A setting that is malformed or out of range; ``field`` names it (``port``, ``ec2.region``).

    The message is the one line ``source: field: problem`` (``source`` is the config file or the
    environment variable the value came from, when known).
    """

    def __init__(self, field: str, problem: str, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        parts = [part for part in (source, field, problem) if part]
        super().__init__(": ".join(parts))


class NotFoundError(ControlPlaneError, LookupError):
    """No ``kind`` (``app``, ``plan``, ``instance``, ``token``) with that ``key``."""

    def __init__(self, kind: str, key: object) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"no {kind} {key!r}")


def app_gone(error: BaseException) -> bool:
    """Whether ``error`` says an app no longer exists (deleted while a loop worked on it): a
    loop's pass over the apps it listed has nothing to warn about then.

    >>> app_gone(NotFoundError("app", "a")), app_gone(NotFoundError("plan", 3))
    (True, False)
    """
    return isinstance(error, NotFoundError) and error.kind == "app"


class ConflictError(ControlPlaneError):
    """A write that lost a race or contradicts the current state (another apply won, a stale
    version); the caller may read again and retry."""


class AppExistsError(ConflictError):
    """An app with this ``name`` is already registered."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an app named {name!r} already exists")


class InvalidTransitionError(ConflictError):
    """An instance lifecycle move that the transition table does not allow."""

    def __init__(self, from_state: str, to_state: str) -> None:
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"an instance cannot go from {from_state!r} to {to_state!r}")


class InvalidRolloutTransitionError(ConflictError):
    """A rollout state move that :data:`controlplane.policies.rollout.TRANSITIONS` does not
    allow (resuming a finished rollout, pausing a rolled-back one)."""

    def __init__(self, from_state: str, to_state: str) -> None:
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"a rollout cannot go from {from_state!r} to {to_state!r}")


class RolloutBudgetError(ConflictError):
    """A rollout whose extra instances the app's budget cannot pay for next to its fleet."""

    def __init__(
        self,
        app: str,
        fleet_usd_per_hr: float,
        extra_usd_per_hr: float,
        budget_usd_per_hr: float,
        extra: str = "",
    ) -> None:
        self.app = app
        self.fleet_usd_per_hr = fleet_usd_per_hr
        self.extra_usd_per_hr = extra_usd_per_hr
        self.budget_usd_per_hr = budget_usd_per_hr
        self.needed_usd_per_hr = fleet_usd_per_hr + extra_usd_per_hr
        what = f" ({extra})" if extra else ""
        super().__init__(
            f"app {app!r}: the rollout needs {extra_usd_per_hr:.4g} USD/hr of extra instances"
            f"{what} on top of the fleet's {fleet_usd_per_hr:.4g} USD/hr, together"
            f" {self.needed_usd_per_hr:.4g} USD/hr, over the budget of {budget_usd_per_hr:g}"
            " USD/hr; raise the budget first"
        )


class BudgetBelowServingFleetError(ConflictError):
    """A budget change below the cost of the app's smallest serving fleet (``floor``: one
    instance of the cheapest planned type on every stage of the applied plan, ``fleet`` in words),
    not forced: it would drain every instance of a stage."""

    def __init__(
        self,
        app: str,
        budget_usd_per_hr: float,
        floor_usd_per_hr: float,
        fleet: str = "",
        *,
        running_usd_per_hr: float | None = None,
    ) -> None:
        self.app = app
        self.budget_usd_per_hr = budget_usd_per_hr
        self.floor_usd_per_hr = floor_usd_per_hr
        self.fleet = fleet
        what = f" ({fleet})" if fleet else ""
        # Without the API's hint: a caller that forces it another way says its own.
        self.shortfall = (
            f"app {app!r}: a budget of {plain(budget_usd_per_hr)} USD/hr is below the"
            f" {floor_usd_per_hr:.4g} USD/hr the app's smallest serving fleet{what} costs"
            " on demand"
        )
        if running_usd_per_hr is not None:
            # A spot fleet that fits: forced, nothing drains now.
            self.shortfall += (
                f" (the fleet runs at {running_usd_per_hr:.4g} USD/hr now, within it: forced,"
                " nothing drains now, but a spot price rise or an on-demand replacement could"
                " not be paid for)"
            )
        super().__init__(f'{self.shortfall}; send "force": true to drain it anyway')


class ProfilesNotMeasuredError(ConflictError):
    """An app whose registered model (an ``artifact``, no ``profiles`` file) has no latency
    profiles measured yet (on ``instance_types``, empty: on any candidate type), so nothing can be
    planned for it: ``heteroplane profile run`` measures them."""

    def __init__(
        self,
        app: str,
        model: str,
        instance_types: tuple[str, ...] = (),
        beyond_budget: tuple[str, ...] = (),
        budget_usd_per_hr: float | None = None,
    ) -> None:
        self.app = app
        self.model = model
        self.instance_types = instance_types
        on = f" on {', '.join(instance_types)}" if instance_types else ""
        if beyond_budget:
            # profile run refuses a worker the budget cannot pay for: a type dearer than the
            # whole budget can be neither profiled nor bought.
            budget = "" if budget_usd_per_hr is None else f" of {plain(budget_usd_per_hr)} USD/hr"
            todo = (
                f"{', '.join(beyond_budget)} alone cost(s) more than the budget{budget}:"
                " drop it from the spec's instance_types (or"
                " raise the budget), then profile what is missing with heteroplane profile run"
                f" --app {app} --types TYPES"
            )
        else:
            todo = f"run heteroplane profile run --app {app}"
        super().__init__(f"app {app} has no latency profiles for model {model}{on}: {todo}")


class ProfilingBudgetError(ConflictError):
    """Profiling workers that the app's budget cannot pay for on top of its fleet: the fleet
    costs ``fleet_usd_per_hr``, ``others_usd_per_hr`` of it the workers of other profile runs
    and rollouts (said apart: a killed run's worker holds its share until it is ended), the
    workers ``workers_usd_per_hr``, the budget is ``budget_usd_per_hr``."""

    def __init__(
        self,
        app: str,
        fleet_usd_per_hr: float,
        workers_usd_per_hr: float,
        budget_usd_per_hr: float,
        others_usd_per_hr: float = 0.0,
    ) -> None:
        self.app = app
        self.fleet_usd_per_hr = fleet_usd_per_hr
        self.workers_usd_per_hr = workers_usd_per_hr
        self.budget_usd_per_hr = budget_usd_per_hr
        self.others_usd_per_hr = others_usd_per_hr
        beside = f"the fleet's {fleet_usd_per_hr:.4g} USD/hr"
        if others_usd_per_hr > 0:
            beside = (
                f"the app's {fleet_usd_per_hr:.4g} USD/hr ({others_usd_per_hr:.4g} USD/hr of it"
                " the workers of other profile runs, a rollout's among them, ended with their"
                " run or once it is not heard of)"
            )
        # What does not fit, without the advice (a rollout's wait quotes it: a rollout profiles
        # the types its plan needs, and takes no --types).
        self.cost = (
            f"app {app!r}: profiling costs {workers_usd_per_hr:.4g} USD/hr (one worker per type)"
            f" on top of {beside}, over the budget of {plain(budget_usd_per_hr)} USD/hr"
        )
        super().__init__(f"{self.cost}; profile fewer types (--types) or raise the budget")


class InvalidValueError(ControlPlaneError, ValueError):
    """A value handed to the store that it refuses (a budget <= 0, a NaN latency, a naive time);
    ``field`` names it. The API validates requests first, so this is a caller's bug or a bad
    command-line value."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class UnknownScopeError(ControlPlaneError, ValueError):
    """A token scope that is not one of the known scopes."""

    def __init__(self, scope: str, known: list[str]) -> None:
        self.scope = scope
        self.known = known
        super().__init__(f"unknown scope {scope!r} (known: {', '.join(known)})")


class DatabaseError(ControlPlaneError):
    """The database cannot be reached, is not migrated, or refused a statement; the message says
    which, on one line, with the URL's password hidden."""


class DatabaseInUseError(DatabaseError):
    """Another process serves the SQLite database (``holder``: its pid, "" when unknown)."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


# --- the model registry ----------------------------------------------------------------------


class ModelError(ControlPlaneError):
    """A model artifact the registry (:mod:`controlplane.registry`) refuses or cannot keep; the
    message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class ModelNameError(ModelError, ValueError):
    """A model name that is not a DNS label, or a reference that is not ``NAME`` or
    ``NAME@VERSION``; ``name`` is what was given."""

    def __init__(self, name: str, problem: str) -> None:
        self.name = name
        super().__init__(problem)


class ModelTooLargeError(ModelError):
    """An artifact over the registry's limit (``model_max_bytes``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        super().__init__(
            f"the model is larger than {max_bytes:,} bytes (the service's model_max_bytes)"
        )


class ModelRejectedError(ModelError):
    """An artifact whose inspection refused it (not ONNX or TorchScript, truncated, no dynamic
    first dimension, TorchScript without input shapes) or did not finish in time; the message
    is the inspector's one line. ``field``: the push's parameter at fault (``format``,
    ``inputs``), None where it is the artifact itself."""

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


# ArtifactStoreError (the registry's blob store failed a read or a write) is the provider's own
# error: the store belongs to the provider (provisioners.storage); it is named here as well, for
# the API's table of errors.


# --- serving ---------------------------------------------------------------------------------


class ServingError(ControlPlaneError):
    """An inference request the serving loop could not answer with outputs; ``app`` names the
    app it was for."""

    def __init__(self, app: str, message: str) -> None:
        self.app = app
        super().__init__(message)


class OverloadedError(ServingError):
    """Admission control refused a query: the queue it would join cannot be served within the
    SLO even at the cheapest gear (``predicted_ms`` against ``slo_ms``); ``retry_after_s`` is
    when the backlog is expected to have drained enough (whole seconds, >= 1). With
    ``forwarded_to``, the query was admitted and the part its cascade forwarded was refused at
    that later model (``predicted_ms``: from the query's arrival to its answer there)."""

    def __init__(
        self,
        app: str,
        predicted_ms: float,
        slo_ms: float,
        retry_after_s: int,
        forwarded_to: str | None = None,
    ) -> None:
        self.predicted_ms = predicted_ms
        self.slo_ms = slo_ms
        self.retry_after_s = retry_after_s
        self.forwarded_to = forwarded_to
        if forwarded_to is not None:
            # Admitted on entry; the part a cascade forwarded was refused at a later model.
            wait = (
                f"the part of the query its cascade forwarded to model {forwarded_to!r} would be"
                f" answered about {predicted_ms:.0f} ms after the query arrived, against its SLO"
                f" of {slo_ms:g} ms"
                if predicted_ms < float("inf")
                else f"model {forwarded_to!r}, to which its cascade forwarded part of the query,"
                " cannot serve it within its SLO"
            )
        elif predicted_ms < float("inf"):
            wait = (
                f"a new query would take about {predicted_ms:.0f} ms against its SLO of"
                f" {slo_ms:g} ms even at the cheapest gear"
            )
        else:
            wait = "its queues hold as many samples as they may"
        super().__init__(app, f"app {app!r} is overloaded: {wait}; retry after {retry_after_s} s")


class NoServingInstanceError(ServingError):
    """No healthy worker of the app serves ``model`` (none running yet, or all failed)."""

    def __init__(self, app: str, model: str, reason: str = "") -> None:
        self.model = model
        extra = f" ({reason})" if reason else ""
        super().__init__(app, f"app {app!r} has no serving instance for model {model!r}{extra}")


class ServingUnavailableError(ServingError):
    """The service runs no serving loop (not started, or stopping), or the app's spec cannot be
    served (its profile files are gone); ``reason`` says which."""

    def __init__(self, app: str, reason: str) -> None:
        self.reason = reason
        super().__init__(app, f"app {app!r} cannot be served now: {reason}")


class RequirementsUnmetError(ServingError):
    """No variant of the app meets a model-less query's requirements; ``offer`` is the closest
    variant (INFaaS's suggestion) and the message says what it misses by."""

    def __init__(self, app: str, message: str, offer: str) -> None:
        self.offer = offer
        super().__init__(app, message)


class QueryFailedError(ServingError):
    """The workers could not answer the query: every attempt failed (``attempts`` of them), or a
    worker refused its inputs; ``reason`` is the last failure. ``transport``: the last failure
    was the worker's, not the model's (no answer, a timeout, a broken or refused connection, an
    error status of the worker's own), so the query may be answered if sent again once another
    worker serves: the API adds ``Retry-After`` to its 502 and gRPC answers ``UNAVAILABLE``, where
    a model that raised is ``INTERNAL``."""

    def __init__(self, app: str, reason: str, attempts: int, *, transport: bool = False) -> None:
        self.reason = reason
        self.attempts = attempts
        self.transport = transport
        super().__init__(
            app, f"app {app!r}: the query failed after {attempts} attempt(s): {reason}"
        )


class QueryRejectedError(ServingError):
    """A worker answered that the query's own inputs make the model fail (an index out of
    range, a wrong shape or datatype: the model raised on this query while it serves others);
    ``reason`` is the worker's one line. Not retried: another worker would refuse it too."""

    def __init__(self, app: str, reason: str) -> None:
        self.reason = reason
        super().__init__(app, f"app {app!r}: the model refused the query's inputs: {reason}")


class QueryTimeoutError(ServingError):
    """The query was not answered within ``give_up_s`` (far past its SLO): an explicit error
    instead of waiting without bound."""

    def __init__(self, app: str, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        within = f"{give_up_s:.6g} s" if give_up_s >= 1.0 else f"{1000.0 * give_up_s:.3g} ms"
        super().__init__(app, f"app {app!r}: the query was not answered within {within}")


class WorkerCallError(ControlPlaneError):
    """A call to a worker that did not give an answer: ``kind`` is ``connect``, ``timeout``,
    ``closed`` (the connection broke), ``malformed`` (an answer that is not the agent's),
    ``status`` (an HTTP error status that says the worker cannot serve: 503, 404, ...), or one
    of the two the worker answered about the batch itself: ``input`` (400, 413, 422: the inputs
    are at fault) and ``model`` (500: the model raised). ``status`` is the HTTP status when
    there was one. ``worker_fault`` is False for ``input`` and ``model``: the worker answered,
    so it is as healthy as before, and retrying elsewhere would not help. ``rows``: the rows of
    the batch (0-based) the worker named as the ones that failed, when it named them (the agent
    runs a failed batch again row by row); None when it did not."""

    def __init__(
        self,
        address: str,
        kind: str,
        detail: str,
        *,
        status: int | None = None,
        worker_fault: bool = True,
        rows: tuple[int, ...] | None = None,
    ) -> None:
        self.address = address
        self.kind = kind
        self.detail = detail
        self.status = status
        self.worker_fault = worker_fault
        self.rows = rows
        super().__init__(f"worker {address}: {kind}: {detail}")


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first line of ``error``'s message (its type's name when it has none), cut to
    ``limit`` characters where given: what a log line or a decision quotes of it."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if limit is None else text[:limit]
