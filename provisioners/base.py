"""The provisioner seam: the :class:`Provisioner` protocol, the records it trades in, and the tags
that mark what heteroplane launched.

The contract (Karpenter's cloud-provider interface and Ray's autoscaler v2 node provider are the
models):

- **Asynchronous.** :meth:`Provisioner.launch` returns as soon as the provider has accepted the
  request; the instances it returns are usually ``pending``. Their progress is read with
  :meth:`Provisioner.list`.
- **Idempotent by request id.** Launching the same :class:`LaunchRequest` again (same
  ``request_id``) returns the instances of the first call and never launches more, also after the
  control plane restarts (the request id is on the instances as :data:`REQUEST_TAG`).
  :meth:`Provisioner.terminate` of an instance already gone is a no-op.
- **Tagged.** Every instance carries the request's tags plus :data:`MANAGED_TAG` = ``"true"`` and
  :data:`REQUEST_TAG` = the request id; :meth:`Provisioner.list` finds instances by tags only.
- **Typed errors.** Only :mod:`provisioners.errors` escape; see there for how they are classified.
- **Events.** What the provider did on its own (fell back to another zone, found a type out of
  capacity, retried) is reported by :meth:`Provisioner.poll_events`, once each.
- **Instance types.** :meth:`Provisioner.instance_types` is what it can launch (``None``: any type
  its cloud offers, known only when a launch is tried), :meth:`Provisioner.launch_refusal` says
  why a type cannot be launched (the reconciler asks before launching a plan).
- **What its workers need.** The provider owns where the registry keeps artifact bytes
  (:meth:`Provisioner.artifact_storage`: a store its workers can fetch from) and how a worker
  it launches is started with the artifacts of a :class:`LaunchRequest` (its own bootstrap).
- **Closed once.** :meth:`Provisioner.close` releases what the provider holds (clients,
  threads); its instances are left running and found again by their tags.

A new provider is one module here implementing this protocol, one line in the control plane's
table of factories (``controlplane.provisioning.FACTORIES``) and one block of settings
(``controlplane.settings``); docs/design.md, "Adding a provider".
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol, get_args, runtime_checkable

from provisioners.artifacts import ArtifactRef
from provisioners.storage import ArtifactStorage

__all__ = [
    "APP_TAG",
    "INSTANCE_TAG",
    "MANAGED_TAG",
    "PLAN_TAG",
    "PROVIDER_STATES",
    "REQUEST_TAG",
    "WITHHELD_ENV",
    "EventKind",
    "LaunchRequest",
    "ProviderState",
    "ProvisionedInstance",
    "Provisioner",
    "ProvisionerEvent",
    "launch_refusal",
    "launch_tags",
    "model_process_env",
    "tags_match",
    "with_port",
]

MANAGED_TAG = "heteroplane:managed"
APP_TAG = "heteroplane:app"
PLAN_TAG = "heteroplane:plan"
REQUEST_TAG = "heteroplane:request-id"
# The control plane's own id of the instance (its database row), when it has one.
INSTANCE_TAG = "heteroplane:instance-id"
# The control plane's secrets, kept out of the environment of a worker (and of the model
# inspector): they run the models users push, whose code can read its own /proc/PID/environ. The
# internal secret opens the serving process's internal routes; a client's token and a database URL
# (its password) are the service's, not a model's. (AWS credentials stay: workers fetch from S3.)
WITHHELD_ENV = ("HETEROPLANE_INTERNAL_TOKEN", "HETEROPLANE_TOKEN", "HETEROPLANE_DATABASE_URL")


def model_process_env() -> dict[str, str]:
    """The environment of a process this one starts to run users' models (a local worker, the
    model inspector): this process's without :data:`WITHHELD_ENV`, with this checkout first on
    ``PYTHONPATH`` (it imports ``provisioners`` from here even where it is not installed)."""
    env = {name: value for name, value in os.environ.items() if name not in WITHHELD_ENV}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


ProviderState = Literal["pending", "running", "stopping", "terminated", "failed"]
PROVIDER_STATES: tuple[ProviderState, ...] = get_args(ProviderState)

EventKind = Literal["capacity", "quota", "throttled", "failed", "info"]


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    """Launch ``count`` instances of ``instance_type`` carrying ``tags``; ``request_id`` makes the
    call idempotent (the reconciler records it before acting). ``artifacts`` are the registered
    models the instances' workers load and serve (:mod:`provisioners.artifacts`); empty: the
    provisioner's own default models (the demo family, by name)."""

    request_id: str
    instance_type: str
    count: int
    tags: Mapping[str, str]
    artifacts: tuple[ArtifactRef, ...] = ()

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if not self.instance_type:
            raise ValueError("instance_type must not be empty")
        if self.count < 1:
            raise ValueError(f"count must be at least 1, got {self.count}")


