"""The EC2 provisioner: workers as EC2 instances, through boto3.

This module owns :class:`Ec2Config` (what the provisioner needs to know, in the provisioners'
own terms; the control plane converts its settings into one) and :class:`Ec2Provisioner`, which
keeps the :class:`~provisioners.base.Provisioner` contract on EC2:

- **Launch.** ``RunInstances`` with ``MinCount = MaxCount = count`` (all or nothing), from the
  type's launch template when one is configured (made by terraform, or by
  :meth:`Ec2Provisioner.ensure_launch_templates` in development), else from ``ami_id``; tags on
  the instance and its volumes (the request's tags, ``heteroplane:managed``,
  ``heteroplane:request-id``, and a ``Name``).
- **Idempotent.** Before launching, the instances tagged with the request id are looked up
  (that survives a restart of the control plane); the ``ClientToken`` of every ``RunInstances``
  is derived from the request id as well, so EC2 itself answers a retried call with the same
  reservation.
- **Capacity.** Capacity errors (``InsufficientInstanceCapacity``, ``Unsupported``, ...) fail
  fast (botocore would otherwise retry their HTTP 500 as transient), mark the offering (type, zone)
  unavailable for ``unavailable_ttl_s`` (Karpenter's unavailable-offerings cache) and the next
  subnet is tried; when none is left, :class:`~provisioners.errors.InsufficientCapacityError`
  goes back to the caller so the planner can fall back to the next configuration. Each step is a
  ``capacity`` event.
- **Spot** (``spot=True``, types with a launch template): ``CreateFleet`` of type ``instant`` with
  every usable subnet as an override, tagging the instances and their volumes at creation as
  ``RunInstances`` does (moto 5.2 accepts the fleet's volume tags but drops them; AWS applies
  them). A request the reconciler tagged on demand (``heteroplane:market=on-demand``: an app's
  on-demand base) goes to ``RunInstances`` whatever ``spot`` says. What spot cannot
  supply is launched on demand where the request was budgeted on demand (the deployment's
  ``spot``); a request the reconciler tagged spot (``heteroplane:market``),
  budgeted at the spot price, is refused instead (:class:`~provisioners.errors.
  SpotUnavailableError`), as is one for a type without a template or with artifacts: the
  reconciler launches it on demand next, where the budget pays for that.
- **Models a user brings** (``request.artifacts``): RunInstances gets ``UserData`` that is the
  provider's own bootstrap (:func:`worker_user_data`): a few lines that write the worker's
  options for the models, one ``--artifact NAME:MODEL:VERSION:FORMAT:SHA256:URI`` (and
  ``--artifact-inputs``) a line, to :data:`ARTIFACTS_FILE`, then the type's launch template's own
  user data as it is (terraform's ``templates/worker.sh.tftpl``, read back with
  ``DescribeLaunchTemplateVersions``, version ``$Default``), whose agent reads that file
  (``--artifacts-file``). The install, the port, the bucket and the unit stay terraform's, and
  nothing of its script is parsed or rewritten; the worker downloads ``s3://`` artifacts with
  its instance role and checks their sha256. A type without such a template (``ami_id``, or a
  template made by :meth:`Ec2Provisioner.ensure_launch_templates`, which has no user data)
  cannot serve artifacts: :class:`~provisioners.errors.InvalidConfigurationError`, as is user
  data over EC2's 16 KB. Spot fleets take the template's user data as it is (``CreateFleet`` has
  no per-launch override), so with ``spot=True`` a request with artifacts is launched on demand,
  with an ``info`` event (refused where it was tagged spot, as above): the simplest correct way
  (a template version per artifact set would be the other, at the price of versions piling up
  on terraform's templates).
- **Artifact store.** With ``model_bucket`` set, the registry keeps the models users bring in
  that bucket under ``model_prefix`` (:meth:`Ec2Provisioner.artifact_storage`), where the
  workers' role may read them; without one, in the control plane's data directory (which EC2
  workers cannot reach: for the family's models only).
- **Throttling** is retried by botocore's adaptive retry mode (client-side rate limiting and
  backoff); what is still throttled after ``max_attempts`` is a
  :class:`~provisioners.errors.ThrottledError`.
- **Listing** is by tags only (``DescribeInstances`` with tag filters, paginated), never
  unfiltered; terminating first looks the ids up and refuses instances that are not ours, or,
  when that lookup is throttled or unanswered, terminates the ids without it (the role may
  terminate managed instances only).
- **Timeouts.** Every EC2 and SQS call waits at most ``connect_timeout_s`` to connect and
  ``read_timeout_s`` for an answer, on each of at most two tries once one timed out: a hung
  endpoint is a :class:`~provisioners.errors.ProvisionerError`, not a stalled reconciler.

Every boto error goes through :func:`map_client_error`; none escapes this module. The endpoint is
boto3's own business: ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_EC2``) points it at a moto
server with no code path of ours.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    ReadTimeoutError,
)

from provisioners.artifacts import ArtifactRef
from provisioners.base import (
    MANAGED_TAG,
    REQUEST_TAG,
    EventKind,
    LaunchRequest,
    ProviderState,
    ProvisionedInstance,
    ProvisionerEvent,
    launch_tags,
)
from provisioners.boto_errors import BOTO_ERRORS, ResponseParserError, first_line
from provisioners.errors import (
    InsufficientCapacityError,
    InvalidConfigurationError,
    ProvisionerError,
    QuotaExceededError,
    SpotUnavailableError,
    ThrottledError,
    UnknownInstanceError,
)
from provisioners.interruptions import MARKET_TAG, InterruptionNotice, Market
from provisioners.spot import InterruptionQueue, SpotPriceReader
from provisioners.storage import (
    DEFAULT_PREFIX,
    S3_ENDPOINT_ENV,
    ArtifactStorage,
    LocalArtifactStorage,
    S3ArtifactStorage,
)

__all__ = [
    "ARTIFACTS_FILE",
    "ARTIFACTS_OPTION",
    "CAPACITY_ERROR_CODES",
    "QUOTA_ERROR_CODES",
    "THROTTLING_ERROR_CODES",
    "USER_DATA_MAX_BYTES",
    "WORKER_COMMAND",
    "Ec2Config",
    "Ec2Provisioner",
    "map_client_error",
    "worker_user_data",
]


# The error codes of EC2 that mean "no capacity of this type here now": another zone or another
# type may work. (Unsupported: the type is not offered in the subnet's zone.)
CAPACITY_ERROR_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientCapacityOnHost",
        "InsufficientFreeAddressesInSubnet",
        "Unsupported",
        "UnfulfillableCapacity",
        "SpotMaxPriceTooLow",
    }
)
QUOTA_ERROR_CODES = frozenset(
    {
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "MaxSpotInstanceCountExceeded",
        "MaxSpotFleetRequestCountExceeded",
        "ResourceLimitExceeded",
    }
)
# botocore's own list of throttling codes, plus EC2's.
THROTTLING_ERROR_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "SlowDown",
        "EC2ThrottledException",
        "PriorRequestNotComplete",
    }
)
_UNAVAILABLE_SERVICE_CODES = frozenset(
    {"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable"}
)
# Which setting an invalid-parameter error points at, by the code's prefix.
_CONFIG_FIELDS = (
    ("InvalidAMIID", "ami_id"),
    ("InvalidSubnetID", "subnet_ids"),
    ("InvalidSubnet", "subnet_ids"),
    ("InvalidGroup", "security_group_ids"),
    ("InvalidSecurityGroupID", "security_group_ids"),
    ("InvalidLaunchTemplate", "launch_templates"),
    ("InvalidInstanceType", "instance_type"),
    ("IdempotentParameterMismatch", "request_id"),
    ("UnauthorizedOperation", "credentials"),
    ("AuthFailure", "credentials"),
    ("InvalidClientTokenId", "credentials"),
    ("OptInRequired", "region"),
    ("InvalidParameter", "request"),
    ("MissingParameter", "request"),
    ("InvalidKeyPair", "launch_templates"),
)

_STATES: Mapping[str, ProviderState] = MappingProxyType(
    {
        "pending": "pending",
        "running": "running",
        "shutting-down": "stopping",
        "stopping": "stopping",
        # We never stop instances: a stopped worker serves nothing and is replaced.
        "stopped": "failed",
        "terminated": "terminated",
    }
)
_DONE_STATES = frozenset({"shutting-down", "terminated"})
# A call that timed out is tried at most this many times (max_attempts still bounds throttles):
# an endpoint that hangs once is likely to hang again, and each try waits read_timeout_s.
_TIMEOUT_ATTEMPTS = 2

# EC2 limits: a ClientToken is at most 64 ASCII characters; a filter takes at most 200 values.
_CLIENT_TOKEN_CHARS = 64
_IDS_PER_CALL = 100
_PROTOCOL_PREFIX = "heteroplane"

# EC2 takes at most 16 KB of user data, counted before the base64 encoding (RunInstances,
# UserData: "User data is limited to 16 KB, in raw form, before it is base64-encoded").
USER_DATA_MAX_BYTES = 16 * 1024
# What the worker template's unit runs (templates/worker.sh.tftpl, ExecStart=).
WORKER_COMMAND = "-m provisioners.worker"
# Where a worker launched with artifacts finds its options for them (the provider's bootstrap
# writes it; the worker template's agent reads it: ARTIFACTS_OPTION is on its ExecStart line).
ARTIFACTS_FILE = "/etc/heteroplane/artifacts"
ARTIFACTS_OPTION = f"--artifacts-file {ARTIFACTS_FILE}"
# The provider's bootstrap: the artifacts' options, then the launch template's script unchanged.
_BOOTSTRAP = """#!/bin/bash
# heteroplane (the EC2 provisioner): the options of the {count} model(s) this worker serves, for
# its agent ({option}); then the launch template's own user data, as it is.
set -euo pipefail
install -d -m 0755 {folder}
cat > {path}.tmp <<'{marker}'
{lines}
{marker}
chmod 0644 {path}.tmp
mv {path}.tmp {path}
"""
_BOOTSTRAP_MARKER = "HETEROPLANE_ARTIFACTS"


@dataclass(frozen=True, slots=True)
class Ec2Config:
    """Where and how to launch: ``subnet_ids`` are tried in order (put them in distinct zones),
    ``launch_templates`` maps an instance type to a template id (``lt-...``) or name; types
    without one are launched from ``ami_id``. ``tag_prefix`` replaces ``heteroplane`` in our tag
    keys on AWS (two deployments in one account). ``unavailable_ttl_s`` is how long a (type, zone)
    out of capacity is skipped; ``max_attempts`` bounds botocore's adaptive retries;
    ``connect_timeout_s`` and ``read_timeout_s`` bound each attempt's wait on the endpoint.
    ``endpoint_url`` is for callers that must pin one; leave it ``None`` and boto3 reads
    ``AWS_ENDPOINT_URL`` itself. ``model_bucket`` (under ``model_prefix``) is where the registry
    keeps the models users bring, for the workers to fetch (``None``: the control plane's data
    directory)."""

    region: str
    subnet_ids: tuple[str, ...]
    security_group_ids: tuple[str, ...] = ()
    ami_id: str | None = None
    launch_templates: Mapping[str, str] = field(default_factory=dict)
    tag_prefix: str = _PROTOCOL_PREFIX
    spot: bool = False
    unavailable_ttl_s: float = 180.0
    max_attempts: int = 5
    endpoint_url: str | None = None
    model_bucket: str | None = None
    model_prefix: str = DEFAULT_PREFIX
    # The SQS queue EventBridge feeds with interruption notices (provisioners/spot.py); None: none.
    interruption_queue_url: str | None = None
    spot_price_ttl_s: float = 300.0
    # Every EC2 and SQS call's socket timeouts: a hung endpoint fails the call (a
    # ProvisionerError) instead of stalling the reconciler's tick (botocore's default read
    # timeout is 60 s). A call that timed out is tried twice at most, so a hung endpoint holds a
    # call about 2 x (connect_timeout_s + read_timeout_s) plus botocore's backoff.
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.region:
            raise InvalidConfigurationError("region", "must not be empty")
        if not self.subnet_ids:
            raise InvalidConfigurationError("subnet_ids", "at least one subnet is needed")
        if self.ami_id is None and not self.launch_templates:
            raise InvalidConfigurationError(
                "launch_templates", "give a launch template per instance type, or an ami_id"
            )
        if not self.tag_prefix or ":" in self.tag_prefix:
            raise InvalidConfigurationError("tag_prefix", "must be a non-empty word without ':'")
        if self.unavailable_ttl_s < 0:
            raise InvalidConfigurationError("unavailable_ttl_s", "must be >= 0")
        if self.max_attempts < 1:
            raise InvalidConfigurationError("max_attempts", "must be at least 1")
        if self.spot_price_ttl_s < 0:
            raise InvalidConfigurationError("spot_price_ttl_s", "must be >= 0")
        if not self.connect_timeout_s > 0:
            raise InvalidConfigurationError("connect_timeout_s", "must be > 0")
        if not self.read_timeout_s > 0:
            raise InvalidConfigurationError("read_timeout_s", "must be > 0")


def map_client_error(
    error: Exception,
    *,
    operation: str = "",
    instance_type: str | None = None,
    zone: str | None = None,
) -> ProvisionerError:
    """The typed error for a boto error met while calling ``operation`` (the one place boto's
    errors are classified).

    >>> from botocore.exceptions import ClientError
    >>> raw = ClientError({"Error": {"Code": "VcpuLimitExceeded", "Message": "64 vCPUs"}}, "Run")
    >>> str(map_client_error(raw, instance_type="g4dn.xlarge"))
    'quota exceeded launching g4dn.xlarge: VcpuLimitExceeded: 64 vCPUs'
    """
    where = f"{operation}: " if operation else ""
    if isinstance(error, ProvisionerError):
        return error
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", "Unknown"))
        detail = str(error.response.get("Error", {}).get("Message", "")).strip()
        mapped = _mapped_client_error(code, detail, where, instance_type, zone)
        mapped.code = code
        return mapped
    if isinstance(error, NoCredentialsError):
        return InvalidConfigurationError("credentials", f"{where}no AWS credentials found")
    if isinstance(error, NoRegionError):
        return InvalidConfigurationError("region", f"{where}no AWS region")
    if isinstance(error, ResponseParserError):
        # The whole page it got follows the first line: an HTML error page, kilobytes of it.
        wrapped = ProvisionerError(
            f"{where}the endpoint answered something that is not EC2's API (a wrong region or"
            f" endpoint?): {first_line(error)}"
        )
        wrapped.retryable = True
        return wrapped
    if isinstance(error, ReadTimeoutError | ConnectTimeoutError):
        # Ec2Config's connect_timeout_s / read_timeout_s, after botocore's retries.
        wrapped = ProvisionerError(
            f"{where}the endpoint did not answer in time, every attempt ({first_line(error)})"
        )
        wrapped.retryable = True
        return wrapped
    if isinstance(error, EndpointConnectionError | BotoCoreError):
        wrapped = ProvisionerError(f"{where}{error}")
        wrapped.retryable = True
        return wrapped
    return ProvisionerError(f"{where}{type(error).__name__}: {error}")


def _mapped_client_error(
    code: str, detail: str, where: str, instance_type: str | None, zone: str | None
) -> ProvisionerError:
    text = f"{code}: {detail}" if detail else code
    if code in CAPACITY_ERROR_CODES:
        return InsufficientCapacityError(instance_type or "?", zone, text)
    if code in QUOTA_ERROR_CODES:
        return QuotaExceededError(instance_type or "?", text)
    if code in THROTTLING_ERROR_CODES:
        return ThrottledError(f"{where}{text}")
    for prefix, setting in _CONFIG_FIELDS:
        if code.startswith(prefix):
            return InvalidConfigurationError(setting, f"{where}{text}")
    wrapped = ProvisionerError(f"{where}{text}")
    wrapped.retryable = code in _UNAVAILABLE_SERVICE_CODES
    return wrapped


class Ec2Provisioner:
    """The :class:`~provisioners.base.Provisioner` on EC2 (see the module docstring).

    ``clock`` (monotonic seconds) ages the unavailable-offerings cache and ``now`` stamps events;
    both are injected for tests.
    """

    name = "ec2"

    def __init__(
        self,
        config: Ec2Config,
        session: boto3.Session | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._now = now if now is not None else (lambda: datetime.now(UTC))
        session = session if session is not None else boto3.Session()
        self._session = session
        self._s3: Any = None
        client_config = Config(
            retries={"mode": "adaptive", "total_max_attempts": config.max_attempts},
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            user_agent_extra="heteroplane",
        )
        try:
            self._client: Any = session.client(
                "ec2",
                region_name=config.region,
                endpoint_url=config.endpoint_url,
                config=client_config,
            )
        except Exception as error:
            raise map_client_error(error, operation="client") from None
        # Capacity errors come back as HTTP 500, which botocore retries as transient: stop that,
        # so that the next zone is tried at once.
        self._client.meta.events.register("needs-retry.ec2.RunInstances", _fail_fast_on_capacity)
        self._client.meta.events.register("needs-retry.ec2", _bounded_timeout_retries)
        self._lock = threading.Lock()
        self._templates: dict[str, str] = dict(config.launch_templates)
        self._unavailable: dict[tuple[str, str, Market], float] = {}
        self._events: builtins.list[ProvisionerEvent] = []
        self._subnet_zones: dict[str, str] | None = None
        self.spot_prices = SpotPriceReader(
            self._client,
            ttl_s=config.spot_price_ttl_s,
            clock=clock,
            on_unpriced=self._unpriced,
        )
        self._interruptions: InterruptionQueue | None = None
        if config.interruption_queue_url:
            try:
                sqs = session.client(
                    "sqs",
                    region_name=config.region,
                    endpoint_url=config.endpoint_url,
                    config=client_config,
                )
            except Exception as error:
                raise map_client_error(error, operation="client") from None
            sqs.meta.events.register("needs-retry.sqs", _bounded_timeout_retries)
            self._interruptions = InterruptionQueue(
                sqs, config.interruption_queue_url, now=self._now
            )

    # --- the protocol ----------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> builtins.list[ProvisionedInstance]:
        existing = self.list({REQUEST_TAG: request.request_id})
        if existing:
            other = {i.instance_type for i in existing} - {request.instance_type}
            if other or len(existing) > request.count:
                raise InvalidConfigurationError(
                    "request_id",
                    f"{request.request_id} already launched {len(existing)} x"
                    f" {', '.join(sorted({i.instance_type for i in existing}))}",
                )
            return existing
        template = self._templates.get(request.instance_type)
        if template is None and self.config.ami_id is None:
            raise InvalidConfigurationError(
                "launch_templates", f"no launch template for {request.instance_type} and no ami_id"
            )
        user_data = self._artifact_user_data(request, template) if request.artifacts else None
        tags = self._aws_tags(launch_tags(request), request.instance_type)
        launched: builtins.list[ProvisionedInstance] = []
        # Spot for the whole deployment (``spot``), or for this request (the reconciler's
        # MARKET_TAG, a plan's spot_fleet: docs/spot.md). The reconciler prices and budgets a
        # request it tags spot at the spot price: what spot cannot supply of it is not run on
        # demand (it would cost more than the budget was told) but refused, and the reconciler
        # launches it on demand next where the budget pays for that. The deployment's ``spot``
        # alone is a saving on untagged requests: what spot cannot supply of those runs on
        # demand. A request tagged "on-demand" (an app's on-demand base, its spot block's
        # survive_share) runs on demand whatever the deployment's ``spot`` says: on spot it
        # would void the share that must survive an interruption wave.
        market = request.tags.get(MARKET_TAG)
        priced_at_spot = market == "spot"
        if (self.config.spot and market != "on-demand") or priced_at_spot:
            why = None
            if template is None:
                why = "spot needs a launch template"
            elif user_data is not None:
                # A fleet launches with the template's user data: no room for the artifacts.
                why = (
                    f"spot fleets take no per-launch user data, and the request carries"
                    f" {len(request.artifacts)} artifact(s)"
                )
            else:
                launched = self._launch_spot(request, template, tags)
                if not launched:
                    why = "spot has no capacity for it now"
            if why is not None and priced_at_spot:
                what = request.instance_type
                self._event("capacity", f"{why}; {what} not launched", what)
                raise SpotUnavailableError(request.instance_type, why)
            if why is not None:  # nothing launched on spot: all of it goes on demand
                self._event(
                    "info",
                    f"{why}; launching {request.count} {request.instance_type} on demand",
                    request.instance_type,
                )
        remaining = request.count - len(launched)
        if remaining > 0 and priced_at_spot:
            return launched  # spot supplied part of it: the rest is launched again, not on demand
        if remaining > 0:
            try:
                launched += self._launch_on_demand(request, remaining, template, tags, user_data)
            except ProvisionerError:
                if launched:
                    # Spot already gave part of the request: keep it, report the rest.
                    self._event(
                        "capacity",
                        f"launched {len(launched)} of {request.count} {request.instance_type}"
                        " (spot); on demand had no capacity for the rest",
                        request.instance_type,
                    )
                    return launched
                raise
        return launched

    def terminate(self, provider_ids: Sequence[str]) -> None:
        """Terminate ``provider_ids`` (idempotent: unknown ids and instances on their way out
        are left alone). They are looked up first and an instance that is not ours is refused
        (:class:`~provisioners.errors.UnknownInstanceError`); when that lookup fails with an
        error that may pass (throttled, no answer), they are terminated by id without it, so a
        budget cut is carried out while ``DescribeInstances`` is throttled: the ids are the
        caller's own launches, and the deployment's role may terminate only instances tagged
        ``heteroplane:managed`` (terraform's TerminateManaged)."""
        ids = builtins.list(dict.fromkeys(provider_ids))
        if not ids:
            return
        found: dict[str, Mapping[str, Any]] = {}
        try:
            for chunk in _chunks(ids, _IDS_PER_CALL):
                filters = [{"Name": "instance-id", "Values": chunk}]
                for raw in self._describe(filters, "DescribeInstances"):
                    found[raw["InstanceId"]] = raw
        except ProvisionerError as error:
            if not error.retryable:
                raise
            self._event(
                "info",
                f"terminating {len(ids)} instance(s) by id, unchecked: the lookup failed ({error})",
            )
            self._terminate_ids(ids)
            return
        managed_key = self._aws_key(MANAGED_TAG)
        for pid, raw in found.items():
            if managed_key not in _tag_dict(raw):
                raise UnknownInstanceError(pid)
        # Unknown ids and instances already on their way out are left alone (idempotent).
        live = [pid for pid, raw in found.items() if raw["State"]["Name"] not in _DONE_STATES]
        self._terminate_ids(live)

    def _terminate_ids(self, ids: Sequence[str]) -> None:
        for chunk in _chunks(ids, _IDS_PER_CALL):
            try:
                self._call("TerminateInstances", InstanceIds=chunk)
            except ProvisionerError as error:
                if not (error.code or "").startswith("InvalidInstanceID"):
                    raise self._reported(error) from None
                # An id EC2 does not know (gone, or never launched) fails the whole call: the
                # others go one by one.
                if len(chunk) > 1:
                    for pid in chunk:
                        self._terminate_ids([pid])

    def poll_events(self) -> builtins.list[ProvisionerEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def spot_price(self, instance_type: str) -> float | None:
        """The spot price of ``instance_type`` now, in its cheapest zone (cached for
        ``spot_price_ttl_s``; provisioners/spot.py)."""
        return self.spot_prices.price(instance_type)

    def poll_interruptions(self) -> builtins.list[InterruptionNotice]:
        """The interruption notices on the queue (provisioners/spot.py), each once; none without
        an ``interruption_queue_url``."""
        if self._interruptions is None:
            return []
        return self._interruptions.poll()

    def list(self, tags: Mapping[str, str]) -> builtins.list[ProvisionedInstance]:
        wanted = {MANAGED_TAG: "true", **tags}
        filters = [
            {"Name": f"tag:{self._aws_key(key)}", "Values": [value]}
            for key, value in wanted.items()
        ]
        return [self._instance(raw) for raw in self._describe(filters, "DescribeInstances")]

    def instance_types(self) -> None:
        """Any type EC2 offers (one it does not know, or has no capacity of, fails at launch)."""
        return None

    def launch_refusal(self, instance_type: str) -> str | None:
        return None

    def artifact_storage(self, root: Path) -> ArtifactStorage:
        """The model bucket (``model_bucket``, under ``model_prefix``), through an S3 client of
        this provider's session (``HETEROPLANE_S3_ENDPOINT_URL`` points it elsewhere, as it does
        the workers' :func:`~provisioners.fetch.fetch_artifact`); without a bucket, files under
        ``root``."""
        if not self.config.model_bucket:
            return LocalArtifactStorage(root)
        with self._lock:
            if self._s3 is None:
                try:
                    self._s3 = self._session.client(
                        "s3",
                        region_name=self.config.region,
                        endpoint_url=os.environ.get(S3_ENDPOINT_ENV),
                    )
                except Exception as error:
                    raise map_client_error(error, operation="client") from None
            client = self._s3
        return S3ArtifactStorage(self.config.model_bucket, self.config.model_prefix, client=client)

    def close(self) -> None:
        """Close the provider's HTTP connections (its instances keep running)."""
        self._client.close()
        if self._s3 is not None:
            self._s3.close()

    # --- beyond the protocol ---------------------------------------------------------------

    def unavailable_offerings(self) -> frozenset[tuple[str, str]]:
        """The (instance type, zone) pairs out of on-demand capacity, as cached now."""
        now_s = self._clock()
        with self._lock:
            return frozenset(
                (instance_type, zone)
                for (instance_type, zone, market), until_s in self._unavailable.items()
                if market == "on-demand" and until_s > now_s
            )

    def ensure_launch_templates(self, instance_types: Sequence[str]) -> dict[str, str]:
        """Development path: make sure each type has a launch template, creating
        ``<tag_prefix>-<type>`` from ``ami_id`` and the security groups where there is none.
        Returns type -> template id for ``instance_types`` and uses them from now on."""
        if self.config.ami_id is None:
            raise InvalidConfigurationError("ami_id", "is needed to create launch templates")
        made: dict[str, str] = {}
        for instance_type in instance_types:
            if instance_type in self._templates:
                made[instance_type] = self._templates[instance_type]
                continue
            name = f"{self.config.tag_prefix}-{instance_type}"
            try:
                found = self._call("DescribeLaunchTemplates", LaunchTemplateNames=[name])
                template_id = str(found["LaunchTemplates"][0]["LaunchTemplateId"])
            except ProvisionerError as error:
                if "NotFound" not in (error.code or ""):
                    raise self._reported(error) from None
                template_id = self._create_launch_template(name, instance_type)
            with self._lock:
                self._templates[instance_type] = template_id
            made[instance_type] = template_id
        return made

    # --- launching -------------------------------------------------------------------------

    def _launch_on_demand(
        self,
        request: LaunchRequest,
        count: int,
        template: str | None,
        tags: builtins.list[dict[str, str]],
        user_data: str | None = None,
    ) -> builtins.list[ProvisionedInstance]:
        instance_type = request.instance_type
        missed: builtins.list[str] = []  # "zone (why)", for the events
        for subnet_id, zone in self._subnets():
            if self._is_unavailable(instance_type, zone, "on-demand"):
                missed.append(f"{zone} (out of capacity recently)")
                continue
            params: dict[str, Any] = {
                "MinCount": count,
                "MaxCount": count,
                "InstanceType": instance_type,
                "SubnetId": subnet_id,
                "ClientToken": _client_token(request.request_id, subnet_id, "on-demand"),
                "TagSpecifications": [
                    {"ResourceType": "instance", "Tags": tags},
                    {"ResourceType": "volume", "Tags": tags},
                ],
            }
            if template is not None:
                params["LaunchTemplate"] = _template_spec(template)
            else:
                params["ImageId"] = self.config.ami_id
            if self.config.security_group_ids:
                params["SecurityGroupIds"] = builtins.list(self.config.security_group_ids)
            if user_data is not None:
                # Text: botocore base64-encodes RunInstances' UserData itself.
                params["UserData"] = user_data
            try:
                response = self._call(
                    "RunInstances", instance_type=instance_type, zone=zone, **params
                )
            except InsufficientCapacityError as error:
                self._mark_unavailable(instance_type, zone, "on-demand")
                code = error.code or "no capacity"
                self._event(
                    "capacity",
                    f"{instance_type} has no on-demand capacity in {zone} ({code});"
                    f" {instance_type} x {zone} skipped for {self.config.unavailable_ttl_s:g} s",
                    instance_type,
                    zone,
                )
                missed.append(f"{zone} ({code})")
                continue
            except ProvisionerError as error:
                raise self._reported(error, instance_type) from None
            instances = [self._instance(raw) for raw in response.get("Instances", [])]
            if missed:
                self._event(
                    "capacity",
                    f"launched {count} {instance_type} in {zone} after no capacity in"
                    f" {', '.join(missed)}",
                    instance_type,
                    zone,
                )
            return instances
        zones = {zone for _, zone in self._subnets()}
        exhausted = InsufficientCapacityError(
            instance_type,
            next(iter(zones)) if len(zones) == 1 else None,
            f"no subnet could launch {count}: {', '.join(missed)}",
        )
        self._event("capacity", str(exhausted), instance_type)
        raise exhausted

    def _launch_spot(
        self, request: LaunchRequest, template: str, tags: builtins.list[dict[str, str]]
    ) -> builtins.list[ProvisionedInstance]:
        instance_type = request.instance_type
        subnets = [
            (subnet_id, zone)
            for subnet_id, zone in self._subnets()
            if not self._is_unavailable(instance_type, zone, "spot")
        ]
        if not subnets:
            self._event("capacity", f"{instance_type} has no spot capacity recently", instance_type)
            return []
        zone_of = dict(subnets)
        try:
            response = self._call(
                "CreateFleet",
                instance_type=instance_type,
                Type="instant",
                ClientToken=_client_token(request.request_id, "fleet", "spot"),
                LaunchTemplateConfigs=[
                    {
                        "LaunchTemplateSpecification": {
                            **_template_spec(template),
                            "Version": "$Default",
                        },
                        "Overrides": [
                            {"InstanceType": instance_type, "SubnetId": subnet_id}
                            for subnet_id, _ in subnets
                        ],
                    }
                ],
                TargetCapacitySpecification={
                    "TotalTargetCapacity": request.count,
                    "DefaultTargetCapacityType": "spot",
                },
                SpotOptions={"AllocationStrategy": "price-capacity-optimized"},
                # An instant fleet takes "volume" (and "network-interface") here as RunInstances
                # does; request and maintain fleets take only "fleet". Source: the CreateFleet
                # API reference, TagSpecification.N (as shipped in botocore 1.44's EC2 model),
                # and the EC2 User Guide, "Tag a new or existing EC2 Fleet request and the
                # instances and volumes it launches". Tagging at creation is also the only kind
                # our role allows (terraform: CreateTags only with ec2:CreateAction).
                TagSpecifications=[
                    {"ResourceType": "instance", "Tags": tags},
                    {"ResourceType": "volume", "Tags": tags},
                ],
            )
        except (ThrottledError, InvalidConfigurationError) as error:
            raise self._reported(error, instance_type) from None
        except ProvisionerError as error:
            self._event("capacity", f"spot fleet failed ({error})", instance_type)
            return []
        for failure in response.get("Errors", []):
            code = str(failure.get("ErrorCode", ""))
            overrides = failure.get("LaunchTemplateAndOverrides", {}).get("Overrides", {})
            zone = zone_of.get(str(overrides.get("SubnetId", "")))
            if code in CAPACITY_ERROR_CODES and zone is not None:
                self._mark_unavailable(instance_type, zone, "spot")
            self._event(
                "capacity",
                f"spot {instance_type}{f' in {zone}' if zone else ''}: {code}",
                instance_type,
                zone,
            )
        ids = [pid for group in response.get("Instances", []) for pid in group["InstanceIds"]]
        if not ids:
            return []
        filters = [{"Name": "instance-id", "Values": ids}]
        launched = [self._instance(raw) for raw in self._describe(filters, "DescribeInstances")]
        if len(launched) < request.count:
            self._event(
                "capacity",
                f"spot supplied {len(launched)} of {request.count} {instance_type}",
                instance_type,
            )
        return launched

    def _artifact_user_data(self, request: LaunchRequest, template: str | None) -> str:
        """The user data that starts the worker with ``request.artifacts``: the launch
        template's own (its default version), the artifacts added (:func:`worker_user_data`)."""
        instance_type = request.instance_type
        if template is None:
            raise InvalidConfigurationError(
                "launch_templates",
                f"{instance_type} has no launch template: serving artifacts needs the worker"
                " template (terraform's), whose user data starts the worker agent",
            )
        try:
            found = self._call(
                "DescribeLaunchTemplateVersions",
                instance_type=instance_type,
                **_template_spec(template),
                Versions=["$Default"],
            )
        except ProvisionerError as error:
            raise self._reported(error, instance_type) from None
        versions = found.get("LaunchTemplateVersions") or [{}]
        encoded = versions[0].get("LaunchTemplateData", {}).get("UserData")
        if not encoded:
            raise InvalidConfigurationError(
                "launch_templates",
                f"launch template {template} ({instance_type}) has no user data: serving"
                " artifacts needs the worker template (terraform's), which starts the agent",
            )
        try:
            script = base64.b64decode(encoded, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise InvalidConfigurationError(
                "launch_templates",
                f"launch template {template} ({instance_type}): its user data is not a script"
                " (base64 of UTF-8 text)",
            ) from None
        return worker_user_data(script, request.artifacts, source=f"launch template {template}")

    def _create_launch_template(self, name: str, instance_type: str) -> str:
        managed = [{"Key": self._aws_key(MANAGED_TAG), "Value": "true"}]
        data: dict[str, Any] = {"ImageId": self.config.ami_id, "InstanceType": instance_type}
        if self.config.security_group_ids:
            data["SecurityGroupIds"] = builtins.list(self.config.security_group_ids)
        try:
            created = self._call(
                "CreateLaunchTemplate",
                LaunchTemplateName=name,
                LaunchTemplateData=data,
                TagSpecifications=[{"ResourceType": "launch-template", "Tags": managed}],
            )
        except ProvisionerError as error:
            raise self._reported(error) from None
        self._event("info", f"created launch template {name}", instance_type)
        return str(created["LaunchTemplate"]["LaunchTemplateId"])

    # --- calling EC2 -----------------------------------------------------------------------

    def _call(
        self,
        operation: str,
        *,
        instance_type: str | None = None,
        zone: str | None = None,
        **params: Any,
    ) -> Any:
        """Call ``operation`` (``RunInstances``); any boto error comes out mapped."""
        method = getattr(self._client, _snake_case(operation))
        try:
            return method(**params)
        except BOTO_ERRORS as error:
            raise map_client_error(
                error, operation=operation, instance_type=instance_type, zone=zone
            ) from None

    # --- reading ---------------------------------------------------------------------------

    def _describe(
        self, filters: builtins.list[dict[str, Any]], operation: str
    ) -> Iterator[Mapping[str, Any]]:
        # Always filtered: by our tags, or by ids (which never fails on an unknown id, unlike
        # the InstanceIds parameter).
        assert filters, "DescribeInstances is never called unfiltered"
        try:
            pages = self._client.get_paginator("describe_instances").paginate(Filters=filters)
            raws = [raw for page in pages for r in page["Reservations"] for raw in r["Instances"]]
        except BOTO_ERRORS as error:
            raise self._reported(map_client_error(error, operation=operation)) from None
        return iter(raws)

    def _subnets(self) -> builtins.list[tuple[str, str]]:
        """(subnet id, zone) in the configured order, the zones looked up once."""
        if self._subnet_zones is None:
            subnet_ids = builtins.list(self.config.subnet_ids)
            try:
                found = self._call("DescribeSubnets", SubnetIds=subnet_ids)
            except ProvisionerError as error:
                raise self._reported(error) from None
            zones = {str(s["SubnetId"]): str(s["AvailabilityZone"]) for s in found["Subnets"]}
            missing = [s for s in self.config.subnet_ids if s not in zones]
            if missing:
                raise InvalidConfigurationError("subnet_ids", f"not found: {', '.join(missing)}")
            self._subnet_zones = zones
        return [(subnet_id, self._subnet_zones[subnet_id]) for subnet_id in self.config.subnet_ids]

    def _instance(self, raw: Mapping[str, Any]) -> ProvisionedInstance:
        launched_at = raw.get("LaunchTime")
        return ProvisionedInstance(
            provider_id=str(raw["InstanceId"]),
            instance_type=str(raw["InstanceType"]),
            state=_STATES.get(str(raw.get("State", {}).get("Name", "")), "failed"),
            tags={self._our_key(k): v for k, v in _tag_dict(raw).items()},
            address=raw.get("PrivateIpAddress") or None,
            zone=raw.get("Placement", {}).get("AvailabilityZone") or None,
            launched_at=launched_at.astimezone(UTC) if isinstance(launched_at, datetime) else None,
            market="spot" if raw.get("InstanceLifecycle") == "spot" else "on-demand",
        )

    # --- tags ------------------------------------------------------------------------------

    def _aws_key(self, key: str) -> str:
        if key.startswith(_PROTOCOL_PREFIX + ":"):
            return self.config.tag_prefix + key[len(_PROTOCOL_PREFIX) :]
        return key

    def _our_key(self, key: str) -> str:
        if key.startswith(self.config.tag_prefix + ":"):
            return _PROTOCOL_PREFIX + key[len(self.config.tag_prefix) :]
        return key

    def _aws_tags(
        self, tags: Mapping[str, str], instance_type: str
    ) -> builtins.list[dict[str, str]]:
        named = {"Name": f"{self.config.tag_prefix}-{instance_type}", **tags}
        return [{"Key": self._aws_key(key), "Value": value} for key, value in named.items()]

    # --- capacity cache and events ---------------------------------------------------------

    def _unpriced(self, instance_types: Sequence[str]) -> None:
        """A ``capacity`` event for the types a spot price read found no price for (once per
        read, so once per ``spot_price_ttl_s``: the empty answer is cached as any other)."""
        for instance_type in instance_types:
            self._event(
                "capacity",
                f"DescribeSpotPriceHistory has no spot price for {instance_type} in any zone (not"
                f" sold on spot there?); asked again in {self.config.spot_price_ttl_s:g} s",
                instance_type,
            )

    def _is_unavailable(self, instance_type: str, zone: str, market: Market) -> bool:
        with self._lock:
            until_s = self._unavailable.get((instance_type, zone, market))
            if until_s is None:
                return False
            if until_s <= self._clock():
                del self._unavailable[(instance_type, zone, market)]
                return False
            return True

    def _mark_unavailable(self, instance_type: str, zone: str, market: Market) -> None:
        with self._lock:
            self._unavailable[(instance_type, zone, market)] = (
                self._clock() + self.config.unavailable_ttl_s
            )

    def _reported(
        self, error: ProvisionerError, instance_type: str | None = None
    ) -> ProvisionerError:
        """Record an event for ``error`` (the kinds worth one) and return it, to be raised."""
        kind: EventKind | None = None
        if isinstance(error, QuotaExceededError):
            kind = "quota"
        elif isinstance(error, ThrottledError):
            kind = "throttled"
        elif isinstance(error, InsufficientCapacityError):
            kind = "capacity"
        elif not isinstance(error, InvalidConfigurationError):
            kind = "failed"
        if kind is not None:
            self._event(kind, str(error), instance_type)
        return error

    def _event(
        self,
        kind: EventKind,
        message: str,
        instance_type: str | None = None,
        zone: str | None = None,
        provider_id: str | None = None,
    ) -> None:
        event = ProvisionerEvent(self._now(), kind, message, instance_type, zone, provider_id)
        with self._lock:
            self._events.append(event)


def worker_user_data(
    script: str, artifacts: Sequence[ArtifactRef], *, source: str = "the worker template"
) -> str:
    """The user data of a worker serving ``artifacts``: the provider's bootstrap, which writes
    their options (:meth:`~provisioners.artifacts.ArtifactRef.worker_options`, one ``--artifact
    NAME:MODEL:VERSION:FORMAT:SHA256:URI`` or ``--artifact-inputs NAME=JSON`` a line) to
    :data:`ARTIFACTS_FILE`, followed by ``script`` as it is (the worker template's user data, as
    terraform renders ``templates/worker.sh.tftpl``; its agent reads the file,
    :data:`ARTIFACTS_OPTION`).

    The file is written through a quoted here-document, so a value reaches the agent as it is
    (no shell or systemd quoting); control characters and backslashes are refused. Raises
    :class:`~provisioners.errors.InvalidConfigurationError` when ``script`` does not start the
    agent with :data:`ARTIFACTS_OPTION` (it would serve its default models instead) or the
    result is over :data:`USER_DATA_MAX_BYTES`.

    >>> ref = ArtifactRef("wine", "wine", 1, "onnx", "0" * 64, "s3://b/models/wine/1/x.onnx")
    >>> line = "ExecStart=/venv/bin/python -m provisioners.worker --artifacts-file /etc/heteroplane/artifacts"
    >>> text = worker_user_data(line, [ref])
    >>> text.endswith(line), "--artifact wine:wine:1:onnx:" in text
    (True, True)
    """  # noqa: E501
    if ARTIFACTS_OPTION not in script:
        raise InvalidConfigurationError(
            "launch_templates",
            f"{source}: its user data does not start the worker agent with"
            f" '{ARTIFACTS_OPTION}', where the artifacts' options are written",
        )
    lines = [
        f"{option} {_checked(value)}" for ref in artifacts for option, value in ref.worker_options()
    ]
    bootstrap = _BOOTSTRAP.format(
        count=len(artifacts),
        option=ARTIFACTS_OPTION,
        folder=ARTIFACTS_FILE.rsplit("/", 1)[0],
        path=ARTIFACTS_FILE,
        marker=_BOOTSTRAP_MARKER,
        lines="\n".join(lines),
    )
    text = bootstrap + script
    size_bytes = len(text.encode("utf-8"))
    if size_bytes > USER_DATA_MAX_BYTES:
        raise InvalidConfigurationError(
            "artifacts",
            f"the worker's user data with {len(artifacts)} artifact(s) is {size_bytes} bytes,"
            f" over EC2's limit of {USER_DATA_MAX_BYTES} (16 KB)",
        )
    return text


def _checked(value: str) -> str:
    """``value`` as one line of the artifacts file, or refused."""
    if "\\" in value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidConfigurationError(
            "artifacts", f"{value[:80]!r}: control characters and backslashes are not passed"
        )
    return value


def _fail_fast_on_capacity(response: Any = None, **_: Any) -> None:
    """botocore ``needs-retry`` hook: raise a capacity error at once instead of retrying it."""
    if not response:
        return
    _, parsed = response
    code = (parsed or {}).get("Error", {}).get("Code")
    if code in CAPACITY_ERROR_CODES:
        raise ClientError(parsed, "RunInstances")


def _bounded_timeout_retries(
    attempts: int = 0, caught_exception: Exception | None = None, **_: Any
) -> None:
    """botocore ``needs-retry`` hook: a call whose try timed out ``_TIMEOUT_ATTEMPTS`` times is
    not tried again (botocore retries a timeout as transient, up to ``max_attempts``)."""
    timed_out = isinstance(caught_exception, ReadTimeoutError | ConnectTimeoutError)
    if timed_out and attempts >= _TIMEOUT_ATTEMPTS:
        assert caught_exception is not None
        raise caught_exception


def _snake_case(operation: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in operation).lstrip("_")


def _client_token(request_id: str, where: str, market: Market) -> str:
    """A ClientToken (<= 64 ASCII characters) unique to (request, subnet, market): EC2 rejects a
    token reused with other parameters, and each subnet tried is another call."""
    digest = hashlib.sha256(f"{request_id}\0{where}\0{market}".encode()).hexdigest()
    return ("hp-" + digest)[:_CLIENT_TOKEN_CHARS]


def _template_spec(template: str) -> dict[str, str]:
    if template.startswith("lt-"):
        return {"LaunchTemplateId": template}
    return {"LaunchTemplateName": template}


def _tag_dict(raw: Mapping[str, Any]) -> dict[str, str]:
    return {str(t["Key"]): str(t.get("Value", "")) for t in raw.get("Tags", []) or []}


def _chunks(items: Sequence[str], size: int) -> Iterator[builtins.list[str]]:
    for start in range(0, len(items), size):
        yield builtins.list(items[start : start + size])
