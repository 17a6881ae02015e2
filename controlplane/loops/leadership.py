"""Which replica runs the periodic jobs: the leader lease and the fence around every job.

Any number of ``heteroplane serve`` replicas may run on one PostgreSQL database. All of them serve
the API and inference; one, the *leader*, also runs the scheduler's jobs (the tuner tick with the
gear switcher and the calibration, the reconcile tick with the capacity replanner, the roll-up,
the re-planning on recorded traffic):
everything that launches or drains instances or writes decisions on a timer. The lease is a
:class:`LeaderLock` (:class:`controlplane.db.lease.AdvisoryLock` on PostgreSQL: a session-level
advisory lock that PostgreSQL releases when the holder's connection ends; :class:`SoleLock` on
SQLite, which serves one replica).

:class:`Leadership` is the state machine, one :meth:`~Leadership.step` per round (every
:data:`TRY_EVERY_S` on a thread of its own):

=========  ==========================================  =========================================
role       the step                                    then
=========  ==========================================  =========================================
standby    ``try_acquire()`` fails                     standby; try again next round
standby    ``try_acquire()`` succeeds                  leader: the jobs start
leader     ``check()`` succeeds (the lock's            leader
           connection answers)
leader     ``check()`` fails                           standby: the jobs stop at once (no new
                                                       run starts; a run in progress ends), the
                                                       lock is released; try again next round
=========  ==========================================  =========================================

The **fence** (:meth:`Leadership.fence`) wraps each job body: before every run it asks the lock
(``check()``, a round trip on the lock's connection), and a run that finds the lease lost does
not happen and demotes the replica at once, without waiting for the next round. What remains is
the window between a passed check and the end of that run (docs/service.md says why the
reconciler's idempotent launches make it harmless).

>>> class Jobs:
...     running = False
...     def start(self): self.running = True
...     def shutdown(self, wait=True): self.running = False
>>> lease, jobs = Leadership(SoleLock()), Jobs()
>>> lease.role, lease.step(jobs), jobs.running
('standby', 'leader', True)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Literal, Protocol

from controlplane.loops.scheduler import JobBodies, JobBody
from controlplane.repeating import Repeating

__all__ = [
    "TRY_EVERY_S",
    "Jobs",
    "LeaderLock",
    "Leadership",
    "Role",
    "SoleLock",
]

logger = logging.getLogger(__name__)

Role = Literal["leader", "standby"]

# How often a standby tries the lock and a leader checks it. A dead leader's lock is free as soon
# as PostgreSQL sees its connection close, so a standby takes over within one round of that.
TRY_EVERY_S = 2.0


class LeaderLock(Protocol):
    """The lease's lock (thread-safe): taken, checked and let go by one replica."""

    def try_acquire(self) -> bool:
        """Take the lock if it is free (or already ours); whether it is ours afterwards."""
        ...

    def check(self) -> bool:
        """Whether the lock is still ours (False also when it was never taken)."""
        ...

    def release(self) -> None:
        """Let the lock go (nothing when it is not ours)."""
        ...


class Jobs(Protocol):
    """What the lease starts and stops (:class:`~controlplane.loops.scheduler.Scheduler`)."""

    def start(self) -> None: ...
    def shutdown(self, wait: bool = True) -> None: ...


class SoleLock:
    """The lock of a replica that is alone by construction (SQLite: the database file's lock,
    :class:`controlplane.db.lease.SqliteFileLock`, already keeps a second process out)."""

    def try_acquire(self) -> bool:
        return True

    def check(self) -> bool:
        return True

    def release(self) -> None:
        return None


