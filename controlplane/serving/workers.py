"""The live workers of an app as the serving loop sees them: where they are, whether they are
healthy, whether they are busy.

- **Where** (:class:`InstanceSource`): the store's instances of the app that are ``running`` (the
  reconciler moved them there once the provider said so and, for local workers, ``/health``
  answered), joined with the provider's listing for their addresses
  (:class:`ProvisionedInstances`: the local provisioner's ``127.0.0.1:port``; EC2's private IP,
  with the agent's port :data:`DEFAULT_WORKER_PORT`). The loop reads it every ``refresh_s`` in a
  thread (it is blocking I/O) and on demand when an app has no worker yet.
  :class:`StaticInstances` is the in-repo fake: a fixed list per app.
- **Healthy** (:class:`Worker`): a worker whose call fails (an error status, a broken connection,
  a timeout) is marked unhealthy *at once* and leaves matching; the dispatcher re-dispatches the
  batch it held. It is probed (``GET /health``) from ``retry_at_s`` on, an exponential backoff
  from :data:`BACKOFF_BASE_S` to :data:`BACKOFF_MAX_S` over its consecutive failures, and
  comes back after a probe that answers ``ok``; a successful batch resets the count. A probe
  whose agent says it is busy (a slow batch still runs there) keeps it out without counting a
  failure: it is probed again after the same backoff (:meth:`Worker.still_busy`). A worker the
  source stops listing (terminated, failed) leaves the loop altogether.
- **Busy**: a worker serves one batch at a time (the agent serialises batches, and the simulator
  and the policies assume it), so the loop sends it the next only when the last has returned;
  ``busy_until_s`` is the predicted end (start plus the profile's mean), which is what the Kairos
  policy reads of a busy instance, as in the authors' live dispatcher.
- **Utilisation** (:meth:`Worker.utilisation`): the share of the last
  :data:`UTILISATION_WINDOW_S` the worker spent serving batches (call start to answer), from
  marks of its cumulative busy time taken at most once a second; what the dashboard's instance
  table shows.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from controlplane.db.store import Store
from controlplane.policies.lifecycle import InstanceState, is_profile_worker
from controlplane.policies.rollout import rollout_request_prefix
from provisioners.base import APP_TAG, Provisioner, with_port
from provisioners.errors import ProvisionerError

__all__ = [
    "BACKOFF_BASE_S",
    "BACKOFF_MAX_S",
    "DEFAULT_WORKER_PORT",
    "UTILISATION_WINDOW_S",
    "InstanceSource",
    "ProvisionedInstances",
    "StaticInstances",
    "Worker",
    "WorkerEndpoint",
    "backoff_s",
]

logger = logging.getLogger(__name__)

# The worker agent's default port (``python -m provisioners.worker --port``), where an EC2
# instance's agent listens on its private address.
DEFAULT_WORKER_PORT = 8080
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
# Utilisation is the busy share over this window, marked at most every UTILISATION_MARK_S.
UTILISATION_WINDOW_S = 60.0
UTILISATION_MARK_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    """A running instance of an app: its id (the store's), type and ``host:port``."""

    instance_id: str
    instance_type: str
    address: str
    provider_id: str | None = None


class InstanceSource(Protocol):
    """Where an app's running workers are (blocking: the loop calls it in a thread)."""

    def running(self, app: str) -> list[WorkerEndpoint]: ...


class ProvisionedInstances:
    """The store's ``running`` instances of an app with the provider's addresses for them.

    The provider is asked only when a running instance's address is not known yet (an
    instance's address does not change while it runs): a refresh every second must not become a
    DescribeInstances call every second per app.
    """

    def __init__(
        self, store: Store, provisioner: Provisioner, *, port: int = DEFAULT_WORKER_PORT
    ) -> None:
        self.store = store
        self.provisioner = provisioner
        self.port = port
        self._lock = threading.Lock()
        self._addresses: dict[str, dict[str, str]] = {}  # app -> provider id -> address

    def running(self, app: str) -> list[WorkerEndpoint]:
        # A profile run's workers (and a rollout's) are not the fleet's.
        return self._running(app, lambda request_id: not is_profile_worker(request_id))

    def running_rollout(self, app: str, rollout_id: int) -> list[WorkerEndpoint]:
        """The running workers of ``app``'s rollout ``rollout_id`` (the new version's)."""
        prefix = rollout_request_prefix(app, rollout_id)
        return self._running(app, lambda request_id: request_id.startswith(prefix))

    def _running(self, app: str, keep: Callable[[str], bool]) -> list[WorkerEndpoint]:
        rows = [
            row
            for row in self.store.list_instances(app, states=[InstanceState.RUNNING.value])
            if keep(row.request_id)
        ]
        running_ids = {r.provider_id for r in rows if r.provider_id is not None}
        with self._lock:
            cached = self._addresses.get(app, {})
            # What stopped running is forgotten: a provider id does not come back.
            known = {p: a for p, a in cached.items() if p in running_ids}
        if running_ids - set(known):
            try:
                listed = self.provisioner.list({APP_TAG: app})
            except ProvisionerError as error:  # throttled, unreachable: the next refresh asks
                logger.warning("%s: cannot list the workers' addresses: %s", app, error)
                listed = []
            for instance in listed:
                address = instance.address
                if instance.state == "running" and address and instance.provider_id in running_ids:
                    known[instance.provider_id] = address
        with self._lock:
            self._addresses[app] = known
        endpoints = []
        for row in rows:
            address = known.get(row.provider_id) if row.provider_id is not None else None
            if address is not None:
                endpoints.append(
                    WorkerEndpoint(
                        row.id, row.instance_type, with_port(address, self.port), row.provider_id
                    )
                )
        return endpoints


class StaticInstances:
    """A fixed list of workers per app, changed by :meth:`set` (tests, benchmarks)."""

    def __init__(self, by_app: Mapping[str, Sequence[WorkerEndpoint]] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_app = {app: list(endpoints) for app, endpoints in (by_app or {}).items()}

    def set(self, app: str, endpoints: Sequence[WorkerEndpoint]) -> None:
        with self._lock:
            self._by_app[app] = list(endpoints)

    def running(self, app: str) -> list[WorkerEndpoint]:
        with self._lock:
            return list(self._by_app.get(app, ()))

    def running_rollout(self, app: str, rollout_id: int) -> list[WorkerEndpoint]:
        """The workers :meth:`set` under ``rollout_request_prefix(app, rollout_id)``."""
        return self.running(rollout_request_prefix(app, rollout_id))


def backoff_s(failures: int) -> float:
    """How long a worker with ``failures`` consecutive failures waits before its next probe.

    >>> [backoff_s(n) for n in (1, 2, 3)]
    [0.5, 1.0, 2.0]
    """
    if failures <= 0:
        return 0.0
    return float(min(BACKOFF_BASE_S * 2.0 ** min(failures - 1, 32), BACKOFF_MAX_S))


class Worker:
    """One live worker in the serving loop (see the module docstring)."""

    __slots__ = (
        "agent_busy",
        "answered",
        "busy_marks",
        "busy_s",
        "busy_until_s",
        "checked_s",
        "endpoint",
        "failures",
        "healthy",
        "idle_since_s",
        "last_error",
        "probing",
        "retry_at_s",
        "running",
        "slow",
        "started_s",
    )

    def __init__(self, endpoint: WorkerEndpoint, now_s: float) -> None:
        self.endpoint = endpoint
        self.answered = 0  # batches it answered since it joined the loop
        # A call to it timed out on a slow batch (it answered its probe) and no call has been
        # answered since: it may still be busy with that batch, so a timeout now is not the
        # new batch's (AppDispatcher._failed).
        # Cleared too when it comes back from a probe that found its agent busy (the agent
        # says so) and then not: the batch is over.
        self.slow = False
        self.healthy = True
        self.running = False
        self.busy_until_s = now_s
        self.started_s = now_s
        self.busy_s = 0.0  # seconds spent serving batches, calls in progress excluded
        self.busy_marks: deque[tuple[float, float]] = deque([(now_s, 0.0)])
        self.idle_since_s = now_s
        self.checked_s = now_s  # when a call or a probe last reached it
        self.failures = 0
        self.retry_at_s = now_s
        self.last_error = ""
        self.probing = False
        self.agent_busy = False  # its last probe found its agent busy (last_error says so)

    @property
    def instance_id(self) -> str:
        return self.endpoint.instance_id

    @property
    def instance_type(self) -> str:
        return self.endpoint.instance_type

    @property
    def address(self) -> str:
        return self.endpoint.address

    def is_idle(self, now_s: float) -> bool:
        return self.healthy and not self.running

    def start(self, now_s: float, predicted_ms: float) -> None:
        self.running = True
        self.started_s = now_s
        self.busy_until_s = now_s + predicted_ms / 1000.0

    def finish(self, now_s: float) -> None:
        if self.running:
            self.busy_s += max(0.0, now_s - self.started_s)
        self.running = False
        self.idle_since_s = now_s
        self.checked_s = now_s
        self.busy_until_s = min(self.busy_until_s, now_s)

    def busy_total_s(self, now_s: float) -> float:
        """Seconds spent serving batches so far, the call in progress included."""
        return self.busy_s + (max(0.0, now_s - self.started_s) if self.running else 0.0)

    def utilisation(self, now_s: float, window_s: float = UTILISATION_WINDOW_S) -> float | None:
        """The share of about the last ``window_s`` spent serving (None before any time has
        passed). Each call marks the busy total (at most every :data:`UTILISATION_MARK_S`) and
        measures from the newest mark at least ``window_s`` old, else the oldest.

        >>> w = Worker(WorkerEndpoint("i-1", "t", "127.0.0.1:1"), 0.0)
        >>> w.start(10.0, 5.0); w.finish(40.0)
        >>> w.utilisation(60.0)
        0.5
        >>> w.utilisation(100.0)  # still from 0: no mark at least 60 s old but that one
        0.3
        >>> w.utilisation(130.0)  # from the mark at 60: idle since
        0.0
        """
        total = self.busy_total_s(now_s)
        marks = self.busy_marks
        if now_s - marks[-1][0] >= UTILISATION_MARK_S:
            marks.append((now_s, total))
        while len(marks) > 1 and marks[1][0] <= now_s - window_s:
            marks.popleft()
        since, busy_then = marks[0]
        if now_s <= since:
            return None
        return min(1.0, max(0.0, (total - busy_then) / (now_s - since)))

    def succeeded(self) -> None:
        self.failures = 0
        self.slow = False

    def fail(self, now_s: float, reason: str) -> None:
        """Unhealthy from now; probed again after the backoff."""
        self.healthy = False
        self.failures += 1
        self.retry_at_s = now_s + backoff_s(self.failures)
        self.last_error = reason
        self.agent_busy = False

    def still_busy(self, now_s: float, in_flight: int, busy_s: float) -> None:
        """Its probe found it alive but its agent busy (``in_flight`` batches, the oldest for
        ``busy_s``: a slow batch still runs there): it stays out of matching, probed again
        after the same backoff (busy is not a failure: the backoff does not grow)."""
        self.retry_at_s = now_s + backoff_s(self.failures)
        self.last_error = f"busy: {in_flight} batch(es) under way, the oldest for {busy_s:.1f} s"
        self.agent_busy = True

    def recover(self, now_s: float) -> None:
        if self.agent_busy:  # its agent said the slow batch ran, and now that none does
            self.slow = False
        self.healthy = True
        self.agent_busy = False
        self.idle_since_s = now_s
        self.checked_s = now_s
        self.last_error = ""
