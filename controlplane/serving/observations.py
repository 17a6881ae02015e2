"""What the serving loop measures, per app, for the tuner, the roll-up and ``/metrics``.

- **Arrivals** (:meth:`Observations.arrival_s`): the arrival time of every query (admitted or
  refused: the tuner scales for the demand, not for what was let in), in a ring buffer of the
  last :data:`ARRIVALS_KEPT`, on the serving loop's monotonic clock. They are what InferLine's
  tuner compares with the planning envelope (``controlplane.policies.tuner.tune(arrival_s, now_s,
  ...)``: the live arrival envelope over windows up to 60 s) and what a gear switcher's measured QPS
  comes from (:meth:`Observations.rate_qps`).
- **Windows** (:meth:`Observations.take_window`): latency and SLO attainment of the queries
  answered since the last call (the roll-up job calls it once per run, every ``rollup_s``,
  10 s by default, and writes one metric sample per app from it: :func:`summarise`).
- **Counters** (:meth:`Observations.totals`): queries answered, late, failed and refused, and
  the samples each model answered, since the service started (``/metrics``).

The event loop writes; the roll-up job and the API's threads read: every method takes a lock.

>>> summary = summarise([10.0, 20.0, 30.0, 400.0], slo_ms=350.0, arrivals=4, elapsed_s=2.0)
>>> summary.arrival_rate_qps, summary.attainment_share
(2.0, 0.75)
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ARRIVALS_KEPT",
    "MAX_WINDOW_LATENCIES",
    "AppTotals",
    "Observations",
    "WindowSummary",
    "summarise",
]

# 2^18 arrivals: the tuner's longest window (60 s) at more than 4,000 queries per second.
ARRIVALS_KEPT = 1 << 18
# Latencies kept per window for its percentiles; past this, every other one is dropped (the
# percentiles of a window of 100 k queries move little by thinning).
MAX_WINDOW_LATENCIES = 100_000


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """One window of an app's serving: arrival rate, latency percentiles and SLO attainment of
    the queries answered in it (None when none was), their accuracy on the validation samples
    they carried (None when none carried one), and the gear in force at its end."""

    arrival_rate_qps: float
    answered: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    attainment_share: float | None
    accuracy: float | None = None
    gear: str | None = None


@dataclass(frozen=True, slots=True)
class AppTotals:
    """An app's counters since the service started."""

    arrived: int = 0
    answered: int = 0
    late: int = 0
    failed: int = 0
    refused: int = 0
    samples_by_model: dict[str, int] = field(default_factory=dict)


def summarise(
    latencies_ms: Sequence[float],
    slo_ms: float,
    arrivals: int,
    elapsed_s: float,
    *,
    correct: int = 0,
    labelled: int = 0,
    gear: str | None = None,
) -> WindowSummary:
    """A window's summary: rate = arrivals / elapsed, percentiles by linear interpolation,
    attainment = share of answered queries within ``slo_ms``, accuracy = correct / labelled."""
    rate = arrivals / elapsed_s if elapsed_s > 0 else 0.0
    accuracy = correct / labelled if labelled else None
    if not latencies_ms:
        return WindowSummary(rate, 0, None, None, None, None, accuracy, gear)
    values = np.asarray(latencies_ms, dtype=np.float64)
    p50, p95, p99 = (float(v) for v in np.percentile(values, [50, 95, 99]))
    attained = float(np.count_nonzero(values <= slo_ms) / values.size)
    return WindowSummary(rate, int(values.size), p50, p95, p99, attained, accuracy, gear)


class _App:
    __slots__ = (
        "answered",
        "arrivals",
        "arrived",
        "correct",
        "failed",
        "head",
        "labelled",
        "late",
        "latencies",
        "refused",
        "samples_by_model",
        "size",
        "window_arrivals",
        "window_since_s",
    )

    def __init__(self, now_s: float) -> None:
        self.arrivals = np.empty(ARRIVALS_KEPT, dtype=np.float64)
        self.head = 0  # next slot to write
        self.size = 0
        self.arrived = 0
        self.answered = 0
        self.late = 0
        self.failed = 0
        self.refused = 0
        self.samples_by_model: Counter[str] = Counter()
        self.window_since_s = now_s
        self.window_arrivals = 0
        self.latencies: list[float] = []
        self.correct = 0
        self.labelled = 0