class Leadership:
    """The leader lease of one replica over ``lock`` (see the module docstring)."""

    def __init__(
        self,
        lock: LeaderLock,
        *,
        try_every_s: float = TRY_EVERY_S,
        serves: str = "the API and inference",
    ) -> None:
        if not try_every_s > 0:
            raise ValueError(f"try_every_s must be > 0, got {try_every_s!r}")
        self.lock = lock
        # What the replica serves while it stands by (its log line says it): a loops process
        # running apart serves the API without inference.
        self.serves = serves
        self.try_every_s = float(try_every_s)
        self._role: Role = "standby"
        self._jobs: Jobs | None = None
        self._mutex = threading.Lock()
        # The lease must outlive a bad round (a driver error not mapped by the lock).
        self._rounds = Repeating(self.step, self.try_every_s, "leader-lease", "leader lease")
        self._terms = 0

    @property
    def role(self) -> Role:
        # Read without the mutex: a round may hold it for a connect timeout, and /healthz must
        # answer meanwhile (an attribute read is atomic).
        return self._role

    @property
    def terms(self) -> int:
        """How many times this replica became leader."""
        return self._terms

    def step(self, jobs: Jobs | None = None) -> Role:
        """One round: a standby tries the lock, a leader checks it (``jobs``: what to start and
        stop; the ones given to :meth:`start` by default). The role after the round."""
        with self._mutex:
            if jobs is not None:
                self._jobs = jobs
            if self._role == "leader":
                if not self.lock.check():
                    self._demote_locked("its connection failed")
            elif self.lock.try_acquire():
                self._role = "leader"
                self._terms += 1
                logger.info("leader lease acquired: this replica runs the periodic jobs")
                if self._jobs is not None:
                    try:
                        self._jobs.start()
                    except Exception:
                        # Jobs that cannot run must not hold the lease from a replica that can.
                        logger.exception("the jobs did not start: leader lease released")
                        self._role = "standby"
                        self.lock.release()
            return self._role

    def holds(self) -> bool:
        """Whether this replica may run a job now: the lock answers that it is still ours. A
        leader whose lock does not is demoted at once (the fence)."""
        term = self._terms
        if self.lock.check():
            return True
        with self._mutex:
            # Only the term whose lock failed: a round may have demoted it and led again since.
            if self._role == "leader" and self._terms == term:
                self._demote_locked("a job's fence found it lost")
        return False

    def fence(self, bodies: JobBodies) -> JobBodies:
        """``bodies`` with each job run only while :meth:`holds` says the lease is ours."""
        changes = {
            field.name: self._fenced(field.name, getattr(bodies, field.name))
            for field in dataclasses.fields(bodies)
        }
        return dataclasses.replace(bodies, **changes)

    def _fenced(self, name: str, body: JobBody) -> JobBody:
        def fenced() -> None:
            if not self.holds():
                logger.info("scheduler job %s not run: this replica does not hold the lease", name)
                return
            body()

        fenced.__name__ = f"fenced_{getattr(body, '__name__', name)}"
        return fenced

    def start(self, jobs: Jobs) -> None:
        """Take one round now (a lone replica leads from the start), then one every
        ``try_every_s`` on a daemon thread until :meth:`stop`."""
        if self._rounds.running:
            raise RuntimeError("the leader lease is already running")
        if self.step(jobs) == "standby":
            logger.info(
                "standby: another replica holds the leader lease; serving %s, trying the lease"
                " every %g s",
                self.serves,
                self.try_every_s,
            )
        self._rounds.start()

    def stop(self) -> None:
        """Stop trying, stop the jobs (waiting for running ones), release the lock."""
        self._rounds.stop()
        with self._mutex:
            jobs = self._jobs
        if jobs is not None:
            # Not under the mutex: a running job's fence takes it.
            jobs.shutdown(wait=True)
        with self._mutex:
            self._role = "standby"
            self.lock.release()

    def _demote_locked(self, why: str) -> None:
        self._role = "standby"
        logger.error("leader lease lost (%s): the periodic jobs are stopped", why)
        if self._jobs is not None:
            # Without waiting: the caller may be a job, and APScheduler's wait would join it.
            self._jobs.shutdown(wait=False)
        self.lock.release()
