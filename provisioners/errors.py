"""The provisioners' errors: one root class and the cases a caller must tell apart.

Every provider raises only these (boto's ``ClientError`` never escapes ``provisioners/``). They are
classified the way Karpenter classifies cloud-provider errors, so the reconciler can decide without
reading messages:

- :class:`InsufficientCapacityError` (``instance_type``, ``zone``): the cloud has no capacity of
  that type there now; try another configuration. ``retryable``: later, yes.
- :class:`QuotaExceededError` (``instance_type``): an account limit; waiting does not help.
- :class:`ThrottledError`: the API refused us after the provider's own retries; retry later.
- :class:`InvalidConfigurationError` (``field``, ``problem``): our settings or request are wrong;
  retrying cannot help.
- :class:`UnknownInstanceError` (``provider_id``): an instance that exists but is not ours.
- :class:`ArtifactStoreError`: the provider's artifact store (:mod:`provisioners.storage`) failed
  a read or a write (the API answers it 503).

Every message is one line.

>>> str(InsufficientCapacityError("g4dn.xlarge", "us-east-1a"))
'insufficient capacity for g4dn.xlarge in us-east-1a'
>>> InsufficientCapacityError("g4dn.xlarge", None).retryable
True
"""

from __future__ import annotations

__all__ = [
    "ArtifactStoreError",
    "InsufficientCapacityError",
    "InvalidConfigurationError",
    "ProvisionerError",
    "QuotaExceededError",
    "SpotUnavailableError",
    "ThrottledError",
    "UnknownInstanceError",
]


def _one_line(text: str) -> str:
    return " ".join(text.split())


class ProvisionerError(Exception):
    """Root of the provisioners' errors; the message is one line.

    ``retryable`` says whether the same call may succeed later without a change on our side;
    ``code`` is the provider's error code, when there was one.
    """

    retryable: bool = False
    # The provider's own error code (EC2's ``InsufficientInstanceCapacity``), when it gave one.
    code: str | None = None

    def __init__(self, message: str = "") -> None:
        super().__init__(_one_line(message))


class InsufficientCapacityError(ProvisionerError):
    """No capacity of ``instance_type`` in ``zone`` (``None``: in any zone we tried)."""

    retryable = True

    def __init__(self, instance_type: str, zone: str | None, message: str = "") -> None:
        self.instance_type = instance_type
        self.zone = zone
        where = f" in {zone}" if zone else ""
        detail = f": {message}" if message else ""
        super().__init__(f"insufficient capacity for {instance_type}{where}{detail}")


class SpotUnavailableError(ProvisionerError):
    """A launch asked for on spot (the reconciler priced and budgeted it at the spot price)
    that spot cannot supply now: the type has no launch template, the workers' user data
    carries artifacts a spot fleet cannot take, or spot has no capacity. Nothing is launched:
    run on demand, it would cost more than the budget was told; the reconciler launches it on
    demand next, at the on-demand price, where the budget pays for that."""

    def __init__(self, instance_type: str, why: str) -> None:
        self.instance_type = instance_type
        super().__init__(f"{instance_type} cannot be launched on spot now: {why}")


class QuotaExceededError(ProvisionerError):
    """An account limit (instances, vCPUs) stops launching more ``instance_type``."""

    def __init__(self, instance_type: str, message: str = "") -> None:
        self.instance_type = instance_type
        detail = f": {message}" if message else ""
        super().__init__(f"quota exceeded launching {instance_type}{detail}")


class ThrottledError(ProvisionerError):
    """The provider's API kept refusing the call as too frequent, after its own retries."""

    retryable = True

    def __init__(self, message: str = "") -> None:
        super().__init__(f"throttled: {message}" if message else "throttled")


class InvalidConfigurationError(ProvisionerError):
    """A setting or a request the provider cannot work with: ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = _one_line(problem)
        super().__init__(f"{field}: {problem}")


class UnknownInstanceError(ProvisionerError):
    """``provider_id`` names an instance that exists but is not managed by us (we never touch
    those)."""

    def __init__(self, provider_id: str) -> None:
        self.provider_id = provider_id
        super().__init__(f"instance {provider_id} is not managed by heteroplane")


class ArtifactStoreError(ProvisionerError):
    """The artifact store (a folder of the data directory, an S3 bucket) failed a read or a
    write, or was given a URI that is not one of its blobs."""
