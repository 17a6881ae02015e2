"""The dispatch-policy seam: what a policy sees of a stage and what it answers.

A policy is asked at every scheduling round (an arrival, a completion, an instance joining) of a
stage whose queue is not empty and that has an idle instance. It sees the stage's central queue in
arrival order and every instance of the stage, busy or idle, and returns which queued queries start
now on which idle instances. Queries it leaves in the queue wait for a later round (Kairos' implicit
"wait for a better instance"). The same policy object runs in the simulator and in the live
dispatcher, so what is simulated is what runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, slots=True)
class QueuedQuery:
    """A query waiting in a stage's queue."""

    query_id: int
    batch_size: int
    arrival_s: float  # when the query entered the system (its SLO clock starts here)
    enqueued_s: float  # when it entered this stage's queue


class InstanceView(Protocol):
    """What a policy may read of an instance."""

    @property
    def index(self) -> int: ...
    @property
    def instance_type(self) -> str: ...
    @property
    def speed_rank(self) -> int:
        """0 for the fastest instance type of the stage, 1 for the next, and so on."""
        ...

    @property
    def busy_until_s(self) -> float:
        """When its current batch finishes (<= now when idle)."""
        ...

    @property
    def idle_since_s(self) -> float: ...
    @property
    def max_batch_size(self) -> int:
        """The largest batch size its profile covers."""
        ...

    def is_idle(self, now_s: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class StageContext:
    """Stage-wide facts a policy may use."""

    max_batch_queries: int  # how many queued queries one instance may take at once
    qos_ms: float | None  # the stage's latency target, if any

    def __post_init__(self) -> None:
        if self.max_batch_queries < 1:
            raise ValueError(f"max_batch_queries must be >= 1, got {self.max_batch_queries}")


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Start ``query_ids`` (a batch, in queue order) on the idle instance ``instance_index``."""

    instance_index: int
    query_ids: tuple[int, ...]


class DispatchPolicy(Protocol):
    """Decides which queued queries start on which idle instances (see the module docstring)."""

    name: str

    def dispatch(
        self,
        now_s: float,
        queue: Sequence[QueuedQuery],
        instances: Sequence[InstanceView],
        context: StageContext,
    ) -> list[Dispatch]: ...

    def observe(self, instance_type: str, batch_size: int, latency_ms: float) -> None:
        """A batch of ``batch_size`` finished on an ``instance_type`` in ``latency_ms`` (service
        time, without queueing): what an online latency model learns from."""
        ...


def per_call(batches: bool, batch_cap: int) -> int:
    """The queries one call carries under the batch cap ``batch_cap`` for a policy whose class
    says whether it ``batches`` (:class:`RegisteredPolicy`): ``batch_cap`` if it does, else 1.

    >>> per_call(True, 4), per_call(False, 4)
    (4, 1)
    """
    return batch_cap if batches else 1


def queries_per_call(policy: object, now_s: float, batch_cap: int) -> int:
    """The most queued queries one call of ``policy`` to an instance carries at ``now_s`` under
    the stage's batch cap ``batch_cap`` (``StageContext.max_batch_queries``): admission control
    and the stage's capacity count an instance at this many, in the simulator and the live
    dispatcher alike. A policy that switches between others over time (the replay's fleet rule,
    a wrapper) answers with its own ``queries_per_call(now_s, batch_cap)`` method; any other by
    its class's ``batches`` (:func:`per_call`: the cap for one that batches, as FCFS does, and
    for a class that does not say; 1 for one that runs each query alone, as Kairos, Clockwork
    and DRS do), and so does one whose own method raises (admission never fails on a policy's
    answer). The answer is within [1, ``batch_cap``].

    >>> from matching.fcfs import FcfsPolicy
    >>> from matching.kairos import KairosPolicy
    >>> kairos = object.__new__(KairosPolicy)
    >>> queries_per_call(FcfsPolicy(), 0.0, 4), queries_per_call(kairos, 0.0, 4)
    (4, 1)
    """
    own = getattr(policy, "queries_per_call", None)
    n = per_call(bool(getattr(type(policy), "batches", True)), batch_cap)
    if callable(own):
        # A policy's own answer that fails counts as its class's. (A try costs nothing where
        # nothing raises; a suppress context is entered on every query's admission.)
        try:  # noqa: SIM105
            n = int(own(now_s, batch_cap))
        except Exception:
            pass
    return max(1, min(batch_cap, n))


class ProfileView(Protocol):
    """What a policy's factory may read of a profile (``estimator.profiles.LatencyProfile``)."""

    @property
    def batch_sizes(self) -> np.ndarray: ...
    @property
    def mean_ms(self) -> np.ndarray: ...
    def mean_by_batch_ms(self) -> np.ndarray:
        """Mean latency indexed by batch size itself (NaN where not measured)."""
        ...

    def quantile_by_batch_ms(self, quantile: float) -> np.ndarray:
        """A quantile of the latency, indexed like :meth:`mean_by_batch_ms`."""
        ...


@dataclass(frozen=True, slots=True)
class PolicySetting:
    """What a policy's factory is built from (``matching.registry.make``).

    ``profiles``: the stage's instance types and their latency profiles. ``base_types``: the
    full-range types, preferred first (policies with ``needs_base_type`` take the first as
    their base). ``threshold``: a batch-size threshold, for policies with ``needs_threshold``.
    ``noise_share`` and ``noise_seed``: prediction noise for policies with ``takes_noise``,
    each made policy drawing from a fresh ``numpy.random.default_rng(noise_seed)``.
    """

    profiles: Mapping[str, ProfileView]
    base_types: tuple[str, ...] = ()
    threshold: int | None = None
    noise_share: float = 0.0
    noise_seed: int = 0


class RegisteredPolicy(Protocol):
    """A dispatch policy class as :mod:`matching.registry` knows it: its name, what it needs
    (read by the callers instead of comparing names), and how to make fresh policies.

    ``needs_base_type``: it must be given at least one full-range type (``base_types``).
    ``needs_threshold``: it must be given a batch-size ``threshold``. ``takes_noise``: it
    accepts prediction noise. ``in_plans``: a plan may name it (it needs nothing a plan does not
    record). ``matched_capacity``: on a mix of types at batch size 1, its capacity is Kairos'
    matching upper bound (``estimator.bounds``), which the tuner sizes with, not the sum of the
    types' rates. ``batches``: it sends a stage's queries in batches up to the stage's cap;
    False: each query runs alone whatever the cap (Kairos, Clockwork, DRS: a query already is
    a batch), so a batch cap above 1 means nothing to it, and admission control counts its
    instances at one query a call (:func:`queries_per_call`).
    """

    name: ClassVar[str]
    needs_base_type: ClassVar[bool]
    needs_threshold: ClassVar[bool]
    takes_noise: ClassVar[bool]
    in_plans: ClassVar[bool]
    matched_capacity: ClassVar[bool]
    batches: ClassVar[bool]

    @classmethod
    def factory(cls, setting: PolicySetting) -> Callable[[], DispatchPolicy]:
        """A maker of fresh policies (a policy keeps state during a run, so each run needs one)."""
        ...
