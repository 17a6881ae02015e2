"""Time, injected: the :class:`Clock` seam, the system clock, and a fake clock for tests.

Policies never read the time themselves (STYLE.md): the composition root hands them a
:class:`Clock`. ``now_s`` is monotonic seconds, for durations and deadlines (it never jumps when
the wall clock is set); ``utcnow`` is the aware UTC wall time, for what is stored and shown.

>>> clock = FakeClock(start_s=100.0)
>>> clock.advance(2.5)
>>> clock.now_s()
102.5
>>> clock.utcnow().isoformat()
'2024-01-01T00:00:02.500000+00:00'
"""

from __future__ import annotations

import math
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

__all__ = ["FAKE_EPOCH", "Clock", "FakeClock", "SystemClock"]

# Where a FakeClock's wall time starts unless told otherwise: a fixed instant keeps tests
# reproducible.
FAKE_EPOCH = datetime(2024, 1, 1, tzinfo=UTC)


@runtime_checkable
class Clock(Protocol):
    """Where the time comes from."""

    def now_s(self) -> float:
        """Monotonic seconds (an arbitrary origin; only differences mean something)."""
        ...

    def utcnow(self) -> datetime:
        """The wall time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The machine's clocks: ``time.monotonic`` and ``datetime.now(UTC)``."""

    def now_s(self) -> float:
        return time.monotonic()

    def utcnow(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock that moves only when told to (:meth:`advance`, :meth:`set_s`); thread-safe.

    The wall time moves with the monotonic time: ``utcnow() = start_utc + (now_s() - start_s)``.
    """

    def __init__(self, start_s: float = 0.0, start_utc: datetime = FAKE_EPOCH) -> None:
        if not math.isfinite(start_s):
            raise ValueError(f"start_s must be finite, got {start_s!r}")
        if start_utc.tzinfo is None:
            raise ValueError("start_utc must be timezone-aware")
        self._start_s = start_s
        self._start_utc = start_utc.astimezone(UTC)
        self._now_s = start_s
        self._lock = threading.Lock()

    def now_s(self) -> float:
        with self._lock:
            return self._now_s

    def utcnow(self) -> datetime:
        with self._lock:
            return self._start_utc + timedelta(seconds=self._now_s - self._start_s)

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0: a monotonic clock never goes back)."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"a clock advances by a finite number of seconds >= 0, got {seconds!r}"
            )
        with self._lock:
            self._now_s += seconds

    def set_s(self, now_s: float) -> None:
        """Move the clock forward to ``now_s`` (not before the current time)."""
        with self._lock:
            if not math.isfinite(now_s) or now_s < self._now_s:
                raise ValueError(f"a clock cannot go back from {self._now_s!r} to {now_s!r}")
            self._now_s = now_s
