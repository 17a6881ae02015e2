"""Bounded planning: a deadline and a cancel flag that long estimator work checks as it goes.

Planning at a large budget ranks many mixes and runs many simulations; a request must not hold a
thread for minutes, nor go on when its client has gone. The caller opens a :func:`limit` around
the work (a context variable, so it follows the work into the thread that runs it when the
context is copied, as ``asyncio.to_thread`` does, and does not leak to other requests); the hot
loops (the Kairos ranking's search, the planner between simulations) call :func:`check`, which
raises :class:`PlanningDeadlineError` past the deadline and :class:`PlanningCancelledError` once
the flag is set. Outside a :func:`limit`, :func:`check` does nothing.

>>> with limit(60.0):
...     check()  # well within the minute
>>> import threading
>>> flag = threading.Event()
>>> flag.set()
>>> with limit(60.0, flag):
...     check()
Traceback (most recent call last):
...
estimator.deadline.PlanningCancelledError: planning was cancelled (the client went away)
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from estimator.errors import EstimatorError

__all__ = ["PlanningCancelledError", "PlanningDeadlineError", "check", "limit"]


class PlanningDeadlineError(EstimatorError):
    """The work ran past its deadline."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(
            f"planning took longer than its deadline of {seconds:g} s: the budget affords more"
            " mixes than can be searched in time; cap the counts (max_counts) or lower the budget"
        )


class PlanningCancelledError(EstimatorError):
    """The work was cancelled (its client went away)."""

    def __init__(self) -> None:
        super().__init__("planning was cancelled (the client went away)")


@dataclass(frozen=True, slots=True)
class _Limit:
    seconds: float
    deadline_s: float  # on time.monotonic
    cancelled: threading.Event | None


_CURRENT: contextvars.ContextVar[_Limit | None] = contextvars.ContextVar(
    "heteroplane_planning_limit", default=None
)


@contextmanager
def limit(seconds: float | None, cancelled: threading.Event | None = None) -> Iterator[None]:
    """Bound the work inside to ``seconds`` (finite, > 0; None: no deadline) and to ``cancelled``
    not being set. Nested limits keep the earlier deadline."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be finite and > 0, got {seconds!r}")
    deadline = math.inf if seconds is None else time.monotonic() + seconds
    seconds = math.inf if seconds is None else seconds
    outer = _CURRENT.get()
    if outer is not None and outer.deadline_s < deadline:
        seconds, deadline = outer.seconds, outer.deadline_s
    if cancelled is None and outer is not None:
        cancelled = outer.cancelled
    token = _CURRENT.set(_Limit(seconds, deadline, cancelled))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def check() -> None:
    """Raise when the current limit's flag is set or its deadline has passed (no limit: no-op)."""
    current = _CURRENT.get()
    if current is None:
        return
    if current.cancelled is not None and current.cancelled.is_set():
        raise PlanningCancelledError
    if time.monotonic() > current.deadline_s:
        raise PlanningDeadlineError(current.seconds)
