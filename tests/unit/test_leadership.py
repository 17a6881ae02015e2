"""The leader lease (``controlplane.loops.leadership``) over a fake lock: who leads, when the jobs
start and stop, and the fence that keeps a replica that lost its lock from running a job.

:class:`FakeLockServer` plays PostgreSQL's part: one session-level lock, held by at most one
session, released when the session ends (``kill``: the process died, its connection closed).
Everything is driven round by round with :meth:`Leadership.step`; nothing waits on a clock.
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from controlplane.loops.leadership import Leadership, SoleLock
from controlplane.loops.scheduler import JobBodies, Scheduler, service_schedule
from controlplane.settings import Settings


class FakeLockServer:
    """One advisory lock shared by the sessions opened on it."""

    def __init__(self) -> None:
        self.holder: FakeLock | None = None
        self.reachable = True


class FakeLock:
    """A replica's lock connection to a :class:`FakeLockServer` (a :class:`LeaderLock`)."""

    def __init__(self, server: FakeLockServer) -> None:
        self.server = server
        self.connected = False
        self.tries = 0
        self.checks = 0
        self.releases = 0

    def try_acquire(self) -> bool:
        self.tries += 1
        if not self.server.reachable:
            self.connected = False
            return False
        self.connected = True
        if self.server.holder is None:
            self.server.holder = self
        return self.server.holder is self

    def check(self) -> bool:
        self.checks += 1
        if self.server.holder is not self:
            return False
        if not (self.connected and self.server.reachable):
            self.drop()
            return False
        return True

    def release(self) -> None:
        self.releases += 1
        self.drop()

    def drop(self) -> None:
        """The session ends (closed, or the server saw the connection go): the lock is free."""
        self.connected = False
        if self.server.holder is self:
            self.server.holder = None


class FakeJobs:
    """Records what the lease asked of the jobs."""

    def __init__(self) -> None:
        self.running = False
        self.calls: list[str] = []

    def start(self) -> None:
        self.running = True
        self.calls.append("start")

    def shutdown(self, wait: bool = True) -> None:
        self.running = False
        self.calls.append(f"shutdown(wait={wait})")


def replica(server: FakeLockServer) -> tuple[Leadership, FakeLock, FakeJobs]:
    lock = FakeLock(server)
    return Leadership(lock), lock, FakeJobs()


def test_of_two_replicas_exactly_one_leads_and_the_other_takes_over_when_it_dies() -> None:
    server = FakeLockServer()
    (a, a_lock, a_jobs), (b, b_lock, b_jobs) = replica(server), replica(server)
    assert a.step(a_jobs) == "leader"
    assert b.step(b_jobs) == "standby"
    for _ in range(3):
        assert (a.step(), b.step()) == ("leader", "standby")
    assert a_jobs.calls == ["start"] and b_jobs.calls == []
    assert a_lock.checks == 3 and b_lock.tries == 4

    a_lock.drop()  # kill -9: the connection closes, PostgreSQL ends the session
    assert b.step() == "leader"
    assert b_jobs.calls == ["start"] and b_jobs.running
    assert (a.role, b.role) == ("leader", "leader")  # a is dead; it learns only if it runs again
    assert a.step() == "standby"  # ...and then it stops its jobs at its next round
    assert a_jobs.calls == ["start", "shutdown(wait=False)"] and not a_jobs.running
    assert b.terms == 1 and a.terms == 1


def test_a_leader_that_loses_its_connection_stops_the_jobs_and_tries_again() -> None:
    server = FakeLockServer()
    lease, lock, jobs = replica(server)
    assert lease.step(jobs) == "leader"
    server.reachable = False
    assert lease.step() == "standby"
    assert jobs.calls == ["start", "shutdown(wait=False)"]
    assert lock.releases == 1 and server.holder is None
    assert lease.step() == "standby"  # still unreachable: it keeps trying
    server.reachable = True
    assert lease.step() == "leader"
    assert jobs.calls[-1] == "start" and lease.terms == 2


def test_the_fence_runs_a_job_only_while_the_lock_answers_and_demotes_at_once() -> None:
    server = FakeLockServer()
    lease, lock, jobs = replica(server)
    ran: list[str] = []
    bodies = lease.fence(
        JobBodies(
            tuner_tick=lambda: ran.append("tuner_tick"),
            reconcile=lambda: ran.append("reconcile"),
            rollup=lambda: ran.append("rollup"),
        )
    )
    bodies.reconcile()
    assert ran == []  # a replica that never took the lock runs nothing
    assert lease.step(jobs) == "leader"
    bodies.reconcile()
    bodies.rollup()
    assert ran == ["reconcile", "rollup"]

    lock.connected = False  # the connection broke between two rounds
    bodies.tuner_tick()
    assert ran == ["reconcile", "rollup"]
    assert lease.role == "standby"  # without waiting for the next round
    assert jobs.calls == ["start", "shutdown(wait=False)"] and server.holder is None