@dataclass(frozen=True, slots=True)
class ProvisionedInstance:
    """One instance as the provider sees it.

    ``address`` is where its worker listens: ``host:port`` for local workers, the private IP for
    EC2 (``None`` until known). ``zone`` is the availability zone (``None`` where it means nothing).
    ``market`` is the purchase option it runs on as the provider bills it, ``on-demand`` or
    ``spot`` (``None``: the provider does not say; it launches what was asked for): EC2 launches
    on demand what spot cannot supply.
    """

    provider_id: str
    instance_type: str
    state: ProviderState
    tags: Mapping[str, str]
    address: str | None = None
    zone: str | None = None
    launched_at: datetime | None = None
    market: str | None = None

    @property
    def request_id(self) -> str | None:
        return self.tags.get(REQUEST_TAG)


@dataclass(frozen=True, slots=True)
class ProvisionerEvent:
    """Something the provider did or met on its own: ``kind`` is ``capacity`` (a type out of
    capacity somewhere, a fallback), ``quota``, ``throttled``, ``failed`` or ``info``."""

    at: datetime
    kind: EventKind
    message: str
    instance_type: str | None = None
    zone: str | None = None
    provider_id: str | None = None


@runtime_checkable
class Provisioner(Protocol):
    """Creates, destroys and lists instances (see the module docstring for the contract)."""

    name: str

    def launch(self, request: LaunchRequest) -> list[ProvisionedInstance]:
        """Launch ``request.count`` instances, or return those an earlier call with the same
        ``request_id`` launched (never launch twice).

        Raises :class:`~provisioners.errors.InsufficientCapacityError` when no zone has capacity,
        :class:`~provisioners.errors.QuotaExceededError`,
        :class:`~provisioners.errors.ThrottledError` or
        :class:`~provisioners.errors.InvalidConfigurationError`.
        """
        ...

    def terminate(self, provider_ids: Sequence[str]) -> None:
        """Terminate these instances. Ids that are unknown or already terminated are ignored
        (idempotent); an id that names an instance not managed by heteroplane raises
        :class:`~provisioners.errors.UnknownInstanceError` and nothing is terminated."""
        ...

    def poll_events(self) -> list[ProvisionerEvent]:
        """The events since the last call, oldest first (each is returned once)."""
        ...

    def instance_types(self) -> frozenset[str] | None:
        """The instance types this provider can launch; ``None``: any its cloud offers (a type
        the cloud does not know fails at launch, as an error)."""
        ...

    def launch_refusal(self, instance_type: str) -> str | None:
        """``None`` when this provider can launch ``instance_type``, else one line saying why not
        (:func:`launch_refusal` over :meth:`instance_types` for most)."""
        ...

    def artifact_storage(self, root: Path) -> ArtifactStorage:
        """Where the registry keeps the bytes of the models users bring, so that this provider's
        workers can fetch them (:mod:`provisioners.storage`); ``root`` is the control plane's own
        folder for them (``<data_dir>/registry``), for a provider whose workers read local
        files."""
        ...

    def close(self) -> None:
        """Release what the provider holds (clients, threads); its instances keep running.
        Called once, when the service stops."""
        ...

    # Last: inside the class body, ``list`` names this method, not the builtin.
    def list(self, tags: Mapping[str, str]) -> list[ProvisionedInstance]:
        """Every instance whose tags include all of ``tags`` (at least :data:`MANAGED_TAG` is
        implied). Instances terminated recently may be listed with state ``terminated`` (EC2 keeps
        them visible for about an hour); callers count only the others."""
        ...


def with_port(address: str, port: int) -> str:
    """A provider address as ``host:port``: as it is when it names a port (``127.0.0.1:8080``,
    ``[::1]:8080``), else with ``port`` (an EC2 private IP; a bare IPv6 address in brackets)."""
    if address.startswith("[") or address.count(":") == 1:
        return address
    if ":" in address:  # a bare IPv6 address
        return f"[{address}]:{port}"
    return f"{address}:{port}"


def launch_refusal(
    provider: str, instance_types: Collection[str] | None, instance_type: str, why: str = ""
) -> str | None:
    """Why ``provider``, which launches ``instance_types`` (``None``: any), cannot launch
    ``instance_type``: ``why`` when given, else a line naming what it can launch.

    >>> launch_refusal("local", {"emu.gpu"}, "g4dn.xlarge")
    'the local provisioner cannot launch g4dn.xlarge (it launches emu.gpu)'
    >>> launch_refusal("ec2", None, "g4dn.xlarge") is None
    True
    """
    if instance_types is None or instance_type in instance_types:
        return None
    return why or (
        f"the {provider} provisioner cannot launch {instance_type}"
        f" (it launches {', '.join(sorted(instance_types)) or 'nothing'})"
    )


def launch_tags(request: LaunchRequest) -> dict[str, str]:
    """The tags an instance launched for ``request`` carries: the request's own, plus
    :data:`MANAGED_TAG` and :data:`REQUEST_TAG` (which win over the request's).

    >>> launch_tags(LaunchRequest("r-1", "t3.large", 1, {APP_TAG: "recs"}))["heteroplane:managed"]
    'true'
    """
    return {**request.tags, MANAGED_TAG: "true", REQUEST_TAG: request.request_id}


def tags_match(tags: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Whether ``tags`` include every key of ``wanted`` with the same value.

    >>> tags_match({"a": "1", "b": "2"}, {"a": "1"})
    True
    """
    return all(tags.get(key) == value for key, value in wanted.items())
