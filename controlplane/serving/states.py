"""INFaaS model states: each (model, instance) is *active*, *overloaded* or *interfered*, and a
variant (a model on an instance type) loaded nowhere is *inactive*.

INFaaS (Romero et al., USENIX ATC'21, section 4.2) keeps, for every model variant on every
worker, a state that routing and scaling read: a variant is *overloaded* when its queue holds
more than it can serve at its profiled throughput, and *interfered* when its measured latency
is above its profile by a margin (another tenant, a noisy neighbour, a throttled CPU). This
module owns the two verdicts as pure functions and a small tracker of measured latencies:

- **Overloaded** (:func:`is_overloaded`): the serving loop keeps one central queue per model
  (InferLine's centralized queue), so the backlog an instance faces is the model's queue; the
  instances of a model serve it together at their profiled rates, and the model is overloaded
  on each of them when draining its backlog takes longer than the SLO,
  ``1000 * queued_samples / capacity_sps > slo_ms``. The verdict is shared by the model's
  instances: a central queue has no per-instance backlog to tell them apart.
- **Interfered** (:func:`is_interfered`): over the last ``window_s`` seconds, the median of
  measured service time / profiled mean service time (same batch size, same instance type)
  of the model on the instance exceeds ``1 + margin``, given at least ``min_samples``
  measurements. A profiled time below ``floor_ms`` (1 ms) counts as ``floor_ms``: under a
  millisecond, a batch's time is mostly the timer's resolution and the interpreter's overhead
  (the demo family's tiny model is profiled at 0.03 ms a sample), and a ratio of two such
  numbers says nothing of interference. The window is in time, so an instance the dispatcher
  stopped sending work to (it avoids interfered ones) comes back as active once its old
  measurements age out, and is tried again.

- **Inactive** (:func:`variant_states`, :func:`loading_latency_s`): INFaaS's variants start
  *inactive*, loaded on no worker, and cost their *loading latency* before they serve (section
  4, Figure 4). Here a variant is a model of the app on an instance type, and it is inactive
  when no running instance of that type serves the model. Every worker agent loads the app's
  whole family when it starts, so loading a variant is starting an instance of its type: its
  loading latency is the type's start-up time
  (:func:`controlplane.policies.tuner.default_boot_s`: 30 s for CPU types, 60 s for GPU
  types); a loaded (active, overloaded or interfered) variant serves without it. The INFaaS
  autoscaler (:mod:`controlplane.policies.infaas_scaling`) weighs it in the cost of a scaling
  action and counts a new instance's capacity only once it has loaded.

An instance is interfered before it is overloaded (:func:`model_state`): the remedy for
interference is elsewhere (another instance), for overload more capacity or a faster variant.
The dispatcher leaves interfered instances out of matching while the model has an active one;
overload is a verdict on the model's queue, which the model-less variant choice
(:mod:`controlplane.policies.variants`) and admission control read. The INFaaS autoscaler
(``scaling: infaas`` in the app spec, :mod:`controlplane.loops.infaas_scaler`) reads all four
from the loop's status every tick; the dashboard reads them through
``GET /v1/apps/{app}/serving`` and ``/metrics``.

>>> is_overloaded(queued_samples=300, capacity_sps=1000.0, slo_ms=200.0)
True
>>> is_interfered([1.1, 1.9, 2.0, 2.1, 1.7], margin=0.5, min_samples=5)
True
>>> model_state(overloaded=True, interfered=False)
'overloaded'
>>> variant_states({"i-1": "overloaded", "i-2": "active"}, {"i-1": "c", "i-2": "c"}, ["c", "g"])
{'c': 'overloaded', 'g': 'inactive'}
>>> loading_latency_s("inactive", boot_s=60.0), loading_latency_s("active", boot_s=60.0)
(60.0, 0.0)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_FLOOR_MS",
    "DEFAULT_MARGIN",
    "DEFAULT_MIN_SAMPLES",
    "DEFAULT_WINDOW_S",
    "ModelState",
    "StateTracker",
    "is_interfered",
    "is_overloaded",
    "loading_latency_s",
    "model_state",
    "variant_states",
]

ModelState = Literal["inactive", "active", "overloaded", "interfered"]

# Measured latency 50% above the profile: beyond the spread of a profile's own samples (the
# family's p99 is within about 30% of its mean on an idle machine), so noise is not interference.
DEFAULT_MARGIN = 0.5
DEFAULT_WINDOW_S = 10.0
DEFAULT_MIN_SAMPLES = 5
DEFAULT_FLOOR_MS = 1.0
# Measurements kept per (model, instance), whatever the window: a bound on memory.
_MAX_KEPT = 256


def is_overloaded(queued_samples: float, capacity_sps: float, slo_ms: float) -> bool:
    """Whether a backlog of ``queued_samples`` takes longer than ``slo_ms`` to drain at
    ``capacity_sps`` samples per second (no capacity: overloaded as soon as anything waits)."""
    if queued_samples <= 0:
        return False
    if capacity_sps <= 0:
        return True
    return 1000.0 * queued_samples / capacity_sps > slo_ms


def is_interfered(ratios: Sequence[float], margin: float, min_samples: int) -> bool:
    """Whether the median of ``ratios`` (measured / profiled service time) exceeds ``1 +
    margin``, given at least ``min_samples`` of them."""
    if len(ratios) < max(min_samples, 1):
        return False
    return statistics.median(ratios) > 1.0 + margin


def model_state(*, overloaded: bool, interfered: bool) -> ModelState:
    """The INFaaS state from the two verdicts (interference first)."""
    if interfered:
        return "interfered"
    return "overloaded" if overloaded else "active"


def variant_states(
    states: Mapping[str, ModelState],
    instance_types: Mapping[str, str],
    types: Iterable[str],
) -> dict[str, ModelState]:
    """The state of a model's variant on each of ``types``, from the model's state on each
    instance (``states``, by instance id) and the instances' types: *inactive* where no instance
    of the type serves the model; else *interfered* when every instance of the type is, else
    *overloaded* when one is (the verdict is the model's queue's: shared), else *active*."""
    by_type: dict[str, list[ModelState]] = {}
    for instance, state in states.items():
        found = instance_types.get(instance)
        if found is not None:
            by_type.setdefault(found, []).append(state)
    out: dict[str, ModelState] = {}
    for name in types:
        seen = by_type.get(name, [])
        if not seen or all(s == "inactive" for s in seen):
            out[name] = "inactive"
        elif all(s == "interfered" for s in seen):
            out[name] = "interfered"
        elif "overloaded" in seen:
            out[name] = "overloaded"
        else:
            out[name] = "active"
    return out


def loading_latency_s(state: ModelState, boot_s: float) -> float:
    """The time before the variant serves a query sent to it: an inactive variant's loading
    latency (the start-up of an instance of its type, ``boot_s``: every worker loads the app's
    whole family as it starts); 0 for a loaded one."""
    return float(boot_s) if state == "inactive" else 0.0


@dataclass(frozen=True, slots=True)
class _Sample:
    at_s: float
    ratio: float


class StateTracker:
    """Measured-over-profiled service-time ratios per (model, instance) over a time window.

    ``instance`` is any hashable key (the serving loop uses the instance's id). Not
    thread-safe: the serving loop's event loop owns it.
    """

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        margin: float = DEFAULT_MARGIN,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        floor_ms: float = DEFAULT_FLOOR_MS,
    ) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        self.window_s = window_s
        self.margin = margin
        self.min_samples = min_samples
        self.floor_ms = floor_ms
        self._samples: dict[tuple[str, Hashable], deque[_Sample]] = {}

    def observe(
        self, model: str, instance: Hashable, now_s: float, measured_ms: float, profiled_ms: float
    ) -> None:
        """One batch of ``model`` took ``measured_ms`` on ``instance`` where its profile says
        ``profiled_ms`` (ignored when either is not a positive number)."""
        if not (profiled_ms > 0 and math.isfinite(profiled_ms) and math.isfinite(measured_ms)):
            return
        key = (model, instance)
        kept = self._samples.get(key)
        if kept is None:
            kept = self._samples[key] = deque(maxlen=_MAX_KEPT)
        kept.append(_Sample(now_s, max(measured_ms, 0.0) / max(profiled_ms, self.floor_ms)))

    def slow(self, measured_ms: float, profiled_ms: float) -> bool:
        """Whether one measurement alone is over the margin (worth re-reading the verdict)."""
        return measured_ms > (1.0 + self.margin) * max(profiled_ms, self.floor_ms)

    def ratios(self, model: str, instance: Hashable, now_s: float) -> list[float]:
        """The ratios measured in the last ``window_s`` (older ones are dropped)."""
        kept = self._samples.get((model, instance))
        if kept is None:
            return []
        cutoff = now_s - self.window_s
        while kept and kept[0].at_s < cutoff:
            kept.popleft()
        return [s.ratio for s in kept]

    def interfered(self, model: str, instance: Hashable, now_s: float) -> bool:
        return is_interfered(self.ratios(model, instance, now_s), self.margin, self.min_samples)

    def forget(self, instances: Iterable[Hashable]) -> None:
        """Drop what was measured on ``instances`` (they left the fleet)."""
        gone = set(instances)
        for key in [k for k in self._samples if k[1] in gone]:
            del self._samples[key]
