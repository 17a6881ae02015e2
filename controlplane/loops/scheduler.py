"""The service's periodic jobs: the tuner tick, reconcile, the metric roll-up, the replan and the
gear switcher.

This module owns *when* the jobs run and how a run is guarded, not what a job does: the bodies
are plain callables handed in by the composition root (:class:`JobBodies`: it plugs in the
tuner, the reconciler, the roll-up and the traffic replanner by replacing one field each). The
``replan`` job re-plans apps whose traffic has left their plan's envelope for good
(``controlplane.loops.traffic_replan``; idle when ``replan_enabled`` is off); the ``gears`` job
is CascadeServe's producer, which evaluates the gear of every app served by gears every
``gear_interval_s`` (0.1 s) on state the tuner tick refreshes (``controlplane.loops.live_gears``);
the capacity
replanner runs inside the reconcile job, after the reconciler's tick
(``controlplane.service.build``). The loop is APScheduler 3.x's
``BackgroundScheduler`` (a thread pool); every job is registered with ``max_instances=1`` and
``coalesce=True``, so a job that overruns its interval is neither run twice at once nor replayed
once per missed tick, and each body is wrapped in a :class:`GuardedJob` that

- never overlaps itself, even when called directly (a test, an operator's "run now"): a call
  that finds the previous run still going is skipped, not queued (APScheduler's
  ``max_instances=1`` guards only the runs its scheduler starts, so it is not enough alone);
- logs a failure with the job's name and traceback and returns, so the next run still happens
  (an exception that escaped would only be logged by APScheduler, without our job name).

>>> job = GuardedJob("demo", lambda: None)
>>> job()
'ran'
>>> job.stats.runs
1
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Literal, Protocol

from apscheduler.schedulers.background import BackgroundScheduler

__all__ = [
    "APSCHEDULER_LOGGER",
    "JOB_NAMES",
    "GuardedJob",
    "JobBodies",
    "JobBody",
    "JobSchedule",
    "JobStats",
    "Scheduler",
    "SchedulerIntervals",
    "SkippedRunsAtDebug",
    "service_schedule",
]

logger = logging.getLogger(__name__)

JobBody = Callable[[], None]
Outcome = Literal["ran", "failed", "skipped"]

JOB_NAMES = ("tuner_tick", "reconcile", "rollup", "replan", "gears")


def _idle(name: str) -> JobBody:
    def body() -> None:
        logger.debug("scheduler job %s: nothing to do yet", name)

    body.__name__ = f"idle_{name}"
    return body


_IDLE = MappingProxyType({name: _idle(name) for name in JOB_NAMES})


@dataclass(frozen=True, slots=True)
class JobBodies:
    """What each periodic job does; replace a field (``dataclasses.replace``) to plug one in.

    The defaults do nothing but log at debug (what a job does where nothing is plugged in: a
    service built without a reconciler or a serving loop, the replan job with ``replan_enabled``
    off, a test).
    """

    tuner_tick: JobBody = _IDLE["tuner_tick"]
    reconcile: JobBody = _IDLE["reconcile"]
    rollup: JobBody = _IDLE["rollup"]
    replan: JobBody = _IDLE["replan"]
    gears: JobBody = _IDLE["gears"]


@dataclass(frozen=True, slots=True)
class JobStats:
    """How often a job ran to the end, failed, or was skipped because it was still running."""

    runs: int = 0
    failures: int = 0
    skips: int = 0


class SkippedRunsAtDebug(logging.Filter):
    """APScheduler warns each time it skips a run because the job's previous run still goes
    (``max_instances=1``, by design; :class:`GuardedJob` counts them as skips): on a busy machine
    that is a warning a second on the user's stderr. This filter, on APScheduler's scheduler
    logger, turns those records into debug records (dropped unless that logger logs debug)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "maximum number of running instances" not in str(record.msg):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_SKIPPED_RUNS = SkippedRunsAtDebug()
APSCHEDULER_LOGGER = "apscheduler.scheduler"


class GuardedJob:
    """A job body that never overlaps itself and whose failures are logged, not raised."""

    def __init__(self, name: str, body: JobBody) -> None:
        self.name = name
        self.body = body
        self._running = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = JobStats()

    @property
    def stats(self) -> JobStats:
        with self._stats_lock:
            return self._stats

    def _count(self, outcome: Outcome) -> None:
        with self._stats_lock:
            s = self._stats
            self._stats = JobStats(
                runs=s.runs + (outcome == "ran"),
                failures=s.failures + (outcome == "failed"),
                skips=s.skips + (outcome == "skipped"),
            )

    def __call__(self) -> Outcome:
        """Run the body once, unless a run is already going; say what happened."""
        if not self._running.acquire(blocking=False):
            logger.info("scheduler job %s skipped: the previous run is still going", self.name)
            self._count("skipped")
            return "skipped"
        try:
            self.body()
        except Exception:
            # The loop must outlive a bad run: log it with the job's name and go on.
            logger.exception("scheduler job %s failed", self.name)
            self._count("failed")
            return "failed"
        finally:
            self._running.release()
        self._count("ran")
        return "ran"


