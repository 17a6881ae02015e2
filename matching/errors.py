"""Errors of the matching library."""

from __future__ import annotations


class MatchingError(ValueError):
    """Root of the matching library's errors."""


class InvalidDispatchError(MatchingError):
    """A policy returned a dispatch the engine cannot carry out (busy instance, unknown query)."""


class InvalidCostMatrixError(MatchingError):
    """A cost matrix that is not a finite, real, two-dimensional array."""


class LatencyModelError(MatchingError):
    """A measurement or an initial point the online latency model cannot use."""


class UnknownLatencyError(LatencyModelError):
    """A prediction for an instance type the latency model has no point or measurement of."""

    def __init__(self, instance_type: str) -> None:
        self.instance_type = instance_type
        super().__init__(
            f"the latency model knows nothing of {instance_type!r}: give it initial points"
            " (e.g. the profile's means) or measurements first"
        )


class MissingQosError(MatchingError):
    """A policy that needs the stage's latency target ran on a stage without one."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        super().__init__(f"the {policy} policy needs the stage's QoS target (qos_ms), got None")


class TailRatioError(MatchingError):
    """Tail ratios (tail latency over mean latency, by batch size) a policy cannot use."""

    def __init__(self, instance_type: str, problem: str) -> None:
        self.instance_type = instance_type
        self.problem = problem
        super().__init__(f"the tail ratios of {instance_type!r} {problem}")