class Observations:
    """Per-app arrivals, windows and counters (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._apps: dict[str, _App] = {}

    def _app(self, app: str, now_s: float) -> _App:
        found = self._apps.get(app)
        if found is None:
            found = self._apps[app] = _App(now_s)
        return found

    # --- what the loop reports ----------------------------------------------------------------

    def arrival(self, app: str, now_s: float) -> None:
        with self._lock:
            entry = self._app(app, now_s)
            entry.arrivals[entry.head] = now_s
            entry.head = (entry.head + 1) % ARRIVALS_KEPT
            entry.size = min(entry.size + 1, ARRIVALS_KEPT)
            entry.arrived += 1
            entry.window_arrivals += 1

    def answered(
        self,
        app: str,
        now_s: float,
        latency_ms: float,
        *,
        late: bool,
        models: Iterable[str],
        correct: int = 0,
        labelled: int = 0,
    ) -> None:
        with self._lock:
            entry = self._app(app, now_s)
            entry.answered += 1
            entry.late += int(late)
            entry.samples_by_model.update(models)
            entry.correct += correct
            entry.labelled += labelled
            latencies = entry.latencies
            latencies.append(latency_ms)
            if len(latencies) > MAX_WINDOW_LATENCIES:
                del latencies[::2]

    def failed(self, app: str, now_s: float) -> None:
        with self._lock:
            self._app(app, now_s).failed += 1

    def refused(self, app: str, now_s: float) -> None:
        with self._lock:
            self._app(app, now_s).refused += 1

    # --- what the tuner, the roll-up and /metrics read -----------------------------------------

    def arrival_s(self, app: str) -> np.ndarray:
        """The kept arrival times of ``app``, oldest first (empty when it had none)."""
        with self._lock:
            entry = self._apps.get(app)
            if entry is None or entry.size == 0:
                return np.empty(0, dtype=np.float64)
            if entry.size < ARRIVALS_KEPT:
                return entry.arrivals[: entry.size].copy()
            return np.concatenate((entry.arrivals[entry.head :], entry.arrivals[: entry.head]))

    def rate_qps(self, app: str, now_s: float, window_s: float) -> float:
        """Arrivals per second over the last ``window_s`` (CascadeServe's measured QPS)."""
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        arrivals = self.arrival_s(app)
        recent = arrivals.size - int(np.searchsorted(arrivals, now_s - window_s, side="right"))
        return recent / window_s

    def take_window(
        self, app: str, now_s: float, slo_ms: float, gear: str | None = None
    ) -> WindowSummary | None:
        """The summary of ``app``'s window since the last call (None when the loop never saw
        the app), and a new window from ``now_s``."""
        with self._lock:
            entry = self._apps.get(app)
            if entry is None:
                return None
            latencies, entry.latencies = entry.latencies, []
            arrivals, entry.window_arrivals = entry.window_arrivals, 0
            correct, labelled = entry.correct, entry.labelled
            entry.correct = entry.labelled = 0
            elapsed = now_s - entry.window_since_s
            entry.window_since_s = now_s
        return summarise(
            latencies, slo_ms, arrivals, elapsed, correct=correct, labelled=labelled, gear=gear
        )

    def totals(self) -> dict[str, AppTotals]:
        with self._lock:
            return {
                app: AppTotals(
                    arrived=e.arrived,
                    answered=e.answered,
                    late=e.late,
                    failed=e.failed,
                    refused=e.refused,
                    samples_by_model=dict(e.samples_by_model),
                )
                for app, e in sorted(self._apps.items())
            }

    def apps(self) -> list[str]:
        with self._lock:
            return sorted(self._apps)
