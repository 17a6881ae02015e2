"""The serving side of a rollout (docs/rollouts.md): which version a query goes to, and what
each version measured, at the client's view.

- :class:`CanaryRoute` is what the rollout loop publishes for an app while a rollout moves
  traffic: the rollout, its step, the share of queries the new version answers, whether the
  step is a shadow one, and the two versions' labels (``NAME@VERSION``). The serving loop reads
  it per query (:meth:`controlplane.serving.loop.ServingLoop.infer`): a query whose request id
  falls in the share (:func:`controlplane.policies.rollout.routed_to_new`) is answered by the
  rollout's own workers; in a shadow step every query is answered by the old version and also
  sent to the new one, whose answer is compared sample by sample and discarded.
- :class:`VersionMeter` counts, per (app, rollout, step, version), the queries answered and
  failed, their latencies (from the API's receipt to the answer, what the client waits), in
  shadow the samples compared and agreed, and, for queries that carry validation sample ids
  (``sample_ids``) of an app with validation records, the samples answered with their label;
  :meth:`VersionMeter.figures` is the judgement's input and ``/metrics``' (labelled by
  version). A step's figures start empty: the judgement of a step
  reads that step's queries only (after a restart, the queries since the restart).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from controlplane.policies.rollout import VersionFigures

__all__ = ["MAX_LATENCIES", "CanaryRoute", "VersionMeter", "VersionSource"]

# The latencies kept per (step, version) for its P99: enough for a P99 of a busy step, bounded.
MAX_LATENCIES = 100_000


class VersionSource(Protocol):
    """What the rollout loop reads of the figures: a :class:`VersionMeter`, or a serving
    process's over its internal routes when the loops run apart
    (:class:`~controlplane.loops.remote_serving.RemoteServing`)."""

    def figures(self, app: str, rollout_id: int, step_index: int) -> dict[str, VersionFigures]: ...
    def forget(self, app: str) -> None: ...


@dataclass(frozen=True, slots=True)
class CanaryRoute:
    """Where an app's queries go while its rollout ``rollout_id`` is at ``step_index``."""

    rollout_id: int
    step_index: int
    model: str
    share: float
    shadow: bool
    old_version: str  # NAME@VERSION
    new_version: str
    # A cascade member's rollout: the cascade's thresholds re-derived for the new version (the
    # new version's workers serve the cascade with them).
    thresholds: tuple[float, ...] | None = None


@dataclass
class _Counts:
    queries: int = 0
    errors: int = 0
    compared: int = 0
    agreed: int = 0
    labelled: int = 0
    correct: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCIES))

    def figures(self) -> VersionFigures:
        latencies = self.latencies_ms
        p99 = float(np.percentile(np.fromiter(latencies, float), 99)) if latencies else None
        return VersionFigures(
            self.queries,
            self.errors,
            p99,
            self.compared,
            self.agreed,
            self.labelled,
            self.correct,
        )


_Key = tuple[str, int, int]  # app, rollout id, step index


class VersionMeter:
    """Per-version figures of the rollouts' steps (thread-safe: the event loop writes, the
    rollout loop and ``/metrics`` read from their threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[_Key, dict[str, _Counts]] = defaultdict(dict)
        # The newest step of each app: /metrics shows it; older steps are dropped.
        self._current: dict[str, _Key] = {}

    def _entry(self, app: str, route: CanaryRoute, version: str) -> _Counts:
        key = (app, route.rollout_id, route.step_index)
        if self._current.get(app) != key:
            old = self._current.get(app)
            if old is not None:
                self._counts.pop(old, None)
            self._current[app] = key
        found = self._counts[key].get(version)
        if found is None:
            found = self._counts[key][version] = _Counts()
        return found

    def answered(
        self,
        app: str,
        route: CanaryRoute,
        version: str,
        latency_ms: float,
        labelled: int = 0,
        correct: int = 0,
    ) -> None:
        """A query the version answered in ``latency_ms``; of its samples, ``labelled`` carried
        a validation sample id and ``correct`` were answered with its label."""
        with self._lock:
            entry = self._entry(app, route, version)
            entry.queries += 1
            entry.labelled += labelled
            entry.correct += correct
            entry.latencies_ms.append(latency_ms)

    def failed(self, app: str, route: CanaryRoute, version: str) -> None:
        with self._lock:
            entry = self._entry(app, route, version)
            entry.queries += 1
            entry.errors += 1

    def compared(
        self, app: str, route: CanaryRoute, version: str, samples: int, agreed: int
    ) -> None:
        with self._lock:
            entry = self._entry(app, route, version)
            entry.compared += samples
            entry.agreed += agreed

    def figures(self, app: str, rollout_id: int, step_index: int) -> dict[str, VersionFigures]:
        """Each version's figures over the step (version label -> figures)."""
        with self._lock:
            counts = self._counts.get((app, rollout_id, step_index), {})
            return {version: c.figures() for version, c in counts.items()}

    def current(self) -> Mapping[str, tuple[int, dict[str, VersionFigures]]]:
        """Every app's newest step: app -> (rollout id, version -> figures)."""
        with self._lock:
            keys = dict(self._current)
            return {
                app: (key[1], {v: c.figures() for v, c in self._counts.get(key, {}).items()})
                for app, key in keys.items()
            }

    def forget(self, app: str) -> None:
        """Drop the app's figures (its rollout ended)."""
        with self._lock:
            key = self._current.pop(app, None)
            if key is not None:
                self._counts.pop(key, None)
