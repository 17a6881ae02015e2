"""The scheduler: a failing job is logged and the loop goes on; a job never overlaps itself.

Jobs are driven by calling their guarded wrapper directly: no sleeps, no timing assertions.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

import pytest

from controlplane.loops.scheduler import (
    APSCHEDULER_LOGGER,
    JOB_NAMES,
    GuardedJob,
    JobBodies,
    JobSchedule,
    Scheduler,
    service_schedule,
)


@dataclass(frozen=True)
class Intervals:
    tuner_tick_s: float = 1.0
    reconcile_s: float = 5.0
    rollup_s: float = 10.0
    replan_s: float = 60.0
    gear_interval_s: float = 0.1


def test_a_failing_job_is_logged_with_its_name_and_the_next_run_still_happens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    def flaky() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("database went away")

    job = GuardedJob("reconcile", flaky)
    with caplog.at_level(logging.ERROR, logger="controlplane.loops.scheduler"):
        assert job() == "failed"
    assert job() == "ran"
    assert calls == [0, 1]
    assert job.stats.failures == 1 and job.stats.runs == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "reconcile" in record.getMessage()
    assert record.exc_info is not None and "database went away" in str(record.exc_info[1])


def test_a_job_never_overlaps_itself() -> None:
    started, release = threading.Event(), threading.Event()
    entered: list[str] = []

    def slow() -> None:
        entered.append("run")
        started.set()
        assert release.wait(timeout=30)

    job = GuardedJob("tuner_tick", slow)
    outcomes: list[str] = []
    first = threading.Thread(target=lambda: outcomes.append(job()))
    first.start()
    assert started.wait(timeout=30)
    # The first run is blocked on the event: a second call, from this thread, is skipped.
    assert job() == "skipped"
    second = threading.Thread(target=lambda: outcomes.append(job()))
    second.start()
    second.join(timeout=30)
    assert outcomes == ["skipped"]
    release.set()
    first.join(timeout=30)
    assert outcomes == ["skipped", "ran"]
    assert entered == ["run"]
    assert job.stats.skips == 2 and job.stats.runs == 1
    # Once the first run is over, the next one runs again.
    assert job() == "ran"


def test_the_guard_is_released_after_a_failure() -> None:
    def boom() -> None:
        raise ValueError("bad")

    job = GuardedJob("reconcile", boom)
    assert job() == "failed"
    assert job() == "failed"
    assert job.stats.failures == 2 and job.stats.skips == 0


def test_base_exceptions_are_not_swallowed() -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    job = GuardedJob("rollup", interrupted)
    with pytest.raises(KeyboardInterrupt):
        job()
    # and the guard was released on the way out
    job.body = lambda: None
    assert job() == "ran"


def test_the_service_schedule_has_the_five_jobs_at_the_settings_periods() -> None:
    schedule = service_schedule(Intervals(rollup_s=30.0), JobBodies())
    assert [(job.name, job.interval_s) for job in schedule] == [
        ("tuner_tick", 1.0),
        ("reconcile", 5.0),
        ("rollup", 30.0),
        ("replan", 60.0),
        ("gears", 0.1),
    ]
    assert tuple(job.name for job in schedule) == JOB_NAMES


def test_default_bodies_do_nothing_and_log_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = Scheduler(service_schedule(Intervals(), JobBodies()))
    with caplog.at_level(logging.DEBUG, logger="controlplane.loops.scheduler"):
        for name in JOB_NAMES:
            assert scheduler.jobs[name]() == "ran"
    assert {name for name in JOB_NAMES if any(name in r.getMessage() for r in caplog.records)} == (
        set(JOB_NAMES)
    )


def test_a_body_is_replaced_by_one_field() -> None:
    ticks: list[str] = []
    bodies = dataclasses.replace(JobBodies(), tuner_tick=lambda: ticks.append("tick"))
    scheduler = Scheduler(service_schedule(Intervals(), bodies))
    scheduler.jobs["tuner_tick"]()
    assert ticks == ["tick"]


def test_start_registers_guarded_non_overlapping_jobs_and_shutdown_stops_cleanly() -> None:
    scheduler = Scheduler(service_schedule(Intervals(), JobBodies()))
    assert not scheduler.running
    scheduler.shutdown()  # not running: nothing to do
    scheduler.start()
    try:
        assert scheduler.running
        with pytest.raises(RuntimeError):
            scheduler.start()
        assert sorted(scheduler.scheduled()) == sorted(
            [
                ("tuner_tick", 1.0, 1, True),
                ("reconcile", 5.0, 1, True),
                ("rollup", 10.0, 1, True),
                ("replan", 60.0, 1, True),
                ("gears", 0.1, 1, True),
            ]
        )
    finally:
        scheduler.shutdown(wait=True)
    assert not scheduler.running
    assert scheduler.scheduled() == []
    # A stopped scheduler starts again (the service restarts in-process in tests).
    scheduler.start()
    scheduler.shutdown(wait=True)
    assert not scheduler.running


def test_apscheduler_skipped_run_warnings_are_debug_records_once_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run skipped because the previous one still goes is by design: not a warning on the
    user's stderr (APScheduler's own message, as its scheduler logs it); other warnings stay."""
    scheduler = Scheduler(service_schedule(Intervals(), JobBodies()))
    scheduler.start()
    scheduler.shutdown(wait=True)
    apscheduler = logging.getLogger(APSCHEDULER_LOGGER)
    skipped = 'Execution of job "%s" skipped: maximum number of running instances reached (%d)'
    with caplog.at_level(logging.WARNING, logger=APSCHEDULER_LOGGER):
        apscheduler.warning(skipped, "gears", 1)
        apscheduler.warning("Run time of job %s was missed", "gears")
    assert [r.getMessage() for r in caplog.records] == ["Run time of job gears was missed"]
    with caplog.at_level(logging.DEBUG, logger=APSCHEDULER_LOGGER):
        caplog.clear()
        apscheduler.warning(skipped, "gears", 1)
    assert [(r.levelname, "skipped" in r.getMessage()) for r in caplog.records] == [("DEBUG", True)]


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError):
        JobSchedule("x", lambda: None, 0.0)
    with pytest.raises(ValueError):
        Scheduler([JobSchedule("x", lambda: None, 1.0), JobSchedule("x", lambda: None, 2.0)])


def test_a_job_marked_at_start_runs_when_the_scheduler_starts() -> None:
    """The reconcile job runs at a (new) leader's start, not one period later: a loops
    process restarted after a budget cut left the fleet over the budget until then."""
    assert [job.name for job in service_schedule(Intervals(), JobBodies()) if job.at_start] == [
        "reconcile"
    ]
    ran = threading.Event()
    later: list[str] = []
    scheduler = Scheduler(
        [
            JobSchedule("now", ran.set, 3600.0, at_start=True),
            JobSchedule("later", lambda: later.append("ran"), 3600.0),
        ]
    )
    scheduler.start()
    try:
        assert ran.wait(timeout=30.0), "the at_start job did not run at the start"
        assert later == []  # the others' first run is one period (an hour) away
    finally:
        scheduler.shutdown(wait=True)