@dataclass(frozen=True, slots=True)
class JobSchedule:
    """A job's name, body and period; ``at_start``: its first run is at the start, not one
    period later."""

    name: str
    body: JobBody
    interval_s: float
    at_start: bool = False

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"job {self.name}: interval_s must be > 0, got {self.interval_s!r}")


class SchedulerIntervals(Protocol):
    """The periods of the service's jobs (``controlplane.settings.Settings`` has them)."""

    @property
    def tuner_tick_s(self) -> float: ...
    @property
    def reconcile_s(self) -> float: ...
    @property
    def rollup_s(self) -> float: ...
    @property
    def replan_s(self) -> float: ...
    @property
    def gear_interval_s(self) -> float: ...


def service_schedule(intervals: SchedulerIntervals, bodies: JobBodies) -> list[JobSchedule]:
    """The service's five jobs with their periods from the settings."""
    return [
        JobSchedule("tuner_tick", bodies.tuner_tick, intervals.tuner_tick_s),
        # At the start too: a leader that has just taken over (a loops process restarted
        # after a budget cut, a failover) enforces the budget and the fleet at once, where the
        # first run one period later left a fleet over a lowered budget for 8.8 s.
        JobSchedule("reconcile", bodies.reconcile, intervals.reconcile_s, at_start=True),
        JobSchedule("rollup", bodies.rollup, intervals.rollup_s),
        JobSchedule("replan", bodies.replan, intervals.replan_s),
        JobSchedule("gears", bodies.gears, intervals.gear_interval_s),
    ]


class Scheduler:
    """Periodic jobs on a ``BackgroundScheduler``; :meth:`start` and :meth:`shutdown` once each
    per run of the service (a stopped scheduler may be started again)."""

    def __init__(self, schedule: Sequence[JobSchedule]) -> None:
        names = [job.name for job in schedule]
        if len(set(names)) != len(names):
            raise ValueError(f"job names must be unique, got {names}")
        self._schedule = tuple(schedule)
        self._jobs = MappingProxyType(
            {job.name: GuardedJob(job.name, job.body) for job in schedule}
        )
        self._lock = threading.Lock()
        self._loop: BackgroundScheduler | None = None

    @property
    def jobs(self) -> Mapping[str, GuardedJob]:
        """The guarded jobs by name (call one to run it now; it still never overlaps itself)."""
        return self._jobs

    @property
    def running(self) -> bool:
        with self._lock:
            return self._loop is not None

    def start(self) -> None:
        """Start the loop in background threads; the first run of each job is one period away,
        but for the jobs to run at the start (:attr:`JobSchedule.at_start`), which run now."""
        with self._lock:
            if self._loop is not None:
                raise RuntimeError("the scheduler is already running")
            logging.getLogger(APSCHEDULER_LOGGER).addFilter(_SKIPPED_RUNS)  # once: same object
            loop = BackgroundScheduler(timezone="UTC")
            for job in self._schedule:
                loop.add_job(
                    self._jobs[job.name],
                    trigger="interval",
                    seconds=job.interval_s,
                    id=job.name,
                    name=job.name,
                    max_instances=1,
                    coalesce=True,
                    # A run that starts late (a busy pool, a suspended host) still runs, once.
                    misfire_grace_time=None,
                    **({"next_run_time": datetime.now(UTC)} if job.at_start else {}),
                )
            loop.start()
            self._loop = loop
            logger.info("scheduler started: %s", ", ".join(self.describe()))

    def describe(self) -> list[str]:
        """One ``name every N s`` per job."""
        return [f"{job.name} every {job.interval_s:g} s" for job in self._schedule]

    def shutdown(self, wait: bool = True) -> None:
        """Stop the loop; with ``wait``, return only after the running jobs have finished.
        Does nothing when the scheduler is not running."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.shutdown(wait=wait)
            logger.info("scheduler stopped")

    def scheduled(self) -> list[tuple[str, float, int, bool]]:
        """``(name, interval_s, max_instances, coalesce)`` of each job the loop holds (empty
        when not running): what was registered, for tests and the health page."""
        with self._lock:
            loop = self._loop
            if loop is None:
                return []
            return [
                (
                    job.id,
                    float(job.trigger.interval.total_seconds()),
                    int(job.max_instances),
                    bool(job.coalesce),
                )
                for job in loop.get_jobs()
            ]
