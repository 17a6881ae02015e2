"""Online calibration on live traffic: the profiles in use checked against the served batches.

This module owns :class:`ProfileCalibrator`, the composition of the calibration policy
(:func:`controlplane.policies.calibration.calibrate`) with the service: once per scheduler tick
(after the tuner's), for every app, it reads the batch service times the serving loop observed
per (model, instance type, batch size) (an injected :data:`BatchTimesSource`), compares them with
the app's resolved profile (already calibrated by the factors stored before), and on drift:

1. stores the new factor, the stored one times the observed / resolved ratio (the factor always
   relates to the profile file: ``Store.set_profile_scale``);
2. records a ``profile_drift`` decision (key ``model:instance_type``) with the resolved profile's
   and the observed mean service time per batch, the batches counted, the old and new factor;
3. tells the resolver to forget the app's factors (``invalidate``), so the live tuner, the gear
   switcher and the next plan preview resolve the calibrated profile;
4. forgets the observed batch times of that pair (``forget``): they were measured against the
   old profile, and the next decision waits for ``min_batches`` new ones;
5. tells whoever sizes the fleet (``resize``: the live tuner, which takes the calibrated service
   rates at its next tick).

A fine correction (the policy's ``fine``: a smaller miss the evidence is sure of) waits for the
rule's ``fine_persist_s`` after the first such verdict, reading the factor on every tick
meanwhile (a stall slows a window of batches together, and each tick's window would otherwise
be a new chance for one to pass); it is stored at the mean of those readings when that mean is
still off by more than ``fine_threshold``, and forgotten and resolved the same way, recorded as
a ``profile_calibrated`` decision, and does not re-size the fleet: the plans and their
predictions take it, the live tuner keeps the rates it set up with until they are off by more
than the threshold. So the tuner is told when the stored factor
has moved past the threshold from the one it last took (its base, the stored factor when this
loop first saw the pair), in one step or in several fine ones; that recalibration is recorded as
a ``profile_drift``.

The same pass measures the control plane's own overhead per query
(:func:`controlplane.policies.calibration.overhead_drift` over the queries' own times the serving
loop observed, the API's part and the dispatch lag, an injected :data:`ApiTimesSource`): when it
moved, it stores the new median (``Store.set_serving_overhead``), records a ``serving_overhead``
decision with both figures and has the resolver forget the app, so that the next plan adds the
measured figure to every query. With it, or alone when it moved by more than the rule's
threshold (and :data:`~controlplane.policies.calibration.CPU_FLOOR_MS`), it stores the serving
process's CPU per answered query (an injected :data:`CpuSource`), the service time of the queue
the planner puts in front of the workers (:func:`controlplane.policies.planner.front_waits_ms`).

While ``held`` says why (a profile run's worker on the serving workers' own host), a pass reads
neither: it drops the batch times and the service's own times kept meanwhile, which that
worker's contention slowed, so that nothing judged after the run rests on them.

The factors and the overhead are in the database, so a restarted service resolves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from controlplane.db.store import AppRecord, Store
from controlplane.db.store.decisions import Keyed
from controlplane.errors import ControlPlaneError, app_gone
from controlplane.policies.calibration import (
    OVERHEAD_QUANTILES,
    Calibration,
    CalibrationRule,
    calibrate,
    overhead_drift,
    serving_cpu_moved,
    spread_drift,
)
from controlplane.spec import ResolvedApp
from estimator.errors import EstimatorError
from estimator.profiles import LatencyProfile

__all__ = [
    "ApiTimesSource",
    "BatchTimesSource",
    "CpuSource",
    "Drift",
    "ForgetFn",
    "ProfileCalibrator",
]

logger = logging.getLogger(__name__)

BatchTimesSource = Callable[[str], Mapping[tuple[str, str], Mapping[int, Sequence[float]]]]
"""App name -> its observed batch service times: (model, instance type) -> batch size -> ms
(the serving loop's :meth:`~controlplane.serving.observations.Observations.batch_times_ms`)."""
ApiTimesSource = Callable[[str], Sequence[float]]
"""App name -> the own time (ms: the API's part and the dispatch lag) of its newest answered
queries (the serving loop's
:meth:`~controlplane.serving.observations.Observations.api_times_ms`)."""
CpuSource = Callable[[str, float], float | None]
"""(app name, now on the loops' clock) -> the serving process's CPU ms per answered query (the
serving loop's :meth:`~controlplane.serving.observations.Observations.serving_cpu_ms`; None:
not measured yet)."""
ForgetFn = Callable[[str, str, str], None]
"""(app, model, instance type) -> drop the observed batch times of that pair."""
ResolveFn = Callable[[AppRecord], ResolvedApp]
InvalidateFn = Callable[[str], None]

DRIFT_KIND = "profile_drift"
CALIBRATED_KIND = "profile_calibrated"
OVERHEAD_KIND = "serving_overhead"
SPREAD_KIND = "profile_spread"


@dataclass(slots=True)
class _Pending:
    """A fine correction waiting for its evidence to hold (:data:`~controlplane.policies.
    calibration.DEFAULT_FINE_PERSIST_S`): since when, and the sum and count of the factors read
    on its ticks."""

    since_s: float
    total: float = 0.0
    readings: int = 0


@dataclass(frozen=True, slots=True)
class Drift:
    """One recalibration: the policy's verdict, the factors before and after, and whether the
    fleet is re-sized for it (``resized``: a drift, or fine corrections past the threshold)."""

    app: str
    calibration: Calibration
    old_factor: float
    new_factor: float
    resized: bool = True


class ProfileCalibrator:
    """The calibration loop over every app the serving loop observes (module docstring).

    ``tick()`` is the scheduler's hook; the rule (``min_batches``, ``threshold``, the fine
    corrections') is the service's settings'. ``invalidate(app)`` is called on any change stored
    for the app (the resolvers forget it), ``resize(app)`` on a recalibration that re-sizes."""

    def __init__(
        self,
        store: Store,
        batch_times: BatchTimesSource,
        resolve: ResolveFn,
        invalidate: InvalidateFn,
        forget: ForgetFn,
        rule: CalibrationRule | None = None,
        api_times: ApiTimesSource | None = None,
        resize: InvalidateFn | None = None,
        clock_s: Callable[[], float] | None = None,
        serving_cpu: CpuSource | None = None,
        reading: Callable[[], AbstractContextManager[None]] | None = None,
        held: Callable[[], str | None] | None = None,
        forget_api_times: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        # Why the batch times and the service's own times are not read now (None: they are): a
        # profile run's workers on the serving workers' own host (the local provisioner) slow
        # their batches and the serving process, and a factor or an overhead judged on them
        # stayed after the run; the times of such a moment are dropped (forget_api_times).
        self._hold = held
        self._forget_api_times = forget_api_times
        # The block each pass reads the sources in (ServingObservations.holding): a serving
        # process apart is read once per app and pass, not once per figure.
        self._reading = contextlib.nullcontext if reading is None else reading
        self._serving_cpu = serving_cpu
        self._clock_s = time.monotonic if clock_s is None else clock_s
        # Per (app, model, instance type): a fine verdict not yet held for fine_persist_s.
        self._pending: dict[tuple[str, str, str], _Pending] = {}
        self._resize = resize
        # Per (app, model, instance type): the factor whoever sizes the fleet last took.
        self._base: dict[tuple[str, str, str], float] = {}
        self._api_times = api_times
        self._batch_times = batch_times
        self._resolve = resolve
        self._invalidate = invalidate
        self._forget = forget
        self._rule = rule if rule is not None else CalibrationRule()

    def tick(self, apps: Sequence[AppRecord] | None = None) -> list[Drift]:
        """One calibration pass over every app (``apps``, the tick's snapshot of the store's
        apps, else read now); the recalibrations it made."""
        made: list[Drift] = []
        held = None if self._hold is None else self._hold()
        if held is not None:
            logger.debug("calibration: the batch and own times are not read: %s", held)
        with self._reading():
            for app in self._store.list_apps() if apps is None else apps:
                try:
                    made.extend(self._tick_app(app, held))
                except (ControlPlaneError, EstimatorError, KeyError, ValueError) as error:
                    # An app whose spec no longer resolves keeps its profiles; the next tick
                    # retries.
                    # One deleted since the tick read the apps has nothing to say.
                    level = logging.DEBUG if app_gone(error) else logging.WARNING
                    logger.log(level, "calibration: %s skipped: %s", app.name, error)
        return made

    def _tick_app(self, app: AppRecord, held: str | None = None) -> list[Drift]:
        if held is None:
            overhead_moved = self._overhead(app.name)
            made, spread_moved = self._profiles(app)
        else:
            overhead_moved, made, spread_moved = False, [], False
            self._drop_batch_times(app.name)
            if self._forget_api_times is not None:
                self._forget_api_times(app.name)
        if made or overhead_moved or spread_moved:
            self._invalidate(app.name)
        if self._resize is not None and (overhead_moved or any(d.resized for d in made)):
            self._resize(app.name)
        return made

    def _overhead(self, app: str) -> bool:
        """Store ``app``'s measured overhead per query when it moved; whether it did."""
        if self._api_times is None:
            return False
        times = self._api_times(app)
        if not times:
            return False
        stored = self._store.get_serving_overhead(app)
        verdict = overhead_drift(
            None if stored is None else stored.overhead_ms,
            times,
            self._rule,
            () if stored is None else stored.quantiles_ms,
        )
        cpu_ms = None if self._serving_cpu is None else self._serving_cpu(app, self._clock_s())
        stored_cpu = None if stored is None else stored.cpu_ms
        overhead_moved = verdict.drift and verdict.observed_ms is not None
        if overhead_moved and verdict.observed_ms is not None:
            # The overhead moved: stored with the newest CPU figure (or the one stored).
            figures = (verdict.observed_ms, verdict.samples, verdict.quantiles_ms)
            cpu_ms = cpu_ms if cpu_ms is not None else stored_cpu
        elif (
            stored is not None
            and cpu_ms is not None
            and serving_cpu_moved(stored_cpu, cpu_ms, self._rule)
        ):
            # Only the CPU figure moved: the stored overhead stays.
            figures = (stored.overhead_ms, stored.samples, stored.quantiles_ms)
        else:
            return False
        overhead_ms, samples, quantiles_ms = figures
        said: Keyed
        if not overhead_moved:
            before_cpu = "none measured" if stored_cpu is None else f"{stored_cpu:.3f} ms before"
            said = (
                OVERHEAD_KIND,
                f"the serving process spends {cpu_ms:.3f} ms of CPU per answered query"
                f" ({before_cpu}): plans serve each query that long at the serving process, a"
                " queue of its own in front of the workers",
                {"cpu_ms": cpu_ms, "previous_cpu_ms": stored_cpu},
                "overhead",
            )
        else:
            before = "none measured" if stored is None else f"{stored.overhead_ms:.2f} ms before"
            p99_ms = quantiles_ms[OVERHEAD_QUANTILES.index(99.0)]
            said = (
                OVERHEAD_KIND,
                f"the control plane's own time per query (the API's part and the dispatch lag)"
                f" is {overhead_ms:.2f} ms at the median and {p99_ms:.2f} ms at p99 over"
                f" {samples} answered queries ({before}); plans add a draw from its"
                " distribution to every query"
                + (
                    ""
                    if cpu_ms is None
                    else f"; the serving process's CPU per query {cpu_ms:.3f} ms"
                ),
                {
                    "overhead_ms": overhead_ms,
                    "overhead_p99_ms": p99_ms,
                    "previous_ms": None if stored is None else stored.overhead_ms,
                    "queries": samples,
                    "cpu_ms": cpu_ms,
                },
                "overhead",
            )
        # Said in the write's transaction (a crash leaves both or neither).
        self._store.set_serving_overhead(
            app, overhead_ms, samples, quantiles_ms=quantiles_ms, cpu_ms=cpu_ms, said=said
        )
        return True

    def _drop_batch_times(self, app: str) -> None:
        """Forget ``app``'s observed batch times and the fine verdicts pending on them (taken
        while the calibration is held, they are not the workers' own speed)."""
        for model, instance_type in list(self._batch_times(app)):
            self._forget(app, model, instance_type)
            self._pending.pop((app, model, instance_type), None)

    def _profiles(self, app: AppRecord) -> tuple[list[Drift], bool]:
        """The recalibrations of ``app``'s profiles made now, and whether a spread was
        stored."""
        observed = self._batch_times(app.name)
        if not observed:
            return [], False
        resolved = self._resolve(app)
        stored = {
            (s.model, s.instance_type): s.factor for s in self._store.list_profile_scales(app.name)
        }
        made = []
        spread_moved = False
        for (model, instance_type), times in sorted(observed.items()):
            try:
                profile = resolved.profile(model, instance_type)
            except EstimatorError:
                continue  # a type the spec no longer names: nothing to calibrate
            spread_moved |= self._spread(app.name, profile, times)
            verdict = calibrate(profile, times, self._rule)
            key = (app.name, model, instance_type)
            readings = 1
            if verdict.drift:
                self._pending.pop(key, None)
            else:
                held = self._held(key, verdict)
                if held is None:
                    continue
                factor, readings = held
                verdict = dataclasses.replace(verdict, factor=factor, fine=True)
            old = stored.get((model, instance_type), 1.0)
            new = old * verdict.factor
            base = self._base.setdefault((app.name, model, instance_type), old)
            resized = verdict.drift or abs(new / base - 1.0) > self._rule.threshold
            if resized:
                self._base[(app.name, model, instance_type)] = new
            what = (
                "profile scaled by"
                if verdict.drift
                else f"held over {readings} readings, a fine correction by their mean:"
                " profile scaled by"
            )
            # Said in the write's transaction (a crash leaves both or neither).
            self._store.set_profile_scale(
                app.name,
                model,
                instance_type,
                new,
                said=(
                    DRIFT_KIND if resized else CALIBRATED_KIND,
                    f"{model} on {instance_type}: {verdict.observed_mean_ms:.1f} ms per batch"
                    f" observed over {verdict.batches} batches, the profile says"
                    f" {verdict.profile_mean_ms:.1f} ms; {what} {new:.3g}",
                    {
                        "model": model,
                        "instance_type": instance_type,
                        "profile_mean_ms": verdict.profile_mean_ms,
                        "observed_mean_ms": verdict.observed_mean_ms,
                        "batches": verdict.batches,
                        "ratio": verdict.factor,
                        "ratio_se": verdict.factor_se,
                        "readings": readings,
                        "old_factor": old,
                        "factor": new,
                    },
                    f"{model}:{instance_type}",
                ),
            )
            self._forget(app.name, model, instance_type)
            made.append(Drift(app.name, verdict, old, new, resized))
        return made, spread_moved

    def _held(self, key: tuple[str, str, str], verdict: Calibration) -> tuple[float, int] | None:
        """A fine correction's factor and readings once its evidence has held for the rule's
        ``fine_persist_s``: a fine verdict starts the wait; every tick meanwhile with enough
        batches reads the factor, whatever its verdict; at the end their mean is the factor when
        it is still off by more than ``fine_threshold`` (None until then, and None when the
        minute's mean is within it: a slow window, not a bias)."""
        now_s = self._clock_s()
        pending = self._pending.get(key)
        if pending is None:
            if not verdict.fine:
                return None
            pending = self._pending[key] = _Pending(now_s)
        if verdict.batches >= self._rule.fine_min_batches:
            pending.total += verdict.factor
            pending.readings += 1
        if now_s - pending.since_s < self._rule.fine_persist_s:
            return None
        del self._pending[key]
        if not pending.readings:
            return None
        mean = pending.total / pending.readings
        if abs(mean - 1.0) <= self._rule.fine_threshold:
            return None
        return mean, pending.readings

    def _spread(
        self, app: str, profile: LatencyProfile, times: Mapping[int, Sequence[float]]
    ) -> bool:
        """Store the observed round trips' shape for ``profile``'s pair when it is off the
        resolved profile's (:func:`~controlplane.policies.calibration.spread_drift`); whether
        it was stored. The fleet is not re-sized for it: the means did not move."""
        verdict = spread_drift(profile, times, self._rule)
        if not verdict.drift:
            return False
        model, instance_type = profile.model, profile.instance_type
        # Said in the write's transaction (a crash leaves both or neither).
        self._store.set_profile_spread(
            app,
            model,
            instance_type,
            verdict.quantiles,
            said=(
                SPREAD_KIND,
                f"{model} on {instance_type}: the slowest 5% of the round trips take"
                f" {verdict.observed_tail:.2f}x their mean over {verdict.batches} batches, the"
                f" profile's {verdict.profile_tail:.2f}x; plans take the observed spread",
                {
                    "model": model,
                    "instance_type": instance_type,
                    "observed_tail_over_mean": verdict.observed_tail,
                    "profile_tail_over_mean": verdict.profile_tail,
                    "batches": verdict.batches,
                },
                f"{model}:{instance_type}",
            ),
        )
        return True
