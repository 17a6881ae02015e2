"""The health of an app's workers as its dispatcher sees it: who is marked unhealthy and when,
who is probed, which failed queries are tried again, and who hears of a lost worker.

- **Failed calls** (:meth:`Health.call_failed`): only a failure of the call itself counts
  against a worker: no connection, a timeout, a broken connection, an answer that is not the
  protocol's, or a status by which the worker says it cannot serve (503 loading or stopping,
  404 a model it does not have: ``worker_fault``). Such a worker is unhealthy at once
  (:meth:`~controlplane.serving.workers.Worker.fail`, which sets its probe backoff). A worker
  that *answered* about the batch (its inputs refused: 400, 413, 422; its model raised: 500;
  :func:`~controlplane.serving.transport.answer_error`) stays healthy and in matching: one bad
  query must not take a worker out for the good ones (the dispatcher fails the queries at
  fault alone and sends the others again).
- **Retries** (:meth:`Health.retries`): a query of a failed batch is tried again on another
  worker while the failure was the worker's and it has had fewer than ``max_attempts`` tries;
  the dispatcher answers the others with an error (502). A timeout on a worker that still
  answers its probe was a slow batch, not the worker's failure: the dispatcher answers a query
  alone in it 504 instead (:meth:`AppDispatcher._failed
  <controlplane.serving.dispatcher.AppDispatcher>`).
- **Probes of the unhealthy** (:meth:`Health.due`, :meth:`Health.recover`): once its backoff is
  over, an unhealthy worker is probed (``GET /v2/health/ready``); one that answers 200 (and is
  still the app's) serves again, the others wait out a longer backoff. One whose agent answers
  that a batch is under way (:class:`~controlplane.serving.transport.WorkerBusy`: the slow
  batch that took it out still runs, and the agent runs one batch at a time) stays out, probed
  again after the same backoff: sent a batch now, that batch would wait and time out too. A
  server that does not say so (not the agent) comes back on its 200 as before.
- **Idle probes** (:meth:`Health.probe_idle`): a healthy worker that no call has reached for
  ``idle_probe_s`` must answer its probe too, so one that died while idle leaves matching
  (recorded like a failed call with nothing in flight) before a query is sent to it. One whose
  agent answers busy runs a batch this dispatcher did not send (a slow one, sent before a
  restart or a leader's failover): it leaves matching as busy, as above, and comes back once its
  agent is not. A worker that a batch reached meanwhile is left to that call's outcome.
- **Losses** (:meth:`Health.report`): a worker just marked unhealthy is logged and handed, as a
  :class:`WorkerLoss`, to ``on_unhealthy`` (the serving loop records it as an instance event).

A worker is probed by one probe at a time (``probing``). The dispatcher places its workers again
after any health change (:mod:`~controlplane.serving.placement`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controlplane.errors import WorkerCallError
from controlplane.serving.config import DispatcherSettings
from controlplane.serving.transport import WorkerBusy, WorkerTransport
from controlplane.serving.workers import Worker, WorkerEndpoint

__all__ = ["Health", "WorkerLoss"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerLoss:
    """A worker just marked unhealthy, and what became of the queries in flight on it then (the
    batch it held: a worker serves one at a time): ``redispatched_queries`` went back to the
    front of their stage's queue for another instance, ``failed_queries`` were answered with an
    error (their last attempt, or no healthy instance left to serve them)."""

    endpoint: WorkerEndpoint
    reason: str
    in_flight_queries: int
    redispatched_queries: int
    failed_queries: int


class Health:
    """The health bookkeeping of one app's workers (see the module docstring)."""

    __slots__ = ("app", "clock_s", "on_unhealthy", "settings", "transport")

    def __init__(
        self,
        app: str,
        transport: WorkerTransport,
        settings: DispatcherSettings,
        clock_s: Callable[[], float],
        on_unhealthy: Callable[[WorkerLoss], None] | None = None,
    ) -> None:
        self.app = app
        self.transport = transport
        self.settings = settings
        self.clock_s = clock_s
        self.on_unhealthy = on_unhealthy

    # --- failed calls ---------------------------------------------------------------------------

    def call_failed(self, worker: Worker, error: WorkerCallError, now_s: float) -> bool:
        """Record a failed call of ``worker``; whether it was lost by it (healthy until now,
        unhealthy from now). A call the worker answered (``worker_fault`` False: the batch's
        inputs refused, or its model raised) never loses it: it counts as a call that reached
        it (see the module docstring)."""
        if not error.worker_fault:
            if worker.healthy:
                worker.succeeded()
            return False
        reason = str(error)
        lost = worker.healthy
        if lost:
            worker.fail(now_s, reason)
        else:
            worker.last_error = reason
        return lost

    def retries(self, error: WorkerCallError, attempts: int) -> bool:
        """Whether a query whose ``attempts``-th try failed with ``error`` is tried again."""
        return error.worker_fault and attempts < self.settings.max_attempts

    def report(self, loss: WorkerLoss, *, idle: bool = False) -> None:
        """Log a lost worker and hand the loss to ``on_unhealthy``."""
        if idle:
            logger.warning(
                "%s: idle worker %s unhealthy: %s",
                self.app,
                loss.endpoint.instance_id,
                loss.reason,
            )
        else:
            logger.warning(
                "%s: worker %s unhealthy: %s; %d queries in flight on it, %d re-dispatched",
                self.app,
                loss.endpoint.instance_id,
                loss.reason,
                loss.in_flight_queries,
                loss.redispatched_queries,
            )
        if self.on_unhealthy is not None:
            self.on_unhealthy(loss)

    # --- probes ---------------------------------------------------------------------------------

    def due(self, workers: Mapping[str, Worker], now_s: float) -> list[Worker]:
        """The unhealthy workers whose backoff is over and that no probe is asking yet."""
        return [
            w for w in workers.values() if not w.healthy and not w.probing and w.retry_at_s <= now_s
        ]

    async def recover(
        self, due: Sequence[Worker], workers: Mapping[str, Worker], timeout_s: float
    ) -> list[Worker]:
        """Probe ``due``; those that answer ``ok`` and are still the app's (in ``workers``) are
        healthy again and returned, those whose agent says it is busy wait out the same backoff
        again, the others a longer one."""
        answers = await self._probe(due, timeout_s)
        now = self.clock_s()
        recovered = []
        for worker, answer in zip(due, answers, strict=True):
            if answer is True and workers.get(worker.instance_id) is worker:
                worker.recover(now)
                recovered.append(worker)
                logger.info("%s: worker %s healthy again", self.app, worker.instance_id)
            elif worker.healthy:
                continue
            elif isinstance(answer, WorkerBusy):
                worker.still_busy(now, answer.in_flight, answer.busy_s)
            else:
                reason = "" if worker.agent_busy else worker.last_error
                worker.fail(now, reason or "health probe failed")
        return recovered

    async def probe_idle(self, workers: Mapping[str, Worker], now_s: float) -> list[Worker]:
        """Probe the healthy workers idle for ``idle_probe_s`` (with the call timeout floor);
        those that do not answer are unhealthy from now and returned (see the module
        docstring)."""
        after_s = self.settings.idle_probe_s
        if after_s is None:
            return []
        idle = [
            w
            for w in workers.values()
            if w.healthy and not w.running and not w.probing and now_s - w.checked_s >= after_s
        ]
        if not idle:
            return []
        asked_s = now_s
        answers = await self._probe(idle, self.settings.call_timeout_floor_s)
        now = self.clock_s()
        lost = []
        for worker, answer in zip(idle, answers, strict=True):
            # A batch it took meanwhile (running now, or done: checked since) speaks for it.
            gone = workers.get(worker.instance_id) is not worker
            if gone or worker.running or worker.checked_s > asked_s:
                continue
            if answer is True:
                worker.checked_s = now
            elif isinstance(answer, WorkerBusy):
                # Alive, but busy with a batch this dispatcher did not send (it has none there:
                # a dispatcher before a restart or a failover sent it, a slow one): a batch sent
                # now would wait behind it and time out. Out while its agent says so, as after a
                # slow query of its own (probed at the same backoff, no failure counted).
                worker.fail(now, "busy with a batch this dispatcher did not send")
                worker.still_busy(now, answer.in_flight, answer.busy_s)
                lost.append(worker)
            elif worker.healthy:
                worker.fail(now, "health probe failed while idle")
                lost.append(worker)
        return lost

    async def _probe(self, workers: Sequence[Worker], timeout_s: float) -> list[bool | WorkerBusy]:
        """Whether each of ``workers`` answers its health probe (an exception, or anything but
        True or a :class:`~controlplane.serving.transport.WorkerBusy`, is a no); they are
        marked ``probing`` meanwhile, so that no other probe overlaps."""
        for worker in workers:
            worker.probing = True
        try:
            answers = await asyncio.gather(
                *(self.transport.health(w.address, timeout_s) for w in workers),
                return_exceptions=True,
            )
        finally:
            for worker in workers:
                worker.probing = False
        return [
            answer if answer is True or isinstance(answer, WorkerBusy) else False
            for answer in answers
        ]