def test_jobs_that_cannot_start_give_the_lease_back() -> None:
    server = FakeLockServer()
    lease, lock, _ = replica(server)

    class Broken(FakeJobs):
        def start(self) -> None:
            raise RuntimeError("no threads left")

    assert lease.step(Broken()) == "standby"
    assert server.holder is None and lock.releases == 1
    other, _, other_jobs = replica(server)
    assert other.step(other_jobs) == "leader"


def test_stop_waits_for_the_jobs_and_releases_the_lock() -> None:
    server = FakeLockServer()
    lease, lock, jobs = replica(server)
    lease.start(jobs)  # the first round is taken at once: a free lock is taken before serving
    try:
        assert lease.role == "leader" and jobs.calls == ["start"]
    finally:
        lease.stop()
    assert lease.role == "standby" and jobs.calls == ["start", "shutdown(wait=True)"]
    assert server.holder is None
    with pytest.raises(ValueError, match="try_every_s"):
        Leadership(lock, try_every_s=0)


def test_the_lease_thread_takes_over_when_the_lock_frees() -> None:
    server = FakeLockServer()
    holder = FakeLock(server)
    assert holder.try_acquire()
    lock, jobs = FakeLock(server), FakeJobs()
    lease = Leadership(lock, try_every_s=0.01)
    lease.start(jobs)
    try:
        assert lease.role == "standby"
        holder.drop()
        deadline = time.monotonic() + 30.0
        while lease.role != "leader" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lease.role == "leader" and jobs.calls == ["start"]
    finally:
        lease.stop()


def test_a_lone_replica_leads_the_real_scheduler_and_its_fenced_jobs_run() -> None:
    ran = threading.Event()
    lease = Leadership(SoleLock())
    bodies = lease.fence(JobBodies(rollup=ran.set))
    scheduler = Scheduler(service_schedule(Settings(), bodies))
    lease.start(scheduler)
    try:
        assert lease.role == "leader" and scheduler.running
        assert scheduler.jobs["rollup"]() == "ran" and ran.is_set()
    finally:
        lease.stop()
    assert not scheduler.running


class KeptFake:
    """What KeptLock asks of an advisory lock: its session answers or not, and a try is
    refused (another session holds it) or cannot reach the database."""

    def __init__(self) -> None:
        self.alive = True
        self.other_holds = False

    @property
    def refused(self) -> bool:
        return self.other_holds

    def check(self) -> bool:
        return self.alive

    def try_acquire(self) -> bool:
        return self.alive and not self.other_holds


def test_a_kept_lock_lost_to_another_holder_calls_on_lost_once_and_an_outage_does_not() -> None:
    from controlplane.db.lease import KeptLock

    fake = KeptFake()
    lost: list[str] = []
    kept = KeptLock(cast(Any, fake), 60.0, "the serving lock", on_lost=lambda: lost.append("x"))
    kept._check()
    assert lost == []
    fake.alive = False  # the database does not answer: not a loss, tried again next round
    kept._check()
    assert lost == []
    fake.other_holds = True  # this one was frozen; another serving process took the lock
    kept._check()
    kept._check()
    assert lost == ["x"]


def test_a_standby_says_what_it_serves(caplog: pytest.LogCaptureFixture) -> None:
    """A loops process running apart serves no inference: its standby line says so."""
    import logging

    server = FakeLockServer()
    first, first_jobs = Leadership(FakeLock(server)), FakeJobs()
    loops = Leadership(FakeLock(server), serves="the API (no inference: a loops process)")
    assert first.step(first_jobs) == "leader"
    with caplog.at_level(logging.INFO, logger="controlplane.loops.leadership"):
        loops.start(FakeJobs())
    try:
        (line,) = [r.getMessage() for r in caplog.records if "standby" in r.getMessage()]
        assert "serving the API (no inference: a loops process)" in line, line
    finally:
        loops.stop()


def test_a_lock_that_cannot_reach_the_database_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A standby tries the lease every 2 s: with the database down it logged "cannot reach" at
    every try, 1,800 identical lines an hour a loops process."""
    import logging
    from socket import socket

    from controlplane.db.lease import AdvisoryLock

    pytest.importorskip("psycopg")
    with socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        lock = AdvisoryLock(f"postgresql+psycopg://heteroplane:secret@127.0.0.1:{port}/hp")
        with caplog.at_level(logging.INFO, logger="controlplane.db.lease"):
            assert not any(lock.try_acquire() for _ in range(3))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("leader lock: cannot reach"), said
    assert "secret" not in said[0]


def test_an_unreachable_database_says_so_at_the_migrations_lock() -> None:
    """The first thing a service does with a PostgreSQL database is to take the migrations'
    lock: where the server does not answer, the line says the database is unreachable (it said
    "cannot lock ... for migrating")."""
    from socket import socket

    from controlplane.db.lease import migration_lock
    from controlplane.errors import DatabaseError

    pytest.importorskip("psycopg")
    with socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg://heteroplane:secret@127.0.0.1:{port}/hp"
    with pytest.raises(DatabaseError) as caught, migration_lock(url):
        pass  # pragma: no cover
    message = str(caught.value)
    assert message.startswith(
        f"cannot reach the database postgresql+psycopg://heteroplane:***@127.0.0.1:{port}/hp"
    )
    assert "secret" not in message
