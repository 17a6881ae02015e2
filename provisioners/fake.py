"""The in-memory fake provisioner, with failure knobs, for unit and component tests.

:class:`FakeProvisioner` keeps the :class:`~provisioners.base.Provisioner` contract the way the
EC2 provisioner does (idempotent by request id, tags, zones tried in order with a capacity
fallback, typed errors, events) and is deterministic: ids come from a counter
(``fake-00000001``, ...), addresses from the same counter, and the time of events and launches
from an injected ``now`` (a fixed instant unless given). Nothing happens on its own: instances
advance through their lifecycle only when the test calls :meth:`FakeProvisioner.step`.

The knobs (each a method, undone by calling it again with other values):

- :meth:`~FakeProvisioner.fail_capacity` / :meth:`~FakeProvisioner.restore_capacity`: no
  capacity of a type in a zone (or every zone);
- :meth:`~FakeProvisioner.set_quota`: at most N live instances of a type;
- :meth:`~FakeProvisioner.throttle_next`: the next N calls raise ``ThrottledError``;
- :meth:`~FakeProvisioner.never_run` / :meth:`~FakeProvisioner.fail_start`: instances of a type
  stay ``pending`` for ever, or turn ``failed`` at the next step;
- :meth:`~FakeProvisioner.fail_terminate_next`: the next N terminations raise;
- :meth:`~FakeProvisioner.crash`: instances vanish, as if the machines died with no trace;
- :meth:`~FakeProvisioner.add_unmanaged`: an instance heteroplane did not launch;
- :meth:`~FakeProvisioner.interrupt`: a spot interruption warning for an instance
  (:meth:`~FakeProvisioner.poll_interruptions` hands it out), the instance taken away (``failed``)
  at the first :meth:`~FakeProvisioner.step` at or past its deadline unless terminated by then.

>>> fake = FakeProvisioner(zones=("zone-a", "zone-b"))
>>> fake.fail_capacity("g4dn.xlarge", "zone-a")
>>> [i.zone for i in fake.launch(LaunchRequest("r-1", "g4dn.xlarge", 2, {}))]
['zone-b', 'zone-b']
>>> fake.poll_events()[0].kind
'capacity'
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from provisioners.base import (
    MANAGED_TAG,
    EventKind,
    LaunchRequest,
    ProviderState,
    ProvisionedInstance,
    ProvisionerEvent,
    launch_tags,
    tags_match,
)
from provisioners.errors import (
    InsufficientCapacityError,
    InvalidConfigurationError,
    ProvisionerError,
    QuotaExceededError,
    ThrottledError,
    UnknownInstanceError,
)
from provisioners.interruptions import (
    INTERRUPTION_NOTICE_S,
    InterruptionNotice,
    NoticeBoard,
    SpotPriceBoard,
)
from provisioners.storage import ArtifactStorage, LocalArtifactStorage

__all__ = ["FAKE_NOW", "FakeProvisioner"]

# The time of everything the fake does unless a ``now`` is injected: a fixed instant keeps tests
# reproducible.
FAKE_NOW = datetime(2024, 1, 1, tzinfo=UTC)

_LIVE_STATES: frozenset[ProviderState] = frozenset({"pending", "running", "stopping"})


@dataclass(frozen=True, slots=True)
class _Launch:
    """What a request id launched (to answer the same request again, and to spot a reuse)."""

    instance_type: str
    count: int
    provider_ids: tuple[str, ...]


class FakeProvisioner:
    """An in-memory :class:`~provisioners.base.Provisioner` (see the module docstring)."""

    name = "fake"

    def __init__(
        self,
        *,
        zones: Sequence[str] = ("fake-zone-a", "fake-zone-b"),
        now: Callable[[], datetime] | None = None,
        running_on_launch: bool = False,
    ) -> None:
        """``zones`` are tried in order; ``now`` stamps launches and events; with
        ``running_on_launch`` instances start ``running`` instead of ``pending``."""
        if not zones:
            raise InvalidConfigurationError("zones", "at least one zone is needed")
        self.zones: tuple[str, ...] = tuple(zones)
        self._now = now if now is not None else (lambda: FAKE_NOW)
        self._running_on_launch = running_on_launch
        self._lock = threading.Lock()
        self._counter = 0
        self._instances: dict[str, ProvisionedInstance] = {}
        self._launches: dict[str, _Launch] = {}
        self._events: list[ProvisionerEvent] = []
        # Knobs.
        self._no_capacity: set[tuple[str, str | None]] = set()
        self._quotas: dict[str, int] = {}
        self._throttle_calls = 0
        self._never_run: set[str] = set()
        self._fail_start: set[str] = set()
        self._stuck: set[str] = set()
        self._fail_terminate_calls = 0
        self._notices = NoticeBoard()
        self._deadlines: dict[str, datetime] = {}
        self._spot_prices = SpotPriceBoard()
        # What tests look at.
        self.launched_total = 0
        self.calls: builtins.list[str] = []

    # --- knobs -----------------------------------------------------------------------------

    def fail_capacity(self, instance_type: str, zone: str | None = None) -> None:
        """No capacity of ``instance_type`` in ``zone`` (``None``: in every zone)."""
        with self._lock:
            self._no_capacity.add((instance_type, zone))

    def restore_capacity(self, instance_type: str, zone: str | None = None) -> None:
        """Undo :meth:`fail_capacity` for the same arguments."""
        with self._lock:
            self._no_capacity.discard((instance_type, zone))

    def set_quota(self, instance_type: str, max_instances: int | None) -> None:
        """At most ``max_instances`` live instances of ``instance_type`` (``None``: no limit)."""
        with self._lock:
            if max_instances is None:
                self._quotas.pop(instance_type, None)
            else:
                self._quotas[instance_type] = max_instances

    def throttle_next(self, calls: int) -> None:
        """The next ``calls`` calls of launch, terminate or list raise ``ThrottledError``."""
        with self._lock:
            self._throttle_calls = calls

    def never_run(self, instance_type: str, stuck: bool = True) -> None:
        """Instances of ``instance_type`` launched from now on stay ``pending`` for ever."""
        with self._lock:
            (self._never_run.add if stuck else self._never_run.discard)(instance_type)

    def fail_start(self, instance_type: str, failing: bool = True) -> None:
        """Pending instances of ``instance_type`` turn ``failed`` at the next :meth:`step`."""
        with self._lock:
            (self._fail_start.add if failing else self._fail_start.discard)(instance_type)

    def set_spot_price(self, instance_type: str, price_usd_per_hr: float | None) -> None:
        """The spot price of ``instance_type`` now, as :meth:`spot_price` answers it (``None``:
        not known here, the app's catalog's serves), as the EC2 provisioner reads it with
        DescribeSpotPriceHistory."""
        self._spot_prices.set(instance_type, price_usd_per_hr)

    def spot_price(self, instance_type: str) -> float | None:
        """The spot price set with :meth:`set_spot_price`, or ``None``."""
        return self._spot_prices.get(instance_type)

    def fail_terminate_next(self, calls: int) -> None:
        """The next ``calls`` calls of :meth:`terminate` raise ``ProvisionerError`` (nothing is
        terminated)."""
        with self._lock:
            self._fail_terminate_calls = calls

    def crash(self, provider_ids: Sequence[str] | None = None) -> builtins.list[str]:
        """These instances (``None``: every one) vanish without a trace: :meth:`list` no longer
        shows them. Returns the ids lost."""
        with self._lock:
            lost = [
                pid
                for pid in (self._instances if provider_ids is None else provider_ids)
                if pid in self._instances
            ]
            for pid in lost:
                del self._instances[pid]
            return lost

    def add_unmanaged(self, instance_type: str, tags: Mapping[str, str] | None = None) -> str:
        """Put a running instance that heteroplane did not launch (no managed tag); its id."""
        with self._lock:
            pid = self._next_id()
            self._instances[pid] = ProvisionedInstance(
                pid,
                instance_type,
                "running",
                dict(tags or {}),
                address=self._address(pid),
                zone=self.zones[0],
                launched_at=self._now(),
            )
            return pid

    def interrupt(
        self, provider_id: str, notice_s: float = INTERRUPTION_NOTICE_S
    ) -> InterruptionNotice:
        """A spot interruption warning for ``provider_id`` at ``now``; the instance is taken
        away (``failed``) at the first :meth:`step` at or past ``now + notice_s`` unless it is
        terminated by then."""
        with self._lock:
            if provider_id not in self._instances:
                raise InvalidConfigurationError("provider_id", f"no instance {provider_id}")
            notice = self._notices.post(provider_id, self._now(), notice_s)
            self._deadlines[provider_id] = notice.deadline
            return notice

    def poll_interruptions(self) -> builtins.list[InterruptionNotice]:
        """The notices :meth:`interrupt` gave since the last call, oldest first."""
        return self._notices.take()

    def step(self) -> None:
        """Advance every instance one step: pending -> running (or failed, or stays pending),
        stopping -> terminated; terminated instances are forgotten; an interrupted instance
        still running at its deadline is taken away (``failed``)."""
        with self._lock:
            now = self._now()
            for pid, deadline in builtins.list(self._deadlines.items()):
                instance = self._instances.get(pid)
                if instance is None or instance.state not in ("pending", "running"):
                    del self._deadlines[pid]
                elif now >= deadline:
                    del self._deadlines[pid]
                    self._instances[pid] = replace(instance, state="failed")
                    self._event("failed", f"{pid} interrupted (spot)", instance, pid)
            for pid, instance in builtins.list(self._instances.items()):
                if instance.state == "terminated":
                    del self._instances[pid]
                elif instance.state == "stopping":
                    self._instances[pid] = replace(instance, state="terminated")
                elif instance.state == "pending":
                    if instance.instance_type in self._fail_start:
                        self._instances[pid] = replace(instance, state="failed")
                        self._event("failed", f"{pid} failed to start", instance, pid)
                    elif pid not in self._stuck:
                        self._instances[pid] = replace(instance, state="running")

    def set_state(self, provider_id: str, state: ProviderState) -> None:
        """Force an instance into ``state`` (a stopped or failed machine, say)."""
        with self._lock:
            self._instances[provider_id] = replace(self._instances[provider_id], state=state)

    # --- the protocol ----------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> builtins.list[ProvisionedInstance]:
        with self._lock:
            self.calls.append("launch")
            self._maybe_throttle("launch")
            earlier = self._launches.get(request.request_id)
            if earlier is not None:
                if (earlier.instance_type, earlier.count) != (request.instance_type, request.count):
                    raise InvalidConfigurationError(
                        "request_id",
                        f"{request.request_id} was used for {earlier.count} x"
                        f" {earlier.instance_type}, not {request.count} x {request.instance_type}",
                    )
                return [
                    self._instances.get(pid) or self._gone(pid, request)
                    for pid in earlier.provider_ids
                ]
            quota = self._quotas.get(request.instance_type)
            if quota is not None:
                live = sum(
                    1
                    for i in self._instances.values()
                    if i.instance_type == request.instance_type
                    and i.state in _LIVE_STATES
                    and MANAGED_TAG in i.tags
                )
                if live + request.count > quota:
                    error = QuotaExceededError(
                        request.instance_type, f"{live} running, limit {quota}"
                    )
                    self._event("quota", str(error), None, None, request.instance_type)
                    raise error
            zone = self._zone_for(request.instance_type)
            stuck = request.instance_type in self._never_run
            state: ProviderState = "running" if self._running_on_launch and not stuck else "pending"
            launched: builtins.list[ProvisionedInstance] = []
            for _ in range(request.count):
                pid = self._next_id()
                instance = ProvisionedInstance(
                    pid,
                    request.instance_type,
                    state,
                    launch_tags(request),
                    address=self._address(pid),
                    zone=zone,
                    launched_at=self._now(),
                )
                self._instances[pid] = instance
                if stuck:
                    self._stuck.add(pid)
                launched.append(instance)
            self.launched_total += request.count
            self._launches[request.request_id] = _Launch(
                request.instance_type, request.count, tuple(i.provider_id for i in launched)
            )
            return launched

    def terminate(self, provider_ids: Sequence[str]) -> None:
        with self._lock:
            self.calls.append("terminate")
            self._maybe_throttle("terminate")
            for pid in provider_ids:
                instance = self._instances.get(pid)
                if instance is not None and MANAGED_TAG not in instance.tags:
                    raise UnknownInstanceError(pid)
            if self._fail_terminate_calls > 0:
                self._fail_terminate_calls -= 1
                self._event("failed", f"terminate of {len(provider_ids)} instance(s) failed")
                raise ProvisionerError("terminate failed (injected)")
            for pid in provider_ids:
                instance = self._instances.get(pid)
                if instance is not None and instance.state != "terminated":
                    self._instances[pid] = replace(instance, state="terminated")

    def list(self, tags: Mapping[str, str]) -> builtins.list[ProvisionedInstance]:
        with self._lock:
            self.calls.append("list")
            self._maybe_throttle("list")
            return [
                instance
                for instance in self._instances.values()
                if MANAGED_TAG in instance.tags and tags_match(instance.tags, tags)
            ]

    def poll_events(self) -> builtins.list[ProvisionerEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def instance_types(self) -> None:
        """Any type (the knobs above make one fail)."""
        return None

    def launch_refusal(self, instance_type: str) -> str | None:
        return None

    def artifact_storage(self, root: Path) -> ArtifactStorage:
        """Files under ``root`` (its instances fetch nothing)."""
        return LocalArtifactStorage(root)

    def close(self) -> None:
        """Nothing to release."""

    # --- inside ----------------------------------------------------------------------------

    def _next_id(self) -> str:
        self._counter += 1
        return f"fake-{self._counter:08d}"

    @staticmethod
    def _address(provider_id: str) -> str:
        number = int(provider_id.rsplit("-", 1)[1])
        return f"10.0.{number // 250}.{number % 250 + 4}"

    def _gone(self, provider_id: str, request: LaunchRequest) -> ProvisionedInstance:
        # An instance this request launched that has since vanished (crashed or forgotten).
        return ProvisionedInstance(
            provider_id, request.instance_type, "terminated", launch_tags(request)
        )

    def _zone_for(self, instance_type: str) -> str:
        if (instance_type, None) in self._no_capacity:
            error = InsufficientCapacityError(instance_type, None, "no zone has capacity")
            self._event("capacity", str(error), None, None, instance_type)
            raise error
        tried: builtins.list[str] = []
        for zone in self.zones:
            if (instance_type, zone) not in self._no_capacity:
                if tried:
                    self._event(
                        "capacity",
                        f"{instance_type} has no capacity in {', '.join(tried)};"
                        f" launched in {zone} instead",
                        None,
                        None,
                        instance_type,
                        zone,
                    )
                return zone
            tried.append(zone)
        error = InsufficientCapacityError(
            instance_type, None, f"no capacity in any zone ({', '.join(tried)})"
        )
        self._event("capacity", str(error), None, None, instance_type)
        raise error

    def _maybe_throttle(self, call: str) -> None:
        if self._throttle_calls > 0:
            self._throttle_calls -= 1
            error = ThrottledError(f"{call} (injected)")
            self._event("throttled", str(error))
            raise error

    def _event(
        self,
        kind: EventKind,
        message: str,
        instance: ProvisionedInstance | None = None,
        provider_id: str | None = None,
        instance_type: str | None = None,
        zone: str | None = None,
    ) -> None:
        if instance is not None:
            instance_type = instance.instance_type
            zone = instance.zone
        self._events.append(
            ProvisionerEvent(self._now(), kind, message, instance_type, zone, provider_id)
        )
